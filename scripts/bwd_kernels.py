"""Each backward kernel timed on its own, for a list of tiles: where the backward's time
goes, and which tiles suit each of its kernels.

    python3 scripts/bwd_kernels.py                                   # GPU, about 2 minutes
    python3 scripts/bwd_kernels.py --d 128 --tiles 64x64,64x128,128x64 --versions v6

For each head dim, causal no and yes, version and (Br, Bc): the public planner's kernels
(``explain_backward``) are launched one at a time on the same device inputs, each
between two CUDA events, median of --repeats after one untimed run (compilation). The
finite-input check is not timed (it is one kernel per call, the same for every tile).
Before it is timed, every configuration's gradients (all kernels, in order) are compared
with those of the default plan on the same inputs: max |ours - default| / max |default|
above 1e-4 is WRONG, and its times are not results. Float32, standard normal inputs,
(B, H, N) of --shape. GPU only (the tensor-core kernels do not run on the simulator).
"""

import argparse
import os
import sys

import numpy as np
from numba import cuda

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

import numbaflash  # noqa: E402
from numbaflash import arrays, dispatch  # noqa: E402
from numbaflash.bench import time_ms  # noqa: E402
from numbaflash.validate import check_backward_inputs  # noqa: E402

AGREE = 1e-4


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="2x16x4096", help="B x H x N")
    ap.add_argument("--d", default="64,128")
    ap.add_argument("--tiles", default="64x64,64x128,128x64,128x128",
                    help="Br x Bc, ...; 'default' for the planner's rule")
    ap.add_argument("--versions", default="v6")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    B, H, N = (int(x) for x in args.shape.split("x"))
    failed = 0
    rows = []
    for d in (int(x) for x in args.d.split(",")):
        shape = (B, H, N, d)
        rng = np.random.default_rng(list(shape))
        q, k, v, dout = (cuda.to_device(rng.standard_normal(shape).astype(np.float32))
                         for _ in range(4))
        for causal in (False, True):
            out, lse = numbaflash.attention(q, k, v, causal=causal, return_lse=True)
            ref = [g.copy_to_host() for g in
                   numbaflash.attention_backward(dout, q, k, v, out, lse, causal=causal)]
            p = check_backward_inputs(dout, q, k, v, out, lse, causal, None)
            BH = B * H
            Q, K, V, O, dO = (arrays.as_kernel_array(a, (BH, N, d), "x")
                              for a in (q, k, v, out, dout))
            L = arrays.as_kernel_array(lse, (BH, N), "lse")
            D = cuda.device_array((BH, N), np.float32)
            dQ, dK, dV = (cuda.device_array((BH, N, d), np.float32) for _ in range(3))
            for version in args.versions.split(","):
                for text in args.tiles.split(","):
                    tiles = None if text == "default" else tuple(
                        int(x) for x in text.split("x"))
                    try:
                        plans = dispatch.plan_backward(p, version, tiles)
                    except ValueError as e:
                        print(f"d={d} causal={causal} {version} {text}: not run ({e})",
                              flush=True)
                        continue
                    dispatch.launch_backward(plans, p, Q, K, V, O, dO, L, D, dQ, dK, dV)
                    got = [a.copy_to_host().reshape(shape) for a in (dQ, dK, dV)]
                    diff = max(float(np.abs(g.astype(np.float64) - r).max()
                                     / max(np.abs(r).max(), 1e-30))
                               for g, r in zip(got, ref))
                    ok = diff <= AGREE
                    failed += not ok
                    times = []
                    for plan in plans:
                        if not ok:
                            break
                        one = dispatch.Plans((plan,))
                        times.append(time_ms(lambda: dispatch.launch_backward(
                            one, p, Q, K, V, O, dO, L, D, dQ, dK, dV), args.repeats, warmup=1))
                    what = " + ".join(f"{pl.kernel} {t:.2f}" for pl, t in zip(plans, times))
                    total = sum(times)
                    smem = "/".join(str(pl.shared_bytes) for pl in plans[1:])
                    line = (f"d={d} causal={causal!s:5} {version} tiles {text:>8} "
                            f"(smem {smem} B): " + (f"{what} = {total:.2f} ms" if ok else
                                                    "WRONG") + f", vs default {diff:.1e}")
                    print(line, flush=True)
                    rows.append(line)
    print(f"{len(rows)} configurations, {failed} WRONG")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
