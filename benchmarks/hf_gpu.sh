#!/usr/bin/env bash
# The five Hugging Face fine-tuning examples of examples/hf (TRL with DDP, FSDP2 and DeepSpeed
# ZeRO-3, Unsloth, Axolotl) on 2 GPUs, each in --tiny mode (weights and data sets cannot be
# downloaded there), for a GPU machine that has torch, transformers, accelerate and peft but
# no package registry:
#
#   bash benchmarks/hf_gpu.sh wheels     # here, with a registry: fill .whl/ (about 40 MiB)
#   bash benchmarks/hf_gpu.sh            # there, from the repository root, .whl/ carried along
#
# The first fetches the missing packages as wheels for Python 3.12 on x86-64 Linux: .whl/ for
# what every example needs (TRL, datasets, DeepSpeed, bitsandbytes), .whl/unsloth/ and
# .whl/axolotl/ for each framework with the TRL release it pins (Unsloth: TRL <= 1.15;
# Axolotl 0.19, the last release for torch 2.11: TRL 1.9), installed apart so that neither pin
# changes what the others run. Two wheels are slimmed to what such a machine loads, with their
# RECORD rewritten: bitsandbytes ships a library for every CUDA and ROCm release (43 MB; only
# CUDA 13.0's is kept) and Unsloth its web UI, "studio" (29 MB; not used by FastLanguageModel).
#
# The second installs them, prints the versions, runs each example under `timeout` (all five
# within 8.5 minutes at worst) with its log in $OUT/<name>.log (OUT defaults to
# benchmarks/results/hf_gpu), and prints a table: example, exit code, wall time, final loss.
set -uo pipefail

UNSLOTH_WHEELS=.whl/unsloth
AXOLOTL_WHEELS=.whl/axolotl

PYTHON=${PYTHON:-python3}  # for `wheels`: a Python with pip and a registry

fetch() {  # fetch DIR PACKAGE==VERSION...: wheels for CPython 3.12 on x86-64 Linux
    local dir=$1; shift
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dir" "$@"
}

slim() {  # slim WHEEL PATTERN...: drop the members matching any regex, rewrite RECORD
    "$PYTHON" - "$@" <<'EOF'
import os, re, sys, zipfile
path, patterns = sys.argv[1], [re.compile(p) for p in sys.argv[2:]]
with zipfile.ZipFile(path) as old:
    keep = [i for i in old.infolist() if not any(p.search(i.filename) for p in patterns)]
    members = {i.filename: old.read(i) for i in keep}
record = next(name for name in members if name.endswith(".dist-info/RECORD"))
members[record] = "".join(line + "\n" for line in members[record].decode().splitlines()
                          if line.split(",")[0] in members).encode()
with zipfile.ZipFile(path + ".tmp", "w", zipfile.ZIP_DEFLATED) as new:
    for name, data in members.items():
        new.writestr(name, data)
os.replace(path + ".tmp", path)
EOF
}

wheels() {
    mkdir -p .whl "$UNSLOTH_WHEELS" "$AXOLOTL_WHEELS"
    # DeepSpeed (published as source only: built here, without its compiled ops) and its needs
    ls .whl/deepspeed-0.19.8-*.whl >/dev/null 2>&1 ||
        DS_BUILD_OPS=0 "$PYTHON" -m pip wheel -q --no-deps -w .whl deepspeed==0.19.8
    fetch .whl hjson==3.1.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated_types==0.8.0 \
        typing_extensions==4.16.0 typing_inspection==0.4.5
    # TRL and datasets: the versions the CPU tests use; datasets < 5 for Unsloth's sake
    fetch .whl trl==1.16.0 datasets==4.8.5 dill==0.4.1 multiprocess==0.70.19
    fetch .whl bitsandbytes==0.50.2
    slim .whl/bitsandbytes-0.50.2-*.whl 'libbitsandbytes_(cuda(?!130)\d+|rocm\d+|xpu\d+)\.so$'
    fetch "$UNSLOTH_WHEELS" unsloth==2026.10.9 unsloth_zoo==2026.10.9 trl==1.15.0
    slim "$UNSLOTH_WHEELS"/unsloth-2026.10.9-*.whl '^studio/'
    # Axolotl 0.19 and what its training path imports that the machine lacks (found by
    # running it on CPU); its contributions packages are source-only, so they are built here.
    # numba and llvmlite (56 MB), which its sample packing also needs, do not fit the carry
    # limit with the rest: on such a machine the import stops there (RESULTS.md).
    fetch "$AXOLOTL_WHEELS" axolotl==0.19.0 trl==1.9.0 kernels==0.16.2 kernels-data==0.16.2 \
        tomlkit==0.15.2 colorama==0.4.6 evaluate==0.4.1 \
        wandb==0.31.0 fastcore==2.2.41 posthog==7.91.1 distro==1.9.0 termcolor==3.3.0 \
        addict==2.4.0 platformdirs==4.14.8
    "$PYTHON" -m pip wheel -q --no-deps -w "$AXOLOTL_WHEELS" axolotl-contribs-lgpl==0.0.7 \
        axolotl-contribs-mit==0.0.6
    du -sh .whl
}

install_into() {  # install_into TARGET DIR: one pip call, so that wheels sharing a folder merge
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$1" "$2"/*.whl
}

final_loss() {  # the final loss summarize() printed, or "-"
    sed -n 's/^[0-9]* ranks (.*), .* final loss \([0-9.]*\), .*/\1/p' "$1" | tail -1 |
        grep . || echo -
}

run() {  # run NAME SECONDS SITE: one example on 2 GPUs, logged, its row of the table kept
    local name=$1 limit=$2 site=$3 status start
    start=$SECONDS
    echo "## $name: python3 examples/hf/$name.py --tiny --gpus 2 (timeout ${limit} s)"
    PYTHONPATH="$site:/tmp/site:$PWD/src" timeout -k 20 "$limit" \
        python3 "examples/hf/$name.py" --tiny --gpus 2 --output-dir "$work/$name" \
        >"$OUT/$name.log" 2>&1
    status=$?
    tail -n 4 "$OUT/$name.log"
    rows+=("$(printf '%-18s %4s %8s %10s' "$name" "$status" "$((SECONDS - start)) s" \
        "$(final_loss "$OUT/$name.log")")")
}

not_runnable() {  # not_runnable NAME REASON
    echo "## $1: not runnable: $2" | tee "$OUT/$1.log"
    rows+=("$(printf '%-18s %4s %8s %10s  not runnable: %s' "$1" - - - "$2")")
}

framework() {  # framework NAME MODULE SITE SECONDS: run it if MODULE imports, else say why
    local why status
    why=$(PYTHONPATH="$3:/tmp/site" timeout 60 python3 -c "import $2" 2>&1)
    status=$?
    if ((status == 0)); then
        run "$1" "$4" "$3"
    elif ((status == 124)); then
        not_runnable "$1" "import $2 did not finish within 60 s"
    else
        not_runnable "$1" "import $2 failed: $(tail -n 1 <<<"$why")"
    fi
}

if [[ ${1:-} == wheels ]]; then
    wheels
    exit
fi

OUT=${OUT:-benchmarks/results/hf_gpu}
mkdir -p "$OUT"
work=$(mktemp -d)
rows=()
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 GPUFLEET_HOME="$work/gpufleet"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit
install_into /tmp/site-unsloth "$UNSLOTH_WHEELS" &&
    install_into /tmp/site-axolotl "$AXOLOTL_WHEELS" || exit
export PYTHONPATH=/tmp/site:$PWD/src
{
    echo "# date: $(date -u +%FT%TZ)"
    nvidia-smi -L
    python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
    for site in /tmp/site /tmp/site-unsloth /tmp/site-axolotl; do
        PYTHONPATH="$site:/tmp/site" python3 - "$site" <<'EOF'
import importlib.metadata as md, sys
found = []
for name in ["transformers", "accelerate", "peft", "trl", "datasets", "pyarrow", "deepspeed",
             "bitsandbytes", "unsloth", "axolotl"]:
    try:
        found.append(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        pass
print(f"{sys.argv[1]}: {', '.join(found)}")
EOF
    done
    run trl_sft_ddp 60 /tmp/site
    run trl_sft_fsdp 60 /tmp/site
    run trl_sft_deepspeed 75 /tmp/site
    framework unsloth_ddp unsloth /tmp/site-unsloth 120
    framework axolotl_ddp axolotl.train /tmp/site-axolotl 90
    echo
    printf '%-18s %4s %8s %10s\n' example exit wall "final loss"
    printf '%s\n' "${rows[@]}"
} 2>&1 | tee "$OUT/hf_gpu.log"
