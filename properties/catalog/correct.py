"""Correct implementations the suite must pass with zero failures (the catalog's control group).

``StepwiseAttention``  the SDPA contract written step by step (expand heads, scale, scores, masks,
                       softmax, dropout, weighted sum); the broken kernels of ``properties.catalog.kernels``
                       are subclasses that each get one step wrong. ``stepwise_attention`` is an instance.
``flash_attention``    FlashAttention's algorithm (Dao et al. 2022, Algorithm 1) in plain torch: query
                       tiles of ``QUERY_BLOCK`` rows, key tiles of ``KEY_BLOCK`` columns, an online
                       softmax (running max and sum, the accumulator rescaled when the max grows), fully
                       masked causal tiles skipped. The block sizes divide few of the suite's lengths
                       (1..8), so partial last tiles are the rule; past 24, about an eighth of the length
                       (``block_size``), odd, so that kernel-scale problems end in a partial tile too. ``flash_attention_tiles_dropped`` in
                       ``kernels.py`` is the same function with the tile count rounded down.
``TorchMultiheadAttention``  ``torch.nn.MultiheadAttention`` behind the zoo's attention contract, so the
                       module and model clauses run on it through ``--zoo``.

    pytest properties/ --kernel properties.catalog.correct:flash_attention
    pytest properties/ --zoo "attention.kernel=properties.catalog.correct:flash_attention"
    pytest properties/ --zoo "attention._target_=properties.catalog.correct.TorchMultiheadAttention ~attention.kernel attention.kv_heads=1 ~attention.kv_heads"
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import torch
from torch import nn

from properties.catalog._utils import compute_dtype
from properties.catalog.registry import Entry, correct, declare

__all__ = ["StepwiseAttention", "stepwise_attention", "flash_attention", "memory_efficient_block3", "TorchMultiheadAttention",
           "QUERY_BLOCK", "KEY_BLOCK", "block_size"]


@correct("stepwise", instance="stepwise_attention",
         mechanism="correct.StepwiseAttention (the broken kernels' base)")
class StepwiseAttention:
    """``softmax(q kᵀ σ + m) v`` in the steps every attention implementation has; one method per step."""

    def __call__(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                 enable_gqa=False):
        if is_causal and attn_mask is not None:
            raise ValueError("is_causal=True cannot be combined with an explicit attn_mask")
        key, value = self.expand_heads(query, key, value, enable_gqa)
        sigma = self.scale(query, key, value, scale)
        ct = self.compute_dtype(query.dtype)
        scores = self.scores(query, key, sigma, ct)
        scores, allowed = self.mask(scores, attn_mask, is_causal)
        weights = self.softmax(scores, allowed)
        weights = self.dropout(weights, dropout_p)
        return self.finish(self.combine(weights, value, ct), query)

    def expand_heads(self, query, key, value, enable_gqa):
        """Grouped-query attention: query head i reads key/value head i // (H / H_kv)."""
        if enable_gqa and query.dim() >= 3 and key.shape[-3] != query.shape[-3]:
            groups = query.shape[-3] // key.shape[-3]
            key, value = key.repeat_interleave(groups, dim=-3), value.repeat_interleave(groups, dim=-3)
        return key, value

    def scale(self, query, key, value, scale):
        return 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale

    def compute_dtype(self, dtype):
        return compute_dtype(dtype)

    def scores(self, query, key, sigma, ct):
        # Scale q before the product: the unscaled q·k may overflow where the score does not.
        return (query.to(ct) * sigma) @ key.to(ct).transpose(-1, -2)

    def causal(self, l, s, device):
        """(l, s) bool, True where query i may see key j: j <= i (top-left, PyTorch's convention)."""
        return torch.ones(l, s, dtype=torch.bool, device=device).tril()

    def admissible(self, scores, attn_mask, is_causal):
        """(scores with the float mask added, bool admissibility broadcastable to the scores)."""
        allowed = torch.ones((), dtype=torch.bool, device=scores.device)
        if is_causal:
            allowed = self.causal(scores.shape[-2], scores.shape[-1], scores.device)
        if attn_mask is not None:
            if attn_mask.dtype == torch.bool:
                allowed = allowed & attn_mask
            else:
                scores = scores + attn_mask.to(scores.dtype)
        return scores, allowed

    def mask(self, scores, attn_mask, is_causal):
        """Inadmissible scores set to −inf before the softmax (paper 3.2.3)."""
        scores, allowed = self.admissible(scores, attn_mask, is_causal)
        return scores.masked_fill(~allowed, float("-inf")), allowed

    def softmax(self, scores, allowed):
        """Softmax over keys with the max subtracted; a row without an admissible key gives zeros."""
        row_max = scores.amax(dim=-1, keepdim=True)
        row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
        unnormalized = torch.exp(scores - row_max)
        total = unnormalized.sum(dim=-1, keepdim=True)
        return unnormalized / torch.where(total > 0, total, torch.ones_like(total))

    def dropout(self, weights, p):
        if p == 0.0:
            return weights
        keep = torch.rand(weights.shape, device=weights.device) >= p
        return weights * keep / (1.0 - p)

    def combine(self, weights, value, ct):
        return weights @ value.to(ct)

    def finish(self, out, query):
        return out.to(query.dtype)


stepwise_attention = StepwiseAttention()

QUERY_BLOCK, KEY_BLOCK = 2, 3


def block_size(n: int, small: int) -> int:
    """``small`` for the suite's small lengths (up to 24); past them an odd block of about n / 8, so that a
    kernel-scale problem still ends in a partial tile and a python loop over tiles stays short."""
    return small if n <= 24 else math.ceil(n / 8) | 1


def _key_tiles(s: int, block: int) -> int:
    return math.ceil(s / block)


@correct("flash", mechanism="FlashAttention's tiled online softmax in plain torch")
@correct("flash in the zoo", zoo="attention.kernel={spec}", mechanism="the zoo's attention on the flash kernel")
def flash_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                    enable_gqa=False, *, _key_tiles=_key_tiles):
    """FlashAttention's tiled forward pass with an online softmax, in plain torch (same contract as SDPA)."""
    if is_causal and attn_mask is not None:
        raise ValueError("is_causal=True cannot be combined with an explicit attn_mask")
    l, s, e = query.shape[-2], key.shape[-2], query.shape[-1]
    if enable_gqa and query.dim() >= 3 and key.shape[-3] != query.shape[-3]:
        groups = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(groups, dim=-3), value.repeat_interleave(groups, dim=-3)
    sigma = 1.0 / math.sqrt(e) if scale is None else scale
    ct = compute_dtype(query.dtype)
    q, k, v = query.to(ct) * sigma, key.to(ct), value.to(ct)
    lead = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2])
    mask = None
    if attn_mask is not None:
        mask = attn_mask.to(ct) if attn_mask.dtype != torch.bool else attn_mask
        mask = mask.expand(*lead, l, s)
    out = torch.zeros(*lead, l, v.shape[-1], dtype=ct, device=query.device)
    query_block, key_block = block_size(l, QUERY_BLOCK), block_size(s, KEY_BLOCK)
    for i0 in range(0, l, query_block):
        i1 = min(i0 + query_block, l)
        q_tile = q[..., i0:i1, :]
        running_max = torch.full((*lead, i1 - i0, 1), float("-inf"), dtype=ct, device=query.device)
        running_sum = torch.zeros((*lead, i1 - i0, 1), dtype=ct, device=query.device)
        acc = torch.zeros((*lead, i1 - i0, v.shape[-1]), dtype=ct, device=query.device)
        for tile in range(_key_tiles(s, key_block)):
            j0 = tile * key_block
            j1 = min(j0 + key_block, s)
            if is_causal and j0 > i1 - 1:
                break  # every later key tile lies above the diagonal for all queries of this tile
            scores = q_tile @ k[..., j0:j1, :].transpose(-1, -2)
            allowed = None
            if is_causal:
                rows = torch.arange(i0, i1, device=query.device)[:, None]
                allowed = torch.arange(j0, j1, device=query.device)[None, :] <= rows
            if mask is not None:
                if mask.dtype == torch.bool:
                    allowed = mask[..., i0:i1, j0:j1] if allowed is None else allowed & mask[..., i0:i1, j0:j1]
                else:
                    scores = scores + mask[..., i0:i1, j0:j1]
            if allowed is not None:
                scores = scores.masked_fill(~allowed, float("-inf"))
            new_max = torch.maximum(running_max, scores.amax(dim=-1, keepdim=True))
            safe_max = torch.where(torch.isfinite(new_max), new_max, torch.zeros_like(new_max))
            correction = torch.exp(running_max - safe_max)   # exp(-inf) = 0 before the first admissible key
            p = torch.exp(scores - safe_max)
            running_sum = running_sum * correction + p.sum(dim=-1, keepdim=True)
            if dropout_p > 0.0:  # dropout on the unnormalized tile; the sum stays the undropped one
                p = p * (torch.rand(p.shape, device=p.device) >= dropout_p) / (1.0 - dropout_p)
            acc = acc * correction + p @ v[..., j0:j1, :]
            running_max = new_max
        out[..., i0:i1, :] = acc / torch.where(running_sum > 0, running_sum, torch.ones_like(running_sum))
    return out.to(query.dtype)


# ------------------------------------------------------------------------- nn.MultiheadAttention adapter
_NO_KERNEL_NOR_KV_HEADS = "~attention.kernel attention.kv_heads=1 ~attention.kv_heads"   # see the class docstring
def _is_plain_order(positions) -> bool:
    """Whether a position module leaves queries, keys and scores alone (nn.MultiheadAttention has no hook)."""
    from zoo.nn.positional import Positions
    return positions is None or (type(positions).rotate is Positions.rotate
                                 and type(positions).score_bias is Positions.score_bias)


@correct("nn.MultiheadAttention", zoo=f"attention._target_={{target}} {_NO_KERNEL_NOR_KV_HEADS}",
         mechanism="torch.nn.MultiheadAttention as the zoo's attention")
@correct("nn.MultiheadAttention (enc-dec)",
         zoo=f"model=encoder_decoder attention._target_={{target}} {_NO_KERNEL_NOR_KV_HEADS}",
         mechanism="torch.nn.MultiheadAttention in an encoder-decoder")
class TorchMultiheadAttention(nn.Module):
    """``nn.MultiheadAttention(batch_first=True)`` with the zoo's attention contract (docs/verify.md).

    The masks are translated (the zoo's key padding mask says True = real key, torch.nn's True = ignore);
    cached decoding keeps the layer's inputs in the cache (nn.MultiheadAttention projects its keys and
    values itself) and attends over all of them. It has no grouped-query heads and no hook for relative positions: remove
    ``kernel`` and ``kv_heads`` from the node (``~attention.kernel attention.kv_heads=1 ~attention.kv_heads``:
    Hydra refuses to delete a key whose value is null, so kv_heads gets a value first); rotary positions
    raise. ``q_proj``, ``k_proj``, ``v_proj`` expose the rows of the packed ``in_proj_weight`` so the oracle
    clauses read the module's own weights.
    """

    def __init__(self, d_model: int, heads: int, bias: bool = True, dropout: float = 0.0, *, device=None,
                 dtype=None):
        super().__init__()
        if heads < 1 or d_model % heads:
            raise ValueError(f"heads={heads} must be a positive divisor of d_model={d_model}")
        self.d_model, self.heads = d_model, heads
        self.mha = nn.MultiheadAttention(d_model, heads, dropout=dropout, bias=bias, batch_first=True,
                                         device=device, dtype=dtype)
        self.layer_index = 0

    def _rows(self, index: int) -> SimpleNamespace:
        d = self.d_model
        bias = self.mha.in_proj_bias
        return SimpleNamespace(weight=self.mha.in_proj_weight[index * d:(index + 1) * d],
                               bias=None if bias is None else bias[index * d:(index + 1) * d])

    q_proj = property(lambda self: self._rows(0))
    k_proj = property(lambda self: self._rows(1))
    v_proj = property(lambda self: self._rows(2))

    @property
    def out_proj(self):
        return self.mha.out_proj

    def forward(self, x, memory=None, *, key_padding_mask=None, is_causal=False, positions=None, cache=None):
        if not _is_plain_order(positions):
            raise NotImplementedError("nn.MultiheadAttention has no hook for relative positions")
        source = x if memory is None else memory
        if cache is not None:
            source, _ = cache.extend(self.layer_index, source, source)
        l, s = x.shape[1], source.shape[1]
        attn_mask = None
        if is_causal:  # True = may NOT attend; query i sits at absolute position offset + i
            attn_mask = ~torch.ones(l, s, dtype=torch.bool, device=x.device).tril(diagonal=s - l)
        ignore = None if key_padding_mask is None else ~key_padding_mask.to(torch.bool)
        out, _ = self.mha(x, source, source, key_padding_mask=ignore, attn_mask=attn_mask, need_weights=False)
        return out


@correct("memory_efficient, blocks of 3",
         mechanism="the same with 3-key blocks (S/8 past 24 keys): every block path runs")
def memory_efficient_block3(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                            enable_gqa=False):
    """The zoo's memory-efficient kernel with blocks of 3 keys, so the suite's small problems cross block
    boundaries (a partial last block, the online softmax's rescaling, the backward's per-block recomputation);
    past 24 keys, odd blocks of about S / 8 (``block_size``)."""
    from zoo.nn.memory_efficient import memory_efficient_attention
    return memory_efficient_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                      block=block_size(key.shape[-2], 3))


# ----------------------------------------------------------- correct implementations defined outside the catalog
declare(Entry("F.scaled_dot_product_attention", "kernel", "PyTorch's SDPA", (), "--kernel",
              "torch.nn.functional:scaled_dot_product_attention"))
declare(Entry("zoo math", "kernel", "the zoo's einsum kernel", (), "--kernel", "math"))
declare(Entry("zoo torch", "kernel", "the zoo's backend calling F.scaled_dot_product_attention", (), "--kernel",
              "torch"))
declare(Entry("zoo memory_efficient", "kernel", "the zoo's FlashAttention-2 style kernel with its own backward", (),
              "--kernel", "memory_efficient"))
declare(Entry("zoo flash-API kernels", "kernel", "zoo/nn/flash.py: reference, tiled, varlen loop and packed, kvcache "
              "gather and paged", (), "--kernel-api", "flash"))
declare(Entry("nn.TransformerEncoder", "model", "examples/torch_nn.py", (), "--model", "examples/torch_nn.py:encoder"))
declare(Entry("nn.Transformer", "model", "examples/torch_nn.py", (), "--model", "examples/torch_nn.py:transformer"))
declare(Entry("HF GPT-2", "model", "examples/huggingface.py", (), "--model", "examples/huggingface.py:gpt2"))
declare(Entry("HF BERT", "model", "examples/huggingface.py", (), "--model", "examples/huggingface.py:bert"))
declare(Entry("HF BART", "model", "examples/huggingface.py", (), "--model", "examples/huggingface.py:bart"))
