"""The PyTorch side (optional, imported only when it is there and needed): SDPA's masks
and backends, float64 references from SDPA MATH (``TorchOracle``), and the timing of
SDPA EFFICIENT and MATH (and FLASH for float16) on the same inputs as numbaflash
(``_bench_sdpa``).

The functions take the ``torch`` module as an argument (``_torch_cuda()`` returns it, or
None where there is no PyTorch with CUDA), so importing this module does not import it.
"""

import math
from contextlib import contextmanager, nullcontext

import numpy as np

from .agreement import MULT, _agreement, _lse_agreement
from .cases import _base_record, sdpa_impls
from .library import masks, simulating
from .timing import _nbytes, _timer_name, time_ms


def _torch_cuda():
    """The torch module when PyTorch is importable and sees a CUDA GPU, else None."""
    if simulating():
        return None
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


@contextmanager
def _tf32_off(torch):
    """Plain float32 matrix products in PyTorch (no TF32) inside the block."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def sdpa_mask(torch, Sq, Sk, causal, device):
    """``(attn_mask, is_causal)`` for PyTorch SDPA matching numbaflash's ``causal=True``.

    numbaflash's causal mask is bottom-right aligned; SDPA's ``is_causal`` is top-left.
    For Sq == Sk they are the same mask, so SDPA gets ``is_causal=True`` (its fast path);
    otherwise an explicit boolean (Sq, Sk) mask.
    """
    if not causal:
        return None, False
    if Sq == Sk:
        return None, True
    return torch.from_numpy(masks.visible(Sq, Sk, "bottom_right")).to(device), False


def _sdpa_backend(torch, name):
    from torch.nn.attention import SDPBackend
    return {"efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH,
            "flash": SDPBackend.FLASH_ATTENTION}[name]


def torch_extra_memory_bytes(torch, fn):
    """Like ``extra_memory_bytes`` for PyTorch calls: peak of PyTorch's allocator during
    ``fn()`` above what was allocated before, minus the returned tensors."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    result = fn()
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated() - before - _nbytes(result))


def torch_references(torch, q, k, v, dout, causal, compute_dtype, backward,
                     chunk_bytes=2**31):
    """out and lse (and dq, dk, dv) by PyTorch in ``compute_dtype``, as float64 tensors.

    out and the gradients come from SDPA's MATH backend; lse (which SDPA does not return)
    is torch.logsumexp over keys of the scaled, masked scores, computed the same way.
    q, k, v, dout are torch tensors (B, H, S, d) on any device; causal None or a mode
    name. Rows that see no key are left out of PyTorch's computation (its MATH backend
    gives NaN there) and get out 0 and lse -inf, as numbaflash gives. Batch and heads are
    flattened and done a few at a time, so the N x N score matrices (and their gradients)
    of one chunk stay near ``chunk_bytes``: at N = 16384 one head's float64 scores take
    2 GiB. Returns a dict of (BH, S, d) float64 tensors, and lse (BH, Sq).
    """
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    B, H, Sq, d = q.shape
    Sk = k.shape[-2]
    BH = B * H
    device = q.device
    visible = masks.visible(Sq, Sk, causal)
    seen_np = visible.any(axis=1)                     # rows that see at least one key
    seen = torch.from_numpy(seen_np).to(device)
    mask = None if causal is None else torch.from_numpy(visible[seen_np]).to(device)
    Q, K, V, dO = (t.reshape(BH, -1, d) for t in (q, k, v, dout))

    f64 = torch.float64
    res = {"out": torch.zeros(BH, Sq, d, dtype=f64, device=device),
           "lse": torch.full((BH, Sq), -math.inf, dtype=f64, device=device)}
    if backward:
        res["dq"] = torch.zeros(BH, Sq, d, dtype=f64, device=device)
        res["dk"] = torch.zeros(BH, Sk, d, dtype=f64, device=device)
        res["dv"] = torch.zeros(BH, Sk, d, dtype=f64, device=device)
    per_head = 4 * Sq * Sk * 8                        # S, P, dP, dS of one head in float64
    chunk = max(1, chunk_bytes // per_head)
    for s in range(0, BH, chunk):
        c = slice(s, s + chunk)
        qc = Q[c][:, seen].to(compute_dtype)          # a new leaf tensor (indexing copies)
        kc, vc = (X[c].to(compute_dtype).clone() for X in (K, V))
        grad = torch.enable_grad() if backward else torch.no_grad()
        with grad, sdpa_kernel(_sdpa_backend(torch, "math")):
            if backward:
                for t in (qc, kc, vc):
                    t.requires_grad_()
            o = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=mask)
            res["out"][c, seen] = o.detach().to(f64)
            if backward:
                doc = dO[c][:, seen].to(compute_dtype)
                dq, dk, dv = torch.autograd.grad(o, (qc, kc, vc), doc)
                res["dq"][c, seen] = dq.to(f64)
                res["dk"][c] = dk.to(f64)
                res["dv"][c] = dv.to(f64)
        with torch.no_grad():
            # lse = log sum_j exp(S_ij), S = scale * Q K^T masked (SDPA's default scale).
            # After the gradients, so this chunk's N x N scores are not held twice.
            s = (qc @ kc.transpose(-2, -1)) * (1.0 / math.sqrt(d))
            if mask is not None:
                s = s.masked_fill(~mask, -math.inf)
            res["lse"][c, seen] = torch.logsumexp(s, dim=-1).to(f64)
        del qc, kc, vc, o, s
    return res


class TorchOracle:
    """float64 references from PyTorch SDPA MATH on the whole tensors (the check on a GPU
    with PyTorch). The naive baseline is SDPA MATH in the inputs' dtype with TF32 off."""

    where = "PyTorch SDPA MATH float64 (baseline: MATH in the dtype, TF32 off)"

    def __init__(self, torch, q, k, v, dout, causal, dtype, backward):
        """q, k, v, dout: torch tensors (B, H, S, d) in ``dtype``; causal: None or a mode."""
        self.torch = torch
        self.dtype = np.dtype(dtype)
        Sq, Sk = q.shape[-2], k.shape[-2]
        zero = ~masks.visible(Sq, Sk, causal).any(axis=1)
        self.zero_rows = torch.from_numpy(zero).to(q.device)
        self.ref = torch_references(torch, q, k, v, dout, causal, torch.float64, backward)
        self.base = {}
        if self.dtype != np.float64:
            with _tf32_off(torch):
                self.base = torch_references(torch, q, k, v, dout, causal, q.dtype, backward)
        if q.is_cuda:
            torch.cuda.empty_cache()      # hand the N x N temporaries back to the driver

    def check(self, name, got):
        """Check numbaflash's ``name`` ("out", "lse", "dq", "dk", "dv"), a device array
        (B, H, S, d), or (B, H, Sq) for lse."""
        ref = self.ref[name]
        got = self.torch.as_tensor(got, device=ref.device).reshape(ref.shape).to(ref.dtype)
        if name == "lse":
            return _lse_agreement(got, ref, self.base.get(name), self.dtype, self.zero_rows)
        zero = self.zero_rows if name in ("out", "dq") else None
        return _agreement(got, ref, self.base.get(name), self.dtype, MULT[name], zero)


def _bench_sdpa(torch, shape, causal, dtype, passes, tensors, repeats, warmup, progress):
    """Records of PyTorch SDPA (EFFICIENT, MATH with TF32 off, and FLASH for float16) for
    one case.

    A backend that cannot run the case (EFFICIENT has no float64 kernel; FLASH takes no
    explicit mask; MATH can run out of memory at long sequences) gets a record with
    ``ms: None`` and the error as its note.
    SDPA is the baseline: its results are not checked (``ok: None``).
    """
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    B, H, Sq, Sk, d = shape
    q, k, v, dout = tensors["q"], tensors["k"], tensors["v"], tensors["dout"]
    mask, is_causal = sdpa_mask(torch, Sq, Sk, causal, q.device)
    # The same memory, marked as needing gradients (detach shares the storage: no copy).
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

    def sdpa(a, b, c):
        return F.scaled_dot_product_attention(a, b, c, attn_mask=mask, is_causal=is_causal)

    records = []
    for impl in sdpa_impls(dtype):
        name = impl.split("_")[1]
        tf32 = _tf32_off(torch) if name == "math" else nullcontext()
        with tf32, sdpa_kernel(_sdpa_backend(torch, name)):
            for what in passes:
                rec = _base_record(shape, causal, dtype, what, impl)
                records.append(rec)
                progress.step(f"{what:8s} {shape} causal={causal} {dtype} {impl}")
                rec["kernel"] = {"efficient": "EFFICIENT_ATTENTION", "math": "MATH (TF32 off)",
                                 "flash": "FLASH_ATTENTION"}[name] + (
                                     ", explicit bottom-right mask" if mask is not None else "")
                o = None
                try:
                    if what == "forward":
                        def fn():
                            with torch.no_grad():
                                return sdpa(q, k, v)
                    elif what == "backward":
                        o = sdpa(qg, kg, vg)

                        def fn():
                            return torch.autograd.grad(o, (qg, kg, vg), dout, retain_graph=True)
                    else:
                        def fn():
                            return torch.autograd.grad(sdpa(qg, kg, vg), (qg, kg, vg), dout)
                    fn()
                    rec.update(ms=time_ms(fn, repeats, warmup), timer=_timer_name(),
                               repeats=repeats, warmup=warmup)
                    rec["extra_mib"] = torch_extra_memory_bytes(torch, fn) / 2**20
                except Exception as e:         # noqa: BLE001 - recorded, not hidden
                    message = str(e).strip().splitlines()[0] if str(e).strip() else ""
                    rec.update(ms=None, note=f"not run: {type(e).__name__}: {message[:200]}")
                finally:
                    del o
                    torch.cuda.empty_cache()
    return records
