"""Bugs that hide below a length: models exact on every input shorter than a threshold, by construction, and wrong
past it (issue 25). Factories for ``--model``::

    pytest properties/ -m model --model properties.catalog.scale_bugs:rotary_positions_in_bf16

Each is a one-method variant of ``ScaleLM``, a decoder-only model written the way Hugging Face writes them
(position ids counted over the real tokens, an additive mask, a per-layer key/value cache) at max_len 1280, with
rotary, ALiBi or learned absolute positions and an optional sliding window. A bug overrides the one step it gets
wrong; below its threshold that step computes exactly what the correct one does (tests/test_scale.py checks it):

- rotary_positions_in_bf16: positions cast to the model's dtype (bfloat16) before the angles (transformers #29285):
  integers up to 256 are exact in bfloat16, so nothing changes before position 257. MODEL-SHIFT (as built).
- window_admits_one_more: a sliding window of 16 that admits 17 keys (transformers #39408): no pair of positions is
  16 apart in a sequence of at most 16. MODEL-WINDOW.
- cache_keeps_last_100: a decode cache that keeps only its last 100 positions (vllm #2064): nothing is dropped
  before 100 positions are cached. MODEL-KV-CACHE at length.
- alibi_positions_clamped: ALiBi distances from positions clamped at the trained length 256 (a bias precomputed for
  the trained length and read with clamped indices): no position reaches 256 below it. MODEL-SHIFT.
- position_table_clamped: a learned position table of 1024 rows read with indices clamped at its last row, in a
  model that declares max_len 1280 (a context extended in the config, not in the table). MODEL-SHIFT.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from properties.catalog.decode_bugs import KVCache as Cache   # every column decoded so far, per layer
from properties.catalog.registry import bug, correct
from properties.core.subject import Subject
from zoo.nn.positional import alibi_slopes

__all__ = ["ScaleLM", "scale_lm", "rotary_positions_in_bf16", "window_admits_one_more", "cache_keeps_last_100",
           "alibi_positions_clamped", "position_table_clamped", "correct_twin", "scale_subject", "TWINS"]

VOCAB, D, HEADS, LAYERS, MAX_LEN, PAD = 64, 32, 4, 2, 1280, 0
WINDOW, KEPT, TRAINED, TABLE = 16, 100, 256, 1024
E = D // HEADS


class ScaleLM(nn.Module):
    """tokens (b, n), mask (b, past + n) True = real (None: all real), cache, offset (added to every position) ->
    logits (b, n, V). positions: "rotary", "alibi" or "learned" (a table of MAX_LEN rows); window: W keys or None."""

    def __init__(self, positions: str = "rotary", window: int | None = None):
        super().__init__()
        self.scheme, self.window = positions, window
        self.embed = nn.Embedding(VOCAB, D)
        self.table = nn.Embedding(MAX_LEN, D) if positions == "learned" else None
        self.qkv = nn.ModuleList(nn.Linear(D, 3 * D) for _ in range(LAYERS))
        self.out = nn.ModuleList(nn.Linear(D, D) for _ in range(LAYERS))
        self.mlp = nn.ModuleList(nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))
                                 for _ in range(LAYERS))
        self.norms = nn.ModuleList(nn.LayerNorm(D) for _ in range(2 * LAYERS + 1))
        self.head = nn.Linear(D, VOCAB, bias=False)
        self.register_buffer("slopes", alibi_slopes(HEADS, dtype=torch.float64), persistent=False)
        with torch.no_grad():   # queries and keys 4x PyTorch's default init: sharp attention, whose positions matter
            for projection in self.qkv:   # as a trained model's do (at the default, rounding hides them in bfloat16)
                projection.weight[: 2 * D] *= 4

    # ---------------------------------------------------------------- the steps a bug overrides (one each)
    def angles(self, positions: torch.Tensor) -> torch.Tensor:
        """Rotary angles (b, l, E/2) in float32 (rotate-half layout, base 10000)."""
        inverse = 10000.0 ** (-torch.arange(0, E, 2, dtype=torch.float32, device=positions.device) / E)
        return positions.float()[..., None] * inverse

    def distances(self, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        """|i - j| between the positions of queries (b, n) and keys (b, s): (b, 1, n, s), for ALiBi."""
        return (query[:, None, :, None] - key[:, None, None, :]).abs()

    def table_rows(self, positions: torch.Tensor) -> torch.Tensor:
        """The rows of the learned table that positions read."""
        return positions

    def allowed(self, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        """(b, 1, n, s): causal, and within the window (W keys, the query's own included)."""
        offset = query[:, None, :, None] - key[:, None, None, :]
        ok = offset >= 0
        return ok if self.window is None else ok & (offset < self.window)

    def cache_update(self, cache: Cache, layer: int, k, v):
        return cache.update(layer, k, v)

    # ------------------------------------------------------------------------------------------ the model
    def _rotate(self, t: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        angle = torch.cat([self.angles(positions)] * 2, -1)[:, None]            # (b, 1, l, E)
        first, second = t.float().chunk(2, -1)
        return (t.float() * angle.cos() + torch.cat([-second, first], -1) * angle.sin()).to(t.dtype)

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor | None = None, cache: Cache | None = None,
                offset: int = 0) -> torch.Tensor:
        b, n = tokens.shape
        past = cache.length if cache is not None else 0
        mask = torch.ones(b, past + n, dtype=torch.bool, device=tokens.device) if mask is None else mask.bool()
        if mask.shape != (b, past + n):
            raise ValueError(f"mask of shape {tuple(mask.shape)}: expected (batch, positions so far) = {(b, past + n)}")
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0) + offset           # of every column so far
        if int(positions.max()) >= MAX_LEN:
            raise ValueError(f"position {int(positions.max())} beyond max_len={MAX_LEN}")
        x = self.embed(tokens)
        if self.table is not None:
            x = x + self.table(self.table_rows(positions[:, -n:]))
        for i in range(LAYERS):
            projected = self.qkv[i](self.norms[2 * i](x)).chunk(3, -1)
            q, k, v = (rearrange(t, "b l (h e) -> b h l e", h=HEADS) for t in projected)
            if self.scheme == "rotary":
                q, k = self._rotate(q, positions[:, -n:]), self._rotate(k, positions[:, -n:])
            if cache is not None:
                k, v = self.cache_update(cache, i, k, v)
            keys = positions[:, -k.shape[-2]:]                      # a cache may hold fewer keys than columns
            allowed = self.allowed(positions[:, -n:], keys) & mask[:, None, None, -k.shape[-2]:]
            bias = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device)
            if self.scheme == "alibi":
                bias = -self.slopes.to(q.dtype)[:, None, None] * self.distances(positions[:, -n:], keys).to(q.dtype)
            bias = bias.masked_fill(~allowed, torch.finfo(q.dtype).min)
            attended = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
            x = x + self.out[i](rearrange(attended, "b h l e -> b l (h e)"))
            x = x + self.mlp[i](self.norms[2 * i + 1](x))
        if cache is not None:
            cache.length += n
        return self.head(self.norms[-1](x))


def scale_subject(cls, positions="rotary", window=None, dtype=torch.float32) -> Subject:
    with torch.random.fork_rng():   # the same weights at every call (the float64 twin is a second call)
        torch.manual_seed(0)
        model = cls(positions, window).to(dtype).eval()

    def decode_step(tokens, mask, state):
        cache = Cache() if state is None else state
        return model(tokens, mask, cache), cache
    return Subject("decoder_only", lambda tokens, mask: model(tokens, mask), VOCAB, MAX_LEN, pad_id=PAD, module=model,
                   embedding=model.embed, decode_step=decode_step, left_padding=True, extrapolates=False,
                   relative_positions=positions != "learned", window=None if window is None else (window,) * LAYERS,
                   shifted=lambda tokens, mask, offset: model(tokens, mask, offset=offset))


# ------------------------------------------------------------------------------------------------- the bugs
class _PositionsInModelDtype(ScaleLM):
    def angles(self, positions):
        dtype = self.embed.weight.dtype   # the bug: positions in the model's dtype (exact integers up to 256 in bf16)
        return super().angles(positions.to(dtype))


class _WindowOneMore(ScaleLM):
    def allowed(self, query, key):
        offset = query[:, None, :, None] - key[:, None, None, :]
        return (offset >= 0) & (offset <= self.window)   # the bug: W + 1 keys


class _RingCache(ScaleLM):
    def cache_update(self, cache, layer, k, v):
        k, v = super().cache_update(cache, layer, k, v)
        cache.keys[layer], cache.values[layer] = k[..., -KEPT:, :], v[..., -KEPT:, :]   # the bug: only the last KEPT
        return k, v


class _AlibiClamped(ScaleLM):
    def distances(self, query, key):   # the bug: a bias table of the trained length, read with clamped positions
        return super().distances(query.clamp(max=TRAINED - 1), key.clamp(max=TRAINED - 1))


class _TableClamped(ScaleLM):
    def table_rows(self, positions):   # the bug: a table of TABLE rows (the rest never trained), indices clamped
        return positions.clamp(max=TABLE - 1)


# ------------------------------------------------------------------------------------------------ factories
@correct("HF-style decoder at scale", level="model",
         mechanism=("scale_bugs.ScaleLM in bfloat16, rotary, a window of 16, max_len 1280: the model the at-scale bugs "
                    "vary"))
def scale_lm() -> Subject:
    """The correct model in bfloat16, rotary positions and a window of 16."""
    return scale_subject(ScaleLM, "rotary", WINDOW, torch.bfloat16)


@bug("MODEL-SHIFT", level="model",
     mechanism="rotary angles from positions cast to bfloat16: exact to position 256, wrong by radians past it")
def rotary_positions_in_bf16() -> Subject:
    return scale_subject(_PositionsInModelDtype, "rotary", None, torch.bfloat16)


@bug("MODEL-WINDOW", level="model", mechanism="a sliding window of 16 that admits 17 keys")
def window_admits_one_more() -> Subject:
    return scale_subject(_WindowOneMore, "rotary", WINDOW)


@bug("MODEL-KV-CACHE", level="model",
     mechanism="a decode cache that keeps only its last 100 positions, exact until prompt plus generation pass 100")
def cache_keeps_last_100() -> Subject:
    return scale_subject(_RingCache, "rotary")


@bug("MODEL-SHIFT", level="model", mechanism="ALiBi distances from positions clamped at the trained length 256")
def alibi_positions_clamped() -> Subject:
    return scale_subject(_AlibiClamped, "alibi")


@bug("MODEL-SHIFT", level="model",
     mechanism=("a learned position table of 1024 rows read with indices clamped at its last row, in a model that "
                "declares max_len 1280"))
def position_table_clamped() -> Subject:
    return scale_subject(_TableClamped, "learned")


# name -> (the correct model it is a variant of, as the arguments of _subject; its threshold: every input whose
# positions and columns stay below it gives the correct model's outputs bit for bit: tests/test_scale.py).
TWINS = {"rotary_positions_in_bf16": ((ScaleLM, "rotary", None, torch.bfloat16), 257),
         "window_admits_one_more": ((ScaleLM, "rotary", WINDOW), WINDOW + 1),
         "cache_keeps_last_100": ((ScaleLM, "rotary"), KEPT + 1),
         "alibi_positions_clamped": ((ScaleLM, "alibi"), TRAINED),
         "position_table_clamped": ((ScaleLM, "learned"), TABLE)}


def correct_twin(name: str) -> Subject:
    """The correct model the bug ``name`` is a variant of."""
    return scale_subject(*TWINS[name][0])
