"""Each backward kernel timed on its own, for the same data in the two layouts the
default path can take: (B, H, S, d) arrays (attention_backward) and the packed
(B * S, H, d) arrays read as they are (attention_varlen_backward, equal lengths: what
numbaflash.torch.flash_attn_func would run in place). Where does the packed backward's
extra time go?

    python3 lab/sweeps/packed_backward_kernels.py [--dtype float32] [--dim 64] [--causal]
                                                  [--shape 2x4096x16] [--repeats 20]
    python3 lab/sweeps/packed_backward_kernels.py --once ...   # two calls of each backward
                                                               # (the first compiles),
                                                               # nothing timed: for ncu's
                                                               # --launch-skip 6

Several processes may run at once: each compiles and makes its first calls on its own,
then takes a file lock (/tmp/packed_backward_kernels.lock) for what it times (or for
--once's second calls).

Both calls are made once; their launch_backward arguments are recorded (a wrapper around
the function each module calls) and each planned kernel with tiles is then launched
alone with them, between two CUDA events (numbaflash.bench.time_ms, median of
--repeats). All the planned kernels together, and the whole backward call of each
layout (host time included), are timed too, and the two layouts' gradients are compared
(max |a - b| / max |b|; the same arithmetic should give the same bits). GPU only.
"""
import argparse
import fcntl

import numpy as np
from numba import cuda

import numbaflash
from numbaflash import api, varlen
from numbaflash.bench import time_ms
from numbaflash.kernels.plan import Plans

RECORDED = []


def recording(real):
    def launch(plans, *args, **kwargs):
        RECORDED.append((plans, args, kwargs, real))
        return real(plans, *args, **kwargs)
    return launch


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--shape", default="2x4096x16", help="B x S x H")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--once", action="store_true")
    args = ap.parse_args()
    B, S, H = (int(x) for x in args.shape.split("x"))
    d, dtype, causal = args.dim, np.dtype(args.dtype), args.causal
    rng = np.random.default_rng([B, S, H, d])
    host = [rng.standard_normal((B, S, H, d)).astype(dtype) for _ in range(4)]
    # (B, H, S, d) copies and the packed (B * S, H, d) arrays of the same values
    plain = [cuda.to_device(np.ascontiguousarray(x.transpose(0, 2, 1, 3))) for x in host]
    packed = [cuda.to_device(x.reshape(B * S, H, d)) for x in host]
    cu = cuda.to_device(np.arange(0, B * S + 1, S, dtype=np.int32))

    api.launch_backward = recording(api.launch_backward)
    varlen.launch_backward = recording(varlen.launch_backward)

    q, k, v, do = plain
    out, lse = numbaflash.attention(q, k, v, causal=causal, return_lse=True)

    def plain_call():
        return numbaflash.attention_backward(do, q, k, v, out, lse, causal=causal)

    pq, pk, pv, pdo = packed
    pout, plse = numbaflash.attention_varlen(pq, pk, pv, cu, cu, max_seqlen_q=S,
                                             max_seqlen_k=S, causal=causal, return_lse=True)

    def packed_call():
        return numbaflash.attention_varlen_backward(pdo, pq, pk, pv, pout, plse, cu, cu,
                                                    max_seqlen_q=S, max_seqlen_k=S,
                                                    causal=causal)

    grads_plain = plain_call()
    grads_packed = packed_call()
    cuda.synchronize()
    lock = open("/tmp/packed_backward_kernels.lock", "w")
    fcntl.flock(lock, fcntl.LOCK_EX)        # held until the process ends
    if args.once:
        plain_call()
        packed_call()
        cuda.synchronize()
        print("two calls of each backward made")
        return
    names = ("dq", "dk", "dv")
    for name, a, b in zip(names, grads_plain, grads_packed):
        a = a.copy_to_host().astype(np.float64)
        b = b.copy_to_host().astype(np.float64).reshape(B, S, H, d).transpose(0, 2, 1, 3)
        diff = float(np.abs(a - b).max() / max(np.abs(a).max(), 1e-30))
        print(f"{name}: packed vs plain max rel diff {diff:.2e}"
              f"{' (same bits)' if np.array_equal(a, b) else ''}")
    print(f"(B, S, H, d) = ({B}, {S}, {H}, {d}), {dtype}, causal={causal}")
    calls = RECORDED[:2]
    for label, (plans, largs, kwargs, real) in zip(("plain", "packed"), calls):
        # the tiled kernels alone; the D kernel (no tiles: the launcher takes the variant
        # arguments from a tiled plan) as all kernels' time less theirs
        alone = []
        for plan in plans:
            if plan.Br:
                one = Plans((plan,))
                ms = time_ms(lambda: real(one, *largs, **kwargs), args.repeats, warmup=2)
                alone.append(ms)
                print(f"{label:6} {plan.kernel} grid {plan.grid} block {plan.block} "
                      f"smem {plan.shared_bytes}: {ms:.3f} ms")
        ms = time_ms(lambda: real(plans, *largs, **kwargs), args.repeats, warmup=2)
        print(f"{label:6} all {len(plans)} kernels: {ms:.3f} ms (untiled ones "
              f"{ms - sum(alone):.3f} ms by difference)")
    for label, fn in (("plain", plain_call), ("packed", packed_call)):
        print(f"{label:6} whole attention{'_varlen' if label == 'packed' else ''}_backward: "
              f"{time_ms(fn, args.repeats, warmup=2):.3f} ms")


if __name__ == "__main__":
    main()
