"""Benchmark numbaflash against PyTorch SDPA: check first, then time, count, and compare.

    python -m numbaflash bench                                  # issue 5's three shapes
    python -m numbaflash bench --shapes 2x16x4096x64 --causal yes --versions v2,v3 \\
        --json bench.json --plot bench.png

For every shape, causal mode and dtype, ``run`` does, in this order:

1. Inputs. Random normal q, k, v and dout on the device: made by ``torch.randn`` when
   PyTorch with CUDA is there (numbaflash sees the very same memory through
   ``numba.cuda.as_cuda_array``, no copy), otherwise by NumPy and copied once.
2. Check. Each numbaflash pass is run once on those inputs and its results (out and
   lse, dq, dk, dv) are compared with a float64 reference before any time is taken
   (``check``), so a fast but wrong kernel never reports a number: its record says
   ``ok: False`` with ``ms: None``.
   With PyTorch: against SDPA's MATH backend in float64 on the whole tensors. Without it:
   against ``numbaflash.reference`` in float64 on the first (batch, head) slice only
   (dense NumPy is slow). The bound is TESTING.md's rule (see ``agreement_bound``).
3. Time. Median of ``repeats`` runs after ``warmup`` runs, each between two CUDA events
   (``time_ms``). A run is one call of the public API on device arrays, as a user makes
   it: launch overhead and output allocation included, host copies excluded.
4. Count. TFLOP/s by the convention of flash-attention's benchmarks (``flops``), and the
   device memory a call takes beyond its outputs (``extra_memory_bytes``).
5. Compare. PyTorch SDPA on the same inputs in the same process: the EFFICIENT backend
   (the ratio ``vs_sdpa`` = SDPA EFFICIENT time / our time: above 1 means faster than
   SDPA) and the MATH backend with TF32 off (plain float32 arithmetic, N x N memory).

Under the CUDA simulator (NUMBA_ENABLE_CUDASIM=1) everything runs, checks included, but
the times measure Python executing the simulated threads, not a GPU: they say nothing
about speed. Every record notes which timer it used.

Records are plain dicts (one per shape, causal, dtype, pass and implementation), ready
for JSON; ``format_table``, ``save_json`` and ``plot`` present them.
"""

import datetime
import importlib.metadata
import json
import math
import platform
import statistics
import sys
import time
from contextlib import contextmanager, nullcontext

import numpy as np
from numba import cuda

from .. import masks, reference
from ..api import attention, attention_backward, explain, explain_backward
from ..dispatch import backend
from ..kernels import simulating
from ..kernels.forward import VERSIONS as FORWARD_VERSIONS

PASSES = ("forward", "backward", "fwd+bwd")
DTYPES = ("float16", "float32", "float64")
SDPA_IMPLS = ("sdpa_efficient", "sdpa_math")

# FLOPs of a pass, in units of the forward's (PERFORMANCE.md): the backward does 2.5x the
# forward's matrix products (five N x N x d products against two).
PASS_FLOP_FACTOR = {"forward": 1.0, "backward": 2.5, "fwd+bwd": 3.5}

# Issue 5's table: what the command times on a GPU when no --shapes are given.
GPU_DEFAULT_SHAPES = ((2, 16, 4096, 64), (2, 16, 4096, 128), (1, 16, 16384, 64))
# Under the simulator: one tiny problem (a simulated thread costs about 150 us).
SIM_DEFAULT_SHAPES = ((1, 1, 32, 8),)

# Agreement rule (TESTING.md): max|ours - ref64| <= mult * max|base - ref64| + 2 spacing.
MULT = {"out": 2, "lse": 2, "dq": 5, "dk": 3, "dv": 3}
FLOAT64_RTOL = 1e-12      # float64 results: within 1e-12 of max(1, max|ref|)
FLOAT32_FLOOR = 1e-5      # float32: never stricter than 1e-5 x max|ref| (TESTING.md's fallback)

SIMULATOR_WARNING = ("times under the CUDA simulator measure Python running the simulated "
                     "threads on the CPU, not a GPU: they say nothing about speed")


# ---------------------------------------------------------------------------------------
# Counting and timing


def flops(B, H, Sq, Sk, d, causal, what):
    """Floating-point operations of one pass, by flash-attention's benchmark convention.

    forward = 4 * B * H * Sq * Sk * d (two matrix products of 2 * Sq * Sk * d each);
    causal with Sq == Sk counts half (the convention's N^2 / 2, not N (N + 1) / 2);
    causal with Sq != Sk counts the visible (query, key) pairs of the bottom-right mask
    instead of Sq * Sk. backward = 2.5 x forward, fwd+bwd ("forward + backward") = 3.5 x.

    >>> flops(2, 16, 4096, 4096, 64, False, "forward")
    137438953472.0
    """
    if what not in PASS_FLOP_FACTOR:
        raise ValueError(f"what must be one of {PASSES}; got {what!r}")
    pairs = float(Sq) * float(Sk)
    if causal:
        if Sq == Sk:
            pairs /= 2
        else:
            # Row r sees keys 0 .. r + Sk - Sq (bottom-right), clipped to [0, Sk].
            pairs = float(np.clip(np.arange(Sq) + (Sk - Sq) + 1, 0, Sk).sum())
    return PASS_FLOP_FACTOR[what] * 4.0 * B * H * pairs * d


def time_ms(fn, repeats=20, warmup=3):
    """Median milliseconds of ``fn()`` over ``repeats`` runs, after ``warmup`` runs.

    On a GPU each run sits between two CUDA events recorded on the default stream (where
    numbaflash and PyTorch both launch unless told otherwise), so the time is the GPU's,
    from the first launch to the last, plus any launch overhead in between. Under the
    simulator there are no event times (Numba returns -1), so ``time.perf_counter`` is
    used: it measures Python, not a GPU.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0; got {repeats}, {warmup}")
    for _ in range(warmup):
        fn()
    cuda.synchronize()
    times = []
    if simulating():
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    start, end = cuda.event(), cuda.event()
    for _ in range(repeats):
        start.record()
        fn()
        end.record()
        end.synchronize()          # wait until the GPU has passed the end event
        times.append(cuda.event_elapsed_time(start, end))
    return statistics.median(times)


def _nbytes(result):
    """Bytes of the arrays in ``result`` (an array, or a tuple/list of them)."""
    if isinstance(result, (tuple, list)):
        return sum(_nbytes(r) for r in result)
    if hasattr(result, "nbytes"):
        return int(result.nbytes)
    if hasattr(result, "element_size"):                 # a torch tensor
        return int(result.element_size() * result.numel())
    return 0


def extra_memory_bytes(fn):
    """Device memory one call of ``fn()`` takes beyond the arrays it returns, in bytes.

    Reads the driver's free memory before and after the call, with deallocation deferred
    (``cuda.defer_cleanup``) so nothing the call allocates is freed before the second
    reading; whatever the call returns (its outputs) is subtracted. The driver hands out
    memory in pages, so small amounts read as 0 or a page (about 2 MiB). This sees
    memory that Numba allocates; PyTorch's caching allocator needs
    ``torch_extra_memory_bytes``. Returns None under the simulator, which has no device
    memory to read.
    """
    if simulating():
        return None
    cuda.synchronize()
    ctx = cuda.current_context()
    ctx.deallocations.clear()                 # free what earlier calls left pending first
    with cuda.defer_cleanup():
        free_before = ctx.get_memory_info().free
        result = fn()
        cuda.synchronize()
        free_after = ctx.get_memory_info().free
    return int(free_before - free_after - _nbytes(result))


# ---------------------------------------------------------------------------------------
# PyTorch (optional): imported only when it is there and needed.


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
    return {"efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[name]


def torch_extra_memory_bytes(torch, fn):
    """Like ``extra_memory_bytes`` for PyTorch calls: peak of PyTorch's allocator during
    ``fn()`` above what was allocated before, minus the returned tensors."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    result = fn()
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated() - before - _nbytes(result))


# ---------------------------------------------------------------------------------------
# Agreement


def agreement_bound(base_err, max_ref, dtype, mult):
    """The largest error of a correct result, by TESTING.md's rule.

    ``base_err`` is the error of a naive computation in ``dtype`` (PyTorch's MATH backend
    with TF32 off, or the NumPy reference in that dtype) against the float64 reference;
    ``max_ref`` is max|reference|:

        bound = mult * base_err + 2 * spacing(max_ref)        (spacing in ``dtype``)

    float64: FLOAT64_RTOL * max(1, max_ref) instead. float32: never below FLOAT32_FLOOR *
    max_ref, TESTING.md's absolute fallback (on tiny problems the naive baseline can be
    exact by luck, and tests/backward_checks.py shows correct gradients over the bare rule
    there). A wrong kernel (1% off, say) is far above either.
    """
    dtype = np.dtype(dtype)
    if dtype == np.float64:
        return FLOAT64_RTOL * max(1.0, max_ref)
    bound = mult * base_err + 2 * float(np.spacing(dtype.type(max_ref)))
    if dtype == np.float32:
        bound = max(bound, FLOAT32_FLOOR * max_ref)
    return float(bound)


def _agreement(got, ref, base, dtype, mult, zero_rows):
    """One tensor's check: ``{"max_err", "bound", "ok"}``. Arrays are float64 (NumPy) or
    float64 torch tensors of one shape (..., S, d); ``zero_rows`` (boolean, (S,)) marks
    rows that must be exactly 0 (queries that see no key). With ``zero_rows`` None the
    arrays may have any (non-empty) shape."""
    err = float(abs(got - ref).max())           # NaN anywhere gives NaN: not <= bound
    max_ref = float(abs(ref).max())
    base_err = 0.0 if base is None else float(abs(base - ref).max())
    bound = agreement_bound(base_err, max_ref, dtype, mult)
    ok = err <= bound
    if zero_rows is not None and bool(zero_rows.any()):
        ok = ok and bool((got[..., zero_rows, :] == 0).all())
    return {"max_err": err, "bound": bound, "ok": bool(ok)}


def _lse_agreement(got, ref, base, dtype, masked_rows):
    """The check of lse, arrays of shape (..., S) as in ``_agreement``.

    Rows that see no key (``masked_rows``, boolean (S,)) must be exactly -inf, as in the
    reference (tests/tolerance.py compares them with array_equal); ``got - ref`` would be
    NaN there, so the rule (mult ``MULT["lse"]``) is applied to the other rows only.
    """
    exact = bool((got[..., masked_rows] == -math.inf).all())     # NaN there fails too
    seen = ~masked_rows
    if not bool(seen.any()):                  # no row sees a key: nothing to bound
        return {"max_err": 0.0, "bound": 0.0, "ok": exact}
    check = _agreement(got[..., seen], ref[..., seen], None if base is None else
                       base[..., seen], dtype, MULT["lse"], None)
    check["ok"] = check["ok"] and exact
    return check


class NumpyOracle:
    """float64 references from ``numbaflash.reference`` for the first (batch, head) slice.

    The check without PyTorch: dense NumPy over one slice is cheap, and a kernel that is
    wrong is almost always wrong there too. The naive baseline is the same reference
    computed in the inputs' dtype.
    """

    where = "numbaflash.reference float64, first (batch, head) slice"

    def __init__(self, q, k, v, dout, causal, dtype, backward):
        """q, k, v, dout: NumPy (B, H, S, d) in ``dtype``; causal: None or a mode name."""
        self.dtype = np.dtype(dtype)
        self.causal = causal
        q0, k0, v0, do0 = (np.asarray(a[0, 0]) for a in (q, k, v, dout))
        self.zero_rows = ~masks.visible(q0.shape[0], k0.shape[0], causal).any(axis=1)
        self.ref = dict(zip(("out", "lse"), reference.forward(q0, k0, v0, causal=causal)))
        self.base = {}
        naive = self.dtype != np.float64
        with np.errstate(all="ignore"):
            if naive:
                self.base.update(zip(("out", "lse"), reference.forward(
                    q0, k0, v0, causal=causal, dtype=self.dtype.type)))
            if backward:
                self.ref.update(zip(("dq", "dk", "dv"),
                                    reference.backward(do0, q0, k0, v0, causal=causal)))
                if naive:
                    self.base.update(zip(("dq", "dk", "dv"), reference.backward(
                        do0, q0, k0, v0, causal=causal, dtype=self.dtype.type)))

    def check(self, name, got):
        """Check numbaflash's ``name`` ("out", "lse", "dq", "dk", "dv"), a device array
        (B, H, S, d), or (B, H, Sq) for lse."""
        got0 = np.asarray(got[0, 0].copy_to_host(), dtype=np.float64)
        base = self.base.get(name)
        if base is not None:
            base = np.asarray(base, dtype=np.float64)
        if name == "lse":
            return _lse_agreement(got0, self.ref[name], base, self.dtype, self.zero_rows)
        zero = self.zero_rows if name in ("out", "dq") else None
        return _agreement(got0, self.ref[name], base, self.dtype, MULT[name], zero)


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


# ---------------------------------------------------------------------------------------
# Arguments


def parse_shape(text):
    """'2x16x4096x64' -> (2, 16, 4096, 64); 'BxHxSqxSkxd' for different lengths.

    Raises ValueError naming what is wrong."""
    parts = text.lower().split("x")
    try:
        numbers = tuple(int(p) for p in parts)
    except ValueError:
        raise ValueError(f"shape {text!r} is not numbers separated by 'x' (e.g. 2x16x4096x64 "
                         f"for B x H x N x d, or 1x8x1000x3000x64 for B x H x Sq x Sk x d)") from None
    return normalize_shape(numbers)


def normalize_shape(shape):
    """(B, H, N, d) or (B, H, Sq, Sk, d) -> (B, H, Sq, Sk, d); ValueError if malformed."""
    try:
        shape = tuple(shape)
    except TypeError:
        raise ValueError(f"a shape is a tuple (B, H, N, d) or (B, H, Sq, Sk, d); got "
                         f"{shape!r}") from None
    if len(shape) not in (4, 5):
        raise ValueError(f"a shape has 4 numbers (B, H, N, d) or 5 (B, H, Sq, Sk, d); got "
                         f"{len(shape)}: {shape!r}")
    if not all(isinstance(n, (int, np.integer)) and not isinstance(n, bool) for n in shape):
        raise ValueError(f"shape entries must be integers; got {shape!r}")
    if min(shape) < 1:
        raise ValueError(f"shape entries must be at least 1; got {shape!r}")
    if len(shape) == 4:
        B, H, N, d = shape
        shape = (B, H, N, N, d)
    return tuple(int(n) for n in shape)


def _check_arguments(shapes, causal, dtype, passes, versions, repeats, warmup):
    """Validate ``run``'s arguments before anything runs; ValueError says which is wrong."""
    if isinstance(shapes, (str, bytes)) or not hasattr(shapes, "__iter__"):
        raise ValueError(f"shapes must be a list of (B, H, N, d) or (B, H, Sq, Sk, d) tuples; "
                         f"got {shapes!r}")
    shapes = list(shapes)
    if shapes and all(isinstance(n, (int, np.integer)) for n in shapes):
        raise ValueError(f"shapes must be a list of shapes; got one shape {tuple(shapes)}: "
                         f"pass [{tuple(shapes)}]")
    shapes = [normalize_shape(s) for s in shapes]
    if not shapes:
        raise ValueError("shapes is empty: give at least one (B, H, N, d)")
    if isinstance(causal, bool):
        causal = (causal,)
    causal = tuple(causal)
    if not causal or not all(isinstance(c, bool) for c in causal):
        raise ValueError(f"causal must be a bool or a tuple of bools, e.g. (False, True); "
                         f"got {causal!r}")
    try:
        dtype_name = np.dtype(dtype).name
    except TypeError:
        dtype_name = None
    if dtype_name not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}; got {dtype!r}")
    dtype = dtype_name
    if isinstance(passes, str):
        passes = (passes,)
    passes = tuple(passes)
    bad = [p for p in passes if p not in PASSES]
    if bad or not passes:
        raise ValueError(f"passes must be a non-empty subset of {PASSES}; got {passes!r}")
    if versions is None or isinstance(versions, str):
        versions = (versions,)
    versions = tuple(versions)
    bad = [v for v in versions if v is not None and v not in FORWARD_VERSIONS]
    if bad or not versions:
        raise ValueError(f"versions must be forward versions {FORWARD_VERSIONS} or None (the "
                         f"default); got {versions!r}")
    for name, n, low in (("repeats", repeats, 1), ("warmup", warmup, 0)):
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < low:
            raise ValueError(f"{name} must be an integer >= {low}; got {n!r}")
    # Let numbaflash itself refuse what it cannot run (head dim, batch * heads), by shape.
    for B, H, Sq, Sk, d in shapes:
        q = _Spec((B, H, Sq, d), dtype)
        kv = _Spec((B, H, Sk, d), dtype)
        try:
            explain(q, kv, kv)
        except (ValueError, TypeError) as e:
            raise ValueError(f"shape {(B, H, Sq, Sk, d)}: {e}") from None
    return shapes, causal, dtype, passes, versions


class _Spec:
    """Something with a shape and a dtype: enough for ``numbaflash.explain``."""

    def __init__(self, shape, dtype):
        self.shape, self.dtype = shape, np.dtype(dtype)


# ---------------------------------------------------------------------------------------
# The benchmark


def _impl_name(version):
    return "numbaflash" if version is None else f"numbaflash_{version}"


def _base_record(shape, causal, dtype, what, impl):
    B, H, Sq, Sk, d = shape
    return {"B": B, "H": H, "Sq": Sq, "Sk": Sk, "d": d, "causal": causal, "dtype": dtype,
            "what": what, "impl": impl, "kernel": None, "ms": None, "tflops": None,
            "vs_sdpa": None, "extra_mib": None, "max_err": None, "bound": None, "ok": None,
            "checked_against": None, "check": None, "timer": None, "repeats": None,
            "warmup": None, "note": None}


def _worst(checks):
    """The check with the largest error relative to its bound (the one to report)."""
    def ratio(c):
        if not c["ok"] or math.isnan(c["max_err"]):
            return math.inf
        return c["max_err"] / c["bound"] if c["bound"] > 0 else 0.0
    return max(checks.values(), key=ratio)


class _Progress:
    """One line per timing on stderr: '[3/18] 12.1 s  forward (1, 1, 32, 32, 8) ...'."""

    def __init__(self, total, enabled):
        self.total, self.enabled, self.done, self.t0 = total, enabled, 0, time.perf_counter()

    def step(self, text):
        self.done += 1
        if self.enabled:
            print(f"bench [{self.done}/{self.total}] {time.perf_counter() - self.t0:7.1f} s  "
                  f"{text}", file=sys.stderr, flush=True)


def _timer_name():
    return ("simulator: Python wall time (not a GPU)" if simulating()
            else "CUDA events (numba), median")


def _measure(rec, fn, outputs_to_check, oracle, repeats, warmup, memory=True):
    """Run ``fn`` once and check it; only if it agrees, time it and read its memory.

    ``outputs_to_check(result)`` maps fn's result to {"out": array, "dq": ...}.
    Fills ``rec`` in place.
    """
    result = fn()                              # the first call also compiles the kernels
    if oracle is not None:
        checks = {name: oracle.check(name, a) for name, a in outputs_to_check(result).items()}
        worst = _worst(checks)
        rec.update(check=checks, max_err=worst["max_err"], bound=worst["bound"],
                   ok=all(c["ok"] for c in checks.values()), checked_against=oracle.where)
        if not rec["ok"]:
            return                             # a wrong result gets no time
    del result
    rec.update(ms=time_ms(fn, repeats, warmup), timer=_timer_name(), repeats=repeats,
               warmup=warmup)
    if memory:
        extra = extra_memory_bytes(fn)
        rec["extra_mib"] = None if extra is None else extra / 2**20


def _make_inputs(torch, shape, dtype, seed):
    """Random normal q, k, v, dout (B, H, S, d) in ``dtype``.

    Returns ``(host, tensors, device)``: host NumPy arrays (None with torch), torch
    tensors (None without torch), and numba device arrays of the same data (views of the
    tensors, no copy, when torch made them).
    """
    B, H, Sq, Sk, d = shape
    sizes = {"q": (B, H, Sq, d), "k": (B, H, Sk, d), "v": (B, H, Sk, d), "dout": (B, H, Sq, d)}
    if torch is not None:
        g = torch.Generator(device="cuda").manual_seed(seed)
        tdtype = getattr(torch, dtype)
        tensors = {n: torch.randn(s, device="cuda", dtype=tdtype, generator=g)
                   for n, s in sizes.items()}
        device = {n: cuda.as_cuda_array(t) for n, t in tensors.items()}
        return None, tensors, device
    rng = np.random.default_rng(seed)
    host = {n: rng.standard_normal(s).astype(dtype) for n, s in sizes.items()}
    device = {n: cuda.to_device(a) for n, a in host.items()}
    return host, None, device


def _api():
    """``attention`` and ``attention_backward`` as the package ``numbaflash.bench`` holds
    them, looked up at call time: a test that replaces ``numbaflash.bench.attention`` with
    a wrong stand-in replaces what is checked and timed."""
    package = sys.modules[__package__]
    return package.attention, package.attention_backward


def _bench_numbaflash(shape, causal, dtype, passes, versions, oracle, dev, repeats, warmup,
                      progress):
    """Records of numbaflash's passes for one case (see ``run``)."""
    attention, attention_backward = _api()
    mode = "bottom_right" if causal else None
    q, k, v, dout = dev["q"], dev["k"], dev["v"], dev["dout"]
    records = []
    try:
        backward_kernels = "+".join(p.kernel for p in explain_backward(q, k, v, causal=mode))
    except ValueError as e:
        backward_kernels, backward_refusal = None, str(e)
    else:
        backward_refusal = None

    for version in versions:
        impl = _impl_name(version)
        try:
            forward_kernel = explain(q, k, v, causal=mode, version=version).kernel
            refusal = None
        except ValueError as e:                # e.g. v3 on the simulator or in float64
            forward_kernel, refusal = None, str(e)
        for what in ("forward", "fwd+bwd"):
            if what not in passes:
                continue
            rec = _base_record(shape, causal, dtype, what, impl)
            records.append(rec)
            progress.step(f"{what:8s} {shape} causal={causal} {dtype} {impl}")
            if refusal or (what == "fwd+bwd" and backward_refusal):
                rec["note"] = f"not run: {refusal or backward_refusal}"
                continue
            if what == "forward":
                rec["kernel"] = forward_kernel

                def fn(version=version):
                    return attention(q, k, v, causal=mode, version=version, return_lse=True)

                def outputs(r):
                    return {"out": r[0], "lse": r[1]}
            else:
                rec["kernel"] = f"{forward_kernel} + {backward_kernels}"

                def fn(version=version):
                    out, lse = attention(q, k, v, causal=mode, version=version, return_lse=True)
                    return (out, lse) + tuple(attention_backward(dout, q, k, v, out, lse,
                                                                 causal=mode))

                def outputs(r):
                    return {"out": r[0], "lse": r[1], "dq": r[2], "dk": r[3], "dv": r[4]}
            _measure(rec, fn, outputs, oracle, repeats, warmup)

    if "backward" in passes:
        # The backward does not depend on the forward's version: timed once, as
        # "numbaflash", from the default forward's out and lse.
        rec = _base_record(shape, causal, dtype, "backward", "numbaflash")
        records.append(rec)
        progress.step(f"backward {shape} causal={causal} {dtype} numbaflash")
        if backward_refusal:
            rec["note"] = f"not run: {backward_refusal}"
        else:
            rec["kernel"] = backward_kernels
            out, lse = attention(q, k, v, causal=mode, return_lse=True)

            def fn():
                return attention_backward(dout, q, k, v, out, lse, causal=mode)

            def outputs(r):
                return {"dq": r[0], "dk": r[1], "dv": r[2]}
            _measure(rec, fn, outputs, oracle, repeats, warmup)
    return records


def _bench_sdpa(torch, shape, causal, dtype, passes, tensors, repeats, warmup, progress):
    """Records of PyTorch SDPA (EFFICIENT, and MATH with TF32 off) for one case.

    A backend that cannot run the case (EFFICIENT has no float64 kernel; MATH can run out
    of memory at long sequences) gets a record with ``ms: None`` and the error as its note.
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
    for impl in SDPA_IMPLS:
        name = impl.split("_")[1]
        tf32 = _tf32_off(torch) if name == "math" else nullcontext()
        with tf32, sdpa_kernel(_sdpa_backend(torch, name)):
            for what in passes:
                rec = _base_record(shape, causal, dtype, what, impl)
                records.append(rec)
                progress.step(f"{what:8s} {shape} causal={causal} {dtype} {impl}")
                rec["kernel"] = ("EFFICIENT_ATTENTION" if name == "efficient" else
                                 "MATH (TF32 off)") + (", explicit bottom-right mask"
                                                       if mask is not None else "")
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


def _order(rec):
    """Sort key inside one case: pass, then numbaflash before SDPA."""
    impls = ["numbaflash"] + [_impl_name(v) for v in FORWARD_VERSIONS] + list(SDPA_IMPLS)
    return PASSES.index(rec["what"]), impls.index(rec["impl"])


def _fill_derived(records):
    """TFLOP/s, and the ratio to SDPA EFFICIENT of the same case and pass."""
    key = ("B", "H", "Sq", "Sk", "d", "causal", "dtype", "what")
    efficient = {tuple(r[k] for k in key): r["ms"] for r in records
                 if r["impl"] == "sdpa_efficient" and r["ms"] is not None}
    for r in records:
        if r["ms"] is None:
            continue
        work = flops(r["B"], r["H"], r["Sq"], r["Sk"], r["d"], r["causal"], r["what"])
        r["tflops"] = work / (r["ms"] * 1e-3) / 1e12
        eff = efficient.get(tuple(r[k] for k in key))
        if eff is not None:
            r["vs_sdpa"] = eff / r["ms"]


def run(shapes, *, causal=(False, True), dtype="float32", passes=PASSES, versions=(None,),
        repeats=20, warmup=3, sdpa=True, check=True, progress=True):
    """Check and time numbaflash (and PyTorch SDPA) on each shape; returns a list of records.

    Args:
        shapes: list of (B, H, N, d) or (B, H, Sq, Sk, d) tuples.
        causal: tuple of bools to run, e.g. (False, True). True is numbaflash's
            bottom-right ``causal=True`` (the same mask as SDPA's ``is_causal`` when Sq == Sk).
        dtype: "float16", "float32" or "float64".
        passes: any of "forward", "backward", "fwd+bwd".
        versions: forward versions to time; None is the library's default (impl
            "numbaflash"), "v1"/"v2"/"v3" time that version (impl "numbaflash_v2", ...).
            A version that cannot run a case (v3 on the simulator, in float64, or with
            d > 128) gets a record with a "not run: ..." note. The backward has one
            default version and is timed once per case, as "numbaflash".
        repeats, warmup: runs timed (median taken) and runs before them.
        sdpa: also time PyTorch SDPA EFFICIENT and MATH (when PyTorch with CUDA is there).
        check: compare with a float64 reference before timing (see the module docstring);
            switching it off leaves ``ok`` None.
        progress: a line per timing on stderr.

    Returns:
        One dict per (shape, causal, pass, implementation), in that order, with keys
        B, H, Sq, Sk, d, causal, dtype, what ("forward" | "backward" | "fwd+bwd"), impl,
        kernel (numbaflash's kernel names from ``explain``/``explain_backward``), ms
        (median, None if not timed), tflops, vs_sdpa (SDPA EFFICIENT ms / this ms),
        extra_mib (device memory beyond the outputs), max_err and bound (the worst
        tensor's), ok (True: agrees; False: WRONG, so not timed; None: not checked or not
        run), checked_against, check (per tensor), timer, repeats, warmup, note.

    Raises:
        ValueError: a bad argument, before anything runs.
        RuntimeError: neither a GPU nor the simulator.
    """
    shapes, causal, dtype, passes, versions = _check_arguments(
        shapes, causal, dtype, passes, versions, repeats, warmup)
    backend()                                 # RuntimeError now if there is no backend
    torch = _torch_cuda()
    with_sdpa = sdpa and torch is not None
    n_numbaflash = (len(versions) * sum(p in passes for p in ("forward", "fwd+bwd"))
                    + ("backward" in passes))
    per_case = n_numbaflash + (len(SDPA_IMPLS) * len(passes) if with_sdpa else 0)
    bar = _Progress(len(shapes) * len(causal) * per_case, progress)
    need_backward = "backward" in passes or "fwd+bwd" in passes

    records = []
    for index, shape in enumerate(shapes):
        host, tensors, dev = _make_inputs(torch, shape, dtype, seed=index)
        for c in causal:
            mode = "bottom_right" if c else None
            oracle = None
            if check:
                if torch is not None:
                    oracle = TorchOracle(torch, tensors["q"], tensors["k"], tensors["v"],
                                         tensors["dout"], mode, dtype, need_backward)
                else:
                    oracle = NumpyOracle(host["q"], host["k"], host["v"], host["dout"], mode,
                                         dtype, need_backward)
            case = _bench_numbaflash(shape, c, dtype, passes, versions, oracle, dev, repeats,
                                     warmup, bar)
            del oracle
            if with_sdpa:
                case += _bench_sdpa(torch, shape, c, dtype, passes, tensors, repeats, warmup,
                                    bar)
            records += sorted(case, key=_order)
        del host, tensors, dev
    _fill_derived(records)
    return records


def wrong_results(records):
    """The records whose check failed (``ok`` is False)."""
    return [r for r in records if r["ok"] is False]


# ---------------------------------------------------------------------------------------
# Presenting


def _status(r):
    if r["ok"] is False:
        return "WRONG RESULT, not timed"
    if r["note"] and r["ms"] is None:
        return "not run"
    if r["ok"] is None:
        return "baseline" if r["impl"] in SDPA_IMPLS else "not checked"
    return "ok"


def _number(x):
    """2 decimals for GPU-sized numbers, scientific for the simulator's tiny ones."""
    return f"{x:.2f}" if x >= 0.01 else f"{x:.1e}"


def format_table(records):
    """The records as a text table, one line each; notes (why something did not run)
    are numbered under it."""
    head = ("shape (B,H,Sq,Sk,d)", "causal", "dtype", "pass", "impl", "ms", "TFLOP/s",
            "vs SDPA", "extra MiB", "max err", "bound", "status", "kernel")
    rows, notes = [], []
    for r in records:
        status = _status(r)
        if r["note"] and r["ms"] is None:
            if r["note"] not in notes:           # the same reason is listed once
                notes.append(r["note"])
            status += f" [{notes.index(r['note']) + 1}]"
        rows.append((
            f"({r['B']},{r['H']},{r['Sq']},{r['Sk']},{r['d']})",
            "yes" if r["causal"] else "no", r["dtype"], r["what"], r["impl"],
            "-" if r["ms"] is None else f"{r['ms']:.3f}",
            "-" if r["tflops"] is None else _number(r["tflops"]),
            "-" if r["vs_sdpa"] is None else f"{r['vs_sdpa']:.3f}x",
            "-" if r["extra_mib"] is None else f"{r['extra_mib']:.1f}",
            "-" if r["max_err"] is None else f"{r['max_err']:.2e}",
            "-" if r["bound"] is None else f"{r['bound']:.2e}",
            status, r["kernel"] or "-"))
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    numeric = {5, 6, 7, 8, 9, 10}

    def line(cells):
        return "  ".join(str(c).rjust(w) if i in numeric else str(c).ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    out = [line(head), line("-" * w for w in widths)] + [line(row) for row in rows]
    out += [f"[{i}] {n}" for i, n in enumerate(notes, 1)]
    if any(r["timer"] and r["timer"].startswith("simulator") for r in records):
        out.append(f"NOTE: {SIMULATOR_WARNING}.")
    out.append("vs SDPA = SDPA EFFICIENT time / this time (>1 means faster than SDPA); "
               "TFLOP/s: forward 4*B*H*Sq*Sk*d, causal half, backward 2.5x, fwd+bwd 3.5x.")
    return "\n".join(out)


def _version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment():
    """What the numbers were measured on: date, backend, GPU, and package versions."""
    from .. import __version__
    try:
        where = backend()
    except RuntimeError:
        where = "none"
    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "backend": where, "gpu": None, "driver_cuda": None,
           "python": platform.python_version(), "numba": _version("numba"),
           "numba_cuda": _version("numba-cuda"), "numpy": np.__version__,
           "torch": _version("torch"), "numbaflash": __version__}
    if where == "simulator":
        env["gpu"] = "none (CUDA simulator, NUMBA_ENABLE_CUDASIM=1)"
    elif where == "gpu":
        name = cuda.get_current_device().name
        env["gpu"] = name.decode() if isinstance(name, bytes) else str(name)
        try:
            env["driver_cuda"] = ".".join(map(str, cuda.cudadrv.driver.driver.get_version()))
        except Exception:                      # noqa: BLE001 - informative only
            pass
    return env


def _json_safe(x):
    """NaN and inf are not JSON: write them as the strings "nan", "inf", "-inf"."""
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    if isinstance(x, (float, np.floating)):
        return float(x) if math.isfinite(x) else str(float(x))
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.bool_):
        return bool(x)
    return x


def save_json(records, path, meta=None):
    """Write ``{"meta": environment(), "records": records}`` to ``path`` as JSON."""
    data = {"meta": environment() if meta is None else meta, "records": records}
    with open(path, "w") as f:
        json.dump(_json_safe(data), f, indent=1)
        f.write("\n")


def plot(records, path=None):
    """TFLOP/s against sequence length (Sk), one line per implementation and pass.

    One panel per (head dim, causal, dtype); records without a time are left out.
    Writes the figure to ``path`` (any format matplotlib knows by the suffix) when
    given, and returns the matplotlib Figure (it displays itself in a notebook).
    Imports matplotlib only here.
    """
    from matplotlib.figure import Figure      # no pyplot: no global state, no display needed

    timed = [r for r in records if r["tflops"] is not None]
    panels = sorted({(r["d"], r["causal"], r["dtype"]) for r in timed})
    fig = Figure(figsize=(6.5 * max(1, len(panels)), 4.5), layout="constrained")
    axes = fig.subplots(1, max(1, len(panels)), squeeze=False)[0]
    styles = {"forward": "-", "backward": "--", "fwd+bwd": ":"}      # line style: the pass
    impls = sorted({r["impl"] for r in timed})                        # colour: the impl
    for ax, (d, causal, dtype) in zip(axes, panels):
        lines = sorted({(r["impl"], r["what"]) for r in timed
                        if (r["d"], r["causal"], r["dtype"]) == (d, causal, dtype)})
        for impl, what in lines:
            pts = sorted((r["Sk"], r["tflops"]) for r in timed
                         if (r["d"], r["causal"], r["dtype"], r["impl"], r["what"])
                         == (d, causal, dtype, impl, what))
            ax.plot([p[0] for p in pts], [p[1] for p in pts], styles[what], marker="o",
                    color=f"C{impls.index(impl) % 10}", label=f"{impl} {what}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length (Sk)")
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"d={d}, {'causal' if causal else 'non-causal'}, {dtype}")
        ax.legend(fontsize="small")
        ax.grid(True, alpha=0.3)
    if not panels:
        axes[0].text(0.5, 0.5, "no timed records", ha="center", va="center")
    if any(r["timer"] and r["timer"].startswith("simulator") for r in timed):
        fig.suptitle("CUDA simulator: these times measure Python, not a GPU")
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig


# ---------------------------------------------------------------------------------------
# Command line (python -m numbaflash bench ...; the parser lives in __main__.py)


def _comma_list(text, allowed, what):
    items = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in items if t not in allowed]
    if bad or not items:
        raise ValueError(f"--{what}: {', '.join(bad) or repr(text)} not among "
                         f"{', '.join(allowed)}")
    return items


def add_arguments(parser):
    """The bench subcommand's options (added to the parser ``__main__`` gives)."""
    parser.add_argument("--shapes", help="comma-separated BxHxNxd or BxHxSqxSkxd, e.g. "
                        "2x16x4096x64,1x16x16384x64 (default on a GPU: issue 5's three "
                        "shapes; on the simulator: 1x1x32x8)")
    parser.add_argument("--causal", default="both", choices=("no", "yes", "both"),
                        help="causal mask (bottom-right; default both)")
    parser.add_argument("--dtype", default="float32", choices=DTYPES)
    parser.add_argument("--passes", default=",".join(PASSES),
                        help=f"comma-separated subset of {','.join(PASSES)} (default all)")
    parser.add_argument("--versions", default="",
                        help="forward versions to time besides the default, e.g. v2,v3")
    parser.add_argument("--repeats", type=int, help="timed runs, median taken (default 20; "
                        "2 on the simulator)")
    parser.add_argument("--warmup", type=int, help="untimed runs first (default 3; 1 on the "
                        "simulator)")
    parser.add_argument("--no-sdpa", action="store_true", help="do not time PyTorch SDPA")
    parser.add_argument("--json", metavar="PATH", help="write the records and the "
                        "environment as JSON")
    parser.add_argument("--plot", metavar="PATH", help="draw TFLOP/s against seqlen (needs "
                        "matplotlib)")


def cli(args):
    """Run the bench subcommand; returns the exit status (0 ok, 1 a wrong result, 2 usage)."""
    def fail(message):
        print(f"python -m numbaflash bench: error: {message}", file=sys.stderr)
        return 2

    try:
        where = backend()
    except RuntimeError as e:
        return fail(str(e))
    sim = where == "simulator"
    try:
        if args.shapes is None:
            shapes = list(SIM_DEFAULT_SHAPES if sim else GPU_DEFAULT_SHAPES)
        else:
            try:
                shapes = [parse_shape(s.strip()) for s in args.shapes.split(",") if s.strip()]
            except ValueError as e:
                raise ValueError(f"--shapes: {e}") from None
            if not shapes:
                raise ValueError("--shapes is empty")
        passes = _comma_list(args.passes, PASSES, "passes")
        extra = _comma_list(args.versions, FORWARD_VERSIONS, "versions") if args.versions else []
        versions = [None] + extra
        causal = {"no": (False,), "yes": (True,), "both": (False, True)}[args.causal]
        repeats = args.repeats if args.repeats is not None else (2 if sim else 20)
        warmup = args.warmup if args.warmup is not None else (1 if sim else 3)
        if args.plot:
            try:
                import matplotlib  # noqa: F401 - fail now, not after the run
            except ImportError:
                raise ValueError("--plot needs matplotlib (pip install matplotlib)") from None
        _check_arguments(shapes, causal, args.dtype, passes, versions, repeats, warmup)
    except ValueError as e:
        return fail(str(e))

    env = environment()
    print(f"numbaflash bench: backend {env['backend']}, GPU {env['gpu']}; numba-cuda "
          f"{env['numba_cuda']}, numpy {env['numpy']}, torch {env['torch'] or 'not installed'}")
    if sim:
        print(f"WARNING: {SIMULATOR_WARNING}. The agreement checks still mean what they say.")
    if _torch_cuda() is None:
        print("PyTorch with CUDA is not available: no SDPA baseline; results are checked "
              "against numbaflash.reference (float64) on the first (batch, head) slice.")
    elif args.no_sdpa:
        print("--no-sdpa: SDPA is not timed (results are still checked against SDPA MATH "
              "float64).")
    records = run(shapes, causal=causal, dtype=args.dtype, passes=passes, versions=versions,
                  repeats=repeats, warmup=warmup, sdpa=not args.no_sdpa)
    print(format_table(records))
    if args.json:
        save_json(records, args.json, meta=env)
        print(f"wrote {args.json}")
    if args.plot:
        plot(records, args.plot)
        print(f"wrote {args.plot}")
    wrong = wrong_results(records)
    if wrong:
        print(f"FAILED: {len(wrong)} result(s) disagree with the reference and were not "
              f"timed (WRONG RESULT rows above).", file=sys.stderr)
        return 1
    return 0
