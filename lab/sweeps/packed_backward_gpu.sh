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
#   bash lab/sweeps/packed_backward_gpu.sh final DIR # one call: the packed and plain tests,
#                                                    # memcheck, then (timed one at a time
#                                                    # under one lock) the float32 kernels
#                                                    # of DIR's tree and this one, and
#                                                    # flash_attn_func's two ways with
#                                                    # gradients; then the float32 packed
#                                                    # batch against the padded one
#   bash lab/sweeps/packed_backward_gpu.sh layout    # flash_attn_func's two ways with
#                                                    # gradients (float32 d = 64 causal and
#                                                    # not, d = 128, float16 d = 64) and the
#                                                    # float32 d = 64 kernels, timed one at a
#                                                    # time under one lock
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
layout)
    LOCK=/tmp/packed_backward_kernels.lock
    W="python3 lab/sweeps/flash_layout_ways.py --lock $LOCK"
    $L packed_bwd_f32_d64 250 $K --dtype float32 --dim 64 &
    $L packed_bwd_f32_d64_causal 250 $K --dtype float32 --dim 64 --causal &
    $L layout_f32_d64_grad 250 $W --dtype float32 --dim 64 --grad &
    $L layout_f32_d64_causal_grad 250 $W --dtype float32 --dim 64 --causal --grad &
    $L layout_f32_d128_grad 250 $W --dtype float32 --dim 128 --grad &
    $L layout_f16_d64_grad 250 $W --dtype float16 --dim 64 --grad &
    wait
    ;;
final)
    before=$(cd "$2" && pwd)
    LOCK=/tmp/packed_backward_kernels.lock
    W="python3 lab/sweeps/flash_layout_ways.py --lock $LOCK"
    SAN="compute-sanitizer --error-exitcode 1 --tool"
    exec 9>$LOCK
    flock 9
    # the timing processes compile now and wait for the lock this shell holds
    (PYTHONPATH="$before:${PYTHONPATH:-}"; export PYTHONPATH
     $L packed_bwd_f32_d64_before 500 $K --dtype float32 --dim 64 &
     $L packed_bwd_f32_d64_causal_before 500 $K --dtype float32 --dim 64 --causal &
     wait) 9>&- &
    $L packed_bwd_f32_d64_after 500 $K --dtype float32 --dim 64 9>&- &
    $L packed_bwd_f32_d64_causal_after 500 $K --dtype float32 --dim 64 --causal 9>&- &
    $L packed_bwd_f32_d128_after 500 $K --dtype float32 --dim 128 9>&- &
    $L layout_f32_d64_grad 500 $W --dtype float32 --dim 64 --grad 9>&- &
    $L layout_f32_d64_causal_grad 500 $W --dtype float32 --dim 64 --causal --grad 9>&- &
    ( $L tests_varlen_v6 250 python3 -m pytest -q -n 4 -p no:cacheprovider \
          tests/test_varlen.py -k "v6 or v10 or v8 or packed_rows" 9>&- &
      $L tests_torch_in_place 250 python3 -m pytest -q -n 2 -p no:cacheprovider \
          tests/test_torch.py -k "in_place" 9>&- &
      $L memcheck_varlen_bwd_v6_float32 250 $SAN memcheck python3 scripts/sanitize_target.py \
          --varlen --backward v6 --dtype float32 9>&- &
      $L memcheck_bwd_v6 250 $SAN memcheck python3 scripts/sanitize_target.py \
          --backward v6 9>&- &
      wait ) 9>&-
    flock -u 9
    exec 9>&-
    wait
    $L varlen_speed_f32 130 python3 scripts/varlen_gpu.py --parts speed --dtypes float32 \
        --dims 64
    ;;
esac
