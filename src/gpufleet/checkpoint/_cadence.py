"""When a Checkpointer saves (``due``) and which step ranks best (``keep_best``).

A save is a collective, so every rank must decide alike. Steps are the same number on every
rank; clocks are not, so the time cadence is rank 0's, broadcast on gpufleet's own gloo group
(``runtime._gloo_group``: main-thread collectives only, in the same order on every rank;
the checkpointer's own group carries its background thread's). The broadcast is
asynchronous and its answer is read at the next ``due()``: no rank waits for it in between.
"""

from __future__ import annotations

import datetime
import math
import time
from typing import Any

import torch
import torch.distributed as dist

from gpufleet import options, runtime
from gpufleet.errors import ConfigError

BEST_MODES = ("min", "max")


class Cadence:
    """Every ``every_steps`` steps, or once ``every`` has passed since the last save."""

    def __init__(self, every_steps: int | None, every: datetime.timedelta | float | str | None):
        if every_steps is not None and (isinstance(every_steps, bool) or not isinstance(every_steps, int)
                                        or every_steps < 1):
            raise ConfigError(f"every_steps={every_steps!r} must be a whole number ≥ 1 (save every so "
                              "many steps), or None")
        self.every_steps = every_steps
        self.every = options._seconds("every", every, means="the time between two saves")
        self._clock: float | None = None  # when the time cadence started: the last save
        self._decision: tuple[Any, torch.Tensor] | None = None  # rank 0's answer, travelling

    def due(self, step: int) -> bool:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ConfigError(f"step={step!r} must be a whole number ≥ 0: the steps done so far")
        by_steps = self.every_steps is not None and step > 0 and step % self.every_steps == 0
        if self.every is None:
            return by_steps
        now = time.monotonic()
        if self._clock is None:
            self._clock = now
        # First, and always: the broadcast is a collective, which no rank may skip.
        return self._rank0_said(now - self._clock >= self.every) or by_steps

    def restart(self) -> None:
        """A save: the clock starts again, and the answer in flight (taken before it) is
        dropped, on every rank at the same call, so that the save is not repeated."""
        self._clock = time.monotonic()
        if self._decision is not None:
            self._decision[0].wait()
            self._decision = None

    def _rank0_said(self, late: bool) -> bool:
        """What rank 0's ``late`` was at the previous ``due()``, on every rank; ``late``
        itself in a world of one."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return late
        flag = torch.tensor([int(late)], dtype=torch.int32)
        work = dist.broadcast(flag, src=0, group=runtime._gloo_group(dist), async_op=True)
        previous, self._decision = self._decision, (work, flag)
        if previous is None:
            return False
        previous[0].wait()
        return bool(previous[1].item())


def check_keep_best(keep_best: Any) -> tuple[str, str] | None:
    if keep_best is None:
        return None
    if not (isinstance(keep_best, (tuple, list)) and len(keep_best) == 2
            and isinstance(keep_best[0], str) and keep_best[0]
            and isinstance(keep_best[1], str) and keep_best[1].lower() in BEST_MODES):
        raise ConfigError(f"keep_best={keep_best!r} must be (metric name, 'min' or 'max'), e.g. "
                          "keep_best=('val_loss', 'min'), or None")
    return keep_best[0], keep_best[1].lower()


def check_metrics(metrics: Any) -> dict[str, float]:
    """``save``'s metrics as the commit record holds them: names to plain numbers."""
    if metrics is None:
        return {}
    if not isinstance(metrics, dict):
        raise ConfigError(f"metrics={metrics!r} must be a dict of names to numbers, e.g. "
                          "{'val_loss': 0.31}")
    recorded = {}
    for name, value in metrics.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if not isinstance(name, str) or isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"metrics[{name!r}]={value!r}: metrics must map names to numbers "
                              "(a float, an int, or a one-element tensor)")
        recorded[name] = float(value)
    return recorded


def pick_best(metrics: dict[int, dict], name: str, mode: str) -> int | None:
    """The step (of {step: its metrics}) with the best finite value of ``name``, the newer
    on a tie; None when no step has one."""
    scored = [(value if mode == "min" else -value, -step) for step, found in metrics.items()
              if isinstance(value := found.get(name), (int, float)) and not isinstance(value, bool)
              and math.isfinite(value)]
    return -min(scored)[1] if scored else None
