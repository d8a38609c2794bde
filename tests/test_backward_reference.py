"""L0: the dense reference's backward (reference.backward) against finite differences and
the identities of TESTING.md, in float64. NumPy only.

Finite differences: for a random direction u = (uq, uk, uv), the directional derivative of
f(q, k, v) = sum(dO * O(q, k, v)) along u is <dQ, uq> + <dK, uk> + <dV, uv>. It is
estimated with the fourth-order central difference

    f'(0) ~ (-f(2h) + 8 f(h) - 8 f(-h) + f(-2h)) / (12 h),   h = 1e-3,

whose truncation error (h^4 ~ 1e-12) and rounding error (1.5 eps |f| / h ~ 3e-13 |f|)
both stay far below the tolerance: 1e-7 relative to sum |gradient * u| (the size the
directional derivative's terms have before they cancel), plus 1e-11 * sum |dO * O| for the
rounding of f itself (it matters only where the gradient is exactly 0, e.g. dQ with one
key). The mask does not depend on the values, so f is smooth, fully masked rows included
(they contribute a constant 0).
"""

import numpy as np
import pytest
from hypothesis import given, settings

from numbaflash import reference
from numbaflash.masks import visible
from backward_checks import GRADS, backward_magnitudes
from strategies import attention_cases, examples, make_case
from tolerance import assert_close_f64

F64 = ("float64",)
MANY = examples(5)      # NumPy only: five times a kernel test's count
FD_RTOL = 1e-7
FD_ROUNDING = 1e-11
RTOL = 1e-13


def loss(case, q, k, v):
    O, _ = reference.forward(q, k, v, causal=case.causal, scale=case.scale)
    return float(np.sum(case.dout * O))


def directional_fd(case, uq, uk, uv, h=1e-3):
    """Fourth-order central difference of ``loss`` along (uq, uk, uv)."""
    def f(t):
        return loss(case, case.q + t * uq, case.k + t * uk, case.v + t * uv)
    return (-f(2 * h) + 8 * f(h) - 8 * f(-h) + f(-2 * h)) / (12 * h)


@settings(max_examples=MANY)
@given(case=attention_cases(dtypes=F64, tiles=None, with_dout=True, max_seqlen=12))
def test_reference_backward_matches_finite_differences(case):
    grads = reference.backward(case.dout, case.q, case.k, case.v, causal=case.causal,
                               scale=case.scale)
    rng = case.rng
    shapes = (case.q.shape, case.k.shape, case.v.shape)
    full = [rng.standard_normal(s) for s in shapes]
    zero = [np.zeros(s) for s in shapes]
    # Each argument alone (so that one wrong gradient cannot hide behind another), then all.
    directions = {name: [full[i] if j == i else zero[j] for j in range(3)]
                  for i, name in enumerate(GRADS)}
    directions["all"] = full
    O, _ = reference.forward(case.q, case.k, case.v, causal=case.causal, scale=case.scale)
    f_size = float(np.sum(np.abs(case.dout * O)))
    for name, u in directions.items():
        analytic = sum(float(np.sum(g * ui)) for g, ui in zip(grads, u))
        size = sum(float(np.sum(np.abs(g * ui))) for g, ui in zip(grads, u))
        numeric = directional_fd(case, *u)
        assert abs(numeric - analytic) <= FD_RTOL * size + FD_ROUNDING * f_size, (
            f"direction {name}: finite difference {numeric!r} vs analytic {analytic!r} "
            f"(|difference| {abs(numeric - analytic):.3g}, sum |g u| = {size:.3g})")


def test_finite_difference_check_catches_a_wrong_gradient():
    """The check above can fail: a dK off by 1% (a plausible bug) is caught."""
    case = make_case(1, 1, 5, 7, 3, "float64", causal="bottom_right", with_dout=True, seed=3)
    dQ, dK, dV = reference.backward(case.dout, case.q, case.k, case.v, causal=case.causal)
    u = case.rng.standard_normal(case.k.shape)
    zero_q, zero_v = np.zeros(case.q.shape), np.zeros(case.v.shape)
    numeric = directional_fd(case, zero_q, u, zero_v)
    size = float(np.sum(np.abs(dK * u)))
    assert abs(numeric - float(np.sum(dK * u))) <= FD_RTOL * size
    assert abs(numeric - float(np.sum(1.01 * dK * u))) > FD_RTOL * size


# --- identities (TESTING.md, "Properties worth testing") -----------------------------

def grads_of(case, q=None, k=None, v=None, dout=None):
    return reference.backward(case.dout if dout is None else dout,
                              case.q if q is None else q, case.k if k is None else k,
                              case.v if v is None else v, causal=case.causal, scale=case.scale)


@settings(max_examples=MANY)
@given(case=attention_cases(dtypes=F64, tiles=None, with_dout=True, min_seqlen=0))
def test_dK_sums_to_zero_over_keys(case):
    """sum_c dK[c] = scale * sum_r (sum_c dS[r, c]) Q[r] and every row of dS sums to 0
    (rowsum(P * dP) = D and rowsum(P) is 1, or 0 for a fully masked row)."""
    _, dK, _ = grads_of(case)
    mag = backward_magnitudes(case.dout, case.q, case.k, case.v, causal=case.causal,
                              scale=case.scale)["dK"]
    total = dK.sum(axis=-2)                                   # (B, H, d)
    assert np.all(np.abs(total) <= RTOL * max(case.Sk, 1) * mag), np.abs(total).max()


@settings(max_examples=MANY)
@given(case=attention_cases(dtypes=F64, tiles=None, with_dout=True))
def test_dV_sums_to_dO_sum_when_every_row_sees_a_key(case):
    """sum_c dV[c] = sum_c sum_r P[r, c] dO[r] = sum_r dO[r] when every row of P sums to 1;
    a fully masked row's dO goes nowhere."""
    _, _, dV = grads_of(case)
    sees = visible(case.Sq, case.Sk, case.causal).any(axis=1)           # (Sq,)
    want = (case.dout * sees[:, None]).sum(axis=-2)
    mag = float(np.abs(case.dout).sum(axis=-2).max())
    assert_close_f64("sum of dV", dV.sum(axis=-2), want, RTOL, mag)


@settings(max_examples=MANY)
@given(case=attention_cases(dtypes=F64, tiles=None, with_dout=True))
def test_D_is_rowsum_dO_O_and_rowsum_P_dP(case):
    O, _ = reference.forward(case.q, case.k, case.v, causal=case.causal, scale=case.scale)
    P = reference.probabilities(case.q, case.k, causal=case.causal, scale=case.scale)
    dP = case.dout @ np.swapaxes(case.v, -1, -2)
    D1 = np.sum(case.dout * O, axis=-1)
    D2 = np.sum(P * dP, axis=-1)
    mag = float((P @ np.abs(case.v) * np.abs(case.dout)).sum(axis=-1).max())
    assert_close_f64("rowsum(P * dP)", D2, D1, RTOL, mag)


@settings(max_examples=MANY)
@given(case=attention_cases(dtypes=F64, tiles=None, with_dout=True))
def test_gradients_invariant_under_key_shift(case):
    """K -> K + 1 u^T adds scale * q_r . u to every logit of row r: P is unchanged, so are
    dK and dV; dQ gains scale * rowsum(dS) u^T = 0."""
    u = case.rng.standard_normal(case.d)
    shifted = grads_of(case, k=case.k + u)
    mags = backward_magnitudes(case.dout, case.q, case.k, case.v, causal=case.causal,
                               scale=case.scale)
    for name, g, s in zip(GRADS, grads_of(case), shifted):
        # the shift changes the size of K and of the logits, so allow their growth
        growth = 1 + float(np.abs(u).max()) / max(float(np.abs(case.k).max()), 1e-300)
        assert_close_f64(name, s, g, 1e-12, mags[name] * growth)


def test_fully_masked_rows_give_zero_dQ_and_nothing_else():
    """Causal bottom_right with Sq > Sk: the first Sq - Sk rows see no key."""
    case = make_case(1, 2, 9, 4, 3, "float64", causal="bottom_right", with_dout=True, seed=5)
    dQ, dK, dV = grads_of(case)
    assert np.array_equal(dQ[..., :5, :], np.zeros_like(dQ[..., :5, :]))
    assert np.isfinite(dQ).all() and np.isfinite(dK).all() and np.isfinite(dV).all()
    # The masked rows' dout does not matter.
    dout = case.dout.copy()
    dout[..., :5, :] = 7.0
    for g, h in zip(grads_of(case), grads_of(case, dout=dout)):
        assert np.array_equal(g, h)


@pytest.mark.parametrize("Sq, Sk", [(0, 3), (3, 0), (0, 0)])
def test_empty_sequences(Sq, Sk):
    case = make_case(1, 1, Sq, Sk, 2, "float64", with_dout=True)
    dQ, dK, dV = grads_of(case)
    assert dQ.shape == case.q.shape and dK.shape == case.k.shape and dV.shape == case.v.shape
    for g in (dQ, dK, dV):
        assert np.array_equal(g, np.zeros_like(g))
