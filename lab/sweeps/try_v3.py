"""Forward v3 (tensor cores) on a GPU: agreement with the float64 reference, and timing
against v2 and PyTorch SDPA (EFFICIENT, float32). It calls the v3 kernel factory directly.

    python scripts/try_v3.py

This is the script behind docs/gpu/2026-11-30/02_v3_check.txt (see docs/gpu-results.md).
scripts/gpu_check.py covers v3 too, through numbaflash.attention(version="v3").
"""
import math, statistics, sys
import numpy as np
import torch
from numba import cuda
import numbaflash
from numbaflash import reference, masks
from numbaflash.kernels import forward as F


def run_v3(q, k, v, causal, Bc):
    B, H, Sq, d = q.shape
    Sk = k.shape[2]
    mode = masks.parse_causal(causal)
    off = masks.causal_offset(Sq, Sk, mode)
    Q, K, V = (cuda.as_cuda_array(x).reshape(B * H, x.shape[2], d) if hasattr(x, "__cuda_array_interface__") else cuda.to_device(x.reshape(B * H, x.shape[2], d)) for x in (q, k, v))
    O = cuda.device_array((B * H, Sq, d), np.float32)
    L = cuda.device_array((B * H, Sq), np.float32)
    kern = F.make_forward_v3(Bc, d, mode is not None)
    kern[(math.ceil(Sq / 64), B * H), (128,)](Q, K, V, O, L, np.float32(1 / math.sqrt(d)), np.int64(off))
    return O, L


def check(B, H, Sq, Sk, d, causal, Bc, rng):
    q, k, v = (rng.uniform(-4, 4, (B, H, S, d)).astype(np.float32) for S in (Sq, Sk, Sk))
    O, L = run_v3(q, k, v, causal, Bc)
    o = O.copy_to_host().reshape(B, H, Sq, d); l = L.copy_to_host().reshape(B, H, Sq)
    ref, rl = reference.forward(q, k, v, causal)
    base, _ = reference.forward(q, k, v, causal, dtype=np.float32)
    err = np.abs(o - ref).max(); berr = np.abs(base - ref).max()
    fin = np.isfinite(rl)
    lerr = np.abs(np.where(fin, l - rl, 0)).max()
    same_inf = np.array_equal(np.isinf(l), np.isinf(rl))
    ok = err <= 2 * berr + 2 * np.spacing(np.abs(ref).max()) and same_inf and not np.isnan(o).any()
    if Sq == Sk and causal is None:
        qt, kt, vt = (torch.from_numpy(x).cuda() for x in (q, k, v))
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            eff = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt).cpu().numpy()
        print(f"   sdpa efficient err {np.abs(eff - ref).max():.2e}")
    print(f"v3 {(B, H, Sq, Sk, d)} {causal} Bc={Bc}: err {err:.2e} base {berr:.2e} lse {lerr:.2e} {'ok' if ok else 'FAIL'}", flush=True)
    return ok


def time_ms(fn, reps=20):
    for _ in range(3):
        fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b))
    return statistics.median(ts)


from torch.nn.attention import SDPBackend, sdpa_kernel
rng = np.random.default_rng(0)
ok = True
for case in [(1, 2, 100, 77, 64, None, 64), (1, 2, 130, 45, 64, "bottom_right", 64), (1, 2, 70, 200, 64, "top_left", 64),
             (1, 2, 1024, 1024, 64, None, 64), (1, 2, 1000, 1000, 128, "bottom_right", 32), (1, 1, 333, 517, 59, None, 64),
             (1, 1, 100, 90, 3, "bottom_right", 64), (2, 16, 2048, 2048, 64, None, 64),
             (1, 4, 2048, 2048, 128, None, 32), (1, 2, 4096, 4096, 64, "bottom_right", 32), (1, 1, 8192, 8192, 64, None, 64)]:
    ok &= check(*case, rng)
from torch.nn.attention import SDPBackend, sdpa_kernel
for (B, H, N, d, Bc) in ((2, 16, 4096, 64, 64), (2, 16, 4096, 64, 32), (2, 16, 4096, 128, 32), (1, 16, 16384, 64, 64)):
    for causal in (False, True):
        q, k, v = (torch.randn(B, H, N, d, device="cuda") for _ in range(3))
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            t_sdpa = time_ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal))
        mode = "top_left" if causal else None
        t3 = time_ms(lambda: run_v3(q, k, v, mode, Bc))
        qd, kd, vd = (cuda.as_cuda_array(x) for x in (q, k, v))
        try:
            t2 = time_ms(lambda: numbaflash.attention(qd, kd, vd, causal=mode, version="v2"), reps=5)
        except Exception as e:
            print("v2 failed:", type(e).__name__, str(e)[-3000:])
            t2 = float("nan")
        fl = 4 * B * H * N * N * d * (0.5 if causal else 1)
        print(f"time {(B, H, N, d)} causal={causal}: sdpa {t_sdpa:.2f} ms ({fl / t_sdpa / 1e9:.1f} TF), v3 {t3:.2f} ms ({fl / t3 / 1e9:.1f} TF, {t_sdpa / t3:.2f}x), v2 {t2:.2f} ms ({fl / t2 / 1e9:.1f} TF)", flush=True)
kern = F.make_forward_v3(64, 64, False)
for sig, ov in kern.overloads.items():
    print("v3 d=64 registers", ov.get_regs_per_thread() if hasattr(ov, "get_regs_per_thread") else "?",
          "local bytes", ov.get_local_mem_per_thread() if hasattr(ov, "get_local_mem_per_thread") else "?")
print("ALL OK" if ok else "FAIL")
