"""What a newcomer meets first: a shape that cannot fit is refused with a MemoryError
before anything is allocated (instead of the OS killing the process), and a call that will
take long on the simulator says so first (SimulatorSlowWarning, with the estimate).

The big shapes here are never allocated: the inputs are objects with only ``shape`` and
``dtype`` (enough for validation and planning), and every test that expects a refusal
fails if anything reaches an allocation or a launch.
"""

import dataclasses
import math
import types
import warnings

import numpy as np
import pytest

import numbaflash
import numbaflash.api
from numbaflash import arrays, reference, validate
from numbaflash.policy import plan_backward, plan_forward
from numbaflash.masks import visible_band
from numbaflash.validate import SimulatorSlowWarning, check_attention_inputs

GiB = 2 ** 30
HUGE = (4, 32, 200000, 128)          # q, k, v of this shape: 39 GiB of float32 inputs


def shaped(shape, dtype=np.float32):
    """An input with a shape and a dtype and no data: validation and planning only."""
    return types.SimpleNamespace(shape=shape, dtype=np.dtype(dtype))


@pytest.fixture
def no_allocation(monkeypatch):
    """Fail the test if the API gets as far as copying or allocating an array."""
    def allocated(*args, **kwargs):
        raise AssertionError("an array was allocated; the memory check should have raised")
    for name in ("as_kernel_array", "device_empty", "filled"):
        monkeypatch.setattr(arrays, name, allocated)


@pytest.fixture
def free_memory(monkeypatch):
    """Pretend the host and the GPU each have 8 GiB free (the default; set .host/.device)."""
    free = types.SimpleNamespace(host=8 * GiB, device=8 * GiB)
    monkeypatch.setattr(validate, "available_host_bytes", lambda: free.host)
    monkeypatch.setattr(validate, "available_device_bytes", lambda: free.device)
    return free


# --- memory --------------------------------------------------------------------------------

def test_forward_memory_counts_copies_outputs_and_lse():
    q = shaped(HUGE)
    p = check_attention_inputs(q, q, q)
    parts = validate.forward_memory(p, plan_forward(p), dict(q=q, k=q, v=q), host=True)
    n = math.prod(HUGE)
    by_what = {what: (nbytes, where) for what, nbytes, where in parts}
    assert by_what["device copies of q, k, v"] == (3 * n * 4, "device")
    assert by_what["out"] == (n * 4, "device")
    assert by_what["lse"] == (n // 128 * 4, "device")
    assert by_what["out and lse copied to the host"] == (n * 4 + n // 128 * 4, "host")
    # device inputs: no copies in, nothing back
    parts = validate.forward_memory(p, plan_forward(p), dict(q=q, k=q, v=q), host=False)
    assert {what for what, _, _ in parts} == {"out", "lse"}


def test_backward_memory_counts_scratch_and_gradients():
    q = shaped((2, 4, 100, 16))
    k = shaped((2, 2, 60, 16))                                   # GQA: 2 K/V heads
    p = check_attention_inputs(q, k, k)
    parts = validate.backward_memory(p, plan_backward(p), {}, host=True)
    by_what = {what: nbytes for what, nbytes, _ in parts}
    q_bytes, kv_bytes = 2 * 4 * 100 * 16 * 4, 2 * 2 * 60 * 16 * 4
    assert by_what["dq"] == q_bytes and by_what["dk"] == by_what["dv"] == kv_bytes
    assert by_what["D = rowsum(dO * O) (scratch)"] == 2 * 4 * 100 * 4
    assert by_what["device copies of q, k, v, out, dout, lse"] == (
        3 * q_bytes + 2 * kv_bytes + 2 * 4 * 100 * 4)
    assert by_what["dq, dk, dv copied to the host"] == q_bytes + 2 * kv_bytes


def test_non_contiguous_host_inputs_count_their_copies():
    q = np.zeros((1, 2, 8, 4), np.float32)
    kt = np.zeros((1, 2, 4, 8), np.float32).swapaxes(-1, -2)     # (1, 2, 8, 4), strided
    p = check_attention_inputs(q, kt, kt)
    parts = validate.forward_memory(p, plan_forward(p), dict(q=q, k=kt, v=kt), host=True)
    assert ("a contiguous copy of k", kt.nbytes, "host") in parts
    assert not any(what == "a contiguous copy of q" for what, _, _ in parts)


def test_huge_forward_is_refused_before_anything_is_allocated(no_allocation, free_memory):
    q = shaped(HUGE)
    with pytest.raises(MemoryError) as info:
        numbaflash.attention(q, q, q)
    message = str(info.value)
    assert f"q of shape {HUGE} and k, v of shape {HUGE} (float32)" in message
    # the bytes needed and the bytes available, with what they are for
    assert f"and {8 * GiB:,} bytes (8.00 GiB) are available" in message
    assert "need" in message and "out" in message and "Nothing was allocated" in message


def test_huge_backward_is_refused_before_anything_is_allocated(no_allocation, free_memory):
    q, lse = shaped(HUGE), shaped(HUGE[:-1])
    with pytest.raises(MemoryError, match=r"attention_backward: q of shape \(4, 32, 200000, "
                                          r"128\).* need [\d,]+ bytes .*dq, dk, dv"):
        numbaflash.attention_backward(q, q, q, q, q, lse)


def test_the_message_names_the_memory_that_is_short(free_memory):
    q = shaped((1, 1, 1 << 20, 64))
    p = check_attention_inputs(q, q, q)
    parts = validate.forward_memory(p, plan_forward(p), {}, host=True)
    free_memory.host, free_memory.device = 1 << 40, 1 << 20        # plenty on the host
    with pytest.raises(MemoryError, match=r"of GPU memory, and 1,048,576 bytes"):
        validate.check_memory(p, parts, "gpu")
    free_memory.host, free_memory.device = 1 << 20, 1 << 40        # plenty on the GPU
    with pytest.raises(MemoryError, match=r"of host memory, and 1,048,576 bytes"):
        validate.check_memory(p, parts, "gpu")
    # On the simulator device arrays are host memory: all of it must fit on the host.
    with pytest.raises(MemoryError, match=r"host memory \(on the simulator device arrays"):
        validate.check_memory(p, parts, "simulator")
    free_memory.host = 1 << 40
    validate.check_memory(p, parts, "simulator")


def test_a_tiny_call_is_checked_and_refused_when_memory_is_short(monkeypatch, free_memory):
    """With the threshold off, the real wiring: a tiny call with "1000 bytes free" is
    refused before a launch, and runs when the memory is there."""
    monkeypatch.setattr(validate, "MEMORY_CHECK_MIN_BYTES", 0)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 9, 4)).astype(np.float32) for _ in range(3))
    free_memory.host = free_memory.device = 1000

    def launched(*args, **kwargs):
        raise AssertionError("a kernel was launched; the memory check should have raised")
    with monkeypatch.context() as m:
        m.setattr(numbaflash.api, "launch_forward", launched)
        with pytest.raises(MemoryError, match=r"\(1, 2, 9, 4\)"):
            numbaflash.attention(q, k, v)
    free_memory.host = free_memory.device = 1 << 30
    out = numbaflash.attention(q, k, v)
    np.testing.assert_allclose(out, reference.forward(q, k, v)[0], rtol=1e-5, atol=1e-6)


def test_a_normal_call_is_not_refused_with_the_real_free_memory():
    have = validate.available_host_bytes()
    assert have is None or have > 0
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 1, 12, 4)).astype(np.float32) for _ in range(3))
    out, lse = numbaflash.attention(q, k, v, return_lse=True)
    dq, dk, dv = numbaflash.attention_backward(out, q, k, v, out, lse)
    assert dq.shape == q.shape and dk.shape == k.shape


# --- time on the simulator -----------------------------------------------------------------

def simulator_plans(plans):
    """The same plans as if they ran on the simulator (the estimate reads only the shapes of
    grid, block and tiles), so these tests mean the same on a GPU machine."""
    plans = plans if isinstance(plans, tuple) else (plans,)
    return tuple(dataclasses.replace(plan, backend="simulator") for plan in plans)


def test_the_readme_shape_is_estimated_slow_and_warns():
    """(2, 8, 256, 64) took about 25 minutes per call on the simulator."""
    q = shaped((2, 8, 256, 64))
    p = check_attention_inputs(q, q, q)
    plans = simulator_plans(plan_forward(p))
    seconds = validate.simulator_seconds(p, plans, switch_interval=5e-3)
    assert seconds > 5 * validate.SIMULATOR_SLOW_S
    with pytest.warns(SimulatorSlowWarning, match=r"attention of q \(2, 8, 256, 64\), k and "
                                                  r"v \(2, 8, 256, 64\) will take about \d+ "
                                                  r"(minutes|hours|s) on the CUDA simulator"):
        assert validate.warn_if_slow(p, plans) > validate.SIMULATOR_SLOW_S


def test_a_slow_backward_warns():
    q = shaped((1, 4, 512, 32))
    p = check_attention_inputs(q, q, q, causal=True)
    with pytest.warns(SimulatorSlowWarning, match="attention_backward of q"):
        validate.warn_if_slow(p, simulator_plans(plan_backward(p)), "attention_backward")


def test_no_warning_on_a_gpu_or_for_empty_calls():
    q = shaped((2, 8, 256, 64))
    p = check_attention_inputs(q, q, q)
    gpu_plan = dataclasses.replace(plan_forward(p), backend="gpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error", SimulatorSlowWarning)
        assert validate.warn_if_slow(p, (gpu_plan,)) is None
        e = shaped((2, 8, 0, 64))
        pe = check_attention_inputs(e, q, q)
        assert validate.warn_if_slow(pe, simulator_plans(plan_forward(pe))) is None


def test_the_estimate_matches_its_calibration():
    """The estimate reproduces timings of the calibration (validate.py's comment) within a
    factor of 2, and scales as the work does."""
    def v5(shape, si, causal=False):
        # the simulator's default plan: forward v5 with (Br, Bc, TM, TN) = (8, 8, 2, 2)
        q = shaped(shape)
        p = check_attention_inputs(q, q, q, causal=causal)
        plans = simulator_plans(plan_forward(p, "v5", (8, 8, 2, 2)))
        return validate.simulator_seconds(p, plans, switch_interval=si)
    for shape, si, measured in [((1, 1, 64, 64), 5e-3, 4.18), ((1, 1, 64, 8), 5e-3, 2.26),
                                ((1, 1, 64, 8), 2e-4, 0.46)]:
        got = v5(shape, si)
        assert measured / 2 < got < measured * 2, (shape, si, got, measured)
    # causal: about half the work of the full square
    full, causal = v5((1, 2, 256, 16), 5e-3), v5((1, 2, 256, 16), 5e-3, causal=True)
    assert 0.4 < causal / full < 0.65
    assert v5((1, 2, 512, 16), 5e-3) > 3 * full


def test_visible_fraction():
    """The fraction of (query, key) pairs a causal mask or window leaves, as masks.py's
    dense mask counts them."""
    for Sq, Sk in ((100, 100), (50, 120), (120, 50)):
        q, k = shaped((1, 1, Sq, 8)), shaped((1, 1, Sk, 8))
        for options in (dict(causal="bottom_right"), dict(causal="top_left"),
                        dict(window_size=(10, 3)), dict(causal=True, window_size=(7, -1))):
            p = check_attention_inputs(q, k, k, **options)
            mask = visible_band(Sq, Sk, options.get("causal"), options.get("window_size"))
            assert validate.visible_fraction(p) == pytest.approx(mask.mean()), options
        assert validate.visible_fraction(check_attention_inputs(q, k, k)) == 1.0


def test_the_api_warns_before_it_allocates(no_allocation):
    """attention() on the simulator warns before anything is allocated: with the warning
    an error, a slow shape stops before the first copy."""
    if numbaflash.backend() != "simulator":
        pytest.skip("the API warns on the simulator only")
    q = shaped((2, 8, 256, 64))
    with warnings.catch_warnings():
        warnings.simplefilter("error", SimulatorSlowWarning)
        with pytest.raises(SimulatorSlowWarning, match="will take about"):
            numbaflash.attention(q, q, q)


def test_a_tiny_call_does_not_warn():
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((1, 1, 10, 4)).astype(np.float32) for _ in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("error", SimulatorSlowWarning)
        out, lse = numbaflash.attention(q, k, v, return_lse=True)
        numbaflash.attention_backward(out, q, k, v, out, lse)
    p = check_attention_inputs(q, k, v)
    assert validate.simulator_seconds(p, simulator_plans(plan_forward(p))) < 5
