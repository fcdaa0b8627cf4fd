"""The caller's eyes on a live run: each rank's pid, memory and progress, sampled through
psutil and the run folder, and each rank's stacks on request.

Sampling is cheap (a few small reads twice a second) and needs nothing from the ranks but
their pid files, heartbeat files and faulthandler (set up by ``gpufleet.rank.worker``). The
OOM kill counters (cgroups, ``/proc/vmstat``) are Linux's: elsewhere there are none to read,
and a SIGKILL is reported without that evidence.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from gpufleet import _process, _stacks
from gpufleet.rundir import Ranks, RunDir, rank_list, read_pid
from gpufleet.watch import diagnosis

SAMPLE_EVERY_S = 0.5
STACKS_WAIT_S = 3.0  # how long ranks get to write their stacks
NCCL_DUMP_WAIT_S = 2.0  # and their NCCL flight recorders to dump, after that
GIB = 2**30
_V2_ROOT = next(
    (p for p in (Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup")) if (p / "cgroup.procs").exists()),
    Path("/sys/fs/cgroup"),
)


@dataclass
class _Rank:
    pid: int | None = None
    rss: int = 0  # bytes, at the last sample
    sampled_at: float = 0.0
    oom_counters: dict[Path, int] = field(default_factory=dict)  # cgroup file -> count at start


class RunMonitor:
    """Watches the ranks of one run; ``sample()`` is called from the supervisor's loop."""

    def __init__(self, run: RunDir, ranks: Ranks, nccl_traces: Path | None = None):
        """``ranks``: those the run folder holds (a count: 0 to N-1). ``nccl_traces``: the
        prefix of the ranks' NCCL flight-recorder files, when not the run's own (a warm pool's
        ranks keep the one they started with)."""
        self.run = run
        self.nccl_traces = nccl_traces or run.nccl_traces
        self.ranks = {r: _Rank() for r in rank_list(ranks)}
        self.global_ooms = _vmstat_oom_kills()
        self.started_at: float | None = None  # wall time once every rank has a pid
        self.last_progress = 0.0
        self._next_sample = 0.0

    # -- progress ---------------------------------------------------------------------------

    def progress(self) -> None:
        """Output arrived from some rank."""
        self.last_progress = time.time()

    def seconds_without_progress(self) -> float | None:
        """None until every rank has started; then seconds since any output or heartbeat."""
        if self.started_at is None:
            return None
        beats = []
        for rank in self.ranks:
            try:
                beats.append(self.run.heartbeat(rank).stat().st_mtime)
            except FileNotFoundError:
                pass
        latest = max([self.started_at, self.last_progress, *beats])
        return time.time() - latest

    # -- sampling ---------------------------------------------------------------------------

    def sample(self) -> None:
        now = time.monotonic()
        if now < self._next_sample:
            return
        self._next_sample = now + SAMPLE_EVERY_S
        for rank, state in self.ranks.items():
            if state.pid is None:
                state.pid = read_pid(self.run.pid_file(rank))
                if state.pid is None:
                    continue
            rss = _rss(state.pid)
            if rss is None:
                continue
            state.rss, state.sampled_at = rss, time.time()
            for counter in _cgroup_oom_files(state.pid):
                if counter not in state.oom_counters:
                    count = _oom_kills_in(counter)
                    if count is not None:
                        state.oom_counters[counter] = count
        if self.started_at is None and all(s.pid is not None for s in self.ranks.values()):
            self.started_at = time.time()

    def pids(self) -> dict[int, int]:
        return {r: s.pid for r, s in self.ranks.items() if s.pid is not None}

    def alive(self) -> int:
        """How many ranks run now (for the status line)."""
        return sum(_process.alive(pid) for pid in self.pids().values())

    # -- out of memory ----------------------------------------------------------------------

    def oom_kill_evidence(self, rank: int) -> str | None:
        """Why a rank that died of SIGKILL was most likely the kernel's OOM killer's victim,
        or None when no OOM kill happened during the run (in its cgroup or on the host)."""
        state = self.ranks[rank]
        seen, precise = [], False
        for counter, before in state.oom_counters.items():
            after = _oom_kills_in(counter)
            precise = precise or counter.name == "memory.events"
            if after is not None and after > before:
                seen.append(f"{counter.parent}: oom_kill {before} → {after}")
        if not seen and not precise:
            # cgroup v1 counts only OOMs of the cgroup's own limit; the host's count is the
            # fallback (it may count another process's kill: hence "most likely")
            now = _vmstat_oom_kills()
            if self.global_ooms is not None and now is not None and now > self.global_ooms:
                seen.append(f"/proc/vmstat: oom_kill {self.global_ooms} → {now}")
        if not seen:
            return None
        used = ""
        if state.sampled_at:
            ago = max(0.0, time.time() - state.sampled_at)
            used = f"; it used {state.rss / GIB:.2f} GiB of host memory {ago:.1f} s before it died"
        cap = _cgroup_limit(state.oom_counters)
        limit = f" (limit of its cgroup: {cap / GIB:.2f} GiB)" if cap else ""
        return (
            "SIGKILL, most likely from the kernel's out-of-memory killer: it counted kills "
            "during the run (" + "; ".join(seen) + ")"
            + used + limit
            + " — use less host memory per rank: smaller batches or fewer DataLoader workers, "
            "load data lazily, or run fewer ranks"
        )

    # -- stacks -----------------------------------------------------------------------------

    def collect_stacks(self, skip=()) -> dict[int, diagnosis.RankState | None]:
        """Ask every live rank (but those in ``skip``) for its stacks (SIGUSR1 →
        faulthandler) and read them back."""
        offsets, asked = {}, {}
        for rank, pid in self.pids().items():
            if rank in skip:
                continue
            path = self.run.stacks(rank)
            offsets[rank] = path.stat().st_size if path.exists() else 0
            try:
                os.kill(pid, signal.SIGUSR1)
                asked[rank] = path
            except ProcessLookupError:
                pass
        _request_nccl_dumps(self.nccl_traces, asked)
        end = time.monotonic() + STACKS_WAIT_S
        states: dict[int, diagnosis.RankState | None] = {r: None for r in self.ranks}
        pending = set(asked)
        while pending and time.monotonic() < end:
            time.sleep(0.1)
            for rank in sorted(pending):
                text = _stacks.dump_since(asked[rank], offsets[rank])
                if text is not None:
                    states[rank] = diagnosis.parse_dump(rank, text)
                    pending.discard(rank)
        nccl = {r: Path(f"{self.nccl_traces}{r}") for r in asked}
        if any(Path(f"{p}.pipe").exists() for p in nccl.values()):
            # NCCL's monitor thread reads its pipe about once a second, then dumps.
            until = time.monotonic() + NCCL_DUMP_WAIT_S
            while time.monotonic() < until and not all(p.exists() for p in nccl.values()):
                time.sleep(0.1)
            time.sleep(0.2)
        for rank, state in states.items():
            if state is not None and rank in nccl:
                states[rank] = diagnosis.with_flight_record(state, nccl[rank])
        return states


def _request_nccl_dumps(prefix: Path, ranks) -> None:
    """Ask PyTorch's NCCL flight recorder of each rank for a dump (through the pipe that
    TORCH_NCCL_DEBUG_INFO_PIPE_FILE makes it open); nothing to do on CPU runs."""
    for rank in ranks:
        pipe = Path(f"{prefix}{rank}.pipe")
        if not pipe.exists():
            continue
        try:
            fd = os.open(pipe, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:  # nobody reads it (any more)
            continue
        try:
            os.write(fd, b"1\n")
        except OSError:
            pass
        finally:
            os.close(fd)


def _rss(pid: int) -> int | None:
    try:
        return psutil.Process(pid).memory_info().rss
    except psutil.Error:  # gone
        return None


def _vmstat_oom_kills() -> int | None:
    """The host's count of OOM kills (Linux); None where there is none to read."""
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except (OSError, ValueError):  # no /proc (macOS), or no such line: no evidence
        pass
    return None


def _cgroup_oom_files(pid: int) -> list[Path]:
    """The file counting OOM kills of the process's own memory cgroup (cgroup v2
    ``memory.events``: kills of its processes by any OOM killer; v1 ``memory.oom_control``:
    kills under its own limit). Ancestors are left out: they count their other children's
    kills too. None of them off Linux."""
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:  # gone, or no /proc (macOS)
        return []
    files = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2 (under .../unified on hybrid hosts)
            base, name = _V2_ROOT, "memory.events"
        elif "memory" in controllers.split(","):  # v1
            base, name = Path("/sys/fs/cgroup/memory"), "memory.oom_control"
        else:
            continue
        counter = base / path.lstrip("/") / name
        if counter.exists():
            files.append(counter)
    return files


def _oom_kills_in(path: Path) -> int | None:
    try:
        for line in path.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    except (OSError, ValueError):
        pass
    return None


def _cgroup_limit(counters: dict[Path, int]) -> int | None:
    """The tightest memory limit among the cgroups watched, in bytes."""
    limits = []
    for counter in counters:
        for name in ("memory.max", "memory.limit_in_bytes"):
            try:
                value = (counter.parent / name).read_text().strip()
            except OSError:
                continue
            if value.isdigit() and int(value) < 2**60:
                limits.append(int(value))
    return min(limits) if limits else None
