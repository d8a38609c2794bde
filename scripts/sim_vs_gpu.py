"""The same kernels on the same inputs, on the GPU and in Numba's CUDA simulator.

    python scripts/sim_vs_gpu.py [--out DIR]        # on a machine with a CUDA GPU

Learners run numbaflash in the simulator (NUMBA_ENABLE_CUDASIM=1) and trust that what
they see is what the GPU computes. This script checks it: it draws small inputs (sizes
the simulator can afford: d <= 16, seqlens <= 20, batch * heads <= 2; ragged lengths
that cross the simulator's 8 x 8 tiles (forward v4, backward v3), both causal
alignments, fully masked rows, float16/32/64), runs every forward and backward version
that both backends can run, once in this process on the GPU and once in a child process
with NUMBA_ENABLE_CUDASIM=1, and compares the results.

The simulator's half took 10-17 s in four runs on a shared 2-core CPU machine
(2026-12-01, numba-cuda 0.30.4); the larger cases it had before took 27-29 s there. To
time it without a GPU:

    python scripts/sim_vs_gpu.py --inputs /tmp/in.npz        # writes the inputs only
    NUMBA_ENABLE_CUDASIM=1 python scripts/sim_vs_gpu.py --_compute /tmp/in.npz /tmp/sim.npz

They are not bitwise equal, and should not be: the simulator evaluates ``math.exp`` and
``math.log`` in Python (float64) and the GPU in float32 with fused multiply-adds.
TESTING.md asks for agreement "within a few ulps"; the check here is

    max |gpu - sim| <= ULPS * spacing(max |sim|)      (ULPS = 8, in the tensor's dtype)

per tensor (O, lse, dQ, dK, dV), after the NaN / inf positions are checked to be equal.
Prints one line per (case, version, tensor) with the difference in ulps, then a summary.
Writes sim_vs_gpu.json into --out.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

ULPS = 8
# Small on purpose: a simulated thread costs 115-160 us to launch and each barrier round
# 5-40 ms per block (TESTING.md), so the simulator's time grows with threads x work. Most
# seqlens span two or three of the 8 x 8 tiles of forward v4 and backward v3.
CASES = [  # (B, H, Sq, Sk, d, causal, dtype)
    (1, 2, 11, 19, 16, None, "float32"),
    (1, 1, 19, 11, 8, "bottom_right", "float32"),     # rows 0..7 see no key
    (2, 1, 17, 17, 5, "top_left", "float32"),
    (1, 1, 1, 20, 3, None, "float32"),
    (1, 2, 13, 17, 8, "bottom_right", "float64"),
    (1, 1, 9, 15, 8, None, "float16"),
]


def compute(inputs_path, out_path):
    """Run every case on whatever backend this process has; save all results."""
    import numbaflash
    from numbaflash.kernels.backward import VERSIONS as BWD
    from numbaflash.kernels.forward import VERSIONS as FWD

    data = np.load(inputs_path)
    backend = numbaflash.backend()
    if backend == "simulator":
        # The simulator runs one Python thread per CUDA thread; handing the GIL over more
        # often made a small forward 5x faster (TESTING.md).
        sys.setswitchinterval(2e-4)
    results = {"backend": np.array(backend)}
    for i, (B, H, Sq, Sk, d, causal, dtype) in enumerate(CASES):
        q, k, v, dout = (data[f"{i}_{name}"] for name in ("q", "k", "v", "dout"))
        for version in FWD:
            try:
                out, lse = numbaflash.attention(q, k, v, causal=causal, return_lse=True,
                                                version=version)
            except ValueError as e:        # e.g. v3 is GPU-only: the library says why
                print(f"case {i} forward {version}: not run ({e})", flush=True)
                continue
            results[f"{i}_fwd_{version}_O"], results[f"{i}_fwd_{version}_lse"] = out, lse
        out, lse = numbaflash.attention(q, k, v, causal=causal, return_lse=True)
        for version in BWD:
            try:
                grads = numbaflash.attention_backward(dout, q, k, v, out, lse, causal=causal,
                                                      version=version)
            except ValueError as e:        # e.g. backward v2 refuses float16
                print(f"case {i} backward {version}: not run ({e})", flush=True)
                continue
            for name, g in zip(("dQ", "dK", "dV"), grads):
                results[f"{i}_bwd_{version}_{name}"] = g
    np.savez(out_path, **results)


def make_inputs(path):
    """Random inputs for every case (uniform in [-2, 2], seed 0), saved to ``path`` (.npz)."""
    rng = np.random.default_rng(0)
    arrays = {}
    for i, (B, H, Sq, Sk, d, causal, dtype) in enumerate(CASES):
        for name, S in (("q", Sq), ("k", Sk), ("v", Sk), ("dout", Sq)):
            arrays[f"{i}_{name}"] = rng.uniform(-2, 2, (B, H, S, d)).astype(dtype)
    np.savez(path, **arrays)


def ulps(gpu, sim):
    """max |gpu - sim| in units of spacing(max |sim|), after checking non-finite positions."""
    for test in (np.isnan, np.isposinf, np.isneginf):
        if not np.array_equal(test(gpu), test(sim)):
            return float("inf")
    finite = np.isfinite(sim)
    if not finite.any():
        return 0.0
    diff = np.abs(gpu[finite].astype(np.float64) - sim[finite].astype(np.float64)).max()
    spacing = float(np.spacing(np.abs(sim[finite]).max().astype(sim.dtype)))
    return float(diff / spacing) if spacing > 0 else (0.0 if diff == 0 else float("inf"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--inputs", metavar="PATH", help="only write the inputs to PATH (.npz) "
                    "and exit (for timing the simulator's half, see above)")
    ap.add_argument("--_compute", nargs=2, help=argparse.SUPPRESS)   # the child process
    args = ap.parse_args()
    if args.inputs:
        make_inputs(args.inputs)
        return 0
    if args._compute:
        compute(*args._compute)
        return 0
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        print("run this on a GPU machine, without NUMBA_ENABLE_CUDASIM=1", file=sys.stderr)
        return 2

    tmp = tempfile.mkdtemp()
    inputs = os.path.join(tmp, "inputs.npz")
    make_inputs(inputs)

    gpu_path, sim_path = os.path.join(tmp, "gpu.npz"), os.path.join(tmp, "sim.npz")
    compute(inputs, gpu_path)
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    subprocess.run([sys.executable, __file__, "--_compute", inputs, sim_path], env=env,
                   check=True)
    gpu, sim = np.load(gpu_path), np.load(sim_path)
    assert str(gpu["backend"]) == "gpu" and str(sim["backend"]) == "simulator", \
        (str(gpu["backend"]), str(sim["backend"]))

    rows, worst = [], 0.0
    for key in sorted(k for k in sim.files if k != "backend"):
        if key not in gpu.files:
            continue
        u = ulps(gpu[key], sim[key])
        i = int(key.split("_")[0])
        rows.append(dict(case=list(map(str, CASES[i])), tensor=key, ulps=u, ok=u <= ULPS))
        worst = max(worst, u)
        print(f"{str(CASES[i]):48s} {key:18s} {u:8.2f} ulps  {'ok' if u <= ULPS else 'FAIL'}",
              flush=True)
    only_gpu = sorted(set(gpu.files) - set(sim.files) - {"backend"})
    ok = all(r["ok"] for r in rows) and bool(rows)
    print(f"{len(rows)} tensors compared (GPU-only, not compared: "
          f"{sorted({k.split('_', 1)[1].rsplit('_', 1)[0] for k in only_gpu}) or 'none'}); "
          f"worst {worst:.2f} ulps; bound {ULPS} ulps: {'OK' if ok else 'FAILED'}")
    with open(os.path.join(args.out, "sim_vs_gpu.json"), "w") as f:
        json.dump(dict(ulps_bound=ULPS, rows=rows, ok=ok), f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
