"""Presenting records: a text table, the environment they were measured in, JSON, and a
plot of TFLOP/s against sequence length.
"""

import datetime
import importlib.metadata
import json
import math
import platform

import numpy as np
from numba import cuda

from .cases import SDPA_IMPLS
from .library import backend, version
from .timing import SIMULATOR_WARNING


def _status(r):
    if r["ok"] is False:
        return "WRONG RESULT, not timed"
    if r["note"] and r["ms"] is None:
        return "not run"
    if r["ok"] is None:
        return "baseline" if r["impl"] in SDPA_IMPLS else "not checked"
    return "ok"


def _number(x):
    """2 decimals for GPU-sized numbers, scientific for the simulator's tiny ones."""
    return f"{x:.2f}" if x >= 0.01 else f"{x:.1e}"


def aligned_rows(head, rows, numeric):
    """The lines of a text table: ``head``, a rule, ``rows``; the columns whose index is in
    ``numeric`` right-aligned, the others left-aligned."""
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]

    def line(cells):
        return "  ".join(str(c).rjust(w) if i in numeric else str(c).ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    return [line(head), line("-" * w for w in widths)] + [line(row) for row in rows]


def format_table(records):
    """The records as a text table, one line each; notes (why something did not run)
    are numbered under it."""
    head = ("shape (B,H,Sq,Sk,d)", "causal", "dtype", "pass", "impl", "ms", "TFLOP/s",
            "vs SDPA", "extra MiB", "max err", "bound", "status", "kernel")
    rows, notes = [], []
    for r in records:
        status = _status(r)
        if r["note"] and r["ms"] is None:
            if r["note"] not in notes:           # the same reason is listed once
                notes.append(r["note"])
            status += f" [{notes.index(r['note']) + 1}]"
        rows.append((
            f"({r['B']},{r['H']},{r['Sq']},{r['Sk']},{r['d']})",
            "yes" if r["causal"] else "no", r["dtype"], r["what"], r["impl"],
            "-" if r["ms"] is None else f"{r['ms']:.3f}",
            "-" if r["tflops"] is None else _number(r["tflops"]),
            "-" if r["vs_sdpa"] is None else f"{r['vs_sdpa']:.3f}x",
            "-" if r["extra_mib"] is None else f"{r['extra_mib']:.1f}",
            "-" if r["max_err"] is None else f"{r['max_err']:.2e}",
            "-" if r["bound"] is None else f"{r['bound']:.2e}",
            status, r["kernel"] or "-"))
    out = aligned_rows(head, rows, numeric={5, 6, 7, 8, 9, 10})
    out += [f"[{i}] {n}" for i, n in enumerate(notes, 1)]
    if any(r["timer"] and r["timer"].startswith("simulator") for r in records):
        out.append(f"NOTE: {SIMULATOR_WARNING}.")
    out.append("vs SDPA = SDPA EFFICIENT time / this time (>1 means faster than SDPA); "
               "TFLOP/s: forward 4*B*H*Sq*Sk*d, causal half, backward 2.5x, fwd+bwd 3.5x.")
    return "\n".join(out)


def _version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment():
    """What the numbers were measured on: date, backend, GPU, and package versions."""
    try:
        where = backend()
    except RuntimeError:
        where = "none"
    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "backend": where, "gpu": None, "driver_cuda": None,
           "python": platform.python_version(), "numba": _version("numba"),
           "numba_cuda": _version("numba-cuda"), "numpy": np.__version__,
           "torch": _version("torch"), "numbaflash": version()}
    if where == "simulator":
        env["gpu"] = "none (CUDA simulator, NUMBA_ENABLE_CUDASIM=1)"
    elif where == "gpu":
        name = cuda.get_current_device().name
        env["gpu"] = name.decode() if isinstance(name, bytes) else str(name)
        try:
            env["driver_cuda"] = ".".join(map(str, cuda.cudadrv.driver.driver.get_version()))
        except Exception:                      # noqa: BLE001 - informative only
            pass
    return env


def _json_safe(x):
    """NaN and inf are not JSON: write them as the strings "nan", "inf", "-inf"."""
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    if isinstance(x, (float, np.floating)):
        return float(x) if math.isfinite(x) else str(float(x))
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.bool_):
        return bool(x)
    return x


def save_json(records, path, meta=None):
    """Write ``{"meta": environment(), "records": records}`` to ``path`` as JSON."""
    data = {"meta": environment() if meta is None else meta, "records": records}
    with open(path, "w") as f:
        json.dump(_json_safe(data), f, indent=1)
        f.write("\n")


def plot(records, path=None):
    """TFLOP/s against sequence length (Sk), one line per implementation and pass.

    One panel per (head dim, causal, dtype); records without a time are left out.
    Writes the figure to ``path`` (any format matplotlib knows by the suffix) when
    given, and returns the matplotlib Figure (it displays itself in a notebook).
    Imports matplotlib only here.
    """
    from matplotlib.figure import Figure      # no pyplot: no global state, no display needed

    timed = [r for r in records if r["tflops"] is not None]
    panels = sorted({(r["d"], r["causal"], r["dtype"]) for r in timed})
    fig = Figure(figsize=(6.5 * max(1, len(panels)), 4.5), layout="constrained")
    axes = fig.subplots(1, max(1, len(panels)), squeeze=False)[0]
    styles = {"forward": "-", "backward": "--", "fwd+bwd": ":"}      # line style: the pass
    impls = sorted({r["impl"] for r in timed})                        # colour: the impl
    for ax, (d, causal, dtype) in zip(axes, panels):
        lines = sorted({(r["impl"], r["what"]) for r in timed
                        if (r["d"], r["causal"], r["dtype"]) == (d, causal, dtype)})
        for impl, what in lines:
            pts = sorted((r["Sk"], r["tflops"]) for r in timed
                         if (r["d"], r["causal"], r["dtype"], r["impl"], r["what"])
                         == (d, causal, dtype, impl, what))
            ax.plot([p[0] for p in pts], [p[1] for p in pts], styles[what], marker="o",
                    color=f"C{impls.index(impl) % 10}", label=f"{impl} {what}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length (Sk)")
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"d={d}, {'causal' if causal else 'non-causal'}, {dtype}")
        ax.legend(fontsize="small")
        ax.grid(True, alpha=0.3)
    if not panels:
        axes[0].text(0.5, 0.5, "no timed records", ha="center", va="center")
    if any(r["timer"] and r["timer"].startswith("simulator") for r in timed):
        fig.suptitle("CUDA simulator: these times measure Python, not a GPU")
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig
