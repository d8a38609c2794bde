"""Forward v2: FlashAttention-2's Algorithm 1, K/V tiles in shared memory.

Parent: v1 (v1_plain.py). One thread block per (Q tile i, head bh), one thread per query
row of the tile, holding its row of Qi in registers. The block walks the K/V tiles j:
all threads copy Kj and Vj into shared memory together, then each thread computes its
row of Sij, takes the tile's max, rescales o once per tile instead of once per key, and
accumulates Pij Vj; the tile's rowsum is added to l as one term (Alg.1 l.9), which also
keeps float32 rounding small. Normalise by l once at the end. Causal and window blocks
visit only the K/V tiles they can see (bands.py).

What it buys: K and V come from HBM once per Q tile instead of once per row (Br times
less traffic). H200, (2, 16, 4096, 64), float32: 8.3 TFLOP/s, 1.6x v1
(lab/runs/2026-11-30/05_gpu_check.txt).

Runs on the GPU and the simulator; takes every variant and dropout (a dropped key's P~
counts in l but not in P~ij Vj), and is the default for variants, float64 and d > 128
(numbaflash/policy.py).
"""

import functools
import math

import numpy as np
from numba import cuda

from .. import acc_type, jit_options
from ..bands import make_kv_tile_range
from ..plan import (
    MAX_THREADS, SHARED_MEM_LIMIT, TILE_TABLE_REASON, Plan, parse_tiles, variant_description
)
from ..sequences import make_sequences
from ..variants import PLAIN, make_dropout, make_variant_functions
from .v1_plain import write_row


@functools.lru_cache(maxsize=None)
def make_forward_v2(Br, Bc, d, causal, acc_dtype, variant=PLAIN):
    """v2 (FlashAttention-2, Algorithm 1) kernel; ``variant`` (kernels/variants.py) adds
    masks, score modifiers and dropout.

    Launch: grid (Tr, B * Hq) with Tr = ceil(Sq / Br), block (Br,): thread r owns row i*Br + r.
    Shared memory: Kj (Bc, d) and Vj (Bc, d) in the accumulator dtype. The Q tile lives in
    registers, each thread holding its own row q_i: Alg.1 l.4 loads Qi "to on-chip SRAM",
    and registers are the fastest on-chip memory. No other thread reads that row, and
    reading it from shared memory instead (as the first draft of v2 did) costs a second
    shared-memory load per multiply-add in Sij = Qi Kj^T: that draft ran 1.7x slower than
    v1 on the H200 at (2, 16, 4096, 64) (lab/runs/2026-11-30/01_gpu_check_first_kernels.txt).
    """
    acc = acc_type(acc_dtype)
    ZERO = acc(0)
    NEG_INF = acc(-math.inf)
    visible, score = make_variant_functions(variant, causal, acc_dtype)
    kept = make_dropout(variant).kept
    WINDOW = variant.window
    DROPOUT = variant.dropout
    TILE_TABLE = variant.tile_table
    kv_tile_range = make_kv_tile_range(Br, Bc, causal, WINDOW)
    VARLEN = variant.varlen
    sequences = make_sequences(VARLEN)
    locate, cut = sequences.locate, sequences.cut

    @cuda.jit(**jit_options())
    def forward_v2(Q, K, V, O, L, softmax_scale, causal_offset, window_lo, Hq, group, softcap,
                   slopes, attn_mask, tiles, seed_lo, seed_hi, keep_threshold, keep_scale, seqs):
        bh = cuda.blockIdx.y            # b * Hq + h: the query head
        b = bh // Hq
        h = bh % Hq
        bh_kv = b * (Hq // group) + h // group  # GQA: the K/V head this query head reads
        i = cuda.blockIdx.x             # Q tile index (Alg.1 l.3: one block per i)
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
        r = cuda.threadIdx.x            # row within the tile
        row = i * Br + r
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
                        # Dropout: l has every p (L is the undropped softmax's), V only
                        # the kept ones (a dropped key adds 0 * v: NaN for a non-finite v,
                        # as in the reference)
                        if DROPOUT and not kept(seed_lo, seed_hi, keep_threshold, b, h, row,
                                                j * Bc + c):
                            p = ZERO
                        for k in range(d):
                            o_i[k] += p * Vj[c, k]      # Alg.1 l.10: ... + P~ij Vj
                # Alg.1 l.9: l_i = alpha l_i + rowsum(P~ij). Summing the tile first and then
                # adding it matters in float32: adding N terms one by one into l_i made the
                # error 2.3x that of PyTorch's float32 softmax at N = 4096 on the H200.
                l_i = alpha * l_i + l_tile
                m_i = m_new

        if active:                                                      # Alg.1 l.12-16
            if DROPOUT:
                write_row(O, L, bh, row, o_i, m_i, l_i, d, ZERO, NEG_INF, keep_scale)
            else:
                write_row(O, L, bh, row, o_i, m_i, l_i, d, ZERO, NEG_INF)

    return forward_v2


# --- the launch contract ------------------------------------------------------------
#
# Tile rule: Br = 64 query rows (threads) per block, and Bc the largest power of two up
# to 64 whose Kj and Vj tiles (Bc x d each, in the accumulator dtype) fit in the 48 KB of
# static shared memory a block may use (Qi lives in registers, so Br costs no shared
# memory). Bigger Bc means fewer barriers per key. Examples, float32: d=64 -> (64, 64);
# d=128 -> (64, 32); d=256 -> (64, 16); float64 halves Bc. A caller's tiles=(Br, Bc) is
# checked against the same limits (Br <= 1024 threads, shared memory <= 48 KB).

FORWARD_BR = 64                # query rows (threads) per block
VARIANTS = True                # takes the variant arguments (kernels/variants.py)
TILE_TABLE = True              # skips the tiles a mask leaves empty (variants.make_tile_table)


def forward_shared_bytes(Br, Bc, d, acc_dtype):
    """Shared memory of the v2 forward kernel: Kj, Vj (Bc, d). (Br is threads, not memory.)"""
    return 2 * Bc * d * np.dtype(acc_dtype).itemsize


def default_forward_tiles(d, acc_dtype):
    """The tile rule (above): Br = 64, the largest Bc that fits."""
    Bc = 64
    while Bc > 1 and forward_shared_bytes(FORWARD_BR, Bc, d, acc_dtype) > SHARED_MEM_LIMIT:
        Bc //= 2
    return FORWARD_BR, Bc


def check_tiles(tiles, d, acc_dtype):
    """Validate a caller's (Br, Bc) for the v2 forward; ValueError names the limit."""
    Br, Bc = parse_tiles(tiles)
    if Br > MAX_THREADS:
        raise ValueError(f"Br = {Br} exceeds {MAX_THREADS}: one thread per query row, and a "
                         f"block holds at most {MAX_THREADS} threads")
    need = forward_shared_bytes(Br, Bc, d, acc_dtype)
    if need > SHARED_MEM_LIMIT:
        raise ValueError(f"tiles (Br, Bc) = ({Br}, {Bc}) need {need} bytes of shared memory at "
                         f"head dim {d} in {acc_dtype}; the limit is {SHARED_MEM_LIMIT} (48 KB "
                         f"static shared memory per block)")
    return Br, Bc


def plan(p, where, tiles, reason):
    """The Plan of forward v2 for Problem ``p``: grid (Tr, B * Hq), block (Br,)."""
    if tiles is None:
        Br, Bc = default_forward_tiles(p.d, p.acc_dtype)
        reason += f"; tiles by the default rule for d={p.d} in {p.acc_dtype}"
    else:
        Br, Bc = check_tiles(tiles, p.d, p.acc_dtype)
        reason += "; tiles given by the caller"
    if p.variant.tile_table:
        reason += TILE_TABLE_REASON
    return Plan("forward", "v2", "forward_v2", where, Br, Bc, (math.ceil(p.Sq / Br), p.BH),
                (Br,), forward_shared_bytes(Br, Bc, p.d, p.acc_dtype), p.acc_dtype, p.causal,
                reason, variant_description(p))


def kernel(plan, p):
    """The compiled kernel of ``plan`` (cached per compile-time parameters)."""
    return make_forward_v2(plan.Br, plan.Bc, p.d, p.upper, p.acc_dtype, p.variant)
