"""MODEL-HISTORY (SPEC.md, "Integrity, history and layouts"): a model's output for an input does not depend on the
calls made before it. Run on a fresh instance each example (``subjects.fresh_subject``: a second factory call, or a
copy of a zoo model taken before its first call), never on the session's model, which every other clause has
called already: a model that keeps state from one long call would be wrong in both calls compared."""
from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings, strategies as st

from properties import clause
from properties.core.assertions import assert_identical
from properties.kernel.integrity import bitwise_equal
from properties.core.subject import moved
from properties.core.tolerance import unit_roundoff
from properties.model.checks import (EXAMPLES, Batch, DRAW_LEN, assert_same_output, batches, call_subject, draw_len,
                                     draw_pair, forward, model_settings, pinned, requires, subject_args)
from properties.model.precision import OWN_NOISE, precision_of
from properties.model.subjects import declared_dtype, fresh_subject, recorder_for
from properties.model.test_models import PAIR

HISTORY = ("long", "batch", "decode")


def _pair(data, s, device, label: str, **options):
    """(src, (tokens, mask), Batch) drawn under labels of its own (``label``, ``label source``): a pinned example
    fixes them apart from the input x."""
    tgt = data.draw(batches(draw_len(s), **options), label=label)
    src = None
    if s.kind == "encoder_decoder":
        b = data.draw(batches(draw_len(s), size=tgt.size, padding=options.get("padding", True)),
                      label=f"{label} source")
        src = (b.tokens(s, device), b.mask(device))
    return src, (tgt.tokens(s, device), tgt.mask(device)), tgt


def longest(s) -> int:
    """The longest input of the history: max_len, or past a length where a declared rotary scaling changes the
    frequencies (dynamic NTK past max_position_embeddings, LongRoPE past the trained length) when the model takes it."""
    thresholds = s.declared.length_thresholds if s.declared is not None else ()
    past = [t + 2 for t in thresholds if t + 2 <= s.max_len or s.extrapolates]
    return max([s.max_len, *past])


def _long(data, s, device) -> None:
    """One sample of a drawn length up to ``longest`` (pinned: the longest), all real."""
    n = data.draw(st.integers(min(DRAW_LEN, s.max_len), longest(s)), label="long length")
    b = Batch(1, n, (n,), seed=n)
    tokens, mask = b.tokens(s, device), b.mask(device)
    forward(s, (tokens, mask) if s.kind == "encoder_decoder" else None, (tokens, mask))


def _batch(data, s, device) -> None:
    """Another batch: other size, lengths and padding."""
    src, tgt, _ = _pair(data, s, device, "other batch", max_size=4)
    forward(s, src, tgt)


def _decode(data, s, device) -> None:
    """A decoding session (a prefill, then one token), its state dropped afterwards."""
    if s.decode_step is None or s.kind == "encoder_only":
        return
    src, (tokens, mask), b = _pair(data, s, device, "decode batch", min_len=2, padding=False, max_size=2)
    state = None
    for start, end in ((0, b.length - 1), (b.length - 1, b.length)):
        def step(*args):
            nonlocal state
            logits, state = s.decode_step(*args, state)
            return logits
        with torch.no_grad():
            call_subject(s, *subject_args(src, tokens[:, start:end], mask[:, :end]), fn=step)


_CALLS = {"long": _long, "batch": _batch, "decode": _decode}


def _scale(y: torch.Tensor) -> float:
    return float(y.double().abs().nan_to_num(0, 0, 0).max()) or 1.0


def _max_len(low: int, high: int) -> int:
    """the longest"""
    return high


# The pinned history, run every time: the longest input, another batch of four, a decoding session.
PINNED_HISTORY = PAIR | {"history": ["long", "batch", "decode"], "long length": _max_len,
                         "other batch": Batch(4, 6, (6, 2, 1, 6), seed=11),
                         "other batch source": Batch(4, 5, (5, 5, 3, 1), seed=12),
                         "decode batch": Batch(2, 4, (4, 4), seed=13), "decode batch source": Batch(2, 3, (3, 3), seed=14)}


def history_property(test):
    """The settings of a MODEL-HISTORY test (one draw after the pin by default), the pinned history first."""
    return settings(model_settings, max_examples=max(1, EXAMPLES // 6))(
        example(data=pinned(PINNED_HISTORY))(given(data=st.data())(test)))


@clause("MODEL-HISTORY")
@history_property
def test_output_does_not_depend_on_earlier_calls(mut, pytestconfig, data):
    s = fresh_subject(pytestconfig, mut.name)
    src, x = draw_pair(data, s, mut.device)
    first, again = forward(s, src, x), forward(s, src, x)
    history = data.draw(st.lists(st.sampled_from(HISTORY), min_size=1, max_size=3), label="history")
    for call in history:
        _CALLS[call](data, s, mut.device)
    after = forward(s, src, x)
    what = f"the output for the same input after the calls {history} (a fresh instance)"
    if bitwise_equal(again, first):   # the instance repeats x bitwise: no rounding excuse
        assert_identical(after, first, what=what, reference="its output before them",
                         note=" (the model repeats this input bitwise)")
        return
    # ρ: the larger of the model's measured noise and the two first calls' difference, relative to max|y|
    real = x[1] if x[1] is not None else torch.ones(x[0].shape, dtype=torch.bool, device=x[0].device)
    measured = precision_of(mut.native).noise if precision_of(mut.native) is not None else 0.0
    rho = max(measured, float((again - first).double().abs()[real].max()) / _scale(first[real]))
    tolerance = OWN_NOISE * rho * _scale(first[real])
    diff = (after.double() - first.double()).abs()[real].nan_to_num(float("inf"))
    assert float(diff.max()) <= tolerance, (
        f"{what} differs from its output before them by {float(diff.max()):.3e} at real positions > {OWN_NOISE} ρ "
        f"max|y| = {tolerance:.3e} (ρ = {rho:.1e}: the model does not repeat this input bitwise)")


# ----------------------------------------------------------------------------- a cast after calls leaves nothing behind
def _left_behind(module: torch.nn.Module, dtype: torch.dtype) -> list[str]:
    """Floating tensors narrower than float32 held by the modules outside their parameters and buffers after a cast
    to ``dtype`` (attributes, lists, tuples and dicts of them): caches and memos the cast did not reach."""
    found = []
    for name, m in module.named_modules():
        registered = set(m._parameters) | set(m._buffers)
        for attribute, value in vars(m).items():
            if attribute in ("_parameters", "_buffers", "_modules"):   # cast by .to(), or modules visited anyway
                continue
            values = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else [value]
            for item in values:
                if attribute not in registered and torch.is_tensor(item) and item.is_floating_point() and \
                        unit_roundoff(item.dtype) > unit_roundoff(torch.float32):
                    found.append(f"{name or type(m).__name__}.{attribute} ({str(item.dtype).removeprefix('torch.')})")
    return found


@clause("MODEL-HISTORY")
@history_property
def test_a_cast_after_calls_leaves_nothing_behind(mut, pytestconfig, data):
    if mut.precise is mut.native:
        pytest.skip(f"no float64 twin ({mut.precise_note or 'the model is compared as built'}): nothing to cast to")
    s = fresh_subject(pytestconfig, mut.name)
    requires(s, "module", "the model cannot be cast")
    built = declared_dtype(s)
    if built in (None, torch.float64):
        pytest.skip(f"the model is built in {built}: a cast to float64 changes nothing")
    src, x = draw_pair(data, s, mut.device)
    history = data.draw(st.lists(st.sampled_from(HISTORY), min_size=1, max_size=3), label="history")
    for call in history:
        _CALLS[call](data, s, mut.device)
    moved(s.module, f"model {mut.name}", torch.float64)
    kept = list(dict.fromkeys(_left_behind(s.module, torch.float64)))
    assert not kept, (f"after module.to(float64) following the calls {history}, the model still holds "
                      f"{', '.join(kept[:4])}: a cache or memo in its {str(built).removeprefix('torch.')} dtype that "
                      f"the cast did not reach")
    recorder = recorder_for(s, torch.float64)
    with torch.no_grad(), recorder, recorder.modules():
        after = call_subject(s, *subject_args(src, *x[:2]))
    narrow = recorder.narrowings({torch.bfloat16, torch.float16})
    assert not narrow, (f"after module.to(float64) following the calls {history}, {narrow[0].module} still computes "
                        f"in {str(narrow[0].dtype).removeprefix('torch.')} ({narrow[0].operation}, {narrow[0].count} "
                        f"operation(s)): a cache, memo or buffer kept from before the cast")
    clean = fresh_subject(pytestconfig, mut.name)
    moved(clean.module, f"model {mut.name}", torch.float64)
    fresh = forward(clean, src, x)
    real = x[1] if x[1] is not None else torch.ones(x[0].shape, dtype=torch.bool, device=x[0].device)
    assert_same_output(after[real], fresh[real], f"the float64 output after the calls {history} made in "
                       f"{str(built).removeprefix('torch.')} and a cast, vs a fresh instance cast before any call",
                       subject=mut.precise)
