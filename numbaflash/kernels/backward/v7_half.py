"""Backward v7: v5's two kernels on the 16-bit tensor cores (m16n8k16), float16 and bfloat16.

Parent: v5 (v5_tensor_cores.py), with forward v7's 16-bit products
(forward/v7_float16.py). v5 rather than v6, because what v6 adds to v5 is about the
3xTF32 splits (splitting on the bits, split pairs, one split A fragment per chunk) and
the variants; with one 16-bit product per mma there is nothing to split, and what is left
is v5's order of work: the same D, dK/dV and dQ kernels, the same warp layout (16 keys a
warp in the dK/dV kernel, 16 query rows a warp in the dQ kernel), the same causal tile
ranges, no atomics. What changes:

* every tile product is one ``mma.sync.m16n8k16`` with float32 accumulation
  (kernels/halves.py: ptx.mma_f16, ptx.mma_bf16), 16 of the head dim a step where v5
  takes 8 with three TF32 products;
* the tiles stay 16-bit in shared memory (the inputs' own values, no rounding), rows
  padded by 8 halves so that a warp's fragment reads hit 32 different banks; the tiles
  that are also read along their other axis (as B of dV, dK and dQ) are stored a second
  time transposed, so that every B word is two neighbours of the contraction axis
  (ptx.load_b32);
* the S (and dP) accumulators of two n-tiles are the A fragment of the next product as
  they stand (forward v7's observation), with P and dS rounded to the input type there
  (pack2), as flash-attention does.

What it costs: the transposed copies (Qi^T and dOi^T in the dK/dV kernel, Kj^T in the dQ
kernel) take shared memory and staging stores, written a column at a time (bank
conflicts that ldmatrix.trans would avoid; backward v9, v9_ldmatrix.py, removes them).
What it buys: forward + backward 1.3x-1.8x faster than with v6 on float16 inputs
(lab/runs/2026-12-05/105_half_speed.txt, H100).

What is rounded: S^T (S) and dP^T (dP) are exact products of the 16-bit inputs summed in
float32; P = exp(scale S - L), D, dS = P (dP - D) and every sum over tiles are float32;
P is rounded to the input type for dV += P^T dO, dS for dK += dS^T Q and dQ += dS K;
dQ, dK and dV are rounded to the input type once, when written.

Finite inputs only, as v5 and v6: a tensor core cannot skip a product, so a NaN or inf in
the q or dO of a query would reach keys that query does not see as 0 * NaN. The call
checks the six inputs first (nonfinite.py, bfloat16 on the bits), and version="v7" with a
NaN or inf is a ValueError.

Runs only when asked for (version="v7"); v9 computes the same gradients faster.
Deterministic (no atomics). Inline PTX on a GPU; on the simulator kernels/simulated.py's
stand-ins (slow). float16 and bfloat16 inputs (a module that says ``BFLOAT16 = True``
gets bfloat16 as its bits, numbaflash/dtypes.py), float32 accumulation, d <= 128, plain
attention with or without a causal mask in either alignment.
"""

import functools
import math
from collections import namedtuple
from dataclasses import replace

from numba import cuda, float32, uint16, uint32

from .. import LOG2E, acc_type, jit_options
from ..bands import make_kv_tile_range, make_q_tile_range
from ..halves import NAMES, make_halves
from ..plan import (Plan, Plans, check_per_kernel_tiles, refuse_backward_variants,
                    rule_per_kernel_tiles)
from ..smem import U


V7_CHUNK = 16           # streamed rows a step: two n-tiles, one A fragment of k = 16


def v7_rows(n):
    """The padded length of a 16-bit shared row holding ``n`` values (a multiple of 16):
    n + 8 halves, an odd multiple of four words, so that the eight groups g of a warp's
    fragment read (rows g, words t) hit 32 different banks (as forward v7)."""
    return n + 8


def v7_head_dim(d):
    """DP: d rounded up to the mma's k = 16 (the padded columns are staged as zeros)."""
    return (d + 15) // 16 * 16


# What dkdv_v7_shared_layout and dq_v7_shared_layout return, by name: offsets in halves of
# the one dynamic array, F32 the float32 values before them (in floats), END its length.
DkdvV7Layout = namedtuple("DkdvV7Layout", "F32 K_AT V_AT Q_AT dO_AT QT_AT dOT_AT END")
DqV7Layout = namedtuple("DqV7Layout", "Q_AT dO_AT K_AT V_AT KT_AT END")


def dkdv_v7_shared_layout(Br, Bc, d):
    """Where backward_dkdv_v7's tiles sit in its dynamic shared memory: first L_i and D_i
    (Br float32 each, F32 = 2 Br floats), then, in halves, Kj and Vj (Bc rows of
    v7_rows(DP)), Qi and dOi (Br rows of v7_rows(DP)), and Qi^T, dOi^T (DP rows of
    v7_rows(Br): the B operands of dKj and dVj, read along the queries).
    ``dkdv_v7_shared_bytes`` is END * 2."""
    DP = v7_head_dim(d)
    F32 = 2 * Br
    K_AT = 2 * F32                      # halves after the float32 values
    V_AT = K_AT + Bc * v7_rows(DP)
    Q_AT = V_AT + Bc * v7_rows(DP)
    dO_AT = Q_AT + Br * v7_rows(DP)
    QT_AT = dO_AT + Br * v7_rows(DP)
    dOT_AT = QT_AT + DP * v7_rows(Br)
    END = dOT_AT + DP * v7_rows(Br)
    return DkdvV7Layout(F32, K_AT, V_AT, Q_AT, dO_AT, QT_AT, dOT_AT, END)


def dq_v7_shared_layout(Br, Bc, d):
    """Where backward_dq_v7's tiles sit in its dynamic shared memory, in halves: Qi and
    dOi (Br rows of v7_rows(DP)), Kj and Vj (Bc rows of v7_rows(DP)), and Kj^T (DP rows
    of v7_rows(Bc): the B operand of dQi, read along the keys). ``dq_v7_shared_bytes`` is
    END * 2."""
    DP = v7_head_dim(d)
    Q_AT = 0
    dO_AT = Q_AT + Br * v7_rows(DP)
    K_AT = dO_AT + Br * v7_rows(DP)
    V_AT = K_AT + Bc * v7_rows(DP)
    KT_AT = V_AT + Bc * v7_rows(DP)
    END = KT_AT + DP * v7_rows(Bc)
    return DqV7Layout(Q_AT, dO_AT, K_AT, V_AT, KT_AT, END)


def dkdv_v7_shared_bytes(Br, Bc, d):
    """Dynamic shared memory of backward_dkdv_v7 (dkdv_v7_shared_layout)."""
    return dkdv_v7_shared_layout(Br, Bc, d).END * 2


def dq_v7_shared_bytes(Br, Bc, d):
    """Dynamic shared memory of backward_dq_v7 (dq_v7_shared_layout)."""
    return dq_v7_shared_layout(Br, Bc, d).END * 2


@functools.lru_cache(maxsize=None)
def _write_narrow(half):
    """How the kernels round a float32 gradient to the stored input type when they write
    it: halves.narrow for float16 (one cvt); for bfloat16 the low half of pack2 (one
    cvt.rn.bf16x2.f32, to nearest even: for the finite values v7 computes, the bits of
    halves.narrow). halves.narrow's bfloat16 rounding on the integer bits made ptxas keep
    the dK/dV kernel's 128 accumulators at d = 128 in a 512-byte stack frame (the write
    loop was left rolled); the cvt does not (tests/ptx_check.py --group backward_half)."""
    halves = make_halves(half)
    if half == "float16":
        return halves.narrow
    pack2 = halves.pack2

    @cuda.jit(device=True, inline=True)
    def narrow_bits(x):
        return uint16(pack2(x, x) & uint32(0xFFFF))

    return narrow_bits


@functools.lru_cache(maxsize=None)
def make_backward_dkdv_v7(Br, Bc, d, causal, half="float16"):
    """v7 dK/dV kernel: 16-bit inputs (``half``: "float16" or "bfloat16", kernels/halves.py)
    on the 16-bit tensor cores, float32 accumulation, d <= 128, finite inputs.

    One block per K/V tile j walks the Q tiles i (Alg.2 l.5-8), as v5's. Warp w owns the
    keys j * Bc + 16 w .. + 16, lane ``lane`` (g = lane // 4, t = lane % 4) the keys
    16 w + g and 16 w + g + 8. Per chunk of V7_CHUNK = 16 queries of Qi (two n-tiles of
    8) the warp computes, as m16n8k16 fragments (rows = its keys, ptx.py's layouts):

        S^T  = Kj Qi^T          A = Kj (rows g, g + 8; halves 2t.. of 16 a k-step),
                                B = Qi (row = query g of the n-tile, halves 2t..)
        dP^T = Vj dOi^T         A = Vj, B = dOi
        P^T  = exp(scale S^T - L), dS^T = P^T (dP^T - D)      float32, per entry
        dVj += P^T dOi          A = P^T: the accumulators of the two n-tiles, rounded
                                (pack2); B = dOi^T (row = head dim g, queries 2t..)
        dKj += dS^T Qi          A = dS^T, rounded the same way; B = Qi^T

    The accumulator of an n-tile holds (key g, queries 2t, 2t + 1) and (key g + 8, the
    same queries): two n-tiles side by side are the A fragment of 16 queries (a0, a1 from
    the first, a2, a3 from the second) without moving data between lanes.

    Float32 sums: each chunk's dVj and dKj products are accumulated by the mma itself, in
    its C operand (the running dk, dv fragments), where v5 sums each chunk from zero and
    then adds it: the chunks still join the accumulator one at a time, in the same order,
    without the 2 d / 4 float32 additions a lane spent on every chunk (64 of a 309-instruction loop at d = 64
    in v9's SASS, lab/runs/2026-12-05/sass_half.txt). The exponentials are the hardware's
    exp2 (ptx.exp2_approx). Rows past Sq and the head dim past d are staged as zeros; entries a query
    does not see (past Sq or Sk, or above the causal bound) have P = dS = 0.

    Launch: grid (ceil(Sk / Bc), BH), block (2 * Bc,); ``dkdv_v7_shared_bytes`` of
    dynamic shared memory:

        kernel[grid, block, 0, nbytes](Q, K, V, dO, L, D, dK, dV, softmax_scale, causal_offset)
    """
    from ..ptx import exp2_approx, load_b32  # inline PTX (simulator: simulated.py)

    halves = make_halves(half)
    HALF = halves.storage                   # float16, or uint16 holding bfloat16 bits
    narrow, pack2, mma = halves.narrow, halves.pack2, halves.mma
    write_narrow = _write_narrow(half)
    acc = acc_type("float32")
    ZERO = acc(0)
    LOG2E_ACC = acc(LOG2E)
    assert Bc % 16 == 0 and Br % V7_CHUNK == 0, (Br, Bc)
    THREADS = 2 * Bc                        # Bc / 16 warps of 32 lanes
    DP = v7_head_dim(d)
    ROW = v7_rows(DP)                       # row length of Kj, Vj, Qi, dOi (halves)
    TROW = v7_rows(Br)                      # row length of Qi^T, dOi^T (halves)
    KS = DP // 16                           # k-steps over the head dim (S^T, dP^T)
    ND = DP // 8                            # n-tiles over the head dim (dKj, dVj)
    NT = V7_CHUNK // 8                      # n-tiles over the queries of a chunk
    ACC = ND * 4                            # fragment registers of dKj and of dVj a lane
    S_FRAGS = NT * 4                        # fragment registers of S^T a lane
    F32, K_AT, V_AT, Q_AT, dO_AT, QT_AT, dOT_AT, END = dkdv_v7_shared_layout(Br, Bc, d)
    q_tile_range = make_q_tile_range(Br, Bc, causal, False)

    @cuda.jit(**jit_options())
    def backward_dkdv_v7(Q, K, V, dO, L, D, dK, dV, softmax_scale, causal_offset):
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
        scale_log2 = softmax_scale * LOG2E_ACC  # exp(x) = exp2(x log2(e))
        HZERO = narrow(ZERO)        # (a 16-bit constant from outside is invalid NVVM IR)

        # One dynamic array, seen as float32 (L_i, D_i) and as halves (the tiles).
        smem32 = cuda.shared.array(0, float32, alignment=16)
        smem = cuda.shared.array(0, HALF, alignment=16)
        L_i = smem32[0:Br]                      # (Br,) L * log2(e) of the Q tile
        D_i = smem32[Br:F32]                    # (Br,) D of the Q tile
        Kj = smem[K_AT:V_AT]                    # (Bc, ROW)
        Vj = smem[V_AT:Q_AT]                    # (Bc, ROW)
        Qi = smem[Q_AT:dO_AT]                   # (Br, ROW)
        dOi = smem[dO_AT:QT_AT]                 # (Br, ROW)
        QiT = smem[QT_AT:dOT_AT]                # (DP, TROW): Qi transposed
        dOiT = smem[dOT_AT:END]                 # (DP, TROW): dOi transposed
        dk = cuda.local.array(ACC, acc)         # dKj fragments: dk[nd*4 + 0..3] =
        dv = cuda.local.array(ACC, acc)         #   dK[g, 8nd+2t], [g, +1], [g+8, ...], ...
        s = cuda.local.array(S_FRAGS, acc)      # S^T, then P^T, of a chunk
        dp = cuda.local.array(S_FRAGS, acc)     # dP^T, then dS^T

        # Alg.2 l.6: stage Kj and Vj once as they are (zeros past Sk and past d).
        for idx in range(tid, Bc * DP, THREADS):
            c = idx // DP
            k = idx % DP
            col = j * Bc + c
            inside = col < Sk and k < d
            Kj[U(c * ROW + k)] = K[U(bh), U(col), U(k)] if inside else HZERO
            Vj[U(c * ROW + k)] = V[U(bh), U(col), U(k)] if inside else HZERO
        for x in range(ACC):
            dk[x] = ZERO
            dv[x] = ZERO

        i_start, i_end = q_tile_range(j, Sq, causal_offset, 0)   # causal: skip hidden tiles
        for i in range(i_start, i_end):
            # Wait until every warp has finished reading the previous Qi, dOi, their
            # transposes, L_i and D_i (on the first pass: nothing to wait for but Kj, Vj,
            # which the barrier below also covers).
            cuda.syncthreads()
            # Alg.2 l.8: stage Qi and dOi, as rows and transposed; L_i, D_i (zeros past Sq).
            for idx in range(tid, Br * DP, THREADS):
                r = idx // DP
                k = idx % DP
                row = i * Br + r
                inside = row < Sq and k < d
                q = Q[U(bh), U(row), U(k)] if inside else HZERO
                o = dO[U(bh), U(row), U(k)] if inside else HZERO
                Qi[U(r * ROW + k)] = q
                dOi[U(r * ROW + k)] = o
                QiT[U(k * TROW + r)] = q
                dOiT[U(k * TROW + r)] = o
            for r in range(tid, Br, THREADS):
                row = i * Br + r
                L_i[r] = L[U(bh), U(row)] * LOG2E_ACC if row < Sq else ZERO
                D_i[r] = D[U(bh), U(row)] if row < Sq else ZERO
            # Wait until the Q tile is staged (and, the first time, Kj and Vj).
            cuda.syncthreads()

            for ch in range(Br // V7_CHUNK):
                r0 = ch * V7_CHUNK              # first query of the chunk within the tile
                # Alg.2 l.10, l.13: S^T = Kj Qi^T and dP^T = Vj dOi^T, one mma per
                # 16 x 8 x 16 block: exact products of the inputs, float32 sums.
                for nt in range(NT):
                    s4 = (ZERO, ZERO, ZERO, ZERO)
                    p4 = (ZERO, ZERO, ZERO, ZERO)
                    at = (w0 + g) * ROW + 2 * t             # A: Kj[g, 2t..], Vj[g, 2t..]
                    bt = (r0 + nt * 8 + g) * ROW + 2 * t    # B[k, n] = Qi[n, k]: query g
                    for ks in range(KS):
                        a = at + 16 * ks
                        b = bt + 16 * ks
                        s4 = mma(load_b32(Kj, U(a)), load_b32(Kj, U(a + 8 * ROW)),
                                 load_b32(Kj, U(a + 8)), load_b32(Kj, U(a + 8 * ROW + 8)),
                                 load_b32(Qi, U(b)), load_b32(Qi, U(b + 8)),
                                 s4[0], s4[1], s4[2], s4[3])
                        p4 = mma(load_b32(Vj, U(a)), load_b32(Vj, U(a + 8 * ROW)),
                                 load_b32(Vj, U(a + 8)), load_b32(Vj, U(a + 8 * ROW + 8)),
                                 load_b32(dOi, U(b)), load_b32(dOi, U(b + 8)),
                                 p4[0], p4[1], p4[2], p4[3])
                    for x in range(4):
                        s[nt * 4 + x] = s4[x]
                        dp[nt * 4 + x] = p4[x]
                # Alg.2 l.11, l.14: P^T = exp(scale S^T - L), dS^T = P^T (dP^T - D) in
                # float32, on the visible (key, query) pairs; 0 elsewhere.
                for nt in range(NT):
                    for x in range(4):
                        r = r0 + nt * 8 + 2 * t + x % 2        # query within the tile
                        row = i * Br + r
                        col = key0 + 8 * (x // 2)
                        seen = row < Sq and col < Sk and (not causal
                                                         or col <= row + causal_offset)
                        y = nt * 4 + x
                        p = exp2_approx(s[y] * scale_log2 - L_i[r]) if seen else ZERO
                        dp[y] = p * (dp[y] - D_i[r]) if seen else ZERO
                        s[y] = p
                # Alg.2 l.12, l.16: dVj += P^T dOi and dKj += dS^T Qi (the scale at the
                # end). A: the two n-tiles' accumulators, P^T and dS^T rounded to the
                # input type (pack2); B: dOi^T and Qi^T rows 8nd + g, queries r0 + 2t..
                pa0 = pack2(s[0], s[1])
                pa1 = pack2(s[2], s[3])
                pa2 = pack2(s[4], s[5])
                pa3 = pack2(s[6], s[7])
                ga0 = pack2(dp[0], dp[1])
                ga1 = pack2(dp[2], dp[3])
                ga2 = pack2(dp[4], dp[5])
                ga3 = pack2(dp[6], dp[7])
                for nd in range(ND):
                    b = (nd * 8 + g) * TROW + r0 + 2 * t
                    y = nd * 4
                    v4 = mma(pa0, pa1, pa2, pa3, load_b32(dOiT, U(b)), load_b32(dOiT, U(b + 8)),
                             dv[y], dv[y + 1], dv[y + 2], dv[y + 3])
                    k4 = mma(ga0, ga1, ga2, ga3, load_b32(QiT, U(b)), load_b32(QiT, U(b + 8)),
                             dk[y], dk[y + 1], dk[y + 2], dk[y + 3])
                    for x in range(4):
                        dv[y + x] = v4[x]
                        dk[y + x] = k4[x]

        # Write dKj (times the scale) and dVj, rounded to the input type once; a key no
        # query sees has dk = dv = 0 exactly.
        for nd in range(ND):
            for x in range(4):
                col = key0 + 8 * (x // 2)
                k = nd * 8 + 2 * t + x % 2
                if col < Sk and k < d:
                    dK[U(bh), U(col), U(k)] = write_narrow(dk[nd * 4 + x] * softmax_scale)
                    dV[U(bh), U(col), U(k)] = write_narrow(dv[nd * 4 + x])

    return backward_dkdv_v7


@functools.lru_cache(maxsize=None)
def make_backward_dq_v7(Br, Bc, d, causal, half="float16"):
    """v7 dQ kernel: the mirror image of make_backward_dkdv_v7 (16-bit inputs, float32
    accumulation, d <= 128, finite inputs).

    One block per Q tile i walks the K/V tiles j (as v5's); warp w owns the query rows
    i * Br + 16 w .. + 16, lane (g, t) the rows 16 w + g and 16 w + g + 8. Per chunk of
    V7_CHUNK = 16 keys of Kj (rows = its queries, columns = the chunk's keys):

        S  = Qi Kj^T            A = Qi, B = Kj (row = key g, halves 2t..)
        dP = dOi Vj^T           A = dOi, B = Vj
        P  = exp(scale S - L), dS = P (dP - D)        float32; L, D of the two rows in
                                                      registers
        dQi += dS Kj            A = dS: the two n-tiles' accumulators rounded (pack2);
                                B = Kj^T (row = head dim g, keys 2t..)

    Launch: grid (ceil(Sq / Br), BH), block (2 * Br,); ``dq_v7_shared_bytes`` of dynamic
    shared memory:

        kernel[grid, block, 0, nbytes](Q, K, V, dO, L, D, dQ, softmax_scale, causal_offset)
    """
    from ..ptx import exp2_approx, load_b32  # inline PTX (simulator: simulated.py)

    halves = make_halves(half)
    HALF = halves.storage
    narrow, pack2, mma = halves.narrow, halves.pack2, halves.mma
    write_narrow = _write_narrow(half)
    acc = acc_type("float32")
    ZERO = acc(0)
    LOG2E_ACC = acc(LOG2E)
    assert Br % 16 == 0 and Bc % V7_CHUNK == 0, (Br, Bc)
    THREADS = 2 * Br                        # Br / 16 warps of 32 lanes
    DP = v7_head_dim(d)
    ROW = v7_rows(DP)                       # row length of Qi, dOi, Kj, Vj (halves)
    TROW = v7_rows(Bc)                      # row length of Kj^T (halves)
    KS = DP // 16
    ND = DP // 8
    NT = V7_CHUNK // 8                      # n-tiles over the keys of a chunk
    ACC = ND * 4                            # fragment registers of dQi a lane
    S_FRAGS = NT * 4
    Q_AT, dO_AT, K_AT, V_AT, KT_AT, END = dq_v7_shared_layout(Br, Bc, d)
    kv_tile_range = make_kv_tile_range(Br, Bc, causal, False)

    @cuda.jit(**jit_options())
    def backward_dq_v7(Q, K, V, dO, L, D, dQ, softmax_scale, causal_offset):
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
        scale_log2 = softmax_scale * LOG2E_ACC  # exp(x) = exp2(x log2(e))
        HZERO = narrow(ZERO)        # (a 16-bit constant from outside is invalid NVVM IR)

        smem = cuda.shared.array(0, HALF, alignment=16)
        Qi = smem[Q_AT:dO_AT]                   # (Br, ROW)
        dOi = smem[dO_AT:K_AT]                  # (Br, ROW)
        Kj = smem[K_AT:V_AT]                    # (Bc, ROW)
        Vj = smem[V_AT:KT_AT]                   # (Bc, ROW)
        KjT = smem[KT_AT:END]                   # (DP, TROW): Kj transposed
        dq = cuda.local.array(ACC, acc)         # dQi fragments (C layout)
        s = cuda.local.array(S_FRAGS, acc)      # S, then P, of a chunk
        dp = cuda.local.array(S_FRAGS, acc)     # dP, then dS
        Lr = cuda.local.array(2, acc)           # L * log2(e) and D of this lane's two rows
        Dr = cuda.local.array(2, acc)

        # Alg.2 l.8 (the dQ pass): stage Qi and dOi once (zeros past Sq and past d).
        for idx in range(tid, Br * DP, THREADS):
            r = idx // DP
            k = idx % DP
            row = i * Br + r
            inside = row < Sq and k < d
            Qi[U(r * ROW + k)] = Q[U(bh), U(row), U(k)] if inside else HZERO
            dOi[U(r * ROW + k)] = dO[U(bh), U(row), U(k)] if inside else HZERO
        for h in range(2):
            row = row0 + 8 * h
            Lr[h] = L[U(bh), U(row)] * LOG2E_ACC if row < Sq else ZERO
            Dr[h] = D[U(bh), U(row)] if row < Sq else ZERO
        for x in range(ACC):
            dq[x] = ZERO

        j_start, j_end = kv_tile_range(i, Sk, causal_offset, 0)  # causal: skip hidden tiles
        for j in range(j_start, j_end):
            # Wait until every warp has finished reading the previous Kj, Vj and Kj^T (on
            # the first pass: nothing to wait for; the barrier below covers Qi, dOi).
            cuda.syncthreads()
            # Alg.2 l.6: stage Kj (as rows and transposed) and Vj (zeros past Sk and d).
            for idx in range(tid, Bc * DP, THREADS):
                c = idx // DP
                k = idx % DP
                col = j * Bc + c
                inside = col < Sk and k < d
                kv = K[U(bh), U(col), U(k)] if inside else HZERO
                Kj[U(c * ROW + k)] = kv
                KjT[U(k * TROW + c)] = kv
                Vj[U(c * ROW + k)] = V[U(bh), U(col), U(k)] if inside else HZERO
            # Wait until the K/V tile is staged (and, the first time, Qi and dOi).
            cuda.syncthreads()

            for ch in range(Bc // V7_CHUNK):
                c_0 = ch * V7_CHUNK             # first key of the chunk within the tile
                # Alg.2 l.10, l.13: S = Qi Kj^T and dP = dOi Vj^T, one mma per block.
                for nt in range(NT):
                    s4 = (ZERO, ZERO, ZERO, ZERO)
                    p4 = (ZERO, ZERO, ZERO, ZERO)
                    at = (w0 + g) * ROW + 2 * t             # A: Qi[g, 2t..], dOi[g, 2t..]
                    bt = (c_0 + nt * 8 + g) * ROW + 2 * t   # B[k, n] = Kj[n, k]: key g
                    for ks in range(KS):
                        a = at + 16 * ks
                        b = bt + 16 * ks
                        s4 = mma(load_b32(Qi, U(a)), load_b32(Qi, U(a + 8 * ROW)),
                                 load_b32(Qi, U(a + 8)), load_b32(Qi, U(a + 8 * ROW + 8)),
                                 load_b32(Kj, U(b)), load_b32(Kj, U(b + 8)),
                                 s4[0], s4[1], s4[2], s4[3])
                        p4 = mma(load_b32(dOi, U(a)), load_b32(dOi, U(a + 8 * ROW)),
                                 load_b32(dOi, U(a + 8)), load_b32(dOi, U(a + 8 * ROW + 8)),
                                 load_b32(Vj, U(b)), load_b32(Vj, U(b + 8)),
                                 p4[0], p4[1], p4[2], p4[3])
                    for x in range(4):
                        s[nt * 4 + x] = s4[x]
                        dp[nt * 4 + x] = p4[x]
                # Alg.2 l.11, l.14: P and dS = P (dP - D) in float32 on the visible
                # (row, key) pairs; 0 elsewhere (a row that sees no key: all 0).
                for nt in range(NT):
                    for x in range(4):
                        h = x // 2
                        row = row0 + 8 * h
                        col = j * Bc + c_0 + nt * 8 + 2 * t + x % 2
                        seen = row < Sq and col < Sk and (not causal
                                                         or col <= row + causal_offset)
                        y = nt * 4 + x
                        p = exp2_approx(s[y] * scale_log2 - Lr[h]) if seen else ZERO
                        dp[y] = p * (dp[y] - Dr[h]) if seen else ZERO
                # Alg.2 l.15: dQi += dS Kj (the scale at the end); A: dS rounded to the
                # input type (pack2); B: Kj^T rows 8nd + g, keys c_0 + 2t..
                ga0 = pack2(dp[0], dp[1])
                ga1 = pack2(dp[2], dp[3])
                ga2 = pack2(dp[4], dp[5])
                ga3 = pack2(dp[6], dp[7])
                for nd in range(ND):
                    b = (nd * 8 + g) * TROW + c_0 + 2 * t
                    y = nd * 4
                    q4 = mma(ga0, ga1, ga2, ga3, load_b32(KjT, U(b)), load_b32(KjT, U(b + 8)),
                             dq[y], dq[y + 1], dq[y + 2], dq[y + 3])
                    for x in range(4):
                        dq[y + x] = q4[x]

        # Write dQi (times the scale), rounded to the input type once; a row that sees
        # no key has dq = 0 exactly.
        for nd in range(ND):
            for x in range(4):
                row = row0 + 8 * (x // 2)
                k = nd * 8 + 2 * t + x % 2
                if row < Sq and k < d:
                    dQ[U(bh), U(row), U(k)] = write_narrow(dq[nd * 4 + x] * softmax_scale)

    return backward_dq_v7


# --- the launch contract ------------------------------------------------------------

# Tile rule, per kernel: the first (Br, Bc) of BWD_V7_CANDIDATES whose kernel fits
# BWD_V7_SHARED_MEM_TARGET (99 KB: what RTX 30 and 40 cards allow a block; two blocks per
# H200 SM), or the device's own maximum if that is lower. At d = 64 both kernels take
# (64, 64): dK/dV 54.5 KB, dQ 45 KB; at d = 128 dK/dV (32, 64), 71.25 KB (its (64, 64)
# needs 104.5 KB), dQ (64, 64), 86 KB. No sweep is recorded: a rule that fits, not one
# measured fastest. A caller's tiles: (Br, Bc) for both kernels, or ((Br, Bc), (Br, Bc)) for
# the dK/dV kernel and the dQ kernel; Br and Bc multiples of 16 up to 256 (warps of 16
# rows, chunks of V7_CHUNK), within 227 KB.
BWD_V7_CANDIDATES = ((64, 64), (32, 64), (64, 32), (32, 32), (16, 32), (16, 16))
BWD_V7_SHARED_MEM_TARGET = 99 * 1024
# On the simulator (kernels/simulated.py), small tiles: each kernel owns 32 rows (two
# warps; every mma is a rendezvous of a warp's 32 Python threads) and streams tiles of
# 16, so that the simulator's short sequences cross a few tile boundaries (as v6).
BWD_V7_SIM = {"dkdv": (16, 32), "dq": (32, 16)}
BWD_V7_MAX_HEAD_DIM = 128     # dKj, dVj and dQi fragments (d / 2 each a lane) in registers
SHARED_BYTES = {"dkdv": dkdv_v7_shared_bytes, "dq": dq_v7_shared_bytes}

VARIANTS = False              # plain attention only (causal in both alignments)
TILE_TABLE = False
BFLOAT16 = True               # reads bfloat16 inputs itself (numbaflash/dtypes.py)


def refusal(p, where):
    """Why backward v7 cannot run Problem ``p`` here (its dtype or head dim), or None."""
    if p.dtype.name not in NAMES:
        other = "v3" if p.dtype.name == "float64" else "v6 or v4"
        return (f"v7 multiplies float16 and bfloat16 inputs on the 16-bit tensor cores; "
                f"{p.dtype} inputs run on {other}")
    if p.d > BWD_V7_MAX_HEAD_DIM:
        return (f"v7 keeps its dK, dV and dQ fragments in registers, which holds head dims "
                f"up to {BWD_V7_MAX_HEAD_DIM}")
    return None


def default_backward_v7_tiles(d, where):
    """The backward v7 tile rule (above): {"dkdv": (Br, Bc), "dq": (Br, Bc)} for ``where``
    (the simulator: BWD_V7_SIM); ValueError if no candidate fits (kernels/plan.py)."""
    candidates = {"dkdv": BWD_V7_CANDIDATES, "dq": BWD_V7_CANDIDATES}   # one list for both
    return rule_per_kernel_tiles("v7", d, where, candidates, SHARED_BYTES,
                                 BWD_V7_SHARED_MEM_TARGET, BWD_V7_SIM)


def check_backward_v7_tiles(tiles, d):
    """A caller's backward v7 tiles: (Br, Bc) for both kernels, or ((Br, Bc), (Br, Bc)) for
    the dK/dV kernel and the dQ kernel. Returns {"dkdv": ..., "dq": ...}; ValueError names
    the limit (kernels/plan.py)."""
    return check_per_kernel_tiles("v7", tiles, d, SHARED_BYTES, V7_CHUNK)


def plan(p, where, tiles, reason, preprocess):
    """The Plans of backward v7 for Problem ``p``: D, then dK/dV with grid (Tc, BH) and
    2 Bc threads, then dQ with grid (Tr, BH) and 2 Br threads, both with dynamic shared
    memory, each kernel its own tiles. ValueError for float32 and float64 inputs, d > 128
    and every variant (window, GQA, softcap, ALiBi, masks, score_mod, dropout, varlen)."""
    refuse_backward_variants("v7", p)
    why = refusal(p, where)
    if why is not None:
        raise ValueError(f"backward v7 cannot run this input: {why}")
    if tiles is None:
        per_kernel = default_backward_v7_tiles(p.d, where)
        reason += f"; tiles by the v7 rule for d={p.d} (each kernel its own)"
    else:
        per_kernel = check_backward_v7_tiles(tiles, p.d)
        reason += "; tiles given by the caller"
    reason += ("; 16-bit tensor cores (m16n8k16, float32 sums; P and dS rounded to the "
               "input type for their products); finite inputs only (checked before the "
               "launch)")
    if p.dtype.name == "bfloat16":
        reason += "; reads the bfloat16 inputs as their bits"
        preprocess = replace(preprocess,
                             reason=preprocess.reason + "; dO and O read as bfloat16 bits")
    Br, Bc = per_kernel["dkdv"]
    dkdv = Plan("backward dK dV", "v7", "backward_dkdv_v7", where, Br, Bc,
                (math.ceil(p.Sk / Bc), p.BH), (2 * Bc,), dkdv_v7_shared_bytes(Br, Bc, p.d),
                p.acc_dtype, p.causal, reason + "; one block per K/V tile, each warp 16 keys",
                dynamic_shared=True)
    Br, Bc = per_kernel["dq"]
    dq = Plan("backward dQ", "v7", "backward_dq_v7", where, Br, Bc,
              (math.ceil(p.Sq / Br), p.BH), (2 * Br,), dq_v7_shared_bytes(Br, Bc, p.d),
              p.acc_dtype, p.causal, reason + "; one block per Q tile, each warp 16 query rows",
              dynamic_shared=True)
    return Plans((preprocess, dkdv, dq))


def kernel(plan, p):
    """The compiled kernel of one of v7's plans (cached per compile-time parameters), for
    the Problem's input type (float16, or bfloat16 read as bits)."""
    make = {"backward_dkdv_v7": make_backward_dkdv_v7,
            "backward_dq_v7": make_backward_dq_v7}[plan.kernel]
    return make(plan.Br, plan.Bc, p.d, p.upper, p.dtype.name)
