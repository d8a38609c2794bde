"""Forward v8: v6 with the next chunk's scores issued before this chunk's softmax.

Parent: v6 (v6_split_once.py). Each chunk's online softmax is a chain of dependent steps,
and with two warps per scheduler the tensor cores idled while it ran. v8 starts the next
chunk's S = Qi Kj^T before this chunk's softmax, so that the scheduler has independent
mma to issue between the softmax's steps; with Qi in shared memory (d > 64) it reads
each Qi fragment once per chunk, and takes 32-key chunks there (v8_chunk). The same
operations on the same values: for the same chunk, its results are v6's bit for bit.

What it buys: (2, 16, 4096, d), float32, ms not causal / causal: d = 64, 5.50 / 3.28
against v6's 6.04 / 3.65 (lab/runs/2026-12-01/50_v8_sweep.txt); d = 128, 11.24 / 6.61
against 13.51 / 7.63 (lab/runs/2026-12-01/52_v8_sweep.txt). In the bench, 0.729x SDPA
EFFICIENT at (2, 16, 4096, 64) (lab/runs/2026-12-01/65_bench.txt). Still two warps per
scheduler, issuing in 38 % of cycles (lab/runs/2026-12-01/54_v8_ncu_d64.txt).

Inline PTX and warp shuffles on a GPU; on the simulator kernels/simulated.py's stand-ins
(the default there stays v5). d <= 128; takes every variant, as v6 does (kernels/variants.py;
make_forward_v6 says how): the default for plain float32 attention with d <= 64 on a GPU
(v9 above).

Packed batches: the packed arrays as they are (kernels/sequences.py's packed rows, as
forward v10), on a (tiles, heads, batch) grid. flash-attn's (b, s, h, d) layout is such a
batch of equal lengths (numbaflash.torch.flash_attn_func; its cost against (b, h, s, d):
docs/pytorch.md).
"""

import functools
import math

from numba import cuda, int32

from .. import acc_type, jit_options
from ..bands import make_kv_tile_range
from ..sequences import make_sequences
from ..variants import PLAIN
from .mma_rows import make_mma_row_steps
from .v6_split_once import plan_warps, refusal as v6_refusal, v6_shared_bytes
from .v6_tile_steps import (
    V6_CHUNK, V6_LOAD_BATCH, V6_Q_REGISTERS_MAX_DP, make_v6_tile_steps, v6_shared_layout,
    v6_staging_width
)


@functools.lru_cache(maxsize=None)
def make_forward_v8(Br, Bc, d, causal, chunk=V6_CHUNK, max_registers=None, variant=PLAIN,
                    gqa=False, equal_lengths=False):
    """v8: v6 with the scores of the next chunk computed while this chunk's softmax runs
    (float32 accumulation, float16 and float32 inputs, d <= 128; the same
    arguments, launch and shared memory as v6, and for the same ``chunk`` the same
    results, bit for bit).

    What changes against v6 is the order of the work, nothing else:

    * The next chunk's S first. v6 does each chunk's steps one after the other: S = Qi
      Kj^T on the tensor cores, then the online softmax, then P~ Vj. The softmax is a
      chain of dependent steps (scale, the quad's max by shuffles, exp2, the sums), and
      with only two warps per scheduler (v6: 172 registers a thread, one block of eight
      warps per SM, lab/runs/2026-12-01/32_v6_ncu.txt) the tensor cores wait while it
      runs. v8 starts
      the next chunk's S before this chunk's softmax: its mma depend on nothing the
      softmax computes, so the scheduler can issue them between the softmax's steps.
      It costs the registers of a second S (chunk / 2 a lane, and its accumulators
      while it is summed); at one block per SM, registers up to 255 a thread cost no
      occupancy. Each tile's first chunk is computed before the loop; the last has no
      next.
    * With Qi in shared memory (d > 64), each Qi fragment is read once per chunk
      (``scores_q_once``: the head dim outside, the n-tiles inside) instead of once per
      n-tile. Every score's sum still runs over the head dim in the same order.

    Its plans give it 32-key chunks at d > 64 (v8_chunk), where v6 takes 16-key chunks:
    there v8's default results differ from v6's default by rounding (the online softmax
    takes other steps), and equal v6's bit for bit with v6 at 32-key chunks.

    ``variant``: masks and score modifiers, with the run-time arguments and costs of
    make_forward_v6's (GQA staging, band and tile-table skips, the per-entry steps of
    make_mma_row_steps; ``gqa`` as there); with ``PLAIN`` the plain kernel, bit for bit.
    Registers at d = 64, (128, 64) tiles (CUDA 13.5's ptxas for sm_90, not yet timed on a
    GPU): plain 179, causal 244, no spills (as before variants); a bias 246; causal with
    window, softcap, ALiBi and a bool mask 255 and 88 bytes of spill stores; causal GQA
    255 and 132; dropout (make_mma_row_steps' ``drop``) alone 240, no spills, with
    causal 255 and 64 bytes of spill stores, and with window, softcap, ALiBi, a bool mask
    and GQA as without dropout (255, 12 bytes).

    ``equal_lengths`` (with ``variant.varlen``): a packed batch of equal lengths, ``seqs``
    the pair (nq, nk) (kernels/sequences.py), so that a block's first rows and its mask's
    shift are the same in every lane. A lab build, never planned: it is no faster. At
    (2, 4096, 16, 64) on an H100, queued, causal, it takes 1.095x the plain build's time
    where the packed build reading cu_seqlens takes 1.073x, and 0.917x against 0.906x
    without the mask (lab/sweeps/v8_packed_causal_time.py,
    lab/runs/2026-12-07/159_v8_packed_causal_time.txt). ptxas for sm_90 at d = 64,
    (128, 64): 244 registers not causal and 249 causal, where the build reading
    cu_seqlens takes 183 and 244.
    """
    acc = acc_type("float32")
    ZERO = acc(0)
    NEG_INF = acc(-math.inf)
    assert Br % 16 == 0 and chunk % 8 == 0 and Bc % chunk == 0, (Br, Bc, chunk)
    CHUNK = chunk
    NCH = Bc // CHUNK                       # chunks of a tile
    DP = (d + 7) // 8 * 8
    KS = DP // 8
    QO_FRAGS = KS * 4
    S_FRAGS = CHUNK // 8 * 4
    Q_FRAGS = QO_FRAGS if DP <= V6_Q_REGISTERS_MAX_DP else 1
    assert 2 * Br % v6_staging_width(d) == 0, (Br, d)
    layout = v6_shared_layout(Br, Bc, d)
    KP_AT, VP_AT, QP_AT, END = layout.KP_AT, layout.VP_AT, layout.QP_AT, layout.END
    TILE_TABLE = variant.tile_table
    GQA = gqa
    kv_tile_range = make_kv_tile_range(Br, Bc, causal, variant.window)
    rows = make_mma_row_steps(d, causal, CHUNK, KS, variant, rows=variant.varlen)
    add_nonfinite_scores, softmax_step = rows.add_nonfinite_scores, rows.softmax_step
    add_nonfinite_values, write_rows = rows.add_nonfinite_values, rows.write_rows
    drop = rows.drop
    whole_tile_seen = rows.whole_tile
    steps = make_v6_tile_steps(Br, Bc, d, CHUNK, variant.varlen, rows=variant.varlen)
    load_q, stage_kv, scores, values = steps.load_q, steps.stage_kv, steps.scores, steps.values
    scores_q_once = steps.scores_q_once
    Q_REGS = DP <= V6_Q_REGISTERS_MAX_DP

    @cuda.jit(device=True, inline=True)
    def next_scores(sn, se, sf, qb, qs, QP, KP, key0, r0, g, t):
        """The S of the chunk at key0, into sn: with Qi in registers as v6, else with
        each Qi fragment read once per chunk (scores_q_once)."""
        if Q_REGS:
            scores(sn, qb, qs, QP, KP, key0, r0, g, t)
        else:
            scores_q_once(sn, se, sf, QP, KP, key0, r0, g, t)

    options = jit_options()
    if max_registers:
        options["max_registers"] = max_registers

    VARLEN = variant.varlen
    sequences = make_sequences(VARLEN, equal=equal_lengths)
    locate, uniform_range = sequences.locate, sequences.uniform_range

    @cuda.jit(**options)
    def forward_v8(Q, K, V, O, L, softmax_scale, causal_offset, window_lo, Hq, group, softcap,
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

        smem = cuda.shared.array(0, acc, alignment=16)     # as v6
        KP = smem[KP_AT:VP_AT]
        VP = smem[VP_AT:QP_AT]
        QP = smem[QP_AT:END]
        bad = cuda.shared.array(3, int32)
        qb = cuda.local.array(Q_FRAGS, acc)
        qs = cuda.local.array(Q_FRAGS, acc)
        o = cuda.local.array(QO_FRAGS, acc)
        s = cuda.local.array(S_FRAGS, acc)      # this chunk's S, then P~
        sn = cuda.local.array(S_FRAGS, acc)     # the next chunk's S (v8)
        se = cuda.local.array(S_FRAGS, acc)     # its small products (with Qi in QP)
        sf = cuda.local.array(S_FRAGS, acc)
        pb = cuda.local.array(S_FRAGS, acc)
        ps = cuda.local.array(S_FRAGS, acc)
        kx = cuda.local.array(V6_LOAD_BATCH, acc)
        vx = cuda.local.array(V6_LOAD_BATCH, acc)

        if tid == 0:
            bad[0] = 0
            bad[1] = 0
            bad[2] = 0
        cuda.syncthreads()
        load_q(Q, QP, qb, qs, bad, bh, i, row0, row1, t, tid, Sq, q0)      # Alg.1 l.4
        for x in range(QO_FRAGS):
            o[x] = ZERO
        m0 = NEG_INF
        m1 = NEG_INF
        l0 = ZERO
        l1 = ZERO

        j_start, j_end = kv_tile_range(i, Sk, causal_offset, window_lo)     # as v6
        if VARLEN:
            j_start, j_end = uniform_range(j_start, j_end)  # packed: known uniform
        for j in range(j_start, j_end):
            if TILE_TABLE and not tiles[bh, i, j]:
                continue                # the mask leaves this tile empty (the whole block)
            mark = int32(j + 1)
            # The barriers, flags and masks of v6. No S of the next tile is computed
            # early: its Kj is staged only after the first barrier below.
            cuda.syncthreads()
            stage_kv(K, V, KP, VP, kx, vx, bad, bh_kv, j, tid, Sk, k0)       # Alg.1 l.7
            cuda.syncthreads()
            fix_scores = bad[0] != 0 or bad[1] == mark
            fix_values = bad[2] == mark
            whole_tile = whole_tile_seen(i * Br, i * Br + Br - 1, j * Bc, j * Bc + Bc - 1, Sk,
                                         causal_offset, window_lo)

            next_scores(sn, se, sf, qb, qs, QP, KP, 0, r0, g, t)    # Alg.1 l.8, first chunk
            for ch in range(NCH):
                key0 = ch * CHUNK
                for x in range(S_FRAGS):
                    s[x] = sn[x]
                if fix_scores:
                    add_nonfinite_scores(s, Q, K, bh, bh_kv, k0 + j * Bc + key0, q0 + row0,
                                         t, q0 + Sq, k0 + Sk)
                # Alg.1 l.8 for the next chunk, before this chunk's softmax (v8's change).
                if ch + 1 < NCH:
                    next_scores(sn, se, sf, qb, qs, QP, KP, key0 + CHUNK, r0, g, t)
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

    return forward_v8


# --- the launch contract: v6's, with its own chunk -----------------------------------

VARIANTS = True                # as v6
TILE_TABLE = True
PACKED_ROWS = True             # a packed batch read as it is (kernels/sequences.py)


def v8_chunk(d, Bc):
    """Keys per online-softmax step of forward v8: 32 where Qi is staged in shared memory
    (d > 64, V6_Q_REGISTERS_MAX_DP) and Bc is a multiple of 32, else v6's 16.
    Measured (lab/sweeps/v6_sweep.py --configs, lab/runs/2026-12-01/52_v8_sweep.txt,
    (2, 16, 4096, 128), (128, 32) tiles, ms not causal / causal): v8 with 32-key chunks
    11.24 / 6.61, with 16-key chunks 12.56 / 7.21; v6 13.08 / 7.25 and 13.51 / 7.63. With Qi in registers (d <= 64) a
    32-key chunk of v8 spills (CUDA 13.5's ptxas: 255 registers and 36 bytes stored at
    (128, 64)), so it stays at 16."""
    wide = d > V6_Q_REGISTERS_MAX_DP and Bc % 32 == 0
    return 32 if wide else V6_CHUNK


def refusal(p, where):
    """Why forward v8 cannot run Problem ``p`` here, or None if it can (v6's limits)."""
    return v6_refusal(p, where, "v8")


def plan(p, where, tiles, reason):
    """The Plan of forward v8 for Problem ``p``: v6's tiles, launch and shared memory."""
    return plan_warps(p, where, tiles, reason, "v8", refusal(p, where), v6_shared_bytes,
                      v8_chunk, packed_rows=True)


def kernel(plan, p):
    """The compiled kernel of ``plan`` (cached per compile-time parameters)."""
    return make_forward_v8(plan.Br, plan.Bc, p.d, p.upper, v8_chunk(p.d, plan.Bc),
                           variant=p.variant, gqa=p.group > 1)
