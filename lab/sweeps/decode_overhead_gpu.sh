#!/usr/bin/env bash
# Where a decode call's time goes, on one GPU, in one call inside 600 s (records to $OUT
# through lab/sweeps/logged.sh; TREE names the tree): scripts/decode_gpu.py's overhead part
# (each kernel's call timed alone, the host's time per call, the calls queued back to
# back) at the four decode shapes in float16, alone; the same under Nsight Compute with
# the kernels' durations; cProfile of the host's side of 50 calls.
#
#   bash lab/sweeps/decode_overhead_gpu.sh
set -u
cd "$(dirname "$0")/../.."
L="bash lab/sweeps/logged.sh"
$L decode_overhead 120 python3 scripts/decode_gpu.py --parts overhead --dtypes float16
$L decode_call_profile 60 python3 lab/sweeps/decode_call_profile.py
$L ncu_decode_durations 200 ncu --metrics gpu__time_duration.sum \
    --kernel-name regex:"split_kv|combine" python3 scripts/decode_gpu.py --parts overhead \
    --dtypes float16 --repeats 2
