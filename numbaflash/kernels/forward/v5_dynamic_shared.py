"""Forward v5: v4 with its tiles in dynamic shared memory.

Parent: v4 (v4_register_blocked.py), whose static shared arrays are limited to 48 KB a
block, which holds it to (32, 16) tiles and 64-thread blocks at d = 128. v5 runs v4's
algorithm, thread layout, barriers and NaN-safety unchanged, but carves its five tiles
out of ONE dynamic shared array (``cuda.shared.array(0, acc)``) at compile-time offsets
and indexes them with unsigned flat indices (``U``, kernels/smem.py); the byte count
goes with the launch, and kernels/smem.py allows the kernel more than 48 KB (up to
227 KB a block on the H200).

What it buys: larger tiles, (128, 64, 8, 4) at d = 64 and (64, 32, 4, 2) at d = 128.
With the while loops of kernels/__init__.py: 5.86 ms against v4's 7.09 at (2, 16, 4096,
64) and 15.50 ms against 21.04 at d = 128 (lab/runs/2026-12-01/26_timing_branch.txt);
0.684x SDPA EFFICIENT at (2, 16, 4096, 64), the fastest version without tensor cores
(lab/runs/2026-12-01/48_bench_v5.txt). Costs: fewer blocks per SM at d = 128.

Variants (kernels/variants.py), as forward v2 takes them: GQA/MQA (query head h reads
K/V head h // group, nothing copied), the window's left bound as a narrower K/V tile
range (bands.py), the table of visible tiles for a boolean attn_mask or a mask_mod
(empty tiles skipped whole), and visible() / score() per entry for windows, masks and
score modifiers. Dropout: a dropped entry's P~ij counts in the row sum l but is stored
as 0 in Pij, so P~ij Vj leaves it out. All of it is compiled in only when asked for: plain
attention (with or without the causal mask) compiles to the plain kernel, bitwise the
same results.

Runs on the GPU and the simulator: the default on the simulator for plain float32 and
float16 attention with d <= 128, where the tensor-core versions cannot run, and on a GPU
whose per-block shared memory holds no v6 tile (numbaflash/policy.py).
"""

import functools
import math
from collections import namedtuple

import numpy as np
from numba import cuda

from .. import acc_type, jit_options
from ..bands import make_kv_tile_range
from ..plan import (
    DYNAMIC_LIMIT_WHY, DYNAMIC_SHARED_MEM_LIMIT, check_thread_tiles, device_dynamic_shared_limit,
    here
)
from ..sequences import make_sequences
from ..smem import U
from ..variants import PLAIN, make_dropout, make_variant_functions
from .v4_register_blocked import V4_MAX_O_REGS, V4_SIM_TILES, plan_blocked, v4_head_dim_padded

# What v5_shared_layout returns, by name.
V5Layout = namedtuple("V5Layout", "Q_AT K_AT V_AT P_AT R_AT END")


def v5_shared_layout(Br, Bc, TM, TN, d):
    """Where forward v5's five tiles sit in its one dynamic shared array: the offsets, in
    elements of the accumulator dtype, of QiT, KjT, Vj, Pij and red (v4's five static
    arrays, same shapes, stored back to back, each row by row), and the end, which is
    the array's length: (Q_AT, K_AT, V_AT, P_AT, R_AT, END). With TX = Bc // TN and DP
    = d rounded up to TX: QiT (DP, Br+1), KjT (DP, Bc+1), Vj (Bc, DP), Pij (Br, Bc+1),
    red (Br, TX). ``v5_shared_bytes`` is END times the itemsize."""
    TX = Bc // TN
    DP = (d + TX - 1) // TX * TX
    Q_AT = 0
    K_AT = Q_AT + DP * (Br + 1)
    V_AT = K_AT + DP * (Bc + 1)
    P_AT = V_AT + Bc * DP
    R_AT = P_AT + Br * (Bc + 1)
    END = R_AT + Br * TX
    return V5Layout(Q_AT, K_AT, V_AT, P_AT, R_AT, END)


@functools.lru_cache(maxsize=None)
def make_forward_v5(Br, Bc, TM, TN, d, causal, acc_dtype, variant=PLAIN):
    """v5: forward v4 with its shared memory taken from dynamic shared memory, so that a
    block's tiles may exceed the 48 KB of static shared memory (the default for plain
    float32 attention with d <= 128 on the simulator; runs on the GPU and the simulator).

    For plain attention the algorithm, thread layout, barriers and NaN-safety are v4's,
    line for line (see make_forward_v4; variants: below); what changes is where the
    five shared arrays come from. v4 declares them with ``cuda.shared.array(shape,
    dtype)``: static shared memory, sized when the kernel compiles, at most 48 KB per
    block. v5 declares ONE dynamic array, ``cuda.shared.array(0, acc)``, whose size in
    bytes is the fourth item of the launch configuration (the third is the stream):

        kernel[grid, block, 0, nbytes](Q, K, V, O, L, softmax_scale, causal_offset,
                                       window_lo, Hq, group, softcap, slopes, attn_mask, tiles,
                                       seed_lo, seed_hi, keep_threshold, keep_scale)

    Up to 48 KB that is all; above it, the compiled kernel must first be allowed more
    (kernels/smem.py, ``allow_dynamic_shared_memory``, which numbaflash/launcher.py's
    ``launch`` calls), up to the GPU's per-block maximum (227 KB on the H100/H200).

    Numba gives every ``cuda.shared.array(0, ...)`` of a kernel the same base address,
    so the tiles are carved out of the one array by hand: ``v5_shared_layout`` places
    them back to back at compile-time offsets, each tile is a 1D slice of the array (a
    view, no copy), and a 2D index [row, col] of v4 becomes [row * row_length + col].
    (A 2D view through ``reshape`` would keep v4's indexing, but on the GPU numba-cuda
    implements it with a call into a helper library, and the strides it returns are
    run-time values, so every shared-memory address would cost more arithmetic.) Under
    the simulator each slice is bounds-checked on its own, so an index that strays out
    of its tile raises IndexError instead of landing in the next tile.

    Launch: as v4: grid (Tr, B * Hq) with Tr = ceil(Sq / Br), block (TY * TX,) with TY =
    Br // TM and TX = Bc // TN; and END * itemsize bytes of dynamic shared memory (END from
    ``v5_shared_layout``).

    Variants (``variant``, kernels/variants.py; the arguments after ``causal_offset`` are
    launcher.variant_arguments'): query head h reads K/V head b * (Hq // group) + h //
    group (GQA without copying K/V); a window's left bound narrows the K/V tile range
    (bands.py); a tile the table of visible tiles marks empty is skipped whole. With a
    window, masks or a score modifier (``PER_ELEMENT``) each entry of the thread's block
    of Sij goes through ``visible()`` and ``score()``, and in the tiles that are not
    wholly visible a masked entry's P~ij is stored as HIDDEN (-1, a value no exp gives),
    so that P~ij Vj skips it without reading its row of V. Dropout (``kept``, one Philox
    call per visible entry) stores a dropped entry's P~ij as 0 after adding it to l, and
    O is multiplied by keep_scale at the end. Without them (plain attention, with or
    without the causal mask and GQA) those steps compile away and the kernel is the
    plain one.
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
    # The variant (compile-time): which steps exist. A plain kernel compiles all of them away.
    # variants.py's visible() is named "sees" here: the plain path keeps its local "visible".
    sees, score = make_variant_functions(variant, causal, acc_dtype)
    kept = make_dropout(variant).kept
    WINDOW = variant.window
    DROPOUT = variant.dropout
    SCORES = (variant.softcap or variant.alibi or variant.mask == "bias"
              or variant.score_mod is not None)
    MASKS = variant.mask == "bool" or variant.mask_mod is not None
    TILE_TABLE = variant.tile_table
    PER_ELEMENT = WINDOW or SCORES or MASKS     # entries need visible() and score()
    HIDDEN = acc(-1)                    # P~ij of a masked entry where the tile is tested
    kv_tile_range = make_kv_tile_range(Br, Bc, causal, WINDOW)

    VARLEN = variant.varlen
    sequences = make_sequences(VARLEN)
    locate, cut = sequences.locate, sequences.cut

    @cuda.jit(**jit_options())
    def forward_v5(Q, K, V, O, L, softmax_scale, causal_offset, window_lo, Hq, group, softcap,
                   slopes, attn_mask, tiles, seed_lo, seed_hi, keep_threshold, keep_scale, seqs):
        bh = cuda.blockIdx.y            # batch * Hq + h: the query head
        batch = bh // Hq
        h = bh % Hq
        bh_kv = batch * (Hq // group) + h // group  # GQA: the K/V head this query head reads
        i = cuda.blockIdx.x             # Q tile index (Alg.1 l.3: one block per i)
        # A packed batch: this block's sequence, as a batch of one (kernels/sequences.py)
        q0, k0, Sq, Sk, shift = locate(seqs, batch, Q.shape[1], K.shape[1])
        if VARLEN:
            if i * Br >= Sq:
                return                  # past this sequence: the whole block, no barrier yet
            bh, bh_kv = h, h // group
        Q, O, L = cut(Q, q0, Sq), cut(O, q0, Sq), cut(L, q0, Sq)
        K, V = cut(K, k0, Sk), cut(V, k0, Sk)
        causal_offset += shift
        window_lo += shift
        tid = cuda.threadIdx.x
        ty = tid // TX
        tx = tid % TX

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
        hidden = cuda.local.array((TM, TN), np.bool_)   # variants: which entries are masked

        # From here on, v4 line for line (with the flat indices above), plus the variant
        # steps behind compile-time flags.
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

        # Alg.1 l.6: loop over K/V tiles; causal blocks stop after the last visible one,
        # windowed blocks start at the first (bands.py).
        j_start, j_end = kv_tile_range(i, Sk, causal_offset, window_lo)
        first_limit = i * Br + causal_offset    # last key the block's first row sees
        last_from = i * Br + Br - 1 + window_lo     # first key the block's last row sees
        for j in range(j_start, j_end):
            if TILE_TABLE and not tiles[bh, i, j]:
                continue                # the mask leaves this tile empty (variants.py);
                                        # the same for every thread: barriers stay matched
            # Does every row of the block see every key of the tile? Then P~ij Vj needs no
            # test (below). A data mask can hide any entry, so its tiles are always tested.
            interior = not causal or j * Bc + Bc - 1 <= first_limit
            if WINDOW:
                interior = interior and j * Bc >= last_from
            if MASKS:
                interior = False
            # Wait until every thread is done with the previous tile's KjT, Vj, Pij (and,
            # for the first tile, until QiT is complete).
            cuda.syncthreads()
            # Alg.1 l.7: load Kj (transposed) and Vj; rows past Sk and columns past d are 0.
            idx = tid
            while idx < Bc * DP:
                c = idx // DP
                k = idx % DP
                col = j * Bc + c
                inside = col < Sk and k < d
                KjT[U(k * BcP + c)] = acc(K[U(bh_kv), U(col), U(k)]) if inside else ZERO
                Vj[U(c * DP + k)] = acc(V[U(bh_kv), U(col), U(k)]) if inside else ZERO
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
            # Scale and mask (with a variant: visible() and score(), variants.py); this
            # thread's part of each row's max ('>': NaN never wins).
            for a in range(TM):
                row = i * Br + ty + TY * a
                m_part = NEG_INF
                for b in range(TN):
                    col = j * Bc + tx + TX * b
                    if PER_ELEMENT:
                        # rows past Sq are masked: attn_mask has no entry for them
                        x = NEG_INF
                        hidden[a, b] = True
                        if row < Sq and sees(batch, h, row, col, Sk, causal_offset,
                                             window_lo, attn_mask):
                            x, _ = score(s[a, b] * softmax_scale, batch, h, row, col, Sq, Sk,
                                         softcap, slopes, attn_mask)
                            hidden[a, b] = False
                    else:
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
                    if PER_ELEMENT and not interior and hidden[a, b]:
                        Pij[U(r * BcP + tx + TX * b)] = HIDDEN  # masked: never reads V
                    else:
                        Pij[U(r * BcP + tx + TX * b)] = p
                    l_tile += p
                l_i[a] = alpha * l_i[a] + l_tile
                m_i[a] = m_new
                for e in range(DN):
                    o[a, e] *= alpha            # Alg.1 l.10: diag(alpha) O_i ...
            if DROPOUT:
                # Dropout: this thread's entries of Pij that are dropped become 0, so that
                # P~ij Vj leaves them out (0 * v); l above counted them. A loop of its own,
                # on shared memory only: with the Philox rounds inside the loop above, it
                # was not unrolled and s and o went to local memory (ptxas: 320 bytes of
                # stack). Skipped: HIDDEN entries (< 0) and 0 (masked or underflowed).
                for a in range(TM):
                    r = ty + TY * a
                    for b in range(TN):
                        at = U(r * BcP + tx + TX * b)
                        if not Pij[at] <= ZERO and not kept(
                                seed_lo, seed_hi, keep_threshold, batch, h, i * Br + r,
                                j * Bc + tx + TX * b):
                            Pij[at] = ZERO
            # Wait until Pij is complete.
            cuda.syncthreads()

            # Alg.1 l.10: ... + P~ij Vj, TM + DN loads per key.
            if interior:
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
            elif PER_ELEMENT:
                # a tile with masked entries: those hold HIDDEN in Pij and never read V
                # (NaN-safe); '< 0' is False for a NaN P~ij, which propagates
                c = 0
                while c < Bc:             # a while loop, not range(): see kernels/__init__.py
                    for a in range(TM):
                        pa[a] = Pij[U((ty + TY * a) * BcP + c)]
                    for e in range(DN):
                        ve[e] = Vj[U(c * DP + tx + TX * e)]
                    for a in range(TM):
                        if not pa[a] < ZERO:
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
                        if DROPOUT:             # O = o / l * keep_scale, 1 / (1 - p)
                            O[bh, row, k] = (ZERO if l_row == ZERO
                                             else o[a, e] / l_row * keep_scale)
                        else:
                            O[bh, row, k] = ZERO if l_row == ZERO else o[a, e] / l_row
                if tx == 0:
                    L[bh, row] = NEG_INF if l_row == ZERO else m_i[a] + math.log(l_row)

    return forward_v5


# --- the launch contract ------------------------------------------------------------
#
# v5 runs v4's kernel with its five shared arrays carved out of dynamic shared memory,
# so the same shared bytes (v5_shared_bytes equals v4_shared_bytes) may exceed 48 KB.
# Tile rule: the first (Br, Bc, TM, TN) of V5_CANDIDATES whose shared memory fits in
# V5_SHARED_MEM_TARGET (113 KB: two blocks, each with the 1 KB the driver reserves, fit
# the 228 KB of an H200 SM; on a GPU that allows a block less, its own maximum,
# device_dynamic_shared_limit) and whose O block per thread fits V4_MAX_O_REGS, as for
# v4. A caller's tiles may use up to DYNAMIC_SHARED_MEM_LIMIT, the H100/H200's per-block
# maximum (kernels/smem.py checks the device's own maximum again before the launch).
# GPU, float32: d <= 64 -> (128, 64, 8, 4), 107520 bytes at d = 64, 256 threads;
# 64 < d <= 128 -> (64, 32, 4, 2), 79104 bytes at d = 128, 256 threads; d = 256 ->
# (16, 16, 2, 2), 52800 bytes. The order is measured (lab/sweeps/v5_sweep.py, with
# unsigned tile indices, lab/runs/2026-12-01/21_v5_sweep.txt), at (2, 16, 4096, d): d = 64, (128, 64, 8, 4) 8.33 ms,
# (64, 64, 4, 4) 9.90, (64, 32, 4, 4) 10.23, v4 11.88; d = 128, (64, 32, 4, 2) 22.88 ms,
# (64, 32, 4, 4) 30.64, the larger tiles 31.6-50.8, v4 46.46. On the simulator,
# V5_SIM_TILES, as v4's.

V5_CANDIDATES = ((128, 64, 8, 4), (64, 32, 4, 2), (64, 32, 4, 4), (32, 32, 4, 4),
                 (32, 16, 4, 2), (16, 16, 2, 2), (16, 8, 2, 1), (8, 8, 2, 2), (8, 8, 1, 1),
                 (4, 4, 1, 1))
V5_SHARED_MEM_TARGET = 113 * 1024
V5_SIM_TILES = V4_SIM_TILES
VARIANTS = True                # takes the variant arguments (kernels/variants.py)
TILE_TABLE = True              # skips the tiles a mask leaves empty (variants.make_tile_table)


def v5_shared_bytes(Br, Bc, TM, TN, d, acc_dtype):
    """Dynamic shared memory of forward v5: v4's five arrays back to back
    (v5_shared_layout), the same bytes as ``v4_shared_bytes``."""
    return v5_shared_layout(Br, Bc, TM, TN, d).END * np.dtype(acc_dtype).itemsize


def default_v5_tiles(d, acc_dtype, where=None):
    """v5 tile rule (above), (Br, Bc, TM, TN). GPU, float32: d <= 64 -> (128, 64, 8, 4),
    256 threads; 64 < d <= 128 -> (64, 32, 4, 2), 256 threads; d = 256 -> (16, 16, 2, 2),
    64 threads; float64: d = 64 -> (64, 32, 4, 2), d = 128 -> (32, 32, 4, 4)."""
    if here(where) == "simulator":
        return V5_SIM_TILES
    target = min(V5_SHARED_MEM_TARGET, device_dynamic_shared_limit(where))
    for Br, Bc, TM, TN in V5_CANDIDATES:
        DN = v4_head_dim_padded(Bc, TN, d) // (Bc // TN)
        if (TM * DN <= V4_MAX_O_REGS
                and v5_shared_bytes(Br, Bc, TM, TN, d, acc_dtype) <= target):
            return Br, Bc, TM, TN
    raise ValueError(f"forward v5 cannot run this input: no v5 tile fits head dim {d} in "
                     f"{acc_dtype} within {target} bytes of shared memory")


def check_v5_tiles(tiles, d, acc_dtype):
    """A caller's forward v5 tiles (``check_thread_tiles``), against the dynamic limit."""
    return check_thread_tiles(tiles, d, acc_dtype, "v5",
                              lambda Br, Bc, TM, TN: v5_shared_bytes(Br, Bc, TM, TN, d,
                                                                    acc_dtype),
                              DYNAMIC_SHARED_MEM_LIMIT, DYNAMIC_LIMIT_WHY)


def plan(p, where, tiles, reason):
    """The Plan of forward v5 for Problem ``p``: v4's, with dynamic shared memory and
    variants."""
    return plan_blocked(p, where, tiles, reason, "v5", default_v5_tiles, check_v5_tiles,
                        v5_shared_bytes, dynamic=True, variants=True)


def kernel(plan, p):
    """The compiled kernel of ``plan`` (cached per compile-time parameters)."""
    TM, TN = plan.thread_tile
    return make_forward_v5(plan.Br, plan.Bc, TM, TN, p.d, p.upper, p.acc_dtype, p.variant)
