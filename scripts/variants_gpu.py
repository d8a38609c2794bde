"""Attention variants on a GPU: agreement with PyTorch, and what skipped tiles buy.

    python scripts/variants_gpu.py --out gpu-out        # on a GPU with PyTorch (minutes)
    NUMBA_ENABLE_CUDASIM=1 python scripts/variants_gpu.py --sim   # the script's own check

Part 1, agreement. For each case (a variant, forward and backward, float32, random
shapes from a fixed seed) numbaflash's out, dq, dk and dv are compared with PyTorch:
SDPA's MATH backend in float64, autograd for the gradients, with every variant written
as an explicit float64 additive mask (-inf where hidden; ALiBi, the float attn_mask and
the relative-position score_mod added): that is how SDPA users express them. softcap is
not additive, so its reference is PyTorch's FlexAttention (eager, float64) with a
tanh score_mod. GQA: K and V are repeated per query head in PyTorch (autograd sums the
copies' gradients). The bound is TESTING.md's rule (bench.agreement_bound): the error of
the same PyTorch computation in float32 with TF32 off is the baseline.

Part 2, time (CUDA events, median). At (1, 16, 16384, 64) float32: full causal against a
sliding window of 256 keys (window_size=(256, 0) with causal), and full attention against
a document mask (16 documents of 1024: as a boolean attn_mask and as a mask_mod), with
SDPA EFFICIENT given the same boolean mask for scale. The window and document runs visit
a small fraction of the tiles, so they must be much faster (the target: the window at
least 10x).

Part 3, the targets on the default path: the package's variant bench,
``bench.run_variants`` (numbaflash/bench/variants.py; ``python -m numbaflash bench
--variants`` runs the same), in float32, then its GQA case in float16. Each variant is
checked against numbaflash.reference in float64 on a slice, then timed (CUDA events,
median, one process): GQA (q (2, 32, 4096, 128), K/V 8 heads, causal) against the same
problem with K/V repeated by hand and against SDPA; softcap 30 and ALiBi against plain
attention at (2, 16, 4096, 64); the window (256, 0) + causal against full causal at
(1, 16, 16384, 64); the document mask against SDPA EFFICIENT with the same boolean mask
(SDPA computes its gradient through the mask too) and against FlexAttention compiled,
where this PyTorch can compile it; forward and forward + backward. Every ratio is printed
as "variant / baseline" time (below 1 is faster than the baseline), with the target where
the case has one.

--sim runs the agreement part on tiny shapes in the simulator against a NumPy version of
the same explicit bias, which checks the bias construction without a GPU or PyTorch.
"""

import argparse
import json
import math
import os
import sys
import time

import numpy as np
from numba import cuda

import numbaflash
from numbaflash import bench, masks

SEED = 20261130


@cuda.jit(device=True)
def documents_1024(b, h, q_idx, kv_idx):
    """Documents of 1024 positions: each query sees the keys of its own document."""
    return q_idx // 1024 == kv_idx // 1024


@cuda.jit(device=True)
def documents_37(b, h, q_idx, kv_idx):
    return q_idx // 37 == kv_idx // 37


@cuda.jit(device=True)
def relative_bias(score, b, h, q_idx, kv_idx):
    """A relative-position bias, by head: -0.05 (h + 1) |q_idx - kv_idx|."""
    return score - 0.05 * (h + 1) * abs(q_idx - kv_idx)


@cuda.jit(device=True)
def relative_bias_grad(score, b, h, q_idx, kv_idx):
    return 1.0


# ---------------------------------------------------------------------------------------
# Cases: (name, B, Hq, Hkv, Sq, Sk, d, options). Options are numbaflash's keyword
# arguments; "attn_mask" values are made per case (below) from a recipe name.

CASES = [
    ("window (64, 16)", 2, 4, 4, 300, 300, 64, dict(window_size=(64, 16))),
    ("window (100, 0) + causal, Sq < Sk", 2, 4, 4, 200, 330, 64,
     dict(window_size=(100, 0), causal=True)),
    ("causal top_left, Sq < Sk", 1, 4, 4, 150, 260, 64, dict(causal="top_left")),
    ("GQA 8 -> 2", 2, 8, 2, 256, 256, 64, dict()),
    ("MQA 4 -> 1 + causal", 1, 4, 1, 300, 300, 128, dict(causal=True)),
    ("softcap 5", 2, 4, 4, 256, 256, 64, dict(softcap=5.0)),
    ("ALiBi per head", 2, 4, 4, 256, 300, 64, dict(alibi_slopes="per_head")),
    ("ALiBi per batch and head + causal", 2, 4, 4, 256, 256, 64,
     dict(alibi_slopes="per_batch", causal=True)),
    ("bool attn_mask (Sq, Sk)", 2, 4, 4, 256, 280, 64, dict(attn_mask="bool_2d")),
    ("bool attn_mask (B, 1, Sq, Sk)", 2, 4, 4, 200, 200, 128, dict(attn_mask="bool_b1")),
    ("float attn_mask (B, H, Sq, Sk)", 2, 4, 4, 200, 250, 64, dict(attn_mask="bias_bh")),
    ("mask_mod documents of 37", 2, 4, 4, 300, 300, 64, dict(mask_mod=documents_37)),
    ("score_mod relative bias", 2, 4, 4, 256, 256, 64,
     dict(score_mod=relative_bias, score_mod_grad=relative_bias_grad)),
    ("all: GQA + window + ALiBi + bool mask + mask_mod", 2, 8, 4, 300, 300, 64,
     dict(window_size=(128, 8), alibi_slopes="per_head", attn_mask="bool_2d",
          mask_mod=documents_37)),
]

SIM_CASES = [(name, B, Hq, Hkv, min(Sq, 23), min(Sk, 29), 4, dict(opts))
             for name, B, Hq, Hkv, Sq, Sk, d, opts in CASES]


def make_options(opts, B, Hq, Sq, Sk, rng):
    """Replace the recipe names in ``opts`` by arrays."""
    opts = dict(opts)
    slopes = opts.get("alibi_slopes")
    if slopes == "per_head":
        opts["alibi_slopes"] = rng.uniform(0.01, 0.2, Hq).astype(np.float32)
    elif slopes == "per_batch":
        opts["alibi_slopes"] = rng.uniform(0.01, 0.2, (B, Hq)).astype(np.float32)
    mask = opts.get("attn_mask")
    if mask == "bool_2d":
        m = rng.random((Sq, Sk)) < 0.8
    elif mask == "bool_b1":
        m = rng.random((B, 1, Sq, Sk)) < 0.6
    elif mask == "bias_bh":
        m = rng.uniform(-3, 3, (B, Hq, Sq, Sk)).astype(np.float32)
    else:
        return opts
    if m.dtype == np.bool_:
        m[..., np.arange(min(Sq, Sk)), np.arange(min(Sq, Sk))] = True   # no empty row
    opts["attn_mask"] = m
    return opts


def explicit_bias(opts, B, Hq, Sq, Sk):
    """Every additive or masking variant in ``opts`` as one float64 (B, Hq, Sq, Sk) array:
    0 or -inf from the masks, plus ALiBi, the float attn_mask and the relative-position
    score_mod. softcap is not additive (see ``reference``)."""
    i = np.arange(Sq)[:, None]
    j = np.arange(Sk)[None, :]
    b = np.arange(B)[:, None, None, None]
    h = np.arange(Hq)[None, :, None, None]
    vis = np.broadcast_to(masks.visible_band(Sq, Sk, opts.get("causal", False),
                                             opts.get("window_size")), (B, Hq, Sq, Sk))
    bias = np.zeros((B, Hq, Sq, Sk))
    slopes = opts.get("alibi_slopes")
    if slopes is not None:
        s = np.asarray(slopes, np.float64)
        s = (s[None, :] if s.ndim == 1 else s)[:, :, None, None]
        bias = bias - s * np.abs(i + Sk - Sq - j)
    mask = opts.get("attn_mask")
    if mask is not None:
        if mask.dtype == np.bool_:
            vis = vis & mask
        else:
            bias = bias + mask.astype(np.float64)
    if opts.get("mask_mod") is not None:
        fn = getattr(opts["mask_mod"], "py_func", opts["mask_mod"])
        vis = vis & np.vectorize(fn, otypes=[bool])(b, h, i, j)
    if opts.get("score_mod") is not None:
        bias = bias - 0.05 * (h + 1) * np.abs(i - j)     # relative_bias, the only score_mod
    if not vis.any(axis=-1).all():
        raise ValueError("a case with a row that sees no key: SDPA gives NaN there")
    return np.where(vis, bias, -np.inf)


def torch_attention(torch, q, k, v, dout, bias, softcap, dtype, group):
    """out, dq, dk, dv by PyTorch in ``dtype`` (float64 reference or float32 baseline)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    qq, kk, vv = leaves
    kk, vv = (t.repeat_interleave(group, dim=1) for t in (kk, vv))
    with bench._tf32_off(torch):
        if softcap is None:
            with sdpa_kernel(SDPBackend.MATH):
                o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=bias.to(dtype))
        else:
            o = _softcap_attention(torch, qq, kk, vv, bias.to(dtype), softcap)
        grads = torch.autograd.grad(o, leaves, dout.to(dtype))
    return [t.detach().to(torch.float64) for t in (o, *grads)]


SOFTCAP_REFERENCE = []      # which PyTorch path the softcap reference took (printed)


def _softcap_attention(torch, q, k, v, bias, cap):
    """softcap attention by FlexAttention (eager) with a tanh score_mod plus the bias; if
    this PyTorch cannot run it eagerly, the same formula written out in PyTorch."""
    def tanh_cap(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap) + bias[b, h, q_idx, kv_idx]
    try:
        from torch.nn.attention.flex_attention import flex_attention
        o = flex_attention(q, k, v, score_mod=tanh_cap)
        SOFTCAP_REFERENCE.append("FlexAttention eager")
        return o
    except Exception as e:             # noqa: BLE001 (recorded, not hidden)
        SOFTCAP_REFERENCE.append(f"PyTorch math (FlexAttention failed: {type(e).__name__}: "
                                 f"{str(e)[:200]})")
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    s = cap * torch.tanh(s / cap) + bias
    return torch.softmax(s, dim=-1) @ v


def numpy_attention(q, k, v, dout, bias, softcap, group):
    """The same explicit-bias attention in NumPy float64 (for --sim)."""
    k, v = (np.repeat(t, group, axis=1) for t in (k, v))
    d = q.shape[-1]
    s0 = q @ np.swapaxes(k, -1, -2) / math.sqrt(d)
    g = np.ones_like(s0)
    if softcap is not None:
        t = np.tanh(s0 / softcap)
        s0, g = softcap * t, 1 - t * t
    s = s0 + bias
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = p @ v
    dp = dout @ np.swapaxes(v, -1, -2)
    ds = p * (dp - (dout * o).sum(-1, keepdims=True)) * g / math.sqrt(d)
    dq = ds @ k
    dk = np.swapaxes(ds, -1, -2) @ q
    dv = np.swapaxes(p, -1, -2) @ dout
    B, Hkv = dk.shape[0], dk.shape[1] // group
    shape = (B, Hkv, group) + dk.shape[2:]
    return o, dq, dk.reshape(shape).sum(2), dv.reshape(shape).sum(2)


def agreement(cases, sim, torch):
    rows = []
    rng = np.random.default_rng(SEED)
    for name, B, Hq, Hkv, Sq, Sk, d, opts in cases:
        opts = make_options(opts, B, Hq, Sq, Sk, rng)
        q = rng.standard_normal((B, Hq, Sq, d)).astype(np.float32)
        k, v = (rng.standard_normal((B, Hkv, Sk, d)).astype(np.float32) for _ in range(2))
        dout = rng.standard_normal((B, Hq, Sq, d)).astype(np.float32)
        bias = explicit_bias(opts, B, Hq, Sq, Sk)
        softcap = opts.get("softcap")
        t0 = time.perf_counter()
        out, lse = numbaflash.attention(q, k, v, return_lse=True, **opts)
        grads = numbaflash.attention_backward(dout, q, k, v, out, lse, **opts)
        ours = [np.asarray(x, np.float64) for x in (out, *grads)]
        if sim:
            ref = numpy_attention(*(x.astype(np.float64) for x in (q, k, v, dout)), bias,
                                  softcap, Hq // Hkv)
            base = [None] * 4
        else:
            tq, tk, tv, tdo = (torch.from_numpy(x).cuda() for x in (q, k, v, dout))
            tb = torch.from_numpy(bias).cuda()
            ref = [x.cpu().numpy() for x in torch_attention(torch, tq, tk, tv, tdo, tb, softcap,
                                                            torch.float64, Hq // Hkv)]
            base = [x.cpu().numpy() for x in torch_attention(torch, tq, tk, tv, tdo, tb, softcap,
                                                             torch.float32, Hq // Hkv)]
        checks = {}
        for what, got, want, b in zip(("out", "dq", "dk", "dv"), ours, ref, base):
            checks[what] = bench._agreement(got, want, b, np.float32, bench.MULT[what], None)
        ok = all(c["ok"] for c in checks.values())
        rows.append(dict(case=name, shape=(B, Hq, Hkv, Sq, Sk, d), ok=ok,
                         reference="NumPy explicit bias" if sim else (
                             SOFTCAP_REFERENCE[-1] + " float64" if softcap
                             else "SDPA MATH float64, explicit bias"),
                         seconds=round(time.perf_counter() - t0, 2), checks=checks))
        worst = max(c["max_err"] / c["bound"] for c in checks.values())
        print(f"{'OK  ' if ok else 'FAIL'} {name:50s} {str((B, Hq, Hkv, Sq, Sk, d)):28s} "
              f"max err/bound {worst:.3f}  ({rows[-1]['reference']})", flush=True)
    return rows


# ---------------------------------------------------------------------------------------
# Part 2: time


def timings(torch, repeats):
    B, H, N, d = 1, 16, 16384, 64
    torch.manual_seed(SEED)
    q, k, v, dout = (torch.randn(B, H, N, d, device="cuda") for _ in range(4))
    docs = np.arange(N) // 1024
    mask_np = docs[:, None] == docs[None, :]
    mask_dev = cuda.to_device(mask_np)
    mask_t = torch.from_numpy(mask_np).cuda()
    runs = [
        ("full causal", dict(causal=True)),
        ("window (256, 0) + causal", dict(causal=True, window_size=(256, 0))),
        ("full (no mask)", dict()),
        ("documents: bool attn_mask", dict(attn_mask=mask_dev)),
        ("documents: mask_mod", dict(mask_mod=documents_1024)),
    ]
    rows = []
    for name, opts in runs:
        def fwd(opts=opts):
            return numbaflash.attention(q, k, v, return_lse=True, **opts)
        out, lse = fwd()

        def fwd_bwd(opts=opts):
            o, l = numbaflash.attention(q, k, v, return_lse=True, **opts)
            return numbaflash.attention_backward(dout, q, k, v, o, l, **opts)
        fwd_bwd()
        f_ms = bench.time_ms(fwd, repeats=repeats, warmup=1)
        fb_ms = bench.time_ms(fwd_bwd, repeats=max(3, repeats // 2), warmup=1)
        rows.append(dict(run=name, forward_ms=f_ms, fwd_bwd_ms=fb_ms))
        print(f"{name:32s} forward {f_ms:9.2f} ms   fwd+bwd {fb_ms:9.2f} ms", flush=True)

    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    for name, kw in (("SDPA EFFICIENT causal", dict(is_causal=True)),
                     ("SDPA EFFICIENT documents (bool mask)", dict(attn_mask=mask_t))):
        def sdpa(kw=kw):
            with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, **kw)
        f_ms = bench.time_ms(sdpa, repeats=repeats, warmup=1)
        rows.append(dict(run=name, forward_ms=f_ms, fwd_bwd_ms=None))
        print(f"{name:32s} forward {f_ms:9.2f} ms", flush=True)
    by = {r["run"]: r for r in rows}
    for what in ("forward_ms", "fwd_bwd_ms"):
        w = by["full causal"][what] / by["window (256, 0) + causal"][what]
        dm = by["full (no mask)"][what] / by["documents: bool attn_mask"][what]
        dmm = by["full (no mask)"][what] / by["documents: mask_mod"][what]
        print(f"{what}: window 256 is {w:.1f}x faster than full causal; documents "
              f"{dm:.1f}x (attn_mask) and {dmm:.1f}x (mask_mod) faster than full")
    return rows


def targets(repeats):
    """Part 3 (module docstring): the package's variant bench (``bench.run_variants``,
    what ``python -m numbaflash bench --variants`` runs) in float32, then GQA in float16;
    its records, one line each (progress lines on stderr while it runs)."""
    rows = bench.run_variants(dtype="float32", repeats=repeats, warmup=1)
    rows += bench.run_variants(dtype="float16", cases=["GQA, causal"], repeats=repeats,
                               warmup=1)
    for r in rows:
        case = f"{r['case']} {r['dtype']} ({r['B']}, {r['Hq']}, {r['Hkv']}, {r['N']}, {r['d']})"
        if r["ms"] is None:
            print(f"{case:50s} {r['what']:8s} not timed: "
                  f"{'WRONG RESULT' if r['ok'] is False else r['note']}", flush=True)
        elif r["baseline_ms"] is None:
            print(f"{case:50s} {r['what']:8s} {r['ms']:9.2f} ms   {r['baseline']:34s} "
                  f"not timed ({r['baseline_note']})", flush=True)
        else:
            verdict = {True: "met", False: "NOT met", None: "not judged (not a GPU)"}
            target = "" if r["target"] is None else (
                f"   target {r['target']}: {verdict[r['met']]}")
            print(f"{case:50s} {r['what']:8s} {r['ms']:9.2f} ms   {r['baseline']:34s} "
                  f"{r['baseline_ms']:9.2f} ms   ratio {r['ratio']:6.3f}{target}", flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="folder for variants_gpu.json")
    ap.add_argument("--sim", action="store_true", help="tiny shapes, NumPy reference")
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--parts", default="agreement,times,targets",
                    help="comma-separated: agreement, times, targets (default: all)")
    args = ap.parse_args(argv)
    parts = set(args.parts.split(","))
    torch = None
    if not args.sim:
        torch = bench._torch_cuda()
        if torch is None:
            sys.exit("needs a CUDA GPU and PyTorch (or --sim under NUMBA_ENABLE_CUDASIM=1)")
    meta = bench.environment()
    print(json.dumps(meta), flush=True)
    rows, bad = [], []
    if "agreement" in parts:
        rows = agreement(SIM_CASES if args.sim else CASES, args.sim, torch)
        bad = [r["case"] for r in rows if not r["ok"]]
        print(f"agreement: {len(rows) - len(bad)} of {len(rows)} cases OK"
              + (f"; FAILED: {bad}" if bad else ""), flush=True)
    times = timings(torch, args.repeats) if "times" in parts and not args.sim else []
    goals = targets(args.repeats) if "targets" in parts and not args.sim else []
    wrong = sorted({f"{r['case']} {r['dtype']} {r['what']}" for r in bench.wrong_variants(goals)})
    if wrong:
        print(f"targets: WRONG RESULT (not timed): {wrong}", flush=True)
    bad += wrong
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "variants_gpu.json"), "w") as f:
            json.dump(bench._json_safe(dict(meta=meta, agreement=rows, timings=times,
                                            targets=goals)), f,
                      indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
