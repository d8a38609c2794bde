"""Forward v9: v8 with the next K/V tile copied asynchronously (cp.async).

Parent: v8 (v8_reordered.py), whose eight warps wait together at every K/V tile, first
at a barrier and then for their loads. In v9, while the block computes tile j, each
thread's copies of tile j + 1 travel from global to shared memory by cp.async
(ptx.cp_async: no register, no wait); at the next tile it waits for its own copies and
splits them as v6 does. At d > 64 Qi is kept plain and split as read, which makes room
for the landing slots. The same values into the same operations: v8's results, bit for
bit.

What it buys: (2, 16, 4096, d), float32, ms not causal / causal: d = 128, 10.11 / 5.74
against v8's 10.92 / 6.08; d = 64, no gain, and a loss with the mask (5.41 / 3.76
against 5.43 / 3.15, at 255 registers) (lab/runs/2026-12-01/60_v9_sweep.txt). In the bench, 0.621x SDPA EFFICIENT at
(2, 16, 4096, 128) (lab/runs/2026-12-01/65_bench.txt).

Inline PTX, warp shuffles and cp.async on a GPU (sm_80 and later); on the simulator
kernels/simulated.py's stand-ins (the default there stays v5). Float32 inputs, d <= 128;
takes every variant, as v6 does (kernels/variants.py; make_forward_v6 says how), the copies
going to the next tile the block visits: the default for plain float32 attention with
64 < d <= 128 on a GPU (numbaflash/policy.py, V9_MIN_HEAD_DIM). Packed batches as v8
reads them (packed rows, (tiles, heads, batch) grid).
"""

import functools
import math
from collections import namedtuple

import numpy as np
from numba import cuda, int32

from .. import acc_type, jit_options
from ..bands import make_kv_tile_range
from ..sequences import make_packed_rows, make_sequences
from ..smem import U
from ..variants import PLAIN
from .mma_rows import make_mma_row_steps
from .v6_split_once import plan_warps, refusal as v6_refusal
from .v6_tile_steps import (
    V6_CHUNK, V6_Q_REGISTERS_MAX_DP, make_v6_tile_steps, v6_shared_layout, v6_staging_width
)
from .v8_reordered import v8_chunk

# What v9_shared_layout returns, by name.
V9Layout = namedtuple("V9Layout", "KP_AT VP_AT QT_AT RK_AT RV_AT END Q_ROW")


def v9_shared_layout(Br, Bc, d):
    """Where forward v9's tiles sit in its one dynamic float32 array: (KP_AT, VP_AT, QT_AT,
    RK_AT, RV_AT, END, Q_ROW). KP and VP are v6's (Kj and Vj as split pairs, rows of
    v6_shared_layout's K_ROW and V_ROW). QT is Qi as plain float32 values, Br rows of
    Q_ROW = DP + 4 (conflict-free fragment reads, as backward v5's tiles), present only
    when Qi does not stay in registers (DP > V6_Q_REGISTERS_MAX_DP). RK and RV are the
    landing places of the asynchronous copies of the next Kj and Vj, Bc rows of d floats
    each. ``v9_shared_bytes`` is END * 4."""
    DP = (d + 7) // 8 * 8
    v6 = v6_shared_layout(Br, Bc, d)     # v6's KP and VP first
    KP_AT, VP_AT, QT_AT = v6.KP_AT, v6.VP_AT, v6.QP_AT
    Q_ROW = DP + 4
    RK_AT = QT_AT + (0 if DP <= V6_Q_REGISTERS_MAX_DP else Br * Q_ROW)
    RV_AT = RK_AT + Bc * d
    END = RV_AT + Bc * d
    return V9Layout(KP_AT, VP_AT, QT_AT, RK_AT, RV_AT, END, Q_ROW)


@functools.lru_cache(maxsize=None)
def make_forward_v9(Br, Bc, d, causal, chunk=V6_CHUNK, max_registers=None, variant=PLAIN,
                    gqa=False):
    """v9: v8 with the next K/V tile copied into shared memory while this one is used
    (sm_80 and later on a GPU; float32 inputs, d <= 128; for the same ``chunk`` the
    same results as v8 and v6, bit for bit).

    What it addresses: v8 runs one block of eight warps per SM
    (lab/runs/2026-12-01/54_v8_ncu_d64.txt), and at every K/V tile all eight wait together, first at a barrier and then for
    their loads from global memory (V6_LOAD_BATCH at a time, held in registers) before
    any can compute. v9 changes how a tile arrives, nothing else:

    * Asynchronous copies. ``cp.async`` (ptx.cp_async) copies an element from global
      to shared memory without passing through a register and without waiting. While
      the block computes tile j, each thread has the elements of tile j + 1 that it will
      split already on their way into RK and RV (plain float32, one slot per element).
      At the next tile it waits for its own copies (ptx.cp_async_wait_all), splits them
      into KP and VP as v6 does (the same finite checks and zeros past Sk and d), and
      starts the copies of the tile after. A thread reads only the slots it copied
      itself, so the wait needs no barrier; the two barriers per tile are v6's.
    * At d > 64, Qi plain. v6 and v8 keep Qi in shared memory as split pairs (135 KB at
      (128, 32) and d = 128); v9 keeps it as plain float32 values (68 KB) and splits each
      fragment as it reads it, once per chunk (v8 reads each fragment once per chunk
      too): that makes room for RK and RV.

    What it bought (lab/runs/2026-12-01/60_v9_sweep.txt, (2, 16, 4096, d), ms not causal
    / causal): at d = 128 10.11 / 5.74 against v8's 10.92 / 6.08; at d = 64 5.41 / 3.76
    against 5.43 / 3.15 (255 registers; CUDA 13.5's ptxas spills it), so the loads' wait
    is not what holds v8 back at d = 64, and the policy runs v9 from d = 65 on only
    (numbaflash/policy.py, V9_MIN_HEAD_DIM).

    Float32 inputs only: a copy moves 4 bytes unchanged (float16 inputs run v7 or v8).
    ``chunk`` and ``max_registers`` as for v8. Launch: as v6, with
    ``v9_shared_layout(Br, Bc, d).END * 4`` bytes of dynamic shared memory (END).

    ``variant``: masks and score modifiers, with the run-time arguments and costs of
    make_forward_v6's (``gqa`` as there); with a tile table, the copies started during a tile are those of
    the next tile the table marks non-empty (``next_tile``: a walk along a row of the
    table, once per visited tile). With ``PLAIN`` the plain kernel, bit for bit.
    """
    from ..ptx import cp_async, cp_async_wait_all  # inline PTX (simulator: simulated.py)
    from ..ptx import split_tf32_finite as split_finite
    from ..ptx import store_pair

    acc = acc_type("float32")
    ZERO = acc(0)
    NEG_INF = acc(-math.inf)
    assert Br % 16 == 0 and chunk % 8 == 0 and Bc % chunk == 0, (Br, Bc, chunk)
    CHUNK = chunk
    NCH = Bc // CHUNK
    THREADS = 2 * Br
    DP = (d + 7) // 8 * 8
    KS = DP // 8
    NT = CHUNK // 8
    QO_FRAGS = KS * 4
    S_FRAGS = NT * 4
    Q_REGS = DP <= V6_Q_REGISTERS_MAX_DP
    Q_FRAGS = QO_FRAGS if Q_REGS else 1
    W = v6_staging_width(d)
    assert 2 * Br % W == 0, (Br, d)
    RSTEP = THREADS // W
    v6 = v6_shared_layout(Br, Bc, d)
    K_ROW, V_ROW = v6.K_ROW, v6.V_ROW
    KP_AT, VP_AT, QT_AT, RK_AT, RV_AT, END, Q_ROW = v9_shared_layout(Br, Bc, d)
    TILE_TABLE = variant.tile_table
    GQA = gqa
    kv_tile_range = make_kv_tile_range(Br, Bc, causal, variant.window)
    VARLEN = variant.varlen
    rows = make_mma_row_steps(d, causal, CHUNK, KS, variant, rows=VARLEN)
    add_nonfinite_scores, softmax_step = rows.add_nonfinite_scores, rows.softmax_step
    add_nonfinite_values, write_rows = rows.add_nonfinite_values, rows.write_rows
    drop = rows.drop
    whole_tile_seen = rows.whole_tile
    sequences = make_sequences(VARLEN)
    locate, uniform_range = sequences.locate, sequences.uniform_range
    position = make_packed_rows(VARLEN).position     # packed: (total, heads, d) as it is
    steps = make_v6_tile_steps(Br, Bc, d, CHUNK, VARLEN, rows=VARLEN)
    load_q, scores, values = steps.load_q, steps.scores, steps.values
    finite_or_zero, load_finite = steps.finite_or_zero, steps.load_finite
    scores_head_dim_outside = steps.scores_head_dim_outside

    @cuda.jit(device=True, inline=True)
    def next_tile(tiles, bh, i, j, j_end):
        """The first K/V tile from j on that the block visits: j itself, or with a tile
        table the first the table marks non-empty (j_end if none is left)."""
        if TILE_TABLE:
            while j < j_end and not tiles[bh, i, j]:
                j += 1
        return j

    @cuda.jit(device=True, inline=True)
    def copy_kv(K, V, RK, RV, bh_kv, j, tid, Sk, k_first):
        """Start the copies of this thread's elements of Kj and Vj (K/V head bh_kv;
        column tid % W, rows tid // W + RSTEP n, as v6's staging) into RK and RV; none
        past Sk or d. ``k_first``: the sequence's first row in a packed K, V (else 0)."""
        k_own = tid % W
        c = tid // W
        if k_own < d:
            while c < Bc and j * Bc + c < Sk:
                at = position(K, bh_kv, k_first + j * Bc + c, Sk, d) + k_own
                cp_async(RK, U(c * d + k_own), K, U(at))
                cp_async(RV, U(c * d + k_own), V, U(at))
                c += RSTEP

    @cuda.jit(device=True, inline=True)
    def split_kv(RK, RV, KP, VP, bad, j, tid, Sk):
        """Alg.1 l.7, second half: this thread's copied elements of Kj and Vj, split into
        KP and VP as v6's stage_kv does (0 past Sk and d; a non-finite one staged as 0,
        raising bad[1] or bad[2] to j + 1)."""
        mark = int32(j + 1)
        k_own = tid % W
        c = tid // W
        if k_own < DP:
            while c < Bc:
                inside = k_own < d and j * Bc + c < Sk
                kx = RK[U(c * d + k_own)] if inside else ZERO
                vx = RV[U(c * d + k_own)] if inside else ZERO
                big, small = split_finite(finite_or_zero(kx, bad, 1, mark))
                store_pair(KP, U(c * K_ROW + 2 * k_own), big, small)
                big, small = split_finite(finite_or_zero(vx, bad, 2, mark))
                store_pair(VP, U(c * V_ROW + 2 * k_own), big, small)
                c += RSTEP

    @cuda.jit(device=True, inline=True)
    def load_q_plain(Q, QT, bad, bh, i, tid, Sq, q_first):
        """Alg.1 l.4 at d > 64: Qi into QT as float32 values (0 past Sq and d, a
        non-finite one as 0 raising bad[0], as v6's load_q). ``q_first``: the sequence's
        first row in a packed Q (else 0)."""
        idx = tid
        while idx < Br * DP:
            r = idx // DP
            k = idx % DP
            QT[U(r * Q_ROW + k)] = load_finite(Q, bh, q_first + i * Br + r, k, q_first + Sq,
                                               bad, 0, int32(1))
            idx += THREADS

    @cuda.jit(device=True, inline=True)
    def q_plain_fragment(QT, r0, ks, t):
        """Qi's A fragment for head-dim step ks from QT (plain values, rows of Q_ROW),
        split as read: the parts v8 stages (split_tf32_finite equals split_tf32 on the
        finite values staged), so the same bits."""
        qr = r0 * Q_ROW + ks * 8 + t
        a0b, a0s = split_finite(QT[U(qr)])                      # Q[g, 8ks + t]
        a1b, a1s = split_finite(QT[U(qr + 8 * Q_ROW)])          # Q[g + 8, ...]
        a2b, a2s = split_finite(QT[U(qr + 4)])                  # Q[g, ... + 4]
        a3b, a3s = split_finite(QT[U(qr + 8 * Q_ROW + 4)])
        return a0b, a1b, a2b, a3b, a0s, a1s, a2s, a3s

    scores_q_plain = scores_head_dim_outside(q_plain_fragment)    # v8's, Qi read plain

    @cuda.jit(device=True, inline=True)
    def next_scores(sn, se, sf, qb, qs, QT, KP, key0, r0, g, t):
        """The S of the chunk at key0 (v8's next_scores, with Qi plain at d > 64)."""
        if Q_REGS:
            scores(sn, qb, qs, QT, KP, key0, r0, g, t)
        else:
            scores_q_plain(sn, se, sf, QT, KP, key0, r0, g, t)

    options = jit_options()
    if max_registers:
        options["max_registers"] = max_registers

    @cuda.jit(**options)
    def forward_v9(Q, K, V, O, L, softmax_scale, causal_offset, window_lo, Hq, group, softcap,
                   slopes, attn_mask, tiles, seed_lo, seed_hi, keep_threshold, keep_scale, seqs):
        if VARLEN:
            # A packed batch read as it is (kernels/sequences.py): head and sequence
            # from the (tiles, heads, batch) grid, each row index plus the sequence's
            # first row
            h = cuda.blockIdx.y
            b = cuda.blockIdx.z
            bh, bh_kv = h, h
            if GQA:
                bh_kv = h // group
            i = cuda.blockIdx.x
            q0, k0, Sq, Sk, shift = locate(seqs, b, Q.shape[0], K.shape[0])
            if i * Br >= Sq:
                return                  # past this sequence: the whole block, no barrier yet
        else:
            bh = cuda.blockIdx.y                # b * Hq + h: the query head
            b = bh // Hq
            h = bh % Hq
            bh_kv = bh                          # the K/V head this query head reads
            if GQA:
                bh_kv = b * (Hq // group) + h // group
            i = cuda.blockIdx.x
            q0, k0, Sq, Sk, shift = locate(seqs, b, Q.shape[1], K.shape[1])
        causal_offset += shift
        window_lo += shift
        tid = cuda.threadIdx.x
        lane = tid % 32
        g = lane // 4
        t = lane % 4
        r0 = (tid // 32) * 16 + g
        row0 = i * Br + r0
        row1 = row0 + 8

        smem = cuda.shared.array(0, acc, alignment=16)     # v9_shared_layout
        KP = smem[KP_AT:VP_AT]
        VP = smem[VP_AT:QT_AT]
        QT = smem[QT_AT:RK_AT]                  # Qi, plain (d > 64)
        RK = smem[RK_AT:RV_AT]                  # the next Kj as it arrives
        RV = smem[RV_AT:END]
        bad = cuda.shared.array(3, int32)
        qb = cuda.local.array(Q_FRAGS, acc)
        qs = cuda.local.array(Q_FRAGS, acc)
        o = cuda.local.array(QO_FRAGS, acc)
        s = cuda.local.array(S_FRAGS, acc)
        sn = cuda.local.array(S_FRAGS, acc)
        se = cuda.local.array(S_FRAGS, acc)
        sf = cuda.local.array(S_FRAGS, acc)
        pb = cuda.local.array(S_FRAGS, acc)
        ps = cuda.local.array(S_FRAGS, acc)

        j_start, j_end = kv_tile_range(i, Sk, causal_offset, window_lo)     # as v6
        if VARLEN:
            j_start, j_end = uniform_range(j_start, j_end)  # packed: known uniform
        j_first = next_tile(tiles, bh, i, j_start, j_end)
        if j_first < j_end:
            copy_kv(K, V, RK, RV, bh_kv, j_first, tid, Sk, k0)  # the first tile's copies start
        if tid == 0:
            bad[0] = 0
            bad[1] = 0
            bad[2] = 0
        cuda.syncthreads()
        if Q_REGS:
            load_q(Q, QT, qb, qs, bad, bh, i, row0, row1, t, tid, Sq, q0)  # Alg.1 l.4
        else:
            load_q_plain(Q, QT, bad, bh, i, tid, Sq, q0)
        for x in range(QO_FRAGS):
            o[x] = ZERO
        m0 = NEG_INF
        m1 = NEG_INF
        l0 = ZERO
        l1 = ZERO

        for j in range(j_start, j_end):
            if TILE_TABLE and not tiles[bh, i, j]:
                continue                # the mask leaves this tile empty (the whole block)
            mark = int32(j + 1)
            cp_async_wait_all()                 # this thread's elements of tile j are in
            # Wait until every warp has finished reading the previous Kj and Vj.
            cuda.syncthreads()
            split_kv(RK, RV, KP, VP, bad, j, tid, Sk)                       # Alg.1 l.7
            j_next = next_tile(tiles, bh, i, j + 1, j_end)
            if j_next < j_end:                  # v9's change: the next tile's copies start
                copy_kv(K, V, RK, RV, bh_kv, j_next, tid, Sk, k0)
            # Wait until Kj, Vj (and, for j = 0, Qi and bad[0]) are complete.
            cuda.syncthreads()
            fix_scores = bad[0] != 0 or bad[1] == mark
            fix_values = bad[2] == mark
            whole_tile = whole_tile_seen(i * Br, i * Br + Br - 1, j * Bc, j * Bc + Bc - 1, Sk,
                                         causal_offset, window_lo)

            # From here on v8's steps, unchanged.
            next_scores(sn, se, sf, qb, qs, QT, KP, 0, r0, g, t)
            for ch in range(NCH):
                key0 = ch * CHUNK
                for x in range(S_FRAGS):
                    s[x] = sn[x]
                if fix_scores:
                    add_nonfinite_scores(s, Q, K, bh, bh_kv, k0 + j * Bc + key0, q0 + row0,
                                         t, q0 + Sq, k0 + Sk)
                if ch + 1 < NCH:
                    next_scores(sn, se, sf, qb, qs, QT, KP, key0 + CHUNK, r0, g, t)
                alpha0, alpha1, m0, m1, l0, l1 = softmax_step(              # Alg.1 l.9
                    s, softmax_scale, whole_tile, j * Bc + key0, row0, t, b, h, Sq, Sk,
                    causal_offset, window_lo, softcap, slopes, attn_mask, m0, m1, l0, l1)
                # Dropout: P~ = 0 where dropped (l above has every P~)
                drop(s, j * Bc + key0, row0, t, b, h, seed_lo, seed_hi, keep_threshold)
                values(o, s, pb, ps, VP, key0, g, t, alpha0, alpha1)         # Alg.1 l.10
                if fix_values:
                    add_nonfinite_values(o, s, V, bh_kv, j * Bc + key0, row0, row1, g, t, b, h,
                                         Sq, Sk, causal_offset, window_lo, attn_mask, k0)

        write_rows(O, L, o, bh, q0 + row0, q0 + row1, t, m0, m1, l0, l1, q0 + Sq, keep_scale)

    return forward_v9


# --- the launch contract: v6's rule with its own shared memory, v8's chunk -----------

VARIANTS = True                # as v6
TILE_TABLE = True
PACKED_ROWS = True             # a packed batch read as it is (kernels/sequences.py)


def v9_shared_bytes(Br, Bc, d):
    """Dynamic shared memory of forward v9 (v9_shared_layout), float32: v6's K/V pairs,
    Qi plain at d > 64, and the landing places of the next K/V tile."""
    return v9_shared_layout(Br, Bc, d).END * 4


def refusal(p, where):
    """Why forward v9 cannot run Problem ``p`` here, or None: v6's limits, and float32
    inputs only."""
    why = v6_refusal(p, where, "v9")
    if why is None and np.dtype(p.dtype) != np.float32:
        why = ("v9 copies its K/V tiles as float32 elements, unconverted (cp.async), so it "
               f"takes float32 inputs only; {np.dtype(p.dtype)} inputs run on v7 (the "
               "default) or v8")
    return why


def plan(p, where, tiles, reason):
    """The Plan of forward v9 for Problem ``p``."""
    return plan_warps(p, where, tiles, reason, "v9", refusal(p, where), v9_shared_bytes,
                      v8_chunk, packed_rows=True)


def kernel(plan, p):
    """The compiled kernel of ``plan`` (cached per compile-time parameters)."""
    return make_forward_v9(plan.Br, plan.Bc, p.d, p.upper, v8_chunk(p.d, plan.Bc),
                           variant=p.variant, gqa=p.group > 1)
