"""gpufleet.strategies: the options API, and DDP / FSDP2 on 2 real gloo ranks against one process.

What a user relies on: a bad strategy name or option is a ConfigError naming the valid ones,
raised before anything starts; k optimizer steps on 2 ranks give the weights one process gets
on the same global batch; grad_accum=2 with half micro-batches gives the weights of grad_accum=1
with whole ones; step() is True only on accumulation boundaries; full_state_dict() hands rank 0
the whole model under the user's own parameter names.

Functions sent to ranks are defined inside the tests so that they travel by value (cloudpickle),
as a notebook user's would; the small model builders below are module-level and are imported by
reference in the ranks (the caller's sys.path travels with the call). DeepSpeed ZeRO has the same
checks in test_deepspeed.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from gpufleet import ConfigError, distributed, runtime, strategies

pytestmark = pytest.mark.timeout(120)

# Two ranks averaging their gradients and one process on the whole batch compute the same sums
# in a different order: float32 rounding, ~1e-7 relative per operation. After STEPS steps of SGD
# on a small model the weights agree to far better than this tolerance; a real difference (a
# missing all-reduce, a gradient summed instead of averaged, a step skipped) is > 1e-2.
ATOL, RTOL = 1e-5, 1e-4
STEPS = 3
GLOBAL_BATCH = 8  # 4 samples per rank; 2 per micro-batch with grad_accum=2
FEATURES = 8
LR = 0.1


def global_batch():
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(GLOBAL_BATCH, FEATURES, generator=gen)
    y = torch.randn(GLOBAL_BATCH, 1, generator=gen)
    return x, y


def one_process_reference(build, x, y, steps=STEPS):
    """What plain single-process training on the whole global batch gives (no gpufleet)."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = build()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_weights_close(got: dict, want: dict, what: str) -> None:
    assert set(got) == set(want), f"{what}: keys {sorted(got)} != the model's own {sorted(want)}"
    for name, ref in want.items():
        value = got[name]
        assert isinstance(value, torch.Tensor) and value.device.type == "cpu", (what, name)
        assert value.shape == ref.shape, f"{what}: {name} has shape {value.shape}, not {ref.shape}"
        assert torch.allclose(value, ref, atol=ATOL, rtol=RTOL), (
            f"{what}: {name} differs from one-process training by "
            f"{(value - ref).abs().max().item():.3g} (tolerance atol={ATOL}, rtol={RTOL})"
        )


# ---------------------------------------------------------------------------- options API


def test_bad_strategy_name_or_options_are_config_errors_before_anything_starts():
    model = torch.nn.Linear(4, 1)

    def sgd(params):
        return torch.optim.SGD(params, lr=0.1)

    assert not dist.is_initialized()

    with pytest.raises(ConfigError) as info:
        strategies.prepare(model, sgd, "fdsp")
    message = str(info.value)
    assert "fdsp" in message
    for name in ("ddp", "fsdp", "zero1", "zero2", "zero3"):
        assert name in message, f"the error does not list the valid strategy {name!r}: {message}"

    valid = {
        "ddp": ("find_unused_parameters", "static_graph", "gradient_as_bucket_view",
                "bucket_cap_mb", "compile"),
        "fsdp": ("blocks", "reshard_after_forward", "activation_checkpointing", "compile",
                 "sync_module_states"),
        "zero2": ("config", "offload_optimizer", "offload_params"),
    }
    for name, options in valid.items():
        with pytest.raises(ConfigError) as info:
            strategies.prepare(model, sgd, name, bucket_size_mb=25)  # a plausible typo
        message = str(info.value)
        assert "bucket_size_mb" in message, message
        for option in options:
            assert option in message, f"{name}: valid option {option!r} not named: {message}"
    # An option of another strategy is unknown too, not silently ignored.
    with pytest.raises(ConfigError, match="blocks"):
        strategies.prepare(model, sgd, "ddp", blocks="Block")

    bad_common = [
        ({"grad_accum": 0}, "grad_accum"),
        ({"grad_accum": -2}, "grad_accum"),
        ({"grad_accum": 1.5}, "grad_accum"),
        ({"grad_accum": "2"}, "grad_accum"),
        ({"grad_accum": True}, "grad_accum"),
        ({"clip_grad_norm": 0}, "clip_grad_norm"),
        ({"clip_grad_norm": -1.0}, "clip_grad_norm"),
        ({"precision": "fp16"}, "bf16"),
        ({"scheduler": 5}, "scheduler"),
    ]
    for kwargs, named in bad_common:
        for name in ("ddp", "fsdp", "zero3"):
            with pytest.raises(ConfigError) as info:
                strategies.prepare(model, sgd, name, **kwargs)
            assert named in str(info.value), (kwargs, str(info.value))
    with pytest.raises(ConfigError, match="optimizer"):
        strategies.prepare(model, "adamw", "ddp")
    # ZeRO's own checks, before DeepSpeed is imported or initialised.
    with pytest.raises(ConfigError, match="stage"):
        strategies.prepare(model, sgd, "zero2", stage=3)  # the name fixes the stage
    with pytest.raises(ConfigError, match="offload_params"):
        strategies.prepare(model, sgd, "zero2", offload_params=True)  # needs stage 3

    assert isinstance(ConfigError("x"), ValueError)
    # Every one of these was refused before a process group (or anything else) was started.
    assert not dist.is_initialized()
    assert list(model.parameters())[0].device.type == "cpu"


# ---------------------------------------------------------------------------- training


def mlp():
    """A small MLP for DDP (only torch.nn classes)."""
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
        torch.nn.Linear(16, 1),
    )


def blocks_net():
    """A model with a ModuleList of identical blocks, as FSDP expects (blocks found by itself)."""

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
            self.blocks = torch.nn.ModuleList(Block() for _ in range(3))
            self.out = torch.nn.Linear(16, 1)

        def forward(self, x):
            x = self.inp(x)
            for block in self.blocks:
                x = block(x)
            return self.out(x)

    return Net()


@pytest.mark.timeout(150)
@pytest.mark.parametrize("strategy, build", [("ddp", mlp), ("fsdp", blocks_net)])
def test_two_ranks_match_one_process_and_grad_accum_matches_whole_batches(
    strategy, build, runs_dir
):
    x, y = global_batch()
    reference = one_process_reference(build, x, y)

    @distributed(gpus=2, runs_dir=runs_dir, timeout=120)
    def train(strategy, x, y):
        import sys

        import torch
        import torch.distributed as dist

        from gpufleet import ConfigError, strategies

        runtime.setup(timeout=60)
        rank, world = runtime.get_global_rank(), runtime.get_world_size()
        per_rank = x.shape[0] // world
        x, y = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
        mse = torch.nn.functional.mse_loss
        out = {}

        def sgd(params):
            return torch.optim.SGD(params, lr=LR, momentum=0.9)

        # grad_accum=1: one whole local batch per optimizer step.
        torch.manual_seed(0)
        model = build()
        trainer = strategies.prepare(model, sgd, strategy)
        out["module_is_users_model"] = trainer.module() is model
        out["device"] = trainer.device
        out["deepspeed_imported"] = "deepspeed" in sys.modules  # only when a ZeRO is chosen
        out["flags_1"] = []
        for _ in range(STEPS):
            trainer.backward(mse(trainer.model(x.to(trainer.device)), y.to(trainer.device)))
            out["flags_1"].append(trainer.step())
        out["optimizer_steps_1"] = trainer.optimizer_steps
        out["full_1"] = trainer.full_state_dict()

        # grad_accum=2: the same local batch as two half micro-batches per optimizer step.
        torch.manual_seed(0)
        trainer = strategies.prepare(build(), sgd, strategy, grad_accum=2)
        out["flags_2"], out["grads_synced"] = [], []
        for _ in range(STEPS):
            for half in (slice(0, per_rank // 2), slice(per_rank // 2, per_rank)):
                trainer.backward(mse(trainer.model(x[half]), y[half]))
                if strategy == "ddp":
                    # "syncs only on the last one": the first micro-batch's gradients stay
                    # local (they differ across ranks), the last one's are averaged (equal).
                    grad = torch.cat([p.grad.flatten() for p in trainer.model.parameters()])
                    both = [torch.zeros_like(grad) for _ in range(world)]
                    dist.all_gather(both, grad)
                    out["grads_synced"].append(torch.equal(both[0], both[1]))
                out["flags_2"].append(trainer.step())
        out["optimizer_steps_2"] = trainer.optimizer_steps
        out["full_2"] = trainer.full_state_dict()

        if strategy == "fsdp":
            try:
                strategies.prepare(build(), sgd, "fsdp", blocks="TransformerBlock")
            except ConfigError as exc:
                out["blocks_error"] = str(exc)
        return out

    results = train.distributed(strategy, x, y)

    for rank, r in enumerate(results):
        assert r["device"] == torch.device("cpu")
        assert not r["deepspeed_imported"], f"rank {rank}: {strategy} imported DeepSpeed"
        assert r["module_is_users_model"], f"rank {rank}: module() is not the user's model"
        assert r["flags_1"] == [True] * STEPS, f"rank {rank}: step() with grad_accum=1"
        assert r["flags_2"] == [False, True] * STEPS, f"rank {rank}: step() with grad_accum=2"
        assert r["optimizer_steps_1"] == r["optimizer_steps_2"] == STEPS
        if strategy == "ddp":
            assert r["grads_synced"] == [False, True] * STEPS, (
                f"rank {rank}: gradients must be all-reduced on the last micro-batch only"
            )
    # full_state_dict(): the whole weights on rank 0, under the model's own names.
    assert_weights_close(results[0]["full_1"], reference, f"{strategy}, 2 ranks")
    assert_weights_close(results[0]["full_2"], reference, f"{strategy}, 2 ranks, grad_accum=2")
    if strategy == "fsdp":
        message = results[0].get("blocks_error")
        assert message is not None, "blocks= naming no submodule class was accepted"
        assert "TransformerBlock" in message, message


# ---------------------------------------------------------------------------- FSDP block options


def test_fsdp_activation_checkpointing_and_resharding_change_memory_not_results(runs_dir):
    """Recomputing each block's activations in backward, or keeping gathered parameters after
    forward, must give the weights plain FSDP gives (bit for bit: the same kernels run)."""

    @distributed(gpus=2, runs_dir=runs_dir, timeout=100)
    def train(options: dict):
        runtime.setup()
        torch.manual_seed(0)
        trainer = strategies.prepare(
            blocks_net(), lambda p: torch.optim.SGD(p, lr=LR, momentum=0.9), "fsdp", **options
        )
        x, y = global_batch()
        rank = runtime.get_global_rank()
        mine = slice(rank * GLOBAL_BATCH // 2, (rank + 1) * GLOBAL_BATCH // 2)
        for _ in range(STEPS):
            trainer.backward(torch.nn.functional.mse_loss(trainer.model(x[mine]), y[mine]))
            trainer.step()
        return trainer.full_state_dict()

    plain = train.distributed({})[0]
    for options in ({"activation_checkpointing": True}, {"reshard_after_forward": False}):
        got = train.distributed(options)[0]
        assert set(got) == set(plain)
        for name in plain:
            assert torch.equal(got[name], plain[name]), f"{options}: {name} differs"


def test_fsdp_model_built_on_the_meta_device_is_materialised_shard_by_shard(runs_dir):
    """A model too large to build whole is built on the meta device; gpufleet shards it, then
    each rank allocates its shards and the model's init_weights() fills them."""

    @distributed(gpus=2, runs_dir=runs_dir, timeout=100)
    def train():
        runtime.setup()

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.blocks = torch.nn.ModuleList(
                    torch.nn.Linear(FEATURES, FEATURES) for _ in range(3)
                )
                self.register_buffer("scale", torch.empty(FEATURES))

            def init_weights(self):
                for i, block in enumerate(self.blocks):
                    block.weight.fill_(0.1 * (i + 1))
                    block.bias.zero_()
                self.scale.fill_(2.0)

            def forward(self, x):
                for block in self.blocks:
                    x = block(x)
                return x * self.scale

        with torch.device("meta"):
            model = Net()
        trainer = strategies.prepare(model, lambda p: torch.optim.SGD(p, lr=LR), "fsdp")
        weights = trainer.full_state_dict()
        x, y = global_batch()
        trainer.backward(torch.nn.functional.mse_loss(trainer.model(x).sum(1, keepdim=True), y))
        trainer.step()
        try:  # a meta model without init_weights() cannot be materialised
            strategies.prepare(
                torch.nn.Linear(2, 2, device="meta"), lambda p: torch.optim.SGD(p, lr=1.0), "fsdp"
            )
            refused = None
        except ConfigError as exc:
            refused = str(exc)
        return {"weights": weights, "buffer": trainer.model.scale.detach().cpu(),
                "refused": refused, "after": trainer.full_state_dict()}

    rank0 = train.distributed()[0]
    for i in range(3):
        want = torch.full((FEATURES, FEATURES), 0.1 * (i + 1))
        assert torch.equal(rank0["weights"][f"blocks.{i}.weight"], want)
        assert torch.equal(rank0["weights"][f"blocks.{i}.bias"], torch.zeros(FEATURES))
    assert torch.equal(rank0["buffer"], torch.full((FEATURES,), 2.0))
    assert not torch.equal(rank0["after"]["blocks.0.weight"], rank0["weights"]["blocks.0.weight"])
    assert rank0["refused"] and "init_weights" in rank0["refused"]
