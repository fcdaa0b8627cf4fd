"""gpufleet's exceptions, and how the failures of a run become one readable error.

Every exception here pickles (a run handle or a cluster may move it between processes), keeps
the remote traceback as text, and puts the root cause first.
"""

from __future__ import annotations

import copy
import signal
from dataclasses import dataclass, field
from pathlib import Path

_SIGNAL_HINTS = {
    "SIGKILL": "killed outright: the kernel's out-of-memory killer, a `kill -9`, or a scheduler",
    "SIGSEGV": "segmentation fault: a crash in native code (a C/C++/CUDA extension)",
    "SIGABRT": "aborted by native code (a failed C++ check or an uncaught C++ exception)",
    "SIGBUS": "bus error: often /dev/shm is too small for DataLoader workers",
    "SIGTERM": "terminated by a SIGTERM from outside the run",
}


LOG_LINE_CHARS = 300  # of each log line quoted in an error

# How a rank can fail (RankFailure.kind), and the words that lead its line in an error.
KINDS = {
    "exception": "",
    "host-oom": "host out of memory: ",
    "cuda-oom": "GPU out of memory: ",
    "exit": "",
    "left": "",  # ended through sys.exit (or its script's end) while the others needed it
    "signal": "",
    "result": "",
    "timeout": "",
    "hang": "hang: ",
    "preempted": "preempted: ",
    "lost": "",
}


class GpufleetError(Exception):
    """Base class of every error gpufleet raises."""


class ConfigError(GpufleetError, ValueError):
    """An option or the machine does not allow the run; raised before any process starts."""


class PayloadError(GpufleetError, TypeError):
    """The function or one of its arguments cannot travel to the ranks."""


@dataclass
class RankFailure:
    """What went wrong in one rank."""

    rank: int
    kind: str  # one of KINDS
    summary: str  # one line: "ValueError: boom", "exit code 3", "signal SIGKILL"
    traceback: str = ""
    host: str = ""
    pid: int | None = None
    exitcode: int | None = None
    time: float = 0.0
    collateral: bool = False  # a communication error, most likely caused by another rank
    log_bytes: int | None = None  # size of the rank's log when it failed
    log_tail: list[str] = field(default_factory=list)
    exception: bytes | None = None  # cloudpickle of the original exception, when it pickled

    @property
    def signal_name(self) -> str | None:
        if self.exitcode is None or self.exitcode >= 0:
            return None
        try:
            return signal.Signals(-self.exitcode).name
        except ValueError:
            return f"signal {-self.exitcode}"

    @property
    def terminated(self) -> bool:
        """Died of a SIGTERM: after another rank's failure, the teardown's (stopped, not failed)."""
        return self.kind == "signal" and self.signal_name == "SIGTERM"

    def group_key(self) -> tuple:
        return (self.kind, self.summary, self.host)


class RunFailedError(GpufleetError, RuntimeError):
    """One or more ranks failed. ``failures`` holds them, root cause first."""

    def __init__(
        self,
        failures: list[RankFailure],
        *,
        run_dir: str | Path,
        world_size: int,
        stopped: list[int] | None = None,
        headline: str | None = None,
        attempts: list[str] | None = None,
    ):
        self.failures = order_failures(failures)
        self.run_dir = Path(run_dir)
        self.world_size = world_size
        self.stopped = sorted(stopped or [])
        self.headline = headline or self._default_headline()
        self.attempts = list(attempts or [])  # one line per earlier attempt of the call
        super().__init__(self._render())

    def __reduce__(self):
        return (
            _rebuild_run_error,
            (type(self), self.failures, self.run_dir, self.world_size, self.stopped,
             self.headline, self.attempts),
        )

    def root_line(self) -> str:
        """The root cause in one line: "rank 1: ValueError: boom"."""
        if not self.failures:
            return self.headline
        ranks, failure = group_failures(self.failures)[0]
        return f"{_ranks_label(ranks)}: {describe(failure)}"

    def after(self, earlier: list["RunFailedError"]) -> "RunFailedError":
        """This error as the last of several attempts, listing the earlier ones' root causes."""
        later = copy.copy(self)  # through __reduce__: every subclass keeps its own fields
        later.attempts = [
            f"attempt {i + 1}: {e.root_line()} (run folder {e.run_dir})" for i, e in enumerate(earlier)
        ]
        later.args = (later._render(),)
        return later

    @property
    def root_cause(self) -> RankFailure | None:
        return self.failures[0] if self.failures else None

    @property
    def ranks(self) -> list[int]:
        return sorted(f.rank for f in self.failures)

    def _default_headline(self) -> str:
        n = sum(not f.collateral for f in self.failures) or len(self.failures)
        echoes = len(self.failures) - n
        more = f" ({echoes} more with a communication error)" if echoes else ""
        return f"{n} of {self.world_size} rank{'s' if self.world_size != 1 else ''} failed{more}"

    def _render(self) -> str:
        lines = [f"{self.headline} (run folder {self.run_dir})"]
        for i, (ranks, failure) in enumerate(group_failures(self.failures)):
            label = "root cause" if i == 0 else "also"
            lines += ["", f"{label}: {_ranks_label(ranks)}: {describe(failure)}"]
            if i > 0 and failure.collateral:
                if failure.kind != "hang":  # a hang's waiting ranks are named, not blamed
                    lines.append("(a communication error: most likely the echo of the failure above)")
                continue
            if failure.traceback:
                lines.append(failure.traceback.rstrip())
            if failure.log_tail:
                lines.append(f"last lines of rank {failure.rank}'s log:")
                lines += [f"  {_clipped(line)}" for line in failure.log_tail]
        if self.stopped:
            lines += ["", f"{_ranks_label(self.stopped)} stopped by gpufleet after the failure."]
        lines += ["", f"per-rank logs: {self.run_dir / 'logs'}/rank-<N>.log"]
        if self.attempts:
            lines += ["", f"this was attempt {len(self.attempts) + 1}; earlier attempts failed too:"]
            lines += [f"  {line}" for line in self.attempts]
        return "\n".join(lines)


class RunTimeoutError(RunFailedError, TimeoutError):
    """The call ran past ``timeout=`` seconds; every rank was stopped."""


class RunHangError(RunFailedError):
    """Every rank was alive but none made progress for ``hang_timeout=`` seconds; the run was
    stopped after each rank's stacks were collected. The root cause is the culprit rank."""


class RunPreemptedError(RunFailedError):
    """The calling process got SIGTERM: every rank was asked to stop (``runtime.should_stop()``)
    and given ``grace_period=`` seconds. ``results`` holds every rank's return value when all
    of them returned in time, else None. Never retried: the process is going away."""

    def __init__(self, failures, *, results: list | None = None, **kwargs):
        self.results = results
        super().__init__(failures, **kwargs)

    def __reduce__(self):
        rebuild, args = super().__reduce__()
        return (_rebuild_preempted, (args, self.results))


class RunCancelledError(RunFailedError):
    """The run was cancelled (``Run.cancel()``, ``gpufleet cancel``, the submitting process
    ended, Ctrl-C in its supervisor); every rank was stopped."""


def _rebuild_preempted(args, results):
    error = _rebuild_run_error(*args)
    error.results = results
    return error


def _rebuild_run_error(cls, failures, run_dir, world_size, stopped, headline, attempts=None):
    return cls(
        failures, run_dir=run_dir, world_size=world_size, stopped=stopped, headline=headline,
        attempts=attempts,
    )


def describe(failure: RankFailure) -> str:
    """One line that says how a rank failed, with host and pid when known."""
    where = ", ".join(x for x in (failure.host, f"pid {failure.pid}" if failure.pid else "") if x)
    where = f" ({where})" if where else ""
    if failure.kind == "signal":
        hint = _SIGNAL_HINTS.get(failure.signal_name or "", "")
        return f"died from {failure.summary}{where}" + (f" — {hint}" if hint else "")
    if failure.kind == "exit" and failure.exitcode == 0:
        return (f"exited with code 0 before returning{where} — the process was ended from "
                "inside the function (os._exit(0), or a library that exits), so no result came back")
    if failure.kind == "exit":
        return f"exited with {failure.summary} without raising a Python exception{where}"
    if failure.kind == "left" and failure.exitcode == 0:
        return (f"left while the other ranks still needed it: {failure.summary}{where} — a rank that "
                "ends leaves every collective, and the others failed on its absence; end every rank "
                "at the same point (return from the function, or reach the script's end, on all of them)")
    if failure.kind == "left":
        return f"ended before returning, through {failure.summary}{where}"
    return f"{KINDS.get(failure.kind, '')}{failure.summary}{where}"


def order_failures(failures: list[RankFailure]) -> list[RankFailure]:
    """Root cause first: real failures before communication errors, both before the ranks a
    teardown's SIGTERM stopped (which report no time), then by time, then rank."""
    return sorted(failures, key=lambda f: (f.terminated, f.collateral, f.time, f.rank))


def group_failures(failures: list[RankFailure]) -> list[tuple[list[int], RankFailure]]:
    """Identical failures (same kind and message) as one entry, in the given order."""
    groups: dict[tuple, tuple[list[int], RankFailure]] = {}
    for failure in failures:
        ranks, _ = groups.setdefault(failure.group_key(), ([], failure))
        ranks.append(failure.rank)
    return [(sorted(ranks), first) for ranks, first in groups.values()]


def _clipped(line: str) -> str:
    """A log line as an error quotes it: the per-rank log keeps it whole."""
    return line if len(line) <= LOG_LINE_CHARS else f"{line[:LOG_LINE_CHARS]}… ({len(line)} characters)"


def _ranks_label(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))
