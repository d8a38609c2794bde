"""L0: the dense float64 reference (numbaflash/reference.py) and the online softmax.

The reference is the oracle for everything else, so it is checked against an independent
formula written with Python loops and math.exp/math.fsum, against hand-written causal masks,
and against the identities of TESTING.md ("Properties worth testing"), in float64 to ~1e-13.
Every metamorphic comparison compares two different computations on a non-empty set (a
permutation that moves something, non-empty parts of a split, a suffix shorter than the
whole, rows that see keys and are blind to the changed ones); each docstring says which
problems that leaves out. (Backward reference tests live in test_backward_reference.py.)
"""

import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from numbaflash import reference
from numbaflash.masks import causal_offset, parse_causal, visible, visible_band
from numbaflash.online_softmax import naive_softmax, online_softmax, online_softmax_steps
from strategies import (attention_cases, blind_columns, examples, moved_permutation,
                        split_points)
from tolerance import assert_close_f64, forward_magnitudes, merge_partials

RTOL = 1e-13
F64 = ("float64",)
MANY = examples(5)       # NumPy only: five times a kernel test's count


def naive_attention_row(q_row, K, V, cols, scale):
    """One output row and its lse from the definition, with loops: an independent oracle."""
    if not cols:
        return [0.0] * len(q_row), -math.inf
    s = [scale * math.fsum(a * b for a, b in zip(q_row, K[c])) for c in cols]
    m = max(s)
    e = [math.exp(x - m) for x in s]
    total = math.fsum(e)
    out = [math.fsum(e[t] * V[c][j] for t, c in enumerate(cols)) / total
           for j in range(len(q_row))]
    return out, m + math.log(total)


def naive_visible_cols(r, Sq, Sk, causal):
    """The keys row r sees, spelled out from the alignment names (not from masks.py):
    bottom_right puts the last query on the last key, top_left puts the first query on
    the first key."""
    if causal is None:
        return list(range(Sk))
    if causal == "bottom_right":
        return [c for c in range(Sk) if c - (Sk - 1) <= r - (Sq - 1)]
    return [c for c in range(Sk) if c <= r]


def mags(case, q=None, k=None, v=None, causal="case"):
    """(mag_O, mag_L) of a case (optionally with replaced inputs): see tolerance.py."""
    return forward_magnitudes(case.q if q is None else q, case.k if k is None else k,
                              case.v if v is None else v,
                              causal=case.causal if causal == "case" else causal,
                              scale=case.scale)


# --- the reference against the definition --------------------------------------------

@settings(max_examples=MANY)
@given(case=attention_cases(dtypes=F64, tiles=None, min_seqlen=0, max_seqlen=12))
def test_reference_matches_loops(case):
    O, L = reference.forward(case.q, case.k, case.v, causal=case.causal, scale=case.scale)
    scale = 1 / math.sqrt(case.d) if case.scale is None else case.scale
    want_O = np.zeros_like(O)
    want_L = np.zeros_like(L)
    for b in range(case.B):
        for h in range(case.H):
            K, V = case.k[b, h].tolist(), case.v[b, h].tolist()
            for r in range(case.Sq):
                cols = naive_visible_cols(r, case.Sq, case.Sk, case.causal)
                want_O[b, h, r], want_L[b, h, r] = naive_attention_row(
                    case.q[b, h, r].tolist(), K, V, cols, scale)
    mO, mL = mags(case)
    assert_close_f64("O", O, want_O, RTOL, mO)
    assert_close_f64("lse", L, want_L, RTOL, mL)


@settings(max_examples=MANY)
@given(case=attention_cases(dtypes=F64, tiles=None, min_seqlen=0))
def test_lse_is_logsumexp_and_rows_of_p_sum_to_one(case):
    O, L = reference.forward(case.q, case.k, case.v, causal=case.causal, scale=case.scale)
    P = reference.probabilities(case.q, case.k, causal=case.causal, scale=case.scale)
    mask = visible(case.Sq, case.Sk, case.causal)
    scale = 1 / math.sqrt(case.d) if case.scale is None else case.scale
    S = scale * (case.q @ np.swapaxes(case.k, -1, -2))
    # logsumexp over visible keys, computed in Python from the scores
    want_L = np.full(L.shape, -np.inf)
    for idx in np.ndindex(L.shape):
        vals = [S[idx][c] for c in range(case.Sk) if mask[idx[-1], c]]
        if vals:
            m = max(vals)
            want_L[idx] = m + math.log(math.fsum(math.exp(x - m) for x in vals))
    mO, mL = mags(case)
    assert_close_f64("lse", L, want_L, RTOL, mL)
    # rows that see a key: P sums to 1; rows that see none: P row all exactly 0
    seen = mask.any(axis=1)
    sums = P.sum(axis=-1)
    np.testing.assert_allclose(sums[..., seen], 1.0, rtol=0, atol=1e-14)
    assert np.array_equal(P[..., ~seen, :], np.zeros_like(P[..., ~seen, :]))
    # masked entries of P are exactly 0; P = exp(S - lse) where visible
    assert np.all(P[..., ~mask] == 0)
    with np.errstate(invalid="ignore"):
        want_P = np.where(mask, np.exp(S - L[..., None]), 0.0)
    assert_close_f64("P", P, want_P, RTOL, 1.0)
    assert_close_f64("O", O, P @ case.v, RTOL, mO)


# --- causal alignment, by hand ---------------------------------------------------------

# (Sq, Sk, mode): the visible matrix written out; rows are queries, columns keys.
HAND_MASKS = {
    (2, 4, "bottom_right"): [[1, 1, 1, 0],
                             [1, 1, 1, 1]],
    (2, 4, "top_left"):     [[1, 0, 0, 0],
                             [1, 1, 0, 0]],
    (4, 2, "bottom_right"): [[0, 0],
                             [0, 0],
                             [1, 0],
                             [1, 1]],
    (4, 2, "top_left"):     [[1, 0],
                             [1, 1],
                             [1, 1],
                             [1, 1]],
    (3, 3, "bottom_right"): [[1, 0, 0],
                             [1, 1, 0],
                             [1, 1, 1]],
    (3, 3, "top_left"):     [[1, 0, 0],
                             [1, 1, 0],
                             [1, 1, 1]],
    (1, 3, "bottom_right"): [[1, 1, 1]],
    (1, 3, "top_left"):     [[1, 0, 0]],
    (3, 1, "bottom_right"): [[0], [0], [1]],
    (3, 1, "top_left"):     [[1], [1], [1]],
    (2, 3, None):           [[1, 1, 1],
                             [1, 1, 1]],
}


@pytest.mark.parametrize("Sq,Sk,mode", list(HAND_MASKS))
def test_causal_alignment_by_hand(Sq, Sk, mode):
    want = np.array(HAND_MASKS[(Sq, Sk, mode)], dtype=bool)
    assert np.array_equal(visible(Sq, Sk, mode), want)
    # With K = 0 every visible score is equal, so each output row is the plain mean of
    # the values it sees, and lse = log(number of keys seen).
    d = 2
    q = np.arange(Sq * d, dtype=np.float64).reshape(Sq, d) - 1
    k = np.zeros((Sk, d))
    v = np.arange(Sk * d, dtype=np.float64).reshape(Sk, d) * 3 + 1
    O, L = reference.forward(q, k, v, causal=mode)
    for r in range(Sq):
        cols = np.flatnonzero(want[r])
        if cols.size:
            np.testing.assert_allclose(O[r], v[cols].mean(axis=0), rtol=1e-15)
            assert L[r] == pytest.approx(math.log(cols.size), rel=1e-15, abs=1e-15)
        else:
            assert np.array_equal(O[r], np.zeros(d)) and L[r] == -np.inf


def test_causal_true_means_bottom_right():
    assert parse_causal(True) == "bottom_right"
    assert parse_causal(False) is None and parse_causal(None) is None
    assert np.array_equal(visible(2, 5, True), visible(2, 5, "bottom_right"))
    assert causal_offset(2, 5, "bottom_right") == 3 and causal_offset(2, 5, "top_left") == 0


# --- online softmax -----------------------------------------------------------------------

def two_pass_softmax(x):
    x = np.asarray(x, dtype=np.float64)
    m = x.max()
    if m == -np.inf:
        return np.zeros_like(x)
    e = np.exp(x - m)
    return e / e.sum()


finite_rows = st.lists(st.floats(-50, 50, allow_nan=False, allow_subnormal=False),
                       min_size=1, max_size=40)
masked_rows = st.lists(st.one_of(st.floats(-50, 50, allow_nan=False, allow_subnormal=False),
                                 st.just(-np.inf)), min_size=1, max_size=40)


@settings(max_examples=MANY)
@given(x=masked_rows, block=st.integers(1, 8))
def test_online_softmax_equals_two_pass(x, block):
    p, m, l = online_softmax(x, block=block)
    want = two_pass_softmax(x)
    np.testing.assert_allclose(p, want, rtol=1e-13, atol=1e-300)
    assert m == max(x)
    if m == -np.inf:
        assert l == 0 and np.array_equal(p, np.zeros(len(x)))
    else:
        assert math.log(l) + m == pytest.approx(
            m + math.log(math.fsum(math.exp(t - m) for t in x)), rel=1e-13, abs=1e-13)


@settings(max_examples=MANY)
@given(x=masked_rows, block=st.integers(1, 8))
def test_online_softmax_invariant_after_every_block(x, block):
    """After t entries, l = sum_{c < t} exp(x_c - m) with m = max(x[:t])."""
    for t, m, l in online_softmax_steps(x, block=block):
        seen = np.asarray(x[:t])
        assert m == seen.max()
        want = math.fsum(math.exp(a - m) for a in seen) if m != -np.inf else 0.0
        assert l == pytest.approx(want, rel=1e-13, abs=0)


def test_online_softmax_all_masked_row():
    p, m, l = online_softmax([-np.inf, -np.inf, -np.inf], block=2)
    assert np.array_equal(p, np.zeros(3)) and m == -np.inf and l == 0


def test_naive_softmax_overflows_where_online_does_not():
    x = np.array([1000.0, 1001.0, 999.0, -5.0])
    naive = naive_softmax(x)
    assert np.isnan(naive).any()               # exp(1000) = inf; inf / inf = nan
    p, m, l = online_softmax(x, block=1)
    assert np.all(np.isfinite(p)) and m == 1001.0
    e = np.exp(x - 1001.0)
    np.testing.assert_allclose(p, e / e.sum(), rtol=1e-15)
    # float32: overflow already at ~88
    assert np.isnan(naive_softmax(np.array([100.0, 90.0], dtype=np.float32))).any()


@settings(max_examples=MANY)
@given(x=finite_rows, block=st.integers(1, 8))
def test_online_softmax_matches_naive_where_naive_is_safe(x, block):
    np.testing.assert_allclose(online_softmax(x, block=block)[0], naive_softmax(np.array(x)),
                               rtol=1e-12)


# --- metamorphic properties, float64 ----------------------------------------------------

def ref(case, q=None, k=None, v=None, **kw):
    opts = {"causal": case.causal, "scale": case.scale}
    opts.update(kw)
    return reference.forward(case.q if q is None else q, case.k if k is None else k,
                             case.v if v is None else v, **opts)


@settings(max_examples=MANY)
@given(case=attention_cases(dtypes=F64, causal=(None,), tiles=None))
def test_kv_permutation(case):
    """Permuting K and V rows together (no mask) leaves O and lse unchanged; the
    permutation is never the identity, so Sk = 1 is not drawn."""
    assume(case.Sk >= 2)
    perm = moved_permutation(case.rng, case.Sk)
    O, L = ref(case)
    O2, L2 = ref(case, k=case.k[..., perm, :], v=case.v[..., perm, :])
    mO, mL = mags(case)
    assert_close_f64("O", O2, O, RTOL, mO)
    assert_close_f64("lse", L2, L, RTOL, mL)


@settings(max_examples=MANY)
@given(case=attention_cases(dtypes=F64, tiles=None))
def test_key_shift(case):
    """K -> K + 1 u^T adds scale * q_r . u to every score of row r: O unchanged, lse
    shifted by that constant (rows that see no key stay at 0 / -inf). u is never 0."""
    u = case.random_like((case.d,))
    if not u.any():
        u[0] = 1
    O, L = ref(case)
    O2, L2 = ref(case, k=case.k + u)
    scale = 1 / math.sqrt(case.d) if case.scale is None else case.scale
    mO, mL = mags(case)
    mL = max(mL, mags(case, k=case.k + u)[1])
    assert_close_f64("O", O2, O, RTOL, mO)
    with np.errstate(invalid="ignore"):
        want_L = L + scale * (case.q @ u)
    assert_close_f64("lse", L2, want_L, RTOL, mL)


@settings(max_examples=MANY)
@given(case=attention_cases(dtypes=F64, tiles=None), a=st.sampled_from([2.0, -0.5, 3.25]))
def test_v_affine(case, a):
    """O(Q, K, aV + b) = aO + b on rows that see a key; masked rows stay exactly 0."""
    b = case.random_like((case.d,))
    O, L = ref(case)
    O2, L2 = ref(case, v=a * case.v + b)
    rows = visible(case.Sq, case.Sk, case.causal).any(axis=1)
    want = np.where(rows[:, None], a * O + b, 0.0)
    assert_close_f64("O", O2, want, RTOL, mags(case, v=a * case.v + b)[0])
    assert np.array_equal(L2, L)


@settings(max_examples=MANY)
@given(case=attention_cases(dtypes=F64, causal=(None, "bottom_right"), tiles=None),
       data=st.data())
def test_split_kv_merge(case, data):
    """Attention over K[:s] and K[s:], merged with their lse, equals the whole.

    Non-causal: both parts unmasked. bottom_right causal with s <= Sk - Sq + 1 (the
    KV-cache split): the prefix is visible to every row (no mask), and the suffix under
    bottom_right alignment has exactly the full problem's mask; rows of the suffix part
    may see no key (lse -inf partials, at s = Sk - Sq + 1 with Sq >= 2). Both parts are
    non-empty (1 <= s <= Sk - 1; an empty part makes the other the whole), so Sk = 1 and
    bottom_right with Sq > Sk are not drawn, nor Sq = 0 (nothing to compare); empty parts
    are test_split_kv_merge_with_minus_inf_partials'."""
    hi = case.Sk - 1 if case.causal is None else min(case.Sk - 1, case.Sk - case.Sq + 1)
    assume(hi >= 1)
    s = data.draw(split_points(1, hi), label="s")
    O, L = ref(case)
    O1, L1 = ref(case, k=case.k[..., :s, :], v=case.v[..., :s, :], causal=None)
    O2, L2 = ref(case, k=case.k[..., s:, :], v=case.v[..., s:, :])
    Om, Lm = merge_partials(O1, L1, O2, L2)
    mO, mL = mags(case)
    assert_close_f64("O", Om, O, RTOL, mO)
    assert_close_f64("lse", Lm, L, RTOL, mL)


@settings(max_examples=MANY)
@given(case=attention_cases(dtypes=F64, tiles=None, min_seqlen=0, max_seqlen=24),
       data=st.data())
def test_forward_splits_is_forward(case, data):
    """reference.forward_splits (the keys cut into num_splits ranges, attention over each
    with its place in the whole mask, merged by combine_splits) gives forward's O and
    lse, for 1 split to more splits than keys (empty ones), every causal mode and a
    window; each part's lse is -inf exactly where its row sees none of its keys."""
    n = data.draw(st.integers(1, case.Sk + 2), label="num_splits")
    window = data.draw(st.sampled_from([None, (3, 1), (0, -1)]), label="window")
    kw = dict(causal=case.causal, scale=case.scale, window_size=window)
    O, L = reference.forward(case.q, case.k, case.v, **kw)
    Os, Ls, parts = reference.forward_splits(case.q, case.k, case.v, n, **kw)
    assert len(parts) == n
    mO, mL = forward_magnitudes(case.q, case.k, case.v, causal=case.causal, scale=case.scale)
    assert_close_f64("O", Os, O, RTOL, mO)
    assert_close_f64("lse", Ls, L, RTOL, mL)
    assert np.array_equal(np.isneginf(Ls), np.isneginf(L))
    for (a, b), (_, Lp) in zip(reference.split_ranges(case.Sk, n), parts):
        sees = visible_band(case.Sq, case.Sk, case.causal, window)[..., a:b].any(axis=-1)
        assert np.array_equal(np.isneginf(Lp), np.broadcast_to(~sees, Lp.shape))


def test_split_ranges():
    """Even ranges that cover the keys in order, the larger first; empty ones past Sk;
    ValueError for no split."""
    assert reference.split_ranges(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert reference.split_ranges(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]
    assert reference.split_ranges(0, 1) == [(0, 0)]
    with pytest.raises(ValueError, match="num_splits"):
        reference.split_ranges(5, 0)


def test_split_kv_merge_with_minus_inf_partials():
    """Explicit: Sq = 3, Sk = 4, bottom_right, s = 2: suffix part rows 0 sees no key; an
    empty prefix or suffix (s = 0, s = Sk) merged with the whole; both parts empty."""
    rng = np.random.default_rng(5)
    q, k, v = (rng.uniform(-4, 4, (3 if i == 0 else 4, 3)) for i in range(3))
    O, L = reference.forward(q, k, v, causal=True)
    O1, L1 = reference.forward(q, k[:2], v[:2])
    O2, L2 = reference.forward(q, k[2:], v[2:], causal=True)
    assert L2[0] == -np.inf and np.array_equal(O2[0], np.zeros(3))
    Om, Lm = merge_partials(O1, L1, O2, L2)
    mO, mL = forward_magnitudes(q, k, v, causal=True)
    assert_close_f64("O", Om, O, RTOL, mO)
    assert_close_f64("lse", Lm, L, RTOL, mL)
    # one part empty (zeros and -inf): the merge is the other part, the whole
    Oe, Le = reference.forward(q, k[:0], v[:0])
    assert np.array_equal(Oe, np.zeros((3, 3))) and np.all(Le == -np.inf)
    for parts in (((Oe, Le), (O, L)), ((O, L), (Oe, Le))):
        Om, Lm = merge_partials(*parts[0], *parts[1])
        assert_close_f64("O", Om, O, RTOL, mO)
        assert_close_f64("lse", Lm, L, RTOL, mL)
    # both parts empty: merge gives 0 and -inf
    Oe, Le = reference.forward(q, k[:0], v[:0])
    Om, Lm = merge_partials(Oe, Le, Oe, Le)
    assert np.array_equal(Om, np.zeros((3, 3))) and np.all(Lm == -np.inf)


@settings(max_examples=MANY)
@given(case=attention_cases(dtypes=F64, causal=("bottom_right",), tiles=None), data=st.data())
def test_causal_suffix(case, data):
    """bottom_right: the last m query rows alone give the last m rows of the whole. m < Sq
    (m = Sq is the whole again), so Sq = 1 is not drawn."""
    assume(case.Sq >= 2)
    m = data.draw(st.integers(1, case.Sq - 1), label="m")
    O, L = ref(case)
    Os, Ls = ref(case, q=case.q[..., -m:, :])
    mO, mL = mags(case)
    assert_close_f64("O", Os, O[..., -m:, :], RTOL, mO)
    assert_close_f64("lse", Ls, L[..., -m:], RTOL, mL)


@settings(max_examples=MANY)
@given(case=attention_cases(dtypes=F64, causal=("bottom_right", "top_left"), tiles=None),
       data=st.data())
def test_causal_prefix_independence(case, data):
    """Changing keys (and values) at columns >= c0 leaves every row that cannot see c0
    unchanged. c0 is one of strategies.blind_columns (some row that sees a key cannot see
    it); Sk = 1, and bottom_right with Sq = 1, have none and are not drawn."""
    columns = blind_columns(case.Sq, case.Sk, case.causal)
    assume(columns)
    c0 = data.draw(st.sampled_from(columns), label="c0")
    k2, v2 = case.k.copy(), case.v.copy()
    k2[..., c0:, :] = case.random_like(k2[..., c0:, :].shape)
    v2[..., c0:, :] = case.random_like(v2[..., c0:, :].shape) * 3
    O, L = ref(case)
    O2, L2 = ref(case, k=k2, v=v2)
    blind = ~visible(case.Sq, case.Sk, case.causal)[:, c0]
    mO, mL = mags(case)
    assert_close_f64("O", O2[..., blind, :], O[..., blind, :], RTOL, mO)
    assert_close_f64("lse", L2[..., blind], L[..., blind], RTOL, mL)


@settings(max_examples=MANY)
@given(case=attention_cases(dtypes=F64, causal=("bottom_right", "top_left"), tiles=None),
       data=st.data())
def test_nan_in_masked_keys_has_no_effect(case, data):
    """NaN in K and V at column c affects exactly the rows that see c: those rows are all
    NaN (O and lse), every other row is unchanged. c is seen by some row and is one of
    strategies.blind_columns (some row that sees a key does not see c), so both sets are
    real; Sk = 1, and bottom_right with Sq = 1, have no such column and are not drawn."""
    sees_c = visible(case.Sq, case.Sk, case.causal).any(axis=0)
    columns = [c for c in blind_columns(case.Sq, case.Sk, case.causal) if sees_c[c]]
    assume(columns)
    c = data.draw(st.sampled_from(columns), label="c")
    k2, v2 = case.k.copy(), case.v.copy()
    k2[..., c, :] = np.nan
    v2[..., c, :] = np.nan
    O, L = ref(case)
    O2, L2 = ref(case, k=k2, v=v2)
    sees = visible(case.Sq, case.Sk, case.causal)[:, c]
    assert np.all(np.isnan(O2[..., sees, :])) and np.all(np.isnan(L2[..., sees]))
    mO, mL = mags(case)
    assert_close_f64("O", O2[..., ~sees, :], O[..., ~sees, :], RTOL, mO)
    assert_close_f64("lse", L2[..., ~sees], L[..., ~sees], RTOL, mL)


def test_nan_in_v_reaches_only_its_column_and_rows():
    """NaN in V[c, j] makes O[r, j] NaN for the rows r that see c, nothing else; lse is
    unchanged (V does not enter the softmax)."""
    rng = np.random.default_rng(1)
    q, k, v = rng.uniform(-4, 4, (4, 3)), rng.uniform(-4, 4, (6, 3)), rng.uniform(-4, 4, (6, 3))
    v2 = v.copy()
    v2[4, 1] = np.nan
    O, L = reference.forward(q, k, v, causal="top_left")
    O2, L2 = reference.forward(q, k, v2, causal="top_left")
    want_nan = np.zeros((4, 3), bool)
    want_nan[4:, 1] = True                      # top_left: row r sees c <= r: no row sees c=4
    assert np.array_equal(np.isnan(O2), want_nan)
    O3, _ = reference.forward(q, k, v2, causal="bottom_right")   # offset 2: rows 2, 3 see c=4
    want_nan[2:, 1] = True
    assert np.array_equal(np.isnan(O3), want_nan)
    assert np.array_equal(L2, L)
