"""L2 (simulator) / L3 (GPU): packed batches of sequences of different lengths,
``attention_varlen``, ``attention_varlen_backward`` and ``explain_varlen``
(numbaflash/varlen.py, numbaflash/kernels/sequences.py).

The contract: q is (total_q, Hq, d), k and v (total_k, Hkv, d); sequence b is rows
cu_q[b]:cu_q[b + 1] of q and cu_k[b]:cu_k[b + 1] of k and v, and its result is exactly
``attention()`` of its own rows (as (1, H, S, d)) with the same options: causal masks,
windows and ALiBi distances aligned bottom-right within the sequence, ALiBi slopes of
shape (B, Hq) giving sequence b row b, dropout's mask for sequence b the one attention()
uses for batch index b (``dropout_mask(B, Hq, max_q, max_k, p, seed)[b, :, :Sq_b, :Sk_b]``).
lse is (Hq, total_q). What is checked:

1. ``test_matches_reference_per_sequence`` (Hypothesis, the default kernel versions):
   drawn packed batches (B 1..3, lengths 0..12 biased to 0 and to the simulator default
   kernels' tile edges 7, 8, 9 (forward v5 and backward v4 take Br = Bc = 8 at d <= 16),
   GQA/MQA, float16/32/64, causal, windows, softcap, ALiBi (Hq,) or (B, Hq)); every
   sequence's (out, lse) with TESTING.md's rule (tolerance.check_forward: float64
   reference on the rounded inputs, the same-dtype baseline, rows that see no key exactly
   0 and -inf), then its (dq, dk, dv) with backward_checks.check_backward (rows that see
   no key dq exactly 0, keys no row sees dk and dv exactly 0); a sequence with no query
   rows must leave its keys' dk, dv exactly 0, one without keys its rows' dq.
2. ``test_forward_bitwise_equals_attention`` / ``test_backward_bitwise_equals_attention``:
   one fixed packed batch (lengths crossing the tiles, an empty sequence of each kind,
   Sq < Sk and Sq > Sk, GQA with B > 1 and Hkv > 1) through every kernel version that
   takes variants; sequence b must equal attention() / attention_backward() of its slices
   bit for bit, with the same version and tiles: the kernels run exactly a batch of one.
3. Dropout (``test_dropout_*``): every such version against reference.forward_varlen /
   backward_varlen given the cut ``dropout_mask``, with the rules of
   test_dropout_forward_kernels.py (its check_dropout's steps, per sequence) and
   test_dropout_backward_kernels.py (its check_dropout_backward, per sequence); float64
   against backward_varlen itself within 1e-12.
4. Determinism: the backward twice gives the same bits.
5. Device arrays (numba.cuda.to_device) give the host's bits, with host or device int32
   cu_seqlens; device int64 cu_seqlens are refused.
6. Every refused input, with its message, from attention_varlen, explain_varlen and the
   backward, with the launcher replaced by one that fails the test (conftest.no_launch).
7. Empty cases (total_q = 0, total_k = 0, batch 0: no launch) and explain_varlen's plan.
8. max_seqlen_q / max_seqlen_k larger than needed give the bits of None.

Outputs are pre-filled with NaN (conftest.nan_prefilled_outputs), so an element a kernel
never writes shows as a NaN where the reference has none.

Simulator cost (2-core machine, CI=true, ``pytest --durations``): 75-80 s for the
file. The tensor-core versions (forward v6 to v9, backward v6) cost 1-4 s a call (each
mma is a rendezvous of a warp's 32 Python threads), so they run at the fixed batch only;
the Hypothesis test (the default versions) takes about 0.5 s an example, 9 s in all.
Backward v6 runs the bitwise test with the "variants" options only (6 s).

Mutations that this file was checked to catch (each alone, in a copy of the repository):
``locate`` returning a shift of 0 or reading k0 from cu_seqlens_q; check_varlen_inputs
without ``Variant.varlen`` (kernels ignoring cu_seqlens); backward v6's dK/dV kernel
indexing a GQA query head with the sequence's batch index instead of 0.
"""

import math
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from numba import cuda

import numbaflash
from numbaflash import reference
from numbaflash.arrays import is_device_array
from numbaflash.kernels import backward as bwd
from numbaflash.kernels import forward as fwd
from backward_checks import acc_dtype, check_backward
from strategies import examples, on_gpu, random_values
from test_dropout_backward_kernels import check_dropout_backward, dropout_magnitudes
from tolerance import (assert_bitwise_equal, assert_matches_reference, baseline_dtype,
                       check_forward, forward_magnitudes, masked_rows_of, score_terms, to_host)

pytestmark = pytest.mark.usefixtures("nan_prefilled_outputs")

GPU = on_gpu()
DTYPES = ("float32", "float16", "float64")
HEAD_DIMS = (8, 3, 16)                  # the first is where Hypothesis shrinks to
# Lengths: 0 (an empty sequence), 1, and the edges of the simulator defaults' 8-row tiles
LENGTH_EDGES = (0, 1, 7, 8, 9)
MAX_LENGTH = 12
WINDOW_SIDES = (-1, 0, 1, 3)
SOFTCAPS = (2.0, 30.0)

# Versions that take variants run packed batches; those whose module sets PACKED run
# packed batches of plain attention only (no GQA, window, softcap, ALiBi or dropout); the
# others refuse them.
FORWARD_VERSIONS = tuple(v for v in fwd.VERSIONS if fwd.module(v).VARIANTS)
BACKWARD_VERSIONS = tuple(v for v in bwd.VERSIONS if bwd.module(v).VARIANTS)
FORWARD_PACKED_ONLY = tuple(v for v in fwd.VERSIONS if getattr(fwd.module(v), "PACKED", False))
BACKWARD_PACKED_ONLY = tuple(v for v in bwd.VERSIONS
                             if getattr(bwd.module(v), "PACKED", False))
FORWARD_REFUSING = tuple(v for v in fwd.VERSIONS
                         if v not in FORWARD_VERSIONS + FORWARD_PACKED_ONLY)
BACKWARD_REFUSING = tuple(v for v in bwd.VERSIONS
                          if v not in BACKWARD_VERSIONS + BACKWARD_PACKED_ONLY)

# Small tiles on the simulator, so the fixed batch's sequences cross several; on a GPU
# each version's own rule (as tests/test_dropout_*_kernels.py).
FORWARD_TILES = {"v1": None, "v2": (8, 8), "v5": (8, 8, 2, 2), "v7": (16, 32)}
BACKWARD_TILES = {"v1": (4, 4), "v4": (8, 8, 2, 2), "v6": (16, 16), "v8": (16, 16),
                  "v10": (16, 16)}


def forward_tiles(version):
    return None if GPU else FORWARD_TILES.get(version, (16, 16))


def backward_tiles(version):
    return None if GPU else BACKWARD_TILES[version]


def forward_dtype(version):
    """v7 takes float16 only; the others run float32 here (v9 takes nothing else)."""
    return "float16" if version == "v7" else "float32"


def test_version_lists():
    """The versions this file runs packed batches through are the ones the brief names;
    a new version that takes variants must be added to the tile tables above."""
    assert FORWARD_VERSIONS == ("v1", "v2", "v5", "v6", "v7", "v8", "v9")
    assert BACKWARD_VERSIONS == ("v1", "v4", "v6", "v8", "v10")
    assert FORWARD_PACKED_ONLY == ("v10",) and BACKWARD_PACKED_ONLY == ("v9",)
    assert (FORWARD_REFUSING == ("v3", "v4")
            and BACKWARD_REFUSING == ("v2", "v3", "v5", "v7"))


# --- cases -------------------------------------------------------------------------------

def cumulative(lengths):
    """cu_seqlens of ``lengths``: (B + 1,) int32, from 0."""
    return np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int32)


def seq(x, cu, b):
    """Sequence b of a packed (total, H, d) array as a (1, H, S_b, d) array."""
    return np.swapaxes(np.asarray(x)[cu[b]:cu[b + 1]], 0, 1)[None]


def seq_lse(lse, cu, b):
    """Sequence b of a packed (H, total) lse as (1, H, S_b)."""
    return np.asarray(lse)[:, cu[b]:cu[b + 1]][None]


@dataclass(frozen=True, repr=False)
class PackedCase:
    """A packed batch (arrays from ``seed``, NumPy): q (total_q, Hq, d), k and v
    (total_k, Hkv, d), dout like q, ALiBi slopes (Hq,) or (B, Hq) when ``alibi``."""
    lens_q: tuple
    lens_k: tuple
    Hq: int
    Hkv: int
    d: int
    dtype: str
    causal: bool
    scale: float | None
    window: tuple | None
    softcap: float | None
    alibi: str | None           # None, "heads" ((Hq,) slopes) or "batch" ((B, Hq) slopes)
    seed: int
    q: np.ndarray = field(compare=False)
    k: np.ndarray = field(compare=False)
    v: np.ndarray = field(compare=False)
    dout: np.ndarray = field(compare=False)
    slopes: np.ndarray | None = field(compare=False)

    @property
    def B(self):
        return len(self.lens_q)

    @property
    def cu_q(self):
        return cumulative(self.lens_q)

    @property
    def cu_k(self):
        return cumulative(self.lens_k)

    @property
    def mode(self):
        """The causal mode for the 4D API and the reference: bottom-right within the
        sequence."""
        return "bottom_right" if self.causal else None

    def variants(self, b=None):
        """The variant keyword arguments; with ``b``, sequence b's (its row of (B, Hq)
        ALiBi slopes, as a batch of one)."""
        kw = {}
        if self.window is not None:
            kw["window_size"] = self.window
        if self.softcap is not None:
            kw["softcap"] = self.softcap
        if self.alibi is not None:
            slopes = self.slopes
            if b is not None and slopes.ndim == 2:
                slopes = slopes[b:b + 1]
            kw["alibi_slopes"] = slopes
        return kw

    def options(self, **override):
        """Keyword arguments for attention_varlen (and its backward)."""
        kw = dict(causal=self.causal, scale=self.scale, **self.variants())
        kw.update(override)
        return kw

    def sequence(self, b):
        """(q, k, v, dout) of sequence b, each (1, H, S, d)."""
        cu_q, cu_k = self.cu_q, self.cu_k
        return (seq(self.q, cu_q, b), seq(self.k, cu_k, b), seq(self.v, cu_k, b),
                seq(self.dout, cu_q, b))

    def __repr__(self):
        return (f"make_packed_case(lens_q={self.lens_q!r}, lens_k={self.lens_k!r}, "
                f"Hq={self.Hq}, Hkv={self.Hkv}, d={self.d}, dtype={self.dtype!r}, "
                f"causal={self.causal}, scale={self.scale!r}, window={self.window!r}, "
                f"softcap={self.softcap!r}, alibi={self.alibi!r}, seed={self.seed})")

    def _repr_pretty_(self, p, cycle):
        p.text(repr(self))


def make_packed_case(lens_q, lens_k, Hq=4, Hkv=2, d=8, dtype="float32", causal=False,
                     scale=None, window=None, softcap=None, alibi=None, seed=0):
    """Build a PackedCase deterministically (what the strategy draws; for @example)."""
    lens_q, lens_k = tuple(int(n) for n in lens_q), tuple(int(n) for n in lens_k)
    rng = np.random.default_rng(seed)
    total_q, total_k = sum(lens_q), sum(lens_k)
    q = random_values(rng, (total_q, Hq, d), dtype)
    k = random_values(rng, (total_k, Hkv, d), dtype)
    v = random_values(rng, (total_k, Hkv, d), dtype)
    dout = random_values(rng, (total_q, Hq, d), dtype)
    slopes = None
    if alibi is not None:
        shape = {"heads": (Hq,), "batch": (len(lens_q), Hq)}[alibi]
        slopes = rng.uniform(0.05, 1.0, shape).astype(np.float32)
    return PackedCase(lens_q, lens_k, Hq, Hkv, d, np.dtype(dtype).name, bool(causal), scale,
                      None if window is None else tuple(window), softcap, alibi, seed, q, k,
                      v, dout, slopes)


def lengths():
    """A sequence length in 0..MAX_LENGTH, half the time one of LENGTH_EDGES (0 first:
    Hypothesis shrinks to empty sequences)."""
    return st.one_of(st.sampled_from(LENGTH_EDGES), st.integers(0, MAX_LENGTH))


@st.composite
def packed_cases(draw, dtypes=DTYPES):
    """Draw a PackedCase: B in 1..3, Hq in 1..4 with Hkv a divisor (GQA, MQA), d from
    HEAD_DIMS, lengths from ``lengths()``, causal or not, scale None or 0.5, and each half
    the time a window, a softcap and ALiBi slopes ((Hq,) or (B, Hq))."""
    dtype = draw(st.sampled_from(dtypes))
    d = draw(st.sampled_from(HEAD_DIMS))
    B = draw(st.integers(1, 3))
    lens_q = tuple(draw(lengths()) for _ in range(B))
    lens_k = tuple(draw(lengths()) for _ in range(B))
    Hq = draw(st.integers(1, 4))
    Hkv = draw(st.sampled_from([n for n in range(1, Hq + 1) if Hq % n == 0]))
    causal = draw(st.booleans())
    scale = draw(st.sampled_from((None, 0.5)))
    window = softcap = alibi = None
    if draw(st.booleans()):
        window = (draw(st.sampled_from(WINDOW_SIDES)), draw(st.sampled_from(WINDOW_SIDES)))
    if draw(st.booleans()):
        softcap = draw(st.sampled_from(SOFTCAPS))
    if draw(st.booleans()):
        alibi = draw(st.sampled_from(("heads", "batch")))
    seed = draw(st.integers(0, 2 ** 32 - 1))
    return make_packed_case(lens_q, lens_k, Hq, Hkv, d, dtype, causal, scale, window, softcap,
                            alibi, seed)


# The fixed batch of the bitwise, dropout and device tests: sequence 0 has Sq < Sk (the
# causal mask shifts by 9), sequence 1 keys but no query rows, sequence 2 Sq > Sk (6 rows
# see no key under causal), sequence 3 query rows but no keys; 17 and 18 cross 8- and
# 16-row tiles; 4 query heads on 2 K/V heads, so a wrong batch or head mapping shows.
FIXED_Q = (9, 0, 17, 3)
FIXED_K = (18, 4, 11, 0)
FIXED_OPTIONS = {
    "plain": dict(causal=False, scale=0.5),
    "variants": dict(causal=True, window=(6, 0), softcap=5.0, alibi="batch"),
}


def fixed_case(dtype="float32", name="variants", seed=1, **kw):
    """The fixed batch (4 query heads on 2 K/V heads, d = 8) with the options ``name``;
    ``kw`` overrides any argument of make_packed_case."""
    return make_packed_case(FIXED_Q, FIXED_K, **{**dict(Hq=4, Hkv=2, d=8, dtype=dtype, seed=seed),
                                                 **FIXED_OPTIONS[name], **kw})


# --- running and checking ----------------------------------------------------------------

def forward(case, device=False, **override):
    """attention_varlen(..., return_lse=True) on the case; (out, lse) on the host."""
    args = [case.q, case.k, case.v]
    cu_q, cu_k = case.cu_q, case.cu_k
    if device:
        args = [cuda.to_device(a) for a in args]
    kw = case.options(**override)
    out, lse = numbaflash.attention_varlen(*args, cu_q, cu_k, return_lse=True, **kw)
    if device:
        assert is_device_array(out) and is_device_array(lse)
    return to_host(out), to_host(lse)


def backward(case, out, lse, device=False, **override):
    """attention_varlen_backward on the case with the given out, lse; grads on the host."""
    args = [case.dout, case.q, case.k, case.v, out, lse]
    if device:
        args = [cuda.to_device(np.ascontiguousarray(a)) for a in args]
    grads = numbaflash.attention_varlen_backward(*args, case.cu_q, case.cu_k,
                                                 **case.options(**override))
    return tuple(to_host(g) for g in grads)


def check_shapes(case, out, lse):
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    assert lse.shape == (case.Hq, case.q.shape[0])
    assert lse.dtype == acc_dtype(case.q.dtype)


def check_forward_per_sequence(case, out, lse):
    """Every sequence's (out, lse) against the float64 reference (tolerance.check_forward);
    every packed row belongs to one sequence, so every output element is checked."""
    check_shapes(case, out, lse)
    cu_q = case.cu_q
    for b in range(case.B):
        if case.lens_q[b] == 0:
            continue
        q, k, v, _ = case.sequence(b)
        try:
            check_forward(q, k, v, seq(out, cu_q, b), seq_lse(lse, cu_q, b), causal=case.mode,
                          scale=case.scale, **case.variants(b))
        except AssertionError as err:
            raise AssertionError(f"sequence {b} (Sq = {case.lens_q[b]}, Sk = "
                                 f"{case.lens_k[b]}): {err}") from None


def assert_zero(name, x):
    assert np.array_equal(x, np.zeros_like(x)), f"{name} must be exactly 0"


def check_backward_per_sequence(case, out, lse, grads):
    """Every sequence's (dq, dk, dv) with backward_checks.check_backward; a sequence
    without query rows must give its keys dk = dv = 0 exactly, one without keys its rows
    dq = 0 exactly."""
    dq, dk, dv = grads
    for name, g, like in (("dq", dq, case.q), ("dk", dk, case.k), ("dv", dv, case.v)):
        assert g.shape == like.shape and g.dtype == like.dtype, name
    cu_q, cu_k = case.cu_q, case.cu_k
    for b in range(case.B):
        nq, nk = case.lens_q[b], case.lens_k[b]
        mine = (seq(dq, cu_q, b), seq(dk, cu_k, b), seq(dv, cu_k, b))
        where = f"sequence {b} (Sq = {nq}, Sk = {nk})"
        if nq == 0 or nk == 0:
            for name, g in zip(("dq", "dk", "dv"), mine):
                assert_zero(f"{where}: {name}", g)
            continue
        q, k, v, dout = case.sequence(b)
        try:
            check_backward(dout, q, k, v, seq(out, cu_q, b), seq_lse(lse, cu_q, b), mine,
                           causal=case.mode, scale=case.scale, **case.variants(b))
        except AssertionError as err:
            raise AssertionError(f"{where}: {err}") from None


# --- 1. the reference, drawn packed batches ------------------------------------------------

@settings(max_examples=examples())
@given(case=packed_cases())
@example(case=make_packed_case((9, 0, 12, 3), (12, 5, 8, 0), Hq=4, Hkv=2, d=8,
                               dtype="float32", causal=True, window=(3, 0), alibi="batch",
                               seed=3))
@example(case=make_packed_case((8, 1, 7), (1, 9, 7), Hq=3, Hkv=1, d=3, dtype="float16",
                               scale=0.5, softcap=2.0, alibi="heads", seed=4))
@example(case=make_packed_case((0, 0), (5, 7), Hq=2, Hkv=2, d=16, dtype="float64",
                               window=(1, 1), seed=5))
def test_matches_reference_per_sequence(case):
    out, lse = forward(case)
    check_forward_per_sequence(case, out, lse)
    grads = backward(case, out, lse)
    check_backward_per_sequence(case, out, lse, grads)


# --- 2. bit for bit what attention() gives each sequence ------------------------------------

@pytest.mark.parametrize("name", sorted(FIXED_OPTIONS))
@pytest.mark.parametrize("version", FORWARD_VERSIONS)
def test_forward_bitwise_equals_attention(version, name):
    """Sequence b of attention_varlen(version=V) is attention(version=V) of its rows, bit
    for bit, out and lse (sequences without rows or keys included)."""
    case = fixed_case(forward_dtype(version), name)
    tiles = forward_tiles(version)
    out, lse = forward(case, version=version, tiles=tiles)
    check_shapes(case, out, lse)
    for b in range(case.B):
        q, k, v, _ = case.sequence(b)
        want_out, want_lse = numbaflash.attention(
            q, k, v, causal=case.mode, scale=case.scale, version=version, tiles=tiles,
            return_lse=True, **case.variants(b))
        assert_bitwise_equal(f"sequence {b}: out", seq(out, case.cu_q, b), to_host(want_out))
        assert_bitwise_equal(f"sequence {b}: lse", seq_lse(lse, case.cu_q, b),
                             to_host(want_lse))


# backward v6, v8 and v10 (3 s a call on the simulator) with the "variants" options only: their
# plain path is the same code with the variants compiled out
BACKWARD_BITWISE = [(v, n) for v in BACKWARD_VERSIONS for n in sorted(FIXED_OPTIONS)
                    if not (v in ("v6", "v8", "v10") and n == "plain")]


@pytest.mark.parametrize("version,name", BACKWARD_BITWISE)
def test_backward_bitwise_equals_attention(version, name):
    """Sequence b of attention_varlen_backward(version=V) is attention_backward(version=V)
    of its slices (and of the same out, lse), bit for bit; with GQA the dK/dV kernels sum
    over each group within the sequence. v8 adds dQ with atomics: on a GPU the order of
    its adds, so its bits, may change between calls, and its dQ is held to the reference
    only (check_backward_per_sequence); the simulator runs blocks one after another, so
    there its dQ is compared bit for bit too."""
    case = fixed_case("float32", name)
    out, lse = forward(case)
    tiles = backward_tiles(version)
    grads = backward(case, out, lse, version=version, tiles=tiles)
    check_backward_per_sequence(case, out, lse, grads)
    cu_q, cu_k = case.cu_q, case.cu_k
    for b in range(case.B):
        q, k, v, dout = case.sequence(b)
        want = numbaflash.attention_backward(
            dout, q, k, v, seq(out, cu_q, b), seq_lse(lse, cu_q, b), causal=case.mode,
            scale=case.scale, version=version, tiles=tiles, **case.variants(b))
        for g_name, got, w, cu in zip(("dq", "dk", "dv"), grads, want, (cu_q, cu_k, cu_k)):
            if GPU and version == "v8" and g_name == "dq":
                continue                # atomics: see the docstring
            assert_bitwise_equal(f"sequence {b}: {g_name}", seq(got, cu, b), to_host(w))


# The 16-bit versions that take packed batches of plain attention only (PACKED): the
# fixed batch without GQA, causal (Sq > Sk and Sq < Sk shift the mask) and not, float16
# and bfloat16 with d = 8 (16-byte copies), float16 with d = 3 (element by element); 16 x
# 16 tiles on the simulator (the forward's Bc 32), so the sequences of 17 and 18 rows
# cross tiles.
PACKED_ONLY_SHAPES = [(dtype, d, causal)
                      for dtype, d in (("float16", 8), ("bfloat16", 8), ("float16", 3))
                      for causal in (False, True) if d == 8 or causal]
PACKED_ONLY_CASES = [(v,) + shape for v in BACKWARD_PACKED_ONLY for shape in PACKED_ONLY_SHAPES]
FORWARD_PACKED_ONLY_CASES = [(v,) + shape for v in FORWARD_PACKED_ONLY
                             for shape in PACKED_ONLY_SHAPES]


@pytest.mark.parametrize("version,dtype,d,causal", FORWARD_PACKED_ONLY_CASES)
def test_packed_only_forward_bitwise_equals_attention(version, dtype, d, causal):
    """Sequence b of attention_varlen(version=V) is attention(version=V) of its rows, bit
    for bit (out and lse), and meets TESTING.md's rule (check_forward_per_sequence), for
    a version that takes packed batches of plain attention only."""
    case = fixed_case(dtype, "plain", Hkv=4, d=d, causal=causal)
    tiles = None if GPU else (16, 32)
    out, lse = forward(case, version=version, tiles=tiles)
    check_shapes(case, out, lse)
    check_forward_per_sequence(case, out, lse)
    for b in range(case.B):
        q, k, v, _ = case.sequence(b)
        want_out, want_lse = numbaflash.attention(q, k, v, causal=case.mode, scale=case.scale,
                                                  version=version, tiles=tiles, return_lse=True)
        assert_bitwise_equal(f"sequence {b}: out", seq(out, case.cu_q, b), to_host(want_out))
        assert_bitwise_equal(f"sequence {b}: lse", seq_lse(lse, case.cu_q, b),
                             to_host(want_lse))


# Forward versions that read a packed batch as it is (their module's PACKED_ROWS), each
# with a dtype it takes
FORWARD_PACKED_ROWS = tuple((v, "float32" if v in ("v8", "v9") else "float16")
                            for v in fwd.VERSIONS
                            if getattr(fwd.module(v), "PACKED_ROWS", False))


def test_packed_rows_versions():
    assert [v for v, _ in FORWARD_PACKED_ROWS] == ["v8", "v9", "v10"]


def test_packed_backward_v6_register_cap():
    """Backward v6's packed dK/dV builds (and v10's, which run v6's work) ask ptxas for at
    most PACKED_MAX_REGISTERS at d <= 64, so that three blocks of 128 threads stay on an
    SM (v6_split_pairs.py says why); the plain builds and the variants with a score
    modifier or mask keep ptxas's choice, and with dropout the kernel keeps dropout's
    cap."""
    from numbaflash.kernels.backward import v6_split_pairs as v6
    from numbaflash.kernels.variants import Variant
    cap = v6.PACKED_MAX_REGISTERS
    rule = v6.dkdv_register_cap
    assert rule(Variant(varlen=True), 64) == cap
    assert rule(Variant(varlen=True), 1) == cap
    assert rule(Variant(varlen=True), 65) is None
    assert rule(Variant(), 64) is None
    assert rule(Variant(varlen=True, softcap=True), 64) is None
    assert rule(Variant(varlen=True, window=True), 64) is None
    assert rule(Variant(varlen=True, dropout=True), 64) == v6.DKDV_DROPOUT_MAX_REGISTERS


@pytest.mark.parametrize("version,dtype", FORWARD_PACKED_ROWS)
def test_packed_rows_forward_nonfinite_inputs_bitwise_equal_attention(version, dtype):
    """A NaN in one sequence's q and an inf in another's k and v take the forward's rare
    fix-up paths, which read the packed arrays at the sequence's first row plus the row
    (kernels/sequences.py, packed rows): each sequence is still attention() of its own
    rows, bit for bit."""
    case = fixed_case(dtype, "plain", Hkv=4)
    case.q[case.cu_q[2] + 3, 1, 2] = np.nan
    case.k[case.cu_k[0] + 5, 2, 0] = np.inf
    case.v[case.cu_k[0] + 7, 3, 4] = -np.inf
    tiles = None if GPU else (16, 32) if version == "v10" else forward_tiles(version)
    out, lse = forward(case, version=version, tiles=tiles)
    for b in range(case.B):
        q, k, v, _ = case.sequence(b)
        want_out, want_lse = numbaflash.attention(q, k, v, causal=case.mode, scale=case.scale,
                                                  version=version, tiles=tiles, return_lse=True)
        assert_bitwise_equal(f"sequence {b}: out", seq(out, case.cu_q, b), to_host(want_out))
        assert_bitwise_equal(f"sequence {b}: lse", seq_lse(lse, case.cu_q, b),
                             to_host(want_lse))
    assert np.isnan(seq(out, case.cu_q, 2)).any()          # the fix-up path did run


@pytest.mark.parametrize("version,dtype,d,causal", PACKED_ONLY_CASES)
def test_packed_only_backward_bitwise_equals_attention(version, dtype, d, causal):
    """Sequence b of attention_varlen_backward(version=V) is attention_backward(version=V)
    of its slices, bit for bit, and each sequence's gradients meet TESTING.md's rule
    (check_backward_per_sequence), for a version that takes packed batches of plain
    attention only."""
    case = fixed_case(dtype, "plain", Hkv=4, d=d, causal=causal)
    out, lse = forward(case)
    tiles = None if GPU else (16, 16)
    grads = backward(case, out, lse, version=version, tiles=tiles)
    check_backward_per_sequence(case, out, lse, grads)
    cu_q, cu_k = case.cu_q, case.cu_k
    for b in range(case.B):
        q, k, v, dout = case.sequence(b)
        want = numbaflash.attention_backward(
            dout, q, k, v, seq(out, cu_q, b), seq_lse(lse, cu_q, b), causal=case.mode,
            scale=case.scale, version=version, tiles=tiles)
        for g_name, got, w, cu in zip(("dq", "dk", "dv"), grads, want, (cu_q, cu_k, cu_k)):
            assert_bitwise_equal(f"sequence {b}: {g_name}", seq(got, cu, b), to_host(w))


# Batches of equal lengths (flash-attn's layout read in place): Sq > Sk (rows that see no
# key under causal) and Sq < Sk, 17 and 18 crossing the simulator's 16-row tiles.
EQUAL_LENGTHS_CASES = [("float16", (17, 17, 17), (11, 11, 11), True),
                       ("float16", (9, 9), (18, 18), True),
                       ("bfloat16", (9, 9), (18, 18), True),
                       ("float16", (9, 9), (18, 18), False)]


@pytest.mark.parametrize("dtype,lens_q,lens_k,causal", EQUAL_LENGTHS_CASES)
def test_packed_equal_lengths_backward_bitwise_equals_attention(dtype, lens_q, lens_k,
                                                                causal):
    """A causal packed batch whose sequences all have the same lengths runs backward v9's
    dQ kernel built for equal lengths (the two lengths as kernel parameters, cu_seqlens
    not read; kernels/sequences.py), and its plan says so; without the mask the dQ kernel
    reads cu_seqlens (backward v9's ``equal_lengths`` rule). Either way each sequence's
    gradients are attention_backward's of its slices, bit for bit, and meet TESTING.md's
    rule."""
    case = make_packed_case(lens_q, lens_k, Hq=2, Hkv=2, d=8, dtype=dtype, causal=causal,
                            seed=3)
    tiles = None if GPU else (16, 16)
    args = (case.q, case.k, case.v, case.cu_q, case.cu_k)
    plans = numbaflash.explain_varlen_backward(*args, **case.options(), version="v9",
                                               tiles=tiles)
    said = f"every sequence {lens_q[0]} query rows and {lens_k[0]} keys, taken as kernel"
    assert (said in plans[-1].reason) == causal and said not in plans[-2].reason, str(plans)
    out, lse = forward(case)
    grads = backward(case, out, lse, version="v9", tiles=tiles)
    check_backward_per_sequence(case, out, lse, grads)
    for b in range(case.B):
        q, k, v, dout = case.sequence(b)
        want = numbaflash.attention_backward(
            dout, q, k, v, seq(out, case.cu_q, b), seq_lse(lse, case.cu_q, b),
            causal=case.mode, scale=case.scale, version="v9", tiles=tiles)
        for g_name, got, w, cu in zip(("dq", "dk", "dv"), grads, want,
                                      (case.cu_q, case.cu_k, case.cu_k)):
            assert_bitwise_equal(f"sequence {b}: {g_name}", seq(got, cu, b), to_host(w))
    # a grid sized past the lengths (max_seqlen larger): its extra blocks return at once
    big = dict(max_seqlen_q=lens_q[0] + 9, max_seqlen_k=lens_k[0] + 9)
    for name, a, b in zip(("dq", "dk", "dv"), backward(case, out, lse, version="v9",
                                                       tiles=tiles, **big), grads):
        assert_bitwise_equal(f"{name} (max_seqlen larger)", a, b)


def test_equal_lengths_are_found_from_cu_seqlens(no_launch):
    """check_varlen_inputs names a batch's equal lengths (nq, nk) and only then: one
    sequence of another length, in q or in k, and there are none."""
    from numbaflash.varlen import check_varlen_inputs
    q = np.zeros((12, 2, 8), np.float16)
    k = np.zeros((15, 2, 8), np.float16)
    for cu_q, cu_k, want in (([0, 4, 8, 12], [0, 5, 10, 15], (4, 5)),
                             ([0, 4, 8, 12], [0, 5, 11, 15], None),
                             ([0, 3, 8, 12], [0, 5, 10, 15], None),
                             ([0, 12], [0, 15], (12, 15))):
        p, _ = check_varlen_inputs(q, k, k, np.array(cu_q), np.array(cu_k))
        assert p.equal_lengths == want, (cu_q, cu_k)
    case = fixed_case("float16", "plain")
    p, _ = check_varlen_inputs(case.q, case.k, case.v, case.cu_q, case.cu_k)
    assert p.equal_lengths is None


@pytest.mark.parametrize("which,version", [("forward", v) for v in FORWARD_PACKED_ONLY]
                         + [("backward", v) for v in BACKWARD_PACKED_ONLY])
@pytest.mark.parametrize("name,options", [
    ("GQA", dict(Hkv=2)), ("window", dict(window=(3, -1))), ("softcap", dict(softcap=5.0)),
    ("ALiBi", dict(alibi="heads"))])
def test_packed_only_versions_refuse_other_variants(which, version, name, options, no_launch):
    """A version that takes packed batches of plain attention only refuses a packed batch
    with any other variant, naming it, before any launch."""
    case = fixed_case("float16", "plain", **{"Hkv": 4, **options})
    lse = np.zeros((case.Hq, sum(case.lens_q)), np.float32)
    with pytest.raises(ValueError, match=rf"{which} {version} .*computes plain attention, "
                                         r"in one batch or packed,") as err:
        if which == "forward":
            numbaflash.attention_varlen(case.q, case.k, case.v, case.cu_q, case.cu_k,
                                        version=version, **case.options())
        else:
            numbaflash.attention_varlen_backward(case.dout, case.q, case.k, case.v, case.dout,
                                                 lse, case.cu_q, case.cu_k, version=version,
                                                 **case.options())
    assert name in str(err.value)


# --- 3. dropout ---------------------------------------------------------------------------

DROP_P = 0.3
DROP_SEED = 2 ** 40 + 17        # both 32-bit words of Philox's key nonzero


def dropout_case(dtype="float32"):
    """The fixed batch, causal with GQA (a window too), and no ALiBi."""
    return fixed_case(dtype, "plain", causal=True, window=(7, -1), scale=None)


def keep_mask(case, p=DROP_P, seed=DROP_SEED):
    """dropout_mask for the padded batch: (B, Hq, max_q, max_k)."""
    return numbaflash.dropout_mask(case.B, case.Hq, max(case.lens_q), max(case.lens_k), p,
                                   seed)


def check_dropout_forward(case, out, lse, keep, p=DROP_P):
    """test_dropout_forward_kernels.check_dropout's steps, per sequence: the float64
    reference and the same-precision baseline (reference.forward_varlen with the padded
    batch's keep mask), rows that see no key exactly 0 and -inf, O's magnitude
    max|V| / (1 - p)."""
    check_shapes(case, out, lse)
    drop = dict(dropout_p=p, dropout_keep=keep, **case.variants())
    cu_q, cu_k = case.cu_q, case.cu_k
    ref_O, ref_L = reference.forward_varlen(case.q, case.k, case.v, cu_q, cu_k, case.mode,
                                            case.scale, **drop)
    base_O = base_L = None
    if case.q.dtype != np.float64:
        with np.errstate(all="ignore"):
            base_O, base_L = reference.forward_varlen(
                case.q, case.k, case.v, cu_q, cu_k, case.mode, case.scale,
                dtype=baseline_dtype(case.q.dtype), **drop)
    for b in range(case.B):
        if case.lens_q[b] == 0:
            continue
        q, k, v, _ = case.sequence(b)
        kw = dict(causal=case.mode, scale=case.scale, **case.variants(b))
        _, mask = score_terms(q, k, **kw)
        rows = masked_rows_of(mask)
        mag_O, mag_L = forward_magnitudes(q, k, v, **kw)

        def part(x, lse_like=False):
            return None if x is None else (seq_lse(x, cu_q, b) if lse_like else seq(x, cu_q, b))
        try:
            assert_matches_reference("O", seq(out, cu_q, b), part(ref_O), part(base_O),
                                     exact=rows[..., None], magnitude=mag_O / (1 - p))
            assert_matches_reference("lse", seq_lse(lse, cu_q, b), part(ref_L, True),
                                     part(base_L, True), exact=rows, magnitude=mag_L)
        except AssertionError as err:
            raise AssertionError(f"sequence {b}: {err}") from None


@pytest.mark.parametrize("version", FORWARD_VERSIONS)
def test_dropout_forward_matches_reference(version):
    """Sequence b drops what attention() drops for batch index b: the padded batch's mask
    cut to the sequence, for every version (causal, a window, GQA: query heads of one
    K/V head draw different masks)."""
    case = dropout_case(forward_dtype(version))
    tiles = forward_tiles(version)
    keep = keep_mask(case)
    out, lse = forward(case, version=version, tiles=tiles, dropout_p=DROP_P,
                       dropout_seed=DROP_SEED)
    check_dropout_forward(case, out, lse, keep)
    # the check can tell batch indices apart: sequence 2's block of the mask differs
    # from the same block of batch index 0's (a kernel drawing with b = 0 would fail)
    assert not np.array_equal(keep[2, :, :17, :11], keep[0, :, :17, :11])


def dropout_out_lse(case, keep, p=DROP_P):
    """out and lse as attention_varlen returns them with dropout, from the float64
    reference with the mask: out in the inputs' dtype, lse in the accumulator's."""
    out, lse = reference.forward_varlen(case.q, case.k, case.v, case.cu_q, case.cu_k,
                                        case.mode, case.scale, dropout_p=p, dropout_keep=keep,
                                        **case.variants())
    return out.astype(case.q.dtype), lse.astype(acc_dtype(case.q.dtype))


@pytest.mark.parametrize("version", BACKWARD_VERSIONS)
def test_dropout_backward_matches_reference(version):
    """Each backward version with dropout, per sequence, by the rule of
    test_dropout_backward_kernels.check_dropout_backward with the cut mask (out and lse
    from the reference: this checks the backward alone)."""
    case = dropout_case()
    keep = keep_mask(case)
    out, lse = dropout_out_lse(case, keep)
    grads = backward(case, out, lse, version=version, tiles=backward_tiles(version),
                     dropout_p=DROP_P, dropout_seed=DROP_SEED)
    cu_q, cu_k = case.cu_q, case.cu_k
    for b in range(case.B):
        nq, nk = case.lens_q[b], case.lens_k[b]
        mine = tuple(seq(g, cu, b) for g, cu in zip(grads, (cu_q, cu_k, cu_k)))
        if nq == 0 or nk == 0:
            for name, g in zip(("dq", "dk", "dv"), mine):
                assert_zero(f"sequence {b}: {name}", g)
            continue
        q, k, v, dout = case.sequence(b)
        try:
            check_dropout_backward(dout, q, k, v, seq(out, cu_q, b), seq_lse(lse, cu_q, b),
                                   keep[b:b + 1, :, :nq, :nk], mine, p=DROP_P,
                                   causal=case.mode, scale=case.scale, **case.variants(b))
        except AssertionError as err:
            raise AssertionError(f"sequence {b}: {err}") from None


def test_dropout_float64_matches_forward_and_backward_varlen():
    """float64, default versions, GQA with (B, Hq) ALiBi: out, lse within 1e-12 of
    reference.forward_varlen and the gradients within 1e-12 of reference.backward_varlen
    (the kernels' own out given to the backward), each relative to its natural size."""
    case = fixed_case("float64", "variants", seed=2)
    keep = keep_mask(case)
    out, lse = forward(case, dropout_p=DROP_P, dropout_seed=DROP_SEED)
    check_dropout_forward(case, out, lse, keep)
    grads = backward(case, out, lse, dropout_p=DROP_P, dropout_seed=DROP_SEED)
    ref = reference.backward_varlen(case.dout, case.q, case.k, case.v, case.cu_q, case.cu_k,
                                    case.mode, case.scale, dropout_p=DROP_P,
                                    dropout_keep=keep, **case.variants())
    cu_q, cu_k = case.cu_q, case.cu_k
    for b in range(case.B):
        nq, nk = case.lens_q[b], case.lens_k[b]
        q, k, v, dout = case.sequence(b)
        if nq and nk:
            mags, _ = dropout_magnitudes(dout, q, k, v, keep[b:b + 1, :, :nq, :nk], DROP_P,
                                         causal=case.mode, scale=case.scale,
                                         **case.variants(b))
        else:
            mags = {"dQ": 0.0, "dK": 0.0, "dV": 0.0}
        for name, got, want, cu in zip(("dQ", "dK", "dV"), grads, ref, (cu_q, cu_k, cu_k)):
            assert_matches_reference(f"sequence {b}: {name}", seq(got, cu, b),
                                     seq(want, cu, b), magnitude=mags[name])


# --- 4. determinism ----------------------------------------------------------------------

def test_backward_is_deterministic():
    """The default backward twice on the same input (GQA: dK, dV summed over each group;
    dropout regenerated from the seed): the same bits."""
    case = fixed_case("float32", "variants", seed=3)
    out, lse = forward(case, dropout_p=DROP_P, dropout_seed=DROP_SEED)
    first = backward(case, out, lse, dropout_p=DROP_P, dropout_seed=DROP_SEED)
    again = backward(case, out, lse, dropout_p=DROP_P, dropout_seed=DROP_SEED)
    for name, a, b in zip(("dq", "dk", "dv"), first, again):
        assert_bitwise_equal(name, a, b)


# --- 5. device arrays ---------------------------------------------------------------------

def test_device_arrays_give_the_host_bits():
    """q, k, v (and dout, out, lse) on the device, cu_seqlens on the host or on the device
    as int32: the host call's bits, forward and backward; the results stay on the device."""
    case = fixed_case("float32", "variants", seed=4)
    host_out, host_lse = forward(case)
    host_grads = backward(case, host_out, host_lse)
    q, k, v, dout = (cuda.to_device(a) for a in (case.q, case.k, case.v, case.dout))
    for where, cu_q, cu_k in (("host", case.cu_q, case.cu_k),
                              ("device", cuda.to_device(case.cu_q), cuda.to_device(case.cu_k))):
        out, lse = numbaflash.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True,
                                               **case.options())
        assert is_device_array(out) and is_device_array(lse)
        assert_bitwise_equal(f"out (cu_seqlens on the {where})", to_host(out), host_out)
        assert_bitwise_equal(f"lse (cu_seqlens on the {where})", to_host(lse), host_lse)
        if where == "device":       # the backward once (cu_seqlens on the device)
            grads = numbaflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k,
                                                         **case.options())
            for name, g, want in zip(("dq", "dk", "dv"), grads, host_grads):
                assert is_device_array(g)
                assert_bitwise_equal(name, to_host(g), want)


def test_host_cu_seqlens_of_any_integer_dtype():
    """Host cu_seqlens in int64 or uint16: the bits of int32."""
    case = fixed_case("float32", "plain", seed=5)
    want_out, want_lse = forward(case)
    for dtype in (np.int64, np.uint16):
        out, lse = numbaflash.attention_varlen(case.q, case.k, case.v, case.cu_q.astype(dtype),
                                               case.cu_k.astype(dtype), return_lse=True,
                                               **case.options())
        assert_bitwise_equal(f"out ({np.dtype(dtype).name})", out, want_out)
        assert_bitwise_equal(f"lse ({np.dtype(dtype).name})", lse, want_lse)


# --- 6. errors, before anything is launched --------------------------------------------------

def error_args(dtype=np.float32):
    """q (5, 4, 8), k, v (6, 2, 8): two sequences, (2, 3) query rows, (4, 2) keys."""
    rng = np.random.default_rng(0)
    q = random_values(rng, (5, 4, 8), dtype)
    k = random_values(rng, (6, 2, 8), dtype)
    v = random_values(rng, (6, 2, 8), dtype)
    return dict(q=q, k=k, v=v, cu_seqlens_q=np.array([0, 2, 5], np.int32),
                cu_seqlens_k=np.array([0, 4, 6], np.int32))


def f16(x):
    return x.astype(np.float16)


def cu(*values, dtype=np.int32):
    return np.array(values, dtype)


# name: (exception, message, change to error_args()); each raised by attention_varlen,
# explain_varlen and attention_varlen_backward alike
ERRORS = {
    "top_left": (ValueError, r"causal='top_left' is not supported for packed batches",
                 lambda a: dict(causal="top_left")),
    "cu_q_missing": (ValueError, r"cu_seqlens_q is required", lambda a: dict(cu_seqlens_q=None)),
    "cu_not_from_0": (ValueError, r"cu_seqlens_q must start at 0; got 1",
                      lambda a: dict(cu_seqlens_q=cu(1, 2, 5))),
    "cu_decreasing": (ValueError, r"cu_seqlens_k must be non-decreasing .* sequence 1 has "
                      r"length -1", lambda a: dict(cu_seqlens_q=cu(0, 2, 2, 5),
                                                    cu_seqlens_k=cu(0, 4, 3, 6))),
    "cu_q_not_total": (ValueError, r"cu_seqlens_q must end at the packed rows' count 5; got 4",
                       lambda a: dict(cu_seqlens_q=cu(0, 2, 4))),
    "cu_k_past_total": (ValueError, r"cu_seqlens_k must end at the packed rows' count 6; got 7",
                        lambda a: dict(cu_seqlens_k=cu(0, 4, 7))),
    "cu_lengths_differ": (ValueError, r"must have the same length \(batch \+ 1\); got 3 and 2",
                          lambda a: dict(cu_seqlens_k=cu(0, 6))),
    "cu_2d": (ValueError, r"cu_seqlens_q must be a \(batch \+ 1,\) array; got shape \(1, 3\)",
              lambda a: dict(cu_seqlens_q=cu(0, 2, 5)[None])),
    "cu_empty": (ValueError, r"must be a \(batch \+ 1,\) array; got shape \(0,\)",
                 lambda a: dict(cu_seqlens_q=cu(), cu_seqlens_k=cu())),
    "cu_float": (TypeError, r"cu_seqlens_k must be an integer array",
                 lambda a: dict(cu_seqlens_k=cu(0, 4, 6, dtype=np.float64))),
    "cu_bool": (TypeError, r"cu_seqlens_q must be an integer array",
                lambda a: dict(cu_seqlens_q=cu(0, 1, 1, dtype=np.bool_))),
    "cu_device_int64": (TypeError, r"cu_seqlens_q on the device must be int32",
                        lambda a: dict(cu_seqlens_q=cuda.to_device(cu(0, 2, 5, dtype=np.int64)))),
    "max_q_too_small": (ValueError, r"max_seqlen_q = 2 is less than the longest sequence, 3",
                        lambda a: dict(max_seqlen_q=2)),
    "max_k_too_small": (ValueError, r"max_seqlen_k = 3 is less than the longest sequence, 4",
                        lambda a: dict(max_seqlen_k=3)),
    "max_q_float": (TypeError, r"max_seqlen_q must be an int or None",
                    lambda a: dict(max_seqlen_q=3.0)),
    "q_4d": (ValueError, r"q must be a packed batch \(total, heads, d\)",
             lambda a: dict(q=a["q"][None])),
    "q_2d": (ValueError, r"q must be a packed batch", lambda a: dict(q=a["q"][:, 0])),
    "k_4d": (ValueError, r"k must be a packed batch", lambda a: dict(k=a["k"][None])),
    "v_2d": (ValueError, r"v must be a packed batch", lambda a: dict(v=a["v"][:, 0])),
    "heads_not_multiple": (ValueError, r"multiple of the number of key/value heads",
                           lambda a: dict(q=a["q"][:, :3])),
    "head_dims_differ": (ValueError, r"same head dim",
                         lambda a: dict(k=a["k"][..., :4], v=a["v"][..., :4])),
    "dtypes_differ": (TypeError, r"same dtype", lambda a: dict(q=f16(a["q"]))),
    "alibi_shape": (ValueError, r"alibi_slopes must have shape",
                    lambda a: dict(alibi_slopes=np.ones((3, 4), np.float32))),
    "dropout_without_seed": (ValueError, r"needs dropout_seed", lambda a: dict(dropout_p=0.5)),
}


def _call(which, args):
    """Call ``which`` ("forward", "explain", "backward") with ``args`` (error_args() and
    its changes); the backward gets a dout, out and lse that fit q."""
    args = dict(args)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    cu_q, cu_k = args.pop("cu_seqlens_q"), args.pop("cu_seqlens_k")
    if which == "forward":
        return numbaflash.attention_varlen(q, k, v, cu_q, cu_k, **args)
    if which == "explain":
        return numbaflash.explain_varlen(q, k, v, cu_q, cu_k, **args)
    shape = getattr(q, "shape", None)
    dtype = getattr(q, "dtype", np.dtype(np.float32))
    like = np.zeros(shape if shape is not None and len(shape) == 3 else (5, 4, 8), dtype)
    lse = np.zeros((like.shape[1], like.shape[0]),
                   np.float64 if dtype == np.float64 else np.float32)
    return numbaflash.attention_varlen_backward(args.pop("dout", like), q, k, v,
                                                args.pop("out", like), args.pop("lse", lse),
                                                cu_q, cu_k, **args)


@pytest.mark.parametrize("which", ["forward", "explain", "backward"])
@pytest.mark.parametrize("name", sorted(ERRORS))
def test_errors_before_any_launch(name, which, no_launch):
    exc, match, change = ERRORS[name]
    args = error_args()
    args.update(change(args))
    with pytest.raises(exc, match=match):
        _call(which, args)


@pytest.mark.parametrize("name", ["attn_mask", "score_mod", "mask_mod"])
def test_masks_and_score_mods_are_refused(name, no_launch):
    """explain_varlen (which takes attention's variant keywords) names the refusal;
    attention_varlen does not take them at all."""
    args = error_args()
    with pytest.raises(ValueError, match=rf"{name} is not supported for packed batches"):
        numbaflash.explain_varlen(*args.values(), **{name: object()})
    with pytest.raises(TypeError, match=name):
        numbaflash.attention_varlen(*args.values(), **{name: object()})


BACKWARD_ERRORS = {
    "dout_shape": (r"dout must have q's shape \(5, 4, 8\) and dtype float32",
                   lambda a, o, l: dict(dout=o[:4])),
    "dout_dtype": (r"dout must have q's shape .* float32; got \(5, 4, 8\), float16",
                   lambda a, o, l: dict(dout=f16(o))),
    "out_shape": (r"out must have q's shape", lambda a, o, l: dict(out=o[:, :2])),
    "out_dtype": (r"out must have q's shape", lambda a, o, l: dict(out=o.astype(np.float64))),
    "lse_4d_layout": (r"lse must be \(Hq, total_q\) = \(4, 5\) in float32",
                      lambda a, o, l: dict(lse=l[None])),
    "lse_transposed": (r"lse must be \(Hq, total_q\) = \(4, 5\)",
                       lambda a, o, l: dict(lse=np.ascontiguousarray(l.T))),
    "lse_float64": (r"lse must be .* in float32, .*; got \(4, 5\), float64",
                    lambda a, o, l: dict(lse=l.astype(np.float64))),
    "lse_float16": (r"lse must be .* in float32", lambda a, o, l: dict(lse=f16(l))),
    "lse_float32_for_float64": (
        r"lse must be .* in float64, .*; got \(4, 5\), float32",
        lambda a, o, l: dict(q=a["q"].astype(np.float64), k=a["k"].astype(np.float64),
                             v=a["v"].astype(np.float64), dout=o.astype(np.float64),
                             out=o.astype(np.float64))),
}


@pytest.mark.parametrize("name", sorted(BACKWARD_ERRORS))
def test_backward_errors_before_any_launch(name, no_launch):
    match, change = BACKWARD_ERRORS[name]
    args = error_args()
    out = np.zeros((5, 4, 8), np.float32)
    lse = np.zeros((4, 5), np.float32)
    args.update(dict(dout=out, out=out, lse=lse))
    args.update(change(args, out, lse))
    with pytest.raises(ValueError, match=match):
        _call("backward", args)


@pytest.mark.parametrize("which,version", [("forward", v) for v in FORWARD_REFUSING]
                         + [("backward", v) for v in BACKWARD_REFUSING])
def test_versions_without_variants_refuse(which, version, no_launch):
    """Forward v3, v4 and backward v2, v3, v5 compute plain attention only: a ValueError
    naming the packed sequences, before any launch."""
    args = error_args()
    args["version"] = version
    with pytest.raises(ValueError, match=r"packed sequences \(varlen\)"):
        _call(which, args)
    if which == "forward":
        with pytest.raises(ValueError, match=r"packed sequences \(varlen\)"):
            _call("explain", args)


@pytest.mark.parametrize("which", ["forward", "backward"])
def test_mixed_host_and_device_inputs_are_refused(which, no_launch):
    """(explain_varlen, like explain, plans from shapes and does not ask.)"""
    args = error_args()
    args["k"] = cuda.to_device(args["k"])
    with pytest.raises(TypeError, match=r"inputs mix host \(NumPy\) and device arrays"):
        _call(which, args)


def test_non_contiguous_device_input_is_refused(no_launch):
    args = error_args()
    wide = cuda.to_device(np.zeros((5, 4, 16), np.float32))
    dev = dict(q=wide[:, :, ::2], k=cuda.to_device(args["k"]), v=cuda.to_device(args["v"]))
    with pytest.raises(ValueError, match=r"q is a non-contiguous device array"):
        numbaflash.attention_varlen(**dev, cu_seqlens_q=args["cu_seqlens_q"],
                                    cu_seqlens_k=args["cu_seqlens_k"])


# --- 7. empty cases and explain_varlen ------------------------------------------------------

EMPTY = {
    "no_query_rows": ((0, 0), (3, 2)),
    "no_keys": ((2, 3), (0, 0)),
    "batch_0": ((), ()),
}


@pytest.mark.parametrize("device", [False, True], ids=["host", "device"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("name", sorted(EMPTY))
def test_empty_without_a_launch(name, dtype, device, no_launch):
    """total_q = 0, total_k = 0 or no sequence at all: the right shapes and dtypes, out 0,
    lse -inf, every gradient 0, and nothing launched."""
    lens_q, lens_k = EMPTY[name]
    case = make_packed_case(lens_q, lens_k, Hq=4, Hkv=2, d=8, dtype=dtype, causal=True)
    out, lse = forward(case, device=device)
    check_shapes(case, out, lse)
    assert_zero("out", out)
    assert np.isneginf(lse).all()
    assert numbaflash.attention_varlen(case.q, case.k, case.v, case.cu_q, case.cu_k).shape == \
        case.q.shape                                        # return_lse=False: out alone
    grads = backward(case, out, lse, device=device)
    for name_, g, like in zip(("dq", "dk", "dv"), grads, (case.q, case.k, case.v)):
        assert g.shape == like.shape and g.dtype == like.dtype
        assert_zero(name_, g)


def test_explain_varlen_plan(no_launch):
    """The plan of the padded grid: (ceil(max_q / Br), B * Hq), the variant named, for the
    default version here, a forced version and tiles, a larger max_seqlen_q; on a GPU
    (ceil(max_q / Br), Hq, B)."""
    case = fixed_case("float32", "variants")
    args = (case.q, case.k, case.v, case.cu_q, case.cu_k)
    B, Hq, max_q = case.B, case.Hq, max(case.lens_q)
    plan = numbaflash.explain_varlen(*args, **case.options())
    assert plan.grid == (math.ceil(max_q / plan.Br), B * Hq)
    assert "packed sequences (varlen)" in plan.variant
    assert "packed sequences (varlen)" in str(plan)
    assert all(part in plan.variant for part in ("window", "softcap", "ALiBi", "GQA"))
    plan = numbaflash.explain_varlen(*args, version="v2", tiles=(8, 8))
    assert plan.version == "v2" and plan.grid == (3, B * Hq)
    assert "packed sequences (varlen)" in str(plan)
    plan = numbaflash.explain_varlen(*args, version="v2", tiles=(8, 8), max_seqlen_q=25)
    assert plan.grid == (4, B * Hq)
    # past the packed rows' total, the grid is the total's (no sequence is longer)
    plan = numbaflash.explain_varlen(*args, version="v2", tiles=(8, 8), max_seqlen_q=2**40)
    assert plan.grid == (math.ceil(sum(case.lens_q) / 8), B * Hq)
    # the GPU's default here, forward v8, reads the packed rows as they are, on a
    # (tiles, heads, batch) grid (kernels/sequences.py)
    plan = numbaflash.explain_varlen(*args, backend="gpu")
    assert plan.backend == "gpu" and plan.version == "v8", str(plan)
    assert plan.grid == (math.ceil(max_q / plan.Br), Hq, B)
    assert "packed sequences (varlen)" in str(plan)


def test_explain_varlen_backward_plans(no_launch):
    """The backward's plans: the D kernel over every packed row of each head, then the
    dK/dV kernel on the padded grid of K/V tiles (ceil(max_k / Bc), B * Hkv) and the dQ
    kernel on that of Q tiles (ceil(max_q / Br), B * Hq), or for versions that read the
    packed arrays as they are (v6, v10) (ceil(max_k / Bc), Hkv, B) and (ceil(max_q / Br),
    Hq, B); the variant named; a forced version and tiles are taken."""
    case = fixed_case("float32", "variants")
    args = (case.q, case.k, case.v, case.cu_q, case.cu_k)
    Hkv = case.k.shape[1]
    total_q = case.q.shape[0]
    for plans in (numbaflash.explain_varlen_backward(*args, **case.options()),
                  numbaflash.explain_varlen_backward(*args, **case.options(), backend="gpu"),
                  numbaflash.explain_varlen_backward(*args, version="v1", tiles=(8, 8))):
        d_plan, dkdv, dq = plans
        assert d_plan.kernel == "backward_preprocess"
        assert d_plan.grid == (math.ceil(total_q / d_plan.block[0]), case.Hq)
        tiles_k = math.ceil(max(case.lens_k) / dkdv.Bc)
        tiles_q = math.ceil(max(case.lens_q) / dq.Br)
        if getattr(bwd.module(dq.version), "PACKED_ROWS", False):
            # the packed arrays as they are: (tiles, heads, batch) (kernels/sequences.py)
            assert dkdv.grid == (tiles_k, Hkv, case.B)
            assert dq.grid == (tiles_q, case.Hq, case.B)
        else:
            assert dkdv.grid == (tiles_k, case.B * Hkv)
            assert dq.grid == (tiles_q, case.B * case.Hq)
        assert all("packed sequences (varlen)" in plan.variant for plan in (dkdv, dq))
    assert plans[-1].version == "v1" and (plans[-1].Br, plans[-1].Bc) == (8, 8)
    assert [p.version for p in numbaflash.explain_varlen_backward(
        *args, **case.options(), backend="gpu")[1:]] == ["v6", "v6"]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_default_for_packed_16_bit_batches(dtype, no_launch):
    """On a GPU a packed float16 or bfloat16 batch of plain attention (causal or not) runs
    forward v10 and backward v9 (on (tiles, heads, batch) grids), as attention() does,
    each sequence on the grid of the longest; with a variant (here GQA) the defaults are v7 and v6, which take every
    variant."""
    for causal in (False, True):
        case = fixed_case(dtype, "plain", Hkv=4, causal=causal)
        args = (case.q, case.k, case.v, case.cu_q, case.cu_k)
        plan = numbaflash.explain_varlen(*args, **case.options(), backend="gpu")
        # v10's packed grid names the head and the sequence apart (kernels/sequences.py)
        assert plan.version == "v10" and plan.grid[1:] == (case.Hq, case.B), str(plan)
        assert "packed sequences (varlen)" in plan.variant
        plans = numbaflash.explain_varlen_backward(*args, **case.options(), backend="gpu")
        assert [plan.version for plan in plans[1:]] == ["v9", "v9"], str(plans)
        assert plans[1].grid[1:] == plans[2].grid[1:] == (case.Hq, case.B)
        assert "in one batch or packed" in plans[1].reason, plans[1].reason
    case = fixed_case(dtype, "plain")                   # 4 query heads on 2 K/V heads
    args = (case.q, case.k, case.v, case.cu_q, case.cu_k)
    assert numbaflash.explain_varlen(*args, **case.options(), backend="gpu").version == "v7"
    plans = numbaflash.explain_varlen_backward(*args, **case.options(), backend="gpu")
    assert plans[-1].version == "v6", str(plans)


# --- 8. max_seqlen larger than needed -----------------------------------------------------

def test_larger_max_seqlen_gives_the_same_bits():
    """max_seqlen_q, max_seqlen_k larger than the longest sequences add blocks that return
    at once: the bits of max_seqlen None, forward and backward, with dropout (its mask
    counts rows and keys within the sequence, not in the padded grid)."""
    case = fixed_case("float32", "variants", seed=6)
    drop = dict(dropout_p=DROP_P, dropout_seed=DROP_SEED)
    out, lse = forward(case, **drop)
    grads = backward(case, out, lse, **drop)
    big = dict(max_seqlen_q=max(case.lens_q) + 9, max_seqlen_k=max(case.lens_k) + 9)
    args = (case.q, case.k, case.v, case.cu_q, case.cu_k)
    assert (numbaflash.explain_varlen(*args, **big).grid[0]
            > numbaflash.explain_varlen(*args).grid[0]), "the larger grid has more row tiles"
    out2, lse2 = forward(case, **drop, **big)
    assert_bitwise_equal("out", out2, out)
    assert_bitwise_equal("lse", lse2, lse)
    grads2 = backward(case, out, lse, **drop, **big)
    for name, a, b in zip(("dq", "dk", "dv"), grads2, grads):
        assert_bitwise_equal(name, a, b)
