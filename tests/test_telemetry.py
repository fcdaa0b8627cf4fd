"""Telemetry from the nodes that train: host CPU and memory, and the GPUs the run holds only,
sampled by one sampler per node, logged into the call's MLflow run, shown by the live status
line and `gpufleet status`. On this CPU machine the GPU part must be absent, quietly; the GPU
part runs in benchmarks/telemetry_gpu.py on a GPU machine."""

from __future__ import annotations

import json
import re
import socket

import pytest
from support import terminal_stdout

from gpufleet import cli, distributed, runtime
from gpufleet.telemetry import describe_gpus, held_gpus

pytestmark = pytest.mark.timeout(120)

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
UUIDS = [f"GPU-{i}{i}{i}{i}aaaa-0000-1111-2222-33334444555{i}" for i in range(8)]


def busy_for(seconds: float):
    """A 2-rank function that keeps its CPUs busy, then says whether its process samples."""

    def train():
        import threading
        import time

        runtime.setup(timeout=30)
        end = time.time() + seconds
        while time.time() < end:
            sum(i * i for i in range(10_000))
        return [t.name for t in threading.enumerate() if t.name == "gpufleet-telemetry"]

    return train


def test_a_tracked_cpu_run_logs_node_0_host_metrics_and_no_gpu_into_its_mlflow_run(runs_dir, capfd):
    mlflow = pytest.importorskip("mlflow")
    fn = distributed(gpus=2, runs_dir=runs_dir)(busy_for(2.0))

    samplers = fn.distributed()

    assert samplers == [["gpufleet-telemetry"], []], "one sampler per node: the first rank's"
    run_id = re.search(r"MLflow run ([0-9a-f]{32})", capfd.readouterr().err)[1]
    client = mlflow.MlflowClient()
    run = client.get_run(run_id)
    metrics, tags = run.data.metrics, run.data.tags
    assert 0 <= metrics["system/node0/cpu_utilization_percent"] <= 100, metrics
    assert metrics["system/node0/memory_used_mb"] > 0
    assert 0 < metrics["system/node0/memory_used_percent"] < 100
    assert tags["gpufleet.node0.host"] == socket.gethostname()
    assert not [k for k in metrics if "gpu" in k.lower()], "no GPU held, none logged"
    assert not [k for k in metrics if k.startswith("system/") and not k.startswith("system/node")], (
        "MLflow's own monitor of the caller's machine is gone")
    history = client.get_metric_history(run_id, "system/node0/cpu_utilization_percent")
    assert history and all(m.timestamp > run.info.start_time - 60_000 for m in history)

    samples = [json.loads(line) for line in (fn.last_run / "telemetry.jsonl").read_text().splitlines()]
    assert samples and all(s["node"] == 0 and s["host"] == socket.gethostname() for s in samples)
    assert all(s["gpus"] == [] for s in samples)
    assert [s["time"] for s in samples] == sorted(s["time"] for s in samples)


def test_on_cpu_the_status_line_and_gpufleet_status_show_no_gpu(runs_dir, monkeypatch, capsys):
    screen = terminal_stdout(monkeypatch)
    fn = distributed(gpus=2, runs_dir=runs_dir, tracking=False)(busy_for(2.5))

    fn.distributed()

    statuses = [line for line in ANSI.sub("", screen.getvalue()).replace("\r", "\n").splitlines()
                if "ranks alive" in line]
    assert statuses, screen.getvalue()
    assert not [line for line in statuses if "GPU" in line], statuses
    assert (fn.last_run / "telemetry.jsonl").stat().st_size > 0, "the host was sampled all the same"

    monkeypatch.undo()  # stdout back for the command
    run_id = fn.last_run.parent.name
    capsys.readouterr()
    assert cli.main(["--runs-dir", str(runs_dir), "status", run_id]) == 0
    shown = capsys.readouterr().out
    assert "status:       succeeded" in shown and "GPU" not in shown and "gpu use" not in shown, shown
    assert cli.main(["--runs-dir", str(runs_dir), "status", run_id, "--json"]) == 0
    assert "gpu_telemetry" not in json.loads(capsys.readouterr().out)


def test_cuda_visible_devices_names_the_nvml_devices_the_run_holds():
    # unset: every GPU in NVML's order, as many as the node's ranks bind (cuda:LOCAL_RANK)
    assert held_gpus(None, 2, UUIDS) == [(0, 0), (1, 1)]
    # indices: NVML's own; a 1-GPU run on an 8-GPU host samples its GPU only
    assert held_gpus("5", 1, UUIDS) == [(0, 5)]
    assert held_gpus("3,5", 2, UUIDS) == [(0, 3), (1, 5)]
    assert held_gpus(" 3 , 5 ,7", 2, UUIDS) == [(0, 3), (1, 5)], "only what the ranks bind"
    # UUIDs, whole or a unique prefix, as CUDA takes them
    assert held_gpus(f"{UUIDS[6]},GPU-2222", 2, UUIDS) == [(0, 6), (1, 2)]
    assert held_gpus("gpu-4444aaaa", 1, UUIDS) == [(0, 4)]
    # CUDA stops at the first entry that names no device; a MIG instance is not sampled
    assert held_gpus("1,-1,2", 3, UUIDS) == [(0, 1)]
    assert held_gpus("9", 1, UUIDS) == []
    assert held_gpus("GPU-", 1, UUIDS) == [], "a prefix of several GPUs names none"
    assert held_gpus("MIG-abcd,2", 2, UUIDS) == [(1, 2)]
    assert held_gpus("", 1, UUIDS) == []
    assert held_gpus("0,0", 2, UUIDS) == [(0, 0)], "never the same GPU twice"
    # no NVML (no driver, no nvidia-ml-py): no GPU
    assert held_gpus(None, 2, []) == held_gpus("0", 1, []) == []


def test_the_gpu_part_says_use_and_memory_of_each_gpu_and_nothing_without_one():
    gib = 2**30

    def gpu(index, busy, used, total=80):
        return {"index": index, "utilization_percent": busy, "memory_used_bytes": int(used * gib),
                "memory_total_bytes": total * gib}

    one_node = {0: {"node": 0, "gpus": [gpu(0, 87, 61.2), gpu(3, 85, 60.04)]}}
    assert describe_gpus(one_node) == "GPU 0: 87% 61.2/80 GiB · GPU 3: 85% 60.0/80 GiB"
    two_nodes = {0: {"node": 0, "gpus": [gpu(0, 50, 1)]}, 1: {"node": 1, "gpus": [gpu(0, 40, 2)]}}
    assert describe_gpus(two_nodes) == "node 0 GPU 0: 50% 1.0/80 GiB · node 1 GPU 0: 40% 2.0/80 GiB"
    many = {n: {"node": n, "gpus": [gpu(i, 70 + 10 * n + 2 * i, 10 + i) for i in range(4)]} for n in (0, 1)}
    assert describe_gpus(many) == "8 GPUs: 78% (70–86%) · 13.0/80 GiB at most"
    assert describe_gpus({0: {"node": 0, "gpus": []}}) == describe_gpus({}) == ""
