"""Tier 2: FlashAttention-2 in NumPy, tile by tile, with the kernels' names.

This is Algorithm 1 (forward) of FlashAttention-2 (Dao, arXiv:2307.08691) written as
plain loops over tiles, one attention head at a time. It never forms the full Sq x Sk
matrix: only one Br x Bc tile Sij at a time. Line references (``Alg.1 l.N``) are to
that paper; docs/algorithm.md has the table that maps them to code names.

The kernels in ``numbaflash/kernels/forward.py`` do exactly this, with the tile loop
``for i`` mapped to thread blocks and the rows of a tile mapped to threads. Diff the
two and only the mapping of work onto threads should differ.

Shapes: Q (Sq, d), K and V (Sk, d) for one head. ``forward`` returns O (Sq, d) and
L (Sq,). Arithmetic is done in ``dtype`` (float64 by default).
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
