"""MLflow runs nest as a user expects: a call, a submitted run or a sweep's trial made inside an
active MLflow run is its child run; a sweep has a parent run with the trials as children and
its best trial tagged."""

from __future__ import annotations

import io

import pytest

import gpufleet
from gpufleet import distributed, runtime

mlflow = pytest.importorskip("mlflow")
pytestmark = pytest.mark.timeout(180)

PARENT = "mlflow.parentRunId"


def _children(parent_id: str) -> list:
    client = mlflow.MlflowClient()
    experiment = client.get_run(parent_id).info.experiment_id
    return client.search_runs([experiment], filter_string=f"tags.`{PARENT}` = '{parent_id}'")


def test_a_call_and_a_submitted_run_inside_an_active_run_become_its_children(runs_dir, monkeypatch):
    @distributed(gpus=2, runs_dir=runs_dir)
    def child(value):
        from gpufleet import log_metrics

        runtime.setup()
        log_metrics({"value": float(value)}, step=0)
        return value

    monkeypatch.setenv("MLFLOW_EXPERIMENT_ID", "0")  # set_experiment sets it: undone after the test
    experiment = mlflow.set_experiment("notebook")
    with mlflow.start_run() as outer:
        assert child.distributed(1) == [1, 1]
        submitted = child.submit(2)
    assert submitted.result() == [2, 2]  # waited on after the caller's run ended: still its child

    runs = {r.data.metrics["value"]: r for r in _children(outer.info.run_id)}
    assert sorted(runs) == [1.0, 2.0], "each call is a child run, with its own metrics"
    for run in runs.values():
        assert run.info.experiment_id == experiment.experiment_id, "in the parent's experiment"
        assert run.info.status == "FINISHED"
    assert submitted.record()["mlflow_run_id"] == runs[2.0].info.run_id
    assert "value" not in mlflow.MlflowClient().get_run(outer.info.run_id).data.metrics, "nothing mixed into it"


def test_a_sweep_is_a_parent_run_whose_children_are_its_trials_and_its_best_is_tagged(runs_dir):
    @distributed(gpus=2, runs_dir=runs_dir)
    def trial(lr):
        from gpufleet import log_metrics

        runtime.setup()
        log_metrics({"loss": 1.0 - lr}, step=0)
        return lr

    sweep = gpufleet.sweep(trial, [{"lr": 0.1}, {"lr": 0.5}, {"lr": 0.3}], metric="loss", name="tune",
                           max_concurrent=2, out=io.StringIO())
    sweep.wait()
    client = mlflow.MlflowClient()
    experiment = client.get_experiment_by_name("gpufleet")
    (parent,) = client.search_runs([experiment.experiment_id], filter_string="tags.`gpufleet.sweep` = 'tune'")
    children = {r.info.run_id: r for r in _children(parent.info.run_id)}
    assert set(children) == {t.run.record()["mlflow_run_id"] for t in sweep.trials}, "every trial, and only they"
    assert sorted(r.data.params["lr"] for r in children.values()) == ["0.1", "0.3", "0.5"]
    best = sweep.trials[1].run.record()["mlflow_run_id"]
    assert parent.data.tags["gpufleet.best_trial"] == "1" and parent.data.tags["gpufleet.best_run_id"] == best
    assert children[best].data.tags["gpufleet.best_trial"] == "true"
    assert parent.data.metrics["best_loss"] == pytest.approx(0.5)
    assert parent.info.status == "FINISHED"
