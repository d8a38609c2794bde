"""Backward v3 on a GPU: check it against float64 references, then time it against v1.

    python scripts/bwd_v3_sweep.py --out bwd_v3_sweep.json     # on a GPU machine
    python scripts/bwd_v3_sweep.py --quick                      # default tiles only

(a) Check. v3 with its default tiles on the shapes in CHECKS (causal and not, Sq != Sk,
    fully masked rows, d = 59, 64, 128; float16, float32, float64), each against the
    dense float64 reference with the test suite's rule (tests/backward_checks.py:
    ``check_backward``, TESTING.md's rule as applied to the backward). Inputs are the
    tests' own (strategies.make_case: float32-exact, uniform in [-4, 4]).
(b) Time. At (2, 16, 4096, 64), (2, 16, 4096, 128) and (1, 16, 16384, 64), float32,
    standard normal inputs: attention_backward (the public call on device arrays: the D
    kernel, the dK/dV kernel and the dQ kernel, output allocation included) with v1 and
    with v3 at each tile setting in CONFIGS, not causal; then causal for v1, v3's default
    and the fastest v3 setting of the non-causal run (each causal kernel is another
    compilation, so not all settings are timed twice). Before a setting is timed it is
    checked like (a) on a small shape with the same head dim and mask (a wrong setting is
    marked WRONG and not timed); its result on the timed shape is then compared with v1's
    (max |v3 - v1| / max |v1| per gradient, reported; above 1e-4 is marked WRONG).
    Timing: CUDA events around each call, one untimed call first (compilation), then
    calls until at least MIN_REPEATS and TARGET_S seconds (at most MAX_REPEATS); the median.

Prints one table; with --out, also writes the records as JSON (numbaflash.bench.save_json:
{"meta": environment, "records": [...]}). Stops starting new work after --budget-s
seconds (default 210) so that it ends within about four minutes on an H200; what is
skipped is listed. Exit status 1 if any check failed or any result was marked WRONG.
"""

import argparse
import os
import statistics
import sys
import time

import numpy as np
from numba import cuda

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import numbaflash  # noqa: E402
from numbaflash import bench, dispatch  # noqa: E402
from numbaflash.kernels import simulating  # noqa: E402
from backward_checks import check_backward  # noqa: E402  (tests/)
from strategies import make_case  # noqa: E402  (tests/)

# (a): (B, H, Sq, Sk, d, dtype, causal)
CHECKS = [
    (1, 2, 1024, 1024, 64, "float32", None),
    (1, 2, 1000, 1000, 64, "float32", "bottom_right"),
    (1, 1, 300, 1100, 64, "float32", "bottom_right"),     # Sq < Sk
    (1, 1, 1100, 300, 64, "float32", "bottom_right"),     # rows 0..799 see no key
    (1, 1, 700, 513, 64, "float32", "top_left"),
    (2, 1, 777, 777, 128, "float32", None),
    (1, 2, 640, 600, 128, "float32", "bottom_right"),
    (1, 1, 257, 300, 59, "float32", "top_left"),
    (1, 1, 256, 256, 64, "float16", "bottom_right"),
    (1, 1, 300, 300, 64, "float64", "bottom_right"),
]
# (b): the timed shapes (B, H, N, d) and v3's tile settings per head dim (None: the rule)
SHAPES = [(2, 16, 4096, 64), (2, 16, 4096, 128), (1, 16, 16384, 64)]
CONFIGS = {64: [None, (32, 32, 2, 4), (32, 32, 2, 2), (32, 32, 4, 4), (16, 16, 2, 2)],
           128: [None, (16, 16, 1, 1), (16, 16, 1, 2), (32, 8, 2, 1), (8, 32, 1, 2)]}
SMALL = (1, 2, 300, 333)            # the pre-timing check: (B, H, Sq, Sk) at the same d
AGREE = 1e-4                        # max |v3 - v1| / max |v1| above this: WRONG
MIN_REPEATS, MAX_REPEATS, TARGET_S = 3, 20, 1.0


class Budget:
    def __init__(self, seconds):
        self.start = time.perf_counter()
        self.seconds = seconds
        self.skipped = []

    def elapsed(self):
        return time.perf_counter() - self.start

    def allows(self, what):
        if self.elapsed() < self.seconds:
            return True
        self.skipped.append(what)
        print(f"[{self.elapsed():5.0f} s] skipped (time budget): {what}", flush=True)
        return False


def time_ms(fn):
    """Median ms of fn() between CUDA events, after one untimed call: calls until
    MIN_REPEATS and TARGET_S are reached (at most MAX_REPEATS). Returns (ms, n).
    (bench.time_ms takes a fixed count; v1 at N = 16384 takes seconds a call, so the
    count adapts here to keep the whole script within its time budget.)"""
    fn()
    cuda.synchronize()
    times = []
    start, end = cuda.event(), cuda.event()
    while len(times) < MAX_REPEATS and (len(times) < MIN_REPEATS
                                        or sum(times) < TARGET_S * 1e3):
        if simulating():        # no event times there (only for trying the script out)
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
            continue
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cuda.event_elapsed_time(start, end))
    return statistics.median(times), len(times)


def tiles_of(plans):
    """(Br, Bc, TM, TN) of a v3 plan (the dK/dV kernel's; both kernels share them)."""
    p = plans[1]
    return (p.Br, p.Bc) + tuple(p.thread_tile or ())


def check_case(B, H, Sq, Sk, d, dtype, causal, tiles=None, seed=0):
    """v3 on a make_case input against the float64 reference with the tests' rule.
    Returns (ok, {name: (error, bound)} or the failure message)."""
    case = make_case(B, H, Sq, Sk, d, dtype, causal, None, None, "uniform", seed, True)
    out, lse = numbaflash.attention(case.q, case.k, case.v, causal=causal, return_lse=True)
    grads = numbaflash.attention_backward(case.dout, case.q, case.k, case.v, out, lse,
                                          causal=causal, version="v3", tiles=tiles)
    try:
        return True, check_backward(case.dout, case.q, case.k, case.v, out, lse, grads,
                                    causal=causal)
    except AssertionError as e:
        return False, str(e)[:500]


def run_checks(records, budget):
    print("(a) v3 (default tiles) against the float64 reference, the tests' rule", flush=True)
    for B, H, Sq, Sk, d, dtype, causal in CHECKS:
        what = f"check {(B, H, Sq, Sk, d)} {dtype} causal={causal}"
        if not budget.allows(what):
            continue
        q = np.zeros((B, H, Sq, d), dtype)
        tiles = tiles_of(numbaflash.explain_backward(q, q[..., :Sk, :], q[..., :Sk, :],
                                                     causal=causal, version="v3"))
        ok, detail = check_case(B, H, Sq, Sk, d, dtype, causal)
        records.append({"kind": "check", "shape": [B, H, Sq, Sk, d], "dtype": dtype,
                        "causal": causal, "tiles": list(tiles), "ok": ok,
                        "detail": detail if not ok else {k: {"error": e, "bound": b}
                                                         for k, (e, b) in detail.items()}})
        worst = ("FAILED: " + detail) if not ok else "ok, error/bound " + ", ".join(
            f"{k} {e / b if b else 0:.2f}" for k, (e, b) in detail.items())
        print(f"[{budget.elapsed():5.0f} s] {what} tiles {tiles}: {worst}", flush=True)


def agreement(got, ref):
    """max |got - ref| / max |ref| for each gradient (device arrays)."""
    out = {}
    for name, g, r in zip(("dQ", "dK", "dV"), got, ref):
        g, r = g.copy_to_host().astype(np.float64), r.copy_to_host().astype(np.float64)
        out[name] = float(np.abs(g - r).max() / max(np.abs(r).max(), 1e-30))
    return out


class Problem:
    """One timed (shape, causal): inputs on the device, the forward's out and lse, and v1's
    gradients and time once measured (the reference for v3's agreement and speed-up)."""

    def __init__(self, shape, causal):
        self.shape, self.causal = shape, causal
        B, H, N, d = shape
        self.d = d
        self.flops = bench.flops(B, H, N, N, d, causal, "backward")
        rng = np.random.default_rng(list(shape))
        self.q, self.k, self.v, self.dout = (
            cuda.to_device(rng.standard_normal(shape).astype(np.float32)) for _ in range(4))
        self.out, self.lse = numbaflash.attention(self.q, self.k, self.v, causal=causal,
                                                  return_lse=True)
        self.v1 = None              # (gradients, record)

    def backward(self, version, tiles):
        return numbaflash.attention_backward(self.dout, self.q, self.k, self.v, self.out,
                                             self.lse, causal=self.causal, version=version,
                                             tiles=tiles)


def time_one(prob, version, tiles, records, budget):
    """Check (v3: on SMALL first), run and time one version and tile setting on ``prob``;
    appends and returns its record (None if skipped or refused)."""
    what = f"time {prob.shape} causal={prob.causal} {version} tiles={tiles or 'default'}"
    if not budget.allows(what):
        return None
    rec = {"kind": "time", "shape": list(prob.shape), "causal": prob.causal,
           "dtype": "float32", "version": version, "tiles_asked": tiles, "ok": True,
           "ms": None}
    try:
        plans = numbaflash.explain_backward(prob.q, prob.k, prob.v, causal=prob.causal,
                                            version=version, tiles=tiles)
    except ValueError as e:
        print(f"  {what}: not run ({e})", flush=True)
        return None
    rec["tiles"] = list(tiles_of(plans)) if version == "v3" else [plans[1].Br, plans[1].Bc]
    rec["block"] = plans[1].block[0]
    if version == "v3":
        ok, detail = check_case(*SMALL, prob.d, "float32", prob.causal, tiles=tiles, seed=1)
        rec["small_check"] = "ok" if ok else detail
        if not ok:
            rec["ok"] = False
            records.append(rec)
            print(f"  {what}: WRONG on the small check, not timed: {detail}", flush=True)
            return rec

    def fn():
        return prob.backward(version, tiles)

    grads = fn()                        # compiles (first call of these kernels)
    if version == "v1":
        prob.v1 = (grads, rec)
    elif prob.v1 is not None:
        rec["max_rel_diff_vs_v1"] = agreement(grads, prob.v1[0])
        rec["ok"] = max(rec["max_rel_diff_vs_v1"].values()) <= AGREE
    if rec["ok"]:
        rec["ms"], rec["repeats"] = time_ms(fn)
        rec["tflops"] = prob.flops / rec["ms"] / 1e9
        if version == "v3" and prob.v1 is not None and prob.v1[1]["ms"]:
            rec["speedup_vs_v1"] = prob.v1[1]["ms"] / rec["ms"]
    records.append(rec)
    diff = rec.get("max_rel_diff_vs_v1")
    print(f"[{budget.elapsed():5.0f} s] {what} -> {tuple(rec['tiles'])}, block {rec['block']}: "
          + (f"{rec['ms']:9.2f} ms {rec['tflops']:6.2f} TFLOP/s" if rec["ms"] else "WRONG")
          + (f", {rec['speedup_vs_v1']:.2f}x v1" if "speedup_vs_v1" in rec else "")
          + (f", max|v3 - v1|/max|v1| {max(diff.values()):.1e}" if diff else ""), flush=True)
    return rec


def run_timing(records, budget, quick):
    """v1 and v3's default first on every shape and mask (the comparison that matters),
    then the other settings without the mask, then, with the mask, the fastest of them
    if it beat the default."""
    print("(b) backward v1 vs v3, float32, CUDA events, median", flush=True)
    problems = {}

    def problem(shape, causal):
        if (shape, causal) not in problems:
            problems[(shape, causal)] = Problem(shape, causal)
        return problems[(shape, causal)]

    for shape in SHAPES:
        for causal in (False, True):
            if budget.allows(f"inputs {shape} causal={causal}"):
                prob = problem(shape, causal)
                time_one(prob, "v1", None, records, budget)
                time_one(prob, "v3", None, records, budget)
    if quick:
        return
    for shape in SHAPES:
        if (shape, False) not in problems:
            continue
        timed = [r for r in records if r["kind"] == "time" and r["version"] == "v3"
                 and r["shape"] == list(shape) and not r["causal"] and r["ms"]]
        for tiles in CONFIGS[shape[3]][1:]:
            rec = time_one(problems[(shape, False)], "v3", tiles, records, budget)
            if rec and rec["ms"]:
                timed.append(rec)
        if not timed:
            continue
        best = min(timed, key=lambda r: r["ms"])
        if best["tiles_asked"] is not None and (shape, True) in problems:
            time_one(problems[(shape, True)], "v3", best["tiles_asked"], records, budget)


def table(records):
    rows = [f"{'shape':<20} {'causal':<6} {'version':<7} {'tiles (Br,Bc,TM,TN)':<20} {'block':>5} "
            f"{'ms':>9} {'TFLOP/s':>8} {'x v1':>6} {'vs v1':>8}"]
    timed = [r for r in records if r["kind"] == "time"]
    order = {tuple(r["shape"]): n for n, r in reversed(list(enumerate(timed)))}
    for r in sorted(timed, key=lambda r: (order[tuple(r["shape"])], r["causal"],
                                          r["version"])):
        diff = r.get("max_rel_diff_vs_v1")
        rows.append(f"{'x'.join(map(str, r['shape'])):<20} {str(r['causal']):<6} "
                    f"{r['version']:<7} {str(tuple(r.get('tiles', ()))):<20} "
                    f"{r.get('block', ''):>5} "
                    + (f"{r['ms']:9.2f} {r['tflops']:8.2f} " if r["ms"]
                       else f"{'WRONG':>9} {'':>8} ")
                    + (f"{r['speedup_vs_v1']:6.2f} " if "speedup_vs_v1" in r else f"{'':>6} ")
                    + (f"{max(diff.values()):8.1e}" if diff else f"{'':>8}"))
    return "\n".join(rows)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="write the records as JSON to this path")
    ap.add_argument("--budget-s", type=float, default=210.0,
                    help="start no new check or timing after this many seconds (default 210)")
    ap.add_argument("--quick", action="store_true", help="time v3's default tiles only")
    ap.add_argument("--skip-checks", action="store_true", help="skip (a)")
    args = ap.parse_args(argv)
    if numbaflash.backend() != "gpu":
        sys.exit("bwd_v3_sweep.py needs a GPU (timings under the simulator mean nothing)")
    budget = Budget(args.budget_s)
    records = []
    if not args.skip_checks:
        run_checks(records, budget)
    run_timing(records, budget, args.quick)
    print()
    print(table(records))
    bad = [r for r in records if not r["ok"]]
    print(f"\n{len([r for r in records if r['kind'] == 'check'])} checks, "
          f"{len([r for r in records if r['kind'] == 'time'])} timings, {len(bad)} failed or "
          f"WRONG, {len(budget.skipped)} skipped for time; {budget.elapsed():.0f} s")
    for what in budget.skipped:
        print(f"  skipped: {what}")
    if args.out:
        meta = bench.environment()
        meta.update({"script": "scripts/bwd_v3_sweep.py", "elapsed_s": budget.elapsed(),
                     "skipped": budget.skipped,
                     "default_v3_tiles": {d: dispatch.default_backward_v3_tiles(d, "float32")
                                          for d in (64, 128)}})
        bench.save_json(records, args.out, meta)
        print(f"wrote {args.out}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
