"""One backward version timed at (2, 16, 4096, d) in float16 (or float32): a quick
before/after probe.

    python3 lab/sweeps/backward_time.py --version v9 --dims 64,128 [--causal] [--repeats 10]
                                        [--dtype float16|float32]

Prints, per d, the median ms of numbaflash.attention_backward(version=...) (CUDA events,
numbaflash.bench.time_ms, 3 warm-ups) and a checksum of the gradients' bits, so that two
trees run one after the other (PYTHONPATH pointing at each tree's numbaflash/) can be
compared for speed and for same bits. The max error of the first (batch, head) against
numbaflash.reference in float64 is printed too. GPU only.
"""

import argparse
import hashlib

import numpy as np
from numba import cuda

import numbaflash
from numbaflash import reference
from numbaflash.bench import time_ms


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--version", default="v9")
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--dtype", default="float16", choices=("float16", "float32"))
    args = ap.parse_args()
    dtype = np.dtype(args.dtype)
    bits_of = np.uint16 if dtype == np.float16 else np.uint32
    causal = "bottom_right" if args.causal else None
    rng = np.random.default_rng(0)
    for d in (int(x) for x in args.dims.split(",")):
        host = [rng.standard_normal((2, 16, 4096, d)).astype(dtype) for _ in range(4)]
        q, k, v, do = (cuda.to_device(x) for x in host)
        out, lse = numbaflash.attention(q, k, v, causal=causal, return_lse=True)

        def call():
            return numbaflash.attention_backward(do, q, k, v, out, lse, causal=causal,
                                                 version=args.version)
        grads = [g.copy_to_host() for g in call()]
        bits = hashlib.sha256(b"".join(g.view(bits_of).tobytes() for g in grads))
        want = reference.backward(*(x[0, 0].astype(np.float64) for x in (host[3], host[0],
                                                                          host[1], host[2])),
                                  causal=bool(causal))
        errs = [float(np.abs(g[0, 0].astype(np.float64) - w).max()) for g, w in zip(grads, want)]
        ms = time_ms(call, repeats=args.repeats, warmup=3)
        print(f"backward {args.version} {args.dtype} (2, 16, 4096, {d}) causal={bool(causal)}: "
              f"{ms:.3f} ms, "
              f"bits {bits.hexdigest()[:16]}, max err dq/dk/dv "
              + "/".join(f"{e:.3g}" for e in errs), flush=True)


if __name__ == "__main__":
    main()
