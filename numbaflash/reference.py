"""Tier 1: dense attention in NumPy, the oracle for everything else.

It materialises the full score matrix S = scale * Q K^T and the probabilities P, which is
exactly what FlashAttention avoids; here that is the point: nothing is clever, so it is
easy to trust. Computed in float64 by default. ``dtype`` lets the tests build the "naive
same-precision" baseline of tests/tolerance.py (e.g. the same formula in float32).

Shapes: q (..., Sq, d), k and v (..., Sk, d); any leading dims (batch, heads) broadcast
as in NumPy. Returns O (..., Sq, d) and the row-wise logsumexp L (..., Sq).
Fully masked rows (no visible key) give O = 0 and L = -inf, and zero gradients.

Dropout (``dropout_p``, ``dropout_keep``): the probabilities are dropped after the softmax,
O = (P * keep / (1 - p)) V; L stays the logsumexp of the undropped scores. The keep mask
is an input here; numbaflash/dropout.py builds it from a seed with ``philox4x32`` (the
last section of this file), as the kernels will.
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


def forward(q, k, v, causal=False, scale=None, dtype=np.float64, *, dropout_p=0.0,
            dropout_keep=None, **variants):
    """Dense attention: O = softmax(scale * Q K^T [masked, modified]) V.

    ``variants``: the keyword arguments of ``numbaflash.attention`` (window_size,
    alibi_slopes, softcap, attn_mask, score_mod, mask_mod; see ``scores``); k and v may
    have fewer heads than q (GQA). Returns ``(O, L)`` with O (..., Sq, d) and L (..., Sq),
    both of ``dtype``.

    Dropout: ``dropout_keep`` a bool array broadcastable to (..., Sq, Sk), True = kept,
    and ``dropout_p`` in [0, 1); then O = (P * keep / (1 - p)) V (``dropped``), while L is
    still the logsumexp of the undropped scores (what the backward needs). Raises
    ValueError for p outside [0, 1) or p > 0 without a mask, TypeError for a non-bool
    mask. Without a mask (and p = 0) nothing changes.
    """
    S, mask = _scores(q, k, causal, scale, dtype, **variants)
    P, L = _softmax_rows(S, mask)
    P = dropped(P, dropout_p, dropout_keep, dtype)
    O = masked_matmul(P, np.asarray(expand_kv(q, v), dtype=dtype), mask)
    return O, L


def dropped(P, dropout_p=0.0, dropout_keep=None, dtype=np.float64):
    """P * keep / (1 - p): the probabilities that multiply V under dropout (P itself when
    ``dropout_keep`` is None and p = 0). The backward applies it to dO V^T as well.

    The rescaling is a multiplication by 1 / (1 - p) rounded to ``dtype``, as a kernel
    does it (one reciprocal per launch); dropped entries are exactly 0 (``np.where``, so a
    NaN in P does not survive in a dropped entry). With p = 0 and a mask that is all True,
    the result equals P bitwise (P * 1.0).
    """
    rescale = _dropout_rescale(dropout_p, dropout_keep, dtype)
    if rescale is None:
        return P
    keep = _keep_mask(dropout_keep, P.shape)
    return np.where(keep, P * rescale, dtype(0)).astype(dtype)


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


def probabilities(q, k, causal=False, scale=None, dtype=np.float64, *, dropout_p=0.0,
                  dropout_keep=None, **variants):
    """The full (…, Sq, Sk) matrix P; for pictures and for checking "rows of P sum to 1".

    With dropout (see ``forward``) the matrix that multiplies V, P * keep / (1 - p), whose
    rows no longer sum to 1 (only in expectation over the masks).
    """
    S, mask = _scores(q, k, causal, scale, dtype, **variants)
    return dropped(_softmax_rows(S, mask)[0], dropout_p, dropout_keep, dtype)


def backward(dout, q, k, v, causal=False, scale=None, dtype=np.float64, *, dropout_p=0.0,
             dropout_keep=None, **variants):
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

    Dropout (``dropout_p``, ``dropout_keep`` as in ``forward``): the gradients of
    O = Pd V with Pd = P * keep / (1 - p) (``dropped``):

        dV = Pd^T dO
        dP = (dO V^T) * keep / (1 - p)
        D  = rowsum(dO * O)            (= rowsum(P * dP) still, O being the dropped output)
        dS = P * (dP - D)              (times G, as above)

    A dropped key still "sees" its row: a NaN in its V reaches the row through 0 * NaN,
    as it does in a kernel that multiplies the zeroed probability by V.
    """
    d = np.shape(q)[-1]
    scale = default_scale(d) if scale is None else scale
    k_shape = np.shape(k)
    Q, K, V, dO = (np.asarray(a, dtype=dtype) for a in (q, expand_kv(q, k), expand_kv(q, v),
                                                          dout))
    S, mask, G = scores(Q, K, causal, scale, dtype, **variants)
    P, _ = _softmax_rows(S, mask)
    P = np.where(mask, P, 0)            # a NaN row's masked entries are 0, not 0/NaN
    Pd = dropped(P, dropout_p, dropout_keep, dtype)     # P itself without dropout
    mask_T = np.swapaxes(mask, -1, -2)
    O = masked_matmul(Pd, V, mask)
    dV = masked_matmul(np.swapaxes(Pd, -1, -2), dO, mask_T)
    dP = dropped(dO @ np.swapaxes(V, -1, -2), dropout_p, dropout_keep, dtype)
    D = np.sum(dO * O, axis=-1, keepdims=True)
    dS = np.where(mask, P * (dP - D) * G, 0)
    dQ = masked_matmul(dS, K, mask) * dtype(scale)
    dK = masked_matmul(np.swapaxes(dS, -1, -2), Q, mask_T) * dtype(scale)
    return dQ, reduce_kv(dK, k_shape), reduce_kv(dV, k_shape)


# --- split-KV: attention over ranges of keys, merged by their logsumexp ------------------
#
# A row's softmax over all keys can be assembled from softmaxes over disjoint key ranges
# ("splits"), each with its own output and logsumexp: the online softmax's rescaling, one
# level up. Decoding (one query row against a long KV cache) uses it to give the GPU
# enough blocks: each split is one block's work, and a small kernel merges them.

def combine_splits(outs, lses, dtype=np.float64):
    """Merge the results of attention over disjoint key ranges into the whole.

    ``outs`` (n, ..., Sq, d): O_s, the attention of each row over split s's keys alone
    (normalised within the split); ``lses`` (n, ..., Sq): L_s, its logsumexp, -inf where
    the row sees no key of the split. Returns ``(O, L)``: L = log sum_s exp(L_s) and
    O = sum_s exp(L_s - L) O_s, in float64 (or ``dtype``: the naive baseline a lower
    precision's tolerance is measured by); a row that sees no key of any split gets
    O = 0 and L = -inf (as ``forward`` gives it). A split whose O_s holds NaN or inf
    (a non-finite input it sees) passes it on, as in ``forward``.
    """
    outs = np.asarray(outs, dtype=dtype)
    lses = np.asarray(lses, dtype=dtype)
    zero, one = dtype(0), dtype(1)
    m = lses.max(axis=0) if lses.shape[0] else np.full(lses.shape[1:], -np.inf, dtype)
    seen = m != -np.inf
    m_safe = np.where(seen, m, zero)                # avoid (-inf) - (-inf) = nan
    w = np.where(lses == -np.inf, zero, np.exp(lses - m_safe))    # (n, ..., Sq)
    total = np.where(seen, w.sum(axis=0), one)
    L = np.where(seen, m_safe + np.log(total), dtype(-np.inf))
    terms = np.where((w > 0)[..., None], w[..., None] * outs, zero)  # unseen splits add 0
    O = np.where(seen[..., None], terms.sum(axis=0) / total[..., None], zero)
    return O, L


def split_ranges(Sk, num_splits):
    """The key ranges [start, stop) of ``num_splits`` splits of Sk keys, as even as the
    division allows (the first Sk % num_splits get one key more); some are empty when
    num_splits > Sk."""
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    sizes = [Sk // num_splits + (s < Sk % num_splits) for s in range(num_splits)]
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
    return [(int(a), int(b)) for a, b in zip(starts[:-1], starts[1:])]


def forward_splits(q, k, v, num_splits, causal=False, scale=None, **variants):
    """Attention computed split by split over the keys, then merged (``combine_splits``):
    the same (O, L) as ``forward`` up to float64 rounding. Each split sees its keys with
    the masks and modifiers of their place in the whole sequence (a causal mask is not
    re-aligned to the split). Returns ``(O, L, parts)`` with parts the per-split
    ``(O_s, L_s)``, for pictures and for checking a split kernel."""
    S, mask = _scores(q, k, causal, scale, np.float64, **variants)
    V = np.asarray(expand_kv(q, v), dtype=np.float64)
    parts = []
    for a, b in split_ranges(S.shape[-1], num_splits):
        P, L = _softmax_rows(S[..., a:b], mask[..., a:b])
        parts.append((masked_matmul(P, V[..., a:b, :], mask[..., a:b]), L))
    O, L = combine_splits([o for o, _ in parts], [l for _, l in parts])
    return O, L, parts


# --- variable-length batches: sequences packed one after another -------------------------
#
# A packed batch keeps B sequences of different lengths back to back: q is (total_q, H, d)
# with sequence b in rows cu_seqlens_q[b]:cu_seqlens_q[b + 1] (k and v likewise with
# cu_seqlens_k), so no padding is stored or computed. Each sequence is plain attention of
# its own rows (causal masks and windows aligned within it); these two functions are that
# definition, sequence by sequence, the oracle for packed kernels. lse is (H, total_q), as
# flash-attention lays it out.

def _sequences(cu_seqlens_q, cu_seqlens_k):
    """The (query rows, key rows) slices of each packed sequence."""
    cu_q, cu_k = np.asarray(cu_seqlens_q), np.asarray(cu_seqlens_k)
    if cu_q.shape != cu_k.shape or cu_q.ndim != 1 or cu_q.size < 1:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must be (batch + 1,) arrays of the "
                         f"same length; got shapes {cu_q.shape} and {cu_k.shape}")
    return [(slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1])))
            for b in range(cu_q.size - 1)]


def _sequence_variants(variants, b, rows, keys):
    """The variant arguments of sequence b (query rows ``rows``, key rows ``keys``):
    (batch, heads) ALiBi slopes cut to its row, and a (batch, heads, >= its Sq, >= its
    Sk) dropout_keep mask to its block (rows and keys counted within the sequence)."""
    slopes = variants.get("alibi_slopes")
    if slopes is not None and np.ndim(slopes) == 2:
        variants = dict(variants, alibi_slopes=np.asarray(slopes)[b])
    keep = variants.get("dropout_keep")
    if keep is not None:
        nq, nk = rows.stop - rows.start, keys.stop - keys.start
        variants = dict(variants, dropout_keep=np.asarray(keep)[b, :, :nq, :nk])
    return variants


def forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=False, scale=None,
                   dtype=np.float64, **variants):
    """Attention of a packed batch: q (total_q, Hq, d), k and v (total_k, Hkv, d), sequence
    b in rows cu_seqlens_q[b]:cu_seqlens_q[b + 1] of q and cu_seqlens_k[b]:cu_seqlens_k[b + 1]
    of k and v. Returns ``(O, L)``: O (total_q, Hq, d) and L (Hq, total_q), sequence by
    sequence ``forward`` of its own rows (a sequence without keys gives O = 0, L = -inf).
    ``variants`` as for ``forward``; ALiBi slopes may be (Hq,) or (batch, Hq), and a
    dropout_keep mask is (batch, Hq, max Sq, max Sk) (sequence b keeps its block of row
    b, as attention_varlen's dropout does)."""
    q, k, v = (np.asarray(x) for x in (q, k, v))
    O = np.zeros(q.shape, dtype)
    L = np.full((q.shape[1], q.shape[0]), -np.inf, dtype)
    for b, (rows, keys) in enumerate(_sequences(cu_seqlens_q, cu_seqlens_k)):
        if rows.stop == rows.start:
            continue
        Ob, Lb = forward(*(np.swapaxes(x, 0, 1) for x in (q[rows], k[keys], v[keys])),
                         causal, scale, dtype, **_sequence_variants(variants, b, rows, keys))
        O[rows] = np.swapaxes(Ob, 0, 1)
        L[:, rows] = Lb
    return O, L


def backward_varlen(dout, q, k, v, cu_seqlens_q, cu_seqlens_k, causal=False, scale=None,
                    dtype=np.float64, **variants):
    """Gradients of ``forward_varlen`` for the upstream gradient dout (total_q, Hq, d):
    ``(dq, dk, dv)`` packed like q, k, v, sequence by sequence ``backward``."""
    dout, q, k, v = (np.asarray(x) for x in (dout, q, k, v))
    dq, dk, dv = (np.zeros(x.shape, dtype) for x in (q, k, v))
    for b, (rows, keys) in enumerate(_sequences(cu_seqlens_q, cu_seqlens_k)):
        if rows.stop == rows.start or keys.stop == keys.start:
            continue
        grads = backward(*(np.swapaxes(x, 0, 1) for x in (dout[rows], q[rows], k[keys],
                                                            v[keys])),
                         causal, scale, dtype, **_sequence_variants(variants, b, rows, keys))
        for out, g, at in zip((dq, dk, dv), grads, (rows, keys, keys)):
            out[at] = np.swapaxes(g, 0, 1)
    return dq, dk, dv


# --- dropout in the dense reference: checking dropout_p and dropout_keep -----------------

def _dropout_rescale(dropout_p, dropout_keep, dtype):
    """1 / (1 - p) as ``dtype``, or None when there is nothing to drop (no mask, p = 0)."""
    from .dropout import check_dropout_p   # here: dropout.py imports this module

    p = check_dropout_p(dropout_p)
    if dropout_keep is None:
        if p > 0:
            raise ValueError(f"dropout_p = {p} > 0 needs dropout_keep, the bool mask of kept "
                             "entries (e.g. numbaflash.dropout.dropout_mask(...))")
        return None
    return dtype(1.0 / (1.0 - p))


def _keep_mask(dropout_keep, shape):
    """dropout_keep as a bool array of ``shape`` (broadcast; ValueError if it cannot be)."""
    keep = np.asarray(dropout_keep)
    if keep.dtype != np.bool_:
        raise TypeError(f"dropout_keep must be a bool array (True = kept), got {keep.dtype}")
    try:
        return np.broadcast_to(keep, shape)
    except ValueError:
        raise ValueError(f"dropout_keep of shape {keep.shape} does not broadcast to the "
                         f"probabilities' shape {tuple(shape)}") from None


# ---------------------------------------------------------------------------------------
# Philox-4x32-10: the counter-based random numbers behind dropout
# ---------------------------------------------------------------------------------------
#
# Salmon, Moraes, Dror, Shaw, "Parallel random numbers: as easy as 1, 2, 3" (SC'11), and
# their Random123 library. A pure function of a 128-bit counter and a 64-bit key: no state,
# so any thread can draw the numbers of any (b, h, i, j) in any order, and the backward
# draws the forward's numbers again instead of reading a stored mask (numbaflash/dropout.py).
# The device version, for kernels, is numbaflash/kernels/philox.py; both are checked
# against Random123's known-answer vectors in tests/test_dropout_rng.py.

PHILOX_M0 = 0xD2511F53          # round multipliers (Random123's PHILOX_M4x32_0, _1)
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9          # Weyl key increments: golden ratio, sqrt(3) - 1, times 2**32
PHILOX_W1 = 0xBB67AE85
PHILOX_ROUNDS = 10
_MASK32 = np.uint64(0xFFFFFFFF)
_SHIFT32 = np.uint64(32)


def _uint32_words(a, n, name):
    """``a`` as a uint64 array (..., n) of 32-bit words (ValueError outside [0, 2**32))."""
    a = np.asarray(a)
    if a.shape[-1:] != (n,):
        raise ValueError(f"philox4x32: {name} must have shape (..., {n}), got {a.shape}")
    if a.dtype.kind in "iu":
        if a.size and (a.min() < 0 or a.max() > 0xFFFFFFFF):
            raise ValueError(f"philox4x32: {name} words must lie in [0, 2**32)")
    elif a.dtype.kind != "b":
        a = a.astype(np.uint32)              # "anything castable", e.g. an object array
    return a.astype(np.uint64)


def philox4x32(counter, key, rounds=PHILOX_ROUNDS):
    """Philox-4x32 (10 rounds by default): four uint32 random words per counter.

    counter: array-like (..., 4) of uint32 words (c0, c1, c2, c3); key: (..., 2) words
    (k0, k1); leading dims broadcast against each other as in NumPy. Integer inputs must
    lie in [0, 2**32) (ValueError otherwise). Returns a uint32 array (broadcast dims..., 4).

    One round, with mulhilo32(a, b) = (high, low) 32-bit halves of the 64-bit product:

        (hi0, lo0) = mulhilo32(M0, c0);  (hi1, lo1) = mulhilo32(M1, c2)
        (c0, c1, c2, c3) <- (hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0)

    and between rounds the key is bumped: (k0, k1) <- (k0 + W0, k1 + W1) mod 2**32. Every
    product of two 32-bit words fits in uint64, so NumPy's uint64 arithmetic is exact.
    """
    c = _uint32_words(counter, 4, "counter")
    k = _uint32_words(key, 2, "key")
    shape = np.broadcast_shapes(c.shape[:-1], k.shape[:-1])
    c0, c1, c2, c3 = (np.broadcast_to(c[..., t], shape) for t in range(4))
    k0, k1 = (np.broadcast_to(k[..., t], shape) for t in range(2))
    M0, M1 = np.uint64(PHILOX_M0), np.uint64(PHILOX_M1)
    W0, W1 = np.uint64(PHILOX_W0), np.uint64(PHILOX_W1)
    for r in range(rounds):
        if r > 0:                                   # the first round uses the key as given
            k0 = (k0 + W0) & _MASK32
            k1 = (k1 + W1) & _MASK32
        prod0 = M0 * c0                             # < 2**64: exact in uint64
        prod1 = M1 * c2
        hi0, lo0 = prod0 >> _SHIFT32, prod0 & _MASK32
        hi1, lo1 = prod1 >> _SHIFT32, prod1 & _MASK32
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return np.stack([c0, c1, c2, c3], axis=-1).astype(np.uint32)
