"""The notebooks: every one runs top to bottom on the simulator, and each pair agrees.

notebooks/NN_name.py (jupytext py:percent) is the source people edit and review;
notebooks/NN_name.ipynb is what GitHub and Jupyter open. Here:

* ``test_pair_in_sync``: the .ipynb has the same cells (type and source) as the .py, says
  it is paired with it, and stores no error outputs. Fix a failure with
  ``python scripts/notebooks.py sync`` (or ``execute``, which also refreshes the outputs).
* ``test_notebook_runs``: a fresh Jupyter kernel runs the .py's cells in order, with
  NUMBA_ENABLE_CUDASIM=1 in the kernel's environment, so the kernels run on the
  simulator. One test per notebook, so pytest-xdist spreads them over processes.
  Any cell that raises fails the test, including an exercise's checking cell.

Notebooks that need a GPU go in GPU_ONLY; they are still checked for sync.
"""

import importlib.util
import os
import time
from pathlib import Path

import jupytext
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
SOURCES = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.py"))
# stems of notebooks that cannot run on the simulator: one list, in scripts/notebooks.py
_spec = importlib.util.spec_from_file_location("nb_script", ROOT / "scripts" / "notebooks.py")
_nb_script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_nb_script)
GPU_ONLY = _nb_script.GPU_ONLY
CELL_TIMEOUT_S = 600


def _cells(nb):
    return [(c.cell_type, c.source.strip()) for c in nb.cells]


def test_there_are_notebooks():
    assert SOURCES, f"no notebooks found in {NOTEBOOKS}"


def test_every_ipynb_has_a_source():
    orphans = [p.name for p in NOTEBOOKS.glob("*.ipynb") if not p.with_suffix(".py").exists()]
    assert not orphans, f"notebooks without a .py source: {orphans}"


@pytest.mark.parametrize("py", SOURCES, ids=[p.stem for p in SOURCES])
def test_pair_in_sync(py):
    ipynb = py.with_suffix(".ipynb")
    assert ipynb.exists(), f"{ipynb.name} is missing: run python scripts/notebooks.py sync"
    source, paired = jupytext.read(py), jupytext.read(ipynb)
    formats = paired.metadata.get("jupytext", {}).get("formats", "")
    assert "py:percent" in formats, f"{ipynb.name} is not paired with a py:percent file"
    assert _cells(paired) == _cells(source), (
        f"{ipynb.name} and {py.name} differ: run python scripts/notebooks.py sync")
    errors = [o for c in paired.cells for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors, f"{ipynb.name} stores an error output: {errors[0].get('ename')}"


@pytest.mark.parametrize("py", SOURCES, ids=[p.stem for p in SOURCES])
def test_notebook_runs(py, tmp_path, monkeypatch):
    if py.stem in GPU_ONLY:
        pytest.skip("needs a GPU")
    nb = jupytext.read(py)
    # Jupyter, IPython and matplotlib write their files under tmp_path, so the test needs
    # no writable home directory.
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               IPYTHONDIR=str(tmp_path / "ipython"), MPLCONFIGDIR=str(tmp_path / "mpl"))
    env.pop("MPLBACKEND", None)          # the inline backend, as in Jupyter
    client = NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOKS)}})
    t0 = time.perf_counter()
    client.execute(env=env)              # raises CellExecutionError naming the cell
    print(f"{py.name}: {time.perf_counter() - t0:.1f} s on the simulator")
