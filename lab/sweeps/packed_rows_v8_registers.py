"""Registers of forward v8's packed build read as it is (forward v10's packed rows,
kernels/sequences.py) beside its plain build, float32, d = 64, its GPU tiles, unheld:
ptxas for sm_90 through nvJitLink. A probe for a patch that is not in the tree: apply
lab/runs/2026-12-06/packed_rows_v8.patch first. No GPU.

    git apply lab/runs/2026-12-06/packed_rows_v8.patch
    NUMBA_ENABLE_CUDASIM=0 python lab/sweeps/packed_rows_v8_registers.py
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")

import numba  # noqa: E402
import numpy as np  # noqa: E402
from numba import cuda  # noqa: E402

import ptx_check as pc  # noqa: E402
from half_registers import link  # noqa: E402
from numbaflash.kernels import forward as fwd  # noqa: E402
from numbaflash.kernels.variants import Variant  # noqa: E402


def main():
    v6, v8 = fwd.module("v6"), fwd.module("v8")
    d, f32 = 64, np.dtype(np.float32)
    Br, Bc = v6.default_v6_tiles(d, "v8", v6.v6_shared_bytes)
    t3 = numba.types.Array(numba.float32, 3, "C")
    sig = (t3, t3, t3, t3, pc.array(f32, 2), numba.float32, numba.int64) + \
        pc.variant_signature(f32)
    for causal in (False, True):
        for packed in (False, True):
            variant = Variant(varlen=True) if packed else Variant()
            k = v8.make_forward_v8(Br, Bc, d, causal, v8.v8_chunk(d, Bc), variant=variant)
            ptx, _ = cuda.compile_ptx(k.py_func, sig, cc=(9, 0))
            info = link(ptx, None)
            keep = {n: info[n] for n in ("registers", "spill_stores", "spill_loads")}
            print(f"forward_v8 float32 d={d} ({Br}, {Bc}) {'causal' if causal else 'full'} "
                  f"{'packed rows' if packed else 'plain'}: {keep}", flush=True)


if __name__ == "__main__":
    main()
