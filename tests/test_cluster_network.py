"""remote=True across a real network: two "hosts" (network namespaces with their own addresses
on a bridge, tests/netns.py), a Ray head in host 1 and a Ray worker node in host 2, 2 CPUs each,
so that a 4-rank gloo call lands as 2 nodes x 2 ranks. No byte between the hosts can take the
loopback interface: each namespace has its own.

The caller is what a user runs: a script in host 1 (a driver inside the cluster's network,
docs/cluster.md section 2) that calls a `@gpufleet.distributed(remote=True)` function. The
test process itself only builds the network, starts and kills hosts, and reads what the
script printed. One cluster serves the module; host 2's Ray node is started again after a
test killed it (by that test, or before the next script). Skipped where namespaces cannot be
made (not root, no `ip`).

    sudo .venv/bin/pytest tests/test_cluster_network.py -v
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from netns import Host, Network, Unavailable
from support import LEFTOVER_GRACE_S, rank_lines


PORT = 6379
LOST_BOUND_S = 30.0  # from the kill to the error in the caller; measured 7-8 s on 2 loaded cores
# Generous bounds: a run here starts 4 ranks, 4 Ray workers and their runtime_env on 2 cores
# (15-40 s when other work shares them); only LOST_BOUND_S is a promise under test.
CALL_TIMEOUT_S = 240
RANK_ENTRY = "gpufleet.launchers._ray_node"  # the command line of a rank's process on a node


@dataclass
class Cluster:
    network: Network
    address: str  # the head's GCS address: HOST1_IP:PORT

    @property
    def head(self) -> Host:
        return self.network.hosts[0]

    @property
    def worker(self) -> Host:
        return self.network.hosts[1]

    def restart_worker(self) -> None:
        """Host 2 comes back: whatever is left of it is killed, its Ray node started again."""
        self.network.kill(self.worker)
        self.network.start_ray(self.worker, port=PORT, head=self.head)

    def worker_down(self) -> bool:
        return not self.network.pids(self.worker)

    def rank_processes(self, host: Host, grace: float = 0.0) -> list[str]:
        """The gpufleet rank processes and rank actors still running in ``host`` after up
        to ``grace`` seconds."""
        deadline = time.monotonic() + grace
        while True:
            found = []
            for pid in self.network.pids(host):
                try:
                    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
                except OSError:  # ended meanwhile
                    continue
                if RANK_ENTRY.encode() in cmdline or b"RankNode" in cmdline:
                    found.append(f"pid {pid}: {cmdline[:160].decode(errors='replace')}")
            if not found or time.monotonic() >= deadline:
                return found
            time.sleep(0.2)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Host 1 with the head, host 2 with a worker node. Each host's Ray logs are kept in the
    session's temporary folder (ray-logs*/), for a failure's post-mortem."""
    try:
        network = Network.create(2)
    except Unavailable as exc:
        pytest.skip(f"no network namespaces: {exc}")
    try:
        head, worker = network.hosts
        address = network.start_ray(head, port=PORT, dashboard=True)  # Ray Jobs, for the laptop
        network.start_ray(worker, port=PORT, head=head)
        yield Cluster(network, address)
    finally:
        network.close(keep_logs=tmp_path_factory.mktemp("ray-logs"))
        assert not network.leftovers(), f"left on the machine: {network.leftovers()}"


@dataclass
class Driver:
    """The user's script, running in host 1; its output in files."""

    popen: subprocess.Popen
    out: Path
    err: Path
    result: Path

    def stdout(self) -> str:
        return self.out.read_text(errors="replace")

    def stderr(self) -> str:
        return self.err.read_text(errors="replace")

    def explain(self) -> str:
        return (f"exit {self.popen.poll()}\n--- stdout:\n{self.stdout()}\n"
                f"--- stderr:\n{self.stderr()}")

    def wait_for(self, predicate, timeout: float, what: str) -> float:
        """Poll the script's output until ``predicate(stdout, stderr)``; the time.time() then."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate(self.stdout(), self.stderr()):
                return time.time()
            if self.popen.poll() is not None:
                pytest.fail(f"the script ended before {what}\n{self.explain()}")
            time.sleep(0.05)
        pytest.fail(f"no {what} within {timeout:g} s\n{self.explain()}")

    def wait(self, timeout: float) -> dict:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the script still runs after {timeout:g} s\n{self.explain()}")
        assert self.result.exists(), self.explain()
        return json.loads(self.result.read_text())

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait()


@pytest.fixture
def run_driver(cluster, tmp_path):
    """run_driver(source, *args) -> Driver: a script in host 1, with the cluster's address,
    a runs folder, a result file and the call's timeout as its first arguments. Host 2 is
    started again first if a test before this one left it dead."""
    if cluster.worker_down():
        cluster.restart_worker()
    started: list[Driver] = []
    work = tmp_path / "cwd"  # what the call ships as its working directory: a small folder
    work.mkdir()

    def start(source: str, *args) -> Driver:
        script = tmp_path / f"driver_{len(started)}.py"
        script.write_text(textwrap.dedent(source))
        result = tmp_path / f"result_{len(started)}.json"
        out, err = tmp_path / f"driver_{len(started)}.out", tmp_path / f"driver_{len(started)}.err"
        with open(out, "wb") as stdout, open(err, "wb") as stderr:
            popen = cluster.network.popen(
                cluster.head, [sys.executable, script, cluster.address, tmp_path / "runs", result,
                               CALL_TIMEOUT_S, *args], cwd=work, stdout=stdout, stderr=stderr)
        started.append(Driver(popen, out, err, result))
        return started[-1]

    yield start
    for driver in started:
        driver.kill()


# ---------------------------------------------------------------------------- 2 nodes x 2 ranks


WHERE = """
import json
import sys

from gpufleet import distributed, runtime

address, runs, result, timeout = sys.argv[1:5]


def where():
    import os
    import subprocess

    import psutil
    import torch.distributed as dist

    runtime.setup(timeout=60)
    shown = subprocess.run(["ip", "-4", "-o", "addr", "show", "scope", "global"],
                           capture_output=True, text=True, check=True).stdout
    mine = {
        "rank": runtime.get_global_rank(),
        "addresses": [line.split()[3].split("/")[0] for line in shown.splitlines()],
        "netns": os.readlink("/proc/self/ns/net"),
    }
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)  # gloo, across both hosts
    tcp = [c for c in psutil.Process().net_connections("tcp") if c.status == "ESTABLISHED"]
    v4 = lambda ip: ip.removeprefix("::ffff:")  # gloo's IPv6 sockets carry IPv4 mapped
    return {
        **mine,
        "everyone": everyone,
        "env": {k: os.environ.get(k) for k in ("MASTER_ADDR", "GLOO_SOCKET_IFNAME", "NODE_RANK")},
        "tcp_local": sorted({v4(c.laddr.ip) for c in tcp}),
        "tcp_remote": sorted({v4(c.raddr.ip) for c in tcp}),
    }


fn = distributed(gpus=4, remote=True, ray_address=address, runs_dir=runs, timeout=float(timeout),
                 tracking=False)(where)
with open(result, "w") as f:
    json.dump(fn.distributed(), f)
"""


@pytest.mark.timeout(360)  # with the cluster's start
def test_two_hosts_two_ranks_each_talk_over_their_own_addresses(cluster, run_driver):
    head, worker = cluster.head, cluster.worker
    netns = {h.ip: cluster.network.run(h, ["readlink", "/proc/self/ns/net"]).stdout.strip()
             for h in (head, worker)}
    driver = run_driver(WHERE)
    results = driver.wait(CALL_TIMEOUT_S + 30)

    host_of = [head, head, worker, worker]  # ranks are ordered by node address, then GPU
    assert [r["rank"] for r in results] == [0, 1, 2, 3], "every rank's value, in rank order"
    for rank, (result, host) in enumerate(zip(results, host_of)):
        assert result["addresses"] == [host.ip], f"rank {rank} runs on {host.name}"
        assert result["netns"] == netns[host.ip], f"rank {rank} runs in {host.name}'s namespace"
        assert result["env"]["MASTER_ADDR"] == head.ip, f"rank {rank}: rank 0's host, not loopback"
        assert result["env"]["GLOO_SOCKET_IFNAME"] == host.interface, (
            f"rank {rank}: gloo on {host.name}'s own interface: {result['env']}")
        # each host's ranks see the other host's, through one gloo all_gather
        assert [e["addresses"] for e in result["everyone"]] == [[h.ip] for h in host_of]
        # its connections (gloo's and the rendezvous store's) run on its host's address, and
        # reach the other host's
        other = worker if host is head else head
        assert result["tcp_local"] == [host.ip], f"rank {rank}: {result}"
        assert other.ip in result["tcp_remote"], f"rank {rank}: {result}"
    layout = (f"4 ranks on 2 nodes of the Ray cluster at {cluster.address}: "
              f"node 0 {head.ip}: ranks 0-1; node 1 {worker.ip}: ranks 2-3")
    assert layout in driver.stderr(), driver.explain()


# ---------------------------------------------------------------------------- a host lost


TRAIN = """
import json
import sys
import time
import traceback

from gpufleet import RunFailedError, distributed, runtime

address, runs, result, timeout, root, retries = sys.argv[1:7]
STEPS, STEP_S = 12, 0.2


def train(root):
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from gpufleet.checkpoint import Checkpointer

    runtime.setup(timeout=60)
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    checkpoints = Checkpointer(root, keep=2, async_save=False)
    start = checkpoints.restore(model, optimizer)
    print(f"attempt {runtime.get_attempt()} starts at step {start}", flush=True)
    for step in range(start, STEPS):
        batch = torch.full((4, 8), float(step + runtime.get_global_rank()))
        loss = model(batch).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        checkpoints.save(step + 1, model, optimizer)  # committed when it returns
        print(f"step {step + 1} saved", flush=True)
        time.sleep(STEP_S)
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    return {"rank": runtime.get_global_rank(), "attempt": runtime.get_attempt(),
            "resumed_at": start, "weights": weights.tolist()}


fn = distributed(gpus=4, remote=True, ray_address=address, runs_dir=runs, timeout=float(timeout),
                 tracking=False, max_retries=int(retries), placement_timeout=120)(train)
try:
    outcome = {"results": fn.distributed(root)}
except RunFailedError as error:
    outcome = {
        "error": type(error).__name__, "text": str(error), "raised_at": time.time(),
        "failures": [{"rank": f.rank, "kind": f.kind, "summary": f.summary, "host": f.host,
                      "collateral": f.collateral} for f in error.failures],
    }
with open(result, "w") as f:
    json.dump(outcome, f)
"""


def hostname() -> str:
    """The namespaces share the machine's host name: the address tells the hosts apart."""
    return socket.gethostname()


def saved(step: int, ranks=range(4)):
    """A predicate on the script's output: every rank printed that it saved ``step``."""
    return lambda out, err: all(f"step {step} saved" in rank_lines(out, r) for r in ranks)


@pytest.mark.timeout(CALL_TIMEOUT_S + 60)
def test_with_a_retry_the_run_waits_for_the_host_and_resumes_from_its_checkpoint(
        cluster, run_driver, tmp_path):
    """max_retries=1: host 2 dies mid-run and its Ray node starts again a few seconds later.

    What the retry waits for: the call's placement group, 4 bundles of 1 CPU. Ray can place
    only 2 of them while host 2 is down (host 1 has 2 CPUs), so the retry waits, saying so
    ("waiting for 4 CPUs"), until a node with the capacity joins the cluster, up to
    placement_timeout (120 s here; the call's timeout bounds it too). Then every rank starts
    again and restores the last step committed before the kill."""
    head, worker = cluster.head, cluster.worker
    driver = run_driver(TRAIN, tmp_path / "checkpoints", 1)
    try:
        driver.wait_for(saved(3), CALL_TIMEOUT_S / 2, "step 3 saved on every rank")
        killed_at = time.time()
        cluster.network.kill(worker)
        detected = driver.wait_for(lambda out, err: "attempt 1 of 2 failed" in err,
                                   LOST_BOUND_S, "the first attempt's failure") - killed_at
        print(f"lost host reported {detected:.1f} s after the kill (attempt 1 of 2)")
        driver.wait_for(lambda out, err: "waiting for 4 CPUs in the Ray cluster" in err, 30,
                        "the retry waiting for room")
        assert cluster.rank_processes(head, grace=LEFTOVER_GRACE_S) == [], (
            "the first attempt's ranks left on host 1")
        time.sleep(3)  # host 2 stays down a little while
    finally:
        cluster.restart_worker()
    outcome = driver.wait(CALL_TIMEOUT_S)

    assert "results" in outcome, outcome.get("text", driver.explain())
    results = outcome["results"]
    # the first attempt's root cause, as printed: a rank of host 2, lost, with its address
    failed = re.search(r"attempt 1 of 2 failed \((.*)\); starting", driver.stderr()).group(1)
    assert re.match(r"ranks? (2|3|2, 3): lost", failed), failed
    assert failed.endswith(f"(node 1: {hostname()} {worker.ip})"), failed
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    assert {r["attempt"] for r in results} == {1}
    resumed = {r["resumed_at"] for r in results}
    assert len(resumed) == 1 and resumed.pop() >= 3, f"resumed at {results[0]['resumed_at']}"
    assert all(r["weights"] == results[0]["weights"] for r in results), "one model on every rank"
    start = results[0]["resumed_at"]
    for rank in range(4):
        assert f"attempt 1 starts at step {start}" in rank_lines(driver.stdout(), rank)


@pytest.mark.timeout(CALL_TIMEOUT_S + 60)
def test_a_lost_host_is_named_with_its_ranks_and_nothing_is_left_on_the_other(
        cluster, run_driver, tmp_path):
    """Every process of host 2 is killed mid-run (a machine that died: its Ray node, its
    actors, its ranks). The call fails within LOST_BOUND_S with ranks 2 and 3 lost, named
    with host 2's address, and no rank of the run is left on host 1."""
    head, worker = cluster.head, cluster.worker
    driver = run_driver(TRAIN, tmp_path / "checkpoints", 0)
    driver.wait_for(saved(3), CALL_TIMEOUT_S / 2, "step 3 saved on every rank")
    killed_at = time.time()
    cluster.network.kill(worker)  # the next test's run_driver starts it again
    outcome = driver.wait(LOST_BOUND_S + 15)
    detected = outcome.get("raised_at", float("inf")) - killed_at
    print(f"lost host reported {detected:.1f} s after the kill")

    assert outcome.get("error") == "RunFailedError", driver.explain()
    assert detected <= LOST_BOUND_S, f"reported {detected:.1f} s after the kill\n{outcome['text']}"
    lost = [f for f in outcome["failures"] if f["kind"] == "lost"]
    assert sorted(f["rank"] for f in lost) == [2, 3], outcome["text"]
    assert all(worker.ip in f["host"] for f in lost), outcome["text"]
    root = outcome["failures"][0]
    assert root["kind"] == "lost" and root["rank"] in (2, 3), outcome["text"]
    for failure in outcome["failures"]:
        if failure["rank"] in (0, 1):  # the survivors' gloo errors: the echo, not the cause
            assert failure["collateral"] and head.ip in failure["host"], outcome["text"]
    where = re.escape(f"(node 1: {hostname()} {worker.ip})")
    for rank in (2, 3):  # what the user reads: each lost rank, with host 2's address
        assert re.search(rf"(root cause|also): (rank {rank}|ranks 2, 3): lost.*{where}",
                         outcome["text"]), outcome["text"]
    assert cluster.rank_processes(head, grace=LEFTOVER_GRACE_S) == [], "ranks left on host 1"


# ---------------------------------------------------------------------------- from a laptop


LAPTOP = """
import sys
from gpufleet import distributed, runtime

def where():
    import subprocess
    runtime.setup(timeout=60)
    shown = subprocess.run(["ip", "-4", "-o", "addr", "show", "scope", "global"],
                           capture_output=True, text=True, check=True).stdout
    return [line.split()[3].split("/")[0] for line in shown.splitlines()]

fn = distributed(gpus=4, remote=True, ray_address=sys.argv[1], detach=True, timeout=240)(where)
print(fn.submit().id)
"""

LATER = """
import sys, gpufleet
run = gpufleet.attach(sys.argv[2], ray_address=sys.argv[1])
print(run.result(timeout=240))
"""


@pytest.mark.timeout(360)
def test_a_laptop_outside_the_cluster_submits_through_ray_jobs_and_leaves(cluster, tmp_path):
    """The root namespace stands for a laptop: it reaches the head's dashboard over the bridge,
    and no Ray port of any node. The submitting process exits at once; another process (with a
    runs folder of its own: another machine) attaches later and gets every rank's value."""
    if cluster.worker_down():  # a test before this one killed host 2
        cluster.restart_worker()
    jobs = f"http://{cluster.head.ip}:8265"
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")}
    (tmp_path / "cwd").mkdir()
    for name, source in (("submit.py", LAPTOP), ("later.py", LATER)):
        (tmp_path / name).write_text(source)
    submitted = subprocess.run(
        [sys.executable, tmp_path / "submit.py", jobs], cwd=tmp_path / "cwd", capture_output=True,
        text=True, timeout=120, env={**env, "GPUFLEET_HOME": str(tmp_path / "laptop")})
    assert submitted.returncode == 0, submitted.stderr
    run_id = submitted.stdout.split()[-1]
    later = subprocess.run(
        [sys.executable, tmp_path / "later.py", jobs, run_id], cwd=tmp_path / "cwd",
        capture_output=True, text=True, timeout=300, env={**env, "GPUFLEET_HOME": str(tmp_path / "desk")})
    assert later.returncode == 0, later.stderr + every_ranks_log(later.stderr)
    head, worker = cluster.head.ip, cluster.worker.ip
    assert later.stdout.strip() == str([[head], [head], [worker], [worker]])


def every_ranks_log(error: str) -> str:
    """For a failed run's post-mortem: the end of each rank's log in the run folder the error
    names (the error itself shows the failing rank's only)."""
    found = re.search(r"\(run folder (\S+)\)", error)
    logs = sorted(Path(found[1]).glob("logs/*.log")) if found else []
    return "".join(f"\n--- {log.name}:\n" + "\n".join(log.read_text(errors="replace").splitlines()[-15:])
                   for log in logs)
