"""L2 (simulator) / L3 (GPU): backward v10, v6 with the running dK, dV and dQ given to the
big*big mma as its C operand (numbaflash/kernels/backward/v10_mma_accumulate.py).

v10 changes where v6's sums are rounded, so its gradients are not v6's bits; what is
checked:

- TESTING.md's rule as backward_checks.check_backward applies it (float64 reference on
  the rounded inputs, baseline the naive formula in the input dtype), on Hypothesis
  cases: float32 and float16, Sq and Sk from 1 to 48 (biased to the simulator tiles'
  boundaries), d in 8 and 16, not causal and both causal alignments, GQA, v10's own tile
  rule (v6's: split pairs, several chunks); exact zeros where no pair is visible.
- v10 against v6 on the same tiles: each gradient within a float32 summation bound of
  v6's (the same terms, rounded in another order), plain, causal, GQA, float16, the
  variants v6 takes (window, softcap, ALiBi, a boolean mask), tiles with several chunks
  and several n-tiles a warp, and a caller's tiles per kernel; dropout against the
  dropout reference; a packed batch against v6's.
- The launch contract: version="v10" plans v6's tiles, pairs, grids and shared memory
  for v10's two kernels; v10 is never a default (deterministic or not, any dtype, either
  backend); refusals before any launch (float64, d > 128, bad tiles); NaN or inf with
  version="v10" a ValueError (numbaflash/policy.py's start_finite_check checks
  them).
- On a GPU only: the same bits over reruns (no atomics).

What the simulator cannot show: it sums a tile's products and C exactly and rounds once
(kernels/simulated.py), where the tensor cores round their float32 sums more coarsely;
v10's running sums pass through that rounding once per chunk. Its error at training
lengths is measured on a GPU (tests/test_backward_kernels.py's cases there, and
lab/journal.md's list of what is to run). The kernels' PTX is checked in
tests/test_ptx.py (groups backward, variants, varlen).

Simulator cost: every mma is a rendezvous of a warp's 32 Python threads; each case keeps
B * H * Sq * Sk * d <= MAX_WORK.
"""

import ml_dtypes
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import numbaflash
from numbaflash.kernels import backward as bwd
from backward_checks import GRADS, backward_magnitudes, check_backward
from strategies import examples, on_gpu, within_budget
from test_dropout_backward_kernels import (P_DROP, SEED, check_dropout_backward,
                                           forward_out_lse, keep_of)
from tolerance import assert_bitwise_equal, fully_masked_rows, to_host, unseen_keys

pytestmark = pytest.mark.usefixtures("nan_prefilled_outputs")

v10 = bwd.module("v10")
DTYPES = ("float32", "float16")
CAUSAL = (None, "bottom_right", "top_left")
# seqlens near the simulator tiles' boundaries (16 and 32: v6's BWD_V6_SIM), up to 48
BOUNDARIES = (1, 15, 16, 17, 31, 32, 33, 47, 48)
MAX_SEQLEN = 48 if not on_gpu() else 700
MAX_WORK = 2 * 48 * 48 * 8 if not on_gpu() else 2 ** 23    # B * H * Sq * Sk * d
EPS32 = float(np.finfo(np.float32).eps)


def make_inputs(B, H, Hkv, Sq, Sk, d, dtype, seed):
    """q, dout (B, H, Sq, d) and k, v (B, Hkv, Sk, d): uniform in [-4, 4], rounded to
    ``dtype`` (the reference then sees exactly what the kernel sees)."""
    rng = np.random.default_rng(seed)

    def draw(heads, S):
        return rng.uniform(-4, 4, (B, heads, S, d)).astype(np.float32).astype(dtype)
    return draw(H, Sq), draw(Hkv, Sk), draw(Hkv, Sk), draw(H, Sq)


@st.composite
def v10_cases(draw):
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
                                        **{n: x for n, x in kw.items() if n != "tiles"})
    grads = numbaflash.attention_backward(dout, q, k, v, out, lse, causal=causal, scale=scale,
                                          version=version, **kw)
    return to_host(out), to_host(lse), tuple(to_host(g) for g in grads)


def assert_near_v6(g10, g6, dout, q, k, v, causal=None, scale=None, **variants):
    """v10's and v6's gradients are float32 sums of the same terms rounded in other
    orders: each within a recursive summation bound of the other, (S + 8) float32
    epsilons of the magnitude of its terms (backward_checks.backward_magnitudes; S the
    terms summed: Sk for dQ, Sq for dK and dV) for each of the two; for float16 outputs
    plus one float16 spacing of the element (the two sums may round to neighbours)."""
    mags = backward_magnitudes(dout, q, k, v, causal=causal, scale=scale, **variants)
    Sq, Sk = np.shape(q)[-2], np.shape(k)[-2]
    for name, a, b in zip(GRADS, g10, g6):
        assert a.dtype == b.dtype and a.shape == b.shape
        terms = Sk if name == "dQ" else Sq
        bound = 2 * (terms + 8) * EPS32 * mags[name]
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        if a.dtype == np.float16:
            bound = bound + np.spacing(np.abs(b).astype(np.float16)).astype(np.float64)
        err = np.abs(a64 - b64)
        assert np.all(err <= bound), (f"{name} of v10 and v6 differ by {err.max():.3g}, "
                                      f"bound {np.min(bound):.3g}")


# --- against the reference -----------------------------------------------------------

@settings(max_examples=examples(0.2))
@given(case=v10_cases())
@example(case=("float32", 2, 2, 1, 40, 9, 16, "bottom_right", None, 3))   # rows without keys
@example(case=("float16", 1, 4, 2, 17, 33, 8, "top_left", 0.5, 4))        # keys without rows
def test_v10_matches_reference(case):
    """dQ, dK, dV within TESTING.md's rule against the float64 reference (with the naive
    formula in the input dtype as the baseline), with v10's own tiles and split pairs;
    exact zeros where no pair is visible."""
    dtype, B, H, Hkv, Sq, Sk, d, causal, scale, seed = case
    q, k, v, dout = make_inputs(B, H, Hkv, Sq, Sk, d, dtype, seed)
    out, lse, grads = run("v10", dout, q, k, v, causal, scale)
    for g, x in zip(grads, (q, k, v)):
        assert g.dtype == x.dtype and g.shape == x.shape
    check_backward(dout, q, k, v, out, lse, grads, causal=causal, scale=scale)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_and_keys_without_pairs_are_exactly_zero(dtype):
    """bottom_right with Sq = 40 > Sk = 9: rows 0-30 see no key, so dQ is exactly 0 there
    (their running sums start at 0 and only ever meet P = 0), nothing NaN. top_left with
    Sk = 37 > Sq = 6: keys 6.. are seen by no row: dK, dV exactly 0."""
    q, k, v, dout = make_inputs(1, 2, 2, 40, 9, 8, dtype, 5)
    out, lse, grads = run("v10", dout, q, k, v, "bottom_right")
    rows = fully_masked_rows(40, 9, "bottom_right")
    assert rows.sum() == 31
    dq = grads[0].astype(np.float32)
    assert np.array_equal(dq[..., rows, :], np.zeros_like(dq[..., rows, :]))
    assert all(np.isfinite(g.astype(np.float32)).all() for g in grads)
    check_backward(dout, q, k, v, out, lse, grads, causal="bottom_right")
    q, k, v, dout = make_inputs(1, 1, 1, 6, 37, 16, dtype, 6)
    _, _, (_, dk, dv) = run("v10", dout, q, k, v, "top_left")
    keys = unseen_keys(6, 37, "top_left")
    for g in (dk, dv):
        g = g.astype(np.float32)
        assert np.array_equal(g[..., keys, :], np.zeros_like(g[..., keys, :]))


# --- v10 against v6, on the same tiles -----------------------------------------------

# (dtype, B, H, Hkv, Sq, Sk, d, causal, variants, tiles); tiles None: the rule's (v6's
# split pairs on the simulator's (16, 32) and (32, 16)); (32, 32) at d = 24: two chunks
# of the dK/dV kernel a Q tile (so its running sums meet the mma more than once a tile)
# and three n-tiles of the head dim; ((32, 32), (16, 64)): a caller's tiles per kernel,
# the dQ kernel's K/V tile two of its chunks of 32 keys.
V6_CASES = {
    "plain": ("float32", 1, 1, 1, 33, 35, 16, None, {}, None),
    "top_left": ("float32", 1, 1, 1, 50, 21, 8, "top_left", {}, None),
    "gqa_bottom_right": ("float32", 2, 4, 2, 17, 20, 8, "bottom_right", {}, None),
    "float16": ("float16", 1, 2, 1, 33, 18, 16, "bottom_right", {}, None),
    "variants": ("float32", 1, 2, 2, 29, 34, 8, None,
                 {"window_size": (9, 4), "softcap": 5.0,
                  "alibi_slopes": np.array([0.25, 0.5], np.float32),
                  "attn_mask": np.tril(np.ones((29, 34), bool), 10)}, (16, 32)),
    "two_chunks_three_ntiles": ("float32", 1, 1, 1, 40, 37, 24, "bottom_right", {},
                                (32, 32)),
    "tiles_per_kernel": ("float32", 1, 1, 1, 35, 70, 16, None, {}, ((32, 32), (16, 64))),
}


@pytest.mark.parametrize("name", list(V6_CASES))
def test_near_v6_and_within_the_rule(name):
    """With the same tiles v10's gradients are v6's up to the rounding of their sums
    (assert_near_v6), and within the rule against the reference (with the variant's
    arguments; v6 with a boolean mask takes one pair of tiles for both kernels)."""
    dtype, B, H, Hkv, Sq, Sk, d, causal, variants, tiles = V6_CASES[name]
    q, k, v, dout = make_inputs(B, H, Hkv, Sq, Sk, d, dtype, 11)
    out, lse, g10 = run("v10", dout, q, k, v, causal, tiles=tiles, **variants)
    _, _, g6 = run("v6", dout, q, k, v, causal, out=out, lse=lse, tiles=tiles, **variants)
    assert_near_v6(g10, g6, dout, q, k, v, causal, **variants)
    check_backward(dout, q, k, v, out, lse, g10, causal=causal, **variants)


def test_dropout():
    """Dropout (v6's keep mask, regenerated per entry): GQA, causal bottom-right, by the
    dropout reference's rule (test_dropout_backward_kernels)."""
    q, k, v, dout = make_inputs(2, 2, 1, 21, 19, 8, "float32", 12)
    keep = keep_of(q, 19)
    out, lse = forward_out_lse(q, k, v, keep, causal="bottom_right")
    grads = numbaflash.attention_backward(dout, q, k, v, out, lse, causal="bottom_right",
                                          dropout_p=P_DROP, dropout_seed=SEED, version="v10")
    check_dropout_backward(dout, q, k, v, out, lse, keep, tuple(to_host(g) for g in grads),
                           causal="bottom_right")


def test_packed_batch():
    """attention_varlen_backward(version="v10"): a packed batch of two sequences (Sq 20
    and 7, Sk 9 and 30), causal, GQA: each sequence's gradients near v6's."""
    rng = np.random.default_rng(13)
    cu_q, cu_k = np.array([0, 20, 27], np.int32), np.array([0, 9, 39], np.int32)
    q, dout = (rng.uniform(-4, 4, (27, 2, 8)).astype(np.float32) for _ in range(2))
    k, v = (rng.uniform(-4, 4, (39, 1, 8)).astype(np.float32) for _ in range(2))
    out, lse = numbaflash.attention_varlen(q, k, v, cu_q, cu_k, causal=True, return_lse=True)
    args = (dout, q, k, v, to_host(out), to_host(lse), cu_q, cu_k)
    g10, g6 = ([to_host(g) for g in numbaflash.attention_varlen_backward(
        *args, causal=True, version=version)] for version in ("v10", "v6"))

    def heads_first(x, sl):
        return np.swapaxes(x[sl], 0, 1)[None]
    for s in range(2):
        rows, keys = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        cut = (rows, keys, keys)
        assert_near_v6([heads_first(g, c) for g, c in zip(g10, cut)],
                       [heads_first(g, c) for g, c in zip(g6, cut)],
                       heads_first(dout, rows), heads_first(q, rows), heads_first(k, keys),
                       heads_first(v, keys), causal=True)


# --- the launch contract ---------------------------------------------------------------

def spec(B, H, S, d, dtype):
    return np.zeros((B, H, S, d), dtype)


@pytest.mark.parametrize("dtype", ["float32", "float16", ml_dtypes.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [None, "top_left"])
@pytest.mark.parametrize("backend", ["gpu", "simulator"])
def test_v10_plans_are_v6s(no_launch, dtype, d, causal, backend):
    """version="v10" plans v6's kernels' tiles, pairs, grids, blocks and shared memory
    (GQA included) for backward_dkdv_v10 and backward_dq_v10, with v6's reasons in v10's
    name."""
    q, kv = spec(2, 4, 300, d, dtype), spec(2, 2, 200, d, dtype)
    got = numbaflash.explain_backward(q, kv, kv, causal=causal, version="v10", backend=backend)
    want = numbaflash.explain_backward(q, kv, kv, causal=causal, version="v6", backend=backend)
    assert [p.kernel for p in got] == ["backward_preprocess", "backward_dkdv_v10",
                                       "backward_dq_v10"]
    assert all(p.version == "v10" for p in got)
    for a, b in zip(got, want):
        assert (a.Br, a.Bc, a.pairs, a.grid, a.block, a.shared_bytes, a.dynamic_shared) == (
            b.Br, b.Bc, b.pairs, b.grid, b.block, b.shared_bytes, b.dynamic_shared)
        assert a.reason == (b.reason.replace("v6 was asked for", "v10 was asked for")
                            .replace("for v6, which computes", "for v10, which computes"))
    assert got[1].grid == (-(-200 // got[1].Bc), 4)        # one block per K/V tile and head


def test_v10_with_a_mask_takes_one_pair_of_tiles(no_launch):
    """A boolean attn_mask (a table of visible tiles): one (Br, Bc) for both kernels, as
    v6; a caller's two different pairs are refused in v10's name."""
    q = spec(1, 2, 100, 64, "float32")
    mask = np.ones((100, 100), bool)
    plans = numbaflash.explain_backward(q, q, q, version="v10", backend="gpu", attn_mask=mask)
    assert (plans[1].Br, plans[1].Bc) == (plans[2].Br, plans[2].Bc)
    with pytest.raises(ValueError, match=r"backward v10 with a boolean attn_mask or mask_mod "
                                         r"takes one \(Br, Bc\) for both kernels"):
        numbaflash.explain_backward(q, q, q, version="v10", attn_mask=mask,
                                    tiles=((16, 32), (32, 16)))


@pytest.mark.parametrize("backend", ["gpu", "simulator"])
@pytest.mark.parametrize("deterministic", [True, False])
def test_v10_is_never_a_default(no_launch, backend, deterministic):
    """v10 runs only when asked for: no dtype, head dim, GQA or mask makes it a default."""
    for dtype in ("float32", "float16", ml_dtypes.bfloat16, "float64"):
        for d in (8, 64, 128, 200):
            for H, Hkv in ((2, 2), (4, 1)):
                q, kv = spec(1, H, 50, d, dtype), spec(1, Hkv, 70, d, dtype)
                for causal in (None, "bottom_right"):
                    plans = numbaflash.explain_backward(q, kv, kv, causal=causal,
                                                        backend=backend,
                                                        deterministic=deterministic)
                    assert all(p.version != "v10" for p in plans)


@pytest.mark.parametrize("d, dtype, tiles, match", [
    (8, "float64", None, r"backward v10 cannot run this input: v10 computes in float32"),
    (136, "float32", None, r"v10 keeps its dK, dV and dQ fragments in registers, which "
                           r"holds head dims up to 128"),
    (16, "float32", (24, 16), r"backward v10 tiles must be \(Br, Bc\) with Br and Bc "
                              r"multiples of 16"),
    (128, "float32", (256, 256), r"backward v10 tiles \(256, 256\) need \d+ bytes of "
                                 r"shared memory at head dim 128; the limit is 232448"),
])
def test_v10_refusals(no_launch, d, dtype, tiles, match):
    q = spec(1, 1, 8, d, dtype)
    with pytest.raises(ValueError, match=match):
        numbaflash.explain_backward(q, q, q, version="v10", tiles=tiles)
    lse = np.zeros((1, 1, 8), "float64" if dtype == "float64" else "float32")
    with pytest.raises(ValueError, match=match):
        numbaflash.attention_backward(q, q, q, q, q, lse, version="v10", tiles=tiles)


@pytest.mark.parametrize("name", ["q", "lse"])
def test_v10_refuses_nonfinite_inputs(name):
    """NaN in an input: version="v10" raises a ValueError that says why and what to use
    (v10's splits on the bits take finite inputs only, as v6's)."""
    q, k, v, dout = make_inputs(1, 1, 1, 9, 7, 8, "float32", 16)
    out, lse = (to_host(x) for x in numbaflash.attention(q, k, v, return_lse=True))
    args = {"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse}
    args[name] = args[name].copy()
    args[name][0, 0, 1] = np.nan
    with pytest.raises(ValueError, match=r"backward v10 cannot run this input: the inputs "
                                         r"hold NaN or inf .*; use v4"):
        numbaflash.attention_backward(*(args[n] for n in ("dout", "q", "k", "v", "out", "lse")),
                                      version="v10")


# --- on a GPU ------------------------------------------------------------------------------

@pytest.mark.skipif(not on_gpu(), reason="a GPU's reruns; the simulator runs blocks in turn")
def test_the_same_bits_over_reruns_on_the_gpu():
    """No atomics, sums in a fixed order: dQ, dK, dV the same bits on every run, and within
    the rule."""
    q, k, v, dout = make_inputs(4, 8, 4, 1000, 999, 64, "float32", 17)
    out, lse, first = run("v10", dout, q, k, v, "bottom_right")
    for _ in range(20):
        _, _, again = run("v10", dout, q, k, v, "bottom_right", out=out, lse=lse)
        for gname, a, b in zip(GRADS, again, first):
            assert_bitwise_equal(gname, a, b)
    check_backward(dout, q, k, v, out, lse, first, causal="bottom_right")
