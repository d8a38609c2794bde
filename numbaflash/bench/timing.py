"""Counting and timing: FLOPs of a pass, the median time of a call, its extra memory.

On a GPU the time of a call is measured between two CUDA events; under the CUDA
simulator there are no event times, and Python's wall clock stands in (it measures the
simulated threads running on the CPU, not a GPU).
"""

import statistics
import time

import numpy as np
from numba import cuda

from .cases import PASSES
from .library import simulating

# FLOPs of a pass, in units of the forward's (docs/performance.md): the backward does 2.5x
# the forward's matrix products (five N x N x d products against two).
PASS_FLOP_FACTOR = {"forward": 1.0, "backward": 2.5, "fwd+bwd": 3.5}

SIMULATOR_WARNING = ("times under the CUDA simulator measure Python running the simulated "
                     "threads on the CPU, not a GPU: they say nothing about speed")


def flops(B, H, Sq, Sk, d, causal, what):
    """Floating-point operations of one pass, by flash-attention's benchmark convention.

    forward = 4 * B * H * Sq * Sk * d (two matrix products of 2 * Sq * Sk * d each);
    causal with Sq == Sk counts half (the convention's N^2 / 2, not N (N + 1) / 2);
    causal with Sq != Sk counts the visible (query, key) pairs of the bottom-right mask
    instead of Sq * Sk. backward = 2.5 x forward, fwd+bwd ("forward + backward") = 3.5 x.

    >>> flops(2, 16, 4096, 4096, 64, False, "forward")
    137438953472.0
    """
    if what not in PASS_FLOP_FACTOR:
        raise ValueError(f"what must be one of {PASSES}; got {what!r}")
    pairs = float(Sq) * float(Sk)
    if causal:
        if Sq == Sk:
            pairs /= 2
        else:
            # Row r sees keys 0 .. r + Sk - Sq (bottom-right), clipped to [0, Sk].
            pairs = float(np.clip(np.arange(Sq) + (Sk - Sq) + 1, 0, Sk).sum())
    return PASS_FLOP_FACTOR[what] * 4.0 * B * H * pairs * d


def time_ms(fn, repeats=20, warmup=3):
    """Median milliseconds of ``fn()`` over ``repeats`` runs, after ``warmup`` runs.

    On a GPU each run sits between two CUDA events recorded on the default stream (where
    numbaflash and PyTorch both launch unless told otherwise), so the time is the GPU's,
    from the first launch to the last, plus any launch overhead in between. Under the
    simulator there are no event times (Numba returns -1), so ``time.perf_counter`` is
    used: it measures Python, not a GPU.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0; got {repeats}, {warmup}")
    for _ in range(warmup):
        fn()
    cuda.synchronize()
    times = []
    if simulating():
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    start, end = cuda.event(), cuda.event()
    for _ in range(repeats):
        start.record()
        fn()
        end.record()
        end.synchronize()          # wait until the GPU has passed the end event
        times.append(cuda.event_elapsed_time(start, end))
    return statistics.median(times)


def time_ms_queued(fn, calls=20, rounds=5, warmup=3):
    """Milliseconds a call of ``fn()`` when ``calls`` calls run back to back: the median
    over ``rounds`` of (the time between two CUDA events around the calls) / ``calls``.

    The host does not wait for each call's kernels before it prepares the next, as in a
    decoding loop or any loop that does not read its results at once: while the GPU runs
    one call's kernels the host prepares the next, and the time is the GPU's whenever
    the host keeps ahead. ``time_ms`` times each call alone (the GPU idle while the host
    prepares it). Under the simulator, the wall time of the calls over ``calls``.
    """
    if calls < 1 or rounds < 1 or warmup < 0:
        raise ValueError(f"calls and rounds must be >= 1 and warmup >= 0; got {calls}, "
                         f"{rounds}, {warmup}")
    for _ in range(warmup):
        fn()
    cuda.synchronize()
    times = []
    for _ in range(rounds):
        if simulating():
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            times.append((time.perf_counter() - t0) * 1e3 / calls)
            continue
        start, end = cuda.event(), cuda.event()
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(cuda.event_elapsed_time(start, end) / calls)
    return statistics.median(times)


def _timer_name():
    return ("simulator: Python wall time (not a GPU)" if simulating()
            else "CUDA events (numba), median")


def _nbytes(result):
    """Bytes of the arrays in ``result`` (an array, or a tuple/list of them)."""
    if isinstance(result, (tuple, list)):
        return sum(_nbytes(r) for r in result)
    if hasattr(result, "nbytes"):
        return int(result.nbytes)
    if hasattr(result, "element_size"):                 # a torch tensor
        return int(result.element_size() * result.numel())
    return 0


def extra_memory_bytes(fn):
    """Device memory one call of ``fn()`` takes beyond the arrays it returns, in bytes.

    Reads the driver's free memory before and after the call, with deallocation deferred
    (``cuda.defer_cleanup``) so nothing the call allocates is freed before the second
    reading; whatever the call returns (its outputs) is subtracted. The driver hands out
    memory in pages, so small amounts read as 0 or a page (about 2 MiB). This sees
    memory that Numba allocates; PyTorch's caching allocator needs
    ``pytorch.torch_extra_memory_bytes``. Returns None under the simulator, which has no
    device memory to read.
    """
    if simulating():
        return None
    cuda.synchronize()
    ctx = cuda.current_context()
    ctx.deallocations.clear()                 # free what earlier calls left pending first
    with cuda.defer_cleanup():
        free_before = ctx.get_memory_info().free
        result = fn()
        cuda.synchronize()
        free_after = ctx.get_memory_info().free
    return int(free_before - free_after - _nbytes(result))
