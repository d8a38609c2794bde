"""Which stream a call runs on (numbaflash/streams.py).

Everywhere: the ``stream=`` argument is checked before anything is launched (TypeError
for what is not a stream, ValueError for a negative handle), and the result does not
depend on it. On a GPU: kernels, copies and the backward's finite-input check run on the
stream given or on the one the inputs name (PyTorch's current stream), so the
side-stream scenario of scripts/stream_race.py gives the right result on every trial;
output buffers are cached per stream.
"""

import gc
import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
from numba import cuda

import numbaflash
from numbaflash import arrays, streams
from numbaflash.kernels import simulating

GPU = not simulating() and cuda.is_available()


def inputs(seed=0, shape=(2, 2, 24, 8)):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(np.float32) for _ in range(4)]


@pytest.mark.parametrize("bad,error", [("0", TypeError), (1.5, TypeError), (True, TypeError),
                                       (object(), TypeError), (-1, ValueError)])
def test_a_bad_stream_is_refused_before_any_launch(bad, error, monkeypatch):
    q, k, v, dout = inputs()
    monkeypatch.setattr(numbaflash.api, "launch_forward", None)      # a launch would fail
    monkeypatch.setattr(numbaflash.api, "launch_backward", None)
    with pytest.raises(error, match="stream"):
        numbaflash.attention(q, k, v, stream=bad)
    out, lse = np.zeros_like(q), np.zeros(q.shape[:-1], np.float32)
    with pytest.raises(error, match="stream"):
        numbaflash.attention_backward(dout, q, k, v, out, lse, stream=bad)


def test_the_result_does_not_depend_on_the_stream():
    q, k, v, dout = inputs(1)
    out, lse = numbaflash.attention(q, k, v, causal=True, return_lse=True)
    grads = numbaflash.attention_backward(dout, q, k, v, out, lse, causal=True)
    for stream in (0, cuda.stream()):
        o, l = numbaflash.attention(q, k, v, causal=True, return_lse=True, stream=stream)
        g = numbaflash.attention_backward(dout, q, k, v, o, l, causal=True, stream=stream)
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads),
                              (o, l, *g)):
            np.testing.assert_array_equal(a, b, err_msg=name)


class _Named:
    """An object that names a stream as PyTorch's (cuda_stream) or CuPy's (ptr) do."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


def test_stream_handles_of_each_kind():
    assert streams.handle_of(0) == 0
    assert streams.handle_of(streams.LEGACY_DEFAULT) == 0
    assert streams.handle_of(1234) == 1234
    assert streams.handle_of(_Named(cuda_stream=77)) == 77
    assert streams.handle_of(_Named(ptr=88)) == 88
    with pytest.raises(TypeError, match="stream must be"):
        streams.handle_of(_Named(ptr="88"))


def test_a_pytorch_cuda_tensor_names_pytorch_s_current_stream(monkeypatch):
    """PyTorch exports the CUDA Array Interface without a stream; the stream it writes a
    tensor on is its current stream, which producer_stream asks for when the caller has
    imported PyTorch (a stand-in module here: the test needs neither PyTorch nor a GPU)."""
    class Tensor:
        is_cuda = True
        device = "cuda:0"
        __cuda_array_interface__ = {"shape": (1,), "typestr": "<f4", "data": (0, False),
                                    "version": 2}

    asked = []

    def current_stream(device):
        asked.append(device)
        return _Named(cuda_stream=4242)

    fake = _Named(Tensor=Tensor, cuda=_Named(current_stream=current_stream))
    monkeypatch.setitem(sys.modules, "torch", fake)
    assert streams.producer_stream(Tensor()) == 4242 and asked == ["cuda:0"]
    assert streams.producer_stream(_Named(__cuda_array_interface__={"stream": 9})) == 9
    assert streams.producer_stream(np.zeros(2)) is None
    # Where PyTorch has the raw handle's function, it is asked with the device's index
    # instead (no Stream object built), the legacy default stream's 1 read as 0.
    Tensor.get_device = lambda self: 3
    raw = {3: 777}
    fake._C = _Named(_cuda_getCurrentRawStream=lambda index: raw[index])
    assert streams.producer_stream(Tensor()) == 777 and asked == ["cuda:0"]
    raw[3] = streams.LEGACY_DEFAULT
    assert streams.torch_stream(Tensor()) == 0


@pytest.mark.skipif(not GPU, reason="PyTorch's streams are the GPU's")
def test_torch_stream_is_pytorch_s_current_stream_on_a_gpu():
    """streams.torch_stream (the raw handle where PyTorch has the function) equals
    torch.cuda.current_stream's handle on the default stream and inside a side stream's
    context."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch without CUDA")
    x = torch.zeros(2, device="cuda")
    assert streams.torch_stream(x) == streams.handle_of(torch.cuda.current_stream(x.device))
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert streams.torch_stream(x) == side.cuda_stream != 0
    assert streams.torch_stream(x) == streams.handle_of(torch.cuda.current_stream(x.device))


def test_interface_stream_reads_the_array_interface():
    assert streams.interface_stream(np.zeros(3)) is None
    assert streams.interface_stream(_Named(__cuda_array_interface__={"stream": None})) is None
    assert streams.interface_stream(_Named(__cuda_array_interface__={"stream": 1})) == 0
    assert streams.interface_stream(_Named(__cuda_array_interface__={"stream": 5})) == 5


# --- on a GPU ---------------------------------------------------------------------------

gpu_only = pytest.mark.skipif(not GPU, reason="streams exist on a GPU only")


@gpu_only
def test_a_numba_stream_orders_copies_kernels_and_results():
    q, k, v, dout = inputs(2, (4, 8, 512, 64))
    want = numbaflash.attention(q, k, v, causal=True)
    s = cuda.stream()
    Q, K, V = (cuda.to_device(x, stream=s) for x in (q, k, v))     # asynchronous copies
    out = numbaflash.attention(Q, K, V, causal=True, stream=s)
    got = out.copy_to_host(stream=s)
    s.synchronize()
    np.testing.assert_array_equal(got, want)


@gpu_only
def test_output_buffers_are_cached_per_stream():
    s = streams.call_stream((), cuda.stream())
    a = arrays.device_empty((4, 16), np.float32, s)
    pointer = a.gpu_data.device_pointer_value
    del a
    gc.collect()
    b = arrays.device_empty((4, 16), np.float32)                  # the default stream
    assert b.gpu_data.device_pointer_value != pointer
    c = arrays.device_empty((4, 16), np.float32, s)               # s: its freed buffer
    assert c.gpu_data.device_pointer_value == pointer


@gpu_only
def test_pytorch_side_stream_gives_the_right_result_every_time():
    pytest.importorskip("torch")
    path = Path(__file__).resolve().parent.parent / "scripts" / "stream_race.py"
    spec = importlib.util.spec_from_file_location("stream_race", path)
    stream_race = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stream_race)
    assert stream_race.main(["--trials", "10", "--shape", "2", "8", "1024", "64"]) == 0


@gpu_only
def test_ready_stream_chooses_as_call_stream_does_and_caches_the_wrapper():
    """ready_stream (the repeated decoding calls' way) picks call_stream's stream for the
    same inputs and argument: a stream argument first, then the first input that names
    one, then the default; arrays in ``also`` are waited for but never choose; the
    CallStream of a handle is made once."""
    s = cuda.stream()
    on_s = _Named(__cuda_array_interface__={"stream": int(s)})
    plain = _Named(__cuda_array_interface__={"stream": None})
    for inputs, stream in (([plain, on_s], None), ([plain], None), ([on_s], 0), ([plain], s)):
        assert (streams.ready_stream(inputs, stream).handle
                == streams.call_stream(inputs, stream).handle)
    assert streams.ready_stream([plain], also=[on_s]) is streams.DEFAULT
    assert streams.ready_stream([on_s]) is streams.ready_stream([on_s])


@gpu_only
def test_a_numba_arrays_producer_is_the_stream_its_interface_names():
    """producer_stream reads a Numba device array's bound stream directly (a repeated
    decoding call asks it of every input): the same handle its CUDA Array Interface names,
    None for an array bound to no stream, 0 for the legacy default stream."""
    s = cuda.stream()
    for stream in (0, s, cuda.legacy_default_stream(), cuda.per_thread_default_stream()):
        x = cuda.device_array((4, 8), np.float32, stream=stream)
        assert streams.producer_stream(x) == streams.interface_stream(x)
    assert streams.producer_stream(cuda.device_array(4, np.float32)) is None
    assert streams.producer_stream(cuda.device_array(4, np.float32, stream=s)) == int(s)
    legacy = cuda.device_array(4, np.float32, stream=cuda.legacy_default_stream())
    assert streams.producer_stream(legacy) == 0
