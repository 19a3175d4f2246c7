"""Tiny float64 models and the attention projections that tests/test_zoo_features.py and tests/test_zoo_packing.py
build their checks from."""
from __future__ import annotations

import torch

from zoo.config.builder import build_model
from zoo.nn.attention import MultiHeadAttention

F64 = torch.float64
SMALL = ("d_model=16", "heads=4", "layers=2", "d_ff=32", "vocab_size=32", "max_len=24", "dropout=0")


def small_model(*overrides: str, dtype=F64):
    """A model of the SMALL size with the overrides, seeded, in eval mode."""
    torch.manual_seed(0)
    return build_model([*SMALL, *overrides], dtype=dtype).eval()


def head_projections(mha: MultiHeadAttention, x: torch.Tensor):
    """q, k, v of the attention module for x, split into heads (b, h, l, e)."""
    q = mha.split_heads(mha.q_proj(x), mha.heads)
    k = mha.split_heads(mha.k_proj(x), mha.kv_heads)
    v = mha.split_heads(mha.v_proj(x), mha.kv_heads)
    return q, k, v
