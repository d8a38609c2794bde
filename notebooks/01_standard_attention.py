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
# # 01 · Standard attention and the memory wall
#
# This is the first of a series of notebooks that build FlashAttention up from the formula
# to a CUDA kernel. Every notebook imports the `numbaflash` package and shows its code
# with `inspect.getsource`; nothing shipped is defined here.
#
# | notebook | what it shows | needs |
# |---|---|---|
# | **01 standard attention** | the formula, the $N \times N$ matrix it materialises, and what that costs in memory | NumPy |
# | 02 online softmax | how to compute a softmax in one pass without storing the row | NumPy |
# | 03 tiling in NumPy | FlashAttention-2 Algorithm 1, tile by tile | NumPy |
# | 04 the forward kernel | the same loop as a Numba CUDA kernel, checked against the reference | GPU or simulator |
# | 05 the backward pass | the gradients, Algorithm 2, and the backward kernels | GPU or simulator |
# | 06 GPU performance | time, TFLOP/s and memory traffic next to PyTorch SDPA | a GPU |
# | 07 masks and modifiers | sliding windows, document masks, softcap, `score_mod`, GQA | GPU or simulator |
#
# Notebooks 01 to 05 each end with an exercise and a cell that checks it. This notebook
# needs only NumPy: no GPU and no simulator.

# %%
import inspect
import tracemalloc

import matplotlib.pyplot as plt
import numpy as np

import numbaflash
from numbaflash import reference, tiled

rng = np.random.default_rng(0)

# %% [markdown]
# ## The formula
#
# For one attention head, the queries $Q \in \mathbb{R}^{N_q \times d}$, keys
# $K \in \mathbb{R}^{N_k \times d}$ and values $V \in \mathbb{R}^{N_k \times d}$ give
#
# $$
# S = \tau\, Q K^\top \in \mathbb{R}^{N_q \times N_k}, \qquad
# P = \operatorname{softmax}_{\text{row}}(S), \qquad
# O = P V \in \mathbb{R}^{N_q \times d},
# $$
#
# with the softmax scale $\tau = 1/\sqrt{d}$ and, row by row,
# $P_{rc} = e^{S_{rc}} / \sum_{c'} e^{S_{rc'}}$. The library's tier-1 reference does
# exactly this, in float64, and keeps $S$ and $P$ in memory as whole matrices. It is
# the oracle every faster version is tested against:

# %%
print(inspect.getsource(reference._scores))
print(inspect.getsource(reference._softmax_rows))
print(inspect.getsource(reference.forward))

# %% [markdown]
# `_softmax_rows` subtracts the row maximum before `exp` (notebook 02 shows why) and
# handles rows that see no key at all. Here is a tiny example: $N = 8$ queries and keys
# with $d = 4$. Each row of $P$ is a probability distribution over the keys, and each
# output row is the corresponding weighted average of the rows of $V$.

# %%
N, d = 8, 4
Q, K, V = (rng.standard_normal((N, d)) for _ in range(3))
S = Q @ K.T / np.sqrt(d)
P = reference.probabilities(Q, K)
O, L = reference.forward(Q, K, V)

print("rows of P sum to", P.sum(axis=1))
print("O == P @ V:", np.allclose(O, P @ V))
assert np.abs(P.sum(axis=1) - 1).max() <= 1e-12, "a row of P does not sum to 1"
assert np.allclose(O, P @ V, rtol=1e-12, atol=1e-12), "reference.forward's O is not P @ V"

fig, axes = plt.subplots(1, 3, figsize=(10, 3))
for ax, (title, M) in zip(axes, [("S = Q K^T / sqrt(d)", S), ("P = softmax(S)", P),
                                  ("causal P", reference.probabilities(Q, K, causal=True))]):
    im = ax.imshow(M, cmap="viridis")
    ax.set_title(title)
    ax.set_xlabel("key c")
    ax.set_ylabel("query r")
    fig.colorbar(im, ax=ax, shrink=0.8)
fig.tight_layout()
plt.show()

# %% [markdown]
# The causal panel uses the mask from `numbaflash.masks`: query $r$ may see key $c$ iff
# $c \le r + \text{offset}$. With $N_q = N_k$ that is the lower triangle; notebook 03
# comes back to the offset when $N_q \ne N_k$.

# %% [markdown]
# ## The $N \times N$ matrix
#
# $Q$, $K$, $V$ and $O$ grow like $N d$. $S$ and $P$ grow like $N^2$. With a batch of $B$
# sequences and $H$ heads, one score matrix in float32 takes $4 B H N^2$ bytes. The plot
# below takes $B = 1$, $H = 32$, $d = 128$ (the sizes are only an example) and draws both
# lines; the dashed lines mark device memories of 16 and 80 GiB for scale.

# %%
B, H, d_model, itemsize = 1, 32, 128, 4                # float32
Ns = 2 ** np.arange(9, 18)                              # 512 .. 131072
qkvo_bytes = 4 * B * H * Ns * d_model * itemsize        # Q, K, V and O
s_bytes = B * H * Ns.astype(np.float64) ** 2 * itemsize # one N x N matrix per head

GiB = 2 ** 30
for n, a, s in zip(Ns, qkvo_bytes, s_bytes):
    print(f"N = {n:6d}:  Q, K, V, O {a / GiB:8.3f} GiB    S {s / GiB:10.2f} GiB")

fig, ax = plt.subplots(figsize=(6, 4))
ax.loglog(Ns, qkvo_bytes / GiB, "o-", label="Q, K, V, O  (grows like N d)")
ax.loglog(Ns, s_bytes / GiB, "s-", label="S  (grows like N²)")
for cap in (16, 80):
    ax.axhline(cap, ls="--", color="gray", lw=0.8)
    ax.text(Ns[0], cap * 1.15, f"{cap} GiB", color="gray")
ax.set_xlabel("sequence length N")
ax.set_ylabel("GiB (float32)")
ax.set_title(f"B={B}, H={H}, d={d_model}")
ax.legend()
plt.show()

# %% [markdown]
# Past a few thousand tokens the score matrix dwarfs everything else, and past a few tens
# of thousands it does not fit at all. Even where it fits, it has to be written to the
# GPU's main memory (HBM) and read back (once to normalise, once for $PV$): the inputs
# are $\Theta(N d)$ bytes, but this traffic is $\Theta(N^2)$, a factor of about $N/d$ more.
# That traffic, not the arithmetic, is what makes standard attention slow at long
# sequence lengths. FlashAttention never writes $S$ or $P$ to memory.

# %% [markdown]
# ## Measured: the reference's peak memory
#
# `tracemalloc` sees NumPy's allocations, so it can measure what the dense reference
# really holds at its peak. The same measurement of `numbaflash.tiled.forward`, the
# tiled NumPy version of notebook 03, shows the other shape of curve. One head, $d = 64$,
# float64.

# %%
def peak_bytes(fn, *args, **kwargs):
    """Peak memory NumPy and Python allocated while fn ran (bytes)."""
    tracemalloc.start()
    fn(*args, **kwargs)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


d = 64
Ns_measured = [128, 256, 512, 1024, 2048]
dense_peak, tiled_peak = [], []
for n in Ns_measured:
    Qn, Kn, Vn = (rng.standard_normal((n, d)) for _ in range(3))
    dense_peak.append(peak_bytes(reference.forward, Qn, Kn, Vn))
    tiled_peak.append(peak_bytes(tiled.forward, Qn, Kn, Vn, Br=64, Bc=64))

print("    N   dense peak   / (8 N^2)    tiled peak   / (8 N d)")
for n, a, b in zip(Ns_measured, dense_peak, tiled_peak):
    print(f"{n:5d} {a / 2**20:9.1f} MiB  {a / (8 * n * n):8.2f}   {b / 2**20:9.2f} MiB  {b / (8 * n * d):8.2f}")

# %%
fig, ax = plt.subplots(figsize=(6, 4))
ax.loglog(Ns_measured, np.array(dense_peak) / 2**20, "s-", label="reference.forward (dense)")
ax.loglog(Ns_measured, np.array(tiled_peak) / 2**20, "o-", label="tiled.forward (Br = Bc = 64)")
ax.loglog(Ns_measured, 8 * np.array(Ns_measured, float) ** 2 / 2**20, "k:", lw=1,
          label="one N x N float64 matrix")
ax.set_xticks(Ns_measured, [str(n) for n in Ns_measured])
ax.minorticks_off()
ax.set_xlabel("sequence length N")
ax.set_ylabel("peak MiB (tracemalloc)")
ax.set_title("one head, d = 64, float64")
ax.legend()
plt.show()

# %% [markdown]
# The dense reference peaks at about four $N \times N$ matrices (the scores, the
# exponentials, the probabilities and a temporary), so its line runs parallel to the
# dotted $N^2$ line. The tiled version holds the inputs, the output and one small
# $B_r \times B_c$ tile at a time: its peak grows like $N d$, and the gap widens with
# every doubling of $N$.
#
# Notebook 02 shows the trick that makes this possible: the softmax of a row can be
# computed while the row streams past, without ever holding the whole row.

# %% [markdown]
# ## Exercise: standard attention in NumPy
#
# Write `my_attention(Q, K, V)` for one head: `Q` is $(N_q, d)$, `K` and `V` are
# $(N_k, d)$, and it returns $O$ of shape $(N_q, d)$. Use the scale $1/\sqrt{d}$ and make
# it safe for large scores.
#
# **How this exercise works:** the next cell is yours: replace `raise NotImplementedError`
# with your code and run it, then run the checking cell after it.
# It compares with `numbaflash.reference.forward` on a few cases and says what looks wrong
# (until you have written it, it says "not attempted yet"). A solution waits out of sight
# in `solutions.py`; the cell after the checker shows it when you ask.

# %%
def my_attention(Q, K, V):
    # your code here: the scores, a row-wise softmax that is safe for large scores, P V
    raise NotImplementedError


# %%
def check_my_attention(fn):
    """Compare fn with the reference on a few cases; raise AssertionError saying what is wrong."""
    cases = {
        "small random": (rng.standard_normal((5, 4)), rng.standard_normal((7, 4)),
                         rng.standard_normal((7, 4))),
        "d = 3": (rng.standard_normal((6, 3)), rng.standard_normal((9, 3)),
                  rng.standard_normal((9, 3))),
        "large scores (inputs x 40)": (40 * rng.standard_normal((4, 8)),
                                       40 * rng.standard_normal((6, 8)),
                                       rng.standard_normal((6, 8))),
        # row 0's largest score is about 1400, row 1's about 1: one maximum for all rows
        # would leave row 1 with exp(-1400) = 0 everywhere
        "rows of very different scores": (np.array([[100.0] + [0.0] * 7, [0.0, 0.1] + [0.0] * 6]),
                                          40 * np.eye(8)[:6], rng.standard_normal((6, 8))),
    }
    for name, (q, k, v) in cases.items():
        try:
            with np.errstate(all="ignore"):
                out = np.asarray(fn(q, k, v))
        except NotImplementedError:
            print("not attempted yet: write my_attention above and run this cell again")
            return
        want = reference.forward(q, k, v)[0]
        if out.shape != want.shape:
            raise AssertionError(f"[{name}] O has shape {out.shape}, expected {want.shape} "
                                 f"(Nq, d): S = Q K^T is (Nq, Nk) and O = P V")
        if not np.isfinite(out).all():
            raise AssertionError(f"[{name}] inf or NaN in O: exp overflows for large scores, "
                                 f"or a whole row underflows to 0 (then 0 / 0) when one maximum "
                                 f"serves every row; subtract each row's own maximum before exp "
                                 f"(notebook 02 shows why that does not change the result)")
        if np.allclose(out, want, rtol=1e-10, atol=1e-12):
            continue
        if np.allclose(out, reference.forward(q, k, v, scale=1.0)[0]):
            raise AssertionError(f"[{name}] this is attention without the scale: multiply S "
                                 f"by 1/sqrt(d)")
        E = np.exp(q @ k.T / np.sqrt(q.shape[1]))
        if np.allclose(out, (E / E.sum(axis=0, keepdims=True)) @ v):
            raise AssertionError(f"[{name}] the softmax normalises the columns: normalise "
                                 f"each row (axis=1), over the keys")
        raise AssertionError(f"[{name}] max |error| {np.abs(out - want).max():.2e} against "
                             f"reference.forward; compare your S and P with reference._scores "
                             f"and reference.probabilities")
    print("all cases match numbaflash.reference.forward")


check_my_attention(my_attention)

# %% [markdown]
# Stuck, or done and curious? Uncomment these lines and run them to see a solution; the
# last one puts it in place of yours (run the checking cell again after it).

# %%
# import solutions
# solutions.show("my_attention")
# my_attention = solutions.my_attention

# %% [markdown]
# ---
# *For the test suite:* CI runs this notebook top to bottom, with the exercise above not
# yet written. This cell runs the same checker on the solution in `solutions.py`, without
# printing it, so a change that breaks the exercise, its checker or its solution fails the
# tests. You can skip it.

# %%
import solutions

check_my_attention(solutions.my_attention)
