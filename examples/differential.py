"""Differential verification: does a fast model match the reference implementation it replaces — in outputs, in
parameter gradients and in cached generation? (properties/SPEC.md: MODEL-DIFF-FORWARD, -GRADIENT, -DECODE)

Hugging Face Llama with PyTorch's fused attention (sdpa) against its eager attention, the same weights:

    pytest properties/ -m model --model examples/differential.py:llama_sdpa --reference examples/differential.py:llama_eager

The zoo's memory-efficient attention backend (FlashAttention-2 style tiles, its own backward) against its math
backend, the same weights:

    pytest properties/ -m model --model examples/differential.py:zoo_memory_efficient --reference examples/differential.py:zoo_math

A reference factory takes the Subject under test and copies its weights; the suite calls it once with the model as
built and once with its float64 twin, and compares both pairs. Built offline from small configs with random weights.
Besides the differential clauses, every other model clause runs on the model under test (add -k DIFF, or
``--catalog-clause`` with ``-p properties.catalog.select``, to run only the comparison).
"""
from __future__ import annotations

import torch

from properties import Subject

VOCAB, MAX_LEN = 64, 64   # 64 positions: MODEL-DIFF-DECODE decodes at least 32


def _llama(attention: str):
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=MAX_LEN,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2, attn_implementation=attention)
    with torch.random.fork_rng():   # the same weights at every call (the suite builds a float64 twin)
        torch.manual_seed(0)
        return LlamaForCausalLM(config).eval()


def llama_sdpa() -> Subject:
    from properties.adapters.huggingface import hf_subject
    return hf_subject(_llama("sdpa"))


def llama_eager(subject: Subject) -> Subject:
    """The eager attention (softmax in float32, as Hugging Face writes it) with the subject's weights."""
    from properties.adapters.huggingface import hf_subject
    model = _llama("eager").to(next(subject.module.parameters()).dtype)
    model.load_state_dict(subject.module.state_dict())
    return hf_subject(model)


_ZOO = ("model=decoder_only", "pos=rotary", "task=verify", "d_model=32", "heads=2", "layers=2", "d_ff=64",
        f"vocab_size={VOCAB}", f"max_len={MAX_LEN}")


def _zoo(kernel: str):
    from zoo.config.builder import build_model
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return build_model([*_ZOO, f"attention={kernel}"])


def zoo_memory_efficient():
    return _zoo("memory_efficient")


def zoo_math(subject: Subject):
    """The zoo's math backend (its einsum kernel) with the subject's weights."""
    model = _zoo("math").to(next(subject.module.parameters()).dtype)
    model.load_state_dict(subject.module.state_dict())
    return model
