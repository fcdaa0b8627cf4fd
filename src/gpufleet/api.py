"""The public decorator: ``@distributed(...)`` and the function object it returns."""

from __future__ import annotations

import functools
import inspect
import os
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Generic, NoReturn, TypeVar, overload

from gpufleet import runtime
from gpufleet.errors import ConfigError
from gpufleet.options import (
    DEFAULT_GRACE_PERIOD,
    DEFAULT_HANG_TIMEOUT,
    DEFAULT_PLACEMENT_TIMEOUT,
    DEFAULT_STRAGGLER_THRESHOLD,
    DEFAULT_TIMEOUT,
    KEEP,
    Duration,
    GPUs,
    Nodes,
    Ranks,
    RunOptions,
    Share,
    Unchanged,
    options_help,
)
from gpufleet.runs import cluster, execution, handles, sweep

if TYPE_CHECKING:
    from gpufleet.runs.handles import Run

NO_ENV: Mapping[str, str] = MappingProxyType({})  # env='s default: nothing added
NoRetry = Sequence[type[BaseException] | str] | type[BaseException] | str

R = TypeVar("R")


class DistributedFunction(Generic[R]):
    """A function that runs as one process per GPU with ``.distributed(...)``.

    Calling it directly runs it here, in this process, undistributed.
    """

    _fn: Callable[..., R]

    def __init__(self, fn: Callable[..., R], options: RunOptions):
        if isinstance(fn, DistributedFunction):  # decorated again: the new options win
            fn = fn._fn
        _check_callable(fn)
        if inspect.isroutine(fn):  # before our own attributes: it copies fn.__dict__
            functools.update_wrapper(self, fn)
        else:  # a callable instance: named by its class; its own state is not ours to copy
            functools.update_wrapper(self, fn, assigned=("__doc__",), updated=())
            self.__name__ = self.__qualname__ = type(fn).__name__
            self.__module__ = type(fn).__module__
        self._fn = fn
        self._options = options
        self.last_run: Path | None = None  # the folder of the last attempt started here

    @property
    def run_options(self) -> RunOptions:
        return self._options

    def __call__(self, *args: Any, **kwargs: Any) -> R:
        with runtime._direct_call():
            return self._fn(*args, **kwargs)

    def options(
        self, *,
        gpus: GPUs | Unchanged = KEEP, gpu_type: str | None | Unchanged = KEEP,
        remote: bool | str | Unchanged = KEEP, timeout: Duration | None | Unchanged = KEEP,
        logs: Ranks | Unchanged = KEEP, env: Mapping[str, str] | Unchanged = KEEP,
        runs_dir: str | os.PathLike[str] | None | Unchanged = KEEP,
        max_retries: int | Unchanged = KEEP, no_retry: NoRetry | Unchanged = KEEP,
        hang_timeout: Duration | None | Unchanged = KEEP, grace_period: Duration | Unchanged = KEEP,
        show_timings: bool | Unchanged = KEEP, step_telemetry: bool | Unchanged = KEEP,
        straggler_threshold: Share | Unchanged = KEEP, collapse_lines: bool | Unchanged = KEEP,
        tracking: bool | None | Unchanged = KEEP, join_mlflow_run: bool | Unchanged = KEEP,
        warm: bool | Unchanged = KEEP, ray_address: str | None | Unchanged = KEEP,
        placement: str | Unchanged = KEEP, placement_timeout: Duration | Unchanged = KEEP,
        pip: bool | Sequence[str] | Unchanged = KEEP,
        runtime_env: Mapping[str, Any] | None | Unchanged = KEEP,
        name: str | None | Unchanged = KEEP, detach: bool | Unchanged = KEEP,
        nnodes: Nodes | Unchanged = KEEP,
        node_rank: int | None | Unchanged = KEEP, rdzv_endpoint: str | None | Unchanged = KEEP,
        rdzv_id: str | None | Unchanged = KEEP,
        **unknown: NoReturn,
    ) -> "DistributedFunction[R]":
        """The same function with some options changed: ``train.options(gpus=1).distributed()``.
        The options are those of ``@distributed``; an option not given keeps its value."""
        given = {k: v for k, v in locals().items() if k not in ("self", "unknown") and v is not KEEP}
        given.update(unknown)  # named in a ConfigError with the valid options
        return DistributedFunction(self._fn, self._options.replace(**given))

    def distributed(self, *args: Any, **kwargs: Any) -> list[R]:
        """Run on every rank; return each rank's value in global-rank order.

        Raises RunFailedError (root cause first) when any rank fails, RunTimeoutError when
        ``timeout`` expires, RunHangError when no rank made progress for ``hang_timeout``,
        RunPreemptedError after a SIGTERM to this process, and KeyboardInterrupt after
        stopping every rank on Ctrl-C. With ``max_retries``, a failed or hung run starts again
        (all ranks, a new port) before that. The run's record stays in the runs folder
        (``gpufleet runs``); while other runs hold this machine's GPUs it waits its turn.
        """
        if self._options.detach:
            raise ConfigError(
                "detach=True applies to .submit(), which returns at once; .distributed() waits "
                "for the run here: drop detach, or call .submit()"
            )
        call = self._prepare(args, kwargs)
        address = cluster.jobs_address(call, submitting=False)
        if address is not None:  # a Ray Jobs address: the run is supervised on the cluster
            return cluster.submit(call, address).follow()
        record = call.record(detached=False)
        record.supervised_here()
        return execution.execute(call, record, on_attempt=self._started)

    def submit(self, *args: Any, **kwargs: Any) -> "Run":
        """Start the run in the background and return its handle at once (``gpufleet.Run``:
        status, wait, result, logs, cancel). The run ends with this process unless the
        function has ``detach=True``; then it goes on and ``gpufleet.attach(run.id)`` finds it
        from any process."""
        call = self._prepare(args, kwargs)
        return handles.submit(call)

    def map(self, inputs: Iterable[Any], *, max_concurrent: int | None = None, fail_fast: bool = False,
            return_exceptions: bool = False, metric: str | None = None, mode: str = "min",
            name: str | None = None, warm: bool = True) -> list[list[R] | BaseException]:
        """One run per input (a keyword dict, an argument tuple, or one argument), each on GPUs
        of its own, ``max_concurrent`` at a time (default: as many as fit on this machine's
        GPUs); every trial's values (a list per trial, in input order) once all ended. A failed
        trial does not stop the others unless ``fail_fast``; its error is raised at the end,
        or with ``return_exceptions=True`` stands in its place. ``gpufleet.sweep`` takes the
        same arguments and returns at once, with the trials' run handles and a live view."""
        return sweep.sweep(self, inputs, max_concurrent=max_concurrent, fail_fast=fail_fast, metric=metric,
                           mode=mode, name=name, warm=warm).results(return_exceptions)

    def _prepare(self, args: tuple, kwargs: dict, **more: Any) -> execution.Call:
        """The call, checked; ``more``: ``Call`` fields such as a sweep's MLflow parent and params."""
        return execution.Call.prepare(
            self._fn, args, kwargs, self._options, self.__name__, f"{self.__module__}.{self.__qualname__}", **more,
        )

    def _started(self, attempt: Path) -> None:
        self.last_run = attempt

    def __repr__(self) -> str:
        return f"<DistributedFunction {self.__qualname__} {self._options}>"


def _check_callable(fn: Any) -> None:
    """Refuse, before any rank starts, what cannot run as a rank's function."""
    if not callable(fn):
        raise ConfigError(
            f"@distributed decorates a function, got {fn!r} (of type {type(fn).__name__}); "
            "put it on a `def`"
        )
    targets = (fn, getattr(type(fn), "__call__", fn))  # a function (or partial), an instance
    name = getattr(fn, "__qualname__", type(fn).__name__)
    if any(inspect.isasyncgenfunction(t) or inspect.iscoroutinefunction(t) for t in targets):
        raise ConfigError(
            f"{name} is an `async def` function, whose call only makes a coroutine that no rank "
            "would run; decorate a plain `def` that calls asyncio.run(...) on it"
        )
    if any(inspect.isgeneratorfunction(t) for t in targets):
        raise ConfigError(
            f"{name} is a generator function (it yields), whose call only makes a generator "
            "that no rank would run; return a list of the values instead of yielding them"
        )


@overload
def distributed(fn: Callable[..., R], /) -> DistributedFunction[R]: ...


@overload
def distributed(
    fn: None = None, /, *,
    gpus: GPUs = None, gpu_type: str | None = None, remote: bool | str = False,
    timeout: Duration | None = DEFAULT_TIMEOUT, logs: Ranks = "all",
    env: Mapping[str, str] = NO_ENV, runs_dir: str | os.PathLike[str] | None = None,
    max_retries: int = 0, no_retry: NoRetry = (), hang_timeout: Duration | None = DEFAULT_HANG_TIMEOUT,
    grace_period: Duration = DEFAULT_GRACE_PERIOD, show_timings: bool = False,
    step_telemetry: bool = True, straggler_threshold: Share = DEFAULT_STRAGGLER_THRESHOLD,
    collapse_lines: bool = True, tracking: bool | None = None, join_mlflow_run: bool = False,
    warm: bool = False, ray_address: str | None = None,
    placement: str = "pack", placement_timeout: Duration = DEFAULT_PLACEMENT_TIMEOUT,
    pip: bool | Sequence[str] = False, runtime_env: Mapping[str, Any] | None = None,
    name: str | None = None, detach: bool = False,
    nnodes: Nodes = None, node_rank: int | None = None,
    rdzv_endpoint: str | None = None, rdzv_id: str | None = None,
) -> Callable[[Callable[..., R]], DistributedFunction[R]]: ...


def distributed(
    fn: Callable[..., R] | None = None, /, **options: Any,
) -> DistributedFunction[R] | Callable[[Callable[..., R]], DistributedFunction[R]]:
    # **options, not the keywords with their defaults: only what the caller wrote counts as
    # given, and a given option beats the config file even where it equals the built-in
    # default (the overload above is the signature type checkers and help() show)
    run_options = RunOptions.create(**options)  # an unknown name: a ConfigError naming it
    if fn is None:
        return lambda f: DistributedFunction(f, run_options)
    return DistributedFunction(fn, run_options)


def _shown_signature() -> inspect.Signature:
    """The keyword overload's signature, with ``fn`` as the implementation takes it."""
    keywords = inspect.signature(typing.get_overloads(distributed)[-1])
    fn, *options = keywords.parameters.values()
    return keywords.replace(parameters=[fn.replace(annotation="Callable[..., R] | None"), *options],
                            return_annotation="DistributedFunction[R] | Callable[[Callable[..., R]], "
                            "DistributedFunction[R]]")


distributed.__signature__ = _shown_signature()  # type: ignore[attr-defined]


distributed.__doc__ = f"""Make a function runnable on every GPU of this machine, or of a Ray cluster.

Use as ``@distributed`` or ``@distributed(gpus=8, gpu_type="H100")``, on a function or a
callable instance; generator and ``async def`` functions are refused (no rank could run what
their call returns). Durations are seconds, or text such as "90s", "30m", "2h", "7d". The
defaults of timeouts, logs, tracking, retries and the runs folder can be set once in
``$GPUFLEET_HOME/config.yaml`` (docs/options.md).

Options (all keyword-only; the same as `gpufleet run`'s flags and a workload file's fields):
{options_help()}
"""
