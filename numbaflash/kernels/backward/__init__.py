"""Backward attention kernels: dQ, dK, dV from dO, by FlashAttention-2 Algorithm 2.

Given the forward's inputs Q (BH, Sq, d), K, V (BH, Sk, d), its output O (BH, Sq, d) and
logsumexp L (BH, Sq), and the upstream gradient dO (BH, Sq, d), the kernels write
dQ (BH, Sq, d) and dK, dV (BH, Sk, d). Nothing of size Sq x Sk is stored: every kernel
recomputes its tile of the probabilities, Pij = exp(scale * Qi Kj^T - L_i) (Alg.2 l.10-11),
from the saved L. The math, per visible (row, col) entry:

    p  = exp(scale * q . k - L)          Alg.2 l.10-11
    dV[col] += p * dO[row]               Alg.2 l.12
    dp = dO[row] . v                     Alg.2 l.13
    ds = p * (dp - D[row])               Alg.2 l.14, with D = rowsum(dO * O) (l.4)
    dQ[row] += scale * ds * k            Alg.2 l.15
    dK[col] += scale * ds * q            Alg.2 l.16

(The paper's S has no scale; ours is scale * Q K^T, so dQ and dK carry one factor of it.)
Kernels are built by cached factories whose arguments are compile-time constants (tile
sizes, head dim, causal or not, accumulator dtype); run-time arguments are
``softmax_scale`` and ``causal_offset``, as in the forward kernels: key column c is
visible from query row r iff c <= r + causal_offset (see numbaflash/masks.py).

The ladder, by lineage: each file says its parent, what it changes and what that buys.

    preprocess               D = rowsum(dO * O) (Alg.2 l.4), which every version runs first
    v1_two_kernels           Algorithm 2 without atomics: a dK/dV kernel, then a dQ kernel
    ├─ v2_atomic_dq          one kernel, dQ by atomic adds (a lesson: not reproducible)
    └─ v3_register_blocked   a TM x TN block of (row, key) pairs per thread (SIMT)
       └─ v4_dynamic_shared  v3's tiles in dynamic shared memory (the simulator's default)
          └─ v5_tensor_cores the tile products on the tensor cores, 3xTF32
             ├─ v6_split_pairs  cheaper splits and staging, streamed tiles split once
             │  ├─ v8_atomic_dq  v6's dK/dV kernel also adds dQ by atomics (deterministic=False)
             │  └─ v10_mma_accumulate  v6 summing dK, dV, dQ in the mma's C
             └─ v7_half      float16 and bfloat16 on the 16-bit tensor cores (m16n8k16)
                └─ v9_ldmatrix  v7's products with ldmatrix operands, no transposed copies,
                                cp.async copies into two stages
    nonfinite                the check that v5's to v10's inputs are finite

Defaults (numbaflash/policy.py decides, and explain_backward() says why), variants or
not: v3 in float64 and at d > 128 (v1 for a variant there); on a GPU, with d <= 128 and
finite inputs, v9 for plain float16 and bfloat16 attention (in one batch or packed: its
module's ``PACKED``) and v6 for float32 and for variants (v4 when an input holds NaN or
inf, or when no v6 tile fits the GPU's shared memory); on the simulator, which cannot run the tensor-core versions, v4. Every default
is deterministic: no atomics, so repeated runs give bitwise identical gradients (v2,
which adds dQ with atomics, runs only when asked for; so do v7, v9's parent, and v10,
not yet measured on a GPU).
``deterministic=False`` (as in flash-attention) lets the default be v8 on a GPU where v8
can run the input and the default is not v9: v6's dK/dV kernel adding dQ by atomics, 5
tile products instead of 7 and no dQ kernel, dQ's last bits varying between runs (not
yet counted on a GPU); elsewhere the deterministic default runs and the plan says why.

Each version's file holds its kernel factories and its launch contract: ``plan(p, where,
tiles, reason, preprocess)`` (the Plans of D, dK/dV and dQ: tile rule, tile check, shared
memory, grid and block, or a ValueError saying why it cannot run the input),
``kernel(plan, p)`` (the compiled kernel of one plan), ``VARIANTS`` (it takes the variant
arguments) and ``TILE_TABLE`` (it skips the tiles a mask leaves empty). ``MODULES`` below
is the registry: a new version is its own file and one line there.

Float32 sums: every accumulator (dKj, dVj over the Q tiles; dQi over the K/V tiles) adds
one tile's terms into a fresh partial first and then adds the partial, as the forward does
with l: adding Sq terms one by one into dK loses float32 accuracy over long sequences
(lab/journal.md, "Backward kernel notes moved from the code"). v7 and v9 add each chunk's
16-term products to the accumulator inside the mma (its C operand) instead, one chunk
at a time, as FlashAttention-2 does; v10 does it in float32 for v6's big*big products
(the small ones still summed from zero per chunk and added by FADD). The price of the
partials is d more registers per accumulator: from d = 64 on, v1's and v2's dK/dV
kernels spill, while v3 and v4 keep their blocks in registers without spills up to
d = 128 (``tests/ptx_check.py --link`` prints each kernel's registers and spills).

Variants (kernels/variants.py, docs/variants.md): the v1, v4, v6, v8 and v10 kernels take
a compile-time ``variant`` and twelve more run-time arguments after causal_offset
(window_lo, Hq, group, softcap, slopes, attn_mask, tiles, dropout's seed_lo, seed_hi,
keep_threshold, keep_scale, and a packed batch's seqs: kernels/sequences.py). dS is multiplied by d score / d s (softcap, score_mod_grad).
Dropout regenerates the forward's keep mask per entry (variants.make_dropout; nothing is
stored) and, with z = keep_scale where kept and 0 where dropped, takes

    dV[col] += p * z * dO[row]           dp = dO[row] . v * z          ds = p * (dp - D[row])

(p the undropped probability, D from the dropped O). With GQA the dK/dV kernel runs one
block per K/V head and tile, and walks the Q tiles of every query head of its group in a
fixed order (each query head with its own dropout mask): dK, dV summed without atomics.
Tiles that a boolean attn_mask or a mask_mod leaves empty are skipped through the table
of visible tiles (``tiles``, variants.make_tile_table). v2, v3 and v5 compute plain
attention only: their plans refuse variants (dropout included), as v7's does.

Fully masked rows (causal with Sq > Sk, where L = -inf) have P = 0: the kernels skip them
before computing exp, so they give a zero dQ row, add nothing to dK and dV, and no
exp(-inf - (-inf)) is ever evaluated. Masked keys are never read into a sum, so NaN there
has no effect; NaN in a visible input propagates (v5 to v10 refuse non-finite inputs,
see nonfinite.py). Speed against PyTorch SDPA: docs/performance.md.
"""


import importlib

# The registry: version -> its module in this package, in the order of the ladder's numbers.
MODULES = {
    "v1": "v1_two_kernels",
    "v2": "v2_atomic_dq",
    "v3": "v3_register_blocked",
    "v4": "v4_dynamic_shared",
    "v5": "v5_tensor_cores",
    "v6": "v6_split_pairs",
    "v7": "v7_half",
    "v8": "v8_atomic_dq",
    "v9": "v9_ldmatrix",
    "v10": "v10_mma_accumulate",
}
VERSIONS = tuple(MODULES)


def module(version):
    """The module of backward ``version`` (its factories and launch contract), or of the
    D = rowsum(dO * O) kernel every version starts with (``"preprocess"``)."""
    name = "preprocess" if version == "preprocess" else MODULES[version]
    return importlib.import_module(f"{__name__}.{name}")
