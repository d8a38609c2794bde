"""The simulator's warp collectives and tensor-core instructions.

Numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1) runs every CUDA thread of a block as a
Python thread, but it has no warp shuffles and cannot run inline PTX, so on its own it
cannot run the kernels a GPU runs by default (forward v3, v6 to v9, backward v5 and v6).
This module supplies both, with the GPU's semantics and fragment layouts, so that those
kernels run on the simulator unchanged:

* **A warp's rendezvous.** The 32 lanes of a warp (threads ``32 w`` to ``32 w + 31`` of
  the block, by linear thread index) meet at a barrier of their own; each leaves its
  operand, the last to arrive computes the instruction for the whole warp at once, and
  each takes what the instruction gives its lane. This is what ``shfl_sync``,
  ``shfl_xor_sync`` and the ``mma`` instructions do on a GPU, where the lanes of a warp
  exchange registers. A lane that can never arrive (finished, or waiting at
  ``syncthreads``) makes the collective raise instead of waiting for ever.
* **The tensor cores' arithmetic.** ``mma_tf32`` (m16n8k8, TF32 inputs) reads only the
  19 bits of each operand that TF32 keeps (the GPU ignores the other 13), multiplies
  exactly and adds in float64 before rounding the sum to float32; ``mma_f16`` (m16n8k16)
  multiplies float16 values (exact in float32) the same way. The GPU's tensor cores add
  in an order and with a rounding of their own, so results agree with a GPU within a few
  float32 ulps of the sum, not bitwise.
* **Rounding and packing.** ``tf32_round`` is ``cvt.rna.tf32.f32`` (to nearest, ties away
  from zero; NaN and inf kept), ``tf32_round_finite`` the same two integer operations the
  GPU kernel does on the bits, ``pack_f16x2`` ``cvt.rn.f16x2.f32`` (to nearest even).
* **Memory helpers.** ``flat_load``, ``flat_load_wide``, ``load_pair``, ``store_pair``
  and ``load_b32`` are the loads they name (``flat_load_wide`` raises on an address that
  is not 8-byte aligned, where a GPU's vector load faults); ``cp_async`` copies at once
  (the copy has landed before any wait, one of the orders a GPU allows) and
  ``cp_async_wait_all`` has nothing left to wait for; ``cp_async16`` likewise (with
  ``cp_async_commit`` and ``cp_async_wait_group`` doing nothing), raising on an address
  that is not 16-byte aligned. ``ldmatrix_x4`` and ``ldmatrix_x4_trans`` are warp
  collectives: each lane leaves its row address, the last lane builds the four 8 x 8
  matrices and hands every lane its registers (raising on a row that is not 16-byte
  aligned, where a GPU faults).

kernels/ptx.py binds these names in place of its intrinsics when the simulator is on,
and ``install`` adds the shuffles to the simulator's ``cuda`` module, so
kernel code reads the same on both. ``tests/test_simulated_ptx.py`` checks every
function against NumPy here, and the same tests run on a GPU against the real
instructions.
"""

import contextlib
import sys
import threading
import time
import weakref

import numpy as np

WARP = 32
_POLL_S = 0.5           # how often a waiting lane looks for an abort or a stuck warp


class _Warp:
    """The meeting place of one warp's 32 lanes. Each collective is one generation: the
    lanes leave their operands in ``slots``; the last to arrive computes what every lane
    gets (``results``) and wakes the others. Operands and results are kept for two
    generations (by parity), so a lane that has left one collective and enters the next
    never overwrites what a slower lane has yet to read: to finish the next one, the
    slower lane must arrive there, after it has read."""

    def __init__(self):
        self.lock = threading.Lock()
        self.slots = ([None] * WARP, [None] * WARP)
        self.results = [None, None]
        self.arrived = [False] * WARP
        self.count = 0
        self.generation = 0
        self.sleepers = []      # the locks the waiting lanes sleep on


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


def _stuck_lanes(thread, warp):
    """The lanes of ``thread``'s warp that can never arrive, as (lane, state, thread):
    finished, or waiting at ``syncthreads`` (on a GPU, a collective with a full mask that
    some lanes skip is undefined; here it would wait for ever). ``install`` has each
    simulated thread enter itself in its block's table of lanes and mark when it
    finishes. Called holding the warp's lock; it reads the lanes holding the block's
    lock too, under which a barrier opens: a barrier being opened wakes its threads one
    by one, and read without that lock, a lane the opener has not reached yet would look
    stuck to a lane it has already woken (seen under a loaded CPU, where the opener can
    wait seconds for the interpreter between two wake-ups). With both locks the reading
    is exact: a lane at a barrier that has not opened, or finished, while this lane
    waits at a collective it has not reached, can never arrive."""
    block = thread._manager._numbaflash_block
    first = thread.thread_id - thread.thread_id % WARP
    stuck = []
    with block.lock:
        for lane in range(WARP):
            other = block.lanes.get(first + lane)
            if other is None or warp.arrived[lane] or other.exception is not None:
                continue        # a lane that raised: the launch reports that, and aborts
            if getattr(other, "_numbaflash_finished", False):
                stuck.append((lane, "finished", other))
            elif other.syncthreads_blocked:
                stuck.append((lane, "at syncthreads", other))
    return stuck


def _where(thread):
    """Where ``thread`` is in kernel code: the innermost frame outside this module and
    the simulator, as "file:line" (for the stuck-lane error)."""
    frame = sys._current_frames().get(thread.ident)
    while frame is not None:
        name = frame.f_code.co_filename
        if name != __file__ and "simulator" not in name and "threading" not in name:
            return f"{name.rsplit('/', 1)[-1]}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


def exchange(value, combine):
    """A warp collective: every lane of the calling warp leaves ``value``; the last lane
    to arrive calls ``combine(values)`` once, with the 32 lanes' values by lane, and it
    returns what each lane gets, by lane; this lane's share is returned. Every lane of
    the warp must call it (as on a GPU, where a collective with a full mask waits for all
    32 lanes). Raises RuntimeError if the simulator aborts the block (another thread
    raised), or if a lane of the warp can never arrive (a kernel bug)."""
    thread, lane, warp = _here()
    with warp.lock:
        generation = warp.generation
        parity = generation & 1
        if warp.arrived[lane]:              # the simulator's own bookkeeping gone wrong
            raise RuntimeError(
                f"warp collective: lane {lane} of warp {thread.thread_id // WARP} arrived "
                f"twice at collective {generation} ({_where(thread)})")
        warp.slots[parity][lane] = value
        warp.arrived[lane] = True
        warp.count += 1
        if warp.count == WARP:              # the last lane: compute, wake the others
            warp.results[parity] = combine(warp.slots[parity])
            warp.count = 0
            warp.arrived = [False] * WARP
            warp.generation += 1
            for sleeper in warp.sleepers:
                sleeper.release()
            warp.sleepers = []
            return warp.results[parity][lane]
        sleeper = _sleeper(thread)
        sleeper.acquire()                   # held until the last lane releases it
        warp.sleepers.append(sleeper)
    started = time.monotonic()
    while not sleeper.acquire(timeout=_POLL_S):
        with warp.lock:
            if warp.generation != generation:
                continue                    # released just now: the acquire succeeds
            if getattr(thread, "abort", False):
                raise RuntimeError("abort flag set while waiting for the warp")
            stuck = _stuck_lanes(thread, warp)
            if stuck:
                lanes = [f"{n} ({state})" if state == "finished" else
                         f"{n} ({state}, {_where(other)})" for n, state, other in stuck]
                raise RuntimeError(
                    f"warp collective: lanes {lanes} of warp {thread.thread_id // WARP} "
                    f"never reach it (lane {lane} waited {time.monotonic() - started:.1f} "
                    f"s at collective {generation}, {_where(thread)}); every lane of a "
                    f"warp must take part")
    sleeper.release()                       # ready for the next collective
    if warp.generation == generation:       # woken before the collective completed
        raise RuntimeError(
            f"warp collective: lane {lane} of warp {thread.thread_id // WARP} was woken "
            f"before collective {generation} completed ({_where(thread)})")
    return warp.results[parity][lane]


# --- warp shuffles -------------------------------------------------------------------


def shfl_sync(mask, value, src_lane):
    """``cuda.shfl_sync``: the value of lane ``src_lane`` (mod 32)."""
    return exchange((value, int(src_lane)), _shuffled)


def shfl_xor_sync(mask, value, lane_mask):
    """``cuda.shfl_xor_sync``: the value of lane ``lane ^ lane_mask``."""
    return exchange((value, int(lane_mask)), _xor_shuffled)


def _shuffled(slots):
    return [slots[src % WARP][0] for _, src in slots]


def _xor_shuffled(slots):
    return [slots[lane ^ lane_mask][0] for lane, (_, lane_mask) in enumerate(slots)]


def install():
    """Give the simulator's ``cuda`` module (the one kernels see while they run) the two
    shuffles the kernels use, and a ``cuda.shared.array`` that takes an ``alignment``
    (the tensor-core kernels ask 16 bytes of their dynamic shared array for their 8-byte
    paired loads; the stand-ins load element by element, so any alignment serves); and
    give its blocks a barrier that wakes threads instead of polling them (``_run_block``).
    Harmless to call twice."""
    from numba.cuda.simulator import kernel, kernelapi
    fake = kernelapi.FakeCUDAModule
    fake.shfl_sync = staticmethod(shfl_sync)
    fake.shfl_xor_sync = staticmethod(shfl_xor_sync)
    if not getattr(kernel.BlockManager.run, "_numbaflash", False):
        _BlockThread[0] = kernel.BlockThread
        kernel.BlockThread.run = _tracked_run(kernel.BlockThread.run)
        kernel.BlockThread.syncthreads = _syncthreads
        kernel.BlockManager.run = _run_block
        kernel.swapped_cuda_module = _swapped_cuda_module
    if not getattr(kernelapi.FakeCUDAShared.array, "_numbaflash_locked", False):
        kernelapi.FakeCUDAShared.array = _shared_array


# --- the ``cuda`` a kernel's module sees --------------------------------------------------
#
# While a kernel or device function runs, the simulator replaces the ``cuda`` module in
# the globals of the function's Python module by its fake one, and puts the original back
# when the function returns. numba-cuda 0.30 does that per call and per thread, without
# counting: when two threads of a block are in device functions of one module, the first
# to return puts the real ``cuda`` back while the other still runs there, which then
# finds ``cuda.shfl_xor_sync`` or ``cuda.syncthreads`` missing or the real thing. The
# replacement below counts the calls per module: the first swaps, the last puts back.

_SWAPS = {}     # id(module globals) -> [calls inside, original entries, fake module]
_SWAPS_LOCK = threading.Lock()


@contextlib.contextmanager
def _swapped_cuda_module(fn, fake_cuda_module):
    """The simulator's ``swapped_cuda_module``, counting the calls inside (above). A call
    with another launch's fake module (threads of an aborted launch may still be
    finishing) swaps that one in and starts a new count."""
    from numba import cuda
    globs = fn.__globals__
    key = id(globs)
    with _SWAPS_LOCK:
        entry = _SWAPS.get(key)
        if entry is None or entry[2] is not fake_cuda_module:
            original = entry[1] if entry is not None else {
                name: value for name, value in globs.items() if value is cuda}
            globs.update({name: fake_cuda_module for name in original})
            entry = _SWAPS[key] = [0, original, fake_cuda_module]
        entry[0] += 1
    try:
        yield
    finally:
        with _SWAPS_LOCK:
            entry[0] -= 1
            if entry[0] == 0 and _SWAPS.get(key) is entry:
                globs.update(entry[1])
                del _SWAPS[key]


# --- the block's threads and its barrier ------------------------------------------------
#
# numba-cuda's simulator runs a block as one Python thread per CUDA thread, and its block
# manager finds out who waits at ``syncthreads`` by polling every thread in a loop that
# never sleeps: the manager holds the interpreter for its whole switch interval between
# any two threads' turns. The replacement below counts arrivals instead, with the same
# rules: a barrier opens when every thread that has not finished is waiting at it, the
# first exception in a thread is raised by the launch, and the other threads are told to
# abort (they raise at their next barrier). Measured on 64 threads: lab journal,
# "simulator speed".

_BlockThread = [None]           # the simulator's BlockThread class, once installed


class _Block:
    """One simulated block: its threads by linear index, how many have not finished,
    and who waits at its barrier."""

    def __init__(self, threads):
        self.lock = threading.Lock()
        self.lanes = {t.thread_id: t for t in threads}
        self.live = len(threads)
        self.waiting = []           # threads asleep at syncthreads
        self.done = threading.Event()   # every thread finished, or one raised
        self.failed = None          # the first thread that raised
        self.barriers = 0           # how many times the barrier has opened


def _run_block(self, grid_point, *args):
    """BlockManager.run: start the block's threads, wait until they finish or one raises
    (then raise the first exception raised, in time)."""
    def target():
        self._f(*args)

    threads = [_BlockThread[0](target, self, grid_point, point, self._debug)
               for point in np.ndindex(*self._block_dim)]
    block = self._numbaflash_block = _Block(threads)
    for t in threads:
        t.start()
    block.done.wait()
    if block.failed is not None:
        with block.lock:
            for t in threads:
                t.abort = True
            _open_barrier(block)
        error, traceback = block.failed.exception
        raise error.with_traceback(traceback)


_run_block._numbaflash = True


def _sleeper(thread):
    """The lock ``thread`` sleeps on at a barrier or a warp collective (unlocked between
    waits; whoever wakes it releases it)."""
    sleeper = thread.__dict__.get("_numbaflash_sleeper")
    if sleeper is None:
        sleeper = thread._numbaflash_sleeper = threading.Lock()
    return sleeper


def _open_barrier(block):
    """Wake every thread waiting at ``syncthreads`` (holding ``block.lock``)."""
    block.barriers += 1
    for t in block.waiting:
        t.syncthreads_blocked = False
        t._numbaflash_sleeper.release()
    block.waiting = []


def _syncthreads(self):
    """BlockThread.syncthreads: wait until every thread of the block that has not
    finished is here."""
    if self.abort:
        raise RuntimeError("abort flag set on syncthreads call")
    block = self._manager._numbaflash_block
    sleeper = _sleeper(self)
    with block.lock:
        barrier = block.barriers
        if len(block.waiting) + 1 == block.live:
            _open_barrier(block)        # the last one in
            sleeper = None
        else:
            sleeper.acquire()
            self.syncthreads_blocked = True
            block.waiting.append(self)
    if sleeper is not None:
        sleeper.acquire()               # released by the last thread in (or an abort)
        sleeper.release()
    if self.abort:
        raise RuntimeError("abort flag set on syncthreads clear")
    if block.barriers == barrier:       # the simulator's own bookkeeping gone wrong
        raise RuntimeError(f"syncthreads: thread {self.thread_id} was woken before the "
                           f"barrier opened")


def _tracked_run(run):
    """BlockThread.run, marking the thread finished when it returns or raises: the
    barrier stops waiting for it, a warp waiting at a collective can tell that it will
    never come (_stuck_lanes), and the launch ends when the last thread ends or one
    raises."""
    def tracked(self):
        try:
            run(self)
        finally:
            block = self._manager._numbaflash_block
            with block.lock:
                self._numbaflash_finished = True
                block.live -= 1
                if self.exception is not None and block.failed is None:
                    block.failed = self         # the launch raises this one
                if block.failed is not None or block.live == 0:
                    block.done.set()
                elif block.waiting and len(block.waiting) == block.live:
                    _open_barrier(block)
    return tracked


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


def exp2_approx(x):
    """``ex2.approx.ftz.f32``: 2^x in float32, 0 where it falls below 2^-126 (the GPU's
    instruction flushes subnormal results; its last bit may differ from this one's)."""
    with np.errstate(over="ignore"):
        y = np.float32(np.exp2(np.float64(x)))
    return np.float32(0) if abs(y) < np.float32(2.0 ** -126) else y


def fmax(x, y):
    """``max.f32``: the larger of x and y, the other one if either is NaN."""
    if np.isnan(x):
        return np.float32(y)
    if np.isnan(y):
        return np.float32(x)
    return np.float32(x if x > y else y)


def warp_min_i32(x):
    """``redux.sync.min.s32`` over the full warp: the smallest of the 32 lanes' values, in
    every lane (a warp collective: every lane must call it)."""
    return exchange(np.int32(x), lambda slots: [min(slots)] * WARP)


def pack_f16x2(lo, hi):
    """``cvt.rn.f16x2.f32``: lo and hi to float16 (to nearest even), lo in the low half."""
    halves = np.array([lo, hi], np.float32).astype(np.float16)
    return np.uint32(halves.view(np.uint32)[0])


def f32_from_bits(u):
    """The float32 whose bits are the uint32 u."""
    return np.float32(_from_bits(u))


def _bfloat16_bits(x):
    """x (float32) to bfloat16 (to nearest even) as its 16 bits, as ``cvt.rn.bf16.f32``
    rounds: a NaN becomes the canonical NaN 0x7FFF."""
    u = int(_bits(x))
    if np.isnan(np.float32(x)):
        return 0x7FFF
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF


def pack_bf16x2(lo, hi):
    """``cvt.rn.bf16x2.f32``: lo and hi to bfloat16 (to nearest even), lo in the low half."""
    return np.uint32(_bfloat16_bits(lo) | (_bfloat16_bits(hi) << 16))


# --- the tensor cores ----------------------------------------------------------------


# Where each lane's fragment registers sit in the m16n8 tiles (kernels/ptx.py): lane
# = 4 g + t; A's registers at rows (g, g + 8, g, g + 8) and k columns (t, t, t + 4, t + 4)
# (m16n8k8; for m16n8k16 each register holds the pair of columns 2 t, 2 t + 1, then
# 2 t + 8, 2 t + 9), B's at k rows (t, t + 4) (pairs 2 t, 2 t + 8) and column g, C's and
# D's at rows (g, g, g + 8, g + 8) and columns (2 t, 2 t + 1, 2 t, 2 t + 1).
_G, _T = np.divmod(np.arange(WARP), 4)
_D_ROWS = np.stack([_G, _G, _G + 8, _G + 8], axis=1)            # (lane, register)
_D_COLS = np.stack([2 * _T, 2 * _T + 1, 2 * _T, 2 * _T + 1], axis=1)


def mma_tf32(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """``mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32`` (kernels/ptx.py gives the
    fragment layout): this lane's (d0, d1, d2, d3) of D = A B + C."""
    return exchange((a0, a1, a2, a3, b0, b1, c0, c1, c2, c3), _mma_tf32_warp)


def mma_f16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """``mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32`` (kernels/ptx.py gives the
    fragment layout; each word two float16 neighbours): this lane's (d0, d1, d2, d3)."""
    return exchange((a0, a1, a2, a3, b0, b1, c0, c1, c2, c3), _mma_f16_warp)


def mma_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """``mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32`` (as mma_f16; each word two
    bfloat16 neighbours): this lane's (d0, d1, d2, d3)."""
    return exchange((a0, a1, a2, a3, b0, b1, c0, c1, c2, c3), _mma_bf16_warp)


def _tf32_operands(x):
    """What the tensor cores read of 32-bit operand registers: their top 19 bits."""
    bits = np.asarray(x, np.float32).view(np.uint32) & np.uint32(0xFFFFE000)
    return bits.view(np.float32).astype(np.float64)


def _mma_tf32_warp(slots):
    regs = np.array(slots, np.float32)                      # (lane, register)
    a, b = _tf32_operands(regs[:, :4]), _tf32_operands(regs[:, 4:6])
    A = np.empty((16, 8))
    B = np.empty((8, 8))
    A[_G, _T], A[_G + 8, _T], A[_G, _T + 4], A[_G + 8, _T + 4] = a.T
    B[_T, _G], B[_T + 4, _G] = b.T
    return _d_of_lanes(A, B, regs[:, 6:])


def _mma_f16_warp(slots, half=np.float16):
    words = np.array([s[:6] for s in slots], np.uint32)     # (lane, register)
    halves = _halves_of(words, half)                        # (lane, 12): low half first
    A = np.empty((16, 16))
    B = np.empty((16, 8))
    for k in (0, 1):
        A[_G, 2 * _T + k], A[_G + 8, 2 * _T + k] = halves[:, k], halves[:, 2 + k]
        A[_G, 2 * _T + 8 + k], A[_G + 8, 2 * _T + 8 + k] = halves[:, 4 + k], halves[:, 6 + k]
        B[2 * _T + k, _G], B[2 * _T + 8 + k, _G] = halves[:, 8 + k], halves[:, 10 + k]
    return _d_of_lanes(A, B, np.array([s[6:] for s in slots], np.float32))


def _mma_bf16_warp(slots):
    return _mma_f16_warp(slots, "bfloat16")


def _halves_of(words, half):
    """The 16-bit values of 32-bit words, low half first, as float64: float16 values, or
    bfloat16 bits (the upper half of a float32)."""
    bits = words.view(np.uint16)
    if half == "bfloat16":
        return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32).astype(np.float64)
    return bits.view(np.float16).astype(np.float64)


def _d_of_lanes(A, B, C):
    """Each lane's four entries of D = A B + C, C given by lane and register (float32):
    the exact products summed in float64 and each entry rounded to float32 once."""
    D = (A @ B)[_D_ROWS, _D_COLS] + C.astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        D = D.astype(np.float32)
    return [tuple(row) for row in D]


# --- loads, stores and copies ---------------------------------------------------------


def _memory_from(A, n):
    """A's memory from its first element on, n + 1 elements of it, as a 1D NumPy view
    (what flat_load's address arithmetic reads: A.ravel() for a C-contiguous A).
    Raises IndexError, as a GPU faults, if element n lies past the end of the allocation
    A is part of (the C-contiguous NumPy array that owns the memory; reading past a view's
    own span but inside its allocation is allowed, as on a GPU)."""
    a = getattr(A, "_ary", A)               # the simulator's device arrays wrap NumPy's
    owner = a
    while isinstance(owner.base, np.ndarray):
        owner = owner.base
    if not owner.flags.c_contiguous:        # memory NumPy did not allocate: bounds unknown
        return np.lib.stride_tricks.as_strided(a, (int(n) + 1,), (a.itemsize,))
    offset = a.__array_interface__["data"][0] - owner.__array_interface__["data"][0]
    try:
        return np.ndarray((int(n) + 1,), a.dtype, owner, offset, (a.itemsize,))
    except ValueError:
        past = offset + (int(n) + 1) * a.itemsize - owner.nbytes
        raise IndexError(f"a load or copy of the element {int(n)} places after an array's "
                         f"first reads {past} bytes past the end of its allocation (a GPU "
                         f"faults there)") from None


def flat_load(A, n):
    """The element n places after A's first in memory (A.ravel()[n] if C-contiguous)."""
    return _memory_from(A, n)[n]


def flat_load_wide(A, n):
    """The 8 bytes from the element n places after A's first (flat_load's addressing), as
    a tuple of A's elements: 2 float32, or 4 float16 or uint16. Raises ValueError, as the
    GPU faults (misaligned address), if they do not start at an 8-byte aligned address."""
    itemsize = getattr(A, "_ary", A).itemsize
    if itemsize not in (2, 4):
        raise TypeError(f"flat_load_wide reads 2- or 4-byte elements; got {itemsize} bytes")
    count = 8 // itemsize
    memory = _memory_from(A, int(n) + count - 1)
    address = memory.__array_interface__["data"][0] + int(n) * itemsize
    if address % 8:
        raise ValueError(f"flat_load_wide: misaligned address (element {n} lies at "
                         f"{address % 8} bytes past an 8-byte boundary)")
    return tuple(memory[int(n) + i] for i in range(count))


def load_pair(A, n):
    """(A[n], A[n + 1]) of a 1D float32 array."""
    return A[n], A[n + 1]


def store_pair(A, n, x, y):
    """A[n], A[n + 1] = x, y for a 1D float32 array."""
    A[n] = x
    A[n + 1] = y


def load_b32(A, n):
    """The 32-bit word holding A[n] (low half) and A[n + 1] of a 1D float16 (or uint16)
    array."""
    return np.uint32(np.array([A[n], A[n + 1]], A.dtype).view(np.uint32)[0])


def cp_async(S, n, A, m):
    """S[n] = the element m places after A's first (flat_load), at once (see the module
    docstring)."""
    S[n] = _memory_from(A, m)[m]


def cp_async_wait_all():
    """Nothing to wait for: cp_async has copied already."""


# --- ldmatrix and 16-byte asynchronous copies (forward v10) ------------------------------


def _address(a, n):
    """The address of element n of the NumPy (or simulator device) array a."""
    a = getattr(a, "_ary", a)
    return a.__array_interface__["data"][0] + int(n) * a.itemsize


def _row_bits(S, n):
    """The 16-byte row S[n:n + 8] of a 16-bit shared array as 8 uint16 bits; raises
    ValueError, as the GPU faults, if it does not start at a 16-byte aligned address."""
    if _address(S, n) % 16:
        raise ValueError(f"ldmatrix: the row at element {n} is not 16-byte aligned "
                         f"({_address(S, n) % 16} bytes past a boundary)")
    return np.asarray(getattr(S, "_ary", S)[int(n):int(n) + 8]).view(np.uint16).copy()


def _ldmatrix_warp(slots, trans):
    """Every lane's four registers of ldmatrix .x4: lanes 8m .. 8m + 7 gave the rows of
    matrix m; lane (g, t) gets M_m[g, 2t], M_m[g, 2t + 1] (.trans: M_m[2t, g], M_m[2t + 1,
    g]), the first in the low half (kernels/ptx.py)."""
    M = np.stack([_row_bits(S, n) for S, n in slots]).reshape(4, 8, 8).astype(np.uint32)
    if trans:
        M = M.transpose(0, 2, 1)
    lo, hi = M[:, _G, 2 * _T], M[:, _G, 2 * _T + 1]         # (matrix, lane)
    words = lo | (hi << np.uint32(16))
    return [tuple(np.uint32(w) for w in words[:, lane]) for lane in range(WARP)]


def ldmatrix_x4(S, n):
    """``ldmatrix.sync.aligned.m8n8.x4.shared.b16``: this lane's (r0, r1, r2, r3), from the
    rows the warp's lanes point to (kernels/ptx.py gives the layout)."""
    return exchange((S, n), lambda slots: _ldmatrix_warp(slots, False))


def ldmatrix_x4_trans(S, n):
    """``ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16``: as ldmatrix_x4, each matrix
    transposed."""
    return exchange((S, n), lambda slots: _ldmatrix_warp(slots, True))


def _movmatrix_warp(words):
    """Every lane's word of the transposed 8 x 8 matrix: lane (g, t) held M[g, 2t] (low
    half) and M[g, 2t + 1]; it gets M[2t, g] and M[2t + 1, g]."""
    w = np.array([int(x) for x in words], np.uint32)
    M = np.empty((8, 8), np.uint32)
    M[_G, 2 * _T] = w & np.uint32(0xFFFF)
    M[_G, 2 * _T + 1] = w >> np.uint32(16)
    T = M.T
    out = T[_G, 2 * _T] | (T[_G, 2 * _T + 1] << np.uint32(16))
    return [np.uint32(x) for x in out]


def movmatrix_trans(x):
    """``movmatrix.sync.aligned.m8n8.trans.b16``: this lane's word of the warp's 8 x 8
    matrix of 16-bit values transposed (kernels/ptx.py gives the layout)."""
    return exchange(np.uint32(x), _movmatrix_warp)


def cp_async16(S, n, A, m):
    """S[n:n + 8] = the 8 elements from the element m places after A's first (flat_load),
    at once; raises ValueError, as the GPU faults, if either address is not 16-byte
    aligned."""
    src = _memory_from(A, int(m) + 7)
    for what, array, k in (("shared", S, n), ("global", src, m)):
        if _address(array, k) % 16:
            raise ValueError(f"cp_async16: misaligned {what} address (element {k} lies at "
                             f"{_address(array, k) % 16} bytes past a 16-byte boundary)")
    S[int(n):int(n) + 8] = src[int(m):int(m) + 8]


# The L2 prefetch hint changes nothing the simulator can see.
cp_async16_l2_256 = cp_async16


def cp_async_commit():
    """Nothing to group: cp_async16 has copied already."""


def cp_async_wait_group(count):
    """Nothing to wait for: cp_async16 has copied already."""


def is_aligned16(A):
    """Whether A's first element lies at a 16-byte aligned address."""
    return _address(A, 0) % 16 == 0
