'''The reproducers of the kernel clauses (properties/repro/write.py writes them): a header that loads the kernel as
the run did and holds a float64 oracle of SDPA's semantics in plain torch, then one body per kind of comparison:
``oracle`` (a call against the oracle and the clause's bound), ``two-calls`` (two calls compared bitwise or within a
bound; forward and, when recorded, backward), ``gradient`` (dQ, dK, dV against the oracle's chain rule, by autograd
through it: the suite's own oracle, properties/core/oracle.py, detaches its inputs and derives the gradients by hand,
properties/kernel/gradients.py), the dropout kinds (the statistical tests over the same number of draws, with the
suite's own stacking of the copies and Hoeffding bound), ``call`` (a call that broke the calling contract: it
raised, or its output's shape, dtype, device or finiteness), and the kinds of properties/repro/kernel_bodies.py.'''
from __future__ import annotations

from properties.kernel.statistics import FALSE_ALARM, hoeffding_halfwidth, stacked_copies
from properties.repro import kernel_bodies
from properties.repro.script import LOAD, VERDICT, absolute_spec, intro, prelude, source_of

__all__ = ["KINDS", "render"]

_HEADER = '''\
{intro}

    python {stem}.py [SUBJECT]

SUBJECT: the code to check instead of the one that failed (same form as on the suite's command line, e.g. the fixed
kernel). Exits 1 while the departure is there, 0 once it is gone, 2 when it could not check (the subject does not
load, {data_file} is not beside this file, an error before any verdict). Needs torch and the subject's module only;
run it from any directory (SUBJECT below, or the argument, names the code to check).
"""
from __future__ import annotations

import importlib
import importlib.util
import math
import os
import pathlib
import sys

import torch

SUBJECT = {subject!r}
DEVICE = {device!r}
WHAT, REFERENCE = {what!r}, {reference!r}   # the clause's words for what it compares
{prelude}
DATA = torch.load(pathlib.Path(__file__).with_name({data_file!r}), weights_only=True)


{load}

def on_device(x):
    if isinstance(x, dict) and "view_of" in x:   # a view over a larger storage (stride 0, a slice), as the run had it
        return torch.as_strided(x["view_of"].to(DEVICE), x["size"], x["stride"], x["offset"])
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


{verdict}

def worst(excess, *named):
    """'at index (...): name = value, ...' for the entry whose excess is largest."""
    i = int(torch.nan_to_num(excess.reshape(-1), nan=math.inf).argmax())
    index = tuple(int(j) for j in torch.unravel_index(torch.tensor(i), excess.shape))
    return f"at index {{index}}: " + ", ".join(f"{{n}} = {{float(t.reshape(-1)[i]):.6g}}" for n, t in named)


def check_gradients(names, grads, grads64, departs):
    """The verdict on gradients against the float64 chain rule: 'd<name> <departs> at ... entries' for the first
    one outside its bound (DATA["bound"][name]), else none."""
    for name, grad, grad64 in zip(names, grads, grads64):
        bound = DATA["bound"][name]
        excess = torch.nan_to_num((grad.double().cpu() - grad64).abs() - bound, nan=math.inf)
        if (excess > 0).any():
            verdict(True, f"d{{name}} {{departs}} at {{int((excess > 0).sum())}} of {{excess.numel()}} entries; "
                    f"worst " + worst(excess, (f"d{{name}}", grad.double().cpu()), ("oracle", grad64),
                                      ("bound", bound.expand_as(grad64))))
    verdict(False, "")


# The suite's own: how the dropout clauses stack their copies, and the Hoeffding bound they test with.
{suite_functions}


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
check_gradients(names, grads, grads64, "departs from the float64 chain rule by more than the bound")
''',
    "dropout-rate": '''
# Statistical: the fraction of dropped weights among the n weights that are positive without dropout is compared with
# dropout_p by Hoeffding's inequality; a correct kernel fails this with probability at most {false_alarm:g}.
n, p, seed = DATA["copies"], DATA["p"], DATA["seed"]
query, key, positive = on_device(DATA["query"]), on_device(DATA["key"]), DATA["positive"]
eye = torch.eye(key.shape[-2], dtype=key.dtype, device=key.device).expand(*key.shape[:-1], key.shape[-2])
with torch.random.fork_rng(devices=[]):
    torch.manual_seed(seed)
    w = subject(*stacked_copies(n, query, key, eye.contiguous()), dropout_p=p).double().cpu()
w = w.reshape(n, *w.shape[1:]) if query.dim() == 2 else w.reshape(n, -1, *w.shape[1:])   # the copies first
count = n * int(positive.sum())
dropped = float((w[:, positive] == 0).sum()) / count
halfwidth = hoeffding_halfwidth(count, 1.0, FALSE_ALARM)
verdict(abs(dropped - p) > halfwidth, f"fraction of dropped weights = {{dropped:.6g}}, dropout_p = {{p:.6g}}: "
        f"|difference| > {{halfwidth:.6g}} (Hoeffding, n = {{count}} weights, false-alarm probability <= {false_alarm:g})")
''',
    "dropout-mean": '''
# Statistical: the mean over n independent dropout draws is compared with the oracle without dropout; the bound is
# Hoeffding's at false-alarm probability {false_alarm:g} shared over the coordinates, plus rounding.
n, p, seed = DATA["copies"], DATA["p"], DATA["seed"]
query, key, value = (on_device(DATA[name]) for name in ("query", "key", "value"))
with torch.random.fork_rng(devices=[]):
    torch.manual_seed(seed)
    out = subject(*stacked_copies(n, query, key, value), dropout_p=p).double().cpu()
mean = (out if query.dim() == 2 else out.reshape(n, -1, *out.shape[1:])).mean(dim=0)
expected, _ = oracle(query, key, value)
excess = torch.nan_to_num((mean - expected).abs() - DATA["bound"], nan=math.inf)
verdict((excess > 0).any(), f"mean over {{n}} dropout draws (p = {{p:.6g}}) of out departs from the oracle without "
        f"dropout at {{int((excess > 0).sum())}} of {{excess.numel()}} entries; worst " +
        worst(excess, ("mean", mean), ("oracle", expected), ("bound", DATA["bound"].expand_as(mean))))
''',
    "dropout-gradient": '''
# V = I: the output is the realised weight matrix (dropped and rescaled), so the dropout mask the forward drew is
# read from it, and dQ, dK, dV are compared with the float64 chain rule through that same mask.
p, contract = DATA["p"], {{name: on_device(x) for name, x in DATA["contract"].items()}}
query, key = on_device(DATA["query"]), on_device(DATA["key"])
eye = torch.eye(key.shape[-2], dtype=key.dtype, device=key.device).expand(*key.shape[:-1], key.shape[-2])
leaves = [t.detach().clone().requires_grad_() for t in (query, key, eye.contiguous())]
with torch.random.fork_rng(devices=[]):
    torch.manual_seed(DATA["seed"])
    out = subject(*leaves, dropout_p=p, **contract)
grads = torch.autograd.grad(out, leaves, on_device(DATA["upstream"]))
keep = out.detach().double().cpu() != 0
leaves64 = [t.detach().double().cpu().requires_grad_() for t in leaves]
weights, _ = oracle(leaves64[0], leaves64[1], leaves64[2].detach(), **contract)
expected = (weights * keep / (1 - p)) @ leaves64[2]
grads64 = torch.autograd.grad(expected, leaves64, DATA["upstream"].double())
check_gradients(("query", "key", "value"), grads, grads64,
                f"with dropout departs from the chain rule with the forward's realised mask (p={{p:.3g}})")
''',
    "call": '''
args = [on_device(x).requires_grad_() if grad else on_device(x) for x, grad in zip(DATA["args"], DATA["requires_grad"])]
kwargs = {{name: on_device(x) for name, x in DATA["kwargs"].items()}}
try:
    out = subject(*args, **kwargs)
except Exception as exc:   # the calling contract: a call inside the kernel's limits returns
    verdict(True, f"the kernel raised {{type(exc).__name__}}: {{exc}}")
if DATA["first_of_tuple"] and isinstance(out, (tuple, list)) and out and torch.is_tensor(out[0]):
    out = out[0]   # FlashAttention's API: (out, softmax_lse, ...)
query, expected = args[0], tuple(DATA["shape"])
if not torch.is_tensor(out):
    verdict(True, f"the kernel returned {{type(out).__name__}}, not a tensor")
if tuple(out.shape) != expected:
    verdict(True, f"output shape {{tuple(out.shape)}} != expected {{expected}} (query's leading dims, value's last dim)")
if out.dtype != query.dtype or out.device != query.device:
    verdict(True, f"output {{out.dtype}} on {{out.device}} != the query's {{query.dtype}} on {{query.device}}")
finite = torch.isfinite(out).cpu()
if DATA["nan_rows"] is not None:   # queries the clause allows to come out NaN
    finite = finite | DATA["nan_rows"][..., None]
first = tuple(int(i) for i in (~finite).nonzero()[0]) if not finite.all() else None
verdict(first is not None, f"output is not finite at {{int((~finite).sum())}} of {{finite.numel()}} entries; "
        f"first at index {{first}}: {{float(out[first]) if first else 0.0}}")
''',
}


KINDS = frozenset(_BODIES) | frozenset(kernel_bodies.BODIES)


def render(evidence: dict, *, clause, data_file: str, nodeid: str, counterexample: str) -> str:
    """The script of a kernel clause's evidence (``evidence["kind"]`` in KINDS)."""
    subject = absolute_spec(evidence["subject"])
    header = _HEADER.format(intro=intro(clause, nodeid, counterexample), load=LOAD,
                            prelude=prelude([subject], "SUBJECT: the kernel to check"),
                            verdict=VERDICT.format(clause=clause.id), what=evidence.get("what", "out"),
                            reference=evidence.get("reference", "the first call"),
                            stem=data_file.removesuffix(".pt"), data_file=data_file, subject=subject,
                            device=evidence.get("device", "cpu"),
                            suite_functions=source_of(stacked_copies, hoeffding_halfwidth))
    body = {**_BODIES, **kernel_bodies.BODIES}[evidence["kind"]].format(false_alarm=FALSE_ALARM)
    return header + body
