"""Success path: results in rank order, arguments, the torchrun environment, runtime, tensors."""

from __future__ import annotations

import os
import re
import signal

import pytest
import torch

from gpufleet import distributed, runtime
from support import run_folders

pytestmark = pytest.mark.timeout(60)

TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")


def test_two_ranks_get_args_kwargs_torchrun_env_and_return_in_rank_order(runs_dir, capfd):
    @distributed(gpus=2, runs_dir=runs_dir, env={"GPUFLEET_TEST_FLAG": "on"})
    def probe(a, b, *, scale=1, tag="default"):
        import datetime
        import os

        import torch
        import torch.distributed as dist

        env = {name: os.environ.get(name) for name in (*TORCHRUN_VARS, "GPUFLEET_TEST_FLAG")}
        # What torchrun promises: init_process_group() with no arguments finds the group.
        dist.init_process_group(timeout=datetime.timedelta(seconds=30))
        total = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(total)
        # setup() after the user's own init_process_group, twice: must be harmless.
        device = runtime.setup(timeout=30)
        again = runtime.setup(timeout=30)
        rank = runtime.get_global_rank()
        return {
            "env": env,
            "pid": os.getpid(),
            "args": (a, b, scale, tag),
            "sum": total.item(),
            "device": (device, again),
            "dist": (dist.get_rank(), dist.get_world_size()),
            "runtime": (rank, runtime.get_local_rank(), runtime.get_world_size(),
                        runtime.get_local_world_size(), runtime.get_node_rank(),
                        runtime.is_main_process()),
            "tensor": torch.arange(4) * (rank + 1),
            "nested": {"t": [torch.full((2,), float(rank))]},
        }

    environ_before = dict(os.environ)
    sigint_before = signal.getsignal(signal.SIGINT)
    results = probe.distributed([1, 2], "b", scale=10, tag="kw")

    assert isinstance(results, list) and len(results) == 2
    ports = set()
    for rank, r in enumerate(results):
        env = r["env"]
        assert r["args"] == ([1, 2], "b", 10, "kw")
        missing = [name for name in TORCHRUN_VARS if not env[name]]
        assert not missing, f"rank {rank} lacks {missing}: {env}"
        assert env["RANK"] == env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "2"
        assert env["GROUP_RANK"] == env["NODE_RANK"] == "0"
        assert env["GPUFLEET_TEST_FLAG"] == "on", "env= reaches the ranks"
        assert 0 < int(env["MASTER_PORT"]) < 65536
        ports.add((env["MASTER_ADDR"], env["MASTER_PORT"]))
        assert r["sum"] == 3.0  # 1 + 2: the all_reduce really crossed ranks
        assert r["dist"] == (rank, 2)
        assert r["runtime"] == (rank, rank, 2, 2, 0, rank == 0)
        assert r["device"] == (torch.device("cpu"), torch.device("cpu"))
        assert isinstance(r["tensor"], torch.Tensor) and r["tensor"].device.type == "cpu"
        assert r["tensor"].tolist() == [0, rank + 1, 2 * (rank + 1), 3 * (rank + 1)]
        assert r["nested"]["t"][0].device.type == "cpu"
        assert r["nested"]["t"][0].tolist() == [float(rank)] * 2
    assert len(ports) == 1, f"ranks disagree on MASTER_ADDR/MASTER_PORT: {ports}"
    pids = {r["pid"] for r in results}
    assert len(pids) == 2 and os.getpid() not in pids, "each rank must be its own process"

    err = capfd.readouterr().err
    gpu_lines = [line for line in err.splitlines() if re.search(r"\bgpu\b", line, re.IGNORECASE)]
    assert len(gpu_lines) == 1, f"expected one line saying no GPU was found, got: {err!r}"
    assert "gloo" in gpu_lines[0].lower() or "cpu" in gpu_lines[0].lower()
    assert len(run_folders(runs_dir)) == 1
    # The caller's own state is left as it was.
    assert dict(os.environ) == environ_before
    assert signal.getsignal(signal.SIGINT) is sigint_before


def test_three_ranks_through_options_return_in_rank_order(runs_dir):
    @distributed(gpus=2, runs_dir=runs_dir)
    def whoami(offset):
        import os
        import time

        import torch
        import torch.distributed as dist

        runtime.setup(timeout=30)
        time.sleep(0.5 * (2 - runtime.get_global_rank()))  # the last rank finishes first
        ranks = [torch.zeros(1) for _ in range(dist.get_world_size())]
        dist.all_gather(ranks, torch.tensor([float(runtime.get_global_rank())]))
        return (runtime.get_global_rank() + offset, runtime.get_world_size(),
                [int(t.item()) for t in ranks], os.getpid())

    three = whoami.options(gpus=3)
    assert three is not whoami
    results = three.distributed(100)

    assert [r[0] for r in results] == [100, 101, 102]
    assert all(r[1] == 3 and r[2] == [0, 1, 2] for r in results)
    assert len({r[3] for r in results}) == 3


def test_direct_call_runs_in_this_process_undistributed(runs_dir):
    @distributed(gpus=2, runs_dir=runs_dir)
    def train(epochs: int, lr: float = 1e-3) -> dict:
        device = runtime.setup(timeout=30)
        return {
            "pid": os.getpid(),
            "device": device,
            "rank": (runtime.get_global_rank(), runtime.get_local_rank(),
                     runtime.get_world_size(), runtime.get_local_world_size(),
                     runtime.get_node_rank(), runtime.is_main_process()),
            "args": (epochs, lr),
        }

    try:
        out = train(3, lr=0.5)
        left_initialized = torch.distributed.is_initialized()
    finally:
        if torch.distributed.is_initialized():  # keep later tests in this process independent
            torch.distributed.destroy_process_group()

    assert out["pid"] == os.getpid()
    assert out["args"] == (3, 0.5)
    assert out["device"] == torch.device("cpu")
    assert out["rank"] == (0, 0, 1, 1, 0, True), "a direct call is a world of one"
    assert not runs_dir.exists(), "a direct call must not create a run folder"
    # The caller (often a notebook kernel) is left as it was: a default process group left
    # behind would make its own init_process_group() fail and make libraries think they run
    # distributed.
    assert not left_initialized, "a direct call left a default process group in the caller"


def test_a_callable_instance_runs_on_every_rank_with_its_state(runs_dir):
    class Trainer:
        def __init__(self, lr):
            self.lr = lr
            self.options = {"lr": lr}  # its own state: it must not hide the function's methods

        def __call__(self, epochs):
            return (runtime.get_global_rank(), self.lr * epochs)

    trainer = distributed(gpus=2, runs_dir=runs_dir, logs="none")(Trainer(0.5))
    assert trainer(4) == (0, 2.0)  # a direct call runs here
    assert trainer.options(logs="none").distributed(4) == [(0, 2.0), (1, 2.0)]
    assert "Trainer" in repr(trainer) and run_folders(runs_dir)[0].parent.name.startswith("Trainer-")
