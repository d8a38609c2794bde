"""Backward v4 on a GPU: check it against float64 references, then time it against v3.

    python scripts/bwd_v4_sweep.py                 # on a GPU machine (about 2 minutes)
    python scripts/bwd_v4_sweep.py --out bwd_v4.json
    NUMBA_ENABLE_CUDASIM=1 python scripts/bwd_v4_sweep.py --sim    # tiny shapes: does it run?

Backward v4 is v3's two kernels with their shared memory carved out of dynamic shared
memory (numbaflash/kernels/backward.py), so that tiles may exceed 48 KB; at d = 128 its
default tiles are (32, 32, 2, 2) where v3's are (16, 16, 2, 1).

(a) Check. v4 with its default tiles on the shapes in CHECKS (causal and not, Sq != Sk,
    fully masked rows, d = 64 and 128, float32), each against the dense float64
    reference with the test suite's rule (tests/backward_checks.py: ``check_backward``).
    Inputs are the tests' own (strategies.make_case: float32-exact, uniform in [-4, 4]).
(b) Time. At (2, 16, 4096, 64) and (2, 16, 4096, 128), float32, standard normal inputs,
    causal no and yes: attention_backward (the public call on device arrays: the D
    kernel, the dK/dV kernel and the dQ kernel, output allocation included) with v3
    (default tiles) and v4 with each tile setting in CONFIGS (None: v4's default rule).
    Each v4 result is compared with v3's on the timed shape (max |v4 - v3| / max |v3| per
    gradient; above 1e-4 is marked WRONG and its time is not a result). Timing: CUDA
    events around each call, one untimed call first (compilation), then the median of
    REPEATS calls. Settings over 100 KB per block run one block per SM.

Prints one table; with --out, also writes the records as JSON (numbaflash.bench.save_json).
Stops starting new work after --budget-s seconds (default 140); what is skipped is
listed. Exit status 1 if any check failed or any result was marked WRONG.
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

# (a): (B, H, Sq, Sk, d, causal), float32
CHECKS = [
    (1, 2, 1024, 1024, 64, None),
    (1, 2, 1000, 1000, 64, "bottom_right"),
    (1, 1, 300, 1100, 128, "bottom_right"),     # Sq < Sk
    (1, 1, 1100, 300, 128, "bottom_right"),     # rows 0..799 see no key
    (1, 1, 700, 513, 128, "top_left"),
    (2, 1, 777, 777, 128, None),
]
# (b): the timed shapes (B, H, N, d) and v4's tile settings per head dim (None: the rule):
# d = 64: v3's tiles by default; two bigger blocks than 48 KB allows.
# d = 128: the rule's (32, 32, 2, 2); v3's (16, 16, 2, 1) through v4 (the cost of dynamic
# shared memory there); (32, 32, 4, 2), over v3's accumulator bound; (64, 32, 4, 2),
# 117760 bytes (one block per SM).
CONFIGS = {64: [None, (64, 32, 4, 2), (64, 64, 4, 4), (64, 64, 4, 2)],
           128: [None, (16, 16, 2, 1), (32, 32, 4, 2), (64, 32, 4, 2), (64, 64, 4, 4)]}
SHAPES = [(2, 16, 4096, 64), (2, 16, 4096, 128)]
AGREE = 1e-4                        # max |v4 - v3| / max |v3| above this: WRONG
REPEATS = 5

# --sim: the same steps on tiny shapes (the simulator runs every thread in Python)
SIM_CHECKS = [(1, 1, 9, 7, 8, "bottom_right"), (1, 1, 6, 11, 8, None)]
SIM_SHAPES = [(1, 1, 12, 8)]
SIM_CONFIGS = {8: [None, (8, 8, 1, 2), (4, 8, 1, 2)]}


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


def time_ms(fn, repeats):
    """Median ms of fn() between CUDA events (wall clock on the simulator), after one
    untimed call."""
    fn()
    cuda.synchronize()
    times = []
    for _ in range(repeats):
        if simulating():
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
            continue
        start, end = cuda.event(), cuda.event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cuda.event_elapsed_time(start, end))
    return statistics.median(times)


def tiles_of(plans):
    """(Br, Bc, TM, TN) and the dynamic bytes (dK/dV, dQ) of a v3 or v4 plan."""
    p = plans[1]
    return (p.Br, p.Bc) + tuple(p.thread_tile), (plans[1].shared_bytes, plans[2].shared_bytes)


def run_checks(checks, records, budget):
    print("(a) v4 (default tiles) against the float64 reference, the tests' rule", flush=True)
    for B, H, Sq, Sk, d, causal in checks:
        what = f"check {(B, H, Sq, Sk, d)} float32 causal={causal}"
        if not budget.allows(what):
            continue
        case = make_case(B, H, Sq, Sk, d, "float32", causal, None, None, "uniform", 0, True)
        out, lse = numbaflash.attention(case.q, case.k, case.v, causal=causal,
                                        return_lse=True)
        plans = numbaflash.explain_backward(case.q, case.k, case.v, causal=causal,
                                            version="v4")
        grads = numbaflash.attention_backward(case.dout, case.q, case.k, case.v, out, lse,
                                              causal=causal, version="v4")
        try:
            detail = check_backward(case.dout, case.q, case.k, case.v, out, lse, grads,
                                    causal=causal)
            ok = True
            text = "ok, error/bound " + ", ".join(f"{k} {e / b if b else 0:.2f}"
                                                  for k, (e, b) in detail.items())
        except AssertionError as e:
            ok, text = False, "FAILED: " + str(e)[:500]
        records.append({"kind": "check", "shape": [B, H, Sq, Sk, d], "causal": causal,
                        "tiles": list(tiles_of(plans)[0]), "ok": ok, "detail": text})
        print(f"[{budget.elapsed():5.0f} s] {what} tiles {tiles_of(plans)[0]}: {text}",
              flush=True)


def run_timing(shapes, configs, repeats, records, budget):
    print("(b) backward v3 vs v4, float32, CUDA events, median", flush=True)
    for shape in shapes:
        B, H, N, d = shape
        rng = np.random.default_rng(list(shape))
        q, k, v, dout = (cuda.to_device(rng.standard_normal(shape).astype(np.float32))
                         for _ in range(4))
        for causal in (False, True):
            if not budget.allows(f"inputs {shape} causal={causal}"):
                continue
            out, lse = numbaflash.attention(q, k, v, causal=causal, return_lse=True)
            work = bench.flops(B, H, N, N, d, causal, "backward")   # causal: half
            ref = None
            for version, tiles in [("v3", None)] + [("v4", t) for t in configs[d]]:
                what = f"{shape} causal={causal} {version} tiles={tiles or 'default'}"
                if not budget.allows(what):
                    continue
                try:
                    plans = numbaflash.explain_backward(q, k, v, causal=causal,
                                                        version=version, tiles=tiles)
                except ValueError as e:
                    print(f"  {what}: not run ({e})", flush=True)
                    continue
                t, nbytes = tiles_of(plans)

                def fn():
                    return numbaflash.attention_backward(dout, q, k, v, out, lse,
                                                         causal=causal, version=version,
                                                         tiles=tiles)

                grads = [g.copy_to_host().astype(np.float64) for g in fn()]
                rec = {"kind": "time", "shape": list(shape), "causal": causal,
                       "version": version, "tiles_asked": tiles, "tiles": list(t),
                       "shared_bytes": list(nbytes), "block": plans[1].block[0], "ok": True,
                       "ms": None}
                if ref is None:
                    ref = grads
                else:
                    rec["max_rel_diff_vs_v3"] = max(
                        float(np.abs(g - r).max() / max(np.abs(r).max(), 1e-30))
                        for g, r in zip(grads, ref))
                    rec["ok"] = rec["max_rel_diff_vs_v3"] <= AGREE
                if rec["ok"]:
                    rec["ms"] = time_ms(fn, repeats)
                    rec["tflops"] = work / rec["ms"] / 1e9
                records.append(rec)
                print(f"[{budget.elapsed():5.0f} s] {what} -> {t}, block {rec['block']}, "
                      f"smem {nbytes[0]}/{nbytes[1]} B: "
                      + (f"{rec['ms']:9.2f} ms {rec['tflops']:6.2f} TFLOP/s" if rec["ms"]
                         else "WRONG")
                      + (f", max|v4 - v3|/max|v3| {rec['max_rel_diff_vs_v3']:.1e}"
                         if "max_rel_diff_vs_v3" in rec else ""), flush=True)


def table(records):
    rows = [f"{'shape':<16} {'causal':<6} {'ver':<4} {'tiles (Br,Bc,TM,TN)':<20} {'block':>5} "
            f"{'smem dKdV/dQ':>13} {'ms':>9} {'TFLOP/s':>8} {'x v3':>6} {'vs v3':>8}"]
    timed = [r for r in records if r["kind"] == "time"]
    v3 = {(tuple(r["shape"]), r["causal"]): r["ms"] for r in timed if r["version"] == "v3"}
    for r in timed:
        base = v3.get((tuple(r["shape"]), r["causal"]))
        speed = f"{base / r['ms']:6.2f}" if r["ms"] and base else f"{'':>6}"
        diff = r.get("max_rel_diff_vs_v3")
        rows.append(f"{'x'.join(map(str, r['shape'])):<16} {str(r['causal']):<6} "
                    f"{r['version']:<4} {str(tuple(r['tiles'])):<20} {r['block']:>5} "
                    f"{'/'.join(map(str, r['shared_bytes'])):>13} "
                    + (f"{r['ms']:9.2f} {r['tflops']:8.2f} " if r["ms"]
                       else f"{'WRONG':>9} {'':>8} ")
                    + speed + (f" {diff:8.1e}" if diff is not None else ""))
    return "\n".join(rows)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="write the records as JSON to this path")
    ap.add_argument("--budget-s", type=float, default=140.0,
                    help="start no new check or timing after this many seconds (default 140)")
    ap.add_argument("--sim", action="store_true",
                    help="tiny shapes, for trying the script under NUMBA_ENABLE_CUDASIM=1")
    ap.add_argument("--skip-checks", action="store_true", help="skip (a)")
    args = ap.parse_args(argv)
    if args.sim != simulating():
        sys.exit("--sim needs NUMBA_ENABLE_CUDASIM=1, and the simulator needs --sim (its "
                 "timings mean nothing, its shapes must be tiny)")
    if not args.sim and numbaflash.backend() != "gpu":
        sys.exit("bwd_v4_sweep.py needs a GPU (or --sim under the simulator)")
    checks, shapes, configs, repeats = ((SIM_CHECKS, SIM_SHAPES, SIM_CONFIGS, 1) if args.sim
                                        else (CHECKS, SHAPES, CONFIGS, REPEATS))
    budget = Budget(args.budget_s)
    records = []
    if not args.skip_checks:
        run_checks(checks, records, budget)
    run_timing(shapes, configs, repeats, records, budget)
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
        meta.update({"script": "scripts/bwd_v4_sweep.py", "elapsed_s": budget.elapsed(),
                     "skipped": budget.skipped,
                     "default_v4_tiles": {d: dispatch.default_backward_v4_tiles(d, "float32")
                                          for d in configs}})
        bench.save_json(records, args.out, meta)
        print(f"wrote {args.out}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
