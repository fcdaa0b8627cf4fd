"""How fast gpufleet notices each kind of failure, and how fast a retried run trains again.

    python benchmarks/fault_recovery.py                  # every GPU (2 gloo processes on CPU)
    python benchmarks/fault_recovery.py --trials 5 --out benchmarks/results/fault_recovery-cpu.md

Detection: rank 1 writes the time, then fails (raises, exits, is killed, segfaults, runs out of
host memory, or goes silent while rank 0 waits in an all_reduce); the time until
``.distributed()`` raises in the caller is the detection time. For a hang it is counted from
rank 1's last output, so it includes ``hang_timeout``.

Recovery: a run with ``max_retries=1`` checkpoints every 5 steps; rank 1 crashes at step 12 of
the first attempt. Recovery time runs from the crash to the first step trained by the second
attempt; that attempt must start at step 10 (the last committed one) and the steps trained
across both attempts must be 0…11 then 10…19: none skipped, none repeated beyond the
uncommitted ones. The final weights must equal an uninterrupted run's.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpufleet import RunFailedError, distributed, runtime

HANG_TIMEOUT = 10.0  # above the slowest silent start-up (a cold `import torch` on a GPU host)
FAULTS = ("exception", "os._exit", "SIGKILL", "SIGSEGV", "host-oom", "hang")


@distributed(logs="none", hang_timeout=HANG_TIMEOUT)
def fail(how: str, stamp: str) -> None:
    import ctypes
    import resource
    import signal

    import torch
    import torch.distributed as dist

    device = runtime.setup(timeout=120)
    dist.barrier()
    if runtime.get_global_rank() == 1:
        if how == "host-oom":  # a memory limit, as a container would set
            size = int(Path("/proc/self/status").read_text().split("VmSize:")[1].split()[0]) * 1024
            resource.setrlimit(resource.RLIMIT_AS, (size + (256 << 20),) * 2)
        print("failing now", flush=True)
        Path(stamp).write_text(repr(time.time()))
        if how == "exception":
            raise RuntimeError("injected")
        if how == "os._exit":
            os._exit(3)
        if how == "SIGKILL":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "SIGSEGV":
            ctypes.string_at(0)
        if how == "host-oom":
            torch.empty(8 << 30, dtype=torch.uint8)
        if how == "hang":
            time.sleep(600)
    dist.all_reduce(torch.ones(1, device=device))  # rank 0 waits for rank 1 here


def detect(how: str, gpus: int | None, errors: Path | None) -> tuple[float, str]:
    with tempfile.TemporaryDirectory() as tmp:
        stamp = f"{tmp}/stamp"
        try:
            fail.options(gpus=gpus).distributed(how, stamp)
        except RunFailedError as error:
            caught = time.time()
            root = error.failures[0]
            if errors:
                (errors / f"{how}.txt").write_text(f"{type(error).__name__}: {error}\n")
            return caught - float(Path(stamp).read_text()), f"rank {root.rank} {root.kind}"
    raise AssertionError(f"{how}: the run did not fail")


@distributed(logs="none", max_retries=1)
def resumable(root: str, steps: int, crash_at: int, stamps: str) -> dict:
    import torch

    from gpufleet import strategies
    from gpufleet.checkpoint import Checkpointer

    runtime.setup()
    torch.manual_seed(0)
    trainer = strategies.prepare(
        torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)),
        lambda params: torch.optim.AdamW(params, lr=1e-2),
        "ddp",
    )
    ckpt = Checkpointer(root, keep=2)
    start = ckpt.restore(trainer)
    rank, attempt = runtime.get_global_rank(), runtime.get_attempt()
    trained = []
    for step in range(start, steps):
        g = torch.Generator().manual_seed(step * 10 + rank)
        x = torch.randn(16, 32, generator=g)
        loss = (trainer.model(x.to(trainer.device)) - x[:, :1].to(trainer.device)).pow(2).mean()
        trainer.backward(loss)
        trainer.step()
        trained.append(step)
        if step == start and attempt == 1 and rank == 0:
            Path(stamps, "resumed").write_text(repr(time.time()))
        if (step + 1) % 5 == 0:
            ckpt.save(step + 1, trainer)
            ckpt.wait()
        if step == crash_at and attempt == 0 and rank == 1:
            Path(stamps, "crashed").write_text(repr(time.time()))
            os._exit(7)
    Path(stamps, f"trained-{attempt}-{rank}").write_text(",".join(map(str, trained)))
    return {"start": start, "weights": trainer.full_state_dict()}


def recover(gpus: int | None) -> tuple[float, str]:
    with tempfile.TemporaryDirectory() as tmp:
        whole = resumable.options(gpus=gpus, max_retries=0).distributed(f"{tmp}/a", 20, -1, tmp)[0]
        Path(tmp, "trained-0-0").unlink()
        resumed = resumable.options(gpus=gpus).distributed(f"{tmp}/b", 20, 12, tmp)[0]
        seconds = float(Path(tmp, "resumed").read_text()) - float(Path(tmp, "crashed").read_text())
        steps = Path(tmp, "trained-1-0").read_text()
        equal = all(bool((whole["weights"][k] == resumed["weights"][k]).all()) for k in whole["weights"])
        check = f"attempt 2 from step {resumed['start']}: {steps.split(',')[0]}…{steps.split(',')[-1]}; weights {'equal' if equal else 'DIFFER'}"
        return seconds, check


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--gpus", type=int, default=None)
    parser.add_argument("--faults", default=",".join(FAULTS) + ",recovery")
    parser.add_argument("--out", type=Path, default=None, help="write the table here (markdown)")
    parser.add_argument("--errors", type=Path, default=None, help="write each fault's error text here")
    args = parser.parse_args()
    if args.errors:
        args.errors.mkdir(parents=True, exist_ok=True)
    rows = []
    for how in args.faults.split(","):
        times, notes = [], set()
        for _ in range(args.trials):
            seconds, note = recover(args.gpus) if how == "recovery" else detect(how, args.gpus, args.errors)
            times.append(seconds)
            notes.add(note)
            print(f"{how:<10} {seconds:6.2f} s  {note}", flush=True)
        rows.append(
            f"| {how} | {statistics.median(times):.2f} | {max(times):.2f} | {'; '.join(sorted(notes))} |"
        )
    lines = [
        "# Fault detection and recovery",
        "",
        f"- date: {time.strftime('%Y-%m-%d')}; host: {platform.node()}, {os.cpu_count()} cores",
        f"- devices: {_devices()}",
        f"- command: python benchmarks/fault_recovery.py {' '.join(sys.argv[1:])}",
        f"- {args.trials} trials per row; hang_timeout={HANG_TIMEOUT:g} s (the hang row includes it)",
        "",
        "| fault | median s | max s | reported as / checked |",
        "|---|---|---|---|",
        *rows,
    ]
    print("\n".join(lines))
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


def _devices() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
        return "; ".join(out.stdout.strip().splitlines()) or "CPU (gloo)"
    except (OSError, subprocess.SubprocessError):
        return "CPU (gloo)"


if __name__ == "__main__":
    main()
