"""The model clauses, run the way a user runs them, on broken models and unusable factories.

The deliberately broken models live in the bug catalog (``properties/catalog/models.py``, registry
``properties.catalog.CATALOG``); ``tests/test_catalog.py`` runs every one of them through
``pytest properties/ --model ...`` and checks that its expected clause fails. Here: the ``--zoo`` plug-in
path with a catalog part, the message of a wrong output shape, and unusable factories, which must stop the
run at startup with a one-line usage error.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from properties import Subject
from properties.catalog.models import MAX_LEN, VOCAB, parts
from properties.catalog.sessions import Session, run_pytest
from zoo.nn.models import DecoderOnly

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().relative_to(ROOT).as_posix()


def wrong_vocabulary():
    model = DecoderOnly(**parts()).eval()
    return Subject("decoder_only", model, vocab_size=VOCAB + 1, max_len=MAX_LEN, module=model)  # V off by one


def not_a_model():
    return "a string"


def unknown_kind():
    model = DecoderOnly(**parts()).eval()
    return Subject("decoder", model, vocab_size=VOCAB, max_len=MAX_LEN)


def misnamed_unused_parameter():
    model = DecoderOnly(**parts()).eval()
    return Subject("decoder_only", model, vocab_size=VOCAB, max_len=MAX_LEN, module=model,
                   unused_parameters=("pooler.weight",))


TINY_BERT = "preset=bert_base d_model=32 heads=2 layers=1 d_ff=64 vocab_size=64 max_len=16"


def bert_with_a_dead_layer():
    """The zoo's BERT (its pooler apart from forward, declared unused by the zoo's Subject) with one more
    layer that forward never calls: that one is a real finding."""
    from zoo.config.builder import build_model
    model = build_model(TINY_BERT.split())
    model.dead = torch.nn.Linear(4, 4)
    return model


def hf_bert_with_pooler():
    import transformers
    from properties.adapters import hf_subject
    config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=16, pad_token_id=0)
    return hf_subject(transformers.BertModel(config))  # add_pooling_layer=True, the default


def run_suite(tmp_path, *options: str) -> tuple[Session, dict[str, set[str]]]:
    """pytest properties/model -m model with options (the model level, as -m model selects it from properties/, without
    collecting the other levels), in a new pytest session; -> (session, {status: clause IDs})."""
    report = tmp_path / "report.json"
    proc = run_pytest(["properties/model", "-m", "model", "-q", "--report-json", str(report), *options], cwd=ROOT,
                      timeout=600)
    statuses: dict[str, set[str]] = {}
    if report.exists():
        for row in json.loads(report.read_text()):
            statuses.setdefault(row["status"], set()).add(row["clause"])
    return proc, statuses


def test_broken_model_fails_its_clause_through_zoo_overrides(tmp_path):
    # The module-level plug-in path: a replacement attention named by its import path.
    overrides = ("model=decoder_only attention._target_=properties.catalog.models.NoCausalMask d_model=32 heads=2 "
                 "layers=2 d_ff=64 vocab_size=64 max_len=16")
    proc, statuses = run_suite(tmp_path, "--zoo", overrides, "-k", "causal or distribution")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "MODEL-CAUSAL" in statuses["failed"], statuses
    assert "MODEL-DISTRIBUTION" in statuses["passed"], statuses  # the rest of the model is sound


def test_wrong_shape_message_names_the_expected_shape(tmp_path):
    proc, _ = run_suite(tmp_path, "--model", f"{HERE}:wrong_vocabulary", "-k", "test_output_shape")
    assert "expected logits of shape (B, L, V) = (" in proc.stdout and f", {VOCAB + 1})" in proc.stdout, proc.stdout


@pytest.mark.parametrize("spec,expected", [
    ("tests/no_such_file.py:factory", "does not exist"),
    (f"{HERE}:no_such_factory", "has no attribute 'no_such_factory'"),
    (f"{HERE}:not_a_model", "returned builtins.str; expected a zoo model"),
    (f"{HERE}:unknown_kind", "Subject.kind='decoder': expected 'decoder_only' | 'encoder_decoder' | 'encoder_only'"),
    (f"{HERE}:misnamed_unused_parameter", "Subject.unused_parameters=('pooler.weight',): expected names of "
                                          "Subject.module's parameters (not parameters: ['pooler.weight'])"),
])
def test_unusable_factory_is_a_one_line_usage_error(tmp_path, spec, expected):
    proc, _ = run_suite(tmp_path, "--model", spec)
    assert proc.returncode == 4, proc.stdout[-2000:] + proc.stderr[-2000:]  # pytest's usage-error status
    errors = [line for line in proc.stderr.splitlines() if line.startswith("ERROR:")]
    assert len(errors) == 1 and expected in errors[0], proc.stderr


def test_bad_zoo_override_is_a_one_line_usage_error(tmp_path):
    proc, _ = run_suite(tmp_path, "--zoo", "model=decoder_only heads=5")
    assert proc.returncode == 4, proc.stdout[-2000:] + proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("ERROR:")]
    assert len(errors) == 1 and "heads=5" in errors[0], proc.stderr


@pytest.mark.parametrize("options,dead", [
    (("--zoo", TINY_BERT), None),
    (("--model", f"{HERE}:hf_bert_with_pooler"), None),
    (("--model", f"{HERE}:bert_with_a_dead_layer"), "dead.weight"),
], ids=["zoo-bert", "hf-bert", "zoo-bert-dead-layer"])
def test_a_pooler_apart_from_forward_is_no_finding_and_a_dead_layer_is(tmp_path, options, dead):
    """MODEL-GRADIENT on BERT: the pooler feeds pooler_output, not the hidden states the Subject returns."""
    if "hf_bert" in options[1]:
        pytest.importorskip("transformers")
    proc, statuses = run_suite(tmp_path, *options, "-k", "every_parameter")
    if dead is None:
        assert proc.returncode == 0 and statuses == {"passed": {"MODEL-GRADIENT"}}, proc.stdout[-3000:]
    else:
        assert proc.returncode == 1 and "MODEL-GRADIENT" in statuses["failed"], proc.stdout[-3000:]
        assert f"['{dead}', '{dead.replace('weight', 'bias')}']" in proc.stdout, proc.stdout[-3000:]


@pytest.mark.parametrize("value,words", [
    (None, "expected a tuple of parameter names"), ("pooler.weight", "expected a tuple of parameter names"),
    ((3,), "expected a tuple of parameter names"), (("nowhere.weight",), "not parameters: ['nowhere.weight']"),
])
def test_bad_unused_parameters_are_one_clear_error(value, words):
    from properties.core.subject import SubjectError
    model = DecoderOnly(**parts()).eval()
    with pytest.raises(SubjectError, match=r"^Subject\.unused_parameters=") as refused:
        Subject("decoder_only", model, vocab_size=VOCAB, max_len=MAX_LEN, module=model, unused_parameters=value)
    assert words in str(refused.value) and "\n" not in str(refused.value)



def test_summary_says_what_each_model_clause_rests_on():
    # Per clause: tests on the float64 twin, in the model's own precision and why, skipped for a missing feature.
    from properties.plugin.report import model_basis
    record = dict(level="model", message="", clauses=["MODEL-BATCH"])
    records = [record | dict(status="passed", precision="float64 twin"),
               record | dict(status="passed", precision="own precision: the twin departs (NaN in its forward)"),
               record | dict(status="passed", precision="own precision: the twin is refused (RuntimeError)"),
               record | dict(clauses=["MODEL-ROUTING"], status="skipped", precision="",
                             message="Subject.routing is None: the model declares no mixture-of-experts routing")]
    assert model_basis(records) == [
        "MODEL-BATCH: 1 on the float64 twin; 1 in its own precision (the twin gives NaN); 1 in its own precision "
        "(the twin is refused (RuntimeError))", "MODEL-ROUTING: skipped: Subject.routing is None"]
