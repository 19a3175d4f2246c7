"""``--model``, ``--zoo`` and ``--zoo-config``: which models the model clauses run on, built once per session.

Without either option the clauses run on the zoo's three families at a tiny size, each with every
position scheme. properties/plugin/suite.py calls ``configure`` (the options are the entry point's), and
asks ``subject_ids`` for its parameters and ``model_under_test`` for each one.
"""
from __future__ import annotations

import contextlib
import copy
import shlex
import warnings
from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from properties.core.tolerance import unit_roundoff
from properties.core.zoo_config import zoo_run
from properties.model.precision import Narrowing, Precision, allowed_dtypes, precision_of, register_precision
from properties.core.dtypes import device_unavailable
from zoo.config.options import FAMILIES, POSITIONS
from properties.core import evidence
from properties.core.hooks import hooks_in_place
from properties.core.subject import (Subject, SubjectError, as_subject, load_subject, moved, same_draws, watched,
                                     zoo_subject)

__all__ = ["configure", "subject_ids", "model_under_test", "fresh_subject", "build_model_under_test",
           "ModelUnderTest", "ZOO_TINY", "measure_precision", "declared_dtype", "recorder_for"]

# Small enough that all twelve zoo models run every clause in seconds (task=verify: the suite checks models,
# not a task, and verify has no sequence length of its own to contradict max_len); two layers so that a
# defect in how one layer feeds the next can show.
ZOO_TINY = ("task=verify", "d_model=32", "heads=2", "layers=2", "d_ff=64", "vocab_size=64", "max_len=16")

_KEY = pytest.StashKey[dict]()
_SKIP = pytest.StashKey[str]()


@dataclass
class ModelUnderTest:
    """One model twice: `native` as built, `precise` with its module in float64 for the clauses
    that compare two evaluations (the same object as `native` when that is impossible)."""
    name: str
    native: Subject
    precise: Subject
    device: torch.device
    precise_note: str = ""

    def __repr__(self) -> str:  # Hypothesis prints it in every counterexample: keep it short
        precision = precision_of(self.precise)
        where = "float64" if precision is None or not precision.own else (
            f"own precision ({str(precision.compute_dtype).removeprefix('torch.')})")
        return f"<{self.name}: {self.native.kind}, comparisons in {where}>"

    @property
    def resolution(self) -> str:
        """For reports: how the comparison clauses compare, and the smallest effect they could detect."""
        precision = precision_of(self.precise)
        return precision.describe() if precision is not None else ""

    def _repr_pretty_(self, printer, cycle):  # Hypothesis' printer would list every field
        printer.text(repr(self))


@dataclass
class _Source:
    make: Callable[[], Subject]                   # a fresh subject each call
    plugin: str                                   # how the watchdog names it (properties/core/watchdog.py)
    built: ModelUnderTest | None = field(default=None)
    # A subject never called before (MODEL-HISTORY): a factory call, or a copy of a zoo model taken before its
    # first call. None: the same as make.
    pristine: Callable[[], Subject] | None = field(default=None)

    def watched(self) -> Subject:
        return watched(self.make(), self.plugin)

    def fresh(self) -> Subject:
        return watched((self.pristine or self.make)(), self.plugin)


def _device_dtype(config):
    """The first --device and --dtype given (the plugin's repeatable options); else cpu, float32.

    The component suite sweeps every device and dtype; a model run takes one, because each
    zoo model is a dozen clauses of whole forward passes.
    """
    devices = config.getoption("--device", None) or ["cpu"]
    dtypes = config.getoption("--dtype", None) or ["float32"]
    return torch.device(devices[0]), getattr(torch, dtypes[0])


def configure(config) -> None:
    """Check --model and --zoo at startup: an unusable model is a one-line UsageError."""
    text = config.getoption("zoo", None)
    if text:
        try:  # an unbalanced quote would otherwise surface as an INTERNALERROR
            shlex.split(text)
        except ValueError as exc:
            raise pytest.UsageError(f"--zoo {text!r}: {exc} (the overrides are split as a shell would: "
                                    f"balance the quotes, e.g. --zoo \"heads=8 'attention.kernel=a b.py:f'\")") from None
    device, dtype = _device_dtype(config)
    reason = device_unavailable(device)
    if reason:
        config.stash[_KEY] = {}
        config.stash[_SKIP] = f"--device {device}: {reason}, model clauses not run"
        return
    config.stash[_SKIP] = ""
    sources: dict[str, _Source] = {}
    recipes: dict[str, dict] = {}   # --repro-dir: how a model clause's reproducer rebuilds each model
    try:
        if config.getoption("model"):
            spec = config.getoption("model")
            recipes["model"] = {"factory": spec}
            first = load_subject(spec)
            made = iter([first])
            sources["model"] = _Source(lambda: next(made, None) or load_subject(spec), f"model {spec}",
                                       pristine=lambda: load_subject(spec))
        run = zoo_run(config)   # the zoo's size check included: a model that cannot fit is one line here
        if run is not None:
            # The config's own dtype (dtype=bfloat16 in --zoo or the saved config) unless --dtype says otherwise.
            own = dtype if config.getoption("--dtype", None) else None

            def rebuilt() -> Subject:   # seeded as --model's factory is: a reproducer rebuilds the same weights
                with same_draws():
                    return zoo_subject(run.cfg, device=device, dtype=own, origin=run.origin)
            sources["zoo"] = _Source(_zoo_maker(rebuilt().module), f"model built by {run.origin}", pristine=rebuilt)
            recipes["zoo"] = _zoo_recipe(run.cfg, own, shlex.split(config.getoption("zoo") or ""), run.origin)
    except SubjectError as exc:
        raise pytest.UsageError(str(exc)) from None
    if not sources:
        for family in FAMILIES:
            for pos in POSITIONS:
                overrides = (f"model={family}", f"pos={pos}", *ZOO_TINY)
                make, pristine = _lazy_zoo(overrides, device, dtype)
                sources[f"{family}-{pos}"] = _Source(make, f"model {family}-{pos}", pristine=pristine)
                recipes[f"{family}-{pos}"] = {"overrides": list(overrides), "dtype": dtype}
    config.stash[_KEY] = sources
    evidence.set_model_recipes(recipes)


def _zoo_recipe(cfg, dtype, words: list, origin: str) -> dict:
    """--zoo or --zoo-config: the composed config itself (a reproducer builds exactly it, with the zoo's
    model_from_config), and the overrides --zoo named, for its reader."""
    from omegaconf import OmegaConf
    return {"config": OmegaConf.to_yaml(cfg), "dtype": dtype, "overrides": words, "origin": origin}


def _zoo_maker(model) -> Callable[[], Subject]:
    # The first call hands out the model itself; later ones deep copies (for the float64 twin).
    made = iter([model])
    return lambda: as_subject(next(made, None) or copy.deepcopy(model))


def _lazy_zoo(overrides, device, dtype) -> tuple[Callable[[], Subject], Callable[[], Subject]]:
    """(make, pristine): the model built once (its first subject the model itself, later ones deep copies), and
    copies of a copy taken when it was built, before any call."""
    built = []

    def build() -> None:
        if not built:
            from zoo.config.builder import build_model
            with same_draws():   # the same weights whatever ran before (and in a reproducer)
                built.append(build_model(list(overrides), device=device, dtype=dtype))
            built.append(copy.deepcopy(built[0]))

    def make() -> Subject:
        if not built:
            build()
            return as_subject(built[0])
        return as_subject(copy.deepcopy(built[0]))

    def pristine() -> Subject:
        build()
        return as_subject(copy.deepcopy(built[1]))
    return make, pristine


def subject_ids(config) -> list:
    if config.stash.get(_SKIP, ""):
        return [pytest.param("none", marks=pytest.mark.skip(reason=config.stash[_SKIP]))]
    return list(config.stash[_KEY])


def fresh_subject(config, key: str) -> Subject:
    """A subject of the model ``key`` that nothing has called yet (MODEL-HISTORY), under the watchdog."""
    return config.stash[_KEY][key].fresh()


def model_under_test(config, key: str) -> ModelUnderTest:
    source = config.stash[_KEY][key]
    if source.built is None:
        source.built = build_model_under_test(source.watched, key, config)
    return source.built


def build_model_under_test(make: Callable[[], Subject], name: str = "model", config=None) -> ModelUnderTest:
    """The subject ``make()`` returns, its float64 twin (a second call, cast) and what the suite measures of both."""
    native = make()
    device = _device_of(native, config)
    precise, note = _float64_twin(make, device, name if config is None else _source_plugin(config, name))
    precise = precise or native
    for subject in {id(native): native, id(precise): precise}.values():
        register_precision(subject, measure_precision(subject, device))
    return ModelUnderTest(name, native, precise, device, note)


_FLOATING = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


class _DtypeRecorder(TorchDispatchMode):
    """Records the floating dtypes of every operation's inputs and outputs, and for each dtype outside ``allowed`` (and
    each float32 operation of a float64 model) the innermost module running it (global module hooks keep the stack)."""

    def __init__(self, names: dict[int, str], allowed: tuple[torch.dtype, ...], island: torch.dtype | None):
        super().__init__()
        self.seen: set[torch.dtype] = set()
        self.names, self.allowed, self.island = names, allowed, island
        self.stack: list[str] = []
        self.found: dict[tuple[str, torch.dtype], list] = {}    # (module, dtype) -> [first operation, count]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        dtypes = {t.dtype for t in tree_flatten(out)[0] if torch.is_tensor(t) and t.dtype in _FLOATING}
        self.seen |= dtypes
        inputs = {t.dtype for t in tree_flatten((args, kwargs))[0] if torch.is_tensor(t) and t.dtype in _FLOATING}
        for dtype in dtypes | inputs:
            if dtype not in self.allowed or dtype == self.island:
                where = self.stack[-1] if self.stack else "the model's own forward"
                entry = self.found.setdefault((where, dtype), [str(func.overloadpacket.__name__), 0])
                entry[1] += 1
        return out

    @contextlib.contextmanager
    def modules(self):
        """The global module hooks that keep the stack of running modules, for the block inside."""
        def enter(module, _):
            self.stack.append(self.names.get(id(module), type(module).__name__))

        def leave(module, _, __):
            if self.stack:
                self.stack.pop()
        with hooks_in_place([register_module_forward_pre_hook(enter), register_module_forward_hook(leave)]):
            yield

    def narrowings(self, dtypes) -> tuple[Narrowing, ...]:
        return tuple(Narrowing(where, op, dtype, count) for (where, dtype), (op, count) in self.found.items()
                     if dtype in dtypes)


def _probe_batch(subject: Subject, device, size: int):
    """Forward arguments for ``size`` copies of one fixed all-real sample of length min(8, max_len)."""
    length = min(8, subject.max_len)
    g = torch.Generator().manual_seed(12345)
    ids = torch.randint(0, subject.vocab_size - 1, (1, length), generator=g)
    ids = torch.where(ids >= subject.pad_id, ids + 1, ids).to(device).expand(size, -1)
    mask = torch.ones(size, length, dtype=torch.bool, device=device)
    return (ids, ids, mask, mask) if subject.kind == "encoder_decoder" else (ids, mask)


def declared_dtype(subject: Subject) -> torch.dtype | None:
    """The dtype the model declares: that of its floating parameters (the most numerous), None without a module."""
    if subject.module is None:
        return None
    counts: dict[torch.dtype, int] = {}
    for p in subject.module.parameters():
        if p.is_floating_point():
            counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    return max(counts, key=counts.get) if counts else None


def recorder_for(subject: Subject, declared: torch.dtype | None) -> _DtypeRecorder:
    names = {} if subject.module is None else {id(m): (n or type(m).__name__) + f" ({type(m).__name__})"
                                               for n, m in subject.module.named_modules()}
    allowed = allowed_dtypes(declared) if declared is not None else _FLOATING
    return _DtypeRecorder(names, allowed, torch.float32 if declared == torch.float64 else None)


def measure_precision(subject: Subject, device) -> Precision:
    """The coarsest allowed floating dtype among a forward pass's intermediate tensors (and the modules computing in a
    dtype the model does not allow, or in float32 inside a float64 model), and the relative noise of the same input
    evaluated twice (nondeterministic kernels). Nothing that changes the batch, the padding or the positions: a leak
    between samples or positions would show there and be taken for noise."""
    one = _probe_batch(subject, device, 1)
    declared = declared_dtype(subject)
    recorder = recorder_for(subject, declared)
    try:
        with torch.no_grad():
            with recorder, recorder.modules():
                first = subject.forward(*one)
            again = subject.forward(*one)
    except Exception:   # the model's own clauses report how it fails; measure nothing here
        return Precision(torch.float64 if subject.module is not None else torch.float32, 0.0, declared)
    if not all(torch.is_tensor(t) and t.is_floating_point() for t in (first, again)):
        return Precision(torch.float64, 0.0, declared)
    declared = declared or first.dtype
    allowed = allowed_dtypes(declared)
    seen = {d for d in recorder.seen | {first.dtype} if d in allowed} or {declared}
    coarsest = max(seen, key=unit_roundoff)
    scale = float(first.double().abs().max()) or 1.0
    noise = float((again.double() - first.double()).abs().max()) / scale
    narrow = recorder.narrowings(set(_FLOATING) - set(allowed))
    islands = recorder.narrowings({torch.float32}) if declared == torch.float64 else ()
    return Precision(coarsest, noise if noise == noise else float("inf"), declared, narrow, islands)


def _device_of(subject: Subject, config) -> torch.device:
    if subject.module is not None:
        for tensor in (*subject.module.parameters(), *subject.module.buffers()):
            return tensor.device
    return _device_dtype(config)[0] if config is not None else torch.device("cpu")


def _source_plugin(config, key: str) -> str:
    source = config.stash.get(_KEY, {}).get(key)
    return source.plugin if source is not None else f"model {key}"


def _float64_twin(make: Callable[[], Subject], device: torch.device, plugin: str = "model"
                  ) -> tuple[Subject | None, str]:
    """A second subject with its module in float64, checked on a tiny input; None if impossible."""
    subject = make()
    if subject.module is None:
        return None, "Subject.module is None: comparisons run in the model's own dtype"
    moved(subject.module, plugin, torch.float64)  # floating parameters and buffers only
    tokens = torch.full((1, 2), (subject.pad_id + 1) % subject.vocab_size, dtype=torch.long, device=device)
    mask = torch.ones(1, 2, dtype=torch.bool, device=device)
    try:
        with torch.no_grad():
            args = (tokens, tokens, mask, mask) if subject.kind == "encoder_decoder" else (tokens, mask)
            out = subject.forward(*args)
    except Exception as exc:  # the user's model may refuse float64 in any way
        note = f"the model does not run in float64 ({type(exc).__name__}): comparisons run in its own dtype"
        warnings.warn(note)
        return None, note
    if not torch.is_tensor(out) or out.dtype != torch.float64:
        note = "the model's output is not float64 after module.to(float64): comparisons run in its own dtype"
        warnings.warn(note)
        return None, note
    return subject, ""
