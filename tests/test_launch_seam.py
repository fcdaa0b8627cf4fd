"""The launch seam: a plan starts nothing; the registry (``launchers.for_run``) picks the
launcher of each kind of run; and a launcher written outside the package, entered in the
registry, runs a decorated call's attempts end to end under the unchanged execution and watcher
(launchers/base.py, launchers/__init__.py, runs/execution.py, watch/supervisor.py)."""

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

import gpufleet
from gpufleet import RunFailedError, distributed, launchers, runtime
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
                   "GPUFLEET_PARENT_PID": str(os.getpid()), "PYTHONPATH": str(Path(__file__).parent),
                   "GPUFLEET_ATTEMPT": str(plan.attempt.number)}  # runtime.get_attempt()
            code = f"from gpufleet.rank import worker; worker.main({str(plan.attempt.path)!r})"
            procs.append(subprocess.Popen([sys.executable, "-c", code], env=env))
        return ProcessJob(procs, plan.attempt)


def place(options):
    """Where a run's ranks go, as the registry asks a launcher's module: here, as locally."""
    from gpufleet.launchers import local

    return local.place(options)


class RegisteredLauncher(ProcessLauncher):
    """ProcessLauncher as the registry makes one, for a run: (placement, options, gate)."""

    launched: list[Path] = []  # the attempts it started, in order

    def __init__(self, placement, options, gate):
        self.placement, self.gate = placement, gate

    def plan(self, attempt, env):
        return ProcessPlan(attempt, env, self.placement.nprocs)

    def launch(self, plan):
        self.gate.begin()  # the run is running: its record says so, its timeout starts
        RegisteredLauncher.launched.append(plan.attempt.path)
        return super().launch(plan)


def test_a_launcher_in_the_registry_runs_a_decorated_calls_attempts(runs_dir, monkeypatch):
    monkeypatch.setitem(launchers._LAUNCHERS, "local", (__name__, "RegisteredLauncher"))
    monkeypatch.setattr(RegisteredLauncher, "launched", [])

    @distributed(gpus=2, runs_dir=runs_dir, max_retries=1, tracking=False)
    def second_time_lucky(value):
        if runtime.get_attempt() == 0 and runtime.get_global_rank() == 1:
            raise ValueError("not this time")
        return (runtime.get_global_rank(), runtime.get_world_size(), value)

    assert second_time_lucky.distributed("x") == [(0, 2, "x"), (1, 2, "x")]
    (run,) = gpufleet.runs(runs_dir)
    record = run.record()
    assert run.status() == "succeeded" and record["attempts"] == ["attempt-0", "attempt-1"]
    assert RegisteredLauncher.launched == [run.path / a for a in record["attempts"]], (
        "the attempts did not go through the launcher the registry names")


def test_the_registry_picks_the_launcher_of_each_kind_of_run(tmp_path):
    from gpufleet.launchers.local import LocalLauncher
    from gpufleet.launchers.nodes import NodeLauncher

    plain = RunOptions.create(gpus=2)
    launcher = launchers.for_run(launchers.place(plain), plain, _NoGate())
    assert type(launcher) is LocalLauncher
    launcher.close()

    node = RunOptions.create(gpus=1, nnodes=2, node_rank=1, rdzv_endpoint="127.0.0.1:29400", rdzv_id="seam")
    launcher = launchers.for_run(launchers.place(node), node, _NoGate())
    assert type(launcher) is NodeLauncher
    plan = launcher.plan(_attempt(tmp_path, "x"), {})  # what would meet where: nothing starts
    assert plan.nprocs == 1
    assert plan.node == {"endpoint": "127.0.0.1:29400", "min_nodes": 2, "max_nodes": 2, "node_rank": 1}
    launcher.close()


def test_a_run_here_imports_no_other_engines_launcher(tmp_path):
    """The registry imports a launcher's module (and its SDK) only when a run needs it."""
    code = ("import sys\n"
            "from gpufleet import launchers\n"
            "from gpufleet.options import RunOptions\n"
            "options = RunOptions.create(gpus=2)\n"
            "launchers.place(options)\n"
            "print(sorted(m for m in ('ray', 'gpufleet.launchers.ray') if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "GPUFLEET_HOME": str(tmp_path / "home")})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout


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
