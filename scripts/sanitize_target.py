"""A small workload for compute-sanitizer: every kernel version on ragged shapes.

    compute-sanitizer --tool memcheck python scripts/sanitize_target.py
    compute-sanitizer --tool racecheck python scripts/sanitize_target.py --variants

``--backward V`` runs only backward version V (after forward v2); ``--forward V`` only
forward version V. ``--variants`` runs the kernels that support attention variants
instead (every version whose module says VARIANTS, and the tile-table kernel) with
windows, GQA, ALiBi, softcap, masks, a mask_mod and dropout, on ragged shapes, in float32
and float16 (a version that refuses a dtype says why and is not run); with ``--forward
V``, ``--backward V`` (after forward v2) or ``--dtype T`` it runs only those, so that one
process per kernel can run in parallel (lab/sweeps/variants_fast_path_gpu.sh), and with
``--cases TEXT`` only the cases whose name contains TEXT (e.g. ``--cases dropout``).

``--kvcache`` runs the decoding kernels instead (kernels/decode/: the cache update, split-KV
with one and several splits, and the combine): device caches with per-batch lengths that
end mid-step, new keys appended, GQA, causal, a window, softcap, ALiBi, d = 40 (two
head-dim columns per lane, the second ragged), a NaN key and an inf value, float32 and
float16 (float16 on the tensor-core kernel, split_kv_mma, float32 on split_kv).

``--varlen`` runs packed batches instead (numbaflash.attention_varlen and its backward):
every forward and backward version that takes variants, on sequences of ragged lengths
(an empty one, Sq != Sk, one past a tile), GQA, causal and a window, float32 and float16
(float64 for the versions that compute in it), and without GQA, causal or not, where the
versions that take packed batches of plain attention (forward v10, backward v9) run too;
a version that refuses says why. ``--forward V`` and ``--backward V`` (together or alone:
backward alone runs after the default forward) and ``--dtype T`` narrow it the same way.

``--forward V`` also runs forward V once on inputs with a NaN in q and k and an inf in v,
so that the paths that handle non-finite inputs (forward v6's fix-ups) are checked too.
``--dtype T`` runs every case in dtype T only (e.g. ``--forward v7 --dtype bfloat16``:
v7 takes float16 and bfloat16 inputs only). ``--forward v10`` (float16 and bfloat16, like
v7) also runs v10 on K and V that are not 16-byte aligned (views one element into larger
arrays), where it loads element by element instead of its 16-byte cp.async copies; the
cases at d = 3 do that too (rows not whole 16-byte pieces).

Shapes are small (the sanitizer slows kernels down 10-100x, and every process compiles
its kernels again) but cross tile boundaries with ragged tails, Sq != Sk in both
directions, both causal alignments, and fully masked rows, so every guard in the kernels
is exercised; float16 and float64 on one case. Prints one line per call.
"""

import sys

import numpy as np
from numba import cuda

import numbaflash
from numbaflash.kernels.backward import VERSIONS as BACKWARD_VERSIONS
from numbaflash.kernels.forward import VERSIONS as FORWARD_VERSIONS

CASES = [  # (B, H, Sq, Sk, d, causal, dtypes)
    (1, 2, 77, 130, 64, "bottom_right", ("float32",)),
    (1, 2, 130, 45, 64, "bottom_right", ("float32",)),   # rows 0..84 see no key
    (2, 1, 33, 1, 3, None, ("float32",)),
    (1, 1, 70, 61, 16, "top_left", ("float16", "float64")),
    (1, 1, 150, 97, 128, "bottom_right", ("float32",)),   # d > 64: Qi in shared memory
]


@cuda.jit(device=True)
def documents_of_19(b, h, q_idx, kv_idx):
    return q_idx // 19 == kv_idx // 19


def variant_cases(rng):
    """(name, (B, Hq, Hkv, Sq, Sk, d), options) for ``--variants``."""
    mask = rng.random((2, 1, 77, 130)) < 0.3
    return [
        ("window + GQA", (2, 4, 2, 77, 130, 64), dict(window_size=(20, 3), causal=True)),
        ("documents mask_mod + softcap", (1, 2, 2, 100, 100, 64),
         dict(mask_mod=documents_of_19, softcap=4.0)),
        ("bool attn_mask + ALiBi + MQA", (2, 2, 1, 77, 130, 32),
         dict(attn_mask=mask, alibi_slopes=np.array([0.1, 0.3], np.float32))),
        ("float bias", (1, 2, 2, 45, 70, 16),
         dict(attn_mask=rng.standard_normal((45, 70)).astype(np.float32))),
        ("dropout + causal + GQA", (2, 4, 2, 77, 130, 64),
         dict(causal=True, dropout_p=0.2, dropout_seed=11)),
        ("dropout + window + softcap", (1, 2, 2, 100, 100, 64),
         dict(window_size=(20, 3), softcap=4.0, dropout_p=0.3, dropout_seed=2**40 + 7)),
    ]


def main_variants():
    from numbaflash.kernels import backward, forward
    fwd_versions = [v for v in FORWARD_VERSIONS if forward.module(v).VARIANTS]
    bwd_versions = [v for v in BACKWARD_VERSIONS if backward.module(v).VARIANTS]
    if "--forward" in sys.argv[1:]:         # --forward V: only forward V (and no backward)
        fwd_versions, bwd_versions = [sys.argv[sys.argv.index("--forward") + 1]], []
    if "--backward" in sys.argv[1:]:        # --backward V: only backward V, after forward v2
        fwd_versions, bwd_versions = ["v2"], [sys.argv[sys.argv.index("--backward") + 1]]
    dtypes = (np.float32, np.float16)
    if "--dtype" in sys.argv[1:]:
        dtypes = (np.dtype(sys.argv[sys.argv.index("--dtype") + 1]).type,)
    only = None
    if "--cases" in sys.argv[1:]:           # --cases TEXT: the cases whose name contains it
        only = sys.argv[sys.argv.index("--cases") + 1]
    rng = np.random.default_rng(1)
    for name, (B, Hq, Hkv, Sq, Sk, d), opts in variant_cases(rng):
        if only is not None and only not in name:
            continue
        for dtype in dtypes:
            q = cuda.to_device(rng.standard_normal((B, Hq, Sq, d)).astype(dtype))
            k, v = (cuda.to_device(rng.standard_normal((B, Hkv, Sk, d)).astype(dtype))
                    for _ in range(2))
            dout = cuda.to_device(rng.standard_normal((B, Hq, Sq, d)).astype(dtype))
            kw = dict(opts)
            if "attn_mask" in kw and kw["attn_mask"].dtype != np.bool_:
                kw["attn_mask"] = kw["attn_mask"].astype(dtype)
            out = lse = None
            for version in fwd_versions:
                try:
                    o, l = numbaflash.attention(q, k, v, return_lse=True, version=version, **kw)
                except ValueError as e:         # e.g. v7 with float32: says why
                    print(f"forward {version} {name} {np.dtype(dtype).name}: not run ({e})")
                    continue
                cuda.synchronize()
                out, lse = (o, l) if out is None else (out, lse)
                print(f"forward {version} {name} {np.dtype(dtype).name}: ok", flush=True)
            for version in bwd_versions:
                try:
                    numbaflash.attention_backward(dout, q, k, v, out, lse, version=version,
                                                  **kw)
                except ValueError as e:
                    print(f"backward {version} {name} {np.dtype(dtype).name}: not run ({e})")
                    continue
                cuda.synchronize()
                print(f"backward {version} {name} {np.dtype(dtype).name}: ok", flush=True)


def nonfinite_forward(versions, rng, shape, causal, dtype=np.float32):
    """The forward versions on inputs with NaN in q and k and +inf in v."""
    B, H, Sq, Sk, d = shape
    q, k, v = (rng.standard_normal((B, H, S, d)).astype(dtype) for S in (Sq, Sk, Sk))
    q[0, 0, 3, 5] = np.nan
    k[0, 1, Sk // 2, 7] = np.nan
    v[0, 0, Sk - 9, 1] = np.inf
    q, k, v = (_to_device(x) for x in (q, k, v))
    for version in versions:
        numbaflash.attention(q, k, v, causal=causal, version=version)
        cuda.synchronize()
        print(f"forward {version} {shape} {causal} {np.dtype(dtype).name} with NaN and inf: ok",
              flush=True)


def _to_device(x):
    """A host array on the device; bfloat16 through its bits (Numba's copy reads the buffer
    protocol, which has no bfloat16)."""
    if x.dtype.name == "bfloat16":
        return cuda.to_device(x.view(np.uint16)).view(x.dtype)
    return cuda.to_device(x)


def misaligned_forward(version, rng, dtype):
    """Forward ``version`` (v10) with K and V one element past a 16-byte boundary: views
    into larger device arrays, so its copies go element by element."""
    B, H, Sq, Sk, d = 1, 2, 77, 130, 64
    q, k, v = (rng.standard_normal((B, H, S, d)).astype(dtype) for S in (Sq, Sk, Sk))

    def shifted(x):
        flat = np.zeros(x.size + 8, x.dtype)
        flat[1:x.size + 1] = x.reshape(-1)
        return _to_device(flat)[1:x.size + 1].reshape(x.shape)

    for causal in (None, "bottom_right"):
        numbaflash.attention(_to_device(q), shifted(k), shifted(v), causal=causal,
                             version=version)
        cuda.synchronize()
        print(f"forward {version} {(B, H, Sq, Sk, d)} {causal} {np.dtype(dtype).name}, K and V "
              f"not 16-byte aligned: ok", flush=True)


def main_kvcache():
    rng = np.random.default_rng(5)
    cases = [  # (B, Hq, Hk, Sq, S_max, S_new, d, options)
        (3, 4, 2, 1, 300, 1, 40, dict(causal=True)),
        (2, 4, 1, 3, 257, 3, 64, dict(causal=True, window_size=(50, 0), softcap=10.0)),
        (2, 2, 2, 2, 190, 0, 128, dict(alibi_slopes=np.array([0.1, 0.2], np.float32))),
        # a NaN key and an inf value inside the lengths: the fix-ups of split_kv_mma
        (2, 8, 2, 2, 200, 2, 64, dict(causal=True, nonfinite=True)),
    ]
    for B, Hq, Hk, Sq, S_max, S_new, d, options in cases:
        options = dict(options)
        nonfinite = options.pop("nonfinite", False)
        for dtype in (np.float32, np.float16):
            q = cuda.to_device(rng.standard_normal((B, Hq, Sq, d)).astype(dtype))
            kc, vc = (rng.standard_normal((B, Hk, S_max, d)).astype(dtype) for _ in range(2))
            if nonfinite:
                kc[0, 0, 5, 3] = np.nan
                vc[1, 1, 7, 2] = np.inf
            kc, vc = cuda.to_device(kc), cuda.to_device(vc)
            new = {}
            if S_new:
                new = {n: cuda.to_device(rng.standard_normal((B, Hk, S_new, d)).astype(dtype))
                       for n in ("k", "v")}
            lens = rng.integers(0, S_max - S_new + 1, B).astype(np.int32)
            lens[0] = 0 if not nonfinite else 150
            for splits in (1, 4, None):
                numbaflash.attention_with_kvcache(q, kc, vc, cache_seqlens=lens,
                                                  num_splits=splits, **new, **options)
                cuda.synchronize()
                print(f"kvcache {(B, Hq, Hk, Sq, S_max, S_new, d)} {sorted(options)} "
                      f"{np.dtype(dtype).name} splits={splits}: ok", flush=True)


def main_varlen():
    from numbaflash.kernels import backward, forward
    rng = np.random.default_rng(9)
    lq, lk = [70, 0, 129, 5], [64, 33, 200, 5]
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (lq, lk))
    fwd_versions, bwd_versions = forward.VERSIONS, backward.VERSIONS
    if "--forward" in sys.argv[1:]:         # --forward V: only forward V (and --backward's)
        fwd_versions = (sys.argv[sys.argv.index("--forward") + 1],)
        bwd_versions = ()
    if "--backward" in sys.argv[1:]:        # --backward V: only backward V (after the
        bwd_versions = (sys.argv[sys.argv.index("--backward") + 1],)     # default forward)
        if "--forward" not in sys.argv[1:]:
            fwd_versions = (None,)
    dtypes = (np.float32, np.float16, np.float64)
    if "--dtype" in sys.argv[1:]:
        dtypes = (np.dtype(sys.argv[sys.argv.index("--dtype") + 1]).type,)
    for dtype in dtypes:
        # GQA (4 query heads on 2 K/V heads) with causal and a window: the versions that
        # take variants; 4 K/V heads, causal or not: also forward v10 and backward v9,
        # which take packed batches of plain attention only (d = 48: 16-byte copies)
        for d, hk, options in ((64, 2, dict(causal=True)), (40, 2, dict(window_size=(20, 3))),
                               (64, 4, dict(causal=True)), (48, 4, {})):
            q = _to_device(rng.standard_normal((cu_q[-1], 4, d)).astype(dtype))
            k, v = (_to_device(rng.standard_normal((cu_k[-1], hk, d)).astype(dtype))
                    for _ in range(2))
            dout = _to_device(rng.standard_normal((cu_q[-1], 4, d)).astype(dtype))
            out = lse = None
            for version in fwd_versions:
                try:
                    out, lse = numbaflash.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True,
                                                           version=version, **options)
                except ValueError as e:
                    print(f"varlen forward {version} {np.dtype(dtype).name}: not run ({e})")
                    continue
                cuda.synchronize()
                print(f"varlen forward {version} d={d} {sorted(options)} "
                      f"{np.dtype(dtype).name}: ok", flush=True)
            for version in bwd_versions if out is not None else ():
                try:
                    numbaflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k,
                                                         version=version, **options)
                except ValueError as e:
                    print(f"varlen backward {version} {np.dtype(dtype).name}: not run ({e})")
                    continue
                cuda.synchronize()
                print(f"varlen backward {version} d={d} {sorted(options)} "
                      f"{np.dtype(dtype).name}: ok", flush=True)


def main():
    if "--kvcache" in sys.argv[1:]:
        return main_kvcache()
    if "--varlen" in sys.argv[1:]:
        return main_varlen()
    if "--variants" in sys.argv[1:]:
        return main_variants()
    forward_versions, backward_versions = FORWARD_VERSIONS, BACKWARD_VERSIONS
    if "--backward" in sys.argv[1:]:        # --backward V: only backward V (forward v2 feeds it)
        backward_versions = (sys.argv[sys.argv.index("--backward") + 1],)
        forward_versions = ("v2",)
    if "--forward" in sys.argv[1:]:         # --forward V: only forward V, no backward
        forward_versions = (sys.argv[sys.argv.index("--forward") + 1],)
        backward_versions = ()
    only = sys.argv[sys.argv.index("--dtype") + 1] if "--dtype" in sys.argv[1:] else None
    rng = np.random.default_rng(0)
    for B, H, Sq, Sk, d, causal, dtypes in CASES:
        for dtype in (np.dtype(t).type for t in ((only,) if only else dtypes)):
            q, k, v = (_to_device(rng.standard_normal((B, H, S, d)).astype(dtype))
                       for S in (Sq, Sk, Sk))
            for version in forward_versions:
                try:
                    out, lse = numbaflash.attention(q, k, v, causal=causal, return_lse=True,
                                                    version=version)
                except ValueError as e:     # e.g. v3 with float64: says why, runs nothing
                    print(f"forward {version} {np.dtype(dtype).name} d={d}: not run ({e})")
                    continue
                cuda.synchronize()
                print(f"forward {version} {(B, H, Sq, Sk, d)} {causal} {np.dtype(dtype).name}: ok",
                      flush=True)
            if "--forward" in sys.argv[1:] and dtype != np.float64 and d == 64:
                nonfinite_forward(forward_versions, rng, (B, H, Sq, Sk, d), causal, dtype)
            if ("--forward" in sys.argv[1:] and "v10" in forward_versions and d == 64
                    and np.dtype(dtype).name in ("float16", "bfloat16")):
                misaligned_forward("v10", rng, dtype)
            dout = _to_device(rng.standard_normal((B, H, Sq, d)).astype(dtype))
            for version in backward_versions:
                try:
                    numbaflash.attention_backward(dout, q, k, v, out, lse, causal=causal,
                                                  version=version)
                except ValueError as e:     # e.g. v2 (atomics) with float16: says why
                    print(f"backward {version} {np.dtype(dtype).name}: not run ({e})")
                    continue
                cuda.synchronize()
                print(f"backward {version} {(B, H, Sq, Sk, d)} {causal} "
                      f"{np.dtype(dtype).name}: ok", flush=True)


if __name__ == "__main__":
    main()
