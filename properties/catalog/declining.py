"""Correct kernels that decline part of the contract, as fused kernels do: the decline profiles.

Each is ``F.scaled_dot_product_attention`` (exact) behind a gate that raises what the real kernel raises for a
problem outside its limits: PyTorch's CUDA backends raise ``RuntimeError: No available kernel. Aborting
execution.`` when the one backend enabled (``torch.nn.attention.sdpa_kernel``) cannot run a problem; hand-written
kernels raise ``NotImplementedError``. The message ends with the profile's name and the limit, so that a report can
tell a skip for the kernel's own reason from any other. The backends' gates are those of PyTorch's dispatcher
(``can_use_flash_attention``, ``can_use_mem_efficient_attention``, ``can_use_cudnn_attention`` in
aten/src/ATen/native/transformers/cuda/sdp_utils.cpp; docs/sources/pytorch-sdpa.md, "Backends, their limits and
their precision"), on an sm90 GPU (H100) with cuDNN 9 before 9.2.2 (head sizes up to 128).

    pytest properties/ -m kernel --kernel properties.catalog.declining:flash_backend

``PROFILES`` names them; ``tests/test_declines.py`` runs the kernel-level suite on all of them and requires, per
profile, no failure and no skip but those of ``CANNOT_RUN`` (clauses none of whose problems the kernel accepts).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["PROFILES", "CANNOT_RUN", "TAGS", "cannot_run", "triton_limits", "cudnn_bool_mask_rows", "zoo_torch_on_cudnn_rows", "flash_backend", "efficient_backend", "cudnn_backend", "grouped_heads_declined",
           "masks_declined", "four_dims_only", "causal_only", "equal_lengths_only", "contiguous_only"]

_HALF = (torch.float16, torch.bfloat16)


def _no_kernel(profile: str, why: str):
    return RuntimeError(f"No available kernel. Aborting execution. ({profile}: {why})")


def _grouped(query, key) -> bool:
    return query.dim() >= 3 and key.dim() >= 3 and query.shape[-3] != key.shape[-3]


def _declining(name: str, gate):
    """F.scaled_dot_product_attention behind ``gate(query, key, value, kwargs) -> exception or None``."""
    def kernel(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        kwargs = dict(attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
        declined = gate(query, key, value, kwargs)
        if declined is not None:
            raise declined
        return F.scaled_dot_product_attention(query, key, value, **kwargs)
    kernel.__name__ = kernel.__qualname__ = name
    kernel.__doc__ = gate.__doc__
    return kernel


def _flash(q, k, v, kw):
    """PyTorch's flash backend: float16/bfloat16, no attn_mask, 4-D, E = Ev <= 256, is_causal only with L = S."""
    e, ev = q.shape[-1], v.shape[-1]
    if q.dim() != 4:
        return _no_kernel("flash", f"inputs must be 4-D, not {q.dim()}-D")
    if q.dtype not in _HALF:
        return _no_kernel("flash", f"dtype {q.dtype}")
    if kw["attn_mask"] is not None:
        return _no_kernel("flash", "attn_mask")
    if not (e == k.shape[-1] == ev and e <= 256):
        return _no_kernel("flash", f"head sizes E = {e}, Ev = {ev} (equal and at most 256)")
    if kw["is_causal"] and q.shape[-2] != k.shape[-2]:
        return _no_kernel("flash", "is_causal with L != S")
    return None


def _efficient(q, k, v, kw):
    """PyTorch's memory-efficient backend: float16/bfloat16/float32, 4-D, E and Ev multiples of 8 (half) or 4."""
    if q.dim() != 4:
        return _no_kernel("efficient", f"inputs must be 4-D, not {q.dim()}-D")
    if q.dtype not in (*_HALF, torch.float32):
        return _no_kernel("efficient", f"dtype {q.dtype}")
    alignment = 8 if q.dtype in _HALF else 4
    if q.shape[-1] % alignment or v.shape[-1] % alignment:
        return _no_kernel("efficient", f"head sizes not multiples of {alignment}")
    return None


def _cudnn(q, k, v, kw):
    """PyTorch's cuDNN backend: float16/bfloat16, 4-D, E, Ev <= 128 and multiples of 8, S > 1, dropout_p a multiple
    of 1/16 (and L > 1 with dropout)."""
    e, ev = q.shape[-1], v.shape[-1]
    if q.dim() != 4:
        return _no_kernel("cudnn", f"inputs must be 4-D, not {q.dim()}-D")
    if q.dtype not in _HALF:
        return _no_kernel("cudnn", f"dtype {q.dtype}")
    if e > 128 or ev > 128 or e % 8 or ev % 8:
        return _no_kernel("cudnn", f"head sizes E = {e}, Ev = {ev} (multiples of 8, at most 128)")
    if k.shape[-2] == 1:
        return _no_kernel("cudnn", "key length 1")
    p = kw["dropout_p"]
    if p * 16 != int(p * 16) or (p and q.shape[-2] == 1):
        return _no_kernel("cudnn", f"dropout_p = {p} (multiples of 1/16, L > 1)")
    return None


def _no_grouped_heads(q, k, v, kw):
    """Grouped heads (enable_gqa with fewer key/value heads) declined; everything else accepted."""
    if kw["enable_gqa"] and _grouped(q, k):
        return NotImplementedError("grouped-query attention is not supported (grouped_heads_declined)")
    return None


def _no_masks(q, k, v, kw):
    """Any attn_mask declined; everything else accepted."""
    if kw["attn_mask"] is not None:
        return NotImplementedError("attn_mask is not supported (masks_declined)")
    return None


def _four_dims(q, k, v, kw):
    """Only 4-D (batch, heads, length, features) inputs."""
    if q.dim() != 4:
        return NotImplementedError(f"only 4-D inputs are supported, not {q.dim()}-D (four_dims_only)")
    return None


def _causal(q, k, v, kw):
    """Only is_causal=True (a causal-only kernel: an LLM's prefill)."""
    if not kw["is_causal"]:
        return NotImplementedError("only is_causal=True is supported (causal_only)")
    return None


def _contiguous(q, k, v, kw):
    """Only contiguous q, k, v (a fused kernel that reads raw pointers with the contiguous strides)."""
    if not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous()):
        return NotImplementedError("only supports contiguous q, k, v (contiguous_only)")
    return None


def _equal_lengths(q, k, v, kw):
    """Only L = S."""
    if q.shape[-2] != k.shape[-2]:
        return NotImplementedError(f"only L = S is supported, not L = {q.shape[-2]}, S = {k.shape[-2]} "
                                   f"(equal_lengths_only)")
    return None


# ------------------------------------------------------------- cuDNN's rows without an admissible key (a stand-in)
# A bool mask applied as a large finite negative bias: a query whose mask admits no key then gets the softmax of its
# raw scores (neither zeros nor the mean of the values), huge keys and values behind the mask reach the output, and
# keys no query may attend get a gradient. These are the symptoms PyTorch's cuDNN backend shows with a bool mask on an
# H100 (docs/kernels.md; examples/repro_cudnn_bool_mask_rows.py); the arithmetic is a model of them, not cuDNN's code.
_FINITE_MASK_BIAS = -30000.0


def cudnn_bool_mask_rows(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                         enable_gqa=False):
    """F.scaled_dot_product_attention with a bool mask applied as a finite bias of -30000 (a float mask as given)."""
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=attn_mask.device).masked_fill(
            ~attn_mask, _FINITE_MASK_BIAS)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                          is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)


def zoo_torch_on_cudnn_rows(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                            enable_gqa=False):
    """The zoo's ``torch`` kernel (zoo/nn/kernel.py) with ``cudnn_bool_mask_rows`` for SDPA: it keeps its promise."""
    from zoo.nn.kernel import sdpa_keeping_the_contract
    return sdpa_keeping_the_contract(cudnn_bool_mask_rows, query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                     is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)


flash_backend = _declining("flash_backend", _flash)
efficient_backend = _declining("efficient_backend", _efficient)
cudnn_backend = _declining("cudnn_backend", _cudnn)
grouped_heads_declined = _declining("grouped_heads_declined", _no_grouped_heads)
masks_declined = _declining("masks_declined", _no_masks)
four_dims_only = _declining("four_dims_only", _four_dims)
causal_only = _declining("causal_only", _causal)
equal_lengths_only = _declining("equal_lengths_only", _equal_lengths)
contiguous_only = _declining("contiguous_only", _contiguous)

PROFILES = {kernel.__name__: kernel for kernel in (flash_backend, efficient_backend, cudnn_backend,
                                                   grouped_heads_declined, masks_declined, four_dims_only,
                                                   causal_only, equal_lengths_only, contiguous_only,
                                                   zoo_torch_on_cudnn_rows)}

# Clauses a profile cannot run a single problem of: each must be skipped with the profile's own message (TAGS), and
# every other clause the suite runs on an undeclining kernel must run and pass.
_MASKS = ("MASK-BOOL", "MASK-FLOAT-ADDITIVE", "MASK-BOOL-FLOAT", "MASK-NO-INFLUENCE", "MASK-FULLY-MASKED",
          "MASK-BROADCAST", "MASK-LOW-PRECISION", "ATTN-GRAD-MASKED", "ATTN-SHIFT-INVARIANT")
_CAUSAL = ("CAUSAL-NO-FUTURE", "CAUSAL-ZERO-ABOVE", "CAUSAL-ALIGNMENT", "ATTN-GRAD", "ATTN-GRAD-CAUSAL", "ATTN-GRAD-GQA",
           "ATTN-ORACLE",   # the oracle clause poses is_causal among its classes
           # the integrity clauses draw causal calls among their others
           "ATTN-HISTORY", "ATTN-INPUTS-UNCHANGED", "ATTN-OUTPUT-FRESH", "ATTN-LAYOUT")
CANNOT_RUN: dict[str, tuple[str, ...]] = {
    "flash_backend": _MASKS,
    "efficient_backend": (),
    "cudnn_backend": (),
    "grouped_heads_declined": ("ATTN-GRAD-GQA",),
    "masks_declined": _MASKS,
    "four_dims_only": (),
    "causal_only": ("not", *_CAUSAL),    # every clause but these: they pose causal problems (grad_cases: always)
    "equal_lengths_only": (),
    "contiguous_only": ("ATTN-LAYOUT",),   # every layout it poses is strided
    "zoo_torch_on_cudnn_rows": (),
}
# The words of each profile's own declines.
TAGS = {name: f"({name.removesuffix('_backend')}:" if name.endswith("_backend") else f"({name})" for name in PROFILES}


def cannot_run(name: str, clause: str) -> bool:
    """Whether profile ``name`` runs no problem of ``clause``."""
    listed = CANNOT_RUN[name]
    return clause not in listed[1:] if listed[:1] == ("not",) else clause in listed


def _triton_example(q, k, v, kw):
    """examples/triton_attention.py's limits: float16/bfloat16, E = Ev in 16, 32, 64, 128, no attn_mask, no dropout."""
    if kw["attn_mask"] is not None or kw["dropout_p"]:
        return NotImplementedError("triton_limits: attn_mask and dropout are not supported")
    if q.dtype not in _HALF or q.shape[-1] not in (16, 32, 64, 128) or v.shape[-1] != q.shape[-1]:
        return NotImplementedError("triton_limits only supports float16/bfloat16, E = Ev in 16, 32, 64, 128")
    return None


# The Triton example's limits over F.scaled_dot_product_attention: the draws (and specialisations) the suite poses
# that kernel, counted without interpreting it (docs/kernels.md).
triton_limits = _declining("triton_limits", _triton_example)
