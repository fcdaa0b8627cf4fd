"""Hugging Face Trainer (and TRL's trainers, which are Trainers) inside a gpufleet run.

    from gpufleet.integrations.huggingface import GpufleetCallback, last_checkpoint

    fleet = GpufleetCallback()
    trainer = Trainer(model, args, train_dataset=data, callbacks=[fleet])
    trainer.train(resume_from_checkpoint=last_checkpoint(args.output_dir))
    if not fleet.stopped:
        trainer.save_model()

In a rank of a gpufleet run the callback

- sends a heartbeat every step, micro-batch and evaluation batch, and every second while the
  Trainer saves a checkpoint, so that ``hang_timeout`` takes none of them for a hang;
- counts each optimizer step for gpufleet's step telemetry (``runtime.step``: the status line's
  ``step 120/500``, ETA, stragglers), with its samples and its tokens (the ``input_ids`` of
  the model's training forward passes), so that tokens/s and MFU are shown;
- adds rank 0's ``device/tokens_per_s`` and ``device/mfu`` (its GPU's, over its last second of
  steps) to what the Trainer logs, so that its printed logs and ``state.log_history`` carry
  them (reporting integrations the Trainer calls before this callback do not);
- forwards what the Trainer logs (``on_log``: loss, learning rate, grad norm, evaluation
  metrics) from rank 0, at the Trainer's global step, to ``gpufleet.log_metrics``: the call's
  MLflow run and its status line. When the Trainer reports to MLflow itself
  (``report_to="mlflow"``, which writes into the call's run: gpufleet hands every rank
  ``MLFLOW_RUN_ID``), only the status line gets them, so that no value is logged twice;
- asks ``runtime.should_stop()`` at every step's end, or every ``check_stop_every`` steps (a
  SIGTERM to the caller: a preemption), and then has the Trainer save a checkpoint
  (``checkpoint-N`` in ``output_dir``) and stop cleanly, within ``grace_period``; ``stopped``
  tells the code after ``train()``;
- checks, at the model's first training forward pass, the memory estimate of the step
  against the rank's free GPU memory (``memory_check``: ``"warn"``, ``"error"``, ``"off"``;
  ``gpufleet.memory``), from the Trainer's own settings (strategy, precision, optimizer,
  gradient checkpointing) and the batch it sees.

``micro_batches(trainer)`` sends the Trainer's training steps through ``gpufleet.memory.MicroBatches``:
a CUDA out-of-memory error on any rank halves the micro-batch on every rank and redoes the step.

``last_checkpoint`` is the one line that makes ``train()`` resume: on a retry
(``max_retries``) or the next call, from the newest complete ``checkpoint-N``.

Outside a gpufleet run (a direct call, a plain script, torchrun) the callback does nothing.
"""

from __future__ import annotations

import contextlib
import numbers
import os
import re
from pathlib import Path
from typing import Any

try:
    from transformers import TrainerCallback
except ImportError as exc:  # an optional extra: say how to get it
    raise ImportError("gpufleet.integrations.huggingface needs Transformers: pip install 'gpufleet[hf]'") from exc

import gpufleet
from gpufleet import _environ, runtime, steps
from gpufleet._log import log
from gpufleet.errors import ConfigError
from gpufleet.memory import check
from gpufleet.tracking import _progress

__all__ = ["GpufleetCallback", "last_checkpoint", "micro_batches"]

CHECKPOINT = re.compile(r"checkpoint-(\d+)")  # the Trainer's folders: PREFIX_CHECKPOINT_DIR-step
# Written last into a checkpoint folder, by rank 0, after the model, optimizer and RNG states:
# a folder without it was cut short by a crash and cannot be resumed from.
TRAINER_STATE = "trainer_state.json"


def last_checkpoint(output_dir: str | os.PathLike) -> str | None:
    """The newest complete ``checkpoint-N`` folder in ``output_dir``, for
    ``trainer.train(resume_from_checkpoint=...)``; None when there is none (a first run, or no
    ``output_dir`` yet), which trains from the start.

    Unlike ``resume_from_checkpoint=True`` it is no error on a first run, and it passes over a
    checkpoint whose writing a crash cut short. Every rank must see the same folder (one
    machine, or storage every node shares, as the Trainer itself requires). A finished run
    resumes at its end: use a new ``output_dir`` to train again from the start.
    """
    folder = Path(output_dir)
    if not folder.is_dir():
        return None
    found = []
    for path in folder.iterdir():
        number = CHECKPOINT.fullmatch(path.name)
        if number and (path / TRAINER_STATE).is_file():
            found.append((int(number[1]), path))
    return str(max(found)[1]) if found else None


class GpufleetCallback(TrainerCallback):
    """Connects a Trainer's loop to the gpufleet run it trains in (see the module's docstring).
    Pass it in ``callbacks=[...]``; after ``train()``, ``stopped`` is True when a stop request
    ended training (a checkpoint was saved: skip the final save and return).

    ``check_stop_every``: ask ``runtime.should_stop()`` every this many optimizer steps. Each
    ask is one small all-reduce across the ranks (about 0.1-0.3 ms); with steps of a few
    milliseconds, asking every 10 or 100 steps keeps that out of the step time.

    ``memory_check``: what a first step that does not fit the rank's free GPU memory does:
    ``"warn"`` (a warning in the rank's log), ``"error"`` (``MemoryCheckError`` before it
    starts) or ``"off"`` (no check); default: ``GPUFLEET_MEMORY_CHECK``, else ``"warn"``.
    """

    def __init__(self, check_stop_every: int = 1, memory_check: str | None = None) -> None:
        _check_every(check_stop_every)
        self.memory_check = check.check_option(memory_check)
        self.check_stop_every = check_stop_every
        self.stopped = False
        self._active = False  # inside a gpufleet run: set when training begins
        self._progress_only = False  # the Trainer logs into the call's MLflow run itself
        self._samples: int | None = None  # per optimizer step, on this rank
        self._tokens = 0  # of this optimizer step's training forward passes, on this rank
        self._counting: Any = None  # the forward pre-hook that counts them
        self._total: int | None = None  # optimizer steps this call will run
        self._saving = contextlib.ExitStack()  # heartbeats while a checkpoint is written
        self._beating = False  # ``_saving`` holds runtime._working()

    def on_train_begin(self, args, state, control, **kwargs):
        self.stopped = False
        self._active = _environ.run_dir() is not None
        if not self._active:
            return
        self._progress_only = "mlflow" in (args.report_to or ()) and bool(os.environ.get("MLFLOW_RUN_ID"))
        self._samples = args.per_device_train_batch_size * args.gradient_accumulation_steps
        self._total = max(state.max_steps - state.global_step, 0) or None
        self._tokens = 0
        model = kwargs.get("model")
        if model is not None and self._counting is None:
            self._counting = model.register_forward_pre_hook(self._count_tokens, with_kwargs=True)
        if model is not None:
            check.watch(model, _training(args, kwargs.get("optimizer")), self.memory_check)
        runtime.heartbeat()
        if state.global_step and state.is_world_process_zero:
            log.info(f"the Trainer resumed at step {state.global_step} of {state.max_steps}")

    def on_substep_end(self, args, state, control, **kwargs):
        if self._active:
            runtime.heartbeat()

    def on_prediction_step(self, args, state, control, **kwargs):
        if self._active:
            runtime.heartbeat()

    def on_step_end(self, args, state, control, **kwargs):
        if not self._active:
            return
        runtime.heartbeat()
        runtime.step(samples=self._samples, tokens=self._tokens or None, total=self._total)
        self._tokens = 0
        # A collective, at the same step on every rank: they save and stop together.
        if state.global_step % self.check_stop_every == 0 and runtime.should_stop():
            self.stopped = True
            control.should_save = True
            control.should_training_stop = True
            if state.is_world_process_zero:
                log.warning(f"asked to stop: saving checkpoint-{state.global_step} in {args.output_dir}, "
                            "then training stops")
        if control.should_save and not self._beating:  # the Trainer saves after this hook
            self._saving.enter_context(runtime._working())
            self._beating = True

    def on_save(self, args, state, control, **kwargs):
        self._quiet()

    def on_step_begin(self, args, state, control, **kwargs):
        self._quiet()  # a save another callback called off: no on_save came

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not (self._active and state.is_world_process_zero and logs):
            return
        values = {k: float(v) for k, v in logs.items()
                  if isinstance(v, numbers.Real) and not isinstance(v, bool)}
        if values:
            _forward(values, state.global_step, self._progress_only)
        if "loss" in logs:  # a training log: with this GPU's throughput
            _add_throughput(logs, state)

    def on_train_end(self, args, state, control, **kwargs):
        self._quiet()
        if self._counting is not None:
            self._counting.remove()
            self._counting = None

    def _count_tokens(self, module, args, kwargs) -> None:
        """A forward pass's tokens (its ``input_ids``), when training: evaluation's do not count."""
        if not module.training:
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None and hasattr(ids, "numel") and not ids.is_floating_point():
            self._tokens += int(ids.numel())

    def _quiet(self) -> None:
        """End the heartbeats of a save: past it, silence counts again for hang_timeout."""
        if self._beating:
            self._beating = False
            self._saving.close()


def _training(args: Any, optimizer: Any) -> check.Training:
    """How the Trainer trains, as the memory estimate needs it."""
    strategy = "fsdp" if args.fsdp else "ddp"
    if args.deepspeed:
        config = getattr(getattr(args, "hf_deepspeed_config", None), "config", None) or {}
        stage = config.get("zero_optimization", {}).get("stage", 0)
        strategy = f"zero{stage}" if stage in (1, 2, 3) else "ddp"
    named = str(getattr(args.optim, "value", args.optim))
    kind = check.optimizer_name(optimizer) if optimizer is not None else (
        "adam8bit" if "8bit" in named else "adamw")
    checkpointing = getattr(args, "activation_checkpointing", None)  # Transformers 5's name
    if checkpointing is None:
        checkpointing = getattr(args, "gradient_checkpointing", False)
    return check.Training(strategy, "bf16" if args.bf16 or args.fp16 else "fp32", kind, bool(checkpointing))


def _check_every(every: object) -> None:
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ConfigError(f"check_stop_every={every!r} must be a whole number of steps ≥ 1 (1: every step)")


def _add_throughput(logs: dict, state) -> None:
    """This rank's tokens/s and MFU into the Trainer's logs and, when it is this log's entry,
    its ``log_history``."""
    found = {f"device/{k}": round(v, 4) for k, v in steps.throughput().items() if k != "samples_per_s"}
    if not found:
        return
    logs.update(found)
    history = state.log_history
    if history and history[-1].get("step") == state.global_step and "loss" in history[-1]:
        history[-1].update(found)


def _forward(values: dict[str, Any], step: int, progress_only: bool) -> None:
    """Rank 0's values to the call's MLflow run and status line, or to the status line only
    when the framework already logs them into the call's run."""
    if not progress_only:
        gpufleet.log_metrics(values, step=step)
        return
    runtime.heartbeat()
    _progress.note(step, values)


def micro_batches(trainer: Any, micro_batch: int | None = None, *, shrink: bool = True) -> Any:
    """Send ``trainer``'s training steps (a Trainer, or TRL's) through ``gpufleet.memory.MicroBatches``;
    returns the trainer.

    Each batch of ``per_device_train_batch_size`` samples the Trainer hands its training step is
    split into micro-batches of ``micro_batch`` samples (default: the whole batch); when a rank
    runs out of GPU memory, every rank halves the micro-batch and redoes the batch, so the
    gradients, the global batch and the optimizer steps stay the Trainer's. Give the Trainer the
    rank's whole batch with ``gradient_accumulation_steps=1``: then every out-of-memory error is
    redone in place. With more accumulation steps, one in any but the first batch of an
    optimizer step ends the attempt, and a retry (``max_retries``) starts at the smaller
    micro-batch. DeepSpeed's engine, which accumulates by itself, is refused."""
    batch = trainer.args.per_device_train_batch_size
    micro_batch = batch if micro_batch is None else micro_batch
    if isinstance(micro_batch, bool) or not isinstance(micro_batch, int) or not 1 <= micro_batch <= batch:
        raise ConfigError(f"micro_batch={micro_batch!r}: a whole number from 1 to the Trainer's "
                          f"per_device_train_batch_size ({batch})")
    if getattr(trainer, "is_deepspeed_enabled", False):
        raise ConfigError("micro_batches does not drive DeepSpeed's engine (ZeRO), which accumulates "
                          "gradients itself; use DDP or FSDP, or DeepSpeed's own batch settings")
    from gpufleet.memory import MicroBatches

    helper: list[MicroBatches] = []

    def training_step(model: Any, inputs: dict, num_items_in_batch: Any = None) -> Any:
        if not helper:  # the model the loop hands over is the wrapped one (DDP, FSDP)
            helper.append(MicroBatches(model, micro_batch, optimizer=trainer.optimizer, shrink=shrink,
                                       backward=trainer.accelerator.backward))
        model.train()
        if callable(getattr(trainer.optimizer, "train", None)):
            trainer.optimizer.train()
        inputs = trainer._prepare_inputs(inputs)
        scaled = _loss_is_summed(trainer, num_items_in_batch)
        accumulation = trainer.current_gradient_accumulation_steps

        def loss_of(micro: dict) -> Any:
            with trainer.compute_loss_context_manager():
                loss = trainer.compute_loss(model, micro, num_items_in_batch=num_items_in_batch)
            if trainer.args.n_gpu > 1:
                loss = loss.mean()
            return loss if scaled else loss / accumulation

        fresh = all(p.grad is None for p in model.parameters() if p.requires_grad)
        helper[0].optimizer_steps = trainer.state.global_step
        loss = helper[0].accumulate(inputs, loss_of, weigh=not scaled, redo=fresh,
                                    synchronise=trainer.accelerator.sync_gradients)
        return loss.detach()

    trainer.training_step = training_step
    return trainer


def _loss_is_summed(trainer: Any, num_items_in_batch: Any) -> bool:
    """Whether the Trainer's loss is a sum over the batch's tokens divided by their number
    (``num_items_in_batch``), so that micro-batches' losses add up, as the Trainer decides it."""
    fixed = getattr(trainer, "loss_is_scaled_for_ga", None)
    if fixed is not None:
        return bool(fixed)
    return bool((getattr(trainer, "model_accepts_loss_kwargs", False) and num_items_in_batch is not None)
                or getattr(trainer, "compute_loss_func", None) is not None)
