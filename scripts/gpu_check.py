"""GPU check: numbaflash against PyTorch SDPA on the same inputs, then timings.

Run on a machine with a CUDA GPU and PyTorch (no simulator):

    python scripts/gpu_check.py [--out DIR] [--skip-timing]

1. Versions: date, GPU, driver, Python, numba, numba-cuda, numpy, torch.
2. Agreement: for each case, numbaflash (every forward version) against PyTorch SDPA's
   MATH backend in float64 on the same inputs. Bound (TESTING.md's rule, with PyTorch's
   float32 MATH backend, TF32 off, as the naive same-precision baseline):
       max|ours - ref64| <= 2 * max|sdpa_fp32_math - ref64| + 2 * spacing(max|ref64|)
   Bottom-right causal is given to SDPA as an explicit boolean mask (its is_causal is
   top-left).
3. Backward agreement: numbaflash.attention_backward against PyTorch autograd through
   SDPA MATH in float64, same rule with multipliers dQ 5, dK 3, dV 3 (baseline: autograd
   through SDPA MATH in float32, TF32 off). Rows that see no key are left out of the
   PyTorch computation (their gradient contributions are 0 by definition, and SDPA's MATH
   gives NaN for them); numbaflash must give exactly 0 in their dQ rows.
4. Determinism: 50 backward runs at (8, 16, 2048, 64) must be bitwise identical.
5. Memory: device memory the backward allocates beyond its outputs, at (1, 16, 16384, 64),
   read from the driver with deallocation deferred (nothing is freed during the call).
6. Timing: forward, backward, forward+backward at (2, 16, 4096, 64) and (2, 16, 4096, 128),
   numbaflash against SDPA float32 EFFICIENT, CUDA events, median after warm-up.

Prints a table and writes gpu_check.json (and the same text) into --out.
"""

import argparse
import datetime
import json
import platform
import sys
import time

import numpy as np
import torch
from numba import cuda
import numba

import numbaflash
from numbaflash import masks
from numbaflash.bench import flops, time_ms

from numbaflash.kernels.forward import VERSIONS as FORWARD_VERSIONS

RESULTS = {"agreement": [], "backward_agreement": [], "timing": []}


def versions():
    import importlib.metadata as md
    dev = torch.cuda.get_device_properties(0)
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": dev.name, "sm_count": dev.multi_processor_count,
        "driver_cuda": ".".join(map(str, cuda.cudadrv.driver.driver.get_version())),
        "python": platform.python_version(), "numba": numba.__version__,
        "numba_cuda": md.version("numba-cuda"), "numpy": np.__version__,
        "torch": torch.__version__,
    }


def sdpa(q, k, v, causal, backend):
    """PyTorch SDPA with an explicit mask for the bottom-right alignment."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    Sq, Sk = q.shape[-2], k.shape[-2]
    mask, is_causal = None, False
    if causal == "top_left":
        is_causal = True
    elif causal == "bottom_right":
        mask = torch.from_numpy(masks.visible(Sq, Sk, "bottom_right")).to(q.device)
    be = {"math": SDPBackend.MATH, "efficient": SDPBackend.EFFICIENT_ATTENTION}[backend]
    with sdpa_kernel(be):
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal)


def agreement(case, rng):
    B, H, Sq, Sk, d, causal, dtype = case
    npdt = np.dtype(dtype)
    q, k, v = (rng.uniform(-4, 4, (B, H, S, d)).astype(npdt) for S in (Sq, Sk, Sk))
    t64 = [torch.from_numpy(a.astype(np.float64)).cuda() for a in (q, k, v)]
    ref = sdpa(*t64, causal, "math")
    torch.backends.cuda.matmul.allow_tf32 = False
    base_dt = torch.float64 if dtype == "float64" else torch.float32
    base = sdpa(*[t.to(base_dt) for t in t64], causal, "math").double()
    # Rows that see no key: SDPA's MATH gives NaN there; numbaflash gives exactly 0.
    seen = torch.from_numpy(masks.visible(Sq, Sk, causal).any(axis=1)).cuda()
    ref = torch.where(seen[:, None], ref, 0.0)
    base = torch.where(seen[:, None], base, 0.0)
    base_err = (base - ref).abs().max().item()
    bound = 2 * base_err + 2 * np.spacing(ref.abs().max().item())
    if dtype == "float64":
        bound = 1e-12 * max(1.0, ref.abs().max().item())
    qd, kd, vd = (cuda.to_device(a) for a in (q, k, v))
    for version in FORWARD_VERSIONS:
        try:
            out = numbaflash.attention(qd, kd, vd, causal=causal, version=version)
        except ValueError as e:           # a version that cannot run this input says why
            print(f"{str((B, H, Sq, Sk, d)):28s} {str(causal):13s} {dtype:8s} {version}  "
                  f"not run: {e}", flush=True)
            continue
        out = out.copy_to_host()
        got = torch.from_numpy(out.astype(np.float64)).cuda()
        err = (got - ref).abs().max().item()
        masked_zero = bool((got[..., ~seen, :] == 0).all().item())
        ok = bool(err <= bound and masked_zero and not torch.isnan(got).any().item())
        row = dict(shape=[B, H, Sq, Sk, d], causal=causal, dtype=dtype, version=version,
                   err=err, baseline_err=base_err, bound=bound, ok=ok)
        RESULTS["agreement"].append(row)
        print(f"{str((B, H, Sq, Sk, d)):28s} {str(causal):13s} {dtype:8s} {version}  "
              f"err {err:.2e}  bound {bound:.2e}  {'ok' if ok else 'FAIL'}", flush=True)


def backward_agreement(case, rng):
    B, H, Sq, Sk, d, causal, dtype = case
    npdt = np.dtype(dtype)
    q, k, v = (rng.uniform(-4, 4, (B, H, S, d)).astype(npdt) for S in (Sq, Sk, Sk))
    dout = rng.uniform(-1, 1, (B, H, Sq, d)).astype(npdt)
    vis = masks.visible(Sq, Sk, causal)
    seen = vis.any(axis=1)                       # rows that see at least one key

    def torch_grads(tdtype):
        qt, kt, vt, dot = (torch.from_numpy(a).to("cuda", tdtype) for a in (q, k, v, dout))
        qs = qt[:, :, seen].clone().requires_grad_()
        kt.requires_grad_()
        vt.requires_grad_()
        mask = torch.from_numpy(vis[seen]).cuda()
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel(SDPBackend.MATH):
            o = torch.nn.functional.scaled_dot_product_attention(qs, kt, vt, attn_mask=mask)
        o.backward(dot[:, :, seen])
        dq = torch.zeros_like(qt)
        dq[:, :, seen] = qs.grad
        return [g.double() for g in (dq, kt.grad, vt.grad)]

    torch.backends.cuda.matmul.allow_tf32 = False
    ref = torch_grads(torch.float64)
    base = torch_grads(torch.float64 if dtype == "float64" else torch.float32)
    qd, kd, vd, dod = (cuda.to_device(a) for a in (q, k, v, dout))
    out, lse = numbaflash.attention(qd, kd, vd, causal=causal, return_lse=True)
    grads = numbaflash.attention_backward(dod, qd, kd, vd, out, lse, causal=causal)
    row = dict(shape=[B, H, Sq, Sk, d], causal=causal, dtype=dtype, ok=True)
    for name, mult, got, r, b in zip(("dq", "dk", "dv"), (5, 3, 3), grads, ref, base):
        got = torch.from_numpy(got.copy_to_host().astype(np.float64)).cuda()
        err = (got - r).abs().max().item()
        base_err = (b - r).abs().max().item()
        bound = mult * base_err + 2 * np.spacing(r.abs().max().item())
        if dtype == "float64":
            bound = 1e-12 * max(1.0, r.abs().max().item())
        ok = bool(err <= bound and not torch.isnan(got).any().item())
        if name == "dq":
            ok = ok and bool((got[:, :, ~torch.from_numpy(seen).cuda()] == 0).all().item())
        row[name] = dict(err=err, baseline_err=base_err, bound=bound, ok=ok)
        row["ok"] = row["ok"] and ok
    RESULTS["backward_agreement"].append(row)
    print(f"backward {str((B, H, Sq, Sk, d)):24s} {str(causal):13s} {dtype:8s} " + "  ".join(
        f"{n} {row[n]['err']:.2e}/{row[n]['bound']:.2e}" for n in ("dq", "dk", "dv"))
        + ("  ok" if row["ok"] else "  FAIL"), flush=True)


def determinism(runs=50, shape=(8, 16, 2048, 64)):
    """Rerun forward and backward; every rerun must equal the first bitwise."""
    rng = np.random.default_rng(1)
    q, k, v, dout = (cuda.to_device(rng.standard_normal(shape).astype(np.float32)) for _ in range(4))
    first = None
    same = True
    for _ in range(runs):
        out, lse = numbaflash.attention(q, k, v, causal=True, return_lse=True)
        grads = numbaflash.attention_backward(dout, q, k, v, out, lse, causal=True)
        now = [a.copy_to_host() for a in (out, lse, *grads)]
        if first is None:
            first = now
        else:
            same = same and all(np.array_equal(a, b) for a, b in zip(first, now))
    RESULTS["determinism"] = dict(shape=list(shape), runs=runs, causal=True,
                                  bitwise_identical=bool(same))
    print(f"determinism: {runs} runs of forward + backward at {shape}, causal: "
          f"{'bitwise identical' if same else 'DIFFERENT'}", flush=True)
    return same


def memory(shape=(1, 16, 16384, 64)):
    """Device memory that attention_backward allocates beyond its three outputs."""
    rng = np.random.default_rng(2)
    q, k, v, dout = (cuda.to_device(rng.standard_normal(shape).astype(np.float32)) for _ in range(4))
    out, lse = numbaflash.attention(q, k, v, return_lse=True)
    cuda.synchronize()
    ctx = cuda.current_context()
    outputs = 3 * q.nbytes
    with cuda.defer_cleanup():            # nothing allocated during the call is freed in it
        free0 = ctx.get_memory_info().free
        grads = numbaflash.attention_backward(dout, q, k, v, out, lse)
        cuda.synchronize()
        free1 = ctx.get_memory_info().free
    B, H, N, d = shape
    used = free0 - free1
    extra = used - outputs
    nxn = B * H * N * N * 4
    RESULTS["memory"] = dict(shape=list(shape), device_bytes_during_backward=used,
                             output_bytes=outputs, extra_bytes=extra,
                             one_fp32_NxN_per_head_bytes=nxn)
    print(f"memory: backward at {shape} took {used / 2**20:.1f} MiB of device memory, "
          f"{outputs / 2**20:.1f} MiB of it the gradients: extra {extra / 2**20:.1f} MiB "
          f"(an fp32 N x N matrix per head would be {nxn / 2**30:.1f} GiB)", flush=True)
    del grads


def timing(shape, causal):
    """Times with numbaflash.bench's helpers: ``time_ms`` (CUDA events on the default
    stream, where numbaflash and PyTorch both launch; median after warm-up) and ``flops``
    (forward 4*B*H*N*N*d, causal half, backward 2.5x, fwd+bwd 3.5x)."""
    B, H, N, d = shape
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, H, N, d, device="cuda", generator=g) for _ in range(3))
    qd, kd, vd = (cuda.as_cuda_array(t) for t in (q, k, v))
    mode = "top_left" if causal else False   # Sq == Sk: both alignments are the same mask
    rows = {}
    rows["forward", "sdpa_efficient"] = time_ms(lambda: sdpa(q, k, v, mode, "efficient"))
    for version in FORWARD_VERSIONS:
        rows["forward", f"numbaflash_{version}"] = time_ms(
            lambda: numbaflash.attention(qd, kd, vd, causal=mode, version=version),
            repeats=5 if version == "v1" else 20)
    rows["forward", "numbaflash_default"] = time_ms(
        lambda: numbaflash.attention(qd, kd, vd, causal=mode))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    dout = torch.randn_like(q)
    o = sdpa(qg, kg, vg, mode, "efficient")
    rows["backward", "sdpa_efficient"] = time_ms(
        lambda: torch.autograd.grad(o, (qg, kg, vg), dout, retain_graph=True))
    rows["fwd+bwd", "sdpa_efficient"] = time_ms(
        lambda: torch.autograd.grad(sdpa(qg, kg, vg, mode, "efficient"), (qg, kg, vg), dout))
    dd = cuda.as_cuda_array(dout)
    out, lse = numbaflash.attention(qd, kd, vd, causal=mode, return_lse=True)
    rows["backward", "numbaflash"] = time_ms(
        lambda: numbaflash.attention_backward(dd, qd, kd, vd, out, lse, causal=mode), repeats=5)

    def fwd_bwd():
        o2, l2 = numbaflash.attention(qd, kd, vd, causal=mode, return_lse=True)
        numbaflash.attention_backward(dd, qd, kd, vd, o2, l2, causal=mode)
    rows["fwd+bwd", "numbaflash"] = time_ms(fwd_bwd, repeats=5)
    for (what, name), ms in rows.items():
        work = flops(B, H, N, N, d, causal, what)
        r = dict(shape=list(shape), causal=causal, what=what, impl=name, ms=ms,
                 tflops=work / ms / 1e9, vs_sdpa=rows[what, "sdpa_efficient"] / ms)
        RESULTS["timing"].append(r)
        print(f"{what:8s} {str(shape):20s} causal={causal!s:5s} {name:18s} {ms:9.3f} ms "
              f"{r['tflops']:6.2f} TFLOP/s  {r['vs_sdpa']:.3f}x SDPA", flush=True)


BACKWARD_CASES = [
    (2, 8, 4096, 4096, 64, None, "float32"),
    (2, 8, 4096, 4096, 64, "bottom_right", "float32"),
    (1, 8, 4096, 4096, 128, "top_left", "float32"),
    (1, 4, 1000, 3000, 128, "bottom_right", "float32"),
    (1, 4, 3000, 1000, 64, "bottom_right", "float32"),   # fully masked rows
    (2, 3, 1025, 97, 59, "top_left", "float32"),
    (1, 2, 513, 257, 256, "bottom_right", "float32"),
    (1, 4, 1024, 1024, 64, "bottom_right", "float64"),
]


def save(out_dir):
    """Write what is known so far (a run cut short by a timeout still leaves its results)."""
    with open(f"{out_dir}/gpu_check.json", "w") as f:
        json.dump(RESULTS, f, indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--skip-timing", action="store_true")
    args = ap.parse_args()
    RESULTS["versions"] = versions()
    print(json.dumps(RESULTS["versions"]), flush=True)
    print("backend:", numbaflash.backend(), flush=True)
    rng = np.random.default_rng(0)
    cases = [
        (2, 16, 4096, 4096, 64, None, "float32"),
        (2, 16, 4096, 4096, 64, "bottom_right", "float32"),
        (1, 8, 4096, 4096, 128, None, "float32"),
        (1, 8, 4096, 4096, 128, "top_left", "float32"),
        (1, 4, 1000, 3000, 128, "bottom_right", "float32"),
        (1, 4, 3000, 1000, 64, "bottom_right", "float32"),   # fully masked rows
        (1, 4, 3000, 1000, 64, "top_left", "float32"),
        (2, 3, 1025, 97, 59, None, "float32"),
        (1, 2, 777, 1023, 111, "bottom_right", "float32"),
        (1, 2, 513, 257, 256, "bottom_right", "float32"),
        (1, 4, 1024, 1024, 64, "bottom_right", "float64"),
        (1, 2, 300, 700, 256, None, "float64"),
    ]
    t0 = time.time()
    for case in cases:
        agreement(case, rng)
    print(f"agreement: {time.time() - t0:.1f} s", flush=True)
    save(args.out)
    t0 = time.time()
    for case in BACKWARD_CASES:
        backward_agreement(case, rng)
    print(f"backward agreement: {time.time() - t0:.1f} s", flush=True)
    deterministic = determinism()
    memory()
    save(args.out)
    if not args.skip_timing:
        for shape in ((2, 16, 4096, 64), (2, 16, 4096, 128), (1, 16, 16384, 64)):
            for causal in (False, True):
                timing(shape, causal)
                save(args.out)
    ok = deterministic and all(r["ok"] for r in RESULTS["agreement"] + RESULTS["backward_agreement"])
    RESULTS["all_ok"] = ok
    save(args.out)
    print("ALL OK" if ok else "SOME CASES FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
