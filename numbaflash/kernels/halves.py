"""The 16-bit input types of the tensor-core kernels, by name: float16 and bfloat16.

Both have an m16n8k16 ``mma`` that multiplies them exactly and adds in float32, with the
same fragment layout (kernels/ptx.py); they differ in how a value is stored, widened to
float32 and rounded back:

    float16   11 significant bits, exponent range up to 65504. Numba has the type.
    bfloat16  8 significant bits, float32's exponent range (the upper half of a float32).
              Numba has no bfloat16 type, so a bfloat16 array reaches a kernel as its bits,
              a uint16 array (numbaflash/dtypes.py makes that view, without a copy).

``make_halves(name)`` returns, by name:

    storage       the Numba type of the kernel's arrays and shared tiles (float16; uint16)
    widen(x)      a stored value as float32, exactly (bfloat16: its bits shifted up 16)
    narrow(x)     a float32 value rounded to the type, to nearest even, as stored
    pack2(lo, hi) two float32 values rounded and packed into one 32-bit word, lo in the low
                  half: an A fragment word (ptx.pack_f16x2, ptx.pack_bf16x2)
    mma           the m16n8k16 product (ptx.mma_f16, ptx.mma_bf16)

bfloat16's ``narrow`` is the instruction ``cvt.rn.bf16x2.f32`` (ptx.pack_bf16x2) with one
half kept: one instruction where the rule on the bits takes seven, and forward v7 at
d = 128, causal, needs 170 registers with it instead of 244 with the bit arithmetic
(ptxas, sm_90). The rule, which the simulator's stand-in follows bit for bit: add 0x7FFF
plus the lowest kept bit of the float32 (ties to even), keep the upper 16 bits; a NaN
becomes the canonical NaN 0x7FFF. So a kernel's bfloat16 outputs have the same bits on
the simulator as on a GPU.

``widen_to_float32`` and ``narrow_from_float32`` are elementwise kernels over flat arrays:
how numbaflash/dtypes.py runs bfloat16 inputs on the kernels that read float32 (every
version but forward v7).
"""

import functools
from collections import namedtuple

from numba import cuda, float32, uint16, uint32
from numba.types import float16

from .ptx import f32_from_bits, mma_bf16, mma_f16, pack_bf16x2, pack_f16x2

NAMES = ("float16", "bfloat16")

Halves = namedtuple("Halves", "name storage widen narrow pack2 mma")


@cuda.jit(device=True, inline=True)
def _widen_float16(x):
    return float32(x)


@cuda.jit(device=True, inline=True)
def _narrow_float16(x):
    return float16(x)


@cuda.jit(device=True, inline=True)
def bfloat16_widen(bits):
    """The bfloat16 with these 16 bits, as float32 (exact)."""
    return f32_from_bits(uint32(bits) << uint32(16))


@cuda.jit(device=True, inline=True)
def bfloat16_narrow(x):
    """The float32 x rounded to bfloat16 (to nearest, ties to even), as its 16 bits:
    ``cvt.rn.bf16x2.f32`` of x twice, one half kept (module docstring)."""
    return uint16(pack_bf16x2(x, x) & uint32(0xFFFF))


@functools.lru_cache(maxsize=None)
def make_halves(name):
    """The Halves of ``name`` ("float16" or "bfloat16"); see the module docstring."""
    if name == "float16":
        return Halves(name, float16, _widen_float16, _narrow_float16, pack_f16x2, mma_f16)
    if name == "bfloat16":
        return Halves(name, uint16, bfloat16_widen, bfloat16_narrow, pack_bf16x2, mma_bf16)
    raise ValueError(f"no 16-bit tensor-core type {name!r}; choose from {NAMES}")


def half_of(dtype):
    """"bfloat16" for the bfloat16 dtype (its name), else None: the ``half`` argument of
    the kernel factories that read bfloat16 bits besides their own dtypes."""
    return "bfloat16" if str(dtype) == "bfloat16" else None


# --- bfloat16 inputs on the float32 kernels -----------------------------------------

CONVERT_THREADS = 256
CONVERT_MAX_BLOCKS = 4096


@cuda.jit
def widen_to_float32(bits, out):
    """out[n] = the bfloat16 bits[n] as float32, for flat arrays of one size."""
    n = cuda.grid(1)
    step = cuda.gridsize(1)
    while n < bits.size:
        out[n] = bfloat16_widen(bits[n])
        n += step


@cuda.jit
def narrow_from_float32(x, bits):
    """bits[n] = x[n] rounded to bfloat16 (bfloat16_narrow), for flat arrays of one size."""
    n = cuda.grid(1)
    step = cuda.gridsize(1)
    while n < x.size:
        bits[n] = bfloat16_narrow(x[n])
        n += step


def convert_grid(size):
    """The grid of the two conversion kernels for ``size`` elements (a grid-stride loop)."""
    return (max(1, min(-(-size // CONVERT_THREADS), CONVERT_MAX_BLOCKS)),)
