"""Position-wise feed-forward network (Vaswani et al. 2017, section 3.3), applied to each position alike.

    relu:      FFN(x) = max(0, x W1 + b1) W2 + b2                  (the paper)
    gelu:      FFN(x) = GELU(x W1 + b1) W2 + b2, exact erf form    (BERT)
    gelu_tanh: the same with GELU's tanh approximation             (GPT-2)
    swiglu:    FFN(x) = (SiLU(x W_gate) * (x W1)) W2               (Shazeer 2020; LLaMA)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["FeedForward", "ACTIVATIONS"]

ACTIVATIONS = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
    "swiglu": F.silu,
}


class FeedForward(nn.Module):
    def __init__(self, d_model: int, d_ff: int, activation: str = "relu", bias: bool = True,
                 dropout: float = 0.0, *, device=None, dtype=None):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation={activation!r}: expected one of {sorted(ACTIVATIONS)}")
        kw = dict(bias=bias, device=device, dtype=dtype)
        self.activation_name = activation
        self.activation = ACTIVATIONS[activation]
        self.up = nn.Linear(d_model, d_ff, **kw)
        self.gate = nn.Linear(d_model, d_ff, **kw) if activation == "swiglu" else None
        self.down = nn.Linear(d_ff, d_model, **kw)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate is not None:
            hidden = self.activation(self.gate(x)) * self.up(x)
        else:
            hidden = self.activation(self.up(x))
        return self.down(self.dropout(hidden) if self.dropout.p else hidden)  # p = 0: the identity, no call
