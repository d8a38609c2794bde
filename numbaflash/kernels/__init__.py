"""Tier 3: the @cuda.jit kernels, one file per pass, versions v1..vN inside each file."""

import numba
from numba import config


def simulating():
    """True when Numba's CUDA simulator is on (NUMBA_ENABLE_CUDASIM=1, set by the user)."""
    return bool(config.ENABLE_CUDASIM)


def jit_options():
    """Options for every @cuda.jit kernel of numbaflash (none at the moment).

    ``lineinfo=True`` would let compute-sanitizer and profilers name source lines, but
    with numba-cuda 0.30.4 and NVVM from CUDA 13.0 and 13.5 it made the v2 forward's PTX
    branch to a label that does not exist ("ptxas: Unknown symbol '$L__BB0_159'", seen on
    the H200 on 2026-11-30; tests/ptx_check.py checks for it). The simulator rejects it
    anyway. Options the simulator rejects must only be added when not ``simulating()``.
    """
    return {}


def acc_type(acc_dtype):
    """The numba scalar type kernels accumulate in: "float32" or "float64"."""
    return {"float32": numba.float32, "float64": numba.float64}[acc_dtype]
