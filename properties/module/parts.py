"""Which modules the module clauses (SPEC.md, "Modules") run on, and how a drawn example builds one.

Default: the zoo's parts from its default config, composed four times so that every option appears once:
attention with both kernel backends (``attention=math``, ``attention=torch``), every ffn, norm and pos
option, and the encoder/decoder layers of a tiny encoder-decoder for each composition (post- and pre-norm).

``--zoo "OVERRIDES"`` (the option of properties/model/subjects.py, split with ``shlex`` as
``properties.core.subject.zoo_subject`` does): the part groups those overrides name (``attention=torch``,
``attention._target_=mypkg.MyAttention``, ``+ffn.key=v``, ``~attention.kernel``) run their clauses on the part
built from that config node; groups it does not name are skipped with the reason.  The layer clauses
always run on the layers of the model that the overrides build (at tiny sizes unless the overrides set
them).  A part is a Hydra partial: each example calls it with drawn sizes (only keys its node has, e.g.
``d_model``, ``heads``, ``kv_heads``, ``d_ff``, ``max_len``) plus ``device=`` and ``dtype=``, puts it in eval
mode and redraws every floating parameter from the example's seed, so counterexamples replay exactly.

What the weight-reading clauses need from a replacement part (they are skipped, with this reason, when
it is missing; the black-box clauses need nothing):
  attention  ``q_proj, k_proj, v_proj, out_proj``, each with ``.weight`` (out, in) and ``.bias`` (or None)
  ffn        ``up`` (W1), ``down`` (W2) and for swiglu ``gate``; the variant is the node's ``activation``
  norm       ``weight`` (gain) and, for LayerNorm, ``bias`` (or None); eps from the node's ``eps``
  layers     ``self_attn``, ``ffn``, ``attn_block.norm``, ``ffn_block.norm`` (decoder: ``cross_attn``,
             ``cross_block.norm``) and the model's ``encoder.layers`` / ``decoder.layers`` / ``pos``
"""
from __future__ import annotations

import functools
import math
import types
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import HealthCheck, settings
from torch import nn

from properties.core import evidence
from properties.core.strategies import derived_generator, require_dtype
from properties.core.watchdog import describe_args, raised, user_call
from properties.core.zoo_config import ZooRun, with_layer_sizes, compose, zoo_run
from zoo.config.options import PARTS

__all__ = ["Part", "LayerSubject", "EXAMPLES", "module_settings", "part_params", "layer_params", "layer_subject",
           "reinitialize", "call_module", "watch_module", "inputs", "OneLine"]

# Each composition names one option of every group; together they cover every option once.
DEFAULT_COMPOSITIONS = (
    ("attention=math", "ffn=relu", "norm=layernorm", "pos=sinusoidal", "norm_placement=post"),
    ("attention=torch", "ffn=gelu", "norm=rmsnorm", "pos=rotary", "norm_placement=pre"),
    ("attention=math", "ffn=gelu_tanh", "norm=layernorm", "pos=learned", "norm_placement=pre"),
    ("attention=math", "ffn=swiglu", "norm=rmsnorm", "pos=none", "norm_placement=post"),
    ("attention=math", "ffn=relu", "norm=layernorm", "pos=alibi", "norm_placement=pre"),
)

# Half the profile's examples, at least 4: the suite runs every clause on several parts.
EXAMPLES = max(4, settings().max_examples // 2)
module_settings = settings(max_examples=EXAMPLES, deadline=None,
                           suppress_health_check=[HealthCheck.too_slow, HealthCheck.differing_executors])


class OneLine:
    """Mixin for drawn structures: Hypothesis prints the dataclass's repr on one line."""

    def _repr_pretty_(self, printer, cycle):
        printer.text(repr(self))


@dataclass(frozen=True, repr=False)
class Part:
    """One part under test: its group, the option chosen for it and its config node."""
    group: str
    choice: str
    node: object = field(compare=False)   # omegaconf DictConfig
    origin: str = "zoo"

    def __repr__(self) -> str:   # Hypothesis prints it in counterexamples
        target = self.node.get("_target_", "?")
        extra = f", kernel={self.node.kernel}" if self.group == "attention" and "kernel" in self.node else ""
        return f"<{self.group}={self.choice}: {target}{extra}>"

    def _repr_pretty_(self, printer, cycle):
        printer.text(repr(self))

    @property
    def id(self) -> str:
        return f"{self.choice}" if self.origin == "zoo" else f"zoo:{self.choice}"

    def has(self, key: str) -> bool:
        return key in self.node

    def get(self, key: str, default=None):
        return self.node[key] if key in self.node else default

    def build(self, device, dtype, seed: int, **sizes) -> nn.Module:
        """The part with ``sizes`` (only the keys its node has), in eval mode, parameters from ``seed`` (an example
        whose dtype the device cannot compute in is discarded)."""
        from zoo.config.parts import instantiate_part
        require_dtype(str(device), dtype)
        given = {k: v for k, v in sizes.items() if k in self.node}
        with user_call(self.plugin, lambda: describe_args(f"building {self.node.get('_target_', '?')}", (), given)):
            factory = instantiate_part(self.node)
            module = factory(**given, device=device, dtype=dtype)
            module.eval()
        reinitialize(module, seed)
        if evidence.active():   # --repro-dir: how a script builds this part again (properties/repro/module.py)
            from omegaconf import OmegaConf
            evidence.observe_part(module, {"group": self.group, "choice": self.choice, "origin": self.origin,
                                           "node": OmegaConf.to_yaml(OmegaConf.create(OmegaConf.to_container(
                                            self.node, resolve=True))),
                                           "sizes": given, "seed": seed, "dtype": str(dtype).removeprefix("torch.")})
        return watch_module(module, self.plugin)

    @property
    def plugin(self) -> str:
        """How the watchdog names it (properties/core/watchdog.py)."""
        return f"module {self.group}={self.choice} ({self.node.get('_target_', '?')})"


def reinitialize(module: nn.Module, seed: int) -> None:
    """Redraw every floating parameter from a CPU generator: matrices N(0, 1/fan_in), gains (1-D
    ``weight``) uniform in [0.5, 1.5], other vectors (biases) N(0, 0.25).  Biases are non-zero on purpose:
    a misplaced bias then shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if not p.is_floating_point():
                continue
            if p.dim() >= 2:
                new = torch.randn(p.shape, generator=g, dtype=torch.float64) / math.sqrt(p.shape[-1])
            elif name.rsplit(".", 1)[-1] == "weight":
                new = 0.5 + torch.rand(p.shape, generator=g, dtype=torch.float64)
            else:
                new = 0.5 * torch.randn(p.shape, generator=g, dtype=torch.float64)
            p.copy_(new.to(p.dtype))


# ------------------------------------------------------------------------------------------ composition
def _default_parts(composition: tuple[str, ...]) -> dict[str, "Part"]:
    cfg, choices = compose(with_layer_sizes(("model=encoder_decoder",) + composition))
    return {g: Part(g, str(choices.get(g, g)), cfg[g], "zoo") for g in PARTS}


def part_params(config, group: str, applies=None) -> list:
    """pytest params (Part) for ``group``; ``applies(part)`` returns None or the reason it does not apply.

    Default: every option of the group once (deduplicated by choice and node).  With --zoo: the group's
    part if the overrides name it, else one skipped param."""
    run = zoo_run(config)
    if run is not None:
        if group not in run.named:
            return [pytest.param(None, id=f"{group}-not-named", marks=pytest.mark.skip(
                reason=f"--zoo names no {group} override: the {group} clauses run on parts the overrides name"))]
        candidates = [Part(group, run.choices.get(group, "config"), run.layer_cfg[group], run.origin.split()[0])]
    else:
        candidates, seen = [], set()
        for composition in DEFAULT_COMPOSITIONS:
            part = _default_parts(composition)[group]
            key = (part.choice, part.node.get("kernel", None))
            if key not in seen:
                seen.add(key)
                candidates.append(part)
    params = []
    for part in candidates:
        reason = applies(part) if applies else None
        if reason and run is None:
            continue   # default run: only the options a clause is about
        marks = [pytest.mark.skip(reason=reason)] if reason else []
        params.append(pytest.param(part, id=part.id, marks=marks))
    return params or [pytest.param(None, id=f"{group}-none", marks=pytest.mark.skip(reason="no part applies"))]


# ----------------------------------------------------------------------------------------------- layers
@dataclass(repr=False)
class LayerSubject:
    """The layers of one model built in float64: encoder layers, decoder layers, the positions module."""
    name: str
    placement: str
    d_model: int
    model: nn.Module
    encoder_layers: list
    decoder_layers: list
    pos: nn.Module | None
    reason: str = ""   # why the layers could not be found (then every layer clause skips)

    def __repr__(self) -> str:
        return f"<layers of {self.name}: {self.placement}-norm>"

    def _repr_pretty_(self, printer, cycle):
        printer.text(repr(self))

    def reseed(self, seed: int) -> None:
        reinitialize(self.model, seed)


def _stack(model, name: str):
    stack = getattr(model, name, None)
    layers = getattr(stack, "layers", None)
    return stack, list(layers) if layers is not None else []


@functools.lru_cache(maxsize=None)
def _default_layer_cfg(words: tuple[str, ...]):
    return compose(with_layer_sizes(words))[0]


_LAYERS: dict = {}


def _layer_subject(cfg, name: str, device: str) -> LayerSubject:
    from zoo.config.builder import model_from_config
    if (name, device) in _LAYERS:
        return _LAYERS[name, device]
    plugin = f"the layers of {name}"
    with user_call(plugin, "building the model"):
        model = model_from_config(cfg, device=device, dtype=torch.float64)
        model.eval()
    for module in model.modules():   # the layer clauses call layers, sub-layers and norms directly
        watch_module(module, plugin)
    encoder, enc_layers = _stack(model, "encoder")
    decoder, dec_layers = _stack(model, "decoder")
    pos = getattr(encoder if encoder is not None else decoder, "pos", None)
    reason = "" if enc_layers or dec_layers else (
        f"{type(model).__qualname__} has no encoder.layers or decoder.layers: the layer clauses find layers there")
    _LAYERS[name, device] = LayerSubject(name, str(cfg.norm_placement), int(cfg.d_model), model, enc_layers,
                                         dec_layers, pos, reason)
    return _LAYERS[name, device]


def layer_params(config, placement: str | None = None) -> list:
    """pytest params: keys of layer subjects (built lazily per device by :func:`layer_subject`); in the
    default run only the compositions with ``norm_placement=placement`` when one is given."""
    run = zoo_run(config)
    if run is not None:
        return [pytest.param((run.origin, run), id="zoo")]
    chosen = [w for w in DEFAULT_COMPOSITIONS if placement is None or f"norm_placement={placement}" in w]
    return [pytest.param((name, ("model=encoder_decoder",) + words), id=name)
            for words in chosen for name in ["-".join(w.split("=")[1] for w in words)]]


def layer_subject(key, device) -> LayerSubject:
    name, source = key
    cfg = source.layer_cfg if isinstance(source, ZooRun) else _default_layer_cfg(source)
    return _layer_subject(cfg, name, str(device))


# ------------------------------------------------------------------------------------------------ calls
def call_module(module: nn.Module, *args, expect: tuple[int, ...], like: torch.Tensor, what: str, **kwargs) -> torch.Tensor:
    """module(*args, **kwargs) without autograd; anything but a tensor of shape ``expect`` with ``like``'s
    dtype and device (or an exception) is an AssertionError naming the call."""
    def describe(t):
        return f"{str(t.dtype).removeprefix('torch.')}{tuple(t.shape)}" if torch.is_tensor(t) else repr(t)
    text = f"{what}({', '.join([describe(a) for a in args] + [f'{k}={describe(v)}' for k, v in kwargs.items()])})"
    owner = getattr(module, "__self__", module)   # module.rotate, module.score_bias: methods of the part
    try:
        with torch.no_grad(), user_call(getattr(owner, _PLUGIN, f"module {type(owner).__qualname__}"), text):
            out = module(*args, **kwargs)
    except Exception as exc:  # a user's module may fail in any way: a finding, not a crash
        raise AssertionError(f"{text} raised {raised(exc)}") from exc
    if not torch.is_tensor(out):
        raise AssertionError(f"{text} returned {type(out).__name__}, not a tensor")
    evidence.observe_module_call(owner, getattr(module, "__name__", "forward"), args, kwargs, out)
    if tuple(out.shape) != tuple(expect):
        raise AssertionError(f"{text} returned shape {tuple(out.shape)}, expected {tuple(expect)}")
    if out.dtype != like.dtype or out.device != like.device:
        raise AssertionError(f"{text} returned {out.dtype} on {out.device}, expected {like.dtype} on {like.device}")
    return out


_PLUGIN = "_watchdog_plugin"   # the attribute naming the plug-in a watched module belongs to


def watch_module(module: nn.Module, plugin: str) -> nn.Module:
    """Run every forward call of ``module`` as one call of the code under test (properties/core/watchdog.py: a time
    limit, a record for the supervisor, SystemExit and the like as failures). The wrapper is an instance attribute
    bound to the module, so deep copies and ``.to()`` keep it; a module that set its own instance ``forward`` is
    left alone."""
    if "forward" not in vars(module):
        setattr(module, _PLUGIN, plugin)
        module.forward = types.MethodType(_watched_forward, module)
    return module


def _watched_forward(self, *args, **kwargs):
    with user_call(getattr(self, _PLUGIN), lambda: describe_args(f"{type(self).__qualname__}.forward", args, kwargs)):
        return type(self).forward(self, *args, **kwargs)


def inputs(seed: int, stream: int, shape, dtype, device, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    """N(shift, scale²) entries from the example's seed (CPU float64), rounded to dtype, moved to device."""
    g = derived_generator(seed, stream)
    return (shift + scale * torch.randn(*shape, generator=g, dtype=torch.float64)).to(dtype).to(device)
