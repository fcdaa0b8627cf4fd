"""examples/hf/axolotl_ddp.py and examples/notebooks/axolotl.ipynb: Axolotl's `load_cfg`,
`load_datasets` and `train` in 2 gloo CPU processes, at the size of tests/test_hf_examples.py
(the tiny random Olmo 3 model, 20 steps).

Without GPUs the example trains LoRA on the unquantized model (QLoRA's 4-bit kernels are
CUDA's) with sample packing, in one DDP world of both ranks: the data set prepared by rank 0
and shared, the loss averaged over the ranks and falling, the adapter saved by rank 0 and loaded
again to generate, the Trainer's loss of every step in the MLflow run gpufleet created for the
call. The notebook runs the same training function, logs the trained model into that run and
loads it back in its own process.

Axolotl is not among the test extras: it pins its own torch (<= 2.13), transformers, TRL and
PEFT. Where it is not installed in this environment, it is taken from AXOLOTL_SITE: Axolotl,
the TRL release it pins and what it imports that the extras lack, installed there without
their dependencies (.ci/run makes it), and put first on the path of the example's processes
only. Without either these tests are skipped.
"""

from __future__ import annotations

import importlib.util

import pytest
from support import (EXAMPLES, assert_all_gone, first_on_path, first_on_path_here, package_site,
                     script_env)
from test_hf_examples import STEPS, check_calls_run, check_training, saved_tensors
from test_hf_notebooks import check_logged_and_loaded, hf_env, run_notebook  # noqa: F401
from test_hf_notebooks import check_training as check_notebook_training
from test_notebook import kernel_env  # noqa: F401 (the fixture hf_env builds on)

# Not imported here: Axolotl's TRL (1.9) shadows the extras' for its own processes only.
AXOLOTL = package_site("axolotl", "AXOLOTL_SITE")
pytestmark = pytest.mark.skipif(AXOLOTL is None, reason=(
    "Axolotl is not installed: `pip install axolotl==0.19.0` pins older torch, transformers and TRL; "
    "install it in an environment of its own, or set AXOLOTL_SITE to a folder made as .ci/run does"))

# About 75 s for the script and 90 s for the notebook on 2 cores beside another workload (the
# ranks import Axolotl, which imports most of the Hugging Face stack); the margin is for a
# busier machine.
SCRIPT_TIMEOUT_S = 300


@pytest.mark.timeout(SCRIPT_TIMEOUT_S + 30)
def test_axolotl_trains_lora_with_sample_packing_in_one_gloo_world_and_saves_the_adapter(
        run_script, tmp_path):
    out = tmp_path / "out"
    env = first_on_path(AXOLOTL, script_env(tmp_path, GPUFLEET_HOME=str(tmp_path / "gpufleet"),
                                            HF_HUB_OFFLINE="1"))
    result = run_script(EXAMPLES / "hf" / "axolotl_ddp.py", "--tiny", "--gpus", "2",
                        "--max-steps", str(STEPS), "--output-dir", out, env=env,
                        timeout=SCRIPT_TIMEOUT_S)
    assert result.returncode == 0, result.explain()
    assert_all_gone(result.tree, what="processes of the example")

    ranks = check_training(result.stdout, out, "MULTI_CPU")  # DDP over gloo, loss averaged
    assert "4-bit base model: False, sample packing: True" in result.stdout
    assert list((out / "prepared").iterdir()), "the data set was prepared once, on disk"
    adapter = saved_tensors(out / "adapter_model.safetensors")
    assert adapter and all("lora_" in k for k in adapter), adapter
    assert any(".self_attn.q_proj.lora_A" in k for k in adapter), "every linear layer"
    assert not (out / "model.safetensors").exists(), "LoRA saves the adapter, not the model"

    if importlib.util.find_spec("mlflow") is None:
        return
    check_calls_run(ranks)  # the loss by Axolotl's use_mlflow: the Trainer's


@pytest.mark.skipif(importlib.util.find_spec("mlflow") is None,
                    reason="the notebook ends by logging the model into MLflow")
@pytest.mark.timeout(SCRIPT_TIMEOUT_S + 60)
def test_axolotl_notebook_trains_logs_the_adapter_to_the_calls_mlflow_run_and_loads_it(
        hf_env, monkeypatch):  # noqa: F811 (the imported fixture)
    first_on_path_here(AXOLOTL, monkeypatch)  # the kernel, and the ranks it starts, import it from there
    text, here = run_notebook("axolotl.ipynb", hf_env)

    out = here / "axolotl_ddp"  # the notebook's OUTPUT_DIR, in its own folder
    run_id = check_notebook_training(text, out, "MULTI_CPU")
    assert "4-bit base model: False, sample packing: True" in text
    flavor = check_logged_and_loaded(text, run_id, "PeftModelForCausalLM")
    assert "peft_adaptor" in flavor, "MLflow stores the adapter, the base model by reference"
