"""Backward v3: v1's kernels register-blocked (SIMT), a TM x TN block per thread.

Parent: v1 (v1_two_kernels.py): the same D, dK/dV and dQ kernels in the same order of
work, with the work of a block spread the way forward v4 (forward/v4_register_blocked.py)
spreads it. v1 is bound by shared-memory loads (no loaded value serves a second key) and
by occupancy (blocks of 32 threads, 16 at d = 128, with spills). In v3 a TY x TX grid of
threads covers the (Br, Bc) tile pair, and thread (ty, tx) owns a TM x TN block of Sij,
Pij, dPij and dSij in registers, plus a block of the accumulators (make_backward_dkdv_v3,
make_backward_dq_v3 say which). Qi, dOi, Kj and Vj are staged transposed with padded
rows, so every read is conflict-free or a broadcast; Pij and dSij go through shared memory.

What it buys: with the float32 tiles at d = 64, (Br, Bc, TM, TN) = (32, 32, 4, 2),
0.75, 0.625 and 0.5 shared loads per FMA (Sij and dPij; dKj and dVj; dQi) instead of v1's
2 and 1, and no spills up to d = 128. Measured on the H200: 3.7x-4.0x v1 at d = 64,
7.0x-7.4x at d = 128 (lab/runs/2026-12-01/11_bwd_v3_sweep.txt, lab/sweeps/bwd_v3_sweep.py).
What it costs: three barriers per tile instead of two, and its shared arrays are static,
at most 48 KB a block, which now also holds Pij and dSij: tiles stay small, (32, 32) at
d = 64 and (16, 16) at d = 128 (v4 lifts that). S, P and dP are still computed in both
passes, as in v1.

The default for plain attention in float64 and at d > 128. Deterministic (one owner
thread per gradient element, summing in the same order for any (TM, TN)); GPU and
simulator.
"""

import functools
from collections import namedtuple
import math

import numpy as np
from numba import cuda

from .. import LOG2E, acc_type, jit_options
from ..bands import make_kv_tile_range, make_q_tile_range
from ..plan import (SHARED_MEM_LIMIT, TILE_TABLE_REASON, Plan, Plans, check_thread_tiles,
                    refuse_backward_variants, variant_description)
from ..smem import U


# What v3_thread_grid returns, by name.
V3ThreadGrid = namedtuple("V3ThreadGrid", "TY TX DPY DNY DPX DNX")



def v3_thread_grid(Br, Bc, TM, TN, d):
    """The shape constants of a v3 kernel, shared by its kernels and their shared memory (below).

    Returns (TY, TX, DPY, DNY, DPX, DNX): a TY x TX grid of threads (TY = Br // TM,
    TX = Bc // TN); the dK/dV kernel splits the head dim over the TY threads of a key
    column (d padded to DPY, DNY = DPY // TY columns each), the dQ kernel over the TX
    threads of a query row (d padded to DPX, DNX = DPX // TX columns each).
    """
    assert Br % TM == 0 and Bc % TN == 0, (Br, Bc, TM, TN)
    TY = Br // TM
    TX = Bc // TN
    DPY = (d + TY - 1) // TY * TY
    DPX = (d + TX - 1) // TX * TX
    return V3ThreadGrid(TY, TX, DPY, DPY // TY, DPX, DPX // TX)


@functools.lru_cache(maxsize=None)
def make_backward_dkdv_v3(Br, Bc, TM, TN, d, causal, acc_dtype):
    """v3 dK/dV kernel (Alg.2 l.5-19 without l.15), register-blocked.

    Launch: grid (Tc, BH) with Tc = ceil(Sk / Bc), block (TY * TX,) with TY = Br // TM and
    TX = Bc // TN; thread tid is (ty, tx) = (tid // TX, tid % TX).

    Per Q tile, thread (ty, tx) owns a TM x TN block of Sij, Pij, dPij and dSij: query rows
    r_a = ty + TY*a (a < TM) and keys c_b = tx + TX*b (b < TN). Across the whole loop it
    owns a TN x DNY block of dKj and of dVj: the same keys c_b and head-dim columns
    k_e = ty + TY*e (e < DNY; d is padded with zeros to DPY = DNY * TY, never written).

    Shared memory (accumulator dtype): KjT, VjT (DPY, Bc + 1), Kj and Vj transposed,
    staged once; QiT, dOiT (DPY, Br + 1), per Q tile; Pij, dSij (Br, Bc + 1), per Q tile;
    L_i (Br), the logsumexp times log2(e), and D_i (Br). The +1 pads make the transposing
    stores and the column reads QiT[k_e, r] (different ty, different k_e) hit different
    banks. ``dkdv_v3_shared_bytes`` counts them.

    Rows whose L is -inf (they see no key) and rows past Sq are staged as zeros, so that a
    NaN in their q or dO can never meet a zero P: the sums over rows below have no test
    except on the causal diagonal. Causal blocks skip the Q tiles whose rows see none of
    their keys, as v1's do, and test (row, key) pairs only on the tiles the diagonal cuts.
    """
    acc = acc_type(acc_dtype)
    ZERO = acc(0)
    NEG_INF = acc(-math.inf)
    LOG2E_ACC = acc(LOG2E)
    grid = v3_thread_grid(Br, Bc, TM, TN, d)
    TY, TX, DP, DN = grid.TY, grid.TX, grid.DPY, grid.DNY
    THREADS = TY * TX
    BrP = Br + 1                        # padded row lengths (shared array shapes must be
    BcP = Bc + 1                        # compile-time constants)
    q_tile_range = make_q_tile_range(Br, Bc, causal, False)

    @cuda.jit(**jit_options())
    def backward_dkdv_v3(Q, K, V, dO, L, D, dK, dV, softmax_scale, causal_offset):
        bh = cuda.blockIdx.y
        j = cuda.blockIdx.x             # K/V tile index (Alg.2 l.5: one block per j)
        tid = cuda.threadIdx.x
        ty = tid // TX
        tx = tid % TX
        Sq = Q.shape[1]
        Sk = K.shape[1]
        # P = exp(S * scale - L) = exp2(S * scale * log2(e) - L * log2(e)): one FMA and an
        # exp2 per entry (L_i below is staged already multiplied by log2(e)).
        scale_log2 = softmax_scale * LOG2E_ACC

        KjT = cuda.shared.array((DP, BcP), acc)
        VjT = cuda.shared.array((DP, BcP), acc)
        QiT = cuda.shared.array((DP, BrP), acc)
        dOiT = cuda.shared.array((DP, BrP), acc)
        Pij = cuda.shared.array((Br, BcP), acc)
        dSij = cuda.shared.array((Br, BcP), acc)
        L_i = cuda.shared.array(Br, acc)
        D_i = cuda.shared.array(Br, acc)
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

        # Alg.2 l.6: stage Kj, Vj transposed (zeros past Sk and past d).
        idx = tid
        while idx < Bc * DP:
            c = idx // DP
            k = idx % DP
            col = j * Bc + c
            inside = col < Sk and k < d
            KjT[U(k), U(c)] = acc(K[U(bh), U(col), U(k)]) if inside else ZERO
            VjT[U(k), U(c)] = acc(V[U(bh), U(col), U(k)]) if inside else ZERO
            idx += THREADS
        for b in range(TN):             # Alg.2 l.7: dKj = 0, dVj = 0
            for e in range(DN):
                dk[b, e] = ZERO
                dv[b, e] = ZERO

        # Alg.2 l.8: loop over Q tiles; causal blocks start at the first one with a row
        # that sees column j*Bc (bands.py, tiled.first_q_tile).
        i_start, i_end = q_tile_range(j, Sq, causal_offset, 0)
        last_col = j * Bc + Bc - 1      # the block's last key
        for i in range(i_start, i_end):
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
                QiT[U(k), U(r)] = acc(Q[U(bh), U(row), U(k)]) if keep else ZERO
                dOiT[U(k), U(r)] = acc(dO[U(bh), U(row), U(k)]) if keep else ZERO
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
            while k < d:             # a while loop, not range(): see kernels/__init__.py
                for a in range(TM):
                    qa[a] = QiT[U(k), U(ty + TY * a)]
                    da[a] = dOiT[U(k), U(ty + TY * a)]
                for b in range(TN):
                    kb[b] = KjT[U(k), U(tx + TX * b)]
                    vb[b] = VjT[U(k), U(tx + TX * b)]
                for a in range(TM):
                    for b in range(TN):
                        s[a, b] += qa[a] * kb[b]
                        dp[a, b] += da[a] * vb[b]
                k += 1
            # Alg.2 l.11 and l.14: Pij = exp(Sij - L_i), dSij = Pij * (dPij - D_i); masked
            # pairs get exactly 0 without an exp (and without reading their S or dP).
            for a in range(TM):
                r = ty + TY * a
                row = i * Br + r
                L_r = L_i[U(r)]
                D_r = D_i[U(r)]
                for b in range(TN):
                    c = tx + TX * b
                    col = j * Bc + c
                    visible = (L_r != NEG_INF and col < Sk
                               and (not causal or col <= row + causal_offset))
                    p = ZERO
                    ds = ZERO
                    if visible:
                        p = math.exp2(s[a, b] * scale_log2 - L_r)
                        ds = p * (dp[a, b] - D_r)
                    Pij[U(r), U(c)] = p
                    dSij[U(r), U(c)] = ds
            # Wait until Pij and dSij are complete.
            cuda.syncthreads()

            # Alg.2 l.12 and l.16: dVj += Pij^T dOi, dKj += dSij^T Qi, this Q tile's part
            # summed on its own; per row 2 (TN + DN) loads for 2 TN DN FMAs.
            for b in range(TN):
                for e in range(DN):
                    dk_t[b, e] = ZERO
                    dv_t[b, e] = ZERO
            if not causal or last_col <= i * Br + causal_offset:
                # every row of the tile sees every key of the block: no test
                r = 0
                while r < Br:             # a while loop, not range(): see kernels/__init__.py
                    for b in range(TN):
                        pb[b] = Pij[U(r), U(tx + TX * b)]
                        sb[b] = dSij[U(r), U(tx + TX * b)]
                    for e in range(DN):
                        oe[e] = dOiT[U(ty + TY * e), U(r)]
                        qe[e] = QiT[U(ty + TY * e), U(r)]
                    for b in range(TN):
                        for e in range(DN):
                            dv_t[b, e] += pb[b] * oe[e]
                            dk_t[b, e] += sb[b] * qe[e]
                    r += 1
            else:
                # the causal diagonal: hidden (row, key) pairs never read q or dO, so a
                # NaN in the row of a query that does not see the key has no effect
                r = 0
                while r < Br:             # a while loop, not range(): see kernels/__init__.py
                    row = i * Br + r
                    for b in range(TN):
                        pb[b] = Pij[U(r), U(tx + TX * b)]
                        sb[b] = dSij[U(r), U(tx + TX * b)]
                    for e in range(DN):
                        oe[e] = dOiT[U(ty + TY * e), U(r)]
                        qe[e] = QiT[U(ty + TY * e), U(r)]
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
                        dK[bh, col, k] = dk[b, e] * softmax_scale
                        dV[bh, col, k] = dv[b, e]

    return backward_dkdv_v3


@functools.lru_cache(maxsize=None)
def make_backward_dq_v3(Br, Bc, TM, TN, d, causal, acc_dtype):
    """v3 dQ kernel (Alg.2 l.15 as its own pass), register-blocked.

    Launch: grid (Tr, BH) with Tr = ceil(Sq / Br), block (TY * TX,) as
    ``make_backward_dkdv_v3``, and the same TM x TN blocks of Sij, dPij, dSij per thread.
    Thread (ty, tx) owns a TM x DNX block of dQi: rows r_a = ty + TY*a and head-dim
    columns k_e = tx + TX*e (e < DNX; d padded with zeros to DPX = DNX * TX).

    Shared memory (accumulator dtype): QiT, dOiT (DPX, Br + 1), staged once; KjT, VjT
    (DPX, Bc + 1), per K/V tile; dSij (Br, Bc + 1). The column reads KjT[k_e, c]
    (different tx, different k_e) and dSij[r_a, c] (different ty) hit different banks
    thanks to the pads. ``dq_v3_shared_bytes`` counts them.
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
    kv_tile_range = make_kv_tile_range(Br, Bc, causal, False)

    @cuda.jit(**jit_options())
    def backward_dq_v3(Q, K, V, dO, L, D, dQ, softmax_scale, causal_offset):
        bh = cuda.blockIdx.y
        i = cuda.blockIdx.x             # Q tile index: one block per i
        tid = cuda.threadIdx.x
        ty = tid // TX
        tx = tid % TX
        Sq = Q.shape[1]
        Sk = K.shape[1]
        scale_log2 = softmax_scale * LOG2E_ACC      # exp2, as in the dK/dV kernel

        QiT = cuda.shared.array((DP, BrP), acc)
        dOiT = cuda.shared.array((DP, BrP), acc)
        KjT = cuda.shared.array((DP, BcP), acc)
        VjT = cuda.shared.array((DP, BcP), acc)
        dSij = cuda.shared.array((Br, BcP), acc)
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

        # Alg.2 l.9: stage Qi and dOi transposed (zeros past Sq and past d); L and D of
        # this thread's rows into registers; dQi = 0.
        idx = tid
        while idx < Br * DP:
            r = idx // DP
            k = idx % DP
            row = i * Br + r
            inside = row < Sq and k < d
            QiT[U(k), U(r)] = acc(Q[U(bh), U(row), U(k)]) if inside else ZERO
            dOiT[U(k), U(r)] = acc(dO[U(bh), U(row), U(k)]) if inside else ZERO
            idx += THREADS
        for a in range(TM):
            row = i * Br + ty + TY * a
            L_a[a] = L[bh, row] * LOG2E_ACC if row < Sq else NEG_INF
            D_a[a] = D[bh, row] if row < Sq else ZERO
            for e in range(DN):
                dq[a, e] = ZERO

        # Loop over K/V tiles; causal blocks stop after the last tile that any of their
        # rows can see (as in v1; bands.py, tiled.tiles_needed).
        _, Tc = kv_tile_range(i, Sk, causal_offset, 0)
        first_limit = i * Br + causal_offset        # the last key the block's first row sees
        for j in range(Tc):
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
                KjT[U(k), U(c)] = acc(K[U(bh), U(col), U(k)]) if inside else ZERO
                VjT[U(k), U(c)] = acc(V[U(bh), U(col), U(k)]) if inside else ZERO
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
                    qa[a] = QiT[U(k), U(ty + TY * a)]
                    da[a] = dOiT[U(k), U(ty + TY * a)]
                for b in range(TN):
                    kb[b] = KjT[U(k), U(tx + TX * b)]
                    vb[b] = VjT[U(k), U(tx + TX * b)]
                for a in range(TM):
                    for b in range(TN):
                        s[a, b] += qa[a] * kb[b]
                        dp[a, b] += da[a] * vb[b]
                k += 1
            # Alg.2 l.11 and l.14: Pij and dSij; masked pairs and rows that see no key
            # (L = -inf) get dS = 0 without an exp.
            for a in range(TM):
                r = ty + TY * a
                row = i * Br + r
                for b in range(TN):
                    c = tx + TX * b
                    col = j * Bc + c
                    visible = (L_a[a] != NEG_INF and col < Sk
                               and (not causal or col <= row + causal_offset))
                    ds = ZERO
                    if visible:
                        p = math.exp2(s[a, b] * scale_log2 - L_a[a])
                        ds = p * (dp[a, b] - D_a[a])
                    dSij[U(r), U(c)] = ds
            # Wait until dSij is complete.
            cuda.syncthreads()

            # Alg.2 l.15: dQi += dSij Kj, this K/V tile's part summed on its own; per key
            # TM + DN loads for TM DN FMAs.
            for a in range(TM):
                for e in range(DN):
                    dq_t[a, e] = ZERO
            if not causal or j * Bc + Bc - 1 <= first_limit:
                # every row of the block sees every key of the tile: no test
                c = 0
                while c < Bc:             # a while loop, not range(): see kernels/__init__.py
                    for a in range(TM):
                        sa[a] = dSij[U(ty + TY * a), U(c)]
                    for e in range(DN):
                        ke[e] = KjT[U(tx + TX * e), U(c)]
                    for a in range(TM):
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
                        sa[a] = dSij[U(ty + TY * a), U(c)]
                    for e in range(DN):
                        ke[e] = KjT[U(tx + TX * e), U(c)]
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

    return backward_dq_v3


# --- the launch contract ------------------------------------------------------------

# v3 tile rule: the first (Br, Bc, TM, TN) of BWD_V3_CANDIDATES whose two kernels fit in
# 48 KB of static shared memory and whose accumulators fit BWD_V3_MAX_ACC_REGS per thread:
# the dK/dV kernel keeps dKj, dVj and one Q tile's part of each (4 TN DNY values, DNY =
# d / TY rounded up), the dQ kernel dQi and one K/V tile's part (2 TM DNX, DNX = d / TX
# rounded up). If no candidate meets the register bound (d > 128 in float32), the first
# that fits in shared memory (ptxas then reports spills; tests/ptx_check.py prints them).
# Under the simulator, BWD_V3_SIM_TILES: small blocks (16 threads) that still have two
# threads and two entries per thread on each axis. Float32: d=64 -> (32, 32, 4, 2),
# d=128 -> (16, 16, 2, 1), 128 threads each; under the simulator (8, 8, 2, 2).
BWD_V3_CANDIDATES = ((32, 32, 4, 2), (16, 16, 2, 1), (16, 16, 1, 1), (8, 8, 1, 1),
                     (4, 4, 1, 1))
BWD_V3_MAX_ACC_REGS = 64
BWD_V3_SIM_TILES = (8, 8, 2, 2)


def dkdv_v3_shared_bytes(Br, Bc, TM, TN, d, acc_dtype):
    """Shared memory of backward_dkdv_v3: KjT, VjT (DPY, Bc+1), QiT, dOiT (DPY, Br+1),
    Pij, dSij (Br, Bc+1), L_i, D_i (Br); DPY = d rounded up to TY = Br // TM."""
    _, _, DPY, _, _, _ = v3_thread_grid(Br, Bc, TM, TN, d)
    n = 2 * DPY * (Bc + 1) + 2 * DPY * (Br + 1) + 2 * Br * (Bc + 1) + 2 * Br
    return n * np.dtype(acc_dtype).itemsize


def dq_v3_shared_bytes(Br, Bc, TM, TN, d, acc_dtype):
    """Shared memory of backward_dq_v3: QiT, dOiT (DPX, Br+1), KjT, VjT (DPX, Bc+1),
    dSij (Br, Bc+1); DPX = d rounded up to TX = Bc // TN."""
    _, _, _, _, DPX, _ = v3_thread_grid(Br, Bc, TM, TN, d)
    n = 2 * DPX * (Br + 1) + 2 * DPX * (Bc + 1) + Br * (Bc + 1)
    return n * np.dtype(acc_dtype).itemsize


def backward_v3_acc_regs(Br, Bc, TM, TN, d):
    """Accumulators per thread of (the dK/dV kernel, the dQ kernel), partials included."""
    _, _, _, DNY, _, DNX = v3_thread_grid(Br, Bc, TM, TN, d)
    return 4 * TN * DNY, 2 * TM * DNX


def _v3_fits(t, d, acc_dtype):
    return max(dkdv_v3_shared_bytes(*t, d, acc_dtype),
               dq_v3_shared_bytes(*t, d, acc_dtype)) <= SHARED_MEM_LIMIT


def default_backward_v3_tiles(d, acc_dtype, where):
    """The v3 tile rule (above), (Br, Bc, TM, TN), for ``where`` ("gpu" or "simulator").
    GPU, float32: d <= 64 -> (32, 32, 4, 2), 128 threads; d = 128 -> (16, 16, 2, 1), 128
    threads; d = 256 -> (8, 8, 1, 1), 64 threads (over the register bound); float64:
    d = 64 -> (16, 16, 2, 1)."""
    if where == "simulator":
        return BWD_V3_SIM_TILES
    fits = [t for t in BWD_V3_CANDIDATES if _v3_fits(t, d, acc_dtype)]
    for t in fits:
        if max(backward_v3_acc_regs(*t, d)) <= BWD_V3_MAX_ACC_REGS:
            return t
    if fits:
        return fits[0]
    raise ValueError(f"backward v3 cannot run this input: no v3 tile fits head dim {d} in "
                     f"{acc_dtype} within {SHARED_MEM_LIMIT} bytes of shared memory")


def check_backward_v3_tiles(tiles, d, acc_dtype):
    """A caller's backward v3 tiles (``check_thread_tiles``, as forward v4); both v3
    kernels must fit."""
    return check_thread_tiles(
        tiles, d, acc_dtype, "backward v3",
        lambda Br, Bc, TM, TN: max(dkdv_v3_shared_bytes(Br, Bc, TM, TN, d, acc_dtype),
                                   dq_v3_shared_bytes(Br, Bc, TM, TN, d, acc_dtype)))


def plan_register_blocked(p, where, tiles, reason, preprocess, version, default_tiles,
                          check_tiles, dkdv_bytes, dq_bytes, why, dynamic_shared=False,
                          variants=False):
    """The Plans of the register-blocked backward ``version`` ("v3", or "v4": v3's kernels
    with dynamic shared memory; each Plan's ``shared_bytes`` is then what its launch asks
    for): D, then dK/dV with grid (Tc, B * Hkv), then dQ with grid (Tr, B * Hq), both with
    (Br / TM) x (Bc / TN) threads. ``default_tiles(d, acc_dtype, where)`` and
    ``check_tiles(tiles, d, acc_dtype)`` are the version's tile rule and tile check,
    ``dkdv_bytes`` and ``dq_bytes`` its kernels' shared memory, ``why`` its measurement.
    ``variants``: the version takes variants (v4); the others refuse them (their plan
    calls refuse_backward_variants), so for them B * Hkv is B * Hq."""
    if tiles is None:
        Br, Bc, TM, TN = default_tiles(p.d, p.acc_dtype, where)
        reason += f"; tiles by the {version} rule for d={p.d} in {p.acc_dtype}"
        if where == "simulator":
            reason += " (small tiles on the simulator, where every thread and barrier is slow)"
    else:
        Br, Bc, TM, TN = check_tiles(tiles, p.d, p.acc_dtype)
        reason += "; tiles given by the caller"
    reason += "; " + why
    threads = (Br // TM) * (Bc // TN)
    Tr, Tc = math.ceil(p.Sq / Br), math.ceil(p.Sk / Bc)
    variant = variant_description(p) if variants else "plain"
    gqa = (f"; GQA: each block sums over the {p.group} query heads of its K/V head in a "
           f"fixed order" if p.group > 1 else "")
    table = TILE_TABLE_REASON if variants and p.variant.tile_table else ""
    return Plans((
        preprocess,
        Plan("backward dK dV", version, f"backward_dkdv_{version}", where, Br, Bc,
             (Tc, p.BHkv), (threads,), dkdv_bytes(Br, Bc, TM, TN, p.d, p.acc_dtype),
             p.acc_dtype, p.causal,
             reason + "; one block per K/V tile, each thread a block of keys" + gqa + table,
             variant, thread_tile=(TM, TN), dynamic_shared=dynamic_shared),
        Plan("backward dQ", version, f"backward_dq_{version}", where, Br, Bc, (Tr, p.BH),
             (threads,), dq_bytes(Br, Bc, TM, TN, p.d, p.acc_dtype), p.acc_dtype, p.causal,
             reason + "; one block per Q tile, each thread a block of query rows" + table,
             variant, thread_tile=(TM, TN), dynamic_shared=dynamic_shared),
    ))


VARIANTS = False               # plain attention only
TILE_TABLE = False


def plan(p, where, tiles, reason, preprocess):
    """The Plans of backward v3 for Problem ``p`` (``plan_register_blocked``)."""
    refuse_backward_variants("v3", p)
    return plan_register_blocked(
        p, where, tiles, reason, preprocess, "v3", default_backward_v3_tiles,
        check_backward_v3_tiles, dkdv_v3_shared_bytes, dq_v3_shared_bytes,
        "measured on the H200: 3.7x to 7.4x faster than v1 "
        "(lab/runs/2026-12-01/11_bwd_v3_sweep.txt)")


def kernel(plan, p):
    """The compiled kernel of one of v3's plans (cached per compile-time parameters)."""
    make = {"backward_dkdv_v3": make_backward_dkdv_v3,
            "backward_dq_v3": make_backward_dq_v3}[plan.kernel]
    TM, TN = plan.thread_tile
    return make(plan.Br, plan.Bc, TM, TN, p.d, p.upper, p.acc_dtype)
