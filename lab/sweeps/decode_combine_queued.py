"""The decode call with each combine kernel (policy.COMBINE_KERNEL: combine, one load
round trip per split and pass; combine_batched, the same bits with a batch of splits'
loads in flight), at the decode shapes, alone and queued back to back: what the combine
costs a whole call.

    python3 lab/sweeps/decode_combine_queued.py [--dtypes float16,float32]
        [--shapes b8-mha,b8-gqa,b1-mha,b1-gqa] [--repeats 50] [--batches 16]

Each line: the shape, the dtype, the planner's split count, then per combine the ms a
call timed alone (bench's ``time_ms``) and queued (``time_ms_queued``), and whether the
outs and lses of all have the same bits. ``--batches``: combine_batched once per value of
its BATCH (the splits whose loads a thread has in flight at once).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))

import numpy as np                                   # noqa: E402

import numbaflash                                    # noqa: E402
from numbaflash import decode_direct, policy         # noqa: E402
from numbaflash.kernels.decode import combine_batched   # noqa: E402
from numbaflash.bench.timing import time_ms, time_ms_queued   # noqa: E402
from decode_gpu import SHAPES, _inputs, _numba      # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtypes", default="float16,float32")
    ap.add_argument("--shapes", default="b8-mha,b8-gqa,b1-mha,b1-gqa")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--batches", default=str(combine_batched.BATCH))
    args = ap.parse_args()
    keep = policy.COMBINE_KERNEL, combine_batched.BATCH
    builds = [("combine", None)] + [("combine_batched", int(b))
                                    for b in args.batches.split(",")]
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        S_max = shape[4]
        for dtype in args.dtypes.split(","):
            q, kc, vc = (_numba(x) for x in _inputs(shape, dtype))
            call = lambda: numbaflash.attention_with_kvcache(q, kc, vc, cache_seqlens=S_max,
                                                             return_lse=True)
            splits = numbaflash.explain_kvcache(q, kc, vc, cache_seqlens=S_max)[0].grid[0]
            row, bits = [], []
            for combine, batch in builds:
                policy.COMBINE_KERNEL = combine
                if batch is not None and batch != combine_batched.BATCH:
                    combine_batched.BATCH = batch       # read when the kernel is built
                    combine_batched.make_combine_batched.cache_clear()
                decode_direct.forget()      # repeated calls are keyed without this switch
                out, lse = call()
                bits.append(np.asarray(out.copy_to_host()).tobytes()
                            + np.asarray(lse.copy_to_host()).tobytes())
                alone = time_ms(call, repeats=args.repeats)
                queued = time_ms_queued(call, calls=args.repeats, rounds=3)
                what = combine if batch is None else f"{combine} BATCH={batch}"
                row.append(f"{what}: {alone:.4f} ms alone, {queued:.4f} ms queued")
            policy.COMBINE_KERNEL = keep[0]
            if combine_batched.BATCH != keep[1]:
                combine_batched.BATCH = keep[1]
                combine_batched.make_combine_batched.cache_clear()
            decode_direct.forget()
            print(f"combine {name} {shape} {dtype} ({splits} splits): " + "; ".join(row)
                  + f"; same bits: {len(set(bits)) == 1}", flush=True)
            del q, kc, vc


if __name__ == "__main__":
    main()
