"""L0 (NumPy) and L2/L3 (one warp, simulator or GPU): the building blocks of the split-KV
decode kernel (numbaflash/kernels/decode/split_kv.py), apart from the kernel.

1. The transposed reduction, ``step_scores``: a step's KEYS partial dot products summed
   over the warp's 32 lanes together, so that each lane ends with the whole score of one
   key. ``step_scores_numpy`` follows the same shuffles lane by lane in NumPy (the
   same float32 additions in the same order): read it next to the device function. Its
   result is each key's sum, and the device function's (run by one warp) has its bits.
   The same warp checks ``step_max`` (NaN is never the max; +0 and -0 give the same bits
   in every lane) and ``from_key``.
2. Which loads the plan compiles (``load_width``): wide (8 bytes a lane) only where every
   load is 8-byte aligned; and the per-step sizes (``keys_per_step``).

The kernel itself, with both loads and both reductions, is tested against the float64
reference in tests/test_kvcache.py ("wide loads and the transposed reduction").
"""

import functools

import numpy as np
import pytest
from numba import cuda, float32

from numbaflash.kernels.decode import split_kv

KEY_COUNTS = (1, 2, 4, 8)


# --- 1. the transposed reduction ---------------------------------------------------------

def step_scores_numpy(parts):
    """What split_kv's ``step_scores`` returns in each lane, for ``parts`` (32, KEYS)
    float32: lane x's partial dot products of the step's KEYS keys.

    Round over lane bit ``mask`` (16, 8, ...): lane x pairs with lane x ^ mask; the lane
    with that bit set keeps the upper half of the keys it holds, the other the lower half,
    and each adds what its partner sends (the half it keeps). After log2(KEYS) rounds lane
    x holds one key's sum over part of the warp; xor rounds over the lower bits finish it.
    Returns (32,) float32: lane x holds the score of key x // (32 // KEYS)."""
    lanes = np.arange(32)
    keys = parts.shape[1]
    s = parts.astype(np.float32)
    half, mask = keys // 2, 16
    while half >= 1:
        upper = ((lanes & mask) != 0)[:, None]
        keep = np.where(upper, s[:, half:2 * half], s[:, :half])
        send = np.where(upper, s[:, :half], s[:, half:2 * half])
        s = keep + send[lanes ^ mask]           # shfl_xor: lane x reads lane x ^ mask
        half, mask = half // 2, mask // 2
    x = s[:, 0]
    while mask >= 1:
        x = x + x[lanes ^ mask]
        mask //= 2
    return x


@pytest.mark.parametrize("keys", KEY_COUNTS)
def test_the_numpy_lanes_sum_each_key(keys):
    """step_scores_numpy gives lane x the sum of key x // (32 / KEYS) over the 32 lanes
    (within float32 rounding of 31 additions), the same bits in every lane of a key, and
    uses 9 shuffles for 8 keys (counted: one per value sent)."""
    rng = np.random.default_rng(keys)
    parts = rng.uniform(-4, 4, (32, keys)).astype(np.float32)
    got = step_scores_numpy(parts)
    key_of = np.arange(32) // (32 // keys)
    want = parts.astype(np.float64).sum(axis=0)[key_of]
    bound = 32 * np.finfo(np.float32).eps * np.abs(parts).sum(axis=0)[key_of]
    assert np.all(np.abs(got - want) <= bound)
    for e in range(keys):
        assert len(set(got[key_of == e].view(np.uint32).tolist())) == 1
    rounds = keys.bit_length() - 1
    shuffles = sum(keys >> (r + 1) for r in range(rounds)) + 5 - rounds
    assert shuffles == keys - 1 + 5 - rounds and (keys != 8 or shuffles == 9)


@functools.lru_cache(maxsize=None)
def one_warp_kernel(keys):
    """A one-warp kernel running make_step_reduction(keys)'s step_scores, step_max and
    from_key on parts (32, keys): scores (32,), maxes (32,), gathered (32, keys)."""
    reduction = split_kv.make_step_reduction(keys, "float32")
    step_scores, step_max, from_key = (reduction.step_scores, reduction.step_max,
                                       reduction.from_key)

    @cuda.jit
    def kernel(parts, scores, maxes, gathered):
        lane = cuda.threadIdx.x
        s = cuda.local.array(keys, float32)
        for e in range(keys):
            s[e] = parts[lane, e]
        x = step_scores(s, lane)
        scores[lane] = x
        maxes[lane] = step_max(x)
        for e in range(keys):
            gathered[lane, e] = from_key(x, e)

    return kernel


def run_one_warp(parts):
    keys = parts.shape[1]
    scores = np.full(32, np.nan, np.float32)
    maxes = np.full(32, np.nan, np.float32)
    gathered = np.full((32, keys), np.nan, np.float32)
    d_scores, d_maxes, d_gathered = (cuda.to_device(a) for a in (scores, maxes, gathered))
    one_warp_kernel(keys)[1, 32](cuda.to_device(parts), d_scores, d_maxes, d_gathered)
    return d_scores.copy_to_host(), d_maxes.copy_to_host(), d_gathered.copy_to_host()


def key_sums(parts):
    """Each key's whole score (step_scores_numpy's, by key)."""
    keys = parts.shape[1]
    return step_scores_numpy(parts)[np.arange(keys) * (32 // keys)]


@pytest.mark.parametrize("keys", KEY_COUNTS)
def test_one_warp_follows_the_numpy_lanes(keys):
    """The device functions on one warp: step_scores has step_scores_numpy's bits in
    every lane; step_max is the keys' max in every lane; from_key gives every lane each
    key's score."""
    rng = np.random.default_rng(10 + keys)
    parts = rng.uniform(-4, 4, (32, keys)).astype(np.float32)
    scores, maxes, gathered = run_one_warp(parts)
    np.testing.assert_array_equal(scores.view(np.uint32),
                                  step_scores_numpy(parts).view(np.uint32))
    sums = key_sums(parts)
    np.testing.assert_array_equal(maxes, np.full(32, sums.max(), np.float32))
    np.testing.assert_array_equal(gathered, np.broadcast_to(sums, (32, keys)))


def test_step_max_skips_nan_and_gives_every_lane_the_same_bits():
    """Keys whose sums are NaN, -inf, -0 and +0 (8 keys): the max is 0, as +0 in every
    lane (a max over '>' keeps whichever zero a lane saw first); with every key NaN or
    -inf it is -inf. from_key passes NaN through."""
    parts = np.full((32, 8), -np.inf, np.float32)
    parts[:, 0] = 1.0
    parts[5, 0] = np.nan                        # key 0: NaN
    parts[:, 2] = -0.0                          # key 2: -0 (a sum of -0s)
    parts[:, 3] = 0.0                           # key 3: +0
    _, maxes, gathered = run_one_warp(parts)
    np.testing.assert_array_equal(maxes.view(np.uint32), np.zeros(32, np.uint32))
    assert np.isnan(gathered[:, 0]).all() and np.isneginf(gathered[:, 1]).all()
    parts[:, 2:4] = np.nan
    _, maxes, _ = run_one_warp(parts)
    assert np.isneginf(maxes).all()


# --- 2. which loads, and the sizes of a step ------------------------------------------------

def layout(k_strides=(4096, 1024, 128), v_strides=(4096, 1024, 128), k_address=0,
           v_address=256):
    return split_kv.CacheLayout(k_strides, v_strides, k_address, v_address)


@pytest.mark.parametrize("dtype,vec", [("float16", 4), ("bfloat16", 4), ("float32", 2),
                                       ("float64", 1)])
def test_wide_loads_where_the_caches_allow_them(dtype, vec):
    if dtype == "bfloat16":
        import ml_dtypes
        dtype = ml_dtypes.bfloat16
    got, why = split_kv.load_width(dtype, 128, None)
    assert got == vec and (f"{vec} " in why if vec > 1 else "one float64" in why)
    assert split_kv.load_width(dtype, 128, layout())[0] == vec


@pytest.mark.parametrize("case,reason", [
    (dict(d=42), "head dim 42 is not a multiple of 4"),
    (dict(k_address=2), "k_cache does not start at an 8-byte aligned address"),
    (dict(v_address=1028), "v_cache does not start at an 8-byte aligned address"),
    (dict(v_strides=(4096, 1024, 42)), "v_cache's strides (4096, 1024, 42)"),
    (dict(k_strides=(0, 130, 128)), "k_cache's strides (0, 130, 128)"),
])
def test_one_element_a_load_otherwise_and_the_reason_says_why(case, reason):
    case = dict(case)
    d = case.pop("d", 128)
    vec, why = split_kv.load_width("float16", d, layout(**case))
    assert vec == 1 and reason in why and "one float16 element" in why


def test_loads_can_be_forced_to_one_element(monkeypatch):
    monkeypatch.setattr(split_kv, "LOADS", "scalar")
    vec, why = split_kv.load_width("float16", 128, None)
    assert vec == 1 and "LOADS" in why


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_a_step_is_a_power_of_two_keys_within_the_registers(dtype):
    """The most keys (a power of two, at most 8) whose values of a lane fit LANE_VALUES
    32-bit registers, for every head dim and both loads."""
    acc = "float64" if dtype == "float64" else "float32"
    vec = split_kv.wide_vec(np.dtype(dtype).itemsize)
    for d in range(1, 257):
        for v in {1, vec if d % vec == 0 else 1}:
            keys = split_kv.keys_per_step(d, v, acc)
            registers = split_kv.columns_per_lane(d, v) * np.dtype(acc).itemsize // 4
            assert keys in KEY_COUNTS and keys * registers <= split_kv.LANE_VALUES
            assert keys == 8 or 2 * keys * registers > split_kv.LANE_VALUES


def test_factory_refuses_what_it_cannot_compile():
    with pytest.raises(ValueError, match="divide the head dim 42"):
        split_kv.make_split_kv(42, 1, False, "float32", vec=4)
    with pytest.raises(ValueError, match="reduction"):
        split_kv.make_split_kv(64, 1, False, "float32", reduction="tree")
    with pytest.raises(ValueError, match="1, 2, 4 or 8 keys"):
        split_kv.make_step_reduction(3, "float32")


def test_the_simulators_wide_load_faults_where_a_gpu_would():
    """flat_load_wide's stand-in reads 8 bytes as the elements of A, bit for bit, and
    raises on an address that is not 8-byte aligned or past the end of A's allocation (a
    GPU's vector load faults there)."""
    from numbaflash.kernels import simulated
    a = np.arange(16, dtype=np.float16)
    assert simulated.flat_load_wide(a, 4) == (4.0, 5.0, 6.0, 7.0)
    b = np.arange(8, dtype=np.float32)
    assert simulated.flat_load_wide(b, 6) == (6.0, 7.0)
    with pytest.raises(ValueError, match="misaligned"):
        simulated.flat_load_wide(a, 2)
    with pytest.raises(ValueError, match="misaligned"):
        simulated.flat_load_wide(b[1:], 0)
    # past the end of the allocation (a GPU faults), and inside it past a view's own span
    with pytest.raises(IndexError, match="8 bytes past the end of its allocation"):
        simulated.flat_load_wide(a, 16)
    with pytest.raises(IndexError, match="8 bytes past the end"):
        simulated.flat_load_wide(b[2:], 6)      # b's elements 8 and 9
    assert simulated.flat_load_wide(b[:2], 6) == (6.0, 7.0)
