"""GPU paths (NCCL, one GPU per rank). Skipped without CUDA; run on the GPU machine."""

from __future__ import annotations

import re

import psutil
import pytest
import torch

from gpufleet import ConfigError, distributed, runtime
from support import EXAMPLES, assert_all_gone, rank_lines

GPUS = torch.cuda.device_count()

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(180),
    pytest.mark.skipif(GPUS == 0, reason="needs CUDA GPUs"),
]


def nccl_all_reduce_job():
    def all_reduce_on_gpus():
        import os

        import torch
        import torch.distributed as dist

        device = runtime.setup(timeout=60)
        rank = runtime.get_global_rank()
        value = torch.full((1024,), float(rank + 1), device=device)
        dist.all_reduce(value)
        return {
            "device": device,
            "local_rank": int(os.environ["LOCAL_RANK"]),
            "current": torch.cuda.current_device(),
            "backend": dist.get_backend(),
            "sum": value,  # a CUDA tensor: must come back on CPU
        }

    return all_reduce_on_gpus


def check_all_reduce(results, world_size):
    assert len(results) == world_size
    expected = world_size * (world_size + 1) / 2
    for rank, r in enumerate(results):
        assert r["local_rank"] == rank
        assert r["device"] == torch.device("cuda", rank)
        assert r["current"] == rank
        assert r["backend"] == "nccl"
        assert r["sum"].device.type == "cpu"
        assert torch.all(r["sum"] == expected)


def test_nccl_all_reduce_on_every_visible_gpu(runs_dir, capfd):
    results = distributed(runs_dir=runs_dir)(nccl_all_reduce_job()).distributed()

    check_all_reduce(results, GPUS)
    assert "no gpu" not in capfd.readouterr().err.lower()


def hardware_type() -> str:
    """"H200" for "NVIDIA H200": the short name users pass as gpu_type."""
    name = torch.cuda.get_device_name(0)
    models = re.findall(r"[A-Z]+\d+\w*", name)
    return models[0] if models else name


@pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs")
def test_nccl_all_reduce_on_two_gpus_of_the_expected_type(runs_dir):
    job = distributed(gpus=2, gpu_type=hardware_type(), runs_dir=runs_dir)(nccl_all_reduce_job())
    results = job.distributed()

    check_all_reduce(results, 2)


def test_more_gpus_than_visible_fails_before_launch_and_says_how_many(runs_dir):
    with pytest.raises(ConfigError) as info:
        distributed(gpus=GPUS + 1, runs_dir=runs_dir)(nccl_all_reduce_job()).distributed()
    assert str(GPUS + 1) in str(info.value) and str(GPUS) in str(info.value)
    assert not runs_dir.exists()


def test_gpu_type_is_checked_against_the_hardware(runs_dir):
    found = hardware_type()
    wrong = "A10" if found != "A10" else "H100"
    with pytest.raises(ConfigError) as info:
        distributed(gpu_type=wrong, runs_dir=runs_dir)(nccl_all_reduce_job()).distributed()
    assert wrong in str(info.value) and found in str(info.value), str(info.value)
    assert not runs_dir.exists()


def test_mlp_ddp_example_trains_on_gpus(run_script):
    result = run_script(EXAMPLES / "mlp_ddp.py", timeout=170)

    assert result.returncode == 0, result.explain()
    losses = [line for line in rank_lines(result.stdout, 0) if "loss" in line.lower()]
    assert len(losses) >= 2, result.stdout
    assert "no gpu" not in result.stderr.lower()
    assert_all_gone(result.tree, what="processes of the example")


def test_a_warm_pool_keeps_nccl_ready_and_releases_gpu_memory_between_calls(runs_dir):
    """Ranks, CUDA contexts and the NCCL group survive the call; the memory a call cached is
    given back unless keep_memory=True; a function that makes and destroys its own group
    still works."""
    import gpufleet

    n = min(GPUS, 2)  # one GPU shows all but the collective across GPUs

    def hold_a_gib(allocate):
        import os

        import torch
        import torch.distributed as dist

        device = runtime.setup()
        at_start = torch.cuda.memory_reserved(device)
        if allocate:
            block = torch.empty(2**30, dtype=torch.uint8, device=device)
            block.fill_(1)
        value = torch.ones(1, device=device)
        dist.all_reduce(value)
        return {"pid": os.getpid(), "device": torch.cuda.current_device(),
                "reserved_at_start": at_start, "sum": value.item()}

    def own_group():
        import torch
        import torch.distributed as dist

        dist.init_process_group("nccl")
        value = torch.ones(1, device="cuda")
        dist.all_reduce(value)
        dist.destroy_process_group()
        return value.item()

    fn = distributed(gpus=n, runs_dir=runs_dir, tracking=False, timeout=120)(hold_a_gib)
    own = distributed(gpus=n, runs_dir=runs_dir, tracking=False, timeout=120)(own_group)
    gib = 2**30
    with gpufleet.pool(gpus=n, runs_dir=runs_dir):
        first = fn.distributed(True)
        second = fn.distributed(False)
        assert own.distributed() == [float(n)] * n == own.distributed()
        third = fn.distributed(False)
    for results in (first, second, third):
        assert [r["device"] for r in results] == list(range(n))
        assert [r["sum"] for r in results] == [float(n)] * n
    assert [r["pid"] for r in first] == [r["pid"] for r in second] == [r["pid"] for r in third]
    assert all(r["reserved_at_start"] < gib for r in second), second
    assert not [r["pid"] for r in first if psutil.pid_exists(r["pid"])], "the pool's ranks outlived it"

    with gpufleet.pool(gpus=n, runs_dir=runs_dir, keep_memory=True):
        fn.distributed(True)
        kept = fn.distributed(False)
    assert all(r["reserved_at_start"] >= gib for r in kept), kept
