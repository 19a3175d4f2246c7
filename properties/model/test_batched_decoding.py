"""MODEL-BATCHED-DECODING (SPEC.md, "Decoding and differential clauses"): cached decoding of a left-padded batch
of prompts of different lengths gives every sample, at every step, the logits of decoding it alone.

The shape is the one batched generation uses: prompts of different lengths left-padded to the longest, one
prefill, then chunks of one or more tokens that every sample shares (teacher-forced: drawn ids, so that each
step's input is known in advance). Each sample is also decoded alone with the same chunks, and run through one
forward pass; at every step the batched logits at its real positions must equal both. Runs on the float64 twin
(``mut.precise``) with the comparison tolerance of properties/model/checks.py (the model's own precision when
it computes in a narrower dtype inside).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch
from hypothesis import settings, given, strategies as st

from properties import clause
from properties.core import evidence
from properties.model.checks import is_float64_twin
from properties.model.checks import (DECODERS, call_subject, comparison_tolerance, forward, model_settings,
                                     only, real_tokens, requires, subject_args)
from properties.model.scale import SLACK
from properties.model.twin import twin_fallback

DECODE_LEN = 16   # positions decoded at most: past the 8 the older clauses draw, and a block boundary at 8
MAX_PROMPT = 8
# Examples from the profile loaded for this run (read when pytest imports this module, after the plugin has loaded
# --hypothesis-profile): 3 at `default`, 100 at `thorough`. An example decodes 3 samples alone and the batch.
DRAWN = max(3, settings().max_examples // 4)


@dataclass(frozen=True)
class DecodePlan:
    """prompts[b] real prompt tokens of sample b (left-padded to the longest), then chunks of new tokens shared by
    all samples; an encoder-decoder's sources have sources[b] real tokens (right-padded)."""
    prompts: tuple[int, ...]
    chunks: tuple[int, ...]
    seed: int
    sources: tuple[int, ...] | None = None

    def _repr_pretty_(self, printer, cycle):  # one line in Hypothesis' counterexamples
        printer.text(repr(self))

    @property
    def prefill(self) -> int:
        return max(self.prompts)

    @property
    def length(self) -> int:
        return self.prefill + sum(self.chunks)


def fit(plan: DecodePlan, limit: int) -> DecodePlan:
    """The plan cut to ``limit`` positions (a subject's max_len): prompts shortened, the last chunks dropped."""
    prompts = tuple(min(p, limit - 1) for p in plan.prompts)
    room, chunks = limit - max(prompts), []
    for c in plan.chunks:
        if room <= 0:
            break
        chunks.append(min(c, room))
        room -= chunks[-1]
    sources = None if plan.sources is None else tuple(min(x, limit) for x in plan.sources)
    return DecodePlan(prompts, tuple(chunks), plan.seed, sources)


def decode_limit(s) -> int:
    """Positions decoded at most: DECODE_LEN, or just past a declared sliding window of up to 64 positions, so that
    prompts plus generation cross it (properties/model/scale.py)."""
    windows = [w + SLACK for w in s.window or () if w is not None and w + SLACK <= 64]
    return min(s.max_len, max([DECODE_LEN, *windows]))


@st.composite
def decode_plans(draw, s) -> DecodePlan:
    limit = decode_limit(s)
    longest = min(MAX_PROMPT, limit - 1)
    size = draw(st.integers(2, min(3, longest)), label="batch size")
    prompts = tuple(draw(st.lists(st.integers(1, longest), min_size=size, max_size=size, unique=True),
                         label="prompt lengths"))
    room = limit - max(prompts)
    sizes = draw(st.lists(st.integers(1, min(8, room)), min_size=1, max_size=room), label="chunk sizes")
    chunks = []
    for c in sizes:
        if c > room:
            break
        chunks.append(c)
        room -= c
    sources = None
    if s.kind == "encoder_decoder":
        sources = tuple(draw(st.lists(st.integers(1, min(MAX_PROMPT, s.max_len)), min_size=size, max_size=size),
                             label="source lengths"))
    return DecodePlan(prompts, tuple(chunks), draw(st.integers(0, 2**16), label="seed"), sources)


def _step(s, src, tokens, mask, state):
    """One decode_step call, its logits checked against the output contract; returns (logits, state)."""
    box = {}

    def call(*args):
        box["logits"], box["state"] = s.decode_step(*args, state)
        return box["logits"]
    with torch.no_grad():
        logits = call_subject(s, *subject_args(src, tokens, mask), fn=call)
    return logits, box["state"]


def _decode(s, src, tokens, mask, cuts) -> list[torch.Tensor]:
    """Logits of each chunk [cuts[i], cuts[i + 1]) decoded with decode_step, the mask covering every position so far."""
    out, state = [], None
    for start, end in zip(cuts, cuts[1:]):
        logits, state = _step(s, src, tokens[:, start:end], mask[:, :end], state)
        out.append(logits)
    return out


def _difference(actual, expected, s) -> tuple[float, int, float]:
    """(max |actual - expected|, the position of the worst entry, tolerance)."""
    tol = comparison_tolerance(expected, s)
    diff = (actual.double() - expected.double()).abs()   # a NaN stays NaN: it fails every comparison below
    if not diff.numel():
        return 0.0, 0, tol
    return float(diff.max()), int(torch.unravel_index(diff.argmax(), diff.shape)[0]), tol


def check_batched_decoding(s, plan: DecodePlan, device, note: str = "") -> None:
    """The clause on one plan: the first (step, sample) where the batched logits part from the sample decoded alone
    or from its forward pass fails, naming both differences."""
    b, prefill, total = len(plan.prompts), plan.prefill, plan.length
    cont = sum(plan.chunks)
    g = torch.Generator().manual_seed(plan.seed)
    samples = [real_tokens(g, (1, p + cont), s, device) for p in plan.prompts]
    tokens = torch.full((b, total), s.pad_id, dtype=torch.long, device=device)
    mask = torch.zeros(b, total, dtype=torch.bool, device=device)
    for row, (p, ids) in enumerate(zip(plan.prompts, samples)):
        tokens[row, prefill - p:] = ids[0]
        mask[row, prefill - p:] = True
    src, solo_src = None, [None] * b
    if plan.sources is not None:
        length = max(plan.sources)
        ids = real_tokens(torch.Generator().manual_seed(plan.seed + 2**17), (b, length), s, device)
        src_mask = torch.arange(length, device=device)[None, :] < torch.tensor(plan.sources, device=device)[:, None]
        src = (torch.where(src_mask, ids, torch.full_like(ids, s.pad_id)), src_mask)
        solo_src = [(ids[row:row + 1, :n], src_mask[row:row + 1, :n]) for row, n in enumerate(plan.sources)]
    offsets = [0, *torch.tensor(plan.chunks).cumsum(0).tolist()]
    batched = _decode(s, src, tokens, mask, [0, *(prefill + o for o in offsets)])
    if evidence.active() and batched:   # --repro-dir: the batch, each sample alone, the tolerance relative to max|y|
        evidence.record("model-batched-decode", device=str(device), what="batched cached decoding",
                        float64=is_float64_twin(s), tokens=tokens, mask=mask,
                        src=src, samples=samples, solo_src=solo_src, prompts=list(plan.prompts), prefill=prefill,
                        offsets=offsets, chunks=list(plan.chunks),
                        relative=comparison_tolerance(torch.ones(1, dtype=batched[0].dtype), s))
    where = f"prompts {plan.prompts} left-padded to {prefill}, then chunks {plan.chunks}{note}"
    for row, (p, ids) in enumerate(zip(plan.prompts, samples)):
        ones = torch.ones_like(ids, dtype=torch.bool)
        alone = _decode(s, solo_src[row], ids, ones, [0, *(p + o for o in offsets)])
        full = forward(s, solo_src[row], (ids, ones))[0]
        for step, (together, single) in enumerate(zip(batched, alone)):
            start = 0 if step == 0 else p + offsets[step - 1]
            mine = together[row, -single.shape[1]:]            # the prefill's real positions are its last p
            reference = full[start:start + single.shape[1]]
            vs_alone, at, tol = _difference(mine, single[0], s)
            vs_full, at_full, tol_full = _difference(mine, reference, s)
            alone_vs_full, _, _ = _difference(single[0], reference, s)
            if vs_alone <= tol and vs_full <= tol_full:   # False for a NaN
                continue
            nan = [w for w, t in (("the batched decoding", mine), ("the decoding alone", single[0]),
                                  ("the forward pass", reference)) if torch.isnan(t).any()]
            what = "the prefill" if step == 0 else f"chunk {step} ({single.shape[1]} token(s))"
            pos = start + (at if vs_alone > tol else at_full)
            raise AssertionError(
                f"sample {row} (prompt of {p}, {prefill - p} pads on the left) at {what}, its position {pos}: "
                f"the batched cached logits differ by {vs_alone:.3e} from the sample decoded alone and by "
                f"{vs_full:.3e} from its forward pass (tolerance {max(tol, tol_full):.3e}); decoded alone it "
                f"differs from its forward pass by {alone_vs_full:.3e}" + (f"; NaN in {', '.join(nan)}" if nan else "")
                + f" [{where}]")


@clause("MODEL-BATCHED-DECODING")
@settings(model_settings, max_examples=DRAWN)
@given(data=st.data())
@twin_fallback
def test_batched_decoding_equals_decoding_alone(mut, data):
    s = _applies(mut.precise)
    check_batched_decoding(s, data.draw(decode_plans(s), label="plan"), mut.device)


def _applies(s):
    s = only(s, *DECODERS)
    requires(s, "decode_step", "the model offers no cached incremental decoding")
    if not s.left_padding:
        pytest.skip("Subject.left_padding is False: a left-padded batch is not the same input as its samples")
    if s.max_len < 3:
        pytest.skip(f"max_len={s.max_len}: no room for two prompts of different lengths and a step")
    return s


# Shapes that real decode-path bugs need, run every time (cut to max_len): one-token steps after a left-padded
# prefill (generation as `generate` does it), and chunks of several tokens after the prefill, the second a chunk of
# 8 that follows 8 cached positions (speculative decoding, chunked prefill, a cache block boundary at 8).
PINNED = {
    "one-token-steps": DecodePlan(prompts=(3, 6, 4), chunks=(1,) * 6, seed=11, sources=(5, 2, 7)),
    "chunks-after-prefill": DecodePlan(prompts=(6, 2, 4), chunks=(2, 8), seed=12, sources=(3, 6, 1)),
}


@clause("MODEL-BATCHED-DECODING")
@pytest.mark.parametrize("shape", list(PINNED))
@twin_fallback
def test_batched_decoding_pinned_shapes(mut, shape):
    s = _applies(mut.precise)
    plan = fit(PINNED[shape], min(s.max_len, DECODE_LEN))
    if s.kind != "encoder_decoder":
        plan = replace(plan, sources=None)
    check_batched_decoding(s, plan, mut.device, note=f", pinned shape {shape}")
