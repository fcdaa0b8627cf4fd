"""The launch seam: what every way of starting a run's ranks provides.

A run (``runs/execution.py``) picks its launcher once (``launchers.for_run``), then for each
attempt makes a plan, launches it and hands the job to the watcher (``watch/supervisor.py``):

    plan = launcher.plan(attempt, env)      # pure: nothing starts; printable as a dry run
    with launcher.launch(plan) as job:      # the ranks start
        values = Supervisor(job, ...).wait()
    launcher.close()                        # once the run is over: what it held is freed

The watcher knows jobs only through ``Job``; a new way of starting ranks is one module with a
``Launcher`` and a ``Job``, and an entry in ``launchers.for_run``.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from gpufleet.errors import RankFailure, RunFailedError
from gpufleet.rundir import Attempt, RunDir

if TYPE_CHECKING:
    from gpufleet.launchers.devices import Ticket
    from gpufleet.watch.diagnosis import RankState
    from gpufleet.watch.monitor import RunMonitor


class Plan(Protocol):
    """What a launcher would start: made without side effects."""

    @property
    def nprocs(self) -> int:
        """How many ranks."""
        ...

    def describe(self) -> str:
        """The plan in words, for a dry run: what would start, where, with which settings."""
        ...


class Gate(Protocol):
    """The run's side of a launch: what a launcher asks of the run it starts."""

    owner: str  # the run's id: who holds the devices while it runs
    since: float  # when the run was created: its place in the line for devices
    ticket: Ticket | None  # its place in line, taken when it was submitted (a launcher takes it)

    def stopped(self) -> bool:
        """True once the run should no longer wait to start: cancelled, preempted, deleted."""
        ...

    def waiting(self, holders: list[str]) -> None:
        """The launch waits for devices that others hold (named by ``holders``)."""
        ...

    def never_started(self) -> RunFailedError:
        """The error of a run that stopped before its ranks could start."""
        ...

    def begin(self, device_ids: tuple[str, ...] = ()) -> float | None:
        """The ranks start: the run is running. Returns its deadline (``time.monotonic()``)."""
        ...


class Job(abc.ABC):
    """One attempt's ranks, started: what the watcher drives.

    Like ``subprocess.Popen`` (``poll``, ``wait``), with ``stop`` (ask every rank to stop)
    and ``release`` (end whatever is left and reap it). The ranks write their reports into
    ``attempt`` (logs, results, pids); the launcher writes its own into ``reports`` (the
    launcher's log and report, NCCL's dumps), the attempt's folder unless the launcher keeps
    its ranks between runs. Used as a context manager around the watching: its end hands the
    job back to its launcher, saying whether the attempt failed.
    """

    attempt: Attempt | RunDir
    reports: RunDir
    world_size: int
    monitor: RunMonitor
    keeps_ranks: bool = False  # the ranks live on after the attempt (a warm pool)
    stamps: dict[str, float]  # instants the launch noted (``timings.py``)

    @abc.abstractmethod
    def poll(self) -> int | None:
        """None while the launcher runs, else its exit status."""

    @abc.abstractmethod
    def wait(self, timeout: float | None = None) -> int:
        """The exit status, once the launcher has ended (``subprocess.TimeoutExpired`` first)."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Ask the launcher to stop every rank (SIGTERM to each); returns at once."""

    @abc.abstractmethod
    def release(self) -> None:
        """End every process of the attempt that is left and free what it held; idempotent."""

    @abc.abstractmethod
    def describe(self) -> str:
        """The launcher in a few words, for an error that says it was lost."""

    @property
    def ranks(self) -> Sequence[int]:
        """The ranks that write into ``attempt``: all of them, or one machine's in a node run."""
        return range(self.world_size)

    def cause(self, failures: list[RankFailure]) -> RankFailure | None:
        """What ended the attempt outside this job's ranks (a rank that failed on another
        machine of a node run, a machine that was lost), given the failures of its own ranks;
        None when those are the whole story."""
        return None

    def every_rank(self, states: dict[int, RankState | None]) -> tuple[dict[int, RankState | None],
                                                                      dict[int, str]]:
        """After a hang, the stacks of every rank of the run, given this job's own
        (``states``), and the machine of each rank where it is not this one (a node run asks
        the other machines for theirs)."""
        return states, {}

    def __enter__(self) -> "Job":
        return self

    def __exit__(self, kind, error, traceback) -> None:
        self.finished(failed=kind is not None)

    def finished(self, failed: bool) -> None:
        """The watcher is done with this attempt (``failed``: it raised)."""


P = TypeVar("P", bound=Plan)


class Launcher(abc.ABC, Generic[P]):
    """Starts the ranks of one run, attempt after attempt, and holds what the attempts share
    (this machine's devices, a connection to a cluster) until ``close``."""

    @abc.abstractmethod
    def plan(self, attempt: Attempt, env: dict[str, str]) -> P:
        """What ``launch`` would start for ``attempt``, with the variables ``env`` set for
        every rank; no process starts and nothing is written."""

    @abc.abstractmethod
    def launch(self, plan: P) -> Job:
        """Start the plan's ranks; returns once they are starting. Raises ``RunFailedError``
        when they cannot start (the gate stopped the wait; a cluster lacks room in time)."""

    def resized(self, error: RunFailedError) -> bool:
        """Whether ``error`` ended an attempt because the run's machines changed (an elastic
        run): the next attempt starts at the new size, and is not counted as a retry."""
        return False

    def close(self) -> None:
        """The run is over: free what its attempts shared."""
