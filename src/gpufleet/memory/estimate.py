"""``estimate()``: the peak memory of one GPU for one training step, before anything runs.

    from gpufleet import memory

    found = memory.estimate("Llama-3.2-1B/config.json", "fsdp", world_size=8, micro_batch=4,
                            seq_len=4096, activation_checkpointing=True)
    print(found)                  # the table; found.total, found.fits["H100 80GB"], ...

Weights, gradients and optimizer state come from the strategy's arithmetic (``_arith``);
activations from a traced forward and backward pass of the model itself (``_trace``), or, for
a Hugging Face model whose pass cannot be traced, from a stated formula (``_formula``).
"""

from __future__ import annotations

import os
from typing import Any

from gpufleet.errors import ConfigError
from gpufleet.memory._arith import DTYPES, Counts, Setup, check_setup, static
from gpufleet.memory._gpus import check_gpus
from gpufleet.memory._result import Estimate

__all__ = ["estimate", "estimate_for_call"]


def estimate(
    model: Any,
    strategy: str = "ddp",
    *,
    world_size: int = 1,
    micro_batch: int = 1,
    seq_len: int | None = None,
    precision: str = "bf16",
    dtype: str | None = None,
    optimizer: str = "adamw",
    lora_rank: int | None = None,
    lora_targets: Any = "all-linear",
    activation_checkpointing: bool = False,
    offload: bool = False,
    inputs: Any = None,
    loss: Any = None,
    gpus: Any = None,
) -> Estimate:
    """Estimate the peak memory per GPU of training ``model`` with ``strategy``.

    ``model``: an ``nn.Module`` (built on the meta device, or anywhere: it is never run), a
    Hugging Face config, or the path of a ``config.json`` (or of its folder). ``strategy``:
    ``"ddp"``, ``"fsdp"``, ``"zero1"``, ``"zero2"`` or ``"zero3"``; ``offload``: FSDP's CPU
    offload, or ZeRO's optimizer offload (and parameter offload with ``"zero3"``).
    ``precision``: ``"bf16"`` (compute in bf16, weights in their dtype: gpufleet's default on
    GPU) or ``"fp32"``. ``dtype``: how the weights are stored (``"fp32"``, ``"bf16"``;
    default: the module's own dtype, fp32 for a config). ``optimizer``: ``"adamw"``,
    ``"adam"``, ``"sgd"``, ``"sgd-momentum"`` or ``"adam8bit"``. ``lora_rank`` and
    ``lora_targets`` (``"all-linear"`` or layer names such as ``["q_proj", "v_proj"]``): train
    LoRA adapters only. ``seq_len``: tokens per sample of a language model (default 2048).

    For a module that is not a Hugging Face model, ``inputs`` is a function of the micro-batch
    size returning its forward's arguments (``lambda b: torch.randn(b, 3, 224, 224)``), and
    ``loss`` a function of its output (default: the output's ``.loss``, else its sum).
    ``gpus``: the GPUs to find the largest micro-batch for (default: the common ones).
    """
    setup = Setup(strategy.lower() if isinstance(strategy, str) else strategy, world_size, precision,
                  optimizer, offload)
    check_setup(setup)
    _check_batch(micro_batch, seq_len)
    sizes = check_gpus(gpus)
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"dtype={dtype!r} must be one of {', '.join(DTYPES)} (how the weights are stored)")
    from gpufleet.memory import _model

    copy, config = _copy_of(model, _model)
    if dtype is not None or config is not None:
        _retype(copy, dtype or "fp32")
    if lora_rank is not None:
        _model.add_lora(copy, lora_rank, lora_targets)
    if activation_checkpointing:
        _model.checkpoint_blocks(copy)
    if inputs is None and config is None:
        raise ConfigError(f"{type(copy).__name__} is not a Hugging Face model, so its inputs are unknown: "
                          "pass inputs=lambda b: <its forward's arguments for b samples>")
    length = _seq_len(seq_len, config, inputs)
    make = _model.user_inputs(inputs) if inputs is not None else _model.token_inputs(copy, length or 1)
    return _estimated(copy, config, setup, micro_batch, length, make, loss, lora_rank,
                      activation_checkpointing, sizes)


def estimate_for_call(model: Any, call: tuple[tuple, dict], *, strategy: str, world_size: int,
                      micro_batch: int, precision: str, optimizer: str, activation_checkpointing: bool,
                      gpus: Any = None) -> Estimate:
    """The estimate of a model as it trains now (its own dtype, LoRA and checkpointing; never
    run), for the arguments of one of its calls (``call``: args and kwargs, real or meta)."""
    from gpufleet.memory import _model

    setup = Setup(strategy, world_size, precision, optimizer, False)
    check_setup(setup)
    copy, config = _copy_of(model, _model)
    if activation_checkpointing:
        _model.checkpoint_blocks(copy)
    make = _model.scaled_inputs(*call)
    tokens = _model.sequence_length(call)
    return _estimated(copy, config, setup, micro_batch, tokens, make, None, None, activation_checkpointing,
                      check_gpus(gpus))


def _estimated(copy: Any, config: Any, setup: Setup, micro_batch: int, seq_len: int | None, make: Any,
               loss: Any, lora_rank: int | None, checkpointing: bool, sizes: dict[str, int]) -> Estimate:
    from gpufleet.memory import _model

    counts = _model.count(copy)
    parts = static(counts, setup)
    fixed, per_sample, traced, note = _activations(copy, config, setup, counts, seq_len, make, loss, checkpointing)
    return Estimate(
        model=f"{type(copy).__name__} ({_count(counts.parameters)} parameters, "
              f"{_count(counts.trainable)} trainable)",
        parameters=counts.parameters, trainable=counts.trainable, strategy=setup.strategy,
        world_size=setup.world_size, micro_batch=micro_batch, seq_len=seq_len, precision=setup.precision,
        dtype={4: "fp32", 2: "bf16"}.get(counts.weight_bytes, "fp32"), optimizer=setup.optimizer,
        lora_rank=lora_rank, activation_checkpointing=checkpointing, offload=setup.offload,
        weights=parts.weights, grads=parts.grads, optimizer_state=parts.optimizer, step=parts.step,
        gathered=parts.gathered, overhead=parts.overhead, activations_fixed=fixed,
        activations_per_sample=per_sample, traced=traced, notes=(*parts.notes, note), gpus=sizes,
    )


def _check_batch(micro_batch: Any, seq_len: Any) -> None:
    if isinstance(micro_batch, bool) or not isinstance(micro_batch, int) or micro_batch < 1:
        raise ConfigError(f"micro_batch={micro_batch!r} must be a whole number ≥ 1 (samples per GPU per "
                          "forward pass)")
    if seq_len is not None and (isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1):
        raise ConfigError(f"seq_len={seq_len!r} must be a whole number of tokens ≥ 1")


def _copy_of(model: Any, _model: Any) -> tuple[Any, Any]:
    """The meta copy to count and trace, and the Hugging Face config it came from (if any)."""
    import torch

    if isinstance(model, torch.nn.Module):
        from gpufleet.memory._trace import twin

        config = getattr(model, "config", None)
        return twin(model), config if _model.is_hf_config(config) else None
    if _model.is_hf_config(model):
        return _model.build_from_config(model), model
    if isinstance(model, (str, os.PathLike, dict)):
        config = _model.load_config(model)
        return _model.build_from_config(config), config
    raise ConfigError(f"model={model!r} is neither an nn.Module, a Hugging Face config, nor the path of "
                      "a config.json")


def _retype(copy: Any, dtype: str) -> None:
    import torch

    from gpufleet.memory._trace import retype

    retype(copy, {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype])


def _seq_len(seq_len: int | None, config: Any, inputs: Any) -> int | None:
    if config is None or inputs is not None:
        return seq_len
    if seq_len is not None:
        return seq_len
    positions = getattr(config, "max_position_embeddings", None)
    from gpufleet.memory._model import DEFAULT_SEQ_LEN

    return min(DEFAULT_SEQ_LEN, positions) if isinstance(positions, int) else DEFAULT_SEQ_LEN


def _activations(copy: Any, config: Any, setup: Setup, counts: Counts, seq_len: int | None, make: Any,
                 loss: Any, checkpointing: bool) -> tuple[int, int, bool, str]:
    """(fixed, per sample, traced, how they were found)."""
    import torch

    from gpufleet.memory import _trace

    mixed = setup.precision == "bf16" and counts.weight_bytes == 4
    # DDP computes under autocast; FSDP and ZeRO compute with bf16 copies of the weights.
    autocast = mixed and setup.strategy == "ddp"
    if mixed and not autocast:
        _trace.retype(copy, torch.bfloat16)
    try:
        fixed, per_sample = _trace.trace(copy, make, loss or _trace.default_loss, autocast)
    except Exception as exc:  # noqa: BLE001  # any failure of the pass: the stated fallback
        reason = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        if config is None:
            return 0, 0, False, (f"activations NOT counted: the forward pass could not be traced ({reason}); "
                                 "the total leaves them out")
        from gpufleet.memory._formula import activations

        try:
            fixed, per_sample, how = activations(config, seq_len or 1, setup.precision, checkpointing)
        except ValueError as missing:
            return 0, 0, False, f"activations NOT counted: not traced ({reason}), and {missing}"
        return fixed, per_sample, False, f"activations by formula, not traced ({reason}): {how}"
    how = "autocast to bf16" if autocast else ("bf16 weights" if mixed or counts.weight_bytes == 2 else "fp32")
    return fixed, per_sample, True, f"activations traced from one forward and backward pass ({how})"


def _count(n: int) -> str:
    for size, unit in ((10**12, "T"), (10**9, "B"), (10**6, "M"), (10**3, "k")):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)
