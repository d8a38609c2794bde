"""The benchmark (``run``): check first, then time, count, and compare with PyTorch SDPA.

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
   (dense NumPy is slow). The bound is the tests' tolerance rule (tests/tolerance.py;
   see ``agreement.agreement_bound``).
3. Time. Median of ``repeats`` runs after ``warmup`` runs, each between two CUDA events
   (``timing.time_ms``). A run is one call of the public API on device arrays, as a user
   makes it: launch overhead and output allocation included, host copies excluded.
4. Count. TFLOP/s by the convention of flash-attention's benchmarks (``timing.flops``),
   and the device memory a call takes beyond its outputs (``timing.extra_memory_bytes``).
5. Compare. PyTorch SDPA on the same inputs in the same process: the EFFICIENT backend
   (the ratio ``vs_sdpa`` = SDPA EFFICIENT time / our time: above 1 means faster than
   SDPA) and the MATH backend with TF32 off (plain float32 arithmetic, N x N memory);
   for float16 inputs also the FLASH backend (flash-attention's kernels, float16 only).

Under the CUDA simulator (NUMBA_ENABLE_CUDASIM=1) everything runs, checks included, but
the times measure Python executing the simulated threads, not a GPU: they say nothing
about speed. Every record notes which timer it used.

Records are plain dicts (one per shape, causal, dtype, pass and implementation), ready
for JSON; ``report.format_table``, ``report.save_json`` and ``report.plot`` present
them.
"""

import math
import sys
import time

import numpy as np
from numba import cuda

from .. import arrays
from .agreement import NumpyOracle
from .cases import (PASSES, SDPA_IMPLS, _base_record, _check_arguments, _impl_name,
                    sdpa_impls)
from .library import FORWARD_VERSIONS, backend, explain, explain_backward
from .pytorch import TorchOracle, _bench_sdpa, _torch_cuda
from .timing import _timer_name, extra_memory_bytes, flops, time_ms


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
        if tdtype == torch.bfloat16:
            # PyTorch exports no bfloat16 through the CUDA Array Interface: its bits as
            # int16, viewed as bfloat16 on Numba's side (numbaflash/dtypes.py)
            device = {n: cuda.as_cuda_array(t.view(torch.int16)).view(dtype)
                      for n, t in tensors.items()}
        else:
            device = {n: cuda.as_cuda_array(t) for n, t in tensors.items()}
        return None, tensors, device
    rng = np.random.default_rng(seed)
    host = {n: rng.standard_normal(s).astype(dtype) for n, s in sizes.items()}
    device = {n: arrays.to_device(a) for n, a in host.items()}
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
            A version that cannot run a case (v3 in float64, or with
            d > 128) gets a record with a "not run: ..." note. The backward has one
            default version and is timed once per case, as "numbaflash".
        repeats, warmup: runs timed (median taken) and runs before them.
        sdpa: also time PyTorch SDPA EFFICIENT and MATH, and FLASH for float16 (when
            PyTorch with CUDA is there).
        check: compare with a float64 reference before timing (see this module's docstring);
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
    per_case = n_numbaflash + (len(sdpa_impls(dtype)) * len(passes) if with_sdpa else 0)
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
