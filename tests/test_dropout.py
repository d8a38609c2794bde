"""Dropout through the public API: the mask each kernel applies is ``dropout_mask``'s.

The kernel-by-kernel comparisons with the dense reference (out, lse and gradients under
TESTING.md's rules) are in tests/test_dropout_forward_kernels.py and
tests/test_dropout_backward_kernels.py; the generator itself in tests/test_dropout_rng.py.
Here:

- The mask, read out of a kernel exactly. With q = k = 0 every visible probability is
  1 / (visible keys), and with V the identity (d >= Sk) row i of O is row i of
  P * keep / (1 - p): its nonzero pattern is the kernel's keep mask, bit for bit. The
  backward's dK/dV kernel shows its own: with dO the identity (d >= Sq), dV = (P * keep /
  (1 - p))^T dO, whose nonzero pattern is the mask transposed. Both must equal
  ``numbaflash.dropout_mask`` for every version, tile size, GQA grouping and causal
  alignment drawn.
- p = 0 is plain attention, bit for bit; the same seed gives the same bits; the options
  are checked before any launch; explain() names dropout; attention_vjp carries it.
"""

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import numbaflash
from numbaflash.kernels import backward as bwd
from numbaflash.kernels import forward as fwd
from strategies import examples, on_gpu, version_params
from tolerance import assert_bitwise_equal, to_host

FORWARD_VARIANTS = tuple(v for v in fwd.VERSIONS if fwd.module(v).VARIANTS)
BACKWARD_VARIANTS = tuple(v for v in bwd.VERSIONS if bwd.module(v).VARIANTS)
NO_DROPOUT_FORWARD = tuple(v for v in fwd.VERSIONS if v not in FORWARD_VARIANTS)
NO_DROPOUT_BACKWARD = tuple(v for v in bwd.VERSIONS if v not in BACKWARD_VARIANTS)


def _dtype_for(explain, version):
    """A dtype ``version`` takes (v7: float16 only)."""
    for dtype in ("float32", "float16"):
        q = np.zeros((1, 1, 4, 16), dtype)
        try:
            explain(q, q, q, version=version)
            return np.dtype(dtype)
        except ValueError:
            continue
    return None


@st.composite
def mask_cases(draw):
    B = draw(st.integers(1, 2))
    Hkv = draw(st.integers(1, 2))
    group = draw(st.sampled_from([1, 2]))
    Sq = draw(st.integers(1, 13))
    Sk = draw(st.integers(1, 13))
    p = draw(st.sampled_from([0.1, 0.5, 0.9]))
    seed = draw(st.integers(0, 2**64 - 1))
    causal = draw(st.sampled_from([False, "bottom_right", "top_left"]))
    return B, Hkv * group, Hkv, Sq, Sk, p, seed, causal


def _expected_keep(B, Hq, Sq, Sk, p, seed, causal):
    from numbaflash.masks import visible
    keep = numbaflash.dropout_mask(B, Hq, Sq, Sk, p, seed)
    return keep & visible(Sq, Sk, causal or None)


def forward_mask(version, case, dtype, tiles=None):
    B, Hq, Hkv, Sq, Sk, p, seed, causal = case
    d = 16
    q = np.zeros((B, Hq, Sq, d), dtype)
    k = np.zeros((B, Hkv, Sk, d), dtype)
    v = np.zeros((B, Hkv, Sk, d), dtype)
    v[:, :, np.arange(Sk), np.arange(Sk)] = 1           # V = identity: O row = P row
    out = numbaflash.attention(q, k, v, causal=causal, dropout_p=p, dropout_seed=seed,
                               version=version, tiles=tiles)
    return to_host(out)[..., :Sk] != 0


@pytest.mark.parametrize("version", version_params(FORWARD_VARIANTS, numbaflash.explain,
                                                   ("float32", "float16")))
@settings(max_examples=examples(0.5))
@given(case=mask_cases())
def test_forward_kernels_apply_dropout_mask_exactly(version, case):
    dtype = _dtype_for(numbaflash.explain, version)
    got = forward_mask(version, case, dtype)
    want = _expected_keep(case[0], case[1], *case[3:])
    np.testing.assert_array_equal(got, want)


@settings(max_examples=examples(0.5))
@given(case=mask_cases(), tiles=st.tuples(st.sampled_from([1, 2, 4, 8]),
                                          st.sampled_from([1, 2, 4, 8])))
def test_the_mask_does_not_depend_on_the_tiles(case, tiles):
    got = forward_mask("v2", case, np.float32, tiles)
    want = _expected_keep(case[0], case[1], *case[3:])
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("version", version_params(BACKWARD_VARIANTS, numbaflash.explain_backward,
                                                   ("float32", "float16")))
@settings(max_examples=examples(0.5))
@given(case=mask_cases())
def test_backward_kernels_apply_dropout_mask_exactly(version, case):
    """dV = (P keep / (1 - p))^T dO with dO the identity: dV's nonzero pattern, summed
    over a GQA group's query heads (no cancellation: every term is >= 0), is the mask."""
    backward_mask(version, case)


def backward_mask(version, case):
    B, Hq, Hkv, Sq, Sk, p, seed, causal = case
    dtype = _dtype_for(numbaflash.explain_backward, version)
    d = 16
    q = np.zeros((B, Hq, Sq, d), dtype)
    k = np.zeros((B, Hkv, Sk, d), dtype)
    v = np.zeros((B, Hkv, Sk, d), dtype)
    dout = np.zeros((B, Hq, Sq, d), dtype)
    dout[:, :, np.arange(Sq), np.arange(Sq)] = 1        # dO = identity: dV column i = row i
    opts = dict(causal=causal, dropout_p=p, dropout_seed=seed)
    out, lse = numbaflash.attention(q, k, v, return_lse=True, **opts)
    _, _, dv = numbaflash.attention_backward(dout, q, k, v, out, lse, version=version, **opts)
    got = np.swapaxes(to_host(dv)[..., :Sq], -1, -2) != 0      # (B, Hkv, Sq, Sk)
    keep = _expected_keep(B, Hq, Sq, Sk, p, seed, causal)
    want = keep.reshape(B, Hkv, Hq // Hkv, Sq, Sk).any(axis=2)
    np.testing.assert_array_equal(got, want)


def _inputs(shape=(2, 2, 11, 9, 8), dtype=np.float32, seed=0):
    B, H, Sq, Sk, d = shape
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, H, Sq, d)).astype(dtype)
    k, v = (rng.standard_normal((B, H, Sk, d)).astype(dtype) for _ in range(2))
    dout = rng.standard_normal((B, H, Sq, d)).astype(dtype)
    return q, k, v, dout


def test_p_zero_is_plain_attention_bit_for_bit():
    q, k, v, dout = _inputs()
    for opts in (dict(dropout_p=0.0), dict(dropout_p=0.0, dropout_seed=5)):
        out, lse = numbaflash.attention(q, k, v, causal=True, return_lse=True, **opts)
        want_out, want_lse = numbaflash.attention(q, k, v, causal=True, return_lse=True)
        assert_bitwise_equal("O", out, want_out)
        assert_bitwise_equal("lse", lse, want_lse)
        grads = numbaflash.attention_backward(dout, q, k, v, out, lse, causal=True, **opts)
        want = numbaflash.attention_backward(dout, q, k, v, out, lse, causal=True)
        for name, g, w in zip(("dQ", "dK", "dV"), grads, want):
            assert_bitwise_equal(name, g, w)


def test_same_seed_same_bits_and_lse_is_the_undropped_one():
    q, k, v, dout = _inputs()
    opts = dict(dropout_p=0.3, dropout_seed=2**63 + 12345)
    out1, lse1 = numbaflash.attention(q, k, v, return_lse=True, **opts)
    out2, lse2 = numbaflash.attention(q, k, v, return_lse=True, **opts)
    assert_bitwise_equal("O", out2, out1)
    assert_bitwise_equal("lse", lse2, lse1)
    _, plain_lse = numbaflash.attention(q, k, v, return_lse=True)
    assert_bitwise_equal("lse (undropped)", lse1, plain_lse)
    g1 = numbaflash.attention_backward(dout, q, k, v, out1, lse1, **opts)
    g2 = numbaflash.attention_backward(dout, q, k, v, out1, lse1, **opts)
    for name, a, b in zip(("dQ", "dK", "dV"), g1, g2):
        assert_bitwise_equal(name, b, a)
    other = numbaflash.attention(q, k, v, dropout_p=0.3, dropout_seed=opts["dropout_seed"] + 1)
    assert not np.array_equal(other, out1)


def test_inputs_without_batch_or_heads_use_b_0_and_h_0():
    """(Sq, d) and (H, Sq, d) inputs: the mask of batch 0 (and head 0)."""
    p, seed, Sq, Sk = 0.5, 77, 6, 9
    v = np.zeros((Sk, 16), np.float32)
    v[np.arange(Sk), np.arange(Sk)] = 1
    q, k = np.zeros((Sq, 16), np.float32), np.zeros((Sk, 16), np.float32)
    out = numbaflash.attention(q, k, v, dropout_p=p, dropout_seed=seed)
    np.testing.assert_array_equal(out[:, :Sk] != 0,
                                  numbaflash.dropout_mask(1, 1, Sq, Sk, p, seed)[0, 0])
    H = 3
    out = numbaflash.attention(*(np.broadcast_to(x, (H,) + x.shape).copy() for x in (q, k, v)),
                               dropout_p=p, dropout_seed=seed)
    np.testing.assert_array_equal(out[..., :Sk] != 0,
                                  numbaflash.dropout_mask(1, H, Sq, Sk, p, seed)[0])


def test_attention_vjp_carries_dropout():
    q, k, v, dout = _inputs()
    opts = dict(dropout_p=0.2, dropout_seed=9, window_size=(3, 2))
    out, vjp = numbaflash.attention_vjp(q, k, v, **opts)
    want_out, lse = numbaflash.attention(q, k, v, return_lse=True, **opts)
    assert_bitwise_equal("O", out, want_out)
    for name, g, w in zip(("dQ", "dK", "dV"), vjp(dout),
                          numbaflash.attention_backward(dout, q, k, v, out, lse, **opts)):
        assert_bitwise_equal(name, g, w)


@pytest.mark.parametrize("opts, error, match", [
    (dict(dropout_p=1.0, dropout_seed=1), ValueError, r"\[0, 1\)"),
    (dict(dropout_p=-0.1, dropout_seed=1), ValueError, r"\[0, 1\)"),
    (dict(dropout_p=float("nan"), dropout_seed=1), ValueError, r"\[0, 1\)"),
    (dict(dropout_p="0.1", dropout_seed=1), ValueError, "real number"),
    (dict(dropout_p=0.1), ValueError, "needs dropout_seed"),
    (dict(dropout_p=0.1, dropout_seed=2**64), ValueError, r"2\*\*64"),
    (dict(dropout_p=0.1, dropout_seed=-1), ValueError, r"2\*\*64"),
    (dict(dropout_p=0.1, dropout_seed=True), ValueError, "int"),
    (dict(dropout_p=0.1, dropout_seed=1.0), ValueError, "int"),
])
def test_bad_dropout_options_raise_before_any_launch(opts, error, match, no_launch):
    q, k, v, dout = _inputs(shape=(1, 1, 3, 3, 4))
    with pytest.raises(error, match=match):
        numbaflash.attention(q, k, v, **opts)
    with pytest.raises(error, match=match):
        numbaflash.attention_backward(dout, q, k, v, q, np.zeros((1, 1, 3), np.float32), **opts)
    with pytest.raises(error, match=match):
        numbaflash.attention_vjp(q, k, v, **opts)


def test_explain_names_dropout_and_the_default_kernel_keeps_it():
    q = np.zeros((1, 2, 64, 64), np.float32)
    plain = numbaflash.explain(q, q, q)
    plan = numbaflash.explain(q, q, q, dropout_p=0.1, dropout_seed=1)
    assert plan.version == plain.version
    assert "dropout" in str(plan)
    plans = numbaflash.explain_backward(q, q, q, dropout_p=0.1, dropout_seed=1)
    assert plans[-1].version == numbaflash.explain_backward(q, q, q)[-1].version
    assert "dropout" in str(plans)
    for where in ("gpu", "simulator"):
        assert (numbaflash.explain(q, q, q, dropout_p=0.1, dropout_seed=1, backend=where).version
                == numbaflash.explain(q, q, q, backend=where).version)


@pytest.mark.parametrize("explain, version", [("explain", v) for v in NO_DROPOUT_FORWARD]
                         + [("explain_backward", v) for v in NO_DROPOUT_BACKWARD])
def test_versions_without_variants_refuse_dropout_by_name(explain, version):
    q = np.zeros((1, 1, 8, 16), np.float32)
    try:
        getattr(numbaflash, explain)(q, q, q, version=version)
    except ValueError as e:
        pytest.skip(f"{version} does not run here at all: {e}")
    with pytest.raises(ValueError, match="dropout"):
        getattr(numbaflash, explain)(q, q, q, version=version, dropout_p=0.1, dropout_seed=1)


MMA_CASE = (1, 2, 1, 13, 11, 0.5, 2**40 + 3, "bottom_right")    # B, Hq, Hkv, Sq, Sk, p, seed


@pytest.mark.parametrize("version", [v for v in ("v6", "v7", "v8", "v9")
                                     if v in FORWARD_VARIANTS])
def test_tensor_core_forwards_apply_dropout_mask_exactly(version):
    """The property test above draws the tensor-core versions on a GPU; on the simulator
    (each mma a rendezvous of 32 Python threads) one fixed case each, GQA and causal."""
    dtype = _dtype_for(numbaflash.explain, version)
    got = forward_mask(version, MMA_CASE, dtype)
    want = _expected_keep(MMA_CASE[0], MMA_CASE[1], *MMA_CASE[3:])
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("version", [v for v in ("v6",) if v in BACKWARD_VARIANTS])
def test_tensor_core_backward_applies_dropout_mask_exactly(version):
    """As above, for the tensor-core backward: one fixed case on the simulator."""
    backward_mask(version, MMA_CASE)
