"""Forward v6 (tensor cores, K/V split once per tile) on a GPU: checked, then timed.

    python3 scripts/v6_sweep.py              # on a GPU machine (a minute or two)
    python3 scripts/v6_sweep.py --quick      # fewer tiles

At (2, 16, 4096, d), float32, causal (bottom-right) and not. First every kernel's output
for the first (batch, head) is compared with numbaflash.reference in float64: its max
error is printed next to forward v5's (the SIMT default, held to TESTING.md's rule by the
test suite), and a v6 error above 2x v5's is marked WRONG and not timed. Then median of
10 CUDA-event timings after one untimed call (numbaflash.bench.time_ms), for v5 (default
tiles), v3 (default tiles), v6 with each tile in TILES, and PyTorch SDPA's EFFICIENT
backend when torch is importable (the ratio column is SDPA's time / this time).
"""

import argparse
import sys

import numpy as np
from numba import cuda

import numbaflash
from numbaflash import reference
from numbaflash.bench import time_ms

TILES = {64: [(64, 64), (64, 32), (128, 64), (128, 32), (64, 128)],
         128: [(64, 16), (64, 32), (128, 16), (64, 64)]}
QUICK = {64: [(64, 64), (128, 64), (128, 32)], 128: [(64, 16), (128, 16), (128, 32)]}


def sdpa_call(q, k, v, causal):
    """A function timing PyTorch SDPA EFFICIENT on the same memory, or None without torch."""
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return None
    tq, tk, tv = (torch.as_tensor(x, device="cuda") for x in (q, k, v))

    def call():
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv,
                                                                    is_causal=causal)
    return call


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    tiles = QUICK if args.quick else TILES
    rng = np.random.default_rng(0)
    ok = True
    print(f"{'d':>4} {'causal':>6} {'kernel':<22} {'max err':>9} {'v5 err':>9} {'ms':>8} "
          f"{'TFLOP/s':>8} {'vs SDPA':>8}")
    for d, tile_list in tiles.items():
        shape = (2, 16, 4096, d)
        hq, hk, hv = (rng.standard_normal(shape).astype(np.float32) for _ in range(3))
        q, k, v = (cuda.to_device(x) for x in (hq, hk, hv))
        for causal in (False, True):
            ref, _ = reference.forward(hq[0, 0], hk[0, 0], hv[0, 0], causal=causal)
            flops = 4 * 2 * 16 * 4096 * 4096 * d * (0.5 if causal else 1.0)
            sdpa = sdpa_call(q, k, v, causal)
            sdpa_ms = time_ms(sdpa, repeats=10, warmup=1) if sdpa else None
            if sdpa_ms:
                print(f"{d:4d} {causal!s:>6} {'sdpa_efficient':<22} {'':>9} {'':>9} "
                      f"{sdpa_ms:8.2f} {flops / sdpa_ms / 1e9:8.1f} {1.0:8.3f}", flush=True)
            runs = [("v5", None), ("v3", None)] + [("v6", t) for t in tile_list]
            v5_err = None
            for version, t in runs:
                def call():
                    return numbaflash.attention(q, k, v, causal=causal, version=version,
                                                tiles=t)
                out = call().copy_to_host()
                err = float(np.abs(out[0, 0] - ref).max())
                v5_err = err if version == "v5" else v5_err
                bad = version == "v6" and not (err <= 2 * v5_err)
                ok &= not bad
                name = f"{version} {t or 'default'}"
                if bad:
                    print(f"{d:4d} {causal!s:>6} {name:<22} {err:9.2e} {v5_err:9.2e} "
                          f"WRONG RESULT, not timed", flush=True)
                    continue
                ms = time_ms(call, repeats=10, warmup=1)
                ratio = f"{sdpa_ms / ms:8.3f}" if sdpa_ms else f"{'-':>8}"
                print(f"{d:4d} {causal!s:>6} {name:<22} {err:9.2e} {v5_err:9.2e} {ms:8.2f} "
                      f"{flops / ms / 1e9:8.1f} {ratio}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
