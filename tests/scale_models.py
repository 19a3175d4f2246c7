"""Tiny Hugging Face decoders at a long max_len (hidden size 64, 2 layers, max_len 4096, random weights, built offline),
each broken past a length the older draws never reached, with their correct twins: the models issue 25 names.

    pytest properties/ --model tests/scale_models.py:rotary_angles_in_bf16      # must fail (MODEL-SHIFT, -ROTARY-ANGLES)
    pytest properties/ --model tests/scale_models.py:llama_bf16                 # must pass

- rotary_angles_in_bf16: Llama in bfloat16 whose rotary angles are computed in the model's dtype (transformers
  #29285, gpt-neox #1003): position ids past 256 round to even numbers, past 512 to multiples of 4, and the
  angles are off by radians. Its float64 twin computes them exactly: only the model as shipped is wrong.
- window_admits_one_more: Mistral that declares sliding_window=16 and admits 17 keys (transformers #39408).
- cache_keeps_last_95: Llama (full attention) whose decode cache keeps only its last 95 positions (vllm #2064).

Each factory returns ``hf_subject(model)``, as a user would write it; nothing else is declared.
"""
from __future__ import annotations

import torch

from properties.adapters import hf_subject, require_transformers

t = require_transformers()

MAX_LEN, WINDOW, KEPT = 4096, 16, 95
COMMON = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=MAX_LEN, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _build(model_class, config, dtype=torch.float32):
    with torch.random.fork_rng():   # the same weights at every call: the float64 twin is a second call
        torch.manual_seed(0)
        model = model_class(config)
    return model.to(dtype).eval()


# ------------------------------------------------------------------------------------------- rotary in bf16
def _angles_in_model_dtype(self, x, position_ids):
    """LlamaRotaryEmbedding.forward with the angles in x's dtype (the bug): positions and frequencies rounded."""
    freqs = position_ids[..., None].to(x.dtype) * self.inv_freq.to(device=x.device, dtype=x.dtype)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


# Weights at std 0.2 (transformers' default initializer_range is 0.02): there the positions move the logits as a
# trained model's do. At 0.02 they move them by about 1%, no more than bfloat16 rounds them.
POSITIONS_MATTER = dict(COMMON, initializer_range=0.2)


def _angles_in_bf16(config):
    model = _build(t.LlamaForCausalLM, t.LlamaConfig(**config), torch.bfloat16)
    for module in model.modules():
        if type(module).__name__ == "LlamaRotaryEmbedding":
            module.forward = _angles_in_model_dtype.__get__(module)
    return hf_subject(model)


def rotary_angles_in_bf16():
    return _angles_in_bf16(POSITIONS_MATTER)


def llama_bf16():
    return hf_subject(_build(t.LlamaForCausalLM, t.LlamaConfig(**POSITIONS_MATTER), torch.bfloat16))


def rotary_angles_in_bf16_small_weights():
    """The same bug at transformers' default initialisation: MODEL-ROTARY-ANGLES reads the table, MODEL-SHIFT's
    outputs cannot show it."""
    return _angles_in_bf16(COMMON)


def llama_bf16_small_weights():
    return hf_subject(_build(t.LlamaForCausalLM, t.LlamaConfig(**COMMON), torch.bfloat16))


def llama():
    return hf_subject(_build(t.LlamaForCausalLM, t.LlamaConfig(**COMMON)))


# -------------------------------------------------------------------------------------- window off by one
class _WindowOneMore(t.MistralForCausalLM):
    """Declares config.sliding_window; its masks and caches are built for one key more."""

    def forward(self, *args, **kwargs):
        self.config.sliding_window += 1
        try:
            return super().forward(*args, **kwargs)
        finally:
            self.config.sliding_window -= 1


def window_admits_one_more():
    return hf_subject(_build(_WindowOneMore, t.MistralConfig(**COMMON, sliding_window=WINDOW)))


def mistral_window():
    return hf_subject(_build(t.MistralForCausalLM, t.MistralConfig(**COMMON, sliding_window=WINDOW)))


# ----------------------------------------------------------------------------------------- ring cache
class _RingCacheLlama(t.LlamaForCausalLM):
    """Full attention in every forward pass; the cache it starts keeps only the last KEPT positions of each layer."""

    def forward(self, *args, past_key_values=None, use_cache=None, **kwargs):
        if use_cache and past_key_values is None:
            from transformers.cache_utils import DynamicCache, DynamicSlidingWindowLayer
            past_key_values = DynamicCache()
            past_key_values.layers = [DynamicSlidingWindowLayer(sliding_window=KEPT + 1)
                                      for _ in range(self.config.num_hidden_layers)]
        return super().forward(*args, past_key_values=past_key_values, use_cache=use_cache, **kwargs)


def cache_keeps_last_95():
    return hf_subject(_build(_RingCacheLlama, t.LlamaConfig(**COMMON)))
