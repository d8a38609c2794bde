"""Input checks shared by every entry point. Everything here runs before any launch."""

import math
from dataclasses import dataclass

import numpy as np

from .masks import causal_offset, parse_causal

SUPPORTED_DTYPES = (np.float16, np.float32, np.float64)
# Largest head dim: each thread keeps its query row's output accumulator (d values) in
# registers, and the K/V tiles (Bc x d each) must fit in 48 KB of static shared memory
# (Numba has no dynamic shared memory opt-in): at d = 256 the float64 tiles are down to 4 keys.
HEAD_DIM_MAX = 256
GRID_Y_MAX = 65535  # batch * heads goes on the grid's y axis


@dataclass(frozen=True)
class Problem:
    """What the kernels need to know about one attention call, after validation."""
    lead: tuple          # leading dims of q (e.g. (B, H)); outputs keep them
    BH: int              # prod(lead): batch and heads flattened
    Sq: int
    Sk: int
    d: int
    dtype: np.dtype      # input (and output) dtype
    acc_dtype: str       # "float32" or "float64": what the kernels compute in
    causal: str | None   # None, "bottom_right" or "top_left"
    causal_offset: int   # key c is visible from query row r iff c <= r + causal_offset
    softmax_scale: float


def _shape_dtype(x, name):
    shape = getattr(x, "shape", None)
    dtype = getattr(x, "dtype", None)
    if shape is None or dtype is None:
        raise TypeError(f"{name} must be an array (NumPy, Numba device array, or an object with "
                        f"__cuda_array_interface__); got {type(x).__name__}")
    try:
        dtype = np.dtype(str(dtype).replace("torch.", ""))
    except TypeError:
        raise TypeError(f"unsupported dtype {dtype} for {name}: numbaflash supports float16 "
                        f"(computed in float32), float32 and float64") from None
    return tuple(int(s) for s in shape), dtype


def check_attention_inputs(q, k, v, causal=False, scale=None):
    """Validate q, k, v and the options; return a ``Problem``. Raises ValueError/TypeError.

    q is (..., Sq, d); k and v are (..., Sk, d) with the same leading dims (rank 2, 3 or 4).
    """
    (qs, qt), (ks, kt), (vs, vt) = (_shape_dtype(a, n) for a, n in ((q, "q"), (k, "k"), (v, "v")))
    for name, s in (("q", qs), ("k", ks), ("v", vs)):
        if len(s) not in (2, 3, 4):
            raise ValueError(f"{name} must have rank 2 (seqlen, d), 3 (heads, seqlen, d) or 4 "
                             f"(batch, heads, seqlen, d); got shape {s}")
    if not (len(qs) == len(ks) == len(vs)):
        raise ValueError(f"q, k, v must have the same rank; got shapes {qs}, {ks}, {vs}")
    if not (qs[:-2] == ks[:-2] == vs[:-2]):
        raise ValueError(f"q, k, v must have the same leading (batch, heads) dims; got shapes "
                         f"{qs}, {ks}, {vs}")
    if ks != vs:
        raise ValueError(f"k and v must have the same shape; got {ks} and {vs}")
    if qs[-1] != ks[-1]:
        raise ValueError(f"q and k must have the same head dim; got {qs[-1]} and {ks[-1]}")
    if not (qt == kt == vt):
        raise TypeError(f"q, k, v must have the same dtype; got {qt}, {kt}, {vt}")
    if qt not in SUPPORTED_DTYPES:
        raise TypeError(f"unsupported dtype {qt}: numbaflash supports float16 (computed in "
                        f"float32), float32 and float64")
    d = qs[-1]
    if d < 1:
        raise ValueError(f"head dim must be at least 1; got {d}")
    if d > HEAD_DIM_MAX:
        raise ValueError(f"head dim {d} exceeds the maximum {HEAD_DIM_MAX}: each thread keeps "
                         f"a row's output (d values) in registers and the K/V tiles must fit "
                         f"in 48 KB of static shared memory")
    mode = parse_causal(causal)
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    elif isinstance(scale, bool) or not isinstance(scale, (int, float, np.integer, np.floating)):
        raise TypeError(f"scale must be a real number or None; got {type(scale).__name__}")
    elif not math.isfinite(scale):
        raise ValueError(f"scale must be finite; got {scale}")
    lead = qs[:-2]
    BH = math.prod(lead)
    if BH > GRID_Y_MAX:
        raise ValueError(f"batch * heads = {BH} exceeds {GRID_Y_MAX}, the CUDA grid's y limit "
                         f"that numbaflash uses for it; split the batch")
    Sq, Sk = qs[-2], ks[-2]
    return Problem(lead=lead, BH=BH, Sq=Sq, Sk=Sk, d=d, dtype=qt,
                   acc_dtype="float64" if qt == np.float64 else "float32",
                   causal=mode, causal_offset=causal_offset(Sq, Sk, mode),
                   softmax_scale=float(scale))


def check_backward_inputs(dout, q, k, v, out, lse, causal=False, scale=None):
    """Validate the backward's inputs; return the ``Problem`` (as ``check_attention_inputs``).

    q, k, v and the options are checked as for the forward. dout and out must have q's
    shape and dtype; lse must have shape (..., Sq) (q's leading dims) and the accumulator
    dtype that ``attention(..., return_lse=True)`` returns: float32 for float16 and float32
    inputs, float64 for float64. Raises ValueError/TypeError.
    """
    p = check_attention_inputs(q, k, v, causal, scale)
    qs, qt = _shape_dtype(q, "q")
    for name, x in (("dout", dout), ("out", out)):
        s, t = _shape_dtype(x, name)
        if s != qs:
            raise ValueError(f"{name} must have q's shape {qs}; got {s}")
        if t != qt:
            raise TypeError(f"{name} must have q's dtype {qt}; got {t}")
    ls, lt = _shape_dtype(lse, "lse")
    if ls != p.lead + (p.Sq,):
        raise ValueError(f"lse must have shape {p.lead + (p.Sq,)} (q's leading dims and Sq); "
                         f"got {ls}")
    if lt != np.dtype(p.acc_dtype):
        raise TypeError(f"lse must be {p.acc_dtype} for {qt} inputs (what attention(..., "
                        f"return_lse=True) returns); got {lt}")
    return p
