"""MODEL-PADDING-IDS (SPEC.md, "Models"): the attention mask alone decides what is padding. A token whose id is the pad,
eos or bos id (``Subject.pad_id`` and ``Subject.special_ids``) at a position the mask marks real is attended like any
other token, in a prompt and when it is decoded.

Every other model clause draws real tokens that are never the pad id, so a model that takes its padding from
``ids != pad_token_id`` (with pad = eos, as Arcee's and many Llama checkpoints ship, it drops every real EOS) is
consistent with itself everywhere else. Here the special id is put at an attended position j and the gradient of the
output at the next position with respect to the embedding at j is read: exactly 0 when the model masks the token,
never exactly 0 when it attends it (a positive softmax weight, however small, passes a gradient).
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import example, strategies as st

from properties import clause
from properties.model.checks import (DRAW_LEN, Batch, call_subject, embedding_probe, model_property, pinned,
                                     real_tokens, requires, subject_args)
from properties.model.twin import observe


def _ids(s) -> list[int]:
    return list(dict.fromkeys([s.pad_id, *s.special_ids]))


def _second(low, high):
    """the second special id"""
    return min(1, high)


def _longest(low, high):
    """the longest"""
    return high


def padding_ids_property(test):
    """The model settings, the pinned case first (two samples, the pad id in one and the next special id in the
    other, at position 1 of the longest draw), and the twin's fallback."""
    return example(data=pinned({"length": _longest, "position j": 1, "batch size": 2, "special id of sample 0": 0,
                                "special id of sample 1": _second, "seed": 0}))(model_property(test))


def _name(s, i: int) -> str:
    roles = ["the pad id" if i == s.pad_id else None] + (["a special id (bos, eos, ...)"] if i in s.special_ids else [])
    return f"{i} ({' and '.join(r for r in roles if r)})"


def _subject(mut):
    s = mut.precise
    requires(s, "embedding", "the embeddings' gradients cannot be read")
    if s.max_len < 3:
        pytest.skip(f"max_len={s.max_len}: no position has a real token after it")
    return s


def _case(data, s, device, first: int):
    length = data.draw(st.integers(first + 2, max(first + 2, min(DRAW_LEN, s.max_len))), label="length")
    position = data.draw(st.integers(first, length - 2), label="position j")
    size = data.draw(st.integers(1, 2), label="batch size")
    ids = _ids(s)
    chosen = [ids[data.draw(st.integers(0, len(ids) - 1), label=f"special id of sample {b}")] for b in range(size)]
    seed = data.draw(st.integers(0, 2**16), label="seed")
    tokens = real_tokens(torch.Generator().manual_seed(seed), (size, length), s, device)
    tokens[:, position] = torch.tensor(chosen, device=device)
    src = None
    if s.kind == "encoder_decoder":
        source = Batch(size, 5, (5,) * size, seed + 2**17)
        src = (source.tokens(s, device), source.mask(device))
    return src, tokens, position, chosen, seed


def _assert_attended(s, grad: torch.Tensor, position: int, chosen, where: str) -> None:
    """grad (B, d): the gradient of the next position's output with respect to the embedding at ``position``."""
    observe(s, grad, "gradient with respect to the token embeddings")
    assert torch.isfinite(grad).all(), f"{where}: the gradient with respect to position {position}'s embedding is NaN"
    dead = (grad == 0).all(-1).nonzero().flatten().tolist()
    assert not dead, (
        f"{where}: position {position} holds token {_name(s, chosen[dead[0]])} and is real (mask 1), yet the output at "
        f"position {position + 1} has a gradient of exactly 0 with respect to its embedding in sample(s) {dead}: the "
        f"token is not attended; hint: padding taken from the token ids (ids != pad_id) instead of the attention mask")


@clause("MODEL-PADDING-IDS")
@padding_ids_property
def test_special_ids_at_real_positions_are_attended(mut, data):
    s = _subject(mut)
    src, tokens, position, chosen, seed = _case(data, s, mut.device, first=0)
    mask = torch.ones_like(tokens, dtype=torch.bool)
    with torch.enable_grad(), embedding_probe(s.embedding, tokens) as deltas:
        out = call_subject(s, *subject_args(src, tokens, mask))
    assert deltas, "Subject.embedding was not called with the tokens passed to forward"
    r = torch.randn(out[:, position + 1].shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    (grad,) = torch.autograd.grad((out[:, position + 1] * r.to(out)).sum(), deltas[0])
    _assert_attended(s, grad[:, position], position, chosen, "forward")


@clause("MODEL-PADDING-IDS")
@padding_ids_property
def test_special_ids_decoded_are_attended(mut, data):
    s = _subject(mut)
    requires(s, "decode_step", "the model offers no cached decoding")
    if s.kind == "encoder_only":
        pytest.skip("applies to decoders")
    src, tokens, position, chosen, seed = _case(data, s, mut.device, first=1)
    mask = torch.ones_like(tokens, dtype=torch.bool)
    state = None

    def step(start: int, end: int):
        nonlocal state

        def call(*args):
            nonlocal state
            logits, state = s.decode_step(*args, state)
            return logits
        return call_subject(s, *subject_args(src, tokens[:, start:end], mask[:, :end]), fn=call)
    with torch.enable_grad():
        step(0, position)                                                    # the prefill before the special id
        with embedding_probe(s.embedding, tokens[:, position:position + 1]) as deltas:
            step(position, position + 1)                                     # the special id, decoded
        assert deltas, "Subject.embedding was not called with the token decode_step was given"
        logits = step(position + 1, position + 2)[:, 0]
    r = torch.randn(logits.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    (grad,) = torch.autograd.grad((logits * r.to(logits)).sum(), deltas[0])
    _assert_attended(s, grad[:, 0], position, chosen,
                     "cached decoding (the special id decoded in its own step, the next step's logits)")
