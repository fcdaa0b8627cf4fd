"""Fully fine-tune Llama 3.2 1B with TRL's SFTTrainer and DeepSpeed ZeRO-3 on every GPU here.

    python examples/hf/trl_sft_deepspeed.py --model meta-llama/Llama-3.2-1B-Instruct --dataset chats.jsonl
    python examples/hf/trl_sft_deepspeed.py --model /models/llama-3.2-1b --dataset chats.jsonl
    python examples/hf/trl_sft_deepspeed.py --size real    # Llama 3.2 1B, random weights: 1 GPU
    python examples/hf/trl_sft_deepspeed.py --size tiny    # a two-layer Llama: CPU, ~35 s

Without --model it trains a stand-in built here (no download), of `--size` (default:
$GPUFLEET_EXAMPLE_SIZE, else real on a GPU, tiny without): `real` is Llama 3.2 1B as published
(LLAMA_3_2_1B below) with random weights, created inside DeepSpeed's `zero.Init` so that each
GPU only ever holds its partition, on chats of the standard library's source at 2048 tokens
(see real.py); `tiny` is the two-layer model of tiny.py.

Every weight trains (no adapter). ZeRO stage 3 partitions the parameters, their gradients and
the AdamW state across the ranks: each GPU holds 1/N of each and gathers a layer's weights
only while it computes with them, overlapping those transfers with compute (`overlap_comm`).
The DeepSpeed config is a plain dict handed to the Trainer; its batch size, accumulation and
clipping fields say "auto", so the Trainer's own arguments fill them in and the two cannot
disagree. Compute is bf16 on GPU, without offloading to the CPU. Because the training
arguments are made before the model, `from_pretrained` loads the checkpoint straight into
partitions (DeepSpeed's `zero.Init`) rather than whole on every rank. A tenth of the data set
is held out: every `--eval-steps` steps the Trainer computes the loss on it and saves a
checkpoint (DeepSpeed's partitioned files plus the optimizer state, so a run can resume), the
last two kept.

At the end the partitions are gathered into one 16-bit copy of the weights, which rank 0 saves
as an ordinary Hugging Face model; the script loads it and generates a few tokens. Every rank
returns its status, first and final training loss, last evaluation loss and the output folder.
With MLflow installed the Trainer's metrics go into the MLflow run gpufleet creates for the call.
gpufleet's Trainer callback turns a SIGTERM into one more checkpoint and a clean stop, and a
run started again (or retried) resumes from the last checkpoint in the output folder.
Needs `pip install -e ".[hf,deepspeed]"`. Without GPUs DeepSpeed runs on its CPU
accelerator, whose first start compiles a small extension (~30 s, once; cached under
$TORCH_EXTENSIONS_DIR).

examples/notebooks/trl_sft_deepspeed.ipynb calls the same `train` from a notebook, with
`log_model="model"`: rank 0 then logs the trained model into the call's MLflow run (MLflow's
transformers flavour), and the notebook loads it back from there and generates.
"""

import time
import warnings

from gpufleet import distributed

import recipe

DEEPSPEED = {
    "zero_optimization": {
        "stage": 3,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        # gather the partitions into a whole model when the Trainer saves one
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "bf16": {"enabled": "auto"},
    "gradient_clipping": "auto",
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
}
EVAL_FRACTION = 0.1
# meta-llama/Llama-3.2-1B config.json (the Instruct model's is the same architecture): 1.24B
# parameters, the input embedding tied to the output layer.
LLAMA_3_2_1B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 128000,
    "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 8192, "max_position_embeddings": 131072,
    "mlp_bias": False, "num_attention_heads": 32, "num_hidden_layers": 16,
    "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "use_cache": True, "vocab_size": 128256,
}


@distributed(env=recipe.NO_TELEMETRY)
def train(model_path: str, dataset_path: str, output_dir: str, max_steps: int,
          learning_rate: float, max_length: int, report_to: str, eval_steps: int,
          log_model: str | None = None, measure: bool = False) -> dict:
    # log_model: the name under which rank 0 logs the trained model into the call's MLflow
    # run (the notebooks in examples/notebooks do); None: not logged. measure: every
    # checkpoint flushed to disk and timed, and the last one restored, timed
    # (benchmarks/real_sizes.py).
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from gpufleet.integrations.huggingface import GpufleetCallback, last_checkpoint

    begun = recipe.begin()
    # DeepSpeed 0.19 gathers and reduces with collectives that torch 2.14 deprecates: without
    # this, a warning for every call, several per step, fills the log.
    warnings.filterwarnings("ignore", r"`torch\.distributed\.\w+` is deprecated", FutureWarning)
    config = SFTConfig(  # before the model: from_pretrained then loads into ZeRO-3 partitions
        output_dir=output_dir,
        deepspeed=DEEPSPEED,
        max_steps=max_steps,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=8,
        gradient_accumulation_steps=1,
        learning_rate=learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=0.05,
        max_grad_norm=1.0,
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        eval_strategy="steps",
        eval_steps=eval_steps,
        save_strategy="steps",
        save_steps=eval_steps,
        save_total_limit=2,
        max_length=max_length,
        logging_steps=1,
        include_num_input_tokens_seen=True,  # for tokens/s
        report_to=recipe.report_to(report_to),
        **recipe.deepspeed_precision(),  # bf16 on GPU
    )
    model = recipe.load_model(model_path)  # into ZeRO-3 partitions, read or random
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    train_set, eval_set = recipe.load_chat_dataset(dataset_path, EVAL_FRACTION)
    fleet = GpufleetCallback()  # heartbeats, metrics to the call, save-and-stop on SIGTERM
    trainer = SFTTrainer(model=model, args=config, processing_class=tokenizer,
                         train_dataset=train_set, eval_dataset=eval_set,
                         callbacks=[fleet, *recipe.measuring(durable=measure)])
    # A run that was stopped or failed resumes from its last checkpoint in output_dir (None:
    # from the start): the model's partitions, the optimizer's, the schedule and the data order.
    trainer.train(resume_from_checkpoint=last_checkpoint(output_dir))
    if not fleet.stopped:  # SIGTERM: a checkpoint was saved in output_dir for the next run
        trainer.save_model()  # every rank gathers its partitions; rank 0 writes the whole model
    evals = [entry["eval_loss"] for entry in trainer.state.log_history if "eval_loss" in entry]
    logged = None if fleet.stopped else recipe.log_model(begun, trainer, log_model)
    return recipe.rank_result(begun, trainer, status="stopped" if fleet.stopped else "ok",
                              restore=measure and not fleet.stopped, logged_model=logged,
                              eval_loss=evals[-1] if evals else None,
                              zero_stage=trainer.accelerator.state.deepspeed_plugin.zero_stage,
                              # ZeRO-3 replaced every parameter by its partition of it
                              partitioned=all(hasattr(p, "ds_id") for p in model.parameters()))


def arguments(argv: list[str] | None = None):
    """The command line (`argv`, else the script's), with the stand-ins of --size built."""
    parser = recipe.command_line(__doc__, model="meta-llama/Llama-3.2-1B-Instruct",
                                 output_dir="trl_sft_deepspeed", max_steps=60, tiny_steps=30,
                                 learning_rate=1e-5, tiny_learning_rate=3e-3,
                                 real_learning_rate=5e-4)
    parser.add_argument("--eval-steps", type=int, default=None,
                        help="evaluate and save a checkpoint every N steps (default: half the "
                             "steps, so twice a run)")
    args = recipe.parse(parser, "llama", argv, published=LLAMA_3_2_1B)
    args.eval_steps = args.eval_steps or max(1, args.max_steps // 2)
    return args


if __name__ == "__main__":
    args = arguments()
    started = time.monotonic()
    results = train.options(gpus=args.gpus).distributed(
        args.model, args.dataset, args.output_dir, args.max_steps, args.learning_rate,
        args.max_length, args.report_to, args.eval_steps)
    print(f"ZeRO stage {results[0]['zero_stage']}, parameters partitioned on every rank: "
          f"{all(r['partitioned'] for r in results)}, last eval loss {results[0]['eval_loss']:.4f}")
    assert all(r["zero_stage"] == 3 and r["partitioned"] for r in results), "not ZeRO-3"
    recipe.summarize(results, time.monotonic() - started)
