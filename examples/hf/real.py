"""Stand-ins at the real size, where the real checkpoint and data set cannot be downloaded: the
model each example names, built from its published configuration (the values of its
`config.json`, written into the example) with random weights, and real text made here: chats
whose answers are the Python standard library's source, tokenised with a byte-level BPE
tokenizer trained on that source.

The model folder holds the configuration and the tokenizer only: the ranks build the model on
the meta device and materialise it on their GPU (`materialise`), so a 20B model never passes
through host memory. Unsloth and Axolotl load a model only from a folder of weights; for them
`build(..., weights=True)` materialises it once on the GPU and saves it there.

    python examples/hf/real.py llama-3.2-1b /tmp/real    # /tmp/real/model, /tmp/real/chat.jsonl
"""

import json
import sys
import sysconfig
from pathlib import Path

SEED = 0
VOCAB = 16384  # the tokenizer's; the model keeps its published vocabulary (ids above stay unused)
TOKENIZER_CHARS = 4_000_000  # source text the tokenizer is trained on (~3 s)
EXAMPLES = 512  # chats written: more than 30 steps of the largest batch take
CHARS_PER_TOKEN = 4.3  # measured for VOCAB on the standard library's source


def source_files() -> list[Path]:
    """The standard library's Python files, in a fixed order; where an interpreter was
    installed without them, the installed packages' sources instead (torch's, transformers')."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.rglob("*.py")
                   if not {"site-packages", "dist-packages", "test", "tests"} & set(p.parts))
    if sum(p.stat().st_size for p in files) < TOKENIZER_CHARS:
        import torch
        import transformers

        for package in (torch, transformers):
            files += sorted(Path(package.__file__).parent.rglob("*.py"))
    return files


def source_chunks(chars: int) -> list[tuple[str, str]]:
    """(file, text) pieces of about `chars` characters each, cut at line ends."""
    chunks = []
    for path in source_files():
        text = path.read_text(errors="replace")
        while len(text) > chars // 4:  # short tails are left out: they pad, not train
            cut = text.rfind("\n", 0, chars)
            cut = cut if cut > chars // 2 else chars
            chunks.append((path.name, text[:cut]))
            text = text[cut:]
    return chunks


def chat_examples(max_length: int, count: int = EXAMPLES) -> list[dict]:
    """Chats in the `messages` format the examples read: a request for a piece of a standard
    library module, answered with its source, long enough to fill `max_length` tokens."""
    import random

    chunks = source_chunks(int(max_length * CHARS_PER_TOKEN))
    random.Random(SEED).shuffle(chunks)
    return [{"messages": [{"role": "user", "content": f"Show me a part of {name}."},
                          {"role": "assistant", "content": text}]}
            for name, text in chunks[:count]]


def tokenizer_texts() -> list[str]:
    texts, total = [], 0
    for path in source_files():
        texts.append(path.read_text(errors="replace"))
        total += len(texts[-1])
        if total >= TOKENIZER_CHARS:
            break
    return texts


def configuration(published: dict, tokenizer, layers: int | None = None):
    """The transformers configuration of `published` (a config.json's values) with the
    tokenizer's special tokens, cut to its first `layers` decoder layers when given."""
    from transformers import AutoConfig

    values = {k: v for k, v in published.items() if k != "model_type"}
    if layers is not None:
        values["num_hidden_layers"] = layers
        if "layer_types" in values:  # the pattern of sliding and full attention, cut with them
            values["layer_types"] = values["layer_types"][:layers]
    values.update(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id, use_cache=False)
    return AutoConfig.for_model(published["model_type"], **values)


def materialise(config, options: dict, device=None):
    """A randomly initialised model of `config`, built on the meta device (no memory) and then
    given memory on `device` (this rank's GPU; the CPU when None) and initialised there, the
    way the architecture initialises itself. Under DeepSpeed ZeRO-3 it is built inside
    DeepSpeed's `zero.Init` instead, which partitions every parameter as it is created.
    `options`: `from_pretrained` keywords (dtype, attention implementation)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    keywords = {k: v for k, v in options.items() if k in ("dtype", "attn_implementation")}
    if is_deepspeed_zero3_enabled():  # from_config enters zero.Init itself
        return AutoModelForCausalLM.from_config(config, **keywords)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, **keywords)
    model.to_empty(device=device or "cpu")
    for module in model.modules():  # built "initialised" on meta: initialise them for real
        module.__dict__.pop("_is_hf_initialized", None)
    with torch.no_grad():
        model.init_weights()  # the architecture's own initialisation; ties lm_head again
    return model


def parameters(config) -> tuple[int, int]:
    """(all parameters, those active for one token) of `config`'s model, counted on the meta
    device: a mixture of experts uses `num_experts_per_tok` of its `num_local_experts`."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = active = 0
    share = getattr(config, "num_experts_per_tok", 1) / getattr(config, "num_local_experts", 1)
    for name, parameter in model.named_parameters():
        total += parameter.numel()
        active += parameter.numel() * (share if ".experts." in name else 1)
    return total, int(active)


def build(published: dict, folder: str | Path, max_length: int, layers: int | None = None,
          weights: bool = False) -> tuple[str, str]:
    """Write the chat data set, the tokenizer and the configuration of `published` (cut to
    `layers`) under `folder`, and with `weights` the random weights too (materialised on the
    GPU, saved from there); return (model folder, data set file) for `--model` and `--dataset`.
    A folder built before with the same inputs is used as it is."""
    import tiny

    folder = Path(folder)
    stamp = {"published": published, "max_length": max_length, "layers": layers,
             "weights": weights, "vocab": VOCAB, "examples": EXAMPLES}
    model, dataset = folder / "model", folder / "chat.jsonl"
    if (folder / "built.json").is_file() and json.loads((folder / "built.json").read_text()) == stamp:
        return str(model), str(dataset)
    folder.mkdir(parents=True, exist_ok=True)
    with open(dataset, "w") as f:
        for example in chat_examples(max_length):
            f.write(json.dumps(example) + "\n")
    tokenizer = tiny.train_tokenizer(tokenizer_texts(), vocab=VOCAB)
    config = configuration(published, tokenizer, layers)
    tokenizer.save_pretrained(model)
    config.save_pretrained(model)
    if weights:
        save_weights(config, model)
    total, active = parameters(config)
    print(f"{published['model_type']} at its published size ({total / 1e9:.2f}B parameters, "
          f"{active / 1e9:.2f}B active; {config.num_hidden_layers} layers), random weights "
          f"{'saved' if weights else 'made in the ranks'}; {EXAMPLES} chats of standard "
          f"library source in {folder}", flush=True)
    (folder / "built.json").write_text(json.dumps(stamp))
    return str(model), str(dataset)


def save_weights(config, folder: Path) -> None:
    """Materialise `config`'s model in bf16 on the GPU (the CPU without one) and save it."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = materialise(config, {"dtype": dtype}, device)
    model.save_pretrained(folder)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()


if __name__ == "__main__":
    import importlib

    rows = {"llama-3.2-1b": ("trl_sft_deepspeed", "LLAMA_3_2_1B"),
            "gpt-oss-20b": ("trl_sft_ddp", "GPT_OSS_20B"),
            "gpt-oss-120b": ("trl_sft_fsdp", "GPT_OSS_120B"),
            "llama-3.2-3b": ("unsloth_ddp", "LLAMA_3_2_3B"),
            "olmo-3-7b": ("axolotl_ddp", "OLMO_3_7B")}
    if len(sys.argv) != 3 or sys.argv[1] not in rows:
        sys.exit(f"usage: python {sys.argv[0]} {{{','.join(rows)}}} FOLDER")
    module, name = rows[sys.argv[1]]
    build(getattr(importlib.import_module(module), name), sys.argv[2], 2048)
