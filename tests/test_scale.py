"""Models at scale (issue 25), in process: the catalog's at-scale bugs are exact below their threshold by construction;
tiny Hugging Face models at max_len 4096 broken past a length (tests/scale_models.py) fail MODEL-SHIFT, MODEL-WINDOW
and MODEL-KV-CACHE on their pinned cases without --reference, and their correct twins pass the same cases; a clause
whose float64 twin departs runs in the model's own precision, with a note; a NaN is reported as a NaN.

The clause bodies are called directly (``test.hypothesis.inner_test``) with the pinned draws the suite runs first
(properties/model/test_scale.py: SHIFT_PINS, WINDOW_PINS, KV_PINS): no subprocess, no drawn examples. The catalog's
bugs are run the way a user runs them by tests/test_catalog.py.
"""
from __future__ import annotations

import importlib.util
import sys
import warnings
from pathlib import Path

import pytest
import torch

from properties import Subject
from properties.catalog import scale_bugs
from properties.model import test_gradients, test_models, test_rotary, test_scale
from properties.model.subjects import build_model_under_test
from properties.model.checks import pinned
from properties.model.test_models import PAIR
from properties.model.twin import TwinDeparture, pop_notes

ROOT = Path(__file__).resolve().parents[1]
# PinnedData rejects a pin that does not fit with hypothesis.assume, which warns outside a property.
pytestmark = pytest.mark.filterwarnings("ignore:Using `assume` outside a property-based test")


# ------------------------------------------------------------------------- the catalog: exact below a length
def _tokens(length: int, seed: int = 1):
    ids = torch.randint(1, scale_bugs.VOCAB, (2, length), generator=torch.Generator().manual_seed(seed))
    return ids, torch.ones_like(ids, dtype=torch.bool)


def _outputs(name: str, s: Subject, length: int) -> torch.Tensor:
    """What the bug changes: the forward pass, or for the cache its last steps decoded one token at a time."""
    tokens, mask = _tokens(length)
    with torch.no_grad():
        if name != "cache_keeps_last_100":
            return s.forward(tokens, mask)
        logits, state = s.decode_step(tokens[:, :length - 3], mask[:, :length - 3], None)
        steps = [logits]
        for i in range(length - 3, length):
            logits, state = s.decode_step(tokens[:, i:i + 1], mask[:, :i + 1], state)
            steps.append(logits)
        return torch.cat(steps, 1)


@pytest.mark.parametrize("name", list(scale_bugs.TWINS))
def test_scale_bugs_are_exact_below_their_threshold(name, one_thread):
    bug, twin = getattr(scale_bugs, name)(), scale_bugs.correct_twin(name)
    threshold = scale_bugs.TWINS[name][1]
    assert torch.equal(_outputs(name, bug, threshold - 1), _outputs(name, twin, threshold - 1)), \
        f"{name} departs from its correct model below {threshold} positions"
    assert not torch.equal(_outputs(name, bug, threshold + 8), _outputs(name, twin, threshold + 8)), \
        f"{name} does not depart past {threshold} positions"


def test_scale_bugs_shifted_positions_exact_below_their_threshold(one_thread):
    """MODEL-SHIFT's bugs through Subject.shifted too: the last position just below the threshold is exact."""
    for name in ("rotary_positions_in_bf16", "alibi_positions_clamped", "position_table_clamped"):
        bug, twin = getattr(scale_bugs, name)(), scale_bugs.correct_twin(name)
        tokens, mask = _tokens(5)
        offset = scale_bugs.TWINS[name][1] - 5
        with torch.no_grad():
            assert torch.equal(bug.shifted(tokens, mask, offset), twin.shifted(tokens, mask, offset)), name


# --------------------------------------------------------------- held-out-like Hugging Face models at 4096
def _hf_file(path: str):
    """The module at ROOT/path, which builds Hugging Face models (skipped without transformers)."""
    pytest.importorskip("transformers", reason="transformers not installed (pip install 'transformer-zoo[hf]')")
    spec = importlib.util.spec_from_file_location(f"_{Path(path).stem}", ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _scale_models():
    return _hf_file("tests/scale_models.py")


def _run_pins(test, mut, pins, **arguments) -> list[str]:
    """The clause body on each pinned case; the failures' first lines."""
    failures = []
    for values in pins:
        try:
            test.hypothesis.inner_test(mut=mut, data=test_scale.pinned_data(values), **arguments)
        except AssertionError as exc:
            failures.append(str(exc).splitlines()[0])
    return failures


CLAUSES = {   # clause body, its pins, its other arguments
    "MODEL-SHIFT": (test_scale.test_shift, test_scale.SHIFT_PINS, {"arrangement": "as-built"}),
    "MODEL-WINDOW": (test_scale.test_window, test_scale.WINDOW_PINS, {}),
    "MODEL-KV-CACHE": (test_scale.test_cached_decoding_at_length, test_scale.KV_PINS, {}),
}
HELD_OUT = [   # (bug, its correct twin, the clause that must catch it)
    ("rotary_angles_in_bf16", "llama_bf16", "MODEL-SHIFT"),
    ("window_admits_one_more", "mistral_window", "MODEL-WINDOW"),
    ("cache_keeps_last_95", "llama", "MODEL-KV-CACHE"),
]


@pytest.mark.parametrize("bug,twin,clause", HELD_OUT, ids=[h[0] for h in HELD_OUT])
def test_held_out_like_bugs_caught_without_a_reference_twins_pass(bug, twin, clause, one_thread):
    models = _scale_models()
    test, pins, arguments = CLAUSES[clause]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # transformers' deprecation notices
        caught = _run_pins(test, build_model_under_test(getattr(models, bug)), pins, **arguments)
        assert caught, f"{bug}: {clause} passed on every pinned case"
        false_alarms = _run_pins(test, build_model_under_test(getattr(models, twin)), pins, **arguments)
    assert not false_alarms, f"{twin}: {false_alarms}"


@pytest.mark.parametrize("factory,bug", [("rotary_angles_in_bf16", True), ("rotary_angles_in_bf16_small_weights", True),
                                         ("llama_bf16", False), ("llama_bf16_small_weights", False)])
def test_rotary_angles_in_bf16_are_caught_whatever_the_weights(factory, bug, one_thread):
    """MODEL-ROTARY-ANGLES reads the rotary table itself: the bug is caught at std 0.02, where positions move the
    logits less than bfloat16 rounds them, as at std 0.2; the correct Llamas pass."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mut = build_model_under_test(getattr(_scale_models(), factory))
    if not bug:
        test_rotary.test_rotary_tables_hold_the_angles_at_every_position(mut=mut)
        return
    with pytest.raises(AssertionError, match=r"rotary_emb \(LlamaRotaryEmbedding\): (cos|sin) at position \d+.*the "
                                             r"first position off is \d+: the angles are not computed at full precision"):
        test_rotary.test_rotary_tables_hold_the_angles_at_every_position(mut=mut)


def test_correct_rotary_tables_of_many_forms_pass(one_thread, capsys):
    """examples/rotary_tables.py, every case: rope scalings that change θ (some by length), partial rotary, interleaved
    pairs, in float32, bfloat16 and float16; GPT-J's fixed table is skipped with the reason."""
    example = _hf_file("examples/rotary_tables.py")
    status = example.main([])
    out = capsys.readouterr().out
    assert status == 0 and out.rstrip().endswith("0 failure(s)"), out
    verdicts = [line.split()[2] for line in out.splitlines()[:-1] if "not in this transformers" not in line]
    assert verdicts.count("skip:") == 3 and verdicts.count("pass") == len(verdicts) - 3, out
    assert example.main(["llama", "nosuch"]) == 2   # an unknown case: one line, nothing run
    captured = capsys.readouterr()
    assert not captured.out and captured.err.count("\n") == 1 and "unknown case(s) ['nosuch']" in captured.err


class _MultimodalRotary(torch.nn.Module):
    """inv_freq and forward(x, position_ids), but position ids of shape (3, B, L), as Qwen2-VL's."""

    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", torch.ones(4))

    def forward(self, x, position_ids):
        if position_ids.dim() != 3:
            raise ValueError("expected position_ids of shape (3, batch, length)")
        return position_ids, position_ids


def test_a_rotary_table_of_another_form_is_skipped_not_failed():
    from types import SimpleNamespace
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), _MultimodalRotary())
    mut = SimpleNamespace(native=SimpleNamespace(module=model, max_len=16), device="cpu")
    with pytest.raises(pytest.skip.Exception, match="not in Hugging Face's text form.*ValueError: expected position_ids"):
        test_rotary.test_rotary_tables_hold_the_angles_at_every_position(mut=mut)


# ------------------------------------------------------------------------------ the float64 twin departs
class _NanInFloat64(torch.nn.Module):
    """Correct in float32; in float64 (its twin) every output is NaN, as a float32 softmax of finfo(float64).min
    makes it. ``leak``: a sample sees the batch's mean (a real bug, in every precision)."""

    def __init__(self, leak: bool):
        super().__init__()
        self.embed, self.head, self.leak = torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16), leak

    def forward(self, tokens, mask=None):
        x = self.embed(tokens)
        if self.leak:
            x = x + 0.1 * x.mean(0, keepdim=True)
        y = self.head(torch.tanh(x.cumsum(1)))
        return y * float("nan") if y.dtype == torch.float64 else y


def _nan_twin(leak: bool):
    def make():
        with torch.random.fork_rng():
            torch.manual_seed(0)
            model = _NanInFloat64(leak).eval()
        return Subject("decoder_only", model, 16, 8, module=model, embedding=model.embed)
    return build_model_under_test(make)


def test_a_departing_twin_hands_the_clause_to_the_model_as_built(one_thread):
    mut = _nan_twin(leak=False)
    assert mut.precise is not mut.native
    pop_notes()
    with pytest.warns(TwinDeparture, match=r"own precision \(float32\): its float64 twin departs \(NaN in its forward"):
        test_models.test_batch_independence.hypothesis.inner_test(mut=mut, data=pinned(PAIR))
    assert pop_notes() == ["ran in the model's own precision (float32): its float64 twin departs (NaN in its forward)"]


def test_a_departing_twin_does_not_hide_a_bug_of_the_model_as_built(one_thread):
    with pytest.raises(AssertionError, match=r"sample 0 inside a batch .* \[in the model's own precision: its float64 "
                                             r"twin departs \(NaN in its forward\)"):
        test_models.test_batch_independence.hypothesis.inner_test(mut=_nan_twin(leak=True), data=pinned(PAIR))


def _native_only(nan_at: int):
    """A subject without a module (no twin) whose logits are NaN from position ``nan_at`` on."""
    embed, head = torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16)

    def forward(tokens, mask=None):
        y = head(embed(tokens).cumsum(1))
        return torch.cat([y[:, :nan_at], y[:, nan_at:] * float("nan")], 1)
    return build_model_under_test(lambda: Subject("decoder_only", forward, 16, 8, embedding=embed))


def test_a_nan_is_reported_as_a_nan(one_thread):
    mut = _native_only(nan_at=0)
    with pytest.raises(AssertionError, match="NaN or infinite") as causal:
        test_models.test_causal_gradient.hypothesis.inner_test(mut=mut, data=pinned(PAIR | {"position i": 1}))
    assert "does not depend" not in str(causal.value)
    with pytest.raises(AssertionError, match="NaN in the first and the second"):
        test_models.test_batch_independence.hypothesis.inner_test(mut=mut, data=pinned(PAIR))


def test_a_nan_gradient_is_reported_as_a_nan_not_a_tolerance(one_thread):
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.head = torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16)

        def forward(self, tokens, mask=None):
            return self.head(torch.sqrt(self.embed(tokens) * 0))   # finite output, NaN gradient (d sqrt at 0)

    model = Model().eval()
    mut = build_model_under_test(lambda: Subject("decoder_only", model, 16, 8, module=model))
    mut.precise = mut.native
    with pytest.raises(AssertionError, match="gradient is NaN or infinite") as failure:
        test_gradients.test_batch_gradient_is_the_sum_of_sample_gradients.hypothesis.inner_test(mut=mut,
                                                                                              data=pinned(PAIR))
    assert "tolerance nan" not in str(failure.value)


@pytest.mark.parametrize("field,value,expected", [
    ("window", (16, 0), "a tuple with one entry per layer, each a positive int or None"),
    ("window", 16, "a tuple with one entry per layer"),
    ("window", (), "a tuple with one entry per layer"),
    ("edges", (96, "block"), "a tuple of positive ints"),
    ("shifted", "position_ids", "a callable or None"),
    ("relative_positions", None, "a bool"),
])
def test_the_scale_fields_are_checked_in_one_line(field, value, expected):
    from properties.core.subject import SubjectError
    with pytest.raises(SubjectError, match=f"Subject.{field}=.*expected .*{expected}") as error:
        Subject("decoder_only", lambda tokens, mask: tokens, 16, 8, **{field: value})
    assert "\n" not in str(error.value)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
