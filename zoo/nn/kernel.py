"""Scaled dot-product attention: the kernel contract and its three backends (math, torch, memory_efficient).

The contract is exactly that of ``torch.nn.functional.scaled_dot_product_attention``::

    kernel(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
           scale=None, enable_gqa=False) -> output

Axis letters (used in every einops pattern of the zoo):

    b  batch            h  query heads       k  key/value heads (grouped-query)
    g  query heads per key/value head (h = k * g)
    l  query positions  s  key/value positions
    e  query/key features per head (d_k)      v  value features per head (d_v)
    d  model features (d_model)               f  feed-forward features (d_ff)

Shapes: query (..., l, e), key (..., s, e), value (..., s, v) -> output (..., l, v).
``attn_mask`` broadcasts to (..., l, s): a bool mask says True = may attend; a float
mask is added to the scores.  ``is_causal`` keeps key j for query i iff j <= i (top-left
aligned, ``tril(ones(l, s))``) and may not be combined with ``attn_mask``.  ``scale``
defaults to 1/sqrt(e).  A query with no admissible key outputs zeros, never NaN.
``enable_gqa`` lets key/value carry fewer heads (dim -3) than the query: query head i
reads key/value head i // (h / k), as PyTorch documents.

One keyword beyond SDPA's signature: ``softcap`` (Gemma 2's logit soft-capping, score -> X·tanh(score/X) before
the mask is added; flash-attn's ``softcap``). SDPA has no way to say it, so only a kernel that declares a
``softcap`` parameter receives it (``takes_softcap``): the zoo's ``math`` kernel does; ``torch`` and
``memory_efficient`` do not, and the config refuses ``attention.softcap`` with them in one line.
"""
from __future__ import annotations

import inspect
import math
from typing import Callable, Protocol

import torch
import torch.nn.functional as F
from einops import einsum, repeat

from zoo.runtime.plugins import PluginError, load_object
from zoo.nn.flash_dense import admissible_softmax, compute_dtype, soft_cap
from zoo.nn.memory_efficient import memory_efficient_attention

__all__ = ["Kernel", "matched_key_value", "math_attention", "torch_attention", "sdpa_keeping_the_contract",
           "resolve_kernel", "takes_softcap", "KERNELS"]


class Kernel(Protocol):
    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                 is_causal: bool = False, scale: float | None = None,
                 enable_gqa: bool = False) -> torch.Tensor: ...


def matched_key_value(query, key, value, enable_gqa=False):
    """(key, value) checked against the query as SDPA's contract requires (the feature size of query and key, the
    length of key and value) and, with ``enable_gqa``, each key/value head repeated for its group of query heads;
    a ValueError names what does not match."""
    s, e = key.shape[-2], query.shape[-1]
    if key.shape[-1] != e:
        raise ValueError(f"query and key feature sizes differ: {e} vs {key.shape[-1]}")
    if value.shape[-2] != s:
        raise ValueError(f"key and value lengths differ: {s} vs {value.shape[-2]}")
    if enable_gqa and query.dim() >= 3 and key.shape[-3] != query.shape[-3]:
        h, k = query.shape[-3], key.shape[-3]
        if h % k:
            raise ValueError(f"query heads ({h}) must be a multiple of key/value heads ({k})")
        key = repeat(key, "... k s e -> ... (k g) s e", g=h // k)
        value = repeat(value, "... k s v -> ... (k g) s v", g=h // k)
    return key, value


def math_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                   scale=None, enable_gqa=False, softcap=None):
    """Reference einsum implementation of the kernel contract (see module docstring), with ``softcap``."""
    if is_causal and attn_mask is not None:
        raise ValueError("is_causal=True cannot be combined with an explicit attn_mask")
    l, s, e = query.shape[-2], key.shape[-2], query.shape[-1]
    key, value = matched_key_value(query, key, value, enable_gqa)
    scale = 1.0 / math.sqrt(e) if scale is None else scale

    ct = compute_dtype(query.dtype)
    # Scale before the product: an unscaled q.k is sqrt(e) times larger than the score and can overflow
    # where the score does not (properties/SPEC.md, ATTN-LARGE-SCORES).
    scores = soft_cap(einsum(query.to(ct) * scale, key.to(ct), "... l e, ... s e -> ... l s"), softcap)
    allowed = torch.ones(l, s, dtype=torch.bool, device=query.device)
    if is_causal:
        allowed = allowed.tril()
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            allowed = allowed & attn_mask
        else:
            scores = scores + attn_mask.to(ct)
    scores = scores.masked_fill(~allowed, float("-inf"))

    weights, _, _ = admissible_softmax(scores)   # a row with no admissible key: zeros, not NaN
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p)
    out = einsum(weights, value.to(ct), "... l s, ... s v -> ... l v")
    return out.to(query.dtype)


# A float-mask row whose every entry lies below this: PyTorch's memory-efficient CUDA kernel multiplies the scores
# by log2(e) in float32 before exp2, and such a row (finfo.min, float32 or bfloat16) overflows to -inf and comes
# out as if fully masked (properties/SPEC.md, MASK-LOW-PRECISION; examples/repro_mem_efficient_finfo_min.py).
_OVERFLOWING_ROW = -torch.finfo(torch.float32).max / 2


def _shift_overflowing_rows(attn_mask):
    """Each row of a float32/bfloat16 mask that lies entirely below -finfo(float32).max / 2 minus its largest entry:
    the softmax is unchanged by a per-row constant, and the subtraction is exact there (Sterbenz: both in
    [-finfo.max, -finfo.max / 2]); every other row is left bit for bit as it was."""
    if attn_mask is None or attn_mask.dtype not in (torch.float32, torch.bfloat16):
        return attn_mask
    row_max = attn_mask.amax(-1, keepdim=True)
    low = (row_max < _OVERFLOWING_ROW) & (row_max > -math.inf)
    return torch.where(low, attn_mask - row_max, attn_mask)


def torch_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                    scale=None, enable_gqa=False):
    """PyTorch's fused kernel, called with the same contract: ``sdpa_keeping_the_contract`` of
    ``F.scaled_dot_product_attention`` (looked up at each call, so that whatever PyTorch dispatches to is used)."""
    return sdpa_keeping_the_contract(F.scaled_dot_product_attention, query, key, value, attn_mask=attn_mask,
                                     dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)


def sdpa_keeping_the_contract(sdpa, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                              enable_gqa=False):
    """``sdpa`` (an SDPA function) made to keep the zoo's contract on every backend PyTorch may dispatch to:

    - a float mask's rows of finfo.min are shifted first, so that the memory-efficient CUDA kernel keeps them
      (``_shift_overflowing_rows``);
    - a bool mask goes in as its additive −inf float mask, and a query it admits no key for comes out as zeros:
      PyTorch's cuDNN backend, which the dispatcher picks for half-precision inputs with a bool mask on Hopper,
      returns neither zeros nor the mean of the values there, with dK and dV reaching keys no query may attend
      (docs/kernels.md; examples/repro_cudnn_bool_mask_rows.py), where a −inf float mask gives zeros.
    """
    no_key = None
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        no_key = ~attn_mask.any(-1, keepdim=True)
        attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=attn_mask.device).masked_fill(
            ~attn_mask, float("-inf"))
    out = sdpa(query, key, value, attn_mask=_shift_overflowing_rows(attn_mask), dropout_p=dropout_p,
               is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    # no sync with the device: the rows are zeroed whether or not there are any
    return out if no_key is None else out.masked_fill(no_key, 0.0)


KERNELS: dict[str, Callable] = {"math": math_attention, "torch": torch_attention,
                                 "memory_efficient": memory_efficient_attention}


def takes_softcap(kernel: Callable) -> bool:
    """Whether a kernel declares the ``softcap`` keyword (a builtin without a signature does not)."""
    try:
        return "softcap" in inspect.signature(kernel).parameters
    except (TypeError, ValueError):
        return False


def resolve_kernel(kernel: str | Callable) -> Callable:
    """A backend name (a key of KERNELS), an import path, or a callable -> the kernel."""
    if callable(kernel):
        return kernel
    if kernel in KERNELS:
        return KERNELS[kernel]
    if ":" not in kernel:
        raise PluginError(f"kernel {kernel!r}: expected one of {sorted(KERNELS)} or an import path 'pkg.module:function'")
    obj = load_object(kernel)
    if not callable(obj):
        raise PluginError(f"kernel {kernel!r} is not callable")
    problem = _signature_problem(obj)
    if problem:
        raise PluginError(f"kernel {kernel!r} {problem}")
    return obj


def _signature_problem(fn: Callable) -> str:
    """Why ``fn`` cannot be called as fn(query, key, value) ('' when it can, or when Python cannot tell: a C function
    without a signature is left to its first call)."""
    import inspect
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return ""
    try:
        signature.bind(0, 0, 0)
    except TypeError:
        return (f"does not take the arguments of the SDPA signature (query, key, value, attn_mask=None, "
                f"dropout_p=0.0, is_causal=False, scale=None): its signature is {signature}")
    return ""
