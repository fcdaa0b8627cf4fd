"""DeepSpeed ZeRO-2 / ZeRO-3 through gpufleet.strategies on 2 CPU gloo ranks (DeepSpeed runs on
CPU), so they are tested without GPUs too: the same weights as one process on the same global
batch, grad_accum, step() flags, full_state_dict(), exact resume after a killed run, and a
checkpoint whose DeepSpeed files were tampered with must not run code when restored.

Both stages run inside one gpufleet call where possible: each call pays for importing DeepSpeed
and loading its comm op once per rank. On a fresh machine DeepSpeed's first run JIT-compiles that
op (~30 s) into ~/.cache/torch_extensions (or $TORCH_EXTENSIONS_DIR); later runs reuse it.

DeepSpeed is not imported into the test process (skip check by find_spec): it takes seconds and
sets a process-wide accelerator.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from gpufleet import RunFailedError, distributed, runtime
from gpufleet.checkpoint import Checkpointer
from support import run_folders
from test_checkpoint import (RunsCode, batch, clone_state, differing, fit_two_micro_batches,
                             resumable_trainer)
from test_checkpoint import mlp as mlp_with_dropout
from test_strategies import (FEATURES, STEPS, assert_weights_close, global_batch, mlp,
                             one_process_reference)

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                       reason="deepspeed is not installed"),
    pytest.mark.timeout(240),
]

STAGES = ("zero2", "zero3")


def test_zero_two_ranks_match_one_process_and_grad_accum_matches_whole_batches(runs_dir):
    x, y = global_batch()
    reference = one_process_reference(mlp, x, y)

    @distributed(gpus=2, runs_dir=runs_dir, timeout=200)
    def train(x, y):
        import torch

        from gpufleet import strategies
        from test_strategies import LR

        runtime.setup(timeout=60)
        rank, world = runtime.get_global_rank(), runtime.get_world_size()
        per_rank = x.shape[0] // world
        x, y = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
        mse = torch.nn.functional.mse_loss

        def sgd(params):
            return torch.optim.SGD(params, lr=LR, momentum=0.9)

        results = {}
        for stage in STAGES:
            out = results[stage] = {}
            torch.manual_seed(0)
            model = mlp()
            trainer = strategies.prepare(model, sgd, stage)
            out["module_is_users_model"] = trainer.module() is model
            out["flags_1"] = []
            for _ in range(STEPS):
                trainer.backward(mse(trainer.model(x.to(trainer.device)), y.to(trainer.device)))
                out["flags_1"].append(trainer.step())
            out["optimizer_steps_1"] = trainer.optimizer_steps
            out["full_1"] = trainer.full_state_dict()

            torch.manual_seed(0)
            trainer = strategies.prepare(mlp(), sgd, stage, grad_accum=2)
            out["flags_2"] = []
            for _ in range(STEPS):
                for half in (slice(0, per_rank // 2), slice(per_rank // 2, per_rank)):
                    trainer.backward(mse(trainer.model(x[half]), y[half]))
                    out["flags_2"].append(trainer.step())
            out["optimizer_steps_2"] = trainer.optimizer_steps
            out["full_2"] = trainer.full_state_dict()
        return results

    results = train.distributed(x, y)

    for stage in STAGES:
        for rank, per_rank in enumerate(results):
            r = per_rank[stage]
            assert r["module_is_users_model"], f"{stage}, rank {rank}: module()"
            assert r["flags_1"] == [True] * STEPS, f"{stage}, rank {rank}: step() flags"
            assert r["flags_2"] == [False, True] * STEPS, f"{stage}, rank {rank}: grad_accum=2"
            assert r["optimizer_steps_1"] == r["optimizer_steps_2"] == STEPS
        # grad_accum=2 on half micro-batches is the same training as whole batches...
        assert_weights_close(results[0][stage]["full_2"], results[0][stage]["full_1"],
                             f"{stage}: grad_accum=2 against grad_accum=1")
    for stage in STAGES:
        # ...and 2 ranks are the same training as one process on the global batch (no clipping
        # asked for: clip_grad_norm=None).
        assert_weights_close(results[0][stage]["full_1"], reference, f"{stage}, 2 ranks")
        assert_weights_close(results[0][stage]["full_2"], reference,
                             f"{stage}, 2 ranks, grad_accum=2")


def test_zero_run_killed_after_save_resumes_to_the_uninterrupted_weights(runs_dir, tmp_path):
    total, saved_at = 4, 2

    @distributed(gpus=2, runs_dir=runs_dir, timeout=200)
    def run(root, crash):
        import torch
        import torch.distributed as dist

        from gpufleet.checkpoint import Checkpointer

        runtime.setup(timeout=60)
        rank = runtime.get_global_rank()

        def prepared(stage, seed):
            torch.manual_seed(seed)
            return resumable_trainer(stage, mlp_with_dropout(dropout=0.1))

        def fit(trainer, steps, ckpt=None):
            fit_two_micro_batches(trainer, steps, ckpt, save_at=saved_at)

        out = {}
        for stage in STAGES:
            if crash:
                trainer = prepared(stage, 0)
                torch.manual_seed(1000 + rank)  # dropout masks: each rank its own
                fit(trainer, range(total))
                out[stage] = clone_state(trainer.full_state_dict())
                trainer = prepared(stage, 0)
                torch.manual_seed(1000 + rank)
                ckpt = Checkpointer(f"{root}/{stage}")
                fit(trainer, range(saved_at + 1), ckpt)
                ckpt.wait()
            else:
                trainer = prepared(stage, 99)
                torch.manual_seed(5000 + rank)
                start = Checkpointer(f"{root}/{stage}").restore(trainer)
                micro_steps = trainer.micro_steps
                fit(trainer, range(start, total))
                out[stage] = {"start": start, "micro_steps": micro_steps,
                              "optimizer_steps": trainer.optimizer_steps,
                              "full": clone_state(trainer.full_state_dict())}
        if crash:
            if rank == 0:
                torch.save(out, f"{root}/uninterrupted.pt")
            dist.barrier()
            if rank == 1:
                raise RuntimeError("simulated crash after the checkpoints")
            dist.barrier()  # rank 0 waits here until gpufleet stops it
        return out

    with pytest.raises(RunFailedError) as info:
        run.distributed(str(tmp_path), True)
    assert info.value.root_cause.rank == 1 and "simulated crash" in str(info.value)

    results = run.distributed(str(tmp_path), False)

    uninterrupted = torch.load(tmp_path / "uninterrupted.pt", weights_only=True)
    for stage in STAGES:
        assert Checkpointer(tmp_path / stage).latest() == saved_at
        for r in results:
            assert r[stage]["start"] == saved_at
            assert r[stage]["micro_steps"] == 2 * saved_at
            assert r[stage]["optimizer_steps"] == total
        resumed, want = results[0][stage]["full"], uninterrupted[stage]
        assert resumed.keys() == want.keys()
        different = {k: (resumed[k] - want[k]).abs().max().item() for k in differing(resumed, want)}
        assert not different, (f"{stage}: resumed weights differ from the uninterrupted run's "
                               f"(max abs difference per tensor): {different}")


def test_zero_checkpoint_with_code_in_its_deepspeed_files_is_refused(runs_dir, tmp_path):
    """README: "Checkpoints load without unpickling code". A ZeRO checkpoint keeps the engine's
    own files beside DCP's; one of them replaced by a pickle that runs a command must be refused
    without running it."""
    marker = tmp_path / "code-ran"

    @distributed(gpus=1, runs_dir=runs_dir, timeout=200)
    def save_poison_restore(root, marker):
        import glob

        import torch

        from gpufleet import strategies
        from gpufleet.checkpoint import Checkpointer

        runtime.setup(timeout=60)
        torch.manual_seed(0)
        trainer = strategies.prepare(mlp(), lambda p: torch.optim.Adam(p), "zero2")
        x, y = global_batch()
        trainer.backward(torch.nn.functional.mse_loss(trainer.model(x), y))
        trainer.step()
        with Checkpointer(root) as ckpt:
            ckpt.save(1, trainer)
        # Someone with write access to the checkpoint folder swaps in a pickle that runs code.
        poisoned = sorted(glob.glob(f"{root}/step-00000001/deepspeed/**/*.pt", recursive=True))
        for path in poisoned:
            torch.save(RunsCode(marker), path)
        try:
            Checkpointer(root).restore(trainer)
            outcome = "restored"
        except BaseException as exc:  # noqa: B036 (torch's CheckpointException is one)
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            outcome = f"{type(exc).__name__}: {exc}"
        return [p.rsplit("/", 1)[-1] for p in poisoned], outcome

    [(poisoned, outcome)] = save_poison_restore.distributed(str(tmp_path / "ckpt"), str(marker))

    assert poisoned, "the ZeRO checkpoint has no DeepSpeed .pt files to tamper with"
    assert not marker.exists(), (
        f"restoring a ZeRO checkpoint ran code planted in its DeepSpeed files {poisoned} "
        f"(restore outcome: {outcome[:300]})"
    )
    assert outcome != "restored"


def test_zero3_offload_to_cpu_gives_the_same_weights(runs_dir):
    """offload_optimizer / offload_params move state to CPU memory; the math must not change."""

    @distributed(gpus=2, runs_dir=runs_dir, timeout=200)
    def train(options: dict):
        from gpufleet import strategies

        runtime.setup()
        torch.manual_seed(0)
        trainer = strategies.prepare(
            mlp(), lambda p: torch.optim.AdamW(p, lr=0.05), "zero3", **options
        )
        config = trainer.model.config  # what DeepSpeed was given
        for step in range(STEPS):
            x, y = batch(step, runtime.get_global_rank())
            trainer.backward(torch.nn.functional.mse_loss(trainer.model(x), y))
            trainer.step()
        zero = config["zero_optimization"]
        return {"weights": trainer.full_state_dict(),
                "offloaded": sorted(k for k in ("offload_optimizer", "offload_param") if k in zero)}

    offloaded = train.distributed({"offload_optimizer": True, "offload_params": True})[0]
    plain = train.distributed({})[0]
    assert offloaded["offloaded"] == ["offload_optimizer", "offload_param"]
    assert plain["offloaded"] == []
    assert not differing(offloaded["weights"], plain["weights"]), "offload changed the weights"


def test_zero_optimizer_steps_are_the_steps_of_the_step_telemetry(runs_dir):
    """As under DDP and FSDP, each optimizer step of ZeRO's trainer is one step of the run's
    step telemetry (steps.json), with no code change: micro-batches are not steps."""
    @distributed(gpus=2, runs_dir=runs_dir, tracking=False, timeout=200)
    def train():
        import torch

        from gpufleet import strategies

        prepared = strategies.prepare(mlp(), lambda p: torch.optim.SGD(p, lr=0.01), "zero2", grad_accum=2)
        for _ in range(12):  # 6 optimizer steps
            prepared.backward(prepared.model(torch.randn(4, FEATURES)).pow(2).mean())
            prepared.step()
        return prepared.optimizer_steps

    assert train.distributed() == [6, 6]
    summary = json.loads((run_folders(runs_dir)[-1] / "steps.json").read_text())
    assert sorted((row["rank"], row["steps"]) for row in summary["ranks"]) == [(0, 6), (1, 6)], summary
