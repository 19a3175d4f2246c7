"""Context-parallel attention: one sequence split across the ranks of a process group, in plain torch.distributed.

The contract (properties/SPEC.md, "Attention split across ranks"; docs/distributed.md): every rank of ``group``
calls

    kernel(query, key, value, *, is_causal=False, scale=None, enable_gqa=False, group=None) -> output

with its own shard of the sequence in SDPA's layout, query (b, h, l/W, e), key (b, k, l/W, e), value (b, k, l/W, v),
and gets its shard of attention over the whole sequence, (b, h, l/W, v) in the query's dtype; gradients flow back to
its shards. Which rows a rank holds is the layout the kernel is written for (``LAYOUTS``; each kernel names its own in
``layouts``, which the suite reads to refuse another --shard):

    contiguous  rank r holds rows r·l/W … (r + 1)·l/W − 1
    zigzag      the sequence cut into 2W chunks; rank r holds chunks r and 2W − 1 − r (causal load balance)

Every kernel here asks the group for each rank's shard length first and declines unequal shards (NotImplementedError)
on every rank alike; the zigzag layout also needs an even shard.

Kernels (``CONTEXT_PARALLEL``, by layout):

* ``ring`` (``RingAttention``): key/value shards travel round the ring; each rank folds every block into its partial
  state (zoo/nn/partial.py: block_attention, merge). The backward pass sends the keys and values round again with
  their dK, dV accumulators, and one last hop brings each shard's gradient home (ring-flash-attention's schedule).
  On the zigzag layout it is ``zigzag``: the same ring, the causal mask from the zigzag positions.
* ``ulysses`` (``UlyssesAttention``): DeepSpeed-Ulysses. An all-to-all trades the sequence shards for head shards,
  each rank attends over the whole sequence with h/W heads, and the inverse all-to-all trades back. The heads must
  divide among the ranks; key/value heads that do not are first repeated to the query heads.
* ``allgather_kv`` (``AllGatherKVAttention``): Llama 3's context parallelism: keys and values all-gathered, each rank's
  queries attend over all of them; the gather's backward reduce-scatters dK, dV.

Collectives are zoo/nn/collectives.py's (contiguous buffers, backward passes written there). Partial states are kept in
float32 for half-precision inputs; the output is rounded to the input's dtype once.
"""
from __future__ import annotations

import math

import torch

from zoo.nn.collectives import all_gather, all_lengths, all_to_all, group_rank, group_size, ring_shift
from zoo.nn.partial import (attention_delta, block_attention, block_attention_backward, expand_heads, merge)
from zoo.runtime.plugins import PluginError, load_object

__all__ = ["LAYOUTS", "shard_positions", "ContextParallelAttention", "RingAttention", "UlyssesAttention",
           "AllGatherKVAttention", "ring_attention", "zigzag_attention", "ulysses_attention",
           "allgather_kv_attention", "CONTEXT_PARALLEL", "resolve_context_parallel"]

LAYOUTS = ("contiguous", "zigzag")


def shard_positions(rank: int, world: int, rows: int, layout: str, device=None) -> torch.Tensor:
    """The global positions of the ``rows`` rows rank ``rank`` holds of a sequence cut into ``world`` equal shards."""
    if layout == "contiguous":
        return torch.arange(rank * rows, (rank + 1) * rows, device=device)
    if layout == "zigzag":
        chunk = rows // 2
        first, second = rank, 2 * world - 1 - rank
        return torch.cat([torch.arange(first * chunk, (first + 1) * chunk, device=device),
                          torch.arange(second * chunk, (second + 1) * chunk, device=device)])
    raise ValueError(f"layout {layout!r}: expected one of {LAYOUTS}")


class ContextParallelAttention:
    """The contract's checks and defaults; a subclass computes ``attend`` on equal, checked shards."""

    name = "context-parallel attention"

    def __init__(self, layout: str = "contiguous"):
        if layout not in LAYOUTS:
            raise ValueError(f"layout {layout!r}: expected one of {LAYOUTS}")
        self.layout = layout

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.layout!r})"

    @property
    def layouts(self) -> tuple[str, ...]:
        """The layouts it is written for (the suite refuses it on another --shard)."""
        return (self.layout,)

    def __call__(self, query, key, value, *, is_causal=False, scale=None, enable_gqa=False, group=None):
        if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
            raise ValueError(f"{self.name}: query, key and value must be (batch, heads, rows, features); got "
                             f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
        if key.shape[-2] != query.shape[-2] or value.shape[-2] != key.shape[-2]:
            raise ValueError(f"{self.name}: query, key and value shards must hold the same rows; got "
                             f"{query.shape[-2]}, {key.shape[-2]}, {value.shape[-2]}")
        if key.shape[1] != query.shape[1] and not enable_gqa:
            raise ValueError(f"{self.name}: {key.shape[1]} key/value heads for {query.shape[1]} query heads need "
                             f"enable_gqa=True")
        if query.shape[1] % key.shape[1]:
            raise ValueError(f"{self.name}: query heads ({query.shape[1]}) must be a multiple of key/value heads "
                             f"({key.shape[1]})")
        lengths = all_lengths(query.shape[-2], group, query.device)
        if len(set(lengths)) > 1:
            raise NotImplementedError(f"{self.name} does not support unequal shards: the ranks hold {lengths} rows "
                                      f"(the sequence length must divide by the world size)")
        if self.layout == "zigzag" and query.shape[-2] % 2:
            raise NotImplementedError(f"{self.name} on the zigzag layout does not support odd shards "
                                      f"({query.shape[-2]} rows: the sequence length must divide by 2W)")
        scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
        return self.attend(query, key, value, scale, bool(is_causal), group)

    def attend(self, q, k, v, scale: float, causal: bool, group):
        raise NotImplementedError

    def positions(self, rank: int, world: int, rows: int, device) -> torch.Tensor:
        """The global positions of rank ``rank``'s rows (its queries, and the keys it holds)."""
        return shard_positions(rank, world, rows, self.layout, device)

    def gathered_positions(self, world: int, rows: int, device) -> torch.Tensor:
        """The positions of every rank's rows concatenated in rank order (what a gather along the rows holds)."""
        return torch.cat([self.positions(r, world, rows, device) for r in range(world)])


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring, scale, causal, group):
        out, lse = ring.forward_pass(q, k, v, scale, causal, group)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.scale, ctx.causal, ctx.group = ring, scale, causal, group
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.ring.backward_pass(q, k, v, out, lse, grad_out, ctx.scale, ctx.causal, ctx.group)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


class RingAttention(ContextParallelAttention):
    """Ring attention (Liu et al., 2023; zhuzilin/ring-flash-attention's schedule); ``zigzag`` on that layout."""

    name = "ring attention"

    def attend(self, q, k, v, scale, causal, group):
        return _Ring.apply(q, k, v, self, scale, causal, group)

    def block(self, q, k, v, scale, q_positions, k_positions):
        """The partial state of the local queries over one key/value block."""
        return block_attention(q, k, v, scale=scale, q_positions=q_positions, k_positions=k_positions)

    def merge(self, out, lse, block_out, block_lse):
        return merge(out, lse, block_out, block_lse)

    def block_of(self, q, k, v, scale, causal: bool, rank: int, source: int, world: int):
        """The partial state of rank ``rank``'s queries over the keys and values rank ``source`` holds: one block,
        masked by the global positions of both under ``causal``."""
        if not causal:
            return self.block(q, k, v, scale, None, None)
        rows = q.shape[-2]
        return self.block(q, k, v, scale, self.positions(rank, world, rows, q.device),
                          self.positions(source, world, rows, q.device))

    def forward_hop(self, k, v, group):
        """Pass the keys and values on to the next rank; receive the previous rank's."""
        return tuple(ring_shift([k, v], group))

    def forward_pass(self, q, k, v, scale, causal, group):
        """(output, LSE) of the local queries over every rank's keys, in the accumulation dtype."""
        world, rank = group_size(group), group_rank(group)
        out = lse = None
        for step in range(world):
            source = (rank - step) % world   # whose keys and values this rank holds at this step
            block_out, block_lse = self.block_of(q, k, v, scale, causal, rank, source, world)
            out, lse = (block_out, block_lse) if out is None else self.merge(out, lse, block_out, block_lse)
            if step < world - 1:
                k, v = self.forward_hop(k, v, group)
        return out, lse

    def backward_positions(self, rank: int, world: int, rows: int, device) -> torch.Tensor:
        """The positions the backward pass recomputes its weights at (the forward's)."""
        return self.positions(rank, world, rows, device)

    def backward_hop(self, k, v, dk, dv, group, last: bool):
        """Pass the keys and values on with their gradient accumulators; at the last step only the accumulators,
        which then reach the rank that holds their shard."""
        if last:
            return (k, v, *ring_shift([dk, dv], group))
        return tuple(ring_shift([k, v, dk, dv], group))

    def backward_pass(self, q, k, v, out, lse, grad_out, scale, causal, group):
        world, rank, rows = group_size(group), group_rank(group), q.shape[-2]
        q_positions = self.backward_positions(rank, world, rows, q.device) if causal else None
        delta = attention_delta(out, grad_out)
        dq, dk, dv = 0.0, torch.zeros_like(k, dtype=out.dtype), torch.zeros_like(v, dtype=out.dtype)
        for step in range(world):
            source = (rank - step) % world
            k_positions = self.backward_positions(source, world, rows, q.device) if causal else None
            dq_block, dk_block, dv_block = block_attention_backward(
                q, k, v, grad_out, lse, delta, scale=scale, q_positions=q_positions, k_positions=k_positions)
            dq, dk, dv = dq + dq_block, dk + dk_block, dv + dv_block
            k, v, dk, dv = self.backward_hop(k, v, dk, dv, group, last=step == world - 1)
        return dq, dk, dv


class UlyssesAttention(ContextParallelAttention):
    """DeepSpeed-Ulysses (Jacobs et al., 2023): all-to-all from sequence shards to head shards and back."""

    name = "Ulysses attention"

    def kv_heads_for(self, k, v, heads: int, world: int):
        """Key/value heads that split among the ranks as the query heads do: as they are when W divides them (rank
        r's query heads read exactly rank r's key/value heads), else repeated to the query heads."""
        if k.shape[1] % world == 0:
            return k, v
        return expand_heads(k, heads), expand_heads(v, heads)

    def to_heads(self, t, group):
        """(b, h, l/W, x) -> (b, h/W, l, x): scatter the heads, gather the rows (in rank order)."""
        return all_to_all(t, group, scatter_dim=1, gather_dim=2)

    def to_rows(self, t, group):
        """The inverse: (b, h/W, l, x) -> (b, h, l/W, x)."""
        return all_to_all(t, group, scatter_dim=2, gather_dim=1)

    def attend(self, q, k, v, scale, causal, group):
        world, heads = group_size(group), q.shape[1]
        if heads % world:
            raise NotImplementedError(f"{self.name} does not support {heads} query heads on {world} ranks: the "
                                      f"heads must divide among the ranks")
        k, v = self.kv_heads_for(k, v, heads, world)
        qh, kh, vh = self.to_heads(q, group), self.to_heads(k, group), self.to_heads(v, group)
        positions = self.gathered_positions(world, q.shape[-2], q.device) if causal else None
        out, _ = block_attention(qh, kh, vh, scale=scale, q_positions=positions, k_positions=positions)
        return self.to_rows(out.to(q.dtype), group)


class AllGatherKVAttention(ContextParallelAttention):
    """Keys and values all-gathered (Llama 3's context parallelism, Dubey et al., 2024, §3.3.2)."""

    name = "all-gather-KV attention"

    def gather(self, t, group):
        return all_gather(t, group, dim=2)

    def attend(self, q, k, v, scale, causal, group):
        world, rank, rows = group_size(group), group_rank(group), q.shape[-2]
        ks, vs = self.gather(k, group), self.gather(v, group)
        q_positions = self.positions(rank, world, rows, q.device) if causal else None
        k_positions = self.gathered_positions(world, rows, q.device) if causal else None
        out, _ = block_attention(q, ks, vs, scale=scale, q_positions=q_positions, k_positions=k_positions)
        return out.to(q.dtype)


ring_attention = RingAttention("contiguous")
zigzag_attention = RingAttention("zigzag")
ulysses_attention = UlyssesAttention("contiguous")
allgather_kv_attention = AllGatherKVAttention("contiguous")

# The zoo's context-parallel kernels by the layout they are written for, by name.
CONTEXT_PARALLEL: dict[str, dict[str, ContextParallelAttention]] = {
    "contiguous": {"ring": ring_attention, "ulysses": ulysses_attention, "allgather_kv": allgather_kv_attention},
    "zigzag": {"zigzag": zigzag_attention, "ulysses": UlyssesAttention("zigzag"),
               "allgather_kv": AllGatherKVAttention("zigzag")},
}


def resolve_context_parallel(spec: str, layout: str):
    """A zoo kernel's name for ``layout`` (``ring`` and ``zigzag`` name the ring on either layout), or an import
    path 'pkg.module:function' / 'path/file.py:function'. Raises zoo.runtime.plugins.PluginError."""
    if layout not in CONTEXT_PARALLEL:
        raise PluginError(f"layout {layout!r}: expected one of {LAYOUTS}")
    kernels = CONTEXT_PARALLEL[layout]
    if spec in ("ring", "zigzag"):
        return RingAttention(layout)
    if spec in kernels:
        return kernels[spec]
    if ":" not in spec:
        names = sorted(set(kernels) | {"ring", "zigzag"})
        raise PluginError(f"context-parallel kernel {spec!r}: expected one of {names} or an import path "
                          f"'pkg.module:function'")
    obj = load_object(spec)
    if not callable(obj):
        raise PluginError(f"kernel {spec!r} is not callable")
    return obj
