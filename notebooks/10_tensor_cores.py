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
# # 10 · Tensor cores from Numba
#
# Forward v2 (notebook 04) multiplies $Q_i K_j^T$ and $\tilde P_{ij} V_j$ one fused
# multiply-add at a time, each thread on its own. The fast rungs of the ladder, v3 and v6
# to v9, hand both products to the **tensor cores**: units that compute a whole small
# matrix product per instruction, `mma.sync`, issued by a warp of 32 threads together.
# numba-cuda has no API for them, so `numbaflash/kernels/ptx.py` writes the instructions as
# inline PTX, through Numba's `@intrinsic` and llvmlite's `InlineAsm`. This notebook shows
#
# 1. the fragment layout: which lane of the warp holds which elements of $A$, $B$ and
#    $C$/$D$, for `m16n8k8` (TF32) and `m16n8k16` (float16, bfloat16), drawn;
# 2. one $16 \times 8 \times 16$ product by inline PTX (`ptx.mma_f16`) in a one-warp
#    kernel, checked against NumPy, and the same bookkeeping in NumPy alone; then
#    `ldmatrix`, which loads whole fragments from shared memory (forward v10);
# 3. the 3xTF32 split that gives the float32 kernels float32 accuracy from TF32 inputs;
# 4. the rounding of $\tilde P$ to float16 or bfloat16 before $\tilde P V$, and why the
#    row sum $\ell$ adds the unrounded float32 $\tilde P$;
# 5. what each rung measured on an H200, read from the lab records.
#
# It runs on the simulator or a GPU. On the simulator there is no inline PTX:
# `numbaflash/kernels/simulated.py` stands in for each instruction, with the GPU's
# fragment layouts and operand rounding, and the 32 lanes of a warp meet in Python to
# compute the product together.

# %%
import inspect
import sys
from pathlib import Path

import matplotlib.pyplot as plt
import ml_dtypes
import numpy as np
from numba import cuda

import numbaflash
from numbaflash import reference
from numbaflash.kernels import ptx, simulated

BACKEND = numbaflash.backend()          # "gpu", or "simulator" under NUMBA_ENABLE_CUDASIM=1
if BACKEND == "simulator":
    sys.setswitchinterval(2e-4)          # cheaper warp rendezvous in the simulator (see 04)
print(f"backend: {BACKEND}")
rng = np.random.default_rng(0)
ROOT = Path(numbaflash.__file__).resolve().parent.parent


def source_of(module, start, stop=None):
    """The source of ``module`` from the first occurrence of ``start`` up to (not
    including) the next occurrence of ``stop`` (or the module's end)."""
    text = inspect.getsource(module)
    i = text.index(start)
    j = text.index(stop, i + len(start)) if stop else len(text)
    return text[i:j].rstrip() + "\n"


# %% [markdown]
# ## 1. The fragment layout
#
# One `mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32` computes $D = A B + C$ with $A$
# $16 \times 8$, $B$ $8 \times 8$, $C$ and $D$ $16 \times 8$. No thread holds a matrix: each
# of the 32 lanes holds a few elements of each (its *fragments*) in its own registers, and
# passes them to the instruction. Which elements is fixed by the PTX ISA; `ptx.py`'s
# docstring writes it with $g$ = `lane // 4` (the lane's *group*, 0..7) and $t$ =
# `lane % 4` (its place in the group, 0..3):

# %%
def layout_section(doc, heading):
    """The docstring's paragraph that starts with heading, and the indented table under it."""
    paragraphs = doc[doc.index(heading):].split("\n\n")
    n = 1
    while n < len(paragraphs) and paragraphs[n].startswith(" "):
        n += 1
    return "\n\n".join(paragraphs[:n])


print(layout_section(ptx.__doc__, "Fragment layout of m16n8k8"), end="\n\n")
print(layout_section(ptx.__doc__, "Fragment layout of m16n8k16"))

# %% [markdown]
# The same, as NumPy index tables: for each matrix, `rows[lane, r]` and `cols[lane, r]`
# are where register (or half-register) `r` of `lane` sits. For `m16n8k16` each 32-bit
# register of $A$ and $B$ holds two 16-bit values, the lower column (of $A$) or row (of
# $B$) in the low half, so $A$ has 8 values per lane and $B$ 4. bfloat16 uses the same
# layout with its own instruction (`.bf16` in place of `.f16`).

# %%
LANES = np.arange(32)
G, T = LANES // 4, LANES % 4             # lane = 4 g + t


def layout_m16n8k8():
    """Where each lane's fragments sit for mma.m16n8k8 (TF32): {name: (rows, cols,
    shape)}, rows and cols (32, registers) int arrays, for A (16, 8), B (8, 8) and C/D
    (16, 8)."""
    return {
        "A": (np.stack([G, G + 8, G, G + 8], 1), np.stack([T, T, T + 4, T + 4], 1),
              (16, 8)),
        "B": (np.stack([T, T + 4], 1), np.stack([G, G], 1), (8, 8)),
        "C": (np.stack([G, G, G + 8, G + 8], 1),
              np.stack([2 * T, 2 * T + 1, 2 * T, 2 * T + 1], 1), (16, 8)),
    }


def layout_m16n8k16():
    """The same for mma.m16n8k16 (float16, bfloat16), by 16-bit value: A (16, 16) 8 values
    a lane (value 2r + h is half h of register a_r), B (16, 8) 4 values, C/D (16, 8) 4."""
    return {
        "A": (np.stack([G, G, G + 8, G + 8, G, G, G + 8, G + 8], 1),
              np.stack([2 * T, 2 * T + 1] * 2 + [2 * T + 8, 2 * T + 9] * 2, 1), (16, 16)),
        "B": (np.stack([2 * T, 2 * T + 1, 2 * T + 8, 2 * T + 9], 1), np.stack([G] * 4, 1),
              (16, 8)),
        "C": layout_m16n8k8()["C"],
    }


def owners(rows, cols, shape):
    """(lane, register) holding each element of a shape matrix; checks that every element
    is held by exactly one lane."""
    lane, reg = np.full(shape, -1), np.full(shape, -1)
    held = np.zeros(shape, int)
    np.add.at(held, (rows, cols), 1)
    assert (held == 1).all(), "an element is held by no lane, or by two"
    lane[rows, cols] = LANES[:, None]
    reg[rows, cols] = np.arange(rows.shape[1])[None, :]
    return lane, reg


for name, layout in (("m16n8k8", layout_m16n8k8()), ("m16n8k16", layout_m16n8k16())):
    print(name, {m: f"{shape}, {rows.shape[1]} per lane" for m, (rows, cols, shape)
                 in layout.items()}, "- every element held once")
    for rows, cols, shape in layout.values():
        owners(rows, cols, shape)

lane_A, _ = owners(*layout_m16n8k8()["A"])
print("\nm16n8k8: the lane that holds each element of A (16 x 8):")
print("\n".join(" ".join(f"{x:2d}" for x in row) for row in lane_A))

# %% [markdown]
# Drawn, each cell holding its lane and register, coloured by the lane's group $g$:

# %%
def draw_layout(axes, layout, title, halves=False):
    """One panel per matrix: each element's lane (large) and register (small)."""
    colors = 0.5 + 0.5 * plt.cm.tab10(np.arange(8))      # light, so the text reads
    for ax, (name, (rows, cols, shape)) in zip(axes, layout.items()):
        lane, reg = owners(rows, cols, shape)
        ax.imshow(colors[lane // 4], aspect="equal")
        letter = "c" if name == "C" else name.lower()
        for (i, j), who in np.ndenumerate(lane):
            r = reg[i, j] // 2 if halves and name != "C" else reg[i, j]
            ax.text(j, i - 0.12, who, ha="center", va="center", fontsize=7)
            ax.text(j, i + 0.3, f"{letter}{r}", ha="center", va="center", fontsize=5.5)
        ax.set_xticks(range(shape[1]))
        ax.set_yticks(range(shape[0]))
        ax.tick_params(labelsize=6, length=0)
        what = "C and D" if name == "C" else name
        ax.set_title(f"{title}: {what} {shape[0]} x {shape[1]}", fontsize=9)


fig, axes = plt.subplots(2, 3, figsize=(12, 9.5),
                         gridspec_kw={"width_ratios": [16, 8, 8]})
draw_layout(axes[0], layout_m16n8k8(), "m16n8k8 (TF32)")
k16_AB = {name: where for name, where in layout_m16n8k16().items() if name != "C"}
draw_layout(axes[1, :2], k16_AB, "m16n8k16 (f16, bf16)", halves=True)
axes[1, 2].axis("off")
axes[1, 2].text(0.5, 0.5, "m16n8k16: C and D\nas m16n8k8 above", ha="center", va="center")
fig.tight_layout()
plt.show()

# %% [markdown]
# A group $g$ (one colour: lanes $4g$ to $4g+3$, a *quad*) holds rows $g$ and $g+8$ of $A$
# and of $C$/$D$, and column $g$ of $B$. Within the quad, lane $t$ holds columns $2t$ and
# $2t+1$ of $C$ and $D$. So the four lanes that share a row of scores are one quad, which
# is why the kernels find a row's max and sum with shuffles between the 4 lanes of a quad
# (`kernels/warp.py`), not across the warp.
#
# ## 2. One product by inline PTX
#
# `ptx.mma_f16` is an `@intrinsic`: when Numba compiles a call to it, `codegen` emits the
# instruction as inline PTX, with its operands in registers (`r` a 32-bit integer
# register, `f` a float32 one). One factory makes it for float16 and for bfloat16
# (`ptx.mma_bf16`), another the packing of two float32 values into one word:

# %%
print(source_of(ptx, "def _mma_m16n8k16(kind):", "mma_f16 = "))
print(source_of(ptx, "mma_f16 = ", "\n\n\n"))

# %% [markdown]
# A kernel of one warp that multiplies one tile. This one is for the notebook, not the
# library: each lane reads its fragments from global memory by the layout above, packs
# two float16 values per word, and issues the instruction; each lane gets back its four
# elements of $D$ and writes them where the layout says. (The library's kernels read
# their fragments from shared tiles: `kernels/forward/v7_float16.py`.)

# %%
@cuda.jit
def mma_16x8x16(A, B, C, D):
    """D = A B + C for one m16n8k16 tile, by one warp of 32 threads: A (16, 16), B (16, 8),
    C and D (16, 8), float32 arrays; A and B are rounded to float16 on the way in."""
    lane = cuda.threadIdx.x
    g = lane // 4
    t = lane % 4
    # A's fragments: rows g and g + 8, columns 2t, 2t + 1 and 2t + 8, 2t + 9
    a0 = ptx.pack_f16x2(A[g, 2 * t], A[g, 2 * t + 1])
    a1 = ptx.pack_f16x2(A[g + 8, 2 * t], A[g + 8, 2 * t + 1])
    a2 = ptx.pack_f16x2(A[g, 2 * t + 8], A[g, 2 * t + 9])
    a3 = ptx.pack_f16x2(A[g + 8, 2 * t + 8], A[g + 8, 2 * t + 9])
    # B's: column g, rows 2t, 2t + 1 and 2t + 8, 2t + 9
    b0 = ptx.pack_f16x2(B[2 * t, g], B[2 * t + 1, g])
    b1 = ptx.pack_f16x2(B[2 * t + 8, g], B[2 * t + 9, g])
    # every lane of the warp issues it; the tensor cores exchange the fragments
    d0, d1, d2, d3 = ptx.mma_f16(a0, a1, a2, a3, b0, b1,
                                 C[g, 2 * t], C[g, 2 * t + 1], C[g + 8, 2 * t],
                                 C[g + 8, 2 * t + 1])
    D[g, 2 * t] = d0
    D[g, 2 * t + 1] = d1
    D[g + 8, 2 * t] = d2
    D[g + 8, 2 * t + 1] = d3


A = rng.standard_normal((16, 16)).astype(np.float32)
B = rng.standard_normal((16, 8)).astype(np.float32)
C = rng.standard_normal((16, 8)).astype(np.float32)
D_dev = cuda.to_device(np.full((16, 8), np.nan, np.float32))
mma_16x8x16[1, 32](cuda.to_device(A), cuda.to_device(B), cuda.to_device(C), D_dev)
D = D_dev.copy_to_host()

# The tensor cores multiply float16 values exactly and add in float32:
A16, B16 = A.astype(np.float16).astype(np.float64), B.astype(np.float16).astype(np.float64)
want = A16 @ B16 + C                     # float64
bound = 18 * np.finfo(np.float32).eps * (np.abs(A16) @ np.abs(B16) + np.abs(C))
err = np.abs(D - want)
print(f"max |D - (A B + C)| = {err.max():.1e}, against float32's rounding of the sums: "
      f"{(err / np.spacing(np.abs(want).astype(np.float32))).max():.2f} ulp at most")
assert (err <= bound).all(), "the kernel's D is not A B + C"
print(f"D is A B + C rounded to float32, bit for bit: "
      f"{np.array_equal(D, want.astype(np.float32))}")

# %% [markdown]
# On the simulator, `ptx.mma_f16` is `simulated.mma_f16`: the lanes meet, the last to
# arrive assembles $A$ and $B$ from the 32 lanes' words, multiplies in float64 and rounds
# each element of $D$ to float32 once, so $D$ equals the rounded exact result bit for bit.
# A GPU's tensor cores add in an order and with a rounding of their own: within a few
# float32 ulps of the sum, not always the same bits (the assertion above allows both).
#
# The same bookkeeping in NumPy alone. **Gather**: each lane takes its fragments from
# $A$, $B$ and $C$ by the layout. **Compute**: each lane's four elements of $D$.
# **Scatter**: each lane's $d_0 \ldots d_3$ back into the $16 \times 8$ matrix.

# %%
def gather(M, layout):
    """Each lane's fragments of M: (32, registers) values."""
    rows, cols, shape = layout
    assert M.shape == shape
    return M[rows, cols]


def warp_mma(a, b, c, layout):
    """What one mma does for the warp: each lane's d = its elements of A B + C, from the
    fragments a, b, c that all 32 lanes hand in (float64 sums, then float32)."""
    lane_A, reg_A = owners(*layout["A"])
    lane_B, reg_B = owners(*layout["B"])
    rows_C, cols_C, _ = layout["C"]
    K = lane_A.shape[1]
    d = np.empty(c.shape, np.float32)
    for lane in range(32):
        for r in range(c.shape[1]):
            i, j = rows_C[lane, r], cols_C[lane, r]
            # row i of A and column j of B, read from the lanes that hold them
            row = [a[lane_A[i, k], reg_A[i, k]] for k in range(K)]
            col = [b[lane_B[k, j], reg_B[k, j]] for k in range(K)]
            d[lane, r] = np.dot(row, col) + c[lane, r]
    return d


def scatter(d, layout):
    """The matrix whose elements the lanes' registers d hold."""
    rows, cols, shape = layout
    M = np.full(shape, np.nan, d.dtype)
    M[rows, cols] = d
    return M


k16 = layout_m16n8k16()
a, b, c = gather(A16, k16["A"]), gather(B16, k16["B"]), gather(C, k16["C"])
D_numpy = scatter(warp_mma(a, b, c, k16), k16["C"])
print(f"per lane: a {a.shape}, b {b.shape}, c {c.shape}; max |NumPy D - kernel D| = "
      f"{np.abs(D_numpy - D).max():.1e}")
assert np.allclose(D_numpy, D, rtol=0, atol=bound.max())

lane_A16, _ = owners(*k16["A"])
lane_B16, _ = owners(*k16["B"])
lane = 5
i, j = k16["C"][0][lane, 0], k16["C"][1][lane, 0]
print(f"lane {lane}'s d0 is D[{i}, {j}]: it needs row {i} of A, held by lanes "
      f"{sorted(set(lane_A16[i].tolist()))}, and column {j} of B, held by lanes "
      f"{sorted(set(lane_B16[:, j].tolist()))}")

# %% [markdown]
# No lane holds what its own outputs need: row $i$ of $A$ lives in one quad and column $j$
# of $B$ in another. That is why `mma.sync` is a warp-wide instruction (every lane must
# issue it, with the same shape and types) and why `warp_mma` above reads other lanes'
# fragments, which is what the simulator's stand-in does when the last lane arrives.
#
# ### Fragments straight from shared memory: `ldmatrix`
#
# The kernel above gathers each word of $B$ from two scattered elements. The library's
# kernels stage $K_j$ and $V_j$ in shared memory first, and v7 still reads each $B$ word
# with its own 32-bit load. Forward v10 uses **`ldmatrix`** instead, another warp-wide
# instruction: every lane names one row of 8 values (16 bytes) in shared memory, lanes
# $8m \ldots 8m+7$ giving rows 0 to 7 of matrix $m$, and `ldmatrix.x4` hands each lane
# one 32-bit register of each of the four $8 \times 8$ matrices, in exactly the layout of
# an `m16n8k16` operand: register $m$ of lane $(g, t)$ holds $M_m[g, 2t]$ and
# $M_m[g, 2t+1]$. `ptx.py` says it in full:

# %%
print(layout_section(ptx.__doc__, "Six more for forward v10").split("    cp_async16")[0].rstrip())

# %% [markdown]
# For $S = Q K_j^T$, $B[k, n] = K_j[n, k]$: a word of $B$ is two neighbouring columns of
# one key, a piece of a row of $K_j$ as it is stored, so the four matrices of one
# `ldmatrix.x4` (keys 0-7 and 8-15, columns 0-7 and 8-15) are $b_0, b_1$ of two n-tiles.
# For $\tilde P V_j$, $B[k, n] = V_j[k, n]$: two neighbouring *keys* of one column, a
# piece of a column of $V_j$; `.trans` transposes each matrix on the way, so $V_j$ stays
# row-major in shared memory too. And the accumulators of $S$ (the $C$ layout) are, packed
# two by two, the $A$ fragments of $\tilde P$ for the next product: a lane's scores never
# leave it. One warp, one $16 \times 16$ tile of each:

# %%
ROW = 24        # halves from one shared row to the next: 16 values and a 16-byte pad
TILE = 16 * ROW     # a 16-row tile (a shared array's size must be a constant)
ZERO = np.float32(0)


@cuda.jit
def scores_then_values(Q, K, V, S, O):
    """One warp: S = Q K^T and O = round16(S) V for 16 queries, 16 keys, d = 16 (float16
    values: Q as float32 that are float16 values, K and V float16; float32 outputs), every
    B word loaded by ldmatrix from K and V stored row-major in shared memory, as forward
    v10 does."""
    Ks = cuda.shared.array(TILE, np.float16, alignment=16)
    Vs = cuda.shared.array(TILE, np.float16, alignment=16)
    lane = cuda.threadIdx.x
    g = lane // 4
    t = lane % 4
    for e in range(lane, 256, 32):
        Ks[(e // 16) * ROW + e % 16] = K[e // 16, e % 16]
        Vs[(e // 16) * ROW + e % 16] = V[e // 16, e % 16]
    # Wait until both tiles are stored.
    cuda.syncthreads()
    q0 = ptx.pack_f16x2(Q[g, 2 * t], Q[g, 2 * t + 1])
    q1 = ptx.pack_f16x2(Q[g + 8, 2 * t], Q[g + 8, 2 * t + 1])
    q2 = ptx.pack_f16x2(Q[g, 2 * t + 8], Q[g, 2 * t + 9])
    q3 = ptx.pack_f16x2(Q[g + 8, 2 * t + 8], Q[g + 8, 2 * t + 9])
    m = lane // 8                            # the matrix this lane names a row of
    # S = Q K^T: matrix m is keys 8 (m // 2) .. + 7, columns 8 (m % 2) .. + 7 of K
    b0, b1, b2, b3 = ptx.ldmatrix_x4(Ks, (8 * (m // 2) + lane % 8) * ROW + 8 * (m % 2))
    s = ptx.mma_f16(q0, q1, q2, q3, b0, b1, ZERO, ZERO, ZERO, ZERO)    # keys 0-7
    u = ptx.mma_f16(q0, q1, q2, q3, b2, b3, ZERO, ZERO, ZERO, ZERO)    # keys 8-15
    S[g, 2 * t], S[g, 2 * t + 1], S[g + 8, 2 * t], S[g + 8, 2 * t + 1] = s
    S[g, 2 * t + 8], S[g, 2 * t + 9], S[g + 8, 2 * t + 8], S[g + 8, 2 * t + 9] = u
    # The C layout of S is the A layout of P: rows g, g + 8; keys 2t, 2t + 1 (+ 8)
    p0 = ptx.pack_f16x2(s[0], s[1])
    p1 = ptx.pack_f16x2(s[2], s[3])
    p2 = ptx.pack_f16x2(u[0], u[1])
    p3 = ptx.pack_f16x2(u[2], u[3])
    # O = P V: with .trans, matrix m is keys 8 (m % 2) .. + 7, columns 8 (m // 2) .. + 7
    b0, b1, b2, b3 = ptx.ldmatrix_x4_trans(Vs, (8 * (m % 2) + lane % 8) * ROW + 8 * (m // 2))
    o = ptx.mma_f16(p0, p1, p2, p3, b0, b1, ZERO, ZERO, ZERO, ZERO)    # columns 0-7
    w = ptx.mma_f16(p0, p1, p2, p3, b2, b3, ZERO, ZERO, ZERO, ZERO)    # columns 8-15
    O[g, 2 * t], O[g, 2 * t + 1], O[g + 8, 2 * t], O[g + 8, 2 * t + 1] = o
    O[g, 2 * t + 8], O[g, 2 * t + 9], O[g + 8, 2 * t + 8], O[g + 8, 2 * t + 9] = w


Q16, K16, V16 = (rng.standard_normal((16, 16)).astype(np.float16) for _ in range(3))
S_dev = cuda.to_device(np.full((16, 16), np.nan, np.float32))
O_dev = cuda.to_device(np.full((16, 16), np.nan, np.float32))
scores_then_values[1, 32](cuda.to_device(Q16.astype(np.float32)), cuda.to_device(K16),
                          cuda.to_device(V16), S_dev, O_dev)
S_kernel, O_kernel = S_dev.copy_to_host(), O_dev.copy_to_host()

eps32 = np.finfo(np.float32).eps
Qd, Kd, Vd = (X.astype(np.float64) for X in (Q16, K16, V16))
S_want = Qd @ Kd.T
assert (np.abs(S_kernel - S_want) <= 18 * eps32 * (np.abs(Qd) @ np.abs(Kd.T))).all()
P16 = S_kernel.astype(np.float16).astype(np.float64)       # the kernel's P, rounded to 16 bits
O_want = P16 @ Vd
assert (np.abs(O_kernel - O_want) <= 18 * eps32 * (np.abs(P16) @ np.abs(Vd))).all()
print(f"S = Q K^T: max error {np.abs(S_kernel - S_want).max():.1e}; "
      f"O = round16(S) V: max error {np.abs(O_kernel - O_want).max():.1e} "
      f"(within float32's rounding of the sums)")

# %% [markdown]
# Why `ROW` is 24 and not 16: shared memory serves 32 **banks** of 4 bytes at once, and
# `ldmatrix` reads a matrix's 8 rows of 16 bytes (4 banks each) in one go. Rows 32 bytes
# apart start on banks 0, 8, 16, 24, 0, ...: two rows share each bank and the read takes
# two passes. A 16-byte pad moves each row 12 banks on and the 8 rows cover all 32 banks
# once:

# %%
def ldmatrix_passes(row_halves):
    """How many passes one 8 x 8 ldmatrix read takes with rows row_halves 16-bit values
    apart: the most rows that share any one bank."""
    banks = [(r * row_halves * 2 // 4 + np.arange(4)) % 32 for r in range(8)]
    return np.bincount(np.concatenate(banks), minlength=32).max()


for row_halves in (16, 24):
    print(f"rows {row_halves} halves apart: {ldmatrix_passes(row_halves)} pass(es) a matrix")

# %% [markdown]
# ## 3. 3xTF32: float32 accuracy from TF32 products
#
# The float32 tensor cores take **TF32** inputs: float32's sign and 8 exponent bits, but
# only 10 of its 23 mantissa bits (11 significant bits in all, against 24). The
# instruction reads the top 19 bits of each 32-bit register and ignores the rest, so the
# kernels round first, with `cvt.rna.tf32.f32` (to nearest, ties away from zero):
# `ptx.tf32_round`. Its bit-level form, as the simulator and `ptx.tf32_round_finite` do
# it: add half of TF32's last place to the bits, then clear the 13 bits TF32 drops.
# In NumPy:

# %%
def tf32(x):
    """x (float32) rounded to TF32, to nearest, ties away from zero (cvt.rna.tf32.f32):
    add half of TF32's last place (bit 12) to the bits, clear the low 13; NaN and inf
    kept. A float32 array."""
    x = np.asarray(x, np.float32)
    bits = (x.view(np.uint32) + np.uint32(0x1000)) & np.uint32(0xFFFFE000)
    return np.where(np.isfinite(x), bits.view(np.float32), x)


def show_bits(name, x):
    """x's float32 bits: sign, exponent, and the mantissa with TF32's 10 bits apart."""
    s = f"{int(np.float32(x).view(np.uint32)):032b}"
    print(f"{name:>21} = {float(x):+.10e}   {s[0]} {s[1:9]} {s[9:19]} {s[19:]}")


samples = np.concatenate([rng.standard_normal(10000).astype(np.float32) * 100,
                          np.float32([1 + 2**-11, 1 + 3 * 2**-11, -(1 + 2**-11), 0, np.inf,
                                      -np.inf, np.nan])])     # ties round away from zero
same = [np.array_equal(np.float32(simulated.tf32_round(x)), tf32(x), equal_nan=True)
        for x in samples]
print(f"tf32() against the simulator's tf32_round on {len(samples)} values: all equal: "
      f"{all(same)}")
assert all(same)

print(source_of(ptx, "@cuda.jit(device=True, inline=True)\ndef split_tf32(",
                "@cuda.jit(device=True, inline=True)\ndef split_tf32_finite"))

# %% [markdown]
# `split_tf32` writes $x = \text{big} + \text{small}$ with both parts TF32: big is $x$
# rounded, small is what rounding left out, rounded again. $x - \text{big}$ is exact in
# float32 (it is $x$'s last 13 mantissa bits, give or take a carry), and small keeps 11
# significant bits of it, so big and small together carry about 22 of $x$'s 24:

# %%
x = np.float32(np.pi)
big = tf32(x)
small = tf32(x - big)
print(f"{'':44}s exponent {'TF32 keeps':10s} the 13 bits it drops")
show_bits("x", x)
show_bits("big = tf32(x)", big)
show_bits("x - big", x - big)
show_bits("small = tf32(x - big)", small)
show_bits("x - (big + small)", x - (big + small))

X = rng.standard_normal(100_000).astype(np.float32)
Xb = tf32(X)
Xs = tf32(X - Xb)
rest = np.abs(X.astype(np.float64) - Xb - Xs) / np.abs(X)
first = np.abs(X - Xb) / np.abs(X)
print(f"\nover {X.size} random values: |x - big| / |x| <= {first.max():.2e} (2^-11 = "
      f"{2.0**-11:.2e}); |x - big - small| / |x| <= {rest.max():.2e} (2^-22 = {2.0**-22:.2e})")

# %% [markdown]
# A product of two split values has four terms:
#
# $$x y = \underbrace{x_b y_b}_{\approx\, x y} + \underbrace{x_b y_s + x_s y_b}_{\lesssim\, 2^{-11} |x y|} + \underbrace{x_s y_s}_{\lesssim\, 2^{-22} |x y|}$$
#
# Each term is a product of two TF32 values, which the tensor cores form exactly. 3xTF32
# issues three `mma`s for the first three terms and drops the fourth: at most $2^{-22}$ of
# the product and typically far less, about float32's own rounding of a product
# ($2^{-24}$). `ptx.mma3_split_b` is forward v3's step: $A$ comes split, $B$ is split on
# the way in, and the two small terms go to their own accumulator $E$ (its docstring says
# why):

# %%
print(source_of(ptx, "@cuda.jit(device=True, inline=True)\ndef mma3_split_b", "@intrinsic"))

Y = rng.standard_normal(X.size).astype(np.float32)
Yb = tf32(Y)
Ys = tf32(Y - Yb)
x64, y64 = X.astype(np.float64), Y.astype(np.float64)
exact = x64 * y64
dropped = np.abs(Xs.astype(np.float64) * Ys) / np.abs(exact)
print(f"the dropped x_s y_s, relative to x y: median {np.median(dropped):.1e}, max "
      f"{dropped.max():.1e}; float32's rounding of a product: up to 2^-24 = {2.0**-24:.1e}")
one = Xb.astype(np.float64) * Yb
three = Xb.astype(np.float64) * Yb + Xb.astype(np.float64) * Ys + Xs.astype(np.float64) * Yb
f32 = (X * Y).astype(np.float64)
print("relative error of one product x y, median and max:")
for name, p in (("1xTF32", one), ("3xTF32", three), ("float32", f32)):
    e = np.abs(p - exact) / np.abs(exact)
    print(f"  {name:8s} {np.median(e):.1e}  {e.max():.1e}")

# %% [markdown]
# In a dot product the sum's rounding adds to this. Here 200 random dot products of
# length 1024, each as a chain of `mma`-like steps: 8 products at a time summed exactly,
# then added to a float32 accumulator and rounded (the simulator's model of an `mma`;
# the GPU rounds in its own way). 1xTF32 is one chain of big products; 3xTF32 the chain
# of big products plus a second chain of the two small terms, added at the end
# (`mma3_split_b`'s $C$ and $E$); float32 the chain of the float32 products. The error is
# relative to $\sum_i |x_i y_i|$, against the float64 dot product:

# %%
def mma_chain(*pairs, k=8):
    """sum_i x_i y_i over the last axis for each (x, y) pair, accumulated as a chain of
    mma steps: k exact products summed, added to a float32 accumulator, rounded."""
    acc = np.zeros(pairs[0][0].shape[0], np.float32)
    for s in range(0, pairs[0][0].shape[1], k):
        for x, y in pairs:
            step = (x[:, s:s + k].astype(np.float64) * y[:, s:s + k]).sum(axis=1)
            acc = (acc + step).astype(np.float32)
    return acc


n = 1024
x = rng.standard_normal((200, n)).astype(np.float32)
y = rng.standard_normal((200, n)).astype(np.float32)
xb, yb = tf32(x), tf32(y)
xs, ys = tf32(x - xb), tf32(y - yb)
truth = np.einsum("tn,tn->t", x.astype(np.float64), y.astype(np.float64))
scale = np.einsum("tn,tn->t", np.abs(x.astype(np.float64)), np.abs(y.astype(np.float64)))
results = {
    "1xTF32": mma_chain((xb, yb)),
    "3xTF32": (mma_chain((xb, yb)) + mma_chain((xs, yb), (xb, ys))).astype(np.float32),
    "float32": mma_chain((x, y)),
}
print(f"dot products of length {n}: error / sum |x_i y_i|, median and max of 200")
for name, r in results.items():
    e = np.abs(r - truth) / scale
    print(f"  {name:8s} {np.median(e):.1e}  {e.max():.1e}")
e1, e3, e32 = (np.abs(r - truth) / scale for r in results.values())
assert np.median(e1) > 100 * np.median(e3) and e3.max() < 4 * e32.max()

# %% [markdown]
# 1xTF32 is more than a thousand times less accurate than float32; 3xTF32 is within a
# factor of two of float32, for three tensor-core products instead of one. That is the
# price the float32 rungs (v3, v6, v8, v9) pay, and what PyTorch's float32 "efficient"
# attention does too (`docs/performance.md`, "Versus SDPA"). v3 splits every operand again
# for every `mma` (`mma3_split_b`); v6 splits each $K$ and $V$ element once, as the block
# stages the tile, into (big, small) pairs in shared memory.
#
# ## 4. Rounding $\tilde P$ to 16 bits
#
# With float16 (or bfloat16) inputs, one `m16n8k16` multiplies 16-bit values exactly and
# adds in float32: one instruction covers 16 of the head dim, where 3xTF32 issues three
# for 8. $S = Q_i K_j^T$ takes the inputs as they are. $\tilde P = \exp(S - m)$ is
# computed in float32, and to multiply it by $V_j$ on the same tensor cores it has to be
# rounded to the inputs' 16-bit type first, as flash-attention's kernels do (forward v7:
# its $S$ accumulators become $\tilde P$'s $A$ fragments, packed by `pack_f16x2`).
#
# The values are in $[0, 1]$. float16 keeps 11 significant bits, so rounding a value
# $\geq 2^{-14}$ (float16's smallest normal) costs at most $2^{-11}$ of it; below that the
# error is at most $2^{-25}$ in absolute terms. bfloat16 keeps float32's exponent range
# but 8 significant bits: at most $2^{-8}$ of every value.

# %%
def round_to(values, dtype):
    """float32 values rounded to a 16-bit type (to nearest even) and back to float32."""
    return values.astype(dtype).astype(np.float32)


P = np.exp(-rng.exponential(3.0, 100_000)).astype(np.float32)       # values in (0, 1]
for name, dtype, u in (("float16", np.float16, 2.0**-11),
                       ("bfloat16", ml_dtypes.bfloat16, 2.0**-8)):
    rounded = round_to(P, dtype)
    rel = np.abs(rounded.astype(np.float64) - P) / P
    normal = (P >= np.finfo(np.float16).tiny) if dtype is np.float16 else (P > 0)
    print(f"{name:8s}: max relative error {rel[normal].max():.3e} (bound {u:.3e}) over "
          f"{normal.sum()} values; max absolute error {np.abs(rounded - P).max():.1e}")
    assert rel[normal].max() <= u

# %% [markdown]
# What that does to attention. One head with float16 (then bfloat16) inputs, the kernel's
# steps in NumPy: $S$ in float32, $\tilde P = \exp(S - m)$ in float32, then
# $O = \mathrm{round}(\tilde P)\, V / \ell$. Against the float64 reference on the same
# inputs (`reference.forward`), next to the error of the float32 $\tilde P$ unrounded and
# of the output's own rounding to the 16-bit type, which every 16-bit kernel has. Two
# choices of $\ell$: the sum of the float32 $\tilde P$ (what v7 and flash-attention do),
# or the sum of the rounded values. And the logsumexp $L = m + \log \ell$, which the
# forward returns:

# %%
Sq, Sk, d = 64, 512, 64
print(f"one head, Sq = {Sq}, Sk = {Sk}, d = {d}; max |error| against float64")
print(f"{'inputs':9s} {'P~ f32':>8s} {'rounded, l f32':>15s} {'rounded, l rnd':>15s} "
      f"{'O to 16 bit':>12s}   {'L, l f32':>9s} {'L, l rnd':>9s}")
lse_rows = {}
for name, dtype in (("float16", np.float16), ("bfloat16", ml_dtypes.bfloat16)):
    q, k, v = (rng.standard_normal((n_, d)).astype(dtype).astype(np.float32)
               for n_ in (Sq, Sk, Sk))
    O_ref, L_ref = reference.forward(q, k, v)                   # float64, the same inputs
    S = (q @ k.T) * np.float32(d**-0.5)                         # float32
    m = S.max(axis=1, keepdims=True)
    P_t = np.exp(S - m)                                         # P~, float32
    P_r = round_to(P_t, dtype)                                  # what the mma reads
    l_f32 = P_t.sum(axis=1, keepdims=True)
    l_rnd = P_r.sum(axis=1, keepdims=True)
    outputs = ((P_t @ v) / l_f32, (P_r @ v) / l_f32, (P_r @ v) / l_rnd, round_to(O_ref, dtype))
    errors = [np.abs(o - O_ref).max() for o in outputs]
    lse = [np.abs(m[:, 0] + np.log(l[:, 0]) - L_ref).max() for l in (l_f32, l_rnd)]
    lse_rows[name] = (S, m, l_f32, l_rnd, L_ref)
    print(f"{name:9s} " + " ".join(f"{e:{w}.1e}" for e, w in zip(errors, (8, 15, 15, 12)))
          + "   " + " ".join(f"{e:9.1e}" for e in lse))
    assert errors[1] < errors[3] and lse[0] < lse[1] / 10

# %% [markdown]
# Rounding $\tilde P$ costs less than rounding the output itself (the terms' errors have
# random signs and are averaged by the sum), and for $O$ the two choices of $\ell$ are
# alike. The difference is in $L$: the sum of the rounded values carries their rounding
# errors into $L = m + \log \ell$, tens to hundreds of times the float32 error here, and
# $L$ is not just a by-product: the backward recomputes $P = \exp(S - L)$ from it in
# float32 (and notebook 08's split-KV merge weighs partial outputs by it). A row of that
# $P$ sums to 1 only if $L$ is the float32 row's logsumexp:

# %%
for name, (S, m, l_f32, l_rnd, L_ref) in lse_rows.items():
    sums = [np.exp(S - (m + np.log(l))).sum(axis=1) for l in (l_f32, l_rnd)]
    err_f32, err_rnd = (np.abs(row_sums - 1).max() for row_sums in sums)
    print(f"{name:8s}: P recomputed from L, max |row sum - 1|: l of the float32 P~ "
          f"{err_f32:.1e}, l of the rounded P~ {err_rnd:.1e}")

# %% [markdown]
# And it costs nothing: the kernel adds the float32 $\tilde P$ into $\ell$ from the
# registers it already holds, before it packs them into 16-bit words for the product.
#
# ## 5. What each rung measured on an H200
#
# The timings below are stored results of recorded runs, not measured here: each row is
# read from the lab file named in it, where the command, the date and the code that ran
# are recorded (`lab/journal.md` has the entry for each). Shape (2, 16, 4096, d),
# float32 (v7: float16 inputs), median ms, not causal / causal. Each rung is compared with
# the version timed beside it in the same file, on the same GPU and inputs: its parent
# where the file has it. Across rows the code of different days ran: v4, for instance,
# went from 11.77 ms to 7.09 at d = 64 with a change of its loops (its docstring), between
# its row and v5's. The cell checks that each number appears in its file, on a line that
# names its version.

# %%
RUNS = "lab/runs/"
RECORDS = [  # (rung, against, d, file in RUNS, rung ms (not causal, causal), against ms)
    ("v3", "v2", 64, "2026-11-30/05_gpu_check.txt", ("14.692", "9.297"), ("16.500", "10.710")),
    ("v3", "v2", 128, "2026-11-30/05_gpu_check.txt", ("34.221", "19.196"), ("48.476", "32.536")),
    ("v4", "v2", 64, "2026-12-01/15_bench_forward.txt", ("11.772", "8.560"), ("17.878", "11.759")),
    ("v4", "v2", 128, "2026-12-01/15_bench_forward.txt", ("46.711", "26.905"), ("46.073", "32.282")),
    ("v5", "v4", 64, "2026-12-01/26_timing_branch.txt", ("5.86", "3.96"), ("7.09", "4.35")),
    ("v5", "v4", 128, "2026-12-01/26_timing_branch.txt", ("15.50", "9.55"), ("21.04", "11.43")),
    ("v6", "v5", 64, "2026-12-01/32_bench.txt", ("5.981", "3.698"), ("6.751", "4.232")),
    ("v6", "v5", 128, "2026-12-01/32_bench.txt", ("13.251", "7.543"), ("15.923", "9.950")),
    ("v7", "v6", 64, "2026-12-01/43_v7_sweep.txt", ("2.47", "1.69"), ("6.04", "3.77")),
    ("v7", "v6", 128, "2026-12-01/43_v7_sweep.txt", ("5.34", "3.12"), ("12.86", "7.16")),
    ("v8", "v6", 64, "2026-12-01/50_v8_sweep.txt", ("5.50", "3.28"), ("6.04", "3.65")),
    ("v8", "v6", 128, "2026-12-01/52_v8_sweep.txt", ("11.24", "6.61"), ("13.08", "7.25")),
    ("v9", "v8", 64, "2026-12-01/60_v9_sweep.txt", ("5.41", "3.76"), ("5.43", "3.15")),
    ("v9", "v8", 128, "2026-12-01/60_v9_sweep.txt", ("10.11", "5.74"), ("10.92", "6.08")),
]


def check_recorded(path, *expected):
    """Raise unless, for each (name, numbers) in expected, every number stands on a line
    of the lab file RUNS + path that also names name."""
    lines = (ROOT / RUNS / path).read_text().splitlines()
    missing = [(name, x) for name, numbers in expected for x in numbers
               if not any(name in line and x in line.split() for line in lines)]
    assert not missing, f"{RUNS}{path} has no line with {missing}"


print(f"{'rung':4s} {'d':>4s}  {'ms':>15s}  {'against':>7s} {'ms':>15s}  {'speed-up':>13s}"
      f"  lab file")
for rung, other, d_, path, mine, theirs in RECORDS:
    check_recorded(path, (rung, mine), (other, theirs))
    ratio = " / ".join(f"{float(b) / float(a):.2f}x" for a, b in zip(mine, theirs))
    print(f"{rung:4s} {d_:4d}  {' / '.join(mine):>15s}  {other:>7s} {' / '.join(theirs):>15s}"
          f"  {ratio:>13s}  {RUNS}{path}")

# %% [markdown]
# How to read it, rung by rung (each version's docstring, in
# `numbaflash/kernels/forward/`, says more):
#
# * **v3** (the tensor cores, 3xTF32, parent v2): 1.1x to 1.7x v2. Held back, its
#   docstring says, by 249 registers a thread, the splits redone for every `mma`, and
#   $K$/$V$ tiles loaded while nothing computes.
# * **v4, v5** are the other branch, without tensor cores: a block of scores per thread
#   (v4), then its tiles in dynamic shared memory (v5). v5 is in the table because it was
#   the fastest version when v6 came, and v6's bench timed v6 beside it, not beside v3.
# * **v6** (each $K$/$V$ element split once as staged, parent v3): 1.1x to 1.3x v5. Its
#   parent took 14.69 ms at d = 64, not causal, in the first sweep of v6
#   (`lab/runs/2026-12-01/27_v6_sweep.txt`), against v6's 5.98 in its bench: 2.5x.
# * **v7** (float16 inputs on `m16n8k16`, parent v6): 2.2x to 2.5x v6 on the same float16
#   inputs, one product where v6 issues three.
# * **v8** (the next chunk's scores issued before this chunk's softmax, parent v6):
#   1.1x to 1.2x, the same results bit for bit.
# * **v9** (the next $K$/$V$ tile copied by `cp.async`, parent v8): 1.06x to 1.08x at
#   d = 128, and nothing at d = 64, where causal is slower (3.76 against 3.15 ms); so v8
#   stays the default at d <= 64 and v9 is the default above.
#
# Where the defaults stand against PyTorch's SDPA, in the bench that `docs/performance.md`
# cites (the same check: each number on a line of its file that names the kernel):

# %%
BENCHES = [  # (dtype, d, file in RUNS, the default's version, its ms, SDPA EFFICIENT ms)
    ("float32", 64, "2026-12-01/65_bench.txt", "v8", ("5.530", "3.308"), ("4.031", "2.301")),
    ("float32", 128, "2026-12-01/65_bench.txt", "v9", ("9.953", "5.728"), ("6.177", "3.364")),
    ("float16", 64, "2026-12-01/44_bench_f16.txt", "v7", ("2.358", "1.705"), ("1.104", "0.665")),
]
print(f"{'dtype':8s} {'d':>4s}  {'default':7s} {'ms':>13s}  {'SDPA EFFICIENT':>14s}  "
      f"{'SDPA / ours':>15s}  lab file")
for dtype, d_, path, version, mine, sdpa in BENCHES:
    check_recorded(path, (version, mine), ("sdpa_efficient", sdpa))
    ratio = " / ".join(f"{float(b) / float(a):.3f}x" for a, b in zip(mine, sdpa))
    print(f"{dtype:8s} {d_:4d}  {version:7s} {' / '.join(mine):>13s}  {' / '.join(sdpa):>14s}"
          f"  {ratio:>15s}  {RUNS}{path}")

# %% [markdown]
# Without tensor cores, v5 reached 0.684x SDPA EFFICIENT at (2, 16, 4096, 64)
# (`lab/runs/2026-12-01/48_bench_v5.txt`), and v6 was 1.1x to 1.3x ahead of v5 in the
# bench of its rows above, not more. Much of what holds the float32 rungs back is the
# price of section 3: the big and small parts of every operand and accumulator take
# registers, so a multiprocessor holds few warps to hide latency with
# (`docs/performance.md`, "What limits the fastest versions"). The float16 rung pays no split, and section 4's rounding
# of $\tilde P$ is the only rounding it adds to the products; SDPA EFFICIENT in float16
# is still two to three times faster.
