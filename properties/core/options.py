"""The values the suite's command-line options accept, and their defaults: each list stated once, with nothing
imported. The plug-in's entry point (properties/plugin/__init__.py) registers every option from them without
loading torch, the zoo or the suite; the modules that act on an option import its values from here."""
from __future__ import annotations

__all__ = ["DTYPE_NAMES", "ALIGNMENTS", "FULLY_MASKED_CONVENTIONS", "FINFO_MIN_ROWS", "KERNEL_APIS", "LIMIT_OPTIONS",
           "DEFAULT_TIMEOUT", "MIN_TIMEOUT", "SHARD_LAYOUTS", "LSE_BASES"]

# The dtypes the suite draws (--dtype), by torch's names. The order matters: Hypothesis shrinks sampled_from
# towards the first entry, so counterexamples show float32 unless the failure needs another dtype.
DTYPE_NAMES = ("float32", "float64", "bfloat16", "float16")

# Where is_causal's diagonal lies when L != S (--causal-alignment): top-left (PyTorch) or bottom-right
# (FlashAttention).
ALIGNMENTS = ("top-left", "bottom-right")

# What a query with no admissible key may output (SPEC.md, MASK-FULLY-MASKED; --fully-masked): zeros (the
# default, PyTorch >= 2.5), NaN (the textbook softmax of an all −inf row), the mean of the values over all keys
# (an additive finfo.min mask: every score becomes finfo.min, the weights uniform; for a row that the caller's
# own float mask sets to −inf, NaN), or any value at all.
FULLY_MASKED_CONVENTIONS = ("zeros", "nan", "mean", "any")

# A float-mask row whose every score is below -finfo(float32).max / log2(e) (--finfo-min-rows; MASK-LOW-PRECISION):
# its softmax (SDPA's semantics), or, declared, what a query without admissible key outputs (PyTorch's
# memory-efficient CUDA kernel scales the scores by log2(e) in float32, and such a row overflows to -inf).
FINFO_MIN_ROWS = ("softmax", "masked")

# The calling conventions of --kernel (--kernel-api): SDPA's signature, flash-attn 2.x's three functions, or a merge of
# partial attention states with FlashInfer's merge_state / merge_states signature.
KERNEL_APIS = ("sdpa", "flash", "flash-varlen", "flash-kvcache", "merge")

# How a context-parallel kernel's ranks hold the sequence (--shard; properties/distributed/layouts.py): contiguous
# shards, or zigzag (2W chunks, rank r holding chunks r and 2W - 1 - r).
SHARD_LAYOUTS = ("contiguous", "zigzag")

# The base of a log-sum-exp a kernel returns or a merge takes (--lse-base): natural (PyTorch, flash-attn, vLLM) or 2
# (FlashInfer's kernels compute with exp2).
LSE_BASES = ("e", "2")

# The options that declare an SDPA kernel's limits (properties/kernel/limits.py; dtypes: --dtype).
LIMIT_OPTIONS = ("--kernel-head-size", "--kernel-no-mask", "--kernel-equal-lengths", "--kernel-equal-head-sizes")

# One call of the code under test may take this long (seconds; --call-timeout, properties/core/watchdog.py). The
# suite's largest drawn problems (kernels: S = 1024 keys, head size 256; models: max_len 4096) take a correct kernel
# written as a Python loop over its query rows, or a small model in float64, a few seconds at most on a loaded
# 2-core CPU; 60 s leaves room for a first call that compiles (Triton, torch.compile) and still names a hang within
# a minute.
DEFAULT_TIMEOUT = 60.0
# The least limit --call-timeout accepts (0 aside): importing torch-using code or a kernel's first call takes some
# tenths of a second on a loaded machine even when nothing is wrong, so a smaller limit would only stop correct code.
MIN_TIMEOUT = 1.0
