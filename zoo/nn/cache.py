"""KV caches: the keys and values of the positions already decoded, so that a decoding step attends to them without
computing them again. ``KVCache`` (grown by concatenation) states the interface every cache offers;
``PagedKVCache`` keeps them in fixed-size blocks; ``StaticKVCache`` (zoo/nn/static_cache.py) in buffers allocated
once per generation. The zoo's MultiHeadAttention asks the cache, never its type, what differs between them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from einops import rearrange

from zoo.nn.flash_kvcache import paged_slots

__all__ = ["KVCache", "PagedKVCache"]


@dataclass
class KVCache:
    """Keys and values of the positions already decoded, one entry per attention layer, grown by concatenation.

    The interface every cache of the zoo offers, and the one a plug-in attention is written against:

        begin(l, key_padding_mask)  the model's first act in a call of l new tokens: their first position
        extend(layer, k, v)         store this call's keys and values (b, k, l, e); return those attended (b, k, s, e)
        finish(l)                   the model's last act, once every layer has extended it
        length                      positions decoded so far

    and, read by the zoo's MultiHeadAttention only, so that the cache decides what differs between caches:

        offset                      the new tokens' positions: an int (the first one), or an (l,) tensor
        mask(window)                this call's mask over the keys extend returns, or None: the layer builds its own
        cross(layer, project)       cross-attention's keys and values: ``project()`` here, kept by a static cache
        keeps_cross                 whether the cross-attention layers are handed the cache at all
    """
    keys: dict[int, torch.Tensor] = field(default_factory=dict)
    values: dict[int, torch.Tensor] = field(default_factory=dict)
    length: int = 0  # positions already decoded; advanced by the model after each step
    keeps_cross = False  # True for zoo.nn.static_cache.StaticKVCache: it keeps the memory's keys and values

    def begin(self, length: int, key_padding_mask: torch.Tensor | None = None) -> int:
        """The model's first act with a cache: the position of the first of ``length`` new tokens."""
        return self.length

    def finish(self, length: int) -> None:
        """The model's last act with a cache, once every layer has extended it."""
        self.length += length

    @property
    def offset(self) -> int | torch.Tensor:
        """The position of the call's first new token (the keys before it are the cache's)."""
        return self.length

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if layer in self.keys:
            k = torch.cat([self.keys[layer], k], dim=-2)
            v = torch.cat([self.values[layer], v], dim=-2)
        self.keys[layer], self.values[layer] = k, v
        return k, v

    def mask(self, window: int | None) -> torch.Tensor | None:
        """None: the layer masks the keys from the offset, as it does without a cache."""
        return None

    def cross(self, layer: int, project: Callable[[], tuple[torch.Tensor, torch.Tensor]]):
        """Cross-attention's keys and values of ``layer``: the memory's, projected at every call."""
        return project()


@dataclass
class PagedKVCache(KVCache):
    """A KV cache in fixed-size blocks (PagedAttention, Kwon et al. 2023; flash_attn_with_kvcache's ``block_table``):
    each layer's keys and values live in a pool of blocks (blocks, block_size, k, e), and ``block_table`` (b, n)
    int32 maps block i of sequence b's positions to its physical block. Blocks are handed out as the sequences
    grow, in turn across the batch, so one sequence's blocks are not adjacent in the pool; ``capacity`` (positions
    per sequence) reserves the whole pool at the first step, else it doubles when full.

    Reads and writes go through the block table (zoo.nn.flash_kvcache.paged_slots); each step hands the layer its keys
    and values gathered in position order, so attention computes exactly what it does with ``KVCache``."""
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
