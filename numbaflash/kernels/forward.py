"""Forward attention kernels: O = softmax(scale * Q K^T [masked]) V and L = logsumexp.

All kernels take (BH, Sq, d) Q and (BH, Sk, d) K, V (batch and heads flattened into BH),
write O (BH, Sq, d) and L (BH, Sq), and are built by a cached factory whose arguments
are compile-time constants (tile sizes, head dim, causal or not, accumulator dtype).
Run-time arguments are ``softmax_scale`` and ``causal_offset``: key column c is visible
from query row r iff c <= r + causal_offset (see numbaflash/masks.py).

The version ladder (each step says what changes against the previous one):

v1  One thread per query row, no shared memory. Each thread reads its q row into
    registers and streams every key and value straight from global memory, updating the
    online softmax (running max m, running sum l, accumulator o) one key at a time.
    The online softmax in its purest form (the running sum is compensated, Kahan-style,
    to stay accurate over long rows). Cost: every thread re-reads all of K and V from
    HBM (Sq times in all), and every key pays a rescale exp(m_old - m_new).
    H200, 2026-11-30, (2, 16, 4096, 64): 5.3 TFLOP/s (SDPA fp32: 34; docs/gpu-results.md).

v2  FlashAttention-2 forward (Algorithm 1). One thread block per (Q tile i, head bh),
    one thread per query row of the tile, holding its row of Qi in registers. It walks the K/V
    tiles j: all threads copy Kj and Vj into shared memory together, then each thread
    computes its row of Sij, takes the tile's max, rescales o once per tile (not once
    per key), and accumulates Pij Vj; the tile's rowsum is added to l as one term
    (Alg.1 l.9), which also keeps float32 rounding small. K and V now come from HBM
    once per Q tile instead of once per row (Br times less traffic). Normalise by l
    once at the end. Causal blocks stop at the last K/V tile they can see.
    H200, 2026-11-30, (2, 16, 4096, 64): 8.5 TFLOP/s, 1.6x v1; the default version.

v3  Tensor cores (GPU only). The same Algorithm 1 with the two matrix products,
    Sij = Qi Kj^T and P~ij Vj, on the tensor cores through inline-PTX ``mma.sync``
    (m16n8k8, TF32 inputs, float32 sums; kernels/ptx.py). TF32 keeps 10 of float32's 23
    mantissa bits, so every operand is split in two TF32 parts and three products are
    summed ("3xTF32"), with the small products in their own accumulator and each chunk's
    P~ij Vj summed from zero: with both, v3's error on the H200 is below that of a
    float32 matmul. A warp owns 16 query rows; row max and sum are shared by the four
    lanes of a quad with warp shuffles. The simulator cannot run it: there the
    dispatcher uses v2. Measured on the H200 (docs/gpu-results.md): 9.3 TFLOP/s at
    (2, 16, 4096, 64) against v2's 8.5 and PyTorch SDPA's 34; what holds it back is
    register pressure (249 registers a thread, 2 blocks per SM), the TF32 splits done
    on every load, and K/V tiles loaded without overlap with the math.
    Contract: finite inputs. A NaN or inf in V at a key that a mask hides from some rows
    of a tile reaches those rows (0 * NaN inside the product), and an inf in K turns that
    key's TF32 split into NaN; v1 and v2 never read masked keys and keep +-inf scores.
    So v3 runs only when asked for (version="v3"); v6 fixes both.

v4  Register-blocked SIMT FlashAttention-2 (runs on the GPU and the simulator; the default
    for plain attention from run 14 until v5 replaced it after run 21). v2 is bound by
    shared-memory loads: each FMA of q_i . Kj[c] and p * Vj[c, k] needs one shared load, and
    no loaded value serves a second row. v4 gives each thread a TM x TN block of Sij and a
    TM x DN block of O_i (DN = d / TX, TX = Bc / TN threads per row) in registers, like a
    SIMT matmul: per k step of Sij it loads TM values of Qi and TN of Kj and does TM * TN
    FMAs, and per key of P~ij Vj it loads TM values of P~ij and DN of Vj for TM * DN FMAs.
    Default float32 tiles at d = 64: Br = 64, Bc = 32, 4 x 4 per thread, 128 threads: 0.5
    loads per FMA in Sij and 0.375 in P~ij Vj instead of 1 (2x to 2.7x fewer loads). Qi is
    staged in shared memory (transposed), Kj transposed, and P~ij goes through shared memory
    (the threads of a row hold different keys); row max and row sum are shared by the TX
    threads of a row through a small shared array (no warp shuffles, so the simulator runs
    it). Costs: four barriers per K/V tile instead of two, and the 48 KB static
    shared-memory limit (Qi, Kj, Vj and P~ij all staged) keeps tiles small at d = 128 (Br =
    32, Bc = 16). Masked keys never reach O: on the causal diagonal the P~ij Vj loop skips
    the hidden (row, key) pairs, so NaN or inf in a masked key has no effect, as in v2.
    ptxas (sm_90, float32, no GPU): 128 registers at d = 64 (4 blocks = 16 warps per SM),
    156 at d = 128 (6 blocks of 64 threads = 12 warps per SM), no spills, no stack. Measured
    on the H200 in docs/performance.md (run 15: 0.34x SDPA EFFICIENT at (2, 16, 4096, 64)
    against v2's 0.23x; faster than v2 in five of issue 5's six cases, tied at (2, 16, 4096,
    128)). Run 14 passed its GPU property tests and compute-sanitizer's memcheck, racecheck
    and synccheck, and it became the default. With unsigned tile indices (as v5, below; run
    20): 10.50 ms against 11.65 before at (2, 16, 4096, 64); memcheck, racecheck and
    synccheck 0 errors again (run 22). With while loops (kernels/__init__.py; run 26): 7.09
    ms at d = 64 and 21.04 at d = 128; ptxas then reports 98 registers at d = 64 and 129 at
    d = 128, no spills.

v5  v4 with dynamic shared memory (the default for plain attention in float32 and float16
    with d <= 128 on the simulator, and on a GPU until v6; runs on both).
    v4's static shared arrays are limited to 48 KB per block, which is what holds v4 to
    (32, 16) tiles and 64-thread blocks at d = 128 (0.128x SDPA there against 0.342x at
    d = 64). v5 runs v4's algorithm, thread layout, barriers and NaN-safety unchanged, but
    its five tiles are slices of ONE dynamic shared array, ``cuda.shared.array(0, acc)``,
    at compile-time offsets (Numba gives every dynamic shared array the same base), with
    flat indices ([row * row_length + col]); the byte count goes with the launch,
    ``kernel[grid, block, 0, nbytes]``, and above 48 KB the compiled kernel must first be
    allowed it (kernels/smem.py sets CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES; up to
    227 KB per block on the H200). Default float32 tiles: d = 64 as v4 (64, 32, 4, 4),
    43776 bytes, so v4 against v5 there measures what dynamic shared memory costs; d = 128
    (64, 32, 4, 4), 77056 bytes, 128 threads (two blocks per SM). ptxas (sm_90, float32,
    with the unsigned indices below): 96 registers at d = 64 (v4: 114-128), 128 at d = 128
    with the bigger tiles; no spills, no stack. Costs: fewer blocks per SM at d = 128 (two,
    8 warps, against v4's 12 warps). Measured on the H200
    (scripts/v5_sweep.py, run 17 in docs/gpu-results.md), (2, 16, 4096, d), float32:
    d = 128: 38.6 ms against v4's 48.8 and v2's 48.1 (1.26x v4; v3, tensor cores: 33.8);
    d = 64, the same tiles as v4: 17.6 ms against v4's 12.1. The cause, found in the SASS
    afterwards (scripts/sass_loops.py): the tiles are slices whose length is a run-time
    value, and Numba wraps every signed index that might be negative around by it, which
    doubled the integer instructions of the inner loops. The tiles are now indexed with
    unsigned integers (``U``, kernels/smem.py): the inner loops have fewer instructions
    than v4's (76 and 61 against 90 and 41 for twice the FMAs, d = 64), and the results
    are bitwise v4's on the simulator. Timed on the H200 since (runs 20 and 21,
    scripts/dynamic_smem_timing.py and scripts/v5_sweep.py; v4 with unsigned indices as
    well): d = 64, v4's tiles 10.28 ms against v4's 10.50, and (128, 64, 8, 4) 8.33 ms;
    d = 128, (64, 32, 4, 2) 22.88 ms against v4's 43.36. v5 is now the default for plain
    attention in float32 and float16 with d <= 128 (dispatch.default_v5_tiles). Its
    multiply-add and tile-loading loops are while loops (kernels/__init__.py says why):
    run 26 took 5.86 ms at d = 64 (8.33 before) and 15.50 ms at d = 128 (22.87 before),
    0.659x PyTorch SDPA's float32 forward at (2, 16, 4096, 64) (docs/performance.md).
    Since v6 (below) it is the default on the simulator only.

v6  v3 made fast and exact (GPU only; the default for plain attention in float32 with
    d <= 128 on a GPU before v8, and in float16 before v7; on the simulator the
    dispatcher runs v5). v3 split
    every K and V operand into TF32 parts again for every mma, in every warp (1162
    instructions per 16-key chunk for 96 mma: scripts/sass_loops.py). v6 splits each
    element once, while the block stages the tile, into (big, small) pairs in dynamic
    shared memory that one 8-byte load fetches; stages the tile one column per thread
    with four loads in flight and flat addresses; keeps three independent sums per score
    tile; masks only the edge and diagonal tiles; and uses exp2 with log2(e) folded in:
    659 instructions per chunk on the path a finite input takes. It is exact for every
    input, which v3 is not: non-finite values are staged as 0 and, in the rare tiles
    that hold one, the terms they were left out of are added back in float32, so NaN and
    inf land exactly where v1/v2 and the reference put them. H200, 2026-12-01 (runs
    27-32, docs/performance.md): (2, 16, 4096, 64) 5.98 ms against v5's 6.75 in the same
    bench, 0.672x SDPA EFFICIENT (v3: 14.7 ms); d = 128, 13.25 ms against 15.92; 0.77x at
    (1, 16, 16384, 64). What holds it back (ncu, run 32): 172 registers and one block of
    eight warps per SM, issue slots busy 38 %, and the K/V tile loaded while no warp of
    the block computes.

v7  v6 for float16 inputs on the float16 tensor cores (GPU only; the default for plain
    float16 attention with d <= 128 on a GPU; on the simulator, v5). A float16 value has
    11 significant bits, so the tensor cores' float16 mma (m16n8k16) multiplies two of
    them exactly and sums in float32: one product where v6 needs three TF32 ones, over
    16 of the head dim instead of 8. Kj and Vj (transposed) stay float16 in shared
    memory, two neighbours per 32-bit word; the S accumulators are, as they stand, the
    A fragments of P~ Vj, with P~ rounded to float16 there (as flash-attention's float16
    kernels do; l sums the float32 P~). NaN and inf are handled as in v6. H200,
    2026-12-01 (run 43, scripts/v7_sweep.py, float16 inputs): (2, 16, 4096, 64) 2.47 ms
    against v6's 6.04 on the same inputs, 53-56 TFLOP/s; d = 128, 5.34 ms against 12.86;
    PyTorch SDPA's float16 EFFICIENT kernel took 1.23 and 1.75 ms.

v8  v6 with its chunk loop reordered (GPU only; the default for plain float32 attention
    with d <= 64 on a GPU; on the simulator, v5). Each chunk's online softmax is a
    chain of dependent steps, and with two warps per scheduler the tensor cores idled
    while it ran. v8 starts the next chunk's S = Qi Kj^T before this chunk's softmax, so
    that the scheduler has independent mma to issue between the softmax's steps. The
    same operations on the same values: its results are bitwise v6's (run 50 compared
    them). H200, 2026-12-01 (run 50, scripts/v6_sweep.py --configs, (2, 16, 4096, d),
    float32, ms not causal / causal): d = 64, 5.50 / 3.28 against v6's 6.04 / 3.65;
    d = 128, where Qi is read from shared memory, 13.75 / 7.63 against 13.53 / 8.08.
    (The default up to d = 64; from d = 65 on, v9.)

v9  v8 with the next K/V tile on its way (GPU only, float32 inputs; the default for
    plain float32 attention with 64 < d <= 128 on a GPU; on the simulator, v5). While
    the block computes tile j, each thread's copies of tile j + 1 travel from global to
    shared memory by cp.async (ptx.cp_async: no register, no wait); at the next tile it
    waits for its own copies and splits them as v6 does. At d > 64 Qi is kept plain and
    split as read, which makes room for the landing slots. The same values into the
    same operations: bitwise v8's results. H200, 2026-12-01 (run 60, scripts/v6_sweep.py
    --configs, (2, 16, 4096, d), float32, ms not causal / causal): d = 128, 10.11 / 5.74
    against v8's 10.92 / 6.08; d = 64, 5.41 / 3.76 against 5.43 / 3.15 (255 registers).

Variants (kernels/variants.py, docs/variants.md): v1 and v2 take a compile-time
``variant`` and seven more run-time arguments after causal_offset (window_lo, Hq, group,
softcap, slopes, attn_mask, tiles): sliding windows, GQA/MQA, softcap, ALiBi, boolean and
additive masks, and the user's score_mod / mask_mod, all through two inlined device
functions, visible() and score(). Masked entries are not computed; tiles a window leaves
empty are not visited, and v2 skips the tiles a boolean attn_mask or a mask_mod leaves
empty through the table of visible tiles (``tiles``, variants.make_tile_table). v3 to v9
compute plain attention only (the dispatcher refuses variants).

Fully masked rows (causal with Sq > Sk, or Sk = 0) end with l = 0: they write O = 0 and
L = -inf. NaN in a visible input propagates to the rows that see it; masked keys are
never read into the sums, so NaN there has no effect.
"""

import functools
import math

from numba import cuda, int32

from . import acc_type, jit_options
from .bands import make_kv_tile_range
from .smem import U
from .variants import PLAIN, make_variant_functions

VERSIONS = ("v1", "v2", "v3", "v4", "v5", "v6", "v7", "v8", "v9")


@functools.lru_cache(maxsize=None)
def make_forward_v1(d, causal, acc_dtype, variant=PLAIN):
    """v1 kernel for head dim ``d``. Launch: grid (ceil(Sq / threads), B * Hq), block
    (threads,). ``variant`` (kernels/variants.py) adds masks and score modifiers."""
    acc = acc_type(acc_dtype)
    ZERO = acc(0)
    NEG_INF = acc(-math.inf)
    visible, score = make_variant_functions(variant, causal, acc_dtype)
    WINDOW = variant.window

    @cuda.jit(**jit_options())
    def forward_v1(Q, K, V, O, L, softmax_scale, causal_offset, window_lo, Hq, group, softcap,
                   slopes, attn_mask, tiles):
        bh = cuda.blockIdx.y            # b * Hq + h: the query head
        row = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        Sq = Q.shape[1]
        Sk = K.shape[1]
        if row >= Sq:
            return                      # no barriers in this kernel, so early exit is safe
        b = bh // Hq
        h = bh % Hq
        bh_kv = b * (Hq // group) + h // group  # GQA: the K/V head this query head reads

        q_i = cuda.local.array(d, acc)  # this row of Q, in registers
        o_i = cuda.local.array(d, acc)  # unnormalised output accumulator
        for k in range(d):
            q_i[k] = acc(Q[bh, row, k])
            o_i[k] = ZERO
        m_i = NEG_INF                   # running max of the scores seen so far
        l_i = ZERO                      # running sum of exp(score - m_i)
        l_err = ZERO                    # its compensation term (see below)

        n_cols = Sk
        if causal:                      # columns past row + offset are masked: never visit them
            n_cols = min(Sk, max(0, row + causal_offset + 1))
        first_col = 0
        if WINDOW:                      # columns before row + window_lo too
            first_col = min(n_cols, max(0, row + window_lo))
        for col in range(first_col, n_cols):
            if not visible(b, h, row, col, Sk, causal_offset, window_lo, attn_mask):
                continue                # masked: not computed, nothing read
            s = ZERO
            for k in range(d):
                s += q_i[k] * acc(K[bh_kv, col, k])
            s, _ = score(s * softmax_scale, b, h, row, col, Sq, Sk, softcap, slopes, attn_mask)
            if s == NEG_INF:
                continue                # probability exactly 0 (e.g. a -inf bias)
            # online softmax, one key at a time: written with ">" so a NaN score leaves m_i
            # alone and reaches o and l through p (NaN propagates, it is not dropped)
            m_new = s if s > m_i else m_i
            alpha = math.exp(m_i - m_new) if m_i != NEG_INF else ZERO   # rescale old state
            p = math.exp(s - m_new)
            # l_i = l_i * alpha + p, as a compensated (Kahan) sum: l_i gathers Sk terms one
            # at a time, and in float32 a plain sum's rounding error grows with Sk (2.3x
            # PyTorch's float32 softmax error at Sk = 4096 on the H200). l_err carries the
            # low-order bits that the last addition lost.
            l_i *= alpha
            l_err *= alpha
            y = p - l_err
            t = l_i + y
            l_err = (t - l_i) - y
            l_i = t
            for k in range(d):
                o_i[k] = o_i[k] * alpha + p * acc(V[bh_kv, col, k])
            m_i = m_new

        _write_row(O, L, bh, row, o_i, m_i, l_i, d, ZERO, NEG_INF)

    return forward_v1


@functools.lru_cache(maxsize=None)
def make_forward_v2(Br, Bc, d, causal, acc_dtype, variant=PLAIN):
    """v2 (FlashAttention-2, Algorithm 1) kernel; ``variant`` (kernels/variants.py) adds
    masks and score modifiers.

    Launch: grid (Tr, B * Hq) with Tr = ceil(Sq / Br), block (Br,): thread r owns row i*Br + r.
    Shared memory: Kj (Bc, d) and Vj (Bc, d) in the accumulator dtype. The Q tile lives in
    registers, each thread holding its own row q_i: Alg.1 l.4 loads Qi "to on-chip SRAM",
    and registers are the fastest on-chip memory. No other thread reads that row, and
    reading it from shared memory instead (as the first draft of v2 did) costs a second
    shared-memory load per multiply-add in Sij = Qi Kj^T: that draft ran 1.7x slower than
    v1 on the H200 at (2, 16, 4096, 64).
    """
    acc = acc_type(acc_dtype)
    ZERO = acc(0)
    NEG_INF = acc(-math.inf)
    visible, score = make_variant_functions(variant, causal, acc_dtype)
    WINDOW = variant.window
    TILE_TABLE = variant.tile_table
    kv_tile_range = make_kv_tile_range(Br, Bc, causal, WINDOW)

    @cuda.jit(**jit_options())
    def forward_v2(Q, K, V, O, L, softmax_scale, causal_offset, window_lo, Hq, group, softcap,
                   slopes, attn_mask, tiles):
        bh = cuda.blockIdx.y            # b * Hq + h: the query head
        b = bh // Hq
        h = bh % Hq
        bh_kv = b * (Hq // group) + h // group  # GQA: the K/V head this query head reads
        i = cuda.blockIdx.x             # Q tile index (Alg.1 l.3: one block per i)
        r = cuda.threadIdx.x            # row within the tile
        row = i * Br + r
        Sq = Q.shape[1]
        Sk = K.shape[1]
        active = row < Sq               # the last tile may be ragged; idle threads still
                                        # help load K/V tiles and must reach every barrier

        Kj = cuda.shared.array((Bc, d), acc)
        Vj = cuda.shared.array((Bc, d), acc)
        q_i = cuda.local.array(d, acc)  # this thread's row of Qi (registers)
        o_i = cuda.local.array(d, acc)  # Alg.1 l.5: O_i = 0, l_i = 0, m_i = -inf (registers)
        s_i = cuda.local.array(Bc, acc)  # this row of Sij
        for k in range(d):
            o_i[k] = ZERO
            q_i[k] = acc(Q[bh, row, k]) if active else ZERO     # Alg.1 l.4: load Qi
        m_i = NEG_INF
        l_i = ZERO

        # Alg.1 l.6: loop over K/V tiles, only those that some row of the tile sees
        # through the causal mask and the window (bands.py): the others are entirely masked.
        j_start, j_end = kv_tile_range(i, Sk, causal_offset, window_lo)
        for j in range(j_start, j_end):
            if TILE_TABLE and not tiles[bh, i, j]:
                continue                # the mask leaves this tile empty (variants.py)
            # Wait until every thread has finished reading the previous Kj and Vj.
            cuda.syncthreads()
            # Alg.1 l.7: load Kj, Vj. The Br threads copy the Bc x d tile together;
            # rows past Sk are filled with 0 (and masked below).
            for idx in range(r, Bc * d, Br):
                c = idx // d
                k = idx % d
                col = j * Bc + c
                Kj[c, k] = acc(K[bh_kv, col, k]) if col < Sk else ZERO
                Vj[c, k] = acc(V[bh_kv, col, k]) if col < Sk else ZERO
            # Wait until Kj and Vj are complete before any thread reads them.
            cuda.syncthreads()
            if active:
                # Alg.1 l.8: this row of Sij = Qi Kj^T, masked, and its max. Masked
                # entries are not computed (variants.py decides which are masked).
                m_tile = NEG_INF
                for c in range(Bc):
                    col = j * Bc + c
                    s_i[c] = NEG_INF
                    if visible(b, h, row, col, Sk, causal_offset, window_lo, attn_mask):
                        s = ZERO
                        for k in range(d):
                            s += q_i[k] * Kj[c, k]
                        s_i[c], _ = score(s * softmax_scale, b, h, row, col, Sq, Sk, softcap,
                                          slopes, attn_mask)
                    if s_i[c] > m_tile:
                        m_tile = s_i[c]
                # Alg.1 l.9: new running max, P~ij = exp(Sij - m_new), new running sum.
                m_new = m_tile if m_tile > m_i else m_i
                m_safe = ZERO if m_new == NEG_INF else m_new    # no key seen yet: avoid -inf - -inf
                alpha = math.exp(m_i - m_safe) if m_i != NEG_INF else ZERO
                for k in range(d):
                    o_i[k] *= alpha     # Alg.1 l.10: diag(alpha) O_i ...
                l_tile = ZERO           # rowsum(P~ij) of this tile alone (see below)
                for c in range(Bc):
                    if s_i[c] != NEG_INF:               # masked keys are never read (NaN-safe)
                        p = math.exp(s_i[c] - m_safe)
                        l_tile += p
                        for k in range(d):
                            o_i[k] += p * Vj[c, k]      # Alg.1 l.10: ... + P~ij Vj
                # Alg.1 l.9: l_i = alpha l_i + rowsum(P~ij). Summing the tile first and then
                # adding it matters in float32: adding N terms one by one into l_i made the
                # error 2.3x that of PyTorch's float32 softmax at N = 4096 on the H200.
                l_i = alpha * l_i + l_tile
                m_i = m_new

        if active:
            _write_row(O, L, bh, row, o_i, m_i, l_i, d, ZERO, NEG_INF)   # Alg.1 l.12-16

    return forward_v2


@cuda.jit(device=True)
def _write_row(O, L, bh, row, o_i, m_i, l_i, d, ZERO, NEG_INF):
    """Normalise once and write one row: O = o / l, L = m + log(l) (Alg.1 l.12-13).

    l == 0 means the row saw no key (fully masked): O = 0 exactly and L = -inf. A NaN l
    is not 0, so NaN propagates to O and L instead of being repaired.
    """
    if l_i == ZERO:
        for k in range(d):
            O[bh, row, k] = ZERO
        L[bh, row] = NEG_INF
    else:
        for k in range(d):
            O[bh, row, k] = o_i[k] / l_i
        L[bh, row] = m_i + math.log(l_i)


FULL_WARP = 0xFFFFFFFF                  # the lane mask of a whole warp


@cuda.jit(device=True, inline=True)
def quad_max(x):
    """The max over the 4 lanes of a quad (the lanes sharing a row of an mma fragment,
    forward v3 and v6); '>' so that NaN does not win (as in v1/v2). Warp shuffles: GPU
    only."""
    y = cuda.shfl_xor_sync(FULL_WARP, x, 1)
    x = y if y > x else x
    y = cuda.shfl_xor_sync(FULL_WARP, x, 2)
    return y if y > x else x


@cuda.jit(device=True, inline=True)
def quad_sum(x):
    """The sum over the 4 lanes of a quad (see quad_max)."""
    x += cuda.shfl_xor_sync(FULL_WARP, x, 1)
    return x + cuda.shfl_xor_sync(FULL_WARP, x, 2)


V3_WARPS = 4                            # v3: warps per block, 16 query rows each
V3_BR = 16 * V3_WARPS                   # v3: query rows per block
V3_CHUNK = 16                           # v3: keys per online-softmax step


@functools.lru_cache(maxsize=None)
def make_forward_v3(Bc, d, causal):
    """v3 (tensor cores, 3xTF32) kernel. GPU only: it emits inline PTX (``mma.sync``) and
    warp shuffles, which the simulator cannot run; there, the dispatcher uses v2, which
    computes the same thing. Float32 accumulation only (float16 and float32 inputs).

    Launch: grid (ceil(Sq / 64), BH), block (128,): four warps, warp w owning query rows
    i*64 + 16w .. +16 of the tile. Shared memory: Kj and Vj, (Bc, DP + 4) float32 each,
    DP = d rounded up to a multiple of 8 (the mma's k); the +4 makes every fragment read
    below hit 32 different banks.

    Lane ``lane`` of a warp holds, for g = lane // 4 and t = lane % 4 (see ptx.py):
      Q fragments  q[ks*4 + 0..3] = Q[g, 8ks+t], Q[g+8, 8ks+t], Q[g, 8ks+t+4], Q[g+8, 8ks+t+4]
      S fragments  s[nt*4 + 0..3] = S[g, 8nt+2t], S[g, 8nt+2t+1], S[g+8, 8nt+2t], S[g+8, 8nt+2t+1]
      O fragments  o[nd*4 + 0..3] = O[g, 8nd+2t], O[g, 8nd+2t+1], O[g+8, 8nd+2t], O[g+8, 8nd+2t+1]
    so each lane owns 2 rows (g and g+8) and the 4 lanes of a "quad" (same g) share them:
    the row max needs a reduction over the quad (two shuffles); the row sum is kept per
    lane and reduced once at the end.

    P~ Vj reuses the S fragments as the A operand without moving data between lanes: the
    mma's k index is a free relabelling of the keys, so "k = t" is taken to mean key 2t
    and "k = t + 4" key 2t + 1 (the two keys a lane holds), and Vj's rows are read in
    that same order for the B operand.

    The K/V tile is processed V3_CHUNK keys at a time: loops that short are unrolled
    completely by NVVM, which keeps every fragment array in registers (over a whole
    64-key tile NVVM left S and O in local memory, and v3 ran at 9 TFLOP/s instead).
    """
    from .ptx import mma3_split_b as mma3, split_tf32 as split   # GPU only: inline PTX

    acc = acc_type("float32")
    ZERO = acc(0)
    NEG_INF = acc(-math.inf)
    DP = (d + 7) // 8 * 8                   # head dim padded to the mma's k = 8
    KS = DP // 8                            # mma steps over the head dim
    NT = V3_CHUNK // 8                      # mma steps over the keys of a chunk
    STRIDE = DP + 4                         # shared row stride (bank-conflict free)
    QO_FRAGS = KS * 4                       # fragment registers of Q and of O per lane
    S_FRAGS = NT * 4                        # fragment registers of S per lane
    write_rows = make_mma_row_steps(d, causal, V3_CHUNK, KS)[4]     # as v6 to v8
    THREADS = 32 * V3_WARPS
    kv_tile_range = make_kv_tile_range(V3_BR, Bc, causal, False)
    assert Bc % V3_CHUNK == 0

    @cuda.jit(**jit_options())
    def forward_v3(Q, K, V, O, L, softmax_scale, causal_offset):
        bh = cuda.blockIdx.y
        i = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        lane = tid % 32
        g = lane // 4
        t = lane % 4
        row0 = i * V3_BR + (tid // 32) * 16 + g     # this lane's two rows
        row1 = row0 + 8
        Sq = Q.shape[1]
        Sk = K.shape[1]

        Kj = cuda.shared.array((Bc, STRIDE), acc)
        Vj = cuda.shared.array((Bc, STRIDE), acc)
        qb = cuda.local.array(QO_FRAGS, acc)        # Q fragments: TF32 big parts
        qs = cuda.local.array(QO_FRAGS, acc)        # and small parts
        o = cuda.local.array(QO_FRAGS, acc)         # O fragments
        s = cuda.local.array(S_FRAGS, acc)          # S, then P~, fragments of a chunk
        pb = cuda.local.array(S_FRAGS, acc)         # P~ split for the tensor cores
        ps = cuda.local.array(S_FRAGS, acc)
        # Alg.1 l.4: load this warp's 16 rows of Qi as A fragments (zero past Sq and d).
        for ks in range(KS):
            for h in range(2):
                col = ks * 8 + t + 4 * h
                x0 = acc(Q[bh, row0, col]) if row0 < Sq and col < d else ZERO
                x1 = acc(Q[bh, row1, col]) if row1 < Sq and col < d else ZERO
                qb[ks * 4 + 2 * h], qs[ks * 4 + 2 * h] = split(x0)
                qb[ks * 4 + 2 * h + 1], qs[ks * 4 + 2 * h + 1] = split(x1)
        for x in range(QO_FRAGS):
            o[x] = ZERO
        m0 = NEG_INF            # running max of row0 and row1 (the same in all 4 lanes)
        m1 = NEG_INF
        l0 = ZERO               # this lane's part of the running sums (reduced at the end)
        l1 = ZERO

        _, Tc = kv_tile_range(i, Sk, causal_offset, 0)     # causal: skip masked tiles
        for j in range(Tc):
            # Wait until every warp has finished reading the previous Kj and Vj.
            cuda.syncthreads()
            for idx in range(tid, Bc * DP, THREADS):               # Alg.1 l.7
                c = idx // DP
                k = idx % DP
                col = j * Bc + c
                inside = col < Sk and k < d
                Kj[c, k] = acc(K[bh, col, k]) if inside else ZERO
                Vj[c, k] = acc(V[bh, col, k]) if inside else ZERO
            # Wait until Kj and Vj are complete.
            cuda.syncthreads()

            for ch in range(Bc // V3_CHUNK):
                key0 = ch * V3_CHUNK                # first key of the chunk within the tile
                # Alg.1 l.8: S = Qi Kj^T on the tensor cores, then scale and mask.
                mt0 = NEG_INF
                mt1 = NEG_INF
                for nt in range(NT):
                    c0 = ZERO
                    c1 = ZERO
                    c2 = ZERO
                    c3 = ZERO
                    e0 = ZERO
                    e1 = ZERO
                    e2 = ZERO
                    e3 = ZERO
                    for ks in range(KS):
                        c0, c1, c2, c3, e0, e1, e2, e3 = mma3(
                            qb[ks * 4], qb[ks * 4 + 1], qb[ks * 4 + 2], qb[ks * 4 + 3],
                            qs[ks * 4], qs[ks * 4 + 1], qs[ks * 4 + 2], qs[ks * 4 + 3],
                            Kj[key0 + nt * 8 + g, ks * 8 + t], Kj[key0 + nt * 8 + g, ks * 8 + t + 4],
                            c0, c1, c2, c3, e0, e1, e2, e3)
                    col = j * Bc + key0 + nt * 8 + 2 * t
                    vis00 = col < Sk and (not causal or col <= row0 + causal_offset)
                    vis01 = col + 1 < Sk and (not causal or col + 1 <= row0 + causal_offset)
                    vis10 = col < Sk and (not causal or col <= row1 + causal_offset)
                    vis11 = col + 1 < Sk and (not causal or col + 1 <= row1 + causal_offset)
                    s[nt * 4] = (c0 + e0) * softmax_scale if vis00 else NEG_INF
                    s[nt * 4 + 1] = (c1 + e1) * softmax_scale if vis01 else NEG_INF
                    s[nt * 4 + 2] = (c2 + e2) * softmax_scale if vis10 else NEG_INF
                    s[nt * 4 + 3] = (c3 + e3) * softmax_scale if vis11 else NEG_INF
                    for h in range(2):
                        if s[nt * 4 + h] > mt0:
                            mt0 = s[nt * 4 + h]
                        if s[nt * 4 + 2 + h] > mt1:
                            mt1 = s[nt * 4 + 2 + h]
                # Alg.1 l.9: new running max (over the quad), P~ = exp(S - m_new), rescale.
                mt0 = quad_max(mt0)
                mt1 = quad_max(mt1)
                mn0 = mt0 if mt0 > m0 else m0
                mn1 = mt1 if mt1 > m1 else m1
                ms0 = ZERO if mn0 == NEG_INF else mn0     # no key seen yet: avoid -inf - -inf
                ms1 = ZERO if mn1 == NEG_INF else mn1
                alpha0 = math.exp(m0 - ms0) if m0 != NEG_INF else ZERO
                alpha1 = math.exp(m1 - ms1) if m1 != NEG_INF else ZERO
                lt0 = ZERO
                lt1 = ZERO
                for nt in range(NT):
                    for h in range(2):
                        x = s[nt * 4 + h]
                        s[nt * 4 + h] = math.exp(x - ms0) if x != NEG_INF else ZERO
                        lt0 += s[nt * 4 + h]
                        x = s[nt * 4 + 2 + h]
                        s[nt * 4 + 2 + h] = math.exp(x - ms1) if x != NEG_INF else ZERO
                        lt1 += s[nt * 4 + 2 + h]
                l0 = alpha0 * l0 + lt0
                l1 = alpha1 * l1 + lt1
                m0 = mn0
                m1 = mn1
                # Alg.1 l.10: O = diag(alpha) O + P~ Vj, with P~ straight from the S
                # fragments (this lane's keys 2t and 2t+1 play the mma's k = t and t + 4).
                for x in range(S_FRAGS):
                    pb[x], ps[x] = split(s[x])
                for nd in range(KS):
                    # The chunk's P~ Vj is summed from zero, then added to the rescaled O in
                    # ordinary float32 arithmetic (as l_tile in v2, and for the same reason).
                    c0 = ZERO
                    c1 = ZERO
                    c2 = ZERO
                    c3 = ZERO
                    e0 = ZERO
                    e1 = ZERO
                    e2 = ZERO
                    e3 = ZERO
                    for ks in range(NT):
                        c0, c1, c2, c3, e0, e1, e2, e3 = mma3(
                            pb[ks * 4], pb[ks * 4 + 2], pb[ks * 4 + 1], pb[ks * 4 + 3],
                            ps[ks * 4], ps[ks * 4 + 2], ps[ks * 4 + 1], ps[ks * 4 + 3],
                            Vj[key0 + ks * 8 + 2 * t, nd * 8 + g],
                            Vj[key0 + ks * 8 + 2 * t + 1, nd * 8 + g],
                            c0, c1, c2, c3, e0, e1, e2, e3)
                    o[nd * 4] = o[nd * 4] * alpha0 + (c0 + e0)
                    o[nd * 4 + 1] = o[nd * 4 + 1] * alpha0 + (c1 + e1)
                    o[nd * 4 + 2] = o[nd * 4 + 2] * alpha1 + (c2 + e2)
                    o[nd * 4 + 3] = o[nd * 4 + 3] * alpha1 + (c3 + e3)

        # Alg.1 l.12-16: the quad's row sums, normalise once, write O and L (the step
        # v6 to v8 share: make_mma_row_steps).
        write_rows(O, L, o, bh, row0, row1, t, m0, m1, l0, l1, Sq)

    return forward_v3


@functools.lru_cache(maxsize=None)
def make_forward_v4(Br, Bc, TM, TN, d, causal, acc_dtype):
    """v4 (register-blocked SIMT FlashAttention-2) kernel (opt-in, ``version="v4"``;
    v5 is this kernel with dynamic shared memory, and the default).

    Launch: grid (Tr, BH) with Tr = ceil(Sq / Br), block (TY * TX,) with TY = Br // TM and
    TX = Bc // TN: thread tid is (ty, tx) = (tid // TX, tid % TX) of a TY x TX grid.

    Thread (ty, tx) owns a TM x TN block of Sij: rows r_a = ty + TY*a (a < TM) and columns
    c_b = tx + TX*b (b < TN), and a TM x DN block of O_i: the same rows, columns
    k_e = tx + TX*e (e < DN), with DP = d rounded up to a multiple of TX and DN = DP // TX
    (the padded columns d..DP-1 hold zeros and are never written). Strided rows and
    columns make every shared-memory read below conflict-free or a broadcast: the TX
    threads of a row read TX consecutive addresses, the threads of a column read one.

    Shared memory (accumulator dtype): QiT (DP, Br + 1), Qi transposed, staged once;
    KjT (DP, Bc + 1), Kj transposed; Vj (Bc, DP); Pij (Br, Bc + 1), P~ij; red (Br, TX),
    partial row maxima and, at the end, partial row sums. The +1 pads make the
    transposing stores (consecutive k by consecutive threads) and the column reads of
    Pij hit different banks. ``dispatch.v4_shared_bytes`` counts them.

    Per K/V tile, four barriers: (1) the previous tile is done with; load Kj, Vj;
    (2) loaded; Sij in registers, masked, partial row max to red; (3) the partial maxima
    are in; each thread reduces the TX maxima of its rows (the same values in the same
    order in every thread of a row, so all agree), rescales o, writes P~ij; (4) P~ij is
    complete; o += P~ij Vj. Each k step of Sij loads TM + TN values for TM * TN FMAs, and
    each key of P~ij Vj loads TM + DN values for TM * DN FMAs (v2: one load per FMA).

    Each thread keeps its own part of l_i (the sum over its TN columns, rescaled by the
    same alpha as everyone in the row, each tile's part summed first as in v2); the TX
    parts are summed through red once, at the end.

    NaN-safety: masked scores are -inf and give p = 0 without an exp of them. A key hidden
    by the causal mask from some rows of the block can still hold NaN or inf in V, and
    0 * NaN = NaN, so on the tiles where the mask cuts through the block (the causal
    diagonal; a block-uniform test) P~ij Vj skips the hidden (row, key) pairs; on every
    other tile no key is hidden (keys past Sk are zero-filled in Vj) and the loop has no
    test. As in v2, a visible key whose score is -inf gets weight 0; unlike v2 its value
    is read (0 * V), so a NaN or inf in V at such a key reaches the row, as it does in the
    dense reference.
    """
    acc = acc_type(acc_dtype)
    ZERO = acc(0)
    NEG_INF = acc(-math.inf)
    assert Br % TM == 0 and Bc % TN == 0, (Br, Bc, TM, TN)
    TY = Br // TM                       # thread rows
    TX = Bc // TN                       # thread columns
    THREADS = TY * TX
    DP = (d + TX - 1) // TX * TX        # head dim padded to the thread grid's width
    DN = DP // TX                       # O columns per thread
    kv_tile_range = make_kv_tile_range(Br, Bc, causal, False)
    BrP = Br + 1                        # padded row lengths of QiT, KjT and Pij (shared
    BcP = Bc + 1                        # array shapes must be compile-time constants)

    @cuda.jit(**jit_options())
    def forward_v4(Q, K, V, O, L, softmax_scale, causal_offset):
        bh = cuda.blockIdx.y
        i = cuda.blockIdx.x             # Q tile index (Alg.1 l.3: one block per i)
        tid = cuda.threadIdx.x
        ty = tid // TX
        tx = tid % TX
        Sq = Q.shape[1]
        Sk = K.shape[1]

        QiT = cuda.shared.array((DP, BrP), acc)
        KjT = cuda.shared.array((DP, BcP), acc)
        Vj = cuda.shared.array((Bc, DP), acc)
        Pij = cuda.shared.array((Br, BcP), acc)
        red = cuda.shared.array((Br, TX), acc)
        s = cuda.local.array((TM, TN), acc)     # this thread's block of Sij, then P~ij
        o = cuda.local.array((TM, DN), acc)     # its block of O_i (unnormalised)
        qa = cuda.local.array(TM, acc)          # one k step: TM values of Qi ...
        kb = cuda.local.array(TN, acc)          # ... and TN of Kj
        pa = cuda.local.array(TM, acc)          # one key: TM values of P~ij ...
        ve = cuda.local.array(DN, acc)          # ... and DN of Vj
        m_i = cuda.local.array(TM, acc)         # running max of each row (all TX agree)
        l_i = cuda.local.array(TM, acc)         # this thread's part of each row's sum

        # Alg.1 l.4-5: stage Qi transposed (zeros past Sq and d); O_i = 0, l = 0, m = -inf.
        for idx in range(tid, Br * DP, THREADS):
            r = idx // DP
            k = idx % DP
            row = i * Br + r
            QiT[U(k), U(r)] = acc(Q[bh, row, k]) if row < Sq and k < d else ZERO
        for a in range(TM):
            m_i[a] = NEG_INF
            l_i[a] = ZERO
            for e in range(DN):
                o[a, e] = ZERO

        # Alg.1 l.6: loop over K/V tiles; causal blocks stop after the last visible one.
        _, Tc = kv_tile_range(i, Sk, causal_offset, 0)     # bands.py
        first_limit = i * Br + causal_offset    # last key the block's first row sees
        for j in range(Tc):
            # Wait until every thread is done with the previous tile's KjT, Vj, Pij (and,
            # for j = 0, until QiT is complete).
            cuda.syncthreads()
            # Alg.1 l.7: load Kj (transposed) and Vj; rows past Sk and columns past d are 0.
            idx = tid
            while idx < Bc * DP:
                c = idx // DP
                k = idx % DP
                col = j * Bc + c
                inside = col < Sk and k < d
                KjT[U(k), U(c)] = acc(K[U(bh), U(col), U(k)]) if inside else ZERO
                Vj[U(c), U(k)] = acc(V[U(bh), U(col), U(k)]) if inside else ZERO
                idx += THREADS
            # Wait until KjT and Vj are complete.
            cuda.syncthreads()

            # Alg.1 l.8: Sij = Qi Kj^T, TM x TN per thread, TM + TN loads per k step.
            for a in range(TM):
                for b in range(TN):
                    s[a, b] = ZERO
            k = 0
            while k < DP:             # a while loop, not range(): see kernels/__init__.py
                for a in range(TM):
                    qa[a] = QiT[U(k), U(ty + TY * a)]
                for b in range(TN):
                    kb[b] = KjT[U(k), U(tx + TX * b)]
                for a in range(TM):
                    for b in range(TN):
                        s[a, b] += qa[a] * kb[b]
                k += 1
            # Scale and mask; this thread's part of each row's max ('>': NaN never wins).
            for a in range(TM):
                row = i * Br + ty + TY * a
                m_part = NEG_INF
                for b in range(TN):
                    col = j * Bc + tx + TX * b
                    visible = col < Sk and (not causal or col <= row + causal_offset)
                    x = s[a, b] * softmax_scale if visible else NEG_INF
                    s[a, b] = x
                    if x > m_part:
                        m_part = x
                red[U(ty + TY * a), U(tx)] = m_part
            # Wait until every partial row max is in red.
            cuda.syncthreads()

            # Alg.1 l.9: m_new, P~ij = exp(Sij - m_new) into Pij, l = alpha l + rowsum.
            for a in range(TM):
                r = ty + TY * a
                m_tile = NEG_INF
                for t in range(TX):
                    x = red[U(r), U(t)]
                    if x > m_tile:
                        m_tile = x
                m_new = m_tile if m_tile > m_i[a] else m_i[a]
                m_safe = ZERO if m_new == NEG_INF else m_new    # no key seen yet
                alpha = math.exp(m_i[a] - m_safe) if m_i[a] != NEG_INF else ZERO
                l_tile = ZERO
                for b in range(TN):
                    x = s[a, b]
                    p = math.exp(x - m_safe) if x != NEG_INF else ZERO
                    Pij[U(r), U(tx + TX * b)] = p
                    l_tile += p
                l_i[a] = alpha * l_i[a] + l_tile
                m_i[a] = m_new
                for e in range(DN):
                    o[a, e] *= alpha            # Alg.1 l.10: diag(alpha) O_i ...
            # Wait until Pij is complete.
            cuda.syncthreads()

            # Alg.1 l.10: ... + P~ij Vj, TM + DN loads per key.
            if not causal or j * Bc + Bc - 1 <= first_limit:
                # no key of this tile is hidden from any row of the block
                c = 0
                while c < Bc:             # a while loop, not range(): see kernels/__init__.py
                    for a in range(TM):
                        pa[a] = Pij[U(ty + TY * a), U(c)]
                    for e in range(DN):
                        ve[e] = Vj[U(c), U(tx + TX * e)]
                    for a in range(TM):
                        for e in range(DN):
                            o[a, e] += pa[a] * ve[e]
                    c += 1
            else:
                # the causal diagonal: hidden (row, key) pairs never read V (NaN-safe)
                c = 0
                while c < Bc:             # a while loop, not range(): see kernels/__init__.py
                    col = j * Bc + c
                    for a in range(TM):
                        pa[a] = Pij[U(ty + TY * a), U(c)]
                    for e in range(DN):
                        ve[e] = Vj[U(c), U(tx + TX * e)]
                    for a in range(TM):
                        if col <= i * Br + ty + TY * a + causal_offset:
                            for e in range(DN):
                                o[a, e] += pa[a] * ve[e]
                    c += 1

        # Alg.1 l.12-16: each row's sum from its TX parts (red was last read before the
        # last tile's fourth barrier, so it is free), normalise once, write O and L.
        for a in range(TM):
            red[U(ty + TY * a), U(tx)] = l_i[a]
        # Wait until every partial row sum is in red.
        cuda.syncthreads()
        for a in range(TM):
            r = ty + TY * a
            row = i * Br + r
            l_row = ZERO
            for t in range(TX):
                l_row += red[U(r), U(t)]
            if row < Sq:
                # l == 0: the row saw no key (fully masked): O = 0 and L = -inf exactly.
                # A NaN l is not 0, so NaN propagates.
                for e in range(DN):
                    k = tx + TX * e
                    if k < d:
                        O[bh, row, k] = ZERO if l_row == ZERO else o[a, e] / l_row
                if tx == 0:
                    L[bh, row] = NEG_INF if l_row == ZERO else m_i[a] + math.log(l_row)

    return forward_v4


def v5_shared_layout(Br, Bc, TM, TN, d):
    """Where forward v5's five tiles sit in its one dynamic shared array: the offsets, in
    elements of the accumulator dtype, of QiT, KjT, Vj, Pij and red (v4's five static
    arrays, same shapes, stored back to back, each row by row), and the end, which is
    the array's length: (Q_AT, K_AT, V_AT, P_AT, R_AT, END). With TX = Bc // TN and DP
    = d rounded up to TX: QiT (DP, Br+1), KjT (DP, Bc+1), Vj (Bc, DP), Pij (Br, Bc+1),
    red (Br, TX). ``dispatch.v5_shared_bytes`` is END times the itemsize."""
    TX = Bc // TN
    DP = (d + TX - 1) // TX * TX
    Q_AT = 0
    K_AT = Q_AT + DP * (Br + 1)
    V_AT = K_AT + DP * (Bc + 1)
    P_AT = V_AT + Bc * DP
    R_AT = P_AT + Br * (Bc + 1)
    END = R_AT + Br * TX
    return Q_AT, K_AT, V_AT, P_AT, R_AT, END


@functools.lru_cache(maxsize=None)
def make_forward_v5(Br, Bc, TM, TN, d, causal, acc_dtype):
    """v5: forward v4 with its shared memory taken from dynamic shared memory, so that a
    block's tiles may exceed the 48 KB of static shared memory (the default for plain
    float32 attention with d <= 128 on the simulator; runs on the GPU and the simulator).

    The algorithm, thread layout, barriers and NaN-safety are v4's, line for line (see
    make_forward_v4); what changes is where the five shared arrays come from. v4
    declares them with ``cuda.shared.array(shape, dtype)``: static shared memory, sized
    when the kernel compiles, at most 48 KB per block. v5 declares ONE dynamic array,
    ``cuda.shared.array(0, acc)``, whose size in bytes is the fourth item of the launch
    configuration (the third is the stream):

        kernel[grid, block, 0, nbytes](Q, K, V, O, L, softmax_scale, causal_offset)

    Up to 48 KB that is all; above it, the compiled kernel must first be allowed more
    (kernels/smem.py, ``allow_dynamic_shared_memory``, which dispatch.launch_forward
    calls), up to the GPU's per-block maximum (227 KB on the H100/H200).

    Numba gives every ``cuda.shared.array(0, ...)`` of a kernel the same base address,
    so the tiles are carved out of the one array by hand: ``v5_shared_layout`` places
    them back to back at compile-time offsets, each tile is a 1D slice of the array (a
    view, no copy), and a 2D index [row, col] of v4 becomes [row * row_length + col].
    (A 2D view through ``reshape`` would keep v4's indexing, but on the GPU numba-cuda
    implements it with a call into a helper library, and the strides it returns are
    run-time values, so every shared-memory address would cost more arithmetic.) Under
    the simulator each slice is bounds-checked on its own, so an index that strays out
    of its tile raises IndexError instead of landing in the next tile.

    Launch: as v4: grid (Tr, BH) with Tr = ceil(Sq / Br), block (TY * TX,) with TY = Br //
    TM and TX = Bc // TN; and END * itemsize bytes of dynamic shared memory (END from
    ``v5_shared_layout``).
    """
    acc = acc_type(acc_dtype)
    ZERO = acc(0)
    NEG_INF = acc(-math.inf)
    assert Br % TM == 0 and Bc % TN == 0, (Br, Bc, TM, TN)
    TY = Br // TM                       # thread rows
    TX = Bc // TN                       # thread columns
    THREADS = TY * TX
    DP = (d + TX - 1) // TX * TX        # head dim padded to the thread grid's width
    DN = DP // TX                       # O columns per thread
    kv_tile_range = make_kv_tile_range(Br, Bc, causal, False)
    BrP = Br + 1                        # padded row lengths of QiT, KjT and Pij (the +1
    BcP = Bc + 1                        # pads spread v4's column accesses over the banks)
    # The tiles' offsets in the dynamic shared array (elements), and how v4's 2D
    # indices map to their flat ones:
    #   QiT (DP, BrP) at Q_AT   QiT[k, r] -> QiT[k * BrP + r]
    #   KjT (DP, BcP) at K_AT   KjT[k, c] -> KjT[k * BcP + c]
    #   Vj  (Bc, DP)  at V_AT   Vj[c, k]  -> Vj[c * DP + k]
    #   Pij (Br, BcP) at P_AT   Pij[r, c] -> Pij[r * BcP + c]
    #   red (Br, TX)  at R_AT   red[r, t] -> red[r * TX + t]
    Q_AT, K_AT, V_AT, P_AT, R_AT, END = v5_shared_layout(Br, Bc, TM, TN, d)

    @cuda.jit(**jit_options())
    def forward_v5(Q, K, V, O, L, softmax_scale, causal_offset):
        bh = cuda.blockIdx.y
        i = cuda.blockIdx.x             # Q tile index (Alg.1 l.3: one block per i)
        tid = cuda.threadIdx.x
        ty = tid // TX
        tx = tid % TX
        Sq = Q.shape[1]
        Sk = K.shape[1]

        # The block's dynamic shared memory (END elements, sized by the launch), cut
        # into the five tiles: slices are views, so QiT[x] is smem[Q_AT + x].
        smem = cuda.shared.array(0, acc)
        QiT = smem[Q_AT:K_AT]
        KjT = smem[K_AT:V_AT]
        Vj = smem[V_AT:P_AT]
        Pij = smem[P_AT:R_AT]
        red = smem[R_AT:END]
        s = cuda.local.array((TM, TN), acc)     # this thread's block of Sij, then P~ij
        o = cuda.local.array((TM, DN), acc)     # its block of O_i (unnormalised)
        qa = cuda.local.array(TM, acc)          # one k step: TM values of Qi ...
        kb = cuda.local.array(TN, acc)          # ... and TN of Kj
        pa = cuda.local.array(TM, acc)          # one key: TM values of P~ij ...
        ve = cuda.local.array(DN, acc)          # ... and DN of Vj
        m_i = cuda.local.array(TM, acc)         # running max of each row (all TX agree)
        l_i = cuda.local.array(TM, acc)         # this thread's part of each row's sum

        # From here on, v4 line for line (with the flat indices above).
        # Alg.1 l.4-5: stage Qi transposed (zeros past Sq and d); O_i = 0, l = 0, m = -inf.
        for idx in range(tid, Br * DP, THREADS):
            r = idx // DP
            k = idx % DP
            row = i * Br + r
            QiT[U(k * BrP + r)] = acc(Q[bh, row, k]) if row < Sq and k < d else ZERO
        for a in range(TM):
            m_i[a] = NEG_INF
            l_i[a] = ZERO
            for e in range(DN):
                o[a, e] = ZERO

        # Alg.1 l.6: loop over K/V tiles; causal blocks stop after the last visible one.
        _, Tc = kv_tile_range(i, Sk, causal_offset, 0)     # bands.py
        first_limit = i * Br + causal_offset    # last key the block's first row sees
        for j in range(Tc):
            # Wait until every thread is done with the previous tile's KjT, Vj, Pij (and,
            # for j = 0, until QiT is complete).
            cuda.syncthreads()
            # Alg.1 l.7: load Kj (transposed) and Vj; rows past Sk and columns past d are 0.
            idx = tid
            while idx < Bc * DP:
                c = idx // DP
                k = idx % DP
                col = j * Bc + c
                inside = col < Sk and k < d
                KjT[U(k * BcP + c)] = acc(K[U(bh), U(col), U(k)]) if inside else ZERO
                Vj[U(c * DP + k)] = acc(V[U(bh), U(col), U(k)]) if inside else ZERO
                idx += THREADS
            # Wait until KjT and Vj are complete.
            cuda.syncthreads()

            # Alg.1 l.8: Sij = Qi Kj^T, TM x TN per thread, TM + TN loads per k step.
            for a in range(TM):
                for b in range(TN):
                    s[a, b] = ZERO
            k = 0
            while k < DP:             # a while loop, not range(): see kernels/__init__.py
                for a in range(TM):
                    qa[a] = QiT[U(k * BrP + ty + TY * a)]
                for b in range(TN):
                    kb[b] = KjT[U(k * BcP + tx + TX * b)]
                for a in range(TM):
                    for b in range(TN):
                        s[a, b] += qa[a] * kb[b]
                k += 1
            # Scale and mask; this thread's part of each row's max ('>': NaN never wins).
            for a in range(TM):
                row = i * Br + ty + TY * a
                m_part = NEG_INF
                for b in range(TN):
                    col = j * Bc + tx + TX * b
                    visible = col < Sk and (not causal or col <= row + causal_offset)
                    x = s[a, b] * softmax_scale if visible else NEG_INF
                    s[a, b] = x
                    if x > m_part:
                        m_part = x
                red[U((ty + TY * a) * TX + tx)] = m_part
            # Wait until every partial row max is in red.
            cuda.syncthreads()

            # Alg.1 l.9: m_new, P~ij = exp(Sij - m_new) into Pij, l = alpha l + rowsum.
            for a in range(TM):
                r = ty + TY * a
                m_tile = NEG_INF
                for t in range(TX):
                    x = red[U(r * TX + t)]
                    if x > m_tile:
                        m_tile = x
                m_new = m_tile if m_tile > m_i[a] else m_i[a]
                m_safe = ZERO if m_new == NEG_INF else m_new    # no key seen yet
                alpha = math.exp(m_i[a] - m_safe) if m_i[a] != NEG_INF else ZERO
                l_tile = ZERO
                for b in range(TN):
                    x = s[a, b]
                    p = math.exp(x - m_safe) if x != NEG_INF else ZERO
                    Pij[U(r * BcP + tx + TX * b)] = p
                    l_tile += p
                l_i[a] = alpha * l_i[a] + l_tile
                m_i[a] = m_new
                for e in range(DN):
                    o[a, e] *= alpha            # Alg.1 l.10: diag(alpha) O_i ...
            # Wait until Pij is complete.
            cuda.syncthreads()

            # Alg.1 l.10: ... + P~ij Vj, TM + DN loads per key.
            if not causal or j * Bc + Bc - 1 <= first_limit:
                # no key of this tile is hidden from any row of the block
                c = 0
                while c < Bc:             # a while loop, not range(): see kernels/__init__.py
                    for a in range(TM):
                        pa[a] = Pij[U((ty + TY * a) * BcP + c)]
                    for e in range(DN):
                        ve[e] = Vj[U(c * DP + tx + TX * e)]
                    for a in range(TM):
                        for e in range(DN):
                            o[a, e] += pa[a] * ve[e]
                    c += 1
            else:
                # the causal diagonal: hidden (row, key) pairs never read V (NaN-safe)
                c = 0
                while c < Bc:             # a while loop, not range(): see kernels/__init__.py
                    col = j * Bc + c
                    for a in range(TM):
                        pa[a] = Pij[U((ty + TY * a) * BcP + c)]
                    for e in range(DN):
                        ve[e] = Vj[U(c * DP + tx + TX * e)]
                    for a in range(TM):
                        if col <= i * Br + ty + TY * a + causal_offset:
                            for e in range(DN):
                                o[a, e] += pa[a] * ve[e]
                    c += 1

        # Alg.1 l.12-16: each row's sum from its TX parts (red was last read before the
        # last tile's fourth barrier, so it is free), normalise once, write O and L.
        for a in range(TM):
            red[U((ty + TY * a) * TX + tx)] = l_i[a]
        # Wait until every partial row sum is in red.
        cuda.syncthreads()
        for a in range(TM):
            r = ty + TY * a
            row = i * Br + r
            l_row = ZERO
            for t in range(TX):
                l_row += red[U(r * TX + t)]
            if row < Sq:
                # l == 0: the row saw no key (fully masked): O = 0 and L = -inf exactly.
                # A NaN l is not 0, so NaN propagates.
                for e in range(DN):
                    k = tx + TX * e
                    if k < d:
                        O[bh, row, k] = ZERO if l_row == ZERO else o[a, e] / l_row
                if tx == 0:
                    L[bh, row] = NEG_INF if l_row == ZERO else m_i[a] + math.log(l_row)

    return forward_v5



@functools.lru_cache(maxsize=None)
def make_mma_row_steps(d, causal, chunk, o_tiles):
    """The steps forward v6 and v7 share, as inlined device functions: everything in their
    chunk loop and after it except the two matrix products and the staging. Both keep a
    warp's 16 query rows in the m16n8 accumulator layout (lane (g, t) holds rows g and
    g + 8, keys or columns 2t and 2t + 1 of each n-tile of 8), so the same code serves
    v6's TF32 products and v7's float16 ones. ``chunk``: keys per online-softmax step
    (NT = chunk / 8 n-tiles of S); ``o_tiles``: n-tiles of 8 columns of O (d padded to
    the mma's k, over 8). Float32 accumulation.

    Returns (finite, add_nonfinite_scores, softmax_step, add_nonfinite_values,
    write_rows); each says what it does. The non-finite fix-ups are described in
    make_forward_v6. (Moving these out of v6 changed its PTX only in the order of a few
    independent instructions: the same instructions, and the same registers after ptxas
    at d = 59, 64 and 128; run 47 timed and tested it on the H200.)"""
    acc = acc_type("float32")
    ZERO = acc(0)
    NEG_INF = acc(-math.inf)
    F32_MAX = acc(3.4028234663852886e38)
    LOG2E = acc(1.4426950408889634)
    NT = chunk // 8
    S_FRAGS = NT * 4

    @cuda.jit(device=True, inline=True)
    def finite(x):
        return abs(x) <= F32_MAX        # one comparison; False for NaN and +-inf

    @cuda.jit(device=True, inline=True)
    def nonfinite_terms(Q, K, bh, row, col, Sq, Sk):
        """The sum of the products Q[row, k] * K[col, k] with a non-finite factor: what
        the tensor cores left out of this score (those factors were staged as 0)."""
        x = ZERO
        if row < Sq and col < Sk:
            k = 0
            while k < d:
                q = acc(Q[U(bh), U(row), U(k)])
                kk = acc(K[U(bh), U(col), U(k)])
                if not (finite(q) and finite(kk)):
                    x += q * kk
                k += 1
        return x

    @cuda.jit(device=True, inline=True)
    def add_nonfinite_scores(s, Q, K, bh, col0, row0, t, Sq, Sk):
        """Rare: a non-finite q or k was staged as 0; add its terms to the chunk's scores
        s (keys from col0)."""
        for nt in range(NT):
            col = col0 + nt * 8 + 2 * t
            for x in range(4):      # s[nt * 4 + x]: row0 or row1, col or col + 1
                s[nt * 4 + x] += nonfinite_terms(Q, K, bh, row0 + 8 * (x // 2),
                                                 col + x % 2, Sq, Sk)

    @cuda.jit(device=True, inline=True)
    def softmax_step(s, softmax_scale, whole_tile, col0, row0, t, Sk, causal_offset,
                     m0, m1, l0, l1):
        """Alg.1 l.8-9 after the product: scale the chunk's scores s (keys from col0),
        mask them unless ``whole_tile`` (the last tile, or the causal diagonal), take the
        new running max over the quad, and turn s into P~ = exp(S - m_new) in place.
        Returns (alpha0, alpha1, m0, m1, l0, l1): the rescale factors of rows row0 and
        row0 + 8 and their new running max and (this lane's part of the) sums."""
        for x in range(S_FRAGS):
            s[x] *= softmax_scale
        if not whole_tile:
            for nt in range(NT):
                col = col0 + nt * 8 + 2 * t
                for x in range(4):
                    key = col + x % 2
                    if not (key < Sk and (not causal
                                          or key <= row0 + 8 * (x // 2) + causal_offset)):
                        s[nt * 4 + x] = NEG_INF
        mt0 = NEG_INF           # this lane's part of the chunk's row maxima
        mt1 = NEG_INF
        for nt in range(NT):
            for h in range(2):
                if s[nt * 4 + h] > mt0:
                    mt0 = s[nt * 4 + h]
                if s[nt * 4 + 2 + h] > mt1:
                    mt1 = s[nt * 4 + 2 + h]
        mt0 = quad_max(mt0)
        mt1 = quad_max(mt1)
        mn0 = mt0 if mt0 > m0 else m0
        mn1 = mt1 if mt1 > m1 else m1
        ms0 = ZERO if mn0 == NEG_INF else mn0     # no key seen yet: avoid -inf - -inf
        ms1 = ZERO if mn1 == NEG_INF else mn1
        # exp(x - m) as exp2(x * log2(e) - m * log2(e)): one multiply-add and the
        # hardware's exp2, where math.exp spends about 15 instructions.
        alpha0 = math.exp2((m0 - ms0) * LOG2E) if m0 != NEG_INF else ZERO
        alpha1 = math.exp2((m1 - ms1) * LOG2E) if m1 != NEG_INF else ZERO
        ml0 = ms0 * LOG2E
        ml1 = ms1 * LOG2E
        lt0 = ZERO
        lt1 = ZERO
        for nt in range(NT):
            for h in range(2):
                x = s[nt * 4 + h]
                s[nt * 4 + h] = math.exp2(x * LOG2E - ml0) if x != NEG_INF else ZERO
                lt0 += s[nt * 4 + h]
                x = s[nt * 4 + 2 + h]
                s[nt * 4 + 2 + h] = math.exp2(x * LOG2E - ml1) if x != NEG_INF else ZERO
                lt1 += s[nt * 4 + 2 + h]
        return alpha0, alpha1, mn0, mn1, alpha0 * l0 + lt0, alpha1 * l1 + lt1

    @cuda.jit(device=True, inline=True)
    def add_nonfinite_values(o, s, V, bh, col0, row0, row1, g, t, Sk, causal_offset):
        """Rare: a non-finite v of the chunk (keys from col0) was staged as 0; add
        p * v for those values to the O fragments o of the rows that see the key."""
        kk = 0
        while kk < chunk:        # the chunk's keys, in step in every lane
            # P~ of this key for row0 and row1 is in lane (g, kk % 8 // 2) of the
            # quad, in s[kk // 8 * 4 + kk % 2] and the entry 2 after it.
            x0 = ZERO
            x1 = ZERO
            for nt in range(NT):
                for h in range(2):
                    if kk // 8 == nt and kk % 2 == h:
                        x0 = s[nt * 4 + h]
                        x1 = s[nt * 4 + 2 + h]
            p0 = cuda.shfl_sync(FULL_WARP, x0, g * 4 + kk % 8 // 2)
            p1 = cuda.shfl_sync(FULL_WARP, x1, g * 4 + kk % 8 // 2)
            col = col0 + kk
            if col < Sk:
                sees0 = not causal or col <= row0 + causal_offset
                sees1 = not causal or col <= row1 + causal_offset
                for nd in range(o_tiles):
                    for h in range(2):
                        k = nd * 8 + 2 * t + h
                        if k < d:
                            v = acc(V[U(bh), U(col), U(k)])
                            if not finite(v):
                                if sees0:
                                    o[nd * 4 + h] += p0 * v
                                if sees1:
                                    o[nd * 4 + 2 + h] += p1 * v
            kk += 1

    @cuda.jit(device=True, inline=True)
    def write_rows(O, L, o, bh, row0, row1, t, m0, m1, l0, l1, Sq):
        """Alg.1 l.12-16: the quad's row sums, normalise once, write O and L (as v3)."""
        l0 = quad_sum(l0)
        l1 = quad_sum(l1)
        for nd in range(o_tiles):
            for h in range(2):
                col = nd * 8 + 2 * t + h
                if col < d:
                    if row0 < Sq:
                        O[bh, row0, col] = ZERO if l0 == ZERO else o[nd * 4 + h] / l0
                    if row1 < Sq:
                        O[bh, row1, col] = ZERO if l1 == ZERO else o[nd * 4 + 2 + h] / l1
        if t == 0:
            if row0 < Sq:
                L[bh, row0] = NEG_INF if l0 == ZERO else m0 + math.log(l0)
            if row1 < Sq:
                L[bh, row1] = NEG_INF if l1 == ZERO else m1 + math.log(l1)

    return finite, add_nonfinite_scores, softmax_step, add_nonfinite_values, write_rows


V6_CHUNK = 16                           # v6: keys per online-softmax step, by default
V6_Q_REGISTERS_MAX_DP = 64              # v6: Q's fragments stay in registers up to this DP
V6_LOAD_BATCH = 4                       # v6: K and V elements a thread loads at once (8: 253
                                        # registers at d = 64 instead of 179)


def v6_shared_layout(Br, Bc, d):
    """Where forward v6's tiles sit in its one dynamic float32 array, and their row
    lengths: (KP_AT, VP_AT, QP_AT, END, K_ROW, V_ROW). Kj, Vj (Bc rows) and, when Qi does
    not stay in registers (DP > V6_Q_REGISTERS_MAX_DP), Qi (Br rows) are stored split
    into their TF32 parts, each element as a (big, small) pair, so that one 8-byte load
    fetches both: element k of row c of Kj is at KP_AT + c * K_ROW + 2k (big) and the
    float after it (small). DP is d rounded up to the mma's k = 8; the rows are padded,
    K_ROW = 2 DP + 8 (Qi's too) and V_ROW = 2 DP + 4, so that the fragment reads of a
    half-warp hit 16 different bank pairs (make_forward_v6). Without a Qi tile, QP_AT =
    END. ``dispatch.v6_shared_bytes`` is END * 4."""
    DP = (d + 7) // 8 * 8
    K_ROW = 2 * DP + 8
    V_ROW = 2 * DP + 4
    KP_AT = 0
    VP_AT = KP_AT + Bc * K_ROW
    QP_AT = VP_AT + Bc * V_ROW
    END = QP_AT + (0 if DP <= V6_Q_REGISTERS_MAX_DP else Br * K_ROW)
    return KP_AT, VP_AT, QP_AT, END, K_ROW, V_ROW


def v6_staging_width(d):
    """How many threads forward v6 puts on one row of a K/V tile when it stages it (one
    column each): d rounded up to the mma's k = 8 and then to a power of two, so that it
    divides the block's 2 Br threads (which must be at least this many)."""
    W = 8
    while W < d:
        W *= 2
    return W


@functools.lru_cache(maxsize=None)
def make_v6_tile_steps(Br, Bc, d, chunk):
    """The steps of forward v6 that v8 reuses, as inlined device functions: Qi into
    registers (or QP), a K/V tile staged as split pairs, and the two products of one
    chunk. Float32 accumulation; the arguments are make_forward_v6's.

    Returns (load_q, stage_kv, scores, scores_q_once, values, finite_or_zero,
    load_finite, scores_head_dim_outside); make_forward_v6's docstring explains what they
    do, and each says which line of Algorithm 1 it is. The last three are for v9: v6's
    non-finite guards, and the factory of scores_q_once for another way of reading Qi."""
    from .ptx import flat_load, load_pair, mma_tf32, store_pair     # GPU only
    from .ptx import split_tf32 as split, split_tf32_finite as split_finite

    acc = acc_type("float32")
    ZERO = acc(0)
    CHUNK = chunk
    THREADS = 2 * Br                        # Br / 16 warps of 32 lanes
    DP = (d + 7) // 8 * 8                   # head dim padded to the mma's k = 8
    KS = DP // 8                            # mma steps over the head dim
    NT = CHUNK // 8                         # mma steps over the keys of a chunk
    S_FRAGS = NT * 4                        # fragment registers of S per lane
    Q_REGS = DP <= V6_Q_REGISTERS_MAX_DP    # Qi's fragments in registers, else in QP
    W = v6_staging_width(d)                 # the staging loops' row width (<= THREADS)
    RSTEP = THREADS // W                    # rows a pass of the block stages
    _, _, _, _, K_ROW, V_ROW = v6_shared_layout(Br, Bc, d)
    finite = make_mma_row_steps(d, False, CHUNK, KS)[0]

    @cuda.jit(device=True, inline=True)
    def mma3(a0b, a1b, a2b, a3b, a0s, a1s, a2s, a3s, b0b, b1b, b0s, b1s, c, e, f):
        """3xTF32 A B with both operands already split: big*big is added to C, the two
        small products to E and F (the small terms in their own accumulators, as in v3;
        two of them, so that the tensor cores work on three independent sums: one
        accumulator would make every mma of a score wait for the one before it)."""
        c = mma_tf32(a0b, a1b, a2b, a3b, b0b, b1b, c[0], c[1], c[2], c[3])
        e = mma_tf32(a0s, a1s, a2s, a3s, b0b, b1b, e[0], e[1], e[2], e[3])
        f = mma_tf32(a0b, a1b, a2b, a3b, b0s, b1s, f[0], f[1], f[2], f[3])
        return c, e, f

    @cuda.jit(device=True, inline=True)
    def mma3_short(a0b, a1b, a2b, a3b, a0s, a1s, a2s, a3s, b0b, b1b, b0s, b1s, c, e):
        """mma3 with both small products in E, as in v3: for P~ Vj, whose sums are only
        chunk / 8 steps long and many (one per 8 columns of O), so that a third
        accumulator would buy no parallelism and cost registers."""
        c = mma_tf32(a0b, a1b, a2b, a3b, b0b, b1b, c[0], c[1], c[2], c[3])
        e = mma_tf32(a0s, a1s, a2s, a3s, b0b, b1b, e[0], e[1], e[2], e[3])
        e = mma_tf32(a0b, a1b, a2b, a3b, b0s, b1s, e[0], e[1], e[2], e[3])
        return c, e

    @cuda.jit(device=True, inline=True)
    def finite_or_zero(x, bad, slot, mark):
        """x, or 0 if x is not finite; then bad[slot] is raised to ``mark``."""
        if not finite(x):
            cuda.atomic.max(bad, slot, mark)
            x = ZERO
        return x

    @cuda.jit(device=True, inline=True)
    def load_finite(A, bh, r, k, nrows, bad, slot, mark):
        """A[bh, r, k] as float32, 0 past the rows (r >= nrows) or the head dim, through
        finite_or_zero."""
        x = acc(A[U(bh), U(r), U(k)]) if r < nrows and k < d else ZERO
        return finite_or_zero(x, bad, slot, mark)

    @cuda.jit(device=True, inline=True)
    def load_q(Q, QP, qb, qs, bad, bh, i, row0, row1, t, tid, Sq):
        """Alg.1 l.4: Qi, split (zero past Sq and d): this lane's A fragments in
        registers (qb, qs), or the whole tile in QP (read after the first tile's
        barriers)."""
        if Q_REGS:
            for ks in range(KS):
                for h in range(2):
                    col = ks * 8 + t + 4 * h
                    qb[ks * 4 + 2 * h], qs[ks * 4 + 2 * h] = split(
                        load_finite(Q, bh, row0, col, Sq, bad, 0, int32(1)))
                    qb[ks * 4 + 2 * h + 1], qs[ks * 4 + 2 * h + 1] = split(
                        load_finite(Q, bh, row1, col, Sq, bad, 0, int32(1)))
        else:
            idx = tid
            while idx < Br * DP:
                r = idx // DP
                k = idx % DP
                big, small = split(load_finite(Q, bh, i * Br + r, k, Sq, bad, 0, int32(1)))
                store_pair(QP, U(r * K_ROW + 2 * k), big, small)
                idx += THREADS

    @cuda.jit(device=True, inline=True)
    def stage_kv(K, V, KP, VP, kx, vx, bad, bh, j, tid, Sk):
        """Alg.1 l.7: load Kj and Vj, split once (rows past Sk and columns past d: 0),
        into KP and VP. A non-finite element is staged as 0 and raises bad[1] (K) or
        bad[2] (V) to j + 1.

        This thread's column is k_own, its rows c_own, c_own + RSTEP, ...; V6_LOAD_BATCH
        rows of each are loaded (into kx, vx) before any is used, so that their loads
        from global memory wait together, not one after the other. The loads are
        unconditional, at flat positions in K and V (ptx.flat_load: one address
        computation each, where K[bh, col, k] costs seven 64-bit multiply-adds); a
        position outside the arrays is replaced by one inside (row Sk - 1; Sk >= 1
        here) and its value by 0."""
        mark = int32(j + 1)
        k_own = tid % W                         # the column and first row this thread
        c_own = tid // W                        # stages of each K/V tile
        k_in = k_own < d
        k_load = min(k_own, d - 1)              # a column inside the arrays
        last_row = (bh * Sk + Sk - 1) * d + k_load      # a position inside K and V
        c = c_own
        while c < Bc:
            at = (bh * Sk + j * Bc + c) * d + k_load     # row j * Bc + c, column k_load
            for u in range(V6_LOAD_BATCH):
                col = j * Bc + c + u * RSTEP
                inside = k_in and c + u * RSTEP < Bc and col < Sk
                at_u = at + u * RSTEP * d if col < Sk else last_row
                kx[u] = acc(flat_load(K, U(at_u)))
                vx[u] = acc(flat_load(V, U(at_u)))
                kx[u] = kx[u] if inside else ZERO
                vx[u] = vx[u] if inside else ZERO
            if k_own < DP:
                for u in range(V6_LOAD_BATCH):
                    r = c + u * RSTEP
                    if r < Bc:
                        big, small = split_finite(finite_or_zero(kx[u], bad, 1, mark))
                        store_pair(KP, U(r * K_ROW + 2 * k_own), big, small)
                        big, small = split_finite(finite_or_zero(vx[u], bad, 2, mark))
                        store_pair(VP, U(r * V_ROW + 2 * k_own), big, small)
            c += V6_LOAD_BATCH * RSTEP

    @cuda.jit(device=True, inline=True)
    def scores(s, qb, qs, QP, KP, key0, r0, g, t):
        """Alg.1 l.8: the chunk's S = Qi Kj^T (keys key0 ... key0 + chunk - 1 of the
        tile) on the tensor cores, into the fragments s, unscaled."""
        for nt in range(NT):
            c = (ZERO, ZERO, ZERO, ZERO)
            e = c
            f = c
            kr = (key0 + nt * 8 + g) * K_ROW + 2 * t    # B = Kj^T: B[t, g] = Kj[g, t]
            for ks in range(KS):
                if Q_REGS:
                    a0b, a1b, a2b, a3b = qb[ks * 4], qb[ks * 4 + 1], qb[ks * 4 + 2], qb[ks * 4 + 3]
                    a0s, a1s, a2s, a3s = qs[ks * 4], qs[ks * 4 + 1], qs[ks * 4 + 2], qs[ks * 4 + 3]
                else:
                    qr = r0 * K_ROW + 2 * (ks * 8 + t)
                    a0b, a0s = load_pair(QP, U(qr))                     # Q[g, 8ks + t]
                    a1b, a1s = load_pair(QP, U(qr + 8 * K_ROW))         # Q[g + 8, ...]
                    a2b, a2s = load_pair(QP, U(qr + 8))                 # Q[g, ... + 4]
                    a3b, a3s = load_pair(QP, U(qr + 8 * K_ROW + 8))
                b0b, b0s = load_pair(KP, U(kr + 16 * ks))               # Kj[g, 8ks + t]
                b1b, b1s = load_pair(KP, U(kr + 16 * ks + 8))           # Kj[g, ... + 4]
                c, e, f = mma3(a0b, a1b, a2b, a3b, a0s, a1s, a2s, a3s,
                               b0b, b1b, b0s, b1s, c, e, f)
            for x in range(4):
                s[nt * 4 + x] = c[x] + (e[x] + f[x])

    def scores_head_dim_outside(q_fragment):
        """``scores`` for a Qi staged in shared memory (d > 64), with the loops the other
        way round: the head dim outside, the chunk's n-tiles inside, so that each A
        fragment of Qi is read once per chunk instead of once per n-tile (v8). Each score
        is summed over the head dim in the same order as in ``scores``, so the results
        are the same bits. ``q_fragment(QX, r0, ks, t)`` reads Qi's A fragment for head-dim
        step ks from its tile QX as (big parts, small parts): from split pairs (v8's
        q_pair_fragment) or plain values split as read (v9). se and sf hold the small
        products' sums."""
        @cuda.jit(device=True, inline=True)
        def scores_q_once(s, se, sf, QX, KP, key0, r0, g, t):
            for x in range(S_FRAGS):
                s[x] = ZERO
                se[x] = ZERO
                sf[x] = ZERO
            for ks in range(KS):
                a0b, a1b, a2b, a3b, a0s, a1s, a2s, a3s = q_fragment(QX, r0, ks, t)
                for nt in range(NT):
                    kr = (key0 + nt * 8 + g) * K_ROW + 2 * t + 16 * ks
                    b0b, b0s = load_pair(KP, U(kr))                 # Kj[g, 8ks + t]
                    b1b, b1s = load_pair(KP, U(kr + 8))             # Kj[g, ... + 4]
                    y = nt * 4
                    c, e, f = mma3(a0b, a1b, a2b, a3b, a0s, a1s, a2s, a3s, b0b, b1b, b0s,
                                   b1s, (s[y], s[y + 1], s[y + 2], s[y + 3]),
                                   (se[y], se[y + 1], se[y + 2], se[y + 3]),
                                   (sf[y], sf[y + 1], sf[y + 2], sf[y + 3]))
                    for x in range(4):
                        s[y + x] = c[x]
                        se[y + x] = e[x]
                        sf[y + x] = f[x]
            for x in range(S_FRAGS):
                s[x] = s[x] + (se[x] + sf[x])
        return scores_q_once

    @cuda.jit(device=True, inline=True)
    def q_pair_fragment(QP, r0, ks, t):
        """Qi's A fragment for head-dim step ks from QP (split pairs, rows of K_ROW)."""
        qr = r0 * K_ROW + 2 * (ks * 8 + t)
        a0b, a0s = load_pair(QP, U(qr))                     # Q[g, 8ks + t]
        a1b, a1s = load_pair(QP, U(qr + 8 * K_ROW))         # Q[g + 8, ...]
        a2b, a2s = load_pair(QP, U(qr + 8))                 # Q[g, ... + 4]
        a3b, a3s = load_pair(QP, U(qr + 8 * K_ROW + 8))
        return a0b, a1b, a2b, a3b, a0s, a1s, a2s, a3s

    scores_q_once = scores_head_dim_outside(q_pair_fragment)

    @cuda.jit(device=True, inline=True)
    def values(o, s, pb, ps, VP, key0, g, t, alpha0, alpha1):
        """Alg.1 l.10: O = diag(alpha) O + P~ Vj for the chunk, P~ straight from the S
        fragments s (keys 2t and 2t+1 of each 8 play the mma's k = t and t + 4, as in
        v3), split into pb, ps first. A NaN in P~ (from a NaN score) reaches l, so its
        split may be anything."""
        for x in range(S_FRAGS):
            pb[x], ps[x] = split_finite(s[x])
        for nd in range(KS):
            c = (ZERO, ZERO, ZERO, ZERO)
            e = c
            for ks in range(NT):
                vr = (key0 + ks * 8 + 2 * t) * V_ROW + 2 * (nd * 8 + g)
                b0b, b0s = load_pair(VP, U(vr))             # Vj[2t, 8nd + g]
                b1b, b1s = load_pair(VP, U(vr + V_ROW))     # Vj[2t + 1, 8nd + g]
                c, e = mma3_short(
                    pb[ks * 4], pb[ks * 4 + 2], pb[ks * 4 + 1], pb[ks * 4 + 3],
                    ps[ks * 4], ps[ks * 4 + 2], ps[ks * 4 + 1], ps[ks * 4 + 3],
                    b0b, b1b, b0s, b1s, c, e)
            # The chunk's P~ Vj is summed from zero, then added to the rescaled O in
            # ordinary float32 arithmetic (as in v3).
            o[nd * 4] = o[nd * 4] * alpha0 + (c[0] + e[0])
            o[nd * 4 + 1] = o[nd * 4 + 1] * alpha0 + (c[1] + e[1])
            o[nd * 4 + 2] = o[nd * 4 + 2] * alpha1 + (c[2] + e[2])
            o[nd * 4 + 3] = o[nd * 4 + 3] * alpha1 + (c[3] + e[3])

    return (load_q, stage_kv, scores, scores_q_once, values, finite_or_zero, load_finite,
            scores_head_dim_outside)


@functools.lru_cache(maxsize=None)
def make_forward_v6(Br, Bc, d, causal, chunk=V6_CHUNK, max_registers=None):
    """v6: v3's tensor-core forward with each K/V tile split into TF32 parts once, in
    shared memory, and exact for every input (GPU only; float32 accumulation, float16
    and float32 inputs, d <= 128). On the simulator the dispatcher runs v5 instead.

    What changes against v3:

    * Split once per tile. v3 splits every K and V operand into its TF32 big and small
      parts again for every mma, in every warp (most of its instructions: docs/
      performance.md). v6 splits each element once, while the block stages the tile, and
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
    (scripts/v6_sweep.py --configs); the dispatcher uses the defaults.

    Launch: grid (ceil(Sq / Br), BH), block (2 * Br,): Br / 16 warps of 16 query rows
    each (v3's fragment layout; see make_forward_v3), and
    ``v6_shared_layout(Br, Bc, d)[3] * 4`` bytes of dynamic shared memory (END).
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
    assert 2 * Br % v6_staging_width(d) == 0, (Br, d)   # dispatch.check_v6_tiles refuses these
    KP_AT, VP_AT, QP_AT, END, _, _ = v6_shared_layout(Br, Bc, d)
    kv_tile_range = make_kv_tile_range(Br, Bc, causal, False)
    (_, add_nonfinite_scores, softmax_step, add_nonfinite_values,
     write_rows) = make_mma_row_steps(d, causal, CHUNK, KS)
    load_q, stage_kv, scores, _, values = make_v6_tile_steps(Br, Bc, d, CHUNK)[:5]

    options = jit_options()
    if max_registers:       # ptxas's register limit (GPU-only kernel: no simulator concern)
        options["max_registers"] = max_registers

    @cuda.jit(**options)
    def forward_v6(Q, K, V, O, L, softmax_scale, causal_offset):
        bh = cuda.blockIdx.y
        i = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        lane = tid % 32
        g = lane // 4
        t = lane % 4
        r0 = (tid // 32) * 16 + g               # this lane's two rows within the tile
        row0 = i * Br + r0
        row1 = row0 + 8
        Sq = Q.shape[1]
        Sk = K.shape[1]

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

        _, Tc = kv_tile_range(i, Sk, causal_offset, 0)     # causal: skip masked tiles
        for j in range(Tc):
            mark = int32(j + 1)
            # Wait until every warp has finished reading the previous Kj and Vj.
            cuda.syncthreads()
            stage_kv(K, V, KP, VP, kx, vx, bad, bh, j, tid, Sk)              # Alg.1 l.7
            # Wait until Kj, Vj (and, for j = 0, QP and bad[0]) are complete.
            cuda.syncthreads()
            fix_scores = bad[0] != 0 or bad[1] == mark     # the same in every thread
            fix_values = bad[2] == mark
            # Does every row of the block see every key of the tile? Then nothing is masked.
            whole_tile = (j * Bc + Bc <= Sk
                          and (not causal or j * Bc + Bc - 1 <= i * Br + causal_offset))

            for ch in range(Bc // CHUNK):
                key0 = ch * CHUNK                # first key of the chunk within the tile
                scores(s, qb, qs, QP, KP, key0, r0, g, t)                    # Alg.1 l.8
                # (What follows the products comes after all of them, so that ptxas may
                # interleave the n-tiles' mma: a branch between them would keep it from it.)
                if fix_scores:          # rare: a non-finite q or k was staged as 0
                    add_nonfinite_scores(s, Q, K, bh, j * Bc + key0, row0, t, Sq, Sk)
                # Alg.1 l.9: scale and mask, new running max (over the quad),
                # P~ = exp(S - m_new) in s, and the rescale factors alpha.
                alpha0, alpha1, m0, m1, l0, l1 = softmax_step(
                    s, softmax_scale, whole_tile, j * Bc + key0, row0, t, Sk, causal_offset,
                    m0, m1, l0, l1)
                values(o, s, pb, ps, VP, key0, g, t, alpha0, alpha1)         # Alg.1 l.10
                if fix_values:          # rare: a non-finite v was staged as 0
                    add_nonfinite_values(o, s, V, bh, j * Bc + key0, row0, row1, g, t, Sk,
                                         causal_offset)

        # Alg.1 l.12-16: the quad's row sums, normalise once, write O and L (as v3).
        write_rows(O, L, o, bh, row0, row1, t, m0, m1, l0, l1, Sq)

    return forward_v6


@functools.lru_cache(maxsize=None)
def make_forward_v8(Br, Bc, d, causal, chunk=V6_CHUNK, max_registers=None):
    """v8: v6 with the scores of the next chunk computed while this chunk's softmax runs
    (GPU only; float32 accumulation, float16 and float32 inputs, d <= 128; the same
    arguments, launch and shared memory as v6, and for the same ``chunk`` the same
    results, bit for bit).

    What changes against v6 is the order of the work, nothing else:

    * The next chunk's S first. v6 does each chunk's steps one after the other: S = Qi
      Kj^T on the tensor cores, then the online softmax, then P~ Vj. The softmax is a
      chain of dependent steps (scale, the quad's max by shuffles, exp2, the sums), and
      with only two warps per scheduler (docs/performance.md: 172 registers a thread,
      one block of eight warps per SM) the tensor cores wait while it runs. v8 starts
      the next chunk's S before this chunk's softmax: its mma depend on nothing the
      softmax computes, so the scheduler can issue them between the softmax's steps.
      It costs the registers of a second S (chunk / 2 a lane, and its accumulators
      while it is summed); at one block per SM, registers up to 255 a thread cost no
      occupancy. Each tile's first chunk is computed before the loop; the last has no
      next.
    * With Qi in shared memory (d > 64), each Qi fragment is read once per chunk
      (``scores_q_once``: the head dim outside, the n-tiles inside) instead of once per
      n-tile. Every score's sum still runs over the head dim in the same order.

    The dispatcher gives it 32-key chunks at d > 64 (dispatch.v8_chunk), where v6 runs
    16: there v8's default results differ from v6's default by rounding (the online
    softmax takes other steps), and equal v6's bit for bit with v6 at 32-key chunks.
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
    KP_AT, VP_AT, QP_AT, END, _, _ = v6_shared_layout(Br, Bc, d)
    kv_tile_range = make_kv_tile_range(Br, Bc, causal, False)
    (_, add_nonfinite_scores, softmax_step, add_nonfinite_values,
     write_rows) = make_mma_row_steps(d, causal, CHUNK, KS)
    load_q, stage_kv, scores, scores_q_once, values = make_v6_tile_steps(Br, Bc, d, CHUNK)[:5]
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

    @cuda.jit(**options)
    def forward_v8(Q, K, V, O, L, softmax_scale, causal_offset):
        bh = cuda.blockIdx.y
        i = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        lane = tid % 32
        g = lane // 4
        t = lane % 4
        r0 = (tid // 32) * 16 + g
        row0 = i * Br + r0
        row1 = row0 + 8
        Sq = Q.shape[1]
        Sk = K.shape[1]

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
        load_q(Q, QP, qb, qs, bad, bh, i, row0, row1, t, tid, Sq)          # Alg.1 l.4
        for x in range(QO_FRAGS):
            o[x] = ZERO
        m0 = NEG_INF
        m1 = NEG_INF
        l0 = ZERO
        l1 = ZERO

        _, Tc = kv_tile_range(i, Sk, causal_offset, 0)
        for j in range(Tc):
            mark = int32(j + 1)
            # The barriers, flags and masks of v6. No S of the next tile is computed
            # early: its Kj is staged only after the first barrier below.
            cuda.syncthreads()
            stage_kv(K, V, KP, VP, kx, vx, bad, bh, j, tid, Sk)              # Alg.1 l.7
            cuda.syncthreads()
            fix_scores = bad[0] != 0 or bad[1] == mark
            fix_values = bad[2] == mark
            whole_tile = (j * Bc + Bc <= Sk
                          and (not causal or j * Bc + Bc - 1 <= i * Br + causal_offset))

            next_scores(sn, se, sf, qb, qs, QP, KP, 0, r0, g, t)    # Alg.1 l.8, first chunk
            for ch in range(NCH):
                key0 = ch * CHUNK
                for x in range(S_FRAGS):
                    s[x] = sn[x]
                if fix_scores:
                    add_nonfinite_scores(s, Q, K, bh, j * Bc + key0, row0, t, Sq, Sk)
                # Alg.1 l.8 for the next chunk, before this chunk's softmax (v8's change).
                if ch + 1 < NCH:
                    next_scores(sn, se, sf, qb, qs, QP, KP, key0 + CHUNK, r0, g, t)
                alpha0, alpha1, m0, m1, l0, l1 = softmax_step(              # Alg.1 l.9
                    s, softmax_scale, whole_tile, j * Bc + key0, row0, t, Sk, causal_offset,
                    m0, m1, l0, l1)
                values(o, s, pb, ps, VP, key0, g, t, alpha0, alpha1)         # Alg.1 l.10
                if fix_values:
                    add_nonfinite_values(o, s, V, bh, j * Bc + key0, row0, row1, g, t, Sk,
                                         causal_offset)

        write_rows(O, L, o, bh, row0, row1, t, m0, m1, l0, l1, Sq)

    return forward_v8


def v9_shared_layout(Br, Bc, d):
    """Where forward v9's tiles sit in its one dynamic float32 array: (KP_AT, VP_AT, QT_AT,
    RK_AT, RV_AT, END, Q_ROW). KP and VP are v6's (Kj and Vj as split pairs, rows of
    v6_shared_layout's K_ROW and V_ROW). QT is Qi as plain float32 values, Br rows of
    Q_ROW = DP + 4 (conflict-free fragment reads, as backward v5's tiles), present only
    when Qi does not stay in registers (DP > V6_Q_REGISTERS_MAX_DP). RK and RV are the
    landing places of the asynchronous copies of the next Kj and Vj, Bc rows of d floats
    each. ``dispatch.v9_shared_bytes`` is END * 4."""
    DP = (d + 7) // 8 * 8
    KP_AT, VP_AT, QT_AT, _, _, _ = v6_shared_layout(Br, Bc, d)     # v6's KP and VP first
    Q_ROW = DP + 4
    RK_AT = QT_AT + (0 if DP <= V6_Q_REGISTERS_MAX_DP else Br * Q_ROW)
    RV_AT = RK_AT + Bc * d
    END = RV_AT + Bc * d
    return KP_AT, VP_AT, QT_AT, RK_AT, RV_AT, END, Q_ROW


@functools.lru_cache(maxsize=None)
def make_forward_v9(Br, Bc, d, causal, chunk=V6_CHUNK, max_registers=None):
    """v9: v8 with the next K/V tile copied into shared memory while this one is used
    (GPU only, sm_80 and later; float32 inputs, d <= 128; for the same ``chunk`` the
    same results as v8 and v6, bit for bit).

    What it addresses: v8 runs one block of eight warps per SM (docs/performance.md, run
    54), and at every K/V tile all eight wait together, first at a barrier and then for
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

    What it bought (run 60, (2, 16, 4096, d), ms not causal / causal): at d = 128 10.11 /
    5.74 against v8's 10.92 / 6.08; at d = 64 5.41 / 3.76 against 5.43 / 3.15 (255
    registers; CUDA 13.5's ptxas spills it), so the loads' wait is not what holds v8 back
    at d = 64, and the dispatcher runs v9 from d = 65 on only
    (dispatch.V9_DEFAULT_MIN_HEAD_DIM).

    Float32 inputs only: a copy moves 4 bytes unchanged (float16 inputs run v7 or v8).
    ``chunk`` and ``max_registers`` as for v8. Launch: as v6, with
    ``v9_shared_layout(Br, Bc, d)[5] * 4`` bytes of dynamic shared memory (END).
    """
    from .ptx import cp_async, cp_async_wait_all, store_pair   # GPU only
    from .ptx import split_tf32_finite as split_finite

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
    _, _, _, _, K_ROW, V_ROW = v6_shared_layout(Br, Bc, d)
    KP_AT, VP_AT, QT_AT, RK_AT, RV_AT, END, Q_ROW = v9_shared_layout(Br, Bc, d)
    kv_tile_range = make_kv_tile_range(Br, Bc, causal, False)
    (_, add_nonfinite_scores, softmax_step, add_nonfinite_values,
     write_rows) = make_mma_row_steps(d, causal, CHUNK, KS)
    (load_q, _, scores, _, values, finite_or_zero, load_finite,
     scores_head_dim_outside) = make_v6_tile_steps(Br, Bc, d, CHUNK)

    @cuda.jit(device=True, inline=True)
    def copy_kv(K, V, RK, RV, bh, j, tid, Sk):
        """Start the copies of this thread's elements of Kj and Vj (column tid % W, rows
        tid // W + RSTEP n, as v6's staging) into RK and RV; none past Sk or d."""
        k_own = tid % W
        c = tid // W
        if k_own < d:
            while c < Bc and j * Bc + c < Sk:
                at = (bh * Sk + j * Bc + c) * d + k_own
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
    def load_q_plain(Q, QT, bad, bh, i, tid, Sq):
        """Alg.1 l.4 at d > 64: Qi into QT as float32 values (0 past Sq and d, a
        non-finite one as 0 raising bad[0], as v6's load_q)."""
        idx = tid
        while idx < Br * DP:
            r = idx // DP
            k = idx % DP
            QT[U(r * Q_ROW + k)] = load_finite(Q, bh, i * Br + r, k, Sq, bad, 0, int32(1))
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
    def forward_v9(Q, K, V, O, L, softmax_scale, causal_offset):
        bh = cuda.blockIdx.y
        i = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        lane = tid % 32
        g = lane // 4
        t = lane % 4
        r0 = (tid // 32) * 16 + g
        row0 = i * Br + r0
        row1 = row0 + 8
        Sq = Q.shape[1]
        Sk = K.shape[1]

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

        _, Tc = kv_tile_range(i, Sk, causal_offset, 0)
        if Tc > 0:
            copy_kv(K, V, RK, RV, bh, 0, tid, Sk)       # the first tile's copies start
        if tid == 0:
            bad[0] = 0
            bad[1] = 0
            bad[2] = 0
        cuda.syncthreads()
        if Q_REGS:
            load_q(Q, QT, qb, qs, bad, bh, i, row0, row1, t, tid, Sq)      # Alg.1 l.4
        else:
            load_q_plain(Q, QT, bad, bh, i, tid, Sq)
        for x in range(QO_FRAGS):
            o[x] = ZERO
        m0 = NEG_INF
        m1 = NEG_INF
        l0 = ZERO
        l1 = ZERO

        for j in range(Tc):
            mark = int32(j + 1)
            cp_async_wait_all()                 # this thread's elements of tile j are in
            # Wait until every warp has finished reading the previous Kj and Vj.
            cuda.syncthreads()
            split_kv(RK, RV, KP, VP, bad, j, tid, Sk)                       # Alg.1 l.7
            if j + 1 < Tc:                      # v9's change: the next tile's copies start
                copy_kv(K, V, RK, RV, bh, j + 1, tid, Sk)
            # Wait until Kj, Vj (and, for j = 0, Qi and bad[0]) are complete.
            cuda.syncthreads()
            fix_scores = bad[0] != 0 or bad[1] == mark
            fix_values = bad[2] == mark
            whole_tile = (j * Bc + Bc <= Sk
                          and (not causal or j * Bc + Bc - 1 <= i * Br + causal_offset))

            # From here on v8's steps, unchanged.
            next_scores(sn, se, sf, qb, qs, QT, KP, 0, r0, g, t)
            for ch in range(NCH):
                key0 = ch * CHUNK
                for x in range(S_FRAGS):
                    s[x] = sn[x]
                if fix_scores:
                    add_nonfinite_scores(s, Q, K, bh, j * Bc + key0, row0, t, Sq, Sk)
                if ch + 1 < NCH:
                    next_scores(sn, se, sf, qb, qs, QT, KP, key0 + CHUNK, r0, g, t)
                alpha0, alpha1, m0, m1, l0, l1 = softmax_step(              # Alg.1 l.9
                    s, softmax_scale, whole_tile, j * Bc + key0, row0, t, Sk, causal_offset,
                    m0, m1, l0, l1)
                values(o, s, pb, ps, VP, key0, g, t, alpha0, alpha1)         # Alg.1 l.10
                if fix_values:
                    add_nonfinite_values(o, s, V, bh, j * Bc + key0, row0, row1, g, t, Sk,
                                         causal_offset)

        write_rows(O, L, o, bh, row0, row1, t, m0, m1, l0, l1, Sq)

    return forward_v9


V7_CHUNK = 32                           # v7: keys per online-softmax step, by default
V7_LOAD_BATCH = 4                       # v7: K and V elements a thread loads at once


def v7_shared_layout(Bc, d):
    """Where forward v7's float16 tiles sit in its one dynamic float16 array, and their row
    lengths: (VT_AT, END, K_ROW, V_ROW). Kj is stored as it is, row c of keys at
    c * K_ROW; Vj transposed, row k (a column of V) at VT_AT + k * V_ROW, so that both
    operands of the mma read two neighbouring float16 values as one 32-bit word. DP is d
    rounded up to the mma's k = 16. The rows are padded to an odd multiple of four words
    (K_ROW = DP + 8, V_ROW = Bc + 8 halves), so that the eight groups of a warp's fragment
    read hit different banks (make_forward_v7). ``dispatch.v7_shared_bytes`` is END * 2."""
    DP = (d + 15) // 16 * 16
    K_ROW = DP + 8
    V_ROW = Bc + 8
    VT_AT = Bc * K_ROW
    END = VT_AT + DP * V_ROW
    return VT_AT, END, K_ROW, V_ROW


def v7_staging_width(d):
    """How many threads forward v7 puts on one row of a K/V tile when it stages it (one
    column each): v6's width, but at least the head dim padded to the mma's k = 16. Every
    column of the padded tile needs a thread to write it (0 past d): a column no thread
    writes holds stale shared memory, and a stale NaN times the 0 of the other operand is
    NaN in the mma. (v6's width alone is 8 at d <= 8, where v7 pads to 16: found by
    reading the kernel in session 8; tests/test_forward_kernels.py checks the rule.)"""
    return max(v6_staging_width(d), (d + 15) // 16 * 16)


@functools.lru_cache(maxsize=None)
def make_forward_v7(Br, Bc, d, causal, chunk=V7_CHUNK):
    """v7: float16 inputs on the float16 tensor cores (GPU only; float32 sums, d <= 128).
    On the simulator the dispatcher runs v5 instead.

    v6 multiplies float32 values to float32 accuracy with three TF32 products (3xTF32).
    A float16 value needs none of that: it has 11 significant bits, and the tensor cores'
    float16 ``mma`` (m16n8k16: 16 x 16 times 16 x 8, ptx.mma_f16) multiplies two of them
    exactly and adds the products in float32. So v7 is v6's algorithm, warp layout and
    online softmax with one product where v6 has three, and k = 16 instead of 8:

    * Sij = Qi Kj^T is one mma per 16 x 8 x 16 block: exact products of the float16
      inputs, summed in float32 (as v6's are, to float32 accuracy).
    * P~ij Vj needs P~ as float16: each probability (in [0, 1]) is rounded to float16
      (ptx.pack_f16x2), a relative error of at most 2^-11 per term, as flash-attention's
      float16 kernels do. The row sum l adds the unrounded float32 P~. The tests hold v7
      to the float16 rule of tests/tolerance.py: its baseline is attention computed in
      float16.
    * The S fragments are the A operand of P~ Vj as they are: the accumulator of an
      m16n8k16 n-tile holds (row g, keys 2t and 2t + 1), and two n-tiles side by side are
      the A fragment of 16 keys (a0 and a1 from the first, a2 and a3 from the second),
      so no shuffle or relabelling is needed.
    * The tiles stay float16 in shared memory (v7_shared_layout): Kj as it is and Vj
      transposed, so that each B word is two neighbours (ptx.load_b32). Half of v6's
      float32 bytes before its pairs; a quarter of them with the pairs.
    * Qi's fragments stay in registers (d / 8 words a lane at d <= 128).

    Non-finite inputs are handled as in v6: such an element is staged as 0, and the terms
    it was part of are added back in float32 (exact NaN and inf positions). Everything
    after the two products is v6's code (``make_mma_row_steps``): the layout of the
    accumulators is the same.

    ``chunk`` (keys per online-softmax step, a multiple of 16 dividing Bc) is there to be
    measured; the dispatcher uses the default.

    Launch: grid (ceil(Sq / Br), BH), block (2 * Br,): Br / 16 warps of 16 query rows, and
    ``v7_shared_layout(Bc, d)[1] * 2`` bytes of dynamic shared memory.
    """
    from numba.types import float16, uint32
    from .ptx import flat_load, load_b32, mma_f16, pack_f16x2      # GPU only

    acc = acc_type("float32")
    ZERO = acc(0)
    NEG_INF = acc(-math.inf)
    assert Br % 16 == 0 and chunk % 16 == 0 and Bc % chunk == 0, (Br, Bc, chunk)
    CHUNK = chunk
    THREADS = 2 * Br                        # Br / 16 warps of 32 lanes
    DP = (d + 15) // 16 * 16                # head dim padded to the mma's k = 16
    KS = DP // 16                           # mma steps over the head dim (S = Q K^T)
    ND = DP // 8                            # n-tiles of 8 columns of O
    NT = CHUNK // 8                         # n-tiles of 8 keys of S in a chunk
    PK = CHUNK // 16                        # mma steps over the keys of a chunk (P~ V)
    Q_WORDS = KS * 4                        # Q's A fragments per lane (two halves a word)
    P_WORDS = PK * 4                        # P~'s A fragments of a chunk per lane
    O_FRAGS = ND * 4                        # O's fragments per lane
    S_FRAGS = NT * 4                        # S, then P~, fragments of a chunk per lane
    W = v7_staging_width(d)                 # the staging loops' row width (<= THREADS)
    assert THREADS % W == 0, (Br, d)        # dispatch.check_v7_tiles refuses these
    RSTEP = THREADS // W                    # rows a pass of the block stages
    VT_AT, END, K_ROW, V_ROW = v7_shared_layout(Bc, d)
    kv_tile_range = make_kv_tile_range(Br, Bc, causal, False)
    (finite, add_nonfinite_scores, softmax_step, add_nonfinite_values,
     write_rows) = make_mma_row_steps(d, causal, CHUNK, ND)

    @cuda.jit(device=True, inline=True)
    def q_value(Q, bh, r, k, Sq, bad):
        """Q[bh, r, k] as float32, 0 past the rows or the head dim, and 0 if not finite
        (then bad[0] is set)."""
        x = acc(Q[U(bh), U(r), U(k)]) if r < Sq and k < d else ZERO
        if not finite(x):
            bad[0] = 1
            x = ZERO
        return x

    @cuda.jit(**jit_options())
    def forward_v7(Q, K, V, O, L, softmax_scale, causal_offset):
        bh = cuda.blockIdx.y
        i = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        lane = tid % 32
        g = lane // 4
        t = lane % 4
        r0 = (tid // 32) * 16 + g               # this lane's two rows within the tile
        k_own = tid % W                         # the column and first row this thread
        c_own = tid // W                        # stages of each K/V tile
        k_in = k_own < d
        k_load = min(k_own, d - 1)              # a column inside the arrays
        row0 = i * Br + r0
        row1 = row0 + 8
        Sq = Q.shape[1]
        Sk = K.shape[1]
        HZERO = float16(ZERO)       # (a float16 constant from outside is invalid NVVM IR)

        # The block's dynamic shared memory, cut into the tiles (v7_shared_layout).
        smem = cuda.shared.array(0, float16, alignment=16)
        KH = smem[0:VT_AT]                      # Kj, rows of K_ROW halves
        VT = smem[VT_AT:END]                    # Vj transposed, rows of V_ROW halves
        bad = cuda.shared.array(3, int32)       # non-finite inputs staged as 0 (as v6)
        q = cuda.local.array(Q_WORDS, uint32)   # Q's A fragments, two float16 a word
        o = cuda.local.array(O_FRAGS, acc)      # O fragments
        s = cuda.local.array(S_FRAGS, acc)      # S, then P~, fragments of a chunk
        p = cuda.local.array(P_WORDS, uint32)    # P~ as the A fragments of P~ Vj
        kx = cuda.local.array(V7_LOAD_BATCH, float16)   # K and V elements in flight
        vx = cuda.local.array(V7_LOAD_BATCH, float16)

        if tid == 0:
            bad[0] = 0
            bad[1] = 0
            bad[2] = 0
        # Wait until bad is clear.
        cuda.syncthreads()
        # Alg.1 l.4: Qi's A fragments (zero past Sq and d): word ks * 4 + w holds row
        # row0 (w even) or row1 (w odd), columns 16 ks + 2t (+ 8 for w >= 2) and the next.
        for ks in range(KS):
            for w in range(4):
                row = row0 + 8 * (w % 2)
                col = ks * 16 + 2 * t + 8 * (w // 2)
                q[ks * 4 + w] = pack_f16x2(q_value(Q, bh, row, col, Sq, bad),
                                           q_value(Q, bh, row, col + 1, Sq, bad))
        for x in range(O_FRAGS):
            o[x] = ZERO
        m0 = NEG_INF            # running max of row0 and row1 (the same in all 4 lanes)
        m1 = NEG_INF
        l0 = ZERO               # this lane's part of the running sums (reduced at the end)
        l1 = ZERO

        _, Tc = kv_tile_range(i, Sk, causal_offset, 0)     # causal: skip masked tiles
        for j in range(Tc):
            mark = int32(j + 1)
            last_row = (bh * Sk + Sk - 1) * d + k_load      # a position inside K and V
            # Wait until every warp has finished reading the previous Kj and Vj.
            cuda.syncthreads()
            # Alg.1 l.7: load Kj and Vj as float16 (rows past Sk, columns past d and
            # non-finite values: 0), as v6 stages them: this thread's column is k_own,
            # its rows c_own, c_own + RSTEP, ..., V7_LOAD_BATCH of them in flight.
            c = c_own
            while c < Bc:
                at = (bh * Sk + j * Bc + c) * d + k_load     # row j * Bc + c, column k_load
                for u in range(V7_LOAD_BATCH):
                    col = j * Bc + c + u * RSTEP
                    inside = k_in and c + u * RSTEP < Bc and col < Sk
                    at_u = at + u * RSTEP * d if col < Sk else last_row
                    kx[u] = flat_load(K, U(at_u))
                    vx[u] = flat_load(V, U(at_u))
                    kx[u] = kx[u] if inside else HZERO
                    vx[u] = vx[u] if inside else HZERO
                if k_own < DP:
                    for u in range(V7_LOAD_BATCH):
                        r = c + u * RSTEP
                        if r < Bc:
                            kv = kx[u]
                            if not finite(acc(kv)):
                                cuda.atomic.max(bad, 1, mark)
                                kv = HZERO
                            KH[U(r * K_ROW + k_own)] = kv
                            vv = vx[u]
                            if not finite(acc(vv)):
                                cuda.atomic.max(bad, 2, mark)
                                vv = HZERO
                            VT[U(k_own * V_ROW + r)] = vv
                c += V7_LOAD_BATCH * RSTEP
            # Wait until Kj, Vj (and, for j = 0, bad[0]) are complete.
            cuda.syncthreads()
            fix_scores = bad[0] != 0 or bad[1] == mark     # the same in every thread
            fix_values = bad[2] == mark
            # Does every row of the block see every key of the tile? Then nothing is masked.
            whole_tile = (j * Bc + Bc <= Sk
                          and (not causal or j * Bc + Bc - 1 <= i * Br + causal_offset))

            for ch in range(Bc // CHUNK):
                key0 = ch * CHUNK                # first key of the chunk within the tile
                # Alg.1 l.8: S = Qi Kj^T, one float16 mma per 16 x 8 x 16 block.
                for nt in range(NT):
                    acc4 = (ZERO, ZERO, ZERO, ZERO)
                    kr = (key0 + nt * 8 + g) * K_ROW + 2 * t    # B[k, n] = Kj[n, k]
                    for ks in range(KS):
                        acc4 = mma_f16(q[ks * 4], q[ks * 4 + 1], q[ks * 4 + 2], q[ks * 4 + 3],
                                       load_b32(KH, U(kr + 16 * ks)),         # Kj[g, 16ks + 2t:]
                                       load_b32(KH, U(kr + 16 * ks + 8)),     # Kj[g, ... + 8:]
                                       acc4[0], acc4[1], acc4[2], acc4[3])
                    for x in range(4):
                        s[nt * 4 + x] = acc4[x]
                if fix_scores:          # rare: a non-finite q or k was staged as 0
                    add_nonfinite_scores(s, Q, K, bh, j * Bc + key0, row0, t, Sq, Sk)
                # Alg.1 l.9 (as v6): scale and mask, new running max, P~ in s, alpha.
                alpha0, alpha1, m0, m1, l0, l1 = softmax_step(
                    s, softmax_scale, whole_tile, j * Bc + key0, row0, t, Sk, causal_offset,
                    m0, m1, l0, l1)
                # Alg.1 l.10: O = diag(alpha) O + P~ Vj. P~ rounded to float16, two S
                # n-tiles (16 keys) to one A fragment: a0, a1 rows g and g + 8 of the
                # first, a2, a3 of the second.
                for pk in range(PK):
                    for w in range(4):
                        x = (2 * pk + w // 2) * 4 + 2 * (w % 2)
                        p[pk * 4 + w] = pack_f16x2(s[x], s[x + 1])
                for nd in range(ND):
                    acc4 = (ZERO, ZERO, ZERO, ZERO)
                    vr = (nd * 8 + g) * V_ROW + key0 + 2 * t     # B[k, n] = Vj[k, n] = VT[n, k]
                    for pk in range(PK):
                        acc4 = mma_f16(p[pk * 4], p[pk * 4 + 1], p[pk * 4 + 2], p[pk * 4 + 3],
                                       load_b32(VT, U(vr + 16 * pk)),         # keys 16pk + 2t:
                                       load_b32(VT, U(vr + 16 * pk + 8)),     # keys ... + 8:
                                       acc4[0], acc4[1], acc4[2], acc4[3])
                    # The chunk's P~ Vj is summed from zero, then added to the rescaled O
                    # in ordinary float32 arithmetic (as in v3 and v6).
                    o[nd * 4] = o[nd * 4] * alpha0 + acc4[0]
                    o[nd * 4 + 1] = o[nd * 4 + 1] * alpha0 + acc4[1]
                    o[nd * 4 + 2] = o[nd * 4 + 2] * alpha1 + acc4[2]
                    o[nd * 4 + 3] = o[nd * 4 + 3] * alpha1 + acc4[3]
                if fix_values:          # rare: a non-finite v was staged as 0 (as v6)
                    add_nonfinite_values(o, s, V, bh, j * Bc + key0, row0, row1, g, t, Sk,
                                         causal_offset)

        # Alg.1 l.12-16: the quad's row sums, normalise once, write O and L (as v6).
        write_rows(O, L, o, bh, row0, row1, t, m0, m1, l0, l1, Sq)

    return forward_v7
