"""Mixture-of-experts models with one routing bug each (MODEL-ROUTING): transformers' own MoE models, tiny, random
weights, built from a config, with their router's forward changed in one line. Factories for ``--model``::

    pytest properties/ -m model --model properties.catalog.moe_bugs:router_softmax_over_tokens

- router_softmax_over_tokens: Mixtral's router takes its softmax over the tokens (dim=0) instead of the experts: each
  token's top-k is then picked from probabilities normalised per expert across the batch, so it is not the top-k of
  its own logits, and it moves with the other tokens of the batch.
- renormalized_against_config: a Qwen3-MoE router that renormalises the chosen experts' probabilities although the
  config says ``norm_topk_prob=False``. Outputs stay consistent (batch, padding, cache all agree): only the weights
  themselves show it.

``mixtral`` and ``qwen3_moe`` are the correct models (the catalog runs the first).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from properties.adapters import hf_subject, require_transformers
from properties.catalog.registry import bug, correct

__all__ = ["mixtral", "qwen3_moe", "router_softmax_over_tokens", "renormalized_against_config"]

MOE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=32, num_experts_per_tok=2, pad_token_id=0, bos_token_id=1,
           eos_token_id=2)


def _model(name: str, router_forward=None, **config):
    t = require_transformers()
    with torch.random.fork_rng():   # the same weights at every call: the float64 twin is a second call
        torch.manual_seed(0)
        model = getattr(t, f"{name}ForCausalLM")(getattr(t, f"{name}Config")(**MOE, **config)).eval()
    if router_forward is not None:
        for module in model.modules():
            if type(module).__name__.endswith("TopKRouter"):
                module.forward = router_forward.__get__(module)
    return hf_subject(model)


@correct("HF Mixtral", level="model",
         mechanism="transformers' Mixtral, 4 experts, top 2 (the model the routing bugs vary)")
def mixtral():
    return _model("Mixtral", num_local_experts=4)


def qwen3_moe():
    return _model("Qwen3Moe", num_experts=4, moe_intermediate_size=16, head_dim=8, norm_topk_prob=False)


def _softmax_over_tokens(self, hidden_states):
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states, self.weight)
    router_probs = torch.softmax(router_logits.float(), dim=0)   # the bug: dim=0, the tokens
    router_top_value, router_indices = torch.topk(router_probs, self.top_k, dim=-1)
    router_top_value /= router_top_value.sum(dim=-1, keepdim=True)
    return router_logits, router_top_value, router_indices


def _always_renormalized(self, hidden_states):
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states, self.weight)
    router_probs = torch.softmax(router_logits, dtype=torch.float, dim=-1)
    router_top_value, router_indices = torch.topk(router_probs, self.top_k, dim=-1)
    router_top_value /= router_top_value.sum(dim=-1, keepdim=True)   # the bug: whatever self.norm_topk_prob says
    return router_logits, router_top_value.to(router_logits.dtype), router_indices


@bug("MODEL-ROUTING", level="model",
     mechanism="Mixtral's router takes its softmax over the tokens (dim=0), not the experts")
def router_softmax_over_tokens():
    return _model("Mixtral", _softmax_over_tokens, num_local_experts=4)


@bug("MODEL-ROUTING", level="model",
     mechanism=("a Qwen3-MoE router renormalises the chosen experts' weights although the config says "
                "norm_topk_prob=False"))
def renormalized_against_config():
    return _model("Qwen3Moe", _always_renormalized, num_experts=4, moe_intermediate_size=16, head_dim=8,
                  norm_topk_prob=False)

