"""The check before the first step: each rank compares the estimate of its training step with
what its GPU has free, and says so, naming the rank, the need, what is free, the largest
micro-batch that fits and the other processes holding memory on that GPU.

It runs once, at the model's first forward pass in training mode (a forward pre-hook, put
first so that it runs before a strategy's own hooks): there the micro-batch and the sequence
length are known. ``memory_check`` says what a shortfall does: ``"warn"`` (the default) a
warning in the rank's log, ``"error"`` a ``MemoryCheckError`` before the step starts, ``"off"``
nothing (no hook). Without a GPU there is nothing to check.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpufleet.errors import ConfigError, GpufleetError
from gpufleet.memory._arith import CUDA_CONTEXT, GIB

CHECKS = ("warn", "error", "off")


class MemoryCheckError(GpufleetError, RuntimeError):
    """The estimate of the first step is more than the rank's GPU has free
    (``memory_check="error"``)."""


def check_option(memory_check: Any) -> str:
    """``memory_check`` checked; None: GPUFLEET_MEMORY_CHECK's, else "warn"."""
    if memory_check is None:
        from gpufleet import _environ

        memory_check = _environ.memory_check()
        if memory_check not in CHECKS:
            raise ConfigError(f"{_environ.MEMORY_CHECK}={memory_check!r} must be warn, error or off")
    if memory_check not in CHECKS:
        raise ConfigError(f"memory_check={memory_check!r} must be 'warn' (say so in the log), 'error' "
                          "(raise before the first step) or 'off'")
    return memory_check


@dataclass(frozen=True)
class Training:
    """How the model trains, as the estimate needs it."""

    strategy: str
    precision: str
    optimizer: str
    activation_checkpointing: bool = False


def watch(model: Any, training: Training, memory_check: str | None = None, device: Any = None) -> Any:
    """Check once, at ``model``'s first forward pass in training; returns the hook's handle
    (None with ``"off"``). ``device``: the GPU's memory as found then (default: this rank's
    current GPU, ``_gpus.this_device()``)."""
    memory_check = check_option(memory_check)
    if memory_check == "off":
        return None

    def first_forward(module: Any, args: tuple, kwargs: dict) -> None:
        import torch

        if not (module.training and torch.is_grad_enabled()):
            return  # evaluation before training: wait for a training pass
        handle.remove()
        run_check(module, (args, kwargs), training, memory_check, device)

    handle = model.register_forward_pre_hook(first_forward, with_kwargs=True, prepend=True)
    return handle


def run_check(model: Any, call: tuple[tuple, dict], training: Training, memory_check: str,
              device: Any = None) -> None:
    from gpufleet import runtime
    from gpufleet._log import log
    from gpufleet.memory._gpus import this_device

    device = device or this_device()
    if device is None:
        return
    try:
        found = estimate_call(model, call, training, _batch_of(call))
    except Exception as exc:  # noqa: BLE001  # the check is a help: training goes on without it
        log.warning(f"rank {runtime.get_global_rank()}: no memory check before the first step "
                    f"({type(exc).__name__}: {exc})")
        return
    message = verdict(found, device, runtime.get_global_rank())
    if message is None:
        log.debug(f"rank {runtime.get_global_rank()}: the first step should fit ({found.total / GIB:.1f} GiB)")
    elif memory_check == "error":
        raise MemoryCheckError(message)
    else:
        log.warning(message)


def estimate_call(model: Any, call: Any, training: Any, micro_batch: int) -> Any:
    """The estimate of ``model`` training as it does now; ``training`` is a ``Training`` or
    gpufleet's trainer (``Prepared``), from which one is made."""
    from gpufleet import runtime
    from gpufleet.memory.estimate import estimate_for_call

    if call is None:
        raise ValueError("the model has not been called yet")
    if not isinstance(training, Training):
        training = of_prepared(training, model)
    return estimate_for_call(model, call, strategy=training.strategy, world_size=runtime.get_world_size(),
                             micro_batch=micro_batch, precision=training.precision,
                             optimizer=training.optimizer,
                             activation_checkpointing=training.activation_checkpointing)


def of_prepared(prepared: Any, model: Any = None) -> Training:
    """How gpufleet's trainer (or, with None, a bare model and its optimizer) trains."""
    if prepared is None:
        return Training("ddp", "fp32", "adamw")
    name = type(prepared).__name__
    spec = prepared.strategy
    strategy = {"PreparedDDP": "ddp", "PreparedFSDP": "fsdp"}.get(name) or f"zero{getattr(spec, 'stage', 3)}"
    return Training(strategy, prepared.precision, optimizer_name(prepared.optimizer),
                    bool(getattr(spec, "activation_checkpointing", False)))


def optimizer_name(optimizer: Any) -> str:
    """The estimate's name for an optimizer: Adam's kind by default (the larger state)."""
    inner = getattr(optimizer, "optimizer", optimizer)  # DeepSpeed's wrapper
    kind = type(inner).__name__.lower()
    if "8bit" in kind:
        return "adam8bit"
    if kind == "sgd":
        momentum = any(group.get("momentum") for group in getattr(inner, "param_groups", []))
        return "sgd-momentum" if momentum else "sgd"
    return "adamw"


def verdict(found: Any, device: Any, rank: int) -> str | None:
    """What to say when the estimate does not fit the device (None when it does). The CUDA
    context already exists: it counts in neither the need nor what is available."""
    need = found.total - CUDA_CONTEXT
    if need <= device.available:
        return None
    budget = device.available + CUDA_CONTEXT
    largest = found.largest_micro_batch(budget)
    others = "; ".join(str(h) for h in device.others)
    return (
        f"rank {rank} (GPU {device.index}, {device.name}): the first step needs about {need / GIB:.1f} GiB at "
        f"micro-batch {found.micro_batch} (weights {found.weights / GIB:.1f}, gradients {found.grads / GIB:.1f}, "
        f"optimizer state {found.optimizer_state / GIB:.1f}, activations {found.activations / GIB:.1f}, "
        f"slack and NCCL {(found.slack + found.overhead - CUDA_CONTEXT) / GIB:.1f} GiB), but "
        f"{device.available / GIB:.1f} GiB are available ({device.free / GIB:.1f} GiB free of "
        f"{device.total / GIB:.1f}"
        + (f", {device.held_here / GIB:.1f} GiB held by this process" if device.held_here else "")
        + (f"; also on this GPU: {others}" if others else "") + "); "
        + (f"the largest micro-batch that fits: {largest}" if largest else "not even micro-batch 1 fits: "
           "shard the model ('fsdp', 'zero3'), use activation checkpointing or LoRA")
    )


def _batch_of(call: Any) -> int:
    import torch
    from torch.utils._pytree import tree_flatten

    for t in tree_flatten(call)[0]:
        if isinstance(t, torch.Tensor) and t.dim():
            return int(t.shape[0])
    return 1
