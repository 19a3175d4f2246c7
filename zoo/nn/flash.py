"""FlashAttention's Python API (flash-attn 2.x) in plain PyTorch: reference kernels for the three entry points.

The calling conventions and semantics are those of ``flash_attn/flash_attn_interface.py`` (the docstrings of
``flash_attn_func``, ``flash_attn_varlen_func`` and ``flash_attn_with_kvcache``)::

    flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False)
    flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, <the same keywords>)
    flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False)

Shapes (axis letters as in ``zoo/nn/kernel.py``): q (b, l, h, e), k and v (b, s, k, e) with h = k·g (query head
i reads key/value head i // g); varlen: q (total_l, h, e), k and v (total_s, k, e) and int32 cu_seqlens (b + 1,);
kvcache: a cache (b_cache, s_cache, k, e), or paged (blocks, block_size, k, e) with an int32 block_table
(b, max_blocks).

Semantics, with o = s − l (bottom-right alignment): query i may attend key j iff j ≤ i + o under ``causal``,
and i + o − left ≤ j ≤ i + o + right under ``window_size=(left, right)`` (−1: unbounded on that side). The
score is σ q·k (σ = softmax_scale, default 1/√e), capped to softcap·tanh(σ q·k / softcap) when softcap > 0, plus
−slope·|i + o − j| with ``alibi_slopes`` of shape (h,) or (b, h); then masked and normalised. A query with no
admissible key outputs 0. Varlen: every sequence of the packed batch is a ``flash_attn_func`` problem of its
own (alibi row b for a (b, h) slope table). KV cache: k and v, when given, are written into the cache in
place at positions cache_seqlens[b] ...; attention covers cache positions [cache_leftpad[b], cache_seqlens[b]
+ l_new), causal, window and alibi bottom-right aligned to that range; ``cache_seqlens=None`` means the whole
cache; ``cache_batch_idx`` picks the cache row of each batch entry. Rotary embedding of the kvcache API is not
implemented (NotImplementedError), nor ``return_softmax_lse`` there.

Kernels (``FLASH_KERNELS``, by API): ``flash`` — ``reference`` (every score at once) and ``tiled`` (key and
query tiles with an online softmax, the FlashAttention-2 forward; tiles outside the causal/window band are
skipped); ``flash-varlen`` — ``varlen_loop`` (one ``reference`` call per sequence) and ``varlen_packed`` (one
block-diagonal problem over the packed axis); ``flash-kvcache`` — ``kvcache_gather`` (the range gathered into
a contiguous tensor, then ``reference``) and ``kvcache_paged`` (an online softmax that walks the cache block by
block through the block table; a contiguous cache is one block per row). Half-precision inputs are computed in
float32. ``reference`` and ``tiled`` (and the varlen kernels) are differentiable with autograd.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from einops import einsum, rearrange, repeat

from zoo.config.plugins import PluginError, load_object

__all__ = ["flash_attn_reference", "flash_attn_tiled", "flash_attn_varlen_loop", "flash_attn_varlen_packed",
           "flash_attn_kvcache_gather", "flash_attn_kvcache_paged", "FLASH_APIS", "FLASH_KERNELS",
           "resolve_flash_kernel", "band_allowed", "soft_cap", "admissible_softmax", "paged_slots"]

FLASH_APIS = ("flash", "flash-varlen", "flash-kvcache")
KEY_BLOCK = 4     # tile sizes of the tiled kernel: small, so that problems of a few keys run several tiles
QUERY_BLOCK = 3


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _window(window_size) -> tuple[int, int]:
    left, right = (int(w) for w in window_size)
    if left < -1 or right < -1:
        raise ValueError(f"window_size={tuple(window_size)}: each side is -1 (unbounded) or >= 0")
    return left, right


def band_allowed(rows: torch.Tensor, cols: torch.Tensor, offset, causal: bool, window_size) -> torch.Tensor:
    """Bool (…rows, …cols) band: key position ``cols`` admissible for query position ``rows`` (broadcast
    against each other), diagonal shifted by ``offset`` = s − l (bottom-right)."""
    left, right = _window(window_size)
    diagonal = rows + offset
    allowed = torch.ones(torch.broadcast_shapes(rows.shape, cols.shape), dtype=torch.bool, device=rows.device)
    if causal:
        allowed = allowed & (cols <= diagonal)
    if right >= 0:
        allowed = allowed & (cols <= diagonal + right)
    if left >= 0:
        allowed = allowed & (cols >= diagonal - left)
    return allowed


def soft_cap(scores: torch.Tensor, softcap) -> torch.Tensor:
    """Gemma 2's logit soft-capping, softcap·tanh(score / softcap), on scaled scores before any bias or mask
    (flash-attn applies it to σ q·k and adds ALiBi afterwards); softcap 0 or None leaves them alone."""
    if not softcap:
        return scores
    return softcap * torch.tanh(scores / softcap)


def _alibi(alibi_slopes, batch: int, heads: int, rows, cols, offset, ct, device):
    """(batch, heads, …) bias −slope·|i + o − j| (None without slopes)."""
    if alibi_slopes is None:
        return None
    slopes = alibi_slopes.to(device=device, dtype=ct)   # float32 slopes are exact in the compute dtype
    if slopes.shape not in ((heads,), (batch, heads)):
        raise ValueError(f"alibi_slopes has shape {tuple(slopes.shape)}: expected ({heads},) or ({batch}, {heads})")
    slopes = slopes.expand(batch, heads)
    distance = (rows + offset - cols).abs().to(ct)
    return -slopes[:, :, None, None] * distance


def _scores(q, k, scale, softcap, ct):
    """σ q·k (q scaled first: ATTN-LARGE-SCORES), capped when softcap > 0; (b, h, l, s) in ``ct``."""
    scores = einsum(q.to(ct) * scale, k.to(ct), "b l h e, b s h e -> b h l s")
    return soft_cap(scores, softcap) if softcap > 0 else scores


def _band_scores(q, k, scale, softcap, alibi_slopes, batch: int, heads: int, rows, cols, offset, causal: bool,
                 window_size, ct):
    """The scores of queries ``rows`` against keys ``cols`` (positions, query i aligned to key i + offset):
    σ q·k capped, plus ALiBi, -inf outside the causal/window band; (b, h, l, s) in ``ct``."""
    scores = _scores(q, k, scale, softcap, ct)
    bias = _alibi(alibi_slopes, batch, heads, rows, cols, offset, ct, q.device)
    if bias is not None:
        scores = scores + bias
    return scores.masked_fill(~band_allowed(rows, cols, offset, causal, window_size), -math.inf)


def admissible_softmax(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Softmax over the last axis where inadmissible keys score -inf: (weights, row max, row sum of exp).

    Max-subtraction keeps exp() in range; a row with no admissible key has max -inf, which is replaced by 0
    so that its weights are all zeros instead of NaN (the kernel contract's fully masked rows)."""
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    unnormalized = torch.exp(scores - row_max)
    total = unnormalized.sum(dim=-1, keepdim=True)
    return unnormalized / torch.where(total > 0, total, torch.ones_like(total)), row_max, total


class _OnlineSoftmax:
    """FlashAttention's running max, running sum and output accumulator over key tiles (FlashAttention-2,
    Algorithm 1), for (b, h, l) queries; a row that never sees an admissible key ends as zeros."""

    def __init__(self, b: int, h: int, l: int, ev: int, ct, device):
        self.max = torch.full((b, h, l, 1), -math.inf, dtype=ct, device=device)
        self.sum = torch.zeros((b, h, l, 1), dtype=ct, device=device)
        self.acc = torch.zeros((b, h, l, ev), dtype=ct, device=device)

    def add(self, scores: torch.Tensor, values: torch.Tensor, dropout_p: float = 0.0) -> None:
        """Fold in one key tile: scores (b, h, l, s), values (b, s, h, v) in the compute dtype."""
        new_max = torch.maximum(self.max, scores.amax(dim=-1, keepdim=True))
        safe_max = torch.where(torch.isfinite(new_max), new_max, torch.zeros_like(new_max))
        correction = torch.exp(self.max - safe_max)
        p = torch.exp(scores - safe_max)
        self.sum = self.sum * correction + p.sum(dim=-1, keepdim=True)
        if dropout_p > 0.0:   # after the sum: dropout acts on the normalised weights
            p = p * (torch.rand(p.shape, device=p.device) >= dropout_p) / (1.0 - dropout_p)
        self.acc = self.acc * correction + einsum(p, values, "b h l s, b s h v -> b h l v")
        self.max = new_max

    def result(self) -> torch.Tensor:
        return self.acc / torch.where(self.sum > 0, self.sum, torch.ones_like(self.sum))


def _expand_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    kv_heads = t.shape[-2]
    if heads % kv_heads:
        raise ValueError(f"query heads ({heads}) must be a multiple of key/value heads ({kv_heads})")
    return repeat(t, "b s k e -> b s (k g) e", g=heads // kv_heads)


def _check(q, k, v):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be (batch, seqlen, heads, headdim); got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[:3] != v.shape[:3] or k.shape[-1] != q.shape[-1] or k.shape[0] != q.shape[0]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} do not match q {tuple(q.shape)}")


def flash_attn_reference(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                         softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """``flash_attn_func`` computed from the definition: every score at once (see the module docstring)."""
    _check(q, k, v)
    b, l, h, e = q.shape
    s = k.shape[1]
    scale = 1.0 / math.sqrt(e) if softmax_scale is None else softmax_scale
    ct = _compute_dtype(q.dtype)
    if s == 0 or l == 0:
        out = q.new_zeros(b, l, h, v.shape[-1])
        lse = torch.full((b, h, l), -math.inf, dtype=torch.float32, device=q.device)
        return (out, lse, None) if return_attn_probs else out
    kx, vx = _expand_kv(k, h), _expand_kv(v, h)
    rows = torch.arange(l, device=q.device)[:, None]
    cols = torch.arange(s, device=q.device)[None, :]
    scores = _band_scores(q, kx, scale, softcap, alibi_slopes, b, h, rows, cols, s - l, causal, window_size, ct)
    weights, row_max, total = admissible_softmax(scores)
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p)
    out = einsum(weights, vx.to(ct), "b h l s, b s h v -> b l h v").to(q.dtype)
    if return_attn_probs:
        lse = (torch.log(total) + row_max).squeeze(-1).to(torch.float32)
        return out, lse, weights
    return out


def flash_attn_tiled(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                     softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """``flash_attn_func`` as FlashAttention-2 computes it: query tiles of ``QUERY_BLOCK``, key tiles of
    ``KEY_BLOCK`` with a running max and sum (online softmax), tiles outside the causal/window band skipped."""
    if return_attn_probs:
        raise NotImplementedError("flash_attn_tiled does not return attention probabilities")
    _check(q, k, v)
    b, l, h, e = q.shape
    s = k.shape[1]
    scale = 1.0 / math.sqrt(e) if softmax_scale is None else softmax_scale
    ct = _compute_dtype(q.dtype)
    left, right = _window(window_size)
    kx, vx = _expand_kv(k, h).to(ct), _expand_kv(v, h).to(ct)
    offset, device = s - l, q.device
    tiles = []
    for i0 in range(0, l, QUERY_BLOCK):
        i1 = min(i0 + QUERY_BLOCK, l)
        q_tile = q[:, i0:i1]
        rows = torch.arange(i0, i1, device=device)[:, None]
        softmax = _OnlineSoftmax(b, h, i1 - i0, v.shape[-1], ct, device)
        # The band of this query tile: keys [first, last] (FlashAttention-2's n_block_min / n_block_max).
        last = s - 1
        if causal or right >= 0:
            last = min(last, i1 - 1 + offset + (right if right >= 0 and not causal else 0))
        first = max(0, i0 + offset - left) if left >= 0 else 0
        for j0 in range(first - first % KEY_BLOCK, last + 1, KEY_BLOCK):
            j1 = min(j0 + KEY_BLOCK, s)
            cols = torch.arange(j0, j1, device=device)[None, :]
            scores = _band_scores(q_tile, kx[:, j0:j1], scale, softcap, alibi_slopes, b, h, rows, cols, offset,
                                  causal, window_size, ct)
            softmax.add(scores, vx[:, j0:j1], dropout_p)
        tiles.append(softmax.result())
    if not tiles:
        return q.new_zeros(b, l, h, v.shape[-1])
    return rearrange(torch.cat(tiles, dim=2), "b h l v -> b l h v").to(q.dtype)


# ------------------------------------------------------------------------------------------------ varlen
def _lengths(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens must be (batch + 1,), got {tuple(cu_seqlens.shape)}")
    bounds = [int(x) for x in cu_seqlens.tolist()]
    if bounds[0] != 0 or any(b1 < b0 for b0, b1 in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens must start at 0 and never decrease: {bounds}")
    return list(zip(bounds, bounds[1:]))


def _alibi_row(alibi_slopes, index: int):
    if alibi_slopes is None or alibi_slopes.dim() == 1:
        return alibi_slopes
    return alibi_slopes[index]


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
                                         causal, window_size, softcap, _alibi_row(alibi_slopes, index))[0])
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
    device, ct = q.device, _compute_dtype(q.dtype)
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
    scores = _scores(q[None], _expand_kv(k[None], h), scale, softcap, ct)[0]               # (h, total_l, total_s)
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
    out = einsum(weights, _expand_kv(v[None], h)[0].to(ct), "h l s, s h v -> l h v")
    return out.to(q.dtype)


# ----------------------------------------------------------------------------------------------- kvcache
def _cache_plan(q, k_cache, k, cache_seqlens, cache_batch_idx, cache_leftpad, block_table):
    """Per batch entry: (cache row or block list, start, end) of the attended range, and where new keys go."""
    b = q.shape[0]
    if block_table is not None and cache_batch_idx is not None:
        raise NotImplementedError("a paged cache (block_table) with cache_batch_idx is not supported")
    if block_table is not None:
        capacity = block_table.shape[1] * k_cache.shape[1]
    else:
        capacity = k_cache.shape[1]
    new = 0 if k is None else k.shape[1]
    if cache_seqlens is None:
        if k is not None:
            raise ValueError("k and v need cache_seqlens (where to append)")
        seqlens = [capacity] * b
    elif isinstance(cache_seqlens, int):
        seqlens = [cache_seqlens] * b
    else:
        seqlens = [int(x) for x in cache_seqlens.reshape(-1).tolist()]
    leftpad = [0] * b if cache_leftpad is None else [int(x) for x in cache_leftpad.tolist()]
    rows = list(range(b)) if cache_batch_idx is None else [int(x) for x in cache_batch_idx.tolist()]
    for index in range(b):
        if not 0 <= leftpad[index] <= seqlens[index] or seqlens[index] + new > capacity:
            raise ValueError(f"batch {index}: cache_leftpad {leftpad[index]}, cache_seqlens {seqlens[index]} "
                             f"and {new} new keys do not fit a cache of {capacity} positions")
    return seqlens, leftpad, rows, new


def paged_slots(block_table: torch.Tensor, positions: torch.Tensor, block_size: int):
    """(physical block, slot within it) of logical cache ``positions`` through a block table (…, max_blocks):
    block_table[…, p // block_size] and p % block_size, so that cache[blocks, slots] reads them in place."""
    return block_table.to(positions.device).long()[..., positions // block_size], positions % block_size


def _locate(positions: torch.Tensor, row: int, index: int, block_table, block_size: int):
    """(cache index 0, cache index 1) tensors of ``positions`` of batch entry ``index``."""
    if block_table is None:
        return torch.full_like(positions, row), positions
    return paged_slots(block_table[index], positions, block_size)


def _append(k_cache, v_cache, k, v, seqlens, rows, block_table):
    """Write the new keys and values into the cache in place."""
    if k is None:
        return
    if v is None or v.shape[:2] != k.shape[:2]:
        raise ValueError("k and v must be given together, with the same batch and length")
    with torch.no_grad():
        for index, row in enumerate(rows):
            positions = torch.arange(seqlens[index], seqlens[index] + k.shape[1], device=k_cache.device)
            where = _locate(positions, row, index, block_table, k_cache.shape[1])
            k_cache[where] = k[index].to(k_cache.dtype)
            v_cache[where] = v[index].to(v_cache.dtype)


def _kvcache_unsupported(rotary_cos, return_softmax_lse):
    if rotary_cos is not None:
        raise NotImplementedError("rotary embedding in the kvcache kernels is not implemented")
    if return_softmax_lse:
        raise NotImplementedError("return_softmax_lse is not implemented")


def flash_attn_kvcache_gather(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                              cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                              softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                              rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """``flash_attn_with_kvcache``: append, gather each entry's range [leftpad, seqlen + new) into a contiguous
    tensor (through the block table when paged), and call ``flash_attn_reference`` on it."""
    _kvcache_unsupported(rotary_cos, return_softmax_lse)
    seqlens, leftpad, rows, new = _cache_plan(q, k_cache, k, cache_seqlens, cache_batch_idx, cache_leftpad,
                                              block_table)
    _append(k_cache, v_cache, k, v, seqlens, rows, block_table)
    outs = []
    for index, row in enumerate(rows):
        positions = torch.arange(leftpad[index], seqlens[index] + new, device=k_cache.device)
        where = _locate(positions, row, index, block_table, k_cache.shape[1])
        outs.append(flash_attn_reference(q[index:index + 1], k_cache[where][None], v_cache[where][None],
                                         softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                                         softcap=softcap, alibi_slopes=_alibi_row(alibi_slopes, index)))
    return torch.cat(outs)


def flash_attn_kvcache_paged(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                             cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                             softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                             rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """``flash_attn_with_kvcache`` as a paged decode kernel: an online softmax over the cache blocks of each
    entry, read in place through the block table (a contiguous cache is one block per row)."""
    _kvcache_unsupported(rotary_cos, return_softmax_lse)
    seqlens, leftpad, rows, new = _cache_plan(q, k_cache, k, cache_seqlens, cache_batch_idx, cache_leftpad,
                                              block_table)
    _append(k_cache, v_cache, k, v, seqlens, rows, block_table)
    b, l, h, e = q.shape
    block_size = k_cache.shape[1]
    scale = 1.0 / math.sqrt(e) if softmax_scale is None else softmax_scale
    ct, device = _compute_dtype(q.dtype), q.device
    rows_q = torch.arange(l, device=device)[:, None]
    outs = []
    for index, row in enumerate(rows):
        start, end = leftpad[index], seqlens[index] + new
        offset = (end - start) - l
        slopes = _alibi_row(alibi_slopes, index)
        softmax = _OnlineSoftmax(1, h, l, v_cache.shape[-1], ct, device)
        for n in range(start // block_size, -(-end // block_size)):
            block = row if block_table is None else int(block_table[index, n])
            j0, j1 = max(start, n * block_size), min(end, (n + 1) * block_size)
            if j1 <= j0:
                continue
            kb = _expand_kv(k_cache[block, j0 - n * block_size:j1 - n * block_size][None], h)
            vb = _expand_kv(v_cache[block, j0 - n * block_size:j1 - n * block_size][None], h)
            cols = torch.arange(j0, j1, device=device)[None, :] - start
            scores = _band_scores(q[index:index + 1], kb, scale, softcap,
                                  None if slopes is None else slopes.reshape(-1), 1, h, rows_q, cols, offset,
                                  causal, window_size, ct)
            softmax.add(scores, vb.to(ct))
        outs.append(softmax.result())
    return rearrange(torch.cat(outs), "b h l v -> b l h v").to(q.dtype)


FLASH_KERNELS: dict[str, dict[str, Callable]] = {
    "flash": {"reference": flash_attn_reference, "tiled": flash_attn_tiled},
    "flash-varlen": {"varlen_loop": flash_attn_varlen_loop, "varlen_packed": flash_attn_varlen_packed},
    "flash-kvcache": {"kvcache_gather": flash_attn_kvcache_gather, "kvcache_paged": flash_attn_kvcache_paged},
}


def resolve_flash_kernel(kernel: str | Callable, api: str) -> Callable:
    """A zoo kernel name of ``api`` (a key of FLASH_KERNELS[api]), an import path, or a callable."""
    if api not in FLASH_KERNELS:
        raise PluginError(f"kernel API {api!r}: expected one of {FLASH_APIS}")
    if callable(kernel):
        return kernel
    if kernel in FLASH_KERNELS[api]:
        return FLASH_KERNELS[api][kernel]
    if ":" not in kernel:
        raise PluginError(f"kernel {kernel!r}: expected one of {sorted(FLASH_KERNELS[api])} ({api} API) or an "
                          "import path 'pkg.module:function'")
    obj = load_object(kernel)
    if not callable(obj):
        raise PluginError(f"kernel {kernel!r} is not callable")
    return obj
