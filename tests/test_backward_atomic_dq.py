"""L2 (simulator) / L3 (GPU): backward v8, v6's dK/dV kernel adding dQ by atomic adds
(numbaflash/kernels/backward/v8_atomic_dq.py), and ``deterministic=False``, which picks it.

What is checked:

- TESTING.md's rule as backward_checks.check_backward applies it (float64 reference on the
  rounded inputs, baseline the naive formula in the input dtype), on Hypothesis cases:
  float32 and float16, Sq and Sk from 1 to 48 (biased to the simulator tiles' boundaries,
  Sq != Sk), d in 8 and 16, not causal and both causal alignments, GQA (two K/V heads, or
  B = 2 with one; B = 2 with four query heads on two K/V heads in the comparison with v6
  below). Outputs are pre-filled with NaN (v8's zero fill must run: a dQ it misses shows
  as NaN).
- Rows that see no key: dQ exactly 0; keys no row sees: dK, dV exactly 0.
- dK and dV are v6's bits with the same tiles (the same work, make_dkdv_v6_work), plain,
  causal, GQA, float16 and with variants; dQ is v6's within a float32 rounding bound.
- The variants v6 takes come along: window, softcap, ALiBi and a boolean mask against the
  reference; dropout against the dropout reference (test_dropout_backward_kernels'); a
  packed batch (attention_varlen_backward(version="v8")) against v6's.
- The policy: deterministic=False picks v8 when planning for a GPU (float32, float16,
  bfloat16 through float32 copies, causal, GQA, variants) and says why; where v8 cannot
  run (the simulator, float64, d > 128) the deterministic default runs and the reason says
  that deterministic=False had no atomic version; NaN or inf found before the launch
  falls back to v4 with that reason; deterministic=True never picks v8; version="v8" runs
  on the simulator; attention_vjp passes deterministic on.
- Errors before any launch: a deterministic that is not a bool, float64, d > 128, bad
  tiles, NaN or inf with version="v8".
- On a GPU only: dK and dV the same bits over reruns (dQ need not be).

Simulator cost: every mma is a rendezvous of a warp's 32 Python threads; each case keeps
B * H * Sq * Sk * d <= MAX_WORK. The PTX of the kernels is checked in tests/test_ptx.py
(group backward_atomic_dq).
"""

import logging

import ml_dtypes
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import numbaflash
from numbaflash import policy, validate
from numbaflash.kernels import backward as bwd
from backward_checks import GRADS, backward_magnitudes, check_backward
from strategies import examples, on_gpu, within_budget
from test_dropout_backward_kernels import (P_DROP, SEED, check_dropout_backward,
                                           forward_out_lse, keep_of)
from tolerance import assert_bitwise_equal, fully_masked_rows, to_host, unseen_keys

pytestmark = pytest.mark.usefixtures("nan_prefilled_outputs")

v8 = bwd.module("v8")
DTYPES = ("float32", "float16")
CAUSAL = (None, "bottom_right", "top_left")
# seqlens near the simulator tiles' boundaries (16 and 32: v6's BWD_V6_SIM), up to 48
BOUNDARIES = (1, 15, 16, 17, 31, 32, 33, 47, 48)
MAX_SEQLEN = 48 if not on_gpu() else 700
MAX_WORK = 2 * 48 * 48 * 8 if not on_gpu() else 2 ** 23    # B * H * Sq * Sk * d
EPS32 = float(np.finfo(np.float32).eps)


def make_inputs(B, H, Hkv, Sq, Sk, d, dtype, seed):
    """q, dout (B, H, S, d) and k, v (B, Hkv, Sk, d): uniform in [-4, 4], rounded to
    ``dtype`` (the reference then sees exactly what the kernel sees)."""
    rng = np.random.default_rng(seed)

    def draw(heads, S):
        return rng.uniform(-4, 4, (B, heads, S, d)).astype(np.float32).astype(dtype)
    return draw(H, Sq), draw(Hkv, Sk), draw(Hkv, Sk), draw(H, Sq)


@st.composite
def v8_cases(draw):
    """(dtype, B, H, Hkv, Sq, Sk, d, causal, scale, seed) within the simulator's budget."""
    dtype = draw(st.sampled_from(DTYPES))
    d = draw(st.sampled_from((8, 16)))
    B, H, Hkv = draw(st.sampled_from(((1, 1, 1), (1, 2, 2), (2, 2, 1), (1, 4, 2))))

    def seqlen():
        return draw(st.one_of(st.sampled_from(BOUNDARIES), st.integers(1, MAX_SEQLEN)))
    Sq, Sk = within_budget(seqlen(), seqlen(), B * H * d, MAX_WORK)
    causal = draw(st.sampled_from(CAUSAL))
    scale = draw(st.sampled_from((None, 0.5)))
    return dtype, B, H, Hkv, Sq, Sk, d, causal, scale, draw(st.integers(0, 2 ** 16))


def run(version, dout, q, k, v, causal=None, scale=None, out=None, lse=None, **kw):
    """(out, lse, (dq, dk, dv)) on the host: the default forward (unless out and lse are
    given), then backward ``version``."""
    if out is None:
        out, lse = numbaflash.attention(q, k, v, causal=causal, scale=scale, return_lse=True,
                                        **{n: x for n, x in kw.items()
                                           if n not in ("deterministic", "tiles")})
    grads = numbaflash.attention_backward(dout, q, k, v, out, lse, causal=causal, scale=scale,
                                          version=version, **kw)
    return to_host(out), to_host(lse), tuple(to_host(g) for g in grads)


def assert_dq_near_v6(dq8, dq6, dout, q, k, v, causal=None, scale=None, **variants):
    """dQ of v8 and of v6 are float32 sums of the same terms in other orders: within a
    recursive summation bound, (Sk + 8) float32 epsilons of the magnitude of the terms
    (backward_checks.backward_magnitudes), for each of the two."""
    mag = backward_magnitudes(dout, q, k, v, causal=causal, scale=scale, **variants)["dQ"]
    bound = 2 * (np.shape(k)[-2] + 8) * EPS32 * mag
    err = float(np.abs(dq8.astype(np.float64) - dq6.astype(np.float64)).max(initial=0))
    assert err <= bound, f"dQ of v8 and v6 differ by {err:.3g} > {bound:.3g}"


# --- against the reference -----------------------------------------------------------

@settings(max_examples=examples(0.2))
@given(case=v8_cases())
@example(case=("float32", 2, 2, 1, 40, 9, 16, "bottom_right", None, 3))   # rows without keys
@example(case=("float16", 1, 4, 2, 17, 33, 8, "top_left", 0.5, 4))        # keys without rows
def test_v8_matches_reference(case):
    """dQ, dK, dV within TESTING.md's rule against the float64 reference (with the naive
    formula in the input dtype as the baseline); exact zeros where no pair is visible."""
    dtype, B, H, Hkv, Sq, Sk, d, causal, scale, seed = case
    q, k, v, dout = make_inputs(B, H, Hkv, Sq, Sk, d, dtype, seed)
    out, lse, grads = run("v8", dout, q, k, v, causal, scale)
    for g, x in zip(grads, (q, k, v)):
        assert g.dtype == x.dtype and g.shape == x.shape
    check_backward(dout, q, k, v, out, lse, grads, causal=causal, scale=scale)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_that_see_no_key_have_dq_exactly_zero(dtype):
    """bottom_right with Sq = 40 > Sk = 9: rows 0-30 see no key (lse = -inf), so no block
    adds anything but 0 to them: dQ exactly 0 there, nothing NaN, the rest within the rule.
    top_left with Sk = 37 > Sq = 6: keys 6.. are seen by no row: dK, dV exactly 0."""
    q, k, v, dout = make_inputs(1, 2, 2, 40, 9, 8, dtype, 5)
    out, lse, grads = run("v8", dout, q, k, v, "bottom_right")
    rows = fully_masked_rows(40, 9, "bottom_right")
    assert rows.sum() == 31
    dq = grads[0].astype(np.float32)
    assert np.array_equal(dq[..., rows, :], np.zeros_like(dq[..., rows, :]))
    assert all(np.isfinite(g.astype(np.float32)).all() for g in grads)
    check_backward(dout, q, k, v, out, lse, grads, causal="bottom_right")
    q, k, v, dout = make_inputs(1, 1, 1, 6, 37, 16, dtype, 6)
    _, _, (_, dk, dv) = run("v8", dout, q, k, v, "top_left")
    keys = unseen_keys(6, 37, "top_left")
    for g in (dk, dv):
        g = g.astype(np.float32)
        assert np.array_equal(g[..., keys, :], np.zeros_like(g[..., keys, :]))


# --- v8 is v6's dK/dV work -----------------------------------------------------------

# (dtype, B, H, Hkv, Sq, Sk, d, causal, variants); tiles (16, 32) cross both axes
V6_CASES = {
    "plain": ("float32", 1, 1, 1, 33, 35, 16, None, {}),
    "top_left": ("float32", 1, 1, 1, 50, 21, 8, "top_left", {}),
    "gqa_bottom_right": ("float32", 2, 4, 2, 17, 20, 8, "bottom_right", {}),
    "float16": ("float16", 1, 2, 1, 33, 18, 16, "bottom_right", {}),
    "variants": ("float32", 1, 2, 2, 29, 34, 8, None,
                 {"window_size": (9, 4), "softcap": 5.0,
                  "alibi_slopes": np.array([0.25, 0.5], np.float32),
                  "attn_mask": np.tril(np.ones((29, 34), bool), 10)}),
}
V6_TILES = (16, 32)             # the simulator's dK/dV tiles, given to both versions
# The GPU's tiles hold several 16-row chunks a Q tile and give a warp more than one of
# dQ's 8-column n-tiles; (16, 32) at d <= 16 give neither. (32, 32) at d = 24: two chunks
# a Q tile, three n-tiles for two warps (warp 0 takes n-tiles 0 and 2).
V6_CASES["two_chunks_three_ntiles"] = ("float32", 1, 1, 1, 40, 37, 24, "bottom_right", {})
V6_CASE_TILES = {"two_chunks_three_ntiles": (32, 32)}


@pytest.mark.parametrize("name", list(V6_CASES))
def test_dk_dv_are_v6s_bits(name):
    """With the same tiles v8's dK and dV are v6's bit for bit: the same work, with the dQ
    step between chunks touching none of it. dQ is within a rounding bound of v6's, and
    all three are within the rule against the reference (with the variant's arguments).
    (The tiles are given: v6 with a boolean mask takes one pair for both its kernels.)"""
    dtype, B, H, Hkv, Sq, Sk, d, causal, variants = V6_CASES[name]
    tiles = V6_CASE_TILES.get(name, V6_TILES)
    q, k, v, dout = make_inputs(B, H, Hkv, Sq, Sk, d, dtype, 11)
    out, lse, g8 = run("v8", dout, q, k, v, causal, tiles=tiles, **variants)
    _, _, g6 = run("v6", dout, q, k, v, causal, out=out, lse=lse, tiles=tiles, **variants)
    for gname, a, b in zip(GRADS[1:], g8[1:], g6[1:]):
        assert_bitwise_equal(gname, a, b)
    assert_dq_near_v6(g8[0], g6[0], dout, q, k, v, causal, **variants)
    check_backward(dout, q, k, v, out, lse, g8, causal=causal, **variants)


def test_dropout():
    """Dropout (the dS kept is v6's, with the regenerated keep mask in it): GQA, causal
    bottom-right, by the dropout reference's rule (test_dropout_backward_kernels)."""
    q, k, v, dout = make_inputs(2, 2, 1, 21, 19, 8, "float32", 12)
    keep = keep_of(q, 19)
    out, lse = forward_out_lse(q, k, v, keep, causal="bottom_right")
    grads = numbaflash.attention_backward(dout, q, k, v, out, lse, causal="bottom_right",
                                          dropout_p=P_DROP, dropout_seed=SEED, version="v8")
    check_dropout_backward(dout, q, k, v, out, lse, keep, tuple(to_host(g) for g in grads),
                           causal="bottom_right")


def test_packed_batch():
    """attention_varlen_backward(version="v8"): a packed batch of two sequences (Sq 20 and
    7, Sk 9 and 30), causal, GQA: dK and dV are v6's bits, dQ near v6's; v8's zero fill
    covers the packed (heads, rows, d) view."""
    rng = np.random.default_rng(13)
    cu_q, cu_k = np.array([0, 20, 27], np.int32), np.array([0, 9, 39], np.int32)
    q, dout = (rng.uniform(-4, 4, (27, 2, 8)).astype(np.float32) for _ in range(2))
    k, v = (rng.uniform(-4, 4, (39, 1, 8)).astype(np.float32) for _ in range(2))
    out, lse = numbaflash.attention_varlen(q, k, v, cu_q, cu_k, causal=True, return_lse=True)
    args = (dout, q, k, v, to_host(out), to_host(lse), cu_q, cu_k)
    g8 = [to_host(g) for g in numbaflash.attention_varlen_backward(*args, causal=True,
                                                                    version="v8")]
    g6 = [to_host(g) for g in numbaflash.attention_varlen_backward(*args, causal=True,
                                                                    version="v6")]
    for gname, a, b in zip(GRADS[1:], g8[1:], g6[1:]):
        assert_bitwise_equal(gname, a, b)
    for s in range(2):
        rows, keys = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])

        def heads_first(x, sl):
            return np.swapaxes(x[sl], 0, 1)
        assert_dq_near_v6(heads_first(g8[0], rows), heads_first(g6[0], rows),
                          heads_first(dout, rows), heads_first(q, rows), heads_first(k, keys),
                          heads_first(v, keys), causal=True)


# --- the policy: deterministic=False -----------------------------------------------------

def spec(B, H, S, d, dtype):
    return np.zeros((B, H, S, d), dtype)


@pytest.mark.parametrize("dtype, kernels", [
    ("float32", ["backward_preprocess", "backward_zero_dq_v8", "backward_dkdv_dq_v8"]),
    ("float16", ["backward_preprocess", "backward_zero_dq_v8", "backward_dkdv_dq_v8",
                 "backward_dq_narrow_v8"]),
    (ml_dtypes.bfloat16, ["backward_preprocess", "backward_zero_dq_v8",
                          "backward_dkdv_dq_v8"]),
])
@pytest.mark.parametrize("d", [64, 128])
def test_deterministic_false_picks_v8_on_a_gpu(no_launch, dtype, kernels, d):
    """Planning for a GPU: deterministic=False gives v8's plans (D, the zero fill, the
    kernel, for float16 the rounding into dQ; bfloat16 runs on float32 copies), with a
    reason that says dQ is added by atomics and its bits may vary, and v6's dK/dV tiles;
    causal and GQA alike. deterministic=True (the default) gives v6."""
    q, kv = spec(2, 4, 300, d, dtype), spec(2, 2, 200, d, dtype)
    for causal in (None, "top_left"):
        plans = numbaflash.explain_backward(q, kv, kv, causal=causal, deterministic=False,
                                            backend="gpu")
        assert [p.kernel for p in plans] == kernels
        assert all(p.version == "v8" for p in plans)
        work = plans[2]
        assert "deterministic=False" in work.reason and "atomic adds" in work.reason
        assert "may vary between runs" in work.reason and "GQA" in work.reason
        v6_dkdv = numbaflash.explain_backward(q, kv, kv, causal=causal, backend="gpu")[1]
        assert v6_dkdv.version == "v6"
        assert (work.Br, work.Bc, work.pairs) == (v6_dkdv.Br, v6_dkdv.Bc, v6_dkdv.pairs)
        assert work.grid == (-(-200 // work.Bc), 4) and work.block == (2 * work.Bc,)
        assert work.shared_bytes == v8.v8_shared_bytes(work.Br, work.Bc, d, work.pairs)
        assert work.shared_bytes <= 227 * 1024 and work.dynamic_shared


def test_deterministic_false_with_variants_picks_v8(no_launch):
    q = spec(1, 2, 100, 64, "float32")
    plans = numbaflash.explain_backward(q, q, q, causal=True, deterministic=False,
                                        backend="gpu", window_size=(16, 0), softcap=3.0,
                                        dropout_p=0.1, dropout_seed=1)
    assert plans[-1].version == "v8" and "dropout" in plans[-1].variant


@pytest.mark.parametrize("dtype, d, backend, why", [
    ("float32", 64, "simulator", "v8 is chosen on a GPU only"),
    ("float64", 64, "gpu", "v8 computes in float32"),
    ("float32", 136, "gpu", "head dims up to 128"),
])
def test_deterministic_false_falls_back_with_a_reason(no_launch, dtype, d, backend, why):
    """Where v8 cannot run the input, deterministic=False runs the deterministic default
    (the same plans as deterministic=True) and its reason says why."""
    q = spec(1, 1, 40, d, dtype)
    plans = numbaflash.explain_backward(q, q, q, deterministic=False, backend=backend)
    default = numbaflash.explain_backward(q, q, q, backend=backend)
    assert [p.kernel for p in plans] == [p.kernel for p in default]
    assert plans[-1].version != "v8"
    assert "deterministic=False had no atomic version for this input" in plans[-1].reason
    assert why in plans[-1].reason


@pytest.mark.parametrize("backend", ["gpu", "simulator"])
def test_deterministic_true_never_picks_v8(no_launch, backend):
    for dtype in ("float32", "float16", ml_dtypes.bfloat16, "float64"):
        for d in (8, 64, 128, 200):
            for H, Hkv in ((2, 2), (4, 1)):
                q, kv = spec(1, H, 50, d, dtype), spec(1, Hkv, 70, d, dtype)
                for causal in (None, "bottom_right"):
                    plans = numbaflash.explain_backward(q, kv, kv, causal=causal,
                                                        backend=backend)
                    assert all(p.version != "v8" for p in plans)


def test_explicit_v8_runs_on_the_simulator_and_logs_its_plans(caplog):
    """version="v8" runs wherever asked (here too), whatever ``deterministic`` says; every
    kernel of its plans is logged with its reason."""
    q, k, v, dout = make_inputs(1, 1, 1, 17, 17, 8, "float16", 14)
    with caplog.at_level(logging.INFO, logger="numbaflash"):
        run("v8", dout, q, k, v, deterministic=True)
    text = caplog.text
    for kernel in ("backward_zero_dq_v8", "backward_dkdv_dq_v8", "backward_dq_narrow_v8"):
        assert kernel in text
    assert "v8 was asked for by the caller" in text


def test_vjp_passes_deterministic_on(caplog):
    """attention_vjp(deterministic=False): the backward is planned with it. On a GPU v8
    runs and its logged reason says why; on the simulator the deterministic default runs
    and its logged reason says deterministic=False found no atomic version."""
    q, k, v, dout = make_inputs(1, 1, 1, 9, 9, 8, "float32", 15)
    _, vjp = numbaflash.attention_vjp(q, k, v, deterministic=False)
    with caplog.at_level(logging.INFO, logger="numbaflash"):
        grads = vjp(dout)
    assert len(grads) == 3
    if on_gpu():
        assert "backward_dkdv_dq_v8" in caplog.text
        assert "v8 because deterministic=False" in caplog.text
    else:
        assert "deterministic=False had no atomic version for this input" in caplog.text


def test_nonfinite_inputs_fall_back_to_v4_with_the_reason():
    """NaN among the inputs of plans that deterministic=False made v8's: the finite check
    gives v4's plans, and the reason says deterministic=False had no atomic
    version for this input; version="v8" with a NaN raises instead."""
    from numba import cuda
    q, k, v, dout = make_inputs(1, 1, 1, 9, 7, 8, "float32", 16)
    out, lse = (to_host(x) for x in numbaflash.attention(q, k, v, return_lse=True))
    q = q.copy()
    q[0, 0, 1, 1] = np.nan
    p = validate.check_backward_inputs(dout, q, k, v, out, lse)
    plans = policy.plan_backward(p, "v8")          # as deterministic=False plans on a GPU
    arrays = [cuda.to_device(np.ascontiguousarray(a.reshape((-1,) + a.shape[2:])))
              for a in (q, k, v, out, dout, lse)]
    checked = policy.start_finite_check(plans, p, *arrays).plans(asked=False)
    assert checked[-1].version == "v4"
    assert "deterministic=False had no atomic version for this input" in checked[-1].reason
    with pytest.raises(ValueError, match=r"backward v8 cannot run this input: the inputs "
                                         r"hold NaN or inf .*; use v4"):
        numbaflash.attention_backward(dout, q, k, v, out, lse, version="v8")


def test_float16_scratch_is_counted(no_launch):
    """The float32 sums of a float16 dQ are device memory the call allocates."""
    q = spec(1, 2, 64, 16, "float16")
    lse = np.zeros((1, 2, 64), np.float32)
    p = validate.check_backward_inputs(q, q, q, q, q, lse)
    for version, counted in (("v8", True), ("v6", False)):
        plans = policy.plan_backward(p, version)
        parts = validate.backward_memory(p, plans, {}, False)
        scratch = [n for what, n, _ in parts if "v8's float32 sums" in what]
        assert scratch == ([2 * 64 * 16 * 4] if counted else [])


# --- errors before any launch ----------------------------------------------------------

@pytest.mark.parametrize("bad", ["yes", 0, None])
def test_deterministic_must_be_a_bool(no_launch, bad):
    q = spec(1, 1, 8, 8, "float32")
    lse = np.zeros((1, 1, 8), np.float32)
    match = r"deterministic must be True or False"
    with pytest.raises(TypeError, match=match):
        numbaflash.explain_backward(q, q, q, deterministic=bad)
    with pytest.raises(TypeError, match=match):
        numbaflash.attention_backward(q, q, q, q, q, lse, deterministic=bad)
    with pytest.raises(TypeError, match=match):
        numbaflash.attention_vjp(q, q, q, deterministic=bad)


@pytest.mark.parametrize("d, dtype, tiles, match", [
    (8, "float64", None, r"backward v8 cannot run this input: v8 computes in float32"),
    (136, "float32", None, r"v8 keeps its dK, dV and dQ fragments in registers, which holds "
                           r"head dims up to 128"),
    (16, "float32", (24, 16), r"backward v8 tiles must be \(Br, Bc\) with Br and Bc "
                              r"multiples of 16"),
    (128, "float32", (256, 256), r"backward v8 tiles \(256, 256\) need \d+ bytes of shared "
                                 r"memory at head dim 128; the limit is 232448"),
])
def test_v8_refusals(no_launch, d, dtype, tiles, match):
    q = spec(1, 1, 8, d, dtype)
    with pytest.raises(ValueError, match=match):
        numbaflash.explain_backward(q, q, q, version="v8", tiles=tiles)
    lse = np.zeros((1, 1, 8), "float64" if dtype == "float64" else "float32")
    with pytest.raises(ValueError, match=match):
        numbaflash.attention_backward(q, q, q, q, q, lse, version="v8", tiles=tiles)


# --- on a GPU ------------------------------------------------------------------------------

@pytest.mark.skipif(not on_gpu(), reason="the order of atomic adds varies on a GPU only")
def test_dk_dv_are_the_same_bits_over_reruns_on_the_gpu():
    """dK and dV have one owner each, summed in a fixed order: the same bits on every run;
    dQ (atomic adds) within the rule every time, the same bits or not."""
    q, k, v, dout = make_inputs(4, 8, 4, 1000, 999, 64, "float32", 17)
    out, lse, first = run("v8", dout, q, k, v, "bottom_right")
    for _ in range(20):
        _, _, again = run("v8", dout, q, k, v, "bottom_right", out=out, lse=lse)
        for gname, a, b in zip(GRADS[1:], again[1:], first[1:]):
            assert_bitwise_equal(gname, a, b)
    check_backward(dout, q, k, v, out, lse, again, causal="bottom_right")
