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
# # 05 · The backward pass
#
# Training needs the gradients of the attention output with respect to $Q$, $K$ and $V$.
# The forward of notebooks 03 and 04 never stored $S$ or $P$; the backward must not store
# them either. This notebook derives the gradients, shows how FlashAttention-2's
# Algorithm 2 recomputes $P$ tile by tile from the saved logsumexp $L$, reads the
# library's NumPy tier (`tiled.backward`) and runs the kernels
# (`numbaflash.attention_backward`), on the simulator or a GPU.

# %%
import inspect
import sys
import tracemalloc

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import FancyArrowPatch, Rectangle
from numba import cuda

import numbaflash
from numbaflash import reference, tiled
from numbaflash.kernels import backward as bwd

BACKEND = numbaflash.backend()
SIM = BACKEND == "simulator"
if SIM:
    sys.setswitchinterval(2e-4)          # cheaper barriers in the simulator (see notebook 04)
    B, H, Sq, Sk, d = 1, 2, 24, 40, 8
    TILES = (16, 16)
else:
    B, H, Sq, Sk, d = 2, 8, 1024, 1024, 64
    TILES = None
print(f"backend: {BACKEND}; q (B, H, Sq, d) = {(B, H, Sq, d)}, k and v (B, H, Sk, d) = "
      f"{(B, H, Sk, d)}, tiles = {TILES or 'default'}")
rng = np.random.default_rng(0)

# %% [markdown]
# ## The gradients
#
# The forward, for one head: $S = \tau Q K^\top$, $P = \operatorname{softmax}_{\text{row}}(S)$,
# $O = PV$. Given $dO = \partial \mathcal{L} / \partial O$ for some loss $\mathcal{L}$:
#
# **Through $O = PV$:**
# $$dV = P^\top dO, \qquad dP = dO\, V^\top .$$
#
# **Through the softmax**, one row $r$ at a time. With $P_{rc} = e^{S_{rc}} / \sum_{c'} e^{S_{rc'}}$,
# $\partial P_{rc'} / \partial S_{rc} = P_{rc'} (\delta_{cc'} - P_{rc})$, so
#
# $$
# dS_{rc} = \sum_{c'} dP_{rc'} P_{rc'} (\delta_{cc'} - P_{rc})
#         = P_{rc} \Big( dP_{rc} - \underbrace{\textstyle\sum_{c'} P_{rc'}\, dP_{rc'}}_{D_r} \Big).
# $$
#
# $D_r$ looks as if it needs the whole row of $P$. It does not:
# $D_r = \sum_{c'} P_{rc'} (dO_r \cdot V_{c'}) = dO_r \cdot \sum_{c'} P_{rc'} V_{c'} = dO_r \cdot O_r$,
# so $D = \operatorname{rowsum}(dO \circ O)$, from two $N \times d$ arrays the backward has anyway.
#
# **Through $S = \tau Q K^\top$:**
# $$dQ = \tau\, dS\, K, \qquad dK = \tau\, dS^\top Q .$$
#
# **Recomputing $P$.** The forward saved $L_r = m_r + \log \ell_r$. Then
# $e^{S_{rc} - L_r} = e^{S_{rc} - m_r} / \ell_r = P_{rc}$: one `exp` per entry rebuilds any
# tile of $P$, with no max and no sum. That is why the forward returns $L$.
#
# The dense reference implements exactly these formulas:

# %%
print(inspect.getsource(reference.backward))

# %% [markdown]
# ## Checking the formulas with finite differences
#
# Take the loss $\mathcal{L} = \sum (dO \circ O)$, whose gradient with respect to $O$ is
# $dO$. For a random direction $E$, the central difference
# $(\mathcal{L}(Q + hE) - \mathcal{L}(Q - hE)) / 2h$ must match $\sum (dQ \circ E)$, and the
# same for $K$ and $V$. In float64 they agree to about eight digits or better.

# %%
q1, k1, v1 = (rng.standard_normal(s) for s in ((6, 4), (9, 4), (9, 4)))
do1 = rng.standard_normal((6, 4))
grads = reference.backward(do1, q1, k1, v1, causal=True)
h = 1e-6
for name, idx, g in zip(("dQ", "dK", "dV"), range(3), grads):
    E = rng.standard_normal(g.shape)
    args_p = [q1, k1, v1]
    args_m = [q1, k1, v1]
    args_p[idx] = args_p[idx] + h * E
    args_m[idx] = args_m[idx] - h * E
    fd = (np.sum(do1 * reference.forward(*args_p, causal=True)[0])
          - np.sum(do1 * reference.forward(*args_m, causal=True)[0])) / (2 * h)
    an = np.sum(g * E)
    print(f"{name}: finite difference {fd:+.10f}, analytic {an:+.10f}, "
          f"relative difference {abs(fd - an) / abs(an):.1e}")

# %% [markdown]
# ## Algorithm 2, and the three passes
#
# FlashAttention-2's Algorithm 2 (arXiv:2307.08691) in the paper's numbering, and where
# each line is in `tiled.backward`:
#
# | line | what it does | in `tiled.backward` |
# |---|---|---|
# | 1–3 | cut $Q$, $O$, $dO$, $L$ into $T_r$ tiles and $K$, $V$ into $T_c$; $dQ = 0$ | `Tr`, `Tc`, `dQ = np.zeros(...)` |
# | 4 | $D = \operatorname{rowsum}(dO \circ O)$ | `D` (pass 1) |
# | 5 | **for** each key/value tile $j$ (one thread block each) | `for j in range(Tc)` (pass 2) |
# | 6–7 | load $K_j$, $V_j$; $dK_j = dV_j = 0$ on chip | `Kj`, `Vj`, `dKj`, `dVj` |
# | 8 | **for** each query tile $i$ | `for i in range(first_q_tile(...), Tr)` |
# | 9 | load $Q_i$, $O_i$, $dO_i$, $dQ_i$, $L_i$, $D_i$ | `Qi`, `dOi`, `L_i`, `D_i` |
# | 10–11 | $S_{ij} = Q_i K_j^\top$, $P_{ij} = e^{S_{ij} - L_i}$ | `_probabilities_and_dS` |
# | 12 | $dV_j \mathrel{+}= P_{ij}^\top dO_i$ | `dVj += ...` |
# | 13–14 | $dP_{ij} = dO_i V_j^\top$, $dS_{ij} = P_{ij} \circ (dP_{ij} - D_i)$ | `_probabilities_and_dS` |
# | 15 | $dQ_i \mathrel{+}= dS_{ij} K_j$, written back to HBM | pass 3, regrouped by $i$ |
# | 16 | $dK_j \mathrel{+}= dS_{ij}^\top Q_i$ | `dKj += ...` |
# | 17–19 | end for; write $dK_j$, $dV_j$; end for | `dK[cols] = ...`, `dV[cols] = ...` |
# | 20 | return $dQ$, $dK$, $dV$ | `return dQ, dK, dV` |
#
# Line 15 is the awkward one. Blocks own key/value tiles $j$, but $dQ_i$ collects a term from
# **every** $j$: all blocks add into the same rows of $dQ$ at once. On a GPU that needs atomic
# additions, whose order (and so the rounding of the sum) changes from run to run. The
# library's deterministic versions (v1; v3 and v4, register-blocked; v5 and v6 on the tensor
# cores, v6 the default on a GPU) instead run a third pass that owns the query tiles and
# recomputes $S_{ij}$, $P_{ij}$, $dP_{ij}$ there; v2 follows the paper with atomics, as a
# lesson.

# %%
print(inspect.getsource(tiled.backward))

# %%
def draw_pass(ax, Tr, Tc, title, owner):
    """The (i, j) tile grid; arrows show which block walks which tiles."""
    ax.add_patch(Rectangle((0, 0), Tc, Tr, fill=False))
    for t in range(1, Tc):
        ax.plot([t, t], [0, Tr], "k", lw=0.4)
    for t in range(1, Tr):
        ax.plot([0, Tc], [t, t], "k", lw=0.4)
    colors = plt.cm.tab10.colors
    if owner == "column":                       # block j walks down its column of tiles
        for j in range(Tc):
            ax.add_patch(FancyArrowPatch((j + 0.5, 0.15), (j + 0.5, Tr - 0.15), color=colors[j],
                                         arrowstyle="->", mutation_scale=12, lw=2))
            ax.text(j + 0.5, -0.3, f"block {j}", ha="center", fontsize=8, color=colors[j])
    elif owner == "row":                        # block i walks along its row of tiles
        for i in range(Tr):
            ax.add_patch(FancyArrowPatch((0.15, i + 0.5), (Tc - 0.15, i + 0.5), color=colors[i],
                                         arrowstyle="->", mutation_scale=12, lw=2))
            ax.text(-0.1, i + 0.5, f"block {i}", ha="right", va="center", fontsize=8,
                    color=colors[i])
    else:                                       # column blocks, each adding into every dQ_i
        for j in range(Tc):
            ax.add_patch(FancyArrowPatch((j + 0.5, 0.15), (j + 0.5, Tr - 0.15), color=colors[j],
                                         arrowstyle="->", mutation_scale=12, lw=2))
            for i in range(Tr):                 # tile (i, j) adds its dS_ij K_j into dQ_i
                y = i + 0.2 + 0.6 * j / max(1, Tc - 1)
                ax.add_patch(FancyArrowPatch((j + 0.5, y), (Tc + 0.4, y), color=colors[j],
                                             alpha=0.6, arrowstyle="->", mutation_scale=8,
                                             lw=0.8))
        for i in range(Tr):
            ax.add_patch(Rectangle((Tc + 0.4, i + 0.1), 0.5, 0.8, color="gray", alpha=0.5))
            ax.text(Tc + 0.65, i + 0.5, f"dQ{i}", ha="center", va="center", fontsize=7)
    ax.set_xlim(-1.2, Tc + 1.1)
    ax.set_ylim(Tr + 0.2, -0.6)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(title, fontsize=10)


fig, axes = plt.subplots(1, 3, figsize=(13, 4))
draw_pass(axes[0], 4, 4, "v1 pass 2: dK, dV\n(block j owns K/V tile j)", "column")
draw_pass(axes[1], 4, 4, "v1 pass 3: dQ\n(block i owns Q tile i, recomputes P, dP)", "row")
draw_pass(axes[2], 4, 4, "v2: dK, dV and dQ in one pass\n(every block adds into every dQ_i: atomics)",
          "atomic")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Memory, measured
#
# As for the forward in notebook 01: `tracemalloc` measures the peak memory of the dense
# reference backward and of the tiled one, for one head, $d = 64$, float64.

# %%
def peak_bytes(fn, *args, **kwargs):
    tracemalloc.start()
    fn(*args, **kwargs)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


Ns = [128, 256, 512, 1024]
dense_peak, tiled_peak = [], []
for n in Ns:
    Qn, Kn, Vn, dOn = (rng.standard_normal((n, 64)) for _ in range(4))
    On, Ln = tiled.forward(Qn, Kn, Vn, Br=64, Bc=64)
    dense_peak.append(peak_bytes(reference.backward, dOn, Qn, Kn, Vn))
    tiled_peak.append(peak_bytes(tiled.backward, dOn, Qn, Kn, Vn, On, Ln, Br=64, Bc=64))
for n, a, b in zip(Ns, dense_peak, tiled_peak):
    print(f"N = {n:5d}: dense {a / 2**20:7.1f} MiB ({a / (8 * n * n):.1f} N x N matrices), "
          f"tiled {b / 2**20:6.2f} MiB")

# %% [markdown]
# ## Running the kernels
#
# `numbaflash.attention_vjp` runs the forward and returns a function for the backward
# (`attention_backward` is the same with `out` and `lse` passed by hand).
# `explain_backward` shows the kernels it launches, in order:

# %%
q = rng.standard_normal((B, H, Sq, d)).astype(np.float32)
k = rng.standard_normal((B, H, Sk, d)).astype(np.float32)
v = rng.standard_normal((B, H, Sk, d)).astype(np.float32)
dout = rng.standard_normal((B, H, Sq, d)).astype(np.float32)

print(numbaflash.explain_backward(q, k, v, tiles=TILES))

# %% [markdown]
# The check is TESTING.md's rule: each gradient's error against the float64 truth may be at
# most a multiple of the error of a naive float32 NumPy computation (dQ 5, dK 3, dV 3: dQ
# sums over the most terms), plus two ulps. A backward is given the forward's `out` and
# `lse`, rounded to float32, so the rule is applied as the test suite applies it
# (`tests/backward_checks.py`): the truth is the float64 gradient of the same float32
# inputs with $D$ taken from that `out`, and the naive baseline is Algorithm 2's formulas,
# dense, in float32, from the same `out` and `lse` ($P = e^{S - L}$). Against
# `reference.backward` run in float32 instead, whose softmax and $D$ are recomputed from
# $S$ and never rounded in between, a correct backward sometimes misses the rule (that
# file measured it on random shapes), so that comparison says nothing about the kernels.

# %%
def alg2_dense(P, Q, K, V, dO, O, scale):
    """Algorithm 2's formulas with the whole P at once (no tiles), in the arrays' dtype."""
    dV = np.swapaxes(P, -1, -2) @ dO                                  # Alg.2 l.12
    dP = dO @ np.swapaxes(V, -1, -2)                                  # l.13
    D = np.sum(dO * O, axis=-1, keepdims=True)                        # l.4
    dS = P * (dP - D)                                                 # l.14
    return scale * dS @ K, scale * np.swapaxes(dS, -1, -2) @ Q, dV    # l.15, l.16


def check_gradients(dout, q, k, v, out, lse, grads, causal=False):
    """TESTING.md's rule for float32 gradients from a backward given out and lse: prints
    each gradient's error and bound, and raises AssertionError if one is above it."""
    scale = 1 / np.sqrt(q.shape[-1])
    f64 = (np.asarray(a, np.float64) for a in (q, k, v, dout, out))
    ref = alg2_dense(reference.probabilities(q, k, causal=causal), *f64, scale)
    S, seen, _ = reference.scores(q, k, causal, np.float32(scale), dtype=np.float32)
    with np.errstate(invalid="ignore"):              # rows that see no key: -inf - (-inf)
        P32 = np.where(seen, np.exp(S - lse[..., None]), np.float32(0))
    base = alg2_dense(P32, q, k, v, dout, out, np.float32(scale))
    for name, g, r, b, mult in zip(("dQ", "dK", "dV"), grads, ref, base, (5, 3, 3)):
        err, base_err = np.abs(g - r).max(), np.abs(b - r).max()
        bound = mult * base_err + 2 * np.spacing(np.float32(np.abs(r).max()))
        print(f"  {name}: max error {err:.2e}, naive float32 {base_err:.2e}, bound {bound:.2e}")
        assert err <= bound, (f"{name}: max error {err:.2e} exceeds the bound {bound:.2e} "
                              f"({mult} x the naive float32 error + 2 ulps)")


out, vjp = numbaflash.attention_vjp(q, k, v, forward_tiles=TILES, backward_tiles=TILES)
grads = vjp(dout)
_, lse = numbaflash.attention(q, k, v, return_lse=True, tiles=TILES)   # the same forward's lse
check_gradients(dout, q, k, v, out, lse, grads)

# %% [markdown]
# Two identities hold for any inputs and make quick sanity checks. Each row of $dS$ sums to
# zero ($\sum_c P_{rc}\, dP_{rc} - D_r \sum_c P_{rc} = D_r - D_r$), so **$dK$ summed over the
# keys is zero** (per head). Each row of $P$ that sees a key sums to one, so **$dV$ summed
# over the keys equals $dO$ summed over the queries**.

# %%
dq, dk, dv = grads
print("max |sum over keys of dK|      =", np.abs(dk.sum(axis=-2)).max())
print("max |sum dV - sum dO| (per head) =", np.abs(dv.sum(axis=-2) - dout.sum(axis=-2)).max())
# Zero up to float32 rounding: 1e-5 of the size of what is summed.
assert np.abs(dk.sum(axis=-2)).max() <= 1e-5 * np.abs(dk).sum(axis=-2).max(), \
    "dK summed over the keys is not zero"
assert np.abs(dv.sum(axis=-2) - dout.sum(axis=-2)).max() <= 1e-5 * np.abs(dout).sum(axis=-2).max(), \
    "dV summed over the keys is not dO summed over the queries"

# %% [markdown]
# ## Causal, and rows that see no key
#
# With bottom-right alignment and $N_q > N_k$ the first $N_q - N_k$ query rows see no key.
# Their output is 0, so nothing flows back through them: their $dQ$ rows are exactly 0.

# %%
q_long = rng.standard_normal((1, 1, Sk + 8, d)).astype(np.float32)
do_long = rng.standard_normal(q_long.shape).astype(np.float32)
o_c, vjp_c = numbaflash.attention_vjp(q_long, k[:1, :1], v[:1, :1], causal=True,
                                      forward_tiles=TILES, backward_tiles=TILES)
dq_c, dk_c, dv_c = vjp_c(do_long)
print("dQ rows of the 8 queries that see nothing are exactly 0:",
      bool((dq_c[0, 0, :8] == 0).all()))
assert (dq_c[0, 0, :8] == 0).all(), "a dQ row of a query that sees no key is not exactly 0"
_, lse_c = numbaflash.attention(q_long, k[:1, :1], v[:1, :1], causal=True, return_lse=True,
                                tiles=TILES)
check_gradients(do_long, q_long, k[:1, :1], v[:1, :1], o_c, lse_c, (dq_c, dk_c, dv_c),
                causal=True)

# %% [markdown]
# ## v1 against v2
#
# The docstring of `numbaflash.kernels.backward` (one file per version under
# `numbaflash/kernels/backward/`) lists what each version changes:

# %%
print(bwd.__doc__)

# %%
out, lse = numbaflash.attention(q, k, v, return_lse=True, tiles=TILES)
by_version = {}
for version in bwd.VERSIONS:
    try:
        plans = numbaflash.explain_backward(q, k, v, version=version, tiles=TILES)
    except ValueError as err:           # e.g. v7: float16 and bfloat16 inputs only
        print(f"{version}: not run here ({err})")
        continue
    g = numbaflash.attention_backward(dout, q, k, v, out, lse, version=version, tiles=TILES)
    by_version[version] = g
    print(f"{version}: {len(plans)} kernels ({', '.join(p.kernel for p in plans)})")
    check_gradients(dout, q, k, v, out, lse, g)

# %% [markdown]
# v2 adds into $dQ$ with atomics. On a GPU the order of those additions depends on how the
# blocks happen to be scheduled, so repeated runs can differ in the last bits. The next cell
# repeats each version on a GPU and counts the distinct results; the simulator runs threads
# in Python's order, which says nothing about a GPU, so there it only says so.

# %%
if SIM:
    print("simulator: run this notebook on a GPU to see whether repeated runs agree bitwise")
else:
    for version in by_version:          # the versions that ran this input above
        runs = {numbaflash.attention_backward(dout, q, k, v, out, lse, version=version)[0].tobytes()
                for _ in range(20)}
        print(f"{version}: {len(runs)} distinct dQ bit patterns in 20 runs")

# %% [markdown]
# ## Exercise: $D$ and $dS$
#
# Write `my_dS(P, V, dO, O)` for one head: from the probabilities `P` $(N_q, N_k)$, the values
# `V` $(N_k, d)$, the upstream gradient `dO` and the output `O` (both $(N_q, d)$), return
# $dS$ $(N_q, N_k)$, the gradient with respect to the scores (before the scale).
#
# **How this exercise works:** the next cell is yours: replace `raise NotImplementedError`
# with your code and run it, then run the checking cell after it.
# It compares with the formulas of `reference.backward` and recognises the usual mistakes
# (until you have written it, it says "not attempted yet"). A solution waits out of sight
# in `solutions.py`; the cell after the checker shows it when you ask.

# %%
def my_dS(P, V, dO, O):
    # your code here: dP (Alg.2 l.13), D (l.4), then dS (l.14)
    raise NotImplementedError


# %%
def check_dS(fn):
    """Compare fn with the reference formulas; raise AssertionError saying what is wrong."""
    Qx, Kx, Vx, dOx = (rng.standard_normal(s) for s in ((7, 5), (11, 5), (11, 5), (7, 5)))
    P = reference.probabilities(Qx, Kx)
    O = P @ Vx
    try:
        got = np.asarray(fn(P, Vx, dOx, O))
    except NotImplementedError:
        print("not attempted yet: write my_dS above and run this cell again")
        return
    dP = dOx @ Vx.T
    D = np.sum(dOx * O, axis=1)
    want = P * (dP - D[:, None])
    if got.shape != want.shape:
        raise AssertionError(f"dS has shape {got.shape}; expected {want.shape} (Nq, Nk), like P")
    if np.allclose(got, want, rtol=1e-12, atol=1e-12):
        print("dS matches; its rows sum to", np.abs(got.sum(axis=1)).max(), "(zero, up to rounding)")
        return
    hints = [(P * dP, "D is missing: dS = P * (dP - D), with D = rowsum(dO * O)"),
             (P * (D[:, None] - dP), "the sign is flipped: dS = P * (dP - D)"),
             (P * (dP - dP.sum(axis=1, keepdims=True)),
              "D is rowsum(dP); it is rowsum(P * dP), which equals rowsum(dO * O)"),
             (dP - D[:, None], "the factor P is missing: dS = P * (dP - D)")]
    for wrong, hint in hints:
        if np.allclose(got, wrong, rtol=1e-12, atol=1e-12):
            raise AssertionError(hint)
    raise AssertionError(f"max |dS - expected| = {np.abs(got - want).max():.2e}; its rows should "
                         f"sum to zero and they sum to up to {np.abs(got.sum(axis=1)).max():.2e}")


check_dS(my_dS)

# %% [markdown]
# Stuck, or done and curious? Uncomment these lines and run them to see a solution; the
# last one puts it in place of yours (run the checking cell again after it).

# %%
# import solutions
# solutions.show("my_dS")
# my_dS = solutions.my_dS

# %% [markdown]
# ## Dropout: randomness the backward can recompute
#
# Attention dropout zeroes each probability with chance $p$ and scales the survivors by
# $1/(1-p)$: $O = (P \circ Z / (1-p))\, V$, with $Z$ a random 0/1 matrix. The backward needs
# the same $Z$: $dV = (P \circ Z/(1-p))^T dO$ and $dP = (dO\, V^T) \circ Z / (1-p)$.
# Storing $Z$ would bring back exactly what FlashAttention removed, an $N \times N$ matrix per
# head:

# %%
B, H, N = 2, 16, 16384
inputs = 3 * B * H * N * 64 * 2                 # q, k, v in float16 at d = 64
mask = B * H * N * N                            # one byte per entry (a bool)
print(f"q, k, v: {inputs / 2**20:,.0f} MiB; a stored dropout mask: {mask / 2**30:,.1f} GiB")

# %% [markdown]
# So the kernels *regenerate* $Z$ instead. The trick is a **counter-based** random number
# generator: a function that maps a counter and a key to random bits, with no state carried
# from one call to the next. Philox-4x32-10 (Salmon et al., 2011) takes four 32-bit counter
# words and two key words and returns four random 32-bit words after ten rounds of
# multiply-and-xor. numbaflash uses the counter $(j \,//\, 4,\ i,\ h,\ b)$ and the seed as
# the key, and keeps entry $(b, h, i, j)$ iff word $j \bmod 4$ is below
# $\lfloor (1-p)\, 2^{32} \rfloor$. Any thread, in any kernel, with any tile size, can ask
# about any entry and gets the same answer, and the forward and the backward agree without
# sharing a byte.
#
# Here is the whole mask of a small problem, built by hand from the NumPy Philox:

# %%
from numbaflash.dropout import keep_threshold, seed_words

p, seed, Sq, Sk = 0.3, 2024, 6, 10
i, j = np.meshgrid(np.arange(Sq), np.arange(Sk), indexing="ij")
counter = np.stack([j // 4, i, np.zeros_like(i), np.zeros_like(i)], axis=-1)   # h = b = 0
words = reference.philox4x32(counter, np.array(seed_words(seed), dtype=np.uint32))
Z = np.take_along_axis(words, (j % 4)[..., None], axis=-1)[..., 0] < keep_threshold(p)
print(Z.astype(int))
print("kept:", Z.mean(), "(1 - p =", 1 - p, ")")
assert np.array_equal(Z, numbaflash.dropout_mask(1, 1, Sq, Sk, p, seed)[0, 0])

# %% [markdown]
# A kernel with dropout, checked against the dense reference given that mask
# (`numbaflash.attention(..., dropout_p, dropout_seed)`; the lse it returns is the
# undropped softmax's, which is what the backward needs):

# %%
rng = np.random.default_rng(5)
q, k, v = (rng.standard_normal((S, 8)).astype(np.float32) for S in (Sq, Sk, Sk))
out = numbaflash.attention(q, k, v, dropout_p=p, dropout_seed=seed)
want, _ = reference.forward(q, k, v, dropout_p=p, dropout_keep=Z)
print("max |kernel - reference| =", np.abs(out - want).max())
assert np.allclose(out, want, rtol=1e-5, atol=1e-5)

# %% [markdown]
# Regenerating costs arithmetic: ten rounds of two 32-bit multiplies per Philox call, next
# to a handful of tensor-core products per entry. One call answers for four neighbouring
# keys of one row, so the kernels try not to waste any of it. In the tensor-core kernels'
# register tiles a lane holds two keys of each of two rows: asking for its own entries it
# would call Philox twice and use half of each answer (and four times, using a quarter,
# in the backward's transposed tile). Instead each lane computes one block of four and
# swaps bits with the lanes that need the rest, through warp shuffles (`kept_rows` and
# `kept_keys` in `numbaflash/kernels/variants.py`): one call per lane and tile.
# docs/variants.md has what dropout costs on a GPU.

# %% [markdown]
# ---
# *For the test suite:* CI runs this notebook top to bottom, with the exercise above not
# yet written. This cell runs the same checker on the solution in `solutions.py`, without
# printing it, so a change that breaks the exercise, its checker or its solution fails the
# tests. You can skip it.

# %%
import solutions

check_dS(solutions.my_dS)
