"""Multi-head attention (Vaswani et al. 2017, section 3.2.2), self or cross, with grouped-query heads.

Axis letters are those of ``zoo.nn.kernel``: b batch, h query heads, k key/value heads,
l query positions, s key/value positions, e features per head, d model features.

    MultiHead(x, m) = concat(head_1, ..., head_h) W_O,  head_i = Attention(x W_i^Q, m W_i^K, m W_i^V)

With ``kv_heads = k < h`` (grouped-query attention; k = 1 is multi-query attention),
query head i reads key/value head i // (h / k), as ``enable_gqa`` does in PyTorch.

Two options of FlashAttention's API (zoo/nn/flash.py, docs/sources/flash-attention.md):

    window=W    sliding-window self-attention (Mistral's ``sliding_window``, Longformer's local attention):
                query i sees key j iff |i - j| < W, i.e. i - W < j <= i under the causal mask -- W keys
                including itself. In flash-attn's terms ``window_size=(W - 1, W - 1)``, which with
                ``causal=True`` is ``(W - 1, 0)``. Positions are absolute (cache offset and padding included),
                so a cached decoding step sees the same W keys the full forward pass does. Cross-attention is
                never windowed (its keys are another sequence's positions).
    softcap=X   Gemma 2's logit soft-capping: score -> X·tanh(score / X), before the bias and the mask. Passed
                to the kernel as ``softcap=``, which SDPA's signature lacks: only a kernel that declares it
                (the zoo's ``math``, or a plug-in) can be used with it (zoo.nn.kernel.takes_softcap).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
from einops import rearrange
from torch import nn

from zoo.nn.cache import KVCache
from zoo.nn.flash_dense import band_allowed
from zoo.nn.kernel import resolve_kernel, takes_softcap
from zoo.nn.packing import Packing

if TYPE_CHECKING:
    from zoo.nn.positional import Positions

__all__ = ["MultiHeadAttention", "window_size"]


def window_size(window: int | None) -> tuple[int, int]:
    """flash-attn's ``window_size`` for a sliding window of W keys (Mistral's ``sliding_window``): (W - 1, W - 1),
    so that i - W < j <= i under the causal mask (transformers #39408 is this off-by-one); None: (-1, -1)."""
    return (-1, -1) if window is None else (window - 1, window - 1)


class MultiHeadAttention(nn.Module):
    """Multi-head attention, self (``memory=None``) or cross, with ``kv_heads`` key/value heads shared by groups of
    query heads, an optional sliding ``window`` and score ``softcap`` (module docstring), computed by ``kernel``
    (a name of zoo.nn.kernel, or a callable with SDPA's signature). Decoding passes a KV cache (zoo/nn/cache.py),
    which supplies the positions, keys and mask of the new tokens; training on packed rows passes a ``Packing``
    (zoo/nn/packing.py). ``layer_index`` is set by the model, so that a cache tells the layers apart."""

    def __init__(self, d_model: int, heads: int, kv_heads: int | None = None, bias: bool = True,
                 dropout: float = 0.0, kernel: str | Callable = "math", window: int | None = None,
                 softcap: float | None = None, *, device=None, dtype=None):
        super().__init__()
        kv_heads = heads if kv_heads is None else kv_heads
        if heads < 1 or d_model % heads:
            raise ValueError(f"heads={heads} must be a positive divisor of d_model={d_model}")
        if kv_heads < 1 or heads % kv_heads:
            raise ValueError(f"kv_heads={kv_heads} must be a positive divisor of heads={heads}")
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, d_model // heads
        self.dropout = dropout
        self.kernel = resolve_kernel(kernel)
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"window={window}: a positive number of keys (null: no window)")
        if softcap is not None and not (isinstance(softcap, (int, float)) and 0 < softcap < float("inf")):
            raise ValueError(f"softcap={softcap}: a positive finite cap (null: no capping)")
        if softcap is not None and not takes_softcap(self.kernel):
            raise ValueError(f"softcap={softcap}: kernel {kernel!r} has no softcap parameter (SDPA's signature "
                             f"cannot cap scores); use kernel=math")
        self.window, self.softcap = window, softcap
        kw = dict(bias=bias, device=device, dtype=dtype)
        self.q_proj = nn.Linear(d_model, heads * self.head_dim, **kw)
        self.k_proj = nn.Linear(d_model, kv_heads * self.head_dim, **kw)
        self.v_proj = nn.Linear(d_model, kv_heads * self.head_dim, **kw)
        self.out_proj = nn.Linear(heads * self.head_dim, d_model, **kw)
        self.layer_index = 0  # set by the model so a KVCache can tell layers apart

    # The steps of forward, each overridable alone (the bug catalog gets exactly one of them wrong).
    # split and merge are the einops patterns in their docstrings, written as the view and transpose einops makes
    # of them: on a GPU a small model's forward pass is bound by the host's time per operation, and einops' own
    # Python per call was 8% of it (docs/benchmarks.md, "Host overhead").
    def split_heads(self, t: torch.Tensor, heads: int) -> torch.Tensor:
        """rearrange(t, "b l (h e) -> b h l e", h=heads)"""
        return t.unflatten(-1, (heads, t.shape[-1] // heads)).transpose(1, 2)

    def merge_heads(self, out: torch.Tensor) -> torch.Tensor:
        """rearrange(out, "b h l e -> b l (h e)")"""
        return out.transpose(1, 2).flatten(2)

    def mask(self, l: int, s: int, offset: int, key_padding_mask: torch.Tensor | None, is_causal: bool,
             bias: torch.Tensor | None, device, *, window: int | None = None,
             segments: torch.Tensor | None = None) -> torch.Tensor | None:
        """The kernel's attn_mask, or None when is_causal alone says it (the kernel's fast path)."""
        mask = None
        if window is not None or segments is not None or \
                (is_causal and (offset or key_padding_mask is not None or bias is not None)):
            # Query i sits at absolute position offset + i = i + s - l (bottom-right) and sees every key up to
            # there, and with a window only the W - 1 before it: flash-attn's band, the one definition.
            rows = torch.arange(l, device=device)[:, None]
            cols = torch.arange(s, device=device)[None, :]
            mask = band_allowed(rows, cols, s - l, is_causal, window_size(window))
        if segments is not None:
            # Packed rows: a token sees only its own sequence. Within one, index and position differ by a
            # constant, so the band above (causal, window) counted in indices is the per-sequence band.
            same = rearrange(segments, "b l -> b 1 l 1") == rearrange(segments, "b s -> b 1 1 s")
            mask = mask & same
        if key_padding_mask is not None:
            padding = rearrange(key_padding_mask.to(torch.bool), "b s -> b 1 1 s")
            mask = padding if mask is None else mask & padding
        if bias is not None:  # a float mask: the bias where a key is admissible, -inf where it is not
            mask = bias if mask is None else bias.masked_fill(~mask, float("-inf"))
        return mask

    def attend(self, q, k, v, mask, is_causal: bool) -> torch.Tensor:
        # softcap only when set: an SDPA-signature kernel would refuse the keyword (the constructor checked).
        extra = {} if self.softcap is None else {"softcap": self.softcap}
        return self.kernel(q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0,
                           is_causal=is_causal, enable_gqa=self.kv_heads != self.heads, **extra)

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None, *,
                key_padding_mask: torch.Tensor | None = None, is_causal: bool = False,
                positions: "Positions | None" = None, cache: KVCache | None = None,
                packing: Packing | None = None) -> torch.Tensor:
        """x (b, l, d) attends to memory (b, s, d), or to itself when memory is None.

        key_padding_mask (b, s) bool: True marks a real key (may be attended to), False padding.
        is_causal: query i sees keys j <= i, counted in absolute positions when a cache holds
        earlier keys. positions: the model's position module (self-attention only), asked to rotate queries
        and keys and for a bias on the scores (zoo.nn.positional).
        cache: keys/values of earlier positions (self-attention decoding step by step).
        packing: several sequences per row (self-attention, no cache): attention within each, positions restart.
        """
        source = x if memory is None else memory
        q = self.split_heads(self.q_proj(x), self.heads)
        if cache is not None and memory is not None:
            # Cross-attention with a cache (one that keeps_cross): the memory's keys and values, as it decides.
            k, v = cache.cross(self.layer_index, lambda: (self.split_heads(self.k_proj(source), self.kv_heads),
                                                          self.split_heads(self.v_proj(source), self.kv_heads)))
            cache = None  # nothing else of the cache concerns cross-attention
        else:
            k = self.split_heads(self.k_proj(source), self.kv_heads)
            v = self.split_heads(self.v_proj(source), self.kv_heads)
        offset = cache.offset if cache is not None else 0
        if packing is not None:
            if cache is not None or memory is not None:
                raise ValueError("packing applies to self-attention without a KV cache (training, scoring)")
            offset = packing.positions  # every token at its position within its own sequence
        if positions is not None:
            q, k = positions.rotate(q, offset), positions.rotate(k, offset)
        if cache is not None:
            k, v = cache.extend(self.layer_index, k, v)
        l, s = q.shape[-2], k.shape[-2]
        bias = positions.score_bias(l, s, offset, self.heads) if positions is not None else None
        bias = None if bias is None else bias.to(q.dtype)
        mask = cache.mask(self.window) if cache is not None else None
        if mask is not None:  # the cache's mask of this call (a static cache's, made once for every layer)
            mask = mask if bias is None else bias.masked_fill(~mask, float("-inf"))
        else:
            # The window only when set and only for self-attention; the catalog's mask() overrides predate it.
            extra = {"window": self.window} if self.window is not None and memory is None else {}
            if packing is not None:
                extra["segments"] = packing.segments
            mask = self.mask(l, s, offset, key_padding_mask, is_causal, bias, x.device, **extra)
        out = self.attend(q, k, v, mask, is_causal and mask is None)
        return self.out_proj(self.merge_heads(out))
