"""Broken kernels with ``flash_attn_varlen_func``'s API (packed sequences, ``cu_seqlens``): ``varlen_base``, the
correct kernel (flash_bugs.flash_base on every sequence's slices), and one realistic bug each, declared a catalog
entry by the ``@bug`` above it.

    pytest properties/ --kernel-api flash-varlen --kernel properties.catalog.flash_varlen_bugs:varlen_causal_global_offset
"""
from __future__ import annotations

import math

import torch

from properties.catalog._utils import compute_dtype
from properties.catalog.flash_bugs import flash_base
from properties.catalog.registry import bug
from zoo.nn.flash_dense import band_allowed

__all__ = ["varlen_base", "varlen_reads_one_key_past_the_end", "varlen_backward_across_sequences",
           "varlen_alibi_row0", "varlen_causal_global_offset", "varlen_cross_sequence_leak"]


def _bounds(cu):
    b = [int(x) for x in cu.tolist()]
    return list(zip(b, b[1:]))


def varlen_base(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
                causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                return_attn_probs=False, *, _key_slice=None, _row=None):
    """A correct ``flash_attn_varlen_func``: ``flash_base`` on every sequence's slices."""
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
    for index, ((q0, q1), (k0, k1)) in enumerate(zip(_bounds(cu_seqlens_q), _bounds(cu_seqlens_k))):
        if _key_slice is not None:
            k0, k1 = _key_slice(k0, k1)
        slopes = alibi_slopes
        if slopes is not None and slopes.dim() == 2:
            slopes = slopes[index if _row is None else _row(index)]
        out[q0:q1] = flash_base(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], dropout_p, softmax_scale, causal,
                                window_size, softcap, slopes)[0]
    return out


@bug("VARLEN-EQUALS-PADDED", "VARLEN-INDEPENDENT", api="flash-varlen",
     mechanism="sequence b's keys sliced k[cu_k[b] : cu_k[b+1] + 1]: the next sequence's first key leaks in")
def varlen_reads_one_key_past_the_end(q, k, v, cu_seqlens_q, cu_seqlens_k, *args, **kwargs):
    return varlen_base(q, k, v, cu_seqlens_q, cu_seqlens_k, *args, **kwargs, _key_slice=lambda a, b: (a, b + 1))



class _VarlenBackwardAcrossSequences(torch.autograd.Function):
    """Forward: the correct varlen kernel. Backward: the gradient of one attention over the whole packed batch, as
    a backward that forgets cu_seqlens does: each sequence's gradients leak into its neighbours'."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, options):
        ctx.save_for_backward(q, k, v)
        ctx.scale = options.get("softmax_scale")
        return varlen_base(q, k, v, cu_q, cu_k, 0, 0, **options)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v = ctx.saved_tensors
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            out = flash_base(*(t[None] for t in leaves), softmax_scale=ctx.scale)[0]
            grads = torch.autograd.grad(out, leaves, grad_out, allow_unused=True)
        return (*grads, None, None, None)


@bug("VARLEN-GRAD", api="flash-varlen",
     mechanism="exact forward; the backward differentiates one attention over the whole packed batch")
def varlen_backward_across_sequences(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **options):
    return _VarlenBackwardAcrossSequences.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, options)

@bug("VARLEN-EQUALS-PADDED", api="flash-varlen", mechanism="(B, H) slopes: row 0 used for every sequence")
def varlen_alibi_row0(q, k, v, cu_seqlens_q, cu_seqlens_k, *args, **kwargs):
    return varlen_base(q, k, v, cu_seqlens_q, cu_seqlens_k, *args, **kwargs, _row=lambda index: 0)


def _packed(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window_size, softcap, alibi_slopes, allowed_fn):
    """One masked problem over the packed axes; ``allowed_fn(qi, ki, q_id, k_id, q_pos, k_pos, offset)``."""
    total_q, h, e = q.shape
    total_k = k.shape[0]
    if total_q == 0 or total_k == 0:
        return q.new_zeros(total_q, h, v.shape[-1])
    ct = compute_dtype(q.dtype)

    def ids(cu, total):
        seq = torch.full((total,), -1, dtype=torch.long)
        pos = torch.zeros(total, dtype=torch.long)
        for index, (a, b) in enumerate(_bounds(cu)):
            seq[a:b], pos[a:b] = index, torch.arange(b - a)
        return seq.to(q.device), pos.to(q.device)

    q_id, q_pos = ids(cu_seqlens_q, total_q)
    k_id, k_pos = ids(cu_seqlens_k, total_k)
    lens_q = torch.tensor([b - a for a, b in _bounds(cu_seqlens_q)] + [0], device=q.device)
    lens_k = torch.tensor([b - a for a, b in _bounds(cu_seqlens_k)] + [0], device=q.device)
    offset = (lens_k[q_id] - lens_q[q_id])[:, None]
    allowed = allowed_fn(torch.arange(total_q, device=q.device)[:, None], torch.arange(total_k, device=q.device)[None, :],
                         q_id[:, None], k_id[None, :], q_pos[:, None], k_pos[None, :], offset)
    diag = q_pos[:, None] + offset
    scale = 1.0 / math.sqrt(e) if softmax_scale is None else softmax_scale
    s = flash_base.scores(q[None], flash_base.expand(k[None], h), scale, softcap, ct)[0]
    if alibi_slopes is not None:
        sl = alibi_slopes.to(device=q.device, dtype=ct)
        sl = sl.expand(len(lens_q) - 1, h)[q_id.clamp_min(0)]
        s = s - sl.T[:, :, None] * (diag - k_pos[None, :]).abs().to(ct)
    s = s.masked_fill(~allowed, -math.inf)
    w = flash_base.softmax(s)
    return torch.einsum("hls,shv->lhv", w, flash_base.expand(v[None], h)[0].to(ct)).to(q.dtype)


@bug("VARLEN-EQUALS-PADDED", api="flash-varlen",
     mechanism="causal/window diagonal of the packed matrix (total_k - total_q), not each sequence's Lk_b - Lq_b")
def varlen_causal_global_offset(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                deterministic=False, return_attn_probs=False):
    """Block-diagonal, but the causal/window diagonal is that of the whole packed matrix (offset total_k −
    total_q over packed indices), not each sequence's own."""
    global_offset = k.shape[0] - q.shape[0]

    def allowed(qi, ki, q_id, k_id, q_pos, k_pos, offset):
        return (q_id == k_id) & (q_id >= 0) & band_allowed(qi + global_offset, ki, 0, causal, window_size)
    return _packed(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window_size, softcap, alibi_slopes,
                   allowed)


@bug("VARLEN-INDEPENDENT", "VARLEN-EQUALS-PADDED", api="flash-varlen",
     mechanism="keys bounded by the end of the query's sequence only: earlier sequences leak in")
def varlen_cross_sequence_leak(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                               softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                               deterministic=False, return_attn_probs=False):
    """Keys are bounded by the end of the query's sequence only: every earlier sequence's keys leak in (positions
    before the sequence's start count as admissible)."""
    def allowed(qi, ki, q_id, k_id, q_pos, k_pos, offset):
        own = (k_id <= q_id) & (k_id >= 0) & (q_id >= 0)
        rel = torch.where(k_id == q_id, k_pos, torch.full_like(k_pos * q_pos, -1))
        rows = q_pos + offset
        band = band_allowed(rows, rel, 0, causal, (-1, window_size[1]))
        if window_size[0] >= 0:
            band = band & ((rel >= rows - window_size[0]) | (k_id < q_id))
        return own & band
    return _packed(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window_size, softcap, alibi_slopes,
                   allowed)
