"""Forward v8's three builds timed on the same data, float32: plain ((B, H, S, d) arrays,
numbaflash.attention), packed rows reading cu_seqlens (the (B * S, H, d) arrays as they
are, numbaflash.attention_varlen with equal lengths: what
numbaflash.torch.flash_attn_func runs in place), and packed rows of equal lengths (the
pair (nq, nk) as kernel parameters, make_forward_v8's ``equal_lengths``, a lab build
that no plan picks). Is the packed causal build's extra time (run 158: its kernel 1.073x
the plain one) in what a lane cannot know to be the same as its neighbours' (each
sequence's first rows and mask shift read from cu_seqlens)?

    python3 lab/sweeps/v8_packed_causal_time.py [--dim 64] [--shape 2x4096x16]
        [--causal both|yes|no] [--repeats 20]

Each call's launch_forward arguments are recorded (a wrapper around the function each
module calls); each build is then launched alone with them, between two CUDA events
(numbaflash.bench.time_ms, median of --repeats), and 10 launches back to back
(time_ms_queued). The outputs are compared with the plain build's (the same arithmetic:
the same bits expected). Each call names version v8, the default there on a GPU; on
the simulator, at a small --shape, it checks this script, not the speed.
"""
import argparse

import numpy as np
from numba import cuda

import numbaflash
from numbaflash import api, launcher, varlen
from numbaflash.bench import time_ms
from numbaflash.bench.timing import time_ms_queued
from numbaflash.kernels import forward as fwd

RECORDED = []


def recording(real):
    def launch_forward(plan, p, *args, **kwargs):
        RECORDED.append((plan, p, args, kwargs))
        return real(plan, p, *args, **kwargs)
    return launch_forward


def equal_lengths_launch(plan, p, args, kwargs):
    """A launch of the equal-lengths build with a packed call's recorded arguments: its
    variant arguments as launch_forward makes them, the pair (nq, nk) for cu_seqlens."""
    v8 = fwd.module("v8")
    kernel = v8.make_forward_v8(plan.Br, plan.Bc, p.d, p.upper, v8.v8_chunk(p.d, plan.Bc),
                                variant=p.variant, gqa=p.group > 1, equal_lengths=True)
    Q, K, V, O, L = args[:5]
    scale = np.float32(p.softmax_scale)
    head = (Q, K, V, O, L, scale, np.int64(p.causal_offset))
    extra = launcher.variant_arguments(p, None, None, None, kwargs["seqs"])
    full = head + extra[:-1] + (launcher.lengths_argument(p),)
    stream = kwargs.get("stream", launcher.DEFAULT)

    def go():
        launcher.launch(kernel, plan.grid, plan.block, full, None,
                        plan.shared_bytes if plan.dynamic_shared else 0, stream)
    return go, O


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--shape", default="2x4096x16", help="B x S x H")
    ap.add_argument("--causal", default="both", choices=("both", "yes", "no"))
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    B, S, H = (int(x) for x in args.shape.split("x"))
    d = args.dim
    rng = np.random.default_rng([B, S, H, d])
    host = [rng.standard_normal((B, S, H, d)).astype(np.float32) for _ in range(3)]
    plain = [cuda.to_device(np.ascontiguousarray(x.transpose(0, 2, 1, 3))) for x in host]
    packed = [cuda.to_device(x.reshape(B * S, H, d)) for x in host]
    cu = np.arange(0, B * S + 1, S, dtype=np.int32)
    api.launch_forward = recording(api.launch_forward)
    varlen.launch_forward = recording(varlen.launch_forward)
    for causal in {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]:
        RECORDED.clear()
        out = numbaflash.attention(*plain, causal=causal, version="v8")
        pout = numbaflash.attention_varlen(*packed, cu, cu, causal=causal, version="v8")
        cuda.synchronize()
        (plan, p, pargs, pkw), (vplan, vp, vargs, vkw) = RECORDED[:2]
        assert plan.version == vplan.version == "v8", (plan.version, vplan.version)
        real = launcher.launch_forward
        ways = {
            "plain": (lambda: real(plan, p, *pargs, **pkw), out),
            "packed, cu_seqlens": (lambda: real(vplan, vp, *vargs, **vkw), pout),
        }
        ways["packed, equal lengths"] = equal_lengths_launch(vplan, vp, vargs, vkw)
        print(f"(B, S, H, d) = ({B}, {S}, {H}, {d}), float32, causal={causal}, "
              f"tiles ({plan.Br}, {plan.Bc}), grid plain {plan.grid} packed {vplan.grid}")
        ref = out.copy_to_host()
        base = None
        for name, (go, result) in ways.items():
            alone = time_ms(go, args.repeats, warmup=2)
            queued = time_ms_queued(go, calls=10, rounds=5, warmup=1)
            got = result.copy_to_host()
            if got.shape != ref.shape:
                got = got.reshape(B, S, H, d).transpose(0, 2, 1, 3)
            same = np.array_equal(got, ref)
            diff = float(np.abs(got.astype(np.float64) - ref).max())
            base = base or queued
            print(f"  {name:22} alone {alone:7.3f} ms  queued {queued:7.3f} ms "
                  f"({queued / base:.3f}x plain)  vs plain: max |diff| {diff:.1e}"
                  f"{' (same bits)' if same else ''}", flush=True)


if __name__ == "__main__":
    main()
