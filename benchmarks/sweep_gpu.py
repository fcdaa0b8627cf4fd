"""A sweep on GPUs: 4 trials of 1 GPU, packed as many at a time as the machine has GPUs.

    python benchmarks/sweep_gpu.py --out benchmarks/results/sweep-1xH200-DATE.md

Each trial trains a small model with NCCL on its GPU (a 1-rank process group), logs its loss
with ``log_metrics`` and returns the GPU it ran on. The table gives each trial's run, GPU,
window (seconds from the sweep's start) and loss; the summary, how many trials ran at once
(the GPU count, on 2 GPUs: two at a time), whether each worker's trials reused its warm ranks
(one process id per worker), and, with MLflow installed, the sweep's parent run with the
trials as children and the best trial tagged.
"""

from __future__ import annotations

import argparse
import datetime
import io
import os
import platform
import sys
import tempfile
import time

import gpufleet
from gpufleet import distributed, log_metrics, runtime


@distributed(gpus=1, timeout=600)
def trial(lr: float, steps: int = 200):
    import torch

    device = runtime.setup()
    began = time.time()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 1)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    x = torch.randn(4096, 512, device=device)
    y = x[:, :1] * 0.5
    for step in range(steps):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 20 == 0 or step == steps - 1:
            log_metrics({"loss": loss.item()}, step=step)
    return {"gpu": os.environ.get("CUDA_VISIBLE_DEVICES"), "pid": os.getpid(), "began": began,
            "ended": time.time(), "loss": loss.item(), "device": str(device)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the markdown table here as well")
    parser.add_argument("--steps", type=int, default=200, help="training steps per trial")
    args = parser.parse_args()
    rates = [0.3, 0.1, 0.03, 0.01]
    view = io.StringIO()
    with tempfile.TemporaryDirectory() as runs_dir:
        start = time.time()
        inputs = [{"lr": lr, "steps": args.steps} for lr in rates]
        sweep = gpufleet.sweep(trial.options(runs_dir=runs_dir), inputs, metric="loss", name="lr-sweep", out=view)
        values = sweep.results(return_exceptions=True)
        took = time.time() - start
        lines = [f"# Sweep on GPUs ({datetime.date.today()})", "",
                 f"- machine: {platform.node()}, {_gpus()}", f"- command: `python {' '.join(sys.argv)}`",
                 f"- {len(rates)} trials of 1 GPU, max_concurrent={sweep.max_concurrent} (the default: what fits)",
                 f"- the whole sweep: {took:.1f} s", "",
                 "| trial | lr | status | run | GPU | window (s) | loss |", "|---|---|---|---|---|---|---|"]
        windows = []
        for t, value in zip(sweep.trials, values):
            if isinstance(value, BaseException):
                lines.append(f"| {t.index} | {t.kwargs['lr']} | {t.status} | {t.run.id if t.run else '-'} | - | - | "
                             f"{type(value).__name__}: {str(value).splitlines()[0]} |")
                continue
            rank0 = value[0]
            windows.append((rank0["began"] - start, rank0["ended"] - start))
            lines.append(f"| {t.index} | {t.kwargs['lr']} | {t.status} | {t.run.id} | {rank0['gpu']} | "
                         f"{windows[-1][0]:.1f}-{windows[-1][1]:.1f} | {rank0['loss']:.4g} |")
        at_once = max((sum(b <= m < e for b, e in windows) for m, _ in windows), default=0)
        pids = sorted({v[0]["pid"] for v in values if not isinstance(v, BaseException)})
        best = sweep.best()
        lines += ["", f"- most trials at once: {at_once}",
                  f"- rank processes: {len(pids)} for {len(windows)} trials (warm ranks reused per worker)",
                  f"- best: trial {best.index if best else '-'} (lr={best.kwargs['lr'] if best else '-'})",
                  f"- MLflow: {_mlflow(sweep)}", "", "The sweep's view:", "", "```", view.getvalue().rstrip(), "```"]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as out:
            out.write(text)
    return 0 if all(t.status == "succeeded" for t in sweep.trials) else 1


def _gpus() -> str:
    try:
        import torch

        count = torch.cuda.device_count()
        return f"{count} × {torch.cuda.get_device_name(0)}" if count else "no GPU"
    except Exception as exc:  # the table says why
        return f"GPUs unknown ({exc})"


def _mlflow(sweep) -> str:
    try:
        import mlflow
    except ImportError:
        return "not installed here: the parent and child runs were not checked"
    from gpufleet.tracking import store_uri

    client = mlflow.MlflowClient(store_uri())  # gpufleet's store: $GPUFLEET_HOME/mlflow.db unless told otherwise
    children = {t.run.record().get("mlflow_run_id") for t in sweep.trials if t.run}
    parents = {client.get_run(c).data.tags.get("mlflow.parentRunId") for c in children if c}
    if len(parents) != 1:
        return f"the trials' runs have parents {parents}"
    parent = client.get_run(parents.pop())
    return (f"parent run {parent.info.run_id} ({parent.info.status}) with {len(children)} children; "
            f"best trial tagged {parent.data.tags.get('gpufleet.best_trial')}")


if __name__ == "__main__":
    sys.exit(main())
