"""L2 (simulator) / L3 (GPU): forward v10, v7 with ldmatrix loads and cp.async copies.

v10 (numbaflash/kernels/forward/v10_ldmatrix.py) changes how Kj and Vj reach the tensor
cores, not what they compute: the same products in the same order as v7. What is
checked, for float16 and bfloat16:

- TESTING.md's rule against the float64 reference on the rounded inputs, with the naive
  same-dtype baseline (tolerance.check_forward), outputs pre-filled with NaN: fixed
  ragged shapes (Sq != Sk both ways, a short last tile on each axis), both causal
  alignments, rows that see no key (out exactly 0, lse -inf), d = 16, 40 (the head dim
  padded to 48), 64 and 128, and drawn shapes (Hypothesis, a small budget: every mma and
  every ldmatrix is a rendezvous of a warp's 32 Python threads on the simulator);
- NaN and inf in visible inputs where the reference puts them (v7's fix-ups);
- v10 == v7 bit for bit (out and lse), finite inputs or not: the same arithmetic;
- the element-by-element copies (d not a multiple of 8; K and V not 16-byte aligned),
  with the same bits;
- the plan: v7's tiles on a GPU, its shared memory (two stages), and the refusals by name
  (float32, d > 128, GQA and the other variants).
"""

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import cuda

import numbaflash
from numbaflash.kernels.forward import v10_ldmatrix
from strategies import examples
from tolerance import assert_bitwise_equal, check_forward, to_host

pytestmark = pytest.mark.usefixtures("nan_prefilled_outputs")

BF16 = ml_dtypes.bfloat16
DTYPES = {"float16": np.float16, "bfloat16": BF16}
CAUSAL = [None, "bottom_right", "top_left"]


def inputs(dtype, Sq, Sk, d, B=1, H=2, seed=0):
    """q, k, v of ``dtype`` (a name in DTYPES), standard normal."""
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((B, H, S, d)).astype(DTYPES[dtype])
                 for S in (Sq, Sk, Sk))


def poisoned(q, k, v):
    """Copies with NaN and inf in visible positions (and a NaN in a key the causal mask
    hides from the first rows)."""
    q, k, v = (x.copy() for x in (q, k, v))
    k[0, 1, 3, 0] = np.nan
    v[0, 0, k.shape[2] - 2, 1] = np.inf
    q[0, 1, 2, 0] = -np.inf
    return q, k, v


def run(version, q, k, v, causal):
    out, lse = numbaflash.attention(q, k, v, causal=causal, version=version, return_lse=True)
    return to_host(out), to_host(lse)


def check_against_reference_and_v7(q, k, v, causal):
    """v10 by the rule, and v10 == v7 bit for bit."""
    out, lse = run("v10", q, k, v, causal)
    check_forward(q, k, v, out, lse, causal=causal)
    out7, lse7 = run("v7", q, k, v, causal)
    assert_bitwise_equal("out", out.view(np.uint16), out7.view(np.uint16))
    assert_bitwise_equal("lse", lse, lse7)
    return out, lse


# (Sq, Sk, d): ragged both ways on the simulator's (32, 32) tiles; d = 40 pads to 48;
# Sk = 70: three K/V tiles, so the first stage is copied into again (tile 2)
SHAPES = [(37, 45, 16), (21, 7, 40), (19, 70, 16)]


@pytest.mark.parametrize("Sq,Sk,d", SHAPES)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("dtype", DTYPES)
def test_v10_matches_the_reference_and_v7(dtype, causal, Sq, Sk, d):
    q, k, v = inputs(dtype, Sq, Sk, d, seed=Sq + d)
    out, lse = check_against_reference_and_v7(q, k, v, causal)
    if causal == "bottom_right" and Sq > Sk:            # rows 0 .. Sq - Sk - 1 see no key
        blind = Sq - Sk
        assert np.all(out[:, :, :blind].astype(np.float32) == 0)
        assert np.all(np.isneginf(lse[:, :, :blind]))


@pytest.mark.parametrize("dtype,causal", [("float16", None), ("bfloat16", "bottom_right"),
                                          ("float16", "top_left"), ("bfloat16", None)])
def test_nan_and_inf_reach_the_reference_positions_as_in_v7(dtype, causal):
    q, k, v = poisoned(*inputs(dtype, 33, 36, 16, seed=3))
    check_against_reference_and_v7(q, k, v, causal)


@pytest.mark.parametrize("dtype,d,causal", [("float16", 64, "bottom_right"),
                                            ("bfloat16", 64, None),
                                            ("float16", 128, None),
                                            ("bfloat16", 128, "top_left")])
def test_v10_at_the_gpu_head_dims(dtype, d, causal):
    """d = 64 and 128, where the GPU's tiles were chosen (here the simulator's tiles; one
    query tile and two K/V tiles, the second short)."""
    q, k, v = inputs(dtype, 20, 35, d, seed=d)
    check_against_reference_and_v7(q, k, v, causal)


def misaligned(x):
    """x on the device, its first element 2 bytes past a 16-byte boundary (a view into a
    larger array): v10 must copy it element by element."""
    flat = np.zeros(x.size + 8, np.uint16)
    flat[1:x.size + 1] = x.view(np.uint16).reshape(-1)
    view = cuda.to_device(flat)[1:x.size + 1].reshape(x.shape)
    return view.view(x.dtype) if x.dtype == BF16 else view.view(np.float16)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_element_by_element_copies(dtype):
    """d = 20 (rows not whole 16-byte pieces), and d = 16 with K and V not 16-byte aligned:
    the copies go element by element, with v7's bits."""
    from numbaflash.kernels import simulated
    q, k, v = inputs(dtype, 33, 41, 20, seed=7)
    check_against_reference_and_v7(q, k, v, "bottom_right")
    q, k, v = inputs(dtype, 33, 41, 16, seed=8)
    kd, vd = misaligned(k), misaligned(v)
    if numbaflash.backend() == "simulator":
        assert not simulated.is_aligned16(kd) and not simulated.is_aligned16(vd)
    qd = cuda.to_device(q) if dtype == "float16" else cuda.to_device(q.view(np.uint16)).view(BF16)
    out, lse = numbaflash.attention(qd, kd, vd, version="v10", return_lse=True)
    out, lse = to_host(out), to_host(lse)
    check_forward(q, k, v, out, lse)
    out7, lse7 = run("v7", q, k, v, None)
    assert_bitwise_equal("out", np.asarray(out).view(np.uint16), out7.view(np.uint16))
    assert_bitwise_equal("lse", lse, lse7)


@st.composite
def drawn_cases(draw):
    return dict(dtype=draw(st.sampled_from(tuple(DTYPES))),
                B=draw(st.integers(1, 2)), H=draw(st.integers(1, 2)),
                Sq=draw(st.sampled_from((1, 31, 32, 33, 65)) | st.integers(1, 70)),
                Sk=draw(st.sampled_from((1, 31, 32, 33, 65)) | st.integers(1, 70)),
                d=draw(st.sampled_from((8, 16, 24, 40))),
                causal=draw(st.sampled_from(CAUSAL)),
                seed=draw(st.integers(0, 2 ** 16)))


@settings(max_examples=examples(0.25), deadline=None)
@given(case=drawn_cases())
def test_v10_on_drawn_shapes(case):
    q, k, v = inputs(case["dtype"], case["Sq"], case["Sk"], case["d"], case["B"], case["H"],
                     case["seed"])
    out, lse = run("v10", q, k, v, case["causal"])
    check_forward(q, k, v, out, lse, causal=case["causal"])


# --- the plan ---------------------------------------------------------------------------

def test_gpu_plan_takes_v7s_tiles_and_two_stages():
    for d, tiles in ((64, (128, 128)), (128, (128, 64)), (40, (128, 128))):
        q = np.zeros((2, 16, 4096, d), np.float16)
        plan = numbaflash.explain(q, q, q, version="v10", backend="gpu")
        assert (plan.Br, plan.Bc) == tiles and plan.block == (2 * tiles[0],)
        dp = (d + 15) // 16 * 16
        assert plan.shared_bytes == 2 * 2 * tiles[1] * (dp + 8) * 2 and plan.dynamic_shared
        assert plan.kernel == "forward_v10"
    assert v10_ldmatrix.v10_shared_bytes(128, 128, 64) == 73728


@pytest.mark.parametrize("kw,match", [
    ({"dtype": np.float32}, r"forward v10 cannot run this input: v10 multiplies float16"),
    ({"d": 136}, r"forward v10 cannot run this input: .*head dims up to 128"),
    ({"Hkv": 1}, r"forward v10 cannot run this input: .*plain attention.*GQA"),
    ({"window_size": (4, 4)}, r"forward v10 cannot run this input: .*plain attention.*window"),
    ({"softcap": 5.0}, r"forward v10 cannot run this input: .*plain attention.*softcap"),
    ({"tiles": (24, 32)}, r"v10 tiles must be \(Br, Bc\) with Br a multiple of 16"),
])
def test_v10_refuses_by_name(kw, match):
    kw = dict(kw)
    dtype, d, Hkv = kw.pop("dtype", np.float16), kw.pop("d", 16), kw.pop("Hkv", 2)
    q = np.zeros((1, 2, 8, d), dtype)
    k = np.zeros((1, Hkv, 8, d), dtype)
    with pytest.raises(ValueError, match=match):
        numbaflash.explain(q, k, k, version="v10", **kw)
