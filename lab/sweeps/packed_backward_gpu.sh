#!/usr/bin/env bash
# Where the packed backward's time goes against the (B, H, S, d) backward on the same
# data (lab/sweeps/packed_backward_kernels.py), on one GPU, inside one 600 s call; records
# go to $OUT through lab/sweeps/logged.sh (TREE names the tree).
#
#   bash lab/sweeps/packed_backward_gpu.sh kernels   # each kernel timed, float32 d = 64
#                                                    # (causal and not), d = 128, float16
#                                                    # d = 64; the processes compile in
#                                                    # parallel and time under a lock
#   bash lab/sweeps/packed_backward_gpu.sh ncu       # Nsight Compute on the float32 d = 64
#                                                    # kernels of both layouts
#   bash lab/sweeps/packed_backward_gpu.sh both      # kernels, then ncu
#   bash lab/sweeps/packed_backward_gpu.sh trees DIR # kernels for the tree whose numbaflash/
#                                                    # is in DIR and for this one (names
#                                                    # ending _before, _after), then ncu
#                                                    # on this one
set -u
cd "$(dirname "$0")/../.."
L="bash lab/sweeps/logged.sh"
K="python3 lab/sweeps/packed_backward_kernels.py"
kernels() {     # [suffix]: names end with it
    local x=${1:-}
    $L packed_bwd_f32_d64$x 300 $K --dtype float32 --dim 64 &
    $L packed_bwd_f32_d64_causal$x 300 $K --dtype float32 --dim 64 --causal &
    $L packed_bwd_f32_d128$x 300 $K --dtype float32 --dim 128 &
    $L packed_bwd_f16_d64$x 300 $K --dtype float16 --dim 64 &
}
profile() {
    $L packed_bwd_ncu_f32_d64 400 ncu --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section Occupancy --section LaunchStats --section WarpStateStats \
        --section SchedulerStats --section ComputeWorkloadAnalysis \
        -k "regex:backward_(preprocess|dkdv|dq)" --launch-skip 6 --launch-count 6 \
        $K --once --dtype float32 --dim 64
}
case "${1:-both}" in
kernels) kernels; wait ;;
ncu) profile ;;
both) kernels; wait; profile ;;
trees)
    before=$(cd "$2" && pwd)
    (PYTHONPATH="$before:${PYTHONPATH:-}"; export PYTHONPATH; kernels _before; wait) &
    kernels _after
    wait
    profile
    ;;
esac
