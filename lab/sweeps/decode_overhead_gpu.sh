#!/usr/bin/env bash
# Where a decode call's time goes, on one GPU, in one call inside 600 s (records to $OUT
# through lab/sweeps/logged.sh; TREE names the tree).
#
#   bash lab/sweeps/decode_overhead_gpu.sh profile   # scripts/decode_gpu.py's overhead part
#       (each kernel's call timed alone, the host's time per call, the calls queued back
#       to back) at the four decode shapes in float16, alone; cProfile of the host's side
#       of 50 calls; the overhead part under Nsight Compute (the kernels' durations)
#   bash lab/sweeps/decode_overhead_gpu.sh check     # after a change to the call: the
#       decode tests on the GPU and the agreement part in parallel, then the overhead part
#       and cProfile alone
#   bash lab/sweeps/decode_overhead_gpu.sh serving   # numbaflash.torch's decoding calls
#       repeated directly and captured in a CUDA graph: their GPU tests and the agreement
#       part in parallel, then scripts/decode_gpu.py's serving part against SDPA alone
#   bash lab/sweeps/decode_overhead_gpu.sh direct    # repeated attention_with_kvcache
#       calls launched directly: the tests of the direct paths, the overhead part and
#       cProfile, then bench --inference in float16
#   bash lab/sweeps/decode_overhead_gpu.sh direct-quick  # the same, fewer tests, float16
#       only, and bench --inference's decode part alone (lab/sweeps/bench_decode_part.py)
#   bash lab/sweeps/decode_overhead_gpu.sh splits    # the split count against the time of
#       calls queued back to back at the GQA shapes, float16, split_kv_mma with two and
#       three stages of shared memory and split_kv (lab/sweeps/decode_splits_queued.py),
#       then the tensor-core decode tests on the GPU
#   bash lab/sweeps/decode_overhead_gpu.sh stalls    # Nsight Compute at b1-gqa, float16:
#       split_kv_mma (one launch) with its warps' stall reasons, and SDPA's kernels for the
#       same call (what they issue, their occupancy), side by side
#   bash lab/sweeps/decode_overhead_gpu.sh combine   # the two combine kernels: the combine
#       tests on the GPU, the whole call with each (lab/sweeps/decode_combine_queued.py),
#       their durations under Nsight Compute at b1-gqa, then bench --inference's decode part
#   bash lab/sweeps/decode_overhead_gpu.sh host      # the host's time per repeated call,
#       step by step (lab/sweeps/decode_host_steps.py), Numba views and PyTorch tensors
#   bash lab/sweeps/decode_overhead_gpu.sh prepared  # repeated calls launched through
#       launcher.PreparedLaunch: the direct paths' tests, the host's steps both ways
#       (lab/sweeps/decode_host_steps.py), bench --inference's float16 decode part
#   bash lab/sweeps/decode_overhead_gpu.sh torch-prepared  # numbaflash.torch's repeated
#       calls through launcher.PreparedLaunch: their GPU tests (forward and decoding,
#       CUDA graphs), then the small call's parts both ways (lab/sweeps/small_call_parts.py)
#   bash lab/sweeps/decode_overhead_gpu.sh transposed  # split_kv_mma_t (the group's rows
#       on the mma's N side) against split_kv_mma: the decode tests on the GPU, both
#       kernels alone and queued (lab/sweeps/decode_kernels_queued.py), their durations
#       and occupancy under Nsight Compute, the host's steps, bench's decode part
#   bash lab/sweeps/decode_overhead_gpu.sh transposed-check  # after it: the direct paths'
#       tests, split_kv_mma_t's stalls under Nsight Compute, the host's steps, bench
#   bash lab/sweeps/decode_overhead_gpu.sh lean [BEFORE]  # the direct paths' tests, the
#       overhead part (float16, float32; also for a before tree's package in BEFORE),
#       bench --inference's decode part, cProfile, numbaflash.torch's decoding step
#       against SDPA (the serving part)
set -u
cd "$(dirname "$0")/../.."
L="bash lab/sweeps/logged.sh"
case "${1:-}" in
profile)
    $L decode_overhead 120 python3 scripts/decode_gpu.py --parts overhead --dtypes float16
    $L decode_call_profile 60 python3 lab/sweeps/decode_call_profile.py
    $L ncu_decode_durations 200 ncu --metrics gpu__time_duration.sum \
        --kernel-name regex:"split_kv|combine" python3 scripts/decode_gpu.py --parts overhead \
        --dtypes float16 --repeats 2
    ;;
check)
    $L decode_agreement 150 python3 scripts/decode_gpu.py --parts agreement &
    NUMBAFLASH_PROFILE=gpu-quick $L tests_decode 150 python3 -m pytest -q -n 0 \
        -p no:cacheprovider tests/test_decode_mma.py tests/test_kvcache.py tests/test_torch.py \
        -k "mma or nan or explain or device or bfloat16 or errors or empty or append or kvcache" &
    wait
    $L decode_overhead 100 python3 scripts/decode_gpu.py --parts overhead --dtypes float16,bfloat16
    $L decode_call_profile 40 python3 lab/sweeps/decode_call_profile.py
    ;;
serving)
    NUMBAFLASH_PROFILE=gpu-quick $L tests_torch_decode 150 python3 -m pytest -q -n 0 \
        -p no:cacheprovider tests/test_torch.py -k "decod or kvcache or capture or repeated" &
    $L decode_agreement 150 python3 scripts/decode_gpu.py --parts agreement &
    wait
    $L decode_serving 240 python3 scripts/decode_gpu.py --parts serving \
        --dtypes float16,bfloat16,float32
    ;;
direct)
    NUMBAFLASH_PROFILE=gpu-quick $L tests_decode_direct 200 python3 -m pytest -q -n 0 \
        -p no:cacheprovider tests/test_kvcache.py tests/test_torch.py \
        -k "repeated or queued or append or captured or capture or kvcache or decod"
    $L decode_overhead 100 python3 scripts/decode_gpu.py --parts overhead \
        --dtypes float16,bfloat16
    $L decode_call_profile 40 python3 lab/sweeps/decode_call_profile.py
    $L bench_inference_float16 240 python3 -m numbaflash bench --inference --dtype float16
    ;;
direct-quick)
    NUMBAFLASH_PROFILE=gpu-quick $L tests_decode_direct 120 python3 -m pytest -q -n 0 \
        -p no:cacheprovider tests/test_kvcache.py tests/test_streams.py tests/test_torch.py \
        -k "repeated or queued or ready_stream or captured"
    $L decode_overhead 60 python3 scripts/decode_gpu.py --parts overhead --dtypes float16
    $L bench_decode 60 python3 lab/sweeps/bench_decode_part.py float16
    ;;
lean)
    # after a change to the repeated call's host steps; BEFORE (a second argument): a
    # before tree's directory holding its numbaflash package, timed in the same call.
    # In the order that matters if the device's time runs out: the tests of the direct
    # paths, the overhead part both ways, bench's decode part, then the serving part.
    before=${2:-}
    NUMBAFLASH_PROFILE=gpu-quick $L tests_decode_direct 150 python3 -m pytest -q -n 0 \
        -p no:cacheprovider tests/test_kvcache.py tests/test_streams.py tests/test_torch.py \
        -k "repeated or queued or ready_stream or captured or scratch or stream"
    if [ -n "$before" ]; then
        PYTHONPATH="$PWD/$before:$PYTHONPATH" $L decode_overhead_before 60 \
            python3 scripts/decode_gpu.py --parts overhead --dtypes float16,float32
    fi
    $L decode_overhead 60 python3 scripts/decode_gpu.py --parts overhead \
        --dtypes float16,float32
    $L bench_decode 120 python3 lab/sweeps/bench_decode_part.py float16 float32
    $L decode_call_profile 30 python3 lab/sweeps/decode_call_profile.py
    $L decode_serving 80 python3 scripts/decode_gpu.py --parts serving \
        --dtypes float16,float32
    ;;
lean-short)
    # lean within about 230 s: the direct path's own tests, the overhead part both ways,
    # bench's float16 decode part
    before=${2:-}
    NUMBAFLASH_PROFILE=gpu-quick $L tests_decode_direct 100 python3 -m pytest -q -n 0 \
        -p no:cacheprovider tests/test_kvcache.py tests/test_streams.py \
        -k "repeated or scratch or producer or ready_stream"
    if [ -n "$before" ]; then
        PYTHONPATH="$PWD/$before:$PYTHONPATH" $L decode_overhead_before 40 \
            python3 scripts/decode_gpu.py --parts overhead --dtypes float16,float32
    fi
    $L decode_overhead 40 python3 scripts/decode_gpu.py --parts overhead \
        --dtypes float16,float32
    $L bench_decode 70 python3 lab/sweeps/bench_decode_part.py float16
    ;;
torch-prepared)
    NUMBAFLASH_PROFILE=gpu-quick $L tests_prepared 200 python3 -m pytest -q -n 0 \
        -p no:cacheprovider tests/test_torch.py tests/test_kvcache.py \
        -k "repeated or captured or capture"
    $L small_call_core 90 python3 lab/sweeps/small_call_parts.py --calls 1000 --launch core
    $L small_call_prepared 90 python3 lab/sweeps/small_call_parts.py --calls 1000 \
        --launch prepared
    ;;
prepared)
    NUMBAFLASH_PROFILE=gpu-quick $L tests_decode_direct 200 python3 -m pytest -q -n 0 \
        -p no:cacheprovider tests/test_kvcache.py tests/test_streams.py tests/test_torch.py \
        -k "repeated or queued or ready_stream or captured or scratch or stream"
    $L decode_host_steps 120 python3 lab/sweeps/decode_host_steps.py
    $L bench_decode 90 python3 lab/sweeps/bench_decode_part.py float16
    ;;
host)
    $L decode_host_steps 120 python3 lab/sweeps/decode_host_steps.py
    ;;
combine)
    NUMBAFLASH_PROFILE=gpu-quick $L tests_combine 100 python3 -m pytest -q -n 0 \
        -p no:cacheprovider tests/test_combine.py tests/test_kvcache.py -k "combine or split"
    $L decode_combine_queued 150 python3 lab/sweeps/decode_combine_queued.py
    $L ncu_combine_durations 100 ncu --metrics gpu__time_duration.sum \
        --kernel-name regex:"combine|split_kv" python3 lab/sweeps/decode_combine_queued.py \
        --shapes b1-gqa --dtypes float16 --repeats 2
    $L bench_decode 120 python3 lab/sweeps/bench_decode_part.py float16 float32
    ;;
stalls)
    SECTIONS="--section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy
        --section WarpStateStats --section SchedulerStats --section LaunchStats
        --section InstructionStats --section ComputeWorkloadAnalysis"
    STALLS="regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio"
    # $SECTIONS unquoted on purpose: one word per option
    $L ncu_stalls_split_kv_mma 150 ncu --kernel-name regex:"split_kv_mma|combine" \
        --launch-skip 2 --launch-count 2 $SECTIONS --metrics "$STALLS" \
        python3 scripts/decode_gpu.py --parts bandwidth --shapes b1-gqa --dtypes float16 \
        --repeats 3
    $L ncu_stalls_sdpa 150 ncu --kernel-name regex:"flash|fmha|attention" \
        --launch-skip 2 --launch-count 3 $SECTIONS --metrics "$STALLS" \
        python3 scripts/decode_gpu.py --parts bandwidth --shapes b1-gqa --dtypes float16 \
        --repeats 3
    ;;
splits)
    $L decode_splits_queued 240 python3 lab/sweeps/decode_splits_queued.py --dtype float16 \
        --shapes b1-gqa,b8-gqa
    NUMBAFLASH_PROFILE=gpu-quick $L tests_decode_mma 150 python3 -m pytest -q -n 0 \
        -p no:cacheprovider tests/test_decode_mma.py
    ;;
transposed)
    # split_kv_mma_t against split_kv_mma, and the repeated call's host steps after
    # its outputs moved behind the split kernel: the tensor-core decode tests and the
    # direct paths' tests on the GPU, both kernels queued and alone at the planner's
    # and given split counts, their durations and occupancy under Nsight Compute at
    # b1-gqa, the host's steps, then bench --inference's decode part
    NUMBAFLASH_PROFILE=gpu-quick $L tests_decode_transposed 200 python3 -m pytest -q -n 0 \
        -p no:cacheprovider tests/test_decode_mma.py tests/test_kvcache.py tests/test_torch.py \
        -k "mma or repeated or queued or captured or decode_outputs or nan or bfloat16"
    $L decode_kernels_queued 150 python3 lab/sweeps/decode_kernels_queued.py \
        --splits 0,33,50,66
    $L ncu_decode_kernels 90 ncu --metrics gpu__time_duration.sum,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active,launch__occupancy_limit_registers,launch__occupancy_limit_shared_mem \
        --kernel-name regex:"split_kv|combine" python3 lab/sweeps/decode_kernels_queued.py \
        --shapes b1-gqa --dtypes float16 --repeats 2
    $L decode_host_steps 60 python3 lab/sweeps/decode_host_steps.py --shapes b1-gqa \
        --calls 1000 --sync-every 5 --prepared 1
    $L bench_decode 120 python3 lab/sweeps/bench_decode_part.py float16 float32
    ;;
transposed-check)
    # after transposed: the direct paths' GPU tests (outputs made while the split kernel
    # runs, PyTorch tensors read without their interface), split_kv_mma_t's stalls under
    # Nsight Compute at b1-gqa (as the stalls mode reads its parent's), the host's steps
    # on Numba views and tensors, bench --inference's decode part
    NUMBAFLASH_PROFILE=gpu-quick $L tests_decode_direct 200 python3 -m pytest -q -n 0 \
        -p no:cacheprovider tests/test_kvcache.py tests/test_torch.py tests/test_streams.py \
        -k "repeated or queued or captured or capture or torch_tensors or scratch or explain or decode_outputs"
    SECTIONS="--section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy
        --section WarpStateStats --section SchedulerStats --section LaunchStats"
    STALLS="regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio"
    # (the command of lab/runs/2026-12-07/155_ncu_stalls_split_kv_mma_t.txt)
    $L ncu_stalls_split_kv_mma_t 100 ncu --kernel-name regex:"split_kv_mma_t" \
        --launch-count 1 $SECTIONS --metrics "$STALLS" \
        python3 scripts/decode_gpu.py --parts bandwidth --shapes b1-gqa --dtypes float16 \
        --repeats 3 --decode-kernels split_kv_mma_t,split_kv_mma,split_kv
    $L decode_host_steps 60 python3 lab/sweeps/decode_host_steps.py --shapes b1-gqa \
        --calls 1000 --sync-every 5 --prepared 1
    $L bench_decode 120 python3 lab/sweeps/bench_decode_part.py float16 float32
    ;;
*)
    echo "usage: bash lab/sweeps/decode_overhead_gpu.sh profile|check|serving|direct|direct-quick|torch-prepared|prepared|host|combine|stalls|splits|transposed|transposed-check|lean [BEFORE]|lean-short [BEFORE]" >&2
    exit 2
    ;;
esac
