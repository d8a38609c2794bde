"""The kernels a GPU runs by default, run where CI runs: on the simulator, through
numbaflash/kernels/simulated.py (warp shuffles and tensor-core instructions emulated),
at fixed small shapes, by the same rules as every other version.

Forward v3, v6, v7 (float16), v8 and v9 and backward v5 and v6, each on ragged lengths
both ways (a short last tile on each axis), both causal alignments and no mask:
- against the float64 reference by TESTING.md's rule (tolerance.check_forward,
  backward_checks.check_backward), outputs pre-filled with NaN;
- NaN and inf in visible inputs reach exactly the positions the reference puts them in
  (the v6 family's fix-up paths; v3 and the tensor-core backward take finite inputs only);
- the bitwise ladder: v8 is v6 reordered, v9 is v8 with asynchronous copies, backward v6
  with split pairs is v6 on the same tiles without them.

The Hypothesis suites draw these versions on a GPU only (strategies.version_params): a
drawn example costs seconds on the simulator, where every mma is a rendezvous of a
warp's 32 Python threads. On a GPU this file runs too, at the same shapes.
"""

import numpy as np
import pytest

import numbaflash
from backward_checks import check_backward
from strategies import make_case
from tolerance import assert_bitwise_equal, check_forward, to_host

pytestmark = pytest.mark.usefixtures("nan_prefilled_outputs")

CAUSAL = [None, "bottom_right", "top_left"]
SHAPES = [(37, 29, 8), (29, 40, 20)]     # (Sq, Sk, d): ragged both ways; d = 20 pads to 24


def forward(case, version, q=None, k=None, v=None):
    out, lse = numbaflash.attention(case.q if q is None else q, case.k if k is None else k,
                                    case.v if v is None else v, causal=case.causal,
                                    version=version, return_lse=True)
    return to_host(out), to_host(lse)


def poisoned(case):
    """The case's inputs with NaN and inf in visible positions (and a NaN in a key the
    causal mask hides from the first rows)."""
    q, k, v = (x.copy() for x in (case.q, case.k, case.v))
    k[0, 1, 3, 0] = np.nan
    v[1, 0, k.shape[2] - 2, 1] = np.inf
    q[1, 1, 2, 0] = -np.inf
    return q, k, v


@pytest.mark.parametrize("Sq,Sk,d", SHAPES)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("version,dtype", [("v3", "float32"), ("v6", "float32"),
                                           ("v8", "float32"), ("v9", "float32"),
                                           ("v7", "float16"), ("v6", "float16")])
def test_tensor_core_forward_matches_reference(version, dtype, causal, Sq, Sk, d):
    case = make_case(B=2, H=2, Sq=Sq, Sk=Sk, d=d, dtype=dtype, causal=causal,
                     seed=Sq + 3 * d + len(version))
    out, lse = forward(case, version)
    check_forward(case.q, case.k, case.v, out, lse, causal=causal)
    if version == "v3":             # finite inputs only (its documented contract)
        return
    q, k, v = poisoned(case)
    out, lse = forward(case, version, q, k, v)
    check_forward(q, k, v, out, lse, causal=causal)


@pytest.mark.parametrize("Sq,Sk,d", SHAPES)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("version,dtype", [("v5", "float32"), ("v6", "float32"),
                                           ("v6", "float16")])
def test_tensor_core_backward_matches_reference(version, dtype, causal, Sq, Sk, d):
    case = make_case(B=2, H=2, Sq=Sq, Sk=Sk, d=d, dtype=dtype, causal=causal,
                     seed=5 * Sq + d, with_dout=True)
    out, lse = numbaflash.attention(case.q, case.k, case.v, causal=causal, return_lse=True)
    out, lse = to_host(out), to_host(lse)
    grads = numbaflash.attention_backward(case.dout, case.q, case.k, case.v, out, lse,
                                          causal=causal, version=version)
    check_backward(case.dout, case.q, case.k, case.v, out, lse,
                   [to_host(g) for g in grads], causal=causal)


@pytest.mark.parametrize("causal", CAUSAL)
def test_the_forward_ladder_is_bitwise_on_the_simulator(causal, monkeypatch):
    """v8 is v6 with its work reordered (v6 built with v8's chunk), v9 is v8 with its K/V
    tiles copied asynchronously: the same bits, finite inputs or not."""
    from numbaflash.kernels.forward import v6_split_once
    from numbaflash.kernels.forward.v8_reordered import v8_chunk
    v6 = v6_split_once.make_forward_v6
    monkeypatch.setattr(v6_split_once, "make_forward_v6", lambda Br, Bc, d, causal: v6(
        Br, Bc, d, causal, v8_chunk(d, Bc)))
    for Sq, Sk, d in SHAPES:
        case = make_case(B=2, H=2, Sq=Sq, Sk=Sk, d=d, causal=causal, seed=d)
        for q, k, v in ((case.q, case.k, case.v), poisoned(case)):
            o6, o8, o9 = (forward(case, ver, q, k, v) for ver in ("v6", "v8", "v9"))
            for name, x6, x8, x9 in zip(("out", "lse"), o6, o8, o9):
                assert_bitwise_equal(f"v8 {name} {(Sq, Sk, d)}", x8, x6)
                assert_bitwise_equal(f"v9 {name} {(Sq, Sk, d)}", x9, x8)


@pytest.mark.parametrize("causal", CAUSAL)
def test_backward_v6_pairs_are_bitwise_its_plain_tiles_on_the_simulator(causal):
    """The split pairs of backward v6's streamed tiles change where the TF32 parts are
    made, not which: its default plan (pairs, as the GPU's rule chooses them) and the
    same tiles given by the caller (no pairs) give the same bits."""
    Sq, Sk, d = SHAPES[1]
    case = make_case(B=2, H=2, Sq=Sq, Sk=Sk, d=d, causal=causal, seed=11, with_dout=True)
    out, lse = numbaflash.attention(case.q, case.k, case.v, causal=causal, return_lse=True)
    plans = numbaflash.explain_backward(case.q, case.k, case.v, causal=causal, version="v6")
    assert any(p.pairs for p in plans), plans
    tiles = tuple((p.Br, p.Bc) for p in plans[1:])
    a = numbaflash.attention_backward(case.dout, case.q, case.k, case.v, out, lse,
                                      causal=causal, version="v6")
    b = numbaflash.attention_backward(case.dout, case.q, case.k, case.v, out, lse,
                                      causal=causal, version="v6", tiles=tiles)
    for name, x, y in zip(("dq", "dk", "dv"), a, b):
        assert_bitwise_equal(name, x, y)
