"""Registers and spills of forward v10's packed build reading the packed arrays as they
are (C-contiguous (total, heads, d), kernels/sequences.py's make_packed_rows) on its
(tiles, heads, batch) grid, beside its plain build: ptxas for sm_90 through nvJitLink, as tests/ptx_check.py links, with the GPU
tiles, unheld and held to the plain build's cap. No GPU.

    NUMBA_ENABLE_CUDASIM=0 python lab/sweeps/packed_rows_registers.py [--dims 64,128]
        [--halves float16,bfloat16] [--forward v10|v8]

``--forward v8``: forward v8 in float32 instead (its default tiles and chunk, plain
attention, the packed build without GQA as flash_attn_func reads (b, s, h, d) in place).
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


def forward_v8(d, causal, half, packed):
    """Forward v8's plain and packed builds, float32 (``half`` unused)."""
    v6, v8 = fwd.module("v6"), fwd.module("v8")
    from numbaflash.kernels.variants import PLAIN, Variant
    Br, Bc = v6.default_v6_tiles(d, "v8", v6.v6_shared_bytes, where="gpu")
    f32 = np.dtype(np.float32)
    t3 = numba.types.Array(numba.float32, 3, "C")
    sig = ((t3, t3, t3, t3, pc.array(f32, 2), numba.float32, numba.int64)
           + pc.variant_signature(f32))
    k = v8.make_forward_v8(Br, Bc, d, causal, v8.v8_chunk(d, Bc),
                           variant=Variant(varlen=True) if packed else PLAIN)
    ptx, _ = cuda.compile_ptx(k.py_func, sig, cc=(9, 0))
    yield f"forward_v8 float32 d={d} {'causal' if causal else 'full'} ({Br}, {Bc}), unheld", \
        link(ptx, None)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--halves", default="float16")
    ap.add_argument("--forward", default="v10", choices=("v10", "v8"))
    args = ap.parse_args()
    build = forward_v8 if args.forward == "v8" else forward_v10
    halves = ["float32"] if args.forward == "v8" else args.halves.split(",")
    for d, causal, half in itertools.product([int(x) for x in args.dims.split(",")],
                                             (False, True), halves):
        for packed, what in ((False, "plain      "), (True, "packed rows")):
            for name, info in build(d, causal, half, packed):
                keep = {k: info[k] for k in ("registers", "spill_stores", "spill_loads")}
                print(f"{what} {name}: {keep}", flush=True)


if __name__ == "__main__":
    main()
