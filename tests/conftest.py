"""Test-wide settings: Hypothesis profiles, the simulator's thread switch interval, fixtures.

Hypothesis profiles (every one has deadline=None: the first launch of a kernel JIT-compiles
it, 1-2 s on a GPU, and a simulated launch is slow by nature). ``max_examples`` is the
count for kernel tests; NumPy-only tests ask for a multiple via ``strategies.examples()``.

    profile     max_examples  used by
    sim         20            the default under the simulator:
                                  NUMBA_ENABLE_CUDASIM=1 pytest -n auto
                                  bash scripts/run test        (a developer's machine)
    gpu         25            the default when numbaflash.backend() == "gpu":
                                  pytest -n 0 tests/           (on a machine with a GPU)
    gpu-quick   6             asked for by name when GPU time is short:
                                  NUMBAFLASH_PROFILE=gpu-quick bash scripts/gpu_all.sh tests
    thorough    1000          asked for by name, e.g. before a release:
                                  NUMBAFLASH_PROFILE=thorough pytest ...
    numbaflash-ci             whenever the CI environment variable is set (CI=true, as
                              .ci/run is run): Hypothesis's built-in ``ci`` profile
                              (derandomized, no example database, print_blob), with the
                              example count of the profile that would otherwise apply
                              (sim, gpu, or NUMBAFLASH_PROFILE's), and deadline=None.
                              CI therefore always runs the same examples; it never loads a
                              randomized profile.

NUMBAFLASH_PROFILE=name picks the profile outside CI (sim, gpu, thorough, or any profile
Hypothesis knows, e.g. default); under CI it picks only the example count.

Simulator speed: under NUMBA_ENABLE_CUDASIM=1 every simulated GPU thread is a Python
thread, and a barrier waits for all of a block's threads. ``sys.setswitchinterval(2e-4)``
(default 5e-3) makes the interpreter hand over between them sooner; TESTING.md measured a
small FlashAttention forward 5x faster with it. It is set in each test process (pytest-xdist
workers import this file too).

Simulator race: numba-cuda 0.30.4's simulator can hand the threads of a launch's first
block different copies of a ``cuda.shared.array`` (an unlocked check-then-set); numbaflash
itself replaces that lookup with a locked one when the simulator is on
(numbaflash/kernels/simulated.py, ``_shared_array``), for users' runs as well as these.

Fixtures:
    nan_prefilled_outputs (module scope): while active, the arrays that numbaflash
        allocates for kernel outputs (numbaflash.arrays.device_empty) start filled with
        NaN instead of whatever memory held. An element a kernel never writes then shows
        as a NaN where the reference has none. Use it with
        ``pytestmark = pytest.mark.usefixtures("nan_prefilled_outputs")``.
"""

import os
import sys

import numpy as np
import pytest
from hypothesis import settings

from numbaflash.kernels import simulating

PROFILE_EXAMPLES = {"sim": 20, "gpu": 25, "gpu-quick": 6, "thorough": 1000}
for _name, _n in PROFILE_EXAMPLES.items():
    settings.register_profile(_name, max_examples=_n, deadline=None)


def _backend_profile():
    if simulating():
        return "sim"
    try:
        from numbaflash import backend
        return "gpu" if backend() == "gpu" else "sim"
    except RuntimeError:          # neither a GPU nor the simulator: NumPy tests only
        return "sim"


def _choose_profile():
    name = os.environ.get("NUMBAFLASH_PROFILE") or _backend_profile()
    if "CI" in os.environ:
        # Hypothesis has already loaded its own "ci" profile (it does when CI is set);
        # keep everything it sets (derandomize=True, database=None, ...) and change only
        # the example count and the deadline.
        count = settings.get_profile(name).max_examples
        settings.register_profile("numbaflash-ci", parent=settings.get_profile("ci"),
                                  max_examples=count, deadline=None)
        return "numbaflash-ci"
    return name


HYPOTHESIS_PROFILE = _choose_profile()
settings.load_profile(HYPOTHESIS_PROFILE)

if simulating():
    sys.setswitchinterval(2e-4)




def pytest_report_header(config):
    s = settings.default
    return (f"numbaflash: hypothesis profile {HYPOTHESIS_PROFILE!r} (max_examples="
            f"{s.max_examples}, derandomize={s.derandomize}), simulator={simulating()}, "
            f"switchinterval={sys.getswitchinterval()}")


@pytest.fixture
def no_launch(monkeypatch):
    """Fail the test if anything reaches a kernel launch: for input that validation must
    refuse first (or that needs no launch at all)."""
    import numbaflash.api
    import numbaflash.launcher

    def launched(*args, **kwargs):
        raise AssertionError("a kernel was launched; validation should have raised first")
    for module in (numbaflash.api, numbaflash.launcher):
        monkeypatch.setattr(module, "launch_forward", launched)
        monkeypatch.setattr(module, "launch_backward", launched)
    monkeypatch.setattr(numbaflash.launcher, "launch", launched)


@pytest.fixture(scope="module")
def nan_prefilled_outputs():
    """Make numbaflash allocate kernel outputs pre-filled with NaN (see module docstring)."""
    from numba import cuda

    import numbaflash.arrays

    def nan_filled(shape, dtype, stream=None):
        return cuda.to_device(np.full(shape, np.nan, dtype=dtype))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(numbaflash.arrays, "device_empty", nan_filled)
        yield


# --- the PTX report (test_ptx.py) in the terminal summary -------------------------------
# test_ptx.py attaches ptxas's register/spill table to its reports (record_property); the
# reports reach the controlling process also under pytest-xdist, so collect them there.

_ptx_reports = []


def pytest_runtest_logreport(report):
    if report.when == "call":
        for key, value in getattr(report, "user_properties", ()):
            if key == "ptx_report":
                _ptx_reports.append((report.nodeid, value))


def pytest_terminal_summary(terminalreporter):
    if _ptx_reports:
        terminalreporter.section("numbaflash PTX report (sm_90, ptxas via nvJitLink)")
        for nodeid, text in sorted(_ptx_reports):
            terminalreporter.write_line(nodeid)
            terminalreporter.write_line(text)
