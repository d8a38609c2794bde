"""Forward v4's thread tiles on a GPU: time each configuration next to v2 and v3.

    python scripts/v4_sweep.py            # on a GPU machine

For (B, H, N, d) = (2, 16, 4096, d), d in {64, 128}, float32, not causal: the median
time (CUDA events, 10 runs after 2 warm-ups) of v2, v3 and v4 with each (Br, Bc, TM, TN)
below, and each one's max |out - v2's out| (v2 is checked against float64 references in
the test suite and by scripts/gpu_check.py; a configuration more than 1e-4 away is
marked WRONG and its time is not a result).
"""

import statistics
import sys

import numpy as np
from numba import cuda

import numbaflash

CONFIGS = {64: [None, (64, 32, 4, 4), (64, 32, 8, 4), (32, 32, 4, 4), (64, 32, 4, 2)],
           128: [None, (32, 16, 4, 2), (32, 16, 4, 4), (32, 32, 4, 4)]}


def time_ms(fn, repeats=10, warmup=2):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = cuda.event(), cuda.event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cuda.event_elapsed_time(start, end))
    return statistics.median(times)


def main():
    rng = np.random.default_rng(0)
    ok = True
    for d, configs in CONFIGS.items():
        shape = (2, 16, 4096, d)
        flops = 4 * 2 * 16 * 4096 * 4096 * d
        q, k, v = (cuda.to_device(rng.standard_normal(shape).astype(np.float32)) for _ in range(3))
        ref = numbaflash.attention(q, k, v, version="v2").copy_to_host()
        runs = [("v2", None), ("v3", None)] + [("v4", c) for c in configs]
        for version, tiles in runs:
            try:
                plan = numbaflash.explain(q, k, v, version=version, tiles=tiles)
                out = numbaflash.attention(q, k, v, version=version, tiles=tiles).copy_to_host()
            except ValueError as e:
                print(f"d={d} {version} {tiles}: not run ({e})")
                continue
            err = float(np.abs(out - ref).max())
            ms = time_ms(lambda: numbaflash.attention(q, k, v, version=version, tiles=tiles))
            good = err <= 1e-4
            ok &= good
            print(f"d={d:3d} {version} tiles={tiles or 'default'!s:16s} "
                  f"(plan {plan.Br}x{plan.Bc} thread tile {getattr(plan, 'thread_tile', None)}, "
                  f"block {plan.block}) {ms:8.3f} ms {flops / ms / 1e9:6.2f} TFLOP/s  "
                  f"max|out - v2| {err:.2e} {'ok' if good else 'WRONG'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
