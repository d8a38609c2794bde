"""L2/L3: arrays.py, the way arrays come in and go out.

On the simulator: views keep the data and the shape rule. On a GPU: the cache of small
output buffers (arrays.device_empty) never hands out a buffer that an array still uses,
and reuses one once its array is gone.
"""

import gc

import numpy as np
import pytest
from numba import cuda

import numbaflash
from numbaflash import arrays, reference
from strategies import on_gpu

GPU_ONLY = pytest.mark.skipif(not on_gpu(), reason="the output cache is GPU-only: the "
                              "simulator's device arrays are NumPy arrays, allocated plainly")


def test_kernel_view_has_the_data_and_the_shape():
    x = np.arange(2 * 3 * 5 * 4, dtype=np.float32).reshape(2, 3, 5, 4)
    d = cuda.to_device(x)
    view = arrays.as_kernel_array(d, (6, 5, 4), "q")
    assert view.shape == (6, 5, 4)
    np.testing.assert_array_equal(view.copy_to_host(), x.reshape(6, 5, 4))
    back = arrays.finish(view, (2, 3, 5, 4), host=True)
    np.testing.assert_array_equal(back, x)


@GPU_ONLY
def test_cached_outputs_are_never_shared_while_alive_and_reused_after():
    rng = np.random.default_rng(0)
    shape = (1, 2, 24, 8)
    inputs = [tuple(rng.standard_normal(shape).astype(np.float32) for _ in range(3))
              for _ in range(6)]
    # Keep every output alive: had a later call reused a live buffer, an earlier result
    # would be overwritten and differ from its reference below.
    outs = [numbaflash.attention(*(cuda.to_device(x) for x in qkv), return_lse=True)
            for qkv in inputs]
    pointers = {o.gpu_data.device_pointer_value for out in outs for o in out}
    assert len(pointers) == 2 * len(outs)
    # A coarse comparison is enough here: an overwritten output would hold another input's
    # result, off by O(1). (Accuracy is tests/test_forward_kernels.py's job.)
    for (q, k, v), (out, lse) in zip(inputs, outs):
        ref_out, ref_lse = reference.forward(q, k, v)
        np.testing.assert_allclose(out.copy_to_host(), ref_out, rtol=0, atol=1e-5)
        np.testing.assert_allclose(lse.copy_to_host(), ref_lse, rtol=0, atol=1e-5)

    del outs, out, lse
    gc.collect()
    q, k, v = inputs[0]
    out2 = numbaflash.attention(cuda.to_device(q), cuda.to_device(k), cuda.to_device(v))
    assert out2.gpu_data.device_pointer_value in pointers      # a freed buffer came back
    np.testing.assert_allclose(out2.copy_to_host(), reference.forward(q, k, v)[0], rtol=0,
                               atol=1e-5)


@GPU_ONLY
def test_only_small_outputs_are_cached():
    small, big = 1000, arrays.POOL_MAX_BUFFER // 4 + 1       # float32 elements
    for n in (small, big):
        a = arrays.device_empty((n,), np.float32)
        del a
        gc.collect()
    pool = arrays._pool(cuda.current_context())
    assert pool.free.get((0, 4 * small)) and (0, 4 * big) not in pool.free   # (stream, bytes)
