"""Forward v7 at d = 64 with (128, 128) tiles, 16-key and 32-key chunks: ptxas's registers
and stack, and the local-memory loads and stores in the PTX (the 32-key chunk's S
fragments live in a 64-byte local array: a loop over its n-tiles indexes it at run time).

    NUMBA_ENABLE_CUDASIM=0 python lab/sweeps/v7_chunk_registers.py
"""
import os, sys, re
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests")); sys.path.insert(0, os.path.join(HERE, "..", ".."))
import numpy as np, numba
from numba import cuda
import ptx_check as pc
from numbaflash.kernels.forward import v7_float16 as v7
f16=np.dtype("float16"); f32=np.dtype("float32")
t3=pc.array(f16,3)
base=(t3,t3,t3,t3,pc.array(f32,2),numba.float32,numba.int64)+pc.variant_signature(f32)
for chunk in (16, 32):
    k=v7.make_forward_v7(128,128,64,False,chunk)
    ptx,_=cuda.compile_ptx(k.py_func, base, cc=(9,0))
    print("chunk", chunk, "local depot:", re.findall(r"__local_depot\d+\[(\d+)\]", ptx), "ld.local", ptx.count("ld.local"), "st.local", ptx.count("st.local"), "lines", ptx.count("\n"))
    print(pc.parse_link_log(pc.link(ptx, "k")))
    if chunk == 32:
        lines = ptx.splitlines()
        for i,l in enumerate(lines):
            if "st.local" in l or "ld.local" in l:
                print(i, l.strip())
