"""From config to model: the one path that tests, the CLI and the property suite all use."""
from __future__ import annotations

from typing import Sequence

import torch

from hydra.utils import instantiate
from omegaconf import DictConfig
from torch import nn

from zoo.config.composition import compose_config
from zoo.config.parts import instantiate_part
from zoo.config.options import PARTS
from zoo.config.schema import torch_dtype

__all__ = ["model_from_config", "build_model"]


def model_from_config(cfg: DictConfig, *, device=None, dtype=None) -> nn.Module:
    """Instantiate the parts as factories and hand them to the model's constructor.

    On the meta device every tensor the constructors make, even one they compute on the default device
    first (the sinusoidal table), is a meta tensor: the largest model costs no memory."""
    parts = {name: instantiate_part(cfg[name]) for name in PARTS}
    device = cfg.device if device is None else device
    dtype = torch_dtype(cfg.dtype) if dtype is None else dtype
    if torch.device(device).type == "meta":
        with torch.device("meta"):
            return instantiate(cfg.model, **parts, device=device, dtype=dtype)
    return instantiate(cfg.model, **parts, device=device, dtype=dtype)


def build_model(overrides: Sequence[str] = (), *, device=None, dtype=None) -> nn.Module:
    """``build_model(["model=decoder_only", "pos=rotary"])``: compose, validate, instantiate. Unless the
    overrides name a task, the config is composed with task=summary: building a model runs no task, so the
    default task's sizes (the card's sequence length) must not refuse a small model."""
    overrides = list(overrides)
    if not any(o.split("=", 1)[0].lstrip("+~") == "task" for o in overrides):
        overrides.insert(0, "task=summary")
    return model_from_config(compose_config(overrides), device=device, dtype=dtype)
