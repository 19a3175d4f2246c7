"""Context-parallel kernels a line or two away from the zoo's (zoo/nn/context_parallel.py), each with one bug that
context-parallel attention has shipped with, and the correct kernels they are measured against.

Each bug is a subclass of the zoo's ``RingAttention``, ``UlyssesAttention`` or ``AllGatherKVAttention`` that changes
one step, and each is wrong on a problem its contract accepts (tests/test_distributed_bugs.py computes that
problem in float64, on two gloo ranks, beside the correct kernel's answer). The distributed level catches each on the
CPU, on two ranks, on the problems every run poses first (properties/distributed/cases.py: the pinned problems of
its clauses)::

    pytest properties/ --kernel properties.catalog.distributed_bugs:stale_kv_backward --world-size 2

Each is caught on the problems pinned for its class (``python -m properties.catalog.mutation_report --profile pinned``
runs only those), by the clauses below:

=================================== ============================================================ ===================
bug                                 what it gets wrong                                           caught by
=================================== ============================================================ ===================
stale_kv_backward                   backward: every step uses the local key/value chunk          CP-GRAD
zigzag_chunks_swapped_in_backward   backward: the zigzag chunks' positions in swapped order      CP-GRAD
kv_transposed_twice_in_backward     backward: keys and values transposed once more               CP-GRAD
local_lse_in_backward               backward: weights from the local block's LSE                 CP-GRAD
ring_receives_into_callers_shards   the next block received into the caller's key/value shards   CP-INPUTS-UNCHANGED,
                                                                                                 CP-GRAD
causal_mask_from_local_positions    the causal mask as if each shard were the whole sequence     CP-ORACLE, CP-CAUSAL,
                                                                                                 CP-GQA, CP-GRAD
rank_offset_off_by_one              a shard's offset r·(L/W − 1): one future key at a boundary   CP-CAUSAL, CP-GQA,
                                                                                                 CP-GRAD
partial_states_in_16_bits           each block's output and LSE rounded to the input dtype       CP-GRAD
empty_block_finite_lse              a fully masked block's LSE is 0, not −∞                      CP-ORACLE, CP-CAUSAL,
                                                                                                 CP-GQA, CP-GRAD
scale_twice_on_remote_blocks        remote blocks scaled twice                                   CP-ORACLE, CP-CAUSAL,
                                                                                                 CP-GQA, CP-GRAD
balanced_schedule_when_not_causal   the causal load balance's half blocks, not causal            CP-ORACLE
ulysses_heads_and_rows_swapped      the all-to-all scatters the rows and gathers the heads       every clause
ulysses_kv_heads_tiled              key/value heads W does not divide tiled, not grouped         CP-GQA
allgather_without_dkv_reduction     dK, dV of the gathered keys not summed over the ranks        CP-GRAD
=================================== ============================================================ ===================

The correct kernels are the zoo's four (``ring``, ``zigzag``, ``ulysses`` and ``allgather_kv``, on each layout they
serve) and ``balanced_zigzag``, the zigzag ring with the causal load balance of ring-flash-attention's
``zigzag_ring_flash_attn`` (``balanced_schedule_when_not_causal``'s twin).
"""
from __future__ import annotations

import math

import torch

from properties.catalog.registry import Entry, bug, correct, declare
from zoo.nn.collectives import all_gather, all_to_all, group_rank, group_size, ring_shift
from zoo.nn.context_parallel import AllGatherKVAttention, RingAttention, UlyssesAttention

__all__ = ["BalancedZigzag", "balanced_zigzag", "stale_kv_backward", "zigzag_chunks_swapped_in_backward",
           "causal_mask_from_local_positions", "partial_states_in_16_bits", "empty_block_finite_lse",
           "ulysses_heads_and_rows_swapped", "allgather_without_dkv_reduction", "ulysses_kv_heads_tiled",
           "kv_transposed_twice_in_backward", "balanced_schedule_when_not_causal", "scale_twice_on_remote_blocks",
           "local_lse_in_backward", "rank_offset_off_by_one", "ring_receives_into_callers_shards",
           "CONTIGUOUS", "ZIGZAG"]

# The command-line words that plug a kernel in on two ranks, for each layout.
CONTIGUOUS = ("--world-size", "2")
ZIGZAG = ("--world-size", "2", "--shard", "zigzag")


# ------------------------------------------------------------------------------------------------- the correct ones
for _name, _spec, _extra, _what in (
        ("zoo ring", "ring", CONTIGUOUS, "ring attention: key/value shards round the ring, partial states merged"),
        ("zoo zigzag", "zigzag", ZIGZAG, "the ring on the zigzag layout, masked by the zigzag positions"),
        ("zoo ulysses", "ulysses", CONTIGUOUS, "DeepSpeed-Ulysses: all-to-all from sequence shards to head shards"),
        ("zoo ulysses, zigzag shards", "ulysses", ZIGZAG, "Ulysses on the zigzag layout"),
        ("zoo allgather_kv", "allgather_kv", CONTIGUOUS, "Llama 3's context parallelism: keys and values gathered"),
        ("zoo allgather_kv, zigzag shards", "allgather_kv", ZIGZAG, "all-gather-KV on the zigzag layout")):
    declare(Entry(_name, "distributed", f"zoo/nn/context_parallel.py: {_what}", (), "--kernel", _spec, _extra))


@correct("balanced zigzag", level="distributed", extra=ZIGZAG, instance="balanced_zigzag",
         mechanism="the zigzag ring with the causal load balance (half blocks after the first step)")
class BalancedZigzag(RingAttention):
    """The zigzag ring with the causal load balance of ring-flash-attention's ``zigzag_ring_flash_attn`` and PyTorch's
    context parallelism: rank r holds chunks r and 2W − 1 − r, so under ``is_causal`` a block from rank s < r is seen
    whole by the first half of its keys only (chunk s) and a block from s > r by the second half of the queries only
    (chunk 2W − 1 − r): each step after the first computes half a block, unmasked. A problem that is not causal has
    no such halves: every query sees every key."""

    def __init__(self, layout: str = "zigzag"):
        super().__init__(layout)

    def balances(self, causal: bool) -> bool:
        """Whether the half-block schedule applies (only the causal mask makes the halves empty)."""
        return causal

    def block_of(self, q, k, v, scale, causal, rank, source, world):
        if source == rank or not self.balances(causal):
            return super().block_of(q, k, v, scale, causal, rank, source, world)
        half = q.shape[-2] // 2
        if source < rank:   # every local query sees the source's first chunk, none its second
            return self.block(q, k[..., :half, :], v[..., :half, :], scale, None, None)
        out, lse = self.block(q[..., half:, :], k, v, scale, None, None)   # only the second chunk's queries see it
        empty_out = out.new_zeros(*out.shape[:-2], half, out.shape[-1])
        empty_lse = lse.new_full((*lse.shape[:-1], half), -math.inf)
        return torch.cat([empty_out, out], dim=-2), torch.cat([empty_lse, lse], dim=-1)


balanced_zigzag = BalancedZigzag("zigzag")


# ------------------------------------------------------------------------------------------------- the ring's backward
@bug("CP-GRAD", level="distributed", extra=CONTIGUOUS, instance="stale_kv_backward",
     mechanism="the backward uses the local (iteration-0) key/value chunk at every step (diffusers#14265)")
class _StaleKVBackward(RingAttention):
    """The backward pass sends only the dK, dV accumulators round the ring and computes every step from the keys and
    values it saved in the forward, its own chunk (diffusers' TemplatedRingAttention read them from ``ctx``): the
    forward is right, the gradients of every remote block come from the wrong keys."""

    def backward_hop(self, k, v, dk, dv, group, last):
        return (k, v, *ring_shift([dk, dv], group))


stale_kv_backward = _StaleKVBackward("contiguous")


@bug("CP-GRAD", level="distributed", extra=ZIGZAG, instance="zigzag_chunks_swapped_in_backward",
     mechanism="the backward recomputes the zigzag mask with the rank's two chunks in swapped order")
class _ZigzagChunksSwappedInBackward(RingAttention):
    """The backward pass rebuilds the positions of a zigzag shard as (chunk 2W − 1 − r, chunk r), the order of the
    forward's second half first: the forward is right, the backward's causal mask is another one."""

    def backward_positions(self, rank, world, rows, device):
        first, second = self.positions(rank, world, rows, device).chunk(2)
        return torch.cat([second, first])


zigzag_chunks_swapped_in_backward = _ZigzagChunksSwappedInBackward("zigzag")


@bug("CP-GRAD", level="distributed", extra=CONTIGUOUS, instance="kv_transposed_twice_in_backward",
     mechanism="the backward transposes the saved keys and values to (b, h, l, e) once more (NeMo Automodel #3157)")
class _KVTransposedTwiceInBackward(RingAttention):
    """The backward pass transposes the keys and values it saved (already in (b, h, l, e)) to (b, h, l, e) again, and
    its dK, dV back (diffusers' native flash and cuDNN backward ops, NVIDIA-NeMo/Automodel PR #3157): where the
    heads equal a shard's rows it silently attends rows as heads (cuDNN's degenerate grouped-query case), elsewhere
    it raises."""

    def backward_pass(self, q, k, v, out, lse, grad_out, scale, causal, group):
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        dq, dk, dv = super().backward_pass(q, k, v, out, lse, grad_out, scale, causal, group)
        return dq, dk.transpose(1, 2), dv.transpose(1, 2)


kv_transposed_twice_in_backward = _KVTransposedTwiceInBackward("contiguous")


@bug("CP-GRAD", level="distributed", extra=CONTIGUOUS, instance="local_lse_in_backward",
     mechanism="the forward saves the local block's LSE, not the merged one: the backward's weights exp(s − λ) are off")
class _LocalLSEInBackward(RingAttention):
    """The forward merges every block into the output but saves for the backward the LSE of the first, local block
    (the state the ring started from): the backward recomputes each weight as exp(s − λ_local), too large by the
    share of the other blocks."""

    def forward_pass(self, q, k, v, scale, causal, group):
        out, _ = super().forward_pass(q, k, v, scale, causal, group)
        rank = group_rank(group)
        _, local_lse = self.block_of(q, k, v, scale, causal, rank, rank, group_size(group))
        return out, local_lse


local_lse_in_backward = _LocalLSEInBackward("contiguous")


@bug("CP-INPUTS-UNCHANGED", "CP-GRAD", level="distributed", extra=CONTIGUOUS,
     instance="ring_receives_into_callers_shards",
     mechanism="the ring receives the next key/value block into the tensors it was given: the caller's shards")
class _RingReceivesIntoCallersShards(RingAttention):
    """Each hop copies the block it received into the key and value tensors it holds, which at the first hop are the
    caller's shards: the forward is right, the caller's keys and values (and the ones saved for the backward) are the
    last block's."""

    def forward_hop(self, k, v, group):
        for mine, received in zip((k, v), super().forward_hop(k, v, group)):
            mine.copy_(received)
        return k, v


ring_receives_into_callers_shards = _RingReceivesIntoCallersShards("contiguous")


# ------------------------------------------------------------------------------------------------- the causal mask
@bug("CP-ORACLE", "CP-CAUSAL", "CP-GQA", "CP-GRAD", level="distributed", extra=CONTIGUOUS,
     instance="causal_mask_from_local_positions",
     mechanism="the causal mask from each shard's local positions, as if each shard were the whole sequence")
class _CausalMaskFromLocalPositions(RingAttention):
    """Every block is masked by the positions of its rows within the shard, 0 … L/W − 1, for queries and keys alike:
    each rank's queries see the keys of every later rank up to their own local position."""

    def positions(self, rank, world, rows, device):
        return torch.arange(rows, device=device)


causal_mask_from_local_positions = _CausalMaskFromLocalPositions("contiguous")


@bug("CP-GQA", "CP-GRAD", "CP-ORACLE", "CP-CAUSAL", level="distributed", extra=CONTIGUOUS,
     instance="rank_offset_off_by_one",
     mechanism="a shard's first position taken as r·(L/W − 1): a shard's last query sees the next shard's first key")
class _RankOffsetOffByOne(RingAttention):
    """Rank r's rows are placed at r·(L/W − 1) … (the index of a shard's last row taken for its length): every rank
    after the first is shifted down by r, so at each shard boundary the last query of the earlier shard admits the
    first key of the next."""

    def positions(self, rank, world, rows, device):
        start = rank * (rows - 1)
        return torch.arange(start, start + rows, device=device)


rank_offset_off_by_one = _RankOffsetOffByOne("contiguous")


# ------------------------------------------------------------------------------------------------- the merge
@bug("CP-GRAD", "CP-WORLD-SIZE", level="distributed", extra=CONTIGUOUS, instance="partial_states_in_16_bits",
     mechanism="each block's partial output and LSE rounded to the input dtype before the merge "
               "(zhuzilin/ring-flash-attention#42)")
class _PartialStatesIn16Bits(RingAttention):
    """Each block's state comes out in the input dtype, as a flash kernel returns its output, and is merged so: in
    float16 or bfloat16 an LSE of tens loses its last digits (an LSE of 50 in bfloat16 moves by up to 0.125). The
    forward's output, rounded to the dtype anyway, barely shows it; the backward recomputes every weight as
    exp(s − λ) from that LSE, and its gradients depart by an order of magnitude more than the correct ring's in the
    same dtype (tests/test_distributed_bugs.py). Exact in float32 and float64."""

    def block(self, q, k, v, scale, q_positions, k_positions):
        out, lse = super().block(q, k, v, scale, q_positions, k_positions)
        return out.to(q.dtype), lse.to(q.dtype)


partial_states_in_16_bits = _PartialStatesIn16Bits("contiguous")


@bug("CP-GQA", "CP-GRAD", "CP-ORACLE", "CP-CAUSAL", level="distributed", extra=CONTIGUOUS,
     instance="empty_block_finite_lse",
     mechanism="a fully masked block's state is (0, 0), not (0, −∞): the merge weighs its zero output (vllm PR #49294)")
class _EmptyBlockFiniteLSE(RingAttention):
    """A block that the causal mask hides entirely from a query gets the LSE 0 instead of −∞, so the merge gives its
    zero output the weight 1 / (1 + exp λ): the output shrinks towards 0 wherever the real LSE λ is not large."""

    def block(self, q, k, v, scale, q_positions, k_positions):
        out, lse = super().block(q, k, v, scale, q_positions, k_positions)
        return out, torch.nan_to_num(lse, neginf=0.0)


empty_block_finite_lse = _EmptyBlockFiniteLSE("contiguous")


@bug("CP-ORACLE", "CP-SCALE", "CP-GQA", "CP-GRAD", "CP-CAUSAL", level="distributed", extra=CONTIGUOUS,
     instance="scale_twice_on_remote_blocks",
     mechanism="the blocks from other ranks get a query pre-scaled for them and are scaled again")
class _ScaleTwiceOnRemoteBlocks(RingAttention):
    """The steps after the first reuse a query pre-scaled once for the ring (q·σ) and the block scales it again: the
    scores of every remote block are σ² q·k, the local block's σ q·k."""

    def block_of(self, q, k, v, scale, causal, rank, source, world):
        if source != rank:
            q = q * scale
        return super().block_of(q, k, v, scale, causal, rank, source, world)


scale_twice_on_remote_blocks = _ScaleTwiceOnRemoteBlocks("contiguous")


@bug("CP-ORACLE", "CP-GRAD", "CP-SHAPE", level="distributed", extra=ZIGZAG,
     instance="balanced_schedule_when_not_causal",
     mechanism="the causal load balance's half blocks used on a non-causal problem (pytorch#141429)")
class _BalancedScheduleWhenNotCausal(BalancedZigzag):
    """The load-balanced schedule (``BalancedZigzag``) is taken whenever the layout is zigzag, causal or not, as
    PyTorch's context parallelism did with load balancing on (its default): without the causal mask, the half of
    each block the schedule skips is not empty, and the non-causal output misses it."""

    def balances(self, causal):
        return True


balanced_schedule_when_not_causal = _BalancedScheduleWhenNotCausal("zigzag")


# ------------------------------------------------------------------------------------------------- Ulysses
@bug("CP-ORACLE", "CP-GQA", "CP-GRAD", "CP-CAUSAL", "CP-SCALE", "CP-SHAPE", level="distributed", extra=CONTIGUOUS,
     instance="ulysses_heads_and_rows_swapped",
     mechanism="the all-to-all scatters the rows, gathers the heads: DeepSpeed's (b, s, h, d) indices on (b, h, s, d)")
class _UlyssesHeadsAndRowsSwapped(UlyssesAttention):
    """The exchange keeps DeepSpeed-Ulysses' indices for its (b, s, h, d) layout (scatter 2, gather 1) on SDPA's
    (b, h, s, d): it scatters the rows and gathers the heads, and its inverse undoes that, so the output has its
    shard's shape, but each rank attends within a W-th of its rows (and a causal mask of the whole sequence does not
    fit them)."""

    def to_heads(self, t, group):
        return all_to_all(t, group, scatter_dim=2, gather_dim=1)

    def to_rows(self, t, group):
        return all_to_all(t, group, scatter_dim=1, gather_dim=2)


ulysses_heads_and_rows_swapped = _UlyssesHeadsAndRowsSwapped("contiguous")


@bug("CP-GQA", "CP-GRAD", "CP-ORACLE", level="distributed", extra=CONTIGUOUS, instance="ulysses_kv_heads_tiled",
     mechanism="key/value heads that do not divide among the ranks repeated with Tensor.repeat (tiled), not grouped "
               "(needs more than one key/value head, a number W does not divide: H_kv < W from W = 4)")
class _UlyssesKVHeadsTiled(UlyssesAttention):
    """Key/value heads that the ranks cannot split are repeated to the query heads with ``Tensor.repeat``, which tiles
    them (query head i reads key/value head i mod H_kv) where grouped-query attention groups them (i // (H / H_kv),
    ``repeat_interleave``). A single key/value head repeats the same either way."""

    def kv_heads_for(self, k, v, heads, world):
        if k.shape[1] % world == 0:
            return k, v
        group = heads // k.shape[1]
        return k.repeat(1, group, 1, 1), v.repeat(1, group, 1, 1)


ulysses_kv_heads_tiled = _UlyssesKVHeadsTiled("contiguous")


# ------------------------------------------------------------------------------------------------- all-gather of K, V
class _GatherKeepingTheLocalGradient(torch.autograd.Function):
    """All-gather along the rows whose backward keeps the rank's own slice of the gradient, unsummed."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather(x, group, dim=2)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(group_size(ctx.group), dim=2)[group_rank(ctx.group)], None


@bug("CP-GRAD", level="distributed", extra=CONTIGUOUS, instance="allgather_without_dkv_reduction",
     mechanism="the key/value all-gather's backward keeps the local slice of dK, dV: no sum over the ranks")
class _AllGatherWithoutDKVReduction(AllGatherKVAttention):
    """The gather's backward returns the rank's own slice of the gradient of the gathered keys and values, not its
    sum over the ranks (a reduce-scatter): each shard's dK, dV hold only the share of the queries of its own rank
    (ring-attention-pytorch's zig_zag_attn does this)."""

    def gather(self, t, group):
        if group_size(group) == 1:
            return t
        return _GatherKeepingTheLocalGradient.apply(t, group)


allgather_without_dkv_reduction = _AllGatherWithoutDKVReduction("contiguous")
