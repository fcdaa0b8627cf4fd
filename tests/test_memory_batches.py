"""`gpufleet.memory.MicroBatches`: a CUDA out-of-memory error on one rank shrinks the micro-batch on
every rank and training goes on, with the same global batch and the same optimizer steps.

What a user relies on:

- torch's own OutOfMemoryError, raised inside the step on one rank of 2 (or 4) real gloo ranks
  at a chosen step, in the forward or the backward pass: every rank halves its micro-batch and
  doubles its accumulation at that same step, redoes it, and ends with the weights that one
  process training on the whole global batch gets (so the global batch and the optimizer steps
  did not change); no rank hangs;
- the shrink is recorded: the attempt's `memory.jsonl`, `steps.json`, `gpufleet status` (text
  and JSON) and the call's MLflow run;
- where the ranks cannot agree (FSDP: the others wait in an all-gather), the rank records the
  smaller micro-batch and its error ends the attempt; a retry (max_retries) resumes from the
  last checkpoint at that micro-batch and ends with the same weights;
- at micro-batch 1 an OOM is an error that carries the memory estimate; shrink=False lets the
  OOM through; the batch splits into micro-batches weighed by their samples.

Functions sent to ranks are defined inside the tests (they travel by value); the model
builders are module-level and imported by reference in the ranks.
"""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from gpufleet import ConfigError, distributed, memory
from support import PYTHON, ended_mlflow_run, run_folders

pytestmark = pytest.mark.timeout(240)

FEATURES = 8
PER_RANK = 8  # samples per rank and step: micro-batch 4 × accumulation 2, at first
STEPS = 4
LR = 0.1
OOM = "CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of 79.19 GiB"
# One process on the global batch and several ranks averaging gradients sum in another order:
# float32 rounding, far below this; a lost or doubled micro-batch is far above it.
ATOL, RTOL = 1e-5, 1e-4


def mlp():
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def blocks_net():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(16, 16)

        def forward(self, x):
            return x + torch.tanh(self.fc(x))

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = torch.nn.Linear(FEATURES, 16)
            self.blocks = torch.nn.ModuleList(Block() for _ in range(2))
            self.out = torch.nn.Linear(16, 1)

        def forward(self, x):
            x = self.inp(x)
            for block in self.blocks:
                x = block(x)
            return self.out(x)

    return Net()


def batches(world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1234)
    return [(torch.randn(PER_RANK * world, FEATURES, generator=gen),
             torch.randn(PER_RANK * world, 1, generator=gen)) for _ in range(STEPS)]


def one_process(build, data) -> dict[str, torch.Tensor]:
    """Plain training on each whole global batch, in one process (no gpufleet)."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = build()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for x, y in data:
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same_weights(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for name, ref in want.items():
        assert torch.allclose(got[name], ref, atol=ATOL, rtol=RTOL), (
            f"{name} differs from one process on the global batch by {(got[name] - ref).abs().max():.3g}")


def train_in_ranks(strategy, build, data, oom, checkpoints=None, plain_step=False, **options):
    """The rank's side: `strategy` over `build()`, MicroBatches at micro-batch 4, torch's OOM
    raised at `oom` = (step, rank, call of the loss function in that step, "forward" or
    "backward"); a checkpoint after every step when `checkpoints` is a folder; with
    `plain_step`, one more step on the last batch through the trainer alone, as if the helper
    had never been there."""
    from gpufleet import memory, runtime, strategies
    from gpufleet.checkpoint import Checkpointer

    runtime.setup(timeout=60)
    rank, world = runtime.get_global_rank(), runtime.get_world_size()
    torch.manual_seed(0)
    trainer = strategies.prepare(build(), lambda p: torch.optim.SGD(p, lr=LR, momentum=0.9), strategy,
                                 **options)
    helper = memory.MicroBatches(trainer, micro_batch=4)
    ckpt = Checkpointer(checkpoints, async_save=False) if checkpoints else None
    start = ckpt.restore(trainer, extra={"batches": helper}) if ckpt else 0
    seen = []
    for step in range(start + 1, len(data) + 1):
        x, y = data[step - 1]
        mine = (x[rank * PER_RANK:(rank + 1) * PER_RANK], y[rank * PER_RANK:(rank + 1) * PER_RANK])
        calls = 0

        def loss_fn(micro):
            nonlocal calls
            calls += 1
            seen.append((step, len(micro[0])))
            loss = torch.nn.functional.mse_loss(trainer.model(micro[0]), micro[1])
            if (step, rank, calls) == oom[:3] and runtime.get_attempt() == 0:
                if oom[3] == "forward":
                    raise torch.OutOfMemoryError(OOM)
                loss.register_hook(lambda grad: (_ for _ in ()).throw(torch.OutOfMemoryError(OOM)))
            return loss

        helper.step(mine, loss_fn)
        if ckpt:
            ckpt.save(step, trainer, extra={"batches": helper})
    if plain_step:
        trainer.backward(torch.nn.functional.mse_loss(trainer.model(mine[0]), mine[1]))
        trainer.step()
    return {"weights": trainer.full_state_dict(), "seen": seen, "micro_batch": helper.micro_batch,
            "grad_accum": helper.grad_accum, "optimizer_steps": trainer.optimizer_steps,
            "shrinks": helper.shrinks, "attempt": runtime.get_attempt(), "start": start,
            "helper_steps": helper.optimizer_steps}


# ---------------------------------------------------------------------------- in place


# find_unused: DDP all-reduces in each backward pass which parameters it used (the Hugging
# Face Trainer's default without gradient checkpointing)
@pytest.mark.parametrize("world, phase, find_unused", [(2, "forward", False), (2, "backward", False),
                                                       (4, "forward", False), (2, "forward", True)])
def test_an_oom_on_one_rank_shrinks_every_rank_and_keeps_the_global_batch(world, phase, find_unused, runs_dir):
    data = batches(world)
    oom = (2, 1, 2, phase)  # step 2, rank 1, its second micro-batch

    @distributed(gpus=world, runs_dir=runs_dir, timeout=180)
    def train(data, oom):
        return train_in_ranks("ddp", mlp, data, oom, plain_step=True, find_unused_parameters=find_unused)

    results = train.distributed(data, oom)
    for rank, r in enumerate(results):
        assert (r["micro_batch"], r["grad_accum"], r["helper_steps"]) == (2, 4, STEPS), rank
        assert r["optimizer_steps"] == STEPS + 1, "and the plain step after them"
        # step 1 at 4; step 2 at 4 (rank 1 ran out in its second micro-batch), redone at 2
        assert [n for s, n in r["seen"] if s <= 2] == [4, 4] + [4, 4] + [2] * 4, (rank, r["seen"])
        assert [n for s, n in r["seen"] if s > 2] == [2] * 4 * (STEPS - 2), (rank, r["seen"])
    # rank 0 holds the whole model; DDP averaged the plain step too (the helper's hook is off)
    assert_same_weights(results[0]["weights"], one_process(mlp, data + data[-1:]))
    [record] = results[0]["shrinks"]
    assert {k: record[k] for k in ("step", "old_micro_batch", "new_micro_batch", "grad_accum", "batch",
                                   "global_batch", "ranks", "in_place")} == {
        "step": 2, "old_micro_batch": 4, "new_micro_batch": 2, "grad_accum": 4, "batch": PER_RANK,
        "global_batch": PER_RANK * world, "ranks": [1], "in_place": True}
    [attempt] = run_folders(runs_dir)
    kept = [json.loads(line) for line in (attempt / "memory.jsonl").read_text().splitlines()]
    assert len(kept) == 1 and kept[0]["ranks"] == [1] and kept[0]["where"] == f"micro-batch 2 of 2, {phase}"
    assert json.loads((attempt / "steps.json").read_text())["memory_shrinks"] == kept


def test_a_shrink_shows_in_status_and_in_mlflow(runs_dir, tmp_path):
    data = batches(2)

    @distributed(gpus=2, runs_dir=runs_dir, timeout=180, tracking=True)
    def train(data, oom):
        return train_in_ranks("ddp", mlp, data, oom)

    train.distributed(data, (3, 0, 1, "forward"))
    [attempt] = run_folders(runs_dir)
    run = attempt.parent
    status = subprocess.run([PYTHON, "-m", "gpufleet", "status", run.name, "--runs-dir", runs_dir, "--json"],
                            capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    [shrink] = json.loads(status.stdout)["memory_shrinks"]
    assert (shrink["step"], shrink["ranks"], shrink["new_micro_batch"]) == (3, [0], 2)
    text = subprocess.run([PYTHON, "-m", "gpufleet", "status", run.name, "--runs-dir", runs_dir],
                          capture_output=True, text=True, timeout=60).stdout
    assert "memory:" in text and "step 3: rank 0 ran out of GPU memory; micro-batch 4 → 2" in text, text
    from mlflow import MlflowClient

    found = ended_mlflow_run(run)
    history = MlflowClient().get_metric_history(found.info.run_id, "memory/micro_batch")
    assert [(m.step, m.value) for m in history] == [(3, 2.0)]


# ---------------------------------------------------------------------------- the fallback


def test_where_the_ranks_cannot_agree_a_retry_goes_on_at_the_smaller_micro_batch(runs_dir, tmp_path):
    data = batches(2)
    checkpoints = str(tmp_path / "checkpoints")

    @distributed(gpus=2, runs_dir=runs_dir, timeout=200, max_retries=1)
    def train(data, oom, checkpoints):
        return train_in_ranks("fsdp", blocks_net, data, oom, checkpoints)

    results = train.distributed(data, (3, 1, 1, "forward"), checkpoints)
    for r in results:
        assert (r["attempt"], r["start"]) == (1, 2), "the retry resumes from the checkpoint of step 2"
        assert (r["micro_batch"], r["grad_accum"], r["optimizer_steps"]) == (2, 4, STEPS)
        assert [n for _, n in r["seen"]] == [2] * 4 * (STEPS - 2), "the retry starts at micro-batch 2"
    assert_same_weights(results[0]["weights"], one_process(blocks_net, data))
    first, second = run_folders(runs_dir)
    [record] = [json.loads(line) for line in (first / "memory.jsonl").read_text().splitlines()]
    assert (record["step"], record["ranks"], record["new_micro_batch"], record["in_place"]) == (3, [1], 2, False)
    assert not (second / "memory.jsonl").exists()
    log = (first / "logs" / "rank-1.log").read_text()
    assert "goes on at micro-batch 2" in log, log[-2000:]


# ---------------------------------------------------------------------------- one process


class Linear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(FEATURES, 1)

    def forward(self, x):
        return self.fc(x)


def test_micro_batches_weighed_by_their_samples_give_the_whole_batchs_step():
    x, y = batches(1)[0]
    torch.manual_seed(0)
    whole, split = Linear(), Linear()
    split.load_state_dict(whole.state_dict())
    opt = torch.optim.SGD(whole.parameters(), lr=LR)
    whole_loss = torch.nn.functional.mse_loss(whole(x), y)
    whole_loss.backward()
    opt.step()
    helper = memory.MicroBatches(split, 3, optimizer=torch.optim.SGD(split.parameters(), lr=LR))
    loss = helper.step({"x": x, "y": y}, lambda m: torch.nn.functional.mse_loss(split(m["x"]), m["y"]))
    assert helper.grad_accum == 3  # 3 + 3 + 2 samples
    assert torch.allclose(loss, whole_loss.detach(), atol=1e-6), "the batch's mean loss"
    for a, b in zip(whole.parameters(), split.parameters()):
        assert torch.allclose(a, b, atol=1e-6), "the step of the whole batch"


def test_at_micro_batch_one_an_oom_ends_with_the_estimate():
    model = Linear()
    helper = memory.MicroBatches(model, 1, optimizer=torch.optim.SGD(model.parameters(), lr=LR))

    def loss_fn(micro):
        model(micro[0])
        raise torch.OutOfMemoryError(OOM)

    with pytest.raises(memory.MicroBatchFloorError) as info:
        helper.step(batches(1)[0], loss_fn)
    message = str(info.value)
    assert "micro-batch 1" in message and "rank 0" in message
    assert "memory estimate per GPU" in message and "total per GPU" in message, message


def test_shrink_off_lets_the_oom_through_and_bad_input_is_refused():
    model = Linear()
    helper = memory.MicroBatches(model, 4, optimizer=torch.optim.SGD(model.parameters(), lr=LR), shrink=False)

    def loss_fn(micro):
        raise torch.OutOfMemoryError(OOM)

    with pytest.raises(torch.OutOfMemoryError):
        helper.step(batches(1)[0], loss_fn)
    assert helper.micro_batch == 4 and not helper.shrinks
    with pytest.raises(ConfigError, match="micro_batch=0"):
        memory.MicroBatches(model, 0, optimizer=torch.optim.SGD(model.parameters(), lr=LR))
    with pytest.raises(ConfigError, match="optimizer="):
        memory.MicroBatches(model, 2)
    with pytest.raises(ConfigError, match="no tensor"):
        memory.MicroBatches(model, 2, optimizer=torch.optim.SGD(model.parameters(), lr=LR)).step(
            ["a", "b"], lambda m: m)


def test_the_micro_batch_travels_in_a_checkpoint():
    model = Linear()
    helper = memory.MicroBatches(model, 8, optimizer=torch.optim.SGD(model.parameters(), lr=LR))
    helper.load_state_dict({"micro_batch": 2, "optimizer_steps": 5})
    assert (helper.micro_batch, helper.optimizer_steps) == (2, 5)
    assert helper.state_dict() == {"micro_batch": 2, "optimizer_steps": 5}
