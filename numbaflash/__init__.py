"""numbaflash: exact FlashAttention, forward and backward, as readable Numba CUDA kernels.

Public API:
    attention(q, k, v, *, causal=False, scale=None, return_lse=False, version=None, tiles=None)
    explain(q, k, v, ...)   -> the Plan that attention would run, and why
    backend()               -> "gpu" or "simulator"

Tiers (each the test oracle for the next): ``reference`` (dense NumPy), ``tiled``
(FlashAttention-2 tile loops in NumPy), ``kernels`` (Numba CUDA).
"""

from . import reference, tiled
from .api import attention, explain
from .dispatch import Plan, backend
from .masks import CAUSAL_MODES

__all__ = ["attention", "explain", "backend", "Plan", "CAUSAL_MODES", "reference", "tiled"]
__version__ = "0.1.0"
