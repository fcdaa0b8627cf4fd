"""Sweeps: one run per input, ``max_concurrent`` at a time, each on GPUs of its own.

    sweep = gpufleet.sweep(train.options(gpus=1), [{"lr": 1e-3}, {"lr": 3e-4}], metric="loss")
    sweep.wait(); sweep.best().run.id

Each trial is an ordinary run of the runs folder (its record, attempts, retries, MLflow run),
supervised by a worker thread of the calling process, as ``.distributed()`` supervises a
call. A worker runs its trials one after the other on a warm pool of its own (the ranks start
once per worker, not once per trial); the devices queue gives each worker's pool GPUs of its
own, so trials of 1 GPU on an 8-GPU machine run eight at a time. With ``remote=True`` the
trials are Ray runs, placed by the cluster. The sweep has an MLflow run of its own whose
children are the trials' runs; the best trial is tagged. docs/sweeps.md has the user's view.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import threading
import time
import weakref
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TextIO

from gpufleet import tracking
from gpufleet._log import log, speaking_for
from gpufleet.errors import ConfigError, GpufleetError, RunCancelledError
from gpufleet.launchers import hardware, warm
from gpufleet.payload import write_private
from gpufleet.runs import execution
from gpufleet.runs.handles import Run
from gpufleet.watch.progress import number

if TYPE_CHECKING:
    from gpufleet.api import DistributedFunction

QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELLED = "queued", "running", "succeeded", "failed", "cancelled"
ENDED = (SUCCEEDED, FAILED, CANCELLED)
SUMMARY_EVERY_S = 30.0  # a line on the running trials' metrics, between the lines of changes
WAIT_POLL_S = 0.2
REMOTE_AT_ONCE = 16  # a remote sweep's default max_concurrent: trials waiting on the cluster at once


@dataclass
class Trial:
    """One input of a sweep and its run."""

    index: int
    args: tuple
    kwargs: dict
    status: str = QUEUED
    run: Run | None = field(default=None, repr=False)  # once it started: its handle (id, logs, progress)
    values: list | None = field(default=None, repr=False)  # every rank's return value, once it succeeded
    error: BaseException | None = field(default=None, repr=False)  # once it failed or was cancelled
    metrics: dict[str, float] = field(default_factory=dict)  # rank 0's last log_metrics
    seconds: float | None = None

    def result(self) -> list:
        """Every rank's value, or the trial's error raised."""
        if self.error is not None:
            raise self.error
        if self.values is None:
            raise GpufleetError(f"trial {self.index} is {self.status}: it has no result yet")
        return self.values

    def params(self) -> dict[str, Any]:
        """The trial's input as MLflow params: its plain values (numbers, text, booleans)."""
        given = {**{f"arg{i}": v for i, v in enumerate(self.args)}, **self.kwargs}
        return {k: v for k, v in given.items() if isinstance(v, (str, int, float, bool)) or v is None}

    def describe(self) -> str:
        shown = ", ".join(f"{k}={v!r}" for k, v in self.kwargs.items())
        return ", ".join(filter(None, [", ".join(map(repr, self.args)), shown]))


class Sweep:
    """The trials of ``gpufleet.sweep``, running in the background: ``wait``, ``results``,
    ``best``, ``cancel``; ``trials`` in input order."""

    def __init__(self, fn: "DistributedFunction", inputs: Iterable[Any], *, max_concurrent: int | None = None,
                 fail_fast: bool = False, metric: str | None = None, mode: str = "min",
                 name: str | None = None, warm: bool = True, out: TextIO | None = None):
        from gpufleet.api import DistributedFunction

        if not isinstance(fn, DistributedFunction):
            raise ConfigError(f"a sweep runs a @distributed function, got {fn!r}: decorate it with "
                              "@gpufleet.distributed first")
        self.trials = [Trial(i, *_arguments(i, item)) for i, item in enumerate(inputs)]
        if not self.trials:
            raise ConfigError("a sweep needs at least one input: pass a list of keyword dicts or argument tuples")
        if mode not in ("min", "max"):
            raise ConfigError(f"mode={mode!r} must be 'min' (the smallest metric is best) or 'max'")
        if metric is not None and (not isinstance(metric, str) or not metric):
            raise ConfigError(f"metric={metric!r} must be the name of a metric the trials log with "
                              "gpufleet.log_metrics, e.g. metric='val_loss'")
        self.name = name or fn.run_options.name or fn.__name__
        self.metric, self.mode, self.fail_fast = metric, mode, fail_fast
        # each trial is named "<sweep>-<index>", and is a child of the sweep's MLflow run
        self._fn = fn.options(name=None, join_mlflow_run=False)
        self._placement = self._fn._prepare(self.trials[0].args, self.trials[0].kwargs).placement  # checks options
        self.max_concurrent = _concurrency(max_concurrent, fn, self._placement, len(self.trials))
        self._warm = warm and not fn.run_options.remote and not fn.run_options.warm
        self._lock = threading.Lock()
        self._next = 0
        self._stopping = False
        self._changed = threading.Event()
        self._caller_run = tracking.callers_run()  # read in the caller's thread: MLflow's active run is per thread
        self._parent = _ParentRun.open(self.name, fn, self)
        _running.add(self)
        self._view = _View(self, out)
        self._workers = [threading.Thread(target=self._work, name=f"gpufleet-sweep-{i}", daemon=True)
                         for i in range(self.max_concurrent)]
        for worker in self._workers:
            worker.start()
        self._watcher = threading.Thread(target=self._watch, name="gpufleet-sweep-view", daemon=True)
        self._watcher.start()

    # -- what the caller asks ----------------------------------------------------------------

    def done(self) -> bool:
        return all(trial.status in ENDED for trial in self.trials)

    def wait(self, timeout: float | None = None) -> "Sweep":
        """Block until every trial ended; Ctrl-C cancels the trials (then re-raises)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while not self.done():
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"sweep {self.name!r} still has {self.counts()} after {timeout:g} s")
                time.sleep(WAIT_POLL_S)
            for thread in (*self._workers, self._watcher):  # pools closed, MLflow run ended
                thread.join()
        except KeyboardInterrupt:
            self.cancel()
            raise
        return self

    def results(self, return_exceptions: bool = False, timeout: float | None = None) -> list:
        """Each trial's values (every rank's, a list) in input order, once all ended. A failed
        trial raises its error (the first in input order), or with ``return_exceptions=True``
        stands in the list as its error."""
        self.wait(timeout)
        if return_exceptions:
            return [trial.values if trial.error is None else trial.error for trial in self.trials]
        return [trial.result() for trial in self.trials]

    def best(self) -> Trial | None:
        """The succeeded trial with the best last value of ``metric`` so far (None: none yet)."""
        metric = self.metric
        if metric is None:
            raise ConfigError("best() ranks trials by a metric: pass metric='...' to the sweep")
        scored = [t for t in self.trials if t.status == SUCCEEDED and _finite(t.metrics.get(metric))]
        if not scored:
            return None
        pick = min if self.mode == "min" else max
        return pick(scored, key=lambda t: t.metrics[metric])

    def cancel(self) -> None:
        """No trial starts any more; the running ones are cancelled (their ranks stopped)."""
        with self._lock:
            self._stopping = True
            for trial in self.trials:
                if trial.status == QUEUED:
                    trial.status, trial.error = CANCELLED, RunCancelledError(
                        [], run_dir="", world_size=0, headline=f"sweep {self.name!r} was cancelled before it started")
            running = [t.run for t in self.trials if t.status == RUNNING and t.run is not None]
        for run in running:
            with contextlib.suppress(GpufleetError, TimeoutError, OSError):
                run.cancel()
        self._changed.set()

    def counts(self) -> str:
        by = {s: sum(t.status == s for t in self.trials) for s in (RUNNING, QUEUED, *ENDED)}
        done = by[SUCCEEDED] + by[FAILED] + by[CANCELLED]
        extra = ", ".join(f"{by[s]} {s}" for s in (FAILED, CANCELLED) if by[s])
        return f"{by[RUNNING]} running, {by[QUEUED]} queued, {done} done" + (f" ({extra})" if extra else "")

    def __len__(self) -> int:
        return len(self.trials)

    def __repr__(self) -> str:
        return f"<gpufleet.Sweep {self.name!r}: {self.counts()}>"

    # -- the workers -------------------------------------------------------------------------

    def _take(self) -> Trial | None:
        with self._lock:
            while self._next < len(self.trials):
                trial = self.trials[self._next]
                self._next += 1
                if trial.status == QUEUED and not self._stopping:
                    trial.status = RUNNING
                    return trial
            return None

    def _work(self) -> None:
        trial = self._take()
        if trial is None:
            return
        with speaking_for(f"sweep {self.name!r}"), self._pool():  # a failed trial's ranks start again for the next
            while trial is not None:
                self._run(trial)
                self._changed.set()
                trial = self._take()

    @contextlib.contextmanager
    def _pool(self) -> Iterator[warm.Pool | None]:
        """This worker's warm ranks, started for its first trial; None: its trials start cold."""
        if not self._warm:
            yield None
            return
        pool = warm.Pool(self._placement.nprocs, runs_dir=self._fn.run_options.runs_dir)
        with warm.bound(pool):
            pool.start()
            yield pool

    def _run(self, trial: Trial) -> None:
        started = time.monotonic()
        fn = self._fn.options(name=f"{self.name}-{trial.index}")
        try:
            with speaking_for(f"trial {trial.index} of {self.name!r}"):
                call = fn._prepare(trial.args, trial.kwargs, caller_run=self._parent.run_id or self._caller_run,
                                   params={"sweep": self.name, "trial": trial.index, **trial.params()})
                record = call.record(detached=False)
                record.supervised_here()
                trial.run = Run(record)
                if self._stopping:  # cancelled meanwhile: the run ends before it starts
                    write_private(record.cancel_request, b"cancel\n")
                self._changed.set()
                trial.values = execution.execute(call, record)
                trial.status = SUCCEEDED
        except BaseException as exc:  # noqa: BLE001 -- a trial's end, whatever it is, is the trial's
            trial.error = exc
            trial.status = CANCELLED if isinstance(exc, RunCancelledError) else FAILED
            if not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit: this process ends
                self.cancel()
        finally:
            trial.seconds = time.monotonic() - started
            if trial.run is not None:
                trial.metrics = dict(trial.run.progress()[1]) or trial.metrics
        if trial.status == FAILED and self.fail_fast:
            log.warning(f"trial {trial.index} of sweep {self.name!r} failed; fail_fast=True: cancelling the others")
            self.cancel()

    # -- the view ----------------------------------------------------------------------------

    def _watch(self) -> None:
        """Follow the running trials' metrics, say each change, close the sweep's MLflow run."""
        try:
            while True:
                ended = self.done()
                for trial in self.trials:
                    if trial.status == RUNNING and trial.run is not None:
                        trial.metrics = dict(trial.run.progress()[1]) or trial.metrics
                self._view.update()
                if ended:
                    break
                self._changed.wait(1.0)
                self._changed.clear()
        finally:
            self._parent.close(self)
            _running.discard(self)


_running: "weakref.WeakSet[Sweep]" = weakref.WeakSet()


@atexit.register
def _cancel_running() -> None:
    """A process that ends stops its sweeps' trials first (their workers are daemon threads)."""
    for running in list(_running):
        running.cancel()


def sweep(fn: "DistributedFunction", inputs: Iterable[Any], *, max_concurrent: int | None = None,
          fail_fast: bool = False, metric: str | None = None, mode: str = "min", name: str | None = None,
          warm: bool = True, out: TextIO | None = None) -> Sweep:
    """Run ``fn`` once per input, in the background; returns the ``Sweep`` at once.

      inputs          keyword dicts (``{"lr": 1e-3}``), argument tuples (``(1e-3, 64)``), or
                      single values (one positional argument each)
      max_concurrent  trials at once (default: as many as fit: this machine's GPUs divided by
                      each trial's gpus, 1 without GPUs; with remote=True, up to 16, placed by
                      the cluster as its GPUs free up)
      fail_fast       the first failed trial cancels the others (default: they go on)
      metric, mode    the metric (``gpufleet.log_metrics``, rank 0's last value) that ranks the
                      trials: ``best()``, the view's "best so far", the MLflow tag; "min" or "max"
      name            the sweep's name (default: the function's); trials are NAME-0, NAME-1, ...
      warm            each worker keeps its ranks alive between its trials (a pool)
      out             where the sweep's view goes (default: stderr)
    """
    return Sweep(fn, inputs, max_concurrent=max_concurrent, fail_fast=fail_fast, metric=metric, mode=mode,
                 name=name, warm=warm, out=out)


def _arguments(index: int, item: Any) -> tuple[tuple, dict]:
    if isinstance(item, dict):
        if not all(isinstance(k, str) for k in item):
            raise ConfigError(f"input {index} of the sweep, {item!r}, has keys that are not argument names")
        return (), dict(item)
    if isinstance(item, tuple):
        return item, {}
    return (item,), {}


def _concurrency(given: int | None, fn: "DistributedFunction", placement: hardware.Placement, trials: int) -> int:
    if given is not None:
        if isinstance(given, bool) or not isinstance(given, int) or given < 1:
            raise ConfigError(f"max_concurrent={given!r} must be a whole number of trials at once, 1 or more")
        return min(given, trials)
    if fn.run_options.remote:  # the cluster's placement groups pack them; each waits for its GPUs
        return min(trials, REMOTE_AT_ONCE)
    slots = placement.virtual or (hardware.visible_gpu_count() if placement.device == "cuda" else 0)
    return max(1, min(trials, slots // placement.nprocs))


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class _View:
    """The sweep's live view: a line at each change (a trial started or ended, a new best),
    and a summary of the running trials' metrics every SUMMARY_EVERY_S."""

    def __init__(self, owner: Sweep, out: TextIO | None):
        self.owner = owner
        self.out = out
        self.seen: dict[int, str] = {}
        self.best: tuple[int, float] | None = None
        self.summary_at = time.monotonic() + SUMMARY_EVERY_S
        self.counts = ""

    def update(self) -> None:
        sweep = self.owner
        lines = []
        for trial in sweep.trials:
            shown = f"{trial.status}:{trial.run.id if trial.run else ''}"
            if self.seen.get(trial.index) == shown or (trial.status == RUNNING and trial.run is None):
                continue
            self.seen[trial.index] = shown
            if trial.status == RUNNING and trial.run is not None:
                lines.append(f"trial {trial.index} ({trial.describe()}) started: run {trial.run.id}")
            elif trial.status != QUEUED:
                lines.append(self._ended(trial))
        metric = sweep.metric
        best = sweep.best() if metric else None
        if metric and best is not None and (self.best is None or self.best[0] != best.index):
            self.best = (best.index, best.metrics[metric])
            lines.append(f"best so far: trial {best.index} ({best.describe()}), {metric}={number(self.best[1])}")
        if time.monotonic() >= self.summary_at:
            self.summary_at = time.monotonic() + SUMMARY_EVERY_S
            lines += [f"  trial {t.index}: {_metrics(t.metrics, sweep.metric)}" for t in sweep.trials
                      if t.status == RUNNING and t.metrics]
        counts = sweep.counts()
        if counts != self.counts:
            self.counts = counts
            lines.append(counts)
        if lines:
            self._say([f"sweep {sweep.name!r}: {line}" for line in lines])

    def _ended(self, trial: Trial) -> str:
        took = f" in {trial.seconds:.1f} s" if trial.seconds is not None else ""
        if trial.status == SUCCEEDED:
            shown = _metrics(trial.metrics, self.owner.metric)
            return f"trial {trial.index} succeeded{took}" + (f" ({shown})" if shown else "")
        error = trial.error
        why = (getattr(error, "root_line", None) or (lambda: f"{type(error).__name__}: {error}"))()
        return f"trial {trial.index} {trial.status}{took}: {why}"

    def _say(self, lines: Sequence[str]) -> None:
        import sys

        out = self.out or sys.stderr
        out.write("".join(f"gpufleet: {line}\n" for line in lines))
        out.flush()


def _metrics(metrics: dict[str, float], first: str | None) -> str:
    names = sorted(metrics, key=lambda k: (k != first, k))[:4]
    return ", ".join(f"{k}={number(metrics[k])}" for k in names)


class _ParentRun:
    """The sweep's own MLflow run: the trials' runs are its children (``mlflow.parentRunId``),
    the best one tagged ``gpufleet.best_trial``; a child of the run the caller is in, if any."""

    def __init__(self, client: Any = None, run_id: str | None = None):
        self.client, self.run_id = client, run_id

    @classmethod
    def open(cls, name: str, fn: "DistributedFunction", sweep: Sweep) -> "_ParentRun":
        if not tracking.wanted(fn.run_options.tracking):
            return cls()
        try:
            from mlflow import MlflowClient

            uri = tracking.store_uri()
            client = MlflowClient(uri)
            run = tracking.Tracking.create(client, uri, name, sweep._caller_run, {"gpufleet.sweep": name})
            params = {"trials": len(sweep.trials), "max_concurrent": sweep.max_concurrent, "metric": sweep.metric,
                      "mode": sweep.mode, "function": f"{fn.__module__}.{fn.__qualname__}"}
            for key, value in params.items():
                client.log_param(run.run_id, key, value)
            return cls(client, run.run_id)
        except Exception as exc:  # the sweep goes on; its trials are tracked each on its own
            log.warning(f"sweep {name!r} has no MLflow run of its own ({type(exc).__name__}: {exc})")
            return cls()

    def close(self, sweep: Sweep) -> None:
        if self.run_id is None:
            return
        statuses = {t.status for t in sweep.trials}
        status = "FINISHED" if statuses == {SUCCEEDED} else "KILLED" if CANCELLED in statuses else "FAILED"
        with contextlib.suppress(Exception):
            metric = sweep.metric
            best = sweep.best() if metric else None
            if metric and best is not None and best.run is not None:
                child = best.run.record().get("mlflow_run_id")
                self.client.set_tag(self.run_id, "gpufleet.best_trial", str(best.index))
                self.client.log_metric(self.run_id, f"best_{metric}", best.metrics[metric])
                if child:
                    self.client.set_tag(self.run_id, "gpufleet.best_run_id", child)
                    self.client.set_tag(child, "gpufleet.best_trial", "true")
            counts = {s: sum(t.status == s for t in sweep.trials) for s in ENDED}
            for state, count in counts.items():
                self.client.log_metric(self.run_id, f"trials_{state}", count)
        with contextlib.suppress(Exception):
            self.client.set_terminated(self.run_id, status)
