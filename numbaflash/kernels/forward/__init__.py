"""Forward attention kernels: O = softmax(scale * Q K^T [masked]) V and L = logsumexp.

All kernels take (BH, Sq, d) Q and (BH, Sk, d) K, V (batch and heads flattened into BH),
write O (BH, Sq, d) and L (BH, Sq), and are built by a cached factory whose arguments
are compile-time constants (tile sizes, head dim, causal or not, accumulator dtype).
Run-time arguments are ``softmax_scale`` and ``causal_offset``: key column c is visible
from query row r iff c <= r + causal_offset (see numbaflash/masks.py).

The ladder, by lineage: each file says its parent, what it changes and what that buys.

    v1_plain             one thread per query row, the online softmax key by key
    v2_flash2            FlashAttention-2 (Algorithm 1): K/V tiles in shared memory
    ├─ v4_register_blocked   a TM x TN block of scores per thread (SIMT)
    │  └─ v5_dynamic_shared  v4's tiles in dynamic shared memory (the simulator's default)
    └─ v3_tensor_cores       the tensor cores, 3xTF32 mma.sync
       └─ v6_split_once      each K/V element split once as staged; exact for every input
          ├─ v8_reordered    the next chunk's scores before this chunk's softmax
          │  └─ v9_async_copy  the next K/V tile copied by cp.async (float32)
          └─ v7_float16      float16 and bfloat16 inputs on the 16-bit tensor cores (m16n8k16)
             └─ v10_ldmatrix  v7's operands by ldmatrix (V untransposed), K/V tiles by cp.async
                              into two stages; the default for plain attention at d > 64

Defaults (numbaflash/policy.py decides, and explain() says why), variants or not: v2 in
float64 and at d > 128; on a GPU, for float16 and bfloat16 inputs, v10 for plain attention
(causal or not, in one batch or packed) at d <= 128 a multiple of 8 and v7 otherwise, and for float32
v8 at d <= 64 and v9 at 64 < d <= 128; on the simulator, which cannot run the tensor-core
versions, v5.

Building blocks: ``mma_rows`` (the per-row steps on mma fragments: the online softmax,
the non-finite fix-ups, the write-out) and ``v6_tile_steps`` (v6's staging and products,
which v8 and v9 reuse); ``kernels/warp.py`` (quad reductions), ``kernels/ptx.py`` (mma,
TF32 splits, cp.async, ldmatrix), ``kernels/smem.py``, ``kernels/bands.py``, ``kernels/variants.py``.

Each version's file holds its kernel factory and its launch contract: ``plan(p, where,
tiles, reason)`` (tile rule, tile check, shared memory, grid and block, or a ValueError
saying why it cannot run the input), ``kernel(plan, p)`` (the compiled kernel),
``VARIANTS`` (it takes the variant arguments) and ``TILE_TABLE`` (it skips the tiles a
mask leaves empty). ``MODULES`` below is the registry: a new version is its own file and
one line there.

Variants (kernels/variants.py, docs/variants.md): v1, v2 and v5 to v9 take a
compile-time ``variant`` and twelve more run-time arguments after causal_offset
(window_lo, Hq, group, softcap, slopes, attn_mask, tiles, dropout's seed_lo, seed_hi,
keep_threshold, keep_scale, and a packed batch's seqs), through two inlined device
functions, visible() and score(); with the plain variant they compile to the plain
kernel. Packed batches of different lengths (``Variant.varlen``, numbaflash/varlen.py):
each block finds its sequence and cuts its arrays to it (kernels/sequences.py). Masked entries are not computed, tiles a window leaves empty are not visited,
and the tiled ones skip the tiles a boolean attn_mask or a mask_mod leaves empty (the
table of visible tiles, variants.make_tile_table). v3 and v4, the first tensor-core and
register-blocked rungs, and v10 (v7's loads changed, not yet its variants), compute plain
attention only: their plans refuse variants, v10's all but a packed batch (its module's
``PACKED``: kernels/plan.py, packed_only).

Fully masked rows (causal with Sq > Sk, or Sk = 0) end with l = 0: they write O = 0 and
L = -inf. NaN in a visible input propagates to the rows that see it; masked keys are
never read into the sums, so NaN there has no effect.
"""

import importlib

# The registry: version -> its module in this package, in the order of the ladder's numbers.
MODULES = {
    "v1": "v1_plain",
    "v2": "v2_flash2",
    "v3": "v3_tensor_cores",
    "v4": "v4_register_blocked",
    "v5": "v5_dynamic_shared",
    "v6": "v6_split_once",
    "v7": "v7_float16",
    "v8": "v8_reordered",
    "v9": "v9_async_copy",
    "v10": "v10_ldmatrix",
}
VERSIONS = tuple(MODULES)


def module(version):
    """The module of forward ``version`` (its factory and launch contract)."""
    return importlib.import_module(f"{__name__}.{MODULES[version]}")
