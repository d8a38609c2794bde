"""Backward v5: the tile products on the tensor cores (3xTF32 mma.sync).

Parent: v4 (v4_dynamic_shared.py), with forward v3's tensor-core split
(forward/v3_tensor_cores.py). The same D, dK/dV and dQ kernels, order of work and
determinism as v4, but every tile product runs as 3xTF32 ``mma.sync`` (ptx.py): in the
dK/dV kernel each warp owns 16 keys and computes S^T = Kj Qi^T and dP^T = Vj dOi^T as
fragments whose rows are its keys, then dVj += P^T dOi and dKj += dS^T Qi with the S
fragments as the A operand (forward v3's relabelling of k); the dQ kernel is its mirror
image, each warp 16 query rows. All four tiles sit in dynamic shared memory in rows of
DP + 4 floats, and every operand is split into its TF32 parts where it is read.

What it costs: finite inputs only. A tensor core cannot skip a product, so a NaN in the q
or dO of a query would reach the keys it does not see as 0 * NaN; nonfinite.py checks the
six inputs (numbaflash/policy.py, start_finite_check): version="v5" with a NaN or
inf is a ValueError before the launch, and the default runs v4 after it. What it buys:
about v4's speed and no more, the plain rung of the tensor-core ladder: at
(2, 16, 4096, 64) 26.63 / 14.43 ms (not causal / causal) against v4's 24.53 / 15.43,
at d = 128 with (64, 64) tiles 74.36 / 39.33 against 64.96 / 34.05
(lab/runs/2026-12-01/35_bwd_v5_sweep.txt). v6 makes it pay.

Runs only when asked for (version="v5"). Deterministic; inline PTX on a GPU, on the
simulator kernels/simulated.py's stand-ins (slow; the default there stays v4); float32
accumulation, float16 and float32 inputs, d <= 128.
"""

import functools
from collections import namedtuple
import math

from numba import cuda

from .. import acc_type, jit_options
from ..bands import make_kv_tile_range, make_q_tile_range
from ..plan import (DYNAMIC_LIMIT_WHY, DYNAMIC_SHARED_MEM_LIMIT, Plan, Plans,
                    device_dynamic_shared_limit, parse_tiles, refuse_backward_variants)
from ..smem import U


# ---------------------------------------------------------------------------------------
# v5: tensor cores (3xTF32)

V5_CHUNK = 16           # backward v5: streamed rows (queries in dK/dV, keys in dQ) per step


def v5_head_dim(d):
    """(DP, STRIDE) of backward v5: d rounded up to the mma's k = 8, and the row length
    of its shared tiles, DP + 4, with which both fragment read patterns (rows g, columns
    t, and rows 2t, columns g: make_backward_dkdv_v5) hit 32 different banks."""
    DP = (d + 7) // 8 * 8
    return DP, DP + 4


# What dkdv_v5_shared_layout returns, by name.
DkdvV5Layout = namedtuple("DkdvV5Layout", "K_AT V_AT Q_AT dO_AT L_AT D_AT END")


def dkdv_v5_shared_layout(Br, Bc, d, pairs=False):
    """Where backward_dkdv_v5's tiles sit in its one dynamic float32 array: the offsets of
    Kj, Vj (Bc rows of STRIDE), Qi, dOi (Br rows of STRIDE), L_i, D_i (Br) and the end:
    (K_AT, V_AT, Q_AT, dO_AT, L_AT, D_AT, END). ``dkdv_v5_shared_bytes`` is
    END * 4. ``pairs`` (backward v6): Qi and dOi each hold their big parts, then their
    small parts (2 Br rows)."""
    _, STRIDE = v5_head_dim(d)
    streamed = 2 * Br if pairs else Br
    K_AT = 0
    V_AT = K_AT + Bc * STRIDE
    Q_AT = V_AT + Bc * STRIDE
    dO_AT = Q_AT + streamed * STRIDE
    L_AT = dO_AT + streamed * STRIDE
    D_AT = L_AT + Br
    END = D_AT + Br
    return DkdvV5Layout(K_AT, V_AT, Q_AT, dO_AT, L_AT, D_AT, END)


# What dq_v5_shared_layout returns, by name.
DqV5Layout = namedtuple("DqV5Layout", "Q_AT dO_AT K_AT V_AT END")


def dq_v5_shared_layout(Br, Bc, d, pairs=False):
    """Where backward_dq_v5's tiles sit in its one dynamic float32 array: the offsets of
    Qi, dOi (Br rows of STRIDE), Kj, Vj (Bc rows of STRIDE) and the end:
    (Q_AT, dO_AT, K_AT, V_AT, END). ``dq_v5_shared_bytes`` is END * 4.
    ``pairs`` (backward v6): Kj and Vj each hold their big parts, then their small parts
    (2 Bc rows)."""
    _, STRIDE = v5_head_dim(d)
    streamed = 2 * Bc if pairs else Bc
    Q_AT = 0
    dO_AT = Q_AT + Br * STRIDE
    K_AT = dO_AT + Br * STRIDE
    V_AT = K_AT + streamed * STRIDE
    END = V_AT + streamed * STRIDE
    return DqV5Layout(Q_AT, dO_AT, K_AT, V_AT, END)


@functools.lru_cache(maxsize=None)
def make_backward_dkdv_v5(Br, Bc, d, causal):
    """v5 dK/dV kernel: tensor cores (3xTF32 ``mma.sync``, as forward v3);
    float32 accumulation, float16 and float32 inputs. On the simulator it runs through
    kernels/simulated.py (slowly; the default there stays v4).

    The work is v4's (one block per K/V tile j, walking the Q tiles i; no atomics), laid
    out for the tensor cores the way forward v3 lays out the forward, with keys where the
    forward has query rows: warp w owns the keys j*Bc + 16w .. +16 of the tile, and lane
    ``lane`` (g = lane // 4, t = lane % 4) the two keys 16w + g and 16w + g + 8. Per
    chunk of V5_CHUNK query rows of Qi the warp computes, in mma fragments (rows = its
    keys, columns = the chunk's queries; ptx.py's C layout):

        S^T  = Kj Qi^T          A = Kj (its 16 rows), B = Qi: both from shared memory
        dP^T = Vj dOi^T         A = Vj, B = dOi
        P^T  = exp(scale S^T - L), dS^T = P^T * (dP^T - D)     per column (query) r
        dVj += P^T dOi          A = P^T from the S fragments, B = dOi
        dKj += dS^T Qi          A = dS^T, B = Qi

    The last two reuse the S fragments as the A operand without moving data between
    lanes, as forward v3 does for P~ Vj: the mma's k = t and t + 4 are taken to mean the
    lane's two queries 2t and 2t + 1, and the B rows are read in that order. So Qi and
    dOi are read in two patterns: rows g, columns t (as B of S^T, dP^T) and rows 2t,
    columns g (as B of dV, dK); rows of DP + 4 floats keep both conflict-free
    (v5_head_dim). Every element is split into its TF32 parts where it is used (as
    forward v3; forward v6 shows what splitting once per tile buys).

    Float32 sums: each chunk's products are summed from zero and then added to dKj, dVj
    in ordinary float32 arithmetic (as forward v3 and backward v4 do per tile).

    Finite inputs only: a tensor core cannot skip a product, so a NaN or inf in the q or
    dO of a query would reach keys that query does not see as 0 * NaN. The call checks
    the inputs first (nonfinite.py; policy.start_finite_check: v4 runs if any is not
    finite, or ValueError if v5 was asked for).
    Rows that see no key (L = -inf) are staged as zeros, so their q and dO play no part.

    Launch: grid (ceil(Sk / Bc), BH), block (2 * Bc,): Bc / 16 warps; END * 4 bytes of
    dynamic shared memory (``dkdv_v5_shared_layout``; allowed first above 48 KB):

        kernel[grid, block, 0, nbytes](Q, K, V, dO, L, D, dK, dV, softmax_scale, causal_offset)
    """
    from ..ptx import mma3_split_b as mma3, split_tf32 as split   # inline PTX (simulator: simulated.py)
    acc = acc_type("float32")
    ZERO = acc(0)
    NEG_INF = acc(-math.inf)
    assert Bc % 16 == 0 and Br % V5_CHUNK == 0, (Br, Bc)
    THREADS = 2 * Bc                        # Bc / 16 warps of 32 lanes
    DP, STRIDE = v5_head_dim(d)
    KS = DP // 8                            # mma steps over the head dim
    NT = V5_CHUNK // 8                      # mma steps over the queries of a chunk
    ACC = KS * 4                            # fragment registers of dKj and of dVj per lane
    S_FRAGS = NT * 4                        # fragment registers of S^T per lane
    K_AT, V_AT, Q_AT, dO_AT, L_AT, D_AT, END = dkdv_v5_shared_layout(Br, Bc, d)
    q_tile_range = make_q_tile_range(Br, Bc, causal, False)

    @cuda.jit(**jit_options())
    def backward_dkdv_v5(Q, K, V, dO, L, D, dK, dV, softmax_scale, causal_offset):
        bh = cuda.blockIdx.y
        j = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        lane = tid % 32
        g = lane // 4
        t = lane % 4
        w0 = (tid // 32) * 16                   # the warp's first key within the tile
        key0 = j * Bc + w0 + g                  # this lane's two keys: key0, key0 + 8
        Sq = Q.shape[1]
        Sk = K.shape[1]

        smem = cuda.shared.array(0, acc)
        Kj = smem[K_AT:V_AT]
        Vj = smem[V_AT:Q_AT]
        Qi = smem[Q_AT:dO_AT]
        dOi = smem[dO_AT:L_AT]
        L_i = smem[L_AT:D_AT]
        D_i = smem[D_AT:END]
        dk = cuda.local.array(ACC, acc)         # dKj fragments: dk[nd*4 + 0..3] =
        dv = cuda.local.array(ACC, acc)         #   dK[g, 8nd+2t], [g, +1], [g+8, ...], ...
        s = cuda.local.array(S_FRAGS, acc)      # S^T, then P^T, of a chunk
        dp = cuda.local.array(S_FRAGS, acc)     # dP^T, then dS^T
        pb = cuda.local.array(S_FRAGS, acc)     # P^T and dS^T split for the tensor cores
        ps = cuda.local.array(S_FRAGS, acc)
        gb = cuda.local.array(S_FRAGS, acc)
        gs = cuda.local.array(S_FRAGS, acc)

        # Alg.2 l.6: stage Kj and Vj once (zeros past Sk and past d).
        for idx in range(tid, Bc * DP, THREADS):
            c = idx // DP
            k = idx % DP
            col = j * Bc + c
            inside = col < Sk and k < d
            Kj[U(c * STRIDE + k)] = acc(K[U(bh), U(col), U(k)]) if inside else ZERO
            Vj[U(c * STRIDE + k)] = acc(V[U(bh), U(col), U(k)]) if inside else ZERO
        for x in range(ACC):
            dk[x] = ZERO
            dv[x] = ZERO

        i_start, i_end = q_tile_range(j, Sq, causal_offset, 0)   # causal: skip hidden tiles
        for i in range(i_start, i_end):
            # Wait until every warp has finished with the previous Qi and dOi.
            cuda.syncthreads()
            # Alg.2 l.8: stage Qi, dOi, L_i, D_i; rows past Sq or that see no key as zeros.
            for idx in range(tid, Br * DP, THREADS):
                r = idx // DP
                k = idx % DP
                row = i * Br + r
                inside = row < Sq and k < d
                if inside:
                    inside = L[U(bh), U(row)] != NEG_INF
                Qi[U(r * STRIDE + k)] = acc(Q[U(bh), U(row), U(k)]) if inside else ZERO
                dOi[U(r * STRIDE + k)] = acc(dO[U(bh), U(row), U(k)]) if inside else ZERO
            for r in range(tid, Br, THREADS):
                row = i * Br + r
                L_i[r] = L[U(bh), U(row)] if row < Sq else ZERO
                D_i[r] = D[U(bh), U(row)] if row < Sq else ZERO
            cuda.syncthreads()

            for ch in range(Br // V5_CHUNK):
                r0 = ch * V5_CHUNK              # first query of the chunk within the tile
                # Alg.2 l.10, l.13: S^T = Kj Qi^T and dP^T = Vj dOi^T on the tensor cores.
                for nt in range(NT):
                    c0 = ZERO
                    c1 = ZERO
                    c2 = ZERO
                    c3 = ZERO
                    e0 = ZERO
                    e1 = ZERO
                    e2 = ZERO
                    e3 = ZERO
                    f0 = ZERO
                    f1 = ZERO
                    f2 = ZERO
                    f3 = ZERO
                    h0 = ZERO
                    h1 = ZERO
                    h2 = ZERO
                    h3 = ZERO
                    brow = (r0 + nt * 8 + g) * STRIDE     # B's column g: query r0+8nt+g
                    for ks in range(KS):
                        at = (w0 + g) * STRIDE + ks * 8 + t
                        bt = brow + ks * 8 + t
                        a0b, a0s = split(Kj[U(at)])
                        a1b, a1s = split(Kj[U(at + 8 * STRIDE)])
                        a2b, a2s = split(Kj[U(at + 4)])
                        a3b, a3s = split(Kj[U(at + 8 * STRIDE + 4)])
                        c0, c1, c2, c3, e0, e1, e2, e3 = mma3(
                            a0b, a1b, a2b, a3b, a0s, a1s, a2s, a3s,
                            Qi[U(bt)], Qi[U(bt + 4)], c0, c1, c2, c3, e0, e1, e2, e3)
                        a0b, a0s = split(Vj[U(at)])
                        a1b, a1s = split(Vj[U(at + 8 * STRIDE)])
                        a2b, a2s = split(Vj[U(at + 4)])
                        a3b, a3s = split(Vj[U(at + 8 * STRIDE + 4)])
                        f0, f1, f2, f3, h0, h1, h2, h3 = mma3(
                            a0b, a1b, a2b, a3b, a0s, a1s, a2s, a3s,
                            dOi[U(bt)], dOi[U(bt + 4)], f0, f1, f2, f3, h0, h1, h2, h3)
                    s[nt * 4] = c0 + e0
                    s[nt * 4 + 1] = c1 + e1
                    s[nt * 4 + 2] = c2 + e2
                    s[nt * 4 + 3] = c3 + e3
                    dp[nt * 4] = f0 + h0
                    dp[nt * 4 + 1] = f1 + h1
                    dp[nt * 4 + 2] = f2 + h2
                    dp[nt * 4 + 3] = f3 + h3
                # Alg.2 l.11, l.14: P^T = exp(scale S^T - L), dS^T = P^T (dP^T - D), on
                # the visible (key, query) pairs; 0 elsewhere.
                for nt in range(NT):
                    for x in range(4):
                        r = r0 + nt * 8 + 2 * t + x % 2        # query within the tile
                        row = i * Br + r
                        col = key0 + 8 * (x // 2)
                        seen = row < Sq and col < Sk and (not causal
                                                         or col <= row + causal_offset)
                        p = math.exp(s[nt * 4 + x] * softmax_scale - L_i[r]) if seen else ZERO
                        s[nt * 4 + x] = p
                        dp[nt * 4 + x] = p * (dp[nt * 4 + x] - D_i[r]) if seen else ZERO
                for x in range(S_FRAGS):
                    pb[x], ps[x] = split(s[x])
                    gb[x], gs[x] = split(dp[x])
                # Alg.2 l.12, l.16: dVj += P^T dOi and dKj += dS^T Qi (the scale at the
                # end), with the S fragments as A: this lane's queries 2t, 2t + 1 play the
                # mma's k = t, t + 4.
                for nd in range(KS):
                    c0 = ZERO
                    c1 = ZERO
                    c2 = ZERO
                    c3 = ZERO
                    e0 = ZERO
                    e1 = ZERO
                    e2 = ZERO
                    e3 = ZERO
                    f0 = ZERO
                    f1 = ZERO
                    f2 = ZERO
                    f3 = ZERO
                    h0 = ZERO
                    h1 = ZERO
                    h2 = ZERO
                    h3 = ZERO
                    for ks in range(NT):
                        bt = (r0 + ks * 8 + 2 * t) * STRIDE + nd * 8 + g
                        c0, c1, c2, c3, e0, e1, e2, e3 = mma3(
                            pb[ks * 4], pb[ks * 4 + 2], pb[ks * 4 + 1], pb[ks * 4 + 3],
                            ps[ks * 4], ps[ks * 4 + 2], ps[ks * 4 + 1], ps[ks * 4 + 3],
                            dOi[U(bt)], dOi[U(bt + STRIDE)], c0, c1, c2, c3, e0, e1, e2, e3)
                        f0, f1, f2, f3, h0, h1, h2, h3 = mma3(
                            gb[ks * 4], gb[ks * 4 + 2], gb[ks * 4 + 1], gb[ks * 4 + 3],
                            gs[ks * 4], gs[ks * 4 + 2], gs[ks * 4 + 1], gs[ks * 4 + 3],
                            Qi[U(bt)], Qi[U(bt + STRIDE)], f0, f1, f2, f3, h0, h1, h2, h3)
                    dv[nd * 4] += c0 + e0
                    dv[nd * 4 + 1] += c1 + e1
                    dv[nd * 4 + 2] += c2 + e2
                    dv[nd * 4 + 3] += c3 + e3
                    dk[nd * 4] += f0 + h0
                    dk[nd * 4 + 1] += f1 + h1
                    dk[nd * 4 + 2] += f2 + h2
                    dk[nd * 4 + 3] += f3 + h3

        # Alg.2 l.18: write dKj (times the scale) and dVj. Keys nobody sees stay 0.
        for nd in range(KS):
            for x in range(4):
                col = key0 + 8 * (x // 2)
                k = nd * 8 + 2 * t + x % 2
                if col < Sk and k < d:
                    dK[U(bh), U(col), U(k)] = dk[nd * 4 + x] * softmax_scale
                    dV[U(bh), U(col), U(k)] = dv[nd * 4 + x]

    return backward_dkdv_v5


@functools.lru_cache(maxsize=None)
def make_backward_dq_v5(Br, Bc, d, causal):
    """v5 dQ kernel: the tensor-core sibling of make_backward_dkdv_v5 (finite inputs;
    the simulator's default stays v4), laid out as forward v3: warp w owns the query rows
    i*Br + 16w .. +16, lane ``lane`` the rows 16w + g and 16w + g + 8. Per chunk of
    V5_CHUNK keys of Kj, in mma fragments (rows = its queries, columns = the keys):

        S  = Qi Kj^T            A = Qi (its 16 rows), B = Kj: both from shared memory
        dP = dOi Vj^T           A = dOi, B = Vj
        P  = exp(scale S - L), dS = P * (dP - D)       per row, L and D in registers
        dQi += dS Kj            A = dS from the fragments (keys 2t, 2t + 1 as k = t,
                                t + 4), B = Kj read as rows 2t, columns g

    Launch: grid (ceil(Sq / Br), BH), block (2 * Br,); END * 4 bytes of dynamic shared
    memory (``dq_v5_shared_layout``):

        kernel[grid, block, 0, nbytes](Q, K, V, dO, L, D, dQ, softmax_scale, causal_offset)
    """
    from ..ptx import mma3_split_b as mma3, split_tf32 as split   # inline PTX (simulator: simulated.py)
    acc = acc_type("float32")
    ZERO = acc(0)
    NEG_INF = acc(-math.inf)
    assert Br % 16 == 0 and Bc % V5_CHUNK == 0, (Br, Bc)
    THREADS = 2 * Br                        # Br / 16 warps of 32 lanes
    DP, STRIDE = v5_head_dim(d)
    KS = DP // 8
    NT = V5_CHUNK // 8                      # mma steps over the keys of a chunk
    ACC = KS * 4                            # fragment registers of dQi per lane
    S_FRAGS = NT * 4
    Q_AT, dO_AT, K_AT, V_AT, END = dq_v5_shared_layout(Br, Bc, d)
    kv_tile_range = make_kv_tile_range(Br, Bc, causal, False)

    @cuda.jit(**jit_options())
    def backward_dq_v5(Q, K, V, dO, L, D, dQ, softmax_scale, causal_offset):
        bh = cuda.blockIdx.y
        i = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        lane = tid % 32
        g = lane // 4
        t = lane % 4
        w0 = (tid // 32) * 16                   # the warp's first row within the tile
        row0 = i * Br + w0 + g                  # this lane's two rows: row0, row0 + 8
        Sq = Q.shape[1]
        Sk = K.shape[1]

        smem = cuda.shared.array(0, acc)
        Qi = smem[Q_AT:dO_AT]
        dOi = smem[dO_AT:K_AT]
        Kj = smem[K_AT:V_AT]
        Vj = smem[V_AT:END]
        dq = cuda.local.array(ACC, acc)         # dQi fragments (C layout)
        s = cuda.local.array(S_FRAGS, acc)      # S, then P, of a chunk
        dp = cuda.local.array(S_FRAGS, acc)     # dP, then dS
        gb = cuda.local.array(S_FRAGS, acc)     # dS split for the tensor cores
        gs = cuda.local.array(S_FRAGS, acc)
        Lr = cuda.local.array(2, acc)           # L and D of this lane's two rows
        Dr = cuda.local.array(2, acc)

        # Stage Qi and dOi once; rows past Sq or that see no key (L = -inf) as zeros.
        for idx in range(tid, Br * DP, THREADS):
            r = idx // DP
            k = idx % DP
            row = i * Br + r
            inside = row < Sq and k < d
            if inside:
                inside = L[U(bh), U(row)] != NEG_INF
            Qi[U(r * STRIDE + k)] = acc(Q[U(bh), U(row), U(k)]) if inside else ZERO
            dOi[U(r * STRIDE + k)] = acc(dO[U(bh), U(row), U(k)]) if inside else ZERO
        for h in range(2):
            row = row0 + 8 * h
            Lr[h] = L[U(bh), U(row)] if row < Sq else ZERO
            Dr[h] = D[U(bh), U(row)] if row < Sq else ZERO
        for x in range(ACC):
            dq[x] = ZERO

        j_start, j_end = kv_tile_range(i, Sk, causal_offset, 0)  # causal: skip hidden tiles
        for j in range(j_start, j_end):
            # Wait until every warp has finished with the previous Kj and Vj (and, the
            # first time, until Qi and dOi are staged).
            cuda.syncthreads()
            for idx in range(tid, Bc * DP, THREADS):
                c = idx // DP
                k = idx % DP
                col = j * Bc + c
                inside = col < Sk and k < d
                Kj[U(c * STRIDE + k)] = acc(K[U(bh), U(col), U(k)]) if inside else ZERO
                Vj[U(c * STRIDE + k)] = acc(V[U(bh), U(col), U(k)]) if inside else ZERO
            cuda.syncthreads()

            for ch in range(Bc // V5_CHUNK):
                c_0 = ch * V5_CHUNK             # first key of the chunk within the tile
                # Alg.2 l.10, l.13: S = Qi Kj^T and dP = dOi Vj^T on the tensor cores.
                for nt in range(NT):
                    c0 = ZERO
                    c1 = ZERO
                    c2 = ZERO
                    c3 = ZERO
                    e0 = ZERO
                    e1 = ZERO
                    e2 = ZERO
                    e3 = ZERO
                    f0 = ZERO
                    f1 = ZERO
                    f2 = ZERO
                    f3 = ZERO
                    h0 = ZERO
                    h1 = ZERO
                    h2 = ZERO
                    h3 = ZERO
                    brow = (c_0 + nt * 8 + g) * STRIDE    # B's column g: key c_0+8nt+g
                    for ks in range(KS):
                        at = (w0 + g) * STRIDE + ks * 8 + t
                        bt = brow + ks * 8 + t
                        a0b, a0s = split(Qi[U(at)])
                        a1b, a1s = split(Qi[U(at + 8 * STRIDE)])
                        a2b, a2s = split(Qi[U(at + 4)])
                        a3b, a3s = split(Qi[U(at + 8 * STRIDE + 4)])
                        c0, c1, c2, c3, e0, e1, e2, e3 = mma3(
                            a0b, a1b, a2b, a3b, a0s, a1s, a2s, a3s,
                            Kj[U(bt)], Kj[U(bt + 4)], c0, c1, c2, c3, e0, e1, e2, e3)
                        a0b, a0s = split(dOi[U(at)])
                        a1b, a1s = split(dOi[U(at + 8 * STRIDE)])
                        a2b, a2s = split(dOi[U(at + 4)])
                        a3b, a3s = split(dOi[U(at + 8 * STRIDE + 4)])
                        f0, f1, f2, f3, h0, h1, h2, h3 = mma3(
                            a0b, a1b, a2b, a3b, a0s, a1s, a2s, a3s,
                            Vj[U(bt)], Vj[U(bt + 4)], f0, f1, f2, f3, h0, h1, h2, h3)
                    s[nt * 4] = c0 + e0
                    s[nt * 4 + 1] = c1 + e1
                    s[nt * 4 + 2] = c2 + e2
                    s[nt * 4 + 3] = c3 + e3
                    dp[nt * 4] = f0 + h0
                    dp[nt * 4 + 1] = f1 + h1
                    dp[nt * 4 + 2] = f2 + h2
                    dp[nt * 4 + 3] = f3 + h3
                # Alg.2 l.11, l.14 on the visible (row, key) pairs; 0 elsewhere.
                for nt in range(NT):
                    for x in range(4):
                        h = x // 2
                        row = row0 + 8 * h
                        col = j * Bc + c_0 + nt * 8 + 2 * t + x % 2
                        seen = row < Sq and col < Sk and (not causal
                                                         or col <= row + causal_offset)
                        p = math.exp(s[nt * 4 + x] * softmax_scale - Lr[h]) if seen else ZERO
                        ds = p * (dp[nt * 4 + x] - Dr[h]) if seen else ZERO
                        gb[nt * 4 + x], gs[nt * 4 + x] = split(ds)
                # Alg.2 l.15: dQi += dS Kj (the scale at the end).
                for nd in range(KS):
                    c0 = ZERO
                    c1 = ZERO
                    c2 = ZERO
                    c3 = ZERO
                    e0 = ZERO
                    e1 = ZERO
                    e2 = ZERO
                    e3 = ZERO
                    for ks in range(NT):
                        bt = (c_0 + ks * 8 + 2 * t) * STRIDE + nd * 8 + g
                        c0, c1, c2, c3, e0, e1, e2, e3 = mma3(
                            gb[ks * 4], gb[ks * 4 + 2], gb[ks * 4 + 1], gb[ks * 4 + 3],
                            gs[ks * 4], gs[ks * 4 + 2], gs[ks * 4 + 1], gs[ks * 4 + 3],
                            Kj[U(bt)], Kj[U(bt + STRIDE)], c0, c1, c2, c3, e0, e1, e2, e3)
                    dq[nd * 4] += c0 + e0
                    dq[nd * 4 + 1] += c1 + e1
                    dq[nd * 4 + 2] += c2 + e2
                    dq[nd * 4 + 3] += c3 + e3

        # Write dQi (times the scale); a row that sees no key has dq = 0 exactly.
        for nd in range(KS):
            for x in range(4):
                row = row0 + 8 * (x // 2)
                k = nd * 8 + 2 * t + x % 2
                if row < Sq and k < d:
                    dQ[U(bh), U(row), U(k)] = dq[nd * 4 + x] * softmax_scale

    return backward_dq_v5


# --- the launch contract ------------------------------------------------------------

# v5's dK/dV kernel owns Bc keys (Bc / 16 warps) and streams Q tiles of Br rows; its dQ
# kernel owns Br query rows (Br / 16 warps) and streams K/V tiles of Bc keys. Each holds
# four tiles of rows of DP + 4 floats (v5_head_dim) in dynamic shared memory.
# Tile rule: the first (Br, Bc) of BWD_V5_CANDIDATES whose two kernels fit in
# BWD_V5_SHARED_MEM_TARGET (two blocks per H200 SM), or the device's own maximum if that
# is lower. Float32: d <= 64 -> (64, 64), 70 KB each; d = 128 -> (64, 32), 102 KB.
# A caller's tiles: Br and Bc multiples of 16 (warps of 16 rows; chunks of V5_CHUNK) up
# to 256, within 227 KB. (v6 uses the same layout and candidates: v6_split_pairs.py.)
BWD_V5_CANDIDATES = ((64, 64), (64, 32), (32, 32), (32, 16), (16, 16))
BWD_V5_SHARED_MEM_TARGET = 113 * 1024
# On the simulator (kernels/simulated.py), small tiles: every thread is a Python thread
# and every mma a rendezvous of a warp's 32 lanes, so fewer warps a block and a tile
# boundary crossed at the simulator's short sequences.
BWD_V5_SIM_TILES = (32, 32)
BWD_V5_MAX_HEAD_DIM = 128     # dKj and dVj fragments (d / 2 each a lane) in registers


def dkdv_v5_shared_bytes(Br, Bc, d, pairs=False):
    """Dynamic shared memory of backward_dkdv_v5 and _v6 (dkdv_v5_shared_layout; v6 uses
    v5's layout; ``pairs``: v6 with Qi and dOi as split pairs)."""
    return dkdv_v5_shared_layout(Br, Bc, d, pairs)[-1] * 4


def dq_v5_shared_bytes(Br, Bc, d, pairs=False):
    """Dynamic shared memory of backward_dq_v5 and _v6 (dq_v5_shared_layout; ``pairs``:
    v6 with Kj and Vj as split pairs)."""
    return dq_v5_shared_layout(Br, Bc, d, pairs)[-1] * 4


def bwd_v5_bytes(Br, Bc, d):
    """The larger of backward v5's (and v6's) two kernels' dynamic shared memory."""
    return max(dkdv_v5_shared_bytes(Br, Bc, d), dq_v5_shared_bytes(Br, Bc, d))


def backward_tensor_core_refusal(version, p, where):
    """Why backward ``version`` ("v5" or "v6", the tensor-core versions) cannot run
    Problem ``p`` here, or None if it can."""
    if p.acc_dtype != "float32":
        return f"{version} computes in float32 (3xTF32); float64 inputs run on v3"
    if p.d > BWD_V5_MAX_HEAD_DIM:
        return (f"{version} keeps its dK, dV and dQ fragments in registers, which holds "
                f"head dims up to {BWD_V5_MAX_HEAD_DIM}")
    return None


def refuse_backward_tensor_cores(version, p, where):
    """ValueError if backward ``version`` ("v5" or "v6") cannot run Problem ``p`` here:
    a variant, or ``backward_tensor_core_refusal``."""
    refuse_backward_variants(version, p)
    refusal = backward_tensor_core_refusal(version, p, where)
    if refusal is not None:
        raise ValueError(f"backward {version} cannot run this input: {refusal}")


def bwd_v5_target(version, where):
    """The shared memory backward ``version``'s tile rule fills (above; v6: the device's
    own maximum)."""
    limit = device_dynamic_shared_limit(where)
    return min(BWD_V5_SHARED_MEM_TARGET, limit) if version == "v5" else limit


def bwd_v5_tiles_within(d, limit):
    """The first of BWD_V5_CANDIDATES whose two kernels fit ``limit`` bytes, or None."""
    return next(((Br, Bc) for Br, Bc in BWD_V5_CANDIDATES
                 if bwd_v5_bytes(Br, Bc, d) <= limit), None)


def default_backward_v5_tiles(d, where, version="v5"):
    """The backward v5 / v6 tile rule (above), (Br, Bc), for ``where`` (the simulator:
    BWD_V5_SIM_TILES)."""
    if where == "simulator":
        return BWD_V5_SIM_TILES
    target = bwd_v5_target(version, where)
    tiles = bwd_v5_tiles_within(d, target)
    if tiles is not None:
        return tiles
    raise ValueError(f"backward {version} cannot run this input: no {version} tile fits "
                     f"head dim {d} within {target} bytes of shared memory")


def check_backward_v5_tiles(tiles, d, version="v5", shared_bytes=None):
    """A caller's backward v5 / v6 tiles (v8's with its ``shared_bytes(Br, Bc, d)``, the
    same warps and chunks); ValueError names the limit."""
    Br, Bc = parse_tiles(tiles)
    chunk = V5_CHUNK
    if Br % 16 or Bc % 16 or Br > 256 or Bc > 256:
        raise ValueError(f"backward {version} tiles must be (Br, Bc) with Br and Bc multiples "
                         f"of 16 up to 256 (warps of 16 rows, chunks of {chunk}); got "
                         f"({Br}, {Bc})")
    need = (shared_bytes or bwd_v5_bytes)(Br, Bc, d)
    if need > DYNAMIC_SHARED_MEM_LIMIT:
        raise ValueError(f"backward {version} tiles ({Br}, {Bc}) need {need} bytes of shared "
                         f"memory at head dim {d}; the limit is {DYNAMIC_SHARED_MEM_LIMIT} "
                         f"({DYNAMIC_LIMIT_WHY})")
    return Br, Bc


def tensor_core_plans(p, where, reason, preprocess, version, per_kernel):
    """The Plans of the tensor-core backward ``version`` ("v5" or "v6"): D, then dK/dV
    with grid (Tc, B * Hq) and 2 Bc threads, then dQ with grid (Tr, B * Hq) and 2 Br
    threads, both with dynamic shared memory. ``per_kernel``: {"dkdv": (Br, Bc, pairs),
    "dq": (Br, Bc, pairs)}."""
    reason += "; finite inputs only (checked on the GPU)"
    Br, Bc, pairs = per_kernel["dkdv"]
    dkdv = Plan("backward dK dV", version, f"backward_dkdv_{version}", where, Br, Bc,
                (math.ceil(p.Sk / Bc), p.BH), (2 * Bc,),
                dkdv_v5_shared_bytes(Br, Bc, p.d, pairs), p.acc_dtype, p.causal,
                reason + "; one block per K/V tile, each warp 16 keys", pairs=pairs,
                dynamic_shared=True)
    Br, Bc, pairs = per_kernel["dq"]
    dq = Plan("backward dQ", version, f"backward_dq_{version}", where, Br, Bc,
              (math.ceil(p.Sq / Br), p.BH), (2 * Br,), dq_v5_shared_bytes(Br, Bc, p.d, pairs),
              p.acc_dtype, p.causal, reason + "; one block per Q tile, each warp 16 query rows",
              pairs=pairs, dynamic_shared=True)
    return Plans((preprocess, dkdv, dq))


VARIANTS = False               # plain attention only
TILE_TABLE = False


def plan(p, where, tiles, reason, preprocess):
    """The Plans of backward v5 for Problem ``p`` (``tensor_core_plans``): one pair of
    tiles for both kernels."""
    refuse_backward_tensor_cores("v5", p, where)
    if tiles is None:
        both = default_backward_v5_tiles(p.d, where, "v5")
        reason += f"; tiles by the v5 rule for d={p.d}"
    else:
        both = check_backward_v5_tiles(tiles, p.d, "v5")
        reason += "; tiles given by the caller"
    return tensor_core_plans(p, where, reason, preprocess, "v5",
                             {"dkdv": both + (False,), "dq": both + (False,)})


def kernel(plan, p):
    """The compiled kernel of one of v5's plans (cached per compile-time parameters)."""
    make = {"backward_dkdv_v5": make_backward_dkdv_v5,
            "backward_dq_v5": make_backward_dq_v5}[plan.kernel]
    return make(plan.Br, plan.Bc, p.d, p.upper)
