"""The one place that decides which kernel runs, with which tiles and grid, and why.

``plan_forward`` turns a validated ``Problem`` into a ``Plan``; ``explain`` (in api.py)
returns that plan without running anything, and every launch logs it on the
``numbaflash`` logger at INFO level:

    import logging; logging.basicConfig(level=logging.INFO)

Tile rule (v2 forward): Br = 64 query rows (threads) per block, and Bc the largest power
of two up to 64 whose Kj and Vj tiles (Bc x d each, in the accumulator dtype) fit in the
48 KB of static shared memory a block may use (Qi lives in registers, so Br costs no
shared memory). Bigger Bc means fewer barriers per key. Examples, float32: d=64 -> (64, 64);
d=128 -> (64, 32); d=256 -> (64, 16); float64 halves Bc. Callers may pass
``tiles=(Br, Bc)``; it is checked against the same limits (Br <= 1024 threads, shared
memory <= 48 KB).

Tile rule (v4 forward, register-blocked, opt-in: ``version="v4"``): see
``default_v4_tiles`` below; its tiles are (Br, Bc, TM, TN), TM x TN the block of scores
each thread owns, and ``explain`` shows them with the thread grid.

Tile rule (v5 forward, the default for plain float32 attention up to d = 128 on the
simulator): v4's kernel with dynamic shared memory, so its tiles may exceed 48 KB: see
``default_v5_tiles`` (up to 113 KB, so two blocks share an SM; a caller's tiles up to
227 KB, the H100/H200's per-block maximum). Float32: d=64 -> (128, 64, 8, 4), d=128 ->
(64, 32, 4, 2), 256 threads each. ``Plan.shared_bytes`` is then the dynamic shared memory
the launch asks for.

Tile rule (forward v6 and v8, tensor cores; v8 is the default for plain float32
attention up to d = 128 on a GPU): see ``default_v6_tiles``; (Br, Bc) with Br / 16 warps of 16 query
rows, 2 Br threads, and dynamic shared memory. Float32: d=64 -> (128, 64), d=128 ->
(128, 32) on the H200.

``plan_backward`` returns ``Plans``, one ``Plan`` per kernel in launch order (D, then
dK/dV, then dQ for v1). Tile rule (backward): one (Br, Bc) for the whole pass, the same
tiling of the (i, j) tile pairs as Algorithm 2: the first candidate in
``TILE_CANDIDATES`` for which both tiled kernels fit in 48 KB of static shared memory.
The dK/dV kernel holds Kj, Vj padded to Bc x (d+1), Qi and dOi of Br x d, and L_i, D_i
of Br; the dQ kernel holds Qi, dOi padded to Br x (d+1) and Kj, Vj of Bc x d (all in the
accumulator dtype). Each kernel holds two tiles more than the forward's, so tiles are
smaller. Examples, float32: d=16 -> (64, 64); d=64 -> (32, 32); d=128 -> (16, 16);
d=256 -> (8, 8). Bc is the dK/dV kernel's thread count and Br the dQ kernel's, so a
caller's ``tiles=(Br, Bc)`` is checked against both (each <= 1024) and both shared
memory sizes.

Tile rule (backward v3, the default for plain attention in float64 and at d > 128): see
``default_backward_v3_tiles``; its tiles are (Br, Bc, TM, TN), shared by its dK/dV and dQ
kernels, with (Br / TM) x (Bc / TN) threads per block. Float32: d=64 -> (32, 32, 4, 2),
d=128 -> (16, 16, 2, 1), 128 threads each; under the simulator (8, 8, 2, 2).

Tile rule (backward v4, the default for plain float32 attention up to d = 128): v3's
kernels with dynamic shared memory, so its tiles may exceed 48 KB: see
``default_backward_v4_tiles`` (up to 100 KB per kernel; a caller's tiles up to 227 KB).
Float32: d=64 -> (64, 64, 4, 4), d=128 -> (32, 32, 2, 2), 256 threads each.
``Plan.shared_bytes`` is each kernel's dynamic shared memory.

Tile rule (v7 forward, float16 tensor cores, the default for plain float16 attention up
to d = 128 on a GPU): see ``_v7_tiles_within`` and ``v7_chunk``; (Br, Bc) with Br / 16
warps, 2 Br threads, dynamic shared memory. On the H200: d <= 64 -> (128, 128), 32-key
chunks; d = 128 -> (128, 64), 16-key chunks.

Tile rule (backward v6, tensor cores, the default for plain float32 attention up to
d = 128 on a GPU, finite inputs): see ``default_backward_v6_plan``; (Br, Bc) with
multiples of 16, 2 Bc threads in the dK/dV kernel and 2 Br in the dQ kernel, each kernel
its own pair, and its streamed tiles kept as split pairs or not. Float32 on the H200: at
d <= 64 dQ (64, 32) with pairs, dK/dV (32, 64) with pairs, causal (64, 64) without; at
d > 64 (32, 128) for dK/dV and (128, 32) for dQ, both with pairs (8 warps a block).
Float16 inputs: (64, 64) at d <= 64, (64, 128) and (128, 64) above, without pairs.
Non-finite inputs: ``finite_inputs_plans`` (v4 instead).
"""

import functools
import logging
import math
from dataclasses import dataclass, replace

import numpy as np
from numba import config, cuda

from . import arrays
from .kernels import backward as bwd_kernels
from .kernels import forward as fwd_kernels
from .kernels import variants as variant_kernels
from .kernels import simulating
from .launcher import launch

log = logging.getLogger("numbaflash")

SHARED_MEM_LIMIT = 48 * 1024   # static shared memory per block (bytes)
MAX_THREADS = 1024             # threads per block
V1_THREADS = 64                # v1: threads (query rows) per block
TILE_CANDIDATES = ((64, 64), (64, 32), (32, 32), (32, 16), (16, 16), (16, 8), (8, 8), (8, 4), (4, 4))
PREPROCESS_THREADS = 64        # backward D = rowsum(dO * O): query rows per block


def backend():
    """'gpu' with a CUDA GPU, 'simulator' under NUMBA_ENABLE_CUDASIM=1; else RuntimeError."""
    if simulating():
        return "simulator"
    if cuda.is_available():
        return "gpu"
    raise RuntimeError("no CUDA GPU is available. To run the same kernels on the CPU, set "
                       "NUMBA_ENABLE_CUDASIM=1 before importing numba (slow: keep shapes small)")


def forward_shared_bytes(Br, Bc, d, acc_dtype):
    """Shared memory of the v2 forward kernel: Kj, Vj (Bc, d). (Br is threads, not memory.)"""
    return 2 * Bc * d * np.dtype(acc_dtype).itemsize


FORWARD_BR = 64                # v2 forward: query rows (threads) per block


def default_forward_tiles(d, acc_dtype):
    """The documented forward tile rule (module docstring): Br = 64, largest Bc that fits."""
    Bc = 64
    while Bc > 1 and forward_shared_bytes(FORWARD_BR, Bc, d, acc_dtype) > SHARED_MEM_LIMIT:
        Bc //= 2
    return FORWARD_BR, Bc


def _parse_tiles(tiles):
    """A caller's tiles as two positive ints (Br, Bc); ValueError otherwise."""
    try:
        Br, Bc = tiles
    except (TypeError, ValueError):
        raise ValueError(f"tiles must be a pair of positive ints (Br, Bc); got {tiles!r}") from None
    if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in (Br, Bc)):
        raise ValueError(f"tiles must be a pair of positive ints (Br, Bc); got {tiles!r}")
    Br, Bc = int(Br), int(Bc)
    if Br < 1 or Bc < 1:
        raise ValueError(f"tiles must be positive; got (Br, Bc) = ({Br}, {Bc})")
    return Br, Bc


def check_tiles(tiles, d, acc_dtype):
    """Validate a caller's (Br, Bc) for the v2 forward; ValueError names the limit."""
    Br, Bc = _parse_tiles(tiles)
    if Br > MAX_THREADS:
        raise ValueError(f"Br = {Br} exceeds {MAX_THREADS}: one thread per query row, and a "
                         f"block holds at most {MAX_THREADS} threads")
    need = forward_shared_bytes(Br, Bc, d, acc_dtype)
    if need > SHARED_MEM_LIMIT:
        raise ValueError(f"tiles (Br, Bc) = ({Br}, {Bc}) need {need} bytes of shared memory at "
                         f"head dim {d} in {acc_dtype}; the limit is {SHARED_MEM_LIMIT} (48 KB "
                         f"static shared memory per block)")
    return Br, Bc


@dataclass(frozen=True)
class Plan:
    """What will run, and why. ``str(plan)`` is one readable line."""
    pass_name: str
    version: str
    kernel: str
    backend: str
    Br: int | None
    Bc: int | None
    grid: tuple
    block: tuple
    shared_bytes: int
    acc_dtype: str
    causal: str | None
    reason: str
    variant: str = "plain"      # what is compiled in beyond plain attention (variants.py)
    thread_tile: tuple | None = None    # forward v4, v5, backward v3: (TM, TN), the block of Sij
                                        # each thread owns
    pairs: bool = False     # backward v6: the streamed tiles kept as split pairs

    def __str__(self):
        tiles = f"tiles (Br, Bc) = ({self.Br}, {self.Bc}), " if self.Br else ""
        if self.thread_tile:
            TM, TN = self.thread_tile
            tiles += (f"thread tile (TM, TN) = ({TM}, {TN}) on a {self.Br // TM} x "
                      f"{self.Bc // TN} thread grid, ")
        if self.pairs:
            tiles += "streamed tiles as split pairs, "
        return (f"{self.pass_name}: {self.kernel} on the {self.backend}; {tiles}grid {self.grid}, "
                f"block {self.block}, shared memory {self.shared_bytes} B, accumulate in "
                f"{self.acc_dtype}, causal={self.causal}, variant: {self.variant}. "
                f"Why: {self.reason}")


def variant_description(p):
    """What explain() shows for the variant of Problem ``p``: the compiled-in pieces, the
    run-time values, and GQA."""
    # A causal mask alone is plain attention with causal=... (shown on its own); a
    # window's right side shares the kernels' causal bound.
    text = p.variant.describe(p.upper and p.window is not None)
    extra = []
    if p.window is not None:
        extra.append(f"window_size={p.window}")
    if p.variant.softcap:
        extra.append(f"softcap={p.softcap:g}")
    if p.group > 1:
        extra.append(f"GQA: {p.group} query heads per K/V head")
    return text + (f" ({', '.join(extra)})" if extra else "")


def needs_variants(p):
    """Why Problem ``p`` needs a kernel that supports variants, or None if plain attention
    (with or without the causal mask) is asked for."""
    if p.variant.plain and p.group == 1 and p.window is None:
        return None
    return variant_description(p)


V3_MAX_HEAD_DIM = 128         # v3 keeps Q (split in two) and O fragments in registers


def v3_shared_bytes(Bc, d):
    """Shared memory of the v3 forward: Kj, Vj of (Bc, DP + 4) float32, DP = d rounded up to 8."""
    return 2 * Bc * ((d + 7) // 8 * 8 + 4) * 4


def default_v3_tiles(d):
    """v3 tile rule: Br = 64 (four warps of 16 rows); Bc the largest of 64, 32, 16 that fits."""
    for Bc in (64, 32, 16):
        if v3_shared_bytes(Bc, d) <= SHARED_MEM_LIMIT:
            return fwd_kernels.V3_BR, Bc
    raise ValueError(f"no v3 tile fits head dim {d} in {SHARED_MEM_LIMIT} bytes")


def check_v3_tiles(tiles, d):
    Br, Bc = _parse_tiles(tiles)
    chunk = fwd_kernels.V3_CHUNK
    if Br != fwd_kernels.V3_BR or Bc % chunk:
        raise ValueError(f"v3 tiles must be (Br, Bc) = ({fwd_kernels.V3_BR}, a multiple of "
                         f"{chunk}): four warps of 16 query rows, keys in chunks of {chunk}; "
                         f"got ({Br}, {Bc})")
    if v3_shared_bytes(Bc, d) > SHARED_MEM_LIMIT:
        raise ValueError(f"v3 tiles (64, {Bc}) need {v3_shared_bytes(Bc, d)} bytes of shared "
                         f"memory at head dim {d}; the limit is {SHARED_MEM_LIMIT}")
    return Br, Bc


# --- forward v4 (register-blocked SIMT; opt-in since v5 took over, run 21) -------------

# v4 tile rule: the first (Br, Bc, TM, TN) of V4_CANDIDATES whose shared memory fits in
# 48 KB and whose O block per thread, TM x DN with DN = DP / TX (TX = Bc / TN threads per
# row, DP = d padded to TX), has at most V4_MAX_O_REGS accumulators. Qi is staged in
# shared memory (DP x Br), which is what shrinks the tiles at large head dims; the O
# bound keeps the accumulators in registers (d = 128 at (32, 16, 4, 4), DN = 32, left a
# 528-byte stack frame in ptxas's report). Under the simulator, V4_SIM_TILES: every
# thread launched and every barrier round is expensive there, and 8 x 8 tiles still cross
# several tile boundaries at the simulator's seqlens (<= 40) while a 2 x 2 thread tile
# exercises the register blocking and the reductions across threads.
V4_CANDIDATES = ((64, 32, 4, 4), (32, 32, 4, 4), (32, 16, 4, 2), (16, 16, 2, 2),
                 (16, 8, 2, 1), (8, 8, 2, 2), (8, 8, 1, 1), (4, 4, 1, 1))
V4_MAX_O_REGS = 64
V4_SIM_TILES = (8, 8, 2, 2)


def v4_head_dim_padded(Bc, TN, d):
    """DP: the head dim rounded up to the thread grid's width TX = Bc // TN."""
    TX = Bc // TN
    return (d + TX - 1) // TX * TX


def v4_shared_bytes(Br, Bc, TM, TN, d, acc_dtype):
    """Shared memory of forward v4: QiT (DP, Br+1), KjT (DP, Bc+1), Vj (Bc, DP),
    Pij (Br, Bc+1), red (Br, TX); DP = d rounded up to TX = Bc // TN."""
    TX = Bc // TN
    DP = v4_head_dim_padded(Bc, TN, d)
    n = DP * (Br + 1) + DP * (Bc + 1) + Bc * DP + Br * (Bc + 1) + Br * TX
    return n * np.dtype(acc_dtype).itemsize


def default_v4_tiles(d, acc_dtype):
    """v4 tile rule (above), (Br, Bc, TM, TN). GPU, float32: d <= 64 -> (64, 32, 4, 4),
    128 threads; d = 128 -> (32, 16, 4, 2), 64 threads; float64: d = 64 -> (32, 16, 4, 2)."""
    if simulating():
        return V4_SIM_TILES
    for Br, Bc, TM, TN in V4_CANDIDATES:
        DN = v4_head_dim_padded(Bc, TN, d) // (Bc // TN)
        if (TM * DN <= V4_MAX_O_REGS
                and v4_shared_bytes(Br, Bc, TM, TN, d, acc_dtype) <= SHARED_MEM_LIMIT):
            return Br, Bc, TM, TN
    raise ValueError(f"forward v4 cannot run this input: no v4 tile fits head dim {d} in "
                     f"{acc_dtype} within {SHARED_MEM_LIMIT} bytes of shared memory")


def _check_thread_tiles(tiles, d, acc_dtype, what, shared_bytes, limit=SHARED_MEM_LIMIT,
                        limit_why="48 KB static shared memory per block"):
    """A caller's register-blocked tiles for ``what`` (forward v4 and v5, backward v3):
    (Br, Bc, TM, TN), or (Br, Bc) with TM, TN the largest of 4, 2, 1 dividing Br, Bc.
    Checks that TM, TN divide the tile, the threads fit a block and ``shared_bytes(Br,
    Bc, TM, TN)`` fits in ``limit`` bytes (static shared memory unless said otherwise,
    ``limit_why``); ValueError names the limit."""
    if isinstance(tiles, (tuple, list)) and len(tiles) == 4:
        Br, Bc = _parse_tiles(tiles[:2])
        TM, TN = _parse_tiles(tiles[2:])
    else:
        Br, Bc = _parse_tiles(tiles)
        TM = next(t for t in (4, 2, 1) if Br % t == 0)
        TN = next(t for t in (4, 2, 1) if Bc % t == 0)
    if Br % TM or Bc % TN:
        raise ValueError(f"{what} tiles need TM to divide Br and TN to divide Bc; got "
                         f"(Br, Bc, TM, TN) = ({Br}, {Bc}, {TM}, {TN})")
    threads = (Br // TM) * (Bc // TN)
    if threads > MAX_THREADS:
        raise ValueError(f"{what} tiles ({Br}, {Bc}, {TM}, {TN}) need {threads} threads "
                         f"((Br / TM) x (Bc / TN)); a block holds at most {MAX_THREADS}")
    need = shared_bytes(Br, Bc, TM, TN)
    if need > limit:
        raise ValueError(f"{what} tiles (Br, Bc, TM, TN) = ({Br}, {Bc}, {TM}, {TN}) need "
                         f"{need} bytes of shared memory at head dim {d} in {acc_dtype}; the "
                         f"limit is {limit} ({limit_why})")
    return Br, Bc, TM, TN


def check_v4_tiles(tiles, d, acc_dtype):
    """A caller's forward v4 tiles (``_check_thread_tiles``)."""
    return _check_thread_tiles(tiles, d, acc_dtype, "v4",
                               lambda Br, Bc, TM, TN: v4_shared_bytes(Br, Bc, TM, TN, d,
                                                                     acc_dtype))


def _plan_forward_blocked(p, where, tiles, reason, version):
    """The Plan of the register-blocked forward ``version`` ("v4" or "v5": v4's kernel
    with dynamic shared memory; ``Plan.shared_bytes`` is then what its launch asks for)."""
    default_tiles, check_tiles, shared_bytes = {
        "v4": (default_v4_tiles, check_v4_tiles, v4_shared_bytes),
        "v5": (default_v5_tiles, check_v5_tiles, v5_shared_bytes)}[version]
    if tiles is None:
        Br, Bc, TM, TN = default_tiles(p.d, p.acc_dtype)
        reason += f"; tiles by the {version} rule for d={p.d} in {p.acc_dtype}"
        if where == "simulator":
            reason += " (small tiles on the simulator, where every thread and barrier is slow)"
    else:
        Br, Bc, TM, TN = check_tiles(tiles, p.d, p.acc_dtype)
        reason += "; tiles given by the caller"
    nbytes = shared_bytes(Br, Bc, TM, TN, p.d, p.acc_dtype)
    if version == "v5":
        reason += (f"; v4's kernel with its {nbytes} bytes of shared memory taken from "
                   f"dynamic shared memory (may exceed 48 KB)")
    threads = (Br // TM) * (Bc // TN)
    return Plan("forward", version, f"forward_{version}", where, Br, Bc,
                (math.ceil(p.Sq / Br), p.BH), (threads,), nbytes, p.acc_dtype, p.causal, reason,
                thread_tile=(TM, TN))


# --- forward v5 (v4 with dynamic shared memory; the default for plain attention) -------

# v5 runs v4's kernel with its five shared arrays carved out of dynamic shared memory
# (kernels/forward.py, make_forward_v5), so the same shared bytes (v5_shared_bytes equals
# v4_shared_bytes) may exceed 48 KB. Tile rule: the first (Br, Bc, TM, TN) of
# V5_CANDIDATES whose shared memory fits in V5_SHARED_MEM_TARGET (113 KB: two blocks,
# each with the 1 KB the driver reserves, fit the 228 KB of an H200 SM; on a GPU that
# allows a block less, its own maximum, device_dynamic_shared_limit) and whose O block
# per thread fits V4_MAX_O_REGS, as for v4. A caller's tiles may use up to
# DYNAMIC_SHARED_MEM_LIMIT, the H100/H200's per-block maximum (kernels/smem.py checks the
# device's own maximum again before the launch). GPU, float32: d <= 64 -> (128, 64, 8, 4),
# 107520 bytes at d = 64, 256 threads; 64 < d <= 128 -> (64, 32, 4, 2), 79104 bytes at
# d = 128, 256 threads; d = 256 -> (16, 16, 2, 2), 52800 bytes. The order is measured:
# scripts/v5_sweep.py, run 21 (unsigned tile indices), at (2, 16, 4096, d): d = 64,
# (128, 64, 8, 4) 8.33 ms, (64, 64, 4, 4) 9.90, (64, 32, 4, 4) 10.23, v4 11.88;
# d = 128, (64, 32, 4, 2) 22.88 ms, (64, 32, 4, 4) 30.64, the larger tiles 31.6-50.8,
# v4 46.46. Under the simulator, V5_SIM_TILES, as v4's.
V5_CANDIDATES = ((128, 64, 8, 4), (64, 32, 4, 2), (64, 32, 4, 4), (32, 32, 4, 4),
                 (32, 16, 4, 2), (16, 16, 2, 2), (16, 8, 2, 1), (8, 8, 2, 2), (8, 8, 1, 1),
                 (4, 4, 1, 1))
V5_SHARED_MEM_TARGET = 113 * 1024
DYNAMIC_SHARED_MEM_LIMIT = 227 * 1024
V5_SIM_TILES = V4_SIM_TILES


def device_dynamic_shared_limit():
    """The dynamic shared memory one block may use on the current GPU: CUDA's
    MAX_SHARED_MEMORY_PER_BLOCK_OPTIN (227 KB on the H100/H200, 163 KB on the A100, 99 KB
    on RTX 30 and 40 cards, 64 KB on RTX 20 cards). The default tile rules of forward v5
    and backward v4 stay within it, so that the defaults run on every GPU and not only on
    the one they were measured on. Without a GPU (the simulator, or a machine that only
    plans, as the tests do) it is DYNAMIC_SHARED_MEM_LIMIT, the H100/H200's."""
    if config.ENABLE_CUDASIM or not cuda.is_available():
        return DYNAMIC_SHARED_MEM_LIMIT
    return cuda.get_current_device().MAX_SHARED_MEMORY_PER_BLOCK_OPTIN


def v5_shared_bytes(Br, Bc, TM, TN, d, acc_dtype):
    """Dynamic shared memory of forward v5: v4's five arrays back to back
    (forward.v5_shared_layout), the same bytes as ``v4_shared_bytes``."""
    return fwd_kernels.v5_shared_layout(Br, Bc, TM, TN, d)[-1] * np.dtype(acc_dtype).itemsize


def default_v5_tiles(d, acc_dtype):
    """v5 tile rule (above), (Br, Bc, TM, TN). GPU, float32: d <= 64 -> (128, 64, 8, 4),
    256 threads; 64 < d <= 128 -> (64, 32, 4, 2), 256 threads; d = 256 -> (16, 16, 2, 2),
    64 threads; float64: d = 64 -> (64, 32, 4, 2), d = 128 -> (32, 32, 4, 4)."""
    if simulating():
        return V5_SIM_TILES
    target = min(V5_SHARED_MEM_TARGET, device_dynamic_shared_limit())
    for Br, Bc, TM, TN in V5_CANDIDATES:
        DN = v4_head_dim_padded(Bc, TN, d) // (Bc // TN)
        if (TM * DN <= V4_MAX_O_REGS
                and v5_shared_bytes(Br, Bc, TM, TN, d, acc_dtype) <= target):
            return Br, Bc, TM, TN
    raise ValueError(f"forward v5 cannot run this input: no v5 tile fits head dim {d} in "
                     f"{acc_dtype} within {target} bytes of shared memory")


def check_v5_tiles(tiles, d, acc_dtype):
    """A caller's forward v5 tiles (``_check_thread_tiles``), against the dynamic limit."""
    return _check_thread_tiles(tiles, d, acc_dtype, "v5",
                               lambda Br, Bc, TM, TN: v5_shared_bytes(Br, Bc, TM, TN, d,
                                                                     acc_dtype),
                               DYNAMIC_SHARED_MEM_LIMIT,
                               "227 KB dynamic shared memory per block on the H100/H200")


# --- forward v6 (tensor cores, 3xTF32, K/V split once per tile; GPU only) --------------

# v6 runs v3's warp layout (16 query rows per warp, Br / 16 warps) with Kj and Vj split
# into TF32 parts once per tile in dynamic shared memory (kernels/forward.py,
# make_forward_v6), and Qi's parts too when d > 64. Tile rule: the first (Br, Bc) of
# V6_CANDIDATES whose shared memory (v6_shared_bytes) fits the current GPU's per-block
# maximum (device_dynamic_shared_limit). The order is measured (scripts/v6_sweep.py
# --configs, run 31, (2, 16, 4096, d), float32, ms not causal / causal): d = 64,
# (128, 64) 5.80 / 3.57, (128, 32) 6.01 / 3.86, (64, 64) 7.19 / 4.57; d = 128,
# (128, 32) 13.28 / 7.35, (64, 32) with 32-key chunks 24.76 / 14.07, (64, 16) 16.59 / 9.07
# (with a 168-register limit). At d = 64 (128, 64) takes 68.6 KB, at d = 128 (128, 32)
# 202 KB (one block per SM). A caller's tiles: Br a multiple of 16 up to 256 (16 warps),
# Bc a multiple of 16 (V6_CHUNK), within the H100/H200's 227 KB.
V6_CANDIDATES = ((128, 64), (128, 32), (64, 32), (64, 16))
V6_MAX_HEAD_DIM = 128         # the O fragments (d / 2 a lane) stay in registers up to here


def v6_shared_bytes(Br, Bc, d):
    """Dynamic shared memory of forward v6 (forward.v6_shared_layout), float32."""
    return fwd_kernels.v6_shared_layout(Br, Bc, d)[3] * 4


# The tensor-core forward versions: the largest head dim each runs, what holds it there,
# and (v6) what the dispatcher runs on the simulator instead.
TENSOR_CORE_LIMITS = {
    "v3": (V3_MAX_HEAD_DIM, "its Q and O fragments", ""),
    "v6": (V6_MAX_HEAD_DIM, "its O fragments", " (there, v5 computes the same thing)"),
    "v8": (V6_MAX_HEAD_DIM, "its O fragments", " (there, v5 computes the same thing)"),
    "v9": (V6_MAX_HEAD_DIM, "its O fragments", " (there, v5 computes the same thing)"),
}


def tensor_core_refusal(version, p, where):
    """Why forward ``version`` ("v3", "v6", "v8" or "v9", the 3xTF32 versions) cannot run
    Problem ``p`` here, or None if it can."""
    max_d, kept, sibling = TENSOR_CORE_LIMITS[version]
    if where != "gpu":
        return (f"{version} uses the tensor cores through inline PTX and warp shuffles, which "
                f"the simulator cannot run{sibling}")
    if p.acc_dtype != "float32":
        return f"{version} computes in float32 (3xTF32); float64 inputs run on v2"
    if p.d > max_d:
        return f"{version} keeps {kept} in registers, which holds head dims up to {max_d}"
    if version == "v9" and np.dtype(p.dtype) != np.float32:
        return ("v9 copies its K/V tiles as float32 elements, unconverted (cp.async), so it "
                f"takes float32 inputs only; {np.dtype(p.dtype)} inputs run on v7 (the "
                "default) or v8")
    return None


# v9 is the float32 default from this head dim on (where Qi sits in shared memory): at
# (2, 16, 4096, 128), (128, 32) tiles, 32-key chunks (scripts/v6_sweep.py --configs,
# run 60, ms not causal / causal) v9 10.11 / 5.74 against v8's 10.92 / 6.08. At d = 64,
# (128, 64), v9 5.41 / 3.76 against 5.43 / 3.15: no gain without the mask and a loss with
# it (255 registers on the device; CUDA 13.5's ptxas spills it), so v8 stays the default
# up to d = 64.
V9_DEFAULT_MIN_HEAD_DIM = fwd_kernels.V6_Q_REGISTERS_MAX_DP + 1


def v9_shared_bytes(Br, Bc, d):
    """Dynamic shared memory of forward v9 (forward.v9_shared_layout), float32: v6's K/V
    pairs, Qi plain at d > 64, and the landing places of the next K/V tile."""
    return fwd_kernels.v9_shared_layout(Br, Bc, d)[5] * 4


def _v6_tiles_within(d, limit, shared_bytes=v6_shared_bytes):
    """The first of V6_CANDIDATES whose shared memory (by ``shared_bytes``: v6's and v8's,
    or v9's) fits ``limit`` bytes, or None."""
    return next(((Br, Bc) for Br, Bc in V6_CANDIDATES if shared_bytes(Br, Bc, d) <= limit),
                None)


def default_v6_tiles(d, version="v6"):
    """v6 tile rule (above), (Br, Bc): d <= 64 -> (128, 64); d = 128 -> (128, 32) on the
    H200, (64, 16) on a GPU that allows a block 99 KB. v9 takes the same rule with its own
    shared memory (v9_shared_bytes): on the H200 the same tiles."""
    limit = device_dynamic_shared_limit()
    tiles = _v6_tiles_within(d, limit, v9_shared_bytes if version == "v9" else v6_shared_bytes)
    if tiles is not None:
        return tiles
    raise ValueError(f"forward {version} cannot run this input: no {version} tile fits head "
                     f"dim {d} within {limit} bytes of shared memory")


def _check_warp_tiles(version, tiles, d, chunk, shared_bytes, staging_width, hint=""):
    """A caller's tiles for forward v6 or v7 (warps of 16 query rows, 2 Br threads that
    stage one column each, ``staging_width(d)`` of them a row, ``chunk`` keys a step);
    ValueError names the limit."""
    Br, Bc = _parse_tiles(tiles)
    if Br % 16 or Br > 256 or Bc % chunk:
        raise ValueError(f"{version} tiles must be (Br, Bc) with Br a multiple of 16 up to 256 "
                         f"(warps of 16 query rows) and Bc a multiple of {chunk} (keys in "
                         f"chunks of {chunk}); got ({Br}, {Bc}){hint}")
    width = staging_width(d)
    if 2 * Br < width:
        raise ValueError(f"{version} tiles ({Br}, {Bc}) at head dim {d}: {version} stages its "
                         f"K/V tiles one column per thread, so its 2 Br threads must cover "
                         f"the head dim rounded up to a power of two ({width}): "
                         f"Br >= {width // 2}")
    need = shared_bytes(Br, Bc, d)
    if need > DYNAMIC_SHARED_MEM_LIMIT:
        raise ValueError(f"{version} tiles ({Br}, {Bc}) need {need} bytes of shared memory at "
                         f"head dim {d}; the limit is {DYNAMIC_SHARED_MEM_LIMIT} (227 KB dynamic "
                         f"shared memory per block on the H100/H200)")
    return Br, Bc


def check_v6_tiles(tiles, d, version="v6"):
    """A caller's forward v6 (or v8: the same kernel reordered; or v9, with its own shared
    memory) tiles; ValueError names the limit."""
    nbytes = v9_shared_bytes if version == "v9" else v6_shared_bytes
    return _check_warp_tiles(version, tiles, d, fwd_kernels.V6_CHUNK, nbytes,
                             fwd_kernels.v6_staging_width,
                             f". ({version} runs on a GPU only; version='v5' takes other tiles)")


def v8_chunk(d, Bc):
    """Keys per online-softmax step of forward v8: 32 where Qi is staged in shared memory
    (d > 64, forward.V6_Q_REGISTERS_MAX_DP) and Bc is a multiple of 32, else v6's 16.
    Measured (scripts/v6_sweep.py --configs, run 52, (2, 16, 4096, 128), (128, 32) tiles,
    ms not causal / causal): v8 with 32-key chunks 11.24 / 6.61, with 16-key chunks
    12.56 / 7.21; v6 13.08 / 7.25 and 13.51 / 7.63. With Qi in registers (d <= 64) a
    32-key chunk of v8 spills (CUDA 13.5's ptxas: 255 registers and 36 bytes stored at
    (128, 64)), so it stays at 16."""
    wide = d > fwd_kernels.V6_Q_REGISTERS_MAX_DP and Bc % 32 == 0
    return 32 if wide else fwd_kernels.V6_CHUNK


def _plan_forward_v6(p, where, tiles, reason, version="v6"):
    """Forward v6, v8 (v6's kernel with the next chunk's scores before this chunk's
    softmax: the same tiles, launch and shared memory) or v9 (v8 with the next K/V tile
    copied asynchronously: the same tile rule and launch, its own shared memory)."""
    refusal = tensor_core_refusal(version, p, where)
    if refusal is not None:
        raise ValueError(f"forward {version} cannot run this input: {refusal}")
    if tiles is None:
        Br, Bc = default_v6_tiles(p.d, version)
        reason += f"; tiles by the v6 rule for d={p.d}"
    else:
        Br, Bc = check_v6_tiles(tiles, p.d, version)
        reason += "; tiles given by the caller"
    if version in ("v8", "v9"):
        reason += f"; {v8_chunk(p.d, Bc)}-key softmax steps (v8_chunk)"
    nbytes = (v9_shared_bytes if version == "v9" else v6_shared_bytes)(Br, Bc, p.d)
    return Plan("forward", version, f"forward_{version}", where, Br, Bc,
                (math.ceil(p.Sq / Br), p.BH), (2 * Br,), nbytes, p.acc_dtype, p.causal, reason)


# --- forward v7 (float16 inputs on the float16 tensor cores, m16n8k16; GPU only) ---------

# v7 is v6 with float16 tiles and one m16n8k16 product where v6 has three m16n8k8 TF32
# ones (kernels/forward.py, make_forward_v7). Tile rule: the first (Br, Bc) of
# V7_CANDIDATES that fits the current GPU's per-block maximum, with V7_CHUNK keys a
# softmax step; d > 64 starts at (128, 64) with 16-key chunks. Measured (scripts/
# v7_sweep.py, run 43, (2, 16, 4096, d), float16, ms not causal / causal): d = 64,
# (128, 128) 2.47 / 1.69, (128, 64) 2.58 / 1.83, (64, 64) 3.04 / 2.03, 16-key chunks at
# (128, 64) 3.58 / 2.27; d = 128, (128, 64) with 16-key chunks 5.34 / 3.12, with 32-key
# chunks 5.60 / 3.25, (64, 64) 6.26 / 3.55 ((128, 128) with 16-key chunks read 4.97 /
# 3.01 in run 44, another run: not taken into the rule without a side-by-side). Forward v6
# on the same inputs: 6.04 / 3.77 and 12.86 / 7.16. (128, 128) takes 35 KB at d = 64,
# (128, 64) 35 KB at d = 128. A caller's tiles: Br a multiple of 16 up to 256, Bc a
# multiple of 32.
V7_CANDIDATES = ((128, 128), (128, 64), (64, 64), (64, 32))
V7_WIDE_MAX_HEAD_DIM = 64     # (128, 128) and 32-key chunks up to here (measured best)
V7_MAX_HEAD_DIM = 128         # the O fragments (d / 2 a lane) stay in registers up to here


def v7_shared_bytes(Br, Bc, d):
    """Dynamic shared memory of forward v7 (forward.v7_shared_layout), float16."""
    return fwd_kernels.v7_shared_layout(Bc, d)[1] * 2


def v7_refusal(p, where):
    """Why forward v7 cannot run Problem ``p`` here, or None if it can."""
    if where != "gpu":
        return ("v7 uses the tensor cores through inline PTX and warp shuffles, which the "
                "simulator cannot run (there, v5 computes the same thing)")
    if p.dtype != "float16":
        return (f"v7 multiplies float16 inputs on the float16 tensor cores; {p.dtype} inputs "
                f"run on v8 (float32) or v2 (float64)")
    if p.d > V7_MAX_HEAD_DIM:
        return (f"v7 keeps its O fragments in registers, which holds head dims up to "
                f"{V7_MAX_HEAD_DIM}")
    return None


def _v7_tiles_within(d, limit):
    """The first of V7_CANDIDATES (from (128, 64) when d > V7_WIDE_MAX_HEAD_DIM) whose
    shared memory fits ``limit`` bytes and whose threads cover the staging width, or None."""
    candidates = V7_CANDIDATES if d <= V7_WIDE_MAX_HEAD_DIM else V7_CANDIDATES[1:]
    width = fwd_kernels.v7_staging_width(d)
    return next(((Br, Bc) for Br, Bc in candidates
                 if v7_shared_bytes(Br, Bc, d) <= limit and 2 * Br >= width), None)


def v7_chunk(d, Bc):
    """Keys per online-softmax step of forward v7: 32 up to V7_WIDE_MAX_HEAD_DIM, 16 above
    (run 43: 5.34 against 5.60 ms at d = 128), and never more than Bc."""
    return min(fwd_kernels.V7_CHUNK if d <= V7_WIDE_MAX_HEAD_DIM else 16, Bc)


def check_v7_tiles(tiles, d):
    """A caller's forward v7 tiles; ValueError names the limit."""
    return _check_warp_tiles("v7", tiles, d, fwd_kernels.V7_CHUNK, v7_shared_bytes,
                             fwd_kernels.v7_staging_width)


def _plan_forward_v7(p, where, tiles, reason):
    refusal = v7_refusal(p, where)
    if refusal is not None:
        raise ValueError(f"forward v7 cannot run this input: {refusal}")
    if tiles is None:
        limit = device_dynamic_shared_limit()
        found = _v7_tiles_within(p.d, limit)
        if found is None:
            raise ValueError(f"forward v7 cannot run this input: no v7 tile fits head dim "
                             f"{p.d} within {limit} bytes of shared memory")
        Br, Bc = found
        reason += f"; tiles by the v7 rule for d={p.d}"
    else:
        Br, Bc = check_v7_tiles(tiles, p.d)
        reason += "; tiles given by the caller"
    return Plan("forward", "v7", "forward_v7", where, Br, Bc, (math.ceil(p.Sq / Br), p.BH),
                (2 * Br,), v7_shared_bytes(Br, Bc, p.d), p.acc_dtype, p.causal, reason)


V4_DEFAULT_MAX_HEAD_DIM = 128   # where v4 and v5 were measured (d = 64 and 128)


def _default_forward_version(p, where):
    """The default forward version for ``p`` and why.

    Plain attention (with or without the causal mask) in float32 with d <= 128, on a GPU:
    v8, which is v6 (the tensor-core kernel, 3xTF32, with K/V split once per tile, exact
    for every input, non-finite ones included: kernels/forward.py) with the next chunk's
    scores issued before this chunk's softmax, and at d > 64 each Qi fragment read once
    per chunk and 32-key chunks (v8_chunk); with the same chunk its results are bitwise
    v6's. On the H200, (2, 16, 4096, d), float32, ms not causal / causal, default tiles
    (scripts/v6_sweep.py --configs): d = 64, v8 5.50 / 3.28 against v6's 6.04 / 3.65 in
    run 50 and 5.90 / 3.27 against 5.88 / 3.85 in run 52; d = 128, 11.24 / 6.61 against
    13.51 / 7.63 (run 52). v6 was the default before v8 (runs 29 and 31: d = 64,
    v6 5.80 / 3.57 against v5's 5.88 / 4.34; d = 128, 13.28 / 7.35 against 15.41 / 9.54).
    From d = 65 on (V9_DEFAULT_MIN_HEAD_DIM, float32 inputs): v9, v8 with the next K/V
    tile copied asynchronously and Qi plain, bitwise v8's results (d = 128: 10.11 / 5.74
    against v8's 10.92 / 6.08, run 60). On the simulator, which cannot run tensor-core code: v5,
    the register-blocked SIMT kernel with its tiles in dynamic shared memory, the fastest
    version there is (its results agree with v8's within rounding; the tests hold both to
    the same rule). v5 was the GPU default before v6 (runs 20-26: d = 64, 5.86 ms against
    v4's 7.09 and v2's 17.99).

    Float16 inputs on a GPU, the same plain attention: v7, v6's algorithm on the float16
    tensor cores (one m16n8k16 product where v6 has three TF32 ones), P~ rounded to
    float16 for its product with V (scripts/v7_sweep.py, run 43, (2, 16, 4096, d), ms not
    causal / causal: d = 64, 2.47 / 1.69 against v6's 6.04 / 3.77; d = 128, 5.34 / 3.12
    against 12.86 / 7.16).

    Variants, float64 and d > 128: v2, which takes the variant arguments and was not
    measured slower there. v3 (the first tensor-core version) stays opt-in: exact only
    for finite inputs, and slower than v6.
    """
    wanted = needs_variants(p)
    if wanted is not None:
        return "v2", ("v2 is the default for variants: v3 to v8 compute plain "
                      "attention only")
    if p.acc_dtype != "float32":
        return "v2", "v2 is the default in float64 (v4 to v8 were measured in float32 only)"
    if p.d > V4_DEFAULT_MAX_HEAD_DIM:
        return "v2", (f"v2 is the default at head dim {p.d} > {V4_DEFAULT_MAX_HEAD_DIM} (v4 to v8 "
                      f"were measured faster at d <= {V4_DEFAULT_MAX_HEAD_DIM} only)")
    if tensor_core_refusal("v8", p, where) is not None:
        return "v5", ("v5 is the default for plain attention in float32 with d <= "
                      f"{V4_DEFAULT_MAX_HEAD_DIM} on the simulator, which cannot run v8 "
                      "(tensor cores, inline PTX): register-blocked, its tiles in dynamic "
                      "shared memory, exact for every input; on a GPU, v8 runs instead")
    limit = device_dynamic_shared_limit()
    if v7_refusal(p, where) is None and _v7_tiles_within(p.d, limit) is not None:
        return "v7", ("v7 is the default for plain attention in float16 with d <= "
                      f"{V7_MAX_HEAD_DIM} on a GPU: float16 products on the tensor cores "
                      "(m16n8k16, float32 sums; P~ rounded to float16 for P~ V), NaN and inf "
                      "placed exactly as by v6, 2.2x-2.4x v6's speed on the H200 (run 43)")
    if _v6_tiles_within(p.d, limit) is None:
        return "v5", (f"v5 is the default here: no v6 tile fits head dim {p.d} in this GPU's "
                      f"{limit} bytes of shared memory per block, and v5 (register-blocked "
                      "SIMT, exact for every input) is the fastest version that does")
    if (p.d >= V9_DEFAULT_MIN_HEAD_DIM and tensor_core_refusal("v9", p, where) is None
            and _v6_tiles_within(p.d, limit, v9_shared_bytes) is not None):
        return "v9", ("v9 is the default for plain attention in float32 with "
                      f"{V9_DEFAULT_MIN_HEAD_DIM} <= d <= {V6_MAX_HEAD_DIM} on a GPU: v8 "
                      "(3xTF32 tensor cores, exact for every input) with the next K/V tile "
                      "copied into shared memory (cp.async) while this one is used, and Qi "
                      "kept plain; bitwise v8's results, 6-7% faster than v8 at d = 128 on "
                      "the H200 (run 60)")
    return "v8", ("v8 is the default for plain attention in float32 with d <= "
                  f"{V6_MAX_HEAD_DIM} on a GPU: v6's tensor-core kernel (3xTF32, K/V split "
                  "once per tile, exact for every input) with the next chunk's scores "
                  "computed during this chunk's softmax (bitwise v6's results for the same "
                  "chunk), the fastest version measured on the H200")


def plan_forward(p, version=None, tiles=None):
    """Choose the forward kernel for Problem ``p``. ``version`` None means the default.

    Never falls back silently: a version that cannot run ``p`` raises ValueError saying why.
    """
    where = backend()
    if version is None:
        version, reason = _default_forward_version(p, where)
    elif version in fwd_kernels.VERSIONS:
        reason = f"{version} was asked for by the caller"
    else:
        raise ValueError(f"unknown forward version {version!r}; choose from {fwd_kernels.VERSIONS}")

    variant = variant_description(p)
    if version == "v1":
        if tiles is not None:
            raise ValueError("tiles apply to the tiled kernels (v2 to v5); v1 has no tiles")
        threads = V1_THREADS
        return Plan("forward", "v1", "forward_v1", where, None, None,
                    (math.ceil(p.Sq / threads), p.BH), (threads,), 0, p.acc_dtype, p.causal,
                    reason + f"; {threads} query rows per block", variant)

    if version == "v3":
        wanted = needs_variants(p)
        if wanted is not None:
            raise ValueError(f"forward v3 cannot run this input: it computes plain attention "
                             f"(with or without a causal mask) only, and this call asks for "
                             f"{wanted}; v1 and v2 (the default) support variants")
        refusal = tensor_core_refusal("v3", p, where)
        if refusal is not None:
            raise ValueError(f"forward v3 cannot run this input: {refusal}")
        if tiles is None:
            Br, Bc = default_v3_tiles(p.d)
            reason += f"; tiles by the v3 rule for d={p.d}"
        else:
            Br, Bc = check_v3_tiles(tiles, p.d)
            reason += "; tiles given by the caller"
        return Plan("forward", "v3", "forward_v3", where, Br, Bc, (math.ceil(p.Sq / Br), p.BH),
                    (32 * fwd_kernels.V3_WARPS,), v3_shared_bytes(Bc, p.d), p.acc_dtype,
                    p.causal, reason)

    if version in ("v4", "v5", "v6", "v7", "v8", "v9"):
        wanted = needs_variants(p)
        if wanted is not None:
            raise ValueError(f"forward {version} cannot run this input: it computes plain "
                             f"attention (with or without a causal mask) only, and this call "
                             f"asks for {wanted}; v1 and v2 (the default) support variants")
        if version in ("v6", "v8", "v9"):
            return _plan_forward_v6(p, where, tiles, reason, version)
        if version == "v7":
            return _plan_forward_v7(p, where, tiles, reason)
        return _plan_forward_blocked(p, where, tiles, reason, version)

    if tiles is None:
        Br, Bc = default_forward_tiles(p.d, p.acc_dtype)
        reason += f"; tiles by the default rule for d={p.d} in {p.acc_dtype}"
    else:
        Br, Bc = check_tiles(tiles, p.d, p.acc_dtype)
        reason += "; tiles given by the caller"
    if p.variant.tile_table:
        reason += TILE_TABLE_REASON
    return Plan("forward", "v2", "forward_v2", where, Br, Bc, (math.ceil(p.Sq / Br), p.BH),
                (Br,), forward_shared_bytes(Br, Bc, p.d, p.acc_dtype), p.acc_dtype, p.causal,
                reason, variant)


def forward_kernel(plan, p):
    """The compiled-kernel factory call for a plan (cached per compile-time parameters)."""
    if plan.version == "v1":
        return fwd_kernels.make_forward_v1(p.d, p.upper, p.acc_dtype, p.variant)
    if plan.version == "v3":
        return fwd_kernels.make_forward_v3(plan.Bc, p.d, p.upper)
    if plan.version == "v4":
        TM, TN = plan.thread_tile
        return fwd_kernels.make_forward_v4(plan.Br, plan.Bc, TM, TN, p.d, p.upper, p.acc_dtype)
    if plan.version == "v5":
        TM, TN = plan.thread_tile
        return fwd_kernels.make_forward_v5(plan.Br, plan.Bc, TM, TN, p.d, p.upper, p.acc_dtype)
    if plan.version == "v6":
        return fwd_kernels.make_forward_v6(plan.Br, plan.Bc, p.d, p.upper)
    if plan.version == "v8":
        return fwd_kernels.make_forward_v8(plan.Br, plan.Bc, p.d, p.upper,
                                           v8_chunk(p.d, plan.Bc))
    if plan.version == "v9":
        return fwd_kernels.make_forward_v9(plan.Br, plan.Bc, p.d, p.upper,
                                           v8_chunk(p.d, plan.Bc))
    if plan.version == "v7":
        return fwd_kernels.make_forward_v7(plan.Br, plan.Bc, p.d, p.upper,
                                           v7_chunk(p.d, plan.Bc))
    return fwd_kernels.make_forward_v2(plan.Br, plan.Bc, p.d, p.upper, p.acc_dtype, p.variant)


TILE_TABLE_REASON = ("; the tiles that the mask leaves empty are skipped: a table of visible "
                     "tiles is computed first (kernel tile_table, one block per tile and "
                     "query head)")


def tile_table(p, Br, Bc, attn_mask):
    """The table of visible (Br x Bc) tiles, (B*Hq, Tr, Tc) bool on the device, for a
    Problem whose variant needs one (variants.make_tile_table), else None."""
    if not p.variant.tile_table:
        return None
    Tr, Tc = math.ceil(p.Sq / Br), math.ceil(p.Sk / Bc)
    tiles = cuda.device_array((p.BH, Tr, Tc), np.bool_)
    if Tr * Tc == 0:
        return tiles
    kernel = variant_kernels.make_tile_table(Br, Bc, p.upper, p.acc_dtype, p.variant)
    grid, block = (Tr * Tc, p.BH), (variant_kernels.TILE_TABLE_THREADS,)
    log.info("tile table: tile_table for (%d, %d) tiles, grid %s, block %s", Br, Bc, grid, block)
    if attn_mask is None:
        attn_mask = _placeholders(p.acc_dtype, _context_key())[1]
    kernel[grid, block](tiles, np.int64(p.Sq), np.int64(p.Sk), np.int64(p.causal_offset),
                        np.int64(p.window_lo), np.int64(p.Hq), attn_mask)
    return tiles


def variant_arguments(p, slopes, attn_mask, tiles=None):
    """The run-time arguments that follow ``causal_offset`` in every kernel that supports
    variants: (window_lo, Hq, group, softcap, slopes, attn_mask, tiles). ``slopes``,
    ``attn_mask`` and ``tiles`` (from ``tile_table``) are device arrays or None (then a
    1-element placeholder that the kernel, compiled without that variant, never reads)."""
    acc = np.dtype(p.acc_dtype)
    no_slopes, no_mask, no_tiles = _placeholders(p.acc_dtype, _context_key())
    return (np.int64(p.window_lo), np.int64(p.Hq), np.int64(p.group), acc.type(p.softcap),
            no_slopes if slopes is None else slopes, no_mask if attn_mask is None else attn_mask,
            no_tiles if tiles is None else tiles)


def _context_key():
    """Which CUDA context is current (device arrays belong to one); None on the simulator."""
    return None if simulating() else id(cuda.current_context())


@functools.lru_cache(maxsize=None)
def _placeholders(acc_dtype, context):
    """The 1-element device arrays passed for the variant arguments a kernel does not use
    (slopes, attn_mask, tiles), made once per context rather than copied to the device on
    every call (three host-to-device copies per launch, for nothing)."""
    return (cuda.to_device(np.zeros((1, 1), acc_dtype)),
            cuda.to_device(np.zeros((1, 1, 1, 1), np.bool_)),
            cuda.to_device(np.zeros((1, 1, 1), np.bool_)))


def launch_forward(plan, p, Q, K, V, O, L, slopes=None, attn_mask=None):
    """Launch the planned forward kernel on device arrays: Q, O (B*Hq, Sq, d), K, V
    (B*Hkv, Sk, d), L (B*Hq, Sq); ``slopes`` and ``attn_mask`` as the Problem's, on the
    device (or None)."""
    log.info("%s", plan)
    kernel = forward_kernel(plan, p)
    scale = np.dtype(p.acc_dtype).type(p.softmax_scale)   # keep the kernel's arithmetic in acc dtype
    args = (Q, K, V, O, L, scale, np.int64(p.causal_offset))
    if plan.version in ("v1", "v2"):     # the kernels that take the variant arguments
        tiles = tile_table(p, plan.Br, plan.Bc, attn_mask) if plan.version == "v2" else None
        args += variant_arguments(p, slopes, attn_mask, tiles)
    # The argument types follow from the input dtype, unless the caller passed arrays of
    # their own (slopes, attn_mask: any dtype and layout); then the dispatcher types them.
    types_key = (p.dtype, p.acc_dtype) if slopes is None and attn_mask is None else None
    launch(kernel, plan.grid, plan.block, args, types_key, forward_dynamic_shared_bytes(plan))


def forward_dynamic_shared_bytes(plan):
    """The dynamic shared memory a forward launch must ask for: v5's to v9's tiles (their
    ``shared_bytes``); 0 for the versions whose shared arrays are static."""
    return plan.shared_bytes if plan.version in ("v5", "v6", "v7", "v8", "v9") else 0


# ---------------------------------------------------------------------------------------
# Backward


class Plans(tuple):
    """The kernels a pass runs, in launch order (a tuple of ``Plan``); str() gives one
    line per kernel."""

    def __str__(self):
        return "\n".join(str(plan) for plan in self)


def dkdv_shared_bytes(Br, Bc, d, acc_dtype):
    """Shared memory of the dK/dV kernels: Kj, Vj (Bc, d+1) + Qi, dOi (Br, d) + L_i, D_i (Br)."""
    return (2 * Bc * (d + 1) + 2 * Br * d + 2 * Br) * np.dtype(acc_dtype).itemsize


def dq_shared_bytes(Br, Bc, d, acc_dtype):
    """Shared memory of the dQ kernel: Qi, dOi (Br, d+1) + Kj, Vj (Bc, d)."""
    return (2 * Br * (d + 1) + 2 * Bc * d) * np.dtype(acc_dtype).itemsize


def backward_shared_bytes(Br, Bc, d, acc_dtype):
    """The larger of the two tiled backward kernels' shared memory (the tile rule's test)."""
    return max(dkdv_shared_bytes(Br, Bc, d, acc_dtype), dq_shared_bytes(Br, Bc, d, acc_dtype))


def default_backward_tiles(d, acc_dtype):
    """The documented backward tile rule (module docstring): largest candidate that fits."""
    for Br, Bc in TILE_CANDIDATES:
        if backward_shared_bytes(Br, Bc, d, acc_dtype) <= SHARED_MEM_LIMIT:
            return Br, Bc
    raise ValueError(f"no backward tile size fits head dim {d} in {acc_dtype} within "
                     f"{SHARED_MEM_LIMIT} bytes of shared memory")


def check_backward_tiles(tiles, d, acc_dtype):
    """Validate a caller's (Br, Bc) for the backward; ValueError names the limit."""
    Br, Bc = _parse_tiles(tiles)
    for name, n, what in (("Br", Br, "query row (dQ kernel)"), ("Bc", Bc, "key row (dK/dV kernel)")):
        if n > MAX_THREADS:
            raise ValueError(f"{name} = {n} exceeds {MAX_THREADS}: the backward runs one thread "
                             f"per {what}, and a block holds at most {MAX_THREADS} threads")
    need = backward_shared_bytes(Br, Bc, d, acc_dtype)
    if need > SHARED_MEM_LIMIT:
        raise ValueError(f"tiles (Br, Bc) = ({Br}, {Bc}) need {need} bytes of shared memory in "
                         f"the backward at head dim {d} in {acc_dtype}; the limit is "
                         f"{SHARED_MEM_LIMIT} (48 KB static shared memory per block)")
    return Br, Bc


# --- backward v3 (register-blocked SIMT; the default in float64 and at d > 128) ---------

# v3 tile rule: the first (Br, Bc, TM, TN) of BWD_V3_CANDIDATES whose two kernels fit in
# 48 KB of static shared memory and whose accumulators fit BWD_V3_MAX_ACC_REGS per thread:
# the dK/dV kernel keeps dKj, dVj and one Q tile's part of each (4 TN DNY values, DNY =
# d / TY rounded up), the dQ kernel dQi and one K/V tile's part (2 TM DNX, DNX = d / TX
# rounded up). If no candidate meets the register bound (d > 128 in float32), the first
# that fits in shared memory (ptxas then reports spills; tests/ptx_check.py prints them).
# Under the simulator, BWD_V3_SIM_TILES: small blocks (16 threads) that still have two
# threads and two entries per thread on each axis.
BWD_V3_CANDIDATES = ((32, 32, 4, 2), (16, 16, 2, 1), (16, 16, 1, 1), (8, 8, 1, 1),
                     (4, 4, 1, 1))
BWD_V3_MAX_ACC_REGS = 64
BWD_V3_SIM_TILES = (8, 8, 2, 2)


def dkdv_v3_shared_bytes(Br, Bc, TM, TN, d, acc_dtype):
    """Shared memory of backward_dkdv_v3: KjT, VjT (DPY, Bc+1), QiT, dOiT (DPY, Br+1),
    Pij, dSij (Br, Bc+1), L_i, D_i (Br); DPY = d rounded up to TY = Br // TM."""
    _, _, DPY, _, _, _ = bwd_kernels.v3_thread_grid(Br, Bc, TM, TN, d)
    n = 2 * DPY * (Bc + 1) + 2 * DPY * (Br + 1) + 2 * Br * (Bc + 1) + 2 * Br
    return n * np.dtype(acc_dtype).itemsize


def dq_v3_shared_bytes(Br, Bc, TM, TN, d, acc_dtype):
    """Shared memory of backward_dq_v3: QiT, dOiT (DPX, Br+1), KjT, VjT (DPX, Bc+1),
    dSij (Br, Bc+1); DPX = d rounded up to TX = Bc // TN."""
    _, _, _, _, DPX, _ = bwd_kernels.v3_thread_grid(Br, Bc, TM, TN, d)
    n = 2 * DPX * (Br + 1) + 2 * DPX * (Bc + 1) + Br * (Bc + 1)
    return n * np.dtype(acc_dtype).itemsize


def backward_v3_acc_regs(Br, Bc, TM, TN, d):
    """Accumulators per thread of (the dK/dV kernel, the dQ kernel), partials included."""
    _, _, _, DNY, _, DNX = bwd_kernels.v3_thread_grid(Br, Bc, TM, TN, d)
    return 4 * TN * DNY, 2 * TM * DNX


def _v3_fits(t, d, acc_dtype):
    return max(dkdv_v3_shared_bytes(*t, d, acc_dtype),
               dq_v3_shared_bytes(*t, d, acc_dtype)) <= SHARED_MEM_LIMIT


def default_backward_v3_tiles(d, acc_dtype):
    """The v3 tile rule (above), (Br, Bc, TM, TN). GPU, float32: d <= 64 -> (32, 32, 4, 2),
    128 threads; d = 128 -> (16, 16, 2, 1), 128 threads; d = 256 -> (8, 8, 1, 1), 64
    threads (over the register bound); float64: d = 64 -> (16, 16, 2, 1)."""
    if simulating():
        return BWD_V3_SIM_TILES
    fits = [t for t in BWD_V3_CANDIDATES if _v3_fits(t, d, acc_dtype)]
    for t in fits:
        if max(backward_v3_acc_regs(*t, d)) <= BWD_V3_MAX_ACC_REGS:
            return t
    if fits:
        return fits[0]
    raise ValueError(f"backward v3 cannot run this input: no v3 tile fits head dim {d} in "
                     f"{acc_dtype} within {SHARED_MEM_LIMIT} bytes of shared memory")


def check_backward_v3_tiles(tiles, d, acc_dtype):
    """A caller's backward v3 tiles (``_check_thread_tiles``, as forward v4); both v3
    kernels must fit."""
    return _check_thread_tiles(
        tiles, d, acc_dtype, "backward v3",
        lambda Br, Bc, TM, TN: max(dkdv_v3_shared_bytes(Br, Bc, TM, TN, d, acc_dtype),
                                   dq_v3_shared_bytes(Br, Bc, TM, TN, d, acc_dtype)))


def _plan_backward_blocked(p, where, tiles, reason, preprocess, version):
    """The Plans of the register-blocked backward ``version`` ("v3" or "v4": v3's kernels
    with dynamic shared memory; each Plan's ``shared_bytes`` is then what its launch asks
    for)."""
    default_tiles, check_tiles, dkdv_bytes, dq_bytes, why = {
        "v3": (default_backward_v3_tiles, check_backward_v3_tiles, dkdv_v3_shared_bytes,
               dq_v3_shared_bytes,
               "measured on the H200: 3.7x to 7.4x faster than v1 (docs/gpu-results.md)"),
        "v4": (default_backward_v4_tiles, check_backward_v4_tiles, dkdv_v4_shared_bytes,
               dq_v4_shared_bytes,
               "v3's kernels with their shared memory taken from dynamic shared memory (may "
               "exceed 48 KB); measured on the H200: as fast as v3 to 1.4x faster "
               "(runs 20-26)")}[version]
    if tiles is None:
        Br, Bc, TM, TN = default_tiles(p.d, p.acc_dtype)
        reason += f"; tiles by the {version} rule for d={p.d} in {p.acc_dtype}"
        if where == "simulator":
            reason += " (small tiles on the simulator, where every thread and barrier is slow)"
    else:
        Br, Bc, TM, TN = check_tiles(tiles, p.d, p.acc_dtype)
        reason += "; tiles given by the caller"
    reason += "; " + why
    threads = (Br // TM) * (Bc // TN)
    Tr, Tc = math.ceil(p.Sq / Br), math.ceil(p.Sk / Bc)
    return Plans((
        preprocess,
        Plan("backward dK dV", version, f"backward_dkdv_{version}", where, Br, Bc, (Tc, p.BH),
             (threads,), dkdv_bytes(Br, Bc, TM, TN, p.d, p.acc_dtype), p.acc_dtype, p.causal,
             reason + "; one block per K/V tile, each thread a block of keys",
             thread_tile=(TM, TN)),
        Plan("backward dQ", version, f"backward_dq_{version}", where, Br, Bc, (Tr, p.BH),
             (threads,), dq_bytes(Br, Bc, TM, TN, p.d, p.acc_dtype), p.acc_dtype, p.causal,
             reason + "; one block per Q tile, each thread a block of query rows",
             thread_tile=(TM, TN)),
    ))


# --- backward v4 (v3 with dynamic shared memory; the default for plain attention) ------

# v4 runs v3's two kernels with their shared arrays carved out of dynamic shared memory
# (kernels/backward.py, make_backward_dkdv_v4 and make_backward_dq_v4), so the same bytes
# (dkdv_v4_shared_bytes equals dkdv_v3_shared_bytes, dq_v4 dq_v3) may exceed 48 KB. Tile
# rule: the first (Br, Bc, TM, TN) of BWD_V4_CANDIDATES whose two kernels fit in
# BWD_V4_SHARED_MEM_TARGET (100 KB: two blocks fit the 228 KB of an H200 SM; on a GPU
# that allows a block less, its own maximum, device_dynamic_shared_limit) and whose
# accumulators fit BWD_V3_MAX_ACC_REGS, as for v3 (if none does, the first that fits in
# shared memory). A caller's tiles may use up to DYNAMIC_SHARED_MEM_LIMIT (227 KB per
# block on the H100/H200; kernels/smem.py checks the device's own maximum again before
# the launch). GPU, float32: d <= 64 -> (64, 64, 4, 4), 256 threads, 100352 / 83200
# bytes at d = 64; 64 < d <= 128 -> (32, 32, 2, 2), 256 threads, 76288 / 71808 bytes at
# d = 128 (v3: (16, 16, 2, 1), 128 threads; (64, 64, 4, 4) needs 167 KB and (32, 32, 4, 2)
# 128 dK/dV accumulators a thread); d = 256 -> (16, 16, 1, 1), 71936 / 69696 bytes,
# within the register bound (v3: (8, 8, 1, 1), over it). Measured (scripts/bwd_v4_sweep.py,
# run 21, unsigned tile indices, (2, 16, 4096, d), not causal / causal): d = 64, (64, 64,
# 4, 4) 30.71 / 17.26 ms, v3's tiles 38.03 / 20.85; d = 128, (32, 32, 2, 2) 84.28 / 45.87
# ms, (64, 64, 4, 4) 81.29 / 42.44 at one block per SM, the others 94-124 / 55-67. Run 18,
# before the unsigned indices, had v4 slower than v3 with every tile. Under the simulator,
# BWD_V4_SIM_TILES, as v3's.
BWD_V4_CANDIDATES = ((64, 64, 4, 4), (32, 32, 4, 2), (32, 32, 2, 2), (16, 16, 2, 1),
                     (16, 16, 1, 1), (8, 8, 1, 1), (4, 4, 1, 1))
BWD_V4_SHARED_MEM_TARGET = 100 * 1024
BWD_V4_SIM_TILES = BWD_V3_SIM_TILES


def dkdv_v4_shared_bytes(Br, Bc, TM, TN, d, acc_dtype):
    """Dynamic shared memory of backward_dkdv_v4: v3's eight arrays back to back
    (backward.dkdv_v4_shared_layout), the same bytes as ``dkdv_v3_shared_bytes``."""
    END = bwd_kernels.dkdv_v4_shared_layout(Br, Bc, TM, TN, d)[-1]
    return END * np.dtype(acc_dtype).itemsize


def dq_v4_shared_bytes(Br, Bc, TM, TN, d, acc_dtype):
    """Dynamic shared memory of backward_dq_v4: v3's five arrays back to back
    (backward.dq_v4_shared_layout), the same bytes as ``dq_v3_shared_bytes``."""
    END = bwd_kernels.dq_v4_shared_layout(Br, Bc, TM, TN, d)[-1]
    return END * np.dtype(acc_dtype).itemsize


def _bwd_v4_bytes(t, d, acc_dtype):
    """The larger of backward v4's two kernels' dynamic shared memory for tiles ``t``."""
    return max(dkdv_v4_shared_bytes(*t, d, acc_dtype), dq_v4_shared_bytes(*t, d, acc_dtype))


def default_backward_v4_tiles(d, acc_dtype):
    """The backward v4 tile rule (above), (Br, Bc, TM, TN). GPU, float32: d <= 64 ->
    (64, 64, 4, 4), 256 threads; d = 128 -> (32, 32, 2, 2), 256 threads; d = 256
    -> (16, 16, 1, 1), 256 threads; float64: d = 64 -> (32, 32, 4, 2), d = 128 ->
    (16, 16, 2, 1) (v3: (16, 16, 2, 1) and (8, 8, 1, 1))."""
    if simulating():
        return BWD_V4_SIM_TILES
    target = min(BWD_V4_SHARED_MEM_TARGET, device_dynamic_shared_limit())
    fits = [t for t in BWD_V4_CANDIDATES if _bwd_v4_bytes(t, d, acc_dtype) <= target]
    for t in fits:
        if max(backward_v3_acc_regs(*t, d)) <= BWD_V3_MAX_ACC_REGS:
            return t
    if fits:
        return fits[0]
    raise ValueError(f"backward v4 cannot run this input: no v4 tile fits head dim {d} in "
                     f"{acc_dtype} within {target} bytes of shared memory")


def check_backward_v4_tiles(tiles, d, acc_dtype):
    """A caller's backward v4 tiles (``_check_thread_tiles``), both kernels against the
    dynamic limit."""
    return _check_thread_tiles(tiles, d, acc_dtype, "backward v4",
                               lambda Br, Bc, TM, TN: _bwd_v4_bytes((Br, Bc, TM, TN), d,
                                                                    acc_dtype),
                               DYNAMIC_SHARED_MEM_LIMIT,
                               "227 KB dynamic shared memory per block on the H100/H200")


# --- backward v5 (tensor cores, 3xTF32; GPU only, finite inputs) ------------------------

# v5's dK/dV kernel owns Bc keys (Bc / 16 warps) and streams Q tiles of Br rows; its dQ
# kernel owns Br query rows (Br / 16 warps) and streams K/V tiles of Bc keys. Each holds
# four tiles of rows of DP + 4 floats (backward.v5_head_dim) in dynamic shared memory.
# Tile rule: the first (Br, Bc) of BWD_V5_CANDIDATES whose two kernels fit in
# BWD_V5_SHARED_MEM_TARGET (two blocks per H200 SM), or the device's own maximum if that
# is lower. Float32: d <= 64 -> (64, 64), 70 KB each; d = 128 -> (64, 32), 102 KB.
# A caller's tiles: Br and Bc multiples of 16 (warps of 16 rows; chunks of V5_CHUNK) up
# to 256, within 227 KB.
BWD_V5_CANDIDATES = ((64, 64), (64, 32), (32, 32), (32, 16), (16, 16))
BWD_V5_SHARED_MEM_TARGET = 113 * 1024
BWD_V5_MAX_HEAD_DIM = 128     # dKj and dVj fragments (d / 2 each a lane) in registers
# v6: v5's layout and candidates, within the device's own maximum instead (227 KB on the
# H200): (64, 64) at d <= 128 there (70 KB at d = 64; 135 KB, one block per SM, at
# d = 128: faster than (64, 32) at two blocks per SM, runs 37-38).
# v6's default plan, per kernel: (Br, Bc, pairs), pairs meaning its streamed tiles (the
# dK/dV kernel's Qi and dOi, the dQ kernel's Kj and Vj) are split once as staged and kept
# as TF32 pairs (backward.make_backward_dkdv_v6).
# * d > 64 (BWD_V6_WIDE): one block of 8 warps per SM (255 registers a thread). Wide
#   tiles first (run 57, (2, 16, 4096, 128), scripts/bwd_kernels.py): dK/dV (64, 128)
#   20.04 ms against (64, 64)'s 34.58, dQ (128, 64) 14.16 against 23.76. Then the
#   streamed side narrowed to 32 to make room for the pairs (run 63): dK/dV (32, 128)
#   with pairs 18.06 / 9.70 ms (not causal / causal) against (64, 128)'s 20.08 / 10.76,
#   dQ (128, 32) with pairs 12.72 / 7.13 against (128, 64)'s 14.15 / 7.66.
# * d <= 64 (BWD_V6_NARROW, by causal): three blocks of 4 warps per SM at 70 KB (168
#   registers); every wider tile was slower (run 57). With pairs at the same 70 KB (run
#   63, (2, 16, 4096, 64)): the dQ kernel (64, 32) 6.50 / 3.77 ms against (64, 64)'s
#   6.90 / 3.97; the dK/dV kernel (32, 64) 9.26 ms against 9.82 without the mask, but
#   5.99 against 5.46 with it, so causal keeps (64, 64) plain. (64, 64) with pairs (105
#   KB, two blocks per SM) was slower for both kernels: 10.86 and 7.63.
BWD_V6_WIDE = {"dkdv": (32, 128, True), "dq": (128, 32, True)}
BWD_V6_WIDE_MIN_HEAD_DIM = 65
BWD_V6_NARROW = {False: {"dkdv": (32, 64, True), "dq": (64, 32, True)},
                 True: {"dkdv": (64, 64, False), "dq": (64, 32, True)}}
# Float16 inputs keep run 57's tiles without pairs (by width, as above): the pairs were
# timed with float32 inputs only, and the float16 dQ kernel with pairs at d = 128, causal,
# needs 8 bytes of spill under CUDA 13.5's ptxas (tests/ptx_check.py), where its tiles
# without pairs need none.
BWD_V6_FLOAT16 = {"wide": {"dkdv": (64, 128, False), "dq": (128, 64, False)},
                  "narrow": {"dkdv": (64, 64, False), "dq": (64, 64, False)}}


def dkdv_v5_shared_bytes(Br, Bc, d, pairs=False):
    """Dynamic shared memory of backward_dkdv_v5 and _v6 (backward.dkdv_v5_shared_layout;
    v6 uses v5's layout; ``pairs``: v6 with Qi and dOi as split pairs)."""
    return bwd_kernels.dkdv_v5_shared_layout(Br, Bc, d, pairs)[-1] * 4


def dq_v5_shared_bytes(Br, Bc, d, pairs=False):
    """Dynamic shared memory of backward_dq_v5 and _v6 (backward.dq_v5_shared_layout;
    ``pairs``: v6 with Kj and Vj as split pairs)."""
    return bwd_kernels.dq_v5_shared_layout(Br, Bc, d, pairs)[-1] * 4


def _bwd_v5_bytes(Br, Bc, d):
    """The larger of backward v5's (and v6's) two kernels' dynamic shared memory."""
    return max(dkdv_v5_shared_bytes(Br, Bc, d), dq_v5_shared_bytes(Br, Bc, d))


def backward_tensor_core_refusal(version, p, where):
    """Why backward ``version`` ("v5" or "v6", the tensor-core versions) cannot run
    Problem ``p`` here, or None if it can."""
    if where != "gpu":
        return (f"{version} uses the tensor cores through inline PTX, which the simulator "
                f"cannot run (there, v4 computes the same thing)")
    if p.acc_dtype != "float32":
        return f"{version} computes in float32 (3xTF32); float64 inputs run on v3"
    if p.d > BWD_V5_MAX_HEAD_DIM:
        return (f"{version} keeps its dK, dV and dQ fragments in registers, which holds "
                f"head dims up to {BWD_V5_MAX_HEAD_DIM}")
    return None


def _bwd_v5_target(version):
    """The shared memory backward ``version``'s tile rule fills (above)."""
    limit = device_dynamic_shared_limit()
    return min(BWD_V5_SHARED_MEM_TARGET, limit) if version == "v5" else limit


def _bwd_v5_tiles_within(d, limit):
    """The first of BWD_V5_CANDIDATES whose two kernels fit ``limit`` bytes, or None."""
    return next(((Br, Bc) for Br, Bc in BWD_V5_CANDIDATES
                 if _bwd_v5_bytes(Br, Bc, d) <= limit), None)


def default_backward_v5_tiles(d, version="v5"):
    """The backward v5 / v6 tile rule (above), (Br, Bc)."""
    target = _bwd_v5_target(version)
    tiles = _bwd_v5_tiles_within(d, target)
    if tiles is not None:
        return tiles
    raise ValueError(f"backward {version} cannot run this input: no {version} tile fits "
                     f"head dim {d} within {target} bytes of shared memory")


def default_backward_v6_plan(d, causal, dtype="float32"):
    """Backward v6's default per kernel: {"dkdv": (Br, Bc, pairs), "dq": (Br, Bc, pairs)}.
    For float32 inputs BWD_V6_WIDE at d >= BWD_V6_WIDE_MIN_HEAD_DIM, BWD_V6_NARROW[causal]
    below; for float16 inputs BWD_V6_FLOAT16; where both kernels fit this device's shared
    memory; else the v5 / v6 rule's tiles (above) for both kernels, without pairs."""
    wide = d >= BWD_V6_WIDE_MIN_HEAD_DIM
    if np.dtype(dtype) == np.float16:
        rule = BWD_V6_FLOAT16["wide" if wide else "narrow"]
    else:
        rule = BWD_V6_WIDE if wide else BWD_V6_NARROW[bool(causal)]
    limit = device_dynamic_shared_limit()
    if (dkdv_v5_shared_bytes(*rule["dkdv"][:2], d, rule["dkdv"][2]) <= limit
            and dq_v5_shared_bytes(*rule["dq"][:2], d, rule["dq"][2]) <= limit):
        return dict(rule)
    tiles = default_backward_v5_tiles(d, "v6")
    return {"dkdv": tiles + (False,), "dq": tiles + (False,)}


def check_backward_v6_tiles(tiles, d):
    """A caller's backward v6 tiles: (Br, Bc) for both kernels, or ((Br, Bc), (Br, Bc))
    for the dK/dV kernel and the dQ kernel. Returns {"dkdv": ..., "dq": ...};
    ValueError names the limit."""
    try:
        nested = len(tiles) == 2 and all(isinstance(t, (tuple, list)) for t in tiles)
    except TypeError:
        nested = False
    if not nested:
        both = check_backward_v5_tiles(tiles, d, "v6")
        return {"dkdv": both, "dq": both}
    return {kind: check_backward_v5_tiles(t, d, "v6") for kind, t in zip(("dkdv", "dq"), tiles)}


def backward_v6_chunk(kind, Br, Bc):
    """The rows a step of backward v6's ``kind`` kernel ("dkdv" or "dq") takes of its
    streamed tile (Qi of Br rows, Kj of Bc): backward.V6_CHUNKS, or 16 if the tile is
    not a multiple of that."""
    chunk = bwd_kernels.V6_CHUNKS[kind]
    streamed = Br if kind == "dkdv" else Bc
    return chunk if streamed % chunk == 0 else bwd_kernels.V6_CHUNK


def check_backward_v5_tiles(tiles, d, version="v5"):
    """A caller's backward v5 / v6 tiles; ValueError names the limit."""
    Br, Bc = _parse_tiles(tiles)
    chunk = bwd_kernels.V5_CHUNK
    if Br % 16 or Bc % 16 or Br > 256 or Bc > 256:
        raise ValueError(f"backward {version} tiles must be (Br, Bc) with Br and Bc multiples "
                         f"of 16 up to 256 (warps of 16 rows, chunks of {chunk}); got "
                         f"({Br}, {Bc})")
    need = _bwd_v5_bytes(Br, Bc, d)
    if need > DYNAMIC_SHARED_MEM_LIMIT:
        raise ValueError(f"backward {version} tiles ({Br}, {Bc}) need {need} bytes of shared "
                         f"memory at head dim {d}; the limit is {DYNAMIC_SHARED_MEM_LIMIT} "
                         f"(227 KB dynamic shared memory per block on the H100/H200)")
    return Br, Bc


def _plan_backward_tensor_cores(p, where, tiles, reason, preprocess, version):
    refusal = backward_tensor_core_refusal(version, p, where)
    if refusal is not None:
        raise ValueError(f"backward {version} cannot run this input: {refusal}")
    if version == "v6":     # one pair of tiles per kernel, and pairs or not
        if tiles is None:
            per_kernel = default_backward_v6_plan(p.d, p.upper, p.dtype)
            reason += (f"; tiles by the v6 rule for d={p.d}"
                       + (", causal" if p.upper else "") + " (each kernel its own)")
        else:
            per_kernel = {kind: t + (False,)
                          for kind, t in check_backward_v6_tiles(tiles, p.d).items()}
            reason += "; tiles given by the caller"
    else:
        if tiles is None:
            both = default_backward_v5_tiles(p.d, version)
            reason += f"; tiles by the {version} rule for d={p.d}"
        else:
            both = check_backward_v5_tiles(tiles, p.d, version)
            reason += "; tiles given by the caller"
        per_kernel = {"dkdv": both + (False,), "dq": both + (False,)}
    reason += "; finite inputs only (checked before the launch)"
    Br, Bc, pairs = per_kernel["dkdv"]
    dkdv = Plan("backward dK dV", version, f"backward_dkdv_{version}", where, Br, Bc,
                (math.ceil(p.Sk / Bc), p.BH), (2 * Bc,),
                dkdv_v5_shared_bytes(Br, Bc, p.d, pairs), p.acc_dtype, p.causal,
                reason + "; one block per K/V tile, each warp 16 keys", pairs=pairs)
    Br, Bc, pairs = per_kernel["dq"]
    dq = Plan("backward dQ", version, f"backward_dq_{version}", where, Br, Bc,
              (math.ceil(p.Sq / Br), p.BH), (2 * Br,), dq_v5_shared_bytes(Br, Bc, p.d, pairs),
              p.acc_dtype, p.causal, reason + "; one block per Q tile, each warp 16 query rows",
              pairs=pairs)
    return Plans((preprocess, dkdv, dq))


def finite_inputs_plans(plans, p, asked, Q, K, V, O, dO, L):
    """``plans``, or v4's if they are v5's or v6's and an input holds NaN or inf (the
    tensor-core backward needs finite inputs: make_backward_dkdv_v5). One check kernel
    over the six arrays and a 4-byte copy back (a device synchronisation). ``asked``: the
    caller named the version, which then raises ValueError instead of running v4."""
    version = plans[-1].version
    if version not in ("v5", "v6"):
        return plans
    flag = cuda.to_device(np.zeros(1, np.int32))
    n = max(a.size for a in (Q, K, V, O, dO, L))
    threads = 256
    blocks = min(math.ceil(n / threads), 4096)
    launch(bwd_kernels.nonfinite_check, (blocks,), (threads,),
           tuple(arrays.flat_view(a) for a in (Q, K, V, O, dO, L)) + (flag,),
           (p.dtype, p.acc_dtype))
    if flag.copy_to_host()[0] == 0:
        return plans
    why = (f"the inputs hold NaN or inf (q, k, v, out, dout or lse), and backward "
           f"{version}'s tensor cores would carry them to keys that do not see them")
    if asked:
        raise ValueError(f"backward {version} cannot run this input: {why}; use v4 (the "
                         f"default falls back to it)")
    v4 = plan_backward(p, "v4")
    log.warning("backward: %s; running v4 instead of the default %s", why, version)
    return Plans(replace(plan, reason=f"{why}: v4 instead of the default {version}; "
                                      f"{plan.reason}")
                 for plan in v4)


def _default_backward_version(p, where):
    """The default backward version for ``p`` and why.

    On a GPU, v6 (tensor cores, 3xTF32) for plain attention, causal or not, in float32 or
    float16 with d <= 128, when the inputs are finite (the call checks them and runs v4
    otherwise, saying why: finite_inputs_plans). Measured on the H200 (scripts/
    bwd_v5_sweep.py, runs 37-38, (2, 16, 4096, d), float32, ms not causal / causal):
    d = 64, v6 19.0-19.3 / 11.7-12.2 against v4's 24.1-25.0 / 15.5-15.8; d = 128 with
    (64, 64) tiles and 32-key chunks in its dQ kernel, 60.5 / 33.7 against 64.9 / 35.1,
    and with each kernel's own tiles 37.6 / 21.3 against 64.3 / 34.0 (run 58); with the
    streamed tiles as split pairs (default_backward_v6_plan) the three kernels, each timed
    alone, take 15.86 ms at d = 64 without the mask (16.82 before) and 30.98 / 17.03 at
    d = 128 (34.43 / 18.60; run 63). Deterministic like v4 (no atomics).

    Elsewhere (the simulator, which cannot run v6, or a GPU where no v6 tile fits), v4
    (register-blocked, tiles in dynamic shared memory) for plain attention, causal or
    not, in float32 or float16 with d <= 128: deterministic like v1 and v3, and the
    fastest SIMT version on the H200 (docs/gpu-results.md, run 21, at (2, 16, 4096, d)):
    d = 64, 30.71
    ms against v3's 37.89 (run 20; both with unsigned tile indices); d = 128, 84.28 ms
    against v3's 119.44 (run 20). With while loops in both (run 26): 24.13 against 28.68
    ms and 65.41 against 89.33; causal at d = 64 they tie (15.63 and 15.56). v3 (the same
    kernels in 48 KB of static shared memory) in float64 and at d > 128, where v4 was not
    measured; v3 was 3.7x to 7.4x faster than v1 (run 11). v1 when the call asks for a
    variant (window, GQA, softcap, ALiBi, masks, user modifiers), which only v1 supports.
    """
    wanted = needs_variants(p)
    if wanted is not None:
        return "v1", (f"v1 is the default for variants ({wanted}): v3 and v4 compute plain "
                      f"attention only")
    if (where == "gpu" and p.acc_dtype == "float32" and p.d <= BWD_V5_MAX_HEAD_DIM
            and _bwd_v5_tiles_within(p.d, _bwd_v5_target("v6")) is not None):
        return "v6", ("v6 is the default for plain attention in float32 and float16 with "
                      f"d <= {BWD_V5_MAX_HEAD_DIM} on a GPU: tensor cores (3xTF32), "
                      "deterministic (no atomics), the fastest version measured on the "
                      "H200 (1.25x-1.39x v4 at d = 64, 1.59x-1.71x at d = 128)")
    if p.acc_dtype == "float32" and p.d <= V4_DEFAULT_MAX_HEAD_DIM:
        if where != "gpu":
            why = "; v6, the GPU default, uses the tensor cores, which the simulator cannot run"
        else:
            why = (f"; no v6 tile fits this GPU's {device_dynamic_shared_limit()} bytes of "
                   "shared memory")
        return "v4", ("v4 is the default for plain attention in float32 with d <= "
                      f"{V4_DEFAULT_MAX_HEAD_DIM} here: register-blocked, its tiles in "
                      "dynamic shared memory, deterministic (no atomics, so repeated runs are "
                      "bitwise identical)" + why)
    return "v3", (f"v3 is the default for plain attention in {p.acc_dtype} at d = {p.d}: "
                  "register-blocked, deterministic (no atomics, so repeated runs are bitwise "
                  f"identical); v4 was measured in float32 at d <= {V4_DEFAULT_MAX_HEAD_DIM} only")


def plan_backward(p, version=None, tiles=None):
    """Choose the backward kernels for Problem ``p``; returns ``Plans`` in launch order.

    ``version`` None means the default (``_default_backward_version``: v4, v3 in
    float64 and at d > 128, v1 for variants). Raises ValueError for an unknown version,
    bad tiles, v2 with float16 inputs, or v2/v3/v4 with a variant.
    """
    where = backend()
    if version is None:
        version, reason = _default_backward_version(p, where)
    elif version in bwd_kernels.VERSIONS:
        reason = f"{version} was asked for by the caller"
    else:
        raise ValueError(f"unknown backward version {version!r}; choose from {bwd_kernels.VERSIONS}")
    if version == "v2" and np.dtype(p.dtype) != np.dtype(p.acc_dtype):
        raise ValueError(f"backward v2 adds into dQ with atomics in the output dtype, so it needs "
                         f"float32 or float64 inputs; got {np.dtype(p.dtype)} (use v1)")
    if version in ("v2", "v3", "v4", "v5", "v6") and needs_variants(p) is not None:
        what = "v2 (a lesson)" if version == "v2" else version
        raise ValueError(f"backward {what} computes plain attention (with or without a "
                         f"causal mask) only, and this call asks for {needs_variants(p)}; "
                         f"use v1 (the default for variants)")
    variant = variant_description(p)

    threads = PREPROCESS_THREADS
    preprocess = Plan("backward D", version, "backward_preprocess", where, None, None,
                      (math.ceil(p.Sq / threads), p.BH), (threads,), 0, p.acc_dtype, p.causal,
                      f"D = rowsum(dO * O) (Alg.2 l.4), {threads} query rows per block")
    if version in ("v3", "v4"):
        return _plan_backward_blocked(p, where, tiles, reason, preprocess, version)
    if version in ("v5", "v6"):
        return _plan_backward_tensor_cores(p, where, tiles, reason, preprocess, version)

    if tiles is None:
        Br, Bc = default_backward_tiles(p.d, p.acc_dtype)
        reason += f"; tiles by the default backward rule for d={p.d} in {p.acc_dtype}"
    else:
        Br, Bc = check_backward_tiles(tiles, p.d, p.acc_dtype)
        reason += "; tiles given by the caller"
    Tr, Tc = math.ceil(p.Sq / Br), math.ceil(p.Sk / Bc)
    shared_dkdv = dkdv_shared_bytes(Br, Bc, p.d, p.acc_dtype)
    if version == "v1":
        gqa = (f"; GQA: each block sums over the {p.group} query heads of its K/V head in a "
               f"fixed order" if p.group > 1 else "")
        if p.variant.tile_table:
            gqa += TILE_TABLE_REASON
        return Plans((
            preprocess,
            Plan("backward dK dV", "v1", "backward_dkdv_v1", where, Br, Bc, (Tc, p.BHkv),
                 (Bc,), shared_dkdv, p.acc_dtype, p.causal,
                 reason + "; one block per K/V tile, one thread per key row" + gqa, variant),
            Plan("backward dQ", "v1", "backward_dq_v1", where, Br, Bc, (Tr, p.BH), (Br,),
                 dq_shared_bytes(Br, Bc, p.d, p.acc_dtype), p.acc_dtype, p.causal,
                 reason + "; one block per Q tile, one thread per query row"
                 + (TILE_TABLE_REASON if p.variant.tile_table else ""), variant),
        ))
    return Plans((
        preprocess,
        Plan("backward dK dV dQ", "v2", "backward_dkdv_dq_v2", where, Br, Bc, (Tc, p.BH), (Bc,),
             shared_dkdv, p.acc_dtype, p.causal,
             reason + "; one block per K/V tile; dQ by atomic adds (not bitwise reproducible)"),
    ))


def backward_kernel(plan, p):
    """The compiled-kernel factory call for one backward plan."""
    if plan.kernel == "backward_preprocess":
        return bwd_kernels.make_backward_preprocess(p.d, p.acc_dtype)
    if plan.version == "v3":
        make = {"backward_dkdv_v3": bwd_kernels.make_backward_dkdv_v3,
                "backward_dq_v3": bwd_kernels.make_backward_dq_v3}[plan.kernel]
        TM, TN = plan.thread_tile
        return make(plan.Br, plan.Bc, TM, TN, p.d, p.upper, p.acc_dtype)
    if plan.version in ("v5", "v6"):
        make = {"backward_dkdv_v5": bwd_kernels.make_backward_dkdv_v5,
                "backward_dq_v5": bwd_kernels.make_backward_dq_v5,
                "backward_dkdv_v6": bwd_kernels.make_backward_dkdv_v6,
                "backward_dq_v6": bwd_kernels.make_backward_dq_v6}[plan.kernel]
        if plan.version == "v6":
            kind = "dkdv" if plan.kernel == "backward_dkdv_v6" else "dq"
            chunk = backward_v6_chunk(kind, plan.Br, plan.Bc)
            return make(plan.Br, plan.Bc, p.d, p.upper, chunk, plan.pairs)
        return make(plan.Br, plan.Bc, p.d, p.upper)
    if plan.version == "v4":
        make = {"backward_dkdv_v4": bwd_kernels.make_backward_dkdv_v4,
                "backward_dq_v4": bwd_kernels.make_backward_dq_v4}[plan.kernel]
        TM, TN = plan.thread_tile
        return make(plan.Br, plan.Bc, TM, TN, p.d, p.upper, p.acc_dtype)
    if plan.kernel == "backward_dkdv_dq_v2":
        return bwd_kernels.make_backward_dkdv_dq_v2(plan.Br, plan.Bc, p.d, p.upper, p.acc_dtype)
    make = {"backward_dkdv_v1": bwd_kernels.make_backward_dkdv_v1,
            "backward_dq_v1": bwd_kernels.make_backward_dq_v1}[plan.kernel]
    return make(plan.Br, plan.Bc, p.d, p.upper, p.acc_dtype, p.variant)


def launch_backward(plans, p, Q, K, V, O, dO, L, D, dQ, dK, dV, slopes=None, attn_mask=None):
    """Launch the planned backward kernels, in order, on device arrays.

    Q, O, dO, dQ are (B*Hq, Sq, d); K, V, dK, dV are (B*Hkv, Sk, d); L and D are (B*Hq, Sq)
    in the accumulator dtype (D is scratch, written by the first kernel). For v2, dQ must
    be zero-filled (its kernel adds into it). ``slopes``, ``attn_mask``: as for the forward.
    """
    scale = np.dtype(p.acc_dtype).type(p.softmax_scale)   # keep the kernel's arithmetic in acc dtype
    offset = np.int64(p.causal_offset)
    tiled = [plan for plan in plans if plan.kernel in ("backward_dkdv_v1", "backward_dq_v1")]
    tiles = tile_table(p, tiled[0].Br, tiled[0].Bc, attn_mask) if tiled else None
    extra = variant_arguments(p, slopes, attn_mask, tiles)
    # As in launch_forward: the argument types follow from the dtypes unless the caller
    # passed arrays of their own (slopes, attn_mask).
    types_key = (p.dtype, p.acc_dtype) if slopes is None and attn_mask is None else None
    for plan in plans:
        log.info("%s", plan)
        if plan.kernel == "backward_preprocess":
            args = (dO, O, D)
        elif plan.kernel == "backward_dkdv_dq_v2":     # v2: one kernel for all three
            args = (Q, K, V, dO, L, D, dQ, dK, dV, scale, offset)
        elif plan.kernel.startswith("backward_dkdv_"):
            args = (Q, K, V, dO, L, D, dK, dV, scale, offset)
        else:                                           # backward_dq_v1, _v3, _v4
            args = (Q, K, V, dO, L, D, dQ, scale, offset)
        if plan.kernel in ("backward_dkdv_v1", "backward_dq_v1"):
            args += extra                               # the kernels that take variants
        # v4 to v6: dynamic shared memory, its bytes go with the launch
        dynamic = plan.shared_bytes if plan.kernel.endswith(("_v4", "_v5", "_v6")) else 0
        launch(backward_kernel(plan, p), plan.grid, plan.block, args, types_key, dynamic)
