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
# # 07 · Masks and score modifiers
#
# Causal attention was the first variant: a mask that hides the keys after the query.
# Models use many more: sliding windows, documents packed into one sequence, ALiBi's
# distance penalty, Gemma's soft cap, grouped-query attention, and masks or biases of
# their own. FlexAttention's idea, which numbaflash follows, is that all of them change
# only two small functions of the kernel:
#
# * **visible**(b, h, row, col): may query `row` see key `col`? Hidden entries are
#   never computed;
# * **score**(s, b, h, row, col): the score of a visible entry, from $s = \tau\, q \cdot k$
#   (and, for the backward, its derivative with respect to $s$).
#
# Both are Numba device functions built by `numbaflash/kernels/variants.py` and compiled
# into the kernels by their factories, so one kernel family serves every variant, and
# your own functions go in the same way. This notebook shows the built-ins, what the
# kernels skip, and a user-defined mask and bias, each checked against the float64
# reference. It runs on the simulator (small shapes) or a GPU.

# %%
import sys

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Rectangle
from numba import cuda, float32

import numbaflash
from numbaflash import launcher, policy, reference
from numbaflash.api import _variant_arrays
from numbaflash.masks import visible_band
from numbaflash.validate import check_attention_inputs

BACKEND = numbaflash.backend()
SIM = BACKEND == "simulator"
if SIM:
    sys.setswitchinterval(2e-4)          # cheaper barriers in the simulator (see notebook 04)
    B, H, S, d = 1, 2, 48, 8
    TILES = (8, 8)
else:
    B, H, S, d = 2, 8, 2048, 64
    TILES = None
print(f"backend: {BACKEND}; q, k, v (B, H, S, d) = {(B, H, S, d)}, tiles = {TILES or 'default'}")
rng = np.random.default_rng(0)
q, k, v, dout = (rng.standard_normal((B, H, S, d)).astype(np.float32) for _ in range(4))


def max_rel_err(got, want):
    """max |got - want| / max |want| (want in float64)."""
    return float(np.max(np.abs(np.asarray(got, np.float64) - want)) / np.max(np.abs(want)))


# The checks of notebooks 04 and 05 (TESTING.md's rule), with the variants: each error
# against the float64 truth at most a multiple of a naive float32 computation's, + 2 ulps.
def within_rule(name, got, want, base, mult):
    err, base_err = np.abs(got - want).max(), np.abs(base - want).max()
    bound = mult * base_err + 2 * np.spacing(np.float32(np.abs(want).max()))
    assert err <= bound, (f"{name}: max error {err:.2e} exceeds the bound {bound:.2e} "
                          f"({mult} x the naive float32 error {base_err:.2e} + 2 ulps)")


def check_forward(outs, q, k, v, **variants):
    """Each of ``outs`` ({name: out}) against the float64 reference by the rule (mult 2);
    prints each relative error."""
    want = reference.forward(q, k, v, **variants)[0]
    base = reference.forward(q, k, v, dtype=np.float32, **variants)[0]
    for name, out in outs.items():
        print(f"{name}: max relative error vs float64 reference {max_rel_err(out, want):.1e}")
        within_rule(name, out, want, base, 2)


def alg2_dense(P, G, q, k, v, dO, O, scale):
    """Algorithm 2's formulas with the whole P at once, in the arrays' dtype (notebook 05),
    dS times G = d score / d (scale q.k); GQA: dK, dV summed over each group's heads."""
    K, V = reference.expand_kv(q, k), reference.expand_kv(q, v)
    dV = np.swapaxes(P, -1, -2) @ dO
    dS = P * (dO @ np.swapaxes(V, -1, -2) - np.sum(dO * O, axis=-1, keepdims=True)) * G
    dK = scale * np.swapaxes(dS, -1, -2) @ q
    return (scale * dS @ K, reference.reduce_kv(dK, np.shape(k)),
            reference.reduce_kv(dV, np.shape(k)))


def check_backward(name, dout, q, k, v, out, lse, grads, **variants):
    """out (mult 2) and (dq, dk, dv) from a backward given out and lse (dQ 5, dK 3, dV 3),
    by the rule as notebook 05 applies it; prints each relative error."""
    scale = 1 / np.sqrt(q.shape[-1])
    S, seen, G = reference.scores(q, k, scale=scale, **variants)            # float64
    P = reference._softmax_rows(S, seen)[0]
    q64, k64, v64, do64, o64 = (np.asarray(a, np.float64) for a in (q, k, v, dout, out))
    want = [P @ reference.expand_kv(q64, v64), *alg2_dense(P, G, q64, k64, v64, do64, o64, scale)]
    S, seen, G = reference.scores(q, k, scale=np.float32(scale), dtype=np.float32, **variants)
    base_out = reference._softmax_rows(S, seen)[0] @ reference.expand_kv(q, v)
    with np.errstate(invalid="ignore"):              # rows that see no key: -inf - (-inf)
        P = np.where(seen, np.exp(S - lse[..., None]), np.float32(0))
    base = [base_out, *alg2_dense(P, G, q, k, v, dout, out, np.float32(scale))]
    print(f"{name}:")
    for what, g, w, b, mult in zip(("out", "dq", "dk", "dv"), (out, *grads), want, base,
                                   (2, 5, 3, 3)):
        print(f"  {what}: max relative error {max_rel_err(g, w):.1e}")
        within_rule(what, g, w, b, mult)


# %% [markdown]
# ## Sliding windows
#
# `window_size=(left, right)` is flash-attention's argument: query $i$ sees keys $j$ with
# $i + S_k - S_q - \text{left} \le j \le i + S_k - S_q + \text{right}$ ($-1$: no bound on
# that side). With `causal=True` the right side is 0. Each side is one comparison in
# `visible`; the bounds of the band also tell each block which K/V tiles to visit, by
# arithmetic, so tiles outside the band are never loaded.

# %%
fig, axes = plt.subplots(1, 3, figsize=(11, 3.6))
for ax, (title, causal, window) in zip(axes, [
        ("causal", True, None), ("window (6, 0), causal", True, (6, 0)),
        ("window (4, 4), Sq < Sk", False, (4, 4))]):
    Sq, Sk = (16, 16) if "Sq <" not in title else (12, 20)
    ax.imshow(visible_band(Sq, Sk, causal, window), cmap="Blues", vmin=0, vmax=1.4)
    ax.set_title(title)
    ax.set_xlabel("key j")
    ax.set_ylabel("query i")
plt.tight_layout()
plt.show()

# %%
out = numbaflash.attention(q, k, v, causal=True, window_size=(8, 0), tiles=TILES)
check_forward({"window (8, 0) + causal": out}, q, k, v, causal=True, window_size=(8, 0))
print(numbaflash.explain(q, k, v, causal=True, window_size=(8, 0), tiles=TILES))

# %% [markdown]
# ## Masks that are not bands: the tile table
#
# A document mask (several documents packed into one sequence, each attending only to
# itself) hides whole tiles far from the diagonal, but not by a rule the kernel can
# work out from two offsets. So when the call has a boolean `attn_mask` or a `mask_mod`,
# numbaflash first runs a small kernel, `tile_table`, that evaluates the mask once per
# entry and records, per (query head, Q tile, K/V tile), whether any entry is visible.
# The attention kernels look the table up at the top of their tile loop and skip the
# empty tiles entirely. This is FlexAttention's *block mask*, built per call for the
# kernel's own tile sizes.
#
# A mask as a Python function: a Numba device function of (b, h, q_idx, kv_idx).

# %%
DOC = S // 4 + 3                         # documents that do not line up with the tiles


@cuda.jit(device=True)
def same_document(b, h, q_idx, kv_idx):
    return q_idx // DOC == kv_idx // DOC


# The table the kernels would use (the tile sizes are the forward's).
p = check_attention_inputs(q, k, v, mask_mod=same_document)
plan = policy.plan_forward(p, tiles=TILES)
table = launcher.tile_table(p, plan.Br, plan.Bc, _variant_arrays(p)[1]).copy_to_host()[0]
mask = np.fromfunction(lambda i, j: i // DOC == j // DOC, (S, S), dtype=int)
print(f"tiles (Br, Bc) = ({plan.Br}, {plan.Bc}): {int(table.sum())} of {table.size} tiles "
      f"visited ({table.mean():.0%}); entries visible: {mask.mean():.0%}")

fig, ax = plt.subplots(figsize=(5.2, 5.2))
ax.imshow(mask, cmap="Blues", vmin=0, vmax=1.4, interpolation="nearest")
for i in range(table.shape[0]):
    for j in range(table.shape[1]):
        if not table[i, j]:
            ax.add_patch(Rectangle((j * plan.Bc - 0.5, i * plan.Br - 0.5), plan.Bc, plan.Br,
                                   facecolor="0.85", edgecolor="white", hatch="//"))
        else:
            ax.add_patch(Rectangle((j * plan.Bc - 0.5, i * plan.Br - 0.5), plan.Bc, plan.Br,
                                   fill=False, edgecolor="tab:orange", lw=0.8))
ax.set_title("document mask: visited tiles (orange), skipped (hatched)")
ax.set_xlabel("key j")
ax.set_ylabel("query i")
plt.show()

# %%
out = numbaflash.attention(q, k, v, mask_mod=same_document, tiles=TILES)
# The same mask as a boolean array (True: attend), broadcast over batch and heads.
out_b = numbaflash.attention(q, k, v, attn_mask=mask, tiles=TILES)
check_forward({"mask_mod forward": out, "attn_mask (S, S) forward": out_b}, q, k, v,
              mask_mod=same_document)

# %% [markdown]
# ## Score modifiers and their gradients
#
# The built-ins, in the order they apply to a visible score $s = \tau\, q\cdot k$:
# `softcap` ($c \tanh(s / c)$, derivative $1 - \tanh^2(s/c)$), `alibi_slopes`
# ($-m_h\,|i + S_k - S_q - j|$), a float `attn_mask` (added) and your `score_mod`. The
# backward multiplies $dS$ by the derivative of the whole chain; a `score_mod` brings its
# own, `score_mod_grad`, and without it the backward refuses with a clear error.
#
# A relative-position bias per head, with its derivative (1: the bias does not depend on
# the score). Constants are `float32`, so the float32 kernel stays in float32.

# %%
@cuda.jit(device=True)
def relative_bias(score, b, h, q_idx, kv_idx):
    return score - float32(0.1) * float32(h + 1) * float32(abs(q_idx - kv_idx))


@cuda.jit(device=True)
def relative_bias_grad(score, b, h, q_idx, kv_idx):
    return float32(1)


mods = dict(softcap=5.0, score_mod=relative_bias, score_mod_grad=relative_bias_grad,
            mask_mod=same_document)
out, lse = numbaflash.attention(q, k, v, return_lse=True, tiles=TILES, **mods)
grads = numbaflash.attention_backward(dout, q, k, v, out, lse, tiles=TILES, **mods)
check_backward("softcap + relative bias + documents", dout, q, k, v, out, lse, grads, **mods)
try:
    numbaflash.attention_backward(dout, q, k, v, out, lse, score_mod=relative_bias)
except ValueError as e:
    print("without score_mod_grad:", e)

# %% [markdown]
# ## Grouped-query attention
#
# With fewer K/V heads than query heads (GQA; one K/V head is MQA), query head $h$ reads
# K/V head $h // (H_q / H_{kv})$ through the index: K and V are never copied. In the
# backward, the block of a K/V tile walks the query heads of its group one after
# another, so $dK$ and $dV$ are summed over the group in a fixed order, without atomics.

# %%
k1, v1 = k[:, :1].copy(), v[:, :1].copy()            # MQA: one K/V head for all H
out, lse = numbaflash.attention(q, k1, v1, causal=True, return_lse=True, tiles=TILES)
dq, dk, dv = numbaflash.attention_backward(dout, q, k1, v1, out, lse, causal=True, tiles=TILES)
print(f"MQA: dk shape {dk.shape} (one head)")
assert dk.shape == k1.shape and dv.shape == v1.shape, "dK and dV must have K's and V's shape"
check_backward("MQA, causal", dout, q, k1, v1, out, lse, (dq, dk, dv), causal=True)

# %% [markdown]
# ## What skipping buys (GPU only)
#
# On a GPU the cost of attention is the number of tiles visited. A sliding window of
# $w$ keys visits about $(w + B_r)/B_c + 1$ tiles per Q tile instead of up to $N/B_c$,
# and a document mask about one tile row per document. Timed here at (1, 8, 8192, 64). At
# N = 16384 on an H200, on the default kernels: docs/variants.md, "On the H200", has the
# window against full causal attention and every variant against what you would run
# otherwise, with the command that measured them.

# %%
if not SIM:
    from numbaflash import bench
    N = 8192
    qg, kg, vg = (cuda.to_device(rng.standard_normal((1, 8, N, 64)).astype(np.float32))
                  for _ in range(3))

    @cuda.jit(device=True)
    def documents_512(b, h, q_idx, kv_idx):
        return q_idx // 512 == kv_idx // 512

    runs = {"full": {}, "causal": dict(causal=True),
            "window (256, 0) + causal": dict(causal=True, window_size=(256, 0)),
            "documents of 512 (mask_mod)": dict(mask_mod=documents_512)}
    ms = {name: bench.time_ms(lambda kw=kw: numbaflash.attention(qg, kg, vg, **kw), repeats=5)
          for name, kw in runs.items()}
    for name, t in ms.items():
        print(f"{name:30s} {t:8.2f} ms   {ms['full'] / t:5.1f}x faster than full")
else:
    print("on the simulator: times would measure Python, not a GPU (see notebook 06)")
