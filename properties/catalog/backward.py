"""Kernels with a hand-written backward (``torch.autograd.Function``): one correct, and one realistic bug each
in the backward while the forward stays exact — the class of bug that reaches users most often (FlashAttention
issues #334, #443, #1052, #1947; PyTorch issues #158212, #148476, #119320, #109517, #103749).

    pytest properties/ --kernel properties.catalog.backward:dq_unscaled

Each function has the SDPA signature. The forward is the same for all (materialised weights, computed in
float32 for half-precision inputs); each bug's entry in the catalog (``_declared``) says what its backward gets
wrong and which clauses must catch it.
"""
from __future__ import annotations

import math

import torch
from einops import rearrange, repeat

from properties.catalog.registry import bug, correct

__all__ = ["straightforward", "dq_unscaled", "dk_unscaled", "rowsum_term_dropped", "causal_missing_in_backward",
           "dropout_not_reapplied", "nan_for_fully_masked_rows", "gqa_kv_gradient_not_summed",
           "float_mask_gradient_before_softmax", "assumes_contiguous_grad_out"]

def _weights(q, k, mask, is_causal, scale, *, naive=False):
    """Softmax weights (float, the compute dtype) with the SDPA mask semantics; rows with no key are 0."""
    scores = (q * scale) @ k.transpose(-1, -2)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    if is_causal:
        l, s = scores.shape[-2:]
        scores = scores.masked_fill(~torch.ones(l, s, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    row_max = scores.amax(-1, keepdim=True)
    if naive:
        e = torch.exp(scores - row_max)
        return e / e.sum(-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    e = torch.exp(scores - row_max)
    total = e.sum(-1, keepdim=True)
    return torch.where(total > 0, e / torch.where(total > 0, total, torch.ones_like(total)), torch.zeros_like(e))


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, dropout_p, is_causal, scale, group, defect):
        compute = torch.promote_types(q.dtype, torch.float32)
        qc, kc, vc = (t.to(compute) for t in (q, k, v))
        if group > 1:
            kc, vc = (repeat(t, "... k s e -> ... (k g) s e", g=group) for t in (kc, vc))
        maskc = None if mask is None else (mask if mask.dtype == torch.bool else mask.to(compute))
        w = _weights(qc, kc, maskc, is_causal, scale)
        keep = None
        if dropout_p > 0:
            keep = torch.rand(w.shape, device=w.device) >= dropout_p
            w_used = w * keep / (1 - dropout_p)
        else:
            w_used = w
        out = w_used @ vc
        ctx.save_for_backward(qc, kc, vc, w, keep, maskc if maskc is not None else torch.empty(0))
        ctx.has_mask, ctx.mask_dtype = mask is not None, None if mask is None else mask.dtype
        ctx.mask_shape = None if mask is None else mask.shape
        ctx.config = (dropout_p, is_causal, scale, group, defect, q.dtype, k.dtype, v.dtype)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        qc, kc, vc, w, keep, maskc = ctx.saved_tensors
        dropout_p, is_causal, scale, group, defect, q_dtype, k_dtype, v_dtype = ctx.config
        if defect == "assumes_contiguous_grad_out" and not grad_out.is_contiguous():
            grad_out = grad_out.as_strided(grad_out.shape, grad_out.contiguous().stride())
        do = grad_out.to(qc.dtype)
        mask = maskc if ctx.has_mask else None
        if defect in ("causal_missing_in_backward", "nan_for_fully_masked_rows"):
            w = _weights(qc, kc, mask, is_causal and defect != "causal_missing_in_backward", scale,
                         naive=defect == "nan_for_fully_masked_rows")
        factor = torch.ones_like(w) if keep is None or defect == "dropout_not_reapplied" else keep.to(w.dtype) / (1 - dropout_p)
        d_v = (w * factor).transpose(-1, -2) @ do
        d_w = (do @ vc.transpose(-1, -2)) * factor
        d_rowsum = torch.zeros_like(w[..., :1]) if defect == "rowsum_term_dropped" else (w * d_w).sum(-1, keepdim=True)
        d_s = w * (d_w - d_rowsum)
        d_q = d_s @ kc * (1.0 if defect == "dq_unscaled" else scale)
        d_k = d_s.transpose(-1, -2) @ qc * (1.0 if defect == "dk_unscaled" else scale)
        if group > 1:
            if defect == "gqa_kv_gradient_not_summed":
                d_k, d_v = (rearrange(t, "... (k g) s e -> ... k g s e", g=group)[..., 0, :, :] for t in (d_k, d_v))
            else:
                d_k, d_v = (rearrange(t, "... (k g) s e -> ... k g s e", g=group).sum(-3) for t in (d_k, d_v))
        d_mask = None
        if ctx.has_mask and ctx.mask_dtype != torch.bool and ctx.needs_input_grad[3]:
            d_mask = d_w if defect == "float_mask_gradient_before_softmax" else d_s
            d_mask = d_mask.sum_to_size(ctx.mask_shape).to(ctx.mask_dtype)
        return d_q.to(q_dtype), d_k.to(k_dtype), d_v.to(v_dtype), d_mask, None, None, None, None, None


def _kernel(defect: str | None):
    def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
        group = query.shape[-3] // key.shape[-3] if enable_gqa and query.dim() >= 3 else 1
        return _Attention.apply(query, key, value, attn_mask, dropout_p, is_causal, scale, group, defect)
    attention.__name__ = attention.__qualname__ = defect or "straightforward"
    return attention


def _declared(defect: str, mechanism: str, *expected: str):
    """The kernel whose backward gets ``defect`` wrong (``mechanism``), declared a catalog entry."""
    kernel = _kernel(defect)
    kernel.__doc__ = mechanism
    return bug(*expected, mechanism=f"exact forward, wrong backward: {mechanism}")(kernel)


straightforward = correct("autograd.Function", mechanism="a hand-written backward over materialised weights")(
    _kernel(None))
straightforward.__doc__ = "Materialised weights, the chain rule through softmax: a correct backward."
dq_unscaled = _declared("dq_unscaled", "dQ = dS K: the softmax scale is left out of the query gradient",
                        "ATTN-GRAD", "ATTN-GRAD-DROPOUT")
dk_unscaled = _declared("dk_unscaled", "dK = dSᵀ Q: the softmax scale is left out of the key gradient",
                        "ATTN-GRAD", "ATTN-GRAD-DROPOUT")
rowsum_term_dropped = _declared("rowsum_term_dropped",
                                "dS = W ∘ dW: the correction term D = rowsum(dO ∘ O) is left out",
                                "ATTN-GRAD", "ATTN-GRAD-DROPOUT")
causal_missing_in_backward = _declared("causal_missing_in_backward",
                                       "the backward recomputes the weights without the causal mask",
                                       "ATTN-GRAD", "ATTN-GRAD-CAUSAL")
dropout_not_reapplied = _declared("dropout_not_reapplied",
                                  "the backward uses the weights before dropout, not the mask the forward drew",
                                  "ATTN-GRAD-DROPOUT")
nan_for_fully_masked_rows = _declared("nan_for_fully_masked_rows",
                                      "the backward recomputes softmax as exp(s - max)/sum: NaN where a row has no key",
                                      "ATTN-GRAD-MASKED")
gqa_kv_gradient_not_summed = _declared("gqa_kv_gradient_not_summed", "grouped-query kv gradients taken from the first "
                                       "head of each group, not summed", "ATTN-GRAD", "ATTN-GRAD-GQA")
float_mask_gradient_before_softmax = _declared("float_mask_gradient_before_softmax",
                                               "the float mask's gradient is dW (before the softmax), not dS",
                                               "ATTN-GRAD")
assumes_contiguous_grad_out = _declared("assumes_contiguous_grad_out",
                                        "reads dO's storage as if contiguous: wrong for strided upstream gradients",
                                        "ATTN-GRAD")
