"""hf_subject checks its uncertain guesses against the model itself (properties/adapters/probe.py): parameters that
forward never reaches, positions of two kinds, Longformer's half-width window. Tiny one-layer models built from a
config, random weights."""
from __future__ import annotations

import pytest
import torch

t = pytest.importorskip("transformers", reason="transformers not installed (pip install 'transformer-zoo[hf]')")

from properties.adapters import hf_subject  # noqa: E402
from properties.adapters.probe import reached_parameters  # noqa: E402
from properties.core.subject import SubjectError  # noqa: E402

ENCODER = dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)


def _model(model_class, config):
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return model_class(config).eval()


def _longformer():
    return _model(t.LongformerForMaskedLM, t.LongformerConfig(**ENCODER, max_position_embeddings=18,
                                                               attention_window=4, pad_token_id=1))


def test_unreached_parameters_stop_with_the_keyword_to_pass():
    # Longformer's global query/key/value projections serve only tokens a global_attention_mask marks.
    with pytest.raises(SubjectError, match=r"^hf_subject: forward does not reach 6 of \d+ parameters "
                                           r"\(longformer\.encoder\.layer\.0\.attention\.self\.query_global\.weight, .*"
                                           r"pass unused_parameters='unreached' \(or their names\)$"):
        hf_subject(_longformer())


def test_declared_unreached_parameters_and_the_half_width_window():
    s = hf_subject(_longformer(), unused_parameters="unreached")
    assert len(s.unused_parameters) == 6 and all("_global." in n for n in s.unused_parameters)
    # attention_window=4: 2 keys on either side and the query itself, Subject.window 3 (W - 1 on either side).
    assert s.window == (3,) and s.attention_modules is not None


def test_reached_parameters_are_read_from_the_graph_without_a_backward_pass():
    model = _longformer()
    reached = reached_parameters(model, lambda tokens, mask: model(input_ids=tokens, attention_mask=mask.long()).logits,
                                 6)
    assert "longformer.embeddings.position_embeddings.weight" in reached
    assert not any("_global" in name for name in reached)
    assert all(p.grad is None for p in model.parameters())


def test_an_unreached_pooler_under_a_head_is_declared_by_itself():
    bigbird = hf_subject(_model(t.BigBirdForMaskedLM, t.BigBirdConfig(**ENCODER, max_position_embeddings=16,
                                                                         attention_type="original_full")))
    assert bigbird.unused_parameters == ("bert.pooler.weight", "bert.pooler.bias")


def test_positions_of_two_kinds_are_absolute():
    # MPNet adds a learned table counted over the real tokens (as RoBERTa's) and a T5-style relative bias: its
    # config names relative buckets, but the probe reaches the absolute table, which decides.
    s = hf_subject(_model(t.MPNetForMaskedLM, t.MPNetConfig(**ENCODER, max_position_embeddings=18, pad_token_id=1)))
    assert (s.relative_positions, s.extrapolates, s.left_padding, s.max_len) == (False, False, True, 16)


def test_a_length_of_minus_one_is_no_length():
    with pytest.raises(SubjectError, match=r"XLNetConfig names no maximum length .*; pass max_len=$"):
        hf_subject(_model(t.XLNetLMHeadModel, t.XLNetConfig(vocab_size=64, d_model=32, n_layer=1, n_head=2,
                                                              d_inner=64)))


def test_a_bidirectional_window_only_the_config_gives_asks_for_its_convention():
    model = _model(t.ModernBertForMaskedLM, t.ModernBertConfig(**{**ENCODER, "num_hidden_layers": 2},
                                                                max_position_embeddings=16, local_attention=4,
                                                                global_attn_every_n_layers=2, cls_token_id=1,
                                                                sep_token_id=2, pad_token_id=0))
    assert hf_subject(model).window == (None, 3)   # half-width 2, as the modules declare it: 2 + 1
    for layer in model.model.layers:   # modules that declare no window: only the config's half-width is left
        layer.attn.sliding_window = None
    with pytest.raises(SubjectError, match=r"^hf_subject: ModernBertConfig gives a sliding window for a "
                                           r"bidirectional stack .*; pass window= \(per layer: .*\)$"):
        hf_subject(model)
