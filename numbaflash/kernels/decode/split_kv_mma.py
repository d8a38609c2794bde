"""Split-KV decoding on the 16-bit tensor cores: a block's query rows are the 16 rows of
an m16n8k16 product, and its keys and values reach the tensor cores through shared
memory (float16 and bfloat16 caches).

Parent: split_kv.py, with forward v10's staging (forward/v10_ldmatrix.py). What stays
split_kv's: the split of a batch's keys over blocks (reference.split_ranges' rule), the
band and the variants per (query row, key) (kernels/variants.py's ``visible`` and
``score``, with each row's own query head and position), the warps' logsumexp merge at
the end (its sums in ``merge_warps``' order), the combine kernel after
it and the launch arguments. What changes is the work per key:

* Rows on the tensor cores. split_kv gives a warp's 32 lanes the head-dim columns of one
  or two query rows and reduces every score over the warp (shuffles, and an online-softmax
  step per row and key). Here a block holds up to ROWS = 16 of the group x Sq rows that
  read one K/V head (four query heads of a GQA group of four, with Sq = 1, take four of
  them; the rest are zeros, never written): S = Q K^T and O += P~ V are m16n8k16 products,
  each warp's lane holding two rows of S and O in the mma's accumulator layout, as forward
  v10's warps do. With GQA each key and value is read once for the whole group (split_kv:
  once per two rows).
* Keys and values through shared memory. The block copies tiles of TILE_KEYS = 64 keys
  and their values by cp.async (16 bytes a copy) into two stages, the next tile on its
  way while the warps use this one. Their rows are swizzled (LAYOUT): each a multiple of
  128 bytes, its 16-byte piece q at piece q ^ (r % 8) of row r, so the 8 rows an
  ldmatrix matrix reads lie in 8 different groups of banks and 8 threads' copies of 128
  contiguous bytes fill one line of shared memory (forward v10's padded rows, the other
  LAYOUTS choice, split those copies and made L2 serve about 1.5 sectors for each one
  needed: split_kv_mma_t.LAYOUT cites the measurement); warp w takes keys 16 w to
  16 w + 15 of each tile, its B fragments from ``ldmatrix`` (K) and ``ldmatrix.trans``
  (V, stored as the cache stores it). A whole tile (32 KB at d = 128) is in flight per
  block, where split_kv's loads had 8 keys per warp in registers; with STAGES = 3 (a lab
  switch, not the default) two tiles are.
* Non-finite values. Where every real row sees every key of a tile (all of them at
  Sq = 1 without a window), the products carry NaN and inf as the reference's do (q . k
  and P V in IEEE arithmetic; a padded row's NaN is never written). Where some row does
  not see some key (``FINITE_TESTS = "edges"``: the tiles at the end of a causal band or
  the edge of a window, and every tile once q holds a NaN or inf) a product with P~ = 0
  would turn a NaN or inf of that key into a NaN in that row, so those tiles are treated
  as forward v10 treats every tile: each thread tests the pieces it copied (in shared
  memory), zeroes a NaN or inf there and flags the tile; the products then miss those
  terms, and the flagged tile's fix-ups add them back from the caches
  (``add_nonfinite_scores``, ``add_nonfinite_values``) for the rows that see them.
  ``FINITE_TESTS = "every"`` tests every tile (the test reads each piece back from
  shared memory: 64 32-bit loads a thread per tile at d = 128).
* P~ is rounded to the cache's type for P~ V (as forward v7 and v10 round it) and the
  exponentials are ``ptx.exp2_approx`` (as mma_rows' softmax step): split_kv multiplies
  in float32 throughout, so the two agree within rounding, not bit for bit.

What it buys: the per-(row, key) work leaves the CUDA cores, and each key is read once
for a whole GQA group. Under Nsight Compute on an H100, float16, d = 128, padded rows
(lab/runs/2026-12-06/121_ncu_decode_durations.txt): 0.388 ms against split_kv's 0.682 at
(8, 32/8, 1, 32768) and 0.207 against 0.335 at (1, 32/8, 1, 131072), 0.86-0.92 of that
GPU's copy bandwidth. With one query row per K/V head it was the slower of the two
(``refusal`` cites it), and split_kv runs those calls. docs/performance.md, "Decoding",
has the rest, and why a whole call is still far slower than its kernel.

Needs: float16 or bfloat16 caches, more than one query row per K/V head, d <=
MAX_HEAD_DIM a multiple of 8, and caches whose rows start 16-byte aligned (first elements
aligned, strides multiples of 8 elements):
``refusal`` says which is missing, and numbaflash/policy.py's ``decode_kernel`` then runs
split_kv. Runs on the GPU (sm_80 and later) and on the simulator (kernels/simulated.py's
stand-ins for ldmatrix, cp.async, mma and the shuffles).
"""

import functools
import math
from collections import namedtuple

import numpy as np
from numba import cuda, int32
from numba.types import uint32

from .. import acc_type, jit_options
from ..forward.v10_ldmatrix import v10_shared_layout
from ..halves import NAMES, half_of, make_halves
from ..plan import Plan, variant_description
from ..ptx import (cp_async16, cp_async16_l2_256, cp_async_commit, cp_async_wait_group,
                   exp2_approx, flat_load, fmax, ldmatrix_x4, ldmatrix_x4_trans, load_b32)
from ..smem import U
from ..variants import PLAIN, make_variant_functions
from ..warp import FULL_WARP, quad_max, quad_sum
from .split_kv import make_split_keys, make_store_result

WARPS = 4                       # warps per block, each taking CHUNK keys of every tile
THREADS = 32 * WARPS
ROWS = 16                       # query rows per block: the mma's M
CHUNK = 16                      # keys per warp and tile: two n-tiles of S, one k-step of P~ V
TILE_KEYS = WARPS * CHUNK       # keys per tile (per stage of shared memory)
MAX_HEAD_DIM = 128              # O's fragments in registers: 64 floats a lane at d = 128
ALIGN = 8                       # 16-byte copies: rows start at multiples of 8 elements
MAX_REGISTERS = None            # no cap (ptxas's choice)
# Which tiles test their copies for NaN and inf (module docstring): "edges", only the tiles
# where some real row does not see some key of the tile (the ends of a causal band or a
# window) or when q holds one; "every" tile, as forward v10 does. scripts/decode_gpu.py
# sets it to time the two.
FINITE_TESTS = "edges"
FINITE_CHOICES = ("edges", "every")

# Stages of shared memory the K/V tiles are copied into: with STAGES = s a block has s - 1
# tiles in flight while its warps use one. 2 is the default; 3 doubles the bytes a block
# has in flight and still lets an SM hold two blocks at d = 128 (111 KB each). Measured
# on an H100, float16, queued, three stages are slower at both GQA decode shapes (0.2339
# against 0.2210 ms at (1, 32/8, 1, 131072), 0.4479 against 0.3857 at (8, 32/8, 1,
# 32768): lab/runs/2026-12-07/148_decode_rescale_queued.txt; every split count:
# 145_decode_splits_queued.txt). A lab switch, set before the plans are made; the same
# arithmetic, so the same bits, either way.
STAGES = 2
STAGE_CHOICES = (2, 3)

# L2_PREFETCH: None, or 256: each copy of a tile hints that L2 may fetch the 256 aligned
# bytes around it (ptx.cp_async16_l2_256). A lab switch, set before the plans are made;
# the same values land in shared memory, so the same bits. Read by the transposed kernel
# (split_kv_mma_t.kernel).
L2_PREFETCH = None
L2_PREFETCHES = (None, 256)

# What split_kv_mma_shared returns, by name: the dynamic array (the stages of K and V
# tiles, rows laid out as LAYOUT says) and the static arrays of the warps' merge.
SharedBytes = namedtuple("SharedBytes", "dynamic static")


def split_kv_mma_shared(d, stages=None, layout=None):
    """Shared memory of a block at head dim d, in bytes: ``dynamic`` (``stages``, by
    default STAGES, of TILE_KEYS keys and values each, 16-bit, rows laid out as
    ``layout``, by default LAYOUT, says) and ``static`` (the warps' m and l per row,
    float32; the merged O, ROWS x d padded to 16, float32; three int32 flags)."""
    stages = STAGES if stages is None else stages
    layout = LAYOUT if layout is None else layout
    DP = (d + 15) // 16 * 16
    return SharedBytes(2 * stages * stage_layout(d, layout).TILE * 2,
                       4 * (2 * WARPS * ROWS + ROWS * DP) + 4 * 3)


def rows_per_block(rows_needed, d):
    """The query rows one block holds: always ROWS (the mma's M; rows past the group x Sq
    rows of a K/V head are zeros)."""
    return ROWS


def check_build(d, half, finite_tests, stages):
    """ValueError, naming the limit, for a build the tensor-core decode kernels (this
    file's and split_kv_mma_t.py's) cannot compile: ``half`` not a 16-bit type of
    kernels/halves.py, ``finite_tests`` not in FINITE_CHOICES, d not a multiple of ALIGN
    up to MAX_HEAD_DIM, ``stages`` not in STAGE_CHOICES."""
    if half not in NAMES:
        raise ValueError(f"half must be one of {NAMES}; got {half!r}")
    if finite_tests not in FINITE_CHOICES:
        raise ValueError(f"finite_tests must be one of {FINITE_CHOICES}; got {finite_tests!r}")
    if d % ALIGN or not 0 < d <= MAX_HEAD_DIM:
        raise ValueError(f"the tensor-core decode kernel takes head dims that are multiples "
                         f"of {ALIGN} up to {MAX_HEAD_DIM}; got {d}")
    if stages not in STAGE_CHOICES:
        raise ValueError(f"stages must be one of {STAGE_CHOICES}; got {stages!r}")


# How a stage's rows lie in shared memory (16-bit elements): ROW, the elements from one
# key's row to the next; TILE, those of one stage of K or V (TILE_KEYS rows).
# "padded": v10_shared_layout's rows, DP + 8 elements, so that the 8 rows one ldmatrix
# matrix reads start in 8 different groups of 4 banks. "swizzled": rows of a multiple of
# 64 elements (128 bytes), with row r's 16-byte piece q stored at piece q ^ (r % 8): the
# same 8 rows read 8 different groups of banks, and 8 threads copying 128 contiguous bytes
# of a row write one aligned 128-byte line of shared memory, where a padded row that
# starts off a line splits such a copy in two and L2 serves about 1.5 sectors for each
# one needed (Nsight Compute, lab/runs/2026-12-07/156_ncu_source_counters_ours.txt).
LAYOUTS = ("padded", "swizzled")
StageLayout = namedtuple("StageLayout", "ROW TILE")


# The layout of this kernel's stages: "swizzled", as split_kv_mma_t's; "padded", forward
# v10's rows. On an H100, float16, queued: 0.2062 ms against 0.2149 at (1, 32/8, 1,
# 131072), 0.3730 against 0.3865 at (8, 32/8, 1, 32768)
# (lab/runs/2026-12-07/158_decode_layouts_parent.txt); ptxas gives 230-235 registers at
# d = 128 against 214-228 padded, no spills. A lab switch, set before the plans are
# made; the same values in the same order, so the same bits.
LAYOUT = "swizzled"


def stage_layout(d, layout):
    """The StageLayout of head dim ``d`` in ``layout`` (LAYOUTS)."""
    DP = (d + 15) // 16 * 16
    if layout == "padded":
        ROW = v10_shared_layout(TILE_KEYS, d).ROW
    elif layout == "swizzled":
        ROW = -(-DP // 64) * 64
    else:
        raise ValueError(f"layout must be one of {LAYOUTS}; got {layout!r}")
    return StageLayout(ROW, TILE_KEYS * ROW)


# The device functions that stage the caches' tiles in shared memory and test them for NaN
# and inf, by name: the tensor-core decode kernels' common part (this file's and
# split_kv_mma_t.py's). piece_at(r, c): where row r's 16-byte piece from column c starts
# in a stage.
Staging = namedtuple("Staging", "finite start_copies test_copies nonfinite_terms piece_at")


@functools.lru_cache(maxsize=None)
def make_staging(d, half, stages, layout, prefetch=None):
    """The Staging of head dim ``d``, ``half`` caches ("float16" or "bfloat16") and
    ``stages`` of shared memory (make_split_kv_mma's arguments): tiles of TILE_KEYS keys
    and their values, copied by THREADS threads 16 bytes at a time into rows laid out as
    ``layout`` says (LAYOUTS), K's stages first, then V's; ``prefetch`` as L2_PREFETCH."""
    if prefetch not in L2_PREFETCHES:
        raise ValueError(f"prefetch must be one of {L2_PREFETCHES}; got {prefetch!r}")
    copy16 = cp_async16 if prefetch is None else cp_async16_l2_256
    SWIZZLED = layout == "swizzled"
    halves = make_halves(half)
    widen = halves.widen
    EXP = uint32(0x7C00 if half == "float16" else 0x7F80)   # all ones: NaN or inf
    EXP_HI = uint32(int(EXP) << 16)
    F32_MAX = acc_type("float32")(3.4028234663852886e38)
    ZERO = acc_type("float32")(0)
    DP = (d + 15) // 16 * 16
    PIECES = DP // 8                        # 16-byte pieces of a tile row
    COPIES = -(-TILE_KEYS * PIECES // THREADS)
    ROW, TILE = stage_layout(d, layout)
    K_AT = 0
    V_AT = stages * TILE                    # K's stages first, then V's

    @cuda.jit(device=True, inline=True)
    def finite(x):
        return abs(x) <= F32_MAX            # False for NaN and +-inf

    @cuda.jit(device=True, inline=True)
    def piece_at(r, c):
        """Where row r's elements c ... c + 7 (c a multiple of 8: one 16-byte piece)
        start in a stage."""
        if SWIZZLED:
            return r * ROW + (((c >> 3) ^ (r & 7)) << 3)
        return r * ROW + c

    @cuda.jit(device=True, inline=True)
    def start_copies(smem, K, V, k_base, v_base, k_row, v_row, key_first, last, st, tid,
                     HZERO):
        """Alg.1 l.7, issued: this thread's 16-byte pieces of the tile of keys key_first
        ... key_first + TILE_KEYS - 1 into stage st; rows past ``last`` (the split's end)
        and the columns past d are written as 0."""
        for u in range(COPIES):
            n = tid + u * THREADS
            if n < TILE_KEYS * PIECES:
                r = n // PIECES
                k0 = (n % PIECES) * 8
                at = piece_at(r, k0)
                key = key_first + r
                if key < last and k0 < d:
                    copy16(smem, U(K_AT + st * TILE + at), K, U(k_base + key * k_row + k0))
                    copy16(smem, U(V_AT + st * TILE + at), V, U(v_base + key * v_row + k0))
                else:
                    for e in range(8):
                        smem[U(K_AT + st * TILE + at + e)] = HZERO
                        smem[U(V_AT + st * TILE + at + e)] = HZERO

    @cuda.jit(device=True, inline=True)
    def all_finite(smem, at):
        """Whether the 8 values smem[at:at + 8] are all finite (exponents not all ones)."""
        ok = True
        for w in range(4):
            word = load_b32(smem, U(at + 2 * w))
            if (word & EXP) == EXP or (word & EXP_HI) == EXP_HI:
                ok = False
        return ok

    @cuda.jit(device=True, inline=True)
    def zero_nonfinite(smem, at, bad, which, mark, HZERO):
        """Rare: the non-finite values of smem[at:at + 8] set to 0, bad[which] raised to
        ``mark``."""
        for e in range(8):
            if not finite(widen(smem[U(at + e)])):
                smem[U(at + e)] = HZERO
                cuda.atomic.max(bad, which, mark)

    @cuda.jit(device=True, inline=True)
    def test_copies(smem, bad, mark, key_first, last, st, tid, HZERO):
        """Alg.1 l.7, landed: this thread's pieces of the tile (stage st), which only it
        wrote, tested for NaN and inf; those are zeroed and flagged (bad[1] for K, bad[2]
        for V, raised to ``mark``) for the fix-ups."""
        for u in range(COPIES):
            n = tid + u * THREADS
            if n < TILE_KEYS * PIECES:
                r = n // PIECES
                k0 = (n % PIECES) * 8
                if key_first + r < last and k0 < d:
                    at = piece_at(r, k0)
                    if not all_finite(smem, K_AT + st * TILE + at):
                        zero_nonfinite(smem, K_AT + st * TILE + at, bad, 1, mark, HZERO)
                    if not all_finite(smem, V_AT + st * TILE + at):
                        zero_nonfinite(smem, V_AT + st * TILE + at, bad, 2, mark, HZERO)

    @cuda.jit(device=True, inline=True)
    def nonfinite_terms(Q, K, b, h, i, k_at):
        """The sum of the products q[c] * k[c] with a non-finite factor, for query row
        (b, h, i) and the key row starting at flat position k_at of K: what the tensor
        cores left out of this score (those factors were staged as 0)."""
        x = ZERO
        c = 0
        while c < d:
            q = widen(Q[U(b), U(h), U(i), U(c)])
            kk = widen(flat_load(K, U(k_at + c)))
            if not (finite(q) and finite(kk)):
                x += q * kk
            c += 1
        return x

    return Staging(finite, start_copies, test_copies, nonfinite_terms, piece_at)


@functools.lru_cache(maxsize=None)
def make_write_rows(d, rows, half):
    """The device function ``write_rows(m_w, l_w, o_w, O, L, O_parts, L_parts, tile, b,
    hk, Hq, group, Sq, n_rows, split, n_splits, tid)``: the tensor-core decode kernels'
    last step (this file's with ``rows`` = ROWS, split_kv_mma_t.py's with its ROWS). From
    the warps' m and l per row (m_w, l_w: WARPS x rows) and their merged O (o_w: rows x
    d padded), each of the block's real rows (tile ``tile`` of the n_rows that read K/V
    head hk of batch b) gets O / l and lse = M + log l, its warps' sums rescaled to
    their max M (a warp that saw no key has l = 0 and is left out; a NaN l counts), the
    block's THREADS threads taking its elements in turn; stored by split_kv's
    ``store_result``."""
    acc = acc_type("float32")
    ZERO = acc(0)
    NEG_INF = acc(-math.inf)
    store_result = make_store_result(half == "bfloat16")

    @cuda.jit(device=True, inline=True)
    def write_rows(m_w, l_w, o_w, O, L, O_parts, L_parts, tile, b, hk, Hq, group, Sq,
                   n_rows, split, n_splits, tid):
        for idx in range(tid, rows * d, THREADS):
            r = idx // d
            col = idx % d
            rr = tile * rows + r
            if rr < n_rows:
                bh = b * Hq + hk * group + rr // Sq
                i = rr % Sq
                top = NEG_INF
                for w in range(WARPS):
                    if m_w[w, r] > top:
                        top = m_w[w, r]
                top = ZERO if top == NEG_INF else top
                l_sum = ZERO
                for w in range(WARPS):
                    if l_w[w, r] != ZERO:           # the warp saw a key (a NaN l counts)
                        l_sum += math.exp(m_w[w, r] - top) * l_w[w, r]
                # l = 0: the rows saw no key of this split: O = 0, L = -inf.
                out = ZERO if l_sum == ZERO else o_w[r, col] / l_sum
                lse = NEG_INF if l_sum == ZERO else top + math.log(l_sum)
                store_result(O, L, O_parts, L_parts, split, n_splits, bh, i, col, out, lse)

    return write_rows


@functools.lru_cache(maxsize=None)
def make_split_kv_mma(d, causal, variant=PLAIN, half="float16", finite_tests="edges",
                      stages=2, layout="swizzled"):
    """The tensor-core split-KV kernel for head dim ``d`` (a multiple of 8, at most
    MAX_HEAD_DIM), ``causal`` (the band's upper bound, as split_kv's) and ``variant``
    (window, softcap, ALiBi), reading ``half`` caches ("float16" or "bfloat16": uint16
    bits, kernels/halves.py), accumulating in float32; ``finite_tests``: which tiles are
    tested for NaN and inf (FINITE_TESTS); ``stages``: of shared memory (STAGES);
    ``layout``: how a stage's rows lie in it (LAYOUTS; LAYOUT).

    Launch and arguments: split_kv's (make_split_kv), with block (THREADS,) and
    ``split_kv_mma_shared(d, stages, layout).dynamic`` bytes of dynamic shared memory;
    the caches' rows must start 16-byte aligned (``refusal``). Block (split, tile,
    b * Hk + hk) holds rows rr = tile * ROWS + r, r < ROWS, of the (batch, K/V head):
    query head hk * group + rr // Sq, query row rr % Sq; lane (g, t) = (lane // 4,
    lane % 4) holds rows g and g + 8. Tiles 0 ... stages - 2 are started before the loop;
    per tile j of the split's keys (stage st = j % stages; with two stages tile j + 1 goes
    to stage 1 - st):

        barrier                      every warp has read stage (j - 1) % stages (tile j - 1)
        start copies of tile j + stages - 1 into that stage; commit
        wait_group stages - 1        this thread's copies of tile j have landed
        test them for NaN and inf    (edge tiles, or every tile: finite_tests) zero those
                                     in place, flag the tile (bad[1], bad[2])
        barrier                      tile j complete and tested
        warp w, keys 16 w ... 16 w + 15 of the tile:
            S = Q K^T                KS ldmatrix.x4, 2 KS mma
            mask, score              visible() and score() per entry (variants.py)
            online-softmax step      quad max, exp2, rescale O, P~ rounded to 16 bits
            O += P~ V                ND / 2 ldmatrix.x4.trans, ND mma
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
    KS = DP // 16                           # k-steps of S = Q K^T
    ND = DP // 8                            # n-tiles of 8 columns of O (even)
    NT = CHUNK // 8                         # n-tiles of 8 keys of S (2)
    Q_WORDS = KS * 4
    O_FRAGS = ND * 4
    S_FRAGS = NT * 4
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

    staging = make_staging(d, half, stages, layout)
    piece_at = staging.piece_at
    finite, start_copies, test_copies, nonfinite_terms = (
        staging.finite, staging.start_copies, staging.test_copies, staging.nonfinite_terms)

    @cuda.jit(device=True, inline=True)
    def add_nonfinite_scores(s, Q, K, b, h0, i0, h1, i1, real0, real1, k_base, k_row, key0,
                             last, t):
        """Rare: a non-finite q or k was staged as 0; add its terms to this lane's scores
        s (keys from key0) of the block's real rows."""
        for nt in range(NT):
            for x in range(4):
                key = key0 + nt * 8 + 2 * t + x % 2
                real = real0 if x < 2 else real1
                if real and key < last:
                    term = nonfinite_terms(Q, K, b, h0 if x < 2 else h1, i0 if x < 2 else i1,
                                           k_base + key * k_row)
                    # s[nt * 4 + x] += term with constant indices only (the loop above is
                    # not unrolled: a run-time index would put s in local memory).
                    for y in range(S_FRAGS):
                        if y == nt * 4 + x:
                            s[y] += term

    @cuda.jit(device=True, inline=True)
    def add_nonfinite_values(o, s, V, b, h0, i0, h1, i1, sees_any0, sees_any1, v_base, v_row,
                             key0, last, n, causal_offset, window_lo, attn_mask, g, t):
        """Rare: a non-finite v of this warp's keys (from key0) was staged as 0; add p * v
        for those values to the O fragments of the rows that see the key (visible(), as
        the scores were masked). P~ of key kk for rows g and g + 8 is in lane (g, kk % 8
        // 2) of the quad, s[kk // 8 * 4 + kk % 2] and the entry 2 after it."""
        kk = 0
        while kk < CHUNK:
            x0 = ZERO
            x1 = ZERO
            for nt in range(NT):
                for e in range(2):
                    if kk // 8 == nt and kk % 2 == e:
                        x0 = s[nt * 4 + e]
                        x1 = s[nt * 4 + 2 + e]
            p0 = cuda.shfl_sync(FULL_WARP, x0, g * 4 + kk % 8 // 2)
            p1 = cuda.shfl_sync(FULL_WARP, x1, g * 4 + kk % 8 // 2)
            key = key0 + kk
            if key < last:
                sees0 = sees_any0 and visible(b, h0, i0, key, n, causal_offset, window_lo,
                                              attn_mask)
                sees1 = sees_any1 and visible(b, h1, i1, key, n, causal_offset, window_lo,
                                              attn_mask)
                for nd in range(ND):
                    for e in range(2):
                        c = nd * 8 + 2 * t + e
                        if c < d:
                            v = widen(flat_load(V, U(v_base + key * v_row + c)))
                            if not finite(v):
                                if sees0:
                                    o[nd * 4 + e] += p0 * v
                                if sees1:
                                    o[nd * 4 + 2 + e] += p1 * v
            kk += 1

    @cuda.jit(device=True, inline=True)
    def masked_scores(s, softmax_scale, b, h0, i0, h1, i1, key0, last, n, Sq, causal_offset,
                      window_lo, softcap, slopes, attn_mask, t):
        """Alg.1 l.8-9 after the product: each of this lane's scores (rows g, g + 8; keys
        key0 + 8 nt + 2t, + 1) scaled and passed through the variant's score if its row
        sees its key, else -inf (split_kv's visible() and score(), per entry)."""
        for nt in range(NT):
            for x in range(4):
                key = key0 + nt * 8 + 2 * t + x % 2
                h = h0 if x < 2 else h1
                i = i0 if x < 2 else i1
                y = nt * 4 + x
                if key < last and visible(b, h, i, key, n, causal_offset, window_lo,
                                          attn_mask):
                    if SCORES:
                        s[y], _ = score(s[y] * softmax_scale, b, h, i, key, Sq, n, softcap,
                                        slopes, attn_mask)
                    else:
                        s[y] *= softmax_scale
                else:
                    s[y] = NEG_INF

    @cuda.jit(**jit_options(MAX_REGISTERS))
    def split_kv_mma(Q, K, V, seqlens, n_new, O, L, O_parts, L_parts, softmax_scale,
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

        # This lane's rows g and g + 8: their query head and row (a padded row, past the
        # group's last, takes the last one's: its scores are computed, never written).
        rr0 = tile * ROWS + g
        rr1 = rr0 + 8
        real0 = rr0 < n_rows
        real1 = rr1 < n_rows
        c0 = min(rr0, n_rows - 1)
        c1 = min(rr1, n_rows - 1)
        h0 = hk * group + c0 // Sq
        i0 = c0 % Sq
        h1 = hk * group + c1 // Sq
        i1 = c1 % Sq
        k_base = b * k_batch + hk * k_head
        v_base = b * v_batch + hk * v_head
        # The row this lane gives ldmatrix (forward v10's): for K, keys 8 (m // 2) + lane % 8
        # of the warp's 16, columns 8 (m % 2) of a k-step; for V, keys 8 (m % 2) + lane % 8,
        # columns 8 (m // 2) of an n-tile pair.
        m = lane // 8
        k_lane = warp * CHUNK + 8 * (m // 2) + lane % 8     # its row of K's stage
        v_lane = warp * CHUNK + 8 * (m % 2) + lane % 8      # and of V's
        HZERO = narrow(ZERO)

        # The stages of K and V tiles, on a 128-byte line (LAYOUT "swizzled")
        smem = cuda.shared.array(0, HALF, alignment=128)
        bad = cuda.shared.array(3, int32)       # non-finite q, k, v staged as 0
        m_w = cuda.shared.array((WARPS, ROWS), acc)         # each warp's m and l per row
        l_w = cuda.shared.array((WARPS, ROWS), acc)
        o_w = cuda.shared.array((ROWS, DP), acc)            # the warps' O, merged
        q = cuda.local.array(Q_WORDS, uint32)   # Q's A fragments
        o = cuda.local.array(O_FRAGS, acc)      # O fragments
        s = cuda.local.array(S_FRAGS, acc)      # S, then P~, of the warp's 16 keys

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
        # Alg.1 l.4: Q's A fragments (rows g, g + 8; zero past the real rows and d; a
        # non-finite q is staged as 0 and flagged, as forward v10 stages it).
        for ks in range(KS):
            for w in range(4):
                real = real0 if w % 2 == 0 else real1
                h = h0 if w % 2 == 0 else h1
                i = i0 if w % 2 == 0 else i1
                col = ks * 16 + 2 * t + 8 * (w // 2)
                x = widen(Q[U(b), U(h), U(i), U(col)]) if real and col < d else ZERO
                y = widen(Q[U(b), U(h), U(i), U(col + 1)]) if real and col + 1 < d else ZERO
                if not (finite(x) and finite(y)):
                    bad[0] = 1
                    x = x if finite(x) else ZERO
                    y = y if finite(y) else ZERO
                q[ks * 4 + w] = pack2(x, y)
        for x in range(O_FRAGS):
            o[x] = ZERO
        m0 = NEG_INF            # running max of rows g and g + 8 (the same in the quad)
        m1 = NEG_INF
        l0 = ZERO               # this lane's part of the running sums
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
            # Does some real row not see some key of the tile (the band's ends: row 0's
            # causal bound, row Sq - 1's window bound), or does q hold a NaN or inf? Then
            # its NaN and inf are staged as 0 and added back (module docstring). The same
            # in every thread (bad[0] was set before the barrier that ended tile j - 1, or
            # before the first tile's barrier below: tested again at every tile).
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
                # Alg.1 l.8: S = Q K^T; one ldmatrix gives b0, b1 of keys 0-7 and b2, b3
                # of keys 8-15 for a k-step.
                KJ = K_AT + st * TILE
                acc_a = (ZERO, ZERO, ZERO, ZERO)
                acc_b = (ZERO, ZERO, ZERO, ZERO)
                for ks in range(KS):
                    b0, b1, b2, b3 = ldmatrix_x4(
                        smem, U(KJ + piece_at(k_lane, 16 * ks + 8 * (m % 2))))
                    acc_a = mma(q[ks * 4], q[ks * 4 + 1], q[ks * 4 + 2], q[ks * 4 + 3],
                                b0, b1, acc_a[0], acc_a[1], acc_a[2], acc_a[3])
                    acc_b = mma(q[ks * 4], q[ks * 4 + 1], q[ks * 4 + 2], q[ks * 4 + 3],
                                b2, b3, acc_b[0], acc_b[1], acc_b[2], acc_b[3])
                for x in range(4):
                    s[x] = acc_a[x]
                    s[4 + x] = acc_b[x]
                if fix_scores:          # rare: a non-finite q or k was staged as 0
                    add_nonfinite_scores(s, Q, K, b, h0, i0, h1, i1, real0, real1, k_base,
                                         k_row, key0, last, t)
                masked_scores(s, softmax_scale, b, h0, i0, h1, i1, key0, last, n, Sq,
                              causal_offset, window_lo, softcap, slopes, attn_mask, t)
                # Alg.1 l.9: the new running max over the quad (fmax: NaN does not win),
                # P~ = exp(S - m) in s, the rescale factors (mma_rows' softmax step).
                mt0 = fmax(fmax(s[0], s[1]), fmax(s[4], s[5]))
                mt1 = fmax(fmax(s[2], s[3]), fmax(s[6], s[7]))
                mt0 = quad_max(mt0)
                mt1 = quad_max(mt1)
                mn0 = mt0 if mt0 > m0 else m0
                mn1 = mt1 if mt1 > m1 else m1
                ms0 = ZERO if mn0 == NEG_INF else mn0    # no key seen yet: avoid -inf - -inf
                ms1 = ZERO if mn1 == NEG_INF else mn1
                alpha0 = exp2_approx((m0 - ms0) * LOG2E)
                alpha1 = exp2_approx((m1 - ms1) * LOG2E)
                lt0 = ZERO
                lt1 = ZERO
                for nt in range(NT):
                    for e in range(2):
                        s[nt * 4 + e] = exp2_approx(s[nt * 4 + e] * LOG2E - ms0 * LOG2E)
                        lt0 += s[nt * 4 + e]
                        s[nt * 4 + 2 + e] = exp2_approx(s[nt * 4 + 2 + e] * LOG2E - ms1 * LOG2E)
                        lt1 += s[nt * 4 + 2 + e]
                l0 = alpha0 * l0 + lt0
                l1 = alpha1 * l1 + lt1
                m0 = mn0
                m1 = mn1
                # Alg.1 l.10: O = diag(alpha) O + P~ V, P~ rounded to the cache's type as
                # the A operand (a0: row g, keys 2t, 2t + 1; a1: row g + 8; a2, a3: keys + 8).
                p0 = pack2(s[0], s[1])
                p1 = pack2(s[2], s[3])
                p2 = pack2(s[4], s[5])
                p3 = pack2(s[6], s[7])
                VJ = V_AT + st * TILE
                for nd in range(0, ND, 2):
                    # B[k, n] = V[key k, column n]: .trans gives b0, b1 of columns 8 nd
                    # and b2, b3 of columns 8 (nd + 1), keys 0-15 of the warp's.
                    b0, b1, b2, b3 = ldmatrix_x4_trans(
                        smem, U(VJ + piece_at(v_lane, 8 * nd + 8 * (m // 2))))
                    acc_a = mma(p0, p1, p2, p3, b0, b1, o[nd * 4] * alpha0,
                                o[nd * 4 + 1] * alpha0, o[nd * 4 + 2] * alpha1,
                                o[nd * 4 + 3] * alpha1)
                    acc_b = mma(p0, p1, p2, p3, b2, b3, o[nd * 4 + 4] * alpha0,
                                o[nd * 4 + 5] * alpha0, o[nd * 4 + 6] * alpha1,
                                o[nd * 4 + 7] * alpha1)
                    for x in range(4):
                        o[nd * 4 + x] = acc_a[x]
                        o[nd * 4 + 4 + x] = acc_b[x]
                if fix_values:          # rare: a non-finite v was staged as 0
                    add_nonfinite_values(o, s, V, b, h0, i0, h1, i1, real0, real1, v_base,
                                         v_row, key0, last, n, causal_offset, window_lo,
                                         attn_mask, g, t)

        # Merge the four warps by their logsumexp, in split_kv's order (merge_warps): each
        # warp's weight exp(m_w - M) for the block's max M of the row, its weighted O added
        # into o_w one warp after another, warp 0 first.
        l0 = quad_sum(l0)
        l1 = quad_sum(l1)
        if t == 0:
            m_w[warp, g] = m0
            m_w[warp, g + 8] = m1
            l_w[warp, g] = l0
            l_w[warp, g + 8] = l1
        # Wait until every warp's m and l are in shared memory.
        cuda.syncthreads()
        top0 = NEG_INF
        top1 = NEG_INF
        for w in range(WARPS):              # '>' keeps NaN out of the max
            if m_w[w, g] > top0:
                top0 = m_w[w, g]
            if m_w[w, g + 8] > top1:
                top1 = m_w[w, g + 8]
        top0 = ZERO if top0 == NEG_INF else top0
        top1 = ZERO if top1 == NEG_INF else top1
        weight0 = math.exp(m0 - top0) if l0 != ZERO else ZERO
        weight1 = math.exp(m1 - top1) if l1 != ZERO else ZERO
        for w in range(WARPS):
            if warp == w:
                for nd in range(ND):
                    for e in range(2):
                        col = nd * 8 + 2 * t + e
                        x0 = weight0 * o[nd * 4 + e] if l0 != ZERO else ZERO
                        x1 = weight1 * o[nd * 4 + 2 + e] if l1 != ZERO else ZERO
                        if w == 0:
                            o_w[g, col] = x0
                            o_w[g + 8, col] = x1
                        else:
                            o_w[g, col] += x0
                            o_w[g + 8, col] += x1
            # Wait until warp w's share is added before the next warp adds its own.
            cuda.syncthreads()
        # Alg.1 l.12-13: each row's merged O over its sum, and its lse (write_rows)
        write_rows(m_w, l_w, o_w, O, L, O_parts, L_parts, tile, b, hk, Hq, group, Sq,
                   n_rows, split, n_splits, tid)

    return split_kv_mma


# --- the launch contract ------------------------------------------------------------


def refusal(p):
    """Why the tensor-core decode kernel does not take CacheProblem ``p``, or None if it
    does: 16-bit caches, more than one query row per K/V head (GQA or Sq > 1), d a
    multiple of 8 up to MAX_HEAD_DIM, rows that start 16-byte aligned (host caches travel
    as fresh, aligned arrays; device caches are read in place, so their first elements
    and strides are checked).

    One row per K/V head (multi-head attention, one new token) is left to split_kv:
    measured on the H200 (lab/runs/2026-12-06/120_decode_decoders.txt, float16, d = 128)
    this kernel took 0.91x split_kv's speed at batch 8 and 0.69x at batch 1 there, against
    1.74x and 1.06x with GQA (groups of 4), where a block's rows share each key it reads."""
    name = str(p.dtype)
    if name not in NAMES:
        return f"{name} caches (the tensor-core decode kernel reads float16 and bfloat16)"
    if p.group * p.Sq < 2:
        return ("one query row per K/V head (the tensor-core decode kernel pays off when "
                "several rows share each key: GQA or Sq > 1)")
    if p.d % ALIGN or p.d > MAX_HEAD_DIM:
        return (f"head dim {p.d} (the tensor-core decode kernel takes multiples of {ALIGN} "
                f"up to {MAX_HEAD_DIM})")
    if p.layout is not None:
        for cache, strides, address in (("k_cache", p.layout.k_strides, p.layout.k_address),
                                         ("v_cache", p.layout.v_strides, p.layout.v_address)):
            if address % 16:
                return (f"{cache} does not start at a 16-byte aligned address (the "
                        f"tensor-core decode kernel copies 16 bytes at a time)")
            if any(st % ALIGN for st in strides):
                return (f"{cache}'s strides {tuple(strides)} (elements) are not multiples of "
                        f"{ALIGN} (the tensor-core decode kernel copies 16-byte rows)")
    return None


def plan(p, where, n_splits, reason):
    """The Plan of the tensor-core split-KV kernel for CacheProblem ``p`` and ``n_splits``
    splits: grid (n_splits, row tiles, B * Hk), block (THREADS,), dynamic shared memory."""
    rows_needed = p.group * p.Sq
    tiles = math.ceil(rows_needed / ROWS)
    reason += (f"; the {rows_needed} query rows that read each K/V head ({p.group} heads x "
               f"{p.Sq} rows) as the 16 rows of the tensor cores' products, in {tiles} "
               f"block(s); {WARPS} warps taking {CHUNK} keys each of every {TILE_KEYS}-key "
               f"tile, copied 16 bytes at a time into {('two', 'three')[STAGES - 2]} stages "
               f"of shared memory")
    return Plan("kvcache", "split_kv_mma", "split_kv_mma", where, None, None,
                (n_splits, tiles, p.B * p.Hk), (THREADS,),
                split_kv_mma_shared(p.d, STAGES, LAYOUT).dynamic,
                p.acc_dtype, "bottom_right" if p.causal else None, reason,
                variant_description(p), dynamic_shared=True)


def kernel(plan, p):
    """The compiled kernel of ``plan`` (cached per compile-time parameters)."""
    return make_split_kv_mma(p.d, p.upper, p.variant, half_of(p.dtype) or "float16",
                             FINITE_TESTS, STAGES, LAYOUT)
