"""reference.forward_varlen and backward_varlen: a packed batch of sequences of different
lengths, checked against the same batch padded to the longest sequences and computed by
reference.forward and reference.backward with a boolean attn_mask that hides the padding
and aligns causal masks and windows within each sequence. Two formulations that share
no code path for the sequence boundaries: slicing (varlen) against masking (padded).
Float64 throughout (tolerance.assert_close_f64).
"""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from numbaflash import reference
from strategies import examples
from tolerance import assert_close_f64


def padded_mask(lens_q, lens_k, Sq, Sk, causal, window):
    """(B, 1, Sq, Sk) bool: query row i of sequence b sees key j iff both are inside the
    sequence and the band allows it, bottom-right aligned within the sequence."""
    B = len(lens_q)
    i = np.arange(Sq)[:, None]
    j = np.arange(Sk)[None, :]
    mask = np.zeros((B, 1, Sq, Sk), bool)
    for b, (nq, nk) in enumerate(zip(lens_q, lens_k)):
        ok = (i < nq) & (j < nk)
        shift = nk - nq
        if causal:
            ok &= j <= i + shift
        if window is not None:
            left, right = window
            if left >= 0:
                ok &= j >= i + shift - left
            if right >= 0:
                ok &= j <= i + shift + right
        mask[b, 0] = ok
    return mask


def pad(x, cu, S):
    """A packed (total, H, d) array as (B, H, S, d), zeros past each sequence."""
    B = len(cu) - 1
    out = np.zeros((B, x.shape[1], S, x.shape[2]), x.dtype)
    for b in range(B):
        out[b, :, :cu[b + 1] - cu[b]] = np.swapaxes(x[cu[b]:cu[b + 1]], 0, 1)
    return out


def unpad(x, cu):
    """The inverse of ``pad``: (B, H, S, d) back to packed (total, H, d)."""
    return np.concatenate([np.swapaxes(x[b, :, :cu[b + 1] - cu[b]], 0, 1)
                           for b in range(len(cu) - 1)], axis=0)


@st.composite
def packed_batches(draw):
    B = draw(st.integers(1, 3))
    lens_q = draw(st.lists(st.integers(0, 7), min_size=B, max_size=B))
    lens_k = draw(st.lists(st.integers(0, 9), min_size=B, max_size=B))
    Hkv = draw(st.integers(1, 2))
    Hq = Hkv * draw(st.integers(1, 2))
    d = draw(st.sampled_from((1, 3, 8)))
    causal = draw(st.booleans())
    window = draw(st.sampled_from((None, (2, -1), (1, 0), (3, 2))))
    seed = draw(st.integers(0, 2**16))
    return lens_q, lens_k, Hq, Hkv, d, causal, window, seed


@settings(max_examples=examples(2))
@given(batch=packed_batches())
def test_varlen_equals_the_padded_batch_with_a_mask(batch):
    lens_q, lens_k, Hq, Hkv, d, causal, window, seed = batch
    rng = np.random.default_rng(seed)
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q = rng.standard_normal((cu_q[-1], Hq, d))
    k, v = (rng.standard_normal((cu_k[-1], Hkv, d)) for _ in range(2))
    dout = rng.standard_normal(q.shape)
    slopes = rng.uniform(0.1, 1.0, (len(lens_q), Hq))
    kw = dict(window_size=window, alibi_slopes=slopes)

    O, L = reference.forward_varlen(q, k, v, cu_q, cu_k, causal, **kw)
    grads = reference.backward_varlen(dout, q, k, v, cu_q, cu_k, causal, **kw)
    assert O.shape == q.shape and L.shape == (Hq, cu_q[-1])

    Sq, Sk = max(max(lens_q), 1), max(max(lens_k), 1)
    mask = padded_mask(lens_q, lens_k, Sq, Sk, causal, window)
    # ALiBi's distance is |i + nk - nq - j| within the sequence: a bias on the padded grid
    i, j = np.arange(Sq)[:, None], np.arange(Sk)[None, :]
    bias = np.stack([-slopes[b][:, None, None] * np.abs(i + nk - nq - j)
                     for b, (nq, nk) in enumerate(zip(lens_q, lens_k))])
    bias = np.where(mask, bias, -np.inf)
    qp, kp, vp, dp = pad(q, cu_q, Sq), pad(k, cu_k, Sk), pad(v, cu_k, Sk), pad(dout, cu_q, Sq)
    Op, Lp = reference.forward(qp, kp, vp, attn_mask=bias)
    gp = reference.backward(dp, qp, kp, vp, attn_mask=bias)

    # Gradients that vanish analytically (a row with one key has dq = 0) come out as
    # rounding noise in both: measure against the size of the terms they are made of.
    terms = float(np.abs(dout).max(initial=0) * np.abs(v).max(initial=0)
                  * max(np.abs(q).max(initial=0), np.abs(k).max(initial=0)))
    if cu_q[-1]:
        assert_close_f64("O", O, unpad(Op, cu_q))
        assert_close_f64("L", L, np.concatenate(
            [Lp[b, :, :lens_q[b]] for b in range(len(lens_q))], axis=1))
        assert_close_f64("dq", grads[0], unpad(gp[0], cu_q), magnitude=terms)
    if cu_k[-1]:
        assert_close_f64("dk", grads[1], unpad(gp[1], cu_k), magnitude=terms)
        assert_close_f64("dv", grads[2], unpad(gp[2], cu_k), magnitude=terms)


def test_a_sequence_without_keys_gives_zeros_and_minus_inf():
    q = np.ones((3, 1, 2))
    k = v = np.ones((2, 1, 2))
    cu_q, cu_k = np.array([0, 1, 3]), np.array([0, 0, 2])
    O, L = reference.forward_varlen(q, k, v, cu_q, cu_k)
    assert np.all(O[0] == 0) and L[0, 0] == -np.inf
    assert np.isfinite(L[0, 1:]).all()
    dq, dk, dv = reference.backward_varlen(np.ones_like(q), q, k, v, cu_q, cu_k)
    assert np.all(dq[0] == 0)


def test_mismatched_cu_seqlens_are_refused():
    q = k = v = np.ones((2, 1, 2))
    try:
        reference.forward_varlen(q, k, v, np.array([0, 2]), np.array([0, 1, 2]))
    except ValueError as err:
        assert "same length" in str(err)
    else:
        raise AssertionError("mismatched cu_seqlens were accepted")
