"""``flash_attn_varlen_func`` in plain PyTorch (the API and its semantics: zoo/nn/flash.py): a packed batch of
sequences, each a ``flash_attn_func`` problem of its own — ``varlen_loop`` (one ``reference`` call per sequence) and
``varlen_packed`` (one block-diagonal problem over the packed axis).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import einsum

from zoo.nn.flash_dense import alibi_row, band_allowed, capped_scores, compute_dtype, expand_kv, flash_attn_reference

__all__ = ["flash_attn_varlen_loop", "flash_attn_varlen_packed"]


def _lengths(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens must be (batch + 1,), got {tuple(cu_seqlens.shape)}")
    bounds = [int(x) for x in cu_seqlens.tolist()]
    if bounds[0] != 0 or any(b1 < b0 for b0, b1 in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens must start at 0 and never decrease: {bounds}")
    return list(zip(bounds, bounds[1:]))


def flash_attn_varlen_loop(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """``flash_attn_varlen_func``: one ``flash_attn_reference`` call per sequence of the packed batch."""
    if return_attn_probs or block_table is not None:
        raise NotImplementedError("varlen_loop: return_attn_probs and block_table are not supported")
    seq_q, seq_k = _lengths(cu_seqlens_q), _lengths(cu_seqlens_k)
    if len(seq_q) != len(seq_k):
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k give {len(seq_q)} and {len(seq_k)} sequences")
    outs = []
    for index, ((q0, q1), (k0, k1)) in enumerate(zip(seq_q, seq_k)):
        outs.append(flash_attn_reference(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], dropout_p, softmax_scale,
                                         causal, window_size, softcap, alibi_row(alibi_slopes, index))[0])
    out = torch.cat(outs) if outs else q.new_zeros(0, q.shape[1], v.shape[-1])
    return torch.cat([out, q.new_zeros(q.shape[0] - out.shape[0], q.shape[1], v.shape[-1])])  # rows past the last


def _positions(seqs, total: int, device):
    """(sequence id, position within it) of every packed row; rows past the last sequence get id -1."""
    ids = torch.full((total,), -1, dtype=torch.long, device=device)
    pos = torch.zeros(total, dtype=torch.long, device=device)
    for index, (a, b) in enumerate(seqs):
        ids[a:b] = index
        pos[a:b] = torch.arange(b - a, device=device)
    return ids, pos


def flash_attn_varlen_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                             softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False, block_table=None):
    """``flash_attn_varlen_func`` as one (h, total_l, total_s) problem over the packed axes, masked block-diagonally:
    query row r of sequence b sees key row c iff c belongs to b and the band admits (r − start_q[b], c − start_k[b])
    with the diagonal offset len_k[b] − len_q[b]."""
    if return_attn_probs or block_table is not None:
        raise NotImplementedError("varlen_packed: return_attn_probs and block_table are not supported")
    seq_q, seq_k = _lengths(cu_seqlens_q), _lengths(cu_seqlens_k)
    if len(seq_q) != len(seq_k):
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k give {len(seq_q)} and {len(seq_k)} sequences")
    total_l, h, e = q.shape
    total_s = k.shape[0]
    device, ct = q.device, compute_dtype(q.dtype)
    if total_l == 0 or total_s == 0:
        return q.new_zeros(total_l, h, v.shape[-1])
    scale = 1.0 / math.sqrt(e) if softmax_scale is None else softmax_scale
    q_id, q_pos = _positions(seq_q, total_l, device)
    k_id, k_pos = _positions(seq_k, total_s, device)
    len_q = torch.tensor([b - a for a, b in seq_q] + [0], device=device)[q_id]     # id -1 reads the extra 0
    len_k = torch.tensor([b - a for a, b in seq_k] + [0], device=device)[q_id]
    offset = (len_k - len_q)[:, None]
    rows, cols = q_pos[:, None], k_pos[None, :]
    allowed = (q_id[:, None] == k_id[None, :]) & (q_id[:, None] >= 0)
    allowed = allowed & band_allowed(rows, cols, offset, causal, window_size)
    scores = capped_scores(q[None], expand_kv(k[None], h), scale, softcap, ct)[0]               # (h, total_l, total_s)
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(device=device, dtype=ct)
        batch = len(seq_q)
        if slopes.shape not in ((h,), (batch, h)):
            raise ValueError(f"alibi_slopes has shape {tuple(slopes.shape)}: expected ({h},) or ({batch}, {h})")
        per_row = slopes.expand(batch, h)[q_id.clamp_min(0)]                                # (total_l, h)
        distance = (rows + offset - cols).abs().to(ct)
        scores = scores - per_row.T[:, :, None] * distance
    scores = scores.masked_fill(~allowed, -math.inf)
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    unnormalized = torch.exp(scores - row_max)
    total = unnormalized.sum(dim=-1, keepdim=True)
    weights = unnormalized / torch.where(total > 0, total, torch.ones_like(total))
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p)
    out = einsum(weights, expand_kv(v[None], h)[0].to(ct), "h l s, s h v -> l h v")
    return out.to(q.dtype)

