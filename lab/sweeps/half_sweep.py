"""The 16-bit kernels' knobs on a GPU: forward v10's tiles, chunk and register cap, forward
v7's tiles, backward v7's tiles, each checked and then timed against SDPA FLASH.

    python3 lab/sweeps/half_sweep.py [--forward v10:64:128:128:32:0,...] [--v7 64:128:128,...]
                                     [--backward 64:64x64:64x64,...] [--shapes 2x16x4096]
                                     [--dtype float16] [--repeats 10]

--forward d:Br:Bc:chunk:maxreg: make_forward_v10(Br, Bc, d, causal, chunk,
    max_registers=maxreg or None), launched directly (the chunk and the register cap are
    knobs the policy does not expose).
--v7 d:Br:Bc: numbaflash.attention(..., version="v7", tiles=(Br, Bc)) (v7's own chunk).
--backward d:BrxBc:BrxBc: numbaflash.attention_backward(..., version="v7",
    tiles=((Br, Bc), (Br, Bc))): the dK/dV kernel's tiles, then the dQ kernel's.
--v9 d:BrxBc:BrxBc: the same for backward v9 (after a line with v9's own tiles), whose
    gradients are v7's bits.

At (B, H, N, d) for each --shapes entry, causal (Sq = Sk) and not. Each result is compared
with the default call's (numbaflash.attention, and attention_backward version="v7" with
its default tiles): "same bits" where it matches exactly; otherwise the max error of the
first (batch, head) against numbaflash.reference in float64 is printed next to the
default's, and a result more than 2x the default's error (3x for gradients: TESTING.md's
factors) is marked WRONG and not timed. Timing: numbaflash.bench.time_ms (CUDA events,
median of --repeats after 3 warm-ups), one process, SDPA FLASH on the same tensors first.
Each line is printed as it comes. GPU only.
"""

import argparse
import sys

import ml_dtypes
import numpy as np
from numba import cuda

import numbaflash
from numbaflash import reference
from numbaflash.bench import time_ms
from numbaflash.kernels import smem
from numbaflash.kernels.forward import v10_ldmatrix as v10

DEFAULT_FORWARD = ("64:128:128:32:0,64:128:128:32:128,64:64:128:32:0,64:64:64:32:0,"
                   "64:128:128:64:0,128:128:64:16:0,128:64:64:16:0,128:64:64:16:128,"
                   "128:64:32:16:0,128:128:128:16:0")
DEFAULT_V7 = "64:128:128,64:64:128,128:128:64,128:64:64"
DEFAULT_BACKWARD = ("64:64x128:64x64,64:128x64:64x64,64:64x64:128x64,64:64x64:64x128,"
                    "128:64x64:64x64,128:32x64:128x64")
DEFAULT_V9 = "64:64x128:64x64,64:64x64:128x64,128:64x64:64x64,128:32x64:64x32"


def parse(items, kinds):
    out = {}
    for item in filter(None, items.split(",")):
        fields = item.split(":")
        out.setdefault(int(fields[0]), []).append(tuple(kinds(f) for f in fields[1:]))
    return out


def pair(text):
    Br, Bc = text.split("x")
    return int(Br), int(Bc)


def sdpa_flash(torch, tq, tk, tv, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def forward():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv,
                                                                    is_causal=causal)
    out = forward()
    grad = torch.randn_like(out)
    rq, rk, rv = (x.detach().requires_grad_(True) for x in (tq, tk, tv))

    def backward():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            o = torch.nn.functional.scaled_dot_product_attention(rq, rk, rv, is_causal=causal)
        o.backward(grad)
    return forward, backward


def v10_call(q, k, v, causal, d, Br, Bc, chunk, maxreg, half):
    """make_forward_v10 launched on (B, H, N, d) device arrays: a function returning O,
    and the kernel's registers and local memory per thread."""
    kernel = v10.make_forward_v10(Br, Bc, d, bool(causal), chunk, half=half,
                                  max_registers=maxreg or None)
    B, H, N, _ = q.shape
    Q, K, V = (x.reshape(B * H, N, d) for x in (q, k, v))
    nbytes = v10.v10_shared_bytes(Br, Bc, d)

    def call():
        O = cuda.device_array((B * H, N, d), Q.dtype)
        L = cuda.device_array((B * H, N), np.float32)
        args = (Q, K, V, O, L, np.float32(1 / np.sqrt(d)), np.int64(0))
        smem.allow_dynamic_shared_memory(kernel, args, nbytes)
        kernel[((N + Br - 1) // Br, B * H), (2 * Br,), 0, nbytes](*args)
        return O.reshape(B, H, N, d)
    call()
    one = lambda x: next(iter(x.values())) if isinstance(x, dict) else x  # noqa: E731
    return call, one(kernel.get_regs_per_thread()), one(kernel.get_local_mem_per_thread())


def host64(x, dtype):
    a = x.copy_to_host() if hasattr(x, "copy_to_host") else np.asarray(x)
    if dtype == np.dtype(ml_dtypes.bfloat16):
        a = a.view(ml_dtypes.bfloat16)
    return a.astype(np.float64)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--forward", default=DEFAULT_FORWARD, help="d:Br:Bc:chunk:maxreg,...")
    ap.add_argument("--v7", default=DEFAULT_V7, help="d:Br:Bc,...")
    ap.add_argument("--backward", default=DEFAULT_BACKWARD, help="d:BrxBc:BrxBc,...")
    ap.add_argument("--v9", default=DEFAULT_V9, help="backward v9: d:BrxBc:BrxBc,...")
    ap.add_argument("--shapes", default="2x16x4096", help="BxHxN,... (d from the configs)")
    ap.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    import torch

    forward_cfg, v7_cfg = parse(args.forward, int), parse(args.v7, int)
    backward_cfg, v9_cfg = parse(args.backward, pair), parse(args.v9, pair)
    dims = sorted(set(forward_cfg) | set(v7_cfg) | set(backward_cfg) | set(v9_cfg))
    tdtype = {"float16": torch.float16, "bfloat16": torch.bfloat16}[args.dtype]
    npdtype = np.dtype(ml_dtypes.bfloat16) if args.dtype == "bfloat16" else np.dtype("float16")
    ok = True
    print("columns: d, causal, what, registers, local bytes, check, ms, ratio to SDPA FLASH",
          flush=True)
    for shape in args.shapes.split(","):
        B, H, N = (int(x) for x in shape.split("x"))
        for d in dims:
            gen = torch.Generator(device="cuda").manual_seed(0)
            tq, tk, tv, tdo = (torch.randn((B, H, N, d), device="cuda", dtype=tdtype,
                                           generator=gen) for _ in range(4))

            def view(t):
                if t.dtype == torch.bfloat16:
                    return cuda.as_cuda_array(t.view(torch.int16)).view(ml_dtypes.bfloat16)
                return cuda.as_cuda_array(t)
            q, k, v, do = (view(t) for t in (tq, tk, tv, tdo))
            hq, hk, hv, hdo = (host64(x[0, 0], npdtype) for x in (q, k, v, do))
            for causal in (False, True):
                tag = f"({B}, {H}, {N}, {d}) {'causal' if causal else 'full'}"
                flops = 4 * B * H * N * N * d * (0.5 if causal else 1.0)
                sdpa_fwd, sdpa_bwd = sdpa_flash(torch, tq, tk, tv, causal)
                flash_fwd = time_ms(sdpa_fwd, args.repeats, 3)
                flash_bwd = time_ms(sdpa_bwd, args.repeats, 3)
                print(f"{tag} SDPA FLASH forward {flash_fwd:.3f} ms "
                      f"({flops / flash_fwd / 1e9:.0f} TFLOP/s), forward+backward "
                      f"{flash_bwd:.3f} ms", flush=True)
                ref_o, _ = reference.forward(hq, hk, hv, causal=causal)
                out, lse = numbaflash.attention(q, k, v, causal=causal, return_lse=True)
                base_o = host64(out, npdtype)
                base_err = float(np.abs(base_o[0, 0] - ref_o).max())

                def default_fwd():
                    return numbaflash.attention(q, k, v, causal=causal)
                runs = [("forward default", default_fwd, "-", "-")]
                for Br, Bc, chunk, maxreg in forward_cfg.get(d, ()):
                    call, regs, local = v10_call(q, k, v, causal, d, Br, Bc, chunk, maxreg,
                                                 args.dtype)
                    runs.append((f"v10 ({Br}, {Bc}) chunk {chunk} maxreg {maxreg or '-'}",
                                 call, regs, local))
                for Br, Bc in v7_cfg.get(d, ()):
                    runs.append((f"v7 ({Br}, {Bc})",
                                 lambda t=(Br, Bc): numbaflash.attention(
                                     q, k, v, causal=causal, version="v7", tiles=t), "-", "-"))
                for name, call, regs, local in runs:
                    got = host64(call(), npdtype)
                    if np.array_equal(got, base_o, equal_nan=True):
                        check = "same bits"
                    else:
                        err = float(np.abs(got[0, 0] - ref_o).max())
                        check = f"err {err:.3g} (default {base_err:.3g})"
                        if not err <= 2 * base_err:
                            ok = False
                            print(f"{tag} {name} {regs} {local} {check} WRONG, not timed",
                                  flush=True)
                            continue
                    ms = time_ms(call, args.repeats, 3)
                    print(f"{tag} {name} regs {regs} local {local} {check} {ms:.3f} ms "
                          f"{flash_fwd / ms:.3f}x", flush=True)

                # Backward v7 (the default forward's out and lse), tiles per kernel.
                ref_grads = reference.backward(hdo, hq, hk, hv, causal=causal)
                base = numbaflash.attention_backward(do, q, k, v, out, lse, causal=causal,
                                                     version="v7")
                base_g = [host64(g, npdtype) for g in base]
                base_errs = [float(np.abs(g[0, 0] - r).max()) for g, r in zip(base_g, ref_grads)]
                configs = ([("v7", None)] + [("v7", t) for t in backward_cfg.get(d, ())]
                           + ([("v9", None)] if d in v9_cfg else [])
                           + [("v9", t) for t in v9_cfg.get(d, ())])
                for version, tiles in configs:
                    def call(version=version, t=tiles):
                        return numbaflash.attention_backward(do, q, k, v, out, lse,
                                                             causal=causal, version=version,
                                                             tiles=t)
                    name = (f"backward {version} default tiles" if tiles is None else
                            f"backward {version} dkdv {tiles[0]} dq {tiles[1]}")
                    got = [host64(g, npdtype) for g in call()]
                    if all(np.array_equal(a, b, equal_nan=True) for a, b in zip(got, base_g)):
                        check = "same bits"
                    else:
                        errs = [float(np.abs(g[0, 0] - r).max()) for g, r in zip(got, ref_grads)]
                        check = "errs " + ", ".join(f"{e:.3g}/{b:.3g}"
                                                    for e, b in zip(errs, base_errs))
                        if not all(e <= 3 * b for e, b in zip(errs, base_errs)):
                            ok = False
                            print(f"{tag} {name} {check} WRONG, not timed", flush=True)
                            continue
                    ms = time_ms(call, args.repeats, 3)
                    print(f"{tag} {name} {check} {ms:.3f} ms (SDPA FLASH forward+backward "
                          f"{flash_bwd:.3f} ms)", flush=True)
    print("half_sweep:", "all checks passed" if ok else "SOME RESULTS WRONG", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
