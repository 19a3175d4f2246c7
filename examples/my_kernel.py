"""A user's attention kernel with the SDPA signature, written from the paper: the worked example of
``--kernel``.

    pytest properties/ --kernel examples/my_kernel.py:attention
"""
from __future__ import annotations

import math

import torch


def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        groups = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(groups, dim=-3), value.repeat_interleave(groups, dim=-3)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    compute = torch.promote_types(query.dtype, torch.float32)
    scores = (query.to(compute) * scale) @ key.to(compute).transpose(-1, -2)
    allowed = torch.ones(scores.shape[-2:], dtype=torch.bool, device=query.device)
    if is_causal:
        allowed = allowed.tril()
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        allowed = allowed & attn_mask
    elif attn_mask is not None:
        scores = scores + attn_mask.to(compute)
    scores = scores.masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row with no admissible key: zeros
    if dropout_p > 0:
        weights = torch.nn.functional.dropout(weights, dropout_p)
    return (weights @ value.to(compute)).to(query.dtype)
