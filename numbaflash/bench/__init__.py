"""Benchmark numbaflash against PyTorch SDPA: check first, then time, count, and compare.

    python -m numbaflash bench                    # docs/performance.md's three shapes
    python -m numbaflash bench --shapes 2x16x4096x64 --causal yes --versions v2,v3 \\
        --json bench.json --plot bench.png
    python -m numbaflash bench --variants         # the attention variants' speed targets
    python -m numbaflash bench --inference        # decoding and packed batches, their targets
    python -m numbaflash bench --energy           # joules per call beside SDPA's (NVML)

From Python: ``records = bench.run([(2, 16, 4096, 64)])``, then ``bench.format_table``,
``bench.save_json`` or ``bench.plot``. A result that disagrees with a float64 reference
is never timed (``bench.wrong_results`` lists them). The variants: ``records =
bench.run_variants()``, then ``bench.format_variant_table``. Decoding against a KV cache
and packed batches: ``records = bench.run_inference()``, then
``bench.format_inference_table``.

The modules, in the order a run uses them:

    cases.py      shapes, passes, dtypes, the record of one case; run's argument checks
    timing.py     flops (the FLOP convention), time_ms (CUDA events), time_ms_queued,
                  extra_memory_bytes
    agreement.py  the error bound of a correct result; the NumPy float64 reference
    pytorch.py    the PyTorch side: SDPA's masks, the SDPA MATH reference, SDPA's timing
    runner.py     run: inputs, check, time, count, compare (its docstring says how)
    report.py     format_table, environment, save_json, plot
    variants.py   run_variants: the variant cases (GQA, softcap, ALiBi, a window, a
                  document mask) checked, then timed against their baselines and targets;
                  format_variant_table
    inference.py  run_inference: decoding against a KV cache (against SDPA and the HBM
                  copy bandwidth) and packed batches (against the same batch padded),
                  checked, then timed, with their targets; format_inference_table.
                  Its parts: decode_cases.py and packed_cases.py, and what they share,
                  inference_checks.py
    energy.py     joules per call from the GPU's energy counter (NVML, the energy extra)
    command.py    the command line (add_arguments, cli)
    library.py    what the bench takes from the rest of numbaflash, imported in one place

Under the CUDA simulator (NUMBA_ENABLE_CUDASIM=1) everything runs, checks included, but
the times measure Python executing the simulated threads, not a GPU.
"""

from .agreement import (FLOAT32_FLOOR, FLOAT64_RTOL, MULT, NumpyOracle, _agreement,
                        _lse_agreement, agreement_bound)
from .cases import (DTYPES, GPU_DEFAULT_SHAPES, PASSES, SDPA_IMPLS, SIM_DEFAULT_SHAPES,
                    _check_arguments, check_host_memory, host_bytes_needed, normalize_shape,
                    parse_shape, sdpa_impls)
from .command import add_arguments, cli
# attention and attention_backward are looked up here by the runner at call time
# (runner._api), so that replacing bench.attention replaces what is checked and timed.
from .library import attention, attention_backward
from .pytorch import (TorchOracle, _tf32_off, _torch_cuda, sdpa_mask,
                      torch_extra_memory_bytes, torch_references)
from .report import _json_safe, environment, format_table, plot, save_json
from .runner import run, wrong_results
from .timing import (PASS_FLOP_FACTOR, SIMULATOR_WARNING, extra_memory_bytes, flops, time_ms,
                     time_ms_queued)
from .variants import (CASE_NAMES, VARIANT_CASES, format_variant_table, run_variants,
                       target_met, wrong_variants)
# attention_with_kvcache, attention_varlen and attention_varlen_backward likewise, by
# the inference cases (inference_checks._inference_api).
from .library import attention_varlen, attention_varlen_backward, attention_with_kvcache
from .inference import (DECODE_SHAPES, PACKED, format_inference_table, hbm_copy,
                        run_inference, wrong_inference)

__all__ = [
    # the benchmark and its presentation
    "run", "wrong_results", "format_table", "environment", "save_json", "plot",
    # the attention variants against their baselines and speed targets
    "run_variants", "format_variant_table", "wrong_variants", "target_met", "VARIANT_CASES",
    "CASE_NAMES",
    # decoding against a KV cache and packed batches, against their baselines and targets
    "run_inference", "format_inference_table", "wrong_inference", "hbm_copy",
    "DECODE_SHAPES", "PACKED",
    # counting and timing
    "flops", "time_ms", "time_ms_queued", "extra_memory_bytes", "PASS_FLOP_FACTOR",
    "SIMULATOR_WARNING",
    # agreement
    "agreement_bound", "NumpyOracle", "MULT", "FLOAT64_RTOL", "FLOAT32_FLOOR",
    # the PyTorch side
    "TorchOracle", "torch_references", "torch_extra_memory_bytes", "sdpa_mask",
    # cases and shapes
    "PASSES", "DTYPES", "SDPA_IMPLS", "sdpa_impls", "GPU_DEFAULT_SHAPES",
    "SIM_DEFAULT_SHAPES", "parse_shape", "normalize_shape", "host_bytes_needed", "check_host_memory",
    # the command line
    "add_arguments", "cli",
    # the public API as the bench calls it (replaceable here)
    "attention", "attention_backward", "attention_with_kvcache", "attention_varlen",
    "attention_varlen_backward",
]
