"""``bench --inference``'s decode part alone (its packed part takes minutes more), for the
dtypes given: the same checks, timings, targets and table as the command.

    python3 lab/sweeps/bench_decode_part.py float16 float32
"""
import sys

from numbaflash.bench.inference import format_inference_table, run_inference

for dtype in sys.argv[1:] or ["float16"]:
    records = run_inference(dtype=dtype, parts="decode")
    print(format_inference_table(records), flush=True)
