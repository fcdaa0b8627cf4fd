"""The local launcher: every rank on this machine, started by torch.distributed.elastic.

``plan`` is pure (the agent's argv and environment); ``launch`` takes this machine's devices
for the run (once: its retries keep them) and starts the agent, which runs in a process of
its own, ``_elastic_agent``; docs/design.md says why. ``LocalJob`` is that agent as the
watcher drives it.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass

from gpufleet import _environ, _process
from gpufleet.launchers import devices, hardware, template
from gpufleet.launchers.base import Gate, Job, Launcher
from gpufleet.launchers.hardware import Placement
from gpufleet.options import RunOptions
from gpufleet.payload import write_private
from gpufleet.rundir import Attempt, RunDir, rank_groups
from gpufleet.watch.monitor import RunMonitor

LOOPBACK_INTERFACE = "lo"
FLIGHT_RECORDER_ENTRIES = 2000  # collectives remembered per rank


def place(options: RunOptions) -> Placement:
    """How many ranks on which device: this machine's GPUs, or CPU processes without one."""
    return hardware.place(options.gpus, options.gpu_type)


@dataclass(frozen=True)
class LaunchPlan:
    """The agent's command line and environment (this machine's devices are added at launch)."""

    folder: RunDir  # where the ranks write (an attempt, or a warm pool's folder)
    argv: list[str]
    env: dict[str, str]
    nprocs: int
    node: dict | None = None  # a node run's rendezvous, for the agent (``nodes.py``)

    def describe(self) -> str:
        """The command and the variables gpufleet decides (values a caller passes may be
        secrets: never shown)."""
        shown = [_environ.DEVICE, "OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"]
        env = ", ".join(f"{name}={self.env[name]}" for name in shown if name in self.env)
        return f"{self.nprocs} ranks on this machine ({env}): {shlex.join(self.argv)}"


class LocalLauncher(Launcher[LaunchPlan]):
    """Cold starts on this machine: a fresh agent and fresh ranks for every attempt."""

    def __init__(self, placement: Placement, options: RunOptions, gate: Gate):
        self.placement = placement
        self.options = options
        self.gate = gate
        self.lease: devices.Lease | None = None  # taken by the first launch, kept by retries

    def plan(self, attempt: Attempt, env: dict[str, str]) -> LaunchPlan:
        return plan(attempt, self.placement, self.options, attempt.number, env)

    def launch(self, plan: LaunchPlan) -> "LocalJob":
        lease = self._hold_devices()
        self.gate.begin(lease.ids)
        # the devices replace this process's CUDA_VISIBLE_DEVICES; a caller's env= still wins
        env = {**plan.env, **lease.env(), **self.options.env}
        agent = launch(dataclasses.replace(plan, env=env))
        return LocalJob(agent, plan.folder, plan.nprocs)

    def close(self) -> None:
        """Free the devices once the values are back: the ranks may still be exiting (their
        CUDA and NCCL teardown, about a second), which the next run of this process, or of
        the line, overlaps, as it would after a torchrun job returned."""
        if self.lease is not None:
            self.lease.release()

    def _hold_devices(self) -> devices.Lease:
        """This machine's devices for the run, taken at the first launch, kept by its retries."""
        if self.lease is None:
            # a run started inside a rank uses the rank's own devices, which its run holds
            if self.placement.takes_devices and _environ.run_dir() is None:
                ticket, self.gate.ticket = self.gate.ticket, None  # acquire drops it when done
                self.lease = devices.acquire(
                    self.placement.nprocs, self.gate.owner, self.gate.waiting,
                    stopped=self.gate.stopped, since=self.gate.since, ticket=ticket,
                )
                if self.lease is None:
                    raise self.gate.never_started()
            else:
                self.lease = devices.Lease()
        return self.lease


class LocalJob(Job):
    """The elastic agent of one attempt (or of a warm pool), and the ranks it started."""

    def __init__(self, agent: subprocess.Popen | template.Forked, attempt: RunDir, world_size: int,
                 reports: RunDir | None = None, keeps_ranks: bool = False):
        self.agent = agent
        self.attempt = attempt
        self.reports = reports or attempt
        self.world_size = world_size
        self.keeps_ranks = keeps_ranks
        self.monitor = RunMonitor(attempt, world_size, self.reports.nccl_traces)
        self.stamps: dict[str, float] = {}

    def poll(self) -> int | None:
        return self.agent.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self.agent.wait(timeout)

    def stop(self) -> None:
        if self.agent.poll() is None:
            self.agent.send_signal(signal.SIGTERM)  # elastic stops the ranks

    def release(self) -> None:
        """Kill every process group of the attempt that still exists; reap the agent."""
        _process.kill_groups(rank_groups(self.attempt, self.world_size))
        if self.agent.poll() is None:  # its pid is its own until reaped
            _process.end_run_tree(self.agent.pid, grace=0)  # what it adopted would go to init
        _process.kill_group(self.agent.pid)
        self.agent.wait()
        _make_private(self.reports.nccl_traces.parent)  # PyTorch writes its dumps with the umask

    def describe(self) -> str:
        return f"the launcher process (torch elastic agent, pid {self.agent.pid})"


def plan(
    folder: RunDir, placement: Placement, options: RunOptions, attempt: int = 0,
    extra_env: dict[str, str] | None = None,
) -> LaunchPlan:
    """The agent for the ranks of ``folder``: this process's environment, ``extra_env``, then
    the call's ``env=``, then gpufleet's own variables."""
    env = _environ.snapshot()
    env.update(extra_env or {})
    env.update(options.env)
    env.update(
        {
            _environ.RUN_DIR: str(folder.path),
            _environ.DEVICE: placement.device,
            _environ.PARENT_PID: str(os.getpid()),
            _environ.ATTEMPT: str(attempt),
            "NODE_RANK": "0",
            "PYTHONUNBUFFERED": "1",
        }
    )
    if "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // placement.nprocs))
    # One machine: gloo's and NCCL's bootstrap sockets listen on loopback only (NCCL still
    # moves data over NVLink / shared memory). Users who set these keep their choice.
    env.setdefault("GLOO_SOCKET_IFNAME", LOOPBACK_INTERFACE)
    env.setdefault("NCCL_SOCKET_IFNAME", LOOPBACK_INTERFACE)
    if placement.device == "cuda":
        _flight_recorder(env, str(folder.nccl_traces))
    argv = [sys.executable, "-m", "gpufleet.launchers._elastic_agent", str(folder.path)]
    return LaunchPlan(folder=folder, argv=argv, env=env, nprocs=placement.nprocs)


def _flight_recorder(env: dict[str, str], prefix: str) -> None:
    """PyTorch's NCCL flight recorder on (the last collectives of each rank, kept in memory),
    dumped into the run folder when a collective times out or when gpufleet asks through the
    per-rank pipe after a hang. The dump file variables are set under both the current and the
    older names; a user's own setting wins."""
    if "TORCH_FR_BUFFER_SIZE" not in env and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in env:
        # newer torch reads TORCH_FR_BUFFER_SIZE and warns on every rank about the old name
        name = "TORCH_FR_BUFFER_SIZE" if _torch_version() >= (2, 8) else "TORCH_NCCL_TRACE_BUFFER_SIZE"
        env[name] = str(FLIGHT_RECORDER_ENTRIES)
    env.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    for name in ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_PIPE_FILE"):
        env.setdefault(name, prefix)


def _torch_version() -> tuple[int, int]:
    major, minor = importlib.metadata.version("torch").split(".")[:2]
    return int(major), int(minor)


def launch(launch_plan: LaunchPlan) -> subprocess.Popen | template.Forked:
    """Start the agent in its own session, so a terminal's Ctrl-C reaches only the caller,
    which then stops the run in order: forked from the kept template (``template.py``), or
    else as a fresh interpreter.

    The agent dies with the thread that started it (PR_SET_PDEATHSIG follows the thread, not
    the process), so every agent is started by one long-lived thread (``_process.starter``):
    a call made from a short-lived thread, or a pool started by one, outlives it.
    """
    folder = launch_plan.folder
    spec = {"nprocs": launch_plan.nprocs, "node": launch_plan.node}
    write_private(folder.path / "launch.json", json.dumps(spec).encode())
    log_fd = os.open(folder.agent_log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        forked = template.start_agent(launch_plan.argv, launch_plan.env, log_fd)
        if forked is not None:
            return forked
        return _process.starter().run(
            subprocess.Popen,
            launch_plan.argv,
            env=launch_plan.env,
            stdin=subprocess.DEVNULL,
            stdout=log_fd,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    finally:
        os.close(log_fd)


def _make_private(folder) -> None:
    if not folder.is_dir():  # the run's folder was deleted
        return
    for path in folder.iterdir():
        try:
            path.chmod(0o600)
        except OSError:
            pass
