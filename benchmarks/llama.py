"""A small Llama-style decoder shared by the benchmarks.

RMSNorm, rotary position embeddings, attention through
``F.scaled_dot_product_attention`` (causal), SwiGLU MLP, untied output head.
Every linear is bias-free, as in Llama. ``forward(tokens, targets)`` returns
the mean cross-entropy loss (written out, see ``cross_entropy``), so a compiled forward covers the loss too.

Built on any device, "meta" included (nothing materialised): rotary tables are
computed inside ``forward`` from the input's device, there are no buffers.

    cfg = LlamaConfig.llama2_7b()             # 32 x 4096, 32 heads, ffn 11008, vocab 32000
    with torch.device("meta"):
        model = Llama(cfg)
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    dim: int = 256
    n_layers: int = 8
    n_heads: int = 4
    ffn_dim: int = 704
    vocab_size: int = 1024
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    @classmethod
    def llama2_7b(cls, n_layers: int = 32) -> "LlamaConfig":
        return cls(dim=4096, n_layers=n_layers, n_heads=32, ffn_dim=11008, vocab_size=32000)

    @classmethod
    def llama3_70b(cls, n_layers: int = 80) -> "LlamaConfig":
        """Llama-3-70B's sizes (without its grouped-query attention: this model's heads all have keys)."""
        return cls(dim=8192, n_layers=n_layers, n_heads=64, ffn_dim=28672, vocab_size=128256, rope_theta=500000.0)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed * self.weight


def rotary(seq_len: int, head_dim: int, theta: float, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (seq_len, head_dim) for rotate-half RoPE."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x, cos, sin):
        b, s, d = x.shape
        q, k, v = (w(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, d))


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x, cos, sin):
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if not any(p.is_meta for p in self.parameters()):
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Small normal weights (std 0.02, output projections scaled by depth), unit norms."""
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                std = 0.02 / (2 * self.cfg.n_layers) ** 0.5 if name.endswith(("wo.weight", "w2.weight")) else 0.02
                p.normal_(0.0, std)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        cos, sin = rotary(tokens.shape[1], self.cfg.head_dim, self.cfg.rope_theta, h.device, h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin)
        logits = self.output(self.norm(h)).float()
        return cross_entropy(logits, targets)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy, written out: ``F.cross_entropy`` (nll_loss) on
    meta tensors under torch.compile hands DTensor's backward a plain tensor
    (AttributeError '_local_tensor'), so meta-device projections could not run."""
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return (torch.logsumexp(logits, dim=-1) - picked).mean()


def param_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
