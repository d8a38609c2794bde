"""Registers and spills of backward v9's dQ kernel (float16) in its three builds, with its
GPU tiles: plain (one batch, C-contiguous (BH, S, d) arrays), packed rows reading each
sequence from cu_seqlens, and packed rows of equal lengths (the two lengths as kernel
parameters, kernels/sequences.py), the build flash-attn's layout runs in place. ptxas
for sm_90 through nvJitLink, as tests/ptx_check.py links.

    NUMBA_ENABLE_CUDASIM=0 python lab/sweeps/equal_lengths_registers.py [--dims 64,128]
"""
import argparse
import itertools
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

import numba  # noqa: E402
import numpy as np  # noqa: E402
from numba import cuda  # noqa: E402

import ptx_check as pc  # noqa: E402
from half_registers import link  # noqa: E402
from numbaflash.kernels import backward as bwd  # noqa: E402


def signature(build):
    """The dQ kernel's argument types for a build: "plain", "cu_seqlens" or "equal"."""
    f16, f32 = np.dtype(np.float16), np.dtype(np.float32)
    t3, a2 = pc.array(f16, 3), pc.array(f32, 2)
    head = (t3, t3, t3, t3, a2, a2, t3, numba.float32, numba.int64)
    if build == "plain":
        return head
    extra = pc.variant_signature(f32)
    if build == "equal":
        return head + extra[:-1] + (numba.types.UniTuple(numba.int64, 2),)
    return head + extra


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dims", default="64,128")
    args = ap.parse_args()
    v9 = bwd.module("v9")
    for d, causal in itertools.product((int(x) for x in args.dims.split(",")), (False, True)):
        Br, Bc = v9.default_backward_v9_tiles(d, "gpu")["dq"]
        for build in ("plain", "cu_seqlens", "equal"):
            kernel = v9.make_backward_dq_v9(Br, Bc, d, causal, "float16",
                                            varlen=build != "plain",
                                            equal_lengths=build == "equal")
            ptx, _ = cuda.compile_ptx(kernel.py_func, signature(build), cc=(9, 0))
            got = link(ptx, None)
            print(f"backward_dq_v9 float16 d={d} {'causal' if causal else 'full':6} "
                  f"({Br}, {Bc}) {build:10}: {got['registers']} registers, "
                  f"{got['spill_stores']} bytes spill stores, {got['spill_loads']} loads",
                  flush=True)


if __name__ == "__main__":
    main()
