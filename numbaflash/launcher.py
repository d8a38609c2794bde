"""Launching a plan: ``launch_forward`` and ``launch_backward`` give each planned kernel
its arguments (the variant arguments and the table of visible tiles for the versions that
take them), and ``launch`` runs a compiled kernel with as little Python around it as a
small call can afford.

``kernel[grid, block, 0, nbytes](*args)`` is how Numba launches a kernel, and every
numbaflash kernel can be launched that way (``DIRECT_LAUNCH = False`` makes every launch
do so). At (1, 1, 128, 64) on the H200 the Python around a kernel is most of a call: the
launch through Numba's dispatcher alone took 46 us of the 77 us that launch, kernel and
synchronize took together (``python3 scripts/overhead.py --breakdown``,
lab/runs/2026-12-01/42_overhead.txt), and a small call is meant to cost at most 2x the
raw launch. Per call, Numba's launch:

1. builds a new launch configuration (``kernel[...]``: it checks the dimensions, wraps
   the stream, and warns about small grids);
2. works out the Numba type of every argument (Numba's dispatcher);
3. looks up the kernel loaded on the current device;
4. turns every argument into the words the kernel's parameters are made of. For an array
   these are: meminfo and parent (0 and 0 for a device array), the number of elements,
   the item size, the data pointer, then the shape and the strides in bytes; a scalar is
   one ctypes value;
5. hands those words to ``cuda.core.launch``.

``launch`` below does step 2 once per (kernel, argument types) and steps 1 and 3 once per
launch configuration and device; per call it does steps 4 and 5 only, in
``_DirectLaunch.__call__``. The words are exactly those of
numba-cuda 0.30's ``_Kernel._prepare_args`` for device arrays (of any layout) and
float32/float64/int32/int64 scalars, and tuples of one such scalar type (their elements'
words in order). A kernel with other argument types (there is none in
numbaflash today) is launched by Numba's compiled kernel instead. Every launch without a
``types_key``, and every launch on the simulator, goes through Numba's dispatcher.
"""

import ctypes
import functools
import logging
import math
import threading

import numba
import numpy as np
from numba import cuda

from .kernels import backward as backward_kernels
from .kernels import forward as forward_kernels
from .kernels import simulating, smem
from . import arrays, dropout
from .kernels import variants as variant_kernels
from .kernels.plan import takes_variant_arguments
from .streams import DEFAULT

log = logging.getLogger("numbaflash")

DIRECT_LAUNCH = True    # False: every launch goes through Numba's dispatcher (as in Numba)

_DIRECT = {}            # (kernel, types_key, grid, block, nbytes) -> _DirectLaunch
_DIRECT_MAX = 1024      # entries kept at most (a grid per shape: many shapes, many entries)


def launch(kernel, grid, block, args, types_key=None, dynamic_shared_bytes=0,
           stream=DEFAULT):
    """``kernel[grid, block, stream, dynamic_shared_bytes](*args)``, with less Python
    around it on the GPU; ``stream`` is the call's streams.CallStream.

    ``types_key``, when given, stands for the argument types: the caller promises that
    equal keys mean equal types (the same dtypes, numbers of dimensions and layouts as
    Numba types them, "C" for a C-contiguous device array). The first launch with a key
    goes through Numba's dispatcher, which compiles the kernel and checks the types;
    later ones launch the compiled kernel directly (module docstring). Without a key, on the simulator, or with
    ``DIRECT_LAUNCH = False``, every launch goes through Numba's dispatcher.

    More than 48 KB of dynamic shared memory must first be allowed to the compiled kernel
    (kernels/smem.py): before every launch through Numba's dispatcher, once per key
    otherwise.

    Returns the ``_DirectLaunch`` that launches this kernel with these argument types and
    this configuration from now on (None without a key, on the simulator, or with
    ``DIRECT_LAUNCH = False``): numbaflash.torch keeps it to repeat a call with new
    pointers (``_DirectLaunch.launch_words``).
    """
    direct_ok = types_key is not None and DIRECT_LAUNCH and not simulating()
    if direct_ok:
        key = (kernel, types_key, grid, block, dynamic_shared_bytes)
        direct = _DIRECT.get(key)
        if direct is not None:
            direct(args, stream)
            return direct
    smem.allow_dynamic_shared_memory(kernel, args, dynamic_shared_bytes)
    try:
        kernel[grid, block, stream.numba, dynamic_shared_bytes](*args)
    except Exception as error:
        if not _out_of_resources(error):
            raise
        raise ValueError(_too_many_registers(kernel, args, block)) from error
    if not direct_ok:
        return None
    if len(_DIRECT) >= _DIRECT_MAX:
        _DIRECT.clear()
    direct = _DIRECT[key] = _DirectLaunch(kernel, args, grid, block, dynamic_shared_bytes)
    return direct


def _out_of_resources(error):
    """Whether a launch failed because the block needs more registers than the GPU has
    (CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES, 701): a kernel's registers per thread times the
    block's threads. Only a caller's own tiles can get there: a version's default tiles
    are sized to launch."""
    return getattr(error, "code", None) == 701 or "OUT_OF_RESOURCES" in str(error)


def _too_many_registers(kernel, args, block):
    """The ValueError message for a block that needs more registers than the GPU has."""
    threads = math.prod(block) if isinstance(block, tuple) else block
    compiled = kernel.compile(tuple(kernel.typeof_pyval(a) for a in args))
    return (f"the kernel {kernel.py_func.__name__} was not launched: {threads} threads a "
            f"block at {compiled.regs_per_thread} registers a thread need more registers "
            f"than the GPU has for one block (it launches this kernel with at most "
            f"{compiled.max_threads_per_block} threads a block). Ask for smaller tiles "
            f"(fewer threads a block) or leave tiles=None (the version's default tiles)")


def _array_words(a):
    """The parameter words of a device array (module docstring, step 4): the same for any
    layout; only the kernel's code differs, which the argument types chose."""
    return array_words(a.size, a.dtype.itemsize, int(a.gpu_data.device_pointer), a.shape,
                       a.strides)


def array_words(size, itemsize, pointer, shape, byte_strides):
    """The parameter words of an array given by its numbers: two null words
    (Numba's meminfo and parent), size, itemsize, the pointer, the shape, the strides in
    bytes. numbaflash.torch builds a tensor's from its own numbers."""
    return (0, 0, size, itemsize, pointer, *shape, *byte_strides)


_SCALARS = {"float32": ctypes.c_float, "float64": ctypes.c_double,
            "int32": ctypes.c_int32, "int64": ctypes.c_int64, "uint32": ctypes.c_uint32}


def _word_maker(numba_type):
    """How one argument of this Numba type becomes its parameter words; None if this
    module does not know (then Numba's own launch is used). A tuple of one scalar type
    (a packed batch's equal lengths) is its elements' words, in order, as Numba passes
    a tuple."""
    if getattr(numba_type, "ndim", None) is not None:          # an array type, any layout
        return _array_words
    if isinstance(numba_type, numba.types.UniTuple):
        scalar = _SCALARS.get(str(numba_type.dtype))
        return None if scalar is None else (lambda x: tuple(scalar(y) for y in x))
    scalar = _SCALARS.get(str(numba_type))
    return None if scalar is None else (lambda x: (scalar(x),))


def device_id():
    """The current CUDA device's number."""
    return cuda.current_context().device.id


_CONTEXTS = {}          # CUcontext handle (int) -> Numba's Context of that primary context
_DRIVER = None          # (cuda.bindings.driver, its CUDA_SUCCESS), imported at first use


def _driver():
    """cuda.bindings' driver module and its success code (imported once: a repeated
    decoding call asks the driver directly twice before its first launch)."""
    global _DRIVER
    if _DRIVER is None:
        from cuda.bindings import driver as binding
        _DRIVER = (binding, binding.CUresult.CUDA_SUCCESS)
    return _DRIVER


def memset_d32_async(address, value, count, stream_handle):
    """Write the 32-bit ``value`` ``count`` times from device ``address``, queued on the
    stream with handle ``stream_handle``: the driver's cuMemsetD32Async called through
    its binding directly (Numba's wrapper of it adds a few microseconds of checks and
    logging to a repeated decoding call, which writes its int lengths this way)."""
    binding, success = _DRIVER or _driver()
    err, = binding.cuMemsetD32Async(address, value, count, stream_handle)
    if err != success:
        raise RuntimeError(f"cuMemsetD32Async failed: {err!r}")


class FlagReadback:
    """A 4-byte flag read back to the host without the host waiting for the stream: the
    copy lands in page-locked host memory and an event marks it, so that the host can
    queue more work on the stream and wait later for the copy alone (a copy into
    pageable memory returns only once everything before it has run). One per thread and
    CUDA context (``flag_readback``), reused: ``read`` waits for its copy, and ``start``
    waits for the one before it (done, unless an error came between its start and its
    read), so that an earlier copy cannot land after a later one."""

    def __init__(self):
        binding, success = _DRIVER or _driver()
        self.host = cuda.pinned_array(1, np.int32)
        err, self.event = binding.cuEventCreate(
            int(binding.CUevent_flags.CU_EVENT_DISABLE_TIMING))
        if err != success:
            raise RuntimeError(f"cuEventCreate failed: {err!r}")

    def start(self, device_pointer, stream_handle):
        """Queue the copy of the int32 at ``device_pointer`` and the event after it on the
        stream with handle ``stream_handle``."""
        binding, success = _DRIVER
        err, = binding.cuEventSynchronize(self.event)      # the copy before this one
        if err != success:
            raise RuntimeError(f"cuEventSynchronize failed: {err!r}")
        self.host[0] = -1
        err, = binding.cuMemcpyDtoHAsync(self.host.ctypes.data, device_pointer, 4,
                                         stream_handle)
        if err == success:
            err, = binding.cuEventRecord(self.event, stream_handle)
        if err != success:
            raise RuntimeError(f"copying the flag back failed: {err!r}")

    def read(self):
        """Wait for the copy (not for the work queued after it) and return the flag."""
        binding, success = _DRIVER
        err, = binding.cuEventSynchronize(self.event)
        if err != success:
            raise RuntimeError(f"cuEventSynchronize failed: {err!r}")
        return int(self.host[0])


_READBACKS = threading.local()


def flag_readback():
    """This thread's FlagReadback for the current CUDA context (made at first use)."""
    table = getattr(_READBACKS, "table", None)
    if table is None:
        table = _READBACKS.table = {}
    key = int(current_context().handle)
    found = table.get(key)
    if found is None:
        found = table[key] = FlagReadback()
    return found


def current_context():
    """Numba's current CUDA context, as ``cuda.current_context()`` gives it, for calls
    that run many times a second (repeated decoding calls). Where another library made
    the context current (PyTorch does), Numba does not remember it for the thread and
    asks the driver and its device table again at every call: 9 us a call on an H100
    (lab/runs/2026-12-07/150_decode_host_steps.txt). Here the driver's current context
    handle (one call) picks Numba's Context from a table, checked to be its device's
    primary context still (``cuda.close()`` drops it); anything else asks Numba."""
    binding, success = _DRIVER or _driver()
    err, handle = binding.cuCtxGetCurrent()
    key = int(handle) if err == success else 0
    context = _CONTEXTS.get(key) if key else None
    if context is not None and context.device.primary_context is context:
        return context
    context = cuda.current_context()
    if key and int(context.handle) == key:
        _CONTEXTS[key] = context
    return context


class _DirectLaunch:
    """One compiled kernel with one launch configuration (but the stream, which is the
    call's), launched by ``cuda.core``:
    Numba's launch steps 1 to 3 (module docstring) done once, at construction, right
    after a launch through Numba's dispatcher; steps 4 and 5 per call. ``functions`` holds the
    kernel as loaded on each device it has run on (a kernel is loaded per device, and
    more than 48 KB of shared memory is allowed per device)."""

    def __init__(self, kernel, args, grid, block, dynamic_shared_bytes):
        from cuda.core import LaunchConfig, launch as core_launch
        self.compiled = kernel.compile(tuple(kernel.typeof_pyval(a) for a in args))
        self.numba_config = kernel[grid, block, 0, dynamic_shared_bytes]
        c = self.numba_config
        self.makers = [_word_maker(t) for t in self.compiled.argument_types]
        if None in self.makers or self.compiled.extensions or self.compiled.debug:
            self.makers = None                  # launched by Numba's compiled kernel
        self.kernel = kernel
        self.core_launch = core_launch
        self.core_config = LaunchConfig(grid=c.griddim, block=c.blockdim,
                                        shmem_size=c.sharedmem)
        self.functions = {device_id(): self.compiled.library.get_cufunc().kernel}

    def __call__(self, args, stream):
        c = self.numba_config
        if self.makers is None:                 # through Numba's dispatcher, on the stream
            self.kernel[c.griddim, c.blockdim, stream.numba, c.sharedmem](*args)
            return
        device = device_id()
        if device not in self.functions:        # the first launch on this device
            smem.allow_dynamic_shared_memory(self.kernel, args, c.sharedmem)
            self.functions[device] = self.compiled.library.get_cufunc().kernel
        words = []
        for make, a in zip(self.makers, args):
            words.extend(make(a))
        self.launch_words(words, stream, device)

    def ready(self, device):
        """Whether ``launch_words`` can launch on this device (the kernel has run there,
        and it is launched directly, not through Numba's dispatcher)."""
        return self.makers is not None and device in self.functions

    def prepare(self, words, slots, device):
        """A PreparedLaunch of this kernel on a device it has run on, with parameter
        words ``words`` (as ``launch_words`` takes them) of which the positions ``slots``
        are set anew at every launch; None if it cannot (the kernel has not run on the
        device, or it is launched through Numba's dispatcher)."""
        function = self.functions.get(device)
        if function is None or self.makers is None:
            return None
        return PreparedLaunch(function, self.numba_config, words, slots)

    def launch_words(self, words, stream, device):
        """Launch with parameter words built by the caller (``array_words`` for each
        array, the makers' words for the rest), on a device this kernel has already run
        on; False (nothing launched) if it has not, or if this kernel is launched through
        Numba's dispatcher. ``__call__`` and numbaflash.torch's repeated calls use it."""
        function = self.functions.get(device)
        if function is None or self.makers is None:
            return False
        self.core_launch(stream.core or self.numba_config.stream, self.core_config,
                         function, *words)
        return True


# Whether repeated decoding calls (numbaflash/decode_direct.py) and numbaflash.torch's
# repeated forward calls launch through PreparedLaunch (True) or build their words for
# cuda.core's launch every time (False). A lab switch: lab/sweeps/decode_host_steps.py
# and lab/sweeps/small_call_parts.py --launch time the two in one process.
PREPARED_LAUNCH = True


class PreparedLaunch:
    """A kernel's launch with its parameter words laid out once in C memory, launched by
    the driver's cuLaunchKernel with only some words set anew each time (the pointers of
    a repeated call's arrays).

    cuda.core's launch, which ``_DirectLaunch.launch_words`` uses, converts every word
    from Python each time: a decoding call's split kernel has over a hundred words (each
    array is 5 + 2 x its dimensions), and the conversion took about 25 us a launch on an
    H100 (lab/runs/2026-12-07/149_decode_host_steps.txt), most of a repeated call's host
    time. Here each word is a ctypes value made once, in an array of their addresses;
    a launch writes the changed words (``slots``) and passes the array's address.

    The words are the same as ``launch_words``': a Python int is a 64-bit word (as
    cuda.core passes it), a ctypes value keeps its type. One lock per object keeps two
    threads from writing the words of one launch while another launches.
    """

    def __init__(self, function, numba_config, words, slots):
        from cuda.bindings import driver as binding
        self._launch = binding.cuLaunchKernel
        self._success = binding.CUresult.CUDA_SUCCESS
        err, self.function = binding.cuKernelGetFunction(function.handle)
        if err != self._success:
            raise RuntimeError(f"cuKernelGetFunction failed: {err!r}")
        c = numba_config
        self.dims = (*_three(c.griddim), *_three(c.blockdim), c.sharedmem)
        self.values = [_owned_word(w) for w in words]
        self.slots = [self.values[i] for i in slots]
        self.addresses = (ctypes.c_void_p * len(self.values))(
            *(ctypes.addressof(v) for v in self.values))
        self.params = ctypes.addressof(self.addresses)
        self.lock = threading.Lock()

    def launch(self, pointers, stream_handle):
        """Launch on the stream with handle ``stream_handle`` (int, 0 for the legacy
        default stream), the words at ``slots`` set to ``pointers`` (ints) in order."""
        with self.lock:
            for slot, value in zip(self.slots, pointers):
                slot.value = value
            err, = self._launch(self.function, *self.dims, stream_handle, self.params, 0)
        if err != self._success:
            raise RuntimeError(f"cuLaunchKernel failed: {err!r}")


def _three(dim):
    """A Numba launch dimension as (x, y, z)."""
    return tuple(dim) + (1,) * (3 - len(dim))


def _owned_word(word):
    """One parameter word as a ctypes value of its own (a copy of a ctypes value; a
    Python int as a signed 64-bit word, or unsigned past the signed range)."""
    if isinstance(word, ctypes._SimpleCData):
        return type(word)(word.value)
    word = int(word)
    return ctypes.c_int64(word) if word < 1 << 63 else ctypes.c_uint64(word)


# --- plans to launches ---------------------------------------------------------------


def launch_forward(plan, p, Q, K, V, O, L, slopes=None, attn_mask=None, stream=DEFAULT,
                   seqs=None):
    """Launch the planned forward kernel on device arrays: Q, O (B*Hq, Sq, d), K, V
    (B*Hkv, Sk, d), L (B*Hq, Sq); ``slopes`` and ``attn_mask`` as the Problem's, on the
    device (or None); on ``stream`` (a streams.CallStream). A packed batch
    (``p.variant.varlen``): Q, O (Hq, total_q, d), K, V (Hkv, total_k, d) views, or for a
    version whose module sets PACKED_ROWS the packed (total, heads, d) arrays as they are;
    L (Hq, total_q) and ``seqs`` (2, B + 1) int32 on the device (kernels/sequences.py).
    Returns ``launch``'s _DirectLaunch (or None)."""
    log.info("%s", plan)
    version = forward_kernels.module(plan.version)
    scale = np.dtype(p.acc_dtype).type(p.softmax_scale)   # keep the kernel's arithmetic in acc dtype
    args = (Q, K, V, O, L, scale, np.int64(p.causal_offset))
    if takes_variant_arguments(version, p):
        tiles = (tile_table(p, plan.Br, plan.Bc, attn_mask, stream) if version.TILE_TABLE
                 else None)
        args += variant_arguments(p, slopes, attn_mask, tiles, seqs)
    rows = getattr(version, "PACKED_ROWS", False)
    return launch(version.kernel(plan, p), plan.grid, plan.block, args,
                  _types_key(p, slopes, attn_mask, seqs, rows),
                  plan.shared_bytes if plan.dynamic_shared else 0, stream)


def _types_key(p, slopes, attn_mask, seqs, rows=False):
    """``launch``'s types_key: the argument types follow from the input dtype, unless the
    caller passed arrays of their own (slopes, attn_mask: any dtype and layout) or the
    arrays are a packed batch's strided views; then Numba's dispatcher types them. A
    packed batch read as it is (``rows``: C-contiguous arrays, seqs (2, B + 1) int32)
    has its types from the dtype too."""
    if slopes is None and attn_mask is None and (seqs is None or rows):
        return (p.dtype, p.acc_dtype) + (("packed rows",) if seqs is not None else ())
    return None


def launch_backward(plans, p, Q, K, V, O, dO, L, D, dQ, dK, dV, slopes=None, attn_mask=None,
                    stream=DEFAULT, seqs=None):
    """Launch the planned backward kernels, in order, on device arrays.

    Q, O, dO, dQ are (B*Hq, Sq, d); K, V, dK, dV are (B*Hkv, Sk, d); L and D are (B*Hq, Sq)
    in the accumulator dtype (D is scratch, written by the first kernel). For v2, dQ must
    be zero-filled (its kernel adds into it). v8 zero-fills its float32 dQ sums itself (a
    kernel of its plans): dQ for float32 inputs, for float16 a float32 scratch array
    allocated here, which its last kernel rounds into dQ. ``slopes``, ``attn_mask``,
    ``stream``, ``seqs``: as for the forward (a packed batch: Q, O, dO, dQ (Hq, total_q,
    d), K, V, dK, dV (Hkv, total_k, d) views, or for a version whose module sets
    PACKED_ROWS the packed (total, heads, d) arrays as they are; L and D (Hq, total_q)).
    """
    scale = np.dtype(p.acc_dtype).type(p.softmax_scale)   # keep the kernel's arithmetic in acc dtype
    offset = np.int64(p.causal_offset)
    version = backward_kernels.module(plans[-1].version)
    extra = ()
    if takes_variant_arguments(version, p):
        tiled = [plan for plan in plans if plan.Br][-1]     # the last kernel with tiles
        tiles = (tile_table(p, tiled.Br, tiled.Bc, attn_mask, stream) if version.TILE_TABLE
                 else None)
        extra = variant_arguments(p, slopes, attn_mask, tiles, seqs)
    # a packed batch: the arrays as they are for a version whose module sets PACKED_ROWS
    # (the D kernel still reads (heads, total, d) views of them), else views
    rows = seqs is not None and getattr(version, "PACKED_ROWS", False)
    types_key = _types_key(p, slopes, attn_mask, seqs, rows)
    dQ_sums = dQ                # where v2's and v8's kernels add dQ up
    if any(plan.pass_name == "backward dQ narrow" for plan in plans):
        dQ_sums = arrays.device_empty(dQ.shape, np.float32, stream)   # v8, float16 inputs
    for plan in plans:
        log.info("%s", plan)
        key = types_key
        if plan.kernel == "backward_preprocess":
            kernel = backward_kernels.module("preprocess").kernel(plan, p)
            args = (dO, O, D)
            if rows:
                args = (arrays.heads_first(dO), arrays.heads_first(O), D)
                # (heads, total, d) views of C-contiguous arrays: their Numba types stand
                # for them in the key (typing two arrays costs less than the dispatcher)
                key = (types_key, numba.typeof(args[0]), numba.typeof(args[1]))
            elif seqs is not None:
                key = None                  # views: typed by Numba's dispatcher
        else:
            kernel = version.kernel(plan, p)
            if plan.pass_name == "backward dQ zero":        # v8: dQ's sums start from 0
                args = (dQ_sums,)
            elif plan.pass_name == "backward dQ narrow":    # v8: the sums rounded into dQ
                args = (dQ_sums, dQ)
            elif plan.pass_name == "backward dK dV dQ":     # v2, v8: one kernel for all three
                args = (Q, K, V, dO, L, D, dQ_sums, dK, dV, scale, offset)
            elif plan.pass_name == "backward dK dV":
                args = (Q, K, V, dO, L, D, dK, dV, scale, offset)
            else:                                           # "backward dQ"
                args = (Q, K, V, dO, L, D, dQ, scale, offset)
            if plan.pass_name not in ("backward dQ zero", "backward dQ narrow"):
                args += extra                               # the kernels that take variants
            if seqs is not None and equal_lengths(version, plan, p):
                args = args[:-1] + (lengths_argument(p),)  # (nq, nk) for cu_seqlens
        launch(kernel, plan.grid, plan.block, args, key,
               plan.shared_bytes if plan.dynamic_shared else 0, stream)


def equal_lengths(version, plan, p):
    """Whether ``plan``'s kernel is built for a packed batch of equal lengths: it takes the
    pair ``lengths_argument(p)`` where other packed builds take cu_seqlens (its version
    module's ``equal_lengths`` rule says which kernels; kernels/sequences.py)."""
    rule = getattr(version, "equal_lengths", None)
    return rule is not None and rule(plan.kernel, p)


def lengths_argument(p):
    """A packed batch of equal lengths' (nq, nk) as a kernel argument (two int64s)."""
    nq, nk = p.equal_lengths
    return (np.int64(nq), np.int64(nk))


def tile_table(p, Br, Bc, attn_mask, stream=DEFAULT):
    """The table of visible (Br x Bc) tiles, (B*Hq, Tr, Tc) bool on the device, for a
    Problem whose variant needs one (variants.make_tile_table), else None; made on
    ``stream``."""
    if not p.variant.tile_table:
        return None
    Tr, Tc = math.ceil(p.Sq / Br), math.ceil(p.Sk / Bc)
    tiles = cuda.device_array((p.BH, Tr, Tc), np.bool_)
    if Tr * Tc == 0:
        return tiles
    kernel = variant_kernels.make_tile_table(Br, Bc, p.upper, p.acc_dtype, p.variant)
    grid, block = (Tr * Tc, p.BH), (variant_kernels.TILE_TABLE_THREADS,)
    log.info("tile table: tile_table for (%d, %d) tiles, grid %s, block %s", Br, Bc, grid, block)
    if attn_mask is None:
        attn_mask = _placeholders(p.acc_dtype, _context_key())[1]
    kernel[grid, block, stream.numba](tiles, np.int64(p.Sq), np.int64(p.Sk),
                                      np.int64(p.causal_offset), np.int64(p.window_lo),
                                      np.int64(p.Hq), attn_mask)
    return tiles


def variant_arguments(p, slopes, attn_mask, tiles=None, seqs=None):
    """The run-time arguments that follow ``causal_offset`` in every kernel that supports
    variants: (window_lo, Hq, group, softcap, slopes, attn_mask, tiles, seed_lo, seed_hi,
    keep_threshold, keep_scale, seqs). ``slopes``, ``attn_mask``, ``tiles`` (from
    ``tile_table``) and ``seqs`` (a packed batch's sequences, kernels/sequences.py) are
    device arrays or None (then a 1-element placeholder that the kernel, compiled without
    that variant, never reads). seed_lo to keep_scale are dropout's
    (kernels/variants.py): the seed's two 32-bit words and the keep threshold as uint32
    (32-bit arithmetic in Philox), and 1 / (1 - p) in the accumulator's dtype."""
    acc = np.dtype(p.acc_dtype)
    no_slopes, no_mask, no_tiles, no_seqs = _placeholders(p.acc_dtype, _context_key())
    if p.variant.dropout:
        seed_lo, seed_hi = dropout.seed_words(p.dropout_seed)
        threshold = dropout.keep_threshold(p.dropout_p)
        keep_scale = 1.0 / (1.0 - p.dropout_p)
    else:
        seed_lo = seed_hi = threshold = 0
        keep_scale = 1.0
    return (np.int64(p.window_lo), np.int64(p.Hq), np.int64(p.group), acc.type(p.softcap),
            no_slopes if slopes is None else slopes, no_mask if attn_mask is None else attn_mask,
            no_tiles if tiles is None else tiles, np.uint32(seed_lo), np.uint32(seed_hi),
            np.uint32(threshold), acc.type(keep_scale), no_seqs if seqs is None else seqs)


def _context_key():
    """Which CUDA context is current (device arrays belong to one); None on the simulator."""
    return None if simulating() else id(cuda.current_context())


@functools.lru_cache(maxsize=None)
def _placeholders(acc_dtype, context):
    """The 1-element device arrays passed for the variant arguments a kernel does not use
    (slopes, attn_mask, tiles, seqs), made once per context rather than copied to the device on
    every call (three host-to-device copies per launch, for nothing)."""
    return (cuda.to_device(np.zeros((1, 1), acc_dtype)),
            cuda.to_device(np.zeros((1, 1, 1, 1), np.bool_)),
            cuda.to_device(np.zeros((1, 1, 1), np.bool_)),
            cuda.to_device(np.zeros((1, 1), np.int32)))
