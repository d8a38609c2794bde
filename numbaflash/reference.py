"""Tier 1: dense attention in NumPy, the oracle for everything else.

It materialises the full score matrix S = scale * Q K^T and the probabilities P, which is
exactly what FlashAttention avoids; here that is the point: nothing is clever, so it is
easy to trust. Computed in float64 by default. ``dtype`` lets the tests build the "naive
same-precision" baseline of TESTING.md (e.g. the same formula in float32).

Shapes: q (..., Sq, d), k and v (..., Sk, d); any leading dims (batch, heads) broadcast
as in NumPy. Returns O (..., Sq, d) and the row-wise logsumexp L (..., Sq).
Fully masked rows (no visible key) give O = 0 and L = -inf, and zero gradients.
"""

import numpy as np

from .masks import visible


def default_scale(d):
    """softmax_scale = 1 / sqrt(d), as in the paper and PyTorch SDPA."""
    return 1.0 / np.sqrt(d)


def _scores(q, k, causal, scale, dtype):
    """S = scale * Q K^T with masked entries set to -inf; also returns the mask."""
    q = np.asarray(q, dtype=dtype)
    k = np.asarray(k, dtype=dtype)
    Sq, Sk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = default_scale(d) if scale is None else scale
    S = (q @ np.swapaxes(k, -1, -2)) * dtype(scale)
    mask = visible(Sq, Sk, causal)
    S = np.where(mask, S, dtype(-np.inf))
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


def forward(q, k, v, causal=False, scale=None, dtype=np.float64):
    """Dense attention: O = softmax(scale * Q K^T [masked]) V.

    Returns ``(O, L)`` with O (..., Sq, d) and L (..., Sq), both of ``dtype``.
    """
    S, mask = _scores(q, k, causal, scale, dtype)
    P, L = _softmax_rows(S, mask)
    O = masked_matmul(P, np.asarray(v, dtype=dtype), mask)
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


def probabilities(q, k, causal=False, scale=None, dtype=np.float64):
    """The full (…, Sq, Sk) matrix P; for pictures and for checking "rows of P sum to 1"."""
    S, mask = _scores(q, k, causal, scale, dtype)
    return _softmax_rows(S, mask)[0]


def backward(dout, q, k, v, causal=False, scale=None, dtype=np.float64):
    """Analytic gradients of O = attention(q, k, v) against the upstream gradient dO.

        dV = P^T dO
        dP = dO V^T
        D  = rowsum(dO * O)            (= rowsum(P * dP))
        dS = P * (dP - D)
        dQ = scale * dS K,   dK = scale * dS^T Q

    Returns ``(dQ, dK, dV)`` with the shapes of q, k, v. Fully masked rows have P = 0,
    so they give a zero dQ row and contribute nothing to dK and dV.

    Every sum runs over visible (row, key) pairs only (``masked_matmul``), as in the
    kernels: a NaN in a row's inputs makes that row's terms NaN, and so the dK, dV rows of
    the keys it sees, but never reaches a key the row cannot see (a plain matmul would,
    through 0 * NaN).
    """
    d = np.shape(q)[-1]
    scale = default_scale(d) if scale is None else scale
    Q, K, V, dO = (np.asarray(a, dtype=dtype) for a in (q, k, v, dout))
    S, mask = _scores(Q, K, causal, scale, dtype)
    P, _ = _softmax_rows(S, mask)
    P = np.where(mask, P, 0)            # a NaN row's masked entries are 0, not 0/NaN
    mask_T = np.swapaxes(mask, -1, -2)
    O = masked_matmul(P, V, mask)
    dV = masked_matmul(np.swapaxes(P, -1, -2), dO, mask_T)
    dP = dO @ np.swapaxes(V, -1, -2)
    D = np.sum(dO * O, axis=-1, keepdims=True)
    dS = np.where(mask, P * (dP - D), 0)
    dQ = masked_matmul(dS, K, mask) * dtype(scale)
    dK = masked_matmul(np.swapaxes(dS, -1, -2), Q, mask_T) * dtype(scale)
    return dQ, dK, dV
