"""The cases a benchmark covers: shapes, passes, dtypes, implementations, the record each
case yields, and the checks of ``run``'s arguments (ValueError before anything runs).

A shape is (B, H, N, d) or (B, H, Sq, Sk, d); ``normalize_shape`` makes it the second.
"""

import numpy as np

from .library import FORWARD_VERSIONS, explain

PASSES = ("forward", "backward", "fwd+bwd")
DTYPES = ("float16", "bfloat16", "float32", "float64")
SDPA_IMPLS = ("sdpa_efficient", "sdpa_math", "sdpa_flash")
# SDPA's FLASH backend has kernels for float16 and bfloat16 only: timed for those inputs.
SDPA_FLASH_DTYPES = ("float16", "bfloat16")


def sdpa_impls(dtype):
    """The SDPA backends timed for inputs of ``dtype``: EFFICIENT and MATH, and FLASH for
    float16 and bfloat16."""
    return tuple(impl for impl in SDPA_IMPLS
                 if impl != "sdpa_flash" or dtype in SDPA_FLASH_DTYPES)

# The shapes of docs/performance.md's table against SDPA: what the command times on a GPU
# when no --shapes are given.
GPU_DEFAULT_SHAPES = ((2, 16, 4096, 64), (2, 16, 4096, 128), (1, 16, 16384, 64))
# Under the simulator: one tiny problem (a simulated thread costs about 150 us).
SIM_DEFAULT_SHAPES = ((1, 1, 32, 8),)

# The NumPy check (``agreement.NumpyOracle``) computes dense float64 (Sq, Sk) matrices for
# one (batch, head) slice: at its peak numbaflash.reference holds about 4.2 of them in the
# forward and 6.3 in the backward (measured with tracemalloc at Sq = Sk = 2048).
REFERENCE_DENSE_MATRICES = {"forward": 5, "backward": 7}


def parse_shape(text):
    """'2x16x4096x64' -> (2, 16, 4096, 4096, 64); 'BxHxSqxSkxd' for different lengths.

    Raises ValueError naming what is wrong."""
    parts = text.lower().split("x")
    try:
        numbers = tuple(int(p) for p in parts)
    except ValueError:
        raise ValueError(f"shape {text!r} is not numbers separated by 'x' (e.g. 2x16x4096x64 "
                         f"for B x H x N x d, or 1x8x1000x3000x64 for B x H x Sq x Sk x d)") from None
    return normalize_shape(numbers)


def normalize_shape(shape):
    """(B, H, N, d) or (B, H, Sq, Sk, d) -> (B, H, Sq, Sk, d); ValueError if malformed."""
    try:
        shape = tuple(shape)
    except TypeError:
        raise ValueError(f"a shape is a tuple (B, H, N, d) or (B, H, Sq, Sk, d); got "
                         f"{shape!r}") from None
    if len(shape) not in (4, 5):
        raise ValueError(f"a shape has 4 numbers (B, H, N, d) or 5 (B, H, Sq, Sk, d); got "
                         f"{len(shape)}: {shape!r}")
    if not all(isinstance(n, (int, np.integer)) and not isinstance(n, bool) for n in shape):
        raise ValueError(f"shape entries must be integers; got {shape!r}")
    if min(shape) < 1:
        raise ValueError(f"shape entries must be at least 1; got {shape!r}")
    if len(shape) == 4:
        B, H, N, d = shape
        shape = (B, H, N, N, d)
    return tuple(int(n) for n in shape)


def host_bytes_needed(shape, dtype, *, simulator, numpy_check, backward):
    """Host memory a case of ``run`` takes at its peak when the inputs are NumPy arrays
    (no PyTorch with CUDA), in bytes; an estimate, for refusing a shape up front.

    The inputs q, k, v, dout in ``dtype`` and one of them in float64 while it is drawn;
    under the simulator also the device copies and the outputs (its device memory is the
    host's); with ``numpy_check`` the dense float64 reference of one (batch, head) slice
    (``REFERENCE_DENSE_MATRICES``).
    """
    B, H, Sq, Sk, d = shape
    itemsize = np.dtype(dtype).itemsize
    inputs = B * H * (2 * Sq + 2 * Sk) * d * itemsize
    need = inputs + B * H * max(Sq, Sk) * d * 8
    if simulator:
        need += 2 * inputs                 # device copies; out, dq, dk, dv the same sizes
    if numpy_check:
        dense = REFERENCE_DENSE_MATRICES["backward" if backward else "forward"]
        need += dense * Sq * Sk * 8
    return need


def host_bytes_available():
    """MemAvailable from /proc/meminfo in bytes, or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024           # the file says kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_host_memory(shapes, dtype, *, simulator, numpy_check, backward):
    """ValueError naming the first shape whose case would not fit in the host's available
    memory (``host_bytes_needed``); nothing is checked where that cannot be read."""
    available = host_bytes_available()
    if available is None:
        return
    for shape in shapes:
        need = host_bytes_needed(shape, dtype, simulator=simulator, numpy_check=numpy_check,
                                 backward=backward)
        if need > available:
            what = ("the inputs and the dense float64 reference of one (batch, head) slice"
                    if numpy_check else "the inputs")
            raise ValueError(f"shape {shape} needs about {need / 2**30:.1f} GiB of host memory "
                             f"({what}); {available / 2**30:.1f} GiB are available: give a "
                             f"smaller shape")


def _check_arguments(shapes, causal, dtype, passes, versions, repeats, warmup):
    """Validate ``run``'s arguments before anything runs; ValueError says which is wrong."""
    if isinstance(shapes, (str, bytes)) or not hasattr(shapes, "__iter__"):
        raise ValueError(f"shapes must be a list of (B, H, N, d) or (B, H, Sq, Sk, d) tuples; "
                         f"got {shapes!r}")
    shapes = list(shapes)
    if shapes and all(isinstance(n, (int, np.integer)) for n in shapes):
        raise ValueError(f"shapes must be a list of shapes; got one shape {tuple(shapes)}: "
                         f"pass [{tuple(shapes)}]")
    shapes = [normalize_shape(s) for s in shapes]
    if not shapes:
        raise ValueError("shapes is empty: give at least one (B, H, N, d)")
    if isinstance(causal, bool):
        causal = (causal,)
    causal = tuple(causal)
    if not causal or not all(isinstance(c, bool) for c in causal):
        raise ValueError(f"causal must be a bool or a tuple of bools, e.g. (False, True); "
                         f"got {causal!r}")
    try:
        dtype_name = np.dtype(dtype).name
    except TypeError:
        dtype_name = None
    if dtype_name not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}; got {dtype!r}")
    dtype = dtype_name
    if isinstance(passes, str):
        passes = (passes,)
    passes = tuple(passes)
    bad = [p for p in passes if p not in PASSES]
    if bad or not passes:
        raise ValueError(f"passes must be a non-empty subset of {PASSES}; got {passes!r}")
    if versions is None or isinstance(versions, str):
        versions = (versions,)
    versions = tuple(versions)
    bad = [v for v in versions if v is not None and v not in FORWARD_VERSIONS]
    if bad or not versions:
        raise ValueError(f"versions must be forward versions {FORWARD_VERSIONS} or None (the "
                         f"default); got {versions!r}")
    for name, n, low in (("repeats", repeats, 1), ("warmup", warmup, 0)):
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < low:
            raise ValueError(f"{name} must be an integer >= {low}; got {n!r}")
    # Let numbaflash itself refuse what it cannot run (head dim, batch * heads), by shape.
    for B, H, Sq, Sk, d in shapes:
        q = _Spec((B, H, Sq, d), dtype)
        kv = _Spec((B, H, Sk, d), dtype)
        try:
            explain(q, kv, kv)
        except (ValueError, TypeError) as e:
            raise ValueError(f"shape {(B, H, Sq, Sk, d)}: {e}") from None
    return shapes, causal, dtype, passes, versions


class _Spec:
    """Something with a shape and a dtype: enough for ``numbaflash.explain``."""

    def __init__(self, shape, dtype):
        self.shape, self.dtype = shape, np.dtype(dtype)


# ---------------------------------------------------------------------------------------
# Records: one per (shape, causal, dtype, pass, implementation)


def _impl_name(version):
    return "numbaflash" if version is None else f"numbaflash_{version}"


def _base_record(shape, causal, dtype, what, impl):
    B, H, Sq, Sk, d = shape
    return {"B": B, "H": H, "Sq": Sq, "Sk": Sk, "d": d, "causal": causal, "dtype": dtype,
            "what": what, "impl": impl, "kernel": None, "ms": None, "tflops": None,
            "vs_sdpa": None, "extra_mib": None, "max_err": None, "bound": None, "ok": None,
            "checked_against": None, "check": None, "timer": None, "repeats": None,
            "warmup": None, "note": None}
