"""Registers and spills of the 16-bit kernels' packed-batch builds (Variant(varlen=True)),
forward v10 and backward v9, beside their plain builds: ptxas for sm_90 through
nvJitLink, as tests/ptx_check.py links, with each version's GPU tiles and register cap. The packed arrays are (heads, total, d)
strided views (layout "A"), lse and D C-contiguous, as numbaflash/varlen.py passes them.

    NUMBA_ENABLE_CUDASIM=0 python lab/sweeps/packed_half_registers.py [--dims 64,128]
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


def signatures(half, packed):
    """(dkdv, dq) argument types: plain C-contiguous arrays, or the packed views and the
    variant arguments."""
    store = np.dtype(np.uint16) if half == "bfloat16" else np.dtype(half)
    f32 = np.dtype(np.float32)
    layout = "A" if packed else "C"
    t3 = numba.types.Array(numba.from_dtype(store), 3, layout)
    a2 = pc.array(f32, 2)
    scale, offset = numba.float32, numba.int64
    extra = pc.variant_signature(f32) if packed else ()
    return ((t3, t3, t3, t3, a2, a2, t3, t3, scale, offset) + extra,
            (t3, t3, t3, t3, a2, a2, t3, scale, offset) + extra)


def backward_v9(d, causal, half, packed):
    v9 = bwd.module("v9")
    tiles = v9.default_backward_v9_tiles(d, "gpu")
    sig = dict(zip(("dkdv", "dq"), signatures(half, packed)))
    for kind in ("dkdv", "dq"):
        Br, Bc = tiles[kind]
        if kind == "dkdv":
            cap = v9.V9_DKDV_MAX_REGISTERS if d <= v9.V9_CAP_MAX_HEAD_DIM else None
            k = v9.make_backward_dkdv_v9(Br, Bc, d, causal, half, max_registers=cap,
                                         varlen=packed)
        else:
            cap = None
            k = v9.make_backward_dq_v9(Br, Bc, d, causal, half, varlen=packed)
        ptx, _ = cuda.compile_ptx(k.py_func, sig[kind], cc=(9, 0))
        name = f"backward_{kind}_v9 {half} d={d} {'causal' if causal else 'full'} ({Br}, {Bc})"
        yield name + (f", held to {cap}" if cap else ""), link(ptx, cap)


def forward_v10(d, causal, half, packed):
    from numbaflash.kernels import forward as fwd
    from numbaflash.kernels.plan import DYNAMIC_SHARED_MEM_LIMIT
    v10 = fwd.module("v10")
    Br, Bc = v10.tiles_within(d, DYNAMIC_SHARED_MEM_LIMIT)
    store = np.dtype(np.uint16) if half == "bfloat16" else np.dtype(half)
    f32 = np.dtype(np.float32)
    t3 = numba.types.Array(numba.from_dtype(store), 3, "A" if packed else "C")
    sig = ((t3, t3, t3, t3, pc.array(f32, 2), numba.float32, numba.int64)
           + (pc.variant_signature(f32) if packed else ()))
    k = v10.make_forward_v10(Br, Bc, d, causal, v10.v7_chunk(d, Bc), half, varlen=packed)
    ptx, _ = cuda.compile_ptx(k.py_func, sig, cc=(9, 0))
    name = f"forward_v10 {half} d={d} {'causal' if causal else 'full'} ({Br}, {Bc})"
    # The launch contract's cap (v10_max_registers), and for a packed build also the
    # plain build's cap, which the contract does not give it
    caps = [None if packed else v10.v10_max_registers(d)]   # the contract of its day
    if packed and v10.v10_max_registers(d):
        caps.append(v10.v10_max_registers(d))
    for cap in caps:
        yield name + (f", held to {cap}" if cap else ""), link(ptx, cap)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--halves", default="float16")
    args = ap.parse_args()
    for d, causal, half in itertools.product([int(x) for x in args.dims.split(",")],
                                             (False, True), args.halves.split(",")):
        for packed in (False, True):
            for name, info in itertools.chain(forward_v10(d, causal, half, packed),
                                              backward_v9(d, causal, half, packed)):
                keep = {k: info[k] for k in ("registers", "spill_stores", "spill_loads")}
                print(f"{'packed' if packed else 'plain '} {name}: {keep}", flush=True)


if __name__ == "__main__":
    main()
