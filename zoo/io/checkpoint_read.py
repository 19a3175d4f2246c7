"""Training checkpoints read back safely: finding them, the manifest and checksums, state.json, and what a saved
config may name (the format is described in zoo/io/checkpoint.py, which writes them).

Every file is checked against the manifest before anything is read, so a damaged, truncated or edited file (an
edited step or learning rate in state.json too) is a clear error instead of silently different weights or a
different run. ``check_config`` refuses a saved config that names anything but the zoo's own classes and kernels
unless ``allow_plugins=true`` was given on the command line.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import stat
from pathlib import Path
from typing import Any

from zoo.io.bounded import InputTooLarge, loads_json, read_json

__all__ = ["CheckpointError", "VerifiedState", "FORMAT", "MANIFEST", "TENSOR_FILES", "MANIFEST_FILES", "file_sha256",
           "manifest_of", "checkpoints_in", "latest_checkpoint", "resolve_checkpoint", "read_state", "check_config"]

FORMAT = "zoo-train-checkpoint/2"   # /2: manifest.json covers every file, state.json included
MANIFEST = "manifest.json"
_MANIFEST_FORMAT = "zoo-checkpoint-manifest/1"
_STEP_DIR = re.compile(r"^step-(\d+)$")
TENSOR_FILES = ("model.safetensors", "train_state.safetensors")   # written by save_training_checkpoint
MANIFEST_FILES = (*TENSOR_FILES, "state.json")                    # what manifest.json covers


# What a checkpoint's JSON files may hold, checked before they are parsed: the zoo writes a manifest of about 400
# bytes listing 3 files, and a state.json of a few KiB plus one integer per parameter tensor (a 4,096-layer model:
# under 1 MiB). Nesting: at most zoo.io.bounded.MAX_DEPTH.
MAX_MANIFEST_BYTES = 64 << 10
MAX_MANIFEST_ENTRIES = 16
MAX_STATE_BYTES = 64 << 20


class CheckpointError(ValueError):
    """A checkpoint that is missing, damaged or made for another model; str() is one line."""


def _line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc).strip() else type(exc).__name__


def file_sha256(path: Path) -> str:
    """The sha256 of a file's bytes (hex), read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _manifest_digest(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def manifest_of(directory: Path) -> dict:
    """manifest.json's content for the checkpoint files in ``directory``: each one's size and sha256, sealed by a
    sha256 of the whole."""
    body = {"format": _MANIFEST_FORMAT,
            "files": {name: {"bytes": (directory / name).stat().st_size, "sha256": file_sha256(directory / name)}
                      for name in MANIFEST_FILES}}
    return {**body, "sha256": _manifest_digest(body)}


class VerifiedState(dict):
    """state.json of a checkpoint (a dict), with ``files``: the bytes of every file the manifest covers, as read once
    and checked against it. The weights are loaded from these bytes (zoo.io.checkpoint.load_weights), never read again:
    a file replaced after the check cannot slip in unchecked."""
    files: dict[str, bytes]


def _verify_files(checkpoint: Path) -> dict[str, bytes]:
    """Every file of the checkpoint against manifest.json (which checks itself first): each file's bytes, read once,
    the checksums computed on what was read."""
    path = checkpoint / MANIFEST
    try:
        manifest = read_json(path, max_bytes=MAX_MANIFEST_BYTES, what="manifest")
    except FileNotFoundError:
        if (checkpoint / "state.json").is_file():
            raise CheckpointError(f"{path} is missing: the checkpoint's files cannot be verified (a checkpoint of "
                                  f"an older zoo, or a damaged one)") from None
        raise CheckpointError(f"{checkpoint}: state.json is missing; not a complete checkpoint") from None
    except InputTooLarge as exc:
        raise CheckpointError(f"{exc} (not a manifest the zoo wrote)") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is damaged or unreadable: {type(exc).__name__}: {_line(exc)}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != _MANIFEST_FORMAT \
            or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{path}: not a {_MANIFEST_FORMAT} file")
    if len(manifest["files"]) > MAX_MANIFEST_ENTRIES:
        raise CheckpointError(f"{path}: {len(manifest['files']):,} entries, more than the {MAX_MANIFEST_ENTRIES} "
                              f"a checkpoint's manifest has (it lists {', '.join(MANIFEST_FILES)})")
    body = {k: v for k, v in manifest.items() if k != "sha256"}
    if manifest.get("sha256") != _manifest_digest(body):
        raise CheckpointError(f"{path} is damaged: its own sha256 does not match its contents")
    files: dict[str, bytes] = {}
    for name in MANIFEST_FILES:
        entry = manifest["files"].get(name)
        if not isinstance(entry, dict):
            raise CheckpointError(f"{path}: no checksum for {name}")
        file = checkpoint / name
        try:
            info = file.stat()
        except FileNotFoundError:
            raise CheckpointError(f"{file} is missing") from None
        except OSError as exc:
            raise CheckpointError(f"{file} cannot be read: {exc.strerror}") from None
        if not stat.S_ISREG(info.st_mode):  # a FIFO would block the checksum's read forever
            raise CheckpointError(f"{file}: not a regular file (a directory, FIFO or device)")
        size = info.st_size
        if size != entry.get("bytes"):
            what = "truncated to" if isinstance(entry.get("bytes"), int) and size < entry["bytes"] else "now"
            raise CheckpointError(f"{file} is damaged: {what} {size:,} bytes, {entry.get('bytes')!r} recorded at "
                                  f"save time")
        try:
            with open(file, "rb") as f:
                data = f.read(size + 1)   # one byte more: a file that grew since its stat shows as damaged
        except OSError as exc:
            raise CheckpointError(f"{file} cannot be read: {exc.strerror}") from None
        if len(data) != size:
            raise CheckpointError(f"{file} is damaged: it changed while it was read ({len(data):,} bytes read, "
                                  f"{size:,} expected)")
        if hashlib.sha256(data).hexdigest() != entry.get("sha256"):
            raise CheckpointError(f"{file} is damaged: its sha256 differs from the one recorded at save time "
                                  f"(an edited or corrupted file)")
        files[name] = data
    return files


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


def read_state(checkpoint: str | os.PathLike) -> VerifiedState:
    """state.json of a checkpoint, after checking every file against the manifest and every entry's type.

    Nothing the file names is imported or called here; ``check_config`` judges the saved config."""
    checkpoint = Path(checkpoint)
    if not checkpoint.is_dir():
        raise CheckpointError(f"{checkpoint}: not a checkpoint directory")
    files = _verify_files(checkpoint)
    try:
        if len(files["state.json"]) > MAX_STATE_BYTES:
            raise InputTooLarge(f"{checkpoint}/state.json: {len(files['state.json']):,} bytes, more than the "
                                f"{MAX_STATE_BYTES:,} a checkpoint's state.json may have")
        state = loads_json(files["state.json"].decode("utf-8"), where=f"{checkpoint}/state.json")
    except InputTooLarge as exc:
        raise CheckpointError(f"{exc} (not a state.json the zoo wrote)") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{checkpoint}/state.json is damaged: {_line(exc)}") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        found = state.get("format") if isinstance(state, dict) else None
        raise CheckpointError(f"{checkpoint}/state.json: not a {FORMAT} file" + (f" ({found})" if found else ""))
    _check_state(state, f"{checkpoint}/state.json", checkpoint)
    verified = VerifiedState(state)
    verified.files = files
    return verified


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
