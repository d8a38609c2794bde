"""The simulator's warp collectives and tensor-core instructions.

Numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1) runs every CUDA thread of a block as a
Python thread, but it has no warp shuffles and cannot run inline PTX, so on its own it
cannot run the kernels a GPU runs by default (forward v3, v6 to v9, backward v5 and v6).
This module supplies both, with the GPU's semantics and fragment layouts, so that those
kernels run on the simulator unchanged:

* **A warp's rendezvous.** The 32 lanes of a warp (threads ``32 w`` to ``32 w + 31`` of
  the block, by linear thread index) meet at a barrier of their own; each leaves its
  operand, waits for the others, and takes what the instruction gives its lane. This is
  what ``shfl_sync``, ``shfl_xor_sync`` and the ``mma`` instructions do on a GPU, where
  the lanes of a warp exchange registers.
* **The tensor cores' arithmetic.** ``mma_tf32`` (m16n8k8, TF32 inputs) reads only the
  19 bits of each operand that TF32 keeps (the GPU ignores the other 13), multiplies
  exactly and adds in float64 before rounding the sum to float32; ``mma_f16`` (m16n8k16)
  multiplies float16 values (exact in float32) the same way. The GPU's tensor cores add
  in an order and with a rounding of their own, so results agree with a GPU within a few
  float32 ulps of the sum, not bitwise.
* **Rounding and packing.** ``tf32_round`` is ``cvt.rna.tf32.f32`` (to nearest, ties away
  from zero; NaN and inf kept), ``tf32_round_finite`` the same two integer operations the
  GPU kernel does on the bits, ``pack_f16x2`` ``cvt.rn.f16x2.f32`` (to nearest even).
* **Memory helpers.** ``flat_load``, ``load_pair``, ``store_pair`` and ``load_b32`` are
  the loads they name; ``cp_async`` copies at once (the copy has landed before any wait,
  one of the orders a GPU allows) and ``cp_async_wait_all`` has nothing left to wait for.

kernels/ptx.py binds these names in place of its intrinsics when the simulator is on,
and ``install`` adds the shuffles to the simulator's ``cuda`` module, so
kernel code reads the same on both. Each lane computes what the instruction gives it
from all the lanes' operands; ``tests/test_simulated_ptx.py`` checks every function
against NumPy here, and the same tests run on a GPU against the real instructions.
"""

import sys
import threading
import weakref

import numpy as np

WARP = 32
_TIMEOUT_S = 0.5        # a lane's wait at the rendezvous, between checks for an abort


class _Warp:
    """The meeting place of one warp's 32 lanes: their operands, and a barrier."""

    def __init__(self):
        self.slots = [None] * WARP
        self.barrier = threading.Barrier(WARP)


_WARPS = weakref.WeakKeyDictionary()    # the simulator's block manager -> {warp: _Warp}
_WARPS_LOCK = threading.Lock()


def _here():
    """(the simulator thread running this lane, its lane, its warp's meeting place)."""
    thread = threading.current_thread()
    manager = getattr(thread, "_manager", None)
    if manager is None:
        raise RuntimeError("a warp collective was called outside a simulated kernel")
    warp, lane = divmod(thread.thread_id, WARP)
    with _WARPS_LOCK:
        warps = _WARPS.setdefault(manager, {})
        if warp not in warps:
            warps[warp] = _Warp()
        return thread, lane, warps[warp]


def _wait(thread, barrier):
    """Wait for the other lanes; give up (RuntimeError) if the simulator aborts the
    block, as it does when another thread raised."""
    while True:
        try:
            barrier.wait(_TIMEOUT_S)
            return
        except threading.BrokenBarrierError:
            if getattr(thread, "abort", False):
                raise RuntimeError("abort flag set while waiting for the warp") from None
            barrier.reset()


def exchange(value):
    """Every lane of the calling warp leaves ``value``; each gets back the list of all
    32 lanes' values, by lane. Every lane of the warp must call it (as on a GPU, where a
    warp collective with a full mask waits for all 32 lanes)."""
    thread, lane, warp = _here()
    warp.slots[lane] = value
    _wait(thread, warp.barrier)         # wait until every lane has left its value
    values = list(warp.slots)
    _wait(thread, warp.barrier)         # wait until every lane has read them all
    return values, lane


# --- warp shuffles -------------------------------------------------------------------


def shfl_sync(mask, value, src_lane):
    """``cuda.shfl_sync``: the value of lane ``src_lane`` (mod 32)."""
    values, _ = exchange(value)
    return values[int(src_lane) % WARP]


def shfl_xor_sync(mask, value, lane_mask):
    """``cuda.shfl_xor_sync``: the value of lane ``lane ^ lane_mask``."""
    values, lane = exchange(value)
    return values[lane ^ int(lane_mask)]


def install():
    """Give the simulator's ``cuda`` module (the one kernels see while they run) the two
    shuffles the kernels use, and a ``cuda.shared.array`` that takes an ``alignment``
    (the tensor-core kernels ask 16 bytes of their dynamic shared array for their 8-byte
    paired loads; the stand-ins load element by element, so any alignment serves).
    Harmless to call twice."""
    from numba.cuda.simulator import kernelapi
    fake = kernelapi.FakeCUDAModule
    fake.shfl_sync = staticmethod(shfl_sync)
    fake.shfl_xor_sync = staticmethod(shfl_xor_sync)
    if not getattr(kernelapi.FakeCUDAShared.array, "_numbaflash_locked", False):
        kernelapi.FakeCUDAShared.array = _shared_array


_SHARED_LOCK = threading.Lock()


def _shared_array(self, shape, dtype, alignment=None):
    """The simulator's ``cuda.shared.array`` (numba-cuda 0.30's FakeCUDAShared.array),
    with two changes. It takes an ``alignment`` and ignores it. And its lookup of a
    static array, one NumPy array per call site (file, line) and launch, holds a lock:
    the original checks and then sets without one, and when the interpreter switches
    threads between the two, two threads of a block get different arrays and the block
    computes from uninitialised memory (about 1 launch in 1000 of forward v2)."""
    from numba.core import types
    from numba.np import numpy_support
    if isinstance(dtype, types.Type):
        dtype = numpy_support.as_dtype(dtype)
    if shape == 0:          # dynamic shared memory: every such array shares one buffer
        count = self._dynshared_size // dtype.itemsize
        return np.frombuffer(self._dynshared.data, dtype=dtype, count=count)
    frame = sys._getframe(1)
    caller = (frame.f_code.co_filename, frame.f_lineno)
    with _SHARED_LOCK:
        res = self._allocations.get(caller)
        if res is None:
            res = np.empty(shape, dtype)
            self._allocations[caller] = res
    return res


_shared_array._numbaflash_locked = True


# --- rounding and packing ------------------------------------------------------------


def _bits(x):
    return np.asarray(x, np.float32).view(np.uint32)


def _from_bits(bits):
    return np.asarray(bits, np.uint32).view(np.float32)[()]


def tf32_round(x):
    """``cvt.rna.tf32.f32``: x to 10 mantissa bits, to nearest, ties away from zero;
    NaN and inf as they are."""
    x = np.float32(x)
    if not np.isfinite(x):
        return x
    return _from_bits((_bits(x) + np.uint32(0x1000)) & np.uint32(0xFFFFE000))


def tf32_round_finite(x):
    """The GPU kernels' bit trick for a finite x: add half of TF32's last place, clear
    the 13 bits TF32 drops (what it does to NaN or inf bits is left as it falls)."""
    return _from_bits((_bits(x) + np.uint32(0x1000)) & np.uint32(0xFFFFE000))


def _tf32_operand(x):
    """What the tensor cores read of a 32-bit operand register: its top 19 bits."""
    return np.float64(_from_bits(_bits(x) & np.uint32(0xFFFFE000)))


def pack_f16x2(lo, hi):
    """``cvt.rn.f16x2.f32``: lo and hi to float16 (to nearest even), lo in the low half."""
    halves = np.array([lo, hi], np.float32).astype(np.float16)
    return np.uint32(halves.view(np.uint32)[0])


def _unpack_f16x2(word):
    """The two float16 values of a 32-bit word, low half first, as float64."""
    return np.array([word], np.uint32).view(np.float16).astype(np.float64)


# --- the tensor cores ----------------------------------------------------------------


def mma_tf32(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """``mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32`` (kernels/ptx.py gives the
    fragment layout): this lane's (d0, d1, d2, d3) of D = A B + C."""
    frags, lane = exchange((a0, a1, a2, a3, b0, b1))
    A = np.empty((16, 8))
    B = np.empty((8, 8))
    for other, (x0, x1, x2, x3, y0, y1) in enumerate(frags):
        g, t = divmod(other, 4)
        A[g, t], A[g + 8, t] = _tf32_operand(x0), _tf32_operand(x1)
        A[g, t + 4], A[g + 8, t + 4] = _tf32_operand(x2), _tf32_operand(x3)
        B[t, g], B[t + 4, g] = _tf32_operand(y0), _tf32_operand(y1)
    return _rows_of_d(A, B, lane, c0, c1, c2, c3)


def mma_f16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """``mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32`` (kernels/ptx.py gives the
    fragment layout; each word two float16 neighbours): this lane's (d0, d1, d2, d3)."""
    frags, lane = exchange((a0, a1, a2, a3, b0, b1))
    A = np.empty((16, 16))
    B = np.empty((16, 8))
    for other, (x0, x1, x2, x3, y0, y1) in enumerate(frags):
        g, t = divmod(other, 4)
        A[g, 2 * t:2 * t + 2], A[g + 8, 2 * t:2 * t + 2] = _unpack_f16x2(x0), _unpack_f16x2(x1)
        A[g, 2 * t + 8:2 * t + 10] = _unpack_f16x2(x2)
        A[g + 8, 2 * t + 8:2 * t + 10] = _unpack_f16x2(x3)
        B[2 * t:2 * t + 2, g], B[2 * t + 8:2 * t + 10, g] = _unpack_f16x2(y0), _unpack_f16x2(y1)
    return _rows_of_d(A, B, lane, c0, c1, c2, c3)


def _rows_of_d(A, B, lane, c0, c1, c2, c3):
    """This lane's four entries of D = A B + C (m16n8 layout), the products summed in
    float64 and each entry rounded to float32 once."""
    g, t = divmod(lane, 4)
    rows = (g, g, g + 8, g + 8)
    cols = (2 * t, 2 * t + 1, 2 * t, 2 * t + 1)
    return tuple(np.float32(A[r] @ B[:, c] + np.float64(np.float32(acc)))
                 for r, c, acc in zip(rows, cols, (c0, c1, c2, c3)))


# --- loads, stores and copies ---------------------------------------------------------


def flat_load(A, n):
    """A.ravel()[n] of a C-contiguous array."""
    return A.reshape(-1)[n]


def load_pair(A, n):
    """(A[n], A[n + 1]) of a 1D float32 array."""
    return A[n], A[n + 1]


def store_pair(A, n, x, y):
    """A[n], A[n + 1] = x, y for a 1D float32 array."""
    A[n] = x
    A[n + 1] = y


def load_b32(A, n):
    """The 32-bit word holding A[n] (low half) and A[n + 1] of a 1D float16 array."""
    return np.uint32(np.array([A[n], A[n + 1]], np.float16).view(np.uint32)[0])


def cp_async(S, n, A, m):
    """S[n] = A.ravel()[m], at once (see the module docstring)."""
    S[n] = A.reshape(-1)[m]


def cp_async_wait_all():
    """Nothing to wait for: cp_async has copied already."""
