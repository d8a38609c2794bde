"""Split-KV decoding: each block one range of one batch's cached keys, for up to MAX_ROWS
of the query rows that read the same K/V head.

Parent: forward v2 (forward/v2_flash2.py): the same online softmax (Alg.1 l.8-10) and
the same handling of masked keys, NaN and rows that see nothing, with the work mapped
onto threads the other way round. v2 gives each thread a query row and loops over all
keys; a decode call has one to a few rows per head and tens of thousands of keys, so
here the keys are spread, three ways:

* over blocks: the keys a batch's rows can see are cut into ``n_splits`` ranges
  (reference.split_ranges' rule, per batch, from that batch's own cache length), one
  block each, so that a decode call launches enough blocks to fill the GPU;
* over the 4 warps of a block: warp w takes steps of KEYS keys at base = first + w KEYS,
  first + (w + 4) KEYS, ..., so the four read neighbouring rows of the cache;
* over the 32 lanes of a warp, by head-dim column, VEC neighbouring columns at a time:
  the head dim is cut into pieces of 32 VEC columns, and lane x holds columns VEC x to
  VEC x + VEC - 1 of each piece (NV values of every row it touches), so a warp reads each
  cached key and value row in whole, coalesced pieces (``column`` gives the mapping).
  A score q . k is the sum of the 32 lanes' partial dot products. A step's KEYS sums are
  reduced together (``step_scores``), after which each lane holds the whole score of one
  key of the step; that lane masks, scores and exponentiates it, and the probabilities go
  back to every lane (``from_key``) for its own columns of o += p v.

Every block holds several query rows at once (``rows``: up to MAX_ROWS of the group x Sq
rows of one (batch, K/V head)), so with GQA each key and value is read once for them
(for a group of four, two blocks read it).
Each warp ends with its own (m, l, o) per row; the block merges its four warps by their
logsumexp through shared memory (``merge_warps``), then writes O and L directly (one
split) or its split's normalised O_s and L_s for the combine kernel (combine.py).

What it buys: a decode call reads the whole cache once, so it is memory-bound, and the
splits let it use the whole GPU. Before the two changes below, at (8, 32, 1, 32768, 128)
it read 2787 GB/s in float32 (2.0x SDPA's bandwidth, 0.65 of the HBM copy) and 2114 GB/s
in float16 (0.46x SDPA, 0.496 of the copy); with GQA (8 K/V heads) far less in float16
(0.08-0.12x SDPA): the per-(key, row) work of the reductions limits it there
(lab/runs/2026-12-04/102_decode_strided_gpu.txt; docs/performance.md, "Decoding").

Two changes since those measurements, both for that profile, and neither measured yet
(they have run on the simulator and through ptxas only, not on a GPU):

* Wide loads (``vec``). Each lane read one element per load: 2 bytes in float16, so a
  step had half of float32's bytes in flight for the same instructions. Now it reads 8
  bytes per load (``ptx.flat_load_wide``): VEC = 4 float16 or bfloat16 values, or 2
  float32, widened to float32 after the load. An 8-byte load needs an 8-byte aligned
  address, so the plan (``load_width``) checks that each cache starts at one and that d
  and the caches' strides are multiples of VEC, and compiles the parent's loads (VEC = 1,
  one element a load) otherwise, saying why; float64 keeps them (one element is 8 bytes).
  Columns past d (d not a multiple of 32 VEC) are loaded from the last VEC columns and
  zeroed, as before one column at a time.
* A transposed reduction (``reduction="transposed"``). The parent summed each of a step's
  KEYS = 8 partial dot products over the whole warp (``warp_sums``: five xor shuffles
  each, 40 per row and step), after which every lane masked, scored and exponentiated
  all 8 keys: with GQA that per-(key, row) work, not the HBM, was the limit.
  ``step_scores`` reduces the 8 sums together: over lane bit 4 (xor 16) each lane keeps
  4 of the 8 and sends its partner the 4 the partner keeps (4 shuffles), then xor 8 (2)
  and xor 4 (1) halve again, and xor 2 and xor 1 finish each sum (1 each): 9 shuffles,
  after which lane bits 4..2 name the key whose score a lane holds. Then the step's max
  over those bits (``step_max``, 3 shuffles), one exp per lane for its own key instead of
  8, and the 8 probabilities to every lane (``from_key``, 8 shuffles), from which each
  lane adds l in the same order: 20 shuffles and 2 exps (with alpha) per row and step
  instead of 40 and 9. With fewer keys a step (d > 128; float64: d > 64) the rounds are
  fewer (``make_step_reduction``).

Both are compile-time arguments of ``make_split_kv``; the plan takes them from LOADS and
REDUCTION, which scripts/decode_gpu.py sets (``--loads``, ``--reduction``) to time each
change alone against the parent's kernel: ``vec=1, reduction="allreduce"`` compiles to the
parent's PTX (the same fingerprint, float64 at d > 64 aside, which now takes fewer keys a
step: ``keys_per_step``). ptxas (sm_90) at d = 128, one / two query rows per block, no
spills: float16 96 / 130 registers with both changes (the parent 128 / 150), float32
94 / 128 (96 / 149). At d = 64 a float16 wide load's 128 columns leave half the lanes
with none (zeroed): 130-151 registers with two rows against the parent's 106-126, and
perhaps slower there; decode_gpu.py's d = 64 shapes would tell.

Lengths: batch b sees the first n_b = cache_seqlens[b] + S_new keys of its cache (never
more than S_max). Causal and windows are bottom-right aligned within that length:
row i sees key j iff j <= i + n_b - Sq (+ right) and j >= i + n_b - Sq - left; ALiBi
adds -slope * |i + n_b - Sq - j|: ``visible`` and ``score`` of kernels/variants.py with
Sk = n_b.

Runs on the GPU and the simulator (warp shuffles and the wide loads there through
kernels/simulated.py).
"""

import functools
import math
from collections import namedtuple
from dataclasses import dataclass

import numpy as np
from numba import cuda

from .. import acc_type, jit_options
from ..halves import half_of, make_halves
from ..plan import Plan, variant_description
from ..ptx import flat_load, flat_load_wide
from ..smem import U
from ..variants import PLAIN, make_variant_functions
from ..warp import FULL_WARP

WARPS = 4                       # warps per block
THREADS = 32 * WARPS
# Query rows one block holds. Two: with four or eight, ptxas keeps the rows' q and o in
# local memory (a stack frame of 160-320 bytes at d = 128, rows indexed in a loop it does
# not unroll), and on the H200 the GQA shapes ran fastest with two: (8, 32/8, 1, 32768,
# 128) at 1.81 ms (float16) and 1.90 ms (float32), against 2.57-2.80 and 2.84-2.87 with
# four or eight (lab/runs/2026-12-04/95_decode_gpu_unbranched_loads.txt, "rows" lines;
# in lab/runs/2026-12-04/100_decode_gpu.txt two rows were 6-17 % faster than one at three
# of the four GQA readings and 9 % slower at the fourth, four and eight again the slowest).
MAX_ROWS = 2
MAX_REGISTERS = None            # no cap (ptxas's choice); scripts/decode_gpu.py tries caps
LANE_VALUES = 32                # per lane, 32-bit registers: KEYS x NV of k (and of v)
                                # and rows x NV of q (and of o) at most
LOAD_BYTES = 8                  # a wide load: 4 float16/bfloat16 or 2 float32 per lane
# The two changes of the module docstring, as the plan compiles them (scripts/decode_gpu.py
# sets these before planning, to time each alone): "wide" loads where the caches allow
# them, or "scalar" (one element a load) always; the "transposed" reduction of a step's
# scores, or the parent's "allreduce".
LOADS = "wide"
REDUCTION = "transposed"
REDUCTIONS = ("transposed", "allreduce")


def wide_vec(itemsize):
    """VEC of a wide load of ``itemsize``-byte elements: 4 (float16, bfloat16), 2
    (float32), 1 (float64, already 8 bytes an element)."""
    return max(1, LOAD_BYTES // itemsize)


def columns_per_lane(d, vec=1):
    """NV: head-dim columns each lane holds, vec neighbours in each piece of 32 vec columns
    (vec = 1: x, x + 32, ...)."""
    return -(-d // (32 * vec)) * vec


def keys_per_step(d, vec=1, acc_dtype="float32"):
    """KEYS: keys a warp loads in one step before using them (up to 8, so that 8 loads of
    each of K and V are in flight per lane), fewer at d > 128 (float64: d > 64) to keep
    the KEYS x NV registers of a lane's keys within LANE_VALUES (a float64 value takes
    two); a power of two, since the transposed reduction names a step's keys by lane
    bits. (Float64 at d = 256 with two rows and every variant needed 255 registers and
    spilled 24 bytes with 4 keys; ptxas, sm_90.)"""
    registers = columns_per_lane(d, vec) * (2 if acc_dtype == "float64" else 1)
    keys = max(1, min(8, LANE_VALUES // registers))
    return 1 << (keys.bit_length() - 1)


def rows_per_block(rows_needed, d):
    """The rows one block holds: the power of two that covers the group x Sq rows of a
    (batch, K/V head), up to MAX_ROWS (and fewer at d > 128, registers as above)."""
    cap = max(1, min(MAX_ROWS, LANE_VALUES // columns_per_lane(d)))
    rows = 1
    while rows < rows_needed and rows < cap:
        rows *= 2
    return rows


# --- a step's scores, reduced over the warp --------------------------------------------

StepReduction = namedtuple("StepReduction", "warp_sums step_scores step_max from_key")


@functools.lru_cache(maxsize=None)
def make_step_reduction(keys, acc_dtype):
    """The warp collectives of a step of ``keys`` keys (1, 2, 4 or 8) in ``acc_dtype``, by
    name (tests/test_decode_kernel.py follows step_scores' lanes in NumPy):

        warp_sums(s)          the parent's all-reduce: each of the KEYS values of s (this
                              lane's partial dot products) summed over the 32 lanes, in
                              every lane; 5 shuffles per key
        step_scores(s, lane)  the transposed reduction: the sum over the 32 lanes of
                              s[lane // (32 / KEYS)] only, the score of this lane's own
                              key; KEYS - 1 + 5 - log2(KEYS) shuffles (9 for 8 keys)
        step_max(x)           the max over the step's keys of x (each lane its own key's),
                              in every lane; log2(KEYS) shuffles
        from_key(x, e)        x of key e's lanes, in every lane; one shuffle (KEYS for
                              the step)
    """
    if keys not in (1, 2, 4, 8):
        raise ValueError(f"a step holds 1, 2, 4 or 8 keys; got {keys}")
    acc = acc_type(acc_dtype)
    ZERO = acc(0)
    NEG_INF = acc(-math.inf)
    KEYS = keys
    ROUNDS = KEYS.bit_length() - 1          # log2(KEYS): the rounds that halve the keys
    LANES_PER_KEY = 32 // KEYS              # lanes e * LANES_PER_KEY ... hold key e's score

    @cuda.jit(device=True, inline=True)
    def warp_sums(s):
        """Each of the KEYS values of s summed over the warp's 32 lanes, in every lane (a
        butterfly of xor shuffles: the same order in every lane, so every lane gets the
        same bits), one round for all KEYS values before the next, so that KEYS shuffles
        are in flight at once instead of one chain after another."""
        for e in range(KEYS):
            s[e] += cuda.shfl_xor_sync(FULL_WARP, s[e], 16)
        for e in range(KEYS):
            s[e] += cuda.shfl_xor_sync(FULL_WARP, s[e], 8)
        for e in range(KEYS):
            s[e] += cuda.shfl_xor_sync(FULL_WARP, s[e], 4)
        for e in range(KEYS):
            s[e] += cuda.shfl_xor_sync(FULL_WARP, s[e], 2)
        for e in range(KEYS):
            s[e] += cuda.shfl_xor_sync(FULL_WARP, s[e], 1)

    @cuda.jit(device=True, inline=True)
    def step_scores(s, lane):
        """The whole score (the sum over the 32 lanes) of key lane // LANES_PER_KEY of the
        step, from s, this lane's KEYS partial dot products (s is overwritten).

        Each round pairs lane x with lane x ^ mask (mask 16, 8, ...) and halves the keys a
        lane holds: the lane with that bit clear keeps the lower half of s[:2 half], the
        other the upper half, and each sends its partner the half the partner keeps, so
        each kept value becomes the pair's sum (half shuffles, all in flight together).
        After log2(KEYS) rounds a lane holds one key's sum over the lanes that differ from
        it in those bits, and lane bits 4, 3, ... (the keys' halves chosen, in order) are
        that key's number: lane // LANES_PER_KEY. The remaining rounds (xor ... 2, 1) sum
        over the lanes of that key, a butterfly as in warp_sums, so that those lanes end
        with the same bits. For KEYS = 8 and lane bits (b4 b3 b2 b1 b0):

            xor 16: keeps keys 4 b4 .. 4 b4 + 3             4 shuffles
            xor 8:  keeps keys 4 b4 + 2 b3 .. + 1           2
            xor 4:  keeps key 4 b4 + 2 b3 + b2 = lane // 4  1
            xor 2, xor 1: the sum over that key's 4 lanes   2
        """
        half = KEYS // 2
        mask = 16
        for _ in range(ROUNDS):
            upper = (lane & mask) != 0          # this lane keeps the upper half
            for e in range(KEYS // 2):
                if e < half:
                    low = s[e]
                    high = s[e + half]
                    keep = high if upper else low
                    send = low if upper else high
                    s[e] = keep + cuda.shfl_xor_sync(FULL_WARP, send, mask)
            half //= 2
            mask //= 2
        x = s[0]
        for _ in range(5 - ROUNDS):
            x += cuda.shfl_xor_sync(FULL_WARP, x, mask)
            mask //= 2
        return x

    @cuda.jit(device=True, inline=True)
    def step_max(x):
        """The max over the step's keys of x, each lane holding its own key's, in every
        lane: xor shuffles over the lane bits that name the keys (16, 8, ... down to
        LANES_PER_KEY). '>' keeps NaN out of the max (as v2: a NaN score reaches l and o
        instead), and the + 0 makes a max of +0 and -0 the same bits in every lane
        (either may win a tie, depending on the lane)."""
        m = x if x > NEG_INF else NEG_INF
        mask = 16
        for _ in range(ROUNDS):
            y = cuda.shfl_xor_sync(FULL_WARP, m, mask)
            m = y if y > m else m
            mask //= 2
        return m + ZERO

    @cuda.jit(device=True, inline=True)
    def from_key(x, e):
        """x of the lanes that hold key e of the step (lane e * LANES_PER_KEY), in every
        lane: called for e = 0 .. KEYS - 1, it gives every lane all the keys' values."""
        return cuda.shfl_sync(FULL_WARP, x, e * LANES_PER_KEY)

    return StepReduction(warp_sums, step_scores, step_max, from_key)


# --- the kernel ---------------------------------------------------------------------------


# The keys one block of a split-KV kernel reads, by name (make_split_keys): n, the batch's
# keys (its cached length plus the new rows); causal_offset and window_lo, the band's
# bounds as bands.py gives them for these rows (variants.py's visible() takes them);
# first ... last - 1, this split's share of the keys the block's rows see.
SplitKeys = namedtuple("SplitKeys", "n causal_offset window_lo first last")


@functools.lru_cache(maxsize=None)
def make_split_keys(causal, window):
    """The device function ``split_keys(seqlens, b, n_new, S_max, Sq, upper_shift,
    lower_shift, split, n_splits)`` -> SplitKeys of batch b and split ``split`` of
    ``n_splits``, for a kernel built ``causal`` (the band's upper bound) and with a
    ``window`` (its lower bound): the decode kernels' common first step (this file's and
    the tensor-core kernels')."""

    @cuda.jit(device=True, inline=True)
    def split_keys(seqlens, b, n_new, S_max, Sq, upper_shift, lower_shift, split, n_splits):
        # This batch's keys, and the band its rows see (bands.py's bounds, in keys).
        n = min(seqlens[b] + n_new, S_max)
        causal_offset = n - Sq + upper_shift
        window_lo = n - Sq + lower_shift
        lo = 0
        hi = n
        if causal:                          # the last row sees up to here
            hi = min(hi, max(0, Sq + causal_offset))
        if window:                          # the first row sees from here
            lo = min(hi, max(0, window_lo))
        # This split's share of [lo, hi): reference.split_ranges' rule.
        span = hi - lo
        first = lo + split * (span // n_splits) + min(split, span % n_splits)
        last = first + span // n_splits + (1 if split < span % n_splits else 0)
        return SplitKeys(n, causal_offset, window_lo, first, last)

    return split_keys


@functools.lru_cache(maxsize=None)
def make_store_result(bf16):
    """The device function ``store_result(O, L, O_parts, L_parts, split, n_splits, bh, i,
    col, out, lse)``: one row's column ``col`` of the split's result (and its lse, from
    column 0), into O and L when the call has one split (rounded to bfloat16 bits with
    ``bf16``), else into the split's partial results for the combine. The decode kernels'
    common last step (this file's and the tensor-core kernels')."""
    narrow = make_halves("bfloat16").narrow

    @cuda.jit(device=True, inline=True)
    def store_result(O, L, O_parts, L_parts, split, n_splits, bh, i, col, out, lse):
        if n_splits == 1:
            if bf16:
                O[bh, i, col] = narrow(out)
            else:
                O[bh, i, col] = out
            if col == 0:
                L[bh, i] = lse
        else:
            O_parts[split, bh, i, col] = out
            if col == 0:
                L_parts[split, bh, i] = lse

    return store_result


@functools.lru_cache(maxsize=None)
def make_split_kv(d, rows, causal, acc_dtype, variant=PLAIN, half=None, vec=1,
                  reduction="transposed"):
    """The split-KV decode kernel for head dim ``d``, ``rows`` query rows per block,
    ``causal`` (the band's upper bound: causal, bottom-right within each batch's length,
    and/or a window's right side, at ``upper_shift``) and ``variant`` (window, softcap,
    ALiBi; kernels/variants.py), accumulating in ``acc_dtype``.

    ``vec``: cache elements each lane reads per load: 1 (one element), or the wide load's
    8 bytes (``wide_vec``: 4 for float16 and bfloat16 caches, 2 for float32), which needs
    d and the caches' strides to be multiples of vec and the caches 8-byte aligned
    (``load_width`` decides). ``reduction``: "transposed" (``step_scores``) or the
    parent's "allreduce" (``warp_sums``).

    Launch: grid (n_splits, row tiles, B * Hk), block (THREADS,). Row tile t holds the
    rows rr = t * rows + r of the (batch, K/V head): query head hk * group + rr // Sq,
    query row rr % Sq. Shared memory: the warps' (m, l, o) for the merge.

    Arguments: Q (B, Hq, Sq, d), any strides; K, V the caches as flat views of their
    memory from element (0, 0, 0, 0), with (B, Hk, S_max, d) element strides (k_batch,
    k_head, k_row, 1) and (v_batch, v_head, v_row, 1) given after S_max: a cache whose
    head dim is contiguous is read in place, whatever the order of its other dimensions
    (flash-attn's (batch, seqlen, heads, d) caches included); seqlens (B,) int32 and
    n_new (keys appended this call): batch b sees n_b = min(seqlens[b] + n_new, S_max)
    keys; O (B*Hq, Sq, d), L (B*Hq, Sq) written with one split, else O_parts (n_splits,
    B*Hq, Sq, d) and L_parts (n_splits, B*Hq, Sq) in the accumulator dtype;
    softmax_scale; upper_shift, lower_shift: the band's bounds relative to n_b - Sq
    (masks.band at Sk = Sq); Hq, group; softcap, slopes, attn_mask (variants.py's
    run-time arguments; attn_mask a placeholder, never read).

    ``half="bfloat16"``: Q, the caches and O hold bfloat16 bits (uint16,
    numbaflash/dtypes.py), widened where they are read and O rounded where it is written
    (kernels/halves.py); otherwise the arrays' own dtype is read and written.
    """
    if vec not in (1, 2, 4) or d % vec:
        raise ValueError(f"vec must be 1, 2 or 4 and divide the head dim {d}; got {vec}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}; got {reduction!r}")
    acc = acc_type(acc_dtype)
    BF16 = half == "bfloat16"
    widen = make_halves("bfloat16").widen if BF16 else acc
    ZERO = acc(0)
    NEG_INF = acc(-math.inf)
    VEC = vec
    PIECE = 32 * VEC                   # head-dim columns a warp reads per load
    PIECES = -(-d // PIECE)
    NV = PIECES * VEC                  # a lane's values of a row: columns_per_lane(d, vec)
    DP = PIECES * PIECE                # the head dim padded to whole pieces
    WHOLE_PIECES = d % PIECE == 0      # every lane's columns are inside the head dim
    KEYS = keys_per_step(d, vec, acc_dtype)
    LANES_PER_KEY = 32 // KEYS
    TRANSPOSED = reduction == "transposed"
    ROWS = rows
    ROW_VALUES = ROWS * NV             # a lane's share of the rows' q (and of o)
    STEP_VALUES = KEYS * NV            # a lane's share of a step's keys (and values)
    WINDOW = variant.window
    visible, score = make_variant_functions(variant, causal, acc_dtype)
    split_keys = make_split_keys(causal, WINDOW)
    store_result = make_store_result(BF16)
    warp_sums, step_scores, step_max, from_key = make_step_reduction(KEYS, acc_dtype)

    @cuda.jit(device=True, inline=True)
    def column(lane, v):
        """The head-dim column of value v of a lane's share of a row: piece v // VEC,
        VEC neighbouring columns per lane in each."""
        return PIECE * (v // VEC) + VEC * lane + v % VEC

    @cuda.jit(device=True, inline=True)
    def load_piece(A, at, x, v):
        """x[v:v + VEC] = A's VEC elements from flat position ``at`` on, widened to the
        accumulator: one 8-byte load (ptx.flat_load_wide), or one element with VEC = 1."""
        if VEC == 1:
            x[v] = widen(flat_load(A, at))
        else:
            piece = flat_load_wide(A, at)
            for j in range(VEC):
                x[v + j] = widen(piece[j])

    @cuda.jit(device=True, inline=True)
    def merge_warps(m_w, l_w, o_w, r, col):
        """Row r's (o, l, m) of the whole block at column col, from the warps' own: the
        logsumexp merge (reference.combine_splits), unnormalised; l = 0: no warp saw a
        key. A warp whose scores were all NaN keeps m = -inf ('>' keeps NaN out of the
        max) but has l = NaN: it is merged (weight 0, times NaN), so NaN carries through."""
        m = NEG_INF
        for w in range(WARPS):
            if m_w[w, r] > m:
                m = m_w[w, r]
        m_safe = ZERO if m == NEG_INF else m    # no finite max: avoid -inf - -inf
        l = ZERO
        o = ZERO
        for w in range(WARPS):
            if l_w[w, r] != ZERO:               # the warp saw a key (a NaN l counts)
                weight = math.exp(m_w[w, r] - m_safe)
                l += weight * l_w[w, r]
                o += weight * o_w[w, r, col]
        m = m_safe
        return o, l, m

    @cuda.jit(**jit_options(MAX_REGISTERS))
    def split_kv(Q, K, V, seqlens, n_new, O, L, O_parts, L_parts, softmax_scale, upper_shift,
                 lower_shift, Hq, group, softcap, slopes, attn_mask, S_max, k_batch, k_head,
                 k_row, v_batch, v_head, v_row):
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
        own = lane // LANES_PER_KEY         # the key of each step this lane scores (transposed)
        Sq = Q.shape[2]
        n_rows = group * Sq                 # the rows that read this K/V head

        # This batch's keys, the band its rows see, this split's share of it.
        keys = split_keys(seqlens, b, n_new, S_max, Sq, upper_shift, lower_shift, split,
                          n_splits)
        n, causal_offset, window_lo = keys.n, keys.causal_offset, keys.window_lo
        first, last = keys.first, keys.last

        m_w = cuda.shared.array((WARPS, ROWS), acc)        # each warp's m, l, o per row
        l_w = cuda.shared.array((WARPS, ROWS), acc)
        o_w = cuda.shared.array((WARPS, ROWS, DP), acc)
        q = cuda.local.array(ROW_VALUES, acc)               # the rows' q, this lane's columns
        o = cuda.local.array(ROW_VALUES, acc)
        m = cuda.local.array(ROWS, acc)
        l = cuda.local.array(ROWS, acc)
        kx = cuda.local.array(STEP_VALUES, acc)              # one step's keys and values
        vx = cuda.local.array(STEP_VALUES, acc)
        s = cuda.local.array(KEYS, acc)                      # this lane's parts of the scores

        for r in range(ROWS):                               # Alg.1 l.4-5
            rr = tile * ROWS + r
            h = hk * group + rr // Sq
            for v in range(NV):
                col = column(lane, v)
                q[r * NV + v] = widen(Q[b, h, rr % Sq, col]) if rr < n_rows and col < d else ZERO
                o[r * NV + v] = ZERO
            m[r] = NEG_INF
            l[r] = ZERO

        base = first + warp * KEYS
        while base < last:
            # Load a step of keys and values, whole rows across the warp (coalesced). Every
            # load is issued, from a row and column inside the cache (clamped), with no
            # branch between the loads, so all of them are in flight together
            # (kernels/forward/v6_tile_steps.py stages its tiles the same way). A key past
            # the split (clamped to its last row) is never used: its score is set to -inf
            # below and its value is not added. Columns past d (d not a multiple of PIECE)
            # are loaded from the last VEC columns and zeroed: every lane's partial dot
            # product sums all its columns, and q's zeros there would turn a copy of an
            # infinite element into NaN (0 * inf).
            for e in range(KEYS):
                key = min(base + e, last - 1)
                k_at = b * k_batch + hk * k_head + key * k_row     # where the rows start
                v_at = b * v_batch + hk * v_head + key * v_row
                for c in range(PIECES):
                    start = PIECE * c + VEC * lane                  # this lane's first column
                    at = start if WHOLE_PIECES else min(start, d - VEC)
                    load_piece(K, U(k_at + at), kx, e * NV + c * VEC)
                    load_piece(V, U(v_at + at), vx, e * NV + c * VEC)
                    if not WHOLE_PIECES:
                        inside = start < d
                        for j in range(VEC):
                            kx[e * NV + c * VEC + j] = kx[e * NV + c * VEC + j] if inside else ZERO
                            vx[e * NV + c * VEC + j] = vx[e * NV + c * VEC + j] if inside else ZERO
            for r in range(ROWS):
                # A padded row (past the group's last) repeats the last one's work, so that
                # every row runs the same code (a loop ptxas can unroll); never written.
                rr = min(tile * ROWS + r, n_rows - 1)
                h = hk * group + rr // Sq
                i = rr % Sq
                # Alg.1 l.8: this lane's part of each key's q . k.
                for e in range(KEYS):
                    part = ZERO
                    for v in range(NV):
                        part += q[r * NV + v] * kx[e * NV + v]
                    s[e] = part
                if TRANSPOSED:
                    # The step's sums reduced together: this lane gets the score of key
                    # `own` alone, and masks it (variants.py; -inf: its product is dropped,
                    # so NaN there has no effect) and scores it; then the step's max.
                    x = step_scores(s, lane)
                    key = base + own
                    if key < last and visible(b, h, i, key, n, causal_offset, window_lo,
                                              attn_mask):
                        x, _ = score(x * softmax_scale, b, h, i, key, Sq, n, softcap,
                                     slopes, attn_mask)
                    else:
                        x = NEG_INF
                    m_step = step_max(x)
                else:
                    # The parent's: every score summed over the whole warp, then every lane
                    # masks and scores all KEYS keys.
                    warp_sums(s)
                    m_step = NEG_INF
                    for e in range(KEYS):
                        key = base + e
                        if key < last and visible(b, h, i, key, n, causal_offset, window_lo,
                                                  attn_mask):
                            s[e], _ = score(s[e] * softmax_scale, b, h, i, key, Sq, n,
                                            softcap, slopes, attn_mask)
                        else:
                            s[e] = NEG_INF
                        if s[e] > m_step:
                            m_step = s[e]
                # Alg.1 l.9-10, as v2: rescale o and l to the new max, add the step. Every
                # lane has the same m_step bits, so the same m, alpha and l.
                m_new = m_step if m_step > m[r] else m[r]
                m_safe = ZERO if m_new == NEG_INF else m_new
                alpha = math.exp(m[r] - m_safe) if m[r] != NEG_INF else ZERO
                for v in range(NV):
                    o[r * NV + v] *= alpha
                l_step = ZERO
                if TRANSPOSED:
                    # One exp per lane, for its own key; every lane gets all KEYS of them
                    # (from_key), -inf marking a key the row does not see (exp never gives
                    # -inf; a NaN score gives p = NaN, which reaches l and o), and adds
                    # them in the same order, so l has the same bits in every lane.
                    p = math.exp(x - m_safe) if x != NEG_INF else NEG_INF
                    for e in range(KEYS):
                        pe = from_key(p, e)
                        if pe != NEG_INF:                   # masked keys add nothing
                            l_step += pe
                            for v in range(NV):
                                o[r * NV + v] += pe * vx[e * NV + v]
                else:
                    # The parent's: every lane computes every key's exp.
                    for e in range(KEYS):
                        if s[e] != NEG_INF:                 # masked keys add nothing
                            pe = math.exp(s[e] - m_safe)
                            l_step += pe
                            for v in range(NV):
                                o[r * NV + v] += pe * vx[e * NV + v]
                l[r] = alpha * l[r] + l_step
                m[r] = m_new
            base += WARPS * KEYS

        # Merge the four warps (their logsumexp, as the splits are merged).
        for r in range(ROWS):
            for v in range(NV):
                o_w[warp, r, column(lane, v)] = o[r * NV + v]
            if lane == 0:
                m_w[warp, r] = m[r]
                l_w[warp, r] = l[r]
        # Wait until every warp's state is in shared memory before any thread merges.
        cuda.syncthreads()
        for idx in range(tid, ROWS * d, THREADS):           # Alg.1 l.12-13
            r = idx // d
            col = idx % d
            rr = tile * ROWS + r
            if rr < n_rows:
                bh = b * Hq + hk * group + rr // Sq
                i = rr % Sq
                o_sum, l_sum, m_max = merge_warps(m_w, l_w, o_w, r, col)
                # l = 0: the rows saw no key of this split: O = 0, L = -inf (a NaN l is
                # not 0 and carries through).
                out = ZERO if l_sum == ZERO else o_sum / l_sum
                lse = NEG_INF if l_sum == ZERO else m_max + math.log(l_sum)
                store_result(O, L, O_parts, L_parts, split, n_splits, bh, i, col, out, lse)

    return split_kv


# --- the launch contract ------------------------------------------------------------


@dataclass(frozen=True)
class CacheLayout:
    """Where device caches lie in memory, as far as the wide loads care: each cache's
    element strides of (batch, head, row) (the head dim is contiguous; 0 for a dimension
    of size 1, never stepped over) and the byte address of its first element."""
    k_strides: tuple
    v_strides: tuple
    k_address: int
    v_address: int


def load_width(dtype, d, layout=None):
    """(vec, why): the cache elements each lane reads per load (make_split_kv's ``vec``)
    for caches of ``dtype`` and head dim ``d``, and why, for the plan's reason.

    A wide load reads LOAD_BYTES = 8 bytes, vec = 8 / itemsize elements, from an 8-byte
    aligned address. Every load starts at a row's start plus a multiple of vec columns,
    so it is aligned when each cache's first element is (``layout``'s addresses), its
    (batch, head, row) strides are multiples of vec and so is d (the last load of a row
    with d not a multiple of 32 vec starts at d - vec). ``layout`` None: host caches,
    which are copied into a fresh, C-contiguous device array (strides multiples of d).
    Otherwise, and with LOADS = "scalar", one element a load."""
    name = np.dtype(dtype).name
    vec = wide_vec(np.dtype(dtype).itemsize)
    if LOADS == "scalar":
        return 1, f"loads of one {name} element a lane (split_kv.LOADS = 'scalar')"
    if vec == 1:
        return 1, f"loads of one {name} element (8 bytes) a lane"
    scalar = f"loads of one {name} element a lane, not {vec} ({LOAD_BYTES} bytes)"
    if d % vec:
        return 1, f"{scalar}: the head dim {d} is not a multiple of {vec}"
    if layout is not None:
        for cache, strides, address in (("k_cache", layout.k_strides, layout.k_address),
                                         ("v_cache", layout.v_strides, layout.v_address)):
            if address % LOAD_BYTES:
                return 1, (f"{scalar}: {cache} does not start at an {LOAD_BYTES}-byte "
                           f"aligned address")
            if any(st % vec for st in strides):
                return 1, (f"{scalar}: {cache}'s strides {tuple(strides)} (elements) are not "
                           f"multiples of {vec}")
    return vec, f"loads of {vec} {name} elements ({LOAD_BYTES} bytes) a lane"


def reduction_description(keys, reduction):
    """How a step's scores are summed over the warp, for the plan's reason."""
    if reduction == "transposed":
        shuffles = keys - 1 + 5 - (keys.bit_length() - 1)
        return (f"the step's {keys} scores reduced together ({shuffles} shuffles, then one "
                f"key per lane)")
    return f"each of the step's {keys} scores all-reduced over the warp (5 shuffles each)"


def refusal(p):
    """None: split_kv takes every cache (numbaflash/policy.py's decode_kernel)."""
    return None


def shared_bytes(rows, d, acc_dtype, vec=1):
    """Static shared memory of a block: the warps' m and l (rows each) and o (rows x the
    head dim padded to whole pieces of 32 vec columns)."""
    itemsize = np.dtype(acc_dtype).itemsize
    return WARPS * rows * (2 + -(-d // (32 * vec)) * 32 * vec) * itemsize


def plan(p, where, n_splits, reason):
    """The Plan of the split-KV kernel for CacheProblem ``p`` and ``n_splits`` splits:
    grid (n_splits, row tiles, B * Hk), block (THREADS,)."""
    rows = rows_per_block(p.group * p.Sq, p.d)
    tiles = math.ceil(p.group * p.Sq / rows)
    vec, loads = load_width(p.dtype, p.d, p.layout)
    keys = keys_per_step(p.d, vec, p.acc_dtype)
    reason += (f"; query rows per block: {rows} of the {p.group * p.Sq} that read each K/V "
               f"head ({p.group} heads x {p.Sq} rows, in {tiles} block(s)); {WARPS} warps "
               f"streaming {keys} keys a step each, with {loads}; "
               f"{reduction_description(keys, REDUCTION)}")
    return Plan("kvcache", "split_kv", "split_kv", where, None, None,
                (n_splits, tiles, p.B * p.Hk), (THREADS,),
                shared_bytes(rows, p.d, p.acc_dtype, vec), p.acc_dtype,
                "bottom_right" if p.causal else None, reason, variant_description(p))


def kernel(plan, p):
    """The compiled kernel of ``plan`` (cached per compile-time parameters)."""
    vec, _ = load_width(p.dtype, p.d, p.layout)
    return make_split_kv(p.d, rows_per_block(p.group * p.Sq, p.d), p.upper, p.acc_dtype,
                         p.variant, half_of(p.dtype), vec, REDUCTION)
