"""`micro_batches` of the Hugging Face and Lightning integrations: the Trainer's training steps go
through `MicroBatches`, so a CUDA out-of-memory error on one rank of two real gloo ranks halves
the micro-batch on both, the step is redone, and the Trainer ends with the weights of a Trainer
that never ran out (same global batch, same optimizer steps). Bad input is refused before
training starts.
"""

from __future__ import annotations

import json

import pytest
import torch

from gpufleet import ConfigError, distributed

pytestmark = pytest.mark.timeout(240)

OOM = "CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of 79.19 GiB"


def needs(module: str) -> None:
    pytest.importorskip(module)


def tiny_trainer(out: str, batch: int, accumulation: int = 1, find_unused: bool | None = None):
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(32, (64, 8), generator=torch.Generator().manual_seed(1))]
    args = TrainingArguments(out, max_steps=4, per_device_train_batch_size=batch,
                             gradient_accumulation_steps=accumulation, learning_rate=1e-2,
                             save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True,
                             seed=0, logging_steps=1, ddp_find_unused_parameters=find_unused)
    return Trainer(LlamaForCausalLM(config), args, train_dataset=data)


# find_unused None: the Trainer's default without gradient checkpointing (True: DDP all-reduces
# the used parameters in each backward pass); False: gradients kept local by a DDP hook
@pytest.mark.parametrize("find_unused", [None, False])
def test_an_oom_on_one_rank_shrinks_both_and_the_trainer_ends_as_if_none_happened(find_unused, runs_dir, tmp_path):
    needs("transformers")
    def train(out: str):
        from gpufleet import runtime
        from gpufleet.integrations.huggingface import micro_batches

        rank = runtime.get_global_rank()
        plain = tiny_trainer(f"{out}/plain", batch=4, find_unused=find_unused)
        plain.train()

        shrunk = micro_batches(tiny_trainer(f"{out}/shrunk", batch=4, find_unused=find_unused), micro_batch=4)
        seen: list[int] = []

        def run_out(module, args, kwargs):  # rank 1, step 2, a micro-batch of 4: once
            size = kwargs["input_ids"].shape[0]
            seen.append(size)
            if rank == 1 and shrunk.state.global_step == 1 and size == 4 and 2 not in seen:
                raise torch.OutOfMemoryError(OOM)

        shrunk.model.register_forward_pre_hook(run_out, with_kwargs=True)
        shrunk.train()
        same = all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in
                   zip(plain.model.state_dict().values(), shrunk.model.state_dict().values()))
        return {"same_weights": same, "steps": (plain.state.global_step, shrunk.state.global_step),
                "sizes": seen, "losses": [round(e["loss"], 4) for e in shrunk.state.log_history if "loss" in e],
                "plain_losses": [round(e["loss"], 4) for e in plain.state.log_history if "loss" in e]}

    fn = distributed(gpus=2, runs_dir=runs_dir, timeout=180, tracking=False)(train)
    results = fn.distributed(str(tmp_path))
    for rank, result in enumerate(results):
        assert result["same_weights"], result
        assert result["steps"] == (4, 4), result
        # micro-batches of 4 until step 2 ran out on rank 1; then two of 2 on every rank
        assert result["sizes"][:1] == [4] and result["sizes"][-1] == 2, result
        assert result["losses"] == pytest.approx(result["plain_losses"], rel=1e-3), result
    records = [json.loads(line) for line in (fn.last_run / "memory.jsonl").read_text().splitlines()]
    assert [(r["step"], r["old_micro_batch"], r["new_micro_batch"], r["ranks"]) for r in records] == [(2, 4, 2, [1])]


def test_with_accumulation_an_oom_after_the_first_batch_ends_the_attempt_and_the_retry_runs_smaller(
        runs_dir, tmp_path):
    needs("transformers")

    def train(out: str):
        from gpufleet import runtime
        from gpufleet.integrations.huggingface import micro_batches

        rank, attempt = runtime.get_global_rank(), runtime.get_attempt()
        plain = tiny_trainer(f"{out}/plain-{attempt}", batch=4, accumulation=2)
        plain.train()
        shrunk = micro_batches(tiny_trainer(f"{out}/shrunk-{attempt}", batch=4, accumulation=2), micro_batch=4)
        seen: list[int] = []

        def run_out(module, args, kwargs):  # attempt 0, rank 1: the second batch of step 2
            seen.append(kwargs["input_ids"].shape[0])
            if attempt == 0 and rank == 1 and shrunk.state.global_step == 1 and len(seen) == 4:
                raise torch.OutOfMemoryError(OOM)

        shrunk.model.register_forward_pre_hook(run_out, with_kwargs=True)
        shrunk.train()
        same = all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in
                   zip(plain.model.state_dict().values(), shrunk.model.state_dict().values()))
        return {"same_weights": same, "sizes": seen, "attempt": attempt}

    fn = distributed(gpus=2, runs_dir=runs_dir, timeout=180, max_retries=1, tracking=False)(train)
    for result in fn.distributed(str(tmp_path)):
        # the retry started every rank at micro-batch 2 (two forward passes per batch of 4)
        assert result["attempt"] == 1 and result["same_weights"], result
        assert set(result["sizes"]) == {2} and len(result["sizes"]) == 2 * 2 * 4, result
    first = fn.last_run.parent / "attempt-0"
    records = [json.loads(line) for line in (first / "memory.jsonl").read_text().splitlines()]
    assert [(r["step"], r["new_micro_batch"], r["ranks"], r["in_place"]) for r in records] == [(2, 2, [1], False)]


def test_a_micro_batch_the_trainer_cannot_take_is_refused(tmp_path):
    needs("transformers")
    from gpufleet.integrations.huggingface import micro_batches

    trainer = tiny_trainer(str(tmp_path), batch=4)
    for bad in (0, 5, 2.0, True):
        with pytest.raises(ConfigError) as info:
            micro_batches(trainer, micro_batch=bad)
        assert f"micro_batch={bad!r}" in str(info.value) and "per_device_train_batch_size (4)" in str(info.value)


def test_lightning_an_oom_on_one_rank_shrinks_both_and_training_ends_as_if_none_happened(runs_dir):
    needs("lightning")

    def train():
        import lightning as L
        import torch.nn.functional as F
        from torch.utils.data import DataLoader, TensorDataset

        from gpufleet import runtime
        from gpufleet.integrations.lightning import micro_batches

        rank = runtime.get_global_rank()
        seen: list[int] = []

        class Net(L.LightningModule):
            def __init__(self, oom: bool):
                super().__init__()
                torch.manual_seed(0)
                self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
                self.oom = oom

            def training_step(self, batch, batch_idx):
                x, y = batch
                if self.oom:
                    seen.append(len(x))
                    if rank == 1 and self.trainer.global_step == 1 and len(x) == 4 and 2 not in seen:
                        raise torch.OutOfMemoryError(OOM)
                return F.mse_loss(self.net(x), y)

            def configure_optimizers(self):
                opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
                sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
                return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

        gen = torch.Generator().manual_seed(1)
        x = torch.randn(64, 8, generator=gen)
        data = TensorDataset(x, x.sum(1, keepdim=True))
        weights = []
        for oom in (False, True):
            module = Net(oom)
            if oom:
                module = micro_batches(module, micro_batch=4, gradient_clip_val=1.0)
            trainer = L.Trainer(strategy="ddp", accelerator="cpu", devices=2, max_steps=4, logger=False,
                                enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                                gradient_clip_val=None if oom else 1.0)
            trainer.fit(module, DataLoader(data, batch_size=4))
            weights.append({k: v.clone() for k, v in module.state_dict().items()})
            steps = trainer.global_step
        same = all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(weights[0].values(), weights[1].values()))
        return {"same_weights": same, "sizes": seen, "steps": steps}

    fn = distributed(gpus=2, runs_dir=runs_dir, timeout=180, tracking=False)(train)
    for result in fn.distributed():
        assert result["same_weights"] and result["steps"] == 4, result
        assert result["sizes"][:1] == [4] and result["sizes"][-1] == 2, result
    records = [json.loads(line) for line in (fn.last_run / "memory.jsonl").read_text().splitlines()]
    assert [(r["step"], r["old_micro_batch"], r["new_micro_batch"], r["ranks"]) for r in records] == [(2, 4, 2, [1])]
