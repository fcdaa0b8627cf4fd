"""A run's record: its folder under the runs directory and ``record.json``, what any process
can read later (the handle, ``gpufleet runs``, ``gpufleet status``) — docs/design.md.

One process writes a record: the one that supervises the run (the caller of
``.distributed()``, the CLI, or the background process of ``.submit()``). It names itself in
the record (pid, its start time, host), so a reader can tell a run still going from one whose
supervisor died without writing an end ("lost").
"""

from __future__ import annotations

import json
import math
import os
import pickle
import re
import socket
import stat
import time
from enum import Enum
from pathlib import Path

from gpufleet import _process
from gpufleet.errors import (
    ConfigError,
    GpufleetError,
    RunCancelledError,
    RunFailedError,
    RunPreemptedError,
    RunTimeoutError,
)
from gpufleet.payload import write_private
from gpufleet.rundir import (
    CANCEL_REQUEST,
    Attempt,
    RunDir,
    attempt_folder,
    ensure_private_dir,
    new_id,
    read_pid,
    runs_root,
)


class RunStatus(str, Enum):
    """Where a run stands. A ``str``: it is written to record.json and compared as text."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    TIMEOUT = "timeout"
    CANCELLED = "cancelled"
    PREEMPTED = "preempted"
    LOST = "lost"  # never ended, and its supervisor is gone
    DAMAGED = "damaged"  # a record.json that cannot be read as a record (cut short, edited)

    def __str__(self) -> str:
        return self.value


QUEUED, RUNNING, SUCCEEDED, FAILED, TIMEOUT, CANCELLED, PREEMPTED, LOST, DAMAGED = RunStatus
# a damaged record's run counts as over: nobody can follow, end or cancel it
FINAL = (SUCCEEDED, FAILED, TIMEOUT, CANCELLED, PREEMPTED, LOST, DAMAGED)
WRITTEN = (QUEUED, RUNNING, SUCCEEDED, FAILED, TIMEOUT, CANCELLED, PREEMPTED)  # what a record says
# The format of record.json, written in every record as "schema". A record without the field
# was written before it existed and has the fields of format 1.
SCHEMA = 2
NAMING_SECONDS = 60.0  # for a submitted run's supervisor to start and name itself
# Space set aside while a run is going, freed for its error and final status: a run that
# fills its disk (logs, results) can still say how it ended.
SPARE_BYTES = 2**20


class DamagedRecordError(ConfigError):
    """A ``record.json`` that is not a record this gpufleet can read; says which file and what
    is wrong with it. ``newer``: it is whole, in a format of a newer gpufleet."""

    newer = False


class Record:
    """The folder ``<runs_dir>/<id>/`` of one run and its ``record.json``."""

    def __init__(self, path: Path):
        self.path = Path(path)

    @classmethod
    def create(cls, runs_dir: Path | None, name: str, run_id: str | None = None, **fields) -> "Record":
        """A new run's folder and record; ``run_id`` keeps an id given elsewhere (a run
        supervised on a cluster has one id on the cluster and on the machine it came from)."""
        root = runs_root(runs_dir)
        ensure_private_dir(root)
        record = cls(root / (run_id or new_id(name)))
        record.path.mkdir(mode=0o700)
        _set_aside(record.spare, SPARE_BYTES)
        record._write({
            "schema": SCHEMA, "id": record.id, "name": name, "status": QUEUED,
            "created": time.time(), "started": None, "ended": None, "attempts": [], "devices": [], "error": None,
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

    def attempt(self, number: int) -> Attempt:
        """Attempt ``number`` (0: the first; a retry is a new attempt)."""
        return Attempt(attempt_folder(self.path, number), number)

    def new_attempt(self) -> Attempt:
        attempts = self.read()["attempts"]
        attempt = Attempt.start(self.path, len(attempts))
        self.update(attempts=[*attempts, attempt.path.name])
        return attempt

    def last_attempt(self) -> Attempt | None:
        attempts = self.read()["attempts"]  # checked: "attempt-N" each
        return self.attempt(int(attempts[-1].split("-")[1])) if attempts else None

    def read(self) -> dict:
        """The record, checked field by field: DamagedRecordError naming the file and what is
        wrong with it (FileNotFoundError: the run's folder was deleted meanwhile)."""
        try:
            raw = self.file.read_bytes()
        except FileNotFoundError:
            raise
        except OSError as exc:
            raise self._damaged(f"it cannot be read: {exc.strerror or exc}") from None
        try:
            data = json.loads(raw)
        except ValueError as exc:  # JSONDecodeError, or bytes that are not text
            what = "it is empty" if not raw.strip() else f"it is not valid JSON ({exc})"
            raise self._damaged(f"{what}, as if cut short or edited") from None
        problem = _problem(data)
        if problem:
            raise self._damaged(problem)
        data.setdefault("schema", SCHEMA - 1)
        return data

    def _damaged(self, problem: str) -> DamagedRecordError:
        newer = problem.startswith("it was written by a newer")
        fix = ("upgrade gpufleet" if newer else
               "`gpufleet prune` counts its run as ended, or delete the run's folder")
        error = DamagedRecordError(f"damaged run record {self.file}: {problem}; {fix}")
        error.newer = newer
        return error

    def update(self, **fields) -> dict:
        data = self.read()
        data.update(fields)
        self._write(data)
        return data

    def supervised_here(self) -> None:
        """Name this process as the run's supervisor."""
        self.update(supervisor=_process.this_process())

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

    def status(self) -> RunStatus:
        """The recorded status, "lost" when the run never ended and its supervisor is gone,
        or "damaged" when its record cannot be read (``read()`` says why)."""
        try:
            data = self.read()
            if data["status"] in FINAL or is_alive(data.get("supervisor"), data["created"]):
                return RunStatus(data["status"])
            data = self.read()  # it may have ended just before it exited
        except DamagedRecordError:
            return DAMAGED
        return RunStatus(data["status"]) if data["status"] in FINAL else LOST

    @property
    def cancel_request(self) -> Path:
        """Exists once someone asked to cancel the run (``Run.cancel()``)."""
        return self.path / CANCEL_REQUEST

    def _write(self, data: dict) -> None:
        write_private(self.file, json.dumps({**data, "schema": SCHEMA}, indent=1).encode())


def _problem(data) -> str | None:
    """What is wrong with a record's fields (None: nothing), for the fields every reader uses;
    a field gpufleet does not know is kept and shown as it is."""
    if not isinstance(data, dict):
        return f"it holds a JSON {type(data).__name__}, not a record (a mapping of fields)"
    schema = data.get("schema", SCHEMA - 1)
    if not _whole(schema) or schema < 1:
        return f"its field 'schema' is {_what(schema)}; it must be a record format, 1 to {SCHEMA}"
    if schema > SCHEMA:
        return (f"it was written by a newer gpufleet (record format {schema}; this gpufleet "
                f"reads formats 1 to {SCHEMA})")
    for name, (check, must) in _FIELDS.items():
        if name not in data:
            return f"its field {name!r} is missing"
        if not check(data[name]):
            return f"its field {name!r} is {_what(data[name])}; it must be {must}"
    supervisor = data.get("supervisor")
    if supervisor is not None and not _is_process(supervisor):
        return (f"its field 'supervisor' is {_what(supervisor)}; it must be a process "
                "(pid, start, host)")
    return None


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _time(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_process(value) -> bool:
    return (isinstance(value, dict) and _whole(value.get("pid"))
            and isinstance(value.get("host"), str)
            and (value.get("start") is None or _whole(value.get("start"))))


def _what(value) -> str:
    """A field's value in a message: short, and only its type where it could be long."""
    if isinstance(value, str):
        return repr(value) if len(value) <= 40 else f"a string of {len(value)} characters"
    if value is None or isinstance(value, (bool, int, float)):
        return repr(value)
    return f"a {type(value).__name__}"


# the fields every reader of a record uses: what each must be, and how to tell
_FIELDS = {
    "id": (lambda v: isinstance(v, str) and bool(v), "the run's id"),
    "name": (lambda v: isinstance(v, str), "the run's name"),
    "status": (lambda v: v in WRITTEN, f"one of {', '.join(WRITTEN)}"),
    "created": (_time, "a time (seconds since 1970)"),
    "started": (lambda v: v is None or _time(v), "a time or null"),
    "ended": (lambda v: v is None or _time(v), "a time or null"),
    "gpus": (lambda v: _whole(v) and v >= 1, "the number of ranks"),
    "attempts": (lambda v: isinstance(v, list) and all(
        isinstance(a, str) and re.fullmatch(r"attempt-\d+", a) for a in v),
        "a list of attempt folders (attempt-0, attempt-1, ...)"),
    "devices": (lambda v: isinstance(v, list) and all(isinstance(d, str) for d in v),
                "a list of device names"),
    "error": (lambda v: v is None or isinstance(v, str), "a line or null"),
}


def _set_aside(path: Path, size: int) -> None:
    """A file of ``size`` bytes that really takes its blocks (not a sparse one)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
    except (AttributeError, OSError):  # no fallocate (macOS), or a file system without it: write them
        os.write(fd, bytes(size))
    finally:
        os.close(fd)


def find(run_id: str, runs_dir: Path | None = None) -> Record:
    """A run by its id, a unique start of it, or its unique 6-digit end; its record is read
    (DamagedRecordError when that fails), so a handle on it can be used."""
    record = _match(run_id, runs_dir)
    record.read()
    return record


def _match(run_id: str, runs_dir: Path | None) -> Record:
    root = runs_root(runs_dir)
    exact = root / run_id
    if run_id and "/" not in run_id and _has_record(exact):
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
    """Every run under the runs directory, newest first; a damaged record's too (dated by
    when its folder last changed), so that it is seen and can be pruned."""
    found = [Record(p) for p in _folders(runs_root(runs_dir))
             if not p.name.startswith(PRUNING) and _has_record(p)]
    dated = [(when, r) for r in found if (when := _created(r)) is not None]  # deleted meanwhile
    return [r for _, r in sorted(dated, key=lambda item: item[0], reverse=True)]


def _folders(root: Path) -> list[Path]:
    """What the runs folder holds (nothing before the first run); ConfigError naming it when
    this user may not read it."""
    try:
        return list(root.iterdir())
    except FileNotFoundError:
        return []
    except OSError as exc:
        check_folder(root, "the runs folder")
        raise ConfigError(f"cannot read the runs folder {root}: {exc.strerror or exc}") from None


def _has_record(folder: Path) -> bool:
    try:
        return (folder / "record.json").is_file()
    except PermissionError:  # a run folder this user may not look into: listed as damaged
        return True


OWN_FOLDER = "use a folder of your own (--runs-dir DIR, runs_dir=, or GPUFLEET_HOME)"


def check_folder(folder: Path, what: str, write: bool = False, fix: str = OWN_FOLDER) -> None:
    """ConfigError naming ``folder`` unless this user may read it and, with ``write``, create
    and change what is in it (or create it): said before anything starts, not as a
    PermissionError halfway."""
    folder = Path(folder).absolute()
    steps = [*reversed(folder.parents), folder]
    for above, step in zip([None, *steps], steps):
        if not os.path.lexists(step):  # created when needed: its parent must let us
            if write and above is not None and not os.access(above, os.W_OK | os.X_OK):
                _refuse(folder, what, above, "is not writable by you", fix)
            return
        if not os.path.isdir(step):
            _refuse(folder, what, step, "is not a folder", fix)
        need = os.X_OK if step != folder else os.R_OK | os.X_OK | (os.W_OK if write else 0)
        if not os.access(step, need):
            _refuse(folder, what, step, "is not open to you", fix)


def _refuse(folder: Path, what: str, step: Path, why: str, fix: str) -> None:
    try:
        info = step.stat()
        whose = (f" (owner uid {info.st_uid}, mode {stat.filemode(info.st_mode)}; "
                 f"you are uid {os.getuid()})")
    except OSError:
        whose = ""
    where = "it" if step == folder else str(step)
    raise ConfigError(f"cannot use {what} {folder}: {where} {why}{whose}; {fix}")


PRUNING = ".pruning-"  # a folder being deleted by ``gpufleet prune`` (hidden from listings)


def prunable(runs_dir: Path | None, older_than: float | None, keep: int | None) -> list[Path]:
    """The folders ``gpufleet prune`` deletes: runs that ended more than ``older_than``
    seconds ago and are not among the ``keep`` most recently ended (either limit may be
    None); with ``older_than``, the folders of warm pools that are gone and unchanged for that
    long; and what an earlier prune left half deleted. A queued or running run, or a pool
    still starting or serving, is never one of them."""
    root = runs_root(runs_dir)
    now = time.time()
    ended = [(when, r.path) for r in all_records(runs_dir) if (when := _ended_at(r)) is not None]
    ended.sort(reverse=True)
    chosen = [path for when, path in ended[keep or 0:] if older_than is None or now - when > older_than]
    for folder in sorted(_folders(root)):
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
    return bool(pids) and not any(pid is not None and _process.start_ticks(pid) is not None for pid in pids)


def status_of(error: BaseException | None) -> RunStatus:
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
    """When the run was created; for a damaged record, when its folder last changed; None
    when it was deleted meanwhile."""
    try:
        return record.read()["created"]
    except DamagedRecordError:
        return _changed(record)
    except OSError:
        return None


def _ended_at(record: Record) -> float | None:
    """When the run ended; None while it is queued or running. A damaged record's run counts
    as ended when its folder last changed: nobody can follow it or end it any more. One in a
    newer gpufleet's format may be a run going on under that version: never pruned here."""
    try:
        status = record.status()
        if status == DAMAGED:
            return None if _newer(record) else _changed(record)
        return (record.read()["ended"] or record.file.stat().st_mtime) if status in FINAL else None
    except (OSError, DamagedRecordError):  # deleted, or damaged, meanwhile: left to the next prune
        return None


def _newer(record: Record) -> bool:
    try:
        record.read()
    except DamagedRecordError as error:
        return error.newer
    return False


def _changed(record: Record) -> float | None:
    try:
        return record.path.stat().st_mtime
    except OSError:  # deleted meanwhile
        return None


def is_alive(supervisor: dict | None, created: float | None = None) -> bool:
    """Whether the process a record names as its supervisor still runs. A record that names
    none yet is given NAMING_SECONDS from its creation for its supervisor to start."""
    if not supervisor:
        return created is None or time.time() - created < NAMING_SECONDS
    if supervisor.get("host") != socket.gethostname():
        return True  # another machine's process: trust the record
    return _process.is_running(supervisor["pid"], supervisor["start"])


