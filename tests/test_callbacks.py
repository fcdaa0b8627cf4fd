"""gpufleet's callbacks for Hugging Face's Trainer and Lightning's Trainer, in real runs of 2 gloo
CPU processes with tiny models built here.

What a user relies on:

- What the framework logs (the Trainer's loss, a LightningModule's ``self.log``) arrives in the
  call's MLflow run, from rank 0, at the framework's step, each step once, and in the run's
  status line (``progress.json``).
- A retry (``max_retries``) of a run that failed after a checkpoint resumes from the
  framework's last checkpoint (``last_checkpoint(output_dir)``, ``fit(ckpt_path="last")``),
  not from step 0: its metrics go on from the checkpoint's step, no step is logged twice.
- SIGTERM to the caller (a preemption) makes every rank save a checkpoint at the same step and
  stop cleanly within the grace period: ``RunPreemptedError`` carries every rank's result, and
  the checkpoint is the framework's own, which the next call resumes from.
- Outside a gpufleet run (a direct call) the callbacks change nothing: training runs to its end.

Each framework is one script: the first attempt fails at step FAIL_AT (after the checkpoint of
step SAVE_EVERY), the retry resumes and trains until the test sends SIGTERM.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import time
from pathlib import Path

import pytest
from support import assert_all_gone, ended_mlflow_run, rank_lines, run_folders, script_env

mlflow = pytest.importorskip("mlflow")

SAVE_EVERY = 3  # the frameworks save a checkpoint every SAVE_EVERY optimizer steps
FAIL_AT = 4  # the first attempt raises at the end of this step, after checkpoint 3
STOP_AFTER = FAIL_AT + 2  # the retry's step after which the test sends SIGTERM
DIRECT_STEPS = 5  # a direct call trains this many steps, to its end
# Start-up of 2 ranks importing transformers or lightning on 2 busy cores, twice (a retry).
SCRIPT_TIMEOUT_S = 120
STOP_BOUND_S = 30  # from SIGTERM to the script's exit (the grace period is longer)
GRACE_S = 60

# The script's frame: argv is the mode ("run": a gpufleet run; "direct": a direct call), the
# runs folder and the output folder. TRAIN defines `train(out, max_steps, fail_at)` for each
# framework; it prints "attempt A step S" at every step and returns what it saw.
SCRIPT = """
import json
import sys

from gpufleet import RunPreemptedError, distributed, runtime

MODE, RUNS, OUT = sys.argv[1], sys.argv[2], sys.argv[3]
SAVE_EVERY, FAIL_AT, DIRECT_STEPS = {save_every}, {fail_at}, {direct_steps}
ENV = {{"MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"}}


@distributed(gpus=2, runs_dir=RUNS, max_retries=1, grace_period={grace}, timeout={timeout}, env=ENV)
def train(out, max_steps, fail_at):
{train}

if __name__ == "__main__":
    if MODE == "direct":
        print("DIRECT " + json.dumps(train(OUT, DIRECT_STEPS, None)), flush=True)
        sys.exit(0)
    try:
        train.distributed(OUT, 100_000, FAIL_AT)
    except RunPreemptedError as err:
        print("STOPPED " + json.dumps({{"results": err.results, "attempt": str(train.last_run)}}),
              flush=True)
        sys.exit(0)
    print("NOT STOPPED", flush=True)
"""

HF_TRAIN = """
    import time

    import torch
    from transformers import (LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback,
                              TrainingArguments)

    from gpufleet.integrations.huggingface import GpufleetCallback, last_checkpoint

    class Script(TrainerCallback):
        resumed_at = None

        def on_train_begin(self, args, state, control, **kwargs):
            self.resumed_at = state.global_step

        def on_step_end(self, args, state, control, **kwargs):
            print(f"attempt {runtime.get_attempt()} step {state.global_step}", flush=True)
            if runtime.get_attempt() == 0 and state.global_step == fail_at:
                raise RuntimeError("injected failure")
            time.sleep(0.1)

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(32, (64, 8))]
    args = TrainingArguments(out, max_steps=max_steps, per_device_train_batch_size=2,
                             learning_rate=1e-2, logging_steps=1, save_strategy="steps",
                             save_steps=SAVE_EVERY, report_to="none", use_cpu=True,
                             disable_tqdm=True, seed=0)
    script, fleet = Script(), GpufleetCallback()
    trainer = Trainer(LlamaForCausalLM(config), args, train_dataset=data, callbacks=[script, fleet])
    resume = last_checkpoint(out)
    trainer.train(resume_from_checkpoint=resume)
    return {"rank": runtime.get_global_rank(), "resumed_from": resume, "resumed_at": script.resumed_at,
            "stopped": fleet.stopped, "step": trainer.state.global_step}
"""

LIGHTNING_TRAIN = """
    import time

    import lightning as L
    import torch
    import torch.nn.functional as F
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    from gpufleet.integrations.lightning import GpufleetCallback

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.mse_loss(self.layer(x), y)
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", F.mse_loss(self.layer(x), y), sync_dist=True)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    class Script(Callback):
        resumed_at = None

        def on_train_start(self, trainer, module):
            self.resumed_at = trainer.global_step

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            print(f"attempt {runtime.get_attempt()} step {trainer.global_step}", flush=True)
            if runtime.get_attempt() == 0 and trainer.global_step == fail_at:
                raise RuntimeError("injected failure")
            time.sleep(0.1)

    L.seed_everything(0, verbose=False)
    x = torch.randn(64, 4)
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4, shuffle=True)
    val_data = DataLoader(TensorDataset(x[:16], x[:16].sum(1, keepdim=True)), batch_size=8)
    checkpoint = ModelCheckpoint(dirpath=out, every_n_train_steps=SAVE_EVERY, save_last=True)
    script, fleet = Script(), GpufleetCallback()
    trainer = L.Trainer(strategy="ddp" if runtime.get_world_size() > 1 else "auto", accelerator="cpu",
                        devices=runtime.get_local_world_size(), max_steps=max_steps, logger=False,
                        log_every_n_steps=1, callbacks=[script, fleet, checkpoint],
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Tiny(), data, val_data, ckpt_path="last")
    return {"rank": runtime.get_global_rank(), "resumed_at": script.resumed_at, "stopped": fleet.stopped,
            "step": trainer.global_step}
"""

FRAMEWORKS = {
    "huggingface": dict(train=HF_TRAIN, metric="loss", needs="transformers"),
    "lightning": dict(train=LIGHTNING_TRAIN, metric="train_loss", needs="lightning"),
}


def needs(module: str) -> None:
    """Skip without ``module``, which only the scripts' processes import (it takes seconds)."""
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed")


def script_for(framework: str) -> str:
    return SCRIPT.format(save_every=SAVE_EVERY, fail_at=FAIL_AT, direct_steps=DIRECT_STEPS,
                         grace=GRACE_S, timeout=SCRIPT_TIMEOUT_S, train=FRAMEWORKS[framework]["train"])


def reached(out: str, attempt: int, step: int) -> bool:
    """Both ranks printed that they ended ``step`` of ``attempt``."""
    return all(f"attempt {attempt} step {step}" in rank_lines(out, r) for r in (0, 1))


@pytest.mark.timeout(2 * SCRIPT_TIMEOUT_S)
@pytest.mark.parametrize("framework", sorted(FRAMEWORKS))
def test_metrics_reach_the_call_a_retry_resumes_and_sigterm_saves_and_stops(framework, tmp_path, start_script):
    needs(FRAMEWORKS[framework]["needs"])
    runs, out = tmp_path / "runs", tmp_path / "out"
    env = script_env(tmp_path, GPUFLEET_HOME=str(tmp_path / "gpufleet"))
    script = start_script(script_for(framework), "run", runs, out, env=env, new_session=True)
    script.wait_for_output(lambda text: reached(text, 1, STOP_AFTER), timeout=SCRIPT_TIMEOUT_S)
    tree = script.sample_tree()

    preempted = time.monotonic()
    os.kill(script.pid, signal.SIGTERM)
    result = script.wait(timeout=STOP_BOUND_S + 20)
    took = time.monotonic() - preempted
    lines = [line for line in result.stdout.splitlines() if line.startswith("STOPPED ")]
    assert len(lines) == 1, "RunPreemptedError with every rank's result\n" + result.explain()
    report = json.loads(lines[0].removeprefix("STOPPED "))
    results = report["results"]

    # The retry resumed from the checkpoint of step SAVE_EVERY, not from step 0.
    assert results and [r["rank"] for r in results] == [0, 1], result.explain()
    assert all(r["resumed_at"] == SAVE_EVERY for r in results), results
    if framework == "huggingface":
        assert all(Path(r["resumed_from"]) == out / f"checkpoint-{SAVE_EVERY}" for r in results), results
    # SIGTERM: every rank stopped at the same step, soon, and a checkpoint of that step was saved.
    assert took < STOP_BOUND_S, f"{took:.1f} s from SIGTERM to the script's exit\n" + result.explain()
    assert all(r["stopped"] for r in results), results
    (stopped_at,) = {r["step"] for r in results}
    assert stopped_at >= STOP_AFTER, results
    assert saved_step(framework, out) == stopped_at, sorted(p.name for p in out.iterdir())
    assert len(run_folders(runs)) == 2, "one failed attempt, one retried and preempted"

    # The framework's metrics, rank 0's, each step once: the retry went on where the checkpoint was.
    run = ended_mlflow_run(Path(report["attempt"]).parent)
    assert run.info.status == "KILLED", "a preempted call"
    metric = FRAMEWORKS[framework]["metric"]
    history = mlflow.MlflowClient().get_metric_history(run.info.run_id, metric)
    assert sorted(m.step for m in history) == list(range(1, stopped_at + 1)), history
    if framework == "lightning":  # an epoch's value: validation runs once, when training stops
        history = mlflow.MlflowClient().get_metric_history(run.info.run_id, "val_loss")
        assert [m.step for m in history] == [stopped_at], history
    progress = json.loads((Path(report["attempt"]) / "progress.json").read_text())
    # the last values logged: the Trainer's summary of the training, Lightning's validation's
    last = {"huggingface": "train_loss", "lightning": "val_loss"}[framework]
    assert progress["step"] == stopped_at and last in progress["metrics"], progress
    assert_all_gone(tree + result.tree, what="processes after the preemption")


def saved_step(framework: str, out: Path) -> int:
    """The step of the newest checkpoint in ``out``: the Trainer's newest ``checkpoint-N``
    (its state written last), Lightning's ``last.ckpt``."""
    if framework == "huggingface":
        newest = max(out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
        return json.loads((newest / "trainer_state.json").read_text())["global_step"]
    import torch

    return torch.load(out / "last.ckpt", map_location="cpu", weights_only=True)["global_step"]


@pytest.mark.timeout(SCRIPT_TIMEOUT_S)
@pytest.mark.parametrize("framework", sorted(FRAMEWORKS))
def test_outside_a_run_the_callbacks_change_nothing(framework, tmp_path, run_script):
    needs(FRAMEWORKS[framework]["needs"])
    runs, out = tmp_path / "runs", tmp_path / "out"
    env = script_env(tmp_path, GPUFLEET_HOME=str(tmp_path / "gpufleet"))

    result = run_script(script_for(framework), "direct", runs, out, env=env, timeout=SCRIPT_TIMEOUT_S)

    assert result.returncode == 0, result.explain()
    lines = [line for line in result.stdout.splitlines() if line.startswith("DIRECT ")]
    assert len(lines) == 1, result.explain()
    trained = json.loads(lines[0].removeprefix("DIRECT "))
    assert trained["step"] == DIRECT_STEPS and not trained["stopped"], trained
    assert trained["resumed_at"] == 0, trained
    assert "gpufleet:" not in result.stderr, result.explain()
    assert not runs.exists(), "a direct call starts no run"
