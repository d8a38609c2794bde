#!/usr/bin/env bash
# Run one command on a GPU machine and keep its output with the header a lab record needs.
#
#   TREE="54f7ef3 + ..." OUT=dir bash lab/sweeps/logged.sh NAME SECONDS COMMAND...
#
# Writes $OUT/NAME.txt: the GPU, the Python packages' versions, the tree (TREE: the device
# copy has no .git), the command with its time limit, the start and end times, then the
# command's stdout and stderr, then its exit status (124: it ran past SECONDS). Prints the
# last lines of the record, so the caller sees how it went.
set -u
name=$1 limit=$2
shift 2
out="${OUT:-gpu-out}/$name.txt"
mkdir -p "$(dirname "$out")"
{
    echo "# $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)"
    echo "# $(python3 -c 'import sys, importlib; print("Python", sys.version.split()[0], end="");
for m in ("numpy", "numba", "numba_cuda", "torch", "ml_dtypes"):
    try:
        v = importlib.import_module(m).__version__
    except Exception:
        v = "absent"
    print(",", m.replace("_", "-"), v, end="")' 2>&1)"
    echo "# tree: ${TREE:-unknown}"
    echo "# command: timeout $limit $*"
    echo "# start: $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
    echo
} > "$out"
timeout "$limit" "$@" >> "$out" 2>&1
rc=$?
{
    echo
    echo "# end: $(date -u '+%Y-%m-%d %H:%M:%S UTC'), exit $rc$([ $rc = 124 ] && echo ' (time limit: cut)')"
} >> "$out"
echo "== $name: exit $rc"
tail -n 4 "$out"
