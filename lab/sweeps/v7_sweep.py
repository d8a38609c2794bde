"""Forward v7 (float16 inputs on the float16 tensor cores) on a GPU: checked, then timed.

    python3 scripts/v7_sweep.py                         # default configs (a minute or two)
    python3 scripts/v7_sweep.py --configs 64:128:64:32,128:64:64:16   # d:Br:Bc:chunk

At (2, 16, 4096, d), float16 inputs, causal (bottom-right) and not. First each kernel's
output for the first (batch, head) is compared with numbaflash.reference in float64 on the
same float16 inputs: its max error is printed next to forward v6's (3xTF32 in float32, so
its error is mostly the rounding of O to float16), and a v7 error above 4x v6's, or above
4 float16 ulps of max|O|, is marked WRONG and not timed. (The test suite holds v7 to
TESTING.md's float16 rule, whose baseline is attention computed in float16: too slow in
NumPy at this size.) Then median of 10 CUDA-event timings after one untimed call
(numbaflash.bench.time_ms), for v6, each v7 config, and PyTorch SDPA's EFFICIENT and
FLASH backends on the same float16 inputs when torch is importable (the ratio column is
SDPA EFFICIENT's time / this time).
"""

import argparse
import sys

import numpy as np
from numba import cuda

import numbaflash
from numbaflash import dispatch, reference
from numbaflash.bench import time_ms
from numbaflash.kernels import forward as fwd
from numbaflash.kernels import smem

DEFAULT_CONFIGS = ("64:128:64:32,64:128:64:16,64:64:64:32,64:128:128:32,64:64:32:32,"
                   "128:128:64:32,128:128:64:16,128:64:64:32,128:64:32:32")


def sdpa_calls(q, k, v, causal):
    """{name: function} timing PyTorch SDPA EFFICIENT and FLASH on the same memory."""
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return {}
    tq, tk, tv = (torch.as_tensor(x, device="cuda") for x in (q, k, v))

    def make(backend):
        def call():
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv,
                                                                        is_causal=causal)
        return call
    return {"sdpa_efficient": make(SDPBackend.EFFICIENT_ATTENTION),
            "sdpa_flash": make(SDPBackend.FLASH_ATTENTION)}


def v7_call(q, k, v, causal, d, Br, Bc, chunk):
    """A function launching make_forward_v7(Br, Bc, d, causal, chunk) on (2, 16, 4096, d)
    device arrays directly (the chunk is a knob the dispatcher does not expose),
    returning O, and the kernel's registers per thread."""
    kernel = fwd.make_forward_v7(Br, Bc, d, bool(causal), chunk)
    B, H, N, _ = q.shape
    Q, K, V = (x.reshape(B * H, N, d) for x in (q, k, v))
    nbytes = dispatch.v7_shared_bytes(Br, Bc, d)

    def call():
        O = cuda.device_array((B * H, N, d), np.float16)
        L = cuda.device_array((B * H, N), np.float32)
        args = (Q, K, V, O, L, np.float32(1 / np.sqrt(d)), np.int64(0))
        smem.allow_dynamic_shared_memory(kernel, args, nbytes)
        kernel[((N + Br - 1) // Br, B * H), (2 * Br,), 0, nbytes](*args)
        return O.reshape(B, H, N, d)
    call()
    regs = kernel.get_regs_per_thread()
    return call, (next(iter(regs.values())) if isinstance(regs, dict) else regs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default=DEFAULT_CONFIGS, help="d:Br:Bc:chunk,...")
    args = ap.parse_args()
    by_d = {}
    for item in args.configs.split(","):
        d, Br, Bc, chunk = (int(x) for x in item.split(":"))
        by_d.setdefault(d, []).append((Br, Bc, chunk))
    rng = np.random.default_rng(0)
    ok = True
    print(f"{'d':>4} {'causal':>6} {'kernel':<24} {'regs':>5} {'max err':>9} {'v6 err':>9} "
          f"{'ms':>8} {'TFLOP/s':>8} {'vs SDPA':>8}")
    for d, variants in by_d.items():
        shape = (2, 16, 4096, d)
        hq, hk, hv = (rng.standard_normal(shape).astype(np.float16) for _ in range(3))
        q, k, v = (cuda.to_device(x) for x in (hq, hk, hv))
        for causal in (False, True):
            ref, _ = reference.forward(*(x[0, 0].astype(np.float64) for x in (hq, hk, hv)),
                                       causal=causal)
            ulp = float(np.spacing(np.float16(np.abs(ref).max())))
            flops = 4 * 2 * 16 * 4096 * 4096 * d * (0.5 if causal else 1.0)
            sdpa_ms = None
            for name, call in sdpa_calls(q, k, v, causal).items():
                ms = time_ms(call, repeats=10, warmup=1)
                sdpa_ms = ms if name == "sdpa_efficient" else sdpa_ms
                print(f"{d:4d} {causal!s:>6} {name:<24} {'':>5} {'':>9} {'':>9} {ms:8.2f} "
                      f"{flops / ms / 1e9:8.1f} {sdpa_ms / ms:8.3f}", flush=True)

            def v6():
                return numbaflash.attention(q, k, v, causal=causal, version="v6")
            v6_err = float(np.abs(v6().copy_to_host()[0, 0].astype(np.float64) - ref).max())
            runs = [("v6 default", v6, "-")]
            for Br, Bc, chunk in variants:
                call, regs = v7_call(q, k, v, causal, d, Br, Bc, chunk)
                runs.append((f"v7 ({Br}, {Bc}) chunk {chunk}", call, regs))
            for name, call, regs in runs:
                err = float(np.abs(call().copy_to_host()[0, 0].astype(np.float64) - ref).max())
                head = f"{d:4d} {causal!s:>6} {name:<24} {regs!s:>5} {err:9.2e} {v6_err:9.2e}"
                if not (err <= 4 * v6_err and err <= 4 * ulp):
                    ok = False
                    print(f"{head} WRONG RESULT, not timed", flush=True)
                    continue
                ms = time_ms(call, repeats=10, warmup=1)
                ratio = f"{sdpa_ms / ms:8.3f}" if sdpa_ms else f"{'-':>8}"
                print(f"{head} {ms:8.2f} {flops / ms / 1e9:8.1f} {ratio}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
