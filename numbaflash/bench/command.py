"""The command line: ``python -m numbaflash bench ...`` (``numbaflash/__main__.py`` makes
the parser; ``add_arguments`` adds the options and ``cli`` runs them).

Every bad value is refused before anything runs, with ``python -m numbaflash bench:
error: ...`` and exit status 2: numbers that are not numbers, shapes numbaflash cannot
run or the host cannot hold, a --json or --plot path in a folder that does not exist.
"""

import os
import sys

from .cases import (DTYPES, GPU_DEFAULT_SHAPES, PASSES, SIM_DEFAULT_SHAPES, _check_arguments,
                    check_host_memory, parse_shape)
from .library import FORWARD_VERSIONS, backend
from .pytorch import _torch_cuda
from .report import environment, format_table, plot, save_json
from .runner import run, wrong_results
from .timing import SIMULATOR_WARNING


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
    parser.add_argument("--causal", default="both", choices=("no", "yes", "both"),
                        help="causal mask (bottom-right; default both)")
    parser.add_argument("--dtype", default="float32", choices=DTYPES)
    parser.add_argument("--passes", default=",".join(PASSES),
                        help=f"comma-separated subset of {','.join(PASSES)} (default all)")
    parser.add_argument("--versions", default="",
                        help="forward versions to time besides the default, e.g. v2,v3")
    parser.add_argument("--repeats", type=int, metavar="N", help="timed runs, median taken, "
                        "at least 1 (default 20; 2 on the simulator)")
    parser.add_argument("--warmup", type=int, metavar="N", help="untimed runs first, at least "
                        "0 (default 3; 1 on the simulator)")
    parser.add_argument("--no-sdpa", action="store_true", help="do not time PyTorch SDPA")
    parser.add_argument("--json", metavar="PATH", help="write the records and the "
                        "environment as JSON")
    parser.add_argument("--plot", metavar="PATH", help="draw TFLOP/s against seqlen (needs "
                        "matplotlib)")


def cli(args):
    """Run the bench subcommand; returns the exit status (0 ok, 1 a wrong result, 2 usage)."""
    def fail(message):
        print(f"python -m numbaflash bench: error: {message}", file=sys.stderr)
        return 2

    try:
        where = backend()
    except RuntimeError as e:
        return fail(str(e))
    sim = where == "simulator"
    torch = _torch_cuda()
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
        passes = _comma_list(args.passes, PASSES, "passes")
        extra = _comma_list(args.versions, FORWARD_VERSIONS, "versions") if args.versions else []
        versions = [None] + extra
        causal = {"no": (False,), "yes": (True,), "both": (False, True)}[args.causal]
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

    env = environment()
    print(f"numbaflash bench: backend {env['backend']}, GPU {env['gpu']}; numba-cuda "
          f"{env['numba_cuda']}, numpy {env['numpy']}, torch {env['torch'] or 'not installed'}")
    if sim:
        print(f"WARNING: {SIMULATOR_WARNING}. The agreement checks still mean what they say.")
    if torch is None:
        print("PyTorch with CUDA is not available: no SDPA baseline; results are checked "
              "against numbaflash.reference (float64) on the first (batch, head) slice.")
    elif args.no_sdpa:
        print("--no-sdpa: SDPA is not timed (results are still checked against SDPA MATH "
              "float64).")
    try:
        records = run(shapes, causal=causal, dtype=args.dtype, passes=passes,
                      versions=versions, repeats=repeats, warmup=warmup,
                      sdpa=not args.no_sdpa)
    except MemoryError as e:
        return fail(f"out of host memory ({e}); give a smaller --shapes")
    print(format_table(records))
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
