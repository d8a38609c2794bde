"""Which Numba code makes ptxas serialise a kernel's wgmma (note C7509)? CPU only.

Four small sm_90a kernels built from the intrinsics of scripts/sm90a_probe.py and
lab/sweeps/wgmma_tf32_gpu.py, each compiled to PTX by numba-cuda and linked by
nvJitLink for sm_90a; prints ptxas's notes for each. Only the kernel whose fill loop
steps by ``cuda.blockDim.x`` gets the note: Numba computes that loop's trip count with a
64-bit division, which ptxas expands into a call of its own subroutine, and one call
anywhere in a kernel makes ptxas serialise every wgmma in it.

    NUMBA_ENABLE_CUDASIM=0 python lab/sweeps/wgmma_serialised_probe.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import numba  # noqa: E402
from numba import cuda, types  # noqa: E402
from numba.cuda.cudadrv import driver  # noqa: E402

import wgmma_tf32_gpu as w  # noqa: E402

probe = w.probe
MMA = w.wgmma_tf32_ss(64)
ZERO = w.zeros(32)
F32A = types.float32[::1]


def link(fn, name):
    ptx, _ = cuda.compile_ptx(fn, (F32A, types.float32), cc=(9, 0, "a"))
    linker = driver._Linker(cc=(9, 0, "a"))
    linker.add_ptx(ptx.encode())
    linker.complete()
    notes = [line for line in linker.info_log.splitlines() if "C75" in line]
    print(f"{name}: div.s64 in PTX: {'div.s64' in ptx}, call in PTX: "
          f"{any(x.strip().startswith('call') for x in ptx.splitlines())}; ptxas: "
          + ("; ".join(n.split(" in the function")[0].strip() for n in notes) or "no note"))


@cuda.jit(device=True, inline=True)
def wgmma_body(S, out):
    base = w.shared_address(S)
    acc = ZERO()
    probe.wgmma_fence()
    for it in range(100):
        acc = MMA(acc, w.descriptor(base, 128, 1024), w.descriptor(base, 128, 1024),
                  numba.uint32(1))
        probe.wgmma_commit()
        probe.wgmma_wait0()
    for i in range(32):
        out[i] = acc[i]


def wgmma_loop(out, scale):
    S = cuda.shared.array(4096, numba.float32)
    wgmma_body(S, out)


def dynamic_index_sum(out, scale):
    S = cuda.shared.array(4096, numba.float32)
    base = w.shared_address(S)
    probe.wgmma_fence()
    acc = MMA(ZERO(), w.descriptor(base, 128, 1024), w.descriptor(base, 128, 1024),
              numba.uint32(0))
    probe.wgmma_commit()
    probe.wgmma_wait0()
    total = numba.float32(0)
    for i in range(32):
        total += acc[i]
    out[0] = total


def fill_step_constant(out, scale):
    S = cuda.shared.array(4096, numba.float32)
    for i in range(cuda.threadIdx.x, 4096, 128):
        S[i] = scale
    w.fence_proxy_async()
    cuda.syncthreads()
    wgmma_body(S, out)


def fill_step_block_size(out, scale):
    S = cuda.shared.array(4096, numba.float32)
    for i in range(cuda.threadIdx.x, 4096, cuda.blockDim.x):
        S[i] = scale
    w.fence_proxy_async()
    cuda.syncthreads()
    wgmma_body(S, out)


if __name__ == "__main__":
    for fn in (wgmma_loop, dynamic_index_sum, fill_step_constant, fill_step_block_size):
        link(fn, fn.__name__)
