"""Split-KV decoding on the 16-bit tensor cores, transposed: the keys and the head dim on
the mma's M side, a GQA group's few query rows on its N side.

Parent: split_kv_mma.py. What stays the parent's: the split of a batch's keys over
blocks, the tiles of TILE_KEYS keys and values copied by cp.async into two stages of
shared memory and tested for NaN and inf where the parent tests them (its
``make_staging``, shared), the variants per (query row, key), the warps' logsumexp merge
in the parent's order, the combine after it, and the launch arguments. What changes is
which operand holds the query rows, and where the tiles' rows lie:

* The parent puts a block's query rows on the mma's M side (16 rows), so with a GQA group
  of four and one new token 12 of every 16 rows are padding, and each lane keeps 64 floats
  of O (16 rows x 128 columns over 32 lanes). Here the products are transposed:
  S^T = K Q^T (A = 16 keys x 16 head-dim columns from ``ldmatrix``, B = Q^T, the rows
  on N = 8) and O^T += V^T P~^T (A = 16 head-dim columns x 16 keys from
  ``ldmatrix.trans``, B = P~^T). A block holds ROWS = 8 query rows; per 16 keys a warp
  makes KS + DP / 16 products where the parent makes 2 KS + DP / 8 (16 against 32 at
  d = 128), a lane keeps 32 floats of O^T, exponentiates 4 scores and rescales 32
  accumulators (the parent: 8 and 64).
* P~^T from S^T's accumulator: a lane holds S^T[key g, rows 2t, 2t + 1] and [key g + 8,
  ...]; the B operand wants P~^T[keys 2t, 2t + 1, row g]. Rounded to 16 bits and packed,
  each 8 x 8 half is transposed in registers by ``movmatrix`` (kernels/ptx.py).
* A row's running max and sum are over the 8 lanes that share its column (lanes t, t + 4,
  ..., shuffles by 4, 8 and 16) instead of a quad; its rescale factor is then in the
  lanes that hold its column of O^T, with no shuffle.
* The stages' rows are swizzled (LAYOUT), not padded: each row a multiple of 128 bytes,
  its 16-byte piece q stored at piece q ^ (r % 8) of row r (``piece_at``). The 8
  threads that copy 128 contiguous bytes of a row fill one 128-byte line of shared
  memory, and the 8 rows an ldmatrix matrix reads lie in 8 different groups of banks.
  With forward v10's padded rows (272 bytes at d = 128), which the parent used until it
  took these too, those copies straddled two lines and L2 served about 1.5 sectors for
  each one needed.
* S^T's eight k-steps are summed in two chains (even and odd k-steps, added at the end),
  so two products are in flight where the parent's one chain waits on each; and the
  order of the additions differs from the parent's, so the two agree within rounding,
  not bit for bit.

What it buys: on an H100 at (1, 32/8, 1, 131072), float16, 33 splits, with padded rows
as the parent's, 0.2169 ms a call queued against the parent's 0.2240 (-3.2 %), 0.2704
against 0.2781 alone; bfloat16 0.2158 against 0.2218 queued; at (8, 32/8, 1, 32768)
within 1.5 % of the parent at every split count measured; out's error against the
float64 reference the parent's (6.13e-06 at b1-gqa, bound 4.28e-05;
lab/runs/2026-12-07/153_decode_kernels_queued.txt). Its swizzled rows then took it from
81 % to 84 % of DRAM throughput under Nsight Compute (198.6 to 190.8 us at b1-gqa, L2's
sectors from 25.2 M to the 16.8 M the caches need: 157_ncu_layouts.txt) and 3.6 % and 4.0 %
off a call queued at the two GQA shapes (157_decode_layouts.txt). It is the default for
the calls it takes
(numbaflash/policy.py's ``decode_kernel``). Needs what the parent needs (its
``refusal``), and at most ROWS query rows per K/V head (more take more blocks, each
reading the keys again: the parent takes those calls). Runs on the GPU (sm_80 and later)
and on the simulator (kernels/simulated.py's stand-ins for ldmatrix, movmatrix, cp.async,
mma and the shuffles).
"""

import functools
import math

from numba import cuda, int32
from numba.types import uint32

from .. import acc_type, jit_options
from ..halves import half_of, make_halves
from ..plan import Plan, variant_description
from ..ptx import (cp_async_commit, cp_async_wait_group, exp2_approx, flat_load, fmax,
                   ldmatrix_x4, ldmatrix_x4_trans, movmatrix_trans)
from ..smem import U
from ..variants import PLAIN, make_variant_functions
from ..warp import FULL_WARP
from . import split_kv_mma as parent
from .split_kv import make_split_keys
from .split_kv_mma import (CHUNK, THREADS, TILE_KEYS, WARPS, SharedBytes, check_build,
                           make_staging, make_write_rows, stage_layout)

ROWS = 8                        # query rows per block: the mma's N
MAX_REGISTERS = None            # no cap (ptxas's choice)
# Blocks per SM the planner fills with one wave (policy.default_num_splits): 2, as the
# parent's. An SM could hold three at d = 128 (74 KB of shared memory and 143-149
# registers a thread with padded rows; 70 KB and 165-168 swizzled), but on an H100,
# float16 and bfloat16, with padded rows, the counts that give three a SM were slower:
# at (1, 32/8, 1, 131072) 50 splits took 0.2337 ms a call queued against 0.2169 at 33
# (two a SM), 66 took 0.2453; under Nsight Compute 238 us at 50 splits with 18 % of the
# SM's warps active against the parent's 219 us at 33 with 12 %
# (lab/runs/2026-12-07/153_decode_kernels_queued.txt, 153_ncu_decode_kernels.txt).
BLOCKS_PER_SM = 2

# How a stage's rows of K and V lie in shared memory (the parent's LAYOUTS). "swizzled":
# the 16-byte pieces of each row permuted within 128-byte lines, so that every copy of 8
# threads fills one line and every ldmatrix reads 8 groups of banks; "padded": forward
# v10's rows. On an H100, float16, queued: 0.1981 ms against 0.2055
# at (1, 32/8, 1, 131072), 0.3653 against 0.3806 at (8, 32/8, 1, 32768)
# (lab/runs/2026-12-07/157_decode_layouts.txt). A lab switch, set before the plans are
# made; the same values in the same order, so the same bits.
LAYOUT = "swizzled"


def split_kv_mma_t_shared(d, stages=None, layout=None):
    """Shared memory of a block at head dim d, in bytes: ``dynamic`` the stages of K and V
    tiles (``stages``, by default the parent's STAGES; rows laid out as ``layout``, by
    default LAYOUT, says), ``static`` the warps' m and l per row, the merged O (ROWS x d
    padded to 16, float32) and three int32 flags."""
    stages = parent.STAGES if stages is None else stages
    layout = LAYOUT if layout is None else layout
    DP = (d + 15) // 16 * 16
    return SharedBytes(2 * stages * stage_layout(d, layout).TILE * 2,
                       4 * (2 * WARPS * ROWS + ROWS * DP) + 4 * 3)


def rows_per_block(rows_needed, d):
    """The query rows one block holds: always ROWS (the mma's N; rows past the group x Sq
    rows of a K/V head are zeros)."""
    return ROWS


@cuda.jit(device=True, inline=True)
def column_max(x):
    """The max over the 8 lanes that share an accumulator column (lanes t, t + 4, ...,
    t + 28); '>' so that NaN does not win, as quad_max."""
    for step in (4, 8, 16):
        y = cuda.shfl_xor_sync(FULL_WARP, x, step)
        x = y if y > x else x
    return x


@cuda.jit(device=True, inline=True)
def column_sum(x):
    """The sum over the 8 lanes that share an accumulator column (see column_max)."""
    for step in (4, 8, 16):
        x += cuda.shfl_xor_sync(FULL_WARP, x, step)
    return x


@functools.lru_cache(maxsize=None)
def make_split_kv_mma_t(d, causal, variant=PLAIN, half="float16", finite_tests="edges",
                        stages=2, layout="swizzled", l2_prefetch=None):
    """The transposed tensor-core split-KV kernel; arguments as the parent's
    ``make_split_kv_mma``; ``layout``, how a stage's rows lie in shared memory (the
    parent's LAYOUTS: LAYOUT here), and ``l2_prefetch``, the parent's L2_PREFETCH.

    Launch and arguments: the parent's, with ``split_kv_mma_t_shared(d, stages,
    layout).dynamic`` bytes of dynamic shared memory and grid (splits, row tiles of ROWS,
    B * Hk). Block (split, tile, b * Hk + hk) holds rows rr = tile * ROWS + r, r < ROWS,
    of the (batch, K/V head). Lane (g, t) = (lane // 4, lane % 4) gives Q^T's B operand
    for row g, and holds S^T and O^T for rows 2t and 2t + 1 (keys g and g + 8 of the
    warp's 16; head-dim columns g and g + 8 of each 16). Per tile j, as the parent, then
    for warp w's keys 16 w ... 16 w + 15:

        S^T = K Q^T              KS ldmatrix.x4, KS mma (two chains)
        mask, score              visible() and score() per entry (variants.py)
        online-softmax step      column max, exp2, rescale O^T, P~ rounded to 16 bits
        P~^T                     2 movmatrix
        O^T += V^T P~^T          DP / 16 ldmatrix.x4.trans, DP / 16 mma
    """
    check_build(d, half, finite_tests, stages)
    halves = make_halves(half)
    HALF = halves.storage
    widen, narrow, pack2, mma = halves.widen, halves.narrow, halves.pack2, halves.mma
    acc = acc_type("float32")
    ZERO = acc(0)
    NEG_INF = acc(-math.inf)
    LOG2E = acc(1.4426950408889634)
    DP = (d + 15) // 16 * 16                # head dim padded to the mma's k = 16
    KS = DP // 16                           # k-steps of S^T = K Q^T
    MT = DP // 16                           # m-tiles of 16 head-dim columns of O^T
    Q_WORDS = KS * 2
    O_FRAGS = MT * 4
    TILE = stage_layout(d, layout).TILE
    K_AT = 0
    V_AT = stages * TILE                    # K's stages first, then V's
    AHEAD = stages - 1                      # tiles in flight while the warps use one
    WINDOW = variant.window
    SCORES = variant.softcap or variant.alibi
    EVERY_TILE = finite_tests == "every"
    visible, score = make_variant_functions(variant, causal, "float32")
    split_keys = make_split_keys(causal, WINDOW)
    write_rows = make_write_rows(d, ROWS, half)
    staging = make_staging(d, half, stages, layout, l2_prefetch)
    piece_at = staging.piece_at
    finite, start_copies, test_copies, nonfinite_terms = (
        staging.finite, staging.start_copies, staging.test_copies, staging.nonfinite_terms)

    @cuda.jit(device=True, inline=True)
    def add_nonfinite_scores(s, Q, K, b, h0, i0, h1, i1, real0, real1, k_base, k_row, key0,
                             last, g):
        """Rare: a non-finite q or k was staged as 0; add its terms to this lane's scores
        s (s[x]: key key0 + g + 8 (x // 2), row 2t + x % 2) of the block's real rows."""
        for x in range(4):
            key = key0 + g + 8 * (x // 2)
            real = real0 if x % 2 == 0 else real1
            if real and key < last:
                s[x] += nonfinite_terms(Q, K, b, h0 if x % 2 == 0 else h1,
                                        i0 if x % 2 == 0 else i1, k_base + key * k_row)

    @cuda.jit(device=True, inline=True)
    def add_nonfinite_values(o, s, V, b, h0, i0, h1, i1, sees_any0, sees_any1, v_base, v_row,
                             key0, last, n, causal_offset, window_lo, attn_mask, g, t):
        """Rare: a non-finite v of this warp's keys (from key0) was staged as 0; add p * v
        for those values to the O^T fragments (columns g, g + 8 of each 16; rows 2t, 2t + 1)
        of the rows that see the key. P~ of key kk for rows 2t, 2t + 1 is in lane (kk % 8,
        t), s[2 (kk // 8)] and s[2 (kk // 8) + 1]."""
        kk = 0
        while kk < CHUNK:
            x0 = s[0] if kk < 8 else s[2]
            x1 = s[1] if kk < 8 else s[3]
            p0 = cuda.shfl_sync(FULL_WARP, x0, (kk % 8) * 4 + t)
            p1 = cuda.shfl_sync(FULL_WARP, x1, (kk % 8) * 4 + t)
            key = key0 + kk
            if key < last:
                sees0 = sees_any0 and visible(b, h0, i0, key, n, causal_offset, window_lo,
                                              attn_mask)
                sees1 = sees_any1 and visible(b, h1, i1, key, n, causal_offset, window_lo,
                                              attn_mask)
                for mt in range(MT):
                    for e in range(2):
                        c = mt * 16 + g + 8 * e
                        if c < d:
                            v = widen(flat_load(V, U(v_base + key * v_row + c)))
                            if not finite(v):
                                if sees0:
                                    o[mt * 4 + 2 * e] += p0 * v
                                if sees1:
                                    o[mt * 4 + 2 * e + 1] += p1 * v
            kk += 1

    @cuda.jit(device=True, inline=True)
    def masked_scores(s, softmax_scale, b, h0, i0, h1, i1, key0, last, n, Sq, causal_offset,
                      window_lo, softcap, slopes, attn_mask, g):
        """Alg.1 l.8-9 after the product: each of this lane's scores (keys key0 + g,
        + 8; rows 2t, 2t + 1) scaled and passed through the variant's score if its row
        sees its key, else -inf (split_kv's visible() and score(), per entry)."""
        for x in range(4):
            key = key0 + g + 8 * (x // 2)
            h = h0 if x % 2 == 0 else h1
            i = i0 if x % 2 == 0 else i1
            if key < last and visible(b, h, i, key, n, causal_offset, window_lo, attn_mask):
                if SCORES:
                    s[x], _ = score(s[x] * softmax_scale, b, h, i, key, Sq, n, softcap,
                                    slopes, attn_mask)
                else:
                    s[x] *= softmax_scale
            else:
                s[x] = NEG_INF

    @cuda.jit(**jit_options(MAX_REGISTERS))
    def split_kv_mma_t(Q, K, V, seqlens, n_new, O, L, O_parts, L_parts, softmax_scale,
                       upper_shift, lower_shift, Hq, group, softcap, slopes, attn_mask, S_max,
                       k_batch, k_head, k_row, v_batch, v_head, v_row):
        split = cuda.blockIdx.x
        n_splits = cuda.gridDim.x
        tile = cuda.blockIdx.y
        bhk = cuda.blockIdx.z               # b * Hk + hk: the K/V head
        Hk = Hq // group
        b = bhk // Hk
        hk = bhk % Hk
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        g = lane // 4
        t = lane % 4
        Sq = Q.shape[2]
        n_rows = group * Sq                 # the rows that read this K/V head

        # This batch's keys, the band its rows see, this split's share (split_kv's).
        keys = split_keys(seqlens, b, n_new, S_max, Sq, upper_shift, lower_shift, split,
                          n_splits)
        n, causal_offset, window_lo = keys.n, keys.causal_offset, keys.window_lo
        first, last = keys.first, keys.last

        # This lane's rows of S^T and O^T, 2t and 2t + 1: their query head and row (a
        # padded row, past the group's last, takes the last one's: its scores are
        # computed, never written); and row g, whose Q^T column this lane gives the mma.
        rr0 = tile * ROWS + 2 * t
        rr1 = rr0 + 1
        real0 = rr0 < n_rows
        real1 = rr1 < n_rows
        c0 = min(rr0, n_rows - 1)
        c1 = min(rr1, n_rows - 1)
        h0 = hk * group + c0 // Sq
        i0 = c0 % Sq
        h1 = hk * group + c1 // Sq
        i1 = c1 % Sq
        rq = tile * ROWS + g
        real_q = rq < n_rows
        cq = min(rq, n_rows - 1)
        hq = hk * group + cq // Sq
        iq = cq % Sq
        k_base = b * k_batch + hk * k_head
        v_base = b * v_batch + hk * v_head
        # The row this lane gives ldmatrix: matrix m = lane // 8 is keys 8 (m % 2) +
        # lane % 8 by columns 8 (m // 2) for K (A of S^T: a0 keys 0-7, a1 keys 8-15, a2
        # and a3 the next 8 columns), keys 8 (m // 2) + lane % 8 by columns 8 (m % 2) for
        # V (transposed, A of O^T: a0 columns 0-7 by keys 0-7, a1 columns 8-15, a2 and a3
        # keys 8-15).
        m = lane // 8
        k_lane = warp * CHUNK + 8 * (m % 2) + lane % 8     # its row of K's stage
        v_lane = warp * CHUNK + 8 * (m // 2) + lane % 8     # and of V's
        HZERO = narrow(ZERO)

        # The stages of K and V tiles, on a 128-byte line (LAYOUT "swizzled")
        smem = cuda.shared.array(0, HALF, alignment=128)
        bad = cuda.shared.array(3, int32)       # non-finite q, k, v staged as 0
        m_w = cuda.shared.array((WARPS, ROWS), acc)         # each warp's m and l per row
        l_w = cuda.shared.array((WARPS, ROWS), acc)
        o_w = cuda.shared.array((ROWS, DP), acc)            # the warps' O, merged
        q = cuda.local.array(Q_WORDS, uint32)   # Q^T's B fragments
        o = cuda.local.array(O_FRAGS, acc)      # O^T fragments
        s = cuda.local.array(4, acc)            # S^T, then P~^T, of the warp's 16 keys

        if tid == 0:
            bad[0] = 0
            bad[1] = 0
            bad[2] = 0
        # Wait until bad is clear.
        cuda.syncthreads()
        n_tiles = (last - first + TILE_KEYS - 1) // TILE_KEYS if last > first else 0
        for ahead in range(AHEAD):          # tiles 0 ... stages - 2, one group each
            if ahead < n_tiles:
                start_copies(smem, K, V, k_base, v_base, k_row, v_row,
                             first + ahead * TILE_KEYS, last, ahead, tid, HZERO)
            cp_async_commit()
        # Alg.1 l.4: Q^T's B fragments (b0: columns 2t, 2t + 1 of row g's q in a k-step,
        # b1: columns 2t + 8, 2t + 9; zero past the real rows and d; a non-finite q is
        # staged as 0 and flagged, as the parent stages it).
        for ks in range(KS):
            for w in range(2):
                col = ks * 16 + 2 * t + 8 * w
                x = widen(Q[U(b), U(hq), U(iq), U(col)]) if real_q and col < d else ZERO
                y = widen(Q[U(b), U(hq), U(iq), U(col + 1)]) if real_q and col + 1 < d \
                    else ZERO
                if not (finite(x) and finite(y)):
                    bad[0] = 1
                    x = x if finite(x) else ZERO
                    y = y if finite(y) else ZERO
                q[ks * 2 + w] = pack2(x, y)
        for x in range(O_FRAGS):
            o[x] = ZERO
        m0 = NEG_INF            # running max of rows 2t and 2t + 1 (the same in a column)
        m1 = NEG_INF
        l0 = ZERO               # this lane's part of the running sums (keys g, g + 8)
        l1 = ZERO

        for j in range(n_tiles):
            st = j % stages
            mark = int32(j + 1)
            key_first = first + j * TILE_KEYS
            # Wait until every warp has finished reading the stage of tile j - 1, where
            # tile j + stages - 1 goes.
            cuda.syncthreads()
            if j + AHEAD < n_tiles:
                start_copies(smem, K, V, k_base, v_base, k_row, v_row,
                             key_first + AHEAD * TILE_KEYS, last, (j + AHEAD) % stages, tid,
                             HZERO)
            cp_async_commit()               # (empty at the last tiles: the count stays)
            # This thread's copies of tile j have landed (at most AHEAD groups after it).
            if stages == 2:
                cp_async_wait_group(1)
            else:
                cp_async_wait_group(2)
            # The parent's edge tiles: tested for NaN and inf where some real row does not
            # see some key of the tile, or q holds one.
            edge = (EVERY_TILE or bad[0] != 0
                    or (causal and key_first + TILE_KEYS - 1 > causal_offset)
                    or (WINDOW and key_first < Sq - 1 + window_lo))
            if edge:
                test_copies(smem, bad, mark, key_first, last, st, tid, HZERO)
            # Wait until the tile is complete and tested (and, at j = 0, bad[0] set).
            cuda.syncthreads()
            fix_scores = bad[0] != 0 or bad[1] == mark      # the same in every thread
            fix_values = bad[2] == mark
            key0 = key_first + warp * CHUNK                 # this warp's 16 keys
            if key0 < last:                                 # (uniform in the warp)
                # Alg.1 l.8: S^T = K Q^T, the even and odd k-steps in two chains.
                KJ = K_AT + st * TILE
                acc_a = (ZERO, ZERO, ZERO, ZERO)
                acc_b = (ZERO, ZERO, ZERO, ZERO)
                for ks in range(0, KS, 2):
                    a0, a1, a2, a3 = ldmatrix_x4(
                        smem, U(KJ + piece_at(k_lane, 16 * ks + 8 * (m // 2))))
                    acc_a = mma(a0, a1, a2, a3, q[ks * 2], q[ks * 2 + 1],
                                acc_a[0], acc_a[1], acc_a[2], acc_a[3])
                    if ks + 1 < KS:
                        a0, a1, a2, a3 = ldmatrix_x4(
                            smem, U(KJ + piece_at(k_lane, 16 * ks + 16 + 8 * (m // 2))))
                        acc_b = mma(a0, a1, a2, a3, q[ks * 2 + 2], q[ks * 2 + 3],
                                    acc_b[0], acc_b[1], acc_b[2], acc_b[3])
                for x in range(4):
                    s[x] = acc_a[x] + acc_b[x]
                if fix_scores:          # rare: a non-finite q or k was staged as 0
                    add_nonfinite_scores(s, Q, K, b, h0, i0, h1, i1, real0, real1, k_base,
                                         k_row, key0, last, g)
                masked_scores(s, softmax_scale, b, h0, i0, h1, i1, key0, last, n, Sq,
                              causal_offset, window_lo, softcap, slopes, attn_mask, g)
                # Alg.1 l.9: the new running max of rows 2t, 2t + 1 over their column's
                # 8 lanes (fmax: NaN does not win), P~ = exp(S - m) in s, the rescale
                # factors.
                mt0 = column_max(fmax(s[0], s[2]))
                mt1 = column_max(fmax(s[1], s[3]))
                mn0 = mt0 if mt0 > m0 else m0
                mn1 = mt1 if mt1 > m1 else m1
                ms0 = ZERO if mn0 == NEG_INF else mn0    # no key seen yet: avoid -inf - -inf
                ms1 = ZERO if mn1 == NEG_INF else mn1
                alpha0 = exp2_approx((m0 - ms0) * LOG2E)
                alpha1 = exp2_approx((m1 - ms1) * LOG2E)
                for e in range(2):
                    s[2 * e] = exp2_approx(s[2 * e] * LOG2E - ms0 * LOG2E)
                    s[2 * e + 1] = exp2_approx(s[2 * e + 1] * LOG2E - ms1 * LOG2E)
                l0 = alpha0 * l0 + (s[0] + s[2])
                l1 = alpha1 * l1 + (s[1] + s[3])
                m0 = mn0
                m1 = mn1
                # P~ rounded to the cache's type, each 8 x 8 half of P~^T (keys g, rows
                # 2t, 2t + 1) transposed into the B operand (keys 2t, 2t + 1, row g).
                p0 = movmatrix_trans(pack2(s[0], s[1]))
                p1 = movmatrix_trans(pack2(s[2], s[3]))
                # Alg.1 l.10: O^T = O^T diag(alpha) + V^T P~^T; c0, c2 are row 2t's.
                VJ = V_AT + st * TILE
                for mt in range(MT):
                    a0, a1, a2, a3 = ldmatrix_x4_trans(
                        smem, U(VJ + piece_at(v_lane, 16 * mt + 8 * (m % 2))))
                    acc_a = mma(a0, a1, a2, a3, p0, p1, o[mt * 4] * alpha0,
                                o[mt * 4 + 1] * alpha1, o[mt * 4 + 2] * alpha0,
                                o[mt * 4 + 3] * alpha1)
                    for x in range(4):
                        o[mt * 4 + x] = acc_a[x]
                if fix_values:          # rare: a non-finite v was staged as 0
                    add_nonfinite_values(o, s, V, b, h0, i0, h1, i1, real0, real1, v_base,
                                         v_row, key0, last, n, causal_offset, window_lo,
                                         attn_mask, g, t)

        # Merge the four warps by their logsumexp, in the parent's order: each warp's
        # weight exp(m_w - M) for the block's max M of the row, its weighted O added into
        # o_w one warp after another, warp 0 first.
        l0 = column_sum(l0)
        l1 = column_sum(l1)
        if g == 0:
            m_w[warp, 2 * t] = m0
            m_w[warp, 2 * t + 1] = m1
            l_w[warp, 2 * t] = l0
            l_w[warp, 2 * t + 1] = l1
        # Wait until every warp's m and l are in shared memory.
        cuda.syncthreads()
        top0 = NEG_INF
        top1 = NEG_INF
        for w in range(WARPS):              # '>' keeps NaN out of the max
            if m_w[w, 2 * t] > top0:
                top0 = m_w[w, 2 * t]
            if m_w[w, 2 * t + 1] > top1:
                top1 = m_w[w, 2 * t + 1]
        top0 = ZERO if top0 == NEG_INF else top0
        top1 = ZERO if top1 == NEG_INF else top1
        weight0 = math.exp(m0 - top0) if l0 != ZERO else ZERO
        weight1 = math.exp(m1 - top1) if l1 != ZERO else ZERO
        for w in range(WARPS):
            if warp == w:
                for mt in range(MT):
                    for e in range(2):
                        col = mt * 16 + g + 8 * e
                        x0 = weight0 * o[mt * 4 + 2 * e] if l0 != ZERO else ZERO
                        x1 = weight1 * o[mt * 4 + 2 * e + 1] if l1 != ZERO else ZERO
                        if w == 0:
                            o_w[2 * t, col] = x0
                            o_w[2 * t + 1, col] = x1
                        else:
                            o_w[2 * t, col] += x0
                            o_w[2 * t + 1, col] += x1
            # Wait until warp w's share is added before the next warp adds its own.
            cuda.syncthreads()
        # Alg.1 l.12-13: each row's merged O over its sum, and its lse (the parent's
        # write_rows)
        write_rows(m_w, l_w, o_w, O, L, O_parts, L_parts, tile, b, hk, Hq, group, Sq,
                   n_rows, split, n_splits, tid)

    return split_kv_mma_t


# --- the launch contract ------------------------------------------------------------


def refusal(p):
    """Why this kernel does not take CacheProblem ``p``, or None if it does: the parent's
    conditions (``split_kv_mma.refusal``), and at most ROWS query rows per K/V head (the
    group x Sq rows of a call with more would take several blocks, each reading the
    keys again; the parent holds 16)."""
    why = parent.refusal(p)
    if why is not None:
        return why
    if p.group * p.Sq > ROWS:
        return (f"{p.group * p.Sq} query rows per K/V head (the transposed decode kernel "
                f"holds {ROWS} a block; the parent holds 16)")
    return None


def plan(p, where, n_splits, reason):
    """The Plan of this kernel for CacheProblem ``p`` and ``n_splits`` splits: grid
    (n_splits, row tiles, B * Hk), block (THREADS,), dynamic shared memory."""
    rows_needed = p.group * p.Sq
    tiles = math.ceil(rows_needed / ROWS)
    reason += (f"; the {rows_needed} query rows that read each K/V head ({p.group} heads x "
               f"{p.Sq} rows) on the N side of the tensor cores' products (keys and head "
               f"dims on M), {ROWS} a block; {WARPS} warps taking {CHUNK} keys each of "
               f"every {TILE_KEYS}-key tile, copied 16 bytes at a time into "
               f"{('two', 'three')[parent.STAGES - 2]} stages of shared memory")
    return Plan("kvcache", "split_kv_mma_t", "split_kv_mma_t", where, None, None,
                (n_splits, tiles, p.B * p.Hk), (THREADS,),
                split_kv_mma_t_shared(p.d, parent.STAGES, LAYOUT).dynamic,
                p.acc_dtype, "bottom_right" if p.causal else None, reason,
                variant_description(p), dynamic_shared=True)


def kernel(plan, p):
    """The compiled kernel of ``plan`` (cached per compile-time parameters)."""
    return make_split_kv_mma_t(p.d, p.upper, p.variant, half_of(p.dtype) or "float16",
                               parent.FINITE_TESTS, parent.STAGES, LAYOUT,
                               parent.L2_PREFETCH)
