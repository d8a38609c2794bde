"""The GPU's default tiles of the register-blocked kernels, run on the simulator too.

Under the simulator the tile rules pick small tiles (forward v5's V5_SIM_TILES,
backward v4's BWD_V4_SIM_TILES), because every thread and barrier is slow there, so the property suites
never run the tiles a GPU runs by default. Here each default kernel runs once with the
tiles its rule picks on a GPU (asked of the rule for where="gpu"), on a
small problem whose lengths cross those tiles' boundaries, and is checked against the
float64 reference by the suites' rules. On a GPU the same tests run the same tiles.
"""

import numpy as np
import pytest

import numbaflash
from numbaflash.kernels.backward import v4_dynamic_shared as bwd_v4
from numbaflash.kernels.forward import v5_dynamic_shared as fwd_v5
from backward_checks import check_backward
from strategies import make_case
from tolerance import check_forward, to_host

D = 8       # small enough for the simulator (TESTING.md), and the tiles are the rule's for d = 8


def gpu_tiles(rule, d, acc_dtype="float32"):
    """What ``rule`` picks on a GPU (the H200's limits without a GPU)."""
    return rule(d, acc_dtype, "gpu")


@pytest.mark.parametrize("causal", [None, "bottom_right"])
def test_forward_v5_with_the_gpu_default_tiles(causal):
    tiles = gpu_tiles(fwd_v5.default_v5_tiles, D)
    assert tiles == (128, 64, 8, 4)                 # the rule's choice at d <= 64 (H200)
    Br, Bc = tiles[:2]
    # two query tiles (the second one short) and three key tiles (the last one short)
    case = make_case(B=1, H=1, Sq=Br + 5, Sk=2 * Bc + 9, d=D, causal=causal, seed=5)
    out, lse = numbaflash.attention(case.q, case.k, case.v, causal=causal, version="v5",
                                    tiles=tiles, return_lse=True)
    check_forward(case.q, case.k, case.v, to_host(out), to_host(lse), causal=causal)


@pytest.mark.parametrize("causal", [None, "bottom_right"])
def test_backward_v4_with_the_gpu_default_tiles(causal):
    tiles = bwd_v4.default_backward_v4_tiles(D, "float32", "gpu")   # the GPU's rule, anywhere
    assert tiles == (64, 64, 4, 4)                  # the rule's choice at d <= 64 (H200)
    Br, Bc = tiles[:2]
    case = make_case(B=1, H=1, Sq=Br + 7, Sk=Bc + 3, d=D, causal=causal, seed=7,
                     with_dout=True)
    out, lse = numbaflash.attention(case.q, case.k, case.v, causal=causal, return_lse=True)
    out, lse = to_host(out), to_host(lse)
    grads = numbaflash.attention_backward(case.dout, case.q, case.k, case.v, out, lse,
                                          causal=causal, version="v4", tiles=tiles)
    check_backward(case.dout, case.q, case.k, case.v, out, lse,
                   tuple(to_host(g) for g in grads), causal=causal)
