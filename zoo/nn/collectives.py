"""The collectives context-parallel attention is built from, differentiable with backward passes written here.

Every tensor handed to torch.distributed is made contiguous first, and every backward pass is a collective of its
own on contiguous buffers: ``all_gather``'s backward is a ``reduce_scatter`` (each rank's slice of the gradient,
summed over the ranks that used it), ``all_to_all``'s is the inverse ``all_to_all``. Nothing here relies on
``torch.distributed.nn.functional``: on gloo in torch 2.13, its ``all_gather`` backward returns the right values in
the wrong order when the incoming gradient is not contiguous (docs/distributed.md), and a kernel built on it gets
dK and dV wrong on the CPU.

A group of one rank is the identity, with no collective called. Ranks are those of ``group`` (None: the default
group); point-to-point peers are named by their rank in the group.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["group_size", "group_rank", "all_gather", "all_to_all", "ring_shift", "all_lengths"]


def group_size(group) -> int:
    return dist.get_world_size(group)


def group_rank(group) -> int:
    return dist.get_rank(group)


def _all_gather_forward(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    x = x.contiguous()
    chunks = [torch.empty_like(x) for _ in range(group_size(group))]
    dist.all_gather(chunks, x, group=group)
    return torch.cat(chunks, dim=dim)


def _reduce_scatter(grad: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Rank r's slice r (along ``dim``) of the sum over the ranks of ``grad``."""
    chunks = [c.contiguous() for c in grad.chunk(group_size(group), dim=dim)]
    out = torch.empty_like(chunks[0])
    dist.reduce_scatter(out, chunks, group=group)
    return out


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _all_gather_forward(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.group, ctx.dim), None, None


def _all_to_all_forward(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    world = group_size(group)
    inputs = [c.contiguous() for c in x.chunk(world, dim=scatter_dim)]
    outputs = [torch.empty_like(inputs[0]) for _ in range(world)]
    dist.all_to_all(outputs, inputs, group=group)
    return torch.cat(outputs, dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, scatter_dim, gather_dim):
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return _all_to_all_forward(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all_forward(grad, ctx.group, gather_dim, scatter_dim), None, None, None


def all_gather(x: torch.Tensor, group=None, dim: int = 0) -> torch.Tensor:
    """Every rank's ``x`` (equal shapes) concatenated along ``dim`` in rank order; its gradient is each rank's own
    slice of the gradient summed over all ranks (reduce_scatter)."""
    if group_size(group) == 1:
        return x
    return _AllGather.apply(x, group, dim)


def all_to_all(x: torch.Tensor, group=None, *, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split ``x`` into W equal chunks along ``scatter_dim``, send chunk r to rank r, and concatenate the chunks
    received along ``gather_dim`` in rank order (DeepSpeed-Ulysses' exchange); its backward is the inverse exchange."""
    if group_size(group) == 1:
        return x
    if x.shape[scatter_dim] % group_size(group):
        raise ValueError(f"all_to_all: dimension {scatter_dim} of size {x.shape[scatter_dim]} does not split into "
                         f"{group_size(group)} equal chunks")
    return _AllToAll.apply(x, group, scatter_dim, gather_dim)


def ring_shift(tensors, group=None) -> list[torch.Tensor]:
    """Send each tensor to the next rank of the ring (r + 1 mod W) and receive the previous rank's (not
    differentiable: the ring's own backward passes its gradients round the same way)."""
    world = group_size(group)
    if world == 1:
        return [t for t in tensors]
    rank = group_rank(group)
    ops, received = [], []
    for t in tensors:
        t = t.contiguous()
        buffer = torch.empty_like(t)
        ops.append(dist.P2POp(dist.isend, t, group=group, group_peer=(rank + 1) % world))
        ops.append(dist.P2POp(dist.irecv, buffer, group=group, group_peer=(rank - 1) % world))
        received.append(buffer)
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    return received


def all_lengths(length: int, group=None, device=None) -> list[int]:
    """Every rank's ``length`` (a shard's rows), in rank order: how a kernel learns, the same on every rank, whether
    the shards are equal."""
    if group_size(group) == 1:
        return [length]
    mine = torch.tensor([length], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(group_size(group))]
    dist.all_gather(every, mine, group=group)
    return [int(t.item()) for t in every]
