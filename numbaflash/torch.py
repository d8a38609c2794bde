"""numbaflash for PyTorch: autograd, and drop-ins for SDPA and flash-attn's ``flash_attn_func``.

An optional layer: ``import numbaflash`` never imports PyTorch; ``import numbaflash.torch``
does (``pip install numbaflash[torch]``). Four functions differentiable through
``torch.autograd`` with respect to q, k and v, and one for decoding:

    attention(q, k, v, **options)        numbaflash.attention's (batch, heads, seqlen, d)
                                         layout and keyword arguments
    scaled_dot_product_attention(...)    torch.nn.functional.scaled_dot_product_attention's
                                         signature and semantics (top-left is_causal, bool
                                         and float masks, enable_gqa)
    flash_attn_func(...)                 flash_attn.flash_attn_func's signature, its
                                         (batch, seqlen, heads, d) layout and semantics
                                         (bottom-right causal, window_size, softcap, ALiBi)
    flash_attn_varlen_func(...)          flash-attn's packed-batch call: sequences of different
                                         lengths back to back, no padding
    flash_attn_with_kvcache(...)         flash-attn's decoding call: new keys and values
                                         written into the caches in place, split-KV
                                         (inference only: no autograd)

This module holds ``attention`` and the steps every call shares; the four drop-ins live
in numbaflash/torch_dropins.py and are handed out here under their names.

Where the tensors live decides the path:

- CUDA tensors go straight to the kernels through ``__cuda_array_interface__`` (no copy
  for C-contiguous tensors), on PyTorch's current stream (numbaflash/streams.py); the
  outputs are allocated by PyTorch's caching allocator on that stream
  (``arrays.allocator``) and come back as tensors on q's device (no copy).
- CPU tensors go through NumPy (``tensor.numpy()`` and ``torch.from_numpy``, no copies of
  their own): on a machine without a GPU the kernels run in the CUDA simulator
  (``NUMBA_ENABLE_CUDASIM=1``), so a tiny model trains with autograd on a laptop.

bfloat16 tensors pass as a 16-bit integer view of their memory, without a copy: PyTorch
exports no bfloat16 that NumPy or Numba read (``tensor.numpy()`` refuses it, and its
``__cuda_array_interface__`` gives none, or only an opaque "<V2"), while numbaflash
takes it as ``ml_dtypes.bfloat16`` (numbaflash/dtypes.py). So ``_array`` reinterprets
``tensor.view(torch.int16)``: a CPU tensor becomes ``.numpy().view(ml_dtypes.bfloat16)``,
a CUDA tensor a Numba device array of ``ml_dtypes.bfloat16`` over the tensor's memory
(bound to PyTorch's current stream, so the call runs there as for the other dtypes);
and ``_tensor`` turns bfloat16 results back the same way (``torch.from_numpy`` or
``torch.as_tensor`` of their int16 view, then ``.view(torch.bfloat16)``). Nothing is
converted on the way: out and the gradients are bfloat16, lse float32. The bits
(uint16) the kernels write for CUDA calls live in int16 tensors from PyTorch's allocator
(``_Uint16``). A float ``attn_mask`` or ``alibi_slopes`` in bfloat16 is widened to
float32 first (exactly; the kernels add them in float32).

The forward saves out and the logsumexp lse; the backward runs numbaflash's backward
kernels (FlashAttention-2 Algorithm 2), which recompute the probabilities from them.

``torch.compile``: the forward and the backward are registered as PyTorch custom ops
(``numbaflash::attention_forward``, ``numbaflash::attention_backward``) with shape
functions, so a compiled model keeps them in its graph (no graph break) whenever the call
has no Python device functions; a call with ``score_mod`` or ``mask_mod`` (Numba device
functions, which an op's schema cannot carry) runs eagerly: one graph break there.
Outside compilation the same kernels run through a ``torch.autograd.Function`` (less
Python per call), or without one when no input needs a gradient; a forward call on CUDA
tensors that repeats an earlier one in shapes, dtype, device and options launches that
call's kernel directly (``_FastForward``, below). CUDA graph capture is refused with a
RuntimeError: a call allocates its outputs and the backward reads a flag back to the host,
which a capture forbids. The exception is decoding: a ``flash_attn_with_kvcache`` call
that repeats an earlier one launches its kernels directly, allocating through PyTorch
(numbaflash/decode_direct.py), and that can be captured.
"""

import contextlib
import ctypes
import logging

import numpy as np
from numba import cuda

try:
    import torch
except ImportError as e:            # pragma: no cover - only without PyTorch
    raise ImportError("numbaflash.torch needs PyTorch: pip install numbaflash[torch] "
                      "(or pip install torch)") from e

from . import api, arrays, dtypes, launcher, streams
from .dropout import check_dropout_p, seed_words
from .kernels import forward as forward_kernels
from .kernels.plan import needs_variants
from .validate import check_attention_inputs

__all__ = ["attention", "scaled_dot_product_attention", "flash_attn_func",
           "flash_attn_varlen_func", "flash_attn_with_kvcache"]

_compiling = getattr(torch.compiler, "is_compiling", lambda: False)

# the dtypes of q, k, v the kernels take; bfloat16 passes as an int16 view (module docstring)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# --- tensors in and out --------------------------------------------------------------------

def _check_tensors(**tensors):
    """Every given tensor is a torch.Tensor on q's device; q, k and v have a dtype the
    kernels take. Raises TypeError or ValueError before anything is launched."""
    q = tensors["q"]
    for name, x in tensors.items():
        if x is None:
            continue
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(x).__name__} "
                            f"(numbaflash.attention takes NumPy and other arrays)")
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device} but q is on {q.device}: all tensors "
                             f"of a call must be on one device")
    for name in ("q", "k", "v"):
        dtype = tensors[name].dtype
        if dtype not in _DTYPES:
            raise TypeError(f"{name} has dtype {dtype}: numbaflash supports float16 and "
                            f"bfloat16 (computed in float32), float32 and float64")
    if not (q.dtype == tensors["k"].dtype == tensors["v"].dtype):
        raise TypeError(f"q, k, v must have the same dtype; got {q.dtype}, "
                        f"{tensors['k'].dtype}, {tensors['v'].dtype}")


def _array(x):
    """What numbaflash takes for tensor ``x``, without a copy: the (detached) CUDA tensor
    itself, which exports ``__cuda_array_interface__``, or a NumPy view of a CPU tensor;
    for bfloat16, an ``ml_dtypes.bfloat16`` view of its int16 view (module docstring)."""
    if x is None:
        return None
    x = x.detach()
    if x.dtype == torch.bfloat16:
        bits = x.view(torch.int16)
        if not x.is_cuda:
            return bits.numpy().view(dtypes.BFLOAT16)
        return _bfloat16_device_array(bits, x.device)
    return x if x.is_cuda else x.numpy()


def _bfloat16_device_array(bits, device):
    """A Numba device array of ``ml_dtypes.bfloat16`` over the memory of the int16 CUDA
    tensor ``bits`` (it keeps the tensor alive), bound to PyTorch's current stream: its
    interface names that stream, so numbaflash's call runs there (numbaflash/streams.py),
    as it does for the tensors of other dtypes. (A Numba array made from PyTorch's
    interface alone names no stream, and the call would take the default stream.)"""
    a = cuda.as_cuda_array(bits, sync=False).view(dtypes.BFLOAT16)
    return a.bind(_torch_stream(device).numba)


_TORCH_DTYPES = {np.dtype(np.float16): torch.float16, np.dtype(np.float32): torch.float32,
                 np.dtype(np.float64): torch.float64,
                 np.dtype(np.int32): torch.int32,        # a decoding call's int lengths
                 np.dtype(np.uint8): torch.uint8}        # scratch bytes (arrays.scratch)


class _Uint16:
    """An int16 CUDA tensor shown through ``__cuda_array_interface__`` as uint16: the kernel
    bits of bfloat16 outputs (dtypes.BITS), from PyTorch's allocator like any output. (Not
    a torch.uint16 tensor: not every PyTorch release this layer runs on exports that
    dtype.)"""

    def __init__(self, shape, device):
        self.tensor = torch.empty(shape, dtype=torch.int16, device=device)
        self.__cuda_array_interface__ = dict(self.tensor.__cuda_array_interface__,
                                             typestr=dtypes.BITS.str)


def _outputs_from(device):
    """Where the kernels' outputs come from: PyTorch's caching allocator for CUDA tensors
    (``torch.empty`` on ``device``, PyTorch's current stream: arrays.allocator), nothing
    special for CPU tensors."""
    if device.type != "cuda":
        return contextlib.nullcontext()

    def allocate(shape, dtype):
        dtype = np.dtype(dtype)
        if dtype == dtypes.BITS:
            return _Uint16(shape, device)
        return torch.empty(shape, dtype=_TORCH_DTYPES[dtype], device=device)
    return arrays.allocator(allocate)


def _tensor(x, device):
    """A torch tensor on ``device`` for what numbaflash returned, without a copy: a NumPy
    array (CPU inputs) or a Numba device array (CUDA inputs; the tensor keeps it alive).
    bfloat16 comes back through its int16 view (module docstring)."""
    if dtypes.is_bfloat16(x.dtype):
        return _tensor(x.view(np.int16), device).view(torch.bfloat16)
    if isinstance(x, np.ndarray):
        return torch.from_numpy(x)
    return torch.as_tensor(x, device=device)


def _compact(x):
    """A C-contiguous version of an attn_mask or alibi_slopes tensor. Dimensions that
    ``expand`` broadcast (stride 0) are cut to size 1 first: the kernels broadcast size-1
    dimensions of a mask themselves, so an expanded mask is never materialised."""
    if x is None or x.is_contiguous():
        return x
    return x[tuple(slice(0, 1) if stride == 0 and size > 1 else slice(None)
                   for stride, size in zip(x.stride(), x.shape))].contiguous()


def _widened(x):
    """An attn_mask or alibi_slopes tensor as numbaflash takes it: a bfloat16 one (what
    PyTorch's SDPA asks for with bfloat16 inputs) as float32, exactly (the kernels add it
    in float32), after ``_compact`` (an expanded mask stays unmaterialised); others as
    they are."""
    if x is None or x.dtype != torch.bfloat16:
        return x
    return _compact(x).float()


# --- the forward, and its repeated calls on CUDA tensors --------------------------------------
#
# What numbaflash.attention does before its launch (checking the inputs, planning, Numba's
# view of each tensor, the output buffers' views) depends only on the shapes, the dtype,
# the device and the options, and at (1, 1, 128, 64) it costs many times the kernel. So a
# forward call on CUDA tensors that repeats an earlier one in all of those (a training or
# decoding loop) launches the kernel that call compiled directly, with the tensors'
# pointers (launcher.PreparedLaunch: its words laid out once, the pointers written per
# call), on PyTorch's current stream, into outputs from PyTorch's allocator. The first
# call of each kind takes the whole path, so bad input still raises before any launch;
# only calls without arrays or device functions among their options (no alibi_slopes,
# attn_mask, score_mod or mask_mod) and on kernels that take no tile table are
# remembered. The dropout seed may differ from call to call.
# bfloat16 takes the direct launch only on a kernel that reads its bits itself (forward
# v7, and v10, the GPU's default: the tensors' pointers are the bits they read and
# write); on the others a call also widens the inputs to float32 copies and rounds the
# output back (numbaflash/dtypes.py), launches the direct path does not make, so every
# such call takes the whole path.

_FAST = {}                  # _fast_key -> _FastForward
_FAST_MAX = 256
_STREAMS = {}               # (device, CUstream handle) -> streams.CallStream
_NO_SEED = (ctypes.c_uint32(0), ctypes.c_uint32(0))


def _fast_key(q, k, v, alibi_slopes, attn_mask, options):
    """What the forward's checks and plan depend on, for a call that may be repeated
    directly (above); None for calls that may not."""
    if (not q.is_cuda or alibi_slopes is not None or attn_mask is not None
            or options["score_mod"] is not None or options["score_mod_grad"] is not None
            or options["mask_mod"] is not None):
        return None
    return _key_of(q, k, v, options["causal"], options["scale"], options["version"],
                   options["tiles"], options["window_size"], options["softcap"],
                   options["dropout_p"])


def _key_of(q, k, v, causal, scale, version, tiles, window, softcap, dropout_p):
    """``_fast_key``'s key from the options themselves; None if one is unhashable."""
    try:
        key = (q.shape, k.shape, v.shape, q.dtype, q.device, type(causal), causal, scale,
               version, None if tiles is None else tuple(tiles),
               None if window is None else tuple(window), softcap, dropout_p)
        hash(key)
    except TypeError:
        return None
    return key


# the current CUDA device's index, without torch.cuda.current_device's Python around it
_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


def _repeated(q, k, v, causal, scale, window_size, softcap, version, tiles):
    """out of a repeated forward call without autograd, dropout or tensors among its
    options, launched directly (_FastForward) before any of the whole path's steps;
    None (nothing launched) for every other call, which takes the whole path. What the
    first call of the kind checked holds for this one: the key has the shapes, q's
    dtype and device, and the options; here k and v have q's dtype and device, and all
    three are plain C-contiguous CUDA tensors."""
    if (type(q) is not torch.Tensor or type(k) is not torch.Tensor
            or type(v) is not torch.Tensor or _compiling()):
        return None
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return None
    if not (q.is_cuda and q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
            and k.dtype is q.dtype and v.dtype is q.dtype):
        return None
    device = q.device
    if k.device != device or v.device != device:
        return None
    fast = _FAST.get(_key_of(q, k, v, causal, scale, version, tiles, window_size, softcap,
                             0.0))
    if fast is None:
        return None
    _refuse_capture(device)
    got = fast(q, k, v, None)
    return None if got is None else got[0]


class _FastForward:
    """One kind of forward call (``_fast_key``), ready to launch again: the Problem and
    plan of its first call, the kernel that call launched (a launcher._DirectLaunch), and
    every parameter word that does not change between calls."""

    def __init__(self, p, plan, direct, device_index, packed=None):
        self.plan, self.direct, self.device_index = plan, direct, device_index
        self.prepared = None        # its launcher.PreparedLaunch, once made
        self.lse_dtype = _TORCH_DTYPES[np.dtype(p.acc_dtype)]
        seqs = None
        if packed is None:
            self.out_shape = p.lead + (p.Sq, p.d)
            self.lse_shape = p.lead + (p.Sq,)
            self.q3, self.k3, self.l2 = (p.BH, p.Sq, p.d), (p.BHkv, p.Sk, p.d), (p.BH, p.Sq)
        else:
            # a packed batch read as it is (flash_attn_func in place): the arrays'
            # (total, heads, d) shapes
            total_q, total_k, seqs = packed
            self.out_shape = (total_q, p.Hq, p.d)
            self.lse_shape = self.l2 = (p.Hq, total_q)
            self.q3, self.k3 = (total_q, p.Hq, p.d), (total_k, p.Hq // p.group, p.d)
        # each array's words around its pointer (_tensor_words), the same on every call
        item = np.dtype(p.dtype).itemsize
        self.q_words = _words_around_pointer(self.q3, item)
        self.k_words = _words_around_pointer(self.k3, item)
        self.l_words = _words_around_pointer(self.l2, np.dtype(p.acc_dtype).itemsize)
        self.dropout = p.variant.dropout
        # the arguments after the five arrays, as launch_forward passes them: a kernel
        # built without variants (forward v10's plain build) takes scale and offset only
        acc = np.dtype(p.acc_dtype)
        rest = (acc.type(p.softmax_scale), np.int64(p.causal_offset))
        self.variant_arguments = len(direct.makers) > 7
        if self.variant_arguments:
            rest += launcher.variant_arguments(p, None, None, None, seqs)
        words = []
        for make, a in zip(direct.makers[5:], rest):
            words.append(tuple(make(a)))
        if not self.variant_arguments:
            self.before_seed, self.after_seed = sum(words, ()), ()
            return
        # (scale, offset, window_lo, Hq, group, softcap, slopes, attn_mask, tiles) | seed
        # words | (keep_threshold, keep_scale, seqs): launcher.variant_arguments' order
        assert len(words) == 14, "launcher.variant_arguments changed: update the splice"
        self.before_seed = sum(words[:9], ())
        self.after_seed = sum(words[11:], ())

    def __call__(self, q, k, v, seed):
        """(out, lse) for tensors of this kind, or None if the kernel cannot be launched
        directly here (another current device: the caller takes the whole path)."""
        device = q.device
        index = device.index
        if index != self.device_index or _current_device() != index:
            return None
        if self.dropout:
            lo, hi = seed_words(seed)           # ValueError for a bad seed, before anything
            seed_part = (ctypes.c_uint32(lo), ctypes.c_uint32(hi))
        elif self.variant_arguments:
            seed_part = _NO_SEED
        else:
            seed_part = ()
        stream = _torch_stream(device)
        out = torch.empty(self.out_shape, dtype=q.dtype, device=device)
        lse = torch.empty(self.lse_shape, dtype=self.lse_dtype, device=device)
        pointers = (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr())
        prepared = (self.prepared or self._prepare(seed_part, index)
                    if launcher.PREPARED_LAUNCH else None)
        if prepared is not None:
            # the words that change: the five pointers, then the seed's (with dropout)
            prepared.launch(pointers + (tuple(w.value for w in seed_part) if self.dropout
                                        else ()), stream.handle)
        elif not self.direct.launch_words(self._words(pointers, seed_part), stream, index):
            return None
        if launcher.log.isEnabledFor(logging.INFO):
            launcher.log.info("%s", self.plan)
        return out, lse

    def _words(self, pointers, seed_part):
        """The kernel's parameter words for these five pointers (q, k, v, out, lse) and
        seed words."""
        q_words, k_words, l_words = self.q_words, self.k_words, self.l_words
        q, k, v, out, lse = pointers
        return (*q_words[0], q, *q_words[1], *k_words[0], k, *k_words[1], *k_words[0], v,
                *k_words[1], *q_words[0], out, *q_words[1], *l_words[0], lse, *l_words[1],
                *self.before_seed, *seed_part, *self.after_seed)

    def _prepare(self, seed_part, index):
        """The launcher.PreparedLaunch of this kind (None if its kernel cannot be launched
        that way): the words laid out once, the pointers' positions (and with dropout
        the seed's) written at each launch."""
        words = self._words((0, 0, 0, 0, 0), seed_part)
        q_words, k_words, l_words = self.q_words, self.k_words, self.l_words
        slots, at = [], 0
        for before, after in (q_words, k_words, k_words, q_words, l_words):
            at += len(before)
            slots.append(at)
            at += 1 + len(after)
        if self.dropout:
            at += len(self.before_seed)
            slots += [at, at + 1]
        self.prepared = self.direct.prepare(words, slots, index)
        return self.prepared


def _tensor_words(t, shape3):
    """The parameter words of C-contiguous tensor ``t`` seen as ``shape3``."""
    before, after = _words_around_pointer(shape3, t.element_size())
    return (*before, t.data_ptr(), *after)


def _words_around_pointer(shape, itemsize):
    """The words of a C-contiguous array of this shape before and after its pointer."""
    strides, step = [], itemsize
    for n in reversed(shape):
        strides.append(step)
        step *= n
    words = launcher.array_words(step // itemsize, itemsize, 0, shape, strides[::-1])
    return words[:4], words[5:]


# PyTorch's current stream as a raw handle, without building a torch.cuda.Stream (a
# private function Triton uses too); torch.cuda.current_stream where it is missing
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _torch_stream(device):
    """The streams.CallStream of PyTorch's current stream on ``device`` (cached per
    handle: a CallStream wraps the handle, it does not own the stream)."""
    if _raw_stream is not None:
        handle = _raw_stream(device.index)
    else:
        handle = torch.cuda.current_stream(device).cuda_stream
    key = (device.index, handle)
    call = _STREAMS.get(key)
    if call is None:
        if len(_STREAMS) >= _FAST_MAX:         # a loop that makes a new stream per call
            _STREAMS.clear()
        call = _STREAMS[key] = streams.call_stream((), handle)
    return call


def _remember(key, q, k, v, options):
    """After a whole-path forward call on CUDA tensors: keep what repeating it directly
    needs (``_FastForward``), if its kernel was launched directly."""
    o = options
    variants = api._variants(o["window_size"], None, o["softcap"], None, None, None, None,
                             o["dropout_p"], o["dropout_seed"])
    p, plan = api._forward_problem_and_plan(_array(q), _array(k), _array(v), o["causal"],
                                            o["scale"], variants, o["version"], o["tiles"])
    module = forward_kernels.module(plan.version)
    if p.BH == 0 or p.Sq == 0 or p.Sk == 0 or p.variant.tile_table:
        return
    if not module.VARIANTS and needs_variants(p) is not None:
        return              # (a plan never gives a variant to such a kernel)
    if dtypes.widens(p, module):        # bfloat16 through float32 copies: the whole path
        return
    nbytes = plan.shared_bytes if plan.dynamic_shared else 0
    direct = launcher._DIRECT.get((module.kernel(plan, p), (p.dtype, p.acc_dtype),
                                   plan.grid, plan.block, nbytes))
    if direct is None or direct.makers is None or q.device.index not in direct.functions:
        return
    if len(_FAST) >= _FAST_MAX:
        _FAST.clear()
    _FAST[key] = _FastForward(p, plan, direct, q.device.index)


def _forward(q, k, v, alibi_slopes, attn_mask, options):
    """numbaflash.attention(..., return_lse=True) on tensors: (out, lse) tensors on q's
    device; a repeated call on CUDA tensors launches directly (above)."""
    key = _fast_key(q, k, v, alibi_slopes, attn_mask, options)
    fast = _FAST.get(key) if key is not None else None
    if fast is not None:
        got = fast(q, k, v, options["dropout_seed"])
        if got is not None:
            return got
    with _outputs_from(q.device):
        out, lse = api.attention(_array(q), _array(k), _array(v), return_lse=True,
                                 alibi_slopes=_array(alibi_slopes),
                                 attn_mask=_array(attn_mask), **options)
    if key is not None and fast is None:
        _remember(key, q, k, v, options)
    return _tensor(out, q.device), _tensor(lse, q.device)


# --- autograd --------------------------------------------------------------------------------

class _Attention(torch.autograd.Function):
    """out = attention(q, k, v); forward and backward by numbaflash's kernels.

    ``forward(ctx, q, k, v, alibi_slopes, attn_mask, forward_options, backward_options)``
    takes C-contiguous q, k, v and returns (out, lse), lse not differentiable. The options
    are numbaflash.attention's and attention_backward's keyword arguments other than
    the arrays."""

    @staticmethod
    def forward(ctx, q, k, v, alibi_slopes, attn_mask, forward_options, backward_options):
        out, lse = _forward(q, k, v, alibi_slopes, attn_mask, forward_options)
        ctx.mark_non_differentiable(lse)
        ctx.save_for_backward(q, k, v, out, lse, alibi_slopes, attn_mask)
        ctx.backward_options = backward_options
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, alibi_slopes, attn_mask = ctx.saved_tensors
        with _outputs_from(q.device):
            dq, dk, dv = api.attention_backward(
                _array(dout.contiguous()), _array(q), _array(k), _array(v), _array(out),
                _array(lse), alibi_slopes=_array(alibi_slopes), attn_mask=_array(attn_mask),
                **ctx.backward_options)
        # No gradient for alibi_slopes or attn_mask, nor for the options.
        return (_tensor(dq, q.device), _tensor(dk, q.device), _tensor(dv, q.device),
                None, None, None, None)


def _refuse_capture(device):
    """RuntimeError if PyTorch is capturing a CUDA graph on ``device``'s current stream."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "numbaflash cannot run inside CUDA graph capture: each call allocates its "
            "outputs (cuMemAlloc) and the backward copies a flag back to the host, which "
            "a capture does not allow; call it outside torch.cuda.graph(...)")


# --- custom ops: what torch.compile sees ----------------------------------------------------
#
# An op's schema holds tensors, numbers and strings only, so the options travel as those:
# causal as "" (none), "bottom_right" or "top_left", window_size and tiles as int lists.

def _causal_word(causal):
    if causal is None or causal is False:
        return ""
    if causal is True:
        return "bottom_right"
    if isinstance(causal, str):
        return causal
    raise TypeError(f"causal must be False, True, 'bottom_right' or 'top_left'; got "
                    f"{causal!r}")


def _options(causal, scale, window, softcap, version, tiles):
    """numbaflash's keyword arguments from an op's arguments."""
    return dict(causal=causal or False, scale=scale,
                window_size=None if window is None else tuple(window), softcap=softcap,
                version=version, tiles=None if tiles is None else tuple(tiles))


@torch.library.custom_op("numbaflash::attention_forward", mutates_args=())
def _forward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                alibi_slopes: torch.Tensor | None, attn_mask: torch.Tensor | None,
                causal: str, scale: float | None, window: list[int] | None,
                softcap: float | None, version: str | None, tiles: list[int] | None,
                backward_version: str | None,
                backward_tiles: list[int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward (backward_version and backward_tiles are for the op's backward)."""
    _refuse_capture(q.device)
    with _outputs_from(q.device):
        out, lse = api.attention(_array(q), _array(k), _array(v), return_lse=True,
                                 alibi_slopes=_array(alibi_slopes),
                                 attn_mask=_array(attn_mask),
                                 **_options(causal, scale, window, softcap, version, tiles))
    return _tensor(out, q.device), _tensor(lse, q.device)


@_forward_op.register_fake
def _(q, k, v, alibi_slopes, attn_mask, causal, scale, window, softcap, version, tiles,
      backward_version, backward_tiles):
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=lse_dtype)


@torch.library.custom_op("numbaflash::attention_backward", mutates_args=())
def _backward_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor, alibi_slopes: torch.Tensor | None,
                 attn_mask: torch.Tensor | None, causal: str, scale: float | None,
                 window: list[int] | None, softcap: float | None, version: str | None,
                 tiles: list[int] | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _refuse_capture(q.device)
    with _outputs_from(q.device):
        grads = api.attention_backward(
            _array(dout), _array(q), _array(k), _array(v), _array(out), _array(lse),
            alibi_slopes=_array(alibi_slopes), attn_mask=_array(attn_mask),
            **_options(causal, scale, window, softcap, version, tiles))
    return tuple(_tensor(g, q.device) for g in grads)


@_backward_op.register_fake
def _(dout, q, k, v, out, lse, alibi_slopes, attn_mask, causal, scale, window, softcap,
      version, tiles):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_forward_op(ctx, inputs, output):
    q, k, v, alibi_slopes, attn_mask, *options = inputs
    ctx.save_for_backward(q, k, v, *output, alibi_slopes, attn_mask)
    # causal, scale, window, softcap, version, tiles, backward_version, backward_tiles
    ctx.options = options
    ctx.mark_non_differentiable(output[1])


def _backward_of_forward_op(ctx, dout, _dlse):
    q, k, v, out, lse, alibi_slopes, attn_mask = ctx.saved_tensors
    causal, scale, window, softcap, _, _, version, tiles = ctx.options
    dq, dk, dv = _backward_op(dout.contiguous(), q, k, v, out, lse, alibi_slopes, attn_mask,
                              causal, scale, window, softcap, version, tiles)
    return (dq, dk, dv) + (None,) * 10


_forward_op.register_autograd(_backward_of_forward_op, setup_context=_setup_forward_op)


def _torch_seed():
    """A dropout seed in [0, 2**64) from PyTorch's default CPU generator, so that
    ``torch.manual_seed`` makes a run with dropout reproducible."""
    lo, hi = (int(x) for x in torch.randint(0, 2**32, (2,), dtype=torch.int64))
    return lo | (hi << 32)


def attention(q, k, v, *, causal=False, scale=None, window_size=None, alibi_slopes=None,
              softcap=None, attn_mask=None, score_mod=None, score_mod_grad=None,
              mask_mod=None, dropout_p=0.0, dropout_seed=None, version=None, tiles=None,
              backward_version=None, backward_tiles=None):
    """``numbaflash.attention`` for torch tensors, differentiable through torch.autograd.

    The forward runs numbaflash.attention(..., return_lse=True) and saves out and lse;
    the backward runs numbaflash.attention_backward. Gradients flow to q, k and v only:
    **no gradient is computed for alibi_slopes or attn_mask** (they are treated as
    constants; their ``.grad`` stays None).

    Args:
        q: (batch, heads, Sq, d), (heads, Sq, d) or (Sq, d) tensor, float16 or bfloat16
            (computed in float32; out and the gradients in q's dtype), float32 or float64.
        k, v: (..., Sk, d) with q's batch dim and dtype; as many heads as q or a divisor
            of that (GQA/MQA).
            All on one device. CUDA tensors run on the GPU on PyTorch's current stream;
            CPU tensors run through NumPy (on the simulator without a GPU). Tensors that
            are not C-contiguous are copied first (``.contiguous()``).
        causal, scale, window_size, softcap, score_mod, score_mod_grad, mask_mod, version,
            tiles: as for ``numbaflash.attention`` (version and tiles: the forward's).
        dropout_p, dropout_seed: as for ``numbaflash.attention``; with dropout_p > 0 and
            no seed, a seed is drawn from PyTorch's default generator (``torch.manual_seed``
            reproduces it), and the backward regenerates the same mask from it.
        alibi_slopes, attn_mask: tensors on q's device, as for ``numbaflash.attention``
            (an attn_mask broadcast with ``expand`` is not materialised; a bfloat16 one
            is widened to float32, exactly). No gradient.
        backward_version, backward_tiles: ``version`` and ``tiles`` of the backward
            (numbaflash.attention_backward).

    Returns:
        out: a tensor with q's shape, dtype and device. Rows that see no key give 0.

    Raises:
        ValueError, TypeError: as numbaflash.attention, plus tensors on different
            devices, non-tensor inputs, or a score_mod without score_mod_grad
            when a gradient is needed; raised before anything is launched.
    """
    if (alibi_slopes is None and attn_mask is None and score_mod is None
            and score_mod_grad is None and mask_mod is None and dropout_p == 0.0):
        out = _repeated(q, k, v, causal, scale, window_size, softcap, version, tiles)
        if out is not None:
            return out
    _check_tensors(q=q, k=k, v=v, alibi_slopes=alibi_slopes, attn_mask=attn_mask)
    alibi_slopes, attn_mask = _widened(alibi_slopes), _widened(attn_mask)
    if dropout_p != 0.0 and dropout_seed is None:
        check_dropout_p(dropout_p)                  # a bad p fails here, before any copy
        dropout_seed = _torch_seed()
    if _compiling():
        if score_mod is None and score_mod_grad is None and mask_mod is None and not dropout_p:
            return _compiled_attention(q, k, v, causal, scale, window_size, alibi_slopes,
                                       softcap, attn_mask, version, tiles, backward_version,
                                       backward_tiles)
        return _eager_attention(q, k, v, causal=causal, scale=scale, window_size=window_size,
                                alibi_slopes=alibi_slopes, softcap=softcap,
                                attn_mask=attn_mask, score_mod=score_mod,
                                score_mod_grad=score_mod_grad, mask_mod=mask_mod,
                                dropout_p=dropout_p, dropout_seed=dropout_seed,
                                version=version, tiles=tiles,
                                backward_version=backward_version,
                                backward_tiles=backward_tiles)
    _refuse_capture(q.device)
    variants = dict(window_size=window_size, softcap=softcap, score_mod=score_mod,
                    score_mod_grad=score_mod_grad, mask_mod=mask_mod, dropout_p=dropout_p,
                    dropout_seed=dropout_seed)
    needs_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    if needs_grad and score_mod is not None and score_mod_grad is None:
        raise ValueError("the backward of a score_mod needs its derivative: pass "
                         "score_mod_grad (a Numba device function), or call under "
                         "torch.no_grad()")
    if needs_grad and (backward_version is not None or backward_tiles is not None):
        # bad backward options fail now, not after the forward (as attention_vjp does)
        api.explain_backward(q, k, v, causal=causal, scale=scale, version=backward_version,
                             tiles=backward_tiles, alibi_slopes=alibi_slopes,
                             attn_mask=attn_mask, **variants)
    elif not all(x is None or x.is_contiguous() for x in (q, k, v, alibi_slopes, attn_mask)):
        # A copy comes next (on a GPU, a launch): validate first, so bad input raises
        # before anything runs. (Contiguous inputs are validated by numbaflash.attention,
        # before its first launch.)
        check_attention_inputs(q, k, v, causal, scale, alibi_slopes=alibi_slopes,
                               attn_mask=attn_mask, **variants)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    forward_options = dict(causal=causal, scale=scale, version=version, tiles=tiles,
                           **variants)
    if not needs_grad:                  # nothing to save for a backward: no autograd node
        out, _ = _forward(q, k, v, _compact(alibi_slopes), _compact(attn_mask),
                          forward_options)
        return out
    backward_options = dict(causal=causal, scale=scale, version=backward_version,
                            tiles=backward_tiles, **variants)
    out, _ = _Attention.apply(q, k, v, _compact(alibi_slopes), _compact(attn_mask),
                              forward_options, backward_options)
    return out


def _compiled_attention(q, k, v, causal, scale, window_size, alibi_slopes, softcap,
                        attn_mask, version, tiles, backward_version, backward_tiles):
    """``attention`` while torch.compile traces: the custom op, which validates its
    inputs when it runs (the shape function only says what it returns)."""
    window = None if window_size is None else [int(w) for w in window_size]
    out, _ = _forward_op(q.contiguous(), k.contiguous(), v.contiguous(),
                         _compact(alibi_slopes), _compact(attn_mask), _causal_word(causal),
                         None if scale is None else float(scale), window,
                         None if softcap is None else float(softcap), version,
                         None if tiles is None else [int(t) for t in tiles],
                         backward_version,
                         None if backward_tiles is None else [int(t) for t in backward_tiles])
    return out


@torch.compiler.disable
def _eager_attention(q, k, v, **options):
    """``attention`` with a score_mod or mask_mod, or with dropout, under torch.compile: run
    eagerly (a graph break), since an op's schema cannot carry a Numba device function
    (and the dropout seed is drawn on the host)."""
    return attention(q, k, v, **options)


# --- the drop-ins for PyTorch's SDPA and flash-attn's functions ------------------------------
#
# They live in numbaflash/torch_dropins.py, which builds on the steps above; this module
# hands them out under its own name (PEP 562), importing that module on first use, so
# neither module imports the other while it is being imported.

_DROPINS = ("scaled_dot_product_attention", "flash_attn_func", "flash_attn_varlen_func",
            "flash_attn_with_kvcache")


def __getattr__(name):
    if name in _DROPINS:
        from . import torch_dropins
        return getattr(torch_dropins, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_DROPINS))
