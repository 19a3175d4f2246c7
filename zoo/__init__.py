"""transformer-zoo: Transformer parts written with einops, assembled by Hydra configs.

    zoo.runtime.plugins   loading user plug-ins by import path (used by zoo.nn, zoo.config and the suite)
    zoo.nn        the parts and the three model families (kernel, attention, caches, ffn, norm, positional, ...)
    zoo.config    option lists, schema and checks, the builder from config to model
    zoo.tasks     what `python -m zoo task=NAME` runs (summary, train, generate, verify, compare)
    zoo.io        atomic writes, weight files, training checkpoints
    zoo.interop   weights from and to Hugging Face GPT-2 / BERT and torch.nn.Transformer

``from zoo import build_model`` is the one call most users need.
"""
from __future__ import annotations

import importlib

__all__ = ["build_model", "compose_config", "model_from_config"]


def __getattr__(name: str):
    if name in ("build_model", "model_from_config"):
        return getattr(importlib.import_module("zoo.config.builder"), name)
    if name == "compose_config":
        return importlib.import_module("zoo.config.composition").compose_config
    raise AttributeError(f"module 'zoo' has no attribute {name!r}")
