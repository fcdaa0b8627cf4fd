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
    "get_replica_rank",
    "is_main_process",
    "get_attempt",
    "setup",
    "main_process_first",
    "heartbeat",
    "should_stop",
    "step",
    "flops",
]

HEARTBEAT_EVERY_S = 1.0  # at most one file touch per second, however often heartbeat() is called
_last_heartbeat = 0.0
_stop_group = None  # (default group it was made under, gloo group) of should_stop()
_first_group = None  # the same, of main_process_first(): a gloo group with a long timeout
# The others wait in main_process_first() as long as the first process takes (a download may
# take hours), and in a checkpoint save for the slowest rank; a first process that hangs is
# found by hang_timeout, like any hang.
FIRST_WAIT = datetime.timedelta(days=7)
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


def get_replica_rank(shard_size: int = 1) -> int:
    """The index of the model replica (copy) this process holds, or holds a part of:
    ``global rank // shard_size``, from 0 to ``get_world_size() // shard_size - 1``.

    ``shard_size`` is how many processes hold one copy of the model between them, in rank
    order (ranks are ordered by node, then GPU):

    - DDP, ZeRO-1/2 (every process a whole copy): 1, the default; the replica rank is the
      global rank.
    - FSDP or ZeRO-3 sharded over every process (gpufleet's ``"fsdp"``, ``"zero3"``):
      ``get_world_size()``; the replica rank is 0 everywhere: there is one copy.
    - HSDP, or tensor parallelism, within each node and replicated across nodes:
      ``get_local_world_size()``; the replica rank is the node rank.

    With several nodes nothing else changes: a DDP run of 2 nodes × 8 GPUs has replicas 0-15,
    the same run sharded per node has replicas 0 and 1. Use it where something goes once per
    copy of the model: the process that writes or evaluates a replica, or, with tensor
    parallelism (whose processes of a replica share their input), the data shard a replica
    reads. FSDP and HSDP are still data parallel inside a replica: each process reads its own
    batches, so shard data by global rank there. In a direct call (outside a run) it is 0, as
    for a world of one process.
    """
    world = get_world_size()
    if isinstance(shard_size, bool) or not isinstance(shard_size, int) or shard_size < 1:
        from gpufleet.errors import ConfigError

        raise ConfigError(f"shard_size={shard_size!r} must be a whole number ≥ 1: how many "
                          "processes hold one copy of the model (1 for DDP)")
    if _environ.is_launched() and world % shard_size:
        from gpufleet.errors import ConfigError

        raise ConfigError(f"shard_size={shard_size} does not divide the run's {world} processes "
                          "into replicas; pass a divisor of get_world_size(), e.g. "
                          f"get_local_world_size() ({get_local_world_size()}) for one copy per node")
    return get_global_rank() // shard_size


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


def flops(per_token: float | None = None, *, per_sample: float | None = None,
          per_step: float | None = None, count: bool = True) -> None:
    """Give the model's FLOPs for MFU (model FLOPs utilisation) in the step telemetry: what
    this rank's model does per token, per sample or per step (one of them), forward and
    backward together; for a dense transformer about ``6 * parameters + 12 * layers * hidden *
    sequence`` per token (weights, then attention).

    Without it, gpufleet counts them itself on one step (torch's FLOP counter, from one
    step's end to the next; that step runs a little slower, and eagerly under torch.compile)
    wherever a peak is known: a GPU of its table (A100, H100, H200, L4, L40S, B200) or
    ``GPUFLEET_PEAK_FLOPS``. ``runtime.flops()`` alone counts them anywhere (steps.json then
    has them, and an MFU if a peak is known); ``runtime.flops(count=False)`` never counts.
    The status line, ``gpufleet status``, steps.json and MLflow then show tokens/s per GPU
    and MFU. Does nothing outside a gpufleet run or with ``step_telemetry=False``.
    """
    steps.model_flops(per_token, per_sample, per_step, count)


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
    return tuple(made[1] for made in (_stop_group, _first_group) if made is not None)


@contextlib.contextmanager
def main_process_first(local: bool = True):
    """Run the ``with`` block on one process first, then on the others: download or
    preprocess once, and let the others read what it wrote.

        with runtime.main_process_first():
            dataset = load_dataset("imdb")    # local rank 0 downloads; the others hit its cache

    ``local=True``: local rank 0 of every node runs the block first (each node has its own
    disk), then the node's other processes, once the first of every node is done;
    ``local=False``: global rank 0 first (a shared file system), then every other process.
    Every process leaves the block together. Call it on every process, after
    ``runtime.setup()``, and call no collective inside the block (the others are not in it).

    The others wait as long as the first takes (a long download does not time out; a first
    process that hangs is found by ``hang_timeout`` like any hang). When the block raises on
    a first process, every other process raises at once, without running the block: a
    GpufleetError naming the rank and its error (reported as an echo of that rank's failure).
    When it raises on another process, the rest raise the same way when they leave the block.
    Outside a run (a direct call) it just runs the block; in a run before ``setup()`` it is
    an error.
    """
    if not _environ.is_launched():
        yield
        return
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        from gpufleet.errors import GpufleetError

        raise GpufleetError("runtime.main_process_first() needs the run's process group: call "
                            "runtime.setup() first, on every process")
    if dist.get_world_size() == 1:
        yield
        return
    group = _waiting_group(dist)
    first = (get_local_rank() if local else get_global_rank()) == 0
    error = None
    if first:
        try:
            yield
        except Exception as exc:  # raised again below, once the others know of it
            error = exc
    _raise_on_failure(dist, group, error)  # the others wait here for the first ones
    if not first:
        try:
            yield
        except Exception as exc:
            error = exc
    _raise_on_failure(dist, group, None if first else error)  # every process leaves together


def _raise_on_failure(dist, group, error: Exception | None) -> None:
    """Tell every process whether the block failed here; raise if it failed anywhere: the
    failing process its own exception, the others an error naming the first one to fail."""
    failures = [None] * dist.get_world_size()
    mine = None if error is None else f"{type(error).__name__}: {error}"
    dist.all_gather_object(failures, mine, group=group)
    if error is not None:
        raise error
    failed = next(((rank, text) for rank, text in enumerate(failures) if text is not None), None)
    if failed is not None:
        from gpufleet.errors import GpufleetError

        rank, text = failed
        echo = GpufleetError(f"rank {rank} failed inside runtime.main_process_first() ({text}), "
                             f"so rank {get_global_rank()} stops too")
        # A communication error as its (hidden) context: gpufleet's failure report then calls
        # this rank's error an echo of the failing rank's, which stays the root cause.
        echo.__context__ = getattr(dist, "DistError", RuntimeError)(str(echo))
        echo.__suppress_context__ = True
        raise echo


def _waiting_group(dist):
    """A gloo group for main_process_first() and the checkpointer's waits in the main thread,
    with a timeout long enough for any download or save (made once per default group, by
    every process at the same call)."""
    global _first_group
    default = dist.group.WORLD
    if _first_group is None or _first_group[0] is not default:
        _first_group = (default, dist.new_group(backend="gloo", timeout=FIRST_WAIT))
    return _first_group[1]


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
