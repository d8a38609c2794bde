"""The inference bench (numbaflash/bench/inference.py, ``python -m numbaflash bench
--inference``): decoding against a KV cache and packed batches run, are checked and
recorded with their targets; a wrong result is refused its time; the padded baseline is
checked before it is timed; the options it does not take are refused; the JSON parses.

The whole command runs once (a module fixture), on the simulator only (its tiny shapes,
one timed run: the times mean nothing there); on a GPU it is the real benchmark, minutes
long. The other tests run the simulator's shapes on either backend, without PyTorch's
baselines, and PyTorch's own baselines on CPU tensors where PyTorch is importable.
"""

import contextlib
import io
import json

import numpy as np
import pytest
from numba import cuda

import numbaflash
from numbaflash import bench, reference
from numbaflash.__main__ import main
from numbaflash.bench import inference

SMALL = dict(size="simulator", repeats=1, warmup=0, sdpa=False, progress=False)
SIM_LENGTHS = [14, 11, 9]            # default_rng(0).integers(1, 17, 3): the first is checked


def _cli(argv):
    """``main(argv)`` with its stdout and stderr captured: ``(status, out, err)``."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(argv)
    return status, out.getvalue(), err.getvalue()


# --- what the cases are ------------------------------------------------------------------


def test_the_cases_and_targets_are_the_documented_ones():
    assert bench.DECODE_SHAPES["gpu"] == ((8, 32, 32, 1, 32768, 128), (8, 32, 8, 1, 32768, 128),
                                         (1, 32, 32, 1, 131072, 128),
                                         (1, 32, 8, 1, 131072, 128))
    assert bench.PACKED["gpu"] == dict(sequences=64, lengths=(128, 4096), heads=16,
                                       dims=(64, 128))
    assert inference.HBM_COPY_BYTES["gpu"] == 4 * 2**30
    assert inference.DECODE_TARGETS == {"sdpa": "1/ratio >= 0.8",
                                        "hbm": {"float16": "1/ratio >= 0.5", "float32": None}}
    assert inference.PACKED_TARGETS == {"forward": None, "fwd+bwd": "1/ratio >= 1.5"}
    # the targets read as the words say: 1/ratio is numbaflash's bandwidth over SDPA's,
    # and how many times faster packed is than padded
    assert bench.target_met("1/ratio >= 0.8", 1 / 0.81) and not bench.target_met(
        "1/ratio >= 0.8", 1 / 0.79)
    assert bench.target_met("1/ratio >= 1.5", 1 / 1.6) and not bench.target_met(
        "1/ratio >= 1.5", 1 / 1.4)


def test_the_padding_mask_hides_the_padding_and_the_future():
    mask = inference.padding_mask([3, 1], 3, causal=False)
    assert mask.shape == (2, 1, 3, 3) and mask.dtype == np.bool_
    assert mask[0, 0].all()
    assert mask[1, 0, 0, 0] and mask[1, 0].sum() == 1           # one row, one key
    causal = inference.padding_mask([3, 2], 3, causal=True)
    assert np.array_equal(causal[0, 0], np.tri(3, dtype=bool))
    assert np.array_equal(causal[1, 0], np.array([[1, 0, 0], [1, 1, 0], [0, 0, 0]], bool))


def test_hbm_copy_counts_bytes_read_and_written():
    ms, gbs = bench.hbm_copy(4096, repeats=1, warmup=0)
    assert ms > 0 and gbs == pytest.approx(2 * 4096 / ms / 1e6)


# --- the command, end to end -------------------------------------------------------------


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    if numbaflash.backend() != "simulator":
        pytest.skip("on a GPU the inference bench is the real benchmark (minutes)")
    path = tmp_path_factory.mktemp("inference") / "inference.json"
    status, out, err = _cli(["bench", "--inference", "--repeats", "1", "--warmup", "0",
                             "--json", str(path)])
    return status, out, err, json.loads(path.read_text())


def test_cli_runs_every_case_checked(cli_run):
    status, out, err, data = cli_run
    assert status == 0, out + err
    records = data["records"]
    decode = [(f"decode, batch {B}, " + ("MHA" if Hq == Hk else f"GQA {Hq // Hk}:1"), base)
              for B, Hq, Hk, _, _, _ in bench.DECODE_SHAPES["simulator"]
              for base in ("SDPA (best of default, EFFICIENT)", "HBM copy")]
    packed = [(f"packed, d={d}" + (", causal" if causal else ""), what, base)
              for d in bench.PACKED["simulator"]["dims"] for causal in (False, True)
              for what in ("forward", "fwd+bwd")
              for base in ("numbaflash padded + bool mask", "SDPA padded + bool mask")]
    assert [(r["case"], r["baseline"]) for r in records if r["part"] == "decode"] == decode
    assert [(r["case"], r["what"], r["baseline"]) for r in records
            if r["part"] == "packed"] == packed
    assert len(records) == len(decode) + len(packed)
    for r in records:
        assert set(r) == set(inference.RECORD_KEYS)
        assert r["ok"] is True and r["dtype"] == "float32", r
        assert 0 <= r["max_err"] <= r["bound"] and r["ms"] > 0
        assert r["met"] is None                            # simulator times judge nothing
        assert r["timer"].startswith("simulator") and r["repeats"] == 1
        if r["baseline"].startswith("SDPA"):               # no PyTorch with CUDA here
            assert r["baseline_ms"] is None and r["ratio"] is None
            assert "no PyTorch with CUDA" in r["baseline_note"]
        else:
            assert r["ratio"] == pytest.approx(r["ms"] / r["baseline_ms"])
        for c in r["check"].values():
            assert c["ok"] and c["max_err"] <= c["bound"]
    # one numbaflash time per case and pass, shared by the baselines' records
    assert records[0]["ms"] == records[1]["ms"] and records[4]["ms"] == records[5]["ms"]


def test_decode_records_bandwidth_and_targets(cli_run):
    records = [r for r in cli_run[3]["records"] if r["part"] == "decode"]
    for r, shape in zip(records[::2], bench.DECODE_SHAPES["simulator"]):
        assert (r["B"], r["Hq"], r["Hkv"], r["Sq"], r["N"], r["d"]) == shape
    for r in records:
        assert set(r["check"]) == {"out", "lse"} and r["what"] == "forward"
        B, Hq, Hk, Sq, S_max, d = (r[k] for k in ("B", "Hq", "Hkv", "Sq", "N", "d"))
        assert r["kv_bytes"] == 2 * B * Hk * S_max * d * 4           # float32 K and V
        assert r["gbs"] == pytest.approx(r["kv_bytes"] / r["ms"] / 1e6)
        assert r["splits"] == 1 and r["kernel"].startswith("split_kv")
        assert "cache_seqlens = " + str(S_max) in r["options"]
        assert r["ms_queued"] > 0                 # the same call, queued back to back
        assert r["checked_against"].startswith("numbaflash.reference float64, first batch")
        if r["baseline"] == "HBM copy":
            assert r["target"] is None            # float32 (float16: 1/ratio >= 0.5)
            # baseline ms: the K and V bytes at the copy's bandwidth, so 1/ratio is the
            # fraction of the copy bandwidth numbaflash reaches
            assert r["baseline_ms"] == pytest.approx(r["kv_bytes"] / r["baseline_gbs"] / 1e6)
            assert 1 / r["ratio"] == pytest.approx(r["gbs"] / r["baseline_gbs"])
            assert "device-to-device copy" in r["baseline_detail"]
            assert r["baseline_ms_queued"] == r["baseline_ms"]     # a bandwidth, not a call
        else:
            assert r["target"] == "1/ratio >= 0.8"
            assert r["baseline_ms_queued"] is None                 # no SDPA here


def test_packed_records_memory_and_targets(cli_run):
    records = [r for r in cli_run[3]["records"] if r["part"] == "packed"]
    heads = bench.PACKED["simulator"]["heads"]
    total, S = sum(SIM_LENGTHS), max(SIM_LENGTHS)
    for r in records:
        assert r["lengths"] == SIM_LENGTHS and (r["total"], r["N"]) == (total, S)
        assert (r["B"], r["Hq"]) == (3, heads)
        assert r["packed_bytes"] == 4 * total * heads * r["d"] * 4    # q, k, v, out float32
        assert r["padded_bytes"] == 4 * 3 * S * heads * r["d"] * 4
        assert r["mask_bytes"] == 3 * S * S
        names = {"forward": {"out", "lse"}, "fwd+bwd": {"out", "lse", "dq", "dk", "dv"}}
        assert set(r["check"]) == names[r["what"]]
        assert r["causal"] == r["case"].endswith("causal")
        if r["baseline"] == "numbaflash padded + bool mask":
            assert r["baseline_ok"] is True and r["baseline_ms"] > 0
            assert r["target"] == {"forward": None, "fwd+bwd": "1/ratio >= 1.5"}[r["what"]]
        else:
            assert r["baseline_ok"] is None and r["target"] is None


def test_cli_prints_both_tables(cli_run):
    status, out, err, data = cli_run
    assert "numbaflash bench --inference" in out and "simulator" in out
    assert "Decoding against a KV cache" in out and "Packed batches" in out
    assert "3 sequences of 9..14 tokens (total 34, padded to 14), 2 heads" in out
    for r in data["records"]:
        assert r["case"] in out
        assert f"{r['max_err']:.2e}" in out
    assert "1/ratio >= 0.8" in out and "1/ratio >= 1.5" in out
    assert "not timed" not in out and "WRONG" not in out
    assert "no PyTorch with CUDA" in out                      # the SDPA baselines' note
    assert "met: '-' where not judged" in out
    assert {"date", "gpu", "numba_cuda", "numpy", "torch"} <= set(data["meta"])
    assert f"bench [{len(data['records'])}/{len(data['records'])}]" in err   # progress


# --- a wrong result is refused its time ----------------------------------------------------


def test_a_wrong_decode_head_is_not_timed(monkeypatch):
    # Only the last query head of the first batch is off (GQA: a head of K/V head 1): the
    # check reads every head of that batch.
    real = numbaflash.attention_with_kvcache

    def wrong(*args, **kwargs):
        out, lse = real(*args, **kwargs)
        host = out.copy_to_host()
        host[0, -1] *= host.dtype.type(1.01)
        return cuda.to_device(host), lse
    monkeypatch.setattr(bench, "attention_with_kvcache", wrong)
    monkeypatch.setitem(bench.DECODE_SHAPES, "simulator", bench.DECODE_SHAPES["simulator"][:1])
    records = bench.run_inference(parts="decode", **SMALL)
    assert [r["baseline"] for r in records] == ["SDPA (best of default, EFFICIENT)",
                                                "HBM copy"]
    assert (records[0]["Hq"], records[0]["Hkv"]) == (4, 2)
    for r in records:
        assert r["ok"] is False and r["ms"] is None and r["gbs"] is None
        assert r["baseline_ms"] is None and r["ratio"] is None and r["met"] is None
        assert not r["check"]["out"]["ok"] and r["check"]["lse"]["ok"]
        assert r["max_err"] > r["bound"]
    assert bench.wrong_inference(records) == records
    assert bench.format_inference_table(records).count("WRONG RESULT, not timed") == 2


def test_a_wrong_packed_sequence_is_not_timed(monkeypatch):
    # Only the last row of the first sequence, in its last head, is off.
    real = numbaflash.attention_varlen

    def wrong(q, k, v, cu_q, cu_k, **kwargs):
        out, lse = real(q, k, v, cu_q, cu_k, **kwargs)
        host = out.copy_to_host()
        host[cu_q[1] - 1, -1] *= host.dtype.type(1.01)
        return cuda.to_device(host), lse
    monkeypatch.setattr(bench, "attention_varlen", wrong)
    records = bench.run_inference(parts=["packed"], **SMALL)
    assert [(r["causal"], r["what"]) for r in records] == [
        (c, w) for c in (False, True) for w in ("forward", "fwd+bwd") for _ in range(2)]
    for r in records:
        assert r["ok"] is False and r["ms"] is None
        assert r["baseline_ms"] is None and r["baseline_ok"] is None and r["ratio"] is None
        assert not r["check"]["out"]["ok"] and r["check"]["lse"]["ok"]
    assert bench.wrong_inference(records) == records
    assert bench.format_inference_table(records).count("WRONG RESULT, not timed") == 8


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_the_check_takes_a_right_result_and_refuses_a_wrong_one(dtype):
    # The rule on a decode slice (GQA: 4 query heads, 2 K/V heads): the float64 reference
    # rounded to the dtype is as right as a result of that dtype can be; 0.5 % off is not.
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(s).astype(dtype) for s in ((4, 1, 16), (2, 48, 16),
                                                               (2, 48, 16)))
    ref, base = inference._references(dtype, q, k, v)
    assert ref["out"].shape == (4, 1, 16) and ref["lse"].shape == (4, 1)
    assert base["out"].dtype == np.dtype(dtype)      # float16: the float32 baseline, rounded
    want = np.concatenate([reference.forward(q[2 * h:2 * h + 2], k[h:h + 1], v[h:h + 1])[0]
                           for h in range(2)])
    np.testing.assert_array_equal(ref["out"], want)   # K/V head h serves query heads 2h, 2h+1
    right = {"out": ref["out"].astype(dtype), "lse": ref["lse"].astype(np.float32)}
    checks = inference._checks(right, ref, base, dtype)
    assert all(c["ok"] for c in checks.values()), checks
    wrong = dict(right, out=right["out"].copy())
    wrong["out"][3] *= np.dtype(dtype).type(1.005)
    assert not inference._checks(wrong, ref, base, dtype)["out"]["ok"]


def _padded_from_reference(data, ref, factor=1.0):
    """A padded batch's result (out, lse, dq, dk, dv) on the device, whose first sequence is
    the reference's (out scaled by ``factor``) and whose other rows are zeros."""
    B, H, S, d, n = data.B, data.H, data.S, data.d, data.first
    arrays = []
    for name in ("out", "lse", "dq", "dk", "dv"):
        x = np.zeros((B, H, S) if name == "lse" else (B, H, S, d), np.float32)
        x[0, :, :n] = ref[name] * (factor if name == "out" else 1.0)
        arrays.append(cuda.to_device(x))
    return tuple(arrays)


def test_the_padded_baseline_is_checked_before_it_is_timed():
    data = inference._PackedInputs(None, SIM_LENGTHS, 2, 8, "float32", seed=1)
    ref, _ = data.references_for(True)
    right = _padded_from_reference(data, ref)
    ok, ms, note = inference._padded_baseline(lambda: right, data, True, 1, 0)
    assert ok is True and ms >= 0 and note is None
    wrong = _padded_from_reference(data, ref, factor=1.01)
    ok, ms, note = inference._padded_baseline(lambda: wrong, data, True, 1, 0)
    assert ok is False and ms is None and "disagrees with the reference" in note


def test_cli_exits_non_zero_on_a_wrong_result(monkeypatch):
    # The command's handling of wrong records, without running the cases.
    def one(**changes):
        record = dict.fromkeys(inference.RECORD_KEYS)
        record.update(part="packed", case="packed, d=8", B=3, Hq=2, Hkv=2, Sq=14, N=14, d=8,
                      dtype="float32", what="forward", baseline="numbaflash padded + bool mask",
                      lengths=SIM_LENGTHS, total=34, ok=True, ms=1.0, max_err=0.1, bound=0.01)
        record.update(changes)
        return record
    for wrong, status in ((one(ok=False, ms=None), "WRONG RESULT, not timed"),
                          (one(baseline_ok=False, baseline_note="not timed: ..."),
                           "baseline WRONG, not timed")):
        monkeypatch.setattr(bench.command, "run_inference", lambda **kw: [wrong])
        code, out, err = _cli(["bench", "--inference", "--repeats", "1", "--warmup", "0"])
        assert code == 1 and status in out and "FAILED" in err


# --- options -------------------------------------------------------------------------------


@pytest.fixture
def nothing_runs(monkeypatch):
    """Fail the test if a case (or a whole table) starts: a bad argument must be refused
    before anything runs."""
    def started(*args, **kwargs):
        raise AssertionError("something ran; the arguments should have been refused first")
    for name in ("_decode_case", "_packed_case", "hbm_copy"):
        monkeypatch.setattr(inference, name, started)
    for name in ("run_inference", "run_variants", "run"):
        monkeypatch.setattr(bench.command, name, started)


@pytest.mark.parametrize("argv, message", [
    (["--variants"], "--inference and --variants are exclusive"),
    (["--shapes", "1x1x32x8"], "--shapes: not with --inference"),
    (["--causal", "yes"], "--causal: not with --inference"),
    (["--passes", "forward"], "--passes: not with --inference"),
    (["--versions", "v2"], "--versions: not with --inference"),
    (["--plot", "p.png"], "--plot: not with --inference"),
    (["--dtype", "float64"], "--dtype float64: --inference times float32 or float16"),
    (["--repeats", "0"], "repeats must be an integer >= 1"),
    (["--warmup", "-1"], "warmup must be an integer >= 0"),
    (["--json", "/no/such/folder/i.json"], "--json: folder"),
])
def test_cli_refuses_what_inference_does_not_take(argv, message, nothing_runs):
    status, out, err = _cli(["bench", "--inference"] + argv)
    assert status == 2
    assert message in err and "bench: error" in err
    assert out == ""                                        # refused before anything ran


@pytest.mark.parametrize("kwargs, message", [
    (dict(dtype="float64"), "dtype must be one of"),
    (dict(parts=["prefill"]), "parts must be names among"),
    (dict(parts=[]), "parts must be names among"),
    (dict(size="huge"), "size must be"),
    (dict(repeats=0), "repeats must be"),
    (dict(warmup=1.5), "warmup must be"),
])
def test_run_inference_argument_errors(kwargs, message, nothing_runs):
    with pytest.raises(ValueError, match=message):
        bench.run_inference(**kwargs, progress=False)


# --- PyTorch's baselines, on CPU tensors ----------------------------------------------------


def test_sdpa_on_the_padded_batch_computes_the_first_sequence():
    torch = pytest.importorskip("torch")
    lengths, S, H, d = np.array([5, 3, 7]), 7, 2, 4
    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((3, H, S, d)).astype(np.float32) for _ in range(4))
    n = lengths[0]
    for causal in (False, True):
        mask = torch.from_numpy(inference.padding_mask(lengths, S, causal))
        fns = inference._sdpa_padded_passes(torch, *(torch.from_numpy(x) for x in
                                                     (q, k, v, dout)), mask)
        first = [x[0, :, :n] for x in (q, k, v, dout)]
        want, _ = reference.forward(*first[:3], causal)
        np.testing.assert_allclose(fns["forward"]()[0, :, :n].numpy(), want, atol=1e-5)
        grads = fns["fwd+bwd"]()
        for got, want in zip(grads, reference.backward(first[3], *first[:3], causal)):
            np.testing.assert_allclose(got[0, :, :n].numpy(), want, atol=1e-5)


def test_sdpa_decode_takes_the_faster_backend_that_runs():
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(0)
    q, k_cache, v_cache = (torch.randn(s, generator=g) for s in
                           ((2, 4, 1, 8), (2, 2, 16, 8), (2, 2, 16, 8)))    # GQA
    ms, queued, detail = inference._sdpa_decode(torch, q, k_cache, v_cache, "float32", 1, 0)
    assert ms >= 0 and queued >= 0 and "SDPA as called (default)" in detail
    assert f"queued {queued:.3f} ms a call" in detail
    assert "EFFICIENT_ATTENTION" in detail                  # float32's fused backend
