"""L2 (simulator) / L3 (GPU): float16 inputs at and beyond the edge of float16's range.

float16's largest finite value is 65504; a value that rounds to 65520 or more becomes inf.
The rest of the suite draws float16 inputs in [-4, 4] and holds the kernels to a naive
float16 baseline (tests/tolerance.py), which overflows, and so refuses to judge, as soon
as a score, dP or a gradient passes 65504. What numbaflash does with such inputs:

    The kernels read float16 inputs into float32 (kernels/__init__.py, ``acc_type``): the
    scores S = scale q.k, the softmax, lse, D = rowsum(dO * out), dP, dS and every sum
    are float32, and only out, dq, dk and dv are rounded to float16, when they are
    written (forward v7 also rounds each probability to float16 for its P V product, as
    flash-attention's float16 kernels do). So:
    * scores beyond 65504 neither overflow nor make NaN: out and lse are those of the
      float32 formula on the float16 inputs, out then rounded to float16;
    * a gradient whose value passes float16's range comes out +-inf with its sign, as a
      cast of the float32 result does, and never NaN; the others are as accurate as the
      float32 formula.

How that is checked here, against the float64 reference on the float16 inputs
(``reference_backward``, reference.forward), with a *float32* baseline in place of the
float16 one (the same naive formulas, tests/backward_checks.py's ``naive_backward`` and
reference.forward, given the float16 inputs in float32):

    forward  max|out - O| <= 2 * max|base - O| + 2 spacing16(max|O|) + eps32 size_S max|V|
             max|lse - L| <= 2 * max|base - L| + 2 spacing32(max|L|) + eps32 size_S
    backward backward_checks.assert_gradient_rule with that baseline (its four terms: 5x /
             3x the baseline, 2 spacings of the output, 2 float32 spacings of the terms'
             size, and eps32 size_S times the sensitivity to a relative error in P),
             on the positions where the reference is finite in float16; where it is not,
             +-inf (``assert_gradient_with_overflow``)

eps32 size_S (size_S: max |S| + log Sk, backward_checks.score_size) is the relative error
P = exp(S - m) carries when something is rounded at the scale of S: a float32 score of
9e4 is known to 0.004 (backward_checks' point 4). It is why a float32 result of large
scores can be worse than float16's output rounding: at |S| = 9e4 and d = 16 the default
backward's dQ was off by 3.3 where max|dQ| was 24, and backward v1's by 0.08
(kernels/backward/v3_register_blocked.py computes exp2(s * scale * log2(e) - L * log2(e))
and the simulator rounds the product s * scale * log2(e) to float32 before the
subtraction, at the scale of S). Where every score is exact in float32 (``exact_scores``:
grid inputs whose partial sums are exact in any order, and a power-of-two scale), the
versions that subtract the row's max (forward, ``EXP_OF_DIFFERENCE``) or L (backward v1,
``BACKWARD_EXP_OF_DIFFERENCE``) from the score before anything else are held to the bound
without that term: their out is float16's rounding of a float32 result accurate to a few
float32 ulps (measured: 0.25 float16 spacings). The mma_rows family (forward v6, v7, v8)
and backward v3 to v6 multiply the score by log2(e) first and are held to the full bound.
At these scores the backward's bound is wide (at |S| = 9e4 the float32 baseline's own dQ
error was 0.08 of a max|dQ| of 24), and so are dQ's and dK's bounds in the
gradient-overflow cases (their terms reach 1e8): a dQ made 0.1% larger everywhere passed
every check here, while the same in dV, an out 3 float16
spacings off at one element, or gradients clipped to +-65504 instead of inf each failed
some (tried once, with the results of the real kernels altered).

One exception is known and marked: forward v7 can give inf where out is exactly 65504
(``test_out_of_values_at_the_float16_maximum``, strict xfail with the reason).

The non-finite half (test_backward_nonfinite.py's contract, float16): NaN spreads exactly
as in float32 (that file's tests run float16 too). Here: +-inf in a visible input gives the
NaN, +inf and -inf positions of numbaflash.reference.backward on the same inputs, every
gradient row it cannot reach is bitwise what it was, and one it cannot reach at all
(a masked or padded key, a fully masked row) changes no bit; backward v5 and v6 refuse a
float16 inf like a NaN.
"""

import numpy as np
import pytest

import numbaflash
from numbaflash import reference
from numbaflash.masks import visible
from backward_checks import (GRADS, assert_gradient_rule, backward_magnitudes, check_out_lse,
                             exact_masks, naive_backward, p_error_magnitudes,
                             reference_backward, score_size)
from strategies import make_case
from tolerance import (MULT, assert_bitwise_equal, assert_exact, assert_same_nonfinite,
                       fully_masked_rows, to_host)

pytestmark = [pytest.mark.usefixtures("nan_prefilled_outputs"),
              # the casts to float16 of values beyond its range that this file is about
              pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")]

F16, F32 = np.float16, np.float32
F16_MAX = float(np.finfo(F16).max)            # 65504
F16_OVERFLOW = F16_MAX + 2.0 ** 4       # 65520, half float16's spacing (2^5) above: rounds to inf
EPS32 = float(np.finfo(F32).eps)
BIG = 600.0             # the large component of q and k: |scale q.k| ~ 1.8e5 at d = 4

# Forward versions that compute p = exp(s - m) from the float32 score (v3's 3xTF32
# products of float16 values are exact too): nothing is rounded at the scale of S.
EXP_OF_DIFFERENCE = ("v1", "v2", "v3", "v4", "v5")
SIMT_FORWARD = [None, "v1", "v2", "v4", "v5"]         # None: the default (v5 here, v10 on a GPU)
TENSOR_CORE_FORWARD = ["v3", "v6", "v7", "v8"]
SIMT_BACKWARD = [None, "v1", "v3", "v4"]              # None: the default (v4 here, v9 on a GPU)
# Backward versions that compute p = exp(s - L) from the float32 score s = scale q.k.
BACKWARD_EXP_OF_DIFFERENCE = ("v1",)
CAUSAL = [None, "bottom_right", "top_left"]


# --- inputs ---------------------------------------------------------------------------

def grid(rng, shape, unit=0.5):
    """float16 multiples of ``unit`` in [-8 unit, 8 unit]."""
    return (rng.integers(-8, 9, size=shape) * unit).astype(F16)


def beyond_range_scores(seed, B=1, H=2, Sq=9, Sk=7, d=4, exact=True):
    """(q, k, v, dout), float16, whose visible scores all exceed 65504 in size: q's first
    component is +-BIG by row, k's is BIG except for key 1 (-BIG), so that a row of +BIG
    sees the key 1 at -1.8e5 below the others (weight 0 in every precision) and a row of
    -BIG sees key 1 alone. ``exact``: the rest is multiples of 0.5 in [-4, 4] (every
    product a multiple of 0.25 and every partial sum < 2^22: exact in float32 in any
    order); else float16 values uniform in [-4, 4] and big components uniform in
    [BIG - 100, BIG + 100] (rounded to float16), so that the float32 scores are not exact.
    v and dout are in [-4, 4]."""
    rng = np.random.default_rng(seed)
    if exact:
        q, k, v, dout = (grid(rng, s) for s in ((B, H, Sq, d), (B, H, Sk, d), (B, H, Sk, d),
                                                (B, H, Sq, d)))
        big_q = np.full((B, H, Sq), BIG)
        big_k = np.full((B, H, Sk), BIG)
    else:
        q, k, v, dout = (rng.uniform(-4, 4, s).astype(F16) for s in
                         ((B, H, Sq, d), (B, H, Sk, d), (B, H, Sk, d), (B, H, Sq, d)))
        big_q = rng.uniform(BIG - 100, BIG + 100, (B, H, Sq))
        big_k = rng.uniform(BIG - 100, BIG + 100, (B, H, Sk))
    q[..., 0] = big_q * np.where(rng.random((B, H, Sq)) < 0.5, 1, -1)
    k[..., 0] = big_k
    if Sk > 1:
        k[..., 1, 0] = -k[..., 1, 0]
    return q, k, v, dout


def beyond_range_gradients(seed, B=1, H=2, Sq=9, Sk=7, d=4):
    """(q, k, v, dout), float16: q, k integers in [-8, 8] (scores up to 128, a peaked
    softmax), v multiples of 32 up to 256 and dout multiples of 4096 up to 32768, so that
    dP = dO . V reaches ~3e7 and dq, dk and dv pass float16's range in places (out, within
    max|v|, does not); every row's dout[0] is 32768, so that dv[c, 0] passes 65504 where
    the rows' probabilities of key c add up to 2 or more."""
    rng = np.random.default_rng(seed)
    q, k = grid(rng, (B, H, Sq, d), 1.0), grid(rng, (B, H, Sk, d), 1.0)
    v = grid(rng, (B, H, Sk, d), 32.0)
    dout = grid(rng, (B, H, Sq, d), 4096.0)
    dout[..., 0] = 32768        # dv[:, 0] = 32768 x (column sums of P): past 65504 above 2
    return q, k, v, dout


def spacing16(x):
    """float16's spacing at |x|: np.spacing(float16(x)), except that at 65504 (where NumPy
    gives inf: the next value up is inf) it is that binade's, 32."""
    return float(np.spacing(F16(min(abs(float(x)), 2.0 ** 15))))


def f32(*arrays):
    return tuple(np.asarray(a, F32) for a in arrays)


def exact_scores(q, k, scale):
    """Whether every score is exact in float32 whatever the order of its sum: the scale is
    a power of two, every product q_i k_i is a multiple of 0.25 (exact in float32), and
    the sum of their sizes is below 2^22 (so every partial sum is a multiple of 0.25
    below 2^22: exact)."""
    Q, K = np.asarray(q, np.float64), np.asarray(k, np.float64)
    power_of_two = np.frexp(scale)[0] == 0.5
    products = Q[..., :, None, :] * K[..., None, :, :]
    return bool(power_of_two and np.all(products * 4 == np.round(products * 4))
                and (np.abs(products).sum(axis=-1) < 2.0 ** 22).all())


# --- the rules --------------------------------------------------------------------------

def check_forward_float32_rule(q, k, v, out, lse, *, causal=None, scale=None, size_term=True):
    """out and lse against the float64 reference with the float32 baseline (module
    docstring). Non-finite positions equal the reference's (none but lse = -inf of rows
    that see no key); those rows are exactly 0 and -inf. ``size_term``: add eps32 size_S
    (times max|V| for out). Returns {name: (error, bound)}."""
    out, lse = to_host(out), to_host(lse)
    assert out.dtype == F16 and lse.dtype == F32, (out.dtype, lse.dtype)
    O, L = reference.forward(q, k, v, causal=causal, scale=scale)
    with np.errstate(all="ignore"):
        base_O, base_L = reference.forward(*f32(q, k, v), causal=causal, scale=scale,
                                           dtype=F32)
    rows = fully_masked_rows(q.shape[-2], k.shape[-2], causal)
    size_S = score_size(q, k, causal=causal, scale=scale) if size_term else 0.0
    max_V = float(np.abs(np.asarray(v, np.float64)).max(initial=0))
    result = {}
    for name, got, ref, base, out_dtype, sensitivity, exact in (
            ("O", out, O, base_O, F16, max_V, rows[:, None]),
            ("lse", lse, L, base_L, F32, 1.0, rows)):
        got = got.astype(np.float64)
        assert_same_nonfinite(name, got, ref)
        assert_same_nonfinite(f"{name} (float32 baseline)", base.astype(np.float64), ref)
        assert_exact(name, got, ref, exact)
        finite = np.isfinite(ref)
        err = float(np.abs(got[finite] - ref[finite]).max(initial=0))
        base_err = float(np.abs(base[finite].astype(np.float64) - ref[finite]).max(initial=0))
        max_ref = float(np.abs(ref[finite]).max(initial=0))
        spacing = spacing16(max_ref) if out_dtype == F16 else float(np.spacing(F32(max_ref)))
        bound = (MULT[name] * base_err + 2 * spacing
                 + EPS32 * size_S * sensitivity)
        assert err <= bound, (f"{name}: max |kernel - ref| = {err:.6g} exceeds {bound:.6g} = "
                              f"{MULT[name]} x float32 baseline error {base_err:.6g} + 2 x "
                              f"spacing({max_ref:.6g}) + eps32 x size_S {size_S:.6g} x "
                              f"{sensitivity:.6g}")
        result[name] = (err, bound)
    return result


def gradient_bound(name, ref, base, magnitude, size_S, p_magnitude, where):
    """assert_gradient_rule's bound for a float16 gradient, over the positions ``where``."""
    diff = np.abs(np.asarray(base, np.float64) - ref)[where]
    base_err = float(diff.max(initial=0))
    max_ref = float(np.abs(ref[where]).max(initial=0))
    return (MULT[name] * base_err + 2 * spacing16(max_ref)
            + 2 * float(np.spacing(F32(magnitude))) + EPS32 * size_S * p_magnitude)


def assert_gradient_with_overflow(name, got, ref, base, magnitude, exact, size_S, p_magnitude):
    """A float16 gradient against the float64 ``ref`` with a float32 ``base``, where ref
    may pass float16's range. With ``bound`` the rule's bound over the positions where
    float16(ref) is finite:

        |ref| - bound >= 65520   must be +-inf with ref's sign (any float32 result within
                                 the bound rounds to inf);
        |ref| + bound <  65520   must be finite, and is held to the rule
                                 (backward_checks.assert_gradient_rule);
        in between               either: +-inf with ref's sign, or finite within the rule.

    No NaN anywhere. Returns (error, bound, number of positions that must be inf)."""
    got = to_host(got)
    assert got.dtype == F16, got.dtype
    assert not np.isnan(got).any(), f"{name}: NaN at {np.argwhere(np.isnan(got))[:5].tolist()}"
    with np.errstate(over="ignore"):
        representable = np.isfinite(ref.astype(F16))
    bound = gradient_bound(name, ref, base, magnitude, size_S, p_magnitude, representable)
    must_inf = np.abs(ref) - bound >= F16_OVERFLOW
    may_inf = np.abs(ref) + bound >= F16_OVERFLOW
    inf = np.isinf(got)
    if not np.array_equal(inf & must_inf, must_inf):
        at = np.argwhere(must_inf & ~inf)[0]
        raise AssertionError(f"{name}: finite {got[tuple(at)]!r} at {tuple(at)} where the "
                             f"reference {ref[tuple(at)]!r} is beyond float16's range")
    if (inf & ~may_inf).any():
        at = np.argwhere(inf & ~may_inf)[0]
        raise AssertionError(f"{name}: inf at {tuple(at)} where the reference "
                             f"{ref[tuple(at)]!r} is within float16's range (bound {bound:.6g})")
    wrong_sign = inf & (np.sign(got) != np.sign(ref))
    assert not wrong_sign.any(), f"{name}: inf of the wrong sign at {np.argwhere(wrong_sign)[:5]}"
    # Finite results where |ref| rounds to 65504 or beyond: within the bound.
    top = ~inf & (np.abs(ref) >= F16_MAX - 2.0 ** 4)
    top_err = float(np.abs(got[top].astype(np.float64) - ref[top]).max(initial=0))
    assert top_err <= bound, (f"{name}: |kernel - ref| = {top_err:.6g} > {bound:.6g} where "
                              f"|ref| >= 65488")
    # The rule on the other positions (these set to 0 in all three): assert_gradient_rule
    # takes np.spacing(float16(max|ref|)), inf where max|ref| rounds to 65504.
    keep = ~inf & ~top
    err, rule_bound = assert_gradient_rule(
        name, np.where(keep, got, F16(0)), np.where(keep, ref, 0.0), np.where(keep, base, 0),
        magnitude, exact, size_S, p_magnitude)
    return max(err, top_err), rule_bound, int(must_inf.sum())


def check_backward_float32_rule(dout, q, k, v, out, lse, grads, *, causal=None, scale=None,
                                size_term=True):
    """(dq, dk, dv) against ``reference_backward`` with the float32 baseline
    ``naive_backward`` of the float16 inputs in float32, out and lse as given (module
    docstring); out and lse themselves by backward_checks.check_out_lse first.
    ``size_term``: include the rule's eps32 size_S term. Returns
    {name: (error, bound, positions that must be inf)}."""
    out, lse = to_host(out), to_host(lse)
    kw = dict(causal=causal, scale=scale)
    check_out_lse(q, k, v, out, lse, **kw)
    ref = reference_backward(dout, q, k, v, out, **kw)
    with np.errstate(all="ignore"):
        base = naive_backward(*f32(dout, q, k, v, out), lse, **kw)
    for name, b in zip(GRADS, base):
        assert np.isfinite(b).all(), f"{name}: the float32 baseline is not finite"
    mags = backward_magnitudes(dout, q, k, v, **kw)
    p_mags = p_error_magnitudes(dout, q, k, v, **kw)
    size_S = score_size(q, k, **kw) if size_term else 0.0
    exact = exact_masks(q.shape[-2], k.shape[-2], causal)
    return {name: assert_gradient_with_overflow(name, g, r, b, mags[name], exact[name], size_S,
                                                p_mags[name])
            for name, g, r, b in zip(GRADS, (to_host(x) for x in grads), ref, base)}


# --- runs -------------------------------------------------------------------------------

def runs(q, k, v, version, causal):
    """The forward version that ``version`` (None: the default) runs here."""
    return numbaflash.explain(q, k, v, causal=causal, version=version).version


def forward(q, k, v, version, causal):
    out, lse = numbaflash.attention(q, k, v, causal=causal, version=version, return_lse=True)
    return to_host(out), to_host(lse)


def backward(dout, q, k, v, out, lse, version, causal):
    grads = numbaflash.attention_backward(dout, q, k, v, out, lse, causal=causal,
                                          version=version)
    return tuple(to_host(g) for g in grads)


def scores_beyond_range(q, k, causal, scale=None):
    """Every visible score's size passes 65504 (the case exercises what it claims)."""
    S, mask, _ = reference.scores(q, k, causal, scale)
    assert mask.any() and (np.abs(S[mask]) > F16_MAX).all(), np.abs(S[mask]).min()
    return S, mask


# --- forward: scores beyond float16's range -----------------------------------------------

@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("version", SIMT_FORWARD)
def test_forward_scores_beyond_float16_are_exact_float32_math(version, causal):
    """Exact float32 scores of size ~1.8e5: out is float16's rounding of an accurate float32
    result (for EXP_OF_DIFFERENCE without the size term), lse the float32 one's."""
    q, k, v, _ = beyond_range_scores(1, Sq=9 if causal != "bottom_right" else 11, Sk=7)
    scores_beyond_range(q, k, causal)
    assert exact_scores(q, k, reference.default_scale(q.shape[-1]))
    out, lse = forward(q, k, v, version, causal)
    assert np.isfinite(out).all() and not (np.isnan(lse) | np.isposinf(lse)).any()
    check_forward_float32_rule(q, k, v, out, lse, causal=causal,
                               size_term=runs(q, k, v, version, causal) not in EXP_OF_DIFFERENCE)
    check_forward_float32_rule(q, k, v, out, lse, causal=causal)


@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("version", SIMT_FORWARD)
def test_forward_inexact_scores_beyond_float16(version, causal):
    """Scores of size ~1.2e5 to 2.6e5 that float32 rounds: within the float32 rule."""
    q, k, v, _ = beyond_range_scores(2, Sq=8, Sk=9, exact=False)
    scores_beyond_range(q, k, causal)
    assert not exact_scores(q, k, reference.default_scale(q.shape[-1]))
    out, lse = forward(q, k, v, version, causal)
    check_forward_float32_rule(q, k, v, out, lse, causal=causal)


@pytest.mark.parametrize("exact", [True, False], ids=["exact-scores", "inexact-scores"])
@pytest.mark.parametrize("version", TENSOR_CORE_FORWARD)
def test_tensor_core_forward_scores_beyond_float16(version, exact):
    """The tensor-core versions that take float16 (v10, v7's bits, the float16 default on a GPU), at
    lengths that leave a short last tile on both axes (their tiles are 16 to 64)."""
    causal = "bottom_right" if exact else "top_left"
    q, k, v, _ = beyond_range_scores(3, B=1, H=1, Sq=17, Sk=19, exact=exact)
    scores_beyond_range(q, k, causal)
    out, lse = forward(q, k, v, version, causal)
    check_forward_float32_rule(q, k, v, out, lse, causal=causal,
                               size_term=not (exact and version in EXP_OF_DIFFERENCE))


V7_OVERSHOOT = ("forward v7 rounds each probability to float16 for P V but sums l from the "
                "float32 probabilities, so out = sum(round16(p) v) / sum(p) can exceed max|v| "
                "by up to 2^-11 relative: with every v = 65504 it gives inf "
                "(tests/test_float16_range.py, test_out_of_values_at_the_float16_maximum)")


@pytest.mark.parametrize("version", SIMT_FORWARD + [
    "v3", "v6", pytest.param("v7", marks=pytest.mark.xfail(strict=True, reason=V7_OVERSHOOT)),
    "v8"])
def test_out_of_values_at_the_float16_maximum(version):
    """Every value is +-65504 (column by column): out is a convex combination of them, so
    exactly +-65504 in every row that sees a key, never inf. The probabilities are chosen
    so that float16 rounding of p errs upward by nearly its most (p just above the
    midpoint 0.500244 of two float16 values; key 0 has p = 1): a version that rounds p to
    float16 for P V and not in l overshoots max|v| by ~2^-11."""
    Sq, Sk, d = 17, 31, 4
    target = 0.50025414
    scale = float(-2 * np.log(target))          # scale * q.k = log(target) for q.k = -0.5
    q = np.zeros((1, 1, Sq, d), F16)
    q[..., 0] = 1
    k = np.zeros((1, 1, Sk, d), F16)
    k[..., 1:, 0] = -0.5
    signs = np.array([1, -1, 1, -1])[:d]
    v = np.broadcast_to(signs * F16_MAX, (1, 1, Sk, d)).astype(F16)
    out, lse = numbaflash.attention(q, k, v, scale=scale, causal="top_left", version=version,
                                    return_lse=True)
    out = to_host(out)
    want = np.broadcast_to(signs * F16_MAX, out.shape).astype(F16)
    assert_bitwise_equal("out", out, want)


# --- backward: scores beyond float16's range ----------------------------------------------

@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("version", SIMT_BACKWARD)
def test_backward_scores_beyond_float16(version, causal):
    """Exact float32 scores of size ~1.8e5 (rows of -BIG see key 1 alone: dQ and dS are
    exactly 0 there in the math): finite gradients within the float32 rule, for
    BACKWARD_EXP_OF_DIFFERENCE without its size term."""
    q, k, v, dout = beyond_range_scores(4, Sq=10 if causal == "bottom_right" else 8, Sk=7)
    scores_beyond_range(q, k, causal)
    assert exact_scores(q, k, reference.default_scale(q.shape[-1]))
    out, lse = forward(q, k, v, None, causal)
    grads = backward(dout, q, k, v, out, lse, version, causal)
    assert all(np.isfinite(g).all() for g in grads)
    check_backward_float32_rule(dout, q, k, v, out, lse, grads, causal=causal,
                                size_term=version not in BACKWARD_EXP_OF_DIFFERENCE)
    check_backward_float32_rule(dout, q, k, v, out, lse, grads, causal=causal)


@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("version", SIMT_BACKWARD)
def test_backward_inexact_scores_beyond_float16(version, causal):
    q, k, v, dout = beyond_range_scores(5, Sq=8, Sk=9, exact=False)
    scores_beyond_range(q, k, causal)
    out, lse = forward(q, k, v, None, causal)
    grads = backward(dout, q, k, v, out, lse, version, causal)
    assert all(np.isfinite(g).all() for g in grads)
    check_backward_float32_rule(dout, q, k, v, out, lse, grads, causal=causal)


# --- backward: gradients beyond float16's range --------------------------------------------

@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("version", SIMT_BACKWARD)
def test_gradients_beyond_float16_become_inf_as_a_cast(version, causal):
    """dP = dO . V up to ~1e7: dq, dk and dv pass 65504 in places. There they are +-inf
    with the reference's sign (the cast of a float32 result within the rule); elsewhere
    finite and within the float32 rule; never NaN. out stays finite (|out| <= max|v|)."""
    q, k, v, dout = beyond_range_gradients(6, Sq=9, Sk=8)
    out, lse = forward(q, k, v, None, causal)
    assert np.isfinite(out).all()
    grads = backward(dout, q, k, v, out, lse, version, causal)
    result = check_backward_float32_rule(dout, q, k, v, out, lse, grads, causal=causal)
    # the case exercises what it claims: each gradient has positions that must overflow
    # and finite ones
    for name, g in zip(GRADS, grads):
        assert result[name][2] > 0, f"{name}: no position must overflow"
        assert np.isfinite(g).any(), f"{name}: nothing finite"


@pytest.mark.parametrize("version, case", [("v5", "scores"), ("v6", "scores"),
                                           ("v6", "gradients")])
def test_tensor_core_backward_beyond_float16(version, case):
    """Backward v5 and v6 (3xTF32; v6 the default on a GPU) on float16 inputs: scores
    beyond 65504 (exact in float32), and gradients beyond it; short last tiles both ways."""
    causal = "bottom_right"
    if case == "scores":
        q, k, v, dout = beyond_range_scores(7, B=1, H=1, Sq=17, Sk=19)
        scores_beyond_range(q, k, causal)
    else:
        q, k, v, dout = beyond_range_gradients(8, B=1, H=1, Sq=17, Sk=19)
    out, lse = forward(q, k, v, None, causal)
    grads = backward(dout, q, k, v, out, lse, version, causal)
    result = check_backward_float32_rule(dout, q, k, v, out, lse, grads, causal=causal)
    if case == "gradients":
        assert result["dQ"][2] > 0 and result["dK"][2] > 0


def test_the_overflow_rule_can_fail():
    """assert_gradient_with_overflow rejects a NaN, a finite value where the reference is
    far beyond 65504, an inf of the wrong sign, and an inf where the reference is small."""
    assert np.isinf(F16(F16_OVERFLOW)) and F16(np.nextafter(F16_OVERFLOW, 0)) == F16_MAX
    ref = np.array([[1e6, -1e6, 10.0, 3.0]])
    base = ref.astype(F32)
    good = np.array([[np.inf, -np.inf, 10.0, 3.0]], F16)
    assert assert_gradient_with_overflow("dQ", good, ref, base, 1e6, False, 0.0, 0.0)[2] == 2
    for bad in ([[np.nan, -np.inf, 10, 3]], [[65504, -np.inf, 10, 3]],
                [[-np.inf, -np.inf, 10, 3]], [[np.inf, -np.inf, np.inf, 3]],
                [[np.inf, -np.inf, 10.5, 3]]):
        with pytest.raises(AssertionError):
            assert_gradient_with_overflow("dQ", np.array(bad, F16), ref, base, 1e6, False,
                                          0.0, 0.0)


# --- float16 inf in the backward's inputs ----------------------------------------------------

# name: (Sq, Sk, causal, input, row, value); every visible case first, then the no-effect ones
INF_SCENARIOS = {
    "q+inf": (6, 5, None, "q", 4, np.inf),
    "q-inf-causal": (6, 5, "top_left", "q", 2, -np.inf),
    "k+inf-some-rows": (6, 11, "top_left", "k", 3, np.inf),
    "k-inf-causal": (9, 9, "bottom_right", "k", 6, -np.inf),
    "v+inf": (5, 6, None, "v", 2, np.inf),
    "v-inf-causal": (9, 9, "bottom_right", "v", 6, -np.inf),
    "dout+inf": (6, 5, "top_left", "dout", 1, np.inf),
    "dout-inf": (6, 5, None, "dout", 3, -np.inf),
    "k+inf-padded-key": (6, 11, "top_left", "k", 9, np.inf),
    "v-inf-padded-key": (6, 11, "top_left", "v", 9, -np.inf),
    "q+inf-fully-masked-row": (9, 5, "bottom_right", "q", 2, np.inf),
    "dout-inf-fully-masked-row": (9, 5, "bottom_right", "dout", 2, -np.inf),
}
NO_EFFECT = ("padded-key", "fully-masked-row")


def inf_run(name, version):
    """(clean grads, grads with the inf, inputs with the inf, case) of one scenario: one
    element (component 1) of one row set to +-inf, the default forward rerun on it."""
    Sq, Sk, causal, which, row, value = INF_SCENARIOS[name]
    case = make_case(1, 2, Sq, Sk, 3, "float16", causal, None, None, "uniform", 17, True)
    arrays = {"q": case.q, "k": case.k, "v": case.v, "dout": case.dout}
    dirty = dict(arrays)
    dirty[which] = arrays[which].copy()
    dirty[which][..., row, 1] = value

    def grads(a):
        out, lse = forward(a["q"], a["k"], a["v"], None, causal)
        return backward(a["dout"], a["q"], a["k"], a["v"], out, lse, version, causal)
    return grads(arrays), grads(dirty), dirty, case


def reach(name):
    """(rows, keys): the query rows whose terms the inf enters (every row that sees the key,
    or the row itself if it sees a key), and the keys those rows see."""
    Sq, Sk, causal, which, row, _ = INF_SCENARIOS[name]
    vis = visible(Sq, Sk, causal)
    rows = vis[:, row] if which in ("k", "v") else (np.arange(Sq) == row) & vis.any(axis=1)
    return rows, vis[rows].any(axis=0)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")   # inf * 0
@pytest.mark.parametrize("version", SIMT_BACKWARD)
@pytest.mark.parametrize("name", list(INF_SCENARIOS))
def test_float16_inf_gives_the_reference_nonfinite_positions(name, version):
    """+-inf in a float16 q, k, v or dout: NaN, +inf and -inf exactly where
    numbaflash.reference.backward (float64, sums over visible pairs) has them; dQ rows of
    the rows the inf cannot reach and dK, dV rows of the keys none of them sees are bitwise
    those of the clean run; an inf in a masked or padded key or a fully masked row changes
    no bit anywhere."""
    clean, dirty, arrays, case = inf_run(name, version)
    with np.errstate(all="ignore"):
        ref = reference.backward(arrays["dout"], arrays["q"], arrays["k"], arrays["v"],
                                 causal=case.causal)
    rows, keys = reach(name)
    for gname, g, c, r in zip(GRADS, dirty, clean, ref):
        assert g.dtype == F16
        assert not (np.isnan(c) | np.isinf(c)).any(), f"{gname}: the clean run is not finite"
        assert_same_nonfinite(gname, g.astype(np.float64), r)
        hit = np.broadcast_to((rows if gname == "dQ" else keys)[:, None], g.shape)
        assert_bitwise_equal(gname, np.where(hit, F16(0), g), np.where(hit, F16(0), c))
    reached = any(not np.isfinite(g).all() for g in dirty)
    assert reached != name.endswith(NO_EFFECT), (name, reached)
    if name.endswith(NO_EFFECT):
        assert not rows.any()


@pytest.mark.parametrize("value", [np.inf, -np.inf, np.nan], ids=["+inf", "-inf", "nan"])
@pytest.mark.parametrize("which", ["q", "k", "v", "dout", "out"])
@pytest.mark.parametrize("version", ["v5", "v6"])
def test_tensor_core_backward_refuses_a_float16_inf(version, which, value):
    """Backward v5 and v6 take finite inputs only (kernels/backward/nonfinite.py): a float16
    +-inf, like a NaN, in any input is a ValueError before their kernels run (the check
    compares in float32: float16 cannot hold float32's largest value)."""
    case = make_case(1, 1, 16, 16, 8, "float16", None, None, None, "uniform", 3, True)
    out, lse = forward(case.q, case.k, case.v, None, None)
    args = {"dout": case.dout, "q": case.q, "k": case.k, "v": case.v, "out": out, "lse": lse}
    args[which] = args[which].copy()
    args[which][0, 0, 5, 2] = value
    with pytest.raises(ValueError, match=rf"backward {version} cannot run this input: the "
                                         r"inputs hold NaN or inf"):
        numbaflash.attention_backward(*(args[n] for n in ("dout", "q", "k", "v", "out", "lse")),
                                      version=version)
