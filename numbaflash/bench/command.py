"""The command line: ``python -m numbaflash bench ...`` (``numbaflash/__main__.py`` makes
the parser; ``add_arguments`` adds the options and ``cli`` runs them). With
``--variants`` it runs the attention variants' table (``variants.run_variants``) instead
of plain attention on shapes; with ``--inference``, decoding against a KV cache and packed
batches (``inference.run_inference``). The two are exclusive. With ``--energy`` the plain
bench also measures joules per call of numbaflash and SDPA EFFICIENT from the GPU's energy
counter (``energy.measure_energy``), after the timings; on a GPU only.

Every bad value is refused before anything runs, with ``python -m numbaflash bench:
error: ...`` and exit status 2: numbers that are not numbers, shapes numbaflash cannot
run or the host cannot hold, a --json or --plot path in a folder that does not exist, an
option that does not apply to --variants or --inference, or both of them at once;
--energy where there is no energy counter to read (the simulator, no pynvml, a GPU
without the counter).
"""

import math
import os
import sys
from collections import namedtuple

from .cases import (DTYPES, GPU_DEFAULT_SHAPES, PASSES, SIM_DEFAULT_SHAPES, _check_arguments,
                    check_host_memory, parse_shape)
from .energy import (DEFAULT_MIN_SECONDS, SIMULATOR_MESSAGE, EnergyUnavailable,
                     format_energy_table, measure_energy, open_meter)
from .inference import (INFERENCE_DTYPES, _check_inference_arguments,
                        format_inference_table, run_inference, wrong_inference)
from .library import FORWARD_VERSIONS, backend
from .pytorch import _torch_cuda
from .report import environment, format_table, plot, save_json
from .runner import run, wrong_results
from .timing import SIMULATOR_WARNING
from .variants import (VARIANT_DTYPES, _check_variant_arguments, format_variant_table,
                       run_variants, wrong_variants)

# Options of the plain bench that --variants and --inference do not take (their cases fix
# them).
NOT_WITH_CASE_TABLES = ("shapes", "causal", "passes", "versions", "plot")


def _comma_list(text, allowed, what):
    items = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in items if t not in allowed]
    if bad or not items:
        raise ValueError(f"--{what}: {', '.join(bad) or repr(text)} not among "
                         f"{', '.join(allowed)}")
    return items


def _shape_text(shapes):
    return ",".join("x".join(str(n) for n in s) for s in shapes)


def _output_path(path, option):
    """ValueError now, not after the run, when ``path``'s folder does not exist."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"--{option}: folder {folder!r} does not exist")


def add_arguments(parser):
    """The bench subcommand's options (added to the parser ``__main__`` gives)."""
    parser.add_argument("--shapes", help="comma-separated BxHxNxd or BxHxSqxSkxd, e.g. "
                        "2x16x4096x64,1x16x16384x64 (default on a GPU: "
                        f"{_shape_text(GPU_DEFAULT_SHAPES)}; on the simulator: "
                        f"{_shape_text(SIM_DEFAULT_SHAPES)})")
    parser.add_argument("--causal", choices=("no", "yes", "both"),
                        help="causal mask (bottom-right; default both)")
    parser.add_argument("--dtype", default="float32", choices=DTYPES,
                        help="inputs' dtype (default float32; --variants, --inference: "
                        "float32 or float16; bfloat16 needs ml_dtypes, which numbaflash "
                        "installs)")
    parser.add_argument("--passes",
                        help=f"comma-separated subset of {','.join(PASSES)} (default all)")
    parser.add_argument("--versions",
                        help="forward versions to time besides the default, e.g. v2,v3")
    parser.add_argument("--repeats", type=int, metavar="N", help="timed runs, median taken, "
                        "at least 1 (default 20; 2 on the simulator)")
    parser.add_argument("--warmup", type=int, metavar="N", help="untimed runs first, at least "
                        "0 (default 3; 1 on the simulator)")
    parser.add_argument("--no-sdpa", action="store_true", help="do not time PyTorch SDPA "
                        "(with --variants: nor FlexAttention)")
    parser.add_argument("--json", metavar="PATH", help="write the records and the "
                        "environment as JSON")
    parser.add_argument("--plot", metavar="PATH", help="draw TFLOP/s against seqlen (needs "
                        "matplotlib)")
    parser.add_argument("--variants", action="store_true", help="instead of plain attention "
                        "on shapes: the attention variants (GQA, softcap, ALiBi, a sliding "
                        "window, a document mask), each checked, then timed against its "
                        "baselines, with its speed target (numbaflash/bench/variants.py); "
                        "takes --dtype, --repeats, --warmup, --no-sdpa, --json")
    parser.add_argument("--inference", action="store_true", help="instead of plain attention "
                        "on shapes: the inference half of FlashAttention, decoding against a "
                        "KV cache (against SDPA and the HBM copy bandwidth) and packed "
                        "batches of different lengths (against the same batch padded), each "
                        "checked, then timed, with its target (numbaflash/bench/"
                        "inference.py); takes --dtype, --repeats, --warmup, --no-sdpa, --json; "
                        "not with --variants")
    parser.add_argument("--energy", action="store_true", help="also measure joules per call "
                        "of numbaflash and SDPA EFFICIENT, and their ratio, from the GPU's "
                        "energy counter (NVML; pip install numbaflash[energy]), after the "
                        "timings: each call repeated over a window of counter updates "
                        "(numbaflash/bench/energy.py); total board energy, the idle power "
                        "shown beside it; on a GPU only, not with --variants or --inference")
    parser.add_argument("--energy-seconds", type=float, metavar="S", help="with --energy: "
                        f"each measured window's least duration (default "
                        f"{DEFAULT_MIN_SECONDS:g})")


def _header(sim, torch, no_sdpa, variants=False, inference=False):
    """The lines before the table: what runs where, and what the times mean."""
    env = environment()
    mode = " --variants" if variants else " --inference" if inference else ""
    print(f"numbaflash bench{mode}: backend {env['backend']}, "
          f"GPU {env['gpu']}; numba-cuda {env['numba_cuda']}, numpy {env['numpy']}, torch "
          f"{env['torch'] or 'not installed'}")
    if sim:
        print(f"WARNING: {SIMULATOR_WARNING}. The agreement checks still mean what they say.")
    if inference:
        print("Each case is checked against numbaflash.reference (float64) before it is "
              "timed: decoding on the first batch (every query head), packed batches on the "
              "first sequence.")
        if torch is None:
            print("PyTorch with CUDA is not available: no SDPA baseline.")
        elif no_sdpa:
            print("--no-sdpa: SDPA is not timed.")
    elif variants:
        print("Each variant is checked against numbaflash.reference (float64) on the first "
              "batch and the query heads of K/V head 0 before it is timed.")
        if torch is None:
            print("PyTorch with CUDA is not available: no SDPA or FlexAttention baseline.")
        elif no_sdpa:
            print("--no-sdpa: SDPA and FlexAttention are not timed.")
    elif torch is None:
        print("PyTorch with CUDA is not available: no SDPA baseline; results are checked "
              "against numbaflash.reference (float64) on the first (batch, head) slice.")
    elif no_sdpa:
        print("--no-sdpa: SDPA is not timed (results are still checked against SDPA MATH "
              "float64).")
    return env


# What ``bench --variants`` and ``bench --inference`` each run: a table of fixed cases.
# ``check(dtype, repeats, warmup, None, None)`` refuses bad numbers (ValueError);
# ``run(dtype=, repeats=, warmup=, sdpa=)`` returns the records, ``format`` prints them,
# ``wrong`` lists the records that disagree with the reference; ``catch``: the exceptions
# of ``run`` reported as usage errors (besides MemoryError); ``wrong_rows``: how the table
# marks those records.
CaseTable = namedtuple("CaseTable", "option dtypes check run format wrong catch wrong_rows")


def _case_table(mode):
    """The CaseTable of ``mode`` ("variants" or "inference"), made when asked (so that a
    test's stand-in for run_variants or run_inference is the one called)."""
    if mode == "variants":
        return CaseTable("--variants", VARIANT_DTYPES, _check_variant_arguments, run_variants,
                         format_variant_table, wrong_variants, (ValueError,),
                         "WRONG RESULT rows")
    return CaseTable("--inference", INFERENCE_DTYPES, _check_inference_arguments,
                     run_inference, format_inference_table, wrong_inference, (),
                     "WRONG rows")


def _cli_cases(args, fail, sim, torch, mode):
    """``bench --variants`` or ``bench --inference`` (``mode``): its table of fixed cases
    (``_case_table``), after refusing the plain bench's options it does not take."""
    table = _case_table(mode)
    given = [f"--{name}" for name in NOT_WITH_CASE_TABLES if getattr(args, name) is not None]
    if given:
        return fail(f"{', '.join(given)}: not with {table.option} (its cases fix their "
                    f"shapes, masks, passes and kernels; it takes --dtype, --repeats, "
                    f"--warmup, --no-sdpa and --json)")
    if args.dtype not in table.dtypes:
        return fail(f"--dtype {args.dtype}: {table.option} times "
                    f"{' or '.join(table.dtypes)} (its targets are about those)")
    repeats = args.repeats if args.repeats is not None else (2 if sim else 20)
    warmup = args.warmup if args.warmup is not None else (1 if sim else 3)
    try:
        table.check(args.dtype, repeats, warmup, None, None)
        if args.json:
            _output_path(args.json, "json")
    except ValueError as e:
        return fail(str(e))
    env = _header(sim, torch, args.no_sdpa, **{mode: True})
    try:
        records = table.run(dtype=args.dtype, repeats=repeats, warmup=warmup,
                            sdpa=not args.no_sdpa)
    except table.catch as e:                 # a check the host's memory cannot hold
        return fail(str(e))
    except MemoryError as e:
        return fail(f"out of host memory ({e})")
    print(table.format(records))
    if args.json:
        save_json(records, args.json, meta=env)
        print(f"wrote {args.json}")
    wrong = table.wrong(records)
    if wrong:
        print(f"FAILED: {len(wrong)} result(s) disagree with the reference and were not "
              f"timed ({table.wrong_rows} above).", file=sys.stderr)
        return 1
    return 0


def _energy_refusal(args, sim):
    """Why ``--energy`` (or ``--energy-seconds``) cannot be taken, or None; before the
    meter is opened."""
    if args.energy_seconds is not None and not args.energy:
        return "--energy-seconds: only with --energy"
    if not args.energy:
        return None
    if args.variants or args.inference:
        mode = "--variants" if args.variants else "--inference"
        return f"--energy: not with {mode} (it measures the plain bench's cases)"
    if sim:
        return f"--energy: {SIMULATOR_MESSAGE}"
    if args.energy_seconds is not None and not (math.isfinite(args.energy_seconds)
                                                and args.energy_seconds > 0):
        return f"--energy-seconds must be a number > 0; got {args.energy_seconds:g}"
    return None


def cli(args):
    """Run the bench subcommand; returns the exit status (0 ok, 1 a wrong result, 2 usage)."""
    def fail(message):
        print(f"python -m numbaflash bench: error: {message}", file=sys.stderr)
        return 2

    if args.variants and args.inference:
        return fail("--inference and --variants are exclusive: each runs a table of its "
                    "own; give one of them")
    try:
        where = backend()
    except RuntimeError as e:
        return fail(str(e))
    sim = where == "simulator"
    refusal = _energy_refusal(args, sim)
    if refusal:
        return fail(refusal)
    torch = _torch_cuda()
    if args.variants or args.inference:
        return _cli_cases(args, fail, sim, torch, "variants" if args.variants else "inference")
    try:
        if args.shapes is None:
            shapes = list(SIM_DEFAULT_SHAPES if sim else GPU_DEFAULT_SHAPES)
        else:
            try:
                shapes = [parse_shape(s.strip()) for s in args.shapes.split(",") if s.strip()]
            except ValueError as e:
                raise ValueError(f"--shapes: {e}") from None
            if not shapes:
                raise ValueError("--shapes is empty")
        passes = (_comma_list(args.passes, PASSES, "passes") if args.passes is not None
                  else list(PASSES))
        extra = _comma_list(args.versions, FORWARD_VERSIONS, "versions") if args.versions else []
        versions = [None] + extra
        causal = {"no": (False,), "yes": (True,), "both": (False, True)}[args.causal or "both"]
        repeats = args.repeats if args.repeats is not None else (2 if sim else 20)
        warmup = args.warmup if args.warmup is not None else (1 if sim else 3)
        if args.plot:
            try:
                import matplotlib  # noqa: F401 - fail now, not after the run
            except ImportError:
                raise ValueError("--plot needs matplotlib (pip install matplotlib)") from None
            _output_path(args.plot, "plot")
        if args.json:
            _output_path(args.json, "json")
        shapes = _check_arguments(shapes, causal, args.dtype, passes, versions, repeats,
                                  warmup)[0]
        if torch is None:                    # NumPy inputs and the NumPy check, on the host
            check_host_memory(shapes, args.dtype, simulator=sim, numpy_check=True,
                              backward="backward" in passes or "fwd+bwd" in passes)
    except ValueError as e:
        return fail(str(e))
    meter = None
    if args.energy:
        try:
            meter = open_meter()             # pynvml, NVML, the device, the counter: now
        except EnergyUnavailable as e:
            return fail(f"--energy: {e}")
    try:
        return _cli_plain(args, fail, sim, torch, shapes, causal, passes, versions, repeats,
                          warmup, meter)
    finally:
        if meter is not None:
            meter.close()


def _cli_plain(args, fail, sim, torch, shapes, causal, passes, versions, repeats, warmup,
               meter):
    """The plain bench once its arguments are checked (and ``meter`` opened for --energy):
    run, print, write."""
    env = _header(sim, torch, args.no_sdpa)
    if meter is not None:
        print(f"--energy: after the timings, joules per call from NVML's energy counter of "
              f"{meter.name} (matched by {meter.matched_by}).")
    try:
        records = run(shapes, causal=causal, dtype=args.dtype, passes=passes,
                      versions=versions, repeats=repeats, warmup=warmup,
                      sdpa=not args.no_sdpa)
    except MemoryError as e:
        return fail(f"out of host memory ({e}); give a smaller --shapes")
    print(format_table(records))
    if meter is not None:
        seconds = DEFAULT_MIN_SECONDS if args.energy_seconds is None else args.energy_seconds
        try:
            env["energy"] = measure_energy(records, meter, min_seconds=seconds)
        except EnergyUnavailable as e:
            return fail(f"--energy: {e}")
        print(format_energy_table(records, env["energy"]))
    if args.json:
        save_json(records, args.json, meta=env)
        print(f"wrote {args.json}")
    if args.plot:
        plot(records, args.plot)
        print(f"wrote {args.plot}")
    wrong = wrong_results(records)
    if wrong:
        print(f"FAILED: {len(wrong)} result(s) disagree with the reference and were not "
              f"timed (WRONG RESULT rows above).", file=sys.stderr)
        return 1
    return 0
