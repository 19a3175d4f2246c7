"""A user's multi-head attention module meeting the zoo's part contract: the worked example of ``--zoo``.

    PYTHONPATH=. pytest properties/ --zoo "attention._target_=examples.my_attention.MyAttention"
    PYTHONPATH=. python -m zoo attention._target_=examples.my_attention.MyAttention task=verify

Constructor: the keys of the attention config node (d_model, heads, kv_heads, bias, dropout, kernel) plus
device= and dtype=. Forward: (x, memory=None, *, key_padding_mask=None, is_causal=False, positions=None,
cache=None); ``positions`` is the model's position module, asked to rotate queries and keys and for a score
bias (zoo/nn/positional.py). The attribute names q_proj, k_proj, v_proj, out_proj let the suite's float64 oracle read
the weights (MHA-ORACLE); without them that clause is skipped and the black-box clauses still run.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MyAttention(nn.Module):
    def __init__(self, d_model, heads, kv_heads=None, bias=True, dropout=0.0, kernel="torch", *, device=None,
                 dtype=None):
        super().__init__()
        kv_heads = heads if kv_heads is None else kv_heads
        if heads < 1 or d_model % heads:  # MHA-HEAD-COUNT: a bad head count is a clear error
            raise ValueError(f"heads={heads} must be a positive divisor of d_model={d_model}")
        if kv_heads < 1 or heads % kv_heads:
            raise ValueError(f"kv_heads={kv_heads} must be a positive divisor of heads={heads}")
        self.heads, self.kv_heads = heads, kv_heads
        self.head_dim, self.dropout, self.layer_index = d_model // heads, dropout, 0
        kw = dict(bias=bias, device=device, dtype=dtype)
        self.q_proj = nn.Linear(d_model, d_model, **kw)
        self.k_proj = nn.Linear(d_model, self.kv_heads * self.head_dim, **kw)
        self.v_proj = nn.Linear(d_model, self.kv_heads * self.head_dim, **kw)
        self.out_proj = nn.Linear(d_model, d_model, **kw)

    def _split(self, t, heads):  # (b, l, heads * e) -> (b, heads, l, e)
        return t.unflatten(-1, (heads, self.head_dim)).transpose(1, 2)

    def forward(self, x, memory=None, *, key_padding_mask=None, is_causal=False, positions=None, cache=None):
        source = x if memory is None else memory
        q = self._split(self.q_proj(x), self.heads)
        k, v = self._split(self.k_proj(source), self.kv_heads), self._split(self.v_proj(source), self.kv_heads)
        offset = cache.length if cache is not None else 0
        if positions is not None:
            q, k = positions.rotate(q, offset), positions.rotate(k, offset)
        if cache is not None:
            k, v = cache.extend(self.layer_index, k, v)
        l, s = q.shape[-2], k.shape[-2]
        mask = torch.ones(l, s, dtype=torch.bool, device=x.device).tril(diagonal=s - l) if is_causal else None
        if key_padding_mask is not None:
            keys = key_padding_mask[:, None, None, :]
            mask = keys if mask is None else mask & keys
        bias = positions.score_bias(l, s, offset, self.heads) if positions is not None else None
        if bias is not None:
            bias = bias.to(q.dtype)
            mask = bias if mask is None else bias.masked_fill(~mask, float("-inf"))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.kv_heads != self.heads,
                                             dropout_p=self.dropout if self.training else 0.0)
        return self.out_proj(out.transpose(1, 2).flatten(-2))
