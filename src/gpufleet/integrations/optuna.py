"""Optuna studies whose trials are gpufleet runs.

    import optuna
    from optuna.distributions import FloatDistribution
    from gpufleet.integrations.optuna import optimize

    study = optuna.create_study(direction="minimize", pruner=optuna.pruners.MedianPruner())
    optimize(study, train.options(gpus=1), {"lr": FloatDistribution(1e-4, 1e-1, log=True)},
             metric="val_loss", n_trials=20, max_concurrent=8)

Each trial is ``study.ask()``; the search space turns it into keyword arguments, and the
``@distributed`` function runs with them in the background (``fn.submit``), so every trial
is a run with a record, logs and an id (the trial's user attribute ``gpufleet_run_id``). One
loop in the calling thread drives every trial: it starts trials while fewer than
``max_concurrent`` run (gpufleet's device queue packs them onto free GPUs), reads each run's
progress (rank 0's ``gpufleet.log_metrics``), reports each new step to its trial, cancels a
run whose trial should be pruned, and tells the study how each trial ended. docs/optuna.md.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from gpufleet._log import log
from gpufleet.api import DistributedFunction
from gpufleet.errors import ConfigError, GpufleetError, RunFailedError
from gpufleet.options import _seconds
from gpufleet.runs import records
from gpufleet.runs.handles import Run
from gpufleet.watch.progress import number

try:
    import optuna
    from optuna.distributions import BaseDistribution
    from optuna.trial import FrozenTrial, Trial, TrialState
except ImportError as exc:  # an optional extra: say how to get it
    raise ImportError("gpufleet.integrations.optuna needs Optuna: pip install 'gpufleet[optuna]'") from exc

__all__ = ["ERROR_ATTR", "RUN_ID_ATTR", "optimize"]

RUN_ID_ATTR = "gpufleet_run_id"  # the trial's run: gpufleet.attach(trial.user_attrs[RUN_ID_ATTR])
ERROR_ATTR = "gpufleet_error"  # why a FAIL trial failed (the whole error: the run's .result())
ERROR_CHARS = 4000  # of an error kept in the study's storage
# How often each running trial's progress is read: rank 0 rewrites it at most every 0.5 s
# (tracking.PROGRESS_EVERY_S), and a read is a stat and a small JSON file.
POLL_SECONDS = 0.5

Space = Callable[[Trial], Mapping[str, Any] | None] | Mapping[str, Any]
Objective = Callable[[list], float | Sequence[float]]
Callback = Callable[[optuna.Study, FrozenTrial], None]


def optimize(
    study: optuna.Study, fn: DistributedFunction, space: Space, *,
    metric: str | Sequence[str] | None = None, objective: Objective | None = None,
    n_trials: int | None = None, timeout: float | str | None = None, max_concurrent: int = 1,
    fail_fast: bool = False, callbacks: Sequence[Callback] = (), name: str | None = None,
) -> optuna.Study:
    """Run trials of ``study`` as runs of ``fn`` until ``n_trials`` have started, ``timeout``
    has passed (running trials then finish, as in ``Study.optimize``) or a callback calls
    ``study.stop()``; return the study.

    ``space``: a mapping of keyword arguments, each an ``optuna.distributions`` distribution
    (searched) or a value (passed as it is); or a function ``space(trial)`` that suggests
    values (``trial.suggest_float(...)``) and returns the keyword arguments (None: the
    suggested values as they are named).
    ``metric``: what rank 0 logs with ``gpufleet.log_metrics`` and the study optimizes: each new
    step's value is reported to the trial (pruning), and the last value is the trial's value.
    A multi-objective study takes one name per direction (and prunes nothing, as Optuna).
    ``objective``: a function of the run's results (every rank's return value, in rank order)
    giving the trial's value instead; ``metric`` then only prunes (optional).
    ``max_concurrent``: trials running at once; each run waits for free GPUs in gpufleet's
    queue, so eight trials of ``fn.options(gpus=1)`` fill an 8-GPU machine.
    A trial whose run fails (or whose value cannot be had) is told FAIL with the error in its
    user attribute ``gpufleet_error``, and the study goes on; ``fail_fast=True`` instead
    cancels the running trials (FAIL) and raises the error. Ctrl-C, or an exception in a
    callback, does the same. ``callbacks``: ``callback(study, frozen_trial)`` after each trial,
    as ``Study.optimize``'s. ``name``: the runs' name before ``-trial-N`` (default: ``fn``'s).
    """
    loop = _Loop(
        _study(study), _function(fn), _space(space), _metrics(study, metric, objective),
        _objective(objective), fail_fast=bool(fail_fast), callbacks=_callbacks(callbacks),
        name=_name(name, fn),
    )
    budget = _Budget(None if n_trials is None else _count("n_trials", n_trials, or_none=True),
                     _deadline(timeout), _count("max_concurrent", max_concurrent))
    with _optimizing(study):
        loop.run(budget)
    return study


# ---------------------------------------------------------------------------- the loop


@dataclass
class _Running:
    """A trial whose run goes on, and what its progress said so far."""

    trial: Trial
    run: Run
    last: dict[str, float] = field(default_factory=dict)  # each metric's last value seen
    reported: int = -1  # the last step reported to the trial

    def note(self, metrics: Mapping[str, float]) -> None:
        self.last.update(metrics)


@dataclass(frozen=True)
class _Budget:
    n_trials: int | None
    deadline: float | None  # time.monotonic() after which no trial starts
    max_concurrent: int


class _Loop:
    """One call of ``optimize``: the trials it started and runs."""

    def __init__(self, study: optuna.Study, fn: DistributedFunction, space: _SearchSpace,
                 metrics: tuple[str, ...], objective: Objective | None, *, fail_fast: bool,
                 callbacks: tuple[Callback, ...], name: str):
        self.study, self.fn, self.space, self.name = study, fn, space, name
        self.metrics, self.objective = metrics, objective
        self.fail_fast, self.callbacks = fail_fast, callbacks
        self.prunes = len(study.directions) == 1 and bool(metrics)  # as Trial.report allows
        self.running: list[_Running] = []
        self.started = 0

    def run(self, budget: _Budget) -> None:
        try:
            while True:
                while self._may_start(budget):
                    self.running.append(self._start())
                if not self.running:
                    return
                time.sleep(POLL_SECONDS)
                for entry in list(self.running):
                    self._poll(entry)
        except BaseException as exc:  # Ctrl-C, fail_fast, a callback's error: no run left behind
            self._abandon(exc)
            raise

    def _may_start(self, budget: _Budget) -> bool:
        return (len(self.running) < budget.max_concurrent
                and (budget.n_trials is None or self.started < budget.n_trials)
                and (budget.deadline is None or time.monotonic() < budget.deadline)
                and not getattr(self.study, "_stop_flag", False))  # study.stop(), see _optimizing

    def _start(self) -> _Running:
        trial = self.study.ask(self.space.distributions)
        self.started += 1
        try:
            kwargs = self.space.kwargs(trial)
            run = self.fn.options(name=f"{self.name}-trial-{trial.number}").submit(**kwargs)
        except BaseException as exc:  # the space or the arguments are wrong: every trial would be
            self._tell_failed(trial, exc)
            raise
        trial.set_user_attr(RUN_ID_ATTR, run.id)
        log.info(f"trial {trial.number} started as run {run.id}: {_shown(trial.params)}")
        return _Running(trial, run)

    def _poll(self, entry: _Running) -> None:
        status = entry.run.status()  # before the progress: once ended, the progress is whole
        step, metrics = entry.run.progress()
        entry.note(metrics)
        reported = self._report(entry, step, metrics)
        if status in records.FINAL:
            self._end(entry, status)
        elif reported and entry.trial.should_prune():
            self._prune(entry)

    def _report(self, entry: _Running, step: int | None, metrics: Mapping[str, float]) -> bool:
        """Report a step not reported yet to the trial; whether one was."""
        value = metrics.get(self.metrics[0]) if self.prunes else None
        if value is None or step is None or step <= entry.reported:
            return False
        entry.trial.report(float(value), int(step))
        entry.reported = int(step)
        return True

    def _end(self, entry: _Running, status: str) -> None:
        self.running.remove(entry)
        if status != records.SUCCEEDED:
            self._failed(entry.trial, _run_error(entry.run))
            return
        try:
            values = self._values(entry)
        except Exception as exc:  # the metric was never logged, the objective raised, a NaN
            self._failed(entry.trial, exc)
            return
        frozen = self.study.tell(entry.trial, values)
        log.info(f"trial {entry.trial.number} finished: {self._said(values)}{self._best()}")
        self._after(frozen)

    def _prune(self, entry: _Running) -> None:
        status = entry.run.cancel()
        if status == records.SUCCEEDED:  # it ended before the cancel reached it: its value stands
            self._end(entry, status)
            return
        self.running.remove(entry)
        frozen = self.study.tell(entry.trial, state=TrialState.PRUNED)
        value = entry.last.get(self.metrics[0])
        log.info(f"trial {entry.trial.number} pruned at step {entry.reported} "
                 f"({self.metrics[0]} {number(value)}); run {entry.run.id} {status}")
        self._after(frozen)

    def _values(self, entry: _Running) -> float | list[float]:
        if self.objective is not None:
            values = self.objective(entry.run.result())
        else:
            missing = [m for m in self.metrics if m not in entry.last]
            if missing:
                raise GpufleetError(
                    f"rank 0 of run {entry.run.id} never logged {', '.join(map(repr, missing))} "
                    f"with gpufleet.log_metrics (it logged: {', '.join(sorted(entry.last)) or 'nothing'}); "
                    "log it, or give objective= to compute the value from the ranks' results"
                )
            values = [entry.last[m] for m in self.metrics]
        return _checked_values(values, len(self.study.directions))

    def _failed(self, trial: Trial, error: BaseException) -> None:
        self._tell_failed(trial, error)
        if self.fail_fast:
            raise error

    def _tell_failed(self, trial: Trial, error: BaseException) -> None:
        trial.set_user_attr(ERROR_ATTR, _error_text(error))
        frozen = self.study.tell(trial, state=TrialState.FAIL)
        run_id = trial.user_attrs.get(RUN_ID_ATTR)
        log.warning(f"trial {trial.number} failed: {_first_line(error)}" + (f" (run {run_id})" if run_id else ""))
        self._after(frozen)

    def _after(self, frozen: FrozenTrial) -> None:
        for callback in self.callbacks:
            callback(self.study, frozen)

    def _abandon(self, cause: BaseException) -> None:
        """Cancel every run still going and tell its trial FAIL, saying why."""
        why = _why_stopped(cause)
        if self.running:
            numbers = ", ".join(str(e.trial.number) for e in self.running)
            log.info(f"{why}: cancelling the runs of trial(s) {numbers}")
        while self.running:
            entry = self.running.pop()
            try:
                entry.run.cancel()
                entry.trial.set_user_attr(ERROR_ATTR, f"cancelled: {why}")
                self.study.tell(entry.trial, state=TrialState.FAIL, skip_if_finished=True)
            except Exception as exc:  # the others must still be cancelled; say what was left
                log.warning(f"trial {entry.trial.number}: could not cancel run {entry.run.id} "
                            f"and end the trial ({type(exc).__name__}: {exc})")

    def _said(self, values: float | list[float]) -> str:
        names = self.metrics if self.objective is None else ()
        shown = values if isinstance(values, list) else [values]
        if len(names) == len(shown):
            return ", ".join(f"{n} {number(v)}" for n, v in zip(names, shown))
        return "value " + ", ".join(number(v) for v in shown)

    def _best(self) -> str:
        if len(self.study.directions) != 1:
            return ""
        best = self.study.best_trial  # this trial at least is complete
        return f"; best is trial {best.number} ({number(best.value)})"


@contextmanager
def _optimizing(study: optuna.Study) -> Iterator[None]:
    """What ``Study.optimize`` sets while it runs, so that ``study.stop()`` works in a callback
    here too (Optuna's MaxTrialsCallback and terminator call it). Optuna keeps this state in
    private attributes (the same from 3.x to 5.x); where they are missing, ``stop()`` raises
    as it does outside ``optimize`` and nothing else changes."""
    local = getattr(study, "_thread_local", None)
    if getattr(local, "in_optimize_loop", False):
        raise ConfigError("optimize() was called inside an optimization of the same study "
                          "(a callback or an objective of study.optimize): call it after that ends")
    study._stop_flag = False
    if local is not None:
        local.in_optimize_loop = True
    try:
        yield
    finally:
        if local is not None:
            local.in_optimize_loop = False


# ---------------------------------------------------------------------------- the space


@dataclass(frozen=True)
class _SearchSpace:
    """A define-by-run function, or distributions (searched) and constants (passed on)."""

    define: Callable[[Trial], Mapping[str, Any] | None] | None = None
    distributions: dict[str, BaseDistribution] | None = None
    constants: dict[str, Any] = field(default_factory=dict)

    def kwargs(self, trial: Trial) -> dict[str, Any]:
        if self.define is None:
            return {**self.constants, **trial.params}
        values = self.define(trial)
        if values is None:
            return dict(trial.params)
        if not isinstance(values, Mapping) or not all(isinstance(k, str) for k in values):
            raise TypeError(f"space(trial) must return the function's keyword arguments as a dict "
                            f"of names to values (or None), not {type(values).__name__}: {values!r:.200}")
        return dict(values)


def _space(space: Any) -> _SearchSpace:
    if isinstance(space, Mapping):
        if not all(isinstance(k, str) for k in space):
            raise ConfigError(f"space's keys must be the function's argument names (strings), "
                              f"got {sorted(map(repr, space))}")
        searched = {k: v for k, v in space.items() if isinstance(v, BaseDistribution)}
        return _SearchSpace(distributions=searched,
                            constants={k: v for k, v in space.items() if k not in searched})
    if callable(space):
        return _SearchSpace(define=space)
    raise ConfigError(f"space={space!r:.200} must be a dict of argument names to optuna "
                      "distributions (or values), or a function of the trial that returns "
                      "the keyword arguments")


# ---------------------------------------------------------------------------- checks


def _study(study: Any) -> optuna.Study:
    if not isinstance(study, optuna.Study):
        raise ConfigError(f"study={study!r:.200} must be an optuna.Study: "
                          "optuna.create_study(direction=...) or optuna.load_study(...)")
    return study


def _function(fn: Any) -> DistributedFunction:
    if not isinstance(fn, DistributedFunction):
        raise ConfigError(f"fn={fn!r:.200} must be a @gpufleet.distributed function, whose "
                          "trials run as gpufleet runs: decorate it (fn.options(gpus=1) packs "
                          "one trial per GPU)")
    return fn


def _metrics(study: Any, metric: Any, objective: Any) -> tuple[str, ...]:
    names = (metric,) if isinstance(metric, str) else tuple(metric or ())
    if not all(isinstance(n, str) and n for n in names):
        raise ConfigError(f"metric={metric!r} must be the name (or names) of a metric rank 0 logs "
                          "with gpufleet.log_metrics")
    directions = len(study.directions)
    if objective is None and len(names) != directions:
        wanted = "a metric's name" if directions == 1 else f"{directions} metric names, one per direction"
        raise ConfigError(f"metric={metric!r}: the study optimizes {directions} value(s): give {wanted} "
                          "(what rank 0 logs with gpufleet.log_metrics), or objective= to compute "
                          "the value from the ranks' results")
    return names


def _objective(objective: Any) -> Objective | None:
    if objective is not None and not callable(objective):
        raise ConfigError(f"objective={objective!r:.200} must be a function of the run's results "
                          "(a list of every rank's return value) that returns the trial's value")
    return objective


def _callbacks(callbacks: Any) -> tuple[Callback, ...]:
    found = tuple(callbacks)
    wrong = [c for c in found if not callable(c)]
    if wrong:
        raise ConfigError(f"callbacks must be functions of (study, frozen_trial), got {wrong!r:.200}")
    return found


def _name(name: Any, fn: DistributedFunction) -> str:
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise ConfigError(f"name={name!r} must be a non-empty string: the runs' name before -trial-N")
    return (name or "").strip() or fn.run_options.name or fn.__name__


def _count(what: str, value: Any, or_none: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{what}={value!r} must be a whole number of at least 1"
                          + (", or None for no limit" if or_none else ""))
    return value


def _deadline(timeout: Any) -> float | None:
    seconds = _seconds("timeout", timeout, means="no trial starts after this long; those running finish")
    return None if seconds is None else time.monotonic() + seconds


# ---------------------------------------------------------------------------- values and words


def _checked_values(values: Any, objectives: int) -> float | list[float]:
    many = isinstance(values, Sequence) and not isinstance(values, str)
    found = list(values) if many else [values]
    if len(found) != objectives:
        raise GpufleetError(f"the trial's value {values!r:.200} has {len(found)} number(s); "
                            f"the study optimizes {objectives}")
    try:
        numbers = [float(v) for v in found]
    except (TypeError, ValueError):
        raise GpufleetError(f"the trial's value {values!r:.200} is not a number") from None
    if any(math.isnan(v) for v in numbers):
        raise GpufleetError(f"the trial's value is NaN ({values!r:.200}): the training diverged?")
    return numbers if many else numbers[0]


def _run_error(run: Run) -> BaseException:
    """The error of an ended run that did not succeed (RunFailedError and its kinds)."""
    try:
        run.result()
    except BaseException as exc:  # the run's own error, to keep in the trial
        return exc
    return GpufleetError(f"run {run.id} ended {run.status()}")


def _error_text(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}"
    if len(text) <= ERROR_CHARS:
        return text
    return text[:ERROR_CHARS] + "\n... (cut: the run's .result() raises the whole error)"


def _first_line(error: BaseException) -> str:
    if isinstance(error, RunFailedError):
        return error.root_line()  # "rank 1: ValueError: boom"
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def _why_stopped(cause: BaseException) -> str:
    if isinstance(cause, KeyboardInterrupt):
        return "optimize was interrupted"
    return f"optimize stopped by {_first_line(cause)}"


def _shown(params: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={number(v)}" for k, v in params.items()) or "no searched parameters"
