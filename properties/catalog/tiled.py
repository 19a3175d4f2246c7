"""FlashAttention-2 in plain torch, tile by tile, forward and backward: the base of the tile-boundary bugs
(``properties.catalog.tile_bugs``) and, behind a fused kernel's limits, a correct kernel of the catalog.

``TiledAttention`` has the SDPA signature. The forward pass walks query tiles of ``BLOCK`` rows and, for each,
key tiles of ``BLOCK`` columns with an online softmax (running maximum and sum, the accumulator rescaled when the
maximum moves) and saves the row log-sum-exp; fully masked causal tiles are skipped. The backward pass (Dao 2023,
Algorithm 2) walks key tiles and recomputes each tile's weights from the saved log-sum-exp:

    P = exp(S - lse)    dV += Pᵀ dO    dP = dO Vᵀ    dS = P ∘ (dP - D), D = rowsum(dO ∘ O)
    dQ += σ dS K        dK += σ dSᵀ Q  (dmask = dS for a float mask that requires grad)

Every step is a method, so that a tile-boundary bug overrides one step. Half-precision inputs are computed in
float32. Dropout is declined (NotImplementedError): the dropout clauses are skipped. ``fused_limits`` is the same
kernel declining what fused kernels commonly do not support: float32/float64, any attn_mask, head sizes other than
16, 32, 64, 128, and L ≠ S.

    pytest properties/ --kernel properties.catalog.tiled:tiled_attention
    pytest properties/ --kernel properties.catalog.tiled:fused_limits
"""
from __future__ import annotations

import math

import torch

from properties.catalog._utils import compute_dtype
from properties.catalog.registry import correct

__all__ = ["BLOCK", "TiledAttention", "tiled_attention", "fused_limits"]

BLOCK = 64


@correct("tiled", instance="tiled_attention",
         mechanism="FlashAttention-2 in plain torch, tiles of 64, its own backward (the tile bugs' base)")
class TiledAttention:
    """The SDPA contract computed tile by tile (see the module docstring); one method per step."""

    block = BLOCK

    def __call__(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                 enable_gqa=False):
        if dropout_p > 0:
            raise NotImplementedError("the tiled kernel has no dropout")
        if is_causal and attn_mask is not None:
            raise ValueError("is_causal=True cannot be combined with an explicit attn_mask")
        return _Tiled.apply(query, key, value, attn_mask, is_causal, scale, enable_gqa, self)

    # ------------------------------------------------------------------------------------------ tiles
    def query_tiles(self, l: int) -> list[tuple[int, int]]:
        return [(i, min(i + self.block, l)) for i in range(0, l, self.block)]

    def key_tiles(self, s: int) -> list[tuple[int, int]]:
        return [(j, min(j + self.block, s)) for j in range(0, s, self.block)]

    def scores(self, q, k, sigma):
        """One tile of scaled scores (q σ) kᵀ (compute dtype; q scaled first: the unscaled q·k may overflow where
        the score does not)."""
        return (q * sigma) @ k.transpose(-1, -2)

    def admissible(self, scores, mask, is_causal, i0, i1, j0, j1):
        """The tile's scores with the mask semantics: the float mask added, -inf where a key is not admissible."""
        if mask is not None:
            tile = self.mask_tile(mask, i0, i1, j0, j1)
            scores = scores.masked_fill(~tile, -math.inf) if tile.dtype == torch.bool else scores + tile
        if is_causal:
            rows = torch.arange(i0, i1, device=scores.device)[:, None]
            cols = torch.arange(j0, j1, device=scores.device)[None, :]
            scores = scores.masked_fill(cols > self.causal_rows(rows, i0), -math.inf)
        return scores

    def mask_tile(self, mask, i0, i1, j0, j1):
        return mask[..., i0:i1, j0:j1]

    def causal_rows(self, rows, i0):
        """The query positions the causal test compares the key positions with."""
        return rows

    def key_tile(self, t, j0, j1):
        """Keys (or values) j0 … j1 - 1 as the forward reads them."""
        return t[..., j0:j1, :]

    # ---------------------------------------------------------------------------------- online softmax
    def update(self, acc, row_max, row_sum, scores, v):
        """Fold one key tile into the running (acc, max, sum) of a query tile."""
        new_max = torch.maximum(row_max, scores.amax(-1, keepdim=True))
        safe = torch.where(torch.isfinite(new_max), new_max, torch.zeros_like(new_max))
        correction = torch.exp(row_max - safe)             # 0 before the first admissible key
        p = torch.exp(scores - safe)
        return acc * correction + p @ v, new_max, row_sum * correction + p.sum(-1, keepdim=True)

    def saved_lse(self, row_max, row_sum, tile_lse):
        """The log-sum-exp the backward recomputes the weights from (``tile_lse``: the last key tile's own)."""
        return torch.log(row_sum) + torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))

    def forward(self, q, k, v, mask, is_causal, sigma):
        """(out, lse) in the compute dtype; q, k, v with the same leading dims."""
        lead, l, s = q.shape[:-2], q.shape[-2], k.shape[-2]
        out = torch.zeros(*lead, l, v.shape[-1], dtype=q.dtype, device=q.device)
        lse = torch.full((*lead, l, 1), -math.inf, dtype=q.dtype, device=q.device)
        for i0, i1 in self.query_tiles(l):
            acc = torch.zeros(*lead, i1 - i0, v.shape[-1], dtype=q.dtype, device=q.device)
            row_max = torch.full((*lead, i1 - i0, 1), -math.inf, dtype=q.dtype, device=q.device)
            row_sum = torch.zeros_like(row_max)
            tile_lse = row_max
            for j0, j1 in self.key_tiles(s):
                if is_causal and j0 > i1 - 1:
                    break   # this and every later key tile lie above the diagonal for all rows of the tile
                scores = self.admissible(self.scores(q[..., i0:i1, :], self.key_tile(k, j0, j1), sigma), mask,
                                         is_causal, i0, i1, j0, j1)
                tile_lse = torch.logsumexp(scores, -1, keepdim=True)
                acc, row_max, row_sum = self.update(acc, row_max, row_sum, scores, self.key_tile(v, j0, j1))
            out[..., i0:i1, :] = acc / torch.where(row_sum > 0, row_sum, torch.ones_like(row_sum))
            lse[..., i0:i1, :] = self.saved_lse(row_max, row_sum, tile_lse)
        return out, lse

    # ------------------------------------------------------------------------------------------ backward
    def backward(self, q, k, v, mask, is_causal, sigma, out, lse, d_out, mask_grad: bool):
        """(dq, dk, dv, dmask or None), key tile by key tile, the weights recomputed from ``lse``."""
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        d_scores = torch.zeros(*q.shape[:-1], k.shape[-2], dtype=q.dtype, device=q.device) if mask_grad else None
        d_rowsum = (d_out * out).sum(-1, keepdim=True)
        l, s = q.shape[-2], k.shape[-2]
        for j0, j1 in self.key_tiles(s):
            dk_tile, dv_tile = torch.zeros_like(k[..., j0:j1, :]), torch.zeros_like(v[..., j0:j1, :])
            for i0, i1 in self.query_tiles(l):
                if is_causal and j0 > i1 - 1:
                    continue
                scores = self.admissible(self.scores(q[..., i0:i1, :], k[..., j0:j1, :], sigma), mask, is_causal,
                                         i0, i1, j0, j1)
                row_lse = lse[..., i0:i1, :]
                p = torch.where(torch.isfinite(row_lse), torch.exp(scores - row_lse), torch.zeros_like(scores))
                dv_tile = dv_tile + p.transpose(-1, -2) @ d_out[..., i0:i1, :]
                dp = d_out[..., i0:i1, :] @ v[..., j0:j1, :].transpose(-1, -2)
                ds = p * (dp - d_rowsum[..., i0:i1, :])
                self.add_dq(dq, i0, i1, sigma * ds @ k[..., j0:j1, :])
                dk_tile = dk_tile + sigma * ds.transpose(-1, -2) @ q[..., i0:i1, :]
                if d_scores is not None:
                    d_scores[..., i0:i1, j0:j1] = ds
            self.write_dk_dv(dk, dv, j0, j1, dk_tile, dv_tile)
        return dq, dk, dv, d_scores

    def add_dq(self, dq, i0, i1, contribution):
        dq[..., i0:i1, :] += contribution

    def write_dk_dv(self, dk, dv, j0, j1, dk_tile, dv_tile):
        dk[..., j0:j1, :], dv[..., j0:j1, :] = dk_tile, dv_tile


class _Tiled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, attn_mask, is_causal, scale, enable_gqa, impl):
        l, s, e = query.shape[-2], key.shape[-2], query.shape[-1]
        group = query.shape[-3] // key.shape[-3] if enable_gqa and query.dim() >= 3 else 1
        ct = compute_dtype(query.dtype)
        q, k, v = query.to(ct), key.to(ct), value.to(ct)
        if group > 1:
            k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
        lead = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2])
        q, k, v = q.expand(*lead, l, e), k.expand(*lead, s, e), v.expand(*lead, s, v.shape[-1])
        mask = None
        if attn_mask is not None:
            mask = (attn_mask if attn_mask.dtype == torch.bool else attn_mask.to(ct)).expand(*lead, l, s)
        sigma = 1.0 / math.sqrt(e) if scale is None else scale
        out, lse = impl.forward(q, k, v, mask, is_causal, sigma)
        ctx.save_for_backward(q, k, v, mask if mask is not None else torch.empty(0), out, lse)
        ctx.options = (is_causal, sigma, group, impl, None,
                       None if attn_mask is None else (attn_mask.shape, attn_mask.dtype))
        ctx.inputs = tuple((t.shape, t.dtype) for t in (query, key, value))
        return out.to(query.dtype)

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, mask, out, lse = ctx.saved_tensors
        is_causal, sigma, group, impl, _, mask_info = ctx.options
        mask = mask if mask_info is not None else None
        mask_grad = mask_info is not None and mask_info[1] != torch.bool and ctx.needs_input_grad[3]
        dq, dk, dv, d_scores = impl.backward(q, k, v, mask, is_causal, sigma, out, lse, d_out.to(q.dtype), mask_grad)
        if group > 1:   # a shared key/value head's gradient is the sum over its query group
            dk, dv = (t.unflatten(-3, (t.shape[-3] // group, group)).sum(-3) for t in (dk, dv))
        grads = [g.sum_to_size(shape).to(dtype) for g, (shape, dtype) in zip((dq, dk, dv), ctx.inputs)]
        d_mask = d_scores.sum_to_size(mask_info[0]).to(mask_info[1]) if mask_grad else None
        return (*grads, d_mask, None, None, None, None)


tiled_attention = TiledAttention()


@correct("tiled, a fused kernel's limits",
         mechanism="the same declining float32/float64, masks, head sizes other than 16/32/64/128 and L != S")
def fused_limits(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """``tiled_attention`` behind a fused kernel's limits, declined in flash-attn's and Triton wrappers' words."""
    if query.dtype not in (torch.float16, torch.bfloat16):
        raise RuntimeError(f"fused_limits only supports float16 and bfloat16, not {query.dtype}")
    if attn_mask is not None:
        raise NotImplementedError("fused_limits: attn_mask is not supported")
    if query.shape[-1] not in (16, 32, 64, 128):
        raise NotImplementedError(f"fused_limits: head size {query.shape[-1]} not supported (16, 32, 64, 128)")
    if query.shape[-2] != key.shape[-2]:
        raise NotImplementedError(f"fused_limits: only L = S is supported, not L = {query.shape[-2]}, "
                                  f"S = {key.shape[-2]}")
    return tiled_attention(query, key, value, None, dropout_p, is_causal, scale, enable_gqa)
