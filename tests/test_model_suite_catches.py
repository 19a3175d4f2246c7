"""The model clauses catch deliberately broken models, each with the clause its defect violates.

Every broken factory below is the tiny zoo model with one part replaced. Each runs through the same
``pytest properties/ --model file.py:factory`` (or ``--zoo``) path a user takes, in a subprocess,
and the JSON report must list the expected clause as failed. Unusable factories must stop the run
at startup with a one-line usage error.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from properties import Subject
from zoo.attention import MultiHeadAttention
from zoo.ffn import FeedForward
from zoo.models import DecoderOnly, EncoderDecoder, EncoderOnly
from zoo.norm import LayerNorm
from zoo.positional import SinusoidalPositions

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().relative_to(ROOT).as_posix()
D, HEADS, VOCAB, MAX_LEN = 32, 2, 64, 16


def _parts(attention=MultiHeadAttention, ffn=FeedForward, pos=SinusoidalPositions) -> dict:
    return dict(vocab_size=VOCAB, d_model=D, layers=2, max_len=MAX_LEN,
                attention=partial(attention, d_model=D, heads=HEADS), ffn=partial(ffn, d_model=D, d_ff=64),
                norm=partial(LayerNorm, d_model=D), pos=partial(pos, d_model=D, max_len=MAX_LEN))


# ------------------------------------------------------------------------------- the broken parts
class NoCausalMask(MultiHeadAttention):
    """Drops the causal mask: every position sees the whole sequence."""

    def forward(self, x, memory=None, *, is_causal=False, **kwargs):
        return super().forward(x, memory, is_causal=False, **kwargs)


class QueryPaddingMask(MultiHeadAttention):
    """Applies the padding mask to the queries (zeroing padded rows) instead of to the keys."""

    def forward(self, x, memory=None, *, key_padding_mask=None, **kwargs):
        out = super().forward(x, memory, **kwargs)
        return out if key_padding_mask is None else out * key_padding_mask[..., None].to(out.dtype)


class SelfInsteadOfCross(MultiHeadAttention):
    """Cross-attention that attends (causally) over the decoder's own states instead of the encoder's."""

    def forward(self, x, memory=None, *, key_padding_mask=None, is_causal=False, **kwargs):
        if memory is not None:
            return super().forward(x, None, is_causal=True, **kwargs)
        return super().forward(x, None, key_padding_mask=key_padding_mask, is_causal=is_causal, **kwargs)


class DropoutInEval(FeedForward):
    """Dropout with training=True hard-coded: active in eval mode too."""

    def forward(self, x):
        return F.dropout(super().forward(x), p=0.1, training=True)


class PositionsNotAdded(SinusoidalPositions):
    """Computes the position codes and forgets to add them."""

    def forward(self, x, offset=0):
        codes = self.table[offset: offset + x.shape[1]]  # noqa: F841  (the defect)
        return x


class CacheOffsetIgnored(SinusoidalPositions):
    """Numbers positions from 0 in every call, so cached decoding restarts the positions at each step."""

    def forward(self, x, offset=0):
        return super().forward(x, 0)


# ------------------------------------------------------------------------------ broken factories
def no_causal_mask():
    return DecoderOnly(**_parts(attention=NoCausalMask))


def query_padding_mask():
    return EncoderOnly(**_parts(attention=QueryPaddingMask))


def cross_attends_to_decoder():
    return EncoderDecoder(**_parts(attention=SelfInsteadOfCross))


def dropout_in_eval():
    return DecoderOnly(**_parts(ffn=DropoutInEval))


def positions_not_added():
    return EncoderOnly(**_parts(pos=PositionsNotAdded))


def cache_offset_ignored():
    return DecoderOnly(**_parts(pos=CacheOffsetIgnored))


def wrong_vocabulary():
    model = DecoderOnly(**_parts()).eval()
    return Subject("decoder_only", model, vocab_size=VOCAB + 1, max_len=MAX_LEN, module=model)  # V off by one


def not_a_model():
    return "a string"


def unknown_kind():
    model = DecoderOnly(**_parts()).eval()
    return Subject("decoder", model, vocab_size=VOCAB, max_len=MAX_LEN)


def run_suite(tmp_path, *options: str) -> tuple[subprocess.CompletedProcess, dict[str, set[str]]]:
    """pytest properties/ -m model with options, in a subprocess; -> (process, {status: clause IDs})."""
    report = tmp_path / "report.json"
    # One intra-op thread: the models are tiny, and several of these runs may share the machine.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "properties/", "-m", "model", "-q",
                           "--report-json", str(report), *options],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    statuses: dict[str, set[str]] = {}
    if report.exists():
        for row in json.loads(report.read_text()):
            statuses.setdefault(row["status"], set()).add(row["clause"])
    return proc, statuses


BROKEN = [
    # factory, the clause its defect violates, -k selecting that clause's tests (a short run: the
    # other clauses a defect breaks would each spend time shrinking their counterexample)
    ("no_causal_mask", "MODEL-CAUSAL", "causal"),
    ("query_padding_mask", "MODEL-PADDING", "padding"),
    ("cross_attends_to_decoder", "MODEL-DEPENDENCE", "depends"),
    ("dropout_in_eval", "MODEL-DETERMINISM", "determinism"),
    ("positions_not_added", "MODEL-PERMUTATION", "permutation"),
    ("cache_offset_ignored", "MODEL-KV-CACHE", "cached_decoding"),
    ("wrong_vocabulary", "MODEL-SHAPE", "output_shape"),
]


@pytest.mark.parametrize("factory,clause_id,tests", BROKEN)
def test_broken_model_fails_its_clause(tmp_path, factory, clause_id, tests):
    proc, statuses = run_suite(tmp_path, "--model", f"{HERE}:{factory}", "-k", tests)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert clause_id in statuses.get("failed", set()), (statuses, proc.stdout[-3000:])


def test_broken_model_fails_its_clause_through_zoo_overrides(tmp_path):
    # The module-level plug-in path: a replacement attention named by its import path.
    module = HERE.removesuffix(".py").replace("/", ".")
    overrides = (f"model=decoder_only attention._target_={module}.NoCausalMask d_model=32 heads=2 layers=2 "
                 f"d_ff=64 vocab_size=64 max_len=16")
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
    (f"{HERE}:unknown_kind", "Subject.kind='decoder': expected 'encoder_only' | 'decoder_only' | 'encoder_decoder'"),
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

