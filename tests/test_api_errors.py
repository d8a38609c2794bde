"""Bad inputs give a clear ValueError/TypeError before anything is launched, and explain()
and the INFO log say what would run and why.

Every error test runs with the launcher replaced by one that fails the test, so an error
raised by a kernel (or no error at all) cannot pass for a validation error.
"""

import logging
import math
import re
import types

import numpy as np
import pytest
from numba import cuda

import numbaflash
import numbaflash.api
import numbaflash.launcher
from numbaflash import policy
from numbaflash.kernels import plan as launch_plan
from numbaflash.kernels.backward import v4_dynamic_shared as bwd_v4, v5_tensor_cores as bwd_v5
from numbaflash.kernels.forward import (
    v4_register_blocked as fwd_v4, v5_dynamic_shared as fwd_v5, v6_split_once as fwd_v6,
    v7_float16 as fwd_v7, v8_reordered as fwd_v8, v9_async_copy as fwd_v9)
from numbaflash.kernels.backward import VERSIONS as BACKWARD_VERSIONS
from numbaflash.kernels.forward import VERSIONS


def plan_as_on_a_gpu(monkeypatch, limit=None):
    """Plan as numbaflash plans on a GPU (``policy.backend`` says "gpu"; nothing is
    launched), with a GPU that allows a block ``limit`` bytes of dynamic shared memory
    (None: the H100/H200's 227 KB, what planning assumes without a GPU to ask)."""
    monkeypatch.setattr(policy, "backend", lambda: "gpu")
    if limit is not None:
        for module in plan_modules():
            if hasattr(module, "device_dynamic_shared_limit"):
                monkeypatch.setattr(module, "device_dynamic_shared_limit",
                                    lambda where=None: limit)


def plan_modules():
    """The policy, kernels/plan.py (whose shared tile rules ask for backward v7 and v9) and
    every version's module: where the device's limit is asked."""
    from numbaflash.kernels import backward, forward
    from numbaflash.kernels import plan as plan_pieces
    return ([policy, plan_pieces] + [forward.module(v) for v in forward.VERSIONS]
            + [backward.module(v) for v in backward.VERSIONS])


def arrays(shape_q=(2, 3, 5, 8), shape_kv=(2, 3, 6, 8), dtype=np.float32):
    q = np.zeros(shape_q, dtype)
    k = np.zeros(shape_kv, dtype)
    v = np.zeros(shape_kv, dtype)
    return q, k, v


def raises(exc, match, *args, **kwargs):
    with pytest.raises(exc, match=match):
        numbaflash.attention(*args, **kwargs)
    with pytest.raises(exc, match=match):       # explain validates the same way
        numbaflash.explain(*args, **kwargs)


pytestmark = pytest.mark.usefixtures("no_launch")


# --- shapes -----------------------------------------------------------------------------

@pytest.mark.parametrize("shape_q,shape_k,shape_v,match", [
    ((5, 8), (6, 8), (7, 8), r"k and v must have the same shape"),
    ((5, 8), (6, 4), (6, 4), r"q and k must have the same head dim"),
    # k and v may have fewer heads than q (GQA/MQA), but a divisor of q's
    ((2, 5, 8), (3, 6, 8), (3, 6, 8), r"multiple of the number of key/value heads"),
    ((2, 3, 5, 8), (2, 4, 6, 8), (2, 4, 6, 8), r"multiple of the number of key/value heads"),
    ((2, 3, 5, 8), (3, 3, 6, 8), (3, 3, 6, 8), r"same batch dim"),
    ((2, 5, 8), (6, 8), (6, 8), r"same rank"),
    ((2, 3, 5, 8), (2, 3, 6, 8), (2, 3, 7, 8), r"k and v must have the same shape"),
])
def test_mismatched_shapes(shape_q, shape_k, shape_v, match):
    q, k, v = np.zeros(shape_q, np.float32), np.zeros(shape_k, np.float32), np.zeros(
        shape_v, np.float32)
    raises(ValueError, match, q, k, v)


@pytest.mark.parametrize("shape", [(8,), (1, 1, 1, 5, 8)], ids=["rank1", "rank5"])
def test_rank_1_or_5(shape):
    q = k = v = np.zeros(shape, np.float32)
    raises(ValueError, r"rank 2 \(seqlen, d\), 3 \(heads, seqlen, d\) or 4", q, k, v)


def test_not_an_array():
    raises(TypeError, r"q must be an array", [[1.0, 2.0]], np.zeros((1, 2)), np.zeros((1, 2)))


# --- dtypes -----------------------------------------------------------------------------

def test_mismatched_dtypes():
    q, k, v = arrays()
    raises(TypeError, r"same dtype; got float32, float64, float32", q, k.astype(np.float64), v)


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint8, np.bool_, np.complex64])
def test_unsupported_dtype(dtype):
    q, k, v = arrays(dtype=dtype)
    raises(TypeError, r"unsupported dtype .*float16 and bfloat16 \(computed in float32\), float32 and float64",
           q, k, v)


# --- head dim ---------------------------------------------------------------------------

def test_head_dim_zero():
    q, k, v = arrays((4, 0), (5, 0))
    raises(ValueError, r"head dim must be at least 1; got 0", q, k, v)


@pytest.mark.parametrize("d", [257, 512])
def test_head_dim_above_the_maximum_names_256_and_why(d):
    q, k, v = arrays((4, d), (5, d))
    raises(ValueError, rf"head dim {d} exceeds the maximum 256.*shared memory", q, k, v)


def test_head_dim_256_is_accepted():
    q, k, v = arrays((4, 256), (5, 256))
    plan = numbaflash.explain(q, k, v)
    assert plan.kernel == "forward_v2"


# --- options ----------------------------------------------------------------------------

@pytest.mark.parametrize("scale", [math.inf, -math.inf, math.nan, np.float32("nan"),
                                   np.float64("inf")])
def test_nonfinite_scale(scale):
    raises(ValueError, r"scale must be finite", *arrays(), scale=scale)


@pytest.mark.parametrize("scale", ["0.5", 1j, [0.5], True])
def test_scale_of_the_wrong_type(scale):
    raises(TypeError, r"scale must be a real number or None", *arrays(), scale=scale)


@pytest.mark.parametrize("causal", ["bottom-right", "BOTTOM_RIGHT", "causal", 1, 0, "", "top"])
def test_unknown_causal_mode(causal):
    raises(ValueError, r"causal must be False, True, 'bottom_right' or 'top_left'", *arrays(),
           causal=causal)


@pytest.mark.parametrize("version", ["v99", "V2", "", 2, "flash"])
def test_unknown_version(version):
    raises(ValueError, r"unknown forward version .*choose from \('v1', 'v2'", *arrays(),
           version=version)


def test_tiles_with_v1():
    raises(ValueError, r"tiles apply to the tiled kernels? .*; v1 has no tiles", *arrays(),
           version="v1", tiles=(4, 4))


@pytest.mark.parametrize("version", VERSIONS)
def test_a_version_either_runs_here_or_says_why_not(version):
    """A version that cannot run an input (e.g. v7 with float32 inputs) raises a
    ValueError that says so and why; it never falls back silently. No version is refused
    for the backend: the simulator runs the tensor-core ones too (kernels/simulated.py)."""
    try:
        plan = numbaflash.explain(*arrays(), version=version)
    except ValueError as err:
        assert re.search(rf"forward {version} cannot run this input: .+", str(err)), str(err)
        assert "simulator" not in str(err)
    else:
        assert plan.version == version and plan.kernel == f"forward_{version}"


def explain_or_skip(*args, **kwargs):
    """explain(), or a visible skip with the library's reason if the version cannot run
    here (test_a_version_either_runs_here_or_says_why_not checks that refusal)."""
    try:
        return numbaflash.explain(*args, **kwargs)
    except ValueError as err:
        if "cannot run" not in str(err):
            raise
        pytest.skip(str(err))


@pytest.mark.parametrize("tiles,match", [
    ((0, 4), r"tiles must be positive; got \(Br, Bc\) = \(0, 4\)"),
    ((4, -1), r"tiles must be positive"),
    ((1025, 1), r"Br = 1025 exceeds 1024: one thread per query row"),
    ((2048, 4), r"Br = 2048 exceeds 1024"),
    ((64, 32), r"tiles \(Br, Bc\) = \(64, 32\) need \d+ bytes of shared memory at head dim "
               r"256 in float32; the limit is 49152 \(48 KB static shared memory per block\)"),
    ((4,), r"tiles must be a pair of positive ints"),
    ((4, 4, 4), r"tiles must be a pair of positive ints"),
    ("ab", r"tiles must be a pair of positive ints"),
    (4, r"tiles must be a pair of positive ints"),
])
def test_bad_tiles(tiles, match):
    q, k, v = arrays((2, 5, 256), (2, 6, 256))
    raises(ValueError, match, q, k, v, version="v2", tiles=tiles)


def test_tiles_too_big_for_shared_memory_in_float64():
    q, k, v = arrays((5, 256), (6, 256), dtype=np.float64)
    raises(ValueError, r"need \d+ bytes of shared memory at head dim 256 in float64", q, k, v,
           tiles=(64, 16))


@pytest.mark.parametrize("tiles", [(8.5, 8), (8, 4.0000001)])
def test_tiles_that_are_not_integers(tiles):
    """A tile size that is not an integer is rejected, not silently truncated (int(8.5) = 8
    would run (8, 8) while the caller asked for something else)."""
    with pytest.raises((TypeError, ValueError), match=r"tiles must be a pair of positive ints"):
        numbaflash.explain(*arrays(), tiles=tiles)


def test_numpy_integer_tiles_are_accepted():
    """(64, 32) as NumPy integers: tiles every default version takes (v5 on the simulator,
    v6 on a GPU, whose Br and Bc must be multiples of 16: run 32 failed this test on the
    H200 with the (8, 4) it used to ask for, correctly refused by v6)."""
    plan = numbaflash.explain(*arrays(), tiles=(np.int64(64), np.int32(32)))
    assert (plan.Br, plan.Bc) == (64, 32)


@pytest.mark.parametrize("tiles,match", [
    ((128, 128, 8, 8), r"v5 tiles \(Br, Bc, TM, TN\) = \(128, 128, 8, 8\) need 271872 bytes of "
                       r"shared memory at head dim 128 in float32; the limit is 232448 \(227 KB "
                       r"dynamic shared memory per block on the H100/H200\)"),
    ((256, 256, 2, 2), r"v5 tiles \(256, 256, 2, 2\) need 16384 threads .*at most 1024"),
    ((8, 8, 3, 2), r"v5 tiles need TM to divide Br and TN to divide Bc"),
    ((0, 8, 1, 1), r"tiles must be positive"),
    ((8, 8, 2), r"tiles must be a pair of positive ints"),
])
def test_bad_v5_tiles(tiles, match):
    """v5's tiles are checked against the dynamic shared-memory limit (227 KB), not 48 KB;
    the rest as v4's."""
    q, k, v = arrays((2, 5, 128), (2, 6, 128))
    raises(ValueError, match, q, k, v, version="v5", tiles=tiles)


def test_v5_takes_tiles_above_48_kb():
    """The point of v5: tiles v4 refuses for static shared memory are accepted."""
    q, k, v = arrays((2, 5, 128), (2, 6, 128))
    with pytest.raises(ValueError, match=r"the limit is 49152"):
        numbaflash.explain(q, k, v, version="v4", tiles=(64, 32, 4, 4))
    plan = numbaflash.explain(q, k, v, version="v5", tiles=(64, 32, 4, 4))
    assert plan.shared_bytes == 77056 > launch_plan.SHARED_MEM_LIMIT
    assert plan.thread_tile == (4, 4) and plan.block == (128,)
    assert "dynamic shared memory" in str(plan) and "tiles given by the caller" in str(plan)


@pytest.mark.parametrize("tiles,match", [
    ((48, 40), r"v6 tiles must be \(Br, Bc\) with Br a multiple of 16 up to 256 .*and Bc a "
               r"multiple of 16 .*got \(48, 40\)"),
    ((272, 16), r"Br a multiple of 16 up to 256"),
    ((256, 128), r"v6 tiles \(256, 128\) need \d+ bytes of shared memory at head dim 128; the "
                 r"limit is 232448 \(227 KB dynamic shared memory per block on the H100/H200\)"),
    ((64,), r"tiles must be a pair of positive ints"),
    ((32, 16), r"v6 tiles \(32, 16\) at head dim 128: .*one column per thread.*Br >= 64"),
])
@pytest.mark.parametrize("version", ["v6", "v8", "v9"])
def test_bad_v6_tiles(version, tiles, match, monkeypatch):
    """v6's tiles, which v8 and v9 share (checked as on a GPU: the planner is told it is
    not simulating; v9 against its own shared memory)."""
    plan_as_on_a_gpu(monkeypatch)
    q, k, v = arrays((2, 5, 128), (2, 6, 128))
    raises(ValueError, match.replace("v6", version), q, k, v, version=version, tiles=tiles)


@pytest.mark.parametrize("version", ["v6", "v8", "v9"])
def test_v6_and_v8_plan_on_a_gpu_and_refuse_elsewhere(version, monkeypatch):
    """On the simulator v6, v8 and v9 are refused with the reason (and v5 is the default);
    on a GPU (simulating patched away) v8 is the default up to d = 64 and v9 above, and
    all three plan the documented tiles, 2 Br threads and their dynamic shared memory
    (v9: its own); float64 and d > 128 are refused with their limits, and by v9 float16
    too."""
    q, k, v = arrays((2, 5, 64), (2, 6, 64))
    if policy.backend() == "simulator":     # it runs there too, with the simulator's tiles
        plan = numbaflash.explain(q, k, v, version=version)
        assert (plan.backend, (plan.Br, plan.Bc)) == ("simulator", (32, 16))
        assert numbaflash.explain(q, k, v).version == "v5"
    plan_as_on_a_gpu(monkeypatch)
    for d, tiles in ((64, (128, 64)), (128, (128, 32))):
        q, k, v = arrays((2, 5, d), (2, 6, d))
        default = numbaflash.explain(q, k, v, causal=True)
        if d <= 64:
            assert default.version == "v8" and "bitwise v6's results" in default.reason
        else:           # v9 from d = 65 on: v8 with asynchronous K/V copies
            assert default.version == "v9" and "bitwise v8's results" in default.reason
            assert default.shared_bytes == fwd_v9.v9_shared_bytes(*tiles, d)
        assert fwd_v8.v8_chunk(d, default.Bc) == (16 if d <= 64 else 32)
        assert f"{16 if d <= 64 else 32}-key softmax steps" in default.reason
        plan = numbaflash.explain(q, k, v, causal=True, version=version)
        assert plan.kernel == f"forward_{version}" and (plan.Br, plan.Bc) == tiles
        nbytes = fwd_v9.v9_shared_bytes if version == "v9" else fwd_v6.v6_shared_bytes
        assert plan.block == (2 * plan.Br,) and plan.shared_bytes == nbytes(*tiles, d)
        assert "tensor" in default.reason and "exact for every input" in default.reason
    q64, k64, v64 = arrays((2, 5, 64), (2, 6, 64), dtype=np.float64)
    raises(ValueError, rf"{version} computes in float32", q64, k64, v64, version=version)
    q16, k16, v16 = arrays((2, 5, 64), (2, 6, 64), dtype=np.float16)
    if version == "v9":
        raises(ValueError, r"v9 .*float32 inputs only; float16 inputs run on v7 \(the "
               r"default\) or v8", q16, k16, v16, version=version)
    else:
        assert numbaflash.explain(q16, k16, v16, version=version).version == version
    q, k, v = arrays((2, 5, 136), (2, 6, 136))
    raises(ValueError, r"head dims up to 128", q, k, v, version=version)


def test_backward_v6_plans_tiles_per_kernel_on_a_gpu(monkeypatch):
    """Backward v6 (the GPU default in float32) plans each kernel's tiles and whether its streamed
    tiles are kept as split pairs (backward v6's BWD_V6_NARROW, BWD_V6_WIDE): at d <= 64 the
    dQ kernel (64, 32) with pairs, the dK/dV kernel (32, 64) with pairs, or with the
    causal mask (64, 64) without; above that (32, 128) and (128, 32), both with pairs;
    each grid, block and shared memory from its own plan; float16 inputs without pairs
    (BWD_V6_FLOAT16). A caller's (Br, Bc) applies to
    both kernels, ((Br, Bc), (Br, Bc)) to each, without pairs; bad tiles name the limit,
    and a GPU with less shared memory than the rule needs gets the one-pair rule without
    pairs (planned, not launched)."""
    plan_as_on_a_gpu(monkeypatch)
    for d, causal, dkdv, dq in ((64, False, (32, 64, True), (64, 32, True)),
                                (64, True, (64, 64, False), (64, 32, True)),
                                (16, True, (64, 64, False), (64, 32, True)),
                                (72, False, (32, 128, True), (128, 32, True)),
                                (128, True, (32, 128, True), (128, 32, True))):
        q, k, v = arrays((2, 300, d), (2, 200, d))
        _, kv, qp = numbaflash.explain_backward(q, k, v, causal=causal)
        assert (kv.version, qp.version) == ("v6", "v6")
        assert (kv.Br, kv.Bc, kv.pairs) == dkdv and (qp.Br, qp.Bc, qp.pairs) == dq
        assert kv.grid == (math.ceil(200 / dkdv[1]), 2) and kv.block == (2 * dkdv[1],)
        assert qp.grid == (math.ceil(300 / dq[0]), 2) and qp.block == (2 * dq[0],)
        assert kv.shared_bytes == bwd_v5.dkdv_v5_shared_bytes(*dkdv[:2], d, dkdv[2]) <= 232448
        assert qp.shared_bytes == bwd_v5.dq_v5_shared_bytes(*dq[:2], d, dq[2]) <= 232448
        assert "each kernel its own" in kv.reason
        assert ("split pairs" in str(kv)) == dkdv[2] and "split pairs" in str(qp)
    # float16 inputs (v9 is their default; v6 when asked for): the tiles of run 57,
    # without pairs (BWD_V6_FLOAT16)
    for d, dkdv, dq in ((64, (64, 64), (64, 64)), (128, (64, 128), (128, 64))):
        q, k, v = arrays((2, 300, d), (2, 200, d), dtype=np.float16)
        _, kv, qp = numbaflash.explain_backward(q, k, v, version="v6")
        assert ((kv.Br, kv.Bc), (qp.Br, qp.Bc)) == (dkdv, dq) and not (kv.pairs or qp.pairs)
    # pairs double the streamed tiles: Qi and dOi (dK/dV), Kj and Vj (dQ)
    assert (bwd_v5.dkdv_v5_shared_bytes(32, 64, 64, True)
            == bwd_v5.dkdv_v5_shared_bytes(64, 64, 64, False) - 64 * 4)
    assert (bwd_v5.dq_v5_shared_bytes(64, 32, 64, True)
            == bwd_v5.dq_v5_shared_bytes(64, 64, 64, False))
    q, k, v = arrays((2, 300, 128), (2, 200, 128))
    _, kv, qp = numbaflash.explain_backward(q, k, v, version="v6", tiles=(32, 64))
    assert (kv.Br, kv.Bc, qp.Br, qp.Bc) == (32, 64, 32, 64)
    assert "tiles given by the caller" in kv.reason and not (kv.pairs or qp.pairs)
    _, kv, qp = numbaflash.explain_backward(q, k, v, version="v6", tiles=((32, 64), (64, 16)))
    assert (kv.Br, kv.Bc, qp.Br, qp.Bc) == (32, 64, 64, 16)
    with pytest.raises(ValueError, match=r"backward v6 tiles must be \(Br, Bc\) with Br and Bc "
                                         r"multiples of 16 .*got \(64, 24\)"):
        numbaflash.explain_backward(q, k, v, version="v6", tiles=((64, 64), (64, 24)))
    with pytest.raises(ValueError, match=r"backward v6 tiles \(128, 128\) need 271360 bytes"):
        numbaflash.explain_backward(q, k, v, version="v6", tiles=((128, 128), (64, 64)))
    plan_as_on_a_gpu(monkeypatch, 101376)
    _, kv, qp = numbaflash.explain_backward(q, k, v)
    assert (kv.Br, kv.Bc) == (qp.Br, qp.Bc) and kv.shared_bytes <= 101376
    assert not (kv.pairs or qp.pairs)


def test_v7_plans_float16_on_a_gpu_and_refuses_the_rest(monkeypatch):
    """v7 (float16 tensor cores): refused on the simulator with the reason; on a GPU
    (simulating patched away) it is the default for float16 variants and d not a multiple
    of 8 (v10 for plain attention; v8 stays float32's), with
    the documented tiles and chunks, 2 Br threads and its dynamic shared memory, and it
    refuses float32, d > 128 and bad tiles, each with its limit."""
    q, k, v = arrays((2, 5, 64), (2, 6, 64), dtype=np.float16)
    if policy.backend() == "simulator":     # it runs there too, with the simulator's tiles
        plan = numbaflash.explain(q, k, v, version="v7")
        assert (plan.backend, (plan.Br, plan.Bc)) == ("simulator", (32, 32))
    plan_as_on_a_gpu(monkeypatch)
    for d, tiles, chunk in ((64, (128, 128), 32), (128, (128, 64), 16)):
        q, k, v = arrays((2, 5, d), (2, 6, d), dtype=np.float16)
        plan = numbaflash.explain(q, k, v, causal=True, version="v7")
        assert plan.kernel == "forward_v7" and (plan.Br, plan.Bc) == tiles
        assert plan.block == (256,) and plan.shared_bytes == fwd_v7.v7_shared_bytes(*tiles, d)
        assert fwd_v7.v7_chunk(d, plan.Bc) == chunk
        # The default for float16: v10 (v7's bits, faster) for plain attention; a
        # variant (here GQA) stays on v7, which takes variants.
        default = numbaflash.explain(q, k, v)
        assert default.version == "v10" and "float16" in default.reason
        qg, kg, _ = arrays((1, 4, 5, d), (1, 2, 6, d), dtype=np.float16)
        assert numbaflash.explain(qg, kg, kg).version == "v7"
        q32, k32, v32 = arrays((2, 5, d), (2, 6, d))    # and for float32 still v8 / v9
        assert numbaflash.explain(q32, k32, v32).version == ("v8" if d <= 64 else "v9")
    q, k, v = arrays((2, 5, 64), (2, 6, 64))
    raises(ValueError, r"v7 multiplies float16 and bfloat16 inputs .*float32 inputs run on v8",
           q, k, v, version="v7")
    q, k, v = arrays((2, 5, 136), (2, 6, 136), dtype=np.float16)
    raises(ValueError, r"head dims up to 128", q, k, v, version="v7")
    q, k, v = arrays((2, 5, 64), (2, 6, 64), dtype=np.float16)
    raises(ValueError, r"Bc a multiple of 32", q, k, v, version="v7", tiles=(64, 48))
    raises(ValueError, r"Br >= 32", q, k, v, version="v7", tiles=(16, 32))


@pytest.mark.parametrize("acc_dtype", ["float32", "float64"])
def test_default_v5_tiles_follow_the_documented_rule(acc_dtype, monkeypatch):
    """The v5 rule (GPU candidates) picks, for every head dim, tiles that pass the caller's
    check, fit V5_SHARED_MEM_TARGET and the O register bound; the examples in
    default_v5_tiles's docstring hold; and v5's shared bytes are v4's (same arrays)."""
    plan_as_on_a_gpu(monkeypatch)
    for d in range(1, 257):
        t = fwd_v5.default_v5_tiles(d, acc_dtype, "gpu")
        assert fwd_v5.check_v5_tiles(t, d, acc_dtype) == t
        nbytes = fwd_v5.v5_shared_bytes(*t, d, acc_dtype)
        assert nbytes <= fwd_v5.V5_SHARED_MEM_TARGET
        assert nbytes == fwd_v4.v4_shared_bytes(*t, d, acc_dtype)
        Br, Bc, TM, TN = t
        assert TM * (fwd_v4.v4_head_dim_padded(Bc, TN, d) // (Bc // TN)) <= fwd_v4.V4_MAX_O_REGS
    if acc_dtype == "float32":
        assert [fwd_v5.default_v5_tiles(d, acc_dtype, "gpu") for d in (64, 128, 256)] == \
            [(128, 64, 8, 4), (64, 32, 4, 2), (16, 16, 2, 2)]
        assert [fwd_v5.v5_shared_bytes(128, 64, 8, 4, 64, acc_dtype),
                fwd_v5.v5_shared_bytes(64, 32, 4, 2, 128, acc_dtype)] == [107520, 79104]
        assert fwd_v4.default_v4_tiles(64, acc_dtype, "gpu") == (64, 32, 4, 4)     # what v5 lifts
        assert fwd_v4.default_v4_tiles(128, acc_dtype, "gpu") == (32, 16, 4, 2)
        # two blocks per SM: each block's bytes plus the 1 KB the driver reserves, twice,
        # within the H200 SM's 228 KB
        assert 2 * (fwd_v5.V5_SHARED_MEM_TARGET + 1024) <= 228 * 1024
    else:
        assert [fwd_v5.default_v5_tiles(d, acc_dtype, "gpu") for d in (64, 128)] == \
            [(64, 32, 4, 2), (32, 32, 4, 4)]


def test_batch_heads_above_the_grid_limit():
    fake = types.SimpleNamespace(shape=(65536, 1, 4, 8), dtype=np.dtype(np.float32))
    with pytest.raises(ValueError, match=r"batch \* heads = 65536 exceeds 65535"):
        numbaflash.explain(fake, fake, fake)


# --- host and device --------------------------------------------------------------------

def test_mixed_host_and_device_inputs():
    q, k, v = arrays()
    with pytest.raises(TypeError, match=r"inputs mix host \(NumPy\) and device arrays"):
        numbaflash.attention(q, cuda.to_device(k), v)
    with pytest.raises(TypeError, match=r"inputs mix host \(NumPy\) and device arrays"):
        numbaflash.attention(cuda.to_device(q), k, v)


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_noncontiguous_device_input(which):
    q, k, v = arrays((2, 5, 16), (2, 6, 16))
    dev = {"q": cuda.to_device(q), "k": cuda.to_device(k), "v": cuda.to_device(v)}
    dev[which] = cuda.to_device(np.zeros(dev[which].shape[:-1] + (32,), np.float32))[:, :, ::2]
    assert not dev[which].is_c_contiguous()
    with pytest.raises(ValueError, match=rf"{which} is a non-contiguous device array.*"
                                         r"C-contiguous"):
        numbaflash.attention(dev["q"], dev["k"], dev["v"])


# --- explain() and the log ----------------------------------------------------------------

@pytest.mark.parametrize("version", VERSIONS)
def test_explain_names_kernel_tiles_backend_and_reason(version):
    q, k, v = arrays((2, 3, 5, 8), (2, 3, 6, 8))
    plan = explain_or_skip(q, k, v, causal=True, version=version)
    assert isinstance(plan, numbaflash.Plan)
    text = str(plan)
    assert plan.kernel == f"forward_{version}" and f"forward_{version}" in text
    assert numbaflash.backend() in text and plan.backend == numbaflash.backend()
    assert "Why:" in text and plan.reason and plan.reason in text
    assert "causal=bottom_right" in text
    if version == "v1":
        assert plan.Br is None and "tiles" not in text
    else:
        assert f"tiles (Br, Bc) = ({plan.Br}, {plan.Bc})" in text


def test_explain_default_names_the_default_and_its_tile_rule():
    plan = numbaflash.explain(*arrays())
    assert plan.version in VERSIONS and plan.kernel == f"forward_{plan.version}"
    assert "default" in plan.reason and "tiles by the" in plan.reason and "d=8" in plan.reason
    plan = numbaflash.explain(*arrays(), version="v2", tiles=(4, 2))
    assert (plan.Br, plan.Bc) == (4, 2) and "tiles given by the caller" in plan.reason


@pytest.mark.parametrize("d,dtype,tiles", [
    (64, "float32", (64, 64)), (128, "float32", (64, 32)), (256, "float32", (64, 16)),
    (256, "float64", (64, 8)), (64, "float64", (64, 32)), (16, "float16", (64, 64)),
])
def test_default_tiles_follow_the_documented_rule(d, dtype, tiles):
    """forward v2's tile rule (kernels/forward/v2_flash2.py): Br = 64; float32 d=64 -> Bc 64, d=128 -> 32,
    d=256 -> 16; float64 halves Bc; float16 is computed in float32."""
    fake = types.SimpleNamespace(shape=(1, 1, 4096, d), dtype=np.dtype(dtype))
    plan = numbaflash.explain(fake, fake, fake, version="v2")
    assert (plan.Br, plan.Bc) == tiles
    assert plan.shared_bytes <= launch_plan.SHARED_MEM_LIMIT
    assert plan.grid == (math.ceil(4096 / tiles[0]), 1) and plan.block == (tiles[0],)


def test_explain_launches_nothing():
    plan = numbaflash.explain(*arrays())       # no_launch would fail the test otherwise
    assert plan.grid == (math.ceil(5 / plan.Br), 6)


@pytest.fixture
def allow_launch(monkeypatch):
    monkeypatch.undo()      # this test launches for real


@pytest.mark.parametrize("version", VERSIONS)
def test_attention_logs_its_plan_at_info(version, allow_launch, caplog):
    q, k, v = arrays((1, 5, 4), (1, 3, 4))
    explain_or_skip(q, k, v, version=version)
    with caplog.at_level(logging.INFO, logger="numbaflash"):
        numbaflash.attention(q, k, v, version=version)
    records = [r for r in caplog.records if r.name == "numbaflash"]
    assert len(records) == 1 and records[0].levelno == logging.INFO
    assert f"forward_{version}" in records[0].getMessage()
    assert "Why:" in records[0].getMessage()


# --- backward versions (explain_backward; nothing is launched) ----------------------------

@pytest.mark.parametrize("version", BACKWARD_VERSIONS)
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_explain_backward_names_each_kernel_or_says_why_not(version, dtype):
    """Every backward version either plans its kernels (one line each: kernel, tiles,
    backend, reason; v3 and v4 also their thread tile) or refuses with a ValueError that says why
    (v2 with float16: atomics in the output dtype; v7 and v9 with float32: 16-bit inputs
    only)."""
    q, k, v = arrays((2, 3, 5, 8), (2, 3, 6, 8), dtype=dtype)
    try:
        plans = numbaflash.explain_backward(q, k, v, causal=True, version=version)
    except ValueError as err:
        if version in ("v5", "v6") and policy.backend() != "gpu":
            assert re.search(rf"backward {version} cannot run this input: {version} uses the "
                             r"tensor cores through inline PTX, which the simulator cannot "
                             r"run", str(err))
            return
        if version in ("v7", "v9"):     # the 16-bit tensor cores: float16 and bfloat16 only
            assert dtype == np.float32, str(err)
            assert re.search(rf"backward {version} cannot run this input: {version} multiplies "
                             r"float16 and bfloat16 inputs", str(err))
            return
        assert version == "v2" and dtype == np.float16, str(err)
        assert re.search(r"backward v2 .*needs float32 or float64 inputs", str(err))
        return
    assert plans[0].kernel == "backward_preprocess"
    assert all(p.version == version and p.kernel.endswith(version) for p in plans[1:])
    assert len(str(plans).splitlines()) == len(plans)
    for plan in plans[1:]:
        text = str(plan)
        if plan.Br is None:         # v8's zero fill and rounding of dQ: no tiles
            assert version == "v8" and "Why:" in text
            continue
        assert f"tiles (Br, Bc) = ({plan.Br}, {plan.Bc})" in text and "Why:" in text
        # v4's tiles live in dynamic shared memory, up to its target of 100 KB per kernel
        limit = {"v4": bwd_v4.BWD_V4_SHARED_MEM_TARGET,
                 "v5": bwd_v5.BWD_V5_SHARED_MEM_TARGET,
                 "v6": bwd_v5.BWD_V5_SHARED_MEM_TARGET,
                 "v8": bwd_v5.BWD_V5_SHARED_MEM_TARGET,
                 "v10": bwd_v5.BWD_V5_SHARED_MEM_TARGET}.get(version,
                                                            launch_plan.SHARED_MEM_LIMIT)
        assert plan.shared_bytes <= limit
        assert "causal=bottom_right" in text
        if version in ("v3", "v4"):
            TM, TN = plan.thread_tile
            assert plan.block == ((plan.Br // TM) * (plan.Bc // TN),)
            assert f"thread tile (TM, TN) = ({TM}, {TN})" in text


@pytest.mark.parametrize("tiles,match", [
    ((64, 64, 4, 4), r"backward v3 tiles \(Br, Bc, TM, TN\) = \(64, 64, 4, 4\) need \d+ bytes "
                     r"of shared memory at head dim 256 in float32; the limit is 49152 \(48 KB "
                     r"static shared memory per block\)"),
    ((128, 128, 2, 2), r"need 4096 threads \(\(Br / TM\) x \(Bc / TN\)\); a block holds at "
                       r"most 1024"),
    ((8, 8, 3, 2), r"backward v3 tiles need TM to divide Br and TN to divide Bc"),
    ((8, 8, 2), r"tiles must be a pair of positive ints"),
])
def test_bad_backward_v3_tiles(tiles, match):
    q, k, v = arrays((2, 5, 256), (2, 6, 256))
    with pytest.raises(ValueError, match=match):
        numbaflash.explain_backward(q, k, v, version="v3", tiles=tiles)


@pytest.mark.parametrize("tiles,match", [
    ((128, 64, 4, 4), r"backward v4 tiles \(Br, Bc, TM, TN\) = \(128, 64, 4, 4\) need 464896 "
                      r"bytes of shared memory at head dim 256 in float32; the limit is 232448 "
                      r"\(227 KB dynamic shared memory per block on the H100/H200\)"),
    ((128, 128, 2, 2), r"need 4096 threads \(\(Br / TM\) x \(Bc / TN\)\); a block holds at "
                       r"most 1024"),
    ((8, 8, 3, 2), r"backward v4 tiles need TM to divide Br and TN to divide Bc"),
    ((8, 8, 2), r"tiles must be a pair of positive ints"),
])
def test_bad_backward_v4_tiles(tiles, match):
    """Backward v4's tiles are checked against the dynamic shared-memory limit (227 KB),
    both kernels, not 48 KB; the rest as v3's."""
    q, k, v = arrays((2, 5, 256), (2, 6, 256))
    with pytest.raises(ValueError, match=match):
        numbaflash.explain_backward(q, k, v, version="v4", tiles=tiles)


@pytest.mark.parametrize("limit", [101376, 65536, 49152])
def test_default_dynamic_tiles_fit_a_smaller_gpu(limit, monkeypatch):
    """On a GPU that allows a block less dynamic shared memory than the H200 (RTX 30/40
    cards 99 KB, RTX 20 cards 64 KB, older ones 48 KB), the default tile rules of forward
    v5 and v6 and backward v4 pick tiles within that GPU's maximum, so the defaults run
    there; on the H200 the rules are unchanged."""
    plan_as_on_a_gpu(monkeypatch, limit)
    for acc in ("float32", "float64"):
        for d in (1, 16, 32, 64, 72, 96, 128, 160, 256):
            t = fwd_v5.default_v5_tiles(d, acc, "gpu")
            assert fwd_v5.v5_shared_bytes(*t, d, acc) <= limit
            t = bwd_v4.default_backward_v4_tiles(d, acc, "gpu")
            assert bwd_v4._bwd_v4_bytes(t, d, acc) <= limit
    if limit == 101376:      # the H200's choices at d = 64 need 107520 bytes (forward)
        assert fwd_v5.default_v5_tiles(64, "float32", "gpu") == (64, 32, 4, 2)
        assert bwd_v4.default_backward_v4_tiles(64, "float32", "gpu") == (64, 64, 4, 4)
    for d in (1, 16, 32, 64, 72, 96, 128):
        fake = types.SimpleNamespace(shape=(1, 1, 4096, d), dtype=np.dtype("float32"))
        plan = numbaflash.explain(fake, fake, fake)
        assert plan.shared_bytes <= limit
        # v8 (v9 from d = 65) where one of their tiles fits; otherwise v5 (or v8 where
        # only v6's fits), and the reason says why
        assert (plan.version in ("v8", "v9") or "no v6 tile fits" in plan.reason), plan
    fake = types.SimpleNamespace(shape=(1, 1, 4096, 64), dtype=np.dtype("float32"))
    plan = numbaflash.explain(fake, fake, fake)
    # simulating() is patched away, so the planner sees a GPU: the default is v8
    assert plan.version == "v8" and plan.shared_bytes <= limit
    plans = numbaflash.explain_backward(fake, fake, fake)
    assert all(p.shared_bytes <= limit for p in plans)


def test_the_device_limit_is_the_gpus_or_the_h200s():
    """On a GPU the rules plan for that GPU's per-block maximum (the query the default
    tile rules make); without one (the simulator, or no CUDA at all) for the H100/H200's
    227 KB, so the tile tables above are what a test machine checks."""
    from numba import config, cuda
    if config.ENABLE_CUDASIM or not cuda.is_available():
        expected = 227 * 1024
        assert launch_plan.DYNAMIC_SHARED_MEM_LIMIT == expected
    else:
        expected = cuda.get_current_device().MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
        assert expected >= 48 * 1024
    assert launch_plan.device_dynamic_shared_limit() == expected


def test_explain_shows_another_backends_plan():
    """explain(..., backend="gpu") shows what a GPU runs, on any machine (the H100/H200's
    shared memory where there is no GPU to ask); backend="simulator" what the simulator
    runs; anything else is a ValueError that names the choices."""
    for d, dtype, forward, backward in ((64, np.float32, "v8", "v6"), (128, np.float32, "v9", "v6"),
                                        (64, np.float16, "v10", "v9"), (64, np.float64, "v2", "v3")):
        q, k, v = arrays((2, 3, 300, d), (2, 3, 200, d), dtype=dtype)
        plan = numbaflash.explain(q, k, v, backend="gpu")
        assert (plan.version, plan.backend) == (forward, "gpu"), plan
        plans = numbaflash.explain_backward(q, k, v, backend="gpu")
        assert {p.version for p in plans} == {backward} and plans[-1].backend == "gpu"
    q, k, v = arrays((2, 3, 300, 64), (2, 3, 200, 64))
    sim = numbaflash.explain(q, k, v, backend="simulator")
    assert (sim.version, sim.backend, (sim.Br, sim.Bc)) == ("v5", "simulator", (8, 8))
    assert numbaflash.explain_backward(q, k, v, backend="simulator")[-1].version == "v4"
    gpu_v5 = numbaflash.explain(q, k, v, backend="gpu", version="v5")
    assert (gpu_v5.Br, gpu_v5.Bc) == (128, 64)          # the GPU's tile rule, not the simulator's
    with pytest.raises(ValueError, match=r"backend must be one of \('gpu', 'simulator'\)"):
        numbaflash.explain(q, k, v, backend="tpu")
