"""The folders both sides of a run share: where the ranks and their launcher write their logs,
results and reports, and where the watcher reads them (docs/design.md, "Run folder").

``RunDir`` is one start of ranks (a warm pool's folder); ``Attempt`` is one try of a run, a
folder inside the run's own (``runs/records.py``)."""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import stat
import time
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from gpufleet import _environ, _process
from gpufleet.errors import ConfigError

CANCEL_REQUEST = "cancel-requested"  # in a run's folder, beside its attempts


@dataclass(frozen=True)
class RunDir:
    path: Path

    @classmethod
    def create(cls, runs_dir: Path | None, name: str) -> "RunDir":
        """A new private folder under ``runs_dir`` (default ``$GPUFLEET_HOME/runs``)."""
        root = runs_root(runs_dir)
        ensure_private_dir(root)
        return cls.create_at(root / new_id(name))

    @classmethod
    def create_at(cls, path: Path) -> "RunDir":
        """A new private folder at ``path``, with its per-rank subfolders."""
        path.mkdir(mode=0o700)  # fails if it exists: nobody can pre-create it for us
        for sub in ("logs", "results", "pids", "stacks", "heartbeats", "nccl", "timings", "steps"):
            (path / sub).mkdir(mode=0o700)
        return cls(path)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def run_id(self) -> str:
        """The run the folder belongs to: itself, unless it is an attempt (``Attempt``)."""
        return self.path.name

    @property
    def payload(self) -> Path:
        return self.path / "payload.pkl"

    @property
    def agent_log(self) -> Path:
        return self.path / "agent.log"

    @property
    def agent_report(self) -> Path:
        return self.path / "agent.json"

    @property
    def elastic_logs(self) -> Path:
        return self.path / "elastic"

    def log(self, rank: int) -> Path:
        return self.path / "logs" / f"rank-{rank}.log"

    def result(self, rank: int) -> Path:
        return self.path / "results" / f"rank-{rank}.pkl"

    def pid_file(self, rank: int) -> Path:
        return self.path / "pids" / f"rank-{rank}.pid"

    def timings(self, rank: int) -> Path:
        """When rank N passed each instant of its start-up and run (``timings.py``)."""
        return self.path / "timings" / f"rank-{rank}.json"

    @property
    def agent_timings(self) -> Path:
        return self.path / "timings" / "agent.json"

    def stacks(self, rank: int) -> Path:
        """Where the rank's Python stacks go when gpufleet asks for them (a hang)."""
        return self.path / "stacks" / f"rank-{rank}.txt"

    def heartbeat(self, rank: int) -> Path:
        """Touched by ``runtime.heartbeat()``: its modification time is the rank's last sign
        of progress besides output."""
        return self.path / "heartbeats" / f"rank-{rank}"

    @property
    def nccl_traces(self) -> Path:
        """The prefix of NCCL's flight-recorder dumps (``<prefix><rank>``) and pipes."""
        return self.path / "nccl" / "rank-"

    @property
    def tracking(self) -> Path:
        """The call's MLflow run as environment variables, for the ranks (``tracking.py``)."""
        return self.path / "tracking.json"

    def orders(self, rank: int) -> Path:
        """A warm pool's pipe to rank N: one line per call (``launchers/warm.py``)."""
        return self.path / "orders" / f"rank-{rank}"

    def ready(self, rank: int) -> Path:
        """How many calls a warm rank has finished and cleaned up after: the caller hands
        over the next call once every rank has (``launchers/warm.py``)."""
        return self.path / "ready" / f"rank-{rank}"

    @property
    def modules(self) -> Path:
        """The files of the user modules a warm pool's ranks have imported, with their
        modification times: an edited module means a fresh pool."""
        return self.path / "modules.json"

    @property
    def progress(self) -> Path:
        """Rank 0's last logged step and metrics (``gpufleet.log_metrics``), for the live
        status line and ``gpufleet status``."""
        return self.path / "progress.json"

    def steps(self, rank: int) -> Path:
        """The rank's step telemetry, one JSON line per window (``steps.py``)."""
        return self.path / "steps" / f"rank-{rank}.jsonl"

    @property
    def steps_summary(self) -> Path:
        """Every rank's steps, summed up by the caller when the attempt ended (``steps.py``)."""
        return self.path / "steps.json"

    @property
    def metrics_log(self) -> Path:
        """Rank 0's ``log_metrics``, one JSON line each, which the caller logs into MLflow."""
        return self.path / "metrics.jsonl"

    @property
    def telemetry(self) -> Path:
        """The node's samples of its host and of the run's GPUs, one JSON line each
        (``telemetry.py``); a Ray node's lines are mirrored into the caller's copy."""
        return self.path / "telemetry.jsonl"

    @property
    def pool_owner(self) -> Path:
        """A warm pool's folder: the process that owns the pool (pid, start time, host), so
        that ``gpufleet prune`` can tell a pool still starting or serving from one that is gone."""
        return self.path / "pool-owner.json"

    @property
    def cancel_request(self) -> Path | None:
        """None: no run can be cancelled through this folder (a warm pool's); see ``Attempt``."""
        return None

    @property
    def stop_request(self) -> Path:
        """Exists once the caller was asked to stop (SIGTERM): ``runtime.should_stop()``."""
        return self.path / "stop-requested"


@dataclass(frozen=True)
class Attempt(RunDir):
    """One try of a run: ``<run folder>/attempt-N``; a retry is the next attempt."""

    number: int = 0

    @classmethod
    def start(cls, run_folder: Path, number: int) -> "Attempt":
        """A new attempt's folder in the run's."""
        return cls(RunDir.create_at(attempt_folder(run_folder, number)).path, number)

    @property
    def run_id(self) -> str:
        return self.path.parent.name

    @property
    def name(self) -> str:
        """``<run id>.attempt-N``: unique among every run's attempts."""
        return f"{self.run_id}.{self.path.name}"

    @property
    def cancel_request(self) -> Path:
        """Exists once someone asked to cancel the run (``Run.cancel()``)."""
        return self.path.parent / CANCEL_REQUEST


def attempt_folder(run_folder: Path, number: int) -> Path:
    return run_folder / f"attempt-{number}"


class LauncherState(str, Enum):
    """What a launcher's report (``agent.json``) says of its ranks: still going, or how they
    ended. No report at all once the launcher is gone means it was lost."""

    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"  # by a signal to the launcher
    ERROR = "error"  # the launcher itself failed (its report holds the traceback)
    LOST = "lost"


def runs_root(runs_dir: Path | None) -> Path:
    """Where runs go: ``runs_dir``, else the config file's ``runs_dir``, else
    ``$GPUFLEET_HOME/runs``."""
    if runs_dir is None:
        from gpufleet.options import user_defaults  # the caller's side: ranks are given theirs

        runs_dir = user_defaults().get("runs_dir")
    return (runs_dir or _environ.gpufleet_home() / "runs").absolute()


def new_id(name: str) -> str:
    """A run's id: its name, the local time and 6 random hex digits."""
    return f"{_safe(name)}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"


Ranks = int | Iterable[int]  # the ranks a folder holds: N for 0..N-1 (every rank on this machine)


def rank_list(ranks: Ranks) -> list[int]:
    """``ranks`` as a list: a count is ranks 0 to N-1; a node run's machine holds some of them."""
    return list(range(ranks)) if isinstance(ranks, int) else list(ranks)


def rank_pids(run: "RunDir", ranks: Ranks) -> list[int | None]:
    """Each rank's pid from its pid file (None where not written yet)."""
    return [read_pid(run.pid_file(rank)) for rank in rank_list(ranks)]


def rank_groups(run: "RunDir", ranks: Ranks) -> list[int]:
    """The process groups the ranks led, for the teardown. A group outlives its leader (what
    the rank started is still in it), and Linux gives no new process the id of a group that
    has members; but once the group is empty too, the pid may go to another process, which
    then leads a group of that id: a pid held by a process younger than the pid file is not
    the rank's, and its group is left alone."""
    groups = []
    for rank in rank_list(ranks):
        path = run.pid_file(rank)
        pid = read_pid(path)
        try:
            written = path.stat().st_mtime
        except OSError:
            continue
        started = _process.started_at(pid) if pid else None
        if pid and (started is None or started <= written + _process.PID_CLOCK_SLACK_SECONDS):
            groups.append(pid)
    return groups


def read_pid(path: Path) -> int | None:
    """The pid in a rank's pid file; None until the rank has written it."""
    try:
        return int(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


def ensure_private_dir(root: Path, closed: bool = False) -> None:
    """Create ``root`` if needed, and every missing folder above it, each 0700 (as
    ``Path.mkdir(parents=True)`` would not); refuse a ``root`` that another user owns or could
    write to, and so a ``$GPUFLEET_HOME`` above it (whoever can write there can swap the
    folders in it), before anything is created in it."""
    root = Path(root).absolute()
    home = _environ.gpufleet_home()
    guarded = [root]
    if home in root.parents:
        guarded += [p for p in root.parents if p == home or home in p.parents]
    for folder in [*reversed(root.parents), root]:  # top down: each checked before use
        if not folder.exists():
            with contextlib.suppress(FileExistsError):  # made meanwhile: checked all the same
                folder.mkdir(mode=0o700)
        if folder in guarded:  # ``closed``: nobody else may even read ``root`` (caches)
            check_private_dir(folder, writable_only=not (closed and folder == root))


def check_private_dir(path: Path, writable_only: bool = False) -> None:
    """Raise unless ``path`` is a real folder of this user that nobody else can write to
    (nor, unless ``writable_only``, read)."""
    info = path.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise ConfigError(
            f"{path} must be a real folder owned by you (uid {os.getuid()}); "
            "choose another folder or set GPUFLEET_HOME"
        )
    forbidden = (stat.S_IWGRP | stat.S_IWOTH) if writable_only else 0o077
    if info.st_mode & forbidden:
        raise ConfigError(
            f"{path} is open to other users (mode {oct(info.st_mode & 0o777)}); "
            f"run `chmod 700 {path}` or choose another folder"
        )


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[:60] or "run"
