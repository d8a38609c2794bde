"""The decode call with each tensor-core decode kernel (policy.DECODE_KERNELS: split_kv_mma,
the query rows on the mma's M side; split_kv_mma_t, on its N side), at the GQA decode
shapes, alone and queued back to back, at the planner's split count and at given ones.

    python3 lab/sweeps/decode_kernels_queued.py [--dtypes float16,bfloat16]
        [--shapes b8-gqa,b1-gqa] [--repeats 50] [--splits 0,16,33,50,66]

Each line: the shape, the dtype, the kernel, the split count (0: the planner's, named),
the ms a call timed alone (bench's ``time_ms``) and queued (``time_ms_queued``). Then per
shape and dtype, at the planner's counts: the largest difference between the two
kernels' outs and lses, and (float16) each one's largest error against
numbaflash.reference in float64 on batch 0, with the bench's agreement bound.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))

import numpy as np                                   # noqa: E402

import numbaflash                                    # noqa: E402
from numbaflash import decode_direct, policy         # noqa: E402
from numbaflash.bench.timing import time_ms, time_ms_queued   # noqa: E402
from decode_gpu import SHAPES, _inputs, _numba      # noqa: E402

KERNELS = ("split_kv_mma", "split_kv_mma_t")


def host(x):
    """A device array's (or CUDA tensor's) values on the host, as float64."""
    a = x.cpu().numpy() if hasattr(x, "cpu") else np.asarray(x.copy_to_host())
    return a.astype(np.float32).astype(np.float64)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtypes", default="float16,bfloat16")
    ap.add_argument("--shapes", default="b8-gqa,b1-gqa")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--splits", default="0")
    args = ap.parse_args()
    keep = policy.DECODE_KERNELS
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        S_max = shape[4]
        for dtype in args.dtypes.split(","):
            q, kc, vc = (_numba(x) for x in _inputs(shape, dtype))
            results = {}
            for kernel in KERNELS:
                policy.DECODE_KERNELS = (kernel,)
                for splits in (int(s) for s in args.splits.split(",")):
                    forced = splits or None
                    call = lambda: numbaflash.attention_with_kvcache(
                        q, kc, vc, cache_seqlens=S_max, num_splits=forced, return_lse=True)
                    decode_direct.forget()  # repeated calls are keyed without the switch
                    plan = numbaflash.explain_kvcache(q, kc, vc, cache_seqlens=S_max,
                                                      num_splits=forced)[0]
                    assert plan.kernel == kernel, plan
                    out, lse = call()
                    if not splits:
                        results[kernel] = (host(out), host(lse))
                    alone = time_ms(call, repeats=args.repeats)
                    queued = time_ms_queued(call, calls=args.repeats, rounds=3)
                    how = "planner's " if not splits else ""
                    print(f"kernels {name} {shape} {dtype} {kernel} {how}{plan.grid[0]} "
                          f"splits: {alone:.4f} ms alone, {queued:.4f} ms queued", flush=True)
            policy.DECODE_KERNELS = keep
            decode_direct.forget()
            (o1, l1), (o2, l2) = results[KERNELS[0]], results[KERNELS[1]]
            line = (f"kernels {name} {dtype}: max |out difference| {np.abs(o1 - o2).max():.3e}, "
                    f"max |lse difference| {np.abs(l1 - l2).max():.3e}")
            # float16: batch 0 against the float64 reference (the bench's check)
            if dtype == "float16":
                from numbaflash.bench.inference_checks import _checks, _references
                hq, hk, hv = (host(x)[0].astype(np.float16) for x in (q, kc, vc))
                ref, base = _references(dtype, hq, hk, hv)
                for kernel in KERNELS:
                    o, lse_ = results[kernel]
                    got = _checks({"out": o[0], "lse": lse_[0]}, ref, base, dtype)
                    line += "; " + kernel + ": " + ", ".join(
                        f"{n} {c['max_err']:.2e} (bound {c['bound']:.2e}, ok {c['ok']})"
                        for n, c in got.items())
            print(line, flush=True)
            del q, kc, vc


if __name__ == "__main__":
    main()
