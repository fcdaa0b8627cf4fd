"""Step telemetry on GPUs, end to end: what a user sees, and that it is right.

    python benchmarks/steps_gpu.py                 # every GPU of the machine
    python benchmarks/steps_gpu.py --gpus 2 --slow-ms 40
    python benchmarks/steps_gpu.py --strategy zero3   # DeepSpeed's trainer (pip install deepspeed)

One call trains a small decoder (``models.py``, 124M config, shorter sequences) with
``gpufleet.strategies`` (``--strategy``, default "fsdp") from a ``gpufleet.data`` loader over token files written
here, with no telemetry code in the loop. With two or more GPUs, the last rank sleeps
``--slow-ms`` before each forward pass, as a throttled GPU or a slow host would make it late.
The script prints the call's own per-rank summary (the table gpufleet prints at the end), then
checks what the run folder holds:

- every rank counted every optimizer step, and the loader's samples;
- the arrival was timed on the GPU (CUDA events: ``arrive_s`` in the window lines);
- GPU memory is reported, and the GPU named as the host names it;
- with several GPUs: the slow rank is the straggler, late by about ``--slow-ms``;
- ``gpufleet status --json`` says the same.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from models import CONFIGS, Decoder  # noqa: E402

from gpufleet import distributed, runtime  # noqa: E402


@distributed(timeout=900)
def train(folder: str, steps: int, slow_ms: float, config_name: str, strategy: str) -> dict:
    import dataclasses
    import time

    import torch

    from gpufleet import data, strategies

    config = dataclasses.replace(CONFIGS[config_name], seq=256, batch=8)
    device = runtime.setup()
    dataset = data.FileDataset(f"{folder}/tokens-*.pt", transform=torch.load)
    loader = data.loader(dataset, batch_size=config.batch, num_workers=2)
    prepared = strategies.prepare(Decoder(config), lambda p: torch.optim.AdamW(p, lr=3e-4), strategy)
    slow = runtime.get_world_size() > 1 and runtime.get_global_rank() == runtime.get_world_size() - 1
    epoch = 0
    while prepared.optimizer_steps < steps:
        dataset.set_epoch(epoch)
        for tokens in loader:
            if prepared.optimizer_steps >= steps:
                break
            if slow:
                if device.type == "cuda":
                    torch.cuda.synchronize()  # the GPU is as late as the host
                time.sleep(slow_ms / 1000)
            tokens = tokens.to(device, non_blocking=True)
            logits = prepared.model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
            prepared.backward(loss)
            prepared.step()
        epoch += 1
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    return {"steps": prepared.optimizer_steps, "gpu": gpu}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=None)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--slow-ms", type=float, default=40.0)
    parser.add_argument("--config", default="124m", choices=sorted(CONFIGS), help="tiny: a CPU smoke test")
    parser.add_argument("--strategy", default="fsdp", choices=["ddp", "fsdp", "zero2", "zero3"])
    args = parser.parse_args()

    config = CONFIGS[args.config]
    with tempfile.TemporaryDirectory() as folder:
        import torch

        for i in range(256):  # one sample per file, as a tokenised shard of one document would be
            torch.save(torch.randint(0, config.vocab, (257,)), f"{folder}/tokens-{i:04d}.pt")
        fn = train.options(gpus=args.gpus)
        values = fn.distributed(folder, args.steps, args.slow_ms, args.config, args.strategy)
        attempt = fn.last_run
    world = len(values)
    summary = json.loads((attempt / "steps.json").read_text())
    windows = [json.loads(line) for path in sorted((attempt / "steps").glob("rank-*.jsonl"))
               for line in path.read_text().splitlines()]
    shown = subprocess.run([sys.executable, "-m", "gpufleet", "status", "--json", attempt.parent.name],
                           capture_output=True, text=True)
    if shown.returncode != 0:
        print(f"gpufleet status --json exited {shown.returncode}:\n{shown.stderr}")
    status = json.loads(shown.stdout)["steps"] if shown.returncode == 0 else {"step": None, "straggler": None}

    checks = {
        "every rank counted every optimizer step": all(r["steps"] == args.steps for r in summary["ranks"]),
        "the loader counted its samples": all(r["samples"] == args.steps * 8 for r in summary["ranks"]),
        "forward and backward marks timed (CUDA events on a GPU)": all(
            w.get("forward_s") is not None and w.get("arrive_s") is not None for w in windows),
        "GPU memory reported": all(r.get("gpu_memory_peak_bytes") for r in summary["ranks"]),
        "the GPU named": all(r.get("gpu") is not None for r in summary["ranks"]),
        "gpufleet status agrees": status["step"] == args.steps,
    }
    if world > 1:
        slow = world - 1
        late = {r["rank"]: r.get("late_s") for r in summary["ranks"]}
        checks[f"rank {slow} is the straggler"] = summary["straggler"] == slow
        checks[f"late by about {args.slow_ms:g} ms"] = abs(late[slow] * 1000 - args.slow_ms) < args.slow_ms / 2
        checks["gpufleet status names it"] = (status["straggler"] or {}).get("rank") == slow
    print(f"\n{world} x {values[0]['gpu']}, {args.strategy}, {args.steps} steps; run folder {attempt}")
    for row in summary["ranks"]:
        peak = row.get("gpu_memory_peak_bytes")
        print(f"  rank {row['rank']}: median step {row['median_step_s'] * 1000:.1f} ms, forward pass "
              f"at {row['median_forward_s'] * 1000:.1f} ms, backward at {row['median_arrive_s'] * 1000:.1f} ms, "
              f"input wait {row['input_wait_share']:.1%}, late {1000 * (row.get('late_s') or 0):+.1f} ms, "
              f"peak GPU memory {f'{peak / 2**30:.2f} GiB' if peak else '-'}, GPU {row['gpu']}")
    for name, ok in checks.items():
        print(f"  {'ok  ' if ok else 'FAIL'} {name}")
    if world == 1:
        print("  (one GPU: no straggler to name; run with two or more GPUs for that part)")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
