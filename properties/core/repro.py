"""--repro-dir DIR: a standalone script for each failing clause (SPEC.md, "Reproducers").

The comparisons that decide a clause record their evidence as they run (``record``: the subject, the inputs of the
call or calls, how they were compared and with which bound); nothing is kept unless the run asks for reproducers.
When a test fails, the evidence of its last comparison — Hypothesis replays the minimal failing example last — is
written as ``DIR/<clause>-<n>.py`` with its tensors in ``DIR/<clause>-<n>.pt`` (read back with
``torch.load(..., weights_only=True)``), both atomically (zoo/io/atomic.py). The script imports torch and the
subject's module only; its float64 oracle is a few lines of plain torch (properties/core/repro_scripts.py).
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

__all__ = ["activate", "active", "record", "clear", "take", "write", "flat_index", "view_index", "observe_call"]

_state: dict = {"dir": None, "evidence": None, "counts": {}, "calls": [], "model_spec": None}


def activate(directory: str | None, model_spec: str | None = None) -> None:
    _state.update(dir=directory, evidence=None, counts={}, calls=[], model_spec=model_spec)


def active() -> bool:
    return _state["dir"] is not None


def record(kind: str, **evidence) -> None:
    """The evidence of the comparison about to be made (kept by reference; only with --repro-dir)."""
    if _state["dir"] is not None:
        _state["evidence"] = {"kind": kind, **evidence}


def clear() -> None:
    _state["evidence"] = None
    _state["calls"].clear()


def take() -> dict | None:
    evidence, _state["evidence"] = _state["evidence"], None
    return evidence


def flat_index(shape, select) -> torch.Tensor:
    """The flat positions in a tensor of ``shape`` that ``select`` (an indexing function) picks, in its order."""
    return select(torch.arange(int(torch.Size(shape).numel())).reshape(tuple(shape))).reshape(-1)


# ------------------------------------------------------------------------------------------------- model calls
def observe_call(args: tuple, out: torch.Tensor, subject) -> None:
    """A model call of the running test (properties/model/checks.py: call_subject): the last few are kept so that a
    failing comparison of two outputs can name the calls that made them."""
    if _state["dir"] is not None and torch.is_tensor(out):
        _state["calls"] = (_state["calls"] + [(args, out, subject)])[-8:]


def view_index(view: torch.Tensor):
    """(args, flat index into that call's output, subject) for a tensor that views a kept call's output."""
    for args, out, subject in reversed(_state["calls"]):
        if view.untyped_storage().data_ptr() == out.untyped_storage().data_ptr() and out.is_contiguous():
            base = torch.arange(out.numel())
            index = torch.as_strided(base, view.shape, view.stride(), view.storage_offset() - out.storage_offset())
            return args, index.reshape(-1), subject
    return None


# ------------------------------------------------------------------------------------------------- writing
def _cpu(value):
    if torch.is_tensor(value):
        return value.detach().cpu().clone()
    if isinstance(value, dict):
        return {k: _cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_cpu(v) for v in value]
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    return value


def write(clause, nodeid: str, counterexample: str) -> str | None:
    """Write the reproducer of the failing test's evidence for ``clause`` (a properties.core.spec.Clause); its path,
    or None when the test recorded none (a failure outside the comparisons: an exception of the subject, a shape)."""
    from properties.core.repro_scripts import render
    from zoo.io.atomic import replacing, write_text
    evidence = take()
    if _state["dir"] is None or evidence is None:
        return None
    evidence = dict(evidence)
    if evidence["kind"] == "model":
        evidence["subject"] = _state["model_spec"]
        if evidence["subject"] is None:   # a zoo family or --zoo: no factory for the script to import
            return None
    n = _state["counts"][clause.id] = _state["counts"].get(clause.id, 0) + 1
    directory = Path(_state["dir"])
    directory.mkdir(parents=True, exist_ok=True)
    stem = f"{clause.id}-{n}"
    data = {k: _cpu(v) for k, v in evidence.items() if k not in ("kind", "subject", "device", "what")}
    with replacing(directory / f"{stem}.pt") as temporary:
        torch.save(data, temporary)
    script = render(evidence, clause=clause, data_file=f"{stem}.pt", nodeid=nodeid, counterexample=counterexample)
    write_text(directory / f"{stem}.py", script)
    os.chmod(directory / f"{stem}.py", 0o755)
    return str(directory / f"{stem}.py")
