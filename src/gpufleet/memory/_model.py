"""The model an estimate is about: built on the meta device from a Hugging Face config, or
copied from a module (``_trace.twin``); LoRA adapters and activation checkpointing put on the
copy; its parameters counted; the inputs of one pass."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gpufleet.errors import ConfigError
from gpufleet.memory import _trace
from gpufleet.memory._arith import Counts

DEFAULT_SEQ_LEN = 2048  # for a language model given without seq_len (capped by its positions)


# ---------------------------------------------------------------------------- building


def is_hf_config(source: Any) -> bool:
    return type(source).__module__.startswith("transformers.") and hasattr(source, "to_dict") \
        and hasattr(source, "model_type")


def load_config(source: str | os.PathLike | dict) -> Any:
    """A Hugging Face config from a ``config.json`` (or its folder), a dict, or a model id
    already in the local cache; nothing is downloaded."""
    try:
        from transformers import AutoConfig
    except ImportError:
        raise ConfigError("estimating from a Hugging Face config needs Transformers: pip install transformers") from None
    if isinstance(source, dict):
        kind = source.get("model_type")
        if not kind:
            raise ConfigError("the config dict has no 'model_type'; give the whole config.json")
        return AutoConfig.for_model(kind, **{k: v for k, v in source.items() if k != "model_type"})
    path = Path(source)
    try:
        if path.exists():
            return AutoConfig.from_pretrained(str(path))
        return AutoConfig.from_pretrained(str(source), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model={str(source)!r} is neither a config.json, a folder holding one, nor a "
                          f"model in the local Hugging Face cache ({exc.__class__.__name__}); nothing is "
                          "downloaded: give the path of its config.json") from None


def build_from_config(config: Any) -> torch.nn.Module:
    """The config's model on the meta device: a causal language model where the config has
    one, else its base model."""
    from transformers import AutoModel, AutoModelForCausalLM

    with torch.device("meta"):
        try:
            return AutoModelForCausalLM.from_config(config)
        except ValueError:  # no causal language model for this config
            return AutoModel.from_config(config)


# ---------------------------------------------------------------------------- changes to the copy


def add_lora(model: torch.nn.Module, rank: int, targets: Any) -> int:
    """Freeze ``model`` and add rank-``rank`` adapters to its targeted linear layers (every
    linear layer but the output head for ``"all-linear"``, else those whose name ends with one
    of ``targets``), as PEFT's LoRA does; returns how many layers got one."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ConfigError(f"lora_rank={rank!r} must be a whole number ≥ 1 (or None for no LoRA)")
    names = [targets] if isinstance(targets, str) else list(targets)
    head = _output_head(model)
    chosen = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)
              and (names == ["all-linear"] and m is not head
                   or any(name == t or name.endswith("." + t) for t in names))]
    if not chosen:
        raise ConfigError(f"lora_targets={targets!r} matches no linear layer of {type(model).__name__}; "
                          "give names such as 'q_proj', or 'all-linear'")
    for p in model.parameters():
        p.requires_grad_(False)
    for name, linear in chosen:
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, _LoRA(linear, rank))
    return len(chosen)


class _LoRA(torch.nn.Module):
    """A frozen linear layer plus B·A, as PEFT computes it (no dropout)."""

    def __init__(self, base: torch.nn.Linear, rank: int):
        super().__init__()
        self.base = base
        dtype = base.weight.dtype
        self.lora_A = torch.nn.Parameter(torch.empty(rank, base.in_features, dtype=dtype, device="meta"))
        self.lora_B = torch.nn.Parameter(torch.empty(base.out_features, rank, dtype=dtype, device="meta"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_A.t()) @ self.lora_B.t()


def _output_head(model: torch.nn.Module) -> Any:
    get = getattr(model, "get_output_embeddings", None)
    return get() if callable(get) else None


def checkpoint_blocks(model: torch.nn.Module) -> None:
    """Recompute each block's activations in backward (Hugging Face's own switch where the
    model has it, else each repeated block's forward wrapped, as gpufleet's FSDP does)."""
    if getattr(model, "supports_gradient_checkpointing", False):
        kwargs = {"use_reentrant": False}
        enable: Any = getattr(model, "activation_checkpointing_enable", None)  # Transformers 5's name
        if callable(enable):
            enable(activation_checkpointing_kwargs=kwargs)
            return
        enable = getattr(model, "gradient_checkpointing_enable", None)
        if callable(enable):
            enable(gradient_checkpointing_kwargs=kwargs)
            return
    from torch.utils.checkpoint import checkpoint

    for block in blocks(model):
        inner = block.forward

        def forward(*args: Any, _inner: Any = inner, **kwargs: Any) -> Any:
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        block.forward = forward  # type: ignore[method-assign]


def blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks (``_trace.stack``), or none."""
    found = _trace.stack(model)
    return found[1] if found is not None else []


# ---------------------------------------------------------------------------- counting


def count(model: torch.nn.Module) -> Counts:
    params = list(model.parameters())  # each shared parameter once
    units = blocks(model)
    sizes = [sum(p.numel() for p in u.parameters()) for u in units]
    largest = units[sizes.index(max(sizes))] if units else None
    floating = [p for p in params if p.is_floating_point()]
    return Counts(
        parameters=sum(p.numel() for p in params),
        trainable=sum(p.numel() for p in params if p.requires_grad),
        unit=max(sizes, default=0),
        unit_trainable=sum(p.numel() for p in largest.parameters() if p.requires_grad) if largest else 0,
        blocks=sum(sizes),
        weight_bytes=floating[0].element_size() if floating else 4,
    )


# ---------------------------------------------------------------------------- inputs


Inputs = Callable[[int], tuple[tuple, dict]]


def token_inputs(model: torch.nn.Module, seq_len: int) -> Inputs:
    """A language model's inputs: ``input_ids`` (and ``labels`` where it takes them, so that
    its own loss, with its logits in fp32, is part of the pass)."""
    import inspect

    takes_labels = "labels" in inspect.signature(model.forward).parameters

    def make(batch: int) -> tuple[tuple, dict]:
        ids = torch.zeros(batch, seq_len, dtype=torch.long, device=_trace.DEVICE)
        return (), {"input_ids": ids, **({"labels": ids} if takes_labels else {})}

    return make


def user_inputs(inputs: Any) -> Inputs:
    """``inputs``: a function of the micro-batch size returning the forward's arguments (a
    tuple, a dict of keyword arguments, or one tensor)."""
    if not callable(inputs):
        raise ConfigError(f"inputs={inputs!r} must be a function of the micro-batch size that returns "
                          "the forward's arguments, e.g. lambda b: torch.randn(b, 3, 224, 224)")

    def make(batch: int) -> tuple[tuple, dict]:
        made = inputs(batch)
        return _as_call(made, lambda t: torch.empty(t.shape, dtype=t.dtype, device=_trace.DEVICE))

    return make


def scaled_inputs(args: tuple, kwargs: dict) -> Inputs:
    """The inputs of a real call, with every tensor whose first dimension is the batch's
    resized to the traced batch (the real tensors are never read)."""
    leaves = [t for t in _tensors((args, kwargs))]
    batch = leaves[0].shape[0] if leaves and leaves[0].dim() else None

    def make(size: int) -> tuple[tuple, dict]:
        def fake(t: torch.Tensor) -> torch.Tensor:
            shape = (size, *t.shape[1:]) if batch is not None and t.dim() and t.shape[0] == batch else t.shape
            return torch.empty(shape, dtype=t.dtype, device=_trace.DEVICE)

        return _as_call((args, kwargs), fake, pair=True)

    return make


def sequence_length(call: Any) -> int | None:
    """The tokens per sample of a language model's call: the second dimension of its first
    integer tensor of two dimensions (``input_ids``); None for other inputs."""
    for t in _tensors(call):
        if t.dim() == 2 and not t.is_floating_point() and t.dtype != torch.bool:
            return int(t.shape[1])
    return None


def _tensors(tree: Any) -> list[torch.Tensor]:
    from torch.utils._pytree import tree_flatten

    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _as_call(made: Any, fake: Callable[[torch.Tensor], torch.Tensor], pair: bool = False) -> tuple[tuple, dict]:
    from torch.utils._pytree import tree_map_only

    made = tree_map_only(torch.Tensor, fake, made)
    if pair:
        return made
    if isinstance(made, dict):
        return (), made
    if isinstance(made, tuple):
        return made, {}
    return (made,), {}
