#!/usr/bin/env bash
# The example notebooks on a GPU machine that has torch, transformers, accelerate, peft,
# lightning and torchvision but no package registry: MLflow, nbclient and (for the TRL and
# Unsloth notebooks) TRL, datasets, DeepSpeed, bitsandbytes and Unsloth are carried as wheels.
# Each notebook runs top to bottom at the size its first cell picks there (the full size of
# the scripts; the fine-tuning notebooks' tiny model: GPUFLEET_EXAMPLE_SIZE=tiny unless set,
# since on a GPU they default to the real size, docs/real-sizes.md), one rank per GPU.
#
#   here, with a registry, wheels for CPython 3.12 on x86-64 Linux (pip download --no-deps):
#     .whl-lite/    mlflow-skinny, sqlalchemy, alembic, nbclient, nbformat, ipykernel,
#                   jupyter-client, argcomplete and what they need that the machine lacks
#     .whl-trl/     what benchmarks/hf_gpu.sh `wheels` puts in .whl/ (TRL, datasets, DeepSpeed,
#                   bitsandbytes); .whl-trl/unsloth/: its .whl/unsloth/ (Unsloth and its TRL)
#   there, from the repository root:
#     bash benchmarks/notebooks_gpu.sh TRACK...
#
# A TRACK is notebooks separated by commas, run one after the other; the tracks run at the same
# time (the GPU has room for all of them). A notebook NAME.ipynb whose folder .whl-trl/NAME/
# exists gets those wheels first on its path (Unsloth pins an older TRL). The executed notebooks
# go to $OUT (default benchmarks/results/notebooks_gpu) with log.txt: the machine, each
# notebook's log, and a table of notebook, exit code and wall time.
set -uo pipefail

OUT=${OUT:-benchmarks/results/notebooks_gpu}
LITE=${LITE:-.whl-lite}
TRL=${TRL:-.whl-trl}
LOGS=$(mktemp -d)
mkdir -p "$OUT"
python3 -m pip install -q --no-index --find-links "$LITE" argcomplete mlflow-skinny sqlalchemy \
    alembic nbclient nbformat ipykernel jupyter-client || exit
install() {  # install TARGET DIR: DIR's wheels, without their needs, into TARGET
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$1" "$2"/*.whl
}
if compgen -G "$TRL/*.whl" >/dev/null; then
    install /tmp/site "$TRL" || exit
fi
for dir in "$TRL"/*/; do
    [[ -d $dir ]] && { install "/tmp/site-$(basename "$dir")" "$dir" || exit; }
done
export GPUFLEET_EXAMPLE_SIZE=${GPUFLEET_EXAMPLE_SIZE:-tiny}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 GPUFLEET_HOME=/tmp/gpufleet \
    MLFLOW_TRACKING_URI=sqlite:////tmp/mlflow.db

track() {  # track NB,NB,...: one after the other, each copied to $OUT and timed
    local name stem start status
    for name in ${1//,/ }; do
        stem=${name%.ipynb} start=$SECONDS
        PYTHONPATH=/tmp/site-$stem:/tmp/site:$PWD/src \
            python3 examples/notebooks/run_all.py "$name" >"$LOGS/$stem.log" 2>&1
        status=$?
        cp "examples/notebooks/$name" "$OUT/"
        printf '%-28s %4s %6s s\n' "$name" "$status" "$((SECONDS - start))" >>"$LOGS/table"
    done
}

for t in "$@"; do
    track "$t" &
done
wait
{
    echo "# date: $(date -u +%FT%TZ)"
    nvidia-smi -L
    python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
    for log in "$LOGS"/*.log; do
        echo "## $(basename "$log")"
        cat "$log"
    done
    printf '\n%-28s %4s %8s\n' notebook exit wall
    cat "$LOGS/table"
} | tee "$OUT/log.txt"
