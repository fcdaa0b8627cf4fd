"""A run's record: its folder under the runs directory and ``record.json``, what any process
can read later (the handle, ``gpufleet runs``, ``gpufleet status``) — docs/design.md.

One process writes a record: the one that supervises the run (the caller of
``.distributed()``, the CLI, or the background process of ``.submit()``). It names itself in
the record (pid, its start time, host), so a reader can tell a run still going from one whose
supervisor died without writing an end ("lost").
"""

from __future__ import annotations

import json
import os
import pickle
import socket
import time
from pathlib import Path

from gpufleet.errors import (
    ConfigError,
    GpufleetError,
    RunCancelledError,
    RunFailedError,
    RunPreemptedError,
    RunTimeoutError,
)
from gpufleet.payload import write_private
from gpufleet.rundir import CANCEL_REQUEST, RunDir, ensure_private_dir, new_id, read_pid, runs_root

QUEUED, RUNNING = "queued", "running"
SUCCEEDED, FAILED, TIMEOUT, CANCELLED, PREEMPTED, LOST = (
    "succeeded", "failed", "timeout", "cancelled", "preempted", "lost",
)
FINAL = (SUCCEEDED, FAILED, TIMEOUT, CANCELLED, PREEMPTED, LOST)
NAMING_SECONDS = 60.0  # for a submitted run's supervisor to start and name itself
# Space set aside while a run is going, freed for its error and final status: a run that
# fills its disk (logs, results) can still say how it ended.
SPARE_BYTES = 2**20


class Record:
    """The folder ``<runs_dir>/<id>/`` of one run and its ``record.json``."""

    def __init__(self, path: Path):
        self.path = Path(path)

    @classmethod
    def create(cls, runs_dir: Path | None, name: str, **fields) -> "Record":
        root = runs_root(runs_dir)
        ensure_private_dir(root)
        record = cls(root / new_id(name))
        record.path.mkdir(mode=0o700)
        _set_aside(record.spare, SPARE_BYTES)
        record._write({
            "id": record.id, "name": name, "status": QUEUED, "created": time.time(),
            "started": None, "ended": None, "attempts": [], "devices": [], "error": None,
            **fields,
        })
        return record

    @property
    def id(self) -> str:
        return self.path.name

    @property
    def file(self) -> Path:
        return self.path / "record.json"

    @property
    def call(self) -> Path:
        """A submitted run's call (function, arguments, options), for its supervisor."""
        return self.path / "call.pkl"

    @property
    def outcome(self) -> Path:
        """The error of a failed run, pickled, for ``Run.result()`` in any process."""
        return self.path / "outcome.pkl"

    @property
    def spare(self) -> Path:
        """Space set aside for the run's end (``SPARE_BYTES``), removed when it ends."""
        return self.path / ".spare"

    @property
    def supervisor_log(self) -> Path:
        """What gpufleet itself printed while supervising a background run."""
        return self.path / "supervisor.log"

    def attempt(self, number: int) -> RunDir:
        """The folder of attempt ``number`` (0: the first; a retry is a new attempt)."""
        return RunDir(self.path / f"attempt-{number}")

    def new_attempt(self) -> RunDir:
        attempts = self.read()["attempts"]
        run = RunDir.create_at(self.attempt(len(attempts)).path)
        self.update(attempts=[*attempts, run.path.name])
        return run

    def last_attempt(self) -> RunDir | None:
        attempts = self.read()["attempts"]
        return RunDir(self.path / attempts[-1]) if attempts else None

    def read(self) -> dict:
        return json.loads(self.file.read_text())

    def update(self, **fields) -> dict:
        data = self.read()
        data.update(fields)
        self._write(data)
        return data

    def supervised_here(self) -> None:
        """Name this process as the run's supervisor."""
        self.update(supervisor=this_process())

    def begin(self, devices: tuple[str, ...] = ()) -> None:
        self.update(status=RUNNING, started=time.time(), devices=list(devices))

    def end(self, error: BaseException | None) -> None:
        """The run is over: its error first (``outcome.pkl``, for ``Run.result()``), then the
        final status, so a reader that sees the status finds the error."""
        self.keep(error)
        self.close(error)

    def keep(self, error: BaseException | None) -> None:
        """The run's error, if any, where ``Run.result()`` finds it (the first half of ``end``)."""
        self.spare.unlink(missing_ok=True)  # room for the error and the status, disk full or not
        if error is None:
            return
        if isinstance(error, KeyboardInterrupt):
            error = self.cancelled()
        try:
            write_private(self.outcome, pickle.dumps(error))
        except Exception as exc:  # the status still says how it ended
            write_private(self.outcome, pickle.dumps(GpufleetError(
                f"{_error_line(error)} (the error itself could not be kept: {type(exc).__name__}: {exc})"
            )))

    def close(self, error: BaseException | None) -> None:
        """The final status (the second half of ``end``), after ``keep(error)``."""
        self.spare.unlink(missing_ok=True)
        self.update(status=status_of(error), ended=time.time(), error=_error_line(error))

    def cancelled(self) -> RunCancelledError:
        data = self.read()
        last = data["attempts"][-1] if data["attempts"] else ""
        return RunCancelledError(
            [], run_dir=self.path / last, world_size=data["gpus"],
            headline=f"run {self.id} was cancelled: every rank was stopped",
        )

    def status(self) -> str:
        """The recorded status, or "lost" when the run never ended and its supervisor is gone."""
        data = self.read()
        if data["status"] in FINAL or is_alive(data.get("supervisor"), data["created"]):
            return data["status"]
        data = self.read()  # it may have ended just before it exited
        return data["status"] if data["status"] in FINAL else LOST

    @property
    def cancel_request(self) -> Path:
        """Exists once someone asked to cancel the run (``Run.cancel()``)."""
        return self.path / CANCEL_REQUEST

    def _write(self, data: dict) -> None:
        write_private(self.file, json.dumps(data, indent=1).encode())


def _set_aside(path: Path, size: int) -> None:
    """A file of ``size`` bytes that really takes its blocks (not a sparse one)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError:  # a file system without fallocate: write them
        os.write(fd, bytes(size))
    finally:
        os.close(fd)


def find(run_id: str, runs_dir: Path | None = None) -> Record:
    """A run by its id, a unique start of it, or its unique 6-digit end."""
    root = runs_root(runs_dir)
    exact = root / run_id
    if run_id and "/" not in run_id and (exact / "record.json").is_file():
        return Record(exact)
    ids = [r.id for r in all_records(runs_dir)]
    matches = [i for i in ids if i.startswith(run_id)] or [i for i in ids if i.endswith(run_id)]
    if not run_id or not matches:
        raise ConfigError(f"no run {run_id!r} in {root}; `gpufleet runs` lists the runs there")
    if len(matches) > 1:
        raise ConfigError(
            f"run {run_id!r} is ambiguous in {root}: it matches {', '.join(matches[:5])}"
            f"{' …' if len(matches) > 5 else ''}; give more of the id"
        )
    return Record(root / matches[0])


def all_records(runs_dir: Path | None = None) -> list[Record]:
    """Every run under the runs directory, newest first."""
    root = runs_root(runs_dir)
    if not root.is_dir():
        return []
    found = [Record(p) for p in root.iterdir()
             if not p.name.startswith(PRUNING) and (p / "record.json").is_file()]
    dated = [(when, r) for r in found if (when := _created(r)) is not None]  # deleted meanwhile
    return [r for _, r in sorted(dated, key=lambda item: item[0], reverse=True)]


PRUNING = ".pruning-"  # a folder being deleted by ``gpufleet prune`` (hidden from listings)


def prunable(runs_dir: Path | None, older_than: float | None, keep: int | None) -> list[Path]:
    """The folders ``gpufleet prune`` deletes: runs that ended more than ``older_than``
    seconds ago and are not among the ``keep`` most recently ended (either limit may be
    None); with ``older_than``, the folders of warm pools that are gone and unchanged for that
    long; and what an earlier prune left half deleted. A queued or running run, or a pool
    still starting or serving, is never one of them."""
    root = runs_root(runs_dir)
    if not root.is_dir():
        return []
    now = time.time()
    ended = []
    for record in all_records(runs_dir):
        try:
            if record.status() in FINAL:
                ended.append((record.read().get("ended") or record.file.stat().st_mtime, record.path))
        except (OSError, ValueError, KeyError):  # deleted meanwhile, or not a record of ours
            continue
    ended.sort(reverse=True)
    chosen = [path for when, path in ended[keep or 0:] if older_than is None or now - when > older_than]
    for folder in sorted(root.iterdir()):
        if folder.name.startswith(PRUNING):
            chosen.append(folder)
        elif older_than is not None and _pool_gone(RunDir(folder), now - older_than):
            chosen.append(folder)
    return chosen


def _pool_gone(folder: RunDir, before: float) -> bool:
    """Whether ``folder`` is a warm pool's (it names its owner; no run's record) that has
    not changed since ``before`` and is over: its owning process is gone, or its ranks all
    exited (a pool that starts again gets a new folder). A pool of another host is left to it."""
    try:
        if (folder.path / "record.json").exists() or folder.path.stat().st_mtime > before:
            return False
        owner = json.loads(folder.pool_owner.read_text())
    except (OSError, ValueError):  # not a pool's folder, or deleted meanwhile
        return False
    if owner.get("host") != socket.gethostname():
        return False
    if not is_alive(owner):
        return True
    pids = [read_pid(p) for p in (folder.path / "pids").glob("rank-*.pid")]
    return bool(pids) and not any(pid is not None and _start_time(pid) is not None for pid in pids)


def this_process() -> dict:
    """This process as a record names its supervisor (and a pool its owner)."""
    return {"pid": os.getpid(), "start": _start_time(os.getpid()), "host": socket.gethostname()}


def status_of(error: BaseException | None) -> str:
    """The final status an outcome gives a run."""
    if error is None:
        return SUCCEEDED
    if isinstance(error, (KeyboardInterrupt, RunCancelledError)):
        return CANCELLED
    if isinstance(error, RunTimeoutError):
        return TIMEOUT
    if isinstance(error, RunPreemptedError):
        return PREEMPTED
    return FAILED


def _error_line(error: BaseException | None) -> str | None:
    if error is None:
        return None
    if isinstance(error, RunFailedError):
        return error.root_line()
    if isinstance(error, KeyboardInterrupt):
        return "interrupted: every rank was stopped"
    return f"{type(error).__name__}: {error}"


def _created(record: Record) -> float | None:
    try:
        return record.read()["created"]
    except (OSError, ValueError, KeyError):
        return None


def is_alive(supervisor: dict | None, created: float | None = None) -> bool:
    """Whether the process a record names as its supervisor still runs. A record that names
    none yet is given NAMING_SECONDS from its creation for its supervisor to start."""
    if not supervisor:
        return created is None or time.time() - created < NAMING_SECONDS
    if supervisor.get("host") != socket.gethostname():
        return True  # another machine's process: trust the record
    started = _start_time(supervisor["pid"])
    return started is not None and started == supervisor["start"]


def _start_time(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot): a pid reused by another process
    has another start time. None when there is no such process, or only its corpse (a zombie
    nobody reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])
