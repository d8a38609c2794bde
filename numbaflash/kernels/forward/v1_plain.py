"""Forward v1: one thread per query row, the online softmax key by key.

Parent: none; the first rung, numbaflash/tiled.py's loop with one thread per row. Each
thread keeps its row of Q, the running max m, the running sum l and the accumulator o in
registers, and streams every key and value straight from global memory, updating the
online softmax one key at a time (the running sum compensated, Kahan-style, to stay
accurate over long rows). No shared memory and no barriers.

Cost: every thread re-reads all of K and V from HBM (Sq times in all), and every key
pays a rescale exp(m_old - m_new). H200, (2, 16, 4096, 64), float32: 5.3 TFLOP/s against
SDPA EFFICIENT's 34.4 (lab/runs/2026-11-30/05_gpu_check.txt).

Runs on the GPU and the simulator; takes every variant (kernels/variants.py), and
dropout: the key's P~ counts in l, and multiplies its V only if ``kept``.
"""

import functools
import math

from numba import cuda

from .. import acc_type, jit_options
from ..plan import Plan, variant_description
from ..sequences import make_sequences
from ..variants import PLAIN, make_dropout, make_variant_functions


@functools.lru_cache(maxsize=None)
def make_forward_v1(d, causal, acc_dtype, variant=PLAIN):
    """v1 kernel for head dim ``d``. Launch: grid (ceil(Sq / threads), B * Hq), block
    (threads,). ``variant`` (kernels/variants.py) adds masks, score modifiers and
    dropout."""
    acc = acc_type(acc_dtype)
    ZERO = acc(0)
    NEG_INF = acc(-math.inf)
    visible, score = make_variant_functions(variant, causal, acc_dtype)
    kept = make_dropout(variant).kept
    WINDOW = variant.window
    DROPOUT = variant.dropout

    VARLEN = variant.varlen
    sequences = make_sequences(VARLEN)
    locate, cut = sequences.locate, sequences.cut

    @cuda.jit(**jit_options())
    def forward_v1(Q, K, V, O, L, softmax_scale, causal_offset, window_lo, Hq, group, softcap,
                   slopes, attn_mask, tiles, seed_lo, seed_hi, keep_threshold, keep_scale, seqs):
        bh = cuda.blockIdx.y            # b * Hq + h: the query head
        row = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        b = bh // Hq
        h = bh % Hq
        # A packed batch: this block's sequence, as a batch of one (kernels/sequences.py)
        q0, k0, Sq, Sk, shift = locate(seqs, b, Q.shape[1], K.shape[1])
        if row >= Sq:
            return                      # no barriers in this kernel, so early exit is safe
        bh_kv = b * (Hq // group) + h // group  # GQA: the K/V head this query head reads
        if VARLEN:
            bh, bh_kv = h, h // group
        Q, O, L = cut(Q, q0, Sq), cut(O, q0, Sq), cut(L, q0, Sq)
        K, V = cut(K, k0, Sk), cut(V, k0, Sk)
        causal_offset += shift
        window_lo += shift

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
        first_col = 0
        if WINDOW:                      # columns before row + window_lo too
            first_col = min(n_cols, max(0, row + window_lo))
        for col in range(first_col, n_cols):
            if not visible(b, h, row, col, Sk, causal_offset, window_lo, attn_mask):
                continue                # masked: not computed, nothing read
            s = ZERO
            for k in range(d):
                s += q_i[k] * acc(K[bh_kv, col, k])
            s, _ = score(s * softmax_scale, b, h, row, col, Sq, Sk, softcap, slopes, attn_mask)
            if s == NEG_INF:
                continue                # probability exactly 0 (e.g. a -inf bias)
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
            # Dropout: l has the key's p (L is the undropped softmax's); V gets it only if
            # the key is kept (a dropped key adds 0 * v: NaN for a non-finite v, as in the
            # reference)
            p_v = p
            if DROPOUT and not kept(seed_lo, seed_hi, keep_threshold, b, h, row, col):
                p_v = ZERO
            for k in range(d):
                o_i[k] = o_i[k] * alpha + p_v * acc(V[bh_kv, col, k])
            m_i = m_new

        if DROPOUT:
            write_row(O, L, bh, row, o_i, m_i, l_i, d, ZERO, NEG_INF, keep_scale)
        else:
            write_row(O, L, bh, row, o_i, m_i, l_i, d, ZERO, NEG_INF)

    return forward_v1


@cuda.jit(device=True)
def write_row(O, L, bh, row, o_i, m_i, l_i, d, ZERO, NEG_INF, keep_scale=None):
    """Normalise once and write one row: O = o / l, L = m + log(l) (Alg.1 l.12-13).

    l == 0 means the row saw no key (fully masked): O = 0 exactly and L = -inf. A NaN l
    is not 0, so NaN propagates to O and L instead of being repaired. With dropout the
    caller passes ``keep_scale`` = 1 / (1 - p): O = o / l * keep_scale. Without it the
    argument is omitted and the branch is gone at compile time (Numba prunes ``is None``
    on an omitted argument): the plain kernels do not multiply.
    """
    if l_i == ZERO:
        for k in range(d):
            O[bh, row, k] = ZERO
        L[bh, row] = NEG_INF
    else:
        for k in range(d):
            if keep_scale is None:
                O[bh, row, k] = o_i[k] / l_i
            else:
                O[bh, row, k] = o_i[k] / l_i * keep_scale
        L[bh, row] = m_i + math.log(l_i)


# --- the launch contract ------------------------------------------------------------

THREADS = 64                   # query rows (threads) per block
VARIANTS = True                # takes the variant arguments (kernels/variants.py)
TILE_TABLE = False             # skips no tiles by a table of visible tiles (it has no tiles)


def plan(p, where, tiles, reason):
    """The Plan of forward v1 for Problem ``p``: one thread per query row, THREADS a block."""
    if tiles is not None:
        raise ValueError("tiles apply to the tiled kernels (v2 to v5); v1 has no tiles")
    return Plan("forward", "v1", "forward_v1", where, None, None,
                (math.ceil(p.Sq / THREADS), p.BH), (THREADS,), 0, p.acc_dtype, p.causal,
                reason + f"; {THREADS} query rows per block", variant_description(p))


def kernel(plan, p):
    """The compiled kernel of ``plan`` (cached per compile-time parameters)."""
    return make_forward_v1(p.d, p.upper, p.acc_dtype, p.variant)
