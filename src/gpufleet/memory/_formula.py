"""The stated fallback for a Hugging Face model whose pass cannot be traced: activations by
formula, on the safe side.

Per transformer layer, at 16 bits (Korthikanti et al. 2022, "Reducing Activation Recomputation
in Large Transformer Models", without sequence parallelism): ``s·b·h·(15 + 19·i/(4h)) +
5·a·s²·b`` bytes, for ``s`` tokens, ``b`` samples, hidden size ``h``, ``a`` attention heads
and an MLP of ``i`` active intermediate features per token (``intermediate_size`` × experts per
token for a mixture of experts). The ``5·a·s²·b`` term keeps the attention scores that fused
attention (FlashAttention, SDPA) does not store, hence the safe side. fp32 compute doubles it.
With activation checkpointing each layer keeps its input (``2·s·b·h``) and one layer is whole
again while it is recomputed. The output layer adds its logits: 2 bytes each, and their fp32
copy and gradient (4 + 4) for the loss.
"""

from __future__ import annotations

from typing import Any


def activations(config: Any, seq_len: int, precision: str, checkpointing: bool) -> tuple[int, int, str]:
    """(fixed bytes, bytes per sample, the formula in words)."""
    text = getattr(config, "get_text_config", lambda: config)()
    h = _first(text, "hidden_size", "n_embd", "d_model")
    layers = _first(text, "num_hidden_layers", "n_layer", "num_layers")
    heads = _first(text, "num_attention_heads", "n_head", "num_heads")
    vocab = _first(text, "vocab_size")
    inner = _first(text, "moe_intermediate_size", "intermediate_size", "n_inner", "ffn_dim", default=4 * h)
    experts = _first(text, "num_experts_per_tok", "num_experts_per_token", "moe_topk", default=1)
    s = seq_len
    layer = s * h * (15 + 19 * inner * experts / (4 * h)) + 5 * heads * s * s
    scale = 2 if precision == "fp32" else 1
    kept = layers * (2 * s * h if checkpointing else layer) + (layer if checkpointing else 0)
    logits = s * vocab * (2 * scale + 8)
    per_sample = int(scale * kept + logits)
    how = (f"Korthikanti et al. per layer s·b·h·(15 + 19·i/4h) + 5·a·s²·b bytes at 16 bits, "
           f"attention scores kept (safe side), {layers} layers"
           + (", checkpointed" if checkpointing else "") + ", logits in fp32 for the loss")
    return 0, per_sample, how


def _first(config: Any, *names: str, default: int | None = None) -> int:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    if default is not None:
        return default
    raise ValueError(f"the config has none of {', '.join(names)}: no formula applies")
