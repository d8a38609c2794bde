"""Where a small call's time goes, on a GPU: numbaflash.torch.attention at (1, 1, 128, 64)
(no autograd) against the raw launch of its kernel and against SDPA, split into the
kernel's time on the GPU (torch.profiler's CUDA kernel durations) and the host's time per
call (calls queued, no wait), beside the wall time of one call with a synchronize after
it (scripts/torch_gpu.py --parts overhead). Then the same for other query tiles of the
default forward, which the kernel's time may favour at a one-block grid.

    python3 lab/sweeps/small_call_parts.py [--dtype float32] [--calls 1000]
"""
import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "scripts"))
import numbaflash.torch as nft  # noqa: E402
from torch_gpu import raw_launch, wall_ms  # noqa: E402

DEV = "cuda"


def host_us(fn, calls):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def kernel_us(fn, calls=100):
    """The GPU's time per call in kernels (every CUDA kernel the call launches)."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    total, names = 0.0, set()
    for e in prof.events():
        if e.device_type.name == "CUDA":
            total += e.device_time if hasattr(e, "device_time") else e.cuda_time
            names.add(e.name[:60])
    return total / calls, sorted(names)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--calls", type=int, default=1000)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 1, 128, 64, device=DEV, dtype=dtype) for _ in range(3))
    with torch.no_grad():
        ways = [("SDPA", lambda: F.scaled_dot_product_attention(q, k, v)),
                ("numbaflash.torch.attention", lambda: nft.attention(q, k, v)),
                ("raw launch", raw_launch(q, k, v))]
        for tiles in ((64, 64), (32, 64), (16, 64)):
            try:
                nft.attention(q, k, v, tiles=tiles)
            except ValueError as e:
                print(f"# tiles {tiles}: {e}")
                continue
            ways.append((f"numbaflash.torch.attention tiles={tiles}",
                         lambda t=tiles: nft.attention(q, k, v, tiles=t)))
            ways.append((f"raw launch tiles={tiles}", raw_launch(q, k, v, tiles=tiles)))
        print(f"(1, 1, 128, 64) {args.dtype}, no autograd; us per call")
        print(f"{'':44s} {'wall+sync':>10s} {'host':>8s} {'kernels':>8s}")
        for name, fn in ways:
            wall = wall_ms(fn, args.calls) * 1e3
            host = host_us(fn, args.calls)
            kern, names = kernel_us(fn)
            print(f"{name:44s} {wall:10.1f} {host:8.1f} {kern:8.1f}   {', '.join(names)}",
                  flush=True)
        print(f"median of {args.calls} (wall, host) and of 100 calls' kernels")


if __name__ == "__main__":
    main()
