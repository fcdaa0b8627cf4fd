"""Fine-tune GPT-OSS 20B with LoRA and TRL's SFTTrainer, one DDP process per GPU of this machine.

    python examples/hf/trl_sft_ddp.py --model openai/gpt-oss-20b --dataset chats.jsonl
    python examples/hf/trl_sft_ddp.py --model /models/gpt-oss-20b --dataset chats.jsonl --gpus 8
    python examples/hf/trl_sft_ddp.py --size real      # GPT-OSS 20B, random weights: 1 GPU, 80 GB
    python examples/hf/trl_sft_ddp.py --size tiny      # a two-layer GPT-OSS: CPU, ~25 s

Without --model it trains a stand-in built here (no download), of `--size` (default:
$GPUFLEET_EXAMPLE_SIZE, else real on a GPU, tiny without): `real` is GPT-OSS 20B as published
(GPT_OSS_20B below), with random weights built on the meta device and materialised on each
GPU, on chats of the standard library's source at 2048 tokens (see real.py); `tiny` is the
two-layer model of tiny.py.

The data set is chat conversations in a `messages` column (a JSON-lines file, a `save_to_disk`
folder or a hub name); TRL applies the tokenizer's chat template. The model is loaded whole on
every GPU in bf16 (its MXFP4 expert weights dequantized: about 42 GB) and wrapped in DDP by the
Trainer. LoRA with r=8 and alpha 16 goes on every linear layer: in GPT-OSS those are the
attention projections (the router and the experts hold their weights as plain tensors, and stay
frozen here; trl_sft_fsdp.py adapts the experts too). Only the adapters train, and their
gradients are all that DDP averages. Non-reentrant gradient checkpointing keeps the
activations small and works with DDP and frozen layers; the learning rate follows a cosine down
to a floor of a tenth of its peak; each GPU takes one conversation per micro-batch and two
micro-batches per optimizer step.

gpufleet starts one process per GPU and sets torchrun's variables, so the Trainer (through
Accelerate) joins them as a DDP world without a launcher of its own. With MLflow installed the
Trainer's metrics and arguments go into the MLflow run gpufleet creates for the call
(`--report-to none`: the metrics only, through gpufleet's callback). gpufleet's Trainer
callback also sends heartbeats, shows the loss on the status line, and turns a SIGTERM to the
script into a checkpoint in the output folder and a clean stop; the same command run again
resumes from it (`last_checkpoint`). Every rank returns its status, its first and final loss
and the output folder; rank 0 saves the adapter there, and the script then loads it on top of
the base model and generates a few tokens. Needs `pip install -e ".[hf]"`.

examples/notebooks/trl_sft_ddp.ipynb calls the same `train` from a notebook, with
`log_model="model"`: rank 0 then logs the trained model into the call's MLflow run (MLflow's
transformers flavour), and the notebook loads it back from there and generates.
"""

import time

from gpufleet import distributed, runtime

import recipe

# openai/gpt-oss-20b config.json, less its quantization_config (MXFP4 experts): the stand-in
# trains in bf16, as the checkpoint does once dequantized. 20.9B parameters, 3.6B active.
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
    "attention_bias": True, "attention_dropout": 0.0, "eos_token_id": 200002,
    "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
    "initial_context_length": 4096, "initializer_range": 0.02, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072, "num_attention_heads": 64, "num_experts_per_tok": 4,
    "num_hidden_layers": 24, "num_key_value_heads": 8, "num_local_experts": 32,
    "output_router_logits": False, "pad_token_id": 199999, "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                     "original_max_position_embeddings": 4096, "rope_type": "yarn",
                     "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128,
    "swiglu_limit": 7.0, "tie_word_embeddings": False, "use_cache": True, "vocab_size": 201088,
}
LORA = dict(r=8, lora_alpha=16, lora_dropout=0.05, target_modules="all-linear",
            task_type="CAUSAL_LM")
MIN_LR_RATE = 0.1  # the cosine schedule ends at this fraction of the peak learning rate


@distributed(env=recipe.NO_TELEMETRY)
def train(model_path: str, dataset_path: str, output_dir: str, max_steps: int,
          learning_rate: float, max_length: int, report_to: str,
          log_model: str | None = None, measure: bool = False) -> dict:
    # log_model: the name under which rank 0 logs the trained model into the call's MLflow
    # run (the notebooks in examples/notebooks do); None: not logged. measure: a checkpoint at
    # the last step, flushed to disk, and its restore, timed (benchmarks/real_sizes.py).
    from peft import LoraConfig
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from gpufleet.integrations.huggingface import GpufleetCallback, last_checkpoint

    begun = recipe.begin()
    # Straight onto this rank's GPU (read from disk, or random weights made there), never
    # whole in host memory.
    model = recipe.load_model(model_path, runtime.get_local_rank() if recipe.on_gpu() else None)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    config = SFTConfig(
        output_dir=output_dir,
        max_steps=max_steps,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=2,
        learning_rate=learning_rate,
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": MIN_LR_RATE},
        warmup_steps=0.03,  # a fraction of max_steps
        gradient_checkpointing=True,
        # Reentrant checkpointing needs inputs that require grad and breaks with DDP's hooks.
        gradient_checkpointing_kwargs={"use_reentrant": False},
        # Every adapter is used in every step: no search for unused parameters, which would
        # cost a traversal of the graph each step.
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
                         peft_config=LoraConfig(**LORA),
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
    parser = recipe.command_line(__doc__, model="openai/gpt-oss-20b", output_dir="trl_sft_ddp",
                                 max_steps=100, tiny_steps=30, learning_rate=2e-4,
                                 tiny_learning_rate=3e-3)
    return recipe.parse(parser, "gpt_oss", argv, published=GPT_OSS_20B)


if __name__ == "__main__":
    args = arguments()
    started = time.monotonic()
    results = train.options(gpus=args.gpus).distributed(
        args.model, args.dataset, args.output_dir, args.max_steps, args.learning_rate,
        args.max_length, args.report_to)
    recipe.summarize(results, time.monotonic() - started)
