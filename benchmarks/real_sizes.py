"""One row of the example table at its real size, trained the same way three ways, alternated:
through `@distributed` (as its notebook calls it), through `gpufleet run`, and through the
framework's own launcher (`accelerate launch` for the TRL and Axolotl rows, plain `python` for
Unsloth on one GPU, `torchrun` on more). Per way: tokens/s per GPU, MFU, peak GPU memory, time
from the command to the first step, the checkpoint save (time the step was blocked, time until
on disk), its restore, and the final loss.

    python benchmarks/real_sizes.py gpt-oss-20b --out benchmarks/results/real_sizes-1xH100
    python benchmarks/real_sizes.py llama-3.2-1b --size tiny --gpus 1 --steps 6 --out /tmp/rs

Rows: llama-3.2-1b (TRL, DeepSpeed ZeRO-3, full fine-tune), gpt-oss-20b (TRL, DDP, LoRA),
llama-3.2-3b (Unsloth, LoRA), olmo-3-7b (Axolotl, QLoRA), gpt-oss-120b (TRL, FSDP2, LoRA; its
first 4 layers on one GPU). Each way runs the example's own `train` (examples/hf) on the same
stand-in, built once before the first way: the published architecture with random weights and
chats of the standard library's source (`--size real`, the default on a GPU), or the tiny one
(`--size tiny`, the default without: to check this script on a CPU). No MLflow (tracking off,
`report_to` none in every way), so that only the launchers differ. Results: a table on stdout,
and `real_sizes-ROW.json` and `.md` in `--out`, with the GPU, date, versions and command.

MFU counts the model's FLOPs per token as a full fine-tune's 6 x N (forward 2N, backward 4N)
or LoRA's 4 x N (frozen weights get no weight gradient), N being the weights that multiply each
token (experts: the active share; not the input embedding unless tied to the output), plus
attention's 12 x layers x attended length x attention width; against a dense bf16 peak of
989 TFLOP/s for H100 and H200.
"""

import argparse
import importlib
import importlib.metadata
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples" / "hf"
WAYS = ("distributed", "gpufleet-run", "native")
PEAK_BF16 = {"H100": 989e12, "H200": 989e12}  # dense, per GPU (NVIDIA's data sheets, SXM)


@dataclass(frozen=True)
class Row:
    module: str  # the example in examples/hf
    launcher: str  # the framework's own: accelerate or python
    full_fine_tune: bool
    what: str


ROWS = {
    "llama-3.2-1b": Row("trl_sft_deepspeed", "accelerate", True,
                        "Llama 3.2 1B, TRL, DeepSpeed ZeRO-3, full fine-tune"),
    "gpt-oss-20b": Row("trl_sft_ddp", "accelerate", False, "GPT-OSS 20B, TRL, DDP, LoRA"),
    "llama-3.2-3b": Row("unsloth_ddp", "python", False, "Llama 3.2 3B, Unsloth, LoRA"),
    "olmo-3-7b": Row("axolotl_ddp", "accelerate", False, "Olmo 3 7B, Axolotl, QLoRA"),
    "gpt-oss-120b": Row("trl_sft_fsdp", "accelerate", False,
                        "GPT-OSS 120B (cut), TRL, FSDP2, LoRA"),
}


def example(row: Row):
    """The row's example module (examples/hf on the import path, as its script has it)."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    return importlib.import_module(row.module)


# ---- in the ranks and the callers the three ways start -------------------------------------

def positional(row: Row, args: dict) -> tuple:
    """The example's `train` arguments for its parsed command line, as its script passes them."""
    if row.module == "axolotl_ddp":
        return ()
    values = [args[k] for k in ("model", "dataset", "output_dir", "max_steps", "learning_rate",
                                "max_length", "report_to")]
    return (*values, args["eval_steps"]) if row.module == "trl_sft_deepspeed" else tuple(values)


def keywords(row: Row, module, args: dict) -> dict:
    if row.module == "axolotl_ddp":
        return {"config": module.config_for(argparse.Namespace(**args), measure=True)}
    return {"measure": True}


def way_main(way: str, name: str, args_file: str, result_file: str) -> None:
    """One way's process: `distributed` calls `train.distributed()` here; `rank` is one rank
    started by a launcher (gpufleet run, accelerate launch, torchrun, python), which calls
    `train` directly with the environment `@distributed(env=...)` gives its ranks."""
    row = ROWS[name]
    module = example(row)
    args = json.loads(Path(args_file).read_text())
    call = (positional(row, args), keywords(row, module, args))
    if way == "distributed":
        results = module.train.options(gpus=args["gpus"], tracking=False).distributed(
            *call[0], **call[1])
        result = results[0]
    else:
        os.environ.update(module.train.run_options.env)
        result = module.train(*call[0], **call[1])
        if int(os.environ.get("RANK", "0")) != 0:
            return
    Path(result_file).write_text(json.dumps(result, default=str))


# ---- the benchmark --------------------------------------------------------------------------

def prepare(name: str, size: str, steps: int | None, gpus: int, work: Path) -> dict:
    """Build the row's stand-in once (in a process of its own: the GPU it materialises weights
    on is free again after) and return the example's parsed arguments."""
    out = work / "args.json"
    line = [sys.executable, __file__, "_prepare", name, str(out), "--size", size,
            "--output-dir", str(work / "train"), "--report-to", "none", "--gpus", str(gpus)]
    line += ["--max-steps", str(steps)] if steps else []
    subprocess.run(line, check=True)
    return json.loads(out.read_text())


def prepare_main(name: str, out: str, argv: list[str]) -> None:
    row = ROWS[name]
    args = example(row).arguments(argv)
    if row.module == "trl_sft_deepspeed":
        args.eval_steps = args.max_steps  # one evaluation and checkpoint, after the last step
    args.gpus = args.gpus or 1
    Path(out).write_text(json.dumps(vars(args)))


def command(way: str, row: Row, name: str, gpus: int, files: tuple[Path, Path]) -> list[str]:
    entry = [__file__, "_way", "rank", name, *map(str, files)]
    if way == "distributed":
        return [sys.executable, __file__, "_way", "distributed", name, *map(str, files)]
    if way == "gpufleet-run":
        return [sys.executable, "-m", "gpufleet", "run", "--gpus", str(gpus), "--no-tracking",
                "--", *entry]
    if row.launcher == "python" and gpus == 1:
        return [sys.executable, *entry]
    if row.launcher == "python":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", str(gpus), *entry]
    if row.module == "trl_sft_deepspeed":  # TRL's way: accelerate's DeepSpeed launcher, on
        # the example's own DeepSpeed config (the Trainer gets the same dict)
        config = files[0].parent / "deepspeed.json"
        config.write_text(json.dumps(example(row).DEEPSPEED))
        mode = ["--use_deepspeed", "--deepspeed_config_file", str(config)]
    elif row.module == "trl_sft_fsdp":  # accelerate's FSDP launcher (a process group even for
        # one process: FSDP refuses to run without); the Trainer's fsdp_config sets the rest
        mode = ["--use_fsdp", "--fsdp_version", "2"]
    else:
        mode = ["--multi_gpu"] if gpus > 1 else []
    return [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(gpus),
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
            *mode, *entry]


def run_way(way: str, name: str, args: dict, work: Path, round_: int) -> dict:
    """Start one way and wait for it; its rank 0's result with the times seen from here."""
    row = ROWS[name]
    folder = work / f"{way}-{round_}"
    folder.mkdir(parents=True, exist_ok=True)
    # each way trains from the start into an output folder of its own
    way_args = {**args, "output_dir": str(folder / "train")}
    files = (folder / "args.json", folder / "result.json")
    files[0].write_text(json.dumps(way_args))
    line = command(way, row, name, args["gpus"], files)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(EXAMPLES), str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    started = time.time()
    with open(folder / "log.txt", "w") as log:
        status = subprocess.run(line, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    ended = time.time()
    result = json.loads(files[1].read_text()) if files[1].is_file() and status == 0 else {}
    return {"way": way, "round": round_, "command": shlex.join(line), "exit": status,
            "wall_s": round(ended - started, 1), "started": started, "log": str(folder / "log.txt"),
            "result": result}


def flops_per_token(model_folder: str, seq: int, full_fine_tune: bool) -> float:
    """Model FLOPs of one trained token (see the module's docstring)."""
    from transformers import AutoConfig

    real = example(Row("real", "", False, ""))
    config = AutoConfig.from_pretrained(model_folder)
    _, active = real.parameters(config)
    if not config.tie_word_embeddings:
        active -= config.vocab_size * config.hidden_size  # a lookup, not a product
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    width = config.num_attention_heads * head_dim
    window = getattr(config, "sliding_window", None) or seq
    kinds = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    attended = sum(min(seq, window) if kind == "sliding_attention" else seq for kind in kinds)
    return (6 if full_fine_tune else 4) * active + 12 * attended * width


def gpu_name() -> str:
    try:
        line = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return "no GPU"
    return line.splitlines()[0].strip() if line.strip() else "no GPU"


def peak_flops(gpu: str) -> float | None:
    return next((peak for model, peak in PEAK_BF16.items() if model in gpu), None)


def measures(run: dict, per_token: float, peak: float | None) -> dict:
    """The table's values of one way's run."""
    result, timings = run["result"], run["result"].get("timings") or {}
    rate = timings.get("tokens_per_s_per_gpu")
    save = (timings.get("saves") or [{}])[-1]
    begun = timings.get("first_step_begun")
    return {"way": run["way"], "round": run["round"], "exit": run["exit"], "wall_s": run["wall_s"],
            "tokens_per_s_per_gpu": rate,
            "mfu": round(per_token * rate / peak, 4) if rate and peak else None,
            "peak_allocated_gib": timings.get("peak_allocated_gib"),
            "peak_reserved_gib": timings.get("peak_reserved_gib"),
            "first_step_s": round(begun - run["started"], 1) if begun else None,
            "save_blocked_s": save.get("blocked_s"), "save_durable_s": save.get("durable_s"),
            "restore_s": timings.get("restore_s"),
            "first_loss": result.get("first_loss"), "final_loss": result.get("final_loss")}


COLUMNS = [("way", "way", "{}"), ("round", "round", "{}"), ("exit", "exit", "{}"),
           ("tokens/s/GPU", "tokens_per_s_per_gpu", "{:,.0f}"), ("MFU", "mfu", "{:.1%}"),
           ("peak alloc GiB", "peak_allocated_gib", "{:.1f}"),
           ("peak reserved GiB", "peak_reserved_gib", "{:.1f}"),
           ("to 1st step s", "first_step_s", "{:.1f}"), ("save blocked s", "save_blocked_s", "{:.2f}"),
           ("save durable s", "save_durable_s", "{:.2f}"), ("restore s", "restore_s", "{:.2f}"),
           ("final loss", "final_loss", "{:.3f}"), ("wall s", "wall_s", "{:.0f}")]


def table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(title for title, _, _ in COLUMNS) + " |",
             "|" + "---|" * len(COLUMNS)]
    for row in rows:
        cells = ["-" if row[key] is None else form.format(row[key]) for _, key, form in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def versions() -> dict:
    found = {"python": sys.version.split()[0]}
    for name in ("gpufleet", "torch", "transformers", "accelerate", "peft", "trl", "datasets",
                 "deepspeed", "bitsandbytes", "unsloth", "axolotl"):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def write(out: Path, name: str, header: dict, rows: list[dict], runs: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"real_sizes-{name}.json").write_text(json.dumps(
        {**header, "rows": rows, "runs": runs}, indent=1, default=str))
    lines = [f"# {ROWS[name].what}: three ways", ""]
    lines += [f"- {key}: {value}" for key, value in header.items()]
    (out / f"real_sizes-{name}.md").write_text("\n".join(lines + ["", table(rows), ""]))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("row", choices=sorted(ROWS))
    parser.add_argument("--out", required=True, help="folder for the JSON and markdown results")
    parser.add_argument("--size", choices=("real", "tiny"), default=None,
                        help="the stand-in (default: real with a GPU, tiny without)")
    parser.add_argument("--steps", type=int, default=None,
                        help="optimizer steps per way (default: 20; tiny: the example's)")
    parser.add_argument("--gpus", type=int, default=1, help="processes, one per GPU (default 1)")
    parser.add_argument("--rounds", type=int, default=1, help="times each way runs (default 1)")
    parser.add_argument("--ways", default=",".join(WAYS),
                        help=f"which ways, in the first round's order (default: {','.join(WAYS)})")
    parser.add_argument("--work", default=None, help="scratch folder (default: OUT/work)")
    options = parser.parse_args(argv)
    ways = options.ways.split(",")
    unknown = sorted(set(ways) - set(WAYS))
    if unknown or options.gpus < 1 or options.rounds < 1:
        parser.error(f"--ways {options.ways!r}, --gpus {options.gpus}, --rounds {options.rounds}: "
                     f"ways are among {', '.join(WAYS)}; gpus and rounds 1 or more")
    run_row(options, ways)


def run_row(options, ways: list[str]) -> None:
    out = Path(options.out).resolve()
    work = Path(options.work).resolve() if options.work else out / "work" / options.row
    gpu = gpu_name()
    size = options.size or ("real" if gpu != "no GPU" else "tiny")
    steps = options.steps or (20 if size == "real" else None)
    started = time.time()
    args = prepare(options.row, size, steps, options.gpus, work)
    prepared = round(time.time() - started, 1)
    row = ROWS[options.row]
    per_token = flops_per_token(args["model"], args["max_length"], row.full_fine_tune)
    runs, rows = [], []
    for round_ in range(options.rounds):
        order = ways[round_ % len(ways):] + ways[:round_ % len(ways)]  # alternated
        for way in order:
            run = run_way(way, options.row, args, work, round_)
            runs.append(run)
            rows.append(measures(run, per_token, peak_flops(gpu)))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    header = {"row": options.row, "what": row.what, "gpu": f"{options.gpus} x {gpu}",
              "date": time.strftime("%Y-%m-%d %H:%M %Z"), "size": size,
              "steps": args["max_steps"], "max_length": args["max_length"],
              "model": args["model"], "layers": args.get("layers"),
              "flops_per_token": f"{per_token:.4g}", "stand-in built in s": prepared,
              "command": shlex.join([sys.executable, *sys.argv]), "versions": versions()}
    write(out, options.row, header, rows, runs)
    print(f"\n{row.what}, {size} size, {options.gpus} x {gpu}\n\n{table(rows)}\n\n"
          f"written to {out}/real_sizes-{options.row}.{{json,md}}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["_way"]:
        way_main(*sys.argv[2:6])
    elif sys.argv[1:2] == ["_prepare"]:
        prepare_main(sys.argv[2], sys.argv[3], sys.argv[4:])
    else:
        main()
