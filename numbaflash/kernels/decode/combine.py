"""The split-KV combine: the splits' results merged by their logsumexp.

Parent: none on the ladder; reference.combine_splits is its NumPy sibling, line for line.
Split s of a row has O_s (normalised over its keys) and L_s = log sum over its keys of
exp(score); the whole row has L = log sum_s exp(L_s) and O = sum_s exp(L_s - L) O_s. With
M = max_s L_s subtracted first nothing overflows: the online softmax's rescaling,
applied once to whole splits instead of step by step to keys.

One thread per output element (bh, row, column); each computes its row's M and sum over
the splits itself (a few dozen reads of L_parts, cached) rather than sharing them, which
keeps the kernel one loop long. Its cost is a read of the partial outputs, small next to
the cache the split kernel reads (n_splits x d values per row against S_max x d).
"""

import functools
import math

from numba import cuda

from .. import acc_type, jit_options
from ..halves import half_of, make_halves
from ..plan import Plan

THREADS = 128


@functools.lru_cache(maxsize=None)
def make_combine(acc_dtype, half=None):
    """The combine kernel: O_parts (n, BH, Sq, d), L_parts (n, BH, Sq) in ``acc_dtype``
    -> O (BH, Sq, d) in the output dtype, L (BH, Sq). A row no split saw (every L_s =
    -inf) gets O = 0 and L = -inf; a NaN L_s (a split that saw NaN) carries through.
    ``half="bfloat16"``: O holds bfloat16 bits, rounded where written (kernels/halves.py)."""
    acc = acc_type(acc_dtype)
    BF16 = half == "bfloat16"
    narrow = make_halves("bfloat16").narrow
    ZERO = acc(0)
    NEG_INF = acc(-math.inf)

    @cuda.jit(**jit_options())
    def combine(O_parts, L_parts, O, L):
        idx = cuda.grid(1)
        BH, Sq, d = O.shape
        if idx >= BH * Sq * d:
            return
        col = idx % d
        i = (idx // d) % Sq
        bh = idx // (d * Sq)
        n = O_parts.shape[0]
        m = NEG_INF
        for s in range(n):                      # '>' keeps NaN out of the max
            if L_parts[s, bh, i] > m:
                m = L_parts[s, bh, i]
        m_safe = ZERO if m == NEG_INF else m    # no finite L_s: avoid -inf - -inf
        total = ZERO
        o = ZERO
        seen = False
        for s in range(n):
            if L_parts[s, bh, i] != NEG_INF:    # a split that saw nothing adds nothing;
                seen = True                     # a NaN L_s is merged and carries through
                weight = math.exp(L_parts[s, bh, i] - m_safe)
                total += weight
                o += weight * O_parts[s, bh, i, col]
        if not seen:                            # no split saw a key
            if BF16:
                O[bh, i, col] = narrow(ZERO)
            else:
                O[bh, i, col] = ZERO
            if col == 0:
                L[bh, i] = NEG_INF
            return
        if BF16:
            O[bh, i, col] = narrow(o / total)
        else:
            O[bh, i, col] = o / total
        if col == 0:
            L[bh, i] = m_safe + math.log(total)

    return combine


def plan(p, where):
    """The Plan of the combine for CacheProblem ``p``: one thread per output element."""
    n = p.B * p.Hq * p.Sq * p.d
    return Plan("kvcache combine", "combine", "combine", where, None, None,
                (max(1, math.ceil(n / THREADS)),), (THREADS,), 0, p.acc_dtype, None,
                "merges the splits by their logsumexp (reference.combine_splits)")


def kernel(plan, p):
    return make_combine(p.acc_dtype, half_of(p.dtype))
