"""FlashAttention's Python API (flash-attn 2.x) in plain PyTorch: reference kernels for the three entry points.

The calling conventions and semantics are those of ``flash_attn/flash_attn_interface.py`` (the docstrings of
``flash_attn_func``, ``flash_attn_varlen_func`` and ``flash_attn_with_kvcache``)::

    flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False)
    flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, <the same keywords>)
    flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False)

Shapes (axis letters as in ``zoo/nn/kernel.py``): q (b, l, h, e), k and v (b, s, k, e) with h = k·g (query head
i reads key/value head i // g); varlen: q (total_l, h, e), k and v (total_s, k, e) and int32 cu_seqlens (b + 1,);
kvcache: a cache (b_cache, s_cache, k, e), or paged (blocks, block_size, k, e) with an int32 block_table
(b, max_blocks).

Semantics, with o = s − l (bottom-right alignment): query i may attend key j iff j ≤ i + o under ``causal``,
and i + o − left ≤ j ≤ i + o + right under ``window_size=(left, right)`` (−1: unbounded on that side). The
score is σ q·k (σ = softmax_scale, default 1/√e), capped to softcap·tanh(σ q·k / softcap) when softcap > 0, plus
−slope·|i + o − j| with ``alibi_slopes`` of shape (h,) or (b, h); then masked and normalised. A query with no
admissible key outputs 0. Varlen: every sequence of the packed batch is a ``flash_attn_func`` problem of its
own (alibi row b for a (b, h) slope table). KV cache: k and v, when given, are written into the cache in
place at positions cache_seqlens[b] ...; attention covers cache positions [cache_leftpad[b], cache_seqlens[b]
+ l_new), causal, window and alibi bottom-right aligned to that range; ``cache_seqlens=None`` means the whole
cache; ``cache_batch_idx`` picks the cache row of each batch entry. Rotary embedding of the kvcache API is not
implemented (NotImplementedError), nor ``return_softmax_lse`` there.

Kernels (``FLASH_KERNELS``, by API): ``flash`` — ``reference`` (every score at once) and ``tiled`` (key and
query tiles with an online softmax, the FlashAttention-2 forward; tiles outside the causal/window band are
skipped); ``flash-varlen`` — ``varlen_loop`` (one ``reference`` call per sequence) and ``varlen_packed`` (one
block-diagonal problem over the packed axis); ``flash-kvcache`` — ``kvcache_gather`` (the range gathered into
a contiguous tensor, then ``reference``) and ``kvcache_paged`` (an online softmax that walks the cache block by
block through the block table; a contiguous cache is one block per row). Half-precision inputs are computed in
float32. ``reference`` and ``tiled`` (and the varlen kernels) are differentiable with autograd.

The kernels live by API in zoo/nn/flash_dense.py (with what they all share: the band, soft-capping, ALiBi, the
admissible and the online softmax), zoo/nn/flash_varlen.py and zoo/nn/flash_kvcache.py (with ``paged_slots``), and
are imported from there; this module names them by API (``FLASH_KERNELS``) and resolves a kernel by name or path.
"""
from __future__ import annotations

from typing import Callable

from zoo.runtime.plugins import PluginError, load_object
from zoo.nn.flash_dense import flash_attn_reference, flash_attn_tiled
from zoo.nn.flash_kvcache import flash_attn_kvcache_gather, flash_attn_kvcache_paged
from zoo.nn.flash_varlen import flash_attn_varlen_loop, flash_attn_varlen_packed

__all__ = ["FLASH_APIS", "FLASH_KERNELS", "resolve_flash_kernel"]

FLASH_APIS = ("flash", "flash-varlen", "flash-kvcache")


FLASH_KERNELS: dict[str, dict[str, Callable]] = {
    "flash": {"reference": flash_attn_reference, "tiled": flash_attn_tiled},
    "flash-varlen": {"varlen_loop": flash_attn_varlen_loop, "varlen_packed": flash_attn_varlen_packed},
    "flash-kvcache": {"kvcache_gather": flash_attn_kvcache_gather, "kvcache_paged": flash_attn_kvcache_paged},
}


def resolve_flash_kernel(kernel: str | Callable, api: str) -> Callable:
    """A zoo kernel name of ``api`` (a key of FLASH_KERNELS[api]), an import path, or a callable."""
    if api not in FLASH_KERNELS:
        raise PluginError(f"kernel API {api!r}: expected one of {FLASH_APIS}")
    if callable(kernel):
        return kernel
    if kernel in FLASH_KERNELS[api]:
        return FLASH_KERNELS[api][kernel]
    if ":" not in kernel:
        raise PluginError(f"kernel {kernel!r}: expected one of {sorted(FLASH_KERNELS[api])} ({api} API) or an "
                          "import path 'pkg.module:function'")
    obj = load_object(kernel)
    if not callable(obj):
        raise PluginError(f"kernel {kernel!r} is not callable")
    return obj
