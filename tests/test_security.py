"""docs/security.md, checked: private run folders, untrusted payloads refused, loopback-only
sockets, secrets kept off disk, damaged results refused."""

from __future__ import annotations

import os
import pickle
import stat
import subprocess
import sys

import pytest

from gpufleet import GpufleetError, distributed, runtime
from gpufleet.payload import dump_call, write_private
from gpufleet.rundir import RunDir
from gpufleet.watch.outcome import collect

pytestmark = pytest.mark.timeout(60)


def test_every_file_and_folder_of_a_run_is_private(tmp_path):
    def work():
        runtime.setup(timeout=30)
        print("a log line")
        return runtime.get_global_rank()

    runs = tmp_path / "runs"
    distributed(gpus=2, runs_dir=runs, logs="none")(work).distributed()

    (run,) = runs.iterdir()
    entries = [run, *run.rglob("*")]
    assert len(entries) > 10
    for path in entries:
        mode = stat.S_IMODE(path.lstat().st_mode)
        expected = 0o700 if path.is_dir() else 0o600
        assert mode == expected, f"{path.relative_to(runs)} has mode {oct(mode)}"


def test_a_runs_folder_others_can_write_is_refused_before_launch(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)

    with pytest.raises(GpufleetError, match="chmod 700"):
        distributed(gpus=2, runs_dir=shared)(lambda: None).distributed()
    assert list(shared.iterdir()) == []


def _planted_run(tmp_path, marker):
    """A run folder as gpufleet makes it, with a payload that would create ``marker``."""
    run = RunDir.create(tmp_path / "runs", "planted")
    write_private(run.payload, dump_call(lambda: open(marker, "w").close(), (), {}))
    return run


def _start_rank(run):
    """A rank's entry run by hand on the folder, as the agent's template would run it."""
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    cmd = [sys.executable, "-c", "import sys; from gpufleet.rank import worker; worker.main(sys.argv[1])",
           str(run.path)]
    return subprocess.run(cmd, env=env, timeout=60)


@pytest.mark.parametrize("tamper", ["group-writable payload", "foreign owner", "open folder"])
def test_a_rank_refuses_a_payload_it_cannot_trust(tmp_path, tamper):
    marker = tmp_path / "payload-ran"
    run = _planted_run(tmp_path, marker)
    if tamper == "group-writable payload":
        run.payload.chmod(0o660)
    elif tamper == "foreign owner":
        if os.getuid() != 0:
            pytest.skip("changing a file's owner needs root")
        os.chown(run.payload, 4242, 4242)
    else:
        run.path.chmod(0o755)

    assert _start_rank(run).returncode != 0
    assert not marker.exists(), "the untrusted payload was executed"
    status, failure = pickle.loads(run.result(0).read_bytes())
    assert status == "error"
    assert any(s in failure.summary for s in ("refusing to load", "open to other users")), (
        failure.summary
    )


def test_the_same_payload_untampered_runs(tmp_path):
    marker = tmp_path / "payload-ran"
    run = _planted_run(tmp_path, marker)

    assert _start_rank(run).returncode == 0
    assert marker.exists()


def test_a_local_run_listens_on_loopback_only(tmp_path):
    def listening_addresses():
        import psutil
        import torch.distributed as dist

        runtime.setup(timeout=30)
        dist.barrier()  # every rank's sockets are up
        agent = next(p for p in psutil.Process().parents()
                     if any("_elastic_agent" in part for part in p.cmdline()))
        processes = [agent, *agent.children(recursive=True)]
        addresses = {
            conn.laddr.ip
            for proc in processes
            for conn in proc.net_connections(kind="inet")
            if conn.status == psutil.CONN_LISTEN
        }
        dist.barrier()  # nobody exits while another rank still looks
        return addresses

    results = distributed(gpus=2, runs_dir=tmp_path / "runs")(listening_addresses).distributed()

    assert results[0], "no listening socket found: the check itself is broken"
    assert all(addresses == {"127.0.0.1"} for addresses in results), results


def test_credentials_reach_the_ranks_but_no_file_of_the_run(tmp_path, monkeypatch):
    token, password = "tok-5f2c9e1a77", "pw-0d93b6c4e2"
    monkeypatch.setenv("SERVICE_API_TOKEN", token)

    def read_secrets():
        import os

        runtime.setup(timeout=30)
        print("training without printing secrets")
        if runtime.get_global_rank() == 1:
            raise RuntimeError("a failure, to exercise error records")
        return os.environ["SERVICE_API_TOKEN"], os.environ["DB_PASSWORD"]

    job = distributed(gpus=2, runs_dir=tmp_path / "runs", env={"DB_PASSWORD": password})
    with pytest.raises(GpufleetError) as info:
        job(read_secrets).distributed()

    assert token not in str(info.value) and password not in str(info.value)
    (run,) = (tmp_path / "runs").iterdir()
    for path in run.rglob("*"):
        if path.is_file() and path.parent.name != "results":
            content = path.read_bytes()
            assert token.encode() not in content and password.encode() not in content, path

    seen = distributed(gpus=1, runs_dir=tmp_path / "ok", env={"DB_PASSWORD": password})(
        lambda: (os.environ["SERVICE_API_TOKEN"], os.environ["DB_PASSWORD"])
    ).distributed()
    assert seen == [(token, password)]


def test_a_damaged_result_file_is_refused_with_a_clear_error(tmp_path):
    run = RunDir.create(tmp_path / "runs", "damaged")
    whole = pickle.dumps(("ok", list(range(1000))))
    write_private(run.result(0), whole[: len(whole) // 2])

    with pytest.raises(GpufleetError, match="rank 0.*damaged"):
        collect(run, world_size=1)


def test_gpufleet_home_and_its_folders_are_created_private(tmp_path, monkeypatch):
    home = tmp_path / "fresh" / "gpufleet-home"  # neither exists yet
    monkeypatch.setenv("GPUFLEET_HOME", str(home))
    monkeypatch.setenv("GPUFLEET_VIRTUAL_GPUS", "2")  # so that device locks are made too
    distributed(gpus=1, logs="none", tracking=False)(lambda: None).distributed()

    made = [home.parent, home, *home.iterdir()]
    assert {p.name for p in made} >= {"gpufleet-home", "runs", "devices"}
    for path in made:
        assert stat.S_IMODE(path.stat().st_mode) == 0o700, f"{path} is {oct(path.stat().st_mode)}"


def test_a_gpufleet_home_others_can_write_is_refused(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    home.chmod(0o777)  # as another user could have made it
    monkeypatch.setenv("GPUFLEET_HOME", str(home))
    with pytest.raises(GpufleetError) as info:
        distributed(gpus=1, logs="none", tracking=False)(lambda: None).distributed()
    assert str(home) in str(info.value) and "chmod 700" in str(info.value)
    assert list(home.iterdir()) == [], "nothing may be created in it"


def test_an_mlflow_store_gpufleet_creates_is_private(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    store = tmp_path / "tracking.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{store}")
    distributed(gpus=1, runs_dir=tmp_path / "runs", logs="none", tracking=True)(lambda: 1).distributed()

    import mlflow

    runs = mlflow.MlflowClient(f"sqlite:///{store}").search_runs(
        [e.experiment_id for e in mlflow.MlflowClient(f"sqlite:///{store}").search_experiments()])
    assert len(runs) == 1, "the store created private must still be MLflow's store"
    assert stat.S_IMODE(store.stat().st_mode) == 0o600


def test_a_gpufleet_home_that_is_a_link_is_followed_to_a_folder_that_must_be_private(
    tmp_path, monkeypatch
):
    """Linking ~/.gpufleet to a larger disk is the user's choice; the folder linked to is
    checked as the home itself would be."""
    target = tmp_path / "bigdisk" / "gpufleet"
    target.mkdir(parents=True, mode=0o700)
    link = tmp_path / "home-link"
    link.symlink_to(target)
    monkeypatch.setenv("GPUFLEET_HOME", str(link))
    job = distributed(gpus=1, logs="none", tracking=False)(lambda: 7)
    assert job.distributed() == [7]
    assert len(list((target / "runs").iterdir())) == 1

    target.chmod(0o777)
    with pytest.raises(GpufleetError, match="chmod 700"):
        job.distributed()
