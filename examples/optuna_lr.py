"""Tune the learning rate of transformer_fsdp.py's model with Optuna: every trial is a gpufleet
run, and trials that fall behind are pruned while they train.

    python examples/optuna_lr.py --small        # CPU-sized: 5 trials of 2 gloo processes, 1-3 min
    python examples/optuna_lr.py                # every GPU for each trial, 12 trials of 1000 steps
    python examples/optuna_lr.py --gpus 1 --max-concurrent 8 --trials 32   # 8 trials at once, 1 GPU each
    python examples/optuna_lr.py --storage sqlite:///optuna.db   # keep the study; run again to add trials

The model, the data (the Python standard library's own source, or `--data`), the optimizer
(AdamW with warmup and cosine decay) and the validation loss are transformer_fsdp.py's,
imported from it; each trial trains a fresh model with FSDP2 for `--steps` steps (fewer than a
whole training run: a learning rate that is good early is nearly always good later too) at the
learning rate the sampler asks for, and no checkpoints are written.

`gpufleet.integrations.optuna.optimize` runs each trial as a background run of `train_trial`.
Every `eval_every` steps rank 0 logs the validation loss with `gpufleet.log_metrics`; the loop
in this process reports it to the trial, and when Optuna's MedianPruner finds the trial worse
than the median of earlier trials at the same step, it cancels the run and the trial is
PRUNED. The first trial is the example's own learning rate (enqueued), so the search starts
from a known-good point; the TPE sampler is seeded, so a run repeats its choices. Each trial
keeps its run's id (`gpufleet.attach(id).logs()` shows what it printed).

The script prints every trial (learning rate, state, validation loss, run id) and the best
learning rate, and exits non-zero unless the best validation loss beats the unigram baseline
of transformer_fsdp.py.
"""

import argparse
import math
import sys

import optuna
import torch
import torch.nn.functional as F
import transformer_fsdp as base  # the model, data, optimizer and evaluation of the FSDP example
from optuna.distributions import FloatDistribution

from gpufleet import distributed, log_metrics, runtime, strategies
from gpufleet.integrations.optuna import RUN_ID_ATTR, optimize

# -- config ---------------------------------------------------------------------------------
TUNING = {  # per trial; the model and batch are transformer_fsdp.py's SIZES
    "full": dict(steps=1000, eval_every=100, trials=12, warmup=50),
    "small": dict(steps=30, eval_every=10, trials=5, warmup=5),
}
LR_RANGE = (1e-4, 1e-1)  # searched on a log scale
FIRST_PRUNED_EVALUATION = 2  # the first evaluations are in the warmup: too early to judge


@distributed
def train_trial(lr: float, files: tuple, size: dict, steps: int, eval_every: int) -> dict:
    """Train a fresh model for ``steps`` steps at ``lr``; log the validation loss as it goes."""
    runtime.setup()
    torch.manual_seed(base.SEED)  # every trial starts from the same weights: only lr differs
    trainer = strategies.prepare(base.ByteLM(**base.architecture(size)), base.adamw(lr), "fsdp",
                                 scheduler=base.warmup_cosine(size["warmup"], steps),
                                 clip_grad_norm=base.CLIP_GRAD_NORM)
    rank, world_size = runtime.get_global_rank(), runtime.get_world_size()
    train_text, val_text = base.load_text(*files)
    batches = base.Windows(train_text.to(trainer.device), size["seq_len"], size["batch_size"],
                           rank, world_size)
    val_windows = base.validation_windows(val_text, size["seq_len"], size["val_windows"], world_size)
    mine = val_windows.view(world_size, -1, size["seq_len"] + 1)[rank].to(trainer.device)
    val_loss = math.nan
    for step in range(1, steps + 1):
        x, y = batches.next_batch()
        loss = F.cross_entropy(trainer.model(x).float().flatten(0, 1), y.flatten())
        trainer.backward(loss)
        trainer.step()
        if step % eval_every == 0 or step == steps:
            val_loss = base.evaluate(trainer.model, mine, size["batch_size"], trainer.device)
            # one call for both, at the same step on every rank (reduce= is a collective): the
            # study reads rank 0's last call, so the value it optimizes is always in it
            log_metrics({"loss": loss.item(), "val_loss": val_loss}, step=step, reduce="mean")
    return {"rank": rank, "lr": lr, "val_loss": val_loss}


def unigram_baseline(files: tuple, size: dict) -> float:
    """What any model must beat (transformer_fsdp.py's check), on the same validation bytes."""
    train_text, val_text = base.load_text(*files)
    windows = base.validation_windows(val_text, size["seq_len"], size["val_windows"], 1)
    return base.unigram_cross_entropy(train_text, windows[:, 1:])


def report(study: optuna.Study, unigram: float) -> None:
    """Print every trial and the best one; exit non-zero unless the best beat the baseline."""
    for t in study.trials:
        value = "-" if t.value is None else f"{t.value:.4f}"
        state = t.state.name.lower() + (f" at step {t.last_step}" if t.state.name == "PRUNED" else "")
        print(f"trial {t.number:2d}  lr {t.params['lr']:.2e}  {state:20s}  "
              f"val loss {value:7s}  run {t.user_attrs.get(RUN_ID_ATTR, '-')}")
    best = study.best_trial
    print(f"best: trial {best.number}, lr {best.params['lr']:.2e}, val loss {best.value:.4f} "
          f"(unigram baseline {unigram:.4f})")
    if not best.value < unigram:
        sys.exit(f"no trial beat the unigram baseline: {best.value:.4f} >= {unigram:.4f}")


def command_line() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Tune transformer_fsdp.py's learning rate "
                                     "with Optuna, each trial a gpufleet run")
    parser.add_argument("--small", action="store_true", help="a CPU-sized model and trials")
    parser.add_argument("--gpus", type=int, default=None, help="processes per trial; default: every GPU")
    parser.add_argument("--trials", type=int, default=None, help="trials to run; default: by size")
    parser.add_argument("--max-concurrent", type=int, default=1, help="trials running at once")
    parser.add_argument("--steps", type=int, default=None, help="steps per trial; default: by size")
    parser.add_argument("--timeout", default=None, help="start no trial after this long (90s, 2h)")
    parser.add_argument("--data", default=None, help="text files (as transformer_fsdp.py's --data)")
    parser.add_argument("--storage", default=None, help="an Optuna storage URL (sqlite:///optuna.db)")
    parser.add_argument("--study-name", default="transformer-lr", help="with --storage: the study")
    return parser.parse_args()


if __name__ == "__main__":
    args = command_line()
    name = "small" if args.small else "full"
    tuning = dict(TUNING[name], **{k: v for k, v in (("steps", args.steps), ("trials", args.trials))
                                   if v is not None})
    size = dict(base.SIZES[name], warmup=tuning["warmup"])
    files = base.split_by_file(base.find_text_files(args.data))
    study = optuna.create_study(
        study_name=args.study_name, storage=args.storage, load_if_exists=True, direction="minimize",
        sampler=optuna.samplers.TPESampler(seed=base.SEED),
        pruner=optuna.pruners.MedianPruner(n_startup_trials=2,
                                           n_warmup_steps=FIRST_PRUNED_EVALUATION * tuning["eval_every"]),
    )
    if not study.trials:
        study.enqueue_trial({"lr": size["lr"]})  # the example's own learning rate first
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # gpufleet says what each trial did
    space = {"lr": FloatDistribution(*LR_RANGE, log=True), "files": files, "size": size,
             "steps": tuning["steps"], "eval_every": tuning["eval_every"]}
    optimize(study, train_trial.options(gpus=args.gpus), space, metric="val_loss",
             n_trials=tuning["trials"], max_concurrent=args.max_concurrent, timeout=args.timeout)
    report(study, unigram_baseline(files, size))
