"""Each backward kernel timed on its own, for a list of tiles: where the backward's time
goes, and which tiles suit each of its kernels.

    python3 scripts/bwd_kernels.py                                   # GPU, about 2 minutes
    python3 scripts/bwd_kernels.py --d 128 --tiles 64x64,64x128,128x64 --versions v6
    python3 scripts/bwd_kernels.py --d 64 --tiles default,32x64/64x32 --pairs no,yes
    python3 scripts/bwd_kernels.py --d 64 --tiles default --chunks 32:16

For each head dim, causal no and yes, version and (Br, Bc): the public planner's kernels
(``explain_backward``) are launched one at a time on the same device inputs, each
between two CUDA events, median of --repeats after one untimed run (compilation). The
finite-input check is not timed (it is one kernel per call, the same for every tile).
Before it is timed, every configuration's gradients (all kernels, in order) are compared
with those of the default plan on the same inputs: max |ours - default| / max |default|
above 1e-4 is WRONG, and its times are not results. Float32, standard normal inputs,
(B, H, N) of --shape. ``--pairs yes`` runs backward v6's kernels with their streamed
tiles split once as staged (``pairs`` of make_backward_dkdv_v6 / make_backward_dq_v6),
where that fits the device's shared memory. GPU only (the tensor-core kernels do not run on the simulator).
"""

import argparse
import os
import sys
from dataclasses import replace

import numpy as np
from numba import cuda

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

import numbaflash  # noqa: E402
from numbaflash import arrays, policy  # noqa: E402
from numbaflash.bench import time_ms  # noqa: E402
from numbaflash.kernels.backward import v5_tensor_cores, v6_split_pairs  # noqa: E402
from numbaflash.kernels.plan import Plans, device_dynamic_shared_limit  # noqa: E402
from numbaflash.launcher import launch_backward  # noqa: E402
from numbaflash.validate import check_backward_inputs  # noqa: E402

AGREE = 1e-4


def with_pairs(plans, d):
    """Backward v6 ``plans`` with their dK/dV and dQ kernels on split pairs; None when a
    kernel would need more shared memory than the device has, or there is no v6 kernel."""
    bytes_of = {"backward_dkdv_v6": v5_tensor_cores.dkdv_v5_shared_bytes,
                "backward_dq_v6": v5_tensor_cores.dq_v5_shared_bytes}
    out = []
    for plan in plans:
        if plan.kernel in bytes_of:
            need = bytes_of[plan.kernel](plan.Br, plan.Bc, d, True)
            if need > device_dynamic_shared_limit():
                return None
            plan = replace(plan, pairs=True, shared_bytes=need)
        out.append(plan)
    return Plans(out) if any(plan.pairs for plan in out) else None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="2x16x4096", help="B x H x N")
    ap.add_argument("--d", default="64,128")
    ap.add_argument("--tiles", default="64x64,64x128,128x64,128x128",
                    help="BrxBc (both kernels) or BrxBc/BrxBc (dK/dV's, dQ's), ...; "
                         "'default' for the planner's rule")
    ap.add_argument("--versions", default="v6")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--pairs", default="no",
                    help="no, yes or no,yes: backward v6 as planned, and with its streamed "
                         "tiles (dK/dV kernel: Qi, dOi; dQ kernel: Kj, Vj) as split pairs")
    ap.add_argument("--chunks", default=None,
                    help="DKDV:DQ, backward v6's rows a step takes in each kernel, for the "
                         "whole run (default: v6_split_pairs.V6_CHUNKS)")
    args = ap.parse_args(argv)
    if args.chunks:
        a, b = (int(x) for x in args.chunks.split(":"))
        v6_split_pairs.V6_CHUNKS.update(dkdv=a, dq=b)
    print(f"backward v6 chunks: {v6_split_pairs.V6_CHUNKS}", flush=True)
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
                    # "BrxBc" for both kernels, "BrxBc/BrxBc" for dK/dV's and dQ's
                    tiles = None if text == "default" else tuple(
                        tuple(int(x) for x in one.split("x")) for one in text.split("/"))
                    if tiles is not None and len(tiles) == 1:
                        tiles = tiles[0]
                    try:
                        plans = policy.plan_backward(p, version, tiles)
                    except ValueError as e:
                        print(f"d={d} causal={causal} {version} {text}: not run ({e})",
                              flush=True)
                        continue
                    for pairs in (x == "yes" for x in args.pairs.split(",")):
                        run = with_pairs(plans, d) if pairs else plans
                        if run is None:
                            print(f"d={d} causal={causal} {version} {text} pairs: not run "
                                  f"(no v6 kernel, or over the device's shared memory)", flush=True)
                            continue
                        launch_backward(run, p, Q, K, V, O, dO, L, D, dQ, dK, dV)
                        got = [a.copy_to_host().reshape(shape) for a in (dQ, dK, dV)]
                        diff = max(float(np.abs(g.astype(np.float64) - r).max()
                                         / max(np.abs(r).max(), 1e-30))
                                   for g, r in zip(got, ref))
                        ok = diff <= AGREE
                        failed += not ok
                        times = []
                        for plan in run:
                            if not ok:
                                break
                            one = Plans((plan,))
                            times.append(time_ms(lambda: launch_backward(
                                one, p, Q, K, V, O, dO, L, D, dQ, dK, dV), args.repeats,
                                warmup=1))
                        what = " + ".join(f"{pl.kernel} {t:.2f}"
                                          for pl, t in zip(run, times))
                        total = sum(times)
                        smem = "/".join(str(pl.shared_bytes) for pl in run[1:])
                        line = (f"d={d} causal={causal!s:5} {version} tiles {text:>8} "
                                f"{'pairs ' if pairs else ''}(smem {smem} B): "
                                + (f"{what} = {total:.2f} ms" if ok else "WRONG")
                                + f", vs default {diff:.1e}")
                        print(line, flush=True)
                        rows.append(line)
    print(f"{len(rows)} configurations, {failed} WRONG")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
