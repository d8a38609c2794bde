"""scripts/hbm_traffic.py without a GPU: ncu's CSV parsed, the model, and the driver run
against a stand-in ncu that prints a recorded table.

The CSV samples keep ncu's layout: its own ``==PROF==`` lines around one table, every
field quoted, a header row, then one row per (launch, metric). Current ncu versions have
the columns of NCU_CSV (Block Size, Grid Size, Device, CC); older ones had a "Kernel Time"
column instead (OLD_CSV). Without ``--print-units base`` values are scaled to a unit and
grouped by thousands, which the parser must undo.
"""

import importlib.util
import json
import stat
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("hbm_traffic", ROOT / "scripts" / "hbm_traffic.py")
hbm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hbm)

HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
          '"Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit",'
          '"Metric Value"')


def row(launch, kernel, block, grid, metric, unit, value):
    return (f'"{launch}","4242","python3.12","127.0.0.1","{kernel}","1","7","{block}","{grid}",'
            f'"0","9.0","Command line profiler metrics","{metric}","{unit}","{value}"')


NCU_CSV = "\n".join([
    "==PROF== Connected to process 4242 (/usr/bin/python3.12)",
    '==PROF== Profiling "forward_v2": 0%....50%....100% - 1 pass',
    '==PROF== Profiling "forward_v2": 0%....50%....100% - 1 pass',
    "==PROF== Disconnected from process 4242",
    HEADER,
    row(0, "forward_v2", "(64, 1, 1)", "(256, 16, 1)", "dram__bytes_read.sum", "byte", "302,612,480"),
    row(0, "forward_v2", "(64, 1, 1)", "(256, 16, 1)", "dram__bytes_write.sum", "byte", "68,190,208"),
    row(0, "forward_v2", "(64, 1, 1)", "(256, 16, 1)", "lts__t_sectors_srcunit_tex_op_read.sum",
        "sector", "1,076,887,552"),
    row(1, "forward_v2", "(32, 1, 1)", "(512, 16, 1)", "dram__bytes_read.sum", "Mbyte", "310.25"),
    row(1, "forward_v2", "(32, 1, 1)", "(512, 16, 1)", "dram__bytes_write.sum", "Kbyte", "66,592"),
    row(1, "forward_v2", "(32, 1, 1)", "(512, 16, 1)", "lts__t_sectors_srcunit_tex_op_read.sum",
        "sector", "2150629376"),
]) + "\n"

OLD_CSV = textwrap.dedent('''\
    ==PROF== Connected to process 17 (/usr/bin/python3)
    "ID","Process ID","Process Name","Host Name","Kernel Name","Kernel Time","Context","Stream","Section Name","Metric Name","Metric Unit","Metric Value"
    "0","17","python3","127.0.0.1","forward_v2","2024-Jan-05 10:00:00","1","7","","dram__bytes_read.sum","Gbyte","1.5"
    "0","17","python3","127.0.0.1","forward_v2","2024-Jan-05 10:00:00","1","7","","dram__bytes_write.sum","Mbyte","68.19"
    "1","17","python3","127.0.0.1","other_kernel","2024-Jan-05 10:00:01","1","7","","dram__bytes_read.sum","Kbyte","96"
    "1","17","python3","127.0.0.1","other_kernel","2024-Jan-05 10:00:01","1","7","","dram__bytes_write.sum","byte","512"
    ==PROF== Disconnected from process 17
    ''')


def test_parse_current_layout_two_launches():
    launches = hbm.parse_ncu_csv(NCU_CSV)
    assert [(x["id"], x["kernel"], x["block"], x["grid"]) for x in launches] == [
        ("0", "forward_v2", "(64, 1, 1)", "(256, 16, 1)"),
        ("1", "forward_v2", "(32, 1, 1)", "(512, 16, 1)")]
    first, second = (x["metrics"] for x in launches)
    assert first == {"dram__bytes_read.sum": 302_612_480, "dram__bytes_write.sum": 68_190_208,
                     "lts__t_sectors_srcunit_tex_op_read.sum": 1_076_887_552}
    assert second["dram__bytes_read.sum"] == pytest.approx(310.25e6)     # Mbyte: 10^6
    assert second["dram__bytes_write.sum"] == pytest.approx(66_592e3)     # grouped Kbyte
    assert second["lts__t_sectors_srcunit_tex_op_read.sum"] == 2_150_629_376


def test_parse_old_layout_with_kernel_time():
    launches = hbm.parse_ncu_csv(OLD_CSV)
    assert [x["kernel"] for x in launches] == ["forward_v2", "other_kernel"]
    assert launches[0]["block"] is None and launches[0]["grid"] is None
    assert launches[0]["metrics"]["dram__bytes_read.sum"] == pytest.approx(1.5e9)
    assert launches[1]["metrics"] == {"dram__bytes_read.sum": 96e3, "dram__bytes_write.sum": 512}


@pytest.mark.parametrize("text, message", [
    ("==PROF== Connected to process 1\n==WARNING== No kernels were profiled.\n", "no CSV table"),
    (HEADER.replace('"Metric Unit",', "") + "\n", "no 'Metric Unit' column"),
    (HEADER + "\n" + row(0, "k", "", "", "dram__bytes_read.sum", "byte", "n/a") + "\n",
     "is not a number"),
    (HEADER + "\n" + row(0, "k", "", "", "dram__bytes_read.sum", "byte", "") + "\n",
     "is not a number"),
    (HEADER + "\n" + row(0, "k", "", "", "dram__bytes_read.sum", "furlong", "3") + "\n",
     "unknown ncu metric unit 'furlong'"),
])
def test_parse_refuses_what_it_cannot_read(text, message):
    with pytest.raises(ValueError, match=message):
        hbm.parse_ncu_csv(text)


def test_model_bytes_counts_the_loops():
    B, H, N, d, Br = 1, 2, 1000, 64, 64
    read, write = hbm.model_bytes(B, H, N, d, Br)
    Tr = 16                                                  # ceil(1000 / 64)
    assert read == B * H * 4 * (N * d + Tr * 2 * N * d)
    assert write == B * H * (4 * N * d + 4 * N)
    # halving Br doubles the K/V term (N divisible by both tiles)
    r64, r32 = hbm.model_bytes(1, 1, 4096, 64, 64)[0], hbm.model_bytes(1, 1, 4096, 64, 32)[0]
    assert r32 - 4 * 4096 * 64 == 2 * (r64 - 4 * 4096 * 64)
    assert hbm.theorem2_accesses(1, 1, 4096, 64, hbm.sram_elements(64, 64, 64)) == \
        4096 ** 2 * 64 ** 2 / (3 * 64 * 64)


def test_tile_pairs_are_the_candidates_that_fit():
    from numbaflash.kernels.backward.v1_two_kernels import TILE_CANDIDATES
    from numbaflash.kernels.forward.v2_flash2 import forward_shared_bytes
    from numbaflash.kernels.plan import SHARED_MEM_LIMIT
    assert hbm.tile_pairs(64) == list(TILE_CANDIDATES)          # Kj, Vj <= 32 KB
    for Br, Bc in hbm.tile_pairs(256):
        assert forward_shared_bytes(Br, Bc, 256, "float32") <= SHARED_MEM_LIMIT
    assert (64, 64) not in hbm.tile_pairs(256)
    assert hbm.parse_tiles("64x64,32X16") == [(64, 64), (32, 16)]


def _fake_ncu(tmp_path, body):
    """An executable that stands in for ncu: it prints --version, or runs ``body``."""
    path = tmp_path / "ncu"
    path.write_text(f"#!{sys.executable}\nimport sys\n"
                    "if '--version' in sys.argv:\n    print('NVIDIA (R) Nsight Compute "
                    "Command Line Profiler\\nVersion 2025.3.1.0 (build 1)')\n    sys.exit(0)\n"
                    + textwrap.dedent(body))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_measure_with_a_stand_in_ncu(tmp_path):
    # Prints a one-launch table whose Block Size is the Br it was asked for, and records
    # its arguments, so the command line is checked too.
    body = f'''
        import json
        args = sys.argv[1:]
        with open({str(tmp_path / "calls.jsonl")!r}, "a") as f:
            f.write(json.dumps(args) + "\\n")
        br = args[args.index("--tiles") + 1].split("x")[0]
        print({HEADER!r})
        for name, unit, value in (("dram__bytes_read.sum", "byte", "1,000,000"),
                                  ("dram__bytes_write.sum", "byte", "2000"),
                                  ("lts__t_sectors_srcunit_tex_op_read.sum", "sector", "10")):
            print(f'"0","1","python3","h","forward_v2","1","7","({{br}}, 1, 1)","(4, 2, 1)",'
                  f'"0","9.0","s","{{name}}","{{unit}}","{{value}}"')
    '''
    ncu = _fake_ncu(tmp_path, body)
    result = hbm.measure((1, 2, 256, 64), "float32", [(64, 64), (32, 16)], ncu=ncu,
                         log=lambda *a: None)
    assert result["error"] is None
    assert result["ncu_version"].startswith("Version 2025")
    assert result["metrics"] == list(hbm.DRAM_METRICS) + [hbm.L2_METRIC]
    assert [(e["Br"], e["Bc"], e["dram_read"], e["dram_write"], e["l2_read"], e["block"])
            for e in result["pairs"]] == [(64, 64, 1e6, 2000, 320, "(64, 1, 1)"),
                                          (32, 16, 1e6, 2000, 320, "(32, 1, 1)")]
    assert all(e["error"] is None for e in result["pairs"])
    assert result["pairs"][1]["model_read"] == hbm.model_bytes(1, 2, 256, 64, 32)[0]
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert len(calls) == 2
    for call in calls:
        assert call[call.index("--kernel-name") + 1] == "regex:forward_v2"
        assert call[call.index("--launch-count") + 1] == "1"
        assert "--worker" in call and call[call.index("--shape") + 1:][:4] == ["1", "2", "256", "64"]


def test_measure_falls_back_to_the_dram_metrics(tmp_path):
    # This ncu rejects the L2 metric; the run is repeated with the DRAM metrics alone.
    body = f'''
        metrics = sys.argv[sys.argv.index("--metrics") + 1].split(",")
        if "{hbm.L2_METRIC}" in metrics:
            print("==ERROR== Failed to find metric {hbm.L2_METRIC}")
            sys.exit(1)
        print({HEADER!r})
        for name in metrics:
            print(f'"0","1","p","h","forward_v2","1","7","(64, 1, 1)","(4, 2, 1)","0","9.0",'
                  f'"s","{{name}}","byte","5"')
    '''
    result = hbm.measure((1, 1, 128, 64), "float32", [(64, 64)], ncu=_fake_ncu(tmp_path, body),
                         log=lambda *a: None)
    (entry,) = result["pairs"]
    assert result["metrics"] == list(hbm.DRAM_METRICS)
    assert (entry["dram_read"], entry["dram_write"], entry["l2_read"]) == (5, 5, None)
    assert entry["error"] is None


def test_measure_reports_a_failing_ncu_and_invents_nothing(tmp_path):
    body = '''
        print("==ERROR== ERR_NVGPUCTRPERM - The user does not have permission to access "
              "NVIDIA GPU Performance Counters on the target device 0.")
        sys.exit(1)
    '''
    result = hbm.measure((1, 1, 128, 64), "float32", [(64, 64), (32, 32)],
                         ncu=_fake_ncu(tmp_path, body), log=lambda *a: None)
    assert "ERR_NVGPUCTRPERM" in result["error"]
    assert all(e["dram_read"] is None and e["dram_write"] is None for e in result["pairs"])
    assert len(result["pairs"]) == 1                  # the second pair was not tried


def test_measure_without_ncu_says_so(tmp_path):
    result = hbm.measure((1, 1, 128, 64), pairs=[(64, 64)], ncu=str(tmp_path / "missing"),
                         log=lambda *a: None)
    assert "not found" in result["error"]
    assert result["pairs"][0]["dram_read"] is None
    assert result["pairs"][0]["model_read"] > 0


def test_measure_stops_at_a_timeout(tmp_path):
    # Pairs come in decreasing Br: after one times out, the smaller (slower) ones are not
    # tried, and each says so; nothing is measured for them.
    body = '''
        import time
        time.sleep(30)
    '''
    result = hbm.measure((1, 1, 128, 64), "float32", [(64, 64), (32, 32), (16, 16)],
                         ncu=_fake_ncu(tmp_path, body), timeout=1, log=lambda *a: None)
    assert [(e["Br"], e["Bc"]) for e in result["pairs"]] == [(64, 64), (32, 32), (16, 16)]
    assert "did not finish in 1 s" in result["pairs"][0]["error"]
    assert [e["error"] for e in result["pairs"][1:]] == ["not tried: (64, 64) timed out"] * 2
    assert all(e["dram_read"] is None for e in result["pairs"])
    assert result["pairs"][2]["model_read"] == hbm.model_bytes(1, 1, 128, 64, 16)[0]


def test_main_without_ncu_writes_json_and_exits_2(tmp_path, capsys):
    out = tmp_path / "r.json"
    status = hbm.main(["--shape", "1", "1", "128", "64", "--tiles", "64x64",
                       "--ncu", str(tmp_path / "missing"), "--json", str(out)])
    assert status == 2
    assert "not found" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["pairs"][0]["Br"] == 64 and data["pairs"][0]["dram_read"] is None
