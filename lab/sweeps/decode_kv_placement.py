"""Where K and V lie in memory, and how the transposed decode kernel lays out and copies
their tiles, against the decode call's time: tests of whether the split kernel's DRAM
throughput (about 80 % of the peak where SDPA's kernel reaches 91 %) depends on the
distance between the two caches, on where the tiles' rows lie in shared memory, and on an
L2 prefetch hint.

    python3 lab/sweeps/decode_kv_placement.py [--shapes b1-gqa,b8-gqa] [--dtype float16]
        [--placements separate,0,4096,69632] [--layouts swizzled,padded,swizzled+256]
        [--kernel split_kv_mma_t|split_kv_mma]
        [--repeats 50]   (--repeats 0: each call once, untimed, for Nsight Compute)

At the bench's decode shapes each cache is a power of two bytes (2^28 at b1-gqa), so two
caches allocated one after the other usually start a power of two apart. Placements:
"separate" (two allocations, as bench --inference makes them: the distance is printed),
or a number g: both caches in one buffer, V starting g bytes after K's end. Layouts
(the LAYOUT of --kernel's module, the only decode kernel the policy may choose here):
"swizzled" (the default) or "padded" (forward v10's rows), with "+256" the L2::256B
prefetch hint on every copy (split_kv_mma.L2_PREFETCH, which only split_kv_mma_t
reads). Each line: the shape, the placement, the distance between the caches, then
SDPA's ms a call alone and queued, then per layout numbaflash's ms a call alone and
queued (bench's time_ms and time_ms_queued, the default stream) and whether its out has
the first layout's bits.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))

import numpy as np                                   # noqa: E402

import numbaflash                                    # noqa: E402
from numbaflash import decode_direct, policy         # noqa: E402
from numbaflash.bench.timing import time_ms, time_ms_queued   # noqa: E402
from numbaflash.kernels.decode import split_kv_mma, split_kv_mma_t   # noqa: E402
from decode_gpu import SHAPES, _inputs               # noqa: E402


def caches(shape, dtype, placement):
    """q, k_cache, v_cache (torch tensors, random normal) with V placed as ``placement``
    says (module docstring); "separate": scripts/decode_gpu.py's inputs, as bench's."""
    import torch
    if placement == "separate":
        return _inputs(shape, dtype)
    B, Hq, Hk, Sq, S_max, d = shape
    g = torch.Generator(device="cuda").manual_seed(0)
    tdt = getattr(torch, dtype)
    q = torch.randn((B, Hq, Sq, d), generator=g, device="cuda", dtype=tdt)
    gap = int(placement)
    n = B * Hk * S_max * d
    size = torch.empty((), dtype=tdt).element_size()
    if gap % 256:
        raise SystemExit(f"a gap must be a multiple of 256 bytes; got {gap}")
    buf = torch.empty(2 * n + gap // size, device="cuda", dtype=tdt)
    kc = buf[:n].view(B, Hk, S_max, d)
    vc = buf[n + gap // size:].view(B, Hk, S_max, d)
    kc.normal_(generator=g)
    vc.normal_(generator=g)
    return q, kc, vc


def main():
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="b1-gqa,b8-gqa")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--placements", default="separate,0,4096,69632")
    ap.add_argument("--layouts", default="swizzled,padded,swizzled+256")
    ap.add_argument("--kernel", default="split_kv_mma_t",
                    choices=("split_kv_mma_t", "split_kv_mma"))
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args()
    module = {"split_kv_mma_t": split_kv_mma_t, "split_kv_mma": split_kv_mma}[args.kernel]
    keep = module.LAYOUT, split_kv_mma.L2_PREFETCH
    policy.DECODE_KERNELS = (args.kernel,)      # the only kernel the plans may choose
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        S_max = shape[4]
        for placement in args.placements.split(","):
            q, kc, vc = caches(shape, args.dtype, placement)
            apart = vc.data_ptr() - kc.data_ptr()
            sdpa = lambda: F.scaled_dot_product_attention(q, kc, vc, enable_gqa=True)
            theirs = (float("nan"),) * 2
            if args.repeats:
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    theirs = (time_ms(sdpa, repeats=args.repeats),
                              time_ms_queued(sdpa, calls=args.repeats, rounds=3))
            line = (f"placement {name} {shape} {args.dtype} {placement}: V starts "
                    f"{apart} bytes after K ({apart / 2**20:.3f} MiB; mod 2^20 "
                    f"{apart % 2**20}); SDPA FLASH {theirs[0]:.4f} alone "
                    f"{theirs[1]:.4f} queued")
            first = None
            for how in args.layouts.split(","):
                layout, _, prefetch = how.partition("+")
                module.LAYOUT = layout
                split_kv_mma.L2_PREFETCH = int(prefetch) if prefetch else None
                decode_direct.forget()      # repeated calls are keyed without the switch
                call = lambda: numbaflash.attention_with_kvcache(q, kc, vc,
                                                                 cache_seqlens=S_max)
                got = call()
                out = (got.cpu().numpy() if hasattr(got, "cpu")
                       else np.asarray(got.copy_to_host()))
                first = out if first is None else first
                same = np.array_equal(out.view(np.uint16), first.view(np.uint16))
                if not args.repeats:        # one call each (for Nsight Compute)
                    line += f"; {how} called once{'' if same else ' (bits differ)'}"
                    continue
                alone = time_ms(call, repeats=args.repeats)
                queued = time_ms_queued(call, calls=args.repeats, rounds=3)
                line += (f"; {how} {alone:.4f} alone {queued:.4f} queued"
                         f"{'' if same else ' (bits differ)'}")
            module.LAYOUT, split_kv_mma.L2_PREFETCH = keep
            decode_direct.forget()
            plan = numbaflash.explain_kvcache(q, kc, vc, cache_seqlens=S_max)[0]
            print(line + f" [{plan.kernel}, {plan.grid[0]} splits]", flush=True)
            del q, kc, vc
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
