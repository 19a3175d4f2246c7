"""What the model clauses share: drawn input structure, calls that check shapes, the comparison
tolerance, and a probe on the token embedding for gradients.

Hypothesis draws structure (batch size, lengths, positions, seeds); a seeded torch.Generator
draws the token ids, on the CPU, so a counterexample is reproducible on any device.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch
import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

from properties.core import evidence
from properties.core.subject import Subject
from properties.core.tolerance import unit_roundoff
from properties.core.strategies import PinnedData
from properties.model.twin import observe, twin_fallback
from properties.model.precision import OUTPUT_ROUNDINGS, accumulation_roundoff, precision_of

__all__ = ["Batch", "batches", "real_tokens", "padded", "extend_with_padding", "call_subject", "model_settings", "model_property",
           "pinned", "pinned_model_property", "EXAMPLES",
           "DECODERS", "only", "draw_len", "forward", "draw_pair", "other_real_tokens", "COMPARISON_FACTOR",
           "comparison_tolerance", "assert_same_output", "record_model_comparison", "record_cached_decoding",
           "check_cached_decoding", "is_float64_twin", "assert_window_gradient", "module_input", "embedding_probe",
           "DRAW_LEN", "noise_floor", "difference_threshold"]

DRAW_LEN = 8  # longest sequence drawn for most clauses: tiny models, fast examples


@dataclass(frozen=True)
class Batch:
    """The structure of one batch: `real[b]` leading positions of sample b are real, the rest padding."""
    size: int
    length: int
    real: tuple[int, ...]
    seed: int

    def _repr_pretty_(self, printer, cycle):  # one line in Hypothesis' counterexamples
        printer.text(repr(self))

    def mask(self, device) -> torch.Tensor:
        return torch.arange(self.length, device=device)[None, :] < torch.tensor(self.real, device=device)[:, None]

    def tokens(self, subject: Subject, device) -> torch.Tensor:
        """Real ids (never pad_id) at real positions, pad_id at padded ones."""
        ids = real_tokens(torch.Generator().manual_seed(self.seed), (self.size, self.length), subject, device)
        return padded(ids, self.mask(device), subject.pad_id)


@st.composite
def batches(draw, max_len: int, *, min_len: int = 1, size: int | None = None, padding: bool = True,
            max_size: int = 3) -> Batch:
    length = draw(st.integers(min_len, max(min_len, max_len)))
    size = draw(st.integers(1, max_size)) if size is None else size
    if padding:
        real = tuple(draw(st.lists(st.integers(min_len, length), min_size=size, max_size=size)))
    else:
        real = (length,) * size
    return Batch(size, length, real, draw(st.integers(0, 2**16)))


def real_tokens(generator: torch.Generator, shape, subject: Subject, device) -> torch.Tensor:
    """Uniform ids in [0, vocab_size) without pad_id."""
    ids = torch.randint(0, subject.vocab_size - 1, tuple(shape), generator=generator)
    return (ids + (ids >= subject.pad_id).long()).to(device)


def padded(tokens: torch.Tensor, mask: torch.Tensor, pad_id: int) -> torch.Tensor:
    return torch.where(mask, tokens, torch.full_like(tokens, pad_id))


def extend_with_padding(tokens: torch.Tensor, mask: torch.Tensor, k: int, pad_id: int, left: bool):
    """(tokens, mask) with k padded positions added on the left or the right: pad ids the mask marks as padding."""
    pads = torch.full((tokens.shape[0], k), pad_id, dtype=tokens.dtype, device=tokens.device)
    off = torch.zeros((mask.shape[0], k), dtype=torch.bool, device=mask.device)
    if left:
        return torch.cat([pads, tokens], 1), torch.cat([off, mask], 1)
    return torch.cat([tokens, pads], 1), torch.cat([mask, off], 1)


def _describe(out) -> str:
    if torch.is_tensor(out):
        return f"a {out.dtype} tensor of shape {tuple(out.shape)}"
    return f"a {type(out).__module__}.{type(out).__qualname__}"


def call_subject(subject: Subject, *args, fn=None) -> torch.Tensor:
    """subject.forward (or fn, e.g. decode_step's logits) with its output checked against the contract."""
    out = (fn or subject.forward)(*args)
    if fn is None:
        evidence.observe_call(args, out, subject)   # --repro-dir: a comparison of two outputs names these calls
    observe(subject, out, "forward" if fn is None else "shifted" if fn is subject.shifted else "decode_step")
    tokens = args[1] if subject.kind == "encoder_decoder" else args[0]
    b, l = tokens.shape
    if subject.kind == "encoder_only":
        ok = torch.is_tensor(out) and out.dim() == 3 and tuple(out.shape[:2]) == (b, l)
        expected = f"hidden states of shape (B, L, D) = ({b}, {l}, D)"
    else:
        ok = torch.is_tensor(out) and tuple(out.shape) == (b, l, subject.vocab_size)
        expected = f"logits of shape (B, L, V) = ({b}, {l}, {subject.vocab_size})"
    if ok and not out.is_floating_point():
        ok, expected = False, expected + " of a floating dtype"
    if not ok:
        raise AssertionError(f"{subject.kind} forward returned {_describe(out)}; expected {expected}")
    return out


# Tolerance for "unchanged"/"equal" between two evaluations of the same model that differ only in
# rounding (another batch, padding, a cache, another evaluation order). Each has forward error
# E <= n * u * A * max|y| to first order (Higham 2002, ch. 3): u the unit roundoff, n the longest
# chain of accumulated roundings, A the amplification of an error by the later layers. For the
# models in scope n <= 2^10 (reductions of <= 2^7 terms -- d_ff, vocabulary, length -- along
# <= 2^3 sequential sublayers) and A <= 2^10 (LayerNorm of small-variance activations at
# initialisation amplifies by <= 50; softmax is 1/2-Lipschitz; residual sums <= 2^3 deep), so
# |a - b| <= 2E <= 2^21 * u * max|y|. In float64 that is 2.3e-10 relative, while the
# differences measured for correct models are ~1e-15 and a real defect gives >= 1e-6.
COMPARISON_FACTOR = 2.0 ** 21


def comparison_tolerance(reference: torch.Tensor, subject: Subject | None = None) -> float:
    """Tolerance for two evaluations of ``subject`` that differ only in rounding: 2^21 u max|y| for a float64
    computation, else its own-precision tolerance (above) times max|y|."""
    finite = reference.detach()[torch.isfinite(reference.detach())]   # a NaN or inf is a failure, not a scale
    scale = finite.abs().max().item() if finite.numel() else 0.0
    scale = max(scale, torch.finfo(reference.dtype).tiny)
    precision = precision_of(subject)
    if precision is not None and precision.own:
        return precision.relative_tolerance * scale
    return COMPARISON_FACTOR * unit_roundoff(reference.dtype) * scale


# Threshold for "must change" (MODEL-DEPENDENCE, MODEL-PERMUTATION): the equality tolerance above is a
# worst case for two whole evaluations (12% of max|y| in float32) and says nothing about whether an effect is
# real. An effect is real when it exceeds what rounding alone produces in this model: DIFFER_ROUNDINGS
# roundings of the accumulation type plus OUTPUT_ROUNDINGS of the output type (below), times max|y|, and
# DIFFER_NOISE times the subject's own measured noise (the same sample alone and inside its batch, which
# are equal in exact arithmetic). A random-weight model's genuine dependence is orders of magnitude larger.
DIFFER_ROUNDINGS = 64
DIFFER_NOISE = 8


def noise_floor(s: Subject, src: tuple | None, tgt: tuple) -> float:
    """max |f(x)_0 - f(x_0)|: sample 0 inside its batch against alone, at its real positions (0 when the model
    is bitwise reproducible there)."""
    together = forward(s, src, tgt)[:1]
    alone = forward(s, src and (src[0][:1], src[1][:1]), (tgt[0][:1], tgt[1][:1]))
    real = tgt[1][:1] if tgt[1] is not None else torch.ones(tgt[0][:1].shape, dtype=torch.bool, device=tgt[0].device)
    diff = (together.double() - alone.double()).abs()[real]
    return float(diff.nan_to_num(float("inf")).max()) if diff.numel() else 0.0


def difference_threshold(s: Subject, reference: torch.Tensor, src: tuple | None, tgt: tuple) -> tuple[float, str]:
    """(threshold, how it was set) above which a change of ``reference`` is an effect, not rounding."""
    precision = precision_of(s)
    dtype = precision.compute_dtype if precision is not None and precision.own else reference.dtype
    relative = DIFFER_ROUNDINGS * accumulation_roundoff(dtype) + OUTPUT_ROUNDINGS * unit_roundoff(dtype)
    rounding = relative * float(reference.detach().abs().max())
    noise = DIFFER_NOISE * noise_floor(s, src, tgt)
    if noise > rounding:
        return noise, f"{DIFFER_NOISE}x the model's measured noise (sample alone vs in its batch)"
    return rounding, (f"{DIFFER_ROUNDINGS} u_acc + {OUTPUT_ROUNDINGS} u of {str(dtype).removeprefix('torch.')}, "
                      f"times max|y|")


def assert_same_output(actual: torch.Tensor, expected: torch.Tensor, what: str, subject: Subject | None = None,
                       where: torch.Tensor | None = None) -> None:
    """|actual - expected| <= comparison_tolerance(expected, subject) elementwise (at ``actual[where]`` only, a bool
    mask of their leading dims, when given), else a readable failure."""
    if where is not None:
        if evidence.active() and actual.shape == expected.shape and actual.shape[:where.dim()] == where.shape:
            every = where.reshape(*where.shape, *[1] * (actual.dim() - where.dim())).expand_as(actual)
            record_model_comparison(actual, expected, what, comparison_tolerance(expected[where], subject), every)
        actual, expected = actual[where], expected[where]
    if actual.shape != expected.shape:
        raise AssertionError(f"{what}: shapes differ, {tuple(actual.shape)} vs {tuple(expected.shape)}")
    nan = torch.isnan(actual) | torch.isnan(expected)
    if nan.any():   # a NaN is reported as one, never as a difference or a tolerance
        first = tuple(int(i) for i in nan.nonzero()[0])
        where = " and ".join(w for w, t in (("the first", actual), ("the second", expected)) if torch.isnan(t).any())
        raise AssertionError(f"{what}: NaN in {where} at {int(nan.sum())} of {nan.numel()} entries, first at index "
                             f"{first}")
    tol = comparison_tolerance(expected, subject)
    record_model_comparison(actual, expected, what, tol)
    diff = (actual.double() - expected.double()).abs()
    diff = torch.where(torch.isnan(diff), torch.full_like(diff, float("inf")), diff)   # inf - inf
    if diff.numel() and diff.max().item() > tol:
        worst = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))
        precision = precision_of(subject)
        how = precision.describe() if precision is not None and precision.own else f"2^21 u max|y| in {expected.dtype}"
        raise AssertionError(f"{what}: differs by {diff.max().item():.3e} at index {worst} "
                             f"(tolerance {tol:.3e}; {how})")


def record_model_comparison(actual, expected, what: str, tol: float, where=None, **more) -> None:
    """--repro-dir: the two forward passes whose outputs are compared, when both tensors view their outputs (and
    the entries ``where`` selects of them)."""
    if not evidence.active():
        return
    first, second = evidence.view_index(expected), evidence.view_index(actual)
    if first is not None and second is not None:
        select = (lambda index: index.reshape(-1)) if where is None else (lambda index: index[where.cpu()])
        evidence.record("model", device=str(actual.device), what=what, reference="the first forward pass",
                        first=list(first[0]), second=list(second[0]), index_first=select(first[1]),
                        index_second=select(second[1]), tolerance=float(tol), float64=expected.dtype == torch.float64,
                        **more)


def is_float64_twin(s: Subject) -> bool:
    """--repro-dir: whether ``s`` computes with float64 parameters (its float64 twin), which a script casts to."""
    return s.module is not None and any(p.dtype == torch.float64 for p in s.module.parameters())


def record_cached_decoding(s: Subject, src: tuple | None, tokens, mask, cuts, out_dtype: torch.dtype) -> None:
    """--repro-dir: MODEL-KV-CACHE's decoding in chunks ``cuts`` against the full pass, with its tolerance relative
    to max|y| (comparison_tolerance at max|y| = 1)."""
    if evidence.active():
        float64 = is_float64_twin(s)
        evidence.record("model-decode", device=str(tokens.device), what="cached decoding", float64=float64,
                        src=None if src is None else src[0], src_mask=None if src is None else src[1], tokens=tokens,
                        mask=mask, cuts=list(cuts), relative=comparison_tolerance(torch.ones(1, dtype=out_dtype), s))


def check_cached_decoding(s, src, tokens, mask, cuts, note: str = "") -> None:
    """MODEL-KV-CACHE's check: decode ``tokens`` in chunks [0, c1), [c1, c2), ... with ``decode_step`` and compare
    each chunk's logits at real positions with the full forward pass."""
    length = tokens.shape[1]
    full = forward(s, src, (tokens, mask))
    record_cached_decoding(s, src, tokens, mask, cuts, full.dtype)
    state = None
    for start, end in zip([0, *cuts], [*cuts, length]):
        def step(*args):
            nonlocal state
            logits, state = s.decode_step(*args, state)
            return logits
        chunk = (tokens[:, start:end], mask[:, :end])
        with torch.no_grad():
            logits = call_subject(s, *subject_args(src, *chunk), fn=step)
        real = mask[:, start:end]
        assert_same_output(logits[real], full[:, start:end][real],
                           f"cached decoding of positions {start}..{end - 1} (chunks {[0, *cuts, length]}{note}) "
                           f"vs the full forward pass", subject=s)


@contextmanager
def embedding_probe(module: torch.nn.Module, tokens: torch.Tensor):
    """Add a zero leaf `delta` to the output of every call of `module` whose input equals `tokens`, or starts with
    them (Longformer pads its input on the right to a multiple of its window before embedding it): delta covers the
    positions of `tokens` only.

    d(output)/d(delta) is then the gradient with respect to those token embeddings; the list
    yielded collects one delta per matching call.
    """
    deltas: list[torch.Tensor] = []
    padded: list[torch.Tensor] = []    # calls on the tokens padded on the right: count only when no exact call
    length = tokens.shape[-1]

    def hook(_module, args, kwargs, output):
        given = next((a for a in (*args, *kwargs.values()) if torch.is_tensor(a)), None)
        if given is None or given.shape[:-1] != tokens.shape[:-1] or given.shape[-1] < length \
                or not torch.equal(given[..., :length], tokens) \
                or not (torch.is_tensor(output) and output.is_floating_point()):
            return None
        if given.shape == tokens.shape:
            deltas.append(torch.zeros_like(output, requires_grad=True))
            return output + deltas[-1]
        padded.append(torch.zeros_like(output[:, :length], requires_grad=True))
        return output + torch.cat([padded[-1], torch.zeros_like(output[:, length:])], 1)

    handle = module.register_forward_hook(hook, with_kwargs=True)
    try:
        yield deltas
    finally:
        handle.remove()
        # An encoder-decoder's longer source may start with the target tokens (1/64 for one token of 64).
        deltas.extend([] if deltas else padded)


# Half the profile's examples, at least 6: each model example runs whole forward passes and the
# default suite has twelve models. The thorough profile scales this up with its own count.
EXAMPLES = max(6, settings().max_examples // 2)
model_settings = settings(max_examples=EXAMPLES, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.differing_executors])


def model_property(test=None, *, twin: bool = True, max_examples: int | None = None):
    """A model clause's property: the model settings, structure drawn inside the test (``data``), and the float64
    twin's fallback (properties/model/twin.py, innermost). ``twin=False`` for a clause that runs only on the model as
    built (``mut.native``): it compares nothing on the twin, so it has nothing to fall back from. ``max_examples``:
    the drawn examples, when not the model settings' EXAMPLES. ``@model_property`` or ``@model_property(...)``."""
    if test is None:
        return lambda test: model_property(test, twin=twin, max_examples=max_examples)
    chosen = model_settings if max_examples is None else settings(model_settings, max_examples=max_examples)
    return chosen(given(data=st.data())(twin_fallback(test) if twin else test))


def _batch_fits(b: Batch, max_len: int, *, min_len: int = 1, size=None, padding: bool = True, max_size: int = 3):
    """Whether batches(max_len, ...) could draw the Batch b (for this subject's max_len)."""
    reals = len(b.real) == b.size and all(min_len <= r <= b.length for r in b.real)
    return (min_len <= b.length <= max(min_len, max_len) and reals and (b.size == size if size is not None else
            1 <= b.size <= max_size) and (padding or all(r == b.length for r in b.real)))


def pinned(values: dict, **checks) -> PinnedData:
    """st.data() for an @example of a model clause: the draws by label; a Batch that does not fit the subject
    (longer than its drawn lengths, padded where the clause draws none) rejects the example. ``checks``: more
    composite strategies by name (PinnedData)."""
    return PinnedData(values, checks={"batches": _batch_fits, **checks})


def pinned_model_property(values: dict, *, twin: bool = True, **checks):
    """model_property (``twin`` as there), run first on the example whose draws are ``pinned(values, **checks)``."""
    return lambda test: example(data=pinned(values, **checks))(model_property(test, twin=twin))
DECODERS = ("decoder_only", "encoder_decoder")


def only(subject: Subject, *kinds: str) -> Subject:
    """The subject, once the clause is skipped for a model of any other kind."""
    if subject.kind not in kinds:
        pytest.skip(f"applies to {' and '.join(kinds)}, not {subject.kind}")
    return subject


def assert_window_gradient(g: torch.Tensor, attended: bool, position: int, dead: Callable[[list], str],
                           leaks: Callable[[float], str]) -> None:
    """MODEL-WINDOW's exact half: g (B, d), the gradient of some outputs with respect to one position's input, is
    not exactly 0 in any sample when those outputs attend it (``dead(samples)`` says which are), and exactly 0
    everywhere when they do not (``leaks(largest)``)."""
    assert torch.isfinite(g).all(), f"the gradient with respect to position {position} is NaN or infinite"
    if attended:
        zero = (g == 0).all(-1).nonzero().flatten().tolist()
        assert not zero, dead(zero)
    else:
        assert not (g != 0).any(), leaks(float(g.abs().max()))


def module_input(args, kwargs):
    """The hidden states a layer's module (``Subject.attention_modules``, a declared part) was called with, and how
    to put others in their place: its first positional argument, else the keyword ``hidden_states``."""
    if args:
        return args[0], lambda h: ((h, *args[1:]), kwargs)
    if "hidden_states" in kwargs:
        return kwargs["hidden_states"], lambda h: (args, {**kwargs, "hidden_states": h})
    raise AssertionError(f"a layer's module was called without positional arguments or the keyword hidden_states "
                         f"(keywords {sorted(kwargs)}); expected the layer's hidden states first")


def requires(subject: Subject, field: str, without: str) -> None:
    """Skip the clause, saying what does not run, when the subject leaves an optional field None."""
    if getattr(subject, field) is None:
        pytest.skip(f"Subject.{field} is None: {without}")


def draw_len(subject: Subject, reserve: int = 0) -> int:
    return min(DRAW_LEN, subject.max_len - reserve)


def subject_args(src: tuple | None, tokens, mask) -> tuple:
    """The positional arguments of Subject.forward (and decode_step, before its state): (src, tgt, src_mask,
    tgt_mask) for an encoder-decoder, whose src is (tokens, mask, ...); (tokens, mask) when src is None."""
    return (src[0], tokens, src[1], mask) if src is not None else (tokens, mask)


def forward(s: Subject, src: tuple | None, tgt: tuple):
    """tgt/src are (tokens, mask[, Batch]); src only for encoder_decoder. No autograd unless asked for."""
    with torch.no_grad():
        return call_subject(s, *subject_args(src, tgt[0], tgt[1]))


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
