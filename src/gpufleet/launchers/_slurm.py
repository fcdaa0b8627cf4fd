"""Where the machines of a run meet, read from a Slurm job step's environment.

Under ``srun`` every node runs gpufleet once (one task per node) with the same command line;
this module turns what srun put in each task's environment into what the node launcher needs:
how many nodes, which one this is, the rendezvous host and port, and a rendezvous id shared by
the step's tasks and by nothing else. The rules are those of Lightning's ``SLURMEnvironment``
and submitit's ``SlurmJobEnvironment``:

- **Only inside a job step.** ``None`` without ``SLURM_JOB_ID``; ``None`` too where Slurm's
  variables are present but srun did not start this process: a batch script's own shell and
  an ``salloc`` shell have no ``SLURM_STEP_ID`` (one gpufleet there runs on one machine, as it
  would anywhere), and, as in Lightning, a job named ``bash`` or ``interactive`` (``salloc``'s
  default name; ``srun --pty bash``) is a shell someone types into, not a launch. The top of
  the 32-bit range of step ids is Slurm's own (batch, extern, interactive steps): not a launch.
- **The step, not the job.** Node count, node list and tasks per node are the step's where srun
  sets them (``SLURM_STEP_*``): a step may use part of its job's nodes, and a batch script's
  ``SLURM_NTASKS_PER_NODE`` is inherited by its steps whatever they run.
- **Host:** the step's first node, expanding Slurm's compressed lists (``node[1-3,5]``,
  ``a[01-02],b3``) as submitit's ``_parse_node_list`` does, zero padding kept.
- **Port:** ``MASTER_PORT`` if set, else Lightning's rule, 15000 + the job id's last four
  digits: the same on every node without talking, and two jobs sharing a node rarely collide.
- **Run id:** ``slurm-JOB.STEP``: one rendezvous per step, so a second srun in the same
  batch script never meets the first one's leftovers.

gpufleet starts the ranks of a node itself, so a step with more than one task on a node (each
of which would start a full node's ranks) is refused with the fix. Environment values are
passed in (``_environ.snapshot()`` in gpufleet), so this module reads nothing by itself.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from gpufleet.errors import ConfigError

PORT_BASE = 15000  # Lightning's: job 1234567 meets on 15000 + 4567
INTERACTIVE_JOB_NAMES = ("bash", "interactive")  # Lightning's: a shell, not a launch
FIRST_SPECIAL_STEP = 0xFFFFFFF0  # Slurm's batch (…fb), extern (…fc), interactive (…fa) steps
ONE_TASK_PER_NODE = ("run one task per node: `srun --ntasks-per-node=1 ...`, and in a batch "
                     "script `#SBATCH --ntasks-per-node=1` (its steps inherit the job's task count)")


@dataclass(frozen=True)
class SlurmNodes:
    """This node's place in a Slurm job step, in the node launcher's terms."""

    nnodes: int
    node_rank: int  # SLURM_NODEID: this node's index in the step, 0 first
    host: str  # the rendezvous host: the step's first node
    port: int
    run_id: str  # the rendezvous id: slurm-JOB.STEP


def from_environment(environ: Mapping[str, str]) -> SlurmNodes | None:
    """The step this process is a task of, or None when srun did not start it (module
    docstring). Raises ConfigError when the step runs several tasks on a node."""
    job_id = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
    step_id = environ.get("SLURM_STEP_ID") or environ.get("SLURM_STEPID")
    if not job_id or environ.get("SLURM_JOB_NAME") in INTERACTIVE_JOB_NAMES or not _is_step(step_id):
        return None
    nnodes = _integer(environ, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
    _check_one_task_per_node(environ, nnodes)
    nodelist = _first(environ, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    return SlurmNodes(nnodes=nnodes, node_rank=_integer(environ, "SLURM_NODEID"),
                      host=expand_nodelist(nodelist)[0], port=_port(environ, job_id),
                      run_id=f"slurm-{job_id}.{step_id}")


def _is_step(step_id: str | None) -> bool:
    return step_id is not None and step_id.isdigit() and int(step_id) < FIRST_SPECIAL_STEP


def _port(environ: Mapping[str, str], job_id: str) -> int:
    if environ.get("MASTER_PORT", "").strip():
        return _integer(environ, "MASTER_PORT")
    if not job_id.isdigit():
        raise ConfigError(f"SLURM_JOB_ID={job_id!r} is not a number, so no rendezvous port "
                          "follows from it: set MASTER_PORT to a free port, the same on every node")
    return PORT_BASE + int(job_id[-4:])


def _check_one_task_per_node(environ: Mapping[str, str], nnodes: int) -> None:
    """Raise ConfigError when the step runs more than one task on a node. The step's layout
    (SLURM_STEP_TASKS_PER_NODE, as "2(x3),1") where srun gives it; else the job's."""
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE"):
        if environ.get(name, "").strip():
            most = max(tasks_per_node(environ[name]))
            if most > 1:
                raise ConfigError(f"{name}={environ[name]}: this Slurm step runs {most} tasks on a "
                                  f"node, and gpufleet starts a node's ranks itself; {ONE_TASK_PER_NODE}")
            return
    ntasks = environ.get("SLURM_STEP_NUM_TASKS") or environ.get("SLURM_NTASKS")
    if ntasks and ntasks.isdigit() and int(ntasks) > nnodes:
        raise ConfigError(f"SLURM_NTASKS={ntasks} tasks on SLURM_NNODES={nnodes} nodes: gpufleet "
                          f"starts a node's ranks itself; {ONE_TASK_PER_NODE}")


def tasks_per_node(text: str) -> list[int]:
    """Slurm's compressed counts, one per node: "2(x3),1" -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for part in text.split(","):
        found = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if found is None:
            raise ConfigError(f"cannot read Slurm's tasks per node {text!r} (expected e.g. '1(x2)' or '2,1')")
        counts += [int(found[1])] * int(found[2] or 1)
    return counts


def expand_nodelist(nodelist: str) -> list[str]:
    """Slurm's compressed host list, expanded in order: "a[01-02],b3" -> [a01, a02, b3];
    several brackets in one name give every combination ("r[1-2]n[1-2]": r1n1, r1n2, ...)."""
    hosts: list[str] = []
    pos = 0
    try:
        while pos < len(nodelist):
            pos = _expand_group(nodelist, pos, hosts)
    except ValueError as exc:  # an unclosed bracket, a range that is not numbers
        raise ConfigError(f"cannot read the Slurm node list {nodelist!r}: {exc}") from None
    if not hosts:
        raise ConfigError(f"the Slurm node list {nodelist!r} names no node")
    return hosts


def _expand_group(nodelist: str, pos: int, hosts: list[str]) -> int:
    """Expand the one name (brackets and all) that starts at ``pos`` into ``hosts``; return
    where the next one starts. The commas inside brackets belong to the brackets."""
    names = [""]
    while pos < len(nodelist) and nodelist[pos] != ",":
        if nodelist[pos] == "[":
            end = nodelist.index("]", pos)
            names = [name + suffix for name in names for suffix in _expand_range(nodelist[pos + 1:end])]
            pos = end + 1
        else:
            names = [name + nodelist[pos] for name in names]
            pos += 1
    hosts += [name for name in names if name]
    return pos + 1


def _expand_range(ranges: str) -> list[str]:
    """ "1-3,5" -> [1, 2, 3, 5]; "08-10" -> [08, 09, 10]: a range keeps its first number's width."""
    suffixes: list[str] = []
    for part in ranges.split(","):
        low, _, high = part.partition("-")
        if not high:
            suffixes.append(low)
            continue
        if not (low.isdigit() and high.isdigit()):
            raise ValueError(f"range {part!r} is not NUMBER-NUMBER")
        suffixes += [f"{number:0{len(low)}d}" for number in range(int(low), int(high) + 1)]
    return suffixes


def _first(environ: Mapping[str, str], *names: str) -> str:
    """The value of the first of ``names`` that is set and not empty."""
    for name in names:
        if environ.get(name, "").strip():
            return environ[name].strip()
    raise ConfigError(f"this Slurm job step sets none of {', '.join(names)}; srun sets them for "
                      "every task: was the environment changed on the way?")


def _integer(environ: Mapping[str, str], *names: str) -> int:
    value = _first(environ, *names)
    if not value.isdigit():
        name = next(n for n in names if environ.get(n, "").strip())
        raise ConfigError(f"{name}={value!r} is not a whole number")
    return int(value)
