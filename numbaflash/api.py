"""The public entry points: ``attention``, ``attention_backward``, ``attention_vjp``,
``explain`` and ``explain_backward``."""

import numpy as np

from . import arrays, dtypes
from .kernels import backward, forward
from .streams import DEFAULT, call_stream, wait_for
from .launcher import launch_backward, launch_forward
from .policy import backend, plan_backward, plan_forward, start_finite_check
from .validate import (backward_memory, check_attention_inputs, check_backward_inputs,
                       check_memory, forward_memory, warn_if_slow)


def _variants(window_size, alibi_slopes, softcap, attn_mask, score_mod, score_mod_grad,
              mask_mod, dropout_p=0.0, dropout_seed=None):
    return dict(window_size=window_size, alibi_slopes=alibi_slopes, softcap=softcap,
                attn_mask=attn_mask, score_mod=score_mod, score_mod_grad=score_mod_grad,
                mask_mod=mask_mod, dropout_p=dropout_p, dropout_seed=dropout_seed)


def _variant_arrays(p, stream=DEFAULT):
    """The Problem's ALiBi slopes and attn_mask as kernel (device) arrays, or None, ready
    for work on ``stream`` (a streams.CallStream)."""
    out = []
    for x in (p.alibi_slopes, p.attn_mask):
        if x is None:
            out.append(None)
        elif not arrays.is_device_array(x):
            out.append(arrays.cuda.to_device(np.ascontiguousarray(x), stream=stream.numba))
        else:
            wait_for(x, stream)
            out.append(x if hasattr(x, "copy_to_host") else arrays.cuda.as_cuda_array(
                x, sync=False))
    return out


_PLANS = {}             # call key -> (Problem, Plan): see _forward_problem_and_plan
_PLANS_MAX = 256


def _call_key(q, k, v, causal, scale, variants, version, tiles):
    """What validation and planning depend on, as a hashable tuple; None if the call
    cannot be keyed (array-valued options such as alibi_slopes or attn_mask, inputs
    without shape and dtype, unhashable options)."""
    if variants["alibi_slopes"] is not None or variants["attn_mask"] is not None:
        return None
    try:
        key = (backend(), tuple((type(x), tuple(x.shape), x.dtype) for x in (q, k, v)),
               causal, scale, version, tiles, tuple(sorted(variants.items())))
        hash(key)
    except (AttributeError, TypeError):
        return None
    return key


def _forward_problem_and_plan(q, k, v, causal, scale, variants, version, tiles):
    """``check_attention_inputs`` then ``plan_forward``, remembered per call key.

    Both depend only on shapes, dtypes and options, not on the data, so a repeated call
    (the same shapes, as in a training loop) skips them: at (1, 1, 128, 64) on the H200
    they were a large part of the Python around a small kernel
    (``scripts/overhead.py --profile``; lab/runs/2026-12-01/11_overhead_profile.txt). Calls that raise are not remembered, so bad input
    still gets its error before any launch, every time.
    """
    key = _call_key(q, k, v, causal, scale, variants, version, tiles)
    hit = _PLANS.get(key) if key is not None else None
    if hit is None:
        p = check_attention_inputs(q, k, v, causal, scale, **variants)
        hit = (p, plan_forward(p, version, tiles))
        if key is not None:
            if len(_PLANS) >= _PLANS_MAX:
                _PLANS.clear()
            _PLANS[key] = hit
    return hit


def attention(q, k, v, *, causal=False, scale=None, window_size=None, alibi_slopes=None,
              softcap=None, attn_mask=None, score_mod=None, score_mod_grad=None,
              mask_mod=None, dropout_p=0.0, dropout_seed=None, return_lse=False, version=None,
              tiles=None, stream=None):
    """Exact attention O = softmax(scale * Q K^T [masked, modified]) V, by a FlashAttention
    kernel.

    Variants (docs/variants.md; each is compiled into the kernel, never applied by Python
    per element; forward v1, v2, v5 to v9 and backward v1, v4, v6 take them, so the
    defaults do):
        window_size: (left, right) sliding window, flash-attention's convention: query i
            sees keys j with i + Sk - Sq - left <= j <= i + Sk - Sq + right; -1 means
            unbounded on that side. Combines with ``causal`` (causal=True is (-1, 0)).
        alibi_slopes: (heads,) or (batch, heads) float array, one slope per query head;
            adds -slope * |i + Sk - Sq - j| to the score (flash-attention's convention).
        softcap: a float > 0: the scaled score s becomes softcap * tanh(s / softcap)
            (before ALiBi and attn_mask are added).
        attn_mask: boolean (True: attend) or float (added to the scores) array that
            broadcasts to (batch, heads, Sq, Sk), as in PyTorch SDPA. No gradient flows to
            a float mask.
        score_mod(score, b, h, q_idx, kv_idx) -> score: a Numba device function
            (``numba.cuda.jit(device=True)``) applied last to every visible score.
        score_mod_grad(score, b, h, q_idx, kv_idx): its derivative d score_mod / d score,
            needed by the backward.
        mask_mod(b, h, q_idx, kv_idx) -> bool: a Numba device function; False hides the key.
    Dropout (numbaflash/dropout.py): ``dropout_p`` in [0, 1) drops each probability with
    that chance and scales the rest by 1 / (1 - p), O = (P * keep / (1 - p)) V, as
    flash-attention does; ``dropout_seed``, an int in [0, 2**64), is required with p > 0.
    The mask is a pure function of (seed, batch, query head, row, column), generated in
    the kernels (Philox-4x32-10) and never stored: ``numbaflash.dropout_mask`` returns it,
    and the backward, given the same p and seed, regenerates it. lse is the undropped
    softmax's. p = 0 is plain attention, bit for bit.
    GQA/MQA: k and v may have fewer heads than q (a divisor of q's); query head h reads
    K/V head h // (Hq // Hkv), without copying K or V.

    Args:
        q: (batch, heads, Sq, d), (heads, Sq, d) or (Sq, d).
        k, v: the same batch dim as q, with Sk rows: (..., Sk, d); as many heads as q, or
            a divisor of that (GQA/MQA, above).
            All three NumPy arrays (result on the host) or all device arrays: Numba device
            arrays or any object with ``__cuda_array_interface__`` such as CuPy arrays or
            PyTorch CUDA tensors (result is a Numba device array, no host round trip).
            dtype float16 or bfloat16 (``ml_dtypes.bfloat16``; both computed in float32),
            float32 or float64; head dim 1..256.
        causal: False (no mask), True or "bottom_right" (flash-attention's alignment: the
            last query row sees all keys), or "top_left" (PyTorch's ``is_causal``).
        scale: softmax scale, default 1/sqrt(d). Must be finite.
        return_lse: also return the logsumexp L of each row (the backward pass needs it).
        version: forward kernel version ("v1", "v2", "v3" tensor cores, "v4"
            register-blocked; "v5" v4 with dynamic shared memory for larger tiles, the
            default for plain attention in float32 and float16 with d <= 128 on the
            simulator; "v6" tensor cores with the splits done once; "v7"
            16-bit tensor cores for float16 and bfloat16 inputs, the default on a GPU
            for them; "v8" v6 with the next chunk's scores computed during this chunk's
            softmax (v6's arithmetic reordered), the default on a GPU for float32 with
            d <= 64; "v9" v8 with the next K/V tile copied asynchronously (float32 only),
            the default on a GPU for float32 with 64 < d <= 128; docs/kernels.md); None
            picks the default (see explain).
        tiles: (Br, Bc) for the tiled kernels (v4 and v5 also take (Br, Bc, TM, TN);
            v6, v8 and v9 want multiples of 16, v7 Br a multiple of 16 and Bc of 32); None
            uses the documented rule in the version's file.
        window_size, alibi_slopes, softcap, attn_mask, score_mod, score_mod_grad, mask_mod:
            attention variants (see "Variants" above).
        dropout_p, dropout_seed: dropout (see "Variants" above).
        stream: the CUDA stream to run on: a Numba, PyTorch or CuPy stream, or a CUstream
            handle (int). None: the stream device inputs name in their CUDA Array
            Interface (PyTorch's or CuPy's current stream), else the default stream
            (numbaflash/streams.py). Device results are ready in that stream's order;
            host results are ready when the call returns.

    Returns:
        out with q's shape and dtype, or ``(out, lse)`` with lse of shape (..., Sq) in
        float32 (float64 for float64 inputs). Rows that see no key (causal with Sq > Sk,
        a window or mask that hides every key, or Sk = 0) give out = 0 and lse = -inf.

    Raises:
        ValueError: bad shapes, scale, causal mode, head dim, version or tiles, or a
            version that cannot run this input; raised before anything is launched.
        TypeError: unsupported or mismatched dtypes, inputs that are not arrays, or a
            ``stream`` that is not a stream.
        MemoryError: the call's arrays (device copies of host inputs, out, lse, and their
            host copies) need more host or GPU memory than is available; raised before
            anything is allocated (validate.check_memory).
        RuntimeError: there is neither a GPU nor the simulator.

    Warns:
        validate.SimulatorSlowWarning: on the simulator, when the call will take longer
            than about 30 s; the message has the estimate (validate.simulator_seconds).
    """
    variants = _variants(window_size, alibi_slopes, softcap, attn_mask, score_mod,
                         score_mod_grad, mask_mod, dropout_p, dropout_seed)
    host = not arrays.on_device((q, k, v))
    p, plan = _forward_problem_and_plan(q, k, v, causal, scale, variants, version, tiles)
    s = call_stream((q, k, v), stream)
    # Before anything is allocated: MemoryError if the arrays cannot fit, and a warning if
    # the call will take long on the simulator.
    check_memory(p, forward_memory(p, plan, dict(q=q, k=k, v=v), host), plan.backend)
    warn_if_slow(p, (plan,))
    out_shape = p.lead + (p.Sq, p.d)
    lse_shape = p.lead + (p.Sq,)
    lse_dtype = np.dtype(p.acc_dtype)

    if p.BH == 0 or p.Sq == 0 or p.Sk == 0:
        # Nothing to launch. With Sk = 0 every row sees no key: out 0, lse -inf.
        out = arrays.filled(out_shape, 0, p.dtype, host, s)
        lse = arrays.filled(lse_shape, -np.inf, lse_dtype, host, s)
        return (out, lse) if return_lse else out

    # bfloat16 on a version that computes in float32: float32 copies (numbaflash/dtypes.py)
    widen = dtypes.widens(p, forward.module(plan.version))
    Q = arrays.as_kernel_array(q, (p.BH, p.Sq, p.d), "q", s, widen)
    K = arrays.as_kernel_array(k, (p.BHkv, p.Sk, p.d), "k", s, widen)
    V = arrays.as_kernel_array(v, (p.BHkv, p.Sk, p.d), "v", s, widen)
    O = arrays.device_empty((p.BH, p.Sq, p.d), dtypes.kernel_dtype(p.dtype, widen), s)
    L = arrays.device_empty((p.BH, p.Sq), lse_dtype, s)
    launch_forward(plan, dtypes.kernel_problem(p, widen), Q, K, V, O, L,
                   *_variant_arrays(p, s), stream=s)
    out = arrays.finish(O, out_shape, host, s, p.dtype)
    if not return_lse:
        return out
    return out, arrays.finish(L, lse_shape, host, s)


def explain(q, k, v, *, causal=False, scale=None, version=None, tiles=None, backend=None,
            **variants):
    """Validate like ``attention`` and return the ``Plan`` it would run, without running it.

    ``print(numbaflash.explain(q, k, v))`` shows the kernel version, tiles, grid, block,
    shared memory, backend (GPU or simulator), the variant compiled in, and the reason for
    each choice. q, k, v may be arrays or anything with ``shape`` and ``dtype``.
    ``backend``: None for this machine's, or "gpu" / "simulator" to see the plan that
    backend would run, on any machine (a GPU's plan assumes the H100/H200's 227 KB of
    shared memory per block when there is no GPU to ask).
    ``variants``: the keyword arguments of ``attention`` (window_size, alibi_slopes, ...).
    """
    p = check_attention_inputs(q, k, v, causal, scale, **variants)
    return plan_forward(p, version, tiles, where=backend)


def attention_backward(dout, q, k, v, out, lse, *, causal=False, scale=None, window_size=None,
                       alibi_slopes=None, softcap=None, attn_mask=None, score_mod=None,
                       score_mod_grad=None, mask_mod=None, dropout_p=0.0, dropout_seed=None,
                       version=None, tiles=None, deterministic=True, stream=None):
    """Gradients of ``attention`` (FlashAttention-2 backward, Algorithm 2).

    Args:
        dout: the upstream gradient dL/dout, with q's shape and dtype.
        q, k, v: the forward's inputs, as for ``attention``.
        out, lse: what ``attention(q, k, v, causal=causal, scale=scale, return_lse=True)``
            returned: out with q's shape and dtype, lse (..., Sq) in float32 (float64 for
            float64 inputs). The backward recomputes the probabilities from lse, so both
            must come from the same q, k, v, causal and scale.
            All six host (NumPy) arrays, or all device arrays (see ``attention``).
        causal, scale: as given to the forward.
        window_size, alibi_slopes, softcap, attn_mask, score_mod, mask_mod: as given to
            the forward. No gradient is returned for alibi_slopes or attn_mask.
        score_mod_grad: d score_mod / d score (a Numba device function), required with a
            score_mod (ValueError otherwise).
        dropout_p, dropout_seed: as given to the forward; the kernels regenerate its
            dropout mask from them (the gradients are those of the dropped output).
        version: backward version ("v1": deterministic, the first rung; "v2":
            atomic dQ, a lesson, float32/float64 only; "v3": register-blocked,
            deterministic, the default for plain attention in float64 and at d > 128
            (v1 with a variant there); "v4": v3 with dynamic shared memory for larger
            tiles, the default in float32 and float16 with d <= 128 on the simulator; "v5":
            tensor cores (3xTF32); "v6": v5 made cheaper, the default for that
            attention on a GPU; "v7": v5 on the 16-bit tensor cores for float16 and
            bfloat16, plain or causal attention, when asked for; "v8": v6's dK/dV kernel
            adding dQ by atomics, not bitwise reproducible, the default on a GPU with
            deterministic=False; "v9": v7 with ldmatrix operands and cp.async copies,
            bitwise v7's gradients, the default for plain float16 and bfloat16
            attention on a GPU; "v10": v6 adding dK, dV and dQ in the mma's C operand
            (v6's tiles and variants, its own rounding, not yet measured on a GPU), when
            asked for. v5 to v10 take finite inputs only: the call checks them first
            and, if one is NaN or inf, runs v4 and logs why for the default, or raises
            ValueError if one of them was asked for); None picks the default; see
            ``explain_backward`` and numbaflash/kernels/backward/ (one file per version).
        tiles: (Br, Bc) for the backward kernels (v3 and v4 also take (Br, Bc, TM, TN);
            v5 and v6 take multiples of 16, and v6 also ((Br, Bc), (Br, Bc)): the dK/dV
            kernel's tiles, then the dQ kernel's; given tiles run without v6's split
            pairs); None uses the documented rule in the version's file (v6:
            default_backward_v6_plan, tiles and pairs per kernel; v8: (Br, Bc) of its
            one kernel).
        deterministic: True (the default): the default version is deterministic, so
            repeated calls give the same bits. False (flash-attention's
            ``deterministic=False``): on a GPU where v8 can run the input, v8 adds dQ by
            atomic adds, one kernel instead of two, and dQ may differ in its last bits
            between runs (dK, dV do not); elsewhere (the simulator, float64, d > 128, NaN
            or inf among the inputs) the deterministic default runs, and the plan's
            reason says why. A ``version`` named by the caller runs either way.
        stream: as for ``attention`` (the inputs' stream: dout's, q's, ... in that order).

    Returns:
        ``(dq, dk, dv)`` with the shapes and dtype of q, k, v (float16 and bfloat16 inputs
        are computed in float32 and the gradients rounded to their dtype, like the
        forward's output).
        Rows that see no key give a zero dq row; keys no row sees get zero dk and dv rows.
        Empty inputs give zero or empty gradients without a launch (Sk = 0: dq is zero,
        dk and dv are empty).

    Raises:
        ValueError: bad shapes (dout, out, lse included), scale, causal mode, head dim,
            version or tiles; raised before anything is launched. Also version="v5" to
            "v8" with a NaN or inf among the inputs (found by a check kernel, before the
            backward's).
        TypeError: unsupported or mismatched dtypes (dout, out, lse included), or a
            ``deterministic`` that is not True or False.
        MemoryError: the arrays the call allocates (device copies of host inputs, the
            scratch D, dq, dk, dv and their host copies) need more host or GPU memory than
            is available; raised before anything is allocated.
        RuntimeError: there is neither a GPU nor the simulator.

    Warns:
        validate.SimulatorSlowWarning: as ``attention``.
    """
    variants = _variants(window_size, alibi_slopes, softcap, attn_mask, score_mod,
                         score_mod_grad, mask_mod, dropout_p, dropout_seed)
    p = check_backward_inputs(dout, q, k, v, out, lse, causal, scale, **variants)
    host = not arrays.on_device((dout, q, k, v, out, lse))
    plans = plan_backward(p, version, tiles, deterministic=deterministic)
    s = call_stream((dout, q, k, v, out, lse), stream)
    check_memory(p, backward_memory(p, plans, dict(dout=dout, q=q, k=k, v=v, out=out, lse=lse),
                                    host), plans[0].backend, "attention_backward")
    warn_if_slow(p, plans, "attention_backward")
    q_shape = p.lead + (p.Sq, p.d)
    k_shape = p.k_lead + (p.Sk, p.d)

    if p.BH == 0 or p.Sq == 0 or p.Sk == 0:
        # Nothing to launch: no (query, key) pair is visible, so every gradient is 0.
        return (arrays.filled(q_shape, 0, p.dtype, host, s),
                arrays.filled(k_shape, 0, p.dtype, host, s),
                arrays.filled(k_shape, 0, p.dtype, host, s))

    acc = np.dtype(p.acc_dtype)
    # bfloat16 on a version that computes in float32: float32 copies (numbaflash/dtypes.py)
    widen = dtypes.widens(p, backward.module(plans[-1].version))
    kp = dtypes.kernel_problem(p, widen)
    Q = arrays.as_kernel_array(q, (p.BH, p.Sq, p.d), "q", s, widen)
    K = arrays.as_kernel_array(k, (p.BHkv, p.Sk, p.d), "k", s, widen)
    V = arrays.as_kernel_array(v, (p.BHkv, p.Sk, p.d), "v", s, widen)
    O = arrays.as_kernel_array(out, (p.BH, p.Sq, p.d), "out", s, widen)
    dO = arrays.as_kernel_array(dout, (p.BH, p.Sq, p.d), "dout", s, widen)
    L = arrays.as_kernel_array(lse, (p.BH, p.Sq), "lse", s)
    D = arrays.device_empty((p.BH, p.Sq), acc, s)         # scratch: D = rowsum(dO * O)
    grad = dtypes.kernel_dtype(p.dtype, widen)
    if plans[-1].version == "v2":
        # v2 adds into dQ with atomics, so it starts from zeros (copied from the host:
        # v2 is a lesson, and this copy is one of its costs).
        dQ = arrays.filled((p.BH, p.Sq, p.d), 0, grad, False, s)
    else:
        dQ = arrays.device_empty((p.BH, p.Sq, p.d), grad, s)
    dK = arrays.device_empty((p.BHkv, p.Sk, p.d), grad, s)
    dV = arrays.device_empty((p.BHkv, p.Sk, p.d), grad, s)
    # v5 to v10 (tensor cores) need finite inputs. The check is queued first; a version
    # the caller named waits for it (an error before its launch), the default's kernels
    # are queued before the wait, and v4's run after them if an input is not finite
    # (policy.start_finite_check says why).
    pending = start_finite_check(plans, kp, Q, K, V, O, dO, L, s)
    if pending is not None and version is not None:
        plans, pending = pending.plans(asked=True), None
    launch_backward(plans, kp, Q, K, V, O, dO, L, D, dQ, dK, dV, *_variant_arrays(p, s),
                    stream=s)
    fallback = plans if pending is None else pending.plans(asked=False)
    if fallback is not plans:
        launch_backward(fallback, kp, Q, K, V, O, dO, L, D, dQ, dK, dV,
                        *_variant_arrays(p, s), stream=s)
    return (arrays.finish(dQ, q_shape, host, s, p.dtype),
            arrays.finish(dK, k_shape, host, s, p.dtype),
            arrays.finish(dV, k_shape, host, s, p.dtype))


def attention_vjp(q, k, v, *, causal=False, scale=None, forward_version=None,
                  forward_tiles=None, backward_version=None, backward_tiles=None,
                  deterministic=True, stream=None, **variants):
    """Run the forward now and return ``(out, vjp)``, where ``vjp(dout) -> (dq, dk, dv)``.

    The same as ``attention(..., return_lse=True)`` followed by ``attention_backward``,
    without carrying out and lse by hand. ``vjp`` may be called any number of times.
    It keeps references to q, k, v (not copies): do not modify them before calling it.

    Args:
        q, k, v, causal, scale: as for ``attention``; ``variants``: its variant keyword
            arguments (window_size, alibi_slopes, softcap, attn_mask, score_mod,
            score_mod_grad, mask_mod) and dropout_p, dropout_seed (the same mask in the
            forward and every ``vjp`` call).
        forward_version, forward_tiles: ``version`` and ``tiles`` of the forward.
        backward_version, backward_tiles: ``version`` and ``tiles`` of the backward.
        deterministic: as for ``attention_backward``, for every ``vjp`` call.
        stream: as for ``attention``, for the forward and every ``vjp`` call.

    Returns:
        ``(out, vjp)``: out as ``attention`` returns it (host or device, like the inputs);
        ``vjp(dout)`` takes dout with out's shape and dtype and returns
        ``(dq, dk, dv)`` as ``attention_backward`` does.

    Raises:
        ValueError: as ``attention`` and ``attention_backward``, for the backward options
            too, before the forward runs; ``vjp`` raises it for a bad dout.
        TypeError: as ``attention``; ``vjp`` raises it for a dout of the wrong dtype.
    """
    p = check_attention_inputs(q, k, v, causal, scale, **variants)
    if p.variant.score_mod is not None and p.variant.score_mod_grad is None:
        raise ValueError("the backward of a score_mod needs its derivative: pass "
                         "score_mod_grad (a Numba device function)")
    plan_backward(p, backward_version, backward_tiles,     # bad backward options fail now
                  deterministic=deterministic)
    out, lse = attention(q, k, v, causal=causal, scale=scale, return_lse=True,
                         version=forward_version, tiles=forward_tiles, stream=stream,
                         **variants)

    def vjp(dout):
        """Gradients (dq, dk, dv) of the attention above for the upstream gradient dout."""
        return attention_backward(dout, q, k, v, out, lse, causal=causal, scale=scale,
                                  version=backward_version, tiles=backward_tiles,
                                  deterministic=deterministic, stream=stream, **variants)

    return out, vjp


def explain_backward(q, k, v, *, causal=False, scale=None, version=None, tiles=None,
                     deterministic=True, backend=None, **variants):
    """Validate like ``attention`` and return the backward's ``Plans`` without running them.

    ``print(numbaflash.explain_backward(q, k, v))`` shows one line per kernel (D, dK/dV,
    dQ for v1, v3 and v4): version, tiles (and v3's and v4's thread tile), grid, block,
    shared memory (v4: dynamic, per kernel), backend, variant and why. ``backend`` as
    for ``explain``: "gpu" shows a GPU's plan on any machine. ``deterministic`` as for
    ``attention_backward`` (False: v8's plans where it can run, D, the zero fill of dQ's
    float32 sums, its one kernel and for float16 the rounding into dQ). (On a GPU the call
    itself also checks that the inputs are finite, and runs v4 instead of v6 or v8 if
    they are not; a plan cannot know that.)
    """
    p = check_attention_inputs(q, k, v, causal, scale, **variants)
    return plan_backward(p, version, tiles, where=backend, deterministic=deterministic)

