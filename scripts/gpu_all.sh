#!/usr/bin/env bash
# Everything numbaflash checks on a real GPU, in one place, logs under $OUT (default ./gpu-out).
#
#   bash scripts/gpu_all.sh tests       # the property suite with real CUDA, GPU-sized shapes
#   bash scripts/gpu_all.sh check       # agreement with PyTorch SDPA (float64) + timings
#   bash scripts/gpu_all.sh simgpu      # the same small inputs on the GPU and in the simulator
#   bash scripts/gpu_all.sh variants    # attention variants vs PyTorch, skipped-tile timings,
#                                         and compute-sanitizer on the variant kernels
#   bash scripts/gpu_all.sh sanitize    # compute-sanitizer memcheck, racecheck, synccheck, initcheck
#                                         (SANITIZER_TOOLS="memcheck racecheck" picks some)
#   bash scripts/gpu_all.sh all         # the four above, each time-limited, logs packed in one file
#   bash scripts/gpu_all.sh energy      # bench --energy: joules per call, numbaflash and SDPA, not
#                                         part of "all" (needs pip install "numbaflash[energy]")
#   bash scripts/gpu_all.sh half        # float16 and bfloat16: their tests, scripts/half_gpu.py
#                                         (agreement, 50 reruns, time against SDPA FLASH, forward
#                                         v10 beside v7), and compute-sanitizer on forward v7,
#                                         v10 and backward v7 in bfloat16; not part of "all"
#   bash scripts/gpu_all.sh atomic      # backward v8 (dQ by atomics): its tests,
#                                         scripts/atomic_dq_gpu.py (agreement, reruns, time
#                                         against v6 and SDPA) and compute-sanitizer; not in "all"
#   bash scripts/gpu_all.sh decode      # the split-KV decode kernel: its tests,
#                                         scripts/decode_gpu.py (agreement, the four builds,
#                                         bandwidth) and compute-sanitizer; not part of "all"
#
# Each part prints a short summary last. Needs a CUDA GPU, PyTorch, and numpy < 2.5.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu-out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
unset NUMBA_ENABLE_CUDASIM

# run_sanitizers LABEL PREFIX "TOOLS" [ARGS...]
# Runs scripts/sanitize_target.py ARGS under each compute-sanitizer tool in TOOLS, logging
# to $OUT/PREFIX_TOOL.txt, and prints one line per tool: LABEL, the tool, its summary line
# and how many calls completed. Returns 1 when a tool printed no summary line or one that
# is not "0 errors" / "0 hazards" (a run that checks nothing also prints no error).
run_sanitizers() {
    local label=$1 prefix=$2 tools=$3
    shift 3
    local status=0 tool log summary calls
    for tool in $tools; do
        log="$OUT/${prefix}_$tool.txt"
        compute-sanitizer --tool "$tool" python3 scripts/sanitize_target.py "$@" > "$log" 2>&1
        summary=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$log" | tail -n 1)
        calls=$(grep -c ": ok$" "$log")
        echo "$label$tool: ${summary:-NO SUMMARY LINE} ($calls calls completed)"
        case "$summary" in
            *" 0 errors"*|*" 0 hazards"*) ;;
            *) status=1 ;;
        esac
    done
    return "$status"
}

part="${1:-}"
case "$part" in
tests)
    # NUMBAFLASH_PROFILE=gpu: more examples; the strategies draw GPU-sized shapes when the
    # backend is the GPU. -p no:cacheprovider: the checkout may be read-only.
    # Arguments after "tests" replace the default selection (the whole tests/ folder).
    # TEST_WORKERS pytest-xdist processes share the GPU (most of a GPU test's time is
    # compiling kernel specialisations on the CPU); 0 runs in this process.
    targets=("${@:2}")
    [ ${#targets[@]} -gt 0 ] || targets=(tests)
    workers=()
    python3 -c "import xdist" 2>/dev/null && workers=(-n "${TEST_WORKERS:-12}")
    NUMBAFLASH_PROFILE="${NUMBAFLASH_PROFILE:-gpu}" timeout "${TEST_TIMEOUT:-420}" \
        python3 -m pytest -p no:cacheprovider -q --maxfail=20 --durations=15 "${workers[@]}" \
        "${targets[@]}" 2>&1 \
        | tee "$OUT/gpu_tests.txt"
    exit "${PIPESTATUS[0]}"
    ;;
check)
    python3 scripts/gpu_check.py --out "$OUT" "${@:2}" 2>&1 | tee "$OUT/gpu_check.txt"
    exit "${PIPESTATUS[0]}"
    ;;
simgpu)
    python3 scripts/sim_vs_gpu.py --out "$OUT" 2>&1 | tee "$OUT/sim_vs_gpu.txt"
    exit "${PIPESTATUS[0]}"
    ;;
variants)
    # Attention variants: agreement with PyTorch (float64) and the skipped-tile timings,
    # then compute-sanitizer on the variant kernels (scripts/sanitize_target.py --variants).
    python3 scripts/variants_gpu.py --out "$OUT" 2>&1 | tee "$OUT/variants_gpu.txt"
    status=${PIPESTATUS[0]}
    run_sanitizers "variants " sanitize_variants \
        "${SANITIZER_TOOLS:-memcheck racecheck synccheck}" --variants || status=1
    exit "$status"
    ;;
energy)
    # The default shapes timed, then each timed call's energy from NVML's counter (windows
    # of at least 2 s); arguments after "energy" go to the bench (e.g. --shapes).
    python3 -m numbaflash bench --energy --repeats 5 --warmup 1 \
        --json "$OUT/bench_energy.json" "${@:2}" 2>&1 | tee "$OUT/bench_energy.txt"
    exit "${PIPESTATUS[0]}"
    ;;
half)
    status=0
    OUT="$OUT" bash "$0" tests tests/test_bfloat16.py tests/test_backward_half.py \
        tests/test_forward_v10.py tests/test_simulated_ptx.py tests/test_torch.py \
        > "$OUT/half_tests_console.txt" 2>&1 || status=1
    tail -n 1 "$OUT/half_tests_console.txt"
    python3 scripts/half_gpu.py --forward-versions default,v7,v10 2>&1 | tee "$OUT/half_gpu.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    run_sanitizers "forward v7 bfloat16 " sanitize_fwd_v7_bf16 \
        "${SANITIZER_TOOLS:-memcheck racecheck synccheck}" --forward v7 --dtype bfloat16 \
        || status=1
    run_sanitizers "forward v10 float16 " sanitize_fwd_v10_f16 \
        "${SANITIZER_TOOLS:-memcheck racecheck synccheck}" --forward v10 --dtype float16 \
        || status=1
    run_sanitizers "backward v7 bfloat16 " sanitize_bwd_v7_bf16 \
        "${SANITIZER_TOOLS:-memcheck racecheck synccheck}" --backward v7 --dtype bfloat16 \
        || status=1
    exit "$status"
    ;;
atomic)
    status=0
    OUT="$OUT" bash "$0" tests tests/test_backward_atomic_dq.py tests/test_varlen.py \
        > "$OUT/atomic_tests_console.txt" 2>&1 || status=1
    tail -n 1 "$OUT/atomic_tests_console.txt"
    python3 scripts/atomic_dq_gpu.py 2>&1 | tee "$OUT/atomic_dq_gpu.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    python3 scripts/atomic_dq_gpu.py --parts speed --no-register-cap 2>&1 \
        | tee "$OUT/atomic_dq_gpu_uncapped.txt"
    run_sanitizers "backward v8 " sanitize_bwd_v8 \
        "${SANITIZER_TOOLS:-memcheck racecheck synccheck}" --backward v8 || status=1
    exit "$status"
    ;;
decode)
    status=0
    OUT="$OUT" bash "$0" tests tests/test_kvcache.py tests/test_decode_kernel.py \
        > "$OUT/decode_tests_console.txt" 2>&1 || status=1
    tail -n 1 "$OUT/decode_tests_console.txt"
    python3 scripts/decode_gpu.py --parts agreement,kernels,bandwidth,layout --repeats 20 \
        2>&1 | tee "$OUT/decode_gpu.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    run_sanitizers "decode " sanitize_decode \
        "${SANITIZER_TOOLS:-memcheck racecheck synccheck}" --kvcache || status=1
    exit "$status"
    ;;
sanitize)
    run_sanitizers "" sanitize "${SANITIZER_TOOLS:-memcheck racecheck synccheck initcheck}" \
        | tee "$OUT/sanitize_summary.txt"
    # The exit status comes from the summary file (the function's is lost in the pipe).
    grep -q "NO SUMMARY\|[1-9][0-9]* errors\|[1-9][0-9]* hazards" "$OUT/sanitize_summary.txt" && exit 1
    exit 0
    ;;
all)
    # Everything, each part under its own time limit. The logs go to a scratch folder and
    # come back packed in $OUT/gpu_logs.tgz, with gpu_check.json and the sanitizer summary
    # beside it (the device tool returns at most 8 files). About 9 minutes on the H200.
    logs=$(mktemp -d)
    status=0
    OUT="$logs" timeout "${CHECK_TIMEOUT:-240}" bash "$0" check > "$logs/check_console.txt" 2>&1 || status=1
    tail -n 3 "$logs/check_console.txt"
    OUT="$logs" NUMBAFLASH_PROFILE="${NUMBAFLASH_PROFILE:-gpu-quick}" TEST_TIMEOUT="${TEST_TIMEOUT:-200}" \
        bash "$0" tests tests/test_forward_kernels.py tests/test_backward_kernels.py \
        tests/test_backward_nonfinite.py tests/test_api_errors.py \
        > "$logs/tests_console.txt" 2>&1 || status=1
    tail -n 1 "$logs/tests_console.txt"
    OUT="$logs" timeout "${SIMGPU_TIMEOUT:-90}" bash "$0" simgpu > "$logs/simgpu_console.txt" 2>&1 || status=1
    tail -n 1 "$logs/simgpu_console.txt"
    OUT="$logs" SANITIZER_TOOLS="${SANITIZER_TOOLS:-memcheck racecheck synccheck}" \
        timeout "${SANITIZE_TIMEOUT:-150}" bash "$0" sanitize || status=1
    tar czf "$OUT/gpu_logs.tgz" -C "$logs" .
    cp "$logs/gpu_check.json" "$logs/sanitize_summary.txt" "$logs/sim_vs_gpu.json" "$OUT/" 2>/dev/null
    exit $status
    ;;
*)
    echo "usage: bash scripts/gpu_all.sh tests|check|simgpu|variants|energy|half|atomic|decode|sanitize|all" >&2
    exit 2
    ;;
esac
