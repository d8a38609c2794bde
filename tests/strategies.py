"""Hypothesis strategies for attention inputs, shared by the forward and backward suites.

One ``@st.composite`` draws every dimension once, then builds consistent arrays:

    from strategies import attention_cases, make_case, examples

    @settings(max_examples=examples())
    @given(case=attention_cases(dtypes=("float32",), with_dout=True))
    def test_something(case):
        out = numbaflash.attention(case.q, case.k, case.v, **case.options())
        ...

What a drawn ``AttentionCase`` holds:

    B, H, Sq, Sk, d      q is (B, H, Sq, d); k, v are (B, Hkv, Sk, d); dout (if asked) like q
    Hkv                  K/V heads: H, except in a GQA case (``gqa_cases``), where each K/V
                         head serves H // Hkv query heads (query head h reads K/V head
                         h // (H // Hkv))
    dtype                np.float16, np.float32 or np.float64 (all arrays have it)
    causal               None, "bottom_right" or "top_left"
    tiles                (Br, Bc) for a tiled kernel, or None ("use the default rule")
    scale                None (1/sqrt(d)) or a number
    values               "uniform" (uniform in [-4, 4]) or "grid" (multiples of 0.5 in
                         [-4, 4]: many exact ties between scores, which exercise the
                         "running max did not change" paths)
    seed                 the arrays are a pure function of the fields above and this seed

Every element is float32-exact (and float16-exact for float16 cases), lies in [-4, 4], and
is never subnormal: inputs are "already rounded to the test dtype" (TESTING.md), so the
float64 reference sees exactly what the kernel sees. Extremes (x100 logits, NaN, inf) are
not drawn here: the tests that want them build them from a drawn case.

``repr(case)`` is a ``make_case(...)`` call that rebuilds the same case. When Hypothesis
reports a counterexample, paste it into an ``@example(case=make_case(...))`` on the test,
so that it is checked on every run from then on (TESTING.md: every counterexample ever
found becomes an @example).

Sizes follow the backend (``numbaflash.backend()``):

    simulator  d <= 16, B*H <= 2, seqlens <= 40 and at most 3 tiles + 1 row per axis,
               tiles from {2, 4, 8, 16}. The simulator pays ~150 us per thread launched
               and 5-40 ms per barrier round per block, so each axis crosses only 2-3 tile
               boundaries. GQA cases: B*H <= 16 and B*H*Sq*Sk*d <= 2048.
    gpu        seqlens up to 4096, d in {64, 128} plus odd 59, 111 (and 1, 16, 256), B*H
               up to 9, B*H*Sq*Sk <= 2^23 (the float64 reference's cost), and for float16
               B*H*Sq*Sk*d <= 2^25 (NumPy's float16 matmul is slow); the production default
               tiles 3 times in 4, another candidate that fits otherwise. GQA cases:
               B*H <= 48.

GQA (``gqa_cases``): B in {1, 2}, 2 or 3 K/V heads, groups of 2 to 8 query heads, so that
a wrong query-to-K/V head mapping gives wrong values (with one K/V head every mapping
gives head 0) and the batch and head indices are both above 0. Many heads cost time, so
the simulator caps B * H at ``gqa_max_batch_heads`` and B * H * Sq * Sk * d at
``max_gqa_work``: the more heads, the shorter the sequences and the smaller d.

Seqlens are biased toward the tile boundaries {1, T-1, T, T+1, 2T+1} of the tile T on their
axis (Br for Sq, Bc for Sk), half the time; otherwise uniform in the allowed range.

Example counts: ``examples(factor)`` scales the active Hypothesis profile's max_examples
(conftest.py registers the profiles; the count there is meant for kernel tests, which run
a kernel on every example). Tests that only run NumPy use a larger factor.
"""

import math
from dataclasses import dataclass, field

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st

from numbaflash import policy
from numbaflash.kernels.backward.v1_two_kernels import TILE_CANDIDATES
from numbaflash.kernels.forward.v2_flash2 import default_forward_tiles, forward_shared_bytes
from numbaflash.kernels.plan import SHARED_MEM_LIMIT
from numbaflash.masks import visible

DTYPES = ("float16", "float32", "float64")
CAUSAL_MODES = (None, "bottom_right", "top_left")
VALUE_KINDS = ("uniform", "grid")
# None (the default 1/sqrt(d)) is first, so Hypothesis shrinks toward it.
SCALES = (None, 0.5, 0.3)


def current_backend():
    """'gpu', 'simulator', or 'none' (no GPU and no simulator: only NumPy tests can run)."""
    try:
        return policy.backend()
    except RuntimeError:
        return "none"


def on_gpu():
    return current_backend() == "gpu"


def refusal(explain, version, dtype="float32"):
    """Why ``explain`` (numbaflash.explain or numbaflash.explain_backward) refuses
    ``version`` for a tiny plain input of ``dtype`` here, or None if it plans it (e.g. a
    GPU-only version on the simulator: the library's reason)."""
    q = np.zeros((1, 1, 4, 16), dtype)
    try:
        explain(q, q, q, version=version)
    except ValueError as err:
        return str(err)
    return None


# The tensor-core versions run on the simulator too (numbaflash/kernels/simulated.py),
# but each of their mma is a rendezvous of a warp's 32 Python threads, and a Hypothesis
# example of them costs seconds there. The property suites draw them on a GPU; on the
# simulator tests/test_tensor_core_properties.py draws cases for each with a smaller
# budget, and tests/test_simulated_kernels.py runs each at fixed small shapes, through
# the same checks and the same bitwise ladder.
SIMULATOR_FIXED_SHAPES_ONLY = {"explain": ("v3", "v6", "v7", "v8", "v9", "v10"),
                               "explain_backward": ("v5", "v6", "v8", "v10")}
# where a version above is tested on the simulator instead, if not in those two files
SIMULATOR_TESTS = {("explain_backward", "v8"): "tests/test_backward_atomic_dq.py",
                   ("explain_backward", "v10"): "tests/test_backward_v10.py",
                   ("explain", "v10"): "tests/test_forward_v10.py"}


def version_params(versions, explain, dtype="float32"):
    """``versions`` as pytest params; one the library says cannot run here at all for
    ``dtype`` (a name, or a tuple of names: refused for every one of them) becomes a
    visible skip carrying its (first) reason, never a silent omission. On the simulator
    the tensor-core versions are skipped with the reason above."""
    import pytest
    params = []
    for version in versions:
        whys = [refusal(explain, version, t) for t in
                ((dtype,) if isinstance(dtype, str) else dtype)]
        why = None if None in whys else whys[0]
        if why is None and not on_gpu() and version in SIMULATOR_FIXED_SHAPES_ONLY.get(
                explain.__name__, ()):
            where = SIMULATOR_TESTS.get((explain.__name__, version),
                                        "tests/test_tensor_core_properties.py and "
                                        "tests/test_simulated_kernels.py")
            why = (f"{version} runs on the simulator in {where}, with a smaller budget (every "
                   "mma a rendezvous of 32 Python threads)")
        params.append(version if why is None else
                      pytest.param(version, marks=pytest.mark.skip(reason=why)))
    return params


@dataclass(frozen=True)
class Sizes:
    """How big drawn problems may be on one backend."""
    max_batch_heads: int            # B * H <= this
    max_seqlen: int                 # Sq, Sk <= this
    head_dims: tuple                # d is drawn from these (the first is where shrinking goes)
    tile_sizes: tuple | None        # Br and Bc each drawn from these; None: production candidates
    max_tiles_per_axis: int | None  # seqlen <= this * T + 1 for tile T on that axis (cost cap)
    default_tile: int               # the T used for boundary bias when a case has no tiles
    max_score_elements: int         # B * H * Sq * Sk <= this (the dense reference's memory/time)
    max_half_macs: int | None = None  # float16: B * H * Sq * Sk * d <= this (NumPy's float16
                                      # matmul, used by the float16 baseline, has no BLAS:
                                      # ~50 M multiply-adds per second)
    other_tiles_odds: int = 1       # draw a non-default tile 1 in this many times (GPU: each
                                    # new tile size is a new 1-2 s JIT compile)
    gqa_max_batch_heads: int = 16   # gqa_cases: B * H <= this (H query heads)
    max_gqa_work: int | None = None  # gqa_cases: B * H * Sq * Sk * d <= this (the simulator's
                                     # cost grows with it); None: no cap beyond the others


SIM_SIZES = Sizes(max_batch_heads=2, max_seqlen=40, head_dims=(4, 1, 2, 3, 5, 8, 13, 16),
                  tile_sizes=(4, 2, 8, 16), max_tiles_per_axis=3, default_tile=8,
                  max_score_elements=2 * 40 * 40, gqa_max_batch_heads=16, max_gqa_work=2048)
GPU_SIZES = Sizes(max_batch_heads=9, max_seqlen=4096, head_dims=(64, 128, 59, 111, 1, 16, 256),
                  tile_sizes=None, max_tiles_per_axis=None, default_tile=64,
                  max_score_elements=2 ** 23, max_half_macs=2 ** 25, other_tiles_odds=4,
                  gqa_max_batch_heads=48)


def sizes_for_backend(backend=None):
    """SIM_SIZES unless the backend is a real GPU."""
    return GPU_SIZES if (backend or current_backend()) == "gpu" else SIM_SIZES


def examples(factor=1.0):
    """max_examples for a test: the active profile's count times ``factor`` (at least 1).

    Call it in ``@settings(max_examples=examples(...))``; the profile is loaded by
    conftest.py before test modules are imported, so this reads the right one.
    """
    return max(1, int(round(settings.default.max_examples * factor)))


# ---------------------------------------------------------------------------------------
# Arrays
# ---------------------------------------------------------------------------------------

def random_values(rng, shape, dtype, values="uniform"):
    """An array of ``shape`` in ``dtype``: float32-exact (and dtype-exact), in [-4, 4],
    no subnormals (they are flushed to 0)."""
    dtype = np.dtype(dtype)
    if values == "uniform":
        x = rng.uniform(-4.0, 4.0, size=shape).astype(np.float32).astype(dtype)
    elif values == "grid":
        x = (rng.integers(-8, 9, size=shape) * 0.5).astype(dtype)
    else:
        raise ValueError(f"unknown values kind {values!r}")
    x[np.abs(x) < np.finfo(dtype).tiny] = 0
    return x


@dataclass(frozen=True, repr=False)
class AttentionCase:
    """A drawn attention problem (see the module docstring). Arrays are NumPy, 4D."""
    B: int
    H: int
    Sq: int
    Sk: int
    d: int
    dtype: type
    causal: str | None
    tiles: tuple | None
    scale: float | None
    values: str
    seed: int
    with_dout: bool
    q: np.ndarray = field(compare=False)
    k: np.ndarray = field(compare=False)
    v: np.ndarray = field(compare=False)
    dout: np.ndarray | None = field(compare=False)
    # For tests that need more random data (a permutation, a shift vector): a Generator
    # seeded from this case's seed, so the data is reproducible from the case's repr.
    rng: np.random.Generator = field(compare=False)
    Hkv: int | None = None      # K/V heads (None: H); make_case always sets it

    def options(self, with_tiles=True, **override):
        """Keyword arguments for ``numbaflash.attention``: causal, scale (and tiles when
        ``with_tiles`` is true and the case has them). ``override`` wins."""
        kw = {"causal": self.causal, "scale": self.scale}
        if with_tiles and self.tiles is not None:
            kw["tiles"] = self.tiles
        kw.update(override)
        return kw


    def random_like(self, shape, values=None):
        """More arrays with this case's dtype and value rules, from ``self.rng`` (each call
        gives new values; the sequence is reproducible from the case's repr)."""
        return random_values(self.rng, shape, self.dtype, values or self.values)

    def _repr_pretty_(self, p, cycle):      # Hypothesis and IPython print this
        p.text(repr(self))

    def __repr__(self):
        return (f"make_case(B={self.B}, H={self.H}, Sq={self.Sq}, Sk={self.Sk}, d={self.d}, "
                f"dtype={np.dtype(self.dtype).name!r}, causal={self.causal!r}, "
                f"tiles={self.tiles!r}, scale={self.scale!r}, values={self.values!r}, "
                f"seed={self.seed}, with_dout={self.with_dout}"
                + (f", Hkv={self.Hkv})" if self.Hkv != self.H else ")"))


def make_case(B, H, Sq, Sk, d, dtype="float32", causal=None, tiles=None, scale=None,
              values="uniform", seed=0, with_dout=False, Hkv=None):
    """Build an AttentionCase deterministically (what the strategy draws, and what
    ``@example(case=make_case(...))`` pins). ``Hkv`` (a divisor of H; None: H) gives k and
    v that many heads (GQA)."""
    dtype = np.dtype(dtype).type
    Hkv = H if Hkv is None else Hkv
    if Hkv < 1 or H % Hkv:
        raise ValueError(f"Hkv = {Hkv} must be a positive divisor of H = {H}")
    rng = np.random.default_rng(seed)
    q = random_values(rng, (B, H, Sq, d), dtype, values)
    k = random_values(rng, (B, Hkv, Sk, d), dtype, values)
    v = random_values(rng, (B, Hkv, Sk, d), dtype, values)
    dout = random_values(rng, (B, H, Sq, d), dtype, values) if with_dout else None
    return AttentionCase(B, H, Sq, Sk, d, dtype, causal, None if tiles is None else tuple(tiles),
                         scale, values, seed, with_dout, q, k, v, dout,
                         np.random.default_rng([seed, 1]), Hkv)


# ---------------------------------------------------------------------------------------
# Strategies
# ---------------------------------------------------------------------------------------

def forward_tile_candidates(d, acc_dtype, sizes=None):
    """The (Br, Bc) pairs the forward v2 kernel may be drawn with for head dim d.

    Simulator: every pair from ``sizes.tile_sizes`` (small tiles; shared memory is never a
    limit there). GPU: the default rule's choice first (what users get), then the other
    candidates of TILE_CANDIDATES (backward v1's) that fit in shared memory.
    """
    sizes = sizes or sizes_for_backend()
    if sizes.tile_sizes is not None:
        return [(Br, Bc) for Br in sizes.tile_sizes for Bc in sizes.tile_sizes]
    default = tuple(default_forward_tiles(d, acc_dtype))
    fits = [t for t in TILE_CANDIDATES if t != default and
            forward_shared_bytes(*t, d, acc_dtype) <= SHARED_MEM_LIMIT]
    return [default] + fits


def tile_cuts(n, tile):
    """Where tiles of ``tile`` cut an axis of length n: the start of every tile but the
    first."""
    return tuple(range(tile, n, tile))


def different_tilings(Sq, Sk, tiles, candidates):
    """The (Br, Bc) of ``candidates`` that cut Sq or Sk at other places than ``tiles``:
    the ones a tile-size invariance test learns something from (two pairs that cut both
    axes alike, e.g. Br = 4 and Br = 8 when Sq <= 4, run the same arithmetic)."""
    Br, Bc = tiles
    here = (tile_cuts(Sq, Br), tile_cuts(Sk, Bc))
    return [t for t in candidates if (tile_cuts(Sq, t[0]), tile_cuts(Sk, t[1])) != here]


def seqlens(tile, lo, hi):
    """A seqlen in [lo, hi], half the time one of the boundaries {1, T-1, T, T+1, 2T+1}."""
    boundaries = sorted({n for n in (1, tile - 1, tile, tile + 1, 2 * tile + 1) if lo <= n <= hi})
    uniform = st.integers(lo, hi)
    return st.one_of(st.sampled_from(boundaries), uniform) if boundaries else uniform


def within_budget(Sq, Sk, per_pair, budget):
    """(Sq, Sk) with the longer one halved (rounding down, at least 1) until
    Sq * Sk * per_pair <= budget: a drawn case kept to the simulator's cost."""
    while Sq * Sk * per_pair > budget:
        if Sq >= Sk:
            Sq = max(1, Sq // 2)
        else:
            Sk = max(1, Sk // 2)
    return Sq, Sk


def _axis_max(sizes, tile, max_seqlen):
    hi = sizes.max_seqlen if max_seqlen is None else min(max_seqlen, sizes.max_seqlen)
    if sizes.max_tiles_per_axis is not None:
        hi = min(hi, sizes.max_tiles_per_axis * tile + 1)
    return hi


def _draw_tiles(draw, sizes, d, acc_dtype, tiles):
    """(case_tiles, Tq, Tk): the drawn (Br, Bc) (None when ``tiles`` is None) and the tile
    sizes the seqlens are biased toward."""
    if tiles is None:
        return None, sizes.default_tile, sizes.default_tile
    candidates = (forward_tile_candidates(d, acc_dtype, sizes) if tiles == "forward"
                  else list(tiles(d, acc_dtype)))
    if not candidates:
        raise ValueError(f"no tile candidates for d={d} in {acc_dtype}")
    # The first candidate (the default on a GPU) unless a 1-in-odds draw says otherwise;
    # shrinking goes to the first candidate.
    other = sizes.other_tiles_odds <= 1 or draw(st.integers(1, sizes.other_tiles_odds)) == \
        sizes.other_tiles_odds
    case_tiles = draw(st.sampled_from(candidates)) if other else candidates[0]
    return case_tiles, case_tiles[0], case_tiles[1]


def _draw_seqlens(draw, sizes, Tq, Tk, budget, min_seqlen, max_seqlen, same_seqlen):
    """(Sq, Sk) with Sq * Sk <= budget, each within the backend's axis cap."""
    cap_q = math.isqrt(budget) if same_seqlen else budget
    Sq = draw(seqlens(Tq, min_seqlen, min(cap_q, _axis_max(sizes, Tq, max_seqlen))))
    if same_seqlen:
        return Sq, Sq
    Sk = draw(seqlens(Tk, min_seqlen, min(budget // max(1, Sq),
                                          _axis_max(sizes, Tk, max_seqlen))))
    return Sq, Sk


def _score_budget(sizes, dtype, d):
    """What the dense reference (and the float16 baseline) can afford: Sq * Sk <= this
    for one head."""
    budget = sizes.max_score_elements
    if dtype == "float16" and sizes.max_half_macs is not None:
        budget = min(budget, sizes.max_half_macs // d)
    return budget


@st.composite
def attention_cases(draw, *, dtypes=DTYPES, causal=CAUSAL_MODES, tiles="forward",
                    with_dout=False, min_seqlen=1, max_seqlen=None, head_dims=None,
                    max_batch_heads=None, values=VALUE_KINDS, scales=SCALES, sizes=None,
                    same_seqlen=False):
    """Draw an ``AttentionCase``: dimensions first, then consistent q, k, v (and dout).

    Args:
        dtypes: dtype names to draw from ("float16", "float32", "float64").
        causal: causal modes to draw from (None, "bottom_right", "top_left").
        tiles: "forward" draws (Br, Bc) for the forward v2 kernel (forward_tile_candidates);
            None gives cases without tiles (the kernel's default rule); a callable
            ``f(d, acc_dtype) -> list of (Br, Bc)`` draws from its list (e.g. the
            backward kernel's own limits).
        with_dout: also draw dout (B, H, Sq, d), the upstream gradient for backward tests.
        min_seqlen: 0 allows empty sequences (Sq = 0 or Sk = 0).
        max_seqlen: a further cap on Sq and Sk (the backend's cap always applies).
        head_dims: d is drawn from these instead of the backend's list.
        max_batch_heads: a further cap on B * H.
        values: value kinds to draw from ("uniform", "grid").
        scales: softmax scales to draw from (None = 1/sqrt(d)).
        sizes: a Sizes to use instead of the backend's.
        same_seqlen: draw Sk = Sq.
    """
    sizes = sizes or sizes_for_backend()
    dtype = draw(st.sampled_from(dtypes))
    acc_dtype = "float64" if dtype == "float64" else "float32"
    d = draw(st.sampled_from(head_dims or sizes.head_dims))
    case_tiles, Tq, Tk = _draw_tiles(draw, sizes, d, acc_dtype, tiles)
    budget = _score_budget(sizes, dtype, d)
    Sq, Sk = _draw_seqlens(draw, sizes, Tq, Tk, budget, min_seqlen, max_seqlen, same_seqlen)

    max_bh = sizes.max_batch_heads if max_batch_heads is None else min(max_batch_heads,
                                                                       sizes.max_batch_heads)
    max_bh = max(1, min(max_bh, budget // max(1, Sq * Sk)))
    B = draw(st.integers(1, max_bh))
    H = draw(st.integers(1, max_bh // B))

    mode = draw(st.sampled_from(causal))
    scale = draw(st.sampled_from(scales))
    kind = draw(st.sampled_from(values))
    seed = draw(st.integers(0, 2 ** 32 - 1))
    return make_case(B, H, Sq, Sk, d, dtype, mode, case_tiles, scale, kind, seed, with_dout)


GQA_GROUPS = (2, 8)         # query heads per K/V head, smallest and largest drawn
GQA_KV_HEADS = (2, 3)       # K/V heads, smallest and largest drawn
GQA_BATCH = (1, 2)


@st.composite
def gqa_cases(draw, *, dtypes=DTYPES, causal=CAUSAL_MODES, tiles="forward", with_dout=False,
              values=VALUE_KINDS, scales=SCALES, sizes=None):
    """Draw a GQA ``AttentionCase``: B in GQA_BATCH, Hkv in GQA_KV_HEADS K/V heads, each
    serving a group of 2 to 8 query heads (H = Hkv * group); k and v have Hkv heads.

    Heads are drawn first, within ``sizes.gqa_max_batch_heads`` (B * H); then d, tiles and
    seqlens within the work budget ``sizes.max_gqa_work`` (B * H * Sq * Sk * d) and the
    reference's B * H * Sq * Sk <= ``sizes.max_score_elements``: many heads come with short
    sequences and a small d. The other arguments are attention_cases'.
    """
    sizes = sizes or sizes_for_backend()
    dtype = draw(st.sampled_from(dtypes))
    acc_dtype = "float64" if dtype == "float64" else "float32"
    B = draw(st.integers(*GQA_BATCH))
    Hkv = draw(st.integers(*GQA_KV_HEADS))
    most = min(GQA_GROUPS[1], sizes.gqa_max_batch_heads // (B * Hkv))
    if most < GQA_GROUPS[0]:
        raise ValueError(f"gqa_max_batch_heads = {sizes.gqa_max_batch_heads} leaves no group")
    # half the time the largest group that fits (8 when B = 1 and Hkv = 2)
    group = draw(st.one_of(st.just(most), st.integers(GQA_GROUPS[0], most)))
    H = Hkv * group
    BH = B * H
    work = sizes.max_gqa_work
    dims = [d for d in sizes.head_dims if work is None or BH * d <= work]
    d = draw(st.sampled_from(dims))
    case_tiles, Tq, Tk = _draw_tiles(draw, sizes, d, acc_dtype, tiles)
    budget = _score_budget(sizes, dtype, d) // BH
    if work is not None:
        budget = min(budget, work // (BH * d))
    Sq, Sk = _draw_seqlens(draw, sizes, Tq, Tk, max(1, budget), 1, None, False)

    mode = draw(st.sampled_from(causal))
    scale = draw(st.sampled_from(scales))
    kind = draw(st.sampled_from(values))
    seed = draw(st.integers(0, 2 ** 32 - 1))
    return make_case(B, H, Sq, Sk, d, dtype, mode, case_tiles, scale, kind, seed, with_dout,
                     Hkv=Hkv)


def moved_permutation(rng, n):
    """A random permutation of range(n) (n >= 2) that is not the identity: a metamorphic
    test that permutes by the identity compares a result with itself."""
    if n < 2:
        raise ValueError(f"every permutation of {n} element(s) is the identity")
    perm = rng.permutation(n)
    return np.roll(perm, 1) if np.array_equal(perm, np.arange(n)) else perm


def blind_columns(Sq, Sk, causal):
    """The key columns c that some query row which sees a key cannot see (under the
    causal mask): changing keys from c on must leave that row unchanged, a comparison of
    real outputs (rows that see no key are 0 and -inf whatever the keys are). Empty for
    Sk = 1, for no mask, and for bottom_right with Sq = 1."""
    vis = visible(Sq, Sk, causal)
    blind = ~vis & vis.any(axis=1)[:, None]
    return [int(c) for c in np.flatnonzero(blind.any(axis=0))]


@st.composite
def split_points(draw, lo, hi):
    """An index s in [lo, hi], biased toward the ends and their neighbours (parts of one
    key; with bottom_right, hi = Sk - Sq + 1 is the split whose suffix part has rows that
    see no key, -inf partials). The split tests pass lo = 1 and hi <= Sk - 1, so that
    both parts are non-empty and neither is the whole."""
    if lo > hi:
        raise ValueError(f"no split point in [{lo}, {hi}]")
    return draw(st.one_of(st.sampled_from(sorted({lo, hi, min(lo + 1, hi), max(hi - 1, lo)})),
                          st.integers(lo, hi)))
