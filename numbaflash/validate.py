"""Input checks shared by every entry point. Everything here runs before any launch."""

import math
from dataclasses import dataclass, field

import numpy as np

from .kernels.variants import PLAIN, Variant
from .masks import band, parse_causal, parse_window

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
    BH: int              # prod(lead): batch and query heads flattened
    Sq: int
    Sk: int
    d: int
    dtype: np.dtype      # input (and output) dtype
    acc_dtype: str       # "float32" or "float64": what the kernels compute in
    causal: str | None   # None, "bottom_right" or "top_left"
    causal_offset: int   # key c is visible from query row r iff c <= r + causal_offset
    softmax_scale: float
    # Variants (kernels/variants.py). The upper band bound (causal and/or a window's right
    # side) is ``causal_offset`` with ``upper``; the window's left side is ``window_lo``.
    upper: bool = False  # compile-time: keys past r + causal_offset are masked
    window: tuple | None = None      # (left, right) as given, normalised; None: no window
    window_lo: int = 0   # key c is visible from row r only if c >= r + window_lo (window)
    k_lead: tuple = ()   # leading dims of k and v: (B, Hkv) with GQA
    B: int = 1           # batch; BH = B * Hq
    Hq: int = 1          # query heads
    group: int = 1       # Hq // Hkv: query heads per K/V head (1 without GQA/MQA)
    softcap: float = 0.0
    variant: Variant = PLAIN
    # run-time arrays of the variant (NumPy or device; not compared)
    alibi_slopes: object = field(default=None, compare=False)   # (1 or B, Hq)
    attn_mask: object = field(default=None, compare=False)      # 4D, broadcastable

    @property
    def BHkv(self):
        return self.BH // self.group


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


def check_attention_inputs(q, k, v, causal=False, scale=None, *, window_size=None,
                           alibi_slopes=None, softcap=None, attn_mask=None, score_mod=None,
                           score_mod_grad=None, mask_mod=None):
    """Validate q, k, v and the options; return a ``Problem``. Raises ValueError/TypeError.

    q is (..., Sq, d); k and v are (..., Sk, d) with the same rank (2, 3 or 4) and batch,
    and a number of heads that divides q's (GQA/MQA). The variant options are described
    in ``numbaflash.attention``.
    """
    (qs, qt), (ks, kt), (vs, vt) = (_shape_dtype(a, n) for a, n in ((q, "q"), (k, "k"), (v, "v")))
    for name, s in (("q", qs), ("k", ks), ("v", vs)):
        if len(s) not in (2, 3, 4):
            raise ValueError(f"{name} must have rank 2 (seqlen, d), 3 (heads, seqlen, d) or 4 "
                             f"(batch, heads, seqlen, d); got shape {s}")
    if not (len(qs) == len(ks) == len(vs)):
        raise ValueError(f"q, k, v must have the same rank; got shapes {qs}, {ks}, {vs}")
    if ks != vs:
        raise ValueError(f"k and v must have the same shape; got {ks} and {vs}")
    if qs[:-3] != ks[:-3]:
        raise ValueError(f"q, k, v must have the same batch dim; got shapes {qs}, {ks}, {vs}")
    Hq = qs[-3] if len(qs) >= 3 else 1
    Hkv = ks[-3] if len(ks) >= 3 else 1
    if Hkv != Hq and (Hkv == 0 or Hq % Hkv):
        raise ValueError(f"q has {Hq} heads and k, v have {Hkv}: for grouped-query attention "
                         f"(GQA/MQA) the number of query heads must be a multiple of the "
                         f"number of key/value heads; got shapes {qs}, {ks}, {vs}")
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
    window = parse_window(window_size)
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
    B = qs[0] if len(qs) == 4 else 1
    upper, lower = band(Sq, Sk, mode, window)
    softcap = _check_softcap(softcap)
    slopes = _check_alibi(alibi_slopes, B, Hq)
    mask, mask_kind = _check_attn_mask(attn_mask, B, Hq, Sq, Sk)
    for name, fn in (("score_mod", score_mod), ("score_mod_grad", score_mod_grad),
                     ("mask_mod", mask_mod)):
        if fn is not None and not callable(fn):
            raise TypeError(f"{name} must be a Numba device function (numba.cuda.jit("
                            f"device=True)); got {type(fn).__name__}")
    if score_mod_grad is not None and score_mod is None:
        raise ValueError("score_mod_grad was given without score_mod")
    variant = Variant(window=lower is not None, softcap=softcap is not None,
                      alibi=slopes is not None, mask=mask_kind, score_mod=score_mod,
                      score_mod_grad=score_mod_grad, mask_mod=mask_mod)
    return Problem(lead=lead, BH=BH, Sq=Sq, Sk=Sk, d=d, dtype=qt,
                   acc_dtype="float64" if qt == np.float64 else "float32",
                   causal=mode, causal_offset=Sk if upper is None else upper,
                   softmax_scale=float(scale), upper=upper is not None, window=window,
                   window_lo=0 if lower is None else lower, k_lead=ks[:-2], B=B, Hq=Hq,
                   group=Hq // Hkv if Hkv else 1, softcap=0.0 if softcap is None else softcap,
                   variant=variant, alibi_slopes=slopes, attn_mask=mask)


def _check_softcap(softcap):
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float, np.integer,
                                                             np.floating)):
        raise TypeError(f"softcap must be a positive real number or None; got "
                        f"{type(softcap).__name__}")
    if not (math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"softcap must be finite and > 0 (scores become cap * tanh(s / cap)); "
                         f"got {softcap}")
    return float(softcap)


def _check_alibi(slopes, B, Hq):
    """ALiBi slopes (Hq,) or (B, Hq), any float dtype; returned as a (1 or B, Hq) view."""
    if slopes is None:
        return None
    shape, dtype = _shape_dtype(slopes, "alibi_slopes")
    if dtype.kind != "f":
        raise TypeError(f"alibi_slopes must be a float array; got {dtype}")
    if shape == (Hq,):
        return slopes.reshape(1, Hq)
    if shape == (B, Hq):
        return slopes
    raise ValueError(f"alibi_slopes must have shape (heads,) = ({Hq},) or (batch, heads) = "
                     f"({B}, {Hq}), one slope per query head; got {shape}")


def _check_attn_mask(mask, B, Hq, Sq, Sk):
    """A boolean or float mask broadcastable to (B, Hq, Sq, Sk); returned as a 4D view
    (size-1 dims prepended, and on the host, dims broadcast with stride 0 cut to size 1:
    nothing is expanded) and its kind, "bool" or "bias"."""
    if mask is None:
        return None, None
    shape, dtype = _shape_dtype(mask, "attn_mask")
    if dtype == np.bool_:
        kind = "bool"
    elif dtype in SUPPORTED_DTYPES:
        kind = "bias"
    else:
        raise TypeError(f"attn_mask must be boolean (True: attend) or float (added to the "
                        f"scores); got {dtype}")
    full = (B, Hq, Sq, Sk)
    if len(shape) > 4 or any(s not in (1, f) for s, f in zip(shape[::-1], full[::-1])):
        raise ValueError(f"attn_mask of shape {shape} does not broadcast to (batch, heads, Sq, "
                         f"Sk) = {full}")
    if isinstance(mask, np.ndarray):
        mask = mask[tuple(slice(0, 1) if st == 0 and sz > 1 else slice(None)
                          for st, sz in zip(mask.strides, mask.shape))]
        mask = np.ascontiguousarray(mask)
    shape4 = (1,) * (4 - len(shape)) + tuple(mask.shape)
    return mask.reshape(shape4), kind


def check_backward_inputs(dout, q, k, v, out, lse, causal=False, scale=None, **variants):
    """Validate the backward's inputs; return the ``Problem`` (as ``check_attention_inputs``).

    q, k, v and the options are checked as for the forward. dout and out must have q's
    shape and dtype; lse must have shape (..., Sq) (q's leading dims) and the accumulator
    dtype that ``attention(..., return_lse=True)`` returns: float32 for float16 and float32
    inputs, float64 for float64. Raises ValueError/TypeError.
    """
    p = check_attention_inputs(q, k, v, causal, scale, **variants)
    if p.variant.score_mod is not None and p.variant.score_mod_grad is None:
        raise ValueError("the backward of a score_mod needs its derivative: pass "
                         "score_mod_grad(score, b, h, q_idx, kv_idx) -> d score_mod / d score "
                         "(a Numba device function)")
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
