"""The public decorator: ``@distributed(...)`` and the function object it returns."""

from __future__ import annotations

import contextlib
import functools
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Generic, TypeVar

from gpufleet import _environ, hardware, launchers, pools, runtime
from gpufleet.errors import ConfigError, RunFailedError, RunPreemptedError, RunTimeoutError
from gpufleet.options import RunOptions, check_world
from gpufleet.payload import dump_call, write_private
from gpufleet.rundir import RunDir
from gpufleet.supervisor import Preemption, Supervisor
from gpufleet.tracking import PendingTracking
from gpufleet.tracking import status_of as tracking_status

R = TypeVar("R")


class DistributedFunction(Generic[R]):
    """A function that runs as one process per GPU with ``.distributed(...)``.

    Calling it directly runs it here, in this process, undistributed.
    """

    def __init__(self, fn: Callable[..., R], options: RunOptions):
        if not callable(fn):
            raise ConfigError(
                f"@distributed decorates a function, got {fn!r} (of type {type(fn).__name__}); "
                "put it on a `def`"
            )
        self._fn = fn
        self._options = options
        self.last_run: Path | None = None  # the run folder of the last attempt started
        functools.update_wrapper(self, fn)

    @property
    def run_options(self) -> RunOptions:
        return self._options

    def __call__(self, *args: Any, **kwargs: Any) -> R:
        with runtime._direct_call():
            return self._fn(*args, **kwargs)

    def options(self, **changes: Any) -> "DistributedFunction[R]":
        """The same function with some options changed: ``train.options(gpus=1).distributed()``."""
        return DistributedFunction(self._fn, self._options.replace(**changes))

    def distributed(self, *args: Any, **kwargs: Any) -> list[R]:
        """Run on every rank; return each rank's value in global-rank order.

        Raises RunFailedError (root cause first) when any rank fails, RunTimeoutError when
        ``timeout`` expires, RunHangError when no rank made progress for ``hang_timeout``,
        RunPreemptedError after a SIGTERM to this process, and KeyboardInterrupt after
        stopping every rank on Ctrl-C. With ``max_retries``, a failed or hung run starts again
        (all ranks, a new port) before that.
        """
        called_at = time.time()
        opts = self._options
        if opts.remote:  # bad input fails before connecting to (or starting) a Ray cluster
            payload = dump_call(self._fn, args, kwargs)
            placement = launchers.get(opts.remote).place(opts)
            check_world(opts, placement.nprocs)
        else:
            placement = hardware.place(opts.gpus, opts.gpu_type)
            check_world(opts, placement.nprocs)
            payload = dump_call(self._fn, args, kwargs)
        if placement.device == "cpu":
            print(f"gpufleet: {placement.describe()}", file=sys.stderr, flush=True)
        deadline = None if opts.timeout is None else time.monotonic() + opts.timeout
        tracking = PendingTracking(opts.tracking, self.__name__, {
            "function": f"{self.__module__}.{self.__qualname__}",
            "gpus": placement.nprocs,
            "world_size": placement.nprocs,
            "device": placement.device,
        })
        outcome: BaseException | None = None
        try:
            with Preemption().installed() as preemption:
                return self._attempts(payload, placement, deadline, preemption, tracking, called_at)
        except BaseException as exc:
            outcome = exc
            raise
        finally:
            if tracking.enabled:
                tracking.close(tracking_status(outcome))

    def _attempts(
        self, payload: bytes, placement, deadline: float | None, preemption: Preemption, tracking,
        called_at: float,
    ) -> list[R]:
        opts = self._options
        earlier: list[RunFailedError] = []
        while True:
            try:
                # a retry's timings start with the retry
                since = called_at if not earlier else time.time()
                return self._run(payload, placement, len(earlier), deadline, preemption, tracking, since)
            except RunFailedError as error:
                if preemption.requested_at is not None or len(earlier) == opts.max_retries or not _retryable(error, opts.no_retry):
                    if not earlier:
                        raise
                    raise error.after(earlier) from error.__cause__
                earlier.append(error)
                print(
                    f"gpufleet: attempt {len(earlier)} of {opts.max_retries + 1} failed "
                    f"({error.root_line()}); starting every rank again",
                    file=sys.stderr,
                    flush=True,
                )

    def _run(
        self, payload: bytes, placement, attempt: int, deadline: float | None, preemption: Preemption,
        tracking: PendingTracking, called_at: float,
    ) -> list[R]:
        """One attempt: a run folder of its own, an agent, its ranks."""
        opts = self._options
        started_at = time.time()
        run = RunDir.create(opts.runs_dir, self.__name__)
        self.last_run = run.path
        write_private(run.payload, payload)
        launcher = launchers.get(opts.remote or "local")
        env = {_environ.TRACKED: "1"} if tracking.enabled else {}
        plan = launcher.plan(run, placement, opts, attempt, env)
        stamps = {"call": called_at, "attempt_started": started_at}
        if opts.remote:  # the ranks run on a cluster; the job stands for the agent
            job = launcher.launch(plan, run, deadline)
            return self._supervise(
                run, job, placement, preemption, stamps, tracking, attempt, deadline, monitor=job.monitor,
            )
        warm = pools.for_call(opts, placement)
        with warm._lease(plan.env) if warm else contextlib.nullcontext() as ranks:
            if ranks is None:  # no pool, or it closed meanwhile: start cold
                agent = launcher.launch(plan, run)
                return self._supervise(run, agent, placement, preemption, stamps, tracking, attempt, deadline)
            stamps["pool_ready"] = time.time()  # after any (re)start of the pool's ranks
            ranks.hand_over(run, plan.env)
            return self._supervise(
                run, ranks.agent, placement, preemption, stamps, tracking, attempt, deadline,
                ranks.folder,
            )

    def _supervise(
        self, run: RunDir, agent, placement, preemption: Preemption, stamps: dict, tracking,
        attempt: int, deadline: float | None, pool_folder: RunDir | None = None, monitor=None,
    ) -> list[R]:
        tracking.begin()  # created while the ranks start; the supervisor hands it over
        supervisor = Supervisor(
            run, agent, placement.nprocs, self._options, preemption, stamps,
            tracking if tracking.enabled else None, attempt,
            launcher=pool_folder, pooled=pool_folder is not None, monitor=monitor,
        )
        return supervisor.wait(deadline)

    def __repr__(self) -> str:
        return f"<DistributedFunction {self.__qualname__} {self._options}>"


def distributed(fn: Callable[..., R] | None = None, /, **options: Any):
    """Make a function runnable on every GPU of this machine, or of a Ray cluster.

    Options (all keyword-only):
      gpus      number of processes, one per GPU; None = every visible GPU (2 CPU processes
                with gloo when no GPU is visible). With remote=True: GPUs across the
                cluster's nodes, None = every GPU of the cluster
      gpu_type  check the GPU model ("H100", "H200", "A10", ...) before starting
      remote    True (or "ray"): run on a Ray cluster, ranks ordered by node then GPU
                (docs/cluster.md); False: this machine
      timeout   seconds for the whole call (default 3 hours); None disables it
      logs      which ranks' output is printed live: "all", "rank0", "none" or a list of ranks
      env       extra environment variables for every rank (on a Ray cluster the ranks get
                their node's environment plus these, not this process's)
      runs_dir  where run folders go (default ~/.gpufleet/runs, or $GPUFLEET_HOME/runs)
      max_retries  how many times a failed run starts again, all ranks together (default 0)
      no_retry  exception types (or names) whose failure is final, e.g. (ValueError,)
      hang_timeout  seconds without output or runtime.heartbeat() on any rank after which the
                run counts as hung: stacks collected, culprit named, run stopped (default 1800;
                None turns it off)
      grace_period  seconds ranks get to stop (runtime.should_stop()) after this process gets
                SIGTERM, before they are stopped (default 30)
      show_timings  print where each call's time went (start-up phases, the function, results);
                every run folder keeps them in timings.json either way
      tracking  MLflow: one run per call, shared with every rank (None: when MLflow is
                installed; True: require it; False: never)
      warm      keep the ranks alive after a call, so the next call ships only its payload
                (a gpufleet.pool shared by such functions; see gpufleet.pool)

    Options of remote runs (an error without remote=True):
      ray_address  the cluster: "HOST:6379", "ray://HOST:10001", "auto"; None: the connection
                this process has, else RAY_ADDRESS, else a new local Ray instance
      placement  "pack" (default: as few nodes as possible), "spread", "strict_pack" (one
                node) or "strict_spread" (one rank per node)
      placement_timeout  seconds to wait for enough free GPUs before failing (default 300);
                a cluster that has too few GPUs at all fails at once
      pip       True: install this environment's packages (pinned) on the workers through
                Ray's runtime_env; or a list of requirements; False (default): none
      runtime_env  Ray runtime_env fields merged into what gpufleet ships (gpufleet itself,
                your local modules, the working directory): e.g. {"working_dir": None},
                {"excludes": ["data/"]}, {"env_vars": {...}}, {"image_uri": ...}

    Use as ``@distributed`` or ``@distributed(gpus=8, gpu_type="H100")``.
    """
    run_options = RunOptions.create(**options)
    if fn is None:
        return lambda f: DistributedFunction(f, run_options)
    return DistributedFunction(fn, run_options)


def _retryable(error: RunFailedError, no_retry: tuple) -> bool:
    """A timeout ends the call (it bounds all attempts), a preemption too (this process is
    going away); so does a root cause in no_retry."""
    if isinstance(error, (RunTimeoutError, RunPreemptedError)):
        return False
    cause = error.__cause__
    if cause is not None:
        names = {type(cause).__name__, f"{type(cause).__module__}.{type(cause).__qualname__}"}
    else:  # the exception did not travel back: its name leads the summary line
        summary = error.root_cause.summary if error.root_cause else ""
        names = {summary.split(":", 1)[0], summary.split(":", 1)[0].rsplit(".", 1)[-1]}
    for kind in no_retry:
        if isinstance(kind, type) and isinstance(cause, kind):
            return False
        if isinstance(kind, str) and kind in names:
            return False
    return True
