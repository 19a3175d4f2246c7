"""The evidence of each comparison, for --repro-dir DIR (SPEC.md, "Reproducers"): a standalone script for each failing
clause.

The comparisons that decide a clause record their evidence as they run (``record``: the subject, the inputs of the
call or calls, how they were compared and with which bound); nothing is kept unless the run asks for reproducers.
When a test fails, the evidence of its last comparison — Hypothesis replays the minimal failing example last — is
written as ``<clause>-<n>.py`` in the run's own subdirectory of DIR, its tensors beside it (properties/repro/write.py). This recorder sits on the
core floor, below the levels whose comparisons call it; the writers are the package properties/repro/.
"""
from __future__ import annotations

import torch

__all__ = ["activate", "active", "directory", "set_model_recipes", "model_recipe", "record", "record_call",
           "observe_kernel_call", "clear", "take", "take_kernel_call", "observe_flash_call", "take_flash_call",
           "flat_index", "view_index", "observe_call", "observe_part", "observe_module_call", "record_module_oracle",
           "new_example", "example_failed", "use_failing_example"]

_state: dict = {"dir": None, "evidence": None, "calls": [], "kernel_call": None, "flash_call": None,
                "alignment": "top-left", "recipes": {}, "parts": {}, "module_call": None, "failed": None}


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
    fallback of a failing clause whose own comparison records nothing (properties/repro/write.py:
    last_call_evidence)."""
    if _state["dir"] is not None:
        _state["kernel_call"] = (subject, query, key, value, dict(kwargs))


def observe_flash_call(subject: str, q, key, value, kwargs: dict) -> None:
    """The same for a kernel with FlashAttention's ``flash`` API (properties/repro/write.py: flash_call_evidence)."""
    if _state["dir"] is not None:
        _state["flash_call"] = (subject, q, key, value, dict(kwargs))


_EXAMPLE = ("evidence", "kernel_call", "flash_call", "calls", "module_call", "parts")   # what one example records


def clear() -> None:
    """A new test: nothing recorded, no failing example kept."""
    new_example()
    _state["failed"] = None


def new_example() -> None:
    """A new Hypothesis example of the running test: its records start empty."""
    _state.update(evidence=None, kernel_call=None, flash_call=None, calls=[], module_call=None, parts={})


def example_failed() -> None:
    """The running example raised: its records are kept as the test's failing example, which the examples Hypothesis
    runs after it (the other explicit examples, which it runs all) do not replace."""
    _state["failed"] = {name: _state[name] for name in _EXAMPLE}


def use_failing_example() -> None:
    """Before a failure's script is written: the records of the test's last failing example, where one was kept."""
    if _state.get("failed"):
        _state.update(_state["failed"])


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


# ------------------------------------------------------------------------------------------------ module calls
def observe_part(module, recipe: dict) -> None:
    """How a module clause's part was built (properties/module/parts.py: Part.build): its config node, sizes, seed."""
    if _state["dir"] is not None:
        _state["parts"] = {id(module): (module, recipe)}   # the part of the running example; the module kept alive


def observe_module_call(module, method: str, args: tuple, kwargs: dict, out) -> None:
    """A call of a module clause's part (properties/module/parts.py: call_module): the last one is the call a
    failing oracle comparison replays."""
    if _state["dir"] is not None and id(module) in _state["parts"]:
        _state["module_call"] = (module, method, tuple(args), dict(kwargs), out)


def record_module_oracle(actual, expected, bound, *, what: str, reference: str, oracle: str,
                         check: str = "elementwise", **more) -> None:
    """A module clause compares ``actual`` (the output of the last call of its part) with a float64 oracle within
    ``bound``: the script builds the part again, makes that call and compares with ``expected`` as computed here.
    ``check="standardize"`` (NORM-STANDARDIZE): ``expected`` is the exact normalized features, ``bound`` the
    output's error bound, ``more["variance"]`` σ²/(σ² + eps); the script applies the clause's two checks."""
    call = _state["module_call"]
    if _state["dir"] is None or call is None or call[4] is not actual:
        return
    module, method, args, kwargs, _ = call
    recipe = _state["parts"][id(module)][1]
    expected = expected.detach().double().cpu()
    record("module-oracle", subject=recipe["origin"], device=str(actual.device), what=what, reference=reference,
           recipe=recipe, method=method, args=list(args), kwargs=dict(kwargs), expected=expected,
           bound=torch.broadcast_to(torch.as_tensor(bound, dtype=torch.float64).cpu(), expected.shape).clone(),
           oracle=oracle, check=check, **{k: v.detach().double().cpu() for k, v in more.items()})
