"""Tier 3: the @cuda.jit kernels, one file per pass, versions v1..vN inside each file."""

import numba
from numba import config


def simulating():
    """True when Numba's CUDA simulator is on (NUMBA_ENABLE_CUDASIM=1, set by the user)."""
    return bool(config.ENABLE_CUDASIM)


def jit_options():
    """Options for @cuda.jit. The simulator rejects ``lineinfo``; on a GPU it lets
    compute-sanitizer and profilers name source lines, at no cost to the machine code."""
    return {} if simulating() else {"lineinfo": True}


def acc_type(acc_dtype):
    """The numba scalar type kernels accumulate in: "float32" or "float64"."""
    return {"float32": numba.float32, "float64": numba.float64}[acc_dtype]
