"""Backward v8: v6's dK/dV kernel also adds dQ, by atomic adds (deterministic=False).

Parent: v6 (v6_split_pairs.py). v6 computes S and dP twice, once in its dK/dV kernel
(as S^T, dP^T) and again in its dQ kernel, because its gradients must be the same bits on
every run: 7 tile products per (Q tile, K/V tile) pair. v8 runs v6's dK/dV kernel alone,
with a dQ step after each chunk of query rows (v2's lesson, on v6's tensor cores):

    dQ_chunk += scale * dS_chunk Kj         (Alg.2 l.15), added into dQ with atomics

so 5 tile products instead of 7 and no dQ kernel. The dK/dV work is v6's own
(make_dkdv_v6_work with this file's dQ step; v6's kernel compiles the same work without
it, to the same PTX as before the step existed), so dK and dV are v6's bits for the same
tiles, and every variant v6 takes comes along: the dS kept is the one v6 computes.

The dQ step, per chunk of CHUNK query rows (make_dq_step):

* Each warp holds dS^T of its 16 keys in the mma C layout (lane: keys g, g + 8; queries
  2t, 2t + 1 of each n-tile). That is neither operand of a product over the keys with
  the query as a free index, so every thread keeps its dS in shared memory (CHUNK rows
  of Bc + 4 floats: dkdv_dq_v8_shared_layout), and after a barrier the block's warps
  share the d / 8 n-tiles of dQ_chunk = dS_chunk Kj between them: 3xTF32 as v6's
  products (dS split on the bits where read; Kj is v6's plain tile), so each element of
  dQ_chunk is one sum of the tile's Bc keys and takes one atomic add per (chunk, block),
  not one per warp.
* Inside a group of 8 keys the kept dS are stored in the order 0, 2, 4, 6, 1, 3, 5, 7,
  so that the A fragment's k = t, t + 4 are keys 2t, 2t + 1 (v6's relabelling, which
  makes Kj's B reads two rows 2t, 2t + 1 apart: no bank conflicts); with rows of Bc + 4
  floats both the stores (rows 2t, keys g) and the A reads (rows g, columns t) hit 32
  different banks.
* Two barriers per chunk: one before the chunk's dS is kept (every warp has read the
  previous chunk's), one after (every warp's dS is there). Every thread of the block
  calls both, on every chunk of every tile it walks, so they stay matched.
* The sums go into a float32 accumulator zero-filled first (backward_zero_dq_v8): dQ
  itself for float32 inputs; for float16 inputs a float32 scratch array that a last
  kernel (backward_dq_narrow_v8) rounds into dQ. bfloat16 inputs reach v8 as float32
  copies (numbaflash/dtypes.py). The scale is applied to each block's sum as it is added.

What it costs: dQ is not reproducible. Floating-point addition is not associative, and
on a GPU the K/V tiles' blocks add into a dQ element in whatever order they run, so dQ
may differ in its last bits from run to run (dK and dV do not: they are v6's, summed in
a fixed order). Also Tc * Sq * d atomic adds per query head (ceil(Sk / Bc) per dQ
element, fewer with a causal mask), the zero fill (and for float16 the float32 scratch
and the rounding kernel), two barriers per chunk, and CHUNK * (Bc + 4) * 4 bytes more
shared memory per block (4.25 KB at Bc = 64, 8.25 KB at Bc = 128), within which v6's
tiles still fit. What it buys: no measurement yet (scripts/atomic_dq_gpu.py times it
against v6 and checks how many of 50 runs give the same dQ bits).

Runs when asked for: ``deterministic=False`` on a GPU where it can run the input
(numbaflash/policy.py), or version="v8" (also on the simulator, through
kernels/simulated.py's stand-ins, where blocks run one after another, so the order of
the adds happens to repeat). Finite inputs only, float32 accumulation, float16 and
float32 inputs, d <= 128, as v6; plain and causal attention in both alignments, GQA
(dQ per query head; dK, dV summed over the group in v6's fixed order), windows,
softcap, ALiBi, masks, score_mod, dropout and packed batches (kernels/variants.py).
"""

import functools
import math
from collections import namedtuple

import numpy as np
from numba import cuda

from .. import acc_type, jit_options
from ..plan import (TILE_TABLE_REASON, Plan, Plans, device_dynamic_shared_limit,
                    variant_description)
from ..smem import U
from ..variants import PLAIN
from .v5_tensor_cores import (BWD_V5_CANDIDATES, backward_tensor_core_refusal,
                              check_backward_v5_tiles, dkdv_v5_shared_layout, v5_head_dim)
from .v6_split_pairs import (V6_CHUNK, DqStep, _make_v6_helpers, backward_v6_chunk,
                             default_backward_v6_plan, make_dkdv_v6_work)


# What dkdv_dq_v8_shared_layout returns, by name: where the kept dS starts in the one
# dynamic float32 array (after v6's tiles), its row length, and the end.
V8Layout = namedtuple("V8Layout", "DS_AT DS_ROW END")


def dkdv_dq_v8_shared_layout(Br, Bc, d, pairs=False, chunk=V6_CHUNK):
    """backward_dkdv_dq_v8's dynamic shared memory: v6's dK/dV layout
    (``dkdv_v5_shared_layout(Br, Bc, d, pairs)``), then the chunk's dS (``chunk`` rows of
    DS_ROW = Bc + 4 floats: module docstring). ``v8_shared_bytes`` is END * 4."""
    DS_AT = dkdv_v5_shared_layout(Br, Bc, d, pairs).END
    DS_ROW = Bc + 4
    return V8Layout(DS_AT, DS_ROW, DS_AT + chunk * DS_ROW)


def v8_shared_bytes(Br, Bc, d, pairs=False, chunk=V6_CHUNK):
    """Dynamic shared memory of backward_dkdv_dq_v8 (dkdv_dq_v8_shared_layout)."""
    return dkdv_dq_v8_shared_layout(Br, Bc, d, pairs, chunk).END * 4


@functools.lru_cache(maxsize=None)
def make_dq_step(Br, Bc, d, pairs, chunk):
    """The dQ step that backward v8 gives v6's dK/dV work (v6_split_pairs.DqStep: wait,
    keep, add; make_dkdv_v6_work says when each is called), for its tiles (Br, Bc), head
    dim d, ``pairs`` (where v6's tiles end) and ``chunk`` (query rows a step, a multiple
    of 16). Inline device functions:

        wait()                        Wait until every warp has read the previous chunk's dS.
        keep(smem, r, c, ds)          dS of query r of the chunk and key c of the tile,
                                      kept in shared memory (module docstring's order).
        add(smem, Kj, dQ, bh, row0, Sq, tid, softmax_scale)
            after a barrier (every warp's dS kept), warp w computes the n-tiles
            nd = w, w + Bc / 16, ... of dQ_chunk = dS_chunk Kj (3xTF32, the small
            products in their own sums as v6's), and each lane adds its fragment of
            them, times the scale, into dQ[bh, row0 + r, k] for rows < Sq and k < d.

    One n-tile at a time, over all of the tile's keys: the A fragment of a k-step is
    loaded and split again for each n-tile a warp takes (two at d = 64 and at d = 128).
    With the k-steps outside and the warp's n-tiles inside (each A fragment split once),
    ptxas (sm_90, float32, d = 64, (32, 64) with pairs) gave the kernel 255 registers
    instead of 175, holding the loads of all Bc / 8 k-steps at once.
    """
    helpers = _make_v6_helpers(d)
    split_finite, mma3, load_split = helpers.split_finite, helpers.mma3, helpers.load_split
    acc = acc_type("float32")
    ZERO = acc(0)
    assert Bc % 16 == 0 and chunk % 16 == 0 and Br % chunk == 0, (Br, Bc, chunk)
    DS_AT, DS_ROW, _ = dkdv_dq_v8_shared_layout(Br, Bc, d, pairs, chunk)
    _, STRIDE = v5_head_dim(d)          # Kj's rows (v6's layout)
    WARPS = Bc // 16
    ND = (d + 7) // 8                   # n-tiles of dQ_chunk over the head dim
    NQ = -(-ND // WARPS)                # n-tiles a warp takes (the last ones may idle)
    MT = chunk // 16                    # m-tiles of 16 query rows
    KSTEPS = Bc // 8                    # k-steps of 8 keys

    @cuda.jit(device=True, inline=True)
    def wait():
        # Wait until every warp has read the previous chunk's dS (add) before this
        # chunk's is kept over it.
        cuda.syncthreads()

    @cuda.jit(device=True, inline=True)
    def keep(smem, r, c, ds):
        u = c % 8                       # key 8q + u at column 8q + u // 2 + 4 (u % 2)
        smem[U(DS_AT + r * DS_ROW + c - u + u // 2 + 4 * (u % 2))] = ds

    @cuda.jit(device=True, inline=True)
    def add(smem, Kj, dQ, bh, row0, Sq, tid, softmax_scale):
        # Wait until every warp has kept its dS of the chunk.
        cuda.syncthreads()
        lane = tid % 32
        g = lane // 4
        t = lane % 4
        warp = tid // 32
        for m in range(MT):
            for q in range(NQ):
                nd = warp + q * WARPS
                if nd < ND:                 # the same for the whole warp
                    c0 = ZERO                   # the big*big products
                    c1 = ZERO
                    c2 = ZERO
                    c3 = ZERO
                    e0 = ZERO                   # the small ones (summed when added)
                    e1 = ZERO
                    e2 = ZERO
                    e3 = ZERO
                    for ks in range(KSTEPS):
                        # A: dS_chunk rows 16m + g, + 8; k = t, t + 4 (keys 8ks + 2t, + 1)
                        at = DS_AT + (m * 16 + g) * DS_ROW + ks * 8 + t
                        a0b, a0s = split_finite(smem[U(at)])
                        a1b, a1s = split_finite(smem[U(at + 8 * DS_ROW)])
                        a2b, a2s = split_finite(smem[U(at + 4)])
                        a3b, a3s = split_finite(smem[U(at + 8 * DS_ROW + 4)])
                        # B: Kj rows 8ks + 2t, + 1 (the keys of k = t, t + 4), column 8nd + g
                        bt = (ks * 8 + 2 * t) * STRIDE + nd * 8 + g
                        b0b, b0s = load_split(Kj, bt)
                        b1b, b1s = load_split(Kj, bt + STRIDE)
                        c0, c1, c2, c3, e0, e1, e2, e3 = mma3(
                            (a0b, a1b, a2b, a3b, a0s, a1s, a2s, a3s), b0b, b1b, b0s, b1s,
                            c0, c1, c2, c3, e0, e1, e2, e3)
                    # Alg.2 l.15: one atomic add per element of dQ_chunk and block
                    row = row0 + m * 16 + g
                    k = nd * 8 + 2 * t
                    if row < Sq:
                        if k < d:
                            cuda.atomic.add(dQ, (bh, row, k), (c0 + e0) * softmax_scale)
                        if k + 1 < d:
                            cuda.atomic.add(dQ, (bh, row, k + 1), (c1 + e1) * softmax_scale)
                    if row + 8 < Sq:
                        if k < d:
                            cuda.atomic.add(dQ, (bh, row + 8, k), (c2 + e2) * softmax_scale)
                        if k + 1 < d:
                            cuda.atomic.add(dQ, (bh, row + 8, k + 1), (c3 + e3) * softmax_scale)

    return DqStep(wait, keep, add)


# Registers: ptxas (sm_90) gives v8's kernel at d = 64 175 to 247 registers without a cap
# (float32 (32, 64) with pairs 175; float32 causal (64, 64) and float16 (64, 64) 244 to
# 247), where v6's dK/dV kernel takes 167: one block of 128 threads per SM fewer (two
# instead of three). Capped at 168 (ptxas's -maxrregcount, as v6 does for dropout) plain
# attention keeps three, with no spills in float16 and causal float32 and 4 bytes of spill
# stores in float32 (32, 64) with pairs. With GQA (254 registers uncapped) and the
# variants the cap cost 36 to 268 bytes of spill stores (dropout alone 112 to 128, where
# v6's dK/dV kernel takes the same cap), so they are not capped. At d = 128 a block of 256 threads takes the whole register file either
# way (255, as v6; v8 not causal with 8 bytes of spill stores). Not measured: None turns
# the cap off (scripts/atomic_dq_gpu.py --no-register-cap).
V8_MAX_REGISTERS = 168
V8_CAP_MAX_HEAD_DIM = 64


def dkdv_dq_register_cap(variant, d, gqa):
    """The registers v8's kernel may use for ``variant`` at head dim ``d`` (above), or None."""
    if V8_MAX_REGISTERS is not None and variant.plain and not gqa and d <= V8_CAP_MAX_HEAD_DIM:
        return V8_MAX_REGISTERS
    return None


@functools.lru_cache(maxsize=None)
def make_backward_dkdv_dq_v8(Br, Bc, d, causal, chunk=None, pairs=False, gqa=False,
                             variant=PLAIN):
    """v8's one kernel: backward_dkdv_v6 (make_backward_dkdv_v6: the same arguments, tiles,
    chunk, pairs, GQA and variant) with make_dq_step's dQ step after every chunk of Qi,
    and its own register cap (dkdv_dq_register_cap). dQ (B * Hq, Sq, d) float32 must be
    zero-filled; it is added into, never written.

    Launch: grid (ceil(Sk / Bc), B * Hkv), block (2 * Bc,), ``v8_shared_bytes(Br, Bc, d,
    pairs, chunk)`` of dynamic shared memory:

        kernel[grid, block, 0, nbytes](Q, K, V, dO, L, D, dQ, dK, dV, softmax_scale,
                                       causal_offset, *variant_arguments)
    """
    chunk = V6_CHUNK if chunk is None else chunk
    work = make_dkdv_v6_work(Br, Bc, d, causal, chunk, pairs, gqa, variant,
                             make_dq_step(Br, Bc, d, pairs, chunk))

    @cuda.jit(**jit_options(dkdv_dq_register_cap(variant, d, gqa)))
    def backward_dkdv_dq_v8(Q, K, V, dO, L, D, dQ, dK, dV, softmax_scale, causal_offset,
                            window_lo, Hq, group, softcap, slopes, attn_mask, tiles, seed_lo,
                            seed_hi, keep_threshold, keep_scale, seqs):
        work(Q, K, V, dO, L, D, dQ, dK, dV, softmax_scale, causal_offset, window_lo, Hq, group,
             softcap, slopes, attn_mask, tiles, seed_lo, seed_hi, keep_threshold, keep_scale,
             seqs)

    return backward_dkdv_dq_v8


# The zero fill and the rounding of a float16 dQ: ROWS rows of each head a block, THREADS
# threads walking them flat; both stride over the whole array by the grid, so any grid
# covers it (a packed batch's (Hq, total_q, d) view as well as (B * Hq, Sq, d)).
ROWS = 16
THREADS = 64


@functools.lru_cache(maxsize=None)
def make_zero_dq():
    """backward_zero_dq_v8(dQ): every element of the float32 dQ accumulator (BH, S, d) set
    to 0, before v8's kernel adds into it. Launch: grid (ceil(S / ROWS), BH), block
    (THREADS,)."""
    ZERO = acc_type("float32")(0)

    @cuda.jit(**jit_options())
    def backward_zero_dq_v8(dQ):
        n = dQ.shape[2]
        for bh in range(cuda.blockIdx.y, dQ.shape[0], cuda.gridDim.y):
            for first in range(cuda.blockIdx.x * ROWS, dQ.shape[1], cuda.gridDim.x * ROWS):
                for idx in range(cuda.threadIdx.x, ROWS * n, THREADS):
                    row = first + idx // n
                    if row < dQ.shape[1]:
                        dQ[bh, row, idx % n] = ZERO

    return backward_zero_dq_v8


@functools.lru_cache(maxsize=None)
def make_narrow_dq():
    """backward_dq_narrow_v8(dQ32, dQ): dQ (float16) = dQ32 (float32) rounded to nearest,
    element by element, after v8's kernel; as make_zero_dq launches."""

    @cuda.jit(**jit_options())
    def backward_dq_narrow_v8(dQ32, dQ):
        n = dQ.shape[2]
        for bh in range(cuda.blockIdx.y, dQ.shape[0], cuda.gridDim.y):
            for first in range(cuda.blockIdx.x * ROWS, dQ.shape[1], cuda.gridDim.x * ROWS):
                for idx in range(cuda.threadIdx.x, ROWS * n, THREADS):
                    row = first + idx // n
                    if row < dQ.shape[1]:
                        dQ[bh, row, idx % n] = dQ32[bh, row, idx % n]

    return backward_dq_narrow_v8


# --- the launch contract ------------------------------------------------------------

# Tile rule: v6's dK/dV tiles and pairs (default_backward_v6_plan's "dkdv": for float32
# (32, 64) with pairs at d <= 64, (64, 64) causal, (32, 128) with pairs above; float16
# (64, 64) and (64, 128)). With the kept dS they take 74,240, 74,496 and 211,456 bytes
# (float32), 74,496 and 211,712 (float16), against v6's 69,888, 70,144, 203,008 and
# 70,144, 203,264: at d <= 64 three blocks still fit an H200 SM's 228 KB (with 1 KB
# reserved per block), if the registers allow. Where they do not fit the device, the
# first of v5's candidates that does, without pairs. On the simulator v6's small tiles
# (16, 32). A caller's tiles: (Br, Bc), multiples of 16 up to 256, without pairs. Not
# measured: v6's tiles were timed without the dQ step.

VARIANTS = True                # takes the variant arguments (kernels/variants.py)
TILE_TABLE = True              # skips the tiles a mask leaves empty (variants.make_tile_table)


def refusal(p, where):
    """Why backward v8 cannot run Problem ``p`` here, or None: v6's limits (float32
    accumulation, so float64 inputs run elsewhere; d <= 128). bfloat16 inputs arrive as
    float32 copies (numbaflash/dtypes.py)."""
    return backward_tensor_core_refusal("v8", p, where)


def default_backward_v8_tiles(d, causal, dtype, where):
    """(Br, Bc, pairs) by the tile rule above; ValueError if no tile fits."""
    Br, Bc, pairs = default_backward_v6_plan(d, causal, dtype, where)["dkdv"]
    if where == "simulator":
        return Br, Bc, pairs
    limit = device_dynamic_shared_limit(where)
    if v8_shared_bytes(Br, Bc, d, pairs) <= limit:
        return Br, Bc, pairs
    for Br, Bc in BWD_V5_CANDIDATES:
        if v8_shared_bytes(Br, Bc, d) <= limit:
            return Br, Bc, False
    raise ValueError(f"backward v8 cannot run this input: no v8 tile fits head dim {d} "
                     f"within {limit} bytes of shared memory")


def tiles_fit(d, causal, dtype, where):
    """Whether some v8 tile fits (the policy asks before choosing v8)."""
    try:
        default_backward_v8_tiles(d, causal, dtype, where)
    except ValueError:
        return False
    return True


def check_backward_v8_tiles(tiles, d):
    """A caller's backward v8 tiles (Br, Bc): v5's rule with v8's shared memory; ValueError
    names the limit."""
    return check_backward_v5_tiles(tiles, d, "v8", v8_shared_bytes)


def plan(p, where, tiles, reason, preprocess):
    """The Plans of backward v8 for Problem ``p``, in launch order: D, the zero fill of the
    float32 dQ accumulator, v8's kernel (grid (Tc, B * Hkv), 2 Bc threads, dK and dV
    written, dQ added into), and for float16 inputs the rounding of the accumulator into
    dQ. ValueError for float64, d > 128, bad tiles."""
    why = refusal(p, where)
    if why is not None:
        raise ValueError(f"backward v8 cannot run this input: {why}")
    if tiles is None:
        Br, Bc, pairs = default_backward_v8_tiles(p.d, p.upper, p.dtype, where)
        reason += (f"; tiles by the v8 rule for d={p.d}" + (", causal" if p.upper else "")
                   + " (v6's dK/dV tiles)")
    else:
        (Br, Bc), pairs = check_backward_v8_tiles(tiles, p.d), False
        reason += "; tiles given by the caller"
    half = np.dtype(p.dtype) == np.float16
    target = "a float32 scratch array" if half else "dQ itself (float32)"
    grid = (math.ceil(p.Sq / ROWS), p.BH)
    zero = Plan("backward dQ zero", "v8", "backward_zero_dq_v8", where, None, None, grid,
                (THREADS,), 0, p.acc_dtype, p.causal,
                f"the float32 sums of dQ start from 0: {target}, zero-filled, "
                f"{ROWS} rows per block")
    gqa = (f"; GQA: dK, dV summed over the {p.group} query heads of each K/V head in a "
           f"fixed order, dQ per query head" if p.group > 1 else "")
    table = TILE_TABLE_REASON if p.variant.tile_table else ""
    chunk = backward_v6_chunk("dkdv", Br, Bc)
    work = Plan("backward dK dV dQ", "v8", "backward_dkdv_dq_v8", where, Br, Bc,
                (math.ceil(p.Sk / Bc), p.BHkv), (2 * Bc,),
                v8_shared_bytes(Br, Bc, p.d, pairs, chunk), p.acc_dtype, p.causal,
                reason + "; finite inputs only (checked on the GPU); v6's dK/dV kernel "
                "(tensor cores, 3xTF32), each warp 16 keys, plus dQ += scale dS Kj per chunk "
                f"of {chunk} query rows by atomic adds into {target} (its bits may vary "
                "between runs)" + gqa + table, variant=variant_description(p), pairs=pairs,
                dynamic_shared=True)
    plans = [preprocess, zero, work]
    if half:
        plans.append(Plan("backward dQ narrow", "v8", "backward_dq_narrow_v8", where, None,
                          None, grid, (THREADS,), 0, p.acc_dtype, p.causal,
                          "dQ = the float32 sums rounded to float16"))
    return Plans(plans)


def kernel(plan, p):
    """The compiled kernel of one of v8's plans (cached per compile-time parameters)."""
    if plan.kernel == "backward_zero_dq_v8":
        return make_zero_dq()
    if plan.kernel == "backward_dq_narrow_v8":
        return make_narrow_dq()
    chunk = backward_v6_chunk("dkdv", plan.Br, plan.Bc)
    return make_backward_dkdv_dq_v8(plan.Br, plan.Bc, p.d, p.upper, chunk, plan.pairs,
                                    p.group > 1, p.variant)
