"""L1: the tiled NumPy FlashAttention-2 forward (numbaflash/tiled.py) equals the dense
reference for any tile sizes (Br, Bc), to ~1e-13 in float64."""

import dataclasses

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from numbaflash import reference, tiled
from numbaflash.masks import causal_offset, parse_causal, visible
from strategies import SIM_SIZES, attention_cases, examples
from tolerance import assert_close_f64, forward_magnitudes, fully_masked_rows

RTOL = 1e-13
MANY = examples(5)

ANY_TILES = tuple(range(1, 18)) + (31, 64)


def any_tiles(d, acc_dtype):
    """Every (Br, Bc) pair from 1..17 plus tiles larger than any drawn seqlen."""
    return [(Br, Bc) for Br in ANY_TILES for Bc in ANY_TILES]


# The CPU can afford more than the simulator's caps: seqlens up to 40 whatever the tile.
CPU_SIZES = dataclasses.replace(SIM_SIZES, max_tiles_per_axis=None)


def per_head(case, fn):
    O = np.empty(case.q.shape, np.float64)
    L = np.empty(case.q.shape[:-1], np.float64)
    for b in range(case.B):
        for h in range(case.H):
            O[b, h], L[b, h] = fn(case.q[b, h], case.k[b, h], case.v[b, h])
    return O, L


@settings(max_examples=MANY)
@given(case=attention_cases(dtypes=("float64",), tiles=any_tiles, min_seqlen=0,
                            sizes=CPU_SIZES))
def test_tiled_equals_reference_float64(case):
    Br, Bc = case.tiles
    O, L = per_head(case, lambda q, k, v: tiled.forward(q, k, v, causal=case.causal,
                                                        scale=case.scale, Br=Br, Bc=Bc))
    ref_O, ref_L = reference.forward(case.q, case.k, case.v, causal=case.causal,
                                     scale=case.scale)
    mO, mL = forward_magnitudes(case.q, case.k, case.v, causal=case.causal, scale=case.scale)
    assert_close_f64("O", O, ref_O, RTOL, mO)
    assert_close_f64("lse", L, ref_L, RTOL, mL)
    rows = fully_masked_rows(case.Sq, case.Sk, case.causal)
    assert np.array_equal(O[..., rows, :], np.zeros_like(O[..., rows, :]))
    assert np.all(L[..., rows] == -np.inf)


@settings(max_examples=MANY)
@given(Sq=st.integers(0, 50), Sk=st.integers(0, 50), Br=st.integers(1, 20),
       Bc=st.integers(1, 20), mode=st.sampled_from([None, "bottom_right", "top_left"]))
def test_tiles_needed_visits_every_visible_tile(Sq, Sk, Br, Bc, mode):
    """Causal skipping never skips a tile that holds a visible key, and never goes past Tc."""
    Tr, Tc = -(-Sq // Br), -(-Sk // Bc)
    offset = causal_offset(Sq, Sk, parse_causal(mode))
    mask = visible(Sq, Sk, mode)
    for i in range(Tr):
        n = tiled.tiles_needed(i, Br, Bc, Tc, offset, mode)
        assert 0 <= n <= Tc
        rows = mask[i * Br:(i + 1) * Br]
        cols = np.flatnonzero(rows.any(axis=0))
        if cols.size:
            assert n >= cols.max() // Bc + 1, (i, n, cols.max())
