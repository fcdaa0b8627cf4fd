"""The launch seam: a plan starts nothing, and a launcher written outside the package runs
real ranks under the unchanged watcher (launchers/base.py, watch/supervisor.py)."""

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpufleet import RunFailedError, launchers, runtime
from gpufleet.launchers.base import Job, Launcher
from gpufleet.options import RunOptions
from gpufleet.payload import dump_call, write_private
from gpufleet.rundir import Attempt
from gpufleet.runs.records import Record
from gpufleet.watch.supervisor import Preemption, Supervisor


def rank_and_arg(value):
    if value == "fail" and runtime.get_global_rank() == 1:
        raise ValueError("rank 1 refuses")
    return (runtime.get_global_rank(), runtime.get_world_size(), value)


@dataclass(frozen=True)
class ProcessPlan:
    attempt: Attempt
    env: dict
    nprocs: int

    def describe(self) -> str:
        return f"{self.nprocs} plain processes"


class ProcessJob(Job):
    """Each rank a plain child process, started without elastic."""

    def __init__(self, procs, attempt):
        self.procs, self.attempt, self.reports = procs, attempt, attempt
        self.world_size = len(procs)
        self.stamps = {}
        from gpufleet.watch.monitor import RunMonitor

        self.monitor = RunMonitor(attempt, len(procs), attempt.nccl_traces)

    def poll(self):
        codes = [p.poll() for p in self.procs]
        return None if None in codes else max(codes, key=abs)

    def wait(self, timeout=None):
        for p in self.procs:
            p.wait(timeout)
        return self.poll()

    def stop(self):
        for p in self.procs:
            if p.poll() is None:
                p.terminate()

    def release(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()

    def describe(self):
        return "the plain rank processes"


class ProcessLauncher(Launcher):
    def plan(self, attempt, env):
        return ProcessPlan(attempt, env, 2)

    def launch(self, plan):
        procs = []
        for rank in range(plan.nprocs):
            env = {**os.environ, **plan.env, "RANK": str(rank), "LOCAL_RANK": str(rank),
                   "WORLD_SIZE": str(plan.nprocs), "LOCAL_WORLD_SIZE": str(plan.nprocs),
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0",
                   "GPUFLEET_RUN_DIR": str(plan.attempt.path), "GPUFLEET_DEVICE": "cpu",
                   "GPUFLEET_PARENT_PID": str(os.getpid()), "PYTHONPATH": str(Path(__file__).parent)}
            code = f"from gpufleet.rank import worker; worker.main({str(plan.attempt.path)!r})"
            procs.append(subprocess.Popen([sys.executable, "-c", code], env=env))
        return ProcessJob(procs, plan.attempt)


def _attempt(tmp_path, value) -> Attempt:
    record = Record.create(tmp_path / "runs", "seam", function="rank_and_arg", kind="function",
                           gpus=2, device="cpu", remote=None)
    attempt = record.new_attempt()
    write_private(attempt.payload, dump_call(rank_and_arg, (value,), {}))
    return attempt


def _watch(launcher, attempt):
    options = RunOptions.create(timeout=120)
    with launcher.launch(launcher.plan(attempt, {})) as job:
        return Supervisor(job, options, Preemption(), {"call": time.time()}, None, 0).wait()


def test_a_launcher_of_its_own_runs_ranks_under_the_watcher(tmp_path):
    values = _watch(ProcessLauncher(), _attempt(tmp_path, "x"))
    assert values == [(0, 2, "x"), (1, 2, "x")]


def test_a_failing_rank_of_such_a_launcher_is_the_root_cause(tmp_path):
    with pytest.raises(RunFailedError) as caught:
        _watch(ProcessLauncher(), _attempt(tmp_path, "fail"))
    assert caught.value.root_cause.rank == 1
    assert "rank 1 refuses" in str(caught.value)
    assert isinstance(caught.value.__cause__, ValueError)


class _NoGate:
    owner, since, ticket = "seam", 0.0, None

    def stopped(self):
        return False

    def waiting(self, holders):
        raise AssertionError("a plan never waits for devices")

    def never_started(self):
        raise AssertionError

    def begin(self, device_ids=()):
        raise AssertionError("a plan never starts the run")


def test_a_local_plan_starts_nothing_writes_nothing_and_hides_secrets(tmp_path):
    options = RunOptions.create(gpus=2, env={"API_TOKEN": "hunter2"})
    placement = launchers.place(options)
    launcher = launchers.for_run(placement, options, _NoGate())
    attempt = _attempt(tmp_path, "x")
    before = sorted(p.relative_to(attempt.path) for p in attempt.path.rglob("*"))
    children = _children()

    plan = launcher.plan(attempt, {"EXTRA": "1"})

    assert sorted(p.relative_to(attempt.path) for p in attempt.path.rglob("*")) == before
    assert _children() == children
    assert plan.nprocs == 2
    text = plan.describe()
    assert "2 ranks" in text and "hunter2" not in text
    launcher.close()


def _children() -> set[int]:
    path = Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children")
    return set(map(int, path.read_text().split()))
