"""The decode call's time against its split count, queued back to back (the GPU's time
when the host keeps ahead), for each decode kernel, at the GQA and batch-1 decode shapes:
the evidence for policy.default_num_splits on the GPU at hand.

    python3 lab/sweeps/decode_splits_queued.py [--dtype float16] [--shapes b1-gqa,b8-gqa]
        [--splits 8,16,24,33,48,66,99,132,198,256] [--repeats 50] [--stages 2,3]

Each line: the shape, the kernel (split_kv_mma and split_kv_mma_t once per ``--stages``:
split_kv_mma.STAGES, the stages of shared memory their K/V tiles are copied into), the
planner's split count, then per split count the ms a call queued (bench's
``time_ms_queued``: the median of three rounds of CUDA events around --repeats calls, on
Numba views of PyTorch tensors), K/V bytes read / time, and the max |difference| of its
out from the planner's count's with the first build (two stages: the same bits for the
same split count). ``--splits
""`` times the planner's count alone. Run 148 ran it at commit bcda63a with a
``--rescale`` option for a lab switch of split_kv_mma since taken out (lab/journal.md).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))

import numpy as np                                   # noqa: E402

import numbaflash                                    # noqa: E402
from numbaflash import decode_direct, policy         # noqa: E402
from numbaflash.bench.timing import time_ms_queued   # noqa: E402
from numbaflash.kernels.decode import split_kv_mma   # noqa: E402
from decode_gpu import SHAPES, _inputs, _kv_bytes, _numba   # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--shapes", default="b1-gqa,b8-gqa")
    ap.add_argument("--splits", default="8,16,24,33,48,66,99,132,198,256")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--kernels", default="split_kv_mma,split_kv")
    ap.add_argument("--stages", default="2,3", help="split_kv_mma.STAGES values to time")
    args = ap.parse_args()
    counts = [int(n) for n in args.splits.split(",") if n]
    keep = policy.DECODE_KERNELS, split_kv_mma.STAGES
    builds = []
    for kernel in args.kernels.split(","):
        for stages in (args.stages.split(",") if kernel.startswith("split_kv_mma")
                       else [None]):
            builds.append((kernel, None if stages is None else int(stages)))
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        S_max = shape[4]
        q, kc, vc = (_numba(x) for x in _inputs(shape, args.dtype))
        n_bytes = _kv_bytes(shape, args.dtype)
        ref = None
        for kernel, stages in builds:
            policy.DECODE_KERNELS = (kernel,)
            split_kv_mma.STAGES = keep[1] if stages is None else stages
            decode_direct.forget()      # repeated calls are keyed without these switches
            try:
                chosen = numbaflash.explain_kvcache(q, kc, vc, cache_seqlens=S_max)[0].grid[0]
            except ValueError as e:
                print(f"splits {name} {kernel}: not run ({e})", flush=True)
                continue
            first = np.asarray(numbaflash.attention_with_kvcache(
                q, kc, vc, cache_seqlens=S_max).copy_to_host(), np.float64)
            ref = first if ref is None else ref
            row = []
            for n in [None] + counts:
                call = lambda: numbaflash.attention_with_kvcache(q, kc, vc, cache_seqlens=S_max,
                                                                 num_splits=n)
                ms = time_ms_queued(call, calls=args.repeats, rounds=3)
                out = np.asarray(call().copy_to_host(), np.float64)
                diff = float(np.max(np.abs(out - ref)))
                row.append(f"{'planner' if n is None else n}:{ms:.4f}ms/"
                           f"{n_bytes / ms / 1e6:.0f}GB/s/d{diff:.1e}")
            what = kernel if stages is None else f"{kernel} stages={stages}"
            print(f"splits-queued {name} {shape} {args.dtype} {what} (planner {chosen}): "
                  + " ".join(row), flush=True)
        policy.DECODE_KERNELS, split_kv_mma.STAGES = keep
        decode_direct.forget()
        del q, kc, vc


if __name__ == "__main__":
    main()
