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
"""

import logging
import math
from dataclasses import dataclass

import numpy as np
from numba import cuda

from .kernels import forward as fwd_kernels
from .kernels import simulating

log = logging.getLogger("numbaflash")

SHARED_MEM_LIMIT = 48 * 1024   # static shared memory per block (bytes)
MAX_THREADS = 1024             # threads per block
V1_THREADS = 64                # v1: threads (query rows) per block
TILE_CANDIDATES = ((64, 64), (64, 32), (32, 32), (32, 16), (16, 16), (16, 8), (8, 8), (8, 4), (4, 4))
DEFAULT_FORWARD = "v2"


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


def check_tiles(tiles, d, acc_dtype):
    """Validate a caller's (Br, Bc) for the v2 forward; ValueError names the limit."""
    try:
        Br, Bc = (int(t) for t in tiles)
    except (TypeError, ValueError):
        raise ValueError(f"tiles must be a pair of positive ints (Br, Bc); got {tiles!r}") from None
    if Br < 1 or Bc < 1:
        raise ValueError(f"tiles must be positive; got (Br, Bc) = ({Br}, {Bc})")
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

    def __str__(self):
        tiles = f"tiles (Br, Bc) = ({self.Br}, {self.Bc}), " if self.Br else ""
        return (f"{self.pass_name}: {self.kernel} on the {self.backend}; {tiles}grid {self.grid}, "
                f"block {self.block}, shared memory {self.shared_bytes} B, accumulate in "
                f"{self.acc_dtype}, causal={self.causal}. Why: {self.reason}")


def plan_forward(p, version=None, tiles=None):
    """Choose the forward kernel for Problem ``p``. ``version`` None means the default."""
    where = backend()
    if version is None:
        version = DEFAULT_FORWARD
        reason = f"{version} is the default: the fastest forward version that runs on the {where}"
    elif version in fwd_kernels.VERSIONS:
        reason = f"{version} was asked for by the caller"
    else:
        raise ValueError(f"unknown forward version {version!r}; choose from {fwd_kernels.VERSIONS}")

    if version == "v1":
        if tiles is not None:
            raise ValueError("tiles apply to the tiled kernel (v2); v1 has no tiles")
        threads = V1_THREADS
        return Plan("forward", "v1", "forward_v1", where, None, None,
                    (math.ceil(p.Sq / threads), p.BH), (threads,), 0, p.acc_dtype, p.causal,
                    reason + f"; {threads} query rows per block")

    if tiles is None:
        Br, Bc = default_forward_tiles(p.d, p.acc_dtype)
        reason += f"; tiles by the default rule for d={p.d} in {p.acc_dtype}"
    else:
        Br, Bc = check_tiles(tiles, p.d, p.acc_dtype)
        reason += "; tiles given by the caller"
    return Plan("forward", "v2", "forward_v2", where, Br, Bc, (math.ceil(p.Sq / Br), p.BH),
                (Br,), forward_shared_bytes(Br, Bc, p.d, p.acc_dtype), p.acc_dtype, p.causal,
                reason)


def forward_kernel(plan, p):
    """The compiled-kernel factory call for a plan (cached per compile-time parameters)."""
    causal = p.causal is not None
    if plan.version == "v1":
        return fwd_kernels.make_forward_v1(p.d, causal, p.acc_dtype)
    return fwd_kernels.make_forward_v2(plan.Br, plan.Bc, p.d, causal, p.acc_dtype)


def launch_forward(plan, p, Q, K, V, O, L):
    """Launch the planned forward kernel on (BH, S, d) device arrays."""
    log.info("%s", plan)
    kernel = forward_kernel(plan, p)
    scale = np.dtype(p.acc_dtype).type(p.softmax_scale)   # keep the kernel's arithmetic in acc dtype
    kernel[plan.grid, plan.block](Q, K, V, O, L, scale, np.int64(p.causal_offset))
