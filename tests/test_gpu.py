"""GPU paths (NCCL, one GPU per rank). Skipped without CUDA; run on the GPU machine."""

from __future__ import annotations

import re

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
