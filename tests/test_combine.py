"""L2 (simulator) / L3 (GPU): the split-KV combine kernels (kernels/decode/combine.py and
its child combine_batched.py) run on their own, on partial results made up to reach
their edges.

combine_batched keeps its parent's arithmetic and order and only issues its loads a
batch of splits at a time, so the two must give the same bits: split counts below, at
and past a batch (BATCH = 16) and past two; splits that saw nothing (L_s = -inf), rows
no split saw, a split whose L_s is NaN, a split whose O_s holds inf; float32 and float64
sums; bfloat16 outputs. The float32 results at every split count are also checked
against reference.combine_splits in float64 by TESTING.md's rule (tests/tolerance.py),
the naive baseline being the same formula in float32.

The whole decoding call, with the combine the policy picks, is checked against the
float64 reference in tests/test_kvcache.py. Cost on the simulator: well under a second a
launch (3 x 2 x 8 threads).
"""

import math

import numpy as np
import pytest
from numba import cuda

from numbaflash import policy, reference
from numbaflash.kernels.decode import combine, combine_batched
from tolerance import assert_bitwise_equal, assert_matches_reference

SPLIT_COUNTS = (1, 2, 15, 16, 17, 33, 40)


def parts(n, acc, seed, special=True):
    """(O_parts (n, 3, 2, 8), L_parts (n, 3, 2)) in ``acc``: O_s normalised-looking
    values, L_s spread over a few units; with ``special``: in row (0, 0) every split saw
    nothing (-inf); in row (1, 1) splits 0 and n - 1 saw nothing; in row (2, 0) the last
    split's L is NaN; in row (2, 1) split n // 2 has O_s = inf in column 3."""
    rng = np.random.default_rng(seed)
    O_parts = rng.uniform(-1, 1, (n, 3, 2, 8)).astype(acc)
    L_parts = rng.uniform(-3, 5, (n, 3, 2)).astype(acc)
    if special:
        L_parts[:, 0, 0] = -np.inf
        L_parts[0, 1, 1] = -np.inf
        L_parts[n - 1, 1, 1] = -np.inf
        L_parts[n - 1, 2, 0] = np.nan
        O_parts[n // 2, 2, 1, 3] = np.inf
    return O_parts, L_parts


def run(make, O_parts, L_parts, acc, half=None):
    """(O, L) of the combine kernel ``make(acc, half)`` launched on the parts."""
    _, BH, Sq, d = O_parts.shape
    out_dtype = np.uint16 if half == "bfloat16" else acc
    O = cuda.to_device(np.full((BH, Sq, d), 7, out_dtype))     # every element written
    L = cuda.to_device(np.full((BH, Sq), 7, acc))
    threads = combine.THREADS
    blocks = math.ceil(BH * Sq * d / threads)
    make(np.dtype(acc).name, half)[blocks, threads](
        cuda.to_device(O_parts), cuda.to_device(L_parts), O, L)
    return O.copy_to_host(), L.copy_to_host()


@pytest.mark.parametrize("n", SPLIT_COUNTS)
@pytest.mark.parametrize("acc", [np.float32, np.float64])
def test_batched_loads_give_the_parents_bits(n, acc):
    O_parts, L_parts = parts(n, acc, seed=n)
    O_plain, L_plain = run(combine.make_combine, O_parts, L_parts, acc)
    O_batch, L_batch = run(combine_batched.make_combine_batched, O_parts, L_parts, acc)
    assert_bitwise_equal("O", O_batch, O_plain)
    assert_bitwise_equal("lse", L_batch, L_plain)


@pytest.mark.parametrize("n", (2, 17, 40))
def test_batched_loads_give_the_parents_bits_in_bfloat16(n):
    O_parts, L_parts = parts(n, np.float32, seed=100 + n)
    plain = run(combine.make_combine, O_parts, L_parts, np.float32, "bfloat16")
    batch = run(combine_batched.make_combine_batched, O_parts, L_parts, np.float32,
                "bfloat16")
    assert_bitwise_equal("O", batch[0], plain[0])
    assert_bitwise_equal("lse", batch[1], plain[1])


@pytest.mark.parametrize("n", SPLIT_COUNTS)
def test_batched_combine_against_the_float64_reference(n):
    """TESTING.md's rule, the naive baseline being the reference's formula in float32;
    the special rows as the reference has them (checked first, by the rule's non-finite
    masks): none seen gives O = 0 and L = -inf, exactly; a NaN L_s gives NaN; an inf in
    O_s gives inf in that column only."""
    O_parts, L_parts = parts(n, np.float32, seed=200 + n)
    O, L = run(combine_batched.make_combine_batched, O_parts, L_parts, np.float32)
    with np.errstate(invalid="ignore"):
        O_ref, L_ref = reference.combine_splits(O_parts, L_parts)
        O_base, L_base = reference.combine_splits(O_parts, L_parts, np.float32)
    none_seen = np.isneginf(L_ref)
    assert none_seen[0, 0] and np.isnan(L_ref[2, 0]) and O_ref[2, 1, 3] == np.inf
    assert_matches_reference("O", O, O_ref, O_base, exact=none_seen[..., None],
                             magnitude=np.abs(O_parts[np.isfinite(O_parts)]).max())
    finite_L = np.isfinite(L_ref)
    assert_matches_reference("lse", L, L_ref, L_base, exact=none_seen,
                             magnitude=np.abs(L_ref[finite_L]).max())


def test_the_policy_plans_the_batched_combine():
    assert policy.COMBINE_KERNEL == "combine_batched"
    assert policy.combine_kernel() is combine_batched
