#!/usr/bin/env bash
# On a GPU: dropout on the default kernels.
#
#   bash lab/sweeps/dropout_gpu.sh costs       # dropout_p = 0.1 against no dropout at
#        (2, 16, 4096, 64 / 128), float32 and float16, with the dK/dV register cap and (d = 64)
#        without it, then the agreement with the dense reference and 50 bitwise reruns
#   bash lab/sweeps/dropout_gpu.sh sanitize    # compute-sanitizer memcheck, racecheck and
#        synccheck on every kernel that takes dropout, one process per (tool, kernel)
#
# numpy<2.5 must be importable (DEVICE.md). Prints what it measured; each part ends with
# one line per process or file.
set -uo pipefail
case "${1:-}" in
costs)
    echo "# timeout 300 python3 scripts/dropout_gpu.py --repeats 10 --parts cost"
    timeout 300 python3 scripts/dropout_gpu.py --repeats 10 --parts cost; echo "exit $?"
    echo "# timeout 120 python3 scripts/dropout_gpu.py --repeats 10 --parts cost --sizes 64 --no-register-cap"
    timeout 120 python3 scripts/dropout_gpu.py --repeats 10 --parts cost --sizes 64 \
        --no-register-cap; echo "exit $?"
    echo "# timeout 150 python3 scripts/dropout_gpu.py --parts agreement,reruns --reruns 50"
    timeout 150 python3 scripts/dropout_gpu.py --parts agreement,reruns --reruns 50
    echo "exit $?"
    ;;
sanitize)
    dir=$(mktemp -d)
    for tool in memcheck racecheck synccheck; do
        for k in "--forward v1" "--forward v2" "--forward v5" "--forward v6" \
                 "--forward v7 --dtype float16" "--forward v8" "--forward v9 --dtype float32" \
                 "--backward v1" "--backward v4" "--backward v6"; do
            echo "$tool $k"
        done
    done | xargs -P "${SANITIZER_JOBS:-14}" -L 1 sh -c 'tool=$1; shift
        tag=$(echo "$*" | tr -d " -")
        timeout "${SANITIZER_TIMEOUT:-420}" compute-sanitizer --tool "$tool" \
            python3 scripts/sanitize_target.py --variants --cases dropout "$@" \
            > "$0/san_${tool}_${tag}.txt" 2>&1
        echo "exit $?" >> "$0/san_${tool}_${tag}.txt"' "$dir"
    for f in "$dir"/san_*.txt; do
        echo "== $(basename "$f"): $(grep -c ': ok$' "$f") calls ok, $(grep -c 'not run' "$f")" \
             "not run; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$f" | tr -s ' ' | tr '\n' ' ')" \
             "$(tail -n 1 "$f")"
    done
    ;;
*)
    echo "usage: $0 costs | sanitize" >&2
    exit 2
    ;;
esac
