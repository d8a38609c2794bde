"""A small workload for compute-sanitizer: every kernel version on ragged shapes.

    compute-sanitizer --tool memcheck python scripts/sanitize_target.py

Shapes are small (the sanitizer slows kernels down 10-100x) but cross tile boundaries
with ragged tails, Sq != Sk in both directions, both causal alignments, and fully masked
rows, so every guard in the kernels is exercised. Prints one line per call.
"""

import numpy as np
from numba import cuda

import numbaflash
from numbaflash.kernels.backward import VERSIONS as BACKWARD_VERSIONS
from numbaflash.kernels.forward import VERSIONS as FORWARD_VERSIONS

CASES = [  # (B, H, Sq, Sk, d, causal)
    (1, 2, 77, 77, 64, None),
    (1, 2, 77, 130, 64, "bottom_right"),
    (1, 2, 130, 45, 64, "bottom_right"),     # rows 0..84 see no key
    (1, 1, 100, 61, 128, "top_left"),
    (2, 1, 33, 1, 3, None),
    (1, 1, 40, 70, 256, "bottom_right"),
]


def main():
    rng = np.random.default_rng(0)
    for B, H, Sq, Sk, d, causal in CASES:
        for dtype in (np.float32, np.float64, np.float16):
            q, k, v = (cuda.to_device(rng.standard_normal((B, H, S, d)).astype(dtype))
                       for S in (Sq, Sk, Sk))
            for version in FORWARD_VERSIONS:
                try:
                    out, lse = numbaflash.attention(q, k, v, causal=causal, return_lse=True,
                                                    version=version)
                except ValueError as e:     # e.g. v3 with float64: says why, runs nothing
                    print(f"forward {version} {np.dtype(dtype).name} d={d}: not run ({e})")
                    continue
                cuda.synchronize()
                print(f"forward {version} {(B, H, Sq, Sk, d)} {causal} {np.dtype(dtype).name}: ok",
                      flush=True)
            dout = cuda.to_device(rng.standard_normal((B, H, Sq, d)).astype(dtype))
            for version in BACKWARD_VERSIONS:
                try:
                    numbaflash.attention_backward(dout, q, k, v, out, lse, causal=causal,
                                                  version=version)
                except ValueError as e:     # e.g. v2 (atomics) with float16: says why
                    print(f"backward {version} {np.dtype(dtype).name}: not run ({e})")
                    continue
                cuda.synchronize()
                print(f"backward {version} {(B, H, Sq, Sk, d)} {causal} "
                      f"{np.dtype(dtype).name}: ok", flush=True)


if __name__ == "__main__":
    main()
