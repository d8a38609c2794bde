"""Backward v1: a dK/dV kernel and a dQ kernel, one thread per row, no atomics.

Parent: the algorithm itself, FlashAttention-2's Algorithm 2, laid out as the mirror image
of forward v2 (forward/v2_flash2.py). After preprocess.py's D = rowsum(dO * O), the dK/dV
kernel runs one block per K/V tile with one thread per key row and walks the Q tiles; the
dQ kernel, Alg.2 l.15 in its own pass, runs one block per Q tile with one thread per
query row and walks the K/V tiles, as forward v2 does.

What it costs: Sij, Pij and dPij are computed in both passes, 7 tile products per (i, j)
pair (S, dV, dP, dK; S, dP, dQ) instead of Algorithm 2's 5, 40% more arithmetic; each
thread holds rows of d accumulators, so from d = 64 on the dK/dV kernel spills.
What it buys: every element of dQ, dK, dV has one owner thread that sums in a fixed
order, so the gradients are deterministic (repeated runs are bitwise identical), and dQ
needs no zero fill. It is the one backward that takes the variants (windows, GQA, masks,
softcap, ALiBi, score_mod), and the default for them.

Measured on the H200: 0.054x PyTorch SDPA EFFICIENT at (2, 16, 4096, 64) and 0.019x at
d = 128 (lab/runs/2026-11-30/07_run7_tests_bench_sanitize.txt). GPU and simulator.
"""

import functools
import math

import numpy as np
from numba import cuda

from .. import acc_type, jit_options
from ..bands import make_kv_tile_range, make_q_tile_range
from ..plan import (MAX_THREADS, SHARED_MEM_LIMIT, TILE_TABLE_REASON, Plan, Plans, parse_tiles,
                    variant_description)
from ..sequences import make_sequences
from ..variants import PLAIN, make_dropout, make_variant_functions


@functools.lru_cache(maxsize=None)
def make_backward_dkdv_v1(Br, Bc, d, causal, acc_dtype, variant=PLAIN):
    """v1 dK/dV kernel (Alg.2 l.5-19 without l.15); ``variant`` (kernels/variants.py) adds
    masks, score modifiers and dropout.

    Launch: grid (Tc, B * Hkv) with Tc = ceil(Sk / Bc), block (Bc,): thread c owns key row
    j*Bc + c of one K/V head. With GQA (Hkv < Hq) the block walks the Q tiles of each query
    head of its group in turn, in a fixed order, adding into the same registers: dK and dV
    are summed over the group without atomics.

    The block stages Kj and Vj once, then walks the Q tiles i: all threads copy Qi, dOi,
    L_i, D_i in together, then each thread recomputes its column of Pij and dSij and
    accumulates its rows of dKj and dVj in registers. Causal and windowed blocks skip the
    Q tiles whose rows see none of their keys (bands.py).

    Shared memory: Kj, Vj (Bc, d+1) and Qi, dOi (Br, d) in the accumulator dtype, plus
    L_i, D_i (Br,). The +1 pads Kj's and Vj's rows so that threads reading Kj[c, k] for
    the same k hit different banks; all threads read the same Qi[r, k] at once (a
    broadcast), so Qi needs no padding. Registers: four rows of d accumulators per thread
    (dKj, dVj and their per-tile partials), so the kernel spills from d = 64 on
    (``tests/ptx_check.py --link`` prints how much).

    Dropout (``variant.dropout``): each visible (row, col) asks ``kept`` (variants.py) the
    forward's question again; z = keep_scale where kept, 0 where dropped. dVj takes the
    dropped probability p * z, dP becomes dO . v * z, and dS = p (dP - D) keeps the
    undropped p (flash-attention's gradients of O = (P * keep / (1 - p)) V).
    """
    acc = acc_type(acc_dtype)
    ZERO = acc(0)
    NEG_INF = acc(-math.inf)
    KJ_COLS = d + 1                     # shared array shapes must be plain constants
    visible, score = make_variant_functions(variant, causal, acc_dtype)
    kept = make_dropout(variant).kept
    WINDOW = variant.window
    TILE_TABLE = variant.tile_table
    DROPOUT = variant.dropout
    q_tile_range = make_q_tile_range(Br, Bc, causal, WINDOW)

    VARLEN = variant.varlen
    sequences = make_sequences(VARLEN)
    locate, cut = sequences.locate, sequences.cut

    @cuda.jit(**jit_options())
    def backward_dkdv_v1(Q, K, V, dO, L, D, dK, dV, softmax_scale, causal_offset, window_lo,
                         Hq, group, softcap, slopes, attn_mask, tiles, seed_lo, seed_hi,
                         keep_threshold, keep_scale, seqs):
        bh_kv = cuda.blockIdx.y         # b * Hkv + h_kv: the K/V head
        b = bh_kv // (Hq // group)
        h_kv = bh_kv % (Hq // group)
        j = cuda.blockIdx.x             # K/V tile index (Alg.2 l.5: one block per j)
        # A packed batch: this block's sequence, as a batch of one (kernels/sequences.py)
        q0, k0, Sq, Sk, shift = locate(seqs, b, Q.shape[1], K.shape[1])
        b_mem = b                       # the batch index of the arrays' memory
        if VARLEN:
            if j * Bc >= Sk:
                return                  # past this sequence: the whole block, no barrier yet
            bh_kv, b_mem = h_kv, 0
        Q, dO, L, D = cut(Q, q0, Sq), cut(dO, q0, Sq), cut(L, q0, Sq), cut(D, q0, Sq)
        K, V, dK, dV = cut(K, k0, Sk), cut(V, k0, Sk), cut(dK, k0, Sk), cut(dV, k0, Sk)
        causal_offset += shift
        window_lo += shift
        c = cuda.threadIdx.x            # key row within the tile
        col = j * Bc + c
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
            bh = b_mem * Hq + h
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
                    # This Q tile's terms are summed on their own, then added to dKj and
                    # dVj, as l in forward v2: Sq terms added one by one into dKj lose
                    # float32 accuracy over long sequences (kernels/backward/__init__.py).
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
                            pd = p                  # the probability that reached O
                            if DROPOUT:
                                # the forward's keep mask, asked again (variants.py):
                                # z = keep_scale or 0; dV takes p z, dP = dO . v z
                                z = keep_scale if kept(seed_lo, seed_hi, keep_threshold, b, h,
                                                       row, col) else ZERO
                                pd = p * z
                                dp = dp * z
                            ds = p * (dp - D_i[r]) * g          # Alg.2 l.14, times d score / d s
                            for k in range(d):
                                dv_t[k] += pd * dOi[r, k]    # Alg.2 l.12: dVj += Pij^T dOi
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
    ``variant`` (kernels/variants.py) adds masks, score modifiers and dropout (dP times
    keep_scale where kept, 0 where dropped, as in the dK/dV kernel).

    Launch: grid (Tr, B * Hq) with Tr = ceil(Sq / Br), block (Br,): thread r owns query row
    i*Br + r, walks the K/V tiles as forward v2 does and accumulates its row of dQi in
    registers (no spills up to d = 64). Shared memory: Qi, dOi (Br, d+1) and Kj, Vj (Bc, d)
    in the accumulator dtype, laid out like forward v2 (Qi and dOi padded: thread r reads
    row r).
    """
    acc = acc_type(acc_dtype)
    ZERO = acc(0)
    NEG_INF = acc(-math.inf)
    QI_COLS = d + 1                     # shared array shapes must be plain constants
    visible, score = make_variant_functions(variant, causal, acc_dtype)
    kept = make_dropout(variant).kept
    WINDOW = variant.window
    TILE_TABLE = variant.tile_table
    DROPOUT = variant.dropout
    kv_tile_range = make_kv_tile_range(Br, Bc, causal, WINDOW)

    VARLEN = variant.varlen
    sequences = make_sequences(VARLEN)
    locate, cut = sequences.locate, sequences.cut

    @cuda.jit(**jit_options())
    def backward_dq_v1(Q, K, V, dO, L, D, dQ, softmax_scale, causal_offset, window_lo, Hq,
                       group, softcap, slopes, attn_mask, tiles, seed_lo, seed_hi,
                       keep_threshold, keep_scale, seqs):
        bh = cuda.blockIdx.y            # b * Hq + h: the query head
        b = bh // Hq
        h = bh % Hq
        bh_kv = b * (Hq // group) + h // group  # GQA: the K/V head this query head reads
        i = cuda.blockIdx.x             # Q tile index: one block per i
        # A packed batch: this block's sequence, as a batch of one (kernels/sequences.py)
        q0, k0, Sq, Sk, shift = locate(seqs, b, Q.shape[1], K.shape[1])
        if VARLEN:
            if i * Br >= Sq:
                return                  # past this sequence: the whole block, no barrier yet
            bh, bh_kv = h, h // group
        Q, dO, L, D, dQ = (cut(Q, q0, Sq), cut(dO, q0, Sq), cut(L, q0, Sq), cut(D, q0, Sq),
                           cut(dQ, q0, Sq))
        K, V = cut(K, k0, Sk), cut(V, k0, Sk)
        causal_offset += shift
        window_lo += shift
        r = cuda.threadIdx.x            # row within the tile
        row = i * Br + r
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
                        if DROPOUT:     # dP = dO . v z, z = keep_scale or 0 (as in dK/dV)
                            z = keep_scale if kept(seed_lo, seed_hi, keep_threshold, b, h, row,
                                                   col) else ZERO
                            dp = dp * z
                        ds = p * (dp - D_row) * g           # Alg.2 l.14, times d score / d s
                        for k in range(d):
                            dq_t[k] += ds * Kj[c, k]     # Alg.2 l.15: dQi += dSij Kj
                for k in range(d):
                    dq_i[k] += dq_t[k]

        if active:
            for k in range(d):
                dQ[bh, row, k] = dq_i[k] * softmax_scale

    return backward_dq_v1


@cuda.jit(device=True)
def _dots(Qi, dOi, Kj, Vj, r, c, d, ZERO):
    """One entry of Sij = Qi Kj^T (Alg.2 l.10, unscaled) and of dPij = dOi Vj^T (l.13)."""
    s = ZERO
    dp = ZERO
    for k in range(d):
        s += Qi[r, k] * Kj[c, k]
        dp += dOi[r, k] * Vj[c, k]
    return s, dp


# --- the launch contract ------------------------------------------------------------

# Tile rule (v1 and v2): one (Br, Bc) for the whole pass, the same tiling of the (i, j)
# tile pairs as Algorithm 2: the first candidate in TILE_CANDIDATES for which both tiled
# kernels fit in 48 KB of static shared memory. The dK/dV kernel holds Kj, Vj padded to
# Bc x (d+1), Qi and dOi of Br x d, and L_i, D_i of Br; the dQ kernel holds Qi, dOi padded
# to Br x (d+1) and Kj, Vj of Bc x d (all in the accumulator dtype). Each kernel holds two
# tiles more than the forward's, so tiles are smaller. Examples, float32: d=16 -> (64, 64);
# d=64 -> (32, 32); d=128 -> (16, 16); d=256 -> (8, 8). Bc is the dK/dV kernel's thread
# count and Br the dQ kernel's, so a caller's ``tiles=(Br, Bc)`` is checked against both
# (each <= 1024) and both shared memory sizes.
TILE_CANDIDATES = ((64, 64), (64, 32), (32, 32), (32, 16), (16, 16), (16, 8), (8, 8), (8, 4), (4, 4))


def dkdv_shared_bytes(Br, Bc, d, acc_dtype):
    """Shared memory of the dK/dV kernels: Kj, Vj (Bc, d+1) + Qi, dOi (Br, d) + L_i, D_i (Br)."""
    return (2 * Bc * (d + 1) + 2 * Br * d + 2 * Br) * np.dtype(acc_dtype).itemsize


def dq_shared_bytes(Br, Bc, d, acc_dtype):
    """Shared memory of the dQ kernel: Qi, dOi (Br, d+1) + Kj, Vj (Bc, d)."""
    return (2 * Br * (d + 1) + 2 * Bc * d) * np.dtype(acc_dtype).itemsize


def backward_shared_bytes(Br, Bc, d, acc_dtype):
    """The larger of the two tiled backward kernels' shared memory (the tile rule's test)."""
    return max(dkdv_shared_bytes(Br, Bc, d, acc_dtype), dq_shared_bytes(Br, Bc, d, acc_dtype))


def default_backward_tiles(d, acc_dtype):
    """The backward tile rule of v1 and v2 (above): largest candidate that fits."""
    for Br, Bc in TILE_CANDIDATES:
        if backward_shared_bytes(Br, Bc, d, acc_dtype) <= SHARED_MEM_LIMIT:
            return Br, Bc
    raise ValueError(f"no backward tile size fits head dim {d} in {acc_dtype} within "
                     f"{SHARED_MEM_LIMIT} bytes of shared memory")


def check_backward_tiles(tiles, d, acc_dtype):
    """Validate a caller's (Br, Bc) for the backward; ValueError names the limit."""
    Br, Bc = parse_tiles(tiles)
    for name, n, what in (("Br", Br, "query row (dQ kernel)"), ("Bc", Bc, "key row (dK/dV kernel)")):
        if n > MAX_THREADS:
            raise ValueError(f"{name} = {n} exceeds {MAX_THREADS}: the backward runs one thread "
                             f"per {what}, and a block holds at most {MAX_THREADS} threads")
    need = backward_shared_bytes(Br, Bc, d, acc_dtype)
    if need > SHARED_MEM_LIMIT:
        raise ValueError(f"tiles (Br, Bc) = ({Br}, {Bc}) need {need} bytes of shared memory in "
                         f"the backward at head dim {d} in {acc_dtype}; the limit is "
                         f"{SHARED_MEM_LIMIT} (48 KB static shared memory per block)")
    return Br, Bc


def backward_tiles(p, tiles, reason):
    """(Br, Bc, reason) for v1 and v2: the caller's ``tiles`` checked, or the rule's."""
    if tiles is None:
        Br, Bc = default_backward_tiles(p.d, p.acc_dtype)
        reason += f"; tiles by the default backward rule for d={p.d} in {p.acc_dtype}"
    else:
        Br, Bc = check_backward_tiles(tiles, p.d, p.acc_dtype)
        reason += "; tiles given by the caller"
    return Br, Bc, reason


VARIANTS = True                # takes the variant arguments (kernels/variants.py)
TILE_TABLE = True              # skips the tiles a mask leaves empty (variants.make_tile_table)


def plan(p, where, tiles, reason, preprocess):
    """The Plans of backward v1 for Problem ``p``: D, then dK/dV with grid (Tc, B * Hkv)
    and Bc threads, then dQ with grid (Tr, B * Hq) and Br threads; static shared memory."""
    Br, Bc, reason = backward_tiles(p, tiles, reason)
    variant = variant_description(p)
    Tr, Tc = math.ceil(p.Sq / Br), math.ceil(p.Sk / Bc)
    gqa = (f"; GQA: each block sums over the {p.group} query heads of its K/V head in a "
           f"fixed order" if p.group > 1 else "")
    if p.variant.tile_table:
        gqa += TILE_TABLE_REASON
    return Plans((
        preprocess,
        Plan("backward dK dV", "v1", "backward_dkdv_v1", where, Br, Bc, (Tc, p.BHkv),
             (Bc,), dkdv_shared_bytes(Br, Bc, p.d, p.acc_dtype), p.acc_dtype, p.causal,
             reason + "; one block per K/V tile, one thread per key row" + gqa, variant),
        Plan("backward dQ", "v1", "backward_dq_v1", where, Br, Bc, (Tr, p.BH), (Br,),
             dq_shared_bytes(Br, Bc, p.d, p.acc_dtype), p.acc_dtype, p.causal,
             reason + "; one block per Q tile, one thread per query row"
             + (TILE_TABLE_REASON if p.variant.tile_table else ""), variant),
    ))


def kernel(plan, p):
    """The compiled kernel of one of v1's plans (cached per compile-time parameters)."""
    make = {"backward_dkdv_v1": make_backward_dkdv_v1,
            "backward_dq_v1": make_backward_dq_v1}[plan.kernel]
    return make(plan.Br, plan.Bc, p.d, p.upper, p.acc_dtype, p.variant)
