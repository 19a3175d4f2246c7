"""Decode-path bugs: models whose forward pass is right and whose cached decoding of a left-padded batch is not.

    pytest properties/ -m model --model properties.catalog.decode_bugs:one_token_positions_from_columns

Each bug shows only on the shape batched generation uses — prompts of different lengths left-padded, a prefill, then
one-token steps or chunks — and never on the shapes the older clauses draw (a forward pass, right-padded cached
decoding, one pinned left-padded decoding in chunks of two within 8 positions): MODEL-BATCHED-DECODING catches
them, MODEL-KV-CACHE, MODEL-PADDING and MODEL-BATCH do not (tests/test_differential.py checks both).

Most are one-method variants of ``TinyLM``, a decoder-only model written the way Hugging Face writes them: position
ids counted over the real tokens (``attention_mask.cumsum(-1) - 1``), an additive 4-D mask (causal with the cache's
offset, and padding; ``finfo.min`` where a key is not admissible), F.scaled_dot_product_attention and a per-layer
key/value cache. ``tiny_lm`` is the correct model; one bug is in the zoo's own attention instead.
"""
from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from properties.catalog.registry import bug, correct
from properties.core.subject import Subject
from zoo.nn.attention import MultiHeadAttention

__all__ = ["TinyLM", "KVCache", "tiny_lm", "one_token_positions_from_columns", "one_token_past_length_from_first_row",
           "one_token_step_attends_padding", "cache_keeps_last_block", "long_chunk_causal_top_left"]

VOCAB, D, HEADS, LAYERS, MAX_LEN, PAD = 64, 32, 2, 2, 32, 0
BLOCK = 8   # the cache's block (cache_keeps_last_block) and the chunked-prefill threshold (long_chunk_causal_top_left)


class KVCache:
    """Keys and values of every position decoded so far (padding included), per layer; ``length`` in columns."""

    def __init__(self):
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.length = 0

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if layer in self.keys:
            k, v = torch.cat([self.keys[layer], k], -2), torch.cat([self.values[layer], v], -2)
        self.keys[layer], self.values[layer] = k, v
        return k, v


class _Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))

    def forward(self, x, attn_mask, store):
        q, k, v = (rearrange(proj(x), "b l (h e) -> b h l e", h=HEADS) for proj in (self.q, self.k, self.v))
        k, v = store(k, v)
        if attn_mask is not None:   # a cache may hold fewer keys than positions (a window): its keys are the last
            attn_mask = attn_mask[..., -k.shape[-2]:]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        return self.o(rearrange(out, "b h l e -> b l (h e)"))


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.attn, self.norm2 = nn.LayerNorm(D), _Attention(), nn.LayerNorm(D)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

    def forward(self, x, attn_mask, store):
        x = x + self.attn(self.norm1(x), attn_mask, store)
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    """tokens (b, n), mask (b, past + n) True = real (None: all real), cache: a KVCache or None -> logits (b, n, V).
    Learned absolute positions, counted over the real tokens so that left padding moves none."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.positions = nn.Embedding(MAX_LEN, D)
        self.blocks = nn.ModuleList(_Block() for _ in range(LAYERS))
        self.norm, self.head = nn.LayerNorm(D), nn.Linear(D, VOCAB, bias=False)

    # The steps a decode path gets wrong, one method each (every bug below overrides exactly one).
    def position_ids(self, mask: torch.Tensor, n: int, past: int) -> torch.Tensor:
        """Positions of the n new tokens: the count of real tokens before each (padding gets 0)."""
        return (mask.long().cumsum(-1) - 1).clamp(min=0)[:, -n:]

    def attention_mask(self, mask: torch.Tensor, n: int, past: int, dtype) -> torch.Tensor:
        """(b, 1, n, past + n) additive: query i (column past + i) sees real keys j <= past + i."""
        causal = torch.ones(n, past + n, dtype=torch.bool, device=mask.device).tril(diagonal=past)
        allowed = causal[None, None] & mask[:, None, None, :]
        return torch.zeros(allowed.shape, dtype=dtype, device=mask.device).masked_fill(~allowed, torch.finfo(dtype).min)

    def cache_update(self, cache: KVCache, layer: int, k, v):
        return cache.update(layer, k, v)

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor | None = None, cache: KVCache | None = None):
        b, n = tokens.shape
        past = cache.length if cache is not None else 0
        mask = torch.ones(b, past + n, dtype=torch.bool, device=tokens.device) if mask is None else mask.bool()
        if mask.shape != (b, past + n):
            raise ValueError(f"mask of shape {tuple(mask.shape)}: expected (batch, positions so far) = {(b, past + n)}")
        positions = self.position_ids(mask, n, past)
        if n and int(positions.max()) >= MAX_LEN:
            raise ValueError(f"position {int(positions.max())} beyond max_len={MAX_LEN}")
        x = self.embed(tokens) + self.positions(positions)
        attn_mask = self.attention_mask(mask, n, past, x.dtype)
        for i, block in enumerate(self.blocks):
            store = (lambda k, v, i=i: self.cache_update(cache, i, k, v)) if cache is not None else (lambda k, v: (k, v))
            x = block(x, attn_mask, store)
        if cache is not None:
            cache.length += n
        return self.head(self.norm(x))


def _subject(cls) -> Subject:
    with torch.random.fork_rng():   # the same weights at every call (the float64 twin is a second call)
        torch.manual_seed(0)
        model = cls().eval()

    def decode_step(tokens, mask, state):
        cache = KVCache() if state is None else state
        return model(tokens, mask, cache), cache
    return Subject("decoder_only", lambda tokens, mask: model(tokens, mask), VOCAB, MAX_LEN, pad_id=PAD, module=model,
                   embedding=model.embed, decode_step=decode_step, left_padding=True, extrapolates=False)


# ------------------------------------------------------------------------------------------------- the bugs
class _PositionsFromColumns(TinyLM):
    def position_ids(self, mask, n, past):
        if past and n == 1:   # the bug: the one-token fast path numbers the token by the cache's length
            return torch.full((mask.shape[0], 1), past, dtype=torch.long, device=mask.device)
        return super().position_ids(mask, n, past)


class _PastLengthFromFirstRow(TinyLM):
    def position_ids(self, mask, n, past):
        if past and n == 1:   # the bug: one past length for the batch, read from the first row (attention_mask[0])
            return (mask[0].long().sum() - 1).expand(mask.shape[0], 1)
        return super().position_ids(mask, n, past)


class _LongChunkTopLeft(TinyLM):
    def attention_mask(self, mask, n, past, dtype):
        if past and n >= BLOCK:   # the bug: the chunked-prefill path aligns the causal mask top-left, as is_causal does
            causal = torch.ones(n, past + n, dtype=torch.bool, device=mask.device).tril()
            allowed = causal[None, None] & mask[:, None, None, :]
            return torch.zeros(allowed.shape, dtype=dtype, device=mask.device).masked_fill(~allowed,
                                                                                           torch.finfo(dtype).min)
        return super().attention_mask(mask, n, past, dtype)


class _CacheKeepsLastBlock(TinyLM):
    def cache_update(self, cache, layer, k, v):
        held = cache.keys[layer].shape[-2] if layer in cache.keys else 0
        if held and (held + k.shape[-2] - 1) // BLOCK > (held - 1) // BLOCK:
            # the bug: a write that opens a new block replaces the cache instead of appending the block
            cache.keys[layer], cache.values[layer] = k, v
            return k, v
        return super().cache_update(cache, layer, k, v)


class OneTokenStepIgnoresPadding(MultiHeadAttention):
    """The zoo's attention with a one-token fast path: a lone new query "needs no mask" (the causal mask admits every
    cached key), so the padding mask is dropped with it."""

    def forward(self, x, memory=None, *, key_padding_mask=None, cache=None, **kwargs):
        if cache is not None and cache.length and x.shape[1] == 1:
            key_padding_mask = None   # the bug
        return super().forward(x, memory, key_padding_mask=key_padding_mask, cache=cache, **kwargs)


# ------------------------------------------------------------------------------------------------ factories
@correct("HF-style decoder", level="model", mechanism="decode_bugs.TinyLM, the model the decode-path bugs vary")
def tiny_lm() -> Subject:
    """The correct model."""
    return _subject(TinyLM)


@bug("MODEL-BATCHED-DECODING", level="model",
     mechanism=("one-token cached steps number the new token by the cache length (columns, padding included) instead "
                "of the real tokens before it"))
def one_token_positions_from_columns() -> Subject:
    return _subject(_PositionsFromColumns)


def one_token_past_length_from_first_row() -> Subject:
    return _subject(_PastLengthFromFirstRow)


@bug("MODEL-BATCHED-DECODING", level="model",
     mechanism=("chunks of 8 or more tokens after cached keys take the chunked-prefill path, whose causal mask is "
                "aligned top-left (is_causal) and misses the cache's offset"))
def long_chunk_causal_top_left() -> Subject:
    return _subject(_LongChunkTopLeft)


@bug("MODEL-BATCHED-DECODING", level="model",
     mechanism=("a cache in blocks of 8 positions replaces its contents with the new chunk when a write opens a new "
                "block: it keeps only the last chunk"))
def cache_keeps_last_block() -> Subject:
    return _subject(_CacheKeepsLastBlock)


@bug("MODEL-BATCHED-DECODING", level="model",
     mechanism=("the zoo's attention drops the padding mask in one-token cached steps (a lone query \"needs no "
                "mask\"): padded keys are attended"))
def one_token_step_attends_padding():
    """The zoo's tiny rotary decoder (left-padding invariant) on OneTokenStepIgnoresPadding."""
    from properties.catalog import models
    from zoo.nn.models import DecoderOnly
    from zoo.nn.positional import RotaryPositions
    rotary = partial(RotaryPositions, d_model=models.D, max_len=models.MAX_LEN, heads=models.HEADS)
    return DecoderOnly(**{**models.parts(attention=OneTokenStepIgnoresPadding), "pos": rotary})


