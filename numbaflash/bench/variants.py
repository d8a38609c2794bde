"""Attention variants in the bench: each checked, then timed against what a user would run
otherwise, with its speed target (``python -m numbaflash bench --variants``).

The cases are the targets of docs/variants.md ("On the H200"), one row of
``VARIANT_CASES`` each: a variant on numbaflash's default path, the inputs it runs on
(``SHAPES``), and the baselines it is compared with, each with its target where it has
one. For every case and pass (forward, and forward + backward), in this order:

1. Check. The variant is run once on its inputs and its results (out and lse, and dq, dk,
   dv for forward + backward) are compared with ``numbaflash.reference`` in float64 on a
   slice: the first batch and the first K/V group (the query heads K/V head 0 serves;
   one head without GQA), by the bench's rule (``agreement.agreement_bound``). The naive
   baseline of the rule is the same reference in float32, for float16 inputs too (as in
   tests/test_float16_range.py: NumPy's float16 arithmetic would take minutes at these
   sizes), its out and gradients then rounded to float16. A wrong result gets no time:
   ``ok`` False, ``ms`` None.
2. Time. The variant, then each baseline on the same inputs (``timing.time_ms``: CUDA
   events, the median of ``repeats`` runs after ``warmup``; one call each first, which
   compiles). The baselines are not checked here: numbaflash's plain path is what
   ``python -m numbaflash bench`` checks, SDPA and FlexAttention are PyTorch's. A
   baseline that serves several cases (plain attention for softcap and ALiBi) is timed
   once.
3. Compare. ratio = variant time / baseline time (below 1: the variant is faster), and
   the case's target, met or not.

Under the CUDA simulator the inputs are tiny ones of the same structure (``SHAPES``'
"simulator" column), SDPA and FlexAttention are not run (no PyTorch with CUDA), and the
times say nothing about speed; the checks still mean what they say.
"""

import functools
from collections import namedtuple

import numpy as np
from numba import cuda

from .agreement import MULT, _agreement, _lse_agreement
from .cases import REFERENCE_DENSE_MATRICES, host_bytes_available
from .library import backend, explain, explain_backward, reference
from .pytorch import _torch_cuda
from .report import aligned_rows
from .runner import _api, _Progress, _worst
from .timing import SIMULATOR_WARNING, _timer_name, time_ms

VARIANT_PASSES = ("forward", "fwd+bwd")
VARIANT_DTYPES = ("float32", "float16")

# The inputs, by name: (B, Hq, Hkv, N, d) on a GPU (the targets' sizes) and the same
# structure on the simulator (a few seconds a call there).
SHAPES = {
    "gqa":   {"gpu": (2, 32, 8, 4096, 128), "simulator": (1, 4, 2, 24, 8)},
    "heads": {"gpu": (2, 16, 16, 4096, 64), "simulator": (1, 2, 2, 24, 8)},
    "long":  {"gpu": (1, 16, 16, 16384, 64), "simulator": (1, 1, 1, 32, 8)},
}
# The lengths the options name: a sliding window of 256 keys, documents of 1024 positions
# (16 of them at N = 16384); on the simulator 4 and 8 (4 documents at N = 32).
LENGTHS = {"gpu": {"window": 256, "document": 1024},
           "simulator": {"window": 4, "document": 8}}

Case = namedtuple("Case", "name inputs options baselines")
Baseline = namedtuple("Baseline", "name impl options target")

# Targets are conditions on ratio = variant ms / baseline ms ("1/ratio >= 12": the
# variant at least 12 times faster); one text, or one per pass.
_DOCUMENT_BASELINES = (
    Baseline("SDPA EFFICIENT, same bool mask", "sdpa",
             {"attn_mask": "documents", "backend": "EFFICIENT"}, "ratio < 1"),
    Baseline("FlexAttention compiled", "flex", {"mask_mod": "documents"}, "ratio <= 1.5"),
)

# Options are numbaflash's keyword arguments; the strings "slopes", "window" and
# "documents" name arrays and functions made for the inputs (``_Inputs.options``).
# Baseline options: "repeat_kv" repeats K/V per query head by hand; SDPA's "backend" is
# one name or one per dtype (FLASH has float16 kernels only, and takes no mask).
VARIANT_CASES = (
    Case("GQA, causal", "gqa", {"causal": True}, (
        Baseline("numbaflash, K/V repeated by hand", "numbaflash",
                 {"causal": True, "repeat_kv": True}, "ratio <= 1.1"),
        Baseline("SDPA {backend}, K/V repeated", "sdpa",
                 {"is_causal": True, "repeat_kv": True,
                  "backend": {"float32": "EFFICIENT", "float16": "FLASH"}}, None))),
    Case("softcap 30", "heads", {"softcap": 30.0}, (
        Baseline("numbaflash plain", "numbaflash", {}, "ratio <= 1.3"),)),
    Case("ALiBi", "heads", {"alibi_slopes": "slopes"}, (
        Baseline("numbaflash plain", "numbaflash", {}, "ratio <= 1.3"),)),
    Case("ALiBi + causal", "heads", {"alibi_slopes": "slopes", "causal": True}, (
        Baseline("numbaflash plain causal", "numbaflash", {"causal": True}, "ratio <= 1.3"),)),
    Case("window + causal", "long", {"window_size": "window", "causal": True}, (
        Baseline("numbaflash full causal", "numbaflash", {"causal": True},
                 {"forward": "1/ratio >= 12", "fwd+bwd": "1/ratio >= 10"}),)),
    Case("documents: bool attn_mask", "long", {"attn_mask": "documents"},
         _DOCUMENT_BASELINES),
    Case("documents: mask_mod", "long", {"mask_mod": "documents"}, _DOCUMENT_BASELINES),
)
CASE_NAMES = tuple(c.name for c in VARIANT_CASES)


def target_met(target, ratio):
    """Whether ``ratio`` meets ``target`` ("ratio <= 1.1", "ratio < 1", "1/ratio >= 12");
    None when there is no target or no ratio."""
    if target is None or ratio is None:
        return None
    quantity, op, value = target.split()
    x = ratio if quantity == "ratio" else 1.0 / ratio
    return {"<": x < float(value), "<=": x <= float(value), ">=": x >= float(value),
            ">": x > float(value)}[op]


@functools.lru_cache(maxsize=None)
def same_document(length):
    """A ``mask_mod`` (a Numba device function): each query sees the keys of its own
    document, the positions cut into documents of ``length``. One function, and one
    compilation, per length."""
    @cuda.jit(device=True)
    def same_document(b, h, q_idx, kv_idx):
        return q_idx // length == kv_idx // length
    return same_document


def _first_line(e):
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:200] if text else ''}"


class _Inputs:
    """One entry of ``SHAPES``: random normal q, dout (B, Hq, N, d) and k, v (B, Hkv, N, d)
    on the device, the arrays the options name, and the host slice the reference reads.

    Made by ``torch.randn`` when PyTorch with CUDA is there (numbaflash reads the same
    memory through ``cuda.as_cuda_array``, and SDPA and FlexAttention get the tensors),
    else by NumPy and copied once.
    """

    def __init__(self, torch, shape, lengths, dtype, seed):
        self.torch, self.shape, self.dtype = torch, shape, dtype
        B, Hq, Hkv, N, d = shape
        self.group = Hq // Hkv                 # query heads per K/V head
        self.window, self.document = lengths["window"], lengths["document"]
        sizes = {"q": (B, Hq, N, d), "k": (B, Hkv, N, d), "v": (B, Hkv, N, d),
                 "dout": (B, Hq, N, d)}
        # The reference's slice: the first batch, the query heads of K/V head 0.
        heads = {"q": self.group, "dout": self.group, "k": 1, "v": 1}
        if torch is not None:
            g = torch.Generator(device="cuda").manual_seed(seed)
            self.tensors = {n: torch.randn(s, device="cuda", dtype=getattr(torch, dtype),
                                           generator=g) for n, s in sizes.items()}
            self.device = {n: cuda.as_cuda_array(t) for n, t in self.tensors.items()}
            self.host = {n: t[:1, :heads[n]].cpu().numpy() for n, t in self.tensors.items()}
        else:
            rng = np.random.default_rng(seed)
            full = {n: rng.standard_normal(s).astype(dtype) for n, s in sizes.items()}
            self.tensors = None
            self.device = {n: cuda.to_device(a) for n, a in full.items()}
            self.host = {n: a[:1, :heads[n]] for n, a in full.items()}
        # ALiBi's slopes, one per query head (a geometric series, as ALiBi's paper has).
        self.slopes = np.geomspace(0.5, 0.5 ** 8, Hq).astype(np.float32)
        self.slopes_slice = self.slopes[:self.group]             # the reference's heads
        docs = np.arange(N) // self.document
        self.documents = docs[:, None] == docs[None, :]          # (N, N) bool: True attends
        self._device_arrays = {}
        # (ref, base) by the reference's options: the two document cases share theirs.
        self.references = {}

    def references_for(self, ref_opts):
        """The dict that holds (or will hold, at the first check) the references of
        ``ref_opts``, shared by every case whose reference options are the same."""
        key = tuple(sorted((k, ("array", id(v)) if isinstance(v, np.ndarray) else v)
                           for k, v in ref_opts.items()))
        return self.references.setdefault(key, {})

    def _on_device(self, name, array):
        if name not in self._device_arrays:
            self._device_arrays[name] = cuda.to_device(array)
        return self._device_arrays[name]

    def repeated(self):
        """k and v with each K/V head repeated for its query heads (a copy, by hand)."""
        if "k_repeated" not in self._device_arrays:
            if self.torch is not None:
                for n in ("k", "v"):
                    t = self.tensors[n].repeat_interleave(self.group, dim=1).contiguous()
                    self.tensors[f"{n}_repeated"] = t
                    self._device_arrays[f"{n}_repeated"] = cuda.as_cuda_array(t)
            else:
                for n in ("k", "v"):
                    host = self.device[n].copy_to_host()
                    self._device_arrays[f"{n}_repeated"] = cuda.to_device(
                        np.repeat(host, self.group, axis=1))
        return self._device_arrays["k_repeated"], self._device_arrays["v_repeated"]

    def options(self, options):
        """``(numbaflash's, the reference's)`` keyword arguments for ``options``: the named
        arrays on the device for numbaflash, their slice on the host for the reference.
        The reference gets the documents as a boolean attn_mask also for the mask_mod: the
        same attention, and the mask_mod's Python body over N * N pairs would take
        minutes at N = 16384."""
        ours, ref = {}, {}
        for key, value in options.items():
            if key == "alibi_slopes" and value == "slopes":
                ours[key] = self._on_device("slopes", self.slopes)
                ref[key] = self.slopes_slice
            elif key == "window_size" and value == "window":
                ours[key] = ref[key] = (self.window, 0)
            elif key == "attn_mask" and value == "documents":
                ours[key] = self._on_device("documents", self.documents)
                ref["attn_mask"] = self.documents
            elif key == "mask_mod" and value == "documents":
                ours[key] = same_document(self.document)
                ref["attn_mask"] = self.documents
            else:
                ours[key] = ref[key] = value
        return ours, ref

    def describe(self, options):
        """The options as text, with the lengths they name: "window_size=(4, 0), ..."."""
        words = {"slopes": "per head", "window": f"({self.window}, 0)",
                 "documents": f"documents of {self.document}"}
        return ", ".join(f"{k}={words.get(v, v) if isinstance(v, str) else v}"
                         for k, v in options.items()) or "-"


def _numbaflash_passes(q, k, v, dout, opts):
    """{pass: closure} of numbaflash's default path (``bench.attention``, looked up now)."""
    attention, attention_backward = _api()

    def forward():
        return attention(q, k, v, return_lse=True, **opts)

    def fwd_bwd():
        out, lse = attention(q, k, v, return_lse=True, **opts)
        return (out, lse) + tuple(attention_backward(dout, q, k, v, out, lse, **opts))
    return {"forward": forward, "fwd+bwd": fwd_bwd}


def _sdpa_passes(torch, q, k, v, dout, backend, **kw):
    """{pass: closure} of PyTorch SDPA on ``backend`` ("EFFICIENT", "FLASH")."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    chosen = getattr(SDPBackend, f"{backend}_ATTENTION")
    # The same memory, marked as needing gradients (detach shares the storage: no copy).
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

    def forward():
        with sdpa_kernel(chosen), torch.no_grad():
            return F.scaled_dot_product_attention(q, k, v, **kw)

    def fwd_bwd():
        with sdpa_kernel(chosen):
            o = F.scaled_dot_product_attention(*leaves, **kw)
            return torch.autograd.grad(o, leaves, dout)
    return {"forward": forward, "fwd+bwd": fwd_bwd}


def _flex_passes(torch, q, k, v, dout, length):
    """{pass: closure} of compiled FlexAttention with the documents' block mask (made
    once, outside the timed calls, as FlexAttention users do). Raises where this PyTorch
    cannot compile it."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def same_doc(b, h, q_idx, kv_idx):
        return q_idx // length == kv_idx // length
    N = q.shape[2]
    block_mask = create_block_mask(same_doc, None, None, N, N, device=q.device)
    flex = torch.compile(flex_attention)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

    def forward():
        with torch.no_grad():
            return flex(q, k, v, block_mask=block_mask)

    def fwd_bwd():
        o = flex(*leaves, block_mask=block_mask)
        return torch.autograd.grad(o, leaves, dout)
    fwd_bwd()                                  # compile now: a failure is this baseline's
    return {"forward": forward, "fwd+bwd": fwd_bwd}


def _references(data, ref_opts, backward):
    """float64 references and float32 naive baselines of the slice ``data.host``:
    ``(ref, base)``, dicts of out, lse (and dq, dk, dv).

    For float16 inputs the baseline's out, dq, dk, dv are rounded to float16, as
    numbaflash's are when written (a float16 computation cannot do better); lse stays
    float32, as numbaflash returns it."""
    h = data.host
    ref, base = {}, {}
    with np.errstate(all="ignore"):
        for dtype, into in ((np.float64, ref), (np.float32, base)):
            into["out"], into["lse"] = reference.forward(h["q"], h["k"], h["v"], dtype=dtype,
                                                         **ref_opts)
            if backward:
                into["dq"], into["dk"], into["dv"] = reference.backward(
                    h["dout"], h["q"], h["k"], h["v"], dtype=dtype, **ref_opts)
        if data.dtype == "float16":
            for name in ("out", "dq", "dk", "dv"):
                if name in base:
                    base[name] = base[name].astype(np.float16)
    return ref, base


def _check(result, ref, base, data):
    """Check a numbaflash result, (out, lse) or (out, lse, dq, dk, dv) device arrays, on
    the reference's slice: ``{name: {"max_err", "bound", "ok"}}``."""
    N = data.shape[3]
    masked = np.isneginf(ref["lse"]).reshape(-1, N).all(axis=0)      # rows seeing no key
    checks = {}
    for name, got in zip(("out", "lse", "dq", "dk", "dv"), result):
        heads = 1 if name in ("dk", "dv") else data.group
        got = np.asarray(got[:1, :heads].copy_to_host(), dtype=np.float64)
        want, naive = ref[name], np.asarray(base[name], dtype=np.float64)
        if name == "lse":
            checks[name] = _lse_agreement(got, want, naive, data.dtype, masked)
        else:
            zero = masked if name in ("out", "dq") else None
            checks[name] = _agreement(got, want, naive, data.dtype, MULT[name], zero)
    return checks


class _Baselines:
    """The baselines of one ``_Inputs``, each made and timed once per pass (by name)."""

    def __init__(self, data, torch, pytorch_note, repeats, warmup):
        self.data, self.torch, self.pytorch_note = data, torch, pytorch_note
        self.repeats, self.warmup = repeats, warmup
        self.passes, self.times = {}, {}

    def backend(self, baseline):
        """SDPA's backend for this dtype ("EFFICIENT", "FLASH"), or None."""
        backend = baseline.options.get("backend")
        return backend[self.data.dtype] if isinstance(backend, dict) else backend

    def name(self, baseline):
        return baseline.name.format(backend=self.backend(baseline))

    def _make(self, baseline):
        """{pass: closure} for ``baseline``, or a string: why it cannot run."""
        data, torch, opts = self.data, self.torch, baseline.options
        if baseline.impl in ("sdpa", "flex") and self.pytorch_note:
            return self.pytorch_note
        if baseline.impl == "numbaflash":
            q, dout = data.device["q"], data.device["dout"]
            k, v = data.repeated() if opts.get("repeat_kv") else (data.device["k"],
                                                                  data.device["v"])
            ours, _ = data.options({n: x for n, x in opts.items() if n != "repeat_kv"})
            return _numbaflash_passes(q, k, v, dout, ours)
        t = data.tensors
        q, k, v, dout = t["q"], t["k"], t["v"], t["dout"]
        try:
            if baseline.impl == "sdpa":
                if opts.get("repeat_kv"):
                    data.repeated()
                    k, v = t["k_repeated"], t["v_repeated"]
                kw = {"is_causal": True} if opts.get("is_causal") else {}
                if opts.get("attn_mask") == "documents":
                    kw["attn_mask"] = torch.from_numpy(data.documents).to(q.device)
                return _sdpa_passes(torch, q, k, v, dout, self.backend(baseline), **kw)
            return _flex_passes(torch, q, k, v, dout, data.document)
        except Exception as e:                 # noqa: BLE001 - recorded, not hidden
            return f"cannot run here: {_first_line(e)}"

    def time(self, baseline, what):
        """``(ms, note)``: the median time of ``baseline``'s pass, or None and why not."""
        name = self.name(baseline)
        if name not in self.passes:
            self.passes[name] = self._make(baseline)
        if (name, what) not in self.times:
            fns = self.passes[name]
            if isinstance(fns, str):
                self.times[name, what] = (None, fns)
            else:
                try:
                    fns[what]()                # the first call compiles
                    self.times[name, what] = (time_ms(fns[what], self.repeats, self.warmup),
                                              None)
                except Exception as e:         # noqa: BLE001 - recorded, not hidden
                    self.times[name, what] = (None, f"failed: {_first_line(e)}")
                finally:
                    if self.torch is not None:
                        self.torch.cuda.empty_cache()
        return self.times[name, what]


def _kernels(q, k, v, opts):
    """``{pass: (kernel names, None)}`` from explain and explain_backward, or ``(None,
    why)`` for a pass numbaflash refuses (its ValueError)."""
    try:
        forward = explain(q, k, v, **opts).kernel
    except ValueError as e:
        return {what: (None, str(e)) for what in VARIANT_PASSES}
    try:
        backward = "+".join(p.kernel for p in explain_backward(q, k, v, **opts))
    except ValueError as e:
        return {"forward": (forward, None), "fwd+bwd": (None, str(e))}
    return {"forward": (forward, None), "fwd+bwd": (f"{forward} + {backward}", None)}


def _measure_variant(fn, kernel, references, data, ref_opts, repeats, warmup):
    """Run one variant pass ``fn`` once and check it; only if it agrees, time it. Returns
    the record's variant fields. ``kernel`` is ``(names, why not)`` from ``_kernels``;
    ``references`` a dict filled with ``(ref, base)`` at its first check (shared by the
    passes, and by cases with the same reference)."""
    kernel, refusal = kernel
    variant = dict(kernel=kernel, ms=None, ok=None, max_err=None, bound=None, check=None,
                   checked_against=None, timer=None, repeats=None, warmup=None, note=None)
    if refusal:
        variant["note"] = f"not run: {refusal}"
        return variant
    result = fn()                              # the first call also compiles the kernels
    if not references:
        references["ref"], references["base"] = _references(data, ref_opts, backward=True)
    checks = _check(result, references["ref"], references["base"], data)
    del result
    worst = _worst(checks)
    variant.update(check=checks, max_err=worst["max_err"], bound=worst["bound"],
                   ok=all(c["ok"] for c in checks.values()),
                   checked_against="numbaflash.reference float64, first batch, query heads "
                   "of K/V head 0 (baseline: the same in float32)")
    if variant["ok"]:                          # a wrong result gets no time
        variant.update(ms=time_ms(fn, repeats, warmup), timer=_timer_name(),
                       repeats=repeats, warmup=warmup)
    return variant


def _check_variant_arguments(dtype, repeats, warmup, cases, size):
    """ValueError, before anything runs, for a bad argument of ``run_variants``."""
    if dtype not in VARIANT_DTYPES:
        raise ValueError(f"dtype must be one of {VARIANT_DTYPES} (the variants' targets are "
                         f"float32 and float16 times); got {dtype!r}")
    for name, n, low in (("repeats", repeats, 1), ("warmup", warmup, 0)):
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < low:
            raise ValueError(f"{name} must be an integer >= {low}; got {n!r}")
    if cases is not None:
        if isinstance(cases, str):
            cases = (cases,)
        bad = [c for c in cases if c not in CASE_NAMES]
        if bad or not cases:
            raise ValueError(f"cases must be names among {CASE_NAMES}; got {tuple(cases)!r}")
    if size not in (None, "gpu", "simulator"):
        raise ValueError(f"size must be None, 'gpu' or 'simulator'; got {size!r}")
    return cases


def _check_host_memory(chosen, size):
    """ValueError naming the first case whose check would not fit in the host's available
    memory: the dense float64 reference of its slice (the query heads of one K/V head)."""
    available = host_bytes_available()
    if available is None:
        return
    for case in chosen:
        B, Hq, Hkv, N, d = SHAPES[case.inputs][size]
        need = REFERENCE_DENSE_MATRICES["backward"] * (Hq // Hkv) * N * N * 8
        if need > available:
            raise ValueError(f"case {case.name!r}: its check (the dense float64 reference of "
                             f"{Hq // Hkv} head(s) at N = {N}) needs about "
                             f"{need / 2**30:.1f} GiB of host memory; "
                             f"{available / 2**30:.1f} GiB are available")


def run_variants(*, dtype="float32", repeats=20, warmup=3, sdpa=True, cases=None, size=None,
                 progress=True):
    """Check, then time, each variant case against its baselines; returns a list of records.

    Args:
        dtype: "float32" or "float16" (inputs; numbaflash computes in float32 either way).
        repeats, warmup: runs timed (median taken) and untimed runs before them.
        sdpa: also time the PyTorch baselines (SDPA, FlexAttention), where PyTorch with
            CUDA is there.
        cases: names from ``CASE_NAMES`` to run (default all, in ``VARIANT_CASES``' order).
        size: "gpu" (the targets' shapes) or "simulator" (tiny ones of the same
            structure); None: by the backend.
        progress: a line per record on stderr.

    Returns:
        One dict per (case, pass, baseline), in that order, with keys case, options (the
        variant's, as text), B, Hq, Hkv, N, d, dtype, what ("forward" | "fwd+bwd"),
        kernel, ms (the variant's median; None if not timed), baseline, baseline_ms,
        ratio (ms / baseline_ms: below 1, the variant is faster), target (text, or None),
        met (True, False, or None: no target, no ratio, or not GPU times at the
        targets' shapes: the simulator's times say nothing about speed), ok (the
        variant's check: True, False for a wrong result, which is not timed, or None:
        not run), max_err and bound (the worst tensor's), check (per tensor),
        checked_against, timer, repeats, warmup, note (why the variant did not run),
        baseline_note (why the baseline did not).

    Raises:
        ValueError: a bad argument, or a check the host's memory cannot hold, before
            anything runs.
        RuntimeError: neither a GPU nor the simulator.
    """
    cases = _check_variant_arguments(dtype, repeats, warmup, cases, size)
    where = backend()                         # RuntimeError now if there is no backend
    size = size or ("simulator" if where == "simulator" else "gpu")
    torch = _torch_cuda()
    if torch is None:
        pytorch_note = "not run: no PyTorch with CUDA"
    elif not sdpa:
        pytorch_note = "not run: PyTorch baselines switched off (--no-sdpa)"
    else:
        pytorch_note = None
    chosen = [c for c in VARIANT_CASES if cases is None or c.name in cases]
    _check_host_memory(chosen, size)
    # The targets are about GPU times at the targets' shapes: judged only there.
    judged = size == "gpu" and where == "gpu"
    bar = _Progress(sum(len(c.baselines) for c in chosen) * len(VARIANT_PASSES), progress)

    records = []
    for seed, inputs in enumerate(dict.fromkeys(c.inputs for c in chosen)):
        shape = SHAPES[inputs][size]
        data = _Inputs(torch, shape, LENGTHS[size], dtype, seed)
        baselines = _Baselines(data, torch, pytorch_note, repeats, warmup)
        q, k, v, dout = (data.device[n] for n in ("q", "k", "v", "dout"))
        for case in (c for c in chosen if c.inputs == inputs):
            ours, ref_opts = data.options(case.options)
            kernels = _kernels(q, k, v, ours)
            fns = _numbaflash_passes(q, k, v, dout, ours)
            references = data.references_for(ref_opts)    # filled at the first check
            for what in VARIANT_PASSES:
                variant = _measure_variant(fns[what], kernels[what], references, data,
                                           ref_opts, repeats, warmup)
                if variant["checked_against"] and "mask_mod" in case.options:
                    variant["checked_against"] += ", documents as a bool attn_mask"
                for baseline in case.baselines:
                    name = baselines.name(baseline)
                    bar.step(f"{what:8s} {case.name} ({dtype}) vs {name}")
                    base_ms = base_note = None
                    if variant["ms"] is not None:     # nothing to compare otherwise
                        base_ms, base_note = baselines.time(baseline, what)
                    target = baseline.target
                    if isinstance(target, dict):
                        target = target.get(what)
                    ratio = variant["ms"] / base_ms if base_ms else None
                    B, Hq, Hkv, N, d = shape
                    records.append(dict(
                        case=case.name, options=data.describe(case.options), B=B, Hq=Hq,
                        Hkv=Hkv, N=N, d=d, dtype=dtype, what=what, baseline=name,
                        baseline_ms=base_ms, ratio=ratio, target=target,
                        met=target_met(target, ratio) if judged else None,
                        baseline_note=base_note, **variant))
        del data, baselines, fns, q, k, v, dout         # this shape's device memory
        if torch is not None:
            torch.cuda.empty_cache()
    return records


def _cell(x, digits=3):
    if x is None:
        return "-"
    return f"{x:.{digits}f}" if abs(x) >= 10 ** -digits or x == 0 else f"{x:.1e}"


def _status(r):
    if r["ok"] is False:
        return "WRONG RESULT, not timed"
    if r["note"]:
        return "not run"
    return "ok" if r["ok"] else "not checked"


def format_variant_table(records):
    """The variant records as a text table, one line each; why something did not run is
    numbered under it."""
    head = ("case", "options", "B,Hq,Hkv,N,d", "dtype", "pass", "ms", "baseline",
            "baseline ms", "ratio", "target", "met", "max err", "bound", "status")
    rows, notes = [], []

    def numbered(note):
        if note not in notes:
            notes.append(note)
        return f" [{notes.index(note) + 1}]"
    for r in records:
        status = _status(r) + (numbered(r["note"]) if r["note"] else "")
        baseline = r["baseline"] + (numbered(r["baseline_note"]) if r["baseline_note"] else "")
        rows.append((
            r["case"], r["options"], f"{r['B']},{r['Hq']},{r['Hkv']},{r['N']},{r['d']}",
            r["dtype"], r["what"], _cell(r["ms"]), baseline, _cell(r["baseline_ms"]),
            _cell(r["ratio"]), r["target"] or "-",
            {True: "yes", False: "NO", None: "-"}[r["met"]],
            "-" if r["max_err"] is None else f"{r['max_err']:.2e}",
            "-" if r["bound"] is None else f"{r['bound']:.2e}", status))
    out = aligned_rows(head, rows, numeric={5, 7, 8, 11, 12})
    out += [f"[{i}] {n}" for i, n in enumerate(notes, 1)]
    if any(r["timer"] and r["timer"].startswith("simulator") for r in records):
        out.append(f"NOTE: {SIMULATOR_WARNING}.")
    if any(r["target"] and r["ratio"] is not None and r["met"] is None for r in records):
        out.append("met: '-' where not judged: the targets are about GPU times at the "
                   "targets' shapes.")
    out.append("ratio = variant time / baseline time (below 1: the variant is faster; "
               "1/ratio: how many times faster). Checked: the variant, against "
               "numbaflash.reference in float64.")
    return "\n".join(out)


def wrong_variants(records):
    """The records whose variant disagreed with the reference (``ok`` False)."""
    return [r for r in records if r["ok"] is False]


__all__ = ["run_variants", "format_variant_table", "wrong_variants", "target_met",
           "same_document", "VARIANT_CASES", "CASE_NAMES", "SHAPES", "LENGTHS",
           "VARIANT_PASSES", "VARIANT_DTYPES", "Case", "Baseline"]
