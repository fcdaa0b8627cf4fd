"""FSDP2: parameters, gradients and optimizer state sharded across ranks (``fully_shard``).

For models that do not fit on one GPU: build those on the meta device
(``with torch.device("meta"): model = Model()``) with an ``init_weights()`` method, and each
rank allocates and initialises only its own shards after sharding. Each block (a repeated submodule such as a transformer
layer) becomes one all-gather unit, then the whole model does; on GPU parameters compute in
bf16 and gradients are reduced in fp32. Blocks are found automatically: the children of the
largest ``ModuleList``/``Sequential`` whose children all share one class. Optional per block:
activation checkpointing and ``torch.compile``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint

from gpufleet.errors import ConfigError
from gpufleet.strategies._base import (
    Common,
    Prepared,
    StrategyOptions,
    build_optimizer,
    parameter_names,
    setup_device,
)


@dataclass(frozen=True)
class FSDP(StrategyOptions):
    """Options of the FSDP2 strategy.

    ``blocks``: the module class (or class name, or a tuple of them) to shard one by one;
    None finds the repeated block automatically. ``reshard_after_forward``: free gathered
    parameters after each block's forward (less memory, one more all-gather in backward).
    ``activation_checkpointing``: recompute each block's activations in backward.
    ``compile``: ``torch.compile`` each block. ``sync_module_states``: start every rank from
    rank 0's initial weights, as DDP does.
    """

    blocks: Any = None
    reshard_after_forward: bool = True
    activation_checkpointing: bool = False
    compile: bool = False
    sync_module_states: bool = True

    def __post_init__(self):
        kinds = self.blocks if isinstance(self.blocks, tuple) else (self.blocks,)
        if self.blocks is not None and not all(isinstance(k, (type, str)) for k in kinds):
            raise ConfigError(
                f"blocks={self.blocks!r} must be a module class, a class name, or a tuple of them"
            )

    def prepare(self, model: torch.nn.Module, common: Common) -> "PreparedFSDP":
        device = setup_device()
        blocks = self.find_blocks(model)
        names = parameter_names(model)
        on_meta = any(p.is_meta for p in model.parameters())
        if on_meta and not callable(getattr(model, "init_weights", None)):
            raise ConfigError(
                f"{type(model).__name__} was built on the meta device but has no init_weights() "
                "method; add one that initialises every parameter and buffer (it runs after "
                "sharding, on each rank's shards), or build the model on CPU"
            )
        if not on_meta:  # a model built whole: every rank starts from rank 0's weights
            model.to(device)
            if self.sync_module_states and dist.get_world_size() > 1:
                _broadcast_from_rank0(model)
        for block in blocks:
            _wrap_forward(block, self.activation_checkpointing, self.compile)
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        policy = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if common.precision_on(device) == "bf16"
            else MixedPrecisionPolicy()
        )
        # With one rank nothing is saved by resharding, only gathers repeated in backward.
        reshard = self.reshard_after_forward and dist.get_world_size() > 1
        for i, block in enumerate(blocks):
            # The last block's parameters are needed again at once by backward: keep them.
            last = i == len(blocks) - 1
            fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard and not last)
        fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
        if on_meta:  # too large to build whole: each rank materialises only its shards
            model.to_empty(device=device)
            with torch.no_grad():
                getattr(model, "init_weights")()
        optimizer = build_optimizer(common.optimizer, model, names)
        scheduler = common.scheduler(optimizer) if common.scheduler else None
        return PreparedFSDP(
            model=model, optimizer=optimizer, scheduler=scheduler, device=device, strategy=self,
            common=common,
        )

    def find_blocks(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        """The submodules that become their own FSDP units, in model order, outermost only
        (a block inside a block stays in its parent's unit)."""
        if self.blocks is not None:
            kinds = self.blocks if isinstance(self.blocks, tuple) else (self.blocks,)
            found = _outermost(model, lambda m: _is_kind(m, kinds))
            if not found:
                present = sorted({type(m).__name__ for m in model.modules()})
                raise ConfigError(
                    f"blocks={self.blocks!r} matches no submodule of {type(model).__name__}; "
                    f"its module classes are: {', '.join(present)}"
                )
            return found
        # The block class: the children of the largest ModuleList/Sequential whose children
        # share one class. Then every instance of it, so that a second stack (a decoder beside
        # an encoder, a vision tower beside a language model) is sharded the same way.
        kind, best_size = None, 0
        for container in model.modules():
            if not isinstance(container, (torch.nn.ModuleList, torch.nn.Sequential)):
                continue
            children = list(container.children())
            if len(children) < 2 or len({type(c) for c in children}) != 1:
                continue
            size = sum(p.numel() for p in container.parameters())
            if size > best_size:
                kind, best_size = type(children[0]), size
        if kind is None:
            warnings.warn(
                f"FSDP found no repeated block in {type(model).__name__}, so the whole model is "
                "one unit (gathered at once); pass blocks=YourBlockClass to shard it block by "
                "block",
                stacklevel=3,
            )
            return []
        return _outermost(model, lambda m: type(m) is kind)


class PreparedFSDP(Prepared):
    def _set_gradient_sync(self, enabled: bool) -> None:
        # FSDP2's no_sync: without it, every micro-batch would reduce-scatter its gradients.
        self.model.set_requires_gradient_sync(enabled)


def _outermost(model: torch.nn.Module, matches) -> list[torch.nn.Module]:
    found: list[torch.nn.Module] = []

    def visit(module: torch.nn.Module) -> None:
        for child in module.children():
            if matches(child):
                found.append(child)
            else:
                visit(child)

    visit(model)
    return found


def _is_kind(module: torch.nn.Module, kinds: tuple) -> bool:
    return any(
        type(module).__name__ == k if isinstance(k, str) else isinstance(module, k) for k in kinds
    )


@torch.no_grad()
def _broadcast_from_rank0(model: torch.nn.Module) -> None:
    for tensor in [*model.parameters(), *model.buffers()]:
        dist.broadcast(tensor.data, src=0)


def _wrap_forward(block: torch.nn.Module, activation_checkpointing: bool, compile: bool) -> None:
    """Recompute and/or compile ``block``'s forward, keeping its state-dict names unchanged.

    The forward is replaced on the instance (not the module wrapped), so FSDP's hooks stay
    outside the compiled region and checkpoints keep the user's parameter names.
    """
    if not (activation_checkpointing or compile):
        return
    forward = block.forward
    if activation_checkpointing:
        inner = forward

        def forward(*args, **kwargs):
            return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    if compile:
        forward = torch.compile(forward)
    block.forward = forward

