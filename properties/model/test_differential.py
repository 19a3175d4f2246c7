"""Differential clauses (SPEC.md, "Decoding and differential clauses"): the model under test against the model
``--reference`` names — outputs (MODEL-DIFF-FORWARD), parameter gradients (MODEL-DIFF-GRADIENT) and cached decoding
(MODEL-DIFF-DECODE). Skipped, with the reason, without ``--reference``.

Each clause runs twice: on the float64 twins (both models cast to float64, where a defect of a percent stands far
above rounding) and on the models as built (where a fast path that only the narrow dtype takes shows). The bound is
the sum of what each model's own precision allows: its comparison tolerance (2^21 u max|y| for a float64
computation, else 16 u_eff max|y| or 16 times its noise measured at start-up; properties/model/checks.py) plus 16
times its noise measured on the very input of the example (each sample inside the batch against alone).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import pytest
import torch
from hypothesis import Phase, settings, strategies as st

from properties import clause
from properties.core import evidence
from properties.core.strategies import pinned_property
from properties.model.checks import (DECODERS, Batch, batches, call_subject, comparison_tolerance, model_settings,
                                     only, pinned, real_tokens, subject_args)
from properties.model.precision import OWN_NOISE
from properties.model.test_models import MIXED, MIXED_SOURCE

DIFF_DECODE_LEN = 64    # positions decoded at most (at least 32 where max_len permits: past a split-KV block)
# Examples from the profile loaded for this run (read when pytest imports this module, after the plugin has loaded
# --hypothesis-profile): forward 4 and the others 2 at `default`; 133 and 66 at `thorough`.
PROFILE = settings().max_examples
FORWARD_EXAMPLES, OTHER_EXAMPLES = max(4, PROFILE // 3), max(2, PROFILE // 6)
ARRANGEMENTS = ("float64", "as-built")


def differential_property(data, **options):
    """The stack of every differential clause: once per arrangement, the model settings with ``options``, first
    on the pinned ``data`` (a PinnedData), then on drawn data."""
    def decorate(test):
        test = pinned_property(settings(model_settings, **options), {"data": st.data()}, {"data": data})(test)
        return pytest.mark.parametrize("arrangement", ARRANGEMENTS)(test)
    return decorate


# Pinned inputs of the forward and gradient clauses (drawn every run): three samples of mixed real lengths, and an
# encoder-decoder's source longer than its target (test_models.py: MIXED, MIXED_SOURCE).
PINNED_INPUTS = {"batch": MIXED, "source": MIXED_SOURCE}


def _pair(mut, reference, arrangement: str):
    """(model under test, reference) in the arrangement; a skip when it does not exist."""
    if arrangement == "as-built":
        return mut.native, reference.native
    if mut.precise is mut.native or reference.precise is reference.native:
        pytest.skip(f"no float64 pair ({mut.precise_note or reference.note or 'no float64 twin'}): "
                    f"the models are compared as built")
    return mut.precise, reference.precise


def _common_ids(ids: torch.Tensor, mask: torch.Tensor, a, r) -> tuple[torch.Tensor, torch.Tensor]:
    """The ids each model sees: real ids that are neither model's pad id, each model's own pad id elsewhere."""
    if a.pad_id != r.pad_id:
        third = next(i for i in range(3) if i not in (a.pad_id, r.pad_id))
        ids = torch.where(ids == r.pad_id, torch.full_like(ids, third), ids)
    pad = lambda s: torch.where(mask, ids, torch.full_like(ids, s.pad_id))  # noqa: E731
    return pad(a), pad(r)


def _draw_inputs(data, a, r, device, *, min_len=1, max_size=3):
    """Per model (src, tgt) as (tokens, mask); src None unless encoder-decoder; the Batch of the target."""
    limit = min(8, a.max_len, r.max_len)
    tb = data.draw(batches(limit, min_len=min_len, max_size=max_size), label="batch")
    sb = data.draw(batches(limit, size=tb.size), label="source") if a.kind == "encoder_decoder" else None

    def sides(b: Batch, offset: int):
        ids = real_tokens(torch.Generator().manual_seed(b.seed + offset), (b.size, b.length), a, device)
        return _common_ids(ids, b.mask(device), a, r) + (b.mask(device),)
    ta, tr, tm = sides(tb, 0)
    if sb is None:
        return (None, (ta, tm)), (None, (tr, tm)), tb
    sa, sr, sm = sides(sb, 2**17)
    return ((sa, sm), (ta, tm)), ((sr, sm), (tr, tm)), tb


def _run(s, src, tgt, rows=slice(None)):
    part = src and (src[0][rows], src[1][rows])
    return call_subject(s, *subject_args(part, tgt[0][rows], tgt[1][rows]))


def _noise(s, src, tgt) -> float:
    """max |f(batch)_b - f(sample b alone)| over samples and real positions: rounding no defect can cause."""
    with torch.no_grad():
        together = _run(s, src, tgt).double()
        worst = 0.0
        for b in range(tgt[0].shape[0]):
            alone = _run(s, src, tgt, slice(b, b + 1)).double()[0]
            diff = (together[b] - alone).abs()[tgt[1][b]]
            worst = max(worst, float(diff.nan_to_num(float("inf")).max()) if diff.numel() else 0.0)
    return worst


def _bound(a, r, ya, yr, noise_a, noise_r) -> tuple[float, str]:
    ta, tr = comparison_tolerance(ya, a), comparison_tolerance(yr, r)
    bound = ta + tr + OWN_NOISE * (noise_a + noise_r)
    return bound, (f"{ta:.1e} + {tr:.1e} (each model's own tolerance) + {OWN_NOISE} x ({noise_a:.1e} + "
                   f"{noise_r:.1e}) (their noise measured on this input)")


def _first_parting(diff: torch.Tensor, bound: float) -> tuple[int, ...] | None:
    """The first index (in row-major order) where diff exceeds bound, or None."""
    over = (diff.nan_to_num(float("inf")) > bound).nonzero()
    return tuple(int(i) for i in over[0]) if len(over) else None


def _record(mut, reference, arrangement: str, what: str, args_a, args_r, mask, bound: float, cuts, **more) -> None:
    """--repro-dir: both models' inputs, the bound, and the chunks decoded (None: one forward pass; ``more``: the
    gradient clause's loss weights and parameter names)."""
    if evidence.active():
        evidence.record("model-diff", device=str(mut.device), what=f"{arrangement}: {what}",
                        reference_factory=reference.spec, float64=arrangement == "float64", first=list(args_a),
                        second=list(args_r), mask=mask, bound=float(bound), cuts=cuts, **more)


# --------------------------------------------------------------------------------------- MODEL-DIFF-FORWARD
@clause("MODEL-DIFF-FORWARD")
@differential_property(pinned(PINNED_INPUTS), max_examples=FORWARD_EXAMPLES)
def test_outputs_agree_with_the_reference(mut, reference, arrangement, data):
    a, r = _pair(mut, reference, arrangement)
    (src_a, tgt_a), (src_r, tgt_r), b = _draw_inputs(data, a, r, mut.device)
    with torch.no_grad():
        ya, yr = _run(a, src_a, tgt_a), _run(r, src_r, tgt_r)
    if ya.shape != yr.shape:
        raise AssertionError(f"output shapes differ: {tuple(ya.shape)} (model under test) vs {tuple(yr.shape)} "
                             f"(reference {reference.spec})")
    mask = tgt_a[1]
    bound, how = _bound(a, r, ya[mask], yr[mask], _noise(a, src_a, tgt_a), _noise(r, src_r, tgt_r))
    _record(mut, reference, arrangement, "the outputs", subject_args(src_a, *tgt_a), subject_args(src_r, *tgt_r), mask,
            bound, None)
    diff = (ya.double() - yr.double()).abs().amax(-1).masked_fill(~mask, 0)      # (B, L)
    first = _first_parting(diff, bound)
    if first is not None:
        worst = float(diff.nan_to_num(float("inf")).max())
        raise AssertionError(
            f"{arrangement}: the outputs part from the reference {reference.spec} first at (sample, position) "
            f"{first} by {float(diff[first]):.3e} (largest difference {worst:.3e}, max|y| "
            f"{float(yr[mask].abs().max()):.3e}); bound {bound:.3e} = {how} [batch of real lengths {b.real}]")


# -------------------------------------------------------------------------------------- MODEL-DIFF-GRADIENT
def _loss_gradients(s, src, tgt, r, rows=slice(None)) -> dict[str, torch.Tensor]:
    named = [(n, p) for n, p in s.module.named_parameters() if p.requires_grad]
    with torch.enable_grad():
        out = _run(s, src, tgt, rows)
        loss = (out * r[rows, : out.shape[1]].to(out))[tgt[1][rows]].sum()
        grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
    return {n: (torch.zeros_like(p) if g is None else g).double() for (n, p), g in zip(named, grads)}


def _gradient_noise(s, src, tgt, r, names) -> tuple[dict, float]:
    """The batch's gradients and max |batch gradient - sum of the samples' gradients| over ``names``."""
    together = _loss_gradients(s, src, tgt, r)
    alone = [_loss_gradients(s, src, tgt, r, slice(b, b + 1)) for b in range(tgt[0].shape[0])]
    worst = 0.0
    for n in names:
        diff = (together[n] - sum(sample[n] for sample in alone)).abs()
        worst = max(worst, float(diff.nan_to_num(float("inf")).max()) if diff.numel() else 0.0)
    return together, worst


@clause("MODEL-DIFF-GRADIENT")
@differential_property(pinned(PINNED_INPUTS), max_examples=OTHER_EXAMPLES)
def test_gradients_agree_with_the_reference(mut, reference, arrangement, data):
    a, r = _pair(mut, reference, arrangement)
    for s, who in ((a, "the model under test"), (r, f"the reference {reference.spec}")):
        if s.module is None:
            pytest.skip(f"Subject.module is None for {who}: its parameters are unknown")
    params_a = {n: p for n, p in a.module.named_parameters() if p.requires_grad}
    params_r = {n: p for n, p in r.module.named_parameters() if p.requires_grad}
    common = [n for n in params_r if n in params_a and params_a[n].shape == params_r[n].shape]
    unmatched = sorted(set(params_a) ^ set(params_r)) + [n for n in params_r if n in params_a and n not in common]
    listing = f"{len(unmatched)} parameter(s) not matched by name and shape: {unmatched[:12]}" if unmatched else ""
    if not common:
        pytest.skip(f"no parameter name is shared with the reference: {listing}")
    (src_a, tgt_a), (src_r, tgt_r), b = _draw_inputs(data, a, r, mut.device, min_len=2)
    with torch.no_grad():
        shape, mine = tuple(_run(r, src_r, tgt_r).shape), tuple(_run(a, src_a, tgt_a).shape)
    if shape != mine:
        raise AssertionError(f"output shapes differ: {mine} (model under test) vs {shape} (reference {reference.spec})")
    weights = torch.randn(shape, generator=torch.Generator().manual_seed(b.seed), dtype=torch.float64)
    ga, noise_a = _gradient_noise(a, src_a, tgt_a, weights, common)
    gr, noise_r = _gradient_noise(r, src_r, tgt_r, weights, common)
    # One scale for all parameters (MODEL-GRAD-BATCH): a gradient that is 0 in exact arithmetic carries the
    # rounding of the others, not of its own size.
    scale = max(float(gr[n].abs().max()) for n in common if gr[n].numel())
    dtype_a, dtype_r = next(iter(params_a.values())).dtype, next(iter(params_r.values())).dtype
    bound, how = _bound(a, r, torch.tensor([scale], dtype=dtype_a), torch.tensor([scale], dtype=dtype_r),
                        noise_a, noise_r)
    _record(mut, reference, arrangement, "parameter gradients", subject_args(src_a, *tgt_a),
            subject_args(src_r, *tgt_r), tgt_a[1], bound, None, weights=weights, names=common)
    worst = max(common, key=lambda n: float((ga[n] - gr[n]).abs().nan_to_num(float("inf")).max()) if ga[n].numel() else 0)
    for n in common:
        diff = (ga[n] - gr[n]).abs()
        first = _first_parting(diff, bound)
        if first is not None:
            raise AssertionError(
                f"{arrangement}: the gradient of {n} parts from the reference's first at index {first}: {float(ga[n][first]):.6e} vs "
                f"{float(gr[n][first]):.6e} (difference {float(diff[first]):.3e}, largest in it "
                f"{float(diff.nan_to_num(float('inf')).max()):.3e}; max |gradient| {scale:.3e}); bound {bound:.3e} = "
                f"{how}; the largest difference is in {worst} "
                f"({float((ga[worst] - gr[worst]).abs().nan_to_num(float('inf')).max()):.3e})"
                + (f"; {listing}" if listing else "") + f" [batch of real lengths {b.real}]")
    if unmatched:
        warnings.warn(f"MODEL-DIFF-GRADIENT compared {len(common)} parameters; {listing}")


# ---------------------------------------------------------------------------------------- MODEL-DIFF-DECODE
@dataclass(frozen=True)
class Schedule:
    """A prefill of ``prefill`` positions, then chunks of the given sizes."""
    prefill: int
    chunks: tuple[int, ...]

    def __repr__(self) -> str:
        return f"Schedule(prefill={self.prefill}, chunks=[{_runs(self.chunks)}])"

    def _repr_pretty_(self, printer, cycle):
        printer.text(repr(self))

    @property
    def cuts(self) -> list[int]:
        return [0, self.prefill, *(self.prefill + c for c in torch.tensor(self.chunks).cumsum(0).tolist())]


@st.composite
def schedules(draw, length: int) -> Schedule:
    """Covering ``length`` positions: a prefill, drawn chunks of 1 to 8 tokens, then one-token steps to the end."""
    prefill = draw(st.integers(1, min(8, length - 1)), label="prefill")
    room, chunks = length - prefill, []
    for c in draw(st.lists(st.integers(1, 8), max_size=6), label="first chunk sizes"):
        if c > room:
            break
        chunks.append(c)
        room -= c
    return Schedule(prefill, tuple(chunks) + (1,) * room)


def _decoder(s, src, tokens, mask, cuts):
    """Yield the logits of each chunk [cuts[i], cuts[i + 1]) decoded with decode_step, one chunk at a time."""
    state = None
    for start, end in zip(cuts, cuts[1:]):
        def step(*args):
            nonlocal state
            logits, state = s.decode_step(*args, state)
            return logits
        with torch.no_grad():   # not around the yield: grad mode is per thread, the caller's would change too
            logits = call_subject(s, *subject_args(src, tokens[:, start:end], mask[:, :end]), fn=step)
        yield logits


def _schedule_fits(schedule: Schedule, length: int) -> bool:
    """Whether schedules(length) could draw ``schedule``."""
    return (1 <= schedule.prefill <= min(8, length - 1) and all(1 <= c <= 8 for c in schedule.chunks)
            and schedule.cuts[-1] == length)


def _prefill_then_chunks(length: int) -> Schedule:
    """prefill 4, chunks of 3 and 8, then one-token steps"""
    prefill, room, chunks = min(4, length - 1), length - min(4, length - 1), []
    for c in (3, 8):
        if c <= room:
            chunks.append(c)
            room -= c
    return Schedule(prefill, tuple(chunks) + (1,) * room)


# Pinned decoding (drawn every run): a prefill, chunks of several tokens (the second of 8 after 7 cached positions),
# then one-token steps to the end; two samples, and sources of mixed real lengths for an encoder-decoder.
PINNED_DECODE = {"schedule": _prefill_then_chunks, "batch size": 2, "seed": 0, "source": Batch(2, 7, (3, 7), seed=8)}

# An example decodes up to 64 positions with each model: shrinking a failure would replay dozens of them, and the
# report already names the first step where the two part. Failures are reported as found (with the seed).
_NO_SHRINK = tuple(p for p in model_settings.phases if p != Phase.shrink)


@clause("MODEL-DIFF-DECODE")
@differential_property(pinned(PINNED_DECODE, schedules=_schedule_fits), max_examples=OTHER_EXAMPLES, phases=_NO_SHRINK)
def test_cached_decoding_agrees_with_the_reference(mut, reference, arrangement, data):
    a, r = _pair(mut, reference, arrangement)
    only(a, *DECODERS)
    for s, who in ((a, "the model under test"), (r, f"the reference {reference.spec}")):
        if s.decode_step is None:
            pytest.skip(f"Subject.decode_step is None for {who}: no cached decoding to compare")
    length = min(a.max_len, r.max_len, DIFF_DECODE_LEN)
    if length < 2:
        pytest.skip(f"max_len {length}: nothing to decode after a prefill")
    schedule = data.draw(schedules(length), label="schedule")
    size = data.draw(st.integers(1, 2), label="batch size")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    ids = real_tokens(torch.Generator().manual_seed(seed), (size, length), a, mut.device)
    ones = torch.ones(size, length, dtype=torch.bool, device=mut.device)
    ta, tr = _common_ids(ids, ones, a, r)
    src_a = src_r = None
    if a.kind == "encoder_decoder":
        sb = data.draw(batches(min(8, a.max_len, r.max_len), size=size), label="source")
        sa, sr = _common_ids(real_tokens(torch.Generator().manual_seed(sb.seed), (size, sb.length), a, mut.device),
                             sb.mask(mut.device), a, r)
        src_a, src_r = (sa, sb.mask(mut.device)), (sr, sb.mask(mut.device))
    # The bound from the forward passes of the whole sequence (equal to the decoded logits in exact arithmetic), so
    # that the decoding stops at the first step where the two part.
    with torch.no_grad():
        ya, yr = _run(a, src_a, (ta, ones)), _run(r, src_r, (tr, ones))
    bound, how = _bound(a, r, ya, yr, _noise(a, src_a, (ta, ones)), _noise(r, src_r, (tr, ones)))
    cuts = schedule.cuts
    _record(mut, reference, arrangement, "cached decoding", subject_args(src_a, ta, ones), subject_args(src_r, tr, ones),
            ones, bound, list(cuts))
    steps = zip(_decoder(a, src_a, ta, ones, cuts), _decoder(r, src_r, tr, ones, cuts))
    for step, (x, y) in enumerate(steps):
        diff = (x.double() - y.double()).abs().amax(-1)                 # (B, n)
        first = _first_parting(diff, bound)
        if first is not None:
            raise AssertionError(
                f"{arrangement}: cached decoding parts from the reference {reference.spec} first at step {step} "
                f"(positions {cuts[step]}..{cuts[step + 1] - 1}), sample {first[0]}, position {cuts[step] + first[1]}, "
                f"by {float(diff[first]):.3e}; bound {bound:.3e} = {how} [{schedule!r} over {length} positions]")


def _runs(chunks) -> str:
    """(1, 1, 1, 3, 1, 1) -> '1 x3, 3, 1 x2': a schedule in one short line."""
    out, i = [], 0
    while i < len(chunks):
        j = i
        while j < len(chunks) and chunks[j] == chunks[i]:
            j += 1
        out.append(f"{chunks[i]}" + (f" x{j - i}" if j - i > 1 else ""))
        i = j
    return ", ".join(out)
