"""Fine-tune Olmo 3 7B with QLoRA through Axolotl's config and train entry point, one DDP process
per GPU of this machine.

    python examples/hf/axolotl_ddp.py --dataset chats.jsonl     # allenai/Olmo-3-7B-Instruct
    python examples/hf/axolotl_ddp.py --model /models/olmo-3-7b --dataset chats.jsonl --gpus 8
    python examples/hf/axolotl_ddp.py --tiny      # a random Olmo-3-shaped model, 2 GPUs: ~1 min

Axolotl is driven by a config: the dict below is what an Axolotl YAML file holds, and the
rank function runs what `axolotl train config.yml` runs after `accelerate launch` has started
the processes: `load_cfg` (validation and defaults), `load_datasets` (chat-template
tokenization, prepared once by rank 0 while the others wait, then shared through
`dataset_prepared_path`) and `train`. gpufleet takes `accelerate launch`'s place: it starts
one process per GPU with torchrun's variables, and Axolotl's Trainer joins them as a DDP world.

QLoRA: the base model is quantized to 4-bit NF4 by bitsandbytes as it loads and stays frozen;
LoRA adapters (r=32) on every linear layer train in bf16 on top of it. Sample packing puts
several short conversations into each 2048-token sequence (SDPA keeps them from attending to
one another), so each step carries full sequences instead of padding. 16 steps, as the
original does. Rank 0 saves the adapter; the script loads it on the base model and generates a
few tokens. With MLflow installed the Trainer's metrics go into the MLflow run gpufleet creates
for the call. Axolotl sends usage telemetry unless told not to: AXOLOTL_DO_NOT_TRACK=1 is set
for every rank.

Needs NVIDIA GPUs (bitsandbytes' 4-bit kernels) and `pip install axolotl` (which pins its own
versions of torch, transformers, TRL and peft). `--tiny` builds a two-layer Olmo 3 model with a
locally trained tokenizer and a generated chat data set (see tiny.py). examples/hf/README.md
says what ran where.
"""

import time

from gpufleet import distributed

import recipe

NO_AXOLOTL_TELEMETRY = {"AXOLOTL_DO_NOT_TRACK": "1"}


def axolotl_config(model_path: str, dataset_path: str, output_dir: str, max_steps: int,
                   learning_rate: float, max_length: int, report_to: str) -> dict:
    """The Axolotl config, as its YAML file would hold it."""
    return {
        "base_model": model_path,
        "load_in_4bit": True,
        "adapter": "qlora",
        "lora_r": 32,
        "lora_alpha": 16,
        "lora_dropout": 0.05,
        "lora_target_linear": True,
        # Axolotl's fused LoRA kernels patch the model's attention code by matching its source
        # text, written for the transformers release Axolotl pins (5.16.1 for 0.19): with any
        # other they fail. Plain PEFT LoRA layers compute the same.
        "lora_mlp_kernel": False,
        "lora_qkv_kernel": False,
        "lora_o_kernel": False,
        "datasets": [{"path": dataset_path, "ds_type": "json", "type": "chat_template",
                      "field_messages": "messages"}],
        "chat_template": "tokenizer_default",
        "dataset_prepared_path": f"{output_dir}/prepared",
        "val_set_size": 0.0,
        "sequence_len": max_length,
        "sample_packing": True,
        "pad_to_sequence_len": True,
        "attn_implementation": "sdpa",
        "micro_batch_size": 2,
        "gradient_accumulation_steps": 2,
        "max_steps": max_steps,
        "optimizer": "adamw_torch_fused",
        "lr_scheduler": "cosine",
        "learning_rate": learning_rate,
        "warmup_ratio": 0.1,
        "bf16": "auto",
        "gradient_checkpointing": True,
        "gradient_checkpointing_kwargs": {"use_reentrant": False},  # DDP and checkpointing
        "logging_steps": 1,
        "save_strategy": "no",
        "output_dir": output_dir,
        "use_mlflow": report_to == "mlflow",
        "seed": 0,
    }


@distributed(env={**recipe.NO_TELEMETRY, **NO_AXOLOTL_TELEMETRY})
def train(config: dict) -> dict:
    from axolotl.cli.config import load_cfg
    from axolotl.common.datasets import load_datasets
    from axolotl.train import train as axolotl_train
    from axolotl.utils.dict import DictDefault

    begun = recipe.begin()
    cfg = load_cfg(DictDefault(config))
    dataset_meta = load_datasets(cfg=cfg)
    # Trains, then rank 0 saves the adapter and tokenizer into output_dir.
    _, _, trainer = axolotl_train(cfg=cfg, dataset_meta=dataset_meta)
    return recipe.rank_result(begun, trainer, quantized=bool(cfg.load_in_4bit),
                              sample_packing=bool(cfg.sample_packing))


if __name__ == "__main__":
    parser = recipe.command_line(__doc__, model="allenai/Olmo-3-7B-Instruct",
                                 output_dir="axolotl_ddp", max_steps=16, tiny_steps=30,
                                 learning_rate=2e-4, tiny_learning_rate=3e-3, max_length=2048,
                                 tiny_max_length=512)
    args = recipe.parse(parser, "olmo3")
    if not recipe.on_gpu():
        parser.error("Axolotl's QLoRA needs NVIDIA GPUs (bitsandbytes' 4-bit kernels); "
                     "examples/hf/README.md says why")
    config = axolotl_config(args.model, args.dataset, args.output_dir, args.max_steps,
                            args.learning_rate, args.max_length, args.report_to)
    started = time.monotonic()
    results = train.options(gpus=args.gpus).distributed(config)
    print(f"4-bit base model: {results[0]['quantized']}, sample packing: "
          f"{results[0]['sample_packing']}")
    recipe.summarize(results, time.monotonic() - started)
