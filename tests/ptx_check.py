"""Compile kernels to PTX for sm_90 (H100/H200) without a GPU, and optionally link them.

The simulator never compiles anything, so the CI suite would not notice a kernel that
the real compiler rejects (an unsupported construct, a float64 literal in a float32
kernel, more static shared memory than a block may have). This script compiles each
kernel in ENTRIES with ``numba.cuda.compile_ptx`` (NVVM, from the CUDA wheels), then, if
asked, links the PTX with nvJitLink for sm_90 and reads ptxas's report: registers,
stack frame, spill stores/loads, shared memory.

It must run with NUMBA_ENABLE_CUDASIM=0 (the simulator's numba.cuda has no compiler), so
tests/test_ptx.py runs it in a subprocess:

    NUMBA_ENABLE_CUDASIM=0 python tests/ptx_check.py [--group forward] [--match f32] [--link]

It prints one JSON object per kernel on stdout (lines starting with "PTXCHECK "):
name, group, ok, error, ptx_bytes, f64_lines (for kernels that must not use float64),
and with --link: registers, stack_bytes, spill_stores, spill_loads, smem_bytes, log.

Adding kernels: write a function that returns a list of ``Entry`` and add it to GROUPS
(e.g. ``GROUPS["backward"] = backward_entries``). An Entry holds a name, a zero-argument
callable that returns the @cuda.jit dispatcher (the cached factory call), the argument
types, and whether its PTX must be free of float64 (float16/float32 kernels).
"""

import argparse
import itertools
import json
import os
import re
import sys
import traceback
from dataclasses import dataclass
from typing import Callable

if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0"):
    sys.exit("ptx_check.py needs NUMBA_ENABLE_CUDASIM=0: the simulator cannot compile to PTX")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numba  # noqa: E402
from numba import cuda  # noqa: E402
from numba.cuda import dispatcher as cuda_dispatcher  # noqa: E402

from ptx_fingerprint import fingerprint  # noqa: E402

CC = (9, 0)
ARCH = "sm_90"


class _FakeDevice:
    compute_capability = CC


if not cuda.is_available():
    # Without a GPU (CI), compile_ptx works for a kernel alone, but a kernel that calls a
    # @cuda.jit(device=True) function (forward's _write_row) fails: while typing the call,
    # numba-cuda's dispatcher asks the *current device* for its compute capability, which
    # initialises the CUDA driver ("CUDA driver library cannot be found"). Answer that
    # question with the target we compile for; nothing else in this process touches a device.
    cuda_dispatcher.get_current_device = lambda: _FakeDevice()

from numbaflash.kernels import forward  # noqa: E402
from numbaflash.kernels.plan import DYNAMIC_SHARED_MEM_LIMIT  # noqa: E402

F = {version: forward.module(version) for version in forward.VERSIONS}   # the forward ladder


@dataclass
class Entry:
    name: str
    group: str
    build: Callable           # () -> the @cuda.jit dispatcher (a cached factory call)
    signature: tuple          # numba types of the kernel's arguments
    no_f64: bool              # the PTX must contain no .f64 instruction or register


def array(dtype, ndim):
    return numba.types.Array(numba.from_dtype(dtype), ndim, "C")


def forward_signature(dtype, acc):
    """forward_v3(Q, K, V, O, L, softmax_scale, causal_offset)."""
    t3 = array(dtype, 3)
    return (t3, t3, t3, t3, array(acc, 2), numba.from_dtype(acc), numba.int64)


def variant_signature(acc, mask_dtype="bool"):
    """What follows causal_offset in kernels that take variants (launcher.variant_arguments):
    window_lo, Hq, group, softcap, slopes (2D), attn_mask (4D, bool or a float dtype),
    tiles (3D bool, the table of visible tiles), then dropout's seed_lo, seed_hi,
    keep_threshold (uint32) and keep_scale, and seqs (2D int32, a packed batch's
    sequences)."""
    import numpy as np
    i64, u32 = numba.int64, numba.uint32
    return (i64, i64, i64, numba.from_dtype(acc), array(acc, 2), array(np.dtype(mask_dtype), 4),
            array(np.dtype(np.bool_), 3), u32, u32, u32, numba.from_dtype(acc),
            array(np.dtype(np.int32), 2))


def forward_variant_signature(dtype, acc, mask_dtype="bool"):
    """forward_v1 / forward_v2(Q, K, V, O, L, softmax_scale, causal_offset, *variant)."""
    return forward_signature(dtype, acc) + variant_signature(acc, mask_dtype)


# Forward versions checked in a group of their own instead of "forward" (the version ->
# its group): forward_entries leaves them out.
OWN_GROUP = {"v10": "forward_v10"}


def forward_entries():
    """Every forward version x float16/float32/float64 x causal off/on x d in 1, 64, 128,
    256, with each version's default tiles, where the version supports the combination
    (v3: float16/float32 and d <= 128); v4 and v5 at d in 1, 59, 64, 128."""
    import numpy as np
    out = []
    for dtype in ("float16", "float32", "float64"):
        acc = "float64" if dtype == "float64" else "float32"
        sig = forward_signature(np.dtype(dtype), np.dtype(acc))
        vsig = forward_variant_signature(np.dtype(dtype), np.dtype(acc))

        def sig_of(version, sig=sig, vsig=vsig):
            """A version's arguments: with the variant ones if it takes variants."""
            return vsig if F[version].VARIANTS else sig
        for d in (1, 64, 128, 256):
            for causal in (False, True):
                tag = f"{dtype}-d{d}-{'causal' if causal else 'full'}"
                out.append(Entry(f"forward_v1-{tag}", "forward",
                                 lambda d=d, c=causal, a=acc: F["v1"].make_forward_v1(d, c, a),
                                 vsig, dtype != "float64"))
                Br, Bc = F["v2"].default_forward_tiles(d, acc)
                out.append(Entry(f"forward_v2-{tag}-tiles{Br}x{Bc}", "forward",
                                 lambda Br=Br, Bc=Bc, d=d, c=causal, a=acc:
                                 F["v2"].make_forward_v2(Br, Bc, d, c, a),
                                 vsig, dtype != "float64"))
                if "v3" in forward.VERSIONS and acc == "float32" and d <= F["v3"].V3_MAX_HEAD_DIM:
                    # v3 (tensor cores, GPU only): float32 accumulation, d <= 128
                    Br, Bc = F["v3"].default_v3_tiles(d)
                    out.append(Entry(f"forward_v3-{tag}-tiles{Br}x{Bc}", "forward",
                                     lambda Bc=Bc, d=d, c=causal: F["v3"].make_forward_v3(Bc, d, c),
                                     sig_of("v3"), True))
        # v4 (register-blocked SIMT): its own tile rule (GPU candidates; this script runs
        # without the simulator), d in 1, 59 (padded to the thread grid), 64, 128; eight
        # entries per dtype like v1 and v2 (tests/test_ptx.py counts them)
        for d in (1, 59, 64, 128):
            Br, Bc, TM, TN = F["v4"].default_v4_tiles(d, acc)
            for causal in (False, True):
                tag = f"{dtype}-d{d}-{'causal' if causal else 'full'}"
                out.append(Entry(f"forward_v4-{tag}-tiles{Br}x{Bc}-thread{TM}x{TN}", "forward",
                                 lambda t=(Br, Bc, TM, TN), d=d, c=causal, a=acc:
                                 F["v4"].make_forward_v4(*t, d, c, a),
                                 sig_of("v4"), dtype != "float64"))
        # v5 (v4 with dynamic shared memory): its own tile rule, the same head dims; ptxas's
        # "smem" shows static shared memory only (1 KB that sm_90 reserves per block): v5's
        # tiles are dynamic, v5_dynamic_shared.v5_shared_bytes of them at launch
        if "v5" in forward.VERSIONS:
            for d in (1, 59, 64, 128):
                Br, Bc, TM, TN = F["v5"].default_v5_tiles(d, acc)
                for causal in (False, True):
                    tag = f"{dtype}-d{d}-{'causal' if causal else 'full'}"
                    out.append(Entry(f"forward_v5-{tag}-tiles{Br}x{Bc}-thread{TM}x{TN}",
                                     "forward", lambda t=(Br, Bc, TM, TN), d=d, c=causal, a=acc:
                                     F["v5"].make_forward_v5(*t, d, c, a),
                                     sig_of("v5"), dtype != "float64"))
        # v6 (tensor cores, GPU only): float32 accumulation, d <= 128, its own tile rule;
        # d = 59 pads to the mma's k, d = 128 stages Qi in shared memory. ptxas's "smem"
        # is static only (bad, the 1 KB sm_90 reserves); the tiles are dynamic
        # v8 (v6 reordered) the same, with the dispatcher's chunk; v9 (v8 with asynchronous
        # K/V copies) too, float32 inputs only
        v8 = lambda Br, Bc, d, c: F["v8"].make_forward_v8(Br, Bc, d, c, F["v8"].v8_chunk(d, Bc))
        v9 = lambda Br, Bc, d, c: F["v9"].make_forward_v9(Br, Bc, d, c, F["v8"].v8_chunk(d, Bc))
        for ver, factory in (("v6", F["v6"].make_forward_v6), ("v8", v8), ("v9", v9)):
            if ver not in forward.VERSIONS or acc != "float32" or (ver == "v9"
                                                               and dtype != "float32"):
                continue
            for d in (1, 59, 64, 128):
                Br, Bc = F["v6"].default_v6_tiles(d, ver, F[ver].v9_shared_bytes if ver == "v9" else F["v6"].v6_shared_bytes)
                for causal in (False, True):
                    tag = f"{dtype}-d{d}-{'causal' if causal else 'full'}"
                    out.append(Entry(f"forward_{ver}-{tag}-tiles{Br}x{Bc}", "forward",
                                     lambda t=(Br, Bc), d=d, c=causal, f=factory:
                                     f(*t, d, c), sig_of(ver), True))
        # v7 (float16 tensor cores, GPU only): float16 inputs only, d <= 128, its own rule
        if "v7" in forward.VERSIONS and dtype == "float16":
            for d in (1, 59, 64, 128):
                Br, Bc = F["v7"].tiles_within(d, DYNAMIC_SHARED_MEM_LIMIT)
                for causal in (False, True):
                    tag = f"{dtype}-d{d}-{'causal' if causal else 'full'}"
                    out.append(Entry(f"forward_v7-{tag}-tiles{Br}x{Bc}", "forward",
                                     lambda t=(Br, Bc), d=d, c=causal:
                                     F["v7"].make_forward_v7(*t, d, c), sig_of("v7"), True))
    assert ({e.name.split("-")[0] for e in out}
            == {f"forward_{v}" for v in forward.VERSIONS if v not in OWN_GROUP}), \
        "a forward version is missing from ptx_check.forward_entries"
    return out


def backward_signatures(dtype, acc):
    """The backward kernels' argument types: (preprocess, dkdv_v1, dq_v1, dkdv_dq_v2).

    backward_preprocess(dO, O, D); backward_dkdv_v1(Q, K, V, dO, L, D, dK, dV, scale,
    offset, *variant); backward_dq_v1(Q, K, V, dO, L, D, dQ, scale, offset, *variant)
    (variant_signature); backward_dkdv_dq_v2(Q,
    K, V, dO, L, D, dQ, dK, dV, scale, offset), where dQ is in the accumulator dtype.
    """
    t3, a2, a3 = array(dtype, 3), array(acc, 2), array(acc, 3)
    scale, offset = numba.from_dtype(acc), numba.int64
    extra = variant_signature(acc)
    return ((t3, t3, a2),
            (t3, t3, t3, t3, a2, a2, t3, t3, scale, offset) + extra,
            (t3, t3, t3, t3, a2, a2, t3, scale, offset) + extra,
            (t3, t3, t3, t3, a2, a2, a3, t3, t3, scale, offset))


def backward_v3_signatures(dtype, acc):
    """(dkdv_v3, dq_v3): v1's arguments without the variant ones (v3 is plain attention)."""
    _, dkdv, dq, _ = backward_signatures(dtype, acc)
    n = len(variant_signature(acc))
    return dkdv[:-n], dq[:-n]


def backward_entries():
    """Every backward kernel x float16/float32/float64 x causal off/on (the preprocessing
    kernel has no mask) x d in 1, 64, 128, 256, with the default backward tiles (v3: its
    own rule, bwd_v3.default_backward_v3_tiles; v4: bwd_v4.default_backward_v4_tiles, both
    for the GPU);
    v2 only where it runs (float32, float64); v3 and v4 at d = 1 and 256 in float32 only."""
    import numpy as np

    from numbaflash.kernels import backward as bwd
    from numbaflash.kernels.backward import preprocess as bwd_pre
    from numbaflash.kernels.backward import v1_two_kernels as bwd_v1
    from numbaflash.kernels.backward import v2_atomic_dq as bwd_v2
    from numbaflash.kernels.backward import v3_register_blocked as bwd_v3
    from numbaflash.kernels.backward import v4_dynamic_shared as bwd_v4
    from numbaflash.kernels.backward import v5_tensor_cores as bwd_v5
    from numbaflash.kernels.backward import v6_split_pairs as bwd_v6
    out = []
    for dtype in ("float16", "float32", "float64"):
        acc = "float64" if dtype == "float64" else "float32"
        pre, dkdv, dq, v2 = backward_signatures(np.dtype(dtype), np.dtype(acc))
        no_f64 = dtype != "float64"
        for d in (1, 64, 128, 256):
            out.append(Entry(f"backward_preprocess-{dtype}-d{d}", "backward",
                             lambda d=d, a=acc: bwd_pre.make_backward_preprocess(d, a), pre,
                             no_f64))
            Br, Bc = bwd_v1.default_backward_tiles(d, acc)
            for causal in (False, True):
                tag = f"{dtype}-d{d}-{'causal' if causal else 'full'}-tiles{Br}x{Bc}"
                args = dict(Br=Br, Bc=Bc, d=d, c=causal, a=acc)
                out.append(Entry(f"backward_dkdv_v1-{tag}", "backward",
                                 lambda kw=args: bwd_v1.make_backward_dkdv_v1(
                                     kw["Br"], kw["Bc"], kw["d"], kw["c"], kw["a"]),
                                 dkdv, no_f64))
                out.append(Entry(f"backward_dq_v1-{tag}", "backward",
                                 lambda kw=args: bwd_v1.make_backward_dq_v1(
                                     kw["Br"], kw["Bc"], kw["d"], kw["c"], kw["a"]),
                                 dq, no_f64))
                if dtype != "float16":
                    out.append(Entry(f"backward_dkdv_dq_v2-{tag}", "backward",
                                     lambda kw=args: bwd_v2.make_backward_dkdv_dq_v2(
                                         kw["Br"], kw["Bc"], kw["d"], kw["c"], kw["a"]),
                                     v2, no_f64))
            # v3 (register-blocked SIMT): its own tile rule (GPU candidates; this script
            # runs without the simulator), the same signatures as v1's kernels; d = 1 and
            # 256 in float32 only (each v3 kernel takes about 2 s to compile here)
            if dtype != "float32" and d not in (64, 128):
                continue
            t = bwd_v3.default_backward_v3_tiles(d, acc, "gpu")
            dkdv3, dq3 = backward_v3_signatures(np.dtype(dtype), np.dtype(acc))

            def bsig(version, kind, plain=(dkdv3, dq3), full=(dkdv, dq)):
                """A backward kernel's arguments: with the variant ones if its version takes
                variants."""
                sigs = full if bwd.module(version).VARIANTS else plain
                return sigs[0] if kind == "dkdv" else sigs[1]
            for causal in (False, True):
                tag = (f"{dtype}-d{d}-{'causal' if causal else 'full'}-tiles{t[0]}x{t[1]}"
                       f"-thread{t[2]}x{t[3]}")
                out.append(Entry(f"backward_dkdv_v3-{tag}", "backward",
                                 lambda t=t, d=d, c=causal, a=acc:
                                 bwd_v3.make_backward_dkdv_v3(*t, d, c, a), bsig("v3", "dkdv"),
                                 no_f64))
                out.append(Entry(f"backward_dq_v3-{tag}", "backward",
                                 lambda t=t, d=d, c=causal, a=acc:
                                 bwd_v3.make_backward_dq_v3(*t, d, c, a), bsig("v3", "dq"),
                                 no_f64))
            # v4 (v3 with dynamic shared memory): its own tile rule, the same head dims and
            # signatures as v3; ptxas's "smem" shows static shared memory only (the 1 KB
            # sm_90 reserves per block): v4's arrays are dynamic,
            # bwd_v4.dkdv_v4_shared_bytes / dq_v4_shared_bytes of them at launch
            if "v4" in bwd.VERSIONS:
                t = bwd_v4.default_backward_v4_tiles(d, acc, "gpu")
                for causal in (False, True):
                    tag = (f"{dtype}-d{d}-{'causal' if causal else 'full'}-tiles{t[0]}x{t[1]}"
                           f"-thread{t[2]}x{t[3]}")
                    out.append(Entry(f"backward_dkdv_v4-{tag}", "backward",
                                     lambda t=t, d=d, c=causal, a=acc:
                                     bwd_v4.make_backward_dkdv_v4(*t, d, c, a),
                                     bsig("v4", "dkdv"), no_f64))
                    out.append(Entry(f"backward_dq_v4-{tag}", "backward",
                                     lambda t=t, d=d, c=causal, a=acc:
                                     bwd_v4.make_backward_dq_v4(*t, d, c, a), bsig("v4", "dq"),
                                     no_f64))
            # v5 (tensor cores, GPU only): float32 accumulation (float16 and float32
            # inputs), d <= 128, its own tile rule (bwd_v5.default_backward_v5_tiles;
            # v6: tiles and pairs per kernel, bwd_v6.default_backward_v6_plan; v10: v6's
            # kernels accumulating in the mma, v6's plan)
            for ver in ("v5", "v6", "v10"):
                if ver not in bwd.VERSIONS or acc != "float32" or d > bwd_v5.BWD_V5_MAX_HEAD_DIM:
                    continue
                v6_family = ver in ("v6", "v10")
                for causal, kind in itertools.product((False, True), ("dkdv", "dq")):
                    Br, Bc, pairs = (bwd_v6.default_backward_v6_plan(d, causal, dtype, "gpu")[kind]
                                     if v6_family
                                     else bwd_v5.default_backward_v5_tiles(d, "gpu", ver) + (False,))
                    tag = (f"{dtype}-d{d}-{'causal' if causal else 'full'}-tiles{Br}x{Bc}"
                           + ("-pairs" if pairs else ""))
                    make = getattr(bwd.module(ver), f"make_backward_{kind}_{ver}")
                    # v6, v10: the chunk the dispatcher gives it, and pairs or not
                    extra = ((bwd_v6.backward_v6_chunk(kind, Br, Bc), pairs) if v6_family
                             else ())
                    out.append(Entry(f"backward_{kind}_{ver}-{tag}", "backward",
                                     lambda m=make, t=(Br, Bc, d, causal) + extra: m(*t),
                                     bsig(ver, kind), True))
    assert {e.name.split("-")[0] for e in out} >= {f"backward_{k}_{v}" for k in ("dkdv", "dq")
                                                   for v in ("v3", "v4", "v5", "v6")}
    return out


@cuda.jit(device=True)
def _relative_bias(score, b, h, q_idx, kv_idx):
    """A user score_mod for the check (float64 constants: user code may use them)."""
    return score - 0.25 * abs(q_idx - kv_idx)


@cuda.jit(device=True)
def _relative_bias_grad(score, b, h, q_idx, kv_idx):
    return 1.0


@cuda.jit(device=True)
def _documents(b, h, q_idx, kv_idx):
    return q_idx // 64 == kv_idx // 64


def variant_entries():
    """Forward v1, v2 and backward dK/dV, dQ v1 specialised for variants
    (kernels/variants.py), float16/float32/float64 at d = 64 and float32 at d = 128, default
    tiles, and the tile-table kernel of the variants that need one:
      builtins: causal + window left + softcap + ALiBi + boolean attn_mask (no float64 in
                float16/float32 kernels);
      bias:     an additive attn_mask in the input dtype (no float64 either);
      usermods: a user score_mod (+ grad) and mask_mod (they may use float64 constants,
                so only compiling and linking is checked)."""
    import numpy as np

    from numbaflash.kernels import backward as bwd
    from numbaflash.kernels import variants as variants_mod
    from numbaflash.kernels.backward import v1_two_kernels as backward_v1
    from numbaflash.kernels.backward.v1_two_kernels import default_backward_tiles
    from numbaflash.kernels.variants import Variant
    variants = {
        "builtins": (True, Variant(window=True, dropout=True, softcap=True, alibi=True, mask="bool"),
                     "bool"),
        "bias": (False, Variant(mask="bias"), None),
        "usermods": (True, Variant(score_mod=_relative_bias, score_mod_grad=_relative_bias_grad,
                                   mask_mod=_documents), "bool"),
    }
    out = []
    for dtype in ("float16", "float32", "float64"):
        acc = "float64" if dtype == "float64" else "float32"
        dt, at = np.dtype(dtype), np.dtype(acc)
        for d in ((64, 128) if dtype == "float32" else (64,)):   # (d = 128 once: CI time)
            for vname, (causal, variant, mask_dtype) in variants.items():
                mask_dtype = mask_dtype or dtype
                no_f64 = dtype != "float64" and vname != "usermods"
                extra = variant_signature(at, mask_dtype)
                tag = f"{dtype}-d{d}-{vname}"
                kw = dict(d=d, c=causal, a=acc, v=variant)
                fsig = forward_signature(dt, at) + extra
                out.append(Entry(f"forward_v1-{tag}", "variants",
                                 lambda kw=kw: F["v1"].make_forward_v1(kw["d"], kw["c"], kw["a"],
                                                                   kw["v"]), fsig, no_f64))
                Br, Bc = F["v2"].default_forward_tiles(d, acc)
                out.append(Entry(f"forward_v2-{tag}-tiles{Br}x{Bc}", "variants",
                                 lambda kw=kw, Br=Br, Bc=Bc: F["v2"].make_forward_v2(
                                     Br, Bc, kw["d"], kw["c"], kw["a"], kw["v"]), fsig, no_f64))
                Br, Bc = default_backward_tiles(d, acc)
                _, dkdv, dq, _ = backward_signatures(dt, at)
                n_variant = len(variant_signature(at))     # what backward_signatures appended
                dkdv = dkdv[:-n_variant] + extra
                dq = dq[:-n_variant] + extra
                out.append(Entry(f"backward_dkdv_v1-{tag}-tiles{Br}x{Bc}", "variants",
                                 lambda kw=kw, Br=Br, Bc=Bc: backward_v1.make_backward_dkdv_v1(
                                     Br, Bc, kw["d"], kw["c"], kw["a"], kw["v"]), dkdv, no_f64))
                out.append(Entry(f"backward_dq_v1-{tag}-tiles{Br}x{Bc}", "variants",
                                 lambda kw=kw, Br=Br, Bc=Bc: backward_v1.make_backward_dq_v1(
                                     Br, Bc, kw["d"], kw["c"], kw["a"], kw["v"]), dq, no_f64))
                if d == 64:
                    out += fast_variant_entries(dtype, acc, tag, variant, causal, fsig, dkdv,
                                                dq, no_f64)
                if variant.tile_table and d == 64:      # (the table does not depend on d)
                    i64 = numba.int64
                    tsig = (array(np.dtype(np.bool_), 3), i64, i64, i64, i64, i64,
                            array(np.dtype(mask_dtype), 4))
                    out.append(Entry(f"tile_table-{dtype}-{vname}-tiles{Br}x{Bc}", "variants",
                                     lambda kw=kw, Br=Br, Bc=Bc: variants_mod.make_tile_table(
                                         Br, Bc, kw["c"], kw["a"], kw["v"]), tsig, no_f64))
    return out


def fast_variant_entries(dtype, acc, tag, variant, causal, fsig, dkdv, dq, no_f64):
    """The fast versions that take variants (forward v5 to v9, backward v4, v6 and v10 (in
    float32), each where its module says VARIANTS and it takes ``dtype``), at d = 64 with
    their GPU tile rules, specialised for ``variant``."""
    from numbaflash.kernels import backward as bwd
    from numbaflash.kernels.backward import v4_dynamic_shared as bwd_v4
    from numbaflash.kernels.backward import v6_split_pairs as bwd_v6
    d, out = 64, []
    if acc != "float32":
        return out
    if F["v5"].VARIANTS:
        t = F["v5"].default_v5_tiles(d, acc)
        out.append(Entry(f"forward_v5-{tag}-tiles{t[0]}x{t[1]}-thread{t[2]}x{t[3]}", "variants",
                         lambda t=t: F["v5"].make_forward_v5(*t, d, causal, acc, variant=variant),
                         fsig, no_f64))
    if F["v7"].VARIANTS and dtype == "float16":
        Br, Bc = F["v7"].tiles_within(d, DYNAMIC_SHARED_MEM_LIMIT)
        out.append(Entry(f"forward_v7-{tag}-gqa-tiles{Br}x{Bc}", "variants",
                         lambda t=(Br, Bc): F["v7"].make_forward_v7(*t, d, causal, gqa=True,
                                                                    variant=variant),
                         fsig, no_f64))
    for ver in ("v8", "v9"):
        if not F[ver].VARIANTS or (ver == "v9" and dtype != "float32"):
            continue
        shared = F["v9"].v9_shared_bytes if ver == "v9" else F["v6"].v6_shared_bytes
        Br, Bc = F["v6"].default_v6_tiles(d, ver, shared)
        make = getattr(F[ver], f"make_forward_{ver}")
        out.append(Entry(f"forward_{ver}-{tag}-gqa-tiles{Br}x{Bc}", "variants",
                         lambda t=(Br, Bc), m=make: m(*t, d, causal, F["v8"].v8_chunk(d, t[1]),
                                                      gqa=True, variant=variant),
                         fsig, no_f64))
    if bwd.module("v4").VARIANTS:
        t = bwd_v4.default_backward_v4_tiles(d, acc, "gpu")
        for kind, sig in (("dkdv", dkdv), ("dq", dq)):
            make = getattr(bwd_v4, f"make_backward_{kind}_v4")
            out.append(Entry(f"backward_{kind}_v4-{tag}-tiles{t[0]}x{t[1]}", "variants",
                             lambda m=make, t=t: m(*t, d, causal, acc, variant=variant), sig,
                             no_f64))
    # v6, and v10 (v6's kernels accumulating in the mma) in float32 only
    for ver in ("v6", "v10"):
        if (ver not in bwd.VERSIONS or not bwd.module(ver).VARIANTS
                or (ver == "v10" and dtype != "float32")):
            continue
        for kind, sig in (("dkdv", dkdv), ("dq", dq)):
            Br, Bc, pairs = bwd_v6.default_backward_v6_plan(d, causal, dtype, "gpu")[kind]
            make = getattr(bwd.module(ver), f"make_backward_{kind}_{ver}")
            chunk = bwd_v6.backward_v6_chunk(kind, Br, Bc)
            # with GQA's loop over the group's query heads (a compile-time flag of v6)
            out.append(Entry(f"backward_{kind}_{ver}-{tag}-gqa-tiles{Br}x{Bc}", "variants",
                             lambda m=make, t=(Br, Bc, d, causal, chunk, pairs):
                             m(*t, gqa=True, variant=variant), sig, no_f64))
    return out


def decode_entries():
    """The decoding kernels (kernels/decode/): split_kv x float16/float32/float64 x d in
    8, 64, 128, 256 (the rows per block of a GQA group of 8 and of one row), plain, causal,
    and causal with a window, softcap and ALiBi, with one element a load and (float16,
    float32: "-wide") 8 bytes a load; split_kv_mma and split_kv_mma_t (float16) at d = 40,
    64, 128, the same three variants, and split_kv_mma with three stages at d = 128, plain
    and with the three variants together; combine, combine_batched and append per dtype."""
    import numpy as np
    from numbaflash.kernels.decode import (append, combine, combine_batched, split_kv,
                                           split_kv_mma, split_kv_mma_t)
    from numbaflash.kernels.variants import PLAIN, Variant
    i64 = numba.int64
    full = Variant(window=True, softcap=True, alibi=True)
    out = []
    for dtype in ("float16", "float32", "float64"):
        acc = "float64" if dtype == "float64" else "float32"
        dt, at = np.dtype(dtype), np.dtype(acc)
        a = numba.from_dtype(at)
        sig = (array(dt, 4), array(dt, 1), array(dt, 1), array(np.dtype(np.int32), 1), i64,
               array(dt, 3), array(at, 2), array(at, 4), array(at, 3), a, i64, i64, i64, i64,
               a, array(at, 2), array(np.dtype(np.bool_), 4)) + (i64,) * 7
        no_f64 = dtype != "float64"
        for d in (8, 64, 128, 256):
            for rows_needed in (1, 8):
                rows = split_kv.rows_per_block(rows_needed, d)
                for causal, variant, what in ((False, PLAIN, "full"), (True, PLAIN, "causal"),
                                              (True, full, "causal-window-softcap-alibi")):
                    out.append(Entry(f"split_kv-{dtype}-d{d}-rows{rows}-{what}", "decode",
                                     lambda d=d, r=rows, c=causal, ac=acc, v=variant:
                                     split_kv.make_split_kv(d, r, c, ac, v), sig, no_f64))
                    # the 8-byte loads, which aligned caches get (split_kv.load_width)
                    vec = split_kv.wide_vec(dt.itemsize)
                    if vec > 1 and d % vec == 0:
                        out.append(Entry(
                            f"split_kv-{dtype}-d{d}-rows{rows}-{what}-wide", "decode",
                            lambda d=d, r=rows, c=causal, ac=acc, v=variant, w=vec:
                            split_kv.make_split_kv(d, r, c, ac, v, vec=w), sig, no_f64))
        if dtype == "float16":
            # the tensor-core decode kernel (float16 and bfloat16 caches, d a multiple of 8)
            for d in (40, 64, 128):
                for causal, variant, what in ((False, PLAIN, "full"), (True, PLAIN, "causal"),
                                              (True, full, "causal-window-softcap-alibi")):
                    out.append(Entry(f"split_kv_mma-{dtype}-d{d}-{what}", "decode",
                                     lambda d=d, c=causal, v=variant:
                                     split_kv_mma.make_split_kv_mma(d, c, v), sig, no_f64))
                    out.append(Entry(f"split_kv_mma_t-{dtype}-d{d}-{what}", "decode",
                                     lambda d=d, c=causal, v=variant:
                                     split_kv_mma_t.make_split_kv_mma_t(d, c, v), sig,
                                     no_f64))
            # three stages of shared memory (split_kv_mma.STAGES, a lab switch), at d = 128
            for causal, variant, what in ((False, PLAIN, "full"),
                                          (True, full, "causal-window-softcap-alibi")):
                out.append(Entry(f"split_kv_mma-{dtype}-d128-{what}-stages3", "decode",
                                 lambda c=causal, v=variant:
                                 split_kv_mma.make_split_kv_mma(128, c, v, stages=3), sig,
                                 no_f64))
        out.append(Entry(f"combine-{dtype}", "decode", lambda ac=acc: combine.make_combine(ac),
                         (array(at, 4), array(at, 3), array(dt, 3), array(at, 2)), no_f64))
        out.append(Entry(f"combine_batched-{dtype}", "decode",
                         lambda ac=acc: combine_batched.make_combine_batched(ac),
                         (array(at, 4), array(at, 3), array(dt, 3), array(at, 2)), no_f64))
        out.append(Entry(f"append-{dtype}", "decode", append.make_append,
                         (array(dt, 4),) * 4 + (array(np.dtype(np.int32), 1),), no_f64))
    return out


def varlen_entries():
    """The kernels a packed batch runs by default (numbaflash/varlen.py), built with
    ``Variant(varlen=True)``: the packed arrays are (heads, total, d) strided views (layout
    "A"), or for forward v8, v9 and v10 and backward v6, v9 and v10 (PACKED_ROWS) the
    (total, heads, d) arrays as they are; lse, D and seqs C-contiguous. Forward v7 and v10 (float16), v8 (float32, d = 64),
    v9 (float32, d = 128), v2 (float64) and v5 (the simulator's); backward v6 (float16 and
    float32, GQA), v10 (float32, GQA), v9 (float16; its dQ kernel also built for a batch of
    equal lengths, seqs the pair (nq, nk)), v4 and v1 (float64), and the D kernel on views;
    causal."""
    import numpy as np
    from numbaflash.kernels import backward as bwd
    from numbaflash.kernels.backward import v1_two_kernels as bwd_v1
    from numbaflash.kernels.backward import v4_dynamic_shared as bwd_v4
    from numbaflash.kernels.backward import v6_split_pairs as bwd_v6
    from numbaflash.kernels.variants import Variant
    variant = Variant(varlen=True)
    out = []

    def view(dt):
        return numba.types.Array(numba.from_dtype(dt), 3, "A")

    for dtype in ("float16", "float32", "float64"):
        acc = "float64" if dtype == "float64" else "float32"
        dt, at = np.dtype(dtype), np.dtype(acc)
        t3, a2 = view(dt), array(at, 2)
        scale, offset = numba.from_dtype(at), numba.int64
        extra = variant_signature(at)
        fsig = (t3, t3, t3, t3, a2, scale, offset) + extra
        # a forward that takes the packed arrays as they are (PACKED_ROWS): C-contiguous
        c3 = array(dt, 3)
        rows = (c3, c3, c3, c3, a2, scale, offset) + extra
        dkdv_rows = (c3, c3, c3, c3, a2, a2, c3, c3, scale, offset) + extra
        dq_rows = (c3, c3, c3, c3, a2, a2, c3, scale, offset) + extra
        dkdv = (t3, t3, t3, t3, a2, a2, t3, t3, scale, offset) + extra
        dq = (t3, t3, t3, t3, a2, a2, t3, scale, offset) + extra
        no_f64 = dtype != "float64"
        tag = f"{dtype}-varlen-causal"
        out.append(Entry(f"backward_preprocess-{dtype}-varlen-d64", "varlen",
                         lambda a=acc: bwd.module("preprocess").make_backward_preprocess(64, a),
                         (t3, t3, a2), no_f64))
        if dtype == "float64":
            Br, Bc = F["v2"].default_forward_tiles(64, acc)
            out.append(Entry(f"forward_v2-{tag}-d64-tiles{Br}x{Bc}", "varlen",
                             lambda t=(Br, Bc), a=acc: F["v2"].make_forward_v2(
                                 *t, 64, True, a, variant), fsig, False))
            Br, Bc = bwd_v1.default_backward_tiles(64, acc)
            for kind, sig in (("dkdv", dkdv), ("dq", dq)):
                make = getattr(bwd_v1, f"make_backward_{kind}_v1")
                out.append(Entry(f"backward_{kind}_v1-{tag}-d64-tiles{Br}x{Bc}", "varlen",
                                 lambda m=make, t=(Br, Bc), a=acc: m(*t, 64, True, a, variant),
                                 sig, False))
            continue
        if dtype == "float16":
            Br, Bc = F["v7"].tiles_within(64, DYNAMIC_SHARED_MEM_LIMIT)
            out.append(Entry(f"forward_v7-{tag}-d64-gqa-tiles{Br}x{Bc}", "varlen",
                             lambda t=(Br, Bc): F["v7"].make_forward_v7(*t, 64, True, gqa=True,
                                                                        variant=variant),
                             fsig, no_f64))
            # forward v10 and backward v9 (the 16-bit defaults for packed batches of plain
            # attention), their GPU tiles, without GQA (neither takes it); unheld (their
            # register caps are link options)
            Br, Bc = F["v10"].tiles_within(64, DYNAMIC_SHARED_MEM_LIMIT)
            out.append(Entry(f"forward_v10-{tag}-d64-tiles{Br}x{Bc}", "varlen",
                             lambda t=(Br, Bc): F["v10"].make_forward_v10(
                                 *t, 64, True, F["v10"].v7_chunk(64, t[1]), varlen=True),
                             rows, no_f64))
            bwd_v9 = bwd.module("v9")
            tiles9 = bwd_v9.default_backward_v9_tiles(64, "gpu")
            for kind, sig in (("dkdv", dkdv_rows), ("dq", dq_rows)):
                Br, Bc = tiles9[kind]
                make = getattr(bwd_v9, f"make_backward_{kind}_v9")
                out.append(Entry(f"backward_{kind}_v9-{tag}-d64-tiles{Br}x{Bc}", "varlen",
                                 lambda m=make, t=(Br, Bc): m(*t, 64, True, varlen=True),
                                 sig, no_f64))
            # the dQ kernel's build for a batch of equal lengths: seqs is the pair (nq, nk)
            Br, Bc = tiles9["dq"]
            pair = numba.types.UniTuple(numba.int64, 2)
            out.append(Entry(f"backward_dq_v9-{dtype}-varlen-equal-causal-d64-tiles{Br}x{Bc}",
                             "varlen", lambda t=(Br, Bc): bwd_v9.make_backward_dq_v9(
                                 *t, 64, True, varlen=True, equal_lengths=True),
                             dq_rows[:-1] + (pair,), no_f64))
        else:
            for ver, d in (("v8", 64), ("v9", 128)):
                shared = F["v9"].v9_shared_bytes if ver == "v9" else F["v6"].v6_shared_bytes
                Br, Bc = F["v6"].default_v6_tiles(d, ver, shared)
                make = getattr(F[ver], f"make_forward_{ver}")
                out.append(Entry(f"forward_{ver}-{tag}-d{d}-gqa-tiles{Br}x{Bc}", "varlen",
                                 lambda t=(Br, Bc), m=make, d=d: m(
                                     *t, d, True, F["v8"].v8_chunk(d, t[1]), gqa=True,
                                     variant=variant), rows, no_f64))
            t = F["v5"].default_v5_tiles(64, acc)
            out.append(Entry(f"forward_v5-{tag}-d64-tiles{t[0]}x{t[1]}", "varlen",
                             lambda t=t, a=acc: F["v5"].make_forward_v5(*t, 64, True, a,
                                                                        variant=variant),
                             fsig, no_f64))
            t = bwd_v4.default_backward_v4_tiles(64, acc, "gpu")
            for kind, sig in (("dkdv", dkdv), ("dq", dq)):
                make = getattr(bwd_v4, f"make_backward_{kind}_v4")
                out.append(Entry(f"backward_{kind}_v4-{tag}-d64-tiles{t[0]}x{t[1]}", "varlen",
                                 lambda m=make, t=t, a=acc: m(*t, 64, True, a,
                                                              variant=variant),
                                 sig, no_f64))
        # v6, and v10 (v6's kernels accumulating in the mma) in float32 only
        for ver in ("v6", "v10"):
            if ver not in bwd.VERSIONS or (ver == "v10" and dtype != "float32"):
                continue
            for kind, sig in (("dkdv", dkdv_rows), ("dq", dq_rows)):
                Br, Bc, pairs = bwd_v6.default_backward_v6_plan(64, True, dtype, "gpu")[kind]
                make = getattr(bwd.module(ver), f"make_backward_{kind}_{ver}")
                chunk = bwd_v6.backward_v6_chunk(kind, Br, Bc)
                out.append(Entry(f"backward_{kind}_{ver}-{tag}-d64-gqa-tiles{Br}x{Bc}",
                                 "varlen", lambda m=make, t=(Br, Bc, 64, True, chunk, pairs):
                                 m(*t, gqa=True, variant=variant), sig, no_f64))
    return out


def bfloat16_entries():
    """The kernels bfloat16 inputs run (numbaflash/dtypes.py): forward v7 on the bfloat16
    tensor cores, its arrays the values' bits (uint16), at d = 59 (padded to the mma's k),
    64 and 128, full and causal; with the variants (GQA, window, softcap, ALiBi and
    dropout) and on a packed batch's strided views; the decoding kernels on bfloat16
    caches; and the two conversion kernels of the versions that compute in float32. None
    of them may use float64."""
    import numpy as np
    from numbaflash.kernels import halves
    from numbaflash.kernels.variants import Variant
    bits, f32 = np.dtype(np.uint16), np.dtype(np.float32)
    fsig = forward_variant_signature(bits, f32)
    out = []
    for d in (59, 64, 128):
        Br, Bc = F["v7"].tiles_within(d, DYNAMIC_SHARED_MEM_LIMIT)
        for causal in (False, True):
            tag = f"bfloat16-d{d}-{'causal' if causal else 'full'}"
            out.append(Entry(f"forward_v7-{tag}-tiles{Br}x{Bc}", "bfloat16",
                             lambda t=(Br, Bc), d=d, c=causal:
                             F["v7"].make_forward_v7(*t, d, c, half="bfloat16"), fsig, True))
    Br, Bc = F["v7"].tiles_within(128, DYNAMIC_SHARED_MEM_LIMIT)
    every = Variant(window=True, softcap=True, alibi=True, dropout=True)
    out.append(Entry(f"forward_v7-bfloat16-d128-causal-gqa-window-softcap-alibi-dropout-"
                     f"tiles{Br}x{Bc}", "bfloat16",
                     lambda t=(Br, Bc), v=every: F["v7"].make_forward_v7(
                         *t, 128, True, variant=v, gqa=True, half="bfloat16"), fsig, True))
    view = numba.types.Array(numba.from_dtype(bits), 3, "A")
    vsig = (view,) * 4 + fsig[4:]
    Br, Bc = F["v7"].tiles_within(64, DYNAMIC_SHARED_MEM_LIMIT)
    out.append(Entry(f"forward_v7-bfloat16-varlen-causal-d64-gqa-tiles{Br}x{Bc}", "bfloat16",
                     lambda t=(Br, Bc), v=Variant(varlen=True): F["v7"].make_forward_v7(
                         *t, 64, True, variant=v, gqa=True, half="bfloat16"), vsig, True))
    # decoding against bfloat16 caches (kernels/decode/), read and written as bits
    from numbaflash.kernels.decode import (append, combine, combine_batched, split_kv,
                                           split_kv_mma, split_kv_mma_t)
    i64, a = numba.int64, numba.float32
    dsig = (array(bits, 4), array(bits, 1), array(bits, 1), array(np.dtype(np.int32), 1), i64,
            array(bits, 3), array(f32, 2), array(f32, 4), array(f32, 3), a, i64, i64, i64, i64,
            a, array(f32, 2), array(np.dtype(np.bool_), 4)) + (i64,) * 7
    full = Variant(window=True, softcap=True, alibi=True)
    for d in (64, 128):
        for rows_needed in (1, 8):
            rows = split_kv.rows_per_block(rows_needed, d)
            for causal, variant, what in ((True, Variant(), "causal"),
                                          (True, full, "causal-window-softcap-alibi")):
                out.append(Entry(f"split_kv-bfloat16-d{d}-rows{rows}-{what}", "bfloat16",
                                 lambda d=d, r=rows, c=causal, v=variant:
                                 split_kv.make_split_kv(d, r, c, "float32", v, "bfloat16"),
                                 dsig, True))
                out.append(Entry(f"split_kv-bfloat16-d{d}-rows{rows}-{what}-wide", "bfloat16",
                                 lambda d=d, r=rows, c=causal, v=variant:
                                 split_kv.make_split_kv(d, r, c, "float32", v, "bfloat16",
                                                        vec=split_kv.wide_vec(2)),
                                 dsig, True))
        for causal, variant, what in ((False, Variant(), "full"),
                                      (True, full, "causal-window-softcap-alibi")):
            out.append(Entry(f"split_kv_mma-bfloat16-d{d}-{what}", "bfloat16",
                             lambda d=d, c=causal, v=variant:
                             split_kv_mma.make_split_kv_mma(d, c, v, "bfloat16"), dsig, True))
            out.append(Entry(f"split_kv_mma_t-bfloat16-d{d}-{what}", "bfloat16",
                             lambda d=d, c=causal, v=variant:
                             split_kv_mma_t.make_split_kv_mma_t(d, c, v, "bfloat16"), dsig,
                             True))
    out.append(Entry("combine-bfloat16", "bfloat16",
                     lambda: combine.make_combine("float32", "bfloat16"),
                     (array(f32, 4), array(f32, 3), array(bits, 3), array(f32, 2)), True))
    out.append(Entry("combine_batched-bfloat16", "bfloat16",
                     lambda: combine_batched.make_combine_batched("float32", "bfloat16"),
                     (array(f32, 4), array(f32, 3), array(bits, 3), array(f32, 2)), True))
    out.append(Entry("append-bfloat16", "bfloat16", append.make_append,
                     (array(bits, 4),) * 4 + (array(np.dtype(np.int32), 1),), True))
    out.append(Entry("widen_to_float32-bfloat16", "bfloat16", lambda: halves.widen_to_float32,
                     (array(bits, 1), array(f32, 1)), True))
    out.append(Entry("narrow_from_float32-bfloat16", "bfloat16",
                     lambda: halves.narrow_from_float32, (array(f32, 1), array(bits, 1)), True))
    return out


def backward_half_entries():
    """Backward v7 (the 16-bit tensor cores, kernels/backward/v7_half.py) and v9 (v7 with
    ldmatrix and cp.async, v9_ldmatrix.py): their dK/dV and dQ kernels for float16 and
    bfloat16 (the arrays the values' bits, uint16) at d = 64 and 128, full and causal,
    each with its GPU tile rule (each kernel its own tiles); and the D kernel reading
    bfloat16 bits. None of them may use float64."""
    import numpy as np
    from numbaflash.kernels import backward as bwd
    from numbaflash.kernels.backward import preprocess as bwd_pre
    v7, v9 = bwd.module("v7"), bwd.module("v9")
    f32 = np.dtype(np.float32)
    out = []
    for half in ("float16", "bfloat16"):
        store = np.dtype(np.uint16) if half == "bfloat16" else np.dtype(half)
        pre, dkdv, dq, _ = backward_signatures(store, f32)
        n = len(variant_signature(f32))             # v7 takes no variant arguments
        sigs = {"dkdv": dkdv[:-n], "dq": dq[:-n]}
        for d in (64, 128):
            tiles = v7.default_backward_v7_tiles(d, "gpu")
            for causal, kind in itertools.product((False, True), ("dkdv", "dq")):
                Br, Bc = tiles[kind]
                tag = f"{half}-d{d}-{'causal' if causal else 'full'}-tiles{Br}x{Bc}"
                make = getattr(v7, f"make_backward_{kind}_v7")
                out.append(Entry(f"backward_{kind}_v7-{tag}", "backward_half",
                                 lambda m=make, t=(Br, Bc, d, causal, half): m(*t),
                                 sigs[kind], True))
            # backward v9 (v7 with ldmatrix and cp.async, v9_ldmatrix.py), its own tiles
            tiles9 = v9.default_backward_v9_tiles(d, "gpu")
            for causal, kind in itertools.product((False, True), ("dkdv", "dq")):
                Br, Bc = tiles9[kind]
                tag = f"{half}-d{d}-{'causal' if causal else 'full'}-tiles{Br}x{Bc}"
                make = getattr(v9, f"make_backward_{kind}_v9")
                out.append(Entry(f"backward_{kind}_v9-{tag}", "backward_half",
                                 lambda m=make, t=(Br, Bc, d, causal, half): m(*t),
                                 sigs[kind], True))
        if half == "bfloat16":
            for d in (64, 128):
                out.append(Entry(f"backward_preprocess-bfloat16-d{d}", "backward_half",
                                 lambda d=d: bwd_pre.make_backward_preprocess(d, "float32",
                                                                              "bfloat16"),
                                 pre, True))
    return out


def backward_atomic_dq_entries():
    """Backward v8 (kernels/backward/v8_atomic_dq.py: v6's dK/dV kernel adding dQ by atomic
    adds): its kernel for float16 and float32 at d = 64 and 128, full and causal, with its
    GPU tile rule (v6's dK/dV tiles and pairs); with GQA's loop over the group at both head
    dims (full); with the built-in variants and dropout (float32, d = 64, causal); on a
    packed batch's views with GQA (float32, d = 64, causal); and its zero fill (on plain
    arrays and on views) and float16 rounding. None of them may use float64."""
    import numpy as np
    from numbaflash.kernels.backward import v8_atomic_dq as v8
    from numbaflash.kernels.variants import Variant
    f32 = np.dtype(np.float32)
    a2, a3 = array(f32, 2), array(f32, 3)
    scale, offset = numba.from_dtype(f32), numba.int64
    extra = variant_signature(f32)

    def view(dt):
        return numba.types.Array(numba.from_dtype(dt), 3, "A")

    def entry(dtype, d, causal, gqa=False, variant=None, label=""):
        dt = np.dtype(dtype)
        t3 = view(dt) if variant is not None and variant.varlen else array(dt, 3)
        sums = t3 if dtype == "float32" else a3         # float16: the float32 scratch
        Br, Bc, pairs = v8.default_backward_v8_tiles(d, causal, dtype, "gpu")
        chunk = v8.backward_v6_chunk("dkdv", Br, Bc)
        tag = (f"{dtype}-d{d}-{'causal' if causal else 'full'}{label}-tiles{Br}x{Bc}"
               + ("-pairs" if pairs else ""))
        sig = (t3, t3, t3, t3, a2, a2, sums, t3, t3, scale, offset) + extra
        kw = dict(gqa=gqa) if variant is None else dict(gqa=gqa, variant=variant)
        return Entry(f"backward_dkdv_dq_v8-{tag}", "backward_atomic_dq",
                     lambda t=(Br, Bc, d, causal, chunk, pairs), kw=kw:
                     v8.make_backward_dkdv_dq_v8(*t, **kw), sig, True)

    out = []
    for dtype in ("float16", "float32"):
        for d in (64, 128):
            for causal in (False, True):
                out.append(entry(dtype, d, causal))
            out.append(entry(dtype, d, False, gqa=True, label="-gqa"))
    builtins = Variant(window=True, dropout=True, softcap=True, alibi=True, mask="bool")
    out.append(entry("float32", 64, True, gqa=True, variant=builtins, label="-builtins-gqa"))
    out.append(entry("float32", 64, True, gqa=True, variant=Variant(varlen=True),
                     label="-varlen-gqa"))
    out.append(Entry("backward_zero_dq_v8-float32", "backward_atomic_dq", v8.make_zero_dq,
                     (a3,), True))
    out.append(Entry("backward_zero_dq_v8-float32-varlen", "backward_atomic_dq",
                     v8.make_zero_dq, (view(f32),), True))
    out.append(Entry("backward_dq_narrow_v8-float16", "backward_atomic_dq", v8.make_narrow_dq,
                     (a3, array(np.dtype(np.float16), 3)), True))
    return out


def forward_v10_entries():
    """Forward v10 (kernels/forward/v10_ldmatrix.py: v7 with ldmatrix loads and cp.async
    copies into two stages): float16 and bfloat16 (its arrays the values' bits), d = 64 and
    128 with its GPU tiles (v7's), full and causal; and d = 59, causal, where it loads
    element by element (rows not whole 16-byte pieces). Plain attention: its plain
    signature. None may use float64."""
    import numpy as np
    v10, v7 = F["v10"], F["v7"]
    out = []
    for half, dt in (("float16", np.dtype(np.float16)), ("bfloat16", np.dtype(np.uint16))):
        sig = forward_signature(dt, np.dtype(np.float32))
        for d, causals in ((64, (False, True)), (128, (False, True)), (59, (True,))):
            Br, Bc = v10.tiles_within(d, DYNAMIC_SHARED_MEM_LIMIT)
            for causal in causals:
                tag = f"{half}-d{d}-{'causal' if causal else 'full'}"
                out.append(Entry(f"forward_v10-{tag}-tiles{Br}x{Bc}", "forward_v10",
                                 lambda t=(Br, Bc), d=d, c=causal, h=half:
                                 v10.make_forward_v10(*t, d, c, v7.v7_chunk(d, t[1]), half=h),
                                 sig, True))
    return out


GROUPS = {"forward": forward_entries, "backward": backward_entries, "variants": variant_entries,
          "decode": decode_entries, "varlen": varlen_entries, "bfloat16": bfloat16_entries,
          "backward_half": backward_half_entries,
          "backward_atomic_dq": backward_atomic_dq_entries,
          "forward_v10": forward_v10_entries}


F64_RE = re.compile(r"\.f64\b")
def toolchain():
    """The versions that decide the PTX: numba, numba-cuda and the CUDA release whose NVVM
    compiles it (from the header of a PTX it writes)."""
    from importlib.metadata import version
    ptx, _ = cuda.compile_ptx(lambda x: None, (numba.types.Array(numba.float32, 1, "C"),), cc=CC)
    release = re.search(r"release ([\d.]+), V([\d.]+)", ptx)
    return {"numba": numba.__version__, "numba-cuda": version("numba-cuda"),
            "cuda": release.group(2) if release else "unknown"}


def f64_lines(ptx):
    """PTX lines that use float64: instructions (add.f64, cvt.f64.f32, ...) or registers."""
    return [ln.strip() for ln in ptx.splitlines()
            if F64_RE.search(ln) and not ln.lstrip().startswith("//")]


def link(ptx, name):
    """Link PTX for ARCH with nvJitLink; returns ptxas's verbose info log."""
    from cuda.bindings import nvjitlink
    handle = nvjitlink.create(2, [f"-arch={ARCH}", "-verbose"])
    try:
        data = ptx.encode()
        nvjitlink.add_data(handle, nvjitlink.InputType.PTX, data, len(data), name)
        try:
            nvjitlink.complete(handle)
        except Exception:
            size = nvjitlink.get_error_log_size(handle)
            buf = bytearray(size)
            nvjitlink.get_error_log(handle, buf)
            raise RuntimeError(f"nvJitLink failed: {buf.decode(errors='replace')}") from None
        size = nvjitlink.get_info_log_size(handle)
        buf = bytearray(size)
        nvjitlink.get_info_log(handle, buf)
        return buf.decode(errors="replace").rstrip("\x00")
    finally:
        nvjitlink.destroy(handle)


def parse_link_log(log):
    """Numbers for the kernel entry from ptxas's verbose report."""
    def grab(pattern):
        m = re.search(pattern, log)
        return int(m.group(1)) if m else None
    return {
        "registers": grab(r"Used (\d+) registers"),
        "stack_bytes": grab(r"(\d+) bytes stack frame"),
        "spill_stores": grab(r"(\d+) bytes spill stores"),
        "spill_loads": grab(r"(\d+) bytes spill loads"),
        "smem_bytes": grab(r"(\d+) bytes smem"),
    }


def check(entry, do_link):
    result = {"name": entry.name, "group": entry.group, "no_f64": entry.no_f64}
    try:
        kernel = entry.build()
        ptx, _ = cuda.compile_ptx(kernel.py_func, entry.signature, cc=CC)
        result["ptx_bytes"] = len(ptx)
        result["fingerprint"] = fingerprint(ptx)
        if entry.no_f64:                # float64 kernels are allowed their .f64
            bad = f64_lines(ptx)
            result["f64_lines"] = bad[:10]
            result["f64_count"] = len(bad)
        else:
            result["f64_lines"], result["f64_count"] = [], None
        if do_link:
            log = link(ptx, entry.name)
            result.update(parse_link_log(log))
            result["log"] = log[-2000:]
        result["ok"] = True
    except Exception as exc:
        result["ok"] = False
        result["error"] = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        result["traceback"] = traceback.format_exc()[-3000:]
    return result


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--group", action="append", choices=sorted(GROUPS),
                    help="entry groups to check (default: all)")
    ap.add_argument("--match", action="append", default=[],
                    help="only entries whose name contains every given substring")
    ap.add_argument("--link", action="store_true", help="also link with nvJitLink")
    ap.add_argument("--list", action="store_true", help="print entry names and exit")
    ap.add_argument("--fingerprints", metavar="FILE",
                    help="write every selected entry's PTX fingerprint and the toolchain to "
                         "FILE (JSON), the record tests/test_ptx.py compares against")
    args = ap.parse_args(argv)
    entries = [e for g in (args.group or sorted(GROUPS)) for e in GROUPS[g]()]
    entries = [e for e in entries if all(m in e.name for m in args.match)]
    if args.list:
        print("\n".join(e.name for e in entries))
        return 0
    if not entries:
        print("no entries selected", file=sys.stderr)
        return 2
    results = []
    for entry in entries:
        results.append(check(entry, args.link))
        print("PTXCHECK " + json.dumps(results[-1]), flush=True)
    if args.fingerprints:
        failed = [r["name"] for r in results if not r["ok"]]
        if failed:
            print(f"not writing {args.fingerprints}: {failed} did not compile", file=sys.stderr)
            return 1
        with open(args.fingerprints, "w") as f:
            json.dump({"toolchain": toolchain(),
                       "kernels": {r["name"]: r["fingerprint"] for r in results}},
                      f, indent=1, sort_keys=True)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
