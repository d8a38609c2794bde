"""Where a small call's time goes, on a GPU: numbaflash.torch.attention at (1, 1, 128, 64)
(no autograd) against the raw launch of its kernel and against SDPA, split into the
kernel's time on the GPU (torch.profiler's CUDA kernel durations) and the host's time per
call (calls queued, no wait), beside the wall time of one call with a synchronize after
it (scripts/torch_gpu.py --parts overhead). With ``--tiles`` the same for other query
tiles of the default forward, which the kernel's time may favour at a one-block grid.

    python3 lab/sweeps/small_call_parts.py [--dtype float32] [--calls 1000] [--breakdown] [--tiles]
        [--launch prepared|core]

``--breakdown`` instead times, on the host alone, each step numbaflash.torch.attention
takes before and around the launch on a repeated call (each step in a loop of its own).
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "scripts"))
import numbaflash.torch as nft  # noqa: E402
from torch_gpu import raw_launch, wall_ms  # noqa: E402

import flash_layout_parts  # noqa: E402  (this folder: its timers)

DEV = "cuda"


def host_us(fn, calls):
    return flash_layout_parts.host_us(fn, calls, warmup=10)


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


def breakdown(q, k, v, calls):
    """The host's time of each step of a repeated numbaflash.torch.attention call."""
    with torch.no_grad():
        nft._FAST.clear()
        nft.attention(q, k, v)
        (key, fast), = nft._FAST.items()
        options = dict(causal=False, scale=None, version=None, tiles=None, window_size=None,
                       softcap=None, score_mod=None, score_mod_grad=None, mask_mod=None,
                       dropout_p=0.0, dropout_seed=None)
        raw = raw_launch(q, k, v)
        steps = [
            ("numbaflash.torch.attention (the whole call)", lambda: nft.attention(q, k, v)),
            ("_repeated (checks, key, then the _FastForward call)",
             lambda: nft._repeated(q, k, v, False, None, None, None, None, None)),
            ("_FastForward call (empty x2, words, launch)", lambda: fast(q, k, v, None)),
            ("raw launch (launch_words)", raw),
            ("_check_tensors", lambda: nft._check_tensors(q=q, k=k, v=v, alibi_slopes=None,
                                                          attn_mask=None)),
            ("_compiling", nft._compiling),
            ("_refuse_capture", lambda: nft._refuse_capture(q.device)),
            ("grad enabled, requires_grad x3",
             lambda: torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))),
            ("is_contiguous x5 (all)", lambda: all(x is None or x.is_contiguous()
                                                   for x in (q, k, v, None, None))),
            ("contiguous x3", lambda: (q.contiguous(), k.contiguous(), v.contiguous())),
            ("_fast_key", lambda: nft._fast_key(q, k, v, None, None, options)),
            ("torch.empty out", lambda: torch.empty(fast.out_shape, dtype=q.dtype,
                                                   device=q.device)),
            ("torch.empty lse", lambda: torch.empty(fast.lse_shape, dtype=fast.lse_dtype,
                                                   device=q.device)),
            ("q.new_empty out", lambda: q.new_empty(fast.out_shape)),
            ("torch.cuda.current_device", torch.cuda.current_device),
            ("torch._C._cuda_getDevice", torch._C._cuda_getDevice),
            ("_torch_stream", lambda: nft._torch_stream(q.device)),
            ("data_ptr x5", lambda: (q.data_ptr(), k.data_ptr(), v.data_ptr(), q.data_ptr(),
                                     q.data_ptr())),
            ("q.device", lambda: q.device),
        ]
        print(f"(1, 1, 128, 64) {q.dtype}: host us per step, {calls} calls each "
              f"(the GPU kept busy where a step launches)")
        for name, fn in steps:
            print(f"{name:48s} {host_us(fn, calls):8.2f}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--breakdown", action="store_true")
    ap.add_argument("--tiles", action="store_true", help="also other query tiles")
    ap.add_argument("--launch", choices=("prepared", "core"), default="prepared",
                    help="repeated calls' launch: launcher.PreparedLaunch, or cuda.core's "
                    "launch with the words built per call (launcher.PREPARED_LAUNCH)")
    args = ap.parse_args()
    from numbaflash import launcher
    launcher.PREPARED_LAUNCH = args.launch == "prepared"
    print(f"launcher.PREPARED_LAUNCH = {launcher.PREPARED_LAUNCH}", flush=True)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 1, 128, 64, device=DEV, dtype=dtype) for _ in range(3))
    if args.breakdown:
        return breakdown(q, k, v, args.calls)
    with torch.no_grad():
        ways = [("SDPA", lambda: F.scaled_dot_product_attention(q, k, v)),
                ("numbaflash.torch.attention", lambda: nft.attention(q, k, v)),
                ("raw launch", raw_launch(q, k, v))]
        for tiles in ((64, 64), (32, 64), (16, 64)) if args.tiles else ():
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
