"""The benchmark (numbaflash/bench.py, ``python -m numbaflash bench``): its counting, its
records, its refusal to time a wrong result, its JSON, and its argument errors.

Runs on the simulator in CI (tiny shapes, one timed run: the times themselves mean
nothing there) and on a GPU. The PyTorch reference is tested on CPU tensors when
PyTorch is importable, and skipped otherwise.
"""

import json
import time

import numpy as np
import pytest
from numba import cuda

import numbaflash
from numbaflash import bench, reference
from numbaflash.__main__ import main

TINY = (1, 1, 32, 8)                     # (B, H, N, d): one block per kernel
RECORD_KEYS = {"B", "H", "Sq", "Sk", "d", "causal", "dtype", "what", "impl", "kernel", "ms",
               "tflops", "vs_sdpa", "extra_mib", "max_err", "bound", "ok"}


# --- counting ------------------------------------------------------------------------


def test_flops_follow_the_convention():
    # (2, 16, 4096, 64): 4 * 2 * 16 * 4096 * 4096 * 64 = 2^37 (PERFORMANCE.md's convention)
    fwd = 4 * 2 * 16 * 4096 * 4096 * 64
    assert fwd == 137_438_953_472
    assert bench.flops(2, 16, 4096, 4096, 64, False, "forward") == fwd
    assert bench.flops(2, 16, 4096, 4096, 64, True, "forward") == fwd / 2
    assert bench.flops(2, 16, 4096, 4096, 64, False, "backward") == 2.5 * fwd
    assert bench.flops(2, 16, 4096, 4096, 64, True, "fwd+bwd") == 3.5 * fwd / 2
    # lab/runs/2026-11-30/05_gpu_check.txt: SDPA EFFICIENT forward 3.999 ms = 34.37 TFLOP/s
    assert fwd / 3.999e-3 / 1e12 == pytest.approx(34.37, abs=0.01)


def test_flops_count_visible_pairs_when_causal_lengths_differ():
    # Bottom-right, Sq=3, Sk=5: rows see 3, 4, 5 keys = 12 pairs; forward = 4 * 12 * d.
    assert bench.flops(1, 1, 3, 5, 1, True, "forward") == 4 * 12
    # Sq=5, Sk=3: rows see 0, 0, 1, 2, 3 keys = 6 pairs (two rows see no key).
    assert bench.flops(1, 1, 5, 3, 2, True, "forward") == 4 * 6 * 2
    assert bench.flops(1, 1, 5, 3, 2, False, "forward") == 4 * 15 * 2
    with pytest.raises(ValueError, match="what must be one of"):
        bench.flops(1, 1, 4, 4, 4, False, "sideways")


def test_sdpa_flash_is_timed_for_16_bit_inputs_only():
    # SDPA's FLASH backend has no float32 or float64 kernel: asking it would only record
    # an error for every float32 case.
    assert bench.sdpa_impls("float16") == ("sdpa_efficient", "sdpa_math", "sdpa_flash")
    assert bench.sdpa_impls("bfloat16") == ("sdpa_efficient", "sdpa_math", "sdpa_flash")
    assert bench.sdpa_impls("float32") == ("sdpa_efficient", "sdpa_math")
    assert bench.sdpa_impls("float64") == ("sdpa_efficient", "sdpa_math")


def test_time_ms_is_the_median_of_the_timed_runs():
    calls = []

    def fn():
        calls.append(1)
        time.sleep(0.01)

    ms = bench.time_ms(fn, repeats=3, warmup=2)
    assert len(calls) == 5                           # 2 warm-up + 3 timed
    assert 9.0 <= ms < 200.0                         # about 10 ms of sleep per run
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        bench.time_ms(fn, repeats=0)


def test_time_ms_queued_is_a_call_of_the_calls_back_to_back():
    calls = []

    def fn():
        calls.append(1)
        time.sleep(0.005)

    ms = bench.time_ms_queued(fn, calls=4, rounds=3, warmup=1)
    assert len(calls) == 1 + 4 * 3                   # 1 warm-up + 3 rounds of 4 calls
    assert 4.5 <= ms < 100.0                         # about 5 ms of sleep per call
    with pytest.raises(ValueError, match="calls and rounds must be >= 1"):
        bench.time_ms_queued(fn, calls=0)


def test_extra_memory_counts_scratch_not_outputs():
    if numbaflash.backend() == "simulator":
        assert bench.extra_memory_bytes(lambda: None) is None      # nothing to read there
        return
    mib = 2**20

    def fn():
        scratch = cuda.device_array(16 * mib, dtype=np.uint8)      # freed when fn returns
        scratch[:1].copy_to_device(np.zeros(1, np.uint8))
        return cuda.device_array(8 * mib, dtype=np.uint8)          # the output
    # The driver's free memory is the whole GPU's: other processes on the same GPU (such as
    # pytest-xdist workers) allocating or freeing in between move the reading (504 MiB
    # under 15 workers, lab/runs/2026-12-01/16_tests_arrays_api_bench.txt). So a few
    # tries; a real error (the output not subtracted: 24 MiB; the scratch not seen: 0) is
    # off on every one of them.
    readings = [bench.extra_memory_bytes(fn) for _ in range(5)]
    assert any(16 * mib <= extra < 20 * mib for extra in readings), readings


# --- the benchmark on a tiny problem -------------------------------------------------


@pytest.fixture(scope="module")
def tiny_records():
    return bench.run([TINY], causal=(False, True), repeats=1, warmup=0, sdpa=False,
                     progress=False)


def test_run_returns_checked_well_formed_records(tiny_records):
    records = tiny_records
    assert [(r["causal"], r["what"]) for r in records] == [
        (c, w) for c in (False, True) for w in ("forward", "backward", "fwd+bwd")]
    q = np.zeros((1, 1, 32, 8), np.float32)
    forward_kernel = numbaflash.explain(q, q, q).kernel
    backward_kernels = "+".join(p.kernel for p in numbaflash.explain_backward(q, q, q))
    for r in records:
        assert RECORD_KEYS <= set(r)
        assert (r["B"], r["H"], r["Sq"], r["Sk"], r["d"]) == (1, 1, 32, 32, 8)
        assert r["impl"] == "numbaflash" and r["dtype"] == "float32"
        assert r["ok"] is True, r
        assert 0 <= r["max_err"] <= r["bound"]
        assert r["ms"] > 0
        work = bench.flops(1, 1, 32, 32, 8, r["causal"], r["what"])
        assert r["tflops"] == pytest.approx(work / (r["ms"] * 1e-3) / 1e12)
        assert r["vs_sdpa"] is None                   # sdpa=False
        expected = {"forward": forward_kernel, "backward": backward_kernels,
                    "fwd+bwd": f"{forward_kernel} + {backward_kernels}"}[r["what"]]
        assert r["kernel"] == expected
        names = {"forward": {"out", "lse"}, "backward": {"dq", "dk", "dv"},
                 "fwd+bwd": {"out", "lse", "dq", "dk", "dv"}}[r["what"]]
        assert set(r["check"]) == names
    json.dumps(records)                               # plain JSON types only


def test_format_table_and_plot(tiny_records, tmp_path):
    table = bench.format_table(tiny_records)
    assert len([line for line in table.splitlines() if line.startswith("(1,1,32,32,8)")]) == 6
    if numbaflash.backend() == "simulator":
        assert "simulator" in table
    pytest.importorskip("matplotlib")
    fig = bench.plot(tiny_records, tmp_path / "bench.png")
    assert (tmp_path / "bench.png").stat().st_size > 0
    assert len(fig.axes) == 2                          # non-causal and causal panels


def test_versions_and_fully_masked_rows():
    # Sq > Sk with the bottom-right mask: the first rows see no key and must be exact 0.
    records = bench.run([(1, 1, 40, 24, 8)], causal=True, passes=("forward",),
                        versions=(None, "v1", "v3"), repeats=1, warmup=0, sdpa=False,
                        progress=False)
    by_impl = {r["impl"]: r for r in records}
    assert set(by_impl) == {"numbaflash", "numbaflash_v1", "numbaflash_v3"}
    assert by_impl["numbaflash_v1"]["ok"] is True
    assert by_impl["numbaflash_v1"]["kernel"] == "forward_v1"
    # v3 (tensor cores) runs on every backend, the simulator included (kernels/simulated.py)
    assert by_impl["numbaflash_v3"]["ok"] is True
    assert by_impl["numbaflash_v3"]["kernel"] == "forward_v3"
    assert not bench.wrong_results(records)


def test_bfloat16_is_checked_then_timed():
    # bfloat16 inputs (ml_dtypes): checked against the float64 reference with a bfloat16
    # baseline, then timed, forward and backward; v7 (the 16-bit tensor cores) asked for too.
    records = bench.run([(1, 1, 24, 20, 16)], causal=True, dtype="bfloat16",
                        passes=("forward", "backward"), versions=(None, "v7"), repeats=1,
                        warmup=0, sdpa=False, progress=False)
    by = {(r["what"], r["impl"]): r for r in records}
    assert by[("forward", "numbaflash_v7")]["kernel"] == "forward_v7"
    assert all(r["ok"] is True and r["dtype"] == "bfloat16" for r in records), records
    assert not bench.wrong_results(records)


# --- a wrong kernel gets no time ---------------------------------------------------------


def _scaled(array, factor):
    """A device array holding ``array * factor`` (a stand-in for a subtly wrong kernel)."""
    return cuda.to_device(array.copy_to_host() * array.dtype.type(factor))


def test_a_wrong_forward_is_refused(monkeypatch):
    real = numbaflash.attention

    def wrong_attention(*args, **kwargs):
        out, lse = real(*args, **kwargs)
        return _scaled(out, 1.01), lse
    monkeypatch.setattr(bench, "attention", wrong_attention)
    records = bench.run([TINY], causal=False, passes=("forward", "fwd+bwd"), repeats=1,
                        warmup=0, sdpa=False, progress=False)
    assert len(records) == 2
    for r in records:
        assert r["ok"] is False
        assert r["ms"] is None and r["tflops"] is None
        assert r["max_err"] > r["bound"]
    assert r["check"]["out"]["ok"] is False
    assert bench.wrong_results(records) == records
    assert bench.format_table(records).count("WRONG RESULT, not timed") == 2


def test_a_wrong_lse_is_refused(monkeypatch):
    # out is right; lse is off by 1e-3 (an lse of about 3.5 allows about 4e-5).
    real = numbaflash.attention

    def wrong_lse(*args, **kwargs):
        out, lse = real(*args, **kwargs)
        return out, cuda.to_device(lse.copy_to_host() + np.float32(1e-3))
    monkeypatch.setattr(bench, "attention", wrong_lse)
    (r,) = bench.run([TINY], causal=False, passes=("forward",), repeats=1, warmup=0,
                     sdpa=False, progress=False)
    assert r["ok"] is False and r["ms"] is None
    assert r["check"]["out"]["ok"] and not r["check"]["lse"]["ok"]
    assert r["max_err"] == r["check"]["lse"]["max_err"] > r["bound"]
    assert "WRONG RESULT, not timed" in bench.format_table([r])


def test_a_wrong_backward_is_refused(monkeypatch):
    real = numbaflash.attention_backward

    def wrong_backward(*args, **kwargs):
        dq, dk, dv = real(*args, **kwargs)
        return dq, _scaled(dk, 1.01), dv
    monkeypatch.setattr(bench, "attention_backward", wrong_backward)
    (r,) = bench.run([TINY], causal=True, passes=("backward",), repeats=1, warmup=0,
                     sdpa=False, progress=False)
    assert r["ok"] is False and r["ms"] is None
    assert r["check"]["dq"]["ok"] and r["check"]["dv"]["ok"] and not r["check"]["dk"]["ok"]


def test_cli_exits_non_zero_on_a_wrong_result(monkeypatch, capsys):
    real = numbaflash.attention
    monkeypatch.setattr(bench, "attention",
                        lambda *a, **k: (lambda o, l: (_scaled(o, 1.01), l))(*real(*a, **k)))
    status = main(["bench", "--shapes", "1x1x32x8", "--causal", "no", "--passes", "forward",
                   "--repeats", "1", "--warmup", "0", "--no-sdpa"])
    out, err = capsys.readouterr()
    assert status == 1
    assert "WRONG RESULT, not timed" in out
    assert "FAILED" in err


def test_fully_masked_rows_must_be_exactly_zero():
    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((1, 1, S, 4)).astype(np.float32)
                     for S in (6, 3, 3, 6))
    oracle = bench.NumpyOracle(q, k, v, dout, "bottom_right", "float32", backward=False)
    out = reference.forward(q, k, v, causal="bottom_right")[0].astype(np.float32)
    assert oracle.check("out", cuda.to_device(out))["ok"]
    out[0, 0, 0, 0] = 1e-30                 # row 0 sees no key; tiny, but not zero
    assert not oracle.check("out", cuda.to_device(out))["ok"]


def test_lse_of_fully_masked_rows_must_be_exactly_minus_inf():
    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((1, 1, S, 4)).astype(np.float32)
                     for S in (6, 3, 3, 6))
    oracle = bench.NumpyOracle(q, k, v, dout, "bottom_right", "float32", backward=False)
    lse = reference.forward(q, k, v, causal="bottom_right")[1].astype(np.float32)
    assert np.isneginf(lse[0, 0, :3]).all()  # rows 0-2 see no key
    check = oracle.check("lse", cuda.to_device(lse))
    assert check["ok"] and check["max_err"] <= check["bound"]
    for bad in (-1e30, np.nan, 0.0):        # very negative, but not -inf; NaN; 0
        wrong = lse.copy()
        wrong[0, 0, 1] = bad
        assert not oracle.check("lse", cuda.to_device(wrong))["ok"], bad
    wrong = lse.copy()
    wrong[0, 0, 4] += np.float32(1e-3)      # a row that sees keys, off by 1e-3
    assert not oracle.check("lse", cuda.to_device(wrong))["ok"]


# --- the command line --------------------------------------------------------------------


def test_cli_writes_json_that_matches_the_table(tmp_path, capsys):
    path = tmp_path / "bench.json"
    status = main(["bench", "--shapes", "1x1x32x8", "--causal", "yes", "--passes",
                   "forward,backward", "--repeats", "1", "--warmup", "0", "--no-sdpa",
                   "--json", str(path)])
    out, err = capsys.readouterr()
    assert status == 0, out + err
    data = json.loads(path.read_text())
    assert {"date", "gpu", "python", "numba", "numba_cuda", "numpy", "torch"} <= set(data["meta"])
    records = data["records"]
    assert [(r["what"], r["impl"], r["causal"]) for r in records] == [
        ("forward", "numbaflash", True), ("backward", "numbaflash", True)]
    for r in records:
        assert RECORD_KEYS <= set(r) and r["ok"] is True
        assert f"{r['ms']:.3f}" in out and f"{r['max_err']:.2e}" in out
    assert "bench [2/2]" in err                                  # progress on stderr


@pytest.mark.parametrize("argv, message", [
    (["--shapes", "2x16x4096"], "--shapes: a shape has 4 numbers"),
    (["--shapes", "2xAx64x8"], "not numbers separated by 'x'"),
    (["--shapes", "1x1x0x8"], "at least 1"),
    (["--shapes", "1x1x32x300"], "head dim 300 exceeds"),
    (["--passes", "forward,sideways"], "--passes: sideways"),
    (["--versions", "v99"], "--versions: v99"),
    (["--repeats", "0"], "repeats must be an integer >= 1"),
    (["--warmup", "-1"], "warmup must be an integer >= 0"),
])
def test_cli_argument_errors_name_the_problem(argv, message, capsys):
    assert main(["bench"] + argv) == 2
    err = capsys.readouterr().err
    assert message in err and "bench: error" in err


def test_cli_rejects_unknown_choices(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "--causal", "maybe"])
    assert e.value.code == 2
    assert "--causal" in capsys.readouterr().err


@pytest.mark.parametrize("kwargs, message", [
    (dict(shapes=[(1, 1, 32)]), "4 numbers"),
    (dict(shapes=(1, 1, 32, 8)), "a list of shapes; got one shape"),
    (dict(shapes=[TINY], causal="yes"), "causal must be a bool"),
    (dict(shapes=[TINY], dtype="int8"), "dtype must be one of"),
    (dict(shapes=[TINY], passes=("forward", "sideways")), "passes must be"),
    (dict(shapes=[TINY], versions=("v99",)), "versions must be"),
    (dict(shapes=[TINY], repeats=0), "repeats must be"),
    (dict(shapes=[]), "shapes is empty"),
])
def test_run_argument_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        bench.run(**kwargs, progress=False)


def test_json_writes_nan_as_a_string(tmp_path):
    path = tmp_path / "r.json"
    bench.save_json([{"max_err": float("nan"), "ms": None}], path, meta={"date": "x"})
    assert json.loads(path.read_text())["records"] == [{"max_err": "nan", "ms": None}]


# --- the PyTorch reference (on CPU tensors; skipped without PyTorch) ----------------------


@pytest.mark.parametrize("shape, causal", [((2, 3, 7, 7, 4), None),
                                           ((1, 2, 9, 5, 3), "bottom_right"),
                                           ((1, 2, 5, 9, 3), "bottom_right")])
def test_torch_references_match_numbaflash_reference(shape, causal):
    torch = pytest.importorskip("torch")
    B, H, Sq, Sk, d = shape
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(B, H, S, d, generator=g) for S in (Sq, Sk, Sk, Sq))
    for chunk_bytes in (2**31, 1):                   # all heads at once, and one by one
        res = bench.torch_references(torch, q, k, v, do, causal, torch.float64, True,
                                     chunk_bytes=chunk_bytes)
        want = (reference.forward(q.numpy(), k.numpy(), v.numpy(), causal=causal)[0],
                *reference.backward(do.numpy(), q.numpy(), k.numpy(), v.numpy(), causal=causal))
        for name, w in zip(("out", "dq", "dk", "dv"), want):
            np.testing.assert_allclose(res[name].numpy().reshape(w.shape), w, atol=1e-12)
        lse = reference.forward(q.numpy(), k.numpy(), v.numpy(), causal=causal)[1]
        got = res["lse"].numpy().reshape(lse.shape)
        np.testing.assert_array_equal(np.isneginf(got), np.isneginf(lse))  # rows seeing no key
        np.testing.assert_allclose(got, lse, atol=1e-12)
    oracle = bench.TorchOracle(torch, q, k, v, do, causal, "float32", True)
    out = want[0].astype(np.float32)
    assert oracle.check("out", out)["ok"]
    assert not oracle.check("out", out * np.float32(1.01))["ok"]
    lse = torch.from_numpy(lse.astype(np.float32))
    assert oracle.check("lse", lse)["ok"]
    assert not oracle.check("lse", lse + 1e-3)["ok"]
