"""transformer-zoo: Transformer parts written with einops, assembled by Hydra configs.

    zoo.nn        the parts and the three model families (kernel, attention, ffn, norm, positional, ...)
    zoo.config    option lists, schema and checks, the builder from config to model, plug-in loading
    zoo.tasks     what `python -m zoo task=NAME` runs (summary, train, generate, verify, compare)
    zoo.io        atomic writes, weight files, training checkpoints
    zoo.interop   weights from and to Hugging Face GPT-2 / BERT and torch.nn.Transformer

``from zoo import build_model`` is the one call most users need.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

__all__ = ["build_model", "compose_config", "model_from_config"]

# Modules that lived in the zoo root before the split by concern: old import paths (in users' scripts and in
# the `_target_` strings of saved configs) still resolve, to the very same module objects.
_MOVED = {
    "kernel": "zoo.nn.kernel", "attention": "zoo.nn.attention", "ffn": "zoo.nn.ffn", "norm": "zoo.nn.norm",
    "positional": "zoo.nn.positional", "embedding": "zoo.nn.embedding", "layers": "zoo.nn.blocks",
    "models": "zoo.nn.models", "schema": "zoo.config.schema", "build": "zoo.config.builder",
    "plugins": "zoo.config.plugins", "summary": "zoo.tasks.summary", "train": "zoo.tasks.train",
    "generate": "zoo.tasks.generate", "verify": "zoo.tasks.verify", "data": "zoo.tasks.data",
    "plots": "zoo.tasks.plots", "compare": "zoo.tasks.compare", "checkpoint": "zoo.io.checkpoint",
    "atomic": "zoo.io.atomic",
}


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """`import zoo.attention` gives `zoo.nn.attention` itself (not a copy), so isinstance checks hold."""

    def find_spec(self, fullname, path=None, target=None):
        package, _, name = fullname.rpartition(".")
        if package == __name__ and name in _MOVED:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        module = importlib.import_module(_MOVED[spec.name.rpartition(".")[2]])
        self.own_spec = module.__spec__  # importlib is about to overwrite it with the alias' spec
        return module

    def exec_module(self, module):  # already executed under its new name
        module.__spec__ = self.own_spec


sys.meta_path.append(_MovedModuleFinder())


def __getattr__(name: str):
    if name in ("build_model", "compose_config", "model_from_config"):
        return getattr(importlib.import_module("zoo.config.builder"), name)
    if name in _MOVED:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'zoo' has no attribute {name!r}")
