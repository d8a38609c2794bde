"""Python overhead of a small call: ``numbaflash.attention`` against the raw kernel launch.

    python scripts/overhead.py [--shape 1,1,128,64] [--calls 500] [--breakdown] [--profile]

The target: a call on device arrays at (1, 1, 128, 64) costs no more than 2x the raw
kernel launch (docs/performance.md has the latest reading). For small problems the
Python around the kernel (validation, planning, output allocation, the launch itself)
can cost more than the kernel.

Three timings, each the median over ``--calls`` calls of wall-clock time per call, with a
synchronize after every call (so each includes the kernel's own run time):

    raw     the compiled kernel of the default plan, launched directly on preallocated
            (BH, S, d) arrays (with the dynamic shared memory v5 asks for): what any
            Numba program pays at least
    api     numbaflash.attention(q, k, v) on device arrays (allocates out; no lse returned)
    api+lse numbaflash.attention(..., return_lse=True)

and the same for causal=True. Prints the ratios api / raw, and api once more with
numbaflash's direct launch turned off (``launcher.DIRECT_LAUNCH = False``: every launch
through Numba's dispatcher), to show what the direct launch buys.
"""

import argparse
import statistics
import sys
import time

import numpy as np
from numba import cuda

import numbaflash
from numbaflash import launcher, policy
from numbaflash.kernels import forward, smem
from numbaflash.streams import DEFAULT
from numbaflash.validate import check_attention_inputs


def forward_kernel(plan, p):
    """The compiled kernel of a forward plan (its version's factory, cached)."""
    return forward.module(plan.version).kernel(plan, p)


def dynamic_bytes(plan):
    """The dynamic shared memory a plan's launch asks for (0 for static shared memory)."""
    return plan.shared_bytes if plan.dynamic_shared else 0


def per_call_us(fn, calls):
    for _ in range(20):            # warm-up: compilation, allocator pools
        fn()
    cuda.synchronize()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def piece_us(fn, calls):
    """Median wall-clock time of ``fn`` in microseconds, no synchronize (Python cost only)."""
    for _ in range(20):
        fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def without_direct_launch(fn):
    """fn() with every launch through Numba's dispatcher (launcher.DIRECT_LAUNCH off)."""
    launcher.DIRECT_LAUNCH = False
    try:
        return fn()
    finally:
        launcher.DIRECT_LAUNCH = True


def breakdown(q, k, v, calls):
    """The pieces of ``numbaflash.attention(q, k, v)`` timed alone (each without the
    kernel's run time): where the Python around the kernel goes."""
    from numbaflash import api, arrays
    variants = api._variants(None, None, None, None, None, None, None)
    p, plan = api._forward_problem_and_plan(q, k, v, False, None, variants, None, None)
    kernel = forward_kernel(plan, p)
    shape3 = (p.BH, p.Sq, p.d)
    Q, K, V = (x.reshape(shape3) for x in (q, k, v))
    O = cuda.device_array(shape3, np.float32)
    L = cuda.device_array((p.BH, p.Sq), np.float32)
    args = (Q, K, V, O, L, np.float32(p.softmax_scale), np.int64(p.causal_offset))
    if forward.module(plan.version).VARIANTS:       # (placeholders for plain attention)
        args += launcher.variant_arguments(p, None, None)
    dynamic = dynamic_bytes(plan)
    smem.allow_dynamic_shared_memory(kernel, args, dynamic)     # above 48 KB (v5)
    config = kernel[plan.grid, plan.block, 0, dynamic]
    compiled = kernel.compile(tuple(kernel.typeof_pyval(a) for a in args))
    direct = launcher._DirectLaunch(kernel, args, plan.grid, plan.block, dynamic)
    pieces = [
        ("validate + plan (remembered per call key)",
         lambda: api._forward_problem_and_plan(q, k, v, False, None, variants, None, None)),
        ("one reshape to (BH, S, d), Numba's reshape", lambda: q.reshape(shape3)),
        ("one reshape to (BH, S, d), arrays._view", lambda: arrays._view(q, shape3)),
        ("allocate O and L, cuda.device_array", lambda: (
            cuda.device_array(shape3, np.float32), cuda.device_array((p.BH, p.Sq), np.float32))),
        ("allocate O and L, arrays.device_empty (cache)", lambda: (
            arrays.device_empty(shape3, np.float32), arrays.device_empty((p.BH, p.Sq), np.float32))),
        ("forward_kernel (factory cache)", lambda: forward_kernel(plan, p)),
        ("cuda.current_context()", cuda.current_context),
        ("launch configuration: kernel[grid, block, 0, n]",
         lambda: kernel[plan.grid, plan.block, 0, dynamic]),
        ("launch: dispatcher, arrays typed before", lambda: config(*args)),
        ("launch: compiled kernel", lambda: compiled.launch(args, config.griddim,
                                                            config.blockdim, config.stream,
                                                            config.sharedmem)),
        ("launch: launcher._DirectLaunch (numbaflash's)", lambda: direct(args, DEFAULT)),
        ("numbaflash.attention, whole call", lambda: numbaflash.attention(q, k, v)),
        ("  the same, DIRECT_LAUNCH = False", lambda: without_direct_launch(
            lambda: numbaflash.attention(q, k, v))),
    ]
    print(f"\nPieces of a call, median of {calls}, no synchronize (launches queue up):")
    for name, fn in pieces:
        print(f"  {name:47s} {piece_us(fn, calls):7.1f} us")
    cuda.synchronize()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="1,1,128,64", help="B,H,N,d")
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--breakdown", action="store_true",
                    help="also time the pieces of a call one by one (no synchronize)")
    ap.add_argument("--profile", action="store_true",
                    help="also print where the API's time goes (cProfile, by own time)")
    args = ap.parse_args()
    B, H, N, d = (int(t) for t in args.shape.split(","))
    rng = np.random.default_rng(0)
    q, k, v = (cuda.to_device(rng.standard_normal((B, H, N, d)).astype(np.float32))
               for _ in range(3))
    print(f"backend: {numbaflash.backend()}, shape (B, H, N, d) = {(B, H, N, d)}, float32, "
          f"median of {args.calls} calls, synchronized after each")
    ok = True
    for causal in (False, True):
        p = check_attention_inputs(q, k, v, causal, None)
        plan = policy.plan_forward(p)
        kernel = forward_kernel(plan, p)
        Q, K, V = (x.reshape((p.BH, S, p.d)) for x, S in ((q, p.Sq), (k, p.Sk), (v, p.Sk)))
        O = cuda.device_array((p.BH, p.Sq, p.d), np.float32)
        L = cuda.device_array((p.BH, p.Sq), np.float32)
        scale, offset = np.float32(p.softmax_scale), np.int64(p.causal_offset)
        # the versions that take variants also take their arguments (placeholders for
        # plain attention), as launcher.launch_forward passes them
        extra = (launcher.variant_arguments(p, None, None)
                 if forward.module(plan.version).VARIANTS else ())

        args_raw = (Q, K, V, O, L, scale, offset, *extra)
        dynamic = dynamic_bytes(plan)     # v5: bytes go with the launch
        smem.allow_dynamic_shared_memory(kernel, args_raw, dynamic)

        def raw():
            kernel[plan.grid, plan.block, 0, dynamic](*args_raw)

        t_raw = per_call_us(raw, args.calls)
        t_api = per_call_us(lambda: numbaflash.attention(q, k, v, causal=causal), args.calls)
        t_lse = per_call_us(lambda: numbaflash.attention(q, k, v, causal=causal,
                                                         return_lse=True), args.calls)
        t_numba = per_call_us(lambda: without_direct_launch(
            lambda: numbaflash.attention(q, k, v, causal=causal)), args.calls)
        ratio = t_api / t_raw
        ok &= ratio <= 2.0
        print(f"causal={causal!s:5s} kernel {plan.kernel}: raw {t_raw:7.1f} us   "
              f"api {t_api:7.1f} us ({ratio:.2f}x raw)   api+lse {t_lse:7.1f} us "
              f"({t_lse / t_raw:.2f}x raw)   api, DIRECT_LAUNCH off {t_numba:7.1f} us "
              f"({t_numba / t_raw:.2f}x raw)")
    if args.breakdown:
        breakdown(q, k, v, args.calls)
    if args.profile:
        import cProfile
        import pstats
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(args.calls):
            numbaflash.attention(q, k, v)
        cuda.synchronize()
        profiler.disable()
        print(f"\ncProfile of {args.calls} calls of numbaflash.attention(q, k, v):")
        stats = pstats.Stats(profiler, stream=sys.stdout)
        stats.sort_stats("tottime").print_stats(25)
        stats.sort_stats("cumulative").print_stats(30)
    print("OK: a call costs at most 2x the raw launch" if ok else
          "ABOVE 2x: the Python around the kernel costs more than the launch")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
