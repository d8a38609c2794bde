"""L2 (simulator) / L3 (GPU): the backward kernels on non-finite inputs.

TESTING.md's table: "NaN or inf in a visible input: NaN propagates to the affected rows
only; no silent repair" and "NaN in masked or padded positions: no effect". Each test runs
the default forward and then ``attention_backward`` with every version in
numbaflash.kernels.backward.VERSIONS (a version that refuses a dtype is a visible skip
with the library's reason), once on clean inputs and once with NaN put in (the forward is
rerun on the NaN inputs, as a user would), in float64, float32 and float16 (float16's
infinities and its range: tests/test_float16_range.py).

Where NaN must go, from the math. The backward of row r, per visible pair (r, c):

    p = exp(s(q_r, k_c) - L_r);  dV[c] += p dO[r];  ds = p (dO[r] . V[c] - D_r)
    dQ[r] += scale ds K[c];      dK[c] += scale ds Q[r];   D_r = dO[r] . O[r]

Masked pairs are not terms of these sums (they are structurally absent, not multiplied by
0), and a row that sees no key has L = -inf and is skipped. So if one of L_r, D_r, dO[r],
Q[r] is NaN for a row r that sees a key, every term of that row is NaN: dQ[r] and the dK
and dV rows of every key r sees are NaN in every component (NaN * 0 is NaN), and nothing
else changes. Call such rows *poisoned*:

    NaN in dO[r] or Q[r]   poisons row r (Q[r]: via L_r and O[r] from the forward)
    NaN in K[c]            poisons every row that sees c (their L and O are NaN)
    NaN in V[c]            poisons every row that sees c (O, hence D, is NaN; L is not),
                           but p stays finite: dV is bitwise unchanged everywhere,
                           dV[c] included

    NaN exactly in: dQ rows of poisoned rows; dK rows (and, except for V, dV rows) of the
    keys some poisoned row sees. Every other element is bitwise what it was (v2's dQ:
    equal to rounding, its atomics add in a varying order even in the simulator).
    Keys no row sees keep dK = dV = 0 exactly; rows that see no key keep dQ = 0 exactly.

In particular NaN in a masked key (some rows do not see it) leaves the dQ of those rows
bitwise unchanged, but it does reach the dK, dV of every key that a row seeing it sees
(through that row's NaN softmax), not only its own. NaN in padded keys (no row sees them)
and NaN in the q or dO row of a fully masked query changes no bit anywhere.

The same NaN positions come out of the reference's formulas with every sum restricted to
visible pairs (``masked_reference_backward`` below), and out of numbaflash.reference.backward,
which sums the same way since this file found that its plain matmuls (0 * NaN over masked
pairs) put NaN where the math has none.
"""

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import numbaflash
from numbaflash import reference
from numbaflash.kernels import backward as bwd
from numbaflash.kernels.backward import v1_two_kernels as bwd_v1
from numbaflash.kernels.plan import SHARED_MEM_LIMIT
from numbaflash.masks import visible
from backward_checks import GRADS, backward_magnitudes, version_tiles
from strategies import (CAUSAL_MODES, Sizes, attention_cases, examples, make_case, on_gpu,
                        refusal)
from tolerance import (assert_bitwise_equal, assert_close_f64, fully_masked_rows, to_host,
                       unseen_keys)

pytestmark = pytest.mark.usefixtures("nan_prefilled_outputs")

DTYPES = ("float64", "float32", "float16")
# v2's dQ is summed by atomics in a varying order: non-NaN elements equal to rounding.
V2_DQ_RTOL = {"float64": 1e-12, "float32": 1e-5}

# Simulator sizes: d <= 8, seqlens <= 20 (at most 3 tiles + 1 per axis), B*H <= 2, tiles 4, 8.
SIM_SIZES = Sizes(max_batch_heads=2, max_seqlen=20, head_dims=(4, 1, 3, 8), tile_sizes=(4, 8),
                  max_tiles_per_axis=3, default_tile=4, max_score_elements=2 * 20 * 20)
SIZES = None if on_gpu() else SIM_SIZES           # None: the backend's (GPU) sizes


def tile_pairs(d, acc_dtype):
    """(Br, Bc) to draw: all pairs of the small tiles; on a GPU the production candidates
    that fit the backward kernels (as test_backward_kernels.py)."""
    if SIZES is not None:
        return [(Br, Bc) for Br in SIZES.tile_sizes for Bc in SIZES.tile_sizes]
    return [t for t in bwd_v1.TILE_CANDIDATES
            if bwd_v1.backward_shared_bytes(*t, d, acc_dtype) <= SHARED_MEM_LIMIT]


def dtype_version_params():
    """Every (dtype, version) pair; one the library refuses (e.g. v2 with float16) is a
    visible skip carrying the library's reason. v5 to v9 refuse NaN inputs with an
    error (the default runs v4 instead of v5, v6, v8 and v9; v7 is never the
    default): their own tests check that (v7's: tests/test_backward_half.py, v8's:
    tests/test_backward_atomic_dq.py, v9's: tests/test_backward_v9.py), and here they are
    skips that say so."""
    params = []
    for dtype in DTYPES:
        for version in bwd.VERSIONS:
            why = refusal(numbaflash.explain_backward, version, dtype)
            if why is None and version in ("v5", "v6"):
                why = (f"{version} takes finite inputs only: it refuses NaN with an error, "
                       "and the default runs v4 instead (test_tensor_core_versions_refuse_"
                       "nonfinite_inputs_and_the_default_runs_v4)")
            elif why is None and version == "v7":
                why = ("v7 takes finite inputs only: it refuses NaN with an error "
                       "(tests/test_backward_half.py, test_v7_refuses_nonfinite_inputs)")
            elif why is None and version == "v9":
                why = ("v9 takes finite inputs only: it refuses NaN with an error "
                       "(tests/test_backward_v9.py, test_v9_refuses_nonfinite_inputs)")
            elif why is None and version == "v8":
                why = ("v8 takes finite inputs only: it refuses NaN with an error "
                       "(tests/test_backward_atomic_dq.py, test_nonfinite_inputs_fall_back_"
                       "to_v4_with_the_reason)")
            elif why is None and version == "v10":
                why = ("v10 takes finite inputs only, as v6 (tests/test_backward_v10.py, "
                       "test_v10_refuses_nonfinite_inputs)")
            marks = () if why is None else pytest.mark.skip(reason=why)
            params.append(pytest.param(dtype, version, id=f"{dtype}-{version}", marks=marks))
    return params


COMBOS = dtype_version_params()


def with_dtype(case, dtype):
    """The same case (same seed, so the same float32-exact values) in ``dtype``."""
    return make_case(case.B, case.H, case.Sq, case.Sk, case.d, dtype, case.causal, case.tiles,
                     case.scale, case.values, case.seed, True)


@st.composite
def nan_cases(draw, axis, causal=CAUSAL_MODES, which=(None,)):
    """(case, index, which): a drawn case (float64; tests recast it), a query row (axis "q")
    or key row (axis "k") index, and which input gets the NaN."""
    case = draw(attention_cases(dtypes=("float64",), causal=causal, tiles=tile_pairs,
                                with_dout=True, sizes=SIZES))
    index = draw(st.integers(0, (case.Sq if axis == "q" else case.Sk) - 1))
    return case, index, draw(st.sampled_from(which))


def gradients(case, version, q=None, k=None, v=None, dout=None):
    """(dQ, dK, dV) as NumPy arrays: the default forward on these inputs, then the backward
    with the case's tiles (for v3 with a thread tile added, backward_checks.version_tiles)."""
    q, k, v = (case.q if q is None else q, case.k if k is None else k,
               case.v if v is None else v)
    dout = case.dout if dout is None else dout
    opts = {"causal": case.causal, "scale": case.scale}
    out, lse = numbaflash.attention(q, k, v, return_lse=True, **opts)
    tiles = version_tiles(version, case.tiles, case.d, case.dtype, case.seed)
    grads = numbaflash.attention_backward(dout, q, k, v, out, lse, version=version,
                                          tiles=tiles, **opts)
    return tuple(to_host(g) for g in grads)


def expected_nan(case, poisoned, dv=True):
    """Per gradient, the rows that must be NaN (module docstring): ``poisoned`` is a bool
    (Sq,) of rows whose terms are NaN; rows that see no key are skipped, so never count."""
    vis = visible(case.Sq, case.Sk, case.causal)
    rows = poisoned & vis.any(axis=1)
    keys = vis[rows].any(axis=0)
    return {"dQ": rows, "dK": keys, "dV": keys if dv else np.zeros(case.Sk, bool)}


def rows_of(mask):
    """Row indices (axis -2) where any element is set, for messages."""
    return np.flatnonzero(mask.reshape(-1, *mask.shape[-2:]).any(axis=(0, 2))).tolist()


def check_nan_spread(case, version, clean, dirty, want):
    """NaN exactly in ``want``'s rows (every component, every batch and head); every other
    element bitwise equal to the clean run (v2's dQ: to rounding); exact zeros kept."""
    mags = backward_magnitudes(case.dout, case.q, case.k, case.v, causal=case.causal,
                               scale=case.scale)
    for name, c, g in zip(GRADS, clean, dirty):
        assert not np.isnan(c).any(), \
            f"{name}: the clean run has NaN at rows {rows_of(np.isnan(c))}"
        full = np.broadcast_to(want[name][:, None], g.shape)
        if not np.array_equal(np.isnan(g), full):
            raise AssertionError(f"{name}: NaN at rows {rows_of(np.isnan(g))} (components "
                                 f"{int(np.isnan(g).sum())}), expected every component of rows "
                                 f"{np.flatnonzero(want[name]).tolist()}")
        zero = g.dtype.type(0)
        kept, before = np.where(full, zero, g), np.where(full, zero, c)
        if version == "v2" and name == "dQ":
            assert_close_f64(name, kept, before, V2_DQ_RTOL[np.dtype(case.dtype).name],
                             mags[name])
        else:
            assert_bitwise_equal(name, kept, before)
    dQ, dK, dV = dirty
    rows = fully_masked_rows(case.Sq, case.Sk, case.causal)
    keys = unseen_keys(case.Sq, case.Sk, case.causal)
    assert np.array_equal(dQ[..., rows, :], np.zeros_like(dQ[..., rows, :])), \
        "dQ of rows that see no key is not exactly 0"
    for name, g in (("dK", dK), ("dV", dV)):
        assert np.array_equal(g[..., keys, :], np.zeros_like(g[..., keys, :])), \
            f"{name} of keys no row sees is not exactly 0"


# --- NaN in K or V: masked, padded and visible keys ----------------------------------------

@pytest.mark.parametrize("dtype, version", COMBOS)
@settings(max_examples=examples(0.5))
@given(drawn=nan_cases("k", causal=("bottom_right", "top_left"), which=("k", "v", "kv")))
# a masked key: rows 0-2 do not see key 3; rows 3-5 do, and see keys 0-5; keys 6-10 unseen
@example(drawn=(make_case(1, 1, 6, 11, 3, "float64", "top_left", (4, 4), None, "uniform", 1,
                          True), 3, "kv"))
@example(drawn=(make_case(1, 2, 6, 11, 3, "float64", "top_left", (4, 8), None, "uniform", 2,
                          True), 3, "v"))
# a padded key (top_left, Sk > Sq: keys >= Sq are seen by no row)
@example(drawn=(make_case(1, 2, 6, 11, 5, "float64", "top_left", (4, 4), None, "uniform", 11,
                          True), 9, "kv"))
# bottom_right, Sq > Sk: fully masked rows 0-3, key 2 seen by rows 6-8 only
@example(drawn=(make_case(2, 1, 9, 5, 4, "float64", "bottom_right", (4, 4), 0.5, "grid", 4,
                          True), 2, "k"))
def test_nan_in_a_key_or_value_reaches_exactly_the_rows_that_see_it(dtype, version, drawn):
    """NaN in K[c] and/or V[c]: dQ of the rows that see c is NaN, and the dK (and for K, dV)
    of every key those rows see; the dQ of rows that do not see c, and every other key's
    dK and dV, are bitwise unchanged. A key no row sees keeps dK = dV = 0 exactly."""
    base, c, which = drawn
    case = with_dtype(base, dtype)
    k, v = case.k.copy(), case.v.copy()
    if "k" in which:
        k[..., c, :] = np.nan
    if "v" in which:
        v[..., c, :] = np.nan
    sees_c = visible(case.Sq, case.Sk, case.causal)[:, c]
    want = expected_nan(case, sees_c, dv="k" in which)
    check_nan_spread(case, version, gradients(case, version), gradients(case, version, k=k, v=v),
                     want)
    if not sees_c.any():                        # padded: its own rows exactly 0 (checked above)
        assert not any(w.any() for w in want.values())


# --- NaN in the upstream gradient dO[r] ----------------------------------------------------

@pytest.mark.parametrize("dtype, version", COMBOS)
@settings(max_examples=examples(0.5))
@given(drawn=nan_cases("q"))
@example(drawn=(make_case(1, 1, 6, 5, 3, "float64", "top_left", (4, 4), None, "uniform", 3,
                          True), 1, None))                # row 1 sees keys 0, 1 of 5
@example(drawn=(make_case(1, 2, 9, 12, 4, "float64", "bottom_right", (8, 4), 0.3, "grid", 5,
                          True), 4, None))
def test_nan_in_dout_reaches_its_row_and_the_keys_it_sees(dtype, version, drawn):
    """NaN in dO[r] (D_r = dO[r] . O[r] is NaN too): dQ[r] is NaN, and dK, dV of the keys r
    sees (dV = P^T dO, dS = P (dP - D)); dQ of every other row and dK, dV of the keys r
    does not see are bitwise unchanged. If r sees no key, nothing changes."""
    base, r, _ = drawn
    case = with_dtype(base, dtype)
    dout = case.dout.copy()
    dout[..., r, :] = np.nan
    poisoned = np.arange(case.Sq) == r
    check_nan_spread(case, version, gradients(case, version), gradients(case, version, dout=dout),
                     expected_nan(case, poisoned))


# --- NaN in Q[r] ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype, version", COMBOS)
@settings(max_examples=examples(0.5))
@given(drawn=nan_cases("q"))
@example(drawn=(make_case(1, 1, 6, 5, 3, "float64", "top_left", (4, 4), None, "uniform", 3,
                          True), 2, None))
@example(drawn=(make_case(1, 1, 7, 7, 8, "float64", None, (8, 8), None, "uniform", 6,
                          True), 0, None))
def test_nan_in_a_query_reaches_its_row_and_the_keys_it_sees(dtype, version, drawn):
    """NaN in Q[r]: the forward gives O[r] and L_r NaN (if r sees a key); the backward's dQ[r]
    and the dK, dV of the keys r sees are NaN, and nothing else changes."""
    base, r, _ = drawn
    case = with_dtype(base, dtype)
    q = case.q.copy()
    q[..., r, :] = np.nan
    out, lse = numbaflash.attention(q, case.k, case.v, causal=case.causal, scale=case.scale,
                                    return_lse=True)
    sees_any = visible(case.Sq, case.Sk, case.causal)[r].any()
    assert np.isnan(to_host(out)[..., r, :]).all() == sees_any
    assert np.isnan(to_host(lse)[..., r]).all() == sees_any
    poisoned = np.arange(case.Sq) == r
    check_nan_spread(case, version, gradients(case, version), gradients(case, version, q=q),
                     expected_nan(case, poisoned))


# --- a fully masked row --------------------------------------------------------------------

@pytest.mark.parametrize("dtype, version", COMBOS)
@pytest.mark.parametrize("where", ["q", "dout", "q+dout"])
def test_nan_in_a_fully_masked_row_has_no_effect(dtype, version, where):
    """bottom_right with Sq = 9 > Sk = 5: rows 0-3 see no key (O = 0, L = -inf). NaN in the
    q and/or dO of row 2 changes no bit of any gradient; its dQ row stays exactly 0 (D_2 =
    dO[2] . O[2] = NaN * 0 is NaN, but the kernels skip rows with L = -inf before using it)."""
    case = make_case(1, 2, 9, 5, 4, dtype, "bottom_right", (4, 4), None, "uniform", 9, True)
    assert fully_masked_rows(case.Sq, case.Sk, case.causal)[2]
    q, dout = case.q.copy(), case.dout.copy()
    if "q" in where.split("+"):
        q[..., 2, :] = np.nan
    if "dout" in where.split("+"):
        dout[..., 2, :] = np.nan
    clean = gradients(case, version)
    dirty = gradients(case, version, q=q, dout=dout)
    nothing = expected_nan(case, np.zeros(case.Sq, bool))
    check_nan_spread(case, version, clean, dirty, nothing)
    assert np.array_equal(dirty[0][..., 2, :], np.zeros_like(dirty[0][..., 2, :]))


@pytest.mark.parametrize("dtype, version", COMBOS)
def test_a_row_whose_lse_is_minus_inf_is_skipped(dtype, version):
    """Not causal, but row 1's lse is -inf and its out 0, as the forward gives a row whose
    every score is -inf: the backward skips it like a fully masked row (P = 0 without an
    exp). Its dQ row is exactly 0, and NaN in its q and dO changes no bit anywhere (v2's
    dQ: to rounding). v3 needs this on its path without per-pair tests: such rows are
    staged as zeros."""
    case = make_case(1, 1, 6, 5, 4, dtype, None, (4, 4), None, "uniform", 21, True)
    out, lse = numbaflash.attention(case.q, case.k, case.v, return_lse=True)
    out, lse = to_host(out).copy(), to_host(lse).copy()
    out[..., 1, :] = 0
    lse[..., 1] = -np.inf
    tiles = version_tiles(version, case.tiles, case.d, case.dtype, case.seed)
    q, dout = case.q.copy(), case.dout.copy()
    q[..., 1, :] = np.nan
    dout[..., 1, :] = np.nan
    clean, dirty = (tuple(to_host(g) for g in numbaflash.attention_backward(
        do, qq, case.k, case.v, out, lse, version=version, tiles=tiles))
        for do, qq in ((case.dout, case.q), (dout, q)))
    mags = backward_magnitudes(case.dout, case.q, case.k, case.v)
    for name, c, g in zip(GRADS, clean, dirty):
        assert not np.isnan(g).any(), f"{name}: NaN at rows {rows_of(np.isnan(g))}"
        if version == "v2" and name == "dQ":
            assert_close_f64(name, g, c, V2_DQ_RTOL[np.dtype(dtype).name], mags[name])
        else:
            assert_bitwise_equal(name, g, c)
    assert np.array_equal(dirty[0][..., 1, :], np.zeros_like(dirty[0][..., 1, :]))


# --- the same NaN positions as a reference --------------------------------------------------

def masked_reference_backward(dout, q, k, v, *, causal=None, scale=None):
    """reference.backward's formulas in float64 with every sum over (row, key) pairs taken
    over visible pairs only, and masked entries of P exactly 0 (also in a NaN row)."""
    dO, Q, K, V = (np.asarray(a, np.float64) for a in (dout, q, k, v))
    s = reference.default_scale(Q.shape[-1]) if scale is None else scale
    mask = visible(Q.shape[-2], K.shape[-2], causal)
    P = np.where(mask, reference.probabilities(Q, K, causal=causal, scale=scale), 0)
    O = reference.masked_matmul(P, V, mask)
    with np.errstate(invalid="ignore"):
        D = np.sum(dO * O, axis=-1, keepdims=True)
        dS = np.where(mask, P * (dO @ np.swapaxes(V, -1, -2) - D), 0)
        dV = reference.masked_matmul(np.swapaxes(P, -1, -2), dO, mask.T)
        dQ = reference.masked_matmul(dS, K, mask) * s
        dK = reference.masked_matmul(np.swapaxes(dS, -1, -2), Q, mask.T) * s
    return dQ, dK, dV


# name: (B, H, Sq, Sk, d, causal, [(input, row index)]); every visible-pair-only case first
SCENARIOS = {
    "dout-unmasked": (1, 1, 6, 5, 3, None, [("dout", 1)]),
    "q-unmasked": (1, 2, 6, 5, 3, None, [("q", 4)]),
    "k-unmasked": (1, 1, 5, 6, 3, None, [("k", 2)]),
    "v-unmasked": (1, 1, 5, 6, 3, None, [("v", 2)]),
    "dout-causal": (1, 1, 6, 5, 3, "top_left", [("dout", 1)]),
    "q-causal": (1, 2, 6, 5, 3, "top_left", [("q", 2)]),
    "k-masked-key": (1, 1, 6, 11, 3, "top_left", [("k", 3)]),
    "v-masked-key": (1, 1, 9, 9, 3, "bottom_right", [("v", 6)]),
    "kv-padded-key": (1, 2, 6, 11, 5, "top_left", [("k", 9), ("v", 9)]),
    "q-fully-masked-row": (1, 1, 9, 5, 4, "bottom_right", [("q", 2)]),
    "dout-fully-masked-row": (1, 1, 9, 5, 4, "bottom_right", [("dout", 2)]),
}

def scenario_run(name, dtype, version):
    """(kernel grads, inputs dict, case) of one SCENARIOS entry."""
    B, H, Sq, Sk, d, causal, nans = SCENARIOS[name]
    case = make_case(B, H, Sq, Sk, d, dtype, causal, (4, 4), None, "uniform", 13, True)
    arrays = {"q": case.q, "k": case.k, "v": case.v, "dout": case.dout}
    for which, index in nans:
        arrays[which] = arrays[which].copy()
        arrays[which][..., index, :] = np.nan
    return gradients(case, version, **arrays), arrays, case


@pytest.mark.parametrize("dtype, version", COMBOS)
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_nan_positions_equal_masked_reference(dtype, version, name):
    """The kernels' NaN positions equal those of the reference's formulas summed over
    visible pairs only (an independent check of expected_nan's reasoning)."""
    grads, arrays, case = scenario_run(name, dtype, version)
    ref = masked_reference_backward(**arrays, causal=case.causal, scale=case.scale)
    assert any(np.isnan(g).any() for g in grads) != name.endswith(("padded-key", "masked-row"))
    for gname, g, want in zip(GRADS, grads, ref):
        assert np.array_equal(np.isnan(g), np.isnan(want)), (
            f"{gname}: kernel NaN rows {rows_of(np.isnan(g))}, masked reference "
            f"{rows_of(np.isnan(want))}")


@pytest.mark.parametrize("dtype, version", COMBOS)
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_nan_positions_equal_reference_backward(dtype, version, name):
    """np.isnan of the kernels' gradients equals np.isnan of numbaflash.reference.backward's
    on the same inputs, with and without masks."""
    grads, arrays, case = scenario_run(name, dtype, version)
    ref = reference.backward(arrays["dout"], arrays["q"], arrays["k"], arrays["v"],
                             causal=case.causal, scale=case.scale)
    for gname, g, want in zip(GRADS, grads, ref):
        assert np.array_equal(np.isnan(g), np.isnan(want)), (
            f"{gname}: kernel NaN rows {rows_of(np.isnan(g))}, reference.backward "
            f"{rows_of(np.isnan(want))}")


@pytest.mark.skipif(not on_gpu(), reason="the GPU's finite check and fallback; the simulator's "
                                         "default is v4 already")
@pytest.mark.parametrize("dtype,default,refusing", [
    ("float32", "v6", ("v5", "v6")), ("float16", "v9", ("v5", "v6", "v9"))])
@pytest.mark.parametrize("which", ["q", "k", "v", "dout", "lse"])
def test_tensor_core_versions_refuse_nonfinite_inputs_and_the_default_runs_v4(
        which, dtype, default, refusing, caplog):
    """The tensor-core backwards need finite inputs: with a NaN in any input, asking for
    one of them is a ValueError that says why, and the default (v6 on a GPU in float32, v9
    in float16) runs v4 after its own kernels (queued before the check's answer), logs
    why, and gives v4's gradients bitwise. With finite inputs the default is v6 or v9."""
    case = make_case(1, 2, 40, 33, 16, dtype, "bottom_right", None, None, "uniform", 4,
                     True)
    out, lse = numbaflash.attention(case.q, case.k, case.v, causal=case.causal,
                                    return_lse=True)
    args = {"dout": case.dout, "q": case.q, "k": case.k, "v": case.v, "out": out, "lse": lse}
    assert numbaflash.explain_backward(case.q, case.k, case.v,
                                       causal=case.causal)[-1].version == default
    bad = dict(args)
    bad[which] = args[which].copy()
    bad[which][0, 1, 7] = np.nan            # a row (query or key) that the mask leaves seen
    names = ("dout", "q", "k", "v", "out", "lse")
    for version in refusing:
        with pytest.raises(ValueError, match=rf"backward {version} cannot run this input: "
                                             r"the inputs hold NaN or inf .*; use v4"):
            numbaflash.attention_backward(*(bad[n] for n in names), causal=case.causal,
                                          version=version)
    with caplog.at_level("INFO", logger="numbaflash"):
        got = numbaflash.attention_backward(*(bad[n] for n in names), causal=case.causal)
    want = numbaflash.attention_backward(*(bad[n] for n in names), causal=case.causal,
                                         version="v4")
    for name, a, b in zip(GRADS, got, want):
        assert_bitwise_equal(name, a, b)
    text = caplog.text
    fell_back = text.index(f"running v4 instead of the default {default}")
    assert (text.index(f"backward_dkdv_{default}") < fell_back
            < text.index("backward_dkdv_v4"))


@pytest.mark.parametrize("packed", [False, True])
def test_the_default_queues_its_kernels_before_the_check_and_v4_writes_after_them(
        packed, monkeypatch, caplog):
    """The default's tensor-core kernels are queued before the host waits for the finite
    check (policy.start_finite_check); with a NaN among the inputs v4 runs after them and
    writes every gradient again: the result is v4's, bitwise. On the simulator, with v6
    made the default (it is v4 there), as on a GPU; packed: attention_varlen_backward."""
    from numbaflash import policy
    real = policy.default_backward_version

    def v6_by_default(p, where, tensor_cores=True):
        return ("v6", "v6 for this test") if tensor_cores else real(p, where, False)

    monkeypatch.setattr(policy, "default_backward_version", v6_by_default)
    case = make_case(1, 2, 9, 7, 8, "float32", "bottom_right", None, None, "uniform", 5,
                     True)
    q, k, v, dout = case.q, case.k, case.v, case.dout
    if packed:
        q, k, v, dout = (np.ascontiguousarray(x[0].transpose(1, 0, 2))
                         for x in (q, k, v, dout))
        cu_q = np.array([0, q.shape[0]], np.int32)
        cu_k = np.array([0, k.shape[0]], np.int32)
        out, lse = numbaflash.attention_varlen(q, k, v, cu_q, cu_k, causal=True,
                                               return_lse=True)
        dout = dout.copy()
        dout[3, 1, 2] = np.nan

        def backward(**kw):
            return numbaflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k,
                                                        causal=True, **kw)
    else:
        out, lse = numbaflash.attention(q, k, v, causal=case.causal, return_lse=True)
        dout = dout.copy()
        dout[0, 1, 3, 2] = np.nan

        def backward(**kw):
            return numbaflash.attention_backward(dout, q, k, v, out, lse,
                                                 causal=case.causal, **kw)
    with caplog.at_level("INFO", logger="numbaflash"):
        got = backward()
    text = caplog.text
    fell_back = text.index("running v4 instead of the default v6")
    assert text.index("backward_dkdv_v6") < fell_back < text.index("backward_dkdv_v4")
    want = backward(version="v4")
    for name, a, b in zip(GRADS, got, want):
        assert_bitwise_equal(name, a, b)
    with pytest.raises(ValueError, match=r"backward v6 cannot run this input"):
        backward(version="v6")
