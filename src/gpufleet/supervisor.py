"""The caller's side of a running call: stream logs, enforce the timeout, react to Ctrl-C,
always tear down, and turn what the ranks left behind into results or one error."""

from __future__ import annotations

import json
import pickle
import signal
import subprocess
import sys
import time

from gpufleet import _process
from gpufleet.errors import GpufleetError, RankFailure, RunFailedError, RunTimeoutError
from gpufleet.logs import LogFollower, tail_lines
from gpufleet.options import RunOptions
from gpufleet.payload import load_private
from gpufleet.rundir import RunDir

POLL_SECONDS = 0.05
STOP_GRACE_SECONDS = 5.0


class Supervisor:
    def __init__(self, run: RunDir, agent: subprocess.Popen, world_size: int, options: RunOptions):
        self.run = run
        self.agent = agent
        self.world_size = world_size
        self.options = options
        self.follower = LogFollower(run.log, world_size, options.shows_rank)

    def wait(self, deadline: float | None = None) -> list:
        """Block until every rank is done; return their values in rank order or raise.

        ``deadline`` (``time.monotonic()``) ends the wait; default: ``timeout`` from now.
        """
        if deadline is None and self.options.timeout is not None:
            deadline = time.monotonic() + self.options.timeout
        try:
            finished = self._follow(deadline)
            if not finished:
                self.stop()
        except KeyboardInterrupt:
            self.stop()
            print(f"gpufleet: interrupted; stopped every rank of {self.run.name}", file=sys.stderr)
            raise
        finally:
            self.follower.close()
            self._sweep()
        if not finished:
            raise self._timeout_error()
        return collect(self.run, self.world_size)

    def _follow(self, deadline: float | None) -> bool:
        while self.agent.poll() is None:
            self.follower.poll()
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(POLL_SECONDS)
        return True

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

    def _sweep(self) -> None:
        """Kill every process group of the run that still exists; reap the agent."""
        for rank in range(self.world_size):
            pid = _read_pid(self.run.pid_file(rank))
            if pid is not None:
                _process.kill_group(pid)
        _process.kill_group(self.agent.pid)
        self.agent.wait()

    def _timeout_error(self) -> RunTimeoutError:
        finished = {r for r in range(self.world_size) if self.run.result(r).exists()}
        running = [
            RankFailure(
                rank=rank,
                kind="timeout",
                summary="still running when the timeout expired",
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


def collect(run: RunDir, world_size: int) -> list:
    """Results in rank order, or RunFailedError with the root cause first."""
    report = _read_report(run)
    values, failures = {}, []
    for rank in range(world_size):
        status, item = _read_result(run, rank)
        if status == "ok":
            values[rank] = item
            continue
        failure = item or _death(run, rank, report)
        failure.log_tail = tail_lines(run.log(rank), end=failure.log_bytes)
        failures.append(failure)
    if not failures:
        return [values[rank] for rank in range(world_size)]
    failures, stopped = _split_stopped(failures)
    error = RunFailedError(failures, run_dir=run.path, world_size=world_size, stopped=stopped)
    raise error from _original_exception(error)


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


def _death(run: RunDir, rank: int, report: dict) -> RankFailure:
    info = report.get("failures", {}).get(str(rank))
    if info is None:
        detail = report.get("error") or "\n".join(tail_lines(run.agent_log))
        return RankFailure(
            rank=rank,
            kind="lost",
            summary=f"no result: the launcher stopped first (its log: {run.agent_log})",
            traceback=detail,
        )
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


def _read_pid(path) -> int | None:
    try:
        return int(path.read_text())
    except (FileNotFoundError, ValueError):
        return None
