"""The watcher: the caller's side of a running attempt. It streams the ranks' logs, enforces
the timeout, spots a hang, reacts to Ctrl-C and SIGTERM, always tears the job down, and has
``outcome.py`` turn what the ranks left behind into values or one error.

It drives a ``launchers.base.Job`` and knows no launcher: the same loop watches ranks on this
machine, on a warm pool, or on a cluster.
"""

from __future__ import annotations

import contextlib
import enum
import json
import signal
import subprocess
import threading
import time

from gpufleet import steps, telemetry, timings
from gpufleet._log import log
from gpufleet.errors import RunCancelledError, RunFailedError
from gpufleet.launchers.base import Job
from gpufleet.options import RunOptions
from gpufleet.payload import write_private
from gpufleet.tracking import CALLER_WAIT_S, Followed, PendingTracking
from gpufleet.watch import outcome, progress
from gpufleet.watch.logs import LogFollower

POLL_SECONDS = 0.05
QUICK_POLL_SECONDS = 0.005  # the first second of a call: a warm call may be over by then
QUICK_POLL_FOR_SECONDS = 1.0
STOP_GRACE_SECONDS = 5.0
TEARDOWN_SECONDS = 30.0  # for ranks that returned to exit (a rank's own limit is EXIT_GRACE_SECONDS)


class Preemption:
    """SIGTERM to this process while a call runs (installed once around all its attempts).

    The handler only takes note; the supervisor of the running attempt acts on it (asks the
    ranks to stop, starts the grace period), and no new attempt starts after it.
    """

    def __init__(self):
        self.requested_at: float | None = None  # time.monotonic() of the first SIGTERM
        self.repeated = False  # a second SIGTERM: end the grace period now

    @contextlib.contextmanager
    def installed(self):
        if threading.current_thread() is not threading.main_thread():
            yield self  # only the main thread may handle signals: never triggered here
            return

        def on_sigterm(signum, frame):
            if self.requested_at is None:
                self.requested_at = time.monotonic()
            else:
                self.repeated = True

        previous = signal.signal(signal.SIGTERM, on_sigterm)
        try:
            yield self
        finally:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


class Ending(enum.Enum):
    """Why the watcher stopped following an attempt."""

    DONE = "done"  # the launcher ended, or every rank wrote its result
    TIMEOUT = "timeout"  # the run's timeout expired
    HANG = "hang"  # no rank made progress for hang_timeout
    GRACE = "grace"  # the grace period after a SIGTERM is over
    CANCEL = "cancel"  # someone cancelled the run (``Run.cancel()``)
    DELETED = "deleted"  # the attempt's folder is gone


class Supervisor:
    def __init__(self, job: Job, options: RunOptions, preemption: Preemption,
                 stamps: dict[str, float], tracking: PendingTracking | None, attempt: int):
        """The attempt is done once every rank has written its result: the values are
        returned while the ranks and the launcher exit in the background (a warm pool's
        ranks live on). ``stamps``: the caller's instants so far (``timings.py``);
        ``tracking``: the run's MLflow run, handed to the ranks once it exists."""
        self.job = job
        self.folder = job.attempt  # where the ranks write
        self.world_size = job.world_size
        self.ranks = list(job.ranks)  # those that write into this folder: all, or one node's
        self.monitor = job.monitor
        self.returned = False  # every rank wrote its result and the ranks live on
        self.stamps = {**stamps, **job.stamps}
        self.began = self.stamps.get("call", time.time())  # for the status line's clock
        self.tracking = tracking  # handed to the ranks once ready (tracking.json)
        if tracking is not None:  # the nodes' samples and ranks' steps go into the MLflow run
            tracking.follow(Followed(self.folder, self.ranks, options.straggler_threshold))
        self.tracking_due = time.monotonic() + CALLER_WAIT_S
        self.number = attempt  # 0: the first attempt
        self.preemption = preemption
        self.options = options
        self.display = progress.open_display()  # draws nothing until the call has run a while
        self.follower = LogFollower(self.folder.log, self.ranks, self._shows, display=self.display,
                                    collapse=options.collapse_lines, pace=options.collapse_lines)
        self.progress = progress.ProgressFile(self.folder.progress)
        self.telemetry = telemetry.Latest(self.folder.telemetry)  # for the status line's GPUs
        self.steps = steps.Reader(self.folder, self.ranks)  # its throughput and stragglers
        self.stop_deadline: float | None = None  # set by a SIGTERM: the end of the grace period

    def _shows(self, rank: int) -> bool:
        """Whether ``rank``'s lines are shown live: the ranks written here are this machine's,
        in the order of their local ranks (``--local-ranks-filter`` names those)."""
        return self.options.shows_rank(rank, self.ranks.index(rank))

    def wait(self, deadline: float | None = None) -> list:
        """Block until every rank is done; return their values in rank order or raise.

        ``deadline`` (``time.monotonic()``) ends the wait; default: ``timeout`` from now.
        The run's timings are saved (and printed with ``show_timings``) either way.
        """
        error = None
        try:
            return self._wait(deadline)
        except BaseException as exc:
            error = exc
            raise
        finally:
            self.stamps["results_collected"] = time.time()
            self._close_display(error)
            self._save_timings()
            self._save_steps(error)

    def _show_status(self) -> None:
        """Refresh the status line when the display wants it (a few times a second)."""
        if self.display.due():
            self.display.show(self._status())

    def _close_display(self, error: BaseException | None) -> None:
        """The status line's final state says how the call ended."""
        final = self._status(progress.ending(error)) if self.display.shown else None
        self.display.close(final)

    def _status(self, outcome: str | None = None) -> progress.Status:
        step, metrics = self.progress.read()
        self.steps.read()
        return progress.Status(
            name=self.folder.name, world_size=len(self.ranks),  # alive of those here
            elapsed=time.time() - self.began,
            alive=None if outcome else self.monitor.alive(), step=step, metrics=metrics,
            attempt=self.number, outcome=outcome,
            steps=steps.compare(self.steps.recent, self.options.straggler_threshold),
            gpus="" if outcome else telemetry.describe_gpus(self.telemetry.read()),
        )

    def _save_timings(self) -> None:
        try:
            found = timings.gather(self.folder.path, self.stamps, self.ranks)
        except OSError:  # the run folder is gone: nothing to keep, nothing to print
            return
        if self.options.show_timings:
            log.info(f"timings of {self.folder.name}\n{found.table()}")

    def _save_steps(self, error: BaseException | None) -> None:
        """Keep the ranks' steps summed up (``steps.json``); print them when the call
        succeeded (a failure's report is about its error)."""
        self.steps.read()
        summary = steps.Summary.of(self.steps, self.options.straggler_threshold)
        if summary is None:
            return
        try:
            summary.save(self.folder.steps_summary)
        except OSError:  # the run folder is gone
            return
        if error is None:
            log.info(f"steps of {self.folder.name}:\n{summary.table()}")

    def _wait(self, deadline: float | None) -> list:
        if deadline is None and self.options.timeout is not None:
            deadline = time.monotonic() + self.options.timeout
        error = None
        try:
            ending = self._follow(deadline)
            error = self._stopping_error(ending)
            if ending == Ending.HANG and self.job.poll() is not None:  # it ended meanwhile
                ending, error = Ending.DONE, None
            if ending != Ending.DONE:
                self.stop()
        except KeyboardInterrupt:
            self.stop()
            log.warning(f"interrupted; stopped every rank of {self.folder.name}")
            raise
        finally:
            self.follower.close()
            if not (self.returned and self.job.poll() is None):
                self.job.release()
                self.stamps["agent_exited"] = time.time()
        if self.preemption.requested_at is not None:  # it outranks a hang or a timeout
            self._ask_to_stop()
            self._end_ranks()
            preempted = outcome.preempted(self.job, self.options)
            raise preempted from outcome.original_exception(preempted) or error
        if error is not None:
            raise error
        try:
            values = outcome.collect(self.folder, self.world_size, self.job)
        except RunFailedError:
            self._end_ranks()  # a failed call returns once its ranks are gone
            raise
        if self.returned and not self.job.keeps_ranks:
            if self.job.poll() is None:  # the values go back while the ranks and the agent exit
                # not a daemon: a script that ends right after the call still lets its ranks
                # finish their exit (atexit hooks, NCCL teardown) before the agent goes
                threading.Thread(target=self._teardown, name="gpufleet-teardown").start()
            else:  # it ended while the values were read, after the release was skipped
                self.job.release()
        return values

    def _stopping_error(self, ending: Ending) -> RunFailedError | None:
        """The error of an attempt the watcher is about to stop (None: it ended by itself)."""
        if ending == Ending.HANG:
            return outcome.hung(self.job, self.options)
        if ending == Ending.TIMEOUT:
            return outcome.timed_out(self.job, self.options)
        if ending == Ending.CANCEL:
            return RunCancelledError(
                [], run_dir=self.folder.path, world_size=self.world_size,
                headline=f"run {self.folder.run_id} was cancelled: every rank was stopped",
            )
        if ending == Ending.DELETED:
            return RunFailedError(
                [], run_dir=self.folder.path, world_size=self.world_size,
                headline=f"the run's folder {self.folder.path} was deleted while it ran, so its "
                "logs, results and record were gone: every rank was stopped",
            )
        return None

    def _end_ranks(self) -> None:
        """Wait for the ranks that returned, and their agent, to exit (a pool's live on)."""
        if self.returned and not self.job.keeps_ranks and self.job.poll() is None:
            self._teardown()
            self.stamps["agent_exited"] = time.time()

    def _follow(self, deadline: float | None) -> Ending:
        """Follow the attempt until it ends, or until it must be stopped (``Ending``)."""
        hang_timeout = self.options.hang_timeout
        quick_until = time.monotonic() + QUICK_POLL_FOR_SECONDS
        while self.job.poll() is None:
            if self.follower.poll():
                self.monitor.progress()
            if self.folder.cancel_request is not None and self.folder.cancel_request.exists():
                return Ending.CANCEL
            if not self.folder.path.is_dir():  # nothing could be kept, nor the run be cancelled
                return Ending.DELETED
            if all(self.folder.result(r).exists() for r in self.ranks):
                self.stamps["ranks_returned"] = time.time()
                self.follower.poll()
                self.returned = True
                return Ending.DONE
            self.monitor.sample()
            self._show_status()
            self._hand_over_tracking()
            if self.preemption.requested_at is not None:
                self._ask_to_stop()
            now = time.monotonic()
            if self.stop_deadline is not None and now > self.stop_deadline:
                return Ending.GRACE
            if deadline is not None and now > deadline:
                return Ending.TIMEOUT
            if hang_timeout is not None and self.stop_deadline is None:
                idle = self.monitor.seconds_without_progress()
                if idle is not None and idle > hang_timeout:
                    return Ending.HANG
            time.sleep(POLL_SECONDS if now > quick_until else QUICK_POLL_SECONDS)
        return Ending.DONE

    def _hand_over_tracking(self) -> None:
        """Once the call's MLflow run exists (or after CALLER_WAIT_S without it), write it for
        the ranks, which wait for it just before the function runs."""
        pending = self.tracking
        if pending is None or not (pending.ready() or time.monotonic() > self.tracking_due):
            return
        self.tracking = None
        try:
            write_private(self.folder.tracking, json.dumps(pending.env()).encode())
        except OSError as exc:  # the ranks go on untracked after their own wait
            log.warning(f"MLflow run not handed to the ranks: {exc}")
        pending.attempt(self.number)

    def _ask_to_stop(self) -> None:
        """After a SIGTERM: ``stop-requested`` in the run folder (``runtime.should_stop()``),
        one line for the user, and the end of the grace period (now, after a second SIGTERM)."""
        asked_at = self.preemption.requested_at
        if asked_at is None:
            return
        if self.stop_deadline is None:
            self.stop_deadline = asked_at + self.options.grace_period
            write_private(self.folder.stop_request, b"SIGTERM\n")
            log.warning(f"SIGTERM: asked every rank to stop (runtime.should_stop() is now True); "
                        f"ranks still running in {self.options.grace_period:g} s will be stopped")
        if self.preemption.repeated:
            self.stop_deadline = min(self.stop_deadline, time.monotonic())

    def stop(self) -> None:
        """Ask the job to stop every rank, then end whatever is left after a few seconds."""
        try:
            self.job.stop()
            end = time.monotonic() + STOP_GRACE_SECONDS
            while self.job.poll() is None and time.monotonic() < end:
                self.follower.poll()
                time.sleep(POLL_SECONDS)
        finally:  # a second Ctrl-C lands here too: kill at once
            self.job.release()

    def _teardown(self) -> None:
        """After every rank returned: let them and the launcher exit by themselves, then
        end what is left."""
        try:
            self.job.wait(TEARDOWN_SECONDS)
        except subprocess.TimeoutExpired:
            pass
        self.job.release()
