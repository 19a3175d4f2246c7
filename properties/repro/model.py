'''The reproducers of the model clauses (properties/repro/write.py writes them): a header that builds the model as the
run built it — the --model factory, or the zoo model from the same composed config (--zoo, --zoo-config) or the same
overrides (the zoo's own families), torch's generator seeded as the suite seeds every build — then one body per kind
of comparison (properties/repro/model_bodies.py): ``model`` (two forward passes within the clause's tolerance,
or bitwise under given seeds), ``model-decode`` (cached decoding against the full pass), ``model-batched-decode``
(a left-padded batch against each sample alone), ``model-factorisation``, ``model-causal-gradient`` (the exact zero
through a probe on the embedding), ``model-shift`` and ``model-diff`` (against the --reference model). A zoo model's
cached decoding and shifted positions are the suite's own functions (properties/core/subject.py), their source in
the script.'''
from __future__ import annotations

from properties.core.evidence import model_recipe
from properties.core.subject import FACTORY_SEED, zoo_decode_step, zoo_shifted
from properties.repro.model_bodies import BODIES
from properties.repro.script import LOAD, VERDICT, absolute_spec, intro, literal, prelude, source_of

__all__ = ["KINDS", "prepare", "render", "unsupported"]

_HEADER = '''\
{intro}
Model: {origin}

    python {stem}.py [MODEL]

MODEL: the model to check instead of the one that failed, in the form the run took it:
{argument}. Exits 1 while the departure is there, 0 once it is gone, 2 when it could not check (the model does not
load, {data_file} is not beside this file, an error before any verdict). Needs torch and the model's module only (a
zoo model: the zoo); run it from any directory.
"""
from __future__ import annotations

import importlib
import importlib.util
import math
import os
import pathlib
import shlex
import sys

import torch

FACTORY = {factory!r}   # --model's factory, or None for a zoo model
OVERRIDES = {overrides!r}   # the zoo model's Hydra overrides
DTYPE = {dtype!r}   # the dtype the suite built the zoo model in (None: the config's own)
CONFIG = {config}   # the config the run composed, built exactly when no MODEL is given (None: build OVERRIDES)
DEVICE = {device!r}
WHAT, REFERENCE = {what!r}, {reference!r}   # the clause's words for what it compares
{prelude}
DATA = torch.load(pathlib.Path(__file__).with_name({data_file!r}), weights_only=True)
FACTORY_SEED = {factory_seed!r}   # the suite builds every model with torch's generator seeded so: the same weights here


{load}

def built_model():
    given = sys.argv[1] if len(sys.argv) > 1 else None
    dtype = getattr(torch, DTYPE) if DTYPE else None
    torch.manual_seed(FACTORY_SEED)
    if FACTORY is not None:
        return load(given or FACTORY)()
    from zoo.config.builder import build_model, model_from_config
    if given is not None or CONFIG is None:   # the zoo's overrides, composed for the suite's task=verify
        words = shlex.split(given) if given is not None else OVERRIDES
        if not any(w.lstrip("+~").split("=", 1)[0] == "task" for w in words):
            words = ["task=verify", *words]
        try:
            return build_model(words, device=DEVICE, dtype=dtype)
        except Exception as exc:   # noqa: BLE001 -- overrides that do not compose or build: nothing to check
            cannot_run(f"the overrides {{' '.join(words)}} do not build a zoo model ({{type(exc).__name__}}: {{exc}})")
    from omegaconf import OmegaConf
    return model_from_config(OmegaConf.create(CONFIG), device=DEVICE, dtype=dtype)


# The suite's own: a zoo model's cached decoding and shifted positions (what Subject.decode_step and Subject.shifted
# are for a zoo model).
{zoo_functions}


def parts(built):
    """(module, forward, decode_step, shifted): a zoo model's forward is the model, in eval mode; a Subject's are its
    fields."""
    if isinstance(built, torch.nn.Module):
        return built.eval(), built, zoo_decode_step(built), zoo_shifted(built)
    return built.module, built.forward, built.decode_step, built.shifted


built = built_model()
module, forward, decode_step, shifted = parts(built)
if DATA["float64"]:   # the clause compared the model's float64 twin (module.to(float64))
    module.to(torch.float64)


def on_device(x):
    return x.to(DEVICE) if torch.is_tensor(x) else x


{verdict}'''
KINDS = frozenset(BODIES)


def prepare(evidence: dict, nodeid: str) -> str:
    """Name the model the failing test ran on (its recipe, put in the evidence): '' or why no script can build it."""
    recipe = model_recipe(nodeid)
    if recipe is None:
        return "the test's model has no recipe a script can rebuild it from (its parameter names no model of this run)"
    recipe = {k: str(v).removeprefix("torch.") if k == "dtype" and v is not None else v for k, v in recipe.items()}
    evidence["recipe"] = recipe
    evidence["subject"] = recipe.get("factory") or recipe.get("origin") or " ".join(recipe["overrides"])
    return ""


def render(evidence: dict, *, clause, data_file: str, nodeid: str, counterexample: str) -> str:
    recipe = evidence["recipe"]
    if "factory" in recipe:
        origin, argument = f"--model {recipe['factory']}", "a factory, pkg.module:factory or path/file.py:factory"
    elif "origin" in recipe:
        origin, argument = f"the zoo model of {recipe['origin']}", "Hydra overrides as --zoo takes them, one argument"
    else:
        origin = f"the zoo's own model built from the overrides {' '.join(recipe['overrides'])}"
        argument = "Hydra overrides as --zoo takes them, one argument"
    factory = absolute_spec(recipe.get("factory"))
    header = _HEADER.format(intro=intro(clause, nodeid, counterexample), load=LOAD,
                            prelude=prelude([factory, evidence.get("reference_factory")], "MODEL: the model to check"),
                            verdict=VERDICT.format(clause=clause.id), stem=data_file.removesuffix(".pt"), origin=origin,
                            argument=argument, data_file=data_file, factory=factory,
                            overrides=recipe.get("overrides", []), dtype=recipe.get("dtype"),
                            config=literal(recipe.get("config")), factory_seed=FACTORY_SEED,
                            zoo_functions=source_of(zoo_decode_step, zoo_shifted),
                            device=evidence.get("device", "cpu"), what=evidence.get("what", "out"),
                            reference=evidence.get("reference", "the first forward pass"))
    return header + BODIES[evidence["kind"]].format()


# Why a failing test of these clauses leaves no script (the terminal summary's `no reproducer` line).
_WHY_NOT = {
    "MODEL-WINDOW": "its gradient checks (d outputs / d embedding through a hook on Subject.embedding; per layer, "
                    "through hooks on Subject.attention_modules) are not recorded; its perturbation half has a script",
    "MODEL-DEPENDENCE": "a must-change clause (a change no larger than the rounding threshold, or 8x the noise measured "
                        "sample alone vs in its batch, fails): not recorded",
    "MODEL-PERMUTATION": "a must-change clause (a change no larger than the rounding threshold, or 8x the noise "
                         "measured sample alone vs in its batch, fails): not recorded",
    "MODEL-SHIFT": "its absolute-positions half is a must-change clause (outputs at two neighbouring offsets that "
                   "differ by no more than the rounding threshold fail): not recorded; its relative half has a script",
    "MODEL-HISTORY": "the same input before and after a drawn history of other calls (long inputs, other batches, "
                     "cached decoding) on a fresh instance: not recorded",
    "MODEL-ROUTING": "the router's logits and chosen experts read through Subject.routing, against a float64 top-k: "
                     "not recorded",
}


def unsupported(clause_id: str) -> str:
    """The precise reason a clause of the model or module levels has no script ('' when the kind is unknown)."""
    if clause_id in _WHY_NOT:
        return _WHY_NOT[clause_id]
    prefix = clause_id.split("-", 1)[0]
    if prefix in ("MHA", "FFN", "NORM", "POS", "LAYER"):
        return ("a module clause whose check (a relation between calls of the part, a statistic of its output, a "
                "gradient, or a layer of a whole model) records nothing yet; only the float64-oracle comparisons "
                "of one call of a part (MHA-ORACLE, MHA-SINGLE-HEAD, MHA-GQA, FFN-FORMULA, POS-SINUSOID-FORMULA, "
                "NORM-STANDARDIZE) have scripts")
    if prefix == "MODEL":
        return "this model clause's check (not two forward passes, not cached decoding) records nothing yet"
    return ""
