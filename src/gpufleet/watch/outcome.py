"""What an attempt's ranks left behind, read into values or one error: each rank's result
or failure (the root cause first, the ranks stopped after it set apart), and the errors of an
attempt the watcher stopped (a hang, a timeout, a SIGTERM).

The watcher (``supervisor.py``) calls it when an attempt ends; a run's handle
(``runs/handles.py``) calls ``collect`` on a finished run's folder.
"""

from __future__ import annotations

import json
import pickle
import signal
from typing import Any

from gpufleet.errors import (
    GpufleetError,
    RankFailure,
    RunFailedError,
    RunHangError,
    RunPreemptedError,
    RunTimeoutError,
)
from gpufleet.launchers.base import Job
from gpufleet.options import RunOptions, spell, spell_seconds
from gpufleet.payload import free_space_note, load_private
from gpufleet.rundir import LauncherState, RunDir
from gpufleet.watch import diagnosis
from gpufleet.watch.logs import tail_lines
from gpufleet.watch.monitor import RunMonitor

# A rank that left with status 0 (sys.exit(0) in the function, its script's end) is named as
# the cause of a peer's communication error that came this soon after it left.
LEFT_WINDOW_SECONDS = 30.0


def hung(job: Job, options: RunOptions) -> RunHangError:
    """Every rank's stacks, read for who waits in a collective and who does not."""
    finished = {r for r in job.ranks if job.attempt.result(r).exists()}
    states, elsewhere = job.every_rank(job.monitor.collect_stacks(skip=finished))
    found, failures = diagnosis.analyse(states, sorted(states), job.attempt.path / "stacks", finished)
    for failure in failures:
        failure.host = elsewhere.get(failure.rank, failure.host)
        if not failure.collateral and failure.rank in job.ranks:
            failure.log_tail = tail_lines(job.attempt.log(failure.rank), count=5)
    folder = job.reports.nccl_traces.parent
    nccl = f" NCCL flight recorder dumps (asked for; written within seconds): {folder}." if any(
        folder.glob("*.pipe")
    ) else ""
    headline = (
        f"no progress for {spell_seconds('hang_timeout', options.hang_timeout)} (no output and no "
        f"runtime.heartbeat() on any rank); stopped all {job.world_size} ranks. {found}.{nccl} "
        f"If the silence was expected, call runtime.heartbeat() or give a larger {spell('hang_timeout')} "
        f"({spell('hang_timeout', None)} turns the check off)"
    )
    return RunHangError(failures, run_dir=job.attempt.path, world_size=job.world_size, headline=headline)


def preempted(job: Job, options: RunOptions) -> RunPreemptedError:
    """After a SIGTERM: every rank's value if all returned in time; otherwise the ranks
    that failed while stopping (root cause first) and those stopped at the grace period's
    end."""
    report = _read_report(job.reports)
    values: dict[int, Any] = {}
    failures: list[RankFailure] = []
    for rank in job.ranks:
        status, failure = _read_result(job.attempt, rank)
        if status in ("ok", "left"):
            values[rank] = failure if status == "ok" else None
            continue
        death = report.get("failures", {}).get(str(rank))
        if failure is None and death and death.get("exitcode") not in (-signal.SIGTERM, -signal.SIGKILL):
            failure = _death(job.reports, rank, report, job.monitor)  # it died by itself
        if failure is None:
            failure = RankFailure(
                rank=rank,
                kind="preempted",
                summary=f"still running when grace_period={options.grace_period:g} s "
                "ended; stopped",
                collateral=True,
            )
        failure.log_tail = tail_lines(job.attempt.log(rank), end=failure.log_bytes, count=5)
        failures.append(failure)
    if not failures:
        return RunPreemptedError(
            [], results=[values[r] for r in job.ranks], run_dir=job.attempt.path,
            world_size=job.world_size,
            headline=f"the caller got SIGTERM; all {job.world_size} ranks stopped within "
            f"grace_period={options.grace_period:g} s (their return values: .results)",
        )
    late = sum(f.kind == "preempted" for f in failures)
    failed = len(failures) - late
    parts = [f"{failed} failed while stopping"] if failed else []
    if late:
        parts.append(
            f"{late} did not return within grace_period={options.grace_period:g} s "
            "(check runtime.should_stop() more often, or pass a larger grace_period=)"
        )
    return RunPreemptedError(
        failures, results=None, run_dir=job.attempt.path, world_size=job.world_size,
        headline=f"the caller got SIGTERM; of {job.world_size} ranks, " + " and ".join(parts),
    )


def timed_out(job: Job, options: RunOptions) -> RunTimeoutError:
    """Where each rank still running was when the timeout expired."""
    states = job.monitor.collect_stacks()
    finished = {r for r in job.ranks if job.attempt.result(r).exists()}
    running = [
        RankFailure(
            rank=rank,
            kind="timeout",
            summary="still running when the timeout expired" + _where(states.get(rank)),
            log_tail=tail_lines(job.attempt.log(rank), count=5),
        )
        for rank in job.ranks
        if rank not in finished
    ]
    headline = (
        f"timed out after {spell_seconds('timeout', options.timeout)} and stopped all "
        f"{job.world_size} ranks; give a larger {spell('timeout')}, or {spell('timeout', None)} for no limit"
    )
    return RunTimeoutError(
        running, run_dir=job.attempt.path, world_size=job.world_size, headline=headline
    )


def _where(state: diagnosis.RankState | None) -> str:
    if state is None:
        return ""
    if state.collective:
        return f", waiting in {state.collective}" + (
            f" called at {state.user_frame.where}" if state.user_frame else ""
        )
    return f", at {state.user_frame.where}" if state.user_frame else ""


def collect(attempt: RunDir, world_size: int, job: Job | None = None) -> list:
    """Results in rank order, or RunFailedError with the root cause first. ``job``: the
    attempt's, while it is watched (its report's folder, monitor and exit status)."""
    reports = job.reports if job else attempt
    report = _read_report(reports)
    lost = report.get("state") == LauncherState.LOST and job is not None and job.poll() is not None
    hosts = report.get("hosts", {})  # a cluster launcher names each rank's node
    values: dict[int, Any] = {}
    failures: list[RankFailure] = []
    left: list[RankFailure] = []
    ranks = job.ranks if job else range(world_size)
    for rank in ranks:
        status, item = _read_result(attempt, rank)
        if status in ("ok", "left"):
            values[rank] = item if status == "ok" else None
            left += [item] if status == "left" else []
            continue
        failures.append(item or _death(reports, rank, report, job.monitor if job else None))
    if not failures:
        return [values[rank] for rank in ranks]
    failures += left_first(left, failures)
    for failure in failures:
        failure.host = hosts.get(str(failure.rank), failure.host)
        failure.log_tail = tail_lines(attempt.log(failure.rank), end=failure.log_bytes)
    cause = job.cause(failures) if job else None
    if cause is not None:  # this machine's ranks failed or were stopped because of it
        for failure in failures:
            failure.collateral = True
        failures.insert(0, cause)
    failures, stopped = _split_stopped(failures)
    headline = _lost_launcher(job) if lost and job is not None else None
    error = RunFailedError(
        failures, run_dir=attempt.path, world_size=world_size, stopped=stopped, headline=headline
    )
    raise error from original_exception(error)


def left_first(left: list[RankFailure], failures: list[RankFailure]) -> list[RankFailure]:
    """The ranks that left with status 0 that a peer failed on: a communication error within
    LEFT_WINDOW_SECONDS after the rank left. Their peers' errors only say that a connection
    closed ("Connection closed by peer"); the rank that left first is the cause."""
    return [
        gone for gone in left
        if any(f.collateral and 0 <= f.time - gone.time <= LEFT_WINDOW_SECONDS for f in failures)
    ]


def _lost_launcher(job: Job) -> str:
    """The launcher (elastic's agent) ended without its report: it was killed or crashed,
    and its ranks died with it (they have PR_SET_PDEATHSIG on it)."""
    code = job.poll()
    if code is not None and code < 0:
        try:
            how = f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            how = f"was killed by signal {-code}"
    else:
        how = f"exited with code {code}"
    return (
        f"{job.describe()} {how} before the ranks finished; they were stopped with it"
        f"{free_space_note(job.reports.path)}"
    )


def _read_result(run: RunDir, rank: int) -> tuple[str, Any]:
    """("ok", the value), ("error", its RankFailure), ("left", its RankFailure: a success
    unless a peer failed on it, ``left_first``), or ("missing", None)."""
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
        return {"state": LauncherState.LOST}


def _death(launcher: RunDir, rank: int, report: dict, monitor: RunMonitor | None = None) -> RankFailure:
    info = report.get("failures", {}).get(str(rank))
    if info is None and report.get("state") == LauncherState.FAILED:
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
    sigterm = [f for f in failures if f.terminated]
    if len(sigterm) == len(failures):
        return failures, []
    return [f for f in failures if f not in sigterm], [f.rank for f in sigterm]


def original_exception(error: RunFailedError) -> BaseException | None:
    root = error.root_cause
    if root is None or root.exception is None:
        return None
    try:
        exc = pickle.loads(root.exception)
    except Exception:  # its class may not import here, or it may not rebuild: text remains
        return None
    return exc if isinstance(exc, BaseException) else None
