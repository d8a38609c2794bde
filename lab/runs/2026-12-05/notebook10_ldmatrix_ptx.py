"""Compile notebook 10's ldmatrix kernel (scores_then_values) for sm_90 without a GPU and
link it with nvJitLink (tests/ptx_check.py's helpers): the simulator accepts code the real
compiler rejects (a first draft sized its shared arrays by an expression, 16 * ROW, which
NVVM refuses: a shared array's size must be a constant)."""
import sys, re
sys.path.insert(0, "tests")
import ptx_check  # the fake device for a GPU-less compile
import numpy as np, numba
from numba import cuda
from numbaflash.kernels import ptx
src = open("notebooks/10_tensor_cores.py").read()
start = src.index("ROW = 24")
stop = src.index("Q16, K16, V16 =")
ns = {"cuda": cuda, "np": np, "ptx": ptx}
exec(src[start:stop], ns)
k = ns["scores_then_values"]
f32 = numba.types.Array(numba.float32, 2, "C")
f16 = numba.types.Array(numba.types.float16, 2, "C")
code, _ = cuda.compile_ptx(k.py_func, (f32, f16, f16, f32, f32), cc=(9, 0))
print("ldmatrix lines:", [l.strip() for l in code.splitlines() if "ldmatrix" in l])
print("mma lines:", sum("mma.sync" in l for l in code.splitlines()))
print(ptx_check.parse_link_log(ptx_check.link(code, "nb10")))
