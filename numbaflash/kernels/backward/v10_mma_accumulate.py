"""Backward v10: v6 with the running dK, dV and dQ given to the mma as its C operand.

Parent: v6 (v6_split_pairs.py): its two kernels, tiles, split pairs, chunks, variants
and launch contract, compiled with one switch more (``accumulate`` of
make_dkdv_v6_work and make_dq_v6_work). What it changes is how each chunk's products
reach the accumulators. v6 sums a chunk's dVj products from zero, the big*big TF32
products in c and the two small ones in e, and then adds both (``dv += c + e``): two
FADD per accumulator element and chunk (and the same for dK, and for dQ in its kernel).
v10 gives the running dv to the big*big mma as its C operand and adds the small
products after it (``dv = mma(big, big, C=dv) + e``): one FADD. Backward v7 and v9 made
the same change in 16 bits (lab/journal.md, "Backward v7 and v9 accumulating in the
mma"), where there are no small products and no FADD is left.

Why the small products keep their own sum (ptx.mma3_split_b): the tensor cores round
their float32 sums more coarsely than an FMA, and forward v3 had 2.3x the error of a
float32 matmul when the small products were added into C with the big ones. Here they
are summed from zero per chunk, as in v6, and added by an FADD; only the big*big
products meet the running sum inside the tensor cores.

What it costs: rounding. The running sum now passes through the tensor cores' adder once
per chunk (Sq / 16 times for dK and dV, Sk / 32 for dQ with v6's chunks), where v6 adds
each chunk's partial with a correctly rounded FADD; if the tensor cores truncate there,
as has been measured for their float32 accumulation on earlier GPUs, that error has one
sign and grows with the sequence rather than as its square root. The simulator
(kernels/simulated.py) sums a tile's products and C exactly and rounds once, so it
cannot show this: v10's gradients there differ from v6's in their last bits only, and
its tests (tests/test_backward_v10.py) hold it to TESTING.md's rule at simulator sizes.
Its error at training lengths, and its speed, are to be measured on a GPU
(lab/journal.md, "Not run yet on the GPU") before v10 can be anyone's default.

What it buys, read from the machine code (no GPU): lab/sweeps/sass_float32_backward.py
counts the chunk loops' instructions, v6 against v10
(lab/runs/2026-12-05/sass_float32_backward.txt). Untimed.

Runs when asked for (version="v10"): finite inputs only, float32 accumulation, float16
and float32 inputs (bfloat16 as float32 copies), d <= 128, plain and causal attention
and every variant v6 takes (windows, GQA, softcap, ALiBi, masks, score_mod, dropout,
packed batches). Deterministic, as v6: no atomics, a fixed order of sums. Inline PTX and
warp shuffles on a GPU; on the simulator kernels/simulated.py's stand-ins.
"""

import functools

from numba import cuda

from .. import jit_options
from ..variants import PLAIN
from . import v6_split_pairs as v6


@functools.lru_cache(maxsize=None)
def make_backward_dkdv_v10(Br, Bc, d, causal, chunk=None, pairs=False, gqa=False,
                           variant=PLAIN):
    """v10's dK/dV kernel: make_backward_dkdv_v6's (the same arguments, launch and register
    cap), with dVj and dKj accumulated in the mma (module docstring)."""
    work = v6.make_dkdv_v6_work(Br, Bc, d, causal, chunk, pairs, gqa, variant,
                                accumulate=True, packed_rows=variant.varlen)

    @cuda.jit(**jit_options(v6.dkdv_register_cap(variant, d)))
    def backward_dkdv_v10(Q, K, V, dO, L, D, dK, dV, softmax_scale, causal_offset, window_lo,
                          Hq, group, softcap, slopes, attn_mask, tiles, seed_lo, seed_hi,
                          keep_threshold, keep_scale, seqs):
        # dK stands in for the dQ argument, which the work without a dQ step never reads
        work(Q, K, V, dO, L, D, dK, dK, dV, softmax_scale, causal_offset, window_lo, Hq, group,
             softcap, slopes, attn_mask, tiles, seed_lo, seed_hi, keep_threshold, keep_scale,
             seqs)

    return backward_dkdv_v10


@functools.lru_cache(maxsize=None)
def make_backward_dq_v10(Br, Bc, d, causal, chunk=None, pairs=False, gqa=False,
                         variant=PLAIN):
    """v10's dQ kernel: make_backward_dq_v6's (the same arguments and launch), with dQi
    accumulated in the mma (module docstring)."""
    work = v6.make_dq_v6_work(Br, Bc, d, causal, chunk, pairs, gqa, variant, accumulate=True,
                              packed_rows=variant.varlen)

    @cuda.jit(**jit_options())
    def backward_dq_v10(Q, K, V, dO, L, D, dQ, softmax_scale, causal_offset, window_lo, Hq,
                        group, softcap, slopes, attn_mask, tiles, seed_lo, seed_hi,
                        keep_threshold, keep_scale, seqs):
        work(Q, K, V, dO, L, D, dQ, softmax_scale, causal_offset, window_lo, Hq, group,
             softcap, slopes, attn_mask, tiles, seed_lo, seed_hi, keep_threshold, keep_scale,
             seqs)

    return backward_dq_v10


# --- the launch contract: v6's, in v10's name ----------------------------------------

VARIANTS = True                # takes the variant arguments (kernels/variants.py)
TILE_TABLE = True              # skips the tiles a mask leaves empty (variants.make_tile_table)
PACKED_ROWS = True             # a packed batch read as it is, as v6 (kernels/sequences.py)


def refusal(p, where):
    """Why backward v10 cannot run Problem ``p`` here, or None: v6's limits (float32
    accumulation, so float64 inputs run elsewhere; d <= 128)."""
    return v6.backward_tensor_core_refusal("v10", p, where)


def tiles_fit(d, where):
    """Whether a v10 tile fits head dim ``d`` here: v6's tiles (v6_split_pairs.tiles_fit)."""
    return v6.tiles_fit(d, where)


def plan(p, where, tiles, reason, preprocess):
    """The Plans of backward v10 for Problem ``p``: v6's (v6_split_pairs.plan: its tile
    rule, pairs, chunks, grids, GQA and tile table; a caller's tiles as v6 takes them),
    for v10's two kernels."""
    return v6.v6_family_plans("v10", p, where, tiles, reason, preprocess)


def kernel(plan, p):
    """The compiled kernel of one of v10's plans (cached per compile-time parameters),
    with v6's chunk (backward_v6_chunk), the plan's pairs, GQA or not and the Problem's
    variant."""
    kind = {"backward_dkdv_v10": "dkdv", "backward_dq_v10": "dq"}[plan.kernel]
    make = make_backward_dkdv_v10 if kind == "dkdv" else make_backward_dq_v10
    chunk = v6.backward_v6_chunk(kind, plan.Br, plan.Bc)
    return make(plan.Br, plan.Bc, p.d, p.upper, chunk, plan.pairs, p.group > 1, p.variant)
