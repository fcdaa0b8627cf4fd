"""Fine-tune Olmo 3 7B with QLoRA through Axolotl's config and train entry point, one DDP process
per GPU of this machine.

    python examples/hf/axolotl_ddp.py --model allenai/Olmo-3-7B-Instruct --dataset chats.jsonl
    python examples/hf/axolotl_ddp.py --model /models/olmo-3-7b --dataset chats.jsonl --gpus 8
    python examples/hf/axolotl_ddp.py --size real  # Olmo 3 7B, random weights: 1 GPU
    python examples/hf/axolotl_ddp.py --size tiny  # a two-layer Olmo 3: ~1 min, CPU or GPU

Without --model it trains a stand-in built here (no download), of `--size` (default:
$GPUFLEET_EXAMPLE_SIZE, else real on a GPU, tiny without): `real` is Olmo 3 7B as published
(OLMO_3_7B below) with random weights, on chats of the standard library's source packed into
2048-token sequences (see real.py). Axolotl reads a model only from a folder of weights (and
quantizes it as it loads), so the weights are materialised once on the GPU and saved there
(14.6 GB) before the ranks start. `tiny` is the two-layer model of tiny.py.

Axolotl is driven by a config: the dict below is what an Axolotl YAML file holds, and the
rank function runs what `axolotl train config.yml` runs after `accelerate launch` has started
the processes: `load_cfg` (validation and defaults), `load_datasets` (chat-template
tokenization, done once, by the rank that first takes Axolotl's file lock in
`dataset_prepared_path`, while the others wait and then load what it saved there) and `train`.
gpufleet takes `accelerate launch`'s place: it starts one process per GPU with torchrun's
variables, and Axolotl's Trainer joins them as a DDP world.

QLoRA: the base model is quantized to 4-bit NF4 by bitsandbytes as it loads and stays frozen;
LoRA adapters (r=32) on every linear layer train in bf16 on top of it. Sample packing puts
several short conversations into each 2048-token sequence (SDPA keeps them from attending to
one another), so each step carries full sequences instead of padding. 16 steps, as the
original does. Rank 0 saves the adapter; the script loads it on the base model and generates a
few tokens. With MLflow installed the Trainer's metrics go into the MLflow run gpufleet creates
for the call. Axolotl sends usage telemetry unless told not to: AXOLOTL_DO_NOT_TRACK=1 is set
for every rank.

Without GPUs (a laptop, CI) it runs as 2 processes over gloo with the same config except for
what needs CUDA: LoRA in fp32 on a base model that is not quantized (bitsandbytes' 4-bit
kernels are CUDA's), with sample packing, the same data preparation and the same Trainer.

Needs `pip install axolotl==0.19.0` (which pins its own versions of torch, transformers, TRL
and peft; 0.19 is the last release for torch < 2.13). examples/hf/README.md says what ran
where.
"""

import os
import time
from pathlib import Path

from gpufleet import distributed

import recipe

NO_AXOLOTL_TELEMETRY = {"AXOLOTL_DO_NOT_TRACK": "1"}
# transformers 5.25 and newer load the Hub's kernels by default, through the `kernels` package
# at 0.19 or newer; Axolotl 0.19 pins kernels 0.16, so loading the model would fail. The
# Hub's kernels are downloads anyway: off unless the user turns them on, here (which loads
# the trained adapter to answer a question) and in the ranks.
os.environ.setdefault("USE_HUB_KERNELS", "NO")
HUB_KERNELS = {"USE_HUB_KERNELS": os.environ["USE_HUB_KERNELS"]}
# allenai/Olmo-3-1025-7B config.json (Olmo-3-7B-Instruct is the same architecture): 7.30B
# parameters, full multi-head attention (32 key/value heads), three sliding-window layers to
# one of full attention, YaRN on the full ones.
OLMO_3_7B = {
    "architectures": ["Olmo3ForCausalLM"], "model_type": "olmo3",
    "attention_bias": False, "attention_dropout": 0.0, "eos_token_id": 100257,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 11008,
    "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention",
                    "full_attention"] * 8,
    "max_position_embeddings": 65536, "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 32, "pad_token_id": 100277, "rms_norm_eps": 1e-06,
    "rope_scaling": {"attention_factor": 1.2079441541679836, "beta_fast": 32.0,
                     "beta_slow": 1.0, "factor": 8.0, "original_max_position_embeddings": 8192,
                     "rope_type": "yarn"},
    "rope_theta": 500000, "sliding_window": 4096, "tie_word_embeddings": False,
    "use_cache": True, "vocab_size": 100278,
}


def axolotl_config(model_path: str, dataset_path: str, output_dir: str, max_steps: int,
                   learning_rate: float, max_length: int, report_to: str,
                   gpu: bool = True, measure: bool = False) -> dict:
    """The Axolotl config, as its YAML file would hold it: QLoRA in bf16 on GPUs; without them
    (`gpu=False`) LoRA in fp32 on a base model that is not quantized. `measure`: a checkpoint
    at the last step, flushed to disk and timed, and its restore (benchmarks/real_sizes.py)."""
    return {
        "base_model": model_path,
        "load_in_4bit": gpu,
        "adapter": "qlora" if gpu else "lora",
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
        "bf16": "auto" if gpu else False,
        "gradient_checkpointing": True,
        "gradient_checkpointing_kwargs": {"use_reentrant": False},  # DDP and checkpointing
        "logging_steps": 1,
        "include_tokens_per_second": True,  # the Trainer counts tokens: for tokens/s
        "plugins": ["axolotl_meter.MeterPlugin"],  # the timings every example returns
        # Axolotl refuses save_steps beside save_strategy "no": both, or neither
        **({"save_strategy": "steps", "save_steps": max_steps} if measure else {"save_strategy": "no"}),
        "output_dir": output_dir,
        "use_mlflow": report_to,  # --report-to: auto, mlflow or none; train() decides on the rank
        "seed": 0,
    }


def config_for(args, measure: bool = False) -> dict:
    """axolotl_config() for the parsed command line (`arguments()`), for this machine."""
    return axolotl_config(args.model, args.dataset, args.output_dir, args.max_steps,
                          args.learning_rate, args.max_length, args.report_to,
                          gpu=recipe.on_gpu(), measure=measure)


def cpu_world() -> None:
    """Without GPUs: make Accelerate's process state a DDP world over gloo, as
    `accelerate launch --cpu` would, before Axolotl reads it. Axolotl creates that state
    without saying "CPU", and Accelerate then takes the missing GPU for a world of one process:
    every rank would prepare the data set and train alone."""
    import os

    from accelerate import PartialState
    from axolotl.utils import environment

    os.environ["ACCELERATE_USE_CPU"] = "true"  # `accelerate launch --cpu`: the Trainer's too
    PartialState(cpu=True)  # joins gpufleet's processes (torchrun's variables) with gloo
    # With more than one process load_cfg asks CUDA whether this rank's GPU can reach another's
    # (for NCCL); a CUDA build of torch on a machine without a driver raises instead of
    # answering. Without GPUs there is no peer access.
    environment.check_cuda_p2p_support = lambda: False


@distributed(env={**recipe.NO_TELEMETRY, **NO_AXOLOTL_TELEMETRY, **HUB_KERNELS})
def train(config: dict, log_model: str | None = None) -> dict:
    # log_model: the name under which rank 0 logs the trained model into the call's MLflow
    # run (examples/notebooks/axolotl.ipynb does); None: not logged.
    from axolotl.cli.config import load_cfg
    from axolotl.common.datasets import load_datasets
    from axolotl.train import train as axolotl_train
    from axolotl.utils.dict import DictDefault

    begun = recipe.begin()
    if isinstance(config["use_mlflow"], str):  # "auto" means mlflow when this call is tracked
        config = {**config, "use_mlflow": recipe.report_to(config["use_mlflow"]) == "mlflow"}
    if not recipe.on_gpu():
        cpu_world()
    cfg = load_cfg(DictDefault(config))
    if not recipe.on_gpu():
        # With more than one process Axolotl 0.19 places the model on the rank's GPU
        # ({"": LOCAL_RANK}, a CUDA index) whatever the device: here it stays on the CPU.
        cfg.device_map = {"": "cpu"}
    dataset_meta = load_datasets(cfg=cfg)
    # Trains, then rank 0 saves the adapter and tokenizer into output_dir.
    _, _, trainer = axolotl_train(cfg=cfg, dataset_meta=dataset_meta)
    # load_cfg wrote the config to a temporary YAML file, for the Trainer's callbacks
    Path(cfg.axolotl_config_path).unlink(missing_ok=True)
    # measure: the checkpoint at the last step loaded back; the adapter and the optimizer's
    # state are this rank's own (DDP), so no collective is needed after Axolotl's cleanup
    return recipe.rank_result(begun, trainer, restore=cfg.save_strategy == "steps",
                              quantized=bool(cfg.load_in_4bit),
                              sample_packing=bool(cfg.sample_packing),
                              logged_model=recipe.log_model(begun, trainer, log_model))


def arguments(argv: list[str] | None = None):
    """The command line (`argv`, else the script's), with the stand-ins of --size built."""
    parser = recipe.command_line(__doc__, model="allenai/Olmo-3-7B-Instruct",
                                 output_dir="axolotl_ddp", max_steps=16, tiny_steps=30,
                                 learning_rate=2e-4, tiny_learning_rate=3e-3, max_length=2048,
                                 tiny_max_length=512)
    # Axolotl loads (and quantizes) from a folder of weights only: the stand-in's are saved
    return recipe.parse(parser, "olmo3", argv, published=OLMO_3_7B, weights=True)


if __name__ == "__main__":
    args = arguments()
    started = time.monotonic()
    results = train.options(gpus=args.gpus).distributed(config_for(args))
    print(f"4-bit base model: {results[0]['quantized']}, sample packing: "
          f"{results[0]['sample_packing']}")
    recipe.summarize(results, time.monotonic() - started)
