"""When each phase of a run happened, from the call to the end of teardown.

Every process of a run stamps the instants it passes (wall-clock ``time.time()``): the caller
when it starts the agent, collects the results and has torn down; each rank when its process
started, when its payload was loaded, around ``runtime.setup()`` and its
function. The caller writes ``timings.json`` in the run folder; ``Timings`` turns the stamps
into the run's critical path: each phase ends when the *slowest* rank reached its end, so the
phases add up to the call's wall time.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from gpufleet import _process
from gpufleet.payload import write_private
from gpufleet.rundir import Ranks, RunDir, rank_list

# The instants, in the order a run passes them, and the phase that ends at each.
PHASES = (
    ("call", ""),
    ("attempt_started", "checks and payload in the caller"),
    ("pool_ready", "start the warm pool's ranks"),
    ("agent_started", "start the agent process"),
    ("launcher_ready", "import torch (agent and rank template, side by side)"),
    ("cluster_placed", "place the ranks on the Ray cluster"),
    ("cluster_actors_ready", "start the ranks' actors (runtime_env, version check)"),
    ("ranks_started", "rendezvous and start the rank processes"),
    ("call_received", "hand the call to the warm ranks"),
    ("payload_loaded", "interpreter, imports and payload"),
    ("tracking_joined", "waiting for the call's MLflow run"),
    ("setup_started", "user code before runtime.setup()"),
    ("cuda_ready", "CUDA initialisation"),
    ("process_group_ready", "rendezvous and process group"),
    ("function_ended", "user function"),
    ("ranks_returned", "results written"),
    ("agent_exited", "rank exits and the agent's teardown"),
    ("results_collected", "read the results"),
)
_RANK_INSTANTS = {"ranks_started", "call_received", "payload_loaded", "tracking_joined", "setup_started", "cuda_ready",
                  "process_group_ready", "function_ended"}

_stamps: dict[str, float] = {}  # this process's instants


def mark(name: str, at: float | None = None) -> None:
    """Note that this process has reached ``name``, now or ``at`` (the first time counts)."""
    _stamps.setdefault(name, time.time() if at is None else at)


def reset() -> None:
    """Forget this process's instants: a warm rank starts each call afresh."""
    _stamps.clear()


def stamps() -> dict[str, float]:
    return dict(_stamps)


def process_started() -> float | None:
    """When this process was created; None where that cannot be read. On Linux its age (time
    since boot less its start in clock ticks since boot) subtracted from now: psutil's creation
    time adds a boot time cut to whole seconds, and so is up to a second early."""
    if not hasattr(time, "CLOCK_BOOTTIME"):
        return _process.started_at(os.getpid())
    ticks = _process.start_ticks(os.getpid())
    if ticks is None:
        return None
    return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK"))


@dataclass
class Timings:
    """The stamps of one run: the caller's and each rank's."""

    caller: dict[str, float] = field(default_factory=dict)
    ranks: dict[int, dict[str, float]] = field(default_factory=dict)

    @classmethod
    def read(cls, run_dir: str | os.PathLike) -> "Timings":
        """The timings of the run whose folder is ``run_dir`` (``timings.json``)."""
        data = json.loads((Path(run_dir) / "timings.json").read_text())
        return cls(caller=data["caller"], ranks={int(r): s for r, s in data["ranks"].items()})

    def instants(self) -> dict[str, float]:
        """Each instant of PHASES that the run passed: the caller's, or the slowest rank's."""
        found = dict(self.caller)
        for name in _RANK_INSTANTS:
            values = [s[name] for s in self.ranks.values() if name in s]
            if values and len(values) == len(self.ranks):
                found[name] = max(values)
        return found

    def phases(self) -> list[tuple[str, float]]:
        """(phase, seconds) along the critical path, skipping instants the run never passed
        (no runtime.setup(), no CUDA); the seconds add up to the call's wall time."""
        at = self.instants()
        passed = [(name, label) for name, label in PHASES if name in at]
        out, reached = [], None
        for name, label in passed:
            # process start times have a clock tick's resolution (Linux): an instant
            # that seems to come before the one it follows counts as no time at all
            now = at[name] if reached is None else max(reached, at[name])
            if reached is not None:
                out.append((label, now - reached))
            reached = now
        return out

    def total(self) -> float:
        at = self.instants()
        return at["results_collected"] - at["call"] if {"call", "results_collected"} <= set(at) else 0.0

    def table(self) -> str:
        rows = self.phases()
        width = max([len(label) for label, _ in rows] + [5])
        lines = [f"{label:<{width}}  {seconds:7.3f} s" for label, seconds in rows]
        lines.append(f"{'total':<{width}}  {self.total():7.3f} s")
        return "\n".join(lines)

    def as_json(self) -> dict:
        return {"caller": self.caller, "ranks": {str(r): s for r, s in self.ranks.items()},
                "phases": dict(self.phases()), "total": self.total()}


def write_rank(path: Path) -> None:
    """This rank's (or the agent's) stamps, for the caller to gather (private, like the
    whole run folder)."""
    write_private(path, json.dumps(stamps()).encode())


def gather(run_dir: Path, caller: dict[str, float], here: Ranks) -> Timings:
    """The caller's stamps and those of every rank ``here`` that wrote them, saved as
    ``timings.json``."""
    ranks = {}
    for rank in rank_list(here):
        try:
            ranks[rank] = json.loads(RunDir(run_dir).timings(rank).read_text())
        except (OSError, ValueError):
            pass
    try:  # the agent's instants (a cold run's) or the cluster launch's, counted with the caller's
        caller = {**json.loads(RunDir(run_dir).agent_timings.read_text()), **caller}
    except (OSError, ValueError):
        pass
    found = Timings(caller=caller, ranks=ranks)
    write_private(run_dir / "timings.json", json.dumps(found.as_json(), indent=1).encode())
    return found
