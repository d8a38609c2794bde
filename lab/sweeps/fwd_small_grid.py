"""The default forward against smaller query tiles at short sequences, where the grid
has few blocks: does a smaller Br (more blocks) pay?

    python3 scripts/fwd_small_grid.py        # GPU, about a minute

For (1, 16, N, d), N = 1024, 2048, 4096, d = 64 and 128, causal no and yes: the default
plan, then tiles (64, Bc) and (32, Bc) with the default's Bc where the version takes
them (a refusal is printed with its reason). Each output is compared with the default's
(max |difference|; the same Bc gives the same bits), then timed with
numbaflash.bench.time_ms (CUDA events, median of 10 after one untimed call; the Python
call is included). Float32, standard normal inputs. Run 67 ran this as an inline script,
which stopped at d = 128 on v9's refusal of (32, 32).
"""
import numpy as np
from numba import cuda

import numbaflash
from numbaflash.bench import time_ms


def main():
    print("forward default tiles against smaller query tiles, (1, 16, N, d), float32; ms "
          "median of 10 (CUDA events, the Python call included)")
    for d in (64, 128):
        for n in (1024, 2048, 4096):
            for causal in (False, True):
                rng = np.random.default_rng(0)
                q, k, v = (cuda.to_device(rng.standard_normal((1, 16, n, d)).astype(np.float32))
                           for _ in range(3))
                plan = numbaflash.explain(q, k, v, causal=causal)
                ref = numbaflash.attention(q, k, v, causal=causal).copy_to_host()
                row = [f"default {plan.version} ({plan.Br}, {plan.Bc})"]
                for tiles in (None, (64, plan.Bc), (32, plan.Bc)):
                    try:
                        o = numbaflash.attention(q, k, v, causal=causal, tiles=tiles)
                    except ValueError as e:
                        row.append(f"{tiles}: not run ({e})")
                        continue
                    diff = np.abs(o.copy_to_host() - ref).max()
                    t = time_ms(lambda: numbaflash.attention(q, k, v, causal=causal,
                                                             tiles=tiles), 10, warmup=1)
                    row.append(f"{tiles}: {t:.3f} ms (max diff {diff:.1e})")
                print(f"d={d} N={n} causal={causal}:", "; ".join(row), flush=True)


if __name__ == "__main__":
    main()
