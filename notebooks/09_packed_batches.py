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
# # 09 · Packed batches: sequences of different lengths, without padding
#
# Notebook 08 was one half of inference: one new token at a time against a long cache.
# The other half is the prompts. A server takes requests of every length and runs their
# prompts through the model together (the *prefill*); training on documents of different
# lengths does the same. Stacked into one (batch, heads, S, d) array, every sequence has
# to be padded to the longest, and the padding costs memory and work.
#
# Packed, the sequences lie back to back with no padding (flash-attention's "varlen"
# layout), and a small array of offsets says where each one starts. This notebook shows
#
# 1. how much padding wastes, by counting, on a small batch and on the batch the bench
#    measures (64 sequences of 128 to 4096 tokens);
# 2. the packed layout: `q` (total, heads, d), `cu_seqlens`, and `lse` (heads, total);
# 3. what a packed call computes: `reference.forward_varlen`, sequence by sequence, and
#    that it equals the padded batch with a mask that hides the padding;
# 4. how a thread block finds its sequence (`numbaflash/kernels/sequences.py`), mirrored in
#    NumPy: offsets, views without copies, blocks that return at once, and the causal mask
#    aligned bottom-right in each sequence;
# 5. `attention_varlen` and its backward on the simulator: each sequence the same bits as
#    `attention()` of that sequence alone, and close to the float64 reference;
# 6. the PyTorch drop-in, `numbaflash.torch.flash_attn_varlen_func`;
# 7. where the GPU measurement will come from.
#
# It runs on the simulator (tiny shapes) or a GPU.

# %%
import inspect
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np

import numbaflash
from numbaflash import arrays, reference
from numbaflash.bench import inference            # the bench's packed batch (sections 1, 7)
from numbaflash.kernels import sequences
from numbaflash.kernels.forward import v2_flash2

BACKEND = numbaflash.backend()          # "gpu", or "simulator" under NUMBA_ENABLE_CUDASIM=1
SIM = BACKEND == "simulator"
if SIM:
    sys.setswitchinterval(2e-4)          # cheaper barriers in the simulator (see notebook 04)
    # section 5's packed batch: query and key lengths per sequence, heads, head dim
    LENS_Q, LENS_K, Hq, Hk, d = (9, 0, 5, 12), (12, 0, 5, 7), 4, 2, 8
else:
    LENS_Q, LENS_K, Hq, Hk, d = (700, 0, 300, 1500), (900, 0, 300, 1100), 8, 2, 64
print(f"backend: {BACKEND}; section 5's batch: query lengths {LENS_Q}, key lengths {LENS_K}, "
      f"(Hq, Hk, d) = {(Hq, Hk, d)}")
rng = np.random.default_rng(0)
ROOT = Path(numbaflash.__file__).resolve().parent.parent


def spec(shape, dtype):
    """Something with a shape and a dtype: all that the explain functions read."""
    return SimpleNamespace(shape=tuple(shape), dtype=np.dtype(dtype))


def cumulative(lengths):
    """cu_seqlens of ``lengths``: (B + 1,) int32, 0 and then the running sum."""
    return np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int32)


# %% [markdown]
# ## 1. What padding wastes
#
# Five sequences of 12, 3, 30, 7 and 18 tokens, padded to the longest (`#` a token, `.`
# padding):

# %%
def waste(lengths):
    """(real rows, padded rows, real score entries, padded score entries) of a batch of
    self-attention sequences (S_q = S_k = n) padded to the longest."""
    lengths = np.asarray(lengths, np.int64)
    S = lengths.max()
    return lengths.sum(), lengths.size * S, (lengths ** 2).sum(), lengths.size * S ** 2


def print_waste(lengths):
    rows, padded_rows, scores, padded_scores = waste(lengths)
    print(f"rows: {rows} real of {padded_rows} padded; {padded_rows - rows} "
          f"({1 - rows / padded_rows:.0%}) are padding")
    print(f"score entries (S_q x S_k per sequence): {scores} real of {padded_scores} "
          f"padded; {padded_scores - scores} ({1 - scores / padded_scores:.0%}) are wasted")


lengths = np.array([12, 3, 30, 7, 18])
S = lengths.max()
for b, n in enumerate(lengths):
    print(f"sequence {b}: {'#' * n}{'.' * (S - n)}  {n:2d} tokens")
print_waste(lengths)

# %% [markdown]
# The rows waste in proportion to the padding, and the scores waste more: a sequence of
# length $n$ has $n^2$ score entries, the padded one $S^2$, so a short sequence in a batch
# with a long one is almost all padding. (A causal mask halves both counts and leaves the
# ratio about where it is.)
#
# The batch that `python -m numbaflash bench --inference` measures: 64 sequences, lengths
# drawn uniformly from 128 to 4096 (NumPy's `default_rng(0)`), 16 heads, d = 128. The
# constants are read from the bench itself, so this is the same batch:

# %%
big = inference.PACKED["gpu"]
low, high = big["lengths"]
big_lengths = np.random.default_rng(inference.LENGTH_SEED).integers(low, high + 1,
                                                                    big["sequences"])
S_big = int(big_lengths.max())
print(f"{big['sequences']} sequences, {big_lengths.min()} to {S_big} tokens, "
      f"{big_lengths.sum()} in all (mean {big_lengths.mean():.0f})")
print_waste(big_lengths)

heads, itemsize = big["heads"], np.dtype(np.float16).itemsize
for dim in big["dims"]:
    rows, padded_rows, _, _ = waste(big_lengths)
    per_row = 4 * heads * dim * itemsize                  # q, k, v and out, float16
    print(f"d = {dim}: q, k, v, out in float16: packed {rows * per_row / 2**30:.2f} GiB, "
          f"padded {padded_rows * per_row / 2**30:.2f} GiB")
print(f"the padded batch's boolean mask that hides the padding, (B, 1, S, S): "
      f"{big['sequences'] * S_big ** 2 / 2**30:.2f} GiB")

# %% [markdown]
# Almost half the rows and nearly two thirds of the score entries are padding. That count
# is what a naive padded computation throws away. `attention()` can do better with a
# mask: notebook 07's tile table skips the tiles a mask leaves empty. But it must be
# given that mask (about a gigabyte here) and padded copies of the arrays, and each call
# first reads the whole mask to build the table, then reads it again in the tiles it
# computes; the packed layout needs none of that. (Both launch the padded grid: section
# 4 shows what a packed launch does with the blocks past a sequence's end.) How much of
# the count survives as time is what the GPU measurement of section 7 is for.
#
# ## 2. The packed layout
#
# Packed, q is **(total, heads, d)**: the sequences' rows one after another, heads in the
# middle (flash-attention's layout; k and v likewise, with their own total). Where each
# sequence starts is `cu_seqlens`, the *cumulative* sequence lengths: B + 1 integers, 0
# first and the total last, so that sequence $b$ is rows `cu_seqlens[b]` to
# `cu_seqlens[b + 1] - 1`.

# %%
cu = cumulative(lengths)
total = int(cu[-1])
print("lengths   ", lengths)
print("cu_seqlens", cu)
q = rng.standard_normal((total, 2, 4))                # (total, heads, d): 2 heads, d = 4
for b in range(lengths.size):
    print(f"sequence {b}: rows {cu[b]:2d}..{cu[b + 1] - 1:2d}, q[{cu[b]}:{cu[b + 1]}] "
          f"has shape {q[cu[b]:cu[b + 1]].shape}")

# %% [markdown]
# Which sequence a packed row belongs to is a search in `cu_seqlens` (the last offset at
# or before the row); the whole map is the sequence numbers repeated by their lengths:

# %%
owner = np.repeat(np.arange(lengths.size), lengths)      # the sequence of each packed row
rows = np.array([0, 11, 12, 15, 44, 45, 69])
print("rows                 ", rows)
print("their sequence       ", np.searchsorted(cu, rows, side="right") - 1)
assert np.array_equal(np.searchsorted(cu, np.arange(total), side="right") - 1, owner)
print("row in its sequence  ", rows - cu[owner[rows]])

# %% [markdown]
# Queries and keys have separate offsets, `cu_seqlens_q` and `cu_seqlens_k`: sequence $b$
# may have $S_q \ne S_k$ (a chunk of a prompt attending to the chunks before it too, or
# cross-attention), and either may be 0. The output is packed like q. The logsumexp has
# the heads **first**, (heads, total): each head's values for all the packed rows lie
# together, as a kernel block writes them (one head, a run of rows). In the self-attention
# case `cu_seqlens_k = cu_seqlens_q`:

# %%
k = rng.standard_normal((total, 2, 4))
v = rng.standard_normal((total, 2, 4))
O, L = reference.forward_varlen(q, k, v, cu, cu, causal=True)
print(f"q, k, v {q.shape}: out {O.shape}, lse {L.shape}")

# %% [markdown]
# ## 3. The definition
#
# `reference.forward_varlen`, tier 1, is the definition: each sequence's rows, given to
# the dense `reference.forward` as a batch of one. Nothing is shared between sequences:

# %%
print(inspect.getsource(reference.forward_varlen))

# %% [markdown]
# The padded batch says the same thing another way: pad every sequence to the longest,
# and give `reference.forward` a boolean mask that lets query row $i$ of sequence $b$ see
# key $j$ only if both are inside the sequence and (causal) $j \le i + S_k - S_q$, the
# sequence's own lengths: the mask is **aligned bottom-right within each sequence**, as
# for `attention()` of that sequence alone. The two formulations share no code for the
# boundaries (slicing against masking), so their agreement, in float64, checks both.
# Here with $S_q \ne S_k$, a sequence with keys but no queries, and grouped-query
# attention (4 query heads, 2 K/V heads):

# %%
def padded_mask(lens_q, lens_k, causal):
    """(B, 1, max S_q, max S_k) bool: query row i of sequence b sees key j iff both lie
    inside the sequence and, causal, j <= i + S_k - S_q (bottom-right in the sequence)."""
    i = np.arange(max(lens_q))[:, None]
    j = np.arange(max(lens_k))[None, :]
    mask = np.zeros((len(lens_q), 1, i.size, j.size), bool)
    for b, (nq, nk) in enumerate(zip(lens_q, lens_k)):
        mask[b, 0] = (i < nq) & (j < nk) & ((j <= i + nk - nq) if causal else True)
    return mask


def pad(x, cu, S):
    """A packed (total, H, d) array as (B, H, S, d), zeros past each sequence."""
    out = np.zeros((len(cu) - 1, x.shape[1], S, x.shape[2]), x.dtype)
    for b in range(len(cu) - 1):
        out[b, :, :cu[b + 1] - cu[b]] = np.swapaxes(x[cu[b]:cu[b + 1]], 0, 1)
    return out


def unpad(x, cu):
    """The inverse of ``pad``: (B, H, S, d) back to packed (total, H, d)."""
    return np.concatenate([np.swapaxes(x[b, :, :cu[b + 1] - cu[b]], 0, 1)
                           for b in range(len(cu) - 1)])


sq3, sk3 = (4, 0, 6, 3), (7, 2, 4, 3)                # query and key lengths per sequence
cu_q3, cu_k3 = cumulative(sq3), cumulative(sk3)
q3 = rng.standard_normal((cu_q3[-1], 4, 8))          # float64: 4 query heads
k3, v3 = rng.standard_normal((2, cu_k3[-1], 2, 8))   # 2 K/V heads (GQA)

O3, L3 = reference.forward_varlen(q3, k3, v3, cu_q3, cu_k3, causal=True)
mask3 = padded_mask(sq3, sk3, causal=True)
Op, Lp = reference.forward(pad(q3, cu_q3, max(sq3)), pad(k3, cu_k3, max(sk3)),
                           pad(v3, cu_k3, max(sk3)), attn_mask=mask3)
Lp_packed = np.concatenate([Lp[b, :, :n] for b, n in enumerate(sq3)], axis=1)
seen = np.isfinite(L3)                               # rows that see at least one key
assert np.array_equal(seen, np.isfinite(Lp_packed)), "the rows that see no key differ"
print(f"packed against padded + mask: max |O difference| "
      f"{np.abs(O3 - unpad(Op, cu_q3)).max():.1e}, max |L difference| "
      f"{np.abs(L3[seen] - Lp_packed[seen]).max():.1e}")
assert np.allclose(O3, unpad(Op, cu_q3), rtol=0, atol=1e-12)
assert np.allclose(L3[seen], Lp_packed[seen], rtol=0, atol=1e-12)
print(f"rows that see no key: {np.flatnonzero(~seen[0])} (lse -inf, out 0, in both)")

# %% [markdown]
# Sequence 2 has 6 query rows and 4 keys, so its first two rows see no key at all
# (section 4 draws why): their `lse` is $-\infty$ and their output 0, the reference's
# convention for an empty row. Sequence 1 has keys and no queries: it contributes nothing
# to the output, and in the backward its keys get zero gradients.
#
# ## 4. How a block finds its sequence
#
# The kernels are the ones `attention()` runs, compiled with one more piece. The grid is
# the padded batch's, sized for the longest sequence: (ceil(max $S_q$ / $B_r$), batch x
# heads) for the forward. Block (i, bh) takes its sequence $b$ from bh, and then, at the
# top of the kernel (here forward v2's, the kernel of notebook 04; every version that runs
# packed batches has the same lines):

# %%
source = inspect.getsource(v2_flash2.make_forward_v2)
start = source.index("        # A packed batch")
print(source[start:source.index("        r = cuda.threadIdx.x", start)])

# %% [markdown]
# `locate` reads the sequence's offsets from `seqs`, the (2, B + 1) array of
# `cu_seqlens_q` and `cu_seqlens_k`; `cut` takes the sequence's rows of an array as a
# view. Both come from `make_sequences`, compiled in only for packed batches (otherwise
# `locate` gives the array's own lengths and `cut` the array itself, and the kernel is
# what it was):

# %%
source = inspect.getsource(sequences.make_sequences)
start = source.index("    @cuda.jit(device=True, inline=True)\n    def locate")
print(source[start:])
print(inspect.getsource(sequences._rows))

# %% [markdown]
# A view is the clear way to say "this sequence's rows", and the plain rungs read packed
# batches that way. The GPU's defaults are fast enough for the view's cost to show:
# forward v8, v9 and v10 and backward v6, v9 and v10 take the packed arrays as they are,
# (total, heads, d), and add the sequence's first row to each row index
# (`sequences.make_packed_rows`); their grids are (tiles, heads, batch), so a block reads
# its head and its sequence from its indices instead of dividing bh. The
# `kernels/sequences.py` docstring says what each step cost in registers.
#
# The same steps in NumPy, for the five sequences of sections 1 and 2 (self-attention,
# 2 heads) with the simulator's tile for this head dim. Each block either finds rows of
# its sequence to compute or returns at once:

# %%
def locate(seqs, b):
    """sequences.locate in NumPy: sequence b's first query row, first key row, lengths,
    and the shift Sk - Sq of its mask."""
    q0, k0 = int(seqs[0, b]), int(seqs[1, b])
    Sq, Sk = int(seqs[0, b + 1]) - q0, int(seqs[1, b + 1]) - k0
    return q0, k0, Sq, Sk, Sk - Sq


def cut(A, start, n):
    """sequences.cut: rows start .. start + n - 1 of every head of A (heads, rows, d)."""
    return A[:, start:start + n]


def prologue(i, bh, seqs, Hq, Br):
    """What block (i, bh) of a packed forward does before its first barrier: None if it
    returns at once, else (b, h, q0, k0, Sq, Sk, shift)."""
    b, h = divmod(bh, Hq)
    q0, k0, Sq, Sk, shift = locate(seqs, b)
    if i * Br >= Sq:
        return None                      # its tile starts past the sequence: return
    return b, h, q0, k0, Sq, Sk, shift


seqs = np.stack([cu, cu])                             # (cu_seqlens_q, cu_seqlens_k)
plan = numbaflash.explain_varlen(spec(q.shape, np.float32), spec(k.shape, np.float32),
                                 spec(v.shape, np.float32), cu, cu, backend="simulator")
Br, H = plan.Br, q.shape[1]
grid = (-(-int(lengths.max()) // Br), lengths.size * H)
assert grid == plan.grid, (grid, plan.grid)
print(f"Br = {Br}; grid {grid}: {grid[0]} Q tiles x {grid[1]} (sequence, head) pairs")
works = np.array([[prologue(i, bh, seqs, H, Br) is not None for i in range(grid[0])]
                  for bh in range(grid[1])])
for bh in range(grid[1]):
    b, h = divmod(bh, H)
    print(f"  sequence {b} ({lengths[b]:2d} rows), head {h}: "
          + " ".join("work" if w else " -- " for w in works[bh]))
print(f"{works.sum()} of {works.size} blocks work; {works.size - works.sum()} return at once")

# %% [markdown]
# A block that returns does so before touching shared memory or reaching a barrier, so
# it costs a launch slot and nothing more.
#
# ### Views, not copies
#
# The packed arrays are (total, heads, d), and a block wants one head's run of rows. The
# kernels are given the arrays as **(heads, total, d)**: the same memory with the first
# two strides swapped. That is a view: nothing moves, and C-contiguity is simply lost.
# On the device, `arrays.heads_first` makes it:

# %%
print(inspect.getsource(arrays.heads_first))

Q = np.ascontiguousarray(q, np.float32)               # packed (total, heads, d)
Qh = np.swapaxes(Q, 0, 1)                             # (heads, total, d): what the kernels see
print(f"packed Q {Q.shape}, strides {Q.strides} bytes; heads first {Qh.shape}, strides "
      f"{Qh.strides}; shares Q's memory: {np.shares_memory(Qh, Q)}; C-contiguous: "
      f"{Qh.flags.c_contiguous}")
q0, _, Sq, _, _ = locate(seqs, 2)
Q2 = cut(Qh, q0, Sq)                                  # sequence 2, every head
assert np.shares_memory(Q2, Q) and np.array_equal(Q2, np.swapaxes(Q[q0:q0 + Sq], 0, 1))
print(f"sequence 2: cut(Qh, {q0}, {Sq}) is {Q2.shape}, strides {Q2.strides}, still Q's "
      f"memory; its row 0 of head 1 is Q[{q0}, 1]")

# %% [markdown]
# Row $r$ of head $h$ of the cut view is element `Q[q0 + r, h]` of the packed array: the
# view's strides do the arithmetic. From here on the block runs exactly as for a batch of
# one, whose array happens to have rows `heads x d` elements apart instead of `d`.
#
# ### The causal mask, bottom-right in each sequence
#
# The host passes the offsets of a square problem (key $j$ is visible from row $i$ if
# $j \le i$), and each block adds its sequence's `shift` $= S_k - S_q$: row $i$ sees keys
# $j \le i + S_k - S_q$, so the **last** query row of every sequence sees its last key, as
# in `attention(causal=True)` of that sequence alone. (A window's left edge moves with it.)
# The batch of section 3, from the padded mask (`x` visible, `.` hidden, blank: outside
# the sequence):

# %%
for b, (nq, nk) in enumerate(zip(sq3, sk3)):
    print(f"sequence {b}: S_q = {nq}, S_k = {nk}, shift = {nk - nq:+d}")
    for i in range(nq):
        print(f"   row {i}  " + "".join("x" if mask3[b, 0, i, j] else "." for j in range(nk)))

# %% [markdown]
# With $S_q < S_k$ (sequence 0) the rows are the last ones of the sequence, and each sees
# the keys before it and its own; with $S_q > S_k$ (sequence 2) the shift is negative and
# the first rows see nothing. A shift computed from the padded lengths instead (the
# longest $S_k$ minus the longest $S_q$) would be right only for the sequences whose own
# $S_k - S_q$ happens to equal it.
#
# ### The bench's batch
#
# For the 64 sequences of section 1 on the H200, `explain_varlen` plans the float16
# forward from shapes alone:

# %%
t_big = int(big_lengths.sum())
big_spec = spec((t_big, heads, 128), np.float16)
cu_big = cumulative(big_lengths)
gplan = numbaflash.explain_varlen(big_spec, big_spec, big_spec, cu_big, cu_big, causal=True,
                                  backend="gpu")
print(gplan)
tiles_per_seq = -(-big_lengths // gplan.Br)                # Q tiles that hold rows
working = int(tiles_per_seq.sum()) * heads
blocks = int(np.prod(gplan.grid))
print(f"\ngrid {gplan.grid}: {blocks} blocks; {working} work, {blocks - working} "
      f"({1 - working / blocks:.0%}) return at once")

# %% [markdown]
# ## 5. The kernels on the simulator
#
# `attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=True)` on the packed batch
# of the first cell: four sequences, one of them empty, query and key lengths that differ
# (with a sequence whose first rows see no key), grouped-query attention, causal. The plan
# first:

# %%
cu_q, cu_k = cumulative(LENS_Q), cumulative(LENS_K)
q, dout = rng.standard_normal((2, cu_q[-1], Hq, d)).astype(np.float32)
k, v = rng.standard_normal((2, cu_k[-1], Hk, d)).astype(np.float32)
plan = numbaflash.explain_varlen(q, k, v, cu_q, cu_k, causal=True)
print(plan)
working = sum(-(-n // plan.Br) for n in LENS_Q) * Hq
print(f"\n{int(np.prod(plan.grid))} blocks, of which {working} work (section 4's count)")

# %% [markdown]
# The forward and the backward. `attention_varlen_backward` takes `out` and `lse` as the
# forward returned them, and returns (dq, dk, dv) packed like q, k and v:

# %%
out, lse = numbaflash.attention_varlen(q, k, v, cu_q, cu_k, causal=True, return_lse=True)
dq, dk, dv = numbaflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k,
                                                  causal=True)
print(f"out {out.shape}, lse {lse.shape}; dq {dq.shape}, dk {dk.shape}, dv {dv.shape}")

# %% [markdown]
# Section 4 says a block of sequence $b$ runs exactly as for a batch of one. Then each
# sequence's rows must be **the same bits** as `attention()` and `attention_backward()` of
# that sequence's slices, with the same kernel versions and tiles (no tolerance: the same
# operations in the same order). The default plans depend on the head dim and the dtype,
# not on the lengths, so each slice gets the packed call's kernels; the cell checks that
# for the forward, and prints the backward's kernels (those of sequence 0 alone):

# %%
def sequence(x, cu, b):
    """Sequence b of a packed (total, H, d) array, as a (1, H, S_b, d) batch of one."""
    return np.swapaxes(x[cu[b]:cu[b + 1]], 0, 1)[None]


for p in numbaflash.explain_backward(sequence(q, cu_q, 0), sequence(k, cu_k, 0),
                                     sequence(v, cu_k, 0), causal=True):
    print(f"backward: {p.kernel}" + (f", tiles (Br, Bc) = ({p.Br}, {p.Bc})" if p.Br else ""))
for b in range(len(LENS_Q)):
    rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
    qb, db = sequence(q, cu_q, b), sequence(dout, cu_q, b)
    kb, vb = sequence(k, cu_k, b), sequence(v, cu_k, b)
    alone = numbaflash.explain(qb, kb, vb, causal=True)
    assert (alone.version, alone.Br, alone.Bc, alone.thread_tile) == \
        (plan.version, plan.Br, plan.Bc, plan.thread_tile), alone
    ob, lb = numbaflash.attention(qb, kb, vb, causal=True, return_lse=True)
    grads = numbaflash.attention_backward(db, qb, kb, vb, ob, lb, causal=True)
    same = {"out": np.array_equal(out[rows], np.swapaxes(ob[0], 0, 1)),
            "lse": np.array_equal(lse[:, rows], lb[0]),
            **{name: np.array_equal(g[at], np.swapaxes(w[0], 0, 1))
               for name, g, w, at in zip(("dq", "dk", "dv"), (dq, dk, dv), grads,
                                         (rows, keys, keys))}}
    print(f"sequence {b} (S_q = {LENS_Q[b]}, S_k = {LENS_K[b]}): same bits as alone: "
          + ", ".join(f"{name} {ok}" for name, ok in same.items()))
    assert all(same.values()), f"sequence {b} differs from attention() of its slices"

# %% [markdown]
# And against the float64 definition of section 3 (`reference.forward_varlen` and
# `backward_varlen`), next to the same reference computed in float32, the error of a
# plain NumPy computation at this precision. The forward is held to notebook 08's rule
# (at most twice the float32 computation's error, + 2 ulps); for the gradients, the
# bitwise equality above carries notebook 05's check of `attention_backward` over to the
# packed call, and the errors are printed for scale.

# %%
want, want_lse = reference.forward_varlen(q, k, v, cu_q, cu_k, causal=True)
base, base_lse = reference.forward_varlen(q, k, v, cu_q, cu_k, causal=True, dtype=np.float32)
seen = np.isfinite(want_lse)
assert np.array_equal(np.isfinite(lse), seen), "the rows that see no key differ"
print(f"rows that see no key: {(~seen[0]).sum()}, out exactly 0: {not out[~seen[0]].any()}, "
      f"dq exactly 0: {not dq[~seen[0]].any()}")
assert not out[~seen[0]].any() and not dq[~seen[0]].any()
for name, got, w, b32 in (("out", out, want, base), ("lse", lse[seen], want_lse[seen],
                                                     base_lse[seen])):
    err, base_err = np.abs(got - w).max(), np.abs(b32 - w).max()
    bound = 2 * base_err + 2 * np.spacing(np.float32(np.abs(w).max()))
    print(f"{name}: max |error| {err:.1e}, float32 NumPy {base_err:.1e}, bound {bound:.1e}")
    assert err <= bound, f"{name}: error {err:.2e} exceeds the bound {bound:.2e}"
want_g = reference.backward_varlen(dout, q, k, v, cu_q, cu_k, causal=True)
base_g = reference.backward_varlen(dout, q, k, v, cu_q, cu_k, causal=True, dtype=np.float32)
for name, got, w, b32 in zip(("dq", "dk", "dv"), (dq, dk, dv), want_g, base_g):
    print(f"{name}: max |error| {np.abs(got - w).max():.1e}, float32 NumPy "
          f"{np.abs(b32 - w).max():.1e}")

# %% [markdown]
# The backward is deterministic (no atomics): each K/V block sums over the query heads of
# its group in a fixed order, so a second call gives the same bits.

# %%
again = numbaflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal=True)
assert all(np.array_equal(a, g) for a, g in zip(again, (dq, dk, dv)))
print("the backward again: the same bits")

# %% [markdown]
# ## 6. From PyTorch
#
# `numbaflash.torch.flash_attn_varlen_func` takes flash-attention's signature (the packed
# tensors, int32 `cu_seqlens` on q's device, the longest lengths) and is differentiable.
# PyTorch is optional (`pip install -e ".[torch]"`; a CPU-only build is enough, and CPU
# tensors run in the simulator), so this section runs only where it imports:

# %%
try:
    import torch
    from numbaflash.torch import flash_attn_varlen_func
except ImportError:
    torch = None
    print("PyTorch is not installed: this section is skipped")

if torch is not None:
    qt, kt, vt = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    out_t = flash_attn_varlen_func(qt, kt, vt, torch.tensor(cu_q), torch.tensor(cu_k),
                                   max(LENS_Q), max(LENS_K), causal=True)
    out_t.backward(torch.tensor(dout))
    same = [np.array_equal(t.numpy(), x)
            for t, x in ((out_t.detach(), out), (qt.grad, dq), (kt.grad, dk), (vt.grad, dv))]
    print(f"torch {torch.__version__}: out, q.grad, k.grad, v.grad the same bits as "
          f"attention_varlen and its backward: {same}")
    assert all(same)

# %% [markdown]
# ## 7. Speed
#
# The packed kernels are timed on a GPU by two commands:
#
# * `python -m numbaflash bench --inference` checks the packed call against the float64
#   reference and then times it on section 1's batch (64 sequences of 128 to 4096 tokens,
#   16 heads, d = 64 and 128, causal and not) against the same batch padded to the longest
#   and run through `attention()` with a boolean mask that hides the padding; its target is
#   forward + backward at least 1.5 times faster packed. It records both layouts' bytes.
# * `python scripts/varlen_gpu.py` adds, on the GPU, the bitwise check of section 5 per
#   sequence for the GPU's default kernels, and the same timing next to PyTorch's SDPA on
#   the padded batch; each line names the kernels that ran.
#
# Their output goes to lab records under `lab/runs/`, which the next cell prints (the
# table and what it means are in `docs/varlen.md`, "Speed"). In the older float16 lines
# both layouts ran backward v6; in the newer ones the packed batch runs the 16-bit
# defaults, forward v10 and backward v9, while the padded batch's mask still sends it to
# forward v7 and backward v6, so their ratios measure the kernels as well as the padding.

# %%
records = sorted(ROOT.glob("lab/runs/*/*varlen*"))
for record in records:
    print(f"{record.relative_to(ROOT)}:")
    for line in record.read_text().splitlines():
        if line.startswith("speed") or "forward packed" in line:
            print(" ", line)
if not records:
    print("no lab record of packed batches on a GPU yet (lab/runs/*/*varlen*): run "
          "python -m numbaflash bench --inference and python scripts/varlen_gpu.py on one")
print(f"the bench times {' and '.join(inference.PACKED_PASSES)} per head dim, causal and not; "
      f"target for fwd+bwd: {inference.PACKED_TARGETS['fwd+bwd']}, ratio = packed ms / "
      f"padded ms")

# %% [markdown]
# Until then, section 1's count is the most that packing can save in score work, and
# section 4's count says how many of the padded grid's blocks a packed launch leaves
# idle. Neither is a time: `docs/varlen.md` will cite the record when there is one.
