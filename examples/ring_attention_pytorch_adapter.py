"""ring-attention-pytorch (lucidrains) with the suite's context-parallel signature, as it ships.

    pip install ring-attention-pytorch==0.5.20
    pytest properties/ --world-size 2 --kernel examples/ring_attention_pytorch_adapter.py:ring
    pytest properties/ --world-size 2 --shard zigzag --kernel examples/ring_attention_pytorch_adapter.py:zigzag

On each rank the suite calls ``ring(q, k, v, is_causal=, scale=, enable_gqa=, group=)`` with that rank's shard in SDPA's
layout (B, H, L/W, E) (docs/distributed.md). The adapter only translates; every number comes from the library:

* ``ring`` is ``ring_flash_attn`` (keys and values passed round the ring, ``ring_reduce_col=True``) on contiguous
  shards. It takes (B, L, H, E): the adapter transposes in and out.
* ``zigzag`` is ``zig_zag_attn`` (keys and values all-gathered, Llama 3's scheme) on zigzag shards (rank r holds
  chunks r and 2W - 1 - r of 2W, as the library's ``zig_zag_shard`` cuts them). It takes SDPA's layout and an
  ``attn_mask`` instead of ``is_causal``: the adapter builds the causal mask from the global positions of the rows
  the rank holds and of the keys the all-gather brings (rank order).
* Grouped heads: both repeat key/value heads as ``(g h)``, so that query head j reads key/value head j mod H_kv, where
  SDPA's head i reads head i // (H / H_kv): the adapter reorders the query heads into the library's order and the
  output heads back.
* Neither takes a scale (both use 1/sqrt(E)), nor a process group (both use the default group): an explicit scale
  other than 1/sqrt(E), and a group smaller than the world (CP-WORLD-SIZE's), are declined in the adapter's words;
  so are unequal shards (the library pads a sequence to equal shards before it shards it: ``zig_zag_pad_seq``, and
  ``RingAttention``'s padding to the ring's buckets), for which the adapter gathers the shard lengths first, and a
  value head size other than the key's for ``ring_flash_attn`` (it asserts they are equal).

Each function declares the layout it is written for (``layouts``): the suite refuses it on the other --shard in one
line. What the suite finds (docs/distributed.md, "Third-party kernels"): the forward and dQ agree with the float64
oracle; dK and dV do not (``ring_flash_attn`` returns dK + dV in the key's gradient: its forward stacks k and v into
one tensor; ``zig_zag_attn``'s all-gather backward keeps the local rank's slice of the gradient, never summing the
other ranks' contributions); and ``ring_flash_attn`` raises in float64 (its masking value, float64's largest, does
not fit the float32 buffer it fills).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from einops import rearrange


def _check(query, key, scale, group, name: str) -> None:
    """Decline, on every rank alike, what the library does not take."""
    if scale is not None and scale != query.shape[-1] ** -0.5:
        raise NotImplementedError(f"{name} does not support an explicit scale (it uses 1/sqrt(E))")
    if dist.get_world_size(group) != dist.get_world_size():
        raise NotImplementedError(f"{name} does not support a process group smaller than the default one (it takes "
                                  f"no group)")
    mine = torch.tensor([query.shape[-2]], device=query.device)
    lengths = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(lengths, mine)
    if len({int(n) for n in lengths}) > 1:
        raise NotImplementedError(f"{name} does not support unequal shards ({[int(n) for n in lengths]} rows): the "
                                  f"library pads the sequence to equal shards before it shards it")


def _to_library_heads(query, key):
    """SDPA's query heads (h g) in the library's order (g h), with g = H / H_kv."""
    groups = query.shape[1] // key.shape[1]
    return rearrange(query, "b (h g) l e -> b (g h) l e", g=groups), groups


def ring(query, key, value, *, is_causal=False, scale=None, enable_gqa=False, group=None):
    from ring_attention_pytorch import ring_flash_attn
    _check(query, key, scale, group, "ring_flash_attn")
    if value.shape[-1] != key.shape[-1]:   # it stacks keys and values into one tensor (an assert, no message)
        raise NotImplementedError("ring_flash_attn does not support a value head size other than the key's")
    q, groups = _to_library_heads(query, key)
    q, k, v = (rearrange(t, "b h l e -> b l h e") for t in (q, key, value))
    out = ring_flash_attn(q, k, v, causal=bool(is_causal), ring_reduce_col=True)
    return rearrange(out, "b l (g h) e -> b (h g) l e", g=groups)


ring.layouts = ("contiguous",)


def zigzag(query, key, value, *, is_causal=False, scale=None, enable_gqa=False, group=None):
    from ring_attention_pytorch.zig_zag_attention import zig_zag_attn
    _check(query, key, scale, group, "zig_zag_attn")
    q, groups = _to_library_heads(query, key)
    mask = None
    if is_causal:
        world, rank, rows = dist.get_world_size(), dist.get_rank(), query.shape[-2]
        if rows % 2:
            raise NotImplementedError("zig_zag_attn does not support odd shards (two equal chunks per rank)")
        chunk = rows // 2

        def positions(r):
            return torch.cat([torch.arange(r * chunk, (r + 1) * chunk),
                              torch.arange((2 * world - 1 - r) * chunk, (2 * world - r) * chunk)])
        keys = torch.cat([positions(r) for r in range(world)])
        mask = (keys[None, :] <= positions(rank)[:, None]).to(query.device)
    out = zig_zag_attn(q, key, value, attn_mask=mask)
    return rearrange(out, "b (g h) l e -> b (h g) l e", g=groups)


zigzag.layouts = ("zigzag",)
