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
* over the 32 lanes of a warp, by head-dim column: lane x holds columns x, x + 32, ...
  (NC of them) of every row it touches, so a warp reads each cached key and value row in
  whole, coalesced 32-element pieces. A score q . k is the sum of 32 lanes' partial dot
  products: a warp all-reduce (``warp_sums``: five rounds of xor shuffles, each round
  for all of a step's keys at once), after which every lane holds it and runs the same
  online-softmax step for its own columns of o.

Every block holds several query rows at once (``rows``: up to MAX_ROWS of the group x Sq
rows of one (batch, K/V head)), so with GQA each key and value is read once for them
(for a group of four, two blocks read it).
Each warp ends with its own (m, l, o) per row; the block merges its four warps by their
logsumexp through shared memory (``merge_warps``), then writes O and L directly (one
split) or its split's normalised O_s and L_s for the combine kernel (combine.py).

What it buys: a decode call reads the whole cache once, so it is memory-bound, and the
splits let it use the whole GPU. At (8, 32, 1, 32768, 128) it read 2787 GB/s in float32
(2.0x SDPA's bandwidth, 0.65 of the HBM copy) and 2114 GB/s in float16 (0.46x SDPA, 0.496
of the copy); with GQA (8 K/V heads) far less in float16 (0.12x SDPA): the per-(key, row)
work of the reductions limits it there (lab/runs/2026-12-04/102_decode_strided_gpu.txt;
docs/performance.md, "Decoding").

Lengths: batch b sees the first n_b = cache_seqlens[b] + S_new keys of its cache (never
more than S_max). Causal and windows are bottom-right aligned within that length:
row i sees key j iff j <= i + n_b - Sq (+ right) and j >= i + n_b - Sq - left; ALiBi
adds -slope * |i + n_b - Sq - j|: ``visible`` and ``score`` of kernels/variants.py with
Sk = n_b.

Runs on the GPU and the simulator (warp shuffles there through kernels/simulated.py).
"""

import functools
import math

import numpy as np
from numba import cuda

from .. import acc_type, jit_options
from ..halves import half_of, make_halves
from ..plan import Plan, variant_description
from ..ptx import flat_load
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
LANE_VALUES = 32                # per lane: rows x NC (q, o) and KEYS x NC (k, v) at most


def columns_per_lane(d):
    """NC: head-dim columns each lane holds (lane x: x, x + 32, ...)."""
    return (d + 31) // 32


def keys_per_step(d):
    """KEYS: keys a warp loads in one step before using them (up to 8, so that 8 loads of
    each of K and V are in flight per lane), fewer at d > 128 to keep KEYS x NC registers
    per lane within LANE_VALUES."""
    return max(1, min(8, LANE_VALUES // columns_per_lane(d)))


def rows_per_block(rows_needed, d):
    """The rows one block holds: the power of two that covers the group x Sq rows of a
    (batch, K/V head), up to MAX_ROWS (and fewer at d > 128, registers as above)."""
    cap = max(1, min(MAX_ROWS, LANE_VALUES // columns_per_lane(d)))
    rows = 1
    while rows < rows_needed and rows < cap:
        rows *= 2
    return rows


@functools.lru_cache(maxsize=None)
def make_split_kv(d, rows, causal, acc_dtype, variant=PLAIN, half=None):
    """The split-KV decode kernel for head dim ``d``, ``rows`` query rows per block,
    ``causal`` (the band's upper bound: causal, bottom-right within each batch's length,
    and/or a window's right side, at ``upper_shift``) and ``variant`` (window, softcap,
    ALiBi; kernels/variants.py), accumulating in ``acc_dtype``.

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
    acc = acc_type(acc_dtype)
    BF16 = half == "bfloat16"
    widen = make_halves("bfloat16").widen if BF16 else acc
    narrow = make_halves("bfloat16").narrow
    ZERO = acc(0)
    NEG_INF = acc(-math.inf)
    NC = columns_per_lane(d)
    DP = NC * 32                       # the head dim padded to whole warps
    WHOLE_WARPS = d % 32 == 0          # every lane's columns are inside the head dim
    KEYS = keys_per_step(d)
    ROWS = rows
    ROW_VALUES = ROWS * NC             # a lane's share of the rows' q (and of o)
    STEP_VALUES = KEYS * NC            # a lane's share of a step's keys (and values)
    WINDOW = variant.window
    visible, score = make_variant_functions(variant, causal, acc_dtype)

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
        Sq = Q.shape[2]
        n_rows = group * Sq                 # the rows that read this K/V head

        # This batch's keys, and the band its rows see (bands.py's bounds, in keys).
        n = min(seqlens[b] + n_new, S_max)
        causal_offset = n - Sq + upper_shift
        window_lo = n - Sq + lower_shift
        lo = 0
        hi = n
        if causal:                          # the last row sees up to here
            hi = min(hi, max(0, Sq + causal_offset))
        if WINDOW:                          # the first row sees from here
            lo = min(hi, max(0, window_lo))
        # This split's share of [lo, hi): reference.split_ranges' rule.
        span = hi - lo
        first = lo + split * (span // n_splits) + min(split, span % n_splits)
        last = first + span // n_splits + (1 if split < span % n_splits else 0)

        m_w = cuda.shared.array((WARPS, ROWS), acc)        # each warp's m, l, o per row
        l_w = cuda.shared.array((WARPS, ROWS), acc)
        o_w = cuda.shared.array((WARPS, ROWS, DP), acc)
        q = cuda.local.array(ROW_VALUES, acc)               # the rows' q, this lane's columns
        o = cuda.local.array(ROW_VALUES, acc)
        m = cuda.local.array(ROWS, acc)
        l = cuda.local.array(ROWS, acc)
        kx = cuda.local.array(STEP_VALUES, acc)              # one step's keys and values
        vx = cuda.local.array(STEP_VALUES, acc)
        s = cuda.local.array(KEYS, acc)

        for r in range(ROWS):                               # Alg.1 l.4-5
            rr = tile * ROWS + r
            h = hk * group + rr // Sq
            for c in range(NC):
                col = lane + 32 * c
                q[r * NC + c] = widen(Q[b, h, rr % Sq, col]) if rr < n_rows and col < d else ZERO
                o[r * NC + c] = ZERO
            m[r] = NEG_INF
            l[r] = ZERO

        base = first + warp * KEYS
        while base < last:
            # Load a step of keys and values, whole rows across the warp (coalesced). Every
            # load is issued, from a row and column inside the cache (clamped), with no
            # branch between the loads, so all of them are in flight together
            # (kernels/forward/v6_tile_steps.py stages its tiles the same way). A key past
            # the split (clamped to its last row) is never used: its score is set to -inf
            # below and its value is not added. Columns past d (d not a multiple of 32)
            # are zeroed, since every lane's partial dot product sums all its columns.
            for e in range(KEYS):
                key = min(base + e, last - 1)
                k_at = b * k_batch + hk * k_head + key * k_row     # where the rows start
                v_at = b * v_batch + hk * v_head + key * v_row
                for c in range(NC):
                    col = lane + 32 * c if WHOLE_WARPS else min(lane + 32 * c, d - 1)
                    kx[e * NC + c] = widen(flat_load(K, U(k_at + col)))
                    vx[e * NC + c] = widen(flat_load(V, U(v_at + col)))
                    if not WHOLE_WARPS:
                        inside = lane + 32 * c < d
                        kx[e * NC + c] = kx[e * NC + c] if inside else ZERO
                        vx[e * NC + c] = vx[e * NC + c] if inside else ZERO
            for r in range(ROWS):
                # A padded row (past the group's last) repeats the last one's work, so that
                # every row runs the same code (a loop ptxas can unroll); never written.
                rr = min(tile * ROWS + r, n_rows - 1)
                h = hk * group + rr // Sq
                i = rr % Sq
                # Alg.1 l.8: this lane's part of each key's q . k, then the warp's sums,
                # the step's KEYS reductions interleaved (their shuffles are independent).
                for e in range(KEYS):
                    part = ZERO
                    for c in range(NC):
                        part += q[r * NC + c] * kx[e * NC + c]
                    s[e] = part
                warp_sums(s)
                # The scores of the visible keys (variants.py), -inf for the others (their
                # products are dropped, so NaN there has no effect), and the step's max.
                m_step = NEG_INF
                for e in range(KEYS):
                    key = base + e
                    if key < last and visible(b, h, i, key, n, causal_offset, window_lo,
                                              attn_mask):
                        s[e], _ = score(s[e] * softmax_scale, b, h, i, key, Sq, n, softcap,
                                        slopes, attn_mask)
                    else:
                        s[e] = NEG_INF
                    if s[e] > m_step:
                        m_step = s[e]
                # Alg.1 l.9-10, as v2: rescale o and l to the new max, add the step.
                m_new = m_step if m_step > m[r] else m[r]
                m_safe = ZERO if m_new == NEG_INF else m_new
                alpha = math.exp(m[r] - m_safe) if m[r] != NEG_INF else ZERO
                for c in range(NC):
                    o[r * NC + c] *= alpha
                l_step = ZERO
                for e in range(KEYS):
                    if s[e] != NEG_INF:                     # masked keys add nothing
                        p = math.exp(s[e] - m_safe)
                        l_step += p
                        for c in range(NC):
                            o[r * NC + c] += p * vx[e * NC + c]
                l[r] = alpha * l[r] + l_step
                m[r] = m_new
            base += WARPS * KEYS

        # Merge the four warps (their logsumexp, as the splits are merged).
        for r in range(ROWS):
            for c in range(NC):
                o_w[warp, r, lane + 32 * c] = o[r * NC + c]
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
                if n_splits == 1:
                    if BF16:
                        O[bh, i, col] = narrow(out)
                    else:
                        O[bh, i, col] = out
                    if col == 0:
                        L[bh, i] = lse
                else:
                    O_parts[split, bh, i, col] = out
                    if col == 0:
                        L_parts[split, bh, i] = lse

    return split_kv


# --- the launch contract ------------------------------------------------------------


def shared_bytes(rows, d, acc_dtype):
    """Static shared memory of a block: the warps' m and l (rows each) and o (rows x the
    head dim padded to 32)."""
    itemsize = np.dtype(acc_dtype).itemsize
    return WARPS * rows * (2 + columns_per_lane(d) * 32) * itemsize


def plan(p, where, n_splits, reason):
    """The Plan of the split-KV kernel for CacheProblem ``p`` and ``n_splits`` splits:
    grid (n_splits, row tiles, B * Hk), block (THREADS,)."""
    rows = rows_per_block(p.group * p.Sq, p.d)
    tiles = math.ceil(p.group * p.Sq / rows)
    reason += (f"; query rows per block: {rows} of the {p.group * p.Sq} that read each K/V "
               f"head ({p.group} heads x {p.Sq} rows, in {tiles} block(s)); {WARPS} warps "
               f"streaming {keys_per_step(p.d)} keys a step each")
    return Plan("kvcache", "split_kv", "split_kv", where, None, None,
                (n_splits, tiles, p.B * p.Hk), (THREADS,), shared_bytes(rows, p.d, p.acc_dtype),
                p.acc_dtype, "bottom_right" if p.causal else None, reason,
                variant_description(p))


def kernel(plan, p):
    """The compiled kernel of ``plan`` (cached per compile-time parameters)."""
    return make_split_kv(p.d, rows_per_block(p.group * p.Sq, p.d), p.upper, p.acc_dtype,
                         p.variant, half_of(p.dtype))
