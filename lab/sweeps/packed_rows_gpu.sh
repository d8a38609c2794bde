#!/usr/bin/env bash
# Forward v10's packed build reading the packed arrays as they are (kernels/sequences.py's
# make_packed_rows) and numbaflash.torch.flash_attn_func reading its layout in place
# through it, on one GPU in one call that ends inside 600 s. Records go to $OUT through
# lab/sweeps/logged.sh (TREE names the tree).
#
#   bash lab/sweeps/packed_rows_gpu.sh
#
# First, in parallel (no timing): the packed batches' agreement with float64, v10's
# packed rows the bits of attention() per sequence, the torch layer's GPU tests of
# flash_attn_func and the direct launches, memcheck on the packed v10 / v9. Then, alone:
# flash-attn's layout in place against (batch, heads, seqlen, d), and the float16 packed
# batch against the padded one at d = 64.
set -u
cd "$(dirname "$0")/../.."
L="bash lab/sweeps/logged.sh"
SAN="compute-sanitizer --error-exitcode 1 --tool"
$L varlen_agreement 240 python3 scripts/varlen_gpu.py --parts agreement &
( $L varlen_bitwise_v10 120 python3 scripts/varlen_gpu.py --parts bitwise \
      --bitwise-forward v10
  $L tests_torch_flash 120 python3 -m pytest -q -n 0 -p no:cacheprovider tests/test_torch.py \
      -k "in_place or flash_attn_func or repeated_cuda or side_stream" ) &
$L memcheck_varlen_v10_v9_float16 150 $SAN memcheck python3 scripts/sanitize_target.py \
    --varlen --forward v10 --backward v9 --dtype float16 &
wait
$L torch_layout 60 python3 scripts/torch_gpu.py --parts layout
$L varlen_speed_d64_float16 170 python3 scripts/varlen_gpu.py --parts speed \
    --dtypes float16 --dims 64
