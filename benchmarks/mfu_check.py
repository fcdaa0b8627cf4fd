"""MFU on a GPU, checked: gpufleet's FLOP count of a Llama 3.2 1B-shaped model against a hand
count, and the MFU its step telemetry shows against one worked out by hand from step times.

    python benchmarks/mfu_check.py                 # one GPU: the 1B shape, bf16, 4 x 2048 tokens
    python benchmarks/mfu_check.py --size tiny     # anywhere, CPUs too: a smoke test

The model is built from Llama 3.2 1B's published config.json (meta-llama/Llama-3.2-1B:
hidden_size 2048, num_hidden_layers 16, num_attention_heads 32, num_key_value_heads 8,
intermediate_size 8192, vocab_size 128256, tie_word_embeddings true, rope_theta 500000), with
random weights: nothing is downloaded (its llama3 rope scaling is left out: it changes no
FLOPs). One call of one rank trains it for ``--steps`` steps of
``--batch`` sequences of ``--seq`` random tokens (AdamW, bf16 weights on a GPU, fp32 on CPU,
SDPA attention), marking each step with ``runtime.step(tokens=...)`` and nothing else: gpufleet
counts the model's FLOPs on one step itself and shows MFU against the GPU's dense peak (its
table; ``GPUFLEET_PEAK_FLOPS`` replaces it, and a CPU run gets a nominal 1e11 so that an MFU
shows). Then the script prints:

- the counted FLOPs per token against 6·N + 12·L·T·d, where N is the weights the matmuls use
  (the tied embedding once, as the output layer), L the layers, T the sequence, d the width;
- each step's time (synchronised with the GPU), tokens/s and MFU worked out by hand (the hand
  count times tokens/s, over the peak), and the MFU steps.json says for the run (its median
  window).

It exits 1 when the count is more than 1% off the hand count. Results go in
``benchmarks/results/mfu_check-<GPU>-<date>.md`` with the command.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from gpufleet import distributed, runtime

# Llama 3.2 1B's config.json; "tiny" keeps its proportions at a size a CPU trains in seconds.
SIZES = {
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=8192, vocab_size=128256, rope_theta=500000.0),
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                 intermediate_size=512, vocab_size=1024, rope_theta=500000.0),
}
CPU_PEAK = "1e11"  # a nominal peak for a CPU run, so that an MFU shows: not a CPU's real one


def train(size: str, steps: int, batch: int, seq: int) -> dict:
    """One rank's run: the model trained ``steps`` steps; each step's seconds."""
    import time

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    device = runtime.setup()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = LlamaConfig(**SIZES[size], tie_word_embeddings=True, max_position_embeddings=max(seq, 2048),
                         head_dim=SIZES[size]["hidden_size"] // SIZES[size]["num_attention_heads"],
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    seconds = []
    for _ in range(steps):
        started = time.perf_counter()
        ids = torch.randint(config.vocab_size, (batch, seq), device=device)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()  # the step's own time, not the CPU's
        seconds.append(time.perf_counter() - started)
        runtime.step(tokens=ids.numel())
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    return {"seconds": seconds, "device": name, "dtype": str(dtype)}


def hand_count(size: str, seq: int) -> float:
    """6·N + 12·L·T·d FLOPs per token."""
    c = SIZES[size]
    d, layers, inner, vocab = c["hidden_size"], c["num_hidden_layers"], c["intermediate_size"], c["vocab_size"]
    kv = c["num_key_value_heads"] * d // c["num_attention_heads"]
    weights = layers * (2 * d * d + 2 * d * kv + 3 * d * inner) + vocab * d
    return 6 * weights + 12 * layers * seq * d


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1b", choices=sorted(SIZES))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=None, help="default: 4 (1b), 2 (tiny)")
    parser.add_argument("--seq", type=int, default=None, help="default: 2048 (1b), 64 (tiny)")
    args = parser.parse_args()
    batch = args.batch or (4 if args.size == "1b" else 2)
    seq = args.seq or (2048 if args.size == "1b" else 64)
    runs = Path(tempfile.mkdtemp(prefix="mfu-check-"))
    env = {"HF_HUB_OFFLINE": "1"}
    if "GPUFLEET_PEAK_FLOPS" not in os.environ and args.size == "tiny":
        env["GPUFLEET_PEAK_FLOPS"] = CPU_PEAK
    call = distributed(gpus=1, runs_dir=str(runs), tracking=False, timeout=3600, env=env)(train)
    result = call.distributed(args.size, args.steps, batch, seq)[0]
    attempt = next(runs.glob("*/attempt-0"))
    row = json.loads((attempt / "steps.json").read_text())["ranks"][0]
    return report(args, batch, seq, result, row)


def report(args, batch: int, seq: int, result: dict, row: dict) -> int:
    counted, peak = row.get("model_flops") or {}, row.get("peak_flops")
    hand = hand_count(args.size, seq)
    where = f"peak {peak:.4g} FLOP/s" if peak else "no peak known"
    print(f"Llama 3.2 1B shape ({args.size}), {batch} x {seq} tokens a step, {result['dtype']}, "
          f"on {result['device']}; {where}")
    if counted.get("per") != "token":
        print(f"no FLOPs per token counted: steps.json says {counted or 'nothing'}")
        return 1
    off = counted["value"] / hand - 1
    print(f"FLOPs per token: counted {counted['value']:.6g} ({counted['dtype']}), "
          f"6N + 12LTd {hand:.6g}: {off:+.3%}")
    print("step  seconds  tokens/s  MFU (hand count)")
    for step, seconds in enumerate(result["seconds"], 1):
        rate = batch * seq / seconds
        mfu = f"{hand * rate / peak:.1%}" if peak else "-"
        print(f"{step:>4}  {seconds:7.3f}  {rate:8.0f}  {mfu}")
    late = result["seconds"][len(result["seconds"]) // 3:]  # past compilation and warm-up
    rate = batch * seq / statistics.median(late)
    if peak:
        print(f"median past the first third: {rate:.0f} tokens/s, MFU {hand * rate / peak:.1%} by hand; "
              f"steps.json: {row.get('tokens_per_s') or 0:.0f} tokens/s, MFU {row.get('mfu') or 0:.1%}")
    return 0 if abs(off) <= 0.01 else 1


if __name__ == "__main__":
    sys.exit(main())
