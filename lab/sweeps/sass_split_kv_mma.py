"""split_kv_mma's machine code (SASS, sm_90) counted: its tile loop's instructions and
the opcodes that fill it, and the whole kernel's, with no GPU.

    NUMBA_ENABLE_CUDASIM=0 python lab/sweeps/sass_split_kv_mma.py [--nvdisasm PATH]
        [--kernel split_kv_mma|split_kv_mma_t]

``--kernel split_kv_mma_t``: its transposed child (kernels/decode/split_kv_mma_t.py), the
same arguments, built the same ways.

Builds the tensor-core decode kernel (float16, d = 128, plain, not causal; two and three
stages) as tests/ptx_check.py's decode entries sign it, links it with
nvJitLink and disassembles it with nvdisasm (the CUDA 13 wheels carry one:
.venv/lib/python3.11/site-packages/nvidia/cu13/bin/nvdisasm). Prints every loop with
tensor-core instructions: its length and its 16 most frequent opcodes. Nsight Compute
counted about 975 instructions a warp and 64-key tile at (1, 32/8, 1, 131072)
(lab/runs/2026-12-07/146_ncu_stalls_split_kv_mma.txt): this says which they are.
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile

import numba
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), os.path.dirname(os.path.abspath(__file__))]
os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")

from sass_half import cubin, loop_bodies, opcodes, ptx_check  # noqa: E402
from numba import cuda  # noqa: E402
from numbaflash.kernels.decode import split_kv_mma, split_kv_mma_t  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nvdisasm", default=shutil.which("nvdisasm") or os.path.join(
        ROOT, ".venv/lib/python3.11/site-packages/nvidia/cu13/bin/nvdisasm"))
    ap.add_argument("--kernel", default="split_kv_mma",
                    choices=("split_kv_mma", "split_kv_mma_t"))
    args = ap.parse_args()
    make = {"split_kv_mma": split_kv_mma.make_split_kv_mma,
            "split_kv_mma_t": split_kv_mma_t.make_split_kv_mma_t}[args.kernel]
    i64 = numba.int64
    dt, at = np.dtype(np.float16), np.dtype(np.float32)
    a = numba.from_dtype(at)
    array = ptx_check.array
    sig = (array(dt, 4), array(dt, 1), array(dt, 1), array(np.dtype(np.int32), 1), i64,
           array(dt, 3), array(at, 2), array(at, 4), array(at, 3), a, i64, i64, i64, i64,
           a, array(at, 2), array(np.dtype(np.bool_), 4)) + (i64,) * 7
    with tempfile.TemporaryDirectory() as tmp:
        for stages in split_kv_mma.STAGE_CHOICES:
            kernel = make(128, False, stages=stages)
            ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=(9, 0))
            info = ptx_check.parse_link_log(ptx_check.link(ptx, args.kernel))
            path = os.path.join(tmp, "k.cubin")
            with open(path, "wb") as f:
                f.write(cubin(ptx))
            sass = subprocess.run([args.nvdisasm, path], capture_output=True, text=True,
                                  check=True).stdout
            whole = opcodes(sass.splitlines())
            print(f"{args.kernel} float16 d=128 plain, STAGES={stages}: "
                  f"{info['registers']} registers, {sum(whole.values())} instructions")
            for body in loop_bodies(sass):
                ops = opcodes(body)
                if ops["HMMA"]:
                    top = ", ".join(f"{op} {n}" for op, n in ops.most_common(16))
                    print(f"    loop of {len(body)} instructions: {top}")


if __name__ == "__main__":
    main()
