"""What a fine-tuning run costs, measured inside its ranks by a Trainer callback: tokens per
second once the first steps are past, the wall-clock time of the first step (the caller
subtracts its own start: time from the command to the first step), the peak GPU memory, and
for each checkpoint the time the training step was blocked by the save and the time until its
files were on disk. benchmarks/real_sizes.py compares these across launchers; every example
returns them in its ranks' results (`timings`).
"""

import os
import time

import torch
from transformers import TrainerCallback

WARMUP_SHARE = 0.2  # the first steps left out of tokens/s: compilation, allocator, caches
GIB = 2 ** 30


class Meter(TrainerCallback):
    """Wall-clock marks of the Trainer's events. `durable`: after each checkpoint, flush every
    written file to disk (`os.sync`) and time it, so that "saved" means "on disk"."""

    def __init__(self, durable: bool = False):
        self.durable = durable
        self.first_step_begun: float | None = None  # time.time(): comparable across processes
        self.steps: list[tuple[float, int]] = []  # (time.monotonic(), tokens seen) per step end
        self.saves: list[dict] = []
        self._last_event = time.monotonic()

    def on_step_begin(self, args, state, control, **kwargs):
        if self.first_step_begun is None:
            self.first_step_begun = time.time()

    def on_step_end(self, args, state, control, **kwargs):
        self._last_event = time.monotonic()
        self.steps.append((self._last_event, int(state.num_input_tokens_seen)))

    # A checkpoint is written after the step's logging and evaluation: the save starts at the
    # later of the two (logging waits for the step's GPU work to finish: the loss's .item()).
    def on_log(self, args, state, control, **kwargs):
        self._last_event = time.monotonic()

    def on_evaluate(self, args, state, control, **kwargs):
        self._last_event = time.monotonic()

    def on_save(self, args, state, control, **kwargs):
        blocked = time.monotonic() - self._last_event
        flushed = 0.0
        if self.durable:
            started = time.monotonic()
            os.sync()  # the Trainer closes its files without fsync: in the page cache only
            flushed = time.monotonic() - started
        self.saves.append({"step": state.global_step, "blocked_s": round(blocked, 3),
                           "durable_s": round(blocked + flushed, 3) if self.durable else None,
                           "folder": os.path.join(args.output_dir,
                                                  f"checkpoint-{state.global_step}")})
        self._last_event = time.monotonic()

    def tokens_per_s(self) -> float | None:
        """Tokens of every rank per second, from the end of the warm-up steps to the last."""
        if len(self.steps) < 2:
            return None
        first = min(max(1, int(len(self.steps) * WARMUP_SHARE)), len(self.steps) - 2)
        (t0, n0), (t1, n1) = self.steps[first], self.steps[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 and n1 > n0 else None


def find(trainer) -> Meter | None:
    return next((c for c in trainer.callback_handler.callbacks if isinstance(c, Meter)), None)


def summary(trainer, world_size: int) -> dict | None:
    """The run's timings as a rank returns them; None without a Meter among its callbacks."""
    found = find(trainer)
    if found is None:
        return None
    rate = found.tokens_per_s()
    gpu = torch.cuda.is_available()
    return {"first_step_begun": found.first_step_begun,
            "tokens_per_s_per_gpu": round(rate / world_size, 1) if rate else None,
            "tokens": found.steps[-1][1] if found.steps else 0, "steps": len(found.steps),
            "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / GIB, 2) if gpu else None,
            "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / GIB, 2) if gpu else None,
            "saves": found.saves}


def restore_seconds(trainer, checkpoint: str) -> float:
    """Load `checkpoint` (the model's or adapter's weights, the optimizer and the schedule)
    back into the trained Trainer, as `train(resume_from_checkpoint=...)` does before its
    first step, and return the seconds it took. Every rank calls it (sharded states load
    together)."""
    started = time.monotonic()
    if trainer.is_deepspeed_enabled:  # the engine loads its partitions, optimizer included
        from transformers.integrations.deepspeed import deepspeed_load_checkpoint

        deepspeed_load_checkpoint(trainer.model_wrapped, checkpoint, load_module_strict=True)
    else:
        trainer._load_from_checkpoint(checkpoint)
    trainer._load_optimizer_and_scheduler(checkpoint)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return round(time.monotonic() - started, 3)
