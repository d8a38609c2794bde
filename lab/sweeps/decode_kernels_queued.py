"""The decode call with each tensor-core decode kernel (policy.DECODE_KERNELS: split_kv_mma,
the query rows on the mma's M side; split_kv_mma_t, on its N side), at the GQA decode
shapes, alone and queued back to back, at the planner's split count and at given ones.

    python3 lab/sweeps/decode_kernels_queued.py [--dtypes float16,bfloat16]
        [--shapes b8-gqa,b1-gqa] [--repeats 50] [--splits 0,16,33,50,66]
        [--copies per_copy,hoisted]

``--copies``: split_kv_mma_t once per value of its COPIES (how a thread addresses its
copies: the same bits either way).
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
from numbaflash.kernels.decode import split_kv_mma_t  # noqa: E402
from numbaflash.bench.timing import time_ms, time_ms_queued   # noqa: E402
from decode_gpu import SHAPES, _inputs, _numba      # noqa: E402

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
    ap.add_argument("--copies", default=split_kv_mma_t.COPIES,
                    help="split_kv_mma_t.COPIES values to time, comma-separated")
    args = ap.parse_args()
    keep = policy.DECODE_KERNELS, split_kv_mma_t.COPIES
    builds = [("split_kv_mma", None)] + [("split_kv_mma_t", c)
                                         for c in args.copies.split(",")]
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        S_max = shape[4]
        for dtype in args.dtypes.split(","):
            q, kc, vc = (_numba(x) for x in _inputs(shape, dtype))
            results = {}
            for kernel, copies in builds:
                policy.DECODE_KERNELS = (kernel,)
                if copies is not None:
                    split_kv_mma_t.COPIES = copies
                label = kernel if copies is None else f"{kernel} ({copies})"
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
                        results[label] = (host(out), host(lse))
                    alone = time_ms(call, repeats=args.repeats)
                    queued = time_ms_queued(call, calls=args.repeats, rounds=3)
                    how = "planner's " if not splits else ""
                    print(f"kernels {name} {shape} {dtype} {label} {how}{plan.grid[0]} "
                          f"splits: {alone:.4f} ms alone, {queued:.4f} ms queued", flush=True)
            policy.DECODE_KERNELS, split_kv_mma_t.COPIES = keep
            decode_direct.forget()
            labels = list(results)
            (o1, l1) = results[labels[0]]
            line = f"kernels {name} {dtype}: against {labels[0]}: " + ", ".join(
                f"{other} max |out difference| {np.abs(o1 - o2).max():.3e}, max |lse "
                f"difference| {np.abs(l1 - l2).max():.3e}"
                for other, (o2, l2) in list(results.items())[1:])
            # float16: batch 0 against the float64 reference (the bench's check)
            if dtype == "float16":
                from numbaflash.bench.inference_checks import _checks, _references
                hq, hk, hv = (host(x)[0].astype(np.float16) for x in (q, kc, vc))
                ref, base = _references(dtype, hq, hk, hv)
                for label, (o, lse_) in results.items():
                    got = _checks({"out": o[0], "lse": lse_[0]}, ref, base, dtype)
                    line += "; " + label + ": " + ", ".join(
                        f"{n} {c['max_err']:.2e} (bound {c['bound']:.2e}, ok {c['ok']})"
                        for n, c in got.items())
            print(line, flush=True)
            del q, kc, vc


if __name__ == "__main__":
    main()
