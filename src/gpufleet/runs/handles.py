"""Handles on runs: ``.submit()`` starts a run in a background process and returns a ``Run``;
``attach(run_id)`` and ``runs()`` give the same handle on any run in the runs folder, from any
process (docs/design.md, "Runs: records, handles, devices, the command line").
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, TextIO

from gpufleet import _environ, _process
from gpufleet._log import log
from gpufleet.errors import ConfigError, GpufleetError
from gpufleet.launchers import devices
from gpufleet.options import check_logs, logs_of_record
from gpufleet.options import shows as shows_live
from gpufleet.payload import load_private, write_private
from gpufleet.runs import records
from gpufleet.runs.records import Record
from gpufleet.watch.logs import LogFollower
from gpufleet.watch.outcome import collect
from gpufleet.watch.progress import ProgressFile

POLL_SECONDS = 0.1
CANCEL_ANSWER_SECONDS = 30.0  # for the supervisor to see the request and stop the ranks
CANCEL_WAIT_SECONDS = 60.0  # then, after an interrupt, for it to end


class Run:
    """A run of this machine's runs folder: started here by ``.submit()``, or found by id."""

    _poll_seconds = POLL_SECONDS  # how often ``wait`` asks whether the run ended

    def __init__(self, record: Record, process: subprocess.Popen | None = None):
        self._record = record
        self._process = process  # the background supervisor, when this process started it

    @property
    def id(self) -> str:
        return self._record.id

    @property
    def path(self) -> Path:
        """The run's folder: record.json, attempt-N/ (logs, results, timings), outcome.pkl."""
        return self._record.path

    @property
    def name(self) -> str:
        return self.record()["name"]

    def record(self) -> dict:
        """What ``record.json`` says now: status, times, devices, attempts, error."""
        return self._record.read()

    def status(self) -> str:
        """queued, running, succeeded, failed, timeout, cancelled, preempted or lost (a
        plain string: ``records.RunStatus``'s value)."""
        status = self._record.status()
        if status not in records.FINAL and self._process is not None and self._process.poll() is not None:
            status = self._record.status()  # it may have ended between the two reads
            status = status if status in records.FINAL else records.LOST
        return status.value

    def done(self) -> bool:
        return self.status() in records.FINAL

    def wait(self, timeout: float | None = None) -> str:
        """Block until the run ends; its final status. TimeoutError after ``timeout`` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.done():
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"run {self.id} is still {self.status()} after {timeout:g} s")
            time.sleep(self._poll_seconds)
        return self.status()

    def result(self, timeout: float | None = None) -> list:
        """Every rank's value in rank order, once the run succeeded; otherwise its error
        (RunFailedError and its kinds: RunCancelledError, RunTimeoutError, ...)."""
        status = self.wait(timeout)
        attempt = self._record.last_attempt()
        if status == records.SUCCEEDED and attempt is not None:  # a success had an attempt
            return collect(attempt, self.record()["gpus"])
        if status == records.DAMAGED:
            self.record()  # raises the error that names the file and what is wrong with it
        if self._record.outcome.exists():
            raise load_private(self._record.outcome)
        raise GpufleetError(
            f"run {self.id} is {status} and left no error: its supervising process "
            f"ended without writing one (its log: {self._record.supervisor_log})"
        )

    def logs(self, rank: int | None = None, follow: bool = False, out: TextIO | None = None,
             logs: Any = None) -> str | None:
        """The last attempt's output: every rank's lines prefixed ``[rank N]``, or one rank's
        own text. With ``out`` they are written there as they are read (in memory a line at
        a time, whatever the size of the logs) and None is returned. ``follow=True`` prints
        them as they come until the run ends (to ``out``, default stdout) and returns None:
        the ranks the run's ``logs`` option shows live (all of them, rank 0, none, or those
        listed), or those ``logs`` gives here, or ``rank`` alone; Ctrl-C stops following
        (KeyboardInterrupt), not the run."""
        world = self._ranks(rank)
        if follow:
            shown = logs_of_record(self.record().get("logs")) if logs is None else check_logs(logs)
            self._follow(rank, world, out or sys.stdout, shown)
            return None
        text = io.StringIO()
        attempt = self._record.last_attempt()
        if attempt is not None and rank is not None:
            _copy_log(attempt.log(rank), out or text, None)
        elif attempt is not None:
            for r in range(world):
                _copy_log(attempt.log(r), out or text, f"[rank {r}] ")
        return text.getvalue() if out is None else None

    def progress(self) -> tuple[int | None, dict[str, float]]:
        """Rank 0's last step and metrics (``gpufleet.log_metrics``) in the current attempt,
        as the run goes: ``(None, {})`` before the first. What a sweep ranks trials by, and
        what prunes an Optuna trial."""
        attempt = self._record.last_attempt()
        if attempt is None:
            return None, {}
        return ProgressFile(attempt.progress).read()

    def cancel(self) -> str:
        """Stop every rank and wait for the run to end; its final status ("cancelled", or
        how it had ended already: cancelling an ended run changes nothing). A queued run
        ends without starting."""
        if self.done():
            return self.status()
        supervisor = self.record().get("supervisor") or {}
        if supervisor.get("host", socket.gethostname()) != socket.gethostname():
            raise ConfigError(
                f"run {self.id} is supervised on {supervisor['host']}: cancel it there "
                f"(gpufleet cancel {self.id})"
            )
        write_private(self._record.cancel_request, b"cancel\n")  # its supervisor polls for it
        try:
            return self.wait(CANCEL_ANSWER_SECONDS)
        except TimeoutError:
            pass
        data = self.record()  # a background supervisor that does not answer: interrupt it
        if data.get("background") and records.is_alive(data.get("supervisor"), data["created"]):
            with contextlib.suppress(ProcessLookupError, TypeError):
                os.kill(data["supervisor"]["pid"], signal.SIGINT)
        return self.wait(CANCEL_WAIT_SECONDS)

    def _ranks(self, rank: int | None) -> int:
        world = self.record()["gpus"]
        if rank is not None and not 0 <= rank < world:
            raise ConfigError(f"rank={rank} is not a rank of run {self.id}: it has ranks 0 to {world - 1}")
        return world

    def _follow(self, rank: int | None, world: int, out: TextIO, live: Any) -> None:
        def shows(r: int) -> bool:
            return r == rank if rank is not None else shows_live(live, r)

        attempt = follower = None
        try:  # Ctrl-C stops following (KeyboardInterrupt), not the run
            while True:
                ended = self.done()
                latest = self._record.last_attempt()
                if latest != attempt and latest is not None:
                    if follower is not None:
                        follower.close()
                    attempt, follower = latest, LogFollower(latest.log, world, shows, out, collapse=True)
                if follower is not None:
                    follower.poll()
                if ended:
                    break
                time.sleep(POLL_SECONDS)
        finally:
            if follower is not None:
                follower.close()

    def __repr__(self) -> str:
        return f"<gpufleet.Run {self.id} {self.status()}>"


def submit(call, cwd: Path | None = None, env: dict[str, str] | None = None, **fields) -> Run:
    """Start ``call`` (``calls.Call``) in a background supervising process, in ``cwd`` (default
    this process's) with ``env`` added to its environment; ``fields`` go into the record. Its
    place in line for devices is taken now, so runs submitted in a row start in that order."""
    import cloudpickle

    from gpufleet.runs import cluster

    address = cluster.jobs_address(call, submitting=True)
    if address is not None:  # supervised on the cluster, as a Ray job
        return cluster.submit(call, address, argv=fields.get("argv"))
    record = call.record(detached=call.options.detach, background=True, **fields)
    env = dict(env or {})
    ticket = secrets = None
    try:
        # environment values never touch the disk: they reach the supervisor in memory
        write_private(record.call, cloudpickle.dumps(
            dataclasses.replace(call, options=call.options.without_secrets())))
        secrets = _in_memory(json.dumps(call.options.secrets()).encode())
        env[_environ.CALL_SECRETS_FD] = str(secrets)
        # as calls._hold_devices: a run started inside a rank holds no devices of its own
        if call.placement.takes_devices and not call.options.remote and _environ.run_dir() is None:
            ticket = devices.reserve(record.id, record.read()["created"])
            env[_environ.DEVICE_TICKET] = ticket.spec()
        process = _start_supervisor(record, call.options.detach, cwd, env, ticket, secrets)
    except BaseException as exc:  # never started: say so in its record
        record.end(exc)
        raise
    finally:
        if ticket is not None:
            ticket.hand_over()
        if secrets is not None:
            os.close(secrets)  # the supervisor holds its own copy
    # reaped as soon as it ends, so that a reader elsewhere never sees its corpse as alive
    threading.Thread(target=process.wait, name=f"gpufleet-reap-{record.id}", daemon=True).start()
    return Run(record, process)


def _in_memory(data: bytes) -> int:
    """A descriptor of an anonymous in-memory file holding ``data`` (no path, no disk). Where
    there is no ``memfd_create`` (macOS), an unlinked 0600 temporary file: in no folder by the
    time the supervisor starts, though the system may page it to disk."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("gpufleet-call-secrets")
    else:
        fd, path = tempfile.mkstemp(prefix="gpufleet-call-secrets-")
        os.unlink(path)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    return fd


def _start_supervisor(record: Record, detached: bool, cwd: Path | None, extra: dict[str, str],
                      ticket, secrets: int) -> subprocess.Popen:
    """``python -m gpufleet.runs.background RECORD`` in its own session, its output in the run's
    supervisor.log. Without ``detach`` it dies with this process (the death signal follows
    the thread that starts it: the launcher's long-lived starter thread)."""
    # the same home (device locks, line) whatever folder the supervisor runs in
    env = {**_environ.snapshot(), "GPUFLEET_HOME": str(_environ.gpufleet_home()), **extra}
    env.pop(_environ.PARENT_PID, None)
    if not detached:
        env[_environ.PARENT_PID] = str(os.getpid())
    log_file = os.open(record.supervisor_log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        return _process.starter().run(
            subprocess.Popen, [sys.executable, "-m", _process.SUPERVISOR_MODULE, str(record.path)],
            env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
            start_new_session=True, pass_fds=(secrets, *((ticket.fd,) if ticket is not None else ())),
        )
    finally:
        os.close(log_file)


def attach(run_id: str, runs_dir: str | os.PathLike | None = None, ray_address: str | None = None) -> Run:
    """The handle of a run by its id (or a unique start or 6-digit end of it), from any
    process: a detached run's logs and result after the notebook that started it is gone.
    A run not in this machine's runs folder is looked for in the Ray cluster whose Jobs
    address (``http://HEAD:8265``) ``ray_address`` or RAY_ADDRESS gives."""
    from gpufleet.launchers.ray import dashboard_address
    from gpufleet.runs import cluster

    try:
        return cluster.attached(records.find(run_id, _root(runs_dir)))
    except ConfigError:
        address = dashboard_address(ray_address)
        if address is None:
            raise
        return cluster.find(run_id, address, _root(runs_dir))


def runs(runs_dir: str | os.PathLike | None = None, ray_address: str | None = None) -> list[Run]:
    """Every run in the runs folder, newest first; with a Ray Jobs address
    (``ray_address`` or RAY_ADDRESS), every run of that cluster too."""
    from gpufleet.launchers.ray import dashboard_address
    from gpufleet.runs import cluster

    address = dashboard_address(ray_address)
    if address is not None:
        try:
            cluster.sync(address, _root(runs_dir))
        except ConfigError as exc:  # this machine's runs are worth listing all the same
            log.warning(f"{exc}; listing this machine's runs only")
    return [cluster.attached(r) for r in records.all_records(_root(runs_dir))]


def _root(runs_dir) -> Path | None:
    return Path(runs_dir).expanduser() if runs_dir is not None else None


def _copy_log(path: Path, out: TextIO, prefix: str | None) -> None:
    """A rank's log into ``out``, each line after ``prefix`` (None: the text as it is)."""
    try:
        log = open(path, errors="replace")
    except FileNotFoundError:
        return
    with log:
        if prefix is None:
            shutil.copyfileobj(log, out)
            return
        for line in log:
            out.write(f"{prefix}{line.rstrip(chr(10))}\n")
