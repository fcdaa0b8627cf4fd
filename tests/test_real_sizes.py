"""The Hugging Face examples at their real sizes (examples/hf/real.py, docs/real-sizes.md): the
switch between the real-size and the tiny stand-in, the published architectures, the random
model made from a folder that holds only a configuration, and the FLOPs per token that
benchmarks/real_sizes.py divides by the GPU's peak.

Nothing here needs a GPU: the published architectures are counted on the meta device, the
real-size path trains on the CPU a model that is small but built and fed as the real-size one
is (a configuration without weights, chats of the standard library's source).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from support import EXAMPLES, REPO, assert_all_gone, script_env

pytest.importorskip("trl")
pytest.importorskip("peft")
pytest.importorskip("datasets")

HF = EXAMPLES / "hf"
SCRIPT_TIMEOUT_S = 150


@pytest.fixture
def examples(monkeypatch):
    """examples/hf importable, as its scripts and notebooks import it."""
    monkeypatch.syspath_prepend(str(HF))
    monkeypatch.delenv("GPUFLEET_EXAMPLE_SIZE", raising=False)
    import recipe

    return recipe


def published():
    """Each example's published configuration, by the model's name."""
    import axolotl_ddp
    import trl_sft_ddp
    import trl_sft_deepspeed
    import trl_sft_fsdp
    import unsloth_ddp

    return {"Llama-3.2-1B": trl_sft_deepspeed.LLAMA_3_2_1B, "Llama-3.2-3B": unsloth_ddp.LLAMA_3_2_3B,
            "gpt-oss-20b": trl_sft_ddp.GPT_OSS_20B, "gpt-oss-120b": trl_sft_fsdp.GPT_OSS_120B,
            "Olmo-3-1025-7B": axolotl_ddp.OLMO_3_7B}


class Specials:  # what real.configuration takes from a tokenizer
    bos_token_id, eos_token_id, pad_token_id = 1, 2, 3


def test_without_a_gpu_the_examples_default_to_tiny_and_the_variable_or_flag_switches(
        examples, monkeypatch, tmp_path):
    import trl_sft_ddp

    assert examples.default_size() == "tiny", "this machine has no GPU"
    monkeypatch.setenv("GPUFLEET_EXAMPLE_SIZE", "real")
    assert examples.default_size() == "real"
    monkeypatch.setenv("GPUFLEET_EXAMPLE_SIZE", "huge")
    with pytest.raises(ValueError, match=r"GPUFLEET_EXAMPLE_SIZE='huge' is not a size: set it to real or tiny"):
        examples.default_size()

    monkeypatch.setenv("GPUFLEET_EXAMPLE_SIZE", "tiny")
    args = trl_sft_ddp.arguments(["--output-dir", str(tmp_path)])
    assert (args.size, args.max_steps, args.max_length) == ("tiny", 30, 1024)
    assert Path(args.model) == tmp_path / "tiny" / "model" and (Path(args.model) / "model.safetensors").exists()
    # the notebooks' way to say it
    assert examples.argv(size="tiny", max_steps=20) == ["--size", "tiny", "--max-steps", "20"]


@pytest.mark.parametrize("argv, says", [
    (["--model", "openai/gpt-oss-20b", "--size", "tiny"], "--model openai/gpt-oss-20b and --size tiny exclude each other"),
    (["--model", "openai/gpt-oss-20b"], "--model openai/gpt-oss-20b needs --dataset"),
    (["--size", "tiny", "--layers", "2"], "--layers 2: a cut of the real-size stand-in"),
    (["--size", "huge"], "argument --size: invalid choice: 'huge'"),
])
def test_contradicting_size_options_are_refused_before_anything_is_built(
        examples, argv, says, tmp_path, capsys):
    import trl_sft_ddp

    with pytest.raises(SystemExit):
        trl_sft_ddp.arguments([*argv, "--output-dir", str(tmp_path)])
    assert says in capsys.readouterr().err
    assert not list(tmp_path.iterdir()), "nothing is built for a refused command line"


def test_the_published_architectures_have_their_published_sizes(examples):
    """Counted on the meta device from the values written into the examples: totals as their
    model cards give them (Olmo 3's to the parameter), the experts' active share as OpenAI's."""
    import real

    expected = {"Llama-3.2-1B": 1_235_814_400, "Llama-3.2-3B": 3_212_749_824,
                "gpt-oss-20b": 20_914_757_184, "gpt-oss-120b": 116_829_156_672,
                "Olmo-3-1025-7B": 7_298_011_136}
    counted = {}
    for name, values in published().items():
        counted[name] = real.parameters(real.configuration(values, Specials))
    assert {name: total for name, (total, _) in counted.items()} == expected
    embedding = 201088 * 2880  # the input embedding: a lookup, not among the active weights
    assert round((counted["gpt-oss-20b"][1] - embedding) / 1e9, 1) == 3.6  # "3.6B active"
    assert round((counted["gpt-oss-120b"][1] - embedding) / 1e9, 1) == 5.1  # "5.1B active"
    cut = real.configuration(published()["gpt-oss-120b"], Specials, layers=4)
    assert (cut.num_hidden_layers, len(cut.layer_types)) == (4, 4)


def small(values: dict, **sizes) -> dict:
    """A published architecture at a CPU's size: the same kind of model, fewer and narrower
    layers."""
    layers = sizes.get("num_hidden_layers", 2)
    cut = dict(values, hidden_size=64, intermediate_size=128, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, num_hidden_layers=layers)
    cut.update(sizes)
    if "layer_types" in values:
        cut["layer_types"] = values["layer_types"][:layers]
    if "num_local_experts" in values:
        cut.update(num_local_experts=4, num_experts_per_tok=2)
    return cut


@pytest.mark.parametrize("name", ["Llama-3.2-1B", "gpt-oss-20b", "Olmo-3-1025-7B"])
def test_a_folder_without_weights_gives_a_random_model_made_on_the_device(examples, tmp_path, name):
    import torch
    from transformers import AutoConfig

    import real

    config = real.configuration(small(published()[name], vocab_size=300), Specials)
    config.save_pretrained(tmp_path)
    assert not examples.has_weights(str(tmp_path)), "only a config.json"

    model = examples.load_model(str(tmp_path))

    assert type(model).__name__ == config.architectures[0]
    saved = AutoConfig.from_pretrained(tmp_path).to_dict()
    assert model.config.to_dict() | {"dtype": None} == saved | {"dtype": None}, "that architecture"
    assert model.dtype == torch.float32, "fp32 on a CPU (model_options: bf16 on a GPU)"
    assert all(p.device.type == "cpu" for p in model.parameters()), "materialised, none on meta"
    weights = dict(model.named_parameters())
    for key, weight in weights.items():
        assert torch.isfinite(weight).all(), key
        if key.endswith("proj.weight") or key.endswith("experts.gate_up_proj") \
                or key.endswith("experts.down_proj"):  # initialised as the architecture does
            assert 0.01 < weight.float().std() < 0.03, (key, weight.float().std())
        if "norm" in key:
            assert torch.equal(weight, torch.ones_like(weight)), key
    if config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight, "tied again"


def test_the_real_size_chats_are_standard_library_source_that_fills_the_sequence(examples):
    import real

    chats = real.chat_examples(max_length=2048, count=64)
    assert len(chats) == 64
    answers = [c["messages"][1]["content"] for c in chats]
    assert all(c["messages"][0]["role"] == "user" and c["messages"][1]["role"] == "assistant"
               for c in chats)
    assert sum("def " in a or "class " in a or "import " in a for a in answers) > 48, "Python"
    assert min(len(a) for a in answers) > 2048 * real.CHARS_PER_TOKEN / 4
    assert sum(len(a) >= 0.5 * 2048 * real.CHARS_PER_TOKEN for a in answers) > 48, \
        "most fill the sequence"


@pytest.mark.timeout(SCRIPT_TIMEOUT_S + 60)
def test_the_real_size_path_trains_a_model_made_in_the_rank_on_standard_library_chats(
        examples, run_script, tmp_path):
    """What `--size real` does, small enough for a CPU: a GPT-OSS built from a configuration
    alone (no weights on disk), random weights made in the rank, chats of the standard
    library's source tokenised by a tokenizer trained on it; LoRA learns, the adapter is
    saved, and nothing tries to load the random base model back from disk."""
    import real

    # the vocabulary cut to the tokenizer's, or the output layer alone would slow a CPU down
    model, dataset = real.build(small(published()["gpt-oss-20b"], vocab_size=real.VOCAB),
                                tmp_path / "real", max_length=64)
    assert {p.name for p in Path(model).iterdir()} >= {"config.json", "tokenizer.json"}
    assert not examples.has_weights(model), "weights are made in the ranks"
    assert json.loads(Path(dataset).read_text().splitlines()[0])["messages"][1]["content"]

    out = tmp_path / "out"
    env = script_env(tmp_path, GPUFLEET_HOME=str(tmp_path / "gpufleet"), HF_HUB_OFFLINE="1",
                     GPUFLEET_TRACKING="0")
    result = run_script(HF / "trl_sft_ddp.py", "--model", model, "--dataset", dataset,
                        "--gpus", "1", "--max-steps", "12", "--learning-rate", "1e-2",
                        "--max-length", "64", "--output-dir", out, env=env,
                        timeout=SCRIPT_TIMEOUT_S)

    assert result.returncode == 0, result.explain()
    assert_all_gone(result.tree, what="processes of the example")
    first, final = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", result.stdout).groups())
    # ln(16384) = 9.7 for a random model over the tokenizer's ids, plus GPT-OSS's router loss
    assert first > 8.5, f"a random model's loss: {first}"
    # LoRA on a frozen random model learns slowly: a fall, not a size (on GPUs: RESULTS)
    assert final < first, f"the loss did not fall: {first} -> {final}"
    assert (out / "adapter_model.safetensors").exists()
    assert f"not generated from {out}: its base model's random weights" in result.stdout
    assert re.search(r"[\d,]+ tokens/s per GPU after the first steps", result.stdout), result.stdout


def test_flops_per_token_are_the_hand_count(examples, tmp_path):
    """6 N (full fine-tune) or 4 N (LoRA) over the weights each token multiplies, plus attention:
    12 x layers x attended length x attention width, sliding windows counted as such."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import real_sizes
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    import real

    for name, values in published().items():
        real.configuration(values, Specials).save_pretrained(tmp_path / name)
    llama = real_sizes.flops_per_token(str(tmp_path / "Llama-3.2-1B"), 2048, full_fine_tune=True)
    # tied: the embedding is the output layer's product too, so it counts
    assert llama == 6 * 1_235_814_400 + 12 * 16 * 2048 * (32 * 64)
    gpt_oss = real_sizes.flops_per_token(str(tmp_path / "gpt-oss-20b"), 2048, full_fine_tune=False)
    active = 4_187_440_704 - 201088 * 2880  # 4 of 32 experts; not the input embedding
    assert gpt_oss == 4 * active + 12 * (12 * 128 + 12 * 2048) * (64 * 64)
    assert round(llama * 50_000 / real_sizes.PEAK_BF16["H100"], 2) == 0.42, \
        "docs/real-sizes.md: 50,000 tokens/s of the 1B row on an H100 is 42% MFU"
