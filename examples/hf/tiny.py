"""Small stand-ins for a model and a data set that cannot be downloaded here: a chat data set
generated from templates, a byte-level BPE tokenizer trained on it, and a randomly initialised
model of a real architecture (GPT-OSS mixture of experts, Llama 3.2, Olmo 3) at a few hundred
thousand parameters. Each is written to disk in the format of the real thing (a JSON-lines
file of chat messages, a `save_pretrained` folder), so the examples' loading, collation,
training and saving code runs exactly as it does for a real checkpoint; only the sizes differ.

    python examples/hf/tiny.py gpt_oss /tmp/tiny     # /tmp/tiny/model and /tmp/tiny/chat.jsonl
"""

import json
import random
import sys
from pathlib import Path

SEED = 0
EXAMPLES = 512  # chat examples generated; each is 20-40 tokens
VOCAB = 512  # BPE vocabulary trained on them, special tokens included

# A ChatML-style template: every turn ends with <|im_end|>, which is also the end-of-sequence
# token, so that SFT learns to stop and generation stops there.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = {"bos_token": "<|startoftext|>", "eos_token": "<|im_end|>",
                  "pad_token": "<|pad|>", "unk_token": "<|unk|>"}
EXTRA_SPECIAL_TOKENS = ["<|im_start|>"]

# Sizes shared by the three architectures: small enough for CPU, the same structure as the
# real models (grouped-query attention, several decoder layers, RMSNorm, rotary positions).
COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, max_position_embeddings=2048, tie_word_embeddings=False)
ARCHITECTURES = {
    # GPT-OSS: 32 experts with 4 active in the 20B model (128 in the 120B); here 4, 2 active.
    # Alternating sliding-window and full attention layers, as in the real model.
    "gpt_oss": dict(config="GptOssConfig", intermediate_size=64, num_local_experts=4,
                    num_experts_per_tok=2, sliding_window=32,
                    layer_types=["sliding_attention", "full_attention"],
                    # YaRN as in the real model: a 32-fold stretch of the original context
                    rope_parameters=dict(rope_type="yarn", factor=32.0, beta_fast=32.0,
                                         beta_slow=1.0, truncate=False, rope_theta=150000.0,
                                         original_max_position_embeddings=2048 // 32)),
    "llama": dict(config="LlamaConfig", intermediate_size=128),
    "olmo3": dict(config="Olmo3Config", intermediate_size=128, sliding_window=32,
                  layer_types=["sliding_attention", "full_attention"]),
}


def chat_examples(count: int = EXAMPLES, seed: int = SEED) -> list[dict]:
    """Instruction / answer pairs in the `messages` format that TRL, Unsloth and Axolotl read.
    The answers follow from the questions (sums, reversed words, colours of things), so a model
    that learns lowers its loss well below what the templates alone give."""
    rng = random.Random(seed)
    words = ["apple", "river", "garden", "pencil", "window", "rocket", "silver", "planet",
             "forest", "candle", "bridge", "mirror", "orange", "castle", "dragon", "violin"]
    colours = {"grass": "green", "the sky": "blue", "snow": "white", "coal": "black",
               "a lemon": "yellow", "blood": "red", "a carrot": "orange", "a plum": "purple"}

    def sum_question():
        a, b = rng.randint(0, 20), rng.randint(0, 20)
        return f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."

    def reverse_question():
        word = rng.choice(words)
        return f"Spell {word} backwards.", f"{word} backwards is {word[::-1]}."

    def colour_question():
        thing = rng.choice(sorted(colours))
        return f"What colour is {thing}?", f"{thing.capitalize()} is {colours[thing]}."

    kinds = [sum_question, reverse_question, colour_question]
    examples = []
    for _ in range(count):
        question, answer = rng.choice(kinds)()
        examples.append({"messages": [{"role": "user", "content": question},
                                      {"role": "assistant", "content": answer}]})
    return examples


def write_chat_dataset(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for example in chat_examples():
            f.write(json.dumps(example) + "\n")
    return path


def train_tokenizer(texts: list[str], vocab: int = VOCAB):
    """A byte-level BPE tokenizer of `vocab` entries trained on `texts`, with special tokens
    and the chat template: what `AutoTokenizer.from_pretrained` of a chat model gives."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token=SPECIAL_TOKENS["unk_token"]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    special = list(SPECIAL_TOKENS.values()) + EXTRA_SPECIAL_TOKENS
    bpe.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=special, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, **SPECIAL_TOKENS,
                                        additional_special_tokens=EXTRA_SPECIAL_TOKENS)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def random_model(architecture: str, tokenizer):
    """A randomly initialised causal language model of `architecture` (a key of
    ARCHITECTURES) whose vocabulary and special tokens are the tokenizer's."""
    import torch
    import transformers

    options = dict(ARCHITECTURES[architecture])
    config_class = getattr(transformers, options.pop("config"))
    config = config_class(**COMMON, **options, vocab_size=len(tokenizer),
                          bos_token_id=tokenizer.bos_token_id,
                          eos_token_id=tokenizer.eos_token_id,
                          pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(SEED)
    return transformers.AutoModelForCausalLM.from_config(config)


def build(architecture: str, folder: str | Path) -> tuple[str, str]:
    """Write the chat data set, the tokenizer and a random `architecture` model under
    `folder`; return (model folder, data set file) for `--model` and `--dataset`."""
    folder = Path(folder)
    dataset = write_chat_dataset(folder / "chat.jsonl")
    tokenizer = train_tokenizer([tokenizer_text(m) for m in chat_examples()])
    model = random_model(architecture, tokenizer)
    model.save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")
    parameters = sum(p.numel() for p in model.parameters())
    print(f"tiny {architecture} model ({type(model).__name__}, {parameters / 1e6:.2f}M "
          f"parameters, vocabulary {len(tokenizer)}) and {EXAMPLES} chat examples in {folder}",
          flush=True)
    return str(folder / "model"), str(dataset)


def tokenizer_text(example: dict) -> str:
    return " ".join(f"{m['role']}\n{m['content']}" for m in example["messages"])


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ARCHITECTURES:
        sys.exit(f"usage: python {sys.argv[0]} {{{','.join(ARCHITECTURES)}}} FOLDER")
    build(sys.argv[1], sys.argv[2])
