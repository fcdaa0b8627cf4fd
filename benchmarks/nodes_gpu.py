"""Node runs on GPUs with NCCL: what one machine shows (two machines need 2 GPUs).

    python benchmarks/nodes_gpu.py --out benchmarks/results/nodes-1xH200-DATE.md

Every step is `gpufleet run` with the node flags, as a user types it on each machine:

1. 1 machine, `--nnodes 1 --rdzv-endpoint 127.0.0.1:PORT`: the node launcher's path (the store
   served by gpufleet, elastic's c10d rendezvous, round.json) with NCCL; an FSDP2 model trains
   and saves with the Checkpointer.
2. The same run again with `--nnodes 1:2` (elastic) resumes from the last step.
3. With GPUs enough (`--machines 2`, one GPU each): two machines on this host,
   `--nnodes 1:2`; machine 2 is killed mid-run; machine 1 goes on alone at world size 1 and
   resumes the FSDP state resharded from its last step.
4. A rank that raises: the error names its rank and machine (exit 1).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GPUFLEET = [sys.executable, "-m", "gpufleet"]
JOB = """
import os, sys, time
import torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from gpufleet import runtime
from gpufleet.checkpoint import Checkpointer

device = runtime.setup()
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)).to(device)
for layer in model:
    if isinstance(layer, torch.nn.Linear):
        fully_shard(layer)
fully_shard(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
steps = int(os.environ.get("STEPS", "20"))
with Checkpointer(sys.argv[1], async_save=False) as ckpt:
    start = ckpt.restore(model, opt)
    print(f"backend {dist.get_backend()} world {world} resumed at {start} "
          f"node {os.environ['NODE_RANK']} of run {os.environ['TORCHELASTIC_RUN_ID']}", flush=True)
    for step in range(start, steps):
        x = torch.randn(64, 256, device=device, generator=torch.Generator(device).manual_seed(step))
        loss = (model(x) - x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        ckpt.save(step + 1, model, opt)
        if rank == 0:
            print(f"step {step + 1} world {world} loss {loss.item():.4f}", flush=True)
        if os.environ.get("FAIL_AT") == str(step + 1) and rank == world - 1:
            raise ValueError(f"bad batch at step {step + 1}")
        time.sleep(float(os.environ.get("PAUSE", "0")))
"""


def run(argv: list[str], env: dict, cwd: Path, timeout: float = 300) -> tuple[int, str, float]:
    start = time.monotonic()
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    return done.returncode, done.stdout + done.stderr, time.monotonic() - start


def node_argv(nnodes: str, port: int, rank: int, *rest: str) -> list[str]:
    return [*GPUFLEET, "run", "--nnodes", nnodes, "--node-rank", str(rank), "--rdzv-endpoint",
            f"127.0.0.1:{port}", "--nproc-per-node", "1", "--no-tracking", *rest]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--machines", type=int, default=1)
    args = parser.parse_args()
    rows, logs = [], []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "job.py").write_text(JOB)
        env = {**os.environ, "GPUFLEET_HOME": str(folder / "home"), "PYTHONUNBUFFERED": "1"}

        code, text, took = run(node_argv("1", 29501, 0, "job.py", "ckpt"), env, folder)
        rows.append(("1 machine, --nnodes 1, FSDP2 + Checkpointer (NCCL)", code, took,
                     _found(text, r"backend \w+ world \d+ resumed at \d+")))
        logs.append(text)
        code, text, took = run(node_argv("1:2", 29502, 0, "job.py", "ckpt"),
                               {**env, "STEPS": "30"}, folder)
        rows.append(("the same, --nnodes 1:2, resumes", code, took, _found(text, r"world \d+ resumed at \d+")))
        logs.append(text)
        if args.machines >= 2:
            rows.append(_two_machines(folder, env, logs))
        code, text, took = run(node_argv("1", 29504, 0, "job.py", "ckpt-fail"), {**env, "FAIL_AT": "3"}, folder)
        rows.append(("a rank raises at step 3", code, took, _found(text, r"root cause: .*")))
        logs.append(text)
    table = ["| step | exit | seconds | what it printed |", "|---|---|---|---|"]
    table += [f"| {what} | {code} | {took:.1f} | `{found}` |" for what, code, took, found in rows]
    import torch

    gpus = (f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, NCCL "
            f"{'.'.join(map(str, torch.cuda.nccl.version()))}" if torch.cuda.is_available() else "no GPU (gloo)")
    header = (f"# Node runs on GPUs\n\n{datetime.date.today()}, {platform.node()}, {gpus}, "
              f"torch {torch.__version__}; "
              f"`python benchmarks/nodes_gpu.py --machines {args.machines}`\n\n")
    text = header + "\n".join(table) + "\n"
    print(text)
    print("\n\n".join(logs))
    if args.out:
        args.out.write_text(text + "\n## Output\n\n```\n" + "\n\n".join(logs)[-20000:] + "\n```\n")


def _two_machines(folder: Path, env: dict, logs: list) -> tuple:
    """Two machines on this host, one GPU each; machine 2 is killed at step 10."""
    outs = [folder / "m0.out", folder / "m1.out"]
    procs = []
    for rank in (0, 1):
        menv = {**env, "CUDA_VISIBLE_DEVICES": str(rank), "STEPS": "40", "PAUSE": "0.2",
                "GPUFLEET_HOME": str(folder / f"home{rank}")}
        with open(outs[rank], "wb") as out:
            procs.append(subprocess.Popen(node_argv("1:2", 29503, rank, "job.py", "ckpt2"), cwd=folder,
                                          env=menv, stdout=out, stderr=subprocess.STDOUT,
                                          start_new_session=True))
    start = time.monotonic()
    while "step 10 world 2" not in outs[0].read_text(errors="replace"):
        if procs[0].poll() is not None or time.monotonic() - start > 240:
            break
        time.sleep(0.1)
    os.killpg(procs[1].pid, 9)  # the machine died: its gpufleet, agent and ranks
    code = procs[0].wait(300)
    text = outs[0].read_text(errors="replace")
    logs.append(text)
    return ("2 machines x 1 GPU, --nnodes 1:2, machine 2 killed at step 10", code, time.monotonic() - start,
            _found(text, r"world 1 resumed at \d+"))


def _found(text: str, pattern: str) -> str:
    match = re.findall(pattern, text)
    return match[-1] if match else "(not found)"


if __name__ == "__main__":
    main()
