"""Where MLflow tracking goes (docs/tracking.md): one store per machine in $GPUFLEET_HOME, never
the working folder; GPUFLEET_TRACKING=0 switches it off; the run folder's logs, timings and
error go with each run; `gpufleet ui` serves the store.

Each test has a GPUFLEET_HOME of its own, no MLFLOW_TRACKING_URI (the suite's store is set
aside) and a working folder of its own, which must stay empty.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from gpufleet import ConfigError, RunFailedError, distributed, tracking

mlflow = pytest.importorskip("mlflow")
pytestmark = pytest.mark.timeout(120)

UI_START_S = 90.0  # MLflow's server imports a lot before it answers


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """A fresh GPUFLEET_HOME; calls are made from ``tmp_path / "work"``."""
    home = tmp_path / "home"
    (tmp_path / "work").mkdir()
    monkeypatch.setenv("GPUFLEET_HOME", str(home))
    for name in ("MLFLOW_TRACKING_URI", "GPUFLEET_TRACKING", "GPUFLEET_VIRTUAL_GPUS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path / "work")
    return home


def store_of(home: Path) -> str:
    return f"sqlite:///{home / 'mlflow.db'}"


def runs_of(uri: str, function_name: str, experiment: str = "gpufleet") -> list:
    client = mlflow.MlflowClient(uri)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        return []
    return [r for r in client.search_runs([found.experiment_id])
            if r.data.tags.get("gpufleet.function", "").endswith(function_name)]


def test_the_store_is_in_gpufleet_home_and_never_in_the_working_folder(home, capfd):
    @distributed(gpus=2)
    def tracked_at_home():
        import os

        from gpufleet import log_metrics

        log_metrics({"loss": 0.5}, step=0)
        return os.environ["MLFLOW_TRACKING_URI"]

    assert tracked_at_home.distributed() == [store_of(home)] * 2, "the ranks log into the same store"

    (run,) = runs_of(store_of(home), "tracked_at_home")
    assert run.info.status == "FINISHED" and run.data.metrics["loss"] == 0.5
    assert Path(run.info.artifact_uri.removeprefix("file://")).is_relative_to(home / "mlartifacts")
    assert (home / "mlflow.db").stat().st_mode & 0o077 == 0, "the store is private"
    assert list(Path.cwd().iterdir()) == [], "no mlflow.db, mlruns or mlartifacts in the working folder"
    assert f"see it: gpufleet ui, then http://127.0.0.1:5000/#/experiments/{run.info.experiment_id}" \
        in capfd.readouterr().err


def test_a_tracking_uri_set_in_the_callers_process_is_kept(home, tmp_path):
    own = f"sqlite:///{tmp_path / 'own.db'}"

    @distributed(gpus=2)
    def tracked_elsewhere():
        import os

        return os.environ["MLFLOW_TRACKING_URI"]

    mlflow.set_tracking_uri(own)
    try:
        assert tracked_elsewhere.distributed() == [own, own]
    finally:
        mlflow.set_tracking_uri(None)
    assert [r.info.status for r in runs_of(own, "tracked_elsewhere")] == ["FINISHED"]
    assert not (home / "mlflow.db").exists()


def test_a_submitted_workload_tracks_into_the_home_store_not_its_folder(home, tmp_path):
    workload = tmp_path / "workload"
    workload.mkdir()
    (workload / "job.py").write_text("import os\nprint('store', os.environ['MLFLOW_TRACKING_URI'])\n")
    (workload / "work.yaml").write_text("script: job.py\ngpus: 2\nexperiment: from-a-file\n")
    done = subprocess.run([sys.executable, "-m", "gpufleet", "submit", "--follow", str(workload / "work.yaml")],
                          capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr

    (run,) = runs_of(store_of(home), "job", experiment="from-a-file")
    assert run.info.status == "FINISHED"
    log = mlflow.MlflowClient(store_of(home)).download_artifacts(
        run.info.run_id, "gpufleet/attempt-0/logs/rank-0.log", str(tmp_path / "got"))
    assert f"store {store_of(home)}" in Path(log).read_text(), "the ranks logged into the same store"
    assert sorted(p.name for p in workload.iterdir()) == ["job.py", "work.yaml"]
    assert list(Path.cwd().iterdir()) == []


@pytest.mark.parametrize("value", ["0", "Off"])
def test_gpufleet_tracking_0_switches_tracking_off_even_for_tracking_true(home, monkeypatch, value):
    monkeypatch.setenv("GPUFLEET_TRACKING", value)

    @distributed(gpus=2, tracking=True)
    def switched_off():
        import os

        return os.environ.get("MLFLOW_RUN_ID")

    assert switched_off.distributed() == [None, None]
    assert sorted(p.name for p in home.iterdir() if p.name != "template") == ["runs"], "no store, no artifacts"
    assert list(Path.cwd().iterdir()) == []


def test_a_bad_gpufleet_tracking_is_an_error_before_anything_starts(home, monkeypatch):
    monkeypatch.setenv("GPUFLEET_TRACKING", "maybe")
    job = distributed(gpus=2)(lambda: 1)

    for start in (job.distributed, job.submit):
        with pytest.raises(ConfigError) as info:
            start()
        assert "GPUFLEET_TRACKING='maybe'" in str(info.value)
        assert "0, 1, true, false, on, off, yes, no" in str(info.value)
    assert not home.exists() or not any((home / "runs").glob("*")), "no run was created"


def test_a_failed_calls_run_has_its_logs_timings_and_error_as_artifacts(home, tmp_path):
    @distributed(gpus=2)
    def fails_with_artifacts():
        from gpufleet import runtime

        print(f"rank {runtime.get_global_rank()} read its shard", flush=True)
        if runtime.get_global_rank() == 1:
            raise ValueError("bad batch 7")

    with pytest.raises(RunFailedError):
        fails_with_artifacts.distributed()

    (run,) = runs_of(store_of(home), "fails_with_artifacts")
    assert run.info.status == "FAILED"
    client = mlflow.MlflowClient(store_of(home))
    got = Path(client.download_artifacts(run.info.run_id, "gpufleet", str(tmp_path / "got")))
    files = {p.relative_to(got).as_posix() for p in got.rglob("*") if p.is_file()}
    assert files == {"error.txt", "attempt-0/timings.json", "attempt-0/agent.log", "attempt-0/logs/rank-0.log",
                     "attempt-0/logs/rank-1.log"}, "nothing else: no payload, results or tracking.json"
    error = (got / "error.txt").read_text()
    assert "root cause: rank 1: ValueError: bad batch 7" in error and "Traceback" in error
    assert "rank 0 read its shard" in (got / "attempt-0/logs/rank-0.log").read_text()
    assert 'raise ValueError("bad batch 7")' in (got / "attempt-0/logs/rank-1.log").read_text()
    assert "phases" in json.loads((got / "attempt-0/timings.json").read_text())


def test_a_ray_job_gets_the_submitters_store_and_switch_unless_the_store_is_another_machines_file(
        home, tmp_path, monkeypatch, capsys):
    from gpufleet.runs import cluster, cluster_job  # the submitter's side, the job's supervisor

    monkeypatch.setenv("GPUFLEET_TRACKING", "off")
    shipped = cluster._supervisor_variables()
    assert shipped == {"MLFLOW_TRACKING_URI": store_of(home), "GPUFLEET_TRACKING": "0"}, "its default store too"

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'laptop.db'}")
    cluster_job._store_of_this_node()
    assert tracking.store_uri() == f"sqlite:///{tmp_path / 'laptop.db'}", "same machine: the submitter's"

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:////no/such/laptop/.gpufleet/mlflow.db")
    cluster_job._store_of_this_node()
    assert tracking.store_uri() == store_of(home), "another machine's file: the head's own store"
    assert "/no/such/laptop/.gpufleet/mlflow.db is not on the cluster's head" in capsys.readouterr().err


def test_attached_files_are_bounded_and_never_links_or_payloads(home, tmp_path, monkeypatch, capsys):
    run_folder = tmp_path / "run"
    newest, oldest = run_folder / "attempt-1", run_folder / "attempt-0"
    for folder in (newest / "logs", oldest / "logs", newest / "results"):
        folder.mkdir(parents=True)
    with (newest / "logs" / "rank-0.log").open("wb") as f:  # 25 MiB, sparse but for its end
        f.truncate(25 * 2**20)
        f.seek(0, os.SEEK_END)
        f.write(b"the end of a long log\n")
    (oldest / "logs" / "rank-0.log").write_bytes(b"x" * 2**21)
    (tmp_path / "secret.txt").write_text("s3cr3t")
    (newest / "logs" / "rank-1.log").symlink_to(tmp_path / "secret.txt")
    (newest / "tracking.json").write_text('{"MLFLOW_TRACKING_URI": "https://user:s3cr3t@host"}')
    (newest / "results" / "rank-0.pkl").write_bytes(b"data")
    (newest / "payload.pkl").write_bytes(b"code")
    client = mlflow.MlflowClient(store_of(home))
    tracking._prepare_store(store_of(home))
    run_id = client.create_run(client.create_experiment("sizes", (tmp_path / "art").as_uri())).info.run_id
    monkeypatch.setattr(tracking, "ARTIFACTS_MAX_BYTES", 21 * 2**20)

    tracking.attach(client, run_id, run_folder, None)

    got = Path(client.download_artifacts(run_id, "gpufleet", str(tmp_path / "got")))
    assert [p.relative_to(got).as_posix() for p in got.rglob("*") if p.is_file()] == ["attempt-1/logs/rank-0.log"]
    cut = (got / "attempt-1/logs/rank-0.log").read_bytes()
    assert len(cut) < 20 * 2**20 + 500, "a long file goes as its end only"
    assert cut.startswith(b"[gpufleet: the first") and cut.endswith(b"the end of a long log\n")
    assert "attempt-0/logs/rank-0.log" in capsys.readouterr().err, "what did not fit is named"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def api(port: int, path: str, body: dict) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/api/2.0/mlflow/{path}", method="POST",
                                     data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as answer:
        return json.loads(answer.read())


def wait_until_it_answers(ui: subprocess.Popen, port: int, output: Path) -> None:
    deadline = time.monotonic() + UI_START_S
    while True:
        assert ui.poll() is None, f"gpufleet ui exited {ui.returncode}:\n{output.read_text()}"
        assert time.monotonic() < deadline, f"no answer within {UI_START_S:g} s:\n{output.read_text()}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2) as answer:
                if answer.status == 200:
                    return
        except OSError:
            time.sleep(0.5)


@pytest.mark.timeout(180)
def test_gpufleet_ui_serves_the_home_store_on_loopback_until_ctrl_c(home, tmp_path):
    @distributed(gpus=2)
    def seen_in_the_ui():
        return 1

    seen_in_the_ui.distributed()
    port = free_port()
    output = tmp_path / "ui.log"
    with output.open("w") as log:
        ui = subprocess.Popen([sys.executable, "-m", "gpufleet", "ui", "--port", str(port)],
                              stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until_it_answers(ui, port, output)
        experiments = api(port, "experiments/search", {"max_results": 100})["experiments"]
        (experiment,) = [e["experiment_id"] for e in experiments if e["name"] == "gpufleet"]
        runs = api(port, "runs/search", {"experiment_ids": [experiment]})["runs"]
        assert [r["info"]["status"] for r in runs] == ["FINISHED"]
        assert any(t["value"].endswith("seen_in_the_ui") for t in runs[0]["data"]["tags"])
        listening = [c.laddr.ip for c in psutil.net_connections("tcp")
                     if c.laddr.port == port and c.status == psutil.CONN_LISTEN]
        assert listening == ["127.0.0.1"], "loopback only"
        tree = psutil.Process(ui.pid).children(recursive=True)
        assert tree, "the server runs in processes of its own"
    finally:
        ui.send_signal(signal.SIGINT)  # Ctrl-C
        code = ui.wait(30)
    assert code == 130
    gone, alive = psutil.wait_procs(tree, timeout=15)
    assert not alive, f"left running: {alive}"
    assert f"http://127.0.0.1:{port}/" in output.read_text(), "the URL is printed"
    assert list(Path.cwd().iterdir()) == []
