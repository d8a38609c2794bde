"""Backward v9's kernels (float16, d = 64, its GPU tiles) in machine code (SASS, sm_90),
their plain builds against their packed builds: each loop that holds tensor-core
instructions, its length and its opcodes by count. No GPU.

    NUMBA_ENABLE_CUDASIM=0 python lab/sweeps/sass_packed_v9.py [--nvdisasm PATH]

The builds: plain (C-contiguous (BH, S, d) arrays), packed rows reading each sequence
from cu_seqlens, and for the causal dQ kernel the packed build of equal lengths (the
pair (nq, nk) as kernel parameters, kernels/sequences.py). flash_attn_func's layout
read in place runs the packed builds; what a packed build adds inside its loops is
what it costs on the GPU beyond the plain call.
"""

import argparse
import os
import shutil
import sys
import tempfile

import numba
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from sass_half import ptx_check, report  # noqa: E402  (sets up tests/ on the path)
from numbaflash.kernels import backward as bwd  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nvdisasm", default=shutil.which("nvdisasm"))
    args = ap.parse_args()
    if not args.nvdisasm:
        sys.exit("nvdisasm not found: pip install nvidia-cuda-nvdisasm, or pass --nvdisasm")
    v9 = bwd.module("v9")
    f16, f32 = np.dtype(np.float16), np.dtype(np.float32)
    t3, a2 = ptx_check.array(f16, 3), ptx_check.array(f32, 2)
    scale, offset = numba.float32, numba.int64
    extra = ptx_check.variant_signature(f32)
    pair = numba.types.UniTuple(numba.int64, 2)
    sigs = {"dkdv": (t3, t3, t3, t3, a2, a2, t3, t3, scale, offset),
            "dq": (t3, t3, t3, t3, a2, a2, t3, scale, offset)}
    tiles = v9.default_backward_v9_tiles(64, "gpu")
    with tempfile.TemporaryDirectory() as tmp:
        for causal in (False, True):
            for kind in ("dkdv", "dq"):
                make = getattr(v9, f"make_backward_{kind}_v9")
                cap = ({"max_registers": v9.V9_DKDV_MAX_REGISTERS} if kind == "dkdv"
                       else {})
                builds = [("plain", {}, sigs[kind]),
                          ("packed, cu_seqlens", {"varlen": True}, sigs[kind] + extra)]
                if kind == "dq" and causal:
                    builds.append(("packed, equal lengths",
                                   {"varlen": True, "equal_lengths": True},
                                   sigs[kind] + extra[:-1] + (pair,)))
                for label, options, sig in builds:
                    name = (f"backward v9 {kind} d=64 {tiles[kind]} "
                            f"{'causal' if causal else 'full'}, {label}")
                    report(name, make(*tiles[kind], 64, causal, **options, **cap), sig,
                           args.nvdisasm, tmp)


if __name__ == "__main__":
    main()
