"""Energy per call from the GPU's own energy counter (``python -m numbaflash bench --energy``).

What is read. NVML's ``nvmlDeviceGetTotalEnergyConsumption``: the energy the whole board
(GPU and its memory) has taken since the driver was loaded, in millijoules, on Volta and
newer GPUs. The binding is the ``nvidia-ml-py`` package (imported as ``pynvml``), the
optional extra ``pip install numbaflash[energy]``. The NVML device is the one the CUDA
context runs on, found by its UUID, or else by its PCI bus id: NVML numbers the GPUs in
PCI order on the whole machine, CUDA in its own order among the visible ones
(``CUDA_VISIBLE_DEVICES``), so the two indices need not agree. Under MIG the counter is
the whole GPU's.

How often the counter moves. NVML's API reference gives the unit and nothing about the
update rate; what is known was observed. The pull request that added the call to the
pynvml binding (gpuopenanalytics/pynvml#18) saw the value change about every 10 ms;
PETSc's manual page for ``PetscLogGpuEnergyMeter`` says the readings of newer GPUs are
updated every 20-100 ms; the Zeus project's notes on measuring GPU energy (ml.energy)
say about every 100 ms. And the readings do not see all of the time: on the A100 and
H100 the power sensor's samples cover about a quarter of it (Yang et al., "Part-time
Power Measurements: nvidia-smi's Lack of Attention", arXiv:2312.02741), which a long
window of a steady load averages out and a short one does not.

So one call is never measured alone (``EnergyMeter.measure``):

1. Warm-up: the call, synchronized, for ``warmup_seconds``, so the clocks and the power
   are those of the call's steady state.
2. Start on an update: poll the counter (every ``poll_seconds``) until it changes, and
   take that value and that moment as the start.
3. Run the call again and again, each followed by a synchronize (as ``timing.time_ms``
   times it: launch overhead included), until both ``min_calls`` calls and
   ``min_seconds`` seconds have passed; by default 2 s, at least 20 updates of a 100 ms
   counter.
4. End on an update: synchronize, poll until the counter changes again, and take that
   value and moment as the end.

joules per call = (E_end - E_start) / calls; mean power = (E_end - E_start) / (t_end -
t_start). Both are the board's total, not idle-subtracted. The window includes the GPU
idle between the last call's end and the next update (``tail_s``: up to one update
period, two if an update falls just after the last call), whose energy is counted in:
with a 100 ms counter, a 2 s window and an idle power a fifth of the call's, at most
about 2 %. The idle power is measured on its own
(``EnergyMeter.idle_watts``: a window of the same rule with nothing running) and
reported beside the numbers, never subtracted from them.
"""

import math
import time
from contextlib import nullcontext
from dataclasses import dataclass

from numba import cuda

from .library import simulating
from .pytorch import _sdpa_backend, _torch_cuda, sdpa_mask
from .report import aligned_rows
from .runner import _api, _make_inputs, _Progress

EXTRA = "pip install numbaflash[energy]"
COUNTER = "nvmlDeviceGetTotalEnergyConsumption"

DEFAULT_MIN_SECONDS = 2.0
DEFAULT_MIN_CALLS = 5
DEFAULT_WARMUP_SECONDS = 0.5
POLL_SECONDS = 0.001
# A counter that has not moved for this long is not moving: NVML's updates come every
# 10-100 ms on the GPUs the module docstring names.
MAX_WAIT_SECONDS = 2.0

# The implementations whose energy the bench measures: numbaflash's (every version timed)
# and SDPA EFFICIENT, the baseline of the time ratio ``vs_sdpa``.
SDPA_ENERGY_IMPL = "sdpa_efficient"
ENERGY_KEYS = ("joules", "watts", "energy_calls", "energy_s", "joules_vs_sdpa")


class EnergyUnavailable(RuntimeError):
    """The energy of a call cannot be measured here; the message says why."""


SIMULATOR_MESSAGE = ("energy is read from a GPU's energy counter (NVML); under the CUDA "
                     "simulator (NUMBA_ENABLE_CUDASIM=1) there is no GPU to read it from")


def load_nvml():
    """The ``pynvml`` module (from ``nvidia-ml-py``).

    Raises:
        EnergyUnavailable: it is not installed; the message names the extra to install.
    """
    try:
        import pynvml
    except ImportError:
        raise EnergyUnavailable(f"energy needs NVML's Python binding, nvidia-ml-py (import "
                                f"pynvml), which is not installed: {EXTRA}") from None
    return pynvml


def _text(x):
    return x.decode() if isinstance(x, bytes) else str(x)


def _pci_bus_id(device):
    """The CUDA device's PCI bus id as NVML writes it ("00000000:3B:00.0"), or None when
    the device does not say (the simulator's)."""
    parts = [getattr(device, f"PCI_{name}_ID", None) for name in ("DOMAIN", "BUS", "DEVICE")]
    if any(p is None for p in parts):
        return None
    domain, bus, dev = parts
    return f"{domain:08X}:{bus:02X}:{dev:02X}.0"


def nvml_handle(nvml, device):
    """The NVML handle of CUDA ``device`` and how it was found.

    By the device's UUID ("GPU-..." in both APIs) first, then by its PCI bus id; never by
    index. A MIG instance's handle is replaced by its GPU's, whose counter there is.

    Args:
        nvml: the ``pynvml`` module (initialised), or a stand-in with the same functions.
        device: a numba CUDA device (``cuda.get_current_device()``): ``uuid`` and the
            attributes ``PCI_DOMAIN_ID``, ``PCI_BUS_ID``, ``PCI_DEVICE_ID``.

    Returns:
        ``(handle, matched_by)``, ``matched_by`` being "uuid GPU-..." or "PCI bus id ...",
        with " (MIG instance: the whole GPU's counter)" after it for a MIG instance.

    Raises:
        EnergyUnavailable: no NVML device has that UUID or PCI bus id.
    """
    uuid = getattr(device, "uuid", None)
    bus_id = _pci_bus_id(device)
    handle = matched_by = None
    if uuid:
        try:
            handle, matched_by = nvml.nvmlDeviceGetHandleByUUID(_text(uuid)), f"uuid {uuid}"
        except nvml.NVMLError:
            handle = None
    if handle is None and bus_id is not None:
        try:
            handle, matched_by = nvml.nvmlDeviceGetHandleByPciBusId(bus_id), f"PCI bus id {bus_id}"
        except nvml.NVMLError:
            handle = None
    if handle is None:
        raise EnergyUnavailable(f"no NVML device matches the CUDA device (uuid {uuid}, PCI "
                                f"bus id {bus_id}): cannot tell which GPU's energy to read")
    is_mig = getattr(nvml, "nvmlDeviceIsMigDeviceHandle", None)
    if is_mig is not None:
        try:
            mig = bool(is_mig(handle))
        except nvml.NVMLError:
            mig = False
        if mig:
            handle = nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle)
            matched_by += " (MIG instance: the whole GPU's counter)"
    return handle, matched_by


@dataclass
class EnergyReading:
    """One measured window (``EnergyMeter.measure``).

    Attributes:
        joules_per_call: the board's energy over the window / calls, in joules (total,
            not idle-subtracted).
        watts: the board's mean power over the window, in watts.
        calls: the calls run in the window.
        seconds: the window, from the counter update that started it to the one that
            ended it.
        tail_s: of ``seconds``, the time after the last call, the GPU idle, until the
            counter's next update (counted in ``joules_per_call``).
    """

    joules_per_call: float
    watts: float
    calls: int
    seconds: float
    tail_s: float


def _cuda_device():
    """The device of the current CUDA context (a function, so that tests can stand in)."""
    return cuda.get_current_device()


class EnergyMeter:
    """Energy per call from NVML's total energy counter of the GPU the CUDA context uses.

    Args:
        nvml: the ``pynvml`` module, or a stand-in with its functions (tests); None
            imports it (``load_nvml``).
        device: the CUDA device; None is the current context's.
        clock, sleep, synchronize: the clock (seconds), the wait, and the wait for the
            GPU; by default ``time.perf_counter``, ``time.sleep``, ``cuda.synchronize``.
        poll_seconds: how often the counter is read while waiting for it to move.
        max_wait_seconds: how long a counter that does not move is waited for.

    Raises:
        EnergyUnavailable: pynvml is missing, NVML cannot start, no NVML device matches
            the CUDA device, or the GPU does not support the counter.
    """

    def __init__(self, nvml=None, device=None, *, clock=time.perf_counter, sleep=time.sleep,
                 synchronize=None, poll_seconds=POLL_SECONDS,
                 max_wait_seconds=MAX_WAIT_SECONDS):
        self.nvml = load_nvml() if nvml is None else nvml
        self._clock, self._sleep = clock, sleep
        self._synchronize = cuda.synchronize if synchronize is None else synchronize
        self.poll_seconds, self.max_wait_seconds = poll_seconds, max_wait_seconds
        try:
            self.nvml.nvmlInit()
        except self.nvml.NVMLError as e:
            raise EnergyUnavailable(f"NVML could not be started ({e}); it comes with the "
                                    f"NVIDIA driver") from None
        self._open = True
        try:
            device = _cuda_device() if device is None else device
            self.handle, self.matched_by = nvml_handle(self.nvml, device)
            self.name = _text(self.nvml.nvmlDeviceGetName(self.handle))
            self.read_mj()                      # EnergyUnavailable now if not supported
        except BaseException:
            self.close()
            raise

    def close(self):
        """Shut NVML down (once)."""
        if self._open:
            self._open = False
            self.nvml.nvmlShutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def read_mj(self):
        """The counter now: millijoules since the driver was loaded.

        Raises:
            EnergyUnavailable: the GPU does not support the counter (NVML_ERROR_NOT_SUPPORTED,
                e.g. older than Volta), or NVML fails to read it.
        """
        try:
            return int(self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle))
        except self.nvml.NVMLError as e:
            if getattr(e, "value", None) == self.nvml.NVML_ERROR_NOT_SUPPORTED:
                raise EnergyUnavailable(
                    f"the GPU {getattr(self, 'name', '?')} does not support NVML's energy "
                    f"counter ({COUNTER}: NVML_ERROR_NOT_SUPPORTED; it needs a Volta or "
                    f"newer GPU)") from None
            raise EnergyUnavailable(f"NVML could not read the energy counter ({COUNTER}: "
                                    f"{e})") from None

    def _next_update(self):
        """Wait for the counter to move: ``(millijoules, seconds)`` of its new value."""
        before = self.read_mj()
        start = self._clock()
        while True:
            self._sleep(self.poll_seconds)
            value, now = self.read_mj(), self._clock()
            if value < before:
                raise EnergyUnavailable(f"the energy counter went backwards ({before} mJ, "
                                        f"then {value} mJ): was the driver reloaded?")
            if value != before:
                return value, now
            if now - start > self.max_wait_seconds:
                raise EnergyUnavailable(f"the energy counter ({COUNTER}) did not change "
                                        f"in {self.max_wait_seconds:g} s")

    def measure(self, fn, *, min_seconds=DEFAULT_MIN_SECONDS, min_calls=DEFAULT_MIN_CALLS,
                warmup_seconds=DEFAULT_WARMUP_SECONDS):
        """Run ``fn()`` over a window of counter updates; its energy per call.

        The module docstring gives the method: warm-up, start on an update, the calls
        (each synchronized) until ``min_calls`` and ``min_seconds`` are both reached, end
        on an update.

        Args:
            fn: the call to measure (launches work on the GPU).
            min_seconds: the window's least duration (> 0).
            min_calls: the least number of calls in the window (>= 1).
            warmup_seconds: how long ``fn`` runs before the window (at least once).

        Returns:
            An ``EnergyReading``.

        Raises:
            ValueError: a bad argument.
            EnergyUnavailable: the counter cannot be read, or does not move.
        """
        if not (isinstance(min_seconds, (int, float)) and math.isfinite(min_seconds)
                and min_seconds > 0):
            raise ValueError(f"min_seconds must be a number > 0; got {min_seconds!r}")
        if isinstance(min_calls, bool) or not isinstance(min_calls, int) or min_calls < 1:
            raise ValueError(f"min_calls must be an integer >= 1; got {min_calls!r}")
        start = self._clock()
        while True:
            fn()
            self._synchronize()
            if self._clock() - start >= warmup_seconds:
                break
        e0, t0 = self._next_update()
        calls = 0
        while calls < min_calls or self._clock() - t0 < min_seconds:
            fn()
            self._synchronize()
            calls += 1
        busy_end = self._clock()
        e1, t1 = self._next_update()
        joules = (e1 - e0) / 1000.0
        return EnergyReading(joules_per_call=joules / calls, watts=joules / (t1 - t0),
                             calls=calls, seconds=t1 - t0, tail_s=t1 - busy_end)

    def idle_watts(self, seconds=DEFAULT_MIN_SECONDS):
        """The board's mean power with nothing running, over a window of at least
        ``seconds`` from one counter update to another (after a synchronize)."""
        self._synchronize()
        e0, t0 = self._next_update()
        self._sleep(seconds)
        e1, t1 = self._next_update()
        return (e1 - e0) / 1000.0 / (t1 - t0)


def open_meter(nvml=None, device=None):
    """An ``EnergyMeter`` for the bench, or EnergyUnavailable saying why there is none
    (the simulator first, then pynvml, NVML, the device and the counter)."""
    if simulating():
        raise EnergyUnavailable(SIMULATOR_MESSAGE)
    return EnergyMeter(nvml, device)


# ---------------------------------------------------------------------------------------
# The bench's energy pass: after ``runner.run``, on the records it timed.


def _version(impl):
    """'numbaflash' -> None, 'numbaflash_v2' -> 'v2'."""
    return None if impl == "numbaflash" else impl.split("_", 1)[1]


def _numbaflash_call(rec, dev):
    """The call ``runner`` timed for this numbaflash record, on the device arrays ``dev``."""
    attention, attention_backward = _api()
    mode = "bottom_right" if rec["causal"] else None
    version = _version(rec["impl"])
    q, k, v, dout = dev["q"], dev["k"], dev["v"], dev["dout"]
    if rec["what"] == "forward":
        return lambda: attention(q, k, v, causal=mode, version=version, return_lse=True)
    if rec["what"] == "backward":
        out, lse = attention(q, k, v, causal=mode, return_lse=True)
        return lambda: attention_backward(dout, q, k, v, out, lse, causal=mode)

    def fwd_bwd():
        out, lse = attention(q, k, v, causal=mode, version=version, return_lse=True)
        return attention_backward(dout, q, k, v, out, lse, causal=mode)
    return fwd_bwd


def _sdpa_call(torch, rec, tensors):
    """The SDPA EFFICIENT call ``pytorch._bench_sdpa`` timed for this record (run it
    inside ``sdpa_kernel`` of that backend)."""
    import torch.nn.functional as F

    q, k, v, dout = tensors["q"], tensors["k"], tensors["v"], tensors["dout"]
    mask, is_causal = sdpa_mask(torch, rec["Sq"], rec["Sk"], rec["causal"], q.device)
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

    def sdpa(a, b, c):
        return F.scaled_dot_product_attention(a, b, c, attn_mask=mask, is_causal=is_causal)
    if rec["what"] == "forward":
        def fn():
            with torch.no_grad():
                return sdpa(q, k, v)
        return fn
    if rec["what"] == "backward":
        o = sdpa(qg, kg, vg)
        return lambda: torch.autograd.grad(o, (qg, kg, vg), dout, retain_graph=True)
    return lambda: torch.autograd.grad(sdpa(qg, kg, vg), (qg, kg, vg), dout)


def _measured(rec):
    """Whether the energy pass measures this record: timed (so checked, where checked),
    and numbaflash's or SDPA EFFICIENT's."""
    return rec["ms"] is not None and rec["ok"] is not False and (
        rec["impl"].startswith("numbaflash") or rec["impl"] == SDPA_ENERGY_IMPL)


def fill_energy_ratios(records):
    """``joules_vs_sdpa`` = SDPA EFFICIENT's joules per call / this record's, for the
    records of the same case and pass that both have joules (above 1: less energy than
    SDPA)."""
    key = ("B", "H", "Sq", "Sk", "d", "causal", "dtype", "what")
    sdpa = {tuple(r[k] for k in key): r["joules"] for r in records
            if r["impl"] == SDPA_ENERGY_IMPL and r.get("joules") is not None}
    for r in records:
        base = sdpa.get(tuple(r[k] for k in key))
        if r.get("joules") and base is not None:
            r["joules_vs_sdpa"] = base / r["joules"]


def measure_energy(records, meter, *, min_seconds=DEFAULT_MIN_SECONDS,
                   min_calls=DEFAULT_MIN_CALLS, progress=True):
    """Joules per call of the timed numbaflash and SDPA EFFICIENT records, in place.

    The idle power first (a window of ``min_seconds`` with nothing running), then, shape
    by shape, fresh inputs as ``runner.run`` makes them and one ``meter.measure`` window
    per record. Every record gets the keys ``ENERGY_KEYS`` (None where not measured):
    joules (per call), watts (mean over the window), energy_calls, energy_s (the window),
    joules_vs_sdpa (``fill_energy_ratios``).

    Args:
        records: ``runner.run``'s records.
        meter: an ``EnergyMeter``.
        min_seconds, min_calls: each window's least duration and number of calls.
        progress: a line per window on stderr.

    Returns:
        What the numbers mean, for the JSON's meta: the counter, the GPU and how it was
        matched, idle_watts, idle_subtracted (False), min_seconds, min_calls.
    """
    for r in records:
        for name in ENERGY_KEYS:
            r.setdefault(name, None)
    idle = meter.idle_watts(min_seconds)
    targets = [r for r in records if _measured(r)]
    torch = _torch_cuda()                    # None without PyTorch with CUDA: no SDPA records
    shapes = list(dict.fromkeys((r["B"], r["H"], r["Sq"], r["Sk"], r["d"]) for r in targets))
    bar = _Progress(len(targets), progress)
    for index, shape in enumerate(shapes):
        case = [r for r in targets if (r["B"], r["H"], r["Sq"], r["Sk"], r["d"]) == shape]
        _, tensors, dev = _make_inputs(torch, shape, case[0]["dtype"], seed=index)
        for rec in case:
            bar.step(f"energy {rec['what']:8s} {shape} causal={rec['causal']} "
                     f"{rec['dtype']} {rec['impl']}")
            if rec["impl"] == SDPA_ENERGY_IMPL:
                from torch.nn.attention import sdpa_kernel
                context = sdpa_kernel(_sdpa_backend(torch, "efficient"))
            else:
                context = nullcontext()
            with context:
                fn = (_sdpa_call(torch, rec, tensors) if rec["impl"] == SDPA_ENERGY_IMPL
                      else _numbaflash_call(rec, dev))
                reading = meter.measure(fn, min_seconds=min_seconds, min_calls=min_calls)
            del fn
            rec.update(joules=reading.joules_per_call, watts=reading.watts,
                       energy_calls=reading.calls, energy_s=reading.seconds)
        del tensors, dev
        if torch is not None:
            torch.cuda.empty_cache()
    fill_energy_ratios(records)
    return {"counter": f"NVML {COUNTER}", "gpu": meter.name, "matched_by": meter.matched_by,
            "idle_watts": idle, "idle_subtracted": False, "min_seconds": min_seconds,
            "min_calls": min_calls}


def format_energy_table(records, meta):
    """The measured records' energy as a text table, with what the numbers mean under it."""
    head = ("shape (B,H,Sq,Sk,d)", "causal", "dtype", "pass", "impl", "J/call", "mean W",
            "calls", "window s", "J vs SDPA")
    rows = [(f"({r['B']},{r['H']},{r['Sq']},{r['Sk']},{r['d']})",
             "yes" if r["causal"] else "no", r["dtype"], r["what"], r["impl"],
             f"{r['joules']:.4g}", f"{r['watts']:.1f}", str(r["energy_calls"]),
             f"{r['energy_s']:.2f}",
             "-" if r.get("joules_vs_sdpa") is None else f"{r['joules_vs_sdpa']:.3f}x")
            for r in records if r.get("joules") is not None]
    out = [f"Energy per call: {meta['counter']} of {meta['gpu']} (matched by "
           f"{meta['matched_by']}); windows of at least {meta['min_seconds']:g} s and "
           f"{meta['min_calls']} calls, from one counter update to another."]
    out += aligned_rows(head, rows, numeric={5, 6, 7, 8, 9}) if rows else [
        "(no record was timed, so none was measured)"]
    out.append(f"J/call and mean W are the whole board's, idle power not subtracted; idle "
               f"power, measured over a window of nothing running: {meta['idle_watts']:.1f} W.")
    out.append("J vs SDPA = SDPA EFFICIENT's J/call / this J/call (>1 means less energy "
               "than SDPA).")
    return "\n".join(out)


__all__ = ["EnergyMeter", "EnergyReading", "EnergyUnavailable", "load_nvml", "nvml_handle",
           "open_meter", "measure_energy", "fill_energy_ratios", "format_energy_table",
           "SIMULATOR_MESSAGE", "EXTRA"]
