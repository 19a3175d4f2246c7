"""Multi-head attention (Vaswani et al. 2017, section 3.2.2), self or cross, with grouped-query heads.

Axis letters are those of ``zoo.nn.kernel``: b batch, h query heads, k key/value heads,
l query positions, s key/value positions, e features per head, d model features.

    MultiHead(x, m) = concat(head_1, ..., head_h) W_O,  head_i = Attention(x W_i^Q, m W_i^K, m W_i^V)

With ``kv_heads = k < h`` (grouped-query attention; k = 1 is multi-query attention),
query head i reads key/value head i // (h / k), as ``enable_gqa`` does in PyTorch.

Two options of FlashAttention's API (zoo/nn/flash.py, docs/sources/flash-attention.md):

    window=W    sliding-window self-attention (Mistral's ``sliding_window``, Longformer's local attention):
                query i sees key j iff |i - j| < W, i.e. i - W < j <= i under the causal mask -- W keys
                including itself. In flash-attn's terms ``window_size=(W - 1, W - 1)``, which with
                ``causal=True`` is ``(W - 1, 0)``. Positions are absolute (cache offset and padding included),
                so a cached decoding step sees the same W keys the full forward pass does. Cross-attention is
                never windowed (its keys are another sequence's positions).
    softcap=X   Gemma 2's logit soft-capping: score -> X·tanh(score / X), before the bias and the mask. Passed
                to the kernel as ``softcap=``, which SDPA's signature lacks: only a kernel that declares it
                (the zoo's ``math``, or a plug-in) can be used with it (zoo.nn.kernel.takes_softcap).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch
from einops import rearrange
from torch import nn

from zoo.nn.flash import band_allowed, paged_slots
from zoo.nn.kernel import resolve_kernel, takes_softcap

if TYPE_CHECKING:
    from zoo.nn.positional import _Positions

__all__ = ["MultiHeadAttention", "KVCache", "PagedKVCache", "Packing", "window_size"]


def window_size(window: int | None) -> tuple[int, int]:
    """flash-attn's ``window_size`` for a sliding window of W keys (Mistral's ``sliding_window``): (W - 1, W - 1),
    so that i - W < j <= i under the causal mask (transformers #39408 is this off-by-one); None: (-1, -1)."""
    return (-1, -1) if window is None else (window - 1, window - 1)


@dataclass
class KVCache:
    """Keys and values of the positions already decoded, one entry per attention layer."""
    keys: dict[int, torch.Tensor] = field(default_factory=dict)
    values: dict[int, torch.Tensor] = field(default_factory=dict)
    length: int = 0  # positions already decoded; advanced by the model after each step
    preallocated = False  # True for zoo.nn.static_cache.StaticKVCache: fixed slots, positions given as a tensor

    def begin(self, length: int, key_padding_mask: torch.Tensor | None = None) -> int:
        """The model's first act with a cache: the position of the first of ``length`` new tokens."""
        return self.length

    def finish(self, length: int) -> None:
        """The model's last act with a cache, once every layer has extended it."""
        self.length += length

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if layer in self.keys:
            k = torch.cat([self.keys[layer], k], dim=-2)
            v = torch.cat([self.values[layer], v], dim=-2)
        self.keys[layer], self.values[layer] = k, v
        return k, v


@dataclass
class PagedKVCache(KVCache):
    """A KV cache in fixed-size blocks (PagedAttention, Kwon et al. 2023; flash_attn_with_kvcache's ``block_table``):
    each layer's keys and values live in a pool of blocks (blocks, block_size, k, e), and ``block_table`` (b, n)
    int32 maps block i of sequence b's positions to its physical block. Blocks are handed out as the sequences
    grow, in turn across the batch, so one sequence's blocks are not adjacent in the pool; ``capacity`` (positions
    per sequence) reserves the whole pool at the first step, else it doubles when full.

    Reads and writes go through the block table (zoo.nn.flash.paged_slots); each step hands the layer its keys and
    values gathered in position order, so attention computes exactly what it does with ``KVCache``."""
    block_size: int = 16
    capacity: int | None = None
    block_table: torch.Tensor | None = None
    pools: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def __post_init__(self):
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size={self.block_size}: a positive number of positions per block")

    def _reserve(self, batch: int, end: int, device) -> None:
        """Logical blocks for positions < end of every sequence, each given the next free physical block."""
        have = 0 if self.block_table is None else self.block_table.shape[1]
        needed = -(-end // self.block_size)
        if needed <= have:
            return
        handed_out = batch * have
        new = torch.arange(handed_out, handed_out + batch * (needed - have), dtype=torch.int32, device=device)
        new = rearrange(new, "(n b) -> b n", b=batch)      # in turn across the batch, as sequences that grow together
        self.block_table = new if self.block_table is None else torch.cat([self.block_table, new], dim=1)

    def _pool(self, layer: int, like: torch.Tensor, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's pools, grown (copied into a pool twice the size, or to capacity) when the table outgrows them."""
        needed = int(self.block_table.max()) + 1
        if layer in self.pools and self.pools[layer][0].shape[0] >= needed:
            return self.pools[layer]
        old = self.pools.get(layer)
        planned = batch * -(-self.capacity // self.block_size) if self.capacity else 0
        size = max(needed, planned, 2 * old[0].shape[0] if old else 0)
        _, kv_heads, _, e = like.shape
        pools = tuple(like.new_zeros(size, self.block_size, kv_heads, e) for _ in range(2))
        if old is not None:
            for new_pool, old_pool in zip(pools, old):
                new_pool[: old_pool.shape[0]] = old_pool
        self.pools[layer] = pools
        return pools

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (b, k, l, e) at positions length .. length + l - 1; return every position's (b, k, s, e)."""
        batch, start, end = k.shape[0], self.length, self.length + k.shape[-2]
        self._reserve(batch, end, k.device)
        k_pool, v_pool = self._pool(layer, k, batch)
        new = paged_slots(self.block_table, torch.arange(start, end, device=k.device), self.block_size)
        k_pool[new] = rearrange(k, "b k l e -> b l k e")
        v_pool[new] = rearrange(v, "b k l e -> b l k e")
        every = paged_slots(self.block_table, torch.arange(end, device=k.device), self.block_size)
        return rearrange(k_pool[every], "b s k e -> b k s e"), rearrange(v_pool[every], "b s k e -> b k s e")


@dataclass(frozen=True)
class Packing:
    """Several sequences packed end to end into each row (flash-attn's varlen semantics, row by row): a token
    attends only to tokens of its own sequence, and positions restart at 0 with every sequence, so each one is
    computed exactly as if it were alone.

    segments (b, l) int: the index of each token's sequence within its row, non-decreasing, -1 for padding
    after the last one. positions (b, l): each token's position within its sequence (0 on padding)."""
    segments: torch.Tensor
    positions: torch.Tensor

    @classmethod
    def from_segments(cls, segments: torch.Tensor) -> "Packing":
        if segments.dim() != 2 or segments.dtype.is_floating_point or segments.dtype == torch.bool:
            raise ValueError(f"segments must be an integer (batch, length) tensor, got {segments.dtype} "
                             f"{tuple(segments.shape)}")
        real = segments >= 0
        ordered = (segments[:, 1:] >= segments[:, :-1]) | ~real[:, 1:]
        if not bool((real[:, 1:] <= real[:, :-1]).all() & ordered.all()):
            raise ValueError("segments: each row must hold non-decreasing sequence indices, then -1 (padding) only")
        index = torch.arange(segments.shape[1], device=segments.device).expand_as(segments)
        starts = torch.ones_like(real)
        starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
        first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
        return cls(segments, torch.where(real, index - first, torch.zeros_like(index)))


class MultiHeadAttention(nn.Module):
    def __init__(self, d_model: int, heads: int, kv_heads: int | None = None, bias: bool = True,
                 dropout: float = 0.0, kernel: str | Callable = "math", window: int | None = None,
                 softcap: float | None = None, *, device=None, dtype=None):
        super().__init__()
        kv_heads = heads if kv_heads is None else kv_heads
        if heads < 1 or d_model % heads:
            raise ValueError(f"heads={heads} must be a positive divisor of d_model={d_model}")
        if kv_heads < 1 or heads % kv_heads:
            raise ValueError(f"kv_heads={kv_heads} must be a positive divisor of heads={heads}")
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, d_model // heads
        self.dropout = dropout
        self.kernel = resolve_kernel(kernel)
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"window={window}: a positive number of keys (null: no window)")
        if softcap is not None and not (isinstance(softcap, (int, float)) and 0 < softcap < float("inf")):
            raise ValueError(f"softcap={softcap}: a positive finite cap (null: no capping)")
        if softcap is not None and not takes_softcap(self.kernel):
            raise ValueError(f"softcap={softcap}: kernel {kernel!r} has no softcap parameter (SDPA's signature "
                             f"cannot cap scores); use kernel=math")
        self.window, self.softcap = window, softcap
        kw = dict(bias=bias, device=device, dtype=dtype)
        self.q_proj = nn.Linear(d_model, heads * self.head_dim, **kw)
        self.k_proj = nn.Linear(d_model, kv_heads * self.head_dim, **kw)
        self.v_proj = nn.Linear(d_model, kv_heads * self.head_dim, **kw)
        self.out_proj = nn.Linear(heads * self.head_dim, d_model, **kw)
        self.layer_index = 0  # set by the model so a KVCache can tell layers apart

    # The steps of forward, each overridable alone (the bug catalog gets exactly one of them wrong).
    # split and merge are the einops patterns in their docstrings, written as the view and transpose einops makes
    # of them: on a GPU a small model's forward pass is bound by the host's time per operation, and einops' own
    # Python per call was 8% of it (README, Benchmarks: the encoder-decoder against nn.Transformer).
    def split_heads(self, t: torch.Tensor, heads: int) -> torch.Tensor:
        """rearrange(t, "b l (h e) -> b h l e", h=heads)"""
        return t.unflatten(-1, (heads, t.shape[-1] // heads)).transpose(1, 2)

    def merge_heads(self, out: torch.Tensor) -> torch.Tensor:
        """rearrange(out, "b h l e -> b l (h e)")"""
        return out.transpose(1, 2).flatten(2)

    def mask(self, l: int, s: int, offset: int, key_padding_mask: torch.Tensor | None, is_causal: bool,
             bias: torch.Tensor | None, device, *, window: int | None = None,
             segments: torch.Tensor | None = None) -> torch.Tensor | None:
        """The kernel's attn_mask, or None when is_causal alone says it (the kernel's fast path)."""
        mask = None
        if window is not None or segments is not None or \
                (is_causal and (offset or key_padding_mask is not None or bias is not None)):
            # Query i sits at absolute position offset + i = i + s - l (bottom-right) and sees every key up to
            # there, and with a window only the W - 1 before it: flash-attn's band, the one definition.
            rows = torch.arange(l, device=device)[:, None]
            cols = torch.arange(s, device=device)[None, :]
            mask = band_allowed(rows, cols, s - l, is_causal, window_size(window))
        if segments is not None:
            # Packed rows: a token sees only its own sequence. Within one, index and position differ by a
            # constant, so the band above (causal, window) counted in indices is the per-sequence band.
            same = rearrange(segments, "b l -> b 1 l 1") == rearrange(segments, "b s -> b 1 1 s")
            mask = mask & same
        if key_padding_mask is not None:
            padding = rearrange(key_padding_mask.to(torch.bool), "b s -> b 1 1 s")
            mask = padding if mask is None else mask & padding
        if bias is not None:  # a float mask: the bias where a key is admissible, -inf where it is not
            mask = bias if mask is None else bias.masked_fill(~mask, float("-inf"))
        return mask

    def attend(self, q, k, v, mask, is_causal: bool) -> torch.Tensor:
        # softcap only when set: an SDPA-signature kernel would refuse the keyword (the constructor checked).
        extra = {} if self.softcap is None else {"softcap": self.softcap}
        return self.kernel(q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0,
                           is_causal=is_causal, enable_gqa=self.kv_heads != self.heads, **extra)

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None, *,
                key_padding_mask: torch.Tensor | None = None, is_causal: bool = False,
                positions: "_Positions | None" = None, cache: KVCache | None = None,
                packing: Packing | None = None) -> torch.Tensor:
        """x (b, l, d) attends to memory (b, s, d), or to itself when memory is None.

        key_padding_mask (b, s) bool: True marks a real key (may be attended to), False padding.
        is_causal: query i sees keys j <= i, counted in absolute positions when a cache holds
        earlier keys. positions: the model's position module (self-attention only), asked to rotate queries
        and keys and for a bias on the scores (zoo.nn.positional).
        cache: keys/values of earlier positions (self-attention decoding step by step).
        packing: several sequences per row (self-attention, no cache): attention within each, positions restart.
        """
        source = x if memory is None else memory
        q = self.split_heads(self.q_proj(x), self.heads)
        if getattr(cache, "preallocated", False) and memory is not None:
            # A StaticKVCache given to cross-attention: the memory's keys and values, projected at the first call.
            k, v = cache.cross(self.layer_index, lambda: (self.split_heads(self.k_proj(source), self.kv_heads),
                                                          self.split_heads(self.v_proj(source), self.kv_heads)))
            cache = None  # nothing else of the cache concerns cross-attention
        else:
            k = self.split_heads(self.k_proj(source), self.kv_heads)
            v = self.split_heads(self.v_proj(source), self.kv_heads)
        static = getattr(cache, "preallocated", False)  # zoo.nn.static_cache.StaticKVCache, causal self-attention
        offset = cache.positions if static else cache.length if cache is not None else 0
        if packing is not None:
            if cache is not None or memory is not None:
                raise ValueError("packing applies to self-attention without a KV cache (training, scoring)")
            offset = packing.positions  # every token at its position within its own sequence
        if positions is not None:
            q, k = positions.rotate(q, offset), positions.rotate(k, offset)
        if cache is not None:
            k, v = cache.extend(self.layer_index, k, v)
        l, s = q.shape[-2], k.shape[-2]
        bias = positions.score_bias(l, s, offset, self.heads) if positions is not None else None
        bias = None if bias is None else bias.to(q.dtype)
        if static:  # this call's mask over the N slots, made once per call for every layer
            mask = cache.mask(self.window)
            mask = mask if bias is None else bias.masked_fill(~mask, float("-inf"))
        else:
            # The window only when set and only for self-attention; the catalog's mask() overrides predate it.
            extra = {"window": self.window} if self.window is not None and memory is None else {}
            if packing is not None:
                extra["segments"] = packing.segments
            mask = self.mask(l, s, offset, key_padding_mask, is_causal, bias, x.device, **extra)
        out = self.attend(q, k, v, mask, is_causal and mask is None)
        return self.out_proj(self.merge_heads(out))
