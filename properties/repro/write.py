"""--repro-dir DIR: write the reproducer of each failing clause (properties/plugin/report.py calls ``write`` as a
test fails), ``<clause>-<n>.py`` with its tensors in ``<clause>-<n>.pt`` in the run's own directory (a fresh
subdirectory of --repro-dir's DIR, properties/plugin/report.py), from the evidence its comparison
recorded (properties/core/evidence.py) or, where that records nothing, from the test's last kernel call checked
against the float64 oracle. Each script is rehearsed here once, as ``python`` would run it: only a script that exits
1 on the code that failed is kept. The text of a script is properties/repro/kernel.py's, model.py's or
module.py's, by the kind of its evidence."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from properties.core.evidence import directory, take, take_flash_call, take_kernel_call
from properties.repro import kernel, model, module
from properties.repro.script import absolute_spec

__all__ = ["write", "reset", "last_call_evidence", "flash_call_evidence", "saved_tensor", "keep_views"]

_counts: dict[str, int] = {}   # clause -> reproducers written this run
# The writer of each kind of evidence.
_RENDER = {**{kind: kernel.render for kind in kernel.KINDS}, **{kind: model.render for kind in model.KINDS},
           **{kind: module.render for kind in module.KINDS}}


def reset() -> None:
    """Number the scripts of a new run from 1."""
    _counts.clear()


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


def write(clause, nodeid: str, counterexample: str) -> tuple[str | None, str]:
    """Write the reproducer of the failing test for ``clause`` (a properties.core.spec.Clause) and run it once here:
    (its path, '') when it exits 1 on the subject that failed, else (None, why no script is left).  The evidence
    its comparison recorded comes first; then the test's last kernel call against the float64 oracle."""
    recorded = take()
    last_call, alignment = take_kernel_call()
    if directory() is None:
        return None, ""
    reasons = []
    for candidate in (recorded, last_call_evidence(last_call, alignment), flash_call_evidence()):
        if candidate is not None:
            path, why = _write_one(clause, dict(candidate), nodeid, counterexample)
            if path:
                return path, ""
            reasons += [why] if why not in reasons else []
    return None, "; ".join(reasons) or model.unsupported(clause.id) or (
        "the failing check records no comparison this writer can rebuild")


def last_call_evidence(call, alignment: str) -> dict | None:
    """The oracle check of a test's last kernel call (SDPA API) with ATTN-ORACLE's bound: the reproducer of a clause
    whose own comparison (two calls related, a rule on the weights) records nothing, kept only where that call
    departs from the oracle too.  Queries without an admissible key are not compared (their convention varies)."""
    if call is None:
        return None
    subject, query, key, value, kwargs = call
    if kwargs.get("dropout_p", 0.0):   # a random output has no oracle
        return None
    from properties.core.tolerance import output_bound, softmax_bounds
    query, key, value = (t.detach() for t in (query, key, value))
    kwargs = {k: v.detach() if torch.is_tensor(v) else v for k, v in kwargs.items() if k != "dropout_p"}
    bound = output_bound(softmax_bounds(query, key, value, causal_alignment=alignment, **kwargs), value)
    return {"kind": "oracle", "subject": subject, "device": str(query.device), "bound": bound,
            "what": "out of the failing test's last kernel call (ATTN-ORACLE's bound)", "alignment": alignment,
            "inputs": dict(query=query, key=key, value=value, **kwargs), "fully_masked": "any"}


def _write_one(clause, evidence: dict, nodeid: str, counterexample: str) -> tuple[str | None, str]:
    if evidence["kind"] in model.KINDS and (why := model.prepare(evidence, nodeid)):
        return None, why
    if evidence.get("reference_factory"):   # found from any directory, as the subject is
        evidence["reference_factory"] = absolute_spec(evidence["reference_factory"])
    folder = Path(directory())
    stem, script_file = _reserve(folder, clause.id)
    data = {k: _cpu(v) for k, v in keep_views(evidence).items()
            if k not in ("kind", "subject", "device", "what", "sticky")}
    script = _RENDER[evidence["kind"]](evidence, clause=clause, data_file=f"{stem}.pt", nodeid=nodeid,
                                       counterexample=counterexample)
    try:
        with open(folder / f"{stem}.pt", "xb") as f:   # exclusive: never onto a file or link already there
            torch.save(data, f)
        with script_file:
            script_file.write(script)
    except BaseException:
        script_file.close()
        for path in (folder / f"{stem}.py", folder / f"{stem}.pt"):
            path.unlink(missing_ok=True)
        raise
    os.chmod(folder / f"{stem}.py", 0o755)
    status, printed = _rehearse(folder / f"{stem}.py")
    if status == 1:
        return str(folder / f"{stem}.py"), ""
    for path in (folder / f"{stem}.py", folder / f"{stem}.pt"):   # a script that does not fail is no reproducer
        path.unlink(missing_ok=True)
    last = printed.strip().splitlines()[-1] if printed.strip() else ""
    return None, (f"the {evidence['kind']} comparison recorded does not reproduce the failure (its script exited "
                  f"{status}: {last})" if status == 0 else f"its script could not run here (exit {status}: {last})")


def _reserve(folder: Path, clause_id: str):
    """The next free name <clause>-<n> in the run's directory, its .py created exclusively (O_EXCL: a name another
    writer of this run took, pytest-xdist's workers share the directory, is skipped; nothing is ever replaced):
    (stem, the script's file open for writing)."""
    n = _counts.get(clause_id, 0)
    while True:
        n += 1
        try:
            script_file = open(folder / f"{clause_id}-{n}.py", "x", encoding="utf-8")
        except FileExistsError:
            continue
        _counts[clause_id] = n
        return f"{clause_id}-{n}", script_file


def _rehearse(path: Path) -> tuple[object, str]:
    """Run the script in this process, as `python path` would, leaving the random state as it was: its exit status
    and what it printed (an exception of the script: its one-line description, status 'error')."""
    import contextlib
    import io
    import runpy
    import sys
    printed, argv, hook, path_entries = io.StringIO(), sys.argv, sys.excepthook, list(sys.path)
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=devices), contextlib.redirect_stdout(printed):
            sys.argv = [str(path)]
            runpy.run_path(str(path), run_name="__main__")
        return 0, printed.getvalue()   # a script that ends without verdict(): no departure found
    except SystemExit as exit_:
        return exit_.code, printed.getvalue()
    except Exception as exc:   # noqa: BLE001 -- the script's own failure is reported, not raised into the suite
        return "error", f"{printed.getvalue()}\n{type(exc).__name__}: {exc}"
    finally:   # the script's own settings (its exit-status hook, its subject's directories) end with it
        sys.argv, sys.excepthook, sys.path[:] = argv, hook, path_entries


def flash_call_evidence() -> dict | None:
    """The oracle check of the failing test's last call of a ``flash``-API kernel (its output against the float64
    flash oracle with FLASH-ORACLE's bound): the reproducer of a flash clause whose own comparison (weights summing
    to 1, a relation between calls) records nothing, kept only where that call departs from the oracle too."""
    call = take_flash_call()
    if call is None:
        return None
    subject, query, key, value, kwargs = call
    if kwargs.get("dropout_p", 0.0) or set(kwargs) - {"softmax_scale", "causal", "window_size", "softcap",
                                                      "alibi_slopes"}:
        return None   # a random output, or keywords the oracle does not model
    from properties.kernel.flash import flash_bounds
    query, key, value = (t.detach() for t in (query, key, value))
    bounds = flash_bounds(query, key, value, **kwargs)
    return {"kind": "flash-oracle", "subject": subject, "device": str(query.device), "query": query, "key": key,
            "value": value, "kwargs": kwargs, "bound": bounds.output_bound(),
            "what": "out of the failing test's last kernel call (FLASH-ORACLE's bound)"}


def saved_tensor(t: torch.Tensor):
    """A tensor as the ``.pt`` file keeps it: a copy with its strides where it is its whole storage, dense; else (a
    key expanded with stride 0, a slice of a larger buffer) that storage and the view over it, which the script
    rebuilds with ``torch.as_strided`` (its header's ``on_device``): a kernel that mishandles stride 0, or reads outside
    the view, meets the same memory (ATTN-LAYOUT)."""
    t = t.detach()
    elements = t.untyped_storage().nbytes() // max(1, t.element_size())
    if t.storage_offset() == 0 and elements == t.numel() and torch.empty_like(t).stride() == t.stride():
        return t.cpu().clone()
    storage = torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), 0, (elements,), (1,))
    return {"view_of": storage.cpu().clone(), "size": list(t.shape), "stride": list(t.stride()),
            "offset": t.storage_offset()}


_CALL_INPUTS = ("inputs", "query", "key", "value", "first", "second", "between", "args")   # what on_device reads


def keep_views(evidence: dict) -> dict:
    """The evidence with the call inputs' float and bool tensors as ``saved_tensor`` keeps them (the scripts read
    those through ``on_device``, which rebuilds a view; bounds, indices and counts stay plain copies)."""
    def walk(x):
        if torch.is_tensor(x) and (x.is_floating_point() or x.dtype == torch.bool):
            return saved_tensor(x)
        if isinstance(x, dict):
            return {name: walk(v) for name, v in x.items()}
        return [walk(v) for v in x] if isinstance(x, (list, tuple)) else x
    return {name: walk(v) if name in _CALL_INPUTS else v for name, v in evidence.items()}
