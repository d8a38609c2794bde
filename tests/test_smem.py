"""kernels/smem.py: dynamic shared memory above 48 KB (GPU), and a no-op on the simulator.

On a GPU: a kernel allowed 100 KB by ``allow_dynamic_shared_memory`` fills all of it and
reads it back (every element written by one thread and read by another); the same kernel
without the attribute cannot be launched with 100 KB (so the first test does not pass by
accident, e.g. on a driver that no longer needs the attribute); and asking for more than
the device's per-block maximum is a ValueError before any launch.
"""

import numpy as np
import pytest
from numba import cuda, float32

from numbaflash.kernels import smem
from strategies import on_gpu

GPU = on_gpu()
NBYTES = 100 * 1024
THREADS = 256


def make_fill_and_check():
    """A fresh kernel each time (the attribute belongs to a compiled kernel, so a test that
    needs a kernel without it must not share one): thread t writes element x = t, t + 256,
    ... with the value x, then, after a barrier, reads the element n - 1 - x (written by
    another thread) and counts the wrong ones. out = [elements seen, wrong values]."""

    @cuda.jit
    def fill_and_check(out):
        buf = cuda.shared.array(0, float32)     # dynamic: sized by the launch
        n = buf.shape[0]
        tid = cuda.threadIdx.x
        for x in range(tid, n, THREADS):
            buf[x] = float32(x)                 # exact: n < 2**24
        # Wait until every element is written.
        cuda.syncthreads()
        wrong = 0
        for x in range(tid, n, THREADS):
            y = n - 1 - x
            if buf[y] != float32(y):
                wrong += 1
        cuda.atomic.add(out, 1, wrong)
        if tid == 0:
            out[0] = n

    return fill_and_check


@pytest.mark.skipif(not GPU, reason="the 48 KB limit and the attribute exist only on a GPU")
def test_100_kb_of_dynamic_shared_memory_can_be_filled_and_read():
    kernel = make_fill_and_check()
    out = cuda.to_device(np.zeros(2, np.int64))
    smem.allow_dynamic_shared_memory(kernel, (out,), NBYTES)
    kernel[1, THREADS, 0, NBYTES](out)
    seen, wrong = out.copy_to_host()
    assert seen == NBYTES // 4 and wrong == 0


@pytest.mark.skipif(not GPU, reason="the 48 KB limit and the attribute exist only on a GPU")
def test_without_the_attribute_a_100_kb_launch_fails():
    kernel = make_fill_and_check()
    out = cuda.to_device(np.zeros(2, np.int64))
    kernel[1, THREADS, 0, 48 * 1024](out)       # up to 48 KB needs nothing
    cuda.synchronize()
    assert out.copy_to_host()[0] == 48 * 1024 // 4
    with pytest.raises(Exception):              # CUDA_ERROR_INVALID_VALUE at launch
        kernel[1, THREADS, 0, NBYTES](out)
        cuda.synchronize()


@pytest.mark.skipif(not GPU, reason="the device's maximum exists only on a GPU")
def test_more_than_the_device_allows_is_a_value_error():
    kernel = make_fill_and_check()
    out = cuda.to_device(np.zeros(2, np.int64))
    most = cuda.get_current_device().MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
    with pytest.raises(ValueError, match=rf"this GPU allows at most {most}"):
        smem.allow_dynamic_shared_memory(kernel, (out,), most + 4)


@pytest.mark.skipif(GPU, reason="checks the simulator")
def test_simulator_runs_dynamic_shared_memory_and_needs_no_attribute():
    """On the simulator the helper does nothing (no driver, no limit), and the simulator
    sizes a dynamic shared array from the launch, as v5 relies on."""
    kernel = make_fill_and_check()
    out = np.zeros(2, np.int64)
    assert smem.allow_dynamic_shared_memory(kernel, (out,), NBYTES) is None
    kernel[1, THREADS, 0, 4 * 1024](out)        # small: every thread is a Python thread
    assert out[0] == 1024 and out[1] == 0
