#!/usr/bin/env bash
# The tensor-core decode kernel (kernels/decode/split_kv_mma.py) on one GPU, in one call
# that ends inside 600 s. Records go to $OUT through lab/sweeps/logged.sh (TREE names the
# tree). Correctness first, in parallel (no timing): scripts/decode_gpu.py's agreement
# (float16, bfloat16 and float32 cases), tests/test_decode_mma.py and the non-Hypothesis
# tests of tests/test_kvcache.py, memcheck and racecheck on scripts/sanitize_target.py
# --kvcache; then, alone, the timings: each decode kernel against the other (the
# "decoders" part: split_kv_mma testing edge tiles or every tile for NaN and inf, and
# split_kv), the default against SDPA and the HBM copy (float16, bfloat16), the split
# counts of the default, and Nsight Compute on split_kv_mma at batch 8 without GQA.
#
#   bash lab/sweeps/decode_mma_gpu.sh
set -u
cd "$(dirname "$0")/../.."
L="bash lab/sweeps/logged.sh"
SAN="compute-sanitizer --error-exitcode 1 --tool"
$L decode_agreement 150 python3 scripts/decode_gpu.py --parts agreement &
NUMBAFLASH_PROFILE=gpu-quick $L tests_decode_mma 150 python3 -m pytest -q -n 0 \
    -p no:cacheprovider tests/test_decode_mma.py tests/test_kvcache.py \
    -k "mma or nan or explain or device or bfloat16 or errors or empty" &
( $L memcheck_kvcache 70 $SAN memcheck python3 scripts/sanitize_target.py --kvcache
  $L racecheck_kvcache 70 $SAN racecheck python3 scripts/sanitize_target.py --kvcache ) &
wait
$L decode_decoders 100 python3 scripts/decode_gpu.py --parts decoders --dtypes float16 \
    --shapes b8-mha,b8-gqa,b1-mha,b1-gqa,b8-mha-d64,b8-gqa-d64
$L decode_bandwidth 120 python3 scripts/decode_gpu.py --parts bandwidth \
    --dtypes float16,bfloat16
$L decode_splits 70 python3 scripts/decode_gpu.py --parts splits --dtypes float16
$L ncu_split_kv_mma 80 ncu --kernel-name regex:split_kv_mma --launch-skip 3 --launch-count 1 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
    --section WarpStateStats --section SchedulerStats --section LaunchStats \
    python3 scripts/decode_gpu.py --parts bandwidth --shapes b8-mha --dtypes float16 --repeats 3
