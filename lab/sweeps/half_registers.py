"""ptxas's registers and spills for the 16-bit kernels with and without a register cap: no GPU.

    NUMBA_ENABLE_CUDASIM=0 python lab/sweeps/half_registers.py

Forward v10 (float16) at d = 64 and 128 with its tiles and chunks, and backward v9's dK/dV
kernel (float16, d = 64, (64, 64)), each compiled to PTX by Numba and linked for sm_90 by
nvJitLink three ways: as ptxas likes, with -maxrregcount=128 and with 96. The caps the
kernels' files apply (V10_MAX_REGISTERS, V9_DKDV_MAX_REGISTERS) come from these lines and
the GPU times in lab/runs/2026-12-05/108_sweep_after.txt.
"""

import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests"))
os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")

from numba import cuda  # noqa: E402

import ptx_check  # noqa: E402
from numbaflash.kernels.backward import v9_ldmatrix as v9  # noqa: E402
from numbaflash.kernels.forward import v10_ldmatrix as v10  # noqa: E402


def link(ptx, cap):
    """ptxas's report for ``ptx`` linked for sm_90 with -maxrregcount=cap (None: none)."""
    from cuda.bindings import nvjitlink
    options = ["-arch=sm_90", "-verbose"] + ([f"-maxrregcount={cap}"] if cap else [])
    handle = nvjitlink.create(len(options), options)
    data = ptx.encode()
    nvjitlink.add_data(handle, nvjitlink.InputType.PTX, data, len(data), "kernel")
    nvjitlink.complete(handle)
    buf = bytearray(nvjitlink.get_info_log_size(handle))
    nvjitlink.get_info_log(handle, buf)
    nvjitlink.destroy(handle)
    return ptx_check.parse_link_log(buf.decode(errors="replace"))


def main():
    f16, f32 = np.dtype(np.float16), np.dtype(np.float32)
    fsig = ptx_check.forward_signature(f16, f32)
    _, dkdv_sig, _, _ = ptx_check.backward_signatures(f16, f32)
    dkdv_sig = dkdv_sig[:-len(ptx_check.variant_signature(f32))]
    builds = []
    for d, Br, Bc, chunk in ((64, 128, 128, 32), (64, 64, 64, 32), (128, 128, 64, 16),
                             (128, 64, 64, 16)):
        for causal in (False, True):
            builds.append((f"forward v10 d={d} ({Br}, {Bc}) chunk {chunk} causal={causal}",
                           v10.make_forward_v10(Br, Bc, d, causal, chunk), fsig))
    for causal in (False, True):
        builds.append((f"backward v9 dK/dV d=64 (64, 64) causal={causal}",
                       v9.make_backward_dkdv_v9(64, 64, 64, causal), dkdv_sig))
    for name, kernel, sig in builds:
        ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=(9, 0))
        for cap in (None, 128, 96):
            r = link(ptx, cap)
            print(f"{name}, cap {cap or '-'}: {r['registers']} registers, stack "
                  f"{r['stack_bytes']} bytes, spill stores {r['spill_stores']} bytes",
                  flush=True)


if __name__ == "__main__":
    main()
