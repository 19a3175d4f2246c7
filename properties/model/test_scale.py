"""Model clauses at the model's scale (SPEC.md, "Models"): MODEL-SHIFT, MODEL-WINDOW, and MODEL-KV-CACHE over long
prompts and generations. Their lengths and positions come from properties/model/scale.py: just below, at and just
above 64, 256, 1024, max_len - 1, every declared window and its horizon, and Subject.edges.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import example, strategies as st

from properties import clause
from properties.core import evidence
from properties.model.checks import is_float64_twin
from properties.model.checks import (DECODERS, EXAMPLES, Batch, assert_same_output, assert_window_gradient, batches,
                                     call_subject, check_cached_decoding, comparison_tolerance, difference_threshold, draw_pair,
                                     embedding_probe, forward, model_property, only, other_real_tokens,
                                     pinned, real_tokens, requires, subject_args)
from properties.model.precision import OWN_ROUNDINGS, accumulation_roundoff, precision_of
from properties.model.scale import SLACK, fits_near, horizon, length_edges, near, position_edges
from properties.model.twin import observe
from properties.model.test_models import FULL, FULL_SOURCE

ARRANGEMENTS = ("float64", "as-built")
SHORT_OFFSETS = (1, 2, 3)   # shifts that keep every position below the first milestone
# A correct model's output at offset s and at offset 0 differ by its forward errors at both: |e_s| + |e_0|. E, the
# largest forward error measured at offsets 0..3, stands for each, so 2E is the expected worst case; the factor 4
# leaves 2 for the spread of a maximum of rounding errors from one offset to another (measured on correct bfloat16
# Llamas, 75 inputs and offsets to 4095: at most 1.6 E). Besides, positions themselves enter in the model's
# precision: a rotary angle p·θ computed with unit roundoff u is off by up to p·u radians, which perturbs each
# rotated query and key as p roundings would; the bound allows OWN_ROUNDINGS·P·u_acc·max|y| for a last position P
# (precision.py's 16 per rounding; measured on a correct model with float32 angles: 1e-9 per position, 1/16 u_acc).
SHIFT_ERRORS = 4
# Drawn examples besides the pinned ones: each costs forward passes over up to max_len positions (KV-CACHE) or eight
# short ones per arrangement (SHIFT); the pinned examples carry the edges every run.
LONG_EXAMPLES = max(2, EXAMPLES // 3)


def long_property(test):
    """checks.model_property with LONG_EXAMPLES drawn examples."""
    return model_property(test, max_examples=LONG_EXAMPLES)


def pinned_data(values: dict):
    """PinnedData for a clause here: the draws by label (properties.model.checks.pinned)."""
    return pinned(values, near=fits_near)


def _pinned(values: dict):
    return example(data=pinned_data(values))


ONE_SOURCE = Batch(1, 7, (7,), seed=10)


def _max(edges, low, high):
    """the highest"""
    return high


def _low(edges, low, high):
    """the lowest"""
    return low


def _past(position):
    def value(edges, low, high):
        return position if low <= position <= high else high
    value.__doc__ = f"{position}"
    return value


# ---------------------------------------------------------------------------------------------- MODEL-SHIFT
def _shifted(s, src, tgt, offset: int) -> torch.Tensor:
    """Subject.shifted's output (checked against the output contract); offset 0 is the forward pass."""
    if offset == 0:
        return forward(s, src, tgt)
    with torch.no_grad():
        return call_subject(s, *subject_args(src, tgt[0], tgt[1]), offset, fn=s.shifted)


def _real(y: torch.Tensor, mask) -> torch.Tensor:
    return y[mask].double() if mask is not None else y.flatten(0, 1).double()


def _largest(diff: torch.Tensor) -> float:
    return float(diff.nan_to_num(float("inf")).max()) if diff.numel() else 0.0


def _forward_error(mut, s, src, tgt) -> tuple[float, str]:
    """E: the largest departure of ``s`` (the model as built) from its float64 twin over offsets 0..3, or, without a
    usable twin, the largest change a shift by 1..3 makes. Both are errors of this computation in its own precision
    at positions no position bug reaches."""
    mask = tgt[1]
    twin = mut.precise if mut.precise is not s else None
    if twin is not None:
        errors = [_largest(_real(_shifted(s, src, tgt, o), mask) - _real(_shifted(twin, src, tgt, o), mask))
                  for o in (0, *SHORT_OFFSETS)]
        if all(e < float("inf") for e in errors):
            return max(errors), "its largest departure from the float64 twin at offsets 0-3"
    base = _real(_shifted(s, src, tgt, 0), mask)
    return (max(_largest(_real(_shifted(s, src, tgt, o), mask) - base) for o in SHORT_OFFSETS),
            "the largest change shifts by 1-3 make")


def _shift_case(mut, arrangement, data):
    s = mut.native if arrangement == "as-built" else mut.precise
    requires(s, "shifted", "the suite cannot move the model's positions")
    if arrangement == "float64" and mut.precise is mut.native:
        pytest.skip(f"no float64 twin ({mut.precise_note or 'the model is compared as built'})")
    src, tgt = draw_pair(data, s, mut.device)
    length = tgt[2].length if src is None else max(tgt[2].length, src[2].length)
    # A declared scaling that changes the rotary frequencies past a length (dynamic NTK, LongRoPE) is relative only
    # below it: the shifted positions stay there.
    thresholds = s.declared.length_thresholds if s.declared is not None else ()
    low, high = length + max(SHORT_OFFSETS), min([s.max_len, *thresholds]) - 1
    if low > high:
        pytest.skip(f"max_len={s.max_len}: no room to shift {length} positions past offset {max(SHORT_OFFSETS)}")
    last = data.draw(near(position_edges(s), low, high), label="last position")
    return s, src, tgt, last - length + 1, last


# Pinned draws (run every time, and by tests/test_scale.py): past 256, where bfloat16 integers start rounding, and
# the last position; for MODEL-WINDOW the shortest sequence past the reach; for MODEL-KV-CACHE past 64 and max_len.
SHIFT_PINS = ({"batch": FULL, "target": FULL, "source": FULL_SOURCE, "last position": _past(257)},
              {"batch": FULL, "target": FULL, "source": FULL_SOURCE, "last position": _max})
WINDOW_PINS = ({"length": _low, "perturbed position": 0, "seed": 0, "batch size": 2},)
KV_PINS = ({"length": _past(65), "new tokens": 3, "chunk sizes": [1, 2], "seed": 0, "source": ONE_SOURCE},
           {"length": _max, "new tokens": 4, "chunk sizes": [1, 1, 2], "seed": 0, "source": ONE_SOURCE})


@clause("MODEL-SHIFT")
@pytest.mark.parametrize("arrangement", ARRANGEMENTS)
@_pinned(SHIFT_PINS[0])
@_pinned(SHIFT_PINS[1])
@long_property
def test_shift(mut, arrangement, data):
    s, src, tgt, offset, last = _shift_case(mut, arrangement, data)
    mask = tgt[1]
    base = _real(_shifted(s, src, tgt, 0), mask)
    moved = _real(_shifted(s, src, tgt, offset), mask)
    if s.relative_positions or not s.positional:
        tol = comparison_tolerance(base, s)
        bound, how = tol, f"the comparison tolerance ({_resolution(s)})"
        scale = float(base[torch.isfinite(base)].abs().max()) if torch.isfinite(base).any() else 0.0
        angles = OWN_ROUNDINGS * last * _accumulation(s) * scale
        if angles > bound:
            bound, how = angles, f"{OWN_ROUNDINGS} x {last} roundings of {_accumulation(s):.1e}, times max|y|"
        if arrangement == "as-built":
            error, what = _forward_error(mut, s, src, tgt)
            if SHIFT_ERRORS * error > tol:
                bound, how = SHIFT_ERRORS * error, f"{SHIFT_ERRORS} x E = {error:.2e}, {what}"
        if evidence.active():   # --repro-dir: the two passes and the bound this example used
            evidence.record("model-shift", device=str(tgt[0].device), what="relative" if s.positional else "absent",
                            float64=is_float64_twin(s), args=list(subject_args(src, tgt[0], mask)), offset=offset,
                            mask=mask, bound=float(bound), how=how, last=last)
        diff = (moved - base).abs().amax(-1)
        worst = _largest(diff)
        assert worst <= bound, (
            f"shifting every position by {offset} (last position {last}) changes the outputs by {worst:.3e} "
            f"(max|y| {scale:.3e}; bound {bound:.3e} = {how}) although the positions are "
            f"{'relative' if s.positional else 'absent'}: the outputs depend on where the sequence starts"
            + (" (NaN)" if torch.isnan(moved).any() or torch.isnan(base).any() else ""))
        return
    if arrangement == "as-built":
        pytest.skip("absolute positions: that shifts change the outputs is checked on the float64 twin")
    earlier = _real(_shifted(s, src, tgt, offset - 1), mask)
    tol, how = difference_threshold(s, moved, src, tgt)
    change = (moved - earlier).abs().amax(-1)
    same = (change <= tol).nonzero().flatten().tolist()
    assert not same, (f"positions {offset - 1}.. and {offset}.. give the same outputs (within {tol:.1e} = {how}) at "
                      f"{len(same)} of {change.numel()} real positions (flattened indices {same[:5]}) although "
                      f"Subject.relative_positions is False: the absolute positions collapse there (a table "
                      f"clamped at its last row?)")


def _accumulation(s) -> float:
    """u_acc of the precision ``s`` computes in (float64's when it computes in float64)."""
    precision = precision_of(s)
    dtype = precision.compute_dtype if precision is not None and precision.own else torch.float64
    return accumulation_roundoff(dtype)


def _resolution(s) -> str:
    precision = precision_of(s)
    return precision.describe() if precision is not None else "float64"


# --------------------------------------------------------------------------------------------- MODEL-WINDOW
@clause("MODEL-WINDOW")
@_pinned(WINDOW_PINS[0])
@model_property
def test_window(mut, data):
    s = mut.precise
    requires(s, "window", "the model declares no sliding window")
    reach = horizon(s)
    if reach is None:
        full = [i for i, w in enumerate(s.window) if w is None]
        pytest.skip(f"layer(s) {full} attend every position: a window is not observable in the outputs")
    low = reach + 2
    if low > s.max_len:
        pytest.skip(f"max_len={s.max_len}: the window's reach {reach} leaves no unreachable position")
    length = data.draw(near((low,), low, min(s.max_len, low + SLACK)), label="length")
    j = data.draw(st.integers(0, length - reach - 2), label="perturbed position")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    size = data.draw(st.integers(1, 2), label="batch size")
    tokens = real_tokens(torch.Generator().manual_seed(seed), (size, length), s, mut.device)
    changed = tokens.clone()
    changed[:, j] = other_real_tokens(tokens[:, j], seed + 1, s)
    ones = torch.ones_like(tokens, dtype=torch.bool)
    src = None
    if s.kind == "encoder_decoder":
        source = Batch(size, 5, (5,) * size, seed + 2**17)
        src = (source.tokens(s, mut.device), source.mask(mut.device))
    before, after = forward(s, src, (tokens, ones)), forward(s, src, (changed, ones))
    distance = (torch.arange(length, device=mut.device) - j)
    if s.kind != "encoder_only":
        distance = torch.where(distance < 0, torch.zeros_like(distance), distance)   # the past cannot see j
    far = distance.abs() > reach
    windows = f"windows {tuple(s.window)}: reach sum(W - 1) = {reach}"
    assert_same_output(after, before, f"outputs more than {reach} positions from the changed token "
                       f"{j} ({windows}) after changing it: a layer attends a key W or more positions back", subject=s,
                       where=far[None, :].expand(before.shape[0], -1))
    if s.embedding is None:   # the attended half needs the gradient: a key 15 positions back in each of two
        return                # layers may carry a weight of 1e-20, exactly non-zero and invisible in any output
    edge = (distance.abs() == reach).nonzero().flatten().tolist()
    weights = torch.randn(before.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    for positions, attended in ((far, False), (distance.abs() == reach, True)):
        with torch.enable_grad(), embedding_probe(s.embedding, tokens) as deltas:
            out = call_subject(s, *subject_args(src, tokens, ones))
        assert len(deltas) == 1, (f"Subject.embedding was called {len(deltas)} times with the target tokens; "
                                  f"expected once (the module that embeds the tokens passed to forward)")
        (grad,) = torch.autograd.grad((out * weights.to(out))[:, positions].sum(), deltas[0])
        observe(s, grad, "gradient with respect to the token embeddings")
        assert_window_gradient(
            grad[:, j], attended, j,
            lambda dead: (f"the outputs exactly {reach} positions from token {j} (positions {edge}; {windows}) have a "
                          f"gradient of exactly 0 with respect to its embedding in sample(s) {dead}: a layer does not "
                          f"attend the key W - 1 positions back"),
            lambda largest: (f"the outputs more than {reach} positions from token {j} ({windows}) have a non-zero "
                             f"gradient with respect to its embedding (largest {largest:.1e}): a layer attends a key W "
                             f"or more positions back"))


# --------------------------------------------------------------------------------- MODEL-KV-CACHE at length
@clause("MODEL-KV-CACHE")
@_pinned(KV_PINS[0])
@_pinned(KV_PINS[1])
@long_property
def test_cached_decoding_at_length(mut, data):
    s = only(mut.precise, *DECODERS)
    requires(s, "decode_step", "the model offers no cached incremental decoding")
    if s.max_len < 3:
        pytest.skip(f"max_len={s.max_len}: nothing to decode after a prefill")
    length = data.draw(near(length_edges(s), 3, s.max_len), label="length")
    new = data.draw(st.integers(1, min(8, length - 1)), label="new tokens")
    sizes = data.draw(st.lists(st.integers(1, 8), min_size=1, max_size=new), label="chunk sizes")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    prefill, cuts = length - new, []
    for size in sizes:
        if (prefill if not cuts else cuts[-1]) + size >= length:
            break
        cuts.append((prefill if not cuts else cuts[-1]) + size)
    tokens = real_tokens(torch.Generator().manual_seed(seed), (1, length), s, mut.device)
    src = None
    if s.kind == "encoder_decoder":
        source = data.draw(batches(min(8, s.max_len), size=1), label="source")
        src = (source.tokens(s, mut.device), source.mask(mut.device))
    check_cached_decoding(s, src, tokens, torch.ones_like(tokens, dtype=torch.bool), [prefill, *cuts],
                           note=f"; a prompt of {prefill} then {length - prefill} new tokens")
