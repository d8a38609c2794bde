"""Energy per call (numbaflash/bench/energy.py, ``python -m numbaflash bench --energy``),
without a GPU: a stand-in NVML module whose energy counter follows a board of known power,
updated every so often, on a clock the test advances. What is checked: the joules per
call and the mean power of a window against the board's known power, the window's rules
(counter updates at both ends, a least duration and number of calls), the idle power, the
NVML device found by UUID or PCI bus id (never by index), the errors (no pynvml, a counter
that is not supported or does not move, the simulator), and the command line's option and
its refusals before anything runs.
"""

import json
import sys
import time
import types

import pytest

from numbaflash.__main__ import main
from numbaflash.bench import command, energy
from numbaflash.bench.energy import EnergyMeter, EnergyUnavailable

NOT_SUPPORTED, NOT_FOUND = 3, 6


class FakeNVMLError(Exception):
    """pynvml's NVMLError as the meter uses it: an exception with the NVML code ``value``."""

    def __init__(self, value):
        super().__init__(value)
        self.value = value

    def __str__(self):
        return {NOT_SUPPORTED: "Not Supported", NOT_FOUND: "Not Found"}.get(self.value,
                                                                             f"code {self.value}")


class Board:
    """A GPU board whose power is piecewise constant, on a clock in integer microseconds.

    ``counter_mj()`` is what NVML would report: the energy since the driver was loaded
    (``base_mj`` plus what this board used), as of the last update, updates coming every
    ``update_us``. ``sleep`` passes time at ``idle_w``; ``call(us, watts)`` makes a call
    that passes ``us`` at ``watts``.
    """

    def __init__(self, idle_w=100.0, update_us=100_000, start_us=10_012_345,
                 base_mj=987_654_321):
        self.idle_w, self.update_us = idle_w, update_us
        self.now_us, self.base_mj = start_us, base_mj
        self.segments = []                               # (start_us, end_us, watts)
        self.calls = 0

    def advance(self, us, watts):
        self.segments.append((self.now_us, self.now_us + us, watts))
        self.now_us += us

    def energy_j(self, at_us):
        return sum(w * max(0, min(e, at_us) - s) for s, e, w in self.segments) / 1e6

    def counter_mj(self):
        last_update = self.now_us // self.update_us * self.update_us
        return self.base_mj + int(self.energy_j(last_update) * 1000)

    def clock(self):
        return self.now_us / 1e6

    def sleep(self, seconds):
        self.advance(round(seconds * 1e6), self.idle_w)

    def call(self, us, watts):
        def fn():
            self.calls += 1
            self.advance(us, watts)
        return fn


class Handle:
    def __init__(self, name, board, uuid, bus_id, mig_of=None):
        self.name, self.board, self.uuid, self.bus_id = name, board, uuid, bus_id
        self.mig_of = mig_of


class FakeNVML:
    """The functions and constants of pynvml that the meter uses, over ``Handle``s."""

    NVMLError = FakeNVMLError
    NVML_ERROR_NOT_SUPPORTED = NOT_SUPPORTED
    NVML_ERROR_NOT_FOUND = NOT_FOUND

    def __init__(self, handles, supported=True, init_error=None):
        self.handles, self.supported, self.init_error = handles, supported, init_error
        self.inits = self.shutdowns = 0

    def nvmlInit(self):
        if self.init_error is not None:
            raise FakeNVMLError(self.init_error)
        self.inits += 1

    def nvmlShutdown(self):
        self.shutdowns += 1

    def _find(self, **key):
        for h in self.handles:
            if all(getattr(h, k) == v for k, v in key.items()):
                return h
        raise FakeNVMLError(NOT_FOUND)

    def nvmlDeviceGetHandleByUUID(self, uuid):
        return self._find(uuid=uuid)

    def nvmlDeviceGetHandleByPciBusId(self, bus_id):
        return self._find(bus_id=bus_id)

    def nvmlDeviceGetHandleByIndex(self, index):
        raise AssertionError("the NVML device was looked up by index")

    def nvmlDeviceIsMigDeviceHandle(self, handle):
        return handle.mig_of is not None

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, handle):
        return handle.mig_of

    def nvmlDeviceGetName(self, handle):
        return handle.name.encode()                   # older pynvml returns bytes

    def nvmlDeviceGetTotalEnergyConsumption(self, handle):
        if not self.supported:
            raise FakeNVMLError(NOT_SUPPORTED)
        return handle.board.counter_mj()


def cuda_device(uuid="GPU-bbbb", bus=0x86):
    """What numba's ``cuda.get_current_device()`` gives the meter: uuid and PCI ids."""
    return types.SimpleNamespace(uuid=uuid, PCI_DOMAIN_ID=0, PCI_BUS_ID=bus, PCI_DEVICE_ID=0)


def two_gpus(board_a=None, board_b=None):
    """NVML's GPU 0 (bus 0x3B) and GPU 1 (bus 0x86): CUDA's device below is NVML's 1."""
    return [Handle("GPU A", board_a or Board(), "GPU-aaaa", "00000000:3B:00.0"),
            Handle("GPU B", board_b or Board(), "GPU-bbbb", "00000000:86:00.0")]


def meter_on(board, **kwargs):
    nvml = FakeNVML(two_gpus(board_b=board), **kwargs)
    return EnergyMeter(nvml, cuda_device(), clock=board.clock, sleep=board.sleep,
                       synchronize=lambda: None)


# --- the measurement -----------------------------------------------------------------------


@pytest.mark.parametrize("update_us", [10_000, 100_000, 250_000])
def test_joules_per_call_is_the_boards_energy_over_the_calls(update_us):
    # 10 ms calls at 400 W: 4 J each. The window adds the idle board (100 W) after the
    # last call until the counter's next update, at most one update period (and a poll).
    board = Board(idle_w=100.0, update_us=update_us)
    reading = meter_on(board).measure(board.call(10_000, 400.0), min_seconds=1.0,
                                      min_calls=5, warmup_seconds=0.2)
    assert 100 <= reading.calls <= 101                 # 1 s of 10 ms calls
    tail = update_us / 1e6 + 0.002
    assert 0 < reading.tail_s <= tail
    assert 4.0 - 1e-5 <= reading.joules_per_call <= 4.0 + 100.0 * tail / reading.calls
    assert 1.0 <= reading.seconds <= 1.0 + tail + 0.01
    # mean power = the same energy over the window's time
    assert reading.watts == pytest.approx(reading.joules_per_call * reading.calls
                                          / reading.seconds)
    assert 100.0 < reading.watts <= 400.0
    assert reading.watts > 400.0 * 1.0 / (1.0 + tail) - 1e-6


def test_the_window_runs_at_least_min_calls():
    # 300 ms calls at 400 W (120 J each): min_calls, not min_seconds, ends the window.
    board = Board(idle_w=100.0, update_us=100_000)
    fn = board.call(300_000, 400.0)
    reading = meter_on(board).measure(fn, min_seconds=0.5, min_calls=5, warmup_seconds=0)
    assert reading.calls == 5
    assert board.calls == 6                            # one warm-up call first
    assert 120.0 - 1e-5 <= reading.joules_per_call <= 120.0 + 100.0 * 0.102 / 5


def test_the_window_starts_and_ends_on_counter_updates():
    # The energy between two updates is exact: 5 calls of 20 ms at 300 W after a warm-up,
    # then idle; a window that ignored the updates (read once before, once right after)
    # would see a counter up to one update period stale at each end.
    board = Board(idle_w=50.0, update_us=100_000)
    reads = []
    nvml = FakeNVML(two_gpus(board_b=board))
    real = nvml.nvmlDeviceGetTotalEnergyConsumption

    def recorded(handle):
        value = real(handle)
        reads.append((board.now_us, value))
        return value
    nvml.nvmlDeviceGetTotalEnergyConsumption = recorded
    meter = EnergyMeter(nvml, cuda_device(), clock=board.clock, sleep=board.sleep,
                        synchronize=lambda: None)
    reading = meter.measure(board.call(20_000, 300.0), min_seconds=0.05, min_calls=5,
                            warmup_seconds=0)
    first_update = next(t for (t, v), (_, before) in zip(reads[1:], reads) if v != before)
    start = first_update // board.update_us * board.update_us
    end = board.now_us // board.update_us * board.update_us
    exact = board.energy_j(end) - board.energy_j(start)
    assert reading.joules_per_call * reading.calls == pytest.approx(exact, abs=2e-3)
    assert reading.calls == 5


def test_idle_power_is_measured_alone():
    board = Board(idle_w=87.5, update_us=100_000)
    assert meter_on(board).idle_watts(1.0) == pytest.approx(87.5, rel=3e-3)


@pytest.mark.parametrize("kwargs, message", [
    (dict(min_seconds=0), "min_seconds must be a number > 0"),
    (dict(min_seconds=float("nan")), "min_seconds must be a number > 0"),
    (dict(min_calls=0), "min_calls must be an integer >= 1"),
])
def test_measure_refuses_bad_arguments(kwargs, message):
    board = Board()
    with pytest.raises(ValueError, match=message):
        meter_on(board).measure(board.call(1000, 200.0), **kwargs)
    assert board.calls == 0


def test_a_counter_that_does_not_move_is_an_error():
    board = Board(update_us=10**12)                    # no update in the test's time
    meter = meter_on(board)
    meter.max_wait_seconds = 0.5
    with pytest.raises(EnergyUnavailable, match=r"did not change in 0\.5 s"):
        meter.measure(board.call(10_000, 300.0), min_seconds=0.1)


def test_a_counter_that_goes_backwards_is_an_error():
    board = Board(update_us=10_000)
    meter = meter_on(board)

    def sleep_through_a_reload(seconds):               # the counter restarts from 0
        board.base_mj = 0
        board.sleep(seconds)
    meter._sleep = sleep_through_a_reload
    with pytest.raises(EnergyUnavailable, match="went backwards"):
        meter.idle_watts(0.1)


# --- which GPU ------------------------------------------------------------------------------


def test_the_nvml_device_is_found_by_uuid():
    nvml = FakeNVML(two_gpus())
    handle, how = energy.nvml_handle(nvml, cuda_device(uuid="GPU-bbbb", bus=0x3B))
    assert handle.name == "GPU B"                      # the UUID wins over the bus id
    assert how == "uuid GPU-bbbb"


@pytest.mark.parametrize("uuid", ["GPU-unknown", None])
def test_the_nvml_device_is_found_by_pci_bus_id_otherwise(uuid):
    nvml = FakeNVML(two_gpus())
    handle, how = energy.nvml_handle(nvml, cuda_device(uuid=uuid, bus=0x86))
    assert handle.name == "GPU B"
    assert how == "PCI bus id 00000000:86:00.0"


def test_no_matching_nvml_device_is_an_error():
    nvml = FakeNVML(two_gpus())
    with pytest.raises(EnergyUnavailable, match="no NVML device matches the CUDA device "
                       r"\(uuid GPU-cccc, PCI bus id 00000000:AF:00\.0\)"):
        energy.nvml_handle(nvml, cuda_device(uuid="GPU-cccc", bus=0xAF))


def test_a_mig_instance_reads_its_gpus_counter():
    gpus = two_gpus()
    instance = Handle("MIG 1g", None, "MIG-1111", None, mig_of=gpus[1])
    nvml = FakeNVML(gpus + [instance])
    handle, how = energy.nvml_handle(nvml, cuda_device(uuid="MIG-1111", bus=0x86))
    assert handle is gpus[1]
    assert how == "uuid MIG-1111 (MIG instance: the whole GPU's counter)"


def test_the_meter_reads_the_matched_gpu():
    a, b = Board(idle_w=60.0, update_us=10_000), Board(idle_w=90.0, update_us=10_000)

    def sleep(seconds):                                # both boards live on one clock
        a.sleep(seconds)
        b.sleep(seconds)
    nvml = FakeNVML(two_gpus(a, b))
    meter = EnergyMeter(nvml, cuda_device(), clock=b.clock, sleep=sleep,
                        synchronize=lambda: None)
    assert meter.name == "GPU B" and meter.matched_by == "uuid GPU-bbbb"
    assert meter.idle_watts(0.5) == pytest.approx(90.0, rel=0.01)     # B's, not A's 60 W


# --- errors ---------------------------------------------------------------------------------


def test_missing_pynvml_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)   # import pynvml raises ImportError
    with pytest.raises(EnergyUnavailable, match=r"pip install numbaflash\[energy\]"):
        energy.load_nvml()
    with pytest.raises(EnergyUnavailable, match="nvidia-ml-py"):
        EnergyMeter(device=cuda_device())


def test_an_unsupported_counter_is_an_error_and_nvml_is_shut_down():
    nvml = FakeNVML(two_gpus(), supported=False)
    with pytest.raises(EnergyUnavailable, match=r"GPU B does not support NVML's energy "
                       r"counter \(nvmlDeviceGetTotalEnergyConsumption: "
                       r"NVML_ERROR_NOT_SUPPORTED"):
        EnergyMeter(nvml, cuda_device())
    assert nvml.inits == 1 and nvml.shutdowns == 1


def test_nvml_that_cannot_start_is_an_error():
    nvml = FakeNVML(two_gpus(), init_error=12)
    with pytest.raises(EnergyUnavailable, match="NVML could not be started"):
        EnergyMeter(nvml, cuda_device())


def test_the_simulator_has_no_meter(monkeypatch):
    monkeypatch.setattr(energy, "simulating", lambda: True)
    nvml = FakeNVML(two_gpus())
    with pytest.raises(EnergyUnavailable, match="under the CUDA simulator"):
        energy.open_meter(nvml, cuda_device())
    assert nvml.inits == 0


# --- records and the table --------------------------------------------------------------------


def _record(impl, what="forward", joules=None, causal=False):
    return {"B": 1, "H": 2, "Sq": 64, "Sk": 64, "d": 16, "causal": causal, "dtype": "float32",
            "what": what, "impl": impl, "joules": joules, "watts": None if joules is None
            else 300.0, "energy_calls": None if joules is None else 40,
            "energy_s": None if joules is None else 2.05, "joules_vs_sdpa": None}


def test_the_ratio_is_sdpas_joules_over_ours_in_the_same_case():
    ours, sdpa = _record("numbaflash", joules=2.0), _record("sdpa_efficient", joules=1.5)
    other_pass = _record("numbaflash", what="backward", joules=5.0)
    other_mask = _record("numbaflash", causal=True, joules=1.0)
    v2 = _record("numbaflash_v2", joules=3.0)
    records = [ours, sdpa, other_pass, other_mask, v2]
    energy.fill_energy_ratios(records)
    assert ours["joules_vs_sdpa"] == pytest.approx(0.75)
    assert v2["joules_vs_sdpa"] == pytest.approx(0.5)
    assert sdpa["joules_vs_sdpa"] == pytest.approx(1.0)
    assert other_pass["joules_vs_sdpa"] is None and other_mask["joules_vs_sdpa"] is None


def test_the_energy_table_says_what_the_numbers_are():
    records = [_record("numbaflash", joules=2.0), _record("sdpa_efficient", joules=1.5),
               _record("sdpa_math")]
    energy.fill_energy_ratios(records)
    meta = {"counter": "NVML nvmlDeviceGetTotalEnergyConsumption", "gpu": "GPU B",
            "matched_by": "uuid GPU-bbbb", "idle_watts": 71.25, "idle_subtracted": False,
            "min_seconds": 2.0, "min_calls": 5}
    table = energy.format_energy_table(records, meta)
    lines = table.splitlines()
    ours = next(line for line in lines if " numbaflash " in line)
    assert ours.split()[-5:] == ["2", "300.0", "40", "2.05", "0.750x"]
    assert not any("sdpa_math" in line for line in lines)       # not measured: no row
    assert "idle power not subtracted" in table and "71.2 W" in table
    assert "GPU B" in table and "uuid GPU-bbbb" in table


# --- the command line -------------------------------------------------------------------------


def _nothing_runs(monkeypatch):
    def ran(*args, **kwargs):
        raise AssertionError("the bench ran; --energy should have been refused first")
    for name in ("run", "run_variants", "run_inference"):
        monkeypatch.setattr(command, name, ran)


def _pretend_gpu(monkeypatch):
    """The command told it is on a GPU, its shape checks (which ask the backend) passed
    through, and the meter given a CUDA device: the --energy path on any machine."""
    monkeypatch.setattr(command, "backend", lambda: "gpu")
    monkeypatch.setattr(command, "_check_arguments", lambda shapes, *args: (shapes,))
    monkeypatch.setattr(energy, "simulating", lambda: False)
    monkeypatch.setattr(energy, "_cuda_device", cuda_device)


@pytest.mark.parametrize("where, argv, message", [
    ("simulator", ["--energy"], "--energy: energy is read from a GPU's energy counter "
     "(NVML); under the CUDA simulator (NUMBA_ENABLE_CUDASIM=1)"),
    ("gpu", ["--energy-seconds", "1"], "--energy-seconds: only with --energy"),
    ("gpu", ["--energy", "--variants"], "--energy: not with --variants"),
    ("gpu", ["--energy", "--inference"], "--energy: not with --inference"),
    ("gpu", ["--energy", "--energy-seconds", "0"], "--energy-seconds must be a number > 0"),
    ("gpu", ["--energy", "--energy-seconds", "inf"], "--energy-seconds must be a number > 0"),
])
def test_cli_refuses_energy_before_anything_runs(where, argv, message, monkeypatch, capsys):
    _nothing_runs(monkeypatch)
    monkeypatch.setattr(command, "backend", lambda: where)
    assert main(["bench", "--shapes", "1x1x32x8"] + argv) == 2
    out, err = capsys.readouterr()
    assert message in err and "bench: error" in err
    assert out == ""


def test_cli_without_pynvml_names_the_extra(monkeypatch, capsys):
    _nothing_runs(monkeypatch)
    _pretend_gpu(monkeypatch)
    monkeypatch.setitem(sys.modules, "pynvml", None)
    assert main(["bench", "--shapes", "1x1x32x8", "--energy"]) == 2
    out, err = capsys.readouterr()
    assert "--energy: energy needs NVML's Python binding" in err
    assert "pip install numbaflash[energy]" in err
    assert out == ""


def test_cli_with_an_unsupported_counter_says_so(monkeypatch, capsys):
    _nothing_runs(monkeypatch)
    nvml = FakeNVML(two_gpus(), supported=False)
    _pretend_gpu(monkeypatch)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    assert main(["bench", "--shapes", "1x1x32x8", "--energy"]) == 2
    out, err = capsys.readouterr()
    assert "NVML_ERROR_NOT_SUPPORTED" in err and "GPU B" in err
    assert out == ""
    assert nvml.shutdowns == nvml.inits == 1


def test_cli_energy_seconds_must_be_a_number(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "--energy", "--energy-seconds", "two"])
    assert e.value.code == 2
    assert "--energy-seconds" in capsys.readouterr().err


class WallBoard:
    """A counter on the real clock: ``watts`` all the time, updated every 5 ms."""

    def __init__(self, watts):
        self.watts = watts

    def counter_mj(self):
        update = 0.005
        return int(time.perf_counter() // update * update * self.watts * 1000)


def test_cli_energy_adds_joules_to_the_table_and_the_json(monkeypatch, tmp_path, capsys):
    # The plain bench, on whatever backend runs numbaflash here (the simulator in CI),
    # with the command told it is on a GPU and NVML standing in with a 250 W board. The
    # window is 0.5 s: the meter reads the clock when it sees the counter move, and on a
    # busy 2-core machine a few ms late in a 0.05 s window read 268 W (7% off).
    import numbaflash
    try:
        numbaflash.backend()
    except RuntimeError:
        pytest.skip("neither a GPU nor the simulator: numbaflash cannot run")
    nvml = FakeNVML([Handle("Board 250 W", WallBoard(250.0), "GPU-bbbb",
                            "00000000:86:00.0")])
    monkeypatch.setattr(command, "backend", lambda: "gpu")
    monkeypatch.setattr(energy, "simulating", lambda: False)
    monkeypatch.setattr(energy, "_cuda_device", cuda_device)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    path = tmp_path / "bench.json"
    status = main(["bench", "--shapes", "1x1x32x8", "--causal", "no", "--passes", "forward",
                   "--repeats", "1", "--warmup", "0", "--no-sdpa", "--energy",
                   "--energy-seconds", "0.5", "--json", str(path)])
    out, err = capsys.readouterr()
    assert status == 0, out + err
    assert nvml.shutdowns == nvml.inits == 1
    (record,) = json.loads(path.read_text())["records"]
    meta = json.loads(path.read_text())["meta"]["energy"]
    assert record["impl"] == "numbaflash" and record["ok"] is True
    assert record["energy_calls"] >= energy.DEFAULT_MIN_CALLS
    assert record["energy_s"] >= 0.5
    assert record["watts"] == pytest.approx(250.0, rel=0.05)
    assert record["joules"] == pytest.approx(record["watts"] * record["energy_s"]
                                             / record["energy_calls"])
    assert record["joules_vs_sdpa"] is None                      # --no-sdpa
    assert meta["idle_watts"] == pytest.approx(250.0, rel=0.05)
    assert meta["idle_subtracted"] is False
    assert meta["gpu"] == "Board 250 W" and meta["matched_by"] == "uuid GPU-bbbb"
    assert "J/call" in out and f"{record['joules']:.4g}" in out
    assert "idle power not subtracted" in out
    assert "bench [1/1]" in err and "energy forward" in err
