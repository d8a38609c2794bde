#!/usr/bin/env bash
# Forward v8 and v9, backward v6 and v9 reading packed batches as they are (kernels/sequences.py's
# packed rows, as forward v10 does), numbaflash.torch.flash_attn_func reading float32
# tensors in place through them, and the small call's parts. One GPU, each call inside
# 600 s; records go to $OUT through lab/sweeps/logged.sh (TREE names the tree).
#
#   bash lab/sweeps/packed_rows_f32_gpu.sh time    # the layout's ways, forward (in
#                                                  # parallel, each process compiling on
#                                                  # its own and timing under a lock), then
#                                                  # alone the small call's parts
#   bash lab/sweeps/packed_rows_f32_gpu.sh time2   # alone: the small call's host steps
#                                                  # and parts; then the layout's ways with
#                                                  # gradients and at d = 128 causal (under
#                                                  # the lock); then the float32 packed
#                                                  # batch against the padded one
#   bash lab/sweeps/packed_rows_f32_gpu.sh one     # the checks and timings that matter most,
#                                                  # in one call (the script says how)
#   bash lab/sweeps/packed_rows_f32_gpu.sh short   # fewer of them, in a shorter call
#   bash lab/sweeps/packed_rows_f32_gpu.sh check   # in parallel: the packed tests (bitwise
#                                                  # against attention() per sequence, NaN
#                                                  # and inf inputs, dropout), the torch
#                                                  # layer's in-place and direct-launch
#                                                  # tests, memcheck on the packed forward
#                                                  # v8 / v9 and backward v6
set -u
cd "$(dirname "$0")/../.."
L="bash lab/sweeps/logged.sh"
SAN="compute-sanitizer --error-exitcode 1 --tool"
W="python3 lab/sweeps/flash_layout_ways.py"
case "${1:-time}" in
time)
    $L layout_f32_d64 300 $W --dtype float32 --dim 64 &
    $L layout_f32_d64_causal 300 $W --dtype float32 --dim 64 --causal &
    $L layout_f32_d128 300 $W --dtype float32 --dim 128 &
    $L layout_f32_d64_grad 300 $W --dtype float32 --dim 64 --grad &
    $L layout_f32_d64_causal_grad 300 $W --dtype float32 --dim 64 --causal --grad &
    $L layout_f32_d128_grad 300 $W --dtype float32 --dim 128 --grad &
    $L layout_f16_d64_grad 300 $W --dtype float16 --dim 64 --grad &
    wait
    $L small_call_parts 200 python3 lab/sweeps/small_call_parts.py --calls 1000 --tiles
    ;;
time2)
    $L small_call_breakdown 60 python3 lab/sweeps/small_call_parts.py --breakdown
    $L small_call_parts 100 python3 lab/sweeps/small_call_parts.py --calls 1000
    $L layout_f32_d128_causal 200 $W --dtype float32 --dim 128 --causal &
    $L layout_f32_d64_grad 200 $W --dtype float32 --dim 64 --grad &
    $L layout_f32_d64_causal_grad 200 $W --dtype float32 --dim 64 --causal --grad &
    $L layout_f32_d128_grad 200 $W --dtype float32 --dim 128 --grad &
    $L layout_f32_d128_causal_grad 200 $W --dtype float32 --dim 128 --causal --grad &
    $L layout_f16_d64_grad 200 $W --dtype float16 --dim 64 --grad &
    $L layout_f16_d64_causal_grad 200 $W --dtype float16 --dim 64 --causal --grad &
    wait
    $L varlen_speed_f32 200 python3 scripts/varlen_gpu.py --parts speed --dtypes float32 \
        --dims 64
    ;;
check)
    $L tests_torch_in_place 500 python3 -m pytest -q -n 4 -p no:cacheprovider \
        tests/test_torch.py -k "in_place or repeated_cuda_calls or flash_attn" &
    $L tests_varlen_packed_rows 500 python3 -m pytest -q -n 6 -p no:cacheprovider \
        tests/test_varlen.py -k "v6 or v8 or v9 or v10 or packed_rows or explain" &
    $L memcheck_varlen_v8_float32 400 $SAN memcheck python3 scripts/sanitize_target.py \
        --varlen --forward v8 --dtype float32 &
    $L memcheck_varlen_v9_float32 400 $SAN memcheck python3 scripts/sanitize_target.py \
        --varlen --forward v9 --dtype float32 &
    $L memcheck_varlen_bwd_v6_float32 400 $SAN memcheck python3 scripts/sanitize_target.py \
        --varlen --backward v6 --dtype float32 &
    $L memcheck_varlen_bwd_v9_float16 400 $SAN memcheck python3 scripts/sanitize_target.py \
        --varlen --forward v10 --backward v9 --dtype float16 &
    wait
    ;;
one)
    # everything in one call: the checks first, while the layout's processes compile and
    # wait for the lock this shell holds; then their timings, one at a time; then alone
    # the small call and the float32 packed batch
    exec 9>/tmp/flash_layout_ways.lock
    flock 9
    for way in "f32_d64_grad --dtype float32 --dim 64 --grad" \
               "f32_d64_causal_grad --dtype float32 --dim 64 --causal --grad" \
               "f32_d128_grad --dtype float32 --dim 128 --grad" \
               "f32_d128_causal --dtype float32 --dim 128 --causal" \
               "f16_d64_grad --dtype float16 --dim 64 --grad"; do
        set -- $way
        name=$1; shift
        $L layout_$name 330 $W "$@" 9>&- &
    done
    set --
    ( $L tests_torch_in_place 200 python3 -m pytest -q -n 6 -p no:cacheprovider \
          tests/test_torch.py -k "in_place or repeated_cuda_calls" 9>&- &
      $L memcheck_varlen_bwd_v6_float32 200 $SAN memcheck python3 scripts/sanitize_target.py \
          --varlen --backward v6 --dtype float32 9>&- &
      $L memcheck_varlen_v10_v9_float16 200 $SAN memcheck python3 \
          scripts/sanitize_target.py --varlen --forward v10 --backward v9 --dtype float16 9>&- &
      wait ) 9>&-
    flock -u 9
    exec 9>&-
    wait
    $L small_call_parts 60 python3 lab/sweeps/small_call_parts.py --calls 1000
    $L varlen_speed_f32 130 python3 scripts/varlen_gpu.py --parts speed --dtypes float32 \
        --dims 64
    ;;
short)
    # the least that decides the defaults, in a short call: the in-place torch tests
    # while the layout's processes compile and wait for this shell's lock; their
    # timings; the small call; the float32 packed batch
    exec 9>/tmp/flash_layout_ways.lock
    flock 9
    for way in "f32_d64_grad --dtype float32 --dim 64 --grad" \
               "f32_d64_causal_grad --dtype float32 --dim 64 --causal --grad" \
               "f16_d64_grad --dtype float16 --dim 64 --grad"; do
        set -- $way
        name=$1; shift
        $L layout_$name 250 $W "$@" 9>&- &
    done
    set --
    $L tests_torch_in_place 150 python3 -m pytest -q -n 4 -p no:cacheprovider \
        tests/test_torch.py -k "in_place" 9>&-
    flock -u 9
    exec 9>&-
    wait
    $L small_call_parts 40 python3 lab/sweeps/small_call_parts.py --calls 1000
    $L varlen_speed_f32 130 python3 scripts/varlen_gpu.py --parts speed --dtypes float32 \
        --dims 64
    ;;
*)
    echo "usage: $0 [time|time2|check|one|short]" >&2
    exit 2
    ;;
esac
