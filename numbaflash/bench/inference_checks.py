"""What both parts of ``bench --inference`` share (inference.py runs them,
decode_cases.py and packed_cases.py hold them): the float64 references of one slice, the
bench's rule applied to them, the check-then-time of one call, the inputs on the device or the host, bytes as text,
and the records' keys."""

import sys

import numpy as np
from numba import cuda

from .agreement import MULT, _agreement, _lse_agreement
from .library import reference
from .runner import _worst
from .timing import _timer_name, time_ms

RECORD_KEYS = (
    "part", "case", "options", "B", "Hq", "Hkv", "Sq", "N", "d", "causal", "dtype", "what",
    "kernel", "ms", "baseline", "baseline_ms", "ratio", "target", "met", "ok", "max_err",
    "bound", "check", "checked_against", "timer", "repeats", "warmup", "note",
    "baseline_ok", "baseline_note", "baseline_detail",
    # decode
    "splits", "kv_bytes", "gbs", "baseline_gbs", "ms_queued", "baseline_ms_queued",
    # packed
    "lengths", "total", "packed_bytes", "padded_bytes", "mask_bytes")


def _inference_api(name):
    """The call ``name`` as the package ``numbaflash.bench`` holds it, looked up at call
    time (as runner._api does): a test that replaces ``numbaflash.bench.attention_varlen``
    replaces what is checked and timed."""
    return getattr(sys.modules[__package__], name)

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


def _size(n):
    """Bytes as text: "512 B", "12.3 KiB", "2.0 GiB"."""
    if n is None:
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
