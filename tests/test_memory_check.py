"""The check before the first step: each rank compares the estimate of its step with what its GPU
has free (`strategies.prepare(..., memory_check=...)`, the Hugging Face and Lightning callbacks).

What a user relies on:

- the message names the rank and its GPU, the need (by part), what is free, what other
  processes hold on that GPU, and the largest micro-batch that fits, which does fit while one
  more does not;
- it runs once, at the model's first forward pass in training (an evaluation before training
  does not count), before that pass starts: "warn" logs and goes on, "error" raises
  MemoryCheckError, "off" installs nothing; a step that fits says nothing;
- an unknown memory_check is a ConfigError before anything starts.

The GPU is described by a `DeviceMemory` value (what `torch.cuda.mem_get_info` and NVML would
say), since this machine has none; on a GPU the same code reads the real one
(benchmarks/memory_gpu.py checks that it does).
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist

from gpufleet import ConfigError, memory, strategies
from gpufleet.memory import check
from gpufleet.memory._arith import CUDA_CONTEXT
from gpufleet.memory._gpus import DeviceMemory, Holder

pytestmark = pytest.mark.timeout(120)

GIB = 2**30
WIDTH = 256
TOKENS = 512  # rows per sample: activations of megabytes a sample


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(WIDTH, 4 * WIDTH)
        self.down = torch.nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))


def samples(batch: int) -> torch.Tensor:
    return torch.randn(batch, TOKENS, WIDTH)


def gpu(available: int, others=()) -> DeviceMemory:
    held = available // 4  # already reserved by this process's allocator
    return DeviceMemory(index=3, name="NVIDIA H100 80GB HBM3", total=80 * GIB, free=available - held,
                        held_here=held, others=tuple(others))


def test_the_message_names_rank_need_free_others_and_the_largest_micro_batch_that_fits():
    found = memory.estimate(Net(), micro_batch=64, precision="fp32", inputs=samples)
    need = found.total - CUDA_CONTEXT  # the context exists already: in neither side
    device = gpu(need - found.activations // 2, [Holder(4242, "python", 30 * GIB)])
    message = check.verdict(found, device, rank=5)
    assert message is not None
    assert message.startswith("rank 5 (GPU 3, NVIDIA H100 80GB HBM3): the first step needs about "
                              f"{need / GIB:.1f} GiB at micro-batch 64"), message
    assert f"{device.available / GIB:.1f} GiB are available" in message
    assert "also on this GPU: pid 4242 python, 30.0 GiB" in message
    largest = int(message.rpartition("the largest micro-batch that fits: ")[2])
    assert 0 < largest < 64
    assert check.verdict(found.at(largest), device, 5) is None
    assert check.verdict(found.at(largest + 1), device, 5) is not None
    assert check.verdict(found, gpu(need), 5) is None, "a step that fits says nothing"
    assert "not even micro-batch 1 fits" in check.verdict(found, gpu(GIB // 100), 5)


def test_the_check_runs_once_at_the_first_training_pass_before_it(caplog):
    model = Net()
    training = check.Training("ddp", "fp32", "adamw")
    small = gpu(2**20)  # 1 MiB: less than two samples' activations
    check.watch(model, training, "error", device=small)
    with torch.no_grad():
        model(samples(2))  # evaluation before training: not the step
    calls = []
    model.register_forward_hook(lambda *_: calls.append(1))
    with pytest.raises(check.MemoryCheckError, match=r"rank 0 \(GPU 3"):
        model(samples(2))
    assert not calls, "the pass that would not fit did not start"
    model(samples(2))  # checked once: training goes on when the user chooses to
    assert calls == [1]

    warned = Net()
    check.watch(warned, training, "warn", device=small)
    with caplog.at_level(logging.WARNING, logger="gpufleet"):
        warned(samples(2))
        warned(samples(2))
    found = [r.getMessage() for r in caplog.records if "the first step needs" in r.getMessage()]
    assert len(found) == 1 and "micro-batch 2" in found[0]
    assert check.watch(Net(), training, "off", device=small) is None


def test_the_environment_decides_where_memory_check_is_not_given(monkeypatch):
    small = gpu(2**20)
    training = check.Training("ddp", "fp32", "adamw")
    monkeypatch.setenv("GPUFLEET_MEMORY_CHECK", "error")
    model = Net()
    check.watch(model, training, device=small)
    with pytest.raises(check.MemoryCheckError):
        model(samples(2))
    assert check.watch(Net(), training, "off", device=small) is None, "given wins over the variable"
    monkeypatch.setenv("GPUFLEET_MEMORY_CHECK", "Off")
    assert check.watch(Net(), training, device=small) is None
    monkeypatch.setenv("GPUFLEET_MEMORY_CHECK", "sometimes")
    with pytest.raises(ConfigError, match="GPUFLEET_MEMORY_CHECK='sometimes'"):
        strategies.prepare(Net(), lambda p: torch.optim.SGD(p, lr=0.1), "ddp")
    assert not dist.is_initialized(), "refused before the process group"


def test_prepare_watches_its_model_and_refuses_an_unknown_memory_check():
    with pytest.raises(ConfigError, match="memory_check='maybe'"):
        strategies.prepare(Net(), lambda p: torch.optim.SGD(p, lr=0.1), "ddp", memory_check="maybe")
    assert not dist.is_initialized(), "refused before the process group"


def test_the_trainers_optimizer_and_strategy_are_read_for_the_estimate():
    assert check.optimizer_name(torch.optim.SGD(Net().parameters(), lr=0.1)) == "sgd"
    assert check.optimizer_name(torch.optim.SGD(Net().parameters(), lr=0.1, momentum=0.9)) == "sgd-momentum"
    assert check.optimizer_name(torch.optim.AdamW(Net().parameters())) == "adamw"


def test_a_hugging_face_trainers_settings_and_batch_are_what_is_checked(tmp_path):
    transformers = pytest.importorskip("transformers")
    from gpufleet.integrations.huggingface import GpufleetCallback, _training

    with pytest.raises(ConfigError, match="memory_check='loud'"):
        GpufleetCallback(memory_check="loud")
    config = transformers.LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(config)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=3,
                                          gradient_checkpointing=True, report_to=[], use_cpu=True)
    training = _training(args, torch.optim.AdamW(model.parameters()))
    assert training == check.Training("ddp", "fp32", "adamw", True)
    check.watch(model, training, "error", device=gpu(2**20))
    ids = torch.randint(0, 1000, (3, 32))
    with pytest.raises(check.MemoryCheckError, match="micro-batch 3") as info:
        model(input_ids=ids, labels=ids)
    assert str(info.value).startswith("rank 0 (GPU 3")


def test_a_lightning_trainers_strategy_and_precision_are_read():
    L = pytest.importorskip("lightning")
    from gpufleet.integrations.lightning import GpufleetCallback, _training

    with pytest.raises(ConfigError, match="memory_check='loud'"):
        GpufleetCallback(memory_check="loud")
    trainer = L.Trainer(accelerator="cpu", devices=1, precision="bf16-mixed", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False)
    assert _training(trainer) == check.Training("ddp", "bf16", "adamw")
