"""One run, from checked input to values or one error: its record, its launcher, its attempts.

The same code runs a call in the caller (``.distributed()``, ``gpufleet run``) and in the
background process of a submitted run (``background.py``). Each attempt goes through the
launch seam (``launchers/base.py``): plan, launch, watch.
"""

from __future__ import annotations

import contextlib
import errno
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpufleet import _environ, launchers
from gpufleet._log import log
from gpufleet.errors import RunCancelledError, RunFailedError, RunPreemptedError, RunTimeoutError
from gpufleet.launchers import devices, template, warm
from gpufleet.launchers.base import Launcher
from gpufleet.launchers.hardware import Placement
from gpufleet.options import RunOptions, Surface, check_world, logs_to_record, surface_in_use
from gpufleet.payload import dump_call, free_space_note, write_private
from gpufleet.runs.records import Record
from gpufleet.tracking import PendingTracking, callers_run
from gpufleet.tracking import status_of as tracking_status
from gpufleet.watch.supervisor import Preemption, Supervisor


@dataclass
class Call:
    """A call ready to run: checked options, the machine's placement, the pickled payload."""

    name: str  # the run's name: the function's, or the script's
    function: str  # what runs, for MLflow's params: "module.qualname" or the script
    payload: bytes
    placement: Placement
    options: RunOptions
    kind: str = "function"  # or "script", "command"
    params: dict[str, Any] = field(default_factory=dict)  # more MLflow params (a workload's)
    called_at: float = field(default_factory=time.time)
    caller_run: str | None = None  # the MLflow run the caller was in: the call's run nests in it
    # how the caller wrote its options (Python, the command line, a workload file), for the
    # errors of a run supervised elsewhere: speaking(*call.surface)
    surface: tuple[Surface, dict[str, str]] = (Surface.PYTHON, {})

    @classmethod
    def prepare(cls, fn: Callable, args: tuple, kwargs: dict, options: RunOptions, name: str,
                function: str, **more) -> "Call":
        """Check everything that can be checked before a process starts; ConfigError or
        PayloadError otherwise."""
        _environ.tracking_allowed()  # a bad GPUFLEET_TRACKING fails here, before a record exists
        if _environ.template_allowed():  # and a bad GPUFLEET_TEMPLATE or GPUFLEET_TEMPLATE_IDLE
            _environ.template_idle_seconds()
        _environ.peak_flops(options.env)  # and a bad GPUFLEET_PEAK_FLOPS, here or in env=
        if launchers.nodes_wanted(options) and options.rdzv_id is None:  # the same on every machine
            from gpufleet.launchers import nodes

            options = options.replace(rdzv_id=nodes.default_id(options, name))
        if options.remote:  # bad input fails before connecting to (or starting) a Ray cluster
            payload = dump_call(fn, args, kwargs)
            placement = launchers.place(options)
            check_world(options, placement.nprocs)
        else:
            placement = launchers.place(options)
            check_world(options, placement.nprocs)
            payload = dump_call(fn, args, kwargs)
        more.setdefault("caller_run", callers_run())
        more.setdefault("surface", surface_in_use())
        return cls(options.name or name, function, payload, placement, options, **more)

    def record(self, **fields) -> Record:
        return Record.create(
            self.options.runs_dir, self.name, function=self.function, kind=self.kind,
            gpus=self.placement.nprocs, device=self.placement.device,
            remote=self.options.remote or None,
            straggler_threshold=self.options.straggler_threshold,
            logs=logs_to_record(self.options.logs),  # what following the run shows (Run.logs)
            **fields,
        )


def execute(call: Call, record: Record, on_attempt: Callable[[Path], None] | None = None,
            ticket: devices.Ticket | None = None, exits_after: bool = False) -> list:
    """Run the call to its end in this process; the record says how it went. ``ticket``: its
    place in line for devices, taken when it was submitted. ``exits_after``: this process
    exits once the call returns (the ``gpufleet`` command), so its MLflow run ends after it
    rather than before (``tracking.PendingTracking``)."""
    if call.placement.device == "cpu":
        log.info(call.placement.describe())
    return _Execution(call, record, on_attempt, ticket, exits_after).run()


class _Execution:
    """The state of one run while it goes: its attempts, its launcher and MLflow run. It is
    the launcher's gate (``launchers.base.Gate``): told when the ranks start, asked whether
    to go on waiting for devices."""

    def __init__(self, call: Call, record: Record, on_attempt, ticket, exits_after: bool):
        self.call = call
        self.ticket = ticket
        self.record = record
        self.owner = record.id
        self.since = record.read()["created"]
        self.on_attempt = on_attempt or (lambda path: None)
        self.opts = call.options
        self.launcher: Launcher | None = None
        self.began = False
        self.deadline: float | None = None
        self.exits_after = exits_after
        self.tracking = PendingTracking(self.opts.tracking, call.name, {
            "function": call.function, "gpus": call.placement.nprocs,
            "world_size": call.placement.nprocs, "device": call.placement.device, **call.params,
        }, record.path, call.caller_run, self.opts.join_mlflow_run, outlives=exits_after,
            fork=template.start_tracker)

    def run(self) -> list:
        outcome: BaseException | None = None
        try:
            with Preemption().installed() as self.preemption:
                self.launcher = launchers.for_run(self.call.placement, self.opts, self)
                return self._attempts()
        except BaseException as exc:
            outcome = exc
            raise
        finally:
            try:
                if self.ticket is not None:  # a place in line it never needed (a pool, Ray)
                    self.ticket.drop()
                if self.launcher is not None:  # first: nothing below may keep the GPUs held
                    self.launcher.close()
            finally:
                self._end(outcome)

    def _end(self, outcome: BaseException | None) -> None:
        """The error, then MLflow's status, then the run's: a record that says ended means
        MLflow's run has ended too (or could not be ended in time). A process that exits
        right after the call does not wait for MLflow: the record ends first, and the tracker
        ends the run after (and links it in the record when the caller did not learn its id)."""
        with self._bookkeeping("its error"):
            self.record.keep(outcome)
        if self.exits_after:
            self._close_record(outcome)
            self.tracking.close(tracking_status(outcome), outcome)
            return
        try:
            self.tracking.close(tracking_status(outcome), outcome)  # the run's logs, timings and error go with it
        finally:
            self._close_record(outcome)

    def _close_record(self, outcome: BaseException | None) -> None:
        with self._bookkeeping("its final status"):
            if self.tracking.run_id:
                self.record.update(mlflow_run_id=self.tracking.run_id)
            self.record.close(outcome)

    @contextlib.contextmanager
    def _bookkeeping(self, what: str):
        """A record that cannot be written (a full disk, a deleted folder) is said in one line;
        it never replaces the run's own outcome, which is raised or returned all the same."""
        try:
            yield
        except OSError as exc:
            log.warning(f"could not keep {what} in {self.record.path}: "
                        f"{exc.strerror or exc}{free_space_note(self.record.path, exc.errno == errno.ENOSPC)}")

    def _attempts(self) -> list:
        earlier: list[RunFailedError] = []
        number = 0
        while True:
            try:
                return self._attempt(number, self.call.called_at if not number else time.time())
            except RunFailedError as error:
                number += 1
                assert self.launcher is not None
                if self.preemption.requested_at is None and self.launcher.resized(error):
                    log.warning(f"{error.root_line()}: the run's machines changed; starting every "
                                "rank again at the new size")
                    continue
                if (self.preemption.requested_at is not None or len(earlier) == self.opts.max_retries
                        or not retryable(error, self.opts.no_retry)):
                    if not earlier:
                        raise
                    raise error.after(earlier) from error.__cause__
                earlier.append(error)
                log.warning(f"attempt {len(earlier)} of {self.opts.max_retries + 1} failed "
                            f"({error.root_line()}); starting every rank again")

    def _attempt(self, number: int, called_at: float) -> list:
        """One attempt: a folder of its own, its plan, its job, watched to its end."""
        assert self.launcher is not None
        if self.record.cancel_request.exists():  # before it starts, or between attempts
            raise self.record.cancelled()
        attempt = self.record.new_attempt()
        self.on_attempt(attempt.path)
        write_private(attempt.payload, self.call.payload)
        # said either way: a call made inside a tracked rank inherits that rank's "1"
        env = {_environ.TRACKED: "1" if self.tracking.enabled else "0",
               _environ.STEP_TELEMETRY: "1" if self.opts.step_telemetry else "0"}
        stamps = {"call": called_at, "attempt_started": time.time()}
        plan = self.launcher.plan(attempt, env)
        with self.launcher.launch(plan) as job:
            self.tracking.begin()  # created while the ranks start; the watcher hands it over
            tracking = self.tracking if self.tracking.enabled else None
            supervisor = Supervisor(job, self.opts, self.preemption, stamps, tracking, number)
            return supervisor.wait(self.deadline)

    # -- the gate ---------------------------------------------------------------------------

    def stopped(self) -> bool:
        return (self.preemption.requested_at is not None or self.record.cancel_request.exists()
                or not self.record.path.is_dir())

    def never_started(self) -> RunFailedError:
        attempt = self.record.last_attempt()
        folder = attempt.path if attempt else self.record.path
        if not self.record.path.is_dir():
            return RunFailedError(
                [], run_dir=folder, world_size=self.call.placement.nprocs,
                headline=f"the run's folder {self.record.path} was deleted while the run waited "
                "for free GPUs: it never started",
            )
        if self.preemption.requested_at is None:
            return self.record.cancelled()
        return RunPreemptedError(
            [], run_dir=folder, world_size=self.call.placement.nprocs,
            headline="SIGTERM while the run waited for free GPUs: it never started",
        )

    def waiting(self, holders: list[str]) -> None:
        warm.give_up_devices(holders)  # this process's own idle pools would hold them forever
        held = f" (held by {', '.join(sorted(set(holders)))})" if holders else ""
        n = self.call.placement.nprocs
        log.info(f"{self.record.id} is queued: waiting for {n} free GPU{'s' if n > 1 else ''}{held}")

    def begin(self, device_ids: tuple[str, ...] = ()) -> float | None:
        """The run starts running: the timeout's clock starts, waiting for devices excluded."""
        if not self.began:
            self.began = True
            self.record.begin(device_ids)
            if self.opts.timeout is not None:
                self.deadline = time.monotonic() + self.opts.timeout
        return self.deadline


def retryable(error: RunFailedError, no_retry: tuple) -> bool:
    """A timeout ends the call (it bounds all attempts), a preemption too (this process is
    going away), and a cancel; so does a root cause in no_retry."""
    if isinstance(error, (RunTimeoutError, RunPreemptedError, RunCancelledError)):
        return False
    if not error.run_dir.parent.is_dir():  # the run's folder was deleted: nowhere to go on
        return False
    cause = error.__cause__
    if cause is not None:
        names = {type(cause).__name__, f"{type(cause).__module__}.{type(cause).__qualname__}"}
    else:  # the exception did not travel back: its name leads the summary line
        summary = error.root_cause.summary if error.root_cause else ""
        names = {summary.split(":", 1)[0], summary.split(":", 1)[0].rsplit(".", 1)[-1]}
    for kind in no_retry:
        if isinstance(kind, type) and isinstance(cause, kind):
            return False
        if isinstance(kind, str) and kind in names:
            return False
    return True
