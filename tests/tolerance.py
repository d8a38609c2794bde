"""TESTING.md's primary tolerance rule, as assertions that explain themselves when they fail.

For a tensor T in {O, lse, dQ, dK, dV} computed by a kernel in a low precision:

    ref  = float64 reference on inputs already rounded to the test dtype
    base = the same naive formula computed in the test dtype
    max|kernel - ref| <= mult[T] * max|base - ref| + 2 * spacing(max|ref|)
    mult: O 2, lse 2, dV 3, dK 3, dQ 5

(spacing is taken in the dtype of the tensor the kernel returned: float16 for a float16
O, float32 for its lse.)

Fallback (TESTING.md: "absolute fallbacks where a baseline is not meaningful: ... float32
within about 1e-5 relative for O and lse"): for float32 O and lse the bound is at least
FALLBACK_RTOL = 1e-5, TESTING.md's number, times the tensor's natural magnitude (below).
The rule alone is too strict in two situations, both found by Hypothesis with correct kernels:
- small problems, where the naive baseline's error is one or two roundings and can be zero
  by luck: lse of a single key, a score of 0.019 summed from products of size 4 (error
  1.9e-7, rule bound 6.6e-9); O at (Sq, Sk, d) = (5, 15, 8) with scores up to 64 (error
  2.7e-6, rule bound 2.6e-6);
- scores summed from large terms, where NumPy's blocked matmul (the baseline) is luckier
  than a plain float32 dot product. On the H200 (2026-11-30): v1 at (Sq, Sk, d) = (63, 15,
  256), scale * sum|q||k| up to 74: O error 1.28e-5 (rule bound 2.8e-6); v3 at (1, 63, 64),
  scale 0.5, sum up to 160: O error 1.09e-5. A NumPy emulation of the plain float32
  formula with sequential fused multiply-adds has errors 1.6e-5 and 1.1e-5 on the same
  inputs, so the kernels are as accurate as float32 arithmetic allows there. (A first
  fallback of 2e-6, stricter than TESTING.md, failed these; it was raised to TESTING.md's
  1e-5, with max|V| = 4 these errors are 3.2e-6 and 2.7e-6 relative.)
On large problems the rule's own bound is about as large (at (2, 16, 4096, 64): 4.5e-5,
the fallback 4e-5), so the rule still decides there. float64 kernels have no lower-precision baseline: they must be
within 1e-12 relative. Relative to what: to the tensor's natural magnitude, not only to
max|ref|, because ref can cancel to ~0 (O is a weighted mean of V rows that may sum to 0;
lse = m + log l can be 0): bound = 1e-12 * max(max|ref|, magnitude), with magnitude
max|V| for O and max|visible score| + log(Sk) for lse (``forward_magnitudes``); backward
callers pass their own (e.g. max|dO| * max|V| * ... for dQ).

Before any value is compared, non-finite positions must agree exactly: the NaN mask, the
+inf mask and the -inf mask of the kernel's tensor equal the reference's (array_equal).
That is also how unwritten outputs show: the kernel tests pre-fill outputs with NaN, so
an element the kernel never wrote is a NaN where the reference has none. Positions the
caller marks ``exact`` (fully masked rows: zero output, zero dQ) must equal the reference
bitwise (array_equal), not approximately.

Use:

    ref_O, ref_L, base_O, base_L = forward_oracle(q, k, v, causal=..., scale=...)
    assert_matches_reference("O", out, ref_O, base_O, exact=rows[..., None])

    # backward, same rule:
    assert_matches_reference("dQ", dQ, ref_dQ, base_dQ, exact=masked_rows[..., None])
"""

import numpy as np

from numbaflash import reference
from numbaflash.masks import visible

MULT = {"O": 2, "lse": 2, "dV": 3, "dK": 3, "dQ": 5}
FLOAT64_RTOL = 1e-12
FALLBACK_RTOL = {("O", "float32"): 1e-5, ("lse", "float32"): 1e-5}


def to_host(x):
    """A NumPy array from a NumPy array or a (real or simulated) device array."""
    return x.copy_to_host() if hasattr(x, "copy_to_host") and not isinstance(x, np.ndarray) \
        else np.asarray(x)


def _where(mask, limit=5):
    idx = np.argwhere(mask)
    shown = ", ".join(str(tuple(int(i) for i in row)) for row in idx[:limit])
    more = f" and {len(idx) - limit} more" if len(idx) > limit else ""
    return f"{shown}{more}"


def _values(prefix, x, mask, limit=5):
    vals = x[mask][:limit]
    return f"{prefix}{', '.join(repr(float(t)) for t in vals)})" if vals.size else ""


def assert_same_nonfinite(name, got, want):
    """NaN, +inf and -inf positions of ``got`` equal those of ``want`` exactly."""
    for what, test in (("NaN", np.isnan), ("+inf", np.isposinf), ("-inf", np.isneginf)):
        g, w = test(got), test(want)
        if not np.array_equal(g, w):
            only_got, only_want = g & ~w, w & ~g
            raise AssertionError(
                f"{name}: {what} positions differ from the reference: kernel has {what} "
                f"where the reference has none at {_where(only_got) or 'nowhere'}"
                f"{_values(' (reference there: ', want, only_got)}; the reference has {what} "
                f"where the kernel has none at {_where(only_want) or 'nowhere'}"
                f"{_values(' (kernel there: ', got, only_want)}")


def assert_exact(name, got, want, exact):
    """Positions where ``exact`` is True must hold exactly the reference's values."""
    exact = np.broadcast_to(exact, got.shape)
    if not np.array_equal(got[exact], want[exact], equal_nan=True):
        bad = exact & ~((got == want) | (np.isnan(got) & np.isnan(want)))
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        raise AssertionError(
            f"{name}: must equal the reference exactly (array_equal) at {int(exact.sum())} "
            f"positions (e.g. fully masked rows), but differs at {_where(bad)}; first: kernel "
            f"{got[first]!r}, reference {want[first]!r}")


def _max_abs_err(got, want, finite):
    with np.errstate(invalid="ignore"):     # inf - inf at masked positions, discarded
        diff = np.where(finite, np.abs(got.astype(np.float64) - want.astype(np.float64)), 0.0)
    if diff.size == 0:
        return 0.0, None
    at = np.unravel_index(int(np.argmax(diff)), diff.shape)
    return float(diff[at]), at


def assert_matches_reference(name, got, ref, base=None, *, exact=None, kind=None,
                             magnitude=0.0):
    """Assert TESTING.md's rule for one tensor; returns ``(error, bound)``.

    Args:
        name: the tensor's name in messages ("O", "lse", "dQ", ...).
        got: what the kernel returned (NumPy or device array), in its own dtype.
        ref: the float64 reference on the same (rounded) inputs.
        base: the naive reference computed in the test dtype; required unless ``got`` is
            float64 (then the bound is FLOAT64_RTOL * max|ref|).
        exact: boolean mask (broadcastable to the shape) of positions that must equal
            ``ref`` exactly, e.g. the rows of fully masked queries.
        kind: key into MULT (default: ``name``).
        magnitude: the tensor's natural size for the float64 relative rule (see the
            module docstring); the bound uses max(max|ref|, magnitude).
    """
    got = to_host(got)
    ref = np.asarray(ref, dtype=np.float64)
    if got.shape != ref.shape:
        raise AssertionError(f"{name}: shape {got.shape} differs from the reference's {ref.shape}")
    assert_same_nonfinite(name, got, ref)
    if exact is not None:
        assert_exact(name, got.astype(np.float64), ref, exact)

    finite = np.isfinite(ref)
    max_ref = float(np.max(np.abs(ref[finite]))) if finite.any() else 0.0
    err, at = _max_abs_err(got, ref, finite)
    if got.dtype == np.float64:
        size = max(max_ref, float(magnitude))
        bound = FLOAT64_RTOL * size
        how = (f"{FLOAT64_RTOL:g} x max(max|ref| = {max_ref:.6g}, magnitude = "
               f"{float(magnitude):.6g}) [float64 rule]")
    else:
        if base is None:
            raise ValueError(f"{name}: a {got.dtype} kernel result needs the baseline `base`")
        base = np.asarray(base)
        if base.shape != ref.shape:
            raise ValueError(f"{name}: baseline shape {base.shape} differs from {ref.shape}")
        base_bad = finite & ~np.isfinite(base)
        if base_bad.any():
            # A baseline that overflowed cannot bound anything: the test must pick inputs
            # for which the naive formula is finite (or compare against another rule).
            raise ValueError(f"{name}: the {base.dtype} baseline is not finite where the "
                             f"reference is, at {_where(base_bad)}; the rule does not apply")
        mult = MULT[kind or name]
        base_err, _ = _max_abs_err(base, ref, finite)
        spacing = float(np.spacing(got.dtype.type(max_ref)))
        bound = mult * base_err + 2 * spacing
        how = (f"{mult} x baseline error {base_err:.6g} ({base.dtype} naive formula) + "
               f"2 x spacing(max|ref| = {max_ref:.6g}) = 2 x {spacing:.6g} [{got.dtype}]")
        fallback = FALLBACK_RTOL.get((kind or name, got.dtype.name))
        if fallback is not None and fallback * float(magnitude) > bound:
            bound = fallback * float(magnitude)
            how = (f"the fallback {fallback:g} x magnitude {float(magnitude):.6g}, larger than "
                   f"the rule's " + how)
    if not err <= bound:
        raise AssertionError(
            f"{name}: max |kernel - ref| = {err:.6g} exceeds the bound {bound:.6g} = {how}; "
            f"worst at index {tuple(int(i) for i in at)}: kernel {got[at]!r}, "
            f"reference {ref[at]!r}")
    return err, bound


def assert_close_f64(name, got, want, rtol=FLOAT64_RTOL, magnitude=0.0):
    """Two float64 results of the same quantity agree: same non-finite positions, then
    max|got - want| <= rtol * max(max|want|, magnitude) over finite positions. For
    metamorphic checks, where ``want`` is itself a computed result, not a reference."""
    got, want = to_host(got).astype(np.float64), to_host(want).astype(np.float64)
    if got.shape != want.shape:
        raise AssertionError(f"{name}: shape {got.shape} differs from {want.shape}")
    assert_same_nonfinite(name, got, want)
    finite = np.isfinite(want)
    max_want = float(np.max(np.abs(want[finite]))) if finite.any() else 0.0
    err, at = _max_abs_err(got, want, finite)
    bound = rtol * max(max_want, float(magnitude))
    if not err <= bound:
        raise AssertionError(
            f"{name}: max |difference| = {err:.6g} exceeds {rtol:g} x max(max|expected| = "
            f"{max_want:.6g}, magnitude = {float(magnitude):.6g}) = {bound:.6g}; worst at "
            f"index {tuple(int(i) for i in at)}: "
            f"got {got[at]!r}, expected {want[at]!r}")
    return err, bound


def assert_bitwise_equal(name, got, want):
    """Exactly the same bits in every position (NaN matches NaN)."""
    got, want = to_host(got), to_host(want)
    if got.shape != want.shape or got.dtype != want.dtype:
        raise AssertionError(f"{name}: {got.dtype}{got.shape} vs {want.dtype}{want.shape}")
    bits = np.dtype(f"u{got.dtype.itemsize}")
    bad = np.ascontiguousarray(got).view(bits) != np.ascontiguousarray(want).view(bits)
    if bad.any():
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        raise AssertionError(f"{name}: not bitwise equal at {_where(bad)}; first: "
                             f"{got[first]!r} vs {want[first]!r}")


# ---------------------------------------------------------------------------------------
# Oracles and masks for forward checks
# ---------------------------------------------------------------------------------------

def baseline_dtype(dtype):
    """The dtype of the naive same-precision baseline: the test dtype itself."""
    return np.dtype(dtype).type


def forward_oracle(q, k, v, *, causal=None, scale=None, **variants):
    """``(ref_O, ref_L, base_O, base_L)``: float64 reference on the given (already rounded)
    inputs, and the same formula in the inputs' dtype (None for float64 inputs).
    ``variants``: attention's variant keyword arguments (window_size, alibi_slopes, ...)."""
    ref_O, ref_L = reference.forward(q, k, v, causal=causal, scale=scale, **variants)
    dtype = np.asarray(q).dtype
    if dtype == np.float64:
        return ref_O, ref_L, None, None
    with np.errstate(all="ignore"):
        base_O, base_L = reference.forward(q, k, v, causal=causal, scale=scale,
                                           dtype=baseline_dtype(dtype), **variants)
    return ref_O, ref_L, base_O, base_L


def score_terms(q, k, *, causal=None, scale=None, **variants):
    """``(size, mask)``: per (query, key) pair, the size of the terms its score is computed
    from, scale * sum_k |q_k k_k| plus what the variants add or change (|S - scale q.k|),
    0 where masked; and the visibility mask (with GQA, k is expanded to q's heads)."""
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(reference.expand_kv(q, k), dtype=np.float64)
    d = q.shape[-1]
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    with np.errstate(all="ignore"):
        raw = scale * (q @ np.swapaxes(k, -1, -2))
        S, mask, _ = reference.scores(q, k, causal, scale, **variants)
        size = abs(scale) * (np.abs(q) @ np.swapaxes(np.abs(k), -1, -2))
        if variants and any(x is not None for x in variants.values()):
            size = size + np.where(np.isfinite(S) & np.isfinite(raw), np.abs(S - raw), 0)
    size = np.where(mask & np.isfinite(size), size, 0.0)
    return size, mask


def forward_magnitudes(q, k, v, *, causal=None, scale=None, **variants):
    """``(mag_O, mag_L)``: the natural sizes of O and lse for the float64 relative rule.

    O is a convex combination of V rows: max|V| (finite entries). lse lies between the
    row's max score and that plus log(Sk), and each score is a dot product whose rounding
    scales with its terms, not its value: max over visible pairs of scale * sum_k |q_k k_k|
    (plus what the variants add: ``score_terms``), plus log(Sk).
    """
    v = np.asarray(v, dtype=np.float64)
    fv = np.abs(v[np.isfinite(v)])
    mag_O = float(fv.max()) if fv.size else 0.0
    Sk = np.shape(k)[-2]
    size, _ = score_terms(q, k, causal=causal, scale=scale, **variants)
    mag_L = float(size.max(initial=0.0)) + float(np.log(max(Sk, 1)))
    return mag_O, mag_L


def fully_masked_rows(Sq, Sk, causal):
    """Boolean (Sq,): query rows that see no key (output exactly 0, lse -inf)."""
    return ~visible(Sq, Sk, causal).any(axis=1)


def unseen_keys(Sq, Sk, causal):
    """Boolean (Sk,): key rows that no query sees (dK, dV exactly 0)."""
    return ~visible(Sq, Sk, causal).any(axis=0)


def masked_rows_of(mask):
    """Boolean (..., Sq): rows of a (..., Sq, Sk) visibility mask that see no key."""
    return ~np.asarray(mask).any(axis=-1)


def check_forward(q, k, v, out, lse, *, causal=None, scale=None, **variants):
    """Check a forward kernel's (out, lse) against the reference with the primary rule.

    Non-finite positions first, then fully masked rows exactly (out 0, lse -inf), then
    values. q, k, v are the NumPy inputs (any layout: (..., S, d)). Returns a dict of
    (error, bound) per tensor for reporting.
    """
    q = np.asarray(q)
    ref_O, ref_L, base_O, base_L = forward_oracle(q, k, v, causal=causal, scale=scale,
                                                  **variants)
    out, lse = to_host(out), to_host(lse)
    if out.dtype != q.dtype:
        raise AssertionError(f"O: dtype {out.dtype}, expected the inputs' dtype {q.dtype}")
    want_lse = np.float64 if q.dtype == np.float64 else np.float32
    if lse.dtype != want_lse:
        raise AssertionError(f"lse: dtype {lse.dtype}, expected {np.dtype(want_lse)}")
    _, mask = score_terms(q, k, causal=causal, scale=scale, **variants)
    rows = masked_rows_of(mask)
    mag_O, mag_L = forward_magnitudes(q, k, v, causal=causal, scale=scale, **variants)
    return {
        "O": assert_matches_reference("O", out, ref_O, base_O, exact=rows[..., None],
                                      magnitude=mag_O),
        "lse": assert_matches_reference("lse", lse, ref_L, base_L, exact=rows,
                                        magnitude=mag_L),
    }


def merge_partials(O1, L1, O2, L2):
    """Combine attention over two disjoint key sets from their outputs and lse:

        L = logaddexp(L1, L2),  O = exp(L1 - L) O1 + exp(L2 - L) O2

    Rows where both parts saw no key (L1 = L2 = -inf) give O = 0 and L = -inf; a part
    with L = -inf gets weight exactly 0. In float64: ``reference.combine_splits`` of the
    two, the tier-1 merge that split-KV uses."""
    return reference.combine_splits([O1, O2], [L1, L2])
