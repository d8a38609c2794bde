#!/usr/bin/env bash
# On a GPU: the variants on the fast kernels (forward v5-v9, backward v4 and v6).
#
#   bash lab/sweeps/variants_fast_path_gpu.sh bits BEFORE_DIR OUT   # plain attention: bitwise
#        the same as BEFORE_DIR's tree, and the bench of both trees (tree_vs_tree_gpu.sh)
#   bash lab/sweeps/variants_fast_path_gpu.sh targets OUT    # scripts/variants_gpu.py: agreement
#        with PyTorch in float64, the skipped-tile times and the speed targets
#   bash lab/sweeps/variants_fast_path_gpu.sh tests OUT      # the variant property tests and the
#        torch layer's tests on the GPU
#   bash lab/sweeps/variants_fast_path_gpu.sh sanitize OUT   # compute-sanitizer (memcheck,
#        synccheck, racecheck) on every kernel that takes variants
#
# numpy<2.5 and PyTorch must be importable (DEVICE.md); each part prints a short summary last.
set -uo pipefail
part=$1
shift
case "$part" in
bits)
    bash lab/sweeps/tree_vs_tree_gpu.sh "$1" "$2"
    ;;
targets)
    out=$1; mkdir -p "$out"
    python3 scripts/variants_gpu.py --out "$out" --repeats 5 > "$out/variants_gpu.txt" 2>&1
    echo "variants_gpu exit $?" >> "$out/variants_gpu.txt"
    grep -E "^(OK|FAIL)|agreement:|ratio|faster|exit|not timed" "$out/variants_gpu.txt"
    ;;
tests)
    out=$1; shift; mkdir -p "$out"
    # -v under xdist prints each result with its name as it comes, so a run cut short by
    # the time limit still says which tests failed.
    NUMBAFLASH_PROFILE=gpu-quick timeout "${TESTS_TIMEOUT:-540}" python3 -m pytest \
        -p no:cacheprovider -n "${TESTS_JOBS:-14}" -v -rf --durations=10 tests/test_variants.py \
        tests/test_variants_forward_mma.py tests/test_variants_backward_mma.py \
        tests/test_torch.py "$@" > "$out/tests_gpu.txt" 2>&1
    echo "pytest exit $?" >> "$out/tests_gpu.txt"
    grep -E "FAILED|ERROR" "$out/tests_gpu.txt" | head -n 20
    tail -n 4 "$out/tests_gpu.txt"
    ;;
sanitize)
    # One process per (tool, kernel), SANITIZER_JOBS at a time: each compiles only its own
    # kernel's variant builds, so the whole set fits in one call of the GPU machine.
    out=$1; mkdir -p "$out"
    kernels=("--forward v5" "--forward v6" "--forward v7 --dtype float16" "--forward v8"
             "--forward v9 --dtype float32" "--backward v4" "--backward v6")
    for tool in ${SANITIZER_TOOLS:-memcheck synccheck racecheck}; do
        for sel in "${kernels[@]}"; do echo "$tool $sel"; done
    done | xargs -P "${SANITIZER_JOBS:-12}" -L 1 bash -c '
        tool=$0; tag=$(echo "$*" | tr -d "-" | tr " " "_")
        timeout "${SANITIZER_TIMEOUT:-480}" compute-sanitizer --tool "$tool" \
            python3 scripts/sanitize_target.py --variants "$@" \
            > "'"$out"'/sanitize_variants_${tool}_${tag}.txt" 2>&1
        echo "exit $?" >> "'"$out"'/sanitize_variants_${tool}_${tag}.txt"'
    for f in "$out"/sanitize_variants_*.txt; do
        echo "$(basename "$f" .txt): $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$f" | tail -n 1)" \
             "($(grep -c ': ok$' "$f") calls, $(grep -c 'not run' "$f") not run, $(tail -n 1 "$f"))"
    done
    ;;
*)
    echo "usage: $0 bits BEFORE OUT | targets OUT | tests OUT | sanitize OUT" >&2
    exit 2
    ;;
esac
