"""gpufleet.checkpoint.Checkpointer on real gloo ranks: resume exactly, keep the newest K steps,
never count a half-written step, refuse damaged or tampered checkpoints without running code.

Exact resume: fp32 training on CPU with gloo is deterministic, so a run killed after step k was
saved and resumed with restore() must end with bit-identical weights (torch.equal) to a run that
was never interrupted: model, optimizer, scheduler, micro-step counter and every rank's random
generators (dropout) all come back.

Functions sent to ranks are defined inside the tests (they travel by value); the small model
builders and helpers below are imported by reference in the ranks (the caller's sys.path
travels with the call).
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from gpufleet import ConfigError, GpufleetError, RunFailedError, distributed, runtime
from gpufleet.checkpoint import Checkpointer

pytestmark = pytest.mark.timeout(120)

FEATURES = 8
# Resuming in a different world size changes the order of float32 sums (gradients averaged over
# 2 ranks vs. computed on one): the next step agrees to ~1e-7 relative, far inside this. A lost
# optimizer state (Adam moments) or a wrong shard changes the step by ~1e-2 or more.
ATOL, RTOL = 1e-5, 1e-4


# ---------------------------------------------------------------------------- models, data


def mlp(dropout: float = 0.0) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 32), torch.nn.Tanh(), torch.nn.Dropout(dropout),
        torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1),
    )


def blocks_net(dropout: float = 0.0) -> torch.nn.Module:
    """A ModuleList of identical blocks: what FSDP shards block by block."""

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(32, 32)
            self.drop = torch.nn.Dropout(dropout)

        def forward(self, x):
            return x + self.drop(torch.tanh(self.fc(x)))

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = torch.nn.Linear(FEATURES, 32)
            self.blocks = torch.nn.ModuleList(Block() for _ in range(3))
            self.out = torch.nn.Linear(32, 1)

        def forward(self, x):
            x = self.inp(x)
            for block in self.blocks:
                x = block(x)
            return self.out(x)

    return Net()


BUILDERS = {"ddp": mlp, "fsdp": blocks_net}


def batch(step: int, rank: int, micro: int = 0, size: int = 4):
    """This rank's data for a step: a function of (step, micro-batch, rank) only, so a resumed
    run sees exactly the batches the uninterrupted one saw."""
    gen = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
    return torch.randn(size, FEATURES, generator=gen), torch.randn(size, 1, generator=gen)


def resumable_trainer(strategy: str, model: torch.nn.Module):
    """What the exact-resume tests train: AdamW, a scheduler, grad_accum=2 and clipping, so
    that every piece of state a checkpoint holds matters."""
    from gpufleet import strategies

    return strategies.prepare(
        model, lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.01), strategy,
        scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.8),
        grad_accum=2, clip_grad_norm=1.0,
    )


def fit_two_micro_batches(trainer, steps, ckpt=None, save_at=None) -> None:
    """Optimizer steps `steps`, two micro-batches each; save once step `save_at` is done."""
    rank = runtime.get_global_rank()
    for step in steps:
        for micro in range(2):
            x, y = batch(step, rank, micro)
            trainer.backward(torch.nn.functional.mse_loss(trainer.model(x), y))
            trainer.step()
        if ckpt is not None and step + 1 == save_at:
            ckpt.save(step + 1, trainer)


def global_batch(step: int, world: int, rank: int, size: int = 8):
    """Rank `rank`'s slice of one global batch (world=1: the whole batch)."""
    gen = torch.Generator().manual_seed(777 + step)
    x, y = torch.randn(size, FEATURES, generator=gen), torch.randn(size, 1, generator=gen)
    n = size // world
    return x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


def clone_state(obj):
    """A deep copy of a (nested) state dict, tensors cloned."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: clone_state(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(clone_state(v) for v in obj)
    return obj


def same_state(a, b) -> bool:
    """Exactly equal (nested) states: tensors with torch.equal, the rest with ==."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.shape == b.shape and torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b))
    return a == b


def differing(a: dict, b: dict) -> list[str]:
    return sorted(k for k in a.keys() | b.keys() if k not in a or k not in b
                  or not torch.equal(a[k], b[k]))


class Cursor:
    """A tiny user object with state_dict()/load_state_dict(), as `extra=` takes."""

    def __init__(self):
        self.position = 0
        self.seen = []
        self.name = "fresh"
        self.table = torch.zeros(3)

    def state_dict(self):
        return {"position": self.position, "seen": list(self.seen), "name": self.name,
                "table": self.table}

    def load_state_dict(self, state):
        self.position = state["position"]
        self.seen = list(state["seen"])
        self.name = state["name"]
        self.table.copy_(state["table"])


# ---------------------------------------------------------------------------- no processes


def test_empty_root_and_bad_arguments_need_no_process(tmp_path):
    root = tmp_path / "never-saved"
    ckpt = Checkpointer(root)
    assert ckpt.latest() is None
    assert ckpt.steps() == []
    model = mlp()
    before = clone_state(model.state_dict())
    optimizer = torch.optim.Adam(model.parameters())
    # A fresh start: nothing to load, 0 steps done, nothing touched.
    assert ckpt.restore(model, optimizer) == 0
    assert same_state(model.state_dict(), before)
    assert not root.exists() or not any(root.iterdir())

    with pytest.raises(GpufleetError) as info:
        ckpt.restore(model, optimizer, step=5)
    assert "5" in str(info.value)

    for keep in (0, -1, 1.5, True, "3"):
        with pytest.raises(ConfigError, match="keep"):
            Checkpointer(tmp_path / "k", keep=keep)
    with pytest.raises(ConfigError):
        Checkpointer("")
    with pytest.raises(ConfigError, match="step"):
        ckpt.save(-1, model, optimizer)
    with pytest.raises(ConfigError):
        ckpt.save(1, {"not": "a model"})
    with pytest.raises(ConfigError, match="state_dict"):
        ckpt.save(1, model, optimizer, extra={"loader": [1, 2, 3]})
    assert not torch.distributed.is_initialized()
    assert ckpt.latest() is None


# ---------------------------------------------------------------------------- keep, steps


def test_keep_newest_steps_restore_chosen_step_and_raw_model(runs_dir, tmp_path):
    @distributed(gpus=2, runs_dir=runs_dir, timeout=120)
    def train(root, raw_root):
        import os

        import torch
        from torch.nn.parallel import DistributedDataParallel

        from gpufleet import GpufleetError, strategies
        from gpufleet.checkpoint import Checkpointer

        runtime.setup(timeout=60)
        rank = runtime.get_global_rank()
        mse = torch.nn.functional.mse_loss

        def prepared(seed):
            torch.manual_seed(seed)
            return strategies.prepare(
                mlp(), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), "ddp",
                scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5),
            )

        out = {}
        trainer = prepared(0)
        ckpt = Checkpointer(root, keep=2)
        out["empty"] = (ckpt.latest(), ckpt.steps(), ckpt.restore(trainer))
        saved = {}
        for step in range(1, 5):
            x, y = batch(step, rank)
            trainer.backward(mse(trainer.model(x), y))
            trainer.step()
            saved[step] = {
                "model": clone_state(trainer.module().state_dict()),
                "optim": clone_state(trainer.optimizer.state_dict()),
                "lr": trainer.optimizer.param_groups[0]["lr"],
            }
            ckpt.save(step, trainer)
        ckpt.wait()
        out["steps"], out["latest"] = ckpt.steps(), ckpt.latest()
        out["folders"] = sorted(os.listdir(root))

        try:
            ckpt.restore(trainer, step=2)  # pruned by keep=2
        except Exception as exc:
            out["missing"] = (type(exc).__name__, isinstance(exc, GpufleetError), str(exc))

        # A new process would start like this: a fresh model, a new Checkpointer.
        fresh = prepared(123)
        out["restored_3"] = Checkpointer(root, keep=2).restore(fresh, step=3)
        out["model_3"] = same_state(fresh.module().state_dict(), saved[3]["model"])
        out["optim_3"] = same_state(fresh.optimizer.state_dict()["state"],
                                    saved[3]["optim"]["state"])
        out["lr_3"] = (fresh.optimizer.param_groups[0]["lr"], saved[3]["lr"])
        out["scheduler_3"] = fresh.scheduler.last_epoch
        out["optimizer_steps_3"] = fresh.optimizer_steps
        out["restored_latest"] = Checkpointer(root, keep=2).restore(fresh)
        out["model_4"] = same_state(fresh.module().state_dict(), saved[4]["model"])
        out["optimizer_steps_4"] = fresh.optimizer_steps

        # Your own model and optimizer, no prepare(): raw DDP + Adam, and a model alone.
        torch.manual_seed(1)
        raw = DistributedDataParallel(mlp())
        adam = torch.optim.Adam(raw.parameters(), lr=1e-2)
        for step in range(2):
            x, y = batch(step, rank)
            mse(raw(x), y).backward()
            adam.step()
            adam.zero_grad()
        plain = mlp()  # the same initial weights on every rank (seeded)
        with Checkpointer(raw_root) as raw_ckpt:
            raw_ckpt.save(2, raw, adam)
        with Checkpointer(f"{raw_root}-plain") as plain_ckpt:
            plain_ckpt.save(7, plain)
        torch.manual_seed(2)
        raw2 = DistributedDataParallel(mlp())
        adam2 = torch.optim.Adam(raw2.parameters(), lr=1e-2)
        out["raw_restored"] = Checkpointer(raw_root).restore(raw2, adam2)
        out["raw_model"] = same_state(raw2.module.state_dict(), raw.module.state_dict())
        out["raw_optim"] = same_state(adam2.state_dict(), adam.state_dict())
        plain2 = mlp()
        out["plain_restored"] = Checkpointer(f"{raw_root}-plain").restore(plain2)
        out["plain_model"] = same_state(plain2.state_dict(), plain.state_dict())
        return out

    root, raw_root = tmp_path / "ckpt", tmp_path / "raw"
    results = train.distributed(str(root), str(raw_root))

    for rank, r in enumerate(results):
        assert r["empty"] == (None, [], 0), f"rank {rank}: an empty root"
        assert r["steps"] == [3, 4] and r["latest"] == 4, f"rank {rank}: keep=2 -> {r['steps']}"
        assert r["folders"] == ["step-00000003", "step-00000004"], r["folders"]
        name, is_ours, message = r["missing"]
        assert is_ours, f"restore(step=2) raised {name}, not a gpufleet error: {message}"
        assert "2" in message and "3" in message and "4" in message, (
            f"the error must name the missing step and the committed ones: {message}"
        )
        assert r["restored_3"] == 3 and r["model_3"] and r["optim_3"], r
        assert r["lr_3"][0] == r["lr_3"][1] == pytest.approx(0.1 * 0.5**3), r["lr_3"]
        assert r["scheduler_3"] == 3
        assert r["optimizer_steps_3"] == 3
        assert r["restored_latest"] == 4 and r["model_4"] and r["optimizer_steps_4"] == 4
        assert r["raw_restored"] == 2 and r["raw_model"] and r["raw_optim"], (
            f"rank {rank}: raw DDP model + Adam did not round-trip"
        )
        assert r["plain_restored"] == 7 and r["plain_model"]
    assert Checkpointer(root).steps() == [3, 4]
    assert Checkpointer(raw_root).latest() == 2


def test_every_rank_sees_the_step_it_waited_for(runs_dir, tmp_path):
    """After save() and wait() return on a rank, that step is committed: latest() says so on
    every rank, and restore() loads it on every rank (not an older step on some of them)."""

    @distributed(gpus=2, runs_dir=runs_dir, timeout=120)
    def save_and_look(root):
        import torch

        from gpufleet import strategies
        from gpufleet.checkpoint import Checkpointer

        runtime.setup(timeout=60)
        torch.manual_seed(0)
        trainer = strategies.prepare(torch.nn.Linear(4, 4), lambda p: torch.optim.SGD(p, lr=0.1),
                                     "ddp")
        ckpt = Checkpointer(root, keep=2)
        seen = []
        for step in range(1, 9):
            ckpt.save(step, trainer)
            ckpt.wait()
            seen.append(ckpt.latest())
        return {"latest_after_wait": seen, "restored": ckpt.restore(trainer)}

    results = save_and_look.distributed(str(tmp_path / "ckpt"))

    for rank, r in enumerate(results):
        assert r["latest_after_wait"] == list(range(1, 9)), (
            f"rank {rank}: latest() right after save(step) + wait() was "
            f"{r['latest_after_wait']} for steps 1..8"
        )
        assert r["restored"] == 8, f"rank {rank} restored step {r['restored']}, not 8"


# ---------------------------------------------------------------------------- async, RNG, extras


def test_async_save_holds_the_state_of_the_call_and_rng_and_loader_resume(runs_dir, tmp_path):
    files = []
    for i in range(24):
        path = tmp_path / "data" / f"item-{i:02d}.txt"
        path.parent.mkdir(exist_ok=True)
        path.write_text(str(i))
        files.append(str(path))

    @distributed(gpus=2, runs_dir=runs_dir, timeout=120)
    def train(root, files):
        import random

        import numpy as np
        import torch

        from gpufleet import data, strategies
        from gpufleet.checkpoint import Checkpointer

        runtime.setup(timeout=60)
        rank = runtime.get_global_rank()
        mse = torch.nn.functional.mse_loss

        def sgd(params):
            return torch.optim.SGD(params, lr=0.1, momentum=0.9)

        def train_steps(trainer, steps):
            for step in steps:
                x, y = batch(step, rank)
                trainer.backward(mse(trainer.model(x), y))
                trainer.step()

        def draws():
            return torch.rand(4), random.random(), np.random.rand(3)

        torch.manual_seed(0)
        trainer = strategies.prepare(mlp(), sgd, "ddp")
        loader = data.loader(data.FileDataset(files, seed=3), batch_size=2, num_workers=0)
        cursor = Cursor()
        batches = iter(loader)
        consumed = [next(batches), next(batches)]
        cursor.position, cursor.seen, cursor.name = 4, [1, 2], "at step 2"
        cursor.table += torch.tensor([1.0, 2.0, 3.0])
        train_steps(trainer, range(2))
        torch.manual_seed(100 + rank)  # each rank its own generators
        random.seed(100 + rank)
        np.random.seed(100 + rank)
        saved_model = clone_state(trainer.module().state_dict())
        saved_optim = clone_state(trainer.optimizer.state_dict())

        ckpt = Checkpointer(root)  # async_save=True is the default
        ckpt.save(2, trainer, extra={"loader": loader, "cursor": cursor})
        # save() has returned: training goes on and changes everything it saved, while the
        # write may still be running.
        expected_draws = draws()
        with torch.no_grad():
            for p in trainer.model.parameters():
                p.add_(1000.0)
        train_steps(trainer, range(2, 5))
        cursor.position, cursor.name = 999, "changed after save"
        cursor.seen.append(3)
        cursor.table.fill_(-1.0)  # in place: the checkpoint must hold the values at save()
        rest_of_epoch = [b for b in batches]
        ckpt.wait()

        # A fresh process resuming: other seeds, fresh objects.
        torch.manual_seed(555)
        random.seed(555)
        np.random.seed(555)
        fresh = strategies.prepare(mlp(), sgd, "ddp")
        fresh_loader = data.loader(data.FileDataset(files, seed=3), batch_size=2, num_workers=0)
        fresh_cursor = Cursor()
        step = Checkpointer(root).restore(fresh, extra={"loader": fresh_loader,
                                                        "cursor": fresh_cursor})
        resumed_draws = draws()
        return {
            "step": step,
            "model": same_state(fresh.module().state_dict(), saved_model),
            "model_diff": differing(fresh.module().state_dict(), saved_model),
            "optim": same_state(fresh.optimizer.state_dict(), saved_optim),
            "optimizer_steps": fresh.optimizer_steps,
            "cursor": fresh_cursor.state_dict(),
            "consumed": consumed,
            "rest_of_epoch": rest_of_epoch,
            "resumed_epoch": [b for b in fresh_loader],
            "expected_draws": expected_draws,
            "resumed_draws": resumed_draws,
        }

    results = train.distributed(str(tmp_path / "ckpt"), files)

    for rank, r in enumerate(results):
        assert r["step"] == 2
        assert r["model"], (f"rank {rank}: the checkpoint does not hold the weights as of the "
                            f"save() call (changed after it: {r['model_diff']})")
        assert r["optim"], f"rank {rank}: optimizer state (momentum) is not the one at save()"
        assert r["optimizer_steps"] == 2
        cursor = r["cursor"]
        assert (cursor["position"], cursor["seen"], cursor["name"]) == (4, [1, 2], "at step 2")
        assert cursor["table"].tolist() == [1.0, 2.0, 3.0], cursor["table"]
        # The loader resumes where it was at save(): no batch repeated or skipped.
        assert len(r["consumed"]) == 2 and r["rest_of_epoch"], r
        assert r["resumed_epoch"] == r["rest_of_epoch"], (
            f"rank {rank}: resumed loader yields {r['resumed_epoch']}, the uninterrupted one "
            f"went on with {r['rest_of_epoch']}"
        )
        torch_draw, py_draw, np_draw = r["expected_draws"]
        got_torch, got_py, got_np = r["resumed_draws"]
        assert torch.equal(got_torch, torch_draw), f"rank {rank}: torch RNG not resumed"
        assert got_py == py_draw, f"rank {rank}: Python random not resumed"
        assert (got_np == np_draw).all(), f"rank {rank}: NumPy RNG not resumed"
    # Every rank got its own generators back, not rank 0's.
    assert not torch.equal(results[0]["resumed_draws"][0], results[1]["resumed_draws"][0])


# ---------------------------------------------------------------------------- kill and resume


@pytest.mark.timeout(180)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_run_killed_after_save_resumes_to_the_uninterrupted_weights(strategy, runs_dir, tmp_path):
    total, saved_at = 4, 2

    @distributed(gpus=2, runs_dir=runs_dir, timeout=120)
    def run(strategy, root, reference_path, crash):
        import torch
        import torch.distributed as dist

        from gpufleet.checkpoint import Checkpointer

        runtime.setup(timeout=60)
        rank = runtime.get_global_rank()

        def prepared(seed):
            torch.manual_seed(seed)
            return resumable_trainer(strategy, BUILDERS[strategy](dropout=0.1))

        def fit(trainer, steps, ckpt=None):
            fit_two_micro_batches(trainer, steps, ckpt, save_at=saved_at)

        if crash:
            # The uninterrupted run, for reference.
            trainer = prepared(0)
            torch.manual_seed(1000 + rank)  # dropout: each rank its own masks
            fit(trainer, range(total))
            full = trainer.full_state_dict()
            if rank == 0:
                torch.save(full, reference_path)
            # The same run, killed after step `saved_at` was saved (and one more step done).
            trainer = prepared(0)
            torch.manual_seed(1000 + rank)
            ckpt = Checkpointer(root)
            fit(trainer, range(saved_at + 1), ckpt)
            ckpt.wait()
            dist.barrier()
            if rank == 1:
                raise RuntimeError("simulated crash after the checkpoint")
            dist.barrier()  # rank 0 waits here until gpufleet stops it
            return None
        # Resume in new processes, from other seeds: everything must come from the checkpoint.
        trainer = prepared(99)
        torch.manual_seed(5000 + rank)
        start = Checkpointer(root).restore(trainer)
        micro_steps = trainer.micro_steps
        fit(trainer, range(start, total))
        return {"start": start, "micro_steps": micro_steps,
                "optimizer_steps": trainer.optimizer_steps, "full": trainer.full_state_dict()}

    root, reference_path = tmp_path / "ckpt", tmp_path / "uninterrupted.pt"
    with pytest.raises(RunFailedError) as info:
        run.distributed(strategy, str(root), str(reference_path), True)
    assert info.value.root_cause.rank == 1, str(info.value)
    assert "simulated crash" in str(info.value)
    assert Checkpointer(root).latest() == saved_at

    results = run.distributed(strategy, str(root), str(reference_path), False)

    uninterrupted = torch.load(reference_path, weights_only=True)
    resumed = results[0]["full"]
    for r in results:
        assert r["start"] == saved_at
        assert r["micro_steps"] == 2 * saved_at, "the micro-step counter (grad_accum) resumes"
        assert r["optimizer_steps"] == total
    assert resumed.keys() == uninterrupted.keys()
    different = {k: (resumed[k] - uninterrupted[k]).abs().max().item()
                 for k in uninterrupted if not torch.equal(resumed[k], uninterrupted[k])}
    assert not different, (f"{strategy}: resumed weights differ from the uninterrupted run's "
                           f"(max abs difference per tensor): {different}")


@pytest.mark.timeout(180)
def test_fsdp_checkpoint_resumes_from_two_ranks_on_one_and_from_one_on_two(runs_dir, tmp_path):
    @distributed(gpus=2, runs_dir=runs_dir, timeout=120)
    def fsdp_run(restore_from, save_to):
        import warnings

        import torch

        from gpufleet import strategies
        from gpufleet.checkpoint import Checkpointer

        runtime.setup(timeout=60)
        rank, world = runtime.get_global_rank(), runtime.get_world_size()
        mse = torch.nn.functional.mse_loss

        def prepared(seed):
            torch.manual_seed(seed)
            return strategies.prepare(blocks_net(), lambda p: torch.optim.Adam(p, lr=1e-2), "fsdp")

        def fit(trainer, steps):
            for step in steps:
                x, y = global_batch(step, world, rank)
                trainer.backward(mse(trainer.model(x), y))
                trainer.step()

        def whole_weights(trainer):
            # A copy: on one CPU rank the whole weights can be the live parameters themselves
            # (as with module.state_dict()), and training goes on after this.
            return clone_state(trainer.full_state_dict())

        out = {}
        if restore_from:
            trainer = prepared(42)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a 1-rank checkpoint has no RNG for rank 1
                out["restored"] = Checkpointer(restore_from).restore(trainer)
            out["restored_weights"] = whole_weights(trainer)
            fit(trainer, range(2, 3))
            out["next_after_restore"] = whole_weights(trainer)
        if save_to:
            trainer = prepared(0)
            fit(trainer, range(2))
            with Checkpointer(save_to) as ckpt:
                ckpt.save(2, trainer)
            out["saved_weights"] = whole_weights(trainer)
            fit(trainer, range(2, 3))
            out["next_after_save"] = whole_weights(trainer)
        return out

    one_rank = fsdp_run.options(gpus=1)
    by_one, by_two = str(tmp_path / "saved-by-1-rank"), str(tmp_path / "saved-by-2-ranks")

    [saver_1] = one_rank.distributed(None, by_one)
    two = fsdp_run.distributed(by_one, by_two)  # restore 1 -> 2 ranks; then save on 2 ranks
    [restorer_1] = one_rank.distributed(by_two, None)  # restore 2 -> 1 rank
    saver_2 = restorer_2 = two[0]  # whole weights are on rank 0

    assert Checkpointer(by_one).latest() == Checkpointer(by_two).latest() == 2
    for what, saver, restorer in [("1 -> 2 ranks", saver_1, restorer_2),
                                  ("2 -> 1 rank", saver_2, restorer_1)]:
        assert restorer["restored"] == 2, what
        # Loading is exact: the restored whole weights are bit-identical to the saved ones.
        diff = differing(restorer["restored_weights"], saver["saved_weights"])
        assert not diff, f"{what}: restored weights differ from the saved ones in {diff}"
        # The optimizer state came along, resharded: the next step matches the saver's own
        # next step (only the float32 summation order differs between 1 and 2 ranks).
        got, want = restorer["next_after_restore"], saver["next_after_save"]
        assert got.keys() == want.keys(), what
        for name in want:
            assert torch.allclose(got[name], want[name], atol=ATOL, rtol=RTOL), (
                f"{what}: {name} one step after the restore differs from the saver's by "
                f"{(got[name] - want[name]).abs().max().item():.3g} (atol={ATOL}, rtol={RTOL})"
            )


# ---------------------------------------------------------------------------- a save killed


def test_save_killed_half_way_leaves_the_previous_step_latest(runs_dir, tmp_path):
    @distributed(gpus=2, runs_dir=runs_dir, timeout=120)
    def train(root, weights_path, kill_during_save):
        import os
        import signal

        import torch

        from gpufleet import strategies
        from gpufleet.checkpoint import Checkpointer

        class DiesWhenWritten:
            """SIGKILLs its process when pickled, which DCP does while it writes the step's
            files: a deterministic "machine lost half-way through a save"."""

            def __deepcopy__(self, memo):
                return self  # the in-memory copy save() makes lets it through

            def __reduce__(self):
                os.kill(os.getpid(), signal.SIGKILL)

        class Progress:
            def __init__(self):
                self.step, self.armed = 0, False

            def state_dict(self):
                return {"step": self.step, "payload": DiesWhenWritten() if self.armed else "-"}

            def load_state_dict(self, state):
                self.step = state["step"]

        runtime.setup(timeout=60)
        rank = runtime.get_global_rank()
        mse = torch.nn.functional.mse_loss

        def fit(trainer, step):
            x, y = batch(step, rank)
            trainer.backward(mse(trainer.model(x), y))
            trainer.step()

        torch.manual_seed(0)
        trainer = strategies.prepare(mlp(), lambda p: torch.optim.SGD(p, lr=0.1), "ddp")
        ckpt, progress = Checkpointer(root), Progress()
        if kill_during_save:
            fit(trainer, 0)
            progress.step = 1
            ckpt.save(1, trainer, extra={"progress": progress})
            ckpt.wait()
            if rank == 0:
                torch.save(clone_state(trainer.module().state_dict()), weights_path)
            fit(trainer, 1)
            progress.step, progress.armed = 2, True
            ckpt.save(2, trainer, extra={"progress": progress})
            ckpt.wait()
            return "the save of step 2 was not killed"
        # A new run on the same root.
        latest_before = ckpt.latest()
        start = ckpt.restore(trainer, extra={"progress": progress})
        restored = clone_state(trainer.module().state_dict())
        step_of_progress = progress.step
        fit(trainer, 1)
        progress.step = 2
        ckpt.save(2, trainer, extra={"progress": progress})
        ckpt.wait()
        return {"latest_before": latest_before, "start": start, "restored": restored,
                "progress": step_of_progress, "latest_after": ckpt.latest(),
                "folders": sorted(os.listdir(root))}

    root, weights_path = tmp_path / "ckpt", tmp_path / "step1.pt"
    with pytest.raises(RunFailedError) as info:
        train.distributed(str(root), str(weights_path), True)
    root_cause = info.value.root_cause
    assert root_cause.kind == "signal" and root_cause.signal_name == "SIGKILL", str(info.value)
    # The kill struck while step 2 was being written: its folder is there, uncommitted.
    partial = root / "step-00000002.partial"
    assert partial.is_dir(), sorted(p.name for p in root.iterdir())
    assert not (partial / "gpufleet.json").exists()

    assert Checkpointer(root).steps() == [1]
    assert Checkpointer(root).latest() == 1

    results = train.distributed(str(root), str(weights_path), False)

    saved = torch.load(weights_path, weights_only=True)
    for rank, r in enumerate(results):
        assert r["latest_before"] == 1 and r["start"] == 1, r
        assert not differing(r["restored"], saved), f"rank {rank}: step 1's weights not restored"
        assert r["progress"] == 1, "extra state of step 1"
        assert r["latest_after"] == 2
        assert r["folders"] == ["step-00000001", "step-00000002"], (
            f"the killed save's folder is left over: {r['folders']}"
        )


# ---------------------------------------------------------------------------- damaged, tampered


class RunsCode:
    """Unpickling this runs a shell command that creates `marker`."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch '{self.marker}'",))


def _metadata(folder: Path):
    return pickle.loads((folder / ".metadata").read_bytes())  # our own file: trusted here


def _poison_metadata(folder: Path, marker: Path) -> bytes:
    metadata = _metadata(folder)
    metadata.planner_data = {**(metadata.planner_data or {}), "note": RunsCode(marker)}
    poisoned = pickle.dumps(metadata)
    (folder / ".metadata").write_bytes(poisoned)
    return poisoned


def _poison_item(folder: Path, fqn: str, marker: Path) -> bytes:
    """Point the checkpoint's entry `fqn` at a torch.save'd object that runs code when loaded
    with plain pickle, appended to the data file that held the entry."""
    metadata = _metadata(folder)
    [index] = [i for i in metadata.storage_data if i.fqn == fqn]
    info = metadata.storage_data[index]
    data_file = folder / info.relative_path
    buffer = io.BytesIO()
    torch.save(RunsCode(marker), buffer)
    payload = buffer.getvalue()
    offset = data_file.stat().st_size
    with open(data_file, "ab") as f:
        f.write(payload)
    metadata.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(payload))
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    return payload


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_damaged_or_tampered_checkpoint_is_refused_without_running_code(runs_dir, tmp_path):
    def make_checkpoint(root):
        import torch

        from gpufleet import strategies
        from gpufleet.checkpoint import Checkpointer

        runtime.setup(timeout=60)
        torch.manual_seed(0)
        trainer = strategies.prepare(mlp(), lambda p: torch.optim.Adam(p), "ddp")
        cursor = Cursor()
        cursor.name = "saved"
        with Checkpointer(root) as ckpt:
            ckpt.save(1, trainer, extra={"cursor": cursor})

    good = tmp_path / "good"
    distributed(gpus=2, runs_dir=runs_dir, timeout=120)(make_checkpoint).distributed(str(good))
    step = good / "step-00000001"
    assert Checkpointer(good).latest() == 1

    roots, markers = {}, {}
    for case in ("truncated data file", "truncated metadata", "code in metadata",
                 "code in an item"):
        root = tmp_path / case.replace(" ", "-")
        shutil.copytree(good, root)
        roots[case], markers[case] = root, tmp_path / f"{root.name}.marker"
    folder = {case: root / "step-00000001" for case, root in roots.items()}
    largest = max(step.glob("*.distcp"), key=lambda p: p.stat().st_size).name
    _truncate(folder["truncated data file"] / largest)
    _truncate(folder["truncated metadata"] / ".metadata")
    poisoned_metadata = _poison_metadata(folder["code in metadata"], markers["code in metadata"])
    poisoned_item = _poison_item(folder["code in an item"], "extra/cursor.name",
                                 markers["code in an item"])

    @distributed(gpus=2, runs_dir=runs_dir, timeout=120)
    def try_restores(roots):
        import torch

        from gpufleet import GpufleetError, strategies
        from gpufleet.checkpoint import Checkpointer

        runtime.setup(timeout=60)
        torch.manual_seed(1)
        trainer = strategies.prepare(mlp(), lambda p: torch.optim.Adam(p), "ddp")
        outcome = {}
        for case, root in roots.items():
            cursor = Cursor()
            try:
                step = Checkpointer(root).restore(trainer, extra={"cursor": cursor})
                outcome[case] = ("loaded", step, cursor.name)
            except BaseException as exc:  # noqa: B036 (torch's CheckpointException is one)
                if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                    raise
                outcome[case] = (type(exc).__name__, isinstance(exc, GpufleetError), str(exc))
        return outcome

    results = try_restores.distributed({"intact": str(good),
                                        **{case: str(root) for case, root in roots.items()}})

    ran_code = [case for case, marker in markers.items() if marker.exists()]
    assert not ran_code, f"loading these checkpoints ran the code in them: {ran_code}"
    problems = []
    for rank, outcome in enumerate(results):
        assert outcome["intact"] == ("loaded", 1, "saved"), outcome["intact"]
        for case, root in roots.items():
            name, is_ours, message = outcome[case]
            headline = message.strip().splitlines()[0] if message.strip() else ""
            if not is_ours:
                problems.append(f"rank {rank}, {case}: {name} instead of a gpufleet error: "
                                f"{headline}")
            elif root.name not in message:
                problems.append(f"rank {rank}, {case}: the error does not name the checkpoint: "
                                f"{headline}")
    assert not problems, "\n".join(problems)
    # The poisoned parts really are code: plain unpickling runs it.
    pickle.loads(poisoned_metadata)
    torch.load(io.BytesIO(poisoned_item), weights_only=False)
    assert markers["code in metadata"].exists() and markers["code in an item"].exists()


# ---------------------------------------------------------------------------- remote roots


@pytest.mark.timeout(180)
def test_url_root_is_staged_locally_uploaded_and_resumed(runs_dir, tmp_path, monkeypatch):
    """An fsspec URL root (here `local://`, the local file system through fsspec's remote code
    path): each step is written to a local staging folder, uploaded with its commit record last,
    pruned to `keep`, and a new run resumes from it."""
    pytest.importorskip("fsspec")
    home = tmp_path / "home"
    monkeypatch.setenv("GPUFLEET_HOME", str(home))
    bucket = tmp_path / "bucket"
    url = f"local://{bucket}"

    @distributed(gpus=2, runs_dir=runs_dir, timeout=100)
    def train(resume: bool):
        from gpufleet import strategies

        runtime.setup()
        torch.manual_seed(0)
        trainer = strategies.prepare(mlp(), lambda p: torch.optim.Adam(p, lr=0.01), "ddp")
        ckpt = Checkpointer(url, keep=2)
        start = ckpt.restore(trainer) if resume else 0
        for step in range(start, start + 3):
            x, y = batch(step, runtime.get_global_rank())
            trainer.backward(torch.nn.functional.mse_loss(trainer.model(x), y))
            trainer.step()
            ckpt.save(step + 1, trainer)
        ckpt.wait()
        return {"start": start, "steps": ckpt.steps(), "weights": trainer.full_state_dict()}

    first = train.distributed(False)
    assert first[0]["steps"] == first[1]["steps"] == [2, 3]
    assert sorted(p.name for p in bucket.iterdir()) == ["step-00000002", "step-00000003"]
    assert (bucket / "step-00000003" / "gpufleet.json").is_file()
    assert (bucket / "step-00000003" / ".metadata").is_file()
    staged = list((home / "cache" / "checkpoints").rglob("*.partial"))
    assert staged == [], f"staging folders left behind: {staged}"

    again = train.distributed(True)
    assert again[0]["start"] == 3
    assert again[0]["steps"] == [5, 6]
    assert not differing(first[0]["weights"], first[0]["weights"])  # sanity of the helper
    assert differing(again[0]["weights"], first[0]["weights"]), "three more steps changed nothing"
