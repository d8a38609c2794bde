"""Tier 3: the @cuda.jit kernels, one package per pass (forward/, backward/), one file per
version, named by lineage; the building blocks they share beside them (plan.py, ptx.py,
warp.py, smem.py, bands.py, variants.py).

Two things about how Numba compiles loops shape the register-blocked kernels (forward v4
and v5, backward v3 and v4):

* Their multiply-add loops over k, over keys and over rows are ``while`` loops
  (``k = 0`` / ``while k < DP:`` / ... / ``k += 1``), not ``for k in range(DP)``.
  Numba lowers ``range`` to a loop that counts down the remaining trips with a compare
  and two selects per step (see the PTX), so ptxas, which turns PTX into machine code,
  cannot see the trip count and keeps one step per iteration: in forward v5's SASS
  (sm_90, d = 64, tiles (128, 64, 8, 4)) each step of its two loops took 59 and 57
  instructions for 32 FFMAs and 12 shared loads. A ``while`` loop's counter (``k += 1``,
  ``k != 64``) it can read, and it unrolls those loops four times: 186 and 185
  instructions for 128 FFMAs and 48 loads (``python lab/sweeps/sass_loops.py``; 46 instead
  of 58 per 32 FFMAs). NVVM unrolls neither (the PTX has one step per loop either way),
  and how far ptxas unrolls depends on the loop: backward v4's dK/dV loops at d = 64
  stay single steps, with fewer instructions than before (63 and 62 instead of 70 and
  69 per 32 FFMAs). The arithmetic, and so every result, is unchanged. Small loops with
  compile-time trip counts (``for a in range(TM)``) stay ``for`` loops: NVVM unrolls
  those completely.
* Indices that cannot be negative are passed as unsigned integers (``U`` in smem.py),
  which spares Numba's wraparound of negative indices (Python's ``a[-1]``); the loads of
  global tiles use them too.
"""

import numba
from numba import config

LOG2E = 1.4426950408889634              # log2(e): exp(x) = exp2(x * LOG2E)


def simulating():
    """True when Numba's CUDA simulator is on (NUMBA_ENABLE_CUDASIM=1, set by the user)."""
    return bool(config.ENABLE_CUDASIM)


def jit_options(max_registers=None):
    """Options for a @cuda.jit kernel of numbaflash: none by default.

    ``max_registers`` caps the registers a thread may use (ptxas's -maxrregcount, given
    when the kernel is linked): a kernel whose register count would cost it a block per
    SM asks for it (backward v6's dK/dV kernel with dropout). On the simulator, which has
    no registers and rejects the option, it is left out.

    ``lineinfo=True`` would let compute-sanitizer and profilers name source lines, but
    with numba-cuda 0.30.4 and NVVM from CUDA 13.0 and 13.5 it made the v2 forward's PTX
    branch to a label that does not exist ("ptxas: Unknown symbol '$L__BB0_159'", seen on
    the H200 on 2026-11-30; tests/ptx_check.py checks for it). The simulator rejects it
    anyway. Options the simulator rejects must only be added when not ``simulating()``.
    """
    if max_registers is None or simulating():
        return {}
    return {"max_registers": max_registers}


def acc_type(acc_dtype):
    """The numba scalar type kernels accumulate in: "float32" or "float64"."""
    return {"float32": numba.float32, "float64": numba.float64}[acc_dtype]


if simulating():
    # The simulator has no warp shuffles of its own; kernels/simulated.py supplies them
    # (and kernels/ptx.py its tensor-core instructions), so the GPU's kernels run there.
    from .simulated import install

    install()
