"""The command line, ``python -m numbaflash``, run as a user runs it: in a subprocess, on
the simulator. Bad option values are argparse errors (exit status 2, a message naming the
option, no traceback); a small demo runs, says it is on the simulator, and checks out."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_cli(*args, timeout=300):
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    return subprocess.run([sys.executable, "-m", "numbaflash", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("args, message", [
    (("--N", "0"), "argument --N: must be a positive integer; got 0"),
    (("--N", "-3"), "argument --N: must be a positive integer; got -3"),
    (("--d", "300"), "argument --d: must be at most 256, numbaflash's largest head dim; got 300"),
    (("--d", "0"), "argument --d: must be a positive integer; got 0"),
    (("--B", "0"), "argument --B: must be a positive integer; got 0"),
    (("--H", "two"), "argument --H: must be a positive integer; got 'two'"),
    (("--B", "40000", "--H", "2"), "--B times --H must be at most 65535"),
], ids=["N=0", "N=-3", "d=300", "d=0", "B=0", "H=two", "B*H"])
def test_bad_demo_values_are_argparse_errors(args, message):
    result = run_cli("demo", *args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert "usage: python -m numbaflash demo" in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


def test_small_demo_runs_on_the_simulator():
    result = run_cli("demo", "--B", "1", "--H", "2", "--N", "20", "--d", "4", "--causal")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "backend: simulator (NUMBA_ENABLE_CUDASIM=1" in out
    assert "inputs: q, k, v of shape (B, H, N, d) = (1, 2, 20, 4), float32, " \
           "causal=bottom_right" in out
    assert "plan: forward:" in out and "on the simulator" in out
    assert "result: OK" in out


def test_bench_subcommand_still_parses():
    result = run_cli("bench", "--help")
    assert result.returncode == 0, result.stderr
    assert "usage: python -m numbaflash bench" in result.stdout
