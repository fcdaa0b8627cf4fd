"""The node launcher: one run over several machines without Ray, as torchrun runs one: every
machine runs gpufleet with the same options (``--nnodes 2 --rdzv-endpoint HOST:PORT``, or
inside a Slurm allocation, none), starts its own ranks with torch elastic's agent, and meets
the others in elastic's c10d rendezvous.

What gpufleet adds to torchrun (docs/design.md, "Nodes without Ray"):

- **One store for the whole run**, served by the gpufleet process of the machine that holds the
  endpoint's address (``_node_store.py``): the rendezvous of every round, and the machines'
  beats and words to each other.
- **Fail together.** A rank's failure, a hang or a lost machine on any machine ends the round
  on every machine within seconds (a failure: about a second; a lost machine: LOST_AFTER_S),
  and every machine's error names the root cause: the rank and machine that failed first.
- **Rounds.** Each attempt of a run is a round with a rendezvous of its own. In an elastic run
  (``--nnodes MIN:MAX``) a lost machine or one that asks to join ends the round, and the next
  starts at the new size without counting as a retry; a run that saves with the
  ``Checkpointer`` resumes resharded, and ``gpufleet.data`` loaders at the global position.

Each machine keeps its own run folder: the logs, results and record of its own ranks.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import time
from dataclasses import dataclass

from gpufleet import _environ
from gpufleet._log import log
from gpufleet.errors import ConfigError, RankFailure, RunFailedError, describe, order_failures
from gpufleet.launchers import _node_store, hardware, local
from gpufleet.launchers._node_store import Ended, NodeStore
from gpufleet.launchers.base import Gate, Launcher
from gpufleet.launchers.hardware import Placement
from gpufleet.launchers.local import LaunchPlan, LocalJob, LocalLauncher
from gpufleet.options import RunOptions, spell
from gpufleet.rundir import Attempt
from gpufleet.watch.monitor import RunMonitor

DEFAULT_PORT = 29400  # torchrun's for the c10d rendezvous
WATCH_EVERY_S = 0.25
AGENT_STOP_S = 10.0  # an agent stopped by the watch that has not ended by then is killed
SAY_WAITING_AFTER_S = 10.0
JOIN_GRACE_S = 10.0  # a round that started without this machine: it asks to join after this
HANG_ANSWER_S = 20.0  # for the other machines' stacks after a hang (each takes a few seconds)
ECHO_WAIT_S = 5.0  # a machine whose ranks only saw a communication error lets the others speak
# (2 s was too short on 2 loaded cores: the failing machine had not spoken yet)
TRACEBACK_CHARS = 4000  # of a root cause's traceback, shared with the other machines


@dataclass(frozen=True)
class NodeSpec:
    """Where and how the machines of a run meet."""

    min_nodes: int
    max_nodes: int
    host: str
    port: int
    rdzv_id: str
    node_rank: int | None = None
    slurm: bool = False  # read from a Slurm allocation

    @property
    def elastic(self) -> bool:
        return self.min_nodes != self.max_nodes

    @property
    def endpoint(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def describe(self) -> str:
        count = f"{self.min_nodes} to {self.max_nodes}" if self.elastic else str(self.max_nodes)
        source = " (from Slurm)" if self.slurm else ""
        return f"{count} machine{'s' if self.max_nodes > 1 else ''} meeting at {self.endpoint}, run {self.rdzv_id!r}{source}"


def wanted(options: RunOptions) -> bool:
    """Whether a run is a node run: ``nnodes`` says so, or a Slurm job step over several
    machines that it runs in (not inside a rank, a warm pool or a Ray run; ``nnodes=1`` keeps
    a run on its machine)."""
    if options.nnodes is not None:
        return options.nnodes != (1, 1) or options.rdzv_endpoint is not None
    if options.remote or options.warm or _environ.run_dir() is not None or not _environ.slurm_job():
        return False
    from gpufleet.launchers import _slurm

    slurm = _slurm.from_environment(_environ.snapshot())
    return slurm is not None and slurm.nnodes > 1  # a step on one machine: a run here


def default_id(options: RunOptions, name: str) -> str:
    """The rendezvous id when none is given: the Slurm step's, else the run's name (the same
    on every machine, unlike its run id)."""
    if options.nnodes is None:
        from gpufleet.launchers import _slurm

        slurm = _slurm.from_environment(_environ.snapshot())
        if slurm is not None:
            return slurm.run_id
    return _safe(options.name or name)


def spec(options: RunOptions) -> NodeSpec:
    """The run's machines, from its options, else from Slurm's variables; ConfigError naming
    what is missing."""
    slurm = None
    if options.nnodes is None:
        from gpufleet.launchers import _slurm

        slurm = _slurm.from_environment(_environ.snapshot())
    if slurm is None and options.nnodes is None:
        raise ConfigError(f"{spell('nnodes')} is not set and this is not a Slurm job step")
    low, high = options.nnodes or (slurm.nnodes, slurm.nnodes)  # type: ignore[union-attr]
    endpoint = options.rdzv_endpoint or (f"{slurm.host}:{slurm.port}" if slurm else None)
    if endpoint is None:
        raise ConfigError(
            f"{spell('nnodes', f'{low}:{high}' if low != high else low)} needs {spell('rdzv_endpoint')}: "
            f"HOST:PORT of one of the machines, the same on every machine, e.g. "
            f"{spell('rdzv_endpoint', 'node001:29400')}")
    host, _, port = endpoint.rpartition(":") if endpoint.rpartition(":")[2].isdigit() else (endpoint, "", "")
    node_rank = options.node_rank if options.node_rank is not None else (slurm.node_rank if slurm else None)
    if node_rank is not None and node_rank >= high:
        raise ConfigError(f"{spell('node_rank', node_rank)} but the run has at most {high} machine"
                          f"{'s' if high > 1 else ''}: node ranks go from 0 to {high - 1}")
    rdzv_id = options.rdzv_id or (slurm.run_id if slurm else None) or "gpufleet"
    return NodeSpec(low, high, host.strip("[]"), int(port or DEFAULT_PORT), rdzv_id, node_rank, slurm is not None)


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "-" for c in name) or "run"


def place(options: RunOptions) -> Placement:
    """This machine's share: its GPUs (or CPU processes), as a run here would have; the
    machines' spec is checked first."""
    found = spec(options)
    if found.slurm and options.nnodes is None:
        log.info(f"in a Slurm job step: {found.describe()}")
    return hardware.place(options.gpus, options.gpu_type)


class NodeLauncher(Launcher[LaunchPlan]):
    """This machine's part of a node run: its devices and its connection to the run's store
    for every round, an agent for each."""

    def __init__(self, placement: Placement, options: RunOptions, gate: Gate):
        self.local = LocalLauncher(placement, options, gate)  # this machine's devices
        self.options = options
        self.gate = gate
        self.spec = spec(options)
        self.store: NodeStore | None = None
        self.job: NodeJob | None = None  # the last round's

    def plan(self, attempt: Attempt, env: dict[str, str]) -> LaunchPlan:
        plan = self.local.plan(attempt, env)
        mine = {**_environ.snapshot(), **self.options.env}
        env = {k: v for k, v in plan.env.items() if k != "NODE_RANK"}  # the rendezvous places it
        for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            if name not in mine:  # the interface that reaches the endpoint: set at launch
                env.pop(name, None)
        node = {"endpoint": self.spec.endpoint, "min_nodes": self.spec.min_nodes,
                "max_nodes": self.spec.max_nodes, "node_rank": self.spec.node_rank}
        return dataclasses.replace(plan, env=env, node=node)

    def launch(self, plan: LaunchPlan) -> "NodeJob":
        lease = self.local._hold_devices()
        self.gate.begin(lease.ids)
        store = self._store()
        addr, interface = _node_store.route_to(self.spec.host, self.spec.port)
        env = {**plan.env, **lease.env(), **self.options.env}
        for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            if interface and name not in plan.env:
                env[name] = interface
        while True:
            number = self._round_to_join(store, addr)
            node = {**(plan.node or {}), "run_id": f"{self.spec.rdzv_id}.r{number}", "addr": addr}
            agent = local.launch(dataclasses.replace(plan, env=env, node=node))
            job = NodeJob(agent, plan.folder, plan.nprocs, store, number, self.spec, addr)
            self.job = job
            if job.meet(self.gate):
                here = f"{job.ranks[0]}-{job.ranks[-1]}" if len(job.ranks) > 1 else str(job.ranks[0])
                log.info(f"node {job.group_rank} of {job.nnodes} ({addr}): rank{'s' * (len(job.ranks) > 1)} "
                         f"{here} of {job.world_size}, round {number}")
                return job
            job.release()
            if store.round() == number and store.ended(number) is None:  # the agent failed alone
                raise job.did_not_meet()

    def _store(self) -> NodeStore:
        if self.store is None:
            log.info(f"this machine is one of {self.spec.describe()}")
            self.store = NodeStore.open(self.spec.host, self.spec.port, self.spec.rdzv_id, _node_store.node_id())
        return self.store

    def _round_to_join(self, store: NodeStore, addr: str) -> int:
        """The round this machine joins: the current one, unless it has ended (then the
        next); an elastic run's round that started without this machine is asked to end."""
        number = store.round()
        if store.ended(number) is None and store.started(number) and self.spec.elastic and (
                self.job is None or self.job.round != number):
            store.end(number, Ended("joined", -1, addr, f"a machine ({addr}) asks to join",
                                    by=store.me))
        if store.ended(number) is not None:
            number = store.next_round(number)
        return number

    def resized(self, error: RunFailedError) -> bool:
        """Whether the attempt ended because the machines changed, in an elastic run: the
        next round starts at the new size, not counted as a retry."""
        ended = self.job.ended_by if self.job is not None else None
        return self.spec.elastic and ended is not None and ended.kind in ("lost", "joined")

    def close(self) -> None:
        try:
            if self.store is not None:
                others = self.job.others() if self.job is not None else []
                self.store.close(others, self.job.round if self.job is not None else 0)
        finally:
            self.local.close()


class NodeJob(LocalJob):
    """This machine's agent in one round, watched with the run's store."""

    def __init__(self, agent, attempt, nprocs: int, store: NodeStore, number: int, spec: NodeSpec,
                 addr: str):
        super().__init__(agent, attempt, nprocs)
        self.store, self.round, self.spec, self.addr = store, number, spec, addr
        self._ranks: list[int] = []
        self.group_rank, self.nnodes = -1, 0
        self.members: dict[int, dict] = {}
        self.ended_by: Ended | None = None
        self._next_watch = 0.0
        self._stopping: float | None = None  # when the watch stopped this machine's ranks
        self._answered = False  # this machine gave its stacks for a hang

    @property
    def ranks(self) -> list[int]:
        return self._ranks

    def describe(self) -> str:
        return f"the launcher process of node {self.group_rank} (torch elastic agent, pid {self.agent.pid})"

    def where(self) -> str:
        return f"node {self.group_rank} ({self.addr})"

    # -- meeting -----------------------------------------------------------------------------

    def meet(self, gate: Gate) -> bool:
        """Wait until the machines of this round have met (True), or the agent ended, or the
        round ended first (False)."""
        try:
            return self._meet(gate)
        except BaseException:  # Ctrl-C, a stop: the agent must not wait on in the rendezvous
            self.stop()
            self.release()
            raise

    def _meet(self, gate: Gate) -> bool:
        started = time.monotonic()
        path = self.attempt.path / "round.json"
        said = False
        while not path.exists():
            if not said and time.monotonic() - started > SAY_WAITING_AFTER_S:
                said = True
                log.info(f"waiting for the other machines to meet at {self.spec.endpoint} "
                         f"(round {self.round}; {self.spec.describe()})")
            if self.agent.poll() is not None:
                return path.exists()
            if gate.stopped():
                raise gate.never_started()
            ended = self.store.ended(self.round)
            if ended is not None:
                self.ended_by = ended
                self.stop()
                return False
            if (self.spec.elastic and time.monotonic() - started > JOIN_GRACE_S
                    and self.store.started(self.round)):  # it met without this machine
                self.store.end(self.round, Ended("joined", -1, self.addr,
                                                 f"a machine ({self.addr}) asks to join", by=self.store.me))
            time.sleep(0.05)
        met = json.loads(path.read_text())
        self.world_size, self._ranks = met["world_size"], met["ranks"]
        self.group_rank, self.nnodes = met["group_rank"], met["nnodes"]
        self.monitor = RunMonitor(self.attempt, self._ranks, self.reports.nccl_traces)
        self.store.joined(self.round, self.group_rank, {"id": self.store.me, "addr": self.addr,
                                                        "ranks": self._ranks})
        return True

    def did_not_meet(self) -> RunFailedError:
        report = self.attempt.agent_report
        detail = ""
        try:
            detail = json.loads(report.read_text()).get("error", "")
        except (OSError, ValueError):
            pass
        last = [line for line in detail.strip().splitlines() if line.strip()][-1:] or ["(no report)"]
        return RunFailedError(
            [], run_dir=self.attempt.path, world_size=self.nprocs_here,
            headline=f"the machines did not meet at {self.spec.endpoint} (run {self.spec.rdzv_id!r}): "
            f"{last[0]}; the agent's log: {self.attempt.agent_log}")

    @property
    def nprocs_here(self) -> int:
        return len(self._ranks) or self.world_size

    # -- watching ----------------------------------------------------------------------------

    def poll(self) -> int | None:
        code = self.agent.poll()
        now = time.monotonic()
        if code is None and self._stopping is None and now >= self._next_watch:
            self._next_watch = now + WATCH_EVERY_S
            self._watch()
        elif code is None and self._stopping is not None and now - self._stopping > AGENT_STOP_S:
            # an agent stopping talks to the run's store, which may be gone with its machine
            self.release()
            code = self.agent.poll()
        return code

    def _watch(self) -> None:
        """End this machine's ranks when the round ended elsewhere, or a machine went silent;
        give this machine's stacks when another machine saw a hang."""
        try:
            self._answer_stacks()
            ended = self.store.ended(self.round)
            if ended is None:
                self._know_members()
                silent = self.store.stale(self.others(), self.round)
                if silent:
                    ended = self.store.end(self.round, self._lost(silent[0]))
        except Exception as exc:  # the store is gone: its machine or its gpufleet was lost
            ended = self._store_lost(exc)
        if ended is not None:  # this machine's own word too: a machine it found silent
            self.ended_by = ended
            self._stopping = time.monotonic()
            log.warning(f"{ended.where()}: {ended.summary}; stopping this machine's ranks")
            self.stop()

    def _know_members(self) -> None:
        """The round's machines, as they say they met (read until every one has)."""
        if len(self.members) < self.nnodes:
            self.members = self.store.members(self.round, self.nnodes)

    # -- hangs -------------------------------------------------------------------------------

    def every_rank(self, states: dict) -> tuple[dict, dict[int, str]]:
        """This machine's stacks and the others', which it asks for: the culprit among all the
        run's ranks (every machine that sees the hang reads the same stacks, and the first one
        to see it says the root cause)."""
        hosts = dict.fromkeys(self.ranks, self.where())
        try:
            self._know_members()
            self.store.ask_for_stacks(self.round)
            self._give_stacks(states)
            wanted = {g: m for g, m in self.members.items() if m["id"] in self.store.running(self.others(), self.round)}
            deadline = time.monotonic() + HANG_ANSWER_S
            while wanted and time.monotonic() < deadline:
                for g in list(wanted):
                    given = self.store.stacks(self.round, g)
                    if given is not None:
                        states.update(_states_from(given))
                        hosts.update(dict.fromkeys(map(int, given), f"node {g} ({wanted.pop(g)['addr']})"))
                time.sleep(0.2)
        except Exception as exc:  # the store is gone: this machine's stacks still speak
            log.warning(f"the other machines' stacks could not be read: {exc}")
        return states, hosts

    def _answer_stacks(self) -> None:
        asker = self.store.stacks_asked(self.round)
        if asker is None or asker == self.store.me or self._answered:
            return
        self._answered = True
        finished = {r for r in self.ranks if self.attempt.result(r).exists()}
        self._give_stacks(self.monitor.collect_stacks(skip=finished))

    def _give_stacks(self, states: dict) -> None:
        self._answered = True
        self.store.give_stacks(self.round, self.group_rank, {
            str(rank): _state_to(state) for rank, state in states.items()
            if not self.attempt.result(rank).exists()})  # a rank that returned is no culprit

    def others(self) -> list[str]:
        return [m["id"] for m in self.members.values() if m["id"] != self.store.me]

    def _lost(self, node_id: str) -> Ended:
        group, info = next((g, m) for g, m in self.members.items() if m["id"] == node_id)
        return Ended("lost", group, info["addr"], f"lost: no heartbeat from its gpufleet process "
                     f"for {_node_store.LOST_AFTER_S:g} s (the machine, its network or the process "
                     "is gone)", rank=info["ranks"][0], by=self.store.me)

    def _store_lost(self, exc: BaseException) -> Ended:
        return Ended("lost", -1, self.spec.endpoint, f"the run's store at {self.spec.endpoint} "
                     f"cannot be reached ({type(exc).__name__}): the machine that serves it, or its "
                     "gpufleet process, is gone", by="")

    # -- the root cause ----------------------------------------------------------------------

    def cause(self, failures: list[RankFailure]) -> RankFailure | None:
        """The round's root cause when it was not this machine's (then every failure here
        is its echo); this machine's own first failure is said to the others first."""
        for failure in failures:
            failure.host = self.where()
        if self.ended_by is None:
            self.ended_by = self._say(order_failures(failures)[0] if failures else None)
        ended = self.ended_by
        if ended.by == self.store.me and ended.kind == "failed":
            return None
        for failure in failures:
            if failure.kind == "lost":  # no result: this machine stopped them (SIGTERM)
                failure.kind, failure.exitcode, failure.summary = "signal", -signal.SIGTERM, "signal SIGTERM"
        return RankFailure(rank=ended.rank, kind="lost" if ended.kind in ("lost", "joined") else "exception",
                           summary=ended.summary, host=ended.where(), traceback=ended.traceback)

    def _say(self, root: RankFailure | None) -> Ended:
        """Tell the others how this machine's round ended, unless another machine's word was
        first. A machine that went silent meanwhile is the likelier cause (its peers' ranks fail
        with a connection error before its silence shows): every other machine must beat again
        first, LOST_AFTER_S at most. A communication error is likelier the echo of a failure
        elsewhere, whose machine then speaks first: it waits ECHO_WAIT_S more. A hang that
        another machine diagnoses is that machine's to say (HANG_ANSWER_S more)."""
        try:
            self._know_members()
            since = self.store.counters(self.others())
            deadline = time.monotonic() + _node_store.LOST_AFTER_S + 1
            if self.store.stacks_asked(self.round) not in (None, self.store.me):
                deadline += HANG_ANSWER_S
                root = root if root is None else dataclasses.replace(root, collateral=True)
            alive_since: float | None = None
            while time.monotonic() < deadline and self.store.ended(self.round) is None:
                if alive_since is None and self.store.beaten_since(self.others(), since, self.round):
                    alive_since = time.monotonic()
                waited = time.monotonic() - (alive_since or 0)
                if alive_since is not None and (root is None or not root.collateral or waited > ECHO_WAIT_S):
                    break
                silent = self.store.stale(self.others(), self.round)
                if silent:
                    return self.store.end(self.round, self._lost(silent[0]))
                time.sleep(_node_store.BEAT_S / 2)
            return self.store.end(self.round, self._word(root))
        except Exception as exc:
            return self._store_lost(exc)

    def _word(self, root: RankFailure | None) -> Ended:
        """This machine's root cause as the others read it (its rank may be another
        machine's, after a hang diagnosed across machines)."""
        if root is None:
            return Ended("failed", self.group_rank, self.addr, "ended", by=self.store.me)
        summary = describe(dataclasses.replace(root, host="", pid=None))
        return Ended("failed", self.group_rank, self.addr, summary, rank=root.rank,
                     traceback=(root.traceback or "")[-TRACEBACK_CHARS:], by=self.store.me,
                     host=root.host if root.rank not in self.ranks else "")

    def __exit__(self, kind, error, traceback) -> None:
        """A round that ended here in a hang, a timeout, a cancel or a SIGTERM ends for every
        machine; one whose ranks all returned is done."""
        try:
            if error is not None and self.ended_by is None and isinstance(error, RunFailedError):
                root = error.root_cause
                self.ended_by = self._say(root if root else RankFailure(
                    rank=-1, kind="exit", summary=error.headline))
            self.store.done(self.round)
        except Exception as exc:  # the store is gone: nothing to tell
            log.debug(f"could not tell the other machines: {exc}")
        super().__exit__(kind, error, traceback)



def _state_to(state) -> dict | None:
    """A rank's stacks as the other machines read them (``diagnosis.RankState``)."""
    if state is None:
        return None
    caller = state.unfinished_caller
    return {"frames": [[f.file, f.line, f.func] for f in state.frames], "text": state.text[-TRACEBACK_CHARS:],
            "unfinished": state.unfinished, "caller": [caller.file, caller.line, caller.func] if caller else None}


def _states_from(given: dict) -> dict:
    from gpufleet.watch.diagnosis import Frame, RankState

    states: dict[int, RankState | None] = {}
    for rank, state in given.items():
        if state is None:
            states[int(rank)] = None
            continue
        caller = Frame(*state["caller"]) if state["caller"] else None
        states[int(rank)] = RankState(rank=int(rank), frames=tuple(Frame(*f) for f in state["frames"]),
                                      text=state["text"], unfinished=state["unfinished"], unfinished_caller=caller)
    return states
