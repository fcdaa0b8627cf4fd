"""examples/hf: TRL's SFTTrainer with DDP + LoRA, FSDP2 + LoRA and DeepSpeed ZeRO-3, each run as
its docstring says (`--tiny`: a random model of the real architecture, 2 gloo CPU processes).

Each example must train in a world of both ranks with the strategy it names (sharded parameters
for FSDP, partitioned ones for ZeRO-3), lower the loss, have rank 0 save what the next user
loads (a LoRA adapter, or a whole model plus checkpoints), and load it again to generate. With
MLflow installed, the Trainer's own metrics land in the MLflow run that gpufleet created for the
call, each step once: written by the Trainer (`report_to="mlflow"`), or else by gpufleet's
callback (`GpufleetCallback`). Unsloth and Axolotl are installed on their own: test_hf_notebooks.py
and test_axolotl.py run them where they are.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
from support import EXAMPLES, assert_all_gone, extensions_cache, script_env

pytest.importorskip("trl")
pytest.importorskip("peft")
pytest.importorskip("datasets")

STEPS = 20  # fewer than the --tiny default of 30: the loss falls well before
# About 25 s each on 2 idle cores (half of it importing transformers in three processes); the
# margin is for a machine busy with other work.
SCRIPT_TIMEOUT_S = 150
RANK_LINE = re.compile(r"^rank (\d+): status (\w+), loss ([\d.]+) -> ([\d.]+), output (.+), "
                       r"mlflow run (\w+)$", flags=re.M)
WORLD_LINE = re.compile(r"^2 ranks \((\w+), world of (\d+)\)", flags=re.M)
GENERATED = re.compile(r"^generated from (.+): '.*' -> '(.*)'$", flags=re.M)


def run_example(name: str, run_script, tmp_path, request, *args, **env_vars) -> tuple[str, Path]:
    """`python examples/hf/NAME --tiny --gpus 2 ...` in `tmp_path` (with `env_vars` set): its
    stdout and output folder."""
    out = tmp_path / "out"
    env = script_env(tmp_path, GPUFLEET_HOME=str(tmp_path / "gpufleet"), HF_HUB_OFFLINE="1",
                     TORCH_EXTENSIONS_DIR=extensions_cache(request, tmp_path), **env_vars)
    result = run_script(EXAMPLES / "hf" / name, "--tiny", "--gpus", "2", "--max-steps",
                        str(STEPS), "--output-dir", out, *args, env=env,
                        timeout=SCRIPT_TIMEOUT_S)
    assert result.returncode == 0, result.explain()
    assert_all_gone(result.tree, what="processes of the example")
    return result.stdout, out


def check_training(stdout: str, out: Path, strategy: str) -> list[dict]:
    """Both ranks trained in one world of 2 with `strategy`, the loss fell, the output is in
    `out`, and the saved output generated text. Returns each rank's printed result."""
    ranks = [dict(rank=int(r), status=s, first=float(a), final=float(b), output=o, run=m)
             for r, s, a, b, o, m in RANK_LINE.findall(stdout)]
    assert [r["rank"] for r in ranks] == [0, 1], "every rank returns its result:\n" + stdout
    assert all(r["status"] == "ok" and Path(r["output"]) == out for r in ranks), ranks
    assert WORLD_LINE.search(stdout).groups() == (strategy, "2"), stdout
    first, final = ranks[0]["first"], ranks[0]["final"]
    assert first > 5.5, "a random model starts near ln(vocabulary) = 6.2"
    assert final < first - 0.3, f"the loss did not fall: {first} -> {final}"
    assert ranks[1]["final"] == final, "the Trainer logs the loss averaged over the ranks"
    generated = GENERATED.search(stdout)
    assert generated and Path(generated[1]) == out and generated[2], \
        "the saved output loads and generates:\n" + stdout
    return ranks


def saved_tensors(path: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        return list(f.keys())


@pytest.mark.timeout(SCRIPT_TIMEOUT_S + 30)
def test_trl_ddp_lora_saves_an_adapter_and_logs_into_gpufleets_mlflow_run(
        run_script, tmp_path, request):
    stdout, out = run_example("trl_sft_ddp.py", run_script, tmp_path, request)

    ranks = check_training(stdout, out, "MULTI_CPU")  # DDP over gloo
    adapter = saved_tensors(out / "adapter_model.safetensors")
    assert adapter and all("lora_" in k for k in adapter), adapter
    assert not (out / "model.safetensors").exists(), "LoRA saves the adapter, not the model"

    if importlib.util.find_spec("mlflow") is None:
        return
    # each step once: gpufleet's callback leaves MLflow to the Trainer (the status line only)
    run = check_calls_run(ranks)
    assert run.data.params["lr_scheduler_type"] == "cosine_with_min_lr"  # beside gpufleet's
    assert run.info.status == "FINISHED"


@pytest.mark.timeout(SCRIPT_TIMEOUT_S + 30)
def test_trl_fsdp2_shards_gpt_oss_saves_a_lora_adapter_with_expert_weights_and_logs_via_gpufleet(
        run_script, tmp_path, request):
    stdout, out = run_example("trl_sft_fsdp.py", run_script, tmp_path, request,
                              "--report-to", "none")  # MLflow: tested with DDP

    ranks = check_training(stdout, out, "FSDP")
    assert "FSDP2 units: GptOssDecoderLayer; parameters sharded on every rank: True" in stdout
    adapter = saved_tensors(out / "adapter_model.safetensors")
    assert any(".self_attn.q_proj.lora_A" in k for k in adapter), adapter
    assert any(".mlp.experts.lora_A" in k for k in adapter), "the experts are adapted too"

    if importlib.util.find_spec("mlflow") is None:
        return
    import mlflow

    # The Trainer reports nowhere: gpufleet's callback logged its loss into the call's run.
    losses = mlflow.MlflowClient().get_metric_history(ranks[0]["run"], "loss")
    assert sorted(m.step for m in losses) == list(range(1, STEPS + 1)), losses


@pytest.mark.timeout(SCRIPT_TIMEOUT_S + 30)
def test_trl_deepspeed_zero3_full_fine_tune_evaluates_checkpoints_and_saves_the_model(
        run_script, tmp_path, request):
    pytest.importorskip("deepspeed")
    # Not tracked, and no MLflow store set: with the default --report-to auto the Trainer
    # reports nowhere, so MLflow (installed or not) makes no store of its own in the working folder.
    stdout, out = run_example("trl_sft_deepspeed.py", run_script, tmp_path, request,
                              "--eval-steps", "10", GPUFLEET_TRACKING="0", MLFLOW_TRACKING_URI="")

    ranks = check_training(stdout, out, "DEEPSPEED")
    check_zero3_saved(stdout, out)
    assert all(r["run"] == "None" for r in ranks), "tracking is off: the call has no MLflow run"
    strays = [p.name for p in tmp_path.iterdir() if p.name in ("mlflow.db", "mlruns")]
    assert not strays, f"an untracked call left an MLflow store in its working folder: {strays}"


def check_calls_run(ranks: list[dict]):
    """Every rank logged into the MLflow run gpufleet created for the call, and rank 0 logged the
    loss of every step once; the run, for more checks."""
    import mlflow

    run_id = ranks[0]["run"]
    assert run_id != "None" and ranks[1]["run"] == run_id, "every rank is in the call's run"
    client = mlflow.MlflowClient()
    run = client.get_run(run_id)
    assert run.data.tags["gpufleet.function"].endswith("train"), "the run gpufleet created"
    assert run.data.params["world_size"] == "2"
    losses = client.get_metric_history(run_id, "loss")
    assert sorted(m.step for m in losses) == list(range(1, STEPS + 1)), "rank 0 logs every step"
    return run


def check_zero3_saved(text: str, out: Path) -> None:
    """A ZeRO-3 full fine-tune: the whole model gathered from the partitions, two checkpoints
    holding DeepSpeed's partitioned optimizer state, and a held-out loss that fell."""
    assert "ZeRO stage 3, parameters partitioned on every rank: True" in text, text
    weights = saved_tensors(out / "model.safetensors")
    assert "model.embed_tokens.weight" in weights and "lm_head.weight" in weights
    checkpoints = sorted(p.name for p in out.glob("checkpoint-*"))
    assert checkpoints == ["checkpoint-10", "checkpoint-20"], checkpoints
    assert all(list((out / c).glob("global_step*/*optim_states.pt")) for c in checkpoints), \
        "each checkpoint holds DeepSpeed's partitioned optimizer state"
    eval_loss = float(re.search(r"last eval loss ([\d.]+)", text)[1])
    assert eval_loss < 5.5, f"the held-out loss fell too: {eval_loss}"


@pytest.mark.skipif(importlib.util.find_spec("mlflow") is None, reason="logging a model needs MLflow")
def test_a_model_is_logged_with_its_requirements_where_torchvision_is_missing(monkeypatch):
    """MLflow's transformers flavour names torchvision among every torch model's requirements
    and fails (ModuleNotFoundError) where it is not installed, as beside many LLM stacks: the
    examples then pin what the model does need."""
    import mlflow.transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    monkeypatch.syspath_prepend(str(EXAMPLES / "hf"))
    import recipe

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=2))
    if importlib.util.find_spec("torchvision") is not None:  # MLflow's own list, then
        assert any(r.startswith("torchvision==") for r in recipe.pip_requirements(model))

    def no_torchvision(model):
        raise ModuleNotFoundError("No module named 'torchvision'", name="torchvision")

    monkeypatch.setattr(mlflow.transformers, "get_default_pip_requirements", no_torchvision)
    needs = recipe.pip_requirements(model)
    assert [r.split("==")[0] for r in needs][:2] == ["transformers", "torch"], needs
    assert all(re.fullmatch(r"[\w-]+==\d[\w.]*", r) for r in needs), "pinned, without local labels"
    assert not any(r.startswith("torchvision") for r in needs), needs
