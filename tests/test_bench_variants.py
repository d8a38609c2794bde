"""The variant bench (numbaflash/bench/variants.py, ``python -m numbaflash bench
--variants``): its cases run and are checked, a wrong variant is refused its time, the
JSON holds the records, and the options it does not take are refused.

The whole table runs on the simulator only (tiny shapes, one timed run: the times mean
nothing there); on a GPU it is the real benchmark, minutes long, which
scripts/variants_gpu.py runs. The other tests run the simulator's shapes on either
backend, without PyTorch's baselines.
"""

import json

import numpy as np
import pytest
from numba import cuda

import numbaflash
from numbaflash import bench
from numbaflash.__main__ import main

VARIANT_KEYS = {"case", "options", "B", "Hq", "Hkv", "N", "d", "dtype", "what", "kernel",
                "ms", "baseline", "baseline_ms", "ratio", "target", "met", "ok", "max_err",
                "bound", "check", "checked_against", "note", "baseline_note"}
SMALL = dict(size="simulator", repeats=1, warmup=0, sdpa=False, progress=False)


def test_targets_read_as_written():
    assert bench.target_met("ratio <= 1.1", 1.1) is True
    assert bench.target_met("ratio <= 1.1", 1.11) is False
    assert bench.target_met("ratio < 1", 1.0) is False
    assert bench.target_met("1/ratio >= 12", 1 / 13) is True      # 13 times faster
    assert bench.target_met("1/ratio >= 12", 1 / 11) is False
    assert bench.target_met(None, 0.5) is None and bench.target_met("ratio < 1", None) is None


def test_the_table_has_the_documented_targets():
    targets = {(c.name, b.name): b.target for c in bench.VARIANT_CASES for b in c.baselines}
    assert targets[("GQA, causal", "numbaflash, K/V repeated by hand")] == "ratio <= 1.1"
    assert targets[("softcap 30", "numbaflash plain")] == "ratio <= 1.3"
    assert targets[("ALiBi + causal", "numbaflash plain causal")] == "ratio <= 1.3"
    assert targets[("window + causal", "numbaflash full causal")] == {
        "forward": "1/ratio >= 12", "fwd+bwd": "1/ratio >= 10"}
    assert targets[("documents: mask_mod", "SDPA EFFICIENT, same bool mask")] == "ratio < 1"
    assert targets[("documents: mask_mod", "FlexAttention compiled")] == "ratio <= 1.5"


@pytest.mark.skipif(numbaflash.backend() != "simulator",
                    reason="on a GPU the table is the real benchmark (minutes): "
                    "scripts/variants_gpu.py runs it")
def test_cli_runs_every_case_checked(tmp_path, capsys):
    path = tmp_path / "variants.json"
    status = main(["bench", "--variants", "--repeats", "1", "--warmup", "0", "--json",
                   str(path)])
    out, err = capsys.readouterr()
    assert status == 0, out + err
    records = json.loads(path.read_text())["records"]
    expected = [(c.name, what, b.name.format(backend="EFFICIENT"))
                for c in bench.VARIANT_CASES for what in ("forward", "fwd+bwd")
                for b in c.baselines]
    assert [(r["case"], r["what"], r["baseline"]) for r in records] == expected
    for r in records:
        assert VARIANT_KEYS <= set(r)
        assert r["ok"] is True, r
        assert 0 <= r["max_err"] <= r["bound"] and r["ms"] > 0
        assert r["met"] is None                        # simulator times judge nothing
        if r["baseline"].startswith(("SDPA", "Flex")):   # no PyTorch with CUDA here
            assert r["baseline_ms"] is None and "no PyTorch with CUDA" in r["baseline_note"]
        else:
            assert r["ratio"] == pytest.approx(r["ms"] / r["baseline_ms"])
        names = {"forward": {"out", "lse"}, "fwd+bwd": {"out", "lse", "dq", "dk", "dv"}}
        assert set(r["check"]) == names[r["what"]]
    gqa = records[0]
    assert (gqa["Hq"], gqa["Hkv"]) == (4, 2)
    # One timing per variant and pass, shared by its baselines' records; one per baseline.
    assert records[0]["ms"] == records[1]["ms"]
    plain = [r["baseline_ms"] for r in records if r["baseline"] == "numbaflash plain"
             and r["what"] == "forward"]
    assert len(plain) == 2 and plain[0] == plain[1]
    assert "not timed" not in out and "simulator" in out
    for case in bench.CASE_NAMES:
        assert case in out
    assert "bench [20/20]" in err                                  # progress on stderr


def _scaled(array, factor):
    """A device array holding ``array * factor`` (a stand-in for a subtly wrong kernel)."""
    return cuda.to_device(array.copy_to_host() * array.dtype.type(factor))


def test_a_wrong_variant_is_not_timed(monkeypatch):
    real = numbaflash.attention

    def wrong_softcap(*args, **kwargs):      # right without softcap, 1% off with it
        out, lse = real(*args, **kwargs)
        return (_scaled(out, 1.01) if kwargs.get("softcap") else out), lse
    monkeypatch.setattr(bench, "attention", wrong_softcap)
    records = bench.run_variants(cases=["softcap 30"], **SMALL)
    assert [r["what"] for r in records] == ["forward", "fwd+bwd"]
    for r in records:
        assert r["ok"] is False and r["ms"] is None
        assert r["ratio"] is None and r["baseline_ms"] is None     # nothing to compare
        assert not r["check"]["out"]["ok"] and r["max_err"] > r["bound"]
    assert bench.wrong_variants(records) == records
    assert bench.format_variant_table(records).count("WRONG RESULT, not timed") == 2


def test_a_wrong_gqa_gradient_is_found_in_the_kv_heads_slice(monkeypatch):
    # dk of K/V head 0 sums the query heads of its group: the check must slice it so.
    real = numbaflash.attention_backward

    def wrong_dk(*args, **kwargs):
        dq, dk, dv = real(*args, **kwargs)
        return dq, _scaled(dk, 1.01), dv
    monkeypatch.setattr(bench, "attention_backward", wrong_dk)
    forward, fwd_bwd = [r for r in bench.run_variants(cases=["GQA, causal"], **SMALL)
                        if r["baseline"].startswith("numbaflash")]
    assert forward["ok"] is True and forward["ms"] > 0 and forward["ratio"] > 0
    assert fwd_bwd["ok"] is False and fwd_bwd["ms"] is None
    assert [n for n, c in fwd_bwd["check"].items() if not c["ok"]] == ["dk"]


def test_cli_exits_non_zero_on_a_wrong_variant(monkeypatch, capsys):
    # The command's handling of a wrong record, without running the table.
    wrong = dict(case="softcap 30", options="softcap=30.0", B=1, Hq=2, Hkv=2, N=24, d=8,
                 dtype="float32", what="forward", kernel="forward_v5", ms=None,
                 baseline="numbaflash plain", baseline_ms=None, ratio=None,
                 target="ratio <= 1.3", met=None, ok=False, max_err=0.1, bound=0.01,
                 check={}, checked_against="x", timer=None, repeats=None, warmup=None,
                 note=None, baseline_note=None)
    monkeypatch.setattr(bench.command, "run_variants", lambda **kw: [wrong])
    assert main(["bench", "--variants", "--repeats", "1", "--warmup", "0"]) == 1
    out, err = capsys.readouterr()
    assert "WRONG RESULT, not timed" in out and "FAILED" in err


@pytest.mark.parametrize("argv, message", [
    (["--shapes", "1x1x32x8"], "--shapes: not with --variants"),
    (["--versions", "v2"], "--versions: not with --variants"),
    (["--causal", "yes"], "--causal: not with --variants"),
    (["--passes", "forward"], "--passes: not with --variants"),
    (["--plot", "p.png", "--shapes", "1x1x32x8"], "--shapes, --plot: not with --variants"),
    (["--dtype", "float64"], "--dtype float64: --variants times float32 or float16"),
    (["--repeats", "0"], "repeats must be an integer >= 1"),
    (["--warmup", "-1"], "warmup must be an integer >= 0"),
    (["--json", "/no/such/folder/v.json"], "--json: folder"),
])
def test_cli_refuses_what_variants_do_not_take(argv, message, capsys):
    assert main(["bench", "--variants"] + argv) == 2
    out, err = capsys.readouterr()
    assert message in err and "bench: error" in err
    assert out == ""                                        # refused before anything ran


@pytest.mark.parametrize("kwargs, message", [
    (dict(dtype="float64"), "dtype must be one of"),
    (dict(cases=["GQA"]), "cases must be names among"),
    (dict(size="huge"), "size must be"),
    (dict(repeats=0), "repeats must be"),
])
def test_run_variants_argument_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        bench.run_variants(**kwargs, progress=False)


def test_same_document_is_one_function_per_length():
    assert bench.variants.same_document(8) is bench.variants.same_document(8)
    fn = bench.variants.same_document(8).py_func
    assert fn(0, 0, 7, 0) and not fn(0, 0, 8, 7)
    assert np.array_equal(np.vectorize(fn)(0, 0, np.arange(16)[:, None], np.arange(16)),
                          np.kron(np.eye(2, dtype=bool), np.ones((8, 8), bool)))
