"""What a set of weights fits: the ``Geometry`` of a zoo model, and the small helpers every converter uses."""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable, Iterable, Mapping

import torch
from einops import rearrange
from torch import nn

from zoo.io.weights import StateDictMismatch
from zoo.nn.attention import MultiHeadAttention
from zoo.nn.ffn import ACTIVATIONS, FeedForward
from zoo.nn.models import DecoderOnly, EncoderDecoder, EncoderOnly
from zoo.nn.norm import LayerNorm, RMSNorm
from zoo.nn.positional import LearnedPositions, NoPositions, RotaryPositions, SinusoidalPositions

State = Mapping[str, torch.Tensor]

FAMILIES = {"decoder_only": DecoderOnly, "encoder_only": EncoderOnly, "encoder_decoder": EncoderDecoder}
POSITIONS = {"learned": LearnedPositions, "sinusoidal": SinusoidalPositions, "rotary": RotaryPositions,
             "none": NoPositions}
NORMS = {"layernorm": LayerNorm, "rmsnorm": RMSNorm}


class ConversionError(ValueError):
    """A source model or state dict the zoo cannot represent exactly; the message says why."""



# --------------------------------------------------------------------------------------------- geometry

@dataclass(frozen=True)
class Geometry:
    """Everything that fixes a zoo model's parameter shapes and its function (dropout aside)."""
    family: str
    vocab_size: int
    d_model: int
    heads: int
    layers: int
    d_ff: int
    max_len: int
    decoder_layers: int | None = None
    kv_heads: int | None = None
    activation: str = "relu"
    norm: str = "layernorm"
    norm_eps: float = 1e-5
    pos: str = "sinusoidal"
    norm_placement: str = "post"
    final_norm: bool = False
    embed_scale: bool = False
    embed_norm: bool = False
    bias: bool = True
    type_vocab_size: int = 0
    pooler: bool = False
    head_classes: int = 0
    tie_head: bool = True
    share_embeddings: bool = True
    dropout: float = 0.0
    attention_dropout: float = 0.0

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ConversionError(f"family={self.family!r}: expected one of {sorted(FAMILIES)}")
        if self.activation not in ACTIVATIONS:
            raise ConversionError(f"activation={self.activation!r}: expected one of {sorted(ACTIVATIONS)}")
        if self.norm not in NORMS or self.pos not in POSITIONS:
            raise ConversionError(f"norm={self.norm!r}, pos={self.pos!r}: expected one of {sorted(NORMS)}, "
                                  f"{sorted(POSITIONS)}")

    def build(self, *, device=None, dtype=None, kernel: str | Callable = "math") -> nn.Module:
        """The zoo model of this geometry, built directly from part factories (random weights)."""
        d = self.d_model
        attention = partial(MultiHeadAttention, d, self.heads, self.kv_heads, self.bias, self.attention_dropout,
                            kernel)
        ffn = partial(FeedForward, d, self.d_ff, self.activation, self.bias)
        norm = (partial(LayerNorm, d, self.norm_eps, self.bias) if self.norm == "layernorm"
                else partial(RMSNorm, d, self.norm_eps))
        pos = (partial(RotaryPositions, d, self.max_len, self.heads) if self.pos == "rotary"
               else partial(POSITIONS[self.pos], d, self.max_len))
        common = dict(vocab_size=self.vocab_size, d_model=d, layers=self.layers, max_len=self.max_len,
                      attention=attention, ffn=ffn, norm=norm, pos=pos, norm_placement=self.norm_placement,
                      final_norm=self.final_norm, embed_scale=self.embed_scale, embed_norm=self.embed_norm,
                      dropout=self.dropout, device=device, dtype=dtype)
        if self.family == "decoder_only":
            return DecoderOnly(tie_head=self.tie_head, **common)
        if self.family == "encoder_only":
            return EncoderOnly(type_vocab_size=self.type_vocab_size, pooler=self.pooler,
                               head_classes=self.head_classes, **common)
        return EncoderDecoder(decoder_layers=self.decoder_layers, share_embeddings=self.share_embeddings,
                              tie_head=self.tie_head, **common)

    def overrides(self) -> list[str]:
        """Hydra overrides for ``zoo.config.builder.build_model`` that describe this geometry (conf/ tree)."""
        def value(v):  # YAML spelling: null, true/false, floats with their exponent (1e-12)
            if v is None:
                return "null"
            return str(v).lower() if isinstance(v, bool) else repr(v) if isinstance(v, float) else str(v)
        out = [f"model={self.family}", f"ffn={self.activation}", f"norm={self.norm}", f"pos={self.pos}"]
        out += [f"{k}={value(getattr(self, k))}" for k in
                ("d_model", "heads", "kv_heads", "layers", "d_ff", "vocab_size", "max_len", "dropout",
                 "norm_placement")]
        out += [f"norm.eps={value(self.norm_eps)}", f"attention.dropout={value(self.attention_dropout)}",
                f"attention.bias={value(self.bias)}", f"ffn.bias={value(self.bias)}"]
        if self.norm == "layernorm":
            out.append(f"norm.bias={value(self.bias)}")
        model = ["final_norm", "embed_scale", "embed_norm"] + {
            "decoder_only": ["tie_head"], "encoder_only": ["type_vocab_size", "pooler", "head_classes"],
            "encoder_decoder": ["decoder_layers", "share_embeddings", "tie_head"]}[self.family]
        return out + [f"model.{k}={value(getattr(self, k))}" for k in model]


def zoo_geometry(model: nn.Module) -> Geometry:
    """Read the geometry back from a built zoo model (the inverse of ``Geometry.build``)."""
    if getattr(model, "kind", None) not in FAMILIES:
        raise ConversionError(f"{type(model).__name__} is not a zoo model (EncoderOnly, DecoderOnly, EncoderDecoder)")
    stack = model.decoder if model.kind == "decoder_only" else model.encoder
    layer = stack.layers[0]
    attn, ffn, norm, pos = layer.self_attn, layer.ffn, layer.attn_block.norm, stack.pos
    for part, kinds in ((attn, (MultiHeadAttention,)), (ffn, (FeedForward,)), (norm, (LayerNorm, RMSNorm)),
                        (pos, tuple(POSITIONS.values()))):
        if type(part) not in kinds:
            raise ConversionError(f"zoo_geometry knows only the zoo's own parts, found {type(part).__name__}")
    kw = dict(
        family=model.kind, vocab_size=model.vocab_size, d_model=model.d_model, heads=attn.heads,
        kv_heads=None if attn.kv_heads == attn.heads else attn.kv_heads, layers=len(stack.layers),
        d_ff=ffn.up.out_features, max_len=model.max_len, activation=ffn.activation_name,
        norm="layernorm" if isinstance(norm, LayerNorm) else "rmsnorm", norm_eps=norm.eps,
        pos=next(k for k, v in POSITIONS.items() if type(pos) is v), norm_placement=layer.attn_block.placement,
        final_norm=stack.final_norm is not None, embed_scale=stack.embedding.multiplier != 1.0,
        embed_norm=stack.embed_norm is not None, bias=attn.q_proj.bias is not None,
        dropout=stack.dropout.p, attention_dropout=attn.dropout)
    if model.kind != "encoder_only":  # an encoder-only model has no LM head to tie
        kw.update(tie_head=model.lm_head.weight is stack.embedding.weight)
    if model.kind == "encoder_only":
        kw.update(type_vocab_size=0 if model.token_types is None else model.token_types.num_embeddings,
                  pooler=model.pooler is not None, head_classes=0 if model.head is None else model.head.out_features)
    if model.kind == "encoder_decoder":
        kw.update(decoder_layers=len(model.decoder.layers),
                  share_embeddings=model.decoder.embedding is model.encoder.embedding)
    return Geometry(**kw)


def require(condition: bool, message: str) -> None:
    """ConversionError(message) unless ``condition``: what a converter says when the weights do not fit."""
    if not condition:
        raise ConversionError(message)


def check_keys(state: State, expected: Iterable[str], source: str) -> None:
    """StateDictMismatch naming the missing and unexpected keys, unless ``state`` has exactly ``expected``."""
    expected = set(expected)
    missing, unexpected = expected - state.keys(), state.keys() - expected
    if missing or unexpected:
        raise StateDictMismatch(missing, unexpected, source=source)


def strip_prefix(state: State, prefix: str, keep: Iterable[str] = ()) -> dict[str, torch.Tensor]:
    """Drop a wrapper's prefix (``transformer.`` of GPT2LMHeadModel, ``bert.``) when every body key has it."""
    keep = set(keep)
    body = [k for k in state if k not in keep]
    if body and all(k.startswith(prefix) for k in body):
        return {(k if k in keep else k[len(prefix):]): v for k, v in state.items()}
    return dict(state)


def drop_buffers(state: State, suffixes: Iterable[str]) -> dict[str, torch.Tensor]:
    # Constant buffers some transformers versions save (causal-mask tables, position ids): not weights.
    suffixes = tuple(suffixes)
    return {k: v for k, v in state.items() if not k.endswith(suffixes)}


def split_qkv_rows(t: torch.Tensor) -> torch.Tensor:
    """Fused (3o, ...) q|k|v rows -> (3, o, ...), as nn.MultiheadAttention's in_proj stacks them."""
    return rearrange(t, "(three o) ... -> three o ...", three=3)


def copy_linear(state: dict, zoo: str, src: State, ref: str, bias: bool = True) -> None:
    """The weight (and bias) of linear layer ``ref`` of ``src`` into ``state`` as layer ``zoo``."""
    state[f"{zoo}.weight"] = src[f"{ref}.weight"]
    if bias:
        state[f"{zoo}.bias"] = src[f"{ref}.bias"]


def dtype_of(model: nn.Module) -> torch.dtype:
    """The dtype of the model's first parameter: the one its converted weights take."""
    return next(model.parameters()).dtype

