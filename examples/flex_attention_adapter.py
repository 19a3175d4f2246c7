"""flash-attn's ``flash_attn_func`` API on PyTorch's ``flex_attention``: score_mod and mask_mod built from the flash
arguments (softcap and ALiBi as a score_mod, causal and window as a mask_mod, both bottom-right aligned).

    pytest properties/ --kernel-api flash --kernel examples/flex_attention_adapter.py:flash_attn_func

flex_attention runs eagerly here (CPU included: slower than compiled, and PyTorch warns once); wrap it in
``torch.compile`` for speed. Dropout is declined (NotImplementedError), so the dropout clauses are skipped.
"""
import math

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    if dropout_p > 0 or return_attn_probs:
        raise NotImplementedError("flex_attention has no dropout and returns no probabilities")
    (b, lq, h, d), lk, (left, right) = q.shape, k.shape[1], window_size
    if lq == 0 or lk == 0:
        return q.new_zeros(b, lq, h, v.shape[-1])
    offset = lk - lq                                     # bottom-right: query i sits at key position i + offset
    wide = torch.float64 if q.dtype == torch.float64 else torch.float32
    slopes = None if alibi_slopes is None else alibi_slopes.to(wide).expand(b, h)

    def score_mod(score, bi, hi, qi, kj):
        if softcap > 0:
            score = softcap * torch.tanh(score / softcap)
        if slopes is not None:
            score = score - slopes[bi, hi] * (qi + offset - kj).abs()
        return score

    def mask_mod(bi, hi, qi, kj):
        ok = (kj <= qi + offset) | (not causal)
        ok = ok & ((kj <= qi + offset + right) | (right < 0))
        return ok & ((kj >= qi + offset - left) | (left < 0))

    block_mask = create_block_mask(mask_mod, None, None, lq, lk, device=q.device)
    out = flex_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), score_mod=score_mod,
                         block_mask=block_mask, scale=1 / math.sqrt(d) if softmax_scale is None else softmax_scale,
                         enable_gqa=k.shape[2] != h)
    return out.transpose(1, 2)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    """The SDPA signature on ``flex_attention`` (``--kernel examples/flex_attention_adapter.py:scaled_dot_product_attention``):
    is_causal as a top-left mask_mod, grouped heads, any number of leading dims. It declines what it does not
    build (an attn_mask, dropout); on the CPU, flex_attention itself declines a forward whose inputs require grad
    ("FlexAttention does not support backward on CPU"), so the gradient clauses are skipped there with that message."""
    if attn_mask is not None or dropout_p > 0:
        raise NotImplementedError("this flex_attention adapter supports no attn_mask and no dropout")
    lead, (l, e), s = query.shape[:-2], query.shape[-2:], key.shape[-2]
    if l == 0 or s == 0:
        return query.new_zeros(*lead, l, value.shape[-1])
    q, k, v = (t.reshape(-1, *t.shape[-3:]) if t.dim() >= 3 else t.reshape(1, 1, *t.shape[-2:])
               for t in (query, key, value))

    def causal(bi, hi, qi, kj):
        return kj <= qi

    block_mask = create_block_mask(causal, None, None, l, s, device=query.device) if is_causal else None
    out = flex_attention(q, k, v, block_mask=block_mask, scale=1 / math.sqrt(e) if scale is None else scale,
                         enable_gqa=enable_gqa and k.shape[1] != q.shape[1])
    return out.reshape(*lead, l, value.shape[-1])
