"""The one place that decides which kernel runs, with which tiles and grid, and why.

``plan_forward`` turns a validated ``Problem`` into a ``Plan``; ``explain`` (in api.py)
returns that plan without running anything, and every launch logs it on the
``numbaflash`` logger at INFO level:

    import logging; logging.basicConfig(level=logging.INFO)

Tile rule (v2 forward): the first (Br, Bc) in ``TILE_CANDIDATES`` whose shared memory
(Qi padded to Br x (d+1), plus Kj and Vj of Bc x d, in the accumulator dtype) fits in the
48 KB of static shared memory a block may use. Bigger tiles mean fewer reloads of K and V
(Br) and fewer barriers (Bc). Examples, float32: d=64 -> (64, 32); d=128 -> (32, 16);
d=256 -> (16, 8). Callers may pass ``tiles=(Br, Bc)``; it is checked against the same
limits (Br <= 1024 threads, shared memory <= 48 KB).
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
    """Shared memory of the v2 forward kernel: Qi (Br, d+1) + Kj, Vj (Bc, d)."""
    return (Br * (d + 1) + 2 * Bc * d) * np.dtype(acc_dtype).itemsize


def default_forward_tiles(d, acc_dtype):
    """The documented tile rule (module docstring): largest candidate that fits."""
    for Br, Bc in TILE_CANDIDATES:
        if forward_shared_bytes(Br, Bc, d, acc_dtype) <= SHARED_MEM_LIMIT:
            return Br, Bc
    raise ValueError(f"no tile size fits head dim {d} in {acc_dtype} within "
                     f"{SHARED_MEM_LIMIT} bytes of shared memory")


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
