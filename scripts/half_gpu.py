"""float16 and bfloat16 on a GPU: agreement, bitwise reruns, and the time against SDPA FLASH.

    python scripts/half_gpu.py [--parts agreement,reruns,speed] [--dtypes float16,bfloat16]
                               [--repeats 10] [--reruns 50] [--forward-versions default,v10]
                               [--backward-versions v6,v7,v9]

1. agreement: the forward default (v10, the 16-bit tensor cores), backward v6 (3xTF32),
   v7 and v9 (the 16-bit tensor cores; v9 the default; ``--backward-versions``
   picks) on ragged shapes (Sq != Sk, both causal alignments, rows that see no key, bfloat16 inputs up to 2^20), against
   ``numbaflash.reference`` in float64 by the bench's rule, whose baseline is the same
   formula in the inputs' dtype (``bench._agreement``; gradients with the bench's
   multipliers). Each forward named by ``--forward-versions`` besides the default (e.g.
   v7) is checked on the same cases, out and lse by the same rule.
2. reruns: each backward version (v6, v7, v9) ``--reruns`` times on the same inputs:
   every run's dq, dk, dv the same bits as the first (deterministic: no atomics).
3. speed: the issue's shapes, (2, 16, 4096, 64), (2, 16, 4096, 128), (1, 16, 16384, 64),
   causal and not: the forward (default v10) and forward + backward (with backward v6,
   v7 and v9, the default) against PyTorch SDPA FLASH on the same tensors, as
   ratios (SDPA's time / numbaflash's; the targets: forward 0.5x, forward + backward 0.4x).
   ``--forward-versions`` (default: ``default``, the policy's forward alone) times each
   forward named there side by side in the same process, on the same tensors, against the
   same SDPA FLASH reading: ``--forward-versions default,v7,v10`` puts v10 next to v7.
   forward + backward runs with the default forward.

Timing: ``numbaflash.bench.time_ms`` (CUDA events, median of ``--repeats`` after 3
warm-ups), one process. GPU only. Every line is printed as it comes (flush).
"""

import argparse
import sys

import ml_dtypes
import numpy as np
from numba import cuda

import numbaflash
from numbaflash import bench, reference

SHAPES = ((2, 16, 4096, 4096, 64), (2, 16, 4096, 4096, 128), (1, 16, 16384, 16384, 64))
TARGETS = {"forward": 0.5, "fwd+bwd": 0.4}
BACKWARDS = ("v6", "v7", "v9")  # 3xTF32, and the 16-bit tensor cores (v9 the default)


def _np_dtype(name):
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def _device(torch, t):
    """A torch CUDA tensor as numbaflash takes it: bfloat16 through its int16 view."""
    if t.dtype == torch.bfloat16:
        return cuda.as_cuda_array(t.view(torch.int16)).view(ml_dtypes.bfloat16)
    return cuda.as_cuda_array(t)


def _check(name, got, want, base, dtype, mult, zero_rows=None):
    c = bench._agreement(np.asarray(got, np.float64), want, base, dtype, mult, zero_rows)
    print(f"  {name}: max err {c['max_err']:.3g}, bound {c['bound']:.3g}: "
          f"{'ok' if c['ok'] else 'WRONG'}", flush=True)
    return c["ok"]


def _forward_version(name):
    """``--forward-versions`` entry -> numbaflash's ``version`` argument (None: the default)."""
    return None if name == "default" else name


def _check_forward_version(version, q, k, v, causal, scale, dtype, out, lse):
    """Forward ``version``'s out and lse by the rule, and whether they have the default's
    bits (v10 should have v7's: the same products in the same order; informative)."""
    o_v, lse_v = numbaflash.attention(q, k, v, causal=causal, scale=scale, return_lse=True,
                                      version=version)
    want, want_lse = reference.forward(q, k, v, causal=causal, scale=scale)
    base, base_lse = reference.forward(q, k, v, causal=causal, scale=scale, dtype=dtype.type)
    ok = _check(f"out (forward {version})", o_v, want, base, dtype, 2)
    c = bench._lse_agreement(np.asarray(lse_v, np.float64), want_lse,
                             np.asarray(base_lse, np.float64), np.dtype(np.float32),
                             np.isneginf(want_lse[0, 0]))
    print(f"  lse (forward {version}): max err {c['max_err']:.3g}, bound {c['bound']:.3g}: "
          f"{'ok' if c['ok'] else 'WRONG'}", flush=True)
    same = (np.array_equal(np.asarray(o_v).view(np.uint16), np.asarray(out).view(np.uint16))
            and np.array_equal(np.asarray(lse_v), np.asarray(lse), equal_nan=True))
    print(f"  forward {version}: {'the same bits as' if same else 'other bits than'} the "
          f"default's out and lse", flush=True)
    return ok and c["ok"]


def agreement(dtypes, forward_versions=("default",), backwards=BACKWARDS):
    rng = np.random.default_rng(1)
    cases = [  # (B, H, Sq, Sk, d, causal, magnitude)
        (1, 4, 777, 1000, 64, None, 1.0),
        (1, 4, 1000, 513, 128, "bottom_right", 1.0),     # 487 rows see no key
        (2, 2, 640, 640, 128, "top_left", 1.0),
        (1, 2, 300, 333, 64, "bottom_right", 2.0 ** 20),
    ]
    ok = True
    for name in dtypes:
        dtype = _np_dtype(name)
        for B, H, Sq, Sk, d, causal, mag in cases:
            if mag > 1 and name != "bfloat16":
                continue                    # beyond float16's range
            q, k, v, dout = (rng.standard_normal((B, H, S, d)).astype(np.float32) * mag
                             for S in (Sq, Sk, Sk, Sq))
            q, k, v, dout = (x.astype(dtype) for x in (q, k, v, dout))
            scale = 1.0 / (mag * mag * np.sqrt(d))
            print(f"{name} {(B, H, Sq, Sk, d)} causal={causal} |x| ~ {mag:g}", flush=True)
            out, lse = numbaflash.attention(q, k, v, causal=causal, scale=scale,
                                            return_lse=True)
            want, _ = reference.forward(q, k, v, causal=causal, scale=scale)
            base, _ = reference.forward(q, k, v, causal=causal, scale=scale, dtype=dtype.type)
            ok &= _check("out (forward default)", out, want, base, dtype, 2)
            for version in forward_versions:
                if version == "default":
                    continue
                ok &= _check_forward_version(version, q, k, v, causal, scale, dtype, out, lse)
            want_g = reference.backward(dout, q, k, v, causal=causal, scale=scale)
            base_g = reference.backward(dout, q, k, v, causal=causal, scale=scale,
                                        dtype=dtype.type)
            for version in backwards:
                grads = numbaflash.attention_backward(dout, q, k, v, out, lse, causal=causal,
                                                      scale=scale, version=version)
                for g_name, g, w, b, mult in zip(("dq", "dk", "dv"), grads, want_g, base_g,
                                                 (5, 3, 3)):
                    ok &= _check(f"{g_name} (backward {version})", g, w, b, dtype, mult)
    return ok


def reruns(torch, dtypes, n, backwards=BACKWARDS):
    ok = True
    for name in dtypes:
        g = torch.Generator(device="cuda").manual_seed(2)
        shape = (2, 8, 2048, 128)
        t = [torch.randn(shape, device="cuda", dtype=getattr(torch, name), generator=g)
             for _ in range(4)]
        q, k, v, dout = (_device(torch, x) for x in t)
        out, lse = numbaflash.attention(q, k, v, causal=True, return_lse=True)
        for version in backwards:
            first = [x.copy_to_host() for x in numbaflash.attention_backward(
                dout, q, k, v, out, lse, causal=True, version=version)]
            same = 0
            for _ in range(n):
                grads = numbaflash.attention_backward(dout, q, k, v, out, lse, causal=True,
                                                      version=version)
                same += all(np.array_equal(a.view(np.uint16), b.copy_to_host().view(np.uint16))
                            for a, b in zip(first, grads))
            print(f"reruns {name} {shape} causal backward {version}: {same} of {n} bitwise "
                  f"the first", flush=True)
            ok &= same == n
    return ok


def speed(torch, dtypes, repeats, forward_versions=("default",), backwards=BACKWARDS):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def ms(fn):
        return bench.time_ms(fn, repeats=repeats, warmup=3)

    for name in dtypes:
        for B, H, Sq, Sk, d in SHAPES:
            for causal in (False, True):
                g = torch.Generator(device="cuda").manual_seed(0)
                tdt = getattr(torch, name)
                qt, kt, vt, dot = (torch.randn((B, H, S, d), device="cuda", dtype=tdt,
                                               generator=g) for S in (Sq, Sk, Sk, Sq))
                q, k, v, dout = (_device(torch, x) for x in (qt, kt, vt, dot))
                mode = "bottom_right" if causal else None
                out, lse = numbaflash.attention(q, k, v, causal=mode, return_lse=True)
                t_fwds = {}
                for fv in forward_versions:
                    version = _forward_version(fv)
                    numbaflash.attention(q, k, v, causal=mode, version=version)  # compile
                    t_fwds[fv] = ms(lambda version=version: numbaflash.attention(
                        q, k, v, causal=mode, version=version))
                t_fb = {}
                for version in backwards:
                    def fb(version=version):
                        o, L = numbaflash.attention(q, k, v, causal=mode, return_lse=True)
                        numbaflash.attention_backward(dout, q, k, v, o, L, causal=mode,
                                                      version=version)
                    t_fb[version] = ms(fb)
                qr, kr, vr = (x.detach().requires_grad_() for x in (qt, kt, vt))
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    s_fwd = ms(lambda: F.scaled_dot_product_attention(qt, kt, vt,
                                                                      is_causal=causal))

                    def sdpa_fb():
                        o = F.scaled_dot_product_attention(qr, kr, vr, is_causal=causal)
                        o.backward(dot)
                    s_fb = ms(sdpa_fb)
                print(f"{name} {(B, H, Sq, Sk, d)} causal={causal}: "
                      + ", ".join(f"forward {fv} {t:.3f} ms ({s_fwd / t:.3f}x)"
                                  for fv, t in t_fwds.items())
                      + f", SDPA FLASH {s_fwd:.3f} (target {TARGETS['forward']}x); fwd+bwd "
                      + ", ".join(f"backward {v} {t:.3f} ms ({s_fb / t:.3f}x)"
                                  for v, t in t_fb.items())
                      + f", SDPA FLASH {s_fb:.3f} (target {TARGETS['fwd+bwd']}x)", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="agreement,reruns,speed")
    ap.add_argument("--dtypes", default="float16,bfloat16")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--reruns", type=int, default=50)
    ap.add_argument("--backward-versions", default=",".join(BACKWARDS),
                    help="backward versions to check, rerun and time, comma-separated")
    ap.add_argument("--forward-versions", default="default",
                    help="forward versions to check and time, comma-separated ('default': "
                         "the policy's choice), e.g. default,v7,v10")
    args = ap.parse_args(argv)
    if not cuda.is_available():
        sys.exit("half_gpu.py needs a CUDA GPU")
    import torch
    parts, dtypes = args.parts.split(","), args.dtypes.split(",")
    forward_versions = tuple(args.forward_versions.split(","))
    backwards = tuple(args.backward_versions.split(","))
    from numbaflash.kernels.forward import VERSIONS
    unknown = [v for v in forward_versions if v != "default" and v not in VERSIONS]
    if unknown:
        sys.exit(f"--forward-versions: no forward version {unknown}; choose from "
                 f"default, {', '.join(VERSIONS)}")
    ok = True
    if "agreement" in parts:
        ok &= agreement(dtypes, forward_versions, backwards)
    if "reruns" in parts:
        ok &= reruns(torch, dtypes, args.reruns, backwards)
    if "speed" in parts:
        speed(torch, dtypes, args.repeats, forward_versions, backwards)
    print("half_gpu:", "all checks passed" if ok else "SOME CHECKS FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
