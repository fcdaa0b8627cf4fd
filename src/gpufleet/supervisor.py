"""The caller's side of a running call: stream logs, enforce the timeout, react to Ctrl-C,
always tear down, and turn what the ranks left behind into results or one error."""

from __future__ import annotations

import contextlib
import json
import pickle
import signal
import subprocess
import sys
import threading
import time

from gpufleet import _process, diagnosis, progress, timings
from gpufleet.errors import (
    GpufleetError,
    RankFailure,
    RunCancelledError,
    RunFailedError,
    RunHangError,
    RunPreemptedError,
    RunTimeoutError,
)
from gpufleet.logs import LogFollower, tail_lines
from gpufleet.monitor import RunMonitor
from gpufleet.options import RunOptions
from gpufleet.payload import free_space_note, load_private, write_private
from gpufleet.rundir import RunDir, rank_groups
from gpufleet.tracking import CALLER_WAIT_S, PendingTracking

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


class Supervisor:
    def __init__(
        self,
        run: RunDir,
        agent: subprocess.Popen,
        world_size: int,
        options: RunOptions,
        preemption: Preemption,
        stamps: dict[str, float],
        tracking: PendingTracking | None,
        attempt: int,
        launcher: RunDir | None = None,
        pooled: bool = False,
        monitor: RunMonitor | None = None,
    ):
        """The call is done once every rank has written its result: the values are returned
        while the ranks and the agent exit in the background. ``launcher``: the folder of
        the agent's own files (its log and report), when it is not ``run``: a warm pool's.
        ``pooled``: the ranks live on after the call (a warm pool). ``monitor``: how to
        watch ranks that do not run on this machine (a cluster launcher's)."""
        self.run = run
        self.launcher = launcher or run
        self.pooled = pooled
        self.returned = False  # every rank wrote its result and the ranks live on
        self.stamps = dict(stamps)  # the caller's instants (timings.py)
        self.began = self.stamps.get("call", time.time())  # for the status line's clock
        self.tracking = tracking  # handed to the ranks once ready (tracking.json)
        self.tracking_due = time.monotonic() + CALLER_WAIT_S
        self.attempt = attempt
        self.preemption = preemption
        self.agent = agent
        self.world_size = world_size
        self.options = options
        self.display = progress.open_display()  # draws nothing until the call has run a while
        self.follower = LogFollower(run.log, world_size, options.shows_rank, display=self.display)
        self.progress = progress.ProgressFile(run.progress)
        self.monitor = monitor or RunMonitor(run, world_size, self.launcher.nccl_traces)
        self.stop_deadline: float | None = None  # set by a SIGTERM: the end of the grace period

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
        return progress.Status(
            name=self.run.name, world_size=self.world_size,
            elapsed=time.time() - self.began,
            alive=None if outcome else self.monitor.alive(), step=step, metrics=metrics,
            attempt=self.attempt, outcome=outcome,
        )

    def _save_timings(self) -> None:
        try:
            found = timings.gather(self.run.path, self.stamps, self.world_size)
        except OSError:  # the run folder is gone: nothing to keep, nothing to print
            return
        if self.options.show_timings:
            print(f"gpufleet: timings of {self.run.name}\n{found.table()}", file=sys.stderr, flush=True)

    def _wait(self, deadline: float | None) -> list:
        if deadline is None and self.options.timeout is not None:
            deadline = time.monotonic() + self.options.timeout
        error = None
        try:
            outcome = self._follow(deadline)
            if outcome == "hang":
                error = self._hang_error()
                if self.agent.poll() is not None:  # it ended while we looked: not a hang
                    outcome, error = "done", None
            elif outcome == "timeout":
                error = self._timeout_error(self.monitor.collect_stacks())
            elif outcome == "cancel":
                error = RunCancelledError(
                    [], run_dir=self.run.path, world_size=self.world_size,
                    headline=f"run {self.run.path.parent.name} was cancelled: every rank was stopped",
                )
            elif outcome == "deleted":
                error = RunFailedError(
                    [], run_dir=self.run.path, world_size=self.world_size,
                    headline=f"the run's folder {self.run.path} was deleted while it ran, so its "
                    "logs, results and record were gone: every rank was stopped",
                )
            if outcome != "done":
                self.stop()
        except KeyboardInterrupt:
            self.stop()
            print(f"gpufleet: interrupted; stopped every rank of {self.run.name}", file=sys.stderr)
            raise
        finally:
            self.follower.close()
            if not (self.returned and self.agent.poll() is None):
                self._sweep()
                self.stamps["agent_exited"] = time.time()
        if self.preemption.requested_at is not None:  # it outranks a hang or a timeout
            self._ask_to_stop()
            self._end_ranks()
            preempted = self._preempted_error()
            raise preempted from _original_exception(preempted) or error
        if error is not None:
            raise error
        try:
            values = collect(self.run, self.world_size, self.monitor, self.agent, self.launcher)
        except RunFailedError:
            self._end_ranks()  # a failed call returns once its ranks are gone
            raise
        if self.returned and self.agent.poll() is None:
            if not self.pooled:  # the values go back while the ranks and the agent exit
                # not a daemon: a script that ends right after the call still lets its ranks
                # finish their exit (atexit hooks, NCCL teardown) before the agent goes
                threading.Thread(target=self._teardown, name="gpufleet-teardown").start()
        return values

    def _end_ranks(self) -> None:
        """Wait for the ranks that returned, and their agent, to exit (a pool's live on)."""
        if self.returned and not self.pooled and self.agent.poll() is None:
            self._teardown()
            self.stamps["agent_exited"] = time.time()

    def _follow(self, deadline: float | None) -> str:
        """Follow the run until it ends ("done"), or until it must be stopped: "timeout",
        "hang", "grace" (the grace period after a SIGTERM is over), "cancel" or "deleted"
        (its folder is gone)."""
        hang_timeout = self.options.hang_timeout
        quick_until = time.monotonic() + QUICK_POLL_FOR_SECONDS
        while self.agent.poll() is None:
            if self.follower.poll():
                self.monitor.progress()
            if self.run.cancel_request is not None and self.run.cancel_request.exists():
                return "cancel"
            if not self.run.path.is_dir():  # nothing could be kept, nor the run be cancelled
                return "deleted"
            if all(self.run.result(r).exists() for r in range(self.world_size)):
                self.stamps["ranks_returned"] = time.time()
                self.follower.poll()
                self.returned = True
                return "done"
            self.monitor.sample()
            self._show_status()
            self._hand_over_tracking()
            if self.preemption.requested_at is not None:
                self._ask_to_stop()
            now = time.monotonic()
            if self.stop_deadline is not None and now > self.stop_deadline:
                return "grace"
            if deadline is not None and now > deadline:
                return "timeout"
            if hang_timeout is not None and self.stop_deadline is None:
                idle = self.monitor.seconds_without_progress()
                if idle is not None and idle > hang_timeout:
                    return "hang"
            time.sleep(POLL_SECONDS if now > quick_until else QUICK_POLL_SECONDS)
        return "done"

    def _hand_over_tracking(self) -> None:
        """Once the call's MLflow run exists (or after CALLER_WAIT_S without it), write it for
        the ranks, which wait for it just before the function runs."""
        pending = self.tracking
        if pending is None or not (pending.ready() or time.monotonic() > self.tracking_due):
            return
        self.tracking = None
        try:
            write_private(self.run.tracking, json.dumps(pending.env()).encode())
        except OSError as exc:  # the ranks go on untracked after their own wait
            print(f"gpufleet: MLflow run not handed to the ranks: {exc}", file=sys.stderr, flush=True)
        pending.attempt(self.attempt)

    def _ask_to_stop(self) -> None:
        """After a SIGTERM: ``stop-requested`` in the run folder (``runtime.should_stop()``),
        one line for the user, and the end of the grace period (now, after a second SIGTERM)."""
        if self.stop_deadline is None:
            self.stop_deadline = self.preemption.requested_at + self.options.grace_period
            write_private(self.run.stop_request, b"SIGTERM\n")
            print(
                f"gpufleet: SIGTERM: asked every rank to stop (runtime.should_stop() is now True); "
                f"ranks still running in {self.options.grace_period:g} s will be stopped",
                file=sys.stderr,
                flush=True,
            )
        if self.preemption.repeated:
            self.stop_deadline = min(self.stop_deadline, time.monotonic())

    def stop(self) -> None:
        """SIGTERM the agent (elastic stops the ranks), then SIGKILL whatever is left."""
        try:
            if self.agent.poll() is None:
                self.agent.send_signal(signal.SIGTERM)
            end = time.monotonic() + STOP_GRACE_SECONDS
            while self.agent.poll() is None and time.monotonic() < end:
                self.follower.poll()
                time.sleep(POLL_SECONDS)
        finally:  # a second Ctrl-C lands here too: kill at once
            self._sweep()

    def _teardown(self) -> None:
        """After every rank returned: let them and the agent exit by themselves, then sweep."""
        try:
            self.agent.wait(TEARDOWN_SECONDS)
        except subprocess.TimeoutExpired:
            pass
        self._sweep()

    def _sweep(self) -> None:
        """Kill every process group of the run that still exists; reap the agent. A remote
        job's processes are on other machines, where its pids name other processes: it
        releases them itself."""
        if getattr(self.agent, "remote", False):
            self.agent.release()
            return
        _process.kill_groups(rank_groups(self.run, self.world_size))
        if self.agent.poll() is None:  # its pid is its own until reaped
            _process.end_run_tree(self.agent.pid, grace=0)  # what it adopted would go to init
        _process.kill_group(self.agent.pid)
        self.agent.wait()
        _make_private(self.run.nccl_traces.parent)  # PyTorch writes its dumps with the umask

    def _hang_error(self) -> RunHangError:
        """Every rank's stacks, read for who waits in a collective and who does not."""
        finished = {r for r in range(self.world_size) if self.run.result(r).exists()}
        states = self.monitor.collect_stacks(skip=finished)
        found, failures = diagnosis.analyse(states, self.world_size, self.run.path / "stacks", finished)
        for failure in failures:
            if not failure.collateral:
                failure.log_tail = tail_lines(self.run.log(failure.rank), count=5)
        folder = self.launcher.nccl_traces.parent
        nccl = f" NCCL flight recorder dumps (asked for; written within seconds): {folder}." if any(
            folder.glob("*.pipe")
        ) else ""
        headline = (
            f"no progress for hang_timeout={self.options.hang_timeout:g} s (no output and no "
            f"runtime.heartbeat() on any rank); stopped all {self.world_size} ranks. {found}.{nccl} "
            "If the silence was expected, call runtime.heartbeat() or pass a larger hang_timeout="
        )
        return RunHangError(failures, run_dir=self.run.path, world_size=self.world_size, headline=headline)

    def _preempted_error(self) -> RunPreemptedError:
        """After a SIGTERM: every rank's value if all returned in time; otherwise the ranks
        that failed while stopping (root cause first) and those stopped at the grace period's
        end."""
        report = _read_report(self.launcher)
        values, failures = {}, []
        for rank in range(self.world_size):
            status, failure = _read_result(self.run, rank)
            if status == "ok":
                values[rank] = failure
                continue
            death = report.get("failures", {}).get(str(rank))
            if failure is None and death and death.get("exitcode") not in (-signal.SIGTERM, -signal.SIGKILL):
                failure = _death(self.launcher, rank, report, self.monitor)  # it died by itself
            if failure is None:
                failure = RankFailure(
                    rank=rank,
                    kind="preempted",
                    summary=f"still running when grace_period={self.options.grace_period:g} s "
                    "ended; stopped",
                    collateral=True,
                )
            failure.log_tail = tail_lines(self.run.log(rank), end=failure.log_bytes, count=5)
            failures.append(failure)
        if not failures:
            return RunPreemptedError(
                [], results=[values[r] for r in range(self.world_size)], run_dir=self.run.path,
                world_size=self.world_size,
                headline=f"the caller got SIGTERM; all {self.world_size} ranks stopped within "
                f"grace_period={self.options.grace_period:g} s (their return values: .results)",
            )
        late = sum(f.kind == "preempted" for f in failures)
        failed = len(failures) - late
        parts = [f"{failed} failed while stopping"] if failed else []
        if late:
            parts.append(
                f"{late} did not return within grace_period={self.options.grace_period:g} s "
                "(check runtime.should_stop() more often, or pass a larger grace_period=)"
            )
        return RunPreemptedError(
            failures, results=None, run_dir=self.run.path, world_size=self.world_size,
            headline=f"the caller got SIGTERM; of {self.world_size} ranks, " + " and ".join(parts),
        )

    def _timeout_error(self, states: dict) -> RunTimeoutError:
        finished = {r for r in range(self.world_size) if self.run.result(r).exists()}
        running = [
            RankFailure(
                rank=rank,
                kind="timeout",
                summary="still running when the timeout expired" + _where(states.get(rank)),
                log_tail=tail_lines(self.run.log(rank), count=5),
            )
            for rank in range(self.world_size)
            if rank not in finished
        ]
        headline = (
            f"timed out after timeout={self.options.timeout:g} s and stopped all "
            f"{self.world_size} ranks; pass a larger timeout= to @distributed(...) "
            "(or timeout=None for no limit)"
        )
        return RunTimeoutError(
            running, run_dir=self.run.path, world_size=self.world_size, headline=headline
        )


def _where(state: diagnosis.RankState | None) -> str:
    if state is None:
        return ""
    if state.collective:
        return f", waiting in {state.collective}" + (
            f" called at {state.user_frame.where}" if state.user_frame else ""
        )
    return f", at {state.user_frame.where}" if state.user_frame else ""


def collect(
    run: RunDir, world_size: int, monitor: RunMonitor | None = None,
    agent: subprocess.Popen | None = None, launcher: RunDir | None = None,
) -> list:
    """Results in rank order, or RunFailedError with the root cause first. ``launcher``: the
    folder with the agent's report, when not ``run``."""
    launcher = launcher or run
    report = _read_report(launcher)
    hosts = report.get("hosts", {})  # a cluster launcher names each rank's node
    values, failures = {}, []
    for rank in range(world_size):
        status, item = _read_result(run, rank)
        if status == "ok":
            values[rank] = item
            continue
        failure = item or _death(launcher, rank, report, monitor)
        failure.host = hosts.get(str(rank), failure.host)
        failure.log_tail = tail_lines(run.log(rank), end=failure.log_bytes)
        failures.append(failure)
    if not failures:
        return [values[rank] for rank in range(world_size)]
    failures, stopped = _split_stopped(failures)
    lost = report.get("state") == "lost" and agent is not None and agent.poll() is not None
    headline = _lost_launcher(agent, launcher) if lost else None
    error = RunFailedError(
        failures, run_dir=run.path, world_size=world_size, stopped=stopped, headline=headline
    )
    raise error from _original_exception(error)


def _lost_launcher(agent: subprocess.Popen, launcher: RunDir) -> str:
    """The launcher (elastic's agent) ended without its report: it was killed or crashed,
    and its ranks died with it (they have PR_SET_PDEATHSIG on it)."""
    code = agent.returncode
    if code is not None and code < 0:
        try:
            how = f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            how = f"was killed by signal {-code}"
    else:
        how = f"exited with code {code}"
    return (
        f"the launcher process (torch elastic agent, pid {agent.pid}) {how} before the ranks "
        f"finished; they were stopped with it{free_space_note(launcher.path)}"
    )


def _read_result(run: RunDir, rank: int) -> tuple[str, object]:
    path = run.result(rank)
    if not path.exists():
        return ("missing", None)
    try:
        return load_private(path)
    except GpufleetError:
        raise
    except Exception as exc:
        raise GpufleetError(
            f"the result file of rank {rank} ({path}) is damaged and was not loaded: "
            f"{type(exc).__name__}: {exc}. It was written whole and renamed into place, so "
            "something changed it afterwards; run the call again"
        ) from exc


def _read_report(run: RunDir) -> dict:
    try:
        return json.loads(run.agent_report.read_text())
    except FileNotFoundError:
        return {"state": "lost"}


def _death(launcher: RunDir, rank: int, report: dict, monitor: RunMonitor | None = None) -> RankFailure:
    info = report.get("failures", {}).get(str(rank))
    if info is None and report.get("state") == "failed":
        # elastic reports the rank that failed; it stopped the others with SIGTERM
        info = {"exitcode": -signal.SIGTERM}
    if info is None:
        detail = report.get("error") or "\n".join(tail_lines(launcher.agent_log))
        return RankFailure(
            rank=rank,
            kind="lost",
            summary=f"no result: the launcher stopped first (its log: {launcher.agent_log})",
            traceback=detail,
        )
    if "lost" in info:  # a remote rank whose node or actor was lost: no exit status
        return RankFailure(rank=rank, kind="lost", summary=info["lost"],
                           time=float(info.get("time") or 0))
    code = info["exitcode"]
    failure = RankFailure(
        rank=rank,
        kind="signal" if code < 0 else "exit",
        summary="",
        pid=info.get("pid"),
        exitcode=code,
        time=float(info.get("time") or 0),
    )
    failure.summary = f"signal {failure.signal_name}" if code < 0 else f"exit code {code}"
    if code > 0:  # a rank that could not write its result or log: a full disk, say
        failure.summary += free_space_note(launcher.path)
    evidence = monitor.oom_kill_evidence(rank) if monitor and code == -signal.SIGKILL else None
    if evidence:
        failure.kind, failure.summary = "host-oom", evidence
    return failure


def _split_stopped(failures: list[RankFailure]) -> tuple[list[RankFailure], list[int]]:
    """Ranks that died of the teardown's SIGTERM after another failure were stopped, not failed."""
    sigterm = [f for f in failures if f.kind == "signal" and f.signal_name == "SIGTERM"]
    if len(sigterm) == len(failures):
        return failures, []
    return [f for f in failures if f not in sigterm], [f.rank for f in sigterm]


def _original_exception(error: RunFailedError) -> BaseException | None:
    root = error.root_cause
    if root is None or root.exception is None:
        return None
    try:
        exc = pickle.loads(root.exception)
    except Exception:  # its class may not import here, or it may not rebuild: text remains
        return None
    return exc if isinstance(exc, BaseException) else None


def _make_private(folder) -> None:
    if not folder.is_dir():  # the run's folder was deleted
        return
    for path in folder.iterdir():
        try:
            path.chmod(0o600)
        except OSError:
            pass
