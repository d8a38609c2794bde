"""The dynamic-shared-memory kernels against their static siblings, on a GPU, briefly.

    python scripts/dynamic_smem_timing.py          # on a GPU machine (about a minute)

At (2, 16, 4096, d), float32, causal and not: forward v4 against v5 and backward v3
against v4, with the tiles below (None: the version's default rule), median of 5
CUDA-event timings after one untimed call. Run it in two checkouts (PYTHONPATH picks the
package) to compare a kernel change. Each dynamic-shared-memory result is compared with its
static sibling's on the same inputs (max |a - b| / max |b|, per output; above 1e-4 is
marked WRONG). The static kernels are checked against float64 references by the test
suite and the bench. This is the quick check of kernels/smem.py's ``U`` (unsigned tile
indices); scripts/v5_sweep.py and scripts/bwd_v4_sweep.py are the full sweeps.
"""

import sys

import numpy as np
from numba import cuda

import numbaflash
from numbaflash.bench import time_ms

FORWARD = {64: [("v4", None), ("v5", None)], 128: [("v4", None), ("v5", None)]}
BACKWARD = {64: [("v3", None), ("v4", None)], 128: [("v3", None), ("v4", None)]}


def rel(a, b):
    a, b = a.copy_to_host(), b.copy_to_host()
    return float(np.abs(a - b).max() / np.abs(b).max())


def main():
    rng = np.random.default_rng(0)
    ok = True
    for d in (64, 128):
        shape = (2, 16, 4096, d)
        q, k, v, do = (cuda.to_device(rng.standard_normal(shape).astype(np.float32))
                       for _ in range(4))
        for causal in (False, True):
            out, lse = numbaflash.attention(q, k, v, causal=causal, return_lse=True)
            first = None
            for version, tiles in FORWARD[d]:
                def call():
                    return numbaflash.attention(q, k, v, causal=causal, version=version,
                                                tiles=tiles)
                o = call()
                first = o if first is None else first
                err = rel(o, first)
                ms = time_ms(call, repeats=5, warmup=1)
                ok &= err <= 1e-4
                print(f"d={d:3d} causal={causal!s:5s} forward  {version} "
                      f"tiles={tiles or 'default'!s:16s} {ms:8.2f} ms  "
                      f"vs first {err:.1e} {'ok' if err <= 1e-4 else 'WRONG'}", flush=True)
            first = None
            for version, tiles in BACKWARD[d]:
                def call():
                    return numbaflash.attention_backward(do, q, k, v, out, lse, causal=causal,
                                                         version=version, tiles=tiles)
                g = call()
                first = g if first is None else first
                err = max(rel(a, b) for a, b in zip(g, first))
                ms = time_ms(call, repeats=5, warmup=1)
                ok &= err <= 1e-4
                print(f"d={d:3d} causal={causal!s:5s} backward {version} "
                      f"tiles={tiles or 'default'!s:16s} {ms:8.2f} ms  "
                      f"vs first {err:.1e} {'ok' if err <= 1e-4 else 'WRONG'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
