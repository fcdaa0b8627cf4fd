"""What the machines of a node run share: one TCP store, served by the gpufleet process of the
machine that holds the rendezvous endpoint's address, for the whole run.

torch elastic's agents meet in it (the c10d rendezvous, ``is_host=false`` on every machine),
one rendezvous per round; gpufleet's own keys, under ``gpufleet/<rdzv_id>/``, make the machines
act as one run:

    round              the round now running (each round: a rendezvous of its own, ``<id>.r<K>``)
    beat/<node>        a counter each machine's gpufleet adds to every BEAT_S seconds
    r<K>/node/<g>      node g of round K: its id, address and ranks (written once it has met)
    r<K>/ended         why round K ended, first writer wins: a rank's failure, a lost machine,
                       a machine that asks to join; every machine stops its ranks on seeing it
    r<K>/hang          the machine that saw a hang first asks every machine for its stacks...
    r<K>/stacks/<g>    ...which each writes: the culprit is named among all the run's ranks
    r<K>/done/<node>   the machine is through with round K (its ranks returned, or it has read
                       why the round ended); the serving machine waits for every one before it
                       closes the store

A machine is lost when its counter stops for LOST_AFTER_S. Counters, not clocks: the machines'
clocks need not agree.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import queue
import socket
import threading
import time
from dataclasses import dataclass

from gpufleet._log import log

BEAT_S = 0.5
LOST_AFTER_S = 6.0  # no beat for this long: the machine (or its gpufleet) is gone
CONNECT_TIMEOUT_S = 600.0  # for the serving machine to come up: torchrun's join timeout
CONNECT_TRY_S = 2.0  # each try to connect (Ctrl-C is heard between tries)
OP_TIMEOUT_S = 15.0  # a store that answers no operation for this long is gone
DONE_WAIT_S = 60.0  # the serving machine waits this long for the others to finish


@dataclass(frozen=True)
class Ended:
    """Why a round ended, as every machine reads it."""

    kind: str  # "failed" (a rank), "lost" (a machine), "joined" (a machine asks in), "stopped"
    node: int  # the group rank of the machine it happened on (-1: a machine not in the round)
    addr: str
    summary: str
    rank: int = -1
    traceback: str = ""
    by: str = ""  # the id of the machine that wrote it
    host: str = ""  # where the rank is, when not on the machine that wrote it (a hang's culprit)

    def where(self) -> str:
        if self.host:
            return self.host
        return f"node {self.node} ({self.addr})" if self.node >= 0 else self.addr

    @classmethod
    def read(cls, raw: bytes) -> "Ended":
        return cls(**json.loads(raw))

    def dump(self) -> bytes:
        return json.dumps(self.__dict__).encode()


def is_local(host: str) -> bool:
    """Whether ``host`` names an address of this machine (of its network namespace)."""
    import psutil

    try:
        wanted = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    mine = {a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs}
    return bool(wanted & mine)


def route_to(host: str, port: int) -> tuple[str, str | None]:
    """This machine's address that reaches ``host``, and the interface that holds it: the
    ranks' and the agents' address, and gloo's and NCCL's socket interface."""
    import psutil

    family = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family[0], socket.SOCK_DGRAM) as probe:
        probe.connect(family[4])  # UDP: no packet is sent, the kernel only picks the route
        addr = probe.getsockname()[0]
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == addr for a in addrs):
            return addr, name
    return addr, None


class _Operations:
    """One daemon thread that runs the store's operations in turn, so that the caller can stop
    waiting for one: a TCPStore operation on a connection whose peer vanished (a cable pulled:
    no reset ever comes) waits for ever, and a thread stuck there must not hold the process."""

    def __init__(self):
        self._queue: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._serve, name="gpufleet-node-store", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            operation, outcome, done = self._queue.get()
            try:
                outcome.append((True, operation()))
            except BaseException as exc:  # handed to the caller, which raises it
                outcome.append((False, exc))
            done.set()

    def run(self, operation, timeout: float):
        outcome: list = []
        done = threading.Event()
        self._queue.put((operation, outcome, done))
        if not done.wait(timeout):
            raise TimeoutError(f"no answer in {timeout:g} s")
        ok, value = outcome[0]
        if not ok:
            raise value
        return value


def _bounded(method):
    """The store operation ``method``, run by the store's operations thread, OP_TIMEOUT_S at
    most; once one timed out, the store counts as gone and every later one fails at once."""

    @functools.wraps(method)
    def bounded(self: "NodeStore", *args, **kwargs):
        if threading.current_thread() is self._operations.thread:  # one operation calls another
            return method(self, *args, **kwargs)
        if self.gone is not None:
            raise ConnectionError(f"the run's store at {self.host}:{self.port} is gone: {self.gone}")
        try:
            return self._operations.run(lambda: method(self, *args, **kwargs), OP_TIMEOUT_S)
        except TimeoutError as exc:
            self.gone = exc
            raise

    return bounded


class NodeStore:
    """This machine's connection to the run's store (and the store itself on the serving
    machine), with the thread that beats for it."""

    def __init__(self, host: str, port: int, run_id: str, me: str, server):
        self.host, self.port, self.me = host, port, me
        self.prefix = f"gpufleet/{run_id}/"
        self.server = server  # the TCPStore this process serves, or None
        self._stores = threading.local()  # one client per thread: no two ops share a socket
        self._stop = threading.Event()
        self._beats = threading.Thread(target=self._beat, name="gpufleet-node-beat", daemon=True)
        self._seen: dict[str, tuple[int, float]] = {}  # node id -> (its counter, when it moved)
        self.gone: BaseException | None = None  # the store could not be reached any more
        self._operations = _Operations()

    @classmethod
    def open(cls, host: str, port: int, run_id: str, me: str) -> "NodeStore":
        """Serve the store when ``host`` is this machine's (and the port is free), else
        connect to it, waiting up to CONNECT_TIMEOUT_S for the serving machine."""
        from torch.distributed import TCPStore

        server = None
        if is_local(host):
            try:
                server = TCPStore(host, port, is_master=True, multi_tenant=True, wait_for_workers=False,
                                  timeout=datetime.timedelta(seconds=OP_TIMEOUT_S))
            except (RuntimeError, ValueError) as exc:  # another node of this machine serves it
                log.debug(f"the rendezvous store on port {port} is served elsewhere: {exc}")
        store = cls(host, port, run_id, me, server)
        store._connect()
        store.client().compare_set(store.prefix + "round", "", "0")
        store._beats.start()
        return store

    def _connect(self) -> None:
        """Wait for the serving machine (CONNECT_TIMEOUT_S at most), in short tries, so that
        Ctrl-C is heard between them and the wait is said once it lasts."""
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        said = False
        while True:
            try:
                self.client(connect_timeout=CONNECT_TRY_S)
                return
            except (RuntimeError, TimeoutError) as exc:  # not serving yet
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no machine served the run's store at {self.host}:{self.port} "
                                       f"within {CONNECT_TIMEOUT_S:g} s: is the machine with that address "
                                       f"running gpufleet with the same options? ({exc})") from None
                if not said and time.monotonic() > deadline - CONNECT_TIMEOUT_S + 5:
                    log.info(f"waiting for the machine that serves {self.host}:{self.port} "
                             "(the rendezvous endpoint) to start gpufleet")
                    said = True

    def client(self, connect_timeout: float = OP_TIMEOUT_S):
        from torch.distributed import TCPStore

        store = getattr(self._stores, "store", None)
        if store is None:
            store = TCPStore(self.host, self.port, is_master=False, multi_tenant=True,
                             timeout=datetime.timedelta(seconds=connect_timeout))
            store.set_timeout(datetime.timedelta(seconds=OP_TIMEOUT_S))
            self._stores.store = store
        return store

    # -- rounds ------------------------------------------------------------------------------

    @_bounded
    def round(self) -> int:
        return int(self.client().get(self.prefix + "round"))

    @_bounded
    def next_round(self, ended: int) -> int:
        """Round ``ended`` is over: the next one (whoever asks first moves it on)."""
        value = self.client().compare_set(self.prefix + "round", str(ended), str(ended + 1))
        return int(value)

    @_bounded
    def joined(self, number: int, node: int, info: dict) -> None:
        self.client().set(f"{self.prefix}r{number}/node/{node}", json.dumps(info))

    @_bounded
    def members(self, number: int, nnodes: int) -> dict[int, dict]:
        """The machines of round ``number`` that have met, by group rank."""
        keys = [f"{self.prefix}r{number}/node/{g}" for g in range(nnodes)]
        store = self.client()
        return {g: json.loads(store.get(k)) for g, k in enumerate(keys) if store.check([k])}

    @_bounded
    def started(self, number: int) -> bool:
        return self.client().check([f"{self.prefix}r{number}/node/0"])

    @_bounded
    def end(self, number: int, why: Ended) -> Ended:
        """Say why round ``number`` ended, unless a machine said it first: the first word."""
        key = f"{self.prefix}r{number}/ended"
        return Ended.read(self.client().compare_set(key, "", why.dump()))

    @_bounded
    def ended(self, number: int) -> Ended | None:
        key = f"{self.prefix}r{number}/ended"
        store = self.client()
        return Ended.read(store.get(key)) if store.check([key]) else None

    # -- hangs -------------------------------------------------------------------------------

    @_bounded
    def ask_for_stacks(self, number: int) -> str:
        """Ask every machine of round ``number`` for its ranks' stacks; the id of the machine
        that asked first (the one whose diagnosis counts)."""
        return self.client().compare_set(f"{self.prefix}r{number}/hang", "", self.me).decode()

    @_bounded
    def stacks_asked(self, number: int) -> str | None:
        key = f"{self.prefix}r{number}/hang"
        store = self.client()
        return store.get(key).decode() if store.check([key]) else None

    @_bounded
    def give_stacks(self, number: int, node: int, states: dict) -> None:
        self.client().set(f"{self.prefix}r{number}/stacks/{node}", json.dumps(states))

    @_bounded
    def stacks(self, number: int, node: int) -> dict | None:
        key = f"{self.prefix}r{number}/stacks/{node}"
        store = self.client()
        return json.loads(store.get(key)) if store.check([key]) else None

    # -- liveness ----------------------------------------------------------------------------

    def _beat(self) -> None:
        while not self._stop.wait(BEAT_S):
            try:
                self.client().add(f"{self.prefix}beat/{self.me}", 1)
            except Exception as exc:  # the serving machine is gone: the watch says so
                self.gone = exc
                return

    @_bounded
    def stale(self, ids: list[str], number: int) -> list[str]:
        """Those of ``ids`` whose counter has not moved for LOST_AFTER_S (the first look at
        a machine starts its clock), but for machines through with round ``number``."""
        store, now, stale = self.client(), time.monotonic(), []
        for node in self.running(ids, number):
            count = store.add(f"{self.prefix}beat/{node}", 0)
            last = self._seen.get(node)
            if last is None or last[0] != count:
                self._seen[node] = (count, now)
            elif now - last[1] > LOST_AFTER_S:
                stale.append(node)
        return stale

    @_bounded
    def beaten_since(self, ids: list[str], since: dict[str, int], number: int) -> bool:
        """Whether each of ``ids`` still in round ``number`` beat after ``since`` (``counters``)."""
        store = self.client()
        return all(store.add(f"{self.prefix}beat/{n}", 0) > since.get(n, 0) for n in self.running(ids, number))

    @_bounded
    def running(self, ids: list[str], number: int) -> list[str]:
        """Those of ``ids`` not yet through with round ``number`` (``done``)."""
        store = self.client()
        return [n for n in ids if not store.check([f"{self.prefix}r{number}/done/{n}"])]

    @_bounded
    def counters(self, ids: list[str]) -> dict[str, int]:
        store = self.client()
        return {n: store.add(f"{self.prefix}beat/{n}", 0) for n in ids}

    # -- the end -----------------------------------------------------------------------------

    @_bounded
    def done(self, number: int) -> None:
        self.client().set(f"{self.prefix}r{number}/done/{self.me}", "1")

    def close(self, others: list[str], number: int) -> None:
        """Stop beating; the serving machine first waits (DONE_WAIT_S at most) until every
        other machine of the last round finished or was lost, so none loses the store while it
        still reads it."""
        self._stop.set()
        if self.server is not None and others:
            deadline = time.monotonic() + DONE_WAIT_S
            while time.monotonic() < deadline:
                try:
                    left = self.running(others, number)
                    if not left or set(left) <= set(self.stale(left, number)):
                        break
                except Exception:  # nothing left to wait for
                    break
                time.sleep(BEAT_S)
        self._stores = threading.local()
        self.server = None


def node_id() -> str:
    """This machine's gpufleet process among the run's: host name and pid."""
    return f"{socket.gethostname()}-{os.getpid()}"
