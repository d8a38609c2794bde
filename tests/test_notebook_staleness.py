"""Stored GPU outputs that name a default kernel are today's: the GPU-only notebooks, and
the tables in docs/ that name or measure a default kernel.

A GPU-only notebook (``GPU_ONLY`` in scripts/notebooks.py) cannot run in CI, so its stored
outputs come from its last run on a GPU. Each prints, in its outputs, the default kernel
versions it measured, as JSON after the word ``DEFAULTS`` at the start of a line::

    DEFAULTS {"gpu": "NVIDIA H200", "dynamic_shared_limit": 232448, "versions": [
     {"pass": "forward", "dtype": "float32", "shape": [1, 16, 1024, 1024, 64], "causal": false, "version": "v8"},
     ...
    ]}

``shape`` is (B, H, Sq, Sk, d), ``pass`` "forward" or "backward", ``causal`` numbaflash's
``causal=True`` (bottom-right) or not, and ``dynamic_shared_limit`` the GPU's shared memory
per block, which the tile rules read. Each entry is compared with what the policy picks
today for that shape on a GPU with that limit (``numbaflash.explain(..., backend="gpu")``
and ``explain_backward``, which need no GPU). A difference means a default changed since
the notebook ran: re-execute it on a GPU (``python scripts/notebooks.py gpu``).

docs/ marks each table or figure that names or measures a default kernel with an HTML
comment that cites the lab file it comes from::

    <!-- DEFAULTS {"source": "lab/runs/2026-12-01/65_bench.json"} -->

A bench JSON (``python -m numbaflash bench --json``) gives the versions from its records
of the default (impl "numbaflash") and their kernel names; for any other file the comment
lists them under "versions", as above ("source" may then be a list of files). The same
comparison applies, on an H100/H200's limit unless the comment gives another.

No GPU needed: the plans are made on any machine (under the simulator too), and nothing
is compiled or launched.
"""

import importlib.util
import json
import re
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

import numbaflash
from numbaflash import policy
from numbaflash.kernels import backward, forward
from numbaflash.kernels import plan as plan_module

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
DOCS = ROOT / "docs"
# the GPU-only notebooks: one list, in scripts/notebooks.py
_spec = importlib.util.spec_from_file_location("nb_script", ROOT / "scripts" / "notebooks.py")
_nb_script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_nb_script)
GPU_NOTEBOOKS = [NOTEBOOKS / f"{stem}.ipynb" for stem in sorted(_nb_script.GPU_ONLY)]

MARKER = "DEFAULTS"
RERUN = "re-execute it on a GPU: python scripts/notebooks.py gpu"
H200_LIMIT = plan_module.DYNAMIC_SHARED_MEM_LIMIT      # what planning assumes without a GPU
DOC_MARKER = re.compile(r"<!--\s*DEFAULTS\s+(\{.*?\})\s*-->", re.S)


# ---------------------------------------------------------------------------------------
# Reading the records


def parse_defaults(text):
    """Every JSON object that follows ``DEFAULTS`` at the start of a line of ``text``."""
    decoder = json.JSONDecoder()
    found = []
    for match in re.finditer(rf"^{MARKER}[ \t]+", text, re.M):
        obj, _ = decoder.raw_decode(text, match.end())
        found.append(obj)
    return found


def notebook_defaults(ipynb):
    """The DEFAULTS objects in the stored stdout of ``ipynb``'s code cells."""
    nb = json.loads(Path(ipynb).read_text())
    found = []
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        text = "".join("".join(o.get("text", "")) for o in cell.get("outputs", [])
                       if o.get("output_type") == "stream" and o.get("name") == "stdout")
        found += parse_defaults(text)
    return found


def _version_of(kernels):
    """'forward_v8' -> 'v8'; 'backward_preprocess+backward_dkdv_v6+backward_dq_v6' -> 'v6'."""
    versions = set(re.findall(r"_(v\d+)\b", kernels))
    assert len(versions) == 1, f"kernel names {kernels!r} do not name one version"
    return versions.pop()


def bench_defaults(path):
    """Entries, as in a DEFAULTS object, from the default's records in a bench JSON."""
    records = json.loads(Path(path).read_text())["records"]
    entries = []
    for r in records:
        if r["impl"] != "numbaflash" or not r.get("kernel"):
            continue
        kernels = dict(zip(("forward", "backward"), r["kernel"].split(" + ")))
        if r["what"] != "fwd+bwd":
            kernels = {r["what"]: r["kernel"]}
        for pass_, names in kernels.items():
            entry = {"pass": pass_, "dtype": r["dtype"],
                     "shape": [r["B"], r["H"], r["Sq"], r["Sk"], r["d"]],
                     "causal": bool(r["causal"]), "version": _version_of(names)}
            if entry not in entries:
                entries.append(entry)
    return entries


def doc_markers():
    """(doc, line, the comment's JSON object) for every DEFAULTS comment in docs/."""
    found = []
    for doc in sorted(DOCS.glob("**/*.md")):
        text = doc.read_text()
        for match in DOC_MARKER.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            found.append((doc.relative_to(ROOT).as_posix(), line, json.loads(match.group(1))))
    return found


# ---------------------------------------------------------------------------------------
# Today's policy, on a GPU


class _Spec:
    """A shape and a dtype: all that ``explain`` reads."""

    def __init__(self, shape, dtype):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)


@contextmanager
def gpu_with_limit(limit):
    """Plan as on a GPU whose blocks may use ``limit`` bytes of dynamic shared memory: the
    policy and every version's module ask ``device_dynamic_shared_limit``, which without
    a GPU answers the H100/H200's."""
    modules = ([policy, plan_module] + [forward.module(v) for v in forward.VERSIONS]
               + [backward.module(v) for v in backward.VERSIONS])
    saved = [(m, m.device_dynamic_shared_limit) for m in modules
             if hasattr(m, "device_dynamic_shared_limit")]
    try:
        for m, _ in saved:
            m.device_dynamic_shared_limit = lambda where=None: limit
        yield
    finally:
        for m, original in saved:
            m.device_dynamic_shared_limit = original


def todays_version(entry):
    """The version the policy picks today on a GPU for ``entry``'s pass, shape and dtype."""
    B, H, Sq, Sk, d = entry["shape"]
    q, kv = _Spec((B, H, Sq, d), entry["dtype"]), _Spec((B, H, Sk, d), entry["dtype"])
    causal = "bottom_right" if entry["causal"] else None
    if entry["pass"] == "forward":
        return numbaflash.explain(q, kv, kv, causal=causal, backend="gpu").version
    if entry["pass"] == "backward":
        return numbaflash.explain_backward(q, kv, kv, causal=causal, backend="gpu")[-1].version
    raise ValueError(f"pass must be 'forward' or 'backward'; got {entry['pass']!r}")


def stale_entries(entries, limit):
    """(entry, today's version) for each entry whose version is not today's."""
    with gpu_with_limit(limit):
        return [(e, v) for e in entries if (v := todays_version(e)) != e["version"]]


def describe(entry, today, where, limit):
    B, H, Sq, Sk, d = entry["shape"]
    return (f"{entry['pass']} {entry['dtype']} shape (B, H, Sq, Sk, d) = ({B}, {H}, {Sq}, "
            f"{Sk}, {d}){', causal' if entry['causal'] else ''}: {where} records "
            f"{entry['version']}, today's policy picks {today} on a GPU with {limit} bytes "
            f"of shared memory per block")


# ---------------------------------------------------------------------------------------
# The checks


def check_notebook(ipynb):
    """Fail, naming the notebook, the shape and both versions, if ``ipynb``'s stored
    outputs name a default other than today's, or name none."""
    ipynb = Path(ipynb)
    records = notebook_defaults(ipynb)
    if not records:
        pytest.fail(f"{ipynb.name} stores no '{MARKER} {{...}}' line in its outputs, so "
                    f"they cannot say which default kernels they measured (they predate "
                    f"that line, or the cell that prints it did not run): {RERUN}")
    problems = []
    for record in records:
        entries = record.get("versions") or []
        if not entries:
            problems.append(f"{ipynb.name}: a {MARKER} line lists no versions")
        limit = record.get("dynamic_shared_limit") or H200_LIMIT
        where = f"{ipynb.name} (run on {record.get('gpu', 'an unnamed GPU')})"
        problems += [describe(e, today, where, limit)
                     for e, today in stale_entries(entries, limit)]
    if problems:
        pytest.fail(f"the stored outputs of {ipynb.name} are stale: a default kernel "
                    f"changed since it ran; {RERUN}\n  " + "\n  ".join(problems))


def check_doc_marker(doc, line, marker):
    """Fail if a docs table's DEFAULTS comment cites no lab file, or names a default other
    than today's (read from the comment, or from the bench JSON it cites)."""
    sources = marker.get("source")
    sources = [sources] if isinstance(sources, str) else list(sources or [])
    if not sources:
        pytest.fail(f"{doc}:{line}: the DEFAULTS comment cites no lab file (\"source\")")
    missing = [s for s in sources if not (ROOT / s).is_file()]
    if missing:
        pytest.fail(f"{doc}:{line}: the DEFAULTS comment cites {missing}, which do not exist")
    entries = marker.get("versions")
    if entries is None:
        entries = [e for s in sources if s.endswith(".json") for e in bench_defaults(ROOT / s)]
    if not entries:
        pytest.fail(f"{doc}:{line}: no default versions: the comment lists none under "
                    f"\"versions\" and its source {sources} is no bench JSON with records "
                    f"of the default")
    limit = marker.get("dynamic_shared_limit") or H200_LIMIT
    problems = [describe(e, today, f"{doc}:{line} (from {', '.join(sources)})", limit)
                for e, today in stale_entries(entries, limit)]
    if problems:
        pytest.fail(f"{doc}:{line} names or measures a default kernel that is no longer the "
                    f"default: measure it again on a GPU, and update the table, its lab "
                    f"file and the comment\n  " + "\n  ".join(problems))


@pytest.mark.parametrize("ipynb", GPU_NOTEBOOKS, ids=[p.stem for p in GPU_NOTEBOOKS])
def test_gpu_notebook_outputs_show_todays_defaults(ipynb):
    check_notebook(ipynb)


DOC_MARKERS = doc_markers()


def test_docs_mark_their_default_tables():
    """The performance page's tables are marked (a check with nothing to check passes
    silently, so the marks must not go missing)."""
    assert any(doc == "docs/performance.md" for doc, _, _ in DOC_MARKERS), (
        "docs/performance.md has no <!-- DEFAULTS {\"source\": ...} --> comment: every table "
        "there that names or measures a default kernel cites its lab file in one")


@pytest.mark.parametrize("doc, line, marker", DOC_MARKERS,
                         ids=[f"{doc}:{line}" for doc, line, _ in DOC_MARKERS])
def test_docs_tables_show_todays_defaults(doc, line, marker):
    check_doc_marker(doc, line, marker)


# ---------------------------------------------------------------------------------------
# The checks themselves, on made-up records (no notebook or doc involved)


def _entry(version, pass_="forward", dtype="float32", d=64):
    return {"pass": pass_, "dtype": dtype, "shape": [1, 16, 4096, 4096, d], "causal": False,
            "version": version}


def test_parse_defaults_reads_one_line_and_many():
    text = ('noise\nDEFAULTS {"versions": [\n {"a": 1},\n {"a": 2}\n]}\nmore\n'
            'DEFAULTS {"versions": []}\n  DEFAULTS {"not": "at a line start"}\n')
    assert parse_defaults(text) == [{"versions": [{"a": 1}, {"a": 2}]}, {"versions": []}]


def test_a_changed_default_is_stale():
    today = todays_version(_entry("v0"))
    assert stale_entries([_entry(today)], H200_LIMIT) == []
    other = "v2" if today != "v2" else "v1"
    assert stale_entries([_entry(other)], H200_LIMIT) == [(_entry(other), today)]


def test_the_devices_limit_is_what_the_policy_reads():
    """A GPU with little shared memory per block gets other defaults than an H200, and
    the check plans with the recorded limit."""
    entry = _entry(todays_version(_entry("v0", d=128)), d=128)
    assert stale_entries([entry], H200_LIMIT) == []
    assert stale_entries([entry], 48 * 1024) != []          # no tensor-core tile fits 48 KB
    assert todays_version(entry) == entry["version"]        # the limit is put back after


def test_bench_records_give_versions(tmp_path):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"meta": {}, "records": [
        {"impl": "numbaflash", "what": "fwd+bwd", "dtype": "float32", "B": 1, "H": 16,
         "Sq": 4096, "Sk": 4096, "d": 64, "causal": False,
         "kernel": "forward_v8 + backward_preprocess+backward_dkdv_v6+backward_dq_v6"},
        {"impl": "numbaflash_v2", "what": "forward", "dtype": "float32", "B": 1, "H": 16,
         "Sq": 4096, "Sk": 4096, "d": 64, "causal": False, "kernel": "forward_v2"},
        {"impl": "sdpa_efficient", "what": "forward", "dtype": "float32", "B": 1, "H": 16,
         "Sq": 4096, "Sk": 4096, "d": 64, "causal": False, "kernel": "EFFICIENT_ATTENTION"},
    ]}))
    assert bench_defaults(path) == [_entry("v8"), _entry("v6", pass_="backward")]
