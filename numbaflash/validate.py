"""Input checks shared by every entry point. Everything here runs before any launch.

Besides the shapes, dtypes and options (``check_attention_inputs``,
``check_backward_inputs``), two checks of what a planned call will cost, made before it
allocates anything: ``check_memory`` (the bytes it allocates, against what the host or
the GPU has free: MemoryError) and ``warn_if_slow`` (its time on the CUDA simulator:
SimulatorSlowWarning).
"""

import math
import os
import sys
import warnings
from dataclasses import dataclass, field

import numpy as np

from .dropout import check_dropout
from . import dtypes
from .dtypes import INPUT_DTYPES
from .kernels.variants import PLAIN, Variant
from .masks import band, parse_causal, parse_window

SUPPORTED_DTYPES = INPUT_DTYPES      # float16, bfloat16, float32, float64 (dtypes.py)
DTYPES_TEXT = ("float16 and bfloat16 (computed in float32), float32 and float64")
MASK_DTYPES = (np.float16, np.float32, np.float64)   # a float attn_mask (added to scores)
# Largest head dim: each thread keeps its query row's output accumulator (d values) in
# registers, and the versions that run every variant (forward v1 and v2, backward v1) keep
# their K/V tiles (Bc x d each) in the 48 KB of static shared memory a block gets without
# asking: at d = 256 v2's float64 tiles are down to 4 keys. (Forward v5-v9 and backward
# v4-v6 opt in to dynamic shared memory above 48 KB, kernels/smem.py, for larger tiles.)
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
    # a packed batch (variant.varlen) whose every sequence has nq query rows and nk keys:
    # (nq, nk), else None. Kernels that read it (kernels/sequences.py, equal lengths) take
    # the two lengths as kernel parameters in place of cu_seqlens.
    equal_lengths: tuple | None = None
    # run-time arrays of the variant (NumPy or device; not compared)
    alibi_slopes: object = field(default=None, compare=False)   # (1 or B, Hq)
    attn_mask: object = field(default=None, compare=False)      # 4D, broadcastable
    # dropout (numbaflash/dropout.py): run-time values; variant.dropout says p > 0
    dropout_p: float = field(default=0.0, compare=False)
    dropout_seed: int = field(default=0, compare=False)

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
        raise TypeError(f"unsupported dtype {dtype} for {name}: numbaflash supports "
                        f"{DTYPES_TEXT}") from None
    return tuple(int(s) for s in shape), dtype


def check_attention_inputs(q, k, v, causal=False, scale=None, *, window_size=None,
                           alibi_slopes=None, softcap=None, attn_mask=None, score_mod=None,
                           score_mod_grad=None, mask_mod=None, dropout_p=0.0,
                           dropout_seed=None):
    """Validate q, k, v and the options; return a ``Problem``. Raises ValueError/TypeError.

    q is (..., Sq, d); k and v are (..., Sk, d) with the same rank (2, 3 or 4) and batch,
    and a number of heads that divides q's (GQA/MQA). The variant options are described
    in ``numbaflash.attention``; dropout's in numbaflash/dropout.py (``check_dropout``).
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
        raise TypeError(f"unsupported dtype {qt}: numbaflash supports {DTYPES_TEXT}")
    d = qs[-1]
    if d < 1:
        raise ValueError(f"head dim must be at least 1; got {d}")
    if d > HEAD_DIM_MAX:
        raise ValueError(f"head dim {d} exceeds the maximum {HEAD_DIM_MAX}: each thread keeps "
                         f"a row's output (d values) in registers, and the kernels that run "
                         f"every variant keep K/V tiles in 48 KB of static shared memory")
    mode = parse_causal(causal)
    window = parse_window(window_size)
    scale = check_scale(scale, d)
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
    dropout_p, dropout_seed = check_dropout(dropout_p, dropout_seed)
    variant = Variant(window=lower is not None, dropout=dropout_p > 0,
                      softcap=softcap is not None,
                      alibi=slopes is not None, mask=mask_kind, score_mod=score_mod,
                      score_mod_grad=score_mod_grad, mask_mod=mask_mod)
    return Problem(lead=lead, BH=BH, Sq=Sq, Sk=Sk, d=d, dtype=qt,
                   acc_dtype="float64" if qt == np.float64 else "float32",
                   causal=mode, causal_offset=Sk if upper is None else upper,
                   softmax_scale=float(scale), upper=upper is not None, window=window,
                   window_lo=0 if lower is None else lower, k_lead=ks[:-2], B=B, Hq=Hq,
                   group=Hq // Hkv if Hkv else 1, softcap=0.0 if softcap is None else softcap,
                   variant=variant, alibi_slopes=slopes, attn_mask=mask,
                   dropout_p=dropout_p, dropout_seed=dropout_seed or 0)


def check_scale(scale, d):
    """The softmax scale: 1/sqrt(d) for None, else a finite real number (TypeError or
    ValueError otherwise)."""
    if scale is None:
        return 1.0 / math.sqrt(d)
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.integer, np.floating)):
        raise TypeError(f"scale must be a real number or None; got {type(scale).__name__}")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite; got {scale}")
    return scale


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
    elif dtype in MASK_DTYPES:
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


# --- Memory: what a call allocates, checked before it allocates anything -------------------
#
# A call whose arrays cannot fit must not get as far as allocating them: on the host (the
# results of a NumPy call, and every array on the simulator, whose device arrays are host
# memory) the OS kills the process when memory runs out, with no Python error. So the API
# adds up the bytes a call will allocate (``forward_memory``, ``backward_memory``) and
# ``check_memory`` raises MemoryError, naming the shape and both byte counts, when they
# exceed what is free. Calls that allocate less than MEMORY_CHECK_MIN_BYTES in each place
# are not checked: reading the free memory costs a system or driver call, and the small
# calls of a training loop should not pay for it.

MEMORY_CHECK_MIN_BYTES = 64 << 20


def available_host_bytes():
    """Host memory that can be allocated now without swapping, in bytes (None if unknown).

    Linux's MemAvailable (/proc/meminfo; what ``free`` calls available), else the free pages
    (``os.sysconf``); at most what this process's cgroup (a container's limit) has left.
    """
    have = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    have = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    if have is None:
        try:
            have = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (AttributeError, OSError, ValueError):
            pass
    left = _cgroup_bytes_left()
    if left is not None:
        have = left if have is None else min(have, left)
    return have


def _cgroup_bytes_left():
    """memory.max - memory.current of this process's cgroup (v2), counting the inactive page
    cache (reclaimed before anything is killed) as free; None without a limit."""
    root = "/sys/fs/cgroup/"
    try:
        with open(root + "memory.max") as f:
            limit = f.read().strip()
        if limit == "max":
            return None
        with open(root + "memory.current") as f:
            used = int(f.read())
        try:
            with open(root + "memory.stat") as f:
                for line in f:
                    if line.startswith("inactive_file "):
                        used -= int(line.split()[1])
                        break
        except OSError:
            pass
        return max(int(limit) - used, 0)
    except (OSError, ValueError):
        return None


def available_device_bytes():
    """Free memory of the current GPU in bytes (the CUDA driver's cuMemGetInfo), or None
    where the memory manager cannot say (Numba's pool allocator plugins may not)."""
    from numba import cuda
    try:
        free, _total = cuda.current_context().get_memory_info()
    except NotImplementedError:
        return None
    return free


def _shapes(p):
    return p.lead + (p.Sq, p.d), p.k_lead + (p.Sk, p.d)


def _empty(p):
    return p.BH == 0 or p.Sq == 0 or p.Sk == 0


def _host_input_parts(inputs):
    """Host copies the API makes of host inputs that are not C-contiguous."""
    return [(f"a contiguous copy of {name}", x.nbytes, "host") for name, x in inputs.items()
            if isinstance(x, np.ndarray) and not x.flags.c_contiguous]


def _variant_parts(p, plan):
    """Device copies of host ALiBi slopes and attn_mask, and the tile table of a mask."""
    if p.alibi_slopes is None and p.attn_mask is None and not p.variant.tile_table:
        return []
    parts = [(f"a device copy of {name}", x.nbytes, "device")
             for name, x in (("alibi_slopes", p.alibi_slopes), ("attn_mask", p.attn_mask))
             if isinstance(x, np.ndarray)]
    if p.variant.tile_table and plan is not None and plan.Br:
        parts.append(("the tile table", p.BH * math.ceil(p.Sq / plan.Br)
                      * math.ceil(p.Sk / plan.Bc), "device"))
    return parts


def _filled(p, outputs, host):
    """An empty call's outputs (arrays.filled): built on the host, copied for device inputs."""
    parts = [(what, n, "host") for what, n in outputs]
    return parts if host else parts + [(what, n, "device") for what, n in outputs]


def forward_memory(p, plan, inputs, host):
    """The arrays ``attention`` allocates for Problem ``p`` run by ``plan``.

    ``inputs``: {"q": q, "k": k, "v": v} as given; ``host``: they are NumPy arrays (copied
    to the device, the results copied back). Returns a list of (what, bytes, where), where
    is "device" (GPU memory; host memory on the simulator) or "host".
    """
    itemsize, acc = p.dtype.itemsize, 8 if p.acc_dtype == "float64" else 4
    out, lse = p.BH * p.Sq * p.d * itemsize, p.BH * p.Sq * acc
    if _empty(p):
        return _filled(p, (("out", out), ("lse", lse)), host)
    parts = [("out", out, "device"), ("lse", lse, "device")]
    if host:
        parts.append(("device copies of q, k, v",
                      (p.BH * p.Sq + 2 * p.BHkv * p.Sk) * p.d * itemsize, "device"))
        parts.append(("out and lse copied to the host", out + lse, "host"))
        parts += _host_input_parts(inputs)
    return parts + _variant_parts(p, plan) + _widened_parts(
        p, plan, host, inputs=p.BH * p.Sq + 2 * p.BHkv * p.Sk, outputs=p.BH * p.Sq)


def _widened_parts(p, plan, host, inputs, outputs):
    """The float32 copies of bfloat16 inputs (``inputs`` rows of d values) and outputs
    (``outputs`` rows) on a version that computes in float32 (numbaflash/dtypes.py):
    made on the host for host inputs, on the device otherwise; the outputs on the device."""
    from .kernels import backward, forward

    if plan is None:
        return []
    ladder = forward if plan.pass_name == "forward" else backward
    if not dtypes.widens(p, ladder.module(plan.version)):
        return []
    parts = [("float32 copies of the bfloat16 inputs", inputs * p.d * 4,
              "host" if host else "device"),
             ("float32 outputs, rounded to bfloat16 after", outputs * p.d * 4, "device")]
    if host:
        parts.append(("device copies of the float32 inputs", inputs * p.d * 4, "device"))
    return parts


def backward_memory(p, plans, inputs, host):
    """The arrays ``attention_backward`` allocates for Problem ``p`` run by ``plans``
    (``Plans``): device copies of host inputs, D = rowsum(dO * O) (scratch), dq, dk, dv,
    and their host copies for host inputs. As ``forward_memory`` otherwise; ``inputs``:
    {"dout": dout, "q": q, ...}."""
    itemsize, acc = p.dtype.itemsize, 8 if p.acc_dtype == "float64" else 4
    dq, dkv = p.BH * p.Sq * p.d * itemsize, p.BHkv * p.Sk * p.d * itemsize
    if _empty(p):
        return _filled(p, (("dq", dq), ("dk", dkv), ("dv", dkv)), host)
    parts = [("D = rowsum(dO * O) (scratch)", p.BH * p.Sq * acc, "device"),
             ("dq", dq, "device"), ("dk", dkv, "device"), ("dv", dkv, "device")]
    if host:
        parts.append(("device copies of q, k, v, out, dout, lse",
                      3 * dq + 2 * dkv + p.BH * p.Sq * acc, "device"))
        parts.append(("dq, dk, dv copied to the host", dq + 2 * dkv, "host"))
        parts += _host_input_parts(inputs)
    if plans and plans[-1].version == "v2":
        parts.append(("the zeros v2's dq starts from", dq, "host"))
    if any(plan.pass_name == "backward dQ narrow" for plan in plans):
        parts.append(("v8's float32 sums of dq (scratch)", p.BH * p.Sq * p.d * 4, "device"))
    tiled = [plan for plan in plans if plan.Br]
    return parts + _variant_parts(p, tiled[0] if tiled else None) + _widened_parts(
        p, plans[-1] if plans else None, host, inputs=3 * p.BH * p.Sq + 2 * p.BHkv * p.Sk,
        outputs=p.BH * p.Sq + 2 * p.BHkv * p.Sk)


def _gib(n):
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"


def check_memory(p, parts, where, what="attention"):
    """Raise MemoryError if the arrays ``parts`` (``forward_memory``, ``backward_memory``)
    need more memory than is available: host memory (``available_host_bytes``) for host
    arrays and, on the simulator (``where`` "simulator"), for device arrays too; GPU
    memory (``available_device_bytes``) for device arrays on a GPU. A place that gets less
    than MEMORY_CHECK_MIN_BYTES is not checked. The message names the shapes, the bytes
    needed (and what for) and the bytes available. ``what``: the API function's name."""
    simulator = where == "simulator"
    need = {}
    for part in parts:
        place = "host" if simulator else part[2]
        need[place] = need.get(place, 0) + part[1]
    for place, n in need.items():
        if n < MEMORY_CHECK_MIN_BYTES:
            continue
        have = available_host_bytes() if place == "host" else available_device_bytes()
        if have is None or n <= have:
            continue
        q_shape, k_shape = _shapes(p)
        memory = ("host memory (on the simulator device arrays are host memory too)"
                  if simulator else "host memory" if place == "host" else "GPU memory")
        detail = ", ".join(f"{w} {_gib(b)}" for w, b, pl in parts
                           if ("host" if simulator else pl) == place)
        raise MemoryError(
            f"{what}: q of shape {q_shape} and k, v of shape {k_shape} ({p.dtype}) need "
            f"{n:,} bytes ({_gib(n)}) of {memory}, and {have:,} bytes ({_gib(have)}) are "
            f"available: {detail}. Nothing was allocated; use shorter sequences, fewer "
            f"heads or a smaller batch (or split the batch over several calls)")


# --- Time on the simulator: a warning before a call that will take long --------------------
#
# The CUDA simulator (NUMBA_ENABLE_CUDASIM=1) runs every GPU thread as a Python thread, so
# a shape that takes milliseconds on a GPU can take hours there. ``warn_if_slow`` estimates
# a planned call's time from its plans (``simulator_seconds``) and warns, with the
# estimate, above SIMULATOR_SLOW_S. The model has three terms, from the simulator's costs
# measured for TESTING.md: a cost per thread launched, per multiply-add of the attention's
# matrix products (divided among the threads however a version maps them), and per
# barrier round (cuda.syncthreads) of each block, one round per tile of the loop a block
# runs. The per-operation and per-round costs depend on the interpreter's thread switch
# interval (sys.setswitchinterval): a short interval makes barriers much cheaper.
# Calibration (numba-cuda 0.30.4, Python 3.12, a shared 2-core machine; float32, the
# simulator's defaults: forward v5 and backward v4 with (Br, Bc, TM, TN) = (8, 8, 2, 2)),
# wall seconds of one call, (B, H, Sq, Sk, d):
#
#   switch interval 5 ms (Python's default)     forward   backward
#     (1, 1, 64, 64, 8)                           2.26      3.50
#     (1, 1, 64, 64, 32)                          2.57      5.57
#     (1, 1, 64, 64, 64)                          4.18     11.56
#     (1, 1, 128, 128, 64)                       16.86
#     (1, 1, 256, 256, 8)                        38.2
#     (1, 2, 96, 96, 16) causal                   6.03     13.85
#   switch interval 0.2 ms (what the tests and notebooks set)
#     (1, 1, 64, 64, 8)                           0.46      1.23
#     (1, 1, 64, 64, 64)                          2.48      7.88
#     (1, 1, 256, 256, 8)                         8.17
#     (1, 2, 96, 96, 16) causal                   2.31      5.86
#
# Fitted: 140 us per thread launched; at 5 ms, 3.0 us per multiply-add and 30 ms per
# barrier round of a block; at 0.2 ms, 3.6 us and 4 ms (linear in between, the end
# points outside). The estimates are within a factor of 1.4 of every timing above; a
# warning is about an order of magnitude, so that is enough.

SIMULATOR_SLOW_S = 30.0
SIM_SECONDS_PER_THREAD = 140e-6
# (switch interval s, seconds per multiply-add, seconds per barrier round of a block)
SIM_CALIBRATION = ((2e-4, 3.6e-6, 4e-3), (5e-3, 3.0e-6, 30e-3))


class SimulatorSlowWarning(UserWarning):
    """A call will take long on the CUDA simulator (NUMBA_ENABLE_CUDASIM=1); the message
    says about how long. Silence it with ``warnings.simplefilter("ignore",
    SimulatorSlowWarning)``."""


# Per pass (Plan.pass_name): multiply-adds per visible (query, key) pair and head-dim
# element, and the axis whose tiles a block loops over (one barrier round per tile).
_SIM_WORK = {"forward": (2, "Sk"), "backward dK dV": (4, "Sq"), "backward dQ": (3, "Sk"),
             "backward dK dV dQ": (5, "Sq")}


def visible_fraction(p):
    """The fraction of (query, key) pairs that a causal mask or sliding window leaves
    visible (1.0 without either; masks given as arrays or functions are not counted)."""
    if not (p.upper or p.variant.window) or p.Sq == 0 or p.Sk == 0:
        return 1.0
    rows = np.arange(p.Sq) if p.Sq <= 1 << 20 else np.linspace(0, p.Sq - 1, 1 << 20)
    hi = np.minimum(rows + p.causal_offset, p.Sk - 1) if p.upper else np.full(rows.shape,
                                                                              p.Sk - 1)
    lo = np.maximum(rows + p.window_lo, 0) if p.variant.window else 0
    return float(np.clip(hi - lo + 1, 0, None).mean()) / p.Sk


def simulator_work(p, plans):
    """(threads launched, multiply-adds, barrier rounds over all blocks) of ``plans``
    (Plan objects of one pass) for Problem ``p``: the inputs of ``simulator_seconds``."""
    visible = visible_fraction(p)
    threads = ops = rounds = 0
    for plan in plans:
        blocks = math.prod(plan.grid)
        threads += blocks * math.prod(plan.block)
        if plan.pass_name in ("backward D", "backward dQ zero", "backward dQ narrow"):
            ops += p.BH * p.Sq * p.d                # D = rowsum(dO * O); v8's dQ fills
            continue
        per_pair, axis = _SIM_WORK.get(plan.pass_name, (2, "Sk"))
        ops += per_pair * p.BH * p.Sq * p.Sk * p.d * visible
        if plan.Br:                                 # a tiled kernel: barriers per tile
            tiles = math.ceil(p.Sq / plan.Br) * p.group if axis == "Sq" else math.ceil(
                p.Sk / plan.Bc)
            rounds += blocks * max(tiles * visible, 1)
    return threads, ops, rounds


def simulator_seconds(p, plans, switch_interval=None):
    """Estimated wall time in seconds of running ``plans`` (Plan objects of one pass, e.g.
    ``explain``'s or ``explain_backward``'s) for Problem ``p`` on the CUDA simulator, at
    the thread switch interval ``switch_interval`` (default: sys.getswitchinterval()).
    The model and its calibration: the comment above SIMULATOR_SLOW_S."""
    si = sys.getswitchinterval() if switch_interval is None else switch_interval
    (s0, op0, round0), (s1, op1, round1) = SIM_CALIBRATION
    w = min(max((si - s0) / (s1 - s0), 0.0), 1.0)
    per_op, per_round = op0 + w * (op1 - op0), round0 + w * (round1 - round0)
    threads, ops, rounds = simulator_work(p, plans)
    return threads * SIM_SECONDS_PER_THREAD + ops * per_op + rounds * per_round


def _duration(seconds):
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} minutes"
    return f"{seconds / 3600:.1f} hours"


def warn_if_slow(p, plans, what="attention", stacklevel=3):
    """On the simulator, warn (SimulatorSlowWarning) if ``plans`` will take longer than
    SIMULATOR_SLOW_S for Problem ``p``, with the estimate; return the estimate in
    seconds (None on a GPU or when nothing is launched). ``stacklevel`` 3 points the
    warning at the caller of the API function that calls this."""
    plans = tuple(plans)
    if not plans or plans[0].backend != "simulator" or _empty(p):
        return None
    seconds = simulator_seconds(p, plans)
    if seconds > SIMULATOR_SLOW_S:
        threads, ops, rounds = simulator_work(p, plans)
        q_shape, k_shape = _shapes(p)
        hint = ""
        if sys.getswitchinterval() > 1e-3:
            hint = (f"; sys.setswitchinterval(2e-4) makes barriers cheaper there (about "
                    f"{_duration(simulator_seconds(p, plans, 2e-4))})")
        warnings.warn(
            f"{what} of q {q_shape}, k and v {k_shape} will take about {_duration(seconds)} "
            f"on the CUDA simulator (NUMBA_ENABLE_CUDASIM=1: every GPU thread is a Python "
            f"thread): {threads:,} threads, {ops:,.0f} multiply-adds, {rounds:,.0f} barrier "
            f"rounds{hint}. On the simulator keep shapes small (sequences of a few hundred, "
            f"head dim <= 16), or run on a GPU", SimulatorSlowWarning, stacklevel=stacklevel)
    return seconds
