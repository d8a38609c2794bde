"""Attention variants: masks and score modifiers, compiled into the kernels.

FlexAttention's idea (Dong et al., arXiv:2412.05496), in Numba: what a variant changes is
two small device functions, built here from a ``Variant`` (compile-time) and inlined into
the forward and backward kernels by their factories:

    visible(b, h, row, col, Sk, causal_offset, window_lo, attn_mask) -> bool
        Is key ``col`` visible from query ``row`` (batch b, query head h)? Masked entries
        are never computed: no dot product, no exp, and nothing is read from them.
    score(s, b, h, row, col, Sq, Sk, softcap, slopes, attn_mask) -> (s_new, ds_new/ds)
        The score of a visible entry, from the scaled dot product s = scale * q . k, and
        its derivative with respect to s (the backward multiplies dS by it).

The arguments after ``col`` are the kernels' run-time arguments (every kernel that
supports variants takes all of them; a variant that does not use one gets a 1-element
placeholder), so one compiled kernel serves every sequence length, window and slope.

The built-ins, in the order they apply (masks first, then the score, step by step):

    mask   col < Sk
           causal / window right: col <= row + causal_offset   (compile-time ``causal``)
           window left:           col >= row + window_lo       (``Variant.window``)
           attn_mask (bool):      attn_mask[b, h, row, col]    (broadcast: size-1 dims)
           mask_mod:              mask_mod(b, h, row, col)     (the user's device function)
    score  s = scale * q . k
           softcap:      s = cap * tanh(s / cap)               d/ds = 1 - tanh^2(s / cap)
           ALiBi:        s -= slope[b, h] * |row + Sk - Sq - col|
           attn_mask (float): s += attn_mask[b, h, row, col]
           score_mod:    s = score_mod(s, b, h, row, col)      d/ds = score_mod_grad(...)

A score of -inf (e.g. a -inf bias) gets probability exactly 0, like a masked entry, but it
is computed.

Dropout (``Variant.dropout``) is the third device function, ``make_dropout``'s:

    kept(seed_lo, seed_hi, threshold, b, h, row, col) -> bool
        Does entry (b, h, row, col) survive dropout? Philox-4x32-10 of the counter
        (col // 4, row, h, b) (kernels/philox.py; numbaflash/dropout.py gives the scheme):
        nothing is stored, the backward asks the same question and gets the same answer.
    kept_rows(seed_lo, seed_hi, threshold, b, h, row0, col, t) -> 4 x bool
        For the tensor-core kernels' row fragments (forward v6 to v9, backward v6's dQ):
        a lane holds keys col and col + 1 (col = 8-aligned base + 2 t) of rows row0 and
        row0 + 8. Lanes t and t ^ 1 need the same two blocks of four, (row0, col // 4)
        and (row0 + 8, col // 4); each lane computes one of them and the pair swaps the
        two words the other needs (a warp shuffle): one Philox call per lane where each
        lane asking for its own two would make two.
    kept_keys(seed_lo, seed_hi, threshold, b, h, row, key, g) -> 4 x bool
        For backward v6's transposed dK/dV fragments: a lane holds rows row and row + 1
        (queries) of keys key and key + 8 (key = 16-aligned base + g). The four lanes
        g & 3 = 0..3 of the same t need the same four blocks, (row or row + 1, key // 4 or
        key // 4 + 2), and one word of each; each computes one block and the four swap
        them (four shuffles): one Philox call per lane instead of four.

    Both are warp collectives (every lane of the warp calls them together, as the mma
    instructions around them require anyway) and give the bits ``kept`` gives, entry
    for entry: the mask does not depend on which lane computes it.

Where it enters: the forward sums the row's undropped probabilities (L is the undropped
softmax's logsumexp) and multiplies V by P~ only where kept; O is then scaled by
``keep_scale`` = 1 / (1 - p). The backward drops the same entries of P for dV and of dP
(dP = dO V^T * kept * keep_scale), and dS = P (dP - D) as before. The run-time arguments,
after ``tiles``: seed_lo, seed_hi, keep_threshold (uint32) and keep_scale (the
accumulator's dtype), from launcher.variant_arguments, which adds ``seqs`` last (a
packed batch's sequences, kernels/sequences.py; a placeholder otherwise). Without
dropout ``kept`` is the constant True and they are never read.

Skipping empty tiles. Causal and window masks are bands: the tiled kernels find the
first and last tile a block needs by arithmetic and never visit the others. A boolean
attn_mask or a mask_mod can leave any tile empty, so for those (``Variant.tile_table``)
a small kernel first builds the table of visible tiles (``make_tile_table``: one block
per (query head, Q tile, K/V tile), True if any entry of the tile is visible), and the
tiled kernels skip a tile whose entry is False: no load, no product, no barrier. This is
FlexAttention's block mask, computed per call for the kernel's own tile sizes. Arrays are indexed with each size-1 dimension pinned to 0, which is how
broadcasting works here: nothing is expanded on the host.
"""

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

import numba
from numba import cuda

from . import acc_type
from .philox import dropout_keep, philox4x32
from .warp import FULL_WARP

MASK_KINDS = (None, "bool", "bias")


@dataclass(frozen=True)
class Variant:
    """What a kernel is specialised for, beyond tiles, head dim and dtype (all compile-time).

    window: a left window bound exists (key col >= row + window_lo). The right bound, like
        the causal mask, is the kernels' ``causal`` flag with ``causal_offset``.
    dropout: dropout_p > 0 (the seed and p are run-time arguments; ``make_dropout``).
    softcap, alibi: the built-in score modifiers (their values are run-time arguments).
    mask: None, "bool" (attn_mask says which keys are visible) or "bias" (attn_mask is
        added to the scores).
    score_mod, score_mod_grad, mask_mod: the user's ``@cuda.jit(device=True)`` functions,
        or None.
    varlen: a packed batch of sequences of different lengths; each block finds its
        sequence in the run-time argument ``seqs`` (kernels/sequences.py).
    """
    window: bool = False
    dropout: bool = False
    softcap: bool = False
    alibi: bool = False
    mask: str | None = None
    score_mod: object = None
    score_mod_grad: object = None
    mask_mod: object = None
    varlen: bool = False

    def __post_init__(self):
        if self.mask not in MASK_KINDS:
            raise ValueError(f"unknown mask kind {self.mask!r}")

    @property
    def plain(self):
        return self == PLAIN

    @property
    def tile_table(self):
        """Whether the tiled kernels need a table of visible tiles: the mask depends on
        data (a boolean attn_mask) or on the user's mask_mod, not only on a band."""
        return self.mask == "bool" or self.mask_mod is not None

    def describe(self, causal=False):
        """One line for explain(): which variant pieces are compiled in."""
        parts = []
        if causal:
            parts.append("window right bound")
        if self.window:
            parts.append("window left bound")
        if self.dropout:
            parts.append("dropout")
        if self.softcap:
            parts.append("softcap")
        if self.alibi:
            parts.append("ALiBi")
        if self.mask == "bool":
            parts.append("boolean attn_mask")
        if self.mask == "bias":
            parts.append("additive attn_mask (bias)")
        for name in ("score_mod", "mask_mod"):
            fn = getattr(self, name)
            if fn is not None:
                parts.append(f"{name}={getattr(fn, '__name__', type(fn).__name__)}")
        if self.varlen:
            parts.append("packed sequences (varlen)")
        return " + ".join(parts) if parts else "plain"


PLAIN = Variant()


@cuda.jit(device=True, inline=True)
def _at(a, b, h, row, col):
    """a[b, h, row, col] with NumPy broadcasting: a dimension of size 1 is indexed at 0."""
    return a[b if a.shape[0] > 1 else 0, h if a.shape[1] > 1 else 0,
             row if a.shape[2] > 1 else 0, col if a.shape[3] > 1 else 0]


@cuda.jit(device=True, inline=True)
def _all_visible(b, h, q_idx, kv_idx):
    return True


@functools.lru_cache(maxsize=None)
def make_variant_functions(variant, causal, acc_dtype):
    """``(visible, score)`` device functions for ``variant`` (module docstring)."""
    acc = acc_type(acc_dtype)
    ONE = acc(1)
    WINDOW = variant.window
    SOFTCAP = variant.softcap
    ALIBI = variant.alibi
    BOOL_MASK = variant.mask == "bool"
    BIAS = variant.mask == "bias"
    MASK_MOD = variant.mask_mod is not None
    SCORE_MOD = variant.score_mod is not None
    SCORE_GRAD = variant.score_mod_grad is not None
    mask_mod = variant.mask_mod if MASK_MOD else _all_visible

    @cuda.jit(device=True, inline=True)
    def _same(score, b, h, q_idx, kv_idx):
        return score

    @cuda.jit(device=True, inline=True)
    def _one(score, b, h, q_idx, kv_idx):
        return ONE

    score_mod = variant.score_mod if SCORE_MOD else _same
    score_mod_grad = variant.score_mod_grad if SCORE_GRAD else _one

    @cuda.jit(device=True, inline=True)
    def visible(b, h, row, col, Sk, causal_offset, window_lo, attn_mask):
        if col >= Sk:
            return False
        if causal and col > row + causal_offset:
            return False
        if WINDOW and col < row + window_lo:
            return False
        if BOOL_MASK and not _at(attn_mask, b, h, row, col):
            return False
        if MASK_MOD and not mask_mod(b, h, row, col):
            return False
        return True

    @cuda.jit(device=True, inline=True)
    def score(s, b, h, row, col, Sq, Sk, softcap, slopes, attn_mask):
        g = ONE                                 # d(score) / d(s), through every step
        if SOFTCAP:
            # s * (1 / cap): the reciprocal does not change in the kernel's loops, so the
            # compiler computes it once; a division per entry costs about ten instructions.
            t = acc(math.tanh(s * (ONE / softcap)))
            s = softcap * t
            g = ONE - t * t
        if ALIBI:
            slope = acc(slopes[b if slopes.shape[0] > 1 else 0, h])
            # the distance in 32 bits: converting a 64-bit integer to float is slower
            s -= slope * acc(abs(numba.int32(row + Sk - Sq - col)))
        if BIAS:
            s += acc(_at(attn_mask, b, h, row, col))
        if SCORE_MOD:
            if SCORE_GRAD:
                g *= acc(score_mod_grad(s, b, h, row, col))
            s = acc(score_mod(s, b, h, row, col))
        return s, g

    return visible, score


class DropoutTests(NamedTuple):
    """``make_dropout``'s device functions (module docstring)."""
    kept: object
    kept_rows: object
    kept_keys: object


@cuda.jit(device=True, inline=True)
def _keep_bits(seed_lo, seed_hi, threshold, b, h, row, block):
    """The keep bits of block ``block`` (keys 4 block to 4 block + 3) of ``row``: bit w
    is set iff word w of Philox((block, row, h, b), (seed_lo, seed_hi)) < threshold."""
    r0, r1, r2, r3 = philox4x32(block, row, h, b, seed_lo, seed_hi)
    th = numba.uint32(threshold)
    return ((numba.int32(1) if r0 < th else numba.int32(0))
            | (numba.int32(2) if r1 < th else numba.int32(0))
            | (numba.int32(4) if r2 < th else numba.int32(0))
            | (numba.int32(8) if r3 < th else numba.int32(0)))


@functools.lru_cache(maxsize=None)
def make_dropout(variant):
    """A DropoutTests of device functions for ``variant`` (module docstring); each gives
    the constant True (every entry kept) without ``variant.dropout``."""
    DROPOUT = variant.dropout

    @cuda.jit(device=True, inline=True)
    def kept(seed_lo, seed_hi, threshold, b, h, row, col):
        if DROPOUT:
            return dropout_keep(seed_lo, seed_hi, threshold, b, h, row, col)
        return True

    @cuda.jit(device=True, inline=True)
    def kept_rows(seed_lo, seed_hi, threshold, b, h, row0, col, t):
        if DROPOUT:
            # this lane computes the block of row row0 + 8 (t & 1); the keys it holds are
            # words 2 (t & 1) and 2 (t & 1) + 1 of each row's block
            odd = t & 1
            bits = _keep_bits(seed_lo, seed_hi, threshold, b, h, row0 + 8 * odd,
                              numba.uint32(col) >> numba.uint32(2))
            lane = cuda.laneid
            top = cuda.shfl_sync(FULL_WARP, bits, lane & ~1)        # row0's block
            bottom = cuda.shfl_sync(FULL_WARP, bits, lane | 1)      # row0 + 8's
            top >>= 2 * odd
            bottom >>= 2 * odd
            return (top & 1) != 0, (top & 2) != 0, (bottom & 1) != 0, (bottom & 2) != 0
        return True, True, True, True

    @cuda.jit(device=True, inline=True)
    def kept_keys(seed_lo, seed_hi, threshold, b, h, row, key, g):
        if DROPOUT:
            # lane m = g & 3 of the four computes block m: row row + (m & 1), keys of
            # key - m + 8 (m >> 1); entry x of every lane (row + x % 2, key + 8 (x // 2))
            # is word m of block x, computed by the lane whose g & 3 is x
            m = g & 3
            bits = _keep_bits(seed_lo, seed_hi, threshold, b, h, row + (m & 1),
                              numba.uint32(key - m + 8 * (m >> 1)) >> numba.uint32(2))
            base = cuda.laneid & ~12                    # the lane of this t with g & 3 = 0
            k0 = cuda.shfl_sync(FULL_WARP, bits, base)
            k1 = cuda.shfl_sync(FULL_WARP, bits, base | 4)
            k2 = cuda.shfl_sync(FULL_WARP, bits, base | 8)
            k3 = cuda.shfl_sync(FULL_WARP, bits, base | 12)
            return (((k0 >> m) & 1) != 0, ((k1 >> m) & 1) != 0, ((k2 >> m) & 1) != 0,
                    ((k3 >> m) & 1) != 0)
        return True, True, True, True

    return DropoutTests(kept, kept_rows, kept_keys)


TILE_TABLE_THREADS = 64                 # threads per block of the tile-table kernel


@functools.lru_cache(maxsize=None)
def make_tile_table(Br, Bc, causal, acc_dtype, variant):
    """Kernel that marks the (Br x Bc) tiles with at least one visible entry.

    Launch: grid (Tr * Tc, B * Hq), block (TILE_TABLE_THREADS,); writes
    tiles[bh, i, j] = True if some row of Q tile i sees some column of K/V tile j. The
    threads of a block split the tile's entries, each stops at its first visible entry,
    and ``syncthreads_or`` combines their answers. Rows past Sq and columns past Sk count
    as invisible.
    """
    visible, _ = make_variant_functions(variant, causal, acc_dtype)

    @cuda.jit
    def tile_table(tiles, Sq, Sk, causal_offset, window_lo, Hq, attn_mask):
        Tc = tiles.shape[2]
        i = cuda.blockIdx.x // Tc       # Q tile
        j = cuda.blockIdx.x % Tc        # K/V tile
        bh = cuda.blockIdx.y
        b = bh // Hq
        h = bh % Hq
        seen = 0
        for idx in range(cuda.threadIdx.x, Br * Bc, cuda.blockDim.x):
            row = i * Br + idx // Bc
            col = j * Bc + idx % Bc
            if row < Sq and visible(b, h, row, col, Sk, causal_offset, window_lo, attn_mask):
                seen = 1
                break
        any_seen = cuda.syncthreads_or(seen)
        if cuda.threadIdx.x == 0:
            tiles[bh, i, j] = any_seen != 0

    return tile_table
