"""Host and device arrays: what comes in, what goes out, with no hidden round trips.

NumPy arrays in -> NumPy arrays out (copied to the device and back).
Device arrays in (Numba device arrays, or anything with ``__cuda_array_interface__``,
such as CuPy arrays and PyTorch CUDA tensors) -> Numba device arrays out; the data never
leaves the GPU. Under the simulator, its fake device arrays play that role.
"""

import numpy as np
from numba import cuda


def is_device_array(x):
    """True for Numba device arrays (real or simulated) and CUDA Array Interface objects."""
    return hasattr(x, "__cuda_array_interface__") or (
        hasattr(x, "copy_to_host") and not isinstance(x, np.ndarray))


def on_device(arrays):
    """True if all arrays are device arrays, False if all are host arrays; else TypeError."""
    kinds = {is_device_array(a) for a in arrays}
    if len(kinds) > 1:
        raise TypeError("inputs mix host (NumPy) and device arrays: pass all of them on the "
                        "host or all on the device")
    return kinds.pop()


def as_kernel_array(x, shape3, name):
    """View x as a C-contiguous (BH, S, d) array the kernels can take.

    Host arrays that are not C-contiguous are copied (np.ascontiguousarray); device arrays
    must already be C-contiguous (copying them silently would hide a cost), else ValueError.
    """
    if not is_device_array(x):
        return cuda.to_device(np.ascontiguousarray(x).reshape(shape3))
    if not hasattr(x, "copy_to_host"):      # CuPy, PyTorch, ...: wrap without a copy
        x = cuda.as_cuda_array(x)
    if not x.is_c_contiguous():
        raise ValueError(f"{name} is a non-contiguous device array; numbaflash needs "
                         f"C-contiguous device inputs (make a contiguous copy first)")
    return x.reshape(shape3)


def device_empty(shape, dtype):
    return cuda.device_array(shape, dtype=dtype)


def finish(x, shape, host):
    """Give an output back in the caller's world: reshaped, on the host if inputs were."""
    x = x.reshape(shape)
    return x.copy_to_host() if host else x


def filled(shape, value, dtype, host):
    """An output that needs no kernel (e.g. Sk = 0): built on the host, moved if needed."""
    a = np.full(shape, value, dtype=dtype)
    return a if host else cuda.to_device(a)
