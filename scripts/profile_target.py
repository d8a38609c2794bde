"""One forward (or backward) version at one shape, a few times: the workload for a profiler.

    python3 scripts/profile_target.py --version v6 --shape 2x16x4096x64 [--causal]
    python3 scripts/profile_target.py --backward --version v6 --shape 2x16x4096x64
    ncu --kernel-name regex:forward_v6 --launch-skip 1 --launch-count 1 \\
        --section WarpStateStats --section SchedulerStats --section Occupancy \\
        python3 scripts/profile_target.py --version v6 --shape 2x16x4096x64

Random normal inputs on the device, float32 unless ``--dtype`` says float16 or bfloat16
(bfloat16 through a uint16 device array viewed as ``ml_dtypes.bfloat16``, as
``numbaflash.torch`` passes PyTorch's); ``--tiles Br,Bc[,...]`` passes tiles. The
first call compiles the kernel (skip it in the profiler: --launch-skip 1). With
``--backward`` the forward runs once (default version) and the backward (q serves as
dout) ``--repeats`` times, with ``--version`` and ``--tiles`` for the backward.
"""

import argparse

import numpy as np
from numba import cuda

import numbaflash


def _device(x, dtype):
    """Host float64 values ``x`` as a device array of ``dtype``."""
    if dtype == "bfloat16":
        import ml_dtypes
        bits = x.astype(ml_dtypes.bfloat16).view(np.uint16)
        return cuda.to_device(bits).view(ml_dtypes.bfloat16)
    return cuda.to_device(x.astype(dtype))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--version", default=None)
    ap.add_argument("--shape", default="2x16x4096x64")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--tiles", default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    ap.add_argument("--backward", action="store_true")
    args = ap.parse_args()
    shape = tuple(int(x) for x in args.shape.split("x"))
    tiles = tuple(int(x) for x in args.tiles.split(",")) if args.tiles else None
    rng = np.random.default_rng(0)
    q, k, v = (_device(rng.standard_normal(shape), args.dtype) for _ in range(3))
    if args.backward:
        out, lse = numbaflash.attention(q, k, v, causal=args.causal, return_lse=True)
        print(numbaflash.explain_backward(q, k, v, causal=args.causal, version=args.version,
                                          tiles=tiles))
        for _ in range(args.repeats):
            numbaflash.attention_backward(q, q, k, v, out, lse, causal=args.causal,
                                          version=args.version, tiles=tiles)
        cuda.synchronize()
        print("done")
        return
    print(numbaflash.explain(q, k, v, causal=args.causal, version=args.version, tiles=tiles))
    for _ in range(args.repeats):
        numbaflash.attention(q, k, v, causal=args.causal, version=args.version, tiles=tiles)
    cuda.synchronize()
    print("done")


if __name__ == "__main__":
    main()
