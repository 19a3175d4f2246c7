"""The declared contracts of a model (--deterministic, --batch-invariant; skipped unless the run declares them,
properties/plugin/contracts.py): bitwise-equal repeated forward and backward passes, and a prompt's outputs and greedy
continuation independent of its batch."""
from __future__ import annotations

import torch
from hypothesis import strategies as st

from properties import clause
from properties.core.assertions import assert_identical
from properties.model.checks import (DECODERS, call_subject, draw_pair, forward, model_property, real_tokens,
                                     subject_args)

BATCH_SIZES = (2, 3, 8)
CONTINUATION = 4   # greedy steps compared (MODEL-BATCH-INVARIANT)


def _upstream(out: torch.Tensor, seed: int) -> torch.Tensor:
    return torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(out)


def _forward_backward(s, src, tgt, seed: int):
    """(output, {parameter name: gradient}) of one pass; no gradients without Subject.module."""
    if s.module is None:
        return forward(s, src, tgt), {}
    params = [(n, p) for n, p in s.module.named_parameters() if p.requires_grad]
    with torch.enable_grad():
        out = call_subject(s, *subject_args(src, tgt[0], tgt[1]))
        grads = torch.autograd.grad((out * _upstream(out, seed)).sum(), [p for _, p in params], allow_unused=True)
    return out.detach(), {n: g for (n, _), g in zip(params, grads) if g is not None}


@clause("MODEL-DETERMINISTIC")
@model_property(twin=False)
def test_repeated_passes_are_bitwise_equal(mut, data):
    s = mut.native
    src, tgt = draw_pair(data, s, mut.device)
    first, first_grads = _forward_backward(s, src, tgt, tgt[2].seed)
    other_src, other_tgt = draw_pair(data, s, mut.device)   # another batch in between
    forward(s, other_src, other_tgt)
    second, second_grads = _forward_backward(s, src, tgt, tgt[2].seed)
    assert_identical(second, first, what="output of the second forward pass", reference="the first",
                     note="; a forward pass on another batch ran between them")
    for name, grad in first_grads.items():
        assert_identical(second_grads[name], grad, what=f"gradient of {name} in the second backward pass",
                         reference="the first")


def _in_batch(s, prompt: torch.Tensor, batch: int, position: int, seed: int) -> torch.Tensor:
    """``prompt`` (1, L) at ``position`` among batch - 1 other unpadded prompts of its length."""
    others = real_tokens(torch.Generator().manual_seed(seed), (batch, prompt.shape[1]), s, prompt.device)
    return torch.cat([others[:position], prompt, others[position + 1:]])


def _args(s, src, tokens):
    """Subject.forward's arguments for unpadded ``tokens`` (an encoder-decoder's source batched alike)."""
    return subject_args(src, tokens, None) if src is None else (src[0], tokens, None, None)


@clause("MODEL-BATCH-INVARIANT")
@model_property(twin=False)
def test_prompt_outputs_do_not_depend_on_the_batch(mut, data):
    s = mut.native
    decoder = s.kind in DECODERS
    src, tgt = draw_pair(data, s, mut.device, padding=False, size=1, reserve=CONTINUATION if decoder else 0)
    batch = data.draw(st.sampled_from(BATCH_SIZES), label="batch size")
    position = data.draw(st.integers(0, batch - 1), label="position")
    seed = tgt[2].seed + 1
    src_b = None if src is None else (_in_batch(s, src[0], batch, position, seed + 1),)
    tokens, tokens_b = tgt[0], _in_batch(s, tgt[0], batch, position, seed)
    for step in range(CONTINUATION if decoder else 1):
        with torch.no_grad():
            alone = call_subject(s, *_args(s, None if src is None else (src[0],), tokens))
            batched = call_subject(s, *_args(s, src_b, tokens_b))
        where = f"at position {position} of a batch of {batch}" + (f", greedy step {step}" if step else "")
        assert_identical(batched[position:position + 1], alone, what=f"outputs of the prompt {where}",
                         reference="its outputs alone")
        if not decoder:
            break
        # Greedy: each sequence of the batch continues with its own argmax (equal logits give equal tokens).
        nxt, nxt_b = alone[:, -1].argmax(-1, keepdim=True), batched[:, -1].argmax(-1, keepdim=True)
        tokens, tokens_b = torch.cat([tokens, nxt], 1), torch.cat([tokens_b, nxt_b], 1)
