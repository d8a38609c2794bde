"""Backward v6: v5 made cheaper: splits on the bits, per-kernel tiles, split-pair tiles;
with the attention variants.

Parent: v5 (v5_tensor_cores.py): its layout, its two kernels and their order of work.
v6 changes what v5 spends instructions on rather than tensor-core time: TF32 splits on
the bits (the inputs were checked finite), each A fragment loaded and split once per
chunk instead of once per n-tile, staging with one flat address per element, exp2 with
log2(e) folded in (ex2.approx.ftz), and 32 keys a step in the dQ kernel
(make_backward_dkdv_v6 says how).
Its plan gives each kernel its own tiles, eight warps a block above d = 64, and, in
float32, keeps the streamed tiles (Qi, dOi for dK/dV; Kj, Vj for dQ) as TF32 pairs split
once as staged, with that side of the tile halved to keep the shared memory.

What it buys, on the H200 at (2, 16, 4096, d): 1.25x-1.39x v4 at d = 64
(lab/runs/2026-12-01/37_bwd_v6_sweep.txt, 38_bwd_v6_chunks.txt), 1.59x-1.71x at d = 128
with the per-kernel tiles (lab/runs/2026-12-01/58_bwd_v6_sweep.txt); the pairs then took
d = 128 from 34.43 / 18.60 ms to 30.98 / 17.03 (not causal / causal;
lab/runs/2026-12-01/63_bwd_pairs_d128.txt). The whole backward runs at 0.54x-0.66x
PyTorch SDPA EFFICIENT (lab/runs/2026-12-01/65_bench.txt; what limits it:
docs/performance.md). What it costs: v5's finite-input contract, and 255 registers a
thread above d = 64.

Variants (kernels/variants.py), as backward v1 takes them: causal in both alignments,
sliding windows (the Q and K/V tiles walked are the band's, bands.py), GQA/MQA without
copying K/V (the dK/dV kernel runs one block per K/V tile and K/V head and sums over the
group's query heads in a fixed order, no atomics), softcap, ALiBi, boolean and additive
attn_mask, score_mod with score_mod_grad, and mask_mod; a mask that depends on data
skips the tiles its table marks empty (both kernels then take one pair of tiles, the
table's), and dropout (the forward's keep mask asked again per entry of a fragment:
make_backward_dkdv_v6 says how). Each variant step is a compile-time switch
(``_variant_flags``, ``variant.dropout``): plain attention compiles none of them and
computes the same bits as before they existed.

Packed batches (numbaflash/varlen.py): both kernels read the packed (total, heads, d)
arrays as they are, each row index plus the sequence's first row, on (tiles, heads,
batch) grids (kernels/sequences.py's packed rows; ``packed_rows`` of the work
functions): at d = 64 168 and 169 registers, where the per-sequence views took up to 255
with spills (lab/runs/2026-12-06/packed_rows_backward_registers.txt), and the float32
packed batch's forward + backward went from 0.87x the padded batch's speed to 1.47x
(lab/runs/2026-12-05/116_varlen_speed_f32.txt, lab/runs/2026-12-06/136_varlen_speed_f32.txt).
Then, staging by columns (``staging_by_columns``) and the packed dK/dV kernel's register
cap (``PACKED_MAX_REGISTERS``) took it to 1.76x (139_varlen_speed_f32.txt, same folder),
and the packed kernels to about the plain kernels' time on a batch of equal lengths
(140_packed_bwd_f32_d64*.txt).

The default on a GPU for plain float32 and float16 attention with d <= 128 and finite
inputs. Deterministic: the gradients are the same bits with any of its tiles, with or
without pairs. Inline PTX and warp shuffles on a GPU; on the simulator
kernels/simulated.py's stand-ins (slow; the default there stays v4). compute-sanitizer's
four tools: 0 errors (lab/runs/2026-12-01/65_bwd_v6_memcheck.txt, 65_bwd_v6_racecheck.txt,
68_bwd_v6_pairs_synccheck.txt, 68_bwd_v6_pairs_initcheck.txt).
"""

import functools
import math
from collections import namedtuple
from dataclasses import replace

import numpy as np
from numba import cuda, int64

from .. import LOG2E, acc_type, jit_options
from ..bands import make_kv_tile_range, make_q_tile_range
from ..plan import TILE_TABLE_REASON, Plans, device_dynamic_shared_limit, variant_description
from ..sequences import make_packed_rows, make_sequences
from ..smem import U
from ..variants import PLAIN, make_dropout, make_variant_functions
from .v5_tensor_cores import (backward_tensor_core_refusal, bwd_v5_target, bwd_v5_tiles_within,
                              check_backward_v5_tiles, default_backward_v5_tiles,
                              dkdv_v5_shared_bytes, dkdv_v5_shared_layout, dq_v5_shared_bytes,
                              dq_v5_shared_layout, tensor_core_plans, v5_head_dim)


# ---------------------------------------------------------------------------------------
# v6: v5 with cheaper splits and staging, each A fragment used for a whole chunk


V6_CHUNK = 16           # backward v6: streamed rows per step, by default


# the chunk v6's plan gives each kernel (scripts/bwd_kernels.py --chunks times others). dQ
# takes 32 keys: its kernel 12.82 ms against 15.05 with 16 at (2, 16, 4096, 128)
# (lab/runs/2026-12-01/64_bwd_chunks_d128.txt); at d = 64, dK/dV 16 and dQ 32 were the
# fastest of the three pairs tried (64_bwd_chunks_d64.txt).
V6_CHUNKS = {"dkdv": V6_CHUNK, "dq": 32}

# With dropout, ptxas gives the dK/dV kernel at d <= 64 all 255 registers (167 without,
# tests/ptx_check.py's link report, sm_90), which leaves two of its blocks of 128 threads
# on an SM instead of three; capped at 168 it keeps three, at the price of 8 to 24 bytes
# of spill stores (float16 / float32, causal or not; at d = 128 the kernel without
# dropout already takes 255: no cap). Only dropout alone is capped: a score modifier or
# mask on top needs registers of its own.
# None turns the cap off (scripts/dropout_gpu.py --no-register-cap times both).
DKDV_DROPOUT_MAX_REGISTERS = 168
DKDV_DROPOUT_CAP_MAX_HEAD_DIM = 64


# A packed batch read as it is (packed rows) holds the sequence's first rows and lengths
# in registers of its own: ptxas gave the causal packed dK/dV kernel at d = 64 170
# registers (the plain one 167), which leaves two blocks on an SM instead of three; capped
# at 168 it takes 167 without spills (lab/runs/2026-12-06/packed_v6_registers.txt). The
# dQ kernel's packed builds take 166 and 168 uncapped (a cap only added spills there).
# The dK/dV kernel's packed builds are capped at d <= 64, unless a score modifier or
# mask needs registers of its own (with dropout, the cap above).
PACKED_MAX_REGISTERS = 168


def _modifies(variant):
    """Whether ``variant`` computes more than plain attention's P per entry (a score
    modifier, a mask by element, a window or a table of visible tiles)."""
    flags = _variant_flags(variant)
    return flags.scores or flags.by_element or flags.window or flags.tile_table


def dkdv_register_cap(variant, d):
    """The registers the dK/dV kernel for ``variant`` at head dim ``d`` may use (above),
    or None (no cap)."""
    if d > DKDV_DROPOUT_CAP_MAX_HEAD_DIM or _modifies(variant):
        return None
    if variant.dropout:
        return DKDV_DROPOUT_MAX_REGISTERS
    if variant.varlen:
        return PACKED_MAX_REGISTERS
    return None


# What _make_v6_helpers and _streamed_tile_steps return: device functions, by name.
V6Helpers = namedtuple("V6Helpers", "split_finite stage a_fragment mma3 load_split stage_pairs")
StreamedTileSteps = namedtuple("StreamedTileSteps", "stage load")


def staging_by_columns(kind, d, pairs, packed_rows):
    """Whether backward v6's ``kind`` kernel ("dkdv" or "dq") stages its tiles by
    columns (_make_v6_helpers): each thread one column, down the rows with a running
    index, instead of a flat index divided into row and column per element, which with
    packed rows also multiplied each row by a stride known only at run time. It cuts the
    instructions of the float32 kernels' tile loops (ptxas for sm_90,
    lab/runs/2026-12-06/sass_packed_backward*.txt) and their times, each kernel timed
    alone (lab/runs/2026-12-06/139_packed_bwd_*.txt, H100). The plain builds stage by
    columns at d <= 64 only, and there not the dK/dV kernel with split pairs: ptxas took
    174 registers for it instead of 167 (packed_v6_registers.txt), two blocks of 128
    threads on an SM instead of three; at d = 128, where the kernels take 255, it spilled
    (ptx_v6_columns_registers.txt)."""
    if packed_rows:
        return True
    return d <= 64 and not (kind == "dkdv" and pairs)


def _make_v6_helpers(d, varlen=False, packed_rows=False, columns=True):
    """Device functions shared by backward v6's two kernels: staging a tile, loading a
    split A fragment or B element, and the 3xTF32 product of split operands. ``varlen``:
    the arrays are a packed batch's views (kernels/sequences.py), whose flat positions
    come from their strides; with ``packed_rows`` the packed (total, heads, d) arrays as
    they are (kernels/sequences.py's packed rows). ``columns``: where the block's
    threads are a multiple of the padded head dim, each thread stages one column down
    the tile's rows with a running index (``staging_by_columns``); False keeps one flat
    index per element, divided into row and column."""
    from ..ptx import flat_load, mma_tf32, split_tf32_finite as split_finite   # inline PTX

    acc = acc_type("float32")
    ZERO = acc(0)
    DP, STRIDE = v5_head_dim(d)
    sequences = make_sequences(varlen)
    position, row_step = sequences.position, sequences.row_step
    ROWS = packed_rows
    if packed_rows:
        position = make_packed_rows(True).position
    COLUMNS = columns

    @cuda.jit(device=True, inline=True)
    def stage(T, A, bh, first, nrows, rows, tid, threads, a_first=0):
        """T[r] = A[bh, first + r] as float32 rows of STRIDE, for r < rows; zeros past
        nrows (the sequence) and past d. One flat address per element (ptx.flat_load).
        ``a_first``: the sequence's first row in a packed array read as it is (else 0)."""
        base = position(A, bh, a_first + first, nrows, d)
        step = A.shape[1] * d if ROWS else row_step(A, d)
        if COLUMNS and threads % DP == 0:
            # each thread keeps one column k and steps down the rows: no division per
            # element, and the address grows by a fixed amount (packed rows: step is known
            # only at run time)
            k = tid % DP
            at = base + (tid // DP) * step + k
            for r in range(tid // DP, rows, threads // DP):
                inside = first + r < nrows and k < d
                T[U(r * STRIDE + k)] = acc(flat_load(A, U(at))) if inside else ZERO
                at += (threads // DP) * step
            return
        for idx in range(tid, rows * DP, threads):
            r = idx // DP
            k = idx % DP
            inside = first + r < nrows and k < d
            T[U(r * STRIDE + k)] = acc(flat_load(A, U(base + r * step + k))) if inside else ZERO

    @cuda.jit(device=True, inline=True)
    def stage_pairs(T, A, bh, first, nrows, rows, tid, threads, a_first=0):
        """As stage, but split once here: T[r] holds the big parts, T[rows + r] the small
        ones (load_pair reads them)."""
        base = position(A, bh, a_first + first, nrows, d)
        step = A.shape[1] * d if ROWS else row_step(A, d)
        if COLUMNS and threads % DP == 0:
            k = tid % DP            # one column per thread, as stage
            at = base + (tid // DP) * step + k
            for r in range(tid // DP, rows, threads // DP):
                inside = first + r < nrows and k < d
                big, small = split_finite(acc(flat_load(A, U(at))) if inside else ZERO)
                at += (threads // DP) * step
                T[U(r * STRIDE + k)] = big
                T[U((rows + r) * STRIDE + k)] = small
            return
        for idx in range(tid, rows * DP, threads):
            r = idx // DP
            k = idx % DP
            inside = first + r < nrows and k < d
            big, small = split_finite(acc(flat_load(A, U(base + r * step + k))) if inside
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

    return V6Helpers(split_finite, stage, a_fragment, mma3, load_split, stage_pairs)


def _streamed_tile_steps(d, pairs, rows, varlen=False, packed_rows=False, columns=True):
    """(stage, load) for the tiles a backward v6 kernel streams (``rows`` rows each):
    staged plain and split where read (load_split), or, with ``pairs``, split once as
    staged (stage_pairs) and read as (big, small); ``varlen``, ``packed_rows``,
    ``columns`` as _make_v6_helpers'."""
    helpers = _make_v6_helpers(d, varlen, packed_rows, columns)
    split_finite, stage = helpers.split_finite, helpers.stage
    load_split, stage_pairs = helpers.load_split, helpers.stage_pairs
    if not pairs:
        return StreamedTileSteps(stage, load_split)
    _, STRIDE = v5_head_dim(d)
    SMALL = rows * STRIDE

    @cuda.jit(device=True, inline=True)
    def load_pair(T, n):
        """The (big, small) parts of element n of a tile staged by stage_pairs."""
        return T[U(n)], T[U(n + SMALL)]

    return StreamedTileSteps(stage_pairs, load_pair)


# What _variant_flags returns: the compile-time switches of a variant in backward v6.
VariantFlags = namedtuple("VariantFlags", "window tile_table scores by_element")


def _variant_flags(variant):
    """Which variant steps backward v6 compiles in: the band's left bound (window), the
    tile-table skip, ``score()`` per visible entry (scores: softcap, ALiBi, a bias,
    score_mod), and ``visible()`` per entry (by_element: a window, a boolean attn_mask or
    mask_mod; without them the causal test and the sequence ends are all there is)."""
    scores = (variant.softcap or variant.alibi or variant.mask == "bias"
              or variant.score_mod is not None)
    masks = variant.mask == "bool" or variant.mask_mod is not None
    return VariantFlags(variant.window, variant.tile_table, scores, variant.window or masks)


@functools.lru_cache(maxsize=None)
def _make_entry(causal, variant):
    """``entry``: P and dS of one (row, col) of a tile with a variant, for both v6 kernels
    (plain attention keeps its two lines inline: as a call they took more registers).

    entry(s, dp, L2, D_r, b, h, row, col, Sq, Sk, scale_log2, softmax_scale, causal_offset,
          window_lo, softcap, slopes, attn_mask) -> (p, ds)

    s and dp are the unscaled q.k and dO.v, L2 the row's logsumexp times log2(e) and D_r
    its rowsum(dO * O). An entry that is not visible (past the sequences, the causal
    bound, or ``variant``'s masks) has p = ds = 0; else p = exp2(s scale log2(e) - L2)
    (Alg.2 l.11), ds = p (dp - D_r) (l.14). With a score modifier (variants.py) p =
    exp(score - L) of the modified score and ds is times d(score)/ds; a score of -inf
    has p = 0 without an exp (its row may have L = -inf)."""
    from ..ptx import exp2_approx      # inline PTX (simulator: simulated.py)
    visible, score = make_variant_functions(variant, causal, "float32")
    flags = _variant_flags(variant)
    SCORES, BY_ELEMENT = flags.scores, flags.by_element
    acc = acc_type("float32")
    ZERO = acc(0)
    NEG_INF = acc(-math.inf)
    LOG2E_ACC = acc(LOG2E)

    @cuda.jit(device=True, inline=True)
    def entry(s, dp, L2, D_r, b, h, row, col, Sq, Sk, scale_log2, softmax_scale,
              causal_offset, window_lo, softcap, slopes, attn_mask):
        if BY_ELEMENT:
            seen = row < Sq and visible(b, h, row, col, Sk, causal_offset, window_lo,
                                        attn_mask)
        else:
            seen = row < Sq and col < Sk and (not causal or col <= row + causal_offset)
        if not SCORES:
            p = exp2_approx(s * scale_log2 - L2) if seen else ZERO
            ds = p * (dp - D_r) if seen else ZERO
            return p, ds
        p = ZERO
        ds = ZERO
        if seen:
            sc, dsc = score(s * softmax_scale, b, h, row, col, Sq, Sk, softcap, slopes,
                            attn_mask)
            if sc != NEG_INF:
                p = exp2_approx(sc * LOG2E_ACC - L2)
                ds = p * (dp - D_r) * dsc
        return p, ds

    return entry


@functools.lru_cache(maxsize=None)
def make_backward_dkdv_v6(Br, Bc, d, causal, chunk=None, pairs=False, gqa=False,
                          variant=PLAIN):
    """v6 dK/dV kernel: v5's, made cheaper where v5 spends its instructions (finite
    inputs, float32 accumulation, d <= 128; v5's shared memory, or with ``pairs``
    Qi and dOi twice as long).

    * Splits on the bits. Every operand is still split into its TF32 parts where it is
      read, but with ``tf32_round_finite`` (two integer instructions where the cvt takes
      about five): the call has checked that the inputs are finite (nonfinite.py), and
      P^T and dS^T are then finite too.
    * Each A fragment serves the whole chunk. S^T and dP^T run over the head dim on the
      outside and the chunk's n-tiles (chunk / 8) inside, so a fragment of Kj and Vj is
      loaded and split once per chunk instead of once per n-tile, and the n-tiles' sums
      are independent (the tensor cores need not wait for one before the next).
    * Staging without the index arithmetic: one flat address per element
      (ptx.flat_load), and no L test per element (with finite inputs, the q and dO of a
      row that sees no key only ever meet P = 0).
    * exp2 with log2(e) folded into the scale and into L_i (as backward v4), by
      ptx.exp2_approx (ex2.approx.ftz.f32, as the forward kernels: math.exp2 wraps the
      same instruction in a range test and two multiplies that keep results below 2^-126
      as subnormals; here those are 0, and every other result is the same).

    ``chunk``: the query rows of Qi a step takes (a multiple of 8 dividing Br; None:
    V6_CHUNK); v6's plan gives V6_CHUNKS (backward_v6_chunk).
    ``pairs``: Qi and dOi, which every warp reads, are split once as they are staged
    and kept as (big, small) pairs: twice their shared memory.

    What was tried and dropped (lab/runs/2026-12-01/36_bwd_v6_sweep.txt): storing every
    tile as (big, small) pairs, split once as it is staged (forward v6's way). It doubles
    the shared memory, so fewer warps fit an SM, and it ran at 0.66x v4's speed at best
    (d = 64; 0.39x at d = 128). ``pairs`` does it for Qi and dOi only, the tiles all the
    block's warps read (each warp reads its own rows of Kj and Vj): with Br halved, in
    the same shared memory (lab/runs/2026-12-01/63_bwd_pairs_d64.txt,
    63_bwd_pairs_d128.txt).

    ``variant`` (kernels/variants.py) adds masks and score modifiers, as backward v1's:
    each (row, col) of P^T and dS^T that ``visible`` hides is 0, a visible one takes
    P = exp(s - L) of the modified score s and dS times d(score)/ds; with a window the
    Q tiles walked are the band's, and with a tile table the tiles it marks empty are
    skipped (the same test for every thread of the block, so the barriers stay matched).
    Plain attention compiles none of it and computes the same bits as before.

    Dropout (``variant.dropout``): z = keep_scale where the forward kept (query row, key)
    (the forward's keep mask, asked again), 0 where it dropped it; dP^T is multiplied by
    z before dS^T = P^T (dP^T - D), and P^T by z after (dVj sums the dropped
    probabilities). In this kernel's S^T fragments a thread holds keys g and g + 8 of its
    warp's 16 and query rows 2t and 2t + 1 of each n-tile: its four entries lie in four
    different blocks of four keys (Philox counters), but the four lanes of the same t
    whose g share g // 4 need the same four blocks. Each computes one and the four swap
    them by shuffles (variants.make_dropout's ``kept_keys``): one Philox call per lane
    and n-tile, where one per entry made four and took the kernel from 167 to 255
    registers (ptxas, sm_90, d = 64).

    Launch: grid (ceil(Sk / Bc), B * Hkv), block (2 * Bc,), END * 4 bytes of dynamic
    shared memory (``dkdv_v5_shared_layout(Br, Bc, d, pairs)``). ``gqa`` (Hkv < Hq): the
    block walks the Q tiles of each query head of its K/V head's group in turn, in a
    fixed order, adding into the same registers, so dK and dV are summed over the group
    without atomics and are the same bits on every run. It is compile-time and one flat
    loop over (query head, Q tile) pairs: ptxas (sm_90, float32, d = 64, (64, 64),
    causal) gave the plain kernel 253 registers instead of 166 with a loop over the group
    around the loop over Q tiles, and 171 with the flat loop compiled in for group = 1.

    The work is ``make_dkdv_v6_work``'s (an inline device function); this kernel runs it
    without a dQ step, which backward v8 (v8_atomic_dq.py) adds.
    """
    work = make_dkdv_v6_work(Br, Bc, d, causal, chunk, pairs, gqa, variant,
                             packed_rows=variant.varlen)

    @cuda.jit(**jit_options(dkdv_register_cap(variant, d)))
    def backward_dkdv_v6(Q, K, V, dO, L, D, dK, dV, softmax_scale, causal_offset, window_lo,
                         Hq, group, softcap, slopes, attn_mask, tiles, seed_lo, seed_hi,
                         keep_threshold, keep_scale, seqs):
        # dK stands in for the dQ argument, which the work without a dQ step never reads
        work(Q, K, V, dO, L, D, dK, dK, dV, softmax_scale, causal_offset, window_lo, Hq, group,
             softcap, slopes, attn_mask, tiles, seed_lo, seed_hi, keep_threshold, keep_scale,
             seqs)

    return backward_dkdv_v6


# What backward v8 (v8_atomic_dq.py) gives make_dkdv_v6_work: the device functions of its
# dQ step, by name (their contract is make_dkdv_v6_work's docstring).
DqStep = namedtuple("DqStep", "wait keep add")


@functools.lru_cache(maxsize=None)
def make_dkdv_v6_work(Br, Bc, d, causal, chunk=None, pairs=False, gqa=False, variant=PLAIN,
                      dq_step=None, accumulate=False, packed_rows=False):
    """The work of backward v6's dK/dV kernel (make_backward_dkdv_v6 says what it does), as
    an inline device function of the kernel's arguments with dQ added before dK:

        work(Q, K, V, dO, L, D, dQ, dK, dV, softmax_scale, causal_offset, window_lo, Hq,
             group, softcap, slopes, attn_mask, tiles, seed_lo, seed_hi, keep_threshold,
             keep_scale, seqs)

    ``dq_step``: None (v6: nothing of it is compiled and dQ is never read, so the kernel's
    PTX is what it was before the hook existed), or a DqStep of three device functions
    that backward v8 makes (v8_atomic_dq.py), called for every chunk of Qi, the same
    calls by every thread of the block (their barriers stay matched):

        wait()                           after S^T and dP^T, before any dS^T is kept
        keep(smem, r, c, ds)             each entry of the thread's dS^T fragment:
                                         query r of the chunk, key c of the tile
        add(smem, Kj, dQ, bh, row0, Sq, tid, softmax_scale)
                                         after dKj and dVj: dQ[bh, row0 + r] for the
                                         chunk's rows, from the kept dS and Kj

    ``smem`` is the kernel's dynamic shared memory, whose floats from
    ``dkdv_v5_shared_layout(Br, Bc, d, pairs).END`` on are the step's; with a packed
    batch dQ is cut to the block's sequence as Q is.

    ``accumulate``: False (v6: each chunk's dVj and dKj products are summed from zero, the
    big*big ones in c, f and the small ones in e, h, and then added, dv += c + e), or True
    (backward v10, v10_mma_accumulate.py): the running dv and dk are the C operand of the
    big*big products, and the small ones, still summed from zero per chunk, are added
    after them (dv = c + e): one FADD per element and chunk instead of two. Not compiled
    when False: v6's PTX is what it was before the switch existed.

    ``packed_rows`` (a packed batch, ``variant.varlen``): the packed (total, heads, d)
    arrays as they are, each row index plus the sequence's first row, on a (tiles,
    heads, batch) grid (kernels/sequences.py's packed rows: v6's and v10's packed
    builds); else the packed arrays' per-sequence views (backward v8's packed build,
    whose dQ step adds into a view).
    """
    from ..ptx import exp2_approx      # inline PTX (simulator: simulated.py)
    ROWS = packed_rows and variant.varlen
    assert not (ROWS and dq_step is not None), "backward v8 reads packed batches by views"
    columns = staging_by_columns("dkdv", d, pairs, ROWS)
    helpers = _make_v6_helpers(d, variant.varlen, ROWS, columns)
    split_finite, stage, a_fragment = helpers.split_finite, helpers.stage, helpers.a_fragment
    mma3, load_split = helpers.mma3, helpers.load_split
    streamed = _streamed_tile_steps(d, pairs, Br, variant.varlen, ROWS, columns)
    stage_q, load_q = streamed.stage, streamed.load
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
    entry = _make_entry(causal, variant)
    flags = _variant_flags(variant)
    WINDOW, TILE_TABLE = flags.window, flags.tile_table
    PLAIN_ENTRY = not (flags.scores or flags.by_element)
    DROPOUT = variant.dropout
    kept_keys = make_dropout(variant).kept_keys
    GQA = gqa
    q_tile_range = make_q_tile_range(Br, Bc, causal, WINDOW)

    VARLEN = variant.varlen
    sequences = make_sequences(VARLEN)
    locate, cut, uniform_range = sequences.locate, sequences.cut, sequences.uniform_range

    DQ = dq_step is not None
    dq_wait, dq_keep, dq_add = dq_step if DQ else (None, None, None)
    ACCUMULATE = accumulate

    @cuda.jit(device=True, inline=True)
    def work(Q, K, V, dO, L, D, dQ, dK, dV, softmax_scale, causal_offset, window_lo, Hq, group,
             softcap, slopes, attn_mask, tiles, seed_lo, seed_hi, keep_threshold, keep_scale,
             seqs):
        if ROWS:
            # A packed batch read as it is (kernels/sequences.py): K/V head and sequence
            # from the (tiles, heads, batch) grid, each row index plus the sequence's
            # first row (q0, k0)
            h_kv = cuda.blockIdx.y
            b = cuda.blockIdx.z
            bh_kv, b_mem = h_kv, 0
            j = cuda.blockIdx.x
            q0, k0, Sq, Sk, shift = locate(seqs, b, Q.shape[0], K.shape[0])
            if j * Bc >= Sk:
                return                  # past this sequence: the whole block, no barrier yet
        else:
            bh_kv = cuda.blockIdx.y     # b * Hkv + h_kv: the K/V head
            b = bh_kv // (Hq // group)
            h_kv = bh_kv % (Hq // group)
            j = cuda.blockIdx.x
            # A packed batch by views: this block's sequence, as a batch of one
            q0, k0, Sq, Sk, shift = locate(seqs, b, Q.shape[1], K.shape[1])
            b_mem = b                   # the batch index of the arrays' memory
            if VARLEN:
                if j * Bc >= Sk:
                    return              # past this sequence: the whole block, no barrier yet
                bh_kv, b_mem = h_kv, 0
            Q, dO, L, D = cut(Q, q0, Sq), cut(dO, q0, Sq), cut(L, q0, Sq), cut(D, q0, Sq)
            K, V, dK, dV = cut(K, k0, Sk), cut(V, k0, Sk), cut(dK, k0, Sk), cut(dV, k0, Sk)
            if DQ:
                dQ = cut(dQ, q0, Sq)
            q0 = int64(0)               # the rows of the (cut) arrays from here on
            k0 = int64(0)
        causal_offset += shift
        window_lo += shift
        tid = cuda.threadIdx.x
        lane = tid % 32
        g = lane // 4
        t = lane % 4
        w0 = (tid // 32) * 16
        key0 = j * Bc + w0 + g
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
        zs = cuda.local.array(4, acc)           # dropout: keep_scale or 0 per entry

        stage(Kj, K, bh_kv, j * Bc, Sk, Bc, tid, THREADS, k0)
        stage(Vj, V, bh_kv, j * Bc, Sk, Bc, tid, THREADS, k0)
        for x in range(ACC):
            dk[x] = ZERO
            dv[x] = ZERO

        # The Q tiles with a row that sees a column of this tile (bands.py); GQA: those of
        # each query head of this K/V head's group in turn, a fixed order, so the sums are
        # bitwise reproducible.
        i_start, i_end = q_tile_range(j, Sq, causal_offset, window_lo)
        if ROWS:
            i_start, i_end = uniform_range(i_start, i_end)  # packed: known uniform
        n_i = i_end - i_start
        for n in range(0 if GQA else i_start, group * n_i if GQA else i_end):
            if GQA:
                h = h_kv * group + n // n_i     # the query head
                bh = b_mem * Hq + h
                i = i_start + n % n_i
            else:                           # n is the Q tile
                h = h_kv
                bh = bh_kv
                i = n
            if TILE_TABLE and not tiles[bh, i, j]:
                continue                # the mask leaves this tile empty (variants.py)
            # Wait until every warp has finished reading the previous Qi, dOi, L_i, D_i
            # (on the first pass: until Kj and Vj are complete).
            cuda.syncthreads()
            stage_q(Qi, Q, bh, i * Br, Sq, Br, tid, THREADS, q0)
            stage_q(dOi, dO, bh, i * Br, Sq, Br, tid, THREADS, q0)
            for r in range(tid, Br, THREADS):
                row = i * Br + r
                L_i[r] = L[U(bh), U(q0 + row)] * LOG2E_ACC if row < Sq else ZERO
                D_i[r] = D[U(bh), U(q0 + row)] if row < Sq else ZERO
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
                if DQ:
                    dq_wait()
                # P^T and dS^T on the visible pairs, split for the tensor cores
                for nt in range(NT):
                    if DROPOUT:
                        # the forward's keep mask for the lane's four entries, one Philox
                        # call per lane (kept_keys, a warp collective: see the docstring)
                        kept0, kept1, kept2, kept3 = kept_keys(
                            seed_lo, seed_hi, keep_threshold, b, h,
                            i * Br + r0 + nt * 8 + 2 * t, key0, g)
                        zs[0] = keep_scale if kept0 else ZERO
                        zs[1] = keep_scale if kept1 else ZERO
                        zs[2] = keep_scale if kept2 else ZERO
                        zs[3] = keep_scale if kept3 else ZERO
                    for x in range(4):
                        r = r0 + nt * 8 + 2 * t + x % 2
                        row = i * Br + r
                        col = key0 + 8 * (x // 2)
                        y = nt * 4 + x
                        if DROPOUT:
                            # dP^T times z = keep_scale or 0, in dp alone
                            z = zs[x]
                            dp[y] = (dp[y] + dpe[y]) * z
                            dpe[y] = ZERO
                        if PLAIN_ENTRY:
                            seen = row < Sq and col < Sk and (not causal
                                                             or col <= row + causal_offset)
                            p = (exp2_approx((s[y] + se[y]) * scale_log2 - L_i[r]) if seen
                                 else ZERO)
                            ds = p * ((dp[y] + dpe[y]) - D_i[r]) if seen else ZERO
                        else:
                            p, ds = entry(s[y] + se[y], dp[y] + dpe[y], L_i[r], D_i[r], b,
                                          h, row, col, Sq, Sk, scale_log2, softmax_scale,
                                          causal_offset, window_lo, softcap, slopes,
                                          attn_mask)
                        if DROPOUT:
                            p = p * z           # dVj sums the dropped probabilities
                        pb[y], ps[y] = split_finite(p)
                        gb[y], gs[y] = split_finite(ds)
                        if DQ:
                            dq_keep(smem, r - r0, w0 + g + 8 * (x // 2), ds)
                # dVj += P^T dOi, dKj += dS^T Qi
                for nd in range(KS):
                    if ACCUMULATE:
                        # v10: the big*big products go straight into the running sums
                        c0 = dv[nd * 4]
                        c1 = dv[nd * 4 + 1]
                        c2 = dv[nd * 4 + 2]
                        c3 = dv[nd * 4 + 3]
                        e0 = ZERO
                        e1 = ZERO
                        e2 = ZERO
                        e3 = ZERO
                        f0 = dk[nd * 4]
                        f1 = dk[nd * 4 + 1]
                        f2 = dk[nd * 4 + 2]
                        f3 = dk[nd * 4 + 3]
                        h0 = ZERO
                        h1 = ZERO
                        h2 = ZERO
                        h3 = ZERO
                    else:
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
                    if ACCUMULATE:
                        # the small products, summed from zero, added by FADD (module
                        # docstring of v10_mma_accumulate.py: not into C)
                        dv[nd * 4] = c0 + e0
                        dv[nd * 4 + 1] = c1 + e1
                        dv[nd * 4 + 2] = c2 + e2
                        dv[nd * 4 + 3] = c3 + e3
                        dk[nd * 4] = f0 + h0
                        dk[nd * 4 + 1] = f1 + h1
                        dk[nd * 4 + 2] = f2 + h2
                        dk[nd * 4 + 3] = f3 + h3
                    else:
                        dv[nd * 4] += c0 + e0
                        dv[nd * 4 + 1] += c1 + e1
                        dv[nd * 4 + 2] += c2 + e2
                        dv[nd * 4 + 3] += c3 + e3
                        dk[nd * 4] += f0 + h0
                        dk[nd * 4 + 1] += f1 + h1
                        dk[nd * 4 + 2] += f2 + h2
                        dk[nd * 4 + 3] += f3 + h3
                if DQ:
                    dq_add(smem, Kj, dQ, bh, i * Br + r0, Sq, tid, softmax_scale)

        for nd in range(KS):
            for x in range(4):
                col = key0 + 8 * (x // 2)
                k = nd * 8 + 2 * t + x % 2
                if col < Sk and k < d:
                    if ROWS:
                        dK[U(k0 + col), U(bh_kv), U(k)] = dk[nd * 4 + x] * softmax_scale
                        dV[U(k0 + col), U(bh_kv), U(k)] = dv[nd * 4 + x]
                    else:
                        dK[U(bh_kv), U(col), U(k)] = dk[nd * 4 + x] * softmax_scale
                        dV[U(bh_kv), U(col), U(k)] = dv[nd * 4 + x]

    return work


@functools.lru_cache(maxsize=None)
def make_backward_dq_v6(Br, Bc, d, causal, chunk=None, pairs=False, gqa=False,
                        variant=PLAIN):
    """v6 dQ kernel: v5's with v6's changes (see make_backward_dkdv_v6; finite
    inputs); ``chunk``: the keys of Kj a step takes; ``pairs``: Kj and Vj split
    once as staged (as make_backward_dkdv_v6's Qi and dOi); ``gqa``, ``variant``: as
    there (dropout: dP times keep_scale or 0 before dS = P (dP - D)). Launch: grid
    (ceil(Sq / Br), B * Hq), block (2 * Br,), END * 4 bytes (``dq_v5_shared_layout(Br,
    Bc, d, pairs)``); with ``gqa`` query head h reads K/V head h // group of its batch.
    The work is ``make_dq_v6_work``'s (an inline device function), as the dK/dV
    kernel's."""
    work = make_dq_v6_work(Br, Bc, d, causal, chunk, pairs, gqa, variant,
                           packed_rows=variant.varlen)

    @cuda.jit(**jit_options())
    def backward_dq_v6(Q, K, V, dO, L, D, dQ, softmax_scale, causal_offset, window_lo, Hq,
                       group, softcap, slopes, attn_mask, tiles, seed_lo, seed_hi,
                       keep_threshold, keep_scale, seqs):
        work(Q, K, V, dO, L, D, dQ, softmax_scale, causal_offset, window_lo, Hq, group,
             softcap, slopes, attn_mask, tiles, seed_lo, seed_hi, keep_threshold, keep_scale,
             seqs)

    return backward_dq_v6


@functools.lru_cache(maxsize=None)
def make_dq_v6_work(Br, Bc, d, causal, chunk=None, pairs=False, gqa=False, variant=PLAIN,
                    accumulate=False, packed_rows=False):
    """The work of backward v6's dQ kernel (make_backward_dq_v6 says what it does), as an
    inline device function of the kernel's arguments:

        work(Q, K, V, dO, L, D, dQ, softmax_scale, causal_offset, window_lo, Hq, group,
             softcap, slopes, attn_mask, tiles, seed_lo, seed_hi, keep_threshold,
             keep_scale, seqs)

    ``accumulate``: as make_dkdv_v6_work's, for dq (backward v10: the running dq is the C
    operand of the big*big products; False compiles v6's sums); ``packed_rows``: as
    make_dkdv_v6_work's."""
    from ..ptx import exp2_approx      # inline PTX (simulator: simulated.py)
    ROWS = packed_rows and variant.varlen
    columns = staging_by_columns("dq", d, pairs, ROWS)
    helpers = _make_v6_helpers(d, variant.varlen, ROWS, columns)
    split_finite, stage, a_fragment = helpers.split_finite, helpers.stage, helpers.a_fragment
    mma3, load_split = helpers.mma3, helpers.load_split
    streamed = _streamed_tile_steps(d, pairs, Bc, variant.varlen, ROWS, columns)
    stage_kv, load_kv = streamed.stage, streamed.load
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
    entry = _make_entry(causal, variant)
    flags = _variant_flags(variant)
    WINDOW, TILE_TABLE = flags.window, flags.tile_table
    PLAIN_ENTRY = not (flags.scores or flags.by_element)
    DROPOUT = variant.dropout
    kept_rows = make_dropout(variant).kept_rows
    GQA = gqa
    kv_tile_range = make_kv_tile_range(Br, Bc, causal, WINDOW)

    VARLEN = variant.varlen
    sequences = make_sequences(VARLEN)
    locate, cut, uniform_range = sequences.locate, sequences.cut, sequences.uniform_range

    ACCUMULATE = accumulate

    @cuda.jit(device=True, inline=True)
    def work(Q, K, V, dO, L, D, dQ, softmax_scale, causal_offset, window_lo, Hq, group,
             softcap, slopes, attn_mask, tiles, seed_lo, seed_hi, keep_threshold, keep_scale,
             seqs):
        if ROWS:
            # A packed batch read as it is (kernels/sequences.py): query head and
            # sequence from the (tiles, heads, batch) grid, each row index plus the
            # sequence's first row (q0, k0)
            h = cuda.blockIdx.y
            b = cuda.blockIdx.z
            bh, bh_kv = h, h // group
            i = cuda.blockIdx.x
            q0, k0, Sq, Sk, shift = locate(seqs, b, Q.shape[0], K.shape[0])
            if i * Br >= Sq:
                return                  # past this sequence: the whole block, no barrier yet
        else:
            bh = cuda.blockIdx.y        # b * Hq + h: the query head
            b = bh // Hq
            h = bh % Hq
            bh_kv = b * (Hq // group) + h // group if GQA else bh   # the K/V head it reads
            i = cuda.blockIdx.x
            # A packed batch by views: this block's sequence, as a batch of one
            q0, k0, Sq, Sk, shift = locate(seqs, b, Q.shape[1], K.shape[1])
            if VARLEN:
                if i * Br >= Sq:
                    return              # past this sequence: the whole block, no barrier yet
                bh, bh_kv = h, h // group
            Q, dO, L, D, dQ = (cut(Q, q0, Sq), cut(dO, q0, Sq), cut(L, q0, Sq),
                               cut(D, q0, Sq), cut(dQ, q0, Sq))
            K, V = cut(K, k0, Sk), cut(V, k0, Sk)
            q0 = int64(0)               # the rows of the (cut) arrays from here on
            k0 = int64(0)
        causal_offset += shift
        window_lo += shift
        tid = cuda.threadIdx.x
        lane = tid % 32
        g = lane // 4
        t = lane % 4
        w0 = (tid // 32) * 16
        row0 = i * Br + w0 + g
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
        stage(Qi, Q, bh, i * Br, Sq, Br, tid, THREADS, q0)
        stage(dOi, dO, bh, i * Br, Sq, Br, tid, THREADS, q0)
        for half in range(2):
            row = row0 + 8 * half
            Lr[half] = L[U(bh), U(q0 + row)] * LOG2E_ACC if row < Sq else ZERO
            Dr[half] = D[U(bh), U(q0 + row)] if row < Sq else ZERO
        for x in range(ACC):
            dq[x] = ZERO

        # The K/V tiles that some row of this tile sees (bands.py)
        j_start, j_end = kv_tile_range(i, Sk, causal_offset, window_lo)
        if ROWS:
            j_start, j_end = uniform_range(j_start, j_end)  # packed: known uniform
        for j in range(j_start, j_end):
            if TILE_TABLE and not tiles[bh, i, j]:
                continue                # the mask leaves this tile empty (variants.py)
            # Wait until every warp has finished reading the previous Kj and Vj (on the
            # first pass: until Qi and dOi are complete).
            cuda.syncthreads()
            stage_kv(Kj, K, bh_kv, j * Bc, Sk, Bc, tid, THREADS, k0)
            stage_kv(Vj, V, bh_kv, j * Bc, Sk, Bc, tid, THREADS, k0)
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
                    if DROPOUT:
                        # dP times z = keep_scale or 0, the forward's keep mask: a thread
                        # holds keys 2t and 2t + 1 of rows g and g + 8, each pair of lanes
                        # one Philox call each (kept_rows, a warp collective)
                        keeps = kept_rows(seed_lo, seed_hi, keep_threshold, b, h, row0,
                                          j * Bc + c_0 + nt * 8 + 2 * t, t)
                        for x in range(4):              # y = nt * 4 + x, as below
                            y = nt * 4 + x
                            dp[y] = (dp[y] + dpe[y]) * (keep_scale if keeps[x] else ZERO)
                            dpe[y] = ZERO
                    for x in range(4):
                        half = x // 2
                        row = row0 + 8 * half
                        col = j * Bc + c_0 + nt * 8 + 2 * t + x % 2
                        y = nt * 4 + x
                        if PLAIN_ENTRY:
                            seen = row < Sq and col < Sk and (not causal
                                                             or col <= row + causal_offset)
                            p = (exp2_approx((s[y] + se[y]) * scale_log2 - Lr[half]) if seen
                                 else ZERO)
                            ds = p * ((dp[y] + dpe[y]) - Dr[half]) if seen else ZERO
                        else:
                            _, ds = entry(s[y] + se[y], dp[y] + dpe[y], Lr[half], Dr[half], b,
                                          h, row, col, Sq, Sk, scale_log2, softmax_scale,
                                          causal_offset, window_lo, softcap, slopes, attn_mask)
                        gb[y], gs[y] = split_finite(ds)
                for nd in range(KS):
                    if ACCUMULATE:
                        # v10: the big*big products go straight into the running sums
                        c0 = dq[nd * 4]
                        c1 = dq[nd * 4 + 1]
                        c2 = dq[nd * 4 + 2]
                        c3 = dq[nd * 4 + 3]
                        e0 = ZERO
                        e1 = ZERO
                        e2 = ZERO
                        e3 = ZERO
                    else:
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
                    if ACCUMULATE:
                        dq[nd * 4] = c0 + e0        # the small products, by FADD
                        dq[nd * 4 + 1] = c1 + e1
                        dq[nd * 4 + 2] = c2 + e2
                        dq[nd * 4 + 3] = c3 + e3
                    else:
                        dq[nd * 4] += c0 + e0
                        dq[nd * 4 + 1] += c1 + e1
                        dq[nd * 4 + 2] += c2 + e2
                        dq[nd * 4 + 3] += c3 + e3

        for nd in range(KS):
            for x in range(4):
                row = row0 + 8 * (x // 2)
                k = nd * 8 + 2 * t + x % 2
                if row < Sq and k < d:
                    if ROWS:
                        dQ[U(q0 + row), U(bh), U(k)] = dq[nd * 4 + x] * softmax_scale
                    else:
                        dQ[U(bh), U(row), U(k)] = dq[nd * 4 + x] * softmax_scale

    return work


# --- the launch contract ------------------------------------------------------------

# v6's fallback rule (default_backward_v6_plan, when its table's tiles do not fit): v5's
# layout and candidates, within the device's own maximum instead (227 KB on the H200):
# (64, 64) at d <= 128 there (70 KB at d = 64; 135 KB, one block per SM, at d = 128,
# still faster than (64, 32) at two blocks per SM: lab/runs/2026-12-01/37_bwd_v6_sweep.txt).
# v6's default plan, per kernel: (Br, Bc, pairs), pairs meaning its streamed tiles (the
# dK/dV kernel's Qi and dOi, the dQ kernel's Kj and Vj) are split once as staged and kept
# as TF32 pairs (make_backward_dkdv_v6). Each kernel timed alone (scripts/bwd_kernels.py):
# * d > 64 (BWD_V6_WIDE): one block of 8 warps per SM (255 registers a thread). Wide
#   tiles first (lab/runs/2026-12-01/57_bwd_kernels.txt, (2, 16, 4096, 128)): dK/dV
#   (64, 128) 20.04 ms against (64, 64)'s 34.58, dQ (128, 64) 14.16 against 23.76. Then
#   the streamed side narrowed to 32 to make room for the pairs (63_bwd_pairs_d128.txt):
#   dK/dV (32, 128) with pairs 18.06 / 9.70 ms (not causal / causal) against (64, 128)'s
#   20.08 / 10.76, dQ (128, 32) with pairs 12.72 / 7.13 against (128, 64)'s 14.15 / 7.66.
# * d <= 64 (BWD_V6_NARROW, by causal): three blocks of 4 warps per SM at 70 KB (168
#   registers); every wider tile was slower (57_bwd_kernels.txt). With pairs at the same
#   70 KB (63_bwd_pairs_d64.txt, (2, 16, 4096, 64)): the dQ kernel (64, 32) 6.50 / 3.77 ms
#   against (64, 64)'s 6.90 / 3.97; the dK/dV kernel (32, 64) 9.26 ms against 9.82 without
#   the mask, but 5.99 against 5.46 with it, so causal keeps (64, 64) plain. (64, 64) with
#   pairs (105 KB, two blocks per SM) was slower for both kernels: 10.86 and 7.63.
# Float32 on the H200: at d <= 64 dQ (64, 32) with pairs, dK/dV (32, 64) with pairs,
# causal (64, 64) without; at d > 64 (32, 128) for dK/dV and (128, 32) for dQ, both with
# pairs (8 warps a block). Float16 inputs: (64, 64) at d <= 64, (64, 128) and (128, 64)
# above, without pairs. A caller's tiles (check_backward_v6_tiles) run without pairs.
BWD_V6_WIDE = {"dkdv": (32, 128, True), "dq": (128, 32, True)}
BWD_V6_WIDE_MIN_HEAD_DIM = 65
# On the simulator (kernels/simulated.py) each kernel streams tiles of 16 rows past 32
# of its own: fewer warps a block (every mma is a rendezvous of Python threads), and the
# GPU rule's choice of split pairs, so the simulator runs the pairs' code too.
BWD_V6_SIM = {"dkdv": (16, 32), "dq": (32, 16)}
BWD_V6_NARROW = {False: {"dkdv": (32, 64, True), "dq": (64, 32, True)},
                 True: {"dkdv": (64, 64, False), "dq": (64, 32, True)}}
# Float16 inputs keep 57_bwd_kernels.txt's tiles without pairs (by width): the pairs were
# timed with float32 inputs only, and the float16 dQ kernel with pairs at d = 128, causal,
# needs 8 bytes of spill under CUDA 13.5's ptxas (tests/ptx_check.py), where its tiles
# without pairs need none.
BWD_V6_FLOAT16 = {"wide": {"dkdv": (64, 128, False), "dq": (128, 64, False)},
                  "narrow": {"dkdv": (64, 64, False), "dq": (64, 64, False)}}


def tiles_fit(d, where):
    """Whether a v6 tile (BWD_V5_CANDIDATES) fits head dim ``d`` within the shared memory
    of a block ``where`` ("gpu": this device's own maximum)."""
    return bwd_v5_tiles_within(d, bwd_v5_target("v6", where)) is not None


def default_backward_v6_plan(d, causal, dtype, where):
    """Backward v6's default per kernel: {"dkdv": (Br, Bc, pairs), "dq": (Br, Bc, pairs)}.
    For float32 inputs BWD_V6_WIDE at d >= BWD_V6_WIDE_MIN_HEAD_DIM, BWD_V6_NARROW[causal]
    below; for float16 inputs BWD_V6_FLOAT16; where both kernels fit the shared memory of a
    block ``where``; else the v5 / v6 rule's tiles (v5_tensor_cores.py) for both kernels,
    without pairs."""
    wide = d >= BWD_V6_WIDE_MIN_HEAD_DIM
    if np.dtype(dtype) == np.float16:
        rule = BWD_V6_FLOAT16["wide" if wide else "narrow"]
    else:
        rule = BWD_V6_WIDE if wide else BWD_V6_NARROW[bool(causal)]
    if where == "simulator":    # the GPU's choice of pairs, on small tiles (BWD_V6_SIM)
        return {kind: BWD_V6_SIM[kind] + (rule[kind][2],) for kind in rule}
    limit = device_dynamic_shared_limit(where)
    if (dkdv_v5_shared_bytes(*rule["dkdv"][:2], d, rule["dkdv"][2]) <= limit
            and dq_v5_shared_bytes(*rule["dq"][:2], d, rule["dq"][2]) <= limit):
        return dict(rule)
    tiles = default_backward_v5_tiles(d, where, "v6")
    return {"dkdv": tiles + (False,), "dq": tiles + (False,)}


def check_backward_v6_tiles(tiles, d, version="v6"):
    """A caller's backward v6 tiles (``version``'s: v10 takes v6's): (Br, Bc) for both
    kernels, or ((Br, Bc), (Br, Bc)) for the dK/dV kernel and the dQ kernel. Returns
    {"dkdv": ..., "dq": ...}; ValueError names the limit."""
    try:
        nested = len(tiles) == 2 and all(isinstance(t, (tuple, list)) for t in tiles)
    except TypeError:
        nested = False
    if not nested:
        both = check_backward_v5_tiles(tiles, d, version)
        return {"dkdv": both, "dq": both}
    return {kind: check_backward_v5_tiles(t, d, version)
            for kind, t in zip(("dkdv", "dq"), tiles)}


def backward_v6_chunk(kind, Br, Bc):
    """The rows a step of backward v6's ``kind`` kernel ("dkdv" or "dq") takes of its
    streamed tile (Qi of Br rows, Kj of Bc): V6_CHUNKS, or 16 if the tile is not a
    multiple of that."""
    chunk = V6_CHUNKS[kind]
    streamed = Br if kind == "dkdv" else Bc
    return chunk if streamed % chunk == 0 else V6_CHUNK


VARIANTS = True                # takes the variant arguments (kernels/variants.py)
TILE_TABLE = True              # skips the tiles a mask leaves empty (variants.make_tile_table)
PACKED_ROWS = True             # a packed batch read as it is (kernels/sequences.py)


def plan(p, where, tiles, reason, preprocess):
    """The Plans of backward v6 for Problem ``p`` (v5's ``tensor_core_plans``): one pair
    of tiles per kernel, and its streamed tiles as split pairs or not; the dK/dV kernel
    on grid (Tc, B * Hkv), each block summing over its K/V head's group (a packed batch:
    (Tc, Hkv, B), and the dQ kernel's (Tr, Hq, B)).

    A variant with a table of visible tiles (a boolean attn_mask, mask_mod) gets one
    (Br, Bc) for both kernels, the table's (the launcher builds one table, for the last
    kernel's tiles): v6's fallback rule (v5's layout within the device's maximum) without
    pairs, or the caller's; a caller's two different pairs of tiles raise ValueError."""
    return v6_family_plans("v6", p, where, tiles, reason, preprocess)


def v6_family_plans(version, p, where, tiles, reason, preprocess):
    """``plan`` for backward ``version``, "v6" or a rung that runs v6's kernels with
    another compile-time switch (v10): the same tiles, pairs, grids and refusals, in
    ``version``'s name."""
    refusal = backward_tensor_core_refusal(version, p, where)
    if refusal is not None:
        raise ValueError(f"backward {version} cannot run this input: {refusal}")
    if p.variant.tile_table:
        if tiles is None:
            both = default_backward_v5_tiles(p.d, where, version)
            reason += (f"; tiles by the v6 fallback rule for d={p.d}, one pair for both "
                       f"kernels (they share the table of visible tiles)")
        else:
            per_kernel = check_backward_v6_tiles(tiles, p.d, version)
            both = per_kernel["dkdv"]
            if per_kernel["dq"] != both:
                raise ValueError(f"backward {version} with a boolean attn_mask or mask_mod "
                                 f"takes one (Br, Bc) for both kernels (they share the table "
                                 f"of visible tiles); got {tiles}")
            reason += "; tiles given by the caller"
        per_kernel = {"dkdv": both + (False,), "dq": both + (False,)}
    elif tiles is None:
        per_kernel = default_backward_v6_plan(p.d, p.upper, p.dtype, where)
        reason += (f"; tiles by the v6 rule for d={p.d}"
                   + (", causal" if p.upper else "") + " (each kernel its own)")
    else:
        per_kernel = {kind: t + (False,)
                      for kind, t in check_backward_v6_tiles(tiles, p.d, version).items()}
        reason += "; tiles given by the caller"
    preprocess_plan, dkdv, dq = tensor_core_plans(p, where, reason, preprocess, version,
                                                  per_kernel)
    variant = variant_description(p)
    table = TILE_TABLE_REASON if p.variant.tile_table else ""
    gqa = (f"; GQA: each block sums over the {p.group} query heads of its K/V head in a "
           f"fixed order" if p.group > 1 else "")
    dkdv = replace(dkdv, grid=(dkdv.grid[0], p.BHkv), reason=dkdv.reason + gqa + table,
                   variant=variant)
    dq = replace(dq, reason=dq.reason + table, variant=variant)
    if p.variant.varlen:    # packed rows: a (tiles, heads, batch) grid (kernels/sequences.py)
        dkdv = replace(dkdv, grid=(dkdv.grid[0], p.Hq // p.group, p.B))
        dq = replace(dq, grid=(dq.grid[0], p.Hq, p.B))
    return Plans((preprocess_plan, dkdv, dq))


def kernel(plan, p):
    """The compiled kernel of one of v6's plans (cached per compile-time parameters), with
    the chunk of ``backward_v6_chunk``, the plan's pairs, GQA or not and the Problem's
    variant."""
    kind = {"backward_dkdv_v6": "dkdv", "backward_dq_v6": "dq"}[plan.kernel]
    make = make_backward_dkdv_v6 if kind == "dkdv" else make_backward_dq_v6
    chunk = backward_v6_chunk(kind, plan.Br, plan.Bc)
    return make(plan.Br, plan.Bc, p.d, p.upper, chunk, plan.pairs, p.group > 1, p.variant)
