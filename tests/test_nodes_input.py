"""Node runs as a user calls them on one machine: bad node options are one clear error before
anything starts (in Python and on the command line), Slurm's variables are read only in a job
step over several machines, and a decorated call with node options on two "machines" of this
host (two processes meeting at 127.0.0.1) returns each machine's own ranks' values.

The same across real network namespaces and a real Slurm: test_nodes_network.py and
test_slurm_nodes.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from support import script_env

import gpufleet
from gpufleet.errors import ConfigError

pytestmark = pytest.mark.timeout(120)

GPUFLEET = [sys.executable, "-m", "gpufleet"]


def _fn():
    return 1


@pytest.mark.parametrize("options, says", [
    ({"nnodes": 0}, "nnodes=0 must be at least 1"),
    ({"nnodes": "3:2"}, "MIN no more than MAX"),
    ({"nnodes": "two"}, "nnodes='two' must be a number of machines"),
    ({"nnodes": 2}, "needs rdzv_endpoint"),
    ({"nnodes": 2, "rdzv_endpoint": "host:99999"}, "rdzv_endpoint='host:99999' must be HOST:PORT"),
    ({"nnodes": 2, "rdzv_endpoint": "h:1", "node_rank": 2}, "node_rank=2 but the run has at most 2 machines"),
    ({"nnodes": 2, "rdzv_endpoint": "h:1", "node_rank": -1}, "node_rank=-1 must be a whole number"),
    ({"nnodes": 2, "rdzv_endpoint": "h:1", "remote": True}, "does not combine with remote=True"),
    ({"nnodes": 2, "rdzv_endpoint": "h:1", "rdzv_id": "a b"}, "rdzv_id='a b' must be letters"),
    ({"node_rank": 1}, "node_rank=1 only applies to a run over several machines: add nnodes=2"),
])
def test_bad_node_options_are_one_error_before_anything_starts(options, says, tmp_path):
    with pytest.raises(ConfigError, match=".*".join(map(_escape, says.split("*")))):
        gpufleet.distributed(_fn, **{"runs_dir": tmp_path, **options}).distributed()
    assert not any(tmp_path.iterdir()), "a run folder was made"


def _escape(text: str) -> str:
    import re

    return re.escape(text)


def test_the_command_line_says_the_same_with_its_flags(tmp_path):
    (tmp_path / "train.py").write_text("print('hi')\n")
    done = subprocess.run([*GPUFLEET, "run", "--nnodes", "2", "--node-rank", "5", "--rdzv-endpoint",
                           "h:29400", "train.py"], cwd=tmp_path, env=script_env(tmp_path),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "--node-rank 5 but the run has at most 2 machines" in done.stderr
    done = subprocess.run([*GPUFLEET, "run", "--nnodes", "1:2", "train.py"], cwd=tmp_path,
                          env=script_env(tmp_path), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--nnodes 1:2 needs --rdzv-endpoint" in done.stderr, done.stderr


SLURM_TWO_NODES = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_NNODES": "2",
                   "SLURM_STEP_NUM_NODES": "2", "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "gpu[07-08]",
                   "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "4",
                   "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_JOB_NAME": "train"}


def test_a_slurm_step_with_two_tasks_per_machine_is_refused_with_the_fix(tmp_path, monkeypatch):
    for key, value in SLURM_TWO_NODES.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError, match="ntasks-per-node=1"):
        gpufleet.distributed(_fn, runs_dir=tmp_path).distributed()
    assert not any(tmp_path.iterdir())


def test_outside_a_job_step_slurm_is_left_alone(tmp_path, monkeypatch):
    """The batch script's own shell (no SLURM_STEP_ID) runs here, on one machine."""
    for key, value in SLURM_TWO_NODES.items():
        if key != "SLURM_STEP_ID":
            monkeypatch.setenv(key, value)
    assert gpufleet.distributed(_fn, runs_dir=tmp_path, gpus=1, tracking=False).distributed() == [1]


TWO_MACHINES = """
import sys
from gpufleet import distributed, runtime


@distributed(gpus=2, nnodes=2, rdzv_endpoint="127.0.0.1:" + sys.argv[2], tracking=False)
def where(tag):
    import torch, torch.distributed as dist

    runtime.setup(timeout=30)
    t = torch.tensor([1.0])
    dist.all_reduce(t)
    return (tag, runtime.get_global_rank(), runtime.get_node_rank(), int(t.item()))


print(where.options(node_rank=int(sys.argv[1])).distributed(f"machine {sys.argv[1]}"), flush=True)
"""


def test_a_decorated_call_on_two_machines_returns_each_machines_own_ranks(tmp_path):
    (tmp_path / "two.py").write_text(textwrap.dedent(TWO_MACHINES))
    port = str(29300 + os.getpid() % 600)
    machines = [subprocess.Popen([sys.executable, "two.py", str(rank), port], cwd=tmp_path,
                                 env=script_env(tmp_path), stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for rank in (1, 0)]
    outputs = [m.communicate(timeout=100) for m in machines]
    for machine, (out, err) in zip(machines, outputs):
        assert machine.returncode == 0, out + err
    assert outputs[1][0].strip() == "[('machine 0', 0, 0, 4), ('machine 0', 1, 0, 4)]", outputs[1]
    assert outputs[0][0].strip() == "[('machine 1', 2, 1, 4), ('machine 1', 3, 1, 4)]", outputs[0]
