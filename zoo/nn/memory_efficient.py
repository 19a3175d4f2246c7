"""Memory-efficient attention in plain PyTorch, FlashAttention-2 style, with its own backward.

The kernel contract of ``zoo.nn.kernel`` (that of ``F.scaled_dot_product_attention``). The forward pass walks
the keys in blocks with an online softmax and keeps, besides the output, only the row log-sum-exp
``lse`` (b, h, l) — never the (l, s) weight matrix; the backward pass recomputes each block's weights from
``lse`` (Dao 2023, Algorithm 2):

    w = exp(q·kᵀ·scale + mask - lse)     D = rowsum(dO ∘ out)     dS = w ∘ (dO vᵀ - D)
    dq += scale · dS k     dk = scale · dSᵀ q     dv = wᵀ dO     (dmask = dS, when a float mask needs it)

So memory grows with l · block, not l · s (a bool or float mask the caller passes is of course (l, s)).
Dropout draws each block's mask from a generator seeded per call and block, so the backward regenerates the
very mask the forward used. Half-precision inputs are computed in float32. Axis letters as in zoo.nn.kernel.
"""
from __future__ import annotations

import math

import torch
from einops import rearrange

__all__ = ["memory_efficient_attention", "BLOCK"]

BLOCK = 128  # keys per block


def _blocks(s: int, block: int):
    return [(j, min(j + block, s)) for j in range(0, s, block)]


def _tile(t: torch.Tensor | None, j0: int, j1: int):
    """A mask's columns j0:j1 (a mask that broadcasts over keys is used whole)."""
    if t is None or t.shape[-1] == 1:
        return t
    return t[..., j0:j1]


def _expand(t: torch.Tensor, group: int) -> torch.Tensor:
    return t if group == 1 else t.repeat_interleave(group, dim=-3)


def _scores(q_scaled, k_tile, mask, is_causal, j0, j1, l):
    """One block of scores with the mask semantics of the contract (-inf where a key is not admissible)."""
    s = q_scaled @ k_tile.transpose(-1, -2)
    mask_tile = _tile(mask, j0, j1)
    if mask_tile is not None:
        s = s.masked_fill(~mask_tile, float("-inf")) if mask_tile.dtype == torch.bool else s + mask_tile
    if is_causal:
        rows = torch.arange(l, device=s.device)[:, None]
        cols = torch.arange(j0, j1, device=s.device)[None, :]
        s = s.masked_fill(cols > rows, float("-inf"))
    return s


def _keep(shape, p: float, seed: int, block_index: int, device) -> torch.Tensor:
    generator = torch.Generator(device=device).manual_seed(seed + 1_000_003 * block_index)
    return torch.rand(shape, generator=generator, device=device) >= p


class _MemoryEfficient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, dropout_p, is_causal, scale, group, block):
        compute = torch.promote_types(q.dtype, torch.float32)
        qs = q.to(compute) * scale  # scale first: an unscaled q·k can overflow where the score does not
        kc, vc = k.to(compute), v.to(compute)
        mask_c = mask if mask is None or mask.dtype == torch.bool else mask.to(compute)
        l = q.shape[-2]
        lead = torch.broadcast_shapes(q.shape[:-2], _expand(k, group).shape[:-2])
        row_max = torch.full((*lead, l), float("-inf"), dtype=compute, device=q.device)
        row_sum = torch.zeros((*lead, l), dtype=compute, device=q.device)
        acc = torch.zeros((*lead, l, v.shape[-1]), dtype=compute, device=q.device)
        seed = int(torch.randint(2**62, (1,))) if dropout_p > 0 else 0
        for index, (j0, j1) in enumerate(_blocks(k.shape[-2], block)):
            s = _scores(qs, _expand(kc[..., j0:j1, :], group), mask_c, is_causal, j0, j1, l)
            new_max = torch.maximum(row_max, s.amax(-1))
            safe_max = torch.where(torch.isfinite(new_max), new_max, torch.zeros_like(new_max))
            w = torch.exp(s - safe_max[..., None])
            correction = torch.exp(row_max - safe_max)
            row_sum = row_sum * correction + w.sum(-1)
            if dropout_p > 0:
                w = w * _keep(w.shape, dropout_p, seed, index, q.device) / (1 - dropout_p)
            acc = acc * correction[..., None] + w @ _expand(vc[..., j0:j1, :], group)
            row_max = new_max
        has_key = row_sum > 0
        out = torch.where(has_key[..., None], acc / torch.where(has_key, row_sum, 1.0)[..., None], 0.0)
        safe_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
        lse = torch.where(has_key, safe_max + torch.log(torch.where(has_key, row_sum, 1.0)), float("-inf"))
        ctx.save_for_backward(q, k, v, mask if mask is not None else torch.empty(0), out, lse)
        ctx.options = (mask is not None, dropout_p, is_causal, scale, group, block, seed)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, mask, out, lse = ctx.saved_tensors
        has_mask, dropout_p, is_causal, scale, group, block, seed = ctx.options
        mask = mask if has_mask else None
        compute = out.dtype
        qs, kc, vc = q.to(compute) * scale, k.to(compute), v.to(compute)
        mask_c = mask if mask is None or mask.dtype == torch.bool else mask.to(compute)
        do = grad_out.to(compute)
        rowsum = (do * out).sum(-1)                                   # D (b, h, l)
        safe_lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[..., None]
        l = q.shape[-2]
        d_q = torch.zeros(out.shape[:-1] + (q.shape[-1],), dtype=compute, device=q.device)
        d_k_blocks, d_v_blocks, d_mask_blocks = [], [], []
        want_mask = has_mask and mask.dtype != torch.bool and ctx.needs_input_grad[3]
        for index, (j0, j1) in enumerate(_blocks(k.shape[-2], block)):
            k_tile, v_tile = _expand(kc[..., j0:j1, :], group), _expand(vc[..., j0:j1, :], group)
            w = torch.exp(_scores(qs, k_tile, mask_c, is_causal, j0, j1, l) - safe_lse)
            w_used = w
            d_w = do @ v_tile.transpose(-1, -2)
            if dropout_p > 0:
                factor = _keep(w.shape, dropout_p, seed, index, q.device).to(compute) / (1 - dropout_p)
                w_used, d_w = w * factor, d_w * factor
            d_s = w * (d_w - rowsum[..., None])
            d_q = d_q + scale * (d_s @ k_tile)
            d_k_blocks.append(d_s.transpose(-1, -2) @ qs)         # d(q·scale)/dk: qs already carries the scale
            d_v_blocks.append(w_used.transpose(-1, -2) @ do)
            if want_mask:
                d_mask_blocks.append(d_s)
        d_k, d_v = torch.cat(d_k_blocks, dim=-2), torch.cat(d_v_blocks, dim=-2)
        if group > 1:
            d_k, d_v = (rearrange(t, "... (k g) s e -> ... k g s e", g=group).sum(-3) for t in (d_k, d_v))
        d_k, d_v = d_k.sum_to_size(k.shape), d_v.sum_to_size(v.shape)
        d_mask = None
        if want_mask:
            d_mask = torch.cat(d_mask_blocks, dim=-1).sum_to_size(mask.shape).to(mask.dtype)
        return (d_q.sum_to_size(q.shape).to(q.dtype), d_k.to(k.dtype), d_v.to(v.dtype), d_mask,
                None, None, None, None, None)


def memory_efficient_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                               enable_gqa=False, *, block: int = BLOCK):
    """The kernel contract (zoo.nn.kernel) in O(l · block) memory, with a recomputing backward."""
    if is_causal and attn_mask is not None:
        raise ValueError("is_causal=True cannot be combined with an explicit attn_mask")
    e, s = query.shape[-1], key.shape[-2]
    if key.shape[-1] != e:
        raise ValueError(f"query and key feature sizes differ: {e} vs {key.shape[-1]}")
    if value.shape[-2] != s:
        raise ValueError(f"key and value lengths differ: {s} vs {value.shape[-2]}")
    group = 1
    if enable_gqa and query.dim() >= 3 and key.shape[-3] != query.shape[-3]:
        if query.shape[-3] % key.shape[-3]:
            raise ValueError(f"query heads ({query.shape[-3]}) must be a multiple of key/value heads "
                             f"({key.shape[-3]})")
        group = query.shape[-3] // key.shape[-3]
    scale = 1.0 / math.sqrt(e) if scale is None else scale
    return _MemoryEfficient.apply(query, key, value, attn_mask, dropout_p, is_causal, scale, group, block)
