#!/usr/bin/env bash
# Cold and warm call times of two source trees side by side on this machine, interleaved so
# that a noisy machine weighs on both alike; then the GPU checks of this tree.
#
#   bash benchmarks/seam_compare.sh OLD_TREE OUT_DIR
#
# OLD_TREE holds the src/ and benchmarks/ of the revision to compare with (git archive REV
# src benchmarks | tar -x -C OLD_TREE).
set -uo pipefail
old=$1 out=$2
mkdir -p "$out"
export PYTHONUNBUFFERED=1
n=$(python -c "import torch; print(torch.cuda.device_count())")
for round in 1 2; do
    for tree in "$old" "$PWD"; do
        name=$([ "$tree" = "$PWD" ] && echo new || echo old)
        echo "== launch overhead, $name tree, round $round"
        GPUFLEET_HOME=$(mktemp -d) PYTHONPATH="$tree/src" python "$tree/benchmarks/launch_overhead.py" \
            --nprocs "$n" --reps 3 --launchers gpufleet,gpufleet-warm --out "$out/launch_overhead-$name-$round.md" \
            > "$out/launch_overhead-$name-$round.log" 2>&1
        grep "^| gpufleet" "$out/launch_overhead-$name-$round.md"
    done
done
echo "== tests/test_gpu.py"
GPUFLEET_HOME=$(mktemp -d) PYTHONPATH="$PWD/src" python -m pytest -q tests/test_gpu.py -p no:cacheprovider \
    > "$out/test_gpu.log" 2>&1
tail -3 "$out/test_gpu.log"
echo "== benchmarks/runs_gpu.py"
GPUFLEET_HOME=$(mktemp -d) PYTHONPATH="$PWD/src" python benchmarks/runs_gpu.py > "$out/runs_gpu.log" 2>&1
grep -E "^(PASS|FAIL|INFO)|checks passed" "$out/runs_gpu.log"
