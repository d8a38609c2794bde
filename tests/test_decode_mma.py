"""L2 (simulator) / L3 (GPU): the tensor-core decode kernels (kernels/decode/split_kv_mma.py
and its transposed child split_kv_mma_t.py) against the float64 reference, beside the
CUDA-core kernel they replace for 16-bit caches (kernels/decode/split_kv.py), and the
policy that picks between them (numbaflash/policy.py's ``decode_kernel``).

The cases and the check are tests/test_kvcache.py's (TESTING.md's rule per batch, caches
bitwise). The drawn cases there reach split_kv_mma too (float16 at d = 8 and 40, with a
GQA group or Sq > 1); here
the fixed cases go where its own structure has edges:

* more query rows than the 16 of a block (a GQA group of 8 x Sq = 3: two row tiles), and
  ALiBi with GQA (each of a block's rows has its own head and slope);
* lengths around its 64-key tiles and a warp's 16 keys, and splits that start inside a
  tile;
* head dims that are not multiples of the mma's 16 (d = 40, 72: padded columns);
* NaN and inf, which the kernel zeroes in shared memory and adds back (fix-ups): in a
  key or value a row does not see (no effect), in a visible one (propagates), in q;
* bfloat16 caches.

Each case runs with ``policy.DECODE_KERNELS`` set to one kernel, so every kernel meets the
same cases (split_kv_mma_t those with at most its 8 rows per K/V head). Cost on the simulator: about 1.5-3 s a call (128-thread blocks).
"""

import numpy as np
import pytest

import numbaflash
from numbaflash import policy
from numbaflash.kernels.decode import split_kv_mma, split_kv_mma_t
from test_kvcache import (check_against_reference, device_like,  # noqa: F401
                          make_cache_case, no_kvcache_launch, run, run_and_check,
                          updated_caches)

pytestmark = pytest.mark.usefixtures("nan_prefilled_outputs")

KERNELS = ("split_kv_mma_t", "split_kv_mma", "split_kv")


@pytest.fixture(params=KERNELS)
def kernel(request, monkeypatch):
    """Run the test with only this decode kernel in policy.DECODE_KERNELS."""
    monkeypatch.setattr(policy, "DECODE_KERNELS", (request.param,))
    return request.param


def takes(kernel_name, case_args):
    """Whether the kernel takes a case of CASES (split_kv_mma_t holds at most its ROWS
    query rows per K/V head; the others take every case here)."""
    rows = case_args["group"] * case_args["Sq"]
    return kernel_name != "split_kv_mma_t" or rows <= split_kv_mma_t.ROWS


def planned(case, **override):
    """The split kernel's plan for the case."""
    kw = dict(cache_seqlens=np.array(case.lengths, np.int32), k=case.k, v=case.v,
              causal=case.causal, num_splits=case.num_splits, **case.variants())
    kw.update(override)
    return numbaflash.explain_kvcache(case.q, case.k_cache, case.v_cache, **kw)[0]


CASES = {
    # name: make_cache_case arguments
    "gqa8-rows24-causal": dict(B=1, Hk=2, group=8, Sq=3, S_max=70, d=16, dtype="float16",
                               lengths=(67,), S_new=3, causal=True, seed=101),
    "tile-edges-splits": dict(B=3, Hk=1, group=2, Sq=1, S_max=140, d=40, dtype="float16",
                              lengths=(63, 65, 129), S_new=1, num_splits=3, seed=103),
    "d72-window-softcap": dict(B=1, Hk=1, group=4, Sq=2, S_max=90, d=72, dtype="float16",
                               lengths=(88,), S_new=2, causal=True, window=(20, 0),
                               softcap=2.0, seed=107),
    "alibi-gqa-heads": dict(B=2, Hk=2, group=3, Sq=1, S_max=40, d=8, dtype="float16",
                            lengths=(17, 40), alibi="batch", num_splits=2, seed=109),
}


@pytest.mark.parametrize("name,kernel_name", [(name, k) for name in sorted(CASES)
                                               for k in KERNELS if takes(k, CASES[name])])
def test_matches_reference(name, kernel_name, monkeypatch):
    monkeypatch.setattr(policy, "DECODE_KERNELS", (kernel_name,))
    case = make_cache_case(**CASES[name])
    assert planned(case).kernel == kernel_name
    run_and_check(case)


def test_more_rows_than_the_transposed_kernel_holds_go_to_its_parent(no_kvcache_launch):
    """A GQA group of 8 with Sq = 3 (24 rows per K/V head): split_kv_mma_t refuses (8 a
    block) and the default order gives the call to split_kv_mma, saying why."""
    q = device_like((1, 16, 3, 64), "float16")
    kv = device_like((1, 2, 100, 64), "float16")
    plan = numbaflash.explain_kvcache(q, kv, kv, cache_seqlens=97, backend="gpu")[0]
    assert plan.kernel == "split_kv_mma"
    assert "not split_kv_mma_t: 24 query rows per K/V head" in plan.reason


# The NaN pre-fill means nothing for bfloat16's uint16 outputs (NaN casts to 0, with a
# warning); the rule's check still sees every element.
@pytest.mark.filterwarnings("ignore:invalid value encountered in cast:RuntimeWarning")
def test_bfloat16_caches(kernel):
    """bfloat16 caches (P~ rounded to bfloat16 for P~ V in split_kv_mma), with a split
    that sees no key (more splits than the keys of batch 0)."""
    import ml_dtypes
    from tolerance import check_forward
    bf16 = ml_dtypes.bfloat16
    rng = np.random.default_rng(113)
    q = rng.uniform(-4, 4, (2, 4, 2, 24)).astype(bf16)
    k_cache, v_cache = (rng.uniform(-4, 4, (2, 2, 80, 24)).astype(bf16) for _ in range(2))
    lengths = np.array([3, 80], np.int32)
    plan = numbaflash.explain_kvcache(q, k_cache, v_cache, cache_seqlens=lengths,
                                      causal=True)[0]
    assert plan.kernel == kernel
    out, lse = numbaflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths,
                                                 causal=True, num_splits=5, return_lse=True)
    for b, n in enumerate(lengths):
        check_forward(q[b:b + 1], k_cache[b:b + 1, :, :n], v_cache[b:b + 1, :, :n],
                      out[b:b + 1], lse[b:b + 1], causal="bottom_right")


def test_nan_a_row_does_not_see_has_no_effect(kernel):
    """float16, causal, Sq = 3 over 70 keys: keys 68 and 69 are hidden from row 0 (and 69
    from row 1) but lie inside the block's keys, in its last tile. NaN in their values
    and an inf in one key: rows that do not see them are finite (a product with P~ = 0
    would spread the NaN); the last row sees them, so it is NaN, as in the reference.
    Cache rows past the length hold NaN too."""
    case = make_cache_case(B=1, Hk=1, group=2, Sq=3, S_max=80, d=16, dtype="float16",
                           lengths=(70,), causal=True, seed=127)
    case.v_cache[0, 0, 68:70, 5] = np.nan
    case.k_cache[0, 0, 69, 2] = np.inf
    case.k_cache[0, 0, 70:] = np.nan
    case.v_cache[0, 0, 70:] = np.nan
    out, lse = run_and_check(case)
    assert np.isfinite(out[0, :, 0]).all()                  # row 0 of both heads
    assert np.isnan(out[0, :, 2, 5]).all()                  # the last row sees key 68


@pytest.mark.parametrize("where", ["q", "key", "value"])
def test_nonfinite_visible_input_propagates(where, kernel):
    """float16, GQA 2, one split over 40 keys: an inf in q (its row's scores are inf or
    NaN), in a visible key (its score is +-inf or NaN) or a NaN in a visible value (that
    column of every row that sees it): the reference's NaN and inf positions, exactly."""
    case = make_cache_case(B=1, Hk=1, group=2, Sq=1, S_max=40, d=24, dtype="float16",
                           lengths=(40,), seed=131)
    if where == "q":
        case.q[0, 1, 0, 7] = np.inf
    elif where == "key":
        case.k_cache[0, 0, 21, 3] = -np.inf
    else:
        case.v_cache[0, 0, 33, 4] = np.nan
    run_and_check(case)


# --- three stages of shared memory (split_kv_mma.STAGES) -----------------------------------

STAGE_CASES = {
    # name: make_cache_case arguments; tiles of 64 keys per split
    "six-tiles-one-split": dict(B=1, Hk=1, group=2, Sq=1, S_max=340, d=16, dtype="float16",
                                lengths=(339,), S_new=1, num_splits=1, seed=151),
    "splits-inside-tiles": dict(B=2, Hk=1, group=4, Sq=1, S_max=200, d=24, dtype="float16",
                                lengths=(199, 70), S_new=1, num_splits=3, seed=157),
    "one-tile-causal-window": dict(B=1, Hk=1, group=2, Sq=3, S_max=60, d=16,
                                   dtype="float16", lengths=(50,), S_new=3, causal=True,
                                   window=(30, 0), seed=163),
}


def stage_case(name):
    """A case of STAGE_CASES, or "nonfinite-edge-tiles": a window over four tiles whose
    first and last tiles hold a value one row sees and the other does not."""
    if name != "nonfinite-edge-tiles":
        return make_cache_case(**STAGE_CASES[name])
    # rows 0 and 1 see keys 130-330 and 131-331: the split reads keys 130-331
    case = make_cache_case(B=1, Hk=1, group=2, Sq=2, S_max=340, d=16, dtype="float16",
                           lengths=(332,), causal=True, window=(200, 0), num_splits=1,
                           seed=167)
    case.v_cache[0, 0, 130, 2] = np.inf         # tile 0: row 0 sees it, row 1 not
    case.v_cache[0, 0, 331, 1] = np.nan         # tile 3: row 1 sees it, row 0 not
    return case


@pytest.mark.parametrize("kernel_name", ["split_kv_mma", "split_kv_mma_t"])
@pytest.mark.parametrize("name", sorted(STAGE_CASES) + ["nonfinite-edge-tiles"])
def test_three_stages_give_two_stages_bits(name, kernel_name, monkeypatch):
    """STAGES = 3 (two tiles in flight, the stage index j % 3) against the default two:
    the same products in the same order, so the same bits, and the reference's rule.
    The cases: six tiles in one split (every stage reused twice), splits that start
    inside a tile, fewer tiles than stages, and a window over four tiles (the first used
    again as the fourth) whose first and last tiles hold a value one row sees and the
    other does not (each edge tile's copies tested, zeroed and flagged in its own stage):
    the other row stays finite, bit for bit."""
    monkeypatch.setattr(policy, "DECODE_KERNELS", (kernel_name,))
    shared = {"split_kv_mma": split_kv_mma.split_kv_mma_shared,
              "split_kv_mma_t": split_kv_mma_t.split_kv_mma_t_shared}[kernel_name]
    case = stage_case(name)
    got = {}
    for stages in (2, 3):           # split_kv_mma_t stages as its parent does
        monkeypatch.setattr(split_kv_mma, "STAGES", stages)
        plan = planned(case)
        assert plan.kernel == kernel_name
        assert plan.shared_bytes == shared(case.q.shape[-1], stages).dynamic
        got[stages] = run(case)
    for a, b in zip(got[2], got[3]):
        np.testing.assert_array_equal(a, b)
    out, lse, k_cache, v_cache = got[3]
    want_k, want_v = updated_caches(case)
    check_against_reference(case, out, lse, want_k, want_v)
    if name == "nonfinite-edge-tiles":
        row0, row1 = out[0, :, 0].astype(np.float64), out[0, :, 1].astype(np.float64)
        assert not np.isfinite(row0[:, 2]).any() and np.isnan(row1[:, 1]).all()
        assert np.isfinite(np.delete(row0, 2, axis=1)).all()
        assert np.isfinite(np.delete(row1, 1, axis=1)).all()


@pytest.mark.parametrize("switches", [("padded", None), ("swizzled", 256), ("padded", 256)])
@pytest.mark.parametrize("name", ["splits-inside-tiles", "nonfinite-edge-tiles"])
@pytest.mark.parametrize("kernel_name", ["split_kv_mma", "split_kv_mma_t"])
def test_layout_and_prefetch_give_the_defaults_bits(kernel_name, name, switches,
                                                    monkeypatch):
    """Each kernel's LAYOUT (where a stage's rows lie in shared memory) and the parent's
    L2_PREFETCH (read by the transposed kernel) change only where the tiles' values sit
    and how their copies are issued: the same values reach the same products, so the
    same bits as the default (swizzled rows, no prefetch hint), with rows past a split's
    end zeroed (splits that start inside a tile) and non-finite values zeroed and
    flagged in edge tiles."""
    monkeypatch.setattr(policy, "DECODE_KERNELS", (kernel_name,))
    module = {"split_kv_mma": split_kv_mma, "split_kv_mma_t": split_kv_mma_t}[kernel_name]
    shared = {"split_kv_mma": split_kv_mma.split_kv_mma_shared,
              "split_kv_mma_t": split_kv_mma_t.split_kv_mma_t_shared}[kernel_name]
    assert (module.LAYOUT, split_kv_mma.L2_PREFETCH) == ("swizzled", None)
    case = stage_case(name)
    want = run(case)
    monkeypatch.setattr(module, "LAYOUT", switches[0])
    monkeypatch.setattr(split_kv_mma, "L2_PREFETCH", switches[1])
    plan = planned(case)
    assert plan.kernel == kernel_name
    assert plan.shared_bytes == shared(case.q.shape[-1], split_kv_mma.STAGES,
                                       switches[0]).dynamic
    for a, b in zip(want, run(stage_case(name))):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("d", [16, 40, 64, 72, 128])
def test_swizzled_pieces_fill_lines_and_spread_over_banks(d):
    """The swizzled layout's promises, for every head dim class: a row's pieces are a
    permutation of the row's first pieces (nothing overlaps, nothing past the row); the 8
    pieces q = 8c ... 8c + 7 of a row (what 8 threads copy) fill one 128-byte line; the
    same piece of 8 consecutive rows from a multiple of 8 (one ldmatrix matrix) lies in
    8 different groups of 4 banks."""
    ROW, TILE = split_kv_mma.stage_layout(d, "swizzled")
    assert ROW % 64 == 0 and TILE == split_kv_mma.TILE_KEYS * ROW
    pieces = (d + 15) // 16 * 2
    at = split_kv_mma.make_staging(d, "float16", 2, "swizzled").piece_at.py_func
    for r in range(16):
        starts = [at(r, 8 * q) for q in range(pieces)]
        assert len(set(starts)) == pieces
        assert all(r * ROW <= x and x + 8 <= (r + 1) * ROW for x in starts)
        for c in range(0, pieces - 7, 8):
            lines = {at(r, 8 * q) * 2 // 128 for q in range(c, c + 8)}
            assert len(lines) == 1
    for r0 in (0, 8):
        for q in range(pieces):
            banks = {(at(r0 + i, 8 * q) * 2 // 16) % 8 for i in range(8)}
            assert len(banks) == 8


def test_layout_and_prefetch_refuse_unknown_values():
    with pytest.raises(ValueError, match="layout must be one of"):
        split_kv_mma.stage_layout(64, "skewed")
    with pytest.raises(ValueError, match="prefetch must be one of"):
        split_kv_mma.make_staging(64, "float16", 2, "swizzled", 128)


def test_stages_are_two_or_three():
    assert split_kv_mma.STAGES == 2         # the default until a GPU says otherwise
    with pytest.raises(ValueError, match="stages must be one of"):
        split_kv_mma.make_split_kv_mma(64, False, stages=4)
    three, two = (split_kv_mma.split_kv_mma_shared(128, s) for s in (3, 2))
    assert three.dynamic == 3 * two.dynamic // 2 and three.static == two.static
    # Two blocks still fit an SM's 228 KB at d = 128: each reserves 1 KB, and ptxas
    # reports 9744 static bytes, 1028 above the sum here (tests/ptx_check.py's entries)
    assert 2 * (three.dynamic + three.static + 1028 + 1024) <= 228 * 1024


# --- the policy ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,d,k_strides,k_address,why", [
    ("float16", 64, None, 4096, None),
    ("bfloat16", 128, (6400 * 2, 64, 128, 1), 4096, None),     # (batch, s, heads, d) in place
    ("float32", 64, None, 4096, "float32 caches"),
    ("float16", 36, None, 4096, "head dim 36"),
    ("float16", 136, None, 4096, "head dim 136"),
    ("float16", 64, None, 4104, "k_cache does not start at a 16-byte aligned address"),
    ("float16", 64, (6400 * 2, 6404, 64, 1), 4096, "k_cache's strides (0, 6404, 64)"),
])
def test_the_policy_says_which_kernel_and_why(dtype, d, k_strides, k_address, why,
                                              no_kvcache_launch):
    """explain_kvcache on device caches (batch 1, 2 K/V heads, 100 rows, a GQA group of
    two): split_kv_mma_t where it can run, else split_kv with both tensor-core kernels'
    refusals in the reason."""
    import ml_dtypes
    dt = ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype
    q = device_like((1, 4, 1, d), dt)
    k_cache = device_like((1, 2, 100, d), dt, k_strides, k_address)
    v_cache = device_like((1, 2, 100, d), dt, None, 1 << 20)
    plan = numbaflash.explain_kvcache(q, k_cache, v_cache, cache_seqlens=100,
                                      backend="gpu")[0]
    if why is None:
        assert plan.kernel == "split_kv_mma_t" and "tensor-core" in plan.reason
        assert plan.block == (split_kv_mma.THREADS,) and plan.grid[1] == 1
        assert plan.shared_bytes == split_kv_mma_t.split_kv_mma_t_shared(d).dynamic
    else:
        assert plan.kernel == "split_kv"
        assert f"not split_kv_mma_t: {why}" in plan.reason
        assert f"not split_kv_mma: {why}" in plan.reason


def test_one_row_per_kv_head_stays_on_split_kv(no_kvcache_launch):
    """Multi-head attention with one new token (Sq = 1, as many query as K/V heads): the
    measured case where split_kv is faster (split_kv_mma.refusal cites it); with Sq = 2
    the rows share each key and split_kv_mma_t takes the call."""
    q, kv = device_like((2, 4, 1, 64), "float16"), device_like((2, 4, 100, 64), "float16")
    plan = numbaflash.explain_kvcache(q, kv, kv, cache_seqlens=100, backend="gpu")[0]
    assert plan.kernel == "split_kv" and "one query row per K/V head" in plan.reason
    q2 = device_like((2, 4, 2, 64), "float16")
    assert numbaflash.explain_kvcache(q2, kv, kv, cache_seqlens=100,
                                      backend="gpu")[0].kernel == "split_kv_mma_t"


@pytest.mark.parametrize("make", [split_kv_mma.make_split_kv_mma,
                                  split_kv_mma_t.make_split_kv_mma_t])
def test_factory_refuses_what_it_cannot_compile(make):
    with pytest.raises(ValueError, match="multiples of 8 up to 128"):
        make(36, False)
    with pytest.raises(ValueError, match="half must be"):
        make(64, False, half="float32")
