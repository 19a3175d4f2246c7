"""Training checkpoints: everything needed to continue a run exactly as if it had never stopped.

One checkpoint is one directory ``<out_dir>/step-NNNNNNN/`` holding

    model.safetensors        the weights (zoo.io.weights.save_checkpoint: tied weights stored once)
    train_state.safetensors  optimizer tensors under ``optimizer.<param>.<name>``, RNG states under ``rng.``
    state.json               step, config, optimizer hyper-parameters, metrics, and the sha256 of both files
    manifest.json            size and sha256 of each of the three files above, and a sha256 of itself

It is written into a hidden temporary directory and renamed into place in one step, so a reader sees a
whole checkpoint or none; an existing checkpoint is never overwritten. Every file is checked against the
manifest before anything is read, so a damaged, truncated or edited file (an edited step or learning rate in
state.json too) is a clear error instead of silently different weights or a different run.

A checkpoint is data, never code: ``check_config`` refuses a saved config that names anything but the zoo's
own classes and kernels (a ``_target_``, ``attention.kernel``), unless ``allow_plugins=true`` was given on
the command line. The checksums catch accidents, not an adversary who rewrites the manifest too; that
refusal is what keeps a shared checkpoint from running code.

This module writes checkpoints and restores a run from one; finding them, verifying them and reading state.json
and the saved config are zoo/io/checkpoint_read.py's (``read_state``, ``checkpoints_in``, ``check_config``, ...).
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import tempfile
import threading
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from zoo.io.weights import StateDictMismatch, load_state_dict_checked, save_checkpoint, state_from_bytes
from zoo.io.checkpoint_read import (FORMAT, MANIFEST, MANIFEST_FILES, TENSOR_FILES, CheckpointError, checkpoints_in,
                                    file_sha256, manifest_of, read_state)

__all__ = ["save_training_checkpoint", "load_weights", "load_training_state"]


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
    tmp = None
    try:
        with _signals_held():  # a Ctrl-C cannot fall between making the directory and naming it for removal
            tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=out_dir))
        _chmod_like_umask(tmp, 0o777)  # mkdtemp makes it private; a checkpoint is an ordinary directory
        save_checkpoint(model, tmp / "model.safetensors")
        save_checkpoint(tensors, tmp / "train_state.safetensors")
        state = {"format": FORMAT, "step": step, "config": config, "metrics": metrics or {},
                 "optimizer": {"param_groups": optimizer_state["param_groups"], "scalars": scalars},
                 "files": {name: file_sha256(tmp / name) for name in TENSOR_FILES}}
        _write_synced(tmp / "state.json", json.dumps(state, indent=1))
        _write_synced(tmp / MANIFEST, json.dumps(manifest_of(tmp), indent=1))
        for name in (*MANIFEST_FILES, MANIFEST):
            _chmod_like_umask(tmp / name, 0o666)
        os.rename(tmp, final)  # a directory rename is atomic; it fails rather than replace a checkpoint
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(out_dir)
    if keep is not None:
        _prune(out_dir, keep)
    return final


_DELETING = ".deleting"


def _prune(out_dir: Path, keep: int) -> None:
    """Delete all but the newest ``keep`` checkpoints, and what an earlier run killed while deleting left.
    Each is renamed out of sight first, so that no reader ever finds half a checkpoint; a Ctrl-C or SIGTERM
    that arrives meanwhile takes effect once the deletion is done (it would otherwise leave the hidden
    remains of a checkpoint on disk)."""
    with _signals_held():
        for old in checkpoints_in(out_dir)[:-keep]:
            try:
                os.rename(old, old.with_name(f".{old.name}{_DELETING}"))
            except OSError:
                continue
        for hidden in out_dir.glob(f".step-*{_DELETING}"):
            shutil.rmtree(hidden, ignore_errors=True)


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Hold SIGINT and SIGTERM until the block ends, then deliver them to the handlers that were in place.
    Only the main thread can change handlers; elsewhere the block runs unprotected."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived: list[int] = []
    previous = {}
    try:  # installed inside the try: a signal between the two installations still finds its handler restored
        for number in (signal.SIGINT, signal.SIGTERM):
            previous[number] = signal.signal(number, lambda number, frame: arrived.append(number))
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, signal.SIG_DFL if handler is None else handler)  # None: set outside Python
        for number in dict.fromkeys(arrived):
            signal.raise_signal(number)


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _one_line(error: StateDictMismatch) -> str:
    return "; ".join(line.strip() for line in str(error).splitlines())


def _verified(checkpoint: Path, state: dict | None) -> dict[str, bytes]:
    """The checkpoint's files as read_state read and checked them (read and checked now when ``state`` is not
    read_state's)."""
    files = getattr(state, "files", None)
    return files if files is not None else read_state(checkpoint).files


def load_weights(model: nn.Module, checkpoint: str | os.PathLike, state: dict | None = None) -> nn.Module:
    """Load model.safetensors of a checkpoint from the very bytes whose checksum read_state verified (``state``,
    read_state's result; without it the checkpoint is read and verified here)."""
    path = Path(checkpoint) / "model.safetensors"
    try:
        data = _verified(Path(checkpoint), state)["model.safetensors"]
        return load_state_dict_checked(model, state_from_bytes(data, f"checkpoint {str(path)!r}"), source=str(path))
    except CheckpointError:
        raise
    except StateDictMismatch as exc:
        raise CheckpointError(_one_line(exc)) from exc
    except Exception as exc:
        raise CheckpointError(f"{path} cannot be read: {type(exc).__name__}: {exc}") from exc


def load_training_state(checkpoint: str | os.PathLike, state: dict, model: nn.Module,
                        optimizer: torch.optim.Optimizer) -> int:
    """Restore weights, optimizer and RNG states; return the step to continue from."""
    checkpoint = Path(checkpoint)
    load_weights(model, checkpoint, state)
    path = checkpoint / "train_state.safetensors"
    try:
        tensors = state_from_bytes(_verified(checkpoint, state)["train_state.safetensors"], f"checkpoint {str(path)!r}")
    except Exception as exc:
        raise CheckpointError(f"{path} cannot be read: {type(exc).__name__}: {exc}") from exc
    saved = state["optimizer"]
    per_param: dict[int, dict] = {}
    for key, value in tensors.items():
        if key.startswith("optimizer."):
            _, index, name = (key.split(".", 2) + ["", ""])[:3]
            if not index.isdigit() or not name:
                raise CheckpointError(f"{path} is damaged: unexpected entry {key!r}")
            per_param.setdefault(int(index), {})[name] = value
        elif not key.startswith("rng."):
            raise CheckpointError(f"{path} is damaged: unexpected entry {key!r}")
    for key, value in saved.get("scalars", {}).items():
        index, name = key.split(".", 1)
        per_param.setdefault(int(index), {})[name] = value
    groups = [dict(g, betas=tuple(g["betas"])) if "betas" in g else g for g in saved["param_groups"]]
    own = optimizer.state_dict()["param_groups"]
    if [len(g["params"]) for g in groups] != [len(g["params"]) for g in own]:
        raise CheckpointError(f"{checkpoint}: optimizer state is for {[len(g['params']) for g in groups]} "
                              f"parameters per group, the model has {[len(g['params']) for g in own]}")
    for i, (group, mine) in enumerate(zip(groups, own)):
        missing = sorted(set(mine) - set(group))
        extra = sorted(set(group) - set(mine))
        if missing or extra:
            raise CheckpointError(f"{checkpoint}/state.json: optimizer.param_groups[{i}] "
                                  + (f"lacks {', '.join(missing)}" if missing else f"has unknown {', '.join(extra)}"))
        for key, value in group.items():
            if key != "params" and mine[key] is not None and value is not None \
                    and type(value) is not type(mine[key]) and not (
                    isinstance(mine[key], (int, float)) and isinstance(value, (int, float))
                    and not isinstance(value, bool) and not isinstance(mine[key], bool)):
                raise CheckpointError(f"{checkpoint}/state.json: optimizer.param_groups[{i}].{key}={value!r}: "
                                      f"expected a {type(mine[key]).__name__}")
    shapes = {i: p.shape for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    for index, values in per_param.items():
        if index not in shapes:
            raise CheckpointError(f"{path}: optimizer state for parameter {index}, the model has {len(shapes)}")
        for name, value in values.items():
            if name in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") and tuple(value.shape) != tuple(shapes[index]):
                raise CheckpointError(f"{path}: optimizer.{index}.{name} has shape {list(value.shape)}, its "
                                      f"parameter {list(shapes[index])}")
    try:
        optimizer.load_state_dict({"state": per_param, "param_groups": groups})
    except (ValueError, KeyError, RuntimeError, TypeError) as exc:
        raise CheckpointError(f"{checkpoint}: optimizer state does not fit: {exc}") from exc
    if "rng.cpu" not in tensors:
        raise CheckpointError(f"{path} is damaged: no RNG state")
    try:
        _set_rng_states(tensors, next(model.parameters()).device)
    except (RuntimeError, TypeError, ValueError, AttributeError) as exc:
        raise CheckpointError(f"{path}: the RNG state cannot be restored: {type(exc).__name__}: "
                              f"{str(exc).splitlines()[0]}") from exc
    return int(state["step"])
