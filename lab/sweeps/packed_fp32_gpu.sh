#!/usr/bin/env bash
# The packed 16-bit kernels (forward v10, backward v9) and the float32 backward rungs (v6,
# v10) on one GPU, in two calls that each end inside 600 s. Records go to $OUT through
# lab/sweeps/logged.sh (TREE names the tree).
#
#   bash lab/sweeps/packed_fp32_gpu.sh check   # correctness, in parallel (no timing): packed
#                                              # agreement and bits, memcheck on the packed
#                                              # v10 / v9, backward v10's tests, its ragged
#                                              # agreement and 50 reruns; then (timed) the
#                                              # float16 packed batch against the padded one,
#                                              # backward v6 against v10 in float32
#   bash lab/sweeps/packed_fp32_gpu.sh time    # the same causal, the packed batch at d = 128
#                                              # (v10 against v7), flash-attn's layout copied
#                                              # and in place, memcheck on backward v10
set -u
cd "$(dirname "$0")/../.."
L="bash lab/sweeps/logged.sh"
SAN="compute-sanitizer --error-exitcode 1 --tool"
case "${1:-}" in
check)
    $L varlen_agreement 240 python3 scripts/varlen_gpu.py --parts agreement,bitwise &
    ( for dt in float16 bfloat16; do
          $L "memcheck_varlen_v10_v9_$dt" 110 $SAN memcheck python3 scripts/sanitize_target.py \
              --varlen --forward v10 --backward v9 --dtype "$dt"
      done ) &
    NUMBAFLASH_PROFILE=gpu-quick $L tests_backward_v10 240 python3 -m pytest -q -n 0 \
        -p no:cacheprovider tests/test_backward_v10.py tests/test_backward_kernels.py -k v10 &
    $L half_f32_v6_v10 240 python3 scripts/half_gpu.py --parts agreement,reruns \
        --dtypes float32 --backward-versions v6,v10 &
    wait
    $L varlen_speed_d64_float16 170 python3 scripts/varlen_gpu.py --parts speed \
        --dtypes float16 --dims 64
    for version in v6 v10; do
        $L "backward_time_f32_${version}" 75 python3 lab/sweeps/backward_time.py \
            --dtype float32 --dims 64,128 --version "$version"
    done
    ;;
time)
    for version in v6 v10; do
        $L "backward_time_f32_${version}_causal" 70 python3 lab/sweeps/backward_time.py \
            --dtype float32 --dims 64,128 --version "$version" --causal
    done
    $L varlen_speed_d128 90 python3 scripts/varlen_gpu.py --parts speed --dtypes float16 \
        --dims 128
    $L varlen_speed_d128_v7 90 python3 scripts/varlen_gpu.py --parts speed --dtypes float16 \
        --dims 128 --forward-version v7
    $L torch_layout 60 python3 scripts/torch_gpu.py --parts layout
    $L memcheck_backward_v10_float32 90 $SAN memcheck python3 scripts/sanitize_target.py \
        --backward v10 --dtype float32
    ;;
*)
    echo "usage: $0 check|time" >&2
    exit 2
    ;;
esac
