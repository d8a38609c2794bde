"""Registers and spills of forward v10's packed build reading the packed arrays as they
are (C-contiguous (total, heads, d), kernels/sequences.py's make_packed_rows) on its
(tiles, heads, batch) grid, beside its plain build: ptxas for sm_90 through nvJitLink, as tests/ptx_check.py links, with the GPU
tiles, unheld and held to the plain build's cap. No GPU.

    NUMBA_ENABLE_CUDASIM=0 python lab/sweeps/packed_rows_registers.py [--dims 64,128]
        [--halves float16,bfloat16]
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
os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")

import numba  # noqa: E402
import numpy as np  # noqa: E402
from numba import cuda  # noqa: E402

import ptx_check as pc  # noqa: E402
from half_registers import link  # noqa: E402
from numbaflash.kernels import forward as fwd  # noqa: E402
from numbaflash.kernels.plan import DYNAMIC_SHARED_MEM_LIMIT  # noqa: E402


def forward_v10(d, causal, half, packed):
    v10 = fwd.module("v10")
    Br, Bc = v10.tiles_within(d, DYNAMIC_SHARED_MEM_LIMIT)
    store = np.dtype(np.uint16) if half == "bfloat16" else np.dtype(half)
    f32 = np.dtype(np.float32)
    t3 = numba.types.Array(numba.from_dtype(store), 3, "C")
    sig = ((t3, t3, t3, t3, pc.array(f32, 2), numba.float32, numba.int64)
           + (pc.variant_signature(f32) if packed else ()))
    k = v10.make_forward_v10(Br, Bc, d, causal, v10.v7_chunk(d, Bc), half, varlen=packed)
    ptx, _ = cuda.compile_ptx(k.py_func, sig, cc=(9, 0))
    name = f"forward_v10 {half} d={d} {'causal' if causal else 'full'} ({Br}, {Bc})"
    caps = [None] + ([v10.v10_max_registers(d)] if v10.v10_max_registers(d) else [])
    for cap in caps:
        yield name + (f", held to {cap}" if cap else ", unheld"), link(ptx, cap)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--halves", default="float16")
    args = ap.parse_args()
    for d, causal, half in itertools.product([int(x) for x in args.dims.split(",")],
                                             (False, True), args.halves.split(",")):
        for packed, what in ((False, "plain      "), (True, "packed rows")):
            for name, info in forward_v10(d, causal, half, packed):
                keep = {k: info[k] for k in ("registers", "spill_stores", "spill_loads")}
                print(f"{what} {name}: {keep}", flush=True)


if __name__ == "__main__":
    main()
