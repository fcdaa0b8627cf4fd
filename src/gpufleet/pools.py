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
import subprocess
import sys
import threading
import time
from pathlib import Path

from gpufleet import _environ, _process, hardware
from gpufleet.errors import ConfigError
from gpufleet.hardware import Placement
from gpufleet.launchers import local
from gpufleet.options import RunOptions
from gpufleet.rundir import RunDir, read_pid
from gpufleet.supervisor import Preemption, Supervisor

CLOSE_GRACE_SECONDS = 10.0
DEFAULT_START_TIMEOUT = 600.0

_active: list["Pool"] = []  # pools entered with `with`, innermost last
_shared: dict[tuple, "Pool"] = {}  # the pools of warm=True functions, by placement
_shared_lock = threading.Lock()


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
        self._options = RunOptions.create(
            gpus=gpus, gpu_type=gpu_type, runs_dir=runs_dir, timeout=start_timeout, hang_timeout=None
        )
        self._keep_memory = keep_memory
        self._lock = threading.RLock()  # one call at a time
        self._ranks: _Ranks | None = None
        self.placement: Placement | None = None
        self.starts = 0  # how many times the ranks were started (1 + rebuilds)

    def __enter__(self) -> "Pool":
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
        return self._ranks is not None and self._ranks.agent.poll() is None

    def start(self) -> "Pool":
        """Start the ranks (CUDA, process group) unless they run; blocks until ready."""
        with self._lock:
            if self.alive:
                return self
            self._discard()
            placement = hardware.place(self._options.gpus, self._options.gpu_type)
            self._ranks = _Ranks.start(placement, self._options, self._keep_memory)
            self.placement = placement
            self.starts += 1
            return self

    def close(self) -> None:
        """Stop the ranks: they exit when their pipes close; whatever is left is killed."""
        with self._lock:
            self._discard()

    def __repr__(self) -> str:
        state = f"{self.placement.nprocs} ranks, {'alive' if self.alive else 'stopped'}" if self.placement else "not started"
        return f"<gpufleet.Pool {state}>"

    @contextlib.contextmanager
    def _lease(self):
        """The ranks, for one call; started (again) first when needed. A call that does not
        end well stops them."""
        with self._lock:
            edited = self._ranks.modules_changed() if self.alive else None
            if edited:
                print(
                    f"gpufleet: {edited} changed since the pool's ranks imported it; "
                    "starting the ranks again",
                    file=sys.stderr, flush=True,
                )
                self._discard()
            elif self._ranks is not None and not self.alive:
                print(
                    "gpufleet: the pool's ranks stopped with the last call; starting them again",
                    file=sys.stderr, flush=True,
                )
            self.start()
            ranks = self._ranks
            try:
                yield ranks
            except BaseException:
                self._discard()
                raise

    def _discard(self) -> None:
        if self._ranks is not None:
            self._ranks.stop()
            self._ranks = None

    def _serves(self, placement: Placement) -> bool:
        return self.placement is None or self.placement == placement


class _Ranks:
    """One start of a pool's ranks: the agent, its folder and the pipes to its ranks."""

    def __init__(self, folder: RunDir, agent: subprocess.Popen, pipes: list[int], env: dict[str, str]):
        self.folder = folder
        self.agent = agent
        self.pipes = pipes
        self.env = env  # the environment the ranks started with (the launch plan's)
        self.nprocs = len(pipes)

    @classmethod
    def start(cls, placement: Placement, options: RunOptions, keep_memory: bool) -> "_Ranks":
        called_at = time.time()
        folder = RunDir.create(options.runs_dir, "pool")
        (folder.path / "orders").mkdir(mode=0o700)
        pipes = []
        for rank in range(placement.nprocs):
            os.mkfifo(folder.orders(rank), 0o600)
            # read-write: opening never blocks, and the ranks see end-of-file only when
            # this process closes it (or dies)
            pipes.append(os.open(folder.orders(rank), os.O_RDWR | os.O_CLOEXEC))
        mode = _environ.POOL_KEEP_MEMORY if keep_memory else "1"
        plan = local.plan(folder, placement, options, 0, {_environ.POOL: mode})
        agent = local.launch(plan, folder)
        ranks = cls(folder, agent, pipes, plan.env)
        supervisor = Supervisor(
            folder, agent, placement.nprocs, options, Preemption(), {"call": called_at}, None, 0,
            pooled=True,
        )
        try:
            supervisor.wait()
        except BaseException:
            ranks.stop()
            raise
        print(
            f"gpufleet: pool of {placement.nprocs} warm ranks ready in "
            f"{time.time() - called_at:.1f} s ({folder.path})",
            file=sys.stderr, flush=True,
        )
        return ranks

    def hand_over(self, run: RunDir, env: dict[str, str]) -> None:
        """Give the call in ``run`` to every rank, with the environment it would have had in
        a cold start: the variables that differ from the ranks' own (None: unset)."""
        changes: dict[str, str | None] = {k: v for k, v in env.items() if self.env.get(k) != v}
        changes.update({k: None for k in self.env if k not in env})
        order = json.dumps({"run": str(run.path), "env": changes}).encode() + b"\n"
        for pipe in self.pipes:
            os.write(pipe, order)

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
        try:
            self.agent.wait(CLOSE_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            pass
        for rank in range(self.nprocs):
            pid = read_pid(self.folder.pid_file(rank))
            if pid is not None:
                _process.kill_group(pid)
        _process.kill_group(self.agent.pid)
        self.agent.wait()


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
    placement, else with ``warm=True`` the shared pool of that placement; None: start cold."""
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


@atexit.register
def _close_shared() -> None:
    for shared in list(_shared.values()):
        shared.close()
    _shared.clear()
