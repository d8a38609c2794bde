"""Dropout on a GPU: agreement with the dense reference, bitwise reruns, and its cost.

    python scripts/dropout_gpu.py [--repeats 10] [--reruns 50] [--parts cost,agreement,reruns]
                                  [--sizes 64,128] [--dtypes float32,float16] [--no-register-cap]

1. Agreement: the default path's forward and backward with dropout (float32 and float16,
   causal and not, GQA) against ``numbaflash.reference`` in float64 given
   ``numbaflash.dropout_mask``, by the bench's rule (``bench._agreement``: the error of
   the same formula in the input's precision is the baseline).
2. Reruns: the backward with dropout ``--reruns`` times; every run bitwise the first.
3. Cost: forward and forward + backward with dropout_p = 0.1 against the same call
   without dropout, at (2, 16, 4096, 64) and (2, 16, 4096, 128), float32 and float16,
   one process, CUDA events (median). Prints "ratio" = with / without, and the backward's
   own time (fwd+bwd minus forward) with and without.

``--no-register-cap`` turns off the register cap of backward v6's dK/dV kernel with
dropout (kernels/backward/v6_split_pairs.py, DKDV_DROPOUT_MAX_REGISTERS) before any kernel
is compiled, so that two processes time the kernel with and without it.

Every line is printed as it comes (flush), so a run cut short keeps what it measured.
"""

import argparse
import sys
import time

import numpy as np
from numba import cuda

import numbaflash
from numbaflash import bench, reference


def agreement():
    rng = np.random.default_rng(7)
    cases = [  # (B, Hq, Hkv, Sq, Sk, d, dtype, causal, p)
        (2, 4, 4, 300, 257, 64, np.float32, False, 0.1),
        (1, 4, 2, 256, 384, 128, np.float32, True, 0.3),
        (2, 4, 4, 200, 200, 64, np.float16, True, 0.2),
        (1, 8, 2, 130, 300, 64, np.float16, False, 0.5),
    ]
    bad = 0
    for B, Hq, Hkv, Sq, Sk, d, dtype, causal, p in cases:
        q = rng.standard_normal((B, Hq, Sq, d)).astype(dtype)
        k, v = (rng.standard_normal((B, Hkv, Sk, d)).astype(dtype) for _ in range(2))
        dout = rng.standard_normal((B, Hq, Sq, d)).astype(dtype)
        seed = int(rng.integers(0, 2**63))
        opts = dict(causal=causal, dropout_p=p, dropout_seed=seed)
        out, lse = numbaflash.attention(q, k, v, return_lse=True, **opts)
        grads = numbaflash.attention_backward(dout, q, k, v, out, lse, **opts)
        keep = numbaflash.dropout_mask(B, Hq, Sq, Sk, p, seed)
        ref_kw = dict(dropout_p=p, dropout_keep=keep)
        f64 = [x.astype(np.float64) for x in (q, k, v, dout)]
        ref_o, _ = reference.forward(*f64[:3], causal, **ref_kw)
        low = [x.astype(dtype) for x in f64]     # the same formula in the input's precision
        base_o, _ = reference.forward(*low[:3], causal, dtype=dtype, **ref_kw)
        ref_g = reference.backward(f64[3], *f64[:3], causal, **ref_kw)
        base_g = reference.backward(low[3], *low[:3], causal, dtype=dtype, **ref_kw)
        worst, ok = 0.0, True
        for what, got, want, base in zip(("out", "dq", "dk", "dv"), (out, *grads),
                                          (ref_o, *ref_g), (base_o, *base_g)):
            c = bench._agreement(np.asarray(got, np.float64), want, base, dtype,
                                 bench.MULT[what], None)
            ok &= c["ok"]
            worst = max(worst, c["max_err"] / c["bound"])
        bad += not ok
        print(f"{'OK  ' if ok else 'FAIL'} agreement {(B, Hq, Hkv, Sq, Sk, d)} "
              f"{np.dtype(dtype).name} causal={causal} p={p}: max err/bound {worst:.3f}",
              flush=True)
    return bad


def reruns(n):
    rng = np.random.default_rng(3)
    q, k, v, dout = (cuda.to_device(rng.standard_normal((2, 8, 1024, 64)).astype(np.float32))
                     for _ in range(4))
    opts = dict(causal=True, dropout_p=0.2, dropout_seed=99)
    out, lse = numbaflash.attention(q, k, v, return_lse=True, **opts)
    first = [g.copy_to_host() for g in numbaflash.attention_backward(dout, q, k, v, out, lse,
                                                                     **opts)]
    same = 0
    for _ in range(n - 1):
        got = numbaflash.attention_backward(dout, q, k, v, out, lse, **opts)
        same += all(np.array_equal(g.copy_to_host(), f) for g, f in zip(got, first))
    print(f"reruns: {same + 1} of {n} backward runs bitwise the first", flush=True)
    return same + 1 != n


def cost(repeats, sizes, dtypes):
    for d in sizes:
        for dtype in dtypes:
            rng = np.random.default_rng(0)
            q, k, v, dout = (cuda.to_device(
                rng.standard_normal((2, 16, 4096, d)).astype(dtype)) for _ in range(4))
            both = {}
            for what in ("forward", "fwd+bwd"):
                ms = both[what] = {}
                for name, opts in (("plain", {}), ("dropout 0.1",
                                                   dict(dropout_p=0.1, dropout_seed=5))):
                    def call(opts=opts):
                        o, l = numbaflash.attention(q, k, v, return_lse=True, **opts)
                        if what == "fwd+bwd":
                            numbaflash.attention_backward(dout, q, k, v, o, l, **opts)
                    call()
                    ms[name] = bench.time_ms(call, repeats=repeats, warmup=1)
                print(f"cost (2, 16, 4096, {d}) {np.dtype(dtype).name} {what}: plain "
                      f"{ms['plain']:.3f} ms, dropout {ms['dropout 0.1']:.3f} ms, ratio "
                      f"{ms['dropout 0.1'] / ms['plain']:.3f}", flush=True)
            bwd = {name: both["fwd+bwd"][name] - both["forward"][name] for name in both["forward"]}
            print(f"cost (2, 16, 4096, {d}) {np.dtype(dtype).name} backward alone: plain "
                  f"{bwd['plain']:.3f} ms, dropout {bwd['dropout 0.1']:.3f} ms, ratio "
                  f"{bwd['dropout 0.1'] / bwd['plain']:.3f}", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--reruns", type=int, default=50)
    ap.add_argument("--parts", default="cost,agreement,reruns")
    ap.add_argument("--sizes", default="64,128", help="head dims of the cost part")
    ap.add_argument("--dtypes", default="float32,float16", help="dtypes of the cost part")
    ap.add_argument("--no-register-cap", action="store_true")
    args = ap.parse_args(argv)
    parts = args.parts.split(",")
    if args.no_register_cap:
        from numbaflash.kernels.backward import v6_split_pairs
        v6_split_pairs.DKDV_DROPOUT_MAX_REGISTERS = None
    cap = "off" if args.no_register_cap else "on"
    print(f"numbaflash dropout on {numbaflash.backend()}, {time.strftime('%Y-%m-%d %H:%M')}, "
          f"dK/dV register cap {cap}", flush=True)
    failed = 0
    for part in parts:
        if part == "cost":
            cost(args.repeats, [int(x) for x in args.sizes.split(",")],
                 [np.dtype(x).type for x in args.dtypes.split(",")])
        elif part == "agreement":
            failed += agreement()
        elif part == "reruns":
            failed += reruns(args.reruns)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
