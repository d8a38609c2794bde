"""The 16-bit kernels' inner loops in machine code (SASS, sm_90), counted by opcode: no GPU.

    NUMBA_ENABLE_CUDASIM=0 python lab/sweeps/sass_half.py [--nvdisasm PATH]

Compiles forward v10 (float16, its GPU tiles at d = 64 and 128, not causal) and backward
v7 and v9 (float16, their GPU tiles at d = 64, not causal) to PTX with Numba, links each
to an sm_90 cubin with nvJitLink, disassembles it with ``nvdisasm`` (pip install
nvidia-cuda-nvdisasm, or a CUDA toolkit's) and prints, for each loop that holds
tensor-core instructions (HMMA), its length and its opcodes by count.

Forward v10 is compiled a second time with its two fix-up branches turned off (``if
fix_scores:`` and ``if fix_values:`` made ``if False:``; never run, only counted): the
loop a finite input executes, without the cold code for NaN and inf inside it. The
backward kernels have no such branches (they take finite inputs only).

Run it in the tree to measure, with PYTHONPATH pointing at another tree's numbaflash/ to
compare (lab/runs/2026-12-05/sass_half.txt holds a before and after).
"""

import argparse
import collections
import inspect
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests"))
os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")

from numba import cuda  # noqa: E402

import ptx_check  # noqa: E402  (tests/ptx_check.py: signatures, the fake device)
from numbaflash.kernels import backward as bwd  # noqa: E402
from numbaflash.kernels.forward import v7_float16 as v7  # noqa: E402
from numbaflash.kernels.forward import v10_ldmatrix as v10  # noqa: E402


def cubin(ptx):
    from cuda.bindings import nvjitlink
    handle = nvjitlink.create(1, ["-arch=sm_90"])
    data = ptx.encode()
    nvjitlink.add_data(handle, nvjitlink.InputType.PTX, data, len(data), "kernel")
    nvjitlink.complete(handle)
    buf = bytearray(nvjitlink.get_linked_cubin_size(handle))
    nvjitlink.get_linked_cubin(handle, buf)
    nvjitlink.destroy(handle)
    return bytes(buf)


def loop_bodies(sass):
    """The instructions of each loop in ``sass``: from a label to a branch back to it."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines)
              if (m := re.match(r"\s*(\.L_x_\d+):", line))}
    for i, line in enumerate(lines):
        m = re.search(r"BRA\s+`?\(?(\.L_x_\d+)", line)
        if m and labels.get(m.group(1), i) < i:
            yield [x for x in lines[labels[m.group(1)]:i + 1]
                   if re.search(r"/\*[0-9a-f]{4,}\*/", x)]


def opcodes(body):
    ops = collections.Counter()
    for line in body:
        m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", line)
        if m:
            ops[m.group(1)] += 1
    return ops


def report(name, kernel, signature, nvdisasm, tmp):
    ptx, _ = cuda.compile_ptx(kernel.py_func, signature, cc=(9, 0))
    info = ptx_check.parse_link_log(ptx_check.link(ptx, name))
    path = os.path.join(tmp, "k.cubin")
    with open(path, "wb") as f:
        f.write(cubin(ptx))
    sass = subprocess.run([nvdisasm, path], capture_output=True, text=True, check=True).stdout
    print(f"{name}: {info['registers']} registers, spills {info['spill_stores']} bytes")
    for body in loop_bodies(sass):
        ops = opcodes(body)
        if ops["HMMA"]:
            top = ", ".join(f"{op} {n}" for op, n in ops.most_common(14))
            print(f"    loop of {len(body)} instructions: {top}")


def v10_finite_only(Br, Bc, d, chunk):
    """make_forward_v10's kernel with its fix-up branches off (module docstring)."""
    source = inspect.getsource(v10.make_forward_v10)
    assert source.count("if fix_scores:") == 1 and source.count("if fix_values:") == 1
    source = textwrap.dedent(source).replace("@functools.lru_cache(maxsize=None)\n", "")
    source = source.replace("if fix_scores:", "if False:").replace("if fix_values:", "if False:")
    namespace = dict(vars(v10))
    exec(compile(source, v10.__file__, "exec"), namespace)
    return namespace["make_forward_v10"](Br, Bc, d, False, chunk)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nvdisasm", default=shutil.which("nvdisasm"))
    args = ap.parse_args()
    if not args.nvdisasm:
        sys.exit("nvdisasm not found: pip install nvidia-cuda-nvdisasm, or pass --nvdisasm")
    f16, f32 = np.dtype(np.float16), np.dtype(np.float32)
    fsig = ptx_check.forward_signature(f16, f32)
    with tempfile.TemporaryDirectory() as tmp:
        for d in (64, 128):
            Br, Bc = v10.tiles_within(d, 232448)
            chunk = v7.v7_chunk(d, Bc)
            tag = f"forward v10 d={d} ({Br}, {Bc}) chunk {chunk}"
            report(tag, v10.make_forward_v10(Br, Bc, d, False, chunk), fsig, args.nvdisasm, tmp)
            report(tag + ", finite path", v10_finite_only(Br, Bc, d, chunk), fsig,
                   args.nvdisasm, tmp)
        _, dkdv_sig, dq_sig, _ = ptx_check.backward_signatures(f16, f32)
        n = len(ptx_check.variant_signature(f32))       # v7 and v9 take no variant arguments
        for version in ("v7", "v9"):
            if version not in bwd.VERSIONS:
                continue
            module = bwd.module(version)
            tiles = getattr(module, f"default_backward_{version}_tiles")(64, "gpu")
            for kind, sig in (("dkdv", dkdv_sig[:-n]), ("dq", dq_sig[:-n])):
                make = getattr(module, f"make_backward_{kind}_{version}")
                report(f"backward {version} {kind} d=64 {tiles[kind]}",
                       make(*tiles[kind], 64, False), sig, args.nvdisasm, tmp)


if __name__ == "__main__":
    main()
