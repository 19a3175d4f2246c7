"""The config's declarations, read and computed right: the float64 rotary formulas (properties/core/rotary.py) agree
with transformers' float32 implementation of every scaling type; the routing rules (properties/core/routing.py) choose
and weight as transformers' routers do, family by family; hf_subject reads each family's per-layer settings (windows,
NoPE layers, bases per layer type, scales, soft caps, unit-offset norms, routing biases on child modules) and names
what it cannot read. In-process, on tiny configs: a few seconds."""
from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("transformers", reason="transformers not installed (pip install 'transformer-zoo[hf]')")

import transformers as t  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

from properties.adapters import hf_subject  # noqa: E402
from properties.adapters.moe import moe_blocks  # noqa: E402
from properties.core.rotary import attention_factor, frequencies  # noqa: E402
from properties.core.routing import RoutingRule, route  # noqa: E402

BASE = dict(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16},
    "yarn_mscale": {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 16, "mscale": 1.0,
                    "mscale_all_dim": 0.707, "beta_fast": 24, "beta_slow": 2},
    "yarn_untruncated": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                         "truncate": False},
    "longrope": {"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 4.0],
                 "long_factor": [2.0, 3.0, 5.0, 8.0, 12.0, 20.0, 30.0, 40.0], "original_max_position_embeddings": 16},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16},
}


def _subject(model_class, config, **keywords):
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return hf_subject(model_class(config), **keywords)


@pytest.mark.parametrize("name", sorted(SCALINGS))
def test_rotary_formulas_agree_with_transformers(name):
    config = t.LlamaConfig(**BASE, rope_parameters={**SCALINGS[name], "rope_theta": 10000.0})
    declared = _subject(t.LlamaForCausalLM, config).declared.attention[0].rotary
    assert declared.kind == SCALINGS[name]["rope_type"]
    for length in (8, 17, 100):     # below and past the trained length; past max_position_embeddings (dynamic)
        theirs, factor = ROPE_INIT_FUNCTIONS[declared.kind](config, None, seq_len=length)
        ours = frequencies(declared, length)
        # transformers computes in float32: a few roundings of each frequency
        torch.testing.assert_close(ours, theirs.double(), rtol=1e-6, atol=0)
        assert math.isclose(attention_factor(declared), factor, rel_tol=1e-12), (name, length)


def test_yarn_attention_factor_is_the_papers():
    config = t.LlamaConfig(**BASE, rope_parameters={**SCALINGS["yarn"], "rope_theta": 10000.0})
    rotary = _subject(t.LlamaForCausalLM, config).declared.attention[0].rotary
    assert math.isclose(attention_factor(rotary), 0.1 * math.log(8.0) + 1.0)   # YaRN §3.4: √(1/t) = 0.1 ln s + 1


ROUTERS = {   # family: (model class, config, the router's class name)
    "mixtral": (t.MixtralForCausalLM, t.MixtralConfig(**BASE, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": (t.Qwen2MoeForCausalLM, t.Qwen2MoeConfig(**BASE, num_experts=4, num_experts_per_tok=2,
                                                          moe_intermediate_size=16, norm_topk_prob=True,
                                                          shared_expert_intermediate_size=16)),
    "qwen3_moe": (t.Qwen3MoeForCausalLM, t.Qwen3MoeConfig(**BASE, num_experts=4, num_experts_per_tok=2,
                                                          moe_intermediate_size=16, norm_topk_prob=False)),
    "olmoe": (t.OlmoeForCausalLM, t.OlmoeConfig(**BASE, num_experts=4, num_experts_per_tok=2)),
    "granitemoe": (t.GraniteMoeForCausalLM, t.GraniteMoeConfig(**BASE, num_local_experts=4, num_experts_per_tok=2)),
    "jamba": (t.JambaForCausalLM, t.JambaConfig(**BASE, num_experts=4, num_experts_per_tok=2, attn_layer_period=2,
                                                attn_layer_offset=1, expert_layer_period=1, expert_layer_offset=0,
                                                mamba_d_state=4, mamba_d_conv=2, mamba_expand=2)),
    "ernie4_5_moe": (t.Ernie4_5_MoeForCausalLM, t.Ernie4_5_MoeConfig(**BASE, num_experts=4, num_experts_per_tok=2,
                                                                     moe_intermediate_size=16, moe_layer_start_index=0,
                                                                     moe_num_shared_experts=1)),
    "glm4_moe": (t.Glm4MoeForCausalLM, t.Glm4MoeConfig(**BASE, n_routed_experts=8, num_experts_per_tok=2,
                                                       moe_intermediate_size=16, n_group=2, topk_group=1,
                                                       first_k_dense_replace=0, routed_scaling_factor=2.5)),
    "deepseek_v3": (t.DeepseekV3ForCausalLM, t.DeepseekV3Config(
        **BASE | dict(num_key_value_heads=4), n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
        n_group=4, topk_group=2, first_k_dense_replace=0, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8, head_dim=8, norm_topk_prob=True, routed_scaling_factor=2.5)),
}


@pytest.mark.parametrize("family", sorted(ROUTERS))
def test_routing_rules_choose_and_weight_as_transformers_routers(family):
    model_class, config = ROUTERS[family]
    s = _subject(model_class, config)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():   # trained-looking correction biases: the choice is then not plain top-k
        for name, tensor in [*s.module.named_parameters(), *s.module.named_buffers()]:
            if name.endswith("e_score_correction_bias"):
                tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.3)
    blocks = s.declared.experts
    assert blocks, s.declared.not_checked
    x = torch.randn(64, config.hidden_size, generator=generator)
    routers = {name: router for name, _, router, _ in moe_blocks(s.module)}
    for block in blocks:
        router = routers[block.name]
        with torch.no_grad():
            logits, weights, chosen = router(x)
        ours = route(logits.double(), block.rule)
        clear = ours.margin > 1e-5
        assert clear.sum() > 32
        order = chosen.sort(1)
        assert torch.equal(order.values[clear], ours.chosen[clear]), family
        torch.testing.assert_close(weights.gather(1, order.indices).double()[clear], ours.weights[clear], rtol=1e-5,
                                   atol=1e-6)


def test_a_routing_rule_of_an_unknown_family_is_not_assumed():
    rule = RoutingRule(2, "sigmoid", True, bias=torch.zeros(4), groups=2, groups_kept=1)
    routed = route(torch.randn(5, 4, generator=torch.Generator().manual_seed(0)), rule)
    assert routed.chosen.shape == (5, 2) and torch.allclose(routed.weights.sum(1), torch.ones(5, dtype=torch.float64))
    assert (routed.chosen // 2 == routed.chosen[:, :1] // 2).all()   # both experts in the one kept group


def test_hf_subject_reads_what_each_layer_declares():
    gemma3 = _subject(t.Gemma3ForCausalLM, t.Gemma3TextConfig(
        **BASE | dict(num_hidden_layers=3), head_dim=16, sliding_window=4, sliding_window_pattern=2,
        query_pre_attn_scalar=32, attn_logit_softcapping=20.0))
    layers = gemma3.declared.attention
    assert [a.window for a in layers] == [4, None, 4]
    assert [a.rotary.base for a in layers] == [10000.0, 1000000.0, 10000.0]   # local and global bases
    assert all(math.isclose(a.scale, 32 ** -0.5) and a.softcap == 20.0 for a in layers)
    assert all(n.unit_offset for n in gemma3.declared.norms) and layers[0].q_norm.unit_offset
    exaone = _subject(t.Exaone4ForCausalLM, t.Exaone4Config(**BASE, sliding_window=4, sliding_window_pattern=2))
    # EXAONE 4 keeps sliding_window on every layer's module and marks the windowed ones is_sliding; its global layers
    # take no rotary embedding (NoPE)
    assert exaone.window == (4, None)
    assert [a.window for a in exaone.declared.attention] == [4, None]
    assert [a.rotary is None for a in exaone.declared.attention] == [False, True]
    granite = _subject(t.GraniteForCausalLM, t.GraniteConfig(**BASE, attention_multiplier=0.25))
    assert granite.declared.attention[0].scale == 0.25
    cohere = _subject(t.CohereForCausalLM, t.CohereConfig(**BASE))
    assert cohere.declared.attention[0].rotary.interleaved and cohere.declared.ends.logit_scale == 0.0625
    gemma2 = _subject(t.Gemma2ForCausalLM, t.Gemma2Config(**BASE, head_dim=16, final_logit_softcapping=30.0))
    assert gemma2.declared.ends.logit_softcap == 30.0 and gemma2.declared.ends.embedding_scale == 8.0   # √64
    stablelm = _subject(t.StableLmForCausalLM, t.StableLmConfig(**BASE))
    assert stablelm.declared.attention[0].rotary.dim == 4 and stablelm.declared.norms[0].kind == "layer"


def test_hf_subject_names_what_it_cannot_read():
    _, config = ROUTERS["deepseek_v3"]
    deepseek = _subject(t.DeepseekV3ForCausalLM, config)
    assert any("layer 0's attention (DeepseekV3Attention" in n for n in deepseek.declared.not_checked)
    assert deepseek.declared.experts and deepseek.declared.experts[0].rule.bias is not None
    gpt2 = _subject(t.GPT2LMHeadModel, t.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2))
    assert not gpt2.declared.attention and "GPT2Attention" in gpt2.declared.not_checked[0]
    ernie = _subject(*ROUTERS["ernie4_5_moe"])
    # the correction bias sits on a child of the router (moe_statics): read from the whole router
    assert ernie.declared.experts[0].rule.bias is not None
    rule = ernie.declared.experts[0].rule
    assert rule.normalized and rule.scoring == "softmax" and rule.k == 2
