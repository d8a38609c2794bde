#!/usr/bin/env bash
# The float32 training target on one GPU (forward + backward against SDPA MATH and
# EFFICIENT, docs/performance.md), inside one 600 s call; records to $OUT through
# lab/sweeps/logged.sh (TREE names the tree).
#
#   bash lab/sweeps/train_f32_gpu.sh bench   # python -m numbaflash bench at the training
#       shapes, forward, backward and forward + backward, causal and not, against SDPA
#       (MATH with TF32 off, EFFICIENT), with the JSON records beside the table
#   bash lab/sweeps/train_f32_gpu.sh ncu     # Nsight Compute on the default float32
#       backward's kernels at (2, 16, 4096, 64) and (2, 16, 4096, 128): speed of light
#       and the roofline, occupancy, warp stalls, pipes, and shared memory's bank
#       conflicts (MemoryWorkloadAnalysis, its tables printed in full: --print-details),
#       one record per head dim
#   bash lab/sweeps/train_f32_gpu.sh both    # bench, then ncu
set -u
cd "$(dirname "$0")/../.."
L="bash lab/sweeps/logged.sh"
SECTIONS="--section SpeedOfLight --section SpeedOfLight_RooflineChart --section Occupancy \
--section LaunchStats --section WarpStateStats --section SchedulerStats \
--section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
--section MemoryWorkloadAnalysis_Tables --print-details all"

bench() {
    $L train_f32_bench 330 python3 -m numbaflash bench \
        --shapes 2x16x4096x64,2x16x4096x128,1x16x16384x64 --causal both \
        --passes forward,backward,fwd+bwd --repeats 5 --warmup 1 \
        --json "${OUT:-gpu-out}/train_f32_bench.json"
}

ncu_kernels() {
    for d in 64 128; do
        $L "train_f32_ncu_d$d" 120 ncu $SECTIONS -k "regex:backward_(dkdv|dq)" \
            --launch-skip 2 --launch-count 2 python3 scripts/profile_target.py --backward \
            --shape "2x16x4096x$d" --repeats 2
    done
}

case "${1:-}" in
bench) bench ;;
ncu) ncu_kernels ;;
both) bench; ncu_kernels ;;
*)
    echo "usage: bash lab/sweeps/train_f32_gpu.sh bench|ncu|both" >&2
    exit 2
    ;;
esac
