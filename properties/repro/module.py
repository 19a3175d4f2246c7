'''The reproducers of the module clauses (properties/repro/write.py writes them): the script builds the zoo part the
failing example checked as the run built it — its config node as the run composed it (the --zoo overrides, or the
zoo's default composition), called with the example's sizes, in eval mode, every floating parameter redrawn from the
example's seed by the suite's own ``reinitialize`` (properties/module/parts.py, its source in the script) — replays
the part's failing call on the recorded inputs and compares the output, within the elementwise bound the clause
used, with a float64 oracle: the formula in plain torch where it is a few lines (the FFN; the sinusoid table, by the
suite's own ``sinusoid_table``), else (multi-head attention, the norms) the float64 values the suite's oracle
computed from the part's own weights in the run, saved with the inputs.

Kind ``module-oracle`` (properties/core/evidence.py: record_module_oracle): MHA-ORACLE, MHA-SINGLE-HEAD, MHA-GQA,
FFN-FORMULA, POS-SINUSOID-FORMULA elementwise; NORM-STANDARDIZE's mean and variance of the features recovered from
the output, with the clause's bounds computed in the script from the oracle's saved output bound (Higham's gamma of
properties/core/tolerance.py).'''
from __future__ import annotations

from properties.core.zoo_config import LAYER_SIZES
from properties.repro.script import VERDICT, intro, literal, prelude, source_of

__all__ = ["KINDS", "render"]

KINDS = frozenset({"module-oracle"})

_HEADER = '''\
{intro}
Part: the {group} part ({target}) of {origin}, sizes {sizes}, {dtype}, parameters redrawn from seed {seed}

    python {stem}.py [OVERRIDES]

OVERRIDES: Hydra overrides as --zoo takes them, one argument (e.g. "{group}._target_=mypkg.FixedPart"): the
{group} part they compose is built instead, with the same sizes, seed and inputs. Exits 1 while the departure is
there, 0 once it is gone, 2 when it could not check (the part does not build, {data_file} is not beside this file, an
error before any verdict). Needs torch and the zoo only; run it from any directory.

Oracle: {oracle_words} The elementwise bound is the one the clause used, saved in {data_file} (the suite's float64
error model of a correct part in {dtype}, {oracle}).
"""
from __future__ import annotations

import math
import os
import pathlib
import shlex
import sys

import torch

GROUP, METHOD = {group!r}, {method!r}   # the part's group and the method the clause called
NODE = {node}   # the part's config node as the run composed it (interpolations resolved)
SIZES, SEED, DTYPE = {sizes!r}, {seed!r}, {dtype!r}
LAYER_SIZES = {layer_sizes!r}   # the sizes the suite composes --zoo with, where the overrides set none
DEVICE = {device!r}
WHAT, REFERENCE = {what!r}, {reference!r}   # the clause's words for what it compares
{prelude}
DATA = torch.load(pathlib.Path(__file__).with_name({data_file!r}), weights_only=True)


def part_node():
    """The run's node, or the node of GROUP that the overrides given on the command line compose."""
    from omegaconf import OmegaConf
    if len(sys.argv) < 2:
        return OmegaConf.create(NODE)
    from zoo.config.composition import compose_config
    words = shlex.split(sys.argv[1])
    given = {{w.split("=", 1)[0].lstrip("+~") for w in words}}
    words = [s for s in LAYER_SIZES if s.split("=", 1)[0] not in given] + words
    try:
        return compose_config(words if "task" in given else ["task=verify", *words])[GROUP]
    except Exception as exc:   # noqa: BLE001 -- overrides that do not compose: nothing to check
        cannot_run(f"the overrides {{sys.argv[1]}} do not compose ({{type(exc).__name__}}: {{exc}})")


# The suite's own: the parameters' draw, the sinusoid table, Higham's gamma.
{suite_functions}


def built_part():
    from zoo.config.parts import instantiate_part
    node = part_node()
    built_part.activation = node.get("activation")   # the FFN variant the formula below computes
    module = instantiate_part(node)(**{{k: v for k, v in SIZES.items() if k in node}}, device=DEVICE,
                                    dtype=getattr(torch, DTYPE))
    module.eval()
    reinitialize(module, SEED)
    return module


def formula(part, args):
    """The clause's formula in float64 plain torch from the part's own weights, where it is a few lines (the FFN,
    the sinusoid table); None where the saved oracle values are the reference (attention, norms)."""
    x = args[0].double().cpu()
    if {formula!r} == "sinusoid":   # the table at positions offset, offset + 1, ... (args[1]: the offset)
        return x + sinusoid_table(range(args[1], args[1] + x.shape[-2]), x.shape[-1])
    if {formula!r} == "ffn":   # act(x W1ᵀ + b1) W2ᵀ + b2; swiglu: (SiLU(x W_gᵀ + b_g) ⊙ (x W1ᵀ + b1)) W2ᵀ + b2
        def lin(name, t):
            layer = getattr(part, name)
            bias = 0.0 if layer.bias is None else layer.bias.detach().double().cpu()
            return t @ layer.weight.detach().double().cpu().T + bias
        act = {{"relu": torch.relu, "gelu": lambda t: 0.5 * t * (1 + torch.erf(t / math.sqrt(2))),
               "gelu_tanh": lambda t: 0.5 * t * (1 + torch.tanh(math.sqrt(2 / math.pi) * (t + 0.044715 * t ** 3)))}}
        kind = built_part.activation
        hidden = (torch.nn.functional.silu(lin("gate", x)) * lin("up", x) if kind == "swiglu" else
                  act[kind](lin("up", x)))
        return lin("down", hidden)
    return None


def on_device(x):
    if isinstance(x, dict) and "view_of" in x:   # a view over a larger storage, as the run had it
        return torch.as_strided(x["view_of"].to(DEVICE), x["size"], x["stride"], x["offset"])
    return x.to(DEVICE) if torch.is_tensor(x) else x


{verdict}'''

_BODY = '''
part = built_part()
args = [on_device(x) for x in DATA["args"]]
kwargs = {name: on_device(x) for name, x in DATA["kwargs"].items()}
with torch.no_grad():
    out = getattr(part, METHOD)(*args, **kwargs).double().cpu()
expected, bound = DATA["expected"], DATA["bound"]
if formula(part, args) is not None:   # recomputed here rather than read from the run's saved values
    expected = formula(part, args)
if out.shape != expected.shape:
    verdict(True, f"{WHAT} has shape {tuple(out.shape)}, expected {tuple(expected.shape)}")
if DATA["check"] == "standardize":   # NORM-STANDARDIZE: the features n = (y - bias)/weight recovered from the output
    u = unit_roundoff(torch.float64)
    g = part.weight.detach().double().cpu()
    b = part.bias.detach().double().cpu() if getattr(part, "bias", None) is not None else torch.zeros_like(g)
    n, d = (out - b) / g, out.shape[-1]
    e = bound / g.abs() + gamma(2, u) * (out.abs() + b.abs()) / g.abs()   # n's bound, from the output's
    mean, square = n.mean(-1), (n * n).mean(-1)
    checks = [("mean of the normalized features", mean, torch.zeros_like(mean), "0",
               e.mean(-1) + gamma(d + 1, u) * n.abs().mean(-1)),
              ("variance of the normalized features", square, DATA["variance"], "σ²/(σ² + eps) (1 up to eps)",
               ((2 * expected.abs() + e) * e).mean(-1) + gamma(d + 2, u) * square)]
    for what, value, target, reference, limit in checks:
        error = torch.nan_to_num((value - target).abs(), nan=math.inf)
        if (error > limit).any():
            i = int((error / limit.clamp_min(1e-300)).reshape(-1).argmax())
            index = tuple(int(j) for j in torch.unravel_index(torch.tensor(i), value.shape))
            verdict(True, f"|{what} - {reference}| = {float(error.reshape(-1)[i]):.6g} > bound "
                    f"{float(limit.reshape(-1)[i]):.6g} at (sample, position) {index}: {what} = "
                    f"{float(value.reshape(-1)[i]):.6g} ({int((error > limit).sum())} of {error.numel()} tokens "
                    f"outside the bound; normalized = (y - bias)/weight)")
    verdict(False, "")
error = torch.nan_to_num((out - expected).abs(), nan=math.inf)
outside = ~(error <= bound)
i = int(torch.where(outside, error / bound.clamp_min(1e-300), torch.full_like(error, -1.0)).reshape(-1).argmax())
index = tuple(int(j) for j in torch.unravel_index(torch.tensor(i), out.shape))
verdict(outside.any(), f"|{WHAT} - {REFERENCE}| = {float(error.reshape(-1)[i]):.6g} > bound "
        f"{float(bound.reshape(-1)[i]):.6g} at index {index}: {WHAT} = {float(out.reshape(-1)[i]):.6g}, "
        f"{REFERENCE} = {float(expected.reshape(-1)[i]):.6g} ({int(outside.sum())} of {out.numel()} entries "
        f"outside the bound)")
'''


_FORMULAS = {"ffn": "ffn", "pos": "sinusoid"}   # groups whose formula the script writes inline (formula())
_ORACLE_WORDS = {
    "inline": "the formula in float64, inline below (formula()), from the part's own weights.",
    "saved": "not recomputed here: the float64 values the suite's oracle computed in the run from the part's own "
             "weights (the weights this script draws from the seed) are saved in {data_file}.",
}


def render(evidence: dict, *, clause, data_file: str, nodeid: str, counterexample: str) -> str:
    """The script of a module clause's evidence (``evidence["kind"]`` in KINDS)."""
    # Imported when a script is written, not with the plug-in: properties/module/parts.py builds its Hypothesis
    # settings when imported, from the profile loaded then, which must be the run's (--hypothesis-profile).
    from properties.core.tolerance import gamma, unit_roundoff
    from properties.module.oracle import sinusoid_table
    from properties.module.parts import reinitialize
    recipe = evidence["recipe"]
    origin = recipe["origin"]
    origin = "the zoo's default composition" if origin == "zoo" else f"the config the run's {origin} composed"
    target = next((line.split(":", 1)[1].strip() for line in recipe["node"].splitlines()
                   if line.startswith("_target_:")), "?")
    # the classes and kernels the node names, as specs: a user's part is imported from where the run found it
    named = [line.split(":", 1)[1].strip() for line in recipe["node"].splitlines()
             if line.strip().startswith(("_target_:", "kernel:"))]
    specs = [name if ":" in name else ":".join(name.rsplit(".", 1)) for name in named]
    header = _HEADER.format(intro=intro(clause, nodeid, counterexample), stem=data_file.removesuffix(".pt"),
                            prelude=prelude(specs, "OVERRIDES: the part to build instead"),
                            group=recipe["group"],
                            target=target, origin=origin, sizes=recipe["sizes"], dtype=recipe["dtype"],
                            seed=recipe["seed"], data_file=data_file, oracle=evidence["oracle"],
                            method=evidence["method"], node=literal(recipe["node"]), layer_sizes=LAYER_SIZES,
                            formula=_FORMULAS.get(recipe["group"]), oracle_words=_ORACLE_WORDS[
                                "inline" if _FORMULAS.get(recipe["group"]) else "saved"].format(data_file=data_file),
                            device=evidence.get("device", "cpu"), what=evidence["what"],
                            reference=evidence["reference"], verdict=VERDICT.format(clause=clause.id),
                            suite_functions=source_of(reinitialize, sinusoid_table, gamma, unit_roundoff))
    return header + _BODY
