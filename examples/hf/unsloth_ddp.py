"""Fine-tune Llama 3.2 3B with Unsloth's FastLanguageModel and LoRA, one DDP process per GPU here.

    python examples/hf/unsloth_ddp.py --model unsloth/Llama-3.2-3B-Instruct --dataset chats.jsonl
    python examples/hf/unsloth_ddp.py --model /models/llama-3.2-3b --dataset chats.jsonl --gpus 8
    python examples/hf/unsloth_ddp.py --size real    # Llama 3.2 3B, random weights: 1 GPU
    python examples/hf/unsloth_ddp.py --size tiny    # a two-layer Llama

Without --model it trains a stand-in built here (no download), of `--size` (default:
$GPUFLEET_EXAMPLE_SIZE, else real on a GPU, tiny without): `real` is Llama 3.2 3B as published
(LLAMA_3_2_3B below) with random weights, on chats of the standard library's source at 2048
tokens (see real.py). Unsloth reads a model only from a folder of weights, so the weights are
materialised once on the GPU and saved there (6.4 GB) before the ranks start. `tiny` is the
two-layer model of tiny.py.

Unsloth loads the model with its own fused kernels (RoPE, RMSNorm, cross-entropy) and patches
TRL's SFTTrainer, so it is imported before transformers and TRL in each rank. Each rank loads
the whole model in bf16 onto its own GPU (`device_map` by LOCAL_RANK, which gpufleet sets) and the
Trainer wraps it in DDP. LoRA with r=16 goes on every attention and MLP projection. Unsloth's
default gradient checkpointing ("unsloth", which offloads activations to the CPU) is
reentrant, which DDP does not support: DDP needs the standard non-reentrant checkpointing
(`use_reentrant=False`). Every adapter is used every step, so DDP need not look for unused
parameters. Rank 0 saves the
adapter; the script loads it on the base model and generates a few tokens. With MLflow
installed the Trainer's metrics go into the MLflow run gpufleet creates for the call.
gpufleet's Trainer callback turns a SIGTERM into a checkpoint in the output folder and a clean
stop; the same command run again resumes from it.

Needs `pip install unsloth` (which pins its own versions of transformers, TRL and datasets) and
NVIDIA GPUs. On a machine without them Unsloth trains on the CPU with its fallback (slowly, and
without its kernels). examples/hf/README.md says what ran where.

examples/notebooks/unsloth.ipynb calls the same `train` from a notebook, with
`log_model="model"`: rank 0 then logs the trained model into the call's MLflow run (MLflow's
transformers flavour), and the notebook loads it back from there and generates.
"""

import time

from gpufleet import distributed, runtime

import recipe

# meta-llama/Llama-3.2-3B config.json (unsloth/Llama-3.2-3B-Instruct is the same
# architecture): 3.21B parameters, the input embedding tied to the output layer.
LLAMA_3_2_3B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 128000,
    "eos_token_id": 128001, "head_dim": 128, "hidden_act": "silu", "hidden_size": 3072,
    "initializer_range": 0.02, "intermediate_size": 8192, "max_position_embeddings": 131072,
    "mlp_bias": False, "num_attention_heads": 24, "num_hidden_layers": 28,
    "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "use_cache": True, "vocab_size": 128256,
}
LORA = dict(r=16, lora_alpha=16, lora_dropout=0.0, bias="none",
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                            "down_proj"])


@distributed(env={**recipe.NO_TELEMETRY, "UNSLOTH_DISABLE_STATISTICS": "1"})
def train(model_path: str, dataset_path: str, output_dir: str, max_steps: int,
          learning_rate: float, max_length: int, report_to: str,
          log_model: str | None = None, measure: bool = False) -> dict:
    # log_model: the name under which rank 0 logs the trained model into the call's MLflow
    # run (the notebooks in examples/notebooks do); None: not logged. measure: a checkpoint at
    # the last step, flushed to disk, and its restore, timed (benchmarks/real_sizes.py).
    from unsloth import FastLanguageModel  # first: it patches transformers and TRL on import

    from trl import SFTConfig, SFTTrainer

    from gpufleet.integrations.huggingface import GpufleetCallback, last_checkpoint

    begun = recipe.begin()
    model, tokenizer = FastLanguageModel.from_pretrained(
        model_name=model_path,
        max_seq_length=max_length,
        dtype=None,  # bf16 where the GPU has it
        load_in_4bit=False,  # 16-bit LoRA: the 3B model fits every GPU whole
        device_map={"": runtime.get_local_rank()} if recipe.on_gpu() else "cpu",
    )
    model = FastLanguageModel.get_peft_model(model, **LORA, use_gradient_checkpointing=True,
                                             random_state=0)
    config = SFTConfig(
        output_dir=output_dir,
        max_steps=max_steps,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        learning_rate=learning_rate,
        lr_scheduler_type="linear",
        warmup_steps=0.05,
        optim="adamw_torch",
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        ddp_find_unused_parameters=False,
        max_length=max_length,
        logging_steps=1,
        include_num_input_tokens_seen=True,  # for tokens/s
        # the final adapter, saved below (and a checkpoint if stopped); measure: one at the end
        save_strategy="steps" if measure else "no",
        save_steps=max_steps,
        report_to=recipe.report_to(report_to),
        **recipe.precision(),
    )
    fleet = GpufleetCallback()  # heartbeats, metrics to the call, save-and-stop on SIGTERM
    trainer = SFTTrainer(model=model, args=config, processing_class=tokenizer,
                         train_dataset=recipe.load_chat_dataset(dataset_path),
                         callbacks=[fleet, *recipe.measuring(durable=measure)])
    # A run that was stopped resumes from its last checkpoint in output_dir (None: from the start).
    trainer.train(resume_from_checkpoint=last_checkpoint(output_dir))
    if fleet.stopped:  # SIGTERM: a checkpoint was saved in output_dir for the next run
        return recipe.rank_result(begun, trainer, status="stopped")
    trainer.save_model()  # rank 0 writes the adapter and the tokenizer
    return recipe.rank_result(begun, trainer, restore=measure,
                              logged_model=recipe.log_model(begun, trainer, log_model))


def arguments(argv: list[str] | None = None):
    """The command line (`argv`, else the script's), with the stand-ins of --size built."""
    parser = recipe.command_line(__doc__, model="unsloth/Llama-3.2-3B-Instruct",
                                 output_dir="unsloth_ddp", max_steps=60, tiny_steps=30,
                                 learning_rate=2e-4, tiny_learning_rate=3e-3)
    # Unsloth loads from a folder of weights only: the stand-in's are saved
    return recipe.parse(parser, "llama", argv, published=LLAMA_3_2_3B, weights=True)


if __name__ == "__main__":
    args = arguments()
    started = time.monotonic()
    results = train.options(gpus=args.gpus).distributed(
        args.model, args.dataset, args.output_dir, args.max_steps, args.learning_rate,
        args.max_length, args.report_to)
    recipe.summarize(results, time.monotonic() - started)
