"""Are two numbaflash trees the same kernels? Bitwise outputs and gradients, on a GPU.

A change that only moves code (files, names, the policy apart from the plans) must give
the same bits. Run this script once per tree, each time with that tree first on
``sys.path``, then compare:

    PYTHONPATH=/path/to/old python lab/sweeps/same_bits.py run --out old.npz
    PYTHONPATH=/path/to/new python lab/sweeps/same_bits.py run --out new.npz
    python lab/sweeps/same_bits.py compare old.npz new.npz

``run`` calls the public API only (``attention``, ``attention_backward``, ``explain``,
``explain_backward``), which both trees share, for every forward and backward version at
a few shapes (ragged lengths, both causal alignments, float32 and float16, d = 64 and 128,
plus GQA with a window and softcap on the variant kernels), with fixed seeds; it stores
every output, lse and gradient and the plan each call ran. ``compare`` checks that the
plans and every array are identical, bit for bit (NaN positions included), except backward
v2's dQ, which is summed with atomics in an order that varies between runs of one tree
(compared within 1e-5 there), and prints each difference. Without a GPU it runs on the simulator only with NUMBA_ENABLE_CUDASIM=1
(small shapes: ``--small``).
"""

import argparse
import json
import sys
import zlib

import numpy as np


def cases(small):
    """(name, shape of q, of k, dtype, causal, extra keyword arguments, versions)."""
    B, H, Sq, Sk = (1, 2, 37, 29) if small else (2, 4, 777, 1000)
    ds = (8,) if small else (64, 128)
    out = []
    for d in ds:
        for dtype in ("float32", "float16"):
            for causal in (False, True, "top_left"):
                out.append((f"plain-d{d}-{dtype}-{causal}", (B, H, Sq, d), (B, H, Sk, d),
                            dtype, causal, {}))
        out.append((f"gqa-window-softcap-d{d}", (B, 2 * H, Sq, d), (B, H, Sk, d), "float32",
                    True, {"window_size": (100, 0), "softcap": 20.0}))
    return out


def run(args):
    import numbaflash
    from numbaflash.kernels.backward import VERSIONS as BACKWARD
    from numbaflash.kernels.forward import VERSIONS as FORWARD
    arrays, plans = {}, {}
    for name, qs, ks, dtype, causal, extra in cases(args.small):
        rng = np.random.default_rng(zlib.crc32(name.encode()))
        q, k, v = (rng.standard_normal(s).astype(dtype) for s in (qs, ks, ks))
        dout = rng.standard_normal(qs).astype(dtype)
        for version in (None,) + tuple(FORWARD):
            key = f"{name}/forward-{version or 'default'}"
            try:
                plan = numbaflash.explain(q, k, v, causal=causal, version=version, **extra)
            except ValueError as err:
                plans[key] = f"refused: {str(err).split(':')[0]}"
                continue
            out, lse = numbaflash.attention(q, k, v, causal=causal, version=version,
                                            return_lse=True, **extra)
            arrays[key + "/out"], arrays[key + "/lse"] = np.asarray(out), np.asarray(lse)
            plans[key] = f"{plan.kernel} {plan.Br}x{plan.Bc} grid {plan.grid} block {plan.block}"
        out, lse = numbaflash.attention(q, k, v, causal=causal, return_lse=True, **extra)
        for version in (None,) + tuple(BACKWARD):
            key = f"{name}/backward-{version or 'default'}"
            try:
                bplans = numbaflash.explain_backward(q, k, v, causal=causal, version=version,
                                                     **extra)
                grads = numbaflash.attention_backward(dout, q, k, v, out, lse, causal=causal,
                                                      version=version, **extra)
            except ValueError as err:
                plans[key] = f"refused: {str(err).split(':')[0]}"
                continue
            for g, a in zip(("dq", "dk", "dv"), grads):
                arrays[f"{key}/{g}"] = np.asarray(a)
            plans[key] = "; ".join(f"{p.kernel} {p.Br}x{p.Bc} grid {p.grid}" for p in bplans)
        print(f"{name}: done", flush=True)
    np.savez(args.out, **arrays, __plans__=np.array(json.dumps(plans, sort_keys=True)))
    print(f"{len(arrays)} arrays, {len(plans)} plans -> {args.out}")


def compare(args):
    a, b = np.load(args.old), np.load(args.new)
    plans_a = json.loads(str(a["__plans__"]))
    plans_b = json.loads(str(b["__plans__"]))
    bad = 0
    for key in sorted(set(plans_a) | set(plans_b)):
        if plans_a.get(key) != plans_b.get(key):
            bad += 1
            print(f"PLAN DIFFERS {key}: {plans_a.get(key)!r} vs {plans_b.get(key)!r}")
    names = sorted(set(a.files) | set(b.files) - {"__plans__"})
    same = atomic = 0
    for n in names:
        if n == "__plans__":
            continue
        if n not in a.files or n not in b.files:
            bad += 1
            print(f"MISSING {n}")
            continue
        x, y = a[n], b[n]
        if "/backward-v2/dq" in n and x.shape == y.shape and np.allclose(x, y, rtol=1e-5,
                                                                          atol=1e-5):
            # v2 adds into dQ with atomics, in an order that varies from run to run (its
            # docstring says so): the same tree does not give the same bits twice
            print(f"atomics {n}: within 1e-5, max |a - b| = {np.max(np.abs(x - y)):.2e}")
            atomic += 1
            continue
        if x.dtype != y.dtype or x.shape != y.shape or x.tobytes() != y.tobytes():
            bad += 1
            diff = np.nanmax(np.abs(x.astype(np.float64) - y.astype(np.float64)))
            print(f"DIFFERS {n}: max |a - b| = {diff}")
        else:
            same += 1
    print(f"{same} arrays bitwise identical, {atomic} atomic-order dQ arrays within 1e-5, "
          f"{len(plans_a)} plans compared, {bad} differences")
    return 1 if bad else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", required=True)
    r.add_argument("--small", action="store_true", help="simulator-sized shapes")
    c = sub.add_parser("compare")
    c.add_argument("old")
    c.add_argument("new")
    args = ap.parse_args()
    if args.what == "run":
        run(args)
        return 0
    return compare(args)


if __name__ == "__main__":
    sys.exit(main())
