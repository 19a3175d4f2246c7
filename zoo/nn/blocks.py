"""Encoder and decoder layers (Vaswani et al. 2017, section 3.1) with either norm placement.

    post (the paper):  x = Norm(x + Dropout(Sublayer(x)))
    pre  (GPT-2):      x = x + Dropout(Sublayer(Norm(x)))

Parts arrive as factories (Hydra partials): each is called with device= and dtype= only, so a
user's replacement module needs nothing else from the layer.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from zoo.nn.cache import KVCache
from zoo.nn.packing import Packing

__all__ = ["EncoderLayer", "DecoderLayer", "Residual", "NORM_PLACEMENTS", "skip_or_drop"]

NORM_PLACEMENTS = ("post", "pre")


def skip_or_drop(dropout: nn.Dropout, x: torch.Tensor) -> torch.Tensor:
    """dropout(x), without the module call when p = 0 (the identity, which draws nothing from the generator):
    on a GPU a small model's forward pass is bound by the host's time per call, and these were 8% of it."""
    return dropout(x) if dropout.p else x


class Residual(nn.Module):
    """One sub-layer with its residual connection, dropout and norm, in either placement: ``block(x, sublayer)``.
    Each layer holds one per sub-layer (``attn_block``, ``cross_block``, ``ffn_block``); another residual scheme is
    a subclass overriding ``forward`` (the suite's catalog swaps in broken ones this way)."""

    def __init__(self, norm: nn.Module, placement: str, dropout: float):
        super().__init__()
        if placement not in NORM_PLACEMENTS:
            raise ValueError(f"norm_placement={placement!r}: expected one of {NORM_PLACEMENTS}")
        self.norm, self.placement, self.dropout = norm, placement, nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, sublayer: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        if self.placement == "pre":
            return x + skip_or_drop(self.dropout, sublayer(self.norm(x)))
        return self.norm(x + skip_or_drop(self.dropout, sublayer(x)))


class EncoderLayer(nn.Module):
    def __init__(self, attention: Callable, ffn: Callable, norm: Callable, norm_placement: str = "post",
                 dropout: float = 0.0, *, device=None, dtype=None):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.self_attn, self.ffn = attention(**kw), ffn(**kw)
        self.attn_block = Residual(norm(**kw), norm_placement, dropout)
        self.ffn_block = Residual(norm(**kw), norm_placement, dropout)

    def forward(self, x, mask=None, positions=None):
        x = self.attn_block(x, lambda h: self.self_attn(h, key_padding_mask=mask, positions=positions))
        return self.ffn_block(x, self.ffn)


class DecoderLayer(nn.Module):
    """Masked self-attention, then (with cross_attention) attention over the encoder's memory, then FFN."""

    def __init__(self, attention: Callable, ffn: Callable, norm: Callable, norm_placement: str = "post",
                 dropout: float = 0.0, cross_attention: bool = True, *, device=None, dtype=None):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.self_attn, self.ffn = attention(**kw), ffn(**kw)
        self.attn_block = Residual(norm(**kw), norm_placement, dropout)
        self.cross_attn = attention(**kw) if cross_attention else None
        self.cross_block = Residual(norm(**kw), norm_placement, dropout) if cross_attention else None
        self.ffn_block = Residual(norm(**kw), norm_placement, dropout)

    def forward(self, x, memory=None, mask=None, memory_mask=None, positions=None, cache: KVCache | None = None,
                packing: Packing | None = None):
        # packing only when given: a plug-in attention (attention._target_) need not know the keyword.
        packed = {} if packing is None else {"packing": packing}
        x = self.attn_block(x, lambda h: self.self_attn(h, key_padding_mask=mask, is_causal=True,
                                                        positions=positions, cache=cache, **packed))
        if self.cross_attn is not None:
            # A static cache keeps the memory's keys and values (zoo.nn.static_cache); a KVCache is self-attention's.
            kept = {"cache": cache} if cache is not None and cache.keeps_cross else {}
            x = self.cross_block(x, lambda h: self.cross_attn(h, memory, key_padding_mask=memory_mask, **kept))
        return self.ffn_block(x, self.ffn)
