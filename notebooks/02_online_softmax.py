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
# # 02 · The online softmax
#
# Notebook 01 ended with a problem: standard attention stores each row of scores before
# it takes the softmax. This notebook shows how to compute the softmax of a row (and,
# with it, the attention output) in **one pass**, keeping only two numbers per row: a
# running maximum $m$ and a running sum $\ell$. It is the idea that FlashAttention is
# built on. NumPy only: no GPU and no simulator.

# %%
import inspect

import matplotlib.pyplot as plt
import numpy as np

from numbaflash import online_softmax as osm

rng = np.random.default_rng(0)

# %% [markdown]
# ## Why subtract the maximum
#
# $$\operatorname{softmax}(x)_c = \frac{e^{x_c}}{\sum_{c'} e^{x_{c'}}}$$
#
# Multiplying the numerator and the denominator by the same $e^{-a}$ changes nothing, so
# for any constant $a$
#
# $$\operatorname{softmax}(x)_c = \frac{e^{x_c - a}}{\sum_{c'} e^{x_{c'} - a}}.$$
#
# With $a = \max_c x_c$ every exponent is $\le 0$, every term is in $(0, 1]$ and the
# largest is exactly 1, so the sum is at least 1: nothing overflows and nothing divides by
# zero. Without it, $e^{x}$ overflows for $x > 709.78$ in float64 and $x > 88.72$ in
# float32. `numbaflash.online_softmax.naive_softmax` is the version without the max, kept
# to show exactly this:

# %%
print(inspect.getsource(osm.naive_softmax))

for x in (np.array([1.0, 2.0, 3.0]),
          np.array([1000.0, 1001.0, 1002.0]),
          np.array([89.0, 90.0], dtype=np.float32)):
    p, m, l = osm.online_softmax(x)
    print(f"x = {x} ({x.dtype})\n   naive:  {osm.naive_softmax(x)}\n   online: {p}")

# %% [markdown]
# The three rows of `[1, 2, 3]` and `[1000, 1001, 1002]` have the same softmax (they differ
# by a constant), but the naive formula turns the second into `inf / inf = nan`. Scores of
# a few hundred are not exotic in attention: they are dot products of $d$-dimensional
# vectors.
#
# Subtracting the max costs a pass: first find $m = \max_c x_c$, then sum
# $e^{x_c - m}$, then divide. In attention a row of $S$ is produced a tile at a time
# (notebook 03), so two passes mean computing $S$ twice or storing it, which is what
# we want to avoid.

# %% [markdown]
# ## The online recurrence
#
# Keep, after seeing $x_1, \dots, x_t$,
#
# $$
# m_t = \max_{c \le t} x_c, \qquad \ell_t = \sum_{c \le t} e^{x_c - m_t}.
# $$
#
# When $x_{t+1}$ arrives, the max may grow, and the old terms were computed against the
# old max. Split the sum and pull out the old one:
#
# $$
# \ell_{t+1} = \sum_{c \le t} e^{x_c - m_{t+1}} + e^{x_{t+1} - m_{t+1}}
#            = e^{m_t - m_{t+1}} \underbrace{\sum_{c \le t} e^{x_c - m_t}}_{\ell_t}
#              + e^{x_{t+1} - m_{t+1}} .
# $$
#
# So the update is
#
# $$
# m_{t+1} = \max(m_t, x_{t+1}), \qquad
# \alpha = e^{m_t - m_{t+1}}, \qquad
# \ell_{t+1} = \alpha\, \ell_t + e^{x_{t+1} - m_{t+1}} .
# $$
#
# $\alpha \le 1$ is the **rescale factor**: when the max does not change it is exactly 1,
# and when it grows it shrinks the old sum onto the new scale. Both exponents are $\le 0$,
# so the recurrence never overflows. It starts from $m_0 = -\infty$, $\ell_0 = 0$
# ($\alpha = e^{-\infty} = 0$ at the first step wipes nothing that mattered). After the last
# entry, $\operatorname{softmax}(x)_c = e^{x_c - m_N} / \ell_N$ and
# $\log \sum_c e^{x_c} = m_N + \log \ell_N$ (the *logsumexp* $L$ that the kernels store for
# the backward pass).
#
# **Blocks.** Nothing changes if the entries arrive a block $\mathcal{B}$ at a time:
#
# $$
# m_{\text{new}} = \max\big(m, \max_{c \in \mathcal{B}} x_c\big), \qquad
# \ell_{\text{new}} = e^{m - m_{\text{new}}}\,\ell + \sum_{c \in \mathcal{B}} e^{x_c - m_{\text{new}}} .
# $$
#
# This is Algorithm 1, line 9, of FlashAttention-2 (arXiv:2307.08691) for one row, with the
# block being one tile of keys.
#
# **The output.** Attention does not need the probabilities themselves, only
# $O = \sum_c p_c v_c$. The same trick keeps an unnormalised accumulator
#
# $$
# o_t = \sum_{c \le t} e^{x_c - m_t}\, v_c, \qquad
# o_{t+1} = \alpha\, o_t + e^{x_{t+1} - m_{t+1}}\, v_{t+1}, \qquad
# O = o_N / \ell_N ,
# $$
#
# (Algorithm 1, lines 10 and 12): one pass over the keys gives the output row, with
# nothing of size $N$ stored.
#
# **Masked entries.** A causal mask sets scores to $-\infty$. If every entry seen so far is
# $-\infty$, then $m = -\infty$ and $\alpha = e^{-\infty - (-\infty)}$ is NaN. The library
# skips the update in that case (the state stays $m = -\infty$, $\ell = 0$), and a row
# that never sees a key ends with $\ell = 0$: its output is 0 and its logsumexp $-\infty$.

# %%
print(inspect.getsource(osm.online_softmax_steps))

# %% [markdown]
# ## Step by step
#
# Watch the state evolve on a short row. The last column recomputes
# $\sum_{c \le t} e^{x_c - m_t}$ directly, to check the invariant at every step.

# %%
x = np.array([0.5, 2.0, 1.0, 4.0, 3.5, -1.0, 6.0, 2.0])
print("  t   x_t     m_t      l_t    alpha   direct sum")
m_prev = -np.inf
for t, m, l in osm.online_softmax_steps(x):
    alpha = np.exp(m_prev - m)
    direct = np.exp(x[:t] - m).sum()
    print(f"{t:3d} {x[t - 1]:5.1f} {m:7.2f} {l:8.4f} {alpha:8.4f} {direct:10.4f}")
    assert np.isclose(l, direct, rtol=1e-12), f"step {t}: l = {l!r}, the direct sum {direct!r}"
    m_prev = m

p, m, l = osm.online_softmax(x)
two_pass = np.exp(x - x.max()) / np.exp(x - x.max()).sum()
print("max |online - two-pass softmax| =", np.abs(p - two_pass).max())
assert np.abs(p - two_pass).max() <= 1e-12, "the online softmax differs from the two-pass one"

# %% [markdown]
# Each time the max grows (steps 2, 4 and 7) $\alpha < 1$ and the running sum drops
# before the new term is added; when it does not grow, $\alpha = 1$.
#
# ## A picture of the running statistics
#
# A longer row whose values drift upward, so the max keeps growing. Processing it one
# entry at a time rescales at every new maximum; processing it in blocks of 8 (one tile
# of keys) rescales at most once per block. Both end in the same place.

# %%
n = 64
x = np.cumsum(rng.normal(0.15, 1.0, n))            # an upward random walk
fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
for block, style in ((1, "-"), (8, "o--")):
    steps = list(osm.online_softmax_steps(x, block=block))
    ts = [t for t, _, _ in steps]
    axes[0].step(ts, [m for _, m, _ in steps], style, where="post", label=f"m, block = {block}")
    axes[1].plot(ts, [l for _, _, l in steps], style, label=f"l, block = {block}")
axes[0].plot(np.arange(1, n + 1), x, ".", color="gray", ms=4, label="x_t")
axes[0].set_title("running max m")
axes[1].set_title("running sum l (on the scale of the current max)")
for ax in axes:
    ax.set_xlabel("entries seen t")
    ax.legend()
fig.tight_layout()
plt.show()

# %% [markdown]
# The running sum is not monotone: it jumps up when a new entry lands near the current
# max and collapses when the max moves up, because everything seen so far is now small
# compared with the new leader. It always stays in $[1, t]$.
#
# ## The block size does not matter
#
# The final $(m, \ell)$, and so the softmax, are the same for every block size, up to
# rounding. This is the property that lets the kernels pick their tile size freely, and
# that the test suite checks for the tiled versions.

# %%
for block in (1, 2, 3, 7, 16, 64):
    p, m, l = osm.online_softmax(x, block=block)
    ref = np.exp(x - x.max()) / np.exp(x - x.max()).sum()
    print(f"block {block:2d}: m = {m:.6f}, l = {l:.12f}, max |p - two-pass| = {np.abs(p - ref).max():.1e}")
    assert m == x.max(), f"block {block}: the final m is {m!r}, not the row's max {x.max()!r}"
    assert np.abs(p - ref).max() <= 1e-12, f"block {block}: p differs from the two-pass softmax"

# %% [markdown]
# ## Exercise: one step of the online softmax
#
# Write `my_online_step(m, l, xb)`: given the running max `m` and sum `l` so far and a
# new block `xb` (a 1-D array), return the new `(m, l)`. It must handle the first block
# (`m = -inf`, `l = 0`) and a block whose entries are all `-inf` (masked).
#
# **How this exercise works:** the next cell is yours: replace `raise NotImplementedError`
# with your code and run it, then run the checking cell after it.
# It runs your step over several rows, compares every intermediate state with
# `online_softmax_steps`, and says what went wrong at the first step that differs (until
# you have written it, it says "not attempted yet"). A solution waits out of sight in
# `solutions.py`; the cell after the checker shows it when you ask.

# %%
def my_online_step(m, l, xb):
    # your code here: the new running max, then the old sum rescaled plus the block's terms
    raise NotImplementedError


# %%
def check_online_step(step):
    """Run step over a few rows; raise AssertionError at the first wrong state, saying why."""
    rows = {
        "random row, blocks of 3": (rng.normal(size=11), 3),
        "rising row, blocks of 1": (np.arange(6.0), 1),
        "large values, blocks of 4": (1000 + 50 * rng.normal(size=12), 4),
        "masked first block, blocks of 2": (np.array([-np.inf, -np.inf, 0.5, 2.0, 1.0]), 2),
    }
    for name, (x, block) in rows.items():
        m, l = -np.inf, 0.0
        for t, m_want, l_want in osm.online_softmax_steps(x, block=block):
            xb = x[(t - 1) // block * block:t]             # the block that ended at entry t
            try:
                with np.errstate(all="ignore"):
                    m_new, l_new = step(m, l, xb)
            except NotImplementedError:
                print("not attempted yet: write my_online_step above and run this cell again")
                return
            where = f"[{name}] after {t} entries (block {np.round(xb, 3)})"
            if np.isnan(m_new) or np.isnan(l_new):
                if m == -np.inf and np.max(xb) == -np.inf:
                    raise AssertionError(f"{where}: NaN. The block is all -inf and so is m: "
                                         f"exp(m - m_new) = exp(-inf + inf) is NaN. Return the "
                                         f"state unchanged when m_new is -inf")
                if m == -np.inf:
                    raise AssertionError(f"{where}: NaN at the first visible block. With m_old = "
                                         f"-inf the rescale factor exp(m_old - m_new) is 0; "
                                         f"exp(m_new - m_old) is inf, and 0 * inf is NaN. Is "
                                         f"the factor upside down?")
                raise AssertionError(f"{where}: NaN in (m, l) = ({m_new}, {l_new})")
            if m_new != m_want:
                raise AssertionError(f"{where}: m = {float(m_new)!r}, expected {float(m_want)!r}: the new max is "
                                     f"max(old m, max of the block)")
            if np.isinf(l_new):
                raise AssertionError(f"{where}: l = inf. Exponents must be x - m_new and "
                                     f"m_old - m_new (both <= 0), never x alone")
            if not np.isclose(l_new, l_want, rtol=1e-12):
                with np.errstate(all="ignore"):
                    no_rescale = l + np.exp(xb - m_want).sum()
                    upside_down = l * np.exp(m_want - m) + np.exp(xb - m_want).sum()
                    old_max = l * np.exp(m - m_want) + np.exp(xb - m).sum()
                    no_max = l + np.exp(xb).sum()
                if np.isclose(l_new, no_rescale, rtol=1e-12):
                    hint = "the old sum was not rescaled: multiply it by exp(m_old - m_new)"
                elif np.isclose(l_new, upside_down, rtol=1e-12):
                    hint = "the rescale factor is upside down: it is exp(m_old - m_new) <= 1"
                elif np.isclose(l_new, old_max, rtol=1e-12):
                    hint = "the block's terms use the old max: use exp(x - m_new)"
                elif np.isclose(l_new, no_max, rtol=1e-12):
                    hint = ("this is sum(exp(x)) without the max: l holds exp(x - m) terms, "
                            "relative to the running max")
                else:
                    hint = "compare with the derivation above"
                raise AssertionError(f"{where}: l = {float(l_new)!r}, expected "
                                     f"{float(l_want)!r}; {hint}")
            m, l = m_new, l_new
    print("every intermediate (m, l) matches numbaflash.online_softmax.online_softmax_steps")


check_online_step(my_online_step)

# %% [markdown]
# Stuck, or done and curious? Uncomment these lines and run them to see a solution; the
# last one puts it in place of yours (run the checking cell again after it).

# %%
# import solutions
# solutions.show("my_online_step")
# my_online_step = solutions.my_online_step

# %% [markdown]
# ---
# *For the test suite:* CI runs this notebook top to bottom, with the exercise above not
# yet written. This cell runs the same checker on the solution in `solutions.py`, without
# printing it, so a change that breaks the exercise, its checker or its solution fails the
# tests. You can skip it.

# %%
import solutions

check_online_step(solutions.my_online_step)
