"""From config to model: the one path that tests, the CLI and the property suite all use."""
from __future__ import annotations

import os
import resource
from typing import Sequence

import torch

from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException, MissingConfigException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn

from zoo.config.schema import OFF_WHEN_NULL, PARTS, ConfigError, integral_overrides, torch_dtype, validate

__all__ = ["compose_config", "instantiate_part", "model_from_config", "build_model", "memory_needed", "available_memory", "check_fits",
           "ModelTooLarge"]


class ModelTooLarge(ConfigError):
    """A model that cannot fit in the memory of its device; str() is one line naming what it needs."""


def compose_config(overrides: Sequence[str] = ()) -> DictConfig:
    """Compose the packaged config tree with Hydra overrides, then validate it."""
    overrides = integral_overrides(list(overrides))
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


def instantiate_part(node: DictConfig):
    """The part's factory: ``instantiate(node)`` without the OFF_WHEN_NULL keys that are null."""
    unset = [key for key in OFF_WHEN_NULL if key in node and node[key] is None]
    if not unset:
        return instantiate(node)
    values = OmegaConf.to_container(node, resolve=True)
    return instantiate({key: value for key, value in values.items() if key not in unset})


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


def _gib(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"


def memory_needed(cfg: DictConfig, *, training: bool = False) -> tuple[int, int]:
    """(bytes, parameters) of the model cfg builds, counted on the meta device: weights and buffers, plus for
    training one gradient and two AdamW moments per weight. A lower bound: activations come on top."""
    model = model_from_config(cfg, device="meta")
    parameters = sum(p.numel() for p in model.parameters())
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return weights * (4 if training else 1) + buffers, parameters


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _status_bytes(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


def available_memory(device) -> tuple[int, str] | None:
    """(bytes free for new tensors, where that figure comes from) on a device, or None when unknown.

    CPU: the least of MemAvailable, the cgroup's limit minus its usage, and the address-space and data limits
    (ulimit -v, -d) minus what the process already maps. CUDA: torch.cuda.mem_get_info."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free, f"free on {device}"
    if device.type != "cpu":
        return None
    found: list[tuple[int, str]] = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append((int(line.split()[1]) * 1024, "MemAvailable"))
    except (OSError, ValueError):
        pass
    for limit_path, usage_path in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        limit, usage = _read_int(limit_path), _read_int(usage_path)
        if limit is not None and usage is not None and limit < 2**60:
            found.append((max(limit - usage, 0), "the cgroup's memory limit"))
    for name, field, what in (("RLIMIT_AS", "VmSize", "ulimit -v"), ("RLIMIT_DATA", "VmData", "ulimit -d")):
        soft, _ = resource.getrlimit(getattr(resource, name))
        used = _status_bytes(field)
        if soft != resource.RLIM_INFINITY and used is not None:
            found.append((max(soft - used, 0), f"the process limit ({what})"))
    return min(found) if found else None


def check_fits(cfg: DictConfig, *, device=None, training: bool = False) -> None:
    """Refuse, in one line naming the memory it needs, a model that cannot fit on its device, before a byte of
    it is allocated. ZOO_SKIP_MEMORY_CHECK=1 skips the check."""
    if os.environ.get("ZOO_SKIP_MEMORY_CHECK"):
        return
    device = torch.device(cfg.device if device is None else device)
    try:
        needed, parameters = memory_needed(cfg, training=training)
        free = available_memory(device)
    except Exception:  # a plug-in part that cannot be built on the meta device: the real build will tell
        return
    if free is None or needed <= free[0]:
        return
    what = "weights, gradients and AdamW moments" if training else "weights and buffers"
    raise ModelTooLarge(f"the model does not fit in memory: {parameters:,} parameters in {cfg.dtype} need at "
                        f"least {_gib(needed)} ({what}) on {device}, and {_gib(free[0])} is available "
                        f"({free[1]}); task=summary shows its card without allocating it")


def build_model(overrides: Sequence[str] = (), *, device=None, dtype=None) -> nn.Module:
    """``build_model(["model=decoder_only", "pos=rotary"])``: compose, validate, instantiate. Unless the
    overrides name a task, the config is composed with task=summary: building a model runs no task, so the
    default task's sizes (the card's sequence length) must not refuse a small model."""
    overrides = list(overrides)
    if not any(o.split("=", 1)[0].lstrip("+~") == "task" for o in overrides):
        overrides.insert(0, "task=summary")
    return model_from_config(compose_config(overrides), device=device, dtype=dtype)
