"""Forward v4: register-blocked SIMT, a TM x TN block of scores per thread.

Parent: v2 (v2_flash2.py), which is bound by shared-memory loads: each multiply-add of
q_i . Kj[c] and p * Vj[c, k] needs one load, and no loaded value serves a second row.
v4 gives each thread a TM x TN block of Sij and a TM x DN block of O_i in registers,
like a SIMT matmul: per k step of Sij it loads TM values of Qi and TN of Kj for TM * TN
FMAs. At d = 64, (64, 32, 4, 4) tiles: 0.5 loads per FMA in Sij and 0.375 in P~ij Vj
instead of 1. Qi, Kj (both transposed) and P~ij are staged in shared memory, and the TX
threads of a row share its max and sum through a small shared array (no warp shuffles).

Costs: four barriers per K/V tile instead of two, and the 48 KB of static shared memory
(Qi, Kj, Vj and P~ij all staged) keeps tiles small at d = 128. H200, float32, (2, 16,
4096, 64): 0.343x SDPA EFFICIENT against v2's 0.226x; faster than v2 in five of the six
bench cases, tied at (2, 16, 4096, 128) not causal (lab/runs/2026-12-01/15_bench_forward.txt);
with the while loops of kernels/__init__.py, 7.09 ms at d = 64 and 21.04 ms at d = 128
(lab/runs/2026-12-01/26_timing_branch.txt).

Runs on the GPU and the simulator; plain attention only (version="v4"). v5 is this
kernel with its tiles in dynamic shared memory.
"""

import functools
import math

import numpy as np
from numba import cuda

from .. import acc_type, jit_options
from ..bands import make_kv_tile_range
from ..plan import (
    SHARED_MEM_LIMIT, TILE_TABLE_REASON, Plan, check_thread_tiles, here, refuse_variants,
    variant_description
)
from ..smem import U


@functools.lru_cache(maxsize=None)
def make_forward_v4(Br, Bc, TM, TN, d, causal, acc_dtype):
    """v4 (register-blocked SIMT FlashAttention-2) kernel (opt-in, ``version="v4"``;
    v5 is this kernel with dynamic shared memory).

    Launch: grid (Tr, BH) with Tr = ceil(Sq / Br), block (TY * TX,) with TY = Br // TM and
    TX = Bc // TN: thread tid is (ty, tx) = (tid // TX, tid % TX) of a TY x TX grid.

    Thread (ty, tx) owns a TM x TN block of Sij: rows r_a = ty + TY*a (a < TM) and columns
    c_b = tx + TX*b (b < TN), and a TM x DN block of O_i: the same rows, columns
    k_e = tx + TX*e (e < DN), with DP = d rounded up to a multiple of TX and DN = DP // TX
    (the padded columns d..DP-1 hold zeros and are never written). Strided rows and
    columns make every shared-memory read below conflict-free or a broadcast: the TX
    threads of a row read TX consecutive addresses, the threads of a column read one.

    Shared memory (accumulator dtype): QiT (DP, Br + 1), Qi transposed, staged once;
    KjT (DP, Bc + 1), Kj transposed; Vj (Bc, DP); Pij (Br, Bc + 1), P~ij; red (Br, TX),
    partial row maxima and, at the end, partial row sums. The +1 pads make the
    transposing stores (consecutive k by consecutive threads) and the column reads of
    Pij hit different banks. ``v4_shared_bytes`` counts them.

    Per K/V tile, four barriers: (1) the previous tile is done with; load Kj, Vj;
    (2) loaded; Sij in registers, masked, partial row max to red; (3) the partial maxima
    are in; each thread reduces the TX maxima of its rows (the same values in the same
    order in every thread of a row, so all agree), rescales o, writes P~ij; (4) P~ij is
    complete; o += P~ij Vj. Each k step of Sij loads TM + TN values for TM * TN FMAs, and
    each key of P~ij Vj loads TM + DN values for TM * DN FMAs (v2: one load per FMA).

    Each thread keeps its own part of l_i (the sum over its TN columns, rescaled by the
    same alpha as everyone in the row, each tile's part summed first as in v2); the TX
    parts are summed through red once, at the end.

    NaN-safety: masked scores are -inf and give p = 0 without an exp of them. A key hidden
    by the causal mask from some rows of the block can still hold NaN or inf in V, and
    0 * NaN = NaN, so on the tiles where the mask cuts through the block (the causal
    diagonal; a block-uniform test) P~ij Vj skips the hidden (row, key) pairs; on every
    other tile no key is hidden (keys past Sk are zero-filled in Vj) and the loop has no
    test. As in v2, a visible key whose score is -inf gets weight 0; unlike v2 its value
    is read (0 * V), so a NaN or inf in V at such a key reaches the row, as it does in the
    dense reference.
    """
    acc = acc_type(acc_dtype)
    ZERO = acc(0)
    NEG_INF = acc(-math.inf)
    assert Br % TM == 0 and Bc % TN == 0, (Br, Bc, TM, TN)
    TY = Br // TM                       # thread rows
    TX = Bc // TN                       # thread columns
    THREADS = TY * TX
    DP = (d + TX - 1) // TX * TX        # head dim padded to the thread grid's width
    DN = DP // TX                       # O columns per thread
    kv_tile_range = make_kv_tile_range(Br, Bc, causal, False)
    BrP = Br + 1                        # padded row lengths of QiT, KjT and Pij (shared
    BcP = Bc + 1                        # array shapes must be compile-time constants)

    @cuda.jit(**jit_options())
    def forward_v4(Q, K, V, O, L, softmax_scale, causal_offset):
        bh = cuda.blockIdx.y
        i = cuda.blockIdx.x             # Q tile index (Alg.1 l.3: one block per i)
        tid = cuda.threadIdx.x
        ty = tid // TX
        tx = tid % TX
        Sq = Q.shape[1]
        Sk = K.shape[1]

        QiT = cuda.shared.array((DP, BrP), acc)
        KjT = cuda.shared.array((DP, BcP), acc)
        Vj = cuda.shared.array((Bc, DP), acc)
        Pij = cuda.shared.array((Br, BcP), acc)
        red = cuda.shared.array((Br, TX), acc)
        s = cuda.local.array((TM, TN), acc)     # this thread's block of Sij, then P~ij
        o = cuda.local.array((TM, DN), acc)     # its block of O_i (unnormalised)
        qa = cuda.local.array(TM, acc)          # one k step: TM values of Qi ...
        kb = cuda.local.array(TN, acc)          # ... and TN of Kj
        pa = cuda.local.array(TM, acc)          # one key: TM values of P~ij ...
        ve = cuda.local.array(DN, acc)          # ... and DN of Vj
        m_i = cuda.local.array(TM, acc)         # running max of each row (all TX agree)
        l_i = cuda.local.array(TM, acc)         # this thread's part of each row's sum

        # Alg.1 l.4-5: stage Qi transposed (zeros past Sq and d); O_i = 0, l = 0, m = -inf.
        for idx in range(tid, Br * DP, THREADS):
            r = idx // DP
            k = idx % DP
            row = i * Br + r
            QiT[U(k), U(r)] = acc(Q[bh, row, k]) if row < Sq and k < d else ZERO
        for a in range(TM):
            m_i[a] = NEG_INF
            l_i[a] = ZERO
            for e in range(DN):
                o[a, e] = ZERO

        # Alg.1 l.6: loop over K/V tiles; causal blocks stop after the last visible one.
        _, Tc = kv_tile_range(i, Sk, causal_offset, 0)     # bands.py
        first_limit = i * Br + causal_offset    # last key the block's first row sees
        for j in range(Tc):
            # Wait until every thread is done with the previous tile's KjT, Vj, Pij (and,
            # for j = 0, until QiT is complete).
            cuda.syncthreads()
            # Alg.1 l.7: load Kj (transposed) and Vj; rows past Sk and columns past d are 0.
            idx = tid
            while idx < Bc * DP:
                c = idx // DP
                k = idx % DP
                col = j * Bc + c
                inside = col < Sk and k < d
                KjT[U(k), U(c)] = acc(K[U(bh), U(col), U(k)]) if inside else ZERO
                Vj[U(c), U(k)] = acc(V[U(bh), U(col), U(k)]) if inside else ZERO
                idx += THREADS
            # Wait until KjT and Vj are complete.
            cuda.syncthreads()

            # Alg.1 l.8: Sij = Qi Kj^T, TM x TN per thread, TM + TN loads per k step.
            for a in range(TM):
                for b in range(TN):
                    s[a, b] = ZERO
            k = 0
            while k < DP:             # a while loop, not range(): see kernels/__init__.py
                for a in range(TM):
                    qa[a] = QiT[U(k), U(ty + TY * a)]
                for b in range(TN):
                    kb[b] = KjT[U(k), U(tx + TX * b)]
                for a in range(TM):
                    for b in range(TN):
                        s[a, b] += qa[a] * kb[b]
                k += 1
            # Scale and mask; this thread's part of each row's max ('>': NaN never wins).
            for a in range(TM):
                row = i * Br + ty + TY * a
                m_part = NEG_INF
                for b in range(TN):
                    col = j * Bc + tx + TX * b
                    visible = col < Sk and (not causal or col <= row + causal_offset)
                    x = s[a, b] * softmax_scale if visible else NEG_INF
                    s[a, b] = x
                    if x > m_part:
                        m_part = x
                red[U(ty + TY * a), U(tx)] = m_part
            # Wait until every partial row max is in red.
            cuda.syncthreads()

            # Alg.1 l.9: m_new, P~ij = exp(Sij - m_new) into Pij, l = alpha l + rowsum.
            for a in range(TM):
                r = ty + TY * a
                m_tile = NEG_INF
                for t in range(TX):
                    x = red[U(r), U(t)]
                    if x > m_tile:
                        m_tile = x
                m_new = m_tile if m_tile > m_i[a] else m_i[a]
                m_safe = ZERO if m_new == NEG_INF else m_new    # no key seen yet
                alpha = math.exp(m_i[a] - m_safe) if m_i[a] != NEG_INF else ZERO
                l_tile = ZERO
                for b in range(TN):
                    x = s[a, b]
                    p = math.exp(x - m_safe) if x != NEG_INF else ZERO
                    Pij[U(r), U(tx + TX * b)] = p
                    l_tile += p
                l_i[a] = alpha * l_i[a] + l_tile
                m_i[a] = m_new
                for e in range(DN):
                    o[a, e] *= alpha            # Alg.1 l.10: diag(alpha) O_i ...
            # Wait until Pij is complete.
            cuda.syncthreads()

            # Alg.1 l.10: ... + P~ij Vj, TM + DN loads per key.
            if not causal or j * Bc + Bc - 1 <= first_limit:
                # no key of this tile is hidden from any row of the block
                c = 0
                while c < Bc:             # a while loop, not range(): see kernels/__init__.py
                    for a in range(TM):
                        pa[a] = Pij[U(ty + TY * a), U(c)]
                    for e in range(DN):
                        ve[e] = Vj[U(c), U(tx + TX * e)]
                    for a in range(TM):
                        for e in range(DN):
                            o[a, e] += pa[a] * ve[e]
                    c += 1
            else:
                # the causal diagonal: hidden (row, key) pairs never read V (NaN-safe)
                c = 0
                while c < Bc:             # a while loop, not range(): see kernels/__init__.py
                    col = j * Bc + c
                    for a in range(TM):
                        pa[a] = Pij[U(ty + TY * a), U(c)]
                    for e in range(DN):
                        ve[e] = Vj[U(c), U(tx + TX * e)]
                    for a in range(TM):
                        if col <= i * Br + ty + TY * a + causal_offset:
                            for e in range(DN):
                                o[a, e] += pa[a] * ve[e]
                    c += 1

        # Alg.1 l.12-16: each row's sum from its TX parts (red was last read before the
        # last tile's fourth barrier, so it is free), normalise once, write O and L.
        for a in range(TM):
            red[U(ty + TY * a), U(tx)] = l_i[a]
        # Wait until every partial row sum is in red.
        cuda.syncthreads()
        for a in range(TM):
            r = ty + TY * a
            row = i * Br + r
            l_row = ZERO
            for t in range(TX):
                l_row += red[U(r), U(t)]
            if row < Sq:
                # l == 0: the row saw no key (fully masked): O = 0 and L = -inf exactly.
                # A NaN l is not 0, so NaN propagates.
                for e in range(DN):
                    k = tx + TX * e
                    if k < d:
                        O[bh, row, k] = ZERO if l_row == ZERO else o[a, e] / l_row
                if tx == 0:
                    L[bh, row] = NEG_INF if l_row == ZERO else m_i[a] + math.log(l_row)

    return forward_v4


# --- the launch contract ------------------------------------------------------------
#
# Tile rule: the first (Br, Bc, TM, TN) of V4_CANDIDATES whose shared memory fits in
# 48 KB and whose O block per thread, TM x DN with DN = DP / TX (TX = Bc / TN threads per
# row, DP = d padded to TX), has at most V4_MAX_O_REGS accumulators. Qi is staged in
# shared memory (DP x Br), which is what shrinks the tiles at large head dims; the O
# bound keeps the accumulators in registers (d = 128 at (32, 16, 4, 4), DN = 32, left a
# 528-byte stack frame in ptxas's report). On the simulator, V4_SIM_TILES: every thread
# launched and every barrier round is expensive there, and 8 x 8 tiles still cross
# several tile boundaries at the simulator's seqlens (<= 40) while a 2 x 2 thread tile
# exercises the register blocking and the reductions across threads.

V4_CANDIDATES = ((64, 32, 4, 4), (32, 32, 4, 4), (32, 16, 4, 2), (16, 16, 2, 2),
                 (16, 8, 2, 1), (8, 8, 2, 2), (8, 8, 1, 1), (4, 4, 1, 1))
V4_MAX_O_REGS = 64
V4_SIM_TILES = (8, 8, 2, 2)
VARIANTS = False
TILE_TABLE = False


def v4_head_dim_padded(Bc, TN, d):
    """DP: the head dim rounded up to the thread grid's width TX = Bc // TN."""
    TX = Bc // TN
    return (d + TX - 1) // TX * TX


def v4_shared_bytes(Br, Bc, TM, TN, d, acc_dtype):
    """Shared memory of forward v4: QiT (DP, Br+1), KjT (DP, Bc+1), Vj (Bc, DP),
    Pij (Br, Bc+1), red (Br, TX); DP = d rounded up to TX = Bc // TN."""
    TX = Bc // TN
    DP = v4_head_dim_padded(Bc, TN, d)
    n = DP * (Br + 1) + DP * (Bc + 1) + Bc * DP + Br * (Bc + 1) + Br * TX
    return n * np.dtype(acc_dtype).itemsize


def default_v4_tiles(d, acc_dtype, where=None):
    """v4 tile rule (above), (Br, Bc, TM, TN). GPU, float32: d <= 64 -> (64, 32, 4, 4),
    128 threads; d = 128 -> (32, 16, 4, 2), 64 threads; float64: d = 64 -> (32, 16, 4, 2)."""
    if here(where) == "simulator":
        return V4_SIM_TILES
    for Br, Bc, TM, TN in V4_CANDIDATES:
        DN = v4_head_dim_padded(Bc, TN, d) // (Bc // TN)
        if (TM * DN <= V4_MAX_O_REGS
                and v4_shared_bytes(Br, Bc, TM, TN, d, acc_dtype) <= SHARED_MEM_LIMIT):
            return Br, Bc, TM, TN
    raise ValueError(f"forward v4 cannot run this input: no v4 tile fits head dim {d} in "
                     f"{acc_dtype} within {SHARED_MEM_LIMIT} bytes of shared memory")


def check_v4_tiles(tiles, d, acc_dtype):
    """A caller's forward v4 tiles (``check_thread_tiles``)."""
    return check_thread_tiles(tiles, d, acc_dtype, "v4",
                              lambda Br, Bc, TM, TN: v4_shared_bytes(Br, Bc, TM, TN, d,
                                                                    acc_dtype))


def plan_blocked(p, where, tiles, reason, version, default_tiles, check_tiles, shared_bytes,
                 dynamic=False, variants=False):
    """The Plan of a register-blocked forward ``version`` (v4, or v5: v4's kernel with
    dynamic shared memory, ``dynamic``; ``Plan.shared_bytes`` is then what its launch
    asks for): grid (Tr, B * Hq), (Br / TM) x (Bc / TN) threads a block. A version that
    takes variants (``variants``, v5) runs them; the others refuse them."""
    if not variants:
        refuse_variants(version, p)
    if tiles is None:
        Br, Bc, TM, TN = default_tiles(p.d, p.acc_dtype, where)
        reason += f"; tiles by the {version} rule for d={p.d} in {p.acc_dtype}"
        if where == "simulator":
            reason += " (small tiles on the simulator, where every thread and barrier is slow)"
    else:
        Br, Bc, TM, TN = check_tiles(tiles, p.d, p.acc_dtype)
        reason += "; tiles given by the caller"
    nbytes = shared_bytes(Br, Bc, TM, TN, p.d, p.acc_dtype)
    if dynamic:
        reason += (f"; v4's kernel with its {nbytes} bytes of shared memory taken from "
                   f"dynamic shared memory (may exceed 48 KB)")
    if variants and p.variant.tile_table:
        reason += TILE_TABLE_REASON
    threads = (Br // TM) * (Bc // TN)
    return Plan("forward", version, f"forward_{version}", where, Br, Bc,
                (math.ceil(p.Sq / Br), p.BH), (threads,), nbytes, p.acc_dtype, p.causal, reason,
                variant_description(p) if variants else "plain", thread_tile=(TM, TN),
                dynamic_shared=dynamic)


def plan(p, where, tiles, reason):
    """The Plan of forward v4 for Problem ``p``."""
    return plan_blocked(p, where, tiles, reason, "v4", default_v4_tiles, check_v4_tiles,
                        v4_shared_bytes)


def kernel(plan, p):
    """The compiled kernel of ``plan`` (cached per compile-time parameters)."""
    TM, TN = plan.thread_tile
    return make_forward_v4(plan.Br, plan.Bc, TM, TN, p.d, p.upper, p.acc_dtype)
