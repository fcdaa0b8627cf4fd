"""Runs supervised on a Ray cluster through Ray Jobs, on real GPUs: pass/fail lines.

    python benchmarks/ray_jobs_gpu.py            # every GPU of the machine in one Ray head

A Ray head with its dashboard is started for the run (``ray_overhead.ray_head``). Each step
runs as a separate process with a gpufleet home of its own, as separate machines would:

1. a submitter sends a detached ``remote=True`` NCCL call of every GPU (bf16 matmuls, one
   all-reduce) to the Jobs address and exits at once;
2. a reader attaches by id from another home, waits for the values, reads one rank's log,
   and ``gpufleet status`` there shows the run's GPUs as the nodes sampled them;
3. a second detached run is cancelled from a third home while its ranks hold the GPUs; no
   process of the run is left on a GPU afterwards (nvidia-smi).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from ray_overhead import ray_head  # noqa: E402  this script's neighbour

SUBMIT = """
import sys, time
from gpufleet import distributed, runtime

@distributed(remote=True, ray_address=sys.argv[1], detach=True, timeout=600)
def work(seconds):
    import torch, torch.distributed as dist
    device = runtime.setup()
    x = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    end = time.monotonic() + seconds
    steps = 0
    while time.monotonic() < end:
        x = torch.tanh(x @ x)
        steps += 1
        if steps % 50 == 0:
            print("step", steps, flush=True)
    total = torch.tensor([float(steps)], device=device)
    dist.all_reduce(total)
    return {"rank": runtime.get_global_rank(), "backend": dist.get_backend(),
            "gpu": torch.cuda.get_device_name(device), "steps": int(total.item())}

start = time.perf_counter()
run = work.submit(float(sys.argv[2]))
print(run.id)
print("submit_s", round(time.perf_counter() - start, 2))
"""

READ = """
import sys, time, gpufleet
start = time.perf_counter()
run = gpufleet.attach(sys.argv[2], ray_address=sys.argv[1])
values = run.result(timeout=600)
print("values", values)
print("status", run.status(), "read_s", round(time.perf_counter() - start, 2))
print("rank0_steps", sum(line.startswith("step") for line in run.logs(rank=0).splitlines()))
"""

CANCEL = """
import sys, time, gpufleet
run = gpufleet.attach(sys.argv[2], ray_address=sys.argv[1])
while "step 100" not in run.logs(rank=0):
    time.sleep(0.5)
start = time.perf_counter()
print("cancel", run.cancel(), "in_s", round(time.perf_counter() - start, 2))
"""


def script(folder: Path, name: str, text: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    home = folder / name
    (home / "cwd").mkdir(parents=True, exist_ok=True)
    path = home / f"{name}.py"
    path.write_text(text)
    env = {**os.environ, "GPUFLEET_HOME": str(home / "gpufleet"), "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)
    return subprocess.run([sys.executable, str(path), *args], cwd=home / "cwd", env=env,
                          capture_output=True, text=True, timeout=timeout)


def gpu_processes() -> list[str]:
    if shutil.which("nvidia-smi") is None:  # no GPU here: nothing can be left on one
        return []
    found = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,process_name", "--format=csv,noheader"],
                           capture_output=True, text=True).stdout
    return [line for line in found.splitlines() if line.strip()]


def check(name: str, ok: bool, detail: str) -> bool:
    print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}", flush=True)
    return ok


def main() -> int:
    import torch

    gpus = torch.cuda.device_count()
    folder = Path(tempfile.mkdtemp(prefix="ray-jobs-gpu-"))
    results = []
    with ray_head(max(gpus, 1)) as (address, head_home, note):
        print(f"head: {address} ({note}); {gpus} GPU(s): "
              f"{', '.join(torch.cuda.get_device_name(i) for i in range(gpus))}", flush=True)
        if address is None:
            return int(not check("Ray head with its dashboard", False, note))
        submitted = script(folder, "laptop", SUBMIT, address, "20")
        ok = submitted.returncode == 0
        results.append(check("submit and exit", ok, submitted.stdout.strip().replace("\n", "; ")
                             if ok else submitted.stderr[-600:]))
        if not ok:
            return 1
        run_id = submitted.stdout.split()[0]
        read = script(folder, "desk", READ, address, run_id)
        out = read.stdout
        values = json.loads(out.split("values ", 1)[1].splitlines()[0].replace("'", '"')) if "values " in out else []
        results.append(check(
            "re-attached from another home after the submitter exited",
            read.returncode == 0 and "status succeeded" in out and len(values) == max(gpus, 1)
            and all(v["backend"] == "nccl" for v in values),
            out.strip().replace("\n", "; ") if read.returncode == 0 else read.stderr[-600:]))
        status = subprocess.run([sys.executable, "-m", "gpufleet", "status", run_id],
                                env={**os.environ, "GPUFLEET_HOME": str(folder / "desk" / "gpufleet")},
                                capture_output=True, text=True, timeout=120)
        gpu_line = [line for line in status.stdout.splitlines() if line.startswith("gpu use:")]
        results.append(check("gpufleet status shows the run's GPUs from the nodes' samples",
                             bool(gpu_line), gpu_line[0] if gpu_line else status.stdout[-400:]))
        second = script(folder, "laptop", SUBMIT, address, "300")
        second_id = second.stdout.split()[0]
        cancelled = script(folder, "phone", CANCEL, address, second_id)
        deadline = time.monotonic() + 30
        while gpu_processes() and time.monotonic() < deadline:
            time.sleep(0.5)
        left = gpu_processes()
        results.append(check("cancel from a third home frees every GPU",
                             "cancel cancelled" in cancelled.stdout and not left,
                             f"{cancelled.stdout.strip()}; on the GPUs after: {left or 'nothing'}"))
        record = head_home / "runs" / second_id / "record.json"
        if record.exists():
            print("head's record of the cancelled run:", json.loads(record.read_text())["status"])
    print(f"{sum(results)} of {len(results)} passed")
    return int(not all(results))


if __name__ == "__main__":
    sys.exit(main())
