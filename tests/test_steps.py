"""Step telemetry, as a user sees it: a slow rank is named a straggler (live, in the run's
summary, in `gpufleet status` and in MLflow) with no code change when the strategies' trainer
and a gpufleet.data loader are used; a loader whose dataset is slow shows as input-bound; one
line (`runtime.step()`) times any loop; a run with neither still works and shows what it can;
`step_telemetry=False` times nothing.

The judging itself (`steps.compare`) is checked on windows written by hand: consistency, the
threshold, a world of one.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from mlflow import MlflowClient

from gpufleet import distributed, runtime, steps
from gpufleet.watch import progress
from support import run_folders, terminal_stdout

pytestmark = pytest.mark.timeout(120)

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def status_json(runs_dir, run_id: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "gpufleet", "status", "--json", "--runs-dir", str(runs_dir), run_id],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout
    return json.loads(out)


def status_text(runs_dir, run_id: str) -> str:
    return subprocess.run(
        [sys.executable, "-m", "gpufleet", "status", "--runs-dir", str(runs_dir), run_id],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout


def summary_of(attempt) -> dict:
    return json.loads((attempt / "steps.json").read_text())


def test_a_slow_rank_is_named_a_straggler_with_no_code_change(runs_dir, tmp_path, monkeypatch, capfd):
    for i in range(64):
        (tmp_path / f"sample-{i:03d}.txt").write_text(str(i))

    @distributed(gpus=2, runs_dir=runs_dir)
    def train(folder):
        import time

        import torch

        from gpufleet import data, strategies

        class Model(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.layer = torch.nn.Linear(4, 1)

            def forward(self, x):
                if runtime.get_global_rank() == 1:
                    time.sleep(0.06)  # rank 1's forward pass is slow: every step waits for it
                return self.layer(x)

        dataset = data.FileDataset(f"{folder}/sample-*.txt", transform=lambda path: torch.ones(4))
        loader = data.loader(dataset, batch_size=2, num_workers=0)
        prepared = strategies.prepare(Model(), lambda p: torch.optim.SGD(p, lr=0.01), "ddp")
        for epoch in range(4):  # 64 steps: the live line has 3 windows to judge, even on a fast machine
            dataset.set_epoch(epoch)
            for batch in loader:
                loss = prepared.model(batch).pow(2).mean()
                prepared.backward(loss)
                prepared.step()
        return prepared.optimizer_steps

    screen = terminal_stdout(monkeypatch)
    assert train.distributed(str(tmp_path)) == [64, 64]

    statuses = ANSI.sub("", screen.getvalue()).replace("\r", "\n").splitlines()
    assert any(re.search(r"straggler rank 1 \(\S+\) \+\d+% of a step late", line) for line in statuses), (
        "the live status line names the slow rank")
    assert any(re.search(r"step \d+ · [\d.]+ samples/s", line) for line in statuses), statuses

    attempt = run_folders(runs_dir)[-1]
    summary = summary_of(attempt)
    assert summary["straggler"] == 1
    by_rank = {row["rank"]: row for row in summary["ranks"]}
    assert by_rank[0]["steps"] == by_rank[1]["steps"] == 64, "every optimizer step is a step"
    late = by_rank[1]["late_s"]
    assert late > 0.03 and by_rank[0]["late_s"] < late - 0.03, "rank 1 reaches the all-reduce late"
    assert by_rank[0]["samples"] == 128, "the loader counts its samples (2 per batch, 64 batches)"
    assert abs(by_rank[0]["median_step_s"] - by_rank[1]["median_step_s"]) < late / 2, (
        "the all-reduce makes every rank's step as slow as the slowest: step time alone hides it")

    err = capfd.readouterr().err
    assert re.search(r"gpufleet: steps of train-\d{8}-\d{6}-[0-9a-f]+\.attempt-0:", err), err
    assert re.search(r"^\s+1\s.*\+[\d.]+ ms straggler", err, re.M), err

    run_id = attempt.parent.name
    shown = status_json(runs_dir, run_id)["steps"]
    assert shown["straggler"]["rank"] == 1 and shown["straggler"]["late_share"] > 0.2
    assert "straggler rank 1" in status_text(runs_dir, run_id)

    record = json.loads((attempt.parent / "record.json").read_text())
    tracked = MlflowClient().get_run(record["mlflow_run_id"])
    assert tracked.data.tags["gpufleet.straggler"].startswith("rank 1")
    assert {"steps/rank0/arrive_s", "steps/rank1/arrive_s", "steps/rank1/step_s",
            "steps/step_s_p50", "steps/step_s_max"} <= set(tracked.data.metrics)


def test_under_fsdp_a_rank_late_to_its_forward_pass_is_the_straggler(runs_dir):
    @distributed(gpus=2, runs_dir=runs_dir, tracking=False)
    def train():
        import time

        import torch

        from gpufleet import strategies

        model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        prepared = strategies.prepare(model, lambda p: torch.optim.SGD(p, lr=0.01), "fsdp")
        for _ in range(40):
            if runtime.get_global_rank() == 1:
                time.sleep(0.08)  # a slow host: the other rank waits in FSDP's forward all-gather
            prepared.backward(prepared.model(torch.randn(4, 16)).pow(2).mean())
            prepared.step()
        return True

    train.distributed()
    summary = summary_of(run_folders(runs_dir)[-1])
    by_rank = {row["rank"]: row for row in summary["ranks"]}
    assert summary["straggler"] == 1, summary
    early = by_rank[1]["median_forward_s"] - by_rank[0]["median_forward_s"]
    assert early > 0.05
    assert abs(by_rank[1]["median_arrive_s"] - by_rank[0]["median_arrive_s"]) < early / 2, (
        "by its backward pass rank 1 is on time: rank 0 waited for it in the all-gather")


def test_a_loader_whose_dataset_sleeps_is_reported_input_bound(runs_dir, tmp_path, monkeypatch):
    for i in range(80):
        (tmp_path / f"sample-{i:03d}.txt").write_text(str(i))

    @distributed(gpus=2, runs_dir=runs_dir)
    def train(folder):
        import time

        import torch

        from gpufleet import data

        def slow_read(path):
            time.sleep(0.02)  # a slow disk, or a heavy decode, in the input pipeline
            return torch.ones(4)

        dataset = data.FileDataset(f"{folder}/sample-*.txt", transform=slow_read)
        loader = data.loader(dataset, batch_size=2, num_workers=0)
        model = torch.nn.Linear(4, 1)
        for epoch in range(4):
            dataset.set_epoch(epoch)
            for batch in loader:  # no trainer, no runtime.step(): each batch is a step
                model(batch).sum().backward()
        return True

    screen = terminal_stdout(monkeypatch)
    train.distributed(str(tmp_path))

    statuses = ANSI.sub("", screen.getvalue()).replace("\r", "\n").splitlines()
    assert any(re.search(r"input-bound: 2 ranks wait \d+% for data", line) for line in statuses), statuses[-8:]
    summary = summary_of(run_folders(runs_dir)[-1])
    assert all(row["input_wait_share"] > 0.5 for row in summary["ranks"]), summary
    assert [row["steps"] for row in summary["ranks"]] == [80, 80], "4 epochs of 20 batches"
    assert [row["samples"] for row in summary["ranks"]] == [160, 160]
    assert summary["straggler"] is None, "both ranks wait alike: nobody is the straggler"
    shown = status_json(runs_dir, run_folders(runs_dir)[-1].parent.name)["steps"]
    assert sorted(shown["input_bound_ranks"]) == [0, 1]


def test_one_line_in_a_hand_written_loop_names_the_straggler(runs_dir):
    @distributed(gpus=2, runs_dir=runs_dir, tracking=False)
    def loop():
        import time

        import torch

        runtime.setup()
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(50):
            if runtime.get_global_rank() == 0:
                time.sleep(0.05)  # rank 0's data augmentation, say, before its forward pass
            model(torch.randn(16, 8)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            runtime.step(samples=16)
        return True

    loop.distributed()
    summary = summary_of(run_folders(runs_dir)[-1])
    assert summary["straggler"] == 0
    assert [row["steps"] for row in summary["ranks"]] == [50, 50]
    assert [row["samples"] for row in summary["ranks"]] == [800, 800]


def test_with_step_the_gap_between_steps_is_input_wait_and_the_total_gives_an_eta(runs_dir, monkeypatch):
    @distributed(gpus=2, runs_dir=runs_dir, tracking=False)
    def loop():
        import time

        for _ in range(40):
            time.sleep(0.03)  # fetching the next batch, outside the step
            with runtime.step(samples=8, tokens=8 * 128, total=40):
                time.sleep(0.06)
        return True

    screen = terminal_stdout(monkeypatch)
    loop.distributed()

    statuses = ANSI.sub("", screen.getvalue()).replace("\r", "\n").splitlines()
    live = [line for line in statuses if "ranks alive" in line and "ETA" in line]
    assert live, statuses
    assert re.search(r"step \d+/40 · [\d.]+k? samples/s · [\d.]+k? tokens/s \([\d.]+k?/rank\) · ETA \d:\d\d:\d\d",
                     live[-1]), live[-1]
    summary = summary_of(run_folders(runs_dir)[-1])
    for row in summary["ranks"]:
        assert row["steps"] == 40
        assert 0.15 < row["input_wait_share"] < 0.6, row  # 0.03 of every 0.09 s, or more
        assert row["median_step_s"] > 0.085, row  # the step runs from the last one's end (body: 0.06 s)
        assert row["samples"] == 320


def test_a_run_without_steps_works_and_shows_what_it_can(runs_dir, monkeypatch, capfd):
    @distributed(gpus=2, runs_dir=runs_dir, tracking=False)
    def plain():
        import time

        time.sleep(2)
        return runtime.get_global_rank()

    screen = terminal_stdout(monkeypatch)
    assert plain.distributed() == [0, 1]

    statuses = [line for line in ANSI.sub("", screen.getvalue()).replace("\r", "\n").splitlines()
                if "plain-…-" in line]
    assert statuses and all("step" not in line for line in statuses), statuses
    attempt = run_folders(runs_dir)[-1]
    assert not (attempt / "steps.json").exists()
    assert "steps of" not in capfd.readouterr().err
    text = status_text(runs_dir, attempt.parent.name)
    assert "status:       succeeded" in text and "steps:" not in text


def test_step_telemetry_off_times_nothing(runs_dir):
    @distributed(gpus=2, runs_dir=runs_dir, tracking=False, step_telemetry=False)
    def loop():
        for _ in range(5):
            runtime.step()
        return True

    assert loop.distributed() == [True, True]
    attempt = run_folders(runs_dir)[-1]
    assert list((attempt / "steps").iterdir()) == [] and not (attempt / "steps.json").exists()


# ---------------------------------------------------------------------------- the judging


def windows(rank: int, arrivals: list[float], step_s: float = 0.1, **extra) -> list[dict]:
    return [{"rank": rank, "host": "h", "gpu": str(rank), "time": 1000.0 + i, "first": 10 * i + 1,
             "last": 10 * (i + 1), "steps": 10, "wall_s": 10 * step_s, "step_s": step_s,
             "arrive_s": a, "input_s": 0.0, "samples": 80, **extra} for i, a in enumerate(arrivals)]


def test_a_rank_consistently_late_past_the_threshold_is_the_straggler():
    recent = {0: windows(0, [0.02] * 5), 1: windows(1, [0.05] * 5), 2: windows(2, [0.021] * 5),
              3: windows(3, [0.019] * 5)}
    found = steps.compare(recent, threshold=0.2)
    assert found.straggler.rank == 1 and found.late_share(found.straggler) == pytest.approx(0.3, abs=0.01)
    assert steps.compare(recent, threshold=0.5).straggler is None, "0.3 of a step is under 0.5"
    assert steps.compare(recent, threshold=0.5).slowest.rank == 1, "still shown as the slowest"
    assert found.samples_per_s == pytest.approx(4 * 80 / 1.0)


def test_one_late_window_is_not_a_straggler_nor_is_a_world_of_one():
    recent = {0: windows(0, [0.02] * 5), 1: windows(1, [0.02, 0.02, 0.09, 0.02, 0.02])}
    assert steps.compare(recent, threshold=0.2).straggler is None
    alone = steps.compare({0: windows(0, [0.09] * 5)}, threshold=0.2)
    assert alone.straggler is None and alone.slowest is None
    too_soon = {0: windows(0, [0.02] * 2), 1: windows(1, [0.09] * 2)}
    assert steps.compare(too_soon, threshold=0.2).straggler is None, "two windows are not consistent"


def test_the_status_parts_and_the_summary_table():
    recent = {0: windows(0, [0.02] * 3, total=100), 1: windows(1, [0.06] * 3, total=100, input_s=0.6)}
    found = steps.compare(recent, threshold=0.2)
    parts = progress.steps_parts(found)
    assert parts[0] == "step 30/100"
    assert parts[1] == "160 samples/s"
    assert parts[2] == "ETA 0:00:07"  # 70 steps at 10 a second
    assert parts[3] == "straggler rank 1 (h, GPU 1) +40% of a step late"
    assert parts[4] == "input-bound: rank 1 waits 60% for data"
    assert "ETA" not in " ".join(progress.steps_parts(found, running=False))


def test_the_printed_summary_of_many_ranks_keeps_the_latest():
    rows = [{"rank": r, "host": "h", "gpu": str(r), "steps": 10, "median_step_s": 0.1,
             "median_arrive_s": 0.01, "input_wait_share": 0.0, "samples": None,
             "gpu_memory_peak_bytes": 2**30, "slowest_steps": [{"step": 1, "seconds": 0.2}],
             "late_s": 0.05 if r == 3 else 0.0} for r in range(64)]
    table = steps.Summary(rows, straggler=3).table().splitlines()
    assert len(table) == 1 + steps.SUMMARY_ROWS + 1, "a header, the rows shown, and what is left out"
    assert any(re.fullmatch(r"\s+3\s+h\s+3\s+10\s+100\.0 ms\s+0%\s+\+50\.0 ms straggler\s+1\.0 GiB\s+"
                            r"#1 200\.0 ms", line) for line in table), table
    assert table[-1] == "  (56 more ranks, less late, in steps.json)"
