"""The check that the tensor-core backward's inputs are finite.

Backward v5, v6 and v7 need finite inputs (a tensor core cannot skip a product);
one small kernel looks at the six inputs and raises a flag: ``nonfinite_check`` for
arrays of a float dtype, ``nonfinite_check_bfloat16`` for bfloat16 given as its bits
(backward v7, numbaflash/dtypes.py).
"""

from numba import cuda, float32, uint32

from .. import jit_options


F32_MAX = 3.4028234663852886e38


@cuda.jit(device=True, inline=True)
def finite(x):
    """x is neither NaN nor +-inf. Compared in float32: float16 cannot hold F32_MAX (the
    simulator, which compares a float16 in float16, made it inf, and let +-inf through)."""
    return abs(float32(x)) <= F32_MAX


BF16_EXPONENT = 0x7F80          # a bfloat16's exponent bits


@cuda.jit(device=True, inline=True)
def finite_bfloat16(bits):
    """The bfloat16 with these 16 bits is neither NaN nor +-inf: its exponent bits are
    not all ones."""
    return (uint32(bits) & uint32(BF16_EXPONENT)) != uint32(BF16_EXPONENT)


def _make_check(finite_value):
    """The check kernel with ``finite_value`` (finite or finite_bfloat16) for the elements
    of Q, K, V, O and dO."""

    @cuda.jit(**jit_options())
    def check(Q, K, V, O, dO, L, flag):
        n = cuda.grid(1)
        step = cuda.gridsize(1)
        bad = False
        while n < Q.size or n < K.size or n < L.size:
            if n < Q.size:
                bad = bad or not (finite_value(Q[n]) and finite_value(O[n])
                                  and finite_value(dO[n]))
            if n < K.size:
                bad = bad or not (finite_value(K[n]) and finite_value(V[n]))
            if n < L.size:
                bad = bad or not (L[n] <= F32_MAX)
            n += step
        if bad:
            flag[0] = 1                 # every writer writes the same value

    return check


# flag[0] = 1 if any element of the 1D arrays Q, K, V, O, dO is NaN or +-inf, or any of L
# is NaN or +inf (L = -inf is a row that sees no key). policy.start_finite_check queues it
# before backward v5 to v10, which need finite inputs (grid-stride loop; GPU and
# simulator); the bfloat16 one for Q, K, V, O, dO given as bits (uint16; L is float32).
nonfinite_check = _make_check(finite)
nonfinite_check_bfloat16 = _make_check(finite_bfloat16)
