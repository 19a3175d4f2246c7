"""Normalisation over each token's features (never across tokens or the batch).

LayerNorm (Ba et al. 2016; Vaswani et al. 2017 section 5.1 "Add & Norm"): (x - mean) / sqrt(var + eps) * g + b,
mean and biased variance over the d features of one token. Seed 004 says "statistics across
tokens": that is wrong for the Transformer, which normalises each token on its own.
RMSNorm (Zhang & Sennrich 2019): x / sqrt(mean(x^2) + eps) * g.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LayerNorm", "RMSNorm"]


class LayerNorm(nn.Module):
    def __init__(self, d_model: int, eps: float = 1e-5, bias: bool = True, *, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(d_model, device=device, dtype=dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class RMSNorm(nn.Module):
    def __init__(self, d_model: int, eps: float = 1e-6, *, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
