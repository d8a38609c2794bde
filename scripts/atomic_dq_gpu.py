"""Backward v8 (dQ by atomic adds, deterministic=False) on a GPU: agreement, reruns, speed.

    python scripts/atomic_dq_gpu.py [--parts agreement,reruns,speed] [--repeats 10]
                                    [--reruns 50] [--no-register-cap]

1. agreement: backward v8 in float32 and float16 on ragged shapes (Sq != Sk, both causal
   alignments, rows that see no key, GQA), against ``numbaflash.reference`` in float64 by
   the bench's rule, whose baseline is the same formula in the inputs' dtype
   (``bench._agreement``; gradients with the bench's multipliers); and that
   ``deterministic=False`` plans v8 here.
2. reruns: v8 ``--reruns`` times on the same float32 inputs (causal, and GQA): how many
   runs give dq, and dk and dv, the same bits as the first. dk and dv must (v6's fixed
   order); dq need not (the atomic adds' order), and its largest difference from the
   first run is printed.
3. speed, float32, at (2, 16, 4096, 64), (2, 16, 4096, 128), (1, 16, 16384, 64), causal
   and not: the backward alone (given out and lse) with v6 (the default) and with v8, and
   forward + backward (the default forward) with each, against PyTorch SDPA MATH (TF32
   off) and EFFICIENT forward + backward on the same tensors, in ms and TFLOP/s (the
   bench's convention).

``--no-register-cap`` builds v8 without its register cap at d = 64
(v8_atomic_dq.V8_MAX_REGISTERS), to time the uncapped kernel. Timing:
``numbaflash.bench.time_ms`` (CUDA events, median of ``--repeats`` after 3 warm-ups), one
process. GPU only. Every line is printed as it comes (flush).
"""

import argparse
import os
import sys

import numpy as np
from numba import cuda

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

import numbaflash  # noqa: E402
from numbaflash import bench, reference  # noqa: E402
from numbaflash.kernels.backward import v8_atomic_dq  # noqa: E402
from numbaflash.masks import visible  # noqa: E402

SHAPES = ((2, 16, 4096, 4096, 64), (2, 16, 4096, 4096, 128), (1, 16, 16384, 16384, 64))
BACKWARDS = ("v6", "v8")        # the default (deterministic) and dQ by atomic adds


def _check(name, got, want, base, dtype, mult, zero_rows=None):
    c = bench._agreement(np.asarray(got, np.float64), want, base, dtype, mult, zero_rows)
    print(f"  {name}: max err {c['max_err']:.3g}, bound {c['bound']:.3g}: "
          f"{'ok' if c['ok'] else 'WRONG'}", flush=True)
    return c["ok"]


def agreement():
    rng = np.random.default_rng(1)
    cases = [  # (B, H, Hkv, Sq, Sk, d, causal)
        (1, 4, 4, 777, 1000, 64, None),
        (1, 4, 2, 1000, 513, 128, "bottom_right"),     # 487 rows see no key; GQA
        (2, 2, 2, 640, 640, 128, "top_left"),
        (2, 8, 1, 300, 333, 59, "bottom_right"),       # MQA, an odd head dim
    ]
    ok = True
    for name in ("float32", "float16"):
        dtype = np.dtype(name)
        for B, H, Hkv, Sq, Sk, d, causal in cases:
            q, dout = (rng.standard_normal((B, H, Sq, d)).astype(dtype) for _ in range(2))
            k, v = (rng.standard_normal((B, Hkv, Sk, d)).astype(dtype) for _ in range(2))
            print(f"{name} {(B, H, Hkv, Sq, Sk, d)} causal={causal}", flush=True)
            plans = numbaflash.explain_backward(q, k, v, causal=causal, deterministic=False)
            print(f"  deterministic=False plans {[p.kernel for p in plans]}", flush=True)
            ok &= plans[-1].version == "v8"
            out, lse = numbaflash.attention(q, k, v, causal=causal, return_lse=True)
            want = reference.backward(dout, q, k, v, causal=causal)
            base = reference.backward(dout, q, k, v, causal=causal, dtype=dtype.type)
            rows = ~visible(Sq, Sk, causal).any(axis=1)         # rows that see no key
            grads = numbaflash.attention_backward(dout, q, k, v, out, lse, causal=causal,
                                                  deterministic=False)
            for g_name, g, w, b, mult, zero in zip(("dq", "dk", "dv"), grads, want, base,
                                                   (5, 3, 3), (rows, None, None)):
                ok &= _check(f"{g_name} (backward v8)", g, w, b, dtype, mult, zero)
    return ok


def reruns(torch, n):
    ok = True
    for shape, Hkv in (((2, 8, 2048, 128), 8), ((2, 8, 2048, 64), 2)):
        g = torch.Generator(device="cuda").manual_seed(2)
        B, H, S, d = shape
        qt, dot = (torch.randn(shape, device="cuda", generator=g) for _ in range(2))
        kt, vt = (torch.randn((B, Hkv, S, d), device="cuda", generator=g) for _ in range(2))
        q, k, v, dout = (cuda.as_cuda_array(x) for x in (qt, kt, vt, dot))
        out, lse = numbaflash.attention(q, k, v, causal=True, return_lse=True)
        first = [x.copy_to_host() for x in numbaflash.attention_backward(
            dout, q, k, v, out, lse, causal=True, version="v8")]
        same_dq = same_dkdv = 0
        worst = 0.0
        for _ in range(n):
            grads = [x.copy_to_host() for x in numbaflash.attention_backward(
                dout, q, k, v, out, lse, causal=True, version="v8")]
            same_dq += np.array_equal(grads[0].view(np.uint32), first[0].view(np.uint32))
            same_dkdv += all(np.array_equal(a.view(np.uint32), b.view(np.uint32))
                             for a, b in zip(grads[1:], first[1:]))
            worst = max(worst, float(np.abs(grads[0] - first[0]).max()))
        print(f"reruns float32 {shape} Hkv={Hkv} causal backward v8: dq {same_dq} of {n} "
              f"bitwise the first (largest difference {worst:.3g}, max |dq| "
              f"{float(np.abs(first[0]).max()):.3g}); dk and dv {same_dkdv} of {n}",
              flush=True)
        ok &= same_dkdv == n
    return ok


def speed(torch, repeats):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.backends.cuda.matmul.allow_tf32 = False       # MATH: plain float32 products

    def ms(fn):
        return bench.time_ms(fn, repeats=repeats, warmup=3)

    def tflops(B, H, Sq, Sk, d, causal, what, t):
        return bench.flops(B, H, Sq, Sk, d, causal, what) / (t * 1e-3) / 1e12

    for B, H, Sq, Sk, d in SHAPES:
        for causal in (False, True):
            g = torch.Generator(device="cuda").manual_seed(0)
            qt, kt, vt, dot = (torch.randn((B, H, S, d), device="cuda", generator=g)
                               for S in (Sq, Sk, Sk, Sq))
            q, k, v, dout = (cuda.as_cuda_array(x) for x in (qt, kt, vt, dot))
            mode = "bottom_right" if causal else None
            out, lse = numbaflash.attention(q, k, v, causal=mode, return_lse=True)
            line = [f"float32 {(B, H, Sq, Sk, d)} causal={causal}:"]
            for version in BACKWARDS:
                t = ms(lambda version=version: numbaflash.attention_backward(
                    dout, q, k, v, out, lse, causal=mode, version=version))
                line.append(f"backward {version} {t:.3f} ms "
                            f"({tflops(B, H, Sq, Sk, d, causal, 'backward', t):.1f} TFLOP/s)")
            for version in BACKWARDS:
                def fb(version=version):
                    o, L = numbaflash.attention(q, k, v, causal=mode, return_lse=True)
                    numbaflash.attention_backward(dout, q, k, v, o, L, causal=mode,
                                                  version=version)
                t = ms(fb)
                line.append(f"fwd+bwd {version} {t:.3f} ms "
                            f"({tflops(B, H, Sq, Sk, d, causal, 'fwd+bwd', t):.1f} TFLOP/s)")
            qr, kr, vr = (x.detach().requires_grad_() for x in (qt, kt, vt))
            for backend in (SDPBackend.MATH, SDPBackend.EFFICIENT_ATTENTION):
                with sdpa_kernel(backend):
                    def sdpa_fb():
                        o = F.scaled_dot_product_attention(qr, kr, vr, is_causal=causal)
                        o.backward(dot)
                    t = ms(sdpa_fb)
                line.append(f"SDPA {backend.name} fwd+bwd {t:.3f} ms "
                            f"({tflops(B, H, Sq, Sk, d, causal, 'fwd+bwd', t):.1f} TFLOP/s)")
            print(" ".join(line[:1]) + " " + "; ".join(line[1:]), flush=True)
            torch.cuda.empty_cache()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="agreement,reruns,speed")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--reruns", type=int, default=50)
    ap.add_argument("--no-register-cap", action="store_true",
                    help="build v8 without its register cap at d <= 64")
    args = ap.parse_args(argv)
    if not cuda.is_available():
        sys.exit("atomic_dq_gpu.py needs a CUDA GPU")
    if args.no_register_cap:
        v8_atomic_dq.V8_MAX_REGISTERS = None            # before any v8 kernel is built
    print(f"backward v8, register cap at d <= {v8_atomic_dq.V8_CAP_MAX_HEAD_DIM}: "
          f"{v8_atomic_dq.V8_MAX_REGISTERS}", flush=True)
    import torch
    parts = args.parts.split(",")
    ok = True
    if "agreement" in parts:
        ok &= agreement()
    if "reruns" in parts:
        ok &= reruns(torch, args.reruns)
    if "speed" in parts:
        speed(torch, args.repeats)
    print("atomic_dq_gpu:", "all checks passed" if ok else "SOME CHECKS FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
