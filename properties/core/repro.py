"""--repro-dir DIR: a standalone script for each failing clause (SPEC.md, "Reproducers").

The comparisons that decide a clause record their evidence as they run (``record``: the subject, the inputs of the
call or calls, how they were compared and with which bound); nothing is kept unless the run asks for reproducers.
When a test fails, the evidence of its last comparison — Hypothesis replays the minimal failing example last — is
written as ``DIR/<clause>-<n>.py`` with its tensors beside it (properties/plugin/repro.py).
"""
from __future__ import annotations

import torch

__all__ = ["activate", "active", "directory", "set_model_recipes", "model_recipe", "record", "record_call",
           "observe_kernel_call", "clear", "take", "take_kernel_call", "observe_flash_call", "take_flash_call",
           "flat_index", "view_index", "observe_call"]

_state: dict = {"dir": None, "evidence": None, "calls": [], "kernel_call": None, "flash_call": None,
                "alignment": "top-left", "recipes": {}}


def activate(directory: str | None, causal_alignment: str = "top-left") -> None:
    _state.update(dir=directory, evidence=None, calls=[], kernel_call=None, flash_call=None,
                  alignment=causal_alignment)


def active() -> bool:
    return _state["dir"] is not None


def directory() -> str | None:
    return _state["dir"]


def set_model_recipes(recipes: dict) -> None:
    """How each model the model clauses run on was built (its test parameter -> {"factory": spec} or
    {"overrides": [...], "dtype": ...} or {"config": yaml}): a model clause's reproducer builds it the same way."""
    _state["recipes"] = dict(recipes)


def model_recipe(nodeid: str) -> dict | None:
    """The recipe of the model a test ran on, read from its parameter id ('test_x[decoder_only-rotary]',
    'test_y[model-prefill-then-chunks]'): the longest model name the id starts with."""
    param = nodeid.rpartition("[")[2].rstrip("]") if nodeid.endswith("]") else ""
    names = [n for n in _state["recipes"] if param == n or param.startswith(n + "-")]
    return _state["recipes"][max(names, key=len)] if names else None


def record(kind: str, *, sticky: bool = False, **evidence) -> None:
    """The evidence of the comparison about to be made (kept by reference; only with --repro-dir). ``sticky``: the
    later comparisons of the test are parts of this one (a call whose oracle check is one of its checks): their
    own records do not replace it."""
    if _state["dir"] is not None and not (_state["evidence"] or {}).get("sticky"):
        _state["evidence"] = {"kind": kind, **evidence, **({"sticky": True} if sticky else {})}


def record_call(subject: str, args: tuple, kwargs: dict, *, shape, nan_rows, first_of_tuple: bool = False) -> None:
    """A kernel call that broke the calling contract (it raised; its output's shape, dtype or device was wrong; it
    was not finite outside ``nan_rows``): the reproducer makes the same call and checks the same contract."""
    if _state["dir"] is not None:
        _state["evidence"] = {"kind": "call", "subject": subject, "device": str(args[0].device), "args": list(args),
                              "kwargs": dict(kwargs), "shape": tuple(shape), "nan_rows": nan_rows,
                              "first_of_tuple": first_of_tuple,   # and the inputs that required grad, as they did
                              "requires_grad": [torch.is_tensor(a) and a.requires_grad for a in args]}


def observe_kernel_call(subject: str, query, key, value, kwargs: dict) -> None:
    """A kernel call (SDPA signature) of the running test that kept the calling contract: the last one is the
    fallback of a failing clause whose own comparison records nothing (properties/plugin/repro.py: last_call)."""
    if _state["dir"] is not None:
        _state["kernel_call"] = (subject, query, key, value, dict(kwargs))


def observe_flash_call(subject: str, q, key, value, kwargs: dict) -> None:
    """The same for a kernel with FlashAttention's ``flash`` API (properties/plugin/repro_kernel.py)."""
    if _state["dir"] is not None:
        _state["flash_call"] = (subject, q, key, value, dict(kwargs))


def clear() -> None:
    _state["evidence"] = None
    _state["kernel_call"] = None
    _state["flash_call"] = None
    _state["calls"].clear()


def take() -> dict | None:
    evidence, _state["evidence"] = _state["evidence"], None
    return evidence


def take_kernel_call():
    """(subject, query, key, value, kwargs) of the running test's last kernel call, and the run's causal alignment."""
    call, _state["kernel_call"] = _state["kernel_call"], None
    return call, _state["alignment"]


def take_flash_call():
    """(subject, q, k, v, kwargs) of the running test's last ``flash``-API kernel call, or None."""
    call, _state["flash_call"] = _state["flash_call"], None
    return call


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
    """(args, index into that call's flattened output shaped like ``view``, subject) for a tensor that views a kept
    call's output."""
    for args, out, subject in reversed(_state["calls"]):
        if view.untyped_storage().data_ptr() == out.untyped_storage().data_ptr() and out.is_contiguous():
            base = torch.arange(out.numel())
            index = torch.as_strided(base, view.shape, view.stride(), view.storage_offset() - out.storage_offset())
            return args, index, subject
    return None
