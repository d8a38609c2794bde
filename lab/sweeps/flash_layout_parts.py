"""Where flash_attn_func's time goes against numbaflash.torch.attention at (2, 4096, 16, 64),
float16, on a GPU: each call timed alone (CUDA events around one call, as
scripts/torch_gpu.py --parts layout times it, so the host's time before the launch
counts), calls queued back to back (the host's time hidden behind the previous kernel:
about the kernel's time), and the host's time per call.

    python3 lab/sweeps/flash_layout_parts.py [--causal]

(Its --hold-packed, at 741eb06, held the packed build to the plain build's register cap
before the launch contract did.)

flash_attn_func reads its (batch, seqlen, heads, d) tensors in place (forward v10's
packed build); attention gets (batch, heads, seqlen, d) tensors (v10's plain build).
"""
import argparse
import statistics

import torch

import numbaflash.torch as nft

DEV = "cuda"


def alone(fn, repeats=30, warmup=3):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def queued(fn, calls=50, repeats=5, warmup=3):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        for _ in range(calls):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / calls)
    return statistics.median(times)


def host_us(fn, calls=200, warmup=3):
    """The host's time per call, the GPU kept busy (no wait in the loop)."""
    import time
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--causal", action="store_true")
    args = ap.parse_args()
    B, S, H, d = 2, 4096, 16, 64
    q, k, v = (torch.randn(B, S, H, d, device=DEV, dtype=torch.float16) for _ in range(3))
    qh, kh, vh = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    c = args.causal
    with torch.no_grad():
        flash = lambda: nft.flash_attn_func(q, k, v, causal=c)      # noqa: E731
        plain = lambda: nft.attention(qh, kh, vh, causal=c)         # noqa: E731
        rows = [("alone", alone(flash), alone(plain)),
                ("queued", queued(flash), queued(plain))]
        hf, hp = host_us(flash), host_us(plain)
    print(f"(2, 4096, 16, 64) float16 causal={c}: flash_attn_func in place against "
          f"attention on (b, h, s, d); ms")
    for name, f, p in rows:
        print(f"{name:7s} flash_attn_func {f:.4f}  attention {p:.4f}  ratio {f / p:.3f}")
    print(f"host us per call (GPU busy): flash_attn_func {hf:.1f}  attention {hp:.1f}")
    from numbaflash import launcher
    for key, direct in launcher._DIRECT.items():
        c = direct.compiled
        print(f"{direct.kernel.py_func.__name__} grid {key[2]}: {c.regs_per_thread} registers, "
              f"{c.local_mem_per_thread} bytes local a thread")


if __name__ == "__main__":
    main()
