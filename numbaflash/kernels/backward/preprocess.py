"""D = rowsum(dO * O) (Alg.2 l.4), the first kernel of every backward version.
"""

import functools
import math

from numba import cuda

from .. import acc_type, jit_options
from ..halves import make_halves
from ..plan import Plan


@functools.lru_cache(maxsize=None)
def make_backward_preprocess(d, acc_dtype, half=None):
    """D = rowsum(dO * O) (Alg.2 l.4): D (BH, Sq) in the accumulator dtype.

    ``half``: None for dO and O of a dtype the accumulator type converts (float16,
    float32, float64), or "bfloat16" (kernels/halves.py) for the bfloat16 bits (uint16)
    that a backward version reading bfloat16 itself is given (its module's BFLOAT16),
    widened exactly to float32 (``acc_dtype`` is then "float32").

    Launch: grid (ceil(Sq / threads), BH), block (threads,): one thread per query row.
    """
    acc = acc_type(acc_dtype)
    widen = acc if half is None else make_halves(half).widen
    ZERO = acc(0)

    @cuda.jit(**jit_options())
    def backward_preprocess(dO, O, D):
        bh = cuda.blockIdx.y
        row = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        if row >= dO.shape[1]:
            return                      # no barriers in this kernel, so early exit is safe
        D_row = ZERO
        for k in range(d):
            D_row += widen(dO[bh, row, k]) * widen(O[bh, row, k])
        D[bh, row] = D_row              # a fully masked row has O = 0, so D = 0

    return backward_preprocess


# --- the launch contract ------------------------------------------------------------

THREADS = 64        # backward D = rowsum(dO * O): query rows per block


def plan(p, where, version):
    """The Plan of the D kernel that backward ``version`` runs first for Problem ``p``:
    grid (ceil(Sq / THREADS), B * Hq), one thread per query row."""
    return Plan("backward D", version, "backward_preprocess", where, None, None,
                (math.ceil(p.Sq / THREADS), p.BH), (THREADS,), 0, p.acc_dtype, p.causal,
                f"D = rowsum(dO * O) (Alg.2 l.4), {THREADS} query rows per block")


def kernel(plan, p):
    """The compiled D kernel (cached per head dim, accumulator dtype and input storage):
    the kernels are given bfloat16 as its bits only when the backward version reads them
    itself (numbaflash/dtypes.py; every other version gets float32 copies, and Problem
    ``p`` then says float32)."""
    half = "bfloat16" if p.dtype.name == "bfloat16" else None
    return make_backward_preprocess(p.d, p.acc_dtype, half)
