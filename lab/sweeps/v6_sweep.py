"""Forward v6 (tensor cores, K/V split once per tile) on a GPU: checked, then timed.

    python3 scripts/v6_sweep.py              # on a GPU machine (a minute or two)
    python3 scripts/v6_sweep.py --quick      # fewer tiles
    python3 scripts/v6_sweep.py --configs 64:64:64:16:0,64:64:64:16:168
                                             # kernel variants d:Br:Bc:chunk:max_registers
    python3 scripts/v6_sweep.py --configs 64:128:64:16:0:v8
                                             # the same for forward v8 (v6's kernel with
                                             # the next chunk's S before the softmax) or
                                             # v9 (v8 with asynchronous K/V copies)

At (2, 16, 4096, d), float32, causal (bottom-right) and not. First every kernel's output
for the first (batch, head) is compared with numbaflash.reference in float64: its max
error is printed next to forward v5's (the SIMT default, held to TESTING.md's rule by the
test suite), and a v6 error above 2x v5's is marked WRONG and not timed. Then median of
10 CUDA-event timings after one untimed call (numbaflash.bench.time_ms), for v5 (default
tiles), v3 (default tiles), v6 with each tile in TILES, and PyTorch SDPA's EFFICIENT
backend when torch is importable (the ratio column is SDPA's time / this time).
With --configs, a v8 or v9 variant is also compared with v6's kernel of the same knobs on
the same inputs: v8 only reorders v6's work, and v9 only changes how v8's tiles arrive,
so their O must be bitwise v6's ("== v6" column; a difference is marked WRONG and not
timed).
"""

import argparse
import sys

import numpy as np
from numba import cuda

import numbaflash
from numbaflash import dispatch, reference
from numbaflash.bench import time_ms
from numbaflash.kernels import forward as fwd
from numbaflash.kernels import smem

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


def variant_call(q, k, v, causal, d, Br, Bc, chunk, max_registers, version="v6"):
    """A function launching make_forward_v6 (or v8, v9)(Br, Bc, d, causal, chunk,
    max_registers) on (2, 16, 4096, d) device arrays directly (the knobs the dispatcher
    does not expose), returning O, and the kernel's registers per thread."""
    factory = {"v6": fwd.make_forward_v6, "v8": fwd.make_forward_v8,
               "v9": fwd.make_forward_v9}[version]
    kernel = factory(Br, Bc, d, True if causal else False, chunk, max_registers or None)
    B, H, N, _ = q.shape
    Q, K, V = (x.reshape(B * H, N, d) for x in (q, k, v))
    nbytes = (dispatch.v9_shared_bytes if version == "v9" else dispatch.v6_shared_bytes)(
        Br, Bc, d)

    def call():
        O = cuda.device_array((B * H, N, d), np.float32)
        L = cuda.device_array((B * H, N), np.float32)
        args = (Q, K, V, O, L, np.float32(1 / np.sqrt(d)), np.int64(0))
        smem.allow_dynamic_shared_memory(kernel, args, nbytes)
        kernel[((N + Br - 1) // Br, B * H), (2 * Br,), 0, nbytes](*args)
        return O.reshape(B, H, N, d)
    call()
    regs = kernel.get_regs_per_thread()
    return call, (next(iter(regs.values())) if isinstance(regs, dict) else regs)


def configs_main(configs):
    """--configs: each kernel variant checked against float64 (first head) and timed."""
    rng = np.random.default_rng(0)
    ok = True
    by_d = {}
    for item in configs.split(","):
        fields = item.split(":")
        version = fields.pop() if len(fields) == 6 else "v6"
        d, Br, Bc, chunk, maxreg = (int(x) for x in fields)
        by_d.setdefault(d, []).append((Br, Bc, chunk, maxreg, version))
    print(f"{'d':>4} {'causal':>6} {'ver':>3} {'Br':>4} {'Bc':>4} {'chunk':>5} {'maxreg':>6} "
          f"{'regs':>5} {'max err':>9} {'== v6':>5} {'ms':>8} {'TFLOP/s':>8} {'vs SDPA':>8}")
    for d, variants in by_d.items():
        shape = (2, 16, 4096, d)
        hq, hk, hv = (rng.standard_normal(shape).astype(np.float32) for _ in range(3))
        q, k, v = (cuda.to_device(x) for x in (hq, hk, hv))
        for causal in (False, True):
            ref, _ = reference.forward(hq[0, 0], hk[0, 0], hv[0, 0], causal=causal)
            flops = 4 * 2 * 16 * 4096 * 4096 * d * (0.5 if causal else 1.0)
            sdpa = sdpa_call(q, k, v, causal)
            sdpa_ms = time_ms(sdpa, repeats=10, warmup=1) if sdpa else None
            v5_err = float(np.abs(numbaflash.attention(q, k, v, causal=causal, version="v5")
                                  .copy_to_host()[0, 0] - ref).max())
            for Br, Bc, chunk, maxreg, version in variants:
                call, regs = variant_call(q, k, v, causal, d, Br, Bc, chunk, maxreg, version)
                out = call().copy_to_host()
                err = float(np.abs(out[0, 0] - ref).max())
                same = "-"
                if version != "v6":
                    v6_out = variant_call(q, k, v, causal, d, Br, Bc, chunk, maxreg)[0]()
                    same = "yes" if np.array_equal(out, v6_out.copy_to_host()) else "NO"
                head = (f"{d:4d} {causal!s:>6} {version:>3} {Br:4d} {Bc:4d} {chunk:5d} "
                        f"{maxreg:6d} {regs:5d} {err:9.2e} {same:>5}")
                if not err <= 2 * v5_err or same == "NO":
                    ok = False
                    print(f"{head} WRONG RESULT (v5 {v5_err:.2e}), not timed", flush=True)
                    continue
                ms = time_ms(call, repeats=10, warmup=1)
                ratio = f"{sdpa_ms / ms:8.3f}" if sdpa_ms else f"{'-':>8}"
                print(f"{head} {ms:8.2f} {flops / ms / 1e9:8.1f} {ratio}", flush=True)
    return 0 if ok else 1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--configs", help="d:Br:Bc:chunk:max_registers[:v8|v9],... (0: no limit)")
    args = ap.parse_args()
    if args.configs:
        return configs_main(args.configs)
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
