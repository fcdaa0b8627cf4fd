"""examples/notebooks: the Hugging Face notebooks (TRL's SFTTrainer with DDP + LoRA, FSDP2 + LoRA
and DeepSpeed ZeRO-3; Unsloth) run top to bottom in a real Jupyter kernel, at the size of
tests/test_hf_examples.py: the tiny random model of the real architecture, 20 steps, 2 gloo CPU
processes.

What a user of such a notebook sees: no cell fails, both ranks trained in one world with the
strategy the notebook names and the loss fell, rank 0 logged the trained model into the MLflow run
gpufleet created for the call (MLflow's transformers flavour), and the notebook's own process
loaded it back from that run and generated text with it. Each notebook runs in a copy of the
examples, in its own folder as Jupyter runs it (it imports its training function from ../hf), with
MAX_STEPS (and what the test of the same script sets) in a cell injected after its parameter cell,
as papermill does. The kernel and its private HOME / Jupyter folders are tests/test_notebook.py's
fixture.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbformat.v4 import new_code_cell
from support import EXAMPLES, extensions_cache, first_on_path_here, package_site
from test_hf_examples import check_zero3_saved
from test_notebook import KERNEL, kernel_env  # noqa: F401 (kernel_env: a fixture)

pytest.importorskip("trl")
pytest.importorskip("peft")
pytest.importorskip("datasets")

NOTEBOOKS = EXAMPLES / "notebooks"
STEPS = 20  # as tests/test_hf_examples.py: the loss falls well before the notebooks' 30
MODEL_NAME = "model"  # the notebooks' default name of the logged model
# About 35 s each on 2 idle cores (a kernel, two ranks that import transformers, MLflow), and
# DeepSpeed's first compilation of its CPU extension; the margin is for a busy machine.
NOTEBOOK_TIMEOUT_S = 240
RANK_LINE = re.compile(r"^rank (\d+): status (\w+), loss ([\d.]+) -> ([\d.]+), output (.+), "
                       r"mlflow run (\w+)$", flags=re.M)
WORLD_LINE = re.compile(r"^2 ranks \((\w+), world of (\d+)\)", flags=re.M)
REPLY = re.compile(r"^(\w+) from runs:/(\w+)/(\w+)\n'What is 7 plus 5\?' -> '(.*)'$", flags=re.M)


def run_notebook(name: str, folder: Path, **parameters) -> tuple[str, Path]:
    """Execute examples/notebooks/NAME in a copy of examples/notebooks and examples/hf under
    `folder`, with MAX_STEPS=STEPS (and `parameters`) injected after its parameter cell; raises
    on any cell error. What the cells printed on stdout, in order, and the notebook's folder."""
    copy = folder / "examples"
    shutil.copytree(EXAMPLES / "hf", copy / "hf", ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "notebooks").mkdir()
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    at = next(i for i, cell in enumerate(nb.cells) if "parameters" in cell.metadata.get("tags", []))
    values = {"MAX_STEPS": STEPS, **parameters}
    nb.cells.insert(at + 1, new_code_cell("\n".join(f"{k} = {v!r}" for k, v in values.items()),
                                          metadata={"tags": ["injected-parameters"]}))
    NotebookClient(nb, kernel_name=KERNEL, timeout=NOTEBOOK_TIMEOUT_S, startup_timeout=60,
                   resources={"metadata": {"path": str(copy / "notebooks")}}).execute()
    printed = ["".join(o.get("text", "") for o in cell.outputs if o.get("name") == "stdout")
               for cell in nb.cells if cell.cell_type == "code"]
    return "\n".join(printed), copy / "notebooks"


def check_training(text: str, out: Path, strategy: str) -> str:
    """Both ranks trained in one world of 2 with `strategy` in the call's MLflow run, and the
    loss fell. The run's id."""
    ranks = [dict(rank=int(r), status=s, first=float(a), final=float(b), output=o, run=m)
             for r, s, a, b, o, m in RANK_LINE.findall(text)]
    assert [r["rank"] for r in ranks] == [0, 1], "every rank returns its result:\n" + text
    assert all(r["status"] == "ok" and Path(r["output"]) == out for r in ranks), ranks
    assert WORLD_LINE.search(text).groups() == (strategy, "2"), text
    first, final = ranks[0]["first"], ranks[0]["final"]
    assert first > 5.5, "a random model starts near ln(vocabulary) = 6.2"
    assert final < first - 0.3, f"the loss did not fall: {first} -> {final}"
    run_id = ranks[0]["run"]
    assert run_id != "None" and ranks[1]["run"] == run_id, "every rank is in the call's run"
    return run_id


def check_logged_and_loaded(text: str, run_id: str, loaded_class: str) -> dict:
    """Rank 0 logged the trained model into the call's run with the transformers flavour, the
    loss of every step is in that run, and the notebook loaded the model back from it and
    generated. The model's transformers flavour configuration."""
    import mlflow

    reply = REPLY.search(text)
    assert reply, "the last cell loads the model from MLflow and answers:\n" + text[-3000:]
    assert reply.groups()[:3] == (loaded_class, run_id, MODEL_NAME), reply.groups()
    assert reply[4], "the loaded model generated text"

    client = mlflow.MlflowClient()
    run = client.get_run(run_id)
    assert run.data.tags["gpufleet.function"].endswith("train"), "the run gpufleet created"
    assert run.info.status == "FINISHED"
    losses = client.get_metric_history(run_id, "loss")
    assert sorted(m.step for m in losses) == list(range(1, STEPS + 1)), "rank 0 logs every step"
    if hasattr(client, "search_logged_models"):  # MLflow 3: a logged model of the run
        logged = client.search_logged_models([run.info.experiment_id],
                                             filter_string=f"source_run_id = '{run_id}'")
        assert [m.name for m in logged] == [MODEL_NAME], "one model, logged into the call's run"
    info = mlflow.models.get_model_info(f"runs:/{run_id}/{MODEL_NAME}")
    assert info.flavors["transformers"]["task"] == "text-generation", info.flavors
    return info.flavors["transformers"]


def saved_tensors(path: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        return list(f.keys())


@pytest.fixture
def hf_env(kernel_env, monkeypatch, request):  # noqa: F811 (the imported fixture)
    """kernel_env, with a gpufleet home of its own, no hub access, and DeepSpeed's extensions
    compiled once (support.extensions_cache)."""
    monkeypatch.setenv("GPUFLEET_HOME", str(kernel_env / "gpufleet"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", extensions_cache(request, kernel_env))
    return kernel_env


needs_mlflow = pytest.mark.skipif(importlib.util.find_spec("mlflow") is None,
                                  reason="the notebooks end by logging the model into MLflow")


@needs_mlflow
@pytest.mark.timeout(NOTEBOOK_TIMEOUT_S + 60)
def test_trl_ddp_notebook_trains_a_lora_adapter_logs_it_to_the_calls_mlflow_run_and_loads_it(hf_env):
    text, here = run_notebook("trl_sft_ddp.ipynb", hf_env)

    out = here / "trl_sft_ddp"  # the notebook's OUTPUT_DIR, in its own folder
    run_id = check_training(text, out, "MULTI_CPU")  # DDP over gloo
    adapter = saved_tensors(out / "adapter_model.safetensors")
    assert adapter and all("lora_" in k for k in adapter), adapter
    assert not (out / "model.safetensors").exists(), "LoRA saves the adapter, not the model"
    flavor = check_logged_and_loaded(text, run_id, "PeftModelForCausalLM")
    assert "peft_adaptor" in flavor, "MLflow stores the adapter, the base model by reference"
    import mlflow

    params = mlflow.MlflowClient().get_run(run_id).data.params
    assert params["world_size"] == "2"  # gpufleet's parameter ...
    assert params["lr_scheduler_type"] == "cosine_with_min_lr"  # ... beside the Trainer's


@needs_mlflow
@pytest.mark.timeout(NOTEBOOK_TIMEOUT_S + 60)
def test_trl_fsdp_notebook_shards_gpt_oss_and_logs_the_adapter_gathered_from_the_shards(hf_env):
    # The Trainer reports nowhere, as in tests/test_hf_examples.py: gpufleet's callback logs.
    text, here = run_notebook("trl_sft_fsdp.ipynb", hf_env, REPORT_TO="none")

    out = here / "trl_sft_fsdp"
    run_id = check_training(text, out, "FSDP")
    assert "FSDP2 units: GptOssDecoderLayer; parameters sharded on every rank: True" in text
    adapter = saved_tensors(out / "adapter_model.safetensors")
    assert any(".self_attn.q_proj.lora_A" in k for k in adapter), adapter
    assert any(".mlp.experts.lora_A" in k for k in adapter), "the experts are adapted too"
    check_logged_and_loaded(text, run_id, "PeftModelForCausalLM")


@needs_mlflow
@pytest.mark.timeout(NOTEBOOK_TIMEOUT_S + 60)
def test_trl_deepspeed_notebook_gathers_the_zero3_partitions_and_logs_the_whole_model(hf_env):
    pytest.importorskip("deepspeed")
    text, here = run_notebook("trl_sft_deepspeed.ipynb", hf_env, EVAL_STEPS=10, REPORT_TO="none")

    out = here / "trl_sft_deepspeed"
    run_id = check_training(text, out, "DEEPSPEED")
    check_zero3_saved(text, out)
    flavor = check_logged_and_loaded(text, run_id, "LlamaForCausalLM")
    assert "peft_adaptor" not in flavor, "a full fine-tune logs the whole model"


# Unsloth, where it is not installed here: in UNSLOTH_SITE (support.package_site), on the
# notebook's path only, since importing Unsloth patches transformers and TRL.
UNSLOTH = package_site("unsloth", "UNSLOTH_SITE")


@pytest.mark.skipif(UNSLOTH is None, reason=(
    "unsloth is not installed: `pip install unsloth` (2026.10.9) would replace this environment's "
    "transformers, TRL and datasets with the older ones it pins (<= 5.17, <= 1.15, < 5). Installed "
    "without its dependencies, beside this environment's, it runs here on CPU with its fallback: "
    "pip install --no-deps --target DIR unsloth==2026.10.9 unsloth_zoo==2026.10.9; UNSLOTH_SITE=DIR"))
@needs_mlflow
@pytest.mark.timeout(NOTEBOOK_TIMEOUT_S + 60)
def test_unsloth_notebook_trains_a_lora_adapter_and_logs_it(hf_env, monkeypatch):
    first_on_path_here(UNSLOTH, monkeypatch)  # the kernel, and the ranks it starts, import it from there
    text, here = run_notebook("unsloth.ipynb", hf_env)

    run_id = check_training(text, here / "unsloth_ddp", "MULTI_CPU")
    check_logged_and_loaded(text, run_id, "PeftModelForCausalLM")
