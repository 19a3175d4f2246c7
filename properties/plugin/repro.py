'''The text of a reproducer (properties/core/repro.py writes it through properties/plugin/report.py): a header that loads the subject as the run did and holds
the float64 oracle in plain torch, then one body per kind of comparison: ``oracle`` (a call against the oracle and
the clause's bound), ``two-calls`` (two calls compared bitwise or within a bound; forward and, when recorded,
backward), ``gradient`` (dQ, dK, dV against the oracle's chain rule), ``dropout-rate`` (the statistical test over
the same number of draws) and ``model`` (two forward passes of a model compared within the clause's tolerance).'''
from __future__ import annotations

import os
import textwrap
from pathlib import Path

import torch

from properties.core import repro
from zoo.io.atomic import replacing, write_text

__all__ = ["render", "write", "reset"]

_counts: dict[str, int] = {}   # clause -> reproducers written this run


def reset() -> None:
    _counts.clear()

_HEADER = '''\
#!/usr/bin/env python3
"""Reproducer of {clause} ({title}), written by the spec suite's --repro-dir.

Clause: {statement}
Failing test: {nodeid}
Counterexample: {counterexample}

    python {stem}.py [SUBJECT]

SUBJECT: the code to check instead of the one that failed (same form as on the suite's command line, e.g. the fixed
kernel). Exits 1 while the departure is there, 0 once it is gone. Needs torch and the subject's module only; the
inputs are in {data_file} beside this file.
"""
import importlib
import importlib.util
import math
import pathlib
import sys

import torch

SUBJECT = {subject!r}
DEVICE = {device!r}
WHAT, REFERENCE = {what!r}, {reference!r}   # the clause's words for what it compares
DATA = torch.load(pathlib.Path(__file__).with_name({data_file!r}), weights_only=True)


def load(spec):
    """'pkg.module:name', 'path/to/file.py:name', or one of the zoo's kernel names (zoo.nn.kernel)."""
    if ":" not in spec:
        from zoo.nn.kernel import resolve_kernel
        return resolve_kernel(spec)
    module_name, _, name = spec.rpartition(":")
    if module_name.endswith(".py"):
        where = importlib.util.spec_from_file_location(pathlib.Path(module_name).stem, module_name)
        module = importlib.util.module_from_spec(where)
        sys.modules[where.name] = module
        where.loader.exec_module(module)
    else:
        module = importlib.import_module(module_name)
    for part in name.split("."):
        module = getattr(module, part)
    return module


def on_device(x):
    return x.to(DEVICE) if torch.is_tensor(x) else x


def oracle(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
           alignment="top-left"):
    """softmax(q k^T scale + mask) v in float64; a query without an admissible key gives 0. Returns (out, no_key)."""
    q, k, v = (t.double().cpu() for t in (query, key, value))   # no detach: the gradient reproducers
    if enable_gqa and q.dim() >= 3 and k.shape[-3] != q.shape[-3]:
        k, v = (t.repeat_interleave(q.shape[-3] // t.shape[-3], dim=-3) for t in (k, v))
    scores = q @ k.transpose(-1, -2) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    allowed = torch.ones(scores.shape[-2:], dtype=torch.bool)
    if is_causal:
        offset = 0 if alignment == "top-left" else scores.shape[-1] - scores.shape[-2]
        allowed = torch.ones_like(allowed).tril(offset)
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        allowed = allowed & attn_mask.cpu()
    elif attn_mask is not None:
        scores = scores + attn_mask.double().cpu()
    scores = scores.masked_fill(~allowed, -math.inf)
    no_key = torch.isinf(scores).all(-1) & (scores < 0).all(-1)
    top = scores.amax(-1, keepdim=True).masked_fill(no_key[..., None], 0)
    weights = (scores - top).exp()
    weights = weights / weights.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny)
    return weights @ v, no_key


def verdict(bad, message):
    """Print the departure in the clause's words and exit 1, or say it is gone and exit 0."""
    if bool(bad):
        print(f"FAIL {clause}: {{message}}")
        sys.exit(1)
    print(f"OK {clause}: no departure on this counterexample")
    sys.exit(0)


def worst(excess, *named):
    """'at index (...): name = value, ...' for the entry whose excess is largest."""
    i = int(torch.nan_to_num(excess.reshape(-1), nan=math.inf).argmax())
    index = tuple(int(j) for j in torch.unravel_index(torch.tensor(i), excess.shape))
    return f"at index {{index}}: " + ", ".join(f"{{n}} = {{float(t.reshape(-1)[i]):.6g}}" for n, t in named)


subject = load(sys.argv[1] if len(sys.argv) > 1 else SUBJECT)
'''

_BODIES = {
    "oracle": '''
inputs = {{name: on_device(x) for name, x in DATA["inputs"].items()}}
query, key, value = inputs.pop("query"), inputs.pop("key"), inputs.pop("value")
if value is None:   # the clause read the kernel's weights: its output for V = I
    value = torch.eye(key.shape[-2], dtype=key.dtype, device=key.device).expand(*key.shape[:-1], key.shape[-2])
out = subject(query, key, value, **inputs).double().cpu()
expected, no_key = oracle(query, key, value, alignment=DATA["alignment"], **inputs)
if DATA["fully_masked"] != "zeros":   # --fully-masked: rows without an admissible key are not compared here
    out = torch.where(no_key[..., None], expected, out)
excess = torch.nan_to_num((out - expected).abs() - DATA["bound"], nan=math.inf)
verdict((excess > 0).any(), f"{{WHAT}} departs from the float64 oracle by more than the bound at "
        f"{{int((excess > 0).sum())}} of {{excess.numel()}} entries; worst " +
        worst(excess, (WHAT, out), ("oracle", expected), ("bound", DATA["bound"].expand_as(out))))
''',
    "two-calls": '''
def call(inputs, upstream=None):
    inputs = {{name: on_device(x) for name, x in inputs.items()}}
    leaves = [inputs.pop(n).detach().requires_grad_(upstream is not None) for n in ("query", "key", "value")]
    out = subject(*leaves, **inputs)
    grads = []
    if upstream is not None and out.requires_grad:
        grads = [g.double().cpu().reshape(-1) for g in torch.autograd.grad(out, leaves, on_device(upstream))]
    return out.detach().double().cpu().reshape(-1), grads


upstream = DATA.get("upstream")
first, first_grads = call(DATA["first"], upstream)
for other in DATA.get("between", []):   # the calls the clause made between the two
    call(other)
second, second_grads = call(DATA["second"], upstream)
a, b = second[DATA["index_second"]], first[DATA["index_first"]]
pairs = [(WHAT, a, b)] + [(f"d{{n}} of the second call", g2, g1)
                              for n, g2, g1 in zip(("q", "k", "v"), second_grads, first_grads)]
for name, x, y in pairs:
    if DATA["bitwise"]:
        bad = ~((x == y) | (x.isnan() & y.isnan()))
        how = "bitwise"
    else:
        bad = torch.nan_to_num((x - y).abs() - DATA["bound"].reshape(-1), nan=math.inf) > 0
        how = "within the bound (this kernel's repeated calls differ in their rounding)"
    if bad.any():
        i = int(bad.nonzero()[0])
        verdict(True, f"{{name}} differs from {{REFERENCE}} ({{how}}) at {{int(bad.sum())}} of {{x.numel()}} compared "
                f"entries; first: {{float(x[i]):.9g}} vs {{float(y[i]):.9g}}")
verdict(False, "")
''',
    "gradient": '''
inputs = {{name: on_device(x) for name, x in DATA["inputs"].items()}}
names = [n for n in ("query", "key", "value", "attn_mask") if n in DATA["bound"]]
leaves = {{n: inputs[n].detach().requires_grad_() for n in names}}
call = {{**inputs, **leaves}}
out = subject(call.pop("query"), call.pop("key"), call.pop("value"), **call)
grads = torch.autograd.grad(out, list(leaves.values()), on_device(DATA["upstream"]))
leaves64 = {{n: inputs[n].detach().double().cpu().requires_grad_() for n in names}}
expected, _ = oracle(**{{**inputs, **leaves64}}, alignment=DATA["alignment"])
grads64 = torch.autograd.grad(expected, list(leaves64.values()), DATA["upstream"].double())
for name, grad, grad64 in zip(names, grads, grads64):
    bound = DATA["bound"][name]
    excess = torch.nan_to_num((grad.double().cpu() - grad64).abs() - bound, nan=math.inf)
    if (excess > 0).any():
        verdict(True, f"d{{name}} departs from the float64 chain rule by more than the bound at "
                f"{{int((excess > 0).sum())}} of {{excess.numel()}} entries; worst " +
                worst(excess, (f"d{{name}}", grad.double().cpu()), ("oracle", grad64), ("bound", bound.expand_as(grad64))))
verdict(False, "")
''',
    "dropout-rate": '''
# Statistical: the fraction of dropped weights among the n weights that are positive without dropout is compared with
# dropout_p by Hoeffding's inequality; a correct kernel fails this with probability at most {false_alarm:g}.
n, p, seed = DATA["copies"], DATA["p"], DATA["seed"]
query, key, positive = on_device(DATA["query"]), on_device(DATA["key"]), DATA["positive"]
eye = torch.eye(key.shape[-2], dtype=key.dtype, device=key.device).expand(*key.shape[:-1], key.shape[-2])
with torch.random.fork_rng(devices=[]):
    torch.manual_seed(seed)
    w = subject(*(t.expand(n, *t.shape).contiguous() for t in (query, key, eye)), dropout_p=p).double().cpu()
count = n * int(positive.sum())
dropped = float((w[:, positive] == 0).sum()) / count
halfwidth = math.sqrt(math.log(2 / {false_alarm!r}) / (2 * count))
verdict(abs(dropped - p) > halfwidth, f"fraction of dropped weights = {{dropped:.6g}}, dropout_p = {{p:.6g}}: "
        f"|difference| > {{halfwidth:.6g}} (Hoeffding, n = {{count}} weights, false-alarm probability <= {false_alarm:g})")
''',
    "model": '''
built = subject()   # the factory, as --model called it
if isinstance(built, torch.nn.Module):   # a zoo model: its forward is the model, in eval mode
    module, forward = built.eval(), built
else:                                     # a Subject: its forward and module
    module, forward = built.module, built.forward
if DATA["float64"]:   # the clause compared the model's float64 twin (module.to(float64))
    module.to(torch.float64)
with torch.no_grad():
    first = forward(*(on_device(x) for x in DATA["first"])).double().cpu().reshape(-1)[DATA["index_first"]]
    second = forward(*(on_device(x) for x in DATA["second"])).double().cpu().reshape(-1)[DATA["index_second"]]
diff = torch.nan_to_num((second - first).abs(), nan=math.inf)
verdict((diff > DATA["tolerance"]).any(), f"{{WHAT}}: differs by {{float(diff.max()):.3e}} from {{REFERENCE}} at "
        f"{{int((diff > DATA['tolerance']).sum())}} of {{diff.numel()}} entries (tolerance {{DATA['tolerance']:.3e}})")
''',
}


def render(evidence: dict, *, clause, data_file: str, nodeid: str, counterexample: str) -> str:
    from properties.kernel.statistics import FALSE_ALARM
    stem = data_file.removesuffix(".pt")
    statement = textwrap.fill(clause.statement, 110, subsequent_indent="    ")
    what, reference = evidence.get("what", "out"), evidence.get("reference", "the first call")
    header = _HEADER.format(what=what, reference=reference, clause=clause.id, title=clause.title, statement=statement, nodeid=nodeid,
                            counterexample=counterexample or "(see the test's report)", stem=stem,
                            data_file=data_file, subject=evidence["subject"], device=evidence.get("device", "cpu"))
    body = _BODIES[evidence["kind"]].format(false_alarm=FALSE_ALARM)
    return header + body


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
    evidence = repro.take()
    if repro.directory() is None or evidence is None:
        return None
    evidence = dict(evidence)
    if evidence["kind"] == "model":
        evidence["subject"] = repro.model_spec()
        if evidence["subject"] is None:   # a zoo family or --zoo: no factory for the script to import
            return None
    n = _counts[clause.id] = _counts.get(clause.id, 0) + 1
    directory = Path(repro.directory())
    directory.mkdir(parents=True, exist_ok=True)
    stem = f"{clause.id}-{n}"
    data = {k: _cpu(v) for k, v in evidence.items() if k not in ("kind", "subject", "device", "what")}
    with replacing(directory / f"{stem}.pt") as temporary:
        torch.save(data, temporary)
    script = render(evidence, clause=clause, data_file=f"{stem}.pt", nodeid=nodeid, counterexample=counterexample)
    write_text(directory / f"{stem}.py", script)
    os.chmod(directory / f"{stem}.py", 0o755)
    return str(directory / f"{stem}.py")
