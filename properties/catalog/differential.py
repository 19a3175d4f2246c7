"""Fast models that differ from their reference, correct fast models, and the reference they are compared with:
factories for ``--model`` and ``--reference`` (MODEL-DIFF-FORWARD, MODEL-DIFF-GRADIENT, MODEL-DIFF-DECODE).

    pytest properties/ -m model --model properties.catalog.differential:softmax_scale_off \\
        --reference properties.catalog.differential:reference

Every model is the zoo's tiny decoder (d_model 32, 2 heads, 2 layers, vocabulary 64) with the attention of a "fast"
implementation, and with biases drawn like a trained model's (the zoo initialises them to 0, which would hide a
dropped bias). ``reference(subject)`` is a copy of the model under test — the same weights — with every attention
layer back on the zoo's plain MultiHeadAttention and its einsum kernel (``math``): what an engineer trusts. Each
defect keeps the model consistent with itself, so only a reference can tell.
"""
from __future__ import annotations

import copy
import math
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from properties.catalog.registry import bug, correct
from zoo.nn.attention import MultiHeadAttention
from zoo.nn.kernel import math_attention, resolve_kernel, torch_attention
from zoo.nn.memory_efficient import memory_efficient_attention
from zoo.nn.models import DecoderOnly, EncoderDecoder
from zoo.nn.positional import RotaryPositions

__all__ = ["reference", "softmax_scale_off", "attention_bias_dropped", "one_layer_wrong_backward",
           "split_kv_decode_drops_last_block", "memory_efficient", "torch_encoder_decoder", "SPLIT_BLOCK"]

MAX_LEN = 64      # room for MODEL-DIFF-DECODE's 64 positions, past split_kv's blocks of 32
SPLIT_BLOCK = 32


def _tiny(family=DecoderOnly, *, kernel=math_attention, attention=MultiHeadAttention, seed: int = 0):
    """The zoo's tiny model (rotary positions) on ``attention`` with ``kernel``; weights seeded, biases N(0, 0.02)."""
    from properties.catalog import models
    rotary = partial(RotaryPositions, d_model=models.D, max_len=MAX_LEN, heads=models.HEADS)
    kwargs = {**models.parts(attention=partial(attention, kernel=kernel)), "pos": rotary, "max_len": MAX_LEN}
    with torch.random.fork_rng():   # the same weights at every call: the float64 twin is a second call
        torch.manual_seed(seed)
        model = family(**kwargs)
        for module in model.modules():
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.normal_(module.bias, std=0.02)
    return model


def reference(subject):
    """The model under test's weights in the zoo's plain attention with the math kernel (a deep copy)."""
    model = copy.deepcopy(subject.module)
    for module in model.modules():
        if isinstance(module, MultiHeadAttention):
            module.__class__ = MultiHeadAttention
            module.kernel = math_attention
    return model


# ------------------------------------------------------------------------------------------- the fast parts
_AGAINST_REFERENCE = ("--reference", f"{__name__}:reference")   # every model here is checked against reference()


def _scale_2_percent_off(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                         enable_gqa=False):
    """A fused kernel whose softmax scale is 1.02/sqrt(d_k) (a constant folded in with the wrong value)."""
    scale = (1.0 / math.sqrt(query.shape[-1]) if scale is None else scale) * 1.02
    return math_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


class FusedQKVWithoutBias(MultiHeadAttention):
    """Queries, keys and values from one fused GEMM over the concatenated weights — without their biases (a fused
    projection written for models that have none, such as Llama, reused on one that has). The rest is the zoo's:
    in self-attention the fused outputs stand in for the three projections' (forward hooks for the one call)."""

    def forward(self, x, memory=None, **kwargs):
        if memory is not None:   # cross-attention: the zoo's separate projections
            return super().forward(x, memory, **kwargs)
        projections = (self.q_proj, self.k_proj, self.v_proj)
        weights = [p.weight for p in projections]
        fused = F.linear(x, torch.cat(weights)).split([w.shape[0] for w in weights], dim=-1)
        hooks = [p.register_forward_hook(lambda module, args, out, t=t: t) for p, t in zip(projections, fused)]
        try:
            return super().forward(x, **kwargs)
        finally:
            for hook in hooks:
                hook.remove()


def _split_kv_decode(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """Split-KV decoding (Flash-Decoding): a single query over more than SPLIT_BLOCK keys is computed over blocks of
    SPLIT_BLOCK keys — and the last, partial block is dropped (s // SPLIT_BLOCK blocks). Other calls are exact."""
    s = key.shape[-2]
    if query.shape[-2] == 1 and s > SPLIT_BLOCK:
        kept = (s // SPLIT_BLOCK) * SPLIT_BLOCK
        key, value = key[..., :kept, :], value[..., :kept, :]
        if attn_mask is not None and attn_mask.shape[-1] != 1:
            attn_mask = attn_mask[..., :kept]
    return math_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


# ------------------------------------------------------------------------------------------------ factories
@bug("MODEL-DIFF-FORWARD", "MODEL-DIFF-GRADIENT", "MODEL-DIFF-DECODE", level="model", extra=_AGAINST_REFERENCE,
     mechanism="a fused kernel's softmax scale is 2% off: 1.02/sqrt(d_k)")
def softmax_scale_off():
    return _tiny(kernel=_scale_2_percent_off)


@bug("MODEL-DIFF-FORWARD", "MODEL-DIFF-GRADIENT", "MODEL-DIFF-DECODE", level="model", extra=_AGAINST_REFERENCE,
     mechanism="a fused QKV projection drops the query, key and value biases")
def attention_bias_dropped():
    return _tiny(attention=FusedQKVWithoutBias)


@bug("MODEL-DIFF-GRADIENT", level="model", extra=_AGAINST_REFERENCE,
     mechanism=("layer 1's attention kernel has an exact forward and a backward without the rowsum term "
                "D = rowsum(dO ∘ O)"))
def one_layer_wrong_backward():
    """Layer 1's self-attention on a kernel with an exact forward and a backward without the rowsum term."""
    model = _tiny()
    model.decoder.layers[1].self_attn.kernel = resolve_kernel("properties.catalog.backward:rowsum_term_dropped")
    return model


@bug("MODEL-DIFF-DECODE", level="model", extra=_AGAINST_REFERENCE,
     mechanism="split-KV decoding of one query over > 32 keys drops the last, partial block of keys (s // 32 blocks)")
def split_kv_decode_drops_last_block():
    return _tiny(kernel=_split_kv_decode)


def _memory_efficient_block16(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                              enable_gqa=False):
    return memory_efficient_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, block=16)


@correct("memory_efficient vs math", level="model", extra=_AGAINST_REFERENCE,
         mechanism="the zoo's memory-efficient kernel (16-key blocks) against the math kernel, the same weights")
def memory_efficient():
    """Correct: the zoo's FlashAttention-2 style kernel, with blocks of 16 keys so that decoding crosses blocks."""
    return _tiny(kernel=_memory_efficient_block16)


@correct("torch vs math (enc-dec)", level="model", extra=_AGAINST_REFERENCE,
         mechanism="an encoder-decoder on PyTorch's SDPA against the math kernel, the same weights")
def torch_encoder_decoder():
    """Correct: an encoder-decoder on PyTorch's fused kernel (F.scaled_dot_product_attention)."""
    return _tiny(EncoderDecoder, kernel=torch_attention)


