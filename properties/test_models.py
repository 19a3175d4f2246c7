"""Model-level clauses (properties/SPEC.md, section Models), run on the model ``--model`` or ``--zoo``
names, or by default on the zoo's three families at a tiny size with every position scheme.

Clauses that compare two evaluations of one model run on its float64 twin (``mut.precise``) with
the tolerance of properties.model_checks; determinism, output distribution, length and gradients
run on the model as built (``mut.native``).
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from properties import clause
from properties.model_checks import (DRAW_LEN, Batch, assert_same_output, batches, call, comparison_tolerance,
                                     embedding_probe, real_tokens)
from properties.model_options import model_under_test, subject_ids
from properties.subject import Subject

pytestmark = pytest.mark.model

# Half the profile's examples, at least 6: each model example runs whole forward passes and the
# default suite has twelve models. The thorough profile scales this up with its own count.
EXAMPLES = max(6, settings().max_examples // 2)
model_settings = settings(max_examples=EXAMPLES, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.differing_executors])
DECODERS = ("decoder_only", "encoder_decoder")


def pytest_generate_tests(metafunc):
    if "mut" in metafunc.fixturenames:
        metafunc.parametrize("mut", subject_ids(metafunc.config), indirect=True)


@pytest.fixture(scope="session")
def mut(request):
    return model_under_test(request.config, request.param)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # The models here are tiny: intra-op threads add only synchronisation, which on a loaded 2-core
    # machine made this module 20x slower. Restored afterwards for the other suites.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def only(subject: Subject, *kinds: str) -> None:
    if subject.kind not in kinds:
        pytest.skip(f"applies to {' and '.join(kinds)}, not {subject.kind}")


def draw_len(subject: Subject, reserve: int = 0) -> int:
    return min(DRAW_LEN, subject.max_len - reserve)


def forward(s: Subject, src: tuple | None, tgt: tuple):
    """tgt/src are (tokens, mask); src only for encoder_decoder. No autograd unless asked for."""
    with torch.no_grad():
        return call(s, *(src[0], tgt[0], src[1], tgt[1]) if src is not None else tgt)


def draw_pair(data, s: Subject, device, *, min_len=1, padding=True, reserve=0, size=None, max_size=3):
    """(src, tgt) as (tokens, mask, Batch); src is None unless the subject is an encoder-decoder."""
    tgt_b = data.draw(batches(draw_len(s, reserve), min_len=min_len, padding=padding, size=size,
                              max_size=max_size), label="batch" if s.kind != "encoder_decoder" else "target")
    src = None
    if s.kind == "encoder_decoder":
        src_b = data.draw(batches(draw_len(s, reserve), min_len=min_len, padding=padding, size=tgt_b.size),
                          label="source")
        src_b = Batch(src_b.size, src_b.length, src_b.real, src_b.seed + 2**17)  # other ids than the target's
        src = (src_b.tokens(s, device), src_b.mask(device), src_b)
    tgt = (tgt_b.tokens(s, device), tgt_b.mask(device), tgt_b)
    if src is not None and torch.equal(src[0], tgt[0]):
        # Equal source and target would make the shared embedding's calls indistinguishable.
        src[0][0, 0] = other_real_tokens(src[0][0, :1], src_b.seed, s)[0]
    return src, tgt


def other_real_tokens(old: torch.Tensor, seed: int, s: Subject) -> torch.Tensor:
    """For each id a uniformly drawn real id different from it (and from pad_id)."""
    r = torch.randint(0, s.vocab_size - 2, tuple(old.shape), generator=torch.Generator().manual_seed(seed))
    r = r.to(old.device)
    low, high = torch.minimum(old, torch.full_like(old, s.pad_id)), torch.maximum(old, torch.full_like(old, s.pad_id))
    r = r + (r >= low).long()
    return r + (r >= high).long()


# ---------------------------------------------------------------------------------------- MODEL-SHAPE
@clause("MODEL-SHAPE")
@model_settings
@given(data=st.data())
def test_output_shape(mut, data):
    s = mut.native
    src, tgt = draw_pair(data, s, mut.device)
    out = forward(s, src and src[:2], tgt[:2])  # call() checks shape and dtype
    assert out.device == tgt[0].device, f"output on {out.device}; expected the input's device {tgt[0].device}"


# --------------------------------------------------------------------------------------- MODEL-CAUSAL
@clause("MODEL-CAUSAL")
@model_settings
@given(data=st.data())
def test_causal_perturbation(mut, data):
    s = mut.precise
    only(s, *DECODERS)
    src, (tokens, mask, b) = draw_pair(data, s, mut.device, min_len=2)
    i = data.draw(st.integers(0, b.length - 2), label="position i")
    later = torch.zeros_like(mask)
    later[:, i + 1:] = True
    changed = torch.where(later & mask, other_real_tokens(tokens, b.seed + 1, s), tokens)
    before = forward(s, src and src[:2], (tokens, mask))
    after = forward(s, src and src[:2], (changed, mask))
    assert_same_output(after[:, : i + 1], before[:, : i + 1],
                       f"logits at positions <= {i} after changing the tokens after {i}")


@clause("MODEL-CAUSAL")
@model_settings
@given(data=st.data())
def test_causal_gradient(mut, data):
    s = mut.precise
    only(s, *DECODERS)
    if s.embedding is None:
        pytest.skip("Subject.embedding is None: only the perturbation half of MODEL-CAUSAL runs")
    src, (tokens, mask, b) = draw_pair(data, s, mut.device, min_len=2)
    i = data.draw(st.integers(0, b.length - 2), label="position i")
    with torch.enable_grad(), embedding_probe(s.embedding, tokens) as deltas:
        logits = call(s, *(src[0], tokens, src[1], mask) if src is not None else (tokens, mask))
    assert len(deltas) == 1, (f"Subject.embedding was called {len(deltas)} times with the target tokens; "
                              f"expected once (the module that embeds the tokens passed to forward)")
    weights = torch.randn(logits[:, i].shape, generator=torch.Generator().manual_seed(b.seed), dtype=torch.float64)
    (grad,) = torch.autograd.grad((logits[:, i] * weights.to(logits)).sum(), deltas[0])
    assert grad[:, : i + 1].abs().sum() > 0, ("the logits do not depend on the output of Subject.embedding at "
                                              "all: it is not the token embedding feeding forward")
    leaking = (grad[:, i + 1:] != 0).any(dim=-1).nonzero().tolist()
    assert not leaking, (f"d logits[:, {i}] / d embedding[:, j] != 0 for later positions (sample, j - {i + 1}) "
                         f"= {leaking}: position {i} sees the future")


# ----------------------------------------------------------------------------------- MODEL-DEPENDENCE
@clause("MODEL-DEPENDENCE")
@model_settings
@given(data=st.data())
def test_every_target_depends_on_every_source(mut, data):
    s = mut.precise
    only(s, "encoder_decoder")
    (src, src_mask, sb), (tgt, tgt_mask, tb) = draw_pair(data, s, mut.device)
    j = data.draw(st.integers(0, min(sb.real) - 1), label="source position j")
    changed = src.clone()
    changed[:, j] = other_real_tokens(src[:, j], sb.seed + 1, s)
    before = forward(s, (src, src_mask), (tgt, tgt_mask))
    after = forward(s, (changed, src_mask), (tgt, tgt_mask))
    tol = comparison_tolerance(before)
    change = (after - before).abs().amax(dim=-1)                       # (B, Lt)
    unaffected = ((change <= tol) & tgt_mask).nonzero().tolist()
    assert not unaffected, (f"changing source token {j} leaves the logits at (sample, target position) "
                            f"{unaffected} unchanged (within {tol:.1e}): the decoder ignores its source there")


# ---------------------------------------------------------------------------------- MODEL-PERMUTATION
@clause("MODEL-PERMUTATION")
@model_settings
@given(data=st.data())
def test_permutation(mut, data):
    s = mut.precise
    only(s, "encoder_only")
    _, (tokens, mask, b) = draw_pair(data, s, mut.device, min_len=2, padding=False)
    order = data.draw(st.permutations(range(b.length)), label="permutation")
    perm = torch.tensor(order, device=mut.device)
    assume(not torch.equal(tokens[:, perm], tokens))  # a permutation that changes the input
    out = forward(s, None, (tokens, mask))
    permuted = forward(s, None, (tokens[:, perm], mask))
    if not s.positional:
        assert_same_output(permuted, out[:, perm], f"output for permuted tokens vs permuted output {order}")
        return
    tol = comparison_tolerance(out)
    assert (permuted - out[:, perm]).abs().max() > tol, (
        f"permuting the tokens by {order} permutes the output (within {tol:.1e}) although Subject.positional "
        f"is True: the model ignores token order")


# ---------------------------------------------------------------------------------------- MODEL-BATCH
@clause("MODEL-BATCH")
@model_settings
@given(data=st.data())
def test_batch_independence(mut, data):
    s = mut.precise
    src, (tokens, mask, b) = draw_pair(data, s, mut.device, max_size=4)
    together = forward(s, src and src[:2], (tokens, mask))
    for k in range(b.size):
        alone_src = src and (src[0][k:k + 1], src[1][k:k + 1])
        alone = forward(s, alone_src, (tokens[k:k + 1], mask[k:k + 1]))
        real = mask[k]
        assert_same_output(together[k][real], alone[0][real],
                           f"sample {k} inside a batch of {b.size} vs alone (real positions)")


# -------------------------------------------------------------------------------------- MODEL-PADDING
def _pad(tokens, mask, k: int, pad_id: int, left: bool):
    pads = torch.full((tokens.shape[0], k), pad_id, dtype=tokens.dtype, device=tokens.device)
    off = torch.zeros((mask.shape[0], k), dtype=torch.bool, device=mask.device)
    if left:
        return torch.cat([pads, tokens], 1), torch.cat([off, mask], 1)
    return torch.cat([tokens, pads], 1), torch.cat([mask, off], 1)


def _padding_case(mut, data, left: bool):
    s = mut.precise
    src, (tokens, mask, b) = draw_pair(data, s, mut.device, reserve=1)
    k_tgt = data.draw(st.integers(0 if src is not None else 1, s.max_len - b.length), label="pads (target)"
                      if src is not None else "pads")
    k_src = data.draw(st.integers(0 if k_tgt else 1, s.max_len - src[2].length), label="pads (source)") \
        if src is not None else 0
    before = forward(s, src and src[:2], (tokens, mask))
    padded_src = src and _pad(src[0], src[1], k_src, s.pad_id, left)
    after = forward(s, padded_src, _pad(tokens, mask, k_tgt, s.pad_id, left))
    after = after[:, k_tgt:] if left else after[:, : b.length]
    side = "prepending" if left else "appending"
    assert_same_output(after[mask], before[mask], f"real positions after {side} {k_tgt} padded positions"
                       + (f" to the target and {k_src} to the source" if src is not None else ""))


@clause("MODEL-PADDING")
@model_settings
@given(data=st.data())
def test_right_padding(mut, data):
    _padding_case(mut, data, left=False)


@clause("MODEL-PADDING")
@model_settings
@given(data=st.data())
def test_left_padding(mut, data):
    if not mut.precise.left_padding:
        pytest.skip("Subject.left_padding is False: the model does not claim left-padding invariance")
    _padding_case(mut, data, left=True)


@clause("MODEL-PADDING")
@model_settings
@given(data=st.data())
def test_mask_none_means_all_real(mut, data):
    s = mut.precise
    src, (tokens, mask, _) = draw_pair(data, s, mut.device, padding=False)
    with_mask = forward(s, src and src[:2], (tokens, mask))
    without = forward(s, src and (src[0], None), (tokens, None))
    assert_same_output(without, with_mask, "mask=None vs an all-True mask")


# ---------------------------------------------------------------------------------- MODEL-DETERMINISM
@clause("MODEL-DETERMINISM")
@model_settings
@given(data=st.data(), seeds=st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1)))
def test_eval_determinism(mut, data, seeds):
    s = mut.native
    src, tgt = draw_pair(data, s, mut.device)
    outs = []
    devices = [mut.device] if mut.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):  # leave the global random state as it was
        for seed in seeds:
            torch.manual_seed(seed)
            outs.append(forward(s, src and src[:2], tgt[:2]))
    same = outs[0].isnan() & outs[1].isnan() | (outs[0] == outs[1])
    assert same.all(), (f"two forward passes on the same input differ at {int((~same).sum())} elements "
                        f"(max {(outs[0] - outs[1]).abs().nan_to_num(0).max().item():.3e}) under random seeds "
                        f"{seeds}: randomness (dropout?) is active in eval mode")


# --------------------------------------------------------------------------------- MODEL-DISTRIBUTION
@clause("MODEL-DISTRIBUTION")
@model_settings
@given(data=st.data())
def test_output_distribution(mut, data):
    s = mut.native
    only(s, *DECODERS)
    src, (tokens, mask, _) = draw_pair(data, s, mut.device)
    logits = forward(s, src and src[:2], (tokens, mask))[mask]       # (real positions, V)
    log_p = torch.log_softmax(logits, dim=-1)
    bad = (~torch.isfinite(log_p)).any(-1).nonzero().flatten().tolist()
    assert not bad, f"log-probabilities not finite at {len(bad)} real positions (flattened indices {bad[:5]})"
    # The softmax in the logits' dtype: each p_i has relative error <= (V + 2) u, their sum adds V u.
    u = torch.finfo(logits.dtype).eps / 2
    bound = (2 * s.vocab_size + 3) * u
    total = torch.softmax(logits, dim=-1).double().sum(-1)
    worst = (total - 1).abs().max().item()
    assert worst <= bound, f"softmax of the logits sums to 1 +- {worst:.3e}; expected within {bound:.3e}"


# --------------------------------------------------------------------- MODEL-FACTORISATION, MODEL-KV-CACHE
def _log_p(logits: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.double(), -1).gather(-1, next_tokens[..., None])[..., 0]


@clause("MODEL-FACTORISATION")
@settings(model_settings, max_examples=max(2, EXAMPLES // 2))
@given(data=st.data())
def test_autoregressive_factorisation(mut, data):
    s = mut.precise
    only(s, *DECODERS)
    src, (y, mask, b) = draw_pair(data, s, mut.device, min_len=2, padding=False, max_size=2)
    full = forward(s, src and src[:2], (y, mask))
    one_pass = _log_p(full[:, :-1], y[:, 1:])                                   # log p(y_k | y_<k), k >= 1
    steps = torch.stack([_log_p(forward(s, src and src[:2], (y[:, :k], mask[:, :k]))[:, -1], y[:, k])
                         for k in range(1, b.length)], dim=1)
    # log_softmax is 2-Lipschitz in the max norm: twice the logits' tolerance bounds each term.
    tol = 2 * comparison_tolerance(full)
    diff = (steps - one_pass).abs()
    assert diff.max() <= tol, (f"log p(y_k | y_<k) from prefix y_<k differs from the one-pass value by "
                               f"{diff.max().item():.3e} at (sample, k - 1) = "
                               f"{tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))} "
                               f"(tolerance {tol:.1e}); totals {steps.sum(1).tolist()} vs {one_pass.sum(1).tolist()}")


@clause("MODEL-KV-CACHE")
@model_settings
@given(data=st.data())
def test_cached_decoding(mut, data):
    s = mut.precise
    only(s, *DECODERS)
    if s.decode_step is None:
        pytest.skip("Subject.decode_step is None: the model offers no cached incremental decoding")
    src, (tokens, mask, b) = draw_pair(data, s, mut.device, min_len=2)
    cuts = sorted(data.draw(st.sets(st.integers(1, b.length - 1), max_size=3), label="chunk boundaries"))
    full = forward(s, src and src[:2], (tokens, mask))
    state = None
    for start, end in zip([0, *cuts], [*cuts, b.length]):
        def step(*args):
            nonlocal state
            logits, state = s.decode_step(*args, state)
            return logits
        chunk = (tokens[:, start:end], mask[:, :end])
        with torch.no_grad():
            args = (src[0], chunk[0], src[1], chunk[1]) if src is not None else chunk
            logits = call(s, *args, fn=step)
        real = mask[:, start:end]
        assert_same_output(logits[real], full[:, start:end][real],
                           f"cached decoding of positions {start}..{end - 1} (chunks {[0, *cuts, b.length]}) "
                           f"vs the full forward pass")


# --------------------------------------------------------------------------------------- MODEL-LENGTH
@clause("MODEL-LENGTH")
@model_settings
@given(data=st.data())
def test_every_length_up_to_max_len(mut, data):
    s = mut.native
    length = data.draw(st.integers(1, s.max_len), label="length")
    batch = Batch(1, length, (length,), data.draw(st.integers(0, 2**16), label="seed"))
    tokens, mask = batch.tokens(s, mut.device), batch.mask(mut.device)
    out = forward(s, (tokens, mask) if s.kind == "encoder_decoder" else None, (tokens, mask))
    assert torch.isfinite(out).all(), f"non-finite output at length {length} <= max_len={s.max_len}"


@clause("MODEL-LENGTH")
@model_settings
@given(data=st.data())
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
    try:
        out = forward(s, src, (tgt, ones(tgt)))
    except AssertionError:
        raise
    except Exception as exc:
        message = str(exc).strip()
        assert not s.extrapolates, (f"{side} of length {s.max_len + extra} > max_len raised {type(exc).__name__}: "
                                    f"{message.splitlines()[0] if message else ''} although Subject.extrapolates")
        assert message and "\n" not in message, (
            f"{side} of length {s.max_len + extra} > max_len={s.max_len} raised {type(exc).__name__} "
            f"with {'no message' if not message else 'a message of several lines'}; expected a one-line error")
        return
    assert s.extrapolates, (f"{side} of length {s.max_len + extra} > max_len={s.max_len} returned an output; "
                            f"expected an error (or Subject.extrapolates=True for a model without a length limit)")
    assert torch.isfinite(out).all(), f"non-finite output for a {side} of length {s.max_len + extra}"


# ------------------------------------------------------------------------------------- MODEL-GRADIENT
@clause("MODEL-GRADIENT")
@settings(model_settings, max_examples=max(2, EXAMPLES // 2))
@given(data=st.data())
def test_every_parameter_gets_a_gradient(mut, data):
    s = mut.native
    if s.module is None:
        pytest.skip("Subject.module is None: the parameters are unknown")
    # Two real positions at least: with one key, softmax weights are constant and the query and key
    # projections get exactly zero gradient although they are used.
    src, (tokens, mask, b) = draw_pair(data, s, mut.device, min_len=2, padding=False)
    named = [(n, p) for n, p in s.module.named_parameters() if p.requires_grad]
    with torch.enable_grad():
        out = call(s, *(src[0], tokens, src[1], mask) if src is not None else (tokens, mask))
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(b.seed), dtype=torch.float64)
        grads = torch.autograd.grad((out * weights.to(out)).sum(), [p for _, p in named], allow_unused=True)
    # Reached: autograd gets from the output to every parameter. Non-zero: required of matrices and
    # tables; a bias or gain need only be reached, because softmax ignores a constant added to a
    # row of scores, so the key-projection bias has zero gradient in exact arithmetic.
    dead = [n for (n, p), g in zip(named, grads) if g is None or (p.dim() >= 2 and not bool((g != 0).any()))]
    assert not dead, (f"{len(dead)} of {len(named)} parameters get no gradient (not reached, or exactly 0 for a "
                      f"matrix): {dead[:8]}")
