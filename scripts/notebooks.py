"""Keep the notebooks' .py (source) and .ipynb (what GitHub and Jupyter open) in step.

    python scripts/notebooks.py sync            # rewrite each .ipynb from its .py, keeping
                                                # the outputs of cells whose source is unchanged
    python scripts/notebooks.py execute [NAME]  # run notebooks top to bottom and store the
                                                # outputs in the .ipynb (all, or those whose
                                                # file name contains NAME)
    python scripts/notebooks.py gpu [NAME]      # on a GPU: run the GPU-only notebooks
                                                # (GPU_ONLY) and store their outputs

The .py file (jupytext py:percent) is the one to edit and review. ``execute`` runs under
the CUDA simulator unless NUMBA_ENABLE_CUDASIM is already set in the environment (set it
to 0 on a GPU machine to store GPU-sized outputs), and skips the GPU-only notebooks under
the simulator. ``gpu`` runs only the GPU-only notebooks, with NUMBA_ENABLE_CUDASIM=0
whatever the environment says: run it whenever a default kernel changes (their stored
outputs record the default versions they measured, and tests/test_notebook_staleness.py
fails when the policy picks others). A notebook that fails keeps its old .ipynb. Each
prints its wall time. tests/test_notebooks.py checks that the pairs agree and that every
notebook runs. Needs the ``test`` extra (jupytext, nbclient, ipykernel, matplotlib).
"""

import os
import sys
import time
from pathlib import Path

import jupytext
from jupytext.combine import combine_inputs_with_outputs
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
GPU_ONLY = {"06_gpu_performance"}      # also in tests/test_notebooks.py: need a real GPU


def sources(name=None):
    """The notebooks' .py sources, in order, optionally filtered by a name fragment."""
    return [p for p in sorted(NOTEBOOKS.glob("[0-9][0-9]_*.py")) if name is None or name in p.name]


def kernel_env(gpu=False):
    """The environment a notebook kernel runs in: the simulator unless told otherwise
    (``gpu``: never), the repository on the path, and matplotlib's inline backend (no
    MPLBACKEND)."""
    env = dict(os.environ)
    if gpu:
        env["NUMBA_ENABLE_CUDASIM"] = "0"
    env.setdefault("NUMBA_ENABLE_CUDASIM", "1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.pop("MPLBACKEND", None)
    return env


def sync(py):
    """Write py's .ipynb twin from py, keeping outputs of unchanged cells."""
    nb = jupytext.read(py)
    ipynb = py.with_suffix(".ipynb")
    if ipynb.exists():
        nb = combine_inputs_with_outputs(nb, jupytext.read(ipynb), fmt="py:percent")
    jupytext.write(nb, ipynb)


def execute(py, timeout=600, gpu=False):
    """Run py top to bottom in a fresh kernel (``gpu``: on the GPU, never the simulator);
    write the outputs to its .ipynb; return seconds. A cell that raises raises
    CellExecutionError here, and the .ipynb is left as it was."""
    nb = jupytext.read(py)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOKS)}})
    t0 = time.perf_counter()
    client.execute(env=kernel_env(gpu))
    seconds = time.perf_counter() - t0
    jupytext.write(nb, py.with_suffix(".ipynb"))
    return seconds


def execute_on_gpu(name=None):
    """Run the GPU-only notebooks (or those whose name contains ``name``) on the GPU and
    store their outputs; 0, or 1 if one failed (its .ipynb then keeps its old outputs)."""
    chosen = [py for py in sources(name) if py.stem in GPU_ONLY]
    if not chosen:
        print(f"no GPU-only notebook matches {name!r}; they are {sorted(GPU_ONLY)}")
        return 2
    failed = 0
    for py in chosen:
        try:
            seconds = execute(py, gpu=True)
        except CellExecutionError as e:
            failed += 1
            print(f"FAILED {py.relative_to(ROOT)}, {e.ename}: {e.evalue}\n(its .ipynb keeps "
                  f"its old outputs)", flush=True)
            continue
        print(f"executed {py.relative_to(ROOT)} on the GPU in {seconds:.1f} s", flush=True)
    return 1 if failed else 0


def main(argv):
    if not argv or argv[0] not in ("sync", "execute", "gpu"):
        print(__doc__)
        return 2
    if argv[0] == "gpu":
        return execute_on_gpu(argv[1] if len(argv) > 1 else None)
    simulator = kernel_env()["NUMBA_ENABLE_CUDASIM"] not in ("", "0")
    for py in sources(argv[1] if len(argv) > 1 else None):
        if argv[0] == "sync":
            sync(py)
            print("synced", py.relative_to(ROOT))
        elif simulator and py.stem in GPU_ONLY:
            print(f"skipped {py.relative_to(ROOT)}: it needs a GPU (its stored outputs come "
                  f"from a GPU run; on a GPU machine, python scripts/notebooks.py gpu reruns "
                  f"it)")
        else:
            print(f"executed {py.relative_to(ROOT)} in {execute(py):.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
