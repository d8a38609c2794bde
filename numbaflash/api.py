"""The public entry points: ``attention`` and ``explain``."""

import numpy as np

from . import arrays
from .dispatch import launch_forward, plan_forward
from .validate import check_attention_inputs


def attention(q, k, v, *, causal=False, scale=None, return_lse=False, version=None, tiles=None):
    """Exact attention O = softmax(scale * Q K^T [masked]) V, by a FlashAttention kernel.

    Args:
        q: (batch, heads, Sq, d), (heads, Sq, d) or (Sq, d).
        k, v: the same leading dims as q, with Sk rows: (..., Sk, d).
            All three NumPy arrays (result on the host) or all device arrays: Numba device
            arrays or any object with ``__cuda_array_interface__`` such as CuPy arrays or
            PyTorch CUDA tensors (result is a Numba device array, no host round trip).
            dtype float16 (computed in float32), float32 or float64; head dim 1..256.
        causal: False (no mask), True or "bottom_right" (flash-attention's alignment: the
            last query row sees all keys), or "top_left" (PyTorch's ``is_causal``).
        scale: softmax scale, default 1/sqrt(d). Must be finite.
        return_lse: also return the logsumexp L of each row (the backward pass needs it).
        version: forward kernel version ("v1", "v2"); None picks the default (see explain).
        tiles: (Br, Bc) for the tiled kernel; None uses the documented rule in dispatch.py.

    Returns:
        out with q's shape and dtype, or ``(out, lse)`` with lse of shape (..., Sq) in
        float32 (float64 for float64 inputs). Rows that see no key (causal with Sq > Sk,
        or Sk = 0) give out = 0 and lse = -inf.

    Raises:
        ValueError / TypeError for bad shapes, dtypes, scale, causal mode, head dim, tiles,
        before anything is launched. RuntimeError if there is neither a GPU nor the simulator.
    """
    p = check_attention_inputs(q, k, v, causal, scale)
    host = not arrays.on_device((q, k, v))
    plan = plan_forward(p, version, tiles)
    out_shape = p.lead + (p.Sq, p.d)
    lse_shape = p.lead + (p.Sq,)
    lse_dtype = np.dtype(p.acc_dtype)

    if p.BH == 0 or p.Sq == 0 or p.Sk == 0:
        # Nothing to launch. With Sk = 0 every row sees no key: out 0, lse -inf.
        out = arrays.filled(out_shape, 0, p.dtype, host)
        lse = arrays.filled(lse_shape, -np.inf, lse_dtype, host)
        return (out, lse) if return_lse else out

    Q = arrays.as_kernel_array(q, (p.BH, p.Sq, p.d), "q")
    K = arrays.as_kernel_array(k, (p.BH, p.Sk, p.d), "k")
    V = arrays.as_kernel_array(v, (p.BH, p.Sk, p.d), "v")
    O = arrays.device_empty((p.BH, p.Sq, p.d), p.dtype)
    L = arrays.device_empty((p.BH, p.Sq), lse_dtype)
    launch_forward(plan, p, Q, K, V, O, L)
    out = arrays.finish(O, out_shape, host)
    if not return_lse:
        return out
    return out, arrays.finish(L, lse_shape, host)


def explain(q, k, v, *, causal=False, scale=None, version=None, tiles=None):
    """Validate like ``attention`` and return the ``Plan`` it would run, without running it.

    ``print(numbaflash.explain(q, k, v))`` shows the kernel version, tiles, grid, block,
    shared memory, backend (GPU or simulator) and the reason for each choice. q, k, v may
    be arrays or anything with ``shape`` and ``dtype``.
    """
    p = check_attention_inputs(q, k, v, causal, scale)
    return plan_forward(p, version, tiles)
