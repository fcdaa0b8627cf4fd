"""Sweeps as a user runs them: ``fn.map`` for values, ``gpufleet.sweep`` for a handle, one run
per input, trials packed onto the machine's (here virtual) GPUs, failures kept to their trial."""

from __future__ import annotations

import io
import time

import pytest

import gpufleet
from gpufleet import ConfigError, RunCancelledError, RunFailedError, distributed, runtime

pytestmark = pytest.mark.timeout(240)


def _window(run) -> tuple[float, float]:
    record = run.record()
    return record["started"], record["ended"]


def test_map_returns_every_trials_values_in_input_order_whatever_finishes_first(runs_dir):
    @distributed(gpus=2, runs_dir=runs_dir)
    def scaled(x, factor=1, pause=0.0):
        time.sleep(pause)
        return x * factor + runtime.get_global_rank()

    inputs = [{"x": 1, "pause": 3.0}, (2, 10), 3]  # the first is the slowest of the two at once
    assert scaled.map(inputs, max_concurrent=2) == [[1, 2], [20, 21], [3, 4]]
    names = sorted(run.name for run in gpufleet.runs(runs_dir=runs_dir))
    assert names == ["scaled-0", "scaled-1", "scaled-2"], "one run per input, in the runs folder"


def test_a_failed_trial_leaves_the_others_to_finish_and_its_error_in_its_place(runs_dir):
    @distributed(gpus=2, runs_dir=runs_dir)
    def trial(lr):
        if lr > 1:
            raise ValueError(f"lr={lr} diverged")
        return lr

    sweep = gpufleet.sweep(trial, [{"lr": 0.1}, {"lr": 5}, {"lr": 0.3}], max_concurrent=2, out=io.StringIO())
    values = sweep.results(return_exceptions=True)
    assert values[0] == [0.1, 0.1] and values[2] == [0.3, 0.3]
    assert isinstance(values[1], RunFailedError) and "lr=5 diverged" in str(values[1])
    assert [t.status for t in sweep.trials] == ["succeeded", "failed", "succeeded"]
    with pytest.raises(RunFailedError, match="lr=5 diverged"):
        trial.map([{"lr": 0.2}, {"lr": 5}])  # map raises the failed trial's error, once all ended


def test_fail_fast_cancels_the_running_trial_and_starts_no_more(runs_dir):
    @distributed(gpus=2, runs_dir=runs_dir)
    def trial(seconds, fail):
        runtime.setup()
        if fail:
            time.sleep(1)  # the other trial is running by then
            raise RuntimeError("broken trial")
        for _ in range(int(seconds * 10)):
            runtime.heartbeat()
            time.sleep(0.1)
        return seconds

    started = time.monotonic()
    sweep = gpufleet.sweep(trial, [(60, False), (0, True), (0, False)], max_concurrent=2, fail_fast=True,
                           out=io.StringIO())
    values = sweep.results(return_exceptions=True)
    assert time.monotonic() - started < 45, "the 60 s trial was stopped, not waited for"
    assert [t.status for t in sweep.trials] == ["cancelled", "failed", "cancelled"]
    assert isinstance(values[0], RunCancelledError) and isinstance(values[1], RunFailedError)
    assert sweep.trials[0].run.status() == "cancelled"
    assert sweep.trials[2].run is None, "a queued trial never starts after fail_fast"


def test_trials_of_one_gpu_are_packed_two_at_a_time_on_two_gpus_with_disjoint_devices(runs_dir, tmp_path,
                                                                                      monkeypatch):
    monkeypatch.setenv("GPUFLEET_VIRTUAL_GPUS", "2")

    @distributed(gpus=1, runs_dir=runs_dir)
    def trial(index, folder):
        import pathlib

        here = pathlib.Path(folder)
        (here / str(index)).touch()
        deadline = time.monotonic() + 90
        while not (here / str(index ^ 1)).exists():  # trials 0 and 1, then 2 and 3, meet
            if time.monotonic() > deadline:
                return index, False
            time.sleep(0.05)
        return index, True

    sweep = gpufleet.sweep(trial, [(i, str(tmp_path)) for i in range(4)], out=io.StringIO())  # as many as fit
    assert sweep.max_concurrent == 2
    assert sweep.results() == [[(i, True)] for i in range(4)], "each trial ran while its partner ran"
    windows = [_window(t.run) for t in sweep.trials]
    moments = sorted({start for start, _ in windows} | {end for _, end in windows})
    assert max(sum(start <= m < end for start, end in windows) for m in moments) <= 2, windows
    for a, b in ((0, 1), (2, 3)):  # partners ran at the same time: on different devices
        devices = [set(sweep.trials[i].run.record()["devices"]) for i in (a, b)]
        assert all(devices) and not devices[0] & devices[1], devices


def test_a_workers_trials_reuse_its_warm_ranks_unless_warm_is_off(runs_dir):
    @distributed(gpus=2, runs_dir=runs_dir)
    def pid(_):
        import os

        return os.getpid()

    warm = pid.map(range(3), max_concurrent=1)
    assert len({tuple(pids) for pids in warm}) == 1, f"the same ranks ran every trial: {warm}"
    cold = pid.map(range(2), max_concurrent=1, warm=False)
    assert cold[0] != cold[1], "warm=False starts every trial's ranks afresh"


def test_the_view_says_each_trial_and_the_best_so_far_and_best_picks_by_metric(runs_dir):
    @distributed(gpus=2, runs_dir=runs_dir)
    def trial(lr):
        from gpufleet import log_metrics

        runtime.setup()
        for step in range(3):
            log_metrics({"loss": 1.0 - lr * step}, step=step)
        return lr

    out = io.StringIO()
    sweep = gpufleet.sweep(trial, [{"lr": 0.1}, {"lr": 0.3}, {"lr": 0.2}], metric="loss", name="lr-search",
                           max_concurrent=1, out=out)
    sweep.wait()
    text = out.getvalue()
    assert sweep.best().index == 1 and sweep.best().metrics["loss"] == pytest.approx(0.4)
    for index in range(3):
        assert f"trial {index} (lr=" in text and f"trial {index} succeeded" in text, text
    assert "best so far: trial 1 (lr=0.3), loss=0.4" in text, text
    assert "0 running, 0 queued, 3 done" in text, text
    assert [t.run.name for t in sweep.trials] == ["lr-search-0", "lr-search-1", "lr-search-2"]


def test_bad_sweep_input_is_refused_before_any_trial_starts(runs_dir):
    @distributed(gpus=2, runs_dir=runs_dir)
    def trial(x):
        return x

    with pytest.raises(ConfigError, match="at least one input"):
        gpufleet.sweep(trial, [])
    with pytest.raises(ConfigError, match="max_concurrent=0"):
        trial.map([1, 2], max_concurrent=0)
    with pytest.raises(ConfigError, match="mode='avg'"):
        trial.map([1], mode="avg")
    with pytest.raises(ConfigError, match="@gpufleet.distributed"):
        gpufleet.sweep(lambda x: x, [1])
    sweep = gpufleet.sweep(trial, [1], out=io.StringIO())
    with pytest.raises(ConfigError, match="metric="):
        sweep.best()
    sweep.wait()
    assert len(gpufleet.runs(runs_dir=runs_dir)) == 1, "only the last, valid sweep ran"
