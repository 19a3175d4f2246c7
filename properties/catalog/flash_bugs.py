"""Broken kernels with ``flash_attn_func``'s API (flash-attn 2.x keywords), forward and backward: ``FlashBase``, a
correct kernel in plain torch written from the docstring in overridable steps, and one realistic bug each as a
subclass that overrides one step, declared a catalog entry by the ``@bug`` above it. Each is correct on the plain
case (no window, softcap or ALiBi), so that only the feature clauses can catch it (SPEC.md, "The FlashAttention API").
The bases of the other two APIs are ``varlen_base`` (flash_varlen_bugs.py) and ``KVCacheBase``
(flash_kvcache_bugs.py); the band of admissible keys is the zoo's one definition, zoo.nn.flash.band_allowed, and
everything else is written from flash-attn's docstrings in plain torch, so that the catalog does not change when the
zoo's kernels do.

    pytest properties/ --kernel-api flash --kernel properties.catalog.flash_bugs:window_left_off_by_one
"""
from __future__ import annotations

import math

import torch

from properties.catalog._utils import compute_dtype
from properties.catalog.registry import bug
from zoo.nn.flash_dense import band_allowed

__all__ = ["FlashBase", "flash_base", "backward_without_window", "softcap_backward_as_uncapped",
           "window_left_off_by_one", "window_right_off_by_one", "window_sides_swapped", "window_top_left",
           "causal_top_left", "softcap_after_mask", "softcap_before_scale", "softcap_after_alibi",
           "alibi_sign_flipped", "alibi_distance_top_left", "alibi_without_abs", "alibi_batch_row_ignored",
           "gqa_heads_tiled_flash", "fully_masked_rows_nan_flash"]


class FlashBase:
    """A correct ``flash_attn_func`` in plain torch, in overridable steps."""

    def band(self, lq, lk, causal, window, device):
        """(lq, lk) bool: key j admissible for query i."""
        rows, cols = torch.arange(lq, device=device)[:, None], torch.arange(lk, device=device)[None, :]
        return band_allowed(rows, cols, lk - lq, causal, window)

    def distance(self, lq, lk, device):
        return ((torch.arange(lq, device=device)[:, None] + (lk - lq)) - torch.arange(lk, device=device)[None, :]).abs()

    def bias(self, slopes, b, h, lq, lk, ct, device):
        slopes = slopes.to(device=device, dtype=ct).expand(b, h)
        return -slopes[:, :, None, None] * self.distance(lq, lk, device).to(ct)

    def expand(self, t, h):
        return t.repeat_interleave(h // t.shape[2], dim=2)

    def scores(self, q, k, scale, softcap, ct):
        s = torch.einsum("blhe,bshe->bhls", q.to(ct) * scale, k.to(ct))
        return softcap * torch.tanh(s / softcap) if softcap > 0 else s

    def masked(self, scores, allowed, softcap):
        return scores.masked_fill(~allowed, -math.inf)

    def softmax(self, scores):
        top = scores.amax(-1, keepdim=True)
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        e = torch.exp(scores - top)
        total = e.sum(-1, keepdim=True)
        return e / torch.where(total > 0, total, torch.ones_like(total))

    def __call__(self, q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                 alibi_slopes=None, deterministic=False, return_attn_probs=False):
        b, lq, h, e = q.shape
        lk = k.shape[1]
        ct = compute_dtype(q.dtype)
        if lq == 0 or lk == 0:
            return q.new_zeros(b, lq, h, v.shape[-1])
        scale = 1.0 / math.sqrt(e) if softmax_scale is None else softmax_scale
        s = self.scores(q, self.expand(k, h), scale, softcap, ct)
        if alibi_slopes is not None:
            s = s + self.bias(alibi_slopes, b, h, lq, lk, ct, q.device)
        s = self.masked(s, self.band(lq, lk, causal, tuple(window_size), q.device), softcap)
        w = self.softmax(s)
        if dropout_p > 0:
            w = torch.nn.functional.dropout(w, dropout_p)
        return torch.einsum("bhls,bshv->blhv", w, self.expand(v, h).to(ct)).to(q.dtype)


flash_base = FlashBase()


# ------------------------------------------------------------------------------------------- flash bugs
@bug("WINDOW-BOUNDS", "FLASH-ORACLE", api="flash", instance="window_left_off_by_one",
     mechanism="left window edge exclusive: j >= i + o - left + 1")
class _WindowLeftOffByOne(FlashBase):
    def band(self, lq, lk, causal, window, device):
        left, right = window
        ok = super().band(lq, lk, causal, (-1, right), device)
        if left >= 0:   # j > i + o - left: the left edge exclusive
            i = torch.arange(lq, device=device)[:, None] + (lk - lq)
            ok = ok & (torch.arange(lk, device=device)[None, :] > i - left)
        return ok


@bug("WINDOW-BOUNDS", "FLASH-ORACLE", api="flash", instance="window_right_off_by_one",
     mechanism="right window edge one too far: j <= i + o + right + 1 (transformers #39408)")
class _WindowRightOffByOne(FlashBase):
    def band(self, lq, lk, causal, window, device):
        left, right = window
        return super().band(lq, lk, causal, (left, right + 1 if right >= 0 else right), device)


@bug("WINDOW-BOUNDS", "FLASH-ORACLE", api="flash", instance="window_sides_swapped",
     mechanism="window_size read as (right, left)")
class _WindowSidesSwapped(FlashBase):
    def band(self, lq, lk, causal, window, device):
        return super().band(lq, lk, causal, (window[1], window[0]), device)


@bug("WINDOW-BOUNDS", "FLASH-ORACLE", api="flash", instance="window_top_left",
     mechanism="window band aligned top-left (i - left <= j <= i + right), not at i + Lk - Lq")
class _WindowTopLeft(FlashBase):
    def band(self, lq, lk, causal, window, device):
        ok = super().band(lq, lk, causal, (-1, -1), device)
        i = torch.arange(lq, device=device)[:, None]
        j = torch.arange(lk, device=device)[None, :]
        left, right = window
        if right >= 0:
            ok = ok & (j <= i + right)
        if left >= 0:
            ok = ok & (j >= i - left)
        return ok


@bug("CAUSAL-BOTTOM-RIGHT", "FLASH-ORACLE", "FLASH-FULLY-MASKED", api="flash", instance="causal_top_left",
     mechanism="causal mask tril(ones(Lq, Lk)) (PyTorch's top-left), not bottom-right")
class _CausalTopLeft(FlashBase):
    def band(self, lq, lk, causal, window, device):
        ok = super().band(lq, lk, False, window, device)
        if causal:
            ok = ok & torch.ones(lq, lk, dtype=torch.bool, device=device).tril()
        return ok


@bug("SOFTCAP-RANGE", "SOFTCAP-FORMULA", "FLASH-ORACLE", api="flash", instance="softcap_after_mask",
     mechanism="the cap applied after masking: c*tanh(-inf) = -c gives masked keys weight")
class _SoftcapAfterMask(FlashBase):
    def scores(self, q, k, scale, softcap, ct):
        return super().scores(q, k, scale, 0.0, ct)

    def masked(self, scores, allowed, softcap):
        scores = scores.masked_fill(~allowed, -math.inf)
        return softcap * torch.tanh(scores / softcap) if softcap > 0 else scores


@bug("SOFTCAP-FORMULA", "FLASH-ORACLE", "FLASH-SCALE", api="flash", instance="softcap_before_scale",
     mechanism="c*tanh(q.k / c) * scale: the cap taken on the unscaled product")
class _SoftcapBeforeScale(FlashBase):
    def scores(self, q, k, scale, softcap, ct):
        s = torch.einsum("blhe,bshe->bhls", q.to(ct), k.to(ct))
        return (softcap * torch.tanh(s / softcap) if softcap > 0 else s) * scale


@bug("SOFTCAP-FORMULA", "ALIBI-BIAS", "FLASH-ORACLE", api="flash", instance="softcap_after_alibi",
     mechanism="the cap applied to score + ALiBi bias instead of before the bias")
class _SoftcapAfterAlibi(FlashBase):
    def __call__(self, q, k, v, *args, softcap=0.0, alibi_slopes=None, **kwargs):
        self._cap, self._alibi = softcap, alibi_slopes is not None
        return super().__call__(q, k, v, *args, softcap=0.0 if self._alibi else softcap, alibi_slopes=alibi_slopes,
                                **kwargs)

    def masked(self, scores, allowed, softcap):
        if self._alibi and self._cap > 0:       # the cap applied to score + bias
            scores = self._cap * torch.tanh(scores / self._cap)
        return super().masked(scores, allowed, softcap)


@bug("ALIBI-BIAS", "FLASH-ORACLE", api="flash", instance="alibi_sign_flipped",
     mechanism="+slope*|i + o - j|: far keys favoured")
class _AlibiSignFlipped(FlashBase):
    def bias(self, slopes, b, h, lq, lk, ct, device):
        return -super().bias(slopes, b, h, lq, lk, ct, device)


@bug("ALIBI-BIAS", "FLASH-ORACLE", api="flash", instance="alibi_distance_top_left",
     mechanism="ALiBi distance |i - j| without the bottom-right offset Lk - Lq")
class _AlibiDistanceTopLeft(FlashBase):
    def distance(self, lq, lk, device):
        return (torch.arange(lq, device=device)[:, None] - torch.arange(lk, device=device)[None, :]).abs()


@bug("ALIBI-BIAS", "FLASH-ORACLE", api="flash", instance="alibi_without_abs",
     mechanism="ALiBi bias -slope*(i + o - j) without the absolute value: later keys rewarded")
class _AlibiWithoutAbs(FlashBase):
    def distance(self, lq, lk, device):
        return (torch.arange(lq, device=device)[:, None] + (lk - lq)) - torch.arange(lk, device=device)[None, :]


@bug("ALIBI-BIAS", "FLASH-ORACLE", "FLASH-SLICE-INDEPENDENT", api="flash", instance="alibi_batch_row_ignored",
     mechanism="(B, H) slopes: row 0 used for every batch entry")
class _AlibiBatchRowIgnored(FlashBase):
    def bias(self, slopes, b, h, lq, lk, ct, device):
        return super().bias(slopes if slopes.dim() == 1 else slopes[0], b, h, lq, lk, ct, device)


@bug("FLASH-GQA", "FLASH-ORACLE", api="flash", instance="gqa_heads_tiled_flash",
     mechanism="kv heads expanded with repeat (head h reads h mod Hkv), not h // (H/Hkv)")
class _GqaHeadsTiled(FlashBase):
    def expand(self, t, h):
        return t.repeat(1, 1, h // t.shape[2], 1)


@bug("FLASH-FULLY-MASKED", "CAUSAL-BOTTOM-RIGHT", "FLASH-ORACLE", api="flash", instance="fully_masked_rows_nan_flash",
     mechanism="plain softmax over a row with no admissible key: NaN instead of 0")
class _FullyMaskedRowsNan(FlashBase):
    def softmax(self, scores):
        return torch.softmax(scores, dim=-1)


class _BackwardWithoutWindow(torch.autograd.Function):
    """Forward: the correct kernel. Backward: weights recomputed with the causal mask only (the window and ALiBi
    forgotten), the chain rule of SPEC.md "Gradients" otherwise exact."""

    @staticmethod
    def forward(ctx, q, k, v, scale, causal, window, alibi_slopes):
        ctx.save_for_backward(q, k, v)
        ctx.options = (scale, causal, alibi_slopes)
        return flash_base(q, k, v, softmax_scale=scale, causal=causal, window_size=window, alibi_slopes=alibi_slopes)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v = ctx.saved_tensors
        scale, causal, _ = ctx.options
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            out = flash_base(*leaves, softmax_scale=scale, causal=causal)
            grads = torch.autograd.grad(out, leaves, grad_out)
        return (*grads, None, None, None, None)


@bug("FLASH-GRAD", "FLASH-GRAD-MASKED", api="flash",
     mechanism="exact forward; the backward recomputes the weights without window and ALiBi")
def backward_without_window(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                            softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    if dropout_p > 0 or softcap > 0:
        return flash_base(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    return _BackwardWithoutWindow.apply(q, k, v, scale, causal, tuple(window_size), alibi_slopes)


@bug("FLASH-GRAD", api="flash", instance="softcap_backward_as_uncapped",
     mechanism="exact forward; the backward omits the cap's slope 1 - tanh^2")
class _SoftcapBackwardAsUncapped(FlashBase):
    """Forward exact; the backward passes the scores' gradient through the cap unchanged (slope 1 instead of
    1 − tanh²), as a hand-written backward that forgets the cap's derivative does."""

    def scores(self, q, k, scale, softcap, ct):
        raw = super().scores(q, k, scale, 0.0, ct)
        if softcap <= 0:
            return raw
        return raw + (softcap * torch.tanh(raw / softcap) - raw).detach()


softcap_backward_as_uncapped = _SoftcapBackwardAsUncapped()
window_left_off_by_one = _WindowLeftOffByOne()
window_right_off_by_one = _WindowRightOffByOne()
window_sides_swapped = _WindowSidesSwapped()
window_top_left = _WindowTopLeft()
causal_top_left = _CausalTopLeft()
softcap_after_mask = _SoftcapAfterMask()
softcap_before_scale = _SoftcapBeforeScale()
softcap_after_alibi = _SoftcapAfterAlibi()
alibi_sign_flipped = _AlibiSignFlipped()
alibi_distance_top_left = _AlibiDistanceTopLeft()
alibi_without_abs = _AlibiWithoutAbs()
alibi_batch_row_ignored = _AlibiBatchRowIgnored()
gqa_heads_tiled_flash = _GqaHeadsTiled()
fully_masked_rows_nan_flash = _FullyMaskedRowsNan()
