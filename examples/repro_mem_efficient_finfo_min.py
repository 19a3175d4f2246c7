"""PyTorch's memory-efficient CUDA kernel: a float-mask row of finfo(float32).min comes out as if fully masked.

    python examples/repro_mem_efficient_finfo_min.py

MASK-LOW-PRECISION's failure on CUDA (``--kernel torch.nn.functional:scaled_dot_product_attention``), reproduced
without the suite. A float mask is added to the scores (SDPA docs), so a row masked with finfo.min everywhere is the
row's scores shifted by one constant, and its softmax is that of the scores: weights that sum to 1. The
memory-efficient kernel (aten/.../mem_eff_attention/kernel_forward.h, ``iterative_softmax``) multiplies the biased
scores by log2(e) in float32 before ``exp2``: score + finfo.min ≈ -3.4e38 times 1.4427 overflows to -inf, the row's
running maximum stays -inf, and the row is treated as having no admissible key — zeros (NaN before PyTorch 2.5:
pytorch/pytorch#110213, the reason for Hugging Face's ``_unmask_unattended``). float32 and bfloat16 masks are
affected (their finfo.min is below -finfo(float32).max / log2(e) ≈ -2.36e38); float16's (-65504) is not. The flash
backend takes no float mask; cuDNN and math give the softmax.

On a machine without CUDA the script runs ``log2e_scaled_attention``, the same arithmetic in plain torch (scores
times log2(e) in float32, exp2, a row whose maximum is -inf output as zeros), which shows the mechanism; the suite's
MASK-LOW-PRECISION catches it there too, and passes it under ``--finfo-min-rows masked``, the convention that
declares this behaviour (tests/test_finfo_min_rows.py).
"""
import math

import torch
import torch.nn.functional as F

LOG2E = 1.4426950408889634


def log2e_scaled_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                           enable_gqa=False):
    """The memory-efficient kernel's softmax arithmetic in plain torch (float32 accumulators, exp2 of scores
    scaled by log2(e)); like it, no float64; no dropout, no grouped heads."""
    if query.dtype == torch.float64 or dropout_p > 0 or (enable_gqa and key.shape[-3] != query.shape[-3]):
        raise NotImplementedError("log2e_scaled_attention: float64, dropout and grouped heads are not supported")
    ct = torch.float32
    sigma = 1 / math.sqrt(query.shape[-1]) if scale is None else scale
    scores = (query.to(ct) * sigma) @ key.to(ct).transpose(-1, -2)
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, -math.inf) if attn_mask.dtype == torch.bool else scores + attn_mask.to(ct)
    if is_causal:
        scores = scores.masked_fill(~torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril(),
                                    -math.inf)
    scaled = scores.to(torch.float32) * LOG2E            # finfo.min * log2(e): -inf in float32
    row_max = scaled.amax(-1, keepdim=True)
    p = torch.exp2(scaled - torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max)))
    total = p.sum(-1, keepdim=True)
    return ((p / torch.where(total > 0, total, torch.ones_like(total))).to(ct) @ value.to(ct)).to(query.dtype)


def main() -> None:
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v = (torch.randn(1, 1, 4, 64, device=device) for _ in range(3))
    mask = torch.zeros(1, 1, 4, 4, device=device)
    mask[..., 0, :] = torch.finfo(torch.float32).min      # query 0: every key at finfo.min, none at -inf
    expected = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), mask.double())[0, 0, 0]
    print(f"device {device}; query 0, the softmax of its scores (float64): {expected[:4].tolist()}")
    if device == "cpu":
        out = log2e_scaled_attention(q, k, v, mask)[0, 0, 0]
        print(f"log2e_scaled_attention (the memory-efficient kernel's arithmetic): {out[:4].tolist()}")
        print("(CUDA is needed to run the memory-efficient kernel itself)")
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel
    for backend in (SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH):
        try:
            with sdpa_kernel([backend]):
                out = F.scaled_dot_product_attention(q, k, v, mask)[0, 0, 0]
            print(f"{backend.name:20} query 0: {out[:4].tolist()}  (all zero: {bool((out == 0).all())})")
        except RuntimeError as exc:
            print(f"{backend.name:20} not available: {str(exc).splitlines()[0]}")


if __name__ == "__main__":
    main()
