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
# # 04 · The forward kernel
#
# Notebook 03 wrote FlashAttention-2's Algorithm 1 as NumPy loops over tiles. This notebook
# reads the same loop as a Numba CUDA kernel, `numbaflash/kernels/forward/v2_flash2.py`
# (one file per version; the package's docstring lists them), and runs it.
# Only the mapping of work onto threads is new: the outer loop over query tiles becomes
# the grid of thread blocks, the rows of a tile become the threads of a block, and the
# tiles $K_j$, $V_j$ are staged in shared memory.
#
# **No GPU?** Start Jupyter with `NUMBA_ENABLE_CUDASIM=1` in its environment and the
# kernels run in Numba's CUDA simulator: one Python thread per CUDA thread, with bounds
# checks, slowly. The sizes below adapt: tiny on the simulator, realistic on a GPU.

# %%
import inspect
import math
import sys
import time

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Rectangle
from numba import cuda

import numbaflash
from numbaflash import reference
from numbaflash.kernels import forward as fwd
from numbaflash.kernels.forward import v1_plain, v2_flash2
from numbaflash.kernels.plan import SHARED_MEM_LIMIT

BACKEND = numbaflash.backend()          # "gpu", or "simulator" under NUMBA_ENABLE_CUDASIM=1
SIM = BACKEND == "simulator"
if SIM:
    # Simulated threads are Python threads; switching between them sooner makes barriers
    # (cuda.syncthreads) much cheaper to simulate. A setting of this process only.
    sys.setswitchinterval(2e-4)
    B, H, Sq, Sk, d = 1, 2, 40, 48, 8
    TILES = (16, 16)                    # small tiles, so every loop crosses a few tile edges
else:
    B, H, Sq, Sk, d = 2, 8, 1024, 1024, 64
    TILES = None                        # v2's tile rule (kernels/forward/v2_flash2.py)
print(f"backend: {BACKEND}; q (B, H, Sq, d) = {(B, H, Sq, d)}, k and v (B, H, Sk, d) = "
      f"{(B, H, Sk, d)}, tiles = {TILES or 'default'}")

rng = np.random.default_rng(0)
q = rng.standard_normal((B, H, Sq, d)).astype(np.float32)
k = rng.standard_normal((B, H, Sk, d)).astype(np.float32)
v = rng.standard_normal((B, H, Sk, d)).astype(np.float32)

# %% [markdown]
# ## The version ladder
#
# The kernels live one version per file in `numbaflash/kernels/forward/`. The package's
# docstring draws the ladder by lineage, and each version's file starts by saying what it
# is, its parent, what it changes and what that buys:

# %%
print(fwd.__doc__)
for version in fwd.VERSIONS:
    print(f"{version}: {fwd.module(version).__name__}: {fwd.module(version).__doc__.splitlines()[0]}")

# %% [markdown]
# ## From loops to threads
#
# | `tiled.forward` (notebook 03) | `forward_v2` kernel |
# |---|---|
# | `for i in range(Tr)` (Alg.1 l.3) | one thread block per query tile: `i = cuda.blockIdx.x` |
# | one call per head | `bh = cuda.blockIdx.y`: the grid's second axis runs over batch $\times$ heads |
# | the rows of `Qi`, `o_i`, `m_i`, `l_i` | one thread per row: `r = cuda.threadIdx.x`, `row = i * Br + r` |
# | `for j in ...` (Alg.1 l.6) | a loop inside the kernel; every thread of the block runs it |
# | `Kj, Vj = K[cols], V[cols]` (l.7) | the block's threads copy the tiles into `cuda.shared.array`s together |
# | `o_i`, `m_i`, `l_i` (l.5) | per-thread `cuda.local.array` and scalars: registers |
#
# `numbaflash.explain` shows the plan that `attention` would launch for these inputs,
# without running anything: kernel, tiles, grid, block, shared memory, and why. Here we
# ask for v2 by name, the version this section reads.

# %%
plan = numbaflash.explain(q, k, v, version="v2", tiles=TILES)
print(plan)

# %%
def draw_grid(ax, BH, Sq, Br, max_rows=48):
    """Each head's query rows, coloured by the thread block that owns them."""
    Tr = -(-Sq // Br)
    colors = plt.cm.tab10.colors
    rows = min(Sq, max_rows)
    for bh in range(BH):
        x0 = bh * 3
        for i in range(-(-rows // Br)):
            n_active = min(Br, Sq - i * Br)
            ax.add_patch(Rectangle((x0, i * Br), 2, min(n_active, rows - i * Br),
                                   color=colors[i % 10], alpha=0.8))
            if n_active < Br and i * Br + Br <= rows + Br:
                ax.add_patch(Rectangle((x0, i * Br + n_active), 2, Br - n_active, fill=False,
                                       hatch="///", color="gray"))
            ax.text(x0 + 1, i * Br + min(Br, n_active) / 2, f"block\n({i}, {bh})",
                    ha="center", va="center", fontsize=8)
        ax.text(x0 + 1, -1, f"bh = {bh}", ha="center")
    ax.set_xlim(-0.5, BH * 3)
    ax.set_ylim(-(-rows // Br) * Br + 0.5, -3)
    ax.set_xticks([])
    ax.set_ylabel("query row")
    ax.set_title(f"grid ({Tr}, {BH}) of blocks, {Br} threads each"
                 + (f" (first {rows} rows)" if rows < Sq else ""))


def draw_load(ax, Br, Bc, d):
    """Which thread copies which element of the Bc x d tile Kj (Alg.1 l.7)."""
    owner = np.arange(Bc * d).reshape(Bc, d) % Br        # idx = c*d + k is copied by thread idx % Br
    ax.imshow(owner, cmap="tab20", aspect="auto")
    if Bc * d <= 256:
        for c in range(Bc):
            for kk in range(d):
                ax.text(kk, c, owner[c, kk], ha="center", va="center", fontsize=7)
    ax.set_xlabel("k (head dim)")
    ax.set_ylabel("c (key within the tile)")
    ax.set_title(f"thread that copies Kj[c, k]  (Br = {Br} threads, Bc = {Bc}, d = {d})")


fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [1, 1.4]})
draw_grid(axes[0], min(B * H, 4), Sq, plan.Br)
draw_load(axes[1], plan.Br, min(plan.Bc, 16), min(d, 16))
fig.tight_layout()
plt.show()

# %% [markdown]
# On the left, each coloured block is one thread block: a query tile of one head. A ragged
# last tile (hatched) still launches all $B_r$ threads; the extra ones compute nothing but
# must help load $K_j$, $V_j$ and reach every barrier. On the right, the copy of a tile:
# element `idx = c*d + k` is copied by thread `idx % Br`, so neighbouring threads read
# neighbouring addresses of $K$ at the same time (on a GPU that makes one wide,
# *coalesced* memory transaction instead of many small ones).
#
# ## The kernel
#
# Here is the v2 factory. Its arguments (`Br`, `Bc`, `d`, `causal`, the accumulator
# dtype, and the `variant` of notebook 07) are compile-time constants, so every tile size
# is its own compiled kernel, and `functools.lru_cache` keeps each one. Compare its body
# with `tiled.forward` from notebook 03: the `Alg.1 l.N` comments line up. Two calls
# come from other modules: `kv_tile_range` (`kernels/bands.py`) gives the K/V tiles a
# causal mask or a window leaves work in (the kernel sibling of `tiled.tiles_needed`),
# and `visible` / `score` (`kernels/variants.py`) are plain "key in range" and
# "s unchanged" for ordinary attention; notebook 07 shows what else they can be.

# %%
print(inspect.getsource(v2_flash2.make_forward_v2))

# %% [markdown]
# Three things have no counterpart in the NumPy version:
#
# * **Two barriers per key/value tile.** `cuda.syncthreads()` before the copy waits until
#   every thread has finished reading the previous $K_j$, $V_j$ (otherwise a fast thread
#   would overwrite a tile a slow one is still using); the one after the copy waits until
#   the tile is complete before anyone reads it.
# * **Idle threads.** Threads whose row is past $N_q$ skip the arithmetic (`active`) but
#   not the copy and not the barriers: a barrier that some threads of a block never reach
#   is undefined behaviour.
# * **No $-\infty - (-\infty)$.** A row that has seen only masked keys keeps
#   $m = -\infty$; the kernel uses `m_safe` and `alpha = 0` instead of computing
#   `exp(-inf - -inf)`, which is NaN on a GPU and an exception in the simulator.

# %% [markdown]
# ## The shared-memory budget
#
# Without asking, a block may use 48 KB of shared memory, declared with a size fixed at
# compile time (`cuda.shared.array(n, dtype)`, static shared memory). More, up to 227 KB
# per block on an H100 or H200, takes dynamic shared memory (`cuda.shared.array(0,
# dtype)`, sized at launch) and a per-kernel opt-in, which `numbaflash/kernels/smem.py`
# makes for forward v5 to v9 and backward v4 to v6. v2 stays within the 48 KB: it holds
# $K_j$ and $V_j$ there, $B_c \times d$ each, in the accumulator dtype;
# v2's file, `numbaflash/kernels/forward/v2_flash2.py`, computes it (`forward_shared_bytes`)
# and applies the documented rule (`default_forward_tiles`):

# %%
print(inspect.getsource(v2_flash2.forward_shared_bytes))
print(inspect.getsource(v2_flash2.default_forward_tiles))

print("  d   float32 (Br, Bc)  bytes    float64 (Br, Bc)  bytes")
for dd in (8, 16, 32, 64, 96, 128, 192, 256):
    cells = []
    for acc in ("float32", "float64"):
        br, bc = v2_flash2.default_forward_tiles(dd, acc)
        cells.append(f"{str((br, bc)):>12} {v2_flash2.forward_shared_bytes(br, bc, dd, acc):7d}")
    print(f"{dd:3d} {cells[0]}    {cells[1]}")

# %%
ds = np.arange(1, 257)
fig, ax = plt.subplots(figsize=(7, 4))
for bc in (64, 32, 16, 8):
    need = [v2_flash2.forward_shared_bytes(64, bc, dd, "float32") / 1024 for dd in ds]
    ax.plot(ds, need, label=f"Bc = {bc}")
chosen = [v2_flash2.forward_shared_bytes(*v2_flash2.default_forward_tiles(dd, "float32"), dd,
                                        "float32") / 1024 for dd in ds]
ax.plot(ds, chosen, "k", lw=3, alpha=0.3, label="the default rule's choice")
ax.axhline(SHARED_MEM_LIMIT / 1024, color="r", ls="--", label="48 KB per block")
ax.set_ylim(0, 70)
ax.set_xlabel("head dim d")
ax.set_ylabel("shared memory (KB), float32")
ax.set_title("Kj and Vj in shared memory")
ax.legend()
plt.show()

# %% [markdown]
# As $d$ grows the key/value tile must shrink to fit, so each barrier round covers fewer
# keys. Each thread also keeps its query row and its output row ($d$ values each) in
# registers, which is the other reason the library stops at head dim 256
# (`numbaflash.validate.HEAD_DIM_MAX`). Asking for more, or for tiles that do not fit,
# raises a `ValueError` that names the limit before anything is launched:

# %%
for bad in (dict(tiles=(64, 128)), dict(tiles=(2048, 8))):
    try:
        numbaflash.explain(np.empty((64, 256), np.float32), np.empty((64, 256), np.float32),
                           np.empty((64, 256), np.float32), **bad)
    except ValueError as e:
        print(f"{bad}: ValueError: {e}")
try:
    numbaflash.explain(*(np.empty((8, 300), np.float32),) * 3)
except ValueError as e:
    print(f"d = 300: ValueError: {e}")

# %% [markdown]
# ## Running it, and checking it
#
# `numbaflash.attention` takes NumPy arrays (or GPU arrays) of shape
# (batch, heads, seqlen, head_dim), validates them, plans, copies to the device and back.
# We check it the way the test suite does (`TESTING.md`): the float64 reference on the
# same float32 inputs is the truth, and the kernel's error must be at most twice the
# error of a plain float32 NumPy computation of the same thing (plus two ulps).

# %%
print(numbaflash.explain(q, k, v, tiles=TILES))      # the default version for this backend
t0 = time.perf_counter()
out, lse = numbaflash.attention(q, k, v, return_lse=True, tiles=TILES)
print(f"first call: {time.perf_counter() - t0:.2f} s (on a GPU this includes compiling the kernel)")

ref_out, ref_lse = reference.forward(q, k, v)                          # float64
base_out, base_lse = reference.forward(q, k, v, dtype=np.float32)      # naive float32
err = np.abs(out - ref_out).max()
base_err = np.abs(base_out - ref_out).max()
bound = 2 * base_err + 2 * np.spacing(np.abs(ref_out).max())
print(f"max |out - reference| = {err:.2e}; naive float32: {base_err:.2e}; bound {bound:.2e}")
assert err <= bound, f"out: max error {err:.2e} exceeds the bound {bound:.2e}"
lse_err = np.abs(lse - ref_lse).max()
lse_bound = 2 * np.abs(base_lse - ref_lse).max() + 2 * np.spacing(np.float32(np.abs(ref_lse).max()))
print(f"max |lse - reference| = {lse_err:.2e}; bound {lse_bound:.2e}")
assert lse_err <= lse_bound, f"lse: max error {lse_err:.2e} exceeds the bound {lse_bound:.2e}"

# %%
fig, ax = plt.subplots(figsize=(7, 3.5))
bins = np.linspace(-12, -5, 50)
kernel_name = numbaflash.explain(q, k, v, tiles=TILES).kernel
for name, o in ((f"{kernel_name} kernel", out), ("naive float32 NumPy", base_out)):
    e = np.abs(o.astype(np.float64) - ref_out).ravel()
    ax.hist(np.log10(np.maximum(e, 1e-12)), bins=bins, alpha=0.6, label=name)
ax.set_xlabel("log10 |error| against the float64 reference, per element")
ax.set_ylabel("elements")
ax.legend()
plt.show()

# %% [markdown]
# Both error distributions sit at float32 rounding (outputs here are of size about 1, and
# float32 keeps about 7 significant digits). The kernel adds in a different order from
# NumPy, so the two histograms differ; the rule above (at most twice the baseline's
# largest error) is what the test suite asserts for every shape it draws.
#
# ## Causal masks, and rows that see nothing
#
# The mask is a run-time offset (key $c$ is visible from query $r$ iff
# $c \le r + \text{offset}$), so one compiled causal kernel serves both alignments. With
# $N_q > N_k$ and the default bottom-right alignment the first $N_q - N_k$ rows see no
# key: their output is exactly 0 and their logsumexp $-\infty$, with no NaN.

# %%
q_long = rng.standard_normal((1, 1, Sk + 8, d)).astype(np.float32)      # Sq > Sk
for causal in ("bottom_right", "top_left"):
    o_c, l_c = numbaflash.attention(q_long, k[:1, :1], v[:1, :1], causal=causal,
                                    return_lse=True, tiles=TILES)
    r_o, r_l = reference.forward(q_long, k[:1, :1], v[:1, :1], causal=causal)
    b_o, _ = reference.forward(q_long, k[:1, :1], v[:1, :1], causal=causal, dtype=np.float32)
    empty = np.isneginf(l_c[0, 0])
    print(f"causal={causal:13s} max error {np.abs(o_c - r_o).max():.1e}; rows with no key: "
          f"{empty.sum()}, all-zero there: {bool((o_c[0, 0][empty] == 0).all())}, "
          f"NaN anywhere: {bool(np.isnan(o_c).any())}")
    assert not np.isnan(o_c).any() and not np.isnan(l_c).any(), f"{causal}: NaN in the output"
    assert np.array_equal(empty, np.isneginf(r_l[0, 0])), f"{causal}: lse -inf on the wrong rows"
    assert empty.sum() == (8 if causal == "bottom_right" else 0), f"{causal}: rows with no key"
    assert (o_c[0, 0][empty] == 0).all(), f"{causal}: a row that sees no key is not exactly 0"
    c_bound = 2 * np.abs(b_o - r_o).max() + 2 * np.spacing(np.float32(np.abs(r_o).max()))
    assert np.abs(o_c - r_o).max() <= c_bound, f"{causal}: error above the bound {c_bound:.1e}"

# %% [markdown]
# ## v1 against v2
#
# `version=` picks a rung of the ladder. v1 has no tiles and no shared memory: every
# thread streams all of $K$ and $V$ from global memory on its own. Both compute the same
# function:

# %%
print(inspect.getsource(v1_plain.make_forward_v1))

# %%
for version in fwd.VERSIONS:
    tiles = TILES if version == "v2" else None     # the tiles chosen above are v2's
    try:
        p = numbaflash.explain(q, k, v, version=version, tiles=tiles)
    except ValueError as e:                         # a version this backend or shape refuses
        print(f"{version}: not run here: {e}")
        continue
    o = numbaflash.attention(q, k, v, version=version, tiles=tiles)
    threads = math.prod(p.grid) * math.prod(p.block)
    print(f"{version}: {p.kernel}, grid {p.grid}, block {p.block}, {threads} threads, "
          f"shared {p.shared_bytes} B; max |out - reference| = {np.abs(o - ref_out).max():.2e}")
    assert np.abs(o - ref_out).max() <= bound, f"{version}: error above the bound {bound:.2e}"

# %% [markdown]
# What each version reads from global memory (HBM) for $K$ and $V$, counted from the
# loops (not measured): v1 reads them once per query **row**, $2 N_q N_k d$ elements;
# v2 once per query **tile**, $2 T_r N_k d$, which is $B_r$ times less.

# %%
Br_plan = numbaflash.explain(q, k, v, version="v2", tiles=TILES).Br
elems_v1 = 2 * B * H * Sq * Sk * d
elems_v2 = 2 * B * H * -(-Sq // Br_plan) * Sk * d
print(f"K and V elements read: v1 {elems_v1:,}, v2 {elems_v2:,} ({elems_v1 / elems_v2:.0f}x fewer)")

# %% [markdown]
# On a GPU the next cell times each version on device arrays (no host copies in the
# timing); on the simulator a time says nothing about a GPU, so it only says so. Measured
# numbers for the H200: `docs/performance.md` has the current ones against PyTorch SDPA,
# and each version's docstring (the ladder printed at the top) cites the file under
# `lab/runs/` that holds its measurement.

# %%
if SIM:
    print("simulator: timings are not meaningful here; run this notebook on a GPU")
else:
    dq, dk, dv = (cuda.to_device(a) for a in (q, k, v))
    for version in fwd.VERSIONS:
        try:
            numbaflash.explain(dq, dk, dv, version=version)
        except ValueError as e:
            print(f"{version}: not run here: {e}")
            continue
        numbaflash.attention(dq, dk, dv, version=version)            # compile, warm up
        cuda.synchronize()
        times = []
        for _ in range(10):
            t0 = time.perf_counter()
            numbaflash.attention(dq, dk, dv, version=version)
            cuda.synchronize()
            times.append(time.perf_counter() - t0)
        flops = 4 * B * H * Sq * Sk * d
        t = np.median(times)
        print(f"{version}: median {t * 1e3:.2f} ms over 10 runs, {flops / t / 1e12:.2f} TFLOP/s")

# %% [markdown]
# ## The tiles do not change the answer
#
# Notebook 03 showed that the NumPy loop gives the same result for any tiles. The kernel
# has compile-time tiles, so this is a statement about different compiled kernels; the
# test suite checks it with random shapes and tiles. A few here:

# %%
tile_choices = [(8, 8), (16, 8), (8, 16), (32, 32)] if SIM else [(64, 64), (64, 32), (32, 16), (128, 32)]
r_o = reference.forward(q[:1, :1], k[:1, :1], v[:1, :1], causal=True)[0]
b_o = reference.forward(q[:1, :1], k[:1, :1], v[:1, :1], causal=True, dtype=np.float32)[0]
t_bound = 2 * np.abs(b_o - r_o).max() + 2 * np.spacing(np.float32(np.abs(r_o).max()))
for tiles in tile_choices:
    o = numbaflash.attention(q[:1, :1], k[:1, :1], v[:1, :1], causal=True, version="v2",
                             tiles=tiles)
    print(f"tiles {tiles}: max |out - reference| = {np.abs(o - r_o).max():.2e} (bound {t_bound:.2e})")
    assert np.abs(o - r_o).max() <= t_bound, f"tiles {tiles}: error above the bound"

# %% [markdown]
# ## Exercise: a logsumexp kernel
#
# Write a kernel that computes only the logsumexp of each row of the scores,
# $L_r = \log \sum_c e^{\tau\, q_r \cdot k_c}$, with one thread per query row and the
# online softmax of notebook 02 over the keys (this is v1 without the output
# accumulator). Signature: `my_lse_kernel(Q, K, L, softmax_scale)` with `Q` of shape
# (BH, Sq, d), `K` (BH, Sk, d) and `L` (BH, Sq), all float64; the checking cell launches
# it with grid `(ceil(Sq / 16), BH)` and blocks of 16 threads, on a size that is not a
# multiple of 16.
#
# **How this exercise works:** the next cell is yours: write the kernel there (a start is
# in its comments) and run it, then run the checking cell after it. It fills `L` with NaN
# before the launch, compares with `reference.forward`'s logsumexp, and says what looks
# wrong (while `my_lse_kernel` is None, it skips the check). A solution waits out of
# sight in `solutions.py`; the cell after the checker shows it when you ask.

# %%
my_lse_kernel = None            # until you write yours


# @cuda.jit
# def my_lse_kernel(Q, K, L, softmax_scale):
#     bh = cuda.blockIdx.y                                         # which head
#     row = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x   # which query row
#     ...                                                          # the online softmax
#     L[bh, row] = ...


# %%
def check_lse_kernel(kernel):
    """Launch kernel on a few inputs; raise AssertionError saying what is wrong."""
    if kernel is None:
        print("skipped: my_lse_kernel is None")
        return
    threads = 16
    n = 37 if SIM else 1000
    cases = {"random": (rng.standard_normal((2, n, 8)), rng.standard_normal((2, n + 5, 8))),
             "large scores (inputs x 30)": (30 * rng.standard_normal((1, n, 8)),
                                            30 * rng.standard_normal((1, 9, 8))),
             "one key": (rng.standard_normal((1, n, 4)), rng.standard_normal((1, 1, 4)))}
    for name, (Qx, Kx) in cases.items():
        BH, Sq_x, d_x = Qx.shape
        scale = 1 / math.sqrt(d_x)
        L_out = cuda.to_device(np.full((BH, Sq_x), np.nan))
        try:
            kernel[(-(-Sq_x // threads), BH), threads](cuda.to_device(Qx), cuda.to_device(Kx),
                                                      L_out, scale)
        except IndexError as e:
            raise AssertionError(f"[{name}] out-of-bounds index ({e}): the grid has "
                                 f"{-(-Sq_x // threads) * threads} threads per head for {Sq_x} "
                                 f"rows; threads with row >= Q.shape[1] must return early") from None
        except (OverflowError, ValueError) as e:
            raise AssertionError(f"[{name}] {type(e).__name__} ({e}) inside the kernel: the "
                                 f"simulator's math.exp and math.log raise where a GPU would "
                                 f"give inf or NaN. Keep a running max and use exp(s - m_new) "
                                 f"and exp(m_old - m_new), whose arguments are <= 0") from None
        got = L_out.copy_to_host()
        want = reference.forward(Qx, Kx, Kx)[1]
        if np.isnan(got).all():
            raise AssertionError(f"[{name}] L is still all NaN: the kernel wrote nothing")
        if np.isnan(got).any():
            heads, rows = np.nonzero(np.isnan(got))
            raise AssertionError(f"[{name}] L is NaN in {heads.size} places (heads "
                                 f"{sorted(set(heads.tolist()))}, first rows "
                                 f"{sorted(set(rows.tolist()))[:5]}): were those rows written? "
                                 f"check row = blockIdx.x * blockDim.x + threadIdx.x and "
                                 f"bh = blockIdx.y; or did exp(-inf - (-inf)) give NaN?")
        if np.isinf(got).any():
            raise AssertionError(f"[{name}] inf in L: exp overflowed. Keep a running max and "
                                 f"use exp(s - m_new), exp(m_old - m_new)")
        if np.allclose(got, want, rtol=1e-12, atol=1e-12):
            continue
        if np.allclose(got, reference.forward(Qx, Kx, Kx, scale=1.0)[1], rtol=1e-12):
            raise AssertionError(f"[{name}] this is the logsumexp without softmax_scale: "
                                 f"multiply each score by it")
        raise AssertionError(f"[{name}] max |L - reference| = {np.abs(got - want).max():.2e}; "
                             f"compare with notebook 02's update: l = l * exp(m - m_new) + "
                             f"exp(s - m_new), and L = m + log(l) at the end")
    print("my_lse_kernel matches reference.forward's logsumexp on every case")


check_lse_kernel(my_lse_kernel)

# %% [markdown]
# Stuck, or done and curious? Uncomment these lines and run them to see a solution; the
# last one puts it in place of yours (run the checking cell again after it).

# %%
# import solutions
# solutions.show("my_lse_kernel")
# my_lse_kernel = solutions.my_lse_kernel

# %% [markdown]
# ---
# *For the test suite:* CI runs this notebook top to bottom, with the exercise above not
# yet written. This cell runs the same checker on the solution in `solutions.py`, without
# printing it, so a change that breaks the exercise, its checker or its solution fails the
# tests. You can skip it.

# %%
import solutions

check_lse_kernel(solutions.my_lse_kernel)
