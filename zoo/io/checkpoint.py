"""Training checkpoints: everything needed to continue a run exactly as if it had never stopped.

One checkpoint is one directory ``<out_dir>/step-NNNNNNN/`` holding

    model.safetensors        the weights (zoo.interop.save_checkpoint: tied weights stored once)
    train_state.safetensors  optimizer tensors under ``optimizer.<param>.<name>``, RNG states under ``rng.``
    state.json               step, config, optimizer hyper-parameters, metrics, and the sha256 of both files

It is written into a hidden temporary directory and renamed into place in one step, so a reader sees a
whole checkpoint or none; an existing checkpoint is never overwritten. The checksums turn a damaged
file into a clear error instead of silently different weights.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zoo.interop import StateDictMismatch, load_state_dict_checked, read_checkpoint, save_checkpoint

__all__ = ["CheckpointError", "FORMAT", "save_training_checkpoint", "checkpoints_in", "latest_checkpoint",
           "resolve_checkpoint", "read_state", "load_weights", "load_training_state"]

FORMAT = "zoo-train-checkpoint/1"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_FILES = ("model.safetensors", "train_state.safetensors")


class CheckpointError(ValueError):
    """A checkpoint that is missing, damaged or made for another model; str() is one line."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    try:  # make the rename itself durable; not every platform can open a directory
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _chmod_like_umask(path: Path, mode: int) -> None:
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, mode & ~umask)


def _rng_states(device: torch.device) -> dict[str, torch.Tensor]:
    states = {"rng.cpu": torch.get_rng_state()}
    if device.type not in ("cpu", "meta"):
        module = getattr(torch, device.type, None)  # torch.cuda, torch.xpu, torch.mps ...
        if module is not None and hasattr(module, "get_rng_state_all"):
            states.update({f"rng.{device.type}.{i}": s for i, s in enumerate(module.get_rng_state_all())})
    return states


def _set_rng_states(tensors: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(tensors["rng.cpu"])
    prefix = f"rng.{device.type}."
    device_states = [tensors[k] for k in sorted((k for k in tensors if k.startswith(prefix)),
                                                key=lambda k: int(k.rsplit(".", 1)[1]))]
    if device_states:
        getattr(torch, device.type).set_rng_state_all(device_states)


def save_training_checkpoint(out_dir: str | os.PathLike, step: int, model: nn.Module,
                             optimizer: torch.optim.Optimizer, config: dict, metrics: dict | None = None,
                             keep: int | None = None) -> Path:
    """Write ``out_dir/step-NNNNNNN`` atomically; then delete all but the newest ``keep`` checkpoints."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    final = out_dir / f"step-{step:07d}"
    if final.exists():
        raise CheckpointError(f"{final} already exists; refusing to overwrite it")
    device = next(model.parameters()).device
    optimizer_state = optimizer.state_dict()
    tensors, scalars = {}, {}
    for index, values in optimizer_state["state"].items():
        for name, value in values.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optimizer.{index}.{name}"] = value
            else:
                scalars[f"{index}.{name}"] = value
    tensors.update(_rng_states(device))
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=out_dir))
    try:
        _chmod_like_umask(tmp, 0o777)  # mkdtemp makes it private; a checkpoint is an ordinary directory
        save_checkpoint(model, tmp / "model.safetensors")
        save_checkpoint(tensors, tmp / "train_state.safetensors")
        state = {"format": FORMAT, "step": step, "config": config, "metrics": metrics or {},
                 "optimizer": {"param_groups": optimizer_state["param_groups"], "scalars": scalars},
                 "files": {name: _sha256(tmp / name) for name in _FILES}}
        with open(tmp / "state.json", "w") as f:
            json.dump(state, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        for name in (*_FILES, "state.json"):
            _chmod_like_umask(tmp / name, 0o666)
        os.rename(tmp, final)  # a directory rename is atomic; it fails rather than replace a checkpoint
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(out_dir)
    if keep is not None:
        for old in checkpoints_in(out_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def checkpoints_in(out_dir: str | os.PathLike) -> list[Path]:
    """The checkpoint directories in out_dir, oldest first (temporary directories are hidden and skipped)."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in out_dir.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(out_dir: str | os.PathLike) -> Path | None:
    found = checkpoints_in(out_dir)
    return found[-1] if found else None


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A step directory as given, or the newest one inside a run's out_dir."""
    path = Path(path)
    if (path / "state.json").is_file():
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        raise CheckpointError(f"{path}: no checkpoint there (expected a step-NNNNNNN directory or a train "
                              f"out_dir that holds one)")
    return latest


def read_state(checkpoint: str | os.PathLike) -> dict[str, Any]:
    """state.json of a checkpoint, after checking its format and the checksums of its files."""
    checkpoint = Path(checkpoint)
    try:
        with open(checkpoint / "state.json") as f:
            state = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{checkpoint}: state.json is missing; not a complete checkpoint") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{checkpoint}/state.json is damaged: {exc}") from exc
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{checkpoint}/state.json: not a {FORMAT} file")
    for key in ("step", "config", "optimizer", "files"):
        if key not in state:
            raise CheckpointError(f"{checkpoint}/state.json is damaged: no {key!r} entry")
    for name in _FILES:
        path = checkpoint / name
        if not path.is_file():
            raise CheckpointError(f"{path} is missing")
        if _sha256(path) != state["files"].get(name):
            raise CheckpointError(f"{path} is damaged: its sha256 differs from the one state.json recorded")
    return state


def _one_line(error: StateDictMismatch) -> str:
    return "; ".join(line.strip() for line in str(error).splitlines())


def load_weights(model: nn.Module, checkpoint: str | os.PathLike) -> nn.Module:
    """Load model.safetensors of a checkpoint (checksum verified by read_state first)."""
    path = Path(checkpoint) / "model.safetensors"
    try:
        return load_state_dict_checked(model, read_checkpoint(path), source=str(path))
    except StateDictMismatch as exc:
        raise CheckpointError(_one_line(exc)) from exc
    except Exception as exc:
        raise CheckpointError(f"{path} cannot be read: {type(exc).__name__}: {exc}") from exc


def load_training_state(checkpoint: str | os.PathLike, state: dict, model: nn.Module,
                        optimizer: torch.optim.Optimizer) -> int:
    """Restore weights, optimizer and RNG states; return the step to continue from."""
    checkpoint = Path(checkpoint)
    load_weights(model, checkpoint)
    path = checkpoint / "train_state.safetensors"
    try:
        tensors = read_checkpoint(path)
    except Exception as exc:
        raise CheckpointError(f"{path} cannot be read: {type(exc).__name__}: {exc}") from exc
    saved = state["optimizer"]
    per_param: dict[int, dict] = {}
    for key, value in tensors.items():
        if key.startswith("optimizer."):
            _, index, name = key.split(".", 2)
            per_param.setdefault(int(index), {})[name] = value
    for key, value in saved.get("scalars", {}).items():
        index, name = key.split(".", 1)
        per_param.setdefault(int(index), {})[name] = value
    groups = [dict(g, betas=tuple(g["betas"])) if "betas" in g else g for g in saved["param_groups"]]
    own = optimizer.state_dict()["param_groups"]
    if [len(g["params"]) for g in groups] != [len(g["params"]) for g in own]:
        raise CheckpointError(f"{checkpoint}: optimizer state is for {[len(g['params']) for g in groups]} "
                              f"parameters per group, the model has {[len(g['params']) for g in own]}")
    try:
        optimizer.load_state_dict({"state": per_param, "param_groups": groups})
    except (ValueError, KeyError, RuntimeError) as exc:
        raise CheckpointError(f"{checkpoint}: optimizer state does not fit: {exc}") from exc
    if "rng.cpu" not in tensors:
        raise CheckpointError(f"{path} is damaged: no RNG state")
    _set_rng_states(tensors, next(model.parameters()).device)
    return int(state["step"])
