"""L2 (simulator) / L3 (GPU): the variants in backward v6, the 3xTF32 tensor-core backward.

test_variants.py's property tests run every version that takes variants, but on the
simulator they skip the tensor-core versions: there every mma is a rendezvous of a warp's
32 Python threads, too slow for Hypothesis. This file gives backward v6 fixed small cases
instead, one per variant, each against the float64 reference with backward_checks'
rule (``check_backward``: exact zeros for rows that see no key and keys that no row
sees). On the simulator the cases use small tiles (``SIM_TILES``) so that each axis
crosses two or three tile boundaries with a ragged last tile; on a GPU the same cases
run at bigger shapes with v6's own tiles. The forward that gives out and lse is v2
(variants, GPU and simulator). Outputs are pre-filled with NaN, so an element the kernels
never write shows.

Simulator cost: 127 s for the whole file on a quiet core, 183 s on a busy shared machine
(``pytest --durations=10``); the GQA case, run twice for the bitwise check, is the
longest (17 s).
"""

import sys

import numpy as np
import pytest

import numbaflash
from numbaflash import launcher
from numbaflash.api import _variant_arrays
from numbaflash.validate import check_attention_inputs
from backward_checks import check_backward
from strategies import make_case, on_gpu
from test_variants import (documents, far_apart_heads, relative_bias, relative_bias_grad,
                           squash, squash_grad)
from tolerance import assert_bitwise_equal, to_host

pytestmark = pytest.mark.usefixtures("nan_prefilled_outputs")

SIM_TILES = (16, 16)        # both kernels: warps of 16 rows, one warp a block


@pytest.fixture(autouse=True, scope="module")
def _fast_thread_switches():
    """The simulator's threads take turns faster (TESTING.md: 5x on a small forward)."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(2e-4)
    yield
    sys.setswitchinterval(before)


def sized(Sq, Sk, d=8):
    """(Sq, Sk, d, tiles): the simulator's small shape and tiles, or on a GPU a shape 8x
    longer at d = 64 with v6's own tiles."""
    if on_gpu():
        return 8 * Sq, 8 * Sk, 64, None
    return Sq, Sk, d, SIM_TILES


def case_of(Sq, Sk, *, B=1, H=2, Hkv=None, dtype="float32", causal=None, seed=0):
    """A case at ``sized`` shapes, and the tiles to give v6."""
    Sq, Sk, d, tiles = sized(Sq, Sk)
    case = make_case(B=B, H=H, Hkv=Hkv, Sq=Sq, Sk=Sk, d=d, dtype=dtype, causal=causal,
                     seed=seed, with_dout=True)
    return case, tiles


def v6_backward(dout, q, k, v, kw, causal=None, tiles=None):
    """out, lse from forward v2; v6's gradients; both checked by the rule. Returns
    (out, lse, (dq, dk, dv)) on the host."""
    out, lse = numbaflash.attention(q, k, v, return_lse=True, version="v2", causal=causal,
                                    **kw)
    out, lse = to_host(out), to_host(lse)
    grads = numbaflash.attention_backward(dout, q, k, v, out, lse, version="v6", tiles=tiles,
                                          causal=causal, **kw)
    grads = tuple(to_host(g) for g in grads)
    assert grads[1].shape == k.shape and grads[2].shape == v.shape
    check_backward(dout, q, k, v, out, lse, grads, causal=causal, **kw)
    return out, lse, grads


def run_case(case, tiles, kw):
    return v6_backward(case.dout, case.q, case.k, case.v, kw, case.causal, tiles)


# --- band masks -------------------------------------------------------------------------------

@pytest.mark.parametrize("causal, window, Sq, Sk", [
    (None, (5, 3), 37, 45),
    ("top_left", (7, -1), 45, 37),
    ("bottom_right", (4, 2), 37, 45),
    ("bottom_right", (3, 0), 45, 37),
])
def test_window(causal, window, Sq, Sk):
    """A sliding window, alone and with either causal alignment; Sq != Sk both ways, so
    whole tiles fall outside the band on both sides."""
    case, tiles = case_of(Sq, Sk, causal=causal, seed=1)
    run_case(case, tiles, {"window_size": window})


def test_rows_that_see_no_key_get_exact_zeros():
    """Sq > Sk with a window (0, 0): the first Sq - Sk rows see no key (lse -inf); their
    dQ is exactly 0 and no gradient holds a NaN."""
    case, tiles = case_of(45, 20, seed=4)
    _, lse, grads = run_case(case, tiles, {"window_size": (0, 0)})
    blind = case.Sq - case.Sk
    assert np.all(np.isneginf(lse[..., :blind]))
    assert np.array_equal(grads[0][..., :blind, :], np.zeros_like(grads[0][..., :blind, :]))
    assert all(np.isfinite(g).all() for g in grads)


# --- GQA --------------------------------------------------------------------------------------

def test_gqa_sums_over_the_group_deterministically():
    """B = 2, Hq = 4 on Hkv = 2 K/V heads far apart in value (a query head that reads the
    wrong K/V head is off by 10 or more), causal: dK, dV summed over each group by the
    rule, and a second run gives the same bits (a fixed order, no atomics). One Q tile on
    the simulator (each dK/dV block walks one tile per query head), two ragged K/V tiles."""
    Sq, Sk, d, tiles = sized(13, 29)
    q, k, v, dout = (a.astype(np.float32) for a in far_apart_heads(
        B=2, Hkv=2, group=2, Sq=Sq, Sk=Sk, d=d, seed=5))
    out, lse, first = v6_backward(dout, q, k, v, {}, "bottom_right", tiles)
    again = numbaflash.attention_backward(dout, q, k, v, out, lse, version="v6", tiles=tiles,
                                          causal="bottom_right")
    for name, a, b in zip(("dQ", "dK", "dV"), first, again):
        assert_bitwise_equal(name, a, b)


def test_mqa_with_a_window_and_the_default_tiles():
    """MQA (two query heads on one K/V head) with a window and v6's own per-kernel tiles
    (on the simulator dK/dV (16, 32), dQ (32, 16) with Kj and Vj as split pairs)."""
    case, _ = case_of(37, 40, H=2, Hkv=1, causal="top_left", seed=6)
    run_case(case, None, {"window_size": (9, -1)})


# --- score modifiers -------------------------------------------------------------------------

def test_softcap():
    """Softcap 2.0 (dS times 1 - tanh^2), causal."""
    case, tiles = case_of(37, 40, causal="bottom_right", seed=8)
    run_case(case, tiles, {"softcap": 2.0})


def test_alibi():
    """ALiBi slopes per (batch, query head), B = 2."""
    case, tiles = case_of(30, 37, B=2, H=1, seed=9)
    slopes = case.rng.uniform(0.05, 1.0, (case.B, case.H)).astype(np.float32)
    run_case(case, tiles, {"alibi_slopes": slopes})


def test_bias_with_minus_inf_entries():
    """An additive attn_mask (per head, broadcast over the batch) with -inf entries: weight
    0, computed; one row all -inf (it sees no key, lse -inf: exactly 0 dQ)."""
    case, tiles = case_of(37, 33, seed=10)
    bias = case.rng.uniform(-2, 2, (case.H, case.Sq, case.Sk)).astype(np.float32)
    bias[case.rng.random(bias.shape) < 0.2] = -np.inf
    bias[1, 3, :] = -np.inf
    _, lse, grads = run_case(case, tiles, {"attn_mask": bias})
    assert np.isneginf(lse[0, 1, 3])
    assert not grads[0][0, 1, 3].any()


@pytest.mark.parametrize("name", ["squash", "relative"])
def test_score_mod_with_its_gradient(name):
    """A user score_mod with score_mod_grad: squash (d/ds = 1 - s^2 / 10, not 1) and a
    per-head relative bias."""
    mod, grad = {"squash": (squash, squash_grad),
                 "relative": (relative_bias, relative_bias_grad)}[name]
    case, tiles = case_of(33, 37, causal="top_left", seed=11)
    run_case(case, tiles, {"score_mod": mod, "score_mod_grad": grad})


# --- data masks: a table of visible tiles --------------------------------------------------

def test_bool_mask_with_a_fully_masked_tile():
    """A boolean attn_mask (B, 1, Sq, Sk) with the second Q tile's rows blind to the first
    K/V tile (an empty tile: skipped by both kernels), a row that sees nothing (exactly 0
    dQ) and a key that no row sees (exactly 0 dK, dV)."""
    case, tiles = case_of(40, 45, seed=12)
    mask = case.rng.random((case.B, 1, case.Sq, case.Sk)) < 0.7
    dq_plan = numbaflash.explain_backward(case.q, case.k, case.v, version="v6", tiles=tiles,
                                          attn_mask=mask)[-1]
    Br, Bc = dq_plan.Br, dq_plan.Bc     # the tiles of both kernels and of the table
    mask[:, :, Br:2 * Br, :Bc] = False
    mask[:, :, 5, :] = False
    mask[:, :, :, 7] = False
    p = check_attention_inputs(case.q, case.k, case.v, attn_mask=mask)
    table = to_host(launcher.tile_table(p, Br, Bc, _variant_arrays(p)[1]))
    assert not table[:, 1, 0].any() and table.sum() < table.size
    _, _, grads = run_case(case, tiles, {"attn_mask": mask})
    assert not grads[0][:, :, 5].any()
    assert not grads[1][:, :, 7].any() and not grads[2][:, :, 7].any()


def test_mask_mod_with_mqa():
    """A document mask_mod (documents of 5 positions) on MQA, causal: the tiles far off the
    diagonal are empty and skipped (their table entries are False)."""
    case, tiles = case_of(37, 37, H=2, Hkv=1, causal="bottom_right", seed=13)
    run_case(case, tiles, {"mask_mod": documents})


def test_everything_at_once_in_float16():
    """float16 inputs (computed in float32): MQA, causal, window, softcap, ALiBi, a float16
    bias with -inf entries and score_mod, all compiled in together."""
    case, tiles = case_of(33, 40, H=2, Hkv=1, dtype="float16", causal="bottom_right",
                          seed=14)
    bias = case.rng.uniform(-1, 1, (case.Sq, case.Sk)).astype(np.float16)
    bias[case.rng.random(bias.shape) < 0.1] = -np.inf
    run_case(case, tiles, {"window_size": (11, 3), "softcap": 30.0,
                           "alibi_slopes": np.linspace(0.1, 0.4, case.H, dtype=np.float32),
                           "attn_mask": bias, "score_mod": relative_bias,
                           "score_mod_grad": relative_bias_grad})


# --- plans and refusals (no launch) --------------------------------------------------------

def test_plan_grids_and_tiles():
    """The dK/dV kernel runs on (Tc, B * Hkv); with a tile table both kernels take one
    (Br, Bc), and a caller's two different pairs are refused by name."""
    q = np.zeros((2, 4, 40, 8), np.float32)
    k = np.zeros((2, 2, 40, 8), np.float32)
    plans = numbaflash.explain_backward(q, k, k, version="v6", tiles=(16, 16))
    dkdv, dq = plans[-2], plans[-1]
    assert dkdv.grid == (3, 4) and dq.grid == (3, 8)
    plans = numbaflash.explain_backward(q, k, k, version="v6", mask_mod=documents)
    assert (plans[-2].Br, plans[-2].Bc) == (plans[-1].Br, plans[-1].Bc)
    with pytest.raises(ValueError, match="one .*Br, Bc.* for both kernels"):
        numbaflash.explain_backward(q, k, k, version="v6", mask_mod=documents,
                                    tiles=((16, 32), (32, 16)))


def test_nonfinite_inputs_are_still_refused():
    """v6 needs finite inputs with variants too: asked for by name, it raises."""
    case, tiles = case_of(20, 20, H=2, Hkv=1, seed=15)
    out, lse = numbaflash.attention(case.q, case.k, case.v, return_lse=True, version="v2",
                                    window_size=(4, 4))
    k = case.k.copy()
    k[0, 0, 3, 1] = np.nan
    with pytest.raises(ValueError, match="NaN or inf"):
        numbaflash.attention_backward(case.dout, case.q, k, case.v, out, lse, version="v6",
                                      tiles=tiles, window_size=(4, 4))
