"""Backward attention kernels: dQ, dK, dV from dO, by FlashAttention-2 Algorithm 2.

Given the forward's inputs Q (BH, Sq, d), K, V (BH, Sk, d), its output O (BH, Sq, d) and
logsumexp L (BH, Sq), and the upstream gradient dO (BH, Sq, d), the kernels write
dQ (BH, Sq, d) and dK, dV (BH, Sk, d). Nothing of size Sq x Sk is stored: every kernel
recomputes its tile of the probabilities, Pij = exp(scale * Qi Kj^T - L_i) (Alg.2 l.10-11),
from the saved L. The math, per visible (row, col) entry:

    p  = exp(scale * q . k - L)          Alg.2 l.10-11
    dV[col] += p * dO[row]               Alg.2 l.12
    dp = dO[row] . v                     Alg.2 l.13
    ds = p * (dp - D[row])               Alg.2 l.14, with D = rowsum(dO * O) (l.4)
    dQ[row] += scale * ds * k            Alg.2 l.15
    dK[col] += scale * ds * q            Alg.2 l.16

(The paper's S has no scale; ours is scale * Q K^T, so dQ and dK carry one factor of it.)
Kernels are built by cached factories whose arguments are compile-time constants (tile
sizes, head dim, causal or not, accumulator dtype); run-time arguments are
``softmax_scale`` and ``causal_offset``, as in forward.py: key column c is visible from
query row r iff c <= r + causal_offset.

The version ladder (each step says what changes against the previous one):

v1  Three kernels, no atomics; the default.
    backward_preprocess: D = rowsum(dO * O) (Alg.2 l.4), one thread per query row.
    backward_dkdv_v1: Alg.2 l.5-19 without l.15. One thread block per (K/V tile j,
        head bh), one thread per key row of the tile (the mirror image of forward v2's
        one thread per query row). The block stages Kj and Vj in shared memory once, then
        walks the Q tiles i: all threads copy Qi, dOi, L_i, D_i in together, then each
        thread recomputes its column of Pij and dSij and accumulates its rows of dKj and
        dVj in registers. Causal blocks skip the leading Q tiles whose rows see none of
        their columns.
    backward_dq_v1: Alg.2 l.15 in its own pass. One block per (Q tile i, head), one
        thread per query row, walking the K/V tiles like forward v2 and accumulating its
        row of dQi in registers.
    Cost: Sij, Pij and dPij are computed twice, once per pass: 7 tile products per
    (i, j) pair (S, dV, dP, dK; S, dP, dQ) instead of Alg.2's 5, 40% more arithmetic.
    What it buys: every element of dQ, dK, dV has one owner thread that sums in a fixed
    order, so repeated runs are bitwise identical, and no zero-filled dQ is needed.
    Registers (ptxas for sm_90, default tiles, float32): the dQ kernel does not spill up
    to d = 64; the dK/dV kernel, with four rows of d accumulators per thread (dKj, dVj and
    their per-tile partials, below), spills from d = 64 on (164-284 bytes at d = 64, about
    2.4 KB at d = 128). tests/ptx_check.py prints the table.

v2  A lesson, not the default: Alg.2 l.15 as the paper writes it. backward_dkdv_dq_v2 is
    backward_dkdv_v1 plus, inside the loop over Q tiles, cuda.atomic.add of
    scale * ds * Kj[c] into dQ in HBM; there is no dQ pass (5 tile products per pair).
    Why it is not the default: (1) floating-point addition is not associative and the
    order in which blocks and threads add into dQ changes from run to run on a GPU, so
    dQ is not bitwise reproducible (TESTING.md requires it of the default path); (2) all
    Bc threads of a block add into the same dQ row at once, Br * Bc * d contended atomics
    per tile pair; (3) dQ must be zero-filled before the launch; (4) it accumulates in
    dQ itself, so it needs dQ in the accumulator dtype: float32 or float64 inputs only
    (flash-attention adds into a float32 scratch buffer and converts it afterwards, and
    offers a deterministic mode for the reason in (1)).

Float32 sums: every accumulator (dKj, dVj over the Q tiles; dQi over the K/V tiles) adds
one tile's terms into a fresh partial first and then adds the partial, as the forward does
with l. Adding Sq terms one by one made dK's error 3x a float32 matmul's on the H200 at
Sq = 1024 (the bound of TESTING.md's rule). The price is d more registers per
accumulator: from d = 64 on, the dK/dV kernels spill (tests/ptx_check.py reports it).

Variants (kernels/variants.py, docs/variants.md): the v1 kernels take a compile-time
``variant`` and seven more run-time arguments after causal_offset (window_lo, Hq, group,
softcap, slopes, attn_mask, tiles). dS is multiplied by d score / d s (softcap, score_mod_grad).
With GQA the dK/dV kernel runs one block per K/V head and tile, and walks the Q tiles of
every query head of its group in a fixed order: dK, dV summed without atomics. Tiles
that a boolean attn_mask or a mask_mod leaves empty are skipped through the table of
visible tiles (``tiles``, variants.make_tile_table). v2 is
plain attention only (the dispatcher refuses variants).

Timed on the H200 in docs/performance.md (v1: 0.054x SDPA EFFICIENT at (2, 16,
4096, 64)). Fully masked rows (causal with Sq > Sk, where L = -inf) have P = 0:
the kernels skip them before computing exp, so they give a zero dQ row, add nothing to
dK and dV, and no exp(-inf - (-inf)) is ever evaluated. Masked keys are never read into
a sum, so NaN there has no effect; NaN in a visible input propagates.
"""

import functools
import math

from numba import cuda

from . import acc_type, jit_options
from .bands import make_kv_tile_range, make_q_tile_range
from .variants import PLAIN, make_variant_functions

VERSIONS = ("v1", "v2")


@functools.lru_cache(maxsize=None)
def make_backward_preprocess(d, acc_dtype):
    """D = rowsum(dO * O) (Alg.2 l.4): D (BH, Sq) in the accumulator dtype.

    Launch: grid (ceil(Sq / threads), BH), block (threads,): one thread per query row.
    """
    acc = acc_type(acc_dtype)
    ZERO = acc(0)

    @cuda.jit(**jit_options())
    def backward_preprocess(dO, O, D):
        bh = cuda.blockIdx.y
        row = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        if row >= dO.shape[1]:
            return                      # no barriers in this kernel, so early exit is safe
        D_row = ZERO
        for k in range(d):
            D_row += acc(dO[bh, row, k]) * acc(O[bh, row, k])
        D[bh, row] = D_row              # a fully masked row has O = 0, so D = 0

    return backward_preprocess


@functools.lru_cache(maxsize=None)
def make_backward_dkdv_v1(Br, Bc, d, causal, acc_dtype, variant=PLAIN):
    """v1 dK/dV kernel (Alg.2 l.5-19 without l.15); ``variant`` (kernels/variants.py) adds
    masks and score modifiers.

    Launch: grid (Tc, B * Hkv) with Tc = ceil(Sk / Bc), block (Bc,): thread c owns key row
    j*Bc + c of one K/V head. With GQA (Hkv < Hq) the block walks the Q tiles of each query
    head of its group in turn, in a fixed order, adding into the same registers: dK and dV
    are summed over the group without atomics. Shared memory: Kj, Vj (Bc, d+1) and Qi, dOi (Br, d) in the accumulator
    dtype, plus L_i, D_i (Br,). The +1 pads Kj's and Vj's rows so that threads reading
    Kj[c, k] for the same k hit different banks; all threads read the same Qi[r, k] at
    once (a broadcast), so Qi needs no padding.
    """
    acc = acc_type(acc_dtype)
    ZERO = acc(0)
    NEG_INF = acc(-math.inf)
    KJ_COLS = d + 1                     # shared array shapes must be plain constants
    visible, score = make_variant_functions(variant, causal, acc_dtype)
    WINDOW = variant.window
    TILE_TABLE = variant.tile_table
    q_tile_range = make_q_tile_range(Br, Bc, causal, WINDOW)

    @cuda.jit(**jit_options())
    def backward_dkdv_v1(Q, K, V, dO, L, D, dK, dV, softmax_scale, causal_offset, window_lo,
                         Hq, group, softcap, slopes, attn_mask, tiles):
        bh_kv = cuda.blockIdx.y         # b * Hkv + h_kv: the K/V head
        b = bh_kv // (Hq // group)
        h_kv = bh_kv % (Hq // group)
        j = cuda.blockIdx.x             # K/V tile index (Alg.2 l.5: one block per j)
        c = cuda.threadIdx.x            # key row within the tile
        col = j * Bc + c
        Sq = Q.shape[1]
        Sk = K.shape[1]
        active = col < Sk               # the last tile may be ragged; idle threads still
                                        # help load Q tiles and must reach every barrier

        Kj = cuda.shared.array((Bc, KJ_COLS), acc)
        Vj = cuda.shared.array((Bc, KJ_COLS), acc)
        Qi = cuda.shared.array((Br, d), acc)
        dOi = cuda.shared.array((Br, d), acc)
        L_i = cuda.shared.array(Br, acc)
        D_i = cuda.shared.array(Br, acc)
        dk_j = cuda.local.array(d, acc)  # this thread's row of dKj (registers)
        dv_j = cuda.local.array(d, acc)  # this thread's row of dVj
        dk_t = cuda.local.array(d, acc)  # one Q tile's part of them (see below)
        dv_t = cuda.local.array(d, acc)
        # Alg.2 l.6: load Kj, Vj. The Bc threads copy the tile together (consecutive
        # threads, consecutive addresses); rows past Sk are 0 and never used.
        for idx in range(c, Bc * d, Bc):
            cc = idx // d
            k = idx % d
            kv_col = j * Bc + cc
            Kj[cc, k] = acc(K[bh_kv, kv_col, k]) if kv_col < Sk else ZERO
            Vj[cc, k] = acc(V[bh_kv, kv_col, k]) if kv_col < Sk else ZERO
        for k in range(d):
            dk_j[k] = ZERO              # Alg.2 l.7: dKj = 0, dVj = 0
            dv_j[k] = ZERO

        # Alg.2 l.8: loop over Q tiles, only those with a row that sees a column of this
        # tile through the causal mask and the window (bands.py; tiled.first_q_tile).
        i_start, i_end = q_tile_range(j, Sq, causal_offset, window_lo)
        # GQA: the query heads of this K/V head's group, one after another (group = 1
        # without GQA): a fixed order, so the sums are bitwise reproducible.
        for g_idx in range(group):
            h = h_kv * group + g_idx    # the query head
            bh = b * Hq + h
            for i in range(i_start, i_end):
                if TILE_TABLE and not tiles[bh, i, j]:
                    continue            # the mask leaves this tile empty (variants.py)
                # Wait until every thread has finished reading the previous Qi, dOi, L_i, D_i
                # (on the first pass: until Kj and Vj are complete).
                cuda.syncthreads()
                # Alg.2 l.9: load Qi, dOi, L_i, D_i. Rows past Sq get L = -inf: no key is
                # visible from them, so they are skipped below.
                for idx in range(c, Br * d, Bc):
                    r = idx // d
                    k = idx % d
                    row = i * Br + r
                    Qi[r, k] = acc(Q[bh, row, k]) if row < Sq else ZERO
                    dOi[r, k] = acc(dO[bh, row, k]) if row < Sq else ZERO
                for r in range(c, Br, Bc):
                    row = i * Br + r
                    L_i[r] = L[bh, row] if row < Sq else NEG_INF
                    D_i[r] = D[bh, row] if row < Sq else ZERO
                # Wait until the Q-side tiles are complete before any thread reads them.
                cuda.syncthreads()
                if active:
                    # This Q tile's terms are summed on their own, then added to dKj and dVj:
                    # in float32, adding Sq terms one by one into dKj made its error 3x that of
                    # a float32 matmul on the H200 at Sq = 1024 (as l in the forward, v2).
                    for k in range(d):
                        dk_t[k] = ZERO
                        dv_t[k] = ZERO
                    for r in range(Br):
                        row = i * Br + r
                        # A row that sees no key (L = -inf) has P = 0: skip it rather than
                        # compute exp(s - L) = exp(+inf). Masked entries are not computed.
                        if row < Sq and L_i[r] != NEG_INF and visible(
                                b, h, row, col, Sk, causal_offset, window_lo, attn_mask):
                            s, dp = _dots(Qi, dOi, Kj, Vj, r, c, d, ZERO)   # Alg.2 l.10, l.13
                            s, g = score(s * softmax_scale, b, h, row, col, Sq, Sk, softcap,
                                         slopes, attn_mask)
                            p = math.exp(s - L_i[r])            # Alg.2 l.11
                            ds = p * (dp - D_i[r]) * g          # Alg.2 l.14, times d score / d s
                            for k in range(d):
                                dv_t[k] += p * dOi[r, k]     # Alg.2 l.12: dVj += Pij^T dOi
                                dk_t[k] += ds * Qi[r, k]     # Alg.2 l.16: dKj += dSij^T Qi
                    for k in range(d):
                        dk_j[k] += dk_t[k]
                        dv_j[k] += dv_t[k]

        if active:                      # Alg.2 l.18: write dKj, dVj
            for k in range(d):
                dK[bh_kv, col, k] = dk_j[k] * softmax_scale
                dV[bh_kv, col, k] = dv_j[k]

    return backward_dkdv_v1


@functools.lru_cache(maxsize=None)
def make_backward_dq_v1(Br, Bc, d, causal, acc_dtype, variant=PLAIN):
    """v1 dQ kernel (Alg.2 l.15 as its own pass, so that no two blocks write one dQ row);
    ``variant`` (kernels/variants.py) adds masks and score modifiers.

    Launch: grid (Tr, B * Hq) with Tr = ceil(Sq / Br), block (Br,): thread r owns query row
    i*Br + r. Shared memory: Qi, dOi (Br, d+1) and Kj, Vj (Bc, d) in the accumulator
    dtype, laid out like forward v2 (Qi and dOi padded: thread r reads row r).
    """
    acc = acc_type(acc_dtype)
    ZERO = acc(0)
    NEG_INF = acc(-math.inf)
    QI_COLS = d + 1                     # shared array shapes must be plain constants
    visible, score = make_variant_functions(variant, causal, acc_dtype)
    WINDOW = variant.window
    TILE_TABLE = variant.tile_table
    kv_tile_range = make_kv_tile_range(Br, Bc, causal, WINDOW)

    @cuda.jit(**jit_options())
    def backward_dq_v1(Q, K, V, dO, L, D, dQ, softmax_scale, causal_offset, window_lo, Hq,
                       group, softcap, slopes, attn_mask, tiles):
        bh = cuda.blockIdx.y            # b * Hq + h: the query head
        b = bh // Hq
        h = bh % Hq
        bh_kv = b * (Hq // group) + h // group  # GQA: the K/V head this query head reads
        i = cuda.blockIdx.x             # Q tile index: one block per i
        r = cuda.threadIdx.x            # row within the tile
        row = i * Br + r
        Sq = Q.shape[1]
        Sk = K.shape[1]
        active = row < Sq               # idle threads of a ragged tile still help load
                                        # K/V tiles and must reach every barrier

        Qi = cuda.shared.array((Br, QI_COLS), acc)
        dOi = cuda.shared.array((Br, QI_COLS), acc)
        Kj = cuda.shared.array((Bc, d), acc)
        Vj = cuda.shared.array((Bc, d), acc)
        dq_i = cuda.local.array(d, acc)  # this thread's row of dQi (registers)
        dq_t = cuda.local.array(d, acc)  # one K/V tile's part of it
        # Alg.2 l.9: load this row of Qi and dOi (only thread r reads row r: no barrier
        # needed before use), and its L and D into registers.
        for k in range(d):
            dq_i[k] = ZERO
            Qi[r, k] = acc(Q[bh, row, k]) if active else ZERO
            dOi[r, k] = acc(dO[bh, row, k]) if active else ZERO
        L_row = L[bh, row] if active else NEG_INF
        D_row = D[bh, row] if active else ZERO

        # Loop over the K/V tiles that some row of this tile sees (as in forward v2;
        # bands.py, tiled.tiles_needed).
        j_start, j_end = kv_tile_range(i, Sk, causal_offset, window_lo)
        for j in range(j_start, j_end):
            if TILE_TABLE and not tiles[bh, i, j]:
                continue                # the mask leaves this tile empty (variants.py)
            # Wait until every thread has finished reading the previous Kj and Vj.
            cuda.syncthreads()
            # Alg.2 l.6: load Kj, Vj together; rows past Sk are 0 (and masked below).
            for idx in range(r, Bc * d, Br):
                c = idx // d
                k = idx % d
                col = j * Bc + c
                Kj[c, k] = acc(K[bh_kv, col, k]) if col < Sk else ZERO
                Vj[c, k] = acc(V[bh_kv, col, k]) if col < Sk else ZERO
            # Wait until Kj and Vj are complete before any thread reads them.
            cuda.syncthreads()
            # A row that sees no key (L = -inf, or past Sq) has P = 0: skip it.
            if active and L_row != NEG_INF:
                for k in range(d):      # this K/V tile's part, summed on its own (as dKj)
                    dq_t[k] = ZERO
                for c in range(Bc):
                    col = j * Bc + c
                    if visible(b, h, row, col, Sk, causal_offset, window_lo, attn_mask):
                        s, dp = _dots(Qi, dOi, Kj, Vj, r, c, d, ZERO)   # Alg.2 l.10, l.13
                        s, g = score(s * softmax_scale, b, h, row, col, Sq, Sk, softcap,
                                     slopes, attn_mask)
                        p = math.exp(s - L_row)             # Alg.2 l.11
                        ds = p * (dp - D_row) * g           # Alg.2 l.14, times d score / d s
                        for k in range(d):
                            dq_t[k] += ds * Kj[c, k]     # Alg.2 l.15: dQi += dSij Kj
                for k in range(d):
                    dq_i[k] += dq_t[k]

        if active:
            for k in range(d):
                dQ[bh, row, k] = dq_i[k] * softmax_scale

    return backward_dq_v1


@functools.lru_cache(maxsize=None)
def make_backward_dkdv_dq_v2(Br, Bc, d, causal, acc_dtype):
    """v2 (lesson): backward_dkdv_v1 plus Alg.2 l.15 by atomic adds into dQ.

    Launch and shared memory as ``make_backward_dkdv_v1``. dQ must be zero-filled and in
    the accumulator dtype. Not bitwise reproducible on a GPU: see the module docstring.
    """
    acc = acc_type(acc_dtype)
    ZERO = acc(0)
    NEG_INF = acc(-math.inf)
    KJ_COLS = d + 1                     # shared array shapes must be plain constants
    q_tile_range = make_q_tile_range(Br, Bc, causal, False)

    @cuda.jit(**jit_options())
    def backward_dkdv_dq_v2(Q, K, V, dO, L, D, dQ, dK, dV, softmax_scale, causal_offset):
        bh = cuda.blockIdx.y
        j = cuda.blockIdx.x             # K/V tile index (Alg.2 l.5: one block per j)
        c = cuda.threadIdx.x            # key row within the tile
        col = j * Bc + c
        Sq = Q.shape[1]
        Sk = K.shape[1]
        active = col < Sk               # idle threads still load and reach every barrier

        Kj = cuda.shared.array((Bc, KJ_COLS), acc)
        Vj = cuda.shared.array((Bc, KJ_COLS), acc)
        Qi = cuda.shared.array((Br, d), acc)
        dOi = cuda.shared.array((Br, d), acc)
        L_i = cuda.shared.array(Br, acc)
        D_i = cuda.shared.array(Br, acc)
        dk_j = cuda.local.array(d, acc)  # this thread's row of dKj (registers)
        dv_j = cuda.local.array(d, acc)  # this thread's row of dVj
        dk_t = cuda.local.array(d, acc)  # one Q tile's part of them (see below)
        dv_t = cuda.local.array(d, acc)
        for idx in range(c, Bc * d, Bc):  # Alg.2 l.6: load Kj, Vj
            cc = idx // d
            k = idx % d
            kv_col = j * Bc + cc
            Kj[cc, k] = acc(K[bh, kv_col, k]) if kv_col < Sk else ZERO
            Vj[cc, k] = acc(V[bh, kv_col, k]) if kv_col < Sk else ZERO
        for k in range(d):
            dk_j[k] = ZERO              # Alg.2 l.7
            dv_j[k] = ZERO

        i_start, i_end = q_tile_range(j, Sq, causal_offset, 0)     # bands.py
        for i in range(i_start, i_end):     # Alg.2 l.8
            # Wait until every thread has finished reading the previous Q-side tiles
            # (on the first pass: until Kj and Vj are complete).
            cuda.syncthreads()
            for idx in range(c, Br * d, Bc):   # Alg.2 l.9: load Qi, dOi, L_i, D_i
                r = idx // d
                k = idx % d
                row = i * Br + r
                Qi[r, k] = acc(Q[bh, row, k]) if row < Sq else ZERO
                dOi[r, k] = acc(dO[bh, row, k]) if row < Sq else ZERO
            for r in range(c, Br, Bc):
                row = i * Br + r
                L_i[r] = L[bh, row] if row < Sq else NEG_INF
                D_i[r] = D[bh, row] if row < Sq else ZERO
            # Wait until the Q-side tiles are complete before any thread reads them.
            cuda.syncthreads()
            if active:
                for k in range(d):      # this Q tile's part, summed on its own (as in v1)
                    dk_t[k] = ZERO
                    dv_t[k] = ZERO
                for r in range(Br):
                    row = i * Br + r
                    visible = row < Sq and (not causal or col <= row + causal_offset)
                    if visible and L_i[r] != NEG_INF:
                        p, ds = _p_and_ds(Qi, dOi, Kj, Vj, r, c, L_i[r], D_i[r],
                                          softmax_scale, d, ZERO)   # Alg.2 l.10-14
                        for k in range(d):
                            dv_t[k] += p * dOi[r, k]     # Alg.2 l.12
                            dk_t[k] += ds * Qi[r, k]     # Alg.2 l.16
                            # Alg.2 l.15: dQi += dSij Kj, straight into HBM. Every thread
                            # of every block with a visible column adds here: atomics.
                            cuda.atomic.add(dQ, (bh, row, k), softmax_scale * ds * Kj[c, k])
                for k in range(d):
                    dk_j[k] += dk_t[k]
                    dv_j[k] += dv_t[k]

        if active:                      # Alg.2 l.18
            for k in range(d):
                dK[bh, col, k] = dk_j[k] * softmax_scale
                dV[bh, col, k] = dv_j[k]

    return backward_dkdv_dq_v2


@cuda.jit(device=True)
def _dots(Qi, dOi, Kj, Vj, r, c, d, ZERO):
    """One entry of Sij = Qi Kj^T (Alg.2 l.10, unscaled) and of dPij = dOi Vj^T (l.13)."""
    s = ZERO
    dp = ZERO
    for k in range(d):
        s += Qi[r, k] * Kj[c, k]
        dp += dOi[r, k] * Vj[c, k]
    return s, dp


@cuda.jit(device=True)
def _p_and_ds(Qi, dOi, Kj, Vj, r, c, L_r, D_r, softmax_scale, d, ZERO):
    """One visible entry (row r of the Q tiles, row c of the K/V tiles), Alg.2 l.10-14.

    Returns p = exp(scale * Qi[r] . Kj[c] - L_r) and ds = p * (dOi[r] . Vj[c] - D_r).
    The v2 kernel (plain attention only) calls it; the v1 kernels, which take variants,
    write the same steps out with the variant's score function in the middle.
    The caller guarantees L_r != -inf, so s - L_r is never -inf - (-inf).
    """
    s = ZERO
    dp = ZERO
    for k in range(d):
        s += Qi[r, k] * Kj[c, k]        # Alg.2 l.10: Sij = Qi Kj^T (one entry)
        dp += dOi[r, k] * Vj[c, k]      # Alg.2 l.13: dPij = dOi Vj^T (one entry)
    p = math.exp(s * softmax_scale - L_r)   # Alg.2 l.11: Pij = exp(Sij - L_i)
    ds = p * (dp - D_r)                 # Alg.2 l.14: dSij = Pij * (dPij - D_i)
    return p, ds
