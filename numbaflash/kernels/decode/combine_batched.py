"""The split-KV combine with each thread's loads issued a batch at a time.

Parent: combine.py. The same thread per output element, the same two passes over the
splits in the same order and the same arithmetic, so the same bits. What changes is when
the loads are issued: the parent reads L_parts[s] (then O_parts[s]) and uses it before it
reads split s + 1's, and the compiler keeps that order, so a thread waits for one load
after another, a round trip to memory per split and pass. Here each pass reads BATCH
splits' values into registers first (loads that do not depend on each other, all in
flight at once) and then uses them in order.

What it buys: a call with few rows and many splits (one query row per head and a long
cache: 32 rows x 128 columns from 33 splits at (1, 32, 1, 131072)) has 32 blocks whose
threads each make 66 dependent round trips; under Nsight Compute on an H100 the parent
took 25.3 us there, next to the split kernel's 202 us
(lab/runs/2026-12-07/146_ncu_stalls_split_kv_mma.txt, stall "long scoreboard": 6.2
cycles a warp per instruction issued). With batches of 16 that is 3 round trips per pass,
and the kernel took 12.7-13.1 us there (147_ncu_combine_durations.txt); whole calls
queued, 0.2134 ms against 0.2210 (147_decode_combine_queued.txt). Batches of 64 were
slower (148_decode_combine_batch.txt).
"""

import functools
import math

from numba import cuda

from .. import acc_type, jit_options
from ..halves import half_of, make_halves
from ..plan import Plan
from .combine import THREADS

BATCH = 16          # splits whose values a thread has in flight at once (registers)


@functools.lru_cache(maxsize=None)
def make_combine_batched(acc_dtype, half=None):
    """The combine kernel, loads batched: the arguments, results and rules of
    combine.make_combine (O_parts (n, BH, Sq, d), L_parts (n, BH, Sq) in ``acc_dtype`` ->
    O (BH, Sq, d), L (BH, Sq); a row no split saw gets O = 0 and L = -inf; a NaN L_s
    carries through), bit for bit."""
    acc = acc_type(acc_dtype)
    BF16 = half == "bfloat16"
    narrow = make_halves("bfloat16").narrow
    ZERO = acc(0)
    NEG_INF = acc(-math.inf)

    @cuda.jit(**jit_options())
    def combine_batched(O_parts, L_parts, O, L):
        idx = cuda.grid(1)
        BH, Sq, d = O.shape
        if idx >= BH * Sq * d:
            return
        col = idx % d
        i = (idx // d) % Sq
        bh = idx // (d * Sq)
        n = O_parts.shape[0]
        ls = cuda.local.array(BATCH, acc)       # a batch of L_s (past n: -inf, skipped)
        os = cuda.local.array(BATCH, acc)       # and of O_s[col]
        m = NEG_INF
        for s0 in range(0, n, BATCH):
            for u in range(BATCH):              # the batch's loads, all issued first
                ls[u] = L_parts[s0 + u, bh, i] if s0 + u < n else NEG_INF
            for u in range(BATCH):              # then used in order; '>' keeps NaN out
                if ls[u] > m:
                    m = ls[u]
        m_safe = ZERO if m == NEG_INF else m    # no finite L_s: avoid -inf - -inf
        total = ZERO
        o = ZERO
        seen = False
        for s0 in range(0, n, BATCH):
            for u in range(BATCH):
                if s0 + u < n:
                    ls[u] = L_parts[s0 + u, bh, i]
                    os[u] = O_parts[s0 + u, bh, i, col]
                else:
                    ls[u] = NEG_INF
                    os[u] = ZERO
            for u in range(BATCH):
                if ls[u] != NEG_INF:            # a split that saw nothing adds nothing;
                    seen = True                 # a NaN L_s is merged and carries through
                    weight = math.exp(ls[u] - m_safe)
                    total += weight
                    o += weight * os[u]
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

    return combine_batched


def plan(p, where):
    """The Plan of the combine for CacheProblem ``p``: one thread per output element, as
    the parent's."""
    n = p.B * p.Hq * p.Sq * p.d
    return Plan("kvcache combine", "combine_batched", "combine_batched", where, None, None,
                (max(1, math.ceil(n / THREADS)),), (THREADS,), 0, p.acc_dtype, None,
                "merges the splits by their logsumexp (reference.combine_splits), "
                f"{BATCH} splits' loads in flight at once")


def kernel(plan, p):
    return make_combine_batched(p.acc_dtype, half_of(p.dtype))
