"""Packed batches of sequences of different lengths: ``attention_varlen``,
``attention_varlen_backward``, ``explain_varlen`` and ``explain_varlen_backward``.

A batch of sequences of different lengths, padded to the longest, spends memory and
work on the padding. Packed, the sequences lie back to back (flash-attention's varlen
layout): q is (total_q, Hq, d) and sequence b is rows cu_seqlens_q[b]:cu_seqlens_q[b + 1]
of it, k and v (total_k, Hkv, d) likewise with cu_seqlens_k. Sequence b is exactly
``attention()`` of its own rows; lse is (Hq, total_q).

The kernels are the ones ``attention()`` runs, compiled with ``Variant.varlen``: the grid
is the padded one (sized for the longest sequence), and each block finds its sequence in
cu_seqlens, cuts the arrays to that sequence's rows and returns at once if its tile lies
past them (numbaflash/kernels/sequences.py). Nothing is padded in memory, and a short
sequence's blocks past its end cost a launch slot and nothing else.
"""

import math
from dataclasses import replace

import numpy as np
from numba import cuda

from . import arrays, dtypes
from .api import _variant_arrays
from .kernels import backward, forward, simulating
from .kernels.backward import preprocess
from .kernels.plan import Plans
from .launcher import device_id, launch_backward, launch_forward
from .masks import parse_causal
from .policy import plan_backward, plan_forward, start_finite_check
from .streams import call_stream
from .validate import (_shape_dtype, backward_memory, check_attention_inputs, check_memory,
                       forward_memory, warn_if_slow)


class _Shape:
    """A shape-and-dtype stand-in: how the packed call reuses attention()'s checks."""

    def __init__(self, shape, dtype):
        self.shape, self.dtype = tuple(shape), dtype


def _packed(x, name, what="(total, heads, d)"):
    shape, dtype = _shape_dtype(x, name)
    if len(shape) != 3:
        raise ValueError(f"{name} must be a packed batch {what}; got shape {shape}")
    return shape, dtype


def _cu_seqlens(cu, name, total):
    """cu_seqlens checked, as a host int64 array: 1D integers, starting at 0,
    non-decreasing, ending at ``total`` (the packed arrays' rows). A device array is
    copied to the host for the check (B + 1 integers; the call waits for it)."""
    if cu is None:
        raise ValueError(f"{name} is required: a (batch + 1,) int32 array of cumulative "
                         f"sequence lengths")
    shape, dtype = _shape_dtype(cu, name)
    if dtype.kind not in "iu":
        raise TypeError(f"{name} must be an integer array (int32); got {dtype}")
    if len(shape) != 1 or shape[0] < 1:
        raise ValueError(f"{name} must be a (batch + 1,) array; got shape {shape}")
    if arrays.is_device_array(cu):
        if dtype != np.int32:
            raise TypeError(f"{name} on the device must be int32 (the kernels read it as "
                            f"is); got {dtype}")
        dev = cu if hasattr(cu, "copy_to_host") else cuda.as_cuda_array(cu)
        host = dev.copy_to_host()
    else:
        host = np.asarray(cu)
    host = host.astype(np.int64)
    if host[0] != 0:
        raise ValueError(f"{name} must start at 0; got {host[0]}")
    steps = np.diff(host)
    if steps.size and steps.min() < 0:
        b = int(np.argmin(steps))
        raise ValueError(f"{name} must be non-decreasing (sequence lengths >= 0); sequence "
                         f"{b} has length {int(steps[b])}")
    if host[-1] != total:
        raise ValueError(f"{name} must end at the packed rows' count {total}; got {host[-1]}")
    if total > np.iinfo(np.int32).max:
        raise ValueError(f"{name}: {total} packed rows exceed int32, the kernels' index")
    return host


def _max_seqlen(given, lengths, name):
    """The longest sequence, or ``given`` if it is at least that (ValueError if less): the
    grid is sized by it. A value past the packed rows' total is cut to the total (no
    sequence is longer; the grid stays within CUDA's limits)."""
    longest = int(lengths.max()) if lengths.size else 0
    if given is None:
        return longest
    if isinstance(given, bool) or not isinstance(given, (int, np.integer)):
        raise TypeError(f"{name} must be an int or None; got {type(given).__name__}")
    if given < longest:
        raise ValueError(f"{name} = {given} is less than the longest sequence, {longest}: "
                         f"the grid is sized by it, so rows past it would not be computed")
    return min(int(given), int(lengths.sum()))


def check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None,
                        max_seqlen_k=None, causal=False, scale=None, **variants):
    """Validate a packed call; returns ``(p, seqs)``: the Problem the kernels run (batch B,
    the longest lengths as Sq and Sk, the offsets of a square problem, ``Variant.varlen``)
    and the host (2, B + 1) int32 array (cu_seqlens_q, cu_seqlens_k). ValueError or
    TypeError names what is wrong, before anything is launched."""
    qs, qt = _packed(q, "q")
    ks, kt = _packed(k, "k")
    vs, vt = _packed(v, "v")
    if parse_causal(causal) == "top_left":
        raise ValueError("causal='top_left' is not supported for packed batches: each "
                         "sequence's causal mask is aligned bottom-right within it "
                         "(flash-attention's varlen convention); use causal=True")
    for name in ("attn_mask", "score_mod", "score_mod_grad", "mask_mod"):
        if variants.get(name) is not None:
            raise ValueError(f"{name} is not supported for packed batches (its indices "
                             f"would be the padded batch's); use attention() on a padded "
                             f"batch")
    cu_q = _cu_seqlens(cu_seqlens_q, "cu_seqlens_q", qs[0])
    cu_k = _cu_seqlens(cu_seqlens_k, "cu_seqlens_k", ks[0])
    if cu_q.size != cu_k.size:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length (batch + "
                         f"1); got {cu_q.size} and {cu_k.size}")
    B = cu_q.size - 1
    Sq = _max_seqlen(max_seqlen_q, np.diff(cu_q), "max_seqlen_q")
    Sk = _max_seqlen(max_seqlen_k, np.diff(cu_k), "max_seqlen_k")
    # attention()'s checks on a square stand-in (batch, heads, 1, d): dtypes, heads, head
    # dim, scale, window, softcap, ALiBi, dropout. Its offsets are a square problem's,
    # which each sequence shifts by its Sk - Sq in the kernels.
    p = check_attention_inputs(_Shape((B, qs[1], 1, qs[2]), qt), _Shape((B, ks[1], 1, ks[2]), kt),
                               _Shape((B, vs[1], 1, vs[2]), vt), causal, scale, **variants)
    p = replace(p, Sq=Sq, Sk=Sk, variant=replace(p.variant, varlen=True),
                equal_lengths=_equal_lengths(cu_q, cu_k))
    return p, np.stack([cu_q, cu_k]).astype(np.int32)


def _equal_lengths(cu_q, cu_k):
    """(nq, nk) if every sequence of the batch has nq query rows and nk keys (flash-attn's
    (batch, seqlen, heads, d) layout seen as a packed batch), else None."""
    lengths_q, lengths_k = np.diff(cu_q), np.diff(cu_k)
    if lengths_q.size == 0 or (lengths_q != lengths_q[0]).any() or (
            lengths_k != lengths_k[0]).any():
        return None
    return int(lengths_q[0]), int(lengths_k[0])


_SAME_SEQS = {}          # (cu_seqlens' bytes, device) -> seqs on the device
_SAME_SEQS_MAX = 64


def device_seqs(seqs, stream):
    """The (2, B + 1) int32 host array ``seqs`` on the device, for the kernels. A batch of
    equal lengths gets one copy kept per batch shape and device, made once (a copy from
    host memory waits for the work queued before it): numbaflash.torch's flash_attn_func
    reads its (batch, seqlen, heads, d) tensors as such a batch on every call. Other
    batches are copied on the call's stream."""
    lengths = np.diff(seqs, axis=1)
    same = lengths.size and (lengths == lengths[:, :1]).all()
    if not same or simulating():
        return cuda.to_device(seqs, stream=stream.numba)
    key = (seqs.tobytes(), seqs.shape, device_id())
    found = _SAME_SEQS.get(key)
    if found is None:
        if len(_SAME_SEQS) >= _SAME_SEQS_MAX:
            _SAME_SEQS.clear()
        found = _SAME_SEQS[key] = cuda.to_device(seqs)      # complete before it returns
    return found


def _as_they_are(x):
    return x


def _packed_problem(p, total_q, total_k):
    """``p`` as one batch of total_q query rows and total_k keys: the sizes of the packed
    arrays, for the memory checks."""
    return replace(p, B=1, BH=p.Hq, Sq=total_q, Sk=total_k, lead=(p.Hq,),
                   k_lead=(p.Hq // p.group,))


def _packed_plans(plans, p, total_q):
    """The backward plans with the D kernel's grid over the packed rows: D = rowsum(dO * O)
    is per row, so it runs over all total_q rows of each head at once."""
    threads = preprocess.THREADS
    first = replace(plans[0], grid=(math.ceil(total_q / threads), p.Hq),
                    reason=plans[0].reason + f", over the {total_q} packed rows of each head")
    return Plans((first,) + tuple(plans[1:]))


def explain_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None,
                   max_seqlen_k=None, causal=False, scale=None, version=None, tiles=None,
                   backend=None, **variants):
    """Validate like ``attention_varlen`` and return the forward ``Plan`` it would run
    (the grid is the padded one: (longest sequence / Br, batch * heads))."""
    p, _ = check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                               max_seqlen_k, causal, scale, **variants)
    return plan_forward(p, version, tiles, where=backend)


def explain_varlen_backward(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None,
                            max_seqlen_k=None, causal=False, scale=None, version=None,
                            tiles=None, backend=None, **variants):
    """Validate like ``attention_varlen_backward`` and return the backward's ``Plans`` it
    would run: the D kernel over the packed rows, then the dK/dV and dQ kernels on the
    padded grid. (On a GPU the call also checks that the inputs are finite, as
    ``attention_backward`` does; a plan cannot know that.)"""
    p, _ = check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                               max_seqlen_k, causal, scale, **variants)
    return _packed_plans(plan_backward(p, version, tiles, where=backend), p, q.shape[0])


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None,
                     max_seqlen_k=None, causal=False, scale=None, return_lse=False,
                     window_size=None, softcap=None, alibi_slopes=None, dropout_p=0.0,
                     dropout_seed=None, version=None, tiles=None, stream=None):
    """Attention over a packed batch of sequences of different lengths (flash-attention's
    ``flash_attn_varlen_func`` layout), without padding.

    Sequence b is rows cu_seqlens_q[b]:cu_seqlens_q[b + 1] of q and cu_seqlens_k[b]:
    cu_seqlens_k[b + 1] of k and v, and its result is exactly ``attention()`` of those
    rows with the same options: causal masks, windows and ALiBi distances aligned
    bottom-right within the sequence. Sequences may be empty.

    Args:
        q: (total_q, Hq, d); k, v: (total_k, Hkv, d), Hkv dividing Hq (GQA/MQA). All NumPy
            arrays (result on the host) or all device arrays (C-contiguous), as for
            ``attention``.
        cu_seqlens_q, cu_seqlens_k: (batch + 1,) cumulative lengths: 0, then
            non-decreasing, ending at total_q (total_k). Integers on the host (any integer
            dtype) or int32 on the device; a device array is copied to the host to be
            checked (the call waits for it: pass host arrays to avoid that).
        max_seqlen_q, max_seqlen_k: the longest sequence (None: computed); a larger
            value is allowed (extra blocks return at once; past the packed total it is cut
            to the total), a smaller one is refused.
        causal: False, or True / "bottom_right" ("top_left" is refused: each sequence's
            mask is aligned bottom-right within it).
        scale, return_lse, window_size, softcap, version, tiles, stream: as for
            ``attention``.
        dropout_p, dropout_seed: as for ``attention``; sequence b's mask is the one
            ``attention`` uses for batch index b (rows and keys counted within it).
        alibi_slopes: (Hq,) or (batch, Hq), as for ``attention``.

    Returns:
        out (total_q, Hq, d) in q's dtype, or ``(out, lse)`` with lse (Hq, total_q) in
        float32 (float64 for float64 inputs). Rows that see no key: out 0, lse -inf.

    Raises:
        ValueError, TypeError: bad shapes, dtypes, cu_seqlens, max_seqlen or options
            (attn_mask, score_mod and mask_mod are not supported here), before anything
            is launched.
        MemoryError, RuntimeError: as ``attention``.
    """
    variants = dict(window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                    dropout_p=dropout_p, dropout_seed=dropout_seed)
    p, seqs = check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, causal, scale, **variants)
    plan = plan_forward(p, version, tiles)
    host = not arrays.on_device((q, k, v))
    s = call_stream((q, k, v), stream)
    total_q, total_k = q.shape[0], k.shape[0]
    packed = _packed_problem(p, total_q, total_k)
    check_memory(packed, forward_memory(packed, plan, dict(q=q, k=k, v=v), host),
                 plan.backend, "attention_varlen")
    warn_if_slow(p, (plan,), "attention_varlen")
    out_shape, lse_shape = (total_q, p.Hq, p.d), (p.Hq, total_q)
    lse_dtype = np.dtype(p.acc_dtype)
    if p.B == 0 or p.Hq == 0 or total_q == 0 or total_k == 0:
        # Nothing to launch: no rows, or no keys (every row sees none: out 0, lse -inf).
        out = arrays.filled(out_shape, 0, p.dtype, host, s)
        lse = arrays.filled(lse_shape, -np.inf, lse_dtype, host, s)
        return (out, lse) if return_lse else out

    # bfloat16 on a version that computes in float32: float32 copies (numbaflash/dtypes.py)
    widen = dtypes.widens(p, forward.module(plan.version))
    Q = arrays.as_kernel_array(q, q.shape, "q", s, widen)
    K = arrays.as_kernel_array(k, k.shape, "k", s, widen)
    V = arrays.as_kernel_array(v, v.shape, "v", s, widen)
    O = arrays.device_empty(out_shape, dtypes.kernel_dtype(p.dtype, widen), s)
    L = arrays.device_empty(lse_shape, lse_dtype, s)
    # The kernel's view of the packed arrays: (heads, total, d) views, or the arrays as
    # they are for a kernel that adds each sequence's first row itself (PACKED_ROWS)
    rows = getattr(forward.module(plan.version), "PACKED_ROWS", False)
    first = _as_they_are if rows else arrays.heads_first
    launch_forward(plan, dtypes.kernel_problem(p, widen), first(Q), first(K), first(V),
                   first(O), L, *_variant_arrays(p, s), stream=s,
                   seqs=device_seqs(seqs, s))
    out = arrays.finish(O, out_shape, host, s, p.dtype)
    return (out, arrays.finish(L, lse_shape, host, s)) if return_lse else out


def attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *,
                              max_seqlen_q=None, max_seqlen_k=None, causal=False, scale=None,
                              window_size=None, softcap=None, alibi_slopes=None,
                              dropout_p=0.0, dropout_seed=None, version=None, tiles=None,
                              stream=None):
    """Gradients of ``attention_varlen``: ``(dq, dk, dv)`` packed like q, k, v.

    dout and out are (total_q, Hq, d) in q's dtype, lse (Hq, total_q) as
    ``attention_varlen(..., return_lse=True)`` returned them; the other arguments as given
    to it; ``version``, ``tiles`` and ``stream`` as for ``attention_backward``. The
    default kernels are deterministic (no atomics): repeated calls give the same bits.
    Keys that no row sees get zero dk and dv.

    Raises:
        ValueError, TypeError: as ``attention_varlen``, and for dout, out, lse of the
            wrong shape or dtype, before anything is launched.
    """
    variants = dict(window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                    dropout_p=dropout_p, dropout_seed=dropout_seed)
    p, seqs = check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, causal, scale, **variants)
    total_q, total_k = q.shape[0], k.shape[0]
    for name, x in (("dout", dout), ("out", out)):
        shape, dtype = _shape_dtype(x, name)
        if shape != tuple(q.shape) or dtype != p.dtype:
            raise ValueError(f"{name} must have q's shape {tuple(q.shape)} and dtype "
                             f"{p.dtype}; got {shape}, {dtype}")
    shape, dtype = _shape_dtype(lse, "lse")
    if shape != (p.Hq, total_q) or dtype != np.dtype(p.acc_dtype):
        raise ValueError(f"lse must be (Hq, total_q) = ({p.Hq}, {total_q}) in {p.acc_dtype}, "
                         f"as attention_varlen returns it; got {shape}, {dtype}")
    plans = _packed_plans(plan_backward(p, version, tiles), p, total_q)
    host = not arrays.on_device((dout, q, k, v, out, lse))
    s = call_stream((dout, q, k, v, out, lse), stream)
    packed = _packed_problem(p, total_q, total_k)
    check_memory(packed, backward_memory(packed, plans, dict(dout=dout, q=q, k=k, v=v, out=out,
                                                             lse=lse), host),
                 plans[0].backend, "attention_varlen_backward")
    warn_if_slow(p, plans, "attention_varlen_backward")
    q_shape, k_shape = (total_q, p.Hq, p.d), (total_k, p.Hq // p.group, p.d)
    if p.B == 0 or p.Hq == 0 or total_q == 0 or total_k == 0:
        # Nothing to launch: no (query, key) pair is visible, so every gradient is 0.
        return tuple(arrays.filled(shape, 0, p.dtype, host, s)
                     for shape in (q_shape, k_shape, k_shape))

    # bfloat16 on a version that computes in float32: float32 copies (numbaflash/dtypes.py)
    widen = dtypes.widens(p, backward.module(plans[-1].version))
    kp = dtypes.kernel_problem(p, widen)
    Q = arrays.as_kernel_array(q, q_shape, "q", s, widen)
    K = arrays.as_kernel_array(k, k_shape, "k", s, widen)
    V = arrays.as_kernel_array(v, k_shape, "v", s, widen)
    O = arrays.as_kernel_array(out, q_shape, "out", s, widen)
    dO = arrays.as_kernel_array(dout, q_shape, "dout", s, widen)
    L = arrays.as_kernel_array(lse, (p.Hq, total_q), "lse", s)
    D = arrays.device_empty((p.Hq, total_q), np.dtype(p.acc_dtype), s)  # rowsum(dO * O)
    grad = dtypes.kernel_dtype(p.dtype, widen)
    if plans[-1].version == "v2":
        dQ = arrays.filled(q_shape, 0, grad, False, s)         # v2 adds into dQ (atomics)
    else:
        dQ = arrays.device_empty(q_shape, grad, s)
    dK = arrays.device_empty(k_shape, grad, s)
    dV = arrays.device_empty(k_shape, grad, s)
    # v5 to v10 (tensor cores) need finite inputs: checked on the packed arrays, as in
    # attention_backward (the default's kernels queued before the wait)
    pending = start_finite_check(plans, kp, Q, K, V, O, dO, L, s)
    if pending is not None and version is not None:
        plans, pending = pending.plans(asked=True), None
    dseqs = device_seqs(seqs, s)

    def launch(plans):
        # the arrays as they are for kernels that add each sequence's first row
        # themselves (PACKED_ROWS; the launcher gives the D kernel its views), else
        # (heads, total, d) views
        rows = getattr(backward.module(plans[-1].version), "PACKED_ROWS", False)
        first = _as_they_are if rows else arrays.heads_first
        launch_backward(plans, kp, first(Q), first(K), first(V), first(O), first(dO), L, D,
                        first(dQ), first(dK), first(dV), *_variant_arrays(p, s), stream=s,
                        seqs=dseqs)

    launch(plans)
    checked = plans if pending is None else pending.plans(asked=False)
    if checked is not plans:
        launch(_packed_plans(checked, p, total_q))
    return (arrays.finish(dQ, q_shape, host, s, p.dtype),
            arrays.finish(dK, k_shape, host, s, p.dtype),
            arrays.finish(dV, k_shape, host, s, p.dtype))
