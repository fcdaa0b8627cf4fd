"""Launch overhead: wall time from call to results of a trivial distributed job.

    python benchmarks/launch_overhead.py                   # 2 processes, 5 repetitions
    python benchmarks/launch_overhead.py --nprocs 2 --reps 7 --out benchmarks/results/x.md

The job: every process initialises a process group (NCCL on GPUs, gloo on CPU), does one
all-reduce, and returns. Each launcher is timed in a fresh interpreter that has already imported
torch, as a notebook user would call it: gpufleet's `.distributed()`, `torchrun` run as a
command, `torch.multiprocessing.spawn`, and accelerate's `notebook_launcher` (fork). The table
shows medians and the ratio to torchrun.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time

LAUNCHERS = ("gpufleet", "torchrun", "mp.spawn", "notebook_launcher")


def job() -> float:
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else None
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device)
    value = torch.ones(1, device=device or "cpu")
    dist.all_reduce(value)
    result = value.item()
    dist.destroy_process_group()
    return result


def _spawn_entry(local_rank: int, nprocs: int, port: int) -> None:
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(nprocs),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    job()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_once(launcher: str, nprocs: int) -> dict | None:
    """One call; for gpufleet, the phases of its run (gpufleet.timings)."""
    if launcher == "gpufleet":
        from gpufleet import distributed
        from gpufleet.timings import Timings

        fn = distributed(gpus=nprocs, logs="none")(job)
        values = fn.distributed()
        assert values == [float(nprocs)] * nprocs, values
        return dict(Timings.read(fn.last_run).phases())
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nprocs}", __file__, "--torchrun-job"]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    elif launcher == "mp.spawn":
        import torch.multiprocessing as mp

        mp.spawn(_spawn_entry, args=(nprocs, _free_port()), nprocs=nprocs, join=True)
    elif launcher == "notebook_launcher":
        from accelerate import notebook_launcher

        notebook_launcher(job, num_processes=nprocs)
    return None


def child(launcher: str, nprocs: int, reps: int) -> None:
    """Time ``reps`` calls in this (fresh) interpreter; print the times as JSON."""
    import torch  # noqa: F401  - imported before timing, as in a notebook

    times, phases = [], []
    for _ in range(reps):
        start = time.perf_counter()
        phases.append(run_once(launcher, nprocs))
        times.append(time.perf_counter() - start)
    print(json.dumps({"times": times, "phases": [p for p in phases if p]}))


def measure(launcher: str, nprocs: int, reps: int) -> tuple[list[float], list[dict]] | str:
    cmd = [sys.executable, __file__, "--child", launcher, f"--nprocs={nprocs}", f"--reps={reps}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return (proc.stderr.strip().splitlines() or ["failed"])[-1][:120]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    return found["times"], found["phases"]


def hardware() -> str:
    import torch

    if torch.cuda.is_available():
        names = {torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())}
        gpus = f"{torch.cuda.device_count()} × {', '.join(names)}"
    else:
        gpus = "no GPU (gloo on CPU)"
    return (f"{gpus}; {os.cpu_count()} CPU cores; {platform.platform()}; "
            f"Python {platform.python_version()}; torch {torch.__version__}")


def report(nprocs: int, reps: int, launchers: list[str]) -> str:
    rows, medians, phases = [], {}, []
    for launcher in launchers:
        measured = measure(launcher, nprocs, reps)
        if isinstance(measured, str):
            rows.append((launcher, "—", "—", "—", f"not run: {measured}"))
            continue
        times, found = measured
        phases += found
        medians[launcher] = statistics.median(times)
        rows.append((launcher, f"{medians[launcher]:.2f}", f"{min(times):.2f}",
                     f"{max(times):.2f}", ""))
    base = medians.get("torchrun")
    lines = [
        f"# Launch overhead, {nprocs} processes, {reps} repetitions",
        "",
        f"- date: {datetime.date.today().isoformat()}",
        f"- hardware: {hardware()}",
        f"- command: python {' '.join(sys.argv)}",
        "",
        "| launcher | median s | min s | max s | median / torchrun | note |",
        "|---|---|---|---|---|---|",
    ]
    for name, median, low, high, note in rows:
        ratio = f"{medians[name] / base:.2f}" if base and name in medians else "—"
        lines.append(f"| {name} | {median} | {low} | {high} | {ratio} | {note} |")
    if phases:
        lines += ["", "gpufleet's calls, phase by phase (median over the calls; `gpufleet.timings`):", "",
                  "| phase | median s |", "|---|---|"]
        for phase in phases[0]:
            lines.append(f"| {phase} | {statistics.median(p.get(phase, 0.0) for p in phases):.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--launchers", default=",".join(LAUNCHERS))
    parser.add_argument("--out", help="also write the table to this file")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--torchrun-job", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.torchrun_job:
        job()
    elif args.child:
        child(args.child, args.nprocs, args.reps)
    else:
        table = report(args.nprocs, args.reps, args.launchers.split(","))
        print(table)
        if args.out:
            with open(args.out, "w") as f:
                f.write(table)


if __name__ == "__main__":
    main()
