"""L1: the tiled NumPy FlashAttention-2 backward (tiled.backward, Algorithm 2) equals the
dense reference for any tile sizes (Br, Bc), in float64; its tile skipping is exact; fully
masked rows and masked NaN behave as TESTING.md says."""

import dataclasses

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from numbaflash import reference, tiled
from numbaflash.masks import causal_offset, parse_causal, visible
from backward_checks import GRADS, backward_magnitudes, check_backward, exact_masks
from strategies import SIM_SIZES, attention_cases, examples, make_case
from tolerance import assert_close_f64

MANY = examples(5)      # NumPy only
ANY_TILES = tuple(range(1, 18)) + (31, 64)
# The CPU can afford more than the simulator's caps: seqlens up to 40 whatever the tile.
CPU_SIZES = dataclasses.replace(SIM_SIZES, max_tiles_per_axis=None)


def any_tiles(d, acc_dtype):
    """Every (Br, Bc) pair from 1..17 plus tiles larger than any drawn seqlen."""
    return [(Br, Bc) for Br in ANY_TILES for Bc in ANY_TILES]


def tiled_forward(case, dtype=np.float64, tiles=None):
    """tiled.forward head by head: O (B, H, Sq, d) and L (B, H, Sq) in dtype."""
    Br, Bc = tiles or case.tiles
    O = np.empty(case.q.shape, dtype)
    L = np.empty(case.q.shape[:-1], dtype)
    for b in range(case.B):
        for h in range(case.H):
            O[b, h], L[b, h] = tiled.forward(case.q[b, h], case.k[b, h], case.v[b, h],
                                             case.causal, case.scale, Br, Bc, dtype)
    return O, L


def tiled_backward(case, dtype=np.float64, tiles=None, k=None, v=None, O=None, L=None):
    """tiled.backward head by head (after tiled.forward unless O and L are given);
    gradients (B, H, S, d) in dtype."""
    Br, Bc = tiles or case.tiles
    k = case.k if k is None else k
    v = case.v if v is None else v
    if O is None:
        O, L = tiled_forward(case, dtype, tiles)
    grads = [np.empty(case.q.shape, dtype), np.empty(k.shape, dtype), np.empty(v.shape, dtype)]
    for b in range(case.B):
        for h in range(case.H):
            for g, x in zip(grads, tiled.backward(case.dout[b, h], case.q[b, h], k[b, h],
                                                  v[b, h], O[b, h], L[b, h], case.causal,
                                                  case.scale, Br, Bc, dtype)):
                g[b, h] = x
    return grads


@settings(max_examples=MANY)
@given(case=attention_cases(dtypes=("float64",), tiles=any_tiles, with_dout=True,
                            min_seqlen=0, sizes=CPU_SIZES))
def test_tiled_backward_equals_reference_float64(case):
    O, L = tiled_forward(case)
    grads = tiled_backward(case, O=O, L=L)
    check_backward(case.dout, case.q, case.k, case.v, O, L, grads, causal=case.causal,
                   scale=case.scale)


@settings(max_examples=MANY)
@given(case=attention_cases(dtypes=("float32",), tiles=any_tiles, with_dout=True,
                            sizes=CPU_SIZES))
def test_tiled_backward_float32_within_baseline_rule(case):
    """The same loops in float32 (forward included) meet TESTING.md's rule as
    backward_checks.py applies it."""
    O, L = tiled_forward(case, np.float32)
    grads = tiled_backward(case, np.float32, O=O, L=L)
    check_backward(case.dout, case.q, case.k, case.v, O, L, grads, causal=case.causal,
                   scale=case.scale)


@settings(max_examples=MANY)
@given(case=attention_cases(dtypes=("float64",), tiles=any_tiles, with_dout=True,
                            sizes=CPU_SIZES),
       other=st.sampled_from(ANY_TILES), other_c=st.sampled_from(ANY_TILES))
def test_tiled_backward_does_not_depend_on_tiles(case, other, other_c):
    mags = backward_magnitudes(case.dout, case.q, case.k, case.v, causal=case.causal,
                               scale=case.scale)
    for name, a, b in zip(GRADS, tiled_backward(case), tiled_backward(case, tiles=(other, other_c))):
        assert_close_f64(name, a, b, 1e-13, mags[name])


@settings(max_examples=examples(20))
@given(Sq=st.integers(0, 50), Sk=st.integers(0, 50), Br=st.integers(1, 20),
       Bc=st.integers(1, 20), mode=st.sampled_from(["bottom_right", "top_left", None]))
def test_first_q_tile_skips_only_masked_tiles(Sq, Sk, Br, Bc, mode):
    """Tiles before first_q_tile have no visible entry; the first one visited has one,
    unless it is the ragged last tile (whose missing rows would have seen the column)."""
    seen = visible(Sq, Sk, mode)
    offset = causal_offset(Sq, Sk, parse_causal(mode))
    Tr, Tc = -(-Sq // Br), -(-Sk // Bc)
    for j in range(Tc):
        first = tiled.first_q_tile(j, Br, Bc, Tr, offset, parse_causal(mode))
        assert 0 <= first <= Tr
        cols = slice(j * Bc, (j + 1) * Bc)
        assert not seen[:first * Br, cols].any()
        if first < Tr - 1:
            assert seen[first * Br:(first + 1) * Br, cols].any()
        if first == Tr and Tr > 0:
            assert not seen[:, cols].any()


@settings(max_examples=MANY)
@given(case=attention_cases(dtypes=("float64",), tiles=any_tiles, with_dout=True,
                            causal=("bottom_right",), sizes=CPU_SIZES))
def test_fully_masked_rows_give_exact_zero_dQ(case):
    """Causal bottom_right with Sq > Sk: dQ rows of the rows that see no key are exactly 0
    (the exp(S - L) with L = -inf is never evaluated), and nothing is NaN."""
    case = make_case(case.B, case.H, case.Sk + 1 + case.Sq, case.Sk, case.d, "float64",
                     "bottom_right", case.tiles, case.scale, case.values, case.seed, True)
    with np.errstate(all="raise"):          # also: no invalid operation anywhere
        dQ, dK, dV = tiled_backward(case)
    masked = exact_masks(case.Sq, case.Sk, case.causal)["dQ"][:, 0]
    assert masked.sum() == case.Sq - case.Sk
    assert np.array_equal(dQ[..., masked, :], np.zeros_like(dQ[..., masked, :]))
    assert np.isfinite(dQ).all() and np.isfinite(dK).all() and np.isfinite(dV).all()


@settings(max_examples=MANY)
@given(case=attention_cases(dtypes=("float64",), tiles=any_tiles, with_dout=True,
                            causal=("top_left",), sizes=CPU_SIZES, max_seqlen=20))
def test_nan_in_keys_no_row_sees_has_no_effect(case):
    """top_left with Sk > Sq: keys Sq.. are seen by no row. NaN there changes nothing, and
    their dK, dV rows are exactly 0."""
    case = make_case(case.B, case.H, case.Sq, case.Sq + 1 + case.Sk, case.d, "float64",
                     "top_left", case.tiles, case.scale, case.values, case.seed, True)
    O, L = reference.forward(case.q, case.k, case.v, causal=case.causal, scale=case.scale)
    clean = tiled_backward(case, O=O, L=L)
    k, v = case.k.copy(), case.v.copy()
    k[..., case.Sq:, :] = np.nan
    v[..., case.Sq:, :] = np.nan
    dirty = tiled_backward(case, k=k, v=v, O=O, L=L)
    mags = backward_magnitudes(case.dout, case.q, case.k, case.v, causal=case.causal,
                               scale=case.scale)
    for name, a, b in zip(GRADS, dirty, clean):
        assert_close_f64(name, a, b, 1e-13, mags[name])
    for g in dirty[1:]:
        assert np.array_equal(g[..., case.Sq:, :], np.zeros_like(g[..., case.Sq:, :]))
