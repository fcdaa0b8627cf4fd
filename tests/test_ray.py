"""remote=True on a real multi-node Ray cluster on this machine: ray.cluster_utils.Cluster
with a head node and two worker nodes of two logical GPUs each (accelerator H100). The GPUs
are Ray's bookkeeping only, so the ranks run on CPU with gloo, as any CPU run does.

The cluster is started once for the module, before any test's leftover-process window opens
(conftest), and its own processes are Ray's, not a test's. What a test starts (actors, ranks,
a node of its own) must be gone when it ends; every test also checks that the cluster got
every GPU back and holds no gpufleet placement group. One test runs a script with no address,
so that gpufleet starts a local Ray instance of its own, which must end with the script.
"""

from __future__ import annotations

import _thread
import contextlib
import importlib
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

# Ray reads this once, when it is imported: every node of the test cluster binds to 127.0.0.1.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.placement_group import (placement_group, placement_group_table,  # noqa: E402
                                      remove_placement_group)

from gpufleet import (ConfigError, RunFailedError, RunHangError, RunPreemptedError,  # noqa: E402
                      RunTimeoutError, distributed, runtime)
from gpufleet.errors import GpufleetError  # noqa: E402
from gpufleet.launchers import _ray_env, _ray_node  # noqa: E402
from gpufleet.launchers import ray as ray_launcher  # noqa: E402
from support import line_of, script_env, terminal_stdout  # noqa: E402

pytestmark = pytest.mark.timeout(120)

NODES, GPUS_PER_NODE = 2, 2
RELEASE_S = 15.0  # for the actors and the placement group to be gone after a call


@pytest.fixture(scope="module")
def cluster():
    """A measured recipe for a cluster on one machine: every node on 127.0.0.1, no token file in the
    home folder, Ray's files in a folder of its own (short: Ray's socket paths must fit).
    The nodes' temporary folder is in it too: a rank lost with its node leaves its node's
    copy of the run there, as a dead machine would."""
    folder = tempfile.mkdtemp(prefix="gf-ray-")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_AUTH_MODE", "disabled")
        env.setenv("RAY_TMPDIR", folder)
        env.delenv("RAY_ADDRESS", raising=False)
        with pytest_handlers_kept():
            started = Cluster(initialize_head=True, head_node_args={
                "num_cpus": 1, "num_gpus": 0, "include_dashboard": False,
            })
        started.nodes_tmp = os.path.join(folder, "tmp")
        os.mkdir(started.nodes_tmp)
        try:
            for _ in range(NODES):
                add_gpu_node(started)
            with pytest_handlers_kept():
                ray.init(address=started.address, logging_level="WARNING", log_to_driver=False)
            yield started
        finally:
            ray.shutdown()
            started.shutdown()
            shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def pytest_handlers_kept():
    """Each node made here and ray.init install a SIGTERM handler in the test process that
    outlives the module (ray.init's raises SystemExit): pytest's own is put back at once."""
    kept = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in kept.items():
            if handler is not None:
                signal.signal(sig, handler)


def add_gpu_node(cluster):
    with pytest_handlers_kept():
        return cluster.add_node(num_cpus=GPUS_PER_NODE, num_gpus=GPUS_PER_NODE,
                                resources={"accelerator_type:H100": 1},
                                env_vars={"TMPDIR": cluster.nodes_tmp})


@pytest.fixture(autouse=True)
def working_dir(tmp_path, monkeypatch):
    """Calls ship their working directory: a small one, never the repository."""
    folder = tmp_path / "cwd"
    folder.mkdir()
    monkeypatch.chdir(folder)


@pytest.fixture(autouse=True)
def released(request):
    """After each test that used the cluster: every GPU free, no gpufleet placement group."""
    yield
    if "cluster" not in request.fixturenames:
        return
    deadline = time.monotonic() + RELEASE_S
    while True:
        groups = [g["name"] for g in placement_group_table().values()
                  if g["name"].startswith("gpufleet-") and g["state"] != "REMOVED"]
        free, total = ray.available_resources().get("GPU", 0), ray.cluster_resources().get("GPU", 0)
        if not groups and free == total:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"{RELEASE_S:g} s after the test: placement groups {groups}, "
                        f"{free:g} of {total:g} GPUs free")
        time.sleep(0.2)


def layout(run_dir: Path) -> list[dict]:
    return json.loads((run_dir / ray_launcher.CLUSTER_FILE).read_text())["ranks"]


def remote(fn, runs_dir, **options):
    options = {"remote": True, "runs_dir": runs_dir, "timeout": 90, **options}
    return distributed(**options)(fn)


# ---------------------------------------------------------------------------- runs


def test_ranks_are_ordered_by_node_then_gpu_with_torchrun_variables(cluster, runs_dir, capsys):
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK",
            "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES", "MLFLOW_RUN_ID")

    def report():
        import torch
        import torch.distributed as dist

        runtime.setup(timeout=30)
        total = torch.tensor([float(runtime.get_global_rank())])
        dist.all_reduce(total)
        print(f"hello from rank {runtime.get_global_rank()}")
        from gpufleet import log_metrics

        log_metrics({"sum": total.item()}, step=7)  # rank 0's, for the status line
        return {"sum": total.item(), **{k: os.environ.get(k) for k in keys}}

    fn = remote(report, runs_dir)
    results = fn.distributed()

    placed = layout(fn.last_run)
    assert [r["RANK"] for r in results] == ["0", "1", "2", "3"]
    assert all(r["sum"] == 6.0 for r in results)  # one gloo group across both nodes
    assert placed[0]["node_id"] == placed[1]["node_id"] != placed[2]["node_id"] == placed[3]["node_id"]
    assert [r["NODE_RANK"] for r in results] == [r["GROUP_RANK"] for r in results] == ["0", "0", "1", "1"]
    assert [r["LOCAL_RANK"] for r in results] == ["0", "1", "0", "1"]
    assert {(r["WORLD_SIZE"], r["LOCAL_WORLD_SIZE"]) for r in results} == {("4", "2")}
    assert {r["MASTER_ADDR"] for r in results} == {placed[0]["ip"]}
    assert len({r["MASTER_PORT"] for r in results}) == 1 and results[0]["MASTER_PORT"].isdigit()
    for result, place in zip(results, placed):  # cuda:LOCAL_RANK is the GPU Ray gave the rank
        assert result["CUDA_VISIBLE_DEVICES"].split(",")[int(result["LOCAL_RANK"])] == place["gpus"][0]
    assert [p["gpus"] for p in placed] == [["0"], ["1"], ["0"], ["1"]]
    assert len({r["MLFLOW_RUN_ID"] for r in results}) == 1  # the call's run reached every node
    captured = capsys.readouterr()
    for rank in range(4):
        assert f"[rank {rank}] hello from rank {rank}" in captured.out
    assert "4 ranks on 2 nodes" in captured.err
    progress = json.loads((fn.last_run / "progress.json").read_text())
    assert (progress["step"], progress["metrics"]) == (7, {"sum": 6.0}), "rank 0's progress mirrored"
    # each node's first rank sampled its host; the lines were mirrored here and logged
    samples = [json.loads(line) for line in (fn.last_run / "telemetry.jsonl").read_text().splitlines()]
    assert {s["node"] for s in samples} == {0, 1} and all(s["gpus"] == [] for s in samples)
    if importlib.util.find_spec("mlflow") is not None:
        import mlflow

        metrics = mlflow.MlflowClient().get_run(results[0]["MLFLOW_RUN_ID"]).data.metrics
        assert {f"system/node{n}/cpu_utilization_percent" for n in (0, 1)} <= set(metrics), metrics


def test_a_remote_sweep_packs_its_trials_onto_the_clusters_gpus(cluster, runs_dir):
    import io

    import gpufleet

    def trial(index):
        import time

        runtime.setup(timeout=30)
        began = time.time()
        time.sleep(1)
        return index, runtime.get_global_rank(), began, time.time()

    sweep = gpufleet.sweep(remote(trial, runs_dir, gpus=2), range(3), out=io.StringIO())
    results = sweep.results()
    assert [[(i, rank) for i, rank, *_ in ranks] for ranks in results] == [[(n, 0), (n, 1)] for n in range(3)]
    windows = [ranks[0][2:] for ranks in results]  # when each trial's ranks held their GPUs
    at_once = max(sum(start <= m < end for start, end in windows) for m, _ in windows)
    assert at_once <= 2, f"4 GPUs hold two trials of 2 at once, never three: {windows}"


def test_the_status_line_counts_the_ranks_alive_on_their_nodes(cluster, runs_dir, monkeypatch):
    screen = terminal_stdout(monkeypatch)

    def steady():
        from gpufleet import log_metrics

        runtime.setup(timeout=30)
        log_metrics({"loss": 0.5}, step=3)
        for _ in range(40):
            time.sleep(0.1)
            runtime.step(samples=2)

    fn = remote(steady, runs_dir)
    fn.distributed()
    shown = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", screen.getvalue())
    assert re.search(r" · 4/4 ranks alive · \d:\d\d:\d\d · step 3 · loss 0.5", shown), shown
    summary = json.loads((fn.last_run / "steps.json").read_text())  # mirrored from the nodes
    assert [(row["rank"], row["steps"], row["samples"]) for row in summary["ranks"]] == [
        (rank, 40, 80) for rank in range(4)]


def test_an_exception_on_the_second_node_names_rank_node_and_traceback(cluster, runs_dir):
    def fails_on_the_second_node():
        runtime.setup(timeout=30)
        if runtime.get_node_rank() == 1 and runtime.get_local_rank() == 0:
            raise ValueError("bad shard on the second node")  # raise-here
        time.sleep(300)

    fn = remote(fails_on_the_second_node, runs_dir)
    started = time.monotonic()
    with pytest.raises(RunFailedError) as info:
        fn.distributed()
    assert time.monotonic() - started < 60  # the others were stopped, not waited for

    error = info.value
    root = error.root_cause
    assert root.rank == 2 and layout(fn.last_run)[2]["node_rank"] == 1
    assert root.summary == "ValueError: bad shard on the second node"
    assert root.host.startswith("node 1: ")
    assert f'{__file__}", line {line_of(__file__, "raise-here")}' in root.traceback
    assert error.stopped == [0, 1, 3]
    assert isinstance(error.__cause__, ValueError)
    assert "rank 2: ValueError: bad shard on the second node (node 1: " in str(error)


def test_local_modules_and_the_working_directory_travel_through_runtime_env(
        cluster, runs_dir, tmp_path, monkeypatch):
    project, work = tmp_path / "project", tmp_path / "work"
    project.mkdir()
    work.mkdir()
    (project / "shipped_helpers.py").write_text("SCALE = 7\n")
    (work / "settings.txt").write_text("read from the working directory\n")
    monkeypatch.syspath_prepend(str(project))
    monkeypatch.chdir(work)
    monkeypatch.setenv("ONLY_IN_THE_CALLER", "1")  # the caller's environment does not travel
    monkeypatch.delitem(sys.modules, "shipped_helpers", raising=False)
    importlib.import_module("shipped_helpers")  # the caller uses it: it must be shipped

    def uses_them():
        import shipped_helpers

        if runtime.get_attempt() == 0 and runtime.get_global_rank() == 1:
            raise RuntimeError("the first attempt fails")
        return {
            "scale": shipped_helpers.SCALE,
            "module": shipped_helpers.__file__,
            "settings": Path("settings.txt").read_text().strip(),
            "greeting": os.environ.get("GREETING"),
            "caller_only": os.environ.get("ONLY_IN_THE_CALLER"),
            "attempt": runtime.get_attempt(),
        }

    results = remote(uses_them, runs_dir, env={"GREETING": "hello"}, max_retries=1).distributed()

    for result in results:
        assert result["scale"] == 7
        assert not result["module"].startswith(str(project))  # Ray's copy, not the caller's file
        assert "runtime_resources" in result["module"]
        assert result["settings"] == "read from the working directory"
        assert (result["greeting"], result["caller_only"]) == ("hello", None)
        assert result["attempt"] == 1  # attempt 0 failed; the retry ran the whole group again
    monkeypatch.delitem(sys.modules, "shipped_helpers")


def test_a_silent_remote_run_is_diagnosed_as_a_hang_from_the_ranks_own_stacks(cluster, runs_dir):
    def silent():
        runtime.setup(timeout=30)
        print("started", flush=True)
        time.sleep(300)  # sleeps-here

    with pytest.raises(RunHangError) as info:
        remote(silent, runs_dir, hang_timeout=3).distributed()
    text = str(info.value)
    assert "no progress for hang_timeout=3 s" in text
    assert f"test_ray.py:{line_of(__file__, 'sleeps-here')} in silent" in text  # read on the nodes


def test_ctrl_c_stops_every_rank_and_releases_the_cluster(cluster, runs_dir):
    def forever():
        runtime.setup(timeout=30)
        print("running", flush=True)
        time.sleep(300)

    fn = remote(forever, runs_dir, gpus=2)

    def interrupt_once_running():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            logs = list((fn.last_run or Path("/nonexistent")).glob("logs/rank-*.log"))
            if len(logs) == 2 and all("running" in log.read_text() for log in logs):
                _thread.interrupt_main()
                return
            time.sleep(0.1)

    threading.Thread(target=interrupt_once_running, daemon=True).start()
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        fn.distributed()
    assert time.monotonic() - started < 60


def test_a_sigterm_to_the_caller_reaches_the_ranks_on_their_nodes(cluster, runs_dir):
    def until_asked():
        runtime.setup(timeout=30)
        print("running", flush=True)
        while not runtime.should_stop():  # a collective: the same answer on every rank
            time.sleep(0.2)
        return f"rank {runtime.get_global_rank()} stopped"

    fn = remote(until_asked, runs_dir, gpus=2, grace_period=30)

    def terminate_once_running():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            logs = list((fn.last_run or Path("/nonexistent")).glob("logs/rank-*.log"))
            if len(logs) == 2 and all("running" in log.read_text() for log in logs):
                os.kill(os.getpid(), signal.SIGTERM)  # the call's handler takes it
                return
            time.sleep(0.1)

    threading.Thread(target=terminate_once_running, daemon=True).start()
    with pytest.raises(RunPreemptedError) as info:
        fn.distributed()
    assert info.value.results == ["rank 0 stopped", "rank 1 stopped"]


def test_a_node_removed_mid_run_is_reported_as_lost(cluster, runs_dir):
    node = add_gpu_node(cluster)  # the test's own node: its processes end with it

    def steady():
        import torch
        import torch.distributed as dist

        runtime.setup(timeout=60)
        print("training", flush=True)
        for _ in range(600):
            dist.all_reduce(torch.ones(1))
            time.sleep(0.1)

    fn = remote(steady, runs_dir, gpus=NODES * GPUS_PER_NODE + GPUS_PER_NODE)
    removed_at = []

    def remove_once_training():
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            run = fn.last_run
            logs = list(run.glob("logs/rank-*.log")) if run else []
            if len(logs) == 6 and all("training" in log.read_text() for log in logs):
                cluster.remove_node(node, allow_graceful=False)
                removed_at.append(time.monotonic())
                return
            time.sleep(0.1)

    remover = threading.Thread(target=remove_once_training, daemon=True)
    remover.start()
    try:
        with pytest.raises(RunFailedError) as info:
            fn.distributed()
    finally:
        remover.join(30)
        if node in cluster.worker_nodes:
            cluster.remove_node(node)
    assert removed_at, "the node was never removed"
    assert time.monotonic() - removed_at[0] < 30, f"found {time.monotonic() - removed_at[0]:.1f} s after"

    placed = layout(fn.last_run)
    on_node = {p["rank"] for p in placed if p["node_id"] == node.node_id}
    assert len(on_node) == GPUS_PER_NODE
    error, root = info.value, info.value.root_cause
    assert root.kind == "lost" and root.rank in on_node, error
    assert "lost with its node" in root.summary or "its Ray actor is gone" in root.summary
    assert root.host.startswith(f"node {placed[root.rank]['node_rank']}: ")
    # Its peers fail with gloo errors (the echo, after it) or are stopped; a rank whose
    # actor outlived the node's raylet for a moment may be one of them.
    for failure in error.failures[1:]:
        assert failure.kind == "lost" and failure.rank in on_node or failure.collateral, error


@pytest.mark.inner  # the inner loop's run of this launcher (tests/suite.py)
def test_without_an_address_a_local_ray_instance_serves_the_call_and_ends_with_the_process(
        run_script, tmp_path):
    ray_files = tempfile.mkdtemp(prefix="gf-ray-")
    env = script_env(tmp_path, RAY_TMPDIR=ray_files, RAY_AUTH_MODE="disabled")
    env.pop("RAY_ADDRESS", None)
    try:
        result = run_script(f"""
            from gpufleet import distributed, runtime

            def rank():
                return runtime.get_global_rank()

            print(distributed(gpus=2, remote=True, runs_dir={str(tmp_path / "runs")!r})(rank).distributed())
        """, env=env, timeout=90)
    finally:
        shutil.rmtree(ray_files, ignore_errors=True)
    assert result.returncode == 0, result.explain()
    assert "[0, 1]" in result.stdout
    assert "2 ranks on 1 node of the Ray cluster" in result.stderr
    # and every process of that instance is gone with the script (the leftover check)


HANDLERS_SCRIPT = """
import signal
import sys

from gpufleet import distributed, runtime


def on_sigterm(signum, frame):
    print("the script's own SIGTERM handler", flush=True)


def on_sigint(signum, frame):
    print("the script's own SIGINT handler", flush=True)


signal.signal(signal.SIGTERM, on_sigterm)
signal.signal(signal.SIGINT, on_sigint)


def rank():
    return runtime.get_global_rank()


fn = distributed(gpus=2, remote=True, ray_address=sys.argv[1], runs_dir=sys.argv[2],
                 timeout=90)(rank)
print("RESULT", fn.distributed(), flush=True)
now = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
print("HANDLERS", "KEPT" if now == (on_sigterm, on_sigint) else f"CHANGED: {now}", flush=True)
"""


def test_a_remote_call_leaves_the_callers_signal_handlers_as_they_were(cluster, run_script,
                                                                      tmp_path):
    result = run_script(HANDLERS_SCRIPT, cluster.address, tmp_path / "runs", timeout=90,
                        env=script_env(tmp_path))
    assert result.returncode == 0, result.explain()
    assert "RESULT [0, 1]" in result.stdout, result.explain()
    assert "HANDLERS KEPT" in result.stdout, result.explain()


# ---------------------------------------------------------------------------- refusals


def test_too_few_gpus_in_the_cluster_fail_before_anything_starts(cluster, runs_dir):
    cases = [
        ({"gpus": 9}, ["gpus=9", "4 GPUs for ranks in all", "gpus=4 or fewer"]),
        ({"gpus": 3, "placement": "strict_pack"}, ["strict_pack", "one node with 3 GPUs"]),
        ({"gpus": 3, "placement": "strict_spread"}, ["strict_spread", "3 nodes"]),
        ({"gpus": 2, "gpu_type": "A10"}, ["gpu_type='A10'", "H100"]),
        ({"gpus": 2, "ray_address": "127.0.0.1:1"}, ["already connected", cluster.address]),
    ]
    for options, words in cases:
        started = time.monotonic()
        with pytest.raises(ConfigError) as info:
            remote(lambda: None, runs_dir, **options).distributed()
        assert time.monotonic() - started < 5
        for word in words:
            assert word in str(info.value), (options, str(info.value))
    assert not runs_dir.exists() or not any(runs_dir.iterdir())  # no run was even created


def test_a_busy_cluster_is_waited_for_visibly_then_times_out(cluster, runs_dir, capsys):
    held = placement_group([{"GPU": 1, "CPU": 1}] * (NODES * GPUS_PER_NODE))
    ray.get(held.ready(), timeout=30)
    try:
        started = time.monotonic()
        with pytest.raises(RunTimeoutError) as info:
            remote(lambda: None, runs_dir, gpus=2, placement_timeout=3).distributed()
        elapsed = time.monotonic() - started
    finally:
        remove_placement_group(held)
    assert 3 <= elapsed < 15
    assert "placement_timeout=3 s for 2 GPUs" in str(info.value)
    assert "0 free now" in str(info.value)
    assert "gpufleet: waiting for 2 GPUs in the Ray cluster" in capsys.readouterr().err


# ---------------------------------------------------------------------------- pure parts


def test_ranks_order_by_node_address_then_gpu_id():
    def node(node_id, ip, gpu):
        return {"node_id": node_id, "ip": ip, "gpus": [gpu], "hostname": "h", "cpus": 8,
                "interface": "eth0"}

    described = [node("b", "10.0.0.2", "1"), node("a", "10.0.0.10", "0"),
                 node("b", "10.0.0.2", "0"), node("a", "10.0.0.10", "3")]
    slots = ray_launcher.order_ranks(described)

    assert [(s.bundle, s.node_rank, s.local_rank) for s in slots] == [
        (2, 0, 0), (0, 0, 1), (1, 1, 0), (3, 1, 1)]
    env = ray_launcher.rank_env({"OMP_NUM_THREADS": "3"}, slots[3], slots, 29400, "run-x")
    assert env["CUDA_VISIBLE_DEVICES"] == "0,3" and env["LOCAL_RANK"] == "1"
    assert (env["RANK"], env["NODE_RANK"], env["MASTER_ADDR"]) == ("3", "1", "10.0.0.2")
    assert (env["OMP_NUM_THREADS"], env["NCCL_SOCKET_IFNAME"]) == ("3", "eth0")  # the user's value wins


def test_nodes_with_another_python_or_torch_are_refused_by_name():
    import platform

    same = {"python": platform.python_version(), "torch": _ray_node.version("torch"),
            "cloudpickle": "3.1.0"}
    _ray_env.check_versions({"node 0: a 10.0.0.1": same})
    with pytest.raises(ConfigError) as info:
        _ray_env.check_versions({
            "node 0: a 10.0.0.1": same,
            "node 1: b 10.0.0.2": {"python": "3.8.10", "torch": "1.13.1", "cloudpickle": None},
        })
    text = str(info.value)
    assert "node 1: b 10.0.0.2: Python 3.8.10, torch 1.13.1, no cloudpickle" in text
    assert "node 0" not in text


def test_the_pip_snapshot_pins_this_environment_but_not_the_clusters_own_packages():
    import cloudpickle

    snapshot = _ray_env.pip_snapshot()
    names = {r.split("==")[0].split(" @ ")[0].lower() for r in snapshot}
    assert f"cloudpickle=={cloudpickle.__version__}" in snapshot
    assert not names & {"ray", "torch", "gpufleet", "pip"}
    assert not any(n.startswith("nvidia-") for n in names)


def test_bad_runtime_env_fails_before_anything_starts(cluster, runs_dir):
    with pytest.raises(GpufleetError) as info:
        remote(lambda: None, runs_dir, gpus=2,
               runtime_env={"working_dir": "/no/such/folder"}).distributed()
    assert "/no/such/folder" in str(info.value)
