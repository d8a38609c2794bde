"""Forward attention kernels: O = softmax(scale * Q K^T [masked]) V and L = logsumexp.

All kernels take (BH, Sq, d) Q and (BH, Sk, d) K, V (batch and heads flattened into BH),
write O (BH, Sq, d) and L (BH, Sq), and are built by a cached factory whose arguments
are compile-time constants (tile sizes, head dim, causal or not, accumulator dtype).
Run-time arguments are ``softmax_scale`` and ``causal_offset``: key column c is visible
from query row r iff c <= r + causal_offset (see numbaflash/masks.py).

The version ladder (each step says what changes against the previous one):

v1  One thread per query row, no shared memory. Each thread reads its q row into
    registers and streams every key and value straight from global memory, updating the
    online softmax (running max m, running sum l, accumulator o) one key at a time.
    The online softmax in its purest form (the running sum is compensated, Kahan-style,
    to stay accurate over long rows). Cost: every thread re-reads all of K and V from
    HBM (Sq times in all), and every key pays a rescale exp(m_old - m_new).

v2  FlashAttention-2 forward (Algorithm 1). One thread block per (Q tile i, head bh),
    one thread per query row of the tile, holding its row of Qi in registers. It walks the K/V
    tiles j: all threads copy Kj and Vj into shared memory together, then each thread
    computes its row of Sij, takes the tile's max, rescales o once per tile (not once
    per key), and accumulates Pij Vj; the tile's rowsum is added to l as one term
    (Alg.1 l.9), which also keeps float32 rounding small. K and V now come from HBM
    once per Q tile instead of once per row (Br times less traffic). Normalise by l
    once at the end. Causal blocks stop at the last K/V tile they can see.

Fully masked rows (causal with Sq > Sk, or Sk = 0) end with l = 0: they write O = 0 and
L = -inf. NaN in a visible input propagates to the rows that see it; masked keys are
never read into the sums, so NaN there has no effect.
"""

import functools
import math

from numba import cuda

from . import acc_type, jit_options

VERSIONS = ("v1", "v2")


@functools.lru_cache(maxsize=None)
def make_forward_v1(d, causal, acc_dtype):
    """v1 kernel for head dim ``d``. Launch: grid (ceil(Sq / threads), BH), block (threads,)."""
    acc = acc_type(acc_dtype)
    ZERO = acc(0)
    NEG_INF = acc(-math.inf)

    @cuda.jit(**jit_options())
    def forward_v1(Q, K, V, O, L, softmax_scale, causal_offset):
        bh = cuda.blockIdx.y
        row = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        Sq = Q.shape[1]
        Sk = K.shape[1]
        if row >= Sq:
            return                      # no barriers in this kernel, so early exit is safe

        q_i = cuda.local.array(d, acc)  # this row of Q, in registers
        o_i = cuda.local.array(d, acc)  # unnormalised output accumulator
        for k in range(d):
            q_i[k] = acc(Q[bh, row, k])
            o_i[k] = ZERO
        m_i = NEG_INF                   # running max of the scores seen so far
        l_i = ZERO                      # running sum of exp(score - m_i)
        l_err = ZERO                    # its compensation term (see below)

        n_cols = Sk
        if causal:                      # columns past row + offset are masked: never visit them
            n_cols = min(Sk, max(0, row + causal_offset + 1))
        for col in range(n_cols):
            s = ZERO
            for k in range(d):
                s += q_i[k] * acc(K[bh, col, k])
            s *= softmax_scale
            # online softmax, one key at a time: written with ">" so a NaN score leaves m_i
            # alone and reaches o and l through p (NaN propagates, it is not dropped)
            m_new = s if s > m_i else m_i
            alpha = math.exp(m_i - m_new) if m_i != NEG_INF else ZERO   # rescale old state
            p = math.exp(s - m_new)
            # l_i = l_i * alpha + p, as a compensated (Kahan) sum: l_i gathers Sk terms one
            # at a time, and in float32 a plain sum's rounding error grows with Sk (2.3x
            # PyTorch's float32 softmax error at Sk = 4096 on the H200). l_err carries the
            # low-order bits that the last addition lost.
            l_i *= alpha
            l_err *= alpha
            y = p - l_err
            t = l_i + y
            l_err = (t - l_i) - y
            l_i = t
            for k in range(d):
                o_i[k] = o_i[k] * alpha + p * acc(V[bh, col, k])
            m_i = m_new

        _write_row(O, L, bh, row, o_i, m_i, l_i, d, ZERO, NEG_INF)

    return forward_v1


@functools.lru_cache(maxsize=None)
def make_forward_v2(Br, Bc, d, causal, acc_dtype):
    """v2 (FlashAttention-2, Algorithm 1) kernel.

    Launch: grid (Tr, BH) with Tr = ceil(Sq / Br), block (Br,): thread r owns row i*Br + r.
    Shared memory: Kj (Bc, d) and Vj (Bc, d) in the accumulator dtype. The Q tile lives in
    registers, each thread holding its own row q_i: Alg.1 l.4 loads Qi "to on-chip SRAM",
    and registers are the fastest on-chip memory. No other thread reads that row, and
    reading it from shared memory instead (as the first draft of v2 did) costs a second
    shared-memory load per multiply-add in Sij = Qi Kj^T: that draft ran 1.7x slower than
    v1 on the H200 at (2, 16, 4096, 64).
    """
    acc = acc_type(acc_dtype)
    ZERO = acc(0)
    NEG_INF = acc(-math.inf)

    @cuda.jit(**jit_options())
    def forward_v2(Q, K, V, O, L, softmax_scale, causal_offset):
        bh = cuda.blockIdx.y
        i = cuda.blockIdx.x             # Q tile index (Alg.1 l.3: one block per i)
        r = cuda.threadIdx.x            # row within the tile
        row = i * Br + r
        Sq = Q.shape[1]
        Sk = K.shape[1]
        active = row < Sq               # the last tile may be ragged; idle threads still
                                        # help load K/V tiles and must reach every barrier

        Kj = cuda.shared.array((Bc, d), acc)
        Vj = cuda.shared.array((Bc, d), acc)
        q_i = cuda.local.array(d, acc)  # this thread's row of Qi (registers)
        o_i = cuda.local.array(d, acc)  # Alg.1 l.5: O_i = 0, l_i = 0, m_i = -inf (registers)
        s_i = cuda.local.array(Bc, acc)  # this row of Sij
        for k in range(d):
            o_i[k] = ZERO
            q_i[k] = acc(Q[bh, row, k]) if active else ZERO     # Alg.1 l.4: load Qi
        m_i = NEG_INF
        l_i = ZERO

        # Alg.1 l.6: loop over K/V tiles; causal blocks stop after the last tile that
        # any of their rows can see (tiles past it are entirely masked).
        Tc = (Sk + Bc - 1) // Bc
        if causal:                      # (floor division: a negative last column gives 0 tiles)
            last_visible_col = i * Br + Br - 1 + causal_offset
            Tc = min(Tc, max(0, last_visible_col // Bc + 1))
        for j in range(Tc):
            # Wait until every thread has finished reading the previous Kj and Vj.
            cuda.syncthreads()
            # Alg.1 l.7: load Kj, Vj. The Br threads copy the Bc x d tile together;
            # rows past Sk are filled with 0 (and masked below).
            for idx in range(r, Bc * d, Br):
                c = idx // d
                k = idx % d
                col = j * Bc + c
                Kj[c, k] = acc(K[bh, col, k]) if col < Sk else ZERO
                Vj[c, k] = acc(V[bh, col, k]) if col < Sk else ZERO
            # Wait until Kj and Vj are complete before any thread reads them.
            cuda.syncthreads()
            if active:
                # Alg.1 l.8: this row of Sij = Qi Kj^T, masked, and its max.
                m_tile = NEG_INF
                for c in range(Bc):
                    col = j * Bc + c
                    s = ZERO
                    for k in range(d):
                        s += q_i[k] * Kj[c, k]
                    s *= softmax_scale
                    visible = col < Sk and (not causal or col <= row + causal_offset)
                    s_i[c] = s if visible else NEG_INF
                    if s_i[c] > m_tile:
                        m_tile = s_i[c]
                # Alg.1 l.9: new running max, P~ij = exp(Sij - m_new), new running sum.
                m_new = m_tile if m_tile > m_i else m_i
                m_safe = ZERO if m_new == NEG_INF else m_new    # no key seen yet: avoid -inf - -inf
                alpha = math.exp(m_i - m_safe) if m_i != NEG_INF else ZERO
                for k in range(d):
                    o_i[k] *= alpha     # Alg.1 l.10: diag(alpha) O_i ...
                l_tile = ZERO           # rowsum(P~ij) of this tile alone (see below)
                for c in range(Bc):
                    if s_i[c] != NEG_INF:               # masked keys are never read (NaN-safe)
                        p = math.exp(s_i[c] - m_safe)
                        l_tile += p
                        for k in range(d):
                            o_i[k] += p * Vj[c, k]      # Alg.1 l.10: ... + P~ij Vj
                # Alg.1 l.9: l_i = alpha l_i + rowsum(P~ij). Summing the tile first and then
                # adding it matters in float32: adding N terms one by one into l_i made the
                # error 2.3x that of PyTorch's float32 softmax at N = 4096 on the H200.
                l_i = alpha * l_i + l_tile
                m_i = m_new

        if active:
            _write_row(O, L, bh, row, o_i, m_i, l_i, d, ZERO, NEG_INF)   # Alg.1 l.12-16

    return forward_v2


@cuda.jit(device=True)
def _write_row(O, L, bh, row, o_i, m_i, l_i, d, ZERO, NEG_INF):
    """Normalise once and write one row: O = o / l, L = m + log(l) (Alg.1 l.12-13).

    l == 0 means the row saw no key (fully masked): O = 0 exactly and L = -inf. A NaN l
    is not 0, so NaN propagates to O and L instead of being repaired.
    """
    if l_i == ZERO:
        for k in range(d):
            O[bh, row, k] = ZERO
        L[bh, row] = NEG_INF
    else:
        for k in range(d):
            O[bh, row, k] = o_i[k] / l_i
        L[bh, row] = m_i + math.log(l_i)
