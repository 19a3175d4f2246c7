"""Training checkpoints: everything needed to continue a run exactly as if it had never stopped.

One checkpoint is one directory ``<out_dir>/step-NNNNNNN/`` holding

    model.safetensors        the weights (zoo.interop.save_checkpoint: tied weights stored once)
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
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import shutil
import signal
import tempfile
import threading
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from zoo.interop import StateDictMismatch, load_state_dict_checked, read_checkpoint, save_checkpoint

__all__ = ["CheckpointError", "FORMAT", "MANIFEST", "save_training_checkpoint", "checkpoints_in", "latest_checkpoint",
           "resolve_checkpoint", "read_state", "check_config", "load_weights", "load_training_state"]

FORMAT = "zoo-train-checkpoint/2"   # /2: manifest.json covers every file, state.json included
MANIFEST = "manifest.json"
_MANIFEST_FORMAT = "zoo-checkpoint-manifest/1"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_FILES = ("model.safetensors", "train_state.safetensors")
_COVERED = (*_FILES, "state.json")


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
    with _signals_held():  # so that a Ctrl-C cannot fall between making the directory and the try that removes it
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=out_dir))
    try:
        _chmod_like_umask(tmp, 0o777)  # mkdtemp makes it private; a checkpoint is an ordinary directory
        save_checkpoint(model, tmp / "model.safetensors")
        save_checkpoint(tensors, tmp / "train_state.safetensors")
        state = {"format": FORMAT, "step": step, "config": config, "metrics": metrics or {},
                 "optimizer": {"param_groups": optimizer_state["param_groups"], "scalars": scalars},
                 "files": {name: _sha256(tmp / name) for name in _FILES}}
        _write_synced(tmp / "state.json", json.dumps(state, indent=1))
        _write_synced(tmp / MANIFEST, json.dumps(_manifest(tmp), indent=1))
        for name in (*_COVERED, MANIFEST):
            _chmod_like_umask(tmp / name, 0o666)
        os.rename(tmp, final)  # a directory rename is atomic; it fails rather than replace a checkpoint
    except BaseException:
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
    held = (signal.SIGINT, signal.SIGTERM)
    previous = {number: signal.signal(number, lambda number, frame: arrived.append(number)) for number in held}
    try:
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


def _manifest_digest(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _manifest(directory: Path) -> dict:
    body = {"format": _MANIFEST_FORMAT,
            "files": {name: {"bytes": (directory / name).stat().st_size, "sha256": _sha256(directory / name)}
                      for name in _COVERED}}
    return {**body, "sha256": _manifest_digest(body)}


def _verify_files(checkpoint: Path) -> None:
    """Every file of the checkpoint against manifest.json (which checks itself first)."""
    path = checkpoint / MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        if (checkpoint / "state.json").is_file():
            raise CheckpointError(f"{path} is missing: the checkpoint's files cannot be verified (a checkpoint of "
                                  f"an older zoo, or a damaged one)") from None
        raise CheckpointError(f"{checkpoint}: state.json is missing; not a complete checkpoint") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is damaged or unreadable: {type(exc).__name__}: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != _MANIFEST_FORMAT \
            or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{path}: not a {_MANIFEST_FORMAT} file")
    body = {k: v for k, v in manifest.items() if k != "sha256"}
    if manifest.get("sha256") != _manifest_digest(body):
        raise CheckpointError(f"{path} is damaged: its own sha256 does not match its contents")
    for name in _COVERED:
        entry = manifest["files"].get(name)
        if not isinstance(entry, dict):
            raise CheckpointError(f"{path}: no checksum for {name}")
        file = checkpoint / name
        try:
            size = file.stat().st_size
        except FileNotFoundError:
            raise CheckpointError(f"{file} is missing") from None
        except OSError as exc:
            raise CheckpointError(f"{file} cannot be read: {exc.strerror}") from None
        if size != entry.get("bytes"):
            what = "truncated to" if isinstance(entry.get("bytes"), int) and size < entry["bytes"] else "now"
            raise CheckpointError(f"{file} is damaged: {what} {size:,} bytes, {entry.get('bytes')!r} recorded at "
                                  f"save time")
        try:
            digest = _sha256(file)
        except OSError as exc:
            raise CheckpointError(f"{file} cannot be read: {exc.strerror}") from None
        if digest != entry.get("sha256"):
            raise CheckpointError(f"{file} is damaged: its sha256 differs from the one recorded at save time "
                                  f"(an edited or corrupted file)")


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
    """state.json of a checkpoint, after checking every file against the manifest and every entry's type.

    Nothing the file names is imported or called here; ``check_config`` judges the saved config."""
    checkpoint = Path(checkpoint)
    if not checkpoint.is_dir():
        raise CheckpointError(f"{checkpoint}: not a checkpoint directory")
    _verify_files(checkpoint)
    try:
        state = json.loads((checkpoint / "state.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{checkpoint}/state.json is damaged: {exc}") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        found = state.get("format") if isinstance(state, dict) else None
        raise CheckpointError(f"{checkpoint}/state.json: not a {FORMAT} file" + (f" ({found})" if found else ""))
    _check_state(state, f"{checkpoint}/state.json", checkpoint)
    return state


def _check_state(state: dict, where: str, checkpoint: Path) -> None:
    """The entries the zoo reads, each of the type it wrote: one line naming the first that is not."""
    for key, kind in (("step", int), ("config", dict), ("optimizer", dict), ("files", dict)):
        if key not in state:
            raise CheckpointError(f"{where} is damaged: no {key!r} entry")
        if not isinstance(state[key], kind) or isinstance(state[key], bool):
            raise CheckpointError(f"{where}: {key}={state[key]!r} is not a{'n integer' if kind is int else ' mapping'}")
    if state["step"] < 0:
        raise CheckpointError(f"{where}: step={state['step']} is negative")
    match = _STEP_DIR.match(checkpoint.name)
    if match and int(match.group(1)) != state["step"]:
        raise CheckpointError(f"{where}: step={state['step']} but the directory is {checkpoint.name}")
    if "metrics" in state and not isinstance(state["metrics"], dict):
        raise CheckpointError(f"{where}: metrics is not a mapping")
    optimizer = state["optimizer"]
    groups = optimizer.get("param_groups")
    if not isinstance(groups, list) or not groups or not all(isinstance(g, dict) for g in groups):
        raise CheckpointError(f"{where}: optimizer.param_groups={groups!r} is not a list of parameter groups")
    for i, group in enumerate(groups):
        params = group.get("params")
        if not isinstance(params, list) or not all(isinstance(p, int) and not isinstance(p, bool) for p in params):
            raise CheckpointError(f"{where}: optimizer.param_groups[{i}].params={params!r} is not a list of integers")
        for key, value in group.items():
            if key == "params":
                continue
            numbers = value if key == "betas" else [value]
            if key == "betas" and (not isinstance(value, list) or len(value) != 2):
                raise CheckpointError(f"{where}: optimizer.param_groups[{i}].betas={value!r} is not a pair")
            for number in numbers:
                if number is not None and not isinstance(number, (bool, int, float, str)):
                    raise CheckpointError(f"{where}: optimizer.param_groups[{i}].{key}={value!r} is not a setting")
                if isinstance(number, float) and not math.isfinite(number):
                    raise CheckpointError(f"{where}: optimizer.param_groups[{i}].{key}={value!r} is not finite")
    scalars = optimizer.get("scalars", {})
    if not isinstance(scalars, dict):
        raise CheckpointError(f"{where}: optimizer.scalars is not a mapping")
    for key, value in scalars.items():
        index, _, name = key.partition(".")
        if not index.isdigit() or not name or isinstance(value, bool) or not isinstance(value, (int, float)):
            raise CheckpointError(f"{where}: optimizer.scalars[{key!r}]={value!r} is not a per-parameter number")


# ------------------------------------------------------------------------------------ what a checkpoint may name

_PART_ROOTS = ("model", "attention", "ffn", "norm", "pos")


def check_config(config: Any, where: str, *, allow_plugins: bool = False, asked: dict | None = None) -> dict:
    """The saved config of a checkpoint, refused (one line naming the key) if it names code outside the zoo.

    Imports and calls nothing. A `_target_` may stand only at the root of a part node (model, attention, ffn,
    norm, pos) and must name one of the zoo's own classes; `attention.kernel` must be one of the zoo's kernels;
    no other Hydra instruction (`_args_`, `_recursive_`, ...) and no interpolation (`${...}`: the zoo saves
    configs resolved) may appear anywhere. A plug-in path passes only with allow_plugins=true (the command
    line's value; the file's own `allow_plugins` entry is dropped) or, when resuming, if the command line's
    config (`asked`) names the very same path at the same key. Returns the config without `allow_plugins`."""
    from zoo.config.schema import zoo_targets
    from zoo.nn.kernel import KERNELS

    if not isinstance(config, dict):
        raise CheckpointError(f"{where}: config is not a mapping")
    config = {k: v for k, v in config.items() if k != "allow_plugins"}
    targets = zoo_targets()

    def asked_for(path: tuple, value: Any) -> bool:
        node: Any = asked
        for key in path:
            if not isinstance(node, dict) or key not in node:
                return False
            node = node[key]
        return node == value

    def refuse_plugin(path: tuple, value: Any, what: str) -> None:
        if allow_plugins or asked_for(path, value):
            return
        raise CheckpointError(f"{where}: config key {'.'.join(map(str, path))}={value!r} names {what} outside the "
                              f"zoo's own; nothing was imported (to trust this checkpoint's plug-ins, pass "
                              f"allow_plugins=true on the command line)")

    def walk(node: Any, path: tuple) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                here = (*path, key)
                name = ".".join(map(str, here))
                if not isinstance(key, str):
                    raise CheckpointError(f"{where}: config key {name} is not a string")
                if key == "_target_":
                    if len(path) != 1 or path[0] not in _PART_ROOTS:
                        raise CheckpointError(f"{where}: config key {name}={value!r}: a _target_ outside the part "
                                              f"nodes ({', '.join(_PART_ROOTS)}); the zoo never saves one there")
                    if not isinstance(value, str):
                        raise CheckpointError(f"{where}: config key {name}={value!r} is not an import path")
                    if value not in targets:
                        refuse_plugin(here, value, "a class")
                elif key.startswith("_") and key.endswith("_") and not (key == "_partial_" and len(path) == 1):
                    raise CheckpointError(f"{where}: config key {name}: a Hydra instruction the zoo never saves")
                elif path == ("attention",) and key == "kernel" and isinstance(value, str) and value not in KERNELS:
                    refuse_plugin(here, value, "a kernel")
                walk(value, here)
        elif isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, (*path, i))
        elif isinstance(node, str) and "${" in node:
            raise CheckpointError(f"{where}: config key {'.'.join(map(str, path))}={node!r} is an interpolation; "
                                  f"the zoo saves configs resolved")

    walk(config, ())
    return config


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
