"""Which CUDA stream a call's kernels run on.

A kernel launched on another stream than the one its inputs were produced on, or the
one its outputs are consumed on, races with that work: inside PyTorch's
``with torch.cuda.stream(s):`` the tensors are written on ``s``, and a result computed
on the legacy default stream may be read on ``s`` before it is written (PyTorch's
streams do not wait for the legacy default stream). So every launch, copy and
allocation of a call goes on one stream, chosen in this order:

1. ``stream=`` given by the caller: a Numba stream (``numba.cuda.stream()``,
   ``cuda.external_stream(ptr)``, ...), a PyTorch stream (its ``cuda_stream``), a CuPy
   stream (its ``ptr``), or a raw ``CUstream`` handle as an int (0: the default stream).
2. Otherwise the stream the first device input was produced on (``producer_stream``):
   the stream its ``__cuda_array_interface__`` names (version 3's ``"stream"``, as CuPy
   exports it: CuPy's current stream), or, for a PyTorch CUDA tensor, PyTorch's current
   stream on its device (PyTorch exports version 2 of the interface, without a stream:
   lab/runs/2026-12-03/73_stream_race_after.txt is what reading only the interface
   gave). PyTorch is asked only if the caller has imported it.
3. Otherwise (NumPy inputs, Numba device arrays without a stream) the default stream,
   as Numba launches.

An input produced on another stream than the call's is waited for (that stream is
synchronised) before anything is launched; one on the call's stream is not (the stream
orders it). The simulator runs every launch at once, so there any stream is the same;
the ``stream=`` argument is still checked.
"""

import sys

from dataclasses import dataclass

from numba import cuda

from .kernels import simulating

# CUDA Array Interface stream values with a fixed meaning (version 3)
LEGACY_DEFAULT = 1
PER_THREAD_DEFAULT = 2


@dataclass(frozen=True)
class CallStream:
    """The stream of one call: ``numba`` for Numba's launches and copies (0 for the
    default stream), ``core`` for cuda.core's launch (None on the simulator), ``handle``
    the CUstream value inputs are compared with (0 for the default stream)."""
    numba: object
    core: object
    handle: int

    def synchronize(self):
        """Wait until everything queued on the stream so far has run."""
        if self.numba == 0:
            cuda.synchronize()
        else:
            self.numba.synchronize()


DEFAULT = CallStream(0, None, 0)


def handle_of(stream):
    """The CUstream handle (int; 0 for the legacy default stream) of a caller's
    ``stream=`` argument; TypeError if it is not one of the kinds the module docstring
    lists, ValueError for a negative handle."""
    if simulating() and isinstance(stream, cuda.stream):
        return 0                                # the simulator's streams are all one
    if isinstance(stream, bool):
        value = None
    elif isinstance(stream, int):
        value = stream
    elif isinstance(getattr(stream, "cuda_stream", None), int):     # PyTorch
        value = stream.cuda_stream
    elif isinstance(getattr(stream, "ptr", None), int):             # CuPy
        value = stream.ptr
    elif not simulating() and isinstance(stream, cuda.cudadrv.driver.Stream):   # Numba
        value = int(stream)
    else:
        value = None
    if value is None:
        raise TypeError(f"stream must be a Numba, PyTorch or CuPy CUDA stream or a "
                        f"CUstream handle (int), not {stream!r}")
    if value < 0:
        raise ValueError(f"stream handle must be >= 0, got {value}")
    return 0 if value == LEGACY_DEFAULT else value


def interface_stream(x):
    """The stream handle a device input's CUDA Array Interface names (0 for the legacy
    default stream), or None if it names none (or x has no interface)."""
    interface = getattr(x, "__cuda_array_interface__", None)
    if not isinstance(interface, dict):
        return None
    value = interface.get("stream")
    return None if value is None else handle_value(int(value))


def handle_value(value):
    """A CUDA Array Interface stream value as the handle calls compare (0: the legacy
    default stream)."""
    return 0 if value == LEGACY_DEFAULT else value


def producer_stream(x):
    """The stream handle device input ``x`` was produced on, as far as can be told: its
    interface's stream, else PyTorch's current stream for a PyTorch CUDA tensor, else
    None (no stream named: the data is ready)."""
    if hasattr(x, "gpu_data") and not simulating():
        # A Numba device array: the stream its interface would name, without building
        # the interface's dict (a repeated decoding call reads it for every input).
        bound = x.stream
        return None if bound == 0 else handle_value(int(bound))
    handle = interface_stream(x)
    return handle if handle is not None else torch_stream(x)


def torch_stream(x):
    """PyTorch's current stream on the device of ``x`` (its handle) if ``x`` is a PyTorch
    CUDA tensor, else None. PyTorch is asked only if the caller has imported it."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor) and x.is_cuda:
        # The raw handle in one call, without building a torch.cuda.Stream (a private
        # function Triton uses too; numbaflash/torch.py asks it the same way), where
        # PyTorch has it: a repeated decoding call on tensors asks at every call.
        raw = getattr(getattr(torch, "_C", None), "_cuda_getCurrentRawStream", None)
        if raw is not None:
            return handle_value(raw(x.get_device()))
        return handle_of(torch.cuda.current_stream(x.device))
    return None


def wait_for(x, call):
    """Make sure device input ``x`` is ready for work on ``call`` (a CallStream): if it
    was produced on another stream, wait for that stream (a host synchronisation)."""
    if simulating():
        return
    handle = producer_stream(x)
    if handle is not None and handle != call.handle:
        _synchronize(handle)


def _synchronize(handle):
    """Wait on the host until the stream with this handle (0: the default) has run."""
    if handle == 0:
        cuda.synchronize()
    else:
        cuda.external_stream(handle).synchronize()


def call_stream(inputs, stream=None):
    """The ``CallStream`` of a call with these inputs and ``stream=`` argument (module
    docstring). On the simulator: the stream argument is checked, DEFAULT returned."""
    if stream is not None:
        handle = handle_of(stream)
        if simulating():
            return DEFAULT
        return _call_stream(_from_handle(handle), handle)
    if simulating():
        return DEFAULT
    for x in inputs:
        handle = producer_stream(x)
        if handle is not None:
            return _call_stream(_from_handle(handle), handle)
    return DEFAULT


def _from_handle(handle):
    if handle == 0:
        return 0
    if handle == PER_THREAD_DEFAULT:
        return cuda.per_thread_default_stream()
    return cuda.external_stream(handle)


def _call_stream(numba_stream, handle):
    from numba.cuda.cudadrv.driver import _to_core_stream
    if numba_stream == 0:
        return DEFAULT
    return CallStream(numba_stream, _to_core_stream(numba_stream), handle)


_KNOWN = {}             # (device, CUstream handle) -> CallStream, for ready_stream
_KNOWN_MAX = 256


def ready_stream(inputs, stream=None, also=()):
    """``call_stream(inputs, stream)``, after waiting for each of ``inputs`` and ``also``
    (device arrays that do not choose the stream) produced on another stream
    (``wait_for``), in one pass over their streams; the CallStream of a handle is made
    once per device (it wraps the handle, it does not own the stream), for calls repeated
    many times (numbaflash/decode_direct.py). Not for the simulator."""
    return ready_handles([producer_stream(x) for x in inputs], stream,
                         [producer_stream(x) for x in also])


def ready_handles(handles, stream=None, also=(), device=None):
    """``ready_stream`` from the inputs' producer handles (``producer_stream`` of each,
    None where an input names none): the inputs' first named stream, unless ``stream``
    is given, after waiting for every other one of ``handles`` and ``also``. ``device``:
    the current device's number if the caller has it (else asked here, when needed)."""
    if stream is not None:
        handle = handle_of(stream)
    else:
        handle = next((h for h in handles if h is not None), None)
    handles = list(handles) + list(also)
    if handle is None or handle == 0:
        call = DEFAULT
    else:
        if device is None:
            device = cuda.current_context().device.id
        key = (device, handle)
        call = _KNOWN.get(key)
        if call is None:
            if len(_KNOWN) >= _KNOWN_MAX:
                _KNOWN.clear()
            call = _KNOWN[key] = _call_stream(_from_handle(handle), handle)
    for h in set(handles):
        if h is not None and h != call.handle:
            _synchronize(h)
    return call
