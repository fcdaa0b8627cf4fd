"""What ``Checkpointer.due(step)`` costs a step when it saves by time (``every=``).

    python benchmarks/checkpoint_due.py --out benchmarks/results/checkpoint_due-cpu-DATE.md
    python benchmarks/checkpoint_due.py --gpus 2 --steps 2000 --step-ms 5

With ``every=`` a save is decided by rank 0's clock and broadcast to every rank, so ``due()`` is
a collective. gpufleet's broadcast is asynchronous: each ``due()`` starts one and reads the
answer the previous one started. This measures, in one call of ``--gpus`` gloo processes, the
time each rank spends inside ``due()`` when every step does ``--step-ms`` of work (a sleep: the
ranks are as busy as a training step would keep them) and ``every`` is never reached, against
the same broadcast waited for at once (what a blocking ``dist.broadcast`` would cost). The
table gives each rank's median and 90th percentile in milliseconds per call.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from gpufleet import distributed, runtime
from gpufleet.checkpoint import Checkpointer

WARMUP = 50  # calls left out of the figures: the group's first collectives set up its pairs


@distributed(tracking=False)
def measure(root: str, steps: int, step_s: float) -> dict:
    runtime.setup()
    ckpt = Checkpointer(root, every=datetime.timedelta(hours=1))  # never due: the cost alone
    group = dist.new_group(backend="gloo")
    answer = torch.zeros(1, dtype=torch.int64)
    asynchronous, waited = [], []
    for step in range(steps + WARMUP):
        time.sleep(step_s)
        started = time.perf_counter()
        if ckpt.due(step):
            raise RuntimeError(f"due({step}) said to save, with every=1h")
        asynchronous.append(time.perf_counter() - started)
    for step in range(steps + WARMUP):
        time.sleep(step_s)
        started = time.perf_counter()
        dist.broadcast(answer, src=0, group=group)  # the same size, waited for here
        waited.append(time.perf_counter() - started)
    return {"rank": runtime.get_global_rank(),
            "due": [t * 1e3 for t in asynchronous[WARMUP:]],
            "waited": [t * 1e3 for t in waited[WARMUP:]]}


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=2, help="processes (gloo, on the CPU)")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--step-ms", type=float, default=5.0, help="work per step (a sleep)")
    parser.add_argument("--out", help="also write the table here (markdown)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as root:
        ranks = measure.options(gpus=args.gpus).distributed(root, args.steps, args.step_ms / 1e3)
    lines = [
        "# `Checkpointer.due()` with `every=`: its cost per step",
        "",
        f"Date: {datetime.date.today()}. Machine: {platform.machine()}, {platform.processor() or 'cpu'}, "
        f"{__import__('os').cpu_count()} cores; Python {platform.python_version()}, torch {torch.__version__}.",
        f"Command: `python {' '.join(sys.argv)}`",
        "",
        f"{args.gpus} gloo processes, {args.steps} steps of {args.step_ms:g} ms of work each "
        f"({WARMUP} more first, left out); milliseconds per call.",
        "",
        "| rank | `due()` (asynchronous broadcast) median | p90 | the broadcast waited for at once: median | p90 |",
        "|---|---|---|---|---|",
    ]
    for r in sorted(ranks, key=lambda r: r["rank"]):
        lines.append(f"| {r['rank']} | {statistics.median(r['due']):.3f} | {percentile(r['due'], 0.9):.3f} | "
                     f"{statistics.median(r['waited']):.3f} | {percentile(r['waited'], 0.9):.3f} |")
    print("\n".join(lines))
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
