"""Attention dropout's random numbers, host side: which (b, h, i, j) are kept.

Dropout zeroes each attention probability P[b, h, i, j] with probability p and scales the
survivors by 1 / (1 - p), so that O = (P * keep / (1 - p)) V is unbiased. The backward
needs the very same keep mask. Storing it would cost batch * heads * Sq * Sk bits of HBM,
the quadratic memory FlashAttention exists to avoid; instead the mask is a pure function
of the seed and the element's coordinates, and the backward recomputes it:

    key     = (seed & 0xffffffff, seed >> 32)               (seed: an int in [0, 2**64))
    counter = (j // 4, i, h, b)                             (four uint32 words)
    words   = Philox-4x32-10(counter, key)                  (four uint32 words)
    keep    = words[j % 4] < keep_threshold(p) = floor((1 - p) * 2**32)

with i the query row, j the key column, h the QUERY head (with GQA several query heads
share a K/V head but not a mask) and b the batch; inputs without batch or head dims use
b = 0, h = 0. Philox is counter-based (Salmon et al., SC'11; reference.philox4x32): no
generator state, so the forward and the backward kernels, with different tilings and
thread mappings, draw the same word for the same element, and this module can build the
mask on the host for the tests. One Philox call covers four neighbouring columns.

Each word is uniform on [0, 2**32), so an element is kept with probability
keep_threshold(p) / 2**32, which is 1 - p to within 2**-32.
"""

import math
import numbers
from fractions import Fraction

import numpy as np

from .reference import philox4x32

SEED_LIMIT = 2**64
_BLOCK_WORDS = 1 << 20          # Philox blocks per NumPy call in dropout_mask (~64 MiB)


def check_dropout_p(dropout_p):
    """``dropout_p`` as a float in [0, 1); ValueError if it is not a real number there
    (bool, NaN and p = 1 included: p = 1 would drop everything and scale by 1 / 0)."""
    if isinstance(dropout_p, (bool, np.bool_)) or not isinstance(dropout_p, numbers.Real):
        raise ValueError(f"dropout_p must be a real number in [0, 1); got "
                         f"{type(dropout_p).__name__} {dropout_p!r}")
    p = float(dropout_p)
    if not 0.0 <= p < 1.0:               # False for NaN too
        raise ValueError(f"dropout_p must lie in [0, 1) (1 would drop every probability "
                         f"and divide by 1 - p = 0); got {dropout_p!r}")
    return p


def check_dropout(dropout_p, dropout_seed):
    """Validate dropout's arguments; returns ``(p, seed)`` as (float, int or None).

    dropout_p: a real number in [0, 1) (not a bool). dropout_seed: an int (Python or NumPy
    integer, not a bool) in [0, 2**64), required when p > 0; with p = 0 it may be None
    (it is checked all the same when given). Raises ValueError naming the limit broken.
    """
    p = check_dropout_p(dropout_p)
    if dropout_seed is None:
        if p > 0:
            raise ValueError(f"dropout_p = {p} > 0 needs dropout_seed, an int in [0, 2**64): "
                             "the backward regenerates the forward's mask from it")
        return p, None
    if isinstance(dropout_seed, (bool, np.bool_)) or not isinstance(dropout_seed,
                                                                    numbers.Integral):
        raise ValueError(f"dropout_seed must be an int in [0, 2**64); got "
                         f"{type(dropout_seed).__name__} {dropout_seed!r}")
    seed = int(dropout_seed)
    if not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"dropout_seed must lie in [0, 2**64) (it is Philox's 64-bit key); "
                         f"got {seed}")
    return p, seed


def keep_threshold(p):
    """The uint32 threshold T = floor((1 - p) * 2**32), as a Python int: a word w is kept
    iff w < T.

    Computed exactly from the binary value of the float p (fractions.Fraction), not in
    floating point: for 0 < p < 1, (1 - p) * 2**32 < 2**32, so T <= 2**32 - 1 fits a uint32
    (float64 would round 1 - p to 1 for p < 2**-53 and give 2**32). p below 2**-32 gives
    T = 2**32 - 1: the single word 0xffffffff is dropped.

    p = 0 gives 2**32, which is no uint32: p = 0 means "no dropout", and callers skip the
    comparison (and the Philox rounds) altogether rather than pass this threshold to a
    kernel. ValueError for p outside [0, 1).
    """
    p = check_dropout_p(p)
    return math.floor((1 - Fraction(p)) * 2**32)


def seed_words(seed):
    """Philox's key (k0, k1) = (seed & 0xffffffff, seed >> 32) for a seed in [0, 2**64)."""
    _, seed = check_dropout(0.0, seed)
    if seed is None:
        raise ValueError("dropout_seed must be an int in [0, 2**64); got None")
    return seed & 0xFFFFFFFF, seed >> 32


def dropout_mask(batch, heads, sq, sk, p, seed):
    """The keep mask of dropout: a bool array (batch, heads, sq, sk), True = kept.

    Element (b, h, i, j) is kept iff word j % 4 of Philox-4x32-10((j // 4, i, h, b), key)
    is below ``keep_threshold(p)``, key = ``seed_words(seed)`` (module docstring); heads
    are query heads; for inputs without batch or head dims take ``dropout_mask(1, 1, sq,
    sk, p, seed)[0, 0]`` (b = 0, h = 0). p = 0 keeps everything (seed may then be None).
    Memory: besides the
    result, the uint64 temporaries of ``philox4x32`` (a few hundred bytes per Philox
    block of four columns) for at most 2**20 blocks at a time: one call per block of rows
    of one (b, h). Raises ValueError for bad p, seed or sizes.
    """
    p, seed = check_dropout(p, seed)
    dims = (batch, heads, sq, sk)
    if any(isinstance(n, (bool, np.bool_)) or not isinstance(n, numbers.Integral) or n < 0
           for n in dims):
        raise ValueError(f"dropout_mask: sizes must be non-negative ints; got {dims}")
    batch, heads, sq, sk = (int(n) for n in dims)
    if max(batch, heads, sq, (sk + 3) // 4, 1) > 2**32:
        raise ValueError("dropout_mask: batch, heads, sq and sk // 4 must fit in a uint32 "
                         "counter word")
    keep = np.ones((batch, heads, sq, sk), dtype=bool)
    if p == 0 or keep.size == 0:
        return keep
    threshold = np.uint64(keep_threshold(p))
    key = np.array(seed_words(seed), dtype=np.uint64)
    nblk = (sk + 3) // 4
    rows_per_call = max(1, _BLOCK_WORDS // nblk)
    counter = np.zeros((min(rows_per_call, sq), nblk, 4), dtype=np.uint64)
    counter[..., 0] = np.arange(nblk)                                    # j // 4
    for b in range(batch):
        for h in range(heads):
            for i0 in range(0, sq, rows_per_call):
                rows = min(rows_per_call, sq - i0)
                c = counter[:rows]
                c[..., 1] = np.arange(i0, i0 + rows)[:, None]                # i
                c[..., 2] = h
                c[..., 3] = b
                words = philox4x32(c, key)                          # (rows, nblk, 4)
                # word j % 4 of block j // 4 is column j: flatten (block, word) in order
                words = words.reshape(rows, nblk * 4)[:, :sk]
                keep[b, h, i0:i0 + rows] = words < threshold
    return keep
