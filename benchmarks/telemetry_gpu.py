"""GPU check of gpufleet's telemetry: a 1-GPU NCCL call doing bf16 matmuls is sampled on its
node, for the GPU it holds only. Needs no MLflow: the samples are read from the run folder's
``telemetry.jsonl``, which is what the caller logs into MLflow when MLflow is installed.

    python benchmarks/telemetry_gpu.py              # on a machine with 1 GPU or more
    python benchmarks/telemetry_gpu.py --seconds 30

On a machine with several GPUs the call is given the last one (CUDA_VISIBLE_DEVICES as an
index), so the table shows that NVML's index follows CUDA_VISIBLE_DEVICES and that the other
GPUs were not sampled; a second, short call names the same GPU by a prefix of its UUID. Prints
the samples, the line the live status line and `gpufleet status` show, what one sample costs,
and PASS/FAIL lines; exits non-zero if a check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import pynvml

pynvml.nvmlInit()
GPUS = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else value


UUIDS = [_text(pynvml.nvmlDeviceGetUUID(h)) for h in GPUS]
NAMES = [_text(pynvml.nvmlDeviceGetName(h)) for h in GPUS]
TARGET = len(GPUS) - 1  # the last GPU: on several GPUs, not the one a default would pick
# before torch is imported: the run's devices are taken from this process's visible ones
os.environ["CUDA_VISIBLE_DEVICES"] = str(TARGET)
HERE = Path(tempfile.mkdtemp(prefix="gpufleet-telemetry-gpu-"))
os.environ["GPUFLEET_HOME"] = str(HERE / "home")

from gpufleet import distributed, runtime, telemetry

checks: list[bool] = []


def check(name: str, ok: bool, detail: str = "") -> None:
    checks.append(ok)
    print(f"{'PASS' if ok else 'FAIL'}  {name}  {detail}", flush=True)


def matmuls(seconds: float) -> dict:
    """Real work for the GPU: 8192² bf16 matmuls, then one NCCL all-reduce."""
    import torch
    import torch.distributed as dist

    device = runtime.setup()
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    done, end = 0, time.time() + seconds
    while time.time() < end:
        for _ in range(20):
            a = torch.nn.functional.normalize(a @ a, dim=-1)
        torch.cuda.synchronize()
        done += 20
    total = torch.tensor([float(done)], device=device)
    dist.all_reduce(total)
    return {"matmuls": int(total.item()), "backend": dist.get_backend(),
            "visible": os.environ.get("CUDA_VISIBLE_DEVICES")}


def samples_of(run_folder: Path) -> list[dict]:
    return [json.loads(line) for line in (run_folder / "telemetry.jsonl").read_text().splitlines()]


def table(samples: list[dict], began: float) -> None:
    print(f"{'t (s)':>6} {'node':>4} {'host':<16} {'GPU':>3} {'util %':>6} {'memory GiB':>14} "
          f"{'power W':>8} {'temp C':>6} {'host CPU %':>10}")
    for s in samples:
        for g in s["gpus"] or [{}]:
            memory = (f"{g['memory_used_bytes'] / 2**30:.1f}/{g['memory_total_bytes'] / 2**30:.0f}"
                      if "memory_used_bytes" in g else "-")
            print(f"{s['time'] - began:6.1f} {s['node']:>4} {s['host'][:16]:<16} {g.get('index', '-'):>3} "
                  f"{g.get('utilization_percent', '-'):>6} {memory:>14} "
                  f"{_number(g.get('power_watts')):>8} {g.get('temperature_c', '-'):>6} "
                  f"{s.get('cpu_percent', '-'):>10}")


def _number(value) -> str:
    return "-" if value is None else f"{value:.0f}"


def run_call(seconds: float) -> tuple[dict, list[dict], float]:
    fn = distributed(gpus=1, tracking=False, runs_dir=HERE / "runs")(matmuls)
    began = time.time()
    result = fn.distributed(seconds)[0]
    return result, samples_of(fn.last_run), began


def sample_cost(held: list[tuple[int, int]]) -> float:
    """Milliseconds one sample takes (host and the held GPU), as the node's sampler takes it."""
    telemetry.prepare()
    sampler = telemetry.Sampler(HERE / "cost.jsonl", 0, True, 1, str(TARGET))
    last = telemetry.cpu_times()
    started = time.perf_counter()
    for _ in range(20):
        _, last = sampler.sample(last, held)
    return (time.perf_counter() - started) / 20 * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=15.0, help="how long the call multiplies")
    args = parser.parse_args()
    print(f"{len(GPUS)} GPU(s) on this machine: " + ", ".join(f"{i} {n}" for i, n in enumerate(NAMES)))
    print(f"the call holds GPU {TARGET} (CUDA_VISIBLE_DEVICES={TARGET})\n")

    result, samples, began = run_call(args.seconds)
    table(samples, began)
    sampled = {g["index"] for s in samples for g in s["gpus"]}
    busy = [g.get("utilization_percent", 0) for s in samples for g in s["gpus"]]
    check("the call ran on NCCL", "nccl" in str(result["backend"]), f"{result['matmuls']} matmuls")
    check("samples every few seconds while it ran",
          len(samples) >= max(2, int(args.seconds // telemetry.SAMPLE_EVERY_S)), f"{len(samples)} samples")
    check("only the held GPU was sampled", sampled == {TARGET}, f"sampled {sorted(sampled)}")
    if len(GPUS) == 1:
        print("      (one GPU on this machine: no other GPU to leave out)")
    for other in range(len(GPUS)):
        if other != TARGET:
            print(f"      GPU {other} ({NAMES[other]}): not sampled"
                  + ("" if other not in sampled else "  <- WRONG"))
    check("the GPU was seen busy", max(busy, default=0) >= 50, f"utilisation up to {max(busy, default=0)}%")
    read = [g for s in samples for g in s["gpus"]]
    check("memory, power and temperature were read",
          bool(read) and all({"memory_used_bytes", "power_watts", "temperature_c"} <= set(g) for g in read))
    last = {s["node"]: s for s in samples}
    print(f"\nthe status line and `gpufleet status` show: {telemetry.describe_gpus(last)}")

    prefix = UUIDS[TARGET][:12]  # CUDA takes a unique prefix of the UUID
    os.environ["CUDA_VISIBLE_DEVICES"] = prefix
    result, samples, _ = run_call(3.0)
    sampled = {g["index"] for s in samples for g in s["gpus"]}
    check("CUDA_VISIBLE_DEVICES as a UUID prefix maps to the same NVML device",
          sampled == {TARGET} and result["visible"] == prefix, f"{prefix} -> {sorted(sampled)}")

    cost = sample_cost([(0, TARGET)])
    print(f"\none sample (host + 1 GPU) takes {cost:.2f} ms; the sampler takes one every "
          f"{telemetry.SAMPLE_EVERY_S:g} s in the node's first rank")
    print(f"\n{sum(checks)} of {len(checks)} checks passed")
    return 0 if all(checks) else 1


if __name__ == "__main__":
    sys.exit(main())
