#!/usr/bin/env bash
# The adoption wave on a GPU machine: the option surface (torchrun's flags, durations, a config
# file default), the package's version, psutil's host numbers and NVML's GPU numbers in a
# run's telemetry, and gpufleet's messages through its logger. One NCCL script, one decorated
# call; prints a short table. Run from the repository root with gpufleet importable
# (PYTHONPATH=src) and argcomplete installed:
#   bash benchmarks/adoption_gpu.sh
set -uo pipefail
export GPUFLEET_HOME=${GPUFLEET_HOME:-$(mktemp -d)} PYTHONUNBUFFERED=1
work=$(mktemp -d)
cat > "$work/nccl_hello.py" <<'PY'
import os
import torch
import torch.distributed as dist

dist.init_process_group("nccl")
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
x = torch.ones(1, device="cuda") * (dist.get_rank() + 1)
dist.all_reduce(x)
print(f"backend {dist.get_backend()} world {dist.get_world_size()} sum {x.item():.0f} "
      f"on {torch.cuda.get_device_name()}")
import time; time.sleep(7)  # long enough for two telemetry samples
dist.destroy_process_group()
PY
printf 'timeout: 5m\nlogs: rank0\n' > "$GPUFLEET_HOME/config.yaml"

row() { printf '%-58s %s\n' "$1" "$2"; }
echo "== gpufleet $(python -m gpufleet --version) on $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), torch $(python -c 'import torch; print(torch.__version__)'), Python $(python -V | cut -d' ' -f2)"
start=$(date +%s.%N)
python -m gpufleet run --standalone --nnodes 1 --nproc_per_node=auto --max-restarts 0 \
    --hang-timeout 10m --no-tracking "$work/nccl_hello.py" > "$work/run.out" 2> "$work/run.err"
rc=$?
took=$(python -c "import time; print(f'{time.time() - $start:.1f}')")
cat "$work/run.out"; sed 's/^/  stderr: /' "$work/run.err"
row "gpufleet run --nproc_per_node=auto (torchrun flags), exit" "$rc ($took s)"
id=$(python -m gpufleet runs --json | python -c "import json,sys; print(json.load(sys.stdin)[0]['id'])")
python -m gpufleet status "$id" --json > "$work/status.json"
python - "$work/status.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
gpus = s.get("gpu_telemetry") or []
print(f"{'status, devices':58} {s['status']}, {s['devices']}")
print(f"{'NVML telemetry of the run GPU (util %, mem GiB, W)':58} "
      + "; ".join(f"{g.get('name')}: {g.get('utilization_percent')}%, "
                  f"{round(g.get('memory_used_bytes', 0) / 2**30, 2)} GiB, {g.get('power_watts')} W" for g in gpus))
PY
python - <<'PY'
import glob, json, os
home = os.environ["GPUFLEET_HOME"]
lines = [json.loads(l) for f in glob.glob(f"{home}/runs/*/attempt-0/telemetry.jsonl") for l in open(f)]
host = [(l.get("cpu_percent"), round(l.get("memory_used_bytes", 0) / 2**30, 1)) for l in lines]
print(f"{'host samples through psutil (cpu %, memory used)':58} {len(lines)} samples, last {host[-1] if host else None}")
PY
python - <<'PY'
from gpufleet import distributed, runtime

@distributed(timeout="3m", hang_timeout="10m", tracking=False)
def device_name():
    import torch
    device = runtime.setup()
    return (str(device), torch.cuda.get_device_name(device), runtime.get_world_size())

label = '@distributed(timeout="3m") on every GPU'
print(f"{label:58} {device_name.distributed()}")
print(f"{'config.yaml logs default reached the decorator':58} logs={device_name.run_options.logs!r}")
PY
