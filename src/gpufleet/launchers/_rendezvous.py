"""The agent's side of a node run (``nodes.py`` is the caller's): torch elastic's c10d
rendezvous in the run's store, as torchrun runs it, with three changes.

- **Ordered nodes.** The rendezvous numbers machines by sorting their descriptors (address,
  pid); a machine given ``node_rank`` sorts by it first, so node 0 is the machine told it is.
- **One rendezvous per round.** Elastic would restart the ranks inside the agent when a
  machine waits to join; here a round ends for every machine at once (``_node_store``), and
  the next round is a new rendezvous with new agents. The agent therefore never sees a waiting
  machine.
- **The round, written down.** Once the machines have met, ``round.json`` in the attempt's
  folder says which ranks this machine holds, its group rank and the world size: what the
  caller's watcher follows.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from gpufleet.payload import write_private
from gpufleet.rundir import RunDir

LAST_CALL_S = 5  # after MIN machines met, how long more may join this round (elastic runs)
JOIN_TIMEOUT_S = 600  # torchrun's: how long machines wait for each other
STORE_TIMEOUT_S = 20  # each store operation (elastic's default, 60 s, holds a stopping agent)
UNORDERED = 1 << 30  # the sort key of a machine given no node_rank: after those given one


def config(node: dict) -> dict[str, Any]:
    """LaunchConfig's rendezvous settings for this machine (``node``: launch.json's)."""
    return dict(
        min_nodes=node["min_nodes"],
        max_nodes=node["max_nodes"],
        run_id=node["run_id"],
        rdzv_backend="c10d",
        rdzv_endpoint=node["endpoint"],
        rdzv_configs={"is_host": False, "join_timeout": JOIN_TIMEOUT_S, "last_call_timeout": LAST_CALL_S,
                      "close_timeout": 10, "read_timeout": STORE_TIMEOUT_S},
        local_addr=node["addr"],
    )


def prepare(run: RunDir, node: dict, here: list[int]) -> None:
    """Patch elastic in this (agent) process for a node run; ``here`` is filled with this
    machine's global ranks once the rendezvous has placed them."""
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dynamic

    setattr(dynamic.DynamicRendezvousHandler, "_node_desc_generator", _OrderedNodes(node.get("node_rank")))
    setattr(dynamic.DynamicRendezvousHandler, "num_nodes_waiting", lambda self: 0)
    meet = SimpleElasticAgent._rendezvous

    def rendezvous(self, worker_group) -> None:
        meet(self, worker_group)
        ranks = [w.global_rank for w in worker_group.workers]
        here[:] = ranks
        round_info = {
            "group_rank": worker_group.group_rank, "nnodes": worker_group.group_world_size,
            "world_size": worker_group.workers[0].world_size, "ranks": ranks,
            "master": f"{worker_group.master_addr}:{worker_group.master_port}",
        }
        write_private(run.path / "round.json", json.dumps(round_info).encode())

    setattr(SimpleElasticAgent, "_rendezvous", rendezvous)


class _OrderedNodes:
    """Elastic's node descriptor generator, making descriptors that sort by node rank."""

    def __init__(self, node_rank: int | None):
        import threading

        self.hint = UNORDERED if node_rank is None else node_rank
        self._lock = threading.Lock()
        self._next = 0

    def generate(self, local_addr: str | None = None):
        import os
        import socket

        with self._lock:
            local_id, self._next = self._next, self._next + 1
        return ordered_node(local_addr or socket.getfqdn(), os.getpid(), local_id, self.hint)


def ordered_node(addr: str, pid: int, local_id: int, hint: int):
    return _node_class()(addr, pid, local_id, hint)


_CLASS: list = []


def _node_class():
    """A subclass of elastic's ``_NodeDesc`` that sorts by ``hint`` first. It is defined in
    this module (importable on every machine: the rendezvous state travels pickled)."""
    if _CLASS:
        return _CLASS[0]
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc

    @dataclasses.dataclass(eq=True, frozen=True, repr=False)
    class OrderedNode(_NodeDesc):
        hint: int = UNORDERED

        def _key(self):
            return (self.hint, self.addr, self.pid, self.local_id)

        def __lt__(self, other):
            return self._key() < other._key()

        def __le__(self, other):
            return self._key() <= other._key()

        def __gt__(self, other):
            return self._key() > other._key()

        def __ge__(self, other):
            return self._key() >= other._key()

    OrderedNode.__module__, OrderedNode.__qualname__ = __name__, "OrderedNode"
    globals()["OrderedNode"] = OrderedNode
    _CLASS.append(OrderedNode)
    return OrderedNode


def __getattr__(name: str):
    """``OrderedNode`` for unpickling in a process that has not made it yet."""
    if name == "OrderedNode":
        return _node_class()
    raise AttributeError(name)
