"""Agreement: is a numbaflash result right? The bound on its error, and the float64
reference computed with NumPy (``NumpyOracle``; ``pytorch.TorchOracle`` is the other).

The rule is the tests' (tests/tolerance.py):

    max|ours - ref64| <= mult * max|base - ref64| + 2 * spacing(max|ref64|)

where ref64 is the float64 reference and base a naive computation in the inputs' dtype.
"""

import math

import numpy as np

from .library import masks, reference

MULT = {"out": 2, "lse": 2, "dq": 5, "dk": 3, "dv": 3}
FLOAT64_RTOL = 1e-12      # float64 results: within 1e-12 of max(1, max|ref|)
FLOAT32_FLOOR = 1e-5      # float32: never stricter than 1e-5 x max|ref| (the rule's fallback)


def agreement_bound(base_err, max_ref, dtype, mult):
    """The largest error of a correct result, by the tests' tolerance rule.

    ``base_err`` is the error of a naive computation in ``dtype`` (PyTorch's MATH backend
    with TF32 off, or the NumPy reference in that dtype) against the float64 reference;
    ``max_ref`` is max|reference|:

        bound = mult * base_err + 2 * spacing(max_ref)        (spacing in ``dtype``)

    float64: FLOAT64_RTOL * max(1, max_ref) instead. float32: never below FLOAT32_FLOOR *
    max_ref, the rule's absolute fallback (on tiny problems the naive baseline can be
    exact by luck, and tests/backward_checks.py shows correct gradients over the bare rule
    there). A wrong kernel (1% off, say) is far above either.
    """
    dtype = np.dtype(dtype)
    if dtype == np.float64:
        return FLOAT64_RTOL * max(1.0, max_ref)
    bound = mult * base_err + 2 * float(np.spacing(dtype.type(max_ref)))
    if dtype == np.float32:
        bound = max(bound, FLOAT32_FLOOR * max_ref)
    return float(bound)


def _agreement(got, ref, base, dtype, mult, zero_rows):
    """One tensor's check: ``{"max_err", "bound", "ok"}``. Arrays are float64 (NumPy) or
    float64 torch tensors of one shape (..., S, d); ``zero_rows`` (boolean, (S,)) marks
    rows that must be exactly 0 (queries that see no key). With ``zero_rows`` None the
    arrays may have any (non-empty) shape."""
    err = float(abs(got - ref).max())           # NaN anywhere gives NaN: not <= bound
    max_ref = float(abs(ref).max())
    base_err = 0.0 if base is None else float(abs(base - ref).max())
    bound = agreement_bound(base_err, max_ref, dtype, mult)
    ok = err <= bound
    if zero_rows is not None and bool(zero_rows.any()):
        ok = ok and bool((got[..., zero_rows, :] == 0).all())
    return {"max_err": err, "bound": bound, "ok": bool(ok)}


def _lse_agreement(got, ref, base, dtype, masked_rows):
    """The check of lse, arrays of shape (..., S) as in ``_agreement``.

    Rows that see no key (``masked_rows``, boolean (S,)) must be exactly -inf, as in the
    reference (tests/tolerance.py compares them with array_equal); ``got - ref`` would be
    NaN there, so the rule (mult ``MULT["lse"]``) is applied to the other rows only.
    """
    exact = bool((got[..., masked_rows] == -math.inf).all())     # NaN there fails too
    seen = ~masked_rows
    if not bool(seen.any()):                  # no row sees a key: nothing to bound
        return {"max_err": 0.0, "bound": 0.0, "ok": exact}
    check = _agreement(got[..., seen], ref[..., seen], None if base is None else
                       base[..., seen], dtype, MULT["lse"], None)
    check["ok"] = check["ok"] and exact
    return check


class NumpyOracle:
    """float64 references from ``numbaflash.reference`` for the first (batch, head) slice.

    The check without PyTorch: dense NumPy over one slice is cheap, and a kernel that is
    wrong is almost always wrong there too. The naive baseline is the same reference
    computed in the inputs' dtype.
    """

    where = "numbaflash.reference float64, first (batch, head) slice"

    def __init__(self, q, k, v, dout, causal, dtype, backward):
        """q, k, v, dout: NumPy (B, H, S, d) in ``dtype``; causal: None or a mode name."""
        self.dtype = np.dtype(dtype)
        self.causal = causal
        q0, k0, v0, do0 = (np.asarray(a[0, 0]) for a in (q, k, v, dout))
        self.zero_rows = ~masks.visible(q0.shape[0], k0.shape[0], causal).any(axis=1)
        self.ref = dict(zip(("out", "lse"), reference.forward(q0, k0, v0, causal=causal)))
        self.base = {}
        naive = self.dtype != np.float64
        with np.errstate(all="ignore"):
            if naive:
                self.base.update(zip(("out", "lse"), reference.forward(
                    q0, k0, v0, causal=causal, dtype=self.dtype.type)))
            if backward:
                self.ref.update(zip(("dq", "dk", "dv"),
                                    reference.backward(do0, q0, k0, v0, causal=causal)))
                if naive:
                    self.base.update(zip(("dq", "dk", "dv"), reference.backward(
                        do0, q0, k0, v0, causal=causal, dtype=self.dtype.type)))

    def check(self, name, got):
        """Check numbaflash's ``name`` ("out", "lse", "dq", "dk", "dv"), a device array
        (B, H, S, d), or (B, H, Sq) for lse."""
        got0 = np.asarray(got[0, 0].copy_to_host(), dtype=np.float64)
        base = self.base.get(name)
        if base is not None:
            base = np.asarray(base, dtype=np.float64)
        if name == "lse":
            return _lse_agreement(got0, self.ref[name], base, self.dtype, self.zero_rows)
        zero = self.zero_rows if name in ("out", "dq") else None
        return _agreement(got0, self.ref[name], base, self.dtype, MULT[name], zero)
