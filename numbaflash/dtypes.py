"""The input dtypes, and how bfloat16 reaches the kernels.

numbaflash takes float16, bfloat16, float32 and float64 inputs. bfloat16 is NumPy's
``ml_dtypes.bfloat16`` (the dtype JAX and others use); a Numba device array may hold it
too: ``cuda.to_device(a.view(np.uint16)).view(ml_dtypes.bfloat16)`` (``cuda.to_device``
of the bfloat16 array itself fails on a GPU: the buffer protocol it reads has no
bfloat16), and numbaflash.torch passes PyTorch's bfloat16 tensors the same way. Numba
has no bfloat16 type, so the kernels never see the dtype:

* a kernel that reads bfloat16 itself (its module says ``BFLOAT16 = True``: forward v7, on
  the 16-bit tensor cores) gets a uint16 view of the same memory, the values' bits
  (kernels/halves.py widens and rounds them);
* every other kernel computes in float32 anyway: it gets float32 copies of the inputs,
  widened exactly (on the host for NumPy inputs, by kernels/halves.py's
  ``widen_to_float32`` on the device), and its float32 outputs are rounded to bfloat16
  (to nearest even, ``narrow_from_float32``). The plan's reason says so.

Outputs are bfloat16 (gradients too), lse float32, as for float16.
"""

from dataclasses import replace

import ml_dtypes
import numpy as np

from .kernels.halves import CONVERT_THREADS, convert_grid, narrow_from_float32, widen_to_float32

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
INPUT_DTYPES = (np.dtype(np.float16), BFLOAT16, np.dtype(np.float32), np.dtype(np.float64))
BITS = np.dtype(np.uint16)              # what a kernel that reads bfloat16 gets


def is_bfloat16(dtype):
    """True for the bfloat16 dtype (or its name)."""
    try:
        return np.dtype(dtype) == BFLOAT16
    except TypeError:
        return False


def reads_bfloat16(module):
    """Whether a kernel version's module reads bfloat16 bits itself (``BFLOAT16 = True``)."""
    return getattr(module, "BFLOAT16", False)


def widens(p, module):
    """Whether Problem ``p`` runs on ``module``'s kernels through float32 copies: bfloat16
    inputs on a version that does not read bfloat16."""
    return is_bfloat16(p.dtype) and not reads_bfloat16(module)


def kernel_dtype(dtype, widen):
    """The dtype of the arrays the kernels read and write for inputs of ``dtype``: float32
    when widened, the bits (uint16) for bfloat16, else ``dtype`` itself."""
    if widen:
        return np.dtype(np.float32)
    return BITS if is_bfloat16(dtype) else np.dtype(dtype)


def kernel_problem(p, widen):
    """The Problem the kernels are launched with: ``p``, with dtype float32 when widened."""
    return replace(p, dtype=np.dtype(np.float32)) if widen else p


def widen_reason(version):
    """What a plan's reason adds when bfloat16 inputs run through float32 copies."""
    return (f"; bfloat16 inputs widened to float32 (exact) for {version}, which computes "
            "in float32, and its outputs rounded to bfloat16 (to nearest even)")


def host_for_kernel(a, widen):
    """A host array ready to copy to the device: bfloat16 as its bits, or as float32 when
    ``widen``; other dtypes as they are."""
    if not is_bfloat16(a.dtype):
        return a
    return a.astype(np.float32) if widen else a.view(BITS)


def device_for_kernel(x, widen, stream):
    """A C-contiguous device array ready for the kernels, on ``stream`` (a
    streams.CallStream): bfloat16 as a uint16 view of its memory, or a float32 copy
    (``widen_to_float32``) when ``widen``; other dtypes as they are."""
    from .arrays import device_empty, flat_view

    if not is_bfloat16(x.dtype):
        return x
    bits = x.view(BITS)
    if not widen:
        return bits
    out = device_empty(tuple(x.shape), np.float32, stream)
    if x.size:
        widen_to_float32[convert_grid(x.size), CONVERT_THREADS, stream.numba](
            flat_view(bits), flat_view(out))
    return out


def as_bits(x):
    """A device array of bfloat16 as a uint16 view of the same memory (any strides); any
    other array as it is."""
    return x.view(BITS) if is_bfloat16(x.dtype) else x


def device_as_bfloat16(x, stream):
    """A kernel's output for bfloat16 inputs as a bfloat16 device array: the uint16 bits
    viewed, or float32 values rounded into a new array (``narrow_from_float32``)."""
    from .arrays import device_empty, flat_view

    if x.dtype == BITS:
        return x.view(BFLOAT16)
    bits = device_empty(tuple(x.shape), BITS, stream)
    if x.size:
        narrow_from_float32[convert_grid(x.size), CONVERT_THREADS, stream.numba](
            flat_view(x), flat_view(bits))
    return bits.view(BFLOAT16)
