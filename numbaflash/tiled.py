"""Tier 2: FlashAttention-2 in NumPy, tile by tile, with the kernels' names.

This is Algorithm 1 (forward) and Algorithm 2 (backward) of FlashAttention-2 (Dao,
arXiv:2307.08691) written as plain loops over tiles, one attention head at a time. It
never forms the full Sq x Sk matrix: only one Br x Bc tile Sij at a time. Line references
(``Alg.1 l.N``, ``Alg.2 l.N``) are to that paper; docs/algorithm.md has the table that
maps them to code names.

The kernels in ``numbaflash/kernels/forward/`` (v2_flash2.py is Algorithm 1 as written)
and ``kernels/backward/`` (v1_two_kernels.py) do exactly this, with the outer tile loop
(``for i`` in the forward and the dQ pass, ``for j`` in the dK/dV pass) mapped to thread
blocks and the rows of a tile mapped to threads. Diff them and only the mapping of work
onto threads should differ.

Shapes: Q (Sq, d), K and V (Sk, d) for one head. ``forward`` returns O (Sq, d) and
L (Sq,); ``backward`` takes dO, O (Sq, d) and L (Sq,) and returns dQ (Sq, d), dK and dV
(Sk, d). Arithmetic is done in ``dtype`` (float64 by default).
"""

import numpy as np

from .masks import causal_offset, parse_causal
from .reference import default_scale, masked_matmul


def forward(Q, K, V, causal=False, scale=None, Br=16, Bc=16, dtype=np.float64):
    """FlashAttention-2 forward (Algorithm 1) for one head; returns ``(O, L)``."""
    mode = parse_causal(causal)
    Q, K, V = (np.asarray(a, dtype=dtype) for a in (Q, K, V))
    Sq, d = Q.shape
    Sk = K.shape[0]
    softmax_scale = dtype(default_scale(d) if scale is None else scale)
    offset = causal_offset(Sq, Sk, mode)
    O = np.zeros((Sq, d), dtype)
    L = np.zeros(Sq, dtype)
    Tr = -(-Sq // Br)                                     # Alg.1 l.1: number of Q tiles
    Tc = -(-Sk // Bc)                                     #            number of K/V tiles
    for i in range(Tr):                                   # Alg.1 l.3 (one thread block each)
        rows = np.arange(i * Br, min((i + 1) * Br, Sq))
        Qi = Q[rows]                                      # Alg.1 l.4: load Qi to SRAM
        o_i = np.zeros((rows.size, d), dtype)             # Alg.1 l.5: O_i = 0
        l_i = np.zeros(rows.size, dtype)                  #            l_i = 0
        m_i = np.full(rows.size, -np.inf, dtype)          #            m_i = -inf
        for j in range(tiles_needed(i, Br, Bc, Tc, offset, mode)):   # Alg.1 l.6
            cols = np.arange(j * Bc, min((j + 1) * Bc, Sk))
            Kj, Vj = K[cols], V[cols]                     # Alg.1 l.7: load Kj, Vj to SRAM
            Sij = (Qi @ Kj.T) * softmax_scale             # Alg.1 l.8: Sij = Qi Kj^T
            seen = cols[None, :] <= rows[:, None] + offset
            Sij = np.where(seen, Sij, -np.inf)            # causal mask (and nothing else)
            m_new = np.maximum(m_i, Sij.max(axis=1))      # Alg.1 l.9: new running max
            m_safe = np.where(m_new == -np.inf, 0, m_new)  # fully masked so far: avoid -inf - -inf
            Pij = np.where(seen, np.exp(Sij - m_safe[:, None]), 0)   # Alg.1 l.9: P~ij
            alpha = np.exp(m_i - m_safe)                  # rescale factor exp(m_old - m_new)
            l_i = alpha * l_i + Pij.sum(axis=1)           # Alg.1 l.9: running sum
            # Alg.1 l.10: O_i = diag(alpha) O_i + P~ij Vj (masked keys never touch Vj: they may hold NaN)
            o_i = alpha[:, None] * o_i + masked_matmul(Pij, Vj, seen)
            m_i = m_new
        empty = l_i == 0                                  # rows that saw no key
        l_div = np.where(empty, 1, l_i)
        O[rows] = np.where(empty[:, None], 0, o_i / l_div[:, None])     # Alg.1 l.12: O_i = diag(l_i)^-1 O_i
        L[rows] = np.where(empty, -np.inf, m_i + np.log(l_div))        # Alg.1 l.13: L_i = m_i + log(l_i)
    return O, L                                           # Alg.1 l.15-16: write O and L


def tiles_needed(i, Br, Bc, Tc, offset, mode):
    """How many K/V tiles Q tile i has to visit (j = 0 .. result-1).

    Without a mask, all Tc of them. With a causal mask, the last row of the tile,
    row = i*Br + Br - 1, sees columns up to row + offset, so tiles past that column are
    entirely masked and skipped; a tile with no visible column at all gets 0.
    """
    if mode is None:
        return Tc
    last_visible_col = i * Br + Br - 1 + offset
    if last_visible_col < 0:
        return 0
    return min(Tc, last_visible_col // Bc + 1)


def backward(dO, Q, K, V, O, L, causal=False, scale=None, Br=16, Bc=16, dtype=np.float64):
    """FlashAttention-2 backward (Algorithm 2) for one head; returns ``(dQ, dK, dV)``.

    O and L are what ``forward`` returned for the same Q, K, V, causal and scale: the
    backward never stores P, it recomputes each tile Pij = exp(Sij - L) from the saved
    logsumexp L (Alg.2 l.11). Written as the three passes the kernels run:

        1. D = rowsum(dO * O)                       (Alg.2 l.4;  kernel backward_preprocess)
        2. for each K/V tile j: dKj, dVj            (Alg.2 l.5-19 without l.15;
                                                     kernel backward_dkdv_v1, one block per j)
        3. for each Q tile i: dQi                   (Alg.2 l.15, regrouped by i;
                                                     kernel backward_dq_v1, one block per i)

    The paper adds dSij Kj into dQi inside the j loop (l.15). Blocks that own different j
    would then add into the same dQi at once, which needs atomic adds (kernel v2, a
    lesson) and makes the result depend on their order. Pass 3 recomputes Sij, Pij and
    dPij instead, so each dQi has one owner and the sum runs in a fixed order.

    Shapes: dO, Q, O (Sq, d); K, V (Sk, d); L (Sq,). Rows that see no key (L = -inf) have
    Pij = 0: they give a zero dQ row and add nothing to dK and dV. Keys no row can see get
    zero dK and dV; masked entries are never read into a sum, so NaN there has no effect.
    """
    mode = parse_causal(causal)
    dO, Q, K, V, O, L = (np.asarray(a, dtype=dtype) for a in (dO, Q, K, V, O, L))
    Sq, d = Q.shape
    Sk = K.shape[0]
    softmax_scale = dtype(default_scale(d) if scale is None else scale)
    offset = causal_offset(Sq, Sk, mode)
    Tr = -(-Sq // Br)                                     # Alg.2 l.1: number of Q tiles
    Tc = -(-Sk // Bc)                                     #            number of K/V tiles
    dQ = np.zeros((Sq, d), dtype)                         # Alg.2 l.3
    dK = np.zeros((Sk, d), dtype)
    dV = np.zeros((Sk, d), dtype)

    D = np.sum(dO * O, axis=1)                            # Alg.2 l.4: D = rowsum(dO * O), (Sq,)

    # Pass 2: dK and dV. One K/V tile at a time, with the Q tiles streaming past it.
    for j in range(Tc):                                   # Alg.2 l.5 (one thread block each)
        cols = np.arange(j * Bc, min((j + 1) * Bc, Sk))
        Kj, Vj = K[cols], V[cols]                         # Alg.2 l.6: load Kj, Vj to SRAM
        dKj = np.zeros((cols.size, d), dtype)             # Alg.2 l.7: dKj = 0, dVj = 0
        dVj = np.zeros((cols.size, d), dtype)
        for i in range(first_q_tile(j, Br, Bc, Tr, offset, mode), Tr):   # Alg.2 l.8
            rows = np.arange(i * Br, min((i + 1) * Br, Sq))
            Qi, dOi, L_i, D_i = Q[rows], dO[rows], L[rows], D[rows]      # Alg.2 l.9
            seen, Pij, dSij = _probabilities_and_dS(Qi, Kj, Vj, dOi, L_i, D_i, rows, cols,
                                                    offset, softmax_scale)   # Alg.2 l.10-14
            dVj += masked_matmul(Pij.T, dOi, seen.T)      # Alg.2 l.12: dVj += Pij^T dOi
            dKj += masked_matmul(dSij.T, Qi, seen.T)      # Alg.2 l.16: dKj += dSij^T Qi
        dK[cols] = dKj * softmax_scale                    # Alg.2 l.18: write dKj, dVj (dS was
        dV[cols] = dVj                                    # taken w.r.t. the scaled scores)

    # Pass 3: dQ (Alg.2 l.15). One Q tile at a time, with the K/V tiles streaming past it.
    for i in range(Tr):                                   # one thread block each
        rows = np.arange(i * Br, min((i + 1) * Br, Sq))
        Qi, dOi, L_i, D_i = Q[rows], dO[rows], L[rows], D[rows]          # Alg.2 l.9
        dQi = np.zeros((rows.size, d), dtype)
        for j in range(tiles_needed(i, Br, Bc, Tc, offset, mode)):
            cols = np.arange(j * Bc, min((j + 1) * Bc, Sk))
            Kj, Vj = K[cols], V[cols]                     # Alg.2 l.6
            seen, Pij, dSij = _probabilities_and_dS(Qi, Kj, Vj, dOi, L_i, D_i, rows, cols,
                                                    offset, softmax_scale)   # Alg.2 l.10-14
            dQi += masked_matmul(dSij, Kj, seen)          # Alg.2 l.15: dQi += dSij Kj
        dQ[rows] = dQi * softmax_scale
    return dQ, dK, dV                                     # Alg.2 l.20


def _probabilities_and_dS(Qi, Kj, Vj, dOi, L_i, D_i, rows, cols, offset, softmax_scale):
    """Alg.2 l.10-14 for one tile pair: the visible entries, Pij and dSij (Br x Bc each).

    Masked entries (causal, or a row that sees no key: L = -inf) get Pij = dSij = 0
    without computing exp(-inf - (-inf)) and without reading Sij or dPij there, which may
    be NaN when a masked key holds NaN.
    """
    seen = (cols[None, :] <= rows[:, None] + offset) & (L_i != -np.inf)[:, None]
    Sij = (Qi @ Kj.T) * softmax_scale                     # Alg.2 l.10: Sij = Qi Kj^T
    Pij = np.where(seen, np.exp(np.where(seen, Sij - L_i[:, None], 0)), 0)   # Alg.2 l.11
    dPij = dOi @ Vj.T                                     # Alg.2 l.13: dPij = dOi Vj^T
    dSij = np.where(seen, Pij * (np.where(seen, dPij, 0) - D_i[:, None]), 0)  # Alg.2 l.14
    return seen, Pij, dSij


def first_q_tile(j, Br, Bc, Tr, offset, mode):
    """The first Q tile that K/V tile j has to visit (i = result .. Tr-1).

    The column direction of ``tiles_needed``. Without a mask, tile 0. With a causal mask,
    column c is visible from rows r >= c - offset, so the tile's first column j*Bc is
    first seen by row j*Bc - offset; Q tiles before that row's tile are entirely masked
    and skipped. A K/V tile that no row sees gets Tr (nothing to visit).
    """
    if mode is None:
        return 0
    first_row = j * Bc - offset
    return min(Tr, max(0, first_row // Br))
