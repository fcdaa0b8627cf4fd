"""``MicroBatches``: one optimizer step over a rank's batch in micro-batches, and a CUDA
out-of-memory error on any rank that halves the micro-batch on every rank and redoes the step.

    trainer = strategies.prepare(model, lambda p: torch.optim.AdamW(p, lr=3e-4), "ddp")
    batches = memory.MicroBatches(trainer, micro_batch=8)
    for batch in loader:                       # this rank's 32 samples: 8 × 4 micro-batches
        loss = batches.step(batch, lambda micro: loss_fn(trainer.model(micro["x"]), micro["y"]))

Each step splits the batch into micro-batches, weighs each micro-batch's loss by its share of
the samples, and steps the optimizer once: the global batch is ``batch × world size`` whatever
the micro-batch, so a shrink changes neither the gradients nor the number of optimizer steps.

When a rank runs out of GPU memory, it stops its micro-batches and every rank says, at the
end of the step, whether it ran out (one all-reduce on a gloo group of its own); if any did,
every rank drops the step's gradients, frees the allocator's cache, halves the micro-batch and
redoes the step. Where the others may be waiting inside a collective for the rank that ran out
(see ``_drivers``), or the optimizer had begun its step, nothing can be agreed on: the rank
records the smaller micro-batch and raises, gpufleet stops the others, and a retry of the call
(``max_retries``) starts at the smaller micro-batch, resuming from the last checkpoint. At
micro-batch 1 an OOM is an error that carries the memory estimate.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable
from typing import Any

from gpufleet import _environ
from gpufleet._log import log
from gpufleet.errors import ConfigError, GpufleetError
from gpufleet.memory import records

__all__ = ["MicroBatches", "MicroBatchFloorError"]


class MicroBatchFloorError(GpufleetError, RuntimeError):
    """Out of GPU memory at micro-batch 1: no smaller step is left to try."""


class MicroBatches:
    """Optimizer steps in micro-batches that shrink when a rank runs out of GPU memory.

    ``target``: the trainer of ``gpufleet.strategies.prepare`` (prepared with
    ``grad_accum=1``: this accumulates), or a model (plain on one rank, DDP or FSDP2) with its
    ``optimizer`` and optional ``scheduler``. ``micro_batch``: samples per forward pass at
    first. ``shrink=False`` lets an out-of-memory error through as it is. ``overlap_sync``
    (DDP): let DDP's last backward pass synchronise gradients while it computes, faster where
    communication is a large share of the step, at the price of ending the attempt (a retry
    goes on) when a rank runs out in that micro-batch. ``backward(loss)``: how a micro-batch's
    loss is backpropagated (default: the trainer's, else ``loss.backward()``).

    ``micro_batch``, ``grad_accum`` (of the last step), ``optimizer_steps`` and ``shrinks``
    (this process's records, ``memory.records``) tell where it stands; ``state_dict()`` keeps
    the micro-batch in a checkpoint (``Checkpointer.save(..., extra={"batches": batches})``).
    """

    def __init__(self, target: Any, micro_batch: int, *, optimizer: Any = None, scheduler: Any = None,
                 shrink: bool = True, overlap_sync: bool = False,
                 backward: Callable[[Any], Any] | None = None):
        if isinstance(micro_batch, bool) or not isinstance(micro_batch, int) or micro_batch < 1:
            raise ConfigError(f"micro_batch={micro_batch!r} must be a whole number ≥ 1")
        from gpufleet.memory._drivers import driver_for

        self.world_size = _environ.world_size()
        self.rank = _environ.rank()
        self._driver = driver_for(target, optimizer, scheduler, self.world_size, overlap_sync)
        self.shrink = shrink
        self._backward = backward or self._driver.backward
        self.micro_batch = micro_batch
        self.grad_accum: int | None = None
        self.optimizer_steps = 0
        self.shrinks: list[dict[str, Any]] = []
        self._group: Any = None
        self._shapes: Any = None  # the last micro-batch's forward arguments, as meta tensors
        self._where: str | None = None  # where this rank last ran out: "micro-batch 2 of 4, backward"
        self._hook = self._driver.model.register_forward_pre_hook(self._remember, with_kwargs=True)
        self._resume_smaller()

    # -- the step -----------------------------------------------------------------------------

    def step(self, batch: Any, loss_fn: Callable[[Any], Any]) -> Any:
        """One optimizer step over ``batch`` (this rank's samples: a tensor, or a tuple, list or
        dict of tensors sharing their first dimension); ``loss_fn(micro)`` returns the mean
        loss of a micro-batch. Returns the batch's mean loss (a tensor, detached)."""
        loss = self.accumulate(batch, loss_fn)
        self._finish(_size(batch))
        return loss

    def accumulate(self, batch: Any, loss_fn: Callable[[Any], Any], *, weigh: bool = True,
                   synchronise: bool = True, redo: bool = True) -> Any:
        """``step`` without the optimizer step, for a loop that steps the optimizer itself (the
        Hugging Face Trainer's): the gradients of ``batch`` are added to the parameters' and,
        with ``synchronise``, averaged across ranks. ``weigh=False``: ``loss_fn`` returns a
        micro-batch's loss already on the batch's scale (summed, not weighed by its samples).
        ``redo=False``: the parameters held gradients before this call, which a redo could not
        tell apart from this call's, so an OOM ends the attempt (a retry goes on)."""
        size = _size(batch)
        while True:
            ran_out = self._micro_batches(batch, size, loss_fn, weigh, synchronise, redo)
            out_of_memory = self._agree(ran_out is not None, size)
            if not out_of_memory:
                if synchronise:
                    self._synchronise(size)
                return self._loss
            self._shrink(out_of_memory, size)

    def _micro_batches(self, batch: Any, size: int, loss_fn: Callable[[Any], Any], weigh: bool,
                       synchronise: bool, redo: bool) -> str | None:
        """Run the step's micro-batches; None when every one ran, else where it ran out."""
        import torch

        chunks = _split(batch, self.micro_batch, size)
        self.grad_accum = len(chunks)
        self._loss = None
        for i, chunk in enumerate(chunks):
            last = i == len(chunks) - 1 and synchronise
            phase = "forward"
            try:
                with self._driver.micro_batch(first=i == 0, last=last):
                    loss = loss_fn(chunk)
                    phase = "backward"
                    weighted = loss * (_size(chunk) / size) if weigh else loss
                    self._backward(weighted)
                self._loss = weighted.detach() if self._loss is None else self._loss + weighted.detach()
            except torch.OutOfMemoryError as exc:
                if not self.shrink:
                    raise
                self._where = f"micro-batch {i + 1} of {len(chunks)}, {phase}"
                if self._driver.leaves_peers_waiting(last):
                    self._give_up(exc, size, "the other ranks may be waiting for it in a collective")
                if not redo:
                    self._give_up(exc, size, "the gradients it holds from earlier in the optimizer step "
                                             "cannot be told apart from this pass's")
                return self._where
        return None

    def _synchronise(self, size: int) -> None:
        """Average the gradients the micro-batches kept local: past the agreement, an OOM here
        cannot be undone in place."""
        import torch

        try:
            self._driver.synchronise()
        except torch.OutOfMemoryError as exc:
            if not self.shrink:
                raise
            self._where = "gradients' all-reduce"
            self._give_up(exc, size, "the gradients' all-reduce had begun")

    def _finish(self, size: int) -> None:
        """The optimizer step: past the agreement, an OOM cannot be undone in place."""
        import torch

        try:
            self._driver.finish()
        except torch.OutOfMemoryError as exc:
            if not self.shrink:
                raise
            self._where = "optimizer step"
            self._give_up(exc, size, "the optimizer step had begun")
        self.optimizer_steps += 1

    # -- agreeing -------------------------------------------------------------------------------

    def _agree(self, ran_out: bool, size: int) -> list[int]:
        """The ranks that ran out in this step, as every rank learns them."""
        if self.world_size == 1:
            return [self.rank] if ran_out else []
        import torch
        import torch.distributed as dist

        flags = torch.zeros(self.world_size, dtype=torch.int32)
        flags[self.rank] = int(ran_out)
        try:
            dist.all_reduce(flags, group=self._gloo())
        except Exception as exc:
            if ran_out:  # the others are gone or stuck: the retry goes on at the smaller size
                self._record(self._new_size(), [self.rank], size, in_place=False)
            raise exc
        return [rank for rank, flag in enumerate(flags.tolist()) if flag]

    def _gloo(self) -> Any:
        """A gloo group of its own, so that agreeing never queues behind training collectives
        (made at the first agreement, by every rank at the same step)."""
        if self._group is None:
            import torch.distributed as dist

            self._group = dist.new_group(backend="gloo")
        return self._group

    # -- shrinking ------------------------------------------------------------------------------

    def _shrink(self, ranks: list[int], size: int) -> None:
        self._free()
        if self.micro_batch == 1:
            raise MicroBatchFloorError(self._floor_message(ranks))
        self._record(self._new_size(), ranks, size, in_place=True)
        self.micro_batch = self._new_size()

    def _new_size(self) -> int:
        return max(1, self.micro_batch // 2)

    def _free(self) -> None:
        """Drop what the step held: its gradients, the allocator's cached blocks."""
        self._driver.forget()
        self._loss = None
        gc.collect()  # the failed pass's graph may sit in a reference cycle
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()

    def _give_up(self, exc: BaseException, size: int, why: str) -> None:
        """Record the smaller micro-batch for a retry and let the error end the attempt."""
        new = self._new_size()
        if self.micro_batch > 1:
            self._record(new, [self.rank], size, in_place=False)
            exc.add_note(f"gpufleet: this rank ran out of GPU memory where it cannot agree with the others "
                         f"({why}); a retry of the call (max_retries) goes on at micro-batch {new}, from "
                         "the last checkpoint")
        else:
            exc.add_note(f"gpufleet: out of GPU memory at micro-batch 1.\n{self._estimate_text()}")
        raise exc

    def _record(self, new: int, ranks: list[int], size: int, in_place: bool) -> None:
        record = {
            "time": time.time(), "attempt": _environ.attempt(), "step": self._step_number(),
            "old_micro_batch": self.micro_batch, "new_micro_batch": new,
            "grad_accum": math.ceil(size / new) if size else None, "batch": size,
            "world_size": self.world_size, "global_batch": size * self.world_size if size else None,
            "ranks": ranks, "where": self._where if self.rank in ranks else None, "in_place": in_place,
        }
        self.shrinks.append(record)
        if in_place and self.rank != min(ranks):  # one line per shrink: the lowest such rank's
            return
        log.warning(f"rank {self.rank}: {records.describe(record)}")
        _keep(record)

    def _step_number(self) -> int:
        prepared = self._driver.prepared
        return (prepared.optimizer_steps if prepared is not None else self.optimizer_steps) + 1

    def _floor_message(self, ranks: list[int]) -> str:
        who = ", ".join(map(str, ranks))
        return (f"rank{'s' if len(ranks) > 1 else ''} {who} ran out of GPU memory at step "
                f"{self._step_number()} with micro-batch 1: even one sample per forward pass does not "
                f"fit. Use activation checkpointing, LoRA, a sharded strategy ('fsdp', 'zero3') or more "
                f"GPUs, or shorter sequences.\n{self._estimate_text()}")

    def _estimate_text(self) -> str:
        from gpufleet.memory.check import estimate_call

        try:
            found = estimate_call(self._driver.model, self._shapes, self._driver.prepared, 1)
        except Exception as exc:  # noqa: BLE001  # the error is the OOM; the estimate only helps
            return f"(no memory estimate: {type(exc).__name__}: {exc})"
        return "memory estimate per GPU:\n" + str(found)

    # -- bookkeeping ----------------------------------------------------------------------------

    def _remember(self, module: Any, args: tuple, kwargs: dict) -> None:
        """Keep the shapes of the model's last call, for the estimate at the floor."""
        import torch
        from torch.utils._pytree import tree_map_only

        self._shapes = tree_map_only(
            torch.Tensor, lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta"), (args, kwargs))

    def _resume_smaller(self) -> None:
        """A retry starts at the micro-batch an earlier attempt shrank to."""
        folder = _environ.run_dir()
        if folder is None or _environ.attempt() == 0:
            return
        earlier = records.earlier(folder)
        if earlier and earlier[-1]["new_micro_batch"] < self.micro_batch:
            self.micro_batch = earlier[-1]["new_micro_batch"]
            if self.rank == 0:
                log.warning(f"micro-batch {self.micro_batch}: attempt {earlier[-1].get('attempt')} ran out "
                            f"of GPU memory at step {earlier[-1].get('step')}")

    def state_dict(self) -> dict[str, int]:
        return {"micro_batch": self.micro_batch, "optimizer_steps": self.optimizer_steps}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.micro_batch = min(self.micro_batch, int(state["micro_batch"]))
        self.optimizer_steps = int(state["optimizer_steps"])

    def close(self) -> None:
        """Stop watching the model's calls (the helper is not used any more)."""
        self._hook.remove()


def _keep(record: dict[str, Any]) -> None:
    """The record in the attempt's folder and, for a tracked call, its MLflow run."""
    folder = _environ.run_dir()
    if folder is None:
        return
    try:
        records.append(folder, record)
    except OSError as exc:  # the shrink happened all the same; only its record is missing
        log.warning(f"the shrink was not recorded: {exc}")
    from gpufleet.tracking import _metric_lines

    if _environ.tracked():
        _metric_lines.append(record["step"], {"memory/micro_batch": float(record["new_micro_batch"]),
                                              "memory/oom_rank": float(record["ranks"][0])})


def _size(batch: Any) -> int:
    import torch

    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0:
            raise ConfigError("a batch tensor needs a first dimension: its samples")
        return batch.shape[0]
    values = list(batch.values()) if hasattr(batch, "values") else list(batch) if isinstance(batch, (tuple, list)) else []
    for value in values:
        if isinstance(value, torch.Tensor) or hasattr(value, "values") or isinstance(value, (tuple, list)):
            try:
                return _size(value)
            except ConfigError:
                continue
    raise ConfigError(f"the batch ({type(batch).__name__}) holds no tensor to split: give a tensor, or a "
                      "tuple, list or dict of tensors whose first dimension is the samples")


def _split(batch: Any, micro_batch: int, size: int) -> list[Any]:
    """``batch`` in pieces of ``micro_batch`` samples (the last may be smaller)."""
    import torch

    count = math.ceil(size / micro_batch)
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0 or batch.shape[0] != size:
            return [batch] * count  # not per sample: every micro-batch gets it whole
        return list(batch.split(micro_batch))
    if hasattr(batch, "items"):
        parts = {k: _split(v, micro_batch, size) for k, v in batch.items()}
        return [{k: v[i] for k, v in parts.items()} for i in range(count)]
    if isinstance(batch, (tuple, list)):
        columns = [_split(v, micro_batch, size) for v in batch]
        rows = [[c[i] for c in columns] for i in range(count)]
        if hasattr(batch, "_fields"):  # a named tuple
            return [type(batch)(*row) for row in rows]
        return [tuple(row) for row in rows] if isinstance(batch, tuple) else rows
    return [batch] * count
