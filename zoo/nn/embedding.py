"""Token embeddings, optionally multiplied by sqrt(d_model) (Vaswani et al. 2017, section 3.4)."""
from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["TokenEmbedding"]


class TokenEmbedding(nn.Module):
    def __init__(self, vocab_size: int, d_model: int, scale: bool = False, *, device=None, dtype=None):
        super().__init__()
        self.vocab_size = vocab_size
        self.embedding = nn.Embedding(vocab_size, d_model, device=device, dtype=dtype)
        self.multiplier = math.sqrt(d_model) if scale else 1.0

    @property
    def weight(self) -> nn.Parameter:
        return self.embedding.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= self.vocab_size):
            raise ValueError(f"token ids must lie in [0, {self.vocab_size}), got [{int(tokens.min())}, {int(tokens.max())}]")
        return self.embedding(tokens) * self.multiplier
