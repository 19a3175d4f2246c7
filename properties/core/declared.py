"""What a model's config declares about each of its parts (``Subject.declared``; SPEC.md, "Models": MODEL-LAYER-*).

An adapter (``properties.adapters.hf_subject`` for transformers) reads the config and finds the modules; the clauses
of ``properties/model/test_declared.py`` hold every module to the declaration, through the module oracles. Each part
names its module and reads its weights when asked (``weights()``), so that the float64 twin's parts give float64
weights. A setting the adapter could not read is listed in ``not_checked``: the clauses name it in their report,
never assume it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from torch import nn

from properties.core.rotary import Rotary
from properties.core.routing import RoutingRule

__all__ = ["Norm", "Attention", "FeedForward", "Experts", "Ends", "Declared", "ACTIVATIONS", "NORM_KINDS"]

ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu")
NORM_KINDS = ("rms", "layer")


@dataclass(frozen=True)
class Norm:
    """y = g·n(x) (+ b): n(x) = x/√(mean x² + eps) ("rms") or (x − mean x)/√(var x + eps) ("layer") over the last
    axis; g = 1 + w when ``unit_offset`` (Gemma), else w; w and b the module's ``weight`` and ``bias``."""
    name: str
    module: nn.Module
    kind: str
    eps: float
    unit_offset: bool = False

    def __post_init__(self):
        if self.kind not in NORM_KINDS:
            raise ValueError(f"norm {self.name}: kind {self.kind!r} not in {NORM_KINDS}")


@dataclass(frozen=True)
class Attention:
    """A causal self-attention layer: heads of ``head_dim`` features, ``kv_heads`` key/value heads (query head i reads
    key/value head i // (heads/kv_heads)), scores σ·q·k capped to c·tanh(s/c) under ``softcap`` c, query i attending
    keys i − W < j ≤ i under ``window`` W, q and k rotated by ``rotary`` at positions 0, 1, ... and normalised first by
    ``q_norm``/``k_norm`` (per head when the norm's width is head_dim or its weight is (heads, head_dim), else over
    the whole projection). ``weights()`` -> {"q", "k", "v", "o"}: (weight (out, in), bias or None)."""
    name: str
    module: nn.Module
    heads: int
    kv_heads: int
    head_dim: int
    scale: float
    weights: Callable[[], dict]
    window: int | None = None
    softcap: float | None = None
    rotary: Rotary | None = None
    q_norm: Norm | None = None
    k_norm: Norm | None = None
    why: dict = field(default_factory=dict, compare=False)   # setting -> the config field it comes from


@dataclass(frozen=True)
class FeedForward:
    """down(act(gate(x)) ⊙ up(x)) when ``gated``, else down(act(up(x))). ``weights()`` -> {"up", "down"[, "gate"]}:
    (weight (out, in), bias or None)."""
    name: str
    module: nn.Module
    activation: str
    gated: bool
    weights: Callable[[], dict]

    def __post_init__(self):
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"feed-forward {self.name}: activation {self.activation!r} not in {ACTIVATIONS}")


@dataclass(frozen=True)
class Experts:
    """A mixture-of-experts block: router logits ℓ = x Wᵀ (+ b) (``router()`` -> (W, b or None)), experts chosen and
    weighted by ``rule`` (properties/core/routing.py), each expert e a gated feed-forward network with ``activation``
    (``experts()`` -> (gate_up (E, 2I, D): gate rows first, down (E, D, I))), plus ``shared`` (always applied) scaled
    by sigmoid(x W_sᵀ) when ``shared_gate()`` gives W_s (Qwen2-MoE)."""
    name: str
    module: nn.Module
    rule: RoutingRule
    activation: str
    router: Callable[[], tuple]
    experts: Callable[[], tuple]
    shared: FeedForward | None = None
    shared_gate: Callable[[], tuple] | None = None


@dataclass(frozen=True)
class Ends:
    """The two ends of a decoder: the first layer (``first_layer``, its input hidden states) receives the token
    embeddings W[ids] (``embedding``'s weight) times ``embedding_scale``; the logits are the head's output z
    (``head``, an nn.Linear) times ``logit_scale`` and capped to c·tanh(z/c) under ``logit_softcap`` c. ``why``: the
    config field each comes from."""
    embedding: nn.Module
    first_layer: nn.Module
    head: nn.Module
    embedding_scale: float = 1.0
    logit_scale: float = 1.0
    logit_softcap: float | None = None
    why: dict = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class Declared:
    """Every part the adapter could read, and the settings it could not (each a short phrase for the report)."""
    attention: tuple[Attention, ...] = ()
    norms: tuple[Norm, ...] = ()
    feed_forward: tuple[FeedForward, ...] = ()
    experts: tuple[Experts, ...] = ()
    ends: Ends | None = None
    not_checked: tuple[str, ...] = ()

    @property
    def length_thresholds(self) -> tuple[int, ...]:
        """Lengths past which a declared rotary scaling changes the frequencies (dynamic NTK, LongRoPE)."""
        return tuple(sorted({a.rotary.threshold for a in self.attention
                             if a.rotary is not None and a.rotary.threshold is not None}))
