'''The reproducers of the model clauses (properties/plugin/repro.py writes them): a header that builds the model as the
run built it — the --model factory, or the zoo model from the same composed config (--zoo, --zoo-config) or the same
overrides (the zoo's own families), torch's generator seeded as the suite seeds every build — then one body per kind
of comparison (properties/plugin/repro_model_bodies.py): ``model`` (two forward passes within the clause's tolerance,
or bitwise under given seeds), ``model-decode`` (cached decoding against the full pass), ``model-batched-decode``
(a left-padded batch against each sample alone), ``model-factorisation``, ``model-causal-gradient`` (the exact zero
through a probe on the embedding), ``model-shift`` and ``model-diff`` (against the --reference model).'''
from __future__ import annotations

import textwrap

from properties.core import repro
from properties.plugin.repro_model_bodies import BODIES

__all__ = ["KINDS", "LOAD", "VERDICT", "prepare", "render", "unsupported"]

# The scripts' plug-in loader, the same text in kernel and model scripts (the suite's own: zoo/plugins.py).
LOAD = '''\
def load(spec):
    """'pkg.module:name', 'path/to/file.py:name', or (a kernel) one of the zoo's kernel names."""
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
'''

# The scripts' verdict, formatted with the clause's id.
VERDICT = '''\
def verdict(bad, message):
    """Print the departure in the clause's words and exit 1, or say it is gone and exit 0."""
    if bool(bad):
        print(f"FAIL {clause}: {{message}}")
        sys.exit(1)
    print(f"OK {clause}: no departure on this counterexample")
    sys.exit(0)
'''

_HEADER = '''\
#!/usr/bin/env python3
"""Reproducer of {clause} ({title}), written by the spec suite's --repro-dir.

Clause: {statement}
Failing test: {nodeid}
Counterexample: {counterexample}
Model: {origin}

    python {stem}.py [MODEL]

MODEL: the model to check instead of the one that failed, in the form the run took it:
{argument}. Exits 1 while the departure is there, 0 once it is gone. Needs torch and the model's module only (a zoo model: the zoo); the
inputs are in {data_file} beside this file.
"""
import importlib
import importlib.util
import math
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
DATA = torch.load(pathlib.Path(__file__).with_name({data_file!r}), weights_only=True)
FACTORY_SEED = 0   # the suite builds every model with torch's generator seeded so: the same weights here


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
        return build_model(words, device=DEVICE, dtype=dtype)
    from omegaconf import OmegaConf
    return model_from_config(OmegaConf.create(CONFIG), device=DEVICE, dtype=dtype)


def zoo_decode_step(model):
    """A zoo model's cached decoding: one chunk of tokens per call, the KV cache carried in the state."""
    from zoo.nn.cache import KVCache
    if hasattr(model, "encode"):   # encoder-decoder: the memory is encoded once
        def step(src, tgt, src_mask, tgt_mask, state):
            state = (model.encode(src, src_mask), KVCache()) if state is None else state
            return model.decode(tgt, state[0], src_mask, tgt_mask, cache=state[1]), state
        return step

    def step(tokens, mask, state):
        cache = KVCache() if state is None else state
        return model(tokens, mask, cache=cache), cache
    return step


def parts(built):
    """(module, forward, decode_step): a zoo model's forward is the model, in eval mode; a Subject's are its fields."""
    if isinstance(built, torch.nn.Module):
        return built.eval(), built, zoo_decode_step(built)
    return built.module, built.forward, built.decode_step


built = built_model()
module, forward, decode_step = parts(built)
if DATA["float64"]:   # the clause compared the model's float64 twin (module.to(float64))
    module.to(torch.float64)


def on_device(x):
    return x.to(DEVICE) if torch.is_tensor(x) else x


{verdict}'''
KINDS = frozenset(BODIES)


def prepare(evidence: dict, nodeid: str) -> str:
    """Name the model the failing test ran on (its recipe, put in the evidence): '' or why no script can build it."""
    recipe = repro.model_recipe(nodeid)
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
    header = _HEADER.format(load=LOAD, verdict=VERDICT.format(clause=clause.id),
                            clause=clause.id, title=clause.title, nodeid=nodeid, stem=data_file.removesuffix(".pt"),
                            statement=textwrap.fill(clause.statement, 110, subsequent_indent="    "),
                            counterexample=counterexample or "(see the test's report)", origin=origin,
                            argument=argument, data_file=data_file, factory=recipe.get("factory"),
                            overrides=recipe.get("overrides", []), dtype=recipe.get("dtype"),
                            config=_literal(recipe.get("config")),
                            device=evidence.get("device", "cpu"), what=evidence.get("what", "out"),
                            reference=evidence.get("reference", "the first forward pass"))
    return header + BODIES[evidence["kind"]].format()


def _literal(text: str | None) -> str:
    """A YAML text as a readable triple-quoted Python literal (its repr where that would change it)."""
    if text is None or "\\" in text or '"""' in text:
        return repr(text)
    return '"""\\\n' + text + '"""'


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
        return ("a module clause: its checks (float64 oracles carrying error bounds, properties/module/approx.py, "
                "or relations between calls of a part the suite redraws per example) record nothing yet")
    if prefix == "MODEL":
        return "this model clause's check (not two forward passes, not cached decoding) records nothing yet"
    return ""
