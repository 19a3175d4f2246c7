"""Broken models, one realistic bug each: factories for ``--model`` (no arguments, returning a zoo model).

    pytest properties/ -m model --model properties.catalog.models:causal_mask_dropped_with_padding

Every factory is the tiny zoo model (d_model 32, 2 heads, 2 layers, vocabulary 64, max_len 16) with one part
replaced by a subclass that changes one line; the ``@bug`` above each factory declares its catalog entry.
"""
from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from einops import rearrange

from properties.catalog.registry import bug, correct
from zoo.nn.attention import MultiHeadAttention
from zoo.nn.ffn import FeedForward
from zoo.nn.blocks import DecoderLayer
from zoo.nn.models import DecoderOnly, EncoderDecoder, EncoderOnly
from zoo.nn.norm import LayerNorm
from zoo.nn.positional import SinusoidalPositions

__all__ = ["D", "HEADS", "VOCAB", "MAX_LEN", "parts", "NoCausalMask", "CausalDroppedWithPadding",
           "QueryPaddingMask", "PaddingMaskInverted", "SelfInsteadOfCross", "DropoutInEval", "BatchStatisticsNorm",
           "PositionsNotAdded", "CacheOffsetIgnored", "LocalWindowOneMore",
           "no_causal_mask", "causal_mask_dropped_with_padding", "query_padding_mask", "padding_mask_inverted",
           "cross_attends_to_decoder", "memory_padding_mask_dropped", "dropout_in_eval", "batch_statistics_norm",
           "cache_offset_ignored", "positions_not_added", "alternating_windows", "local_window_one_more"]

D, HEADS, VOCAB, MAX_LEN = 32, 2, 64, 16


def parts(attention=MultiHeadAttention, ffn=FeedForward, pos=SinusoidalPositions, norm=LayerNorm) -> dict:
    """The keyword arguments of a tiny zoo model, with any part replaced."""
    return dict(vocab_size=VOCAB, d_model=D, layers=2, max_len=MAX_LEN,
                attention=partial(attention, d_model=D, heads=HEADS), ffn=partial(ffn, d_model=D, d_ff=64),
                norm=partial(norm, d_model=D), pos=partial(pos, d_model=D, max_len=MAX_LEN))


# ------------------------------------------------------------------------------------------ the broken parts
class NoCausalMask(MultiHeadAttention):
    """Drops the causal mask: every position sees the whole sequence (is_causal never forwarded)."""

    def forward(self, x, memory=None, *, is_causal=False, **kwargs):
        return super().forward(x, memory, is_causal=False, **kwargs)


class CausalDroppedWithPadding(MultiHeadAttention):
    """The zoo's attention with one condition lost: the explicit causal mask is built only when a cache
    offset is present (``if is_causal and offset:``), and with a padding mask the kernel gets
    ``is_causal=False`` — so the mask is causal without padding and bidirectional with it."""

    def mask(self, l, s, offset, key_padding_mask, is_causal, bias, device):
        mask = None
        if is_causal and offset:  # the bug: "or key_padding_mask is not None" missing
            mask = torch.ones(l, s, dtype=torch.bool, device=device).tril(diagonal=s - l)
        if key_padding_mask is not None:
            padding = rearrange(key_padding_mask.to(torch.bool), "b s -> b 1 1 s")
            mask = padding if mask is None else mask & padding
        return mask


class QueryPaddingMask(MultiHeadAttention):
    """Applies the padding mask to the queries (zeroing padded rows of the output) instead of the keys."""

    def forward(self, x, memory=None, *, key_padding_mask=None, **kwargs):
        out = super().forward(x, memory, **kwargs)
        return out if key_padding_mask is None else out * key_padding_mask[..., None].to(out.dtype)


class PaddingMaskInverted(MultiHeadAttention):
    """Passes the padding mask in torch.nn's polarity (True = ignore) to code that expects True = real key:
    ``key_padding_mask=~mask``, or a mask of ones for real tokens fed to nn.MultiheadAttention."""

    def forward(self, x, memory=None, *, key_padding_mask=None, **kwargs):
        if key_padding_mask is not None:
            key_padding_mask = ~key_padding_mask.to(torch.bool)
        return super().forward(x, memory, key_padding_mask=key_padding_mask, **kwargs)


class SelfInsteadOfCross(MultiHeadAttention):
    """Cross-attention that attends (causally) over the decoder's own states instead of the encoder's."""

    def forward(self, x, memory=None, *, key_padding_mask=None, is_causal=False, **kwargs):
        if memory is not None:
            return super().forward(x, None, is_causal=True, **kwargs)
        return super().forward(x, None, key_padding_mask=key_padding_mask, is_causal=is_causal, **kwargs)


class DropoutInEval(FeedForward):
    """Dropout with training=True hard-coded (``F.dropout(h, p)`` without ``training=self.training``)."""

    def forward(self, x):
        return F.dropout(super().forward(x), p=0.1, training=True)


class BatchStatisticsNorm(LayerNorm):
    """BatchNorm-style statistics: mean and variance of each feature over the batch and positions
    (``x.mean(dim=(0, 1))``) instead of over each token's features."""

    def forward(self, x):
        mean = x.mean(dim=(0, 1), keepdim=True)
        var = x.var(dim=(0, 1), keepdim=True, unbiased=False)
        return (x - mean) / torch.sqrt(var + self.eps) * self.weight + self.bias


class PositionsNotAdded(SinusoidalPositions):
    """Computes the position codes and forgets to add them."""

    def forward(self, x, offset=0):
        codes = self.table[offset: offset + x.shape[1]]  # noqa: F841  (the defect)
        return x


class CacheOffsetIgnored(SinusoidalPositions):
    """Numbers positions from 0 in every call, so cached decoding restarts the positions at each step."""

    def forward(self, x, offset=0):
        return super().forward(x, 0)


class LocalWindowOneMore(MultiHeadAttention):
    """A sliding window of W that admits W + 1 keys (transformers #39408's off-by-one), in the windowed layers only:
    in a model whose windowed and global layers alternate, the global ones hide it from the outputs."""

    def mask(self, *args, window=None, **kwargs):
        return super().mask(*args, window=None if window is None else window + 1, **kwargs)


class _MemoryMaskDropped(DecoderLayer):
    """Cross-attention called without the source padding mask (memory_key_padding_mask not passed on)."""

    def forward(self, x, memory=None, mask=None, memory_mask=None, positions=None, cache=None):
        return super().forward(x, memory, mask, None, positions, cache)


# ------------------------------------------------------------------------------------------------ factories
def _factory(family, **replaced):
    """A factory for ``--model``: the tiny ``family`` model with the ``replaced`` parts, a fresh model each call
    (tests/test_repro.py builds a correct model with it)."""
    return partial(family, **parts(**replaced))


@bug("MODEL-CAUSAL", "MODEL-FACTORISATION", "MODEL-KV-CACHE", level="model",
     mechanism="the decoder's self-attention never receives is_causal")
def no_causal_mask():
    return DecoderOnly(**parts(attention=NoCausalMask))


@bug("MODEL-CAUSAL", "MODEL-PADDING", "MODEL-KV-CACHE", level="model",
     mechanism="the causal mask is built only without a padding mask (one condition lost)")
def causal_mask_dropped_with_padding():
    return DecoderOnly(**parts(attention=CausalDroppedWithPadding))


@bug("MODEL-PADDING", level="model",
     mechanism="the padding mask applied to the queries (output rows) instead of the keys")
def query_padding_mask():
    return EncoderOnly(**parts(attention=QueryPaddingMask))


@bug("MODEL-PADDING", level="model",
     mechanism="padding mask passed in torch.nn's polarity (True = ignore): real keys masked")
def padding_mask_inverted():
    return EncoderOnly(**parts(attention=PaddingMaskInverted))


@bug("MODEL-DEPENDENCE", level="model",
     mechanism="cross-attention attends over the decoder's own states, not the encoder's")
def cross_attends_to_decoder():
    return EncoderDecoder(**parts(attention=SelfInsteadOfCross))


@bug("MODEL-DETERMINISM", level="model",
     mechanism="F.dropout(..., training=True) hard-coded: dropout active in eval mode")
def dropout_in_eval():
    return DecoderOnly(**parts(ffn=DropoutInEval))


@bug("MODEL-BATCH", "MODEL-PADDING", level="model",
     mechanism="BatchNorm-style statistics over the batch and positions instead of per token")
def batch_statistics_norm():
    return EncoderOnly(**parts(norm=BatchStatisticsNorm))


@bug("MODEL-PERMUTATION", level="model", mechanism="position codes computed but never added to the embeddings")
def positions_not_added():
    return EncoderOnly(**parts(pos=PositionsNotAdded))


@bug("MODEL-KV-CACHE", level="model", mechanism="positions restart at 0 in every cached decoding step (offset ignored)")
def cache_offset_ignored():
    return DecoderOnly(**parts(pos=CacheOffsetIgnored))


LOCAL_WINDOW = 4


@correct("alternating windows", level="model",
         mechanism=("the tiny zoo decoder, a window of 4 in its even layers and none in its odd ones (the model "
                    "local_window_one_more varies)"))
def alternating_windows(attention=MultiHeadAttention):
    """The tiny decoder with a window of LOCAL_WINDOW in its even layers and none in its odd ones (Gemma 2's
    layout)."""
    model = DecoderOnly(**parts(attention=attention))
    for index, layer in enumerate(model.decoder.layers):
        layer.self_attn.window = LOCAL_WINDOW if index % 2 == 0 else None
    return model


@bug("MODEL-WINDOW", level="model",
     mechanism=("a window of 4 that admits 5 keys, in the windowed layers of a model whose windowed and global "
                "layers alternate (the global ones hide it from the outputs)"))
def local_window_one_more():
    return alternating_windows(LocalWindowOneMore)


@bug("MODEL-PADDING", level="model", mechanism="cross-attention called without the source padding mask")
def memory_padding_mask_dropped():
    model = EncoderDecoder(**parts())
    for layer in model.decoder.layers:
        layer.__class__ = _MemoryMaskDropped
    return model
