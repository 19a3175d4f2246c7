"""Model clauses about decoding: the autoregressive factorisation, cached decoding, and lengths
(SPEC.md, "Models": MODEL-FACTORISATION, MODEL-KV-CACHE, MODEL-LENGTH)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from properties import clause
from properties.core import evidence
from properties.model.checks import is_float64_twin
from properties.model.checks import (EXAMPLES, DECODERS, Batch, call_subject, check_cached_decoding,
                                     comparison_tolerance, draw_pair, forward,
                                     model_property, model_settings, only, pinned, pinned_model_property, subject_args,
                                     real_tokens, requires)
from properties.model.twin import twin_fallback
from properties.model.test_models import FULL_PAIR, PAIR


# --------------------------------------------------------------------- MODEL-FACTORISATION, MODEL-KV-CACHE
def _log_p(logits: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.double(), -1).gather(-1, next_tokens[..., None])[..., 0]


@clause("MODEL-FACTORISATION")
@settings(model_settings, max_examples=max(2, EXAMPLES // 2))
@example(data=pinned(FULL_PAIR))
@given(data=st.data())
@twin_fallback
def test_autoregressive_factorisation(mut, data):
    s = only(mut.precise, *DECODERS)
    src, (y, mask, b) = draw_pair(data, s, mut.device, min_len=2, padding=False, max_size=2)
    full = forward(s, src, (y, mask))
    one_pass = _log_p(full[:, :-1], y[:, 1:])                                   # log p(y_k | y_<k), k >= 1
    steps = torch.stack([_log_p(forward(s, src, (y[:, :k], mask[:, :k]))[:, -1], y[:, k])
                         for k in range(1, b.length)], dim=1)
    # log_softmax is 2-Lipschitz in the max norm: twice the logits' tolerance bounds each term.
    tol = 2 * comparison_tolerance(full, subject=s)
    if evidence.active():   # --repro-dir: the sequence, and the tolerance relative to max|y|
        evidence.record("model-factorisation", device=str(y.device), float64=is_float64_twin(s), tokens=y, mask=mask,
                        src=None if src is None else src[0], src_mask=None if src is None else src[1],
                        relative=comparison_tolerance(torch.ones(1, dtype=full.dtype), s))
    diff = (steps - one_pass).abs()
    assert diff.max() <= tol, (f"log p(y_k | y_<k) from prefix y_<k differs from the one-pass value by "
                               f"{diff.max().item():.3e} at (sample, k - 1) = "
                               f"{tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))} "
                               f"(tolerance {tol:.1e}); totals {steps.sum(1).tolist()} vs {one_pass.sum(1).tolist()}")


@clause("MODEL-KV-CACHE")
@pinned_model_property(PAIR | {"chunk boundaries": {2, 3}})   # mixed lengths: sample 1 (2 real) all pads after the prefill
def test_cached_decoding(mut, data):
    s = only(mut.precise, *DECODERS)
    requires(s, "decode_step", "the model offers no cached incremental decoding")
    src, (tokens, mask, b) = draw_pair(data, s, mut.device, min_len=2)
    cuts = sorted(data.draw(st.sets(st.integers(1, b.length - 1), max_size=3), label="chunk boundaries"))
    check_cached_decoding(s, src, tokens, mask, cuts)


def _left_padded(tokens, mask, pad_id):
    """Each row's real prefix moved to the end: the same samples, left-padded."""
    out_tokens, out_mask = torch.full_like(tokens, pad_id), torch.zeros_like(mask)
    for row, n in enumerate(mask.sum(1).tolist()):
        out_tokens[row, tokens.shape[1] - n:] = tokens[row, :n]
        out_mask[row, tokens.shape[1] - n:] = True
    return out_tokens, out_mask


# The shapes that real decode-path bugs need, drawn every run (SPEC.md, MODEL-KV-CACHE): a prefill followed by
# chunks of several tokens (a mask dropped or a causal diagonal misaligned once keys are cached), mixed real
# lengths, and the same batch left-padded (positions counted from column 0 under a cache).
PINNED_DECODING = {
    "prefill-then-chunks": dict(real=(8, 5), cuts=(4, 6), left=False),
    "prefill-then-one-token-steps": dict(real=(8, 6), cuts=(5, 6, 7), left=False),
    "left-padded-mixed-lengths": dict(real=(8, 3, 6), cuts=(4, 6), left=True),
}


@clause("MODEL-KV-CACHE")
@pytest.mark.parametrize("shape", list(PINNED_DECODING))
@twin_fallback
def test_cached_decoding_pinned_shapes(mut, shape):
    s = only(mut.precise, *DECODERS)
    requires(s, "decode_step", "the model offers no cached incremental decoding")
    spec = PINNED_DECODING[shape]
    if spec["left"] and not s.left_padding:
        pytest.skip("Subject.left_padding is False: the model does not claim left-padding invariance")
    length = min(8, s.max_len)
    real = tuple(min(r, length) for r in spec["real"])
    cuts = tuple(c for c in spec["cuts"] if c < length)
    target = Batch(len(real), length, real, seed=7)
    tokens, mask = target.tokens(s, mut.device), target.mask(mut.device)
    if spec["left"]:
        tokens, mask = _left_padded(tokens, mask, s.pad_id)
    src = None
    if s.kind == "encoder_decoder":
        source = Batch(len(real), length, tuple(reversed(real)), seed=2**17 + 7)
        src = (source.tokens(s, mut.device), source.mask(mut.device))
    check_cached_decoding(s, src, tokens, mask, cuts, note=f", pinned shape {shape}: real lengths {real}"
                           + (", left-padded" if spec["left"] else ""))


# --------------------------------------------------------------------------------------- MODEL-LENGTH
def _max_len(low, high):
    """max_len"""
    return high


@clause("MODEL-LENGTH")
@example(data=pinned({"length": _max_len, "seed": 0}))   # the last row of a position table
@example(data=pinned({"length": 1, "seed": 0}))
@model_property(twin=False)
def test_every_length_up_to_max_len(mut, data):
    s = mut.native
    length = data.draw(st.integers(1, s.max_len), label="length")
    batch = Batch(1, length, (length,), data.draw(st.integers(0, 2**16), label="seed"))
    tokens, mask = batch.tokens(s, mut.device), batch.mask(mut.device)
    out = forward(s, (tokens, mask) if s.kind == "encoder_decoder" else None, (tokens, mask))
    assert torch.isfinite(out).all(), f"non-finite output at length {length} <= max_len={s.max_len}"


@clause("MODEL-LENGTH")
@example(data=pinned({"positions beyond max_len": 1, "too long": "source"}))   # one past the table: off by one
@example(data=pinned({"positions beyond max_len": 1, "too long": "target"}))
@model_property(twin=False)
def test_beyond_max_len(mut, data):
    s = mut.native
    extra = data.draw(st.integers(1, 3), label="positions beyond max_len")
    side = data.draw(st.sampled_from(["source", "target"]), label="too long") \
        if s.kind == "encoder_decoder" else "input"
    gen = torch.Generator().manual_seed(extra)
    long = real_tokens(gen, (1, s.max_len + extra), s, mut.device)
    short = real_tokens(gen, (1, 2), s, mut.device)
    ones = lambda t: torch.ones_like(t, dtype=torch.bool)  # noqa: E731
    tgt = short if side == "source" else long
    src = (long if side == "source" else short, ones(long if side == "source" else short)) \
        if s.kind == "encoder_decoder" else None
    extrapolates = s.extrapolates if s.extrapolates is not None else (None if not s.positional else False)
    try:   # the model's own call: any exception it raises, AssertionError included, is its refusal
        with torch.no_grad():
            raw = s.forward(*subject_args(src, tgt, ones(tgt)))
    except Exception as exc:
        message = str(exc).strip()
        assert not extrapolates, (f"{side} of length {s.max_len + extra} > max_len raised {type(exc).__name__}: "
                                  f"{message.splitlines()[0] if message else ''} although Subject.extrapolates")
        assert message and "\n" not in message, (
            f"{side} of length {s.max_len + extra} > max_len={s.max_len} raised {type(exc).__name__} "
            f"with {'no message' if not message else 'a message of several lines'}; expected a one-line error")
        return
    out = call_subject(s, *subject_args(src, tgt, ones(tgt)), fn=lambda *_: raw)   # the output contract
    assert extrapolates is not False, (
        f"{side} of length {s.max_len + extra} > max_len={s.max_len} returned an output; expected an error "
        f"(or Subject.extrapolates=True for a model without a length limit)")
    assert torch.isfinite(out).all(), f"non-finite output for a {side} of length {s.max_len + extra}"
