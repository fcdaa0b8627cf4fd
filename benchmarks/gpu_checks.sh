#!/usr/bin/env bash
# Every GPU code path in one go, for a GPU machine whose image already has torch, pytest and
# accelerate:  bash benchmarks/gpu_checks.sh OUT_DIR
# Writes gpu_checks.log and launch_overhead.md into OUT_DIR.
set -uo pipefail
out=${1:-benchmarks/results}
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export GPUFLEET_HOME=$(mktemp -d)
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
{
    echo "# date: $(date -u +%FT%TZ)"
    nvidia-smi -L
    python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())"
    for step in "python3 examples/hello_world.py" "python3 examples/mlp_ddp.py" \
                "python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py"; do
        echo "## $step"
        SECONDS=0
        $step; status=$?
        echo "## exit $status in ${SECONDS} s"
    done
} 2>&1 | tee "$out/gpu_checks.log"
python3 benchmarks/launch_overhead.py --nprocs "$gpus" --reps 5 --out "$out/launch_overhead.md"
