"""``--reference`` and ``--reference-kernel``: what the differential clauses compare the implementation under test
with (properties/SPEC.md, "Decoding and differential clauses").

    pytest properties/ --model fast.py:model --reference ref.py:reference        # MODEL-DIFF-*
    pytest properties/ --kernel my_triton.py:attention --reference-kernel torch   # ATTN-DIFF, ATTN-DIFF-GRAD

``--reference FILE.py:FACTORY`` (or ``pkg.module:factory``) names a second model of the same kind and vocabulary:
the factory is called with no arguments or, when it takes one positional parameter, with the Subject under test,
so that it can copy its weights (``ref.load_state_dict(subject.module.state_dict())``) — it must not change that
Subject. It is called a second time with the float64 twin of the model under test, and the result is cast to
float64 the same way, so that the clauses can compare both precisions. ``--reference-kernel`` names a kernel as
``--kernel`` does. Anything unusable is a one-line ``pytest.UsageError`` at start-up. Without either option the
differential clauses are skipped with the reason.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import pytest
import torch

from properties.core.strategies import required
from properties.core.subject import Subject, SubjectError, as_subject, moved, same_draws, watched
from properties.core.watchdog import raised, user_call
from zoo.runtime.plugins import PluginError, load_object

__all__ = ["Reference", "configure", "reference_of", "reference_kernel_of"]

_MODEL = pytest.StashKey[object]()
_KERNEL = pytest.StashKey[object]()


@dataclass
class Reference:
    """The reference model twice, like the model under test (properties.model.subjects.ModelUnderTest): ``native``
    built from the Subject under test as built, ``precise`` from its float64 twin and cast to float64 (``native``
    itself when either model has no float64 twin)."""
    spec: str
    native: Subject
    precise: Subject
    note: str = ""

    def __repr__(self) -> str:  # Hypothesis prints fixtures' reprs in counterexamples
        return f"<reference {self.spec}>"


# --reference upstream: transformers' own class for the model's config, its weights loaded by name or through
# --reference-map (properties/adapters/upstream.py, loaded by name like any factory).
UPSTREAM, UPSTREAM_FACTORY = "upstream", "properties.adapters.upstream:upstream_reference"


def configure(config) -> None:
    """Resolve both options now: an unusable reference is a UsageError before any test runs."""
    config.stash[_KERNEL] = _kernel(config.getoption("--reference-kernel", None))
    config.stash[_MODEL] = None
    spec = config.getoption("--reference", None)
    if config.getoption("--reference-map", None) and spec != UPSTREAM:
        raise pytest.UsageError("--reference-map names upstream's weights: it goes with --reference upstream")
    if spec:
        config.stash[_MODEL] = _model(config, spec)


def reference_of(config) -> Reference | None:
    return config.stash.get(_MODEL, None)


def reference_kernel_of(config):
    """The --reference-kernel as a GuardedKernel, or None."""
    return config.stash.get(_KERNEL, None)


# The fixtures of the differential clauses (properties/plugin/suite.py registers this module as a plug-in): a test
# without the option is skipped.
@pytest.fixture(name="reference", scope="session")
def reference_fixture(pytestconfig):
    return required(reference_of(pytestconfig),
                    "no --reference given: the differential clauses compare the model with a reference model")


@pytest.fixture(name="reference_kernel", scope="session")
def reference_kernel_fixture(pytestconfig):
    return required(reference_kernel_of(pytestconfig),
                    "no --reference-kernel given: the differential kernel clauses compare with a reference kernel")


# ------------------------------------------------------------------------------------------------ kernels
def _kernel(spec: str | None):
    if not spec:
        return None
    from properties.kernel.guard import GuardedKernel
    from zoo.nn.kernel import resolve_kernel
    try:
        with user_call(f"kernel reference {spec}", f"importing {spec.rpartition(':')[0]!r}"):
            return GuardedKernel(f"reference {spec}", resolve_kernel(spec))
    except PluginError as exc:
        raise pytest.UsageError(f"--reference-kernel: {exc}") from None


# ------------------------------------------------------------------------------------------------- models
def _takes_subject(factory, spec: str) -> bool:
    """True when the factory takes one positional parameter (the Subject under test), False when it takes none."""
    try:
        parameters = list(inspect.signature(factory).parameters.values())
    except (TypeError, ValueError):   # a builtin or C callable without a signature: call it without arguments
        return False
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)]
    required = [p for p in positional if p.default is p.empty and p.kind != p.VAR_POSITIONAL]
    required += [p for p in parameters if p.kind == p.KEYWORD_ONLY and p.default is p.empty]
    if len(required) > 1 or any(p.kind == p.KEYWORD_ONLY for p in required):
        raise pytest.UsageError(f"--reference {spec!r}: the factory requires {len(required)} arguments "
                                f"({', '.join(p.name for p in required)}); expected none or one positional "
                                f"parameter (the Subject under test)")
    return bool(positional)


def _build(factory, spec: str, subject: Subject, takes: bool) -> Subject:
    try:
        with user_call(f"reference model {spec}", "its factory"), same_draws():   # as --model's factory is called
            obj = factory(subject) if takes else factory()
    except SubjectError as exc:   # a Subject the factory built with an unusable field
        raise pytest.UsageError(f"--reference {spec!r}: {exc}") from None
    except Exception as exc:  # the user's code may fail in any way
        first = raised(exc).strip().splitlines()[0]
        raise pytest.UsageError(f"--reference {spec!r}: the factory raised {first}") from None
    try:
        return watched(as_subject(obj, origin=f"--reference {spec!r}"), f"reference model {spec}")
    except SubjectError as exc:   # neither a zoo model nor a Subject
        raise pytest.UsageError(str(exc)) from None


def _check_compatible(spec: str, ref: Subject, under_test: Subject) -> None:
    for field, what in (("kind", "kind"), ("vocab_size", "vocabulary size")):
        if getattr(ref, field) != getattr(under_test, field):
            raise pytest.UsageError(f"--reference {spec!r}: its {what} {getattr(ref, field)!r} differs from the model "
                                    f"under test's {getattr(under_test, field)!r}; a reference must be a model of the "
                                    f"same kind and vocabulary")


def _float64(ref: Subject, device, spec: str) -> tuple[Subject | None, str]:
    """``ref`` with its module cast to float64, checked on a tiny input (None and why when impossible)."""
    if ref.module is None:
        return None, "the reference has no Subject.module: it is compared as built"
    moved(ref.module, f"reference model {spec}", torch.float64)
    tokens = torch.full((1, 2), (ref.pad_id + 1) % ref.vocab_size, dtype=torch.long, device=device)
    mask = torch.ones(1, 2, dtype=torch.bool, device=device)
    try:
        with torch.no_grad():
            out = ref.forward(*((tokens, tokens, mask, mask) if ref.kind == "encoder_decoder" else (tokens, mask)))
    except Exception as exc:  # the user's model may refuse float64 in any way
        return None, f"the reference does not run in float64 ({type(exc).__name__}): it is compared as built"
    if not torch.is_tensor(out) or out.dtype != torch.float64:
        return None, "the reference's output is not float64 after module.to(float64): it is compared as built"
    return ref, ""


def _upstream(config):
    """The factory of --reference upstream: the subject -> transformers' model of its config with its weights."""
    mapping_spec = config.getoption("--reference-map", None)
    try:
        build = load_object(UPSTREAM_FACTORY)
        mapping = load_object(mapping_spec) if mapping_spec else None
    except PluginError as exc:
        raise pytest.UsageError(f"--reference upstream: {exc}") from None
    return lambda subject: build(subject, mapping)


def _model(config, spec: str) -> Reference | None:
    from properties.model import subjects
    from properties.model.precision import register_precision
    if not (config.getoption("model", None) or config.getoption("zoo", None) or config.getoption("zoo_config", None)):
        raise pytest.UsageError(f"--reference {spec!r}: needs the model it is compared with: --model, --zoo or "
                                f"--zoo-config")
    keys = subjects.subject_ids(config)
    if not all(isinstance(k, str) for k in keys):   # the model clauses are skipped (e.g. no such device)
        return None
    if len(keys) != 1:
        raise pytest.UsageError(f"--reference {spec!r}: compares one model with its reference; give only one of "
                                f"--model, --zoo and --zoo-config")
    if spec == UPSTREAM:
        factory, takes = _upstream(config), True
    else:
        try:
            with user_call(f"reference model {spec}", f"importing {spec.rpartition(':')[0]!r}"):
                factory = load_object(spec)
        except PluginError as exc:
            raise pytest.UsageError(f"--reference {exc}") from None
        if not callable(factory):
            raise pytest.UsageError(f"--reference {spec!r}: {type(factory).__name__} is not callable; expected a "
                                    f"factory returning a zoo model or a properties.Subject")
        takes = _takes_subject(factory, spec)
    mut = subjects.model_under_test(config, keys[0])
    native = _build(factory, spec, mut.native, takes)
    _check_compatible(spec, native, mut.native)
    precise, note = native, "the model under test has no float64 twin: both are compared as built"
    if mut.precise is not mut.native:
        twin, note = _float64(_build(factory, spec, mut.precise, takes), mut.device, spec)
        precise = twin or native
    for subject in {id(native): native, id(precise): precise}.values():
        register_precision(subject, subjects.measure_precision(subject, mut.device))
    return Reference(spec, native, precise, note if precise is native else "")
