"""What every strategy shares: option checks, the optimizer hand-over, and ``Prepared``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, cast

import torch

from gpufleet import runtime, steps
from gpufleet.errors import ConfigError

PRECISIONS = ("bf16", "fp32")


@dataclass(frozen=True)
class Common:
    """Options every strategy takes, checked before the model is touched."""

    optimizer: Any
    scheduler: Callable[[Any], Any] | None
    grad_accum: int
    clip_grad_norm: float | None
    precision: str | None  # None: bf16 on GPU, fp32 on CPU

    def precision_on(self, device: torch.device) -> str:
        return self.precision or ("bf16" if device.type == "cuda" else "fp32")


def check_common(*, optimizer, scheduler, grad_accum, clip_grad_norm, precision) -> Common:
    if not (callable(optimizer) or isinstance(optimizer, torch.optim.Optimizer)):
        raise ConfigError(
            f"optimizer={optimizer!r} is neither an optimizer nor a function of the parameters; "
            "pass e.g. lambda params: torch.optim.AdamW(params, lr=1e-3)"
        )
    if scheduler is not None and not callable(scheduler):
        raise ConfigError(
            f"scheduler={scheduler!r} is not a function of the optimizer; pass e.g. "
            "lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000)"
        )
    if isinstance(grad_accum, bool) or not isinstance(grad_accum, int) or grad_accum < 1:
        raise ConfigError(f"grad_accum={grad_accum!r} must be a whole number ≥ 1")
    if clip_grad_norm is not None and not (
        isinstance(clip_grad_norm, (int, float)) and clip_grad_norm > 0
    ):
        raise ConfigError(f"clip_grad_norm={clip_grad_norm!r} must be a positive number or None")
    if precision is not None and precision not in PRECISIONS:
        raise ConfigError(
            f"precision={precision!r} is not one of {', '.join(map(repr, PRECISIONS))} "
            "(None: bf16 on GPU, fp32 on CPU)"
        )
    return Common(optimizer, scheduler, grad_accum, clip_grad_norm, precision)


class StrategyOptions:
    """Mixin for a strategy's frozen dataclass of options: building it from keywords."""

    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]

    @classmethod
    def from_options(cls, **options: Any):
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(names))
        if unknown:
            raise ConfigError(
                f"unknown option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} for "
                f"strategy {cls.__name__}; valid options: {', '.join(names)}"
            )
        return cls(**options)


def setup_device() -> torch.device:
    """This rank's device, with the process group initialised (a no-op when it already is)."""
    return runtime.setup()


def build_optimizer(optimizer: Any, model: torch.nn.Module, names: dict[int, str]) -> Any:
    """The optimizer over ``model``'s current parameters.

    A function is called with the parameters. An optimizer built before the strategy replaced
    the parameters (FSDP does) is rebuilt with the same class, defaults and parameter groups:
    ``names`` maps the id of each original parameter to its name.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        return optimizer(model.parameters())
    current = dict(model.named_parameters())
    held = [p for group in optimizer.param_groups for p in group["params"]]
    if all(current.get(names.get(id(p), "")) is p for p in held):
        return optimizer  # the strategy kept the parameters (DDP)
    groups = []
    for group in optimizer.param_groups:
        try:
            params = [current[names[id(p)]] for p in group["params"]]
        except KeyError:
            raise ConfigError(
                f"the optimizer {type(optimizer).__name__} holds a parameter that is not in the "
                "model; pass a function instead: lambda params: YourOptimizer(params, ...)"
            ) from None
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
    return type(optimizer)(groups, **optimizer.defaults)


def parameter_names(model: torch.nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}


class Prepared:
    """A model and optimizer made ready by a strategy: the training loop talks to this.

    ``model`` is the wrapped module to call, ``optimizer`` and ``scheduler`` are the ones built
    for it, ``device`` is this rank's device. ``backward(loss)`` then ``step()`` after every
    micro-batch: the optimizer steps on the last micro-batch of each ``grad_accum`` group, and
    DDP and FSDP synchronise gradients only then (DeepSpeed's engine decides for ZeRO).
    """

    def __init__(self, *, model, optimizer, scheduler, device, strategy, common: Common):
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.device = device
        self.strategy = strategy
        self.grad_accum = common.grad_accum
        self.clip_grad_norm = common.clip_grad_norm
        self.precision = common.precision_on(device)
        self.micro_steps = 0  # backward passes so far
        self._grad_norm: torch.Tensor | None = None
        self._set_gradient_sync(self._syncs_next())
        steps.trainer_ready(model)  # the step telemetry counts optimizer steps, times forwards

    # -- the training loop --------------------------------------------------------------------

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate ``loss`` (scaled by 1/grad_accum)."""
        steps.backward_is_local(not self._syncs_next())  # the step telemetry's arrival is the sync
        (loss / self.grad_accum if self.grad_accum > 1 else loss).backward()

    def step(self) -> bool:
        """End a micro-batch; on the last of a group, step the optimizer (and scheduler).

        Returns True when the optimizer stepped.
        """
        self.micro_steps += 1
        boundary = self.micro_steps % self.grad_accum == 0
        if boundary:
            if self.clip_grad_norm is not None:
                norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_grad_norm)
                # Kept on the device: float() here would wait for the GPU at every step.
                self._grad_norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
            self.optimizer.step()
            if self.scheduler is not None:
                self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            steps.trainer_step()
        self._set_gradient_sync(self._syncs_next())
        return boundary

    @property
    def grad_norm(self) -> float | None:
        """The gradient norm before clipping, at the last optimizer step (with clip_grad_norm)."""
        return None if self._grad_norm is None else float(self._grad_norm)

    @property
    def optimizer_steps(self) -> int:
        return self.micro_steps // self.grad_accum

    def module(self) -> torch.nn.Module:
        """The user's model without the strategy's wrapper."""
        return self.model

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's weights as CPU tensors on rank 0; an empty dict on the others.

        A collective: call it on every rank. Keys are the user's model's own names.
        """
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return cast("dict[str, torch.Tensor]", get_model_state_dict(self.model, options=options))

    # -- the counters a checkpoint keeps (model and optimizer are saved by gpufleet.checkpoint) --

    def state_dict(self) -> dict[str, int]:
        return {"micro_steps": self.micro_steps}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.micro_steps = int(state["micro_steps"])
        self._set_gradient_sync(self._syncs_next())

    # -- what each strategy supplies --------------------------------------------------------

    def _syncs_next(self) -> bool:
        return (self.micro_steps + 1) % self.grad_accum == 0

    def _set_gradient_sync(self, enabled: bool) -> None:
        """Let the next backward pass all-reduce gradients, or keep them local."""
