"""The Slurm test cluster itself (tests/slurm.py): real munged, slurmctld and one slurmd per
host of a namespace network, real srun and sbatch. What later tests rely on is checked here:
one task per host, each in its host's namespace with its host's address and folders, node
names that resolve to the hosts' addresses, tasks that reach each other across the bridge,
batch jobs that run srun, and a close that leaves nothing behind. Skipped where the cluster
cannot run (not root, no Slurm or munge installed, no namespaces).

    sudo .venv/bin/pytest tests/test_slurm_cluster.py -v
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
import time
from pathlib import Path

import pytest
from netns import Unavailable
from slurm import SlurmCluster, start_on_a_new_network

pytestmark = pytest.mark.timeout(60)

SRUN_TIMEOUT_S = 30.0

# Written by each task to report-<SLURM_PROCID>.json in its working directory (the file system
# is shared, as on a cluster): what Slurm told it and where it really runs. A file, not stdout:
# srun interleaves long lines of two tasks.
REPORT = """
import json, os, socket, sys
env = {k: v for k, v in os.environ.items() if k.startswith(("SLURM", "GPUFLEET_HOME", "HOME"))}
nodes = sys.argv[1].split(",")
with open(f"report-{env['SLURM_PROCID']}.json", "w") as out:
    json.dump({
    "env": env,
    "hostname": socket.gethostname(),
    "netns": os.readlink("/proc/self/ns/net"),
    "resolved": {name: socket.gethostbyname(name) for name in nodes},
    "python": sys.executable,
    "path0": os.environ["PATH"].split(os.pathsep)[0],
    }, out)
"""

# Task 0 listens on its node; task 1 connects to it by node name and says who it is.
PING = """
import os, socket, sys, time
port = 29517
if os.environ["SLURM_PROCID"] == "0":
    server = socket.create_server(("0.0.0.0", port))
    server.settimeout(20)
    conn, (peer, _) = server.accept()
    print(f"task 0 heard {conn.recv(100).decode()!r} from {peer}", flush=True)
else:
    deadline = time.monotonic() + 20
    while True:
        try:
            client = socket.create_connection((sys.argv[1], port), timeout=2)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    client.sendall(socket.gethostname().encode())
    client.close()
"""


@pytest.fixture(scope="module")
def cluster(slurm_cluster):
    """Two hosts, node1 (with slurmctld) and node2 (conftest.py's ``slurm_cluster``)."""
    return slurm_cluster


def write(folder: Path, name: str, source: str) -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(source))
    return path


def reports(folder: Path) -> list[dict]:
    """The tasks' reports, by SLURM_PROCID."""
    return [json.loads(path.read_text()) for path in sorted(folder.glob("report-*.json"))]


def netns_of(cluster: SlurmCluster, index: int) -> str:
    """The namespace of host ``index`` as /proc/PID/ns/net names it: net:[INODE]."""
    return f"net:[{os.stat(f'/run/netns/{cluster.hosts[index].name}').st_ino}]"


def test_srun_runs_one_task_in_each_host(cluster, tmp_path):
    script = write(tmp_path, "report.py", REPORT)
    done = cluster.srun(["-N2", "--ntasks-per-node=1", "python", script, ",".join(cluster.nodes)],
                        cwd=tmp_path, timeout=SRUN_TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    tasks = reports(tmp_path)
    assert len(tasks) == 2, done.stdout
    job_ids = {task["env"]["SLURM_JOB_ID"] for task in tasks}
    assert len(job_ids) == 1 and job_ids.pop().isdigit()
    addresses = {node: host.ip for node, host in zip(cluster.nodes, cluster.hosts)}
    for index, task in enumerate(tasks):
        env = task["env"]
        assert env["SLURM_NNODES"] == "2" and env["SLURM_NTASKS"] == "2"
        assert env["SLURM_JOB_NODELIST"] == "node[1-2]" == env["SLURM_STEP_NODELIST"]
        assert (env["SLURM_PROCID"], env["SLURM_NODEID"], env["SLURM_LOCALID"]) == (str(index), str(index), "0")
        assert env["SLURMD_NODENAME"] == task["hostname"] == f"node{index + 1}"
        assert env["SLURM_STEP_ID"] == "0"
        assert env["SLURM_LAUNCH_NODE_IPADDR"] == cluster.hosts[0].ip  # srun ran in host 1
        assert task["netns"] == netns_of(cluster, index)  # really in that host's namespace
        assert task["resolved"] == addresses  # node names are the hosts' addresses
        assert env["GPUFLEET_HOME"] == str(cluster.hosts[index].folder / "gpufleet")
        assert env["HOME"] == str(cluster.hosts[index].folder)
        assert task["path0"] == str(Path(sys.executable).parent)  # this venv's python first
    assert tasks[0]["netns"] != tasks[1]["netns"]


def test_tasks_reach_each_other_by_node_name(cluster, tmp_path):
    script = write(tmp_path, "ping.py", PING)
    done = cluster.srun(["-N2", "--ntasks-per-node=1", "python", script, cluster.nodes[0]],
                        cwd=tmp_path, timeout=SRUN_TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    # From node2's address: the bytes crossed the bridge, not a loopback.
    assert done.stdout.strip() == f"task 0 heard 'node2' from {cluster.hosts[1].ip}"


def test_sbatch_job_runs_srun_on_both_nodes(cluster, tmp_path):
    script = write(tmp_path, "report.py", REPORT)
    job_id = cluster.sbatch(f"""
        #!/bin/sh
        #SBATCH --nodes=2
        #SBATCH --ntasks-per-node=1
        echo "batch on $(hostname): step ${{SLURM_STEP_ID:-none}} of job $SLURM_JOB_ID"
        srun python {script} {",".join(cluster.nodes)}
    """, cwd=tmp_path)
    job = cluster.wait(job_id, timeout=SRUN_TIMEOUT_S)
    assert (job.state, job.exit_code) == ("COMPLETED", 0), job.output
    assert job.output.splitlines()[0] == f"batch on node1: step none of job {job_id}"
    tasks = reports(tmp_path)
    assert [t["hostname"] for t in tasks] == ["node1", "node2"], job.output
    assert {t["env"]["SLURM_JOB_ID"] for t in tasks} == {job_id}
    assert [t["env"]["SLURM_STEP_ID"] for t in tasks] == ["0", "0"]
    assert [t["netns"] for t in tasks] == [netns_of(cluster, 0), netns_of(cluster, 1)]


def test_failed_batch_job_reports_its_exit_code(cluster):
    job = cluster.wait(cluster.sbatch("#!/bin/sh\necho about to fail\nexit 3\n"),
                       timeout=SRUN_TIMEOUT_S)
    assert (job.state, job.exit_code, job.output) == ("FAILED", 3, "about to fail\n")


def test_close_ends_running_jobs_and_removes_everything():
    """A cluster of its own, closed while a batch job's step sleeps on both nodes."""
    try:
        network, cluster = start_on_a_new_network()
    except Unavailable as exc:
        pytest.skip(f"no Slurm test cluster: {exc}")
    try:
        job_id = cluster.sbatch("#!/bin/sh\n#SBATCH --nodes=2\nsrun sleep 600\n")
        sleepers = wait_for_sleepers(cluster, count=2)
        folder, etc = cluster.folder, [Path("/etc/netns") / h.name for h in cluster.hosts]
        cluster.close()
        assert cluster.leftovers() == []
        assert not folder.exists() and not any(path.exists() for path in etc)
        assert not [pid for pid in sleepers if os.path.exists(f"/proc/{pid}")], job_id
        assert not [pid for pid in cluster_pids(cluster) if b"slurm" in cmdline(pid)]
    finally:
        cluster.close()
        network.close()


def wait_for_sleepers(cluster: SlurmCluster, count: int, timeout: float = 20.0) -> list[int]:
    """The pids of ``count`` `sleep 600` tasks in the cluster's hosts, once they all run."""
    deadline = time.monotonic() + timeout
    while True:
        found = [pid for pid in cluster_pids(cluster)
                 if cmdline(pid).split(b"\x00")[:2] in ([b"sleep", b"600"], [b"/usr/bin/sleep", b"600"])]
        if len(found) >= count:
            return found
        assert time.monotonic() < deadline, f"{count} tasks not started: {cluster.logs()}"
        time.sleep(0.1)


def cluster_pids(cluster: SlurmCluster) -> list[int]:
    return [pid for host in cluster.hosts for pid in cluster.network.pids(host)]


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:  # ended meanwhile
        return b""
