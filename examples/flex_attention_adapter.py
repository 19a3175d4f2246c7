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
