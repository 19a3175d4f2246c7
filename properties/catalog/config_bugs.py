"""Models that depart from what their config declares, one realistic bug each (MODEL-LAYER-*, MODEL-PRECISION,
MODEL-HISTORY, MODEL-PADDING-IDS, MODEL-ROUTING): transformers' own models, tiny, random weights, built from a config,
with one module's forward or one buffer changed as the bug does it. Each is self-consistent — batching, padding and
caching agree — so only the config's declarations show it. Factories for ``--model``::

    pytest properties/ -m model --model properties.catalog.config_bugs:gemma3_local_layers_global_base

``CORRECT`` names the correct model each bug varies (a factory here too); ``BUGS`` the mechanism of each bug.
"""
from __future__ import annotations

import math
import types

import torch
import torch.nn.functional as F

from properties.adapters import hf_subject, require_transformers
from properties.catalog.registry import bug, correct

__all__ = ["CORRECT", "gemma3", "gemma2", "gemma", "llama", "llama_yarn", "llama_dynamic", "llama_bf16",
           "qwen2_moe", "granitemoe", "mixtral", "ernie_moe", "glm4_moe", "phi3_longrope", "stablelm", "llama_pad_eos"]

BASE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _build(name: str, dtype=torch.float32, subject: dict | None = None, **config):
    """hf_subject of transformers' ``{name}ForCausalLM`` on ``{name}Config(**BASE | config)``, weights from seed 0."""
    t = require_transformers()
    config_class = getattr(t, "Gemma3TextConfig" if name == "Gemma3" else f"{name}Config")
    with torch.random.fork_rng():   # the same weights at every call: the float64 twin is a second call
        torch.manual_seed(0)
        model = getattr(t, f"{name}ForCausalLM")(config_class(**(BASE | config))).to(dtype).eval()
    return model, subject or {}


def _subject(built):
    model, keywords = built
    return hf_subject(model, **keywords)


def _patch(model, class_suffix: str, forward):
    """Every module whose class name ends with ``class_suffix`` gets ``forward`` (the bug)."""
    found = [m for m in model.modules() if type(m).__name__.endswith(class_suffix)]
    assert found, f"no module of a class ending with {class_suffix!r}"
    for module in found:
        module.forward = types.MethodType(forward, module)
    return model


def _trained_bias(model, scale: float = 0.3):
    """e_score_correction_bias drawn as training leaves it (not zeros: the choice then differs from plain top-k)."""
    generator = torch.Generator().manual_seed(1)
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if name.endswith("e_score_correction_bias"):
            with torch.no_grad():
                tensor.copy_(torch.randn(tensor.shape, generator=generator) * scale)
    return model


# ------------------------------------------------------------------------------------------- the correct models
GEMMA3 = dict(head_dim=8, sliding_window=4, sliding_window_pattern=2, query_pre_attn_scalar=32,
              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                               "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
              attn_implementation="eager")
GEMMA2 = dict(head_dim=8, sliding_window=4, query_pre_attn_scalar=32, attn_implementation="eager")
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "rope_theta": 10000.0}
DYNAMIC = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.2, 1.5, 2.0], "long_factor": [1.5, 3.0, 6.0, 12.0],
            "rope_theta": 10000.0}
MOE = dict(num_experts_per_tok=2)


@correct("HF Gemma 3, per-layer bases", level="model",
         mechanism="sliding layers with base 1e4, global ones 1e6, query_pre_attn_scalar (the model the Gemma bugs vary)")
def gemma3():
    return _subject(_build("Gemma3", **GEMMA3))


def gemma2():
    return _subject(_build("Gemma2", **GEMMA2))


def gemma():
    return _subject(_build("Gemma", head_dim=8))


def llama():
    return _subject(_build("Llama"))


def llama_yarn():
    return _subject(_build("Llama", rope_parameters=dict(YARN)))


def llama_dynamic():
    return _subject(_build("Llama", rope_parameters=dict(DYNAMIC)))


def llama_bf16():
    return _subject(_build("Llama", torch.bfloat16))


def llama_pad_eos():   # pad = eos, as Arcee's and many Llama checkpoints ship
    return _subject(_build("Llama", pad_token_id=2, eos_token_id=2))


def phi3_longrope():
    return _subject(_build("Phi3", original_max_position_embeddings=16, rope_parameters=dict(LONGROPE)))


def stablelm():   # LayerNorm, a quarter of each head rotated
    return _subject(_build("StableLm"))


def qwen2_moe():
    return _subject(_build("Qwen2Moe", **MOE, num_experts=4, moe_intermediate_size=16,
                           shared_expert_intermediate_size=16))


def granitemoe():
    return _subject(_build("GraniteMoe", **MOE, num_local_experts=4))


def mixtral():
    return _subject(_build("Mixtral", **MOE, num_local_experts=4))


def ernie_moe():
    model, keywords = _build("Ernie4_5_Moe", **MOE, num_experts=4, moe_intermediate_size=16, moe_layer_start_index=0,
                             moe_num_shared_experts=1)
    return _subject((_trained_bias(model), keywords))


@correct("HF GLM-4-MoE, biased router", level="model",
         mechanism="sigmoid scores, a trained correction bias, the best 1 of 2 groups, routed_scaling_factor 2.5 (the model the routing bugs vary)")
def glm4_moe():
    model, keywords = _build("Glm4Moe", **MOE, n_routed_experts=8, moe_intermediate_size=16, n_group=2, topk_group=1,
                             first_k_dense_replace=0, head_dim=8, routed_scaling_factor=2.5)
    return _subject((_trained_bias(model), keywords))


CORRECT = {name: globals()[name] for name in ("gemma3", "gemma2", "gemma", "llama", "llama_yarn", "llama_dynamic",
                                               "llama_bf16", "llama_pad_eos", "phi3_longrope", "stablelm", "qwen2_moe",
                                               "granitemoe", "mixtral", "ernie_moe", "glm4_moe")}


# ------------------------------------------------------------------------------------------------------ the bugs
@bug("MODEL-LAYER-ATTENTION", level="model",
     mechanism="Gemma 3's sliding layers rotate with the global layers' base (1e6, not 1e4)")
def gemma3_local_layers_global_base():
    model, keywords = _build("Gemma3", **GEMMA3)
    rotary = model.model.rotary_emb
    with torch.no_grad():   # the sliding layers' table built from the global base (rope_theta 1e6 everywhere)
        rotary.sliding_attention_inv_freq.copy_(rotary.full_attention_inv_freq)
        rotary.sliding_attention_original_inv_freq.copy_(rotary.full_attention_inv_freq)
    return _subject((model, keywords))


@bug("MODEL-LAYER-ATTENTION", level="model",
     mechanism="Gemma 2's scores scaled by head_dim^-1/2 where the config says query_pre_attn_scalar^-1/2")
def gemma2_scale_from_head_dim():
    model, keywords = _build("Gemma2", **GEMMA2)
    for layer in model.model.layers:     # head_dim^-1/2 where the config says query_pre_attn_scalar^-1/2
        layer.self_attn.scaling = layer.self_attn.head_dim ** -0.5
    return _subject((model, keywords))


@bug("MODEL-LAYER-ATTENTION", level="model",
     mechanism="YaRN's attention factor 0.1·ln(s) + 1 left at 1")
def yarn_attention_factor_one():
    model, keywords = _build("Llama", rope_parameters=dict(YARN))
    model.model.rotary_emb.attention_scaling = 1.0      # YaRN's 0.1·ln(4) + 1 dropped: cos and sin unscaled
    return _subject((model, keywords))


def _rms_without_unit_offset(self, x):
    output = self._norm(x.float())
    return (output * self.weight.float()).type_as(x)     # the bug: w, not (1 + w)


@bug("MODEL-LAYER-NORM", level="model",
     mechanism="Gemma's RMSNorm scales by w instead of (1 + w)")
def gemma_norm_without_unit_offset():
    model, keywords = _build("Gemma", head_dim=8)
    with torch.no_grad():   # trained-looking gains, so that the model is not degenerate either way
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)) * 0.1)
    return _subject((_patch(model, "GemmaRMSNorm", _rms_without_unit_offset), keywords))


def _rms_eps_outside_root(self, hidden_states):
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    root = hidden_states.pow(2).mean(-1, keepdim=True).sqrt()
    hidden_states = hidden_states / (root + self.variance_epsilon)    # the bug: eps added outside the root
    return self.weight * hidden_states.to(input_dtype)


@bug("MODEL-LAYER-NORM", level="model",
     mechanism="RMSNorm x/(√(mean x²) + eps): eps outside the root (NaN gradient at a zero embedding)")
def rmsnorm_eps_outside_root():
    model, keywords = _build("Llama")
    return _subject((_patch(model, "LlamaRMSNorm", _rms_eps_outside_root), keywords))


def _shared_expert_ungated(self, hidden_states):
    batch_size, sequence_length, hidden_dim = hidden_states.shape
    flat = hidden_states.view(-1, hidden_dim)
    shared = self.shared_expert(flat)              # the bug: sigmoid(shared_expert_gate(x)) never applied
    _, weights, experts = self.gate(flat)
    return (self.experts(flat, experts, weights) + shared).reshape(batch_size, sequence_length, hidden_dim)


@bug("MODEL-LAYER-MOE", level="model",
     mechanism="Qwen2-MoE's shared expert added without its sigmoid gate")
def qwen2_moe_shared_expert_ungated():
    model, _ = _build("Qwen2Moe", **MOE, num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=16)
    # hf_subject's probe finds the gate unreached and asks for the keyword; the user passes it, as a user does
    return _subject((_patch(model, "Qwen2MoeSparseMoeBlock", _shared_expert_ungated),
                     {"unused_parameters": "unreached"}))


def _mixtral_not_renormalised(self, hidden_states):
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    logits = F.linear(hidden_states, self.weight)
    probabilities = torch.softmax(logits.float(), dim=-1)
    top, indices = torch.topk(probabilities, self.top_k, dim=-1)    # the bug: no division by their sum
    return logits, top, indices


@bug("MODEL-ROUTING", "MODEL-LAYER-MOE", level="model",
     mechanism="Mixtral's router skips the renormalisation over its top 2")
def mixtral_not_renormalised():
    model, keywords = _build("Mixtral", **MOE, num_local_experts=4)
    return _subject((_patch(model, "MixtralTopKRouter", _mixtral_not_renormalised), keywords))


def _ernie_bias_ignored(self, hidden_states):
    logits = F.linear(hidden_states.float(), self.weight.float())
    probabilities = F.softmax(logits, dim=1, dtype=torch.float)
    _, chosen = torch.topk(probabilities, self.top_k, dim=-1)        # the bug: moe_statics' bias left out
    weights = torch.gather(probabilities, dim=-1, index=chosen)
    weights = weights / torch.clamp(weights.sum(dim=-1, keepdim=True), min=self.norm_min)
    return logits, weights.to(hidden_states.dtype), chosen


@bug("MODEL-ROUTING", "MODEL-LAYER-MOE", level="model",
     mechanism="Ernie 4.5-MoE's router chooses without its e_score_correction_bias")
def ernie_moe_bias_ignored():
    model, keywords = _build("Ernie4_5_Moe", **MOE, num_experts=4, moe_intermediate_size=16, moe_layer_start_index=0,
                             moe_num_shared_experts=1)
    return _subject((_patch(_trained_bias(model), "Ernie4_5_MoeTopKRouter", _ernie_bias_ignored), keywords))


@bug("MODEL-ROUTING", "MODEL-LAYER-MOE", level="model",
     mechanism="GLM-4-MoE's combine weights not multiplied by routed_scaling_factor")
def glm4_moe_scaling_factor_dropped():
    model, keywords = _build("Glm4Moe", **MOE, n_routed_experts=8, moe_intermediate_size=16, n_group=2, topk_group=1,
                             first_k_dense_replace=0, head_dim=8, routed_scaling_factor=2.5)
    for module in model.modules():      # the weights not multiplied by routed_scaling_factor
        if type(module).__name__ == "Glm4MoeTopkRouter":
            module.routed_scaling_factor = 1.0
    return _subject((_trained_bias(model), keywords))


def _granite_router_bf16(self, hidden_states):
    logits = F.linear(hidden_states.bfloat16(), self.weight.bfloat16()).float()   # the bug: the router in bf16
    top_logits, top_index = logits.topk(self.top_k, dim=-1)
    return logits, torch.softmax(top_logits, dim=-1).type_as(hidden_states), top_index


@bug("MODEL-PRECISION", level="model",
     mechanism="GraniteMoE's router computes its logits in bfloat16 inside a float32 model")
def granitemoe_router_in_bf16():
    model, keywords = _build("GraniteMoe", **MOE, num_local_experts=4)
    return _subject((_patch(model, "GraniteMoeTopKRouter", _granite_router_bf16), keywords))


@bug("MODEL-LAYER-ATTENTION", level="model",
     mechanism="Phi-3's LongRoPE keeps the short factors past the trained length")
def phi3_longrope_short_factors_past_trained_length():
    model, keywords = _build("Phi3", original_max_position_embeddings=16, rope_parameters=dict(LONGROPE))
    rotary = model.model.rotary_emb
    rotary.long_inv_freq = rotary.original_inv_freq.clone()   # the long factors never used
    return _subject((model, keywords))


@bug("MODEL-LAYER-ATTENTION", level="model",
     mechanism="StableLM rotates every feature where partial_rotary_factor says a quarter")
def stablelm_full_rotary():
    model, keywords = _build("StableLm")
    for layer in model.model.layers:    # every feature rotated where partial_rotary_factor says a quarter
        layer.self_attn.rotary_ndims = layer.self_attn.head_dim
    rotary = model.model.rotary_emb
    dim = model.config.hidden_size // model.config.num_attention_heads
    with torch.no_grad():
        full = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    rotary.inv_freq = full
    rotary.original_inv_freq = full.clone()
    return _subject((model, keywords))


def _rotary_table_cached(self, x, position_ids):
    """A rotary module that computes its cos/sin table once, in the dtype of its first call, and indexes it after."""
    table = getattr(self, "table", None)
    if table is None:
        positions = torch.arange(self.original_max_seq_len, device=x.device, dtype=torch.float)
        angles = positions[:, None] * self.inv_freq.float()[None, :]
        angles = torch.cat((angles, angles), dim=-1)
        self.table = table = ((angles.cos() * self.attention_scaling).to(x.dtype),
                              (angles.sin() * self.attention_scaling).to(x.dtype))   # kept as a plain attribute
    return table[0][position_ids].to(x.dtype), table[1][position_ids].to(x.dtype)


@bug("MODEL-HISTORY", level="model",
     mechanism="a bfloat16 Llama's rotary table, cached at its first call, kept in bfloat16 after .to(float64)")
def rotary_table_kept_after_cast():
    model, keywords = _build("Llama", torch.bfloat16)
    return _subject((_patch(model, "LlamaRotaryEmbedding", _rotary_table_cached), keywords))


@bug("MODEL-HISTORY", "MODEL-LAYER-ATTENTION", level="model",
     mechanism="dynamic NTK's base, enlarged by an input past max_position_embeddings, never restored (transformers #25306)")
def dynamic_ntk_never_restored():
    model, keywords = _build("Llama", rope_parameters=dict(DYNAMIC))
    # transformers #25306: the base enlarged by a call past max_position_embeddings is kept for every later call
    model.model.rotary_emb.original_max_seq_len = 10 ** 9
    return _subject((model, keywords))


@bug("MODEL-LAYER-ENDS", level="model",
     mechanism="Gemma's token embeddings not multiplied by √hidden_size")
def gemma_embeddings_unscaled():
    model, keywords = _build("Gemma", head_dim=8)
    with torch.no_grad():   # a port that forgets Gemma's √hidden_size on the token embeddings
        model.model.embed_tokens.embed_scale.fill_(1.0)
    model.model.embed_tokens.scalar_embed_scale = 1.0
    return _subject((model, keywords))


@bug("MODEL-PADDING-IDS", level="model",
     mechanism="pad = eos, padding taken from input_ids != pad_token_id: real eos tokens dropped")
def padding_from_ids():
    """pad = eos; the model ANDs the attention mask with ``input_ids != pad_token_id``: every real eos is dropped."""
    model, keywords = _build("Llama", pad_token_id=2, eos_token_id=2)
    inner = model.forward

    def forward(input_ids=None, attention_mask=None, **kwargs):
        if input_ids is not None and attention_mask is not None:   # the bug: padding inferred from the ids
            attention_mask = attention_mask.clone()
            attention_mask[:, -input_ids.shape[1]:] *= (input_ids != model.config.pad_token_id).to(attention_mask)
        return inner(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
    model.forward = forward
    return _subject((model, keywords))


def _jitter_always(self, hidden_states):
    batch_size, sequence_length, hidden_dim = hidden_states.shape
    if self.jitter_noise > 0:   # the bug: `self.training and` lost, the router jitter multiplies in eval too
        hidden_states = hidden_states * torch.empty_like(hidden_states).uniform_(1.0 - self.jitter_noise,
                                                                                 1.0 + self.jitter_noise)
    hidden_states = hidden_states.view(-1, hidden_dim)
    _, weights, experts = self.gate(hidden_states)
    return self.experts(hidden_states, experts, weights).reshape(batch_size, sequence_length, hidden_dim)


@bug("MODEL-DETERMINISM", level="model",
     mechanism="Mixtral's router jitter noise applied in eval mode")
def router_jitter_in_eval():
    model, keywords = _build("Mixtral", **MOE, num_local_experts=4, router_jitter_noise=0.1)
    return _subject((_patch(model, "MixtralSparseMoeBlock", _jitter_always), keywords))
