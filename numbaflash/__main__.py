"""Command line: ``python -m numbaflash demo [--B 2 --H 4 --N 256 --d 64 --causal]`` and
``python -m numbaflash bench [--shapes 2x16x4096x64 --causal both --versions v2,v3 ...]``.

The demo runs attention on random inputs on whatever backend is there (the GPU, or the
CUDA simulator under NUMBA_ENABLE_CUDASIM=1), checks it against the float64 reference,
and prints the backend, the plan, the error and the time.

The bench checks numbaflash's forward and backward against a float64 reference, then
times them against PyTorch SDPA on the same inputs (numbaflash/bench.py says how).
"""

import argparse
import sys
import time

import numpy as np


def demo(args):
    import numbaflash
    from numbaflash import reference

    try:
        where = numbaflash.backend()
    except RuntimeError as e:
        print(f"numbaflash demo: {e}", file=sys.stderr)
        return 2
    small = where == "simulator"
    B, H = args.B or (1 if small else 2), args.H or (2 if small else 8)
    N, d = args.N or (48 if small else 1024), args.d or (8 if small else 64)
    print(f"backend: {where}" + (" (NUMBA_ENABLE_CUDASIM=1: the kernels run on the CPU, "
                                 "slowly; sizes are kept small)" if small else ""))
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((B, H, N, d)).astype(np.float32) for _ in range(3))
    causal = "bottom_right" if args.causal else False
    print(f"inputs: q, k, v of shape (B, H, N, d) = {q.shape}, float32, causal={causal}")
    print("plan:", numbaflash.explain(q, k, v, causal=causal))

    t0 = time.perf_counter()
    out, lse = numbaflash.attention(q, k, v, causal=causal, return_lse=True)
    t1 = time.perf_counter()
    out, lse = numbaflash.attention(q, k, v, causal=causal, return_lse=True)
    t2 = time.perf_counter()

    ref_out, ref_lse = reference.forward(q, k, v, causal=causal)          # float64
    base_out, _ = reference.forward(q, k, v, causal=causal, dtype=np.float32)
    err = np.abs(out - ref_out).max()
    base_err = np.abs(base_out - ref_out).max()
    lse_err = np.abs(lse - ref_lse).max()
    ok = err <= 2 * base_err + 2 * np.spacing(np.abs(ref_out).max())
    print(f"max |out - float64 reference| = {err:.3e}  (naive float32 NumPy: {base_err:.3e})")
    print(f"max |lse - float64 reference| = {lse_err:.3e}")
    print(f"time: first call {t1 - t0:.3f} s (includes compilation), second call {t2 - t1:.3f} s "
          f"(host to device copies included)")
    print("result:", "OK, within 2x the naive float32 error" if ok else "MISMATCH")
    return 0 if ok else 1


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m numbaflash")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="run attention on random inputs and check it")
    p.add_argument("--B", type=int, help="batch size")
    p.add_argument("--H", type=int, help="heads")
    p.add_argument("--N", type=int, help="sequence length")
    p.add_argument("--d", type=int, help="head dim")
    p.add_argument("--causal", action="store_true", help="bottom-right causal mask")
    p = sub.add_parser("bench", help="check, then time forward and backward against "
                       "PyTorch SDPA (TFLOP/s, memory, a table, JSON, a plot)")
    from numbaflash import bench
    bench.add_arguments(p)
    args = parser.parse_args(argv)
    if args.command == "demo":
        return demo(args)
    if args.command == "bench":
        return bench.cli(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
