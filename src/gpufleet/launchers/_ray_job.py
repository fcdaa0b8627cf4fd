"""A running Ray job as the watcher drives it (``launchers.base.Job``), and the thread that
mirrors it.

``RayJob``'s ``release`` ends its actors and placement group in place of killing local
process groups: its processes are on other machines, and their pids mean nothing here. A
pump thread polls every rank's actor (``_ray_node.RankNode``) and mirrors what the rank wrote
into the caller's run folder: log bytes, stacks, heartbeats, timings, the result, then the
exit status. So the supervisor's log following, timeouts, hang detection and result
collection work unchanged. The pump is also the remote run's fail-fast: the first rank that
fails or is lost stops the others. In an elastic run it also watches for room to grow
(``Growth``), and says when the cluster ended the attempt (``changed``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gpufleet._log import log
from gpufleet.launchers.base import Job
from gpufleet.payload import write_private
from gpufleet.rundir import Attempt, LauncherState
from gpufleet.watch import diagnosis
from gpufleet.watch.monitor import STACKS_WAIT_S, RunMonitor

PUMP_SECONDS = 0.05  # between two rounds of polls
STOP_GRACE_SECONDS = 5.0  # SIGTERM, then SIGKILL: as elastic's agent does locally
UNAVAILABLE_LOST_S = 3.0  # an actor Ray cannot reach this long is lost with its node
SILENT_LOST_S = 15.0  # an actor that does not answer a poll this long is lost too
RELEASE_WAIT_S = 5.0
CLOSE_MARGIN_S = 2.0  # beyond a node's own wait for its rank to exit (_ray_node.CLOSE_WAIT_S)
GROW_CHECK_S = 2.0  # an elastic job below its maximum asks Ray for room this often
GROW_STABLE_S = 5.0  # room that lasts this long (no one else took it) makes the job grow


@dataclass(frozen=True)
class Growth:
    """What an elastic job below its largest size needs to see room for more ranks."""

    most: int  # its largest size
    grace: float  # grace_period: for the ranks to stop by themselves before SIGTERM
    spelled: str  # its sizes, in words, for messages
    room: Callable[[dict[str, int]], int]  # ranks the cluster could hold now, given the job's own by node


@dataclass
class RankActor:
    """One rank's actor and what the pump knows of it."""

    rank: int
    actor: Any
    bundle: int  # its index in the placement group (and in RayJob.actors)
    where: str  # "node 1: host 10.0.0.2", for errors and the launcher's log
    node_id: str = ""  # Ray's id of its node
    pending: Any = None  # the poll in flight
    asked_at: float = 0.0
    seen_at: float = field(default_factory=time.time)  # its last answer: when it was last alive
    unreachable_since: float | None = None
    started: bool = False  # the rank wrote its pid file: it runs its function
    pid: int | None = None  # on its node; never used on this machine
    exit: int | None = None
    returned: bool = False  # its result is here (an exit 0 without one is a failure)
    ended_at: float = 0.0
    lost: str | None = None  # why it counts as lost
    actor_dead: bool = False  # Ray reported its actor dead (nothing left to close)
    pushed: set = field(default_factory=set)  # caller files handed to it

    @property
    def final(self) -> bool:
        return self.exit is not None or self.lost is not None

    @property
    def failed(self) -> bool:
        return self.lost is not None or (self.exit is not None and (self.exit != 0 or not self.returned))


class RayJob(Job):
    """The ranks of one attempt on a Ray cluster, their actors and placement group."""

    def __init__(self, run: Attempt):
        self.run = self.attempt = self.reports = run
        self.world_size = 0  # once started
        self.stamps: dict[str, float] = {}
        self.group = None  # the placement group, once asked for
        self.actors: list = []  # one per bundle, in bundle order
        self.rank_actors: list[RankActor] = []  # in rank order, once started
        self.returncode: int | None = None
        self._done = threading.Event()
        self._quit = threading.Event()
        self._stopping_since: float | None = None
        self._killed = False
        self._stopped_by_caller = False
        self._hosts: dict[str, str] = {}
        self._release_lock = threading.Lock()
        self._released = False
        self.growth: Growth | None = None
        self.changed: str | None = None  # the cluster ended the attempt: why (a lost rank, room to grow)
        self.lost_on: set[str] = set()  # nodes where Ray lost ranks of this job
        self.grown_to: int | None = None  # the room it stopped to grow into
        self._growing_since: float | None = None  # asked the ranks to stop, to start again larger
        self._grown_at = 0.0
        self._room_since: float | None = None
        self._next_room_check = 0.0
        self._pump_thread = threading.Thread(target=self._pump, name="gpufleet-ray-pump", daemon=True)

    # -- what the watcher drives ------------------------------------------------------------

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._done.wait(timeout) or self.returncode is None:
            raise subprocess.TimeoutExpired("the ranks on the Ray cluster", timeout or 0.0)
        return self.returncode

    def stop(self) -> None:
        """The watcher stops the run (timeout, hang, Ctrl-C, end of a grace period)."""
        self._stopped_by_caller = True
        self._stop()

    def describe(self) -> str:
        return f"the Ray job of {self.run.name}"

    # -- start and release ------------------------------------------------------------------

    def start(self, ranks: list[RankActor], growth: Growth | None = None) -> "RayJob":
        self.rank_actors, self.growth = ranks, growth
        self.world_size = len(ranks)
        self.monitor = RemoteMonitor(self.run, len(ranks), self)
        self._hosts = {str(r.rank): r.where for r in ranks}
        self._report({"state": LauncherState.RUNNING})
        self._pump_thread.start()
        return self

    def release(self) -> None:
        """Kill every rank and actor of the job and remove its placement group; idempotent,
        bounded in time, and safe from any thread."""
        with self._release_lock:  # a second release (a second Ctrl-C) waits for the first
            self._release()

    def _release_when_ended(self) -> None:
        """The pump's last act: every rank has ended and all it wrote is mirrored, so the
        cluster's GPUs go back at once. The watcher releases a job after its values only
        while the job still runs (a teardown thread); one that ends while the values are
        read would keep its actors and placement group until the caller's Ray connection
        ends. Nothing to do while another thread releases."""
        if self._release_lock.acquire(blocking=False):
            try:
                self._release()
            finally:
                self._release_lock.release()

    def _release(self) -> None:
        """``release``, under its lock."""
        import ray
        from ray.util.placement_group import remove_placement_group

        if self._released:
            return
        try:
            self._quit.set()
            if self._pump_thread.is_alive() and threading.current_thread() is not self._pump_thread:
                self._pump_thread.join(RELEASE_WAIT_S)
            if self.returncode is None:
                _quietly(self._finish, stopped=True)
            # a lost rank's actor that Ray reports dead or cannot reach would only make the
            # close wait its full time: ray.kill below is all it can take
            gone = {r.bundle for r in self.rank_actors
                    if r.lost is not None and (r.actor_dead or r.unreachable_since is not None)}
            closes = [actor.close.remote() for i, actor in enumerate(self.actors) if i not in gone]
            if closes:  # each kills its rank's processes and removes its node's copy of the run
                ray.wait(closes, num_returns=len(closes), timeout=RELEASE_WAIT_S + CLOSE_MARGIN_S)
        finally:  # whatever happened above, the GPUs are given back
            for actor in self.actors:
                _quietly(ray.kill, actor, no_restart=True)
            group = self.group or _named_group(f"gpufleet-{self.run.name}")
            if group is not None:  # also one made just before a Ctrl-C stopped the launch
                _quietly(remove_placement_group, group)
            self._released = True
            # every rank was handed it, and its node's copy goes with close(): the MLflow URI,
            # which may hold a password, stays on no machine of a cluster (docs/security.md)
            self.run.tracking.unlink(missing_ok=True)
            if self.returncode is None:  # the report could not be written: still end
                self.returncode = 1
                self._done.set()
        _quietly(self._note, "released the actors and the placement group")

    # -- the pump ---------------------------------------------------------------------------

    def _pump(self) -> None:
        try:
            while not self._quit.is_set():
                self._poll_round()
                self._push_caller_files()
                self._fail_fast()
                self._watch_growth()
                if all(r.final for r in self.rank_actors):
                    self._finish()
                    self._release_when_ended()
                    return
                time.sleep(PUMP_SECONDS)
        except Exception:  # never a silent hang: what is left of the job counts as lost
            why = traceback.format_exc().strip().splitlines()[-1]
            self._note(f"the pump failed:\n{traceback.format_exc()}")
            for r in self.rank_actors:
                if not r.final:
                    self._lose(r, f"lost: gpufleet stopped following it ({why})", machine=False)
            self._finish()
            self._release_when_ended()

    def _poll_round(self) -> None:
        import ray

        now = time.monotonic()
        live = [r for r in self.rank_actors if not r.final]
        for r in live:
            if r.pending is None:
                r.pending, r.asked_at = r.actor.poll.remote(), now
        refs = [r.pending for r in live]
        # ready once the actor answered, wherever the answer is: a large result still on its
        # way here must not count as silence
        answered, _ = ray.wait(refs, num_returns=len(refs), timeout=PUMP_SECONDS, fetch_local=False)
        ready = set(answered)
        for r in live:
            if r.pending in ready:
                ref, r.pending = r.pending, None
                self._answer(r, ref)
            elif time.monotonic() - r.asked_at > SILENT_LOST_S:
                self._lose(r, f"lost: its actor did not answer for {SILENT_LOST_S:g} s (its node is "
                              "unreachable or stalled)")

    def _answer(self, r: RankActor, ref) -> None:
        import ray

        try:
            answer = ray.get(ref)
        except ray.exceptions.ActorUnavailableError as exc:
            # Ray cannot reach the actor's process; for an actor that is never restarted,
            # that lasting a few seconds means its node (or the process) is gone
            r.unreachable_since = r.unreachable_since or time.monotonic()
            if time.monotonic() - r.unreachable_since > UNAVAILABLE_LOST_S:
                self._lose(r, self._why_lost(r, exc))
            return
        except ray.exceptions.RayActorError as exc:
            r.actor_dead = True
            self._lose(r, self._why_lost(r, exc))
            return
        except ray.exceptions.RayError as exc:  # the actor's poll itself failed on its node
            self._lose(r, f"lost: its actor failed: {_first_line(exc)}")
            return
        r.unreachable_since, r.seen_at = None, time.time()
        self._mirror(r, answer)

    def _mirror(self, r: RankActor, answer: dict) -> None:
        """Into the caller's run folder, in the order the rank wrote: output, stacks,
        heartbeat, telemetry, steps, metrics, progress, timings, result; the exit status last, once the rest
        is here. Every node's telemetry lines go into the one file, each line tagged by node."""
        run, rank = self.run, r.rank
        _append(run.log(rank), answer.get("log"))
        _append(run.stacks(rank), answer.get("stacks"))
        _append(run.telemetry, answer.get("telemetry"))
        _append(run.steps(rank), answer.get("steps"))
        _append(run.metrics_log, answer.get("metrics"))
        if answer.get("beat"):  # the caller's own clock: the nodes' may differ
            _touch(run.heartbeat(rank))
        if answer.get("started"):
            r.started = True
        if answer.get("progress"):
            write_private(run.progress, answer["progress"])
        if answer.get("timings"):
            write_private(run.timings(rank), answer["timings"])
        if answer.get("result") is not None:
            r.returned = True
            # a rank that returned after a stop to grow: its value is no result of the run,
            # whose next attempt resumes at the larger size (from its checkpoint)
            if self._growing_since is None:
                write_private(run.result(rank), answer["result"])
        if answer.get("exit") is not None:
            r.exit, r.ended_at = answer["exit"], answer["ended_at"]
            self._note(f"rank {rank} ({r.where}) exited with {_status(r.exit)}")

    def _why_lost(self, r: RankActor, exc: BaseException) -> str:
        """Whether Ray counts the rank's node as dead (a lost machine) or only its actor
        (a killed process), with Ray's own words."""
        import ray

        alive = {n["NodeID"]: n.get("Alive") for n in ray.nodes()}
        said = _ray_reason(exc)
        if getattr(exc, "preempted", False):
            return f"lost with its node: Ray says the node was preempted ({said})"
        if alive.get(r.node_id) is False:
            return f"lost with its node: Ray counts node {r.node_id[:8]} dead ({said})"
        return f"lost: its Ray actor is gone (its node died, or the process was killed); Ray says {said}"

    def _lose(self, r: RankActor, why: str, machine: bool = True) -> None:
        """``machine``: Ray lost it (its node or actor), rather than gpufleet giving up on it."""
        # dated when it was last heard of: a node that died before its peers' errors is
        # their root cause, not their echo
        r.lost, r.ended_at, r.pending = why, r.seen_at, None
        if machine:
            self.changed = self.changed or f"rank {r.rank} {why}"
            self.lost_on.add(r.node_id)
        self._note(f"rank {r.rank} ({r.where}) lost: {why}")

    def _fail_fast(self) -> None:
        """The first rank that fails or is lost stops the others: SIGTERM, then SIGKILL
        after STOP_GRACE_SECONDS; a rank still not ended after that is lost."""
        if self._stopping_since is None and any(r.failed for r in self.rank_actors):
            failed = next(r for r in self.rank_actors if r.failed)
            self._note(f"rank {failed.rank} failed: stopping the others")
            self._stop()
        if self._stopping_since is None:
            return
        waited = time.monotonic() - self._stopping_since
        if waited > STOP_GRACE_SECONDS and not self._killed:
            self._killed = True
            self._signal_all(signal.SIGKILL)
        if waited > STOP_GRACE_SECONDS + UNAVAILABLE_LOST_S:
            for r in self.rank_actors:
                if not r.final:
                    self._lose(r, f"lost: it did not end within {UNAVAILABLE_LOST_S:g} s of SIGKILL",
                               machine=False)

    # -- growing (an elastic job below its largest size) -------------------------------------

    def _watch_growth(self) -> None:
        """Room for more ranks that lasts GROW_STABLE_S asks every rank to stop
        (``runtime.should_stop()``); those still running after the grace period are stopped.
        The attempt then ends as resized, and the next one starts larger."""
        growth, now = self.growth, time.monotonic()
        if growth is None or self._stopping_since is not None:
            return
        if self._growing_since is not None:
            if now > self._growing_since + growth.grace:
                self._note(f"grace_period={growth.grace:g} s is over: stopping the ranks still running")
                self._stop()
            return
        if now < self._next_room_check:
            return
        self._next_room_check = now + GROW_CHECK_S
        if not all(r.started and not r.final and not r.returned for r in self.rank_actors):
            self._room_since = None  # starting, or ending by itself: nothing to stop
            return
        try:
            room = min(growth.most, growth.room(Counter(r.node_id for r in self.rank_actors)))
        except Exception as exc:  # Ray's state is unreadable for a moment: ask again later
            self._note(f"could not read the cluster's free resources: {type(exc).__name__}: {exc}")
            return
        if room <= self.world_size:
            self._room_since = None
        elif self._room_since is None:
            self._room_since = now
        elif now - self._room_since >= GROW_STABLE_S:
            self._grow(room)

    def _grow(self, room: int) -> None:
        self._growing_since, self._grown_at, self.grown_to = time.monotonic(), time.time(), room
        self.changed = (f"stopped to grow: the Ray cluster has room for {room} ranks "
                        f"({self.growth.spelled if self.growth else ''}), this attempt {self.world_size}")
        self._note(self.changed)
        log.info(f"room for {room} ranks in the Ray cluster (this attempt has {self.world_size}): "
                 "asking every rank to stop (runtime.should_stop()) to start again at that size")
        stop = self.run.stop_request.name
        for r in self.rank_actors:
            r.actor.push.remote(stop, b"RESIZE\n")
            r.pushed.add(stop)

    def _stop(self) -> None:
        if self._stopping_since is None:
            self._stopping_since = time.monotonic()
            self._signal_all(signal.SIGTERM)

    def _signal_all(self, signum: int) -> None:
        for r in self.rank_actors:
            if not r.final:
                r.actor.signal.remote(int(signum))

    def _push_caller_files(self) -> None:
        """Files the caller writes for its ranks (the MLflow run, a stop request after
        SIGTERM) go to every node's run folder."""
        for path in (self.run.tracking, self.run.stop_request):
            if not path.exists():
                continue
            data = None
            for r in self.rank_actors:
                if path.name not in r.pushed and not r.final:
                    data = data if data is not None else path.read_bytes()
                    r.actor.push.remote(path.name, data)
                    r.pushed.add(path.name)

    def _finish(self, stopped: bool = False) -> None:
        """Write the launcher's report (``agent.json``, as the local agent does), then tell
        the supervisor that the job ended."""
        failures = {}
        for r in self.rank_actors:
            if self._growing_since is not None and r.lost is None:
                failures[str(r.rank)] = {"lost": self.changed, "time": self._grown_at}
            elif r.lost is not None:
                failures[str(r.rank)] = {"lost": r.lost, "time": r.ended_at}
            elif r.failed:  # an exit code, or an exit 0 before the rank returned
                failures[str(r.rank)] = {"exitcode": r.exit, "time": r.ended_at}
        if stopped or self._stopped_by_caller:
            state = LauncherState.STOPPED
        else:
            state = LauncherState.FAILED if failures else LauncherState.SUCCEEDED
        self._report({"state": state, "failures": failures})
        self.returncode = 0 if state == LauncherState.SUCCEEDED else 1
        self._done.set()

    # -- the launcher's own files ----------------------------------------------------------

    def _report(self, report: dict) -> None:
        # where each rank runs, read by the supervisor to name the node in failures
        write_private(self.run.agent_report, json.dumps({**report, "hosts": self._hosts}).encode())

    def _note(self, line: str) -> None:
        stamp = time.strftime("%H:%M:%S")
        fd = os.open(self.run.agent_log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with os.fdopen(fd, "a") as log:
            log.write(f"[{stamp}] {line}\n")

    # -- for the monitor --------------------------------------------------------------------

    def ranks_alive(self) -> int:
        """Ranks that run their function now: started, neither exited nor lost."""
        return sum(r.started and not r.final for r in self.rank_actors)

    def all_started(self) -> bool:
        return bool(self.rank_actors) and all(r.started or r.final for r in self.rank_actors)

    def collect_stacks(self, skip=()) -> dict[int, diagnosis.RankState | None]:
        """Every live rank's stacks, asked of its actor (which signals the rank on its node
        and waits for the dump), parsed as a local rank's are."""
        import ray

        asked = {r.rank: r.actor.stacks.remote(STACKS_WAIT_S) for r in self.rank_actors
                 if r.started and not r.final and r.rank not in skip}
        states: dict[int, diagnosis.RankState | None] = {r.rank: None for r in self.rank_actors}
        if asked:
            ray.wait(list(asked.values()), num_returns=len(asked), timeout=STACKS_WAIT_S + 2)
        for rank, ref in asked.items():
            try:
                text = ray.get(ref, timeout=0)
            except Exception:  # no answer in time, or the actor is gone: no stacks for it
                continue
            if text:
                states[rank] = diagnosis.parse_dump(rank, text)
        return states


class RemoteMonitor(RunMonitor):
    """The caller's eyes on ranks that run on other machines: progress and heartbeats come
    from the mirrored files, stacks from the ranks' actors. Nothing is read from this
    machine's /proc or cgroups: those would be another process's."""

    def __init__(self, run: Attempt, world_size: int, job: RayJob):
        super().__init__(run, world_size)
        self.job = job

    def sample(self) -> None:
        if self.started_at is None and self.job.all_started():
            self.started_at = time.time()

    def pids(self) -> dict[int, int]:
        return {}

    def alive(self) -> int:
        return self.job.ranks_alive()

    def oom_kill_evidence(self, rank: int) -> str | None:
        return None

    def collect_stacks(self, skip=()) -> dict[int, diagnosis.RankState | None]:
        return self.job.collect_stacks(skip)


def _append(path, data: bytes | None) -> None:
    if data:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)


def _touch(path) -> None:
    try:
        os.utime(path)
    except FileNotFoundError:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))


def _status(code: int) -> str:
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def _first_line(exc: BaseException, limit: int = 160) -> str:
    text = str(exc).strip()
    line = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {line[:limit]}{'...' if len(line) > limit else ''}"


def _named_group(name: str):
    from ray.util import get_placement_group

    try:
        return get_placement_group(name)
    except ValueError:  # never made
        return None


def _ray_reason(exc: BaseException, limit: int = 400) -> str:
    """Ray's account of a dead actor: its first line, and the line with the cause (out of
    memory, node drained or preempted, worker exit) when Ray gives one."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    cause = next((line for line in lines[1:] if "error_message" in line or "reason" in line.lower()), "")
    text = " ".join(part for part in (lines[0] if lines else "", cause) if part)
    # what differs from one actor to the next (its id, its worker's ip:port) would keep the
    # lost ranks of one node apart in the error: the node names them ("ranks 2, 3: lost ...")
    text = _PER_ACTOR.sub("…", text)
    return f"{type(exc).__name__}: {text[:limit]}{'...' if len(text) > limit else ''}"


_PER_ACTOR = re.compile(r"\b[0-9a-f]{32,}\b|(?:ipv4:)?\d{1,3}(?:\.\d{1,3}){3}:\d+")


def _quietly(fn, *args, **kwargs) -> None:
    """Release steps that fail because their object is already gone (a dead actor, a removed
    group) must not stop the other steps; anything else is printed."""
    import ray

    try:
        fn(*args, **kwargs)
    except (ValueError, ray.exceptions.RayError):
        pass
    except Exception as exc:
        log.warning(f"releasing the Ray job: {type(exc).__name__}: {exc}")
