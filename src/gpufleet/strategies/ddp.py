"""DDP: every rank holds the whole model; gradients are averaged across ranks.

For models that fit on one GPU. On GPU the forward pass runs under bf16 autocast unless
``precision="fp32"``; parameters and gradients stay fp32, as DDP users expect.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from gpufleet.strategies._base import (
    Common,
    Prepared,
    StrategyOptions,
    build_optimizer,
    parameter_names,
    setup_device,
)


@dataclass(frozen=True)
class DDP(StrategyOptions):
    """Options of DistributedDataParallel (same names, same meaning)."""

    find_unused_parameters: bool = False
    static_graph: bool = False
    gradient_as_bucket_view: bool = True
    bucket_cap_mb: float | None = None
    compile: bool = False  # torch.compile the wrapped model

    def prepare(self, model: torch.nn.Module, common: Common) -> "PreparedDDP":
        device = setup_device()
        names = parameter_names(model)
        model = model.to(device)
        bucket: dict[str, Any] = {"bucket_cap_mb": self.bucket_cap_mb} if self.bucket_cap_mb else {}
        ddp = DistributedDataParallel(
            model,
            device_ids=[device] if device.type == "cuda" else None,
            find_unused_parameters=self.find_unused_parameters,
            static_graph=self.static_graph,
            gradient_as_bucket_view=self.gradient_as_bucket_view,
            **bucket,
        )
        if common.precision_on(device) == "bf16":
            setattr(ddp, "forward", _autocast(ddp.forward, device.type))
        if self.compile:
            # Compiled after wrapping, so that Dynamo splits the graph at DDP's bucket
            # boundaries and each bucket's all-reduce overlaps the rest of the backward pass
            # (compiled before, the whole backward is one node and every all-reduce waits).
            ddp.compile()
        optimizer = build_optimizer(common.optimizer, model, names)
        scheduler = common.scheduler(optimizer) if common.scheduler else None
        return PreparedDDP(
            model=ddp, optimizer=optimizer, scheduler=scheduler, device=device, strategy=self,
            common=common,
        )


class PreparedDDP(Prepared):
    def module(self) -> torch.nn.Module:
        return self.model.module

    def _set_gradient_sync(self, enabled: bool) -> None:
        # What DistributedDataParallel.no_sync() toggles; set between micro-batches so that the
        # training loop needs no context manager.
        self.model.require_backward_grad_sync = enabled


def _autocast(forward, device_type: str):
    @functools.wraps(forward)
    def run(*args, **kwargs):
        with torch.autocast(device_type, dtype=torch.bfloat16):
            return forward(*args, **kwargs)

    return run
