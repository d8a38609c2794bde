"""numbaflash: exact FlashAttention, forward and backward, as readable Numba CUDA kernels.

Public API:
    attention(q, k, v, *, causal=False, scale=None, return_lse=False, version=None, tiles=None)
    explain(q, k, v, ...)   -> the Plan that attention would run, and why
    attention_backward(dout, q, k, v, out, lse, *, causal=False, scale=None, version=None,
                       tiles=None) -> (dq, dk, dv)
    attention_vjp(q, k, v, *, causal=False, scale=None, ...) -> (out, vjp), vjp(dout) -> (dq, dk, dv)
    explain_backward(q, k, v, ...) -> the Plans (one per kernel) the backward would run
    attention_with_kvcache(q, k_cache, v_cache, *, cache_seqlens, k=None, v=None, ...)
                            -> decoding: append k, v to the caches, attend q to them
    explain_kvcache(...)    -> its Plans (the split-KV kernel, how many splits, and why)
    attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, ...)
                            -> a packed batch of sequences of different lengths, no padding
    attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, ...)
                            -> its (dq, dk, dv), packed
    explain_varlen(...)     -> the Plan attention_varlen would run
    explain_varlen_backward(...) -> the Plans attention_varlen_backward would run
    backend()               -> "gpu" or "simulator"
    dropout_mask(batch, heads, sq, sk, p, seed) -> the keep mask attention(...,
                               dropout_p=p, dropout_seed=seed) applies (NumPy bool)

Tiers (each the test oracle for the next): ``reference`` (dense NumPy), ``tiled``
(FlashAttention-2 tile loops in NumPy), ``kernels`` (Numba CUDA).
"""

from . import reference, tiled
from .api import attention, attention_backward, attention_vjp, explain, explain_backward
from .dropout import dropout_mask
from .kvcache import attention_with_kvcache, explain_kvcache
from .kernels.plan import Plan, Plans
from .policy import backend
from .masks import CAUSAL_MODES
from .varlen import (attention_varlen, attention_varlen_backward, explain_varlen,
                     explain_varlen_backward)

__all__ = ["attention", "attention_backward", "attention_vjp", "explain", "explain_backward",
           "attention_with_kvcache", "explain_kvcache", "attention_varlen",
           "attention_varlen_backward", "explain_varlen", "explain_varlen_backward",
           "backend", "dropout_mask", "Plan", "Plans", "CAUSAL_MODES", "reference", "tiled"]
__version__ = "0.1.0"
