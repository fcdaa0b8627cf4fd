"""``gpufleet estimate``: the memory estimate from the command line.

    gpufleet estimate path/to/config.json --strategy fsdp --world-size 8 --micro-batch 4 --seq-len 4096
    gpufleet estimate model.py:build --inputs model.py:example --strategy all --json

MODEL is a Hugging Face ``config.json`` (or its folder), or ``FILE.py:NAME`` /
``package.module:NAME`` naming an ``nn.Module`` class or a function that returns a module,
called with no argument on the meta device (nothing is allocated). ``--strategy all`` estimates
every strategy. Output: a table (rich in a terminal), or JSON.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

from gpufleet.errors import ConfigError
from gpufleet.memory._arith import DTYPES, OPTIMIZERS, PRECISIONS, STRATEGIES
from gpufleet.memory._gpus import COMMON


def add_parser(sub: Any) -> None:
    """The ``estimate`` subcommand, on the ``gpufleet`` parser's subparsers."""
    p = sub.add_parser(
        "estimate", help="estimate the GPU memory of a training step, before anything starts",
        description="Estimate the peak GPU memory per rank of one training step (weights, gradients, "
        "optimizer state, activations traced from the model, overhead), and the largest micro-batch "
        "that fits each common GPU. MODEL: a Hugging Face config.json (or its folder), or FILE.py:NAME / "
        "package.module:NAME naming an nn.Module class or a function returning one (built on the meta "
        "device).")
    p.add_argument("model", help="config.json, its folder, or FILE.py:NAME / package.module:NAME")
    p.add_argument("--strategy", default="ddp", help=f"{', '.join(STRATEGIES)}, several joined by commas, "
                   "or all (default ddp)")
    p.add_argument("--world-size", type=int, default=1, metavar="N", help="GPUs training together (default 1)")
    p.add_argument("--micro-batch", type=int, default=1, metavar="B", help="samples per GPU per forward pass")
    p.add_argument("--seq-len", type=int, metavar="TOKENS", help="tokens per sample (language models; "
                   "default 2048, or the model's positions if fewer)")
    p.add_argument("--precision", choices=PRECISIONS, default="bf16", help="compute in bf16 (default) or fp32")
    p.add_argument("--dtype", choices=tuple(DTYPES), help="how the weights are stored (default: the module's, "
                   "fp32 for a config)")
    p.add_argument("--optimizer", choices=tuple(OPTIMIZERS), default="adamw", help="(default adamw)")
    p.add_argument("--lora-rank", type=int, metavar="R", help="train LoRA adapters of rank R only")
    p.add_argument("--lora-targets", default="all-linear", metavar="NAMES",
                   help="all-linear (default) or layer names joined by commas: q_proj,v_proj")
    p.add_argument("--activation-checkpointing", action="store_true", help="recompute activations in backward")
    p.add_argument("--offload", action="store_true", help="FSDP's CPU offload, or ZeRO's optimizer "
                   "(and zero3's parameter) offload")
    p.add_argument("--inputs", metavar="FILE.py:NAME", help="a function of the micro-batch size returning "
                   "the forward's arguments (needed for a module that is not a Hugging Face model)")
    p.add_argument("--gpu", action="append", metavar="NAME", help=f"size for these GPUs only "
                   f"(repeatable; known: {', '.join(COMMON)})")
    p.add_argument("--json", action="store_true", help="print the estimate as JSON")
    p.set_defaults(command=run)


def run(args: argparse.Namespace) -> int:
    from gpufleet.memory.estimate import estimate

    strategies = _strategies(args.strategy)
    model = _model(args.model)
    inputs = _named(args.inputs, "--inputs") if args.inputs else None
    targets = args.lora_targets if args.lora_targets == "all-linear" else args.lora_targets.split(",")
    found = [estimate(model, s, world_size=args.world_size, micro_batch=args.micro_batch, seq_len=args.seq_len,
                      precision=args.precision, dtype=args.dtype, optimizer=args.optimizer,
                      lora_rank=args.lora_rank, lora_targets=targets,
                      activation_checkpointing=args.activation_checkpointing, offload=args.offload,
                      inputs=inputs, gpus=args.gpu)
             for s in strategies]
    if args.json:
        data = [e.as_dict() for e in found]
        print(json.dumps(data if len(data) > 1 else data[0], indent=1))
        return 0
    _show(found)
    return 0


def _show(found: list[Any]) -> None:
    if sys.stdout.isatty():
        from rich.console import Console

        console = Console()
        for e in found:
            console.print(e)
            console.print()
        return
    print("\n\n".join(str(e) for e in found))


def _strategies(text: str) -> list[str]:
    if text == "all":
        return list(STRATEGIES)
    chosen = [s.strip().lower() for s in text.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in STRATEGIES]
    if unknown or not chosen:
        raise ConfigError(f"--strategy {text}: choose among {', '.join(STRATEGIES)}, several joined by commas, "
                          "or all")
    return chosen


def _model(text: str) -> Any:
    """A config path as it is; FILE.py:NAME or module:NAME built on the meta device."""
    if ":" not in text or Path(text).exists():
        return text
    made = _named(text, "MODEL")
    import torch

    if isinstance(made, torch.nn.Module):
        return made
    with torch.device("meta"):
        model = made()
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"{text} returned {type(model).__name__}, not an nn.Module")
    return model


def _named(text: str, what: str) -> Any:
    """The object NAME of FILE.py:NAME or package.module:NAME."""
    where, _, name = text.rpartition(":")
    if not where or not name:
        raise ConfigError(f"{what} {text!r}: give FILE.py:NAME or package.module:NAME")
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise ConfigError(f"{what} {text!r}: {where} not found")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        assert spec is not None and spec.loader is not None  # a .py file always has a loader
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, str(path.parent.absolute()))  # its own imports, as python FILE.py would
        try:
            spec.loader.exec_module(module)
        finally:
            sys.path.remove(str(path.parent.absolute()))
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as exc:
            raise ConfigError(f"{what} {text!r}: cannot import {where}: {exc}") from None
    if not hasattr(module, name):
        raise ConfigError(f"{what} {text!r}: {where} has no {name}")
    return getattr(module, name)
