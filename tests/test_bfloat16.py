"""L2 (simulator) / L3 (GPU): bfloat16 inputs, forward and backward.

bfloat16 (``ml_dtypes.bfloat16``) has 8 significant bits and float32's exponent range.
numbaflash computes it in float32: forward v7 reads the bits itself, on the bfloat16
tensor cores (P~ rounded to bfloat16 for P~ V), and every other version gets float32
copies and rounds its outputs to bfloat16 (numbaflash/dtypes.py). What is checked:

- TESTING.md's rule (tests/tolerance.py, backward_checks.py) against the float64 reference
  on the bfloat16 inputs, with the same naive formula in bfloat16 as the baseline
  (reference.forward / backward_checks.naive_backward with dtype bfloat16: matrix
  products summed in float32 and rounded, as a bfloat16 framework computes them), on
  random shapes: Sq != Sk, both causal alignments (rows that see no key: out exactly 0,
  lse -inf, dq exactly 0), GQA, windows, softcap, and large-magnitude inputs (values up to
  2^20, beyond float16's range);
- the simulator's default (forward v5, backward v4, through float32 copies) and forward v7
  (the GPU's default, on the simulator's stand-ins);
- output dtypes (bfloat16; lse float32), device arrays in and out with the same bits as
  host arrays, packed batches and KV-cache decoding (whose kernels read the bits too),
  the rounding kernels bit for bit against ml_dtypes, the plans' reasons, and the errors
  before any launch.
"""

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import cuda

import numbaflash
from numbaflash import dtypes
from numbaflash.kernels import halves
from backward_checks import check_backward
from strategies import examples, on_gpu
from tolerance import assert_bitwise_equal, check_forward, to_host

BF16 = ml_dtypes.bfloat16
FORWARD_VERSIONS = ("default", "v7")


def to_device(a):
    """A bfloat16 NumPy array on the device: its bits copied, viewed as bfloat16 there
    (Numba's copy reads the buffer protocol, which has no bfloat16; numbaflash/dtypes.py)."""
    return cuda.to_device(a.view(np.uint16)).view(BF16)


def bf16_inputs(rng, B, Hq, Hkv, Sq, Sk, d, magnitude=1.0):
    """q, k, v (and dout) as bfloat16, standard normal times ``magnitude``."""
    def draw(H, S):
        return (rng.standard_normal((B, H, S, d)) * magnitude).astype(BF16)
    return draw(Hq, Sq), draw(Hkv, Sk), draw(Hkv, Sk), draw(Hq, Sq)


@st.composite
def cases(draw):
    """A small bfloat16 problem and its options (simulator-sized)."""
    Hkv = draw(st.sampled_from((1, 2)))
    group = draw(st.sampled_from((1, 2)))
    opts = {}
    causal = draw(st.sampled_from((False, "bottom_right", "top_left")))
    if causal:
        opts["causal"] = causal
    if draw(st.booleans()):
        opts["window_size"] = (draw(st.integers(0, 12)), draw(st.integers(0, 12)))
    if draw(st.booleans()):
        opts["softcap"] = draw(st.sampled_from((5.0, 30.0)))
    return dict(B=draw(st.integers(1, 2)), Hq=Hkv * group, Hkv=Hkv,
                Sq=draw(st.integers(1, 40)), Sk=draw(st.integers(1, 40)),
                d=draw(st.sampled_from((1, 8, 13, 16, 32))),
                magnitude=draw(st.sampled_from((1.0, 4.0, 2.0 ** 20))),
                seed=draw(st.integers(0, 2 ** 16)), opts=opts)


def _version(version):
    return None if version == "default" else version


@pytest.mark.parametrize("version", FORWARD_VERSIONS)
@settings(max_examples=examples())
@given(case=cases())
def test_forward_matches_reference(case, version):
    """out (bfloat16) and lse (float32) by the rule, against a bfloat16 baseline."""
    rng = np.random.default_rng(case["seed"])
    q, k, v, _ = bf16_inputs(rng, case["B"], case["Hq"], case["Hkv"], case["Sq"], case["Sk"],
                             case["d"], case["magnitude"])
    # Large inputs: a smaller scale keeps the scores' softmax from being one-hot (which
    # would make every result a copy of one V row).
    scale = 1.0 / (case["magnitude"] ** 2 * np.sqrt(case["d"]))
    out, lse = numbaflash.attention(q, k, v, scale=scale, return_lse=True,
                                    version=_version(version), **case["opts"])
    assert out.dtype == BF16 and lse.dtype == np.float32
    check_forward(q, k, v, out, lse, scale=scale, **case["opts"])


@settings(max_examples=examples())
@given(case=cases())
def test_backward_matches_reference(case):
    """dq, dk, dv (bfloat16) by the gradient rule, after the default forward."""
    rng = np.random.default_rng(case["seed"])
    q, k, v, dout = bf16_inputs(rng, case["B"], case["Hq"], case["Hkv"], case["Sq"],
                                case["Sk"], case["d"], case["magnitude"])
    scale = 1.0 / (case["magnitude"] ** 2 * np.sqrt(case["d"]))
    out, lse = numbaflash.attention(q, k, v, scale=scale, return_lse=True, **case["opts"])
    grads = numbaflash.attention_backward(dout, q, k, v, out, lse, scale=scale,
                                          **case["opts"])
    assert all(g.dtype == BF16 for g in grads)
    check_backward(dout, q, k, v, out, lse, grads, scale=scale, **case["opts"])


@pytest.mark.parametrize("version", FORWARD_VERSIONS)
def test_rows_that_see_no_key(version):
    """Sq > Sk, causal bottom-right: the first Sq - Sk rows see no key; out exactly 0,
    lse -inf, their dq exactly 0 (check_forward and check_backward test them exactly)."""
    rng = np.random.default_rng(3)
    q, k, v, dout = bf16_inputs(rng, 1, 2, 2, 21, 7, 16)
    out, lse = numbaflash.attention(q, k, v, causal=True, return_lse=True,
                                    version=_version(version))
    assert np.all(to_host(out)[:, :, :14].astype(np.float32) == 0)
    assert np.all(np.isneginf(to_host(lse)[:, :, :14]))
    check_forward(q, k, v, out, lse, causal=True)
    grads = numbaflash.attention_backward(dout, q, k, v, out, lse, causal=True)
    check_backward(dout, q, k, v, out, lse, grads, causal=True)


@pytest.mark.parametrize("version", FORWARD_VERSIONS)
def test_device_arrays_give_the_host_bits(version):
    """Numba device arrays of bfloat16 in, bfloat16 device arrays out, with the same bits
    as the NumPy call (forward and backward)."""
    rng = np.random.default_rng(5)
    q, k, v, dout = bf16_inputs(rng, 2, 2, 1, 19, 23, 16)
    out, lse = numbaflash.attention(q, k, v, causal=True, return_lse=True,
                                    version=_version(version))
    dev = [to_device(x) for x in (q, k, v, dout)]
    d_out, d_lse = numbaflash.attention(*dev[:3], causal=True, return_lse=True,
                                        version=_version(version))
    assert d_out.dtype == BF16 and not isinstance(d_out, np.ndarray)
    assert_bitwise_equal("out", d_out.copy_to_host(), out)
    assert_bitwise_equal("lse", d_lse.copy_to_host(), lse)
    grads = numbaflash.attention_backward(dout, q, k, v, out, lse, causal=True)
    d_grads = numbaflash.attention_backward(dev[3], *dev[:3], d_out, d_lse, causal=True)
    for name, g, dg in zip(("dq", "dk", "dv"), grads, d_grads):
        assert dg.dtype == BF16
        assert_bitwise_equal(name, dg.copy_to_host(), g)


def test_v7_rounds_p_to_bfloat16():
    """v7's P~ V product takes P~ rounded to bfloat16 (8 bits): its out differs from the
    float32 kernels' (which round only out), by more than out's own rounding somewhere,
    and both meet the rule. (A v7 that kept P~ in float16 or float32 would agree with the
    float32 kernels nearly everywhere.)"""
    rng = np.random.default_rng(11)
    q, k, v, _ = bf16_inputs(rng, 1, 2, 2, 48, 48, 32)
    o7 = to_host(numbaflash.attention(q, k, v, version="v7")).astype(np.float64)
    o5 = to_host(numbaflash.attention(q, k, v)).astype(np.float64)
    spacing = np.spacing(np.abs(o5).astype(np.float32).astype(BF16)).astype(np.float64)
    assert np.any(np.abs(o7 - o5) > spacing)


def test_rounding_kernels_match_ml_dtypes():
    """narrow_from_float32 rounds as ml_dtypes does (to nearest even), bit for bit, over
    ties, subnormals, the largest values, infinities and random values of every size; NaN
    becomes the canonical NaN. widen_to_float32 gives the exact float32 values."""
    rng = np.random.default_rng(0)
    special = np.array([0.0, -0.0, 1.0, 1.00390625, 1.01171875, 1.0 + 2 ** -8,
                        1.0 + 3 * 2 ** -8, 3.3895e38, 3.4e38, -3.4e38, np.inf, -np.inf,
                        1e-40, -1e-45, 65520.0], np.float32)
    sizes = rng.choice(np.float32([1e-38, 1e-3, 1, 1e5, 1e30]), 3000)
    x = np.concatenate([special, (rng.standard_normal(3000) * sizes).astype(np.float32),
                        np.float32([np.nan, -np.nan])])
    bits = cuda.to_device(np.zeros(x.size, np.uint16))
    halves.narrow_from_float32[halves.convert_grid(x.size), halves.CONVERT_THREADS](
        cuda.to_device(x), bits)
    got = bits.copy_to_host()
    want = x.astype(BF16).view(np.uint16)
    nan = np.isnan(x)
    np.testing.assert_array_equal(got[~nan], want[~nan])
    assert np.all(got[nan] == 0x7FFF)       # the canonical NaN, as cvt.rn.bf16x2.f32 gives
    wide = cuda.to_device(np.zeros(x.size, np.float32))
    halves.widen_to_float32[halves.convert_grid(x.size), halves.CONVERT_THREADS](bits, wide)
    np.testing.assert_array_equal(wide.copy_to_host(), got.view(BF16).astype(np.float32))


def test_plans_say_how_bfloat16_runs():
    """On a GPU the default forward (v10) and backward (v9) read bfloat16 themselves; the
    simulator's defaults and a version without bfloat16 (backward v6) say that they run
    on float32 copies."""
    q = np.zeros((1, 2, 64, 64), BF16)
    gpu = numbaflash.explain(q, q, q, backend="gpu")
    assert gpu.version == "v10" and "bfloat16" in gpu.reason and "widened" not in gpu.reason
    assert "widened to float32" in numbaflash.explain(q, q, q, backend="simulator").reason
    plans = numbaflash.explain_backward(q, q, q, backend="gpu")
    assert plans[-1].version == "v9" and "reads the bfloat16 inputs as their bits" in str(plans)
    assert "widened" not in str(plans)
    plans = numbaflash.explain_backward(q, q, q, backend="gpu", version="v6")
    assert "widened to float32" in plans[-1].reason


def test_errors_before_any_launch(no_launch):
    """Mixed dtypes, and an lse that is not float32, are refused by name."""
    q = np.zeros((1, 1, 8, 16), BF16)
    with pytest.raises(TypeError, match="same dtype"):
        numbaflash.attention(q, q.astype(np.float16), q)
    with pytest.raises(TypeError, match="lse must be float32"):
        numbaflash.attention_backward(q, q, q, q, q, np.zeros((1, 1, 8), np.float64))
    with pytest.raises(TypeError, match="bfloat16"):
        numbaflash.attention(q.view(np.uint16), q.view(np.uint16), q.view(np.uint16))


def test_a_torch_bfloat16_tensor_is_refused_with_the_way_through(no_launch):
    """What PyTorch cannot export (a bfloat16 tensor, here a stand-in with its dtype and
    the CUDA Array Interface) gets a clear error naming numbaflash.torch, before any
    launch, from every entry point."""
    class TorchTensor:
        __cuda_array_interface__ = {}

        def __init__(self, shape, dtype):
            self.shape, self.dtype = shape, dtype

    t = TorchTensor((1, 1, 8, 16), "torch.bfloat16")
    lse = TorchTensor((1, 1, 8), "torch.float32")
    for call in (lambda: numbaflash.attention(t, t, t),
                 lambda: numbaflash.attention_backward(t, t, t, t, t, lse),
                 lambda: numbaflash.attention_with_kvcache(t, t, t, cache_seqlens=4)):
        with pytest.raises(TypeError, match="numbaflash.torch"):
            call()


def test_dtype_helpers():
    assert dtypes.is_bfloat16(BF16) and dtypes.is_bfloat16("bfloat16")
    assert not dtypes.is_bfloat16(np.float16) and not dtypes.is_bfloat16("not a dtype")
    assert dtypes.kernel_dtype(BF16, False) == np.uint16
    assert dtypes.kernel_dtype(BF16, True) == np.float32
    assert dtypes.kernel_dtype(np.float16, False) == np.float16


@pytest.mark.skipif(not on_gpu(), reason="needs a GPU: the default bfloat16 forward there is "
                    "v10 on the tensor cores, at a size the simulator cannot afford")
def test_gpu_default_runs_on_the_tensor_cores():
    rng = np.random.default_rng(1)
    q, k, v, _ = bf16_inputs(rng, 2, 4, 2, 300, 333, 64)
    out, lse = numbaflash.attention(q, k, v, causal=True, return_lse=True)
    check_forward(q, k, v, out, lse, causal=True)


@pytest.mark.parametrize("version", FORWARD_VERSIONS)
def test_packed_batch_is_each_sequence(version):
    """attention_varlen on bfloat16: each sequence's out and lse have exactly the bits of
    attention() on that sequence alone (an empty one included), and the packed backward's
    gradients those of attention_backward."""
    rng = np.random.default_rng(7)
    lens = (5, 0, 17, 9)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    q, k, v, dout = (rng.standard_normal((int(cu[-1]), 2, 16)).astype(BF16)
                     for _ in range(4))
    out, lse = numbaflash.attention_varlen(q, k, v, cu, cu, causal=True, return_lse=True,
                                           version=_version(version))
    assert out.dtype == BF16 and lse.dtype == np.float32
    grads = numbaflash.attention_varlen_backward(dout, q, k, v, out, lse, cu, cu, causal=True)
    for a, b in zip(cu[:-1], cu[1:]):
        if a == b:
            continue
        one = [x[a:b].transpose(1, 0, 2)[None] for x in (q, k, v, dout)]
        o1, l1 = numbaflash.attention(*one[:3], causal=True, return_lse=True,
                                      version=_version(version))
        assert_bitwise_equal("out", out[a:b], o1[0].transpose(1, 0, 2))
        assert_bitwise_equal("lse", lse[:, a:b], l1[0])
        g1 = numbaflash.attention_backward(one[3], *one[:3], o1, l1, causal=True)
        for name, g, want in zip(("dq", "dk", "dv"), grads, g1):
            assert g.dtype == BF16
            assert_bitwise_equal(name, g[a:b], want[0].transpose(1, 0, 2))


@pytest.mark.parametrize("num_splits", [1, 3])
def test_kv_cache_is_attention_on_the_sliced_caches(num_splits):
    """Decoding against bfloat16 caches (the split-KV kernel reads their bits): the new
    rows are written into the caches in place, exactly; out and lse agree with attention()
    on the sliced caches by the rule (the splits change the float32 sums' order, not the
    rule), for one split and three, GQA, causal; device caches give the host's bits."""
    rng = np.random.default_rng(9)
    B, Hq, Hk, S_max, d, S_new = 2, 4, 2, 40, 16, 3
    q = rng.standard_normal((B, Hq, S_new, d)).astype(BF16)
    k_cache, v_cache = (rng.standard_normal((B, Hk, S_max, d)).astype(BF16) for _ in range(2))
    k_new, v_new = (rng.standard_normal((B, Hk, S_new, d)).astype(BF16) for _ in range(2))
    seqlens = np.array([10, 29], np.int32)
    kc, vc = k_cache.copy(), v_cache.copy()
    out, lse = numbaflash.attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens, k=k_new,
                                                 v=v_new, causal=True, num_splits=num_splits,
                                                 return_lse=True)
    assert out.dtype == BF16 and lse.dtype == np.float32
    for b in range(B):
        at = int(seqlens[b])
        assert_bitwise_equal("k_cache rows", kc[b, :, at:at + S_new], k_new[b])
        assert_bitwise_equal("v_cache rows", vc[b, :, at:at + S_new], v_new[b])
        assert_bitwise_equal("untouched rows", kc[b, :, :at], k_cache[b, :, :at])
        n = at + S_new
        check_forward(q[b:b + 1], kc[b:b + 1, :, :n], vc[b:b + 1, :, :n], out[b:b + 1],
                      lse[b:b + 1], causal=True)
    dev = [to_device(x) for x in (q, k_cache, v_cache, k_new, v_new)]
    d_out = numbaflash.attention_with_kvcache(dev[0], dev[1], dev[2], cache_seqlens=seqlens,
                                              k=dev[3], v=dev[4], causal=True,
                                              num_splits=num_splits)
    assert d_out.dtype == BF16
    assert_bitwise_equal("out", d_out.copy_to_host(), out)
    assert_bitwise_equal("device k_cache", dev[1].copy_to_host(), kc)
