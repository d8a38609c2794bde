"""L2 (simulator) / L3 (GPU): backward v9, v7 with ldmatrix operands and cp.async copies
(numbaflash/kernels/backward/v9_ldmatrix.py), float16 and bfloat16.

v9 computes v7's products in v7's order, so its gradients must be v7's bit for bit; that
is the main check, on Hypothesis cases (test_backward_half's: float16 and bfloat16, Sq
and Sk from 1 to 48 around the simulator tiles' boundaries, d in 8, 16, 59, 64, not causal
and both causal alignments), with v9's own tile rule (several Q and K/V tiles, so both
stages of its double buffer are used). v7 itself is held to TESTING.md's rule against the
float64 reference in tests/test_backward_half.py; one case here checks v9 against it
directly. Besides:

- the copies element by element (d not a multiple of 8, or an array not 16-byte
  aligned) give the same bits as the 16-byte copies;
- other tiles give v7's bits too (the sums' order is the chunks', not the tiles');
- the finite-input contract (version="v9" with NaN or inf is a ValueError; the default's
  fallback to v4 is tests/test_backward_nonfinite.py's, on a GPU), refusals before any launch (variants, float32, d > 128, bad tiles),
  explain_backward's plans, and v9 the GPU's default for plain 16-bit attention;
- the kernels compile and link for sm_90 without spills: test_backward_half's
  compile test covers them (tests/ptx_check.py's "backward_half" group).
"""

import ml_dtypes
import numpy as np
import pytest
from hypothesis import example, given, settings

import numbaflash
from numbaflash.kernels import backward as bwd
from backward_checks import GRADS, check_backward
from strategies import examples, on_gpu
from test_backward_half import HALVES, as_dtype, device, half_cases, make_inputs, poison
from tolerance import assert_bitwise_equal, to_host

pytestmark = pytest.mark.usefixtures("nan_prefilled_outputs")

v9 = bwd.module("v9")
BF16 = ml_dtypes.bfloat16


def gradients(version, dout, q, k, v, out, lse, causal=None, scale=None, tiles=None):
    return numbaflash.attention_backward(dout, q, k, v, out, lse, causal=causal, scale=scale,
                                         version=version, tiles=tiles)


def address(a):
    """Where a device array's data starts (the simulator's: its NumPy array's)."""
    if hasattr(a, "__cuda_array_interface__"):
        return a.__cuda_array_interface__["data"][0]
    return getattr(a, "_ary", a).__array_interface__["data"][0]


def assert_same_bits(got, want):
    for name, a, b in zip(GRADS, got, want):
        assert_bitwise_equal(name, to_host(a).view(np.uint16), to_host(b).view(np.uint16))


@settings(max_examples=examples(0.5))
@given(case=half_cases())
@example(case=("float16", 1, 1, 40, 9, 59, "bottom_right", None, 3))   # rows without keys
@example(case=("bfloat16", 1, 2, 17, 33, 64, "top_left", 0.5, 4))      # keys without rows
@example(case=("float16", 2, 1, 48, 47, 16, None, None, 5))            # 3 Q, 2 K/V tiles
def test_v9_gives_v7s_bits(case):
    """dQ, dK, dV: v7's bits, on every case (the same products in the same order)."""
    dtype, B, H, Sq, Sk, d, causal, scale, seed = case
    q, k, v, dout = make_inputs(B, H, Sq, Sk, d, dtype, seed)
    out, lse = numbaflash.attention(q, k, v, causal=causal, scale=scale, return_lse=True)
    got = gradients("v9", dout, q, k, v, out, lse, causal, scale)
    for g, x in zip(got, (q, k, v)):
        assert g.dtype == x.dtype and g.shape == x.shape
    assert_same_bits(got, gradients("v7", dout, q, k, v, out, lse, causal, scale))


@pytest.mark.parametrize("dtype", HALVES)
def test_v9_matches_reference(dtype):
    """v9 against the float64 reference by TESTING.md's rule (check_backward), directly."""
    q, k, v, dout = make_inputs(1, 2, 37, 29, 24, dtype, 11)
    out, lse = numbaflash.attention(q, k, v, causal="bottom_right", return_lse=True)
    grads = gradients("v9", dout, q, k, v, out, lse, "bottom_right")
    check_backward(dout, q, k, v, out, lse, grads, causal="bottom_right")


@pytest.mark.parametrize("dtype", HALVES)
def test_element_copies_give_the_same_bits(dtype):
    """K and V starting 2 bytes past a 16-byte boundary (device arrays cut from a longer
    one): v9 copies element by element instead of 16 bytes at a time, with the same
    bits as from aligned arrays."""
    q, k, v, dout = make_inputs(1, 1, 33, 35, 16, dtype, 12)
    out, lse = numbaflash.attention(q, k, v, causal="top_left", return_lse=True)
    want = gradients("v9", dout, q, k, v, out, lse, "top_left")

    def shifted(a):
        a = np.ascontiguousarray(to_host(a))
        bits = a.view(np.uint16) if a.dtype == BF16 else a
        big = device(np.concatenate([np.zeros(1, bits.dtype), bits.ravel()]))
        view = big[1:].reshape(a.shape)
        return view.view(BF16) if a.dtype == BF16 else view
    ks, vs = shifted(k), shifted(v)
    assert address(ks) % 16 != 0 and address(vs) % 16 != 0
    dev = [device(a) for a in (dout, q)] + [ks, vs] + [device(a) for a in (out, lse)]
    got = numbaflash.attention_backward(*dev, causal="top_left", version="v9")
    assert_same_bits(got, want)


@pytest.mark.parametrize("dtype", HALVES)
def test_other_tiles_give_the_same_bits(dtype):
    """v9's gradients do not depend on its tiles (every sum runs chunk by chunk in key or
    query order), so any tiles give v7's bits."""
    q, k, v, dout = make_inputs(1, 2, 35, 33, 16, dtype, 8)
    out, lse = numbaflash.attention(q, k, v, causal="top_left", return_lse=True)
    want = gradients("v7", dout, q, k, v, out, lse, "top_left")
    for tiles in ((16, 16), ((32, 16), (16, 32)), (32, 32)):
        assert_same_bits(gradients("v9", dout, q, k, v, out, lse, "top_left", tiles=tiles),
                         want)


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("name", ["dout", "k"])
def test_v9_refuses_nonfinite_inputs(dtype, name):
    """NaN in an input: version="v9" raises a ValueError that says why and what to use."""
    q, k, v, dout = make_inputs(1, 1, 9, 7, 8, dtype, 9)
    out, lse = numbaflash.attention(q, k, v, return_lse=True)
    args = {"dout": dout, "q": q, "k": k, "v": v, "out": to_host(out), "lse": to_host(lse)}
    args[name] = poison(args[name], "nan", dtype)
    with pytest.raises(ValueError, match=r"backward v9 cannot run this input: the inputs hold "
                                         r"NaN or inf .*; use v4"):
        numbaflash.attention_backward(*(args[n] for n in ("dout", "q", "k", "v", "out", "lse")),
                                      version="v9")


@pytest.mark.parametrize("kwargs, match", [
    ({"window_size": (4, 0)}, r"v9"),
    ({"softcap": 5.0}, r"v9"),
])
def test_v9_refuses_variants(no_launch, kwargs, match):
    q = np.zeros((1, 1, 8, 16), np.float16)
    with pytest.raises(ValueError, match=match):
        numbaflash.explain_backward(q, q, q, version="v9", **kwargs)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_v9_refuses_float32_and_float64(no_launch, dtype):
    q = np.zeros((1, 1, 8, 16), dtype)
    with pytest.raises(ValueError, match=r"backward v9 cannot run this input: v9 multiplies "
                                         r"float16 and bfloat16 inputs"):
        numbaflash.explain_backward(q, q, q, version="v9")


@pytest.mark.parametrize("tiles, match", [
    ((24, 16), r"backward v9 tiles must be \(Br, Bc\) with Br and Bc multiples of 16"),
    ((256, 256), r"backward v9 tiles \(256, 256\) need \d+ bytes of shared memory in its "
                 r"dkdv kernel at head dim 128; the limit is 232448"),
])
def test_bad_v9_tiles_and_head_dims_are_refused(no_launch, tiles, match):
    q = np.zeros((1, 1, 8, 128), np.float16)
    with pytest.raises(ValueError, match=match):
        numbaflash.explain_backward(q, q, q, version="v9", tiles=tiles)
    wide = np.zeros((1, 1, 8, 136), np.float16)
    with pytest.raises(ValueError, match=r"v9 keeps its dK, dV and dQ fragments in registers, "
                                         r"which holds head dims up to 128"):
        numbaflash.explain_backward(wide, wide, wide, version="v9")


@pytest.mark.parametrize("dtype", HALVES)
def test_explain_backward_shows_v9s_plans(dtype):
    """explain_backward(version="v9"): D, then v9's two kernels with the tile rule's tiles
    (the simulator's or, with backend="gpu", within 99 KB); on a GPU v9 is the default."""
    q = as_dtype(np.zeros((2, 3, 40, 64), np.float32), dtype)
    k = as_dtype(np.zeros((2, 3, 70, 64), np.float32), dtype)
    plans = numbaflash.explain_backward(q, k, k, causal=True, version="v9")
    assert [p.kernel for p in plans] == ["backward_preprocess", "backward_dkdv_v9",
                                         "backward_dq_v9"]
    text = str(plans)
    assert "v9 was asked for by the caller" in text and "bitwise v7's gradients" in text
    assert ("reads the bfloat16 inputs as their bits" in text) == (dtype == "bfloat16")
    tiles = v9.default_backward_v9_tiles(64, "gpu" if on_gpu() else "simulator")
    _, dkdv, dq = plans
    assert (dkdv.Br, dkdv.Bc) == tiles["dkdv"] and (dq.Br, dq.Bc) == tiles["dq"]
    assert dkdv.grid == (-(-70 // dkdv.Bc), 6) and dq.grid == (-(-40 // dq.Br), 6)
    for d in (64, 128):
        qd = as_dtype(np.zeros((1, 1, 8, d), np.float32), dtype)
        _, dkdv, dq = numbaflash.explain_backward(qd, qd, qd, version="v9", backend="gpu")
        assert max(dkdv.shared_bytes, dq.shared_bytes) <= v9.BWD_V9_SHARED_MEM_TARGET
    default = numbaflash.explain_backward(q, k, k, causal=True, backend="gpu")[-1]
    assert default.version == "v9" and "v9 is the default in float16 and bfloat16" in default.reason


def test_v9_tile_rule_fits_every_head_dim():
    """For every d up to 128 the GPU tile rule gives tiles the caller's check accepts and
    that fit BWD_V9_SHARED_MEM_TARGET; the simulator gets BWD_V9_SIM."""
    for d in range(1, 129):
        tiles = v9.default_backward_v9_tiles(d, "gpu")
        assert v9.check_backward_v9_tiles((tiles["dkdv"], tiles["dq"]), d) == tiles
        for kind, (Br, Bc) in tiles.items():
            assert v9.SHARED_BYTES[kind](Br, Bc, d) <= v9.BWD_V9_SHARED_MEM_TARGET
    assert v9.default_backward_v9_tiles(64, "simulator") == v9.BWD_V9_SIM
