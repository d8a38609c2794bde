"""``bench --inference``, its decode part: ``attention_with_kvcache`` checked, then timed
against PyTorch SDPA and the HBM copy (inference.py runs it).

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
   once. Both numbaflash and SDPA are timed two ways: each call alone
   (``timing.time_ms``: ``ms``, ``baseline_ms``), and calls queued back to back as a
   decoding loop runs them (``timing.time_ms_queued``: ``ms_queued``,
   ``baseline_ms_queued``), where the host's work for a call overlaps the GPU's for the
   one before.
3. Compare. Bandwidth = the bytes of K and V read / time. The HBM copy's ``baseline_ms``
   is the time its bandwidth takes for those bytes, so against either baseline 1/ratio
   is numbaflash's bandwidth over the baseline's. Targets, judged on the calls timed
   alone: 1/ratio >= 0.8 against SDPA; 1/ratio >= 0.5 against the HBM copy in float16
   (float32: shown, no target). The queued times' 1/ratio is shown beside them.
"""

import warnings

import numpy as np
from numba import cuda

from .inference_checks import (_checks, _host, _inference_api, _measure, _on_host,
                               _random, _record, _references, _size)
from .library import explain_kvcache
from .timing import time_ms, time_ms_queued
from .variants import _cell, _first_line, target_met

# (B, Hq, Hk, Sq, S_max, d): the decode shapes of docs/kvcache.md's targets on a GPU
# (batch 8 at 32K keys, batch 1 at 128K; without and with GQA), and the same structure
# on the simulator (GQA with two K/V heads and batch 2; one K/V head per query head).
DECODE_SHAPES = {
    "gpu": ((8, 32, 32, 1, 32768, 128), (8, 32, 8, 1, 32768, 128),
            (1, 32, 32, 1, 131072, 128), (1, 32, 8, 1, 131072, 128)),
    "simulator": ((2, 4, 2, 1, 48, 16), (1, 4, 4, 1, 64, 16)),
}

# The HBM copy: bytes copied device to device (4 GiB, as scripts/decode_gpu.py copies).
HBM_COPY_BYTES = {"gpu": 2**32, "simulator": 2**12}

# Targets, on ratio = numbaflash ms / baseline ms (target_met reads them).
DECODE_TARGETS = {"sdpa": "1/ratio >= 0.8",
                  "hbm": {"float16": "1/ratio >= 0.5", "float32": None}}

HBM_BASELINE = "HBM copy"


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
    """``(ms, ms_queued, detail)``: PyTorch SDPA on the decode tensors as
    scripts/decode_gpu.py times it: as a user calls it (its own backend choice), and on
    the fused backend of the dtype (FLASH for float16, EFFICIENT for float32) where that
    backend takes the call; with ``enable_gqa`` when the caches have fewer heads. ms is
    the faster of the two, each call timed alone; ms_queued, that one's calls queued
    back to back (``timing.time_ms_queued``)."""
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
        use_fused = fused_ms is not None and fused_ms < default_ms
        if use_fused:
            with sdpa_kernel(fused):
                queued_ms = time_ms_queued(sdpa, repeats, warmup=warmup)
        else:
            queued_ms = time_ms_queued(sdpa, repeats, warmup=warmup)
    how = f"{fused.name} {fused_ms:.3f} ms" if fused_ms is not None else \
        f"{fused.name} refuses the call"
    detail = (f"SDPA as called (default) {default_ms:.3f} ms, {how}: the faster is the "
              f"baseline; queued {queued_ms:.3f} ms a call")
    return (fused_ms if use_fused else default_ms), queued_ms, detail


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
    ms_queued = time_ms_queued(fn, repeats, warmup=warmup) if ours["ms"] else None
    name = f"decode, batch {B}, " + ("MHA" if Hq == Hk else f"GQA {Hq // Hk}:1")
    fused = "FLASH" if dtype == "float16" else "EFFICIENT"
    records = []
    for baseline in ("sdpa", "hbm"):
        label = f"SDPA (best of default, {fused})" if baseline == "sdpa" else HBM_BASELINE
        bar.step(f"decode {shape} ({dtype}) vs {label}")
        base_ms = base_queued = base_gbs = note = detail = None
        if ours["ms"] is not None:             # nothing to compare otherwise
            if baseline == "hbm":
                copy_ms, base_gbs = hbm()
                base_ms = base_queued = data.kv_bytes / (base_gbs * 1e6)
                detail = (f"a device-to-device copy of {_size(HBM_COPY_BYTES[size])}: "
                          f"{copy_ms:.3f} ms, {_cell(base_gbs, 0)} GB/s read + written; baseline "
                          f"ms = the K and V bytes at that bandwidth")
            elif sdpa_note:
                note = sdpa_note
            else:
                try:
                    t = data.arrays
                    base_ms, base_queued, detail = _sdpa_decode(
                        torch, t["q"], t["k_cache"], t["v_cache"], dtype, repeats, warmup)
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
            baseline_gbs=base_gbs, ms_queued=ms_queued, baseline_ms_queued=base_queued,
            **ours))
    return records
