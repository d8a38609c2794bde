# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 08 · Decoding: one query row against a long KV cache
#
# A model that generates text produces one token at a time. At each step the new token
# has one query row per head, and it attends to the keys and values of every token before
# it. Those do not change from one step to the next, so the model keeps them, per
# sequence, in a **KV cache** and only appends the new token's key and value.
#
# That makes decoding the opposite of the shapes notebooks 03 to 06 were about: $S_q = 1$
# and $S_k$ in the tens of thousands. This notebook shows
#
# 1. what `numbaflash.attention_with_kvcache` computes, on tiny NumPy arrays;
# 2. why the forward kernels are the wrong shape for it: too few blocks, and a call whose
#    cost is reading the cache once;
# 3. the fix, split-KV: cut the keys into ranges, attend to each range separately, and
#    merge the ranges by their logsumexp, in NumPy step by step;
# 4. the decode kernels (`numbaflash/kernels/decode/`) on the simulator, against the
#    float64 reference, with 1, 2 and 3 splits and with grouped-query attention;
# 5. what the H200 measured, from the lab record.
#
# It runs on the simulator (tiny shapes) or a GPU.

# %%
import inspect
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np

import numbaflash
from numbaflash import policy, reference
from numbaflash.kernels import decode
from numbaflash.kernels.decode import combine, split_kv

BACKEND = numbaflash.backend()          # "gpu", or "simulator" under NUMBA_ENABLE_CUDASIM=1
SIM = BACKEND == "simulator"
if SIM:
    sys.setswitchinterval(2e-4)          # cheaper barriers in the simulator (see notebook 04)
    B, Hk, S_max, d = 2, 2, 40, 8        # every kernel call below stays this small
else:
    B, Hk, S_max, d = 2, 8, 8192, 128
print(f"backend: {BACKEND}; caches (B, Hk, S_max, d) = {(B, Hk, S_max, d)}")
rng = np.random.default_rng(0)

ROOT = Path(numbaflash.__file__).resolve().parent.parent
# The H200 measurements of the decode kernels (scripts/decode_gpu.py); sections 2 and 5.
LAB_RECORD = ROOT / "lab" / "runs" / "2026-12-06" / "120_decode_bandwidth.txt"


def spec(shape, dtype):
    """Something with a shape and a dtype: all that the explain functions read."""
    return SimpleNamespace(shape=tuple(shape), dtype=np.dtype(dtype))


def lab_lines(prefix):
    """The lines of the lab record that start with ``prefix``."""
    if not LAB_RECORD.exists():
        raise FileNotFoundError(f"{LAB_RECORD.relative_to(ROOT)} is missing: it is what "
                                f"python scripts/decode_gpu.py prints on an H200")
    return [line for line in LAB_RECORD.read_text().splitlines() if line.startswith(prefix)]


def reference_per_batch(q, k_cache, v_cache, lengths, dtype=np.float64, **kw):
    """(O, L) of the reference, batch by batch over each batch's first lengths[b] keys:
    what attention_with_kvcache computes (causal bottom-right within that length)."""
    parts = [reference.forward(q[b:b + 1], k_cache[b:b + 1, :, :n], v_cache[b:b + 1, :, :n],
                               dtype=dtype, **kw) for b, n in enumerate(lengths)]
    return (np.concatenate([o for o, _ in parts]), np.concatenate([l for _, l in parts]))


# The check of notebooks 04, 05 and 07 (TESTING.md's rule): the error against the float64
# truth at most twice a naive float32 computation's, + 2 ulps of float32.
# float16 inputs get the naive float16 computation as the baseline instead.
def check(name, out, lse, q, k_cache, v_cache, lengths, **kw):
    want, want_lse = reference_per_batch(q, k_cache, v_cache, lengths, **kw)
    low = np.float16 if q.dtype == np.float16 else np.float32
    base, base_lse = reference_per_batch(q, k_cache, v_cache, lengths, low, **kw)
    for what, got, w, b in (("out", out, want, base), ("lse", lse, want_lse, base_lse)):
        seen = np.isfinite(w)                    # rows that see no key: lse = -inf exactly
        assert np.array_equal(np.isfinite(got), seen), f"{name}: {what}'s -inf rows differ"
        err = np.abs(got[seen] - w[seen]).max(initial=0)
        base_err = np.abs(b[seen] - w[seen]).max(initial=0)
        bound = 2 * base_err + 2 * np.spacing(np.float32(np.abs(w[seen]).max(initial=0)))
        print(f"{name}: {what} max |error| {err:.1e} (bound {bound:.1e})")
        assert err <= bound, f"{name}: {what} error {err:.2e} exceeds the bound {bound:.2e}"


# %% [markdown]
# ## 1. The call: append, then attend
#
# `attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=..., k=..., v=...)` follows
# flash-attention's `flash_attn_with_kvcache`:
#
# * `k_cache`, `v_cache` are (batch, $H_k$, $S_{max}$, d): room for $S_{max}$ keys per
#   sequence, of which batch $b$ has filled the first `cache_seqlens[b]`;
# * `k`, `v` (optional) are the new keys and values, (batch, $H_k$, $S_{new}$, d). The call
#   **writes them into the caches in place**, at rows `cache_seqlens[b]` to
#   `cache_seqlens[b] + S_new - 1`, and then batch $b$ attends to its first
#   $n_b$ = `cache_seqlens[b]` + $S_{new}$ keys. `cache_seqlens` itself is not changed:
#   the caller keeps the lengths;
# * `q` is (batch, $H_q$, $S_q$, d): $S_q = 1$ for one decoding step, a few rows for
#   speculative decoding or a chunk of a prompt;
# * `causal=True` is aligned **bottom-right** within each batch's $n_b$ keys: query row $i$
#   sees keys $j \le i + n_b - S_q$, so the last new row sees every key and the first one
#   sees all but the $S_q - 1$ newer ones. (`causal="top_left"` has no meaning here and is
#   refused.)
#
# Two sequences of different lengths, two new tokens each ($S_q = S_{new} = 2$), on tiny
# arrays:

# %%
lengths = np.array([3, 6])                   # keys already cached, per sequence
Sq = S_new = 2
k_cache = np.zeros((2, 1, 10, 4), np.float32)
v_cache = np.zeros((2, 1, 10, 4), np.float32)
for b, n in enumerate(lengths):              # fill what is "already cached"
    k_cache[b, :, :n] = rng.standard_normal((1, n, 4))
    v_cache[b, :, :n] = rng.standard_normal((1, n, 4))
q1 = rng.standard_normal((2, 1, Sq, 4)).astype(np.float32)
k1 = rng.standard_normal((2, 1, S_new, 4)).astype(np.float32)
v1 = rng.standard_normal((2, 1, S_new, 4)).astype(np.float32)
before = k_cache.copy()

out1, lse1 = numbaflash.attention_with_kvcache(q1, k_cache, v_cache, cache_seqlens=lengths,
                                               k=k1, v=v1, causal=True, return_lse=True)

n_b = lengths + S_new
for b in range(2):
    at = slice(lengths[b], n_b[b])
    assert np.array_equal(k_cache[b, :, at], k1[b]) and np.array_equal(v_cache[b, :, at], v1[b]), \
        f"batch {b}: the new keys and values are not at rows {at.start}..{at.stop - 1}"
    assert np.array_equal(k_cache[b, :, :lengths[b]], before[b, :, :lengths[b]]), \
        f"batch {b}: the keys already cached changed"
    assert not k_cache[b, :, n_b[b]:].any(), f"batch {b}: rows past n_b were written"
    print(f"batch {b}: new rows written at {lengths[b]}..{n_b[b] - 1}; it sees n_b = {n_b[b]} "
          f"keys; visible keys per query row (causal, bottom-right):")
    for i in range(Sq):
        print("   row", i, "".join("x" if j <= i + n_b[b] - Sq else "." for j in range(10)))
print("cache_seqlens after the call:", lengths, "(unchanged: the caller adds S_new)")
check("two sequences, S_q = 2, causal", out1, lse1, q1, k_cache, v_cache, n_b, causal=True)

# %% [markdown]
# The check compares each batch with the dense reference on that batch's first $n_b$ rows
# of the (now updated) caches: the whole contract in one line. The columns printed as `.`
# past $n_b$ are rows of the cache that this call never reads.
#
# ## 2. Why one query row starves the GPU
#
# Take a realistic decode step: batch 8, 32 heads, one new row each, a cache of 32768
# keys, d = 128, float16. What would the forward kernels of notebooks 04 and 06 do with
# it? `explain` plans a call from shapes alone, and `backend="gpu"` shows a GPU's plan
# on any machine.

# %%
DEC = (8, 32, 1, 32768, 128)                       # (B, H, S_q, S_k, d)
Bd, Hd, Sqd, Skd, dd = DEC
q_spec = spec((Bd, Hd, Sqd, dd), np.float16)
kv_spec = spec((Bd, Hd, Skd, dd), np.float16)
fwd = numbaflash.explain(q_spec, kv_spec, kv_spec, backend="gpu")
print(fwd)
blocks = int(np.prod(fwd.grid))
SMS = policy.sm_count("gpu")                       # this GPU's SMs; the H200's without one
Tc = -(-Skd // fwd.Bc)
print(f"\nforward: {blocks} blocks (one per Q tile and batch x head) for {SMS} SMs, "
      f"{blocks / SMS:.1f} per SM; each block walks all {Skd} keys, Tc = {Tc} K/V tiles one "
      f"after another, for {Sqd} query row of its {fwd.Br} (the other {fwd.Br - Sqd} are padding)")

# %% [markdown]
# So the grid has about two blocks per SM, and each block does one long serial loop.
# A GPU reads memory fast only when many independent loads are in flight at once, from
# many warps on every SM; a couple of blocks per SM, each waiting for its next tile before
# it can ask for the one after, cannot keep enough requests in flight. And almost all of
# each block's tile of query rows is padding.
#
# What *should* a decode step cost? Each cached key and value is read once, and each is
# used in one multiply-add per query row of its head: in float16 the call does about one
# FLOP per byte read, far left of the ridge of notebook 06's roofline. It is
# **memory-bound**: the best it can do is read the cache at the speed of HBM. The
# fastest the H200 moves bytes, measured as a device-to-device copy, is the `HBM copy`
# line of the lab record (section 5 prints it); at that speed:

# %%
kv_bytes = 2 * Bd * Hd * Skd * dd * np.dtype(np.float16).itemsize      # K and V, once
flops = 4 * Bd * Hd * Sqd * Skd * dd                                     # q.k and p v
copy_line, = lab_lines("HBM copy")
copy_bytes_per_s = float(re.search(r"([0-9.]+) GB/s", copy_line).group(1)) * 1e9
print(f"K and V read per call: {kv_bytes / 2**30:.1f} GiB; FLOPs {flops / 1e9:.1f} G: "
      f"{flops / kv_bytes:.1f} FLOP per byte")
print(f"at the HBM copy bandwidth of the lab record: {kv_bytes / copy_bytes_per_s * 1e3:.2f} "
      f"ms per call: about the least a kernel that reads the cache once can take")

# %% [markdown]
# The decode plan for the same step: `explain_kvcache` takes the same shape-only inputs
# (here with the new token's k and v, one row each, appended at position 32767) and says
# how many splits the planner picks, and why.

# %%
new_spec = spec((Bd, Hd, 1, dd), np.float16)
plans = numbaflash.explain_kvcache(q_spec, kv_spec, kv_spec, cache_seqlens=Skd - 1,
                                   k=new_spec, v=new_spec, backend="gpu")
print(plans)
n_splits = plans[0].grid[0]
print(f"\nsplit-KV: {int(np.prod(plans[0].grid))} blocks ({n_splits} splits x "
      f"{int(np.prod(plans[0].grid[1:]))}), about {np.prod(plans[0].grid) / SMS:.1f} per SM; "
      f"each walks {-(-Skd // n_splits)} keys")
print("\nthe rule:", inspect.getdoc(policy.default_num_splits), sep="\n")

# %% [markdown]
# Inside a block the keys are spread again: four warps take turns over the split's keys,
# and within a warp each lane holds d/32 columns of every key and value (in runs of
# neighbours, 8 bytes a load where the caches' alignment allows), so a warp reads a cached
# row in one coalesced piece. A step's scores are then summed across the warp's lanes
# together, not one key at a time (`split_kv.py`'s docstring has the details).
#
# ## 3. Split-KV in NumPy: the logsumexp merge
#
# Attention of one row over all its keys can be assembled from attention over disjoint
# ranges of them. For a split $s$ with keys $\mathcal{K}_s$, let
#
# $$
# L_s = \log \sum_{j \in \mathcal{K}_s} e^{x_j}, \qquad
# O_s = \sum_{j \in \mathcal{K}_s} \frac{e^{x_j}}{e^{L_s}}\, v_j
# $$
#
# (the split's own softmax, normalised within the split, and its logsumexp, exactly what
# the forward returns for those keys alone). Then for the whole row
#
# $$
# L = \log \sum_s e^{L_s}, \qquad O = \sum_s e^{L_s - L}\, O_s ,
# $$
#
# because $e^{L_s - L} O_s = \sum_{j \in \mathcal{K}_s} e^{x_j - L} v_j$, and the splits'
# sums add up to the whole. Computed as written, $e^{L_s}$ overflows; with
# $M = \max_s L_s$ subtracted first, every weight $e^{L_s - M}$ is in $(0, 1]$.
#
# This is notebook 02's online softmax one level up. There, a new block of entries with
# a larger max rescaled the running sum by $\alpha = e^{m - m_{new}}$ before adding the
# block's terms. Here each split arrives already summed, as $(O_s, L_s)$, and the merge
# rescales each one by $e^{L_s - M}$: the same correction, applied once per split instead
# of once per tile.
#
# The splits first: `reference.split_ranges` cuts $S_k$ keys into ranges as even as the
# division allows (the first $S_k \bmod n$ get one key more).

# %%
Sk = 20
ranges = reference.split_ranges(Sk, 3)
print(f"split_ranges({Sk}, 3) = {ranges}")
print(f"split_ranges(4, 6) = {reference.split_ranges(4, 6)}  (more splits than keys: some empty)")

qr = rng.standard_normal((1, 1, 1, 8))               # one query row, float64
kr = 3 * rng.standard_normal((1, 1, Sk, 8))          # scores spread wide enough that the max matters
vr = rng.standard_normal((1, 1, Sk, 8))

parts = [reference.forward(qr, kr[..., a:b, :], vr[..., a:b, :]) for a, b in ranges]
for (a, b), (O_s, L_s) in zip(ranges, parts):
    print(f"keys {a:2d}..{b - 1:2d}: L_s = {L_s.item():7.3f}, O_s[:3] = {O_s.ravel()[:3].round(3)}")

# %% [markdown]
# The merge by hand, then `reference.combine_splits` (the NumPy sibling, line for line, of
# the combine kernel), then the whole row at once:

# %%
L_s = np.array([L.item() for _, L in parts])
M = L_s.max()
w = np.exp(L_s - M)                                   # each split's weight, in (0, 1]
L = M + np.log(w.sum())
O = sum(w_s / w.sum() * O_s for w_s, (O_s, _) in zip(w, parts))
print(f"M = {M:.3f}; weights e^(L_s - M) = {w.round(4)}; e^(L_s - L) = {(w / w.sum()).round(4)} "
      f"(sum {(w / w.sum()).sum():.12f})")

O_c, L_c = reference.combine_splits([o for o, _ in parts], [l for _, l in parts])
O_ref, L_ref = reference.forward(qr, kr, vr)
for name, (o, l) in {"by hand": (O, L), "combine_splits": (O_c, L_c)}.items():
    print(f"{name:15s}: max |O - forward| = {np.abs(o - O_ref).max():.1e}, "
          f"|L - forward| = {np.abs(l - L_ref).max():.1e}")
    assert np.allclose(o, O_ref, rtol=0, atol=1e-12) and np.allclose(l, L_ref, rtol=0, atol=1e-12), \
        f"{name}: the merged splits differ from the whole row"

# %% [markdown]
# A split that sees no key (an empty range, or one a mask hides entirely) has
# $L_s = -\infty$: its weight is $e^{-\infty} = 0$ and it changes nothing, which is how
# the kernel treats the splits a short sequence leaves empty. `reference.forward_splits`
# does all of the above for a whole problem, with masks kept in their place in the full
# sequence (a causal mask is not re-aligned to each split):

# %%
O_e, L_e = reference.combine_splits([*[o for o, _ in parts], np.zeros_like(O_ref)],
                                    [*[l for _, l in parts], np.full_like(L_ref, -np.inf)])
assert np.array_equal(O_e, O_c) and np.array_equal(L_e, L_c), "an empty split changed the result"
print("an extra empty split (L_s = -inf): the result is unchanged, bit for bit")

qc = rng.standard_normal((1, 2, 3, 8))                # 3 query rows, causal, bottom-right
kc, vc = rng.standard_normal((2, 1, 2, Sk, 8))
for n in (1, 3, 7, 25):
    O_n, L_n, _ = reference.forward_splits(qc, kc, vc, n, causal=True)
    O_f, L_f = reference.forward(qc, kc, vc, causal=True)
    print(f"forward_splits, {n:2d} splits: max |O - forward| = {np.abs(O_n - O_f).max():.1e}")
    assert np.abs(O_n - O_f).max() < 1e-12 and np.abs(L_n - L_f).max() < 1e-12

# %% [markdown]
# ### The same merge inside the kernel
#
# The decode kernel applies this merge twice. Inside a block, each of its four warps runs
# the online softmax over its own share of the split's keys and ends with its own
# $(m, \ell, o)$ per query row; the block merges the four through shared memory with the
# same weights, $e^{m_w - m}$ (`merge_warps`, in `split_kv.py`). Then, with more than one
# split, the combine kernel merges the splits' $(O_s, L_s)$:

# %%
source = inspect.getsource(split_kv.make_split_kv)
start = source.index("    @cuda.jit(device=True, inline=True)\n    def merge_warps")
print(source[start:source.index("    @cuda.jit(**jit_options(", start)])
print(inspect.getsource(combine.make_combine))

# %% [markdown]
# One thread per output element, each reading its row's $L_s$ and its column of $O_s$ split
# after split: the plain form. The one that runs by default, `combine_batched.py`, does
# the same arithmetic in the same order but starts the loads of 16 splits before it uses
# them, since a thread that waits for each load in turn makes one trip to memory per
# split (`docs/performance.md`, "Batch 1 with GQA", has what that cost).
#
# Each split's key range comes from the same rule as `reference.split_ranges`, computed in
# the kernel from its split index (`first` and `last` in `split_kv`). The arithmetic, for
# every span and split count up to 40:

# %%
for span in range(41):
    for n in range(1, 41):
        kernel_ranges = [(s * (span // n) + min(s, span % n),
                          s * (span // n) + min(s, span % n) + span // n + (s < span % n))
                         for s in range(n)]
        assert kernel_ranges == reference.split_ranges(span, n), (span, n)
print("the kernel's first/last arithmetic = reference.split_ranges, for spans 0..40 and 1..40 splits")

# %% [markdown]
# ## 4. The decode kernels on the simulator
#
# `numbaflash/kernels/decode/` holds three kernels; the package's docstring lists them:

# %%
print(decode.__doc__)

# %% [markdown]
# The kernel itself (`make_split_kv` in `split_kv.py`) is a factory like the forward
# kernels: print it with `inspect.getsource(split_kv.make_split_kv)`. Its top lines, the
# launch contract:

# %%
print(inspect.getdoc(split_kv.make_split_kv))

# %% [markdown]
# On the simulator the planner picks one split (there is no GPU to fill), so the cells
# below force 1, 2 and 3 with `num_splits=` and check each against the float64 reference,
# batch by batch. The two sequences have different lengths, so their splits cover
# different ranges. Each call writes the same new rows again (at the same `lengths`), so
# the caches are the same for all three.

# %%
lengths = np.array([9, S_max - 5])
Hq = Hk                                              # one query head per K/V head first
k_cache = np.zeros((B, Hk, S_max, d), np.float32)
v_cache = np.zeros((B, Hk, S_max, d), np.float32)
for b, n in enumerate(lengths):
    k_cache[b, :, :n] = rng.standard_normal((Hk, n, d))
    v_cache[b, :, :n] = rng.standard_normal((Hk, n, d))
q = rng.standard_normal((B, Hq, 1, d)).astype(np.float32)
k = rng.standard_normal((B, Hk, 1, d)).astype(np.float32)
v = rng.standard_normal((B, Hk, 1, d)).astype(np.float32)

print(numbaflash.explain_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, k=k, v=v))
results = {}
for n in (1, 2, 3):
    results[n] = numbaflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths,
                                                   k=k, v=v, num_splits=n, return_lse=True)
    check(f"{n} split(s)", *results[n], q, k_cache, v_cache, lengths + 1)
for n in (2, 3):
    print(f"{n} splits against 1: max |out difference| = "
          f"{np.abs(results[n][0] - results[1][0]).max():.1e} (float32 sums in another order)")

# %% [markdown]
# The splits agree with each other up to float32 rounding, not bit for bit: the same sums
# in another order.
#
# ### Grouped-query attention
#
# With GQA, $H_q / H_k$ query heads (a *group*) read the same K/V head. Giving each query
# head its own block would read each cached key once per head of the group, and decoding
# is all about bytes read. So a block of the decode kernel holds **several query rows**,
# those of one (batch, K/V head), and uses each key it loads for all of them. How many
# is a compile-time constant, `split_kv.MAX_ROWS`, set by what the registers hold (the
# file says why, and cites the measurement):

# %%
print(f"split_kv.MAX_ROWS = {split_kv.MAX_ROWS}")
for group in (2, 4):
    p = numbaflash.explain_kvcache(spec((B, Hk * group, 1, d), np.float32), k_cache, v_cache,
                                   cache_seqlens=lengths)[0]
    print(f"group of {group}: grid {p.grid} (splits, row tiles, batch x K/V heads); "
          f"{split_kv.rows_per_block(group, d)} query rows per block, so each key is read by "
          f"{p.grid[1]} block(s) per split")

# %% [markdown]
# While the group fits in one block (group x $S_q$ <= `MAX_ROWS`), one block per (split,
# batch, K/V head) holds all its query rows and each key is read once for the group; a
# larger group is cut into row tiles, each of which reads the keys again. The kernel on a
# group of two:

# %%
qg = rng.standard_normal((B, 2 * Hk, 1, d)).astype(np.float32)     # 2 query heads per K/V head
num_splits = 2 if SIM else None
out_g, lse_g = numbaflash.attention_with_kvcache(qg, k_cache, v_cache, cache_seqlens=lengths,
                                                 k=k, v=v, num_splits=num_splits,
                                                 return_lse=True)
check(f"GQA, group of 2, {num_splits or 'default'} split(s)", out_g, lse_g, qg, k_cache,
      v_cache, lengths + 1)

# %% [markdown]
# ### The group on the tensor cores
#
# Everything above ran `split_kv.py`, which puts the head dimension across a warp's lanes:
# each score is a sum over 32 lanes (shuffles), and each (query row, key) pair takes its
# own online-softmax step on the CUDA cores. With a group of four query heads that is
# four times the work per key for the same bytes, and it is what kept the float16 GQA
# shapes far below SDPA (lab/runs/2026-12-05/104_decode_gpu.txt).
#
# For float16 and bfloat16 caches with several query rows per K/V head (GQA, or more
# than one new token), the plan picks `split_kv_mma.py` instead. It sees the
# group's query rows of one K/V head as a small matrix Q (group x $S_q$ rows, zero-padded
# to 16) and each tile of 64 keys as $K_j$, so a tile's scores are one matrix product
# $Q K_j^T$: a job for the tensor cores' 16 x 8 x 16 products, exactly as in forward v10
# (notebook 10), with each of the block's four warps taking 16 of the tile's keys. The
# tiles are copied into shared memory asynchronously, two stages deep, the next one on its
# way while the warps use this one. The softmax, the split and the merge are the same as
# above. With a single row per K/V head (multi-head attention, one new token) the
# tensor cores have nothing to share and `split_kv` stays: on the H200 it was the faster
# of the two there (the measurement is cited in `split_kv_mma.refusal`).
#
# A GQA group of four decoding one token fills only 4 of those 16 rows. Transposing both
# products puts the keys (and, for $P V$, the head dims) on the 16 rows and the group on
# the 8 columns: $S^T = K_j Q^T$, $O^T \mathrel{+}= V_j^T \tilde P^T$. That is
# `split_kv_mma_t.py`, the plan's choice for up to 8 rows per K/V head: half the
# products per key, and each lane keeps 32 floats of $O^T$ instead of 64. It also lays a
# tile's rows out differently in shared memory. Padding each row by 16 bytes (forward
# v10's way to keep `ldmatrix` free of bank conflicts) starts most rows partway into a
# 128-byte line, so the 128 contiguous bytes that 8 threads copy land across two lines and
# the copy is fetched in pieces: L2 served about 1.5 sectors for each one the kernel
# needed. Instead, each row is a whole number of lines and its 16-byte piece $q$ is stored
# at piece $q \oplus (r \bmod 8)$ of row $r$ (a swizzle): a copy fills one line, and the 8
# rows that one `ldmatrix` matrix reads still fall in 8 different groups of banks.
# `policy.decode_kernel` says which kernel a call gets:

# %%
print(inspect.getdoc(policy.decode_kernel))
q16 = rng.standard_normal((B, 4 * Hk, 1, d)).astype(np.float16)    # a group of 4, float16
k16, v16 = (x.astype(np.float16) for x in (k_cache, v_cache))
plan16 = numbaflash.explain_kvcache(q16, k16, v16, cache_seqlens=lengths + 1)[0]
print(f"\nfloat16, group of 4: {plan16.kernel}, grid {plan16.grid}: one block per (split, "
      f"batch x K/V head) holds the group's 4 query rows")
out16, lse16 = numbaflash.attention_with_kvcache(q16, k16, v16, cache_seqlens=lengths + 1,
                                                 num_splits=num_splits, return_lse=True)
check("float16, group of 4, tensor cores", out16, lse16, q16, k16, v16, lengths + 1)

# %% [markdown]
# (The check's baseline here is the naive computation in float16, the input type.) The
# kernel's own docstring says how it treats NaN and inf: a product with $P = 0$ would turn
# a NaN in a key a row does not see into a NaN in that row, so non-finite values are
# zeroed in shared memory and added back, for the rows that see them, by a slow path that
# only flagged tiles take.
#
# A sequence with nothing cached and no new key sees nothing: its rows come back with
# $O = 0$ and $L = -\infty$, the reference's convention for a row that sees no key (the
# other sequence is unaffected).

# %%
out_0, lse_0 = numbaflash.attention_with_kvcache(qg, k_cache, v_cache,
                                                 cache_seqlens=np.array([0, lengths[1]]),
                                                 num_splits=num_splits, return_lse=True)
print("batch 0 (no keys): out all zero:", not out_0[0].any(), "; lse:", lse_0[0].ravel())
assert not out_0[0].any() and np.all(lse_0[0] == -np.inf)
check("one empty sequence", out_0, lse_0, qg, k_cache, v_cache, [0, lengths[1]])

# %% [markdown]
# ## 5. Measured on the H200
#
# `scripts/decode_gpu.py` checks the decode kernels against the float64 reference on a GPU
# and times them at four decode shapes (batch 8 with a 32768-key cache and batch 1 with
# 131072 keys, each with 32 query heads and 32 or 8 K/V heads, d = 128), next to
# PyTorch's SDPA. Its latest record on the H200 (float16 and bfloat16) is the lab file
# named in the first cell. The `HBM copy` line is the ceiling: the bandwidth of a plain
# device-to-device copy. Each `bandwidth` line gives, for one shape and dtype, the bytes of
# K and V read per call divided by the time, for numbaflash (with the kernel that ran and
# its number of splits) and for the faster of SDPA's default and its fused backend, and the
# two ratios: of SDPA, and of the HBM copy. That record was made while `split_kv_mma` took
# every 16-bit call, the multi-head ones too; the `decoders` lines of the file beside it
# time both kernels at each shape, which is why the multi-head calls now run `split_kv`.

# %%
print(f"{LAB_RECORD.relative_to(ROOT)}:")
for line in lab_lines("HBM copy") + lab_lines("bandwidth"):
    print(line)
DECODERS = LAB_RECORD.with_name("120_decode_decoders.txt")
print(f"\n{DECODERS.relative_to(ROOT)}:")
for line in DECODERS.read_text().splitlines():
    if line.startswith("decoders"):
        print(line)

SERVING = ROOT / "lab" / "runs" / "2026-12-07" / "141_decode_serving.txt"   # the H200
print(f"\n{SERVING.relative_to(ROOT)}:")
for line in SERVING.read_text().splitlines():
    if line.startswith("serving"):
        print(line)

# %% [markdown]
# What to look for:
#
# * **Against the HBM copy.** A decode call is memory-bound, so "of HBM copy" is the
#   fraction of the memory system's speed it reaches. (The copy reads and writes; a
#   kernel that only reads can go a little faster, so a ratio can pass 1.)
# * **GQA against multi-head.** With 8 K/V heads for 32 query heads the cache holds four
#   times fewer bytes for the same query rows: four times the arithmetic per byte read,
#   which `split_kv_mma` does on the tensor cores with each key read once for the group.
#   Compare each GQA line's fraction of the HBM copy with its multi-head twin's.
# * **Against SDPA.** In float16, SDPA runs FlashAttention's own CUDA kernels, and the
#   ratio says how far numbaflash's Numba kernels are from them. In float32 (the float32 `serving`
#   lines) SDPA has no flash kernel and the ratio goes the other way.
#
# * **A call is more than its kernel.** The `bandwidth` and `decoders` lines time each
#   call alone from Python, on the day the host still copied the lengths and checked,
#   planned and wrapped every call; at these sizes most of a 16-bit call was that Python.
#   The `serving` lines (a later record, after the host's work was cut) time the same steps as a PyTorch user runs them through
#   `numbaflash.torch.flash_attn_with_kvcache`, three ways: a call alone, calls queued back
#   to back, and a step replayed from a CUDA graph. The last two leave the host out, and
#   compare the kernels with SDPA's (`docs/performance.md`, "Decoding", says what each
#   way shows).
#
# The numbers live in the lab record only; `docs/kvcache.md` cites it, and
# `explain_kvcache` says how many splits a call gets and why.
