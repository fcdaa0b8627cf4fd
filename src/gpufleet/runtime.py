"""What user code calls inside a rank.

The getters read torchrun's variables, so they work the same under gpufleet, under torchrun,
and in a direct (undistributed) call, where they describe a world of one process.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gpufleet import _environ, steps, timings
from gpufleet.rundir import RunDir

if TYPE_CHECKING:
    import torch

__all__ = [
    "get_global_rank",
    "get_local_rank",
    "get_world_size",
    "get_local_world_size",
    "get_node_rank",
    "is_main_process",
    "get_attempt",
    "setup",
    "heartbeat",
    "should_stop",
    "step",
]

HEARTBEAT_EVERY_S = 1.0  # at most one file touch per second, however often heartbeat() is called
_last_heartbeat = 0.0
_stop_group = None  # (default group it was made under, gloo group) of should_stop()
_call_end_hooks: list[Callable[[], None]] = []  # see _at_call_end()


def get_global_rank() -> int:
    """This process's rank among all processes of the run (0 in a direct call)."""
    return _environ.rank()


def get_local_rank() -> int:
    """This process's rank on its machine; also the index of its GPU."""
    return _environ.local_rank()


def get_world_size() -> int:
    """How many processes the run has (1 in a direct call)."""
    return _environ.world_size()


def get_local_world_size() -> int:
    """How many processes of the run share this machine."""
    return _environ.local_world_size()


def get_node_rank() -> int:
    """The index of this machine among the run's machines."""
    return _environ.node_rank()


def is_main_process() -> bool:
    """True on global rank 0: the one rank that should print, save and log."""
    return get_global_rank() == 0


def get_attempt() -> int:
    """Which run of the call this is: 0 first, then 1, 2, ... for each retry (``max_retries``).

    With gpufleet's checkpoints a retry resumes from the last committed step by itself
    (``Checkpointer.restore``); this tells code that wants to act differently on a retry.
    """
    return _environ.attempt()


def heartbeat() -> None:
    """Tell gpufleet this rank is making progress, for code that is silent for longer than
    ``hang_timeout``. Output on any rank and checkpoint saves count too. Cheap enough to call
    every step; does nothing outside a gpufleet run."""
    global _last_heartbeat
    now = time.monotonic()
    if now - _last_heartbeat < HEARTBEAT_EVERY_S:
        return
    _last_heartbeat = now
    folder = _environ.run_dir()
    if folder is None:
        return
    path = RunDir(folder).heartbeat(get_global_rank())
    try:
        try:
            os.utime(path)
        except FileNotFoundError:  # the first beat: private, like everything in the run folder
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600))
    except OSError:  # a beat that cannot be recorded must never fail the training step
        pass


def step(samples: int | None = None, tokens: int | None = None, total: int | None = None) -> steps.Step:
    """Count a training step, for gpufleet's step telemetry: call it at the end of each step,
    or wrap each step in ``with runtime.step():`` (the time between two steps then counts as
    waiting for input). Not needed with the strategies' trainer (``Prepared.step()``), which
    counts optimizer steps by itself; once called, its count is the one used.

    ``samples`` and ``tokens``: how many this rank's step processed (for throughput; a
    ``gpufleet.data`` loader counts samples by itself); ``total``: how many steps this call
    will run, for the ETA. Each rank's step time, input wait and arrival at the step's
    gradient collective (the start of its syncing backward pass) are compared by the caller,
    which names a rank the others keep waiting for (``straggler_threshold``). Cheap: a few
    clock reads per step and one small write a second. Does nothing outside a gpufleet run
    or with ``step_telemetry=False``.
    """
    return steps.step(samples, tokens, total)


@contextlib.contextmanager
def _working():
    """Heartbeats every second while a long, silent gpufleet operation runs (a checkpoint's
    write, upload or load), so that it is never taken for a hang. Also a decorator."""
    heartbeat()
    done = threading.Event()

    def beat():
        while not done.wait(HEARTBEAT_EVERY_S):
            heartbeat()

    beater = threading.Thread(target=beat, name="gpufleet-heartbeat", daemon=True)
    beater.start()
    try:
        yield
    finally:
        done.set()
        beater.join()


def should_stop() -> bool:
    """True once the run was asked to stop: its caller got SIGTERM (a preemption). Save a
    checkpoint and return within ``grace_period`` seconds.

    With a process group it is a collective (one small all-reduce on a gloo group of its own),
    so call it at the same point on every rank, e.g. at the end of each step: every rank gets
    the same answer at the same step. False outside a gpufleet run.
    """
    folder = _environ.run_dir()
    asked = folder is not None and RunDir(folder).stop_request.exists()
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return asked
    if dist.get_world_size() == 1:
        return asked
    import torch

    flag = torch.tensor([int(asked)], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=_gloo_group(dist))
    return bool(flag.item())


def _gloo_group(dist):
    """A gloo group for should_stop(), made once per default group (creating it is itself a
    collective, on every rank at the same call)."""
    global _stop_group
    default = dist.group.WORLD
    if _stop_group is None or _stop_group[0] is not default:
        _stop_group = (default, dist.new_group(backend="gloo"))
    return _stop_group[1]


def _own_groups() -> tuple:
    """The process groups gpufleet made for itself (kept alive by a warm pool)."""
    return (_stop_group[1],) if _stop_group is not None else ()


def setup(backend: str | None = None, *, timeout: float | None = None) -> "torch.device":
    """Bind this rank's GPU and initialise the default process group; return the device.

    The backend is nccl on GPUs and gloo on CPU unless ``backend`` says otherwise (for
    example ``"cpu:gloo,cuda:nccl"``). ``timeout`` (seconds) bounds every collective. Calling
    it again, or after user code already called ``init_process_group``, changes nothing. In a
    direct call (no launcher) it creates a process group of one process, with no network, so
    that collectives and DDP in the function still work; the call closes it when it returns.
    """
    import torch
    import torch.distributed as dist

    timings.mark("setup_started")
    device = _device(torch)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        timings.mark("cuda_ready")
    if not dist.is_available() or dist.is_initialized():
        return device
    options: dict[str, Any] = {
        "backend": backend or ("nccl" if device.type == "cuda" else "gloo"),
        "device_id": device if device.type == "cuda" else None,
        "timeout": datetime.timedelta(seconds=timeout) if timeout else None,
    }
    if not _environ.is_launched():
        # A direct call: a world of one, with an in-memory store, so that collectives and DDP
        # in the function work unchanged and no port is opened.
        options.update(store=dist.HashStore(), rank=0, world_size=1)
    dist.init_process_group(**options)
    timings.mark("process_group_ready")
    return device


def _device(torch) -> "torch.device":
    wants_cpu = _environ.device_kind() == "cpu"
    if wants_cpu or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", get_local_rank())


@contextlib.contextmanager
def _direct_call():
    """Around a direct (undistributed) call: close the world of one that setup() may open,
    so the caller's process is left as it was."""
    dist = sys.modules.get("torch.distributed")
    had_group = dist is not None and dist.is_available() and dist.is_initialized()
    try:
        yield
        _finish_saves()
    finally:
        dist = sys.modules.get("torch.distributed")
        if not had_group and dist is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def _at_call_end(hook: Callable[[], None]) -> None:
    """Run ``hook`` whenever the user's function returns, before its call ends (checkpoints
    register theirs when imported)."""
    _call_end_hooks.append(hook)


def _finish_saves() -> None:
    """Run the call-end hooks in order: wait for checkpoint saves still in flight, so that a
    call ends only once they are published, and an error while saving is the call's error."""
    for hook in _call_end_hooks:
        hook()
