"""The local launcher: every rank on this machine, started by torch.distributed.elastic.

``plan`` is pure (what would run: argv and environment); ``launch`` starts it. The engine runs
in its own process, ``_elastic_agent``; docs/design.md says why.
"""

from __future__ import annotations

import concurrent.futures
import importlib.metadata
import json
import os
import queue
import threading
import subprocess
import sys
from dataclasses import dataclass

from gpufleet import _environ
from gpufleet.hardware import Placement
from gpufleet.options import RunOptions
from gpufleet.payload import write_private
from gpufleet.rundir import RunDir


LOOPBACK_INTERFACE = "lo"
FLIGHT_RECORDER_ENTRIES = 2000  # collectives remembered per rank


@dataclass(frozen=True)
class LaunchPlan:
    argv: list[str]
    env: dict[str, str]
    nprocs: int


def plan(
    run: RunDir, placement: Placement, options: RunOptions, attempt: int = 0,
    extra_env: dict[str, str] | None = None,
) -> LaunchPlan:
    env = _environ.snapshot()
    env.update(extra_env or {})
    env.update(options.env)
    env.update(
        {
            _environ.RUN_DIR: str(run.path),
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
        _flight_recorder(env, str(run.nccl_traces))
    argv = [sys.executable, "-m", "gpufleet.launchers._elastic_agent", str(run.path)]
    return LaunchPlan(argv=argv, env=env, nprocs=placement.nprocs)


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


def launch(launch_plan: LaunchPlan, run: RunDir) -> subprocess.Popen:
    """Start the agent in its own session, so a terminal's Ctrl-C reaches only the caller,
    which then stops the run in order.

    The agent dies with the thread that started it (PR_SET_PDEATHSIG follows the thread, not
    the process), so every agent is started by one long-lived thread: a call made from a
    short-lived thread, or a pool started by one, outlives it.
    """
    spec = {"nprocs": launch_plan.nprocs}
    write_private(run.path / "launch.json", json.dumps(spec).encode())
    log_fd = os.open(run.agent_log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        return _starter().run(
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


class _Starter:
    """A daemon thread that lives as long as this process: it ends only when the process
    does, so the agents it started get their parent-death signal exactly then (after the
    interpreter waited for the calls' teardown threads)."""

    def __init__(self):
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="gpufleet-starter", daemon=True).start()

    def run(self, fn, *args, **kwargs):
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._tasks.put((done, fn, args, kwargs))
        return done.result()

    def _serve(self) -> None:
        while True:
            done, fn, args, kwargs = self._tasks.get()
            try:
                done.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # handed to the caller, which raises it
                done.set_exception(exc)


_starters: dict[int, _Starter] = {}
_starters_lock = threading.Lock()


def _starter() -> _Starter:
    """This process's starter (a forked child of the caller gets its own)."""
    with _starters_lock:
        pid = os.getpid()
        if pid not in _starters:
            _starters[pid] = _Starter()
        return _starters[pid]
