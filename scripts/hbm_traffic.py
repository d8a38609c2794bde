"""Memory traffic of the v2 forward against its tile size, measured with Nsight Compute.

    python scripts/hbm_traffic.py [--shape B H N d] [--dtype float32] [--tiles 64x64,32x32]
                                  [--ncu PATH] [--timeout S] [--json FILE]

For each tile pair (Br, Bc), by default every pair of the library's candidate tiles
(``TILE_CANDIDATES``, in kernels/backward/v1_two_kernels.py) whose K/V tiles fit in
forward v2's shared memory at this head dim, it runs Nsight Compute once on a child
Python process that calls ``numbaflash.attention(q, k, v, version="v2", tiles=(Br, Bc))``
once on device arrays (random normal inputs, non-causal, Sq = Sk = N). ncu profiles that
one launch only (``--kernel-name regex:forward_v2 --launch-count 1``) and reads

    dram__bytes_read.sum, dram__bytes_write.sum   bytes between the L2 cache and HBM
    lts__t_sectors_srcunit_tex_op_read.sum        32-byte sectors the SMs read from L2

(if ncu rejects the third, the run is repeated with the DRAM metrics only). ncu replays
the kernel with the caches flushed before each pass (its default ``--cache-control all``),
so every launch starts from a cold L2.

It prints one line per pair with the model's bytes beside the measured ones
(``model_bytes``: Q read once, K and V once per query tile, O and L written once), and
``--json`` writes everything, errors included. Nothing is estimated in place of a
measurement: if ncu is missing, refused (no permission for the performance counters) or
failed, the pair's entry says so, its measured values are None, and the exit status is
non-zero (2: ncu not found; 1: some pair not measured).

Needs a CUDA GPU, numbaflash importable (the repository root is put on the child's
PYTHONPATH) and ncu on PATH or given by --ncu. ``--worker`` is the child's mode.
"""

import argparse
import csv
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))              # numbaflash from this checkout, installed or not
KERNEL_REGEX = "regex:forward_v2"
DRAM_METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum")
L2_METRIC = "lts__t_sectors_srcunit_tex_op_read.sum"
SECTOR_BYTES = 32
# ncu's unit names, scaled to the base unit (ncu scales bytes by powers of 1000). With
# --print-units base every value is already in bytes, sectors or nanoseconds.
UNIT_SCALE = {"": 1, "byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "Tbyte": 1e12,
              "sector": 1, "Ksector": 1e3, "Msector": 1e6, "Gsector": 1e9,
              "nsecond": 1, "usecond": 1e3, "msecond": 1e6, "second": 1e9}


# ---------------------------------------------------------------------------------------
# The model


def model_bytes(B, H, N, d, Br, itemsize=4, lse_itemsize=4):
    """HBM bytes of the v2 forward counted from its loops (non-causal, Sq = Sk = N).

    Per (batch, head): each of the ceil(N / Br) query tiles reads its rows of Q once and
    all of K and V (2 N d elements); O (N d elements) and L (N values) are written once.
    Returns ``(read, write)`` in bytes for all B * H heads.
    """
    Tr = math.ceil(N / Br)
    read = itemsize * (N * d + Tr * 2 * N * d)          # Q once, K and V once per query tile
    write = itemsize * N * d + lse_itemsize * N         # O and L once
    return B * H * read, B * H * write


def sram_elements(Br, Bc, d):
    """On-chip elements one v2 block works with: its Q rows (registers) and Kj, Vj (shared)."""
    return Br * d + 2 * Bc * d


def theorem2_accesses(B, H, N, d, M):
    """FlashAttention paper, Theorem 2: Theta(N^2 d^2 / M) HBM accesses per head for an
    on-chip memory of M elements (the constant is not given; this is N^2 d^2 / M)."""
    return B * H * N * N * d * d / M


# ---------------------------------------------------------------------------------------
# Tile pairs


def tile_pairs(d, dtype="float32"):
    """The forward's candidate tile pairs whose Kj, Vj fit in a block's shared memory."""
    from numbaflash.kernels.backward.v1_two_kernels import TILE_CANDIDATES
    from numbaflash.kernels.forward import v2_flash2
    from numbaflash.kernels.plan import SHARED_MEM_LIMIT
    acc = "float64" if dtype == "float64" else "float32"
    return [(Br, Bc) for Br, Bc in TILE_CANDIDATES
            if v2_flash2.forward_shared_bytes(Br, Bc, d, acc) <= SHARED_MEM_LIMIT]


def parse_tiles(text):
    """'64x64,32x16' -> [(64, 64), (32, 16)]."""
    pairs = []
    for item in text.split(","):
        br, bc = item.lower().split("x")
        pairs.append((int(br), int(bc)))
    return pairs


# ---------------------------------------------------------------------------------------
# ncu's CSV


def parse_value(value, unit):
    """One 'Metric Value' cell (digits may be grouped by commas) in the base unit.

    Raises ValueError for an empty or non-numeric value ("n/a") and for an unknown unit:
    a value that cannot be read is not a zero.
    """
    if unit not in UNIT_SCALE:
        raise ValueError(f"unknown ncu metric unit {unit!r}")
    text = value.strip().replace(",", "")
    try:
        number = float(text)
    except ValueError:
        raise ValueError(f"ncu metric value {value!r} is not a number") from None
    if not math.isfinite(number):
        raise ValueError(f"ncu metric value {value!r} is not finite")
    return number * UNIT_SCALE[unit]


def parse_ncu_csv(text):
    """The launches in the output of ``ncu --csv --metrics ...``, in launch order.

    ncu prints its own lines (``==PROF== ...``, ``==WARNING== ...``) and the profiled
    program's output around one table: a header row (``"ID","Process ID",...,"Kernel
    Name",...,"Metric Name","Metric Unit","Metric Value"``; the columns in between differ
    between ncu versions) and one row per (launch, metric). Returns a list of dicts
    ``{"id", "kernel", "block", "grid", "metrics": {name: value in the base unit}}``
    ("block" and "grid" are None where this ncu has no such columns).
    Raises ValueError when there is no table or a value cannot be read.
    """
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines)
                  if line.startswith('"ID"') and '"Metric Name"' in line), None)
    if start is None:
        raise ValueError("no CSV table in ncu's output (no line starting with \"ID\" and "
                         "naming a \"Metric Name\" column)")
    table = [line for line in lines[start:] if line.strip() and not line.startswith("==")]
    reader = csv.DictReader(table)
    for column in ("ID", "Kernel Name", "Metric Name", "Metric Unit", "Metric Value"):
        if column not in reader.fieldnames:
            raise ValueError(f"ncu's CSV has no {column!r} column: {reader.fieldnames}")
    launches = {}
    for row in reader:
        launch = launches.setdefault(row["ID"], {
            "id": row["ID"], "kernel": row["Kernel Name"], "block": row.get("Block Size"),
            "grid": row.get("Grid Size"), "metrics": {}})
        launch["metrics"][row["Metric Name"]] = parse_value(row["Metric Value"],
                                                            row["Metric Unit"])
    return list(launches.values())


# ---------------------------------------------------------------------------------------
# Running ncu


def find_ncu(ncu=None):
    """Path of the ncu executable: ``ncu`` if given, else $NCU, ncu on PATH, or where the
    CUDA toolkit and Nsight Compute installers put it. None if there is none."""
    if ncu:
        return ncu if Path(ncu).exists() or shutil.which(ncu) else None
    candidates = [os.environ.get("NCU"), shutil.which("ncu"), "/usr/local/cuda/bin/ncu"]
    candidates += sorted(map(str, Path("/usr/local").glob("cuda-*/bin/ncu")), reverse=True)
    candidates += sorted(map(str, Path("/opt/nvidia").glob("nsight-compute/*/ncu")), reverse=True)
    for candidate in candidates:
        if candidate and Path(candidate).is_file():
            return candidate
    return None


def ncu_version(ncu):
    try:
        out = subprocess.run([ncu, "--version"], capture_output=True, text=True, timeout=60)
        return out.stdout.strip().splitlines()[-1] if out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def worker_command(shape, dtype, tiles):
    return [sys.executable, str(Path(__file__).resolve()), "--worker",
            "--shape", *map(str, shape), "--dtype", dtype, "--tiles", f"{tiles[0]}x{tiles[1]}"]


def ncu_command(ncu, metrics, shape, dtype, tiles, base_units=True):
    """The ncu command line that profiles one v2 forward launch with ``tiles``."""
    cmd = [ncu, "--csv", "--target-processes", "all", "--kernel-name", KERNEL_REGEX,
           "--launch-skip", "0", "--launch-count", "1", "--metrics", ",".join(metrics)]
    if base_units:
        cmd[2:2] = ["--print-units", "base"]
    return cmd + worker_command(shape, dtype, tiles)


def child_env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.pop("NUMBA_ENABLE_CUDASIM", None)        # the child must run on the GPU
    return env


def run_ncu(cmd, timeout):
    """Run one ncu command; return (launches, error text or None, seconds)."""
    t0 = time.perf_counter()
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=child_env())
    except subprocess.TimeoutExpired:
        return None, f"ncu did not finish in {timeout} s", time.perf_counter() - t0
    seconds = time.perf_counter() - t0
    text = out.stdout + "\n" + out.stderr
    messages = [line for line in text.splitlines() if line.startswith("==") and "PROF==" not in line]
    if out.returncode != 0:
        tail = "\n".join((messages or text.strip().splitlines())[-6:])
        return None, f"ncu exited with status {out.returncode}:\n{tail}", seconds
    try:
        launches = parse_ncu_csv(out.stdout)
    except ValueError as e:
        tail = "\n".join((messages or text.strip().splitlines())[-6:])
        return None, f"{e}\n{tail}", seconds
    if len(launches) != 1:
        return None, (f"ncu profiled {len(launches)} launches matching {KERNEL_REGEX!r}; "
                      f"expected 1"), seconds
    return launches, None, seconds


def _model_fields(shape, Br, Bc, itemsize, acc):
    """The entry fields that come from the model, not from ncu."""
    import numpy as np
    from numbaflash.kernels.forward import v2_flash2

    B, H, N, d = shape
    read, write = model_bytes(B, H, N, d, Br, itemsize, np.dtype(acc).itemsize)
    return {"shared_bytes": v2_flash2.forward_shared_bytes(Br, Bc, d, acc),
            "sram_elements": sram_elements(Br, Bc, d), "model_read": read, "model_write": write,
            "theorem2": theorem2_accesses(B, H, N, d, sram_elements(Br, Bc, d))}


def measure(shape, dtype="float32", pairs=None, ncu=None, timeout=300, log=print):
    """Profile one v2 forward launch per tile pair; returns a JSON-ready dict.

    Each entry of ``result["pairs"]`` holds Br, Bc, shared memory, the model's bytes and
    the measured ones (None, with ``error`` saying why, where nothing was measured).
    ``result["error"]`` is set when ncu could not be run at all.
    """
    import numpy as np

    itemsize = np.dtype(dtype).itemsize
    acc = "float64" if dtype == "float64" else "float32"
    pairs = tile_pairs(shape[3], dtype) if pairs is None else pairs
    path = find_ncu(ncu)
    result = {"shape": list(shape), "dtype": dtype, "kernel_regex": KERNEL_REGEX,
              "ncu": path, "ncu_version": ncu_version(path) if path else None,
              "metrics": None, "error": None, "pairs": []}
    if path is None:
        where = ncu or "not in $NCU, on PATH, in /usr/local/cuda*/bin or /opt/nvidia/nsight-compute"
        result["error"] = f"Nsight Compute (ncu) was not found ({where}): nothing was measured"
    # ncu may reject the L2 metric or --print-units on some versions: the first pair
    # tries the full set, then the DRAM metrics alone; later pairs keep what worked.
    attempts = [(DRAM_METRICS + (L2_METRIC,), True), (DRAM_METRICS, True), (DRAM_METRICS, False)]
    for Br, Bc in pairs:
        entry = {"Br": Br, "Bc": Bc, **_model_fields(shape, Br, Bc, itemsize, acc),
                 "dram_read": None, "dram_write": None, "l2_read": None,
                 "kernel": None, "seconds": None, "error": result["error"]}
        result["pairs"].append(entry)
        if path is None:
            continue
        errors = []
        for metrics, base_units in list(attempts):
            cmd = ncu_command(path, metrics, shape, dtype, (Br, Bc), base_units)
            launches, error, seconds = run_ncu(cmd, timeout)
            if error is None:
                attempts = [(metrics, base_units)]     # keep what worked for the next pairs
                break
            errors.append(error)
            if "did not finish" in error:
                break                                  # a retry would not be faster
        entry["seconds"] = round(seconds, 1)
        if error is not None:
            entry["error"] = "\n".join(errors)
            log(f"({Br}, {Bc}): not measured: {entry['error']}")
            if "did not finish" in entry["error"]:
                # Pairs come in decreasing Br by default: the next ones would take longer.
                for Br2, Bc2 in pairs[len(result["pairs"]):]:
                    result["pairs"].append(dict(entry, Br=Br2, Bc=Bc2, seconds=None,
                                                error=f"not tried: ({Br}, {Bc}) timed out"))
                    result["pairs"][-1].update(_model_fields(shape, Br2, Bc2, itemsize, acc))
                break
            if not any(e["dram_read"] is not None for e in result["pairs"]):
                # The first pair failed every way: ncu itself does not work here
                # (no counter permission, no kernel matched); the others would fail too.
                result["error"] = (f"ncu failed on the first tile pair ({Br}, {Bc}), so the "
                                   f"others were not tried: {entry['error']}")
                break
            continue
        m = launches[0]["metrics"]
        result["metrics"] = list(metrics)
        result["command"] = " ".join(cmd)
        entry.update(kernel=launches[0]["kernel"], block=launches[0]["block"],
                     grid=launches[0]["grid"], dram_read=m.get(DRAM_METRICS[0]),
                     dram_write=m.get(DRAM_METRICS[1]), error=None)
        if L2_METRIC in m:
            entry["l2_read"] = m[L2_METRIC] * SECTOR_BYTES
        log(format_entry(entry))
    return result


def _gb(x):
    return "n/a" if x is None else f"{x / 1e9:9.3f}"


def format_entry(e):
    return (f"({e['Br']:3d}, {e['Bc']:3d}) shared {e['shared_bytes']:6d} B  DRAM read "
            f"{_gb(e['dram_read'])} GB  write {_gb(e['dram_write'])} GB  L2->SM read "
            f"{_gb(e['l2_read'])} GB  | model read {_gb(e['model_read'])} GB  write "
            f"{_gb(e['model_write'])} GB  [{e['seconds']} s]")


# ---------------------------------------------------------------------------------------
# The profiled child


def worker(shape, dtype, tiles):
    """One v2 forward on device arrays: the launch ncu profiles."""
    import numpy as np
    from numba import cuda

    import numbaflash
    if numbaflash.backend() != "gpu":
        sys.exit("hbm_traffic.py --worker needs a CUDA GPU (the simulator has no HBM)")
    rng = np.random.default_rng(0)
    q, k, v = (cuda.to_device(rng.standard_normal(shape, dtype=np.float32).astype(dtype))
               for _ in range(3))
    numbaflash.attention(q, k, v, version="v2", tiles=tiles)
    cuda.synchronize()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 2)[2])
    ap.add_argument("--shape", type=int, nargs=4, metavar=("B", "H", "N", "d"),
                    default=(1, 16, 16384, 64), help="(batch, heads, seqlen, head dim); "
                    "default 1 16 16384 64")
    ap.add_argument("--dtype", default="float32", choices=("float16", "float32", "float64"))
    ap.add_argument("--tiles", help="tile pairs BrxBc, comma-separated (default: every "
                    "forward candidate that fits shared memory at this head dim)")
    ap.add_argument("--ncu", help="path of ncu (default: $NCU, ncu on PATH, /usr/local/cuda*/bin/ncu "
                    "or /opt/nvidia/nsight-compute/*/ncu)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per ncu run (default 300)")
    ap.add_argument("--json", help="write the result to this file")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    shape = tuple(args.shape)
    if args.worker:
        worker(shape, args.dtype, parse_tiles(args.tiles)[0])
        return 0
    pairs = parse_tiles(args.tiles) if args.tiles else None
    result = measure(shape, args.dtype, pairs, args.ncu, args.timeout)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    if result["error"]:
        print(result["error"])
        return 2
    missing = [e for e in result["pairs"] if e["error"]]
    if missing:
        print(f"{len(missing)} of {len(result['pairs'])} tile pairs were not measured")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
