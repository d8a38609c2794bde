"""Backward v4: v3 with its tiles in dynamic shared memory.

Parent: v3 (v3_register_blocked.py). v4 runs v3's two kernels with the algorithm, thread
layout, barriers and NaN-safety unchanged, as forward v5 does forward v4 (and takes
variants, below): each kernel's shared arrays are slices of one dynamic shared array at
compile-time offsets (dkdv_v4_shared_layout, dq_v4_shared_layout), indexed flat and
unsigned (kernels/smem.py's U). The byte count goes with each launch, and above 48 KB the kernel
is first allowed it (kernels/smem.py; up to 227 KB a block on the H200).

What it buys: tiles past v3's 48 KB. Float32 defaults: (64, 64, 4, 4) up to d = 64 and
(32, 32, 2, 2) up to d = 128, 256 threads each, against v3's (32, 32, 4, 2) and
(16, 16, 2, 1) with 128; at d = 128 that is 1 shared load per FMA in Sij and dPij
(v3: 1.5). Measured on the H200 at (2, 16, 4096, d): 24.13 ms against v3's 28.68 at
d = 64 (causal, the two tie), 65.41 against 89.33 at d = 128
(lab/runs/2026-12-01/26_timing_branch.txt): as fast as v3 to 1.4x faster. What it costs:
with signed indices, the slices' negative-index wraparound made v4 slower than v3 with
every tile (lab/runs/2026-12-01/18_bwd_v4_sweep.txt); hence U.

Variants (kernels/variants.py), as backward v1 takes them: the dK/dV kernel runs one
block per (K/V tile, K/V head) and walks the Q tiles of every query head of its group in
a fixed order, so GQA/MQA dK and dV are summed without atomics and stay deterministic;
the dQ kernel reads its query head's K/V head. Windows narrow the tile ranges
(bands.py), the table of visible tiles skips the tiles a boolean attn_mask or a
mask_mod leaves empty, and visible() / score() (dS times d score / d s) run per entry
for windows, masks and score modifiers. Dropout regenerates the forward's keep mask per
entry (variants.make_dropout): Pij holds the dropped probabilities for dV, and dP is
dropped before dS. Plain attention (with or without the causal mask) compiles all of it
away.

The default on the simulator for plain float32 and float16 attention with d <= 128, and
on a GPU where v6 cannot run (an input holds NaN or inf, or no v6 tile fits). With the
same tiles its gradients are bitwise v3's on the simulator for plain attention.
Deterministic; GPU and simulator.
"""

import functools
from collections import namedtuple
import math

import numpy as np
from numba import cuda

from .. import LOG2E, acc_type, jit_options
from ..bands import make_kv_tile_range, make_q_tile_range
from ..plan import (DYNAMIC_LIMIT_WHY, DYNAMIC_SHARED_MEM_LIMIT, check_thread_tiles,
                    device_dynamic_shared_limit)
from ..sequences import make_sequences
from ..smem import U
from ..variants import PLAIN, make_dropout, make_variant_functions
from .v3_register_blocked import (BWD_V3_MAX_ACC_REGS, BWD_V3_SIM_TILES, backward_v3_acc_regs,
                                  plan_register_blocked, v3_thread_grid)


# --- v4: v3 with dynamic shared memory ----------------------------------------------------


# What dkdv_v4_shared_layout returns, by name.
DkdvV4Layout = namedtuple("DkdvV4Layout", "K_AT V_AT Q_AT dO_AT P_AT dS_AT L_AT D_AT END")


def dkdv_v4_shared_layout(Br, Bc, TM, TN, d):
    """Where backward_dkdv_v4's arrays sit in its one dynamic shared array: the offsets, in
    elements of the accumulator dtype, of KjT, VjT, QiT, dOiT, Pij, dSij, L_i, D_i (v3's
    eight static arrays, same shapes, back to back, each row by row) and the end, which is
    the array's length: (K_AT, V_AT, Q_AT, dO_AT, P_AT, dS_AT, L_AT, D_AT, END). With
    v3_thread_grid's DPY (d rounded up to TY = Br // TM): KjT, VjT (DPY, Bc+1), QiT, dOiT
    (DPY, Br+1), Pij, dSij (Br, Bc+1), L_i, D_i (Br). ``dkdv_v4_shared_bytes`` is
    END times the itemsize (the same bytes as v3's)."""
    DP = v3_thread_grid(Br, Bc, TM, TN, d).DPY
    K_AT = 0
    V_AT = K_AT + DP * (Bc + 1)
    Q_AT = V_AT + DP * (Bc + 1)
    dO_AT = Q_AT + DP * (Br + 1)
    P_AT = dO_AT + DP * (Br + 1)
    dS_AT = P_AT + Br * (Bc + 1)
    L_AT = dS_AT + Br * (Bc + 1)
    D_AT = L_AT + Br
    END = D_AT + Br
    return DkdvV4Layout(K_AT, V_AT, Q_AT, dO_AT, P_AT, dS_AT, L_AT, D_AT, END)


# What dq_v4_shared_layout returns, by name.
DqV4Layout = namedtuple("DqV4Layout", "Q_AT dO_AT K_AT V_AT dS_AT END")


def dq_v4_shared_layout(Br, Bc, TM, TN, d):
    """Where backward_dq_v4's arrays sit in its one dynamic shared array: the offsets of
    QiT, dOiT (DPX, Br+1), KjT, VjT (DPX, Bc+1) and dSij (Br, Bc+1), DPX = d rounded up to
    TX = Bc // TN, and the end: (Q_AT, dO_AT, K_AT, V_AT, dS_AT, END).
    ``dq_v4_shared_bytes`` is END times the itemsize (the same bytes as v3's)."""
    DP = v3_thread_grid(Br, Bc, TM, TN, d).DPX
    Q_AT = 0
    dO_AT = Q_AT + DP * (Br + 1)
    K_AT = dO_AT + DP * (Br + 1)
    V_AT = K_AT + DP * (Bc + 1)
    dS_AT = V_AT + DP * (Bc + 1)
    END = dS_AT + Br * (Bc + 1)
    return DqV4Layout(Q_AT, dO_AT, K_AT, V_AT, dS_AT, END)


@functools.lru_cache(maxsize=None)
def make_backward_dkdv_v4(Br, Bc, TM, TN, d, causal, acc_dtype, variant=PLAIN):
    """v4 dK/dV kernel: ``make_backward_dkdv_v3``'s kernel with its shared memory taken
    from dynamic shared memory (GPU and simulator; the module docstring says where it is
    the default).

    For plain attention the algorithm, thread layout, barriers and NaN-safety are v3's
    line for line (see make_backward_dkdv_v3 for what each thread owns and why;
    variants: below); only where the eight shared
    arrays come from changes, as forward v5 changes forward v4. v3 declares them with
    ``cuda.shared.array(shape, dtype)`` (static, at most 48 KB per block, which is what
    holds v3 to (16, 16, 2, 1) tiles at d = 128); v4 declares ONE dynamic array,
    ``cuda.shared.array(0, acc)``, and cuts it into v3's arrays at the compile-time
    offsets of ``dkdv_v4_shared_layout``: each is a 1D slice (a view), and v3's 2D index
    [row, col] becomes [row * row_length + col] (why slices and not reshape: see
    forward/v5_dynamic_shared.py). Under the simulator each slice is bounds-checked on its
    own.

    Launch: grid (Tc, B * Hkv), one block per K/V tile and K/V head, block (TY * TX,),
    plus END * itemsize bytes of dynamic shared memory (END from
    ``dkdv_v4_shared_layout``; ``dkdv_v4_shared_bytes``):

        kernel[grid, block, 0, nbytes](Q, K, V, dO, L, D, dK, dV, softmax_scale, causal_offset,
                                       window_lo, Hq, group, softcap, slopes, attn_mask, tiles,
                                       seed_lo, seed_hi, keep_threshold, keep_scale)

    Above 48 KB the compiled kernel must first be allowed that much (kernels/smem.py;
    numbaflash/launcher.py does it). Measured: the module docstring (v4).

    Variants (``variant``, kernels/variants.py), as backward v1's dK/dV kernel: with GQA
    the block walks the Q tiles of each query head of its group in turn (g_idx = 0 ..
    group - 1), adding into the same registers, so dK and dV are summed over the group
    in a fixed order, without atomics. A window's left bound narrows the Q tile range
    (bands.py), a tile the table of visible tiles marks empty is skipped whole, and with
    a window, masks or a score modifier (``PER_ELEMENT``) each entry goes through
    ``visible()`` and ``score()`` (P = exp(s - L) with the modified score s, dS times its
    derivative g); where a tile is not wholly visible, a masked entry's P is stored as
    HIDDEN (-1, a value no exp gives), so that dKj and dVj skip it without reading its
    rows of Q and dO. Dropout (``DROPOUT``): z = keep_scale where the forward kept the
    entry (``kept``, asked again), 0 where it dropped it; Pij holds p z (what dVj sums) and
    dS = p (dP z - D) (times g), so a dropped entry is 0 in Pij, not HIDDEN: it is
    visible and its row of Q still enters dKj. Plain attention compiles all of that away.
    """
    acc = acc_type(acc_dtype)
    ZERO = acc(0)
    NEG_INF = acc(-math.inf)
    LOG2E_ACC = acc(LOG2E)
    grid = v3_thread_grid(Br, Bc, TM, TN, d)
    TY, TX, DP, DN = grid.TY, grid.TX, grid.DPY, grid.DNY
    THREADS = TY * TX
    BrP = Br + 1                        # padded row lengths of QiT, dOiT (BrP) and of
    BcP = Bc + 1                        # KjT, VjT, Pij, dSij (BcP), as in v3
    # The arrays' offsets in the dynamic shared array (elements), and v3's 2D indices:
    #   KjT, VjT  (DP, BcP)  KjT[k, c] -> KjT[k * BcP + c]
    #   QiT, dOiT (DP, BrP)  QiT[k, r] -> QiT[k * BrP + r]
    #   Pij, dSij (Br, BcP)  Pij[r, c] -> Pij[r * BcP + c]
    #   L_i, D_i  (Br,)      unchanged
    K_AT, V_AT, Q_AT, dO_AT, P_AT, dS_AT, L_AT, D_AT, END = dkdv_v4_shared_layout(
        Br, Bc, TM, TN, d)
    # The variant (compile-time): which steps exist. A plain kernel compiles all of them away.
    # variants.py's visible() is named "sees" here: the plain path keeps its local "visible".
    sees, score = make_variant_functions(variant, causal, acc_dtype)
    WINDOW = variant.window
    SCORES = (variant.softcap or variant.alibi or variant.mask == "bias"
              or variant.score_mod is not None)
    MASKS = variant.mask == "bool" or variant.mask_mod is not None
    TILE_TABLE = variant.tile_table
    PER_ELEMENT = WINDOW or SCORES or MASKS     # entries need visible() and score()
    DROPOUT = variant.dropout           # entries need kept() (variants.make_dropout)
    kept = make_dropout(variant).kept
    HIDDEN = acc(-1)                    # P of a masked entry where the tile is tested
    q_tile_range = make_q_tile_range(Br, Bc, causal, WINDOW)

    VARLEN = variant.varlen
    sequences = make_sequences(VARLEN)
    locate, cut = sequences.locate, sequences.cut

    @cuda.jit(**jit_options())
    def backward_dkdv_v4(Q, K, V, dO, L, D, dK, dV, softmax_scale, causal_offset, window_lo,
                         Hq, group, softcap, slopes, attn_mask, tiles, seed_lo, seed_hi,
                         keep_threshold, keep_scale, seqs):
        bh_kv = cuda.blockIdx.y         # batch * Hkv + h_kv: the K/V head
        batch = bh_kv // (Hq // group)
        h_kv = bh_kv % (Hq // group)
        j = cuda.blockIdx.x             # K/V tile index (Alg.2 l.5: one block per j)
        # A packed batch: this block's sequence, as a batch of one (kernels/sequences.py)
        q0, k0, Sq, Sk, shift = locate(seqs, batch, Q.shape[1], K.shape[1])
        b_mem = batch                   # the batch index of the arrays' memory
        if VARLEN:
            if j * Bc >= Sk:
                return                  # past this sequence: the whole block, no barrier yet
            bh_kv, b_mem = h_kv, 0
        Q, dO, L, D = cut(Q, q0, Sq), cut(dO, q0, Sq), cut(L, q0, Sq), cut(D, q0, Sq)
        K, V, dK, dV = cut(K, k0, Sk), cut(V, k0, Sk), cut(dK, k0, Sk), cut(dV, k0, Sk)
        causal_offset += shift
        window_lo += shift
        tid = cuda.threadIdx.x
        ty = tid // TX
        tx = tid % TX
        # P = exp(S * scale - L) = exp2(S * scale * log2(e) - L * log2(e)): one FMA and an
        # exp2 per entry (L_i below is staged already multiplied by log2(e)).
        scale_log2 = softmax_scale * LOG2E_ACC

        # The block's dynamic shared memory (END elements, sized by the launch), cut into
        # v3's eight arrays: slices are views, so KjT[x] is smem[K_AT + x].
        smem = cuda.shared.array(0, acc)
        KjT = smem[K_AT:V_AT]
        VjT = smem[V_AT:Q_AT]
        QiT = smem[Q_AT:dO_AT]
        dOiT = smem[dO_AT:P_AT]
        Pij = smem[P_AT:dS_AT]
        dSij = smem[dS_AT:L_AT]
        L_i = smem[L_AT:D_AT]
        D_i = smem[D_AT:END]
        s = cuda.local.array((TM, TN), acc)     # this thread's block of Sij, then Pij
        dp = cuda.local.array((TM, TN), acc)    # ... of dPij, then dSij
        qa = cuda.local.array(TM, acc)          # one k step: TM values of Qi, of dOi ...
        da = cuda.local.array(TM, acc)
        kb = cuda.local.array(TN, acc)          # ... and TN of Kj, of Vj
        vb = cuda.local.array(TN, acc)
        pb = cuda.local.array(TN, acc)          # one query row: TN values of Pij, of dSij ...
        sb = cuda.local.array(TN, acc)
        qe = cuda.local.array(DN, acc)          # ... and DN of Qi, of dOi
        oe = cuda.local.array(DN, acc)
        dk = cuda.local.array((TN, DN), acc)    # this thread's block of dKj, dVj
        dv = cuda.local.array((TN, DN), acc)
        dk_t = cuda.local.array((TN, DN), acc)  # one Q tile's part of them (as in v1)
        dv_t = cuda.local.array((TN, DN), acc)

        # From here on, v3 line for line (with the flat indices above), plus the variant
        # steps behind compile-time flags.
        # Alg.2 l.6: stage Kj, Vj transposed (zeros past Sk and past d).
        idx = tid
        while idx < Bc * DP:
            c = idx // DP
            k = idx % DP
            col = j * Bc + c
            inside = col < Sk and k < d
            KjT[U(k * BcP + c)] = acc(K[U(bh_kv), U(col), U(k)]) if inside else ZERO
            VjT[U(k * BcP + c)] = acc(V[U(bh_kv), U(col), U(k)]) if inside else ZERO
            idx += THREADS
        for b in range(TN):             # Alg.2 l.7: dKj = 0, dVj = 0
            for e in range(DN):
                dk[b, e] = ZERO
                dv[b, e] = ZERO

        # Alg.2 l.8: loop over Q tiles; causal blocks start at the first one with a row
        # that sees column j*Bc, windowed blocks stop after the last (bands.py,
        # tiled.first_q_tile).
        i_start, i_end = q_tile_range(j, Sq, causal_offset, window_lo)
        last_col = j * Bc + Bc - 1      # the block's last key
        # GQA: the query heads of this K/V head's group, one after another (group = 1
        # without GQA): a fixed order, so the sums are bitwise reproducible.
        for g_idx in range(group):
            h = h_kv * group + g_idx    # the query head
            bh = U(b_mem * Hq + h)      # unsigned: an index that needs no wraparound test
            for i in range(i_start, i_end):
                if TILE_TABLE and not tiles[bh, i, j]:
                    continue            # the mask leaves this tile empty (variants.py);
                                        # the same for every thread: barriers stay matched
                # Does every row of the tile see every key of the block? Then dKj and dVj
                # need no test (below). A data mask can hide any entry: always tested.
                interior = not causal or last_col <= i * Br + causal_offset
                if WINDOW:
                    interior = interior and j * Bc >= i * Br + Br - 1 + window_lo
                if MASKS:
                    interior = False
                # Wait until every thread is done with the previous tile's QiT, dOiT, Pij,
                # dSij, L_i, D_i (for the first tile: until KjT and VjT are complete).
                cuda.syncthreads()
                # Alg.2 l.9: load Qi, dOi (transposed), L_i, D_i. A row past Sq or with
                # L = -inf is zeros, and its L_i is -inf, so it is skipped below.
                idx = tid
                while idx < Br * DP:
                    r = idx // DP
                    k = idx % DP
                    row = i * Br + r
                    keep = row < Sq and k < d
                    if keep:
                        keep = L[bh, row] != NEG_INF
                    QiT[U(k * BrP + r)] = acc(Q[U(bh), U(row), U(k)]) if keep else ZERO
                    dOiT[U(k * BrP + r)] = acc(dO[U(bh), U(row), U(k)]) if keep else ZERO
                    idx += THREADS
                for r in range(tid, Br, THREADS):
                    row = i * Br + r
                    L_i[U(r)] = L[bh, row] * LOG2E_ACC if row < Sq else NEG_INF
                    D_i[U(r)] = D[bh, row] if row < Sq else ZERO
                # Wait until QiT, dOiT, L_i, D_i are complete.
                cuda.syncthreads()

                # Alg.2 l.10 and l.13: Sij = Qi Kj^T and dPij = dOi Vj^T, TM x TN each per
                # thread; per k step 2 (TM + TN) loads for 2 TM TN FMAs.
                for a in range(TM):
                    for b in range(TN):
                        s[a, b] = ZERO
                        dp[a, b] = ZERO
                k = 0
                while k < d:         # a while loop, not range(): see kernels/__init__.py
                    for a in range(TM):
                        qa[a] = QiT[U(k * BrP + ty + TY * a)]
                        da[a] = dOiT[U(k * BrP + ty + TY * a)]
                    for b in range(TN):
                        kb[b] = KjT[U(k * BcP + tx + TX * b)]
                        vb[b] = VjT[U(k * BcP + tx + TX * b)]
                    for a in range(TM):
                        for b in range(TN):
                            s[a, b] += qa[a] * kb[b]
                            dp[a, b] += da[a] * vb[b]
                    k += 1
                # Alg.2 l.11 and l.14: Pij = exp(Sij - L_i), dSij = Pij * (dPij - D_i); masked
                # pairs get exactly 0 without an exp (and without reading their S or dP).
                # With a variant: visible() and score(), P from the modified score, dS
                # times its derivative g (variants.py); with dropout Pij holds p z and dS
                # takes dP z (z = keep_scale or 0: the forward's keep mask).
                for a in range(TM):
                    r = ty + TY * a
                    row = i * Br + r
                    L_r = L_i[U(r)]
                    D_r = D_i[U(r)]
                    for b in range(TN):
                        c = tx + TX * b
                        col = j * Bc + c
                        p = ZERO
                        ds = ZERO
                        if PER_ELEMENT:
                            # L = -inf also for rows past Sq: visible() is not asked there
                            seen = L_r != NEG_INF and sees(batch, h, row, col, Sk,
                                                           causal_offset, window_lo,
                                                           attn_mask)
                            if seen:
                                x, g = score(s[a, b] * softmax_scale, batch, h, row, col, Sq,
                                             Sk, softcap, slopes, attn_mask)
                                p = math.exp2(x * LOG2E_ACC - L_r)
                                if DROPOUT:
                                    z = keep_scale if kept(seed_lo, seed_hi, keep_threshold,
                                                           batch, h, row, col) else ZERO
                                    ds = p * g * (dp[a, b] * z - D_r)
                                    p = p * z
                                else:
                                    ds = p * g * (dp[a, b] - D_r)
                            elif not interior:
                                p = HIDDEN      # masked: never reads Q or dO (below)
                        else:
                            visible = (L_r != NEG_INF and col < Sk
                                       and (not causal or col <= row + causal_offset))
                            if visible:
                                p = math.exp2(s[a, b] * scale_log2 - L_r)
                                if DROPOUT:
                                    z = keep_scale if kept(seed_lo, seed_hi, keep_threshold,
                                                           batch, h, row, col) else ZERO
                                    ds = p * (dp[a, b] * z - D_r)
                                    p = p * z
                                else:
                                    ds = p * (dp[a, b] - D_r)
                        Pij[U(r * BcP + c)] = p
                        dSij[U(r * BcP + c)] = ds
                # Wait until Pij and dSij are complete.
                cuda.syncthreads()

                # Alg.2 l.12 and l.16: dVj += Pij^T dOi, dKj += dSij^T Qi, this Q tile's part
                # summed on its own; per row 2 (TN + DN) loads for 2 TN DN FMAs.
                for b in range(TN):
                    for e in range(DN):
                        dk_t[b, e] = ZERO
                        dv_t[b, e] = ZERO
                if interior:
                    # every row of the tile sees every key of the block: no test
                    r = 0
                    while r < Br:         # a while loop, not range(): see kernels/__init__.py
                        for b in range(TN):
                            pb[b] = Pij[U(r * BcP + tx + TX * b)]
                            sb[b] = dSij[U(r * BcP + tx + TX * b)]
                        for e in range(DN):
                            oe[e] = dOiT[U((ty + TY * e) * BrP + r)]
                            qe[e] = QiT[U((ty + TY * e) * BrP + r)]
                        for b in range(TN):
                            for e in range(DN):
                                dv_t[b, e] += pb[b] * oe[e]
                                dk_t[b, e] += sb[b] * qe[e]
                        r += 1
                elif PER_ELEMENT:
                    # a tile with masked pairs: they hold HIDDEN in Pij and never read q or
                    # dO, so a NaN in the row of a query that does not see the key has no
                    # effect; '< 0' is False for a NaN P, which propagates
                    r = 0
                    while r < Br:         # a while loop, not range(): see kernels/__init__.py
                        for b in range(TN):
                            pb[b] = Pij[U(r * BcP + tx + TX * b)]
                            sb[b] = dSij[U(r * BcP + tx + TX * b)]
                        for e in range(DN):
                            oe[e] = dOiT[U((ty + TY * e) * BrP + r)]
                            qe[e] = QiT[U((ty + TY * e) * BrP + r)]
                        for b in range(TN):
                            if not pb[b] < ZERO:
                                for e in range(DN):
                                    dv_t[b, e] += pb[b] * oe[e]
                                    dk_t[b, e] += sb[b] * qe[e]
                        r += 1
                else:
                    # the causal diagonal: hidden (row, key) pairs never read q or dO, so a
                    # NaN in the row of a query that does not see the key has no effect
                    r = 0
                    while r < Br:         # a while loop, not range(): see kernels/__init__.py
                        row = i * Br + r
                        for b in range(TN):
                            pb[b] = Pij[U(r * BcP + tx + TX * b)]
                            sb[b] = dSij[U(r * BcP + tx + TX * b)]
                        for e in range(DN):
                            oe[e] = dOiT[U((ty + TY * e) * BrP + r)]
                            qe[e] = QiT[U((ty + TY * e) * BrP + r)]
                        for b in range(TN):
                            if j * Bc + tx + TX * b <= row + causal_offset:
                                for e in range(DN):
                                    dv_t[b, e] += pb[b] * oe[e]
                                    dk_t[b, e] += sb[b] * qe[e]
                        r += 1
                for b in range(TN):
                    for e in range(DN):
                        dk[b, e] += dk_t[b, e]
                        dv[b, e] += dv_t[b, e]

        # Alg.2 l.18: write dKj (times the scale: kernels/backward/__init__.py) and dVj.
        for b in range(TN):
            col = j * Bc + tx + TX * b
            if col < Sk:
                for e in range(DN):
                    k = ty + TY * e
                    if k < d:
                        dK[bh_kv, col, k] = dk[b, e] * softmax_scale
                        dV[bh_kv, col, k] = dv[b, e]

    return backward_dkdv_v4


@functools.lru_cache(maxsize=None)
def make_backward_dq_v4(Br, Bc, TM, TN, d, causal, acc_dtype, variant=PLAIN):
    """v4 dQ kernel: ``make_backward_dq_v3``'s kernel with its shared memory taken from
    dynamic shared memory, as ``make_backward_dkdv_v4`` is v3's dK/dV kernel's.

    v3's five shared arrays (QiT, dOiT, KjT, VjT, dSij) are slices of one dynamic array at
    the offsets of ``dq_v4_shared_layout``, with flat indices; for plain attention
    everything else is v3's line for line (see make_backward_dq_v3). Launch: as v3,
    grid (Tr, B * Hq), block (TY * TX,), plus END * itemsize bytes of dynamic shared
    memory (``dq_v4_shared_bytes``), allowed first above 48 KB (kernels/smem.py); its
    arguments are the dK/dV kernel's with dQ in place of dK, dV.

    Variants (``variant``), as backward v1's dQ kernel: query head h reads K/V head
    b * (Hq // group) + h // group; a window narrows the K/V tile range, the table of
    visible tiles skips empty tiles, and with a window, masks or a score modifier
    (``PER_ELEMENT``) each entry goes through ``visible()`` and ``score()`` (dS times g).
    dSij has no value to spare for a marker (any dS is possible), so where a tile is not
    wholly visible dQi += dSij Kj asks ``visible()`` again per (row, key): a masked key
    is never read for that row. Dropout: dS = p (dP z - D) (times g), z = keep_scale where
    the forward kept the entry, 0 where it dropped it (as in the dK/dV kernel).
    """
    acc = acc_type(acc_dtype)
    ZERO = acc(0)
    NEG_INF = acc(-math.inf)
    LOG2E_ACC = acc(LOG2E)
    grid = v3_thread_grid(Br, Bc, TM, TN, d)
    TY, TX, DP, DN = grid.TY, grid.TX, grid.DPX, grid.DNX
    THREADS = TY * TX
    BrP = Br + 1
    BcP = Bc + 1
    # Offsets (elements) and v3's 2D indices: QiT, dOiT (DP, BrP): [k, r] -> [k * BrP + r];
    # KjT, VjT (DP, BcP): [k, c] -> [k * BcP + c]; dSij (Br, BcP): [r, c] -> [r * BcP + c].
    Q_AT, dO_AT, K_AT, V_AT, dS_AT, END = dq_v4_shared_layout(Br, Bc, TM, TN, d)
    # The variant (compile-time), as in the dK/dV kernel ("sees" is variants.py's visible()).
    sees, score = make_variant_functions(variant, causal, acc_dtype)
    WINDOW = variant.window
    SCORES = (variant.softcap or variant.alibi or variant.mask == "bias"
              or variant.score_mod is not None)
    MASKS = variant.mask == "bool" or variant.mask_mod is not None
    TILE_TABLE = variant.tile_table
    PER_ELEMENT = WINDOW or SCORES or MASKS     # entries need visible() and score()
    DROPOUT = variant.dropout           # entries need kept() (variants.make_dropout)
    kept = make_dropout(variant).kept
    kv_tile_range = make_kv_tile_range(Br, Bc, causal, WINDOW)

    VARLEN = variant.varlen
    sequences = make_sequences(VARLEN)
    locate, cut = sequences.locate, sequences.cut

    @cuda.jit(**jit_options())
    def backward_dq_v4(Q, K, V, dO, L, D, dQ, softmax_scale, causal_offset, window_lo, Hq,
                       group, softcap, slopes, attn_mask, tiles, seed_lo, seed_hi,
                       keep_threshold, keep_scale, seqs):
        bh = cuda.blockIdx.y            # batch * Hq + h: the query head
        batch = bh // Hq
        h = bh % Hq
        bh_kv = batch * (Hq // group) + h // group  # GQA: the K/V head this query head reads
        i = cuda.blockIdx.x             # Q tile index: one block per i
        # A packed batch: this block's sequence, as a batch of one (kernels/sequences.py)
        q0, k0, Sq, Sk, shift = locate(seqs, batch, Q.shape[1], K.shape[1])
        if VARLEN:
            if i * Br >= Sq:
                return                  # past this sequence: the whole block, no barrier yet
            bh, bh_kv = h, h // group
        Q, dO, L, D, dQ = (cut(Q, q0, Sq), cut(dO, q0, Sq), cut(L, q0, Sq), cut(D, q0, Sq),
                           cut(dQ, q0, Sq))
        K, V = cut(K, k0, Sk), cut(V, k0, Sk)
        causal_offset += shift
        window_lo += shift
        tid = cuda.threadIdx.x
        ty = tid // TX
        tx = tid % TX
        scale_log2 = softmax_scale * LOG2E_ACC      # exp2, as in the dK/dV kernel

        # The block's dynamic shared memory, cut into v3's five arrays (views).
        smem = cuda.shared.array(0, acc)
        QiT = smem[Q_AT:dO_AT]
        dOiT = smem[dO_AT:K_AT]
        KjT = smem[K_AT:V_AT]
        VjT = smem[V_AT:dS_AT]
        dSij = smem[dS_AT:END]
        s = cuda.local.array((TM, TN), acc)     # this thread's block of Sij
        dp = cuda.local.array((TM, TN), acc)    # ... of dPij
        qa = cuda.local.array(TM, acc)          # one k step: TM values of Qi, of dOi ...
        da = cuda.local.array(TM, acc)
        kb = cuda.local.array(TN, acc)          # ... and TN of Kj, of Vj
        vb = cuda.local.array(TN, acc)
        sa = cuda.local.array(TM, acc)          # one key: TM values of dSij ...
        ke = cuda.local.array(DN, acc)          # ... and DN of Kj
        L_a = cuda.local.array(TM, acc)         # L * log2(e) and D of this thread's rows
        D_a = cuda.local.array(TM, acc)
        dq = cuda.local.array((TM, DN), acc)    # this thread's block of dQi
        dq_t = cuda.local.array((TM, DN), acc)  # one K/V tile's part of it (as in v1)

        # From here on, v3 line for line (with the flat indices above), plus the variant
        # steps behind compile-time flags.
        # Alg.2 l.9: stage Qi and dOi transposed (zeros past Sq and past d); L and D of
        # this thread's rows into registers; dQi = 0.
        idx = tid
        while idx < Br * DP:
            r = idx // DP
            k = idx % DP
            row = i * Br + r
            inside = row < Sq and k < d
            QiT[U(k * BrP + r)] = acc(Q[U(bh), U(row), U(k)]) if inside else ZERO
            dOiT[U(k * BrP + r)] = acc(dO[U(bh), U(row), U(k)]) if inside else ZERO
            idx += THREADS
        for a in range(TM):
            row = i * Br + ty + TY * a
            L_a[a] = L[bh, row] * LOG2E_ACC if row < Sq else NEG_INF
            D_a[a] = D[bh, row] if row < Sq else ZERO
            for e in range(DN):
                dq[a, e] = ZERO

        # Loop over K/V tiles; causal blocks stop after the last tile that any of their
        # rows can see, windowed blocks start at the first (as in v1; bands.py,
        # tiled.tiles_needed).
        j_start, j_end = kv_tile_range(i, Sk, causal_offset, window_lo)
        first_limit = i * Br + causal_offset        # the last key the block's first row sees
        last_from = i * Br + Br - 1 + window_lo     # the first key the block's last row sees
        for j in range(j_start, j_end):
            if TILE_TABLE and not tiles[bh, i, j]:
                continue                # the mask leaves this tile empty (variants.py);
                                        # the same for every thread: barriers stay matched
            # Does every row of the block see every key of the tile? Then dQi += dSij Kj
            # needs no test (below). A data mask can hide any entry: always tested.
            interior = not causal or j * Bc + Bc - 1 <= first_limit
            if WINDOW:
                interior = interior and j * Bc >= last_from
            if MASKS:
                interior = False
            # Wait until every thread is done with the previous KjT, VjT, dSij (for the
            # first tile: until QiT and dOiT are complete).
            cuda.syncthreads()
            # Alg.2 l.6: load Kj, Vj transposed; zeros past Sk and past d.
            idx = tid
            while idx < Bc * DP:
                c = idx // DP
                k = idx % DP
                col = j * Bc + c
                inside = col < Sk and k < d
                KjT[U(k * BcP + c)] = acc(K[U(bh_kv), U(col), U(k)]) if inside else ZERO
                VjT[U(k * BcP + c)] = acc(V[U(bh_kv), U(col), U(k)]) if inside else ZERO
                idx += THREADS
            # Wait until KjT and VjT are complete.
            cuda.syncthreads()

            # Alg.2 l.10 and l.13: Sij and dPij, TM x TN per thread.
            for a in range(TM):
                for b in range(TN):
                    s[a, b] = ZERO
                    dp[a, b] = ZERO
            k = 0
            while k < d:             # a while loop, not range(): see kernels/__init__.py
                for a in range(TM):
                    qa[a] = QiT[U(k * BrP + ty + TY * a)]
                    da[a] = dOiT[U(k * BrP + ty + TY * a)]
                for b in range(TN):
                    kb[b] = KjT[U(k * BcP + tx + TX * b)]
                    vb[b] = VjT[U(k * BcP + tx + TX * b)]
                for a in range(TM):
                    for b in range(TN):
                        s[a, b] += qa[a] * kb[b]
                        dp[a, b] += da[a] * vb[b]
                k += 1
            # Alg.2 l.11 and l.14: Pij and dSij; masked pairs and rows that see no key
            # (L = -inf) get dS = 0 without an exp. With a variant: visible() and score(),
            # P from the modified score, dS times its derivative g (variants.py); with
            # dropout dP times z (keep_scale where kept, 0 where dropped).
            for a in range(TM):
                r = ty + TY * a
                row = i * Br + r
                for b in range(TN):
                    c = tx + TX * b
                    col = j * Bc + c
                    ds = ZERO
                    if PER_ELEMENT:
                        # L = -inf also for rows past Sq: visible() is not asked there
                        if L_a[a] != NEG_INF and sees(batch, h, row, col, Sk,
                                                      causal_offset, window_lo, attn_mask):
                            x, g = score(s[a, b] * softmax_scale, batch, h, row, col, Sq, Sk,
                                         softcap, slopes, attn_mask)
                            p = math.exp2(x * LOG2E_ACC - L_a[a])
                            if DROPOUT:
                                z = keep_scale if kept(seed_lo, seed_hi, keep_threshold, batch,
                                                       h, row, col) else ZERO
                                ds = p * g * (dp[a, b] * z - D_a[a])
                            else:
                                ds = p * g * (dp[a, b] - D_a[a])
                    else:
                        visible = (L_a[a] != NEG_INF and col < Sk
                                   and (not causal or col <= row + causal_offset))
                        if visible:
                            p = math.exp2(s[a, b] * scale_log2 - L_a[a])
                            if DROPOUT:
                                z = keep_scale if kept(seed_lo, seed_hi, keep_threshold, batch,
                                                       h, row, col) else ZERO
                                ds = p * (dp[a, b] * z - D_a[a])
                            else:
                                ds = p * (dp[a, b] - D_a[a])
                    dSij[U(r * BcP + c)] = ds
            # Wait until dSij is complete.
            cuda.syncthreads()

            # Alg.2 l.15: dQi += dSij Kj, this K/V tile's part summed on its own; per key
            # TM + DN loads for TM DN FMAs.
            for a in range(TM):
                for e in range(DN):
                    dq_t[a, e] = ZERO
            if interior:
                # every row of the block sees every key of the tile: no test
                c = 0
                while c < Bc:             # a while loop, not range(): see kernels/__init__.py
                    for a in range(TM):
                        sa[a] = dSij[U((ty + TY * a) * BcP + c)]
                    for e in range(DN):
                        ke[e] = KjT[U((tx + TX * e) * BcP + c)]
                    for a in range(TM):
                        for e in range(DN):
                            dq_t[a, e] += sa[a] * ke[e]
                    c += 1
            elif PER_ELEMENT:
                # a tile with masked pairs: a key hidden from a row (visible() again) is
                # never read for it, so a NaN in that key has no effect on the row
                c = 0
                while c < Bc:             # a while loop, not range(): see kernels/__init__.py
                    col = j * Bc + c
                    for a in range(TM):
                        sa[a] = dSij[U((ty + TY * a) * BcP + c)]
                    for e in range(DN):
                        ke[e] = KjT[U((tx + TX * e) * BcP + c)]
                    for a in range(TM):
                        row = i * Br + ty + TY * a
                        if L_a[a] != NEG_INF and sees(batch, h, row, col, Sk, causal_offset,
                                                      window_lo, attn_mask):
                            for e in range(DN):
                                dq_t[a, e] += sa[a] * ke[e]
                    c += 1
            else:
                # the causal diagonal: a key hidden from a row is never read for it, so
                # a NaN in that key has no effect on the row
                c = 0
                while c < Bc:             # a while loop, not range(): see kernels/__init__.py
                    col = j * Bc + c
                    for a in range(TM):
                        sa[a] = dSij[U((ty + TY * a) * BcP + c)]
                    for e in range(DN):
                        ke[e] = KjT[U((tx + TX * e) * BcP + c)]
                    for a in range(TM):
                        if col <= i * Br + ty + TY * a + causal_offset:
                            for e in range(DN):
                                dq_t[a, e] += sa[a] * ke[e]
                    c += 1
            for a in range(TM):
                for e in range(DN):
                    dq[a, e] += dq_t[a, e]

        # Write dQi (times the scale). A row that sees no key (L = -inf) writes exact zeros.
        for a in range(TM):
            row = i * Br + ty + TY * a
            if row < Sq:
                for e in range(DN):
                    k = tx + TX * e
                    if k < d:
                        dQ[bh, row, k] = ZERO if L_a[a] == NEG_INF else dq[a, e] * softmax_scale

    return backward_dq_v4


# --- the launch contract ------------------------------------------------------------

# v4 runs v3's two kernels with their shared arrays carved out of dynamic shared memory
# (make_backward_dkdv_v4 and make_backward_dq_v4), so the same bytes (dkdv_v4_shared_bytes
# equals dkdv_v3_shared_bytes, dq_v4 dq_v3) may exceed 48 KB. Tile rule: the first
# (Br, Bc, TM, TN) of BWD_V4_CANDIDATES whose two kernels fit in BWD_V4_SHARED_MEM_TARGET
# (100 KB: two blocks fit the 228 KB of an H200 SM; on a GPU that allows a block less, its
# own maximum, device_dynamic_shared_limit) and whose accumulators fit BWD_V3_MAX_ACC_REGS,
# as for v3 (if none does, the first that fits in shared memory). A caller's tiles may use
# up to DYNAMIC_SHARED_MEM_LIMIT (227 KB per block on the H100/H200; kernels/smem.py
# checks the device's own maximum again before the launch). GPU, float32: d <= 64 ->
# (64, 64, 4, 4), 256 threads, 100352 / 83200 bytes at d = 64; 64 < d <= 128 -> (32, 32,
# 2, 2), 256 threads, 76288 / 71808 bytes at d = 128 (v3: (16, 16, 2, 1), 128 threads;
# (64, 64, 4, 4) needs 167 KB and (32, 32, 4, 2) 128 dK/dV accumulators a thread);
# d = 256 -> (16, 16, 1, 1), 71936 / 69696 bytes, within the register bound (v3: (8, 8,
# 1, 1), over it). The tile sweep behind the rule (lab/sweeps/bwd_v4_sweep.py,
# lab/runs/2026-12-01/21_bwd_v4_sweep.txt, (2, 16, 4096, d), not causal / causal): d = 64,
# (64, 64, 4, 4) 30.71 / 17.26 ms, v3's tiles 38.03 / 20.85; d = 128, (32, 32, 2, 2)
# 84.28 / 45.87 ms, (64, 64, 4, 4) 81.29 / 42.44 at one block per SM, the others 94-124 /
# 55-67. Under the simulator, BWD_V4_SIM_TILES, as v3's.
BWD_V4_CANDIDATES = ((64, 64, 4, 4), (32, 32, 4, 2), (32, 32, 2, 2), (16, 16, 2, 1),
                     (16, 16, 1, 1), (8, 8, 1, 1), (4, 4, 1, 1))
BWD_V4_SHARED_MEM_TARGET = 100 * 1024
BWD_V4_SIM_TILES = BWD_V3_SIM_TILES


def dkdv_v4_shared_bytes(Br, Bc, TM, TN, d, acc_dtype):
    """Dynamic shared memory of backward_dkdv_v4: v3's eight arrays back to back
    (dkdv_v4_shared_layout), the same bytes as ``dkdv_v3_shared_bytes``."""
    END = dkdv_v4_shared_layout(Br, Bc, TM, TN, d)[-1]
    return END * np.dtype(acc_dtype).itemsize


def dq_v4_shared_bytes(Br, Bc, TM, TN, d, acc_dtype):
    """Dynamic shared memory of backward_dq_v4: v3's five arrays back to back
    (dq_v4_shared_layout), the same bytes as ``dq_v3_shared_bytes``."""
    END = dq_v4_shared_layout(Br, Bc, TM, TN, d)[-1]
    return END * np.dtype(acc_dtype).itemsize


def _bwd_v4_bytes(t, d, acc_dtype):
    """The larger of backward v4's two kernels' dynamic shared memory for tiles ``t``."""
    return max(dkdv_v4_shared_bytes(*t, d, acc_dtype), dq_v4_shared_bytes(*t, d, acc_dtype))


def default_backward_v4_tiles(d, acc_dtype, where):
    """The backward v4 tile rule (above), (Br, Bc, TM, TN), for ``where`` ("gpu" or
    "simulator"). GPU, float32: d <= 64 -> (64, 64, 4, 4), 256 threads; d = 128 -> (32,
    32, 2, 2), 256 threads; d = 256 -> (16, 16, 1, 1), 256 threads; float64: d = 64 ->
    (32, 32, 4, 2), d = 128 -> (16, 16, 2, 1) (v3: (16, 16, 2, 1) and (8, 8, 1, 1))."""
    if where == "simulator":
        return BWD_V4_SIM_TILES
    target = min(BWD_V4_SHARED_MEM_TARGET, device_dynamic_shared_limit(where))
    fits = [t for t in BWD_V4_CANDIDATES if _bwd_v4_bytes(t, d, acc_dtype) <= target]
    for t in fits:
        if max(backward_v3_acc_regs(*t, d)) <= BWD_V3_MAX_ACC_REGS:
            return t
    if fits:
        return fits[0]
    raise ValueError(f"backward v4 cannot run this input: no v4 tile fits head dim {d} in "
                     f"{acc_dtype} within {target} bytes of shared memory")


def check_backward_v4_tiles(tiles, d, acc_dtype):
    """A caller's backward v4 tiles (``check_thread_tiles``), both kernels against the
    dynamic limit."""
    return check_thread_tiles(tiles, d, acc_dtype, "backward v4",
                              lambda Br, Bc, TM, TN: _bwd_v4_bytes((Br, Bc, TM, TN), d,
                                                                   acc_dtype),
                              DYNAMIC_SHARED_MEM_LIMIT, DYNAMIC_LIMIT_WHY)


VARIANTS = True                # takes the variant arguments (kernels/variants.py)
TILE_TABLE = True              # skips the tiles a mask leaves empty (variants.make_tile_table);
                               # its two kernels share (Br, Bc), so one table serves both


def plan(p, where, tiles, reason, preprocess):
    """The Plans of backward v4 for Problem ``p``: v3's (``plan_register_blocked``), with
    each kernel's shared memory dynamic, and variants: the dK/dV kernel's grid is
    (Tc, B * Hkv)."""
    return plan_register_blocked(
        p, where, tiles, reason, preprocess, "v4", default_backward_v4_tiles,
        check_backward_v4_tiles, dkdv_v4_shared_bytes, dq_v4_shared_bytes,
        "v3's kernels with their shared memory taken from dynamic shared memory (may "
        "exceed 48 KB); measured on the H200: as fast as v3 to 1.4x faster "
        "(lab/runs/2026-12-01/26_timing_branch.txt)",
        dynamic_shared=True, variants=True)


def kernel(plan, p):
    """The compiled kernel of one of v4's plans (cached per compile-time parameters)."""
    make = {"backward_dkdv_v4": make_backward_dkdv_v4,
            "backward_dq_v4": make_backward_dq_v4}[plan.kernel]
    TM, TN = plan.thread_tile
    return make(plan.Br, plan.Bc, TM, TN, p.d, p.upper, p.acc_dtype, p.variant)
