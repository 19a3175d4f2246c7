"""Hugging Face architectures at a tiny size, random weights, no download: the conformance run's models.

    pytest properties/ -m model --model examples/conformance.py:llama_eager
    python -m properties.adapters.conformance          # every factory below, as a table

Every public function here is a factory (the conformance runner lists them): hidden size 32, 2 layers,
vocabulary 64, at most 16 to 32 positions. The ``*_bf16`` variants are the same models in bfloat16 (the
clauses that compare two evaluations still run on a float64 copy). Weights are drawn from a fixed seed, so
the suite's float64 twin (a second call) is the same model. With ``CONFORMANCE_MAX_LEN=N`` in the environment
(the runner's second run, ``--long N``) every model takes N positions instead.
"""
from __future__ import annotations

import os

import torch

from properties.adapters import hf_subject, require_transformers

t = require_transformers()

F32, BF16 = torch.float32, torch.bfloat16
LONG = int(os.environ.get("CONFORMANCE_MAX_LEN") or 0)   # python -m properties.adapters.conformance --long N
VOCAB, MAX_LEN, DECODER_LEN = 64, LONG or 16, LONG or 32
SPECIAL = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
DECODER = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=DECODER_LEN, **SPECIAL)
SEQ2SEQ = dict(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
               decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=MAX_LEN,
               decoder_start_token_id=2, **SPECIAL)


def _build(model_class, config, dtype, subject=None, **init):
    """hf_subject of model_class(config, **init) in dtype, weights from seed 0; ``subject``: hf_subject's keywords."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = model_class(config, **init)
    return hf_subject(model.to(dtype).eval(), **(subject or {}))


# ------------------------------------------------------------------------------------------ decoders
def gpt2(dtype=F32):
    return _build(t.GPT2LMHeadModel, t.GPT2Config(vocab_size=VOCAB, n_positions=MAX_LEN, n_embd=32, n_layer=2,
                                                  n_head=2, **SPECIAL), dtype)


def llama_eager(dtype=F32, attn="eager"):
    return _build(t.LlamaForCausalLM, t.LlamaConfig(**DECODER, num_key_value_heads=2, attn_implementation=attn), dtype)


def llama_sdpa(dtype=F32):
    return llama_eager(dtype, attn="sdpa")


def mistral(dtype=F32):
    return _build(t.MistralForCausalLM, t.MistralConfig(**DECODER, num_key_value_heads=2, sliding_window=8), dtype)


def qwen2(dtype=F32):
    return _build(t.Qwen2ForCausalLM, t.Qwen2Config(**DECODER, num_key_value_heads=2), dtype)


def gpt_neox(dtype=F32):
    return _build(t.GPTNeoXForCausalLM, t.GPTNeoXConfig(**DECODER), dtype)


def opt(dtype=F32):
    return _build(t.OPTForCausalLM, t.OPTConfig(vocab_size=VOCAB, hidden_size=32, word_embed_proj_dim=32, ffn_dim=64,
                                                num_hidden_layers=2, num_attention_heads=2,
                                                max_position_embeddings=MAX_LEN, **SPECIAL), dtype)


def phi(dtype=F32):
    return _build(t.PhiForCausalLM, t.PhiConfig(**DECODER), dtype)


def gemma2(dtype=F32):   # sliding and global layers alternate; soft-capped scores; eager attention
    return _build(t.Gemma2ForCausalLM, t.Gemma2Config(**DECODER, num_key_value_heads=2, head_dim=8, sliding_window=4,
                                                      attn_implementation="eager"), dtype)


def bloom(dtype=F32):    # ALiBi, positions from the mask; no length in its config (ALiBi has no limit): max_len given
    return _build(t.BloomForCausalLM, t.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4, **SPECIAL),
                  dtype, subject=dict(max_len=DECODER_LEN))


def mpt(dtype=F32):      # ALiBi; its length is max_seq_len
    return _build(t.MptForCausalLM, t.MptConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, expansion_ratio=2,
                                                max_seq_len=DECODER_LEN, **SPECIAL), dtype)


def gpt_neo(dtype=F32):  # a global and a local layer, the local one with a window of 4 positions
    return _build(t.GPTNeoForCausalLM, t.GPTNeoConfig(vocab_size=VOCAB, max_position_embeddings=MAX_LEN, hidden_size=32,
                                                      num_layers=2, num_heads=2, intermediate_size=64, window_size=4,
                                                      attention_types=[[["global", "local"], 1]], **SPECIAL), dtype)


# ------------------------------------------- per-layer windows (MODEL-WINDOW checks each windowed layer alone)
def gemma3(dtype=F32):   # five sliding layers to one global, as Gemma 3 ships; a window of 4
    return _build(t.Gemma3ForCausalLM, t.Gemma3TextConfig(**DECODER | dict(num_hidden_layers=3), num_key_value_heads=2,
                                                          head_dim=8, sliding_window=4, sliding_window_pattern=2,
                                                          attn_implementation="eager"), dtype)


def qwen2_window(dtype=F32):   # max_window_layers=1: layer 0 attends everything, layer 1 a window of 4
    return _build(t.Qwen2ForCausalLM, t.Qwen2Config(**DECODER, num_key_value_heads=2, use_sliding_window=True,
                                                    sliding_window=4, max_window_layers=1), dtype)


# --------------------------------------------------------- mixture of experts (MODEL-ROUTING; float64 twin eager)
MOE = dict(DECODER, num_key_value_heads=2, num_experts_per_tok=2)


def mixtral(dtype=F32):  # 4 experts, top 2, weights renormalised over the chosen ones (Mixtral's router)
    return _build(t.MixtralForCausalLM, t.MixtralConfig(**MOE, num_local_experts=4), dtype)


def qwen3_moe(dtype=F32):  # norm_topk_prob=False: the chosen experts' softmax probabilities as they are
    return _build(t.Qwen3MoeForCausalLM, t.Qwen3MoeConfig(**MOE, num_experts=4, moe_intermediate_size=16, head_dim=8,
                                                          norm_topk_prob=False), dtype)


def olmoe(dtype=F32):
    return _build(t.OlmoeForCausalLM, t.OlmoeConfig(**MOE, num_experts=4), dtype)


def qwen2_moe(dtype=F32):   # a shared expert beside the routed ones, gated by a sigmoid
    return _build(t.Qwen2MoeForCausalLM, t.Qwen2MoeConfig(**MOE, num_experts=4, moe_intermediate_size=16,
                                                          shared_expert_intermediate_size=16), dtype)


# ---------------------- settings declared per layer, rotary scalings, biased routers (MODEL-LAYER-*, MODEL-ROUTING)
def _trained_router_bias(subject, scale=0.3):
    """e_score_correction_bias as training leaves it (zeros at initialisation: the choice would be plain top-k)."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, tensor in [*subject.module.named_parameters(), *subject.module.named_buffers()]:
            if name.endswith("e_score_correction_bias"):
                tensor.copy_(torch.randn(tensor.shape, generator=generator) * scale)
    return subject


def llama_yarn(dtype=F32):   # YaRN: factor 4 over a trained length of 8, attention factor 0.1 ln 4 + 1
    return _build(t.LlamaForCausalLM, t.LlamaConfig(**LLAMA_LIKE, rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "rope_theta": 10000.0}), dtype)


def llama3_rope(dtype=F32):  # Llama 3.1's wavelength-dependent scaling
    return _build(t.LlamaForCausalLM, t.LlamaConfig(**LLAMA_LIKE, rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8, "rope_theta": 500000.0}), dtype)


def llama_dynamic(dtype=F32):  # dynamic NTK: the base grows past max_position_embeddings
    return _build(t.LlamaForCausalLM, t.LlamaConfig(**LLAMA_LIKE, rope_parameters={
        "rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}), dtype)


def phi3_longrope(dtype=F32):  # LongRoPE: short factors up to 16 positions, long ones past
    return _build(t.Phi3ForCausalLM, t.Phi3Config(**LLAMA_LIKE, original_max_position_embeddings=DECODER_LEN // 2,
                                                  rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                                   "short_factor": [1.0, 1.2, 1.5, 2.0],
                                                                   "long_factor": [1.5, 3.0, 6.0, 12.0]}), dtype)


def exaone4(dtype=F32):     # a window of 4 on layer 0, a global layer without rotary (NoPE) on layer 1
    return _build(t.Exaone4ForCausalLM, t.Exaone4Config(**LLAMA_LIKE, sliding_window=4, sliding_window_pattern=2),
                  dtype)


def granitemoe(dtype=F32):  # attention_multiplier for the scale; softmax over the top-2 logits
    return _build(t.GraniteMoeForCausalLM, t.GraniteMoeConfig(**MOE, num_local_experts=4, attention_multiplier=0.25),
                  dtype)


def ernie4_5_moe(dtype=F32):  # softmax plus a correction bias (on the router's child moe_statics), a shared expert
    return _trained_router_bias(_build(t.Ernie4_5_MoeForCausalLM, t.Ernie4_5_MoeConfig(
        **MOE, num_experts=4, moe_intermediate_size=16, moe_layer_start_index=0, moe_num_shared_experts=1), dtype))


def glm4_moe(dtype=F32):    # sigmoid scores + bias, the best 1 of 2 groups, routed_scaling_factor, partial rotary
    return _trained_router_bias(_build(t.Glm4MoeForCausalLM, t.Glm4MoeConfig(
        **MOE, n_routed_experts=8, moe_intermediate_size=16, n_group=2, topk_group=1, first_k_dense_replace=0,
        head_dim=8, routed_scaling_factor=2.5), dtype))


def deepseek_v3(dtype=F32):  # the same router; multi-head latent attention (its attention is named not checked)
    return _trained_router_bias(_build(t.DeepseekV3ForCausalLM, t.DeepseekV3Config(
        **MOE | dict(num_key_value_heads=4), n_routed_experts=8, moe_intermediate_size=16, n_group=2, topk_group=1,
        first_k_dense_replace=0, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=8, head_dim=8, routed_scaling_factor=2.5), dtype))


def jamba(dtype=F32):       # Mamba and attention layers, experts (not renormalised) in every layer
    return _build(t.JambaForCausalLM, t.JambaConfig(**MOE, num_experts=4, attn_layer_period=2, attn_layer_offset=1,
                                                    expert_layer_period=1, expert_layer_offset=0, mamba_d_state=4,
                                                    mamba_d_conv=2, mamba_expand=2), dtype)


# ------------------------------ more decoders as a user builds them: a plain hf_subject(model), no keyword
LLAMA_LIKE = dict(DECODER, num_key_value_heads=2)


def qwen3(dtype=F32):       # q/k norms, layer_types all full attention
    return _build(t.Qwen3ForCausalLM, t.Qwen3Config(**LLAMA_LIKE, head_dim=8), dtype)


def olmo2(dtype=F32):       # norms after attention and MLP, q/k norms
    return _build(t.Olmo2ForCausalLM, t.Olmo2Config(**LLAMA_LIKE), dtype)


def stablelm(dtype=F32):    # partial rotary (25% of each head), LayerNorm
    return _build(t.StableLmForCausalLM, t.StableLmConfig(**LLAMA_LIKE), dtype)


def granite(dtype=F32):     # embedding, residual, attention and logit multipliers
    return _build(t.GraniteForCausalLM, t.GraniteConfig(**LLAMA_LIKE), dtype)


def cohere(dtype=F32):      # parallel attention and MLP, interleaved rotary, logit scale
    return _build(t.CohereForCausalLM, t.CohereConfig(**LLAMA_LIKE), dtype)


def starcoder2(dtype=F32):  # biases, LayerNorm, GELU MLP
    return _build(t.Starcoder2ForCausalLM, t.Starcoder2Config(**LLAMA_LIKE), dtype)


def phi3(dtype=F32):        # fused qkv and gate_up projections
    return _build(t.Phi3ForCausalLM, t.Phi3Config(**LLAMA_LIKE), dtype)


def gemma(dtype=F32):       # embeddings scaled by sqrt(hidden), (1 + w) RMSNorm, GeGLU
    return _build(t.GemmaForCausalLM, t.GemmaConfig(**LLAMA_LIKE, head_dim=8), dtype)


def glm(dtype=F32):         # partial interleaved rotary
    return _build(t.GlmForCausalLM, t.GlmConfig(**LLAMA_LIKE, head_dim=8), dtype)


def cohere2(dtype=F32):     # sliding layers and a global one every 4th (layer_types), a window of 4
    return _build(t.Cohere2ForCausalLM, t.Cohere2Config(**LLAMA_LIKE | dict(num_hidden_layers=4), sliding_window=4),
                  dtype)


def olmo3(dtype=F32):       # sliding and full layers (layer_types), a window of 4
    return _build(t.Olmo3ForCausalLM, t.Olmo3Config(**LLAMA_LIKE | dict(num_hidden_layers=4), sliding_window=4),
                  dtype)


def xglm(dtype=F32):        # fairseq's sinusoidal positions, a table that regrows past max_len
    return _build(t.XGLMForCausalLM, t.XGLMConfig(vocab_size=VOCAB, d_model=32, ffn_dim=64, num_layers=2,
                                                  attention_heads=4, max_position_embeddings=DECODER_LEN, **SPECIAL),
                  dtype)


# ------------------------------------------------------------------------------------------ encoders
def bert(dtype=F32):
    return _build(t.BertModel, t.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                            intermediate_size=64, max_position_embeddings=MAX_LEN, type_vocab_size=1,
                                            pad_token_id=0), dtype)  # with its pooler, as BertModel is built by default


def distilbert(dtype=F32):
    return _build(t.DistilBertModel, t.DistilBertConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=2, hidden_dim=64,
                                                        max_position_embeddings=MAX_LEN, pad_token_id=0), dtype)


def roberta(dtype=F32):  # positions padding_idx + 1 ... over the real tokens: 16 + 2 rows
    return _build(t.RobertaModel, t.RobertaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                                  num_attention_heads=2, intermediate_size=64, type_vocab_size=1,
                                                  max_position_embeddings=MAX_LEN + 2, pad_token_id=1), dtype,
                  add_pooling_layer=False)


# ------------------ encoders whose guesses hf_subject checks against the model itself (properties/adapters/probe.py)
ENCODER = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)


def mpnet(dtype=F32):       # a learned absolute table (counted over real tokens, as RoBERTa's) and relative buckets
    return _build(t.MPNetForMaskedLM, t.MPNetConfig(**ENCODER, max_position_embeddings=MAX_LEN + 2,
                                                    pad_token_id=1), dtype)


def deberta_v2(dtype=F32):  # absolute positions added to the input and relative attention (c2p, p2c) together
    return _build(t.DebertaV2ForMaskedLM, t.DebertaV2Config(**ENCODER, max_position_embeddings=MAX_LEN,
                                                            relative_attention=True, position_biased_input=True,
                                                            pos_att_type=["p2c", "c2p"], position_buckets=8,
                                                            type_vocab_size=0, pad_token_id=0), dtype)


def longformer(dtype=F32):  # a local window of 2 keys on either side; the global projections unused without globals
    return _build(t.LongformerForMaskedLM, t.LongformerConfig(**ENCODER, max_position_embeddings=MAX_LEN + 2,
                                                              attention_window=4, pad_token_id=1), dtype,
                  subject=dict(unused_parameters="unreached"))


def bigbird(dtype=F32):     # full attention; the pooler under the masked-LM head is never called
    return _build(t.BigBirdForMaskedLM, t.BigBirdConfig(**ENCODER, max_position_embeddings=MAX_LEN,
                                                        attention_type="original_full", pad_token_id=0), dtype)


def squeezebert(dtype=F32):  # grouped 1x1 convolutions for the projections; an unused pooler
    return _build(t.SqueezeBertForMaskedLM, t.SqueezeBertConfig(**ENCODER, embedding_size=32,
                                                                max_position_embeddings=MAX_LEN, pad_token_id=0),
                  dtype)


def modernbert(dtype=F32):   # local attention of 8 (4 keys on either side) every other layer, rotary
    return _build(t.ModernBertForMaskedLM, t.ModernBertConfig(**ENCODER, max_position_embeddings=MAX_LEN,
                                                              local_attention=8, global_attn_every_n_layers=2,
                                                              cls_token_id=1, sep_token_id=2, **SPECIAL), dtype)


# ---------------------------------------------------------------------------------- encoder-decoders
def t5(dtype=F32):
    return _build(t.T5ForConditionalGeneration, t.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2, relative_attention_num_buckets=8,
        relative_attention_max_distance=MAX_LEN, decoder_start_token_id=0, **SPECIAL), dtype)


def m2m100(dtype=F32):      # fairseq's sinusoidal positions that regrow past max_len, on both sides
    return _build(t.M2M100ForConditionalGeneration, t.M2M100Config(**SEQ2SEQ), dtype)


def bart(dtype=F32):
    return _build(t.BartForConditionalGeneration, t.BartConfig(**SEQ2SEQ, forced_eos_token_id=None), dtype)


def marian(dtype=F32):
    return _build(t.MarianMTModel, t.MarianConfig(**SEQ2SEQ), dtype)


# ------------------------------------------------------------------------------------ bfloat16 twins
# One line each: the same factories in bfloat16 (each a top-level function, as the conformance run finds them).
def gpt2_bf16(): return gpt2(BF16)
def llama_eager_bf16(): return llama_eager(BF16)
def llama_sdpa_bf16(): return llama_sdpa(BF16)
def mistral_bf16(): return mistral(BF16)
def qwen2_bf16(): return qwen2(BF16)
def gpt_neox_bf16(): return gpt_neox(BF16)
def opt_bf16(): return opt(BF16)
def phi_bf16(): return phi(BF16)
def gpt_neo_bf16(): return gpt_neo(BF16)
def gemma2_bf16(): return gemma2(BF16)
def bloom_bf16(): return bloom(BF16)
def mpt_bf16(): return mpt(BF16)
def bert_bf16(): return bert(BF16)
def distilbert_bf16(): return distilbert(BF16)
def roberta_bf16(): return roberta(BF16)
def t5_bf16(): return t5(BF16)
def bart_bf16(): return bart(BF16)
def marian_bf16(): return marian(BF16)
def gemma3_bf16(): return gemma3(BF16)
def qwen2_window_bf16(): return qwen2_window(BF16)
def mixtral_bf16(): return mixtral(BF16)
def qwen3_moe_bf16(): return qwen3_moe(BF16)
def olmoe_bf16(): return olmoe(BF16)
def qwen2_moe_bf16(): return qwen2_moe(BF16)
def qwen3_bf16(): return qwen3(BF16)
def olmo2_bf16(): return olmo2(BF16)
def stablelm_bf16(): return stablelm(BF16)
def granite_bf16(): return granite(BF16)
def cohere_bf16(): return cohere(BF16)
def starcoder2_bf16(): return starcoder2(BF16)
def phi3_bf16(): return phi3(BF16)
def gemma_bf16(): return gemma(BF16)
def glm_bf16(): return glm(BF16)
def cohere2_bf16(): return cohere2(BF16)
def olmo3_bf16(): return olmo3(BF16)
def xglm_bf16(): return xglm(BF16)
def mpnet_bf16(): return mpnet(BF16)
def deberta_v2_bf16(): return deberta_v2(BF16)
def longformer_bf16(): return longformer(BF16)
def bigbird_bf16(): return bigbird(BF16)
def squeezebert_bf16(): return squeezebert(BF16)
def modernbert_bf16(): return modernbert(BF16)
def llama_yarn_bf16(): return llama_yarn(BF16)
def llama3_rope_bf16(): return llama3_rope(BF16)
def llama_dynamic_bf16(): return llama_dynamic(BF16)
def phi3_longrope_bf16(): return phi3_longrope(BF16)
def exaone4_bf16(): return exaone4(BF16)
def granitemoe_bf16(): return granitemoe(BF16)
def ernie4_5_moe_bf16(): return ernie4_5_moe(BF16)
def glm4_moe_bf16(): return glm4_moe(BF16)
def deepseek_v3_bf16(): return deepseek_v3(BF16)
def jamba_bf16(): return jamba(BF16)
def m2m100_bf16(): return m2m100(BF16)
