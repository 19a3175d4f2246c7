"""Weight files: save a model's state dict as safetensors (tied tensors stored once, written atomically), read
safetensors or torch.save files (weights_only=True: never arbitrary pickles), and load with a report of every
missing, unexpected or mismatched key."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, Mapping

import torch
from torch import nn

from zoo.io.atomic import replacing
from zoo.io.bounded import loads_json

__all__ = ["StateDictMismatch", "read_checkpoint", "state_from_bytes", "load_state_dict_checked", "load_checkpoint", "save_checkpoint"]

State = Mapping[str, torch.Tensor]


class StateDictMismatch(ValueError):
    """Keys or shapes that do not fit the model; the message lists every problem, not just the first."""

    def __init__(self, missing: Iterable[str] = (), unexpected: Iterable[str] = (),
                 mismatched: Iterable[tuple[str, tuple, tuple]] = (), conflicting: Iterable[str] = (),
                 source: str = "state dict"):
        self.missing, self.unexpected = sorted(missing), sorted(unexpected)
        self.mismatched, self.conflicting = sorted(mismatched), sorted(conflicting)
        lines = [f"{source} does not fit the model:"]
        if self.missing:
            lines.append(f"  missing keys ({len(self.missing)}): " + ", ".join(self.missing))
        if self.unexpected:
            lines.append(f"  unexpected keys ({len(self.unexpected)}): " + ", ".join(self.unexpected))
        for key, got, want in self.mismatched:
            lines.append(f"  shape mismatch {key}: checkpoint {list(got)} vs model {list(want)}")
        if self.conflicting:
            lines.append("  tied weights with different values in the checkpoint: " + ", ".join(self.conflicting))
        super().__init__("\n".join(lines))



# -------------------------------------------------------------------------------------- checkpoints

_ALIASES = "zoo.aliases"  # safetensors metadata: JSON {alias key: stored key} for tied tensors


def _tensor_groups(state: Mapping[str, torch.Tensor]) -> list[list[str]]:
    """Keys whose tensors are the same view of the same memory (tied weights), in state-dict order."""
    groups: dict[tuple, list[str]] = {}
    for key, t in state.items():
        if t.device.type == "meta":
            ident = (id(t),)
        else:
            ident = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        groups.setdefault(ident, []).append(key)
    return list(groups.values())


def save_checkpoint(model: nn.Module | State, path: str | os.PathLike,
                    metadata: Mapping[str, str] | None = None) -> Path:
    """Write the weights as safetensors, atomically (temp file + os.replace).

    safetensors refuses tensors that share memory, so each group of tied weights is stored once
    and the other names are recorded in the metadata; ``load_checkpoint`` restores them.
    """
    from safetensors.torch import save_file

    state = model.state_dict() if isinstance(model, nn.Module) else dict(model)
    bad = [k for k, v in state.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise TypeError(f"save_checkpoint: values that are not tensors: {bad}")
    tensors, aliases, storages = {}, {}, set()
    for keys in _tensor_groups(state):
        t = state[keys[0]].detach()
        # Distinct tensors that overlap in memory (not ties) would also be refused: copy them apart.
        shared = t.untyped_storage().data_ptr() in storages
        storages.add(t.untyped_storage().data_ptr())
        tensors[keys[0]] = (t.clone() if shared else t).contiguous().cpu()
        aliases.update({k: keys[0] for k in keys[1:]})
    meta = {"format": "pt", **(metadata or {})}
    if aliases:
        meta[_ALIASES] = json.dumps(aliases, sort_keys=True)
    path = Path(path)
    with replacing(path) as temporary:
        save_file(tensors, str(temporary), metadata=meta)
    return path


def _is_safetensors(data: bytes) -> bool:
    # Layout: an 8-byte little-endian header length, then a JSON header starting with '{'.
    if len(data) < 9:
        return False
    size = int.from_bytes(data[:8], "little")
    return data[8:9] == b"{" and 0 < size <= len(data) - 8


def read_checkpoint(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The state dict in a safetensors file or a torch.save file, on the CPU (``state_from_bytes`` of its bytes)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
    return state_from_bytes(path.read_bytes(), f"checkpoint {str(path)!r}")


def state_from_bytes(data: bytes, where: str) -> dict[str, torch.Tensor]:
    """The state dict that ``data`` (a safetensors or torch.save file's bytes) holds, on the CPU: what was read is what
    is loaded, so a checksum of ``data`` covers the weights (zoo.io.checkpoint_read).

    torch.save files are read with ``weights_only=True``: tensors and plain containers only, never
    arbitrary pickled objects. A file holding {'state_dict': ...} or {'model': ...} is unwrapped.
    """
    if _is_safetensors(data):
        from safetensors.torch import load

        state = load(data)
        header = loads_json(data[8:8 + int.from_bytes(data[:8], "little")].decode("utf-8", "replace"),
                            where=f"{where}: header")
        metadata = header.get("__metadata__") if isinstance(header, dict) else None
        aliases = loads_json((metadata or {}).get(_ALIASES, "{}"), where=f"{where}: metadata {_ALIASES}", max_depth=1)
        if not isinstance(aliases, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                    for k, v in aliases.items()):
            raise ValueError(f"{where}: metadata {_ALIASES} is not a mapping of names to names")
        for alias, key in aliases.items():
            if key not in state:
                raise ValueError(f"{where}: alias {alias!r} points to missing key {key!r}")
            state[alias] = state[key]
        return state
    import io
    try:
        obj = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # anything torch.load rejects: not a checkpoint we may open
        raise ValueError(f"{where} is neither safetensors nor a weights-only torch.save file: "
                         f"{type(exc).__name__}: {exc}") from exc
    for wrapper in ("state_dict", "model"):
        if isinstance(obj, Mapping) and isinstance(obj.get(wrapper), Mapping):
            obj = obj[wrapper]
            break
    if not isinstance(obj, Mapping):
        raise ValueError(f"{where} holds a {type(obj).__name__}, not a state dict")
    bad = [str(k) for k, v in obj.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    if bad:
        raise ValueError(f"{where}: entries that are not named tensors: {bad}")
    return dict(obj)


def load_state_dict_checked(model: nn.Module, state: State, *, source: str = "checkpoint") -> nn.Module:
    """``model.load_state_dict`` with one report of every missing, unexpected and mis-shaped key.

    A model with tied weights (one Parameter under several names) accepts a state dict that names
    the tie only once, as ``safetensors.torch.save_model`` writes; names given twice must agree.
    """
    own = model.state_dict(keep_vars=True)
    filled = dict(state)
    groups: dict[int, list[str]] = {}
    for key, t in own.items():
        groups.setdefault(id(t), []).append(key)
    conflicting = []
    for keys in groups.values():
        present = [k for k in keys if k in state]
        if len(keys) < 2 or not present:
            continue
        first = state[present[0]]
        if any(state[k] is not first and (state[k].shape != first.shape or not torch.equal(state[k], first))
               for k in present[1:]):
            conflicting.append(" = ".join(present))
        filled.update({k: first for k in keys if k not in state})
    missing = [k for k in own if k not in filled]
    unexpected = [k for k in state if k not in own]
    mismatched = [(k, tuple(filled[k].shape), tuple(own[k].shape)) for k in own
                  if k in filled and tuple(filled[k].shape) != tuple(own[k].shape)]
    if missing or unexpected or mismatched or conflicting:
        raise StateDictMismatch(missing, unexpected, mismatched, conflicting, source=source)
    model.load_state_dict(filled, strict=True)
    return model


def load_checkpoint(model: nn.Module, path: str | os.PathLike) -> nn.Module:
    """Load a safetensors / weights-only torch.save checkpoint into ``model``; raises StateDictMismatch."""
    return load_state_dict_checked(model, read_checkpoint(path), source=f"checkpoint {str(path)!r}")

