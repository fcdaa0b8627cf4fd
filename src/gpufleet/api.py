"""The public decorator: ``@distributed(...)`` and the function object it returns."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from gpufleet import hardware, launchers, runtime
from gpufleet.errors import ConfigError
from gpufleet.options import RunOptions, check_world
from gpufleet.payload import dump_call, write_private
from gpufleet.rundir import RunDir
from gpufleet.supervisor import Supervisor

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
        ``timeout`` expires, and KeyboardInterrupt after stopping every rank on Ctrl-C.
        """
        opts = self._options
        placement = hardware.place(opts.gpus, opts.gpu_type)
        check_world(opts, placement.nprocs)
        payload = dump_call(self._fn, args, kwargs)
        run = RunDir.create(opts.runs_dir, self.__name__)
        write_private(run.payload, payload)
        if placement.device == "cpu":
            print(f"gpufleet: {placement.describe()}", file=sys.stderr, flush=True)
        launcher = launchers.get("local")
        agent = launcher.launch(launcher.plan(run, placement, opts), run)
        return Supervisor(run, agent, placement.nprocs, opts).wait()

    def __repr__(self) -> str:
        return f"<DistributedFunction {self.__qualname__} {self._options}>"


def distributed(fn: Callable[..., R] | None = None, /, **options: Any):
    """Make a function runnable on every GPU of this machine.

    Options (all keyword-only):
      gpus      number of processes, one per GPU; None = every visible GPU (2 CPU processes
                with gloo when no GPU is visible)
      gpu_type  check the GPU model ("H100", "H200", "A10", ...) before starting
      remote    run on a Ray cluster (not available yet)
      timeout   seconds for the whole call (default 3 hours); None disables it
      logs      which ranks' output is printed live: "all", "rank0", "none" or a list of ranks
      env       extra environment variables for every rank
      runs_dir  where run folders go (default ~/.gpufleet/runs, or $GPUFLEET_HOME/runs)

    Use as ``@distributed`` or ``@distributed(gpus=8, gpu_type="H100")``.
    """
    run_options = RunOptions.create(**options)
    if fn is None:
        return lambda f: DistributedFunction(f, run_options)
    return DistributedFunction(fn, run_options)
