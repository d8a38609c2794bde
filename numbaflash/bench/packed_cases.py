"""``bench --inference``, its packed part: ``attention_varlen`` and its backward checked,
then timed against the same batch padded and run with a mask (inference.py runs it).

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
"""

import numpy as np

from .inference_checks import (_checks, _host, _inference_api, _measure, _on_device,
                               _on_host, _random, _record, _references)
from .library import check_varlen_inputs, explain_varlen, plan_backward
from .runner import _api, _worst
from .timing import time_ms
from .variants import _first_line, target_met

PACKED_PASSES = ("forward", "fwd+bwd")
# The packed batches: how many sequences, their lengths' range (drawn uniformly in it,
# both ends included, by numpy's default_rng(LENGTH_SEED)), heads, head dims.
# On the simulator the lengths drawn are 14, 11 and 9: each crosses the simulator's tile
# boundary at 8 keys (longer ones cost another tile row and column of simulated blocks).
PACKED = {
    "gpu": dict(sequences=64, lengths=(128, 4096), heads=16, dims=(64, 128)),
    "simulator": dict(sequences=3, lengths=(1, 16), heads=2, dims=(8,)),
}
LENGTH_SEED = 0

# Targets, on ratio = numbaflash ms / baseline ms (target_met reads them).
PACKED_TARGETS = {"forward": None, "fwd+bwd": "1/ratio >= 1.5"}

PADDED_BASELINE = "numbaflash padded + bool mask"
SDPA_PADDED_BASELINE = "SDPA padded + bool mask"


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
