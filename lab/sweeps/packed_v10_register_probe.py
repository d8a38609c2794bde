"""Where forward v10's packed build spends its registers: ptxas (sm_90) on the packed
build (float16, d = 64, (128, 128) tiles, unheld) with parts of kernels/sequences.py's
packed steps swapped for the plain ones, and the arrays typed strided ("A", as
numbaflash/varlen.py passes (heads, total, d) views) or C-contiguous. A probe of
registers only: most of these builds would index the packed arrays wrongly. No GPU.

    NUMBA_ENABLE_CUDASIM=0 python lab/sweeps/packed_v10_register_probe.py

Each line: the layout, which steps are the packed ones (the rest plain), registers.
"locate from parameters" is a locate that takes the lengths from kernel parameters (the
seqs array's shape stands in for them), as a batch of equal lengths could: uniform, where
the packed locate reads cu_seqlens from memory.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests"))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")

import numba  # noqa: E402
import numpy as np  # noqa: E402
from numba import cuda, int64  # noqa: E402

import ptx_check as pc  # noqa: E402
from numbaflash.kernels import forward as fwd  # noqa: E402
from numbaflash.kernels import sequences as sq  # noqa: E402
from numbaflash.kernels.plan import DYNAMIC_SHARED_MEM_LIMIT  # noqa: E402


@cuda.jit(device=True, inline=True)
def locate_from_parameters(seqs, b, Sq, Sk):
    n_q = int64(seqs.shape[0])
    n_k = int64(seqs.shape[1])
    return b * n_q, b * n_k, n_q, n_k, n_k - n_q


CASES = [  # (layout, packed steps)
    ("A", ("locate", "cut", "position", "row_step", "uniform_range")),   # the packed build
    ("C", ("locate", "cut", "position", "row_step", "uniform_range")),
    ("A", ()),
    ("C", ()),
    ("C", ("locate",)),
    ("C", ("locate from parameters",)),
    ("C", ("position", "row_step")),
    ("C", ("cut",)),
    ("C", ("uniform_range",)),
    ("C", ("locate from parameters", "position", "row_step")),
    ("A", ("locate from parameters", "position", "row_step")),
]


def main():
    v10 = fwd.module("v10")
    packed, plain = sq.make_sequences(True), sq.make_sequences(False)
    make = v10.make_forward_v10.__wrapped__          # uncached: each build its own steps
    d = 64
    Br, Bc = v10.tiles_within(d, DYNAMIC_SHARED_MEM_LIMIT)
    f16, f32 = np.dtype(np.float16), np.dtype(np.float32)
    try:
        for layout, parts in CASES:
            steps = plain
            for part in parts:
                if part == "locate from parameters":
                    steps = steps._replace(locate=locate_from_parameters)
                else:
                    steps = steps._replace(**{part: getattr(packed, part)})
            v10.make_sequences = lambda varlen, steps=steps: steps
            t3 = numba.types.Array(numba.from_dtype(f16), 3, layout)
            sig = ((t3, t3, t3, t3, pc.array(f32, 2), numba.float32, numba.int64)
                   + pc.variant_signature(f32))
            counts = []
            for causal in (False, True):
                kernel = make(Br, Bc, d, causal, v10.v7_chunk(d, Bc), "float16", varlen=True)
                ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=(9, 0))
                info = pc.parse_link_log(pc.link(ptx, "probe"))
                counts.append(f"{info['registers']} ({info['spill_stores']} B spilled)")
            print(f"arrays {layout}, packed steps {', '.join(parts) or 'none'}: "
                  f"{counts[0]}, causal {counts[1]}", flush=True)
    finally:
        v10.make_sequences = sq.make_sequences


if __name__ == "__main__":
    main()
