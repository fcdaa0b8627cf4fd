"""What counting a step's FLOPs costs the step: its peak GPU memory and time, counted three
ways, on a Llama 3.2 1B of random weights (bf16, sequence 2048, micro-batch 4, gradient
checkpointing, AdamW), one GPU.

    python benchmarks/flop_count.py [--layers 16] [--batch 4] [--seq 2048] [--out DIR]

Ways, each over the same step after two warm-up steps: none; torch's
``torch.utils.flop_counter.FlopCounterMode`` (what step telemetry used to count with); and
gpufleet's ``flops.Counter`` (what it counts with now). Prints a table, and writes it with the
GPU, date and versions to ``flop_count-GPU-DATE.md`` in ``--out``.
"""

import argparse
import datetime
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from gpufleet import flops  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU: to check the script, no figure


def model_and_batch(layers: int, batch: int, seq: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=layers,
                         num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=seq,
                         tie_word_embeddings=True, attn_implementation="sdpa")
    model = LlamaForCausalLM(config).to(DEVICE, torch.bfloat16)
    model.gradient_checkpointing_enable()
    model.train()
    ids = torch.randint(0, config.vocab_size, (batch, seq), device=DEVICE)
    return model, ids


def step(model, optimizer, ids) -> None:
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


class TorchCounter:
    def __enter__(self):
        from torch.utils.flop_counter import FlopCounterMode

        self.mode = FlopCounterMode(display=False)
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)
        self.flops = self.mode.get_total_flops()


class GpufleetCounter:
    def __enter__(self):
        self.counter = flops.Counter()
        self.counter.start()
        return self

    def __exit__(self, *exc):
        self.counter.ended_step(None, None)
        self.flops = self.counter.stop().value


class Nothing:
    flops = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


def measure(way, model, optimizer, ids) -> dict:
    gpu = DEVICE == "cuda"
    if gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    try:
        with way() as counted:
            step(model, optimizer, ids)
    except Exception as exc:  # noqa: BLE001  # torch's counter refuses some kernels: say which
        optimizer.zero_grad(set_to_none=True)
        return {"error": f"{type(exc).__name__}: {exc}"}
    if gpu:
        torch.cuda.synchronize()
    return {"seconds": time.perf_counter() - start, "flops": counted.flops,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if gpu else float("nan")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    model, ids = model_and_batch(args.layers, args.batch, args.seq)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    for _ in range(2):
        step(model, optimizer, ids)
    ways = {"none": Nothing, "torch FlopCounterMode": TorchCounter, "gpufleet flops.Counter": GpufleetCounter}
    rows = []
    for _ in range(2):  # alternated, twice: the second round is reported
        rows = [(name, measure(way, model, optimizer, ids)) for name, way in ways.items()]
    gpu = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU"
    lines = [f"# What counting a step's FLOPs costs the step ({gpu})", "",
             f"- date: {datetime.date.today()}; torch {torch.__version__}",
             f"- command: `python benchmarks/flop_count.py --layers {args.layers} --batch {args.batch} "
             f"--seq {args.seq}` (Llama 3.2 1B shape, random weights, bf16, gradient checkpointing, AdamW)",
             "", "| counted with | peak allocated GiB | step s | TFLOPs counted |", "|---|---|---|---|"]
    for name, row in rows:
        if "error" in row:
            lines.append(f"| {name} | — | — | failed: {row['error']} |")
            continue
        counted = "—" if row["flops"] is None else f"{row['flops'] / 1e12:.2f}"
        lines.append(f"| {name} | {row['peak_gib']:.2f} | {row['seconds']:.3f} | {counted} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        name = f"flop_count-{gpu.replace(' ', '_')}-{datetime.date.today()}.md"
        (args.out / name).write_text(text)


if __name__ == "__main__":
    main()
