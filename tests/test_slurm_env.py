"""Reading a Slurm job step from the environment (gpufleet.launchers._slurm), with the
variables exactly as Slurm 22.05 set them on the test cluster of tests/slurm.py (SLURM_CONF
and the TaskProlog's SLURM_SCRIPT_CONTEXT left out; job ids changed where a case needs more
digits), so no Slurm is needed here."""

from __future__ import annotations

import pytest

from gpufleet.errors import ConfigError
from gpufleet.launchers._slurm import SlurmNodes, expand_nodelist, from_environment, tasks_per_node

# `srun -N2 --ntasks-per-node=1 CMD` from the login node: the task on node2.
SRUN_TASK_1 = {
    "SLURMD_NODENAME": "node2", "SLURM_CLUSTER_NAME": "gf82c050", "SLURM_CPUS_ON_NODE": "1",
    "SLURM_GTIDS": "1", "SLURM_JOBID": "1", "SLURM_JOB_CPUS_PER_NODE": "1(x2)", "SLURM_JOB_GID": "0",
    "SLURM_JOB_ID": "1", "SLURM_JOB_NAME": "sh", "SLURM_JOB_NODELIST": "node[1-2]",
    "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_PARTITION": "test", "SLURM_JOB_UID": "0",
    "SLURM_JOB_USER": "root", "SLURM_LAUNCH_NODE_IPADDR": "10.213.176.2", "SLURM_LOCALID": "0",
    "SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_NODELIST": "node[1-2]", "SLURM_NPROCS": "2",
    "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "1", "SLURM_PRIO_PROCESS": "0", "SLURM_PROCID": "1",
    "SLURM_SRUN_COMM_HOST": "10.213.176.2", "SLURM_SRUN_COMM_PORT": "36735", "SLURM_STEPID": "0",
    "SLURM_STEP_ID": "0", "SLURM_STEP_LAUNCHER_PORT": "36735", "SLURM_STEP_NODELIST": "node[1-2]",
    "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
    "SLURM_SUBMIT_DIR": "/tmp/gfproto", "SLURM_SUBMIT_HOST": "node1", "SLURM_TASKS_PER_NODE": "1(x2)",
    "SLURM_TASK_PID": "7383", "SLURM_TOPOLOGY_ADDR": "node2", "SLURM_TOPOLOGY_ADDR_PATTERN": "node",
    "SLURM_UMASK": "0022", "SLURM_WORKING_CLUSTER": "gf82c050:10.213.176.2:6817:9728:109",
}
SRUN_TASK_0 = {**SRUN_TASK_1, "SLURMD_NODENAME": "node1", "SLURM_GTIDS": "0", "SLURM_NODEID": "0",
               "SLURM_PROCID": "0", "SLURM_TASK_PID": "7381", "SLURM_TOPOLOGY_ADDR": "node1"}

# A batch script with `#SBATCH --nodes=2`: its own shell on node1 (no step) ...
BATCH_SHELL = {
    "SLURMD_NODENAME": "node1", "SLURM_CLUSTER_NAME": "gf82c050", "SLURM_CPUS_ON_NODE": "1",
    "SLURM_GTIDS": "0", "SLURM_JOBID": "2", "SLURM_JOB_CPUS_PER_NODE": "1(x2)", "SLURM_JOB_GID": "0",
    "SLURM_JOB_ID": "2", "SLURM_JOB_NAME": "job-6sfpmutr.sh", "SLURM_JOB_NODELIST": "node[1-2]",
    "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_PARTITION": "test", "SLURM_JOB_UID": "0",
    "SLURM_JOB_USER": "root", "SLURM_LOCALID": "0", "SLURM_NNODES": "2", "SLURM_NODEID": "0",
    "SLURM_NODELIST": "node[1-2]", "SLURM_NODE_ALIASES": "(null)", "SLURM_PRIO_PROCESS": "0",
    "SLURM_PROCID": "0", "SLURM_SUBMIT_DIR": "/tmp/gfslurm-nhxrjaqs/jobs", "SLURM_SUBMIT_HOST": "node1",
    "SLURM_TASKS_PER_NODE": "1(x2)", "SLURM_TASK_PID": "7495", "SLURM_TOPOLOGY_ADDR": "node1",
    "SLURM_TOPOLOGY_ADDR_PATTERN": "node",
    "SLURM_WORKING_CLUSTER": "gf82c050:10.213.176.2:6817:9728:109",
}
# ... and the task on node2 of its `srun CMD`.
BATCH_STEP_TASK_1 = {
    **BATCH_SHELL, "SLURMD_NODENAME": "node2", "SLURM_DISTRIBUTION": "cyclic", "SLURM_GTIDS": "1",
    "SLURM_JOB_CPUS_PER_NODE_PACK_GROUP_0": "1(x2)", "SLURM_LAUNCH_NODE_IPADDR": "10.213.176.2",
    "SLURM_NODEID": "1", "SLURM_NPROCS": "2", "SLURM_NTASKS": "2", "SLURM_PROCID": "1",
    "SLURM_SRUN_COMM_HOST": "10.213.176.2", "SLURM_SRUN_COMM_PORT": "35197", "SLURM_STEPID": "0",
    "SLURM_STEP_ID": "0", "SLURM_STEP_LAUNCHER_PORT": "35197", "SLURM_STEP_NODELIST": "node[1-2]",
    "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
    "SLURM_TASK_PID": "7521", "SLURM_TOPOLOGY_ADDR": "node2", "SLURM_UMASK": "0022",
}

# `salloc -N2 CMD`: CMD runs on the login node, in no step.
SALLOC_SHELL = {
    "SLURM_CLUSTER_NAME": "gf82c050", "SLURM_JOBID": "3", "SLURM_JOB_CPUS_PER_NODE": "1(x2)",
    "SLURM_JOB_ID": "3", "SLURM_JOB_NAME": "interactive", "SLURM_JOB_NODELIST": "node[1-2]",
    "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_PARTITION": "test", "SLURM_NNODES": "2",
    "SLURM_NODELIST": "node[1-2]", "SLURM_NODE_ALIASES": "(null)", "SLURM_SUBMIT_DIR": "/tmp/gfproto",
    "SLURM_SUBMIT_HOST": "node1", "SLURM_TASKS_PER_NODE": "1(x2)",
}

# The step's variables of `srun -N2 -n4` (2 tasks per node) and `srun -N2 -n3` (2 and 1), with
# SLURM_NTASKS_PER_NODE=2 inherited from `#SBATCH --ntasks-per-node=2` in the second case.
TWO_PER_NODE = {**SRUN_TASK_1, "SLURM_NPROCS": "4", "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "4",
                "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_TASKS_PER_NODE": "2(x2)"}
UNEVEN = {**SRUN_TASK_1, "SLURM_NPROCS": "3", "SLURM_NTASKS": "3", "SLURM_STEP_NUM_TASKS": "3",
          "SLURM_STEP_TASKS_PER_NODE": "2,1", "SLURM_TASKS_PER_NODE": "2,1", "SLURM_NTASKS_PER_NODE": "2"}


def test_each_task_of_an_srun_step_knows_its_node():
    assert from_environment(SRUN_TASK_0) == SlurmNodes(nnodes=2, node_rank=0, host="node1",
                                                       port=15001, run_id="slurm-1.0")
    assert from_environment(SRUN_TASK_1) == SlurmNodes(nnodes=2, node_rank=1, host="node1",
                                                       port=15001, run_id="slurm-1.0")


def test_a_step_of_a_batch_job_is_a_launch_its_script_is_not():
    assert from_environment(BATCH_STEP_TASK_1) == SlurmNodes(2, 1, "node1", 15002, "slurm-2.0")
    assert from_environment(BATCH_SHELL) is None  # gpufleet in the script itself: one machine


def test_no_launch_outside_slurm_and_in_interactive_shells():
    assert from_environment({}) is None
    assert from_environment({"PATH": "/usr/bin", "MASTER_PORT": "29500"}) is None
    assert from_environment(SALLOC_SHELL) is None
    # `srun --pty bash`: a step, but a shell someone types into (Lightning's rule)
    assert from_environment({**SRUN_TASK_0, "SLURM_JOB_NAME": "bash"}) is None
    assert from_environment({**SRUN_TASK_0, "SLURM_JOB_NAME": "interactive"}) is None


def test_slurms_own_steps_are_not_launches():
    for special in ("4294967291", "4294967292", "4294967290", "batch", "extern"):  # batch, extern, interactive
        assert from_environment({**SRUN_TASK_0, "SLURM_STEP_ID": special}) is None, special


def test_each_step_has_its_own_rendezvous():
    second = from_environment({**BATCH_STEP_TASK_1, "SLURM_STEP_ID": "1", "SLURM_STEPID": "1"})
    assert second.run_id == "slurm-2.1"


def test_port_from_the_last_four_digits_of_the_job_id_or_master_port():
    job = {**SRUN_TASK_0, "SLURM_JOB_ID": "1234567", "SLURM_JOBID": "1234567"}
    assert from_environment(job).port == 15000 + 4567
    assert from_environment({**job, "SLURM_JOB_ID": "98760000"}).port == 15000
    assert from_environment({**job, "MASTER_PORT": "29500"}).port == 29500
    with pytest.raises(ConfigError, match="MASTER_PORT='twelve' is not a whole number"):
        from_environment({**job, "MASTER_PORT": "twelve"})


def test_host_is_the_first_node_of_the_step():
    # A step on part of its job's nodes (`srun -N2 -w c[3-4]` in a 4-node job).
    step = {**SRUN_TASK_1, "SLURM_JOB_NODELIST": "c[01-04]", "SLURM_NODELIST": "c[01-04]",
            "SLURM_JOB_NUM_NODES": "4", "SLURM_STEP_NODELIST": "c[03-04]"}
    assert from_environment(step).host == "c03"
    assert from_environment({**SRUN_TASK_1, "SLURM_STEP_NODELIST": "gpu-a7,gpu-b1"}).host == "gpu-a7"


@pytest.mark.parametrize("nodelist, hosts", [
    ("node1", ["node1"]),
    ("node[1-2]", ["node1", "node2"]),
    ("node[1-3,5]", ["node1", "node2", "node3", "node5"]),
    ("a[01-02],b3", ["a01", "a02", "b3"]),
    ("gpu[008-011]", ["gpu008", "gpu009", "gpu010", "gpu011"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("x1,y[2,4],z", ["x1", "y2", "y4", "z"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ("ip-10-0-0-[12,7]", ["ip-10-0-0-12", "ip-10-0-0-7"]),
])
def test_nodelists_expand_as_slurm_compresses_them(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("nodelist", ["node[1-2", "node[a-b]", ""])
def test_unreadable_nodelists_are_config_errors(nodelist):
    with pytest.raises(ConfigError, match="node list"):
        expand_nodelist(nodelist)


def test_tasks_per_node_expands_slurms_counts():
    assert tasks_per_node("1(x2)") == [1, 1]
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert tasks_per_node("4") == [4]


@pytest.mark.parametrize("environ, shown", [
    (TWO_PER_NODE, "SLURM_STEP_TASKS_PER_NODE=2(x2)"),
    (UNEVEN, "SLURM_STEP_TASKS_PER_NODE=2,1"),
    ({**TWO_PER_NODE, "SLURM_STEP_NUM_NODES": "1", "SLURM_NNODES": "1", "SLURM_STEP_TASKS_PER_NODE": "2"},
     "SLURM_STEP_TASKS_PER_NODE=2"),
])
def test_several_tasks_per_node_are_refused_with_the_fix(environ, shown):
    with pytest.raises(ConfigError) as raised:
        from_environment(environ)
    message = str(raised.value)
    assert shown in message
    assert "srun --ntasks-per-node=1" in message and "#SBATCH --ntasks-per-node=1" in message


def test_the_steps_layout_wins_over_the_jobs():
    # `#SBATCH --ntasks-per-node=2` then `srun -n2 ...`: one task per node in this step.
    inherited = {**BATCH_STEP_TASK_1, "SLURM_NTASKS_PER_NODE": "2", "SLURM_TASKS_PER_NODE": "2(x2)"}
    assert from_environment(inherited).nnodes == 2


def test_without_the_steps_layout_the_task_count_decides():
    older = {k: v for k, v in TWO_PER_NODE.items() if not k.startswith("SLURM_STEP_")}
    older.update(SLURM_STEP_ID="0")
    del older["SLURM_NTASKS_PER_NODE"]
    with pytest.raises(ConfigError, match="SLURM_NTASKS=4 tasks on SLURM_NNODES=2 nodes"):
        from_environment(older)
    with pytest.raises(ConfigError, match="SLURM_NTASKS_PER_NODE=2"):
        from_environment({**older, "SLURM_NTASKS_PER_NODE": "2"})
