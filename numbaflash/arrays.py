"""Host and device arrays: what comes in, what goes out, with no hidden round trips.

NumPy arrays in -> NumPy arrays out (copied to the device and back).
Device arrays in (Numba device arrays, or anything with ``__cuda_array_interface__``,
such as CuPy arrays and PyTorch CUDA tensors) -> Numba device arrays out; the data never
leaves the GPU. Under the simulator, its fake device arrays play that role.
"""

import contextlib
import contextvars
import math
import weakref

import numpy as np
from numba import cuda

from . import dtypes
from .kernels import simulating
from .streams import DEFAULT, wait_for

if not simulating():
    from numba.cuda.cudadrv.devicearray import DeviceNDArray
    from numba.cuda.cudadrv.driver import MemoryPointer


def is_device_array(x):
    """True for Numba device arrays (real or simulated) and CUDA Array Interface objects."""
    return hasattr(x, "__cuda_array_interface__") or (
        hasattr(x, "copy_to_host") and not isinstance(x, np.ndarray))


def on_device(arrays):
    """True if all arrays are device arrays, False if all are host arrays; else TypeError.
    A PyTorch bfloat16 tensor is refused (TypeError) with the way through: PyTorch exports
    no bfloat16 through the CUDA Array Interface or NumPy."""
    for a in arrays:
        if str(getattr(a, "dtype", "")) == "torch.bfloat16":
            raise TypeError("a PyTorch bfloat16 tensor cannot be read directly (PyTorch "
                            "exports no bfloat16 to NumPy or through the CUDA Array "
                            "Interface): call numbaflash.torch, which passes its int16 view "
                            "without a copy (numbaflash/dtypes.py)")
    kinds = {is_device_array(a) for a in arrays}
    if len(kinds) > 1:
        raise TypeError("inputs mix host (NumPy) and device arrays: pass all of them on the "
                        "host or all on the device")
    return kinds.pop()


def to_device(a, stream=DEFAULT):
    """``cuda.to_device(a)`` on ``stream`` for a C-contiguous host array; a bfloat16 one
    travels as its uint16 bits (Numba's copy reads the buffer protocol, which has no
    bfloat16) and is viewed as bfloat16 again on the device."""
    if dtypes.is_bfloat16(a.dtype):
        return cuda.to_device(a.view(dtypes.BITS), stream=stream.numba).view(a.dtype)
    return cuda.to_device(a, stream=stream.numba)


def as_kernel_array(x, shape3, name, stream=DEFAULT, widen=False):
    """View x as a C-contiguous (BH, S, d) array the kernels can take, ready for work on
    ``stream`` (a streams.CallStream).

    Host arrays are copied to the device on ``stream`` (through np.ascontiguousarray if
    they are not C-contiguous); device arrays must already be C-contiguous (copying them
    silently would hide a cost), else ValueError. A device array produced on another
    stream than ``stream`` is waited for (streams.wait_for). bfloat16 arrives as its bits
    (uint16), or as a float32 copy with ``widen`` (numbaflash/dtypes.py).
    """
    if not is_device_array(x):
        a = dtypes.host_for_kernel(np.ascontiguousarray(x).reshape(shape3), widen)
        return cuda.to_device(a, stream=stream.numba)
    wait_for(x, stream)
    if not hasattr(x, "copy_to_host"):      # CuPy, PyTorch, ...: wrap without a copy
        x = cuda.as_cuda_array(x, sync=False)
    if not x.is_c_contiguous():
        raise ValueError(f"{name} is a non-contiguous device array; numbaflash needs "
                         f"C-contiguous device inputs (make a contiguous copy first)")
    return dtypes.device_for_kernel(_view(x, shape3), widen, stream)


def strided_view(x, name, stream=DEFAULT):
    """x as a device array the kernels can index with its own strides, ready for work on
    ``stream``: host arrays are copied to the device (C-contiguous); device arrays are
    wrapped without a copy, whatever their strides (a transposed view reads and writes
    the memory it views). Negative strides are refused (ValueError)."""
    if not is_device_array(x):
        return to_device(np.ascontiguousarray(x), stream)
    wait_for(x, stream)
    if not hasattr(x, "copy_to_host"):      # CuPy, PyTorch, ...: wrap without a copy
        x = cuda.as_cuda_array(x, sync=False)
    if any(st < 0 for st in x.strides):
        raise ValueError(f"{name} has negative strides {tuple(x.strides)}; numbaflash reads "
                         f"device arrays with positive strides only")
    return x


def flat_with_strides(x, name):
    """``(flat, strides)`` for a device array x whose last dimension is contiguous: flat a
    1-dimensional view of its memory from its first element to its last, strides x's in
    elements, so that x[i, j, k, l] is flat[i * s0 + j * s1 + k * s2 + l]. ValueError if
    the last dimension is not contiguous."""
    itemsize = x.dtype.itemsize
    shape, byte_strides = tuple(x.shape), tuple(x.strides)
    if shape[-1] > 1 and byte_strides[-1] != itemsize:
        raise ValueError(f"{name}: its last dimension (the head dim) must be contiguous in "
                         f"memory; got strides {byte_strides} (bytes) for shape {shape}")
    if any(st % itemsize for st in byte_strides):
        raise ValueError(f"{name}: strides {byte_strides} are not whole elements")
    strides = tuple(st // itemsize for st in byte_strides)
    extent = 1 + sum((n - 1) * st for n, st in zip(shape, strides))
    if simulating():
        return np.lib.stride_tricks.as_strided(x._ary, (extent,), (itemsize,)), strides
    return DeviceNDArray((extent,), (itemsize,), x.dtype, gpu_data=x.gpu_data), strides


def heads_first(x):
    """The C-contiguous device array ``x`` (rows, heads, d) as a (heads, rows, d) view of the
    same memory (strides only, no copy): how the kernels read a packed batch
    (numbaflash/varlen.py)."""
    shape = (x.shape[1], x.shape[0]) + tuple(x.shape[2:])
    c = _c_strides(tuple(x.shape), x.dtype.itemsize)
    strides = (c[1], c[0]) + c[2:]
    if simulating():
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
        return FakeCUDAArray(np.lib.stride_tricks.as_strided(x._ary, shape, strides))
    return DeviceNDArray(shape, strides, x.dtype, gpu_data=x.gpu_data)


def flat_view(x):
    """The C-contiguous device array ``x`` as one dimension, the same data (``_view``)."""
    return _view(x, (x.size,))


def _view(x, shape):
    """The C-contiguous device array ``x`` with another shape, the same data: what
    ``x.reshape(shape)`` gives, built directly. Numba's reshape first works out whether
    a copy would be needed, which costs as much again (scripts/overhead.py --breakdown);
    for a C-contiguous array it never is."""
    if tuple(x.shape) == tuple(shape):
        return x
    if simulating():
        return x.reshape(shape)
    return DeviceNDArray(shape, _c_strides(shape, x.dtype.itemsize), x.dtype,
                         gpu_data=x.gpu_data)


def _c_strides(shape, itemsize):
    """The strides in bytes of a C-contiguous array of ``shape``."""
    strides, step = [], itemsize
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


# --- outputs: a small cache of device buffers --------------------------------------------
#
# A small call spends more time allocating its outputs than launching its kernel:
# cuMemAlloc per output, and a cuMemFree (which waits for the GPU) when the output is
# dropped. scripts/overhead.py --breakdown measured 78 us for O and L at (1, 1, 128, 64)
# on the H200, against 34 us for the launch. So outputs of at most POOL_MAX_BUFFER bytes
# come from a cache, as PyTorch's allocator does it: when the last array using a buffer is
# garbage-collected, the buffer goes back to the cache instead of to the driver, and the
# next output of that size reuses it. The cache keeps at most POOL_MAX_CACHED bytes per
# CUDA context; larger outputs are allocated and freed as usual. Set POOL_MAX_BUFFER = 0
# to turn it off.
#
# Buffers are cached per stream (streams.py: the stream a call runs on), as PyTorch's
# caching allocator does it: a buffer goes back to the cache of the stream its output was
# written on, and is reused only by calls on that stream, so the stream orders the old
# output's writes before the new one's. The caveat is PyTorch's too: a use of an output
# on another stream is not ordered with that reuse. If you pass an output to work on
# another stream, keep a reference to it until that work is done.

POOL_MAX_BUFFER = 1 << 20       # bytes: outputs up to this size come from the cache
POOL_MAX_CACHED = 64 << 20      # bytes kept in the cache per context at most
_pools = {}                     # id(CUDA context) -> its _Pool


def _pool(context):
    """The cache of ``context`` (a Numba CUDA context); a new one for a new context."""
    pool = _pools.get(id(context))
    if pool is None or pool.context() is not context:     # new, or an id reused
        pool = _pools[id(context)] = _Pool(context)
    return pool


class _Pool:
    def __init__(self, context):
        self.context = weakref.ref(context)
        self.free = {}          # (stream handle, size in bytes) -> buffers not in use
        self.cached = 0         # bytes in self.free

    def take(self, context, nbytes, stream):
        """A device buffer of ``nbytes`` for work on the stream with handle ``stream``,
        whose memory comes back here when it is dropped."""
        key = (stream, nbytes)
        buffers = self.free.get(key)
        if buffers:
            base = buffers.pop()
            self.cached -= nbytes
        else:
            base = context.memalloc(nbytes)
        return MemoryPointer(context, base.device_pointer, nbytes,
                             finalizer=lambda: self.give_back(base, key))

    def give_back(self, base, key):
        nbytes = key[1]
        if self.cached + nbytes <= POOL_MAX_CACHED:
            self.free.setdefault(key, []).append(base)
            self.cached += nbytes
        # else: dropping ``base`` frees it through Numba, as any device array


# --- outputs from another library's allocator ----------------------------------------------
#
# Inside ``with allocator(fn):`` every device output and scratch buffer of a call comes from
# ``fn(shape, dtype)``, which returns an object with ``__cuda_array_interface__`` (it keeps
# the memory alive for as long as the output is used). numbaflash.torch passes
# ``torch.empty``: its outputs then come from PyTorch's caching allocator on PyTorch's
# current stream, where the kernels run too, so PyTorch accounts for the memory and orders
# its reuse as for any tensor of its own. (Not used under the simulator.)

_ALLOCATE = contextvars.ContextVar("numbaflash_allocate", default=None)


@contextlib.contextmanager
def allocator(fn):
    """Make ``fn(shape, dtype)`` allocate the device outputs of the calls inside."""
    token = _ALLOCATE.set(fn)
    try:
        yield
    finally:
        _ALLOCATE.reset(token)


def caller_allocates():
    """Whether the call runs inside ``allocator(fn)``."""
    return _ALLOCATE.get() is not None


def device_empty(shape, dtype, stream=DEFAULT, context=None):
    """An uninitialised device array for work on ``stream`` (a streams.CallStream): from
    the caller's allocator inside ``allocator(fn)``; else small ones reuse cached buffers
    of that stream (above). ``context``: the current Numba CUDA context if the caller
    has it (asking Numba for it costs microseconds a time)."""
    dtype = np.dtype(dtype)
    nbytes = dtype.itemsize * math.prod(shape)
    allocate = _ALLOCATE.get()
    if allocate is not None and nbytes and not simulating():
        return cuda.as_cuda_array(allocate(shape, dtype))
    if simulating() or nbytes == 0 or nbytes > POOL_MAX_BUFFER:
        return cuda.device_array(shape, dtype=dtype)
    if context is None:
        context = cuda.current_context()
    return DeviceNDArray(shape, _c_strides(shape, dtype.itemsize), dtype,
                         gpu_data=_pool(context).take(context, nbytes, stream.handle))


def scratch(nbytes, stream=DEFAULT, context=None):
    """``(owner, pointer)``: ``nbytes`` of device memory for work on ``stream`` that only
    kernels read and write (no array around it: cheaper than ``device_empty``), from the
    caller's allocator inside ``allocator(fn)``, else the stream's cache as for outputs.
    The memory stays the caller's while ``owner`` lives (outside ``allocator(fn)``, a
    Numba MemoryPointer). ``context`` as for ``device_empty``. Not for the simulator."""
    allocate = _ALLOCATE.get()
    if allocate is not None:
        owner = allocate((nbytes,), np.uint8)
        return owner, owner.__cuda_array_interface__["data"][0]
    if context is None:
        context = cuda.current_context()
    if nbytes > POOL_MAX_BUFFER:
        owner = context.memalloc(nbytes)
    else:
        owner = _pool(context).take(context, nbytes, stream.handle)
    return owner, int(owner.device_pointer)


# --- scratch that stays with a stream -------------------------------------------------------
#
# A repeated decoding call (numbaflash/decode_direct.py) needs scratch memory that only its
# own kernels read and write: the lengths and the splits' partial results. A stream runs
# its kernels in order, so the scratch of one call on a stream can be the next call's on
# that stream too: ``workspace`` keeps one buffer per (context, stream) and hands out the
# same memory every time, grown (after waiting for the stream) when a call needs more.

WORKSPACE_MAX = 64 << 20        # bytes: a call that needs more takes ``scratch`` instead
_workspaces = {}                # (id(context), stream handle) -> (weakref(context), buffer)


def workspace(nbytes, stream, context):
    """The device address of at least ``nbytes`` of scratch for kernels on ``stream`` (a
    streams.CallStream) and on no other stream, the same memory for every call on that
    stream; None where ``scratch`` must be used instead: more than WORKSPACE_MAX, or
    inside ``allocator(fn)`` (the caller's allocator then owns every buffer, as in a
    CUDA graph's capture). Not for the simulator."""
    if nbytes > WORKSPACE_MAX or _ALLOCATE.get() is not None:
        return None
    key = (id(context), stream.handle)
    held = _workspaces.get(key)
    if held is None or held[0]() is not context or held[1].size < nbytes:
        if held is not None and held[0]() is context:
            stream.synchronize()        # queued kernels may still use the old buffer
        size = 1 << max(8, (nbytes - 1).bit_length())      # powers of two: few regrowths
        held = _workspaces[key] = (weakref.ref(context), context.memalloc(size))
    return int(held[1].device_pointer)


def c_contiguous(shape, dtype, memory):
    """A C-contiguous device array of ``shape`` and ``dtype`` on ``memory`` (a Numba
    MemoryPointer, such as ``scratch``'s owner): for outputs whose buffers were taken
    before their kernels were launched. Not for the simulator."""
    dtype = np.dtype(dtype)
    return DeviceNDArray(shape, _c_strides(shape, dtype.itemsize), dtype, gpu_data=memory)


def finish(x, shape, host, stream=DEFAULT, dtype=None):
    """Give an output back in the caller's world: reshaped, on the host if inputs were
    (copied on ``stream``, which is then waited for). With ``dtype`` bfloat16, x (its bits,
    or float32 values from a kernel that computed in float32) becomes a bfloat16 array
    (numbaflash/dtypes.py)."""
    if dtype is not None and dtypes.is_bfloat16(dtype):
        x = dtypes.device_as_bfloat16(x, stream)
    x = _view(x, shape)
    if not host:
        return x
    a = x.copy_to_host(stream=stream.numba)
    if stream.numba != 0:
        stream.synchronize()
    return a


def filled(shape, value, dtype, host, stream=DEFAULT):
    """An output that needs no kernel (e.g. Sk = 0): built on the host, moved if needed
    (on ``stream``)."""
    a = np.full(shape, value, dtype=dtype)
    return a if host else to_device(a, stream)
