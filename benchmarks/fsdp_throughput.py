"""Training throughput of gpufleet's strategies against hand-written FSDP2 and DDP.

    python benchmarks/fsdp_throughput.py                       # every mode, 1 and 2 GPUs
    python benchmarks/fsdp_throughput.py --modes fsdp,plain-fsdp --gpus 2
    python benchmarks/fsdp_throughput.py --config tiny --gpus 2 --no-compile  # smoke test on CPU

Modes (each a separate gpufleet call, so each starts from a fresh process group):

    fsdp        gpufleet.strategies.prepare(model, AdamW, "fsdp", compile=True)   (1.2B)
    fsdp-keep   the same with reshard_after_forward=False (no all-gathers in backward)
    plain-fsdp  the same model in a hand-written FSDP2 script: per-block torch.compile and
                fully_shard, then the root; bf16 parameters, fp32 reduction       (1.2B)
    ddp         gpufleet.strategies.prepare(model, AdamW, "ddp", compile=True)    (124M)
    plain-ddp   hand-written DDP with bf16 autocast, torch.compile of the wrapper (124M)
    ddp-no-sync plain-ddp that never all-reduces gradients: what the step costs without
                communication, to tell communication from other per-GPU slowdowns
    zero3       gpufleet.strategies.prepare(model, AdamW, "zero3")  (1.2B; needs deepspeed)

Every mode prints tokens/s per GPU and MFU against 989 TFLOP/s (H100/H200 dense bf16), where
FLOPs per token = 6 · parameters + 12 · layers · d_model · sequence. One JSON line per result
goes to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from models import CONFIGS, build  # noqa: E402

from gpufleet import distributed, runtime  # noqa: E402

PEAK_FLOPS = 989e12
BIG, SMALL = "1.2b", "124m"
MODES = {
    "fsdp": BIG, "fsdp-keep": BIG, "plain-fsdp": BIG, "ddp": SMALL, "plain-ddp": SMALL,
    "ddp-no-sync": SMALL, "zero3": BIG,
}


@distributed(timeout=1800, logs="rank0")
def measure(mode: str, config_name: str, steps: int, warmup: int, compile: bool) -> dict:
    import torch

    config = CONFIGS[config_name]
    device = runtime.setup()
    model, params = build(config_name, device)
    step = _train_step(mode, model, device, compile)
    tokens = torch.randint(0, config.vocab, (config.batch, config.seq + 1), device=device)
    for _ in range(warmup):
        loss = step(tokens)
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        loss = step(tokens)
    _sync(device)
    elapsed = time.perf_counter() - start
    tokens_per_s = config.batch * config.seq * steps / elapsed
    return {
        "mode": mode,
        "config": config_name,
        "gpus": runtime.get_world_size(),
        "params": params,
        "tokens_per_s_per_gpu": tokens_per_s,
        "mfu": tokens_per_s * config.flops_per_token(params) / PEAK_FLOPS,
        "step_s": elapsed / steps,
        "loss": float(loss),
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0,
    }


def _train_step(mode: str, model, device, compile: bool):
    """A function of a token batch that runs one optimizer step and returns the loss."""
    import torch
    import torch.nn.functional as F

    def loss_of(forward, tokens):
        logits = forward(tokens[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())

    def adamw(params):
        # fused: one kernel per step instead of ~10 passes over 1.2B parameters (~10% of a step)
        return torch.optim.AdamW(params, lr=1e-4, fused=device.type == "cuda")

    if mode in ("fsdp", "fsdp-keep", "ddp", "zero3"):
        from gpufleet import strategies

        options = {"compile": compile} if mode != "zero3" else {}
        if mode == "fsdp-keep":
            options["reshard_after_forward"] = False
        trainer = strategies.prepare(model, adamw, mode.removesuffix("-keep"), **options)

        def step(tokens):
            loss = loss_of(trainer.model, tokens)
            trainer.backward(loss)
            trainer.step()
            return loss.detach()

        return step

    if mode == "plain-fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for i, layer in enumerate(model.layers):
            if compile:
                layer.compile()
            last = i == len(model.layers) - 1
            fully_shard(layer, mp_policy=policy, reshard_after_forward=not last)
        fully_shard(model, mp_policy=policy)
        forward = model
    elif mode in ("plain-ddp", "ddp-no-sync"):
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
        if compile:  # after wrapping, as torch's DDP notes advise (Dynamo's DDPOptimizer)
            ddp.compile()

        def forward(tokens):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                return ddp(tokens)

        if mode == "ddp-no-sync":  # a diagnosis: the same step with no gradient all-reduce
            ddp.require_backward_grad_sync = False
    else:
        raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
    optimizer = adamw(model.parameters())

    def step(tokens):
        loss = loss_of(forward, tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--gpus", default="1,2", help="comma-separated world sizes")
    parser.add_argument("--config", help="override every mode's model size (e.g. tiny)")
    parser.add_argument("--steps", type=int, default=10, help="measured steps (124m: 5×)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    parser.add_argument("--out", type=Path, default=None, help="append JSON lines here")
    args = parser.parse_args()
    rows = []
    for mode in args.modes.split(","):
        for gpus in (int(g) for g in args.gpus.split(",")):
            started = time.perf_counter()
            config = args.config or MODES[mode]
            try:
                result = measure.options(gpus=gpus).distributed(
                    mode, config, args.steps * (5 if config == SMALL else 1), args.warmup, args.compile
                )[0]
            except Exception as exc:  # one failing mode must not hide the others' numbers
                print(f"{mode} on {gpus}: FAILED: {str(exc).splitlines()[0]}", flush=True)
                continue
            result["call_s"] = time.perf_counter() - started
            rows.append(result)
            print(_row(result), flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(result) + "\n")
    print("\nmode        config gpus  tokens/s/GPU    MFU  step s  peak GiB")
    for r in rows:
        print(_row(r))
    _ratios(rows)


def _row(r: dict) -> str:
    return (
        f"{r['mode']:<11} {r['config']:>6} {r['gpus']:>4} {r['tokens_per_s_per_gpu']:>13,.0f} "
        f"{r['mfu']:>6.1%} {r['step_s']:>7.3f} {r['peak_mem_gib']:>9.1f}"
    )


def _ratios(rows: list[dict]) -> None:
    by = {(r["mode"], r["gpus"]): r["tokens_per_s_per_gpu"] for r in rows}
    for gpus in sorted({r["gpus"] for r in rows}):
        if ("fsdp", gpus) in by and ("plain-fsdp", gpus) in by:
            print(f"fsdp / plain-fsdp on {gpus} GPU(s): {by['fsdp', gpus] / by['plain-fsdp', gpus]:.3f}×")
    for mode in ("ddp", "plain-ddp"):
        if (mode, 1) in by and (mode, 2) in by:
            print(f"{mode} per-GPU scaling 1 → 2 GPUs: {by[mode, 2] / by[mode, 1]:.1%}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
