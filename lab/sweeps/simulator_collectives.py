"""Cost of one warp shuffle, one mma (m16n8k8, TF32) and one syncthreads on the CUDA
simulator, in a block of 64 threads (two warps), and of one forward call of v5, v8 and
v7 and one backward call of v6 at a small shape: what numbaflash/kernels/simulated.py's
rendezvous and block barrier cost there.

    NUMBA_ENABLE_CUDASIM=1 python lab/sweeps/simulator_collectives.py [N]

Run it on a tree (PYTHONPATH=tree) to compare trees; the switch interval is the tests'
(2e-4 s).
"""

import sys
import time

sys.setswitchinterval(2e-4)

import numpy as np                      # noqa: E402
from numba import cuda                  # noqa: E402

import numbaflash                       # noqa: E402
from numbaflash.kernels import ptx      # noqa: E402

N = int(sys.argv[1]) if len(sys.argv) > 1 else 100


@cuda.jit
def shuffles(X, Out):
    i = cuda.threadIdx.x
    x = X[i]
    for _ in range(N):
        x = cuda.shfl_xor_sync(0xFFFFFFFF, x, 1)
    Out[i] = x


@cuda.jit
def mmas(X, Out):
    i = cuda.threadIdx.x
    x = X[i]
    for _ in range(N):
        d0, d1, d2, d3 = ptx.mma_tf32(x, x, x, x, x, x, x, x, x, x)
        x = d0 * np.float32(1e-3)
    Out[i] = x


@cuda.jit
def barriers(X, Out):
    i = cuda.threadIdx.x
    x = X[i]
    for _ in range(N):
        cuda.syncthreads()
    Out[i] = x


X = np.ones(64, np.float32)
Out = np.zeros(64, np.float32)
print(f"numbaflash from {numbaflash.__file__}")
for kernel, what in ((shuffles, "shfl_xor_sync"), (mmas, "mma_tf32"), (barriers, "syncthreads")):
    t = time.perf_counter()
    kernel[1, 64](X, Out)
    print(f"{what:14s} {(time.perf_counter() - t) / N * 1e3:7.2f} ms per call (64 threads)")

rng = np.random.default_rng(0)
q, k, v, dout = (rng.uniform(-4, 4, (1, 2, 37, 8)).astype(np.float32) for _ in range(4))
for version in ("v5", "v8"):
    t = time.perf_counter()
    numbaflash.attention(q, k, v, version=version)
    print(f"forward {version} float32 (1, 2, 37, 8): {time.perf_counter() - t:6.2f} s")
h = [x.astype(np.float16) for x in (q, k, v)]
t = time.perf_counter()
numbaflash.attention(*h, version="v7")
print(f"forward v7 float16 (1, 2, 37, 8): {time.perf_counter() - t:6.2f} s")
out, lse = numbaflash.attention(q, k, v, return_lse=True)
for version in ("v4", "v6"):
    t = time.perf_counter()
    numbaflash.attention_backward(dout, q, k, v, out, lse, version=version)
    print(f"backward {version} float32 (1, 2, 37, 8): {time.perf_counter() - t:6.2f} s")
