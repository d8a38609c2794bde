"""Forward v8's registers and spills (ptxas for sm_90 through nvJitLink, as tests/ptx_check.py
links) for plain C-contiguous arrays, strided ("A" layout) arrays, and the packed-batch
build (Variant(varlen=True)) on each: what reading the flash-attn layout in place costs.

    NUMBA_ENABLE_CUDASIM=0 python lab/sweeps/strided_v8_registers.py
"""
import sys, os
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests")); sys.path.insert(0, os.path.join(HERE, "..", ".."))
import numpy as np, numba
from numba import cuda
import ptx_check as pc
from numbaflash.kernels.variants import Variant, PLAIN
from numbaflash.kernels.forward import v8_reordered as v8mod
from numbaflash.kernels.forward import v6_split_once as v6mod
d=64
Br,Bc = v6mod.default_v6_tiles(d, "v8", v6mod.v6_shared_bytes)
def A(dt): return numba.types.Array(numba.from_dtype(np.dtype(dt)),3,"A")
def C(dt): return pc.array(np.dtype(dt),3)
acc=np.dtype("float32")
def sig(t3, variant):
    base=(t3,t3,t3,t3,pc.array(acc,2),numba.float32,numba.int64)
    return base + pc.variant_signature(acc)
cases = [("plain C", PLAIN, C, False), ("plain A", PLAIN, A, False),
         ("varlen C", Variant(varlen=True), C, False), ("varlen A", Variant(varlen=True), A, False),
         ("varlen A causal", Variant(varlen=True), A, True)]
for name, var, lay, causal in cases:
    k = v8mod.make_forward_v8(Br, Bc, d, causal, v8mod.v8_chunk(d, Bc), variant=var)
    ptx,_ = cuda.compile_ptx(k.py_func, sig(lay("float32"), var), cc=(9,0))
    r = pc.parse_link_log(pc.link(ptx, name))
    print(name, Br, Bc, r)
