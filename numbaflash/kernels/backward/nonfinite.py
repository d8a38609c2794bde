"""The check that the tensor-core backward's inputs are finite.

Backward v5 and v6 need finite inputs (a tensor core cannot skip a product);
one small kernel looks at the six inputs and raises a flag.
"""

from numba import cuda, float32

from .. import jit_options


F32_MAX = 3.4028234663852886e38


@cuda.jit(device=True, inline=True)
def finite(x):
    """x is neither NaN nor +-inf. Compared in float32: float16 cannot hold F32_MAX (the
    simulator, which compares a float16 in float16, made it inf, and let +-inf through)."""
    return abs(float32(x)) <= F32_MAX


@cuda.jit(**jit_options())
def nonfinite_check(Q, K, V, O, dO, L, flag):
    """flag[0] = 1 if any element of the 1D arrays Q, K, V, O, dO is NaN or +-inf, or any
    of L is NaN or +inf (L = -inf is a row that sees no key). policy.finite_inputs_plans
    runs it before backward v5 and v6, which need finite inputs (grid-stride loop; GPU and
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
