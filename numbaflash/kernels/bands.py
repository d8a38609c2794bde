"""Which tiles a band mask leaves work in: the tile loops' bounds, as device functions.

Causal attention and sliding windows are bands: query row r sees key columns c with
r + window_lo <= c <= r + causal_offset (the left side only with a window, the right
side only with ``causal``, which also covers a window's right side). A tile whose
entries all fall outside the band has nothing to compute, and the first and last tiles
that do are found by arithmetic, so the tiled kernels loop over just those:

    kv_tile_range(i, Sk, causal_offset, window_lo) -> (j_start, j_end)
        the K/V tiles j in [j_start, j_end) that some row of Q tile i sees: the forward
        kernels and the backward dQ kernel loop over them;
    q_tile_range(j, Sq, causal_offset, window_lo) -> (i_start, i_end)
        the Q tiles i in [i_start, i_end) with some row that sees a column of K/V tile j:
        the backward dK/dV kernels loop over them.

``causal`` and ``window`` are compile-time (the factories' arguments), so a kernel without
a mask compiles to the plain ``range(Tc)``. These are the kernel siblings of
``tiled.tiles_needed`` and ``tiled.first_q_tile``. Floor division keeps negative bounds
right: a tile that no row sees gives an empty range.
"""

import functools

from numba import cuda


@functools.lru_cache(maxsize=None)
def make_kv_tile_range(Br, Bc, causal, window):
    """``kv_tile_range`` for (Br x Bc) tiles (module docstring)."""

    @cuda.jit(device=True, inline=True)
    def kv_tile_range(i, Sk, causal_offset, window_lo):
        j_end = (Sk + Bc - 1) // Bc
        if causal:                  # the tile's last row sees up to this column
            last_visible_col = i * Br + Br - 1 + causal_offset
            j_end = min(j_end, max(0, last_visible_col // Bc + 1))
        j_start = 0
        if window:                  # the tile's first row sees from this column on
            first_visible_col = i * Br + window_lo
            j_start = min(j_end, max(0, first_visible_col // Bc))
        return j_start, j_end

    return kv_tile_range


@functools.lru_cache(maxsize=None)
def make_q_tile_range(Br, Bc, causal, window):
    """``q_tile_range`` for (Br x Bc) tiles (module docstring)."""

    @cuda.jit(device=True, inline=True)
    def q_tile_range(j, Sq, causal_offset, window_lo):
        i_end = (Sq + Br - 1) // Br
        i_start = 0
        if causal:                  # the tile's first column is first seen by this row
            first_row = j * Bc - causal_offset
            i_start = min(i_end, max(0, first_row // Br))
        if window:                  # the tile's last column is last seen by this row
            last_row = j * Bc + Bc - 1 - window_lo
            i_end = min(i_end, max(0, last_row // Br + 1))
        return i_start, i_end

    return q_tile_range
