"""Backward v5 and v6 (tensor cores) on a GPU: check them against float64 references, then
time them against v4, the SIMT default before them.

    python scripts/bwd_v5_sweep.py                  # on a GPU machine (about 3 minutes)
    python scripts/bwd_v5_sweep.py --out bwd.json --configs 64:v5:64x64,128:v6:32x16

(a) Check. v5 and v6 (--check-versions) with their default tiles on the shapes in CHECKS
    (causal and not, Sq != Sk, fully masked rows, d = 59, 64 and 128, float32), each
    against the dense float64 reference with the test suite's rule
    (tests/backward_checks.py: ``check_backward``), printed as error / bound per
    gradient. Inputs are the tests' own (strategies.make_case: float32-exact, uniform in
    [-4, 4]). Then the non-finite contract: v5 or v6 asked for with a NaN input raises
    ValueError, and the default runs v4 (its gradients bitwise v4's).
(b) Time. At SHAPES (or --shapes), float32, standard normal inputs, causal no and yes:
    attention_backward (the public call on device arrays: for v5 and v6 the finite
    check, the D kernel, the dK/dV kernel and the dQ kernel, output allocation included)
    with v4 (default tiles) and each (version, tiles) of --configs (default CONFIGS;
    None: the version's rule; "v6cAxB": v6 with chunks of A and B rows). Each result is
    compared with v4's on the timed shape (max |ours - v4| / max |v4| per gradient;
    above 1e-4 is WRONG and its time is not a result). Timing: CUDA events, one untimed
    call first (compilation), then the median of REPEATS.

Prints one table; with --out, also writes the records as JSON (numbaflash.bench.save_json).
Stops starting new work after --budget-s seconds (default 200). Exit status 1 if any check
failed or any result was WRONG. GPU only (v5 and v6 cannot run on the simulator).
"""

import argparse
import os
import sys

import numpy as np
from numba import cuda

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import numbaflash  # noqa: E402
from numbaflash import bench, dispatch  # noqa: E402
from numbaflash.kernels import backward as bwd  # noqa: E402
from backward_checks import check_backward  # noqa: E402  (tests/)
from bwd_v4_sweep import Budget, time_ms  # noqa: E402  (scripts/)
from strategies import make_case  # noqa: E402  (tests/)

# (a): (B, H, Sq, Sk, d, causal), float32
CHECKS = [
    (1, 2, 1024, 1024, 64, None),
    (1, 2, 1000, 1000, 64, "bottom_right"),
    (1, 1, 4096, 4096, 64, None),                # long sums over Sq and Sk
    (1, 1, 300, 1100, 128, "bottom_right"),     # Sq < Sk
    (1, 1, 1100, 300, 128, "bottom_right"),     # rows 0..799 see no key
    (1, 1, 700, 513, 128, "top_left"),
    (2, 1, 777, 777, 128, None),
    (1, 3, 129, 77, 59, None),                  # d not a multiple of 8
]
SHAPES = [(2, 16, 4096, 64), (2, 16, 4096, 128), (1, 16, 16384, 64)]
CONFIGS = {64: [("v5", None), ("v6", None)], 128: [("v5", None), ("v6", None)]}
AGREE = 1e-4
REPEATS = 5


def tiles_of(plans):
    """The tiles (one pair, or the dK/dV kernel's and the dQ kernel's if they differ) and
    the two kernels' shared memory."""
    kv, q = (plans[1].Br, plans[1].Bc), (plans[2].Br, plans[2].Bc)
    return (kv if kv == q else (kv, q)), (plans[1].shared_bytes, plans[2].shared_bytes)


def run_checks(records, budget, version):
    print(f"(a) {version} (default tiles) against the float64 reference, the tests' rule",
          flush=True)
    for B, H, Sq, Sk, d, causal in CHECKS:
        what = f"check {(B, H, Sq, Sk, d)} float32 causal={causal}"
        if not budget.allows(what):
            continue
        case = make_case(B, H, Sq, Sk, d, "float32", causal, None, None, "uniform", 0, True)
        out, lse = numbaflash.attention(case.q, case.k, case.v, causal=causal,
                                        return_lse=True)
        plans = numbaflash.explain_backward(case.q, case.k, case.v, causal=causal,
                                            version=version)
        grads = numbaflash.attention_backward(case.dout, case.q, case.k, case.v, out, lse,
                                              causal=causal, version=version)
        try:
            detail = check_backward(case.dout, case.q, case.k, case.v, out, lse, grads,
                                    causal=causal)
            ok = True
            text = "ok, error/bound " + ", ".join(f"{k} {e / b if b else 0:.2f}"
                                                  for k, (e, b) in detail.items())
        except AssertionError as e:
            ok, text = False, "FAILED: " + str(e)[:500]
        records.append({"kind": "check", "version": version, "shape": [B, H, Sq, Sk, d],
                        "causal": causal, "tiles": list(tiles_of(plans)[0]), "ok": ok,
                        "detail": text})
        print(f"[{budget.elapsed():5.0f} s] {what} tiles {tiles_of(plans)[0]}: {text}",
              flush=True)
    # the non-finite contract
    case = make_case(1, 1, 64, 64, 64, "float32", None, None, None, "uniform", 0, True)
    out, lse = numbaflash.attention(case.q, case.k, case.v, return_lse=True)
    k = case.k.copy()
    k[0, 0, 5, 3] = np.nan
    try:
        numbaflash.attention_backward(case.dout, case.q, k, case.v, out, lse, version=version)
        ok, text = False, f"FAILED: {version} ran on a NaN input"
    except ValueError as e:
        ok, text = True, f"ok, ValueError: {str(e)[:160]}"
    got = numbaflash.attention_backward(case.dout, case.q, k, case.v, out, lse)
    want = numbaflash.attention_backward(case.dout, case.q, k, case.v, out, lse, version="v4")
    same = all(np.array_equal(a, b, equal_nan=True) for a, b in zip(got, want))
    ok = ok and same
    text += f"; default equals v4 bitwise: {same}"
    records.append({"kind": "check", "version": version, "shape": [1, 1, 64, 64, 64],
                    "causal": None, "tiles": None, "ok": ok, "detail": "NaN input: " + text})
    print(f"[{budget.elapsed():5.0f} s] NaN input: {text}", flush=True)


def run_timing(shapes, configs, records, budget):
    print("(b) backward v4 vs v5, float32, CUDA events, median", flush=True)
    for shape in shapes:
        B, H, N, d = shape
        rng = np.random.default_rng(list(shape))
        q, k, v, dout = (cuda.to_device(rng.standard_normal(shape).astype(np.float32))
                         for _ in range(4))
        for causal in (False, True):
            if not budget.allows(f"inputs {shape} causal={causal}"):
                continue
            out, lse = numbaflash.attention(q, k, v, causal=causal, return_lse=True)
            work = bench.flops(B, H, N, N, d, causal, "backward")
            ref = None
            for name, tiles in [("v4", None)] + configs.get(d, [("v5", None)]):
                what = f"{shape} causal={causal} {name} tiles={tiles or 'default'}"
                if not budget.allows(what):
                    continue
                # "v6c16x32": v6 with 16-row chunks in its dK/dV kernel, 32 in its dQ kernel
                version = name[:2]
                chunks = (bwd.V6_CHUNK, bwd.V6_CHUNK)
                if name.startswith("v6c"):
                    chunks = tuple(int(x) for x in name[3:].split("x"))
                bwd.V6_CHUNKS.update(dkdv=chunks[0], dq=chunks[1])
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
                       "version": name, "tiles_asked": tiles, "tiles": list(t),
                       "shared_bytes": list(nbytes), "ok": True, "ms": None}
                if ref is None:
                    ref = grads
                else:
                    rec["max_rel_diff_vs_v4"] = max(
                        float(np.abs(g - r).max() / max(np.abs(r).max(), 1e-30))
                        for g, r in zip(grads, ref))
                    rec["ok"] = rec["max_rel_diff_vs_v4"] <= AGREE
                if rec["ok"]:
                    rec["ms"] = time_ms(fn, REPEATS)
                    rec["tflops"] = work / rec["ms"] / 1e9
                records.append(rec)
                print(f"[{budget.elapsed():5.0f} s] {what} -> {t}, smem {nbytes[0]}/"
                      f"{nbytes[1]} B: "
                      + (f"{rec['ms']:9.2f} ms {rec['tflops']:6.2f} TFLOP/s" if rec["ms"]
                         else "WRONG")
                      + (f", max|ours - v4|/max|v4| {rec['max_rel_diff_vs_v4']:.1e}"
                         if "max_rel_diff_vs_v4" in rec else ""), flush=True)


def table(records):
    rows = [f"{'shape':<16} {'causal':<6} {'ver':<9} {'tiles':<10} {'smem dKdV/dQ':>13} "
            f"{'ms':>9} {'TFLOP/s':>8} {'x v4':>6} {'vs v4':>8}"]
    timed = [r for r in records if r["kind"] == "time"]
    v4 = {(tuple(r["shape"]), r["causal"]): r["ms"] for r in timed if r["version"] == "v4"}
    for r in timed:
        base = v4.get((tuple(r["shape"]), r["causal"]))
        speed = f"{base / r['ms']:6.2f}" if r["ms"] and base else f"{'':>6}"
        diff = r.get("max_rel_diff_vs_v4")
        rows.append(f"{'x'.join(map(str, r['shape'])):<16} {str(r['causal']):<6} "
                    f"{r['version']:<9} {str(tuple(r['tiles'])):<10} "
                    f"{'/'.join(map(str, r['shared_bytes'])):>13} "
                    + (f"{r['ms']:9.2f} {r['tflops']:8.2f} " if r["ms"]
                       else f"{'WRONG':>9} {'':>8} ")
                    + speed + (f" {diff:8.1e}" if diff is not None else ""))
    return "\n".join(rows)


def parse_configs(text):
    """'64:v5:64x64,64:v6:None,128:v6c16x32:32x16' -> {64: [("v5", (64, 64)), ("v6", None)],
    128: [("v6c16x32", (32, 16))]} ("v6cAxB": v6 with chunks of A rows in its dK/dV
    kernel and B in its dQ kernel)."""
    out = {}
    for item in text.split(","):
        d, version, tiles = item.split(":")
        out.setdefault(int(d), []).append(
            (version, None if tiles == "None" else tuple(int(x) for x in tiles.split("x"))))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="write the records as JSON to this path")
    ap.add_argument("--budget-s", type=float, default=200.0)
    ap.add_argument("--check-versions", default="v5,v6",
                    help="versions (a) checks, comma-separated ('' skips (a))")
    ap.add_argument("--configs", help="versions and tiles per head dim, e.g. "
                                      "64:v5:64x64,64:v6:None,128:v6:32x16")
    ap.add_argument("--shapes", help="B:H:N:d,... (default: SHAPES)")
    args = ap.parse_args(argv)
    if numbaflash.backend() != "gpu":
        sys.exit("bwd_v5_sweep.py needs a GPU: backward v5 runs inline PTX")
    configs = parse_configs(args.configs) if args.configs else CONFIGS
    shapes = ([tuple(int(x) for x in s.split(":")) for s in args.shapes.split(",")]
              if args.shapes else SHAPES)
    budget = Budget(args.budget_s)
    records = []
    for version in args.check_versions.split(","):
        if version:
            run_checks(records, budget, version)
    run_timing(shapes, configs, records, budget)
    print()
    print(table(records))
    bad = [r for r in records if not r["ok"]]
    print(f"\n{len([r for r in records if r['kind'] == 'check'])} checks, "
          f"{len([r for r in records if r['kind'] == 'time'])} timings, {len(bad)} failed or "
          f"WRONG, {len(budget.skipped)} skipped for time; {budget.elapsed():.0f} s")
    if args.out:
        meta = bench.environment()
        meta.update({"script": "scripts/bwd_v5_sweep.py", "elapsed_s": budget.elapsed(),
                     "skipped": budget.skipped,
                     "default_tiles": {
                         **{f"v5-d{d}": dispatch.default_backward_v5_tiles(d, "v5")
                            for d in configs},
                         **{f"v6-d{d}-{'causal' if c else 'full'}":
                            dispatch.default_backward_v6_plan(d, c)
                            for d in configs for c in (False, True)}}})
        bench.save_json(records, args.out, meta)
        print(f"wrote {args.out}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
