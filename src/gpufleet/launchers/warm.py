"""Warm pools: rank processes that stay alive between calls.

    with gpufleet.pool(gpus=2):
        train.distributed(...)      # pays the start-up once
        evaluate.distributed(...)   # ships only the payload

A pool is an ordinary local run whose ranks, once set up (CUDA bound, process group made),
wait for calls instead of exiting: each call gets its own run folder as always, and its
payload path travels to every rank through a per-rank pipe in the pool's folder. Any call
that does not end well (an error, a timeout, a hang, Ctrl-C, SIGTERM) takes the ranks down
with it, and the next call starts them again: a call never inherits a broken process group.
docs/design.md ("Warm pool") has the details and what state carries over between calls.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from gpufleet import _environ, _process
from gpufleet._log import log
from gpufleet.errors import ConfigError
from gpufleet.launchers import devices, hardware, local, template
from gpufleet.launchers.hardware import Placement
from gpufleet.launchers.local import LaunchPlan, LocalJob, LocalLauncher
from gpufleet.options import RunOptions
from gpufleet.payload import write_private
from gpufleet.rundir import RunDir
from gpufleet.watch.supervisor import Preemption, Supervisor

CLOSE_GRACE_SECONDS = 10.0
DEFAULT_START_TIMEOUT = 600.0
READY_TIMEOUT_SECONDS = 60.0  # for warm ranks to clean up after a call before the next one
READY_POLL_SECONDS = 0.002
# Read when the ranks start (CUDA, NCCL, the allocator, OpenMP, the dynamic loader): a call
# that sets them differently gets freshly started ranks rather than silently old values.
START_UP_VARIABLES = ("CUDA_VISIBLE_DEVICES", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF",
                      "OMP_NUM_THREADS", "LD_PRELOAD", "LD_LIBRARY_PATH")
START_UP_PREFIXES = ("NCCL_", "TORCH_NCCL_", "TORCH_FR_", "GLOO_")

_active: list["Pool"] = []  # pools entered with `with`, innermost last
_shared: dict[tuple, "Pool"] = {}  # the pools of warm=True functions, by placement
_shared_lock = threading.Lock()
_bound = threading.local()  # .pool: the pool of this thread's calls (a sweep's worker), first


@contextlib.contextmanager
def bound(pool: "Pool") -> Iterator["Pool"]:
    """This thread's calls run on ``pool`` when their placement matches it (a sweep's worker,
    whose trials run one after the other); the pool is closed at the end."""
    _bound.pool = pool
    try:
        yield pool
    finally:
        _bound.pool = None
        pool.close()


class Pool:
    """Rank processes kept alive between calls; see ``gpufleet.pool``."""

    def __init__(
        self,
        gpus: int | None = None,
        *,
        gpu_type: str | None = None,
        runs_dir: str | os.PathLike | None = None,
        keep_memory: bool = False,
        start_timeout: float = DEFAULT_START_TIMEOUT,
    ):
        if not isinstance(keep_memory, bool):
            raise ConfigError(f"keep_memory={keep_memory!r} must be True or False")
        where = {"runs_dir": runs_dir} if runs_dir is not None else {}  # None: the config file's
        self._options = RunOptions.create(
            gpus=gpus, gpu_type=gpu_type, **where, timeout=start_timeout, hang_timeout=None
        )
        self._keep_memory = keep_memory
        self._lock = threading.RLock()  # one call at a time
        self._ranks: _Ranks | None = None
        self._closed = False
        self.placement: Placement | None = None
        self.starts = 0  # how many times the ranks were started (1 + rebuilds)

    def __enter__(self) -> "Pool":
        self._closed = False
        self.start()
        _active.append(self)
        return self

    def __exit__(self, *exc_info) -> None:
        _active.remove(self)
        self.close()

    @property
    def folder(self) -> Path | None:
        """The run folder of the pool's ranks (their start-up and between-call output)."""
        return self._ranks.folder.path if self._ranks else None

    @property
    def alive(self) -> bool:
        return self._ranks is not None and self._ranks.alive

    def start(self) -> "Pool":
        """Start the ranks (CUDA, process group) unless they run; blocks until ready."""
        self._start()
        return self

    def _start(self, stopped: Callable[[], bool] = lambda: False) -> bool:
        """``start``; False, with no ranks, when ``stopped()`` while waiting for free devices
        (the call that needed them was cancelled or preempted in the meantime)."""
        with self._lock:
            if self.alive:
                return True
            self._discard()
            placement = hardware.place(self._options.gpus, self._options.gpu_type)
            ranks = _Ranks.start(placement, self._options, self._keep_memory, stopped)
            if ranks is None:
                return False
            self._ranks = ranks
            self.placement = placement
            self.starts += 1
            return True

    def close(self) -> None:
        """Stop the ranks: they exit when their pipes close; whatever is left is killed. A
        call that was about to use the pool runs cold instead."""
        with self._lock:
            self._closed = True
            self._discard()

    def __repr__(self) -> str:
        state = f"{self.placement.nprocs} ranks, {'alive' if self.alive else 'stopped'}" if self.placement else "not started"
        return f"<gpufleet.Pool {state}>"

    def acquire(self, env: dict[str, str], stopped: Callable[[], bool]) -> _Ranks | None:
        """The ranks, ready for one attempt with the environment ``env`` (its launch plan's),
        started (again) first when needed; the pool is that attempt's until ``hand_back``.
        None, and the pool free, once it is closed, or when ``stopped()`` while its start
        waited for devices."""
        self._lock.acquire()
        try:
            ranks = self._ready(env, stopped)
        except BaseException:
            self._lock.release()
            raise
        if ranks is None:
            self._lock.release()
        return ranks

    def hand_back(self, failed: bool) -> None:
        """The attempt is over: an attempt that did not end well stops the ranks."""
        try:
            if failed:
                self._discard()
        finally:
            self._lock.release()

    def _ready(self, env: dict[str, str], stopped: Callable[[], bool]) -> _Ranks | None:
        if self._closed or stopped():  # stopped while another call had the pool
            return None
        why = self._stale(env)
        if why:
            log.warning(f"{why}; starting the pool's ranks again")
            self._discard()
        if not self._start(stopped):
            return None
        return self._ranks

    def _stale(self, env: dict[str, str]) -> str | None:
        """Why the running ranks cannot take the next call (None: they can)."""
        if self._ranks is None:
            return None
        if not self.alive:
            return "the pool's ranks stopped with the last call"
        edited = self._ranks.modules_changed()
        if edited:
            return f"{edited} changed since the pool's ranks imported it"
        changed = self._ranks.start_up_changes(env)
        if changed:
            return f"{', '.join(changed)} changed since the pool's ranks started"
        if not self._ranks.wait_ready(READY_TIMEOUT_SECONDS):
            return (f"the pool's ranks did not clean up after the last call within "
                    f"{READY_TIMEOUT_SECONDS:g} s (their log: {self._ranks.folder.log(0)})")
        return None

    def _discard(self) -> None:
        if self._ranks is not None:
            self._ranks.stop()
            self._ranks = None

    def _holder(self) -> str | None:
        """The name its devices are held under (``devices.holders``)."""
        return self._ranks.folder.name if self._ranks is not None else None

    def _serves(self, placement: Placement) -> bool:
        """Same device and number of ranks (a call's gpu_type was checked already)."""
        mine = self.placement
        return mine is not None and (mine.device, mine.nprocs) == (placement.device, placement.nprocs)


class _Ranks:
    """One start of a pool's ranks: the agent, its folder and the pipes to its ranks."""

    def __init__(self, folder: RunDir, agent: subprocess.Popen | template.Forked | None, pipes: list[int],
                 env: dict[str, str], lease: devices.Lease):
        self.folder = folder
        self.lease = lease  # the devices the ranks hold while they live
        self.agent = agent
        self.pipes = pipes
        self.env = env  # the environment the ranks started with (the launch plan's)
        self.nprocs = len(pipes)
        self.calls = 0  # handed over so far

    @classmethod
    def start(cls, placement: Placement, options: RunOptions, keep_memory: bool,
              stopped: Callable[[], bool]) -> "_Ranks | None":
        """The ranks, ready; None when ``stopped()`` while waiting for free devices."""
        called_at = time.time()
        folder = RunDir.create(options.runs_dir, "pool")
        write_private(folder.pool_owner, json.dumps(_process.this_process()).encode())
        for sub in ("orders", "ready"):
            (folder.path / sub).mkdir(mode=0o700)
        pipes: list[int] = []
        agent = None
        lease = devices.Lease()

        def waits(holders: list[str]) -> None:
            give_up_devices(holders)  # another pool of this process would hold them forever
            log.info(f"the pool waits for {placement.nprocs} free GPUs (held by "
                     f"{', '.join(sorted(set(holders)))})")

        try:
            if placement.takes_devices:
                held = devices.acquire(placement.nprocs, folder.name, waits, stopped)
                if held is None:  # the call was stopped first: the pool never started
                    shutil.rmtree(folder.path, ignore_errors=True)
                    return None
                lease = held
            for rank in range(placement.nprocs):
                os.mkfifo(folder.orders(rank), 0o600)
                # read-write: opening never blocks, and the ranks see end-of-file only when
                # this process closes it (or dies)
                pipes.append(os.open(folder.orders(rank), os.O_RDWR | os.O_CLOEXEC))
            mode = _environ.POOL_KEEP_MEMORY if keep_memory else "1"
            plan = local.plan(folder, placement, options, 0, {_environ.POOL: mode, **lease.env()})
            agent = local.launch(plan)
            job = LocalJob(agent, folder, placement.nprocs, keeps_ranks=True)
            Supervisor(job, options, Preemption(), {"call": called_at}, None, 0).wait()
        except BaseException:
            cls(folder, agent, pipes, {}, lease).stop()
            raise
        log.info(f"pool of {placement.nprocs} warm ranks ready in "
                 f"{time.time() - called_at:.1f} s ({folder.path})")
        return cls(folder, agent, pipes, plan.env, lease)

    def hand_over(self, run: RunDir, env: dict[str, str]) -> None:
        """Give the call in ``run`` to every rank, with the environment it would have had in
        a cold start: the variables that differ from the ranks' own (None: unset)."""
        env = {**env, **self.lease.env()}  # the pool's devices are the call's
        changes: dict[str, str | None] = {k: v for k, v in env.items() if self.env.get(k) != v}
        changes.update({k: None for k in self.env if k not in env})
        order = {"run": str(run.path), "env": changes, "cwd": os.getcwd()}
        line = json.dumps(order).encode() + b"\n"
        for pipe in self.pipes:
            os.write(pipe, line)
        self.calls += 1

    def wait_ready(self, timeout: float) -> bool:
        """Wait until every rank has cleaned up after the calls handed over so far."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.alive:
            if all(self._finished(rank) >= self.calls for rank in range(self.nprocs)):
                return True
            time.sleep(READY_POLL_SECONDS)
        return False

    @property
    def alive(self) -> bool:
        return self.agent is not None and self.agent.poll() is None

    def _finished(self, rank: int) -> int:
        try:
            return int(self.folder.ready(rank).read_text())
        except (OSError, ValueError):
            return -1

    def start_up_changes(self, env: dict[str, str]) -> list[str]:
        """The variables read when the ranks start that the call sets differently."""
        env = {**env, **self.lease.env()}
        names = {n for n in {*env, *self.env} if n in START_UP_VARIABLES or n.startswith(START_UP_PREFIXES)}
        return sorted(n for n in names if env.get(n) != self.env.get(n) and not _per_run(n))

    def modules_changed(self) -> str | None:
        """The first user module file edited since the ranks imported it, if any."""
        try:
            seen = json.loads(self.folder.modules.read_text())
        except (OSError, ValueError):
            return None
        for path, mtime in seen.items():
            try:
                if os.stat(path).st_mtime != mtime:
                    return path
            except OSError:
                continue
        return None

    def stop(self) -> None:
        for pipe in self.pipes:
            os.close(pipe)
        self.pipes = []
        if self.agent is not None:
            try:
                self.agent.wait(CLOSE_GRACE_SECONDS)
            except subprocess.TimeoutExpired:
                pass
            LocalJob(self.agent, self.folder, self.nprocs).release()
        self.lease.release()


class WarmLauncher(LocalLauncher):
    """Runs each attempt on a warm pool's ranks (``for_call``): only the payload travels. An
    attempt that finds no pool (closed meanwhile) starts cold, as ``LocalLauncher``."""

    def launch(self, plan: LaunchPlan) -> LocalJob:
        pool = for_call(self.options, self.placement)
        ranks = pool.acquire(plan.env, self.gate.stopped) if pool else None
        if pool is None or ranks is None:
            # closed meanwhile, or the run was stopped while the pool waited for devices
            # (then the cold path's own wait says so at once)
            return super().launch(plan)
        try:
            self.gate.begin(ranks.lease.ids)
            job = WarmJob(pool, ranks, plan.folder)
            job.stamps["pool_ready"] = time.time()  # after any (re)start of the pool's ranks
            ranks.hand_over(plan.folder, plan.env)
        except BaseException:
            pool.hand_back(failed=True)
            raise
        return job


class WarmJob(LocalJob):
    """One attempt on a pool's ranks: the pool's agent and folder, the attempt's reports."""

    def __init__(self, pool: Pool, ranks: _Ranks, attempt: RunDir):
        assert ranks.agent is not None  # a started pool's
        super().__init__(ranks.agent, attempt, ranks.nprocs, reports=ranks.folder, keeps_ranks=True)
        self.pool = pool

    def finished(self, failed: bool) -> None:
        self.pool.hand_back(failed)


def pool(
    gpus: int | None = None,
    *,
    gpu_type: str | None = None,
    runs_dir: str | os.PathLike | None = None,
    keep_memory: bool = False,
    start_timeout: float = DEFAULT_START_TIMEOUT,
) -> Pool:
    """Keep rank processes warm between calls: use as ``with gpufleet.pool(gpus=2): ...``.

    Inside the block, every ``.distributed()`` call whose placement matches the pool's (same
    number of GPUs, or CPU processes) runs on the pool's ranks, which keep their imports,
    CUDA context and process group; each call ships only its payload. Other calls start
    cold as usual. The ranks start when the block is entered and stop when it ends.

      gpus          ranks, one per GPU (None: every visible GPU; 2 CPU processes without one)
      gpu_type      check the GPU model, as in ``@distributed``
      runs_dir      where the pool's folder and its calls' run folders go
      keep_memory   keep the GPU memory PyTorch cached during a call for the next one
                    (default: released after every call)
      start_timeout seconds the ranks get to start

    A call that fails, times out, hangs or is interrupted stops the ranks; the next call
    starts them again. ``@distributed(warm=True)`` keeps a pool for the function without a
    ``with`` block.
    """
    return Pool(gpus, gpu_type=gpu_type, runs_dir=runs_dir, keep_memory=keep_memory, start_timeout=start_timeout)


def for_call(options: RunOptions, placement: Placement) -> Pool | None:
    """The pool a call runs on: the innermost ``with gpufleet.pool(...)`` that matches its
    placement (or the pool bound to this thread, first), else with ``warm=True`` the shared
    pool of that placement; None: start cold."""
    mine = getattr(_bound, "pool", None)
    if mine is not None and mine._serves(placement):
        return mine
    for candidate in reversed(_active):
        if candidate._serves(placement):
            return candidate
    if not options.warm:
        return None
    key = (placement.device, placement.nprocs)
    with _shared_lock:
        if key not in _shared:
            _shared[key] = Pool(placement.nprocs, runs_dir=options.runs_dir)
        return _shared[key]


def give_up_devices(holders: list[str]) -> None:
    """A call of this process waits for devices that its own pools hold, which nothing would
    ever free: close the shared pools of ``warm=True`` functions among them (they start again
    when next needed); a ``with gpufleet.pool()`` block's pool is an error naming it."""
    for active in _active:
        if active._holder() in holders:
            raise ConfigError(
                f"this call waits for GPUs that its own process's pool holds ({active}, "
                f"{active.folder}): run it with the pool's gpus={active.placement and active.placement.nprocs}, or "
                "outside the `with gpufleet.pool(...)` block"
            )
    with _shared_lock:
        for key, shared in list(_shared.items()):
            if shared._holder() in holders:
                log.info(f"closing the warm pool {shared.folder} to free its GPUs for "
                         "this call")
                shared.close()
                del _shared[key]


def _per_run(name: str) -> bool:
    """Set for each run by gpufleet itself (the flight recorder's files live in the run
    folder), so never a reason to start again."""
    return name in {"TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_PIPE_FILE"}


@atexit.register
def _close_shared() -> None:
    for shared in list(_shared.values()):
        shared.close()
    _shared.clear()
