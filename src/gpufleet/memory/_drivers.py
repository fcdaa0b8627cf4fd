"""How ``MicroBatches`` drives each kind of model through one optimizer step: when gradients
are kept local, when they are synchronised, and whether a micro-batch may leave the other
ranks inside a collective (then an out-of-memory error there cannot be agreed on in place).

- DDP: every micro-batch's backward pass goes through DDP as usual, but a communication hook
  of the helper's keeps each bucket local while the helper runs a step (and all-reduces it as
  DDP's own hook does otherwise); once every rank has said that it did not run out of memory,
  the helper averages the gradients itself (one all-reduce per 64 MiB). Nothing waits for
  another rank before that, so an OOM anywhere in forward or backward is agreed on in place;
  the gradients stay DDP's bucket views (``no_sync`` would make a second copy of them). DDP
  broadcasts its buffers at the first micro-batch of a step only, as with ``no_sync``.
  ``overlap_sync=True`` lets DDP's last backward pass overlap the all-reduce with the
  computation instead (faster when communication is a large share of a step), and an OOM in
  that micro-batch then ends the attempt. A DDP model made with ``find_unused_parameters=True``
  (the Hugging Face Trainer's default without gradient checkpointing) all-reduces in every
  backward pass which parameters it used, which no hook keeps local: its micro-batches run
  under ``no_sync`` and the helper averages the gradients afterwards the same way.
- FSDP2: parameters are gathered in every forward pass, so with more than one rank an OOM in
  any micro-batch may leave the others waiting in an all-gather: the attempt ends, and a retry
  goes on at the smaller micro-batch. With one rank there is nobody to wait.
- A plain module (one rank): nothing to synchronise.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from gpufleet.errors import ConfigError

SYNC_CHUNK_BYTES = 64 * 2**20


class Driver:
    """One optimizer step of a model, in micro-batches."""

    def __init__(self, model: Any, optimizer: Any, scheduler: Any, prepared: Any, world_size: int):
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.prepared = prepared  # gpufleet's trainer, when given one
        self.world_size = world_size

    @contextlib.contextmanager
    def micro_batch(self, first: bool, last: bool) -> Iterator[None]:
        yield

    def leaves_peers_waiting(self, last: bool) -> bool:
        """Whether an OOM in this micro-batch may leave another rank inside a collective."""
        return False

    def backward(self, loss: torch.Tensor) -> None:
        if self.prepared is not None:
            self.prepared.backward(loss)
        else:
            loss.backward()

    def synchronise(self) -> None:
        """Average the gradients across ranks, where the micro-batches kept them local."""

    def finish(self) -> None:
        """The optimizer step (with the trainer's clipping, scheduler and step telemetry)."""
        if self.prepared is not None:
            self.prepared.step()
            return
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def forget(self) -> None:
        """Drop the gradients of a step that will be redone (the model's own too: a wrapped
        optimizer, Accelerate's, may skip ``zero_grad`` in the middle of an accumulation)."""
        self.optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)


class DDPDriver(Driver):
    def __init__(self, *args: Any, overlap_sync: bool, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.overlap = overlap_sync
        self.local = False  # inside a step: the hook keeps buckets local
        # DDP that looks for unused parameters all-reduces which ones each backward pass used,
        # a collective no hook can keep local: such a model accumulates under no_sync instead
        self.unused = bool(getattr(self.model, "find_unused_parameters", False))
        if not overlap_sync and not self.unused:
            try:
                self.model.register_comm_hook(self, _local_or_allreduce)
            except RuntimeError:  # DDP takes one hook, and the user registered theirs
                raise ConfigError("this DistributedDataParallel model has a communication hook already, and "
                                  "MicroBatches needs its own to keep gradients local until the ranks agree; "
                                  "pass overlap_sync=True to keep yours") from None

    @contextlib.contextmanager
    def micro_batch(self, first: bool, last: bool) -> Iterator[None]:
        # DDP broadcasts its buffers at a forward pass after a synchronising one: once a step.
        self.model.require_forward_param_sync = first
        if self.overlap:
            if last:
                yield
                return
            with self.model.no_sync():
                yield
            return
        if self.unused:
            with self.model.no_sync():
                yield
            return
        self.local = True
        try:
            yield
        finally:
            self.local = False

    def leaves_peers_waiting(self, last: bool) -> bool:
        return self.overlap and last

    def synchronise(self) -> None:
        if self.overlap:
            return
        import torch.distributed as dist

        group = self.model.process_group
        params = [p for p in self.model.parameters() if p.requires_grad]
        for chunk in _chunks(params):
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in chunk]
            flat = torch._utils._flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=group)
            flat.div_(self.world_size)
            for p, grad, averaged in zip(chunk, grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                grad.copy_(averaged)
                p.grad = grad


def _local_or_allreduce(driver, bucket):  # DDP checks a hook's annotations: none here
    """DDP's communication hook: the bucket as it is inside the helper's step (averaged after
    the ranks agree), DDP's own all-reduce and mean outside it."""
    if driver.local:
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    return allreduce_hook(driver.model.process_group, bucket)


class FSDPDriver(Driver):
    @contextlib.contextmanager
    def micro_batch(self, first: bool, last: bool) -> Iterator[None]:
        self.model.set_requires_gradient_sync(last)  # reduce-scatter on the last micro-batch only
        yield

    def leaves_peers_waiting(self, last: bool) -> bool:
        return self.world_size > 1


def driver_for(target: Any, optimizer: Any, scheduler: Any, world_size: int, overlap_sync: bool) -> Driver:
    """The driver of a gpufleet trainer (``strategies.prepare``) or of a model and optimizer."""
    prepared = target if hasattr(target, "micro_steps") and hasattr(target, "grad_accum") else None
    if prepared is not None:
        if optimizer is not None or scheduler is not None:
            raise ConfigError("optimizer= and scheduler= are the trainer's own: pass the trainer alone")
        if prepared.grad_accum != 1:
            raise ConfigError(f"the trainer was prepared with grad_accum={prepared.grad_accum}; MicroBatches "
                              "does the accumulation: prepare it with grad_accum=1")
        model, optimizer, scheduler = prepared.model, prepared.optimizer, None
    else:
        model = target
        if optimizer is None:
            raise ConfigError("MicroBatches(model, ...) needs optimizer=...: the optimizer it steps "
                              "(or pass the trainer of gpufleet.strategies.prepare)")
    inner = getattr(model, "_orig_mod", model)  # torch.compile's wrapper
    kind = type(inner).__name__
    common = dict(model=inner, optimizer=optimizer, scheduler=scheduler, prepared=prepared,
                  world_size=world_size)
    if kind == "DeepSpeedEngine":
        raise ConfigError("MicroBatches does not drive DeepSpeed's engine (ZeRO), which accumulates "
                          "gradients itself; use 'ddp' or 'fsdp', or DeepSpeed's own batch settings")
    if kind == "DistributedDataParallel":
        return DDPDriver(**common, overlap_sync=overlap_sync)
    if callable(getattr(inner, "set_requires_gradient_sync", None)):
        return FSDPDriver(**common)
    if world_size > 1:
        raise ConfigError(f"{kind} is a plain module in a run of {world_size} ranks, so nothing would "
                          "average its gradients: wrap it in DistributedDataParallel or FSDP (or use "
                          "gpufleet.strategies.prepare)")
    return Driver(**common)


def _chunks(params: list[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    """Parameters in groups of one dtype and device, about SYNC_CHUNK_BYTES each."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        groups.setdefault((p.dtype, p.device), []).append(p)
    for group in groups.values():
        chunk: list[torch.Tensor] = []
        size = 0
        for p in group:
            chunk.append(p)
            size += p.numel() * p.element_size()
            if size >= SYNC_CHUNK_BYTES:
                yield chunk
                chunk, size = [], 0
        if chunk:
            yield chunk
