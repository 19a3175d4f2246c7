"""``--model``, ``--zoo`` and ``--zoo-config``: which models the model clauses run on, built once per session.

Without either option the clauses run on the zoo's three families at a tiny size, each with every
position scheme. properties.plugin calls ``add_options`` and ``configure``, and asks
``subject_ids`` for its parameters and ``model_under_test`` for each one.
"""
from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch

from properties.core.zoo_config import zoo_run
from zoo.config.options import FAMILIES, POSITIONS
from properties.core.subject import Subject, SubjectError, as_subject, load_subject, zoo_subject

__all__ = ["add_options", "configure", "subject_ids", "model_under_test", "ModelUnderTest", "ZOO_TINY"]

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
        precision = "float64" if self.precise is not self.native else "own dtype"
        return f"<{self.name}: {self.native.kind}, comparisons in {precision}>"

    def _repr_pretty_(self, printer, cycle):  # Hypothesis' printer would list every field
        printer.text(repr(self))


@dataclass
class _Source:
    make: Callable[[], Subject]                   # a fresh subject each call
    built: ModelUnderTest | None = field(default=None)


def add_options(parser) -> None:
    group = parser.getgroup("models", "model-level clauses (properties/SPEC.md, section Models)")
    group.addoption("--model", default=None, metavar="pkg.module:factory",
                    help="verify the model factory() returns (a zoo model or a properties.Subject); "
                         "also path/to/file.py:factory")
    group.addoption("--zoo", default=None, metavar="OVERRIDES",
                    help='verify the zoo model built from Hydra overrides, e.g. '
                         '"model=decoder_only attention._target_=mypkg.MyAttention"')
    group.addoption("--zoo-config", default=None, metavar="PATH",
                    help="verify the zoo model a saved config builds (a YAML such as `python -m zoo task=verify` "
                         "writes); like --zoo, every level runs")


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
    device, dtype = _device_dtype(config)
    if device.type == "cuda" and not torch.cuda.is_available():
        config.stash[_KEY] = {}
        config.stash[_SKIP] = f"--device {device}: CUDA not available, model clauses not run"
        return
    config.stash[_SKIP] = ""
    sources: dict[str, _Source] = {}
    try:
        if config.getoption("model"):
            spec = config.getoption("model")
            first = load_subject(spec)
            made = iter([first])
            sources["model"] = _Source(lambda: next(made, None) or load_subject(spec))
        run = zoo_run(config)
        if run is not None:
            first = zoo_subject(run.cfg, device=device, dtype=dtype, origin=run.origin)
            sources["zoo"] = _Source(_zoo_maker(first.module))
    except SubjectError as exc:
        raise pytest.UsageError(str(exc)) from None
    if not sources:
        for family in FAMILIES:
            for pos in POSITIONS:
                overrides = (f"model={family}", f"pos={pos}", *ZOO_TINY)
                sources[f"{family}-{pos}"] = _Source(_lazy_zoo(overrides, device, dtype))
    config.stash[_KEY] = sources


def _zoo_maker(model) -> Callable[[], Subject]:
    # The first call hands out the model itself; later ones deep copies (for the float64 twin).
    made = iter([model])
    return lambda: as_subject(next(made, None) or copy.deepcopy(model))


def _lazy_zoo(overrides, device, dtype) -> Callable[[], Subject]:
    built = []

    def make() -> Subject:
        if not built:
            from zoo.config.builder import build_model
            built.append(build_model(list(overrides), device=device, dtype=dtype))
            return as_subject(built[0])
        return as_subject(copy.deepcopy(built[0]))
    return make


def subject_ids(config) -> list:
    if config.stash.get(_SKIP, ""):
        return [pytest.param("none", marks=pytest.mark.skip(reason=config.stash[_SKIP]))]
    return list(config.stash[_KEY])


def model_under_test(config, key: str) -> ModelUnderTest:
    source = config.stash[_KEY][key]
    if source.built is None:
        native = source.make()
        device = _device_of(native, config)
        precise, note = _float64_twin(source.make, device)
        source.built = ModelUnderTest(key, native, precise or native, device, note)
    return source.built


def _device_of(subject: Subject, config) -> torch.device:
    if subject.module is not None:
        for tensor in (*subject.module.parameters(), *subject.module.buffers()):
            return tensor.device
    return _device_dtype(config)[0]


def _float64_twin(make: Callable[[], Subject], device: torch.device) -> tuple[Subject | None, str]:
    """A second subject with its module in float64, checked on a tiny input; None if impossible."""
    subject = make()
    if subject.module is None:
        return None, "Subject.module is None: comparisons run in the model's own dtype"
    subject.module.to(torch.float64)  # floating parameters and buffers only
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
