"""MODEL-ROTARY-ANGLES over the rotary tables of many Hugging Face architectures: no false alarm.

    python examples/rotary_tables.py [NAME ...]      # needs the [hf] extra (transformers); about 10 s

Builds each model offline from a small config (one layer, hidden size 64, max_len 4096 unless the case says
otherwise, random weights) in float32, bfloat16 and float16, and runs the clause on it as the suite does
(``hf_subject``, then the clause body). Prints one line per model and dtype: pass, skip with the reason, or the
clause's failure; exits 1 on any failure. tests/test_scale.py runs every case.
"""
from __future__ import annotations

import sys
import warnings

import pytest
import torch

from properties.adapters import hf_subject, require_transformers
from properties.model.subjects import build_model_under_test
from properties.model.test_rotary import test_rotary_tables_hold_the_angles_at_every_position as rotary_clause

t = require_transformers()

SIZES = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
             max_position_embeddings=4096, pad_token_id=0)
KV = dict(num_key_value_heads=2)
CASES = {   # name -> (model class, config class, config options)
    "llama": ("LlamaForCausalLM", "LlamaConfig", KV),
    "llama-theta-5e5": ("LlamaForCausalLM", "LlamaConfig", dict(KV, rope_theta=500000.0)),
    "llama-linear": ("LlamaForCausalLM", "LlamaConfig", dict(KV, rope_scaling={"rope_type": "linear", "factor": 4.0})),
    "llama-dynamic": ("LlamaForCausalLM", "LlamaConfig", dict(KV, max_position_embeddings=1024, rope_scaling={
        "rope_type": "dynamic", "factor": 4.0})),
    "llama-yarn": ("LlamaForCausalLM", "LlamaConfig", dict(KV, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024})),
    "llama3": ("LlamaForCausalLM", "LlamaConfig", dict(KV, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 1024})),
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(KV, sliding_window=16)),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", dict(KV, num_local_experts=2)),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", KV),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(KV, head_dim=16)),
    "gemma": ("GemmaForCausalLM", "GemmaConfig", dict(KV, head_dim=16)),
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", dict(KV, head_dim=16)),
    "gpt-neox-partial": ("GPTNeoXForCausalLM", "GPTNeoXConfig", dict(rotary_pct=0.25)),
    "phi": ("PhiForCausalLM", "PhiConfig", dict(partial_rotary_factor=0.5)),
    "phi3-longrope": ("Phi3ForCausalLM", "Phi3Config", dict(original_max_position_embeddings=1024, rope_scaling={
        "type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8})),
    "stablelm": ("StableLmForCausalLM", "StableLmConfig", {}),
    "falcon": ("FalconForCausalLM", "FalconConfig", dict(alibi=False, new_decoder_architecture=True, num_kv_heads=2)),
    "cohere-interleaved": ("CohereForCausalLM", "CohereConfig", KV),
    "olmo": ("OlmoForCausalLM", "OlmoConfig", KV),
    "starcoder2": ("Starcoder2ForCausalLM", "Starcoder2Config", KV),
    "glm": ("GlmForCausalLM", "GlmConfig", dict(KV, head_dim=16)),
    # fixed sin/cos tables, not Hugging Face's inv_freq form: the clause skips them with its reason
    "gptj": ("GPTJForCausalLM", "GPTJConfig", dict(n_embd=64, n_layer=1, n_head=4, n_positions=4096, rotary_dim=8)),
}


def factory(name: str, dtype: torch.dtype):
    model_class, config_class, options = CASES[name]
    config = getattr(t, config_class)(**options if name == "gptj" else {**SIZES, **options})

    def make():
        with torch.random.fork_rng():
            torch.manual_seed(0)
            model = getattr(t, model_class)(config)
        return hf_subject(model.to(dtype).eval())
    return make


def main(names: list[str]) -> int:
    unknown = sorted(set(names) - set(CASES))
    if unknown:
        print(f"unknown case(s) {unknown}; choose from {sorted(CASES)}", file=sys.stderr)
        return 2
    failures = 0
    for name in names or CASES:
        if not hasattr(t, CASES[name][0]):
            print(f"{name:20s} not in this transformers ({t.__version__})")
            continue
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                mut = build_model_under_test(factory(name, dtype))
            try:
                rotary_clause(mut=mut)
                verdict = "pass"
            except pytest.skip.Exception as exc:
                verdict = f"skip: {exc}"
            except AssertionError as exc:
                failures, verdict = failures + 1, f"FAIL: {exc}"
            print(f"{name:20s} {str(dtype).removeprefix('torch.'):9s} {verdict}", flush=True)
    print(f"{failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
