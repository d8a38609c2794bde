"""The float32 tensor-core backward's inner loops in machine code (SASS, sm_90), counted by
opcode: no GPU.

    NUMBA_ENABLE_CUDASIM=0 python lab/sweeps/sass_float32_backward.py [--nvdisasm PATH]
                                                                      [--versions v6,v10]
                                                                      [--layouts plain,packed]

Compiles backward v6's two kernels (and v10's, where the tree has it: v6's kernels with
the running dK, dV, dQ given to the big*big mma as its C operand) for float32 inputs,
plain attention with the variant arguments as the launcher passes them, at d = 64 and
128 not causal and d = 64 causal, each with the tiles, split pairs and chunk that
``default_backward_v6_plan`` and ``backward_v6_chunk`` give it on a GPU; links each to an
sm_90 cubin with nvJitLink, disassembles it with ``nvdisasm`` (pip install
nvidia-cuda-nvdisasm, or a CUDA toolkit's) and prints ptxas's registers and spills and,
for each loop that holds tensor-core instructions (HMMA), its length, its opcodes by count
(lab/sweeps/sass_half.py's counter) and, on a second line, the float opcodes this work is
about (FADD, FMUL, FFMA, FSETP, FSEL, MUFU). The counts are of the machine code, not of
what runs: a loop nested in another is counted in both (the outer loop's body holds it
once).

The backward kernels take finite inputs only, so there is no cold fix-up code to leave
out. Run it in the tree to measure, with PYTHONPATH pointing at another tree's
numbaflash/ to compare (lab/runs/2026-12-05/sass_float32_backward.txt holds a before and
after). ``--layouts packed`` compiles the packed builds instead (``Variant(varlen=True)``,
the (total, heads, d) arrays as they are: what a packed batch, and
numbaflash.torch.flash_attn_func reading in place, run), without GQA.
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")

import sass_half  # noqa: E402  (its cubin, loop_bodies and opcodes; tests/ptx_check.py)
from sass_half import ptx_check  # noqa: E402
from numba import cuda  # noqa: E402
from numbaflash.kernels import backward as bwd  # noqa: E402
from numbaflash.kernels.variants import PLAIN, Variant  # noqa: E402

CASES = ((64, False), (128, False), (64, True))     # (d, causal)
FLOAT_OPS = ("FADD", "FMUL", "FFMA", "FSETP", "FSEL", "MUFU")


def report(name, kernel, signature, nvdisasm, tmp):
    """sass_half.report's lines, and each loop's FLOAT_OPS."""
    ptx, _ = cuda.compile_ptx(kernel.py_func, signature, cc=(9, 0))
    info = ptx_check.parse_link_log(ptx_check.link(ptx, name))
    path = os.path.join(tmp, "k.cubin")
    with open(path, "wb") as f:
        f.write(sass_half.cubin(ptx))
    sass = subprocess.run([nvdisasm, path], capture_output=True, text=True, check=True).stdout
    print(f"{name}: {info['registers']} registers, spills {info['spill_stores']} bytes",
          flush=True)
    for body in sass_half.loop_bodies(sass):
        ops = sass_half.opcodes(body)
        if ops["HMMA"]:
            top = ", ".join(f"{op} {n}" for op, n in ops.most_common(14))
            print(f"    loop of {len(body)} instructions: {top}")
            print("        " + ", ".join(f"{op} {ops[op]}" for op in FLOAT_OPS))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nvdisasm", default=shutil.which("nvdisasm"))
    ap.add_argument("--versions", default="v6,v10",
                    help="backward versions to compile, those of them the tree has")
    ap.add_argument("--layouts", default="plain",
                    help="plain, packed or plain,packed: the (B*H, S, d) builds, the packed "
                         "batch's (total, heads, d) builds")
    args = ap.parse_args()
    if not args.nvdisasm:
        sys.exit("nvdisasm not found: pip install nvidia-cuda-nvdisasm, or pass --nvdisasm")
    f32 = np.dtype(np.float32)
    _, dkdv_sig, dq_sig, _ = ptx_check.backward_signatures(f32, f32)
    v6 = bwd.module("v6")
    with tempfile.TemporaryDirectory() as tmp:
        for version in args.versions.split(","):
            if version not in bwd.VERSIONS:
                print(f"backward {version}: not in this tree")
                continue
            module = bwd.module(version)
            for d, causal in CASES:
                plan = v6.default_backward_v6_plan(d, causal, f32, "gpu")
                for layout in args.layouts.split(","):
                    # the packed builds take the same argument types (C-contiguous 3-d
                    # arrays, (total, heads, d) instead of (B*H, S, d))
                    variant = Variant(varlen=True) if layout == "packed" else PLAIN
                    for kind, sig in (("dkdv", dkdv_sig), ("dq", dq_sig)):
                        Br, Bc, pairs = plan[kind]
                        chunk = v6.backward_v6_chunk(kind, Br, Bc)
                        make = getattr(module, f"make_backward_{kind}_{version}")
                        tag = (f"backward {version} {layout} {kind} d={d}"
                               f"{' causal' if causal else ''} ({Br}, {Bc})"
                               f"{' pairs' if pairs else ''} chunk {chunk}")
                        report(tag, make(Br, Bc, d, causal, chunk, pairs, variant=variant),
                               sig, args.nvdisasm, tmp)


if __name__ == "__main__":
    main()
