"""The inference half of FlashAttention in the bench: decoding against a KV cache, and
packed batches of different lengths, each checked, then timed against what a user would
run otherwise, with its target (``python -m numbaflash bench --inference``).

Two parts, each case in the order of variants.py: check, then time, then compare.

Decode (``DECODE_SHAPES``, (B, Hq, Hk, Sq, S_max, d)): ``attention_with_kvcache`` on full
caches (cache_seqlens = S_max), with the planner's number of splits.

1. Check. out and lse of the first batch, every query head, against
   ``numbaflash.reference.forward`` in float64 on that batch's caches, by the bench's rule
   (``agreement.agreement_bound``); the naive baseline is the same reference in float32,
   its out rounded to float16 for float16 inputs (as in variants.py). A wrong result
   gets no time (``ok`` False, ``ms`` None), and nothing is compared with it.
2. Time. numbaflash; PyTorch SDPA on the same tensors as scripts/decode_gpu.py calls it:
   as a user calls it (its own choice of backend) and on the fused backend of the dtype
   (FLASH for float16, EFFICIENT for float32) where that takes the call, ``enable_gqa``
   for GQA, the faster of the two being the baseline; and the HBM copy bandwidth (a
   device-to-device copy of ``HBM_COPY_BYTES``, bytes read + written / time), measured
   once.
3. Compare. Bandwidth = the bytes of K and V read / time. The HBM copy's ``baseline_ms``
   is the time its bandwidth takes for those bytes, so against either baseline 1/ratio
   is numbaflash's bandwidth over the baseline's. Targets: 1/ratio >= 0.8 against SDPA;
   1/ratio >= 0.5 against the HBM copy in float16 (float32: shown, no target).

Packed (``PACKED``): ``attention_varlen`` and ``attention_varlen_backward`` on sequences of
lengths drawn uniformly (NumPy ``default_rng(0)``), every head dim, causal and not,
forward and forward + backward.

1. Check. The first sequence's out and lse (and dq, dk, dv) against ``numbaflash.reference``
   in float64 by the same rule.
2. Time. The packed call, and the same batch padded to the longest sequence and run
   through ``attention`` / ``attention_backward`` with a boolean attn_mask that hides the
   padding (and, causal, each sequence's future, aligned as the packed call aligns it:
   bottom-right within the sequence, which for equal query and key lengths is the
   lower triangle), as scripts/varlen_gpu.py does. The padded baseline's first sequence
   is checked against the same reference before it is timed (a mask that hid the wrong
   keys would make the comparison say nothing). PyTorch SDPA (its own backend choice) on
   the padded batch with the mask is timed too, without a target.
3. Compare. ratio = packed ms / padded ms; target: forward + backward 1/ratio >= 1.5 (packed
   at least 1.5 times faster). The bytes of q, k, v and out of both layouts are recorded
   (``packed_bytes``, ``padded_bytes``; the padded batch's mask in ``mask_bytes``).

Under the CUDA simulator the shapes are tiny ones of the same structure (the "simulator"
entries), PyTorch does not run, and the times say nothing about speed; the checks still
mean what they say.
"""

import sys
import warnings

import numpy as np
from numba import cuda

from .agreement import MULT, _agreement, _lse_agreement
from .library import (attention_varlen, attention_varlen_backward,  # noqa: F401
                      attention_with_kvcache, backend, check_varlen_inputs, explain_kvcache,
                      explain_varlen, plan_backward, reference)
from .pytorch import _torch_cuda
from .report import aligned_rows
from .runner import _api, _Progress, _worst
from .timing import SIMULATOR_WARNING, _timer_name, time_ms
from .variants import _cell, _first_line, target_met

INFERENCE_PARTS = ("decode", "packed")
INFERENCE_DTYPES = ("float32", "float16")
PACKED_PASSES = ("forward", "fwd+bwd")

# (B, Hq, Hk, Sq, S_max, d): the decode shapes of docs/kvcache.md's targets on a GPU
# (batch 8 at 32K keys, batch 1 at 128K; without and with GQA), and the same structure
# on the simulator (GQA with two K/V heads and batch 2; one K/V head per query head).
DECODE_SHAPES = {
    "gpu": ((8, 32, 32, 1, 32768, 128), (8, 32, 8, 1, 32768, 128),
            (1, 32, 32, 1, 131072, 128), (1, 32, 8, 1, 131072, 128)),
    "simulator": ((2, 4, 2, 1, 48, 16), (1, 4, 4, 1, 64, 16)),
}
# The packed batches: how many sequences, their lengths' range (drawn uniformly in it,
# both ends included, by numpy's default_rng(LENGTH_SEED)), heads, head dims.
# On the simulator the lengths drawn are 14, 11 and 9: each crosses the simulator's tile
# boundary at 8 keys (longer ones cost another tile row and column of simulated blocks).
PACKED = {
    "gpu": dict(sequences=64, lengths=(128, 4096), heads=16, dims=(64, 128)),
    "simulator": dict(sequences=3, lengths=(1, 16), heads=2, dims=(8,)),
}
LENGTH_SEED = 0
# The HBM copy: bytes copied device to device (4 GiB, as scripts/decode_gpu.py copies).
HBM_COPY_BYTES = {"gpu": 2**32, "simulator": 2**12}

# Targets, on ratio = numbaflash ms / baseline ms (target_met reads them).
DECODE_TARGETS = {"sdpa": "1/ratio >= 0.8",
                  "hbm": {"float16": "1/ratio >= 0.5", "float32": None}}
PACKED_TARGETS = {"forward": None, "fwd+bwd": "1/ratio >= 1.5"}

PADDED_BASELINE = "numbaflash padded + bool mask"
SDPA_PADDED_BASELINE = "SDPA padded + bool mask"
HBM_BASELINE = "HBM copy"

RECORD_KEYS = (
    "part", "case", "options", "B", "Hq", "Hkv", "Sq", "N", "d", "causal", "dtype", "what",
    "kernel", "ms", "baseline", "baseline_ms", "ratio", "target", "met", "ok", "max_err",
    "bound", "check", "checked_against", "timer", "repeats", "warmup", "note",
    "baseline_ok", "baseline_note", "baseline_detail",
    # decode
    "splits", "kv_bytes", "gbs", "baseline_gbs",
    # packed
    "lengths", "total", "packed_bytes", "padded_bytes", "mask_bytes")


def _inference_api(name):
    """The call ``name`` as the package ``numbaflash.bench`` holds it, looked up at call
    time (as runner._api does): a test that replaces ``numbaflash.bench.attention_varlen``
    replaces what is checked and timed."""
    return getattr(sys.modules[__package__], name)


# --- the check -------------------------------------------------------------------------


def _references(dtype, q, k, v, dout=None, causal=False):
    """float64 references and naive baselines of one slice: ``(ref, base)``, dicts of out and
    lse (and dq, dk, dv when ``dout`` is given), in the slice's layout: q (Hq, Sq, d), k, v
    (Hk, Sk, d).

    One K/V head at a time, with the query heads it serves (GQA): the reference holds one
    K/V head's keys (repeated for its query heads) and their dense matrices at a time,
    not the whole batch's. The naive baseline is the reference in float32 (for float16 inputs
    too, as in variants.py), its out and gradients rounded to float16 for float16 inputs.
    """
    Hq, Hk = q.shape[0], k.shape[0]
    group = Hq // Hk
    names = ("out", "lse") + (("dq", "dk", "dv") if dout is not None else ())
    ref, base = ({n: [] for n in names} for _ in range(2))
    with np.errstate(all="ignore"):
        for h in range(Hk):
            rows, keys = slice(h * group, (h + 1) * group), slice(h, h + 1)
            for compute, into in ((np.float64, ref), (np.float32, base)):
                out, lse = reference.forward(q[rows], k[keys], v[keys], causal, dtype=compute)
                into["out"].append(out)
                into["lse"].append(lse)
                if dout is not None:
                    grads = reference.backward(dout[rows], q[rows], k[keys], v[keys], causal,
                                               dtype=compute)
                    for name, g in zip(("dq", "dk", "dv"), grads):
                        into[name].append(g)
    ref, base = ({n: np.concatenate(parts) for n, parts in d.items()} for d in (ref, base))
    if np.dtype(dtype) == np.float16:
        for name in ("out", "dq", "dk", "dv"):
            if name in base:
                base[name] = base[name].astype(np.float16)
    return ref, base


def _checks(got, ref, base, dtype):
    """``{name: {"max_err", "bound", "ok"}}``: numbaflash's results ``got`` (host arrays in
    the reference's layout) by the bench's rule. Rows that see no key must be exactly 0
    (out, dq) and -inf (lse)."""
    rows = ref["lse"].shape[-1]
    masked = np.isneginf(ref["lse"]).reshape(-1, rows).all(axis=0)
    checks = {}
    for name, x in got.items():
        x = np.asarray(x, dtype=np.float64)
        naive = np.asarray(base[name], dtype=np.float64)
        if name == "lse":
            checks[name] = _lse_agreement(x, ref[name], naive, dtype, masked)
        else:
            zero = masked if name in ("out", "dq") else None
            checks[name] = _agreement(x, ref[name], naive, dtype, MULT[name], zero)
    return checks


def _measure(fn, check, checked_against, repeats, warmup):
    """Run ``fn`` once and check its result (``check(result)`` gives the checks); only if it
    agrees, time it. Returns the record's fields of the measured call."""
    fields = dict(ms=None, ok=None, max_err=None, bound=None, check=None,
                  checked_against=None, timer=None, repeats=None, warmup=None)
    result = fn()                              # the first call also compiles the kernels
    checks = check(result)
    del result
    worst = _worst(checks)
    fields.update(check=checks, max_err=worst["max_err"], bound=worst["bound"],
                  ok=all(c["ok"] for c in checks.values()), checked_against=checked_against)
    if fields["ok"]:                           # a wrong result gets no time
        fields.update(ms=time_ms(fn, repeats, warmup), timer=_timer_name(), repeats=repeats,
                      warmup=warmup)
    return fields


def _host(x):
    """A device array's values on the host, in float64."""
    return np.asarray(x.copy_to_host(), dtype=np.float64)


def _record(**fields):
    """One record: every key of ``RECORD_KEYS``, None where ``fields`` does not set it."""
    record = dict.fromkeys(RECORD_KEYS)
    record.update(fields)
    return record


# --- decoding against a KV cache -------------------------------------------------------


def _random(torch, sizes, dtype, seed):
    """Random normal arrays, ``{name: shape}`` in ``dtype``: ``(arrays, device)``.

    The arrays are torch tensors on the GPU when PyTorch with CUDA is there (numbaflash
    reads the same memory through ``cuda.as_cuda_array``, and SDPA gets the tensors), else
    NumPy arrays, copied to the device once; ``device`` holds what numbaflash gets.
    """
    if torch is not None:
        g = torch.Generator(device="cuda").manual_seed(seed)
        arrays = {n: torch.randn(s, device="cuda", dtype=getattr(torch, dtype), generator=g)
                  for n, s in sizes.items()}
    else:
        rng = np.random.default_rng(seed)
        arrays = {n: rng.standard_normal(s, dtype=np.float32).astype(dtype)
                  for n, s in sizes.items()}
    return arrays, {n: _on_device(a) for n, a in arrays.items()}


def _on_device(x):
    """A torch CUDA tensor as a device array (no copy), or a NumPy array copied there."""
    return cuda.as_cuda_array(x) if hasattr(x, "cpu") else cuda.to_device(x)


def _on_host(x):
    """A torch tensor's (or NumPy array's) values as a NumPy array."""
    return x.cpu().numpy() if hasattr(x, "cpu") else np.asarray(x)


class _DecodeInputs:
    """One decode shape: random normal q (B, Hq, Sq, d) and full caches k_cache, v_cache
    (B, Hk, S_max, d) (``_random``), and batch 0 of each on the host (the check's slice)."""

    def __init__(self, torch, shape, dtype, seed):
        B, Hq, Hk, Sq, S_max, d = shape
        self.arrays, self.device = _random(torch, {
            "q": (B, Hq, Sq, d), "k_cache": (B, Hk, S_max, d), "v_cache": (B, Hk, S_max, d)},
            dtype, seed)
        self.host = {n: _on_host(a[0]) for n, a in self.arrays.items()}
        # The bytes one call reads from the caches (scripts/decode_gpu.py's _kv_bytes).
        self.kv_bytes = 2 * B * Hk * S_max * d * np.dtype(dtype).itemsize


def _sdpa_decode(torch, q, k_cache, v_cache, dtype, repeats, warmup):
    """``(ms, detail)``: PyTorch SDPA on the decode tensors as scripts/decode_gpu.py times it:
    as a user calls it (its own backend choice), and on the fused backend of the dtype
    (FLASH for float16, EFFICIENT for float32) where that backend takes the call; with
    ``enable_gqa`` when the caches have fewer heads. ms is the faster of the two."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    gqa = k_cache.shape[1] != q.shape[1]

    def sdpa():
        with torch.no_grad():
            return F.scaled_dot_product_attention(q, k_cache, v_cache, enable_gqa=gqa)
    fused = SDPBackend.FLASH_ATTENTION if dtype == "float16" else SDPBackend.EFFICIENT_ATTENTION
    with warnings.catch_warnings():             # a backend that refuses says why, at length
        warnings.simplefilter("ignore")
        sdpa()
        default_ms = time_ms(sdpa, repeats, warmup)
        try:
            with sdpa_kernel(fused):
                sdpa()
                fused_ms = time_ms(sdpa, repeats, warmup)
        except RuntimeError:
            fused_ms = None
    how = f"{fused.name} {fused_ms:.3f} ms" if fused_ms is not None else \
        f"{fused.name} refuses the call"
    detail = f"SDPA as called (default) {default_ms:.3f} ms, {how}: the faster is the baseline"
    return min(default_ms, fused_ms if fused_ms is not None else default_ms), detail


def hbm_copy(n_bytes, repeats, warmup):
    """``(ms, GB/s)`` of a device-to-device copy of ``n_bytes`` (a multiple of 4): the median
    time (``timing.time_ms``) and bytes read + written / time."""
    src = cuda.device_array(n_bytes // 4, dtype=np.float32)    # what it holds does not matter
    dst = cuda.device_array_like(src)

    def copy():
        dst.copy_to_device(src)
    copy()
    ms = time_ms(copy, repeats, warmup)
    return ms, 2 * n_bytes / ms / 1e6


def _decode_kernels(data, S_max):
    """``(kernel names, number of splits)`` of the planner's choice."""
    d = data.device
    plans = explain_kvcache(d["q"], d["k_cache"], d["v_cache"], cache_seqlens=S_max)
    return "+".join(p.kernel for p in plans), int(plans[0].grid[0])


def _decode_case(shape, dtype, seed, torch, sdpa_note, hbm, size, judged, repeats, warmup,
                 bar):
    """The records of one decode shape: against SDPA, then against the HBM copy."""
    kvcache_call = _inference_api("attention_with_kvcache")
    B, Hq, Hk, Sq, S_max, d = shape
    data = _DecodeInputs(torch, shape, dtype, seed)
    q, k_cache, v_cache = (data.device[n] for n in ("q", "k_cache", "v_cache"))
    kernel, splits = _decode_kernels(data, S_max)

    def fn():
        return kvcache_call(q, k_cache, v_cache, cache_seqlens=S_max, return_lse=True)

    def check(result):
        h = data.host
        ref, base = _references(dtype, h["q"], h["k_cache"], h["v_cache"])
        out, lse = result
        return _checks({"out": _host(out[0]), "lse": _host(lse[0])}, ref, base, dtype)
    ours = _measure(fn, check, "numbaflash.reference float64, first batch, every query head "
                    "(baseline: the same in float32)", repeats, warmup)
    gbs = data.kv_bytes / ours["ms"] / 1e6 if ours["ms"] else None
    name = f"decode, batch {B}, " + ("MHA" if Hq == Hk else f"GQA {Hq // Hk}:1")
    fused = "FLASH" if dtype == "float16" else "EFFICIENT"
    records = []
    for baseline in ("sdpa", "hbm"):
        label = f"SDPA (best of default, {fused})" if baseline == "sdpa" else HBM_BASELINE
        bar.step(f"decode {shape} ({dtype}) vs {label}")
        base_ms = base_gbs = note = detail = None
        if ours["ms"] is not None:             # nothing to compare otherwise
            if baseline == "hbm":
                copy_ms, base_gbs = hbm()
                base_ms = data.kv_bytes / (base_gbs * 1e6)
                detail = (f"a device-to-device copy of {_size(HBM_COPY_BYTES[size])}: "
                          f"{copy_ms:.3f} ms, {_cell(base_gbs, 0)} GB/s read + written; baseline "
                          f"ms = the K and V bytes at that bandwidth")
            elif sdpa_note:
                note = sdpa_note
            else:
                try:
                    t = data.arrays
                    base_ms, detail = _sdpa_decode(torch, t["q"], t["k_cache"], t["v_cache"],
                                                   dtype, repeats, warmup)
                    base_gbs = data.kv_bytes / base_ms / 1e6
                except Exception as e:         # noqa: BLE001 - recorded, not hidden
                    note = f"failed: {_first_line(e)}"
                finally:
                    torch.cuda.empty_cache()
        target = DECODE_TARGETS[baseline]
        target = target.get(dtype) if isinstance(target, dict) else target
        ratio = ours["ms"] / base_ms if base_ms else None
        records.append(_record(
            part="decode", case=name, options=f"cache full (cache_seqlens = {S_max}), "
            f"the planner's {splits} split(s)", B=B, Hq=Hq, Hkv=Hk, Sq=Sq, N=S_max, d=d,
            causal=False, dtype=dtype, what="forward", kernel=kernel, baseline=label,
            baseline_ms=base_ms, ratio=ratio, target=target,
            met=target_met(target, ratio) if judged else None, baseline_note=note,
            baseline_detail=detail, splits=splits, kv_bytes=data.kv_bytes, gbs=gbs,
            baseline_gbs=base_gbs, **ours))
    return records


# --- packed batches of different lengths -----------------------------------------------


def _cu(lengths):
    """cu_seqlens: 0, then the running total of ``lengths`` (int32, on the host)."""
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def padding_mask(lengths, S, causal):
    """The boolean attn_mask (B, 1, S, S) of a batch of sequences of ``lengths`` padded to
    S, True where a query row attends to a key: both inside the sequence, and (causal) the
    key not after the row. That is the packed call's causal mask, bottom-right within each
    sequence, since a sequence's query and key lengths are equal (scripts/varlen_gpu.py's
    mask). Padded query rows see no key."""
    valid = np.arange(S)[None, :] < np.asarray(lengths)[:, None]               # (B, S)
    mask = valid[:, None, :, None] & valid[:, None, None, :]
    if causal:
        mask = mask & np.tri(S, dtype=bool)
    return mask


class _PackedInputs:
    """One packed batch: random normal q, k, v, dout (total, H, d) (``_random``), the first
    sequence's rows on the host (the check's slice, as (H, n, d)), and on demand the same
    batch padded to the longest sequence, (B, H, S, d), with its boolean masks."""

    def __init__(self, torch, lengths, heads, d, dtype, seed):
        self.torch, self.dtype = torch, dtype
        self.lengths = np.asarray(lengths)
        self.cu = _cu(self.lengths)
        self.total, self.S = int(self.cu[-1]), int(self.lengths.max())
        self.B, self.H, self.d = len(self.lengths), heads, d
        self.arrays, self.device = _random(torch, dict.fromkeys(
            ("q", "k", "v", "dout"), (self.total, heads, d)), dtype, seed)
        self.first = n = int(self.lengths[0])     # the first sequence: the check's slice
        self.host = {x: np.ascontiguousarray(_on_host(a[:n]).swapaxes(0, 1))
                     for x, a in self.arrays.items()}
        itemsize = np.dtype(dtype).itemsize
        # q, k, v and out of each layout (what a batch holds at its forward)
        self.packed_bytes = 4 * self.total * heads * d * itemsize
        self.padded_bytes = 4 * self.B * heads * self.S * d * itemsize
        self.mask_bytes = self.B * self.S * self.S           # (B, 1, S, S) bool
        self._padded, self._masks, self.references = None, {}, {}

    def references_for(self, causal):
        """``(ref, base)`` of the first sequence, forward and backward, made once."""
        if causal not in self.references:
            h = self.host
            self.references[causal] = _references(self.dtype, h["q"], h["k"], h["v"],
                                                  h["dout"], causal)
        return self.references[causal]

    def padded(self):
        """``(arrays, device)``: q, k, v, dout padded to (B, H, S, d), zeros past each
        sequence, as ``_random`` gives them."""
        if self._padded is None:
            shape, torch = (self.B, self.H, self.S, self.d), self.torch
            arrays = {x: np.zeros(shape, self.dtype) if torch is None else torch.zeros(
                shape, device="cuda", dtype=getattr(torch, self.dtype)) for x in self.arrays}
            for b, n in enumerate(self.lengths):
                at = slice(int(self.cu[b]), int(self.cu[b + 1]))
                for x, packed in self.arrays.items():
                    arrays[x][b, :, :n] = packed[at].swapaxes(0, 1)
            self._padded = (arrays, {x: _on_device(a) for x, a in arrays.items()})
        return self._padded

    def mask(self, causal):
        """``(array, device)``: ``padding_mask`` of this batch, as a torch tensor on the GPU
        (or a NumPy array without PyTorch) and as what numbaflash gets."""
        if causal not in self._masks:
            mask = padding_mask(self.lengths, self.S, causal)
            if self.torch is not None:
                mask = self.torch.from_numpy(mask).cuda()
            self._masks[causal] = (mask, _on_device(mask))
        return self._masks[causal]


def _packed_passes(data, causal):
    """{pass: closure} of the packed calls (``bench.attention_varlen`` and its backward,
    looked up now); each returns (out, lse) or (out, lse, dq, dk, dv)."""
    packed = _inference_api("attention_varlen")
    packed_backward = _inference_api("attention_varlen_backward")
    q, k, v, dout = (data.device[x] for x in ("q", "k", "v", "dout"))
    cu, S = data.cu, data.S                # host cu_seqlens: no wait for a device copy
    kw = dict(max_seqlen_q=S, max_seqlen_k=S, causal=causal)

    def forward():
        return packed(q, k, v, cu, cu, return_lse=True, **kw)

    def fwd_bwd():
        out, lse = packed(q, k, v, cu, cu, return_lse=True, **kw)
        return (out, lse) + tuple(packed_backward(dout, q, k, v, out, lse, cu, cu, **kw))
    return {"forward": forward, "fwd+bwd": fwd_bwd}


def _padded_passes(data, causal):
    """{pass: closure} of the padded batch through ``bench.attention`` and
    ``attention_backward`` with the boolean mask."""
    attention, attention_backward = _api()
    padded = data.padded()[1]
    q, k, v, dout = (padded[x] for x in ("q", "k", "v", "dout"))
    mask = data.mask(causal)[1]

    def forward():
        return attention(q, k, v, attn_mask=mask, return_lse=True)

    def fwd_bwd():
        out, lse = attention(q, k, v, attn_mask=mask, return_lse=True)
        return (out, lse) + tuple(attention_backward(dout, q, k, v, out, lse, attn_mask=mask))
    return {"forward": forward, "fwd+bwd": fwd_bwd}


def _sdpa_padded_passes(torch, q, k, v, dout, mask):
    """{pass: closure} of PyTorch SDPA on the padded batch with the boolean mask, its own
    backend choice (as scripts/varlen_gpu.py calls it)."""
    import torch.nn.functional as F
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]    # the same memory

    def forward():
        with torch.no_grad():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def fwd_bwd():
        o = F.scaled_dot_product_attention(*leaves, attn_mask=mask)
        return torch.autograd.grad(o, leaves, dout)
    return {"forward": forward, "fwd+bwd": fwd_bwd}


def _first_sequence(result, data, padded=False):
    """The first sequence (n rows) of a result (out, lse[, dq, dk, dv]) on the host, in the
    reference's layout (H, n, d): rows 0..n-1 of the packed (total, H, d) arrays (lse
    (H, total)), or the first n rows of the padded batch 0."""
    n = data.first
    if padded:
        def rows(x):
            return _host(x[0])[:, :n]
        lse = rows(result[1])
    else:
        def rows(x):
            return _host(x[:n]).swapaxes(0, 1)
        lse = _host(result[1])[:, :n]
    got = {"out": rows(result[0]), "lse": lse}
    got.update(zip(("dq", "dk", "dv"), map(rows, result[2:])))
    return got


def _packed_kernels(data, causal):
    """{pass: kernel names} of the packed calls (the forward's plan, then the backward's)."""
    q, k, v = (data.device[x] for x in ("q", "k", "v"))
    forward = explain_varlen(q, k, v, data.cu, data.cu, causal=causal).kernel
    p, _ = check_varlen_inputs(q, k, v, data.cu, data.cu, causal=causal)
    backward = "+".join(plan.kernel for plan in plan_backward(p))
    return {"forward": forward, "fwd+bwd": f"{forward} + {backward}"}


def _padded_baseline(fn, data, causal, repeats, warmup):
    """``(ok, ms, note)`` of the padded baseline: its first sequence checked against the
    reference, then (if it agrees) timed."""
    ref, base = data.references_for(causal)
    checks = _checks(_first_sequence(fn(), data, padded=True), ref, base, data.dtype)
    worst = _worst(checks)
    if not all(c["ok"] for c in checks.values()):
        return False, None, (f"not timed: its first sequence disagrees with the reference "
                             f"(max err {worst['max_err']:.2e} > bound {worst['bound']:.2e})")
    return True, time_ms(fn, repeats, warmup), None


def _packed_case(data, causal, torch, sdpa_note, judged, repeats, warmup, bar):
    """The records of one packed batch and causal mode: each pass against the padded batch
    through numbaflash, then through SDPA."""
    ours_fns = _packed_passes(data, causal)
    kernels = _packed_kernels(data, causal)
    options = ("causal (bottom-right within each sequence)" if causal else "not causal")
    name = f"packed, d={data.d}" + (", causal" if causal else "")
    records = []
    for what in PACKED_PASSES:
        ref, base = data.references_for(causal)

        def check(result):
            return _checks(_first_sequence(result, data), ref, base, data.dtype)
        ours = _measure(ours_fns[what], check, "numbaflash.reference float64, first sequence, "
                        "every head (baseline: the same in float32)", repeats, warmup)
        for baseline in (PADDED_BASELINE, SDPA_PADDED_BASELINE):
            bar.step(f"{what:8s} {name} ({data.dtype}) vs {baseline}")
            base_ok = base_ms = note = None
            if ours["ms"] is not None:         # nothing to compare otherwise
                if baseline == PADDED_BASELINE:
                    base_ok, base_ms, note = _padded_baseline(
                        _padded_passes(data, causal)[what], data, causal, repeats, warmup)
                elif sdpa_note:
                    note = sdpa_note
                else:
                    try:
                        t = data.padded()[0]
                        fns = _sdpa_padded_passes(torch, t["q"], t["k"], t["v"], t["dout"],
                                                  data.mask(causal)[0])
                        fns[what]()            # the first call picks and loads its kernels
                        base_ms = time_ms(fns[what], repeats, warmup)
                    except Exception as e:     # noqa: BLE001 - recorded, not hidden
                        note = f"failed: {_first_line(e)}"
                    finally:
                        torch.cuda.empty_cache()
            target = PACKED_TARGETS[what] if baseline == PADDED_BASELINE else None
            ratio = ours["ms"] / base_ms if base_ms else None
            records.append(_record(
                part="packed", case=name, options=options, B=data.B, Hq=data.H, Hkv=data.H,
                Sq=data.S, N=data.S, d=data.d, causal=causal, dtype=data.dtype, what=what,
                kernel=kernels[what], baseline=baseline, baseline_ms=base_ms, ratio=ratio,
                target=target, met=target_met(target, ratio) if judged else None,
                baseline_ok=base_ok, baseline_note=note,
                lengths=[int(n) for n in data.lengths], total=data.total,
                packed_bytes=data.packed_bytes, padded_bytes=data.padded_bytes,
                mask_bytes=data.mask_bytes, **ours))
    return records


# --- the run ---------------------------------------------------------------------------


def _check_inference_arguments(dtype, repeats, warmup, parts, size):
    """ValueError, before anything runs, for a bad argument of ``run_inference``; returns
    the parts to run."""
    if dtype not in INFERENCE_DTYPES:
        raise ValueError(f"dtype must be one of {INFERENCE_DTYPES} (the inference targets are "
                         f"about those); got {dtype!r}")
    for name, n, low in (("repeats", repeats, 1), ("warmup", warmup, 0)):
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < low:
            raise ValueError(f"{name} must be an integer >= {low}; got {n!r}")
    if size not in (None, "gpu", "simulator"):
        raise ValueError(f"size must be None, 'gpu' or 'simulator'; got {size!r}")
    if parts is None:
        return INFERENCE_PARTS
    if isinstance(parts, str):
        parts = (parts,)
    parts = tuple(parts)
    if not parts or any(p not in INFERENCE_PARTS for p in parts):
        raise ValueError(f"parts must be names among {INFERENCE_PARTS}; got {parts!r}")
    return parts


def run_inference(*, dtype="float32", repeats=20, warmup=3, sdpa=True, parts=None, size=None,
                  progress=True):
    """Check, then time, decoding against a KV cache and packed batches against their
    baselines; returns a list of records (this module's docstring says how).

    Args:
        dtype: "float32" or "float16" (inputs; numbaflash computes in float32 either way).
        repeats, warmup: runs timed (median taken) and untimed runs before them.
        sdpa: also time PyTorch SDPA, where PyTorch with CUDA is there.
        parts: names from ``INFERENCE_PARTS`` ("decode", "packed"); default both.
        size: "gpu" (the targets' shapes) or "simulator" (tiny ones of the same
            structure); None: by the backend.
        progress: a line per record on stderr.

    Returns:
        One dict per (case, pass, baseline), decode first, with the keys of
        ``RECORD_KEYS``: part ("decode" | "packed"), case, options (as text), B, Hq, Hkv,
        Sq, N (decode: S_max; packed: B sequences padded to N), d, causal, dtype, what
        ("forward" | "fwd+bwd"), kernel, ms (numbaflash's median; None if not timed),
        baseline, baseline_ms, ratio (ms / baseline_ms), target (text, or None), met (True,
        False, or None: no target, no ratio, or not GPU times at the targets' shapes), ok
        (numbaflash's check: False for a wrong result, which is not timed), max_err and
        bound (the worst tensor's), check (per tensor), checked_against, timer, repeats,
        warmup, note, baseline_ok (the padded baseline's check; None for the others),
        baseline_note (why the baseline has no time), baseline_detail (how it was
        measured); decode: splits, kv_bytes (K and V bytes read per call), gbs and
        baseline_gbs (bandwidths, GB/s); packed: lengths, total, packed_bytes and
        padded_bytes (q, k, v, out of each layout), mask_bytes (the padded batch's mask).

    Raises:
        ValueError: a bad argument, before anything runs.
        RuntimeError: neither a GPU nor the simulator.
    """
    parts = _check_inference_arguments(dtype, repeats, warmup, parts, size)
    where = backend()                         # RuntimeError now if there is no backend
    size = size or ("simulator" if where == "simulator" else "gpu")
    torch = _torch_cuda()
    if torch is None:
        sdpa_note = "not run: no PyTorch with CUDA"
    elif not sdpa:
        sdpa_note = "not run: SDPA switched off (--no-sdpa)"
    else:
        sdpa_note = None
    # The targets are about GPU times at the targets' shapes: judged only there.
    judged = size == "gpu" and where == "gpu"
    packed = PACKED[size]
    steps = (("decode" in parts) * len(DECODE_SHAPES[size]) * 2
             + ("packed" in parts) * len(packed["dims"]) * 2 * len(PACKED_PASSES) * 2)
    bar = _Progress(steps, progress)

    copy = {}

    def hbm():
        """The HBM copy, measured at the first decode case that needs it."""
        if "gbs" not in copy:
            copy["ms"], copy["gbs"] = hbm_copy(HBM_COPY_BYTES[size], repeats, warmup)
        return copy["ms"], copy["gbs"]

    records = []
    if "decode" in parts:
        for seed, shape in enumerate(DECODE_SHAPES[size]):
            records += _decode_case(shape, dtype, seed, torch, sdpa_note, hbm, size, judged,
                                    repeats, warmup, bar)
            if torch is not None:
                torch.cuda.empty_cache()
    if "packed" in parts:
        low, high = packed["lengths"]
        lengths = np.random.default_rng(LENGTH_SEED).integers(low, high + 1,
                                                              packed["sequences"])
        for seed, d in enumerate(packed["dims"], start=1):
            data = _PackedInputs(torch, lengths, packed["heads"], d, dtype, seed)
            for causal in (False, True):
                records += _packed_case(data, causal, torch, sdpa_note, judged, repeats,
                                        warmup, bar)
            del data                          # this head dim's device memory
            if torch is not None:
                torch.cuda.empty_cache()
    return records


# --- the table -------------------------------------------------------------------------


def _size(n):
    """Bytes as text: "512 B", "12.3 KiB", "2.0 GiB"."""
    if n is None:
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _status(r):
    if r["ok"] is False:
        return "WRONG RESULT, not timed"
    if r["baseline_ok"] is False:
        return "baseline WRONG, not timed"
    if r["note"]:
        return "not run"
    return "ok" if r["ok"] else "not checked"


def _err(x):
    return "-" if x is None else f"{x:.2e}"


def format_inference_table(records):
    """The inference records as text: a table for decoding, one for packed batches (each
    present when there are records of it), one line a record; why a baseline has no time,
    and how it was measured, numbered under them."""
    notes = []

    def numbered(note):
        if note is None:
            return ""
        if note not in notes:
            notes.append(note)
        return f" [{notes.index(note) + 1}]"

    def met(r):
        return {True: "yes", False: "NO", None: "-"}[r["met"]]

    def inverse(r):
        return None if r["ratio"] is None else 1 / r["ratio"]
    out = []
    decode = [r for r in records if r["part"] == "decode"]
    if decode:
        head = ("case", "B,Hq,Hk,Sq,S_max,d", "dtype", "splits", "ms", "GB/s", "baseline",
                "baseline ms", "baseline GB/s", "1/ratio", "target", "met", "max err",
                "bound", "status")
        rows = [(r["case"], f"{r['B']},{r['Hq']},{r['Hkv']},{r['Sq']},{r['N']},{r['d']}",
                 r["dtype"], r["splits"], _cell(r["ms"]), _cell(r["gbs"], 1),
                 r["baseline"] + numbered(r["baseline_note"]) + numbered(r["baseline_detail"]),
                 _cell(r["baseline_ms"]), _cell(r["baseline_gbs"], 1), _cell(inverse(r)),
                 r["target"] or "-", met(r), _err(r["max_err"]), _err(r["bound"]), _status(r))
                for r in decode]
        out.append("Decoding against a KV cache (attention_with_kvcache; GB/s = K and V bytes "
                   "read / time)")
        out += aligned_rows(head, rows, numeric={3, 4, 5, 7, 8, 9, 12, 13})
    packed = [r for r in records if r["part"] == "packed"]
    if packed:
        if out:
            out.append("")
        head = ("case", "dtype", "pass", "ms", "baseline", "baseline ms", "1/ratio", "target",
                "met", "q,k,v,out packed", "padded", "max err", "bound", "status")
        rows = [(r["case"], r["dtype"], r["what"], _cell(r["ms"]),
                 r["baseline"] + numbered(r["baseline_note"]), _cell(r["baseline_ms"]),
                 _cell(inverse(r)), r["target"] or "-", met(r), _size(r["packed_bytes"]),
                 _size(r["padded_bytes"]), _err(r["max_err"]), _err(r["bound"]), _status(r))
                for r in packed]
        first = packed[0]
        out.append(f"Packed batches (attention_varlen and its backward): {first['B']} "
                   f"sequences of {min(first['lengths'])}..{max(first['lengths'])} tokens "
                   f"(total {first['total']}, padded to {first['N']}), {first['Hq']} heads; "
                   f"against the same batch padded, with a bool attn_mask")
        out += aligned_rows(head, rows, numeric={3, 5, 6, 9, 10, 11, 12})
    out += [f"[{i}] {n}" for i, n in enumerate(notes, 1)]
    if any(r["timer"] and r["timer"].startswith("simulator") for r in records):
        out.append(f"NOTE: {SIMULATOR_WARNING}.")
    if any(r["target"] and r["ratio"] is not None and r["met"] is None for r in records):
        out.append("met: '-' where not judged: the targets are about GPU times at the "
                   "targets' shapes.")
    out.append("ratio = numbaflash time / baseline time; 1/ratio: decoding, numbaflash's "
               "bandwidth over the baseline's; packed, how many times faster packed is. "
               "Checked: numbaflash (and the padded baseline), against numbaflash.reference "
               "in float64.")
    return "\n".join(out)


def wrong_inference(records):
    """The records whose numbaflash result, or padded baseline, disagreed with the
    reference (``ok`` or ``baseline_ok`` False)."""
    return [r for r in records if r["ok"] is False or r["baseline_ok"] is False]


__all__ = ["run_inference", "format_inference_table", "wrong_inference", "hbm_copy",
           "padding_mask",
           "DECODE_SHAPES", "PACKED", "HBM_COPY_BYTES", "DECODE_TARGETS", "PACKED_TARGETS",
           "INFERENCE_PARTS", "INFERENCE_DTYPES", "PACKED_PASSES", "RECORD_KEYS"]
