"""hf_subject (properties/adapters/huggingface.py) reads a Hugging Face model right: kind, vocabulary, pad id,
length, padding claim, and a decode_step whose state carries over to the next step. A few factories of
examples/conformance.py, built and called directly (the conformance run itself takes minutes)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="transformers not installed (pip install 'transformer-zoo[hf]')")

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def conformance():
    spec = importlib.util.spec_from_file_location("_conformance_examples", ROOT / "examples" / "conformance.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# (factory, kind, pad_id, max_len, left_padding, extrapolates)
CASES = [
    ("llama_sdpa", "decoder_only", 0, 32, True, True),      # rotary; position ids from the mask
    ("gpt2", "decoder_only", 0, 16, True, False),           # learned table; position ids from the mask
    ("roberta", "encoder_only", 1, 16, True, False),        # positions counted over non-pad tokens, from 2
    ("bart", "encoder_decoder", 0, 16, False, False),
    ("bloom", "decoder_only", 0, 32, True, True),           # ALiBi computed for any length; max_len given
    ("mpt", "decoder_only", 0, 32, True, False),            # ALiBi tabulated for max_seq_len (its length's name)
    ("gemma2", "decoder_only", 0, 32, True, True),
]


@pytest.mark.parametrize("name,kind,pad,max_len,left,extrapolates", CASES, ids=[c[0] for c in CASES])
def test_hf_subject_fields(conformance, name, kind, pad, max_len, left, extrapolates):
    s = getattr(conformance, name)()
    assert (s.kind, s.vocab_size, s.pad_id, s.max_len) == (kind, 64, pad, max_len)
    assert (s.left_padding, s.extrapolates) == (left, extrapolates)
    assert s.module is not None and not s.module.training
    assert s.embedding in set(s.module.modules())
    assert (s.decode_step is None) == (kind == "encoder_only")


# (factory, relative_positions, window, shifted given)
POSITIONS = [
    ("llama_sdpa", True, None, True),
    ("gpt2", False, None, True),
    ("mistral", True, (8, 8), True),           # sliding_window, on every layer
    ("gemma2", True, (4, None), True),         # layer_types: sliding, full
    ("gpt_neo", False, (None, 4), True),       # attention_layers: global, local
    ("bloom", True, None, False),              # ALiBi from the mask: no position_ids to shift
    ("t5", True, None, False),
    ("gemma3", True, (4, None, 4), True),      # sliding_window_pattern 2: each module's own sliding_window
    ("qwen2_window", True, (None, 4), True),   # max_window_layers=1: the first layer full, the second windowed
    ("cohere2", True, (4, 4, 4, None), True),  # layer_types: a global layer every 4th
    ("xglm", False, None, True),               # fairseq's sinusoidal table: absolute positions
]


@pytest.mark.parametrize("name,relative,window,shifted", POSITIONS, ids=[c[0] for c in POSITIONS])
def test_hf_subject_reads_positions_and_windows(conformance, name, relative, window, shifted):
    s = getattr(conformance, name)()
    assert (s.relative_positions, s.window, s.shifted is not None) == (relative, window, shifted)


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "qwen2_window", "gpt_neo"])
def test_hf_subject_finds_each_layers_attention(conformance, name):
    # MODEL-WINDOW checks each windowed layer through its attention module: one per layer, the layer's own.
    s = getattr(conformance, name)()
    stack = next(m for m in s.module.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == len(s.window))
    assert s.attention_modules is not None and len(s.attention_modules) == len(s.window)
    assert all(any(a is m for m in block.modules()) for a, block in zip(s.attention_modules, stack))


@pytest.mark.parametrize("name,normalized", [("mixtral", True), ("qwen3_moe", False), ("olmoe", False)])
def test_hf_subject_reads_the_routers(conformance, name, normalized):
    # Each MoE layer is recorded once per forward pass: the router's logits, the experts and weights combined.
    s = getattr(conformance, name)()
    tokens = torch.randint(1, 64, (2, 5))
    with torch.no_grad(), s.routing() as routes:
        s.forward(tokens, torch.ones_like(tokens, dtype=torch.bool))
    assert len(routes) == 2 and all(r.top_k and r.normalized is normalized for r in routes)
    assert [tuple(r.logits.shape) + tuple(r.experts.shape) for r in routes] == [(10, 4, 10, 2)] * 2


def test_float64_twin_of_an_moe_model_runs_its_experts_eagerly(conformance):
    # grouped_mm, transformers' default for experts, refuses float64 on the CPU; the twin switches to eager.
    s = conformance.mixtral()
    s.module.to(torch.float64)
    tokens = torch.randint(1, 64, (1, 4))
    assert s.forward(tokens, None).dtype == torch.float64
    assert s.module.config._experts_implementation == "eager"


def test_regrowing_position_table_has_no_length_limit(conformance):
    s = conformance.xglm()
    assert s.extrapolates is True
    tokens = torch.randint(1, 64, (1, s.max_len + 3))
    assert s.forward(tokens, None).shape[1] == s.max_len + 3


def _tiny(model_class, config):
    from properties.adapters import hf_subject
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return hf_subject(model_class(config))


def test_hf_subject_guesses_what_the_config_says():
    import transformers as t
    gptj = _tiny(t.GPTJForCausalLM, t.GPTJConfig(vocab_size=64, n_positions=32, n_embd=32, n_layer=1, n_head=2,
                                                 rotary_dim=8))
    codegen = _tiny(t.CodeGenForCausalLM, t.CodeGenConfig(vocab_size=64, n_positions=32, n_ctx=32, n_embd=32,
                                                          n_layer=1, n_head=2, rotary_dim=8))
    for s in (gptj, codegen):   # rotary through a fixed sin/cos table: relative, but no extrapolation
        assert (s.max_len, s.relative_positions, s.extrapolates, s.left_padding) == (32, True, False, True)
    deberta = _tiny(t.DebertaV2Model, t.DebertaV2Config(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                                                         num_attention_heads=2, intermediate_size=64,
                                                         max_position_embeddings=32, relative_attention=True,
                                                         position_biased_input=False, position_buckets=8,
                                                         pos_att_type=["p2c", "c2p"]))
    assert (deberta.kind, deberta.relative_positions, deberta.left_padding, deberta.extrapolates) == \
        ("encoder_only", True, True, True)
    absolute = _tiny(t.DebertaV2Model, t.DebertaV2Config(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                                                          num_attention_heads=2, intermediate_size=64,
                                                          max_position_embeddings=32, relative_attention=True,
                                                          pos_att_type=["p2c", "c2p"]))
    assert (absolute.relative_positions, absolute.left_padding) == (False, False)   # position_biased_input
    dynamic = _tiny(t.LlamaForCausalLM, t.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                      num_hidden_layers=1, num_attention_heads=2,
                                                      max_position_embeddings=32,
                                                      rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                                       "rope_theta": 10000.0}))
    # relative below max_position_embeddings, past which its frequencies change: MODEL-SHIFT shifts below it
    assert dynamic.relative_positions and dynamic.extrapolates and dynamic.declared.length_thresholds == (32,)


def test_hf_subject_names_the_keyword_it_cannot_guess():
    import transformers as t
    from properties.core.subject import SubjectError
    with pytest.raises(SubjectError, match=r"BloomConfig names no maximum length \(none of max_position_embeddings, "
                                           r".*\); pass max_len=$"):
        _tiny(t.BloomForCausalLM, t.BloomConfig(vocab_size=64, hidden_size=32, n_layer=1, n_head=2))


def _inputs(b: int, length: int, seed: int):
    tokens = torch.randint(3, 64, (b, length), generator=torch.Generator().manual_seed(seed))
    return tokens, torch.ones(b, length, dtype=torch.bool)


@pytest.mark.parametrize("name", ["llama_sdpa", "bart"])
def test_decode_step_state_carries_over(conformance, name):
    s = conformance.__dict__[name]()
    tgt, mask = _inputs(2, 5, 0)
    src, src_mask = _inputs(2, 4, 1)
    with torch.no_grad():
        if s.kind == "encoder_decoder":
            full = s.forward(src, tgt, src_mask, mask)
            first, state = s.decode_step(src, tgt[:, :3], src_mask, mask[:, :3], None)
            second, state = s.decode_step(src, tgt[:, 3:], src_mask, mask, state)
        else:
            full = s.forward(tgt, mask)
            first, state = s.decode_step(tgt[:, :3], mask[:, :3], None)
            second, state = s.decode_step(tgt[:, 3:], mask, state)
    assert first.shape == (2, 3, 64) and second.shape == (2, 2, 64)
    torch.testing.assert_close(torch.cat([first, second], 1), full, rtol=1e-4, atol=1e-5)


def test_left_padding_positions_from_the_mask(conformance):
    s = conformance.llama_sdpa()
    tokens, mask = _inputs(1, 4, 2)
    padded = torch.cat([torch.zeros(1, 2, dtype=torch.long), tokens], 1)
    padded_mask = torch.cat([torch.zeros(1, 2, dtype=torch.bool), mask], 1)
    with torch.no_grad():
        torch.testing.assert_close(s.forward(padded, padded_mask)[:, 2:], s.forward(tokens, mask),
                                   rtol=1e-4, atol=1e-5)


def test_not_a_transformers_model():
    from properties.adapters import hf_subject
    from properties.core.subject import SubjectError
    with pytest.raises(SubjectError, match="PreTrainedModel"):
        hf_subject(torch.nn.Linear(2, 2))


def test_missing_transformers_names_the_extra(monkeypatch):
    import sys
    from properties.adapters import require_transformers
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers now raises ImportError
    with pytest.raises(ImportError, match=r"transformer-zoo\[hf\]"):
        require_transformers()


# (factory, attention layers read, MoE blocks read, whether a not-checked note names the attention, routing rule)
DECLARED = [
    ("llama_yarn", 2, 0, False, None),
    ("phi3_longrope", 2, 0, False, None),
    ("exaone4", 2, 0, False, None),
    ("granitemoe", 2, 2, False, "top 2 of softmax, renormalised"),
    ("ernie4_5_moe", 2, 2, False, "top 2 of softmax, + a correction bias for the choice, renormalised (sum clamped "
                                  "at 1e-12)"),
    ("glm4_moe", 2, 2, False, "top 2 of sigmoid, + a correction bias for the choice, in the best 1 of 2 groups, "
                              "renormalised, times 2.5"),
    ("deepseek_v3", 0, 2, True, "top 2 of sigmoid, + a correction bias for the choice, in the best 1 of 2 groups, "
                                "renormalised, times 2.5"),
    ("jamba", 1, 2, False, "top 2 of softmax, not renormalised"),
]


@pytest.mark.parametrize("name,attention,experts,unread,rule", DECLARED, ids=[c[0] for c in DECLARED])
def test_hf_subject_reads_each_part_the_config_declares(conformance, name, attention, experts, unread, rule):
    from properties.core.routing import describe_rule
    s = getattr(conformance, name)()
    assert (len(s.declared.attention), len(s.declared.experts)) == (attention, experts), s.declared.not_checked
    assert any("attention" in n for n in s.declared.not_checked) == unread, s.declared.not_checked
    assert all(describe_rule(block.rule) == rule for block in s.declared.experts)
    if experts:   # the routes MODEL-ROUTING checks carry the same rule
        tokens = torch.randint(3, 64, (1, 5))
        with torch.no_grad(), s.routing() as routes:
            s.forward(tokens, None)
        assert routes and all(describe_rule(r.rule) == rule for r in routes)
