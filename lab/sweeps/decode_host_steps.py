"""Where the host's time goes in a repeated ``attention_with_kvcache`` call, step by step,
without a profiler's own cost: each step's function is wrapped with a clock
(``time.perf_counter_ns``, about 0.1 us a reading), the calls repeated, and the mean
microseconds a call printed per step, with the whole call's and what is left (the
Python between the steps), and the time from the call's start to its first launch
through launcher.PreparedLaunch ("before the first launch"); then whether every way gave
the same out and lse bits.

    python3 lab/sweeps/decode_host_steps.py [--shapes b1-gqa,b8-mha] [--calls 2000]
        [--inputs numba,torch] [--prepared 0,1] [--sync-every 200]

``--inputs``: the arrays as bench --inference passes them (``numba``: Numba views of
PyTorch tensors, ``cuda.as_cuda_array``) or as a PyTorch user does (``torch``: the
tensors). ``--prepared``: launcher.PREPARED_LAUNCH, the kernels' words laid out once
(1) or built for cuda.core's launch at every call (0). The calls are queued without waiting (the GPU falls behind; only the host's
time is read), synchronising every ``--sync-every`` calls so the queue stays short (a
launch blocks when the GPU's queue of launches is full: fewer calls between the
synchronisations keep that out of the host's times).
"""
import argparse
import collections
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))

import torch                                         # noqa: E402
from numba import cuda                               # noqa: E402

import numbaflash                                    # noqa: E402
from numbaflash import arrays, decode_direct, kvcache, launcher, streams   # noqa: E402
from decode_gpu import SHAPES, _inputs               # noqa: E402

SPENT = collections.Counter()
COUNT = collections.Counter()


def clocked(name, fn):
    def wrapper(*args, **kwargs):
        t = time.perf_counter_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            SPENT[name] += time.perf_counter_ns() - t
            COUNT[name] += 1
    return wrapper


CALL_START = [None]          # when the call being clocked began (None: its first launch seen)


def first_launch(fn):
    """Clock from the start of the whole call to its first kernel launch ("before the
    first launch": what a call timed alone waits for on top of its kernels)."""
    def wrapper(*args, **kwargs):
        if CALL_START[0] is not None:
            SPENT["before the first launch"] += time.perf_counter_ns() - CALL_START[0]
            COUNT["before the first launch"] += 1
            CALL_START[0] = None
        return fn(*args, **kwargs)
    return wrapper


def whole_call(fn):
    def wrapper(*args, **kwargs):
        CALL_START[0] = time.perf_counter_ns()
        return fn(*args, **kwargs)
    return wrapper


def wrap_steps():
    """The steps of kvcache.attention_with_kvcache's repeated path, by the names it
    calls them through."""
    for name in ("_device_memory", "direct_key", "_repeat", "ready_handles"):
        setattr(kvcache, name, clocked(f"kvcache.{name}", getattr(kvcache, name)))
    decode_direct.lookup = clocked("decode_direct.lookup", decode_direct.lookup)
    kvcache.decode_direct.lookup = decode_direct.lookup
    for name in ("workspace", "scratch", "c_contiguous", "is_device_array",
                 "caller_allocates"):
        setattr(arrays, name, clocked(f"arrays.{name}", getattr(arrays, name)))
    launcher.current_context = clocked("launcher.current_context",
                                       launcher.current_context)
    launcher._DirectLaunch.launch_words = clocked("launch_words (per launch)",
                                                  launcher._DirectLaunch.launch_words)
    launcher.PreparedLaunch.launch = first_launch(clocked("PreparedLaunch.launch",
                                                          launcher.PreparedLaunch.launch))
    launcher.memset_d32_async = clocked("launcher.memset_d32_async",
                                        launcher.memset_d32_async)
    streams.torch_stream = clocked("streams.torch_stream", streams.torch_stream)
    kvcache.torch_stream = streams.torch_stream
    kvcache.producer_stream = clocked("streams.producer_stream", kvcache.producer_stream)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="b1-gqa,b8-mha")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--inputs", default="numba,torch")
    ap.add_argument("--prepared", default="0,1")
    ap.add_argument("--sync-every", type=int, default=200)
    args = ap.parse_args()
    wrap_steps()
    call_fn = whole_call(clocked("attention_with_kvcache (whole)",
                                 numbaflash.attention_with_kvcache))
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        S_max = shape[4]
        tensors = _inputs(shape, "float16")
        bits = {}
        for kind, prepared in [(k, p) for k in args.inputs.split(",")
                               for p in args.prepared.split(",")]:
            launcher.PREPARED_LAUNCH = prepared == "1"
            decode_direct.forget()
            xs = tensors if kind == "torch" else [cuda.as_cuda_array(x) for x in tensors]
            q, kc, vc = xs
            for _ in range(20):                     # the first call records the kernels
                call_fn(q, kc, vc, cache_seqlens=S_max)
            torch.cuda.synchronize()
            SPENT.clear()
            COUNT.clear()
            start = time.perf_counter_ns()
            for i in range(args.calls):
                call_fn(q, kc, vc, cache_seqlens=S_max)
                if i % args.sync_every == args.sync_every - 1:
                    torch.cuda.synchronize()
            wall = time.perf_counter_ns() - start
            torch.cuda.synchronize()
            n = args.calls
            whole = SPENT["attention_with_kvcache (whole)"] / n / 1e3
            print(f"host-steps {name} {shape} float16, {kind} inputs, PREPARED_LAUNCH="
                  f"{launcher.PREPARED_LAUNCH}: "
                  f"{whole:.1f} us a call (wall {wall / n / 1e3:.1f} us a call, with the "
                  f"synchronisations)", flush=True)
            for step, ns in SPENT.most_common():
                print(f"    {step:40s} {ns / n / 1e3:7.2f} us a call, "
                      f"{COUNT[step] / n:.1f} calls", flush=True)
            out, lse = call_fn(q, kc, vc, cache_seqlens=S_max, return_lse=True)
            bits[kind, prepared] = (out.copy_to_host().tobytes()
                                    + lse.copy_to_host().tobytes())
            decode_direct.forget()
            del xs, q, kc, vc
        print(f"host-steps {name}: every way gives the same out and lse bits: "
              f"{len(set(bits.values())) == 1}", flush=True)
        bits.clear()
        del tensors


if __name__ == "__main__":
    main()
