"""ptxas's registers and spills for backward v6's float32 kernels, plain and packed
builds, with and without a cap of 168 registers: no GPU.

    NUMBA_ENABLE_CUDASIM=0 python lab/sweeps/packed_v6_registers.py

At d = 64 a dK/dV or dQ block has 128 threads; three of them fit an SM's 65,536
registers at up to 168 registers a thread, two above (registers are given to a warp in
steps of 8 a thread). Each kernel is built with the tiles, split pairs and chunk that
``default_backward_v6_plan`` and ``backward_v6_chunk`` give it on a GPU (not causal and
causal), plain and with ``Variant(varlen=True)`` (the packed (total, heads, d) arrays as
they are), compiled by Numba and linked for sm_90 by nvJitLink with no cap and with
-maxrregcount=168 (lab/sweeps/half_registers.py's link).
"""

import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests"))
os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")

from numba import cuda  # noqa: E402

import ptx_check  # noqa: E402
from half_registers import link  # noqa: E402
from numbaflash.kernels.backward import v6_split_pairs as v6  # noqa: E402
from numbaflash.kernels.variants import PLAIN, Variant  # noqa: E402


def main():
    f32 = np.dtype(np.float32)
    _, dkdv_sig, dq_sig, _ = ptx_check.backward_signatures(f32, f32)
    for d in (64,):
        for causal in (False, True):
            plan = v6.default_backward_v6_plan(d, causal, f32, "gpu")
            for layout, variant in (("plain", PLAIN), ("packed", Variant(varlen=True))):
                for kind, sig in (("dkdv", dkdv_sig), ("dq", dq_sig)):
                    Br, Bc, pairs = plan[kind]
                    chunk = v6.backward_v6_chunk(kind, Br, Bc)
                    make = v6.make_backward_dkdv_v6 if kind == "dkdv" else v6.make_backward_dq_v6
                    kernel = make(Br, Bc, d, causal, chunk, pairs, variant=variant)
                    ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=(9, 0))
                    name = (f"v6 {layout} {kind} d={d}{' causal' if causal else ''} "
                            f"({Br}, {Bc}){' pairs' if pairs else ''} chunk {chunk}")
                    for cap in (None, 168):
                        r = link(ptx, cap)
                        print(f"{name}, cap {cap or '-'}: {r['registers']} registers, "
                              f"spill stores {r['spill_stores']} B, loads {r['spill_loads']} B",
                              flush=True)


if __name__ == "__main__":
    main()
