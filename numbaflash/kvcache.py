"""Decoding against a KV cache: ``attention_with_kvcache`` and ``explain_kvcache``.

A model that generates text appends each new token's key and value to a per-sequence
cache and attends its new query rows to everything cached so far. The call here does
both (flash-attention's ``flash_attn_with_kvcache`` semantics): it writes the new keys
and values into the caches in place, then runs the split-KV kernels
(numbaflash/kernels/decode/) over each batch's first cache_seqlens[b] + S_new keys.
"""

import contextlib
import contextvars
import math
import sys
from dataclasses import dataclass, field

import numpy as np

from numba import cuda
from numba.cuda.cudadrv import driver

from . import arrays, decode_direct, launcher
from .kernels.decode import append as append_kernels
from .kernels.decode import split_kv as split_kv_kernels
from .kernels import simulating
from .kernels.plan import Plans
from .kernels.variants import Variant
from .launcher import _context_key, _placeholders, launch
from .masks import band, parse_causal, parse_window
from .policy import (COMBINE_MODULES, DECODE_MODULES, combine_kernel, decode_kernel,
                     default_num_splits, where_to_plan)
from .streams import (call_stream, handle_value, producer_stream, ready_handles, torch_stream,
                      wait_for)
from .dtypes import as_bits, kernel_dtype
from .validate import (DTYPES_TEXT, GRID_Y_MAX, HEAD_DIM_MAX, SUPPORTED_DTYPES, _check_alibi,
                       _check_softcap, _shape_dtype, check_scale)

MAX_SPLITS = 256                # a forced num_splits above this is refused


@dataclass(frozen=True)
class CacheProblem:
    """One ``attention_with_kvcache`` call, after validation (what the plans need)."""
    B: int
    Hq: int
    Hk: int
    Sq: int
    S_max: int           # the caches' length
    S_new: int           # new keys and values appended by this call (0: none)
    d: int
    dtype: np.dtype
    acc_dtype: str
    causal: bool         # bottom-right within each batch's length
    softmax_scale: float
    window: tuple | None = None
    upper_shift: int = 0         # key j visible from row i iff j <= i + n_b - Sq + upper_shift
    lower_shift: int = 0         # ... and j >= i + n_b - Sq + lower_shift (with a window)
    softcap: float = 0.0
    variant: Variant = Variant()
    n_max: int = 0       # the most keys any batch sees (S_max when the lengths are on the GPU)
    alibi_slopes: object = field(default=None, compare=False)
    seqlens: object = field(default=None, compare=False)     # (B,) int32, host or device
    layout: object = None    # split_kv.CacheLayout of device caches; None: host caches

    @property
    def group(self):
        return self.Hq // self.Hk

    @property
    def upper(self):
        return self.causal or (self.window is not None and self.window[1] >= 0)


def _check_seqlens(cache_seqlens, B, S_max, S_new, device):
    """cache_seqlens as a (B,) int32 array (host or device) and the most keys a batch
    sees; ValueError/TypeError naming the problem. Host values are checked against the
    cache: 0 <= cache_seqlens[b] and cache_seqlens[b] + S_new <= S_max."""
    if isinstance(cache_seqlens, (int, np.integer)) and not isinstance(cache_seqlens, bool):
        seqlens = np.full(B, int(cache_seqlens), np.int64)
    elif arrays.is_device_array(cache_seqlens):
        if not device:
            raise TypeError("cache_seqlens is a device array but the caches are on the "
                            "host: pass it as a NumPy array or an int")
        shape, dtype = _shape_dtype(cache_seqlens, "cache_seqlens")
        if shape != (B,) or dtype != np.int32:
            raise ValueError(f"cache_seqlens must be an int or a (batch,) = ({B},) int32 "
                             f"array; got a device array of shape {shape} and dtype {dtype}")
        return cache_seqlens, S_max
    else:
        seqlens = np.asarray(cache_seqlens)
        if seqlens.dtype.kind not in "iu" or seqlens.shape != (B,):
            raise ValueError(f"cache_seqlens must be an int or a (batch,) = ({B},) integer "
                             f"array; got shape {seqlens.shape} and dtype {seqlens.dtype}")
    if B and (seqlens.min() < 0 or seqlens.max() + S_new > S_max):
        raise ValueError(f"cache_seqlens must be >= 0 and leave room for the {S_new} new "
                         f"keys in the caches' {S_max} rows (cache_seqlens[b] + {S_new} <= "
                         f"{S_max}); got {seqlens.tolist()}")
    n_max = int(seqlens.max()) + S_new if B else 0
    return seqlens.astype(np.int32), n_max


def _cache_memory(x, itemsize):
    """(element strides, byte address of the first element) of the device array ``x`` of
    rank 4: a Numba device array, anything with the CUDA Array Interface, or the
    simulator's arrays (NumPy underneath). A dimension of size 1 gets stride 0: it is never
    stepped over, and a producer may give it any stride."""
    ary = getattr(x, "_ary", None)
    if isinstance(ary, np.ndarray):
        shape, byte_strides, address = ary.shape, ary.strides, ary.__array_interface__["data"][0]
    else:
        cai = x.__cuda_array_interface__
        shape, address = tuple(cai["shape"]), cai["data"][0]
        byte_strides = cai.get("strides")
        if byte_strides is None:            # C-contiguous
            byte_strides = tuple(int(np.prod(shape[k + 1:])) * itemsize
                                 for k in range(len(shape)))
    return (tuple(0 if n == 1 else st // itemsize for n, st in zip(shape, byte_strides)),
            int(address or 0))


def _cache_layout(k_cache, v_cache, itemsize):
    """The split_kv.CacheLayout of device caches (where the wide loads may read)."""
    (k_strides, k_address), (v_strides, v_address) = (
        _cache_memory(x, itemsize) for x in (k_cache, v_cache))
    return split_kv_kernels.CacheLayout(k_strides[:3], v_strides[:3], k_address, v_address)


def check_kvcache_inputs(q, k_cache, v_cache, cache_seqlens, k=None, v=None, causal=False,
                         scale=None, window_size=None, softcap=None, alibi_slopes=None,
                         num_splits=None):
    """Validate an ``attention_with_kvcache`` call; return a ``CacheProblem``."""
    names = [("q", q), ("k_cache", k_cache), ("v_cache", v_cache)]
    if (k is None) != (v is None):
        raise ValueError("pass both k and v (the new keys and values) or neither")
    if k is not None:
        names += [("k", k), ("v", v)]
    shapes = {}
    dtypes = {}
    for name, x in names:
        shapes[name], dtypes[name] = _shape_dtype(x, name)
        if len(shapes[name]) != 4:
            raise ValueError(f"{name} must have rank 4 (batch, heads, seqlen, d); got shape "
                             f"{shapes[name]}")
    device = arrays.on_device([x for _, x in names])
    B, Hq, Sq, d = shapes["q"]
    if shapes["k_cache"] != shapes["v_cache"]:
        raise ValueError(f"k_cache and v_cache must have the same shape; got "
                         f"{shapes['k_cache']} and {shapes['v_cache']}")
    Bc, Hk, S_max, dk = shapes["k_cache"]
    if Bc != B or dk != d:
        raise ValueError(f"the caches must be (batch, heads, S_max, d) with q's batch {B} and "
                         f"head dim {d}; got q {shapes['q']} and caches {shapes['k_cache']}")
    if Hk == 0 or Hq % Hk:
        raise ValueError(f"q has {Hq} heads and the caches {Hk}: the number of query heads "
                         f"must be a multiple of the caches' (GQA/MQA)")
    S_new = 0
    if k is not None:
        if shapes["k"] != shapes["v"] or shapes["k"][:2] != (B, Hk) or shapes["k"][3] != d:
            raise ValueError(f"k and v (the new keys and values) must both have shape (batch, "
                             f"heads, S_new, d) = ({B}, {Hk}, S_new, {d}); got {shapes['k']} "
                             f"and {shapes['v']}")
        S_new = shapes["k"][2]
    if len(set(dtypes.values())) > 1:
        raise TypeError(f"q, the caches and the new k, v must have the same dtype; got "
                        + ", ".join(f"{n} {t}" for n, t in dtypes.items()))
    dtype = dtypes["q"]
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"unsupported dtype {dtype}: numbaflash supports {DTYPES_TEXT}")
    if not 1 <= d <= HEAD_DIM_MAX:
        raise ValueError(f"head dim must be in 1..{HEAD_DIM_MAX}; got {d}")
    if B * Hk > GRID_Y_MAX:
        raise ValueError(f"batch * K/V heads = {B * Hk} exceeds {GRID_Y_MAX}, the CUDA grid "
                         f"limit numbaflash uses for it; split the batch")
    mode = parse_causal(causal)
    if mode == "top_left":
        raise ValueError("attention_with_kvcache aligns causal masks bottom-right within "
                         "each batch's length (the new rows are the last ones); "
                         "causal='top_left' has no meaning here: use causal=True")
    window = parse_window(window_size)
    # The band at Sk = Sq: its bounds relative to n_b - Sq, the same for every batch.
    upper, lower = band(Sq, Sq, mode, window)
    scale = check_scale(scale, d)
    softcap = _check_softcap(softcap)
    slopes = _check_alibi(alibi_slopes, B, Hq)
    if num_splits is not None and (isinstance(num_splits, bool)
                                   or not isinstance(num_splits, (int, np.integer))
                                   or not 1 <= num_splits <= MAX_SPLITS):
        raise ValueError(f"num_splits must be None (the planner chooses) or an int in "
                         f"1..{MAX_SPLITS}; got {num_splits!r}")
    seqlens, n_max = _check_seqlens(cache_seqlens, B, S_max, S_new, device)
    variant = Variant(window=lower is not None, softcap=softcap is not None,
                      alibi=slopes is not None)
    layout = _cache_layout(k_cache, v_cache, dtype.itemsize) if device else None
    return CacheProblem(B=B, Hq=Hq, Hk=Hk, Sq=Sq, S_max=S_max, S_new=S_new, d=d, dtype=dtype,
                        acc_dtype="float64" if dtype == np.float64 else "float32",
                        causal=mode is not None, softmax_scale=float(scale), window=window,
                        upper_shift=0 if upper is None else upper,
                        lower_shift=0 if lower is None else lower,
                        softcap=0.0 if softcap is None else softcap, variant=variant,
                        n_max=n_max, alibi_slopes=slopes, seqlens=seqlens, layout=layout)


def plan_kvcache(p, num_splits=None, where=None):
    """The Plans of a CacheProblem, in launch order: the cache update (device caches with
    new keys), the split-KV kernel, and the combine if there is more than one split."""
    where = where_to_plan(where)
    module, why = decode_kernel(p)
    if num_splits is None:
        n, reason = default_num_splits(p, where, module)
    else:
        n, reason = int(num_splits), f"{num_splits} split(s) asked for by the caller"
    plans = [module.plan(p, where, n, f"{why}; {reason}")]
    if n > 1:
        plans.append(combine_kernel().plan(p, where))
    return Plans(plans)


def attention_with_kvcache(q, k_cache, v_cache, *, cache_seqlens, k=None, v=None,
                           causal=False, scale=None, window_size=None, softcap=None,
                           alibi_slopes=None, num_splits=None, return_lse=False, stream=None):
    """Attention of new query rows against a KV cache, appending new keys and values
    first (flash-attention's ``flash_attn_with_kvcache``).

    Batch b sees the first n_b = cache_seqlens[b] + S_new keys of its caches: the
    cache_seqlens[b] already there, then the S_new new ones written by this call.

    Args:
        q: (batch, Hq, Sq, d), the new query rows (Sq = 1 for one decoding step).
        k_cache, v_cache: (batch, Hk, S_max, d) with Hk dividing Hq (GQA/MQA). NumPy
            arrays (the result is then on the host) or device arrays (Numba, CuPy,
            PyTorch CUDA tensors), like q. Device arrays are read (and the caches written)
            in place with their own strides, as long as the head dim is contiguous: a
            cache kept as (batch, S_max, Hk, d), as flash-attn keeps it, is passed as its
            ``transpose(1, 2)`` view, without a copy (numbaflash.torch's
            ``flash_attn_with_kvcache`` does that).
        cache_seqlens: an int, or a (batch,) integer array: the keys already cached per
            batch. Host values are checked (0 <= cache_seqlens[b] and cache_seqlens[b] +
            S_new <= S_max); a device array (int32, with device caches) is used as it is,
            each n_b clamped to S_max, since checking it would wait for the GPU.
        k, v: None, or the new keys and values (batch, Hk, S_new, d): written into the
            caches in place at rows cache_seqlens[b], ..., cache_seqlens[b] + S_new - 1
            before the attention (NumPy caches on the host, device caches on the GPU).
            cache_seqlens itself is not changed.
        causal: False, or True / "bottom_right": row i sees keys j <= i + n_b - Sq (the
            last row sees every key of its batch).
        scale, window_size, softcap, alibi_slopes: as for ``numbaflash.attention``, with
            positions taken within each batch's n_b keys (bottom-right aligned).
        num_splits: None lets the planner choose how many ranges the keys are split into
            (``explain_kvcache`` says why); an int in 1..256 forces it.
        return_lse: also return the logsumexp (batch, Hq, Sq), float32 (float64 for
            float64 inputs).
        stream: as for ``numbaflash.attention``.

    A call on device arrays that repeats an earlier one (the same shapes, strides, dtype
    and options, cache_seqlens an int or a device array as before) launches the kernels
    that call compiled directly, without checking and planning again
    (numbaflash/decode_direct.py).

    Returns:
        out (batch, Hq, Sq, d) in q's dtype, or ``(out, lse)``. Rows that see no key
        (n_b = 0, or a window that hides them all) give out = 0 and lse = -inf.

    Raises:
        ValueError, TypeError: bad shapes, dtypes, lengths or options, before anything is
            written or launched.
    """
    options = dict(causal=causal, scale=scale, window_size=window_size, softcap=softcap,
                   alibi_slopes=alibi_slopes, num_splits=num_splits)
    memory = _device_memory((q, k_cache, v_cache, k, v))
    context = None if memory is None else launcher.current_context()
    key = direct_key(memory, cache_seqlens, options, context)
    fast = decode_direct.lookup(key)
    got = None if fast is None else _repeat(fast, k, memory, cache_seqlens, stream, context)
    if got is None:
        with recording() as launched:
            got = _whole_call(q, k_cache, v_cache, cache_seqlens, k, v, stream, **options)
        if key is not None:
            decode_direct.remember(key, launched, context.device.id)
    return got if return_lse else got[0]


def _device_memory(xs):
    """For each of q, k_cache, v_cache, k, v (None stays None): (shape, byte strides,
    dtype, pointer, producer) of a device array (a Numba one, or anything with the CUDA
    Array Interface), producer being the handle of the stream it was made on
    (``streams.producer_stream``); None for all if any given one is not on the device (a
    call that is never repeated directly), or on the simulator. Each array's interface
    is read once: this runs before every repeated decoding call."""
    if simulating():
        return None
    out = []
    torch = sys.modules.get("torch")
    if torch is not None:
        _torch_typestrs(torch)
    streams = {}                # a PyTorch device's index -> its current stream's handle
    for x in xs:
        if x is None:
            out.append(None)
        elif hasattr(x, "gpu_data"):                # a Numba device array
            out.append((x.shape, x.strides, x.dtype, x.device_ctypes_pointer.value or 0,
                        producer_stream(x)))
        elif (torch is not None and isinstance(x, torch.Tensor) and x.is_cuda
              and x.dtype in _TORCH_TYPESTR and x.layout is torch.strided
              and not x.requires_grad):
            # What PyTorch's __cuda_array_interface__ gives (version 2: no stream, so the
            # producer is PyTorch's current stream, as torch_stream says), read from the
            # tensor without building the interface's dict: 32 us for three tensors on
            # an H100 (lab/runs/2026-12-07/153_decode_host_steps.txt).
            device = x.get_device()
            if device not in streams:
                streams[device] = torch_stream(x)
            size = x.element_size()
            strides = None if x.is_contiguous() else tuple(n * size for n in x.stride())
            out.append((tuple(x.shape), strides, _TORCH_TYPESTR[x.dtype],
                        x.data_ptr() if x.numel() else 0, streams[device]))
        else:
            try:        # a PyTorch bfloat16 tensor raises here: the whole call refuses it
                cai = x.__cuda_array_interface__
                named = cai.get("stream")
                out.append((tuple(cai["shape"]), cai.get("strides"), cai["typestr"],
                            cai["data"][0] or 0,
                            torch_stream(x) if named is None else handle_value(int(named))))
            except (AttributeError, TypeError, KeyError):
                return None
    return out


# PyTorch dtypes whose tensors _device_memory reads directly, with the typestr PyTorch's
# __cuda_array_interface__ gives them (others, bfloat16 among them, take the interface).
_TORCH_TYPESTR = {}


def _torch_typestrs(torch):
    """_TORCH_TYPESTR, filled the first time PyTorch is seen (it is never imported here)."""
    if not _TORCH_TYPESTR:
        _TORCH_TYPESTR.update({torch.float16: "<f2", torch.float32: "<f4",
                               torch.float64: "<f8", torch.int32: "<i4"})
    return _TORCH_TYPESTR


def direct_key(memory, cache_seqlens, options, context=None):
    """The kind of an ``attention_with_kvcache`` call on device arrays
    (numbaflash/decode_direct.py) from ``_device_memory``; None for a call that is never
    repeated directly (host arrays, the simulator, ALiBi slopes, lengths other than an int
    or an int32 device array). ``context``: the current Numba CUDA context, if the
    caller has it."""
    if memory is None or options["alibi_slopes"] is not None:
        return None
    k = memory[3]
    if arrays.is_device_array(cache_seqlens):
        lengths = _device_memory((cache_seqlens,))
        if lengths is None:
            return None
        lengths = lengths[0][:3]
    else:
        lengths = decode_direct.int_lengths_key(cache_seqlens, 0 if k is None else k[0][2])
        if lengths is None:
            return None
    device = (launcher.device_id() if context is None else context.device.id)
    try:        # options: attention_with_kvcache's dict, its keys always in one order
        key = ("arrays", device,
               tuple([None if m is None else (m[0], m[1], m[2], m[3] % 16) for m in memory]),
               lengths, tuple(options.values()))
        hash(key)
    except TypeError:
        return None
    return key


def _repeat(fast, k, memory, cache_seqlens, stream, context):
    """(out, lse) of a call of a kind ``fast`` (decode_direct.FastDecode) launched
    directly, on the call's stream (numbaflash/streams.py), inputs from other streams
    waited for as the whole call waits for them; None (nothing launched) if it must take
    the whole call: another device, or an int length out of range.

    What runs before the first kernel starts is what a call timed alone pays on top of
    its kernels, so it is kept short: the inputs' memory read once (``_device_memory``),
    the context asked for once (``launcher.current_context``), the scratch the stream's
    (``arrays.workspace``, laid out once in ``FastDecode.scratch``), the outputs' buffers
    taken just before the first kernel that writes them (with a combine, while the split
    kernel runs: FastDecode.launch), and the output arrays built after the launches."""
    B, Hq, Sq, d = memory[0][0]
    S_max = memory[1][0][2]
    lengths_on_device = arrays.is_device_array(cache_seqlens)
    if not (lengths_on_device or
            0 <= cache_seqlens <= S_max - (0 if k is None else memory[3][0][2])):
        return None
    device = context.device.id
    if not fast.ready(device):
        return None
    lengths = _device_memory((cache_seqlens,))[0] if lengths_on_device else None
    s = ready_handles([m[4] for m in memory if m is not None], stream,
                      [lengths[4]] if lengths_on_device else [], device)
    pointers = {"q": memory[0][3], "k_cache": memory[1][3], "v_cache": memory[2][3]}
    if k is not None:
        pointers["k"], pointers["v"] = memory[3][3], memory[4][3]
    # The scratch (the lengths, unless on the device, then the splits' partial results)
    # in the stream's workspace, each part 256-byte aligned (FastDecode.scratch).
    offsets, at = fast.scratch[lengths_on_device]
    base = arrays.workspace(at, s, context)
    if base is None:            # too large, or the caller's allocator owns every buffer
        # (held stays alive until the kernels are queued: the memory is theirs till then)
        held, base = arrays.scratch(at, s, context)     # noqa: F841
    for role, offset in offsets.items():
        pointers[role] = base + offset
    if lengths_on_device:
        pointers["seqlens"] = lengths[3]
    else:       # as _device_lengths does for one value, without an array around it
        launcher.memset_d32_async(pointers["seqlens"], cache_seqlens, B, s.handle)
    out_dtype = fast.made["out"][1]
    if arrays.caller_allocates() or out_dtype != np.dtype(memory[0][2]):
        # Outputs from the caller's allocator, or bfloat16 (the kernels' bits or float32
        # sums become a bfloat16 array after them): the whole call's way of finishing.
        def allocate(role, shape, dtype):
            if role in ("out", "lse"):          # returned: arrays
                a = arrays.device_empty(shape, dtype, s, context)
                return a, a.device_ctypes_pointer.value
            return None, pointers[role]
        made = fast.launch(pointers, allocate, s)
        return (arrays.finish(made["out"], (B, Hq, Sq, d), False, s, np.dtype(memory[0][2])),
                arrays.finish(made["lse"], (B, Hq, Sq), False, s))
    lse_dtype = fast.made["lse"][1]
    buffers = {}

    def allocate(role, shape, dtype):
        if role in ("out", "lse"):          # the buffers now, the arrays after the launch
            buffers[role], pointer = arrays.scratch(
                math.prod(shape) * np.dtype(dtype).itemsize, s, context)
            return None, pointer
        return None, pointers[role]
    fast.launch(pointers, allocate, s)
    return (arrays.c_contiguous((B, Hq, Sq, d), out_dtype, buffers["out"]),
            arrays.c_contiguous((B, Hq, Sq), lse_dtype, buffers["lse"]))


def _whole_call(q, k_cache, v_cache, cache_seqlens, k, v, stream, causal, scale,
                window_size, softcap, alibi_slopes, num_splits):
    """``attention_with_kvcache``'s checks, plan and launches: (out, lse)."""
    p = check_kvcache_inputs(q, k_cache, v_cache, cache_seqlens, k, v, causal, scale,
                             window_size, softcap, alibi_slopes, num_splits)
    plans = plan_kvcache(p, num_splits)
    inputs = [q, k_cache, v_cache] + ([k, v] if k is not None else [])
    host = not arrays.on_device(inputs)
    s = call_stream(inputs, stream)
    acc = np.dtype(p.acc_dtype)
    BH = p.B * p.Hq
    out_shape, lse_shape = (p.B, p.Hq, p.Sq, p.d), (p.B, p.Hq, p.Sq)

    if host and k is not None:                  # the new rows, into the host caches
        for b in range(p.B):
            at = int(p.seqlens[b])
            k_cache[b, :, at:at + p.S_new] = k[b]
            v_cache[b, :, at:at + p.S_new] = v[b]
    n_keys = p.n_max if host else p.S_max       # cache rows the kernels may read
    if BH == 0 or p.Sq == 0 or n_keys == 0:
        return (arrays.filled(out_shape, 0, p.dtype, host, s),
                arrays.filled(lse_shape, -np.inf, acc, host, s))

    # bfloat16 travels as its bits (uint16 views, numbaflash/dtypes.py): the kernels
    # widen what they read and round what they write.
    if host:    # only the rows some batch sees travel to the GPU
        K = as_bits(arrays.strided_view(k_cache[:, :, :n_keys], "k_cache", s))
        V = as_bits(arrays.strided_view(v_cache[:, :, :n_keys], "v_cache", s))
    else:       # read and written in place, whatever the order of their dimensions
        K = as_bits(arrays.strided_view(k_cache, "k_cache", s))
        V = as_bits(arrays.strided_view(v_cache, "v_cache", s))
    # The caches as flat views with strides (ValueError here, before anything is written,
    # if the head dim is not contiguous).
    K_flat, k_strides = arrays.flat_with_strides(K, "k_cache")
    V_flat, v_strides = arrays.flat_with_strides(V, "v_cache")
    Q = as_bits(arrays.strided_view(q, "q", s))
    if arrays.is_device_array(p.seqlens):
        wait_for(p.seqlens, s)
        seqlens = (p.seqlens if hasattr(p.seqlens, "copy_to_host")
                   else arrays.cuda.as_cuda_array(p.seqlens, sync=False))
    else:
        seqlens = _device_lengths(p.seqlens, s)
    if not host and k is not None and p.S_new:  # the new rows, into the device caches
        K_new = as_bits(arrays.strided_view(k, "k", s))
        V_new = as_bits(arrays.strided_view(v, "v", s))
        update = append_kernels.plan(p, plans[0].backend)
        args = (K, V, K_new, V_new, seqlens)
        direct = launch(append_kernels.kernel(update, p), update.grid, update.block, args,
                        _types_key("append", p, args), stream=s)
        _record(direct, args, ("k_cache", "v_cache", "k", "v", "seqlens"))
    O, L = launch_kvcache(plans, p, Q, (K_flat, k_strides), (V_flat, v_strides),
                          K.shape[2], seqlens, s)
    return arrays.finish(O, out_shape, host, s, p.dtype), arrays.finish(L, lse_shape, host, s)


def _device_lengths(values, stream):
    """Host lengths ((B,) int32) in a buffer of the stream's pool (no allocation per
    call), written on ``stream`` without waiting for it: a memset when every batch has
    the same length (an int ``cache_seqlens``), else an asynchronous copy. A plain copy
    from host memory would first wait for the work queued on the stream, so each decoding
    step would wait for the previous one's kernels and the host could never run ahead."""
    seqlens = arrays.device_empty(values.shape, np.int32, stream)
    if simulating() or not values.size:
        seqlens.copy_to_device(values)
        return seqlens
    address = seqlens.device_ctypes_pointer.value
    if (values == values[0]).all():
        driver.driver.cuMemsetD32Async(address, int(values[0]), values.size, stream.handle)
    else:       # pageable memory: staged by the driver before the call returns
        driver.driver.cuMemcpyHtoDAsync(address, values.ctypes.data, values.nbytes,
                                        stream.handle)
    return seqlens


def launch_kvcache(plans, p, Q, K, V, S, seqlens, stream):
    """Launch the split-KV kernel (and the combine) on device arrays, on ``stream``: Q
    (B, Hq, Sq, d), any strides; the caches K and V as ``(flat, strides)`` of a (B, Hk,
    S, d) array (arrays.flat_with_strides); return the outputs O (B*Hq, Sq, d) and L
    (B*Hq, Sq)."""
    BH = p.B * p.Hq
    acc = np.dtype(p.acc_dtype)
    O = arrays.device_empty((BH, p.Sq, p.d), kernel_dtype(p.dtype, False), stream)
    L = arrays.device_empty((BH, p.Sq), acc, stream)
    split_plan = plans[0]
    n = split_plan.grid[0]
    if n > 1:
        O_parts = arrays.device_empty((n, BH, p.Sq, p.d), acc, stream)
        L_parts = arrays.device_empty((n, BH, p.Sq), acc, stream)
    else:   # never written with one split: the smallest arrays of the right types
        O_parts = arrays.device_empty((1, 1, 1, 1), acc, stream)
        L_parts = arrays.device_empty((1, 1, 1), acc, stream)
    no_slopes, no_mask = _placeholders(p.acc_dtype, _context_key())[:2]
    slopes = (no_slopes if p.alibi_slopes is None
              else arrays.strided_view(p.alibi_slopes, "alibi_slopes", stream))
    (K_flat, k_strides), (V_flat, v_strides) = K, V
    args = (Q, K_flat, V_flat, seqlens, np.int64(p.S_new), O, L, O_parts, L_parts,
            acc.type(p.softmax_scale), np.int64(p.upper_shift), np.int64(p.lower_shift),
            np.int64(p.Hq), np.int64(p.group), acc.type(p.softcap), slopes, no_mask,
            np.int64(S), *(np.int64(x) for x in k_strides[:3]),
            *(np.int64(x) for x in v_strides[:3]))
    module = DECODE_MODULES[split_plan.version]
    # Repeated calls with the same argument types launch directly (launcher.launch)
    direct = launch(module.kernel(split_plan, p), split_plan.grid, split_plan.block, args,
                    _types_key("split", p, args),
                    split_plan.shared_bytes if split_plan.dynamic_shared else 0, stream)
    # With a combine after it the split kernel writes only the partial results, so a
    # repeated call makes out and lse while it runs (decode_direct.UNUSED).
    unused = decode_direct.UNUSED
    _record(direct, args, ("q", "k_cache", "v_cache", "seqlens", None,
                           "out" if n == 1 else unused, "lse" if n == 1 else unused,
                           "o_parts", "l_parts"))
    if n > 1:
        merge = plans[1]
        args = (O_parts, L_parts, O, L)
        module = COMBINE_MODULES[merge.version]
        direct = launch(module.kernel(merge, p), merge.grid, merge.block, args,
                        _types_key("combine", p, args), 0, stream)
        _record(direct, args, ("o_parts", "l_parts", "out", "lse"))
    return O, L


def _types_key(kernel, p, args):
    """launcher.launch's types_key for one decode kernel's arguments: its name, the dtypes,
    and each array argument's layout as Numba types it (the caches' flat views and the
    buffers made here are always C-contiguous; q, the caches' 4-D views and the caller's
    lengths may not be). None with the caller's ALiBi slopes (any dtype and layout) or on
    the simulator (every launch goes through Numba's dispatcher there)."""
    if p.alibi_slopes is not None or simulating():
        return None
    return (kernel, str(p.dtype), p.acc_dtype,
            tuple(a._numba_type_.layout for a in args if hasattr(a, "_numba_type_")
                  and getattr(a, "ndim", 0)))


# --- what a call launched, for numbaflash.torch's repeated calls ------------------------------

@dataclass(frozen=True)
class Launched:
    """One kernel a call launched directly: the launcher._DirectLaunch, the arguments it
    was given, and for each argument the name of the call's array it is a view of ("q",
    "k_cache", "v_cache", "k", "v", "seqlens", "out", "lse", "o_parts", "l_parts"), or
    None for a value that depends only on the call's shapes and options."""
    direct: object
    args: tuple
    roles: tuple


_RECORDING = contextvars.ContextVar("numbaflash_kvcache_recording", default=())


@contextlib.contextmanager
def recording():
    """Inside ``with recording() as launched:``, the list ``launched`` gets a ``Launched``
    for each kernel an ``attention_with_kvcache`` call launches directly, in order, and
    None for one it launches through Numba's dispatcher (then the call is not repeated
    directly: numbaflash/decode_direct.py). Recordings nest: each open one gets every
    launch."""
    launched = []
    token = _RECORDING.set(_RECORDING.get() + (launched,))
    try:
        yield launched
    finally:
        _RECORDING.reset(token)


def _record(direct, args, roles):
    for launched in _RECORDING.get():
        launched.append(None if direct is None else
                        Launched(direct, args, roles + (None,) * (len(args) - len(roles))))


def explain_kvcache(q, k_cache, v_cache, *, cache_seqlens, k=None, v=None, causal=False,
                    scale=None, num_splits=None, backend=None, **variants):
    """Validate like ``attention_with_kvcache`` and return its ``Plans`` without running
    them (nothing is written into the caches): the split-KV kernel, with the number of
    splits and why, and the combine when there is more than one split. ``backend`` as
    for ``numbaflash.explain``. q, the caches, k and v may be anything with ``shape`` and
    ``dtype``."""
    p = check_kvcache_inputs(q, k_cache, v_cache, cache_seqlens, k, v, causal, scale,
                             num_splits=num_splits, **variants)
    return plan_kvcache(p, num_splits, where=backend)
