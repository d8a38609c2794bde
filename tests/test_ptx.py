"""Every forward kernel compiles to PTX for sm_90 and links with nvJitLink (no GPU needed).

The simulator runs the kernels but never compiles them; this is where the real compiler
sees them. tests/ptx_check.py does the work in a subprocess with NUMBA_ENABLE_CUDASIM=0
(the simulator's numba.cuda cannot compile), one subprocess per dtype so that
pytest-xdist spreads them over its workers. Checked for every entry:

- compile_ptx succeeds, and nvJitLink links the PTX for sm_90 (ptxas accepts it, e.g.
  the static shared memory fits);
- float16 and float32 kernels contain no .f64 instruction or register (a float64 literal
  or a Python float sneaking into the arithmetic doubles its cost on the GPU);
- forward v2 at d = 64 in float32 (the common case) spills no registers;
- every kernel's PTX, its mangled names normalised (ptx_check.normalised_ptx), has the
  fingerprint recorded in tests/ptx_fingerprints.json: moving or renaming code must not
  change what the compiler makes of it. A change that means to change a kernel's PTX
  rewrites the record (``python tests/ptx_check.py --fingerprints
  tests/ptx_fingerprints.json`` with NUMBA_ENABLE_CUDASIM=0) and says so in its commit.

The registers, stack and spills ptxas reports are printed in the terminal summary
("numbaflash PTX report"), for every run.
"""

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "ptx_check.py")
FINGERPRINTS = os.path.join(HERE, "ptx_fingerprints.json")


def run_ptx_check(*args):
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    proc = subprocess.run([sys.executable, SCRIPT, *args], env=env, capture_output=True,
                          text=True, timeout=900, cwd=os.path.dirname(HERE))
    results = [json.loads(line[len("PTXCHECK "):]) for line in proc.stdout.splitlines()
               if line.startswith("PTXCHECK ")]
    if proc.returncode != 0 or not results:
        pytest.fail(f"ptx_check.py {' '.join(args)} exited {proc.returncode} with "
                    f"{len(results)} results\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n"
                    f"{proc.stderr[-5000:]}")
    assert_fingerprints(results)
    return results


def recorded_fingerprints():
    with open(FINGERPRINTS) as f:
        return json.load(f)


def assert_fingerprints(results):
    """Every compiled kernel's PTX fingerprint is the recorded one (module docstring)."""
    record = recorded_fingerprints()
    changed = [f"{r['name']}: {r['fingerprint']} (recorded {record['kernels'].get(r['name'])})"
               for r in results if r["ok"] and r["fingerprint"] != record["kernels"].get(r["name"])]
    assert not changed, (
        "the PTX of these kernels differs from tests/ptx_fingerprints.json (compiled with "
        f"{record['toolchain']}; if this toolchain differs, regenerate the record from the "
        "commit before your change and compare again):\n" + "\n".join(changed))


def assert_compiled_without_f64(results, dtype):
    """Every kernel compiled and linked, and those that must avoid float64 (float16 and
    float32 kernels) have none in their PTX."""
    failed = [f"{r['name']}: {r['error']}\n{r.get('traceback', '')}" for r in results
              if not r["ok"]]
    assert not failed, "kernels that do not compile or link:\n" + "\n".join(failed)
    with_f64 = [f"{r['name']}: {r['f64_count']} lines, e.g. {r['f64_lines'][:3]}"
                for r in results if r["no_f64"] and r["f64_count"]]
    assert not with_f64, f"{dtype} kernels with float64 in their PTX:\n" + "\n".join(with_f64)


def table(results):
    rows = [f"{'kernel':<46} {'regs':>5} {'stack':>6} {'spill st':>9} {'spill ld':>9} "
            f"{'smem':>6} {'f64':>4}"]
    for r in results:
        rows.append(f"{r['name']:<46} {r.get('registers')!s:>5} {r.get('stack_bytes')!s:>6} "
                    f"{r.get('spill_stores')!s:>9} {r.get('spill_loads')!s:>9} "
                    f"{r.get('smem_bytes')!s:>6} {r.get('f64_count')!s:>4}")
    return "\n".join(rows)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_forward_kernels_compile_and_link_for_sm90(dtype, record_property):
    results = run_ptx_check("--group", "forward", f"--match=-{dtype}-", "--link")
    record_property("ptx_report", table(results))
    print(table(results))
    # every version x 4 head dims x causal off/on, where the version supports it (v3, v6,
    # v8: float16/float32, d <= 128; v7: float16; v9: float32): nothing silently left out
    from numbaflash.kernels.forward import VERSIONS
    # (v10: its own group, test_forward_v10_kernels_compile_and_link_for_sm90)
    want = 8 * len([v for v in VERSIONS if v not in ("v3", "v6", "v7", "v8", "v9", "v10")])
    if "v3" in VERSIONS and dtype != "float64":
        want += 6
    if dtype != "float64":                          # v6 and v8
        want += 8 * len([v for v in VERSIONS if v in ("v6", "v8")])
    if "v9" in VERSIONS and dtype == "float32":     # v9: float32 inputs only
        want += 8
    if "v7" in VERSIONS and dtype == "float16":     # v7: float16 inputs only
        want += 8
    assert len(results) == want, [r["name"] for r in results]

    assert_compiled_without_f64(results, dtype)

    for r in results:
        assert r["registers"] is not None, f"no register count in ptxas's log:\n{r['log']}"
        assert r["spill_stores"] is not None, f"no spill count in ptxas's log:\n{r['log']}"

    if dtype == "float32":
        v2_d64 = [r for r in results if r["name"].startswith("forward_v2-float32-d64-")]
        assert len(v2_d64) == 2
        for r in v2_d64:
            assert r["spill_stores"] == 0 and r["spill_loads"] == 0, (
                f"{r['name']} spills registers: {r['spill_stores']} bytes stored, "
                f"{r['spill_loads']} loaded\n{r['log']}")


def test_f64_detector_sees_float64():
    """The .f64 check can fail: a float32 kernel with a float64 literal is caught."""
    code = r"""
import math, numba
from numba import cuda
def k(x):
    x[0] = x[0] * 0.1 + math.exp(numba.float64(x[0]))   # float64 sneaks in
ptx, _ = cuda.compile_ptx(k, (numba.types.Array(numba.float32, 1, "C"),), cc=(9, 0))
import ptx_check
print("F64LINES", len(ptx_check.f64_lines(ptx)))
"""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0", PYTHONPATH=os.pathsep.join(
        [HERE, os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    count = int(proc.stdout.split("F64LINES")[1].split()[0])
    assert count > 0


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_variant_kernels_compile_and_link_for_sm90(dtype, record_property):
    """The kernels specialised for attention variants (window, softcap, ALiBi, masks, user
    score_mod/mask_mod; ptx_check.variant_entries) compile and link for sm_90, and the
    built-in ones keep float16/float32 kernels free of float64."""
    results = run_ptx_check("--group", "variants", f"--match=-{dtype}-", "--link")
    record_property("ptx_report", table(results))
    # head dims x variants x kernels, and the tile table for the two variants with a mask;
    # then the fast versions at d = 64 per variant (ptx_check.fast_variant_entries):
    # float32: forward v5, v8, v9 and the two kernels of backward v4, v6 and v10; float16:
    # forward v5, v8, v7 and backward v4 and v6; float64: none (they compute in float32)
    n_d = 2 if dtype == "float32" else 1
    fast = {"float16": 7, "float32": 9, "float64": 0}[dtype]
    assert len(results) == n_d * 3 * 4 + 2 + 3 * fast, [r["name"] for r in results]
    assert_compiled_without_f64(results, dtype)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_decode_kernels_compile_and_link_for_sm90(dtype, record_property):
    """The decoding kernels (kernels/decode/, ptx_check.decode_entries) compile and link
    for sm_90: split_kv at four head dims x one and two rows per block x plain, causal
    and causal with window, softcap and ALiBi (float16 and float32: with one element a
    load and with 8-byte loads), split_kv_mma and split_kv_mma_t (float16) at three head
    dims with the same three variants, split_kv_mma with three stages at d = 128 (plain,
    and the variants together),
    then combine, combine_batched and append; the float16 and float32 ones without
    float64."""
    results = run_ptx_check("--group", "decode", f"--match=-{dtype}", "--link")
    record_property("ptx_report", table(results))
    builds = 1 if dtype == "float64" else 2
    # split_kv_mma and split_kv_mma_t at 3 head dims x 3 variants, and 2 builds of
    # split_kv_mma with three stages
    mma = 2 * 3 * 3 + 2 if dtype == "float16" else 0
    assert len(results) == 4 * 2 * 3 * builds + mma + 3, [r["name"] for r in results]
    assert_compiled_without_f64(results, dtype)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_varlen_kernels_compile_and_link_for_sm90(dtype, record_property):
    """The kernels a packed batch runs by default (ptx_check.varlen_entries: built with
    Variant(varlen=True), reading (heads, total, d) strided views) compile and link for
    sm_90: float16 forward v7 and v10 and backward v6 and v9 (its dQ kernel also built
    for a batch of equal lengths); float32 forward v5, v8, v9 and backward v4, v6, v10;
    float64 forward v2 and backward v1; and the D kernel on views. The float16 and
    float32 ones without float64."""
    results = run_ptx_check("--group", "varlen", f"--match=-{dtype}-varlen", "--link")
    record_property("ptx_report", table(results))
    assert len(results) == {"float16": 8, "float32": 10, "float64": 4}[dtype], (
        [r["name"] for r in results])
    assert_compiled_without_f64(results, dtype)


def test_bfloat16_kernels_compile_and_link_for_sm90(record_property):
    """The kernels bfloat16 inputs run (ptx_check.bfloat16_entries): forward v7 on the
    bfloat16 tensor cores at d = 59, 64, 128, full and causal, with every variant and on a
    packed batch's views, the decoding kernels (split_kv with one element and 8 bytes a
    load, split_kv_mma, split_kv_mma_t, combine, combine_batched, append) on bfloat16 caches, and the two
    conversion kernels; none uses float64, and each has its recorded fingerprint."""
    results = run_ptx_check("--group", "bfloat16", "--link")
    record_property("ptx_report", table(results))
    assert len(results) == 37, [r["name"] for r in results]
    assert_compiled_without_f64(results, "bfloat16")
    assert_fingerprints(results)


def test_backward_atomic_dq_kernels_compile_and_link_for_sm90(record_property):
    """Backward v8 (ptx_check.backward_atomic_dq_entries: v6's dK/dV kernel adding dQ by
    atomic adds) for float16 and float32 at d = 64 and 128, full, causal and GQA, with the
    built-in variants and dropout, on a packed batch's views, and its zero fill and float16
    rounding: each compiles and links for sm_90 without float64, has its recorded
    fingerprint, and spills at most 8 bytes (none at d = 64 without GQA or variants).
    (ptxas's counts here are without v8's register cap at d = 64, which is given at link
    time when the kernel is launched: v8_atomic_dq.V8_MAX_REGISTERS.)"""
    results = run_ptx_check("--group", "backward_atomic_dq", "--link")
    record_property("ptx_report", table(results))
    print(table(results))
    assert len(results) == 2 * 2 * 3 + 2 + 3, [r["name"] for r in results]
    assert_compiled_without_f64(results, "float16 and float32")
    for r in results:
        assert r["spill_stores"] <= 8 and r["spill_loads"] <= 8, (
            f"{r['name']} spills {r['spill_stores']} bytes\n{r['log']}")
        name = r["name"]
        if "-d64-" in name and "gqa" not in name:
            assert r["spill_stores"] == 0 and r["stack_bytes"] == 0, f"{name}\n{r['log']}"


def test_forward_v10_kernels_compile_and_link_for_sm90(record_property):
    """Forward v10 (ptx_check.forward_v10_entries: ldmatrix and cp.async) for float16 and
    bfloat16 at d = 64 and 128, full and causal, and at d = 59 (element-by-element loads):
    each compiles and links for sm_90 without float64, has its recorded fingerprint, and
    spills nothing."""
    results = run_ptx_check("--group", "forward_v10", "--link")
    record_property("ptx_report", table(results))
    print(table(results))
    assert len(results) == 2 * 5, [r["name"] for r in results]
    assert_compiled_without_f64(results, "float16 and bfloat16")
    for r in results:
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, f"{r['name']}\n{r['log']}"


def test_fingerprint_record_covers_every_entry():
    """The record names exactly the kernels ptx_check.py compiles (none added unrecorded,
    none recorded that no longer exist), and it was made with the toolchain CI installs."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    proc = subprocess.run([sys.executable, SCRIPT, "--list"], env=env, capture_output=True,
                          text=True, timeout=300, cwd=os.path.dirname(HERE))
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = recorded_fingerprints()
    assert set(proc.stdout.split()) == set(record["kernels"])
    code = "import sys; sys.path.insert(0, 'tests'); import json, ptx_check; " \
           "print(json.dumps(ptx_check.toolchain()))"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=300, cwd=os.path.dirname(HERE))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.splitlines()[-1]) == record["toolchain"]


def test_fingerprint_sees_a_changed_kernel():
    """The fingerprint can fail: one changed instruction changes it; a renamed module does
    not."""
    sys.path.insert(0, HERE)
    import ptx_fingerprint as ptx_check
    ptx = ("//\n// Generated by NVIDIA NVVM Compiler\n.visible .entry _ZN10numbaflash7kernels"
           "7forward3abcE5Array(\n\t.param .u64 _ZN10numbaflash7kernels7forward3abcE5Array_param_0"
           "\n)\n{\n\tadd.f32 \t%f1, %f2, %f3;\n\tcall _ZN10numbaflash7kernels4warp8quad_maxEf;\n}")
    moved = ptx.replace("7kernels7forward3abc", "7kernels7forward9v2_flash23abc").replace(
        "4warp8quad_max", "5warps8quad_max")
    changed = ptx.replace("add.f32", "sub.f32")
    assert ptx_check.fingerprint(moved) == ptx_check.fingerprint(ptx)
    assert ptx_check.fingerprint(changed) != ptx_check.fingerprint(ptx)
