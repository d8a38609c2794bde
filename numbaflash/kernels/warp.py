"""Warp collectives: the row max and row sum shared by the four lanes of a quad.

In an mma.sync fragment the four lanes of a quad (lanes 4g to 4g + 3) hold the
columns of the same two rows, so a row's max or sum is two shuffles away.
Warp shuffles on a GPU; on the simulator kernels/simulated.py supplies them.
"""

from numba import cuda

FULL_WARP = 0xFFFFFFFF                  # the lane mask of a whole warp


@cuda.jit(device=True, inline=True)
def quad_max(x):
    """The max over the 4 lanes of a quad (the lanes sharing a row of an mma fragment in
    the tensor-core kernels); '>' so that NaN does not win (as in v1/v2). Warp shuffles
    (on the simulator, kernels/simulated.py's)."""
    y = cuda.shfl_xor_sync(FULL_WARP, x, 1)
    x = y if y > x else x
    y = cuda.shfl_xor_sync(FULL_WARP, x, 2)
    return y if y > x else x


@cuda.jit(device=True, inline=True)
def quad_sum(x):
    """The sum over the 4 lanes of a quad (see quad_max)."""
    x += cuda.shfl_xor_sync(FULL_WARP, x, 1)
    return x + cuda.shfl_xor_sync(FULL_WARP, x, 2)
