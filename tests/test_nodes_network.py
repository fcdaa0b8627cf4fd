"""Node runs across a real network: two "machines" (network namespaces with their own addresses
on a bridge, tests/netns.py), each running `gpufleet run --nnodes ... --rdzv-endpoint HOST1:PORT`
as a user would type it on each machine, torchrun-style. No byte between them can take the
loopback interface: each namespace has its own.

    sudo .venv/bin/pytest tests/test_nodes_network.py -v

Skipped where namespaces cannot be made (not root, no `ip`).
"""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from netns import Host, Network, Unavailable
from support import describe, is_template


GPUFLEET = str(Path(sys.executable).with_name("gpufleet"))
RUN_TIMEOUT_S = 180
FAIL_TOGETHER_S = 10.0  # a rank's failure on one machine to the other machine's exit (~2 s measured)
LOST_BOUND_S = 20.0  # a killed machine to the other's exit: LOST_AFTER_S (6 s) + the stop
_ports = itertools.count(29400 + os.getpid() % 500)

TRAIN = """
import os, sys, time
import torch, torch.distributed as dist
from gpufleet import runtime

runtime.setup(timeout=60)
rank, world = dist.get_rank(), dist.get_world_size()
shown = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
         "GROUP_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")}
print("vars", " ".join(f"{k}={v}" for k, v in shown.items()), flush=True)
steps = int(os.environ.get("STEPS", "1"))
for step in range(1, steps + 1):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    print(f"step {step} sum {t.item():g}", flush=True)
    if os.environ.get("FAIL_RANK") == str(rank) and step == int(os.environ.get("FAIL_STEP", "1")):
        raise ValueError(f"bad batch at step {step}")
    if os.environ.get("HANG_RANK") == str(rank) and step == int(os.environ.get("HANG_STEP", "5")):
        time.sleep(3600)
    time.sleep(float(os.environ.get("PAUSE", "0")))
"""

ELASTIC = """
import os, sys, time
import torch, torch.distributed as dist
from gpufleet import runtime
from gpufleet.checkpoint import Checkpointer

ckpt_root, out = sys.argv[1], sys.argv[2]
STEPS, GLOBAL_BATCH = int(os.environ["STEPS"]), 8
runtime.setup(timeout=60)
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
ddp = torch.nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
with Checkpointer(ckpt_root, async_save=False, keep=2) as ckpt:
    start = ckpt.restore(model, opt)
    print(f"resumed at {start} with {world} ranks", flush=True)
    for step in range(start, STEPS):
        x = torch.randn(GLOBAL_BATCH, 4, generator=torch.Generator().manual_seed(step))
        y = x.sum(1, keepdim=True)
        loss = torch.nn.functional.mse_loss(ddp(x[rank::world]), y[rank::world])  # same global batch
        opt.zero_grad()
        loss.backward()
        opt.step()
        ckpt.save(step + 1, model, opt)
        print(f"step {step + 1} world {world}", flush=True)
        # slow while alone: the run must still be going when the lost machine is back, however
        # long a loaded machine takes to start gpufleet again
        time.sleep(float(os.environ.get("PAUSE", "0")) * (1 if world == 4 else 4))
if rank == 0:
    torch.save(model.state_dict(), out)
"""


@pytest.fixture(scope="module")
def network():
    try:
        network = Network.create(2)
    except Unavailable as exc:
        pytest.skip(f"no network namespaces: {exc}")
    try:
        yield network
    finally:
        network.close()
        assert not network.leftovers(), f"left on the machine: {network.leftovers()}"


@dataclass
class Node:
    """`gpufleet run` on one machine; its output in a file."""

    host: Host
    popen: subprocess.Popen
    out: Path
    started: float

    def text(self) -> str:
        return self.out.read_text(errors="replace")

    def wait(self, timeout: float = RUN_TIMEOUT_S) -> int:
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"gpufleet on {self.host.name} still runs after {timeout:g} s:\n{self.text()}")

    def wait_for(self, pattern: str, timeout: float = RUN_TIMEOUT_S) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if re.search(pattern, self.text()):
                return time.monotonic()
            if self.popen.poll() is not None:
                pytest.fail(f"gpufleet on {self.host.name} ended before {pattern!r}:\n{self.text()}")
            time.sleep(0.1)
        pytest.fail(f"no {pattern!r} on {self.host.name} in {timeout:g} s:\n{self.text()}")


@pytest.fixture
def nodes(network, tmp_path):
    """start(host, node_rank, script, *args, nnodes="2", **env) -> Node: gpufleet run on that
    machine, meeting the others at host 1's address."""
    port = next(_ports)
    started: list[Node] = []
    (tmp_path / "train.py").write_text(textwrap.dedent(TRAIN))
    (tmp_path / "elastic.py").write_text(textwrap.dedent(ELASTIC))

    def start(host: Host, node_rank: int, script: str = "train.py", *args, nnodes: str = "2",
              hang: str = "60", **env: str) -> Node:
        out = tmp_path / f"{host.name}-{len(started)}.out"
        argv = [GPUFLEET, "run", "--nnodes", nnodes, "--node-rank", str(node_rank), "--rdzv-endpoint",
                f"{network.hosts[0].ip}:{port}", "--nproc-per-node", "2", "--hang-timeout", hang,
                "--no-tracking", script, *map(str, args)]
        with open(out, "wb") as stdout:
            popen = network.popen(host, argv, env=network.env(host, **env), cwd=tmp_path,
                                  stdout=stdout, stderr=subprocess.STDOUT)
        started.append(Node(host, popen, out, time.monotonic()))
        return started[-1]

    yield start
    for node in started:
        if node.popen.poll() is None:
            node.popen.kill()
            node.popen.wait()


def _left(network: Network, host: Host, grace: float = 5.0) -> list[str]:
    """The processes of ``host`` still running after ``grace`` seconds, but for its kept
    template (which outlives runs by design, docs/design.md)."""
    deadline = time.monotonic() + grace
    while True:
        left = []
        for pid in network.pids(host):
            try:
                process = psutil.Process(pid)
                if not is_template(process):
                    left.append(describe(process))
            except psutil.Error:  # ended meanwhile
                continue
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def _vars(text: str) -> list[dict[str, str]]:
    lines = [line.split("vars ", 1)[1] for line in text.splitlines() if "vars " in line]
    return [dict(pair.split("=", 1) for pair in line.split()) for line in lines]


@pytest.mark.inner  # the inner loop's run of this launcher (tests/suite.py)
def test_two_machines_of_two_ranks_run_as_one_world_with_torchruns_variables(network, nodes):
    h1, h2 = network.hosts
    first, second = nodes(h1, 0), nodes(h2, 1)
    assert first.wait() == 0, first.text()
    assert second.wait() == 0, second.text()
    ranks = {}
    for node, host in ((first, h1), (second, h2)):
        for seen in _vars(node.text()):
            ranks[int(seen["RANK"])] = (host, seen)
        assert "step 1 sum 6" in node.text(), node.text()  # 0+1+2+3, across both machines
    assert sorted(ranks) == [0, 1, 2, 3]
    for rank, (host, seen) in ranks.items():
        assert seen["WORLD_SIZE"] == "4" and seen["LOCAL_WORLD_SIZE"] == "2"
        assert seen["GROUP_RANK"] == seen["NODE_RANK"] == str(rank // 2)  # --node-rank orders them
        assert host is (h1 if rank < 2 else h2)
        assert seen["MASTER_ADDR"] == h1.ip  # node 0's address on the network, not loopback
        assert seen["TORCHELASTIC_RUN_ID"].startswith("train.r")
    assert "ranks 2-3 of 4" in second.text()


def test_a_rank_that_fails_on_one_machine_stops_the_other_which_names_it(network, nodes):
    h1, h2 = network.hosts
    first = nodes(h1, 0, STEPS="200", PAUSE="0.05")
    # rank 2 sleeps at that step: its machine's teardown stops it (SIGTERM) before it sees the failure
    second = nodes(h2, 1, STEPS="200", PAUSE="0.05", FAIL_RANK="3", FAIL_STEP="20", HANG_RANK="2", HANG_STEP="20")
    assert second.wait() == 1
    failed_at = time.monotonic()
    assert first.wait() == 1, first.text()
    took = time.monotonic() - failed_at
    print(f"rank failure on machine 2 -> machine 1 ended in {took:.1f} s")
    assert took < FAIL_TOGETHER_S, first.text()
    # machine 1's error: the root cause is rank 3 on node 1, with its traceback; its own ranks were stopped
    root = first.text().split("root cause: ", 1)[1]
    assert root.startswith(f"rank 3: ValueError: bad batch at step 20 (node 1 ({h2.ip}))"), first.text()
    assert 'raise ValueError(f"bad batch at step {step}")' in root
    # its own ranks: stopped, or failed with the echo of it (gloo's "connection closed by peer")
    assert "gpufleet: 1 of 4 ranks failed" in first.text(), first.text()
    assert f"root cause: rank 3: ValueError: bad batch at step 20 (node 1 ({h2.ip}), pid" in second.text()
    assert not _left(network, h1), "processes left on machine 1"


def test_a_machine_that_dies_stops_the_other_which_says_it_was_lost(network, nodes):
    first, _ = _lose_machine_2(network, nodes, network.kill, "killed")  # the machine died
    assert not _left(network, network.hosts[0]), "processes left on machine 1"


def test_a_machine_cut_off_the_network_is_named_lost_and_both_stop(network, nodes):
    """No connection error here (the cable is out): beats alone tell."""
    try:
        _, second = _lose_machine_2(network, nodes, network.link_down, "cut off")
        assert second.wait(60) == 1, second.text()  # it cannot reach the run's store: it stops too
        assert "cannot be reached" in second.text() or "lost" in second.text(), second.text()
    finally:
        network.link_up(network.hosts[1])


def _lose_machine_2(network, nodes, fault, what: str) -> tuple[Node, Node]:
    """Machine 2 is lost (``fault`` on its host) while both train: machine 1 ends within
    LOST_BOUND_S, naming machine 2's first rank as lost."""
    h1, h2 = network.hosts
    first, second = nodes(h1, 0, STEPS="1000", PAUSE="0.05"), nodes(h2, 1, STEPS="1000", PAUSE="0.05")
    second.wait_for(r"step 10 ")
    fault(h2)
    since = time.monotonic()
    assert first.wait() == 1, first.text()
    took = time.monotonic() - since
    print(f"machine 2 {what} -> machine 1 ended in {took:.1f} s")
    assert took < LOST_BOUND_S, first.text()
    root = first.text().split("root cause: ", 1)[1].splitlines()[0]
    assert root.startswith("rank 2: lost: no heartbeat") and f"(node 1 ({h2.ip}))" in root, first.text()
    return first, second


@pytest.mark.timeout(480)
def test_an_elastic_run_goes_from_two_machines_to_one_and_back_and_ends_as_an_uninterrupted_run(
        network, nodes, tmp_path):
    h1, h2 = network.hosts
    env = {"STEPS": "60", "PAUSE": "0.4"}  # up to 90 s alone: time for the machine to come back
    ckpt, out = tmp_path / "ckpt", tmp_path / "elastic.pt"
    first = nodes(h1, 0, "elastic.py", ckpt, out, nnodes="1:2", **env)
    second = nodes(h2, 1, "elastic.py", ckpt, out, nnodes="1:2", **env)
    second.wait_for(r"step \d+ world 4")
    network.kill(h2)
    first.wait_for(r"resumed at \d+ with 2 ranks", timeout=60)  # alone: 2 ranks, resharded
    first.wait_for(r"step \d+ world 2")
    again = nodes(h2, 1, "elastic.py", ckpt, out, nnodes="1:2", **env)  # the machine is back
    assert first.wait() == 0, first.text()
    assert again.wait() == 0, again.text()
    text = first.text()
    worlds = [int(w) for w in re.findall(r"resumed at \d+ with (\d) ranks", text)]
    assert worlds[0] in (2, 4) and 2 in worlds and worlds[-1] == 4, text
    assert "the run's machines changed" in text
    assert re.findall(r"step (\d+) world", text)[-1] == "60"
    # the same steps on one machine, never interrupted: the same weights
    alone = subprocess.run([GPUFLEET, "run", "--nproc-per-node", "2", "--no-tracking", "elastic.py",
                            tmp_path / "ckpt-alone", tmp_path / "alone.pt"], cwd=tmp_path,
                           env={**os.environ, "STEPS": "60"}, capture_output=True, text=True,
                           timeout=RUN_TIMEOUT_S)
    assert alone.returncode == 0, alone.stdout + alone.stderr
    import torch

    resized, steady = torch.load(out), torch.load(tmp_path / "alone.pt")
    for name in steady:
        torch.testing.assert_close(resized[name], steady[name], rtol=1e-5, atol=1e-6)


def test_a_hang_names_the_culprit_rank_and_its_machine_on_every_machine(network, nodes):
    h1, h2 = network.hosts
    # rank 3 stops in its own code at step 5 while ranks 0-2 wait for it in all_reduce
    first = nodes(h1, 0, STEPS="100", PAUSE="0.05", HANG_RANK="3", hang="10s")
    second = nodes(h2, 1, STEPS="100", PAUSE="0.05", HANG_RANK="3", hang="10s")
    assert first.wait() == 1 and second.wait() == 1
    for node in (first, second):
        root = node.text().split("root cause: ", 1)[1].splitlines()[0]
        assert root.startswith("rank 3: hang: not in a collective: at train.py:"), node.text()
        assert f"(node 1 ({h2.ip}))" in root, node.text()
