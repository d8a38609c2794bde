"""Philox-4x32-10 and the dropout keep test as device functions, for the kernels.

The same generator as ``numbaflash.reference.philox4x32`` (the NumPy oracle, which says
where the constants come from) and the same mask as ``numbaflash.dropout.dropout_mask``
(whose docstring gives the scheme): element (b, h, i, j) is kept iff word j % 4 of
Philox((j // 4, i, h, b), (seed_lo, seed_hi)) is below the threshold. Nothing is stored
between the forward and the backward; both call ``dropout_keep`` for the elements of
their tiles.

Integer types are spelled out (``numba.uint32(...)``, ``numba.uint64(...)``): Numba types
every integer operation in 64 bits (uint32 ^ uint32 is a uint64 xor), and mixing signed
with unsigned 64-bit integers gives float64, so every result is cast back explicitly and
every constant has its type. All state (the counter words and the key) is held as uint32
between operations, so that LLVM narrows the 64-bit xors and adds back to 32 bits and
each mulhilo32, one 64-bit product of two zero-extended words, becomes one
``mul.wide.u32`` (its halves are register moves). Holding the key in uint64 instead
(masked after each bump) gave 64-bit xors and two ``mul.lo.s64`` per product in the PTX.
The ten rounds unroll: the PTX of a kernel calling ``philox4x32`` has 20 ``mul.wide.u32``,
32-bit xors and adds, no branch and no float64 (tests/test_dropout_rng.py compiles one).

Pass uint32 values (``np.uint32`` kernel arguments, or indices from ``cuda.grid`` /
``threadIdx``, which are 32-bit underneath): a cast from a genuine int64 (e.g. seed words
passed as Python ints, hence int64 arguments) lets LLVM widen the whole chain back to
64 bits: a kernel calling ``dropout_keep`` with int64 seed words and threshold had 24
``mul.lo.s64`` (6 with uint32 arguments: address arithmetic), 2 ``mul.wide.u32`` (20) and
64-bit xors in its PTX (numba-cuda 0.30.4, CUDA 13.5 NVVM). The results are the same.

The same code runs in the simulator, where the values are NumPy scalars: every product
of two 32-bit words fits in uint64 (no overflow warning); the key bump is masked to 32
bits before the cast to uint32, and the low half is a NumPy uint64 -> uint32 scalar
cast, which truncates (only a Python int out of range makes ``np.uint32`` raise).

Device functions (``inline=True``), usable from any kernel:

    philox4x32(c0, c1, c2, c3, k0, k1) -> (r0, r1, r2, r3)      uint32 words
    dropout_keep(seed_lo, seed_hi, threshold, b, h, i, j) -> bool

``threshold`` is ``numbaflash.dropout.keep_threshold(p)`` for 0 < p < 1 (a uint32 value);
with p = 0 a kernel does not call ``dropout_keep`` at all.
"""

import numba
from numba import cuda

from .. import reference

# The constants of reference.py (Random123's values), as typed scalars: Numba freezes
# module-level NumPy scalars into the kernel as constants of that type.
M0 = numba.uint64(reference.PHILOX_M0)
M1 = numba.uint64(reference.PHILOX_M1)
W0 = numba.uint64(reference.PHILOX_W0)
W1 = numba.uint64(reference.PHILOX_W1)
MASK32 = numba.uint64(0xFFFFFFFF)
SHIFT32 = numba.uint64(32)
ROUNDS = reference.PHILOX_ROUNDS
U32_2 = numba.uint32(2)
U32_3 = numba.uint32(3)
U32_0 = numba.uint32(0)
U32_1 = numba.uint32(1)


@cuda.jit(device=True, inline=True)
def philox4x32(c0, c1, c2, c3, k0, k1):
    """Philox-4x32-10 of counter (c0, c1, c2, c3) and key (k0, k1): four uint32 words.

    Arguments are any integers in [0, 2**32); they are converted to uint32 first.
    """
    x0 = numba.uint32(c0)
    x1 = numba.uint32(c1)
    x2 = numba.uint32(c2)
    x3 = numba.uint32(c3)
    key0 = numba.uint32(k0)
    key1 = numba.uint32(k1)
    for _ in range(ROUNDS):
        # mulhilo32: the 64-bit product of two zero-extended words (mul.wide.u32), split
        # into its 32-bit halves
        prod0 = M0 * numba.uint64(x0)
        prod1 = M1 * numba.uint64(x2)
        hi0 = numba.uint32(prod0 >> SHIFT32)
        lo0 = numba.uint32(prod0)                   # truncation: the low half
        hi1 = numba.uint32(prod1 >> SHIFT32)
        lo1 = numba.uint32(prod1)
        x0, x1, x2, x3 = numba.uint32(hi1 ^ x1 ^ key0), lo1, numba.uint32(hi0 ^ x3 ^ key1), lo0
        # bump the key for the next round, mod 2**32 (a uint32 add: the mask costs nothing)
        key0 = numba.uint32((numba.uint64(key0) + W0) & MASK32)
        key1 = numba.uint32((numba.uint64(key1) + W1) & MASK32)
    return x0, x1, x2, x3


@cuda.jit(device=True, inline=True)
def dropout_keep(seed_lo, seed_hi, threshold, b, h, i, j):
    """True iff element (b, h, i, j) survives dropout: word j % 4 of
    Philox((j // 4, i, h, b), (seed_lo, seed_hi)) < threshold (all uint32 values; h is the
    query head). Four neighbouring columns share one Philox call: a kernel that needs all
    four should call ``philox4x32`` once and compare each word itself."""
    col = numba.uint32(j)
    r0, r1, r2, r3 = philox4x32(col >> U32_2, i, h, b, seed_lo, seed_hi)
    word = col & U32_3
    w = r3
    if word == U32_0:
        w = r0
    elif word == U32_1:
        w = r1
    elif word == U32_2:
        w = r2
    return w < numba.uint32(threshold)
