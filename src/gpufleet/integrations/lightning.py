"""Lightning's Trainer inside a gpufleet run.

    from gpufleet.integrations.lightning import GpufleetCallback

    latest = ModelCheckpoint(dirpath="checkpoints", save_last=True)  # every epoch, no monitor
    fleet = GpufleetCallback()
    trainer = L.Trainer(strategy="ddp", callbacks=[latest, fleet])
    trainer.fit(model, train_loader, val_loader, ckpt_path="last")

In a rank of a gpufleet run the callback

- sends a heartbeat every training and validation batch, so that ``hang_timeout`` takes no
  step for a hang;
- counts each optimizer step for gpufleet's step telemetry (``runtime.step``: the status line's
  ``step 120/500``, ETA, stragglers), with its tokens when ``tokens`` says how to count a
  batch's; a LightningModule's ``flops_per_batch`` (the attribute Lightning's
  ``ThroughputMonitor`` reads) gives the model's FLOPs for MFU, which gpufleet otherwise counts
  itself on one step where a GPU's peak is known;
- logs rank 0's ``device/tokens_per_s`` and ``device/mfu`` (its GPU's, over its last second of
  steps) to the trainer's loggers on the steps Lightning logs;
- forwards what the LightningModule logs for its loggers (``self.log``, ``trainer.logged_metrics``)
  from rank 0, at the trainer's global step, to ``gpufleet.log_metrics``: the call's MLflow run
  and its status line. A step's values go on the steps Lightning logs (``log_every_n_steps``),
  epoch and validation values when their epoch ends; a value is sent when it changed since it
  was last sent. When an ``MLFlowLogger`` of the trainer writes into the call's run itself
  (``run_id=os.environ["MLFLOW_RUN_ID"]``), only the status line gets them, so that no value
  is logged twice;
- asks ``runtime.should_stop()`` after every optimizer step, or every ``check_stop_every`` (a
  SIGTERM to the caller: a preemption), then saves a ``ModelCheckpoint``'s last checkpoint
  (``last.ckpt`` in its ``dirpath``: the first one with ``save_last``, else the first) and
  stops training cleanly, within ``grace_period``, as ``EarlyStopping`` would (Lightning runs
  the epoch's validation first when the loop has one); ``stopped`` tells the code after
  ``fit()``;
- checks, at the LightningModule's first training forward pass (``self(batch)`` in
  ``training_step``; a module that calls only its submodules is not checked), the memory
  estimate of the step against the rank's free GPU memory (``memory_check``: ``"warn"``,
  ``"error"``, ``"off"``; ``gpufleet.memory``), from the trainer's strategy, precision and
  optimizer.

``micro_batches(module, micro_batch)`` sends the LightningModule's training steps through
``gpufleet.memory.MicroBatches``: a CUDA out-of-memory error on any rank halves the micro-batch on
every rank and redoes the batch.

Resuming is Lightning's own: ``fit(..., ckpt_path="last")`` loads the newest ``last*.ckpt`` of
the ``ModelCheckpoint`` folders, and starts from scratch, with a warning, when there is none.
A ``ModelCheckpoint(save_last=True)`` that saves at every epoch or every N steps (no
``monitor``: one that monitors a metric saves, and so rewrites ``last.ckpt``, only when the
metric improves) keeps it current, so that a retry after a crash (``max_retries``) resumes from
the latest state, not only after a stop.

Outside a gpufleet run (a direct call, a plain script, torchrun) the callback does nothing.
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Callable
from typing import Any

import torch

try:
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from lightning.pytorch.loggers import MLFlowLogger
except ImportError as exc:  # an optional extra: say how to get it
    raise ImportError("gpufleet.integrations.lightning needs Lightning: pip install lightning") from exc

import gpufleet
from gpufleet import _environ, runtime, steps
from gpufleet._log import log
from gpufleet.errors import ConfigError
from gpufleet.memory import check
from gpufleet.tracking import _progress

__all__ = ["GpufleetCallback", "micro_batches"]


class GpufleetCallback(Callback):
    """Connects a Lightning Trainer's loop to the gpufleet run it trains in (see the module's
    docstring). After ``fit()``, ``stopped`` is True when a stop request ended training.

    ``check_stop_every``: ask ``runtime.should_stop()`` every this many optimizer steps. Each
    ask is one small all-reduce across the ranks (about 0.1-0.3 ms); with steps of a few
    milliseconds, asking every 10 or 100 steps keeps that out of the step time.

    ``tokens``: a function of a training batch that says how many tokens it holds (for example
    ``lambda batch: batch["input_ids"].numel()``), for tokens/s and a per-token MFU.

    ``memory_check``: what a first step that does not fit the rank's free GPU memory does:
    ``"warn"`` (a warning in the rank's log), ``"error"`` (``MemoryCheckError`` before it
    starts) or ``"off"`` (no check); default: ``GPUFLEET_MEMORY_CHECK``, else ``"warn"``.
    """

    def __init__(self, check_stop_every: int = 1, *, tokens: Callable[[Any], int] | None = None,
                 memory_check: str | None = None) -> None:
        if isinstance(check_stop_every, bool) or not isinstance(check_stop_every, int) or check_stop_every < 1:
            raise ConfigError(f"check_stop_every={check_stop_every!r} must be a whole number of steps ≥ 1 "
                              "(1: every step)")
        if tokens is not None and not callable(tokens):
            raise ConfigError(f"tokens={tokens!r} must be a function of a batch that returns its "
                              "number of tokens, e.g. lambda batch: batch['input_ids'].numel()")
        self.check_stop_every = check_stop_every
        self.memory_check = check.check_option(memory_check)
        self.tokens = tokens
        self._tokens = 0  # of this optimizer step's batches
        self.stopped = False
        self._active = False  # inside a gpufleet run: set when training starts
        self._progress_only = False  # an MLFlowLogger writes into the call's run itself
        self._total: int | None = None  # optimizer steps this call will run
        self._step = 0  # the global step last seen: a new one is an optimizer step
        self._sent: dict[str, float] = {}  # the values last forwarded, by name

    def on_train_start(self, trainer, pl_module) -> None:
        self.stopped = False
        self._active = _environ.run_dir() is not None
        if not self._active:
            return
        self._progress_only = trainer.is_global_zero and _logs_into_the_call(trainer)
        total = trainer.estimated_stepping_batches - trainer.global_step
        self._total = int(total) if math.isfinite(total) and total > 0 else None
        self._step = trainer.global_step
        self._sent = {}
        self._tokens = 0
        per_batch = getattr(pl_module, "flops_per_batch", None)
        if per_batch:  # Lightning's convention (measure_flops): forward and backward of a batch
            runtime.flops(per_step=per_batch * trainer.accumulate_grad_batches)
        check.watch(pl_module, _training(trainer), self.memory_check)
        runtime.heartbeat()
        if trainer.is_global_zero:
            _check_checkpointing(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self._active:
            return
        runtime.heartbeat()
        if self.tokens is not None:
            self._tokens += int(self.tokens(batch))
        if trainer.global_step == self._step:  # a micro-batch of gradient accumulation
            return
        self._step = trainer.global_step
        runtime.step(tokens=self._tokens or None, total=self._total)
        self._tokens = 0
        if trainer.global_step % max(trainer.log_every_n_steps, 1) == 0:
            self._forward(trainer)
            _log_throughput(trainer)
        # a collective, at the same step on every rank
        if trainer.global_step % self.check_stop_every == 0 and runtime.should_stop():
            self._save_and_stop(trainer)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if self._active:
            runtime.heartbeat()

    def on_validation_end(self, trainer, pl_module) -> None:
        if self._active and not trainer.sanity_checking:
            self._forward(trainer)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if self._active:
            self._forward(trainer)

    def _forward(self, trainer) -> None:
        """The logged values that changed since they were last sent, from rank 0. Every rank
        reads them: computing an epoch's value may be a collective (``sync_dist``)."""
        logged = trainer.logged_metrics
        if not trainer.is_global_zero:
            return
        values = {name: float(value) for name, value in logged.items() if _is_scalar(value)}
        changed = {name: value for name, value in values.items() if self._sent.get(name) != value}
        if not changed:
            return
        self._sent.update(changed)
        if self._progress_only:
            runtime.heartbeat()
            _progress.note(trainer.global_step, changed)
        else:
            gpufleet.log_metrics(changed, step=trainer.global_step)

    def _save_and_stop(self, trainer) -> None:
        """Save the last checkpoint (every rank takes part) and end training after this step."""
        self.stopped = True
        trainer.should_stop = True
        checkpoint = _keeper_of_last(trainer)
        if checkpoint is None:
            if trainer.is_global_zero:
                log.warning("asked to stop: training stops, without a checkpoint (the trainer has "
                            "no ModelCheckpoint)")
            return
        candidates = {"epoch": torch.tensor(trainer.current_epoch), "step": torch.tensor(trainer.global_step)}
        path = checkpoint.format_checkpoint_name(candidates, checkpoint.CHECKPOINT_NAME_LAST)
        if trainer.is_global_zero:
            log.warning(f"asked to stop: saving {path} at step {trainer.global_step}, then training stops")
            if os.path.islink(path):  # save_last="link": replace the link, not the file it names
                os.unlink(path)
        checkpoint.last_model_path = path  # its last checkpoint, in the state saved, and after
        with runtime._working():
            trainer.save_checkpoint(path)


def _log_throughput(trainer) -> None:
    """Rank 0's tokens/s and MFU, to the trainer's loggers (as ThroughputMonitor's ``device/``
    values), at this step."""
    found = {f"device/{k}": v for k, v in steps.throughput().items() if k != "samples_per_s"}
    if found and trainer.is_global_zero:
        for logger in trainer.loggers:
            logger.log_metrics(found, step=trainer.global_step)


def _training(trainer) -> check.Training:
    """How the trainer trains, as the memory estimate needs it."""
    kind = type(trainer.strategy).__name__
    strategy = "fsdp" if kind in ("FSDPStrategy", "ModelParallelStrategy") else "ddp"
    if kind == "DeepSpeedStrategy":
        stage = getattr(trainer.strategy, "config", {}).get("zero_optimization", {}).get("stage", 0)
        strategy = f"zero{stage}" if stage in (1, 2, 3) else "ddp"
    optimizer = check.optimizer_name(trainer.optimizers[0]) if trainer.optimizers else "adamw"
    return check.Training(strategy, "bf16" if "16" in str(trainer.precision) else "fp32", optimizer)


def _logs_into_the_call(trainer) -> bool:
    """Whether one of the trainer's loggers is an MLFlowLogger on the call's MLflow run."""
    run_id = os.environ.get("MLFLOW_RUN_ID")
    return bool(run_id) and any(isinstance(logger, MLFlowLogger) and logger.run_id == run_id
                                for logger in trainer.loggers)


def _check_checkpointing(trainer) -> None:
    checkpoints = [c for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint)]
    if checkpoints and not any(c.save_last for c in checkpoints):
        log.warning("no ModelCheckpoint(save_last=True): only a stop request writes the last.ckpt "
                    "that fit(ckpt_path='last') resumes from, so a retry after a crash starts over")


def _keeper_of_last(trainer) -> ModelCheckpoint | None:
    """The ModelCheckpoint whose last.ckpt a stop writes: the first with save_last, else the first."""
    checkpoints = [c for c in trainer.checkpoint_callbacks
                   if isinstance(c, ModelCheckpoint) and c.dirpath is not None]
    return next((c for c in checkpoints if c.save_last), checkpoints[0] if checkpoints else None)


def _is_scalar(value) -> bool:
    if isinstance(value, torch.Tensor):
        return value.numel() == 1
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def micro_batches(module: Any, micro_batch: int, *, shrink: bool = True, gradient_clip_val: float | None = None,
                  gradient_clip_algorithm: str = "norm") -> Any:
    """Send ``module``'s training steps (a LightningModule with automatic optimization) through
    ``gpufleet.memory.MicroBatches``; returns the module.

    Each batch the loader gives is split into micro-batches of ``micro_batch`` samples, each
    goes through the module's own ``training_step`` (its loss: a mean over the micro-batch,
    weighed by its samples), and the optimizer steps once per batch; when a rank runs out of
    GPU memory, every rank halves the micro-batch and redoes the batch. The module switches to
    Lightning's manual optimization, where this helper steps the optimizer, clips the gradients
    (``gradient_clip_val``, ``gradient_clip_algorithm``: give them here, not to the Trainer) and
    steps the schedulers as ``configure_optimizers`` set them (per step or per epoch, at their
    frequency); under DDP it averages the gradients itself. One optimizer; no accumulation over
    batches in the Trainer (``accumulate_grad_batches=1``)."""
    if isinstance(micro_batch, bool) or not isinstance(micro_batch, int) or micro_batch < 1:
        raise ConfigError(f"micro_batch={micro_batch!r} must be a whole number ≥ 1")
    if not module.automatic_optimization:
        raise ConfigError("micro_batches takes a LightningModule with automatic optimization: with manual "
                          "optimization, use gpufleet.memory.MicroBatches in your training_step")
    from gpufleet.memory import MicroBatches

    original = module.training_step
    helper: list[MicroBatches] = []
    module.automatic_optimization = False

    def training_step(batch: Any, batch_idx: int) -> Any:
        trainer = module.trainer
        model = trainer.strategy.model  # DistributedDataParallel under DDP, else the module
        optimizer = module.optimizers()
        if isinstance(optimizer, list):
            raise ConfigError(f"micro_batches steps one optimizer; configure_optimizers gave {len(optimizer)}")
        if not helper:
            helper.append(MicroBatches(model, micro_batch, optimizer=optimizer, shrink=shrink,
                                       backward=module.manual_backward))
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            # Lightning runs training_step inside DDP's forward, once per batch: DDP's reducer
            # would expect one backward pass of its output; the helper averages instead.
            model.require_backward_grad_sync = False

        def loss_of(micro: Any) -> Any:
            out = original(micro, batch_idx)
            return out["loss"] if isinstance(out, dict) else out

        helper[0].optimizer_steps = trainer.global_step
        loss = helper[0].accumulate(batch, loss_of)
        if gradient_clip_val is not None:
            module.clip_gradients(optimizer, gradient_clip_val=gradient_clip_val,
                                  gradient_clip_algorithm=gradient_clip_algorithm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _step_schedulers(trainer, "step", trainer.global_step)
        return loss

    def on_train_epoch_end() -> None:
        epoch_end()
        _step_schedulers(module.trainer, "epoch", module.trainer.current_epoch + 1)

    epoch_end = module.on_train_epoch_end
    module.training_step = training_step
    module.on_train_epoch_end = on_train_epoch_end
    return module


def _step_schedulers(trainer: Any, interval: str, count: int) -> None:
    """Step the schedulers of ``interval`` ("step" or "epoch") whose frequency ``count`` reaches,
    as automatic optimization would (a scheduler that monitors a metric gets it)."""
    for config in trainer.lr_scheduler_configs:
        if config.interval != interval or count % config.frequency:
            continue
        if config.reduce_on_plateau:
            value = trainer.callback_metrics.get(config.monitor)
            if value is not None:
                config.scheduler.step(value)
        else:
            config.scheduler.step()
