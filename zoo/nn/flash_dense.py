"""``flash_attn_func`` in plain PyTorch (the API and its semantics: zoo/nn/flash.py): the ``reference`` and ``tiled``
kernels, and what every flash kernel shares — the causal/window band, soft-capping, ALiBi, the admissible softmax
and FlashAttention's online softmax over key tiles.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import einsum, rearrange, repeat

__all__ = ["flash_attn_reference", "flash_attn_tiled", "band_allowed", "soft_cap", "admissible_softmax",
           "compute_dtype", "alibi_row", "capped_scores", "band_scores", "OnlineSoftmax", "expand_kv", "KEY_BLOCK",
           "QUERY_BLOCK"]

KEY_BLOCK = 4     # tile sizes of the tiled kernel: small, so that problems of a few keys run several tiles
QUERY_BLOCK = 3


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype scores and sums are computed in: float32 for half-precision inputs (their scores overflow and
    the softmax loses its small weights), the input's own otherwise."""
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


def alibi_row(alibi_slopes, index: int):
    """The slopes of batch entry ``index``: a (h,) table is every entry's, a (b, h) table has a row each."""
    if alibi_slopes is None or alibi_slopes.dim() == 1:
        return alibi_slopes
    return alibi_slopes[index]


def capped_scores(q, k, scale, softcap, ct):
    """σ q·k (q scaled first: ATTN-LARGE-SCORES), capped when softcap > 0; (b, h, l, s) in ``ct``."""
    scores = einsum(q.to(ct) * scale, k.to(ct), "b l h e, b s h e -> b h l s")
    return soft_cap(scores, softcap) if softcap > 0 else scores


def band_scores(q, k, scale, softcap, alibi_slopes, batch: int, heads: int, rows, cols, offset, causal: bool,
                 window_size, ct):
    """The scores of queries ``rows`` against keys ``cols`` (positions, query i aligned to key i + offset):
    σ q·k capped, plus ALiBi, -inf outside the causal/window band; (b, h, l, s) in ``ct``."""
    scores = capped_scores(q, k, scale, softcap, ct)
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


class OnlineSoftmax:
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


def expand_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    """(b, s, k, e) keys or values repeated to (b, s, heads, e): query head i reads key/value head i // g."""
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
    ct = compute_dtype(q.dtype)
    if s == 0 or l == 0:
        out = q.new_zeros(b, l, h, v.shape[-1])
        lse = torch.full((b, h, l), -math.inf, dtype=torch.float32, device=q.device)
        return (out, lse, None) if return_attn_probs else out
    kx, vx = expand_kv(k, h), expand_kv(v, h)
    rows = torch.arange(l, device=q.device)[:, None]
    cols = torch.arange(s, device=q.device)[None, :]
    scores = band_scores(q, kx, scale, softcap, alibi_slopes, b, h, rows, cols, s - l, causal, window_size, ct)
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
    ct = compute_dtype(q.dtype)
    left, right = _window(window_size)
    kx, vx = expand_kv(k, h).to(ct), expand_kv(v, h).to(ct)
    offset, device = s - l, q.device
    tiles = []
    for i0 in range(0, l, QUERY_BLOCK):
        i1 = min(i0 + QUERY_BLOCK, l)
        q_tile = q[:, i0:i1]
        rows = torch.arange(i0, i1, device=device)[:, None]
        softmax = OnlineSoftmax(b, h, i1 - i0, v.shape[-1], ct, device)
        # The band of this query tile: keys [first, last] (FlashAttention-2's n_block_min / n_block_max).
        last = s - 1
        if causal or right >= 0:
            last = min(last, i1 - 1 + offset + (right if right >= 0 and not causal else 0))
        first = max(0, i0 + offset - left) if left >= 0 else 0
        for j0 in range(first - first % KEY_BLOCK, last + 1, KEY_BLOCK):
            j1 = min(j0 + KEY_BLOCK, s)
            cols = torch.arange(j0, j1, device=device)[None, :]
            scores = band_scores(q_tile, kx[:, j0:j1], scale, softcap, alibi_slopes, b, h, rows, cols, offset,
                                  causal, window_size, ct)
            softmax.add(scores, vx[:, j0:j1], dropout_p)
        tiles.append(softmax.result())
    if not tiles:
        return q.new_zeros(b, l, h, v.shape[-1])
    return rearrange(torch.cat(tiles, dim=2), "b h l v -> b l h v").to(q.dtype)

