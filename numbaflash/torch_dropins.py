"""Drop-ins for PyTorch tensors, on numbaflash's kernels: PyTorch's
``scaled_dot_product_attention``, and flash-attn's ``flash_attn_func``,
``flash_attn_varlen_func`` and ``flash_attn_with_kvcache`` with flash-attn's signatures,
(batch, seqlen, heads, d) layout and semantics. ``numbaflash.torch`` exports them (its
docstring says how tensors reach the kernels) and holds the steps they share with its
``attention``; this module holds the signatures and what they alone need: reading
flash-attn's layout in place as a packed batch of equal lengths (``_FlashLayout``), the
packed batch's autograd node, and the repeated decoding calls.
"""

import numpy as np
import torch

from . import api
from . import kvcache as api_kvcache
from . import decode_direct
from . import varlen as api_varlen
from .dropout import check_dropout_p
from .kernels import backward as backward_kernels
from .kernels import forward as forward_kernels
from .validate import check_attention_inputs
from .torch import (_FAST, _FAST_MAX, _TORCH_DTYPES, _FastForward, _array, _check_tensors,
                    _compact, _compiling, _current_device, _outputs_from, _refuse_capture,
                    _tensor, _torch_seed, _torch_stream, _widened, attention, launcher)


# --- PyTorch's scaled_dot_product_attention -------------------------------------------------

def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False):
    """A drop-in for ``torch.nn.functional.scaled_dot_product_attention``, with its
    semantics: ``softmax(query @ key^T * scale + bias) @ value``.

    - ``is_causal=True`` is PyTorch's top-left aligned causal mask (query i sees keys
      j <= i, also when Sq != Sk); numbaflash's ``causal="top_left"``.
    - ``attn_mask``: boolean (True: the key takes part) or float (added to the scores),
      broadcastable to (..., Sq, Sk) as in PyTorch; a mask broadcast with ``expand`` is not
      materialised. Not together with is_causal (PyTorch raises too). No gradient flows
      to a float attn_mask (its ``.grad`` stays None), unlike PyTorch.
    - ``scale``: default 1/sqrt(E).
    - ``enable_gqa=True``: key and value may have fewer heads than query (a divisor of
      them); query head h uses key/value head h // (Hq // Hkv), as in PyTorch. Without
      it, differing head counts raise RuntimeError, as in PyTorch, except a single
      key/value head, which PyTorch broadcasts (and numbaflash runs as MQA).

    Args:
        query: (N, ..., Hq, L, E) tensor, float16, bfloat16, float32 or float64 (rank 2
            to 4 as given; higher ranks have their leading dims flattened into one batch
            dim).
        key, value: (N, ..., Hkv, S, E) with query's leading dims and dtype; value's
            head dim must equal E (PyTorch allows another Ev; numbaflash does not yet).
        attn_mask, dropout_p, is_causal, scale, enable_gqa: as in PyTorch. Dropout keeps
            PyTorch's semantics (each probability dropped with chance dropout_p, the rest
            scaled by 1 / (1 - p)) with numbaflash's mask: the seed is drawn from PyTorch's
            default generator (``torch.manual_seed`` reproduces it), but the masks are not
            PyTorch's bits.

    Returns:
        (N, ..., Hq, L, E) tensor on query's device, query's dtype. Query rows that see
        no key give 0 (as PyTorch's math backend does), never NaN.

    Raises:
        RuntimeError: differing head counts without enable_gqa; attn_mask with is_causal.
        ValueError, TypeError: what numbaflash does not support (value head dim != E,
            batch dims that only broadcast, a mask that does not broadcast, ...),
            and what ``attention`` raises; all before anything is launched.
    """
    if is_causal and attn_mask is not None:
        raise RuntimeError("scaled_dot_product_attention: an explicit attn_mask must not be "
                           "given with is_causal=True (PyTorch raises too)")
    _check_tensors(q=query, k=key, v=value, attn_mask=attn_mask)
    for name, x in (("query", query), ("key", key), ("value", value)):
        if x.dim() < 2:
            raise ValueError(f"{name} must have at least 2 dims (..., seqlen, head_dim); got "
                             f"shape {tuple(x.shape)}")
    if not query.dim() == key.dim() == value.dim():
        raise ValueError(f"query, key, value must have the same number of dims; got shapes "
                         f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
    if value.shape[-1] != query.shape[-1]:
        raise ValueError(f"value's head dim {value.shape[-1]} differs from query's "
                         f"{query.shape[-1]}: numbaflash needs Ev = E (PyTorch allows "
                         f"another Ev)")
    if query.dim() >= 3:
        Hq, Hkv = query.shape[-3], key.shape[-3]
        if Hq == 1 and Hkv > 1:
            raise ValueError(f"query has 1 head and key/value {Hkv}: PyTorch broadcasts the "
                             f"query head, numbaflash does not; expand query to {Hkv} heads")
        if Hq != Hkv and not enable_gqa and Hkv != 1:
            raise RuntimeError(
                f"query has {Hq} heads and key/value {Hkv}: pass enable_gqa=True for "
                f"grouped-query attention (PyTorch's scaled_dot_product_attention raises "
                f"here too)")
        if Hq != Hkv and Hq % Hkv:
            raise RuntimeError(f"enable_gqa needs query's heads ({Hq}) to be a multiple of "
                               f"key's and value's ({Hkv})")
        if query.shape[:-3] != key.shape[:-3] or key.shape[:-3] != value.shape[:-3]:
            raise ValueError(
                f"query, key and value must have the same batch dims (numbaflash does not "
                f"broadcast them); got shapes {tuple(query.shape)}, {tuple(key.shape)}, "
                f"{tuple(value.shape)}: expand them first")
    lead = tuple(query.shape[:-2])
    if query.dim() > 4:
        # (N, ..., H, L, E) -> (N * ..., H, L, E): the kernels take at most one batch dim.
        # A mask then must not vary over the flattened dims.
        if attn_mask is not None:
            while attn_mask.dim() > 3 and attn_mask.shape[0] == 1:
                attn_mask = attn_mask[0]
            if attn_mask.dim() > 3:
                raise ValueError(
                    f"with {query.dim()}-dim inputs, numbaflash takes an attn_mask that "
                    f"varies at most over (heads, L, S); got shape {tuple(attn_mask.shape)}")
        query, key, value = (x.reshape((-1,) + tuple(x.shape[-3:]))
                             for x in (query, key, value))
    out = attention(query, key, value, causal="top_left" if is_causal else False,
                    scale=scale, attn_mask=attn_mask, dropout_p=dropout_p)
    return out.reshape(lead + tuple(out.shape[-2:]))


# --- flash-attn's flash_attn_func -------------------------------------------------------------

def _check_flash_layout(function, **tensors):
    """ValueError unless every given tensor has 4 dims, flash-attn's (batch, seqlen, heads,
    head_dim)."""
    for name, x in tensors.items():
        if x is not None and x.dim() != 4:
            raise ValueError(f"{function} takes {name} as (batch, seqlen, heads, head_dim); "
                             f"got shape {tuple(x.shape)}")


def _flash_window(window_size):
    """flash-attn's window_size as (left, right) with -1 for an unbounded side; ValueError
    if it is not a pair of ints."""
    try:
        left, right = window_size
        return (-1 if left < 0 else int(left), -1 if right < 0 else int(right))
    except (TypeError, ValueError):
        raise ValueError(f"window_size must be a pair of ints (left, right); got "
                         f"{window_size!r}") from None


_FLASH = {}                 # _flash_key -> _FlashLayout
_FLASH_MAX = 256
# flash_attn_func with gradients: in place (the packed backward reading the arrays as
# they are) or through (batch, heads, seqlen, d) copies, by which was measured faster at
# (2, 4096, 16, d) on an H100: float32 without the causal mask in place (d = 64 and 128,
# lab/runs/2026-12-06/140_layout_*_grad.txt), float32 causal through the copies;
# float16 in place, causal or not, since the backward queues its kernels before it waits
# for the finite check (d = 64, lab/runs/2026-12-07/159_layout_f16_d64_*.txt: queued
# 1.019x and 1.003x the (b, h, s, d) call against the copies' 1.051x and 1.080x).
# bfloat16 computes on float16's kernels and follows float16. The kinds that run in
# place, as (dtype name, causal):
_FLASH_GRAD_IN_PLACE = {("float32", False), ("float16", False), ("float16", True),
                        ("bfloat16", False), ("bfloat16", True)}


def _flash_grad_in_place(dtype, causal):
    """Whether flash_attn_func with gradients runs in place for inputs of NumPy ``dtype``
    (_FLASH_GRAD_IN_PLACE)."""
    return (np.dtype(dtype).name, bool(causal)) in _FLASH_GRAD_IN_PLACE


class _FlashLayout:
    """How flash_attn_func runs one kind of call (shapes, dtype, device, options): in
    place, or through (batch, heads, seqlen, d) copies.

    In place, q, k and v are seen as a packed batch of equal lengths, (batch * seqlen,
    heads, d) views of the same memory (numbaflash.attention_varlen with cu_seqlens 0, S,
    2S, ...), and out is written in flash-attn's layout directly. That is taken where
    the packed forward's kernel reads the packed arrays as they are (its module's
    ``PACKED_ROWS``: forward v8, v9, v10) and the tensors are C-contiguous; with
    gradients, only for the kinds ``_FLASH_GRAD_IN_PLACE`` names. Every other kind of call
    takes the copies. The cu_seqlens stay on the host (CPU tensors: checking them costs
    no wait for the GPU), and the kernels' copy of them is made once
    (varlen.device_seqs)."""

    def __init__(self, q, k, v, variants):
        check_attention_inputs(*(x.transpose(1, 2) for x in (q, k, v)), **variants)
        B, Sq, Sk = q.shape[0], q.shape[1], k.shape[1]
        self.cu_q = torch.arange(B + 1, dtype=torch.int32) * Sq      # 0, Sq, 2 Sq, ...
        self.cu_k = torch.arange(B + 1, dtype=torch.int32) * Sk
        self.options = dict(max_seqlen_q=Sq, max_seqlen_k=Sk, causal=variants["causal"],
                            scale=variants["scale"], window_size=variants["window_size"],
                            softcap=variants["softcap"])
        self.in_place = self.in_place_grad = False
        if q.is_cuda and B > 0 and all(x.is_contiguous() for x in (q, k, v)):
            packed = [_array(x.view(x.shape[0] * x.shape[1], x.shape[2], x.shape[3]))
                      for x in (q, k, v)]
            p, _ = api_varlen.check_varlen_inputs(*packed, self.cu_q.numpy(),
                                                  self.cu_k.numpy(), **self.options)
            plan = api.plan_forward(p)
            self.in_place = getattr(forward_kernels.module(plan.version), "PACKED_ROWS",
                                    False)
            # With gradients, in place only where the packed backward's kernels read the
            # arrays as they are too (PACKED_ROWS) and that was measured faster than
            # the copies (_FLASH_GRAD_IN_PLACE)
            if self.in_place and _flash_grad_in_place(p.dtype, self.options["causal"]):
                backward = backward_kernels.module(api.plan_backward(p)[-1].version)
                self.in_place_grad = getattr(backward, "PACKED_ROWS", False)
        self.fast_key = None


def _flash_key(q, k, v, alibi_slopes, dropout_p, variants):
    """The kind of a flash_attn_func call (``_FlashLayout``); None for calls that always
    take the copies: ALiBi slopes (an array argument) and dropout (a seed drawn per
    call) are not carried into the packed call."""
    if not q.is_cuda or alibi_slopes is not None or dropout_p != 0.0:
        return None
    key = (q.shape, k.shape, v.shape, q.dtype, q.device,
           tuple(x.is_contiguous() for x in (q, k, v)), variants["causal"], variants["scale"],
           variants["window_size"], variants["softcap"])
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _flash_layout(q, k, v, alibi_slopes, dropout_p, variants):
    """The _FlashLayout of this call's kind, or None (the copies)."""
    key = _flash_key(q, k, v, alibi_slopes, dropout_p, variants)
    if key is None:
        return None
    found = _FLASH.get(key)
    if found is None:
        if len(_FLASH) >= _FLASH_MAX:
            _FLASH.clear()
        found = _FLASH[key] = _FlashLayout(q, k, v, variants)
        found.fast_key = ("flash",) + key
    return found if found.in_place else None


def _flash_in_place(q, k, v, layout, grad):
    """flash_attn_func read in place (``_FlashLayout``): out (batch, Sq, heads, d);
    ``grad``: through the autograd node."""
    fast = None if grad else _FAST.get(layout.fast_key)
    if fast is not None:            # a repeated call: the tensors' pointers are all it needs
        got = fast(q, k, v, None)
        if got is not None:
            return got[0].view(q.shape[0], q.shape[1], q.shape[2], v.shape[3])
    packed = [x.view(x.shape[0] * x.shape[1], x.shape[2], x.shape[3]) for x in (q, k, v)]
    options = dict(layout.options, dropout_p=0.0, dropout_seed=None)
    if grad:        # (a repeated forward launches directly inside the autograd node too)
        out, _ = _VarlenAttention.apply(*packed, layout.cu_q, layout.cu_k, None, options,
                                        layout.fast_key)
    else:
        out, _ = _varlen_forward(*packed, layout.cu_q, layout.cu_k, None, options,
                                 layout.fast_key)
    return out.view(q.shape[0], q.shape[1], q.shape[2], v.shape[3])


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                    deterministic=False, return_attn_probs=False):
    """A drop-in for flash-attn's ``flash_attn_func``: its (batch, seqlen, heads, d) layout,
    signature and semantics.

    - ``causal=True`` is bottom-right aligned (flash-attn's convention: the last query sees
      every key; with Sq > Sk the first Sq - Sk rows see none and give 0).
    - ``window_size=(left, right)``: query i sees keys j with
      i + Sk - Sq - left <= j <= i + Sk - Sq + right; a negative side is unbounded;
      with causal, right is 0.
    - ``softcap``: 0.0 is off; c > 0 replaces each scaled score s by c * tanh(s / c).
    - ``alibi_slopes``: (heads,) or (batch, heads); adds -slope * |i + Sk - Sq - j|.
      No gradient flows to it.
    - GQA/MQA: k, v with fewer heads than q (a divisor): query head h uses K/V head
      h // (Hq // Hkv).
    - ``deterministic`` is accepted and has no effect: the backward here is always the
      deterministic default (no atomics). flash-attn's default, False, would otherwise
      pick backward v8, whose atomic dQ is opt-in; it is reached through
      ``numbaflash.attention_backward(..., deterministic=False)``.

    **Layout**: on CUDA tensors without gradients, C-contiguous q, k, v are read in
    place where the GPU's default forward for the call reads packed batches as they are
    (float32 on forward v8 / v9, float16 and bfloat16 plain attention on forward v10;
    without ALiBi or dropout): they are seen as a packed batch of equal lengths, (batch
    * seqlen, heads, d) views of the same memory, and out is written in this layout.
    With gradients the same, and the packed backward writes the gradients in this
    layout, except for float32 with the causal mask (``_FLASH_GRAD_IN_PLACE``: where the
    copies were measured faster). Those calls, and everything else, are copied to
    (batch, heads, seqlen, d) (``transpose(1, 2).contiguous()``), ``attention`` runs on
    the copies, and out comes back transposed the same way; autograd carries the
    gradients through the transposes. docs/pytorch.md has the measured cost of each
    way.

    Args:
        q: (batch, Sq, Hq, d); k, v: (batch, Sk, Hkv, d). float16, bfloat16, float32 or
            float64.
        dropout_p: the dropout probability (flash-attn's semantics; the seed is drawn from
            PyTorch's default generator, the mask is numbaflash's: numbaflash.dropout_mask).
        softmax_scale: default 1/sqrt(d).
        return_attn_probs: must be False (not implemented).

    Returns:
        out: (batch, Sq, Hq, d), q's dtype and device.

    Raises:
        NotImplementedError: return_attn_probs=True.
        ValueError, TypeError: inputs that are not 4-dim, and what ``attention`` raises;
            all before anything is launched.
    """
    if return_attn_probs:
        raise NotImplementedError(
            "return_attn_probs=True is not implemented: numbaflash.torch.flash_attn_func "
            "returns out only (numbaflash.attention(..., return_lse=True) gives the "
            "logsumexp)")
    _check_tensors(q=q, k=k, v=v, alibi_slopes=alibi_slopes)
    _check_flash_layout("flash_attn_func", q=q, k=k, v=v)
    alibi_slopes = _widened(alibi_slopes)
    window = _flash_window(window_size)
    variants = dict(causal=bool(causal), scale=softmax_scale,
                    window_size=None if window == (-1, -1) else window,
                    softcap=None if softcap == 0.0 else softcap, alibi_slopes=alibi_slopes)
    check_dropout_p(dropout_p)                  # a bad p fails here, before any copy
    compiling = _compiling()
    if not compiling:
        layout = _flash_layout(q, k, v, alibi_slopes, dropout_p, variants)
        _refuse_capture(q.device)
        grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
        if layout is not None and (layout.in_place_grad or not grad):
            return _flash_in_place(q, k, v, layout, grad)   # validated when first seen
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))        # (batch, heads, seqlen, d) views
    if not compiling:
        # Validate before anything is copied or launched (under torch.compile the custom
        # op validates when it runs).
        check_attention_inputs(qt, kt, vt, **variants)
    # Transposed copies (the docstring's Layout says why not the strided kernels).
    out = attention(qt.contiguous(), kt.contiguous(), vt.contiguous(),
                    dropout_p=dropout_p, **variants)
    return out.transpose(1, 2).contiguous()                     # (batch, Sq, Hq, d)


class _VarlenAttention(torch.autograd.Function):
    """out = attention_varlen(q, k, v, ...); forward and backward by numbaflash's kernels.

    ``forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, options, fast_key)``
    takes C-contiguous packed q, k, v and returns (out, lse), lse not differentiable;
    ``options`` are the keyword arguments attention_varlen and its backward share;
    ``fast_key`` as _varlen_forward's (flash_attn_func in place; None otherwise)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, options,
                fast_key=None):
        out, lse = _varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, options,
                                   fast_key)
        ctx.mark_non_differentiable(lse)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes)
        ctx.options = options
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, cu_q, cu_k, alibi_slopes = ctx.saved_tensors
        with _outputs_from(q.device):
            dq, dk, dv = api_varlen.attention_varlen_backward(
                _array(dout.contiguous()), _array(q), _array(k), _array(v), _array(out),
                _array(lse), _array(cu_q), _array(cu_k), alibi_slopes=_array(alibi_slopes),
                **ctx.options)
        return (_tensor(dq, q.device), _tensor(dk, q.device), _tensor(dv, q.device),
                None, None, None, None, None)


def _varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, options,
                    fast_key=None):
    """numbaflash.attention_varlen(..., return_lse=True) on tensors: (out, lse) tensors.
    With ``fast_key`` (flash_attn_func in place), a repeated call launches directly
    (``_FastForward``)."""
    fast = _FAST.get(fast_key) if fast_key is not None else None
    if fast is not None:
        got = fast(q, k, v, None)
        if got is not None:
            return got
    with _outputs_from(q.device):
        out, lse = api_varlen.attention_varlen(
            _array(q), _array(k), _array(v), _array(cu_seqlens_q), _array(cu_seqlens_k),
            return_lse=True, alibi_slopes=_array(alibi_slopes), **options)
    if fast_key is not None and fast is None:
        _remember_packed(fast_key, q, k, v, cu_seqlens_q, cu_seqlens_k, options)
    return _tensor(out, q.device), _tensor(lse, q.device)


def _remember_packed(key, q, k, v, cu_seqlens_q, cu_seqlens_k, options):
    """After a whole-path packed call of equal lengths on CUDA tensors (flash_attn_func in
    place): keep what repeating it directly needs, if its kernel was launched directly."""
    p, seqs = api_varlen.check_varlen_inputs(_array(q), _array(k), _array(v),
                                             _array(cu_seqlens_q), _array(cu_seqlens_k),
                                             **{n: options[n] for n in (
                                                 "max_seqlen_q", "max_seqlen_k", "causal",
                                                 "scale", "window_size", "softcap")})
    plan = api.plan_forward(p)
    module = forward_kernels.module(plan.version)
    if not getattr(module, "PACKED_ROWS", False):
        return
    nbytes = plan.shared_bytes if plan.dynamic_shared else 0
    direct = launcher._DIRECT.get((module.kernel(plan, p),
                                   (p.dtype, p.acc_dtype, "packed rows"),
                                   plan.grid, plan.block, nbytes))
    if direct is None or direct.makers is None or q.device.index not in direct.functions:
        return
    device_seqs = api_varlen.device_seqs(seqs, None)    # equal lengths: the call's own
    if len(_FAST) >= _FAST_MAX:
        _FAST.clear()
    _FAST[key] = _FastForward(p, plan, direct, q.device.index,
                              packed=(q.shape[0], k.shape[0], device_seqs))


@torch.compiler.disable
def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False,
                           window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """A drop-in for flash-attn's ``flash_attn_varlen_func``: packed batches of sequences
    of different lengths (numbaflash.attention_varlen), differentiable through
    torch.autograd with respect to q, k and v.

    Semantics as ``flash_attn_func`` (bottom-right causal, window_size, softcap, ALiBi,
    GQA, ``deterministic`` without effect) within each sequence.

    Args:
        q: (total_q, Hq, d); k, v: (total_k, Hkv, d). float16, bfloat16, float32 or
            float64.
            Non-contiguous tensors are copied first.
        cu_seqlens_q, cu_seqlens_k: (batch + 1,) int32 tensors on q's device: 0, then
            non-decreasing, ending at total_q (total_k). On a GPU they are copied to the
            host to be checked (the call waits for them).
        max_seqlen_q, max_seqlen_k: the longest sequences (ints; larger is allowed).
        dropout_p: as flash_attn_func (seed from PyTorch's default generator).
        block_table: must be None (paged K/V is not implemented).
        return_attn_probs: must be False (not implemented).

    Returns:
        out: (total_q, Hq, d), q's dtype and device.

    torch.compile: runs eagerly (one graph break).

    Raises:
        NotImplementedError: block_table or return_attn_probs=True.
        ValueError, TypeError: what ``numbaflash.attention_varlen`` raises, before anything
            is launched.
    """
    if block_table is not None:
        raise NotImplementedError("block_table (paged K/V) is not implemented: pass packed "
                                  "k and v")
    if return_attn_probs:
        raise NotImplementedError("return_attn_probs=True is not implemented: "
                                  "numbaflash.attention_varlen(..., return_lse=True) gives "
                                  "the logsumexp")
    _check_tensors(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                   alibi_slopes=alibi_slopes)
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu.dtype != torch.int32:
            raise TypeError(f"{name} must be an int32 tensor; got {cu.dtype}")
    alibi_slopes = _widened(alibi_slopes)
    _refuse_capture(q.device)
    window = _flash_window(window_size)
    seed = None
    if dropout_p != 0.0:
        check_dropout_p(dropout_p)
        seed = _torch_seed()
    options = dict(max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, causal=bool(causal),
                   scale=softmax_scale, window_size=None if window == (-1, -1) else window,
                   softcap=None if softcap == 0.0 else softcap, dropout_p=dropout_p,
                   dropout_seed=seed)
    if not all(x.is_contiguous() for x in (q, k, v)):
        # a copy comes next (on a GPU, a launch): validate first
        api_varlen.check_varlen_inputs(
            _array(q), _array(k), _array(v), _array(cu_seqlens_q), _array(cu_seqlens_k),
            max_seqlen_q, max_seqlen_k, options["causal"], softmax_scale,
            window_size=options["window_size"], softcap=options["softcap"],
            alibi_slopes=_array(alibi_slopes), dropout_p=dropout_p, dropout_seed=seed)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    slopes = _compact(alibi_slopes)
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
        out, _ = _VarlenAttention.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, slopes, options)
    else:
        out, _ = _varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, slopes, options)
    return out


def _decode_key(views, cache_seqlens, options):
    """The kind of a ``flash_attn_with_kvcache`` call on CUDA tensors (numbaflash/
    decode_direct.py), from its (batch, heads, seqlen, d) views; None for a call that is
    never repeated directly."""
    q, k = views[0], views[3]
    if options["alibi_slopes"] is not None or not q.is_cuda:
        return None
    if isinstance(cache_seqlens, torch.Tensor):
        lengths = (cache_seqlens.shape, cache_seqlens.stride(), cache_seqlens.dtype)
    else:
        lengths = decode_direct.int_lengths_key(cache_seqlens, 0 if k is None else k.shape[2])
        if lengths is None:
            return None
    try:
        key = ("torch", q.device, q.dtype,
               tuple(None if x is None else (x.shape, x.stride(), x.data_ptr() % 16)
                     for x in views),
               lengths, tuple(sorted(options.items())))
        hash(key)
    except TypeError:
        return None
    return key


def _repeat_decode(fast, views, cache_seqlens):
    """(out, lse) tensors, (batch, Hq, Sq, d) and (batch, Hq, Sq), of a call of a kind
    ``fast`` (a decode_direct.FastDecode) launched directly; None (nothing launched) if
    it must take the whole path: another device, or an int length out of range."""
    q, k_cache, v_cache, k, v = views
    device = q.device
    if _current_device() != device.index or not fast.ready(device.index):
        return None
    if isinstance(cache_seqlens, torch.Tensor):
        seqlens = cache_seqlens
    else:
        B, S_max = k_cache.shape[0], k_cache.shape[2]
        if not 0 <= cache_seqlens <= S_max - (0 if k is None else k.shape[2]):
            return None
        seqlens = torch.full((B,), cache_seqlens, dtype=torch.int32, device=device)
    pointers = {"q": q.data_ptr(), "k_cache": k_cache.data_ptr(),
                "v_cache": v_cache.data_ptr(), "seqlens": seqlens.data_ptr()}
    if k is not None:
        pointers["k"], pointers["v"] = k.data_ptr(), v.data_ptr()

    def allocate(role, shape, dtype):
        dtype = q.dtype if role == "out" else _TORCH_DTYPES[np.dtype(dtype)]
        t = torch.empty(shape, dtype=dtype, device=device)
        return t, t.data_ptr()
    made = fast.launch(pointers, allocate, _torch_stream(device))
    B, Hq, Sq, d = q.shape
    return made["out"].view(B, Hq, Sq, d), made["lse"].view(B, Hq, Sq)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None,
                            rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                            cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False):
    """A drop-in for flash-attn's ``flash_attn_with_kvcache``: decoding against a KV cache,
    with its (batch, seqlen, heads, d) layout, signature and semantics
    (numbaflash.attention_with_kvcache underneath; docs/kvcache.md).

    - k, v (batch, S_new, Hk, d), if given, are written into k_cache and v_cache in place
      at rows cache_seqlens[b], ...; then q attends to the first cache_seqlens[b] + S_new
      keys of batch b. ``cache_seqlens`` itself is not changed (the caller advances it).
    - The caches (batch, S_max, Hk, d) are read and written where they are: no copy, on
      CUDA tensors through their transposed views (the head dim must be contiguous).
    - ``causal``, ``window_size``, ``softcap``, ``alibi_slopes``: as in flash_attn_func,
      bottom-right within each sequence's length.
    - ``num_splits``: 0 lets numbaflash choose the split-KV count (explain_kvcache says
      why), 1 turns splitting off, n > 1 forces n.
    - No autograd: this is the inference path, as in flash-attn.
    - A call on CUDA tensors that repeats an earlier one (the same shapes, strides, dtype
      and options, cache_seqlens of the same kind) launches the kernels that call
      compiled directly, and can be captured in a CUDA graph
      (numbaflash/decode_direct.py; docs/pytorch.md, "CUDA graphs").

    Args:
        q: (batch, Sq, Hq, d); k_cache, v_cache: (batch, S_max, Hk, d), Hk dividing Hq.
            float16, bfloat16, float32 or float64 (bfloat16 caches are read and written
            in place through their int16 view, as every bfloat16 tensor here).
        cache_seqlens: an int or a (batch,) int32 tensor; None means every cache is full
            (S_max keys, no new k and v).
        rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad, block_table: must be None
            (not implemented; rotary_interleaved is then unused).

    Returns:
        out (batch, Sq, Hq, d), q's dtype and device; with ``return_softmax_lse``,
        ``(out, lse)`` with lse (batch, Hq, Sq) in float32.

    Raises:
        NotImplementedError: rotary embeddings, cache_batch_idx, cache_leftpad or a paged
            cache (block_table).
        ValueError, TypeError: as numbaflash.attention_with_kvcache; before anything is
            written or launched.
        RuntimeError: inside CUDA graph capture, a call that does not repeat one made
            outside it.
    """
    for name, x in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin),
                    ("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad),
                    ("block_table", block_table)):
        if x is not None:
            raise NotImplementedError(f"flash_attn_with_kvcache: {name} is not implemented "
                                      f"in numbaflash; pass None")
    _check_tensors(q=q, k=k_cache, v=v_cache, k_new=k, v_new=v, alibi_slopes=alibi_slopes)
    _check_flash_layout("flash_attn_with_kvcache", q=q, k_cache=k_cache, v_cache=v_cache,
                        k=k, v=v)
    alibi_slopes = _widened(alibi_slopes)
    window = _flash_window(window_size)
    if cache_seqlens is None:
        if k is not None:
            raise ValueError("flash_attn_with_kvcache: new k and v need cache_seqlens (where "
                             "to write them)")
        cache_seqlens = k_cache.shape[1]
    elif isinstance(cache_seqlens, torch.Tensor):
        if cache_seqlens.device != q.device:
            raise ValueError(f"cache_seqlens is on {cache_seqlens.device} but q is on "
                             f"{q.device}")
    # (batch, heads, seqlen, d) views, as numbaflash.attention_with_kvcache takes them
    views = [None if x is None else x.transpose(1, 2) for x in (q, k_cache, v_cache, k, v)]
    options = dict(causal=bool(causal), scale=softmax_scale,
                   window_size=None if window == (-1, -1) else window,
                   softcap=None if softcap == 0.0 else softcap,
                   alibi_slopes=_compact(alibi_slopes),
                   num_splits=None if num_splits == 0 else num_splits)
    key = _decode_key(views, cache_seqlens, options)
    fast = decode_direct.lookup(key)
    got = None if fast is None else _repeat_decode(fast, views, cache_seqlens)
    if got is None:
        if q.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "flash_attn_with_kvcache: inside CUDA graph capture numbaflash can only "
                "repeat a decoding call it has already run outside the capture (a "
                "warm-up call with the same shapes, strides, dtype, options and kind of "
                "cache_seqlens, int or tensor; calls with alibi_slopes are never "
                "captured): this one is new, and its first run compiles, checks and "
                "allocates in ways a capture forbids")
        if isinstance(cache_seqlens, torch.Tensor):
            cache_seqlens = _array(cache_seqlens)
        options["alibi_slopes"] = _array(options["alibi_slopes"])
        with _outputs_from(q.device), api_kvcache.recording() as launched:
            out, lse = api_kvcache.attention_with_kvcache(
                *(_array(x) for x in views[:3]), cache_seqlens=cache_seqlens,
                k=_array(views[3]), v=_array(views[4]), return_lse=True, **options)
        out, lse = _tensor(out, q.device), _tensor(lse, q.device)
        if key is not None:
            decode_direct.remember(key, launched, q.device.index)
    else:
        out, lse = got
    if not return_softmax_lse:
        return out.transpose(1, 2)
    return out.transpose(1, 2), lse
