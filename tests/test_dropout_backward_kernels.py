"""L2 (simulator) / L3 (GPU): attention dropout in the backward kernels (v1, v4, v6).

The kernels regenerate the forward's keep mask (kernels/variants.py, ``make_dropout``)
and compute flash-attention's gradients of O = (P * keep / (1 - p)) V:

    Z  = keep / (1 - p)          (keep_scale where kept, 0 where dropped)
    dV = (P Z)^T dO,  dP = (dO V^T) Z,  D = rowsum(dO * O),  dS = P (dP - D) G
    dQ = scale dS K,  dK = scale dS^T Q

(numbaflash.reference.backward's docstring). Each case runs a backward version on fixed
small shapes whose sequences cross tile boundaries with ragged last tiles, and compares
it with backward_checks' rule: ``ref`` is the float64 gradient of the rounded inputs
with D from the given out, ``base`` Algorithm 2's formulas in the test dtype from the
given out and lse (backward_checks.naive_backward), both with the keep mask Z; the
magnitudes the rule adds are backward_checks' formulas with Z in them. check_backward
itself does not take a keep mask, hence the dropout versions here, written the same way.

out and lse come from the dense reference with the same mask
(``reference.forward(..., dropout_keep=numbaflash.dropout_mask(...))``), rounded as
``attention`` returns them (out in the input dtype, lse in float32, float64 for float64
inputs): this file tests the backward kernels alone, whatever forward is in use.

Cases: plain, causal in both alignments with Sq != Sk, GQA (B = 2, four query heads on
two K/V heads: the masks differ per query head and dK, dV sum over each group), a
sliding window; float16 (v4) and float64 (v1) once each. Then: p = 0 is the plain kernel
bit for bit, the same seed gives the same bits twice (no atomics), another seed other
gradients. Backward v6 (tensor cores) is slow on the simulator (every mma a rendezvous of
32 Python threads; tests/test_variants_backward_mma.py), so it gets two cases at (16, 16)
tiles. Outputs are pre-filled with NaN, so an element the kernels never write shows.

Simulator cost (``pytest --durations``, 2-core machine shared with other jobs): 39-51 s
for the whole file, 14 s of it v6's three runs and 11-15 s the two determinism tests.
"""

import sys

import numpy as np
import pytest

import numbaflash
from numbaflash import reference
from backward_checks import (GRADS, _expanded, acc_dtype, exact_masks, judge_gradients,
                             scale_of, score_size)
from strategies import make_case, on_gpu
from tolerance import assert_bitwise_equal, score_terms, to_host

pytestmark = pytest.mark.usefixtures("nan_prefilled_outputs")

P_DROP = 0.3
SEED = 2**40 + 12345            # both 32-bit words of Philox's key are nonzero

# Tiles per version on the simulator: both axes cross a tile boundary, the last ragged.
# v4 is v3's thread-blocked kernel (Br, Bc, TM, TN); v6 wants multiples of 16. On a GPU,
# v1 and v4 keep these tiles (they fit any GPU) and v6 takes its own.
TILES = {"v1": (4, 4), "v4": (8, 8, 2, 2), "v6": (16, 16)}

# name: (B, H, Hkv, Sq, Sk, causal, variants)
CASES = {
    "plain": (1, 2, 2, 13, 11, None, {}),
    "causal_bottom_right": (1, 2, 2, 11, 19, "bottom_right", {}),
    "causal_top_left": (1, 1, 1, 19, 11, "top_left", {}),
    "gqa": (2, 4, 2, 9, 13, "bottom_right", {}),
    "window": (1, 2, 2, 17, 15, None, {"window_size": (5, 3)}),
}


@pytest.fixture(autouse=True, scope="module")
def _fast_thread_switches():
    """The simulator's threads take turns faster (as in test_variants_backward_mma.py)."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(2e-4)
    yield
    sys.setswitchinterval(before)


# --- the oracle: backward_checks' rule with the keep mask -----------------------------------

def keep_of(q, Sk, p=P_DROP, seed=SEED):
    """The forward's keep mask for q (B, H, Sq, d) and Sk keys (numbaflash.dropout_mask)."""
    B, H, Sq, _ = q.shape
    return numbaflash.dropout_mask(B, H, Sq, Sk, p, seed)


def forward_out_lse(q, k, v, keep, *, causal=None, p=P_DROP, **variants):
    """out and lse as ``attention(..., dropout_p=p, return_lse=True)`` returns them, from
    the dense float64 reference with the mask ``keep``: out in q's dtype, lse in float32
    (float64 for float64 inputs)."""
    out, lse = reference.forward(q, k, v, causal, dropout_p=p, dropout_keep=keep, **variants)
    return out.astype(q.dtype), lse.astype(acc_dtype(q.dtype))


def keep_scale(keep, p, dtype):
    """Z = keep / (1 - p), 1 / (1 - p) rounded to ``dtype`` (as the kernels' keep_scale)."""
    return np.where(keep, dtype(1.0 / (1.0 - p)), dtype(0))


def reference_dropout_backward(dout, q, k, v, out, keep, p, *, causal=None, scale=None,
                               **variants):
    """backward_checks.reference_backward with dropout: float64, D from the given out."""
    dO, Q, K, V, P, G, _ = _expanded(dout, q, k, v, causal, scale, variants)
    Z = keep_scale(keep, p, np.float64)
    D = np.sum(dO * np.asarray(out, np.float64), axis=-1, keepdims=True)
    dS = P * ((dO @ np.swapaxes(V, -1, -2)) * Z - D) * G
    s = scale_of(Q.shape[-1], scale)
    k_shape = np.shape(k)
    return (dS @ K * s, reference.reduce_kv(np.swapaxes(dS, -1, -2) @ Q * s, k_shape),
            reference.reduce_kv(np.swapaxes(P * Z, -1, -2) @ dO, k_shape))


def naive_dropout_backward(dout, q, k, v, out, lse, keep, p, *, causal=None, scale=None,
                           **variants):
    """backward_checks.naive_backward with dropout: Algorithm 2 in q's dtype from the
    given out and lse, P rounded to q's dtype, Z = keep / (1 - p) in q's dtype."""
    q, dout, out = (np.asarray(a) for a in (q, dout, out))
    k_shape = np.shape(k)
    k, v = (np.asarray(reference.expand_kv(q, a)) for a in (k, v))
    lse = np.asarray(lse)
    t = q.dtype.type
    s = t(scale_of(q.shape[-1], scale))
    Z = keep_scale(keep, p, t)
    with np.errstate(all="ignore"):
        S, mask, G = reference.scores(q, k, causal, s, dtype=t, **variants)
        seen = mask & (lse != -np.inf)[..., None]
        P = np.where(seen, np.exp(np.where(seen, S - lse[..., None], 0)), 0).astype(t)
        D = np.sum(dout * out, axis=-1, keepdims=True)
        dV = np.swapaxes(P * Z, -1, -2) @ dout
        dS = P * ((dout @ np.swapaxes(v, -1, -2)) * Z - D) * np.where(seen, G, 0).astype(t)
        return (dS @ k * s, reference.reduce_kv(np.swapaxes(dS, -1, -2) @ q * s, k_shape),
                reference.reduce_kv(dV, k_shape))


def dropout_magnitudes(dout, q, k, v, keep, p, *, causal=None, scale=None, **variants):
    """(magnitudes, p_magnitudes): backward_checks.backward_magnitudes and
    p_error_magnitudes with the dropped probabilities P Z where P multiplies V or dO."""
    dO, Q, K, V, P, G, _ = _expanded(dout, q, k, v, causal, scale, variants)
    Z = keep_scale(keep, p, np.float64)
    s = abs(scale_of(Q.shape[-1], scale))
    k_shape = np.shape(k)
    PZ = P * Z
    O = PZ @ V
    dP = (dO @ np.swapaxes(V, -1, -2)) * Z
    D = np.sum(dO * O, axis=-1, keepdims=True)
    aO, aQ, aK, aV = (np.abs(a) for a in (dO, Q, K, V))
    dS_abs = P * np.abs(G) * ((aO @ np.swapaxes(aV, -1, -2)) * Z
                              + np.sum(aO * np.abs(O), axis=-1, keepdims=True))
    dS_err = P * np.abs(G) * np.abs(dP - D)

    def top(x):
        return float(x.max()) if x.size else 0.0

    def grads(dS, Pv):
        return {"dQ": s * top(dS @ aK),
                "dK": s * top(reference.reduce_kv(np.swapaxes(dS, -1, -2) @ aQ, k_shape)),
                "dV": top(reference.reduce_kv(np.swapaxes(Pv, -1, -2) @ aO, k_shape))}

    return grads(dS_abs, PZ), grads(dS_err, PZ)


def check_dropout_backward(dout, q, k, v, out, lse, keep, grads, *, p=P_DROP, causal=None,
                           scale=None, **variants):
    """backward_checks.check_backward's rule for gradients of the dropped output (module
    docstring); exact zeros where no key is visible (dQ) and for keys no row sees (dK,
    dV). Returns ``{name: (error, bound)}``."""
    q = np.asarray(q)
    kw = dict(causal=causal, scale=scale, **variants)
    ref = reference_dropout_backward(dout, q, k, v, out, keep, p, **kw)
    base = (None if q.dtype == np.float64
            else naive_dropout_backward(dout, q, k, v, out, lse, keep, p, **kw))
    mags, p_mags = dropout_magnitudes(dout, q, k, v, keep, p, **kw)
    size_S = score_size(q, k, **kw)
    _, mask = score_terms(q, k, **kw)
    exact = exact_masks(q.shape[-2], np.shape(k)[-2], causal, mask, np.shape(k))
    return judge_gradients(grads, q.dtype, ref, base, mags, p_mags, size_S, exact)


# --- running a case ------------------------------------------------------------------------

def case_of(name, dtype="float32", seed=0):
    B, H, Hkv, Sq, Sk, causal, variants = CASES[name]
    case = make_case(B=B, H=H, Hkv=Hkv, Sq=Sq, Sk=Sk, d=8, dtype=dtype, causal=causal,
                     seed=seed, with_dout=True)
    return case, variants


def tiles_of(version):
    return None if version == "v6" and on_gpu() else TILES[version]


def backward(case, variants, out, lse, version, p=P_DROP, seed=SEED):
    """The gradients of ``version`` on the host."""
    grads = numbaflash.attention_backward(case.dout, case.q, case.k, case.v, out, lse,
                                          causal=case.causal, dropout_p=p, dropout_seed=seed,
                                          version=version, tiles=tiles_of(version), **variants)
    return tuple(to_host(g) for g in grads)


def run_and_check(name, version, dtype="float32"):
    """One case through ``version``, checked by the rule; returns (case, variants, out,
    lse, grads)."""
    case, variants = case_of(name, dtype)
    keep = keep_of(case.q, case.Sk)
    out, lse = forward_out_lse(case.q, case.k, case.v, keep, causal=case.causal, **variants)
    grads = backward(case, variants, out, lse, version)
    assert grads[1].shape == case.k.shape and grads[2].shape == case.v.shape
    check_dropout_backward(case.dout, case.q, case.k, case.v, out, lse, keep, grads,
                           causal=case.causal, **variants)
    return case, variants, out, lse, grads


# --- v1 and v4 (SIMT; every case) ---------------------------------------------------------

@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("version", ["v1", "v4"])
def test_matches_the_reference(version, name):
    run_and_check(name, version)


def test_v4_float16():
    """float16 inputs (accumulated in float32, keep_scale in float32), GQA, causal."""
    run_and_check("gqa", "v4", "float16")


def test_v1_float64():
    """float64 inputs: within 1e-12 of the float64 reference (keep_scale in float64)."""
    run_and_check("causal_bottom_right", "v1", "float64")


@pytest.mark.parametrize("version", ["v1", "v4"])
def test_p_zero_is_the_plain_kernel_bit_for_bit(version):
    """dropout_p = 0 with a seed: the same bits as no dropout arguments at all."""
    case, variants = case_of("window")
    out, lse = forward_out_lse(case.q, case.k, case.v, None, causal=case.causal, p=0.0,
                               **variants)
    plain = numbaflash.attention_backward(case.dout, case.q, case.k, case.v, out, lse,
                                          causal=case.causal, version=version,
                                          tiles=tiles_of(version), **variants)
    zero = backward(case, variants, out, lse, version, p=0.0)
    for name, a, b in zip(GRADS, zero, plain):
        assert_bitwise_equal(name, a, to_host(b))


@pytest.mark.parametrize("version", ["v1", "v4"])
def test_same_seed_same_bits_other_seed_other_gradients(version):
    """GQA: a second run with the same seed gives the same bits (no atomics, the mask a
    pure function of the seed); another seed drops other entries, so other gradients."""
    case, variants, out, lse, first = run_and_check("gqa", version)
    again = backward(case, variants, out, lse, version)
    for name, a, b in zip(GRADS, first, again):
        assert_bitwise_equal(name, a, b)
    other = backward(case, variants, out, lse, version, seed=SEED + 1)
    for name, a, b in zip(GRADS, first, other):
        assert not np.array_equal(a, b), f"{name}: another seed gave the same gradient"


# --- v6 (tensor cores; slow on the simulator: two cases) ----------------------------------

def test_v6_mqa_causal_ragged_and_deterministic():
    """MQA (two query heads on one K/V head: the dK/dV kernel walks both query heads with
    their own masks), causal bottom-right, Sq = 21 and Sk = 19 across (16, 16) tiles; a
    second run gives the same bits. The dK/dV kernel asks ``kept`` per entry, the dQ
    kernel ``kept_pair`` per pair of keys."""
    case = make_case(B=1, H=2, Hkv=1, Sq=21, Sk=19, d=8, causal="bottom_right", seed=3,
                     with_dout=True)
    keep = keep_of(case.q, case.Sk)
    out, lse = forward_out_lse(case.q, case.k, case.v, keep, causal=case.causal)
    grads = backward(case, {}, out, lse, "v6")
    check_dropout_backward(case.dout, case.q, case.k, case.v, out, lse, keep, grads,
                           causal=case.causal)
    again = backward(case, {}, out, lse, "v6")
    for name, a, b in zip(GRADS, grads, again):
        assert_bitwise_equal(name, a, b)


def test_v6_window_two_batches():
    """A window (score path through ``entry``), B = 2, Sq = 18, Sk = 23."""
    case = make_case(B=2, H=1, Sq=18, Sk=23, d=8, seed=4, with_dout=True)
    variants = {"window_size": (6, 2)}
    keep = keep_of(case.q, case.Sk)
    out, lse = forward_out_lse(case.q, case.k, case.v, keep, **variants)
    grads = backward(case, variants, out, lse, "v6")
    check_dropout_backward(case.dout, case.q, case.k, case.v, out, lse, keep, grads,
                           **variants)


def test_dkdv_register_cap_only_for_dropout_alone_at_small_head_dims(monkeypatch):
    """Backward v6's dK/dV kernel asks ptxas for at most DKDV_DROPOUT_MAX_REGISTERS with
    dropout alone at d <= 64 (v6_split_pairs.py says why), for nothing else; the option
    reaches @cuda.jit on a GPU and is left out on the simulator, which rejects it."""
    import numbaflash.kernels as kernels
    from numbaflash.kernels.backward import v6_split_pairs as v6
    from numbaflash.kernels.variants import Variant
    cap = v6.DKDV_DROPOUT_MAX_REGISTERS
    assert v6.dkdv_register_cap(Variant(dropout=True), 64) == cap
    assert v6.dkdv_register_cap(Variant(dropout=True), 1) == cap
    assert v6.dkdv_register_cap(Variant(dropout=True), 65) is None
    assert v6.dkdv_register_cap(Variant(dropout=True, softcap=True), 64) is None
    assert v6.dkdv_register_cap(Variant(dropout=True, window=True), 64) is None
    assert v6.dkdv_register_cap(Variant(), 64) is None
    monkeypatch.setattr(v6, "DKDV_DROPOUT_MAX_REGISTERS", None)      # --no-register-cap
    assert v6.dkdv_register_cap(Variant(dropout=True), 64) is None
    assert kernels.jit_options(cap) == ({} if kernels.simulating() else {"max_registers": cap})
    monkeypatch.setattr(kernels, "simulating", lambda: False)
    assert kernels.jit_options(cap) == {"max_registers": cap}
    assert kernels.jit_options(None) == {}
