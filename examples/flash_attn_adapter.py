"""The real flash-attn 2.x (CUDA, fp16/bf16 only) under the suite's FlashAttention-API clauses:

    pytest properties/ --kernel-api flash --kernel examples/flash_attn_adapter.py:flash_attn_func \
        --device cuda --dtype float16 --dtype bfloat16 --window-right-below-lk
    (likewise --kernel-api flash-varlen with :flash_attn_varlen_func, flash-kvcache with :flash_attn_with_kvcache)

``--window-right-below-lk`` keeps the drawn windows where flash-attn's CUDA kernel follows its docstring (SPEC.md,
"Windows of the CUDA kernel"). flash-attn pages its KV cache in blocks of a multiple of 256 positions; smaller
drawn blocks are declined here (NotImplementedError: the paged clause is skipped with that reason).
"""
from flash_attn import flash_attn_func, flash_attn_varlen_func  # noqa: F401  (pip install flash-attn; CUDA only)
from flash_attn import flash_attn_with_kvcache as _with_kvcache


def flash_attn_with_kvcache(q, k_cache, v_cache, *args, block_table=None, **kwargs):
    if block_table is not None and k_cache.shape[1] % 256:
        raise NotImplementedError(f"flash-attn pages in blocks of 256k positions, not {k_cache.shape[1]}")
    return _with_kvcache(q, k_cache, v_cache, *args, block_table=block_table, **kwargs)
