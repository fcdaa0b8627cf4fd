"""The memory estimate against the measured peak, and a real CUDA OOM that shrinks the micro-batch,
on one GPU.

    PYTHONPATH=src python benchmarks/memory_gpu.py --out benchmarks/results/memory_gpu-1xH100-DATE.md
    PYTHONPATH=src python benchmarks/memory_gpu.py --tiny        # the script itself, on a CPU

1. Estimate against measured, per combination of model × strategy × micro-batch × LoRA ×
   activation checkpointing, world size 1 (``"ddp"``, ``"fsdp"`` and, where DeepSpeed is
   installed, ``"zero2"``/``"zero3"`` still run their own code on one rank): the estimate
   (``gpufleet.memory.estimate`` on the model's config, computed on the CPU in worker
   processes while the GPU measures) against ``torch.cuda.max_memory_allocated`` and
   ``max_memory_reserved`` over 3 optimizer steps of ``gpufleet.strategies`` (AdamW, bf16
   mixed precision) after the model is built; and what the process holds outside PyTorch's
   allocator (CUDA context, NCCL) against the estimate's overhead. Target: within ±10%.
2. A real OOM: Llama 3.2 1B (DDP) through ``MicroBatches`` at micro-batch 8 (16 samples a
   step), ``torch.cuda.set_per_process_memory_fraction`` lowered before step OOM_STEP to what
   micro-batch 4 needs; the time from the OOM to the end of the redone step, the loss curve
   against a run at micro-batch 4 from the start (target: within 1%), the optimizer steps.
3. The same OOM through the Hugging Face Trainer (``huggingface.micro_batches``).
4. The check before the first step on a GPU that another process fills: its warning names
   that process, and ``memory_check="error"`` raises.

Each measurement runs in a process of its own (DeepSpeed's engines keep their memory until
their process ends).

Models are built from published configurations with random weights (Llama 3.2 1B from
examples/hf/trl_sft_deepspeed.py, read without importing it; the 124M and 1.2B decoders of
``models.py``): nothing is downloaded. Prints a table; ``--out`` also writes it with the GPU,
date, versions and command. About 7 minutes on one H100.
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import dataclasses
import gc
import json
import multiprocessing
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

GIB = 2**30
STEPS = 3
OOM_STEP, OOM_STEPS, OOM_BATCH = 5, 10, 16  # the OOM run: where, how long, samples per step
TARGET = 0.10


@dataclass(frozen=True)
class Row:
    model: str  # "llama-3.2-1b", "decoder-124m", "decoder-1.2b" (or "tiny-*" with --tiny)
    strategy: str
    micro_batch: int
    seq_len: int
    lora_rank: int | None = None
    checkpointing: bool = False

    @property
    def name(self) -> str:
        extra = (f" LoRA {self.lora_rank}" if self.lora_rank else "") + (" AC" if self.checkpointing else "")
        return f"{self.model} {self.strategy} mb{self.micro_batch}×{self.seq_len}{extra}"


ROWS = [
    Row("llama-3.2-1b", "ddp", 4, 2048),
    Row("llama-3.2-1b", "ddp", 4, 2048, checkpointing=True),
    Row("llama-3.2-1b", "fsdp", 4, 2048),
    Row("llama-3.2-1b", "fsdp", 8, 2048, checkpointing=True),
    Row("llama-3.2-1b", "ddp", 8, 2048, lora_rank=16),
    Row("llama-3.2-1b", "ddp", 16, 1024, lora_rank=16, checkpointing=True),
    Row("decoder-1.2b", "fsdp", 8, 2048),
    Row("decoder-124m", "ddp", 16, 1024),
    Row("decoder-124m", "ddp", 32, 1024),
    Row("llama-3.2-1b", "zero2", 4, 2048),
    Row("llama-3.2-1b", "zero3", 4, 2048),
]
TINY = [Row("tiny-llama", "ddp", 2, 64), Row("tiny-llama", "fsdp", 2, 64, lora_rank=4),
        Row("tiny-decoder", "ddp", 2, 32, checkpointing=True)]


# ---------------------------------------------------------------------------- the models


def llama_config(tiny: bool):
    """Llama 3.2 1B's published config.json (its values, read from the example)."""
    from transformers import AutoConfig

    source = (ROOT / "examples" / "hf" / "trl_sft_deepspeed.py").read_text()
    node = next(n for n in ast.parse(source).body if isinstance(n, ast.Assign)
                and getattr(n.targets[0], "id", "") == "LLAMA_3_2_1B")
    values = ast.literal_eval(node.value)
    if tiny:
        values.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=1000)
    kind = values.pop("model_type")
    values["use_cache"] = False
    return AutoConfig.for_model(kind, **values)


def decoder_config(name: str):
    from models import CONFIGS

    return CONFIGS["tiny" if name.startswith("tiny") else name.split("-")[1]]


def is_llama(row: Row) -> bool:
    return "llama" in row.model


def lora_dtype(row: Row) -> str:
    return "bf16" if row.lora_rank else "fp32"  # LoRA's frozen base in bf16, as it is loaded


def vocabulary(row: Row, tiny: bool) -> int:
    if is_llama(row):
        return 1000 if tiny else 128256
    return decoder_config(row.model).vocab


def decoder_loss(output):
    tokens = output.shape[0] * output.shape[1]
    return torch.nn.functional.cross_entropy(output.float().flatten(0, 1), torch.zeros(tokens, dtype=torch.long,
                                                                                      device=output.device))


# ---------------------------------------------------------------------------- estimates (CPU)


def estimate_row(row: Row, tiny: bool) -> dict:
    from gpufleet import memory

    started = time.monotonic()
    common = dict(micro_batch=row.micro_batch, precision="bf16", lora_rank=row.lora_rank,
                  activation_checkpointing=row.checkpointing, dtype=lora_dtype(row))
    if is_llama(row):
        found = memory.estimate(llama_config(tiny), row.strategy, seq_len=row.seq_len, **common)
    else:
        from models import Decoder

        config = dataclasses.replace(decoder_config(row.model), seq=row.seq_len)
        with torch.device("meta"):
            model = Decoder(config)
        found = memory.estimate(model, row.strategy, loss=decoder_loss,
                                inputs=lambda b: torch.zeros(b, row.seq_len, dtype=torch.long), **common)
    return {**found.as_dict(), "estimate_s": time.monotonic() - started}


# ---------------------------------------------------------------------------- measurements (GPU)


def build(row: Row, tiny: bool, device: torch.device):
    """The row's model on the GPU, random weights, and a function of a batch giving its loss."""
    torch.manual_seed(0)
    dtype = torch.bfloat16 if row.lora_rank else torch.float32
    if is_llama(row):
        from transformers import AutoModelForCausalLM

        with torch.device(device):
            model = AutoModelForCausalLM.from_config(llama_config(tiny), dtype=dtype)
        if row.checkpointing:
            from gpufleet.memory._model import checkpoint_blocks

            checkpoint_blocks(model)  # Hugging Face's own switch, non-reentrant
        if row.lora_rank:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(r=row.lora_rank, target_modules="all-linear"))
        return model, lambda m, ids: m(input_ids=ids, labels=ids).loss
    from models import Decoder

    with torch.device(device):
        model = Decoder(dataclasses.replace(decoder_config(row.model), seq=row.seq_len)).to(dtype)
    if row.checkpointing:
        from torch.utils.checkpoint import checkpoint

        for block in model.layers:
            inner = block.forward
            block.forward = lambda *a, _f=inner: checkpoint(_f, *a, use_reentrant=False)
    return model, lambda m, ids: decoder_loss(m(ids))


def measure_row(row: Row, tiny: bool) -> dict:
    from gpufleet import strategies

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if row.strategy.startswith("zero"):
        try:
            import deepspeed  # noqa: F401
        except ImportError:
            return {"skipped": "DeepSpeed is not installed here"}
        one_rank_world()
    model, loss_of = build(row, tiny, device)
    trainer = strategies.prepare(model, lambda p: torch.optim.AdamW(p, lr=1e-5), row.strategy,
                                 precision="bf16", memory_check="off")
    vocab = vocabulary(row, tiny)
    ids = torch.randint(0, vocab, (row.micro_batch, row.seq_len), device=device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    for _ in range(STEPS):
        trainer.backward(loss_of(trainer.model, ids))
        trainer.step()
    found = {}
    if cuda:
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        found = {"allocated": torch.cuda.max_memory_allocated(), "reserved": torch.cuda.max_memory_reserved(),
                 "outside": total - free - torch.cuda.memory_reserved()}
    del trainer, model, ids
    _clean()
    return found


def one_rank_world() -> None:
    """What a launcher sets for a world of one rank, which DeepSpeed reads (the ZeRO rows run
    in this process, not under a launcher)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1"),
                        ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port))):
        os.environ.setdefault(name, value)


def isolated(fn, *args) -> dict:
    """``fn(*args)`` in a fresh process: each measurement starts from an empty GPU, whatever an
    earlier one left behind (DeepSpeed's engines keep memory until their process ends); an
    exception becomes ``{"error": ...}``."""
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        try:
            return pool.submit(fn, *args).result()
        except Exception as exc:  # noqa: BLE001  # one part's failure is reported in its line
            return {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}


def _clean() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------- a real OOM


def oom_run(micro_batch: int, limit_at: int | None, per_sample: int, tiny: bool) -> dict:
    """Llama 3.2 1B (DDP) through MicroBatches; from step ``limit_at`` the process may use only
    what micro-batch 4 needs (a real CUDA OOM at micro-batch 8). Losses per step, times."""
    from gpufleet import memory, strategies

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    row = Row("tiny-llama" if tiny else "llama-3.2-1b", "ddp", micro_batch, 64 if tiny else 1024)
    model, loss_of = build(row, tiny, device)
    trainer = strategies.prepare(model, lambda p: torch.optim.AdamW(p, lr=1e-4), "ddp", precision="bf16",
                                 memory_check="off")
    helper = memory.MicroBatches(trainer, micro_batch)
    gen = torch.Generator().manual_seed(7)
    data = [torch.randint(0, 1000 if tiny else 128256, (OOM_BATCH, row.seq_len), generator=gen)
            for _ in range(OOM_STEPS)]
    losses, ends = [], []
    for step, ids in enumerate(data, start=1):
        if step == limit_at:
            _limit(per_sample)
        loss = helper.step(ids.to(device), lambda micro: loss_of(trainer.model, micro))
        losses.append(float(loss))
        ends.append(time.time())
    result = {"losses": losses, "optimizer_steps": trainer.optimizer_steps, "micro_batch": helper.micro_batch,
              "shrinks": helper.shrinks, "step_ends": ends}
    if torch.cuda.is_available():
        torch.cuda.set_per_process_memory_fraction(1.0)
    del trainer, model, helper
    _clean()
    return result


def trainer_oom_run(micro_batch: int, limit_at: int | None, per_sample: int, tiny: bool) -> dict:
    """As ``oom_run``, through the Hugging Face Trainer and ``huggingface.micro_batches``."""
    import logging

    from transformers import Trainer, TrainerCallback, TrainingArguments

    from gpufleet.integrations.huggingface import micro_batches

    cuda = torch.cuda.is_available()
    row = Row("tiny-llama" if tiny else "llama-3.2-1b", "ddp", micro_batch, 64 if tiny else 1024)
    model, _ = build(row, tiny, torch.device("cuda" if cuda else "cpu"))
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 1000 if tiny else 128256, (OOM_BATCH * OOM_STEPS, row.seq_len), generator=gen)
    ends: list[float] = []

    class Limit(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step + 1 == limit_at:
                _limit(per_sample)

        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.time())

    args = TrainingArguments("/tmp/memory_gpu-trainer", max_steps=OOM_STEPS, per_device_train_batch_size=OOM_BATCH,
                             gradient_accumulation_steps=1, learning_rate=1e-4, lr_scheduler_type="constant",
                             bf16=cuda, use_cpu=not cuda, save_strategy="no", report_to="none", logging_steps=1,
                             disable_tqdm=True, seed=0, data_seed=0)
    trainer = micro_batches(Trainer(model, args, train_dataset=[{"input_ids": i, "labels": i} for i in ids],
                                    callbacks=[Limit()]), micro_batch)
    said: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = said.append  # type: ignore[method-assign]
    logging.getLogger("gpufleet").addHandler(handler)
    try:
        trainer.train()
    finally:
        logging.getLogger("gpufleet").removeHandler(handler)
        if cuda:
            torch.cuda.set_per_process_memory_fraction(1.0)
    shrinks = [(r.created, r.getMessage()) for r in said if "ran out of GPU memory" in r.getMessage()]
    return {"losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
            "optimizer_steps": trainer.state.global_step, "shrinks": shrinks, "step_ends": ends}


def trainer_oom_recovery(tiny: bool, per_sample: int) -> dict:
    shrunk = isolated(trainer_oom_run, 8, OOM_STEP, per_sample, tiny)
    steady = isolated(trainer_oom_run, 4, None, per_sample, tiny)
    if "error" in shrunk or "error" in steady:
        return {"error": shrunk.get("error") or steady.get("error")}
    diffs = [abs(a - b) / abs(b) for a, b in zip(shrunk["losses"], steady["losses"])]
    found = {"shrinks": [m for _, m in shrunk["shrinks"]], "max_loss_diff": max(diffs),
             "optimizer_steps": (shrunk["optimizer_steps"], steady["optimizer_steps"]),
             "losses": (shrunk["losses"], steady["losses"])}
    if shrunk["shrinks"]:
        when = shrunk["shrinks"][0][0]
        found["continue_s"] = min(end for end in shrunk["step_ends"] if end > when) - when
    return found


def _limit(per_sample: int) -> None:
    """Let the process use what it reserved at micro-batch 8 less 2 samples' activations: micro-
    batch 8 does not fit any more, micro-batch 4 (4 samples less) does."""
    if not torch.cuda.is_available():
        return
    peak = torch.cuda.max_memory_reserved()
    _clean()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(max(peak - 2 * per_sample, 0) / total)


def oom_recovery(tiny: bool, per_sample: int) -> dict:
    shrunk = isolated(oom_run, 8, OOM_STEP, per_sample, tiny)
    steady = isolated(oom_run, 4, None, per_sample, tiny)
    if "error" in shrunk or "error" in steady:
        return {"error": shrunk.get("error") or steady.get("error")}
    if tiny:  # no GPU to run out of: the script's own path is what is checked
        shrunk["note"] = "no GPU: the OOM was not provoked"
    diffs = [abs(a - b) / abs(b) for a, b in zip(shrunk["losses"], steady["losses"])]
    shrink = shrunk["shrinks"][0] if shrunk["shrinks"] else None
    redone = shrink["step"] if shrink else None
    cont = shrunk["step_ends"][redone - 1] - shrink["time"] if shrink else None
    return {"shrink": shrink, "continue_s": cont, "max_loss_diff": max(diffs),
            "loss_diffs": diffs, "optimizer_steps": (shrunk["optimizer_steps"], steady["optimizer_steps"]),
            "losses": (shrunk["losses"], steady["losses"])}


# ---------------------------------------------------------------------------- the check


HOG = "import sys, time, torch; x = torch.empty(int(sys.argv[1]), dtype=torch.uint8, device='cuda'); " \
      "print('ready', flush=True); time.sleep(600)"


def check_with_a_neighbour(tiny: bool) -> dict:
    """Another process holds all but what the step needs less 4 GiB: the warning names it;
    memory_check="error" raises."""
    if not torch.cuda.is_available():
        return {"skipped": "no GPU"}
    import logging

    from gpufleet import strategies
    from gpufleet.memory import MemoryCheckError

    row = Row("llama-3.2-1b", "ddp", 4, 2048)
    free, _ = torch.cuda.mem_get_info()
    hog = subprocess.Popen([sys.executable, "-c", HOG, str(max(free - 24 * GIB, GIB))],
                           stdout=subprocess.PIPE, text=True)
    try:
        hog.stdout.readline()
        found: dict = {"neighbour_pid": hog.pid}
        for mode in ("warn", "error"):
            model, loss_of = build(row, tiny, torch.device("cuda"))
            trainer = strategies.prepare(model, lambda p: torch.optim.AdamW(p, lr=1e-5), "ddp",
                                         memory_check=mode)
            ids = torch.randint(0, 128256, (row.micro_batch, row.seq_len), device="cuda")
            records: list[str] = []
            handler = logging.Handler()
            handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
            logging.getLogger("gpufleet").addHandler(handler)
            outcome = "the first forward pass ran"
            try:
                loss_of(trainer.model, ids)
            except MemoryCheckError as exc:
                outcome = f"MemoryCheckError: {exc}"
            except torch.OutOfMemoryError:
                outcome = "then the forward pass ran out of memory"
            finally:
                logging.getLogger("gpufleet").removeHandler(handler)
            warned = [r for r in records if "the first step needs" in r]
            said = warned[-1] if warned else f"no warning of the need (gpufleet said: {records or 'nothing'})"
            found[mode] = outcome if mode == "error" and not records else f"{said}; {outcome}"
            del trainer, model, ids
            _clean()
        found["names_the_neighbour"] = all(f"pid {hog.pid}" in found[m] for m in ("warn", "error"))
        return found
    finally:
        hog.kill()
        hog.wait()


# ---------------------------------------------------------------------------- the report


def table(rows: list[Row], estimates: list[dict], measured: list[dict]) -> list[str]:
    lines = ["| combination | estimate allocated | measured allocated | ratio | estimate reserved | "
             "measured reserved | ratio | outside PyTorch (est. / measured) | trace s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row, e, m in zip(rows, estimates, measured):
        if "skipped" in m or "error" in m or "error" in e:
            lines.append(f"| {row.name} | {m.get('skipped') or m.get('error') or e.get('error')} ||||||||")
            continue
        if not m:
            lines.append(f"| {row.name} | {e['allocated'] / GIB:.2f} GiB | (no GPU) ||||||{e['estimate_s']:.0f} |")
            continue
        ra, rr = e["allocated"] / m["allocated"], e["reserved"] / m["reserved"]
        lines.append(
            f"| {row.name} | {e['allocated'] / GIB:.2f} GiB | {m['allocated'] / GIB:.2f} GiB | {ra:.3f}"
            f"{'' if abs(ra - 1) <= TARGET else ' ✗'} | {e['reserved'] / GIB:.2f} GiB | {m['reserved'] / GIB:.2f} GiB | "
            f"{rr:.3f}{'' if abs(rr - 1) <= TARGET else ' ✗'} | {e['overhead'] / GIB:.2f} / "
            f"{m['outside'] / GIB:.2f} GiB | {e['estimate_s']:.0f} |")
    return lines


def report(rows, estimates, measured, recovery, check, args, trainer) -> str:
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU (--tiny)"
    import transformers

    head = [f"# memory_gpu: estimate against measured, OOM recovery ({gpu})", "",
            f"date {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; torch {torch.__version__}, "
            f"transformers {transformers.__version__}; command: python {' '.join(sys.argv)}", "",
            f"## Estimate against measured (1 GPU, {STEPS} steps of AdamW, bf16 mixed precision; target ±10%)",
            ""]
    r = recovery
    oom = ["", "## A real CUDA OOM (set_per_process_memory_fraction), Llama 3.2 1B DDP, 16 samples a step", ""]
    if not r:
        oom += ["- not run (--parts)"]
    elif "error" in r:
        oom += [f"- failed: {r['error']}"]
    elif r.get("shrink"):
        oom += [f"- shrink: step {r['shrink']['step']}, micro-batch {r['shrink']['old_micro_batch']} → "
                f"{r['shrink']['new_micro_batch']}, where: {r['shrink'].get('where')}",
                f"- training went on {r['continue_s']:.2f} s after the OOM (the redone step's end; target < 10 s)"]
    else:
        oom += ["- no OOM happened: the limit was not low enough (see the losses)"]
    oom += [] if not r or "error" in r else [f"- loss curve against micro-batch 4 from the start: largest difference {100 * r['max_loss_diff']:.3f}% "
            f"(target < 1%)", f"- optimizer steps: {r['optimizer_steps'][0]} and {r['optimizer_steps'][1]}",
            f"- losses (shrunk, steady): {json.dumps([[round(x, 4) for x in c] for c in r['losses']])}"]
    t = trainer
    hf = ["", "## The same OOM through the Hugging Face Trainer (`huggingface.micro_batches`)", ""]
    if not t:
        hf += ["- not run (--parts)"]
    elif "error" in t:
        hf += [f"- failed: {t['error']}"]
    else:
        hf += [f"- shrinks: {t['shrinks'] or 'none (the limit was not low enough)'}"]
        if "continue_s" in t:
            hf += [f"- training went on {t['continue_s']:.2f} s after the OOM (the redone step's end)"]
        hf += [f"- loss curve against micro-batch 4 from the start: largest difference {100 * t['max_loss_diff']:.3f}%",
               f"- optimizer steps: {t['optimizer_steps'][0]} and {t['optimizer_steps'][1]}"]
    checked = ["", "## The check before the first step, another process holding most of the GPU", "",
               *(f"- {k}: {v}" for k, v in check.items())]
    return "\n".join(head + table(rows, estimates, measured) + oom + hf + checked) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny models: check this script on a CPU")
    parser.add_argument("--out", type=Path, help="also write the report to this file")
    parser.add_argument("--only", help="the rows whose name holds this text")
    parser.add_argument("--parts", default="rows,oom,trainer,check",
                        help="which parts to run, of rows (estimate against measured), oom, trainer "
                             "(the OOM through the Hugging Face Trainer), check")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    rows = TINY if args.tiny else ROWS
    rows = [r for r in rows if "rows" in parts and (not args.only or args.only in r.name)]
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=min(6, os.cpu_count() or 1), mp_context=context) as pool:
        pending = [pool.submit(estimate_row, row, args.tiny) for row in rows]
        measured = []
        for row in rows:
            measured.append(isolated(measure_row, row, args.tiny))
            print(f"measured {row.name}: {measured[-1]}", flush=True)
        estimates = []
        for future in pending:
            try:
                estimates.append(future.result())
            except Exception as exc:  # noqa: BLE001
                estimates.append({"error": f"estimate: {type(exc).__name__}: {str(exc)[:160]}"})
    per_sample = next((e["activations_per_sample"] for r, e in zip(rows, estimates)
                       if r.model.endswith("llama-3.2-1b") and r.strategy == "ddp" and not r.lora_rank
                       and not r.checkpointing and "error" not in e), 0)
    per_sample = per_sample // 2  # those rows trace 2048 tokens a sample; the OOM run has 1024
    recovery = oom_recovery(args.tiny, per_sample) if "oom" in parts else {}
    print(f"recovery: {recovery}", flush=True)
    trainer = trainer_oom_recovery(args.tiny, per_sample) if "trainer" in parts else {}
    print(f"trainer: {trainer}", flush=True)
    check = isolated(check_with_a_neighbour, args.tiny) if "check" in parts else {}
    text = report(rows, estimates, measured, recovery, check, args, trainer)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps(
            {"rows": [dataclasses.asdict(r) for r in rows], "estimates": estimates, "measured": measured,
             "recovery": recovery, "trainer": trainer, "check": check}, indent=1, default=str))


if __name__ == "__main__":
    main()
