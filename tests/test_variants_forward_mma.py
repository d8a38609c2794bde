"""L2 (simulator) / L3 (GPU): attention variants in the tensor-core forward kernels v6 to v9.

Forward v6, v8 and v9 (float32 inputs) and v7 (float16 inputs) take every variant
(kernels/variants.py) through the shared steps of kernels/forward/mma_rows.py. On the
simulator each mma is a rendezvous of a warp's 32 Python threads, too slow for the
Hypothesis properties of test_variants.py, so these are fixed small cases: each variant
once per version, with tiles small enough (one or two warps a block, Br and Bc of 16 or
32) that several tiles, ragged edges and skipped tiles occur. Every result is checked with
TESTING.md's rule against the float64 reference (tolerance.check_forward): non-finite
positions exactly, rows that see no key exactly 0 with lse -inf, outputs pre-filled with
NaN so that an unwritten element shows. On a GPU (strategies.on_gpu()) the same cases run
at larger sizes with each version's own tiles.

What is covered: sliding windows (alone, and with causal in both alignments), GQA
(Hq = 4 on Hkv = 2, K/V heads far apart in value) and MQA, softcap, ALiBi, a boolean
attn_mask (with a fully masked tile, which the tile table skips, and a fully masked row),
a float bias with -inf entries, score_mod, mask_mod, rows that see no key, Sq != Sk, and
NaN/inf in K and V where the variant hides them or shows them to some rows only (the
kernels' non-finite fix-ups, which must use the variant's visibility).
"""

import numpy as np
import pytest

import numbaflash
from strategies import on_gpu
from test_variants import documents, every_third_key, relative_bias, squash
from tolerance import check_forward, masked_rows_of, score_terms, to_host

pytestmark = pytest.mark.usefixtures("nan_prefilled_outputs")

VERSIONS = ("v6", "v7", "v8", "v9")
DTYPE = {"v6": "float32", "v7": "float16", "v8": "float32", "v9": "float32"}
GPU = on_gpu()
D = 64 if GPU else 8                    # head dim (v7 pads it to 16 on the simulator)
N = 8 if GPU else 1                     # sequence lengths below are scaled by N on a GPU


def tiles_for(version, wide=False):
    """Small tiles on the simulator, so that a short sequence crosses several tiles: one
    warp a block (Br = 16; ``wide``: two warps), Bc the smallest the version takes (v7's
    chunk is 32 keys). None on a GPU: the version's own tile rule."""
    if GPU:
        return None
    return (32 if wide else 16, 32 if version == "v7" else 16)


def inputs(version, B, Hq, Sq, Sk, Hkv=None, seed=0, head_offsets=False):
    """q (B, Hq, Sq, D), k, v (B, Hkv, Sk, D) in the version's dtype, values in [-2, 2].
    ``head_offsets``: K/V head n gets n added to its values, so that a query head reading
    the wrong K/V head gives visibly wrong output."""
    Hkv = Hq if Hkv is None else Hkv
    rng = np.random.default_rng(seed)
    dtype = DTYPE[version]
    q = rng.uniform(-2, 2, (B, Hq, Sq, D)).astype(dtype)
    k = rng.uniform(-2, 2, (B, Hkv, Sk, D))
    v = rng.uniform(-2, 2, (B, Hkv, Sk, D))
    if head_offsets:
        shift = np.arange(B * Hkv).reshape(B, Hkv, 1, 1)
        k, v = k + 0.5 * shift, v + shift
    return q, k.astype(dtype), v.astype(dtype)


def run(version, q, k, v, causal=None, tiles=None, **variants):
    """The version's (out, lse) on the host, checked against the reference."""
    out, lse = numbaflash.attention(q, k, v, causal=causal, version=version, tiles=tiles,
                                    return_lse=True, **variants)
    out, lse = to_host(out), to_host(lse)
    check_forward(q, k, v, out, lse, causal=causal, **variants)
    return out, lse


def blind_rows(q, k, causal=None, **variants):
    """The rows that see no key, by the reference's mask."""
    _, mask = score_terms(q, k, causal=causal, **variants)
    return masked_rows_of(mask)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("causal, window, Sq, Sk", [
    (None, (3, 2), 37 * N, 29 * N),
    ("bottom_right", (5 * N, 0), 21 * N, 40 * N),
    ("top_left", (2, 7), 40 * N, 19 * N),
])
def test_window(version, causal, window, Sq, Sk):
    """Sliding windows, alone and with causal in both alignments (Sq != Sk both ways):
    the tile loop starts at the window's first tile, the window's edge tiles are masked
    per entry and the tiles inside it are not; rows that see no key give exact zeros."""
    q, k, v = inputs(version, 1, 2, Sq, Sk, seed=1)
    out, lse = run(version, q, k, v, causal=causal, tiles=tiles_for(version),
                   window_size=window)
    rows = blind_rows(q, k, causal=causal, window_size=window)
    assert np.array_equal(out[rows], np.zeros_like(out[rows]))
    assert np.isneginf(lse[rows]).all()


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("B, Hq, Hkv", [(1, 4, 2), (2, 2, 1)])
def test_gqa_and_mqa(version, B, Hq, Hkv):
    """GQA (Hq = 4 on Hkv = 2) and MQA (one K/V head per batch, B = 2): each query head
    stages its own K/V head's tiles, whose values are far apart, with a causal mask."""
    q, k, v = inputs(version, B, Hq, 19 * N, 33 * N, Hkv=Hkv, seed=2, head_offsets=True)
    run(version, q, k, v, causal="bottom_right", tiles=tiles_for(version))


@pytest.mark.parametrize("version", VERSIONS)
def test_softcap_and_alibi(version):
    """softcap (GQA, two warps a block) and ALiBi slopes per (batch, query head), with the
    causal mask: every visible entry goes through score(), on whole tiles too."""
    q, k, v = inputs(version, 1, 2, 35 * N, 30 * N, Hkv=1, seed=3)
    run(version, 4 * q, k, v, tiles=tiles_for(version, wide=True), softcap=2.5)
    slopes = np.array([[0.5, 0.125]], np.float32)
    run(version, q, k, v, causal="top_left", tiles=tiles_for(version), alibi_slopes=slopes)


@pytest.mark.parametrize("version", VERSIONS)
def test_bool_mask_skips_empty_tiles(version):
    """A boolean attn_mask (per head) with a band of keys hidden from every row, wider than
    a tile (so the tile table skips a tile), a row that sees no key, and NaN and inf in the
    hidden keys' K and V: no effect, the blind row exactly 0 with lse -inf."""
    Sq, Sk = 20 * N, 70 * N
    q, k, v = inputs(version, 1, 2, Sq, Sk, seed=4)
    rng = np.random.default_rng(4)
    mask = rng.random((1, 2, Sq, Sk)) < 0.6
    hidden = slice(10 * N, 66 * N)          # whole K/V tiles of every version's Bc
    mask[..., hidden] = False
    mask[0, 1, 3] = False                   # a row that sees no key
    k[0, :, 20 * N] = np.nan
    v[0, :, 33 * N] = np.inf
    out, lse = run(version, q, k, v, tiles=tiles_for(version), attn_mask=mask)
    assert np.array_equal(out[0, 1, 3], np.zeros_like(out[0, 1, 3]))
    assert np.isneginf(lse[0, 1, 3]) and not np.isnan(out).any()


@pytest.mark.parametrize("version", VERSIONS)
def test_bias_with_minus_inf(version):
    """A float bias (broadcast over batch and heads) with -inf entries: a -inf column, a row
    that is -inf everywhere (it sees keys, all with probability 0: O = 0, lse = -inf), and
    an inf in V at a key that the window shows to some rows only (the values fix-up)."""
    Sq, Sk = 23 * N, 37 * N
    q, k, v = inputs(version, 1, 2, Sq, Sk, seed=5)
    rng = np.random.default_rng(5)
    bias = rng.uniform(-1, 1, (Sq, Sk)).astype(np.float32)
    bias[:, 7] = -np.inf
    bias[9] = -np.inf
    v[0, 0, 30 * N, 1] = np.inf
    run(version, q, k, v, tiles=tiles_for(version, wide=True), attn_mask=bias,
        window_size=(4 * N, 3))


@pytest.mark.parametrize("version", VERSIONS)
def test_score_mod(version):
    """score_mod: a non-linear one, and a per-head relative bias with the causal mask."""
    q, k, v = inputs(version, 1, 2, 18 * N, 33 * N, seed=6)
    run(version, q, k, v, tiles=tiles_for(version), score_mod=squash)
    run(version, q, k, v, causal="bottom_right", tiles=tiles_for(version),
        score_mod=relative_bias)


@pytest.mark.parametrize("version", VERSIONS)
def test_mask_mod(version):
    """mask_mod: a document mask (blocks of 5: most tiles empty, skipped by the table) with
    a window, and NaN in one key (only the rows of its document that the window lets see
    it become NaN); a mask by batch (B = 2) with causal."""
    q, k, v = inputs(version, 1, 2, 40 * N, 40 * N, seed=7)
    k[0, 0, 35 * N + 1] = np.nan
    run(version, q, k, v, tiles=tiles_for(version, wide=True), mask_mod=documents,
        window_size=(3, 2))
    q, k, v = inputs(version, 2, 1, 34 * N, 21 * N, seed=8)
    run(version, q, k, v, causal="top_left", tiles=tiles_for(version),
        mask_mod=every_third_key)


@pytest.mark.parametrize("version", VERSIONS)
def test_rows_that_see_no_key(version):
    """window (0, 0) with Sq > Sk: the first Sq - Sk rows see no key (exact 0, lse -inf),
    the others one key each; with ALiBi on top (score() on a one-key row)."""
    Sq, Sk = 30 * N, 13 * N
    q, k, v = inputs(version, 1, 1, Sq, Sk, seed=9)
    slopes = np.array([0.75], np.float32)
    out, lse = run(version, q, k, v, tiles=tiles_for(version), window_size=(0, 0),
                   alibi_slopes=slopes)
    blind = Sq - Sk
    assert np.array_equal(out[..., :blind, :], np.zeros_like(out[..., :blind, :]))
    assert np.isneginf(lse[..., :blind]).all()
    assert np.isfinite(lse[..., blind:]).all()
