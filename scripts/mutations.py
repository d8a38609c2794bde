"""Mutation check: the test suite fails when a known bug is put into the code.

A suite that always passes proves nothing. This script takes bugs that a FlashAttention
kernel really gets (a causal bound off by one, the wrong K/V head under GQA, a dropped
barrier, a dropped softcap derivative, a wrong lse for an empty row, a swapped mma
fragment register, ...), puts each one into a temporary copy of the package, runs the
few tests that should notice it, and reports whether they did:

    .venv/bin/python scripts/mutations.py              # every mutation (a few minutes)
    .venv/bin/python scripts/mutations.py --list       # what each one changes, file:line
    .venv/bin/python scripts/mutations.py --only barrier-v5 --only softcap-grad
    .venv/bin/python scripts/mutations.py -n 4         # pytest-xdist workers per run
    .venv/bin/python scripts/mutations.py --rev HEAD   # the committed tree, not the work tree

For each mutation: copy numbaflash/, tests/ and pyproject.toml (from the working tree,
uncommitted edits included, or with ``--rev COMMIT`` as they are at that commit) into a
fresh temporary directory (never .venv), replace one exact piece of source text (each
search text must occur exactly once in its file, or the script stops and says the code
moved), and run the mutation's pytest selection there with NUMBA_ENABLE_CUDASIM=1,
CI=true (Hypothesis's derandomized profile), ``-x -q -p no:cacheprovider`` (with
``-n N`` no ``-x``: see ``pytest_args``). The copy's package is imported ahead of the
venv's editable install of this checkout because the copy comes first on PYTHONPATH and
pytest runs from the copy's root; each pytest process prints the ``numbaflash.__file__``
it imported, and a small plugin in the copy refuses to start (in every xdist worker too)
if that file is not the copy's.

A mutation is caught only if pytest exits 1 with at least one FAILED test. Exit 0 (all
passed) means it survived; exit 2, 3, 4 or 5 (interrupted, internal or usage error, no
tests collected) and a timeout count as not caught, and the table says which. Before any
mutation, each selection runs once on an unmutated copy and must pass; otherwise the run
is invalid (exit status 2). The script exits 1 if any mutation is not caught, 0 if all are.
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
COPIED = ("numbaflash", "tests", "pyproject.toml", "conftest.py", "setup.cfg", "pytest.ini")
IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc", ".hypothesis", ".pytest_cache")
PLUGIN = "_mutation_copy_check"
PLUGIN_SOURCE = '''\
"""Written by scripts/mutations.py: refuse to run unless numbaflash comes from this copy."""
import os
from pathlib import Path

import pytest


def pytest_configure(config):
    import numbaflash
    root = Path(os.environ["NUMBAFLASH_MUTATION_COPY"]).resolve()
    where = Path(numbaflash.__file__).resolve()
    if root not in where.parents:
        raise pytest.UsageError(f"numbaflash was imported from {where}, not from the "
                                f"mutated copy {root}")
'''
# Runs pytest in the same process that reports where numbaflash came from.
BOOT = ("import sys, numbaflash, pytest; "
        "print('numbaflash imported from', numbaflash.__file__, flush=True); "
        "sys.exit(pytest.main(sys.argv[1:]))")
EXIT_MEANING = {0: "all passed", 1: "tests failed", 2: "interrupted or collection error",
                3: "internal error", 4: "usage error", 5: "no tests collected"}


@dataclass(frozen=True)
class Edit:
    path: str           # relative to the repository root
    search: str         # must occur exactly once in the file
    replace: str


@dataclass(frozen=True)
class Mutation:
    name: str
    bug: str            # what the mutation breaks, in words
    edits: tuple        # of Edit
    tests: tuple        # pytest arguments: files and -k expressions


V5 = "numbaflash/kernels/forward/v5_dynamic_shared.py"
V1_BWD = "numbaflash/kernels/backward/v1_two_kernels.py"
FWD_V5_CAUSAL = ("tests/test_forward_kernels.py", "-k", "test_causal_with_sq_not_sk and v5")
FWD_V5_F32 = ("tests/test_forward_kernels.py", "-k", "test_float32_matches_reference and v5")

MUTATIONS = (
    Mutation(
        "causal-mask-v5",
        "causal mask off by one in forward v5 (the simulator's default forward): the "
        "diagonal key is hidden (col < row + offset instead of <=)",
        (Edit(V5, "visible = col < Sk and (not causal or col <= row + causal_offset)",
              "visible = col < Sk and (not causal or col < row + causal_offset)"),),
        FWD_V5_CAUSAL),
    Mutation(
        "causal-tile-bound",
        "causal tile range off by one in the shared helper every tiled kernel uses "
        "(bands.kv_tile_range): the '+ 1' dropped, so the diagonal's K/V tile is skipped",
        (Edit("numbaflash/kernels/bands.py",
              "j_end = min(j_end, max(0, last_visible_col // Bc + 1))",
              "j_end = min(j_end, max(0, last_visible_col // Bc))"),),
        FWD_V5_CAUSAL),
    Mutation(
        "gqa-heads-forward",
        "GQA head mapping in forward v2 (the default for GQA): query head h reads K/V head "
        "h % Hkv instead of h // group (the same with one K/V head, MQA)",
        (Edit("numbaflash/kernels/forward/v2_flash2.py",
              "bh_kv = b * (Hq // group) + h // group",
              "bh_kv = b * (Hq // group) + h % (Hq // group)"),),
        ("tests/test_variants.py", "-k", "gqa or (test_forward_matches_reference and v2)")),
    Mutation(
        "gqa-heads-backward",
        "GQA head mapping in backward v1 (the default for GQA), the dQ kernel and the "
        "dK/dV kernel's loop over a group's query heads, both interleaved (h % Hkv)",
        (Edit(V1_BWD, "bh_kv = b * (Hq // group) + h // group",
              "bh_kv = b * (Hq // group) + h % (Hq // group)"),
         Edit(V1_BWD, "h = h_kv * group + g_idx",
              "h = g_idx * (Hq // group) + h_kv")),
        ("tests/test_variants.py", "-k", "gqa or test_backward_matches_reference")),
    Mutation(
        "barrier-v5",
        "dropped barrier in forward v5 (the simulator's default forward): the one after "
        "staging KjT and Vj, so threads read K/V entries other threads have not written",
        # Each of v5's five barriers, dropped alone, was caught by this selection on the
        # simulator (its Python threads switch often enough for the race to show).
        (Edit(V5, "            # Wait until KjT and Vj are complete.\n"
                  "            cuda.syncthreads()\n",
              "            # Wait until KjT and Vj are complete. (barrier dropped)\n"),),
        ("tests/test_forward_kernels.py", "-k",
         "(test_causal_with_sq_not_sk or test_float32_matches_reference) and v5")),
    Mutation(
        "softcap-grad",
        "softcap's derivative dropped in the backward: d score / d s = 1 instead of "
        "1 - tanh^2(s / cap)",
        (Edit("numbaflash/kernels/variants.py", "g = ONE - t * t", "g = ONE"),),
        ("tests/test_variants.py", "-k", "test_backward_matches_reference")),
    Mutation(
        "empty-row-lse-v5",
        "wrong lse for a fully masked row in forward v5: 0 instead of -inf",
        (Edit(V5, "L[bh, row] = NEG_INF if l_row == ZERO else m_i[a] + math.log(l_row)",
              "L[bh, row] = ZERO if l_row == ZERO else m_i[a] + math.log(l_row)"),),
        ("tests/test_forward_kernels.py", "-k",
         "test_fully_masked_rows_are_exact_zero_with_lse_minus_inf and v5")),
    Mutation(
        "fragment-swap-v6",
        "swapped mma fragment registers in the tensor-core forward (v6_tile_steps.values, "
        "used by v6, v8, v9): P~'s A fragment passed as a0, a2, a1, a3 where the m16n8k8 "
        "layout needs a0, a1, a2, a3 of (row g, row g + 8, key t, key t + 4)",
        (Edit("numbaflash/kernels/forward/v6_tile_steps.py",
              "pb[ks * 4], pb[ks * 4 + 2], pb[ks * 4 + 1], pb[ks * 4 + 3],\n"
              "                    ps[ks * 4], ps[ks * 4 + 2], ps[ks * 4 + 1], ps[ks * 4 + 3],",
              "pb[ks * 4], pb[ks * 4 + 1], pb[ks * 4 + 2], pb[ks * 4 + 3],\n"
              "                    ps[ks * 4], ps[ks * 4 + 1], ps[ks * 4 + 2], ps[ks * 4 + 3],"),),
        # one case: every simulated mma is a rendezvous of 32 Python threads (minutes)
        ("tests/test_simulated_kernels.py::"
         "test_tensor_core_forward_matches_reference[v6-float32-None-37-29-8]",)),
    Mutation(
        "dropped-scale-v5",
        "softmax scale dropped in forward v5: S = Q K^T instead of scale * Q K^T",
        (Edit(V5, "x = s[a, b] * softmax_scale if visible else NEG_INF",
              "x = s[a, b] if visible else NEG_INF"),),
        FWD_V5_F32),
    Mutation(
        "rescale-l-v5",
        "online-softmax rescale dropped from the running sum in forward v5: "
        "l = l + rowsum(P~) instead of alpha l + rowsum(P~) when the row max grows",
        (Edit(V5, "l_i[a] = alpha * l_i[a] + l_tile", "l_i[a] = l_i[a] + l_tile"),),
        FWD_V5_F32),
    Mutation(
        "dropped-D-v4",
        "D = rowsum(dO * O) dropped from dS in backward v4's dK/dV kernel (the "
        "simulator's default backward): dS = P * dP instead of P * (dP - D)",
        (Edit("numbaflash/kernels/backward/v4_dynamic_shared.py",
              "ds = p * (dp[a, b] - D_r)", "ds = p * dp[a, b]"),),
        ("tests/test_backward_kernels.py", "-k", "test_matches_reference and v4")),
)


class CodeMoved(Exception):
    pass


def source_text(path, rev=None):
    """The text of ``path`` (relative to the repository) in the working tree, or at the
    commit ``rev``; None if it does not exist there."""
    if rev is None:
        file = REPO / path
        return file.read_text() if file.is_file() else None
    proc = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:{path}"],
                          capture_output=True, text=True)
    return proc.stdout if proc.returncode == 0 else None


def check_edit(edit, rev=None):
    """The 1-based line of edit.search in its file; CodeMoved unless it occurs once."""
    text = source_text(edit.path, rev)
    if text is None:
        raise CodeMoved(f"{edit.path} does not exist" + (f" at {rev}" if rev else ""))
    n = text.count(edit.search)
    if n != 1:
        raise CodeMoved(f"{edit.path}: the search text occurs {n} times, not exactly once; "
                        f"the code moved, so update this mutation in scripts/mutations.py:\n"
                        f"    {edit.search!r}")
    return text[:text.index(edit.search)].count("\n") + 1


def where(mutation, rev=None):
    """'file:line' of each edit, lines of one file joined: 'bands.py:36' or 'x.py:188,107'."""
    lines = {}
    for e in mutation.edits:
        lines.setdefault(e.path.removeprefix("numbaflash/"), []).append(str(check_edit(e, rev)))
    return ", ".join(f"{path}:{','.join(n)}" for path, n in lines.items())


def make_copy(mutation=None, rev=None):
    """A fresh temporary copy of what pytest needs (from the working tree, or from the
    commit ``rev``), with ``mutation`` applied (or none)."""
    root = Path(tempfile.mkdtemp(prefix="numbaflash-mutation-"))
    if rev is None:
        for name in COPIED:
            src = REPO / name
            if src.is_dir():
                shutil.copytree(src, root / name, ignore=IGNORED)
            elif src.is_file():
                shutil.copy2(src, root / name)
    else:
        names = [n for n in COPIED if subprocess.run(
            ["git", "-C", str(REPO), "cat-file", "-e", f"{rev}:{n}"],
            capture_output=True).returncode == 0]
        archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, *names],
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
    (root / f"{PLUGIN}.py").write_text(PLUGIN_SOURCE)
    for edit in (mutation.edits if mutation else ()):
        path = root / edit.path
        text = path.read_text()
        if text.count(edit.search) != 1:    # checked in the repo already; the copy agrees
            raise CodeMoved(f"{edit.path}: search text not found once in the copy")
        path.write_text(text.replace(edit.search, edit.replace, 1))
    return root


def pytest_args(tests, workers):
    """-x -q, or with xdist workers -n N without -x: under xdist, -x stops pytest as
    "interrupted" (exit 2, not 1) after the first failure, which the rule below could not
    tell from a collection error."""
    args = ["-q", "-p", "no:cacheprovider", "-p", PLUGIN]
    args = args + ["-n", str(workers)] if workers is not None else ["-x"] + args
    return args + list(tests)


def show_command(tests, workers):
    quoted = [a if re.fullmatch(r"[\w./:=-]+", a) else repr(a)
              for a in pytest_args(tests, workers)]
    return ("NUMBA_ENABLE_CUDASIM=1 CI=true PYTHONPATH=<copy> python -m pytest "
            + " ".join(quoted))


@dataclass
class Result:
    rc: int | None      # None: timed out
    failed: list
    errors: int
    seconds: float
    imported: str
    tail: str


def run_selection(root, tests, workers, timeout):
    env = dict(os.environ)
    env.update(NUMBA_ENABLE_CUDASIM="1", CI="true", NUMBAFLASH_MUTATION_COPY=str(root),
               PYTHONPATH=os.pathsep.join([str(root)] + [p for p in
                                           env.get("PYTHONPATH", "").split(os.pathsep) if p]))
    env.pop("NUMBAFLASH_PROFILE", None)     # the suite's own default count (conftest.py)
    cmd = [sys.executable, "-c", BOOT] + pytest_args(tests, workers)
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True,
                              timeout=timeout)
        rc, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as err:
        rc = None
        out = ((err.stdout or b"").decode(errors="replace") if isinstance(err.stdout, bytes)
               else (err.stdout or ""))
    seconds = time.monotonic() - start
    failed = re.findall(r"^FAILED (.+?)(?: - .*)?$", out, re.M)
    errors = len(re.findall(r"^ERROR ", out, re.M))
    m = re.search(r"^numbaflash imported from (.+)$", out, re.M)
    imported = m.group(1).strip() if m else "?"
    return Result(rc, failed, errors, seconds, imported, "\n".join(out.splitlines()[-25:]))


def imported_from_copy(result, root):
    try:
        return Path(root).resolve() in Path(result.imported).resolve().parents
    except (OSError, ValueError):
        return False


def verdict(result):
    if result.rc is None:
        return "NOT caught (timed out)"
    if result.rc == 1 and result.failed:
        return "caught"
    if result.rc == 0:
        return "SURVIVED (all passed)"
    if result.rc == 1:
        return "NOT caught (exit 1 without a FAILED test: errors only)"
    return f"NOT caught (exit {result.rc}: {EXIT_MEANING.get(result.rc, 'unknown')})"


def table(rows):
    head = ("mutation", "where (file:line)", "exit", "verdict", "first failing test", "time")
    cells = [head] + rows
    widths = [min(max(len(r[c]) for r in cells), 70) for c in range(len(head))]
    lines = []
    for n, r in enumerate(cells):
        lines.append("  ".join(x.ljust(w) for x, w in zip(r, widths)).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", action="append", metavar="NAME",
                    help="run only this mutation (repeatable)")
    ap.add_argument("--list", action="store_true",
                    help="list the mutations, where each applies and its tests, then exit")
    ap.add_argument("-n", dest="workers", type=int, default=None,
                    help="pytest-xdist workers for each pytest run (default: none)")
    ap.add_argument("--timeout", type=float, default=900,
                    help="seconds one pytest run may take (default 900): over it, not caught")
    ap.add_argument("--rev", metavar="COMMIT", default=None,
                    help="copy numbaflash/ and tests/ as they are at this commit (default: "
                         "the working tree, uncommitted edits included)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary copies")
    args = ap.parse_args(argv)

    names = [m.name for m in MUTATIONS]
    for name in args.only or ():
        if name not in names:
            ap.error(f"unknown mutation {name!r}; --list shows them: {', '.join(names)}")
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    try:
        places = {m.name: where(m, args.rev) for m in chosen}   # stops if the code moved
    except CodeMoved as err:
        print(f"error: {err}", file=sys.stderr)
        return 2

    if args.list:
        for m in chosen:
            print(f"{m.name}  ({places[m.name]})\n    {m.bug}\n    "
                  f"{show_command(m.tests, args.workers)}")
        return 0

    copies = []
    try:
        # The unmutated selections must pass, or a failure below says nothing.
        selections = list(dict.fromkeys(m.tests for m in chosen))
        root = make_copy(rev=args.rev)
        copies.append(root)
        print(f"baseline: {len(selections)} selection(s) on an unmutated copy ({root})",
              flush=True)
        for tests in selections:
            res = run_selection(root, tests, args.workers, args.timeout)
            ok = res.rc == 0 and imported_from_copy(res, root)
            print(f"  {'pass' if ok else 'FAIL'}  {res.seconds:6.1f} s  exit {res.rc}  "
                  f"{show_command(tests, args.workers)}\n        numbaflash from "
                  f"{res.imported}", flush=True)
            if not ok:
                print(res.tail)
                print("error: the unmutated selection does not pass (or did not import the "
                      "copy): this run is invalid", file=sys.stderr)
                return 2

        rows = []
        for m in chosen:
            root = make_copy(m, args.rev)
            copies.append(root)
            res = run_selection(root, m.tests, args.workers, args.timeout)
            if not imported_from_copy(res, root):
                print(res.tail)
                print(f"error: {m.name}: pytest imported numbaflash from {res.imported}, "
                      f"not from the mutated copy {root}", file=sys.stderr)
                return 2
            v = verdict(res)
            first = res.failed[0] if res.failed else ("-" if not res.errors else
                                                      f"({res.errors} error(s))")
            rows.append((m.name, places[m.name], "timeout" if res.rc is None else str(res.rc),
                         v, first, f"{res.seconds:.1f} s"))
            print(f"{m.name}: {v} in {res.seconds:.1f} s, exit {res.rc}, first failure "
                  f"{first}\n    {show_command(m.tests, args.workers)}\n    numbaflash from "
                  f"{res.imported}", flush=True)
            if v != "caught":
                print("    " + res.tail.replace("\n", "\n    "), flush=True)
    finally:
        if not args.keep:
            for root in copies:
                shutil.rmtree(root, ignore_errors=True)

    print()
    print(table(rows))
    missed = [r[0] for r in rows if r[3] != "caught"]
    print()
    if missed:
        print(f"{len(missed)} of {len(rows)} mutations NOT caught: {', '.join(missed)}")
        return 1
    print(f"all {len(rows)} mutations caught")
    return 0


if __name__ == "__main__":
    sys.exit(main())
