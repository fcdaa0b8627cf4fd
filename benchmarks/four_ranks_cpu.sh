#!/usr/bin/env bash
# Four ranks on a machine without GPUs (gloo): the correctness part of the 4-GPU runs, for
# when no 4-GPU machine is at hand.   bash benchmarks/four_ranks_cpu.sh OUT_DIR
set -uo pipefail
out=${1:-benchmarks/results}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 GPUFLEET_HOME=$(mktemp -d)
log="$out/four_ranks-cpu-$(date -u +%F).log"
{
    echo "# date: $(date -u +%FT%TZ)"
    echo "# hardware: $(nproc) CPU cores, no GPU; $(python -c 'import platform, torch; print(platform.platform(), "torch", torch.__version__)')"
    for step in "python examples/hello_world.py --gpus 4" \
                "python examples/mlp_ddp.py --gpus 4" \
                "python examples/transformer_fsdp.py --small --gpus 4" \
                "python benchmarks/launch_overhead.py --nprocs 4 --reps 5 --launchers gpufleet,gpufleet-warm,torchrun,mp.spawn --out $out/launch_overhead-4-cpu-$(date -u +%F).md"; do
        echo "## $step"
        SECONDS=0
        $step; status=$?
        echo "## exit $status in ${SECONDS} s"
    done
} 2>&1 | tee "$log"
