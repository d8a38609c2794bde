"""L0: the backward oracles checked themselves, for every variant they accept. NumPy only.

tests/backward_checks.py holds the two things every backward kernel is held to:
``reference_backward`` (the float64 gradients, D taken from the out it is given) and
``naive_backward`` (Algorithm 2's formulas, dense, in the inputs' dtype, P from the lse
it is given). Both take the variant keyword arguments of ``numbaflash.attention``: GQA
(k and v with fewer heads), window_size, softcap, alibi_slopes, boolean and additive
attn_mask, score_mod with score_mod_grad, and mask_mod, with causal in either alignment.
If either oracle were wrong for a variant, the kernels would be held to a wrong answer.

Here, in float64 and for every variant alone and in combination:
  1. reference_backward, and naive_backward given float64 inputs (where it computes the
     same gradients from the exact lse), agree with the central finite differences of
     the float64 forward reference, f(q, k, v) = sum(dO * O(q, k, v)): the directional
     check of TESTING.md's L0 row, relative error < 1e-7 (``FD_RTOL``; the estimator and
     its error budget are those of tests/test_backward_reference.py, which checks
     reference.backward this way for plain and causal attention only);
  2. both agree with numbaflash.reference.backward to 1e-13 of the gradient's magnitude
     (``backward_checks.backward_magnitudes``);
  3. rows that see no key (causal with Sq > Sk, a window, an all-False mask row, a row of
     -inf biases, a mask_mod) get a dQ row of exact zeros, and keys that no query of any
     head of their group sees get exact zero dK and dV rows (array_equal), in all three.

The masks do not depend on the values, so f is smooth in q, k and v everywhere, fully
masked rows included (they contribute a constant 0); a -inf bias is a weight of exactly
0 whatever the values. Inputs are drawn in [-1.5, 1.5] (not strategies.py's [-4, 4]): the
non-linear score_mod below (s - s^3 / 30) has a first derivative of about s^2 / 10, and
at the scores of [-4, 4] inputs (|s| up to ~60 at d = 16) the fourth-order difference's
truncation error, ~ h^4 |f^(5)| with f^(5) growing like that derivative to the fifth,
would exceed the tolerance; at [-1.5, 1.5] and d <= 8 it is < 1e-12.

``test_the_check_catches_*`` show that the check can fail: the gradients a plausible bug
gives (softcap's tanh' factor dropped, dK and dV of one query head instead of the group
sum, score_mod's derivative taken as 1, D from an out off by 1e-6) are rejected.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from numbaflash import reference
from backward_checks import (GRADS, backward_magnitudes, exact_masks, naive_backward,
                             reference_backward)
from strategies import examples
from tolerance import assert_close_f64

FD_RTOL = 1e-7          # TESTING.md, L0: directional check, relative error < 1e-7
FD_ROUNDING = 1e-11     # the rounding of f itself, relative to sum |dO * O| (see above)
FD_STEP = 1e-3
ORACLE_RTOL = 1e-13     # the three float64 backward formulas, relative to the magnitude
LOW, HIGH = -1.5, 1.5


# --- score and mask modifiers: plain Python (the float64 reference calls them per element,
# as it calls a Numba device function's py_func); the same forms as tests/test_variants.py

def relative_bias(score, b, h, q_idx, kv_idx):
    """A relative-position bias by head: linear in the score, derivative 1."""
    return score - 0.25 * (h + 1) * abs(q_idx - kv_idx)


def relative_bias_grad(score, b, h, q_idx, kv_idx):
    return 1.0


def squash(score, b, h, q_idx, kv_idx):
    """Non-linear, with a derivative that is not 1: s -> s - s^3 / 30."""
    return score - score * score * score / 30.0


def squash_grad(score, b, h, q_idx, kv_idx):
    return 1.0 - score * score / 10.0


def by_position(score, b, h, q_idx, kv_idx):
    """Non-linear and position dependent: s -> s (1 + 0.1 (b + h)) + 0.05 s^2 (q_idx - kv_idx)."""
    return score * (1.0 + 0.1 * (b + h)) + 0.05 * score * score * (q_idx - kv_idx)


def by_position_grad(score, b, h, q_idx, kv_idx):
    return 1.0 + 0.1 * (b + h) + 0.1 * score * (q_idx - kv_idx)


def documents(b, h, q_idx, kv_idx):
    """A document mask: blocks of 3 positions, each sees its own block."""
    return q_idx // 3 == kv_idx // 3


def every_third_key(b, h, q_idx, kv_idx):
    """Depends on the batch: batch b hides keys kv_idx = b (mod 3)."""
    return kv_idx % 3 != b


def head_and_row(b, h, q_idx, kv_idx):
    """Head 0 hides every key from query row 1 (a fully masked row in one head only)."""
    return not (h == 0 and q_idx == 1)


SCORE_MODS = {"relative": (relative_bias, relative_bias_grad), "squash": (squash, squash_grad),
              "by_position": (by_position, by_position_grad)}
MASK_MODS = {"documents": documents, "every_third_key": every_third_key,
             "head_and_row": head_and_row}


# --- cases ------------------------------------------------------------------------------

class Case:
    """float64 dout, q, k, v (k and v with Hkv heads), the causal mode, scale and variant
    keyword arguments; ``repr`` says how to rebuild it."""

    def __init__(self, B, H, Hkv, Sq, Sk, d, causal=None, scale=None, seed=0, **variants):
        rng = np.random.default_rng(seed)
        self.shape = (B, H, Hkv, Sq, Sk, d)
        self.q = rng.uniform(LOW, HIGH, (B, H, Sq, d))
        self.k = rng.uniform(LOW, HIGH, (B, Hkv, Sk, d))
        self.v = rng.uniform(LOW, HIGH, (B, Hkv, Sk, d))
        self.dout = rng.uniform(LOW, HIGH, (B, H, Sq, d))
        self.rng = np.random.default_rng([seed, 1])
        self.causal, self.scale, self.seed = causal, scale, seed
        self.variants = {name: value for name, value in variants.items() if value is not None}

    @property
    def kw(self):
        return dict(causal=self.causal, scale=self.scale, **self.variants)

    def __repr__(self):
        shown = {n: (f"array{np.shape(x)}" if isinstance(x, np.ndarray) else
                     getattr(x, "__name__", x)) for n, x in self.variants.items()}
        return (f"Case(B, H, Hkv, Sq, Sk, d = {self.shape}, causal={self.causal!r}, "
                f"scale={self.scale!r}, seed={self.seed}, {shown})")


def bool_mask(rng, shape, p=0.7, empty_row=None, empty_key=None):
    """A random boolean attn_mask of ``shape`` (broadcastable to (B, H, Sq, Sk)), True with
    probability p, with an all-False query row and/or key column if asked."""
    m = rng.random(shape) < p
    if empty_row is not None:
        m[..., empty_row, :] = False
    if empty_key is not None:
        m[..., empty_key] = False
    return m


def bias(rng, shape, p_inf=0.2, inf_row=None):
    """A random float attn_mask (bias) in [-2, 2] with -inf entries (weight 0), and a row of
    -inf biases (a row that sees no key) if asked."""
    m = rng.uniform(-2, 2, shape)
    m[rng.random(shape) < p_inf] = -np.inf
    if inf_row is not None:
        m[..., inf_row, :] = -np.inf
    return m


def named_case(name, seed):
    """The case ``name`` of CASES with ``seed``."""
    make = CASES[name]
    return make(np.random.default_rng([seed, 7]), seed)


# name -> (rng, seed) -> Case. Every variant alone, then in combination; the shapes give
# fully masked rows (Sq > Sk with bottom_right causal or a window, empty mask rows) and
# keys no query sees (top_left causal with Sk > Sq, empty mask columns) where they can.
CASES = {
    "plain": lambda r, s: Case(2, 2, 2, 5, 7, 4, seed=s),
    "plain-scale-0.3-d1": lambda r, s: Case(1, 2, 2, 6, 5, 1, scale=0.3, seed=s),
    "plain-Sq1-Sk1": lambda r, s: Case(1, 1, 1, 1, 1, 3, seed=s),
    "causal-bottom_right-Sq>Sk": lambda r, s: Case(1, 2, 2, 8, 5, 4, "bottom_right", seed=s),
    "causal-bottom_right-Sq<Sk": lambda r, s: Case(2, 1, 1, 4, 9, 3, "bottom_right", seed=s),
    "causal-top_left-Sq>Sk": lambda r, s: Case(1, 2, 2, 8, 5, 4, "top_left", seed=s),
    "causal-top_left-Sq<Sk": lambda r, s: Case(1, 2, 2, 4, 9, 5, "top_left", seed=s),
    "gqa-group2": lambda r, s: Case(2, 4, 2, 5, 6, 4, seed=s),
    "gqa-group3-bottom_right": lambda r, s: Case(1, 6, 2, 7, 5, 3, "bottom_right", seed=s),
    "gqa-group5-top_left": lambda r, s: Case(1, 10, 2, 4, 7, 2, "top_left", seed=s),
    "gqa-group8": lambda r, s: Case(1, 16, 2, 3, 4, 3, seed=s),
    "gqa-group4-3kv": lambda r, s: Case(1, 12, 3, 4, 5, 2, "bottom_right", seed=s),
    "mqa-group4": lambda r, s: Case(2, 4, 1, 5, 4, 3, seed=s),
    "window-(2,1)": lambda r, s: Case(1, 2, 2, 9, 9, 4, window_size=(2, 1), seed=s),
    "window-(0,0)-Sq>Sk": lambda r, s: Case(1, 2, 2, 8, 5, 3, window_size=(0, 0), seed=s),
    "window-(-1,2)-top_left": lambda r, s: Case(1, 2, 2, 6, 9, 4, "top_left",
                                                window_size=(-1, 2), seed=s),
    "window-(3,-1)-gqa": lambda r, s: Case(1, 4, 2, 7, 7, 3, window_size=(3, -1), seed=s),
    "window-(1,0)-bottom_right-Sq<Sk": lambda r, s: Case(1, 1, 1, 4, 8, 4, "bottom_right",
                                                         window_size=(1, 0), seed=s),
    "softcap-0.5": lambda r, s: Case(1, 2, 2, 5, 6, 4, softcap=0.5, seed=s),
    "softcap-2": lambda r, s: Case(2, 2, 1, 6, 5, 8, "bottom_right", softcap=2.0, seed=s),
    "softcap-30": lambda r, s: Case(1, 2, 2, 5, 7, 4, "top_left", softcap=30.0, seed=s),
    "alibi-heads": lambda r, s: Case(1, 3, 3, 6, 7, 4, alibi_slopes=r.uniform(0.05, 1, 3),
                                     seed=s),
    "alibi-batch-heads-gqa": lambda r, s: Case(2, 4, 2, 7, 5, 3, "bottom_right",
                                               alibi_slopes=r.uniform(0.05, 1, (2, 4)), seed=s),
    "bool-mask-(Sq,Sk)": lambda r, s: Case(1, 2, 2, 6, 7, 4,
                                           attn_mask=bool_mask(r, (6, 7), empty_row=2,
                                                               empty_key=4), seed=s),
    "bool-mask-(B,1,Sq,Sk)-causal": lambda r, s: Case(2, 2, 2, 6, 6, 3, "top_left",
                                                      attn_mask=bool_mask(r, (2, 1, 6, 6),
                                                                          empty_row=5),
                                                      seed=s),
    "bool-mask-(H,1,Sk)-gqa": lambda r, s: Case(1, 4, 2, 5, 6, 3,
                                                attn_mask=bool_mask(r, (4, 1, 6), p=0.6,
                                                                    empty_key=0), seed=s),
    "bias-(Sq,Sk)": lambda r, s: Case(1, 2, 2, 6, 7, 4, attn_mask=bias(r, (6, 7), inf_row=3),
                                      seed=s),
    "bias-(B,H,Sq,Sk)-bottom_right": lambda r, s: Case(2, 2, 1, 7, 5, 3, "bottom_right",
                                                       attn_mask=bias(r, (2, 2, 7, 5)), seed=s),
    "bias-(1,Sk)-no-inf": lambda r, s: Case(1, 2, 2, 5, 6, 4,
                                            attn_mask=bias(r, (1, 6), p_inf=0), seed=s),
    "score_mod-relative": lambda r, s: Case(1, 2, 2, 6, 6, 4, score_mod=relative_bias,
                                            score_mod_grad=relative_bias_grad, seed=s),
    "score_mod-squash": lambda r, s: Case(1, 2, 2, 6, 5, 4, "bottom_right", score_mod=squash,
                                          score_mod_grad=squash_grad, seed=s),
    "score_mod-by_position-gqa": lambda r, s: Case(2, 4, 2, 5, 6, 3, score_mod=by_position,
                                                   score_mod_grad=by_position_grad, seed=s),
    "mask_mod-documents": lambda r, s: Case(1, 2, 2, 7, 8, 4, mask_mod=documents, seed=s),
    "mask_mod-every_third_key": lambda r, s: Case(3, 1, 1, 5, 6, 3, mask_mod=every_third_key,
                                                  seed=s),
    "mask_mod-head_and_row-gqa": lambda r, s: Case(1, 4, 2, 5, 5, 3, "top_left",
                                                   mask_mod=head_and_row, seed=s),
    "everything-bool": lambda r, s: Case(
        2, 6, 2, 7, 6, 4, "bottom_right", window_size=(3, 1), softcap=2.0,
        alibi_slopes=r.uniform(0.05, 1, (2, 6)), attn_mask=bool_mask(r, (2, 1, 7, 6), 0.8),
        score_mod=squash, score_mod_grad=squash_grad, mask_mod=every_third_key, seed=s),
    "everything-bias": lambda r, s: Case(
        1, 8, 2, 6, 7, 3, "top_left", window_size=(-1, 2), softcap=0.5,
        alibi_slopes=r.uniform(0.05, 1, 8), attn_mask=bias(r, (8, 6, 7), inf_row=1),
        score_mod=relative_bias, score_mod_grad=relative_bias_grad, mask_mod=documents,
        seed=s),
}
SEEDS = (0, 1)


# --- the checks -------------------------------------------------------------------------

def loss(case, q, k, v):
    """f(q, k, v) = sum(dO * O(q, k, v)), O the float64 forward reference with the case's
    variants; its gradient is (dQ, dK, dV)."""
    O, _ = reference.forward(q, k, v, **case.kw)
    return float(np.sum(case.dout * O))


def directional_fd(case, uq, uk, uv, h=FD_STEP):
    """Fourth-order central difference of ``loss`` along (uq, uk, uv)."""
    def f(t):
        return loss(case, case.q + t * uq, case.k + t * uk, case.v + t * uv)
    return (-f(2 * h) + 8 * f(h) - 8 * f(-h) + f(-2 * h)) / (12 * h)


def fd_mismatches(case, grads):
    """The directions along which ``grads`` = (dQ, dK, dV) disagree with the finite
    difference by more than FD_RTOL * sum |g u| + FD_ROUNDING * sum |dO * O|: each
    argument alone (so that one wrong gradient cannot hide behind another), then all
    three. Returns a list of messages, empty if they agree."""
    shapes = (case.q.shape, case.k.shape, case.v.shape)
    full = [case.rng.standard_normal(s) for s in shapes]
    zero = [np.zeros(s) for s in shapes]
    directions = {name: [full[i] if j == i else zero[j] for j in range(3)]
                  for i, name in enumerate(GRADS)}
    directions["all"] = full
    O, _ = reference.forward(case.q, case.k, case.v, **case.kw)
    f_size = float(np.sum(np.abs(case.dout * O)))
    bad = []
    for name, u in directions.items():
        analytic = sum(float(np.sum(g * ui)) for g, ui in zip(grads, u))
        size = sum(float(np.sum(np.abs(g * ui))) for g, ui in zip(grads, u))
        numeric = directional_fd(case, *u)
        if not abs(numeric - analytic) <= FD_RTOL * size + FD_ROUNDING * f_size:
            bad.append(f"direction {name}: finite difference {numeric!r} vs analytic "
                       f"{analytic!r} (|difference| {abs(numeric - analytic):.3g}, "
                       f"sum |g u| = {size:.3g})")
    return bad


def oracles(case):
    """``{name: (dQ, dK, dV)}`` of the three float64 backward formulas on the case."""
    out, lse = reference.forward(case.q, case.k, case.v, **case.kw)
    return {
        "reference_backward": reference_backward(case.dout, case.q, case.k, case.v, out,
                                                 **case.kw),
        "naive_backward": naive_backward(case.dout, case.q, case.k, case.v, out, lse,
                                         **case.kw),
        "reference.backward": reference.backward(case.dout, case.q, case.k, case.v,
                                                 **case.kw),
    }


def check_oracles(case):
    """Checks 1 to 3 of the module docstring on one case."""
    results = oracles(case)
    for name, grads in results.items():
        for gname, g, x in zip(GRADS, grads, (case.q, case.k, case.v)):
            assert g.shape == x.shape and g.dtype == np.float64, (name, gname, g.shape, g.dtype)
            assert np.isfinite(g).all(), f"{name} {gname}: not finite ({case})"
    # 1. finite differences (reference.backward's own check is in test_backward_reference.py
    # for plain attention; here it is checked with the variants too)
    for name, grads in results.items():
        bad = fd_mismatches(case, grads)
        assert not bad, f"{name} on {case}: " + "; ".join(bad)
    # 2. the three agree
    mags = backward_magnitudes(case.dout, case.q, case.k, case.v, **case.kw)
    want = results["reference.backward"]
    for name in ("reference_backward", "naive_backward"):
        for gname, g, w in zip(GRADS, results[name], want):
            assert_close_f64(f"{name} {gname} vs reference.backward ({case})", g, w,
                             ORACLE_RTOL, mags[gname])
    # 3. exact zeros
    _, mask, _ = reference.scores(case.q, case.k, **case.kw)
    exact = exact_masks(case.q.shape[-2], case.k.shape[-2], case.causal, mask, case.k.shape)
    for name, grads in results.items():
        for gname, g in zip(GRADS, grads):
            where = np.broadcast_to(exact[gname], g.shape)
            assert np.array_equal(g[where], np.zeros(int(where.sum()))), \
                f"{name} {gname}: not exactly 0 where no pair is visible ({case})"
    return exact


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", list(CASES))
def test_oracles_match_finite_differences_and_each_other(name, seed):
    check_oracles(named_case(name, seed))


def test_the_cases_exercise_what_they_claim():
    """The named cases hold the things their names say: fully masked rows and unseen keys
    where claimed, -inf biases, GQA groups of 2 to 8 with two or three K/V heads."""
    def exact(name):
        case = named_case(name, 0)
        _, mask, _ = reference.scores(case.q, case.k, **case.kw)
        return case, exact_masks(case.q.shape[-2], case.k.shape[-2], case.causal, mask,
                                 case.k.shape)
    for name in ("causal-bottom_right-Sq>Sk", "window-(0,0)-Sq>Sk", "bool-mask-(Sq,Sk)",
                 "bool-mask-(B,1,Sq,Sk)-causal", "bias-(Sq,Sk)", "mask_mod-head_and_row-gqa",
                 "everything-bias"):
        case, ex = exact(name)
        if name.startswith("bias") or name == "everything-bias":
            # a row of -inf biases is visible (a score, not a mask) yet has weight 0
            lse = reference.forward(case.q, case.k, case.v, **case.kw)[1]
            assert np.isneginf(lse).any(), name
        else:
            assert ex["dQ"].any(), name
    for name in ("causal-top_left-Sq<Sk", "bool-mask-(Sq,Sk)", "bool-mask-(H,1,Sk)-gqa"):
        assert exact(name)[1]["dK"].any(), name
    groups = {named_case(n, 0).shape[1] // named_case(n, 0).shape[2]
              for n in CASES if n.startswith("gqa")}
    assert {2, 3, 4, 5, 8} <= groups
    assert all(named_case(n, 0).shape[2] >= 2 for n in CASES if n.startswith("gqa"))
    assert np.isneginf(named_case("bias-(B,H,Sq,Sk)-bottom_right", 0).variants["attn_mask"]).any()


def test_a_row_of_minus_inf_biases_has_zero_gradients():
    """A row that is visible but whose every score is -inf has P = 0 and lse = -inf: its dQ
    is exactly 0 in the three oracles, and its dO changes no bit of dK and dV."""
    case = named_case("bias-(Sq,Sk)", 0)
    row = 3
    assert np.isneginf(case.variants["attn_mask"][row]).all()
    before = oracles(case)
    case.dout = case.dout.copy()
    case.dout[..., row, :] = 1e3
    after = oracles(case)
    for name in before:
        dQ = after[name][0]
        assert np.array_equal(dQ[..., row, :], np.zeros_like(dQ[..., row, :])), name
        for gname, b, a in zip(GRADS[1:], before[name][1:], after[name][1:]):
            assert np.array_equal(a, b), (name, gname)


@pytest.mark.parametrize("Sq, Sk", [(0, 3), (3, 0), (0, 0)])
def test_empty_sequences(Sq, Sk):
    """No visible pair: every oracle gives zeros (or empty arrays) of the inputs' shapes."""
    case = Case(1, 4, 2, Sq, Sk, 3, "bottom_right", window_size=(1, 1), seed=0)
    for name, grads in oracles(case).items():
        for gname, g, x in zip(GRADS, grads, (case.q, case.k, case.v)):
            assert g.shape == x.shape, (name, gname, g.shape)
            assert np.array_equal(g, np.zeros_like(x)), (name, gname)


# --- random combinations ------------------------------------------------------------------

@st.composite
def oracle_cases(draw):
    """A Case with dimensions and every variant drawn (each one on or off)."""
    Hkv = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 2, 3, 4, 5, 8]))
    B = draw(st.integers(1, 2))
    Sq = draw(st.integers(1, 8))
    Sk = draw(st.integers(1, 8))
    d = draw(st.sampled_from([4, 1, 2, 3, 8]))
    H = Hkv * group
    causal = draw(st.sampled_from([None, "bottom_right", "top_left"]))
    scale = draw(st.sampled_from([None, 0.5, 0.3]))
    seed = draw(st.integers(0, 2 ** 32 - 1))
    rng = np.random.default_rng([seed, 7])
    kw = {}
    if draw(st.booleans()):
        kw["window_size"] = (draw(st.sampled_from([-1, 0, 1, 3])),
                             draw(st.sampled_from([-1, 0, 1, 3])))
    if draw(st.booleans()):
        kw["softcap"] = draw(st.sampled_from([0.5, 2.0, 30.0]))
    if draw(st.booleans()):
        kw["alibi_slopes"] = rng.uniform(0.05, 1.0, (B, H) if draw(st.booleans()) else (H,))
    mask_kind = draw(st.sampled_from([None, "bool", "bias"]))
    if mask_kind is not None:
        full = (B, H, Sq, Sk)
        rank = draw(st.integers(2, 4))
        shape = tuple(n if draw(st.booleans()) else 1 for n in full[4 - rank:])
        kw["attn_mask"] = (bool_mask(rng, shape) if mask_kind == "bool" else
                           bias(rng, shape, p_inf=draw(st.sampled_from([0, 0.2]))))
    if draw(st.booleans()):
        # squash turns a -inf score (a -inf bias) into NaN, by design (docs/variants.md):
        # drawn only where there is none
        neg_inf = mask_kind == "bias" and np.isneginf(kw["attn_mask"]).any()
        mod = "relative" if neg_inf else draw(st.sampled_from(sorted(SCORE_MODS)))
        kw["score_mod"], kw["score_mod_grad"] = SCORE_MODS[mod]
    if draw(st.booleans()):
        kw["mask_mod"] = MASK_MODS[draw(st.sampled_from(sorted(MASK_MODS)))]
    return Case(B, H, Hkv, Sq, Sk, d, causal, scale, seed, **kw)


@settings(max_examples=examples(5))       # NumPy only: five times a kernel test's count
@given(case=oracle_cases())
def test_oracles_on_random_variant_combinations(case):
    check_oracles(case)


# --- the check can fail -------------------------------------------------------------------

def reference_without(case, **override):
    """reference_backward on the case with some variant arguments replaced."""
    out, _ = reference.forward(case.q, case.k, case.v, **case.kw)
    kw = dict(case.kw, **override)
    return reference_backward(case.dout, case.q, case.k, case.v, out, **kw)


def test_the_check_catches_softcap_without_its_derivative(monkeypatch):
    """reference_backward with G = 1 (softcap's 1 - tanh^2 forgotten) fails the check."""
    case = named_case("softcap-2", 0)
    assert not fd_mismatches(case, reference_without(case))
    real = reference.scores

    def scores_without_G(*args, **kwargs):
        S, mask, G = real(*args, **kwargs)
        return S, mask, np.ones_like(G)

    monkeypatch.setattr(reference, "scores", scores_without_G)
    wrong = reference_without(case)
    monkeypatch.undo()
    bad = fd_mismatches(case, wrong)
    assert any(m.startswith("direction dQ") for m in bad) and \
        any(m.startswith("direction dK") for m in bad), bad


def test_the_check_catches_gqa_without_the_group_sum():
    """dK and dV of the first query head of each group, not the group's sum, fail."""
    case = named_case("gqa-group3-bottom_right", 0)
    dQ, dK, dV = reference_without(case)
    _, Hq, Hkv = case.shape[:3]
    g = Hq // Hkv
    full = reference.backward(case.dout, case.q, reference.expand_kv(case.q, case.k),
                              reference.expand_kv(case.q, case.v), causal=case.causal)
    first_dK, first_dV = full[1][:, ::g], full[2][:, ::g]
    assert first_dK.shape == dK.shape
    bad = fd_mismatches(case, (dQ, first_dK, first_dV))
    assert any(m.startswith("direction dK") for m in bad) and \
        any(m.startswith("direction dV") for m in bad), bad
    assert not any(m.startswith("direction dQ") for m in bad), bad


def test_the_check_catches_a_wrong_score_mod_derivative():
    """squash's backward with its derivative taken as 1 fails; the right one passes."""
    case = named_case("score_mod-squash", 0)
    assert not fd_mismatches(case, reference_without(case))
    wrong = reference_without(case, score_mod_grad=relative_bias_grad)
    bad = fd_mismatches(case, wrong)
    assert any(m.startswith("direction dQ") for m in bad), bad


def test_the_check_catches_D_from_a_slightly_wrong_out():
    """reference_backward takes D = rowsum(dO * out) from the out it is given: an out off
    by 1e-6 (relative) gives dQ and dK that the check rejects."""
    case = named_case("plain", 0)
    out, _ = reference.forward(case.q, case.k, case.v, **case.kw)
    wrong = reference_backward(case.dout, case.q, case.k, case.v, out * (1 + 1e-6), **case.kw)
    bad = fd_mismatches(case, wrong)
    assert any(m.startswith("direction dQ") for m in bad), bad
