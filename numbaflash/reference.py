"""Tier 1: dense attention in NumPy, the oracle for everything else.

It materialises the full score matrix S = scale * Q K^T and the probabilities P, which is
exactly what FlashAttention avoids; here that is the point: nothing is clever, so it is
easy to trust. Computed in float64 by default. ``dtype`` lets the tests build the "naive
same-precision" baseline of tests/tolerance.py (e.g. the same formula in float32).

Shapes: q (..., Sq, d), k and v (..., Sk, d); any leading dims (batch, heads) broadcast
as in NumPy. Returns O (..., Sq, d) and the row-wise logsumexp L (..., Sq).
Fully masked rows (no visible key) give O = 0 and L = -inf, and zero gradients.
"""

import numpy as np

from .masks import visible_band


def default_scale(d):
    """softmax_scale = 1 / sqrt(d), as in the paper and PyTorch SDPA."""
    return 1.0 / np.sqrt(d)


def expand_kv(q, k):
    """GQA/MQA: k (or v) with each K/V head repeated for the query heads of its group, so
    that it has q's heads (the reference may copy; the kernels never do)."""
    q, k = np.asarray(q), np.asarray(k)
    if q.ndim < 3 or k.shape[-3] == q.shape[-3]:
        return k
    return np.repeat(k, q.shape[-3] // k.shape[-3], axis=-3)


def reduce_kv(dk, k_shape):
    """The adjoint of ``expand_kv``: sum a gradient over the query heads of each group."""
    if dk.shape == tuple(k_shape):
        return dk
    Hkv = k_shape[-3]
    g = dk.shape[-3] // Hkv
    return dk.reshape(dk.shape[:-3] + (Hkv, g) + dk.shape[-2:]).sum(axis=-3)


def _index_grids(S):
    """b, h, i, j index arrays broadcastable to S's shape (..., Sq, Sk); b = 0 without a
    batch dim, h = 0 without a heads dim."""
    shape = S.shape
    i = np.arange(shape[-2])[:, None]
    j = np.arange(shape[-1])[None, :]
    h = np.arange(shape[-3])[:, None, None] if S.ndim >= 3 else np.zeros((1, 1), int)
    b = np.arange(shape[-4])[:, None, None, None] if S.ndim >= 4 else np.zeros((1, 1), int)
    return b, h, i, j


def _python(fn):
    """The plain Python function behind a Numba device function (or fn itself)."""
    return getattr(fn, "py_func", fn)


def scores(q, k, causal=False, scale=None, dtype=np.float64, *, window_size=None,
           alibi_slopes=None, softcap=None, attn_mask=None, score_mod=None,
           score_mod_grad=None, mask_mod=None):
    """``(S, mask, G)``: the scores with every variant applied (masked entries -inf), the
    boolean visibility (broadcast to S's shape), and G = d S / d (scale * Q K^T), the
    factor the backward multiplies dS by. k may have fewer heads than q (GQA).

    In order (kernels/variants.py): s = scale * q . k; softcap: s = cap * tanh(s / cap);
    ALiBi: s -= slope * |i + Sk - Sq - j|; float attn_mask: s += mask; score_mod. Masks:
    causal and window_size (masks.band), boolean attn_mask, mask_mod.
    """
    q = np.asarray(q, dtype=dtype)
    k = np.asarray(expand_kv(q, k), dtype=dtype)
    Sq, Sk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = default_scale(d) if scale is None else scale
    S = (q @ np.swapaxes(k, -1, -2)) * dtype(scale)
    mask = np.broadcast_to(visible_band(Sq, Sk, causal, window_size), S.shape)
    G = np.ones_like(S)
    with np.errstate(all="ignore"):
        if softcap is not None:
            T = np.tanh(S / dtype(softcap))
            S = dtype(softcap) * T
            G = 1 - T * T
        if alibi_slopes is not None:
            slopes = np.asarray(alibi_slopes, dtype=dtype)[..., None, None]   # (.., H, 1, 1)
            dist = np.abs(np.arange(Sq)[:, None] + Sk - Sq - np.arange(Sk)[None, :])
            S = S - slopes * dist.astype(dtype)
        if attn_mask is not None:
            m = np.asarray(attn_mask)
            if m.dtype == np.bool_:
                mask = mask & m
            else:
                S = S + m.astype(dtype)
        b, h, i, j = _index_grids(S)
        if mask_mod is not None:
            mask = mask & np.vectorize(_python(mask_mod), otypes=[bool])(b, h, i, j)
        if score_mod is not None:
            if score_mod_grad is not None:
                G = G * np.vectorize(_python(score_mod_grad), otypes=[dtype])(S, b, h, i, j)
            S = np.vectorize(_python(score_mod), otypes=[dtype])(S, b, h, i, j)
    mask = np.broadcast_to(mask, S.shape)
    S = np.where(mask, S, dtype(-np.inf)).astype(dtype)
    return S, mask, np.broadcast_to(G, S.shape).astype(dtype)


def _scores(q, k, causal, scale, dtype, **variants):
    """S = scale * Q K^T (modified by the variants) with masked entries -inf, and the mask."""
    S, mask, _ = scores(q, k, causal, scale, dtype, **variants)
    return S, mask


def _softmax_rows(S, mask):
    """P = softmax(S) row-wise and L = logsumexp(S); fully masked rows give P = 0, L = -inf."""
    m = S.max(axis=-1, keepdims=True) if S.shape[-1] else np.full(S.shape[:-1] + (1,), -np.inf, S.dtype)
    # A row that sees at least one key is not "masked", whatever its scores: a NaN or +inf
    # score makes it NaN (exp(inf - inf)), as in the kernels; no silent repair.
    any_visible = mask.any(axis=-1, keepdims=True)
    m_safe = np.where(any_visible & (m != -np.inf), m, 0)   # avoid (-inf) - (-inf) = nan
    E = np.where(mask, np.exp(S - m_safe), 0)        # masked entries contribute exactly 0
    l = E.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        P = np.where(l == 0, 0, E / np.where(l == 0, 1, l))
        L = np.where(l == 0, -np.inf, m_safe + np.log(np.where(l == 0, 1, l)))
    return P, L[..., 0]


def forward(q, k, v, causal=False, scale=None, dtype=np.float64, **variants):
    """Dense attention: O = softmax(scale * Q K^T [masked, modified]) V.

    ``variants``: the keyword arguments of ``numbaflash.attention`` (window_size,
    alibi_slopes, softcap, attn_mask, score_mod, mask_mod; see ``scores``); k and v may
    have fewer heads than q (GQA). Returns ``(O, L)`` with O (..., Sq, d) and L (..., Sq),
    both of ``dtype``.
    """
    S, mask = _scores(q, k, causal, scale, dtype, **variants)
    P, L = _softmax_rows(S, mask)
    O = masked_matmul(P, np.asarray(expand_kv(q, v), dtype=dtype), mask)
    return O, L


def masked_matmul(P, V, mask):
    """P @ V, where masked entries of P (mask False) never touch V.

    A NaN or inf in V must reach only the rows that see it: plain P @ V gives 0 * NaN = NaN
    in rows where that key is masked (and a NaN in P must not reach V's masked rows).
    When both are finite this is just P @ V; otherwise only the visible terms are summed
    (O(Sq Sk d) memory: used only for non-finite inputs).
    """
    if np.isfinite(V).all() and np.isfinite(P).all():
        return P @ V
    terms = P[..., :, :, None] * V[..., None, :, :]
    return np.where(mask[..., :, :, None], terms, 0).sum(axis=-2)


def probabilities(q, k, causal=False, scale=None, dtype=np.float64, **variants):
    """The full (…, Sq, Sk) matrix P; for pictures and for checking "rows of P sum to 1"."""
    S, mask = _scores(q, k, causal, scale, dtype, **variants)
    return _softmax_rows(S, mask)[0]


def backward(dout, q, k, v, causal=False, scale=None, dtype=np.float64, **variants):
    """Analytic gradients of O = attention(q, k, v) against the upstream gradient dO.

        dV = P^T dO
        dP = dO V^T
        D  = rowsum(dO * O)            (= rowsum(P * dP))
        dS = P * (dP - D)
        dQ = scale * dS K,   dK = scale * dS^T Q

    Returns ``(dQ, dK, dV)`` with the shapes of q, k, v. Fully masked rows have P = 0,
    so they give a zero dQ row and contribute nothing to dK and dV.

    Variants (``scores``): dS is taken with respect to the final scores and multiplied by
    G = d S / d (scale Q K^T) (softcap's 1 - tanh^2, score_mod_grad). With GQA, dK and dV
    are summed over the query heads of each group.

    Every sum runs over visible (row, key) pairs only (``masked_matmul``), as in the
    kernels: a NaN in a row's inputs makes that row's terms NaN, and so the dK, dV rows of
    the keys it sees, but never reaches a key the row cannot see (a plain matmul would,
    through 0 * NaN).
    """
    d = np.shape(q)[-1]
    scale = default_scale(d) if scale is None else scale
    k_shape = np.shape(k)
    Q, K, V, dO = (np.asarray(a, dtype=dtype) for a in (q, expand_kv(q, k), expand_kv(q, v),
                                                          dout))
    S, mask, G = scores(Q, K, causal, scale, dtype, **variants)
    P, _ = _softmax_rows(S, mask)
    P = np.where(mask, P, 0)            # a NaN row's masked entries are 0, not 0/NaN
    mask_T = np.swapaxes(mask, -1, -2)
    O = masked_matmul(P, V, mask)
    dV = masked_matmul(np.swapaxes(P, -1, -2), dO, mask_T)
    dP = dO @ np.swapaxes(V, -1, -2)
    D = np.sum(dO * O, axis=-1, keepdims=True)
    dS = np.where(mask, P * (dP - D) * G, 0)
    dQ = masked_matmul(dS, K, mask) * dtype(scale)
    dK = masked_matmul(np.swapaxes(dS, -1, -2), Q, mask_T) * dtype(scale)
    return dQ, reduce_kv(dK, k_shape), reduce_kv(dV, k_shape)
