"""examples/lightning_two_tower.py trains in small mode on 2 processes (here: gloo on CPU), keeps
its best and last checkpoints, and logs into the MLflow run gpufleet created for the call."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch
from support import EXAMPLES, assert_all_gone, rank_lines, script_env

EPOCHS = 6  # small mode's

MIN_AUROC = 0.75  # what the example itself checks in small mode; chance is 0.5
# About 20 s on an idle 2-core machine (imports and MLflow's sqlite setup are half of it); the
# margin is for a machine busy with other work (127 s was seen at a load average of 9).
SCRIPT_TIMEOUT_S = 200


@pytest.mark.timeout(SCRIPT_TIMEOUT_S + 30)
def test_lightning_two_tower_learns_and_keeps_the_best_checkpoint(run_script, tmp_path):
    pytest.importorskip("lightning")
    pytest.importorskip("torchmetrics")
    out = tmp_path / "out"
    env = script_env(tmp_path, GPUFLEET_HOME=str(tmp_path / "gpufleet"))

    result = run_script(EXAMPLES / "lightning_two_tower.py", "--small", "--gpus", "2",
                        "--out", out, env=env, timeout=SCRIPT_TIMEOUT_S)

    assert result.returncode == 0, result.explain()
    best = re.search(r"^best val AUROC (\d+\.\d+)", result.stdout, flags=re.M)
    assert best, result.explain()
    assert float(best.group(1)) >= MIN_AUROC, result.explain()
    # Rank 0 alone prints a line per epoch, and the AUROC of the last is above the first.
    epochs = [float(line.split("val_auroc")[-1]) for line in rank_lines(result.stdout, 0)
              if line.startswith("epoch ")]
    assert len(epochs) == EPOCHS and epochs[-1] > epochs[0], result.explain()
    assert not [line for line in rank_lines(result.stdout, 1) if line.startswith("epoch ")]

    checkpoint = re.search(r"^best checkpoint (.+\.ckpt)$", result.stdout, flags=re.M)
    assert checkpoint, result.explain()
    checkpoint = Path(checkpoint.group(1))
    assert checkpoint.is_file() and checkpoint.is_relative_to(out), checkpoint
    assert f"{float(best.group(1)):.4f}" in checkpoint.name  # the best epoch's file, by name
    saved = torch.load(checkpoint, map_location="cpu", weights_only=True)
    assert saved["hyper_parameters"]["users"] == 400, saved["hyper_parameters"]  # small mode
    assert {"user_tower.0.weight", "item_tower.0.weight"} <= saved["state_dict"].keys()
    last = torch.load(out / "checkpoints" / "latest" / "last.ckpt", map_location="cpu", weights_only=True)
    assert last["epoch"] == EPOCHS - 1, "last.ckpt, where a next run resumes: the last epoch"
    if importlib.util.find_spec("mlflow") is not None:
        check_the_calls_mlflow_run(result.stdout)
    else:
        assert list((out / "csv").glob("*/metrics.csv")), sorted(p.name for p in out.iterdir())

    # Lightning joined gpufleet's two ranks (the example checks it started no process itself).
    assert "2 ranks (TorchElasticEnvironment" in result.stdout, result.explain()
    assert_all_gone(result.tree, what="processes of the example")


def check_the_calls_mlflow_run(stdout: str) -> None:
    """Lightning's logger wrote into the call's MLflow run (the suite's store), not a store of
    its own: its hyperparameters beside gpufleet's, each epoch's AUROC once."""
    import mlflow

    run_id = re.search(r"^MLflow run (\w+)$", stdout, flags=re.M)
    assert run_id and run_id.group(1) != "None", stdout
    client = mlflow.MlflowClient()
    run = client.get_run(run_id.group(1))
    assert client.get_experiment(run.info.experiment_id).name == "two_tower"
    assert run.data.tags["gpufleet.function"].endswith("train"), "the run gpufleet created"
    assert run.data.params["world_size"] == "2" and run.data.params["users"] == "400"
    aurocs = client.get_metric_history(run.info.run_id, "val_auroc")
    assert len(aurocs) == EPOCHS, f"one value per epoch, logged once: {aurocs}"
