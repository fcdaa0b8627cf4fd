"""The 10M-parameter transformer of transformer_fsdp.py, trained with DeepSpeed ZeRO-3.

    python examples/deepspeed_zero.py                   # every GPU, 2000 steps: ~3.5 min, 2 H200s
    python examples/deepspeed_zero.py --steps 3000      # resume that run: 1000 steps more
    python examples/deepspeed_zero.py --offload-optimizer --checkpoint-dir checkpoints/offload
    python examples/deepspeed_zero.py --small           # CPU-sized: 2 gloo processes, 20-40 s

The model, the data (the Python standard library's own source, or `--data`), the training loop,
the checkpoints and the checks are those of transformer_fsdp.py, imported from it; only the
strategy differs. `gpufleet.strategies.prepare(..., "zero3")` hands the model to
`deepspeed.initialize` with ZeRO stage 3: parameters, gradients and optimizer state are
partitioned across ranks, and the DeepSpeed engine does the bf16 casts (on GPU), the gradient
clipping and the scheduler steps. `gpufleet.checkpoint.Checkpointer` saves the engine through
DeepSpeed's own `save_checkpoint` (its partitioned files, under `deepspeed/` in each step's
folder) and the data position and random generators beside it, so a second run resumes.
ZeRO-3 gathers and releases parameters with Python hooks on every module, which costs more per
step than FSDP2 on a model this small (measured on 2 H200s after the first step: 89-108 ms
against FSDP2's 35-46 ms, benchmarks/results/deepspeed_zero-2xH200-2026-11-30.log and
transformer_fsdp-2xH200-2026-11-30.log): the default is 2000 steps rather than FSDP's 4000.

Needs `pip install deepspeed`. On a machine without GPUs DeepSpeed runs on its CPU accelerator,
and its first start compiles a small communication extension (about 30 s, once: it is cached
in ~/.cache/torch_extensions or $TORCH_EXTENSIONS_DIR).
"""

import torch

from gpufleet import distributed, runtime, strategies
from transformer_fsdp import (CLIP_GRAD_NORM, SEED, ByteLM, adamw, architecture, command_line,
                              configure, fit, summarize, warmup_cosine)

FULL_STEPS = 2000  # measured at 89-108 ms each on 2 H200s: 228 s with the start-up


@distributed
def train(files: tuple, size: dict, steps: int, checkpoint_dir: str, *,
          offload_optimizer: bool = False, offload_params: bool = False) -> dict:
    runtime.setup()
    torch.manual_seed(SEED)  # ZeRO-3 partitions each rank's copy: they must start the same
    trainer = strategies.prepare(
        ByteLM(**architecture(size)),
        adamw(size["lr"]),  # a torch optimizer: DeepSpeed partitions its state
        "zero3",
        scheduler=warmup_cosine(size["warmup"], steps),  # stepped by the engine
        clip_grad_norm=CLIP_GRAD_NORM,  # becomes DeepSpeed's gradient_clipping
        offload_optimizer=offload_optimizer,
        offload_params=offload_params,
    )
    return fit(trainer, files, size, steps, checkpoint_dir)


if __name__ == "__main__":
    parser = command_line(__doc__.splitlines()[0], "checkpoints/deepspeed_zero")
    parser.add_argument("--offload-optimizer", action="store_true",
                        help="keep the optimizer state in CPU memory")
    parser.add_argument("--offload-params", action="store_true",
                        help="keep the parameters in CPU memory between uses")
    args, size, files = configure(parser, "checkpoints/deepspeed_zero", full_steps=FULL_STEPS)
    results = train.options(gpus=args.gpus).distributed(
        files, size, args.steps, args.checkpoint_dir, offload_optimizer=args.offload_optimizer,
        offload_params=args.offload_params)
    summarize(results)
