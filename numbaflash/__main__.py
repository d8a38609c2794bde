"""Command line: ``python -m numbaflash demo [--B 2 --H 4 --N 256 --d 64 --causal]`` and
``python -m numbaflash bench [--shapes 2x16x4096x64 --causal both --versions v2,v3 ...]``
(or ``bench --variants``, ``bench --inference``).

The demo runs attention on random inputs on whatever backend is there (the GPU, or the
CUDA simulator under NUMBA_ENABLE_CUDASIM=1), checks it against the float64 reference,
and prints the backend, the plan, the error and the time.

The bench checks numbaflash's forward and backward against a float64 reference, then
times them against PyTorch SDPA on the same inputs (numbaflash/bench/ says how); with
--variants, the attention variants against their baselines and speed targets; with
--inference, decoding against a KV cache and packed batches against theirs.
"""

import argparse
import sys
import time

import numpy as np

from numbaflash.validate import GRID_Y_MAX, HEAD_DIM_MAX, available_host_bytes


def demo(args, error):
    """The demo command; ``error(message)`` reports a bad option (argparse's parser.error:
    prints the usage and exits with status 2)."""
    import numbaflash
    from numbaflash import reference

    try:
        where = numbaflash.backend()
    except RuntimeError as e:
        print(f"numbaflash demo: {e}", file=sys.stderr)
        return 2
    small = where == "simulator"
    # Sizes not given: small on the simulator (seconds), realistic on a GPU.
    B = args.B if args.B is not None else (1 if small else 2)
    H = args.H if args.H is not None else (2 if small else 8)
    N = args.N if args.N is not None else (48 if small else 1024)
    d = args.d if args.d is not None else (8 if small else 64)
    if B * H > GRID_Y_MAX:
        error(f"--B times --H must be at most {GRID_Y_MAX} (batch * heads is the CUDA grid's "
              f"y axis); got {B} * {H} = {B * H}")
    # The check builds the dense float64 reference, which holds about four N x N score
    # matrices per head (notebook 01 measures it): refuse what cannot fit, before anything
    # is allocated (attention checks its own arrays; validate.check_memory).
    need = 4 * 8 * B * H * N * N + 4 * 4 * B * H * N * d
    have = available_host_bytes()
    if have is not None and need > have:
        error(f"--B {B} --H {H} --N {N} --d {d}: the demo's float64 reference needs about "
              f"{need:,} bytes of host memory (four N x N score matrices per head) and "
              f"{have:,} are available; use a smaller --N")
    print(f"backend: {where}" + (" (NUMBA_ENABLE_CUDASIM=1: the kernels run on the CPU, "
                                 "slowly; the default sizes are small)" if small else ""))
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((B, H, N, d)).astype(np.float32) for _ in range(3))
    causal = "bottom_right" if args.causal else False
    print(f"inputs: q, k, v of shape (B, H, N, d) = {q.shape}, float32, causal={causal}")
    print("plan:", numbaflash.explain(q, k, v, causal=causal))

    try:
        t0 = time.perf_counter()
        out, lse = numbaflash.attention(q, k, v, causal=causal, return_lse=True)
        t1 = time.perf_counter()
        out, lse = numbaflash.attention(q, k, v, causal=causal, return_lse=True)
        t2 = time.perf_counter()
    except MemoryError as e:         # the arrays cannot fit: said before allocating them
        print(f"numbaflash demo: {e}", file=sys.stderr)
        return 2

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


def positive_int(text):
    """argparse type: an integer >= 1 (a size of the demo's inputs)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer; got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer; got {n}")
    return n


def head_dim(text):
    """argparse type: a head dim numbaflash supports, 1 to validate.HEAD_DIM_MAX."""
    n = positive_int(text)
    if n > HEAD_DIM_MAX:
        raise argparse.ArgumentTypeError(f"must be at most {HEAD_DIM_MAX}, numbaflash's "
                                         f"largest head dim; got {n}")
    return n


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m numbaflash")
    sub = parser.add_subparsers(dest="command", required=True)
    p = demo_parser = sub.add_parser("demo", help="run attention on random inputs and check it")
    p.add_argument("--B", type=positive_int, help="batch size (default 1 on the simulator, 2 "
                   "on a GPU)")
    p.add_argument("--H", type=positive_int, help="heads (default 2 on the simulator, 8 on a "
                   "GPU)")
    p.add_argument("--N", type=positive_int, help="sequence length (default 48 on the "
                   "simulator, 1024 on a GPU)")
    p.add_argument("--d", type=head_dim, help=f"head dim, 1 to {HEAD_DIM_MAX} (default 8 on "
                   f"the simulator, 64 on a GPU)")
    p.add_argument("--causal", action="store_true", help="bottom-right causal mask")
    p = sub.add_parser("bench", help="check, then time forward and backward against "
                       "PyTorch SDPA (TFLOP/s, memory, a table, JSON, a plot); --variants: "
                       "the attention variants against their speed targets; --inference: "
                       "decoding against a KV cache and packed batches against theirs")
    from numbaflash import bench
    bench.add_arguments(p)
    args = parser.parse_args(argv)
    if args.command == "demo":
        return demo(args, demo_parser.error)
    if args.command == "bench":
        return bench.cli(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
