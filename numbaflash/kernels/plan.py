"""What a launch is: ``Plan`` (one kernel, its tiles, grid, block, shared memory and why)
and ``Plans`` (the kernels of a pass in launch order), with the limits and tile checks
that several versions share.

Each version's file (kernels/forward/v*.py, kernels/backward/v*.py) builds its own Plan
from these pieces: its tile rule, its tile check, its shared memory, its grid. The policy
(numbaflash/policy.py) only picks the version.
"""

from dataclasses import dataclass

import numpy as np
from numba import config, cuda

from .variants import Variant

SHARED_MEM_LIMIT = 48 * 1024   # static shared memory per block (bytes)
MAX_THREADS = 1024             # threads per block
# Dynamic shared memory one block may use on the H100/H200 (CUDA's
# MAX_SHARED_MEMORY_PER_BLOCK_OPTIN there); kernels/smem.py allows a kernel more than 48 KB.
DYNAMIC_SHARED_MEM_LIMIT = 227 * 1024
DYNAMIC_LIMIT_WHY = "227 KB dynamic shared memory per block on the H100/H200"

# The variant of a packed batch of plain attention (packed_only).
PACKED_PLAIN = Variant(varlen=True)

TILE_TABLE_REASON = ("; the tiles that the mask leaves empty are skipped: a table of visible "
                     "tiles is computed first (kernel tile_table, one block per tile and "
                     "query head)")


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
    thread_tile: tuple | None = None    # forward v4, v5, backward v3, v4: (TM, TN), the block
                                        # of Sij each thread owns
    pairs: bool = False     # backward v6: the streamed tiles kept as split pairs
    dynamic_shared: bool = False    # shared_bytes go with the launch (dynamic shared memory)

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


class Plans(tuple):
    """The kernels a pass runs, in launch order (a tuple of ``Plan``); str() gives one
    line per kernel."""

    def __str__(self):
        return "\n".join(str(plan) for plan in self)


def here(where=None):
    """``where`` ("gpu" or "simulator"), or None for the backend this process runs on."""
    if where is not None:
        return where
    return "simulator" if config.ENABLE_CUDASIM else "gpu"


def device_dynamic_shared_limit(where=None):
    """The dynamic shared memory one block may use on the current GPU: CUDA's
    MAX_SHARED_MEMORY_PER_BLOCK_OPTIN (227 KB on the H100/H200, 163 KB on the A100, 99 KB
    on RTX 30 and 40 cards, 64 KB on RTX 20 cards). The default tile rules stay within
    it, so that the defaults run on every GPU and not only on the one they were measured
    on. Without a GPU (the simulator, or a machine that only plans, as the tests and
    ``explain(..., backend="gpu")`` do) it is DYNAMIC_SHARED_MEM_LIMIT, the H100/H200's."""
    if where != "gpu" or config.ENABLE_CUDASIM or not cuda.is_available():
        return DYNAMIC_SHARED_MEM_LIMIT
    return cuda.get_current_device().MAX_SHARED_MEMORY_PER_BLOCK_OPTIN


def parse_tiles(tiles):
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


def check_thread_tiles(tiles, d, acc_dtype, what, shared_bytes, limit=SHARED_MEM_LIMIT,
                       limit_why="48 KB static shared memory per block"):
    """A caller's register-blocked tiles for ``what`` (forward v4 and v5, backward v3 and
    v4): (Br, Bc, TM, TN), or (Br, Bc) with TM, TN the largest of 4, 2, 1 dividing Br, Bc.
    Checks that TM, TN divide the tile, the threads fit a block and ``shared_bytes(Br,
    Bc, TM, TN)`` fits in ``limit`` bytes (static shared memory unless said otherwise,
    ``limit_why``); ValueError names the limit."""
    if isinstance(tiles, (tuple, list)) and len(tiles) == 4:
        Br, Bc = parse_tiles(tiles[:2])
        TM, TN = parse_tiles(tiles[2:])
    else:
        Br, Bc = parse_tiles(tiles)
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


def check_warp_tiles(version, tiles, d, chunk, shared_bytes, staging_width, hint=""):
    """A caller's tiles for the warp-tiled forward versions (v6 to v9: warps of 16 query
    rows, 2 Br threads that stage one column each, ``staging_width(d)`` of them a row,
    ``chunk`` keys a step); ValueError names the limit."""
    Br, Bc = parse_tiles(tiles)
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


def rule_per_kernel_tiles(version, d, where, candidates, shared_bytes, target, simulator):
    """A backward tile rule with each kernel its own tiles (v7, v9): {"dkdv": (Br, Bc),
    "dq": (Br, Bc)}, for each kernel the first of ``candidates[kind]`` whose
    ``shared_bytes[kind](Br, Bc, d)`` fits ``target`` (or the device's maximum if lower);
    ``simulator`` on the simulator. ValueError, naming the limit, if none fits."""
    if where == "simulator":
        return dict(simulator)
    limit = min(target, device_dynamic_shared_limit(where))
    tiles = {}
    for kind, need in shared_bytes.items():
        tiles[kind] = next((t for t in candidates[kind] if need(*t, d) <= limit), None)
        if tiles[kind] is None:
            raise ValueError(f"backward {version} cannot run this input: no {version} tile "
                             f"fits head dim {d} within {limit} bytes of shared memory")
    return tiles


def check_per_kernel_tiles(version, tiles, d, shared_bytes, chunk):
    """A caller's tiles for a backward with each kernel its own (v7, v9): (Br, Bc) for both
    kernels, or ((Br, Bc), (Br, Bc)) for the dK/dV kernel and the dQ kernel, each Br and Bc
    a multiple of 16 up to 256 (warps of 16 rows, chunks of ``chunk``) whose
    ``shared_bytes[kind]`` fits the dynamic limit. Returns {"dkdv": ..., "dq": ...};
    ValueError names the limit."""
    try:
        nested = len(tiles) == 2 and all(isinstance(t, (tuple, list)) for t in tiles)
    except TypeError:
        nested = False
    per_kernel = dict(zip(("dkdv", "dq"), tiles if nested else (tiles, tiles)))
    for kind, pair in per_kernel.items():
        Br, Bc = parse_tiles(pair)
        if Br % 16 or Bc % 16 or Br > 256 or Bc > 256:
            raise ValueError(f"backward {version} tiles must be (Br, Bc) with Br and Bc "
                             f"multiples of 16 up to 256 (warps of 16 rows, chunks of "
                             f"{chunk}); got ({Br}, {Bc})")
        need = shared_bytes[kind](Br, Bc, d)
        if need > DYNAMIC_SHARED_MEM_LIMIT:
            raise ValueError(f"backward {version} tiles ({Br}, {Bc}) need {need} bytes of "
                             f"shared memory in its {kind} kernel at head dim {d}; the limit "
                             f"is {DYNAMIC_SHARED_MEM_LIMIT} ({DYNAMIC_LIMIT_WHY})")
        per_kernel[kind] = (Br, Bc)
    return per_kernel


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


def packed_only(p):
    """Whether Problem ``p``'s one variant is a packed batch (``Variant.varlen``) of plain
    attention, with or without the causal mask: what a version whose module sets
    ``PACKED`` computes besides plain attention."""
    return p.variant == PACKED_PLAIN and p.group == 1 and p.window is None


def computes(module, p):
    """Whether the version of ``module`` computes Problem ``p``: plain attention; every
    variant if it takes variants (its ``VARIANTS``); a packed batch of plain attention if
    its ``PACKED`` says so (a module without the name takes packed batches only through
    VARIANTS)."""
    return (needs_variants(p) is None or module.VARIANTS
            or (getattr(module, "PACKED", False) and packed_only(p)))


def takes_variant_arguments(module, p):
    """Whether the kernels of ``module`` built for Problem ``p`` take the variant run-time
    arguments after causal_offset (launcher.variant_arguments): every build of a version
    that takes variants, and the packed-batch build of one that sets ``PACKED``."""
    return bool(module.VARIANTS or (getattr(module, "PACKED", False) and p.variant.varlen))


def refuse_variants(version, p, packed=False):
    """ValueError for a forward ``version`` that computes plain attention only, if
    Problem ``p`` asks for a variant; with ``packed``, a packed batch of plain attention
    is not refused (packed_only)."""
    wanted = needs_variants(p)
    if packed and packed_only(p):
        return
    if wanted is not None:
        also = ", in one batch or packed," if packed else ""
        raise ValueError(f"forward {version} cannot run this input: it computes plain "
                         f"attention{also} (with or without a causal mask) only, and this "
                         f"call asks for {wanted}; v1 and v2 (the default) support variants")


def refuse_backward_variants(version, p, packed=False):
    """ValueError for a backward ``version`` that computes plain attention only, if
    Problem ``p`` asks for a variant; with ``packed``, a packed batch of plain attention
    is not refused (packed_only)."""
    wanted = needs_variants(p)
    if packed and packed_only(p):
        return
    if wanted is not None:
        what = "v2 (a lesson)" if version == "v2" else version
        also = ", in one batch or packed," if packed else ""
        raise ValueError(f"backward {what} computes plain attention{also} (with or without a "
                         f"causal mask) only, and this call asks for {wanted}; "
                         f"use v1 (the default for variants)")


def tensor_core_refusal(version, p, where, max_d, kept):
    """Why the 3xTF32 tensor-core ``version`` cannot run Problem ``p`` (on a GPU, or on
    the simulator through kernels/simulated.py), or None: it needs float32 accumulation
    and d <= ``max_d`` (``kept``: what it keeps in registers)."""
    if p.acc_dtype != "float32":
        return f"{version} computes in float32 (3xTF32); float64 inputs run on v2"
    if p.d > max_d:
        return f"{version} keeps {kept} in registers, which holds head dims up to {max_d}"
    return None
