"""Strategies: one call turns a model and an optimizer into DDP, FSDP2 or DeepSpeed ZeRO training.

    from gpufleet import strategies

    trainer = strategies.prepare(
        model, lambda params: torch.optim.AdamW(params, lr=3e-4), "fsdp", grad_accum=4
    )
    for x, y in loader:
        loss = loss_fn(trainer.model(x), y)
        trainer.backward(loss)
        trainer.step()        # the optimizer steps once every grad_accum calls

Each strategy is a small module with an options class (``DDP``, ``FSDP``, ``ZeRO``); a name
(``"ddp"``, ``"fsdp"``, ``"zero1"``, ``"zero2"``, ``"zero3"``) picks its defaults and keyword
options override them. DeepSpeed is imported only when a ZeRO strategy is chosen. Nothing here
is required: raw DDP, FSDP2 or DeepSpeed code runs unchanged inside a gpufleet call.
"""

from __future__ import annotations

from typing import Any, Callable

from gpufleet.errors import ConfigError
from gpufleet.memory import check
from gpufleet.strategies._base import Prepared, StrategyOptions, check_common
from gpufleet.strategies.ddp import DDP
from gpufleet.strategies.deepspeed import ZeRO
from gpufleet.strategies.fsdp import FSDP

__all__ = ["NAMES", "Prepared", "prepare", "resolve", "DDP", "FSDP", "ZeRO"]

# name -> (options class, options the name fixes)
_REGISTRY: dict[str, tuple[type[StrategyOptions], dict[str, Any]]] = {
    "ddp": (DDP, {}),
    "fsdp": (FSDP, {}),
    "zero1": (ZeRO, {"stage": 1}),
    "zero2": (ZeRO, {"stage": 2}),
    "zero3": (ZeRO, {"stage": 3}),
}
NAMES = tuple(_REGISTRY)


def resolve(strategy: Any = "ddp", **options: Any) -> Any:
    """The options object of a strategy given by name (plus keyword options) or as an object."""
    if isinstance(strategy, str):
        key = strategy.lower()
        if key not in _REGISTRY:
            raise ConfigError(
                f"unknown strategy {strategy!r}; choose one of {', '.join(map(repr, NAMES))}"
            )
        cls, fixed = _REGISTRY[key]
        clash = set(fixed) & set(options)
        if clash:
            raise ConfigError(
                f"strategy {strategy!r} fixes {', '.join(sorted(clash))}; drop that option or "
                f"use {cls.__name__}({', '.join(f'{k}=...' for k in sorted(clash))})"
            )
        return cls.from_options(**fixed, **options)
    registered = next((cls for cls, _ in _REGISTRY.values() if cls is strategy), None)
    if registered is not None:  # the class itself: its defaults
        return registered.from_options(**options)
    if hasattr(strategy, "prepare") and hasattr(strategy, "from_options"):
        if options:
            raise ConfigError(
                f"options {sorted(options)} were given beside the strategy object "
                f"{strategy!r}; set them on the object instead"
            )
        return strategy
    raise ConfigError(
        f"strategy={strategy!r} is neither a name ({', '.join(map(repr, NAMES))}) "
        "nor a strategy object such as gpufleet.strategies.FSDP(...)"
    )


def prepare(
    model: Any,
    optimizer: Any,
    strategy: Any = "ddp",
    *,
    scheduler: Callable[[Any], Any] | None = None,
    grad_accum: int = 1,
    clip_grad_norm: float | None = None,
    precision: str | None = None,
    memory_check: str | None = None,
    **options: Any,
) -> Prepared:
    """Wrap ``model`` for ``strategy`` and build its optimizer; return a ``Prepared``.

    ``optimizer`` is a function of the parameters (``lambda params: AdamW(params, lr=1e-3)``),
    or an optimizer already built on ``model.parameters()`` (rebuilt on the sharded parameters
    where the strategy replaces them). ``scheduler`` is a function of the optimizer.
    ``grad_accum`` micro-batches make one optimizer step, with gradients synchronised only on
    the last one. ``precision`` is ``"bf16"`` (the default on GPU) or ``"fp32"`` (the default
    on CPU). Other keyword options belong to the strategy (see ``DDP``, ``FSDP``, ``ZeRO``).

    ``memory_check``: at the first training forward pass, each rank compares the memory
    estimate of its step (``gpufleet.memory``) with what its GPU has free: ``"warn"`` says so
    in the rank's log when it does not fit (naming the largest micro-batch that does),
    ``"error"`` raises ``gpufleet.memory.MemoryCheckError`` instead, ``"off"`` skips it
    (default: ``GPUFLEET_MEMORY_CHECK``, else ``"warn"``).

    Calls ``runtime.setup()`` first if the process group is not initialised yet.
    """
    memory_check = check.check_option(memory_check)
    spec = resolve(strategy, **options)
    common = check_common(
        optimizer=optimizer,
        scheduler=scheduler,
        grad_accum=grad_accum,
        clip_grad_norm=clip_grad_norm,
        precision=precision,
    )
    prepared = spec.prepare(model, common)
    check.watch(prepared.model, check.of_prepared(prepared), memory_check)
    return prepared

