"""L2 (simulator) / L3 (GPU): ``attention_with_kvcache`` and ``explain_kvcache`` against
the float64 reference (numbaflash/kvcache.py, numbaflash/kernels/decode/).

The contract, per batch b: the new keys and values k[b], v[b] (S_new rows, optional) are
first written into the caches at rows cache_seqlens[b] .. cache_seqlens[b] + S_new - 1;
then batch b's query rows attend to the first n_b = cache_seqlens[b] + S_new keys of its
caches, causal masks and windows aligned bottom-right within n_b. So batch b's (out, lse)
is ``reference.forward(q[b:b+1], k_cache[b:b+1, :, :n_b], v_cache[b:b+1, :, :n_b], ...)``
with ALiBi slopes of batch b; every check below is that, per batch, with TESTING.md's rule
(tolerance.check_forward: float64 reference on the already-rounded inputs, the naive
same-dtype baseline, exact zeros and -inf for rows that see no key, NaN positions exact).
Outputs (and the split kernel's partial outputs) are pre-filled with NaN
(conftest.nan_prefilled_outputs), so an element a kernel never writes shows.

Cost on the simulator: the split-KV kernel launches 128-thread blocks, one per (split,
row tile, batch x K/V head); a call at B=2, Hk=2, d=8, S_max=40 takes about 2 s. The
drawn problems stay within B, Hk <= 2, Sq <= 3, S_max <= 48; the Hypothesis tests use a
fraction of the profile's examples (strategies.examples).

Lengths are biased toward 0 and the kernel's step boundaries: each warp loads KEYS = 8
keys a step (split_kv.keys_per_step for d <= 128) and the 4 warps of a block together 32,
so n_b in {0, 1, 7, 8, 9, 31, 32, 33, room} crosses them. Head dims 8, 3, 20 and 40: not
multiples of the columns a warp reads per load (lanes past d hold zeros). float16 and
float32 read 8 bytes a load (split_kv.load_width) but at d = 3; float64 one element, so
that d = 40 gives two columns per lane.

Two cases that once went wrong have their own tests: a window's right side without
causal=True (``test_window_right_side_without_causal``), and a NaN score that is the
only visible score of a warp's share of the keys or of a split
(``test_nan_score_propagates``: the warp or split kept m = -inf and was skipped).
"""

import types
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from numba import cuda

import numbaflash
import numbaflash.kvcache
import numbaflash.launcher
import numbaflash.policy
from numbaflash.kernels.decode import split_kv
from strategies import examples, on_gpu, random_values
from tolerance import (assert_bitwise_equal, assert_close_f64, check_forward,
                       forward_magnitudes, to_host)

pytestmark = pytest.mark.usefixtures("nan_prefilled_outputs")

DTYPES = ("float32", "float16", "float64")
HEAD_DIMS = (8, 3, 20, 40)          # the first is where Hypothesis shrinks to
MAX_CACHE = 48                      # S_max
SPLITS = (None, 1, 2, 3, 4, 5)
WINDOW_SIDES = (-1, 0, 1, 2, 5)
SOFTCAPS = (0.5, 2.0, 30.0)
STEP = split_kv.WARPS * split_kv.keys_per_step(8)       # keys one block step covers (32)
LENGTH_BOUNDARIES = (0, 1, 7, 8, 9, STEP - 1, STEP, STEP + 1)


# --- cases --------------------------------------------------------------------------------

@dataclass(frozen=True, repr=False)
class CacheCase:
    """A drawn ``attention_with_kvcache`` problem (arrays from ``seed``, NumPy)."""
    B: int
    Hk: int
    group: int
    Sq: int
    S_max: int
    d: int
    dtype: str
    lengths: tuple              # cache_seqlens, one per batch
    S_new: int                  # new keys and values (0: k = v = None)
    causal: bool
    scale: float | None
    num_splits: int | None
    window: tuple | None
    softcap: float | None
    alibi: str | None           # None, "heads" ((Hq,) slopes) or "batch" ((B, Hq) slopes)
    seed: int
    q: np.ndarray = field(compare=False)
    k_cache: np.ndarray = field(compare=False)
    v_cache: np.ndarray = field(compare=False)
    k: np.ndarray | None = field(compare=False)
    v: np.ndarray | None = field(compare=False)
    alibi_slopes: np.ndarray | None = field(compare=False)

    @property
    def Hq(self):
        return self.Hk * self.group

    def variants(self):
        """The variant keyword arguments, as attention_with_kvcache takes them."""
        kw = {}
        if self.window is not None:
            kw["window_size"] = self.window
        if self.softcap is not None:
            kw["softcap"] = self.softcap
        if self.alibi is not None:
            kw["alibi_slopes"] = self.alibi_slopes
        return kw

    def __repr__(self):
        return (f"make_cache_case(B={self.B}, Hk={self.Hk}, group={self.group}, Sq={self.Sq}, "
                f"S_max={self.S_max}, d={self.d}, dtype={self.dtype!r}, "
                f"lengths={self.lengths!r}, S_new={self.S_new}, causal={self.causal}, "
                f"scale={self.scale!r}, num_splits={self.num_splits!r}, "
                f"window={self.window!r}, softcap={self.softcap!r}, alibi={self.alibi!r}, "
                f"seed={self.seed})")

    def _repr_pretty_(self, p, cycle):
        p.text(repr(self))


def make_cache_case(B, Hk, group, Sq, S_max, d, dtype="float32", lengths=None, S_new=0,
                    causal=False, scale=None, num_splits=None, window=None, softcap=None,
                    alibi=None, seed=0):
    """Build a CacheCase deterministically (what the strategy draws; for @example)."""
    lengths = tuple(int(n) for n in (lengths if lengths is not None else [S_max - S_new] * B))
    rng = np.random.default_rng(seed)
    Hq = Hk * group
    q = random_values(rng, (B, Hq, Sq, d), dtype)
    k_cache = random_values(rng, (B, Hk, S_max, d), dtype)
    v_cache = random_values(rng, (B, Hk, S_max, d), dtype)
    k = random_values(rng, (B, Hk, S_new, d), dtype) if S_new else None
    v = random_values(rng, (B, Hk, S_new, d), dtype) if S_new else None
    slopes = None
    if alibi is not None:
        shape = {"heads": (Hq,), "batch": (B, Hq)}[alibi]
        slopes = rng.uniform(0.05, 1.0, shape).astype(np.float32)
    return CacheCase(B, Hk, group, Sq, S_max, d, np.dtype(dtype).name, lengths, S_new, causal,
                     scale, num_splits, None if window is None else tuple(window), softcap,
                     alibi, seed, q, k_cache, v_cache, k, v, slopes)


@st.composite
def cache_cases(draw, *, dtypes=DTYPES, head_dims=HEAD_DIMS, variants=False, max_new=2,
                splits=SPLITS):
    """Draw a CacheCase: B, Hk in 1..2, groups of 1..3, Sq in 1..3, S_max <= MAX_CACHE,
    per-batch lengths biased toward LENGTH_BOUNDARIES (0 included), S_new new keys in
    0..max_new, causal or not, num_splits from ``splits``; with ``variants`` also a
    window, softcap and ALiBi slopes ((Hq,) or (B, Hq)), each half the time."""
    dtype = draw(st.sampled_from(dtypes))
    d = draw(st.sampled_from(head_dims))
    B = draw(st.integers(1, 2))
    Hk = draw(st.integers(1, 2))
    group = draw(st.integers(1, 3))
    Sq = draw(st.integers(1, 3))
    S_new = draw(st.integers(0, max_new))
    S_max = draw(st.integers(max(1, S_new), MAX_CACHE))
    room = S_max - S_new
    near = sorted({n for n in LENGTH_BOUNDARIES + (room,) if n <= room})
    lengths = tuple(draw(st.one_of(st.sampled_from(near), st.integers(0, room)))
                    for _ in range(B))
    causal = draw(st.booleans())
    scale = draw(st.sampled_from((None, 0.5)))
    num_splits = draw(st.sampled_from(splits))
    window = softcap = alibi = None
    if variants:
        if draw(st.booleans()):
            right = draw(st.sampled_from(WINDOW_SIDES))
            window = (draw(st.sampled_from(WINDOW_SIDES)), right)
        if draw(st.booleans()):
            softcap = draw(st.sampled_from(SOFTCAPS))
        if draw(st.booleans()):
            alibi = draw(st.sampled_from(("heads", "batch")))
    seed = draw(st.integers(0, 2 ** 32 - 1))
    return make_cache_case(B, Hk, group, Sq, S_max, d, dtype, lengths, S_new, causal, scale,
                           num_splits, window, softcap, alibi, seed)


# --- running and checking -------------------------------------------------------------------

def updated_caches(case):
    """The caches as the call must leave them: the new rows written at each length."""
    k_cache, v_cache = case.k_cache.copy(), case.v_cache.copy()
    for b, at in enumerate(case.lengths):
        if case.S_new:
            k_cache[b, :, at:at + case.S_new] = case.k[b]
            v_cache[b, :, at:at + case.S_new] = case.v[b]
    return k_cache, v_cache


def run(case, device=False, **override):
    """Call attention_with_kvcache on copies of the case's caches (host or device);
    return (out, lse, k_cache, v_cache) on the host, the caches as the call left them."""
    k_cache, v_cache = case.k_cache.copy(), case.v_cache.copy()
    args = [case.q, k_cache, v_cache]
    k, v = case.k, case.v
    lengths = np.array(case.lengths, np.int32)
    if device:
        args = [cuda.to_device(a) for a in args]
        k, v = (None, None) if k is None else (cuda.to_device(k), cuda.to_device(v))
    kw = dict(cache_seqlens=lengths, k=k, v=v, causal=case.causal, scale=case.scale,
              num_splits=case.num_splits, return_lse=True, **case.variants())
    kw.update(override)
    out, lse = numbaflash.attention_with_kvcache(*args, **kw)
    return to_host(out), to_host(lse), to_host(args[1]), to_host(args[2])


def check_against_reference(case, out, lse, k_cache, v_cache, lengths=None):
    """Each batch's (out, lse) against reference.forward over its first n_b keys of the
    given caches (TESTING.md's rule, tolerance.check_forward)."""
    lengths = case.lengths if lengths is None else lengths
    assert out.shape == case.q.shape and lse.shape == case.q.shape[:3]
    for b, cached in enumerate(lengths):
        n = min(cached + case.S_new, case.S_max)
        kw = case.variants()
        if case.alibi == "batch":
            kw["alibi_slopes"] = case.alibi_slopes[b:b + 1]
        try:
            check_forward(case.q[b:b + 1], k_cache[b:b + 1, :, :n], v_cache[b:b + 1, :, :n],
                          out[b:b + 1], lse[b:b + 1],
                          causal="bottom_right" if case.causal else None, scale=case.scale,
                          **kw)
        except AssertionError as err:
            raise AssertionError(f"batch {b} (n_b = {n} keys): {err}") from None


def run_and_check(case, device=False, **override):
    """Run the case, check the caches (bitwise) and the result; return (out, lse)."""
    out, lse, k_cache, v_cache = run(case, device, **override)
    want_k, want_v = updated_caches(case)
    assert_bitwise_equal("k_cache", k_cache, want_k)
    assert_bitwise_equal("v_cache", v_cache, want_v)
    check_against_reference(case, out, lse, want_k, want_v)
    return out, lse


# --- 1. the reference, drawn shapes ---------------------------------------------------------

@settings(max_examples=examples())
@given(case=cache_cases())
@example(case=make_cache_case(B=2, Hk=2, group=2, Sq=3, S_max=41, d=40, dtype="float16",
                              lengths=(0, 33), S_new=0, causal=True, num_splits=3, seed=1))
@example(case=make_cache_case(B=2, Hk=1, group=3, Sq=2, S_max=40, d=20, dtype="float32",
                              lengths=(9, 31), S_new=2, causal=False, scale=0.5, seed=2))
def test_matches_reference(case):
    run_and_check(case)


# --- 2. variants: window, softcap, ALiBi, GQA -----------------------------------------------

@settings(max_examples=examples(0.75))
@given(case=cache_cases(variants=True))
def test_variants_match_reference(case):
    run_and_check(case)


FIXED_VARIANTS = {
    "window_causal": dict(causal=True, window=(5, 0)),
    "window_causal_right": dict(causal=True, window=(2, 3)),
    "window_left_only": dict(causal=False, window=(3, -1)),
    "window_hides_rows": dict(causal=True, window=(0, 0)),
    "softcap": dict(softcap=2.0, scale=0.5),
    "alibi_heads": dict(alibi="heads"),
    "alibi_batch_causal": dict(alibi="batch", causal=True),
    "all_together": dict(causal=True, window=(7, 0), softcap=30.0, alibi="batch"),
}


@pytest.mark.parametrize("name", sorted(FIXED_VARIANTS))
def test_variant(name):
    """Each variant once at a fixed GQA shape: 2 batches with different lengths, 2 K/V
    heads of 2 query heads each (a wrong head or batch mapping gives wrong values)."""
    case = make_cache_case(B=2, Hk=2, group=2, Sq=2, S_max=24, d=8, dtype="float32",
                           lengths=(6, 20), S_new=1, num_splits=2, seed=7,
                           **FIXED_VARIANTS[name])
    run_and_check(case)


@pytest.mark.parametrize("window", [(-1, 0), (2, 0)])
def test_window_right_side_without_causal(window):
    case = make_cache_case(B=1, Hk=1, group=1, Sq=2, S_max=12, d=4, dtype="float64",
                           lengths=(10,), window=window, seed=3)
    run_and_check(case)


def test_gqa_heads_map_to_their_kv_head():
    """K/V heads far apart in value: query head h must read K/V head h // group of its
    own batch; any other mapping shows in O's values."""
    case = make_cache_case(B=2, Hk=2, group=2, Sq=1, S_max=20, d=8, dtype="float64",
                           lengths=(12, 19), seed=11)
    for b in range(2):
        for h in range(2):
            case.v_cache[b, h] += 10 * (2 * b + h)
    run_and_check(case)


# --- 3. split counts -----------------------------------------------------------------------

@pytest.mark.parametrize("dtype,splits", [("float64", (1, 2, 3, 7, 12)),
                                          ("float32", (1, 3, 12))])
def test_split_counts_agree(dtype, splits):
    """The same call with 1, 2, 3, 7 and more splits than keys (12 > 10): each matches
    the reference; in float64 they agree with each other to 1e-12 (TESTING.md's
    split-merge property). Batch 0 sees no key (every split empty), the causal window
    leaves some splits without a visible key for some rows (-inf partials)."""
    case = make_cache_case(B=2, Hk=1, group=2, Sq=3, S_max=12, d=8, dtype=dtype,
                           lengths=(0, 10), causal=True, window=(5, 0), seed=5)
    results = {n: run_and_check(case, num_splits=n) for n in splits}
    if dtype == "float64":
        mag_O, mag_L = forward_magnitudes(case.q[1:], case.k_cache[1:, :, :10],
                                          case.v_cache[1:, :, :10], causal="bottom_right",
                                          window_size=case.window)
        out1, lse1 = results[1]
        for n in splits[1:]:
            out, lse = results[n]
            assert_close_f64(f"O ({n} splits vs 1)", out, out1, magnitude=mag_O)
            assert_close_f64(f"lse ({n} splits vs 1)", lse, lse1, magnitude=mag_L)


# --- 4. appending in place -----------------------------------------------------------------

def test_append_host_caches():
    """Host caches: rows [n_b, n_b + S_new) hold k[b], v[b] exactly, every other row is
    unchanged (bitwise), and the result is the reference over the updated caches; one
    batch appends at 0, the other fills the cache to its last row."""
    case = make_cache_case(B=2, Hk=2, group=1, Sq=3, S_max=20, d=8, dtype="float16",
                           lengths=(0, 17), S_new=3, causal=True, seed=13)
    run_and_check(case)


@pytest.mark.parametrize("lengths_on", ["host", "device"])
def test_append_device_caches(lengths_on):
    """Device caches (and q, k, v): the append kernel writes the new rows in place; the
    caches copied back are checked bitwise, the result against the reference. The
    lengths as a NumPy array or an int32 device array."""
    case = make_cache_case(B=2, Hk=2, group=2, Sq=2, S_max=24, d=20, dtype="float32",
                           lengths=(5, 22), S_new=2, causal=True, num_splits=2, seed=17)
    lengths = np.array(case.lengths, np.int32)
    if lengths_on == "device":
        lengths = cuda.to_device(lengths)
    run_and_check(case, device=True, cache_seqlens=lengths)


def test_device_lengths_past_the_cache_are_clamped():
    """A device array of lengths is not checked (it would wait for the GPU): new rows
    that would land at or past S_max are not written, and n_b is clamped to S_max
    (the docstring's contract)."""
    case = make_cache_case(B=1, Hk=1, group=1, Sq=1, S_max=10, d=8, dtype="float64",
                           lengths=(9,), S_new=2, seed=19)
    out, lse, k_cache, v_cache = run(case, device=True,
                                     cache_seqlens=cuda.to_device(np.array([9], np.int32)))
    want_k, want_v = case.k_cache.copy(), case.v_cache.copy()
    want_k[0, :, 9], want_v[0, :, 9] = case.k[0, :, 0], case.v[0, :, 0]
    assert_bitwise_equal("k_cache", k_cache, want_k)
    assert_bitwise_equal("v_cache", v_cache, want_v)
    check_against_reference(case, out, lse, want_k, want_v, lengths=(8,))   # n_b = 10


def test_decoding_steps_queued_without_waiting():
    """Host lengths go to the GPU on the call's stream without waiting for it (a memset
    for an int, an asynchronous copy for an array, into one reused buffer), so steps are
    queued back to back and only read at the end: each step's result must still be its
    own lengths' (a step reading a later step's lengths would be off)."""
    case = make_cache_case(B=2, Hk=1, group=2, Sq=1, S_max=40, d=8, dtype="float32",
                           seed=23)
    q, k_cache, v_cache = (cuda.to_device(a) for a in (case.q, case.k_cache, case.v_cache))
    steps = [5, (3, 30), 17, (40, 1), 33, (0, 9), 40]
    results = [numbaflash.attention_with_kvcache(
                   q, k_cache, v_cache, return_lse=True,
                   cache_seqlens=n if isinstance(n, int) else np.array(n, np.int32))
               for n in steps]
    for n, (out, lse) in zip(steps, results):
        lengths = (n, n) if isinstance(n, int) else n
        check_against_reference(case, to_host(out), to_host(lse), case.k_cache,
                                case.v_cache, lengths=lengths)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("lengths_on", ["int", "device"])
@pytest.mark.parametrize("S_new", [0, 1], ids=["no_new", "new_rows"])
def test_repeated_calls_launch_directly_with_the_same_bits(monkeypatch, dtype, lengths_on,
                                                           S_new):
    """On a GPU the second call of a kind (numbaflash/decode_direct.py) skips the checks,
    the plan and the views, and gives the whole call's bits for other arrays of that kind:
    out, lse and the caches with the new rows. On the simulator nothing is remembered."""
    from numbaflash import decode_direct
    if not on_gpu() and (dtype, lengths_on, S_new) != ("float32", "int", 0):
        pytest.skip("on the simulator every call takes the whole path: one case shows it")

    def arrays_of(seed):
        case = make_cache_case(B=2, Hk=2, group=4, Sq=1, S_max=48, d=16, dtype=dtype,
                               lengths=(5, 40), S_new=S_new, seed=seed)
        xs = [case.q, case.k_cache, case.v_cache, case.k, case.v]
        return [None if x is None else cuda.to_device(x) for x in xs]

    def call(q, k_cache, v_cache, k, v):
        lengths = (20 if lengths_on == "int" else
                   cuda.to_device(np.array([5, 40], np.int32)))
        return numbaflash.attention_with_kvcache(q, k_cache, v_cache, k=k, v=v,
                                                 cache_seqlens=lengths, causal=True,
                                                 return_lse=True)

    decode_direct.forget()
    want = call(*arrays_of(1))                          # the whole call
    decode_direct.forget()
    call(*arrays_of(0))                                 # the whole call, remembered
    if not on_gpu():
        assert decode_direct._REMEMBERED == {}
        return
    assert len(decode_direct._REMEMBERED) == 1

    def refuse(*args, **kwargs):
        raise AssertionError("the repeated call took the whole path")

    monkeypatch.setattr(numbaflash.kvcache, "_whole_call", refuse)
    second = arrays_of(1)
    got = call(*second)
    (fast,) = decode_direct._REMEMBERED.values()        # launched through PreparedLaunch
    assert all(prepared is not None for prepared in fast.prepared)
    for name, a, b in (("out", got[0], want[0]), ("lse", got[1], want[1])):
        assert_bitwise_equal(name, to_host(a), to_host(b))
    if S_new:
        want_k, want_v = (to_host(x) for x in arrays_of(1)[1:3])
        for b, n in enumerate((20, 20) if lengths_on == "int" else (5, 40)):
            want_k[b, :, n], want_v[b, :, n] = to_host(second[3])[b, :, 0], \
                to_host(second[4])[b, :, 0]
        assert_bitwise_equal("k_cache", to_host(second[1]), want_k)
        assert_bitwise_equal("v_cache", to_host(second[2]), want_v)


def test_torch_tensors_are_read_as_their_interface_says():
    """On a GPU a repeated call reads float16, float32 and int32 CUDA tensors without
    building their __cuda_array_interface__ (kvcache._device_memory): the same shape,
    strides (None when contiguous), typestr and pointer as the interface gives, and
    PyTorch's current stream as the producer; a tensor that requires grad still goes
    through the interface, whose error says so (as before the direct read)."""
    from numbaflash import kvcache, streams
    torch = pytest.importorskip("torch")
    if not on_gpu() or not torch.cuda.is_available():
        pytest.skip("on the simulator there is nothing to read: every call is whole")
    xs = [torch.zeros(2, 3, 4, device="cuda", dtype=torch.float16),
          torch.zeros(4, 3, 2, device="cuda").transpose(0, 2),
          torch.zeros(3, device="cuda", dtype=torch.int32), torch.zeros(0, device="cuda")]
    for x, got in zip(xs, kvcache._device_memory(xs)):
        cai = x.__cuda_array_interface__
        assert got == (tuple(cai["shape"]), cai.get("strides"), cai["typestr"],
                       cai["data"][0] or 0, streams.torch_stream(x))
    graded = torch.zeros(2, device="cuda", requires_grad=True)
    with pytest.raises(RuntimeError, match="requires grad"):
        kvcache._device_memory([xs[0], graded])


def test_repeated_calls_share_their_streams_scratch(monkeypatch):
    """On a GPU repeated calls take their scratch (lengths, the splits' partial results)
    from one buffer per stream (arrays.workspace), which a call that needs more grows.
    Two kinds of call (4 and 8 splits) alternated, on the default stream and on a stream
    of their own, every output kept: each the bits of the same call made alone, through
    the whole path."""
    from numbaflash import arrays, decode_direct
    if not on_gpu():
        pytest.skip("the workspace is the GPU's: the simulator takes the whole path")
    case = make_cache_case(B=2, Hk=2, group=2, Sq=1, S_max=64, d=16, dtype="float32",
                           seed=31)

    def device_inputs(seed):
        rng = np.random.default_rng(seed)
        return [cuda.to_device(random_values(rng, x.shape, x.dtype))
                for x in (case.q, case.k_cache, case.v_cache)]
    kinds = (4, 8)
    inputs = [device_inputs(seed) for seed in range(6)]

    def call(xs, splits, stream=None):
        return numbaflash.attention_with_kvcache(*xs, cache_seqlens=50, num_splits=splits,
                                                 return_lse=True, stream=stream)
    decode_direct.forget()
    want = []
    for i, xs in enumerate(inputs):            # each alone, through the whole path
        decode_direct.forget()
        want.append([to_host(a) for a in call(xs, kinds[i % 2])])
    arrays._workspaces.clear()
    for stream in (None, cuda.stream()):
        decode_direct.forget()
        for splits in kinds:                    # the whole path once per kind: remembered
            call(inputs[0], splits, stream)
        assert len(decode_direct._REMEMBERED) == 2

        def refuse(*args, **kwargs):
            raise AssertionError("a repeated call took the whole path")
        with monkeypatch.context() as m:
            m.setattr(numbaflash.kvcache, "_whole_call", refuse)
            got = [call(xs, kinds[i % 2], stream) for i, xs in enumerate(inputs)]
        cuda.synchronize()
        for i, (out, lse) in enumerate(got):
            assert_bitwise_equal(f"out {i}", to_host(out), want[i][0])
            assert_bitwise_equal(f"lse {i}", to_host(lse), want[i][1])
    handles = {key[1] for key in arrays._workspaces}
    assert len(handles) == 2                    # one buffer per stream


# --- 5. rows that see no key --------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_empty_caches_give_zeros_and_minus_inf(dtype):
    """Every length 0 and no new keys: out exactly 0, lse -inf (no launch needed)."""
    case = make_cache_case(B=2, Hk=1, group=2, Sq=2, S_max=8, d=8, dtype=dtype,
                           lengths=(0, 0))
    out, lse, k_cache, v_cache = run(case)
    assert out.dtype == np.dtype(dtype) and lse.dtype == np.float32
    assert np.array_equal(out, np.zeros_like(out))
    assert np.array_equal(lse, np.full_like(lse, -np.inf))
    assert_bitwise_equal("k_cache", k_cache, case.k_cache)


def test_rows_that_see_no_key():
    """One batch empty, the other with more query rows than keys under causal and a
    window (0, 0): the rows that see nothing give exactly 0 and -inf (check_forward's
    exact rows), the others match the reference."""
    case = make_cache_case(B=2, Hk=1, group=2, Sq=3, S_max=8, d=8, dtype="float32",
                           lengths=(0, 2), causal=True, window=(0, 0), num_splits=2, seed=23)
    out, lse = run_and_check(case)
    assert np.array_equal(out[0], np.zeros_like(out[0])) and np.isneginf(lse[0]).all()
    assert np.isneginf(lse[1, :, 0]).all() and np.isfinite(lse[1, :, 1:]).all()


# --- 6. NaN -----------------------------------------------------------------------------

@pytest.mark.parametrize("device", [False, True], ids=["host", "device"])
def test_nan_beyond_the_length_or_masked_has_no_effect(device):
    """NaN in cache rows at or past n_b (read by no one; on the host still inside the
    rows copied for the longer batch) and in a key that causal hides from row 0: no
    effect on rows that do not see it; the NaN key propagates to the row that sees it
    (the last one) only."""
    case = make_cache_case(B=2, Hk=2, group=1, Sq=2, S_max=24, d=8, dtype="float32",
                           lengths=(6, 20), causal=True, seed=29)
    case.k_cache[0, :, 6:] = np.nan
    case.v_cache[0, :, 6:] = np.nan
    case.k_cache[1, :, 20:] = np.nan
    case.v_cache[1, :, 20:] = np.nan
    case.v_cache[1, 1, 19, :] = np.nan          # key 19: only row 1 sees it (via V)
    out, lse = run_and_check(case, device=device)
    assert np.isfinite(out[0]).all() and np.isfinite(lse).all()
    assert np.isfinite(out[1, 0]).all() and np.isfinite(out[1, 1, 0]).all()
    assert np.isnan(out[1, 1, 1]).all()


def test_nan_in_a_visible_value_reaches_its_batch_only():
    """NaN in one visible value element of batch 1, K/V head 1: O is NaN in that column
    for the query heads of that K/V head, in every row that sees the key; batch 0 and
    the other head are unaffected (the same positions as the reference)."""
    case = make_cache_case(B=2, Hk=2, group=2, Sq=2, S_max=16, d=8, dtype="float32",
                           lengths=(14, 9), num_splits=3, seed=31)
    case.v_cache[1, 1, 4, 2] = np.nan
    out, lse = run_and_check(case)
    nan = np.isnan(out)
    assert nan[1, 2:, :, 2].all() and nan.sum() == 2 * 2
    assert np.isfinite(lse).all()


@pytest.mark.parametrize("where", ["q", "only_key", "warp_only_key", "split_only_seen"])
def test_nan_score_propagates(where):
    """A NaN score must reach the row (TESTING.md: NaN in a visible input propagates,
    no silent repair), as numbaflash.attention does. ``split_only_seen``: row 0 sees
    keys 0 and 1, both in split 0 of 2 (causal, n = 4, Sq = 3); key 1 is NaN, so split
    0's L is NaN and split 1's -inf for that row: the combine, whose max skips NaN, must
    still not take the row for one that saw nothing."""
    lengths, Sq, splits = {"q": (5, 1, None), "only_key": (1, 1, None),
                           "warp_only_key": (9, 1, None), "split_only_seen": (4, 3, 2)}[where]
    case = make_cache_case(B=1, Hk=1, group=1, Sq=Sq, S_max=12, d=8, dtype="float32",
                           lengths=(lengths,), causal=Sq > 1, num_splits=splits, seed=37)
    if where == "q":
        case.q[0, 0, 0, 3] = np.nan                 # every score NaN
    elif where == "only_key":
        case.k_cache[0, 0, 0, 0] = np.nan           # the row's only key
    elif where == "warp_only_key":
        case.k_cache[0, 0, 8, 0] = np.nan           # warp 1's only key (keys 8..15)
    else:
        case.k_cache[0, 0, 1, 0] = np.nan           # seen by every row
    out, lse = run_and_check(case)
    assert np.isnan(out).all() and np.isnan(lse).all()


# --- 7. errors, before anything is written --------------------------------------------------

@pytest.fixture
def no_kvcache_launch(monkeypatch):
    """Fail the test if anything is launched (kvcache imports ``launch`` by name)."""
    def launched(*args, **kwargs):
        raise AssertionError("a kernel was launched; validation should have raised first")
    monkeypatch.setattr(numbaflash.kvcache, "launch", launched)
    monkeypatch.setattr(numbaflash.launcher, "launch", launched)


def error_inputs(dtype=np.float32):
    """q (2, 4, 1, 8), caches (2, 2, 8, 8) with lengths (2, 5), new k, v of 2 rows."""
    rng = np.random.default_rng(0)
    q = random_values(rng, (2, 4, 1, 8), dtype)
    k_cache = random_values(rng, (2, 2, 8, 8), dtype)
    v_cache = random_values(rng, (2, 2, 8, 8), dtype)
    k = random_values(rng, (2, 2, 2, 8), dtype)
    v = random_values(rng, (2, 2, 2, 8), dtype)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=np.array([2, 5]),
                k=k, v=v)


def f16(x):
    return x.astype(np.float16)


ERRORS = {
    "q_rank_3": (ValueError, r"q must have rank 4", lambda a: dict(q=a["q"][0])),
    "cache_rank_5": (ValueError, r"k_cache must have rank 4",
                     lambda a: dict(k_cache=a["k_cache"][None])),
    "caches_differ": (ValueError, r"k_cache and v_cache must have the same shape",
                      lambda a: dict(v_cache=a["v_cache"][:, :, :7])),
    "cache_batch": (ValueError, r"q's batch 2", lambda a: dict(
        k_cache=a["k_cache"][:1], v_cache=a["v_cache"][:1])),
    "cache_head_dim": (ValueError, r"head dim 8", lambda a: dict(
        k_cache=a["k_cache"][..., :4], v_cache=a["v_cache"][..., :4])),
    "heads_not_multiple": (ValueError, r"multiple of the caches'",
                           lambda a: dict(q=a["q"][:, :3])),
    "new_k_heads": (ValueError, r"k and v \(the new keys and values\) must both have shape",
                    lambda a: dict(k=a["k"][:, :1], v=a["v"][:, :1])),
    "new_k_v_differ": (ValueError, r"must both have shape", lambda a: dict(v=a["v"][:, :, :1])),
    "length_past_cache": (ValueError, r"cache_seqlens\[b\] \+ 2 <= 8\)",
                          lambda a: dict(cache_seqlens=np.array([2, 7]))),
    "int_length_past_cache": (ValueError, r"\+ 2 <= 8", lambda a: dict(cache_seqlens=7)),
    "negative_length": (ValueError, r"must be >= 0",
                        lambda a: dict(cache_seqlens=np.array([-1, 2]))),
    "lengths_shape": (ValueError, r"\(batch,\) = \(2,\)",
                      lambda a: dict(cache_seqlens=np.array([1, 2, 3]))),
    "lengths_float": (ValueError, r"integer array",
                      lambda a: dict(cache_seqlens=np.array([1.0, 2.0]))),
    "k_without_v": (ValueError, r"both k and v", lambda a: dict(v=None)),
    "v_without_k": (ValueError, r"both k and v", lambda a: dict(k=None)),
    "num_splits_0": (ValueError, r"num_splits .* 1\.\.256", lambda a: dict(num_splits=0)),
    "num_splits_300": (ValueError, r"num_splits .* 1\.\.256", lambda a: dict(num_splits=300)),
    "num_splits_bool": (ValueError, r"num_splits", lambda a: dict(num_splits=True)),
    "top_left": (ValueError, r"top_left", lambda a: dict(causal="top_left")),
    "causal_unknown": (ValueError, r"causal must be", lambda a: dict(causal="sideways")),
    "alibi_shape": (ValueError, r"alibi_slopes must have shape",
                    lambda a: dict(alibi_slopes=np.ones(3, np.float32))),
    "dtype_q": (TypeError, r"same dtype", lambda a: dict(q=f16(a["q"]))),
    "dtype_cache": (TypeError, r"same dtype", lambda a: dict(v_cache=f16(a["v_cache"]))),
    "dtype_new": (TypeError, r"same dtype", lambda a: dict(k=f16(a["k"]), v=f16(a["v"]))),
    "mixed_host_device": (TypeError, r"mix host", lambda a: dict(q=cuda.to_device(a["q"]))),
    "device_lengths_host_caches": (TypeError, r"device array but the caches are on the host",
                                   lambda a: dict(cache_seqlens=cuda.to_device(
                                       np.array([2, 5], np.int32)))),
}


@pytest.mark.parametrize("name", sorted(ERRORS))
def test_errors_before_anything_is_written(name, no_kvcache_launch):
    exc, match, change = ERRORS[name]
    """Each bad input raises its ValueError/TypeError, from attention_with_kvcache and
    explain_kvcache alike, with nothing launched and the caches (the originals, which
    the replaced arguments are views or copies of) unchanged bitwise."""
    exc, match, change = ERRORS[name]
    args = error_inputs()
    k_cache, v_cache = args["k_cache"], args["v_cache"]
    before_k, before_v = k_cache.copy(), v_cache.copy()
    args.update(change(args))
    with pytest.raises(exc, match=match):
        numbaflash.attention_with_kvcache(**args)
    with pytest.raises(exc, match=match):       # explain validates the same way
        numbaflash.explain_kvcache(**args)
    assert_bitwise_equal("k_cache", k_cache, before_k)
    assert_bitwise_equal("v_cache", v_cache, before_v)


def test_error_on_device_caches_writes_nothing(no_kvcache_launch):
    """A length past the cache with device caches: ValueError before the append kernel."""
    args = error_inputs()
    before_k, before_v = args["k_cache"].copy(), args["v_cache"].copy()
    dev = {name: cuda.to_device(args[name]) for name in ("q", "k_cache", "v_cache", "k", "v")}
    with pytest.raises(ValueError, match=r"\+ 2 <= 8"):
        numbaflash.attention_with_kvcache(**dev, cache_seqlens=np.array([7, 0]))
    assert_bitwise_equal("k_cache", dev["k_cache"], before_k)
    assert_bitwise_equal("v_cache", dev["v_cache"], before_v)


# --- 8. explain_kvcache ------------------------------------------------------------------

@pytest.fixture
def cuda_core_decode(monkeypatch):
    """Plan split_kv for every cache (policy.DECODE_KERNELS), as for float32: the tests of
    its loads and reductions use float16 caches, which split_kv_mma_t or split_kv_mma take
    otherwise (tests/test_decode_mma.py)."""
    monkeypatch.setattr(numbaflash.policy, "DECODE_KERNELS", ("split_kv",))


def shaped(shape, dtype="float16"):
    return types.SimpleNamespace(shape=shape, dtype=np.dtype(dtype))


DECODE = dict(q=shaped((8, 32, 1, 128)), k_cache=shaped((8, 32, 32768, 128)),
              v_cache=shaped((8, 32, 32768, 128)), cache_seqlens=32000)


@pytest.mark.parametrize("dtype,Hk,kernel,splits", [
    ("float32", 32, "split_kv", 5),         # 8 blocks per SM: 5 x 256
    ("float16", 32, "split_kv", 5),         # one row per K/V head: split_kv's
    ("float16", 8, "split_kv_mma_t", 4),    # GQA: one wave of 2 per SM, 4 x 64 blocks
    ("bfloat16", 4, "split_kv_mma_t", 8),   # groups of 8: 8 x 32 blocks
])
def test_explain_gpu_decode_splits_and_says_why(dtype, Hk, kernel, splits, no_kvcache_launch):
    """The decode plans on a GPU (132 SMs assumed without one): the kernel, the splits
    by its rule (policy.default_num_splits), the combine after more than one."""
    if dtype == "bfloat16":
        import ml_dtypes
        dtype = ml_dtypes.bfloat16
    kv = shaped((8, Hk, 32768, 128), dtype)
    q = shaped((8, 32, 1, 128), dtype)
    plans = numbaflash.explain_kvcache(q, kv, kv,
                                       cache_seqlens=32000, backend="gpu")
    split = plans[0]
    assert split.kernel == kernel and split.grid == (splits, 1, 8 * Hk)
    assert split.block == (split_kv.THREADS,)
    assert [plan.kernel for plan in plans[1:]] == (["combine_batched"] if splits > 1 else [])
    count = "one split" if splits == 1 else f"{splits} split(s)"
    assert count in split.reason and "SM" in split.reason
    assert split.backend == "gpu" and "Why:" in str(plans)


def test_explain_forced_and_simulator_splits(no_kvcache_launch):
    plans = numbaflash.explain_kvcache(**DECODE, backend="gpu", num_splits=5)
    assert plans[0].grid[0] == 5 and "asked for by the caller" in plans[0].reason
    assert len(plans) == 2
    plans = numbaflash.explain_kvcache(**DECODE, backend="gpu", num_splits=1)
    assert len(plans) == 1 and plans[0].grid[0] == 1
    plans = numbaflash.explain_kvcache(**DECODE, backend="simulator")
    assert len(plans) == 1 and plans[0].grid[0] == 1 and plans[0].backend == "simulator"
    assert "simulator" in plans[0].reason
    # Enough batches and heads to fill the GPU without splitting: one split.
    many = dict(DECODE, q=shaped((64, 32, 1, 128)), k_cache=shaped((64, 32, 4096, 128)),
                v_cache=shaped((64, 32, 4096, 128)), cache_seqlens=4000)
    plans = numbaflash.explain_kvcache(**many, backend="gpu")
    assert len(plans) == 1 and plans[0].grid[0] == 1 and "one split" in plans[0].reason


def test_explain_writes_nothing(no_kvcache_launch):
    args = error_inputs()
    before_k, before_v = args["k_cache"].copy(), args["v_cache"].copy()
    plans = numbaflash.explain_kvcache(**args, causal=True, window_size=(3, 0), softcap=5.0)
    assert plans[0].kernel == "split_kv" and "window" in plans[0].variant
    assert_bitwise_equal("k_cache", args["k_cache"], before_k)
    assert_bitwise_equal("v_cache", args["v_cache"], before_v)


# --- 9. strided inputs: flash-attn's (batch, seqlen, heads, d) order -----------------------

def _bshd(x):
    """x (batch, heads, s, d) stored as (batch, s, heads, d)."""
    return None if x is None else np.ascontiguousarray(x.transpose(0, 2, 1, 3))


def _view(x):
    """The (batch, heads, s, d) view of a (batch, s, heads, d) array, host or device (Numba
    transposes device arrays of two dimensions only: on a GPU the view is built from the
    strides, as a tensor's transpose(1, 2) arrives through the CUDA Array Interface)."""
    if x is None:
        return None
    if not hasattr(x, "copy_to_host"):
        return x.transpose(0, 2, 1, 3)
    if on_gpu():
        from numba.cuda.cudadrv.devicearray import DeviceNDArray
        (s0, s1, s2, s3), (t0, t1, t2, t3) = x.shape, x.strides
        return DeviceNDArray((s0, s2, s1, s3), (t0, t2, t1, t3), x.dtype, gpu_data=x.gpu_data)
    return x.transpose((0, 2, 1, 3))


@pytest.mark.parametrize("device", [False, True], ids=["host", "device"])
def test_caches_in_flash_attn_order_are_read_and_written_in_place(device):
    """q, the caches and the new k, v stored as (batch, s, heads, d) and passed as their
    (batch, heads, s, d) views: the reference's result, and the new rows written into the
    very arrays given (a device cache is read and written where it is, no copy)."""
    case = make_cache_case(B=2, Hk=2, group=2, Sq=2, S_max=24, d=40, dtype="float32",
                           lengths=(6, 20), S_new=1, causal=True, num_splits=2, seed=41)
    q, kc, vc, k, v = (_bshd(x) for x in (case.q, case.k_cache, case.v_cache, case.k, case.v))
    if device:
        q, kc, vc, k, v = (cuda.to_device(x) for x in (q, kc, vc, k, v))
    out, lse = numbaflash.attention_with_kvcache(
        _view(q), _view(kc), _view(vc), cache_seqlens=np.array(case.lengths, np.int32),
        k=_view(k), v=_view(v), causal=True, num_splits=2, return_lse=True)
    want_k, want_v = updated_caches(case)
    assert_bitwise_equal("k_cache", to_host(kc).transpose(0, 2, 1, 3), want_k)
    assert_bitwise_equal("v_cache", to_host(vc).transpose(0, 2, 1, 3), want_v)
    check_against_reference(case, to_host(out), to_host(lse), want_k, want_v)


def test_a_cache_without_a_contiguous_head_dim_is_refused():
    """The kernels read whole head-dim rows: a cache whose last dimension is strided gets
    a ValueError naming it, before anything is written."""
    case = make_cache_case(B=1, Hk=1, group=1, Sq=1, S_max=8, d=4, dtype="float32",
                           lengths=(3,), seed=43)
    wide = cuda.to_device(np.zeros((1, 1, 8, 8), np.float32))
    with pytest.raises(ValueError, match="head dim"):
        numbaflash.attention_with_kvcache(cuda.to_device(case.q), wide[:, :, :, ::2],
                                          cuda.to_device(case.v_cache), cache_seqlens=3)


# --- 10. wide loads and the transposed reduction --------------------------------------------
#
# split_kv reads each lane's columns 8 bytes a load (4 float16/bfloat16 or 2 float32) where
# every load is 8-byte aligned, one element a load otherwise (load_width; the plan says
# which), and reduces a step's scores together (step_scores, tests/test_decode_kernel.py).
# The drawn tests above run both on host caches (d = 8, 20, 40: wide; d = 3: one element);
# here device caches inside wider arrays choose the path, and the plan's reason is checked.

def in_wider(x, extra, offset):
    """x (B, H, S, d) copied to the device inside a (B, H, S, d + extra) array, at columns
    offset .. offset + d - 1, and returned as that view (strides of the wider array)."""
    wide = np.zeros(x.shape[:3] + (x.shape[3] + extra,), x.dtype)
    wide[..., offset:offset + x.shape[3]] = x
    return cuda.to_device(wide)[:, :, :, offset:offset + x.shape[3]]


def run_on_views(case, extra, offset, **override):
    """The case with q, k, v on the device and the caches as views in_wider(extra,
    offset); returns (out, lse, k_cache, v_cache, the split kernel's plan reason)."""
    kc, vc = (in_wider(x, extra, offset) for x in (case.k_cache, case.v_cache))
    q = cuda.to_device(case.q)
    k, v = (None, None) if case.k is None else (cuda.to_device(case.k), cuda.to_device(case.v))
    kw = dict(cache_seqlens=np.array(case.lengths, np.int32), k=k, v=v, causal=case.causal,
              scale=case.scale, num_splits=case.num_splits, **case.variants())
    kw.update(override)
    reason = numbaflash.explain_kvcache(q, kc, vc, **kw)[0].reason
    out, lse = numbaflash.attention_with_kvcache(q, kc, vc, return_lse=True, **kw)
    return to_host(out), to_host(lse), to_host(kc), to_host(vc), reason


@pytest.mark.parametrize("extra,offset,path", [
    (4, 0, "loads of 4 float16 elements (8 bytes) a lane"),
    (4, 1, "k_cache does not start at an 8-byte aligned address"),
    (2, 0, "k_cache's strides"),
])
@pytest.mark.usefixtures("cuda_core_decode")
def test_device_caches_choose_their_loads(extra, offset, path):
    """float16 caches inside wider arrays: rows 4 columns apart keep the wide loads; a
    view one column in (2 bytes past an 8-byte boundary) or rows 42 columns apart (not a
    multiple of 4) get one element a load, and the plan's reason says which and why.
    Either way the new rows are written into the views and the result is the
    reference's."""
    case = make_cache_case(B=2, Hk=2, group=2, Sq=1, S_max=40, d=40, dtype="float16",
                           lengths=(13, 38), S_new=1, causal=True, num_splits=2, seed=47)
    out, lse, k_cache, v_cache, reason = run_on_views(case, extra, offset)
    assert path in reason and "scores reduced together" in reason
    want_k, want_v = updated_caches(case)
    assert_bitwise_equal("k_cache", k_cache, want_k)
    assert_bitwise_equal("v_cache", v_cache, want_v)
    check_against_reference(case, out, lse, want_k, want_v)


def device_like(shape, dtype, strides=None, address=0):
    """Something with a shape, a dtype and a CUDA Array Interface (strides in elements,
    None: C-contiguous; the data at ``address``): all explain_kvcache reads of a device
    array. Nothing is launched with it."""
    dtype = np.dtype(dtype)
    byte_strides = None if strides is None else tuple(st * dtype.itemsize for st in strides)
    return types.SimpleNamespace(shape=shape, dtype=dtype, __cuda_array_interface__=dict(
        shape=shape, strides=byte_strides, data=(address, False), typestr=dtype.str,
        version=3))


@pytest.mark.parametrize("k_strides,k_address,path", [
    (None, 4096, "loads of 4 float16 elements"),
    ((3, 6400, 64, 1), 4096, "loads of 4 float16 elements"),   # batch 1: its stride unused
    ((6400 * 2, 64, 128, 1), 4096, "loads of 4 float16 elements"),    # (batch, s, heads, d)
    (None, 4098, "k_cache does not start at an 8-byte aligned address"),
    ((6400 * 2, 6402, 64, 1), 4096, "k_cache's strides (0, 6402, 64)"),
])
@pytest.mark.usefixtures("cuda_core_decode")
def test_the_plan_reads_where_device_caches_lie(k_strides, k_address, path,
                                                no_kvcache_launch):
    """explain_kvcache on device caches (batch 1, 2 heads, 100 rows, d = 64, float16) at
    a given address and strides: wide loads when every load would be 8-byte aligned,
    else one element a load and the reason names the cache and the cause."""
    q = device_like((1, 4, 1, 64), "float16")
    k_cache = device_like((1, 2, 100, 64), "float16", k_strides, k_address)
    v_cache = device_like((1, 2, 100, 64), "float16", None, 1 << 20)
    reason = numbaflash.explain_kvcache(q, k_cache, v_cache, cache_seqlens=100,
                                        backend="gpu")[0].reason
    assert path in reason


@pytest.mark.parametrize("dtype,d", [("float16", 72), ("float32", 136)])
def test_head_dims_past_one_piece(dtype, d):
    """d not a multiple of the 32 VEC columns one load of the warp covers: float16 d = 72
    (a piece of 128 and 72 - 128: lanes 18 to 31 zeroed), float32 d = 136 (three pieces
    of 64, the last with 8 columns; 6 values a lane, so 4 keys a step instead of 8)."""
    case = make_cache_case(B=1, Hk=1, group=2, Sq=1, S_max=21, d=d, dtype=dtype,
                           lengths=(21,), num_splits=1, seed=53)
    out, lse, k_cache, v_cache = run(case)
    check_against_reference(case, out, lse, k_cache, v_cache)


def test_an_infinite_key_in_the_last_columns():
    """float16, d = 40: lanes 10 to 31 hold no column of the head dim and read the last
    4 columns again (clamped). A key whose last element is -inf, against q rows with a
    positive last element, has score -inf: masked, out finite, as in the reference. The
    clamped copies must be zeroed, not multiplied by q's zeros (0 * -inf = NaN)."""
    case = make_cache_case(B=1, Hk=1, group=2, Sq=1, S_max=20, d=40, dtype="float16",
                           lengths=(20,), seed=71)
    case.q[..., -1] = 1.0
    case.k_cache[0, 0, 6, -1] = -np.inf
    out, lse = run_and_check(case)
    assert np.isfinite(out).all() and np.isfinite(lse).all()


# The NaN pre-fill means nothing for bfloat16's uint16 outputs (NaN casts to 0, with a
# warning); the rule's check still sees every element.
@pytest.mark.filterwarnings("ignore:invalid value encountered in cast:RuntimeWarning")
@pytest.mark.usefixtures("cuda_core_decode")
def test_bfloat16_caches_read_wide():
    """bfloat16 caches (their bits read 4 to a load and widened): the rule against the
    reference, with a split that sees no key (more splits than the keys of batch 0)."""
    from tolerance import check_forward
    import ml_dtypes
    bf16 = ml_dtypes.bfloat16
    rng = np.random.default_rng(59)
    q = rng.uniform(-4, 4, (2, 4, 1, 24)).astype(bf16)
    k_cache, v_cache = (rng.uniform(-4, 4, (2, 2, 20, 24)).astype(bf16) for _ in range(2))
    lengths = np.array([3, 20], np.int32)
    reason = numbaflash.explain_kvcache(q, k_cache, v_cache, cache_seqlens=lengths)[0].reason
    assert "loads of 4 bfloat16 elements" in reason
    out, lse = numbaflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths,
                                                 num_splits=5, return_lse=True)
    for b, n in enumerate(lengths):
        check_forward(q[b:b + 1], k_cache[b:b + 1, :, :n], v_cache[b:b + 1, :, :n],
                      out[b:b + 1], lse[b:b + 1])


@pytest.mark.parametrize("where", ["key", "value"])
def test_nan_in_a_visible_key_of_a_wide_step(where):
    """float16, wide loads, causal, 3 query rows over 11 keys: key 9 is seen by rows 1
    and 2, and hidden from row 0. A NaN in its key (one element) makes rows 1 and 2 of
    that head NaN, in every column (the key's own lanes score it and pass p = NaN to
    every lane); a NaN in its value, only that column. Row 0 and the other head stay
    finite: the NaN key is masked there. NaN positions as in the reference (check_forward)."""
    case = make_cache_case(B=1, Hk=2, group=1, Sq=3, S_max=12, d=16, dtype="float16",
                           lengths=(11,), causal=True, seed=61)
    (case.k_cache if where == "key" else case.v_cache)[0, 1, 9, 5] = np.nan
    out, lse = run_and_check(case)
    assert np.isfinite(out[0, 0]).all() and np.isfinite(out[0, 1, 0]).all()
    nan_columns = np.isnan(out[0, 1, 1:])
    assert nan_columns.all() if where == "key" else (nan_columns.sum(axis=-1) == 1).all()
    assert np.isnan(lse[0, 1, 1:]).all() == (where == "key")


@pytest.mark.usefixtures("cuda_core_decode")
def test_the_parents_kernel_is_still_there(monkeypatch):
    """LOADS = "scalar" and REDUCTION = "allreduce" (what scripts/decode_gpu.py sets to time
    the parent): the plan says so, and the result is the reference's."""
    monkeypatch.setattr(split_kv, "LOADS", "scalar")
    monkeypatch.setattr(split_kv, "REDUCTION", "allreduce")
    case = make_cache_case(B=1, Hk=2, group=2, Sq=1, S_max=40, d=40, dtype="float16",
                           lengths=(37,), S_new=1, num_splits=2, seed=67)
    reason = numbaflash.explain_kvcache(case.q, case.k_cache, case.v_cache,
                                        cache_seqlens=np.array(case.lengths), k=case.k,
                                        v=case.v)[0].reason
    assert "split_kv.LOADS = 'scalar'" in reason and "all-reduced over the warp" in reason
    run_and_check(case)
