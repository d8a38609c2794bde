"""numbaflash/launcher.py: the direct launch passes the kernel what Numba's launch passes.

On a GPU:
- the parameter words the direct launch builds for a kernel's arguments equal, word for
  word, those numba-cuda's own ``_Kernel._prepare_args`` builds for the same arguments
  (arrays, views of other shapes, the float and integer scalars);
- every default forward kernel launched directly gives bitwise the output and lse of the
  same kernel launched through Numba's dispatcher (``DIRECT_LAUNCH = False``), float32 and
  float16, causal or not, on shapes that are not tile multiples; the first call of a key
  goes through the dispatcher, so each is called twice before it is compared.
On the simulator every launch goes through the dispatcher, which the test below checks.
"""

import ctypes

import numpy as np
import pytest
from numba import cuda

import numbaflash
from numbaflash import arrays, launcher, policy
from numbaflash.kernels import forward
from numbaflash.validate import check_attention_inputs
from strategies import make_case, on_gpu
from tolerance import to_host

GPU = on_gpu()


def test_the_simulator_never_launches_directly(monkeypatch):
    if GPU:
        pytest.skip("on a GPU the direct launch is used; the tests below check it there")
    monkeypatch.setattr(launcher, "_DIRECT", {})
    case = make_case(B=1, H=1, Sq=5, Sk=7, d=4, causal=None, seed=1)
    for _ in range(2):
        numbaflash.attention(cuda.to_device(case.q), cuda.to_device(case.k),
                             cuda.to_device(case.v))
    assert launcher._DIRECT == {}


def test_types_keys_say_when_the_dtype_gives_every_argument_type():
    """A types key (launch: equal keys, equal argument types) for plain arrays, and for a
    packed batch whose kernel reads the packed arrays as they are (C-contiguous, its own
    key); None where the types depend on the caller's arrays (slopes, masks) or on a
    packed batch's strided views."""
    q = np.zeros((1, 2, 3, 8), np.float16)
    p = check_attention_inputs(q, q, q)
    seqs, slopes = object(), object()
    plain = launcher._types_key(p, None, None, None)
    rows = launcher._types_key(p, None, None, seqs, rows=True)
    assert plain == (p.dtype, p.acc_dtype) and rows == plain + ("packed rows",)
    assert launcher._types_key(p, None, None, seqs) is None
    assert launcher._types_key(p, slopes, None, seqs, rows=True) is None
    assert launcher._types_key(p, slopes, None, None) is None


def test_a_tuple_of_scalars_is_its_elements_words():
    """A packed batch's equal lengths, (nq, nk) int64, become two int64 words in order, as
    numba-cuda's _prepare_args flattens a tuple; a tuple of another kind has no maker (the
    launch then goes through Numba)."""
    import numba
    pair = (np.int64(17), np.int64(11))
    make = launcher._word_maker(numba.typeof(pair))
    words = make(pair)
    assert [type(w) for w in words] == [ctypes.c_int64, ctypes.c_int64]
    assert [w.value for w in words] == [17, 11]
    assert launcher._word_maker(numba.typeof((np.int64(1), np.float32(2)))) is None


def _value(word):
    """A parameter word as a number: Python ints as they are, ctypes values unwrapped."""
    return word.value if isinstance(word, ctypes._SimpleCData) else word


@pytest.mark.skipif(not GPU, reason="the direct launch exists only on a GPU")
def test_the_direct_launchs_words_are_numbas():
    case = make_case(B=2, H=3, Sq=37, Sk=29, d=16, causal=None, seed=2)
    q, k, v = (cuda.to_device(x) for x in (case.q, case.k, case.v))
    p = numbaflash.api._forward_problem_and_plan(q, k, v, False, None,
                                                 numbaflash.api._variants(*[None] * 7),
                                                 None, None)[0]
    plan = policy.plan_forward(p)
    kernel = forward.module(plan.version).kernel(plan, p)
    Q = arrays.as_kernel_array(q, (p.BH, p.Sq, p.d), "q")      # views of another shape
    K = arrays.as_kernel_array(k, (p.BHkv, p.Sk, p.d), "k")
    V = arrays.as_kernel_array(v, (p.BHkv, p.Sk, p.d), "v")
    O = arrays.device_empty((p.BH, p.Sq, p.d), np.float32)     # from the output cache
    L = cuda.device_array((p.BH, p.Sq), np.float32)            # from Numba
    args = (Q, K, V, O, L, np.float32(p.softmax_scale), np.int64(-3))
    if forward.module(plan.version).VARIANTS:   # the defaults take the variant arguments
        args += launcher.variant_arguments(p, None, None)   # (their placeholders)
    nbytes = plan.shared_bytes if plan.dynamic_shared else 0
    launcher.launch(kernel, plan.grid, plan.block, args, ("test",), nbytes)
    direct = launcher._DIRECT[(kernel, ("test",), plan.grid, plan.block, nbytes)]
    assert direct.makers is not None, "the default forward kernel must launch directly"
    ours = [w for make, a in zip(direct.makers, args) for w in make(a)]
    numbas = []
    for t, a in zip(direct.compiled.argument_types, args):
        direct.compiled._prepare_args(t, a, 0, [], numbas)
    assert [type(w) for w in ours] == [type(w) for w in numbas]
    assert [_value(w) for w in ours] == [_value(w) for w in numbas]


@pytest.mark.skipif(not GPU, reason="the direct launch exists only on a GPU")
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("causal", [None, "bottom_right"])
@pytest.mark.parametrize("shape", [(1, 1, 128, 64), (2, 3, 97, 59), (1, 2, 300, 128)])
def test_a_direct_launch_gives_bitwise_the_dispatchers_result(dtype, causal, shape,
                                                              monkeypatch):
    B, H, S, d = shape
    case = make_case(B=B, H=H, Sq=S, Sk=S + 11, d=d, causal=causal, seed=3)
    q, k, v = (cuda.to_device(x.astype(dtype)) for x in (case.q, case.k, case.v))
    results = {}
    for direct in (False, True):
        monkeypatch.setattr(launcher, "DIRECT_LAUNCH", direct)
        for _ in range(2):          # the first call of a key goes through the dispatcher
            out, lse = numbaflash.attention(q, k, v, causal=causal, return_lse=True)
        results[direct] = (to_host(out), to_host(lse))
    assert any(key[1] is not None for key in launcher._DIRECT), "nothing launched directly"
    for a, b in zip(results[False], results[True]):
        np.testing.assert_array_equal(a, b)


@pytest.mark.skipif(not GPU, reason="the direct launch exists only on a GPU")
@pytest.mark.parametrize("version", [None, "v4"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("causal", [None, "bottom_right"])
def test_a_direct_backward_launch_gives_bitwise_the_dispatchers_gradients(version, dtype,
                                                                          causal,
                                                                          monkeypatch):
    """The backward's kernels (the finite check, D, dK/dV, dQ), launched both ways."""
    case = make_case(B=2, H=2, Sq=97, Sk=130, d=64, causal=causal, seed=4, with_dout=True)
    q, k, v, dout = (cuda.to_device(x.astype(dtype)) for x in (case.q, case.k, case.v,
                                                                case.dout))
    out, lse = numbaflash.attention(q, k, v, causal=causal, return_lse=True)
    results = {}
    for direct in (False, True):
        monkeypatch.setattr(launcher, "DIRECT_LAUNCH", direct)
        for _ in range(2):          # the first call of a key goes through the dispatcher
            grads = numbaflash.attention_backward(dout, q, k, v, out, lse, causal=causal,
                                                  version=version)
        results[direct] = [to_host(g) for g in grads]
    for a, b in zip(results[False], results[True]):
        np.testing.assert_array_equal(a, b)


@pytest.mark.skipif(not GPU, reason="the direct launch exists only on a GPU")
@pytest.mark.parametrize("causal", [False, True])
def test_a_direct_packed_backward_of_equal_lengths_gives_the_dispatchers_gradients(
        causal, monkeypatch):
    """A packed float16 batch of equal lengths: backward v9's causal dQ kernel takes the
    lengths as a pair of int64s (kernels/sequences.py; without the mask it reads
    cu_seqlens); launched directly (their words built here) and through Numba's
    dispatcher, the same bits; and its words are Numba's."""
    rng = np.random.default_rng(5)
    B, S, H, d = 3, 97, 2, 64
    q, k, v, dout = (cuda.to_device(rng.standard_normal((B * S, H, d)).astype(np.float16))
                     for _ in range(4))
    cu = np.arange(B + 1, dtype=np.int32) * S
    out, lse = numbaflash.attention_varlen(q, k, v, cu, cu, causal=causal, return_lse=True)
    plans = numbaflash.explain_varlen_backward(q, k, v, cu, cu, causal=causal)
    assert plans[-1].version == "v9"
    assert ("taken as kernel parameters" in plans[-1].reason) == causal
    results = {}
    for direct in (False, True):
        monkeypatch.setattr(launcher, "DIRECT_LAUNCH", direct)
        for _ in range(2):          # the first call of a key goes through the dispatcher
            grads = numbaflash.attention_varlen_backward(dout, q, k, v, out, lse, cu, cu,
                                                         causal=causal)
        results[direct] = [to_host(g) for g in grads]
    for a, b in zip(results[False], results[True]):
        np.testing.assert_array_equal(a, b)
    if causal:
        found = [entry for key, entry in launcher._DIRECT.items()
                 if key[0].py_func.__name__ == "backward_dq_v9"
                 and "UniTuple" in str(entry.compiled.argument_types[-1])]
        assert found and all(entry.makers is not None for entry in found)


class _TooManyRegisters(Exception):
    """What a launch raises when the block needs more registers than the GPU has."""
    code = 701


def forward_v10():
    """The Python function of the stand-in kernel below (its name is the kernel's)."""


class _UnlaunchableKernel:
    """Stands in for a compiled kernel whose block is too large for its registers: the
    launch fails as on a GPU (CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES), and compile() reports
    what ptxas gave (forward v10's numbers at d = 128, asked for 384 threads a block)."""
    py_func = staticmethod(forward_v10)
    failure = _TooManyRegisters("CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES")

    def __getitem__(self, config):
        def launch(*args):
            raise self.failure
        return launch

    def typeof_pyval(self, value):
        return type(value)

    def compile(self, types):
        return type("Compiled", (), {"regs_per_thread": 172, "max_threads_per_block": 352})


class _FailingKernel(_UnlaunchableKernel):
    failure = RuntimeError("some other launch failure")


def test_a_block_with_too_many_registers_is_named_with_the_limit():
    """A caller's tiles can ask for a block that needs more registers than a GPU has (the
    launch fails with CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES): the error names the kernel, its
    threads and registers, the most threads it can launch, and what to do. Other launch
    failures pass through as they are."""
    with pytest.raises(ValueError, match=r"forward_v10 was not launched: 384 threads a block "
                                         r"at 172 registers.*at most 352 threads.*smaller tiles"):
        launcher.launch(_UnlaunchableKernel(), (4, 1), 384, (1.0,))
    with pytest.raises(RuntimeError, match="some other launch failure"):
        launcher.launch(_FailingKernel(), (4, 1), 384, (1.0,))
