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


@cuda.jit(**jit_options())
def nonfinite_check(Q, K, V, O, dO, L, flag):
    """flag[0] = 1 if any element of the 1D arrays Q, K, V, O, dO is NaN or +-inf, or any
    of L is NaN or +inf (L = -inf is a row that sees no key). policy.finite_inputs_plans
    runs it before backward v5, v6 and v7, which need finite inputs (grid-stride loop; GPU and
    simulator)."""
    n = cuda.grid(1)
    step = cuda.gridsize(1)
    bad = False
    while n < Q.size or n < K.size or n < L.size:
        if n < Q.size:
            bad = bad or not (finite(Q[n]) and finite(O[n]) and finite(dO[n]))
        if n < K.size:
            bad = bad or not (finite(K[n]) and finite(V[n]))
        if n < L.size:
            bad = bad or not (L[n] <= F32_MAX)
        n += step
    if bad:
        flag[0] = 1                 # every writer writes the same value


@cuda.jit(**jit_options())
def nonfinite_check_bfloat16(Q, K, V, O, dO, L, flag):
    """nonfinite_check for Q, K, V, O, dO given as bfloat16 bits (uint16; L is float32):
    what policy.finite_inputs_plans runs before backward v7 on bfloat16 inputs."""
    n = cuda.grid(1)
    step = cuda.gridsize(1)
    bad = False
    while n < Q.size or n < K.size or n < L.size:
        if n < Q.size:
            bad = bad or not (finite_bfloat16(Q[n]) and finite_bfloat16(O[n])
                              and finite_bfloat16(dO[n]))
        if n < K.size:
            bad = bad or not (finite_bfloat16(K[n]) and finite_bfloat16(V[n]))
        if n < L.size:
            bad = bad or not (L[n] <= F32_MAX)
        n += step
    if bad:
        flag[0] = 1                 # every writer writes the same value
