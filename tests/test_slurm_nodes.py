"""gpufleet inside a real Slurm allocation (tests/slurm.py: munged, slurmctld and one slurmd per
network-namespace host): `srun gpufleet run train.py` and an sbatch script whose `srun python
script.py` makes a decorated call, both with no node flag. The node count, node rank and the
rendezvous host come from Slurm's variables. Skipped where the cluster cannot run (not root,
no Slurm or munge, no namespaces).

    sudo .venv/bin/pytest tests/test_slurm_nodes.py -v
"""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)

GPUFLEET = str(Path(sys.executable).with_name("gpufleet"))
RUN_TIMEOUT_S = 200.0

TRAIN = """
import os, socket
import torch, torch.distributed as dist
from gpufleet import runtime

runtime.setup(timeout=60)
t = torch.tensor([float(dist.get_rank())])
dist.all_reduce(t)
print(f"rank {dist.get_rank()} of {dist.get_world_size()} on {socket.gethostname()} "
      f"node {os.environ['NODE_RANK']} sum {t.item():g}", flush=True)
"""

DECORATED = """
import socket
from gpufleet import distributed, runtime


@distributed(gpus=2, tracking=False)
def where() -> str:
    import torch, torch.distributed as dist

    runtime.setup(timeout=60)
    t = torch.tensor([1.0])
    dist.all_reduce(t)
    return f"rank {runtime.get_global_rank()} of {runtime.get_world_size()} sum {t.item():g}"


if __name__ == "__main__":
    for line in where.distributed():  # no node flag: Slurm's variables say where the others are
        print(f"{socket.gethostname()}: {line}", flush=True)
"""


@pytest.mark.inner  # the inner loop's run of this launcher (tests/suite.py)
def test_srun_gpufleet_run_needs_no_node_flags(slurm_cluster, tmp_path):
    (tmp_path / "train.py").write_text(textwrap.dedent(TRAIN))
    done = slurm_cluster.srun(["-N2", "--ntasks-per-node=1", GPUFLEET, "run", "--nproc-per-node", "2",
                       "--no-tracking", "train.py"], cwd=tmp_path, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, done.stdout + done.stderr
    ranks = dict(re.findall(r"rank (\d) of 4 on (node\d) node \d sum 6", done.stdout))
    assert ranks == {"0": "node1", "1": "node1", "2": "node2", "3": "node2"}, done.stdout
    assert re.search(r"in a Slurm job step: 2 machines meeting at node1:\d+, run 'slurm-\d+\.0'",
                     done.stderr), done.stderr


def test_a_decorated_call_in_an_sbatch_script_runs_on_every_node(slurm_cluster, tmp_path):
    (tmp_path / "decorated.py").write_text(textwrap.dedent(DECORATED))
    script = f"""#!/bin/bash
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
srun {sys.executable} decorated.py
"""
    job = slurm_cluster.wait(slurm_cluster.sbatch(script, cwd=tmp_path), timeout=RUN_TIMEOUT_S)
    assert job.state == "COMPLETED", job.output
    lines = re.findall(r"(node\d): rank (\d) of 4 sum 4", job.output)
    # each machine's call returns its own ranks' values, in rank order
    assert sorted(lines) == [("node1", "0"), ("node1", "1"), ("node2", "2"), ("node2", "3")], job.output


def test_the_sbatch_example_trains_on_both_machines(slurm_cluster):
    repo = Path(__file__).resolve().parents[1]
    script = (repo / "examples" / "slurm" / "mlp_ddp.sbatch").read_text()
    # the test cluster's partition allows short jobs only: the command line's --time wins
    job = slurm_cluster.wait(slurm_cluster.sbatch(script, "--time=5", cwd=repo), timeout=RUN_TIMEOUT_S)
    assert job.state == "COMPLETED", job.output
    assert "in a Slurm job step: 2 machines meeting at node1" in job.output, job.output
