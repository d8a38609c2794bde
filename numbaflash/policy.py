"""Which kernel version runs, and why: two ordered decision lists.

``default_forward_version`` and ``default_backward_version`` read top to bottom; the first
rule that applies decides, and its reason is what ``explain()`` shows and the log says.
Everything else about a launch (tiles, shared memory, grid, what a version refuses)
belongs to the version's own file, reached through the ladders' registries
(``numbaflash.kernels.forward.module(version)``, ``numbaflash.kernels.backward.module``).
The measurements behind each rule are in the version files' docstrings and in
docs/performance.md, each cited by the lab/ file that holds it.

    import logging; logging.basicConfig(level=logging.INFO)   # every launch's plan
"""

import logging
import math
from dataclasses import replace

import numpy as np
from numba import cuda

from . import arrays, dtypes, launcher
from .kernels import backward, forward, simulating
from .kernels.backward.nonfinite import nonfinite_check, nonfinite_check_bfloat16
from .kernels.decode import (combine, combine_batched, split_kv, split_kv_mma,
                              split_kv_mma_t)
from .kernels.plan import Plans, computes, device_dynamic_shared_limit, needs_variants
from .launcher import launch
from .streams import DEFAULT

log = logging.getLogger("numbaflash")

BACKENDS = ("gpu", "simulator")
SIMT_MAX_HEAD_DIM = 128         # where the fast SIMT and tensor-core versions were measured
V9_MIN_HEAD_DIM = 65            # v9 over v8 from here (Qi in shared memory, d > 64)


def backend():
    """'gpu' with a CUDA GPU, 'simulator' under NUMBA_ENABLE_CUDASIM=1; else RuntimeError."""
    if simulating():
        return "simulator"
    if cuda.is_available():
        return "gpu"
    raise RuntimeError("no CUDA GPU is available. To run the same kernels on the CPU, set "
                       "NUMBA_ENABLE_CUDASIM=1 before importing numba (slow: keep shapes small)")


def where_to_plan(where):
    """``where`` checked ("gpu" or "simulator"), or this machine's backend if None."""
    if where is None:
        return backend()
    if where not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None (this machine's); "
                         f"got {where!r}")
    return where


def serves(ladder, version, p):
    """Whether ``version`` of ``ladder`` (kernels.forward or kernels.backward) computes
    Problem ``p``: plain attention, or a variant if the version takes variants (its
    module's VARIANTS), or a packed batch of plain attention if its PACKED says so
    (kernels/plan.py: computes)."""
    return computes(ladder.module(version), p)


def _variant_note(p):
    """What the reason adds for a variant: which pieces the kernel compiles in."""
    wanted = needs_variants(p)
    return "" if wanted is None else f"; with the variant compiled in: {wanted}"


def default_forward_version(p, where):
    """The default forward version for Problem ``p`` on ``where``, and why. A variant
    never forces a slower version where a faster one computes it (``serves``)."""
    wanted = needs_variants(p)
    if p.acc_dtype != "float32":
        return "v2", "v2 is the default in float64 (v4 to v9 were measured in float32 only)"
    if p.d > SIMT_MAX_HEAD_DIM:
        return "v2", (f"v2 is the default at head dim {p.d} > {SIMT_MAX_HEAD_DIM} (v4 to v9 "
                      f"were measured faster at d <= {SIMT_MAX_HEAD_DIM} only)")
    if where != "gpu":
        if not serves(forward, "v5", p):
            return "v2", (f"v2 is the default for variants ({wanted}) on the simulator: v5 "
                          "computes plain attention only")
        return "v5", ("v5 is the default in float32 with d <= "
                      f"{SIMT_MAX_HEAD_DIM} on the simulator: register-blocked, its tiles in "
                      "dynamic shared memory, exact for every input, and the fastest there "
                      "(v8, the GPU's default, runs on the simulator too, through "
                      "kernels/simulated.py, but each of its mma is a rendezvous of a warp's "
                      "32 Python threads); on a GPU, v8 runs instead" + _variant_note(p))
    limit = device_dynamic_shared_limit(where)
    v6, v7, v9 = forward.module("v6"), forward.module("v7"), forward.module("v9")
    v10 = forward.module("v10")
    if (p.d % 8 == 0 and v10.refusal(p, where) is None
            and v10.tiles_within(p.d, limit) is not None and serves(forward, "v10", p)):
        return "v10", ("v10 is the default in float16 and bfloat16 with d <= "
                       f"{v10.V10_MAX_HEAD_DIM}, d a multiple of 8 (its 16-byte copies), on a "
                       "GPU for plain attention (causal or not): v7 with its K/V tiles copied "
                       "by cp.async into two stages and its mma operands loaded by ldmatrix, "
                       "bitwise v7's results; on the H100 at (2, 16, 4096, d) in float16 "
                       "1.43x v7's speed at d = 64 (128 registers a thread, two blocks per "
                       "SM) and 1.80x at d = 128 (lab/runs/2026-12-05/108_sweep_after.txt)")
    if (v7.refusal(p, where) is None and v7.tiles_within(p.d, limit) is not None
            and serves(forward, "v7", p)):
        return "v7", ("v7 is the default in float16 and bfloat16 with d <= "
                      f"{v7.V7_MAX_HEAD_DIM} on a GPU where v10 is not (variants, d not a "
                      "multiple of 8): 16-bit products on the tensor cores (m16n8k16, "
                      "float32 sums; P~ rounded to the input type for P~ V), NaN and inf "
                      "placed exactly as by v6, 2.2x-2.4x v6's speed on the H200"
                      + _variant_note(p))
    if v6.tiles_within(p.d, limit) is None:
        if not serves(forward, "v5", p):
            return "v2", (f"v2 is the default for variants ({wanted}) here: no v6 tile fits "
                          f"head dim {p.d} in this GPU's {limit} bytes of shared memory per "
                          "block, and v5 computes plain attention only")
        return "v5", (f"v5 is the default here: no v6 tile fits head dim {p.d} in this GPU's "
                      f"{limit} bytes of shared memory per block, and v5 (register-blocked "
                      "SIMT, exact for every input) is the fastest version that does"
                      + _variant_note(p))
    if (p.d >= V9_MIN_HEAD_DIM and v9.refusal(p, where) is None
            and v6.tiles_within(p.d, limit, v9.v9_shared_bytes) is not None
            and serves(forward, "v9", p)):
        return "v9", ("v9 is the default in float32 with "
                      f"{V9_MIN_HEAD_DIM} <= d <= {v6.V6_MAX_HEAD_DIM} on a GPU: v8 "
                      "(3xTF32 tensor cores, exact for every input) with the next K/V tile "
                      "copied into shared memory (cp.async) while this one is used, and Qi "
                      "kept plain; bitwise v8's results, 6-7% faster than v8 at d = 128 on "
                      "the H200" + _variant_note(p))
    if not serves(forward, "v8", p):
        return "v2", (f"v2 is the default for variants ({wanted}) here: the tensor-core "
                      "versions compute plain attention only")
    return "v8", ("v8 is the default in float32 with d <= "
                  f"{v6.V6_MAX_HEAD_DIM} on a GPU: v6's tensor-core kernel (3xTF32, K/V split "
                  "once per tile, exact for every input) with the next chunk's scores "
                  "computed during this chunk's softmax (bitwise v6's results for the same "
                  "chunk), the fastest version measured on the H200" + _variant_note(p))


def default_backward_version(p, where, tensor_cores=True):
    """The default backward version for Problem ``p`` on ``where``, and why;
    ``tensor_cores=False`` leaves out v5, v6 and v9 (inputs that hold NaN or inf)."""
    wanted = needs_variants(p)
    v9 = backward.module("v9")
    if (tensor_cores and where == "gpu" and v9.refusal(p, where) is None
            and serves(backward, "v9", p)):
        return "v9", ("v9 is the default in float16 and bfloat16 with d <= "
                      f"{v9.BWD_V9_MAX_HEAD_DIM} on a GPU for plain attention (causal or "
                      "not, in one batch or packed): the 16-bit tensor cores (v7's "
                      "products, bitwise v7's gradients) with ldmatrix operands and "
                      "cp.async copies, deterministic (no atomics); on the H100 at (2, 16, "
                      "4096, d) in float16 2.5x v7's speed at d = 64 and 2.9x at d = 128, v7 "
                      "itself 1.3x-1.8x v6's in forward + backward "
                      "(lab/runs/2026-12-05/108_sweep_after.txt, 105_half_speed.txt)")
    if (tensor_cores and where == "gpu" and p.acc_dtype == "float32"
            and p.d <= SIMT_MAX_HEAD_DIM and backward.module("v6").tiles_fit(p.d, where)
            and serves(backward, "v6", p)):
        return "v6", ("v6 is the default in float32 and float16 with "
                      f"d <= {SIMT_MAX_HEAD_DIM} on a GPU: tensor cores (3xTF32), "
                      "deterministic (no atomics), the fastest version measured on the "
                      "H200 (1.25x-1.39x v4 at d = 64, 1.59x-1.71x at d = 128)"
                      + _variant_note(p))
    if (p.acc_dtype == "float32" and p.d <= SIMT_MAX_HEAD_DIM
            and serves(backward, "v4", p)):
        if not tensor_cores:
            why = "; v6 needs finite inputs"
        elif where != "gpu":
            why = ("; v6, the GPU default, runs on the simulator too (kernels/simulated.py), "
                   "but slower there: each of its mma is a rendezvous of a warp's 32 Python "
                   "threads")
        elif not serves(backward, "v6", p):
            why = "; v6 computes plain attention only"
        else:
            why = (f"; no v6 tile fits this GPU's {device_dynamic_shared_limit(where)} bytes of "
                   "shared memory")
        return "v4", ("v4 is the default in float32 with d <= "
                      f"{SIMT_MAX_HEAD_DIM} here: register-blocked, its tiles in "
                      "dynamic shared memory, deterministic (no atomics, so repeated runs are "
                      "bitwise identical)" + why + _variant_note(p))
    if wanted is not None:
        return "v1", (f"v1 is the default for variants ({wanted}) here: the faster versions "
                      "that could run this input compute plain attention only")
    return "v3", (f"v3 is the default for plain attention in {p.acc_dtype} at d = {p.d}: "
                  "register-blocked, deterministic (no atomics, so repeated runs are bitwise "
                  f"identical); v4 was measured in float32 at d <= {SIMT_MAX_HEAD_DIM} only")


def plan_forward(p, version=None, tiles=None, where=None):
    """The forward Plan for Problem ``p``: ``version`` None means the default; ``where``
    None means this machine ("gpu" or "simulator" plan for that backend, on any machine).
    Never falls back silently: a version that cannot run ``p`` raises ValueError saying why.
    """
    where = where_to_plan(where)
    if version is None:
        version, reason = default_forward_version(p, where)
    elif version in forward.VERSIONS:
        reason = f"{version} was asked for by the caller"
    else:
        raise ValueError(f"unknown forward version {version!r}; choose from {forward.VERSIONS}")
    if dtypes.widens(p, forward.module(version)):
        reason += dtypes.widen_reason(version)
    return forward.module(version).plan(p, where, tiles, reason)


def atomic_backward_version(p, where, version, reason):
    """``deterministic=False``: v8 (dQ added by atomics) where it runs Problem ``p`` and the
    deterministic default is not v9, else the deterministic default (``version``,
    ``reason``), saying why."""
    if version == "v9":
        return version, (f"{reason}; deterministic=False keeps v9: v8 adds dQ by atomics "
                         "but multiplies in 3xTF32, and v9's 16-bit backward took under a "
                         "third of v8's float32 one at (2, 16, 4096, 64) on the H100 "
                         "(lab/runs/2026-12-05/113_half_speed.txt, 115_atomic_speed.txt)")
    v8 = backward.module("v8")
    why = v8.refusal(p, where)
    if where != "gpu":
        why = ("v8 is chosen on a GPU only (on the simulator each of its mma is a rendezvous "
               "of 32 Python threads; version='v8' runs it there)")
    elif why is None and not v8.tiles_fit(p.d, p.upper, p.dtype, where):
        why = f"no v8 tile fits this GPU's {device_dynamic_shared_limit(where)} bytes"
    if why is None:
        return "v8", ("v8 because deterministic=False: v6's dK/dV kernel also adds dQ by "
                      "atomic adds (5 tile products instead of 7, no dQ kernel); dQ's bits "
                      "may vary between runs" + _variant_note(p))
    return version, (f"{reason}; deterministic=False had no atomic version for this input: "
                     f"{why}")


def plan_backward(p, version=None, tiles=None, where=None, deterministic=True):
    """The backward Plans for Problem ``p``, in launch order (D, then dK/dV, then dQ);
    ``version`` and ``where`` as for ``plan_forward``. ``deterministic=False`` lets the
    default be v8 (atomic adds: ``atomic_backward_version``); a version named by the
    caller runs as asked either way. Raises ValueError for an unknown version, bad tiles,
    or a version that cannot run ``p`` (its own file says why), TypeError for a
    ``deterministic`` that is not a bool."""
    where = where_to_plan(where)
    if not isinstance(deterministic, (bool, np.bool_)):
        raise TypeError(f"deterministic must be True or False; got {deterministic!r}")
    if version is None:
        version, reason = default_backward_version(p, where)
        if not deterministic:
            version, reason = atomic_backward_version(p, where, version, reason)
    elif version in backward.VERSIONS:
        reason = f"{version} was asked for by the caller"
    else:
        raise ValueError(f"unknown backward version {version!r}; choose from "
                         f"{backward.VERSIONS}")
    if dtypes.widens(p, backward.module(version)):
        reason += dtypes.widen_reason(version)
    preprocess = backward.module("preprocess").plan(p, where, version)
    return backward.module(version).plan(p, where, tiles, reason, preprocess)


def start_finite_check(plans, p, Q, K, V, O, dO, L, stream=DEFAULT):
    """Queue the check that the six inputs are finite, if ``plans`` are v5's to v10's (the
    tensor-core backward), and return its ``PendingCheck``; None for other plans. One
    check kernel over the six arrays on ``stream`` (a streams.CallStream), and its 4-byte
    flag copied back (launcher.FlagReadback); nothing waits yet. For bfloat16 given as
    its bits (v7: Problem ``p`` says bfloat16) the check reads the exponent bits.

    The backward call queues its kernels before it waits for the answer, so that the GPU
    runs them while the host waits: the answer is almost always "finite", and waiting
    first left the GPU idle while the host made the launches after it (the idle time
    per call of lab/runs/2026-12-07/158_layout_f16_d64_grad_kernels.txt). If it is not,
    the call launches the fallback's plans after them, which write every gradient again."""
    if plans[-1].version not in ("v5", "v6", "v7", "v8", "v9", "v10"):
        return None
    n = max(a.size for a in (Q, K, V, O, dO, L))
    threads = 256
    check = nonfinite_check_bfloat16 if dtypes.is_bfloat16(p.dtype) else nonfinite_check
    views = tuple(arrays.flat_view(a) for a in (Q, K, V, O, dO, L))
    flag = _cleared_flag(stream)
    launch(check, (min(math.ceil(n / threads), 4096),), (threads,), views + (flag,),
           (p.dtype, p.acc_dtype), stream=stream)
    if simulating():
        return PendingCheck(plans, p, None, int(flag.copy_to_host()[0]), flag)
    readback = launcher.flag_readback()
    readback.start(flag.device_ctypes_pointer.value, stream.handle)
    return PendingCheck(plans, p, readback, None, flag)


class PendingCheck:
    """A queued finiteness check (``start_finite_check``): ``plans(asked)`` waits for its
    answer and returns the plans to run: the checked ones, or the default's without
    tensor cores (v4, or v1 for a variant v4 does not take) if an input holds NaN or inf;
    ``asked`` (the caller named the version) raises ValueError instead of falling back
    (v7 is never the default, so it always raises)."""

    def __init__(self, plans, p, readback, found, flag):
        self.checked, self.p, self.readback, self.found = plans, p, readback, found
        self.flag = flag            # the device flag, kept until its copy has been read

    def plans(self, asked):
        """The checked plans if the inputs are finite, else the fallback's (a warning in
        the log says why), or ValueError if ``asked`` (the caller named the version).
        Waits for the check's copy only, not for work queued after it."""
        found = self.readback.read() if self.found is None else self.found
        plans, p = self.checked, self.p
        if found == 0:
            return plans
        version = plans[-1].version
        why = (f"the inputs hold NaN or inf (q, k, v, out, dout or lse), and backward "
               f"{version}'s tensor cores would carry them to keys that do not see them")
        where = plans[-1].backend
        other, _ = default_backward_version(p, where, tensor_cores=False)
        if asked:
            raise ValueError(f"backward {version} cannot run this input: {why}; use "
                             f"{other} (the default falls back to it)")
        if version == "v8":     # chosen for deterministic=False
            why += "; deterministic=False had no atomic version for this input"
        log.warning("backward: %s; running %s instead of the default %s", why, other,
                    version)
        return Plans(replace(plan, reason=f"{why}: {other} instead of the default "
                                          f"{version}; {plan.reason}")
                     for plan in plan_backward(p, other, where=where))


def _cleared_flag(stream):
    """The non-finite check's flag: one int32 on the device, 0, set on ``stream`` (a
    streams.CallStream) by the driver's memset, queued behind the work before it. A copy
    from host memory (``cuda.to_device``) would first wait for that work, the forward's
    kernels: the GPU would then idle while the host builds the check's arguments and
    launches it. On the simulator, a copy."""
    if simulating():
        return cuda.to_device(np.zeros(1, np.int32))
    flag = arrays.device_empty((1,), np.int32, stream)
    launcher.memset_d32_async(flag.device_ctypes_pointer.value, 0, 1, stream.handle)
    return flag


# --- decoding against a KV cache: how many splits ------------------------------------

# Split until the grid has SPLIT_BLOCKS_PER_SM blocks per SM, each split keeping at least
# SPLIT_MIN_KEYS keys. Measured on the H200 at d = 128 (lab/runs/2026-12-04/100_decode_gpu.txt,
# the "splits" lines, ms for 1, 2, 4, 8, 16, 32, 64 splits): the fastest count gave 4 to
# 16 blocks per SM; about 8 per SM was within 2 % of the fastest at three of the four
# decode shapes and 12 % off at batch 8 without GQA in float16 (16 per SM fastest there);
# about 2 per SM was 23-48 % slower everywhere.
SPLIT_BLOCKS_PER_SM = 8
SPLIT_MIN_KEYS = 512
SPLIT_MAX = 64
# split_kv_mma: 78 KB of shared memory a block at d = 128 lets an SM hold two. Measured on
# an H100 at d = 128, float16 (lab/runs/2026-12-06/119_decode_splits.txt, ms for 1, 2, 4,
# ..., 64 splits): the fastest counts gave 256-512 blocks (one or two waves of two per
# SM: 1, 4, 16 and 64 splits at batch 8 / 8 with GQA / batch 1 / 1 with GQA); the counts
# nearest 8 blocks per SM (4, 16, 32, 64) were 9 %, 57 % and 6 % slower than those at
# the first three shapes. This rule picks 1, 4, 8 and 33 there.
MMA_BLOCKS_PER_SM = 2
# split_kv_mma_t: the same rule with its own count (kernels/decode/split_kv_mma_t.py's
# BLOCKS_PER_SM, which says why it is 2 although an SM could hold three).
BLOCKS_PER_SM = {split_kv_mma: MMA_BLOCKS_PER_SM,
                 split_kv_mma_t: split_kv_mma_t.BLOCKS_PER_SM}


def sm_count(where):
    """The GPU's streaming multiprocessors (132 on the H200; assumed when there is no GPU
    to ask)."""
    if where == "gpu" and not simulating() and cuda.is_available():
        return cuda.get_current_device().MULTIPROCESSOR_COUNT
    return 132


# The decode kernels, in the order decode_kernel tries them (kernels/decode/). A script
# that times one against the other sets this (scripts/decode_gpu.py --decode-kernels).
DECODE_KERNELS = ("split_kv_mma_t", "split_kv_mma", "split_kv")
DECODE_MODULES = {"split_kv_mma_t": split_kv_mma_t, "split_kv_mma": split_kv_mma,
                  "split_kv": split_kv}


def decode_kernel(p):
    """The decode kernel for CacheProblem ``p`` (its module in kernels/decode/) and why.
    The first of DECODE_KERNELS that takes the call, in order:

    1. split_kv_mma_t: split_kv_mma transposed, the rows on the mma's N side, for the
       calls with 2 to 8 query rows per K/V head (a GQA group of up to eight decoding one
       token); fewer products, registers and exps per key than its parent, and 3 % faster
       at batch 1 with GQA on an H100 (its docstring cites the measurement).
    2. split_kv_mma: the query rows of a K/V head on the 16-bit tensor cores, K and V
       tiles through shared memory; float16 and bfloat16 caches with more than one query
       row per K/V head (GQA, or Sq > 1), d a multiple of 8 up to 128, rows 16-byte
       aligned (its ``refusal`` names what is missing, and cites the measurement behind
       the rows).
    3. split_kv: every cache, each row's scores reduced over a warp on the CUDA cores.
    """
    refused = []
    for name in DECODE_KERNELS:
        module = DECODE_MODULES[name]
        why_not = module.refusal(p)
        if why_not is None:
            reason = DECODE_REASONS[name]
            if refused:
                reason += " (not " + "; not ".join(refused) + ")"
            return module, reason
        refused.append(f"{name}: {why_not}")
    raise ValueError(f"no decode kernel of {DECODE_KERNELS} takes this call: "
                     + "; ".join(refused))


# The combine after more than one split (kernels/decode/): combine_batched, the parent's
# bits with each thread's loads issued a batch of splits at a time (its docstring cites the
# measurement: the parent's one round trip per split and pass made it an eighth of a batch-1
# call). A script that times one against the other sets this; it is read when a call is
# planned (repeated calls launch what their first call planned: decode_direct.forget()).
COMBINE_KERNEL = "combine_batched"
COMBINE_MODULES = {"combine_batched": combine_batched, "combine": combine}


def combine_kernel():
    """The module of the combine kernel (COMBINE_KERNEL)."""
    return COMBINE_MODULES[COMBINE_KERNEL]


DECODE_REASONS = {
    "split_kv_mma_t": ("the transposed tensor-core decode kernel (16-bit caches with "
                       "aligned rows, 2 to 8 query rows per K/V head on the products' "
                       "N side)"),
    "split_kv_mma": ("the tensor-core decode kernel (16-bit caches with aligned rows, "
                     "several query rows per K/V head)"),
    "split_kv": "the CUDA-core decode kernel",
}


def split_limit(n_max):
    """The most splits ``default_num_splits`` gives when the longest sequence has n_max
    keys: at least SPLIT_MIN_KEYS keys a split, at most SPLIT_MAX splits, at least one."""
    return min(max(1, n_max // SPLIT_MIN_KEYS), SPLIT_MAX)


def default_num_splits(p, where, module=split_kv):
    """How many ranges the split-KV kernel ``module`` cuts each batch's keys into, and
    why (kernels/decode/). In order:

    1. On the simulator, one: there is no GPU to fill, and each split is work.
    2. split_kv_mma and split_kv_mma_t: one wave of their blocks, BLOCKS_PER_SM per SM
       (what their shared memory and registers let an SM hold), the splits rounded to the nearest count (at least one):
       its blocks pay a prologue and a merge, and a second, partial wave costs more than
       it gives.
    3. split_kv: one split when the grid already has SPLIT_BLOCKS_PER_SM blocks per SM
       without splitting (many batches and heads, or many query rows); otherwise enough
       splits to reach that.
    Either way each split keeps at least SPLIT_MIN_KEYS keys of the longest sequence, and
    there are at most SPLIT_MAX.
    """
    rows = module.rows_per_block(p.group * p.Sq, p.d)
    blocks = p.B * p.Hk * math.ceil(p.group * p.Sq / rows)
    if where != "gpu":
        return 1, ("one split on the simulator: there is no GPU to fill (num_splits= "
                   "forces more)")
    sms = sm_count(where)
    most = split_limit(p.n_max)
    if module in BLOCKS_PER_SM:
        per_sm = BLOCKS_PER_SM[module]
        target = per_sm * sms
        n = min(max(1, round(target / blocks)), most)
        count = "one split" if n == 1 else f"{n} split(s)"
        return n, (f"{count}: {blocks} blocks without splitting for {sms} SMs; one "
                   f"wave of {per_sm} blocks per SM, rounded, with at least "
                   f"{SPLIT_MIN_KEYS} keys a split and at most {SPLIT_MAX} splits")
    target = SPLIT_BLOCKS_PER_SM * sms
    if blocks >= target:
        return 1, (f"one split: {blocks} blocks without splitting already give "
                   f"{SPLIT_BLOCKS_PER_SM} per SM on this GPU's {sms}")
    n = min(math.ceil(target / blocks), most)
    return n, (f"{n} split(s): {blocks} blocks without splitting for {sms} SMs; splitting "
               f"the keys (up to {p.n_max} a batch) gives {n * blocks} blocks, aiming at "
               f"{SPLIT_BLOCKS_PER_SM} per SM with at least {SPLIT_MIN_KEYS} keys a split "
               f"and at most {SPLIT_MAX} splits")
