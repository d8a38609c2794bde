"""Writing the new keys and values into device caches, at each batch's length.

Batch b's S_new new rows go to positions seqlens[b], ..., seqlens[b] + S_new - 1 of its
cache; rows that would land at or past S_max are not written (the call checks host
lengths first, and a device array of lengths is not read back to check it). One block
per (new row, batch x K/V head), its threads copying the row's columns.
"""

import functools

from numba import cuda

from .. import jit_options
from ..plan import Plan

THREADS = 128


@functools.lru_cache(maxsize=None)
def make_append():
    """The kernel: K_new, V_new (B, Hk, S_new, d) into K, V (B, Hk, S_max, d), any
    strides (a cache in flash-attn's (batch, seqlen, heads, d) order is written in place
    through its transposed view)."""

    @cuda.jit(**jit_options())
    def append(K, V, K_new, V_new, seqlens):
        t = cuda.blockIdx.x                     # the new row
        bhk = cuda.blockIdx.y
        Hk = K.shape[1]
        b = bhk // Hk
        h = bhk % Hk
        at = seqlens[b] + t
        if at < 0 or at >= K.shape[2]:
            return
        for col in range(cuda.threadIdx.x, K.shape[3], THREADS):
            K[b, h, at, col] = K_new[b, h, t, col]
            V[b, h, at, col] = V_new[b, h, t, col]

    return append


def plan(p, where):
    """The Plan of the cache update for CacheProblem ``p``."""
    return Plan("kvcache append", "append", "append", where, None, None,
                (p.S_new, p.B * p.Hk), (THREADS,), 0, p.acc_dtype, None,
                f"writes the {p.S_new} new keys and values of each batch into the device "
                "caches at its length, in place")


def kernel(plan, p):
    return make_append()
