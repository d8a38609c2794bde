"""L2 (simulator) / L3 (GPU): every backward kernel version against the reference.

Each version in numbaflash.kernels.backward.VERSIONS runs through the public API
(``attention_backward(version=...)``), after the default forward. What is checked:

- float64 within 1e-12 relative, float32 and float16 by TESTING.md's rule as
  backward_checks.py applies it to the backward (its docstring says how and why), on
  random shapes from strategies.py; non-finite positions compared exactly first; dQ rows
  of fully masked queries and dK, dV rows of keys nobody sees exactly 0.
- Outputs are pre-filled with NaN (conftest's nan_prefilled_outputs), so an element a
  kernel never writes shows up as a NaN where the reference has none.
- The identities of TESTING.md in float64: sum over keys of dK is 0; sum of dV is the sum
  of dO when every row sees a key; D = rowsum(dO * O) = rowsum(P * dP) (the preprocessing
  kernel itself); key-shift invariance; tile-size invariance.
- Edge cases: seqlen 1, ragged tails, Sq > Sk with fully masked rows, Sq < Sk, both causal
  alignments, head dims 1 and odd, NaN in keys nobody sees, bitwise-identical reruns (v1),
  device arrays in and out, attention_vjp, and every error before any launch.

Sizes follow the backend (strategies.py): tiny on the simulator, large on a GPU.
"""

import logging

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import numbaflash
from numbaflash import reference
from numbaflash.kernels import backward as bwd
from numbaflash.kernels.backward import preprocess as bwd_pre
from numbaflash.kernels.backward import v1_two_kernels as bwd_v1
from numbaflash.kernels.backward import v3_register_blocked as bwd_v3
from numbaflash.kernels.backward import v4_dynamic_shared as bwd_v4
from numbaflash.kernels.backward import v5_tensor_cores as bwd_v5
from numbaflash.kernels.plan import SHARED_MEM_LIMIT
from numbaflash.masks import visible
from backward_checks import (GRADS, backward_magnitudes, check_backward, exact_masks,
                             version_tiles)
from strategies import (attention_cases, examples, make_case, on_gpu, sizes_for_backend,
                        version_params)
from tolerance import assert_bitwise_equal, assert_close_f64, to_host

pytestmark = pytest.mark.usefixtures("nan_prefilled_outputs")

F64 = ("float64",)
RTOL = 1e-12


VERSIONS = version_params(bwd.VERSIONS, numbaflash.explain_backward)
# dtypes each version supports (v2 adds into dQ in its own dtype: no float16)
VERSION_DTYPES = {"v1": ("float16", "float32", "float64"), "v2": ("float32", "float64"),
                  "v3": ("float16", "float32", "float64"),
                  "v4": ("float16", "float32", "float64"), "v5": ("float16", "float32"),
                  "v6": ("float16", "float32"),
                  "v7": ("float16",),     # and bfloat16: tests/test_backward_half.py
                  "v8": ("float16", "float32"),   # and tests/test_backward_atomic_dq.py
                  "v10": ("float16", "float32")}  # and tests/test_backward_v10.py
# the versions without atomics
DETERMINISTIC = [v for v in VERSIONS if getattr(v, "values", (v,))[0] not in ("v2", "v8")]


def backward_tiles(d, acc_dtype):
    """(Br, Bc) pairs to draw for the backward kernels: every pair of the simulator's small
    tiles; on a GPU the production candidates that fit both backward kernels."""
    sizes = sizes_for_backend()
    pairs = bwd_v1.TILE_CANDIDATES if sizes.tile_sizes is None else \
        [(Br, Bc) for Br in sizes.tile_sizes for Bc in sizes.tile_sizes]
    return [t for t in pairs
            if bwd_v1.backward_shared_bytes(*t, d, acc_dtype) <= SHARED_MEM_LIMIT]


def forward(case, q=None, k=None, v=None):
    """(out, lse) by the default forward (its own tiles): what a user passes back."""
    return numbaflash.attention(case.q if q is None else q, case.k if k is None else k,
                                case.v if v is None else v, return_lse=True,
                                **case.options(with_tiles=False))


def require_dtype(version, dtype, d=4):
    """Skip, with the library's reason, if ``version`` refuses ``dtype`` (v5: float64) or
    head dim ``d`` (v5, v6, v8 and v10: d > 128, their fragments in registers)."""
    too_wide = version in ("v5", "v6", "v8", "v10") and d > bwd_v5.BWD_V5_MAX_HEAD_DIM
    if np.dtype(dtype).name not in VERSION_DTYPES[version] or too_wide:
        q = np.zeros((1, 1, 4, d), dtype)
        with pytest.raises(ValueError) as err:
            numbaflash.explain_backward(q, q, q, version=version)
        pytest.skip(str(err.value))


def backward(case, version="v1", tiles=None, out=None, lse=None, k=None, v=None, dout=None):
    """(out, lse, (dq, dk, dv)) as NumPy arrays: the forward (unless out and lse are
    given), then attention_backward with the case's tiles unless ``tiles`` is given (for
    v3 and v4 with a thread tile added, backward_checks.version_tiles). A dtype the
    version refuses is a visible skip (require_dtype)."""
    if version != "v2":                 # v2's float16 refusal is tested as an error
        require_dtype(version, case.dtype, case.d)
    k = case.k if k is None else k
    v = case.v if v is None else v
    if out is None:
        out, lse = forward(case, k=k, v=v)
    tiles = version_tiles(version, tiles or case.tiles, case.d, case.dtype, case.seed)
    grads = numbaflash.attention_backward(case.dout if dout is None else dout, case.q, k, v,
                                          out, lse, version=version, tiles=tiles,
                                          **case.options(with_tiles=False))
    return to_host(out), to_host(lse), tuple(to_host(g) for g in grads)


def check(case, version="v1", **kw):
    out, lse, grads = backward(case, version, **kw)
    return check_backward(case.dout, case.q, case.k, case.v, out, lse, grads,
                          causal=case.causal, scale=case.scale)


def cases(dtypes, **kw):
    return attention_cases(dtypes=dtypes, tiles=backward_tiles, with_dout=True, **kw)


# --- every version against the reference ---------------------------------------------

@pytest.mark.parametrize("version", VERSIONS)
@given(case=cases(("float64", "float32", "float16")))
@example(case=make_case(B=1, H=1, Sq=1, Sk=1, d=8, dtype="float32", causal=None, tiles=(4, 4),
                        scale=None, values="uniform", seed=817524, with_dout=True))
@example(case=make_case(B=1, H=1, Sq=1, Sk=1, d=111, dtype="float32", causal=None,
                        tiles=(32, 16), scale=0.3, values="grid", seed=0, with_dout=True))
def test_matches_reference(version, case):
    if np.dtype(case.dtype).name not in VERSION_DTYPES[version]:      # v2: float32 instead
        case = make_case(case.B, case.H, case.Sq, case.Sk, case.d, "float32", case.causal,
                         case.tiles, case.scale, case.values, case.seed, True)
    check(case, version)


@pytest.mark.parametrize("version", VERSIONS)
@given(case=cases(F64, causal=("bottom_right",)))
def test_fully_masked_rows_sq_greater_than_sk(version, case):
    """Causal bottom_right with Sq > Sk: the first Sq - Sk rows see no key. Their dQ rows
    are exactly 0 (checked with array_equal inside check_backward) and nothing is NaN."""
    case = make_case(case.B, case.H, case.Sk + 1 + case.Sq % 4, case.Sk, case.d, "float64",
                     "bottom_right", case.tiles, case.scale, case.values, case.seed, True)
    out, lse, grads = backward(case, version)
    assert exact_masks(case.Sq, case.Sk, case.causal)["dQ"].any()
    for g in grads:
        assert np.isfinite(g).all()
    check_backward(case.dout, case.q, case.k, case.v, out, lse, grads, causal=case.causal,
                   scale=case.scale)


EDGE_CASES = [
    # (B, H, Sq, Sk, d, causal, tiles): seqlen 1, ragged tails, Sq > Sk and Sq < Sk in both
    # alignments, head dim 1 and odd, tiles larger than the sequence
    (1, 1, 1, 1, 4, None, (4, 4)),
    (1, 1, 1, 9, 3, "bottom_right", (4, 4)),
    (1, 1, 9, 1, 5, "top_left", (4, 2)),
    (1, 2, 9, 1, 5, "bottom_right", (2, 4)),
    (1, 1, 9, 7, 1, None, (4, 4)),
    (2, 1, 11, 6, 3, "bottom_right", (4, 2)),
    (1, 1, 6, 11, 5, "top_left", (2, 4)),
    (1, 1, 6, 11, 5, "bottom_right", (4, 4)),
    (1, 1, 11, 6, 7, "top_left", (8, 4)),
    (1, 1, 5, 5, 16, None, (16, 16)),
]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("B, H, Sq, Sk, d, causal, tiles", EDGE_CASES)
def test_edge_cases(version, dtype, B, H, Sq, Sk, d, causal, tiles):
    check(make_case(B, H, Sq, Sk, d, dtype, causal, tiles, None, "uniform", 7, True), version)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_large_logits(version, dtype):
    """q and k x 8 (logits up to ~1000): finite and within the rule. In float32, lse ~ 1000
    is stored with an absolute error of ~3e-5, which P = exp(S - lse) inherits as a
    relative error; the rule's naive baseline has the same."""
    require_dtype(version, dtype)
    case = make_case(1, 1, 9, 10, 8, dtype, "bottom_right", (4, 4), None, "uniform", 3, True)
    q, k = (case.q * 8).astype(dtype), (case.k * 8).astype(dtype)
    out, lse = numbaflash.attention(q, k, case.v, causal=case.causal, return_lse=True)
    grads = numbaflash.attention_backward(case.dout, q, k, case.v, out, lse,
                                          causal=case.causal, version=version,
                                          tiles=version_tiles(version, (4, 4), 8, dtype, 3))
    for g in grads:
        assert np.isfinite(g).all()
    check_backward(case.dout, q, k, case.v, out, lse, grads, causal=case.causal)


# --- identities (float64) -------------------------------------------------------------

@given(case=cases(F64))
def test_identities(case):
    """sum over keys of dK = 0 per head; sum of dV = sum of dO over the rows that see a key."""
    _, _, (dQ, dK, dV) = backward(case)
    mags = backward_magnitudes(case.dout, case.q, case.k, case.v, causal=case.causal,
                               scale=case.scale)
    total = dK.sum(axis=-2)
    assert np.all(np.abs(total) <= RTOL * max(case.Sk, 1) * mags["dK"]), np.abs(total).max()
    sees = visible(case.Sq, case.Sk, case.causal).any(axis=1)
    want = (case.dout * sees[:, None]).sum(axis=-2)
    assert_close_f64("sum of dV", dV.sum(axis=-2), want, RTOL,
                     float(np.abs(case.dout).sum(axis=-2).max()))


@given(case=cases(F64))
def test_preprocess_kernel_computes_D(case):
    """The D kernel alone: D = rowsum(dO * O) (to rounding) = rowsum(P * dP)."""
    from numba import cuda
    out, _ = forward(case)
    O = np.ascontiguousarray(to_host(out).reshape(-1, case.Sq, case.d))
    dO = np.ascontiguousarray(case.dout.reshape(-1, case.Sq, case.d))
    D = cuda.to_device(np.full(O.shape[:2], np.nan))
    kernel = bwd_pre.make_backward_preprocess(case.d, "float64")
    threads = bwd_pre.THREADS
    kernel[(-(-case.Sq // threads), O.shape[0]), (threads,)](cuda.to_device(dO),
                                                            cuda.to_device(O), D)
    D = D.copy_to_host().reshape(case.q.shape[:-1])
    mag = float((np.abs(case.dout) * np.abs(to_host(out))).sum(axis=-1).max(initial=0))
    assert_close_f64("D", D, np.sum(case.dout * to_host(out), axis=-1), 1e-14, mag)
    P = reference.probabilities(case.q, case.k, causal=case.causal, scale=case.scale)
    dP = case.dout @ np.swapaxes(case.v, -1, -2)
    assert_close_f64("rowsum(P * dP)", D, np.sum(P * dP, axis=-1), RTOL, mag)


@given(case=cases(F64))
def test_key_shift_invariance(case):
    """K -> K + 1 u^T: every logit of row r moves by scale * q_r . u, so P does not change;
    neither do dQ (rowsum(dS) = 0), dK and dV."""
    u = case.random_like((case.d,))
    k = case.k + u
    _, _, shifted = backward(case, k=k)
    _, _, plain = backward(case)
    mags = backward_magnitudes(case.dout, case.q, k, case.v, causal=case.causal,
                               scale=case.scale)
    for name, a, b in zip(GRADS, shifted, plain):
        assert_close_f64(name, a, b, RTOL, mags[name])


@given(case=cases(F64), data=st.data())
@example(case=make_case(B=1, H=1, Sq=1, Sk=1, d=128, dtype="float64", causal=None, tiles=(8, 8),
                        scale=None, values="uniform", seed=0, with_dout=True),
         data=None).via("H200 2026-11-30: the other tiles were drawn for another head dim")
def test_tile_size_invariance(case, data):
    """The gradients do not depend on (Br, Bc) beyond rounding. The second (Br, Bc) is
    drawn from the pairs that fit this case's head dim and dtype."""
    candidates = backward_tiles(case.d, "float64" if np.dtype(case.dtype) == np.float64 else "float32")
    other = data.draw(st.sampled_from(candidates)) if data is not None else candidates[-1]
    out, lse = forward(case)
    _, _, a = backward(case, out=out, lse=lse)
    _, _, b = backward(case, tiles=other, out=out, lse=lse)
    mags = backward_magnitudes(case.dout, case.q, case.k, case.v, causal=case.causal,
                               scale=case.scale)
    for name, x, y in zip(GRADS, a, b):
        assert_close_f64(name, x, y, RTOL, mags[name])


# v3 tiles (Br, Bc, TM, TN) for the simulator: thread grids 4 x 4 down to 1 x 1, TM != TN
V3_SIM_TILES = ((8, 8, 2, 2), (8, 8, 4, 2), (8, 4, 2, 1), (4, 8, 1, 4), (16, 8, 4, 4),
                (4, 4, 1, 1))


def v3_tiles_that_fit(d, acc_dtype):
    """V3_SIM_TILES under the simulator; on a GPU the candidates of the v3 rule that fit."""
    if not on_gpu():
        return list(V3_SIM_TILES)
    fits = []
    for t in bwd_v3.BWD_V3_CANDIDATES:
        try:
            fits.append(bwd_v3.check_backward_v3_tiles(t, d, acc_dtype))
        except ValueError:
            pass
    return fits


@settings(max_examples=examples(0.5))
@given(case=cases(F64, max_seqlen=20, max_batch_heads=1), data=st.data())
def test_v3_does_not_depend_on_tiles_or_thread_tiles(case, data):
    """v3's gradients do not depend on (Br, Bc, TM, TN) beyond rounding, and equal v1's.
    With (Br, Bc) fixed, the thread tile changes no order of summation (every sum runs
    over k, the rows or the keys in the same order, whichever thread owns it): in the
    simulator the results are then equal to the last bit."""
    mags = backward_magnitudes(case.dout, case.q, case.k, case.v, causal=case.causal,
                               scale=case.scale)
    out, lse = forward(case)
    _, _, ref = backward(case, "v1", out=out, lse=lse)
    tiles = data.draw(st.sampled_from(v3_tiles_that_fit(case.d, "float64")))
    _, _, got = backward(case, "v3", tiles=tiles, out=out, lse=lse)
    for name, x, y in zip(GRADS, got, ref):
        assert_close_f64(name, x, y, RTOL, mags[name])
    if not on_gpu() and tiles[:2] == (8, 8):
        other = (8, 8, 1, 2) if tiles[2:] != (1, 2) else (8, 8, 2, 2)
        _, _, again = backward(case, "v3", tiles=other, out=out, lse=lse)
        for name, x, y in zip(GRADS, got, again):
            assert_bitwise_equal(name, x, y)


@settings(max_examples=examples(0.5))
@given(case=cases(("float64", "float32"), max_seqlen=20, max_batch_heads=1),
       data=st.data())
def test_v4_equals_v3_with_the_same_tiles(case, data):
    """v4 is v3's kernels with their shared arrays carved out of one dynamic shared array:
    with the same (Br, Bc, TM, TN) every sum runs in the same order, so the gradients are
    bitwise equal to v3's (on the simulator; on a GPU too, unless the compiler contracts
    differently, so there they are compared to rounding)."""
    dtype = np.dtype(case.dtype).name
    tiles = data.draw(st.sampled_from(v3_tiles_that_fit(case.d, dtype)))
    out, lse = forward(case)
    _, _, want = backward(case, "v3", tiles=tiles, out=out, lse=lse)
    _, _, got = backward(case, "v4", tiles=tiles, out=out, lse=lse)
    if on_gpu():
        mags = backward_magnitudes(case.dout, case.q, case.k, case.v, causal=case.causal,
                                   scale=case.scale)
        for name, x, y in zip(GRADS, got, want):
            assert_close_f64(name, x, y,
                             RTOL if dtype == "float64" else 1e-5, mags[name])
    else:
        for name, x, y in zip(GRADS, got, want):
            assert_bitwise_equal(name, x, y)


@pytest.mark.parametrize("version", VERSIONS)
def test_nan_in_keys_nobody_sees_has_no_effect(version):
    """top_left with Sk > Sq: keys Sq.. are visible from no row. NaN there changes no bit
    of any gradient, and their dK, dV rows are exactly 0. (v2's dQ is summed by atomics
    in a varying order, even in the simulator: there, equal up to rounding.)"""
    case = make_case(1, 2, 6, 11, 5, "float32", "top_left", (4, 4), None, "uniform", 11, True)
    out, lse = forward(case)
    _, _, clean = backward(case, version, out=out, lse=lse)
    k, v = case.k.copy(), case.v.copy()
    k[..., case.Sq:, :] = np.nan
    v[..., case.Sq:, :] = np.nan
    if version in ("v5", "v6"):
        # v5 and v6 take finite inputs only; the check before their launch refuses NaN
        # anywhere (test_backward_nonfinite.py: the default then runs v4)
        with pytest.raises(ValueError, match=f"backward {version} cannot run this input: "
                                             "the inputs hold NaN or inf"):
            backward(case, version, out=out, lse=lse, k=k, v=v)
        return
    _, _, dirty = backward(case, version, out=out, lse=lse, k=k, v=v)
    mags = backward_magnitudes(case.dout, case.q, case.k, case.v, causal=case.causal)
    for name, a, b in zip(GRADS, dirty, clean):
        if version == "v2" and name == "dQ":
            assert_close_f64(name, a, b, 1e-6, mags[name])
        else:
            assert_bitwise_equal(name, a, b)
    for g in dirty[1:]:
        assert np.array_equal(g[..., case.Sq:, :], np.zeros_like(g[..., case.Sq:, :]))


# --- determinism, interop, the vjp convenience ----------------------------------------

@pytest.mark.parametrize("version", DETERMINISTIC)
def test_repeated_runs_are_bitwise_identical(version):
    """v1 and v3 have no atomics: every element has one owner that sums in a fixed order."""
    case = make_case(2, 1, 13, 11, 5, "float32", "bottom_right", (4, 4), None, "uniform", 5,
                     True)
    out, lse = forward(case)
    first = backward(case, version, out=out, lse=lse)[2]
    for _ in range(2):
        for name, a, b in zip(GRADS, backward(case, version, out=out, lse=lse)[2], first):
            assert_bitwise_equal(name, a, b)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_gradients_have_the_input_dtype(dtype):
    case = make_case(1, 1, 5, 6, 3, dtype, None, (4, 4), None, "uniform", 2, True)
    for g in backward(case)[2]:
        assert g.dtype == np.dtype(dtype)


def test_device_arrays_in_device_arrays_out():
    from numba import cuda
    case = make_case(1, 2, 7, 5, 3, "float32", "bottom_right", (4, 4), None, "uniform", 4, True)
    out, lse = forward(case)
    host = numbaflash.attention_backward(case.dout, case.q, case.k, case.v, out, lse,
                                         causal=case.causal, tiles=(4, 4))
    dev = numbaflash.attention_backward(*(cuda.to_device(a) for a in (
        case.dout, case.q, case.k, case.v, out, lse)), causal=case.causal, tiles=(4, 4))
    for name, h, d in zip(GRADS, host, dev):
        assert isinstance(h, np.ndarray) and not isinstance(d, np.ndarray)
        assert_bitwise_equal(name, d.copy_to_host(), h)


@pytest.mark.parametrize("lead", [(), (2,)])
def test_2d_and_3d_layouts(lead):
    """(Sq, d) and (H, Sq, d) inputs give gradients of their shapes, bitwise equal to the
    same heads run as (1, H, Sq, d)."""
    case = make_case(1, 2, 7, 6, 3, "float64", "top_left", (4, 4), None, "uniform", 8, True)
    heads = slice(None) if lead else 0          # (2,): both heads; (): head 0 alone
    dout, q, k, v = (a[0, heads] for a in (case.dout, case.q, case.k, case.v))
    out, lse = numbaflash.attention(q, k, v, causal=case.causal, return_lse=True)
    got = numbaflash.attention_backward(dout, q, k, v, out, lse, causal=case.causal,
                                        tiles=(4, 4))
    want = numbaflash.attention_backward(*(a[None, None] if not lead else a[None]
                                           for a in (dout, q, k, v, out, lse)),
                                         causal=case.causal, tiles=(4, 4))
    for name, g, w, x in zip(GRADS, got, want, (q, k, v)):
        assert g.shape == x.shape
        assert_bitwise_equal(name, g, w.reshape(x.shape))


def test_vjp_equals_the_explicit_calls():
    case = make_case(1, 2, 9, 6, 4, "float32", "bottom_right", (4, 4), None, "uniform", 6,
                     True)
    out, vjp = numbaflash.attention_vjp(case.q, case.k, case.v, causal=case.causal,
                                        backward_tiles=(4, 4))
    want_out, lse = forward(case)
    assert_bitwise_equal("out", out, want_out)
    want = numbaflash.attention_backward(case.dout, case.q, case.k, case.v, want_out, lse,
                                         causal=case.causal, tiles=(4, 4))
    for name, g, w in zip(GRADS, vjp(case.dout), want):
        assert_bitwise_equal(name, g, w)
    # vjp can be called again, with another dout
    dout2 = case.random_like(case.dout.shape)
    want2 = numbaflash.attention_backward(dout2, case.q, case.k, case.v, want_out, lse,
                                          causal=case.causal, tiles=(4, 4))
    for name, g, w in zip(GRADS, vjp(dout2), want2):
        assert_bitwise_equal(name, g, w)


def test_launches_are_logged(caplog):
    """Every kernel the default plans (v4 on the simulator, v6 on a GPU) is logged with
    its reason. (This test passed tiles=(4, 4), which v6 refuses: found on the H200,
    run 44.)"""
    case = make_case(1, 1, 5, 5, 2, "float32", None, None, None, "uniform", 1, True)
    out, lse = forward(case)
    plans = numbaflash.explain_backward(case.q, case.k, case.v)
    with caplog.at_level(logging.INFO, logger="numbaflash"):
        numbaflash.attention_backward(case.dout, case.q, case.k, case.v, out, lse)
    text = caplog.text
    assert [plan.kernel for plan in plans][:1] == ["backward_preprocess"]
    for plan in plans:
        assert plan.kernel in text and plan.reason in text
    assert "deterministic" in text


# --- plans and errors (no launch) ------------------------------------------------------

def inputs(dtype="float32", Sq=4, Sk=5, d=3, lead=(1, 2)):
    rng = np.random.default_rng(0)
    q = rng.standard_normal(lead + (Sq, d)).astype(dtype)
    k = rng.standard_normal(lead + (Sk, d)).astype(dtype)
    v = rng.standard_normal(lead + (Sk, d)).astype(dtype)
    acc = np.float64 if dtype == "float64" else np.float32
    return q.copy(), q, k, v, q.copy(), np.zeros(lead + (Sq,), acc)


@pytest.mark.parametrize("which, bad, error, match", [
    ("dout", lambda a: a[..., :3, :], ValueError, r"dout must have q's shape \(1, 2, 4, 3\)"),
    ("out", lambda a: a[..., :2], ValueError, r"out must have q's shape"),
    ("dout", lambda a: a.astype(np.float64), TypeError, r"dout must have q's dtype float32"),
    ("out", lambda a: a.astype(np.float16), TypeError, r"out must have q's dtype float32"),
    ("lse", lambda a: a[..., :3], ValueError, r"lse must have shape \(1, 2, 4\)"),
    ("lse", lambda a: a[..., None], ValueError, r"lse must have shape"),
    ("lse", lambda a: a.astype(np.float64), TypeError, r"lse must be float32 for float32"),
    ("lse", lambda a: [0.0], TypeError, r"lse must be an array"),
    ("k", lambda a: a[..., :2], ValueError, r"k and v must have the same shape"),
])
def test_bad_inputs_raise_before_any_launch(no_launch, which, bad, error, match):
    names = ("dout", "q", "k", "v", "out", "lse")
    args = dict(zip(names, inputs()))
    args[which] = bad(args[which])
    with pytest.raises(error, match=match):
        numbaflash.attention_backward(*(args[n] for n in names))


def test_float16_lse_is_rejected(no_launch):
    dout, q, k, v, out, lse = inputs("float16")
    with pytest.raises(TypeError, match="lse must be float32 for float16"):
        numbaflash.attention_backward(dout, q, k, v, out, lse.astype(np.float16))


def test_mixed_host_and_device_raise(no_launch):
    from numba import cuda
    dout, q, k, v, out, lse = inputs()
    with pytest.raises(TypeError, match="mix host"):
        numbaflash.attention_backward(dout, q, k, v, out, cuda.to_device(lse))


@pytest.mark.parametrize("version, tiles, d, match", [
    ("v99", None, 3, r"unknown backward version 'v99'; choose from \('v1', 'v2', .*'v10'\)"),
    ("v1", (2048, 4), 3, r"Br = 2048 exceeds 1024: the backward runs one thread per query row"),
    ("v1", (4, 2048), 3, r"Bc = 2048 exceeds 1024: the backward runs one thread per key row"),
    ("v1", (0, 4), 3, r"tiles must be positive"),
    ("v1", "big", 3, r"tiles must be a pair of positive ints"),
    ("v1", (64, 64), 64, r"tiles \(Br, Bc\) = \(64, 64\) need 66560 bytes of shared memory in "
                         r"the backward at head dim 64 in float32; the limit is 49152"),
    ("v2", (64, 64), 64, r"need 66560 bytes"),
    ("v3", (64, 64), 64, r"backward v3 tiles \(Br, Bc, TM, TN\) = \(64, 64, 4, 4\) need "
                         r"\d+ bytes of shared memory at head dim 64 in float32; the limit is "
                         r"49152"),
    ("v3", (32, 32, 3, 2), 3, r"backward v3 tiles need TM to divide Br"),
    ("v3", (64, 64, 1, 1), 3, r"need 4096 threads .*; a block holds at most 1024"),
    ("v3", (32, 32, 0, 2), 3, r"tiles must be positive"),
    ("v3", (32, 32, 4), 3, r"tiles must be a pair of positive ints"),
    ("v4", (128, 128, 4, 4), 128, r"backward v4 tiles \(Br, Bc, TM, TN\) = \(128, 128, 4, 4\) "
                                  r"need \d+ bytes of shared memory at head dim 128 in float32; "
                                  r"the limit is 232448 \(227 KB dynamic shared memory per "
                                  r"block on the H100/H200\)"),
    ("v4", (32, 32, 3, 2), 3, r"backward v4 tiles need TM to divide Br"),
    ("v4", (64, 64, 1, 1), 3, r"need 4096 threads .*; a block holds at most 1024"),
    ("v4", (32, 32, 0, 2), 3, r"tiles must be positive"),
    ("v4", (32, 32, 4), 3, r"tiles must be a pair of positive ints"),
])
def test_bad_version_or_tiles_raise_before_any_launch(no_launch, version, tiles, d, match):
    with pytest.raises(ValueError, match=match):
        numbaflash.attention_backward(*inputs(d=d), version=version, tiles=tiles)
    with pytest.raises(ValueError, match=match):
        numbaflash.explain_backward(*inputs(d=d)[1:4], version=version, tiles=tiles)


def test_v2_refuses_float16(no_launch):
    with pytest.raises(ValueError, match="v2 adds into dQ with atomics.*float16"):
        numbaflash.attention_backward(*inputs("float16"), version="v2")


def test_vjp_checks_backward_options_before_the_forward(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the forward ran")
    monkeypatch.setattr(numbaflash.api, "launch_forward", fail)
    q = inputs()[1]
    with pytest.raises(ValueError, match="unknown backward version"):
        numbaflash.attention_vjp(q, q, q, backward_version="v99")


def test_vjp_rejects_a_bad_dout():
    q = inputs()[1]
    _, vjp = numbaflash.attention_vjp(q, q, q, backward_tiles=(4, 4))
    with pytest.raises(ValueError, match="dout must have q's shape"):
        vjp(q[..., :2, :])


@pytest.mark.parametrize("Sq, Sk, lead", [(0, 5, (1, 2)), (4, 0, (1, 2)), (0, 0, (2,)),
                                          (4, 5, (0, 3))])
@pytest.mark.parametrize("host", [True, False])
def test_empty_inputs_give_zeros_without_a_launch(no_launch, Sq, Sk, lead, host):
    """Sk = 0: dq is zero (no row sees a key), dk and dv are empty; Sq = 0: dk and dv are
    zero (no query looks at them); batch * heads = 0: all empty."""
    from numba import cuda
    args = inputs("float32", Sq=Sq, Sk=Sk, lead=lead)
    if not host:
        args = tuple(cuda.to_device(a) for a in args)
    dq, dk, dv = numbaflash.attention_backward(*args)
    assert dq.shape == lead + (Sq, 3) and dk.shape == dv.shape == lead + (Sk, 3)
    for g in (dq, dk, dv):
        g = to_host(g)
        assert g.dtype == np.float32 and np.array_equal(g, np.zeros_like(g))


def test_explain_backward_names_each_kernel():
    q = inputs()[1]
    plans = numbaflash.explain_backward(q, q, q, causal=True)  # the default: v6, v4 sim
    default = "v6" if on_gpu() else "v4"
    assert [p.kernel for p in plans] == ["backward_preprocess", f"backward_dkdv_{default}",
                                         f"backward_dq_{default}"]
    assert len(str(plans).splitlines()) == 3
    assert all(p.causal == "bottom_right" for p in plans)
    assert f"{default} is the default" in str(plans)
    if not on_gpu():
        assert "runs on the simulator too" in str(plans)
    plans = numbaflash.explain_backward(q.astype(np.float64), q.astype(np.float64),
                                        q.astype(np.float64))    # float64: v3
    assert [p.kernel for p in plans][1:] == ["backward_dkdv_v3", "backward_dq_v3"]
    assert "v3 is the default for plain attention in float64" in str(plans)
    plans = numbaflash.explain_backward(q, q, q, causal=True, window_size=(2, 0))
    # a variant runs on the default if that version takes variants, else on v1
    wanted = default if bwd.module(default).VARIANTS else "v1"
    assert [p.kernel for p in plans] == ["backward_preprocess", f"backward_dkdv_{wanted}",
                                         f"backward_dq_{wanted}"]
    assert f"{wanted} is the default" in str(plans) and "window" in plans[-1].variant
    plans = numbaflash.explain_backward(q, q, q, version="v2", tiles=(4, 8))
    assert [p.kernel for p in plans] == ["backward_preprocess", "backward_dkdv_dq_v2"]
    assert (plans[1].Br, plans[1].Bc, plans[1].block) == (4, 8, (8,))
    assert "not bitwise reproducible" in str(plans)
    plans = numbaflash.explain_backward(q, q, q, version="v3", tiles=(16, 8, 2, 4))
    assert [p.kernel for p in plans] == ["backward_preprocess", "backward_dkdv_v3",
                                         "backward_dq_v3"]
    for plan in plans[1:]:
        assert (plan.Br, plan.Bc, plan.thread_tile, plan.block) == (16, 8, (2, 4), (16,))
        assert "thread tile (TM, TN) = (2, 4) on a 8 x 2 thread grid" in str(plan)
        assert plan.shared_bytes <= SHARED_MEM_LIMIT
    assert plans[1].grid == (1, 2) and plans[2].grid == (1, 2)       # Sk = 5, Sq = 4
    plans = numbaflash.explain_backward(q, q, q, version="v3", tiles=(8, 8))
    assert plans[1].thread_tile == (4, 4)        # (Br, Bc) alone: TM, TN as forward v4
    plans = numbaflash.explain_backward(q, q, q, version="v4", tiles=(16, 8, 2, 4))
    assert [p.kernel for p in plans] == ["backward_preprocess", "backward_dkdv_v4",
                                         "backward_dq_v4"]
    v3 = numbaflash.explain_backward(q, q, q, version="v3", tiles=(16, 8, 2, 4))
    for plan, same in zip(plans[1:], v3[1:]):    # v3's launch; the bytes now dynamic
        assert (plan.Br, plan.Bc, plan.thread_tile, plan.block, plan.grid) == \
            (same.Br, same.Bc, same.thread_tile, same.block, same.grid)
        assert plan.shared_bytes == same.shared_bytes
        assert "dynamic shared memory" in str(plan)


def test_v4_takes_tiles_above_48_kb():
    """The point of v4: tiles v3 refuses for static shared memory are accepted, and the
    plans carry each kernel's dynamic bytes."""
    q = np.zeros((1, 2, 5, 128), np.float32)
    with pytest.raises(ValueError, match=r"the limit is 49152"):
        numbaflash.explain_backward(q, q, q, version="v3", tiles=(32, 32, 2, 2))
    plans = numbaflash.explain_backward(q, q, q, version="v4", tiles=(32, 32, 2, 2))
    assert [p.shared_bytes for p in plans[1:]] == [76288, 71808]
    assert all(p.block == (256,) and p.thread_tile == (2, 2) for p in plans[1:])
    assert "tiles given by the caller" in str(plans)


@pytest.mark.parametrize("acc_dtype", ["float32", "float64"])
def test_default_v3_tiles_fit_every_head_dim(acc_dtype):
    """The v3 rule (GPU candidates) picks, for every head dim, tiles whose two kernels fit
    48 KB and whose accumulators fit the register bound up to d = 128 in float32; and the
    examples in default_backward_v3_tiles's docstring hold."""
    for d in range(1, 257):
        t = bwd_v3.default_backward_v3_tiles(d, acc_dtype, "gpu")
        assert bwd_v3.check_backward_v3_tiles(t, d, acc_dtype) == t
        if acc_dtype == "float32" and d <= 128:
            assert max(bwd_v3.backward_v3_acc_regs(*t, d)) <= bwd_v3.BWD_V3_MAX_ACC_REGS
    if acc_dtype == "float32":
        assert [bwd_v3.default_backward_v3_tiles(d, "float32", "gpu")
                for d in (64, 128, 256)] == [(32, 32, 4, 2), (16, 16, 2, 1), (8, 8, 1, 1)]
    else:
        assert bwd_v3.default_backward_v3_tiles(64, "float64", "gpu") == (16, 16, 2, 1)
    assert bwd_v3.default_backward_v3_tiles(64, acc_dtype, "simulator") == \
        bwd_v3.BWD_V3_SIM_TILES


@pytest.mark.parametrize("acc_dtype", ["float32", "float64"])
def test_default_v4_tiles_follow_the_documented_rule(acc_dtype):
    """The backward v4 rule (GPU candidates) picks, for every head dim, tiles that pass the
    caller's check, whose two kernels fit BWD_V4_SHARED_MEM_TARGET and whose accumulators
    fit v3's register bound (float32, every d up to 256; float64 up to 160); each kernel's
    dynamic bytes are v3's for the same tiles (same arrays); and the examples in
    default_backward_v4_tiles's docstring hold."""
    for d in range(1, 257):
        t = bwd_v4.default_backward_v4_tiles(d, acc_dtype, "gpu")
        assert bwd_v4.check_backward_v4_tiles(t, d, acc_dtype) == t
        dkdv = bwd_v4.dkdv_v4_shared_bytes(*t, d, acc_dtype)
        dq = bwd_v4.dq_v4_shared_bytes(*t, d, acc_dtype)
        assert max(dkdv, dq) <= bwd_v4.BWD_V4_SHARED_MEM_TARGET
        assert dkdv == bwd_v3.dkdv_v3_shared_bytes(*t, d, acc_dtype)
        assert dq == bwd_v3.dq_v3_shared_bytes(*t, d, acc_dtype)
        if acc_dtype == "float32" or d <= 160:
            assert max(bwd_v3.backward_v3_acc_regs(*t, d)) <= bwd_v3.BWD_V3_MAX_ACC_REGS
    if acc_dtype == "float32":
        assert [bwd_v4.default_backward_v4_tiles(d, acc_dtype, "gpu")
                for d in (64, 128, 256)] == [(64, 64, 4, 4), (32, 32, 2, 2), (16, 16, 1, 1)]
        assert [bwd_v4.dkdv_v4_shared_bytes(64, 64, 4, 4, 64, acc_dtype),
                bwd_v4.dq_v4_shared_bytes(64, 64, 4, 4, 64, acc_dtype)] == [100352, 83200]
        assert [bwd_v4.dkdv_v4_shared_bytes(32, 32, 2, 2, 128, acc_dtype),
                bwd_v4.dq_v4_shared_bytes(32, 32, 2, 2, 128, acc_dtype)] == [76288, 71808]
    else:
        assert [bwd_v4.default_backward_v4_tiles(d, acc_dtype, "gpu") for d in (64, 128)] == \
            [(32, 32, 4, 2), (16, 16, 2, 1)]
    assert bwd_v4.default_backward_v4_tiles(64, acc_dtype, "simulator") == \
        bwd_v4.BWD_V4_SIM_TILES


@pytest.mark.parametrize("acc_dtype", ["float32", "float64"])
def test_default_backward_tiles_fit_every_head_dim(acc_dtype):
    """The documented rule picks, for every head dim up to the maximum, tiles whose two
    kernels fit 48 KB; and the examples in the rule's comment (v1_two_kernels.py) hold."""
    for d in range(1, 257):
        Br, Bc = bwd_v1.default_backward_tiles(d, acc_dtype)
        assert bwd_v1.dkdv_shared_bytes(Br, Bc, d, acc_dtype) <= SHARED_MEM_LIMIT
        assert bwd_v1.dq_shared_bytes(Br, Bc, d, acc_dtype) <= SHARED_MEM_LIMIT
    if acc_dtype == "float32":
        assert [bwd_v1.default_backward_tiles(d, "float32") for d in (16, 64, 128, 256)] == \
            [(64, 64), (32, 32), (16, 16), (8, 8)]


def test_the_check_itself_can_fail():
    """check_backward is not vacuous: a gradient off by 1e-5 relative in one element fails."""
    case = make_case(1, 1, 7, 6, 4, "float32", None, (4, 4), None, "uniform", 9, True)
    out, lse, grads = backward(case)
    check_backward(case.dout, case.q, case.k, case.v, out, lse, grads)
    for i in range(3):
        bad = [g.copy() for g in grads]
        at = np.unravel_index(np.argmax(np.abs(bad[i])), bad[i].shape)
        bad[i][at] *= np.float32(1 + 1e-5)
        with pytest.raises(AssertionError):
            check_backward(case.dout, case.q, case.k, case.v, out, lse, bad)


@pytest.mark.skipif(not on_gpu(), reason="determinism over many reruns is a GPU property")
@pytest.mark.parametrize("version", DETERMINISTIC)
def test_bitwise_identical_over_50_reruns_on_the_gpu(version):
    case = make_case(8, 4, 1000, 999, 64, "float32", "bottom_right", None, None, "uniform", 1,
                     True)
    out, lse = forward(case)
    first = backward(case, version, out=out, lse=lse)[2]
    for _ in range(50):
        for name, a, b in zip(GRADS, backward(case, version, out=out, lse=lse)[2], first):
            assert_bitwise_equal(name, a, b)



@pytest.mark.skipif(not on_gpu(), reason="at GPU sizes; on the simulator tests/test_simulated_kernels.py runs the same check at small shapes")
@pytest.mark.parametrize("d", [1, 59, 64, 100, 128])
@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
def test_backward_v6_pairs_are_bitwise_its_plain_tiles(d, causal):
    """Backward v6's default for float32 inputs keeps its streamed tiles as split pairs
    (v6_split_pairs.BWD_V6_NARROW, BWD_V6_WIDE): the same splits of the same values, done once
    as staged instead of where read, so its gradients must be bit for bit those of the
    same tiles given by the caller (which are run without pairs). Ragged lengths both
    ways, and with bottom_right and Sq > Sk rows that see no key."""
    dtype = np.float32
    rng = np.random.default_rng(d + 11)
    for Sq, Sk in ((200, 333), (333, 200), (128, 128), (5, 1)):
        q, dout = (rng.standard_normal((2, 3, Sq, d)).astype(dtype) for _ in range(2))
        k, v = (rng.standard_normal((2, 3, Sk, d)).astype(dtype) for _ in range(2))
        out, lse = numbaflash.attention(q, k, v, causal=causal, return_lse=True)
        _, kv, qp = numbaflash.explain_backward(q, k, v, causal=causal)
        assert (kv.version, qp.version) == ("v6", "v6") and qp.pairs
        tiles = ((kv.Br, kv.Bc), (qp.Br, qp.Bc))
        _, kv_plain, qp_plain = numbaflash.explain_backward(q, k, v, causal=causal,
                                                            version="v6", tiles=tiles)
        assert not (kv_plain.pairs or qp_plain.pairs)
        paired = numbaflash.attention_backward(dout, q, k, v, out, lse, causal=causal)
        plain = numbaflash.attention_backward(dout, q, k, v, out, lse, causal=causal,
                                              version="v6", tiles=tiles)
        for name, a, b in zip(GRADS, paired, plain):
            assert_bitwise_equal(f"{name} at {(Sq, Sk)}", a, b)

# --- the real compiler (no GPU needed) ------------------------------------------------

@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_backward_kernels_compile_and_link_for_sm90(dtype, record_property):
    """Every backward kernel (ptx_check.py's "backward" group: each kernel x causal off/on
    x d in 1, 64, 128, 256 with the default tiles) compiles for sm_90 and links; float16
    and float32 kernels have no float64 in their PTX; at d = 64 in float32 (the common
    case) v1's dQ kernel spills no registers, and v3's to v6's and v10's two kernels spill
    none at d = 64 and d = 128 in float16 and float32. (v1's dK/dV kernels keep four rows of d
    accumulators, dKj and dVj plus one Q tile's part of each, which float32 accuracy
    needs (see backward.py); from d = 64 on they spill: reported, not failed.)"""
    from test_ptx import assert_compiled_without_f64, run_ptx_check, table
    results = run_ptx_check("--group", "backward", f"--match=-{dtype}-", "--link")
    record_property("ptx_report", table(results))
    print(table(results))
    # per d: preprocess + (v1's two kernels, v2's one but not for float16) x causal; v3's
    # and v4's two kernels x causal at every d in float32, at d = 64 and 128 otherwise
    per_d = 1 + 2 * (2 if dtype == "float16" else 3)
    want = 4 * per_d + 2 * 4 * (4 if dtype == "float32" else 2)
    # v5's, v6's and v10's two kernels x causal at d = 1, 64, 128 in float32, 64 and 128
    # in float16
    want += 3 * {"float32": 12, "float16": 8, "float64": 0}[dtype]
    assert len(results) == want, [r["name"] for r in results]
    assert_compiled_without_f64(results, dtype)
    hot = []
    if dtype == "float32":
        hot = [r for r in results if "-d64-" in r["name"] and "backward_dq_v1-" in r["name"]]
        assert len(hot) == 2
    if dtype in ("float16", "float32"):
        for version in ("_v3-", "_v4-", "_v5-", "_v6-", "_v10-"):
            blocked = [r for r in results if version in r["name"]
                       and ("-d64-" in r["name"] or "-d128-" in r["name"])]
            assert len(blocked) == 8
            hot += blocked
    for r in hot:
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, (
            f"{r['name']} spills registers: {r['spill_stores']} bytes stored, "
            f"{r['spill_loads']} loaded\n{r['log']}")
        assert r["stack_bytes"] == 0, f"{r['name']} has a stack frame\n{r['log']}"
