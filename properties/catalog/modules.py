"""Broken zoo parts, one realistic bug each, plugged in through ``_target_`` as a user's replacement part:

    pytest properties/ --zoo "attention._target_=properties.catalog.modules.SplitHeadsWithoutTranspose"

Each class subclasses the zoo's part and changes the one line the docstring names. The layer bugs live in
the residual block of the zoo's layers; the models that use them (``*EncoderDecoder``) are named with
``model._target_``. The ``@module_bug`` above each class declares its catalog entry: the overrides that plug it in
(``{target}``: the class's path), the clauses expected to catch it and the mechanism in a line.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange, repeat

from properties.catalog.registry import module_bug
from zoo.nn.attention import MultiHeadAttention
from zoo.nn.ffn import FeedForward
from zoo.nn.blocks import Residual
from zoo.nn.models import EncoderDecoder
from zoo.nn.norm import LayerNorm
from zoo.nn.positional import SinusoidalPositions

__all__ = ["SplitHeadsWithoutTranspose", "MergeHeadsTransposed", "GqaHeadsInterleaved", "ScaleByModelWidth",
           "LayerNormOverPositions", "FeedForwardWithoutActivation", "GeluTanhForExact", "SinCosSwapped",
           "FrequencyExponentDoubled", "NoResidualEncoderDecoder", "NormedResidualEncoderDecoder",
           "LayerNormMeanTermDropped", "FeedForwardDownDetached"]


@module_bug("split_heads_without_transpose", "attention._target_={target}", "MHA-ORACLE", "MHA-PERMUTATION",
            mechanism="heads split with view(b, h, l, e) instead of view(b, l, h, e).transpose")
class SplitHeadsWithoutTranspose(MultiHeadAttention):
    """Splits heads with ``view(b, h, l, e)`` on the (b, l, h·e) projection instead of
    ``view(b, l, h, e).transpose(1, 2)``: each "head" holds a block of positions and features of several
    positions are mixed."""

    def split_heads(self, t, heads):
        b, l, _ = t.shape
        return t.reshape(b, heads, l, -1)


@module_bug("merge_heads_transposed", "attention._target_={target}", "MHA-ORACLE",
            mechanism="heads merged as (e h) while split as (h e): W^O reads the wrong columns")
class MergeHeadsTransposed(MultiHeadAttention):
    """Merges the heads as (e h) — ``out.transpose(1, 3).reshape(b, l, -1)`` — while the split was (h e):
    the output projection reads every head's features in the wrong columns."""

    def merge_heads(self, out):
        return rearrange(out, "b h l e -> b l (e h)")


@module_bug("gqa_heads_interleaved", "attention._target_={target}", "MHA-GQA",
            mechanism="grouped kv heads tiled (head i mod k) instead of repeat_interleave (i // g)")
class GqaHeadsInterleaved(MultiHeadAttention):
    """Repeats grouped key/value heads by tiling (``k.repeat(1, g, 1, 1)``: query head i reads kv head
    i mod k) instead of ``repeat_interleave`` (kv head i // g), the order of the pretrained checkpoints."""

    def attend(self, q, k, v, mask, is_causal):
        g = self.heads // self.kv_heads
        k, v = repeat(k, "b k s e -> b (g k) s e", g=g), repeat(v, "b k s e -> b (g k) s e", g=g)
        return self.kernel(q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0,
                           is_causal=is_causal)


@module_bug("attention_scale_by_model_width", "attention._target_={target}", "MHA-ORACLE", "MHA-SINGLE-HEAD",
            mechanism="the module passes scale = 1/sqrt(d_model) instead of 1/sqrt(d_model/h)")
class ScaleByModelWidth(MultiHeadAttention):
    """Passes scale = 1/√d_model to the kernel instead of the default 1/√d_k (d_k = d_model/h)."""

    def attend(self, q, k, v, mask, is_causal):
        return self.kernel(q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0,
                           is_causal=is_causal, enable_gqa=self.kv_heads != self.heads,
                           scale=1.0 / math.sqrt(self.heads * self.head_dim))


@module_bug("layernorm_over_positions", "norm._target_={target}", "NORM-PER-TOKEN", "NORM-STANDARDIZE",
            mechanism="LayerNorm statistics over the positions (dim 1), not each token's features")
class LayerNormOverPositions(LayerNorm):
    """Normalizes each feature over the positions of a sequence (mean and variance over dim 1, as an
    ``nn.LayerNorm``/``InstanceNorm`` applied to a (B, D, L) layout) instead of each token over its features."""

    def forward(self, x):
        mean = x.mean(dim=-2, keepdim=True)
        var = x.var(dim=-2, keepdim=True, unbiased=False)
        y = (x - mean) / torch.sqrt(var + self.eps)
        y = y * self.weight
        return y if self.bias is None else y + self.bias


@module_bug("ffn_without_activation", "ffn._target_={target}", "FFN-FORMULA",
            mechanism="the activation between the two linear maps forgotten")
class FeedForwardWithoutActivation(FeedForward):
    """The activation between the two linear maps forgotten: the FFN collapses to one linear map."""

    def forward(self, x):
        hidden = self.up(x) if self.gate is None else self.gate(x) * self.up(x)
        return self.down(self.dropout(hidden))


@module_bug("gelu_tanh_for_exact", "ffn=gelu ffn._target_={target}", "FFN-FORMULA",
            mechanism="GELU's tanh approximation where the config says exact GELU")
class GeluTanhForExact(FeedForward):
    """Uses GELU's tanh approximation where the node says exact GELU (BERT's ``gelu`` vs GPT-2's
    ``gelu_new``): a pretrained BERT's outputs drift by ~1e-3 per layer."""

    def forward(self, x):
        if self.activation_name == "gelu":
            return self.down(self.dropout(F.gelu(self.up(x), approximate="tanh")))
        return super().forward(x)


def _table(length, d_model, exponent_factor=2.0, swap=False, *, device=None, dtype=None):
    position = torch.arange(length, dtype=torch.float64, device=device)
    index = torch.arange(0, d_model, 2, dtype=torch.float64, device=device)  # 2i
    angle = position[:, None] / torch.pow(10000.0, exponent_factor * index / (2 * d_model))[None, :]
    first, second = (torch.cos, torch.sin) if swap else (torch.sin, torch.cos)
    table = torch.empty(length, d_model, dtype=torch.float64, device=device)
    table[:, 0::2] = first(angle)
    table[:, 1::2] = second(angle[:, : d_model // 2])
    return table.to(dtype or torch.get_default_dtype())


class _Sinusoid(SinusoidalPositions):
    swap, exponent_factor = False, 2.0

    def __init__(self, d_model, max_len, *, device=None, dtype=None):
        super().__init__(d_model, max_len, device=device, dtype=dtype)
        self._rebuild()

    def _rebuild(self):
        if self.table.device.type != "meta":
            self.table = _table(*self.table.shape, self.exponent_factor, self.swap, device=self.table.device,
                                dtype=self.table.dtype)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self._rebuild()
        return self


@module_bug("sin_cos_swapped", "pos._target_={target}", "POS-SINUSOID-FORMULA",
            mechanism="cos on the even features and sin on the odd ones")
class SinCosSwapped(_Sinusoid):
    """cos on the even features and sin on the odd ones (``pe[:, 0::2] = cos``): the paper's order swapped."""
    swap = True


@module_bug("frequency_exponent_doubled", "pos._target_={target}", "POS-SINUSOID-FORMULA", "POS-SINUSOID-WAVELENGTHS",
            mechanism="exponent 2*(2i)/d: the even index arange(0, d, 2) doubled again")
class FrequencyExponentDoubled(_Sinusoid):
    """Exponent 2·(2i)/d: the even feature index 2i (``arange(0, d, 2)``) multiplied by 2 again, so the
    wavelengths run from 2π to 10000²·2π over the first half and the slowest sinusoids are nearly constant."""
    exponent_factor = 4.0


# ---------------------------------------------------------------------------------------------- layers
class _NoResidual(Residual):
    """Post-norm sub-layer without its residual connection: Norm(Sublayer(x))."""

    def forward(self, x, sublayer):
        if self.placement == "pre":
            return self.dropout(sublayer(self.norm(x)))
        return self.norm(self.dropout(sublayer(x)))


class _NormedResidual(Residual):
    """Pre-norm sub-layer whose residual carries the normalized input: h = Norm(x); h + Sublayer(h), the
    ``x = self.ln(x); x = x + self.attn(x)`` rewrite of ``x = x + self.attn(self.ln(x))``."""

    def forward(self, x, sublayer):
        if self.placement == "pre":
            h = self.norm(x)
            return h + self.dropout(sublayer(h))
        return super().forward(x, sublayer)


class _WithResidual(EncoderDecoder):
    residual: type = Residual

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for module in self.modules():
            if type(module) is Residual:
                module.__class__ = self.residual  # the layers' residual blocks are of the broken kind


@module_bug("residual_missing", "model=encoder_decoder model._target_={target}", "LAYER-RESIDUAL", "LAYER-POST-NORM",
            mechanism="post-norm sub-layers without the residual: Norm(Sublayer(x))")
class NoResidualEncoderDecoder(_WithResidual):
    """The zoo's encoder-decoder whose layers drop the residual connection (x → Norm(Sublayer(x)))."""
    residual = _NoResidual


@module_bug("residual_of_normed_input", "model=encoder_decoder norm_placement=pre model._target_={target}",
            "LAYER-PRE-NORM", "LAYER-RESIDUAL",
            mechanism="pre-norm residual carries the normalized input: h = Norm(x); h + Sublayer(h)")
class NormedResidualEncoderDecoder(_WithResidual):
    """The zoo's encoder-decoder whose pre-norm layers add the sub-layer to the normalized input."""
    residual = _NormedResidual


class _LayerNormMeanTermDropped(torch.autograd.Function):
    """LayerNorm with a hand-written backward, as fused norm kernels have: the forward is exact, the backward
    forgets the mean of g∘dy, so dx = (ĝ − n·mean(ĝ∘n))/σ instead of (ĝ − mean(ĝ) − n·mean(ĝ∘n))/σ."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        mean = x.mean(-1, keepdim=True)
        inv_std = torch.rsqrt(x.var(-1, unbiased=False, keepdim=True) + eps)
        normed = (x - mean) * inv_std
        ctx.save_for_backward(normed, inv_std, weight)
        return normed * weight + bias

    @staticmethod
    def backward(ctx, dy):
        normed, inv_std, weight = ctx.saved_tensors
        g = dy * weight
        dx = (g - normed * (g * normed).mean(-1, keepdim=True)) * inv_std   # mean(g) term missing
        lead = tuple(range(dy.dim() - 1))
        return dx, (dy * normed).sum(lead), dy.sum(lead), None


@module_bug("layernorm_backward_mean_term_dropped", "norm=layernorm norm._target_={target}", "NORM-GRAD",
            mechanism="hand-written LayerNorm backward without the mean(g·dy) term")
class LayerNormMeanTermDropped(LayerNorm):
    """Fused-norm bug: the backward drops the mean-correction term of dx (the forward is exact)."""

    def forward(self, x):
        return _LayerNormMeanTermDropped.apply(x, self.weight, self.bias, self.eps)


@module_bug("ffn_down_weight_detached", "ffn._target_={target}", "FFN-GRAD",
            mechanism="the second linear map applied with a detached weight (W2 gets no gradient)")
class FeedForwardDownDetached(FeedForward):
    """The second linear map applied with ``self.down.weight.detach()`` (a weight shared by copy, or wrapped in
    no_grad to save memory): the forward is exact, W2 never learns."""

    def forward(self, x):
        hidden = self.activation(self.gate(x)) * self.up(x) if self.gate is not None else self.activation(self.up(x))
        return F.linear(self.dropout(hidden), self.down.weight.detach(), self.down.bias)
