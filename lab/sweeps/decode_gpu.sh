#!/usr/bin/env bash
# On a GPU: decoding against a KV cache (kernels/decode/).
#
#   bash lab/sweeps/decode_gpu.sh tests      # tests/test_kvcache.py on the GPU
#   bash lab/sweeps/decode_gpu.sh sanitize   # compute-sanitizer memcheck, racecheck and
#        synccheck on scripts/sanitize_target.py --kvcache, one process per tool
#   bash lab/sweeps/decode_gpu.sh measure    # scripts/decode_gpu.py: agreement, split
#        counts, rows per block, bandwidth against SDPA and the HBM copy limit
#
# numpy<2.5 must be importable (DEVICE.md). Each part ends with its exit status.
set -uo pipefail
case "${1:-}" in
tests)
    echo "# timeout 400 python3 -m pytest tests/test_kvcache.py -q -x -p no:cacheprovider"
    timeout 400 python3 -m pytest tests/test_kvcache.py -q -x -p no:cacheprovider 2>&1 | tail -15
    echo "exit ${PIPESTATUS[0]}"
    ;;
sanitize)
    dir=$(mktemp -d)
    for tool in memcheck racecheck synccheck; do
        ( timeout 400 compute-sanitizer --tool "$tool" python3 scripts/sanitize_target.py \
            --kvcache > "$dir/san_$tool.txt" 2>&1; echo "exit $?" >> "$dir/san_$tool.txt" ) &
    done
    wait
    for f in "$dir"/san_*.txt; do
        echo "== $(basename "$f"): $(grep -c ': ok$' "$f") calls ok; $(grep -E \
            'ERROR SUMMARY|RACECHECK SUMMARY' "$f" | tr -s ' ' | tr '\n' ' ') $(tail -1 "$f")"
    done
    ;;
measure)
    echo "# timeout 400 python3 scripts/decode_gpu.py --repeats 15"
    timeout 400 python3 scripts/decode_gpu.py --repeats 15; echo "exit $?"
    ;;
*)
    echo "usage: $0 tests|sanitize|measure" >&2
    exit 2
    ;;
esac
