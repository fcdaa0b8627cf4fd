"""Fine-tune GPT-OSS 120B with LoRA and TRL's SFTTrainer, sharded with FSDP2 over every GPU here.

    python examples/hf/trl_sft_fsdp.py --model openai/gpt-oss-120b --dataset chats.jsonl
    python examples/hf/trl_sft_fsdp.py --model /models/gpt-oss-120b --dataset chats.jsonl --gpus 8
    python examples/hf/trl_sft_fsdp.py --size real     # GPT-OSS 120B's first 4 layers: 1 GPU
    python examples/hf/trl_sft_fsdp.py --size tiny     # a two-layer GPT-OSS: CPU, ~25 s

Without --model it trains a stand-in built here (no download), of `--size` (default:
$GPUFLEET_EXAMPLE_SIZE, else real on a GPU, tiny without): `real` is GPT-OSS 120B as published
(GPT_OSS_120B below) with random weights, on chats of the standard library's source at 2048
tokens (see real.py), cut to its first `--layers` decoder layers (default 4: what one 80 GB GPU
holds with the adapters on every expert; docs/real-sizes.md has the arithmetic). Each rank
materialises the stand-in whole on its GPU before FSDP shards it, so the stand-in is for cuts
that fit one GPU; the whole 120B (36 layers, 234 GB in bf16) needs 4 or more GPUs and a
checkpoint, which local rank 0 reads into host memory and FSDP hands out in shards.
`tiny` is the two-layer model of tiny.py.

At bf16 the 120B model is about 230 GB: more than one GPU holds, so it is sharded. The Trainer
gets FSDP through its own `fsdp` / `fsdp_config` arguments (version 2: `fully_shard`); the unit
of sharding is the model's decoder layer, whose class is read off the model (built on the meta
device) rather than written down, so the same code shards any architecture. Each layer's
parameters are gathered for its forward and backward and freed after
(`reshard_after_forward`), activations are recomputed in the backward pass (non-reentrant
activation checkpointing), compute is bf16 on GPU. Only local rank 0 reads the checkpoint from
disk (`cpu_ram_efficient_loading`); the others get their shards from it, so host memory holds
one copy of the weights rather than one per GPU.

LoRA with r=32 and alpha 64 goes on the attention projections and, through PEFT's
`target_parameters`, on the experts' weights (`gate_up_proj`, `down_proj`: tensors of every
expert, not linear layers), so the mixture of experts adapts as well. The adapter is gathered
from the shards and saved by rank 0 (`FULL_STATE_DICT`); the script then loads it on top of the
base model and generates a few tokens. With MLflow installed the Trainer's metrics go into the
MLflow run gpufleet creates for the call. gpufleet's Trainer callback turns a SIGTERM into a
checkpoint in the output folder (the sharded model's and optimizer's state) and a clean stop;
the same command run again resumes from it. Needs `pip install -e ".[hf]"`.

examples/notebooks/trl_sft_fsdp.ipynb calls the same `train` from a notebook, with
`log_model="model"`: rank 0 then logs the trained model into the call's MLflow run (MLflow's
transformers flavour), and the notebook loads it back from there and generates.
"""

import os
import time

from gpufleet import distributed, runtime

import recipe

# openai/gpt-oss-120b config.json, less its quantization_config (MXFP4 experts): the stand-in
# trains in bf16, as the checkpoint does once dequantized. 116.8B parameters, 5.1B active.
GPT_OSS_120B = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
    "attention_bias": True, "attention_dropout": 0.0, "eos_token_id": 200002,
    "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
    "initial_context_length": 4096, "initializer_range": 0.02, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 18,
    "max_position_embeddings": 131072, "num_attention_heads": 64, "num_experts_per_tok": 4,
    "num_hidden_layers": 36, "num_key_value_heads": 8, "num_local_experts": 128,
    "output_router_logits": False, "pad_token_id": 199999, "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                     "original_max_position_embeddings": 4096, "rope_type": "yarn",
                     "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128,
    "swiglu_limit": 7.0, "tie_word_embeddings": False, "use_cache": True, "vocab_size": 201088,
}
ONE_GPU_LAYERS = 4  # the real-size stand-in's cut (docs/real-sizes.md: why 4 on 80 GB)

LORA = dict(r=32, lora_alpha=64, lora_dropout=0.0, task_type="CAUSAL_LM",
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
# What `accelerate launch --use_fsdp` would export: with them, from_pretrained reads the weights
# on local rank 0 only and leaves the other ranks' models empty (meta) until FSDP hands out shards.
FSDP_LOADING = {"ACCELERATE_USE_FSDP": "true", "FSDP_CPU_RAM_EFFICIENT_LOADING": "true"}


def decoder_layer_class(model_path: str) -> str:
    """The class name of the model's repeated decoder layer, FSDP's unit of sharding, read off
    the model built on the meta device (no memory, no weights read)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    return type(model.get_decoder().layers[0]).__name__


@distributed(env={**recipe.NO_TELEMETRY, **FSDP_LOADING})
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
    layer = decoder_layer_class(model_path)
    # A checkpoint is read by local rank 0 alone and handed out in shards; random weights are
    # made on each rank's GPU, where FSDP shards them in place.
    from_disk = recipe.has_weights(model_path)
    os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = str(from_disk).lower()
    config = SFTConfig(  # first: it starts the process group that from_pretrained's loading needs
        output_dir=output_dir,
        max_steps=max_steps,
        # one sequence per micro-batch: at 2048 tokens the logits over GPT-OSS's 201k-token
        # vocabulary alone take 4 GB (bf16, with their fp32 loss and gradient 8 GB more)
        per_device_train_batch_size=1,
        gradient_accumulation_steps=2,
        learning_rate=learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=0.03,
        fsdp=True,
        fsdp_config={
            "version": 2,
            "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "transformer_layer_cls_to_wrap": [layer],
            "reshard_after_forward": True,
            "cpu_ram_efficient_loading": from_disk,
            "state_dict_type": "FULL_STATE_DICT",  # save_model() gathers the adapter on rank 0
        },
        # Activation checkpointing by the model's own layers rather than fsdp_config's: FSDP's
        # wrapper renames every layer's modules, and PEFT 0.21, which finds the adapter's
        # weights by module name, would then save an empty adapter.
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        max_length=max_length,
        logging_steps=1,
        include_num_input_tokens_seen=True,  # for tokens/s
        # the final adapter, saved below (and a checkpoint if stopped); measure: one at the end
        save_strategy="steps" if measure else "no",
        save_steps=max_steps,
        report_to=recipe.report_to(report_to),
        **recipe.precision(),
    )
    model = recipe.load_model(
        model_path, None if from_disk or not recipe.on_gpu() else runtime.get_local_rank())
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    recipe.fsdp_on_cpu()
    fleet = GpufleetCallback()  # heartbeats, metrics to the call, save-and-stop on SIGTERM
    trainer = SFTTrainer(model=model, args=config, processing_class=tokenizer,
                         train_dataset=recipe.load_chat_dataset(dataset_path),
                         peft_config=LoraConfig(**LORA),
                         callbacks=[fleet, *recipe.measuring(durable=measure)])
    # A run that was stopped resumes from its last checkpoint in output_dir (None: from the start).
    trainer.train(resume_from_checkpoint=last_checkpoint(output_dir))
    if fleet.stopped:  # SIGTERM: a checkpoint was saved in output_dir for the next run
        return recipe.rank_result(begun, trainer, status="stopped", decoder_layer=layer,
                                  sharded=recipe.sharded_parameters(trainer.model))
    trainer.save_model()  # every rank takes part in the gather; rank 0 writes
    return recipe.rank_result(begun, trainer, restore=measure, decoder_layer=layer,
                              sharded=recipe.sharded_parameters(trainer.model),
                              logged_model=recipe.log_model(begun, trainer, log_model))


def arguments(argv: list[str] | None = None):
    """The command line (`argv`, else the script's), with the stand-ins of --size built."""
    parser = recipe.command_line(__doc__, model="openai/gpt-oss-120b", output_dir="trl_sft_fsdp",
                                 max_steps=100, tiny_steps=30, learning_rate=2e-4,
                                 tiny_learning_rate=3e-3, real_layers=ONE_GPU_LAYERS)
    return recipe.parse(parser, "gpt_oss", argv, published=GPT_OSS_120B)


if __name__ == "__main__":
    args = arguments()
    started = time.monotonic()
    results = train.options(gpus=args.gpus).distributed(
        args.model, args.dataset, args.output_dir, args.max_steps, args.learning_rate,
        args.max_length, args.report_to)
    print(f"FSDP2 units: {results[0]['decoder_layer']}; parameters sharded on every rank: "
          f"{all(r['sharded'] for r in results)}")
    assert all(r["sharded"] for r in results), "the Trainer did not shard the model with FSDP"
    recipe.summarize(results, time.monotonic() - started)
