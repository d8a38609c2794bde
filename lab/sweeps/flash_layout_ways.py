"""flash_attn_func's two ways against numbaflash.torch.attention on (b, h, s, d) tensors,
on a GPU, at (2, 4096, 16, d): read in place (a packed batch of equal lengths, on the
forward's packed build, and with gradients the packed backward) and through (b, h, s, d)
copies, each forced on the call's kind whatever the default picks. One configuration a
process; several processes may run at once: each compiles on its own and times while
it holds a lock (``--lock``), so their timings do not overlap.

    python3 lab/sweeps/flash_layout_ways.py --dtype float32 --dim 64 [--causal] [--grad]
        [--profile] [--kernels]

Prints, in ms, the median of 20 calls each timed alone with CUDA events (as
scripts/torch_gpu.py --parts layout times them) and of 5 x 20 calls queued back to back
(about the kernels' time), and each way's ratio to attention on (b, h, s, d). With
``--grad`` a call is the forward and the backward of a sum of out * dout. ``--profile``
then runs 20 calls of each way and of attention under cProfile (each call synchronized,
so the host's functions are what is listed) and prints the 25 functions with the most
time of their own, and the host's time per call outside any wait for the GPU.
``--kernels`` runs 10 calls of each way under torch.profiler and lists the GPU time of
every kernel and copy a call runs (CUPTI's activity records: Numba's launches included),
to say which kernel a way's extra time is in.
"""
import argparse
import cProfile
import fcntl
import io
import pstats
import time

import torch

import numbaflash.torch as nft
from numbaflash import torch_dropins

import flash_layout_parts  # noqa: E402  (this folder: its timers)

DEV = "cuda"


def alone(fn):
    return flash_layout_parts.alone(fn, repeats=20, warmup=0)


def queued(fn):
    return flash_layout_parts.queued(fn, calls=20, repeats=5, warmup=0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--grad", action="store_true")
    ap.add_argument("--lock", default="/tmp/flash_layout_ways.lock")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--kernels", action="store_true")
    args = ap.parse_args()
    B, S, H, d, c = 2, 4096, 16, args.dim, args.causal
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(B, S, H, d, device=DEV, dtype=dtype) for _ in range(4))
    qh, kh, vh = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    douth = dout.transpose(1, 2).contiguous()
    if args.grad:
        for x in (q, k, v, qh, kh, vh):
            x.requires_grad_()

    def run(fn, a, b, c_, g):
        if not args.grad:
            with torch.no_grad():
                return fn(a, b, c_)
        out = fn(a, b, c_)
        out.backward(g)
        return out

    flash = lambda: run(lambda a, b, c_: nft.flash_attn_func(a, b, c_, causal=c),   # noqa
                        q, k, v, dout)
    plain = lambda: run(lambda a, b, c_: nft.attention(a, b, c_, causal=c),         # noqa
                        qh, kh, vh, douth)
    flash()
    (layout,) = torch_dropins._FLASH.values()         # this process's one kind of call
    default = (layout.in_place, layout.in_place_grad)
    results = {}
    for way, in_place in (("in place", True), ("copies", False)):
        layout.in_place = layout.in_place_grad = in_place
        t0 = time.perf_counter()
        results[way] = flash()              # compiles this way's kernels
        print(f"# {way}: first call {time.perf_counter() - t0:.1f} s", flush=True)
    plain()
    torch.cuda.synchronize()
    # the same values both ways (each way's own kernels: compared within a float32 bound)
    diff = (results["in place"].float() - results["copies"].float()).abs().max().item()
    with open(args.lock, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        rows = []
        for way, in_place in (("in place", True), ("copies", False)):
            layout.in_place = layout.in_place_grad = in_place
            for _ in range(3):
                flash()
            rows.append((f"flash_attn_func {way}", alone(flash), queued(flash)))
        for _ in range(3):
            plain()
        rows.append(("attention (b,h,s,d)", alone(plain), queued(plain)))
        fcntl.flock(lock, fcntl.LOCK_UN)
    layout.in_place, layout.in_place_grad = default
    what = "forward + backward" if args.grad else "forward"
    print(f"({B}, {S}, {H}, {d}) {args.dtype} causal={c} {what}; default way: in place "
          f"{default[1] if args.grad else default[0]}; out in place vs copies max |diff| "
          f"{diff:.3g}")
    base_alone, base_queued = rows[-1][1], rows[-1][2]
    for name, a, qd in rows:
        print(f"{name:26s} alone {a:8.3f} ms ({a / base_alone:.3f}x)   queued {qd:8.3f} ms "
              f"({qd / base_queued:.3f}x)")
    # Each asked-for look inside a call (cProfile, the kernels' GPU time), for each way.
    for asked, look in ((args.profile, profile), (args.kernels, kernel_times)):
        if not asked:
            continue
        with open(args.lock, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            for way, in_place in (("in place", True), ("copies", False), ("attention", None)):
                if in_place is not None:
                    layout.in_place = layout.in_place_grad = in_place
                fn = plain if in_place is None else flash
                look(f"flash_attn_func {way}" if in_place is not None else
                     "attention (b,h,s,d)", fn)
            fcntl.flock(lock, fcntl.LOCK_UN)
        layout.in_place, layout.in_place_grad = default


def kernel_times(name, fn, calls=10):
    """The GPU time per call of each kernel (and memcpy/memset) ``calls`` calls run,
    from torch.profiler's CUDA activity, longest first, and their sum."""
    from torch.profiler import ProfilerActivity, profile as torch_profile
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    totals = {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        count, us = totals.get(e.name, (0, 0.0))
        totals[e.name] = (count + 1, us + e.time_range.elapsed_us())
    print(f"\n## GPU time per call, {name} ({calls} calls)")
    rows = sorted(totals.items(), key=lambda kv: -kv[1][1])
    for kname, (count, us) in rows:
        print(f"  {us / calls:10.1f} us  {count / calls:4.1f}x  {kname[:110]}")
    print(f"  {sum(us for _, us in totals.values()) / calls:10.1f} us  in all")


def profile(name, fn, calls=20):
    """cProfile of ``calls`` synchronized calls: the 25 functions with the most time of
    their own, and the host's time per call without the waits for the GPU (the time
    inside torch.cuda.synchronize and the Event/stream waits taken out)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
        torch.cuda.synchronize()
    prof.disable()
    stats = pstats.Stats(prof)
    total = stats.total_tt
    waits = sum(tt for (file, line, func), (cc, nc, tt, ct, callers) in stats.stats.items()
                if "synchronize" in func or "copy_to_host" in func or "wait" in func)
    print(f"\n## cProfile, {name}: {calls} calls, {1e3 * total / calls:.3f} ms a call "
          f"in all, {1e3 * (total - waits) / calls:.3f} ms a call outside waits "
          f"(synchronize, copy_to_host, wait: {1e3 * waits / calls:.3f} ms)")
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
    print(text.getvalue())


if __name__ == "__main__":
    main()
