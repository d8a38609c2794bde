"""L2 (simulator) / L3 (GPU): backward v7, the 16-bit tensor-core backward
(numbaflash/kernels/backward/v7_half.py), float16 and bfloat16.

v7 runs only when asked for (``attention_backward(..., version="v7")``). What is checked:

- TESTING.md's rule as backward_checks.check_backward applies it (float64 reference on the
  rounded inputs, baseline the naive formula in the input dtype: backward_checks.py says
  how), on Hypothesis cases: float16 and bfloat16, Sq and Sk from 1 to 48 (biased to the
  simulator tiles' boundaries), d in 8, 16, 59, 64, not causal and both causal
  alignments. Outputs are pre-filled with NaN, so an element never written shows up.
- Rows that see no key: dQ exactly 0 (and keys no row sees: dK, dV exactly 0).
- Repeated runs give the same bits; the tiles change the order of the float32 sums, so
  other tiles are held to the same rule, not to the same bits; the same tiles given by
  the caller and device arrays in and out give the same bits as the default launch.
- The finite-input contract: NaN or inf in any input (bfloat16: found on the exponent
  bits) makes version="v7" a ValueError; the D kernel reading bfloat16 bits.
- Refusals before any launch: variants, float32 and float64 inputs, d > 128, bad tiles;
  explain_backward(version="v7") shows the plans (simulator and GPU tile rules), and v7
  is never the default.
- The kernels compile and link for sm_90 without spills (tests/ptx_check.py's
  "backward_half" group).

Simulator cost: each drawn case keeps B * H * Sq * Sk * d <= MAX_WORK (every mma is a
rendezvous of a warp's 32 Python threads), about 1 to 3 s.
"""

import json
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import numbaflash
from numbaflash.kernels import backward as bwd
from numbaflash.kernels.backward import nonfinite
from numbaflash.kernels.backward import preprocess as bwd_pre
from backward_checks import GRADS, check_backward
from strategies import examples, on_gpu, within_budget
from tolerance import assert_bitwise_equal, fully_masked_rows, to_host, unseen_keys

pytestmark = pytest.mark.usefixtures("nan_prefilled_outputs")

v7 = bwd.module("v7")
BF16 = ml_dtypes.bfloat16
HALVES = ("float16", "bfloat16")
CAUSAL = (None, "bottom_right", "top_left")
# seqlens near the simulator tiles' boundaries (16 and 32: BWD_V7_SIM), and up to 48
BOUNDARIES = (1, 15, 16, 17, 31, 32, 33, 47, 48)
MAX_SEQLEN = 48 if not on_gpu() else 700
MAX_WORK = 2 * 48 * 48 * 16 if not on_gpu() else 2 ** 23   # B * H * Sq * Sk * d


def as_dtype(x, dtype):
    return x.astype(BF16 if dtype == "bfloat16" else np.dtype(dtype))


def device(a):
    """A host array on the device; bfloat16 copied as its bits and viewed back (Numba's
    copy to a GPU takes no bfloat16 buffer)."""
    from numba import cuda
    a = np.ascontiguousarray(to_host(a))
    if a.dtype == BF16:
        return cuda.to_device(a.view(np.uint16)).view(BF16)
    return cuda.to_device(a)


def make_inputs(B, H, Sq, Sk, d, dtype, seed):
    """q, k, v, dout in ``dtype``: uniform in [-4, 4], rounded to the dtype (the reference
    then sees exactly what the kernel sees)."""
    rng = np.random.default_rng(seed)
    return tuple(as_dtype(rng.uniform(-4, 4, (B, H, S, d)).astype(np.float32), dtype)
                 for S in (Sq, Sk, Sk, Sq))


@st.composite
def half_cases(draw):
    """(dtype, B, H, Sq, Sk, d, causal, scale, seed) within the simulator's budget."""
    dtype = draw(st.sampled_from(HALVES))
    d = draw(st.sampled_from((8, 16, 59, 64)))
    B, H = draw(st.sampled_from(((1, 1), (1, 2), (2, 1))))

    def seqlen():
        return draw(st.one_of(st.sampled_from(BOUNDARIES), st.integers(1, MAX_SEQLEN)))
    Sq, Sk = within_budget(seqlen(), seqlen(), B * H * d, MAX_WORK)
    causal = draw(st.sampled_from(CAUSAL))
    scale = draw(st.sampled_from((None, 0.5)))
    return dtype, B, H, Sq, Sk, d, causal, scale, draw(st.integers(0, 2 ** 16))


def run_v7(dout, q, k, v, causal=None, scale=None, tiles=None, out=None, lse=None):
    """(out, lse, (dq, dk, dv)): the default forward (unless given), then backward v7."""
    if out is None:
        out, lse = numbaflash.attention(q, k, v, causal=causal, scale=scale, return_lse=True)
    grads = numbaflash.attention_backward(dout, q, k, v, out, lse, causal=causal, scale=scale,
                                          version="v7", tiles=tiles)
    return out, lse, grads


def check_case(dtype, B, H, Sq, Sk, d, causal, scale, seed, tiles=None):
    q, k, v, dout = make_inputs(B, H, Sq, Sk, d, dtype, seed)
    out, lse, grads = run_v7(dout, q, k, v, causal, scale, tiles)
    for g, x in zip(grads, (q, k, v)):
        assert g.dtype == x.dtype and g.shape == x.shape
    return check_backward(dout, q, k, v, out, lse, grads, causal=causal, scale=scale)


# --- against the reference -----------------------------------------------------------

@settings(max_examples=examples(0.5))
@given(case=half_cases())
@example(case=("float16", 1, 1, 40, 9, 59, "bottom_right", None, 3))   # rows without keys
@example(case=("bfloat16", 1, 2, 17, 33, 64, "top_left", 0.5, 4))      # keys without rows
def test_v7_matches_reference(case):
    """dQ, dK, dV within TESTING.md's rule against the float64 reference, with the naive
    formula in the input dtype as the baseline; exact zeros where no pair is visible."""
    check_case(*case)


@pytest.mark.parametrize("dtype", HALVES)
def test_rows_that_see_no_key_have_dq_exactly_zero(dtype):
    """bottom_right with Sq = 40 > Sk = 9: rows 0-30 see no key (lse = -inf). Their dQ rows
    are exactly 0, nothing is NaN, and the rest is within the rule."""
    q, k, v, dout = make_inputs(1, 2, 40, 9, 8, dtype, 5)
    out, lse, grads = run_v7(dout, q, k, v, "bottom_right")
    rows = fully_masked_rows(40, 9, "bottom_right")
    assert rows.sum() == 31
    dq = to_host(grads[0]).astype(np.float32)
    assert np.array_equal(dq[..., rows, :], np.zeros_like(dq[..., rows, :]))
    for g in grads:
        assert np.isfinite(to_host(g).astype(np.float32)).all()
    check_backward(dout, q, k, v, out, lse, grads, causal="bottom_right")


@pytest.mark.parametrize("dtype", HALVES)
def test_keys_no_row_sees_have_dk_dv_exactly_zero(dtype):
    """top_left with Sk = 37 > Sq = 6: keys 6.. are seen by no row: dK, dV exactly 0."""
    q, k, v, dout = make_inputs(1, 1, 6, 37, 16, dtype, 6)
    _, _, (_, dk, dv) = run_v7(dout, q, k, v, "top_left")
    keys = unseen_keys(6, 37, "top_left")
    for g in (dk, dv):
        g = to_host(g).astype(np.float32)
        assert np.array_equal(g[..., keys, :], np.zeros_like(g[..., keys, :]))


# --- determinism and the launch ------------------------------------------------------

@pytest.mark.parametrize("dtype", HALVES)
def test_repeated_runs_are_bitwise_identical(dtype):
    """No atomics: every gradient element has one owner that sums in a fixed order."""
    q, k, v, dout = make_inputs(2, 1, 21, 19, 16, dtype, 7)
    out, lse, first = run_v7(dout, q, k, v, "bottom_right")
    for _ in range(2):
        _, _, again = run_v7(dout, q, k, v, "bottom_right", out=out, lse=lse)
        for name, a, b in zip(GRADS, again, first):
            assert_bitwise_equal(name, to_host(a).view(np.uint16), to_host(b).view(np.uint16))


@pytest.mark.parametrize("dtype", HALVES)
def test_results_do_not_depend_on_the_launch(dtype):
    """The default plan's tiles given by the caller, and device arrays in and out, give the
    same bits as the default launch. Other tiles (a different order of the float32 sums
    over tiles and chunks, so not the same bits) are within the same rule."""
    q, k, v, dout = make_inputs(1, 2, 35, 33, 16, dtype, 8)
    out, lse, want = run_v7(dout, q, k, v, "top_left")
    _, dkdv, dq = numbaflash.explain_backward(q, k, v, causal="top_left", version="v7")
    same = ((dkdv.Br, dkdv.Bc), (dq.Br, dq.Bc))
    _, _, given_tiles = run_v7(dout, q, k, v, "top_left", tiles=same, out=out, lse=lse)
    dev = [device(a) for a in (dout, q, k, v, out, lse)]
    on_device = numbaflash.attention_backward(*dev, causal="top_left", version="v7")
    for name, a, b, c in zip(GRADS, given_tiles, on_device, want):
        assert not isinstance(b, np.ndarray)
        assert_bitwise_equal(name, to_host(a).view(np.uint16), to_host(c).view(np.uint16))
        assert_bitwise_equal(name, to_host(b).view(np.uint16), to_host(c).view(np.uint16))
    for tiles in ((16, 16), ((32, 16), (16, 32))):
        _, _, other = run_v7(dout, q, k, v, "top_left", tiles=tiles, out=out, lse=lse)
        check_backward(dout, q, k, v, out, lse, other, causal="top_left")


# --- finite inputs only --------------------------------------------------------------

def poison(a, which, dtype):
    """A copy of ``a`` with one element made non-finite: NaN, +inf or -inf (bfloat16: a
    NaN with a payload other than the canonical one too)."""
    a = np.array(a)
    at = (0,) * (a.ndim - 1) + (1,)
    bad = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf}[which]
    if which == "nan" and dtype == "bfloat16" and a.dtype == BF16:
        a.view(np.uint16)[at] = 0xFF81            # -NaN, lowest payload bit
    else:
        a[at] = bad
    return a


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("name", ["dout", "q", "k", "v", "out", "lse"])
@pytest.mark.parametrize("which", ["nan", "inf"])
def test_v7_refuses_nonfinite_inputs(dtype, name, which):
    """NaN or inf in any input: version="v7" raises a ValueError that says why (its
    tensor cores would carry them to keys that do not see them) and what to use; the
    default runs (v4 on the simulator; never v7)."""
    q, k, v, dout = make_inputs(1, 1, 9, 7, 8, dtype, 9)
    out, lse = numbaflash.attention(q, k, v, causal="bottom_right", return_lse=True)
    args = {"dout": dout, "q": q, "k": k, "v": v, "out": to_host(out), "lse": to_host(lse)}
    args[name] = poison(args[name], which, dtype)
    names = ("dout", "q", "k", "v", "out", "lse")
    with pytest.raises(ValueError, match=r"backward v7 cannot run this input: the inputs hold "
                                         r"NaN or inf .*; use v4"):
        numbaflash.attention_backward(*(args[n] for n in names), causal="bottom_right",
                                      version="v7")
    if which == "nan" and name == "q":
        grads = numbaflash.attention_backward(*(args[n] for n in names), causal="bottom_right")
        assert len(grads) == 3


def test_bfloat16_check_reads_the_exponent_bits():
    """nonfinite_check_bfloat16: every sign and exponent with a few mantissas, finite ones
    pass together; each non-finite pattern (+-inf, NaNs with several payloads) alone
    raises the flag."""
    from numba import cuda
    sign_exp = np.arange(512, dtype=np.uint32) << 7
    patterns = (sign_exp[:, None] | np.array([0, 1, 0x40, 0x7F], np.uint32)).astype(np.uint16)
    patterns = patterns.ravel()
    finite = np.isfinite(patterns.view(BF16).astype(np.float32))
    assert finite.sum() == len(patterns) - 8         # +-inf, and six NaNs

    def flagged(bits):
        bits = cuda.to_device(np.ascontiguousarray(bits))
        L = cuda.to_device(np.zeros(1, np.float32))
        flag = cuda.to_device(np.zeros(1, np.int32))
        nonfinite.nonfinite_check_bfloat16[4, 64](bits, bits, bits, bits, bits, L, flag)
        return int(flag.copy_to_host()[0])

    assert flagged(patterns[finite]) == 0
    for bits in patterns[~finite]:
        assert flagged(np.array([0x3F80, bits], np.uint16)) == 1, hex(int(bits))


def test_preprocess_reads_bfloat16_bits():
    """The D kernel with half="bfloat16": D = rowsum(dO * O) from the bits, in float32."""
    from numba import cuda
    rng = np.random.default_rng(10)
    dO, O = (rng.standard_normal((2, 70, 13)).astype(BF16) for _ in range(2))
    D = cuda.to_device(np.full((2, 70), np.nan, np.float32))
    kernel = bwd_pre.make_backward_preprocess(13, "float32", "bfloat16")
    threads = bwd_pre.THREADS
    kernel[(-(-70 // threads), 2), (threads,)](cuda.to_device(dO.view(np.uint16)),
                                              cuda.to_device(O.view(np.uint16)), D)
    want = np.sum(dO.astype(np.float64) * O.astype(np.float64), axis=-1)
    got = D.copy_to_host()
    mag = np.sum(np.abs(dO.astype(np.float64) * O.astype(np.float64)), axis=-1)
    assert np.all(np.abs(got - want) <= 13 * np.finfo(np.float32).eps * mag)


# --- refusals and plans (nothing is launched) -----------------------------------------

VARIANTS = {
    "window": (dict(window_size=(2, 0)), "window"),
    "softcap": (dict(softcap=5.0), "softcap"),
    "alibi": (dict(alibi_slopes=np.ones(2, np.float32)), "ALiBi"),
    "attn_mask": (dict(attn_mask=np.ones((8, 8), bool)), "mask"),
    "dropout": (dict(dropout_p=0.1, dropout_seed=1), "dropout"),
}


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("variant", list(VARIANTS) + ["gqa"])
def test_v7_refuses_variants(no_launch, dtype, variant):
    """v7 computes plain attention (causal or not) only: every variant is a ValueError
    naming it, from explain_backward and attention_backward alike."""
    q = as_dtype(np.zeros((1, 2, 8, 16), np.float32), dtype)
    kv = q[:, :1] if variant == "gqa" else q
    kw, name = VARIANTS.get(variant, ({}, "GQA"))
    match = rf"backward v7 computes plain attention.*{name}"
    with pytest.raises(ValueError, match=match):
        numbaflash.explain_backward(q, kv, kv, version="v7", **kw)
    lse = np.zeros((1, 2, 8), np.float32)
    with pytest.raises(ValueError, match=match):
        numbaflash.attention_backward(q, q, kv, kv, q, lse, version="v7", **kw)


def test_v7_refuses_packed_sequences(no_launch):
    q = np.zeros((5, 2, 8), np.float16)
    lse = np.zeros((2, 5), np.float32)
    cu = np.array([0, 2, 5], np.int32)
    with pytest.raises(ValueError, match=r"backward v7 computes plain attention.*varlen"):
        numbaflash.attention_varlen_backward(q, q, q, q, q, lse, cu, cu, version="v7")


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_v7_refuses_float32_and_float64(no_launch, dtype):
    q = np.zeros((1, 1, 8, 16), dtype)
    with pytest.raises(ValueError, match=r"backward v7 cannot run this input: v7 multiplies "
                                         r"float16 and bfloat16 inputs on the 16-bit tensor "
                                         rf"cores; {dtype} inputs run on"):
        numbaflash.explain_backward(q, q, q, version="v7")


@pytest.mark.parametrize("tiles, match", [
    ((24, 16), r"backward v7 tiles must be \(Br, Bc\) with Br and Bc multiples of 16"),
    (((16, 16), (16, 8)), r"multiples of 16 up to 256.*got \(16, 8\)"),
    ((256, 256), r"backward v7 tiles \(256, 256\) need \d+ bytes of shared memory in its "
                 r"dkdv kernel at head dim 128; the limit is 232448"),
])
def test_bad_v7_tiles_and_head_dims_are_refused(no_launch, tiles, match):
    q = np.zeros((1, 1, 8, 128), np.float16)
    with pytest.raises(ValueError, match=match):
        numbaflash.explain_backward(q, q, q, version="v7", tiles=tiles)
    wide = np.zeros((1, 1, 8, 136), np.float16)
    with pytest.raises(ValueError, match=r"v7 keeps its dK, dV and dQ fragments in registers, "
                                         r"which holds head dims up to 128"):
        numbaflash.explain_backward(wide, wide, wide, version="v7")


@pytest.mark.parametrize("dtype", HALVES)
def test_explain_backward_shows_v7s_plans(dtype):
    """explain_backward(version="v7"): D, then v7's dK/dV and dQ kernels with their tiles,
    grids and reasons; on a GPU (backend="gpu") the tile rule's tiles within 99 KB. The
    default on a GPU is v9 (v4 on the simulator): v7 runs only when asked for."""
    q = as_dtype(np.zeros((2, 3, 40, 64), np.float32), dtype)
    k = as_dtype(np.zeros((2, 3, 70, 64), np.float32), dtype)
    plans = numbaflash.explain_backward(q, k, k, causal=True, version="v7")
    assert [p.kernel for p in plans] == ["backward_preprocess", "backward_dkdv_v7",
                                         "backward_dq_v7"]
    text = str(plans)
    assert len(text.splitlines()) == 3 and "v7 was asked for by the caller" in text
    assert "16-bit tensor cores" in text and "finite inputs only" in text
    assert ("reads the bfloat16 inputs as their bits" in text) == (dtype == "bfloat16")
    where = "gpu" if on_gpu() else "simulator"
    tiles = v7.default_backward_v7_tiles(64, where)
    _, dkdv, dq = plans
    assert (dkdv.Br, dkdv.Bc) == tiles["dkdv"] and (dq.Br, dq.Bc) == tiles["dq"]
    assert dkdv.grid == (-(-70 // dkdv.Bc), 6) and dkdv.block == (2 * dkdv.Bc,)
    assert dq.grid == (-(-40 // dq.Br), 6) and dq.block == (2 * dq.Br,)
    assert all(p.causal == "bottom_right" and p.dynamic_shared for p in plans[1:])
    for d, want in ((64, {"dkdv": (64, 64), "dq": (64, 64)}),
                    (128, {"dkdv": (32, 64), "dq": (64, 64)})):
        qd = as_dtype(np.zeros((1, 1, 8, d), np.float32), dtype)
        _, dkdv, dq = numbaflash.explain_backward(qd, qd, qd, version="v7", backend="gpu")
        assert {"dkdv": (dkdv.Br, dkdv.Bc), "dq": (dq.Br, dq.Bc)} == want
        assert max(dkdv.shared_bytes, dq.shared_bytes) <= v7.BWD_V7_SHARED_MEM_TARGET
    default = numbaflash.explain_backward(q, k, k, causal=True, backend="gpu")
    assert default[-1].version == "v9"


def test_v7_tile_rule_fits_every_head_dim():
    """The GPU tile rule gives, for every d up to 128, tiles the caller's check accepts
    and that fit BWD_V7_SHARED_MEM_TARGET; the simulator gets BWD_V7_SIM."""
    for d in range(1, 129):
        tiles = v7.default_backward_v7_tiles(d, "gpu")
        assert v7.check_backward_v7_tiles((tiles["dkdv"], tiles["dq"]), d) == tiles
        for kind, (Br, Bc) in tiles.items():
            assert v7.SHARED_BYTES[kind](Br, Bc, d) <= v7.BWD_V7_SHARED_MEM_TARGET
    assert v7.default_backward_v7_tiles(64, "simulator") == v7.BWD_V7_SIM


# --- the real compiler (no GPU needed) ------------------------------------------------

def test_v7_kernels_compile_and_link_for_sm90(record_property):
    """tests/ptx_check.py's "backward_half" group (v7's and v9's two kernels for float16
    and bfloat16 at d = 64 and 128, full and causal, and the D kernel on bfloat16 bits)
    compiles for sm_90 and links, without float64, spills or a stack frame; except v9's
    dK/dV kernel at d = 128 with the causal mask, which ptxas gives 255 registers and at
    most 128 bytes of spills (v9_ldmatrix.V9_DKDV_SPILL_BYTES says why that is kept)."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ptx_check.py")
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    proc = subprocess.run([sys.executable, script, "--group", "backward_half", "--link"],
                          env=env, capture_output=True, text=True, timeout=900,
                          cwd=os.path.dirname(os.path.dirname(script)))
    results = [json.loads(line[len("PTXCHECK "):]) for line in proc.stdout.splitlines()
               if line.startswith("PTXCHECK ")]
    assert proc.returncode == 0 and len(results) == 34, proc.stderr[-3000:]
    record_property("ptx_report", "\n".join(
        f"{r['name']}: {r.get('registers')} registers, stack {r.get('stack_bytes')}, "
        f"spills {r.get('spill_stores')}/{r.get('spill_loads')}" for r in results))
    for r in results:
        assert r["ok"], f"{r['name']}: {r.get('error')}"
        assert not r["f64_count"], f"{r['name']}: float64 in its PTX: {r['f64_lines'][:3]}"
        if r["name"].startswith("backward_dkdv_v9-") and "-d128-causal-" in r["name"]:
            bound = bwd.module("v9").V9_DKDV_SPILL_BYTES
            assert max(r["spill_stores"], r["spill_loads"], r["stack_bytes"]) <= bound, (
                f"{r['name']}\n{r['log']}")
            continue
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, f"{r['name']}\n{r['log']}"
        assert r["stack_bytes"] == 0, f"{r['name']} has a stack frame\n{r['log']}"
