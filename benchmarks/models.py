"""A Llama-style decoder (RMSNorm, rotary attention, SwiGLU) for the throughput benchmarks.

Sizes are named in ``CONFIGS``; ``flops_per_token`` is the count the MFU targets use:
6 · parameters + 12 · layers · d_model · sequence (forward and backward, attention included).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Config:
    d_model: int
    layers: int
    heads: int
    hidden: int
    vocab: int
    seq: int
    batch: int  # per GPU

    def flops_per_token(self, params: int) -> float:
        return 6 * params + 12 * self.layers * self.d_model * self.seq


CONFIGS = {
    # the FSDP target: ~1.2B parameters
    "1.2b": Config(d_model=2048, layers=16, heads=16, hidden=8192, vocab=32000, seq=2048, batch=8),
    # GPT-2-small sized, for DDP scaling
    "124m": Config(d_model=768, layers=12, heads=12, hidden=2048, vocab=32000, seq=1024, batch=16),
    # a smoke test on CPU
    "tiny": Config(d_model=64, layers=2, heads=4, hidden=128, vocab=256, seq=32, batch=2),
}


class Attention(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.heads = c.heads
        self.qkv = nn.Linear(c.d_model, 3 * c.d_model, bias=False)
        self.out = nn.Linear(c.d_model, c.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.attn_norm = nn.RMSNorm(c.d_model)
        self.attn = Attention(c)
        self.mlp_norm = nn.RMSNorm(c.d_model)
        self.gate = nn.Linear(c.d_model, c.hidden, bias=False)
        self.up = nn.Linear(c.d_model, c.hidden, bias=False)
        self.down = nn.Linear(c.hidden, c.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Decoder(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.embed = nn.Embedding(c.vocab, c.d_model)
        self.layers = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.norm = nn.RMSNorm(c.d_model)
        self.head = nn.Linear(c.d_model, c.vocab, bias=False)
        self.config = c
        cos, sin = _rope(c)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def init_weights(self) -> None:
        """Initialise every parameter and buffer in place: what FSDP calls on each rank's
        shards when the model was built on the meta device."""
        for module in self.modules():
            if module is not self and hasattr(module, "reset_parameters"):
                module.reset_parameters()
        cos, sin = _rope(self.config)
        self.cos.copy_(cos)
        self.sin.copy_(sin)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        cos, sin = self.cos[: tokens.shape[1]], self.sin[: tokens.shape[1]]
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.head(self.norm(x))


def _rope(c: Config) -> tuple[torch.Tensor, torch.Tensor]:
    half = c.d_model // c.heads // 2
    freqs = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float32) / half))
    angles = torch.outer(torch.arange(c.seq, dtype=torch.float32), freqs)
    return angles.cos(), angles.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = x.float().chunk(2, dim=-1)
    cos, sin = cos[None, None], sin[None, None]
    return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1).type_as(x)


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def build(config_name: str, device: torch.device) -> tuple[Decoder, int]:
    """The named model, made on ``device`` from seed 0, and its parameter count."""
    torch.manual_seed(0)
    with torch.device(device):
        model = Decoder(CONFIGS[config_name])
    return model, parameter_count(model)
