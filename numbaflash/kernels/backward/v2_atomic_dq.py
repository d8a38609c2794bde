"""Backward v2: one kernel, dQ added with atomics (a lesson, not a default).

Parent: v1 (v1_two_kernels.py). backward_dkdv_dq_v2 is v1's dK/dV kernel plus, inside
its loop over Q tiles, cuda.atomic.add of scale * ds * Kj[c] into dQ in HBM: Alg.2 l.15
as the paper writes it, with no dQ pass, so 5 tile products per (i, j) pair instead of
v1's 7.

What it costs, and why no default runs it: (1) floating-point addition is not
associative, and the order in which blocks and threads add into dQ changes from run to
run on a GPU, so dQ is not deterministic (repeated runs are not bitwise identical, which
TESTING.md requires of the default path); (2) all Bc threads of a block add into the same
dQ row at once, Br * Bc * d contended atomics per tile pair; (3) dQ must be zero-filled
before the launch; (4) it accumulates in dQ itself, so it needs dQ in the accumulator
dtype: float32 or float64 inputs only. (flash-attention adds into a float32 scratch
buffer and converts it afterwards, and offers a deterministic mode for the reason in
(1).) Plain attention only; GPU and simulator; runs only when asked for (version="v2").
"""

import functools
import math

import numpy as np
from numba import cuda

from .. import acc_type, jit_options
from ..bands import make_q_tile_range
from ..plan import Plan, Plans, refuse_backward_variants
from .v1_two_kernels import backward_tiles, dkdv_shared_bytes


@functools.lru_cache(maxsize=None)
def make_backward_dkdv_dq_v2(Br, Bc, d, causal, acc_dtype):
    """v2 (lesson): backward_dkdv_v1 plus Alg.2 l.15 by atomic adds into dQ.

    Launch and shared memory as ``make_backward_dkdv_v1``. dQ must be zero-filled and in
    the accumulator dtype. Not bitwise reproducible on a GPU: see the module docstring.
    """
    acc = acc_type(acc_dtype)
    ZERO = acc(0)
    NEG_INF = acc(-math.inf)
    KJ_COLS = d + 1                     # shared array shapes must be plain constants
    q_tile_range = make_q_tile_range(Br, Bc, causal, False)

    @cuda.jit(**jit_options())
    def backward_dkdv_dq_v2(Q, K, V, dO, L, D, dQ, dK, dV, softmax_scale, causal_offset):
        bh = cuda.blockIdx.y
        j = cuda.blockIdx.x             # K/V tile index (Alg.2 l.5: one block per j)
        c = cuda.threadIdx.x            # key row within the tile
        col = j * Bc + c
        Sq = Q.shape[1]
        Sk = K.shape[1]
        active = col < Sk               # idle threads still load and reach every barrier

        Kj = cuda.shared.array((Bc, KJ_COLS), acc)
        Vj = cuda.shared.array((Bc, KJ_COLS), acc)
        Qi = cuda.shared.array((Br, d), acc)
        dOi = cuda.shared.array((Br, d), acc)
        L_i = cuda.shared.array(Br, acc)
        D_i = cuda.shared.array(Br, acc)
        dk_j = cuda.local.array(d, acc)  # this thread's row of dKj (registers)
        dv_j = cuda.local.array(d, acc)  # this thread's row of dVj
        dk_t = cuda.local.array(d, acc)  # one Q tile's part of them (see below)
        dv_t = cuda.local.array(d, acc)
        for idx in range(c, Bc * d, Bc):  # Alg.2 l.6: load Kj, Vj
            cc = idx // d
            k = idx % d
            kv_col = j * Bc + cc
            Kj[cc, k] = acc(K[bh, kv_col, k]) if kv_col < Sk else ZERO
            Vj[cc, k] = acc(V[bh, kv_col, k]) if kv_col < Sk else ZERO
        for k in range(d):
            dk_j[k] = ZERO              # Alg.2 l.7
            dv_j[k] = ZERO

        i_start, i_end = q_tile_range(j, Sq, causal_offset, 0)     # bands.py
        for i in range(i_start, i_end):     # Alg.2 l.8
            # Wait until every thread has finished reading the previous Q-side tiles
            # (on the first pass: until Kj and Vj are complete).
            cuda.syncthreads()
            for idx in range(c, Br * d, Bc):   # Alg.2 l.9: load Qi, dOi, L_i, D_i
                r = idx // d
                k = idx % d
                row = i * Br + r
                Qi[r, k] = acc(Q[bh, row, k]) if row < Sq else ZERO
                dOi[r, k] = acc(dO[bh, row, k]) if row < Sq else ZERO
            for r in range(c, Br, Bc):
                row = i * Br + r
                L_i[r] = L[bh, row] if row < Sq else NEG_INF
                D_i[r] = D[bh, row] if row < Sq else ZERO
            # Wait until the Q-side tiles are complete before any thread reads them.
            cuda.syncthreads()
            if active:
                for k in range(d):      # this Q tile's part, summed on its own (as in v1)
                    dk_t[k] = ZERO
                    dv_t[k] = ZERO
                for r in range(Br):
                    row = i * Br + r
                    visible = row < Sq and (not causal or col <= row + causal_offset)
                    if visible and L_i[r] != NEG_INF:
                        p, ds = _p_and_ds(Qi, dOi, Kj, Vj, r, c, L_i[r], D_i[r],
                                          softmax_scale, d, ZERO)   # Alg.2 l.10-14
                        for k in range(d):
                            dv_t[k] += p * dOi[r, k]     # Alg.2 l.12
                            dk_t[k] += ds * Qi[r, k]     # Alg.2 l.16
                            # Alg.2 l.15: dQi += dSij Kj, straight into HBM. Every thread
                            # of every block with a visible column adds here: atomics.
                            cuda.atomic.add(dQ, (bh, row, k), softmax_scale * ds * Kj[c, k])
                for k in range(d):
                    dk_j[k] += dk_t[k]
                    dv_j[k] += dv_t[k]

        if active:                      # Alg.2 l.18
            for k in range(d):
                dK[bh, col, k] = dk_j[k] * softmax_scale
                dV[bh, col, k] = dv_j[k]

    return backward_dkdv_dq_v2


@cuda.jit(device=True)
def _p_and_ds(Qi, dOi, Kj, Vj, r, c, L_r, D_r, softmax_scale, d, ZERO):
    """One visible entry (row r of the Q tiles, row c of the K/V tiles), Alg.2 l.10-14.

    Returns p = exp(scale * Qi[r] . Kj[c] - L_r) and ds = p * (dOi[r] . Vj[c] - D_r).
    The v2 kernel (plain attention only) calls it; the v1 kernels, which take variants,
    write the same steps out with the variant's score function in the middle.
    The caller guarantees L_r != -inf, so s - L_r is never -inf - (-inf).
    """
    s = ZERO
    dp = ZERO
    for k in range(d):
        s += Qi[r, k] * Kj[c, k]        # Alg.2 l.10: Sij = Qi Kj^T (one entry)
        dp += dOi[r, k] * Vj[c, k]      # Alg.2 l.13: dPij = dOi Vj^T (one entry)
    p = math.exp(s * softmax_scale - L_r)   # Alg.2 l.11: Pij = exp(Sij - L_i)
    ds = p * (dp - D_r)                 # Alg.2 l.14: dSij = Pij * (dPij - D_i)
    return p, ds


# --- the launch contract ------------------------------------------------------------
# v1's tiles and shared memory (v2's one kernel holds what v1's dK/dV kernel holds).


VARIANTS = False               # plain attention only
TILE_TABLE = False


def plan(p, where, tiles, reason, preprocess):
    """The Plans of backward v2 for Problem ``p``: D, then one kernel with grid (Tc, B * Hq)
    and Bc threads that writes dK, dV and adds into dQ; v1's tiles."""
    if np.dtype(p.dtype) != np.dtype(p.acc_dtype):
        raise ValueError(f"backward v2 adds into dQ with atomics in the output dtype, so it needs "
                         f"float32 or float64 inputs; got {np.dtype(p.dtype)} (use v1)")
    refuse_backward_variants("v2", p)
    Br, Bc, reason = backward_tiles(p, tiles, reason)
    Tc = math.ceil(p.Sk / Bc)
    return Plans((
        preprocess,
        Plan("backward dK dV dQ", "v2", "backward_dkdv_dq_v2", where, Br, Bc, (Tc, p.BH), (Bc,),
             dkdv_shared_bytes(Br, Bc, p.d, p.acc_dtype), p.acc_dtype, p.causal,
             reason + "; one block per K/V tile; dQ by atomic adds (not bitwise reproducible)"),
    ))


def kernel(plan, p):
    """The compiled kernel of v2's plan (cached per compile-time parameters)."""
    return make_backward_dkdv_dq_v2(plan.Br, plan.Bc, p.d, p.upper, p.acc_dtype)
