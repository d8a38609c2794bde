"""L2 (simulator) / L3 (GPU): attention variants, forward and backward, against the reference.

Variants (numbaflash/kernels/variants.py): sliding windows (with and without causal),
GQA/MQA, softcap, ALiBi, boolean and additive attn_mask, and user score_mod / mask_mod.
Every check is TESTING.md's rule (tolerance.py, backward_checks.py) against the float64
reference (reference.py), with the variant passed to both; fully masked rows must be
exactly 0 (lse -inf), keys nobody sees exactly 0 in dK and dV, and outputs are pre-filled
with NaN so an unwritten element shows.

One strategy draws a case (strategies.attention_cases) and a variant to go with it:
``variant_cases``. Kernel versions that refuse variants (forward v3, backward v2) are
checked to refuse with a clear ValueError.

GQA: attention_cases draw B * H <= 2 on the simulator, so the variant tests see GQA only
as MQA (2 query heads on 1 K/V head), where every query-to-K/V head mapping gives head 0.
The GQA tests draw strategies.gqa_cases instead (B up to 2, 2-3 K/V heads, groups of 2-8,
short sequences when there are many heads) for every version the library plans a GQA
input for (forward and backward), with the other variants on top (ALiBi slopes and masks
per query head); a fixed case with K/V heads far apart in value shows a wrong head as
wrong values; every other version must refuse GQA by name.
"""

import numpy as np
import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from numba import cuda

import numbaflash
from numbaflash import launcher, reference
from numbaflash.kernels import backward as bwd
from numbaflash.kernels import forward as fwd
from numbaflash.api import _variant_arrays
from numbaflash.validate import check_attention_inputs
from numbaflash.masks import band, parse_window, visible_band
from backward_checks import check_backward, exact_masks
from strategies import (attention_cases, different_tilings, examples, gqa_cases, make_case,
                        on_gpu, refusal, sizes_for_backend, version_params)
from test_backward_kernels import backward_tiles
from tolerance import (assert_bitwise_equal, assert_close_f64, check_forward, masked_rows_of,
                       score_terms, to_host)

pytestmark = pytest.mark.usefixtures("nan_prefilled_outputs")

# The versions that take variants (their module's VARIANTS), asked of the registries: each
# runs the property tests below (the tensor-core ones only on a GPU: strategies.version_params);
# every other version is checked to refuse a variant by name.
FORWARD_VARIANTS = tuple(v for v in fwd.VERSIONS if fwd.module(v).VARIANTS)
BACKWARD_VARIANTS = tuple(v for v in bwd.VERSIONS if bwd.module(v).VARIANTS)
ALL_DTYPES = ("float64", "float32", "float16")

WINDOW_SIDES = (-1, 0, 1, 2, 5)


# --- user modifiers for the tests (Numba device functions) ---------------------------------

@cuda.jit(device=True)
def relative_bias(score, b, h, q_idx, kv_idx):
    """A relative-position bias: 0.25 per position of distance, by head."""
    return score - 0.25 * (h + 1) * abs(q_idx - kv_idx)


@cuda.jit(device=True)
def relative_bias_grad(score, b, h, q_idx, kv_idx):
    return 1.0


@cuda.jit(device=True)
def squash(score, b, h, q_idx, kv_idx):
    """A non-linear score_mod with a derivative that is not 1: s -> s - s^3 / 30."""
    return score - score * score * score / 30.0


@cuda.jit(device=True)
def squash_grad(score, b, h, q_idx, kv_idx):
    return 1.0 - score * score / 10.0


@cuda.jit(device=True)
def documents(b, h, q_idx, kv_idx):
    """A document mask: queries and keys in blocks of 5 positions, each sees its own."""
    return q_idx // 5 == kv_idx // 5


@cuda.jit(device=True)
def every_third_key(b, h, q_idx, kv_idx):
    return kv_idx % 3 != b


SCORE_MODS = {"relative": (relative_bias, relative_bias_grad), "squash": (squash, squash_grad)}
MASK_MODS = {"documents": documents, "every_third_key": every_third_key}


# --- strategy ----------------------------------------------------------------------------

@st.composite
def variant_cases(draw, *, dtypes=("float64", "float32", "float16"), with_dout=False,
                  kinds=("window", "gqa", "softcap", "alibi", "mask", "mods"), tiles="forward",
                  cases=None):
    """``(case, k, v, variants)``: a drawn case, its k and v (fewer heads with GQA), and
    the variant keyword arguments for attention(). ``cases``: a strategy of cases to draw
    from instead of attention_cases(dtypes, with_dout, tiles) (e.g. gqa_cases, whose k and
    v already have fewer heads)."""
    case = draw(attention_cases(dtypes=dtypes, with_dout=with_dout, tiles=tiles)
                if cases is None else cases)
    k, v = case.k, case.v
    kw = {}
    if "window" in kinds and draw(st.booleans()):
        kw["window_size"] = (draw(st.sampled_from(WINDOW_SIDES)),
                             draw(st.sampled_from(WINDOW_SIDES)))
    if "gqa" in kinds and case.Hkv == case.H > 1 and draw(st.booleans()):
        # MQA (one K/V head) or another divisor of H
        Hkv = draw(st.sampled_from([h for h in range(1, case.H) if case.H % h == 0]))
        k, v = k[:, :Hkv].copy(), v[:, :Hkv].copy()
    if "softcap" in kinds and draw(st.booleans()):
        kw["softcap"] = draw(st.sampled_from([0.5, 2.0, 30.0]))
    if "alibi" in kinds and draw(st.booleans()):
        per_batch = draw(st.booleans())
        shape = (case.B, case.H) if per_batch else (case.H,)
        kw["alibi_slopes"] = case.rng.uniform(0.05, 1.0, shape).astype(np.float32)
    if "mask" in kinds and draw(st.booleans()):
        # a boolean mask or a float bias, with a shape that broadcasts to (B, H, Sq, Sk)
        full = (case.B, case.H, case.Sq, case.Sk)
        rank = draw(st.integers(2, 4))
        shape = tuple(n if draw(st.booleans()) else 1 for n in full[4 - rank:])
        if draw(st.booleans()):
            kw["attn_mask"] = case.rng.random(shape) < 0.7
        else:
            bias = case.rng.uniform(-2, 2, shape).astype(np.float32)
            if draw(st.booleans()):
                bias[case.rng.random(shape) < 0.2] = -np.inf    # -inf bias: weight 0
            kw["attn_mask"] = bias.astype(case.dtype)
    if "mods" in kinds and draw(st.booleans()):
        # squash maps a -inf score (a -inf bias) to NaN, which then propagates, as it
        # should (docs/variants.md); the rule's checks need finite baselines, so squash is
        # drawn only without -inf biases.
        neg_inf = "attn_mask" in kw and np.isneginf(kw["attn_mask"]).any()
        name = "relative" if neg_inf else draw(st.sampled_from(sorted(SCORE_MODS)))
        kw["score_mod"], kw["score_mod_grad"] = SCORE_MODS[name]
    if "mods" in kinds and draw(st.booleans()):
        kw["mask_mod"] = MASK_MODS[draw(st.sampled_from(sorted(MASK_MODS)))]
    return case, k, v, kw


def forward(case, k, v, variants, version, with_tiles=True):
    tiles = case.tiles if (with_tiles and version == "v2") else None
    out, lse = numbaflash.attention(case.q, k, v, return_lse=True, version=version, tiles=tiles,
                                    causal=case.causal, scale=case.scale, **variants)
    return to_host(out), to_host(lse)


# --- forward -------------------------------------------------------------------------------

def takes_dtype(explain, version, dtype, d=16):
    """Whether ``explain`` plans ``version`` for a plain input of ``dtype`` and head dim
    ``d`` here (v5 and the tensor-core versions refuse float64, v7 everything but float16,
    the tensor-core versions d > 128). A drawn case a version refuses for its dtype or head
    dim is not its case (the head-dim refusal is tested at the end of this file)."""
    q = np.zeros((1, 1, 4, d), np.dtype(dtype))
    try:
        explain(q, q, q, version=version)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("version", version_params(FORWARD_VARIANTS, numbaflash.explain,
                                                   ALL_DTYPES))
@settings(max_examples=examples())
@given(drawn=variant_cases())
@example(drawn=(make_case(B=1, H=2, Sq=9, Sk=5, d=3, dtype="float64", causal=None,
                          tiles=(4, 2), seed=3), None, None, {"window_size": (1, 0)}))
def test_forward_matches_reference(drawn, version):
    case, k, v, kw = drawn
    assume(takes_dtype(numbaflash.explain, version, case.dtype, case.d))
    k = case.k if k is None else k
    v = case.v if v is None else v
    out, lse = forward(case, k, v, kw, version)
    check_forward(case.q, k, v, out, lse, causal=case.causal, scale=case.scale, **kw)


@settings(max_examples=examples(0.5))
@given(drawn=variant_cases(dtypes=("float64",)), data=st.data())
def test_forward_tile_size_invariance(drawn, data):
    """v2 with two tilings agrees to 1e-12 (float64) with any variant (v1 is held to the
    reference by test_forward_matches_reference). The other tiling cuts Sq or Sk at other
    places than the case's (strategies.different_tilings): one that cuts both alike runs
    the same arithmetic, so problems too short for any other cut (Sq, Sk <= 2) are not
    drawn."""
    case, k, v, kw = drawn
    others = different_tilings(case.Sq, case.Sk, case.tiles,
                               [(Br, Bc) for Br in (2, 4, 8, 16) for Bc in (2, 4, 8, 16)])
    assume(others)
    other = data.draw(st.sampled_from(others), label="other tiles")
    out1, lse1 = forward(case, k, v, kw, "v2")
    out2, lse2 = numbaflash.attention(case.q, k, v, return_lse=True, tiles=other,
                                      version="v2", causal=case.causal, scale=case.scale, **kw)
    size, _ = score_terms(case.q, k, causal=case.causal, scale=case.scale, **kw)
    mag_L = float(size.max(initial=0)) + np.log(max(case.Sk, 1))
    assert_close_f64("O", out2, out1, 1e-12, float(np.abs(v).max(initial=0)))
    assert_close_f64("lse", lse2, lse1, 1e-12, mag_L)


def test_window_convention_is_flash_attentions():
    """Query i sees keys j with i + Sk - Sq - left <= j <= i + Sk - Sq + right; -1 is
    unbounded; causal=True is (-1, 0); causal and a window combine (the narrower wins)."""
    Sq, Sk = 4, 7
    got = visible_band(Sq, Sk, None, (2, 1))
    i, j = np.arange(Sq)[:, None], np.arange(Sk)[None, :]
    assert np.array_equal(got, (j >= i + Sk - Sq - 2) & (j <= i + Sk - Sq + 1))
    assert np.array_equal(visible_band(Sq, Sk, True), visible_band(Sq, Sk, None, (-1, 0)))
    assert np.array_equal(visible_band(Sq, Sk, "top_left", (1, 3)),
                          visible_band(Sq, Sk, "top_left") & visible_band(Sq, Sk, None, (1, 3)))
    assert parse_window((-1, -1)) is None and band(Sq, Sk, None, None) == (None, None)


@pytest.mark.parametrize("version", version_params(FORWARD_VARIANTS, numbaflash.explain))
def test_fully_masked_rows_are_exact_zero(version):
    """A window (0, 0) with Sq > Sk, a boolean mask with an all-False row, and a -inf bias
    row: those rows give out exactly 0 and lse -inf, with NaN in the masked keys."""
    case = make_case(B=1, H=2, Sq=9, Sk=5, d=4, dtype="float32", tiles=(4, 4), seed=1)
    k = case.k.copy()
    k[..., 0, :] = np.nan                   # key 0 is masked for every row below
    mask = np.ones((case.Sq, case.Sk), bool)
    mask[:, 0] = False
    mask[3] = False
    bias = np.zeros((case.Sq, case.Sk), np.float32)
    bias[:, 0] = np.nan * 0 - np.inf        # masked by the bool mask anyway
    bias[6] = -np.inf
    for kw in ({"window_size": (0, 0), "attn_mask": mask},
               {"attn_mask": mask, "alibi_slopes": np.array([0.5, 1.0], np.float32)}):
        out, lse = forward(case, k, case.v, kw, version)
        _, vis = score_terms(case.q, k, causal=None, scale=None, **kw)
        rows = masked_rows_of(vis)
        assert rows.any()
        assert np.array_equal(out[rows], np.zeros_like(out[rows]))
        assert np.isneginf(lse[rows]).all() and not np.isnan(out).any()
        check_forward(case.q, k, case.v, out, lse, **kw)


@pytest.mark.parametrize("version", version_params(FORWARD_VARIANTS, numbaflash.explain))
def test_nan_in_masked_keys_has_no_effect(version):
    """NaN in keys and values that a window hides: the output is bitwise unchanged."""
    case = make_case(B=1, H=1, Sq=12, Sk=12, d=4, dtype="float32", tiles=(4, 4), seed=5)
    kw = {"window_size": (2, 1)}
    out, lse = forward(case, case.k, case.v, kw, version)
    vis = visible_band(12, 12, None, (2, 1))
    k, v = case.k.copy(), case.v.copy()
    k[..., 11, :] = np.nan                  # seen only by rows 9..11
    v[..., 11, :] = np.nan
    out2, lse2 = forward(case, k, v, kw, version)
    blind = ~vis[:, 11]
    assert_bitwise_equal("O", out2[..., blind, :], out[..., blind, :])
    assert np.isnan(out2[..., ~blind, :]).all()


# --- backward ------------------------------------------------------------------------------

@pytest.mark.parametrize("version", version_params(BACKWARD_VARIANTS,
                                                   numbaflash.explain_backward, ALL_DTYPES))
@settings(max_examples=examples())
@given(drawn=variant_cases(with_dout=True, tiles=backward_tiles))
@example(drawn=(make_case(B=1, H=1, Sq=3, Sk=3, d=4, dtype="float64", causal="bottom_right",
                          tiles=(4, 4), seed=0, with_dout=True), None, None,
                {"attn_mask": np.array([[1.5], [-np.inf], [1.2]]),
                 "score_mod": relative_bias, "score_mod_grad": relative_bias_grad}))
@example(drawn=(make_case(B=1, H=2, Sq=7, Sk=9, d=4, dtype="float32", causal="top_left",
                          tiles=(4, 2), seed=2, with_dout=True), None, None,
                {"window_size": (2, -1), "softcap": 2.0}))
def test_backward_matches_reference(drawn, version):
    case, k, v, kw = drawn
    assume(takes_dtype(numbaflash.explain_backward, version, case.dtype, case.d))
    k = case.k if k is None else k
    v = case.v if v is None else v
    out, lse = forward(case, k, v, kw, "v2", with_tiles=False)
    # v1 takes the drawn (Br, Bc); the register-blocked and tensor-core versions run their
    # own tile rules (small tiles on the simulator)
    tiles = case.tiles if version == "v1" else None
    grads = numbaflash.attention_backward(case.dout, case.q, k, v, out, lse, tiles=tiles,
                                          version=version, causal=case.causal,
                                          scale=case.scale, **kw)
    grads = tuple(to_host(g) for g in grads)
    assert grads[1].shape == k.shape and grads[2].shape == v.shape
    check_backward(case.dout, case.q, k, v, out, lse, grads, causal=case.causal,
                   scale=case.scale, **kw)


def test_gqa_backward_is_deterministic_and_equals_the_expanded_heads():
    """MQA: dK, dV equal the group sums of attention with K, V copied per query head (in
    float64 to 1e-12), and repeated runs are bitwise identical (no atomics)."""
    case = make_case(B=1, H=2, Sq=9, Sk=7, d=4, dtype="float64", tiles=(4, 4), seed=9,
                     with_dout=True)
    k, v = case.k[:, :1].copy(), case.v[:, :1].copy()
    kw = {"window_size": (3, 1)}
    out, vjp = numbaflash.attention_vjp(case.q, k, v, backward_tiles=(4, 4), **kw)
    g1, g2 = vjp(case.dout), vjp(case.dout)
    for a, b in zip(g1, g2):
        assert_bitwise_equal("grad", to_host(a), to_host(b))
    ke, ve = reference.expand_kv(case.q, k), reference.expand_kv(case.q, v)
    out_e, vjp_e = numbaflash.attention_vjp(case.q, ke, ve, backward_tiles=(4, 4), **kw)
    assert_close_f64("O", out, out_e, 1e-12, float(np.abs(v).max()))
    dq, dk, dv = vjp_e(case.dout)
    assert_close_f64("dQ", g1[0], dq, 1e-12, float(np.abs(dq).max()))
    assert_close_f64("dK", g1[1], reference.reduce_kv(to_host(dk), k.shape), 1e-12,
                     float(np.abs(dk).sum()))
    assert_close_f64("dV", g1[2], reference.reduce_kv(to_host(dv), v.shape), 1e-12,
                     float(np.abs(dv).sum()))


# --- GQA: several K/V heads, several batches -------------------------------------------------

def gqa_refusal(explain, version):
    """Why ``explain`` (numbaflash.explain or explain_backward) refuses ``version`` for a
    GQA input here (B = 2, 4 query heads on 2 K/V heads, in float32, or float16 for a
    version that takes float16 only), or None if it plans it."""
    dtype = np.float32 if refusal(explain, version, "float32") is None else np.float16
    q = np.zeros((2, 4, 8, 4), dtype)
    k = np.zeros((2, 2, 8, 4), dtype)
    try:
        explain(q, k, k, version=version)
    except ValueError as err:
        return str(err)
    return None


# The versions the library plans a GQA input for, asked of the library itself; each other
# version is checked to refuse GQA by name (test_versions_without_gqa_refuse_it).
GQA_FORWARD = tuple(v for v in fwd.VERSIONS if gqa_refusal(numbaflash.explain, v) is None)
GQA_BACKWARD = tuple(v for v in bwd.VERSIONS
                     if gqa_refusal(numbaflash.explain_backward, v) is None)
NO_GQA = ([("explain", v) for v in fwd.VERSIONS if v not in GQA_FORWARD]
          + [("explain_backward", v) for v in bwd.VERSIONS if v not in GQA_BACKWARD])


def test_some_versions_take_gqa():
    """The GQA tests below run on something: forward v2 (the default for variants) and
    backward v1 at least."""
    assert "v2" in GQA_FORWARD and "v1" in GQA_BACKWARD, (GQA_FORWARD, GQA_BACKWARD)


@pytest.mark.parametrize("explain, version", NO_GQA)
def test_versions_without_gqa_refuse_it(explain, version):
    """A version that the GQA tests leave out refuses GQA with a ValueError naming it."""
    why = gqa_refusal(getattr(numbaflash, explain), version)
    assert why is not None and "GQA" in why, why


# The other variants on top of GQA; "gqa" itself is the case's (gqa_cases).
GQA_EXTRAS = ("window", "softcap", "alibi", "mask", "mods")


@pytest.mark.parametrize("version", version_params(GQA_FORWARD, numbaflash.explain,
                                                   ALL_DTYPES))
@settings(max_examples=examples(0.5))
@given(drawn=variant_cases(cases=gqa_cases(dtypes=("float64", "float32", "float16")),
                           kinds=GQA_EXTRAS))
@example(drawn=(make_case(B=2, H=6, Hkv=3, Sq=5, Sk=9, d=4, dtype="float64", tiles=(4, 4),
                          causal="bottom_right", seed=12), None, None, {}))
@example(drawn=(make_case(B=1, H=16, Hkv=2, Sq=3, Sk=5, d=2, dtype="float32", tiles=(2, 4),
                          seed=13), None, None,
                {"alibi_slopes": np.linspace(0.1, 1.0, 16).astype(np.float32)}))
def test_gqa_forward_matches_reference(drawn, version):
    """GQA with 2-3 K/V heads, groups of 2-8 and B up to 2 (strategies.gqa_cases), with
    the other variants drawn on top: out and lse by TESTING.md's rule."""
    case, k, v, kw = drawn
    assume(takes_dtype(numbaflash.explain, version, case.dtype, case.d))
    k = case.k if k is None else k
    v = case.v if v is None else v
    assert k.shape[1] == case.Hkv >= 2 and case.H % case.Hkv == 0
    out, lse = forward(case, k, v, kw, version)
    check_forward(case.q, k, v, out, lse, causal=case.causal, scale=case.scale, **kw)


@pytest.mark.parametrize("version", version_params(GQA_BACKWARD, numbaflash.explain_backward,
                                                   ALL_DTYPES))
@settings(max_examples=examples(0.25))
@given(drawn=variant_cases(cases=gqa_cases(dtypes=("float64", "float32", "float16"),
                                           with_dout=True, tiles=backward_tiles),
                           kinds=GQA_EXTRAS))
@example(drawn=(make_case(B=2, H=4, Hkv=2, Sq=7, Sk=6, d=3, dtype="float64", tiles=(4, 2),
                          causal="top_left", seed=14, with_dout=True), None, None, {}))
def test_gqa_backward_matches_reference(drawn, version):
    """The backward of the GQA cases above: dK and dV summed over each group of query
    heads, by backward_checks' rule (exact zeros for keys no head of the group sees)."""
    case, k, v, kw = drawn
    assume(takes_dtype(numbaflash.explain_backward, version, case.dtype, case.d))
    k = case.k if k is None else k
    v = case.v if v is None else v
    # On the simulator the forward runs with the case's small tiles: its default (64, 64)
    # costs about a second per block there, and GQA has many blocks.
    out, lse = forward(case, k, v, kw, "v2", with_tiles=not on_gpu())
    grads = numbaflash.attention_backward(case.dout, case.q, k, v, out, lse, version=version,
                                          tiles=case.tiles if version == "v1" else None,
                                          causal=case.causal, scale=case.scale, **kw)
    grads = tuple(to_host(g) for g in grads)
    assert grads[1].shape == k.shape and grads[2].shape == v.shape
    check_backward(case.dout, case.q, k, v, out, lse, grads, causal=case.causal,
                   scale=case.scale, **kw)


def far_apart_heads(B=2, Hkv=2, group=4, Sq=5, Sk=6, d=2, seed=31):
    """q (B, H, Sq, d), k, v (B, Hkv, Sk, d) and dout (B, H, Sq, d) in float64 where every
    K/V head is far from the others in value: V of K/V head n = b * Hkv + g is 10 n plus
    noise in [-1, 1] and K is scaled by n + 1, and dout of query head h (in every batch) is
    10 h plus noise. A query head that reads the wrong K/V head is off by 10 or more."""
    rng = np.random.default_rng(seed)
    H = Hkv * group
    n = np.arange(B * Hkv).reshape(B, Hkv, 1, 1)
    q = rng.uniform(-1, 1, (B, H, Sq, d))
    k = rng.uniform(-1, 1, (B, Hkv, Sk, d)) * (n + 1)
    v = rng.uniform(-1, 1, (B, Hkv, Sk, d)) + 10.0 * n
    dout = rng.uniform(-1, 1, (B, H, Sq, d)) + 10.0 * np.arange(H).reshape(1, H, 1, 1)
    return q, k, v, dout


def widest_dtype(explain, version):
    """The widest of float64, float32, float16 that ``version`` takes."""
    return next(t for t in ALL_DTYPES if takes_dtype(explain, version, t))


@pytest.mark.parametrize("version", version_params(GQA_FORWARD, numbaflash.explain,
                                                   ALL_DTYPES))
def test_gqa_each_query_head_reads_its_own_kv_head(version):
    """B = 2, 2 K/V heads far apart in value (far_apart_heads), groups of 4: every output
    row of query head (b, h) is a convex combination of the rows of V head (b, h // 4), so
    it lies within 1 of that head's offset; and the output is bitwise the output with K
    and V copied per query head (reference.expand_kv: the same arithmetic per head). In
    the widest dtype the version takes."""
    dtype = widest_dtype(numbaflash.explain, version)
    q, k, v, _ = (x.astype(dtype) for x in far_apart_heads())
    B, H, group = q.shape[0], q.shape[1], q.shape[1] // k.shape[1]
    tiles = (4, 4) if version == "v2" else None
    out, lse = (to_host(x) for x in numbaflash.attention(q, k, v, return_lse=True,
                                                         version=version, tiles=tiles))
    for b in range(B):
        for h in range(H):
            want = 10.0 * (b * k.shape[1] + h // group)
            err = np.abs(out[b, h] - want).max()
            assert err <= 1.0, (f"query head (b={b}, h={h}) should read K/V head "
                                f"{h // group} (values near {want}); its output is "
                                f"{err:.3g} away")
    check_forward(q, k, v, out, lse)
    ke, ve = reference.expand_kv(q, k), reference.expand_kv(q, v)
    out_e, lse_e = numbaflash.attention(q, ke, ve, return_lse=True, version=version,
                                        tiles=tiles)
    assert_bitwise_equal("O", out, to_host(out_e))
    assert_bitwise_equal("lse", lse, to_host(lse_e))


@pytest.mark.parametrize("version", version_params(GQA_BACKWARD, numbaflash.explain_backward,
                                                   ALL_DTYPES))
def test_gqa_gradients_go_to_their_own_kv_head(version):
    """far_apart_heads again (B = 2, 2 K/V heads, groups of 4; dout of query head h near
    10 h). Without a mask every row of P sums to 1, so the sum over keys of dV for K/V
    head (b, g) is the sum of dout over the rows of its group's query heads 4g .. 4g + 3
    (other heads give sums hundreds away); dQ is bitwise dQ with K and V copied per query
    head, and dK, dV are its group sums (to 1e-12 in float64, 1e-5 in float32: the
    group is summed in another order); and the reference's rule holds. In the widest
    dtype the version takes; tiles (4, 4) for v1, the version's own rule otherwise."""
    dtype = widest_dtype(numbaflash.explain_backward, version)
    q, k, v, dout = (x.astype(dtype) for x in far_apart_heads())
    rtol = 1e-12 if dtype == "float64" else 1e-5
    tiles = (4, 4) if version == "v1" else None
    B, Hkv, group = q.shape[0], k.shape[1], q.shape[1] // k.shape[1]
    out, lse = numbaflash.attention(q, k, v, return_lse=True, version="v2", tiles=(4, 4))
    dq, dk, dv = (to_host(g) for g in numbaflash.attention_backward(
        dout, q, k, v, out, lse, version=version, tiles=tiles))
    want = dout.astype(np.float64).reshape(B, Hkv, group, *dout.shape[2:]).sum(axis=(2, 3))
    assert_close_f64("sum over keys of dV", dv.astype(np.float64).sum(axis=2), want, rtol,
                     float(np.abs(dout).sum()))
    check_backward(dout, q, k, v, to_host(out), to_host(lse), (dq, dk, dv))
    ke, ve = reference.expand_kv(q, k), reference.expand_kv(q, v)
    dq_e, dk_e, dv_e = (to_host(g) for g in numbaflash.attention_backward(
        dout, q, ke, ve, out, lse, version=version, tiles=tiles))
    assert_bitwise_equal("dQ", dq, dq_e)
    dk_e, dv_e = dk_e.astype(np.float64), dv_e.astype(np.float64)
    assert_close_f64("dK", dk, reference.reduce_kv(dk_e, k.shape), rtol,
                     float(np.abs(dk_e).sum()))
    assert_close_f64("dV", dv, reference.reduce_kv(dv_e, v.shape), rtol,
                     float(np.abs(dv_e).sum()))


def test_fully_masked_rows_give_zero_gradients():
    case = make_case(B=1, H=1, Sq=9, Sk=5, d=4, dtype="float64", tiles=(4, 4), seed=4,
                     with_dout=True)
    kw = {"window_size": (0, 0)}            # Sq > Sk: the first 4 rows see no key
    out, lse = forward(case, case.k, case.v, kw, "v2")
    grads = [to_host(g) for g in numbaflash.attention_backward(
        case.dout, case.q, case.k, case.v, out, lse, tiles=(4, 4), **kw)]
    exact = exact_masks(9, 5, None, visible_band(9, 5, None, (0, 0)))
    assert exact["dQ"].any()
    assert np.array_equal(grads[0][0, 0, :4], np.zeros((4, 4)))
    assert all(np.isfinite(g).all() for g in grads)
    check_backward(case.dout, case.q, case.k, case.v, out, lse, grads, **kw)


# --- skipped tiles -----------------------------------------------------------------------

@settings(max_examples=examples())
@given(drawn=variant_cases(dtypes=("float32",), kinds=("window", "mask", "mods")),
       data=st.data())
def test_tile_table_marks_exactly_the_tiles_with_a_visible_entry(drawn, data):
    """The table the tiled kernels skip tiles by (variants.make_tile_table) is True exactly
    for the (Br x Bc) tiles where the float64 reference's mask has a visible entry."""
    case, k, v, kw = drawn
    Br = data.draw(st.sampled_from([1, 2, 4, 8, 16]), label="Br")
    Bc = data.draw(st.sampled_from([1, 2, 4, 8, 16]), label="Bc")
    p = check_attention_inputs(case.q, k, v, case.causal, case.scale, **kw)
    tiles = launcher.tile_table(p, Br, Bc, _variant_arrays(p)[1])
    if not p.variant.tile_table:        # bands only: the kernels skip by arithmetic
        assert tiles is None
        return
    _, mask, _ = reference.scores(case.q, k, case.causal, case.scale, **kw)
    mask = np.broadcast_to(mask, case.q.shape[:-1] + (case.Sk,)).reshape(p.BH, p.Sq, p.Sk)
    Tr, Tc = -(-p.Sq // Br), -(-p.Sk // Bc)
    padded = np.zeros((p.BH, Tr * Br, Tc * Bc), bool)
    padded[:, :p.Sq, :p.Sk] = mask
    want = padded.reshape(p.BH, Tr, Br, Tc, Bc).any(axis=(2, 4))
    assert np.array_equal(to_host(tiles), want), (to_host(tiles).astype(int), want.astype(int))


def test_tiles_a_mask_leaves_empty_are_not_visited():
    """A document mask leaves the off-diagonal tiles empty: the table says so, and the
    kernels that skip those tiles still give the reference's result (forward v2 and the
    backward, at tiles that split the documents and tiles that do not)."""
    rng = np.random.default_rng(5)
    q, k, v, dout = (rng.standard_normal((1, 2, 20, 4)) for _ in range(4))
    p = check_attention_inputs(q, k, v, mask_mod=documents)
    table = to_host(launcher.tile_table(p, 5, 5, None))
    assert np.array_equal(table[0], np.eye(4, dtype=bool))     # documents of 5 = tiles of 5
    want = reference.forward(q, k, v, mask_mod=documents)[0]
    dwant = reference.backward(dout, q, k, v, mask_mod=documents)
    for tiles in ((5, 5), (4, 8)):
        out, lse = numbaflash.attention(q, k, v, mask_mod=documents, tiles=tiles,
                                        return_lse=True)
        assert_close_f64("out", out, want)
        grads = numbaflash.attention_backward(dout, q, k, v, out, lse, mask_mod=documents,
                                              tiles=tiles)
        for name, got, ref in zip(("dq", "dk", "dv"), grads, dwant):
            assert_close_f64(name, got, ref)


# --- refusals and validation --------------------------------------------------------------

NO_VARIANTS = ([("explain", "forward", v) for v in fwd.VERSIONS if v not in FORWARD_VARIANTS]
               + [("explain_backward", "backward", v) for v in bwd.VERSIONS
                  if v not in BACKWARD_VARIANTS])


def test_the_fast_paths_take_variants():
    """The property tests above run the simulator's defaults, not only the teaching rungs:
    forward v5 and backward v4 take variants, as do forward v1, v2 and backward v1."""
    assert {"v1", "v2", "v5"} <= set(FORWARD_VARIANTS), FORWARD_VARIANTS
    assert {"v1", "v4"} <= set(BACKWARD_VARIANTS), BACKWARD_VARIANTS


@pytest.mark.parametrize("explain, ladder, version", NO_VARIANTS)
def test_versions_without_variants_refuse(explain, ladder, version):
    """A version that does not take variants refuses each with a ValueError naming it."""
    explain = getattr(numbaflash, explain)
    dtype = next((t for t in ("float32", "float16") if refusal(explain, version, t) is None),
                 None)
    if dtype is None:
        pytest.skip(refusal(explain, version))
    q = np.zeros((1, 2, 8, 4), dtype)
    k = np.zeros((1, 1, 8, 4), dtype)
    for kw, name in (({"softcap": 3.0}, "softcap"), ({"window_size": (2, 2)}, "window")):
        with pytest.raises(ValueError, match=f"{ladder} {version}.*plain attention.*{name}"):
            explain(q, q, q, version=version, **kw)
    with pytest.raises(ValueError, match=f"{ladder} {version}.*plain attention.*GQA"):
        explain(q, k, k, version=version)


def test_explain_names_the_variant_compiled_in():
    q = np.zeros((1, 2, 8, 4), np.float32)
    assert "softcap" in str(numbaflash.explain(q, q, q, softcap=3.0))
    assert "softcap" in str(numbaflash.explain_backward(q, q, q, softcap=3.0))
    assert "variant: plain" in str(numbaflash.explain(q, q, q, causal=True))


@pytest.mark.parametrize("kw, error, match", [
    ({"window_size": (1,)}, ValueError, "pair of ints"),
    ({"window_size": (-2, 0)}, ValueError, ">= -1"),
    ({"softcap": 0.0}, ValueError, "softcap must be finite and > 0"),
    ({"softcap": float("inf")}, ValueError, "softcap must be finite and > 0"),
    ({"softcap": "big"}, TypeError, "softcap"),
    ({"alibi_slopes": np.ones(3, np.float32)}, ValueError, "alibi_slopes must have shape"),
    ({"alibi_slopes": np.ones((2, 2), np.float32)}, ValueError, "alibi_slopes must have shape"),
    ({"alibi_slopes": np.ones(2, np.int32)}, TypeError, "float"),
    ({"attn_mask": np.ones((3, 8), bool)}, ValueError, "does not broadcast"),
    ({"attn_mask": np.ones((1, 1, 1, 8, 8), bool)}, ValueError, "does not broadcast"),
    ({"attn_mask": np.ones((8, 8), np.int32)}, TypeError, "boolean .* or float"),
    ({"score_mod": 3}, TypeError, "score_mod must be a Numba device function"),
    ({"score_mod_grad": squash_grad}, ValueError, "without score_mod"),
])
def test_bad_variant_options_raise_before_any_launch(kw, error, match):
    q = np.zeros((1, 2, 8, 4), np.float32)
    with pytest.raises(error, match=match):
        numbaflash.attention(q, q, q, **kw)


def test_gqa_heads_must_divide():
    q = np.zeros((1, 3, 8, 4), np.float32)
    k = np.zeros((1, 2, 8, 4), np.float32)
    with pytest.raises(ValueError, match="multiple of the number of key/value heads"):
        numbaflash.attention(q, k, k)


def test_score_mod_backward_needs_its_gradient():
    case = make_case(B=1, H=1, Sq=4, Sk=4, d=4, dtype="float64", with_dout=True)
    out, lse = numbaflash.attention(case.q, case.k, case.v, return_lse=True, score_mod=squash)
    with pytest.raises(ValueError, match="needs its derivative: pass score_mod_grad"):
        numbaflash.attention_backward(case.dout, case.q, case.k, case.v, out, lse,
                                      score_mod=squash)
    with pytest.raises(ValueError, match="needs its derivative"):
        numbaflash.attention_vjp(case.q, case.k, case.v, score_mod=squash)


@pytest.mark.parametrize("explain, version", [("explain", v) for v in ("v6", "v7", "v8", "v9")]
                         + [("explain_backward", "v6")])
def test_tensor_core_versions_refuse_head_dims_past_their_registers(explain, version):
    """The drawn cases above skip what a version refuses for its head dim (takes_dtype);
    the refusal itself: named, with the limit, before any launch."""
    dtype = "float16" if version == "v7" else "float32"
    q = np.zeros((1, 1, 4, 256), dtype)
    with pytest.raises(ValueError, match="head dims up to 128"):
        getattr(numbaflash, explain)(q, q, q, version=version)
