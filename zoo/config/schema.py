"""What a valid zoo config is, checked before anything is built.

Hydra's structured config (``ZooSchema``) fixes the top-level keys and their types, so an unknown
key or a non-integer size is refused while composing. ``validate`` then checks what types cannot
say (positive sizes, divisibility, known choices) and every part node against the constructor of
its ``_target_``, so that no key is ever dropped silently. Each problem is one ``ConfigError``
line naming the key, the value and what is allowed. The options of each task and of the data, and
their checks, are in zoo/config/task_schemas.py (their names are importable from here too).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import math
import types
import typing
from dataclasses import dataclass, fields
from typing import Any, Callable, ContextManager, Optional

import torch
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from zoo.nn.ffn import ACTIVATIONS, FeedForward
from zoo.nn.attention import MultiHeadAttention
from zoo.nn.positional import RotaryPositions
from zoo.nn.kernel import KERNELS
from zoo.nn.blocks import NORM_PLACEMENTS
from zoo.config.errors import ConfigError, refuse_value
from zoo.config.options import DTYPES, MAX_LAYERS, PARTS
from zoo.config.parts import OFF_WHEN_NULL, instantiate_part
from zoo.runtime.call_limit import parse_limit
from zoo.runtime.plugins import PluginError, locate
from zoo.config.task_schemas import TASK_SCHEMAS, DataOptions, check_seed, check_task

__all__ = ["ZooSchema", "validate", "torch_dtype", "zoo_targets", "plugin_in", "integral_overrides"]


@dataclass
class ZooSchema:
    d_model: int = MISSING
    heads: int = MISSING
    kv_heads: Optional[int] = None
    layers: int = MISSING
    d_ff: int = MISSING
    vocab_size: int = MISSING
    max_len: int = MISSING
    dropout: float = MISSING
    norm_placement: str = MISSING
    device: str = "cpu"
    dtype: str = "float32"
    seed: int = 0
    call_timeout: float = 60.0  # seconds one call of a plug-in may take (zoo/runtime/call_limit.py); 0: no limit
    reference: Optional[str] = None  # task=compare: hf (gpt2_small, bert_base) or torch (vaswani_base)
    model: Any = MISSING
    attention: Any = MISSING
    ffn: Any = MISSING
    norm: Any = MISSING
    pos: Any = MISSING
    task: Any = MISSING
    data: Any = MISSING  # conf/data: the synthetic task that task=train and task=generate use
    # Loading a checkpoint (task=generate, task=train task.resume=true) imports and calls only the zoo's own
    # classes and kernels; true (on the command line: the file's own value is never read) accepts the
    # plug-in paths (_target_, attention.kernel) the checkpoint's config names.
    allow_plugins: bool = False


ConfigStore.instance().store(name="zoo_schema", node=ZooSchema)


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ConfigError(f"dtype={name}: unknown dtype (allowed: {', '.join(DTYPES)})")
    return DTYPES[name]


def _type_ok(value: Any, hint: Any) -> bool:
    """Whether a plain config value fits a constructor annotation; unknown hints pass."""
    if hint is inspect.Parameter.empty or hint is Any:
        return True
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, arm) for arm in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    return True  # callables, modules and other rich types are the constructor's to check


def _check_part(path: str, node: DictConfig) -> None:
    """Every key of a part node must be a parameter of its _target_, of the annotated type (an OFF_WHEN_NULL
    key only when set)."""
    target = node.get("_target_")
    if not target or not isinstance(target, str):
        refuse_value(f"{path}._target_", target, "every part needs an import path such as "
                                                 "'zoo.nn.attention.MultiHeadAttention'")
    try:
        obj = locate(target)
    except PluginError as exc:
        refuse_value(f"{path}._target_", target, f"cannot be loaded: {exc}")
    init = obj.__init__ if inspect.isclass(obj) else obj
    signature = inspect.signature(init)
    accepts_any = any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())
    try:
        hints = typing.get_type_hints(init)
    except Exception:  # annotations that cannot be evaluated: skip the type check, keep the key check
        hints = {}
    names = [n for n in signature.parameters if n not in ("self", "device", "dtype")]
    given_elsewhere = PARTS if path == "model" else ()  # model_from_config hands the model its parts
    for name, parameter in signature.parameters.items():
        if name in ("self", "device", "dtype") or name in given_elsewhere or name in node \
                or parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD) \
                or parameter.default is not parameter.empty:
            continue
        raise ConfigError(f"{path}.{name}: missing, and {target} needs it (set {path}.{name}=VALUE)")
    for key in node:
        if key in ("_target_", "_partial_") or (key in OFF_WHEN_NULL and node[key] is None):
            continue
        if key not in signature.parameters and not accepts_any:
            refuse_value(f"{path}.{key}", node[key], f"not a parameter of {target} (allowed: {', '.join(names)})")
        value = node[key]
        if key in hints and not _type_ok(value, hints[key]):
            refuse_value(f"{path}.{key}", value, f"expected {_hint_name(hints[key])}")


def _is_subclass(target: str, cls: type) -> bool:
    obj = locate(target)  # already loaded by _check_part
    return isinstance(obj, type) and issubclass(obj, cls)


def _hint_name(hint: Any) -> str:
    return str(hint).replace("typing.", "").replace("<class '", "").replace("'>", "")


def _positive(cfg: DictConfig, *keys: str) -> None:
    for key in keys:
        if cfg[key] < 1:
            refuse_value(key, cfg[key], "must be a positive integer")


def _divisors(n: int, limit: int = 12) -> list[int]:
    """The smallest `limit` divisors of n, trying at most 10^5 candidates (d_model may be 1e9, or a large prime:
    then the list shows the divisors found among them, and n itself)."""
    small, large = [], []
    for d in range(1, min(math.isqrt(n), 10**5) + 1):
        if n % d == 0:
            small.append(d)
            if d != n // d:
                large.append(n // d)
            if len(small) >= limit:
                break
    return sorted(small + large)[:limit]


def _allowed_divisors(n: int) -> str:
    shown = _divisors(n, 13)
    return ", ".join(map(str, shown[:12])) + (", ..." if len(shown) > 12 else "")


def _check_device(name: str, task: str | None) -> None:
    """A device this machine has: cpu, an available cuda (index in range), or another available backend."""
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError, TypeError):
        refuse_value("device", name, "not a device (allowed: cpu, cuda, cuda:N)")
    if device.type == "cpu":
        return
    if device.type == "meta":
        if task == "summary":
            return
        refuse_value("device", name, "the meta device holds no data, so nothing can run on it; task=summary builds "
                                     "the model card there by itself (allowed: cpu, cuda, cuda:N)")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            refuse_value("device", name, "CUDA is not available on this machine (allowed: cpu)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            refuse_value("device", name, f"this machine has {torch.cuda.device_count()} CUDA device(s) "
                                         f"(allowed: cpu, cuda, cuda:0..cuda:{torch.cuda.device_count() - 1})")
        return
    backend = getattr(torch.backends, device.type, None) or getattr(torch, device.type, None)
    try:
        available = bool(backend.is_available()) if backend is not None else False
    except Exception:  # a backend that cannot even say
        available = False
    if not available:
        refuse_value("device", name, f"{device.type} is not available on this machine (allowed: cpu"
                                     f"{', cuda' if torch.cuda.is_available() else ''})")


# Parameters of part nodes checked by name, whatever the class (the zoo's or a plug-in's): sizes, probabilities,
# and the constants a norm or a position scheme divides by.
_PART_SIZES = ("d_model", "heads", "d_ff", "layers", "decoder_layers", "vocab_size", "max_len", "window")
_PART_COUNTS = ("head_classes", "type_vocab_size", "pad_id")


def _check_part_values(path: str, node: DictConfig) -> None:
    for key in node:
        value = node[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        where = f"{path}.{key}"
        if isinstance(value, float) and not math.isfinite(value):
            refuse_value(where, value, "must be a finite number")
        if key == "dropout" and not 0.0 <= value < 1.0:
            refuse_value(where, value, "must lie in [0, 1)")
        if key in ("eps", "base") and not value > 0:
            refuse_value(where, value, "must be positive")
        if key == "softcap" and not value > 0:
            refuse_value(where, value, "must be positive (null: no capping)")
        if key in _PART_SIZES and value < 1:
            refuse_value(where, value, "must be a positive integer")
        if key in ("layers", "decoder_layers") and value > MAX_LAYERS:
            refuse_value(where, value, f"more layers than a stack may have (allowed: 1 to {MAX_LAYERS})")
        if key in _PART_COUNTS and value < 0:
            refuse_value(where, value, "must be a non-negative integer")


def _check_interpolations(node: DictConfig, path: str = "") -> None:
    """Every interpolation must resolve; `${hydra:...}` only can inside a Hydra run, and is left to it elsewhere."""
    from omegaconf.errors import InterpolationResolutionError

    for key in node:
        where = f"{path}{key}"
        if OmegaConf.is_interpolation(node, key):
            try:
                node[key]
            except InterpolationResolutionError as exc:
                if "HydraConfig was not set" in str(exc):
                    continue
                raw = OmegaConf.to_container(node, resolve=False)[key]
                reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                refuse_value(where, raw, f"the interpolation does not resolve: {reason}")
        elif OmegaConf.is_config(node._get_node(key)) and not OmegaConf.is_missing(node, key) \
                and isinstance(node._get_node(key), DictConfig):
            _check_interpolations(node[key], f"{where}.")


def validate(cfg: DictConfig, plugin_call: Callable[[], ContextManager] = contextlib.nullcontext) -> None:
    """Raise ConfigError (one line) for the first value that cannot be used. ``plugin_call()`` is entered around
    the code of a plug-in alone (importing it, reading its signature), not the zoo's own: the spec suite bounds
    that call with its --call-timeout, which must not be spent on the zoo's imports."""
    _check_interpolations(cfg)
    known = {f.name for f in fields(ZooSchema)}
    for key in cfg:
        if key not in known and key != "hydra":
            refuse_value(key, cfg[key], f"unknown key (allowed: {', '.join(sorted(known))})")
    _positive(cfg, "d_model", "heads", "layers", "d_ff", "vocab_size", "max_len")
    if cfg.layers > MAX_LAYERS:
        refuse_value("layers", cfg.layers, f"more layers than a stack may have (allowed: 1 to {MAX_LAYERS})")
    check_seed("seed", cfg.seed)
    try:
        parse_limit(cfg.call_timeout)
    except ValueError as exc:
        refuse_value("call_timeout", cfg.call_timeout, str(exc))
    if cfg.d_model % cfg.heads:
        refuse_value("heads", cfg.heads,
                     f"must divide d_model={cfg.d_model} (allowed: {_allowed_divisors(cfg.d_model)})")
    if cfg.kv_heads is not None and (cfg.kv_heads < 1 or cfg.heads % cfg.kv_heads):
        refuse_value("kv_heads", cfg.kv_heads,
                     f"must divide heads={cfg.heads} (allowed: null, {_allowed_divisors(cfg.heads)})")
    if not (isinstance(cfg.dropout, (int, float)) and 0.0 <= cfg.dropout < 1.0):
        refuse_value("dropout", cfg.dropout, "must lie in [0, 1)")
    if cfg.norm_placement not in NORM_PLACEMENTS:
        refuse_value("norm_placement", cfg.norm_placement, f"unknown placement (allowed: {', '.join(NORM_PLACEMENTS)})")
    torch_dtype(cfg.dtype)
    _check_device(str(cfg.device), cfg.task.get("name") if isinstance(cfg.get("task"), DictConfig) else None)

    for part in ("model", *PARTS):
        target = cfg[part].get("_target_")
        with plugin_call() if isinstance(target, str) and target not in zoo_targets() else contextlib.nullcontext():
            _check_part(part, cfg[part])
        _check_part_values(part, cfg[part])
    if cfg.ffn.get("activation") is not None and _is_subclass(cfg.ffn._target_, FeedForward) \
            and cfg.ffn.activation not in ACTIVATIONS:
        refuse_value("ffn.activation", cfg.ffn.activation, f"unknown activation (allowed: {', '.join(ACTIVATIONS)})")
    kernel = cfg.attention.get("kernel")
    if isinstance(kernel, str) and kernel not in KERNELS:
        from zoo.nn.kernel import resolve_kernel
        try:
            with plugin_call():
                function = resolve_kernel(kernel)
        except PluginError as exc:
            refuse_value("attention.kernel", kernel,
                         str(exc).removeprefix(f"kernel {kernel!r} ").removeprefix(f"{kernel!r}: "))
        try:
            signature = inspect.signature(function)
        except (TypeError, ValueError):  # a builtin without a signature (F.scaled_dot_product_attention): trusted
            signature = None
        if signature is not None:
            try:
                signature.bind(None, None, None, attn_mask=None, dropout_p=0.0, is_causal=False, enable_gqa=False)
            except TypeError as exc:
                refuse_value("attention.kernel", kernel, f"does not take the arguments the zoo passes (query, key, "
                                                         f"value, attn_mask=, dropout_p=, is_causal=, enable_gqa=): "
                                                         f"{exc}")
    if cfg.attention.get("softcap") is not None and _is_subclass(cfg.attention._target_, MultiHeadAttention):
        from zoo.nn.kernel import resolve_kernel, takes_softcap
        with plugin_call() if isinstance(kernel, str) and kernel not in KERNELS else contextlib.nullcontext():
            function = resolve_kernel(kernel)
        if not takes_softcap(function):
            refuse_value("attention.softcap", cfg.attention.softcap,
                         f"attention.kernel={kernel} has SDPA's signature, which cannot cap scores (allowed with "
                         f"attention.kernel=math or a kernel taking softcap=)")
    if _is_subclass(cfg.pos._target_, RotaryPositions) and (cfg.d_model // cfg.heads) % 2:
        refuse_value("heads", cfg.heads,
                     f"rotary positions need an even head size, d_model/heads = {cfg.d_model // cfg.heads}")

    _check_zoo_parts_build(cfg)
    check_task(cfg)


def _check_zoo_parts_build(cfg: DictConfig) -> None:
    """Each of the zoo's own parts is built once on the meta device (no memory, about a millisecond): what its
    constructor refuses, e.g. an attention.kv_heads that does not divide attention.heads, is one line here rather
    than an error of the whole model's build. A plug-in part is left to its own constructor."""

    for part in PARTS:
        node = cfg[part]
        if node.get("_target_") not in zoo_targets():
            continue
        try:
            with torch.device("meta"):
                instantiate_part(node)(device="meta", dtype=torch_dtype(cfg.dtype))
        except Exception as exc:  # noqa: BLE001 - the constructor's own words, in one line
            cause = exc.__cause__ or exc
            if "overflow" in str(cause):  # a tensor of 2^63 bytes or more: no device holds it
                from zoo.config.sizing import ModelTooLarge, model_size
                raise ModelTooLarge(f"the model does not fit in any memory: {model_size(cfg).parameters:,} "
                                    f"parameters in {cfg.dtype} (d_model={cfg.d_model}), and one {part} tensor "
                                    f"alone would hold 2^63 bytes or more, more than any device has") from None
            raise ConfigError(f"{part}: {str(cause).splitlines()[0] if str(cause) else type(cause).__name__}") \
                from None


def plugin_in(cfg: DictConfig) -> str | None:
    """'attention.kernel=k.py:f' (or 'ffn._target_=pkg.Mine'): the first plug-in a config names, None if none; what
    ``call_timeout`` bounds and names."""
    kernel = cfg.attention.get("kernel")
    if isinstance(kernel, str) and kernel not in KERNELS:
        return f"attention.kernel={kernel}"
    for part in ("model", *PARTS):
        target = cfg[part].get("_target_")
        if isinstance(target, str) and target not in zoo_targets():
            return f"{part}._target_={target}"
    return None


@functools.lru_cache(maxsize=None)
def zoo_targets() -> frozenset[str]:
    """The import paths of the zoo's own parts and models: every `_target_` of the packaged config groups
    (conf/model, conf/attention, conf/ffn, conf/norm, conf/pos)."""
    from importlib.resources import files

    found = set()
    for group in ("model", *PARTS):
        for entry in (files("zoo.conf") / group).iterdir():
            if entry.name.endswith(".yaml"):
                target = OmegaConf.create(entry.read_text()).get("_target_")
                if isinstance(target, str):
                    found.add(target)
    return frozenset(found)


def _int_fields() -> set[str]:
    keys = {f.name for f in fields(ZooSchema) if f.type in (int, "int", Optional[int], "Optional[int]")}
    for schema in TASK_SCHEMAS.values():
        keys |= {f"task.{f.name}" for f in fields(schema) if f.type in (int, "int", Optional[int], "Optional[int]")}
    keys |= {f"data.{f.name}" for f in fields(DataOptions) if f.type in (int, "int")}
    return keys


def integral_overrides(overrides: list[str]) -> list[str]:
    """`d_model=1e9` (an integral number written as a float) for an integer key becomes `d_model=1000000000`;
    anything else is left for Hydra and validate to judge."""
    ints = _int_fields()
    out = []
    for word in overrides:
        key, sep, value = word.partition("=")
        bare = key.lstrip("+~")
        if sep and bare in ints and any(c in value for c in "eE.") and not value.startswith(("${", "'", '"')):
            try:
                number = float(value)
            except ValueError:
                number = None
            if number is not None and math.isfinite(number) and number == int(number):
                word = f"{key}={int(number)}"
        out.append(word)
    return out
