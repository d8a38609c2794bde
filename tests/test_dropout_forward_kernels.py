"""L2 (simulator) / L3 (GPU): dropout in the forward kernels, against the reference.

Every forward version that takes variants (v1, v2, v5 and the tensor-core v6 to v9)
applies dropout in the kernel (kernels/variants.py, "Dropout"): the row sum l counts every
P~ (lse stays the undropped softmax's), P~ Vj only the kept entries, and O is multiplied
by 1 / (1 - p) at the end. Each result is checked with TESTING.md's rule against the
float64 reference given the very mask ``numbaflash.dropout_mask`` returns
(reference.forward(..., dropout_p, dropout_keep)), the same-precision baseline built the
same way in the inputs' dtype (tolerance.check_forward does not take a dropout mask, so
``check_dropout`` below does its steps): non-finite positions exactly, rows that see no
key exactly 0 with lse -inf, outputs pre-filled with NaN so that an unwritten element
shows.

What is covered, per version: a ragged Sq != Sk that crosses tile boundaries; causal
with rows that see no key; a window with GQA (query head h, not its K/V head, draws the
mask); a large p (rows with every entry dropped: O = 0, lse finite); an inf in V at a key
some rows see, where a dropped entry gives 0 * inf = NaN as in the reference. Then: p = 0
is the plain kernel bit for bit, the same seed gives the same bits twice (another seed
other results), and the versions agree with each other within their bounds.

On the simulator each mma is a rendezvous of a warp's 32 Python threads, so v6 to v9 run
at fixed small shapes with small tiles (as tests/test_variants_forward_mma.py); on a GPU
(strategies.on_gpu()) the shapes grow and every version takes its own tiles.
"""

import numpy as np
import pytest

import numbaflash
from numbaflash import reference
from strategies import on_gpu
from tolerance import (assert_bitwise_equal, assert_matches_reference, baseline_dtype,
                       forward_magnitudes, masked_rows_of, score_terms, to_host)

pytestmark = pytest.mark.usefixtures("nan_prefilled_outputs")

SIMT = ("v1", "v2", "v5")               # run on the simulator at any shape
MMA = ("v6", "v7", "v8", "v9")          # tensor cores: slow on the simulator
VERSIONS = SIMT + MMA
GPU = on_gpu()
D = 64 if GPU else 8                    # head dim (v7 pads it to 16 on the simulator)
N = 8 if GPU else 1                     # sequence lengths below are scaled by N on a GPU


def dtype_of(version, default="float32"):
    """v7 takes float16 inputs only; the others float32 here (float64 and float16 for the
    SIMT versions in test_dtypes)."""
    return "float16" if version == "v7" else default


def tiles_for(version):
    """Small tiles on the simulator so that the short sequences below cross several of
    them (v7's chunk is 32 keys, v5 (Br, Bc, TM, TN)); None on a GPU: the version's rule."""
    if GPU:
        return None
    return {"v1": None, "v2": (8, 8), "v5": (8, 8, 2, 2), "v7": (16, 32)}.get(version, (16, 16))


def inputs(dtype, B, Hq, Sq, Sk, Hkv=None, seed=0):
    """q (B, Hq, Sq, D), k, v (B, Hkv, Sk, D) in ``dtype``, values in [-2, 2]; K/V head n
    has n added to its values, so that a query head reading the wrong one shows."""
    Hkv = Hq if Hkv is None else Hkv
    rng = np.random.default_rng(seed)
    q = rng.uniform(-2, 2, (B, Hq, Sq, D))
    k = rng.uniform(-2, 2, (B, Hkv, Sk, D))
    v = rng.uniform(-2, 2, (B, Hkv, Sk, D)) + np.arange(B * Hkv).reshape(B, Hkv, 1, 1)
    return q.astype(dtype), k.astype(dtype), v.astype(dtype)


def check_dropout(q, k, v, out, lse, p, seed, *, causal=None, **variants):
    """tolerance.check_forward's steps with dropout: the float64 reference and the
    same-precision baseline both given dropout_mask(B, Hq, Sq, Sk, p, seed); rows that see
    no key exactly (O = 0, lse = -inf). Returns {"O": (error, bound), "lse": ...}."""
    q = np.asarray(q)
    B, Hq, Sq, _ = q.shape
    keep = numbaflash.dropout_mask(B, Hq, Sq, k.shape[-2], p, seed)
    drop = dict(dropout_p=p, dropout_keep=keep)
    ref_O, ref_L = reference.forward(q, k, v, causal, None, **drop, **variants)
    base_O = base_L = None
    if q.dtype != np.float64:
        with np.errstate(all="ignore"):
            base_O, base_L = reference.forward(q, k, v, causal, None,
                                               dtype=baseline_dtype(q.dtype), **drop,
                                               **variants)
    out, lse = to_host(out), to_host(lse)
    assert out.dtype == q.dtype
    _, mask = score_terms(q, k, causal=causal, **variants)
    rows = masked_rows_of(mask)
    mag_O, mag_L = forward_magnitudes(q, k, v, causal=causal, **variants)
    return {
        # kept weights sum to at most 1 / (1 - p): O's natural size is max|V| / (1 - p)
        "O": assert_matches_reference("O", out, ref_O, base_O, exact=rows[..., None],
                                      magnitude=mag_O / (1 - p)),
        "lse": assert_matches_reference("lse", lse, ref_L, base_L, exact=rows,
                                        magnitude=mag_L),
    }


def run(version, q, k, v, p, seed, causal=None, tiles="default", **variants):
    """The version's (out, lse) on the host with dropout (p, seed)."""
    tiles = tiles_for(version) if tiles == "default" else tiles
    out, lse = numbaflash.attention(q, k, v, causal=causal, version=version, tiles=tiles,
                                    dropout_p=p, dropout_seed=seed, return_lse=True,
                                    **variants)
    return to_host(out), to_host(lse)


# (causal, Sq, Sk, Hq, Hkv, window, p): each crosses tile boundaries with Sq != Sk
CASES = {
    "ragged": (None, 21 * N, 37 * N, 2, 2, None, 0.3),
    # bottom_right with Sq > Sk: the first Sq - Sk rows see no key
    "causal_blind_rows": ("bottom_right", 40 * N, 23 * N, 1, 1, None, 0.2),
    "window_gqa": ("top_left", 19 * N, 35 * N, 4, 2, (6 * N, 2), 0.5),
    # most entries dropped: some rows keep none (O = 0 there, lse finite); Sk is not
    # scaled on a GPU, where rows of 72 keys would all keep some (0.9 ** 72 ~ 5e-4)
    "large_p": (None, 18 * N, 9, 1, 1, None, 0.9),
}


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("name", CASES)
def test_matches_reference(version, name):
    """Each version against the float64 reference with the same keep mask."""
    causal, Sq, Sk, Hq, Hkv, window, p = CASES[name]
    q, k, v = inputs(dtype_of(version), 1, Hq, Sq, Sk, Hkv, seed=len(name))
    kw = {} if window is None else dict(window_size=window)
    out, lse = run(version, q, k, v, p, 2**40 + 17, causal=causal, **kw)
    check_dropout(q, k, v, out, lse, p, 2**40 + 17, causal=causal, **kw)
    if name == "causal_blind_rows":
        assert np.isneginf(lse[0, 0, :Sq - Sk]).all() and (out[0, 0, :Sq - Sk] == 0).all()
    if name == "large_p":
        keep = numbaflash.dropout_mask(1, Hq, Sq, Sk, p, 2**40 + 17)
        none_kept = ~keep.any(axis=-1)
        assert none_kept.any(), "the case should have a row with every entry dropped"
        assert (out[none_kept] == 0).all() and np.isfinite(lse[none_kept]).all()


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # simulator
@pytest.mark.parametrize("version", VERSIONS)
def test_nonfinite_value_at_dropped_and_kept_entries(version):
    """An inf in V at a key that a window shows to some rows only: rows that keep it get
    inf (or NaN), rows that drop it 0 * inf = NaN (as the reference), rows that do not see
    it nothing; the tensor-core versions' non-finite fix-up multiplies the dropped P~ = 0."""
    Sq, Sk = 20 * N, 24 * N
    q, k, v = inputs(dtype_of(version), 1, 2, Sq, Sk, seed=7)
    v[0, :, 11 * N, 3] = np.inf
    kw = dict(window_size=(3, 4))
    out, lse = run(version, q, k, v, 0.5, 99, **kw)
    check_dropout(q, k, v, out, lse, 0.5, 99, **kw)
    column = out[0, :, :, 3]
    assert np.isnan(column).any() and np.isfinite(column).any()


@pytest.mark.parametrize("version", SIMT)
@pytest.mark.parametrize("dtype", ["float64", "float16"])
def test_dtypes(version, dtype):
    """float64 (within 1e-12 relative) and float16 inputs, causal, GQA."""
    q, k, v = inputs(dtype, 2, 2, 19 * N, 26 * N, Hkv=1, seed=3)
    out, lse = run(version, q, k, v, 0.25, 5, causal="bottom_right")
    check_dropout(q, k, v, out, lse, 0.25, 5, causal="bottom_right")


@pytest.mark.parametrize("version", VERSIONS)
def test_p_zero_is_plain_and_seed_repeats(version):
    """p = 0 (with a seed or without) gives the plain kernel's out and lse bit for bit;
    the same seed twice gives the same bits, another seed other results."""
    q, k, v = inputs(dtype_of(version), 1, 1, 17 * N, 21 * N, seed=11)
    tiles = tiles_for(version)
    plain = numbaflash.attention(q, k, v, causal="bottom_right", version=version,
                                 tiles=tiles, return_lse=True)
    zero = run(version, q, k, v, 0.0, 123, causal="bottom_right")
    for name, a, b in zip(("O", "lse"), zero, plain):
        assert_bitwise_equal(name, a, b)
    first = run(version, q, k, v, 0.4, 123, causal="bottom_right")
    again = run(version, q, k, v, 0.4, 123, causal="bottom_right")
    for name, a, b in zip(("O", "lse"), first, again):
        assert_bitwise_equal(name, a, b)
    other = run(version, q, k, v, 0.4, 124, causal="bottom_right")
    assert not np.array_equal(first[0], other[0], equal_nan=True)
    assert_bitwise_equal("lse", other[1], first[1])     # lse does not depend on the mask
    assert not np.array_equal(first[0], to_host(plain[0]), equal_nan=True)


def test_versions_agree():
    """The float32 versions on one input: each within its bound of the reference, hence
    within the sum of two bounds of each other (checked too: the same mask everywhere)."""
    causal, p, seed = "bottom_right", 0.35, 2**63 + 5
    q, k, v = inputs("float32", 1, 1, 27 * N, 30 * N, seed=13)
    results = {}
    for version in ("v1", "v2", "v5", "v6", "v8", "v9"):
        out, lse = run(version, q, k, v, p, seed, causal=causal)
        results[version] = (out, lse, check_dropout(q, k, v, out, lse, p, seed, causal=causal))
    out1, lse1, bounds1 = results["v1"]
    for version, (out, lse, bounds) in results.items():
        for name, a, b in (("O", out, out1), ("lse", lse, lse1)):
            finite = np.isfinite(b)
            assert np.array_equal(np.isfinite(a), finite)
            err = np.abs(a[finite].astype(np.float64) - b[finite]).max(initial=0.0)
            assert err <= bounds[name][1] + bounds1[name][1], (version, name, err)
