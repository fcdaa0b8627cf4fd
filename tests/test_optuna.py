"""Optuna studies whose trials are gpufleet runs (gpufleet.integrations.optuna.optimize).

What a user relies on:

- Each trial runs the decorated function as a gpufleet run, with the keyword arguments the
  search space gives (searched values and constants); the trial keeps the run's id, and the
  study gets the last value of the metric rank 0 logged, or what `objective` computes from
  every rank's result.
- A trial the pruner rejects is stopped early: its run is cancelled before it finishes its
  steps and the trial is PRUNED.
- A trial whose function raises (or that never logs the metric) is FAIL with the error kept,
  and the other trials go on; with fail_fast the error is raised and the running trials'
  runs are cancelled.
- With max_concurrent=2, two trials run at the same time on disjoint (virtual) GPUs.
- A callback's study.stop() ends the loop, as in Study.optimize.

Runs are real: CPU processes with gloo through gpufleet's own launcher, functions of a few
steps. Every test checks that nothing it started is left running (conftest.py).
"""

from __future__ import annotations

import pytest
from support import EXAMPLES, assert_all_gone, run_folders

import gpufleet
from gpufleet import ConfigError, RunFailedError, distributed

optuna = pytest.importorskip("optuna", reason="Optuna is an optional extra: pip install 'gpufleet[optuna]'")
from gpufleet.integrations.optuna import ERROR_ATTR, RUN_ID_ATTR, optimize  # noqa: E402 (needs optuna)

FloatDistribution = optuna.distributions.FloatDistribution
TrialState = optuna.trial.TrialState

pytestmark = pytest.mark.timeout(120)

RUN_TIMEOUT_S = 90  # each trial run's own limit: a broken feature fails instead of stalling


@pytest.fixture(autouse=True)
def private_home(tmp_path, monkeypatch):
    """gpufleet's home (device locks and their queue) in the test's own folder."""
    monkeypatch.setenv("GPUFLEET_HOME", str(tmp_path / "gpufleet-home"))
    monkeypatch.delenv("GPUFLEET_VIRTUAL_GPUS", raising=False)


def quiet_study(**kwargs):
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.create_study(**kwargs)


def make_trainer(runs_dir, gpus: int = 1):
    """A trial function: loss (x - 0.3)^2 + 1/(step + 1) at each step, logged by rank 0; x < -0.5
    raises; ``metric_name`` renames what is logged; a file ``done`` marks the last step."""

    @distributed(gpus=gpus, runs_dir=runs_dir, timeout=RUN_TIMEOUT_S, tracking=False)
    def train(x, steps=3, pause=0.0, metric_name="loss", done=None):
        import pathlib
        import time

        from gpufleet import log_metrics

        if x < -0.5:
            raise ValueError(f"x={x} is out of range")
        for step in range(steps):
            log_metrics({metric_name: (x - 0.3) ** 2 + 1 / (step + 1)}, step=step)
            time.sleep(pause)
        if done is not None:
            pathlib.Path(done).write_text("finished every step")
        return x

    return train


def no_trial_left_running(study):
    running = [t.number for t in study.trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]
    assert not running, f"trials left running: {running}"


def the_run(trial, runs_dir) -> gpufleet.Run:
    return gpufleet.attach(trial.user_attrs[RUN_ID_ATTR], runs_dir=runs_dir)


# ---------------------------------------------------------------------------- values


def test_each_trial_is_a_run_and_the_study_gets_the_metrics_last_value(runs_dir):
    study = quiet_study(direction="minimize")
    for x in (0.3, 0.8):
        study.enqueue_trial({"x": x})

    space = {"x": FloatDistribution(-0.5, 1.0), "steps": 4}  # searched, and passed as it is
    returned = optimize(study, make_trainer(runs_dir), space, metric="loss", n_trials=2)

    assert returned is study
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 2
    for trial, x in zip(study.trials, (0.3, 0.8)):
        # the last step (3) of 4 was logged last: (x - 0.3)^2 + 1/4
        assert trial.value == pytest.approx((x - 0.3) ** 2 + 0.25)
        assert trial.params == {"x": x}
        assert max(trial.intermediate_values) == 3  # reported as the run went, to its end
        run = the_run(trial, runs_dir)
        assert run.status() == "succeeded"
        assert run.result() == [x]
        assert run.name == f"train-trial-{trial.number}"
    assert study.best_params == {"x": 0.3}


def test_objective_computes_the_value_from_every_ranks_result(runs_dir):
    @distributed(gpus=2, runs_dir=runs_dir, timeout=RUN_TIMEOUT_S, tracking=False)
    def scaled(x):
        from gpufleet import runtime

        return x * (runtime.get_global_rank() + 1)

    study = quiet_study(direction="maximize")
    study.enqueue_trial({"x": 0.5})

    def space(trial):  # define-by-run: returns the keyword arguments
        return {"x": trial.suggest_float("x", 0.0, 1.0)}

    optimize(study, scaled, space, objective=lambda results: sum(results), n_trials=1)

    (trial,) = study.trials
    assert trial.state == TrialState.COMPLETE
    assert trial.value == pytest.approx(0.5 * 1 + 0.5 * 2)  # ranks 0 and 1, in rank order
    assert the_run(trial, runs_dir).result() == [0.5, 1.0]


# ---------------------------------------------------------------------------- pruning


def test_a_clearly_bad_trial_is_pruned_its_run_cancelled_before_its_last_step(runs_dir, tmp_path):
    steps = 400  # 0.05 s each: ~20 s, far more than seeing step 0 and cancelling takes
    study = quiet_study(direction="minimize", pruner=optuna.pruners.ThresholdPruner(upper=2.0))
    bad, good = tmp_path / "bad-finished", tmp_path / "good-finished"
    study.enqueue_trial({"x": 3.0}, user_attrs={"done": str(bad)})  # loss > 7 at every step
    study.enqueue_trial({"x": 0.3}, user_attrs={"done": str(good)})

    def space(trial):
        x = trial.suggest_float("x", -0.5, 5.0)
        return {"x": x, "steps": steps if x > 1 else 3, "pause": 0.05, "done": trial.user_attrs["done"]}

    optimize(study, make_trainer(runs_dir), space, metric="loss", n_trials=2)

    pruned, completed = study.trials
    assert pruned.state == TrialState.PRUNED, pruned
    assert max(pruned.intermediate_values) < steps - 1, "pruned only after its last step"
    assert all(v > 2.0 for v in pruned.intermediate_values.values())
    assert the_run(pruned, runs_dir).status() == "cancelled"
    assert not bad.exists(), "the pruned trial's function ran to its end"
    assert completed.state == TrialState.COMPLETE and good.exists()
    no_trial_left_running(study)


# ---------------------------------------------------------------------------- failures


def test_a_trial_that_fails_is_fail_with_its_error_and_the_others_go_on(runs_dir):
    study = quiet_study(direction="minimize")
    study.enqueue_trial({"x": -1.0, "metric_name": "loss"})  # raises ValueError in the rank
    study.enqueue_trial({"x": 0.1, "metric_name": "other"})  # never logs "loss"
    study.enqueue_trial({"x": 0.3, "metric_name": "loss"})

    def space(trial):
        return {"x": trial.suggest_float("x", -1.0, 1.0),
                "metric_name": trial.suggest_categorical("metric_name", ["loss", "other"])}

    optimize(study, make_trainer(runs_dir), space, metric="loss", n_trials=3)  # one after another

    raised, unlogged, fine = study.trials
    assert raised.state == TrialState.FAIL
    error = raised.user_attrs[ERROR_ATTR]
    assert "ValueError: x=-1.0 is out of range" in error and "Traceback" in error, error
    with pytest.raises(RunFailedError, match="x=-1.0 is out of range"):
        the_run(raised, runs_dir).result()  # the whole error, from the run the trial names

    assert unlogged.state == TrialState.FAIL
    assert the_run(unlogged, runs_dir).status() == "succeeded"
    assert "never logged 'loss'" in unlogged.user_attrs[ERROR_ATTR]
    assert "other" in unlogged.user_attrs[ERROR_ATTR]  # what it logged instead

    assert fine.state == TrialState.COMPLETE
    assert fine.value == pytest.approx(1 / 3)


def test_fail_fast_raises_the_error_and_cancels_the_running_trials(runs_dir, tmp_path):
    study = quiet_study(direction="minimize")
    study.enqueue_trial({"x": 0.3})  # a long trial: still running when the other fails
    study.enqueue_trial({"x": -1.0})
    long_done = tmp_path / "long-finished"

    def space(trial):
        x = trial.suggest_float("x", -1.0, 1.0)
        # the long one would take 75 s: it can only be stopped, never finish, in the test
        return {"x": x, "steps": 1500 if x > 0 else 1, "pause": 0.05, "done": str(long_done)}

    with pytest.raises(RunFailedError, match="x=-1.0 is out of range"):
        optimize(study, make_trainer(runs_dir), space, metric="loss", n_trials=5,
                 max_concurrent=2, fail_fast=True)

    long, failed = study.trials  # no trial started after the failure
    assert failed.state == TrialState.FAIL
    assert long.state == TrialState.FAIL
    assert long.user_attrs[ERROR_ATTR].startswith("cancelled: optimize stopped by rank 0: ValueError")
    assert the_run(long, runs_dir).status() == "cancelled"
    assert not long_done.exists()


def test_an_interrupt_cancels_the_running_trials_runs(runs_dir, tmp_path):
    study = quiet_study(direction="minimize")
    study.enqueue_trial({"x": 0.3})  # quick
    study.enqueue_trial({"x": 0.9})  # still running when the first one ends
    long_done = tmp_path / "long-finished"

    def space(trial):
        x = trial.suggest_float("x", 0.0, 1.0)
        long = x > 0.5
        return {"x": x, "steps": 1500 if long else 1, "pause": 0.05, "done": str(long_done) if long else None}

    def ctrl_c(study, frozen):  # as Ctrl-C would land in the loop
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        optimize(study, make_trainer(runs_dir), space, metric="loss", n_trials=2, max_concurrent=2,
                 callbacks=[ctrl_c])

    quick, long = study.trials
    assert quick.state == TrialState.COMPLETE
    assert long.state == TrialState.FAIL
    assert long.user_attrs[ERROR_ATTR] == "cancelled: optimize was interrupted"
    assert the_run(long, runs_dir).status() == "cancelled"
    assert not long_done.exists()


# ---------------------------------------------------------------------------- concurrency


def test_two_trials_run_at_once_on_disjoint_gpus(runs_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("GPUFLEET_VIRTUAL_GPUS", "2")  # scheduled as on a machine of 2 GPUs
    sync = tmp_path / "sync"
    sync.mkdir()

    @distributed(gpus=1, runs_dir=runs_dir, timeout=RUN_TIMEOUT_S, tracking=False)
    def meets_the_other(x, sync_dir):
        import os
        import pathlib
        import time

        from gpufleet import log_metrics

        pathlib.Path(sync_dir, f"started-{x}").write_text(os.environ.get("CUDA_VISIBLE_DEVICES", ""))
        deadline = time.monotonic() + 60
        while len(list(pathlib.Path(sync_dir).glob("started-*"))) < 2:  # both are running
            if time.monotonic() > deadline:
                raise TimeoutError("the other trial never started while this one ran")
            time.sleep(0.05)
        log_metrics({"loss": x}, step=0)

    study = quiet_study(direction="minimize")
    for x in (0.1, 0.2):
        study.enqueue_trial({"x": x})
    space = {"x": FloatDistribution(0.0, 1.0), "sync_dir": str(sync)}
    optimize(study, meets_the_other, space, metric="loss", n_trials=2, max_concurrent=2)

    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 2, [
        t.user_attrs.get(ERROR_ATTR) for t in study.trials]
    first, second = (the_run(t, runs_dir).record() for t in study.trials)
    assert first["started"] < second["ended"] and second["started"] < first["ended"], (first, second)
    assert set(first["devices"]).isdisjoint(second["devices"]), (first["devices"], second["devices"])


def test_a_callback_that_stops_the_study_ends_the_loop(runs_dir):
    study = quiet_study(direction="minimize")
    seen = []

    def record(study, frozen):
        seen.append((frozen.number, frozen.state))

    stop_after_one = optuna.study.MaxTrialsCallback(1, states=(TrialState.COMPLETE,))
    optimize(study, make_trainer(runs_dir), {"x": FloatDistribution(0.0, 1.0)}, metric="loss",
             callbacks=[record, stop_after_one])  # no n_trials, no timeout: only stop() ends it

    assert seen == [(0, TrialState.COMPLETE)]
    assert len(study.trials) == 1


# ---------------------------------------------------------------------------- the example


def test_the_example_tunes_the_fsdp_transformers_learning_rate(run_script):
    """examples/optuna_lr.py --small, cut to 2 trials of 20 steps (the pruner spares the first 2)."""
    result = run_script(EXAMPLES / "optuna_lr.py", "--small", "--trials", "2", "--steps", "20",
                        timeout=110)

    assert result.returncode == 0, result.explain()  # the best trial beat the unigram baseline
    trials = [line for line in result.stdout.splitlines() if line.startswith("trial ")]
    assert len(trials) == 2 and all(" complete " in line for line in trials), result.explain()
    assert "lr 3.00e-03" in trials[0], "the example's own learning rate goes first"
    run_id = trials[1].split(" run ")[-1].strip()
    assert gpufleet.attach(run_id).status() == "succeeded", result.explain()
    assert "best: trial" in result.stdout, result.explain()
    assert_all_gone(result.tree, what="processes of the example")


# ---------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("call, says", [
    (lambda s, f: optimize(s, f.__wrapped__, {"x": 1}, metric="loss"), "@gpufleet.distributed"),
    (lambda s, f: optimize(s, f, [("x", 1)], metric="loss"), "space="),
    (lambda s, f: optimize(s, f, {"x": 1}), "objective="),
    (lambda s, f: optimize(s, f, {"x": 1}, metric=["a", "b"]), "give a metric's name"),
    (lambda s, f: optimize(s, f, {"x": 1}, metric="loss", max_concurrent=0), "max_concurrent=0"),
    (lambda s, f: optimize(s, f, {"x": 1}, metric="loss", n_trials=1.5), "n_trials=1.5"),
    (lambda s, f: optimize(s, f, {"x": 1}, metric="loss", timeout="soon"), "timeout='soon'"),
    (lambda s, f: optimize("study", f, {"x": 1}, metric="loss"), "optuna.Study"),
])
def test_bad_input_is_refused_before_any_trial_starts(runs_dir, call, says):
    study = quiet_study(direction="minimize")
    with pytest.raises(ConfigError) as info:
        call(study, make_trainer(runs_dir))
    assert says in str(info.value), str(info.value)
    assert not study.trials and not run_folders(runs_dir)
