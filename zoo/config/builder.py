"""From config to model: the one path that tests, the CLI and the property suite all use."""
from __future__ import annotations

from typing import Sequence

from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException, MissingConfigException
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch import nn

from zoo.config.schema import PARTS, ConfigError, torch_dtype, validate

__all__ = ["compose_config", "model_from_config", "build_model"]


def compose_config(overrides: Sequence[str] = ()) -> DictConfig:
    """Compose the packaged config tree with Hydra overrides, then validate it."""
    try:
        if GlobalHydra.instance().is_initialized():  # inside a running Hydra app
            cfg = compose("config", overrides=list(overrides))
        else:
            with initialize_config_module("zoo.conf", version_base="1.3"):
                cfg = compose("config", overrides=list(overrides))
    except HydraException as exc:
        raise ConfigError(explain_composition_error(exc)) from exc
    validate(cfg)
    return cfg


def explain_composition_error(exc: HydraException) -> str:
    """Hydra's several-line composition errors, said in one line: key, value, what is allowed."""
    if isinstance(exc, MissingConfigException) and exc.options:
        group = (exc.missing_cfg_file or "").split("/")[0]
        choice = (exc.missing_cfg_file or "").split("/", 1)[-1]
        return f"{group}={choice}: no such option (allowed: {', '.join(sorted(exc.options))})"
    cause = exc.__cause__
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    override = next((line.split("'")[1] for line in lines if line.startswith("Could not override '")), None)
    if override is not None:
        return f"{override}: unknown key (add a new key with +{override}=VALUE only if the part accepts it)"
    if lines and lines[0].startswith("Error merging override ") and cause is not None:
        reason = str(cause).splitlines()[0]
        if "could not be converted to" in reason:
            reason = "expected " + reason.rsplit("converted to ", 1)[1].lower()
        return f"{lines[0].removeprefix('Error merging override ')}: {reason}"
    return f"{lines[0] if lines else type(exc).__name__} (an override is key=value or group=option)"


def model_from_config(cfg: DictConfig, *, device=None, dtype=None) -> nn.Module:
    """Instantiate the parts as factories and hand them to the model's constructor."""
    parts = {name: instantiate(cfg[name]) for name in PARTS}
    device = cfg.device if device is None else device
    dtype = torch_dtype(cfg.dtype) if dtype is None else dtype
    return instantiate(cfg.model, **parts, device=device, dtype=dtype)


def build_model(overrides: Sequence[str] = (), *, device=None, dtype=None) -> nn.Module:
    """``build_model(["model=decoder_only", "pos=rotary"])``: compose, validate, instantiate."""
    return model_from_config(compose_config(overrides), device=device, dtype=dtype)
