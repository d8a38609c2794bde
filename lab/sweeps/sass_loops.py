"""The innermost loops of a kernel's machine code (SASS, sm_90), counted: no GPU needed.

    python scripts/sass_loops.py [--nvdisasm PATH] [--d 64]

Compiles forward v4 and v5 and backward v3 and v4 (float32, not causal; v4 and v3 with
their GPU default tiles for head dim d, v5 and backward v4 with those and with their own
GPU defaults) to PTX with Numba, links the PTX to an sm_90 cubin with nvJitLink
(numba-cuda[cu13]), disassembles it with ``nvdisasm`` (from a CUDA toolkit; pass its path
if it is not on PATH) and prints, for every loop with at least 16 FFMAs and no barrier
(the multiply-add loops), its instruction count, shared loads (LDS), FFMAs and integer
instructions (IMAD, IADD3, LEA, SHF, ISETP, SEL); and, on a second line, for every loop
with global loads and shared stores (the tile-loading loops), its instruction count,
global loads (LDG) and shared stores (STS). Last, forward v3 (tensor cores, d <= 128):
its chunk loop's instructions, tensor-core instructions (HMMA), shared loads, integer and
float instructions, and ptxas's registers and spills; then the same for forward v6 (its
default tiles), once as compiled and once without the branches that handle non-finite
inputs (what a chunk of finite input executes).

It is the evidence behind kernels/smem.py's ``U`` (before the dynamic-shared-memory
kernels indexed their tiles with unsigned integers, their inner loops carried twice the
integer instructions of the static-array kernels', from Numba's negative-index
wraparound) and behind the while loops of kernels/__init__.py.
"""

import argparse
import inspect
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")

from numba import cuda  # noqa: E402

import ptx_check  # noqa: E402  (tests/ptx_check.py: the kernels' signatures)
from numbaflash import dispatch  # noqa: E402
from numbaflash.kernels import backward as bwd  # noqa: E402
from numbaflash.kernels import forward as fwd  # noqa: E402


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


def count(body, pattern):
    return sum(1 for x in body if re.search(pattern, x))


INTEGER = r"IMAD|IADD3|LEA|SHF|ISETP|SEL"


def inner_loops(sass, load_loops=False):
    """(instructions, LDS, FFMA, integer) for each loop with >= 16 FFMAs and no barrier;
    with ``load_loops``, (instructions, LDG, STS) for each loop with global loads and
    shared stores and no FFMA (the tile-loading loops) instead."""
    loops = []
    for body in loop_bodies(sass):
        if load_loops:
            if count(body, r"\bLDG") and count(body, r"\bSTS") and not count(body, "FFMA"):
                loops.append((len(body), count(body, r"\bLDG"), count(body, r"\bSTS")))
        elif count(body, "FFMA") >= 16 and not count(body, "BAR"):
            loops.append((len(body), count(body, r"\bLDS"), count(body, "FFMA"),
                          count(body, INTEGER)))
    return sorted(loops, reverse=True)


def tensor_core_loops(sass):
    """(instructions, HMMA, LDS, integer, float) for each loop with tensor-core
    instructions and no barrier (forward v3's chunk loop)."""
    loops = [(len(body), count(body, "HMMA"), count(body, r"\bLDS"),
              count(body, INTEGER + "|LOP3"), count(body, r"FADD|FMUL|FFMA|FSEL|FSETP|FMNMX"))
             for body in loop_bodies(sass) if count(body, "HMMA") and not count(body, "BAR")]
    return sorted(loops, reverse=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nvdisasm", default=shutil.which("nvdisasm"))
    ap.add_argument("--d", type=int, default=64)
    args = ap.parse_args()
    if not args.nvdisasm:
        sys.exit("nvdisasm not found: pass --nvdisasm PATH (it comes with a CUDA toolkit)")
    d, f32 = args.d, np.float32
    v4 = dispatch.default_v4_tiles(d, "float32")
    v5 = dispatch.default_v5_tiles(d, "float32")
    b3 = dispatch.default_backward_v3_tiles(d, "float32")
    b4 = dispatch.default_backward_v4_tiles(d, "float32")
    # forward v5 and backward v4 take the variant arguments; forward v4, backward v3 do not
    fsig, fsig5 = (ptx_check.forward_signature(f32, f32),
                   ptx_check.forward_variant_signature(f32, f32))
    bsig, bsig4 = (ptx_check.backward_v3_signatures(f32, f32)[0],
                   ptx_check.backward_signatures(f32, f32)[1])
    kernels = [
        (f"forward v4 {v4}", fwd.make_forward_v4(*v4, d, False, "float32"), fsig),
        (f"forward v5 {v4}", fwd.make_forward_v5(*v4, d, False, "float32"), fsig5),
        (f"forward v5 {v5}", fwd.make_forward_v5(*v5, d, False, "float32"), fsig5),
        (f"backward v3 dK/dV {b3}", bwd.make_backward_dkdv_v3(*b3, d, False, "float32"), bsig),
        (f"backward v4 dK/dV {b3}", bwd.make_backward_dkdv_v4(*b3, d, False, "float32"), bsig4),
        (f"backward v4 dK/dV {b4}", bwd.make_backward_dkdv_v4(*b4, d, False, "float32"), bsig4),
    ]
    with tempfile.TemporaryDirectory() as tmp:
        for name, kernel, signature in kernels:
            ptx, _ = cuda.compile_ptx(kernel.py_func, signature, cc=(9, 0))
            path = os.path.join(tmp, "k.cubin")
            with open(path, "wb") as f:
                f.write(cubin(ptx))
            sass = subprocess.run([args.nvdisasm, path], capture_output=True, text=True,
                                  check=True).stdout
            loops = ", ".join(f"{n} insts ({lds} LDS, {ffma} FFMA, {integer} integer)"
                              for n, lds, ffma, integer in inner_loops(sass))
            loads = ", ".join(f"{n} insts ({ldg} LDG, {sts} STS)"
                              for n, ldg, sts in inner_loops(sass, load_loops=True))
            print(f"d={d} {name:36s} {loops}\n{'':42s}tile loads: {loads}")
        # forward v3 (tensor cores, GPU only): its chunk loop, and ptxas's registers
        if d <= 128:
            Br, Bc = dispatch.default_v3_tiles(d)
            ptx, _ = cuda.compile_ptx(fwd.make_forward_v3(Bc, d, False).py_func, fsig, cc=(9, 0))
            info = ptx_check.parse_link_log(ptx_check.link(ptx, "forward_v3"))
            path = os.path.join(tmp, "k.cubin")
            with open(path, "wb") as f:
                f.write(cubin(ptx))
            sass = subprocess.run([args.nvdisasm, path], capture_output=True, text=True,
                                  check=True).stdout
            loops = ", ".join(f"{n} insts ({hmma} HMMA, {lds} LDS, {integer} integer, "
                              f"{fp} float)" for n, hmma, lds, integer, fp
                              in tensor_core_loops(sass))
            print(f"d={d} {'forward v3 ' + str((Br, Bc)):36s} {loops}\n{'':42s}registers "
                  f"{info['registers']}, spill stores {info['spill_stores']} bytes")
            # forward v6 (tensor cores, K/V split once per tile), its default tiles: the
            # chunk loop as compiled, and without the code for non-finite inputs (the
            # branches a finite input never takes): what a chunk executes
            Br, Bc = dispatch.default_v6_tiles(d)
            for name, cold in (("", True), (", finite path only", False)):
                kernel = fwd.make_forward_v6(Br, Bc, d, False)
                py = kernel.py_func
                if not cold:
                    source = inspect.getsource(fwd.make_forward_v6)
                    assert source.count("if fix_scores:") == 1 and source.count("if fix_values:") == 1
                    kernel = _without_fixups(source, Br, Bc, d)
                    py = kernel.py_func
                ptx, _ = cuda.compile_ptx(py, fsig, cc=(9, 0))
                info = ptx_check.parse_link_log(ptx_check.link(ptx, "forward_v6"))
                with open(path, "wb") as f:
                    f.write(cubin(ptx))
                sass = subprocess.run([args.nvdisasm, path], capture_output=True, text=True,
                                      check=True).stdout
                lds64 = len(re.findall(r"LDS\.64", sass))
                loops = ", ".join(f"{n} insts ({hmma} HMMA, {lds} LDS, {integer} integer, "
                                  f"{fp} float)" for n, hmma, lds, integer, fp
                                  in tensor_core_loops(sass))
                print(f"d={d} {'forward v6 ' + str((Br, Bc)) + name:36s} {loops}\n{'':42s}"
                      f"registers {info['registers']}, spill stores {info['spill_stores']} "
                      f"bytes, {lds64} LDS.64 in the kernel")


def _without_fixups(source, Br, Bc, d):
    """make_forward_v6's kernel compiled with its two non-finite fix-up branches turned
    off (``if False:``), for counting what a finite input executes; never used to run."""
    namespace = dict(vars(fwd))
    source = textwrap.dedent(source).replace("@functools.lru_cache(maxsize=None)\n", "")
    source = source.replace("if fix_scores:", "if False:").replace("if fix_values:", "if False:")
    exec(compile(source, fwd.__file__, "exec"), namespace)
    return namespace["make_forward_v6"](Br, Bc, d, False)


if __name__ == "__main__":
    main()
