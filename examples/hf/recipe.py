"""What the Hugging Face fine-tuning examples share: their command line, the model and data
they start from (a real checkpoint and data set, or stand-ins: `--size real`, the published
architecture with random weights and the standard library's source, from real.py; `--size
tiny`, a two-layer model of it and generated chats, from tiny.py), what each rank returns, and
the check after training that the saved output loads and generates.

The examples import this module in the caller and, inside their `@distributed` functions, in
the ranks (gpufleet gives the ranks the caller's import path).
"""

import argparse
import importlib.util
import inspect
import json
import math
import os
import time
from pathlib import Path

# Neither MLflow nor the Hugging Face hub may phone home from the ranks (they may have no
# network at all); @distributed(env=NO_TELEMETRY) sets these in every rank.
NO_TELEMETRY = {"MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "1",
                "HF_HUB_DISABLE_TELEMETRY": "1"}
PROMPT = "What is 7 plus 5?"  # the question the saved model answers after training
NEW_TOKENS = 8
SIZES = ("real", "tiny")
# The stand-ins' size when --size is not given: real on a machine with a GPU, tiny without.
SIZE_VARIABLE = "GPUFLEET_EXAMPLE_SIZE"


def command_line(doc: str, *, model: str, output_dir: str, max_steps: int, tiny_steps: int,
                 learning_rate: float, tiny_learning_rate: float, max_length: int = 1024,
                 tiny_max_length: int | None = None, real_steps: int = 30,
                 real_learning_rate: float = 1e-3, real_max_length: int = 2048,
                 real_layers: int | None = None) -> argparse.ArgumentParser:
    """The options every example has; an example adds its own before `parse(parser)`. `model`:
    the checkpoint the example fine-tunes (named in --model's help); the defaults of steps,
    learning rate and length are per start: a checkpoint (`max_steps`, ...), the real-size
    stand-in (`real_*`; `real_layers`: its cut, None for every layer) or the tiny one."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--model", default=None,
                        help=f"hub name or local folder of the checkpoint, e.g. {model} (default: "
                             "a stand-in of --size built here; a folder holding only a "
                             "config.json and a tokenizer: random weights of that architecture)")
    parser.add_argument("--dataset", default=None,
                        help="chat data set with a `messages` column: a .jsonl/.json/.parquet "
                             "file, a `save_to_disk` folder, or a hub name")
    parser.add_argument("--size", choices=SIZES, default=None,
                        help="without --model, the stand-in built here (no download): real, the "
                             "published architecture with random weights, on chats of the "
                             "standard library's source; tiny, a two-layer model of it on "
                             f"generated chats, for CPUs (default: ${SIZE_VARIABLE}, else real "
                             "where there is a GPU, tiny where there is none)")
    parser.add_argument("--tiny", dest="size", action="store_const", const="tiny",
                        help="the same as --size tiny")
    parser.add_argument("--layers", type=int, default=None,
                        help="--size real: keep the first N decoder layers (default: "
                             f"{real_layers or 'all'})")
    parser.add_argument("--output-dir", default=output_dir,
                        help=f"where the trained model goes (default: ./{output_dir})")
    parser.add_argument("--max-steps", type=int, default=None,
                        help=f"optimizer steps (default: {max_steps}; --size real: {real_steps}; "
                             f"--size tiny: {tiny_steps})")
    parser.add_argument("--learning-rate", type=float, default=None,
                        help=f"peak learning rate (default: {learning_rate:g}; --size real: "
                             f"{real_learning_rate:g}, tiny: {tiny_learning_rate:g}, for weights "
                             "that start random)")
    tiny_max_length = tiny_max_length or max_length
    parser.add_argument("--max-length", type=int, default=None,
                        help=f"tokens per sequence (default: {max_length}; --size real: "
                             f"{real_max_length}; tiny: {tiny_max_length}); longer examples are "
                             "truncated")
    parser.add_argument("--gpus", type=int, default=None,
                        help="processes, one per GPU (default: every GPU; 2 CPU processes without)")
    parser.add_argument("--report-to", default="auto",
                        help="Trainer's report_to; auto (the default): mlflow when gpufleet tracks "
                             "the call in MLflow (the Trainer logs into the call's run), none when "
                             "it does not (no MLflow store of the Trainer's own); with none, "
                             "gpufleet's callback logs the metrics into the call's run")
    parser.set_defaults(defaults={
        "checkpoint": dict(max_steps=max_steps, learning_rate=learning_rate, max_length=max_length),
        "real": dict(max_steps=real_steps, learning_rate=real_learning_rate,
                     max_length=real_max_length, layers=real_layers),
        "tiny": dict(max_steps=tiny_steps, learning_rate=tiny_learning_rate,
                     max_length=tiny_max_length)})
    return parser


def default_size(parser: argparse.ArgumentParser | None = None) -> str:
    """The stand-ins' size when none is asked for: $GPUFLEET_EXAMPLE_SIZE, else real on a
    machine with a GPU and tiny without (CPUs: CI, a laptop)."""
    chosen = os.environ.get(SIZE_VARIABLE, "").strip().lower()
    if chosen and chosen not in SIZES:
        message = (f"{SIZE_VARIABLE}={os.environ[SIZE_VARIABLE]!r} is not a size: set it to "
                   f"{' or '.join(SIZES)}, or unset it (real with a GPU, tiny without)")
        if parser is None:
            raise ValueError(message)
        parser.error(message)
    return chosen or ("real" if on_gpu() else "tiny")


def parse(parser: argparse.ArgumentParser, architecture: str,
          argv: list[str] | None = None, *, published: dict | None = None,
          weights: bool = False) -> argparse.Namespace:
    """Parse the command line (`argv`, else the script's). Without --model, build the stand-ins
    of --size under OUTPUT_DIR/SIZE and point --model and --dataset at them: tiny.py's
    `architecture`, or real.py's model of `published` (its config.json's values; with `weights`,
    its random weights saved too, for loaders that read only weights from a folder). Paths
    become absolute: the ranks get them as they are."""
    args = parser.parse_args(argv)
    if args.model is not None and args.size is not None:
        parser.error(f"--model {args.model} and --size {args.size} exclude each other: --model "
                     "trains that checkpoint, --size builds a stand-in")
    if args.model is None:
        args.size = args.size or default_size(parser)
    start = args.size or "checkpoint"
    for name, value in args.defaults[start].items():  # unset: the start's default
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    if args.layers is not None and (args.size != "real" or args.layers < 1):
        parser.error(f"--layers {args.layers}: a cut of the real-size stand-in, 1 or more "
                     "layers, with --size real")
    args.output_dir = str(Path(args.output_dir).resolve())
    if args.size == "tiny":
        import tiny

        args.model, args.dataset = tiny.build(architecture, Path(args.output_dir) / "tiny")
    elif args.size == "real":
        import real

        args.model, dataset = real.build(published, Path(args.output_dir) / "real",
                                         args.max_length, args.layers, weights)
        args.dataset = args.dataset or dataset
    elif args.dataset is None:
        parser.error(f"--model {args.model} needs --dataset (or leave --model out for a "
                     "stand-in of --size)")
    for name in ("model", "dataset"):  # local paths absolute; hub names as they are
        if Path(getattr(args, name)).exists():
            setattr(args, name, str(Path(getattr(args, name)).resolve()))
    return args


def argv(tiny: bool = False, **options) -> list[str]:
    """The command line for these options, for a notebook: `argv(size="tiny", max_steps=20)`
    is `["--size", "tiny", "--max-steps", "20"]` (`tiny=True`: `--tiny`); an option whose
    value is None is left out (its default)."""
    line = ["--tiny"] if tiny else []
    for name, value in options.items():
        if value is not None:
            line += ["--" + name.replace("_", "-"), str(value)]
    return line


def report_to(choice: str) -> str:
    """On a rank: the Trainer's report_to for --report-to CHOICE. gpufleet hands a tracked
    call's MLflow run to every rank as MLFLOW_RUN_ID; without it (MLflow not installed, or
    tracking off) the Trainer's MLflow callback would make a store in the working folder."""
    if choice != "auto":
        return choice
    return "mlflow" if os.environ.get("MLFLOW_RUN_ID") else "none"


def on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def load_chat_dataset(path: str, eval_fraction: float = 0.0, seed: int = 0):
    """The data set at `path` (see --dataset); with eval_fraction, a (train, eval) split of
    it, the same on every rank."""
    from datasets import load_dataset, load_from_disk

    source = Path(path)
    if source.is_dir() and (source / "dataset_info.json").exists():
        dataset = load_from_disk(path)
    elif source.is_file():
        kind = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}[source.suffix]
        dataset = load_dataset(kind, data_files=path, split="train")
    else:
        dataset = load_dataset(path, split="train")
    if not eval_fraction:
        return dataset
    split = dataset.train_test_split(test_size=eval_fraction, seed=seed)
    return split["train"], split["test"]


def model_options(model: str) -> dict:
    """`from_pretrained` keywords for `model`: bf16 on GPU (fp32 on CPU, where bf16 matrix
    products are slow); for GPT-OSS, eager attention (its attention sinks are not in SDPA)
    and its MXFP4 expert weights dequantized to bf16, since LoRA trains on unquantized ones."""
    import torch
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model)
    options = {"dtype": torch.bfloat16 if on_gpu() else torch.float32, "use_cache": False}
    if config.model_type == "gpt_oss":
        options["attn_implementation"] = "eager"
        quantization = getattr(config, "quantization_config", None) or {}
        if quantization.get("quant_method") == "mxfp4":
            from transformers import Mxfp4Config

            options["quantization_config"] = Mxfp4Config(dequantize=True)
    return options


def has_weights(model_path: str) -> bool:
    """False for a local folder that holds a configuration but no weights: a real-size
    stand-in, whose random weights the ranks make (load_model)."""
    folder = Path(model_path)
    return not folder.is_dir() or any(folder.glob("*.safetensors")) or any(folder.glob("*.bin"))


def load_model(model_path: str, device=None):
    """The model to fine-tune, in the precision of model_options(): the checkpoint at
    `model_path` (on `device` when given, straight from disk), or for a folder without weights
    a random model of its configuration, built on the meta device and materialised on `device`
    (real.materialise; the CPU when None), never whole in host memory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    options = model_options(model_path)
    if has_weights(model_path):
        if device is not None:
            options["device_map"] = {"": device}
        return AutoModelForCausalLM.from_pretrained(model_path, **options)
    import real

    return real.materialise(AutoConfig.from_pretrained(model_path), options, device)


def measuring(durable: bool = False) -> list:
    """The Trainer callback that times this run (meter.Meter: tokens/s, time to the first step,
    peak GPU memory, checkpoint saves; `durable`: each save flushed to disk and timed so), in a
    list for `callbacks=`."""
    import meter

    return [meter.Meter(durable=durable)]


def precision() -> dict:
    """TrainingArguments keywords for this machine: bf16 on GPU; fp32 on CPU (TRL's default is
    bf16, which CPUs without bf16 units emulate slowly), with gloo for the process group."""
    return {"bf16": True} if on_gpu() else {"bf16": False, "use_cpu": True}


# Accelerate, which the Trainer runs on, turns FSDP and DeepSpeed on only for accelerators:
# without a GPU the Trainer quietly falls back to DDP (FSDP), or counts one process per world
# (DeepSpeed). fsdp_on_cpu() and deepspeed_precision() let a CPU run (a laptop, CI) shard with
# gloo as the GPU run does, so it tests the same code path. On GPUs they change nothing.

def fsdp_on_cpu() -> None:
    """Call after the training arguments are made (they set up Accelerate's process state)
    and before the Trainer."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    state = PartialState()
    if state.distributed_type == DistributedType.MULTI_CPU:
        # The type Accelerate checks before it takes the FSDP plugin; the device stays the CPU
        # (set already) and the process group gloo (created already).
        state.distributed_type = DistributedType.MULTI_GPU


def deepspeed_precision() -> dict:
    """precision() for DeepSpeed: bf16 on GPU. On CPU fp32, and Accelerate's process state set
    up for DeepSpeed over gloo, which the training arguments then use as it is: call it in
    their keywords (`SFTConfig(..., **deepspeed_precision())`), so that it runs before them."""
    if on_gpu():
        return {"bf16": True}
    import torch.distributed as dist
    from accelerate.state import PartialState

    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"  # what `accelerate launch` would export
    state = PartialState()  # DeepSpeed's CPU accelerator starts the gloo process group
    # Accelerate takes the missing CUDA backend for a world of one process: correct the count.
    state.backend = dist.get_backend()
    state.num_processes, state.process_index = dist.get_world_size(), dist.get_rank()
    state.local_process_index = int(os.environ["LOCAL_RANK"])
    return {"bf16": False, "accelerator_config": {"use_configured_state": True}}


def sharded_parameters(model) -> bool:
    """True when FSDP2 holds the model's parameters as shards (DTensors) on this rank."""
    from torch.distributed.tensor import DTensor

    return all(isinstance(p, DTensor) for p in model.parameters())


def logged_losses(log_history: list[dict]) -> list[tuple[int, float]]:
    """(step, training loss) as the Trainer logged it: the mean over every rank since the
    previous log, so the same list on every rank."""
    return [(entry["step"], entry["loss"]) for entry in log_history if "loss" in entry]


def begin() -> dict:
    """Called first thing in a rank: the clock and the MLflow run, read before the Trainer's
    MLflow callback ends the run at the end of training (which also clears MLFLOW_RUN_ID)."""
    return {"started": time.monotonic(), "mlflow_run": os.environ.get("MLFLOW_RUN_ID")}


def rank_result(begun: dict, trainer, restore: bool = False, **extra) -> dict:
    """What each rank returns: its status, the loss at the start and the end, where the model
    went, the world the Trainer trained in, the MLflow run it logged into (None when
    untracked), its time in seconds and its timings (meter.summary). `restore`: load the last
    checkpoint back and time it (every rank together)."""
    from gpufleet import runtime

    import meter

    losses = logged_losses(trainer.state.log_history)
    timings = meter.summary(trainer, trainer.args.world_size)
    if restore and timings and timings["saves"]:
        timings["restore_s"] = meter.restore_seconds(trainer, timings["saves"][-1]["folder"])
    extra.setdefault("timings", timings)
    return {"rank": runtime.get_global_rank(), "status": "ok",
            "first_loss": losses[0][1] if losses else math.nan,
            "final_loss": losses[-1][1] if losses else math.nan, "losses": losses,
            "output_dir": trainer.args.output_dir, "world_size": trainer.args.world_size,
            "strategy": str(trainer.accelerator.distributed_type).split(".")[-1],
            "mlflow_run": begun["mlflow_run"],
            "seconds": round(time.monotonic() - begun["started"], 1), **extra}


def load_saved(output_dir: str, on_cpu: bool = False):
    """(model, tokenizer) as training saved them in output_dir: a whole model, or a LoRA
    adapter on top of the base model it names (a PEFT model). In bf16 on the GPUs, unless
    `on_cpu` or there are none."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    options = {"dtype": torch.bfloat16, "device_map": "auto"} if on_gpu() and not on_cpu else {}
    if (Path(output_dir) / "adapter_config.json").exists():
        from peft import AutoPeftModelForCausalLM

        model = AutoPeftModelForCausalLM.from_pretrained(output_dir, **options)
    else:
        model = AutoModelForCausalLM.from_pretrained(output_dir, **options)
    return model, AutoTokenizer.from_pretrained(output_dir)


def generate(output_dir: str, prompt: str = PROMPT, new_tokens: int = NEW_TOKENS) -> str:
    """Load what training saved in output_dir (load_saved) and answer `prompt` greedily. Runs
    in the caller, after the ranks."""
    import torch

    model, tokenizer = load_saved(output_dir)
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                           add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True).to(model.device)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1]:])


def log_model(begun: dict, trainer, name: str | None) -> str | None:
    """On rank 0, once the Trainer saved: log what it saved in its output folder into the
    call's MLflow run with MLflow's transformers flavour, as a text-generation model named
    `name`, and return its URI, `runs:/<run id>/<name>` (`mlflow.transformers.load_model`
    takes it). A LoRA adapter goes as a PEFT model: MLflow stores the adapter and refers to
    the base model by its hub name, or by its folder when it is a local one. None on the other
    ranks, when `name` is None, or when the call has no MLflow run (MLflow missing, or
    tracking off)."""
    from gpufleet import runtime

    if name is None or runtime.get_global_rank() != 0:
        return None
    if not has_weights(base_model(trainer.args.output_dir)):
        print("the model is not logged: its base model's weights were made in the ranks and "
              "never saved (a real-size stand-in)", flush=True)
        return None
    run_id = begun["mlflow_run"]
    if run_id is None:
        why = "tracking is off" if importlib.util.find_spec("mlflow") else "MLflow is not installed"
        print(f"the model is not logged: this call has no MLflow run ({why})", flush=True)
        return None
    import mlflow
    from transformers.integrations import deepspeed

    # Read back whole (FSDP and ZeRO-3 trained it in shards), on the CPU: MLflow only writes it
    # out. Not into ZeRO-3 partitions, which would wait for the other ranks.
    zero3 = getattr(trainer.args, "hf_deepspeed_config", None)
    deepspeed.unset_hf_deepspeed_config()
    try:
        model, tokenizer = load_saved(trainer.args.output_dir, on_cpu=True)
    finally:
        if zero3 is not None:
            deepspeed.set_hf_deepspeed_config(zero3)
    accepts = inspect.signature(mlflow.transformers.log_model).parameters
    options = {"name" if "name" in accepts else "artifact_path": name}  # MLflow 3, MLflow 2
    adapter = getattr(model, "peft_config", {}).get("default")
    if adapter is not None and Path(adapter.base_model_name_or_path).is_dir() \
            and "base_model_path" in accepts:  # a local base model: referred to, not copied
        options["base_model_path"] = adapter.base_model_name_or_path
    # By id: the Trainer's MLflow callback may have ended the run in this process.
    with mlflow.start_run(run_id=run_id):
        mlflow.transformers.log_model(
            {"model": model, "tokenizer": tokenizer}, task="text-generation",
            # What the model needs, named: otherwise MLflow loads it again in a new process
            # to find out which packages it imports.
            pip_requirements=pip_requirements(model), **options)
    print(f"logged the trained model into MLflow run {run_id} as {name!r}", flush=True)
    return f"runs:/{run_id}/{name}"


def pip_requirements(model) -> list[str]:
    """The packages a logged model needs, pinned to the installed versions: MLflow's default
    list for the transformers flavour. MLflow names torchvision in it for every torch model and
    fails where torchvision is not installed (common beside an LLM): the same list without it."""
    import mlflow.transformers

    try:
        return mlflow.transformers.get_default_pip_requirements(model)
    except ModuleNotFoundError as exc:
        if exc.name != "torchvision":
            raise
    from importlib.metadata import version

    names = ["transformers", "torch"] + ["accelerate"] * bool(importlib.util.find_spec("accelerate"))
    names += ["peft"] * hasattr(model, "peft_config")
    return [f"{name}=={version(name).split('+')[0]}" for name in names]


def report(results: list[dict], elapsed: float) -> None:
    """Print each rank's result and check that training did what it should: every rank in one
    world, and a falling loss. AssertionError otherwise."""
    for r in results:
        print(f"rank {r['rank']}: status {r['status']}, loss {r['first_loss']:.4f} -> "
              f"{r['final_loss']:.4f}, output {r['output_dir']}, mlflow run {r['mlflow_run']}")
    first = results[0]
    print(f"{len(results)} ranks ({first['strategy']}, world of {first['world_size']}), "
          f"{len(first['losses'])} logged steps, final loss {first['final_loss']:.4f}, "
          f"{elapsed:.1f} s")
    timings = first.get("timings") or {}
    if timings.get("tokens_per_s_per_gpu"):
        memory = (f"; peak GPU memory {timings['peak_allocated_gib']} GiB allocated, "
                  f"{timings['peak_reserved_gib']} GiB reserved"
                  if timings["peak_allocated_gib"] is not None else "")
        print(f"{timings['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU after the first steps"
              f"{memory}")
    assert [r["rank"] for r in results] == list(range(len(results))), results
    assert all(r["status"] == "ok" and r["world_size"] == len(results) for r in results), results
    assert first["final_loss"] < first["first_loss"], f"the loss did not fall: {first['losses']}"


def base_model(output_dir: str) -> str:
    """The model a saved LoRA adapter sits on (its folder or hub name), else output_dir."""
    adapter = Path(output_dir) / "adapter_config.json"
    if adapter.is_file():
        return json.loads(adapter.read_text())["base_model_name_or_path"]
    return output_dir


def summarize(results: list[dict], elapsed: float) -> None:
    """report(), then load the saved output and generate from it (not where an adapter sits on
    random weights that were never saved). Exits non-zero (AssertionError) when training did
    not do what it should."""
    report(results, elapsed)
    first = results[0]
    if not has_weights(base_model(first["output_dir"])):
        print(f"not generated from {first['output_dir']}: its base model's random weights were "
              "made in the ranks and not saved")
        return
    text = generate(first["output_dir"])
    print(f"generated from {first['output_dir']}: {PROMPT!r} -> {text!r}")
