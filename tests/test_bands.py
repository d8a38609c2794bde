"""L1: the tile loops' bounds for band masks (numbaflash/kernels/bands.py).

The tiled kernels visit only the tiles that ``kv_tile_range`` (forward, backward dQ) and
``q_tile_range`` (backward dK/dV) give. A range that missed a tile with a visible entry
would silently drop terms; a range wider than needed only costs time. So: every tile with
a visible entry is inside the range, and the range ends on such tiles (it is tight) when
no tile involved is cut by Sq (the kernels treat a ragged Q tile's missing rows like the
others, which can only widen the range). Checked against masks.visible_band on random lengths,
tiles, causal alignments and windows, calling the device functions' Python bodies.
"""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from numbaflash.kernels.bands import make_kv_tile_range, make_q_tile_range
from numbaflash.masks import band, visible_band
from strategies import examples

SIDES = (-1, 0, 1, 2, 5, 17)
band_cases = dict(
    Sq=st.integers(0, 40), Sk=st.integers(0, 40), Br=st.sampled_from([1, 2, 3, 4, 8, 16]),
    Bc=st.sampled_from([1, 2, 3, 4, 8, 16]), mode=st.sampled_from([None, "bottom_right",
                                                                    "top_left"]),
    window=st.one_of(st.none(), st.tuples(st.sampled_from(SIDES), st.sampled_from(SIDES))))


def kernel_arguments(Sq, Sk, mode, window):
    """(causal, has_window, causal_offset, window_lo), as validate.py gives the kernels."""
    upper, lower = band(Sq, Sk, mode, window)
    return (upper is not None, lower is not None, Sk if upper is None else upper,
            0 if lower is None else lower)


def tight(lo, hi, nonempty, empty_band):
    """[lo, hi) starts and ends on non-empty tiles (or is empty when none is). Not
    promised when the band itself is empty (a top-left causal mask with a window can give
    window_lo > causal_offset): the kernels then visit tiles and find nothing in them."""
    if empty_band:
        return True
    if not nonempty.size:
        return lo >= hi
    return lo == nonempty.min() and hi == nonempty.max() + 1


@settings(max_examples=examples(2))
@given(**band_cases)
def test_kv_tile_range_covers_exactly_the_visible_tiles(Sq, Sk, Br, Bc, mode, window):
    causal, has_window, offset, window_lo = kernel_arguments(Sq, Sk, mode, window)
    kv_tile_range = make_kv_tile_range(Br, Bc, causal, has_window).py_func
    mask = visible_band(Sq, Sk, mode, window)
    Tr, Tc = -(-Sq // Br), -(-Sk // Bc)
    for i in range(Tr):
        lo, hi = kv_tile_range(i, Sk, offset, window_lo)
        assert 0 <= lo and hi <= Tc
        cols = np.flatnonzero(mask[i * Br:(i + 1) * Br].any(axis=0))
        nonempty = np.unique(cols // Bc)
        assert np.all((lo <= nonempty) & (nonempty < hi)), (i, lo, hi, nonempty)
        if (i + 1) * Br <= Sq:
            empty_band = has_window and window_lo > offset
            assert tight(lo, hi, nonempty, empty_band), (i, lo, hi, nonempty)


@settings(max_examples=examples(2))
@given(**band_cases)
def test_q_tile_range_covers_exactly_the_visible_tiles(Sq, Sk, Br, Bc, mode, window):
    causal, has_window, offset, window_lo = kernel_arguments(Sq, Sk, mode, window)
    q_tile_range = make_q_tile_range(Br, Bc, causal, has_window).py_func
    mask = visible_band(Sq, Sk, mode, window)
    Tr, Tc = -(-Sq // Br), -(-Sk // Bc)
    for j in range(Tc):
        lo, hi = q_tile_range(j, Sq, offset, window_lo)
        assert 0 <= lo and hi <= Tr
        rows = np.flatnonzero(mask[:, j * Bc:(j + 1) * Bc].any(axis=1))
        nonempty = np.unique(rows // Br)
        assert np.all((lo <= nonempty) & (nonempty < hi)), (j, lo, hi, nonempty)
        if (j + 1) * Bc <= Sk and Sq % Br == 0:   # (rows past Sq count as seeing the band)
            empty_band = has_window and window_lo > offset
            assert tight(lo, hi, nonempty, empty_band), (j, lo, hi, nonempty)
