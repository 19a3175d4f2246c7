"""Model-level gradient clauses (properties/SPEC.md, "Gradients": MODEL-GRAD-PADDING, MODEL-GRAD-BATCH).

Both compare two evaluations of one model, so they run on its float64 twin (``mut.precise``) with the
comparison tolerance of properties/model/checks.py. The loss is Σ r ∘ f(x, m) over the real positions, with
r Gaussian from the batch's seed.
"""
from __future__ import annotations

import torch

from properties import clause
from properties.model.checks import (assert_same_output, extend_with_padding, call_subject, comparison_tolerance, draw_pair, embedding_probe,
                                     pinned_model_property, requires, subject_args)
from properties.model.twin import observe
from properties.model.test_models import PAIR


def _weights(s, src, tokens, mask, seed: int, length: int) -> torch.Tensor:
    """r: Gaussian loss weights of shape (B, length, *output features), float64."""
    with torch.no_grad():
        tail = tuple(call_subject(s, *subject_args(src, tokens, mask)).shape[2:])
    return torch.randn((tokens.shape[0], length, *tail), generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64)


def _loss(out, mask, r):
    return (out * r[:, : out.shape[1]].to(out))[mask].sum()


def _embedding_gradient(s, src, tokens, mask, r) -> torch.Tensor:
    """d loss / d (the output of Subject.embedding for the target tokens), (B, L, d)."""
    with torch.enable_grad(), embedding_probe(s.embedding, tokens) as deltas:
        out = call_subject(s, *subject_args(src, tokens, mask))
    assert len(deltas) == 1, (f"Subject.embedding was called {len(deltas)} times with the target tokens; "
                              f"expected once (the module that embeds the tokens passed to forward)")
    (grad,) = torch.autograd.grad(_loss(out, mask, r), deltas[0])
    observe(s, grad, "gradient with respect to the token embeddings")
    return grad


# --------------------------------------------------------------------------------- MODEL-GRAD-PADDING
@clause("MODEL-GRAD-PADDING")
@pinned_model_property(PAIR)
def test_padding_gets_no_gradient(mut, data):
    s = mut.precise
    requires(s, "embedding", "the embeddings' gradients cannot be read")
    extra = 2
    src, (tokens, mask, b) = draw_pair(data, s, mut.device, min_len=2, reserve=extra)
    r = _weights(s, src, tokens, mask, b.seed, b.length + extra)
    grad = _embedding_gradient(s, src, tokens, mask, r)
    if not torch.isfinite(grad).all():
        raise AssertionError(_nan_gradient(s, src, tokens, mask, r, grad))
    leaking = (grad[~mask] != 0).any(-1).nonzero().flatten().tolist()
    assert not leaking, (f"the loss over real positions gives a non-zero gradient to the embeddings of "
                         f"{len(leaking)} padded positions (indices among the padded ones: {leaking[:6]}); hint: "
                         f"padding is attended (a padding mask dropped or inverted)")
    padded_tokens, padded_mask = extend_with_padding(tokens, mask, extra, s.pad_id, left=False)
    padded_src = src and extend_with_padding(src[0], src[1], extra, s.pad_id, left=False)
    grad_padded = _embedding_gradient(s, padded_src, padded_tokens, padded_mask, r)[:, : b.length]
    assert_same_output(grad_padded[mask], grad[mask],
                       f"gradient at real positions with {extra} padded positions appended vs without"
                       + (" (to the target and the source)" if src is not None else ""), subject=s)


def _nan_gradient(s, src, tokens, mask, r, grad) -> str:
    """What a non-finite gradient looks like: at which positions (real or padded, their embeddings exactly 0 or not),
    and in which parameters' gradients of the same loss."""
    bad = (~torch.isfinite(grad)).any(-1)                                       # (B, L)
    padded, real = (bad & ~mask).nonzero().tolist(), (bad & mask).nonzero().tolist()
    with torch.no_grad():
        embedded = s.embedding(tokens)
    zero = bool((embedded[bad & ~mask] == 0).all()) if padded else False
    words = []
    if padded:
        words.append(f"{len(padded)} padded position(s) {[tuple(p) for p in padded[:4]]}"
                     + (" whose embeddings are exactly 0 (the pad id's row of the table)" if zero else ""))
    if real:
        words.append(f"{len(real)} real position(s) {[tuple(p) for p in real[:4]]}")
    parameters = ""
    if s.module is not None:
        named = [(n, p) for n, p in s.module.named_parameters() if p.requires_grad]
        with torch.enable_grad():
            out = call_subject(s, *subject_args(src, tokens, mask))
            grads = torch.autograd.grad(_loss(out, mask, r), [p for _, p in named], allow_unused=True)
        nan = [n for (n, _), g in zip(named, grads) if g is not None and not torch.isfinite(g).all()]
        if nan:
            parameters = f"; and in the gradients of {len(nan)} of {len(named)} parameters ({', '.join(nan[:4])}{', ...' if len(nan) > 4 else ''})"
    hint = ("; hint: a norm whose eps is outside the square root (x/(√(mean x²) + eps)) has an infinite derivative at a "
            "zero input" if zero else "")
    return (f"the gradient of the loss over real positions is NaN or infinite with respect to the embeddings of "
            f"{' and '.join(words)}{parameters}{hint}")


# ----------------------------------------------------------------------------------- MODEL-GRAD-BATCH
@clause("MODEL-GRAD-BATCH")
@pinned_model_property(PAIR)
def test_batch_gradient_is_the_sum_of_sample_gradients(mut, data):
    s = mut.precise
    requires(s, "module", "the parameters are unknown")
    src, (tokens, mask, b) = draw_pair(data, s, mut.device, max_size=3)
    r = _weights(s, src, tokens, mask, b.seed, b.length)
    named = [(n, p) for n, p in s.module.named_parameters() if p.requires_grad]

    def gradients(rows):
        part_src = src and (src[0][rows], src[1][rows])
        with torch.enable_grad():
            out = call_subject(s, *subject_args(part_src, tokens[rows], mask[rows]))
            grads = torch.autograd.grad(_loss(out, mask[rows], r[rows]), [p for _, p in named], allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g for (_, p), g in zip(named, grads)]
        for (name, _), g in zip(named, grads):
            observe(s, g, "parameter gradients")
        return grads

    together = gradients(slice(None))
    alone = [gradients(slice(k, k + 1)) for k in range(b.size)]
    for who, grads in [("the batch's", together), *((f"sample {k}'s", g) for k, g in enumerate(alone))]:
        bad = [name for (name, _), g in zip(named, grads) if not torch.isfinite(g).all()]
        assert not bad, (f"{who} gradient is NaN or infinite in {len(bad)} parameter(s): {bad[:4]} (its loss is "
                         f"over the real positions only)")
    # One scale for all parameters: a gradient that is 0 in exact arithmetic (the key bias's) is rounding
    # noise of the size of the others' rounding, not of its own.
    scale = max(float(g.abs().max()) for g in together if g.numel())
    tolerance = comparison_tolerance(torch.tensor([scale], dtype=together[0].dtype), subject=s)
    for i, (name, _) in enumerate(named):
        summed = sum(sample[i] for sample in alone)
        diff = float((together[i] - summed).abs().nan_to_num(float("inf")).max()) if summed.numel() else 0.0
        assert diff <= tolerance, (f"d{name} of the batch's summed loss vs the sum of the {b.size} samples' gradients "
                                   f"computed alone: differs by {diff:.3e} (tolerance {tolerance:.3e} = 2^21 u "
                                   f"max|gradient| over all parameters)")
