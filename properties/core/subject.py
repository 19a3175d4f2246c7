"""The model under test: the ``Subject`` contract, and how ``--model`` / ``--zoo`` produce one.

A factory named by ``--model pkg.module:factory`` (or ``path/to/file.py:factory``) returns either a
zoo model, adapted here, or a ``Subject``. ``--zoo "model=decoder_only pos=rotary"`` builds a zoo
model from Hydra overrides. Everything a user can get wrong here is a one-line ``SubjectError``.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Callable

import torch
from torch import nn

from zoo.nn.models import DecoderOnly, EncoderDecoder, EncoderOnly
from zoo.config.options import FAMILIES
from zoo.runtime.plugins import PluginError, load_object
from properties.core.declared import Declared
from properties.core.routing import RoutingRule
from properties.core.watchdog import describe_args, raised, user_call
from zoo.nn.positional import NoPositions

__all__ = ["Subject", "SubjectError", "Route", "KINDS", "as_subject", "load_subject", "zoo_subject", "zoo_shifted",
           "zoo_decode_step", "watched", "same_draws", "moved", "FACTORY_SEED", "called_dtypes"]

# Every factory (--model, --reference) is called with torch's generator seeded with this, so that one factory called
# twice builds the same weights: the float64 twin is the model under test cast, and `--model F:f --reference F:f`
# compares a model with itself (MODEL-DIFF-* must pass; tests/test_robust_runs.py).
FACTORY_SEED = 0

KINDS = FAMILIES  # a subject's kind is one of the zoo's model families
ZOO_MODELS = (EncoderOnly, DecoderOnly, EncoderDecoder)


class SubjectError(ValueError):
    """A model the suite cannot use; str() is one line for the user."""


@dataclass
class Route:
    """One call of a mixture-of-experts layer, as ``Subject.routing`` records it. Rows are the layer's tokens in the
    order of the forward pass's (B, L), flattened.

    logits (N, E): the router's scores; experts (N, k): the experts each token is sent to; weights (N, k): the
    weights their outputs are combined with. top_k: True when the model routes each token to the k experts of its
    largest logits (a softmax top-k router), False when its rule is unknown: then only batch and padding invariance
    are checked. normalized: True when the weights are the chosen experts' softmax probabilities divided by their
    sum (they sum to 1), False when they are those probabilities themselves, None when the model does not say (only
    their ratios, exp(logit difference), are checked). rule: the whole declared rule (scores, a correction bias,
    groups, a scaling factor: properties/core/routing.py); when given it takes the place of top_k and normalized.
    """
    logits: torch.Tensor
    experts: torch.Tensor
    weights: torch.Tensor
    top_k: bool = True
    normalized: bool | None = None
    rule: RoutingRule | None = None


@dataclass
class Subject:
    """A model as the model clauses see it (properties/SPEC.md, section Models).

    kind: "encoder_only" | "decoder_only" | "encoder_decoder".
    forward: encoder_only  forward(tokens, mask) -> hidden (B, L, D)
             decoder_only  forward(tokens, mask) -> logits (B, L, V)
             encoder_decoder forward(src, tgt, src_mask, tgt_mask) -> logits (B, Lt, V)
        tokens int64 (B, L); masks (B, L) bool or None, True = real token, None = all real.
    vocab_size, max_len: token ids lie in [0, vocab_size); inputs have at most max_len positions.
    positional: False when the model injects no order information (MODEL-PERMUTATION).
    pad_id: the token placed at padded positions.
    special_ids: further ids with a meaning of their own (bos, eos, a decoder's start id; ``hf_subject`` reads them
        from the config): MODEL-PADDING-IDS places them, and pad_id, at attended positions, where the mask alone
        decides that they are real.

    Optional, each enabling (part of) one clause; a clause whose field is missing is skipped
    with the reason:
    module: the nn.Module holding the parameters. Enables MODEL-GRADIENT, and lets the
        comparison clauses run in float64 (a fresh copy from the factory is cast with .to()).
    embedding: the module mapping token ids to token embeddings (for encoder_decoder the
        decoder's; it may be shared with the encoder: the suite uses the call whose input equals
        the target tokens). Enables the gradient half of MODEL-CAUSAL.
    decode_step: cached incremental decoding, enabling MODEL-KV-CACHE.
        decoder_only:    decode_step(tokens, mask, state) -> (logits, state)
        encoder_decoder: decode_step(src, tgt, src_mask, tgt_mask, state) -> (logits, state)
        tokens/tgt (B, n) are the next n positions, mask/tgt_mask (B, positions so far) cover all
        positions decoded so far, state is None on the first call and then whatever the
        previous call returned (a KV cache, the encoder output, ...); logits are (B, n, V).
    left_padding: True when prepending padded positions must leave the real positions'
        outputs unchanged (relative or no positions, or positions counted from the mask).
    extrapolates: True when inputs longer than max_len are valid (no length limit); False when
        they must raise an exception (learned or tabulated positions); None (the default): False for a
        positional model, and for one without positions (positional=False) either outcome is accepted.
    unused_parameters: names (as ``module.named_parameters()`` gives them) of parameters that forward does
        not use by design, such as BERT's pooler when forward returns the hidden states. MODEL-GRADIENT
        leaves them out; every name must be a parameter of ``module``.
    shifted: forward with every sample's positions counted from ``offset`` instead of 0, enabling MODEL-SHIFT:
        shifted(tokens, mask, offset) (encoder_decoder: shifted(src, tgt, src_mask, tgt_mask, offset), both sides
        shifted); offset 0 is forward. Hugging Face models: position_ids + offset; zoo models: offset padded
        columns prepended.
    relative_positions: True when positions enter only as offsets between query and key (rotary, ALiBi, relative
        buckets): shifting every position by one offset must change nothing (MODEL-SHIFT). False (absolute codes
        or a table) requires shifted outputs to differ from one offset to the next.
    window: the sliding window of each self-attention layer of the (target) stack, in order: W means a query
        attends its W most recent positions, itself included (Mistral's ``sliding_window``; an encoder: W - 1 on
        either side), None a layer that attends every position. Enables MODEL-WINDOW when every layer has one.
    edges: further lengths where the implementation changes path (a cache block, a chunk size): the long draws
        (properties/model/scale.py) put sequences just below and above each.
    attention_modules: the self-attention module of each layer of the (target) stack, in the order of ``window``,
        each taking the layer's hidden states (B, L, D) as its first argument (or keyword ``hidden_states``) and
        returning them (or a tuple that starts with them). MODEL-WINDOW then checks every windowed layer alone,
        whatever the other layers do (Gemma 2's alternating layers), through hooks on these modules.
    routing: mixture-of-experts routing, enabling MODEL-ROUTING: ``with routing() as routes:`` records every routed
        layer's call during the forward passes inside the block, appending one ``Route`` per call.
    declared: what the model's config declares about each part (properties/core/declared.py: each attention layer's
        scale, window, soft cap, grouping and rotary embedding, each norm's formula, each feed-forward network's
        activation, each mixture-of-experts block's routing and combine), enabling MODEL-LAYER-*; settings the adapter
        could not read are listed there and named in the report.
    """
    kind: str
    forward: Callable
    vocab_size: int
    max_len: int
    positional: bool = True
    pad_id: int = 0
    special_ids: tuple[int, ...] = ()
    module: nn.Module | None = None
    embedding: nn.Module | None = None
    decode_step: Callable | None = None
    left_padding: bool = False
    extrapolates: bool | None = None
    unused_parameters: tuple[str, ...] = ()
    shifted: Callable | None = None
    relative_positions: bool = False
    window: tuple[int | None, ...] | None = None
    edges: tuple[int, ...] = ()
    attention_modules: tuple[nn.Module, ...] | None = None
    routing: Callable | None = None
    declared: Declared | None = None

    def __post_init__(self):
        check_subject(self)


def check_subject(s: Subject) -> None:
    def fail(field: str, value, expected: str):
        raise SubjectError(f"Subject.{field}={value!r}: expected {expected}")

    if s.kind not in KINDS:
        fail("kind", s.kind, " | ".join(repr(k) for k in KINDS))
    if not callable(s.forward):
        fail("forward", s.forward, "a callable")
    # MODEL-CAUSAL and MODEL-DEPENDENCE swap a real token for another real one: two non-pad ids.
    if not isinstance(s.vocab_size, int) or s.vocab_size < 3:
        fail("vocab_size", s.vocab_size, "an int >= 3")
    if not isinstance(s.max_len, int) or s.max_len < 2:
        fail("max_len", s.max_len, "an int >= 2")
    if not isinstance(s.pad_id, int) or not 0 <= s.pad_id < s.vocab_size:
        fail("pad_id", s.pad_id, f"an int in [0, vocab_size={s.vocab_size})")
    for name in ("positional", "left_padding", "extrapolates", "relative_positions"):
        if not isinstance(getattr(s, name), bool) and not (name == "extrapolates" and s.extrapolates is None):
            fail(name, getattr(s, name), "a bool" + (" or None" if name == "extrapolates" else ""))
    for name in ("module", "embedding"):
        if getattr(s, name) is not None and not isinstance(getattr(s, name), nn.Module):
            fail(name, getattr(s, name), "a torch.nn.Module or None")
    for name in ("decode_step", "shifted", "routing"):
        if getattr(s, name) is not None and not callable(getattr(s, name)):
            fail(name, getattr(s, name), "a callable or None")
    positive = lambda n: isinstance(n, int) and not isinstance(n, bool) and n >= 1  # noqa: E731
    if s.window is not None and not (isinstance(s.window, (tuple, list)) and s.window
                                     and all(w is None or positive(w) for w in s.window)):
        fail("window", s.window, "None or a tuple with one entry per layer, each a positive int or None")
    if s.attention_modules is not None:
        if not (isinstance(s.attention_modules, (tuple, list)) and all(isinstance(m, nn.Module)
                                                                       for m in s.attention_modules)):
            fail("attention_modules", s.attention_modules, "None or a tuple of torch.nn.Module, one per layer")
        if s.window is None or len(s.attention_modules) != len(s.window):
            fail("attention_modules", f"<{len(s.attention_modules)} modules>",
                 f"one module per entry of Subject.window ({'None' if s.window is None else len(s.window)})")
    if s.declared is not None and not isinstance(s.declared, Declared):
        fail("declared", type(s.declared).__name__, "None or a properties.core.declared.Declared")
    if not isinstance(s.special_ids, (tuple, list)) or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < s.vocab_size for i in s.special_ids):
        fail("special_ids", s.special_ids, f"a tuple of ids in [0, vocab_size={s.vocab_size})")
    if not isinstance(s.edges, (tuple, list)) or not all(positive(e) for e in s.edges):
        fail("edges", s.edges, "a tuple of positive ints")
    if not isinstance(s.unused_parameters, (tuple, list)) or not all(isinstance(n, str) for n in s.unused_parameters):
        fail("unused_parameters", s.unused_parameters, "a tuple of parameter names")
    if s.unused_parameters:
        known = set() if s.module is None else {name for name, _ in s.module.named_parameters()}
        unknown = [name for name in s.unused_parameters if name not in known]
        if unknown:
            fail("unused_parameters", s.unused_parameters, "names of Subject.module's parameters "
                 f"({'no module given' if s.module is None else f'not parameters: {unknown[:3]}'})")


def _adds_absolute_positions(pos: nn.Module) -> bool:
    # The zoo's position modules add codes in forward() (absolute) and/or rotate q, k (relative).
    # Only absolute codes move when padding is prepended; a foreign module is assumed absolute.
    from zoo.nn.positional import Positions
    return not isinstance(pos, Positions) or type(pos).forward is not Positions.forward


def zoo_shifted(model: nn.Module) -> Callable:
    """Subject.shifted of a zoo model: its positions count columns, so ``offset`` masked pad columns prepended to
    every sequence shift every real position by ``offset``; their outputs are dropped. (A model clause's reproducer
    holds this function's source: properties/repro/model.py.)"""
    def pad(tokens, mask, offset):
        pads = torch.full((tokens.shape[0], offset), model.pad_id, dtype=tokens.dtype, device=tokens.device)
        real = torch.ones_like(tokens, dtype=torch.bool) if mask is None else mask.bool()
        return torch.cat([pads, tokens], 1), torch.cat([torch.zeros_like(pads, dtype=torch.bool), real], 1)

    def shifted(*args):
        *args, offset = args
        if model.kind == "encoder_decoder":
            src, tgt, src_mask, tgt_mask = args
            (src, src_mask), (tgt, tgt_mask) = pad(src, src_mask, offset), pad(tgt, tgt_mask, offset)
            return model(src, tgt, src_mask, tgt_mask)[:, offset:]
        return model(*pad(*args, offset))[:, offset:]
    return shifted


def zoo_decode_step(model: nn.Module) -> Callable:
    """Subject.decode_step of a decoder-only or encoder-decoder zoo model: one chunk of tokens per call, the KV cache
    carried in the state (an encoder-decoder's memory encoded at the first call). (A model clause's reproducer holds
    this function's source: properties/repro/model.py.)"""
    from zoo.nn.cache import KVCache   # here: a script that holds this source needs the zoo only for a zoo model

    if model.kind == "decoder_only":
        def decode_step(tokens, mask, state):
            cache = KVCache() if state is None else state
            return model(tokens, mask, cache=cache), cache
        return decode_step

    def decode_step(src, tgt, src_mask, tgt_mask, state):
        if state is None:
            state = (model.encode(src, src_mask), KVCache())
        memory, cache = state
        return model.decode(tgt, memory, src_mask, tgt_mask, cache=cache), state
    return decode_step


def _attention_modules(stack: nn.Module) -> tuple[nn.Module, ...]:
    return tuple(layer.self_attn for layer in stack.layers)


def _windows(stack: nn.Module) -> tuple[int | None, ...] | None:
    """Subject.window of a zoo stack: each layer's self-attention window (None when no layer has one)."""
    windows = tuple(getattr(layer.self_attn, "window", None) for layer in stack.layers)
    return windows if any(w is not None for w in windows) else None


def _zoo_subject(model: nn.Module) -> Subject:
    """A zoo model as a Subject. The clauses are about inference, so the model is put in eval mode."""
    model.eval()
    stacks = [model.encoder, model.decoder] if isinstance(model, EncoderDecoder) else \
        [model.encoder if isinstance(model, EncoderOnly) else model.decoder]
    relative = not any(_adds_absolute_positions(s.pos) for s in stacks)
    common = dict(kind=model.kind, forward=model, vocab_size=model.vocab_size, max_len=model.max_len,
                  pad_id=model.pad_id, module=model,
                  positional=any(getattr(s.pos, "injects_order", True) for s in stacks),
                  left_padding=relative, relative_positions=relative, shifted=zoo_shifted(model),
                  window=_windows(stacks[-1]),
                  attention_modules=_attention_modules(stacks[-1]) if _windows(stacks[-1]) else None,
                  # NoPositions never checks a length; every other zoo scheme refuses > max_len.
                  extrapolates=all(isinstance(s.pos, NoPositions) for s in stacks))
    if isinstance(model, EncoderOnly):  # forward returns the hidden states (or the head's): the pooler is apart
        unused = tuple(name for name, _ in model.named_parameters() if name.startswith("pooler."))
        return Subject(**common, embedding=model.encoder.embedding, unused_parameters=unused)
    return Subject(**common, embedding=model.decoder.embedding, decode_step=zoo_decode_step(model))


def as_subject(obj: object, origin: str = "the factory") -> Subject:
    if isinstance(obj, Subject):
        return obj
    if isinstance(obj, ZOO_MODELS):
        return _zoo_subject(obj)
    raise SubjectError(f"{origin} returned {type(obj).__module__}.{type(obj).__qualname__}; expected a zoo model "
                       f"(zoo.nn.models.EncoderOnly, DecoderOnly or EncoderDecoder) or a properties.Subject")


@contextlib.contextmanager
def same_draws():
    """torch's global generators seeded with ``FACTORY_SEED`` inside, and restored after (the CPU's; a CUDA
    generator is seeded lazily, as torch.manual_seed does, and not restored)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(FACTORY_SEED)
        yield


def moved(module: nn.Module, plugin: str, *args, **kwargs) -> nn.Module:
    """``module.to(*args, **kwargs)`` as one call of the code under test: a user's ``_apply`` or ``to`` may hang or
    exit (properties/core/watchdog.py)."""
    words = [str(a).removeprefix("torch.") for a in args] + [f"{k}={str(v).removeprefix('torch.')}" for k, v in kwargs.items()]
    with user_call(plugin, f"module.to({', '.join(words)})"):
        return module.to(*args, **kwargs)


def load_subject(spec: str) -> Subject:
    """``--model pkg.module:factory`` or ``path/to/file.py:factory`` -> a validated Subject."""
    try:
        with user_call(f"model {spec}", f"importing {spec.rpartition(':')[0]!r}"):
            factory = load_object(spec)
    except PluginError as exc:
        raise SubjectError(f"--model {exc}") from exc
    if not callable(factory):
        raise SubjectError(f"--model {spec!r}: {type(factory).__name__} is not callable; expected a factory "
                           f"returning a zoo model or a properties.Subject")
    try:
        with user_call(f"model {spec}", "its factory"), same_draws():
            obj = factory()
    except SubjectError as exc:
        raise SubjectError(f"--model {spec!r}: {exc}") from exc
    except Exception as exc:  # the user's code may fail in any way
        first = raised(exc).strip().splitlines()[0]
        raise SubjectError(f"--model {spec!r}: the factory raised {first}") from exc
    return as_subject(obj, origin=f"--model {spec!r}")


_CALLED: set[str] = set()   # the floating dtypes of the model's outputs since the last called_dtypes()


def _note_dtype(out) -> None:
    first = out[0] if isinstance(out, (tuple, list)) and out else out
    if torch.is_tensor(first) and first.is_floating_point():
        _CALLED.add(str(first.dtype).removeprefix("torch."))


def called_dtypes() -> list[str]:
    """The dtypes of the outputs of every watched call since the last call of this (then forgotten): what the
    report names as the precisions the model was run in."""
    found = sorted(_CALLED)
    _CALLED.clear()
    return found


def watched(subject: Subject, plugin: str) -> Subject:
    """The same subject, its forward and decode_step each run as one call of the code under test (a time limit,
    and a record of the call: properties/core/watchdog.py)."""
    forward, decode_step, shifted = subject.forward, subject.decode_step, subject.shifted

    def watched_forward(*args):
        with user_call(plugin, lambda: describe_args(f"{subject.kind} forward", args, {})):
            out = forward(*args)
        _note_dtype(out)
        return out

    def watched_decode_step(*args):
        with user_call(plugin, lambda: describe_args(f"{subject.kind} decode_step", args[:-1], {})):
            out = decode_step(*args)
        _note_dtype(out)
        return out
    def watched_shifted(*args):
        with user_call(plugin, lambda: describe_args(f"{subject.kind} shifted", args, {})):
            out = shifted(*args)
        _note_dtype(out)
        return out
    return replace(subject, forward=watched_forward,
                   decode_step=None if decode_step is None else watched_decode_step,
                   shifted=None if shifted is None else watched_shifted)


def zoo_subject(cfg, *, device=None, dtype=None, origin: str = "--zoo") -> Subject:
    """The zoo model a validated config builds (``properties.core.zoo_config``), as a Subject."""
    from zoo.config.builder import model_from_config  # Hydra is imported only when a zoo model is wanted
    from zoo.config.errors import ConfigError
    try:
        with user_call(f"model built by {origin}", "building it"):
            model = model_from_config(cfg, device=device, dtype=dtype)
    except (ConfigError, PluginError) as exc:
        raise SubjectError(f"{origin}: {exc}") from exc
    except Exception as exc:  # a user's replacement part may fail in any way while constructed
        from hydra.errors import InstantiationException
        if isinstance(exc, InstantiationException) and exc.__cause__ is not None:   # its first line names no cause
            exc = exc.__cause__
        first = raised(exc).strip().splitlines()[0]
        raise SubjectError(f"{origin}: building the model raised {first}") from exc
    return as_subject(model, origin="--zoo")

