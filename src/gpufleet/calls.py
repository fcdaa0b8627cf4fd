"""One call, from checked input to values or one error: its record, its devices, its attempts.

The same code supervises a call in the caller (``.distributed()``, ``gpufleet run``) and in
the background process of a submitted run (``_submitted.py``).
"""

from __future__ import annotations

import contextlib
import errno
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpufleet import _environ, devices, hardware, launchers, pools
from gpufleet.errors import RunCancelledError, RunFailedError, RunPreemptedError, RunTimeoutError
from gpufleet.hardware import Placement
from gpufleet.options import RunOptions, check_world
from gpufleet.payload import dump_call, free_space_note, write_private
from gpufleet.records import Record
from gpufleet.rundir import RunDir
from gpufleet.supervisor import Preemption, Supervisor
from gpufleet.tracking import PendingTracking
from gpufleet.tracking import status_of as tracking_status


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

    @classmethod
    def prepare(cls, fn: Callable, args: tuple, kwargs: dict, options: RunOptions, name: str,
                function: str, **more) -> "Call":
        """Check everything that can be checked before a process starts; ConfigError or
        PayloadError otherwise."""
        if options.remote:  # bad input fails before connecting to (or starting) a Ray cluster
            payload = dump_call(fn, args, kwargs)
            placement = launchers.get(options.remote).place(options)
            check_world(options, placement.nprocs)
        else:
            placement = hardware.place(options.gpus, options.gpu_type)
            check_world(options, placement.nprocs)
            payload = dump_call(fn, args, kwargs)
        return cls(options.name or name, function, payload, placement, options, **more)

    def record(self, **fields) -> Record:
        return Record.create(
            self.options.runs_dir, self.name, function=self.function, kind=self.kind,
            gpus=self.placement.nprocs, device=self.placement.device,
            remote=self.options.remote or None, **fields,
        )


def execute(call: Call, record: Record, on_attempt: Callable[[Path], None] | None = None,
            ticket: devices.Ticket | None = None) -> list:
    """Run the call to its end in this process; the record says how it went. ``ticket``: its
    place in line for devices, taken when it was submitted."""
    if call.placement.device == "cpu":
        print(f"gpufleet: {call.placement.describe()}", file=sys.stderr, flush=True)
    return _Execution(call, record, on_attempt, ticket).run()


class _Execution:
    """The state of one call while it runs: its attempts, devices and MLflow run."""

    def __init__(self, call: Call, record: Record, on_attempt, ticket):
        self.call = call
        self.ticket = ticket
        self.record = record
        self.on_attempt = on_attempt or (lambda path: None)
        self.opts = call.options
        self.lease: devices.Lease | None = None
        self.began = False
        self.deadline: float | None = None
        self.tracking = PendingTracking(self.opts.tracking, call.name, {
            "function": call.function, "gpus": call.placement.nprocs,
            "world_size": call.placement.nprocs, "device": call.placement.device, **call.params,
        })

    def run(self) -> list:
        outcome: BaseException | None = None
        try:
            with Preemption().installed() as self.preemption:
                return self._attempts()
        except BaseException as exc:
            outcome = exc
            raise
        finally:
            try:
                if self.ticket is not None:  # a place in line it never needed (a pool, Ray)
                    self.ticket.drop()
                self._release_devices()  # first: nothing below may keep the GPUs held
            finally:
                # the error, then MLflow's status, then the run's: a record that says ended
                # means MLflow's run has ended too (or could not be ended in time)
                with self._bookkeeping("its error"):
                    self.record.keep(outcome)
                try:
                    if self.tracking.enabled:
                        self.tracking.close(tracking_status(outcome))
                finally:
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
            print(f"gpufleet: could not keep {what} in {self.record.path}: "
                  f"{exc.strerror or exc}{free_space_note(self.record.path, exc.errno == errno.ENOSPC)}",
                  file=sys.stderr, flush=True)

    def _attempts(self) -> list:
        earlier: list[RunFailedError] = []
        while True:
            try:
                return self._run(len(earlier), self.call.called_at if not earlier else time.time())
            except RunFailedError as error:
                if (self.preemption.requested_at is not None or len(earlier) == self.opts.max_retries
                        or not retryable(error, self.opts.no_retry)):
                    if not earlier:
                        raise
                    raise error.after(earlier) from error.__cause__
                earlier.append(error)
                print(
                    f"gpufleet: attempt {len(earlier)} of {self.opts.max_retries + 1} failed "
                    f"({error.root_line()}); starting every rank again",
                    file=sys.stderr, flush=True,
                )

    def _run(self, attempt: int, called_at: float) -> list:
        """One attempt: a run folder of its own, an agent, its ranks."""
        if self.record.cancel_request.exists():  # before it starts, or between attempts
            raise self.record.cancelled()
        run = self.record.new_attempt()
        self.on_attempt(run.path)
        write_private(run.payload, self.call.payload)
        launcher = launchers.get(self.opts.remote or "local")
        # said either way: a call made inside a tracked rank inherits that rank's "1"
        env = {_environ.TRACKED: "1" if self.tracking.enabled else "0"}
        stamps = {"call": called_at, "attempt_started": time.time()}
        placement = self.call.placement
        if self.opts.remote:  # the ranks run on a cluster; the job stands for the agent
            self._begin(run)
            job = launcher.launch(launcher.plan(run, placement, self.opts, attempt, env), run, self.deadline)
            return self._supervise(run, job, stamps, attempt, monitor=job.monitor)
        plan = launcher.plan(run, placement, self.opts, attempt, env)
        warm = pools.for_call(self.opts, placement)
        with warm._lease(plan.env, self._stop_waiting) if warm else contextlib.nullcontext() as ranks:
            # no pool, it closed meanwhile, or the call was stopped while the pool waited for
            # devices (then the cold path's own wait says so at once)
            if ranks is None:
                self._hold_devices(run)
                plan = launcher.plan(run, placement, self.opts, attempt, {**env, **self.lease.env()})
                return self._supervise(run, launcher.launch(plan, run), stamps, attempt)
            self._begin(run, ranks.lease.ids)
            stamps["pool_ready"] = time.time()  # after any (re)start of the pool's ranks
            ranks.hand_over(run, plan.env)
            return self._supervise(run, ranks.agent, stamps, attempt, ranks.folder)

    def _hold_devices(self, run: RunDir) -> None:
        """Take this machine's devices for the call (once: retries keep them)."""
        if self.lease is None:
            # a run started inside a rank uses the rank's own devices, which its run holds
            if self.call.placement.takes_devices and _environ.run_dir() is None:
                ticket, self.ticket = self.ticket, None  # acquire drops it when done
                self.lease = devices.acquire(
                    self.call.placement.nprocs, self.record.id, self._queued,
                    stopped=self._stop_waiting, since=self.record.read()["created"],
                    ticket=ticket,
                )
                if self.lease is None:
                    raise self._stopped_while_queued(run)
            else:
                self.lease = devices.Lease()
        self._begin(run, self.lease.ids)

    def _stop_waiting(self) -> bool:
        return (self.preemption.requested_at is not None or self.record.cancel_request.exists()
                or not self.record.path.is_dir())

    def _stopped_while_queued(self, run: RunDir) -> RunFailedError:
        if not self.record.path.is_dir():
            return RunFailedError(
                [], run_dir=run.path, world_size=self.call.placement.nprocs,
                headline=f"the run's folder {self.record.path} was deleted while the run waited "
                "for free GPUs: it never started",
            )
        if self.preemption.requested_at is None:
            return self.record.cancelled()
        return RunPreemptedError(
            [], run_dir=run.path, world_size=self.call.placement.nprocs,
            headline="SIGTERM while the run waited for free GPUs: it never started",
        )

    def _queued(self, holders: list[str]) -> None:
        pools.give_up_devices(holders)  # this process's own idle pools would hold them forever
        held = f" (held by {', '.join(sorted(set(holders)))})" if holders else ""
        n = self.call.placement.nprocs
        print(
            f"gpufleet: {self.record.id} is queued: waiting for {n} free GPU{'s' if n > 1 else ''}{held}",
            file=sys.stderr, flush=True,
        )

    def _begin(self, run: RunDir, device_ids: tuple[str, ...] = ()) -> None:
        """The call starts running: the timeout's clock starts, waiting for devices excluded."""
        if not self.began:
            self.began = True
            self.record.begin(device_ids)
            if self.opts.timeout is not None:
                self.deadline = time.monotonic() + self.opts.timeout

    def _supervise(self, run: RunDir, agent, stamps: dict, attempt: int,
                   pool_folder: RunDir | None = None, monitor=None) -> list:
        self.tracking.begin()  # created while the ranks start; the supervisor hands it over
        supervisor = Supervisor(
            run, agent, self.call.placement.nprocs, self.opts, self.preemption, stamps,
            self.tracking if self.tracking.enabled else None, attempt,
            launcher=pool_folder, pooled=pool_folder is not None, monitor=monitor,
        )
        return supervisor.wait(self.deadline)

    def _release_devices(self) -> None:
        """Free the devices once the values are back: the ranks may still be exiting (their
        CUDA and NCCL teardown, about a second), which the next run of this process, or of
        the line, overlaps, as it would after a torchrun job returned."""
        if self.lease is not None:
            self.lease.release()


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
