"""Model-level clauses (properties/SPEC.md, section Models), run on the model ``--model`` or ``--zoo``
names, or by default on the zoo's three families at a tiny size with every position scheme.

Clauses that compare two evaluations of one model run on its float64 twin (``mut.precise``) with
the tolerance of properties.model.checks; determinism, output distribution, length and gradients
run on the model as built (``mut.native``).
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import assume, example, given, settings
from torch.utils._pytree import tree_flatten, tree_map
from hypothesis import strategies as st

from properties import clause
from properties.core import evidence
from properties.core.hooks import hooks_in_place
from properties.model.checks import extend_with_padding, is_float64_twin
from properties.model.checks import (EXAMPLES, DECODERS, Batch, assert_same_output, call_subject,
                                     difference_threshold, draw_pair, embedding_probe, forward,
                                     model_settings, only, other_real_tokens, pinned, pinned_model_property,
                                     record_model_comparison, requires, subject_args)
from properties.model.twin import observe


# ------------------------------------------------------------------------------------------ pinned shapes
# Pinned structure, drawn every run (SPEC.md: a known bug class is never a coin flip). Three samples of mixed real
# lengths, right-padded: padding that is attended, a mask over the wrong axis or inverted, statistics across the
# batch show there. An encoder-decoder's source is longer than its target (L_x != L_y) and padded differently.
MIXED = Batch(3, 5, (5, 2, 4), seed=7)
MIXED_SOURCE = Batch(3, 7, (3, 7, 6), seed=8)
# The same without padding, for the clauses that draw none.
FULL = Batch(2, 5, (5, 5), seed=9)
FULL_SOURCE = Batch(2, 7, (7, 7), seed=10)
PAIR = {"batch": MIXED, "target": MIXED, "source": MIXED_SOURCE}     # labels of draw_pair, every model kind
FULL_PAIR = {"batch": FULL, "target": FULL, "source": FULL_SOURCE}


# ---------------------------------------------------------------------------------------- MODEL-SHAPE
@clause("MODEL-SHAPE")
@pinned_model_property(PAIR, twin=False)
def test_output_shape(mut, data):
    s = mut.native
    src, tgt = draw_pair(data, s, mut.device)
    out = forward(s, src, tgt)  # call_subject() checks shape and dtype
    assert out.device == tgt[0].device, f"output on {out.device}; expected the input's device {tgt[0].device}"


# --------------------------------------------------------------------------------------- MODEL-CAUSAL
def _causal_case(s, mut, data):
    """A decoder's inputs (src is None for decoder_only) and a position i that has later positions."""
    src, (tokens, mask, b) = draw_pair(data, s, mut.device, min_len=2)
    return src, tokens, mask, b, data.draw(st.integers(0, b.length - 2), label="position i")


@clause("MODEL-CAUSAL")
@pinned_model_property(PAIR | {"position i": 1})      # sample 1 has no real position after i: padding only
def test_causal_perturbation(mut, data):
    s = only(mut.precise, *DECODERS)
    src, tokens, mask, b, i = _causal_case(s, mut, data)
    later = torch.zeros_like(mask)
    later[:, i + 1:] = True
    changed = torch.where(later & mask, other_real_tokens(tokens, b.seed + 1, s), tokens)
    before = forward(s, src, (tokens, mask))
    after = forward(s, src, (changed, mask))
    assert_same_output(after[:, : i + 1], before[:, : i + 1],
                       f"logits at positions <= {i} after changing the tokens after {i}", subject=s)


@clause("MODEL-CAUSAL")
@pinned_model_property(PAIR | {"position i": 1})
def test_causal_gradient(mut, data):
    s = only(mut.precise, *DECODERS)
    requires(s, "embedding", "only the perturbation half of MODEL-CAUSAL runs")
    src, tokens, mask, b, i = _causal_case(s, mut, data)
    with torch.enable_grad(), embedding_probe(s.embedding, tokens) as deltas:
        logits = call_subject(s, *subject_args(src, tokens, mask))
    assert len(deltas) == 1, (f"Subject.embedding was called {len(deltas)} times with the target tokens; "
                              f"expected once (the module that embeds the tokens passed to forward)")
    # Only samples whose position i is real: the outputs at padded positions are unspecified (a padded query whose
    # every key is masked may see any key, as Gemma 2's outside its window does).
    real = mask[:, i] if mask is not None else torch.ones(tokens.shape[0], dtype=torch.bool, device=tokens.device)
    assume(bool(real.any()))
    weights = torch.randn(logits[:, i].shape, generator=torch.Generator().manual_seed(b.seed), dtype=torch.float64)
    weights = weights * real[:, None].to(weights)
    if evidence.active():   # --repro-dir: the same probe and weights, the exact zero checked again
        evidence.record("model-causal-gradient", device=str(tokens.device), position=i, tokens=tokens, weights=weights,
                        real=real, args=list(subject_args(src, tokens, mask)),
                        float64=is_float64_twin(s))
    (grad,) = torch.autograd.grad((logits[:, i] * weights.to(logits)).sum(), deltas[0])
    observe(s, grad, f"gradient of the logits at position {i}")
    bad = (~torch.isfinite(grad)).any(-1).nonzero().tolist()
    assert not bad, (f"d logits[:, {i}] / d embedding is NaN or infinite at (sample, position) {bad[:6]}"
                     + (f" (the logits themselves are not finite at {i})" if not torch.isfinite(logits[:, i]).all()
                        else ""))
    assert grad[:, : i + 1].abs().sum() > 0, ("the logits do not depend on the output of Subject.embedding at "
                                              "all: it is not the token embedding feeding forward")
    leaking = ((grad[:, i + 1:] != 0).any(dim=-1) & real[:, None]).nonzero().tolist()
    assert not leaking, (f"d logits[:, {i}] / d embedding[:, j] != 0 for later positions (sample, j - {i + 1}) "
                         f"= {leaking}: position {i} sees the future")


# ----------------------------------------------------------------------------------- MODEL-DEPENDENCE
@clause("MODEL-DEPENDENCE")
@pinned_model_property(PAIR | {"source position j": 2})    # the last position that is real in every source
def test_every_target_depends_on_every_source(mut, data):
    s = only(mut.precise, "encoder_decoder")
    (src, src_mask, sb), (tgt, tgt_mask, tb) = draw_pair(data, s, mut.device)
    j = data.draw(st.integers(0, min(sb.real) - 1), label="source position j")
    changed = src.clone()
    changed[:, j] = other_real_tokens(src[:, j], sb.seed + 1, s)
    before = forward(s, (src, src_mask), (tgt, tgt_mask))
    after = forward(s, (changed, src_mask), (tgt, tgt_mask))
    tol, how = difference_threshold(s, before, (src, src_mask), (tgt, tgt_mask))
    change = (after - before).abs().amax(dim=-1)                       # (B, Lt)
    unaffected = ((change <= tol) & tgt_mask).nonzero().tolist()
    assert not unaffected, (f"changing source token {j} leaves the logits at (sample, target position) "
                            f"{unaffected} unchanged (within {tol:.1e} = {how}): the decoder ignores its source there")


# ---------------------------------------------------------------------------------- MODEL-PERMUTATION
@clause("MODEL-PERMUTATION")
@pinned_model_property(FULL_PAIR | {"permutation": (4, 2, 0, 3, 1)})
def test_permutation(mut, data):
    s = only(mut.precise, "encoder_only")
    _, (tokens, mask, b) = draw_pair(data, s, mut.device, min_len=3, padding=False)
    # Not the reversal: a position encoding symmetric in |i - j| (ALiBi in an encoder) is exactly
    # equivariant under it, and it is the only other permutation that keeps every distance.
    order = data.draw(st.permutations(range(b.length)).filter(lambda o: list(o) != list(range(len(o)))[::-1]),
                      label="permutation")
    perm = torch.tensor(order, device=mut.device)
    assume(not torch.equal(tokens[:, perm], tokens))  # a permutation that changes the input
    out = forward(s, None, (tokens, mask))
    permuted = forward(s, None, (tokens[:, perm], mask))
    if not s.positional:
        assert_same_output(permuted, out[:, perm], f"output for permuted tokens vs permuted output {order}", subject=s)
        return
    tol, how = difference_threshold(s, out, None, (tokens, mask))
    assert (permuted - out[:, perm]).abs().max() > tol, (
        f"permuting the tokens by {order} permutes the output (within {tol:.1e} = {how}) although "
        f"Subject.positional is True: the model ignores token order")


# ---------------------------------------------------------------------------------------- MODEL-BATCH
@clause("MODEL-BATCH")
@pinned_model_property(PAIR)
def test_batch_independence(mut, data):
    s = mut.precise
    src, (tokens, mask, b) = draw_pair(data, s, mut.device, max_size=4)
    together = forward(s, src, (tokens, mask))
    for k in range(b.size):
        alone_src = src and (src[0][k:k + 1], src[1][k:k + 1])
        alone = forward(s, alone_src, (tokens[k:k + 1], mask[k:k + 1]))
        real = mask[k]
        assert_same_output(together[k], alone[0], f"sample {k} inside a batch of {b.size} vs alone (real positions)",
                           subject=s, where=real)


# -------------------------------------------------------------------------------------- MODEL-PADDING
def _padding_case(mut, data, left: bool):
    s = mut.precise
    src, (tokens, mask, b) = draw_pair(data, s, mut.device, reserve=1)
    k_tgt = data.draw(st.integers(0 if src is not None else 1, s.max_len - b.length), label="pads (target)"
                      if src is not None else "pads")
    k_src = data.draw(st.integers(0 if k_tgt else 1, s.max_len - src[2].length), label="pads (source)") \
        if src is not None else 0
    before = forward(s, src, (tokens, mask))
    padded_src = src and extend_with_padding(src[0], src[1], k_src, s.pad_id, left)
    after = forward(s, padded_src, extend_with_padding(tokens, mask, k_tgt, s.pad_id, left))
    after = after[:, k_tgt:] if left else after[:, : b.length]
    side = "prepending" if left else "appending"
    assert_same_output(after, before, f"real positions after {side} {k_tgt} padded positions"
                       + (f" to the target and {k_src} to the source" if src is not None else ""), subject=s,
                       where=mask)


# Two pads after a batch of mixed lengths (so its samples already end in different numbers of pads); an
# encoder-decoder gets one on the target and two on the source (a dropped memory mask shows only there).
PADS = {"pads": 2, "pads (target)": 1, "pads (source)": 2}


@clause("MODEL-PADDING")
@pinned_model_property(PAIR | PADS)
def test_right_padding(mut, data):
    _padding_case(mut, data, left=False)


@clause("MODEL-PADDING")
@pinned_model_property(PAIR | PADS)
def test_left_padding(mut, data):
    if not mut.precise.left_padding:
        pytest.skip("Subject.left_padding is False: the model does not claim left-padding invariance")
    _padding_case(mut, data, left=True)


@clause("MODEL-PADDING")
@pinned_model_property(FULL_PAIR)
def test_mask_none_means_all_real(mut, data):
    s = mut.precise
    src, (tokens, mask, _) = draw_pair(data, s, mut.device, padding=False)
    with_mask = forward(s, src, (tokens, mask))
    without = forward(s, src and (src[0], None), (tokens, None))
    assert_same_output(without, with_mask, "mask=None vs an all-True mask", subject=s)


# ---------------------------------------------------------------------------------- MODEL-DETERMINISM
@clause("MODEL-DETERMINISM")
@model_settings
@example(data=pinned(PAIR), seeds=(0, 1))
@given(data=st.data(), seeds=st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1)))
def test_eval_determinism(mut, data, seeds):
    s = mut.native
    src, tgt = draw_pair(data, s, mut.device)
    outs = []
    devices = [mut.device] if mut.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):  # leave the global random state as it was
        for seed in seeds:
            torch.manual_seed(seed)
            outs.append(forward(s, src, tgt))
    if evidence.active() and outs[0].shape == outs[1].shape:   # --repro-dir: the two seeded passes, compared bitwise
        record_model_comparison(outs[1], outs[0], "the second forward pass under another random seed", 0.0,
                                 seeds=list(seeds), bitwise=True)
    same = outs[0].isnan() & outs[1].isnan() | (outs[0] == outs[1])
    if not same.all():
        with torch.random.fork_rng(devices=devices):
            where = _first_random_module(s, src, tgt, seeds)
        raise AssertionError(
            f"two eval-mode forward passes on the same input differ at {int((~same).sum())} of {same.numel()} output "
            f"elements (max {(outs[0] - outs[1]).abs().nan_to_num(0).max().item():.3e}) under torch seeds {seeds}"
            f"{where}; hint: a random operation left on in eval mode (dropout, router jitter noise, sampling)")


def _bitwise(a, b) -> bool:
    ta = [t for t in tree_flatten(a)[0] if torch.is_tensor(t)]
    tb = [t for t in tree_flatten(b)[0] if torch.is_tensor(t)]
    return len(ta) == len(tb) and all(x.shape == y.shape and bool((x.isnan() & y.isnan() | (x == y)).all())
                                      for x, y in zip(ta, tb))


def _first_random_module(s, src, tgt, seeds) -> str:
    """Where the randomness enters: the first module (in the order calls finish: the innermost first) whose inputs
    are bitwise equal in the two seeded passes and whose outputs are not. "" without Subject.module."""
    if s.module is None:
        return ""
    names = {id(m): n or type(m).__name__ for n, m in s.module.named_modules()}
    calls: list[list] = [[], []]

    def hooks(run: int):
        inputs: dict[int, list] = {}

        def before(module, args, kwargs):
            inputs.setdefault(id(module), []).append(tree_map(_copy, (args, kwargs)))

        def after(module, args, kwargs, output):
            calls[run].append((id(module), inputs[id(module)].pop(), tree_map(_copy, output)))
        return [h for m in s.module.modules() for h in (m.register_forward_pre_hook(before, with_kwargs=True),
                                                       m.register_forward_hook(after, with_kwargs=True))]
    for run, seed in enumerate(seeds):
        with hooks_in_place(hooks(run)):
            torch.manual_seed(seed)
            forward(s, src, tgt)
    for (key, args_a, out_a), (other, args_b, out_b) in zip(*calls):
        if key == other and _bitwise(args_a, args_b) and not _bitwise(out_a, out_b):
            module = next(m for m in s.module.modules() if id(m) == key)
            return (f": the first module whose output changes with the seed while its inputs are bitwise equal is "
                    f"{names[key]} ({type(module).__name__})")
    return ""


def _copy(value):
    return value.detach().clone() if torch.is_tensor(value) else value


# --------------------------------------------------------------------------------- MODEL-DISTRIBUTION
@clause("MODEL-DISTRIBUTION")
@pinned_model_property(PAIR, twin=False)
def test_output_distribution(mut, data):
    s = only(mut.native, *DECODERS)
    src, (tokens, mask, _) = draw_pair(data, s, mut.device)
    logits = forward(s, src, (tokens, mask))[mask]       # (real positions, V)
    log_p = torch.log_softmax(logits, dim=-1)
    bad = (~torch.isfinite(log_p)).any(-1).nonzero().flatten().tolist()
    assert not bad, f"log-probabilities not finite at {len(bad)} real positions (flattened indices {bad[:5]})"
    # The softmax in the logits' dtype: each p_i has relative error <= (V + 2) u, their sum adds V u.
    u = torch.finfo(logits.dtype).eps / 2
    bound = (2 * s.vocab_size + 3) * u
    total = torch.softmax(logits, dim=-1).double().sum(-1)
    worst = (total - 1).abs().max().item()
    assert worst <= bound, f"softmax of the logits sums to 1 +- {worst:.3e}; expected within {bound:.3e}"


# ------------------------------------------------------------------------------------- MODEL-GRADIENT
# One source sample of two equal tokens (ids drawn for a vocabulary of 64): a CI run drew it.
REPEATED_SOURCE = {"batch": Batch(1, 2, (2,), seed=0), "target": Batch(1, 2, (2,), seed=0),
                   "source": Batch(1, 2, (2,), seed=176)}


@clause("MODEL-GRADIENT")
@settings(model_settings, max_examples=max(2, EXAMPLES // 2))
@example(data=pinned(FULL_PAIR))
@example(data=pinned(REPEATED_SOURCE))
@given(data=st.data())
def test_every_parameter_gets_a_gradient(mut, data):
    s = mut.native
    requires(s, "module", "the parameters are unknown")
    # Two real positions at least: with one key, softmax weights are constant and the query and key
    # projections get exactly zero gradient although they are used.
    src, (tokens, mask, b) = draw_pair(data, s, mut.device, min_len=2, padding=False)
    # And two different tokens in each sequence, the source's too: equal tokens give equal values (rotary turns
    # only queries and keys), so the softmax weights, and with them the query and key projections, do not matter.
    for sequence, _, batch in filter(None, (src, (tokens, mask, b))):
        if bool(sequence[0, 1] == sequence[0, 0]):
            sequence[0, 1] = other_real_tokens(sequence[0, :1], batch.seed, s)[0]
    named = [(n, p) for n, p in s.module.named_parameters() if p.requires_grad and n not in s.unused_parameters]
    with torch.enable_grad():
        out = call_subject(s, *subject_args(src, tokens, mask))
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(b.seed), dtype=torch.float64)
        grads = torch.autograd.grad((out * weights.to(out)).sum(), [p for _, p in named], allow_unused=True)
    # Reached: autograd gets from the output to every parameter. Non-zero: required of matrices and
    # tables; a bias or gain need only be reached, because softmax ignores a constant added to a
    # row of scores, so the key-projection bias has zero gradient in exact arithmetic.
    dead = [n for (n, p), g in zip(named, grads) if g is None or (p.dim() >= 2 and not bool((g != 0).any()))]
    assert not dead, (f"{len(dead)} of {len(named)} parameters get no gradient (not reached, or exactly 0 for a "
                      f"matrix): {dead[:8]}")
