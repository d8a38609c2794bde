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
# # 03 · Tiling in NumPy: FlashAttention-2, Algorithm 1
#
# Notebook 02 computed the softmax of one row in a single pass, a block of entries at a
# time. FlashAttention does this for a whole block of rows at once: it cuts $Q$ into tiles
# of $B_r$ rows and $K$, $V$ into tiles of $B_c$ rows, and walks over the pairs of tiles,
# so that only a $B_r \times B_c$ piece of the score matrix ever exists. This notebook
# reads the library's tier-2 code, `numbaflash.tiled.forward`, which is Algorithm 1 of
# FlashAttention-2 (Tri Dao, arXiv:2307.08691) written as NumPy loops, with the names the
# CUDA kernel of notebook 04 uses. NumPy only: no GPU and no simulator.

# %%
import inspect

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Rectangle

from numbaflash import masks, reference, tiled
from numbaflash.online_softmax import online_softmax_steps

rng = np.random.default_rng(0)

# %% [markdown]
# ## Algorithm 1, line by line
#
# The paper states the algorithm for one head with $N$ queries and keys; the library
# allows $N_q \ne N_k$. In the paper's numbering (the code cites these as `Alg.1 l.N`):
#
# | line | what it does | in `tiled.forward` |
# |---|---|---|
# | 1 | cut $Q$ into $T_r = \lceil N_q / B_r \rceil$ tiles $Q_i$ of $B_r$ rows, and $K$, $V$ into $T_c = \lceil N_k / B_c \rceil$ tiles $K_j$, $V_j$ of $B_c$ rows | `Tr`, `Tc` |
# | 2 | cut $O$ and the logsumexp $L$ into $T_r$ matching tiles | `O[rows]`, `L[rows]` |
# | 3 | **for** each query tile $i$ (on a GPU: one thread block each) | `for i in range(Tr)` |
# | 4 | load $Q_i$ into on-chip memory (SRAM) | `Qi = Q[rows]` |
# | 5 | start $O_i = 0$, $\ell_i = 0$, $m_i = -\infty$ on chip | `o_i`, `l_i`, `m_i` |
# | 6 | **for** each key/value tile $j$ | `for j in range(tiles_needed(...))` |
# | 7 | load $K_j$, $V_j$ into SRAM | `Kj, Vj = K[cols], V[cols]` |
# | 8 | $S_{ij} = Q_i K_j^\top$ (scaled by $\tau$) | `Sij` |
# | 9 | $m_{\text{new}} = \max(m_i, \operatorname{rowmax} S_{ij})$, $\tilde P_{ij} = \exp(S_{ij} - m_{\text{new}})$, $\ell_i \leftarrow e^{m_i - m_{\text{new}}}\ell_i + \operatorname{rowsum}\tilde P_{ij}$ | `m_new`, `Pij`, `alpha`, `l_i` |
# | 10 | $O_i \leftarrow \operatorname{diag}(e^{m_i - m_{\text{new}}})\, O_i + \tilde P_{ij} V_j$ | `o_i` |
# | 11 | end for | |
# | 12 | $O_i \leftarrow \operatorname{diag}(\ell_i)^{-1} O_i$ | `O[rows] = ... o_i / l_div` |
# | 13 | $L_i = m_i + \log \ell_i$ | `L[rows] = ...` |
# | 14, 15 | write $O_i$ and $L_i$ to HBM | the same two assignments |
# | 16, 17 | end for; return $O$ and $L$ | `return O, L` |
#
# Lines 9 and 10 are notebook 02's online update, once per tile instead of once per entry,
# for $B_r$ rows at a time. Two things are not in the paper's listing: the causal mask
# (entries with key $c > r + \text{offset}$ are set to $-\infty$, and tiles that are
# entirely masked are never visited), and the care for rows that see no key at all.

# %%
print(inspect.getsource(tiled.forward))

# %%
print(inspect.getsource(tiled.tiles_needed))

# %% [markdown]
# ## What is on chip at each step
#
# Take $N_q = N_k = 16$, $B_r = B_c = 4$, so $T_r = T_c = 4$, and follow query tile
# $i = 2$. In each panel, $Q$ is on the left, $K^\top$ on top and $V^\top$ below, so that
# a key tile and its value tile sit in the same columns as the scores they touch. Blue
# tiles are in shared memory (SRAM); the red tile $S_{ij}$ is the only piece of the score
# matrix that exists at that moment. Pale red tiles have been folded into $m_i$, $\ell_i$
# and $O_i$ and are gone. The running $m_i$, $\ell_i$ and the accumulator $O_i$ live in
# registers, one row per thread.

# %%
def draw_step(ax, Nq, Nk, d, Br, Bc, i, j, causal=False, title=None):
    """One panel: Q (left), K^T (top), V^T (bottom) and the tile grid of S."""
    Tc = -(-Nk // Bc)
    offset = masks.causal_offset(Nq, Nk, masks.parse_causal(causal))
    n_visit = tiled.tiles_needed(i, Br, Bc, Tc, offset, masks.parse_causal(causal))
    sram, cur, done, skip = "#4c72b0", "#d62728", "#f4b6b6", "#dddddd"
    # S: the grid of tiles, with the element mask underneath
    vis = masks.visible(Nq, Nk, causal)
    ax.imshow(np.where(vis, 1.0, 0.0), cmap="Greys", vmin=0, vmax=4, origin="upper",
              extent=(0, Nk, Nq, 0))
    for jj in range(Tc):
        x0, w = jj * Bc, min(Bc, Nk - jj * Bc)
        if jj < j and jj < n_visit:
            ax.add_patch(Rectangle((x0, i * Br), w, min(Br, Nq - i * Br), color=done))
        if jj >= n_visit:
            ax.add_patch(Rectangle((x0, i * Br), w, min(Br, Nq - i * Br), fill=False,
                                   hatch="///", color="gray"))
    if j < n_visit:
        ax.add_patch(Rectangle((j * Bc, i * Br), min(Bc, Nk - j * Bc), min(Br, Nq - i * Br),
                               color=cur))
    # Q on the left (d columns), K^T above and V^T below (d rows)
    gap = 1
    ax.add_patch(Rectangle((-d - gap, 0), d, Nq, fill=False))
    ax.add_patch(Rectangle((-d - gap, i * Br), d, min(Br, Nq - i * Br), color=sram))
    for y0 in (-d - gap, Nq + gap):
        ax.add_patch(Rectangle((0, y0), Nk, d, fill=False))
        if j < n_visit:
            ax.add_patch(Rectangle((j * Bc, y0), min(Bc, Nk - j * Bc), d, color=sram))
    ax.text(-d / 2 - gap, -gap - 0.5, "Q", ha="center", va="bottom")
    ax.text(Nk + 0.5, -d / 2 - gap, "Kᵀ", va="center")
    ax.text(Nk + 0.5, Nq + gap + d / 2, "Vᵀ", va="center")
    ax.text(Nk + 0.5, Nq / 2, "S", va="center")
    if j < n_visit:
        ax.text((j + 0.5) * Bc, (i + 0.5) * Br, "Sᵢⱼ", color="w", ha="center", va="center")
    for t in range(0, Nk + 1, Bc):
        ax.plot([t, t], [0, Nq], color="k", lw=0.3)
    for t in range(0, Nq + 1, Br):
        ax.plot([0, Nk], [t, t], color="k", lw=0.3)
    ax.set_xlim(-d - gap - 0.5, Nk + 2.5)
    ax.set_ylim(Nq + d + gap + 0.5, -d - gap - 0.5)
    ax.set_aspect("equal")
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_title(title or f"i = {i}, j = {j}")


Nq = Nk = 16
d, Br, Bc = 3, 4, 4
fig, axes = plt.subplots(1, 4, figsize=(13, 4.2))
for j, ax in enumerate(axes):
    draw_step(ax, Nq, Nk, d, Br, Bc, i=2, j=j,
              title=f"i = 2, j = {j}: Alg.1 l.7-10")
fig.suptitle("Query tile i = 2 walks over the key/value tiles (blue: in SRAM, red: S_ij)")
fig.tight_layout(rect=(0, 0, 1, 0.94))
plt.show()

# %% [markdown]
# The same walk with a causal mask: query tile 2 holds rows 8 to 11, which see keys up to
# 11, so key tile 3 (keys 12 to 15) is entirely masked. `tiles_needed` stops the loop
# before it (hatched: never loaded, never computed). Tile $j = 2$ is on the diagonal: it is
# computed, and the mask inside it sets the upper-right entries to $-\infty$.

# %%
fig, axes = plt.subplots(1, 4, figsize=(13, 4.2))
for j, ax in enumerate(axes):
    skipped = j >= tiled.tiles_needed(2, Br, Bc, 4, masks.causal_offset(Nq, Nk, "bottom_right"),
                                      "bottom_right")
    draw_step(ax, Nq, Nk, d, Br, Bc, i=2, j=j, causal=True,
              title=f"i = 2, j = {j}" + (": skipped" if skipped else ""))
fig.suptitle("causal: the walk stops at the diagonal (white: masked entries)")
fig.tight_layout(rect=(0, 0, 1, 0.94))
plt.show()

# %% [markdown]
# ## Which tiles causal attention skips
#
# Over the whole grid of $(i, j)$ pairs, a tile is *full* (every entry visible),
# *diagonal* (computed, partly masked) or *skipped*. With $N_q \ne N_k$ the two alignments
# of `numbaflash.masks` put the diagonal in different places: bottom-right (the default
# for `causal=True`, as in flash-attention) makes the last query see every key, top-left
# (PyTorch's `is_causal`) makes the first query see only key 0. With $N_q > N_k$ and
# bottom-right alignment, the first $N_q - N_k$ rows see no key at all.

# %%
def tile_map(Nq, Nk, Br, Bc, causal):
    """0 = skipped, 1 = diagonal (computed, partly masked), 2 = full, per (i, j) tile."""
    mode = masks.parse_causal(causal)
    offset = masks.causal_offset(Nq, Nk, mode)
    vis = masks.visible(Nq, Nk, causal)
    Tr, Tc = -(-Nq // Br), -(-Nk // Bc)
    kinds = np.zeros((Tr, Tc), int)
    for i in range(Tr):
        for j in range(tiled.tiles_needed(i, Br, Bc, Tc, offset, mode)):
            kinds[i, j] = 2 if vis[i * Br:(i + 1) * Br, j * Bc:(j + 1) * Bc].all() else 1
    return kinds


cases = [(32, 32, "bottom_right"), (24, 40, "bottom_right"), (24, 40, "top_left"),
         (40, 24, "bottom_right")]
Br, Bc = 8, 8
cmap = plt.matplotlib.colors.ListedColormap(["#dddddd", "#f4a261", "#2a9d8f"])
fig, axes = plt.subplots(1, len(cases), figsize=(14, 4))
for ax, (nq, nk, mode) in zip(axes, cases):
    kinds = tile_map(nq, nk, Br, Bc, mode)
    ax.imshow(kinds, cmap=cmap, vmin=0, vmax=2, extent=(0, nk, nq, 0))
    ax.imshow(np.ma.masked_where(masks.visible(nq, nk, mode), np.ones((nq, nk))),
              cmap="Greys", alpha=0.35, vmin=0, vmax=1, extent=(0, nk, nq, 0))
    ax.set_xticks(range(0, nk + 1, Bc))
    ax.set_yticks(range(0, nq + 1, Br))
    ax.grid(color="k", lw=0.5)
    n_skip = (kinds == 0).sum()
    ax.set_title(f"Nq={nq}, Nk={nk}, {mode}\n{n_skip} of {kinds.size} tiles skipped")
    ax.set_xlabel("key")
    ax.set_ylabel("query")
fig.suptitle("green: full tile, orange: diagonal tile, grey: skipped; shading: masked entries")
fig.tight_layout(rect=(0, 0, 1, 0.94))
plt.show()

# %% [markdown]
# For $N_q = N_k = N$ the skipped fraction tends to one half as $N / B$ grows: causal
# attention does about half the work. The diagonal tiles still pay for their masked
# entries.

# %% [markdown]
# ## The running statistics of one row are notebook 02's
#
# Row $r$ of query tile $i$ sees one block of $B_c$ scores per key tile. Its $m_i$ and
# $\ell_i$ after tile $j$ are exactly what `online_softmax_steps` gives for that row of
# $S$ with `block = Bc`, and the logsumexp that `tiled.forward` writes is
# $m + \log \ell$ at the end.

# %%
Nq, Nk, d, Br, Bc = 12, 40, 8, 4, 8
Q, K, V = (rng.standard_normal((n, d)) for n in (Nq, Nk, Nk))
O, L = tiled.forward(Q, K, V, Br=Br, Bc=Bc)
S = Q @ K.T / np.sqrt(d)
r = 5
steps = list(online_softmax_steps(S[r], block=Bc))
for t, m, l in steps:
    print(f"after key tile {t // Bc - 1}: m = {m:.4f}, l = {l:.4f}")
print(f"m + log(l) = {steps[-1][1] + np.log(steps[-1][2]):.12f};  tiled.forward's L[{r}] = {L[r]:.12f}")
assert np.isclose(steps[-1][1] + np.log(steps[-1][2]), L[r], rtol=1e-12), \
    "tiled.forward's L is not the online softmax's m + log(l)"

# %% [markdown]
# ## The result does not depend on the tiles
#
# Whatever $B_r$ and $B_c$ are, including ones that do not divide $N$ and tiles larger than
# the whole sequence, `tiled.forward` computes the same function as the dense reference;
# only the order of the floating-point additions changes. In float64 the difference is
# at the level of rounding ($10^{-16}$). Here on a ragged size, with and without the
# causal mask:

# %%
Nq, Nk, d = 37, 45, 8
Q, K, V = (rng.standard_normal((n, d)) for n in (Nq, Nk, Nk))
sizes = [1, 2, 3, 5, 8, 16, 64]
errors = {}
for causal in (False, True):
    O_ref, L_ref = reference.forward(Q, K, V, causal=causal)
    err = np.zeros((len(sizes), len(sizes)))
    for a, br in enumerate(sizes):
        for b, bc in enumerate(sizes):
            O, L = tiled.forward(Q, K, V, causal=causal, Br=br, Bc=bc)
            err[a, b] = np.abs(O - O_ref).max()
    errors[causal] = err
    print(f"causal={causal}: largest |O - reference| over all {err.size} tilings = {err.max():.1e}")
    # float64 rounding: TESTING.md's 1e-12 relative to the size of O (at most max|V|)
    assert err.max() <= 1e-12 * np.abs(V).max(), f"causal={causal}: a tiling changes O"

fig, axes = plt.subplots(1, 2, figsize=(10, 4))
for ax, (causal, err) in zip(axes, errors.items()):
    im = ax.imshow(np.log10(np.maximum(err, 1e-18)), cmap="magma", vmin=-18, vmax=-14)
    ax.set_xticks(range(len(sizes)), sizes)
    ax.set_yticks(range(len(sizes)), sizes)
    ax.set_xlabel("Bc")
    ax.set_ylabel("Br")
    ax.set_title(f"log10 max|O - reference|, causal={causal}")
    fig.colorbar(im, ax=ax, shrink=0.8)
fig.tight_layout()
plt.show()

# %% [markdown]
# The test suite checks the same property with random shapes and tiles (Hypothesis), and
# then the same for the CUDA kernels, where the tiles are compile-time constants.
#
# ## What tiling changes: memory, and HBM traffic counted
#
# The certain gain is memory: nothing of size $N_q \times N_k$ is ever stored (notebook 01
# measured it). Traffic between HBM and the chip is subtler. Counting elements from the
# loop structure (a count, not a measurement), for $N_q = N_k = N$:
#
# * dense: read $Q$, $K$, $V$ and write $O$ ($4Nd$), write $S$ and read it back, write $P$
#   and read it back ($4N^2$);
# * tiled: read $Q$ once, read $K$ and $V$ once per query tile ($2 T_r N d \approx 2N^2 d / B_r$),
#   write $O$ and $L$ once ($Nd + N$).
#
# Tiling does not remove the $N^2$ term; it changes its constant from 4 to $2d/B_r$. That
# is a saving only when the query tile is large enough ($B_r > d/2$): the size of $B_r$,
# which shared memory limits, is what pays.

# %%
d = 64
Ns = 2 ** np.arange(8, 16)
dense = 4 * Ns * d + 4 * Ns.astype(float) ** 2             # Q, K, V, O + S and P, written and read
fig, ax = plt.subplots(figsize=(6, 4))
ax.loglog(Ns, dense, "ks-", label="dense: 4Nd + 4N²")
for Br in (16, 64, 128):
    Tr = -(-Ns // Br)
    tiled_count = Ns * d + 2 * Tr * Ns * d + Ns * d + Ns  # Q; K and V per query tile; O, L
    ax.loglog(Ns, tiled_count, "o-", label=f"tiled, Br = {Br}: 2Nd + 2 Tr N d + N")
ax.set_xlabel("N (= Nq = Nk)")
ax.set_ylabel("elements moved to or from HBM")
ax.set_title(f"one head, d = {d} (counted, not measured)")
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# With $d = 64$: $B_r = 16$ moves twice as much as the dense version, $B_r = 64$ half,
# $B_r = 128$ a quarter. How big $B_r$ and $B_c$ can be is decided by shared memory, the
# subject of notebook 04.

# %% [markdown]
# ## Exercise: the inner step, Algorithm 1 lines 8 to 10
#
# Write `my_tile_step(Qi, Kj, Vj, m_i, l_i, o_i, softmax_scale)` for one query tile and one
# key/value tile, without a mask: `Qi` is $(B_r, d)$, `Kj` and `Vj` are $(B_c, d)$, `m_i`
# and `l_i` are $(B_r,)$, `o_i` is $(B_r, d)$. Return the new `(m_i, l_i, o_i)`.
#
# **How this exercise works:** the next cell is yours: replace `raise NotImplementedError`
# with your code and run it, then run the checking cell after it.
# It drives Algorithm 1 with your step (lines 3 to 7 and 12 to 13 are done for you),
# compares $O$ and $L$ with the dense reference, and uses which of them is wrong, and for
# which tiling, to say what to fix (until you have written it, it says "not attempted
# yet"). A solution waits out of sight in `solutions.py`; the cell after the checker shows
# it when you ask.

# %%
def my_tile_step(Qi, Kj, Vj, m_i, l_i, o_i, softmax_scale):
    # your code here: l.8 (Sij), l.9 (m_new, Pij, l_new), l.10 (o_new)
    raise NotImplementedError


# %%
def run_with_step(step, Q, K, V, Br, Bc):
    """Algorithm 1 for one head with the learner's inner step; returns (O, L)."""
    Nq, d = Q.shape
    scale = 1 / np.sqrt(d)
    O, L = np.zeros_like(Q), np.zeros(Nq)
    for i in range(0, Nq, Br):
        Qi = Q[i:i + Br]
        m_i, l_i, o_i = np.full(len(Qi), -np.inf), np.zeros(len(Qi)), np.zeros_like(Qi)
        for j in range(0, len(K), Bc):
            m_i, l_i, o_i = step(Qi, K[j:j + Bc], V[j:j + Bc], m_i, l_i, o_i, scale)
            if np.shape(m_i) != (len(Qi),) or np.shape(l_i) != (len(Qi),) or np.shape(o_i) != Qi.shape:
                raise AssertionError(f"shapes: m_i {np.shape(m_i)}, l_i {np.shape(l_i)}, o_i "
                                     f"{np.shape(o_i)}; expected ({len(Qi)},), ({len(Qi)},), {Qi.shape}")
        O[i:i + Br] = o_i / l_i[:, None]             # l.12
        L[i:i + Br] = m_i + np.log(l_i)              # l.13
    return O, L


def check_tile_step(step):
    """Raise AssertionError with a diagnosis if step is not Alg.1 l.8-10."""
    Q, K, V = (rng.standard_normal((n, 5)) for n in (13, 22, 22))
    cases = [("one key/value tile (Bc >= Nk)", Q, K, V, 4, 32),
             ("several key/value tiles", Q, K, V, 4, 6),
             ("large scores (inputs x 30)", 30 * Q, 30 * K, V, 5, 4)]
    one_tile_ok = False
    for name, q, k, v, br, bc in cases:
        try:
            with np.errstate(all="ignore"):
                O, L = run_with_step(step, q, k, v, br, bc)
        except NotImplementedError:
            print("not attempted yet: write my_tile_step above and run this cell again")
            return
        O_ref, L_ref = reference.forward(q, k, v)
        if not (np.isfinite(O).all() and np.isfinite(L).all()):
            raise AssertionError(f"[{name}] inf or NaN: the exponents must be relative to the "
                                 f"new running max (Sij - m_new, m_i - m_new), so none is > 0")
        L_ok = np.allclose(L, L_ref, rtol=1e-10, atol=1e-10)
        O_ok = np.allclose(O, O_ref, rtol=1e-10, atol=1e-10)
        if L_ok and O_ok:
            one_tile_ok = one_tile_ok or bc >= len(k)
            continue
        if np.allclose(O, reference.forward(q, k, v, scale=1.0)[0], rtol=1e-10, atol=1e-10):
            raise AssertionError(f"[{name}] this is attention without softmax_scale: multiply "
                                 f"Sij by it (l.8)")
        if not one_tile_ok:
            raise AssertionError(f"[{name}] wrong even with a single key/value tile, where no "
                                 f"rescaling happens: check l.8 (Sij = Qi Kj^T * scale) and "
                                 f"l.9 (Pij = exp(Sij - m_new), l = rowsum(Pij))")
        if L_ok:
            raise AssertionError(f"[{name}] L is right but O is wrong: m_i and l_i are fine, "
                                 f"o_i is not rescaled correctly; l.10 multiplies the old o_i "
                                 f"by alpha = exp(m_old - m_new) before adding Pij Vj")
        raise AssertionError(f"[{name}] L is wrong with several tiles (max error "
                             f"{np.abs(L - L_ref).max():.1e}): l_i must be rescaled by "
                             f"alpha = exp(m_old - m_new) before the tile's rowsum is added (l.9)")
    print("O and L match numbaflash.reference.forward for every tiling tried")


check_tile_step(my_tile_step)

# %% [markdown]
# Stuck, or done and curious? Uncomment these lines and run them to see a solution; the
# last one puts it in place of yours (run the checking cell again after it).

# %%
# import solutions
# solutions.show("my_tile_step")
# my_tile_step = solutions.my_tile_step

# %% [markdown]
# ---
# *For the test suite:* CI runs this notebook top to bottom, with the exercise above not
# yet written. This cell runs the same checker on the solution in `solutions.py`, without
# printing it, so a change that breaks the exercise, its checker or its solution fails the
# tests. You can skip it.

# %%
import solutions

check_tile_step(solutions.my_tile_step)
