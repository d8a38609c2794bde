#!/usr/bin/env bash
# Forward v10's packed build reading the packed arrays as they are (kernels/sequences.py's
# make_packed_rows) and numbaflash.torch.flash_attn_func reading its layout in place
# through it, on one GPU, each call ending inside 600 s. Records go to $OUT through
# lab/sweeps/logged.sh (TREE names the tree).
#
#   bash lab/sweeps/packed_rows_gpu.sh          # the first look (run 129): in parallel the
#                                               # packed agreement with float64, v10's packed
#                                               # rows the bits of attention() per sequence,
#                                               # the torch layer's flash_attn_func tests,
#                                               # memcheck on the packed v10 / v9; then alone
#                                               # flash-attn's layout in place against (b, h,
#                                               # s, d), and the float16 packed batch against
#                                               # the padded one at d = 64
#   bash lab/sweeps/packed_rows_gpu.sh check    # what the first look cut: the agreement and
#                                               # bitwise parts in full, the torch tests of
#                                               # the in-place path and of the direct launches
#                                               # (v10's plain build among them)
#   bash lab/sweeps/packed_rows_gpu.sh time     # the layout (both ways, causal too) and the
#                                               # packed 16-bit batches at d = 64 and 128
set -u
cd "$(dirname "$0")/../.."
L="bash lab/sweeps/logged.sh"
SAN="compute-sanitizer --error-exitcode 1 --tool"
case "${1:-first}" in
first)
    $L varlen_agreement 240 python3 scripts/varlen_gpu.py --parts agreement &
    ( $L varlen_bitwise_v10 120 python3 scripts/varlen_gpu.py --parts bitwise \
          --bitwise-forward v10
      $L tests_torch_flash 120 python3 -m pytest -q -n 0 -p no:cacheprovider \
          tests/test_torch.py -k "in_place or flash_attn_func or repeated_cuda or side_stream" ) &
    $L memcheck_varlen_v10_v9_float16 150 $SAN memcheck python3 scripts/sanitize_target.py \
        --varlen --forward v10 --backward v9 --dtype float16 &
    wait
    $L torch_layout 60 python3 scripts/torch_gpu.py --parts layout
    $L varlen_speed_d64_float16 170 python3 scripts/varlen_gpu.py --parts speed \
        --dtypes float16 --dims 64
    ;;
check)
    $L varlen_agreement 540 python3 scripts/varlen_gpu.py --parts agreement &
    $L varlen_bitwise_v10 400 python3 scripts/varlen_gpu.py --parts bitwise \
        --bitwise-forward v10 &
    $L tests_torch_gpu 540 python3 -m pytest -q -n 4 -p no:cacheprovider tests/test_torch.py \
        -k "in_place or repeated_cuda_calls or flash_attn or side_stream" &
    wait
    ;;
time)
    $L torch_layout 70 python3 scripts/torch_gpu.py --parts layout
    $L flash_layout_parts 70 python3 lab/sweeps/flash_layout_parts.py
    $L flash_layout_parts_causal 70 python3 lab/sweeps/flash_layout_parts.py --causal
    $L varlen_speed_16bit 330 python3 scripts/varlen_gpu.py --parts speed \
        --dtypes float16,bfloat16 --dims 64,128
    ;;
*)
    echo "usage: $0 [first|check|time]" >&2
    exit 2
    ;;
esac
