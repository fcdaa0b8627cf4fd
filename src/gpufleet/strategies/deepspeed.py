"""DeepSpeed ZeRO 1/2/3: optimizer state, then gradients, then parameters partitioned across
ranks, with optional CPU offload. DeepSpeed is imported only here, when a ZeRO strategy runs.

A DeepSpeed config (dict or JSON file) passes through unchanged; the curated fields (stage,
offload, bf16, gradient accumulation and clipping) are filled in where the config leaves them
out, and a contradiction between the two is an error rather than a silent choice.
"""

from __future__ import annotations

import copy
import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gpufleet import steps
from gpufleet.errors import ConfigError
from gpufleet.strategies._base import Common, Prepared, StrategyOptions, setup_device


@dataclass(frozen=True)
class ZeRO(StrategyOptions):
    """Options of the DeepSpeed strategy.

    ``stage``: 1, 2 or 3. ``config``: a DeepSpeed config dict or the path of a JSON file.
    ``offload_optimizer`` / ``offload_params``: keep optimizer state / parameters (stage 3)
    in CPU memory.
    """

    stage: int = 3
    config: Any = None
    offload_optimizer: bool = False
    offload_params: bool = False

    def __post_init__(self):
        if self.stage not in (1, 2, 3):
            raise ConfigError(f"stage={self.stage!r} must be 1, 2 or 3")
        if self.offload_params and self.stage != 3:
            raise ConfigError(
                f"offload_params=True needs ZeRO stage 3 (stage={self.stage}); use 'zero3' or "
                "offload_optimizer=True"
            )
        if self.config is not None and not isinstance(self.config, (dict, str, os.PathLike)):
            raise ConfigError(
                f"config={self.config!r} must be a DeepSpeed config dict or a JSON file path"
            )

    def deepspeed_config(self, common: Common, device: torch.device) -> dict:
        """The config handed to ``deepspeed.initialize``: the user's plus the curated fields."""
        config = copy.deepcopy(_read_config(self.config))
        _refuse_auto(config, "")
        if "optimizer" in config:
            raise ConfigError(
                "the DeepSpeed config has an 'optimizer' section, but gpufleet hands DeepSpeed "
                "the optimizer passed to prepare(), and DeepSpeed would ignore the config's; "
                "remove the section and pass e.g. lambda params: torch.optim.AdamW(params, lr=...)"
            )
        zero = config.setdefault("zero_optimization", {})
        _put(zero, "stage", self.stage, "zero_optimization.stage")
        pin = device.type == "cuda"
        if self.offload_optimizer:
            _put(zero.setdefault("offload_optimizer", {"pin_memory": pin}), "device", "cpu",
                 "zero_optimization.offload_optimizer.device")
        if self.offload_params:
            _put(zero.setdefault("offload_param", {"pin_memory": pin}), "device", "cpu",
                 "zero_optimization.offload_param.device")
        _set_precision(config, common, device)
        if common.grad_accum > 1:
            _put(config, "gradient_accumulation_steps", common.grad_accum, "gradient_accumulation_steps")
        # else the config's batch fields decide; PreparedZeRO reads the result back
        if common.clip_grad_norm is not None:
            _put(config, "gradient_clipping", common.clip_grad_norm, "gradient_clipping")
        # DeepSpeed clips at 1.0 unless told otherwise; gpufleet clips only when asked to.
        config.setdefault("gradient_clipping", 0.0)
        if not {"train_batch_size", "train_micro_batch_size_per_gpu"} & set(config):
            # DeepSpeed insists on a batch size; it only uses it for its own data loader and
            # throughput logs, which gpufleet does not use.
            config["train_micro_batch_size_per_gpu"] = 1
        # A torch optimizer (DeepSpeed's own ones need compiled kernels).
        config.setdefault("zero_allow_untested_optimizer", True)
        config.setdefault("zero_force_ds_cpu_optimizer", False)
        config.setdefault("steps_per_print", 2**31 - 1)  # gpufleet users log their own loss
        return config

    def prepare(self, model: torch.nn.Module, common: Common) -> "PreparedZeRO":
        device = setup_device()
        if device.type == "cpu":
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        # DeepSpeed calls collectives that torch deprecates; the warnings are not the user's.
        warnings.filterwarnings(
            "ignore", message=r".*is deprecated\. Please use `torch\.distributed\.", category=FutureWarning
        )
        import deepspeed

        config = self.deepspeed_config(common, device)
        optimizer = common.optimizer
        if isinstance(optimizer, torch.optim.Optimizer):
            built = optimizer
            optimizer = lambda params: built  # noqa: E731  # DeepSpeed wraps it as given
        engine, ds_optimizer, _, scheduler = deepspeed.initialize(
            model=model.to(device),
            optimizer=optimizer,
            model_parameters=[p for p in model.parameters() if p.requires_grad],
            lr_scheduler=common.scheduler,
            config=config,
            dist_init_required=False,
        )
        prepared = PreparedZeRO(
            model=engine, optimizer=ds_optimizer, scheduler=scheduler, device=device,
            strategy=self, common=common,
        )
        prepared.grad_accum = engine.gradient_accumulation_steps()
        return prepared


class PreparedZeRO(Prepared):
    """The DeepSpeed engine does the accumulation, clipping, scaling and scheduler steps."""

    def backward(self, loss: torch.Tensor) -> None:
        self.model.backward(loss)

    def step(self) -> bool:
        boundary = self.model.is_gradient_accumulation_boundary()
        self.model.step()
        self.micro_steps += 1
        if boundary:
            steps.trainer_step()  # the step telemetry counts optimizer steps, as the others do
        return boundary

    @property
    def grad_norm(self) -> float | None:
        norm = self.model.get_global_grad_norm()
        return None if norm is None else float(norm)

    def module(self) -> torch.nn.Module:
        return self.model.module

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The module's weights gathered on rank 0, in the module's dtype (bf16 under bf16;
        DeepSpeed keeps the fp32 master weights in its optimizer)."""
        import deepspeed

        engine = self.model
        params = list(engine.module.parameters())
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None, enabled=engine.zero_optimization_stage() == 3):
            if torch.distributed.get_rank() != 0:
                return {}
            return {k: v.detach().to("cpu", copy=True) for k, v in engine.module.state_dict().items()}

    def save_engine(self, folder: str) -> None:
        self.model.save_checkpoint(folder, tag="engine", save_latest=False)

    def load_engine(self, folder: str) -> None:
        """Load the engine's files with ``weights_only=True``: DeepSpeed itself unpickles them
        whole, which would run any code planted in a checkpoint."""
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address

        allowed = [DynamicLossScaler, LossScaler, ZeroStageEnum, fragment_address]
        files = self.model.checkpoint_engine

        def load(path, map_location=None):
            with torch.serialization.safe_globals(allowed):
                return torch.load(path, map_location=map_location, weights_only=True)

        files.load = load  # on this engine's instance only, and only while loading
        try:
            self.model.load_checkpoint(folder, tag="engine")
        finally:
            del files.load

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.micro_steps = int(state["micro_steps"])


def _read_config(config: Any) -> dict:
    if config is None:
        return {}
    if isinstance(config, dict):
        return config
    path = Path(config)
    try:
        return json.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"DeepSpeed config file {str(path)!r} cannot be read: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise ConfigError(f"DeepSpeed config file {str(path)!r} is not valid JSON: {exc}") from exc


def _set_precision(config: dict, common: Common, device: torch.device) -> None:
    """bf16 on GPU unless the config chose (fp16 or bf16 sections); an explicit precision
    that the config contradicts is an error."""
    chosen = [k for k in ("bf16", "fp16") if config.get(k, {}).get("enabled")]
    if common.precision is None and chosen:
        return
    wanted = common.precision_on(device)
    if wanted == "bf16":
        if "fp16" in chosen:
            raise ConfigError(
                "the DeepSpeed config enables fp16 but precision='bf16' was asked for; "
                "drop one of them"
            )
        _put(config.setdefault("bf16", {}), "enabled", True, "bf16.enabled")
    elif chosen:
        raise ConfigError(
            f"the DeepSpeed config enables {chosen[0]} but precision='fp32' was asked for; "
            "drop one of them"
        )


def _refuse_auto(section: Any, path: str) -> None:
    if section == "auto":
        raise ConfigError(
            f"DeepSpeed config field {path!r} is 'auto', which only Hugging Face's Trainer "
            "resolves; give it a value"
        )
    if isinstance(section, dict):
        for key, value in section.items():
            _refuse_auto(value, f"{path}.{key}" if path else key)


def _put(section: dict, key: str, value: Any, where: str) -> None:
    if section.setdefault(key, value) != value:
        raise ConfigError(
            f"the DeepSpeed config sets {where}={section[key]!r} but gpufleet's options ask for "
            f"{value!r}; change one of them"
        )
