"""The inference half of FlashAttention in the bench: decoding against a KV cache, and
packed batches of different lengths, each checked, then timed against what a user would
run otherwise, with its target (``python -m numbaflash bench --inference``).

Two parts, each case in the order of variants.py: check, then time, then compare.

Decode (decode_cases.py): ``attention_with_kvcache`` on full caches of the
``DECODE_SHAPES``, against PyTorch SDPA and the HBM copy bandwidth. Packed
(packed_cases.py): ``attention_varlen`` and its backward on sequences of mixed lengths
(``PACKED``), against the same batch padded to the longest and run with a mask. Each
module's docstring says how its cases are checked, timed and compared, and its targets.

Under the CUDA simulator the shapes are tiny ones of the same structure (the "simulator"
entries), PyTorch does not run, and the times say nothing about speed; the checks still
mean what they say.
"""

import numpy as np

from .library import backend
from .pytorch import _torch_cuda
from .report import aligned_rows
from .runner import _Progress
from .timing import SIMULATOR_WARNING
from .variants import _cell
# The two parts and what they share, also reachable from here (tests and notebook 09 read
# them as inference.*; run_inference calls the cases through this module's names).
from .decode_cases import (DECODE_SHAPES, DECODE_TARGETS, HBM_COPY_BYTES,  # noqa: F401
                           _decode_case, _sdpa_decode, hbm_copy)
from .inference_checks import RECORD_KEYS, _checks, _references, _size  # noqa: F401
from .packed_cases import (LENGTH_SEED, PACKED, PACKED_PASSES, PACKED_TARGETS,  # noqa: F401
                           _PackedInputs, _packed_case, _padded_baseline,
                           _sdpa_padded_passes, padding_mask)

INFERENCE_PARTS = ("decode", "packed")
INFERENCE_DTYPES = ("float32", "float16")


# --- the run ---------------------------------------------------------------------------


def _check_inference_arguments(dtype, repeats, warmup, parts, size):
    """ValueError, before anything runs, for a bad argument of ``run_inference``; returns
    the parts to run."""
    if dtype not in INFERENCE_DTYPES:
        raise ValueError(f"dtype must be one of {INFERENCE_DTYPES} (the inference targets are "
                         f"about those); got {dtype!r}")
    for name, n, low in (("repeats", repeats, 1), ("warmup", warmup, 0)):
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < low:
            raise ValueError(f"{name} must be an integer >= {low}; got {n!r}")
    if size not in (None, "gpu", "simulator"):
        raise ValueError(f"size must be None, 'gpu' or 'simulator'; got {size!r}")
    if parts is None:
        return INFERENCE_PARTS
    if isinstance(parts, str):
        parts = (parts,)
    parts = tuple(parts)
    if not parts or any(p not in INFERENCE_PARTS for p in parts):
        raise ValueError(f"parts must be names among {INFERENCE_PARTS}; got {parts!r}")
    return parts


def run_inference(*, dtype="float32", repeats=20, warmup=3, sdpa=True, parts=None, size=None,
                  progress=True):
    """Check, then time, decoding against a KV cache and packed batches against their
    baselines; returns a list of records (decode_cases.py's and packed_cases.py's
    docstrings say how).

    Args:
        dtype: "float32" or "float16" (inputs; numbaflash computes in float32 either way).
        repeats, warmup: runs timed (median taken) and untimed runs before them.
        sdpa: also time PyTorch SDPA, where PyTorch with CUDA is there.
        parts: names from ``INFERENCE_PARTS`` ("decode", "packed"); default both.
        size: "gpu" (the targets' shapes) or "simulator" (tiny ones of the same
            structure); None: by the backend.
        progress: a line per record on stderr.

    Returns:
        One dict per (case, pass, baseline), decode first, with the keys of
        ``RECORD_KEYS``: part ("decode" | "packed"), case, options (as text), B, Hq, Hkv,
        Sq, N (decode: S_max; packed: B sequences padded to N), d, causal, dtype, what
        ("forward" | "fwd+bwd"), kernel, ms (numbaflash's median; None if not timed),
        baseline, baseline_ms, ratio (ms / baseline_ms), target (text, or None), met (True,
        False, or None: no target, no ratio, or not GPU times at the targets' shapes), ok
        (numbaflash's check: False for a wrong result, which is not timed), max_err and
        bound (the worst tensor's), check (per tensor), checked_against, timer, repeats,
        warmup, note, baseline_ok (the padded baseline's check; None for the others),
        baseline_note (why the baseline has no time), baseline_detail (how it was
        measured); decode: splits, kv_bytes (K and V bytes read per call), gbs and
        baseline_gbs (bandwidths, GB/s); packed: lengths, total, packed_bytes and
        padded_bytes (q, k, v, out of each layout), mask_bytes (the padded batch's mask).

    Raises:
        ValueError: a bad argument, before anything runs.
        RuntimeError: neither a GPU nor the simulator.
    """
    parts = _check_inference_arguments(dtype, repeats, warmup, parts, size)
    where = backend()                         # RuntimeError now if there is no backend
    size = size or ("simulator" if where == "simulator" else "gpu")
    torch = _torch_cuda()
    if torch is None:
        sdpa_note = "not run: no PyTorch with CUDA"
    elif not sdpa:
        sdpa_note = "not run: SDPA switched off (--no-sdpa)"
    else:
        sdpa_note = None
    # The targets are about GPU times at the targets' shapes: judged only there.
    judged = size == "gpu" and where == "gpu"
    packed = PACKED[size]
    steps = (("decode" in parts) * len(DECODE_SHAPES[size]) * 2
             + ("packed" in parts) * len(packed["dims"]) * 2 * len(PACKED_PASSES) * 2)
    bar = _Progress(steps, progress)

    copy = {}

    def hbm():
        """The HBM copy, measured at the first decode case that needs it."""
        if "gbs" not in copy:
            copy["ms"], copy["gbs"] = hbm_copy(HBM_COPY_BYTES[size], repeats, warmup)
        return copy["ms"], copy["gbs"]

    records = []
    if "decode" in parts:
        for seed, shape in enumerate(DECODE_SHAPES[size]):
            records += _decode_case(shape, dtype, seed, torch, sdpa_note, hbm, size, judged,
                                    repeats, warmup, bar)
            if torch is not None:
                torch.cuda.empty_cache()
    if "packed" in parts:
        low, high = packed["lengths"]
        lengths = np.random.default_rng(LENGTH_SEED).integers(low, high + 1,
                                                              packed["sequences"])
        for seed, d in enumerate(packed["dims"], start=1):
            data = _PackedInputs(torch, lengths, packed["heads"], d, dtype, seed)
            for causal in (False, True):
                records += _packed_case(data, causal, torch, sdpa_note, judged, repeats,
                                        warmup, bar)
            del data                          # this head dim's device memory
            if torch is not None:
                torch.cuda.empty_cache()
    return records


# --- the table -------------------------------------------------------------------------


def _status(r):
    if r["ok"] is False:
        return "WRONG RESULT, not timed"
    if r["baseline_ok"] is False:
        return "baseline WRONG, not timed"
    if r["note"]:
        return "not run"
    return "ok" if r["ok"] else "not checked"


def _err(x):
    return "-" if x is None else f"{x:.2e}"


def format_inference_table(records):
    """The inference records as text: a table for decoding, one for packed batches (each
    present when there are records of it), one line a record; why a baseline has no time,
    and how it was measured, numbered under them."""
    notes = []

    def numbered(note):
        if note is None:
            return ""
        if note not in notes:
            notes.append(note)
        return f" [{notes.index(note) + 1}]"

    def met(r):
        return {True: "yes", False: "NO", None: "-"}[r["met"]]

    def inverse(r):
        return None if r["ratio"] is None else 1 / r["ratio"]

    def inverse_queued(r):
        if r.get("ms_queued") is None or r.get("baseline_ms_queued") is None:
            return None
        return r["baseline_ms_queued"] / r["ms_queued"]
    out = []
    decode = [r for r in records if r["part"] == "decode"]
    if decode:
        head = ("case", "B,Hq,Hk,Sq,S_max,d", "dtype", "splits", "ms", "GB/s", "baseline",
                "baseline ms", "baseline GB/s", "1/ratio", "target", "met", "queued ms",
                "queued 1/ratio", "max err", "bound", "status")
        rows = [(r["case"], f"{r['B']},{r['Hq']},{r['Hkv']},{r['Sq']},{r['N']},{r['d']}",
                 r["dtype"], r["splits"], _cell(r["ms"]), _cell(r["gbs"], 1),
                 r["baseline"] + numbered(r["baseline_note"]) + numbered(r["baseline_detail"]),
                 _cell(r["baseline_ms"]), _cell(r["baseline_gbs"], 1), _cell(inverse(r)),
                 r["target"] or "-", met(r), _cell(r.get("ms_queued")),
                 _cell(inverse_queued(r)), _err(r["max_err"]), _err(r["bound"]), _status(r))
                for r in decode]
        out.append("Decoding against a KV cache (attention_with_kvcache; GB/s = K and V bytes "
                   "read / time; ms: each call timed alone, the target judged on it; "
                   "queued: calls back to back, as a decoding loop runs them)")
        out += aligned_rows(head, rows, numeric={3, 4, 5, 7, 8, 9, 12, 13, 14, 15})
    packed = [r for r in records if r["part"] == "packed"]
    if packed:
        if out:
            out.append("")
        head = ("case", "dtype", "pass", "ms", "baseline", "baseline ms", "1/ratio", "target",
                "met", "q,k,v,out packed", "padded", "max err", "bound", "status")
        rows = [(r["case"], r["dtype"], r["what"], _cell(r["ms"]),
                 r["baseline"] + numbered(r["baseline_note"]), _cell(r["baseline_ms"]),
                 _cell(inverse(r)), r["target"] or "-", met(r), _size(r["packed_bytes"]),
                 _size(r["padded_bytes"]), _err(r["max_err"]), _err(r["bound"]), _status(r))
                for r in packed]
        first = packed[0]
        out.append(f"Packed batches (attention_varlen and its backward): {first['B']} "
                   f"sequences of {min(first['lengths'])}..{max(first['lengths'])} tokens "
                   f"(total {first['total']}, padded to {first['N']}), {first['Hq']} heads; "
                   f"against the same batch padded, with a bool attn_mask")
        out += aligned_rows(head, rows, numeric={3, 5, 6, 9, 10, 11, 12})
    out += [f"[{i}] {n}" for i, n in enumerate(notes, 1)]
    if any(r["timer"] and r["timer"].startswith("simulator") for r in records):
        out.append(f"NOTE: {SIMULATOR_WARNING}.")
    if any(r["target"] and r["ratio"] is not None and r["met"] is None for r in records):
        out.append("met: '-' where not judged: the targets are about GPU times at the "
                   "targets' shapes.")
    out.append("ratio = numbaflash time / baseline time; 1/ratio: decoding, numbaflash's "
               "bandwidth over the baseline's; packed, how many times faster packed is. "
               "Checked: numbaflash (and the padded baseline), against numbaflash.reference "
               "in float64.")
    return "\n".join(out)


def wrong_inference(records):
    """The records whose numbaflash result, or padded baseline, disagreed with the
    reference (``ok`` or ``baseline_ok`` False)."""
    return [r for r in records if r["ok"] is False or r["baseline_ok"] is False]


__all__ = ["run_inference", "format_inference_table", "wrong_inference", "hbm_copy",
           "padding_mask",
           "DECODE_SHAPES", "PACKED", "HBM_COPY_BYTES", "DECODE_TARGETS", "PACKED_TARGETS",
           "INFERENCE_PARTS", "INFERENCE_DTYPES", "PACKED_PASSES", "RECORD_KEYS"]
