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

v1  Three kernels, no atomics; the default for variants (windows, GQA, masks, ...).
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

v3  Register-blocked SIMT, the default for plain attention in float64 and at d > 128
    (causal or not; runs on the GPU and the simulator; v4 elsewhere). The same three
    kernels and order of work as v1 (backward_preprocess is reused), with the work of a
    block spread the way forward v4 spreads it. v1 is bound by
    shared-memory loads and by occupancy: each FMA of s, dp, dKj and dVj needs one or two
    shared loads and no loaded value serves a second key, and its 32-thread blocks (16 at
    d = 128) with 255 registers and spills leave about 6 warps per SM. In v3 the (Br, Bc)
    tile pair is covered by a TY x TX grid of threads (TY = Br / TM, TX = Bc / TN); thread
    (ty, tx) owns a TM x TN block of Sij, Pij, dPij and dSij (rows ty + TY*a, keys
    tx + TX*b) in registers, and a block of the accumulators: in backward_dkdv_v3 its TN
    keys x d / TY head-dim columns of dKj and dVj, in backward_dq_v3 its TM rows x d / TX
    columns of dQi. Per k step of Sij and dPij a thread loads 2 (TM + TN) values for
    2 TM TN FMAs; per row of dVj += Pij^T dOi and dKj += dSij^T Qi, 2 (TN + d/TY) values
    for 2 TN d/TY FMAs; per key of dQi += dSij Kj, TM + d/TX for TM d/TX FMAs. Default
    float32 tiles at d = 64: (Br, Bc, TM, TN) = (32, 32, 4, 2), 128 threads: 0.75, 0.625
    and 0.5 loads per FMA instead of v1's 2 (in Sij, dPij) and 1. Qi, dOi, Kj and Vj are
    staged transposed, with rows padded to an odd length, so that every read is
    conflict-free or a broadcast; Pij and dSij go through shared memory (the threads of a
    key hold different rows). P = exp2(S * scale * log2(e) - L * log2(e)): log2(e) is
    folded into the scale and into L_i once per row, so each entry costs one FMA and an
    exp2. Causal blocks skip fully masked tiles as in v1 and test (row, key) pairs only on
    tiles the mask cuts through; rows with L = -inf (they see no key) are staged as zeros
    in the dK/dV kernel and written as zeros by the dQ kernel, so NaN in a masked key, or
    in the q or dO of a row that sees no key, has no effect, as in v1. No atomics: every
    element of dQ, dK, dV has one owner thread that sums in a fixed order (the same order
    for any (TM, TN)), so repeated runs are bitwise identical.
    Costs: three barriers per tile instead of two (load; Pij and dSij written; read), and
    the 48 KB of static shared memory, which now holds Pij and dSij as well: (32, 32) at
    d = 64, (16, 16) at d = 128 (2 TM TN and the accumulators keep 0 spills there). As in
    v1, S, P and dP are computed in both passes (7 tile products per pair).
    ptxas (sm_90, float32, default tiles, no GPU): d = 64, (32, 32, 4, 2): dK/dV 157
    registers (116 causal), dQ 95 (109 causal); d = 128, (16, 16, 2, 1): dK/dV 128, dQ 78;
    no spills, no stack; shared memory 43520 / 39040 bytes (d = 64), 38144 / 36928
    (d = 128). What it should buy: 2-3x fewer shared loads per FMA and 2-3x more resident
    warps than v1 (dK/dV: 3 blocks of 4 warps per SM at d = 64, limited by registers);
    the prediction is a few times v1's speed at d = 64, less at d = 128, where the tiles
    are 16 x 16. Measured on the H200 (scripts/bwd_v3_sweep.py, docs/gpu-results.md run
    11): 3.7x to 4.0x v1 at d = 64, 7.0x to 7.4x at d = 128 (where v1's 16-thread blocks
    were the worst), all within the tolerance rule.

v4  v3 with dynamic shared memory (the default for plain float32 attention with d <= 128;
    GPU and simulator).
    v3's shared arrays are static, at most 48 KB per block, and at d = 128 that is what
    holds it to (16, 16, 2, 1) tiles (0.13x PyTorch SDPA there against 0.21x at d = 64 with
    (32, 32, 4, 2)). v4 runs v3's two kernels with the algorithm, thread layout, barriers
    and NaN-safety unchanged line for line, as forward v5 does forward v4: each kernel's
    arrays are slices of ONE dynamic shared array, ``cuda.shared.array(0, acc)``, at
    compile-time offsets (dkdv_v4_shared_layout, dq_v4_shared_layout), with flat indices
    ([row * row_length + col]); the byte count goes with each launch,
    ``kernel[grid, block, 0, nbytes]``, and above 48 KB the compiled kernel is first
    allowed it (kernels/smem.py; up to 227 KB per block on the H200). With the same tiles
    v4's gradients are bitwise v3's on the simulator. Default float32 tiles: d <= 64
    (64, 64, 4, 4), 256 threads, 100352 / 83200 bytes (dK/dV / dQ; v3: (32, 32, 4, 2),
    128 threads); d = 128 (32, 32, 2, 2), 256 threads, 76288 / 71808 bytes
    (two blocks per SM): per k step of Sij and dPij 1 load per FMA (v3 at d = 128: 1.5),
    per row of dVj, dKj 0.625 (v3: 1.06). (32, 32, 4, 2) at d = 128 would need 128 dK/dV
    accumulators a thread, twice v3's register bound. ptxas (sm_90, float32, default
    tiles, no GPU, with the unsigned indices of kernels/smem.py): d = 64: dK/dV 101
    registers (103 causal; v3: 157 and 116), dQ 72; d = 128: dK/dV 101 (105 causal), dQ 64
    (72 causal); no spills, no stack. Measured on the H200
    (scripts/bwd_v4_sweep.py, run 18 in docs/gpu-results.md; all checks against float64
    passed), before its tiles were indexed with unsigned integers: slower than v3
    everywhere. With v3's own tiles the
    dynamic array costs a third of the speed (d = 64: 73.3 ms against v3's 48.1; d = 128
    at (16, 16, 2, 1): 267.8 against 144.7), as in forward v5; larger tiles at d = 128
    win some of it back but not all ((32, 32, 4, 2): 152.6 ms, 0.95x v3; the default
    (32, 32, 2, 2): 164.3 ms, 0.88x). The same sweep after the change (run 21; v3 without
    them, 47.93 and 146.04 ms): d = 64, v3's tiles 38.03 ms, (64, 64, 4, 4) 30.71 (causal
    17.26); d = 128, (32, 32, 2, 2) 84.28 (causal 45.87), (64, 64, 4, 4) 81.29 at one block
    per SM. v3 with unsigned indices (run 20): 37.89 and 119.44 ms. So v4 is the default
    for plain float32 attention with d <= 128 (dispatch._default_backward_version). With
    while loops (kernels/__init__.py; run 26): v4 24.13 ms at d = 64 (29.91 before) and
    65.41 at d = 128 (83.66), v3 28.68 and 89.33; causal at d = 64 the two tie (15.63 and
    15.56 ms).

v5  Tensor cores, plain (GPU only; opt-in). The same two kernels and order of work as v4,
    with the tile products on the tensor cores as 3xTF32 ``mma.sync`` (forward v3's
    split; ptx.py): in the dK/dV kernel warp w owns 16 keys and computes S^T = Kj Qi^T
    and dP^T = Vj dOi^T as mma fragments whose rows are its keys, then dVj += P^T dOi and
    dKj += dS^T Qi with the S fragments as the A operand (forward v3's relabelling of k);
    the dQ kernel is its mirror image (warp w owns 16 query rows). All four tiles in
    dynamic shared memory, rows of DP + 4 floats (both read patterns conflict-free).
    Every operand is split into its TF32 parts where it is read, as in forward v3.
    Finite inputs only: a tensor core cannot skip a product, so a NaN in the q or dO of a
    query would reach the keys it does not see as 0 * NaN. The dispatcher checks the six
    inputs with one small kernel (``nonfinite_check``) before the launch: version="v5"
    with a NaN or inf is a ValueError, and the default runs v4 instead, logging why.
    Measured (scripts/bwd_v5_sweep.py, run 35, (2, 16, 4096, d), float32, ms not causal /
    causal): d = 64 26.63 / 14.43 (v4 24.53 / 15.43), d = 128 74.36 / 39.33 with (64, 64)
    tiles (v4 64.96 / 34.05): as fast as v4, no faster; every check within the rule.
v6  v5, cheaper (GPU only; the default for plain float32/float16 attention with d <= 128
    on a GPU, finite inputs). Three changes, each where v5 spends instructions rather
    than tensor-core time: splits on the bits (ptx.tf32_round_finite, two integer
    instructions, where the cvt takes about five: the inputs were checked finite); the
    head dim on the outside of S^T and dP^T, so each A fragment is loaded and split once
    per chunk and serves its n-tiles; staging with one flat address per element
    (ptx.flat_load) and no L test per element. exp2 with log2(e) folded in. The dQ
    kernel takes 32 keys a step where its tile allows (V6_CHUNKS). Measured (runs 37-38):
    d = 64 18.99-19.33 / 11.72-12.15 ms (1.25x-1.39x v4), d = 128 with (64, 64) tiles
    60.52 / 33.69 (1.04x-1.07x v4). Each kernel takes its own tiles from the dispatcher
    (dispatch.default_backward_v6_plan): at d > 64 the dK/dV kernel (64, 128) and the dQ
    kernel (128, 64), eight warps a block where (64, 64) gave four at one block per SM:
    d = 128 37.60 / 21.32 ms (run 58). Tried and dropped (run 36): storing every tile as
    TF32 pairs split once as staged (forward v6's way): twice the shared memory, fewer
    warps per SM, 0.66x v5. Kept (run 63, the float32 default): pairs for the streamed
    tiles only (which every warp reads), with that side of the tile halved to keep the
    shared memory: at d = 128 (32, 128) and (128, 32), 8-10 % faster; at d = 64 (32, 64)
    and (64, 32), about 6 % without the mask (with it, dK/dV keeps (64, 64) plain).
    compute-sanitizer memcheck, racecheck, synccheck and initcheck: 0 errors (run 40;
    with the pairs, memcheck and racecheck: run 65). What limits it: docs/performance.md.

Float32 sums: every accumulator (dKj, dVj over the Q tiles; dQi over the K/V tiles) adds
one tile's terms into a fresh partial first and then adds the partial, as the forward does
with l. Adding Sq terms one by one made dK's error 3x a float32 matmul's on the H200 at
Sq = 1024 (the bound of TESTING.md's rule). The price is d more registers per
accumulator: from d = 64 on, v1's and v2's dK/dV kernels spill (tests/ptx_check.py reports
it); v3 keeps them in registers without spills up to d = 128 (each thread holds a block).

Variants (kernels/variants.py, docs/variants.md): the v1 kernels take a compile-time
``variant`` and seven more run-time arguments after causal_offset (window_lo, Hq, group,
softcap, slopes, attn_mask, tiles). dS is multiplied by d score / d s (softcap, score_mod_grad).
With GQA the dK/dV kernel runs one block per K/V head and tile, and walks the Q tiles of
every query head of its group in a fixed order: dK, dV summed without atomics. Tiles
that a boolean attn_mask or a mask_mod leaves empty are skipped through the table of
visible tiles (``tiles``, variants.make_tile_table). v2, v3 and v4 compute plain
attention only (the dispatcher refuses variants); so do v5 and v6.

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
from .smem import U
from .variants import PLAIN, make_variant_functions

VERSIONS = ("v1", "v2", "v3", "v4", "v5", "v6")


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


# --- v3: register-blocked SIMT ------------------------------------------------------------

LOG2E = 1.4426950408889634              # log2(e): exp(x) = exp2(x * LOG2E)


def v3_thread_grid(Br, Bc, TM, TN, d):
    """The shape constants of a v3 kernel, shared by both kernels and by dispatch.py.

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
    return TY, TX, DPY, DPY // TY, DPX, DPX // TX


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
    banks. ``dispatch.dkdv_v3_shared_bytes`` counts them.

    Rows whose L is -inf (they see no key) and rows past Sq are staged as zeros, so that a
    NaN in their q or dO can never meet a zero P: the sums over rows below have no test
    except on the causal diagonal.
    """
    acc = acc_type(acc_dtype)
    ZERO = acc(0)
    NEG_INF = acc(-math.inf)
    LOG2E_ACC = acc(LOG2E)
    TY, TX, DP, DN, _, _ = v3_thread_grid(Br, Bc, TM, TN, d)
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

        # Alg.2 l.18: write dKj (times the scale, see the module docstring) and dVj.
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
    thanks to the pads. ``dispatch.dq_v3_shared_bytes`` counts them.
    """
    acc = acc_type(acc_dtype)
    ZERO = acc(0)
    NEG_INF = acc(-math.inf)
    LOG2E_ACC = acc(LOG2E)
    TY, TX, _, _, DP, DN = v3_thread_grid(Br, Bc, TM, TN, d)
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


# --- v4: v3 with dynamic shared memory ----------------------------------------------------

def dkdv_v4_shared_layout(Br, Bc, TM, TN, d):
    """Where backward_dkdv_v4's arrays sit in its one dynamic shared array: the offsets, in
    elements of the accumulator dtype, of KjT, VjT, QiT, dOiT, Pij, dSij, L_i, D_i (v3's
    eight static arrays, same shapes, back to back, each row by row) and the end, which is
    the array's length: (K_AT, V_AT, Q_AT, dO_AT, P_AT, dS_AT, L_AT, D_AT, END). With
    v3_thread_grid's DPY (d rounded up to TY = Br // TM): KjT, VjT (DPY, Bc+1), QiT, dOiT
    (DPY, Br+1), Pij, dSij (Br, Bc+1), L_i, D_i (Br). ``dispatch.dkdv_v4_shared_bytes`` is
    END times the itemsize (the same bytes as v3's)."""
    _, _, DP, _, _, _ = v3_thread_grid(Br, Bc, TM, TN, d)
    K_AT = 0
    V_AT = K_AT + DP * (Bc + 1)
    Q_AT = V_AT + DP * (Bc + 1)
    dO_AT = Q_AT + DP * (Br + 1)
    P_AT = dO_AT + DP * (Br + 1)
    dS_AT = P_AT + Br * (Bc + 1)
    L_AT = dS_AT + Br * (Bc + 1)
    D_AT = L_AT + Br
    END = D_AT + Br
    return K_AT, V_AT, Q_AT, dO_AT, P_AT, dS_AT, L_AT, D_AT, END


def dq_v4_shared_layout(Br, Bc, TM, TN, d):
    """Where backward_dq_v4's arrays sit in its one dynamic shared array: the offsets of
    QiT, dOiT (DPX, Br+1), KjT, VjT (DPX, Bc+1) and dSij (Br, Bc+1), DPX = d rounded up to
    TX = Bc // TN, and the end: (Q_AT, dO_AT, K_AT, V_AT, dS_AT, END).
    ``dispatch.dq_v4_shared_bytes`` is END times the itemsize (the same bytes as v3's)."""
    _, _, _, _, DP, _ = v3_thread_grid(Br, Bc, TM, TN, d)
    Q_AT = 0
    dO_AT = Q_AT + DP * (Br + 1)
    K_AT = dO_AT + DP * (Br + 1)
    V_AT = K_AT + DP * (Bc + 1)
    dS_AT = V_AT + DP * (Bc + 1)
    END = dS_AT + Br * (Bc + 1)
    return Q_AT, dO_AT, K_AT, V_AT, dS_AT, END


@functools.lru_cache(maxsize=None)
def make_backward_dkdv_v4(Br, Bc, TM, TN, d, causal, acc_dtype):
    """v4 dK/dV kernel: ``make_backward_dkdv_v3``'s kernel with its shared memory taken
    from dynamic shared memory (the default for plain float32 attention, d <= 128; GPU
    and simulator).

    The algorithm, thread layout, barriers and NaN-safety are v3's line for line (see
    make_backward_dkdv_v3 for what each thread owns and why); only where the eight shared
    arrays come from changes, as forward v5 changes forward v4. v3 declares them with
    ``cuda.shared.array(shape, dtype)`` (static, at most 48 KB per block, which is what
    holds v3 to (16, 16, 2, 1) tiles at d = 128); v4 declares ONE dynamic array,
    ``cuda.shared.array(0, acc)``, and cuts it into v3's arrays at the compile-time
    offsets of ``dkdv_v4_shared_layout``: each is a 1D slice (a view), and v3's 2D index
    [row, col] becomes [row * row_length + col] (why slices and not reshape: see
    forward.make_forward_v5). Under the simulator each slice is bounds-checked on its own.

    Launch: as v3, grid (Tc, BH), block (TY * TX,), plus END * itemsize bytes of dynamic
    shared memory (END from ``dkdv_v4_shared_layout``; ``dispatch.dkdv_v4_shared_bytes``):

        kernel[grid, block, 0, nbytes](Q, K, V, dO, L, D, dK, dV, softmax_scale, causal_offset)

    Above 48 KB the compiled kernel must first be allowed that much (kernels/smem.py;
    dispatch.launch_backward does it). Measured: the module docstring (v4).
    """
    acc = acc_type(acc_dtype)
    ZERO = acc(0)
    NEG_INF = acc(-math.inf)
    LOG2E_ACC = acc(LOG2E)
    TY, TX, DP, DN, _, _ = v3_thread_grid(Br, Bc, TM, TN, d)
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
    q_tile_range = make_q_tile_range(Br, Bc, causal, False)

    @cuda.jit(**jit_options())
    def backward_dkdv_v4(Q, K, V, dO, L, D, dK, dV, softmax_scale, causal_offset):
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

        # From here on, v3 line for line (with the flat indices above).
        # Alg.2 l.6: stage Kj, Vj transposed (zeros past Sk and past d).
        idx = tid
        while idx < Bc * DP:
            c = idx // DP
            k = idx % DP
            col = j * Bc + c
            inside = col < Sk and k < d
            KjT[U(k * BcP + c)] = acc(K[U(bh), U(col), U(k)]) if inside else ZERO
            VjT[U(k * BcP + c)] = acc(V[U(bh), U(col), U(k)]) if inside else ZERO
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
            if not causal or last_col <= i * Br + causal_offset:
                # every row of the tile sees every key of the block: no test
                r = 0
                while r < Br:             # a while loop, not range(): see kernels/__init__.py
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
            else:
                # the causal diagonal: hidden (row, key) pairs never read q or dO, so a
                # NaN in the row of a query that does not see the key has no effect
                r = 0
                while r < Br:             # a while loop, not range(): see kernels/__init__.py
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

        # Alg.2 l.18: write dKj (times the scale, see the module docstring) and dVj.
        for b in range(TN):
            col = j * Bc + tx + TX * b
            if col < Sk:
                for e in range(DN):
                    k = ty + TY * e
                    if k < d:
                        dK[bh, col, k] = dk[b, e] * softmax_scale
                        dV[bh, col, k] = dv[b, e]

    return backward_dkdv_v4


@functools.lru_cache(maxsize=None)
def make_backward_dq_v4(Br, Bc, TM, TN, d, causal, acc_dtype):
    """v4 dQ kernel: ``make_backward_dq_v3``'s kernel with its shared memory taken from
    dynamic shared memory, as ``make_backward_dkdv_v4`` is v3's dK/dV kernel's.

    v3's five shared arrays (QiT, dOiT, KjT, VjT, dSij) are slices of one dynamic array at
    the offsets of ``dq_v4_shared_layout``, with flat indices; everything else is v3's
    line for line (see make_backward_dq_v3). Launch: as v3, grid (Tr, BH), block
    (TY * TX,), plus END * itemsize bytes of dynamic shared memory
    (``dispatch.dq_v4_shared_bytes``), allowed first above 48 KB (kernels/smem.py).
    """
    acc = acc_type(acc_dtype)
    ZERO = acc(0)
    NEG_INF = acc(-math.inf)
    LOG2E_ACC = acc(LOG2E)
    TY, TX, _, _, DP, DN = v3_thread_grid(Br, Bc, TM, TN, d)
    THREADS = TY * TX
    BrP = Br + 1
    BcP = Bc + 1
    # Offsets (elements) and v3's 2D indices: QiT, dOiT (DP, BrP): [k, r] -> [k * BrP + r];
    # KjT, VjT (DP, BcP): [k, c] -> [k * BcP + c]; dSij (Br, BcP): [r, c] -> [r * BcP + c].
    Q_AT, dO_AT, K_AT, V_AT, dS_AT, END = dq_v4_shared_layout(Br, Bc, TM, TN, d)
    kv_tile_range = make_kv_tile_range(Br, Bc, causal, False)

    @cuda.jit(**jit_options())
    def backward_dq_v4(Q, K, V, dO, L, D, dQ, softmax_scale, causal_offset):
        bh = cuda.blockIdx.y
        i = cuda.blockIdx.x             # Q tile index: one block per i
        tid = cuda.threadIdx.x
        ty = tid // TX
        tx = tid % TX
        Sq = Q.shape[1]
        Sk = K.shape[1]
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

        # From here on, v3 line for line (with the flat indices above).
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
                KjT[U(k * BcP + c)] = acc(K[U(bh), U(col), U(k)]) if inside else ZERO
                VjT[U(k * BcP + c)] = acc(V[U(bh), U(col), U(k)]) if inside else ZERO
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
                    dSij[U(r * BcP + c)] = ds
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
                        sa[a] = dSij[U((ty + TY * a) * BcP + c)]
                    for e in range(DN):
                        ke[e] = KjT[U((tx + TX * e) * BcP + c)]
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


# ---------------------------------------------------------------------------------------
# v5: tensor cores (3xTF32), GPU only

V5_CHUNK = 16           # backward v5: streamed rows (queries in dK/dV, keys in dQ) per step


def v5_head_dim(d):
    """(DP, STRIDE) of backward v5: d rounded up to the mma's k = 8, and the row length
    of its shared tiles, DP + 4, with which both fragment read patterns (rows g, columns
    t, and rows 2t, columns g: make_backward_dkdv_v5) hit 32 different banks."""
    DP = (d + 7) // 8 * 8
    return DP, DP + 4


def dkdv_v5_shared_layout(Br, Bc, d, pairs=False):
    """Where backward_dkdv_v5's tiles sit in its one dynamic float32 array: the offsets of
    Kj, Vj (Bc rows of STRIDE), Qi, dOi (Br rows of STRIDE), L_i, D_i (Br) and the end:
    (K_AT, V_AT, Q_AT, dO_AT, L_AT, D_AT, END). ``dispatch.dkdv_v5_shared_bytes`` is
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
    return K_AT, V_AT, Q_AT, dO_AT, L_AT, D_AT, END


def dq_v5_shared_layout(Br, Bc, d, pairs=False):
    """Where backward_dq_v5's tiles sit in its one dynamic float32 array: the offsets of
    Qi, dOi (Br rows of STRIDE), Kj, Vj (Bc rows of STRIDE) and the end:
    (Q_AT, dO_AT, K_AT, V_AT, END). ``dispatch.dq_v5_shared_bytes`` is END * 4.
    ``pairs`` (backward v6): Kj and Vj each hold their big parts, then their small parts
    (2 Bc rows)."""
    _, STRIDE = v5_head_dim(d)
    streamed = 2 * Bc if pairs else Bc
    Q_AT = 0
    dO_AT = Q_AT + Br * STRIDE
    K_AT = dO_AT + Br * STRIDE
    V_AT = K_AT + streamed * STRIDE
    END = V_AT + streamed * STRIDE
    return Q_AT, dO_AT, K_AT, V_AT, END


@functools.lru_cache(maxsize=None)
def make_backward_dkdv_v5(Br, Bc, d, causal):
    """v5 dK/dV kernel: tensor cores (3xTF32 ``mma.sync``, as forward v3), GPU only;
    float32 accumulation, float16 and float32 inputs. On the simulator the dispatcher
    runs v4, which computes the same thing.

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
    dO of a query would reach keys that query does not see as 0 * NaN. The dispatcher
    checks the inputs first and runs v4 if any is not finite (dispatch.launch_backward).
    Rows that see no key (L = -inf) are staged as zeros, so their q and dO play no part.

    Launch: grid (ceil(Sk / Bc), BH), block (2 * Bc,): Bc / 16 warps; END * 4 bytes of
    dynamic shared memory (``dkdv_v5_shared_layout``; allowed first above 48 KB):

        kernel[grid, block, 0, nbytes](Q, K, V, dO, L, D, dK, dV, softmax_scale, causal_offset)
    """
    from .ptx import mma3_split_b as mma3, split_tf32 as split   # GPU only: inline PTX
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
    """v5 dQ kernel: the tensor-core sibling of make_backward_dkdv_v5 (GPU only, finite
    inputs; v4 on the simulator), laid out as forward v3: warp w owns the query rows
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
    from .ptx import mma3_split_b as mma3, split_tf32 as split   # GPU only: inline PTX
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


F32_MAX = 3.4028234663852886e38


@cuda.jit(**jit_options())
def nonfinite_check(Q, K, V, O, dO, L, flag):
    """flag[0] = 1 if any element of the 1D arrays Q, K, V, O, dO is NaN or +-inf, or any
    of L is NaN or +inf (L = -inf is a row that sees no key). The dispatcher runs it
    before backward v5, which needs finite inputs (grid-stride loop; GPU and simulator)."""
    n = cuda.grid(1)
    step = cuda.gridsize(1)
    bad = False
    while n < Q.size or n < K.size or n < L.size:
        if n < Q.size:
            bad = bad or not (abs(Q[n]) <= F32_MAX and abs(O[n]) <= F32_MAX
                              and abs(dO[n]) <= F32_MAX)
        if n < K.size:
            bad = bad or not (abs(K[n]) <= F32_MAX and abs(V[n]) <= F32_MAX)
        if n < L.size:
            bad = bad or not (L[n] <= F32_MAX)
        n += step
    if bad:
        flag[0] = 1                 # every writer writes the same value


# ---------------------------------------------------------------------------------------
# v6: v5 with cheaper splits and staging, each A fragment used for a whole chunk (GPU only)


V6_CHUNK = 16           # backward v6: streamed rows per step, by default
# the chunk the dispatcher gives each v6 kernel (scripts/bwd_v5_sweep.py measures others)
V6_CHUNKS = {"dkdv": V6_CHUNK, "dq": 32}    # dQ: 32 keys, 7% faster at d = 128 (run 38)


def _make_v6_helpers(d):
    """Device functions shared by backward v6's two kernels: staging a tile, loading a
    split A fragment or B element, and the 3xTF32 product of split operands."""
    from .ptx import flat_load, mma_tf32, split_tf32_finite as split_finite   # GPU only

    acc = acc_type("float32")
    ZERO = acc(0)
    DP, STRIDE = v5_head_dim(d)

    @cuda.jit(device=True, inline=True)
    def stage(T, A, bh, first, nrows, rows, tid, threads):
        """T[r] = A[bh, first + r] as float32 rows of STRIDE, for r < rows; zeros past
        nrows (the sequence) and past d. One flat address per element (ptx.flat_load)."""
        base = (bh * nrows + first) * d
        for idx in range(tid, rows * DP, threads):
            r = idx // DP
            k = idx % DP
            inside = first + r < nrows and k < d
            T[U(r * STRIDE + k)] = acc(flat_load(A, U(base + r * d + k))) if inside else ZERO

    @cuda.jit(device=True, inline=True)
    def stage_pairs(T, A, bh, first, nrows, rows, tid, threads):
        """As stage, but split once here: T[r] holds the big parts, T[rows + r] the small
        ones (load_pair reads them)."""
        base = (bh * nrows + first) * d
        for idx in range(tid, rows * DP, threads):
            r = idx // DP
            k = idx % DP
            inside = first + r < nrows and k < d
            big, small = split_finite(acc(flat_load(A, U(base + r * d + k))) if inside
                                      else ZERO)
            T[U(r * STRIDE + k)] = big
            T[U((rows + r) * STRIDE + k)] = small

    @cuda.jit(device=True, inline=True)
    def load_split(T, n):
        """T[n] split into its TF32 parts."""
        return split_finite(T[U(n)])

    @cuda.jit(device=True, inline=True)
    def a_fragment(T, row, ks, t):
        """The A fragment (ptx.py) of rows row, row + 8 and columns 8ks + t, + 4 of a
        tile, as (big parts, small parts)."""
        at = row * STRIDE + ks * 8 + t
        a0b, a0s = load_split(T, at)
        a1b, a1s = load_split(T, at + 8 * STRIDE)
        a2b, a2s = load_split(T, at + 4)
        a3b, a3s = load_split(T, at + 8 * STRIDE + 4)
        return a0b, a1b, a2b, a3b, a0s, a1s, a2s, a3s

    @cuda.jit(device=True, inline=True)
    def mma3(a, b0b, b1b, b0s, b1s, c0, c1, c2, c3, e0, e1, e2, e3):
        """3xTF32 with A (the 8 values of a_fragment) and B split: big*big into C, the
        two small products into E."""
        e0, e1, e2, e3 = mma_tf32(a[4], a[5], a[6], a[7], b0b, b1b, e0, e1, e2, e3)
        e0, e1, e2, e3 = mma_tf32(a[0], a[1], a[2], a[3], b0s, b1s, e0, e1, e2, e3)
        c0, c1, c2, c3 = mma_tf32(a[0], a[1], a[2], a[3], b0b, b1b, c0, c1, c2, c3)
        return c0, c1, c2, c3, e0, e1, e2, e3

    return split_finite, stage, a_fragment, mma3, load_split, stage_pairs


def _streamed_tile_steps(d, pairs, rows):
    """(stage, load) for the tiles a backward v6 kernel streams (``rows`` rows each):
    staged plain and split where read (load_split), or, with ``pairs``, split once as
    staged (stage_pairs) and read as (big, small)."""
    split_finite, stage, _, _, load_split, stage_pairs = _make_v6_helpers(d)
    if not pairs:
        return stage, load_split
    _, STRIDE = v5_head_dim(d)
    SMALL = rows * STRIDE

    @cuda.jit(device=True, inline=True)
    def load_pair(T, n):
        """The (big, small) parts of element n of a tile staged by stage_pairs."""
        return T[U(n)], T[U(n + SMALL)]

    return stage_pairs, load_pair


@functools.lru_cache(maxsize=None)
def make_backward_dkdv_v6(Br, Bc, d, causal, chunk=None, pairs=False):
    """v6 dK/dV kernel: v5's, made cheaper where v5 spends its instructions (GPU only;
    finite inputs, float32 accumulation, d <= 128; v5's shared memory, or with ``pairs``
    Qi and dOi twice as long).

    * Splits on the bits. Every operand is still split into its TF32 parts where it is
      read, but with ``tf32_round_finite`` (two integer instructions where the cvt takes
      about five): the dispatcher has checked that the inputs are finite, and P^T and
      dS^T are then finite too.
    * Each A fragment serves the whole chunk. S^T and dP^T run over the head dim on the
      outside and the chunk's n-tiles (chunk / 8) inside, so a fragment of Kj and Vj is
      loaded and split once per chunk instead of once per n-tile, and the n-tiles' sums
      are independent (the tensor cores need not wait for one before the next).
    * Staging without the index arithmetic: one flat address per element
      (ptx.flat_load), and no L test per element (with finite inputs, the q and dO of a
      row that sees no key only ever meet P = 0).
    * exp2 with log2(e) folded into the scale and into L_i (as backward v4).

    ``chunk``: the query rows of Qi a step takes (a multiple of 8 dividing Br; None:
    V6_CHUNK); the dispatcher gives backward.V6_CHUNKS (dispatch.backward_v6_chunk).
    ``pairs``: Qi and dOi, which every warp reads, are split once as they are staged
    and kept as (big, small) pairs: twice their shared memory.

    What was tried and dropped (run 36, docs/gpu-results.md): storing every tile as
    (big, small) pairs, split once as it is staged (forward v6's way). It doubles the
    shared memory, so fewer warps fit an SM, and it ran at 0.66x v5's speed. ``pairs``
    does it for Qi and dOi only, the tiles all the block's warps read (each warp reads
    its own rows of Kj and Vj): with Br halved, in the same shared memory (run 63).

    Launch as v5: grid (ceil(Sk / Bc), BH), block (2 * Bc,), END * 4 bytes of dynamic
    shared memory (``dkdv_v5_shared_layout(Br, Bc, d, pairs)``).
    """
    split_finite, stage, a_fragment, mma3, load_split, _ = _make_v6_helpers(d)
    stage_q, load_q = _streamed_tile_steps(d, pairs, Br)
    acc = acc_type("float32")
    ZERO = acc(0)
    CHUNK = V6_CHUNK if chunk is None else chunk
    assert Bc % 16 == 0 and Br % CHUNK == 0 and CHUNK % 8 == 0, (Br, Bc, CHUNK)
    LOG2E_ACC = acc(LOG2E)
    THREADS = 2 * Bc
    DP = (d + 7) // 8 * 8
    KS = DP // 8
    NT = CHUNK // 8
    ACC = KS * 4
    S_FRAGS = NT * 4
    _, STRIDE = v5_head_dim(d)
    K_AT, V_AT, Q_AT, dO_AT, L_AT, D_AT, END = dkdv_v5_shared_layout(Br, Bc, d, pairs)
    q_tile_range = make_q_tile_range(Br, Bc, causal, False)

    @cuda.jit(**jit_options())
    def backward_dkdv_v6(Q, K, V, dO, L, D, dK, dV, softmax_scale, causal_offset):
        bh = cuda.blockIdx.y
        j = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        lane = tid % 32
        g = lane // 4
        t = lane % 4
        w0 = (tid // 32) * 16
        key0 = j * Bc + w0 + g
        Sq = Q.shape[1]
        Sk = K.shape[1]
        scale_log2 = softmax_scale * LOG2E_ACC     # exp(x) = exp2(x log2(e))

        smem = cuda.shared.array(0, acc)
        Kj = smem[K_AT:V_AT]
        Vj = smem[V_AT:Q_AT]
        Qi = smem[Q_AT:dO_AT]
        dOi = smem[dO_AT:L_AT]
        L_i = smem[L_AT:D_AT]
        D_i = smem[D_AT:END]
        dk = cuda.local.array(ACC, acc)
        dv = cuda.local.array(ACC, acc)
        s = cuda.local.array(S_FRAGS, acc)      # S^T of a chunk: the big*big products
        se = cuda.local.array(S_FRAGS, acc)     # and the small ones (summed when used)
        dp = cuda.local.array(S_FRAGS, acc)     # dP^T, the same way
        dpe = cuda.local.array(S_FRAGS, acc)
        pb = cuda.local.array(S_FRAGS, acc)     # P^T, split for the tensor cores
        ps = cuda.local.array(S_FRAGS, acc)
        gb = cuda.local.array(S_FRAGS, acc)     # dS^T, split
        gs = cuda.local.array(S_FRAGS, acc)

        stage(Kj, K, bh, j * Bc, Sk, Bc, tid, THREADS)
        stage(Vj, V, bh, j * Bc, Sk, Bc, tid, THREADS)
        for x in range(ACC):
            dk[x] = ZERO
            dv[x] = ZERO

        i_start, i_end = q_tile_range(j, Sq, causal_offset, 0)
        for i in range(i_start, i_end):
            cuda.syncthreads()
            stage_q(Qi, Q, bh, i * Br, Sq, Br, tid, THREADS)
            stage_q(dOi, dO, bh, i * Br, Sq, Br, tid, THREADS)
            for r in range(tid, Br, THREADS):
                row = i * Br + r
                L_i[r] = L[U(bh), U(row)] * LOG2E_ACC if row < Sq else ZERO
                D_i[r] = D[U(bh), U(row)] if row < Sq else ZERO
            cuda.syncthreads()

            for ch in range(Br // CHUNK):
                r0 = ch * CHUNK
                for x in range(S_FRAGS):
                    s[x] = ZERO
                    se[x] = ZERO
                    dp[x] = ZERO
                    dpe[x] = ZERO
                # S^T = Kj Qi^T, dP^T = Vj dOi^T: head dim outside, the chunk's n-tiles in
                for ks in range(KS):
                    ka = a_fragment(Kj, w0 + g, ks, t)
                    va = a_fragment(Vj, w0 + g, ks, t)
                    for nt in range(NT):
                        bt = (r0 + nt * 8 + g) * STRIDE + ks * 8 + t
                        b0b, b0s = load_q(Qi, bt)
                        b1b, b1s = load_q(Qi, bt + 4)
                        (s[nt * 4], s[nt * 4 + 1], s[nt * 4 + 2], s[nt * 4 + 3],
                         se[nt * 4], se[nt * 4 + 1], se[nt * 4 + 2], se[nt * 4 + 3]) = mma3(
                            ka, b0b, b1b, b0s, b1s,
                            s[nt * 4], s[nt * 4 + 1], s[nt * 4 + 2], s[nt * 4 + 3],
                            se[nt * 4], se[nt * 4 + 1], se[nt * 4 + 2], se[nt * 4 + 3])
                        b0b, b0s = load_q(dOi, bt)
                        b1b, b1s = load_q(dOi, bt + 4)
                        (dp[nt * 4], dp[nt * 4 + 1], dp[nt * 4 + 2], dp[nt * 4 + 3],
                         dpe[nt * 4], dpe[nt * 4 + 1], dpe[nt * 4 + 2], dpe[nt * 4 + 3]) = mma3(
                            va, b0b, b1b, b0s, b1s,
                            dp[nt * 4], dp[nt * 4 + 1], dp[nt * 4 + 2], dp[nt * 4 + 3],
                            dpe[nt * 4], dpe[nt * 4 + 1], dpe[nt * 4 + 2], dpe[nt * 4 + 3])
                # P^T and dS^T on the visible pairs, split for the tensor cores
                for nt in range(NT):
                    for x in range(4):
                        r = r0 + nt * 8 + 2 * t + x % 2
                        row = i * Br + r
                        col = key0 + 8 * (x // 2)
                        seen = row < Sq and col < Sk and (not causal
                                                         or col <= row + causal_offset)
                        y = nt * 4 + x
                        p = math.exp2((s[y] + se[y]) * scale_log2 - L_i[r]) if seen else ZERO
                        ds = p * ((dp[y] + dpe[y]) - D_i[r]) if seen else ZERO
                        pb[y], ps[y] = split_finite(p)
                        gb[y], gs[y] = split_finite(ds)
                # dVj += P^T dOi, dKj += dS^T Qi
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
                        pa = (pb[ks * 4], pb[ks * 4 + 2], pb[ks * 4 + 1], pb[ks * 4 + 3],
                              ps[ks * 4], ps[ks * 4 + 2], ps[ks * 4 + 1], ps[ks * 4 + 3])
                        ga = (gb[ks * 4], gb[ks * 4 + 2], gb[ks * 4 + 1], gb[ks * 4 + 3],
                              gs[ks * 4], gs[ks * 4 + 2], gs[ks * 4 + 1], gs[ks * 4 + 3])
                        bt = (r0 + ks * 8 + 2 * t) * STRIDE + nd * 8 + g
                        b0b, b0s = load_q(dOi, bt)
                        b1b, b1s = load_q(dOi, bt + STRIDE)
                        c0, c1, c2, c3, e0, e1, e2, e3 = mma3(
                            pa, b0b, b1b, b0s, b1s, c0, c1, c2, c3, e0, e1, e2, e3)
                        b0b, b0s = load_q(Qi, bt)
                        b1b, b1s = load_q(Qi, bt + STRIDE)
                        f0, f1, f2, f3, h0, h1, h2, h3 = mma3(
                            ga, b0b, b1b, b0s, b1s, f0, f1, f2, f3, h0, h1, h2, h3)
                    dv[nd * 4] += c0 + e0
                    dv[nd * 4 + 1] += c1 + e1
                    dv[nd * 4 + 2] += c2 + e2
                    dv[nd * 4 + 3] += c3 + e3
                    dk[nd * 4] += f0 + h0
                    dk[nd * 4 + 1] += f1 + h1
                    dk[nd * 4 + 2] += f2 + h2
                    dk[nd * 4 + 3] += f3 + h3

        for nd in range(KS):
            for x in range(4):
                col = key0 + 8 * (x // 2)
                k = nd * 8 + 2 * t + x % 2
                if col < Sk and k < d:
                    dK[U(bh), U(col), U(k)] = dk[nd * 4 + x] * softmax_scale
                    dV[U(bh), U(col), U(k)] = dv[nd * 4 + x]

    return backward_dkdv_v6


@functools.lru_cache(maxsize=None)
def make_backward_dq_v6(Br, Bc, d, causal, chunk=None, pairs=False):
    """v6 dQ kernel: v5's with v6's changes (see make_backward_dkdv_v6; GPU only,
    finite inputs); ``chunk``: the keys of Kj a step takes; ``pairs``: Kj and Vj split
    once as staged (as make_backward_dkdv_v6's Qi and dOi). Launch as v5: grid
    (ceil(Sq / Br), BH), block (2 * Br,), END * 4 bytes (``dq_v5_shared_layout(Br, Bc, d,
    pairs)``)."""
    split_finite, stage, a_fragment, mma3, load_split, _ = _make_v6_helpers(d)
    stage_kv, load_kv = _streamed_tile_steps(d, pairs, Bc)
    acc = acc_type("float32")
    ZERO = acc(0)
    CHUNK = V6_CHUNK if chunk is None else chunk
    assert Br % 16 == 0 and Bc % CHUNK == 0 and CHUNK % 8 == 0, (Br, Bc, CHUNK)
    LOG2E_ACC = acc(LOG2E)
    THREADS = 2 * Br
    DP = (d + 7) // 8 * 8
    KS = DP // 8
    NT = CHUNK // 8
    ACC = KS * 4
    S_FRAGS = NT * 4
    _, STRIDE = v5_head_dim(d)
    Q_AT, dO_AT, K_AT, V_AT, END = dq_v5_shared_layout(Br, Bc, d, pairs)
    kv_tile_range = make_kv_tile_range(Br, Bc, causal, False)

    @cuda.jit(**jit_options())
    def backward_dq_v6(Q, K, V, dO, L, D, dQ, softmax_scale, causal_offset):
        bh = cuda.blockIdx.y
        i = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        lane = tid % 32
        g = lane // 4
        t = lane % 4
        w0 = (tid // 32) * 16
        row0 = i * Br + w0 + g
        Sq = Q.shape[1]
        Sk = K.shape[1]
        scale_log2 = softmax_scale * LOG2E_ACC     # exp(x) = exp2(x log2(e))

        smem = cuda.shared.array(0, acc)
        Qi = smem[Q_AT:dO_AT]
        dOi = smem[dO_AT:K_AT]
        Kj = smem[K_AT:V_AT]
        Vj = smem[V_AT:END]
        dq = cuda.local.array(ACC, acc)
        s = cuda.local.array(S_FRAGS, acc)
        se = cuda.local.array(S_FRAGS, acc)
        dp = cuda.local.array(S_FRAGS, acc)
        dpe = cuda.local.array(S_FRAGS, acc)
        gb = cuda.local.array(S_FRAGS, acc)
        gs = cuda.local.array(S_FRAGS, acc)
        Lr = cuda.local.array(2, acc)
        Dr = cuda.local.array(2, acc)

        # Rows past Sq are staged as zeros; rows that see no key have every P = 0 (the
        # inputs are finite, so their q and dO cannot reach other rows through 0 * NaN).
        stage(Qi, Q, bh, i * Br, Sq, Br, tid, THREADS)
        stage(dOi, dO, bh, i * Br, Sq, Br, tid, THREADS)
        for h in range(2):
            row = row0 + 8 * h
            Lr[h] = L[U(bh), U(row)] * LOG2E_ACC if row < Sq else ZERO
            Dr[h] = D[U(bh), U(row)] if row < Sq else ZERO
        for x in range(ACC):
            dq[x] = ZERO

        j_start, j_end = kv_tile_range(i, Sk, causal_offset, 0)
        for j in range(j_start, j_end):
            cuda.syncthreads()
            stage_kv(Kj, K, bh, j * Bc, Sk, Bc, tid, THREADS)
            stage_kv(Vj, V, bh, j * Bc, Sk, Bc, tid, THREADS)
            cuda.syncthreads()

            for ch in range(Bc // CHUNK):
                c_0 = ch * CHUNK
                for x in range(S_FRAGS):
                    s[x] = ZERO
                    se[x] = ZERO
                    dp[x] = ZERO
                    dpe[x] = ZERO
                for ks in range(KS):
                    qa = a_fragment(Qi, w0 + g, ks, t)
                    oa = a_fragment(dOi, w0 + g, ks, t)
                    for nt in range(NT):
                        bt = (c_0 + nt * 8 + g) * STRIDE + ks * 8 + t
                        b0b, b0s = load_kv(Kj, bt)
                        b1b, b1s = load_kv(Kj, bt + 4)
                        (s[nt * 4], s[nt * 4 + 1], s[nt * 4 + 2], s[nt * 4 + 3],
                         se[nt * 4], se[nt * 4 + 1], se[nt * 4 + 2], se[nt * 4 + 3]) = mma3(
                            qa, b0b, b1b, b0s, b1s,
                            s[nt * 4], s[nt * 4 + 1], s[nt * 4 + 2], s[nt * 4 + 3],
                            se[nt * 4], se[nt * 4 + 1], se[nt * 4 + 2], se[nt * 4 + 3])
                        b0b, b0s = load_kv(Vj, bt)
                        b1b, b1s = load_kv(Vj, bt + 4)
                        (dp[nt * 4], dp[nt * 4 + 1], dp[nt * 4 + 2], dp[nt * 4 + 3],
                         dpe[nt * 4], dpe[nt * 4 + 1], dpe[nt * 4 + 2], dpe[nt * 4 + 3]) = mma3(
                            oa, b0b, b1b, b0s, b1s,
                            dp[nt * 4], dp[nt * 4 + 1], dp[nt * 4 + 2], dp[nt * 4 + 3],
                            dpe[nt * 4], dpe[nt * 4 + 1], dpe[nt * 4 + 2], dpe[nt * 4 + 3])
                for nt in range(NT):
                    for x in range(4):
                        h = x // 2
                        row = row0 + 8 * h
                        col = j * Bc + c_0 + nt * 8 + 2 * t + x % 2
                        seen = row < Sq and col < Sk and (not causal
                                                         or col <= row + causal_offset)
                        y = nt * 4 + x
                        p = math.exp2((s[y] + se[y]) * scale_log2 - Lr[h]) if seen else ZERO
                        ds = p * ((dp[y] + dpe[y]) - Dr[h]) if seen else ZERO
                        gb[y], gs[y] = split_finite(ds)
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
                        ga = (gb[ks * 4], gb[ks * 4 + 2], gb[ks * 4 + 1], gb[ks * 4 + 3],
                              gs[ks * 4], gs[ks * 4 + 2], gs[ks * 4 + 1], gs[ks * 4 + 3])
                        bt = (c_0 + ks * 8 + 2 * t) * STRIDE + nd * 8 + g
                        b0b, b0s = load_kv(Kj, bt)
                        b1b, b1s = load_kv(Kj, bt + STRIDE)
                        c0, c1, c2, c3, e0, e1, e2, e3 = mma3(
                            ga, b0b, b1b, b0s, b1s, c0, c1, c2, c3, e0, e1, e2, e3)
                    dq[nd * 4] += c0 + e0
                    dq[nd * 4 + 1] += c1 + e1
                    dq[nd * 4 + 2] += c2 + e2
                    dq[nd * 4 + 3] += c3 + e3

        for nd in range(KS):
            for x in range(4):
                row = row0 + 8 * (x // 2)
                k = nd * 8 + 2 * t + x % 2
                if row < Sq and k < d:
                    dQ[U(bh), U(row), U(k)] = dq[nd * 4 + x] * softmax_scale

    return backward_dq_v6
