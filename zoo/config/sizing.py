"""How large the model a config describes is, and whether it fits its device, decided from the config alone.

``model_size(cfg)`` counts the parameters (tied tensors once, per part as the model card groups them), the
buffers and the modules of the model without building it: the zoo's parts and families are counted by formula,
in O(1) of the layer count, and agree with the built model exactly (tests/test_sizing.py checks every option).
A part of your own (``attention._target_=...``) is built once on the meta device and its counts multiplied by
the number of layers that hold it; if even that fails, it is counted as the zoo's part of the same role and the
size is marked as estimated. A model class of your own is counted as the zoo family it subclasses or its
``kind`` names (decoder-only when it names none).

``check_fits`` compares what a run needs (weights and buffers; for training also gradients and two AdamW
moments; the activations of the batch it runs) with the memory its device has free, and refuses in one line
before a byte is allocated. It never gives up silently: where a device cannot say how much memory it has free,
the host's free memory bounds it. The property suite's ``--zoo`` path calls it as ``check_fits(cfg,
device=..., dtype=...)``; ``ZOO_SKIP_MEMORY_CHECK=1`` turns it off.
"""
from __future__ import annotations

import inspect
import os
from dataclasses import dataclass, field

import torch
from omegaconf import DictConfig, OmegaConf

from zoo.config.device_memory import available_memory
from zoo.config.errors import ConfigError
from zoo.config.parts import instantiate_part
from zoo.config.options import DTYPES, PARTS
from zoo.runtime.plugins import PluginError, locate

__all__ = ["ModelTooLarge", "Count", "ModelSize", "model_size", "memory_needed", "check_fits", "builds_a_part"]

PART_ORDER = ("embeddings", "attention", "ffn", "norms", "head", "other")  # as zoo.tasks.summary groups them


class ModelTooLarge(ConfigError):
    """A model that cannot fit in the memory of its device; str() is one line naming what it needs."""


@dataclass(frozen=True)
class Count:
    """Parameter elements (by part), buffer elements, nn.Module instances and tensors of (part of) a model."""
    parts: tuple[int, ...] = (0,) * len(PART_ORDER)
    buffers: int = 0
    modules: int = 0
    tensors: int = 0

    @classmethod
    def of(cls, part: str, parameters: int = 0, *, buffers: int = 0, modules: int = 0, tensors: int = 0) -> "Count":
        return cls(tuple(parameters if p == part else 0 for p in PART_ORDER), buffers, modules, tensors)

    def __add__(self, other: "Count") -> "Count":
        return Count(tuple(a + b for a, b in zip(self.parts, other.parts)), self.buffers + other.buffers,
                     self.modules + other.modules, self.tensors + other.tensors)

    def __mul__(self, n: int) -> "Count":
        return Count(tuple(a * n for a in self.parts), self.buffers * n, self.modules * n, self.tensors * n)

    __rmul__ = __mul__

    @property
    def parameters(self) -> int:
        return sum(self.parts)


@dataclass(frozen=True)
class ModelSize:
    parameters: int                # elements, a tied tensor once
    by_part: dict                  # part (PART_ORDER) -> parameter elements, as zoo.tasks.summary.parameters_by_part
    buffers: int                   # buffer elements (the sinusoidal table, ALiBi slopes)
    modules: int                   # nn.Module instances
    tensors: int                   # parameter and buffer tensors
    element_size: int              # bytes per element in the model's dtype
    estimated: tuple = field(default=())  # what was not counted exactly: plug-in parts or models, and why
    # the largest temporary tensor the constructors make (the sinusoidal table is computed in float64)
    build_transient_bytes: int = 0

    @property
    def weight_bytes(self) -> int:
        return self.parameters * self.element_size

    @property
    def buffer_bytes(self) -> int:
        return self.buffers * self.element_size


# ----------------------------------------------------------------------------------- the zoo's parts by formula

def _linear(part: str, fan_in: int, fan_out: int, bias: bool) -> Count:
    return Count.of(part, fan_in * fan_out + (fan_out if bias else 0), modules=1, tensors=2 if bias else 1)


def _arguments(cls: type, node: DictConfig) -> dict:
    """The constructor's arguments for a part node: the node's keys, then the constructor's defaults."""
    values = {k: v for k, v in OmegaConf.to_container(node, resolve=True).items() if not k.startswith("_")}
    signature = inspect.signature(cls.__init__ if inspect.isclass(cls) else cls)
    for name, parameter in signature.parameters.items():
        if name not in values and parameter.default is not inspect.Parameter.empty:
            values[name] = parameter.default
    return values


def _attention(a: dict, part: str = "attention") -> Count:
    d, heads = a["d_model"], a["heads"]
    kv_heads = heads if a.get("kv_heads") is None else a["kv_heads"]
    e, bias = d // heads, bool(a.get("bias", True))
    return (Count(modules=1) + _linear(part, d, heads * e, bias) + 2 * _linear(part, d, kv_heads * e, bias)
            + _linear(part, heads * e, d, bias))


def _ffn(a: dict, part: str = "ffn") -> Count:
    d, f, bias = a["d_model"], a["d_ff"], bool(a.get("bias", True))
    gate = _linear(part, d, f, bias) if a.get("activation") == "swiglu" else Count()
    return Count(modules=2) + _linear(part, d, f, bias) + gate + _linear(part, f, d, bias)  # + the Dropout


def _layernorm(a: dict, part: str = "norms") -> Count:
    bias = bool(a.get("bias", True))
    return Count.of(part, a["d_model"] * (2 if bias else 1), modules=1, tensors=2 if bias else 1)


def _rmsnorm(a: dict, part: str = "norms") -> Count:
    return Count.of(part, a["d_model"], modules=1, tensors=1)


def _sinusoidal(a: dict, part: str = "embeddings") -> Count:
    return Count(buffers=a["max_len"] * a["d_model"], modules=1, tensors=1)


def _learned(a: dict, part: str = "embeddings") -> Count:
    return Count.of(part, a["max_len"] * a["d_model"], modules=2, tensors=1)


def _alibi(a: dict, part: str = "embeddings") -> Count:
    return Count(buffers=a["heads"], modules=1, tensors=1)


def _no_parameters(a: dict, part: str = "embeddings") -> Count:
    return Count(modules=1)


def _zoo_formulas() -> dict:
    from zoo.nn.attention import MultiHeadAttention
    from zoo.nn.ffn import FeedForward
    from zoo.nn.norm import LayerNorm, RMSNorm
    from zoo.nn.positional import (AlibiPositions, LearnedPositions, NoPositions, RotaryPositions,
                                   SinusoidalPositions)
    return {MultiHeadAttention: _attention, FeedForward: _ffn, LayerNorm: _layernorm, RMSNorm: _rmsnorm,
            SinusoidalPositions: _sinusoidal, LearnedPositions: _learned, RotaryPositions: _no_parameters,
            AlibiPositions: _alibi, NoPositions: _no_parameters}


_ROLE = {"attention": ("MultiHeadAttention", "attention"), "ffn": ("FeedForward", "ffn"),
         "norm": ("LayerNorm", "norms"), "pos": ("SinusoidalPositions", "embeddings")}  # class, card part


def builds_a_part(cfg: DictConfig) -> bool:
    """Whether ``model_size`` (so ``check_fits``) builds a part on the meta device to count it: a part of your own,
    one the zoo has no formula for. The zoo's own parts are counted from their settings."""
    formulas = _zoo_formulas()
    for role in PARTS:
        try:
            if locate(cfg[role]._target_) not in formulas:
                return True
        except PluginError:
            continue
    return False


def _part(cfg: DictConfig, role: str, dtype: torch.dtype, estimated: list) -> tuple[Count, int]:
    """(one instance's count, bytes of its largest temporary while it is built) of the part cfg[role]."""
    formulas = _zoo_formulas()
    node, (zoo_name, card_part) = cfg[role], _ROLE[role]
    try:
        cls = locate(node._target_)
    except PluginError:  # validate() refuses it; counted as the zoo's part of that role meanwhile
        cls = None
    if cls in formulas:
        arguments = _arguments(cls, node)
        transient = 0
        if formulas[cls] is _sinusoidal:  # computed in float64, the angles at half width, then cast
            transient = arguments["max_len"] * arguments["d_model"] * 12
        return formulas[cls](arguments, card_part), transient
    try:  # a part of your own: one instance on the meta device, O(1) of the layer count
        with torch.device("meta"):
            module = instantiate_part(node)(device="meta", dtype=dtype)
        tensors = [*module.parameters(), *module.buffers()]
        return Count.of(card_part, sum(p.numel() for p in module.parameters()),
                        buffers=sum(b.numel() for b in module.buffers()), modules=len(list(module.modules())),
                        tensors=len(tensors)), 0
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - the user's constructor may fail in any way, sys.exit() too
        estimated.append(f"{role}._target_={node._target_} counted as the zoo's {zoo_name} (one instance could "
                         f"not be built on the meta device: {type(exc).__name__})")
    zoo_class = next(c for c in formulas if c.__name__ == zoo_name)
    try:
        return formulas[zoo_class](_arguments(zoo_class, node), card_part), 0
    except (KeyError, TypeError, ValueError):  # a node without the zoo part's sizes
        return Count(modules=1), 0


# ---------------------------------------------------------------------------------------- the families

def _family(cls: object) -> str:
    from zoo.nn.models import DecoderOnly, EncoderDecoder, EncoderOnly
    for family in (EncoderOnly, DecoderOnly, EncoderDecoder):
        if isinstance(cls, type) and issubclass(cls, family):
            return family.kind
    kind = getattr(cls, "kind", None)
    return kind if kind in ("encoder_only", "decoder_only", "encoder_decoder") else ""


def _stack(m: dict, parts: dict, layers: int, cross: bool, own_embedding: bool) -> Count:
    """zoo.nn.models._Stack: embedding, positions, optional embedding norm, dropout, the layers, a final norm."""
    d, vocab = m["d_model"], m["vocab_size"]
    attention, ffn, norm, pos = parts["attention"], parts["ffn"], parts["norm"], parts["pos"]
    residual = Count(modules=2) + norm  # Residual, its Dropout and its norm
    layer = Count(modules=1) + attention + ffn + 2 * residual
    if cross:
        layer = layer + attention + residual
    final_norm = m.get("final_norm")
    if final_norm is None:
        final_norm = m.get("norm_placement") == "pre"
    embedding = Count.of("embeddings", vocab * d, modules=2, tensors=1) if own_embedding else Count()
    return (Count(modules=3) + embedding + pos + (norm if m.get("embed_norm") else Count())  # _Stack, Dropout, ModuleList
            + layers * layer + (norm if final_norm else Count()))


def _model(family: str, m: dict, parts: dict) -> Count:
    d, vocab = m["d_model"], m["vocab_size"]
    if family == "encoder_only":
        types = m.get("type_vocab_size") or 0
        classes = m.get("head_classes") or 0
        return (Count(modules=1) + _stack(m, parts, m["layers"], cross=False, own_embedding=True)
                + (Count.of("embeddings", types * d, modules=1, tensors=1) if types else Count())
                + (_linear("head", d, d, True) if m.get("pooler") else Count())
                + (_linear("head", d, classes, True) if classes else Count()))
    head = Count(modules=1) if m.get("tie_head", True) else _linear("head", d, vocab, False)
    if family == "decoder_only":
        return Count(modules=1) + _stack(m, parts, m["layers"], cross=False, own_embedding=True) + head
    decoder_layers = m["layers"] if m.get("decoder_layers") is None else m["decoder_layers"]
    return (Count(modules=1) + _stack(m, parts, m["layers"], cross=False, own_embedding=True)
            + _stack(m, parts, decoder_layers, cross=True, own_embedding=not m.get("share_embeddings", True))
            + head)


def model_size(cfg: DictConfig, *, dtype: torch.dtype | None = None) -> ModelSize:
    """The size of the model cfg builds, counted from the config without building it (see the module's doc)."""
    dtype = DTYPES.get(str(cfg.dtype), torch.float32) if dtype is None else dtype
    estimated: list[str] = []
    parts, transient = {}, 0
    for role in PARTS:
        parts[role], part_transient = _part(cfg, role, dtype, estimated)
        transient = max(transient, part_transient)
    try:
        cls = locate(cfg.model._target_)
    except PluginError:
        cls = None
    family = _family(cls)
    if not family or _family_class(family) is not cls:
        if not family:
            family = "decoder_only"
        estimated.append(f"model._target_={cfg.model._target_} counted as the zoo's {family} family")
    model = _arguments(_family_class(family), cfg.model)
    try:
        count = _model(family, model, parts)
    except (KeyError, TypeError) as exc:  # validate() refuses such a node first; said here too, never skipped
        raise ConfigError(f"model: cannot be sized from its config ({type(exc).__name__}: {exc})") from None
    return ModelSize(parameters=count.parameters, by_part=dict(zip(PART_ORDER, count.parts)), buffers=count.buffers,
                     modules=count.modules, tensors=count.tensors,
                     element_size=torch.empty((), dtype=dtype, device="meta").element_size(),
                     estimated=tuple(estimated), build_transient_bytes=transient)


def _family_class(family: str) -> type:
    from zoo.nn.models import DecoderOnly, EncoderDecoder, EncoderOnly
    return {"encoder_only": EncoderOnly, "decoder_only": DecoderOnly, "encoder_decoder": EncoderDecoder}[family]


# ------------------------------------------------------------------------------------------------ memory

def _activation_bytes(cfg: DictConfig, size: ModelSize, *, batch: int, length: int, training: bool) -> int:
    """A lower bound on the activations of one batch of `batch` sequences of `length` tokens: without gradients
    the residual stream and the largest tensor one layer makes (queries/keys/values and the scores, the FFN's
    hidden layer, or the logits); in training also what each layer keeps for its backward pass (the inputs of
    its linear maps and norms) and the logits with their gradient in float32. Token ids are int64."""
    if batch < 1 or length < 1:
        return 0
    family = _family(_located(cfg.model._target_)) or "decoder_only"
    d, vocab, heads = int(cfg.d_model), int(cfg.vocab_size), int(cfg.heads)
    kv_heads = heads if cfg.kv_heads is None else int(cfg.kv_heads)
    e, d_ff = d // heads, int(cfg.d_ff) * (2 if cfg.ffn.get("activation") == "swiglu" else 1)
    tokens = batch * length * 8 * (2 if family == "encoder_decoder" else 1)
    rows = batch * length
    if not training:
        largest = max(rows * (heads + 2 * kv_heads) * e + batch * heads * length * length, rows * d_ff, rows * vocab)
        memory = rows * d if family == "encoder_decoder" else 0
        return tokens + (2 * rows * d + memory + largest) * size.element_size
    encoder, decoder = int(cfg.model.layers), 0
    if family == "encoder_decoder":
        decoder = encoder if cfg.model.get("decoder_layers") is None else int(cfg.model.decoder_layers)
    per_layer = rows * (4 * d + heads * e + d_ff)
    cross = rows * (2 * d + heads * e + 2 * kv_heads * e)
    logits = 2 * rows * vocab * max(size.element_size, 4)
    return tokens + ((encoder + decoder) * per_layer + decoder * cross) * size.element_size + logits


def _located(target: str) -> object:
    try:
        return locate(target)
    except PluginError:
        return None


def memory_needed(cfg: DictConfig, *, training: bool = False, dtype: torch.dtype | None = None, batch: int = 0,
                  length: int = 0, resident_tokens: int = 0) -> tuple[int, int]:
    """(bytes, parameters) a run of the model cfg builds needs at least: weights and buffers, for training one
    gradient and two AdamW moments per weight, `resident_tokens` int64 token ids it keeps, the activations of a
    (batch, length) batch, and while the model is built the constructors' largest temporary tensor."""
    size = model_size(cfg, dtype=dtype)
    resident = size.weight_bytes * (4 if training else 1) + size.buffer_bytes + 8 * resident_tokens
    working = max(size.build_transient_bytes,
                  _activation_bytes(cfg, size, batch=batch, length=length, training=training))
    return resident + working, size.parameters


def _gib(n: float) -> str:
    for unit, scale in (("EiB", 2**60), ("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n / 2**20:,.1f} MiB"


def check_fits(cfg: DictConfig, *, device=None, dtype: torch.dtype | None = None, training: bool = False,
               batch: int = 0, length: int = 0, resident_tokens: int = 0) -> None:
    """Refuse, in one line naming the memory it needs, a model (and a batch of `batch` x `length` tokens) that
    cannot fit on its device, before a byte of it is allocated; decided from the config (``model_size``), in
    O(1) of the layer count. The meta device holds no data: nothing to check. ZOO_SKIP_MEMORY_CHECK=1 skips it."""
    if os.environ.get("ZOO_SKIP_MEMORY_CHECK"):
        return
    device = torch.device(cfg.device if device is None else device)
    if device.type == "meta":
        return
    size = model_size(cfg, dtype=dtype)
    needed, parameters = memory_needed(cfg, training=training, dtype=dtype, batch=batch, length=length,
                                       resident_tokens=resident_tokens)
    free = available_memory(device)
    if free is None:  # no /proc, no sysconf, no device figure: nothing to compare with, and the reason is said
        free = (2**63, "nothing on this machine reports free memory")
    if needed <= free[0]:
        return
    what = "weights, gradients and AdamW moments" if training else "weights and buffers"
    if batch and length:
        what += f", and the activations of a batch of {batch:,} x {length:,} tokens"
    if resident_tokens:
        what += f", {resident_tokens:,} token ids kept"
    dtype_name = str(dtype).removeprefix("torch.") if dtype is not None else cfg.dtype
    note = f"; {size.estimated[0]}" if size.estimated else ""
    raise ModelTooLarge(f"the model does not fit in memory: {parameters:,} parameters in {dtype_name} need at "
                        f"least {_gib(needed)} ({what}) on {device}, and {_gib(free[0])} is available "
                        f"({free[1]}); task=summary shows its card without allocating it{note}")
