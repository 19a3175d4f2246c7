"""Token embeddings, optionally multiplied by sqrt(d_model) (Vaswani et al. 2017, section 3.4)."""
from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["TokenEmbedding", "embedding_table"]


def embedding_table(num: int, dim: int, *, device=None, dtype=None) -> nn.Embedding:
    """``nn.Embedding(num, dim)``; on the meta device without initial values (shapes only: a model card, a config's
    check), since drawing them there, the first time in a process, imports torch's Python meta kernels (over 1 s)."""
    if torch.device(device or "cpu").type == "meta":
        weight = torch.empty(num, dim, device="meta", dtype=dtype or torch.get_default_dtype())
        return nn.Embedding(num, dim, _weight=weight)
    return nn.Embedding(num, dim, device=device, dtype=dtype)


class TokenEmbedding(nn.Module):
    def __init__(self, vocab_size: int, d_model: int, scale: bool = False, *, device=None, dtype=None):
        super().__init__()
        self.vocab_size = vocab_size
        self.embedding = embedding_table(vocab_size, d_model, device=device, dtype=dtype)
        self.multiplier = math.sqrt(d_model) if scale else 1.0

    @property
    def weight(self) -> nn.Parameter:
        return self.embedding.weight

    def check(self, *tokens: torch.Tensor) -> None:
        """Refuse ids outside [0, vocab_size) in one line, before nn.Embedding reads them (on a GPU an id out of
        range is a device-side assert). Reading the extremes waits for the device: one synchronisation for all the
        tensors given. Inside a compiled graph (a decoding step fed the ids the model chose) nothing is read."""
        tokens = [t for t in tokens if t.numel()]
        if not tokens or torch.compiler.is_compiling():
            return
        extremes = torch.stack([torch.stack(torch.aminmax(t)) for t in tokens]).tolist()
        low, high = min(e[0] for e in extremes), max(e[1] for e in extremes)
        if low < 0 or high >= self.vocab_size:
            raise ValueError(f"token ids must lie in [0, {self.vocab_size}), got [{low}, {high}]")

    def forward(self, tokens: torch.Tensor, check: bool = True) -> torch.Tensor:
        """check=False: the caller has checked the ids (TokenEmbedding.check)."""
        if check:
            self.check(tokens)
        x = self.embedding(tokens)
        return x if self.multiplier == 1.0 else x * self.multiplier  # x * 1.0 is x: no kernel for it
