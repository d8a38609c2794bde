"""Forward v10's tile loops in machine code (SASS, sm_90), plain build against packed
build (Variant(varlen=True)), float16, not causal: registers, spills and each loop's
opcodes by count (lab/sweeps/sass_half.py's counter). No GPU.

    NUMBA_ENABLE_CUDASIM=0 python lab/sweeps/sass_packed_v10.py [--dims 64] [--layout A|C]
                                                                [--nvdisasm PATH]

``--layout C`` types the packed build's arrays C-contiguous instead of strided ("A", as
numbaflash/varlen.py passes (heads, total, d) views): a probe of what the strides cost in
registers only; the kernel would then index the arrays wrongly.
"""
import argparse
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests"))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")

import numba  # noqa: E402
import numpy as np  # noqa: E402

import ptx_check as pc  # noqa: E402
import sass_half  # noqa: E402
from numbaflash.kernels import forward as fwd  # noqa: E402
from numbaflash.kernels.plan import DYNAMIC_SHARED_MEM_LIMIT  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dims", default="64")
    ap.add_argument("--layout", default="A", choices=("A", "C"))
    ap.add_argument("--nvdisasm", default=shutil.which("nvdisasm"))
    args = ap.parse_args()
    if not args.nvdisasm:
        sys.exit("nvdisasm not found: pip install nvidia-cuda-nvdisasm, or pass --nvdisasm")
    v10 = fwd.module("v10")
    f16, f32 = np.dtype(np.float16), np.dtype(np.float32)
    with tempfile.TemporaryDirectory() as tmp:
        for d in (int(x) for x in args.dims.split(",")):
            Br, Bc = v10.tiles_within(d, DYNAMIC_SHARED_MEM_LIMIT)
            for packed in (False, True):
                t3 = numba.types.Array(numba.from_dtype(f16), 3,
                                       args.layout if packed else "C")
                sig = ((t3, t3, t3, t3, pc.array(f32, 2), numba.float32, numba.int64)
                       + (pc.variant_signature(f32) if packed else ()))
                kernel = v10.make_forward_v10(Br, Bc, d, False, v10.v7_chunk(d, Bc),
                                              "float16", varlen=packed)
                name = (f"forward v10 float16 d={d} ({Br}, {Bc}) "
                        + (f"packed, arrays {args.layout}" if packed else "plain"))
                sass_half.report(name, kernel, sig, args.nvdisasm, tmp)


if __name__ == "__main__":
    main()
