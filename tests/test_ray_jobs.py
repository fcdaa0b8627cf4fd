"""Runs supervised on a Ray cluster through Ray Jobs (docs/cluster.md, "Runs that live on the
cluster"): a real head started with `ray start --head` and its dashboard, reached only at
its Jobs address (http://127.0.0.1:PORT), as a laptop outside the cluster's network would.

Every submitter and every reader is a separate process with a runs folder of its own, as
separate machines would be; the head keeps its own runs folder (its GPUFLEET_HOME). The
cluster has no GPU, so ranks are CPU processes with gloo. tests/test_cluster_network.py runs
the same across network namespaces.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

ray = pytest.importorskip("ray")

from support import rank_lines, script_env  # noqa: E402

pytestmark = pytest.mark.timeout(180)

CPUS = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def head():
    """A Ray head with its dashboard, started as a user would (`ray start --head`), with the
    `python` of this environment first on its PATH (a job's entrypoint runs `python`). Every
    port it listens on is its own: Ray's fixed defaults (the dashboard agent's 52365, the
    client server's 10001) are taken by whichever Ray instance of the machine came first (a
    test of another worker's), and a head whose agent could not bind its port refuses every job
    ("No available agent to submit job")."""
    folder = Path(tempfile.mkdtemp(prefix="gf-jobs-"))
    home = folder / "home"
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
           "GPUFLEET_HOME": str(home), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    env.pop("RAY_ADDRESS", None)
    port, dashboard = _free_port(), _free_port()
    own_ports = [f"--{name}={_free_port()}" for name in (
        "dashboard-agent-listen-port", "dashboard-agent-grpc-port", "ray-client-server-port",
        "runtime-env-agent-port", "metrics-export-port")]
    ray_cli = str(Path(sys.executable).parent / "ray")
    started = subprocess.run(
        [ray_cli, "start", "--head", f"--port={port}", "--dashboard-host=127.0.0.1",
         f"--dashboard-port={dashboard}", *own_ports, f"--num-cpus={CPUS}", "--num-gpus=0",
         f"--temp-dir={folder / 'ray'}", "--disable-usage-stats", "--include-dashboard=true"],
        env=env, capture_output=True, text=True, timeout=120,
    )
    if started.returncode != 0:
        pytest.fail(f"ray start failed:\n{started.stdout}\n{started.stderr}")
    try:
        yield {"address": f"http://127.0.0.1:{dashboard}", "gcs": f"127.0.0.1:{port}", "home": home, "env": env,
               "session": folder / "ray"}
    finally:
        stop_ray(folder)
        shutil.rmtree(folder, ignore_errors=True)


def stop_ray(folder: Path) -> None:
    """Stop the Ray processes of this head only (`ray stop` would stop every Ray instance of
    the machine): those whose command line names its folder, and what they started."""
    procs = []
    for proc in psutil.process_iter(["cmdline"]):
        if str(folder) in " ".join(proc.info["cmdline"] or ()):
            procs += [proc, *proc.children(recursive=True)]
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    _, alive = psutil.wait_procs(procs, timeout=10)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()


def machine(tmp_path: Path, name: str, head) -> dict[str, str]:
    """The environment of a process on a machine of its own: its own home and runs folder."""
    folder = tmp_path / name
    (folder / "cwd").mkdir(parents=True, exist_ok=True)
    env = script_env(folder, GPUFLEET_HOME=str(folder / "gpufleet"), RAY_AUTH_MODE="disabled")
    env.pop("RAY_ADDRESS", None)
    return env


def run(tmp_path: Path, code: str, name: str, head, *args: str, timeout: float = 150,
        env: dict | None = None) -> subprocess.CompletedProcess:
    folder = tmp_path / name
    env = env or machine(tmp_path, name, head)
    script = folder / "cwd" / "main.py"
    script.write_text(code.replace("ADDRESS", head["address"]))
    return subprocess.run([sys.executable, str(script), *args], cwd=script.parent, env=env,
                          capture_output=True, text=True, timeout=timeout)


def on_head(head, run_id: str) -> Path:
    return head["home"] / "runs" / run_id


def rank_pids(head, run_id: str) -> list[int]:
    folder = on_head(head, run_id)
    attempt = sorted(folder.glob("attempt-*"))[-1]
    return [r["pid"] for r in json.loads((attempt / "cluster.json").read_text())["ranks"]]


def assert_stopped(pids: list[int], within: float = 15.0) -> None:
    deadline = time.monotonic() + within
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
        assert time.monotonic() < deadline, f"rank processes {pids} still run {within:g} s after the run ended"
        time.sleep(0.2)


FOREGROUND = """
import os, sys
from gpufleet import distributed, runtime

@distributed(gpus=2, remote=True, ray_address="ADDRESS", env={"TOKEN": "tok-8c1e0f"})
def train(x):
    runtime.setup()
    print("token seen", os.environ["TOKEN"][::-1], flush=True)  # the value is nowhere in the code
    return x * (runtime.get_global_rank() + 1)

print("values", train.distributed(21))
"""


@pytest.mark.inner  # the inner loop's run of this launcher (tests/suite.py)
def test_a_call_given_a_jobs_address_is_supervised_on_the_cluster(tmp_path, head):
    laptop = machine(tmp_path, "laptop", head)
    laptop.pop("MLFLOW_TRACKING_URI", None)  # the laptop's default store: its $GPUFLEET_HOME/mlflow.db
    done = run(tmp_path, FOREGROUND, "laptop", head, env=laptop)
    assert done.returncode == 0, done.stderr
    assert "values [21, 42]" in done.stdout
    assert all("token seen f0e1c8-kot" in rank_lines(done.stderr, r) for r in (0, 1)), done.stderr
    assert "gpufleet-record" not in done.stderr + done.stdout  # event lines are never shown
    # the run's record lives on the head, under the id of the mirror here
    mirrors = list((tmp_path / "laptop" / "gpufleet" / "runs").iterdir())
    assert len(mirrors) == 1
    record = json.loads((mirrors[0] / "record.json").read_text())
    assert record["status"] == "succeeded" and record["cluster"]["address"] == head["address"]
    assert json.loads((on_head(head, mirrors[0].name) / "record.json").read_text())["status"] == "succeeded"
    # the head tracked it in the store the submitter resolved (its own default), not the head's
    import mlflow

    store = Path(laptop["GPUFLEET_HOME"]).resolve() / "mlflow.db"
    tracked = mlflow.MlflowClient(f"sqlite:///{store}").get_run(record["mlflow_run_id"])
    assert not (head["home"] / "mlflow.db").exists()
    assert tracked.info.status == "FINISHED"
    assert any(key.startswith("system/node0/cpu") for key in tracked.data.metrics), tracked.data.metrics
    # env= values are not in the job's metadata, entrypoint or runtime_env, nor on either disk
    from ray.job_submission import JobSubmissionClient

    job = JobSubmissionClient(head["address"]).get_job_info(record["cluster"]["job"])
    assert "tok-8c1e0f" not in json.dumps([job.metadata, job.entrypoint, job.runtime_env], default=str)
    for folder in (mirrors[0], on_head(head, mirrors[0].name)):
        for path in folder.rglob("*"):
            assert not path.is_file() or b"tok-8c1e0f" not in path.read_bytes(), path
    # with the cluster out of reach, this machine's runs are still listed, as they last were
    gone = f"http://127.0.0.1:{_free_port()}"
    listed = subprocess.run([sys.executable, "-m", "gpufleet", "runs"],
                            env={**machine(tmp_path, "laptop", head), "RAY_ADDRESS": gone},
                            capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0, listed.stderr
    assert f"cannot reach Ray Jobs at {gone}" in listed.stderr and "listing this machine's runs only" in listed.stderr
    assert mirrors[0].name in listed.stdout and "succeeded" in listed.stdout


SUBMIT = """
import sys, time
from gpufleet import distributed, runtime

@distributed(gpus=2, remote=True, ray_address="ADDRESS", detach=True, max_retries=1)
def steps(n):
    import gpufleet
    runtime.setup()
    if runtime.get_attempt() == 0 and runtime.get_global_rank() == 1:
        raise ValueError("first attempt fails on rank 1")
    for i in range(n):
        print("step", i, flush=True)
        time.sleep(0.5)
    return runtime.get_global_rank()

run = steps.submit(int(sys.argv[1]))
print(run.id)
"""

READ = """
import sys, gpufleet
run = gpufleet.attach(sys.argv[1], ray_address="ADDRESS")
print("values", run.result(timeout=120))
print("status", run.status(), len(run.record()["attempts"]))
print("rank1", run.logs(rank=1).split())
"""


def test_a_detached_run_goes_on_after_its_submitter_and_is_read_from_another_machine(tmp_path, head):
    submitted = run(tmp_path, SUBMIT, "laptop", head, "4")
    assert submitted.returncode == 0, submitted.stderr
    run_id = submitted.stdout.split()[-1]
    read = run(tmp_path, READ, "desktop", head, run_id)  # another machine: a runs folder of its own
    assert read.returncode == 0, read.stderr
    assert "values [0, 1]" in read.stdout
    assert "status succeeded 2" in read.stdout  # a retry after rank 1 failed, on the cluster
    assert "rank1 ['step', '0', 'step', '1', 'step', '2', 'step', '3']" in read.stdout
    # the command line reaches it too, and lists it among the cluster's runs
    env = machine(tmp_path, "desktop", head)
    listed = subprocess.run([sys.executable, "-m", "gpufleet", "runs", "--ray-address", head["address"]],
                            env=env, capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0, listed.stderr
    assert any(line.startswith(run_id) and "succeeded" in line for line in listed.stdout.splitlines())
    status = subprocess.run([sys.executable, "-m", "gpufleet", "status", run_id[-6:]],
                            env=env, capture_output=True, text=True, timeout=60)
    assert "attempt-0, attempt-1" in status.stdout and "succeeded" in status.stdout
    followed = subprocess.run([sys.executable, "-m", "gpufleet", "logs", "--follow", "--rank", "0",
                               "--ray-address", head["address"], run_id],
                              env=machine(tmp_path, "phone", head), capture_output=True, text=True, timeout=60)
    assert followed.returncode == 0, followed.stderr
    assert followed.stdout.count("step 3") == 1  # the ended run's last attempt, rank 0 alone


CANCEL = """
import sys, time, gpufleet
run = gpufleet.attach(sys.argv[1], ray_address="ADDRESS")
while "step 2" not in run.logs(rank=0):  # the ranks of the second attempt are at work
    time.sleep(0.2)
print("cancel", run.cancel())
try:
    run.result()
except gpufleet.RunCancelledError as exc:
    print("raised", type(exc).__name__)
"""


def test_cancel_from_another_machine_stops_every_rank(tmp_path, head):
    submitted = run(tmp_path, SUBMIT, "laptop", head, "600")
    run_id = submitted.stdout.split()[-1]
    cancelled = run(tmp_path, CANCEL, "desktop", head, run_id)
    assert "cancel cancelled" in cancelled.stdout, cancelled.stderr
    assert "raised RunCancelledError" in cancelled.stdout
    assert_stopped(rank_pids(head, run_id))
    assert json.loads((on_head(head, run_id) / "record.json").read_text())["status"] == "cancelled"


FAILING = """
from gpufleet import distributed, runtime, RunFailedError

@distributed(gpus=2, remote=True, ray_address="ADDRESS")
def broken():
    runtime.setup()
    if runtime.get_global_rank() == 1:
        raise KeyError("no such column: 'label'")
    return 0

try:
    broken.distributed()
except RunFailedError as exc:
    print("root", exc.root_cause.rank, exc.root_cause.summary)
"""


def test_a_failing_rank_is_the_same_precise_error_as_a_local_run(tmp_path, head):
    done = run(tmp_path, FAILING, "laptop", head)
    assert "root 1 KeyError: \"no such column: 'label'\"" in done.stdout, done.stdout + done.stderr


UNDETACHED = """
import sys, time
from gpufleet import distributed, runtime

@distributed(gpus=2, remote=True, ray_address="ADDRESS")
def forever():
    runtime.setup()
    print("alive", flush=True)
    while True:
        time.sleep(0.5)

run = forever.submit()
while "alive" not in run.logs(rank=1):
    time.sleep(0.2)
print(run.id, flush=True)
"""


def test_a_run_that_was_not_detached_ends_with_its_submitter(tmp_path, head):
    done = run(tmp_path, UNDETACHED, "laptop", head)
    assert done.returncode == 0, done.stderr
    run_id = done.stdout.split()[-1]
    deadline = time.monotonic() + 60
    record = on_head(head, run_id) / "record.json"
    while json.loads(record.read_text())["status"] not in ("cancelled", "lost"):
        assert time.monotonic() < deadline, "the run still runs a minute after its submitter exited"
        time.sleep(0.5)
    assert json.loads(record.read_text())["status"] == "cancelled"
    assert_stopped(rank_pids(head, run_id))


def test_bad_input_fails_before_anything_is_submitted(tmp_path, head):
    too_many = FOREGROUND.replace("gpus=2", f"gpus={CPUS + 1}")
    done = run(tmp_path, too_many, "laptop", head)
    assert done.returncode != 0
    assert f"gpus={CPUS + 1} but the Ray cluster at {head['address']}" in done.stderr
    assert not (tmp_path / "laptop" / "gpufleet" / "runs").exists() or \
        not list((tmp_path / "laptop" / "gpufleet" / "runs").iterdir())
    nowhere = FOREGROUND.replace("ADDRESS", f"http://127.0.0.1:{_free_port()}")
    done = run(tmp_path, nowhere, "laptop", head)
    assert "cannot reach the Ray dashboard at http://127.0.0.1:" in done.stderr


DRIVER = """
import sys, gpufleet
from gpufleet import distributed, runtime

@distributed(gpus=2, remote=True, ray_address=sys.argv[1])
def where():
    import os
    return os.environ.get("GPUFLEET_RAY_JOB")

run = where.submit()
print(type(run).__name__, run.result(timeout=120))
"""


def test_a_submit_from_a_driver_inside_the_cluster_goes_to_ray_jobs(tmp_path, head):
    done = run(tmp_path, DRIVER, "node", head, head["gcs"])  # a GCS address: this process is a driver
    assert done.returncode == 0, done.stderr
    assert "ClusterRun ['1', '1']" in done.stdout  # supervised by the job, which the ranks are part of


OLDER = """
import gpufleet
from gpufleet.launchers import _ray_env

# this submitter stands for a machine with another Python and torch: what it sends says so
_ray_env.origin = lambda: {"python": "3.9.18", "torch": "1.13.1+cu117"}

@gpufleet.distributed(gpus=2, remote=True, ray_address="ADDRESS")
def train():
    return 1

try:
    train.distributed()
except gpufleet.ConfigError as exc:
    print("refused:", exc)
"""


def test_a_head_with_another_python_or_torch_refuses_the_call_before_unpickling_it(tmp_path, head):
    done = run(tmp_path, OLDER, "laptop", head)
    assert "refused:" in done.stdout, done.stdout + done.stderr
    line = done.stdout.split("refused:", 1)[1]
    assert "(the submitter: 3.9.18)" in line and "(the submitter: 1.13.1+cu117)" in line
    assert f"Python {sys.version_info.major}.{sys.version_info.minor}" in line


def test_a_script_and_its_helper_module_outside_the_working_directory_travel(tmp_path, head):
    code = tmp_path / "laptop" / "code"
    code.mkdir(parents=True)
    (code / "helpers.py").write_text("def scale(x):\n    return 10 * x\n")
    (code / "main.py").write_text(
        "import torch, helpers\n"
        "from gpufleet import distributed, runtime\n"
        f"@distributed(gpus=2, remote=True, ray_address={head['address']!r})\n"
        "def f():\n"
        "    return helpers.scale(runtime.get_global_rank() + 1)\n"
        "print('values', f.distributed())\n"
    )
    env = machine(tmp_path, "laptop", head)
    done = subprocess.run([sys.executable, str(code / "main.py")], cwd=tmp_path / "laptop" / "cwd",
                          env=env, capture_output=True, text=True, timeout=150)
    assert "values [10, 20]" in done.stdout, done.stderr


SECRETIVE = """
import hashlib, os, sys
from gpufleet import distributed, runtime

# the value comes from the submitter's environment: neither this script nor the function,
# both shipped to the cluster, holds it
@distributed(gpus=2, remote=True, ray_address="ADDRESS", detach=True,
             env={"MY_TOKEN": os.environ.pop("SUBMITTED_TOKEN")})
def digest():
    runtime.setup()
    return hashlib.sha256(os.environ["MY_TOKEN"].encode()).hexdigest()

print(digest.submit().id)
"""

# A plain driver of the cluster, as anyone who can run code on it (a job submitted through the
# dashboard) is: every key of every namespace of Ray's internal key-value store, each value
# read whole and, where it is a zip (an uploaded package), each of its files.
READ_RAY_KV = """
import io, sys, zipfile
import ray
from ray._private import ray_constants
from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_list

ray.init(address=sys.argv[1], logging_level="ERROR")
namespaces = {None, *(v for k, v in vars(ray_constants).items() if k.startswith("KV_NAMESPACE_"))}
packages = 0
for namespace in namespaces:
    for key in _internal_kv_list(b"", namespace=namespace):
        value = _internal_kv_get(key, namespace=namespace) or b""
        texts = [value]
        if zipfile.is_zipfile(io.BytesIO(value)):
            packages += 1
            with zipfile.ZipFile(io.BytesIO(value)) as package:
                texts += [package.read(name) for name in package.namelist()]
        for marker in sys.argv[2:]:
            if any(marker.encode() in text for text in texts):
                print("FOUND", marker, "in", namespace, key)
print("packages", packages)
"""


def test_secrets_of_a_ray_job_are_left_nowhere_on_the_cluster(tmp_path, head):
    """env= values and the MLflow settings reach the run on the cluster, and once it ended
    neither Ray's key-value store (where it keeps uploaded packages) nor any file of the
    head's Ray session folder or gpufleet home holds them."""
    token, password = "tok-7d1e9a4c0b5f", "mlpw-3f8e26c1d4a0"
    laptop = machine(tmp_path, "laptop", head)
    laptop.update(SUBMITTED_TOKEN=token, MLFLOW_TRACKING_PASSWORD=password)
    submitted = run(tmp_path, SECRETIVE, "laptop", head, env=laptop)
    assert submitted.returncode == 0, submitted.stderr
    read = run(tmp_path, READ, "desktop", head, submitted.stdout.split()[-1])
    assert f"values {[hashlib.sha256(token.encode()).hexdigest()] * 2}" in read.stdout, read.stderr

    # the run was tracked: its MLflow settings, whose URI may hold a password, were used
    run_folder = on_head(head, submitted.stdout.split()[-1])
    assert json.loads((run_folder / "record.json").read_text())["mlflow_run_id"]
    assert not list(run_folder.rglob("tracking.json")), "the ranks' copy of the MLflow URI stayed"
    found = run(tmp_path, READ_RAY_KV, "node", head, head["gcs"], token, password)
    assert found.returncode == 0, found.stderr
    assert "FOUND" not in found.stdout, found.stdout
    assert int(found.stdout.split("packages")[-1]) > 0, found.stdout  # the read saw the run's code
    for folder in (head["session"], head["home"]):
        for path in folder.rglob("*"):
            if path.is_file():
                data = path.read_bytes()
                assert token.encode() not in data and password.encode() not in data, path
