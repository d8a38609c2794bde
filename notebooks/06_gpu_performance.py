# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 06 · Performance on a GPU
#
# Notebooks 01 to 05 were about getting the right answer. This one measures what the
# kernels cost on a real GPU: time, device memory and memory traffic, next to PyTorch's
# `scaled_dot_product_attention` (SDPA) on the same inputs, and next to the model of
# memory traffic in the FlashAttention paper. Every number printed or plotted here is
# measured in this run (or computed from a formula that the text names); the stored
# outputs come from the run that the first section describes.
#
# | section | what it measures |
# |---|---|
# | 1 where it ran | date, GPU, versions, and the kernels the library picks for these shapes |
# | 2 time and TFLOP/s | forward, backward and both against $N$: the default kernels, plain and fast rungs of the version ladder, SDPA; float16 against SDPA FLASH |
# | 3 memory | device memory beyond the outputs against $N$, and the $N \times N$ matrix it avoids |
# | 4 HBM traffic | forward v2's bytes read from HBM and L2 against its tile size (Nsight Compute), the loop model, Theorem 2 |
# | 5 roofline | where the measured kernels sit against the GPU's compute and bandwidth ceilings |
# | 6 what limits the fastest version | the measured gap, and the resources each kernel was given |
#
# **Needs** a CUDA GPU. PyTorch with CUDA gives the SDPA comparison (without it only
# numbaflash is timed), and Nsight Compute (`ncu`, with access to the GPU's performance
# counters) gives section 4's measurement (without it section 4 shows the model only and
# says so). It cannot run on the CUDA simulator: a simulated thread is Python on the CPU,
# so there is nothing to time. Each timing cell prints how long it took, and the last
# cell the whole notebook's time. To rerun it on a GPU and store its outputs:
#
#     python scripts/notebooks.py gpu
#
# Run it again whenever a default kernel changes: section 2 records the default versions
# it measured, and the test suite fails when the library would pick others today
# (`tests/test_notebook_staleness.py`). The sizes are parameters in the first cell:
# shrink them for a smaller GPU.

# %%
import importlib.util
import inspect
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import matplotlib.pyplot as plt
import numpy as np
from IPython.display import Markdown, display
from numba import cuda

import numbaflash
from numbaflash import bench, validate
from numbaflash.kernels import backward as bwd_kernels
from numbaflash.kernels import forward as fwd_kernels
from numbaflash.kernels.forward import v2_flash2
from numbaflash.kernels.plan import device_dynamic_shared_limit

T_START = time.perf_counter()
# ---- sizes: B * H = 16 heads, head dim 64, float32 (shrink the N lists on a smaller GPU)
B, H, D, DTYPE = 1, 16, 64, "float32"
N_FORWARD = [1024, 2048, 4096, 8192, 16384]     # section 2 (forward) and 3
N_FWD_BWD = [1024, 2048, 4096, 8192, 16384]     # section 2 (backward, forward + backward) and 3
D_WIDE, N_WIDE = 128, [4096, 16384]             # section 2: the forward at head dim 128
N_FLOAT16 = [1024, 4096, 16384]                 # section 2: float16 inputs, against SDPA FLASH
# ---- the forward rungs timed beside the default (numbaflash/kernels/forward/, one file each)
PLAIN_RUNGS = ("v1", "v2")              # for contrast: no tiles; FlashAttention-2's tiles
FAST_RUNGS = ("v5", "v6", "v8", "v9")   # register-blocked SIMT; the tensor cores (3xTF32)
WIDE_RUNGS = ("v5", "v8", "v9")         # beside the default at head dim 128
FLOAT16_RUNGS = ("v8",)                 # beside the float16 default: float16 inputs in 3xTF32
REPEATS, WARMUP = 10, 2                              # forward: median of REPEATS after WARMUP
REPEATS_BWD, WARMUP_BWD = 5, 1                       # backward: slower, fewer runs
HBM_SHAPE = (1, 16, 16384, 64)                       # section 4: (B, H, N, d), one ncu run per tile pair
HBM_TILES = [(8, 64), (16, 64), (32, 64), (64, 64), (128, 64)]   # Bc fixed, Br varied; None: every candidate that fits
# ---- section 5's ceilings: the H200's, measured on 2026-11-30 (cuBLAS GEMMs and a device
# ---- copy). Another GPU has other ceilings: replace these three numbers with its own.
PEAK_FP32 = 51e12          # FLOP/s: cuBLAS float32 GEMM with TF32 off (plain FMA units; datasheet 67e12)
PEAK_TF32 = 403e12         # FLOP/s: cuBLAS TF32 GEMM (tensor cores)
HBM_BYTES_PER_S = 4.2e12   # bytes/s: device-to-device copy bandwidth

BACKEND = numbaflash.backend()                       # "gpu", or "simulator" under NUMBA_ENABLE_CUDASIM=1
if BACKEND != "gpu":
    print("This notebook measures a GPU. It needs: a CUDA GPU (and NUMBA_ENABLE_CUDASIM unset or 0); "
          "PyTorch with CUDA for the SDPA comparison; Nsight Compute (ncu) for section 4.")
    raise RuntimeError(f"this notebook needs a CUDA GPU, and this is the {BACKEND}; its stored "
                       f"outputs come from the GPU run that its section 1 describes")


def spec(shape, dtype):
    """Something with a shape and a dtype: all that numbaflash.explain reads."""
    return SimpleNamespace(shape=tuple(shape), dtype=np.dtype(dtype))


def default_forward(d, dtype, n=max(N_FORWARD)):
    """The forward version the library picks on this GPU for (B, H, n, d) in dtype."""
    return numbaflash.explain(*[spec((B, H, n, d), dtype)] * 3).version


def besides_default(rungs, d, dtype):
    """None (the default) and the rungs that are not the default and can run the input."""
    chosen = [None]
    for v in rungs:
        try:
            numbaflash.explain(*[spec((B, H, max(N_FORWARD), d), dtype)] * 3, version=v)
        except ValueError as e:
            print(f"not timed: {e}")
            continue
        if v != default_forward(d, dtype):
            chosen.append(v)
    return tuple(chosen)


FORWARD_VERSIONS = besides_default(PLAIN_RUNGS + FAST_RUNGS, D, DTYPE)
WIDE_VERSIONS = besides_default(WIDE_RUNGS, D_WIDE, DTYPE)
FLOAT16_VERSIONS = besides_default(FLOAT16_RUNGS, D, "float16")

try:
    import torch
    SDPA = torch.cuda.is_available()
except ImportError:
    torch, SDPA = None, False

ROOT = Path(numbaflash.__file__).resolve().parent.parent
HBM_SCRIPT = ROOT / "scripts" / "hbm_traffic.py"
_spec = importlib.util.spec_from_file_location("hbm_traffic", HBM_SCRIPT)
hbm = importlib.util.module_from_spec(_spec)         # the script's model and ncu helpers
_spec.loader.exec_module(hbm)
print(f"backend {BACKEND}; PyTorch SDPA: {'yes' if SDPA else 'no'}; "
      f"ncu: {hbm.find_ncu() or 'not found'}")
for name, versions in (("float32, d = 64", FORWARD_VERSIONS), ("float32, d = 128", WIDE_VERSIONS),
                       ("float16, d = 64", FLOAT16_VERSIONS)):
    print(f"forward versions timed, {name}: the default and {', '.join(versions[1:]) or 'none'}")

# %% [markdown]
# ## 1 · Where it ran
#
# A time means little without the machine, the versions and the date.
# `bench.environment()` records them; the GPU's size (streaming multiprocessors, L2
# cache, shared memory) comes from the driver.

# %%
env = bench.environment()
dev = cuda.get_current_device()
env["streaming multiprocessors"] = dev.MULTIPROCESSOR_COUNT
env["L2 cache (MB)"] = dev.L2_CACHE_SIZE / 1e6
env["shared memory per SM (KB)"] = dev.MAX_SHARED_MEMORY_PER_MULTIPROCESSOR / 1024
env["shared memory per block (KB)"] = device_dynamic_shared_limit("gpu") / 1024
NCU = hbm.find_ncu()
env["ncu"] = hbm.ncu_version(NCU) if NCU else "not found"
for key, value in env.items():
    print(f"{key:>28}: {value}")
SMS = dev.MULTIPROCESSOR_COUNT
L2_BYTES = dev.L2_CACHE_SIZE
if "H200" not in str(env["gpu"]):
    print("\nNOTE: section 5's ceilings (first cell) are the H200's; this is another GPU")

# %% [markdown]
# What "numbaflash" and "default" mean below: the kernels the library picks for each
# shape and dtype when no version is asked for. The choice depends on the dtype, the head
# dimension and the GPU (its shared memory per block), and it changes as the version
# ladder grows, so this notebook asks the policy (`numbaflash/policy.py`) instead of
# naming them: `explain()` prints the plan for each kind of input timed below, and why.

# %%
for d, dtype in ((D, DTYPE), (D_WIDE, DTYPE), (D, "float16")):
    q_spec = spec((B, H, max(N_FORWARD), d), dtype)
    print(f"---- (B, H, N, d) = {q_spec.shape}, {dtype}")
    print(numbaflash.explain(q_spec, q_spec, q_spec))
    print(numbaflash.explain_backward(q_spec, q_spec, q_spec))

# %% [markdown]
# ## 2 · Time and TFLOP/s against the sequence length
#
# ### Counting
#
# Per head, the forward computes two matrix products, $S = QK^\top$ and $O = PV$, each
# $N \times N \times d$ multiply-adds, that is $2N^2d$ floating-point operations. So
#
# $$
# \text{FLOPs}_{\text{forward}} = 4\,B\,H\,N^2 d, \qquad
# \text{FLOPs}_{\text{backward}} = 2.5 \times \text{FLOPs}_{\text{forward}}, \qquad
# \text{FLOPs}_{\text{fwd+bwd}} = 3.5 \times \text{FLOPs}_{\text{forward}},
# $$
#
# the convention of flash-attention's benchmarks (the backward's five products against
# the forward's two; causal attention counts half). The exponentials, the max and the
# rescaling are not counted. TFLOP/s is this count divided by the measured time, so it
# compares implementations of the same work; it is not an instruction count.

# %%
print(inspect.getsource(bench.flops))

# %% [markdown]
# ### Timing
#
# A GPU runs asynchronously: a launch returns to Python before the kernel has run. So a
# time is taken with two CUDA *events* recorded on the GPU's stream around the call, and
# the GPU's clock between them is read after both have passed. The first call compiles
# the kernel (a second or two), so a few warm-up calls come first, and the median of
# several runs is kept. Each call is a call of the public API on arrays already on the
# device, as a user makes it: Python overhead and output allocation are included, host
# copies are not.

# %%
print(inspect.getsource(bench.time_ms))

# %% [markdown]
# `bench.run` does more than time: it first runs each implementation once and compares
# its result with a float64 reference (PyTorch SDPA's MATH backend in float64, or
# `numbaflash.reference` without PyTorch), and a result outside the test suite's bound
# gets no time at all. Then it times PyTorch SDPA on the same inputs in the same process:
# the EFFICIENT backend (a fused kernel, in float32 on the tensor cores with the 3xTF32
# split, so float32-accurate; the column `vs SDPA` is SDPA EFFICIENT's time divided by
# ours, so above 1 would mean faster than SDPA), the MATH backend (plain PyTorch
# operations that store the $N \times N$ matrices, TF32 off), and, for float16 inputs,
# the FLASH backend (flash-attention's kernels, which take float16 and bfloat16 only).
#
# The forward first, in float32: the default, and beside it rungs of the version ladder
# (`numbaflash/kernels/forward/`, one file per version): the plain ones for contrast and
# the fast ones. What each is, from the first line of its file's docstring:

# %%
def ladder(versions):
    for v in versions:
        if v is not None:
            print(f"{v}: {fwd_kernels.module(v).__doc__.strip().splitlines()[0]}")


ladder(sorted({v for v in FORWARD_VERSIONS + WIDE_VERSIONS + FLOAT16_VERSIONS if v}
              | {default_forward(D, DTYPE), default_forward(D_WIDE, DTYPE),
                 default_forward(D, "float16")}))

# %%
t0 = time.perf_counter()
fwd = bench.run([(B, H, n, D) for n in N_FORWARD], causal=(False,), dtype=DTYPE,
                passes=("forward",), versions=FORWARD_VERSIONS, repeats=REPEATS,
                warmup=WARMUP, sdpa=SDPA, progress=False)
print(bench.format_table(fwd))
print(f"\n{time.perf_counter() - t0:.0f} s for this cell")
if bench.wrong_results(fwd):
    print("WRONG RESULTS above: those implementations were not timed")

# %%
STYLE = {  # impl name in the records -> (colour, marker), the same in every plot
    "numbaflash": ("C0", "o"), "sdpa_efficient": ("C3", "s"), "sdpa_math": ("C1", "D"),
    "sdpa_flash": ("k", "X"), "numbaflash_v1": ("C7", "v"), "numbaflash_v2": ("C9", "^"),
    "numbaflash_v3": ("C8", "<"), "numbaflash_v4": ("C8", ">"), "numbaflash_v5": ("C5", "P"),
    "numbaflash_v6": ("C4", "*"), "numbaflash_v7": ("C8", "h"), "numbaflash_v8": ("C2", "p"),
    "numbaflash_v9": ("C6", "d")}
SDPA_LABELS = {"sdpa_efficient": "PyTorch SDPA EFFICIENT", "sdpa_math": "PyTorch SDPA MATH (TF32 off)",
               "sdpa_flash": "PyTorch SDPA FLASH"}


def versions_in(kernels):
    """'forward_v8 + backward_preprocess+backward_dkdv_v6+backward_dq_v6' -> 'v8 + v6'."""
    found = re.findall(r"_(v\d+)\b", kernels or "")
    return " + ".join(dict.fromkeys(found))


def label(records, impl, what=None):
    """The legend's name of an implementation; the default's says which versions ran (in
    the pass ``what``, or in any)."""
    if impl == "numbaflash":
        ran = sorted({versions_in(r["kernel"]) for r in records
                      if r["impl"] == impl and r["kernel"] and what in (None, r["what"])})
        return f"numbaflash default ({', '.join(ran)})"
    if impl.startswith("numbaflash_"):
        return f"numbaflash {impl.split('_')[1]}"
    return SDPA_LABELS[impl]


def series(records, what, impl, key):
    """(N, value) pairs of one implementation and pass, where the value was measured."""
    return sorted((r["Sk"], r[key]) for r in records
                  if r["what"] == what and r["impl"] == impl and r[key] is not None)


def plot_speed(records, what, d=D, dtype=DTYPE):
    fig, (ax_ms, ax_tf) = plt.subplots(1, 2, figsize=(13, 4.6))
    for impl in dict.fromkeys(r["impl"] for r in records):
        ms, tf = series(records, what, impl, "ms"), series(records, what, impl, "tflops")
        if not ms:
            continue
        color, marker = STYLE.get(impl, ("C8", "x"))
        lw = 2.5 if impl == "numbaflash" else 1.5
        name = label(records, impl, what)
        ax_ms.plot(*zip(*ms), marker=marker, color=color, lw=lw, label=name)
        ax_tf.plot(*zip(*tf), marker=marker, color=color, lw=lw, label=name)
    default = series(records, what, "numbaflash", "ms")
    if default:                                  # a line of slope 2 through the last point
        n_last, ms_last = default[-1]
        ns = np.array([n for n, _ in default], float)
        ax_ms.plot(ns, ms_last * (ns / n_last) ** 2, "k:", lw=1, label=r"$\propto N^2$")
    ax_ms.set_xscale("log", base=2)
    ax_ms.set_yscale("log")
    ax_ms.set_ylabel("time (ms, median)")
    ax_tf.set_xscale("log", base=2)
    ax_tf.set_ylabel("TFLOP/s")
    for ax in (ax_ms, ax_tf):
        ax.set_xlabel(f"sequence length N  (B·H = {B * H} heads, d = {d}, {dtype})")
        ax.grid(True, which="both", alpha=0.3)
    ax_ms.legend(fontsize="small")
    fig.suptitle(f"{what}, non-causal, {dtype}, d = {d}")
    fig.tight_layout()
    plt.show()


def ratios(records, what, baseline="sdpa_efficient"):
    """One line per implementation: the baseline's time divided by its time, per N
    (above 1: faster than the baseline)."""
    base = dict(series(records, what, baseline, "ms"))
    if not base:
        print(f"{label(records, baseline)} was not timed: no ratios")
        return
    print(f"{what}: {label(records, baseline)}'s time / each one's time (above 1: faster)")
    for impl in dict.fromkeys(r["impl"] for r in records):
        pts = [(n, base[n] / ms) for n, ms in series(records, what, impl, "ms") if n in base]
        if pts and impl != baseline:
            print(f"{label(records, impl, what):>36}: "
                  + "  ".join(f"N={n}: {x:.2f}x" for n, x in pts))


plot_speed(fwd, "forward")

# %%
ratios(fwd, "forward")
for n in N_FORWARD:
    plan = numbaflash.explain(*[spec((B, H, n, D), DTYPE)] * 3)
    blocks = plan.grid[0] * plan.grid[1]
    print(f"N = {n:5d}: the default forward ({plan.version}) launches {blocks:5d} blocks of "
          f"{plan.block[0]} threads for {SMS} SMs ({blocks / SMS:.1f} per SM)")

# %% [markdown]
# How to read these plots:
#
# * The work grows as $N^2$, so once the GPU is busy the time should follow the dotted
#   line (slope 2 on log-log axes). At short sequences two things flatten it: a call has
#   a fixed cost (Python and the launch, tens of microseconds), and with one block per
#   query tile and head there may be fewer blocks than the GPU's streaming
#   multiprocessors (SMs) can hold at once (the printout above counts them), so part of
#   the GPU idles.
# * Once the GPU is full, TFLOP/s should level off; the right-hand plot shows where.
# * The rungs tell the ladder's story: from one thread per row without tiles (v1), to
#   FlashAttention-2's tiles (v2), register blocking (v5), and the tensor cores (v6 and
#   the versions built on it). Each version's file says what it changes and what that
#   buys, with the measurement behind it.
# * The ratios are the measured answer to "how far is this from PyTorch".
#
# ### Head dimension 128
#
# A larger head dimension changes what fits on chip, and the policy may pick another
# kernel there (section 1 printed which). A shorter series:

# %%
t0 = time.perf_counter()
wide = bench.run([(B, H, n, D_WIDE) for n in N_WIDE], causal=(False,), dtype=DTYPE,
                 passes=("forward",), versions=WIDE_VERSIONS, repeats=REPEATS,
                 warmup=WARMUP, sdpa=SDPA, progress=False)
print(bench.format_table(wide))
print(f"\n{time.perf_counter() - t0:.0f} s for this cell\n")
if bench.wrong_results(wide):
    print("WRONG RESULTS above: those implementations were not timed")
ratios(wide, "forward")

# %% [markdown]
# ### Backward, and forward and backward
#
# Training runs the backward too. The backward's default (section 1 printed it and why)
# does not depend on the forward's version, so these timings use the default forward
# only: the backward alone (from a stored forward's output and logsumexp), and the two
# together, as one training step calls them. Fewer repeats: a call is slower.

# %%
t0 = time.perf_counter()
fb = bench.run([(B, H, n, D) for n in N_FWD_BWD], causal=(False,), dtype=DTYPE,
               passes=("backward", "fwd+bwd"), versions=(None,), repeats=REPEATS_BWD,
               warmup=WARMUP_BWD, sdpa=SDPA, progress=False)
print(bench.format_table(fb))
print(f"\n{time.perf_counter() - t0:.0f} s for this cell")
if bench.wrong_results(fb):
    print("WRONG RESULTS above: those implementations were not timed")

# %%
plot_speed(fb, "fwd+bwd")
ratios(fb, "backward")
ratios(fb, "fwd+bwd")
fwd_ms = dict(series(fwd, "forward", "numbaflash", "ms"))
for n, ms in series(fb, "fwd+bwd", "numbaflash", "ms"):
    if n in fwd_ms:
        print(f"N = {n:5d}: the forward is {fwd_ms[n] / ms:5.1%} of numbaflash's "
              f"forward + backward time ({fwd_ms[n]:.2f} of {ms:.2f} ms)")

# %% [markdown]
# ### float16 inputs, against SDPA FLASH
#
# With float16 inputs the forward can multiply on the float16 tensor cores, and SDPA
# has a third backend, FLASH (flash-attention's own kernels), for float16 only: the
# fastest attention PyTorch ships. numbaflash computes in float32 and rounds only
# where its float16 kernel says (notebook 04, and the README's float16 rule). Beside
# the float16 default: the same inputs through a float32 tensor-core rung.

# %%
t0 = time.perf_counter()
f16 = bench.run([(B, H, n, D) for n in N_FLOAT16], causal=(False,), dtype="float16",
                passes=("forward", "fwd+bwd"), versions=FLOAT16_VERSIONS, repeats=REPEATS,
                warmup=WARMUP, sdpa=SDPA, progress=False)
print(bench.format_table(f16))
print(f"\n{time.perf_counter() - t0:.0f} s for this cell")
if bench.wrong_results(f16):
    print("WRONG RESULTS above: those implementations were not timed")

# %%
plot_speed(f16, "forward", dtype="float16")
for what in ("forward", "fwd+bwd"):
    ratios(f16, what, "sdpa_flash")
    ratios(f16, what, "sdpa_efficient")

# %% [markdown]
# ### The default kernels this run measured
#
# The stored outputs of this notebook are only worth reading while they show the
# kernels the library runs. So the cell below records, for every shape timed above,
# the default versions that ran, as JSON after the word `DEFAULTS`, with the GPU and
# its shared memory per block (the tile rules, and so the choice, read it). The test
# suite reads that record from the stored outputs and compares it with what the policy
# picks today for the same shapes on that GPU (`tests/test_notebook_staleness.py`); when
# a default changes, the test fails until the notebook is run again on a GPU.

# %%
def default_versions(records):
    """One entry per shape, dtype and pass that the default ran in ``records``."""
    entries = []
    for r in records:
        if r["impl"] != "numbaflash" or r["kernel"] is None:
            continue
        q = spec((r["B"], r["H"], r["Sq"], r["d"]), r["dtype"])
        kv = spec((r["B"], r["H"], r["Sk"], r["d"]), r["dtype"])
        causal = "bottom_right" if r["causal"] else None
        passes = ("forward", "backward") if r["what"] == "fwd+bwd" else (r["what"],)
        for what in passes:
            if what == "forward":
                version = numbaflash.explain(q, kv, kv, causal=causal).version
            else:
                version = numbaflash.explain_backward(q, kv, kv, causal=causal)[-1].version
            assert version in versions_in(r["kernel"]).split(" + "), (version, r["kernel"])
            entry = {"pass": what, "dtype": r["dtype"],
                     "shape": [r["B"], r["H"], r["Sq"], r["Sk"], r["d"]],
                     "causal": bool(r["causal"]), "version": version}
            if entry not in entries:
                entries.append(entry)
    return entries


entries = default_versions(fwd + wide + fb + f16)
where = json.dumps({"gpu": str(env["gpu"]), "dynamic_shared_limit": device_dynamic_shared_limit("gpu"),
                    "date": env["date"]})
# one JSON object; one entry a line, so that it reads as a table
print("DEFAULTS " + where[:-1] + ', "versions": [\n ' + ",\n ".join(json.dumps(e) for e in entries)
      + "\n]}")

# %% [markdown]
# ## 3 · Memory against the sequence length
#
# The formula's $S = \tau QK^\top$ and $P = \operatorname{softmax}(S)$ are $N \times N$ per
# head. Stored once in float32, one such matrix takes
#
# $$ \text{bytes} = 4\,B\,H\,N^2, $$
#
# which at $N = 16384$ and 16 heads is 17 GB, $N/d = 256$ times $Q$ itself. The
# dense reference of notebook 01 stores $S$ and $P$ (in float64); PyTorch's MATH backend
# stores them too. FlashAttention stores neither: only $O$ and the logsumexp $L$ of each
# row (the backward recomputes $P$ tile by tile from $L$).
#
# Measured here, per call, the device memory beyond the arrays the call returns:
#
# * numbaflash: the driver's free memory before and after the call, with nothing freed
#   in between (`bench.extra_memory_bytes`). The driver counts in pages of about 2 MiB, so
#   small buffers read as 0 or 2 MiB.
# * PyTorch SDPA: the peak of PyTorch's allocator during the call (reset before it) above
#   what was allocated before (`bench.torch_extra_memory_bytes`).

# %%
print(inspect.getsource(bench.extra_memory_bytes))
print(inspect.getsource(bench.torch_extra_memory_bytes))

# %%
MIB = 2**20
mem_rows = [("forward", fwd, "numbaflash", "numbaflash forward"),
            ("fwd+bwd", fb, "numbaflash", "numbaflash forward + backward"),
            ("forward", fwd, "sdpa_efficient", "SDPA EFFICIENT forward"),
            ("fwd+bwd", fb, "sdpa_efficient", "SDPA EFFICIENT forward + backward"),
            ("forward", fwd, "sdpa_math", "SDPA MATH forward"),
            ("fwd+bwd", fb, "sdpa_math", "SDPA MATH forward + backward")]
ns_all = sorted(set(N_FORWARD) | set(N_FWD_BWD))
dense_mib = {n: 4 * B * H * n * n / MIB for n in ns_all}

print(f"{'N':>6} {'one N x N fp32':>15} " + " ".join(f"{label[:24]:>25}" for *_, label in mem_rows))
for n in ns_all:
    cells = []
    for what, recs, impl, _ in mem_rows:
        got = dict(series(recs, what, impl, "extra_mib")).get(n)
        cells.append(f"{'-' if got is None else f'{got:.1f}':>25}")
    print(f"{n:6d} {dense_mib[n]:15.1f} " + " ".join(cells))
print("(MiB beyond each call's outputs; '-': not measured, e.g. not run or out of memory)")

fig, ax = plt.subplots(figsize=(8.5, 5))
ax.plot(ns_all, [dense_mib[n] for n in ns_all], "k-", lw=3, alpha=0.35,
        label=r"one $N \times N$ float32 matrix per head (computed)")
styles = {"forward": "-", "fwd+bwd": "--"}
for what, recs, impl, name in mem_rows:
    pts = series(recs, what, impl, "extra_mib")
    if pts:
        color, marker = STYLE[impl]
        ax.plot(*zip(*pts), styles[what], marker=marker, color=color, label=name)
ax.set_xscale("log", base=2)
ax.set_yscale("symlog", linthresh=1)              # 0 MiB is a possible measurement
ax.set_xlabel(f"sequence length N  (B·H = {B * H} heads, d = {D}, {DTYPE})")
ax.set_ylabel("device memory beyond the outputs (MiB)")
ax.set_title("memory: measured (lines with markers) against the N x N matrix (grey)")
ax.grid(True, which="both", alpha=0.3)
ax.legend(fontsize="small")
plt.show()

# %% [markdown]
# The grey line grows as $N^2$. A kernel that stored an $N \times N$ matrix would sit on
# it or above it; the measured lines say, for each implementation, whether it does. For
# numbaflash, `extra MiB` also covers the backward's own scratch: $D =
# \operatorname{rowsum}(dO \circ O)$, one value per query row (notebook 05).
#
# ## 4 · HBM traffic against the tile size (forward v2)
#
# ### The model
#
# A GPU's main memory (HBM) is large and slow to reach; the on-chip memories (registers
# and shared memory inside each SM, then the L1 and L2 caches) are small and fast. The
# point of FlashAttention is to read HBM less. This section counts it for forward v2,
# FlashAttention-2's Algorithm 1 with one thread per query row, whose loops make the
# count easy to read; every tiled rung reads $K$ and $V$ the same way, once per query
# tile, with its own $B_r$ (section 5 uses that). Count what the v2 forward reads and
# writes, from its loops, per (batch, head) and with $s$ bytes per element: each thread
# reads its row of $Q$ once, writes its row of $O$ and its $L$ once, and each of the
# $T_r = \lceil N / B_r \rceil$ query tiles (one block each) walks all of $K$ and $V$:
#
# $$
# \text{bytes} = s\,\big(\underbrace{N d}_{Q} + \underbrace{T_r \cdot 2 N d}_{K,\ V}
#   + \underbrace{N d}_{O}\big) + \underbrace{4 N}_{L}
#   \;\approx\; \frac{2\,s\,N^2 d}{B_r} \quad (N \gg B_r).
# $$
#
# $B_c$ does not appear: it sets how many keys a block holds at once, not how often $K$
# and $V$ are read. `scripts/hbm_traffic.py` holds this model:

# %%
print(inspect.getsource(hbm.model_bytes))

# %% [markdown]
# ### Theorem 2
#
# The FlashAttention paper (Dao et al., 2022, Theorem 2) states the same scaling in
# general: with an on-chip memory of $M$ elements ($d \le M \le Nd$), standard attention
# makes $\Theta(Nd + N^2)$ HBM accesses and FlashAttention
#
# $$ \Theta\!\left(\frac{N^2 d^2}{M}\right). $$
#
# A v2 block works with its $B_r$ rows of $Q$ (registers) and its $K_j$, $V_j$ tiles
# (shared memory), so here $M = B_r d + 2 B_c d$; with $B_r = B_c = B$ that is
# $N^2 d^2 / (3Bd) = N^2 d / (3B)$, the model's $1/B_r$ again. $\Theta$ gives the shape,
# not the constant, so the plot below draws $N^2d^2/M$ scaled to meet the model at
# v2's default tiles.
#
# ### What a GPU adds: caches
#
# The model counts what the blocks *ask* global memory for. On the GPU every such read
# first goes to the SM's L1 cache, then to the L2 cache that all SMs share, and only a
# miss there reaches HBM. Theorem 2 has one processor with one on-chip memory; a GPU has
# one SRAM per SM and a shared L2 of tens of megabytes behind them, and the blocks that
# run at the same time read the same $K$ and $V$ when they belong to the same head.
# Nsight Compute reads the hardware counters of one kernel launch, at two levels:
#
# * `dram__bytes_read.sum`, `dram__bytes_write.sum`: bytes between L2 and HBM;
# * `lts__t_sectors_srcunit_tex_op_read.sum` × 32 bytes: what the SMs (past their L1)
#   read from L2.
#
# The shape must be large enough that $K$ and $V$ cannot simply stay in L2:

# %%
hb, hh, hn, hd = HBM_SHAPE
item = np.dtype(DTYPE).itemsize
kv_all, kv_head = 2 * hb * hh * hn * hd * item, 2 * hn * hd * item
print(f"HBM_SHAPE {HBM_SHAPE}: K and V take {kv_all / 1e6:.0f} MB in all "
      f"({kv_all / L2_BYTES:.1f}x the {L2_BYTES / 1e6:.0f} MB L2), {kv_head / 1e6:.1f} MB per head "
      f"({kv_head / L2_BYTES:.2f}x the L2)")
pairs = HBM_TILES or hbm.tile_pairs(hd, DTYPE)
print(f"tile pairs (Br, Bc) measured: {pairs}")
for Br, Bc in pairs:
    print(f"  ({Br:2d}, {Bc:2d}): grid ({-(-hn // Br)}, {hb * hh}) blocks of {Br} threads, "
          f"shared memory {v2_flash2.forward_shared_bytes(Br, Bc, hd, 'float32')} B")

# %% [markdown]
# At the default `HBM_SHAPE`, all of $K$ and $V$ is larger than L2 but one head's are
# not, and the blocks of one head are numbered next to each other (`blockIdx.x` runs over
# a head's query tiles), so blocks that run at the same time are likely to share a head.
# The measurement decides how much of the model's re-reading the caches absorb.
#
# `scripts/hbm_traffic.py` runs `ncu` once per tile pair on a child Python process that
# calls `numbaflash.attention(q, k, v, version="v2", tiles=(Br, Bc))` once; ncu profiles
# that one launch (`--kernel-name regex:forward_v2 --launch-count 1`), with the caches
# flushed before it. ncu replays the kernel to read its counters, and each run starts a
# fresh Python process and compiles the kernel, so this takes several seconds a pair. If
# ncu is missing or fails, the script says why and measures nothing.

# %%
cmd = [sys.executable, str(HBM_SCRIPT), "--shape", *map(str, HBM_SHAPE), "--dtype", DTYPE,
       "--timeout", "150"]
if HBM_TILES:
    cmd += ["--tiles", ",".join(f"{a}x{b}" for a, b in HBM_TILES)]
t0 = time.perf_counter()
with tempfile.TemporaryDirectory() as tmp:
    out_json = Path(tmp) / "hbm_traffic.json"
    try:
        proc = subprocess.run(cmd + ["--json", str(out_json)], capture_output=True, text=True,
                              timeout=540)
        print(proc.stdout[-6000:])
        if proc.returncode != 0:
            print(f"hbm_traffic.py exited with status {proc.returncode}")
            print(proc.stderr[-3000:])
    except subprocess.TimeoutExpired:
        print("hbm_traffic.py did not finish in 540 s: no measurement")
    traffic = json.loads(out_json.read_text()) if out_json.exists() else None
print(f"{time.perf_counter() - t0:.0f} s for this cell")

measured = [] if traffic is None else [e for e in traffic["pairs"] if e["dram_read"] is not None]
if traffic is not None and traffic["error"]:
    print(f"NO MEASUREMENT: {traffic['error']}")
elif not measured:
    print("NO MEASUREMENT: see the output above")

# %%
model = []
for Br, Bc in pairs:
    read, write = hbm.model_bytes(hb, hh, hn, hd, Br, item)
    theorem2 = hbm.theorem2_accesses(hb, hh, hn, hd, hbm.sram_elements(Br, Bc, hd))
    model.append((Br, Bc, read, write, theorem2))
default_pair = v2_flash2.default_forward_tiles(hd, "float32")
scale2 = next(m[2] / m[4] for m in model if m[:2] == default_pair) if default_pair in pairs \
    else model[0][2] / model[0][4]

fig, (ax_r, ax_w) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [1.6, 1]})
brs = [m[0] for m in model]
ax_r.plot(brs, [m[2] / 1e9 for m in model], "k-", lw=2, alpha=0.6,
          label="model: Q once, K and V once per query tile")
ax_r.plot(brs, [scale2 * m[4] / 1e9 for m in model], "x", color="C4", ms=9,
          label=r"Theorem 2: $N^2d^2/M$, $M = B_r d + 2B_c d$ (scaled)")
ax_r.axhline(item * hb * hh * (hn * hd + 2 * hn * hd) / 1e9, color="gray", ls=":",
             label="Q, K, V each read once")
ax_w.plot(brs, [m[3] / 1e9 for m in model], "k-", lw=2, alpha=0.6, label="model: O and L once")
if measured:
    pts = [(e["Br"], e["Bc"], e["dram_read"], e["dram_write"], e["l2_read"]) for e in measured]
    ax_r.plot([p[0] for p in pts], [p[2] / 1e9 for p in pts], "o", color="C3", ms=8,
              label="measured: HBM -> L2 (dram__bytes_read)")
    if any(p[4] is not None for p in pts):
        ax_r.plot([p[0] for p in pts if p[4] is not None],
                  [p[4] / 1e9 for p in pts if p[4] is not None], "s", color="C0", mfc="none",
                  ms=9, label="measured: L2 -> SMs (lts sectors x 32 B)")
    ax_w.plot([p[0] for p in pts], [p[3] / 1e9 for p in pts], "o", color="C3", ms=8,
              label="measured: L2 -> HBM (dram__bytes_write)")
    for p in pts:
        ax_r.annotate(f"({p[0]},{p[1]})", (p[0], p[2] / 1e9), textcoords="offset points",
                      xytext=(4, -12), fontsize=7, color="C3")
    ax_r.set_title(f"reads, {HBM_SHAPE} {DTYPE}, v2 forward")
else:
    reason = "ncu did not run" if traffic is None else (traffic["error"] or "see above")
    ax_r.set_title(f"reads: MODEL ONLY, measurement missing\n({reason[:80]})", color="C3")
for ax in (ax_r, ax_w):
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("Br (query rows per block)")
    ax.set_ylabel("GB")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
ax_w.set_title("writes")
fig.tight_layout()
plt.show()

# %%
if measured:
    print(f"{'(Br, Bc)':>9} {'model read':>11} {'L2 -> SMs':>10} {'HBM read':>9} "
          f"{'L2/model':>9} {'HBM/model':>10} {'HBM write':>10} {'write/model':>12}")
    for e in measured:
        l2 = e["l2_read"]
        l2_gb = "n/a" if l2 is None else f"{l2 / 1e9:7.2f} GB"
        l2_ratio = "n/a" if l2 is None else f"{l2 / e['model_read']:.2f}"
        print(f"({e['Br']:2d}, {e['Bc']:2d}) {e['model_read'] / 1e9:8.2f} GB {l2_gb:>10} "
              f"{e['dram_read'] / 1e9:6.2f} GB {l2_ratio:>9} "
              f"{e['dram_read'] / e['model_read']:10.3f} {e['dram_write'] / 1e9:7.3f} GB "
              f"{e['dram_write'] / e['model_write']:12.2f}")
    lo, hi = min(measured, key=lambda e: e["Br"]), max(measured, key=lambda e: e["Br"])
    text = (f"**Measured** (ncu {traffic['ncu_version'] or ''}): from $B_r = {hi['Br']}$ down to "
            f"$B_r = {lo['Br']}$ the model's reads grow {lo['model_read'] / hi['model_read']:.1f}x; "
            f"the bytes read from HBM grow {lo['dram_read'] / hi['dram_read']:.2f}x "
            f"({hi['dram_read'] / 1e9:.2f} GB to {lo['dram_read'] / 1e9:.2f} GB, that is "
            f"{hi['dram_read'] / hi['model_read']:.1%} and {lo['dram_read'] / lo['model_read']:.1%} "
            f"of the model)")
    if lo["l2_read"] is not None and hi["l2_read"] is not None:
        text += (f", and the bytes the SMs read from L2 grow "
                 f"{lo['l2_read'] / hi['l2_read']:.1f}x ({hi['l2_read'] / hi['model_read']:.2f} and "
                 f"{lo['l2_read'] / lo['model_read']:.2f} times the model)")
    display(Markdown(text + "."))
else:
    display(Markdown("**No measurement** in this run (see the output above): the plot shows "
                     "the model only."))

# %% [markdown]
# How to read it. The model's line and Theorem 2's crosses fall as $1/B_r$: a bigger
# query tile reads $K$ and $V$ fewer times. What the counters add:
#
# * **L2 → SMs** is the traffic the model counts, seen after each SM's L1 cache. Where it
#   is near the model, each block really does fetch all of $K$ and $V$ once; where it is
#   above, the SMs fetch whole 32-byte sectors for narrower accesses (a thread reading its
#   own row of $Q$ uses 4 bytes of a sector); where it is below, blocks on the same SM
#   found tiles in L1.
# * **HBM** is what is left after L2. Where it sits far below the model, the L2 cache
#   served the re-reads of $K$ and $V$ to the blocks of the same head: on this GPU the
#   tile size then moves traffic between L2 and the SMs more than traffic to HBM. Theorem
#   2's "fewer HBM accesses for a larger $M$" describes the SRAM-to-main-memory traffic of
#   one processor; on a GPU, the level where that traffic shows is the one that the
#   numbers above put it at.
# * **Writes**: $O$ and $L$ once, whatever the tiles.
#
# ## 5 · A roofline
#
# A kernel that moves $Y$ bytes between HBM and the chip and does $W$ floating-point
# operations has the *arithmetic intensity* $I = W / Y$ (FLOP per byte). With a compute ceiling $P$ (FLOP/s)
# and a memory bandwidth $\beta$ (bytes/s) it cannot run faster than
#
# $$ \text{attainable} = \min(P,\; I \cdot \beta). $$
#
# Left of the ridge $I^* = P/\beta$ a kernel is bound by memory, right of it by
# arithmetic. The ceilings in the first cell are the H200's, measured on 2026-11-30: 51
# TFLOP/s for float32 on the ordinary FMA units (cuBLAS GEMM with TF32 off; the datasheet
# says 67), 403 TFLOP/s for TF32 on the tensor cores (cuBLAS), and 4.2 TB/s HBM bandwidth
# (a device-to-device copy). The tensor-core rungs compute each float32 product as three
# TF32 products ("3xTF32", notebook 04), so their float32-accurate ceiling is at most a
# third of the TF32 one.
#
# Each numbaflash kernel timed at `HBM_SHAPE` in section 2 is placed at the intensity
# that section 4's model gives it with its own $B_r$ (as `explain` plans it; 1 for v1,
# which reads $K$ and $V$ once per row), and v2 also at the intensity of its measured HBM
# bytes, all at the TFLOP/s measured in section 2. SDPA's bytes are not measured here, so
# it is a horizontal line.

# %%
flops_hbm = bench.flops(hb, hh, hn, hn, hd, False, "forward")
floor_bytes = item * hb * hh * 4 * hn * hd + 4 * hb * hh * hn          # Q, K, V read, O written once
at_shape = {r["impl"]: r["tflops"] for r in fwd
            if (r["B"], r["H"], r["Sk"], r["d"]) == HBM_SHAPE and r["tflops"] is not None}
if not at_shape:
    print(f"section 2 did not time the forward at HBM_SHAPE {HBM_SHAPE}: no measured points")

points = []                      # (label, intensity, measured TFLOP/s, colour, marker)
hbm_spec = spec((hb, hh, hn, hd), DTYPE)
for impl in at_shape:
    if impl.startswith("numbaflash"):
        version = None if impl == "numbaflash" else impl.split("_")[1]
        br = numbaflash.explain(hbm_spec, hbm_spec, hbm_spec, version=version).Br or 1
        intensity = flops_hbm / sum(hbm.model_bytes(hb, hh, hn, hd, br, item))
        color, marker = STYLE.get(impl, ("C8", "x"))
        points.append((f"{label(fwd, impl, 'forward')}, model bytes (Br = {br})", intensity,
                       at_shape[impl], color, marker))
v2_measured = next((e for e in measured if (e["Br"], e["Bc"]) == default_pair), None)
v2_impl = "numbaflash" if default_forward(hd, DTYPE, hn) == "v2" else "numbaflash_v2"
if v2_measured is not None and v2_impl in at_shape:       # section 4 measured v2, default tiles
    intensity = flops_hbm / (v2_measured["dram_read"] + v2_measured["dram_write"])
    points.append(("numbaflash v2, measured HBM bytes", intensity, at_shape[v2_impl],
                   STYLE["numbaflash_v2"][0], "*"))

fig, ax = plt.subplots(figsize=(9, 5.5))
x = np.logspace(-1, 4.5, 300)
for peak, name, ls in ((PEAK_FP32, "float32 FMA ceiling", "-"),
                       (PEAK_TF32, "TF32 tensor-core ceiling", "--"),
                       (PEAK_TF32 / 3, "3xTF32 (a third of TF32)", ":")):
    ax.plot(x, np.minimum(peak, x * HBM_BYTES_PER_S) / 1e12, "k", ls=ls, lw=1.2,
            label=f"{name}: {peak / 1e12:.0f} TFLOP/s")
ax.axvline(flops_hbm / floor_bytes, color="gray", ls="-.", lw=1,
           label="intensity if Q, K, V, O crossed HBM once")
if "sdpa_efficient" in at_shape:
    ax.axhline(at_shape["sdpa_efficient"], color="C3", lw=1.5,
               label=f"PyTorch SDPA EFFICIENT: {at_shape['sdpa_efficient']:.1f} TFLOP/s (bytes not measured)")
for name, intensity, tf, color, marker in points:
    ax.plot(intensity, tf, marker, color=color, ms=11, label=f"{name}: {tf:.1f} TFLOP/s")
ax.set_xscale("log")
ax.set_yscale("log")
ax.set_ylim(0.1, 1000)
ax.set_xlabel("arithmetic intensity (FLOP per HBM byte)")
ax.set_ylabel("TFLOP/s")
ax.set_title(f"forward at {HBM_SHAPE}, {DTYPE}; ceilings: the H200's (first cell)")
ax.grid(True, which="both", alpha=0.3)
ax.legend(fontsize="x-small", loc="lower right")
plt.show()

print(f"ridge points: float32 FMA {PEAK_FP32 / HBM_BYTES_PER_S:.0f} FLOP/B, "
      f"TF32 {PEAK_TF32 / HBM_BYTES_PER_S:.0f} FLOP/B")
for name, intensity, tf, _, _ in points:
    roof = min(PEAK_FP32, intensity * HBM_BYTES_PER_S) / 1e12
    side = "right" if intensity > PEAK_FP32 / HBM_BYTES_PER_S else "left"
    print(f"{name:>55}: intensity {intensity:8.1f} FLOP/B ({side} of the float32 ridge), "
          f"measured {tf:5.1f} TFLOP/s, float32 FMA roof there {roof:5.1f} TFLOP/s"
          + ("  <- ABOVE the bandwidth roof: these bytes did not all come from HBM"
             if tf * 1e12 > intensity * HBM_BYTES_PER_S * 1.05 else ""))

# %% [markdown]
# A point above the sloped part of a roof is not a contradiction but a message: at that
# intensity the bytes it was given could not have crossed HBM in the time measured, so
# the caches served part of them, and the model's intensity undercounts. The distance
# between a point and the ceiling above it is what the kernel leaves on the table.
#
# ## 6 · What limits the fastest version
#
# The measured gap, at the largest forward size timed, and the resources the compiler
# gave each kernel compiled in this run (registers per thread; local memory per thread,
# where non-zero means registers spilled to memory; shared memory per block, static: the
# versions that take theirs at launch, dynamically, report only their static part here,
# and `explain` in section 1 printed the full amount):

# %%
n_big = max(N_FORWARD)
big = [r for r in fwd if r["Sk"] == n_big and r["tflops"] is not None
       and r["impl"].startswith("numbaflash")]
if big:
    best = max(big, key=lambda r: r["tflops"])
    line = (f"fastest numbaflash forward at N = {n_big}, {DTYPE}: "
            f"{label(fwd, best['impl'], 'forward')}, "
            f"{best['tflops']:.1f} TFLOP/s ({best['ms']:.1f} ms), "
            f"{best['tflops'] * 1e12 / PEAK_FP32:.0%} of the float32 FMA ceiling, "
            f"{best['tflops'] * 1e12 / (PEAK_TF32 / 3):.0%} of the 3xTF32 ceiling")
    if best["vs_sdpa"] is not None:
        line += f"; {best['vs_sdpa']:.2f}x SDPA EFFICIENT's speed"
    print(line)
for what in ("backward", "fwd+bwd"):
    rows = [r for r in fb if r["Sk"] == max(N_FWD_BWD) and r["what"] == what
            and r["impl"] == "numbaflash" and r["ms"]]
    if rows and rows[0]["vs_sdpa"] is not None:
        print(f"{what} at N = {max(N_FWD_BWD)}: {label(fb, 'numbaflash', what)}, "
              f"{rows[0]['tflops']:.2f} TFLOP/s, {rows[0]['vs_sdpa']:.3f}x SDPA EFFICIENT's speed")


def per_signature(x):
    """numba reports one value per compiled signature (a dict): 'a/b', or '' if none."""
    values = x.values() if isinstance(x, dict) else [x]
    return "/".join(str(v) for v in sorted(set(values)))


kernels = []
for d, dtype in ((D, DTYPE), (D_WIDE, DTYPE), (D, "float16")):
    q_spec = spec((B, H, n_big, d), dtype)
    p = validate.check_attention_inputs(q_spec, q_spec, q_spec, False, None)
    for version in fwd_kernels.VERSIONS:
        try:
            plan = numbaflash.explain(q_spec, q_spec, q_spec, version=version)
        except ValueError:
            continue                               # this version cannot run this input
        kernels.append((f"forward {version}, d={d} {dtype}", plan,
                        fwd_kernels.module(version).kernel(plan, p)))
    for plan in numbaflash.explain_backward(q_spec, q_spec, q_spec):
        kernel_module = bwd_kernels.module("preprocess" if plan.kernel == "backward_preprocess"
                                           else plan.version)
        kernels.append((f"{plan.kernel}, d={d} {dtype}", plan, kernel_module.kernel(plan, p)))
print(f"\n{'kernel':>42} {'threads/block':>14} {'registers':>10} {'local B':>8} {'shared B':>9}")
for name, plan, kernel in kernels:
    if not hasattr(kernel, "get_regs_per_thread"):
        print(f"{name:>42}  (this Numba reports no resources)")
        continue
    regs, local, shared = (per_signature(f()) for f in (kernel.get_regs_per_thread,
                                                         kernel.get_local_mem_per_thread,
                                                         kernel.get_shared_mem_per_block))
    if not regs:
        continue                                   # not compiled in this run
    print(f"{name:>42} {plan.block[0]:14d} {regs:>10} {local:>8} {shared:>9}")

# %% [markdown]
# What the measurements say, and where to read why:
#
# * **The gap.** The first lines above give the fastest forward's share of the GPU's
#   ceilings and of PyTorch's speed, and the backward's. Section 5's printout says on
#   which side of the ridge each kernel sits: to the right, arithmetic sets the ceiling,
#   not HBM bandwidth.
# * **Why.** [docs/performance.md](../docs/performance.md), "What limits the fastest
#   versions", reads the default kernels with Nsight Compute and says what holds them
#   back. The table above shows two of the resources it weighs: registers (an SM has
#   65536, so registers × threads per block bounds how many blocks it holds at once) and
#   shared memory. Each version's file, and [docs/kernels.md](../docs/kernels.md), say
#   what that version changed and what the change measured.
# * **What comes next** is listed in docs/performance.md under "What would close it".
#   Each new version is added beside the old ones, and this notebook, rerun, measures it
#   the same way.

# %%
print(f"this notebook ran for {time.perf_counter() - T_START:.0f} s")
