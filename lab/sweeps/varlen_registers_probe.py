"""Where forward v8's packed-batch build (Variant(varlen=True)) spends its registers: ptxas
for sm_90 (through nvJitLink, as tests/ptx_check.py links), d = 64, default tiles, float32,
C-contiguous arrays.

    NUMBA_ENABLE_CUDASIM=0 python lab/sweeps/varlen_registers_probe.py plain|varlen|nocut

plain   the kernel without varlen
varlen  the packed build as it is in the tree
nocut   the packed build with sequences' cut replaced by the identity (wrong results,
        registers only): what the rest of the prologue (the sequence's bounds from
        cu_seqlens, the shifted offsets) costs without the per-sequence views

With lab/runs/2026-12-05/rows_outer_probe.patch applied (`git apply`), ``varlen`` is the
build that takes the packed arrays as (total, heads, d), C-contiguous, cut to the
sequence's rows, and ``nocut`` cuts nothing in that build.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests"))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
import numba  # noqa: E402
import numpy as np  # noqa: E402
from numba import cuda  # noqa: E402

import ptx_check as pc  # noqa: E402
import numbaflash.kernels.sequences as sq  # noqa: E402

mode = sys.argv[1]
if mode == "nocut":
    sq._rows = sq._all_rows
    if hasattr(sq, "_outer_rows"):
        sq._outer_rows = sq._all_rows
from numbaflash.kernels.forward import v6_split_once as v6mod  # noqa: E402
from numbaflash.kernels.forward import v8_reordered as v8mod  # noqa: E402
from numbaflash.kernels.variants import PLAIN, Variant  # noqa: E402

d = 64
Br, Bc = v6mod.default_v6_tiles(d, "v8", v6mod.v6_shared_bytes)
acc = np.dtype("float32")
t3 = pc.array(acc, 3)
var = PLAIN if mode == "plain" else Variant(varlen=True)
sig = (t3, t3, t3, t3, pc.array(acc, 2), numba.float32, numba.int64) + pc.variant_signature(acc)
k = v8mod.make_forward_v8(Br, Bc, d, False, v8mod.v8_chunk(d, Bc), variant=var)
ptx, _ = cuda.compile_ptx(k.py_func, sig, cc=(9, 0))
print(mode, (Br, Bc), pc.parse_link_log(pc.link(ptx, mode)), flush=True)
