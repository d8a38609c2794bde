"""Dropout's random numbers: Philox-4x32-10 (NumPy, scalar Python, device), the keep mask,
dropout's argument checks, and the dense reference with dropout.

What is checked, and against what:

- Known answers: Random123's published vectors for Philox-4x32 (10 rounds, and 7 rounds
  for the ``rounds`` argument), for the NumPy version, the scalar oracle below and the
  device function (simulator, or GPU where there is one).
- The NumPy version against ``philox_scalar``, a plain-int transcription of the round
  function, on counters and keys drawn by Hypothesis (which favours 0 and 2**32 - 1).
- The device functions of numbaflash/kernels/philox.py against reference.philox4x32 and
  dropout.dropout_mask, in a tiny kernel; and their PTX (compiled for sm_90 in a
  subprocess, no GPU needed): 20 mul.wide.u32 for the 10 rounds, no 64-bit xor, no
  float64. The tensor-core kernels' warp-shared tests (kernels/variants.py's kept_rows
  and kept_keys) in a one-warp kernel whose lanes hold the kernels' fragment entries,
  against dropout_mask at those entries.
- Statistics of the mask, each a z-test of a count of independent Bernoulli trials with a
  false-alarm rate of 1e-6 per test (z = 4.89, two-sided): the keep rate, the rate of each
  of the four words, and the rate at which two elements that share all coordinates but
  one (the word within a Philox block, the next block, the next row, head, batch, or a
  seed differing in either 32-bit key word) agree. The pairs of one test are disjoint, so
  their agreements are independent trials under the null hypothesis. The seeds are fixed,
  so the outcome never changes from run to run; the false-alarm rate is the probability
  that a correct generator fails for a seed picked at random (with the ~70 tests here, at
  most 7e-5 by the union bound). Power, measured by swapping in weaker generators: they
  fail Philox cut to 1, 2, 3, 4 or 5 rounds (adjacent rows still agree at z = 33 after 5
  rounds), a counter without the head, and one word used for all four columns.
- The dense reference with dropout: O against the formula (P * keep / (1 - p)) V, the lse
  unchanged, p = 0 with an all-True mask bitwise equal to no dropout, and the backward
  against fourth-order central differences of sum(dO * O) with the mask held fixed (as
  in test_backward_reference.py).
"""

import os
import re
import statistics
import subprocess
import sys
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import cuda

from numbaflash import reference
from numbaflash.dropout import (check_dropout, check_dropout_p, dropout_mask,
                                keep_threshold, seed_words)
from numbaflash.kernels import simulating
from numbaflash.kernels.philox import dropout_keep, philox4x32
from numbaflash.kernels.variants import Variant, make_dropout
from strategies import attention_cases, examples

MANY = examples(5)          # NumPy only: five times a kernel test's count
U32 = 2**32

# Random123's known-answer vectors ("kat_vectors" in the Random123 distribution), as
# reproduced in DEShawResearch/Random123-Boost, libs/random/test/test_philox.cpp
# (test_kat_philox4x32), whose comment says they were cut and pasted from that file:
# (counter c0..c3, key k0 k1) -> output. Several independent implementations in public
# repositories test against the same 10-round values.
KAT_10 = [
    ((0x00000000, 0x00000000, 0x00000000, 0x00000000), (0x00000000, 0x00000000),
     (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF),
     (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]
KAT_7 = [
    ((0x00000000, 0x00000000, 0x00000000, 0x00000000), (0x00000000, 0x00000000),
     (0x5F6FB709, 0x0D893F64, 0x4F121F81, 0x4F730A48)),
    ((0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF),
     (0x5207DDC2, 0x45165E59, 0x4D8EE751, 0x8C52F662)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0x4DFCCABA, 0x190A87F0, 0xC47362BA, 0xB6B5242A)),
]

# Two-sided z for a false-alarm rate of 1e-6 per test: 4.8916...
FALSE_ALARM = 1e-6
Z = statistics.NormalDist().inv_cdf(1 - FALSE_ALARM / 2)

needs_cuda = pytest.mark.skipif(not simulating() and not cuda.is_available(),
                                reason="needs the CUDA simulator or a GPU")


def philox_scalar(counter, key, rounds=10):
    """Philox-4x32 on Python ints, straight from the definition (the test's own oracle)."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for r in range(rounds):
        if r:
            k0 = (k0 + 0x9E3779B9) % U32
            k1 = (k1 + 0xBB67AE85) % U32
        p0 = 0xD2511F53 * c0
        p1 = 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (p1 // U32) ^ c1 ^ k0, p1 % U32, (p0 // U32) ^ c3 ^ k1, p0 % U32
    return c0, c1, c2, c3


# --- known answers ---------------------------------------------------------------------

@pytest.mark.parametrize("rounds, kat", [(10, KAT_10), (7, KAT_7)])
def test_reference_philox_known_answers(rounds, kat):
    for counter, key, want in kat:
        got = reference.philox4x32(np.array(counter, np.uint32), np.array(key, np.uint32),
                                   rounds=rounds)
        assert got.dtype == np.uint32 and got.shape == (4,)
        assert [int(x) for x in got] == list(want)
    # all three at once, from plain Python ints
    got = reference.philox4x32([c for c, _, _ in kat], [k for _, k, _ in kat], rounds=rounds)
    assert got.tolist() == [list(w) for _, _, w in kat]


@pytest.mark.parametrize("rounds, kat", [(10, KAT_10), (7, KAT_7)])
def test_scalar_oracle_known_answers(rounds, kat):
    for counter, key, want in kat:
        assert philox_scalar(counter, key, rounds) == want


# --- the NumPy version against the scalar oracle --------------------------------------

word = st.integers(0, U32 - 1)
counters = st.tuples(word, word, word, word)
keys = st.tuples(word, word)


@settings(max_examples=MANY)
@given(cs=st.lists(counters, min_size=1, max_size=6), ks=st.lists(keys, min_size=1,
                                                                 max_size=6))
def test_reference_philox_matches_scalar(cs, ks):
    n = min(len(cs), len(ks))
    cs, ks = cs[:n], ks[:n]
    got = reference.philox4x32(np.array(cs, np.uint32), np.array(ks, np.uint32))
    assert got.tolist() == [list(philox_scalar(c, k)) for c, k in zip(cs, ks)]


@settings(max_examples=MANY)
@given(cs=st.lists(counters, min_size=1, max_size=4), key=keys)
def test_reference_philox_broadcasts(cs, key):
    """A (2, n, 4) counter against one (2,) key; and an (n, 1, 4) counter against (3, 2)
    keys gives (n, 3, 4)."""
    c = np.array(cs, np.uint32)
    got = reference.philox4x32(np.stack([c, c[::-1]]), np.array(key, np.uint32))
    assert got.shape == (2, len(cs), 4)
    assert got[0].tolist() == [list(philox_scalar(x, key)) for x in cs]
    assert got[1].tolist() == [list(philox_scalar(x, key)) for x in cs[::-1]]
    ks = np.array([key, (0, 0), (U32 - 1, 1)], np.uint32)
    grid = reference.philox4x32(c[:, None, :], ks)
    assert grid.shape == (len(cs), 3, 4)
    assert grid.tolist() == [[list(philox_scalar(x, tuple(k))) for k in ks.tolist()]
                             for x in cs]


def test_reference_philox_rejects_words_out_of_range():
    with pytest.raises(ValueError, match=r"\[0, 2\*\*32\)"):
        reference.philox4x32([0, 0, 0, U32], [0, 0])
    with pytest.raises(ValueError, match=r"\[0, 2\*\*32\)"):
        reference.philox4x32([0, 0, 0, 0], [-1, 0])
    with pytest.raises(ValueError, match=r"\(\.\.\., 4\)"):
        reference.philox4x32([0, 0, 0], [0, 0])


# --- the device functions (simulator or GPU) ----------------------------------------------

@cuda.jit
def philox_kernel(counter, key, out):
    t = cuda.grid(1)
    if t < out.shape[0]:
        r0, r1, r2, r3 = philox4x32(counter[t, 0], counter[t, 1], counter[t, 2],
                                    counter[t, 3], key[t, 0], key[t, 1])
        out[t, 0] = r0
        out[t, 1] = r1
        out[t, 2] = r2
        out[t, 3] = r3


@cuda.jit
def keep_kernel(seed_lo, seed_hi, threshold, keep):
    """keep[b, h, i, j] = dropout_keep(...): one block per (b, h), one thread per (i, j)."""
    b = cuda.blockIdx.x
    h = cuda.blockIdx.y
    i = cuda.threadIdx.y
    j = cuda.threadIdx.x
    keep[b, h, i, j] = dropout_keep(seed_lo, seed_hi, threshold, b, h, i, j)


def run_philox_kernel(counter, key):
    counter = np.ascontiguousarray(counter, np.uint32)
    key = np.ascontiguousarray(key, np.uint32)
    out = cuda.to_device(np.zeros_like(counter))
    with warnings.catch_warnings():
        # no NumPy overflow warning in the simulator (RuntimeWarning); a GPU's
        # low-occupancy warning for this one-block launch is not this test's business
        warnings.simplefilter("error", RuntimeWarning)
        philox_kernel[1, counter.shape[0]](cuda.to_device(counter), cuda.to_device(key), out)
    return out.copy_to_host()


@needs_cuda
def test_device_philox_known_answers():
    got = run_philox_kernel([c for c, _, _ in KAT_10], [k for _, k, _ in KAT_10])
    assert got.tolist() == [list(w) for _, _, w in KAT_10]


@needs_cuda
def test_device_philox_matches_reference():
    rng = np.random.default_rng(20240611)
    counter = rng.integers(0, U32, size=(32, 4), dtype=np.uint32)
    key = rng.integers(0, U32, size=(32, 2), dtype=np.uint32)
    counter[:4] = [[0, 0, 0, 0], [U32 - 1] * 4, [U32 - 1, 0, U32 - 1, 0], [1, 2, 3, 4]]
    key[:4] = [[U32 - 1, U32 - 1], [0, 0], [1, U32 - 1], [U32 - 1, 0]]
    np.testing.assert_array_equal(run_philox_kernel(counter, key),
                                  reference.philox4x32(counter, key))


@needs_cuda
@pytest.mark.parametrize("p, seed", [(0.3, 0x0123456789ABCDEF), (0.9, 7),
                                     (2.0**-40, 2**64 - 1)])
def test_device_dropout_keep_matches_dropout_mask(p, seed):
    """B = 2, H = 3 (blocks), Sq = 5, Sk = 11 (threads): Sk is not a multiple of 4, so the
    last Philox block is cut; the seed words and threshold are passed as uint32, as the
    kernels will. p = 2**-40 has the largest threshold, 2**32 - 1."""
    B, H, Sq, Sk = 2, 3, 5, 11
    lo, hi = seed_words(seed)
    keep = cuda.to_device(np.zeros((B, H, Sq, Sk), dtype=np.bool_))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)     # (as in run_philox_kernel)
        keep_kernel[(B, H), (Sk, Sq)](np.uint32(lo), np.uint32(hi),
                                      np.uint32(keep_threshold(p)), keep)
    np.testing.assert_array_equal(keep.copy_to_host(), dropout_mask(B, H, Sq, Sk, p, seed))



# The warp-shared keep tests of the tensor-core kernels (kernels/variants.py, make_dropout):
# one warp whose lanes hold the fragment entries the kernels give them, each lane writing
# the four bits it gets, against dropout_mask at those entries.
_SHARED = make_dropout(Variant(dropout=True))


@cuda.jit
def kept_rows_kernel(seed_lo, seed_hi, threshold, b, h, row_base, col_base, out):
    """Lane (g, t) = (lane // 4, lane % 4) holds keys col_base + 8 n + 2 t, + 1 of rows
    row_base + g and + g + 8, as in forward v6-v9's S fragments (n-tile n = blockIdx.x)."""
    lane = cuda.threadIdx.x
    n = cuda.blockIdx.x
    g, t = lane // 4, lane % 4
    k0, k1, k2, k3 = _SHARED.kept_rows(seed_lo, seed_hi, threshold, b, h, row_base + g,
                                       col_base + 8 * n + 2 * t, t)
    out[n, lane, 0] = k0
    out[n, lane, 1] = k1
    out[n, lane, 2] = k2
    out[n, lane, 3] = k3


@cuda.jit
def kept_keys_kernel(seed_lo, seed_hi, threshold, b, h, row_base, key_base, out):
    """Lane (g, t) holds query rows row_base + 8 n + 2 t, + 1 of keys key_base + g and
    + g + 8, as in backward v6's S^T fragments (key_base a multiple of 16)."""
    lane = cuda.threadIdx.x
    n = cuda.blockIdx.x
    g, t = lane // 4, lane % 4
    k0, k1, k2, k3 = _SHARED.kept_keys(seed_lo, seed_hi, threshold, b, h,
                                       row_base + 8 * n + 2 * t, key_base + g, g)
    out[n, lane, 0] = k0
    out[n, lane, 1] = k1
    out[n, lane, 2] = k2
    out[n, lane, 3] = k3


@needs_cuda
@pytest.mark.parametrize("p, seed", [(0.5, 2**40 + 17), (0.1, 0xFEDCBA9876543210)])
def test_warp_shared_keep_tests_match_dropout_mask(p, seed):
    """kept_rows and kept_keys give every lane the bits dropout_mask has at the entries
    its fragment holds (b = 1, h = 2; rows and keys away from 0; two n-tiles)."""
    B, H, Sq, Sk, b, h = 2, 3, 64, 96, 1, 2
    mask = dropout_mask(B, H, Sq, Sk, p, seed)[b, h]
    lo, hi = seed_words(seed)
    args = (np.uint32(lo), np.uint32(hi), np.uint32(keep_threshold(p)), b, h)
    rows = cuda.to_device(np.zeros((2, 32, 4), np.bool_))
    kept_rows_kernel[2, 32](*args, 16, 32, rows)
    keys = cuda.to_device(np.zeros((2, 32, 4), np.bool_))
    kept_keys_kernel[2, 32](*args, 24, 48, keys)
    rows, keys = rows.copy_to_host(), keys.copy_to_host()
    for n in range(2):
        for lane in range(32):
            g, t = lane // 4, lane % 4
            col = 32 + 8 * n + 2 * t
            want = [mask[16 + g, col], mask[16 + g, col + 1], mask[24 + g, col],
                    mask[24 + g, col + 1]]
            assert rows[n, lane].tolist() == want, ("kept_rows", n, lane)
            row, key = 24 + 8 * n + 2 * t, 48 + g
            want = [mask[row, key], mask[row + 1, key], mask[row, key + 8],
                    mask[row + 1, key + 8]]
            assert keys[n, lane].tolist() == want, ("kept_keys", n, lane)

PTX_SCRIPT = r"""
import re, sys
from numba import cuda
from numba.cuda import dispatcher
if not cuda.is_available():     # the target's compute capability, not a device's (as in
    class FakeDevice:           # tests/ptx_check.py: typing a call to a device function
        compute_capability = (9, 0)     # asks the current device for it)
    dispatcher.get_current_device = lambda: FakeDevice()
sys.path.insert(0, "tests")
from test_dropout_rng import keep_kernel, kept_keys_kernel, kept_rows_kernel, philox_kernel

warp = "void(uint32, uint32, uint32, int64, int64, int64, int64, boolean[:, :, :])"
for name, kernel, sig in [
        ("philox", philox_kernel, "void(uint32[:, :], uint32[:, :], uint32[:, :])"),
        ("keep", keep_kernel, "void(uint32, uint32, uint32, boolean[:, :, :, :])"),
        ("kept_rows", kept_rows_kernel, warp), ("kept_keys", kept_keys_kernel, warp)]:
    ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=(9, 0))
    ops = re.findall(r"^\s*([a-z]+(?:\.[a-z0-9]+)*)", ptx, re.M)
    print("PTXOPS", name, " ".join(ops), "F64", len(re.findall(r"\.f64\b", ptx)))
"""


def test_device_functions_compile_to_32_bit_ptx():
    """The PTX (sm_90, compiled in a subprocess: the simulator has no compiler) of the
    kernels above: one calling ``philox4x32``, one calling ``dropout_keep`` with uint32
    seed words and threshold, and the two warp-shared tests. The first two have one
    mul.wide.u32 per mulhilo32 (2 per round, 10 rounds), the counter and key arithmetic in
    32 bits (no 64-bit xor) and no float64. The warp-shared ones make one Philox call per
    lane, not two or four: 18 to 20 mul.wide.u32 (with int64 b and h, as the kernels pass
    them, NVVM does 2 of the 20 products in 64 bits), shuffles, no float64."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", PTX_SCRIPT], env=env, cwd=root,
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 0 and re.search(r"libNVVM|NVVM.*not found", proc.stderr):
        pytest.skip("NVVM is not installed: " + proc.stderr.strip().splitlines()[-1])
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line.split() for line in proc.stdout.splitlines() if line.startswith("PTXOPS")]
    assert [line[1] for line in lines] == ["philox", "keep", "kept_rows", "kept_keys"]
    for line in lines:
        name, ops, f64 = line[1], line[2:-2], int(line[-1])
        assert f64 == 0, f"{name}: float64 in the PTX"
        if name.startswith("kept_"):
            assert 18 <= ops.count("mul.wide.u32") <= 20, (name, sorted(set(ops)))
            assert any(op.startswith("shfl.sync") for op in ops), name
        else:
            assert ops.count("mul.wide.u32") == 20, (name, sorted(set(ops)))
            assert "xor.b64" not in ops, name
            assert ops.count("xor.b32") >= 40, name


# --- keep_threshold, seed_words, check_dropout -------------------------------------------

@pytest.mark.parametrize("p, want", [
    (0.5, 2**31), (0.25, 3 * 2**30), (0.75, 2**30), (0.1, 3865470566),
    (2.0**-32, U32 - 1), (2.0**-40, U32 - 1), (5e-324, U32 - 1),
    (1 - 2.0**-32, 1), (1 - 2.0**-33, 0), (0.0, U32)])
def test_keep_threshold_values(p, want):
    assert keep_threshold(p) == want


@settings(max_examples=MANY)
@given(p=st.floats(0.0, 1.0, exclude_min=True, exclude_max=True))
def test_keep_threshold_is_floor_of_exact_value(p):
    """T / 2**32 <= 1 - p < (T + 1) / 2**32 in exact arithmetic, and T fits a uint32."""
    from fractions import Fraction
    T = keep_threshold(p)
    assert isinstance(T, int) and 0 <= T <= U32 - 1
    assert Fraction(T, U32) <= 1 - Fraction(p) < Fraction(T + 1, U32)


@pytest.mark.parametrize("seed, want", [(0, (0, 0)), (1, (1, 0)), (2**32, (0, 1)),
                                        (0x0123456789ABCDEF, (0x89ABCDEF, 0x01234567)),
                                        (2**64 - 1, (U32 - 1, U32 - 1)),
                                        (np.uint64(2**64 - 1), (U32 - 1, U32 - 1))])
def test_seed_words(seed, want):
    assert seed_words(seed) == want


@pytest.mark.parametrize("p, seed, want", [
    (0.0, None, (0.0, None)), (0, None, (0.0, None)), (0.0, 5, (0.0, 5)),
    (0.1, 0, (0.1, 0)), (np.float32(0.5), np.uint64(2**64 - 1), (0.5, 2**64 - 1)),
    (np.float64(0.25), np.int32(3), (0.25, 3))])
def test_check_dropout_accepts(p, seed, want):
    got = check_dropout(p, seed)
    assert got == want and type(got[0]) is float
    assert got[1] is None or type(got[1]) is int


@pytest.mark.parametrize("p", [-0.1, 1.0, 1, 1.5, float("nan"), float("inf"), -0.0 - 1e-300])
def test_check_dropout_rejects_p_out_of_range(p):
    with pytest.raises(ValueError, match=r"dropout_p must lie in \[0, 1\)"):
        check_dropout(p, 0)
    with pytest.raises(ValueError, match=r"dropout_p must lie in \[0, 1\)"):
        check_dropout_p(p)


@pytest.mark.parametrize("p", [True, False, np.bool_(False), "0.1", None, 0.5j, [0.1]])
def test_check_dropout_rejects_p_not_real(p):
    with pytest.raises(ValueError, match=r"dropout_p must be a real number in \[0, 1\)"):
        check_dropout(p, 0)


def test_check_dropout_needs_seed_when_p_positive():
    with pytest.raises(ValueError, match=r"needs dropout_seed, an int in \[0, 2\*\*64\)"):
        check_dropout(0.1, None)


@pytest.mark.parametrize("seed", [-1, 2**64, np.int64(-1)])
def test_check_dropout_rejects_seed_out_of_range(seed):
    with pytest.raises(ValueError, match=r"dropout_seed must lie in \[0, 2\*\*64\)"):
        check_dropout(0.1, seed)


@pytest.mark.parametrize("seed", [True, np.bool_(True), 1.0, np.float64(3), "3", 3 + 0j])
def test_check_dropout_rejects_seed_not_int(seed):
    with pytest.raises(ValueError, match=r"dropout_seed must be an int in \[0, 2\*\*64\)"):
        check_dropout(0.1, seed)
    with pytest.raises(ValueError, match=r"dropout_seed must be an int"):
        check_dropout(0.0, seed)          # a seed given with p = 0 is checked too


# --- the mask: definition, p = 0, determinism ---------------------------------------------

def test_dropout_mask_definition():
    """Element by element, from the contract with the scalar oracle (no NumPy Philox)."""
    B, H, Sq, Sk, p, seed = 2, 2, 3, 6, 0.4, 2**63 + 12345
    T = keep_threshold(p)
    key = (seed % U32, seed // U32)
    want = np.array([[[[philox_scalar((j // 4, i, h, b), key)[j % 4] < T
                        for j in range(Sk)] for i in range(Sq)] for h in range(H)]
                     for b in range(B)])
    np.testing.assert_array_equal(dropout_mask(B, H, Sq, Sk, p, seed), want)


def test_dropout_mask_blocks_of_rows_agree(monkeypatch):
    """Building the mask a few rows at a time (as it does for large masks) gives the same."""
    import numbaflash.dropout as dropout
    want = dropout_mask(2, 2, 7, 9, 0.3, 11)
    monkeypatch.setattr(dropout, "_BLOCK_WORDS", 3)        # 1 row of 3 blocks per call
    np.testing.assert_array_equal(dropout.dropout_mask(2, 2, 7, 9, 0.3, 11), want)


@pytest.mark.parametrize("seed", [None, 0, 2**64 - 1])
def test_p_zero_keeps_everything(seed):
    keep = dropout_mask(2, 3, 5, 7, 0.0, seed)
    assert keep.shape == (2, 3, 5, 7) and keep.dtype == np.bool_ and keep.all()


@pytest.mark.parametrize("dims", [(0, 2, 3, 4), (1, 0, 3, 4), (1, 2, 0, 4), (1, 2, 3, 0)])
def test_empty_masks(dims):
    assert dropout_mask(*dims, 0.5, 1).shape == dims


def test_dropout_mask_rejects_bad_sizes():
    with pytest.raises(ValueError, match="non-negative ints"):
        dropout_mask(1, 1, -1, 4, 0.5, 1)
    with pytest.raises(ValueError, match="non-negative ints"):
        dropout_mask(1, 1, 2.0, 4, 0.5, 1)


def test_same_seed_same_mask_and_every_coordinate_matters():
    B, H, Sq, Sk, p = 2, 2, 16, 32, 0.5
    a = dropout_mask(B, H, Sq, Sk, p, 42)
    np.testing.assert_array_equal(a, dropout_mask(B, H, Sq, Sk, p, 42))
    for other in (43, 42 + 2**32, 42 ^ 2**63):          # either key word
        assert not np.array_equal(a, dropout_mask(B, H, Sq, Sk, p, other))
    assert not np.array_equal(a[:, 0], a[:, 1])          # heads
    assert not np.array_equal(a[0], a[1])                # batches
    assert not np.array_equal(a[:, :, 0], a[:, :, 1])    # rows
    assert not np.array_equal(a[..., :4], a[..., 4:8])   # Philox blocks
    # a larger mask extends a smaller one: nothing depends on the sizes
    np.testing.assert_array_equal(dropout_mask(B, H, Sq + 3, Sk + 5, p, 42)[..., :Sq, :Sk],
                                  a)


# --- statistics ---------------------------------------------------------------------------

def assert_rate(count, n, rate, what):
    """|count - n rate| <= Z sigma for a Binomial(n, rate) count (false alarm 1e-6)."""
    sigma = np.sqrt(n * rate * (1 - rate))
    assert abs(count - n * rate) <= Z * sigma, (
        f"{what}: {count} of {n}, expected {n * rate:.1f} +- {Z:.2f} * {sigma:.1f} "
        f"(z = {(count - n * rate) / sigma:.2f})")


STAT_SEEDS = [0, 2**64 - 1, 0x5DEECE66D2545F49]


@pytest.mark.parametrize("seed", STAT_SEEDS)
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate(p, seed):
    """Kept count of a 2**21-element mask, and of each of the four words separately."""
    keep = dropout_mask(2, 4, 512, 512, p, seed)
    q = keep_threshold(p) / U32                         # the exact keep probability
    assert_rate(int(keep.sum()), keep.size, q, f"kept, p = {p}")
    for w in range(4):
        part = keep[..., w::4]
        assert_rate(int(part.sum()), part.size, q, f"kept in word {w}, p = {p}")


def agreement(x, y, rate_keep, what):
    """x and y hold disjoint pairs of elements; under independence each pair agrees (both
    kept or both dropped) with probability q**2 + (1 - q)**2."""
    a = rate_keep ** 2 + (1 - rate_keep) ** 2
    assert_rate(int(np.sum(x == y)), x.size, a, what)


@pytest.mark.parametrize("seed", STAT_SEEDS)
@pytest.mark.parametrize("p", [0.5, 0.2])
def test_neighbours_are_independent(p, seed):
    """Pairs differing in one coordinate agree at the rate independence predicts: the
    words of one Philox block (all 6 pairs), the last word of a block and the first of the
    next, adjacent rows, heads, batches, and seeds differing in the low or the high key
    word. Each test uses disjoint pairs (about 2**18 to 2**20 of them)."""
    B, H, Sq, Sk = 2, 2, 256, 512
    keep = dropout_mask(B, H, Sq, Sk, p, seed)
    q = keep_threshold(p) / U32
    for w1 in range(4):
        for w2 in range(w1 + 1, 4):
            agreement(keep[..., w1::4], keep[..., w2::4], q, f"words {w1}, {w2}")
    agreement(keep[..., 3:-1:4], keep[..., 4::4], q, "word 3 and the next block's word 0")
    agreement(keep[:, :, 0::2], keep[:, :, 1::2], q, "rows 2t, 2t + 1")
    agreement(keep[:, 0], keep[:, 1], q, "heads 0, 1")
    agreement(keep[0], keep[1], q, "batches 0, 1")
    for other, what in (((seed + 1) % 2**64, "seed + 1"), (seed ^ 2**32, "seed ^ 2**32")):
        agreement(keep, dropout_mask(B, H, Sq, Sk, p, other), q, what)


# --- the dense reference with dropout ---------------------------------------------------

def small_case(seed, B=1, H=2, Hkv=None, Sq=5, Sk=7, d=3):
    rng = np.random.default_rng(seed)
    Hkv = H if Hkv is None else Hkv
    q = rng.uniform(-2, 2, (B, H, Sq, d))
    k = rng.uniform(-2, 2, (B, Hkv, Sk, d))
    v = rng.uniform(-2, 2, (B, Hkv, Sk, d))
    dout = rng.uniform(-2, 2, (B, H, Sq, d))
    return q, k, v, dout


@pytest.mark.parametrize("causal", [False, True, "top_left"])
def test_reference_p_zero_all_kept_is_no_dropout(causal):
    """dropout_keep all True with p = 0 gives bitwise the results without dropout."""
    q, k, v, dout = small_case(1, Sq=6, Sk=4)
    ones = np.ones((6, 4), dtype=bool)
    kw = dict(causal=causal, softcap=3.0)
    for got, want in zip(reference.forward(q, k, v, dropout_p=0.0, dropout_keep=ones, **kw),
                         reference.forward(q, k, v, **kw)):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(reference.backward(dout, q, k, v, dropout_p=0.0, dropout_keep=ones,
                                            **kw),
                         reference.backward(dout, q, k, v, **kw)):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(
        reference.probabilities(q, k, dropout_p=0, dropout_keep=ones, **kw),
        reference.probabilities(q, k, **kw))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("p", [0.2, 0.7])
def test_reference_forward_with_dropout_matches_formula(p, causal):
    """O = (P * keep / (1 - p)) V with P the undropped probabilities; lse unchanged; GQA
    (4 query heads on 2 K/V heads) so the mask follows the query head."""
    q, k, v, _ = small_case(2, B=2, H=4, Hkv=2, Sq=6, Sk=9)
    keep = dropout_mask(2, 4, 6, 9, p, 99)
    O, L = reference.forward(q, k, v, causal=causal, dropout_p=p, dropout_keep=keep)
    O0, L0 = reference.forward(q, k, v, causal=causal)
    P = reference.probabilities(q, k, causal=causal)
    want = (P * keep / (1 - p)) @ np.repeat(v, 2, axis=1)
    np.testing.assert_allclose(O, want, rtol=1e-13, atol=1e-13)
    np.testing.assert_array_equal(L, L0)
    assert not np.allclose(O, O0)
    np.testing.assert_allclose(
        reference.probabilities(q, k, causal=causal, dropout_p=p, dropout_keep=keep),
        P * keep / (1 - p), rtol=1e-15, atol=0)


def directional_fd(f, h=1e-3):
    """Fourth-order central difference of f at 0 (test_backward_reference.py's rule)."""
    return (-f(2 * h) + 8 * f(h) - 8 * f(-h) + f(-2 * h)) / (12 * h)


@settings(max_examples=MANY)
@given(case=attention_cases(dtypes=("float64",), tiles=None, with_dout=True, max_seqlen=8),
       p=st.sampled_from([0.1, 0.5, 0.9]), mask_seed=st.integers(0, 2**64 - 1))
def test_reference_backward_with_dropout_matches_finite_differences(case, p, mask_seed):
    """<dQ, uq> + <dK, uk> + <dV, uv> equals the derivative of sum(dO * O) along u, with
    the keep mask held fixed (the mask does not depend on the values, so the loss is
    smooth); tolerance as in test_backward_reference.py."""
    keep = dropout_mask(case.B, case.H, case.Sq, case.Sk, p, mask_seed)
    kw = dict(causal=case.causal, scale=case.scale, dropout_p=p, dropout_keep=keep)
    grads = reference.backward(case.dout, case.q, case.k, case.v, **kw)
    rng = case.rng
    u = [rng.standard_normal(a.shape) for a in (case.q, case.k, case.v)]

    for name, zero_others in (("all", None), ("dQ", 0), ("dK", 1), ("dV", 2)):
        uu = u if zero_others is None else [u[i] if i == zero_others else 0 * u[i]
                                            for i in range(3)]

        def f(t, uu=uu):
            O, _ = reference.forward(case.q + t * uu[0], case.k + t * uu[1],
                                     case.v + t * uu[2], **kw)
            return float(np.sum(case.dout * O))

        numeric = directional_fd(f)
        analytic = sum(float(np.sum(g * x)) for g, x in zip(grads, uu))
        size = sum(float(np.sum(np.abs(g * x))) for g, x in zip(grads, uu))
        O, _ = reference.forward(case.q, case.k, case.v, **kw)
        tol = 1e-7 * size + 1e-11 * float(np.sum(np.abs(case.dout * O)))
        assert abs(numeric - analytic) <= tol, (
            f"direction {name}: finite difference {numeric!r} vs analytic {analytic!r} "
            f"(tolerance {tol:.3g})")


def test_reference_backward_with_dropout_gqa_and_dropped_keys():
    """GQA (dK, dV summed over the group) with a mask that drops whole keys for one head:
    the dropped keys get dV = 0 from that head, and the gradients still match finite
    differences."""
    q, k, v, dout = small_case(3, B=1, H=2, Hkv=1, Sq=4, Sk=5)
    p = 0.5
    keep = np.ones((1, 2, 4, 5), dtype=bool)
    keep[0, 0, :, 1] = False                 # key 1 dropped for every row of head 0
    keep[0, 1, :, 1] = False                 # ... and of head 1
    keep[0, 1, 2, 3] = False
    kw = dict(causal=True, dropout_p=p, dropout_keep=keep)
    dQ, dK, dV = reference.backward(dout, q, k, v, **kw)
    assert np.all(dV[0, 0, 1] == 0)
    rng = np.random.default_rng(4)
    u = [rng.standard_normal(a.shape) for a in (q, k, v)]

    def f(t):
        O, _ = reference.forward(q + t * u[0], k + t * u[1], v + t * u[2], **kw)
        return float(np.sum(dout * O))

    analytic = sum(float(np.sum(g * x)) for g, x in zip((dQ, dK, dV), u))
    size = sum(float(np.sum(np.abs(g * x))) for g, x in zip((dQ, dK, dV), u))
    assert abs(directional_fd(f) - analytic) <= 1e-7 * size


def test_reference_dropout_argument_errors():
    q, k, v, dout = small_case(5)
    with pytest.raises(ValueError, match="needs dropout_keep"):
        reference.forward(q, k, v, dropout_p=0.1)
    with pytest.raises(ValueError, match=r"dropout_p must lie in \[0, 1\)"):
        reference.forward(q, k, v, dropout_p=1.0, dropout_keep=np.ones((5, 7), bool))
    with pytest.raises(TypeError, match="bool array"):
        reference.backward(dout, q, k, v, dropout_p=0.1, dropout_keep=np.ones((5, 7)))
    with pytest.raises(ValueError, match="does not broadcast"):
        reference.forward(q, k, v, dropout_p=0.1, dropout_keep=np.ones((7, 5), bool))
