"""Why the bench's forward at a short sequence took longer than a direct call (run 66:
0.541 ms at (1, 16, 1024, 64); run 67: 0.349 ms): the same forward timed the ways the two
differ.

    python3 scripts/bench_vs_direct.py [--shape 1x16x1024x64]     # GPU, under a minute

numbaflash.bench.time_ms (CUDA events, median) of numbaflash.attention on one shape,
float32, not causal, for each of: inputs made by numba (cuda.to_device) or viewed from
torch tensors (cuda.as_cuda_array, as the bench makes them); return_lse off or on (the
bench's call returns it); 5 repeats (the bench's --repeats 5) or 10. Then the first line
again, to show whether the GPU was still warming up at the start. Written in session 11,
when the device time had run out: not yet run on a GPU.
"""
import argparse

import numpy as np
from numba import cuda

import numbaflash
from numbaflash.bench import time_ms


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="1x16x1024x64")
    args = ap.parse_args()
    shape = tuple(int(x) for x in args.shape.split("x"))
    rng = np.random.default_rng(0)
    made = {"numba": [cuda.to_device(rng.standard_normal(shape).astype(np.float32))
                      for _ in range(3)]}
    try:
        import torch
    except ImportError:
        print("torch not importable: the torch-view rows are not run")
    else:
        made["torch view"] = [cuda.as_cuda_array(torch.randn(shape, device="cuda"))
                              for _ in range(3)]
    rows = [(src, lse, reps) for src in made for lse in (False, True) for reps in (5, 10)]
    rows.append(rows[0])
    for src, lse, reps in rows:
        q, k, v = made[src]
        numbaflash.attention(q, k, v, return_lse=lse)       # compile, allocate once
        t = time_ms(lambda: numbaflash.attention(q, k, v, return_lse=lse), reps, warmup=1)
        print(f"{shape} inputs {src:10s} return_lse={lse!s:5} repeats {reps:2d}: {t:.3f} ms",
              flush=True)


if __name__ == "__main__":
    main()
