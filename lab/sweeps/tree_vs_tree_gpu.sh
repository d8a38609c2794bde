#!/usr/bin/env bash
# On a GPU: is this tree the same kernels as another one (a tree from before a change that
# only moves code)? Bitwise outputs and gradients (lab/sweeps/same_bits.py), then the bench
# of both trees at two shapes, one after the other.
#
#   bash lab/sweeps/tree_vs_tree_gpu.sh BEFORE_DIR OUT_DIR
#
# BEFORE_DIR holds the other tree's numbaflash/ package (e.g. `git archive <commit>
# numbaflash | tar -x -C BEFORE_DIR`); this tree is the current directory. numpy<2.5 and
# the CUDA wheels must be importable (DEVICE.md); PyTorch for the bench's SDPA columns.
set -uo pipefail
before=$(cd "$1" && pwd); out=$2; here=$(pwd)
mkdir -p "$out"
{
    date -u; nvidia-smi -L; python3 -c "import numba, numba_cuda, numpy, torch; print('numba', numba.__version__, 'numba-cuda', numba_cuda.__version__, 'numpy', numpy.__version__, 'torch', torch.__version__)"
    echo "before: $before"; echo "after: $here ($(git -C "$here" rev-parse --short HEAD 2>/dev/null || echo 'no git'))"
} > "$out/env.txt" 2>&1

# The two trees' outputs, in parallel (compiling is most of the time, on the CPU).
(cd "$before" && PYTHONPATH="$before:${PYTHONPATH:-}" python3 "$here/lab/sweeps/same_bits.py" run --out "$out/before.npz") > "$out/same_bits_before.log" 2>&1 &
(PYTHONPATH="$here:${PYTHONPATH:-}" python3 "$here/lab/sweeps/same_bits.py" run --out "$out/after.npz") > "$out/same_bits_after.log" 2>&1 &
wait
python3 lab/sweeps/same_bits.py compare "$out/before.npz" "$out/after.npz" > "$out/same_bits.txt" 2>&1
echo "compare exit $?" >> "$out/same_bits.txt"
rm -f "$out/before.npz" "$out/after.npz"
cat "$out/same_bits_before.log" "$out/same_bits_after.log" >> "$out/same_bits.txt"
rm -f "$out/same_bits_before.log" "$out/same_bits_after.log"

# The bench of both trees, one at a time (timings), each from its own directory so that
# `python -m numbaflash` finds that tree's package.
shapes=2x16x4096x64,2x16x4096x128
for tree in before after; do
    dir=$([ "$tree" = before ] && echo "$before" || echo "$here")
    (cd "$dir" && PYTHONPATH="$dir:${PYTHONPATH:-}" python3 -m numbaflash bench --shapes "$shapes" \
        --passes forward,fwd+bwd --repeats 5 --warmup 1 --json "$out/bench_$tree.json") \
        > "$out/bench_$tree.txt" 2>&1
    echo "bench $tree exit $?" >> "$out/bench_$tree.txt"
done
grep -h "bitwise identical\|compare exit\|DIFFERS\|MISSING" "$out/same_bits.txt" | head -n 20
grep -h "exit" "$out"/bench_*.txt
