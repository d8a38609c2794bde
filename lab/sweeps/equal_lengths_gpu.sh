#!/usr/bin/env bash
# Backward v9's causal dQ kernel built for packed batches of equal lengths
# (kernels/sequences.py), on one GPU inside one 600 s call; records to $OUT through
# lab/sweeps/logged.sh (TREE names the tree).
#
#   bash lab/sweeps/equal_lengths_gpu.sh
#
# The GPU tests of the build (the direct launch's words and bits, the packed batches of
# equal lengths bitwise per sequence), then flash_attn_func's two ways with gradients at
# (2, 4096, 16, d) in float16 (lab/sweeps/flash_layout_ways.py): causal at d = 64 (where
# the build takes 106 registers instead of 148) and d = 128, and at d = 64 without the mask
# (the build is not used there: the same kernels as before, for comparison; with cProfile
# of each way's host side: the in-place way's time alone exceeds its time queued more
# than the other ways' do, lab/runs/2026-12-06/140_layout_f16_d64_grad.txt). The three
# compile in parallel and time one at a time (--lock).
#
#   bash lab/sweeps/equal_lengths_gpu.sh short   # within about 250 s: the equal-lengths
#       tests alone, then float16 causal d = 64 with gradients alone
#   bash lab/sweeps/equal_lengths_gpu.sh tests   # the GPU tests of the build alone, with
#       the time they need (about 40 s a packed case, compiling: 150 s cut them at six)
set -u
cd "$(dirname "$0")/../.."
L="bash lab/sweeps/logged.sh"
if [ "${1:-}" = tests ]; then
    NUMBAFLASH_PROFILE=gpu-quick $L tests_equal_lengths 450 python3 -m pytest -q -n 0 \
        -p no:cacheprovider tests/test_launcher.py tests/test_varlen.py \
        -k "equal_lengths or equal_lengths_are or words or packed_only_backward"
    exit
fi
if [ "${1:-}" = short ]; then
    NUMBAFLASH_PROFILE=gpu-quick $L tests_equal_lengths 100 python3 -m pytest -q -n 0 \
        -p no:cacheprovider tests/test_launcher.py tests/test_varlen.py -k "equal_lengths"
    $L layout_f16_d64_causal_grad 150 python3 lab/sweeps/flash_layout_ways.py \
        --dtype float16 --dim 64 --causal --grad
    exit
fi
NUMBAFLASH_PROFILE=gpu-quick $L tests_equal_lengths 150 python3 -m pytest -q -n 0 \
    -p no:cacheprovider tests/test_launcher.py tests/test_varlen.py \
    -k "equal_lengths or equal_lengths_are or words or packed_only_backward"
LOCK=/tmp/equal_lengths_ways.lock
$L layout_f16_d64_causal_grad 250 python3 lab/sweeps/flash_layout_ways.py --lock $LOCK \
    --dtype float16 --dim 64 --causal --grad &
$L layout_f16_d128_causal_grad 250 python3 lab/sweeps/flash_layout_ways.py --lock $LOCK \
    --dtype float16 --dim 128 --causal --grad &
$L layout_f16_d64_grad 250 python3 lab/sweeps/flash_layout_ways.py --lock $LOCK \
    --dtype float16 --dim 64 --grad --profile &
wait
