"""MLflow tracking: one run per call, shared with every rank, with a truthful final status."""

from __future__ import annotations

import time

import pytest
from support import ended_mlflow_run

from gpufleet import ConfigError, RunFailedError, RunTimeoutError, distributed, runtime

mlflow = pytest.importorskip("mlflow")
pytestmark = pytest.mark.timeout(120)


def _runs_of(function_name: str) -> list:
    client = mlflow.MlflowClient()
    experiment = client.get_experiment_by_name("gpufleet")
    if experiment is None:
        return []
    return [r for r in client.search_runs([experiment.experiment_id])
            if r.data.tags.get("gpufleet.function") == function_name]


def test_a_call_is_one_mlflow_run_with_params_rank0_metrics_and_status(runs_dir, capfd):
    @distributed(gpus=2, runs_dir=runs_dir)
    def tracked_training():
        import mlflow

        from gpufleet import log_metrics

        runtime.setup()
        rank = runtime.get_global_rank()
        for step in range(3):
            log_metrics({"loss": 1.0 + rank - 0.1 * step}, step=step)  # rank 0's values
            log_metrics({"rank_mean": float(rank), "rank_max": float(rank)}, step=step, reduce="mean")
        log_metrics({"rank_max_of_all": float(rank)}, reduce="max")
        if rank == 0:  # plain mlflow calls land in the same run
            with mlflow.start_run():
                mlflow.log_param("lr", 0.1)
        return rank

    assert tracked_training.distributed() == [0, 1]
    runs = _runs_of("tracked_training")
    client = mlflow.MlflowClient()

    assert len(runs) == 1, "one MLflow run per call"
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert run.data.params["gpus"] == "2" and run.data.params["world_size"] == "2"
    assert run.data.params["function"].endswith("tracked_training")
    assert run.data.params["lr"] == "0.1", "mlflow.start_run() in a rank joins the call's run"
    losses = [m.value for m in sorted(client.get_metric_history(run.info.run_id, "loss"),
                                      key=lambda m: m.step)]
    assert losses == pytest.approx([1.0, 0.9, 0.8]), "rank 0's values only"
    assert run.data.metrics["rank_mean"] == pytest.approx(0.5)
    assert run.data.metrics["rank_max_of_all"] == pytest.approx(1.0)
    assert run.info.run_id in capfd.readouterr().err, "the run is named when the call starts"


def test_failed_and_timed_out_calls_get_their_status(runs_dir):
    @distributed(gpus=2, runs_dir=runs_dir)
    def tracked_failure():
        raise ValueError("no")

    @distributed(gpus=2, runs_dir=runs_dir, timeout=8)
    def tracked_sleeper():
        import time

        time.sleep(60)

    with pytest.raises(RunFailedError):
        tracked_failure.distributed()
    with pytest.raises(RunTimeoutError):
        tracked_sleeper.distributed()

    assert [r.info.status for r in _runs_of("tracked_failure")] == ["FAILED"]
    assert [r.info.status for r in _runs_of("tracked_sleeper")] == ["KILLED"]


def test_retries_stay_in_one_run_and_tracking_false_creates_none(runs_dir):
    @distributed(gpus=2, runs_dir=runs_dir, max_retries=1)
    def tracked_retry():
        if runtime.get_attempt() == 0 and runtime.get_global_rank() == 1:
            raise RuntimeError("first attempt fails")
        return runtime.get_attempt()

    @distributed(gpus=2, runs_dir=runs_dir, tracking=False)
    def untracked():
        import os

        return os.environ.get("MLFLOW_RUN_ID")

    assert tracked_retry.distributed() == [1, 1]
    assert untracked.distributed() == [None, None]

    runs = _runs_of("tracked_retry")
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    assert runs[0].data.tags["gpufleet.attempts"] == "2"
    assert _runs_of("untracked") == []


def test_bad_tracking_values_and_reduce_are_errors(runs_dir):
    from gpufleet import log_metrics

    with pytest.raises(ConfigError, match="tracking"):
        distributed(gpus=2, runs_dir=runs_dir, tracking="yes")
    with pytest.raises(ConfigError, match="reduce"):
        log_metrics({"x": 1.0}, reduce="sum")


def test_a_caller_inside_an_mlflow_run_that_asks_to_join_it_has_the_ranks_log_into_it(runs_dir, monkeypatch):
    @distributed(gpus=2, runs_dir=runs_dir, join_mlflow_run=True)
    def joins_callers_run():
        from gpufleet import log_metrics

        runtime.setup()
        log_metrics({"from_ranks": 3.0}, reduce="max")
        return 0

    monkeypatch.setenv("MLFLOW_EXPERIMENT_ID", "0")  # set_experiment sets it: undone after the test
    experiment = mlflow.set_experiment("gpufleet-caller")
    with mlflow.start_run() as outer:
        joins_callers_run.distributed()
        status_during = mlflow.MlflowClient().get_run(outer.info.run_id).info.status
    run = mlflow.MlflowClient().get_run(outer.info.run_id)

    assert run.data.metrics["from_ranks"] == 3.0
    assert status_during == "RUNNING", "the caller's own run is left to the caller"
    assert _runs_of("joins_callers_run") == [], "no run of its own"
    assert run.info.experiment_id == experiment.experiment_id


def test_a_cancelled_submitted_run_is_killed_in_mlflow_and_named_in_its_record(runs_dir):
    @distributed(gpus=2, runs_dir=runs_dir)
    def tracked_cancel():
        import time

        from gpufleet import log_metrics

        runtime.setup()
        log_metrics({"loss": 2.0}, step=0)
        print("logged", flush=True)
        time.sleep(120)

    run = tracked_cancel.submit()
    while "logged" not in run.logs(rank=0):
        assert not run.done(), run.logs()
        time.sleep(0.1)
    assert run.cancel() == "cancelled"

    (tracked,) = _runs_of("tracked_cancel")
    assert tracked.info.status == "KILLED"
    assert tracked.data.metrics["loss"] == 2.0
    assert run.record()["mlflow_run_id"] == tracked.info.run_id, "the record links its MLflow run"


def test_a_workload_file_sets_the_experiment_and_its_parameters(runs_dir, tmp_path):
    import subprocess
    import sys

    (tmp_path / "job.py").write_text("print('step')\n")
    (tmp_path / "params.yaml").write_text("lr: 0.003\noptim: {beta: 0.9}\n")
    (tmp_path / "work.yaml").write_text(
        "script: job.py\ngpus: 2\nparameters: params.yaml\nexperiment: sweeps\n")
    done = subprocess.run(
        [sys.executable, "-m", "gpufleet", "submit", "--runs-dir", str(runs_dir), "--follow",
         str(tmp_path / "work.yaml")], capture_output=True, text=True, timeout=100,
    )
    assert done.returncode == 0, done.stderr
    client = mlflow.MlflowClient()  # the suite's store (MLFLOW_TRACKING_URI)
    experiment = client.get_experiment_by_name("sweeps")
    assert experiment is not None, "the workload's experiment"
    (tracked,) = client.search_runs([experiment.experiment_id])
    assert tracked.data.params["lr"] == "0.003" and tracked.data.params["optim.beta"] == "0.9"
    assert tracked.info.status == "FINISHED"


def test_gpufleet_run_imports_neither_torch_nor_mlflow_and_its_run_ends_after_it(runs_dir, tmp_path):
    import subprocess
    import sys

    (tmp_path / "job.py").write_text("from gpufleet import log_metrics\nlog_metrics({'loss': 0.25}, step=1)\n")
    code = ("import sys; from gpufleet.cli import main; rc = main(sys.argv[1:]); "
            "print(sorted({'torch', 'mlflow'} & {m.split('.')[0] for m in sys.modules})); sys.exit(rc)")
    done = subprocess.run([sys.executable, "-c", code, "run", "--runs-dir", str(runs_dir), "--gpus", "2",
                           str(tmp_path / "job.py")], capture_output=True, text=True, timeout=100)

    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "[]", "the command imported them"
    (folder,) = [p for p in runs_dir.iterdir() if p.is_dir()]
    tracked = ended_mlflow_run(folder)
    assert tracked.info.status == "FINISHED" and tracked.data.metrics["loss"] == 0.25
    assert tracked.info.run_id in done.stderr, "the run is named when the call starts"


def test_a_caller_killed_outright_leaves_its_run_killed_with_its_metrics(runs_dir):
    import os
    import signal

    @distributed(gpus=2, runs_dir=runs_dir)
    def tracked_orphan():
        import time

        from gpufleet import log_metrics

        log_metrics({"loss": 3.0}, step=0)
        print("logged", flush=True)
        time.sleep(120)

    run = tracked_orphan.submit()
    while "logged" not in run.logs(rank=0):
        assert not run.done(), run.logs()
        time.sleep(0.1)
    os.kill(run.record()["supervisor"]["pid"], signal.SIGKILL)

    tracked = ended_mlflow_run(run.path)
    assert tracked.info.status == "KILLED"
    assert tracked.data.metrics["loss"] == 3.0, "what was logged before the kill is in the run"
    run.wait(60)  # its ranks die with it (checked for leftovers by conftest)
