"""Every strategy trains, checkpoints, dies and resumes: the GPU check of issue-level behaviour.

    python benchmarks/strategies_gpu.py                     # every variant below on 2 GPUs
    python benchmarks/strategies_gpu.py --strategies ddp,fsdp --steps 6   # also runs on CPU

Variants: ddp, fsdp, zero2, zero3, and fsdp-ac (activation checkpointing), fsdp-meta (the model
built on the meta device, each rank initialising its shards), zero3-offload (optimizer state
and parameters in CPU memory).

For each strategy, three gpufleet calls on the same checkpoint root:
  1. uninterrupted: 2·k steps, checkpoint at step k (async save), final weights returned;
  2. interrupted: k steps, checkpoint at k, then rank 1 dies (os._exit) — the call fails;
  3. resumed: restore (returns k), train to 2·k, final weights returned.
The weights of 3 must equal those of 1; the table shows the largest difference. For FSDP a
fourth call resumes the 2-rank checkpoint on 1 rank (DCP reshards) and checks the loss.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from models import Config, Decoder  # noqa: E402

from gpufleet import RunFailedError, distributed, runtime  # noqa: E402

CONFIG = Config(d_model=512, layers=4, heads=8, hidden=1536, vocab=1024, seq=256, batch=8)
VARIANTS = {  # name: (strategy, options, build on the meta device)
    "ddp": ("ddp", {}, False),
    "fsdp": ("fsdp", {}, False),
    "fsdp-ac": ("fsdp", {"activation_checkpointing": True}, False),
    "fsdp-meta": ("fsdp", {}, True),
    "zero2": ("zero2", {}, False),
    "zero3": ("zero3", {}, False),
    "zero3-offload": ("zero3", {"offload_optimizer": True, "offload_params": True}, False),
}


@distributed(timeout=900, logs="rank0")
def train(variant: str, root: str, steps: int, save_at: int, die_after_save: bool) -> dict:
    import os

    import torch
    import torch.nn.functional as F

    from gpufleet import strategies
    from gpufleet.checkpoint import Checkpointer

    runtime.setup()
    torch.manual_seed(0)
    strategy, options, on_meta = VARIANTS[variant]
    with torch.device("meta" if on_meta else "cpu"):
        model = Decoder(CONFIG)
    trainer = strategies.prepare(
        model,
        lambda params: torch.optim.AdamW(params, lr=1e-3),
        strategy,
        scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + 0.1 * s)),
        clip_grad_norm=1.0,
        **options,
    )
    ckpt = Checkpointer(root, keep=2)
    start = ckpt.restore(trainer)
    losses, save_s = [], None
    for step in range(start, steps):
        tokens = _batch(step, runtime.get_global_rank(), trainer.device)
        logits = trainer.model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        trainer.backward(loss)
        trainer.step()
        losses.append(loss.item())
        if step + 1 == save_at:
            began = time.perf_counter()
            ckpt.save(step + 1, trainer)
            save_s = time.perf_counter() - began
            if die_after_save:
                ckpt.wait()
                if runtime.get_global_rank() == 1:
                    os._exit(3)
    weights = trainer.full_state_dict()
    return {"start": start, "losses": losses, "weights": weights, "save_s": save_s}


def _batch(step: int, rank: int, device):
    """Token rows that follow a learnable rule (next = current + stride), different per step and
    rank, the same in every run."""
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)
    first = torch.randint(0, CONFIG.vocab, (CONFIG.batch, 1), generator=g)
    stride = torch.randint(1, 4, (CONFIG.batch, 1), generator=g)
    return ((first + stride * torch.arange(CONFIG.seq + 1)) % CONFIG.vocab).to(device)


def max_difference(a: dict, b: dict) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def check(variant: str, steps: int, gpus: int) -> list[str]:
    k = steps // 2
    run = train.options(gpus=gpus)
    with tempfile.TemporaryDirectory() as tmp:
        began = time.perf_counter()
        whole = run.distributed(variant, f"{tmp}/whole", steps, k, False)[0]
        elapsed = time.perf_counter() - began
        try:
            run.distributed(variant, f"{tmp}/cut", steps, k, True)
            died = "no (the run did not fail!)"
        except RunFailedError as exc:
            died = "yes" if "rank 1" in str(exc) else str(exc).splitlines()[0][:60]
        resumed = run.distributed(variant, f"{tmp}/cut", steps, k, False)[0]
        diff = max_difference(whole["weights"], resumed["weights"])
        rows = [
            f"{variant:<13} {gpus:>4} {whole['losses'][0]:>7.3f} → {whole['losses'][-1]:<7.3f} "
            f"{whole['save_s']:>7.3f} {died:>9} {resumed['start']:>8} {diff:>11.2e} "
            f"{'yes' if diff == 0 else 'no':>6} {elapsed:>7.1f}"
        ]
        if variant == "fsdp" and gpus > 1:
            one = train.options(gpus=1).distributed(variant, f"{tmp}/cut", steps + 2, 0, False)[0]
            rows.append(
                f"fsdp {gpus}→1 rank: restored step {one['start']}, loss there {one['losses'][0]:.3f} "
                f"(the {gpus}-rank run had {whole['losses'][k]:.3f})"
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--strategies", default=",".join(VARIANTS))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--gpus", type=int, default=2)
    args = parser.parse_args()
    rows = []
    for variant in args.strategies.split(","):
        if variant not in VARIANTS:
            parser.error(f"unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")
        rows += check(variant, args.steps, args.gpus)
        print(rows[-1], flush=True)
    print(
        "\nvariant       gpus loss first → last  save s  rank died  resumed  max |Δw| vs whole  "
        "equal  call s"
    )
    print("\n".join(rows))


if __name__ == "__main__":
    main()
