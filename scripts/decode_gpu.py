"""Decoding against a KV cache on a GPU: agreement, split counts, and bandwidth against
SDPA and the HBM copy limit.

    python scripts/decode_gpu.py [--parts agreement,decoders,splits,rows,registers,kernels,
                                          layout,bandwidth,overhead,serving]
                                 [--repeats 20] [--dtypes float16,float32] [--shapes NAME,...]
                                 [--decode-kernels split_kv_mma_t,split_kv_mma,split_kv]
                                 [--loads wide|scalar] [--reduction transposed|allreduce]

``--decode-kernels`` sets policy.DECODE_KERNELS (the order in which the decode kernels are
tried: split_kv_mma_t and split_kv_mma, the tensor-core kernels, take 16-bit caches with
aligned rows, split_kv_mma_t up to 8 rows per K/V head, and split_kv every cache) before
any plan is made; without it, the policy's own order; ``--decode-kernels split_kv`` runs
every part on the CUDA-core kernel.

``--loads`` and ``--reduction`` set split_kv.LOADS and split_kv.REDUCTION before any plan
is made, so every part runs that build of the split-KV kernel (the defaults: wide and
transposed; ``--loads scalar --reduction allreduce`` is the kernel before those two
changes, kernels/decode/split_kv.py's docstring).

1. agreement: ``attention_with_kvcache`` (new keys appended on the GPU, per-batch
   lengths, causal or not, GQA, window, softcap, ALiBi, split counts 1 and default and
   forced, and caches one column into wider arrays, which the plan must read one
   element a load) against ``numbaflash.reference.forward`` in float64 on each batch's
   slice of the caches, by the bench's rule (``bench._agreement``).
1b. decoders: the default call's time with each decode kernel alone (split_kv_mma_t,
   split_kv_mma with FINITE_TESTS "edges" and "every", split_kv; policy.DECODE_KERNELS), each with the
   planner's split count, at each shape and dtype in one process, and each one's out
   against the first's.
2. splits: the time of one decode call for num_splits in 1, 2, 4, ..., 64 and the
   planner's choice, at each shape (the evidence behind policy.default_num_splits).
3. rows (GQA shapes): the default split count's time with a block holding at most 1, 2,
   4 or 8 of the group's query rows (split_kv.MAX_ROWS, set before the plans are made):
   more rows read each key once for more heads, and cost registers.
4. registers (the multi-head shapes): the default call with the split kernel's registers
   capped (split_kv.MAX_REGISTERS: 64, 80) against ptxas's own choice; fewer registers
   let more blocks share an SM.
5. kernels: each change to the split-KV kernel alone, at each shape and dtype, in one
   process: the default call's time with split_kv.LOADS x REDUCTION in (scalar, wide) x
   (allreduce, transposed), scalar + allreduce being the kernel before both; each
   build's out against that one's (max |difference|) and the loads its plan chose.
5b. overhead: where a call's time goes, each decode kernel alone at each shape and dtype:
   the call as the other parts time it (CUDA events around each call), the host's time
   per call (``time.perf_counter`` over ``--repeats`` calls issued back to back, no sync
   between them), and the GPU's time per call for those calls queued back to back (events
   around all of them: the kernels' time when the host keeps ahead of the GPU). Under
   ``ncu --metrics gpu__time_duration.sum`` the kernels' own durations come with it.
6. layout: numbaflash.torch.flash_attn_with_kvcache on caches in flash-attn's (batch,
   S_max, heads, d) order (read in place through strides) against attention_with_kvcache
   on the same values in (batch, heads, S_max, d) order: bitwise the same out, and the
   time ratio; one new key appended on the GPU first in both.
7. bandwidth: numbaflash's default against SDPA (FLASH for float16, EFFICIENT for
   float32; ``enable_gqa`` for GQA) and the HBM copy bandwidth (a device-to-device copy
   of 4 GiB, bytes read + written / time). Bandwidth = K and V bytes read / time.
8. serving (asked for by name): a decoding step as a PyTorch user runs it,
   numbaflash.torch.flash_attn_with_kvcache (the caches' (batch, S_max, heads, d) views
   of the same memory SDPA reads, cache_seqlens a tensor) against SDPA as a user calls it
   (its own backend choice), three ways each: a call timed alone (as the other parts
   time), calls queued back to back (events around ``--repeats`` calls: the GPU's time
   when the host keeps ahead), and one call captured in a CUDA graph and replayed
   ``--repeats`` times (events around the replays: the kernels with no host between
   them). The ratios are SDPA's time over numbaflash's, each way.

Shapes (batch, Hq, Hk, Sq, S_max, d): the decode shapes of the targets in docs/kvcache.md
(and two at d = 64, by name).
Timing: ``numbaflash.bench.time_ms`` (CUDA events on the default stream, PyTorch's current
stream here, where numbaflash launches), median of ``--repeats`` after 3 warm-ups, one
process. Every line is printed as it comes (flush).
"""

import argparse
import sys
import warnings

import numpy as np

import numbaflash
from numbaflash import bench, reference

SHAPES = {  # name: (B, Hq, Hk, Sq, S_max, d)
    "b8-mha": (8, 32, 32, 1, 32768, 128),
    "b8-gqa": (8, 32, 8, 1, 32768, 128),
    "b1-mha": (1, 32, 32, 1, 131072, 128),
    "b1-gqa": (1, 32, 8, 1, 131072, 128),
    # asked for by name only (--shapes): at d = 64 a float16 wide load's 128 columns
    # leave half the lanes without a column
    "b8-mha-d64": (8, 32, 32, 1, 32768, 64),
    "b8-gqa-d64": (8, 32, 8, 1, 32768, 64),
}
TARGETS = ["b8-mha", "b8-gqa", "b1-mha", "b1-gqa"]      # the default --shapes


def _forget_repeats():
    """A decode kernel's module switch changed: forget what repeated calls recorded.
    numbaflash/decode_direct.py keys a kind of call by its arrays and options, not by
    these lab switches, so without this a repeated call would launch the kernel an
    earlier setting compiled."""
    from numbaflash import decode_direct
    decode_direct.forget()


def agreement():
    import torch
    rng = np.random.default_rng(11)
    cases = [  # (B, Hq, Hk, Sq, S_max, S_new, d, dtype, options, splits)
        (3, 8, 8, 1, 5000, 1, 128, np.float16, {}, None),
        (3, 8, 2, 1, 5000, 1, 128, np.float32, {}, None),
        (2, 8, 2, 4, 3000, 4, 64, np.float16, dict(causal=True), 5),
        (2, 4, 4, 3, 4096, 3, 128, np.float32, dict(causal=True, window_size=(700, 0)), None),
        (2, 4, 1, 2, 2000, 2, 96, np.float32, dict(softcap=20.0), 3),
        (2, 4, 2, 1, 2500, 1, 128, np.float16, dict(alibi_slopes=True), None),
        (1, 16, 4, 8, 9000, 8, 128, np.float32, dict(causal=True), 1),
        # the caches one column into (..., d + 4) arrays: 2 or 4 bytes past an 8-byte
        # boundary, so the plan must choose loads of one element (a wide load would fault)
        (2, 8, 2, 1, 3000, 1, 128, np.float16, dict(offset=1), None),
        (2, 8, 8, 2, 2000, 2, 64, np.float32, dict(offset=1, causal=True), 3),
        # bfloat16 caches, GQA 4 with Sq = 4 (16 rows a K/V head), causal, a window
        (2, 8, 2, 4, 3000, 4, 128, "bfloat16", dict(causal=True, window_size=(900, 0)), None),
        (3, 32, 4, 1, 6000, 1, 64, "bfloat16", dict(softcap=30.0), None),
    ]
    bad = 0
    for B, Hq, Hk, Sq, S_max, S_new, d, dtype, options, splits in cases:
        options = dict(options)
        offset = options.pop("offset", 0)
        if options.get("alibi_slopes"):
            options["alibi_slopes"] = rng.uniform(0.01, 0.2, Hq).astype(np.float32)
        if dtype == "bfloat16":     # NumPy's through ml_dtypes, torch's from float32
            import ml_dtypes
            dtype = ml_dtypes.bfloat16
        q = rng.standard_normal((B, Hq, Sq, d)).astype(dtype)
        kc, vc = (rng.standard_normal((B, Hk, S_max, d)).astype(dtype) for _ in range(2))
        k, v = (rng.standard_normal((B, Hk, S_new, d)).astype(dtype) for _ in range(2))
        lens = rng.integers(0, S_max - S_new + 1, B).astype(np.int32)
        tq, tkc, tvc, tk, tv = (_to_torch(x) for x in (q, kc, vc, k, v))
        if offset:
            tkc, tvc = (_inside_wider(x, offset) for x in (tkc, tvc))
        nq, nkc, nvc, nk, nv = (_numba(x) for x in (tq, tkc, tvc, tk, tv))
        plans = numbaflash.explain_kvcache(nq, nkc, nvc, cache_seqlens=lens, k=nk, v=nv,
                                           num_splits=splits, **options)
        out, lse = numbaflash.attention_with_kvcache(
            nq, nkc, nvc, cache_seqlens=lens, k=nk, v=nv, num_splits=splits,
            return_lse=True, **options)
        out = out.copy_to_host()
        lse = lse.copy_to_host()
        kc_after, vc_after = (_to_numpy(x, dtype) for x in (tkc, tvc))
        worst, ok = 0.0, True
        for b in range(B):
            n = lens[b] + S_new
            at = slice(lens[b], n)
            ok &= np.array_equal(kc_after[b, :, at], k[b]) and np.array_equal(vc_after[b, :, at], v[b])
            kw = dict(options)
            if "alibi_slopes" in kw:
                kw["alibi_slopes"] = kw["alibi_slopes"].astype(np.float64)
            f64 = [x.astype(np.float64) for x in (q[b], kc_after[b, :, :n], vc_after[b, :, :n])]
            want, want_lse = reference.forward(*f64, kw.pop("causal", False), **kw)
            low = [x.astype(dtype) for x in f64]
            base, _ = reference.forward(*low, options.get("causal", False), dtype=dtype, **kw)
            c = bench._agreement(out[b].astype(np.float64), want, base, dtype, bench.MULT["out"],
                                 None)
            ok &= c["ok"]
            worst = max(worst, c["max_err"] / c["bound"])
            seen = np.isfinite(want_lse)
            ok &= np.array_equal(seen, np.isfinite(lse[b]))
            ok &= np.allclose(lse[b][seen], want_lse[seen], rtol=1e-5, atol=1e-5)
        bad += not ok
        opts = {k: ("..." if k == "alibi_slopes" else val) for k, val in options.items()}
        if offset:
            opts["caches at column"] = offset
        print(f"{'OK  ' if ok else 'FAIL'} agreement {(B, Hq, Hk, Sq, S_max, d)} S_new={S_new} "
              f"{np.dtype(dtype).name} {opts} {plans[0].kernel}, splits={plans[0].grid[0]} "
              f"{_loads(plans[0])}: "
              f"max err/bound {worst:.3f}", flush=True)
    return bad


def _to_torch(x):
    """A NumPy array on the GPU as a torch tensor (bfloat16 through float32, exactly)."""
    import torch
    if x.dtype.name == "bfloat16":
        return torch.from_numpy(x.astype(np.float32)).cuda().to(torch.bfloat16)
    return torch.from_numpy(x).cuda()


def _to_numpy(x, dtype):
    """A torch tensor (any strides) as a NumPy array of ``dtype`` (bfloat16 through
    float32, exactly)."""
    import torch
    if x.dtype == torch.bfloat16:
        return x.float().contiguous().cpu().numpy().astype(dtype)
    return x.contiguous().cpu().numpy()


def _numba(x):
    """A torch tensor as numbaflash takes it: itself, or for bfloat16 (which PyTorch does
    not export) a Numba view of its bits as ml_dtypes' bfloat16, no copy."""
    import torch
    if x.dtype != torch.bfloat16:
        return x
    import ml_dtypes
    from numba import cuda
    return cuda.as_cuda_array(x.view(torch.int16)).view(ml_dtypes.bfloat16)


def _as_torch(out):
    """numbaflash's device output as a float32 torch tensor (a bfloat16 one through its
    bits)."""
    import torch
    if str(out.dtype) == "bfloat16":
        bits = torch.as_tensor(out.view(np.int16), device="cuda")
        return bits.view(torch.bfloat16).float()
    return torch.as_tensor(out, device="cuda").float()


def _inside_wider(x, offset):
    """The tensor x (..., d) copied into a (..., d + 4) tensor at columns offset .. offset +
    d - 1, returned as that view (rows d + 4 apart, the first element offset columns in)."""
    import torch
    wide = torch.zeros(x.shape[:-1] + (x.shape[-1] + 4,), dtype=x.dtype, device=x.device)
    wide[..., offset:offset + x.shape[-1]] = x
    return wide[..., offset:offset + x.shape[-1]]


def _loads(plan):
    """The loads the split-KV plan chose, as its reason says (split_kv.load_width);
    split_kv_mma and split_kv_mma_t copy 16 bytes at a time, always."""
    if plan.kernel in ("split_kv_mma", "split_kv_mma_t"):
        return "16-byte cp.async copies"
    reason = plan.reason
    at = reason.find("with loads of ")
    return reason[at + len("with "):reason.find(";", at)] if at >= 0 else "loads: ?"


def _ms(fn, repeats):
    """Median ms of fn() (``bench.time_ms``: CUDA events on the default stream, where
    PyTorch's default current stream launches too), after 3 warm-up calls."""
    return bench.time_ms(fn, repeats=repeats, warmup=3)


def _inputs(shape, dtype):
    import torch
    B, Hq, Hk, Sq, S_max, d = shape
    g = torch.Generator(device="cuda").manual_seed(0)
    tdt = getattr(torch, dtype)
    q = torch.randn((B, Hq, Sq, d), generator=g, device="cuda", dtype=tdt)
    kc = torch.randn((B, Hk, S_max, d), generator=g, device="cuda", dtype=tdt)
    vc = torch.randn((B, Hk, S_max, d), generator=g, device="cuda", dtype=tdt)
    return q, kc, vc


def _kv_bytes(shape, dtype):
    B, Hq, Hk, Sq, S_max, d = shape
    return 2 * B * Hk * S_max * d * np.dtype(dtype).itemsize


def decoders(shapes, dtypes, repeats):
    """Each decode kernel alone (module docstring, part 1b)."""
    import torch
    from numbaflash import policy
    from numbaflash.kernels.decode import split_kv_mma
    keep, keep_tests = policy.DECODE_KERNELS, split_kv_mma.FINITE_TESTS
    for name in shapes:
        shape = SHAPES[name]
        S_max = shape[4]
        for dtype in dtypes:
            q, kc, vc = _inputs(shape, dtype)
            n_bytes = _kv_bytes(shape, dtype)
            row = []
            first = None
            q, kc, vc = (_numba(x) for x in (q, kc, vc))
            for kernel, tests in (("split_kv_mma_t", "edges"), ("split_kv_mma", "edges"),
                                  ("split_kv_mma", "every"), ("split_kv", None)):
                policy.DECODE_KERNELS = (kernel,)
                split_kv_mma.FINITE_TESTS = tests or keep_tests
                _forget_repeats()
                try:
                    plan = numbaflash.explain_kvcache(q, kc, vc, cache_seqlens=S_max)[0]
                except ValueError as error:
                    row.append(f"{kernel}: refused ({error})")
                    continue
                kernel = kernel + (f" ({tests} tiles tested)" if tests else "")
                call = lambda: numbaflash.attention_with_kvcache(q, kc, vc, cache_seqlens=S_max)
                out = _as_torch(call())
                first = out if first is None else first
                diff = (out - first).abs().max().item()
                ms = _ms(call, repeats)
                row.append(f"{kernel} ({plan.grid[0]} splits): {ms:.3f} ms "
                           f"{n_bytes / ms / 1e6:.0f} GB/s, max |out - first| {diff:.1e}")
            policy.DECODE_KERNELS = keep
            split_kv_mma.FINITE_TESTS = keep_tests
            _forget_repeats()
            print(f"decoders {name} {shape} {dtype}: " + "; ".join(row), flush=True)
            del q, kc, vc
            torch.cuda.empty_cache()


def overhead(shapes, dtypes, repeats):
    """Where a call's time goes (module docstring, part 5b)."""
    import time
    import torch
    from numba import cuda
    from numbaflash import policy
    keep = policy.DECODE_KERNELS
    for name in shapes:
        shape = SHAPES[name]
        S_max = shape[4]
        for dtype in dtypes:
            q, kc, vc = (_numba(x) for x in _inputs(shape, dtype))
            row = []
            for kernel in ("split_kv_mma", "split_kv"):
                policy.DECODE_KERNELS = (kernel,)
                _forget_repeats()
                try:
                    plan = numbaflash.explain_kvcache(q, kc, vc, cache_seqlens=S_max)[0]
                except ValueError:
                    continue
                call = lambda: numbaflash.attention_with_kvcache(q, kc, vc, cache_seqlens=S_max)
                each = _ms(call, repeats)
                cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(repeats):
                    call()
                host = (time.perf_counter() - t0) / repeats * 1e3
                cuda.synchronize()
                start, end = cuda.event(), cuda.event()
                start.record()
                for _ in range(repeats):
                    call()
                end.record()
                end.synchronize()
                queued = cuda.event_elapsed_time(start, end) / repeats
                row.append(f"{kernel} ({plan.grid[0]} splits): {each:.3f} ms a call timed "
                           f"alone, host {host:.3f} ms a call, {queued:.3f} ms a call queued")
            policy.DECODE_KERNELS = keep
            _forget_repeats()
            print(f"overhead {name} {shape} {dtype}: " + "; ".join(row), flush=True)
            del q, kc, vc
            torch.cuda.empty_cache()


def splits(shapes, dtypes, repeats):
    for name in shapes:
        shape = SHAPES[name]
        for dtype in dtypes:
            q, kc, vc = _inputs(shape, dtype)
            n_bytes = _kv_bytes(shape, dtype)
            chosen = numbaflash.explain_kvcache(q, kc, vc, cache_seqlens=shape[4])[0].grid[0]
            row = []
            for n in (1, 2, 4, 8, 16, 32, 64):
                ms = _ms(lambda: numbaflash.attention_with_kvcache(
                    q, kc, vc, cache_seqlens=shape[4], num_splits=n), repeats)
                row.append(f"{n}:{ms:.3f}ms/{n_bytes / ms / 1e6:.0f}GB/s")
            print(f"splits {name} {shape} {dtype} (default {chosen}): " + " ".join(row),
                  flush=True)
            del q, kc, vc


def rows(shapes, dtypes, repeats):
    from numbaflash.kernels.decode import split_kv
    keep = split_kv.MAX_ROWS
    for name in shapes:
        shape = SHAPES[name]
        if shape[1] == shape[2]:
            continue
        for dtype in dtypes:
            q, kc, vc = _inputs(shape, dtype)
            n_bytes = _kv_bytes(shape, dtype)
            row = []
            for most in (1, 2, 4, 8):
                split_kv.MAX_ROWS = most
                _forget_repeats()
                n = numbaflash.explain_kvcache(q, kc, vc, cache_seqlens=shape[4])[0].grid[0]
                ms = _ms(lambda: numbaflash.attention_with_kvcache(
                    q, kc, vc, cache_seqlens=shape[4]), repeats)
                row.append(f"rows<={most} ({n} splits):{ms:.3f}ms/{n_bytes / ms / 1e6:.0f}GB/s")
            split_kv.MAX_ROWS = keep
            _forget_repeats()
            print(f"rows {name} {shape} {dtype}: " + " ".join(row), flush=True)
            del q, kc, vc


def registers(shapes, dtypes, repeats):
    from numbaflash.kernels.decode import split_kv
    keep = split_kv.MAX_REGISTERS
    for name in shapes:
        shape = SHAPES[name]
        if shape[1] != shape[2]:
            continue
        for dtype in dtypes:
            q, kc, vc = _inputs(shape, dtype)
            n_bytes = _kv_bytes(shape, dtype)
            row = []
            for cap in (None, 80, 64):
                split_kv.MAX_REGISTERS = cap
                split_kv.make_split_kv.cache_clear()
                _forget_repeats()
                ms = _ms(lambda: numbaflash.attention_with_kvcache(
                    q, kc, vc, cache_seqlens=shape[4]), repeats)
                row.append(f"cap {cap}:{ms:.3f}ms/{n_bytes / ms / 1e6:.0f}GB/s")
            split_kv.MAX_REGISTERS = keep
            split_kv.make_split_kv.cache_clear()
            _forget_repeats()
            print(f"registers {name} {shape} {dtype}: " + " ".join(row), flush=True)
            del q, kc, vc


def kernels(shapes, dtypes, repeats):
    """Each change to the split-KV kernel alone (module docstring, part 5)."""
    import torch
    from numbaflash.kernels.decode import split_kv
    keep = split_kv.LOADS, split_kv.REDUCTION
    builds = [("scalar", "allreduce"), ("wide", "allreduce"), ("scalar", "transposed"),
              ("wide", "transposed")]
    for name in shapes:
        shape = SHAPES[name]
        S_max = shape[4]
        for dtype in dtypes:
            q, kc, vc = _inputs(shape, dtype)
            n_bytes = _kv_bytes(shape, dtype)
            row = []
            parent = None
            for loads, reduction in builds:
                split_kv.LOADS, split_kv.REDUCTION = loads, reduction
                _forget_repeats()
                plan = numbaflash.explain_kvcache(q, kc, vc, cache_seqlens=S_max)[0]
                call = lambda: numbaflash.attention_with_kvcache(q, kc, vc, cache_seqlens=S_max)
                out = torch.as_tensor(call(), device="cuda").float()
                parent = out if parent is None else parent
                diff = (out - parent).abs().max().item()
                ms = _ms(call, repeats)
                row.append(f"{loads}+{reduction} ({_loads(plan)}): {ms:.3f} ms "
                           f"{n_bytes / ms / 1e6:.0f} GB/s, max |out - first| {diff:.1e}")
            split_kv.LOADS, split_kv.REDUCTION = keep
            _forget_repeats()
            print(f"kernels {name} {shape} {dtype}: " + "; ".join(row), flush=True)
            del q, kc, vc
            torch.cuda.empty_cache()


def layout(shapes, dtypes, repeats):
    import torch
    import numbaflash.torch as nft
    for name in shapes:
        shape = SHAPES[name]
        B, Hq, Hk, Sq, S_max, d = shape
        for dtype in dtypes:
            q, kc, vc = _inputs(shape, dtype)
            k, v = (torch.randn((B, Hk, 1, d), device="cuda", dtype=q.dtype) for _ in range(2))
            lens = torch.full((B,), S_max - 1, dtype=torch.int32, device="cuda")
            kc2, vc2 = (x.transpose(1, 2).contiguous() for x in (kc, vc))    # (B, S, H, d)
            ours = lambda: numbaflash.attention_with_kvcache(q, kc, vc, cache_seqlens=lens,
                                                              k=k, v=v)
            flash = lambda: nft.flash_attn_with_kvcache(
                q.transpose(1, 2), kc2, vc2, k=k.transpose(1, 2), v=v.transpose(1, 2),
                cache_seqlens=lens)
            a = torch.as_tensor(ours(), device="cuda")
            b = flash().transpose(1, 2)
            same = torch.equal(a, b) and torch.equal(kc2.transpose(1, 2), kc)
            t_ours, t_flash = _ms(ours, repeats), _ms(flash, repeats)
            print(f"layout {name} {shape} {dtype}: (b, h, s, d) {t_ours:.3f} ms, flash-attn's "
                  f"(b, s, h, d) {t_flash:.3f} ms, ratio {t_flash / t_ours:.3f}; out and "
                  f"caches bitwise equal: {same}", flush=True)
            del q, kc, vc, kc2, vc2
            torch.cuda.empty_cache()


def copy_bandwidth(repeats):
    import torch
    x = torch.empty(2**30, dtype=torch.float32, device="cuda")      # 4 GiB
    y = torch.empty_like(x)
    ms = _ms(lambda: y.copy_(x), repeats)
    gbs = 2 * x.numel() * 4 / ms / 1e6
    print(f"HBM copy: 4 GiB device-to-device, {ms:.3f} ms, {gbs:.0f} GB/s (read + written)",
          flush=True)
    del x, y
    return gbs


def bandwidth(shapes, dtypes, repeats):
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F
    hbm = copy_bandwidth(repeats)
    for name in shapes:
        shape = SHAPES[name]
        B, Hq, Hk, Sq, S_max, d = shape
        for dtype in dtypes:
            q, kc, vc = _inputs(shape, dtype)
            n_bytes = _kv_bytes(shape, dtype)
            nq, nkc, nvc = (_numba(x) for x in (q, kc, vc))
            plans = numbaflash.explain_kvcache(nq, nkc, nvc, cache_seqlens=S_max)
            ours = _ms(lambda: numbaflash.attention_with_kvcache(
                nq, nkc, nvc, cache_seqlens=S_max), repeats)
            # SDPA as a user calls it (its own choice of backend), and the fused backend
            # for the dtype where it takes the call (FLASH for float16, EFFICIENT for
            # float32; with GQA they may not: then only the default is timed)
            gqa = Hk != Hq
            sdpa = lambda: F.scaled_dot_product_attention(q, kc, vc, enable_gqa=gqa)
            default_ms = _ms(sdpa, repeats)
            backend = SDPBackend.FLASH_ATTENTION if dtype != "float32" else \
                SDPBackend.EFFICIENT_ATTENTION
            try:
                with sdpa_kernel(backend):
                    fused_ms = _ms(sdpa, repeats)
            except RuntimeError:
                fused_ms = float("nan")
            theirs = min(default_ms, fused_ms) if fused_ms == fused_ms else default_ms
            how = (f"default {default_ms:.3f} ms, {backend.name} "
                   + (f"{fused_ms:.3f} ms" if fused_ms == fused_ms else "refuses the call"))
            out = _as_torch(numbaflash.attention_with_kvcache(nq, nkc, nvc,
                                                              cache_seqlens=S_max))
            want = sdpa()
            diff = (out.float() - want.float()).abs().max().item()
            ours_gbs, theirs_gbs = n_bytes / ours / 1e6, n_bytes / theirs / 1e6
            print(f"bandwidth {name} {shape} {dtype}: numbaflash {ours:.3f} ms {ours_gbs:.0f} "
                  f"GB/s ({plans[0].kernel}, {plans[0].grid[0]} splits); SDPA ({how}) best "
                  f"{theirs:.3f} ms "
                  f"{theirs_gbs:.0f} GB/s; ratio {ours_gbs / theirs_gbs:.3f} of SDPA, "
                  f"{ours_gbs / hbm:.3f} of HBM copy; max |ours - SDPA| {diff:.2e}",
                  flush=True)
            del q, kc, vc, out, want
            torch.cuda.empty_cache()


def _three_ways(fn, repeats):
    """(alone, queued, graph) ms per call of ``fn`` on PyTorch's current stream (part 8)."""
    import torch
    alone = _ms(fn, repeats)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    queued = start.elapsed_time(end) / repeats
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                   # the warm-up PyTorch asks for
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    end.synchronize()
    return alone, queued, start.elapsed_time(end) / repeats


def serving(shapes, dtypes, repeats):
    """A decoding step as a PyTorch user runs it (module docstring, part 8)."""
    import torch
    import torch.nn.functional as F
    import numbaflash.torch as nft
    for name in shapes:
        shape = SHAPES[name]
        B, Hq, Hk, Sq, S_max, d = shape
        for dtype in dtypes:
            q, kc, vc = _inputs(shape, dtype)
            n_bytes = _kv_bytes(shape, dtype)
            lengths = torch.full((B,), S_max, dtype=torch.int32, device="cuda")
            flash = [x.transpose(1, 2) for x in (q, kc, vc)]    # (batch, seqlen, heads, d)
            ours = lambda: nft.flash_attn_with_kvcache(*flash, cache_seqlens=lengths)
            theirs = lambda: F.scaled_dot_product_attention(q, kc, vc, enable_gqa=Hk != Hq)
            plan = numbaflash.explain_kvcache(*(_numba(x) for x in (q, kc, vc)),
                                              cache_seqlens=S_max)[0]
            diff = (ours().transpose(1, 2).float() - theirs().float()).abs().max().item()
            row = []
            for who, fn in (("numbaflash.torch", ours), ("SDPA", theirs)):
                times = _three_ways(fn, repeats)
                row.append((who, times))
            (_, a), (_, b) = row
            print(f"serving {name} {shape} {dtype} ({plan.kernel}, {plan.grid[0]} splits): "
                  + "; ".join(f"{who} alone {t[0]:.3f}, queued {t[1]:.3f}, graph {t[2]:.3f} "
                              f"ms a call" for who, t in row)
                  + "; of SDPA's bandwidth: alone {:.3f}, queued {:.3f}, graph {:.3f}".format(
                      *(y / x for x, y in zip(a, b)))
                  + f"; graph {n_bytes / a[2] / 1e6:.0f} GB/s; max |ours - SDPA| {diff:.2e}",
                  flush=True)
            del q, kc, vc, flash
            torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts",
                    default="agreement,decoders,splits,rows,registers,kernels,layout,bandwidth")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--dtypes", default="float16,float32")
    ap.add_argument("--shapes", default=",".join(TARGETS),
                    help=f"from {', '.join(SHAPES)}")
    ap.add_argument("--decode-kernels", default=None,
                    help="policy.DECODE_KERNELS for every part, in order (default: "
                         "the policy's own)")
    ap.add_argument("--loads", choices=("wide", "scalar"), default="wide",
                    help="split_kv.LOADS for every part (scalar: one element a load)")
    ap.add_argument("--reduction", choices=("transposed", "allreduce"), default="transposed",
                    help="split_kv.REDUCTION for every part (allreduce: the parent's)")
    args = ap.parse_args()
    from numbaflash.kernels.decode import split_kv
    split_kv.LOADS, split_kv.REDUCTION = args.loads, args.reduction
    from numbaflash import policy
    if args.decode_kernels:
        policy.DECODE_KERNELS = tuple(args.decode_kernels.split(","))
    warnings.filterwarnings("ignore", message=".*(under-utilization|kernel not used|runtime "
                            "disabled|same num_heads).*")
    parts = args.parts.split(",")
    dtypes = args.dtypes.split(",")
    shapes = args.shapes.split(",")
    import torch
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, numbaflash "
          f"{numbaflash.__version__}; policy.DECODE_KERNELS = {policy.DECODE_KERNELS}; "
          f"split_kv.LOADS = {split_kv.LOADS!r}, REDUCTION = {split_kv.REDUCTION!r}",
          flush=True)
    bad = 0
    if "agreement" in parts:
        bad += agreement()
    if "decoders" in parts:
        decoders(shapes, dtypes, args.repeats)
    if "overhead" in parts:
        overhead(shapes, dtypes, args.repeats)
    if "splits" in parts:
        splits(shapes, dtypes, args.repeats)
    if "rows" in parts:
        rows(shapes, dtypes, args.repeats)
    if "registers" in parts:
        registers(shapes, dtypes, args.repeats)
    if "kernels" in parts:
        kernels(shapes, dtypes, args.repeats)
    if "layout" in parts:
        layout(shapes, dtypes, args.repeats)
    if "bandwidth" in parts:
        bandwidth(shapes, dtypes, args.repeats)
    if "serving" in parts:
        serving(shapes, dtypes, args.repeats)
    print(f"decode_gpu: {bad} agreement failure(s)", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
