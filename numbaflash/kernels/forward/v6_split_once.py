"""Forward v6: v3 with each K/V element split once, exact for every input.

Parent: v3 (v3_tensor_cores.py), which splits every K and V operand into TF32 parts
again for every mma, in every warp. v6 splits each element once, while the block stages
the tile, into (big, small) pairs in dynamic shared memory that one 8-byte load fetches;
it stages one column per thread with four loads in flight, keeps three independent sums
per score tile, masks only the edge and diagonal tiles, and uses exp2. A 16-key chunk
takes 659 instructions on the path a finite input takes, against v3's 1162
(lab/sweeps/sass_loops.py). And it is exact for every input, which v3 is not:
non-finite values are staged as 0 and added back in float32 in the rare tiles that hold
one, so NaN and inf land where v1, v2 and the reference put them.

What it buys: (2, 16, 4096, 64), float32, 5.98 ms against v5's 6.75 in the same bench,
0.672x SDPA EFFICIENT; d = 128, 13.25 ms (lab/runs/2026-12-01/32_bench.txt). What holds
it back: 172 registers and one block of eight warps per SM, issue slots busy 38 %, and
the K/V tile loaded while no warp of the block computes
(lab/runs/2026-12-01/32_v6_ncu.txt); v8 and v9 work on the last two.

Inline PTX and warp shuffles on a GPU; on the simulator kernels/simulated.py's stand-ins
(the default there stays v5). Float32 accumulation, d <= 128; takes every variant
(kernels/variants.py: the mask, score and dropout steps are mma_rows.py's, K/V staged
from the query head's K/V head for GQA, band and tile-table skips); opt-in
(version="v6"), its descendants v7, v8 and v9 being the GPU defaults.
"""

import functools
import math

from numba import cuda, int32

from .. import acc_type, jit_options
from ..bands import make_kv_tile_range
from ..plan import (
    TILE_TABLE_REASON, Plan, check_warp_tiles, device_dynamic_shared_limit, here,
    tensor_core_refusal, variant_description
)
from ..sequences import make_sequences
from ..variants import PLAIN
from .mma_rows import make_mma_row_steps
from .v6_tile_steps import (
    V6_CHUNK, V6_LOAD_BATCH, V6_Q_REGISTERS_MAX_DP, make_v6_tile_steps, v6_shared_layout,
    v6_staging_width
)


@functools.lru_cache(maxsize=None)
def make_forward_v6(Br, Bc, d, causal, chunk=V6_CHUNK, max_registers=None, variant=PLAIN,
                    gqa=False):
    """v6: v3's tensor-core forward with each K/V tile split into TF32 parts once, in
    shared memory, and exact for every input (float32 accumulation, float16 and
    float32 inputs, d <= 128). On the simulator kernels/simulated.py's stand-ins run it
    (slowly; the default there stays v5).

    What changes against v3:

    * Split once per tile. v3 splits every K and V operand into its TF32 big and small
      parts again for every mma, in every warp (most of its instructions:
      lab/sweeps/sass_loops.py). v6 splits each element once, while the block stages the tile, and
      stores both parts side by side, so that one 8-byte shared load (ptx.load_pair)
      fetches both: KP and VP in dynamic shared memory (as forward v5: one
      ``cuda.shared.array(0, float32)`` cut into slices; kernels/smem.py allows more than
      48 KB; v6_shared_layout). The product loops are then shared loads and mma only. P~ is
      split in registers with ``tf32_round_finite`` (two integer instructions a part).
    * Qi's parts stay in registers up to DP = 64 (as v3); above, they are staged in
      shared memory too (QP), which keeps d = 128 free of spills.
    * Exact for non-finite inputs. A tensor core cannot skip a product: a NaN or inf in
      V at a key hidden from some rows of the tile reaches them as 0 * NaN, and an inf
      split into TF32 parts is inf + NaN. So v6 stages a non-finite element as 0 (both
      parts) and records that the tile holds one (``bad``: [0] for Qi, [1] and [2] the
      last K and V tile that did, as j + 1, so nothing needs clearing). For such a tile,
      rare in practice, the warp then adds back exactly the terms that were left out, in
      plain float32: each score gets the products q * k that have a non-finite factor
      (read again from global memory), and each O entry gets p * v for the non-finite
      values of the keys its row sees (p from the lane of the quad that holds it, by a
      shuffle). A term with a non-finite factor makes its sum NaN or +-inf whatever the
      finite rest is, so the result matches v1/v2's and the reference's NaN and inf
      positions, and every entry no such term reaches is bitwise what it would be with
      the value finite (the staged 0 contributes 0 * p = 0 where the finite value gave
      0 * p = 0 too, for a hidden key).

    The staging and the two products are ``make_v6_tile_steps``'s (shared with v8); the
    steps after the products (scale, mask, online softmax, the fix-ups, the final write)
    are ``make_mma_row_steps``'s (shared with v7 and v8).

    ``chunk`` (the keys of one online-softmax step, a multiple of 8 dividing Bc) and
    ``max_registers`` (ptxas's limit, None for none) are there to be measured
    (lab/sweeps/v6_sweep.py --configs); the plans use the defaults.

    ``variant`` (kernels/variants.py, compile-time) adds masks and score modifiers, with
    the run-time arguments after ``causal_offset`` (launcher.variant_arguments): query
    head bh = b * Hq + h stages K/V head b * (Hq // group) + h // group (GQA, MQA); the
    tile loop runs over the band's tiles only (bands.py: causal and the window's left
    bound) and skips a tile the table marks empty (``tiles``, with a data mask: before
    its barriers, the same in every thread of the block); ``whole_tile`` is false on a
    window's edge tiles and on every tile of a data mask. What a variant costs per entry
    is make_mma_row_steps's. Dropout (the last four run-time arguments) is its ``drop``
    step between the softmax and P~ Vj, on every tile, and the keep_scale of write_rows.
    With ``PLAIN`` (group 1, no window) the results are the plain kernel's, bit for bit,
    and the chunk loop the same.

    ``gqa`` (compile-time): query heads share K/V heads (group > 1, kernel() passes
    p.group > 1). Without it the kernel reads K/V head bh and ignores ``group``: the plain
    kernel's addressing. Computing the K/V head from the run-time group costs ptxas
    registers in v8 at d = 64 (179 -> 251 a thread without a mask; causal, 244 -> 255
    and 132 bytes of spill stores: CUDA 13.5's ptxas for sm_90), so plain attention does
    not pay it.

    Launch: grid (ceil(Sq / Br), BH), block (2 * Br,): Br / 16 warps of 16 query rows
    each (v3's fragment layout; see make_forward_v3), and
    ``v6_shared_layout(Br, Bc, d).END * 4`` bytes of dynamic shared memory (END).
    """
    acc = acc_type("float32")
    ZERO = acc(0)
    NEG_INF = acc(-math.inf)
    assert Br % 16 == 0 and chunk % 8 == 0 and Bc % chunk == 0, (Br, Bc, chunk)
    CHUNK = chunk
    DP = (d + 7) // 8 * 8                   # head dim padded to the mma's k = 8
    KS = DP // 8                            # mma steps over the head dim
    QO_FRAGS = KS * 4                       # fragment registers of Q and of O per lane
    S_FRAGS = CHUNK // 8 * 4                # fragment registers of S per lane
    Q_FRAGS = QO_FRAGS if DP <= V6_Q_REGISTERS_MAX_DP else 1
    assert 2 * Br % v6_staging_width(d) == 0, (Br, d)   # check_v6_tiles refuses these
    layout = v6_shared_layout(Br, Bc, d)
    KP_AT, VP_AT, QP_AT, END = layout.KP_AT, layout.VP_AT, layout.QP_AT, layout.END
    TILE_TABLE = variant.tile_table
    GQA = gqa
    kv_tile_range = make_kv_tile_range(Br, Bc, causal, variant.window)
    rows = make_mma_row_steps(d, causal, CHUNK, KS, variant)
    add_nonfinite_scores, softmax_step = rows.add_nonfinite_scores, rows.softmax_step
    add_nonfinite_values, write_rows = rows.add_nonfinite_values, rows.write_rows
    drop = rows.drop
    whole_tile_seen = rows.whole_tile
    steps = make_v6_tile_steps(Br, Bc, d, CHUNK, variant.varlen)
    load_q, stage_kv, scores, values = steps.load_q, steps.stage_kv, steps.scores, steps.values

    options = jit_options()
    if max_registers:       # ptxas's register limit (ptxas only; the simulator ignores it)
        options["max_registers"] = max_registers

    VARLEN = variant.varlen
    sequences = make_sequences(VARLEN)
    locate, cut = sequences.locate, sequences.cut

    @cuda.jit(**options)
    def forward_v6(Q, K, V, O, L, softmax_scale, causal_offset, window_lo, Hq, group, softcap,
                   slopes, attn_mask, tiles, seed_lo, seed_hi, keep_threshold, keep_scale, seqs):
        bh = cuda.blockIdx.y                    # b * Hq + h: the query head
        b = bh // Hq
        h = bh % Hq
        bh_kv = bh                              # the K/V head this query head reads
        if GQA:
            bh_kv = b * (Hq // group) + h // group
        i = cuda.blockIdx.x
        # A packed batch: this block's sequence, as a batch of one (kernels/sequences.py)
        q0, k0, Sq, Sk, shift = locate(seqs, b, Q.shape[1], K.shape[1])
        if VARLEN:
            if i * Br >= Sq:
                return                  # past this sequence: the whole block, no barrier yet
            bh, bh_kv = h, h // group
        Q, O, L = cut(Q, q0, Sq), cut(O, q0, Sq), cut(L, q0, Sq)
        K, V = cut(K, k0, Sk), cut(V, k0, Sk)
        causal_offset += shift
        window_lo += shift
        tid = cuda.threadIdx.x
        lane = tid % 32
        g = lane // 4
        t = lane % 4
        r0 = (tid // 32) * 16 + g               # this lane's two rows within the tile
        row0 = i * Br + r0
        row1 = row0 + 8

        # The block's dynamic shared memory, cut into the tiles (v6_shared_layout).
        smem = cuda.shared.array(0, acc, alignment=16)     # 8-byte pairs need 8
        KP = smem[KP_AT:VP_AT]                  # Kj as (big, small) pairs, rows of K_ROW
        VP = smem[VP_AT:QP_AT]                  # Vj, rows of V_ROW
        QP = smem[QP_AT:END]                    # Qi, rows of K_ROW (if not in registers)
        bad = cuda.shared.array(3, int32)       # non-finite inputs staged as 0 (docstring)
        qb = cuda.local.array(Q_FRAGS, acc)     # Q fragments (if in registers): big parts
        qs = cuda.local.array(Q_FRAGS, acc)     # and small parts
        o = cuda.local.array(QO_FRAGS, acc)     # O fragments
        s = cuda.local.array(S_FRAGS, acc)      # S, then P~, fragments of a chunk
        pb = cuda.local.array(S_FRAGS, acc)     # P~ split for the tensor cores
        ps = cuda.local.array(S_FRAGS, acc)
        kx = cuda.local.array(V6_LOAD_BATCH, acc)   # K and V elements in flight
        vx = cuda.local.array(V6_LOAD_BATCH, acc)

        if tid == 0:
            bad[0] = 0
            bad[1] = 0
            bad[2] = 0
        # Wait until bad is clear.
        cuda.syncthreads()
        load_q(Q, QP, qb, qs, bad, bh, i, row0, row1, t, tid, Sq)          # Alg.1 l.4
        for x in range(QO_FRAGS):
            o[x] = ZERO
        m0 = NEG_INF            # running max of row0 and row1 (the same in all 4 lanes)
        m1 = NEG_INF
        l0 = ZERO               # this lane's part of the running sums (reduced at the end)
        l1 = ZERO

        # Only the tiles the band (causal, window) leaves work in (bands.py).
        j_start, j_end = kv_tile_range(i, Sk, causal_offset, window_lo)
        for j in range(j_start, j_end):
            if TILE_TABLE and not tiles[bh, i, j]:
                continue                # the mask leaves this tile empty (the whole block)
            mark = int32(j + 1)
            # Wait until every warp has finished reading the previous Kj and Vj.
            cuda.syncthreads()
            stage_kv(K, V, KP, VP, kx, vx, bad, bh_kv, j, tid, Sk)           # Alg.1 l.7
            # Wait until Kj, Vj (and, for j = 0, QP and bad[0]) are complete.
            cuda.syncthreads()
            fix_scores = bad[0] != 0 or bad[1] == mark     # the same in every thread
            fix_values = bad[2] == mark
            # Does every row of the block see every key of the tile? Then nothing is masked.
            whole_tile = whole_tile_seen(i * Br, i * Br + Br - 1, j * Bc, j * Bc + Bc - 1, Sk,
                                         causal_offset, window_lo)

            for ch in range(Bc // CHUNK):
                key0 = ch * CHUNK                # first key of the chunk within the tile
                scores(s, qb, qs, QP, KP, key0, r0, g, t)                    # Alg.1 l.8
                # (What follows the products comes after all of them, so that ptxas may
                # interleave the n-tiles' mma: a branch between them would keep it from it.)
                if fix_scores:          # rare: a non-finite q or k was staged as 0
                    add_nonfinite_scores(s, Q, K, bh, bh_kv, j * Bc + key0, row0, t, Sq, Sk)
                # Alg.1 l.9: scale, mask and the variant's score, new running max (over
                # the quad), P~ = exp(S - m_new) in s, and the rescale factors alpha.
                alpha0, alpha1, m0, m1, l0, l1 = softmax_step(
                    s, softmax_scale, whole_tile, j * Bc + key0, row0, t, b, h, Sq, Sk,
                    causal_offset, window_lo, softcap, slopes, attn_mask, m0, m1, l0, l1)
                # Dropout: P~ = 0 where dropped (l above has every P~)
                drop(s, j * Bc + key0, row0, t, b, h, seed_lo, seed_hi, keep_threshold)
                values(o, s, pb, ps, VP, key0, g, t, alpha0, alpha1)         # Alg.1 l.10
                if fix_values:          # rare: a non-finite v was staged as 0
                    add_nonfinite_values(o, s, V, bh_kv, j * Bc + key0, row0, row1, g, t, b, h,
                                         Sq, Sk, causal_offset, window_lo, attn_mask)

        # Alg.1 l.12-16: the quad's row sums, normalise once, write O and L (as v3).
        write_rows(O, L, o, bh, row0, row1, t, m0, m1, l0, l1, Sq, keep_scale)

    return forward_v6


# --- the launch contract ------------------------------------------------------------
#
# v6 runs v3's warp layout (16 query rows per warp, Br / 16 warps) with Kj and Vj split
# into TF32 parts once per tile in dynamic shared memory, and Qi's parts too when d > 64.
# Tile rule: the first (Br, Bc) of V6_CANDIDATES whose shared memory (v6_shared_bytes)
# fits the current GPU's per-block maximum (device_dynamic_shared_limit). The order is
# measured (lab/sweeps/v6_sweep.py --configs, lab/runs/2026-12-01/31_v6_configs.txt,
# (2, 16, 4096, d), float32, ms not causal / causal): d = 64, (128, 64) 5.80 / 3.57, (128, 32) 6.01 / 3.86, (64, 64)
# 7.19 / 4.57; d = 128, (128, 32) 13.28 / 7.35, (64, 32) with 32-key chunks 24.76 /
# 14.07, (64, 16) 16.59 / 9.07 (with a 168-register limit). At d = 64 (128, 64) takes
# 68.6 KB, at d = 128 (128, 32) 202 KB (one block per SM). A caller's tiles: Br a
# multiple of 16 up to 256 (16 warps), Bc a multiple of 16 (V6_CHUNK), within the
# H100/H200's 227 KB. v8 and v9 take the same rule (v9 with its own shared memory).

V6_CANDIDATES = ((128, 64), (128, 32), (64, 32), (64, 16))
# On the simulator (kernels/simulated.py), small tiles: every thread is a Python thread
# and every mma a rendezvous of a warp's 32 lanes, so fewer warps a block and a tile
# boundary crossed at the simulator's short sequences.
V6_SIM_TILES = (32, 16)
V6_MAX_HEAD_DIM = 128         # the O fragments (d / 2 a lane) stay in registers up to here
VARIANTS = True               # takes the variant arguments (kernels/variants.py)
TILE_TABLE = True             # skips the tiles a mask leaves empty (variants.make_tile_table)


def v6_shared_bytes(Br, Bc, d):
    """Dynamic shared memory of forward v6 (v6_shared_layout), float32."""
    return v6_shared_layout(Br, Bc, d).END * 4


def refusal(p, where, version="v6"):
    """Why forward ``version`` (v6, or v8: the same kernel reordered) cannot run Problem
    ``p`` here, or None if it can."""
    return tensor_core_refusal(version, p, where, V6_MAX_HEAD_DIM, "its O fragments")


def tiles_within(d, limit, shared_bytes=v6_shared_bytes):
    """The first of V6_CANDIDATES whose shared memory (by ``shared_bytes``: v6's and v8's,
    or v9's) fits ``limit`` bytes, or None."""
    return next(((Br, Bc) for Br, Bc in V6_CANDIDATES if shared_bytes(Br, Bc, d) <= limit),
                None)


def default_v6_tiles(d, version="v6", shared_bytes=v6_shared_bytes, where=None):
    """v6 tile rule (above), (Br, Bc): d <= 64 -> (128, 64); d = 128 -> (128, 32) on the
    H200, (64, 16) on a GPU that allows a block 99 KB. v9 takes the same rule with its own
    shared memory (``shared_bytes``): on the H200 the same tiles."""
    if here(where) == "simulator":
        return max(V6_SIM_TILES[0], v6_staging_width(d) // 2), V6_SIM_TILES[1]
    limit = device_dynamic_shared_limit(where)
    tiles = tiles_within(d, limit, shared_bytes)
    if tiles is not None:
        return tiles
    raise ValueError(f"forward {version} cannot run this input: no {version} tile fits head "
                     f"dim {d} within {limit} bytes of shared memory")


def check_v6_tiles(tiles, d, version="v6", shared_bytes=v6_shared_bytes):
    """A caller's forward v6 (or v8, or v9 with its own ``shared_bytes``) tiles;
    ValueError names the limit."""
    return check_warp_tiles(version, tiles, d, V6_CHUNK, shared_bytes, v6_staging_width,
                            f". (version='v5' takes other tiles)")


def plan_warps(p, where, tiles, reason, version, why_not, shared_bytes, chunk=None,
               packed_rows=False):
    """The Plan of forward v6, v8 or v9 (``version``; ``why_not``: its refusal, or None;
    ``shared_bytes``: its shared memory; ``chunk(d, Bc)``: its keys per softmax step, for
    v8 and v9): grid (Tr, B * Hq), 2 Br threads (Br / 16 warps) a block. All three take
    variants (the table of visible tiles is made for the plan's (Br, Bc))."""
    if why_not is not None:
        raise ValueError(f"forward {version} cannot run this input: {why_not}")
    if tiles is None:
        Br, Bc = default_v6_tiles(p.d, version, shared_bytes, where)
        reason += f"; tiles by the v6 rule for d={p.d}"
    else:
        Br, Bc = check_v6_tiles(tiles, p.d, version, shared_bytes)
        reason += "; tiles given by the caller"
    if chunk is not None:
        reason += f"; {chunk(p.d, Bc)}-key softmax steps (v8_chunk)"
    if p.variant.tile_table:
        reason += TILE_TABLE_REASON
    grid = ((math.ceil(p.Sq / Br), p.Hq, p.B) if packed_rows and p.variant.varlen
            else (math.ceil(p.Sq / Br), p.BH))
    return Plan("forward", version, f"forward_{version}", where, Br, Bc,
                grid, (2 * Br,), shared_bytes(Br, Bc, p.d),
                p.acc_dtype, p.causal, reason, variant_description(p), dynamic_shared=True)


def plan(p, where, tiles, reason):
    """The Plan of forward v6 for Problem ``p``."""
    return plan_warps(p, where, tiles, reason, "v6", refusal(p, where), v6_shared_bytes)


def kernel(plan, p):
    """The compiled kernel of ``plan`` (cached per compile-time parameters)."""
    if p.variant.plain and p.group == 1:    # the plain call, as wrappers of it (tests) make it
        return make_forward_v6(plan.Br, plan.Bc, p.d, p.upper)
    return make_forward_v6(plan.Br, plan.Bc, p.d, p.upper, variant=p.variant,
                           gqa=p.group > 1)
