"""Weights in and out of the zoo: Hugging Face GPT-2 and BERT, torch.nn.Transformer, nn.MultiheadAttention,
and user checkpoints (safetensors, or torch.save files read with weights_only=True).

Converters work on state dicts (str -> Tensor) and a ``Geometry`` that says which zoo model the
weights fit; ``zoo_*_from_*`` helpers build the matching model and load it.

    Hugging Face GPT2LMHeadModel  <->  DecoderOnly     (gpt2_to_zoo / zoo_to_gpt2)
    Hugging Face BertModel        <->  EncoderOnly     (bert_to_zoo / zoo_to_bert, a pure renaming)
    torch.nn.Transformer           ->  EncoderDecoder  (torch_transformer_to_zoo)
    nn.MultiheadAttention          ->  MultiHeadAttention (mha_to_zoo)

Returned tensors may share memory with the input state dict; loading them copies.
``transformers`` is optional: it is imported only by the functions that build Hugging Face objects.
"""
from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Iterable, Mapping

import torch
from einops import rearrange
from torch import nn

from zoo.atomic import replacing
from zoo.attention import MultiHeadAttention
from zoo.ffn import ACTIVATIONS, FeedForward
from zoo.models import DecoderOnly, EncoderDecoder, EncoderOnly
from zoo.norm import LayerNorm, RMSNorm
from zoo.positional import LearnedPositions, NoPositions, RotaryPositions, SinusoidalPositions

__all__ = [
    "Geometry", "StateDictMismatch", "ConversionError", "zoo_geometry",
    "gpt2_geometry", "gpt2_to_zoo", "zoo_to_gpt2", "zoo_gpt2_from_hf", "hf_gpt2_config", "hf_gpt2_from_zoo",
    "bert_geometry", "bert_to_zoo", "zoo_to_bert", "zoo_bert_from_hf", "hf_bert_config", "hf_bert_from_zoo",
    "TorchTransformerReference", "torch_transformer_geometry", "torch_transformer_to_zoo",
    "zoo_from_torch_transformer", "mha_to_zoo", "zoo_attention_from_mha",
    "read_checkpoint", "load_state_dict_checked", "load_checkpoint", "save_checkpoint",
]

State = Mapping[str, torch.Tensor]

FAMILIES = {"decoder_only": DecoderOnly, "encoder_only": EncoderOnly, "encoder_decoder": EncoderDecoder}
POSITIONS = {"learned": LearnedPositions, "sinusoidal": SinusoidalPositions, "rotary": RotaryPositions,
             "none": NoPositions}
NORMS = {"layernorm": LayerNorm, "rmsnorm": RMSNorm}


class ConversionError(ValueError):
    """A source model or state dict the zoo cannot represent exactly; the message says why."""


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
        """Hydra overrides for ``zoo.build.build_model`` that describe this geometry (conf/ tree)."""
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


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConversionError(message)


def _check_keys(state: State, expected: Iterable[str], source: str) -> None:
    expected = set(expected)
    missing, unexpected = expected - state.keys(), state.keys() - expected
    if missing or unexpected:
        raise StateDictMismatch(missing, unexpected, source=source)


def _strip_prefix(state: State, prefix: str, keep: Iterable[str] = ()) -> dict[str, torch.Tensor]:
    """Drop a wrapper's prefix (``transformer.`` of GPT2LMHeadModel, ``bert.``) when every body key has it."""
    keep = set(keep)
    body = [k for k in state if k not in keep]
    if body and all(k.startswith(prefix) for k in body):
        return {(k if k in keep else k[len(prefix):]): v for k, v in state.items()}
    return dict(state)


def _drop_buffers(state: State, suffixes: Iterable[str]) -> dict[str, torch.Tensor]:
    # Constant buffers some transformers versions save (causal-mask tables, position ids): not weights.
    suffixes = tuple(suffixes)
    return {k: v for k, v in state.items() if not k.endswith(suffixes)}


def _split_rows(t: torch.Tensor) -> torch.Tensor:
    """Fused (3o, ...) q|k|v rows -> (3, o, ...), as nn.MultiheadAttention's in_proj stacks them."""
    return rearrange(t, "(three o) ... -> three o ...", three=3)


def _linear(state: dict, zoo: str, src: State, ref: str, bias: bool = True) -> None:
    state[f"{zoo}.weight"] = src[f"{ref}.weight"]
    if bias:
        state[f"{zoo}.bias"] = src[f"{ref}.bias"]


# ---------------------------------------------------------------------------------------------- GPT-2

_GPT2_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu"}


def gpt2_geometry(config) -> Geometry:
    """GPT2Config -> the DecoderOnly geometry that computes the same function."""
    _require(config.activation_function in _GPT2_ACTIVATIONS,
             f"GPT-2 activation_function={config.activation_function!r}: supported {sorted(_GPT2_ACTIVATIONS)}")
    _require(config.scale_attn_weights and not config.scale_attn_by_inverse_layer_idx,
             "GPT-2 attention must be scaled by 1/sqrt(head_dim) only (scale_attn_weights=True, "
             "scale_attn_by_inverse_layer_idx=False)")
    _require(not getattr(config, "add_cross_attention", False), "GPT-2 with cross-attention has no zoo counterpart")
    return Geometry(family="decoder_only", vocab_size=config.vocab_size, d_model=config.n_embd, heads=config.n_head,
                    layers=config.n_layer, d_ff=config.n_inner or 4 * config.n_embd, max_len=config.n_positions,
                    activation=_GPT2_ACTIVATIONS[config.activation_function], norm_eps=config.layer_norm_epsilon,
                    pos="learned", norm_placement="pre", final_norm=True,
                    tie_head=bool(getattr(config, "tie_word_embeddings", True)),
                    dropout=float(config.resid_pdrop), attention_dropout=float(config.attn_pdrop))


def _gpt2_compatible(g: Geometry) -> None:
    _require(g.family == "decoder_only" and g.norm == "layernorm" and g.pos == "learned" and g.norm_placement == "pre"
             and g.final_norm and g.bias and not g.embed_scale and not g.embed_norm and g.kv_heads is None
             and g.activation in ("gelu_tanh", "gelu", "relu"),
             f"not a GPT-2 geometry (need decoder_only, pre-norm LayerNorm with bias and a final norm, learned "
             f"positions, no embedding scale/norm, kv_heads=None): {g}")


def _gpt2_keys(g: Geometry) -> list[str]:
    per_layer = ["ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight",
                 "attn.c_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias",
                 "mlp.c_proj.weight", "mlp.c_proj.bias"]
    keys = ["wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias", "lm_head.weight"]
    return keys + [f"h.{i}.{k}" for i in range(g.layers) for k in per_layer]


def gpt2_to_zoo(state: State, geometry: Geometry) -> dict[str, torch.Tensor]:
    """GPT2LMHeadModel (or GPT2Model) state dict -> DecoderOnly state dict.

    HF's Conv1D computes x @ W + b, so W is the transpose of nn.Linear's weight; c_attn fuses
    q|k|v along its output axis.
    """
    _gpt2_compatible(geometry)
    src = _drop_buffers(_strip_prefix(state, "transformer.", keep=["lm_head.weight"]),
                        (".attn.bias", ".attn.masked_bias"))
    if "lm_head.weight" not in src:  # GPT2Model: no head; GPT-2's head is the token embedding
        _require(geometry.tie_head, "a GPT2Model state dict has no lm_head.weight, so the head must be tied")
        src["lm_head.weight"] = src.get("wte.weight")
    _check_keys(src, _gpt2_keys(geometry), "GPT-2 state dict")
    out: dict[str, torch.Tensor] = {"decoder.embedding.embedding.weight": src["wte.weight"],
                                    "decoder.pos.embedding.weight": src["wpe.weight"]}
    for i in range(geometry.layers):
        h, z = f"h.{i}.", f"decoder.layers.{i}."
        _linear(out, z + "attn_block.norm", src, h + "ln_1")
        _linear(out, z + "ffn_block.norm", src, h + "ln_2")
        q, k, v = rearrange(src[h + "attn.c_attn.weight"], "d (three o) -> three o d", three=3)
        qb, kb, vb = _split_rows(src[h + "attn.c_attn.bias"])
        for name, w, b in (("q_proj", q, qb), ("k_proj", k, kb), ("v_proj", v, vb)):
            out[f"{z}self_attn.{name}.weight"], out[f"{z}self_attn.{name}.bias"] = w, b
        for zoo_name, hf_name in (("self_attn.out_proj", "attn.c_proj"), ("ffn.up", "mlp.c_fc"),
                                  ("ffn.down", "mlp.c_proj")):
            out[f"{z}{zoo_name}.weight"] = src[f"{h}{hf_name}.weight"].t()
            out[f"{z}{zoo_name}.bias"] = src[f"{h}{hf_name}.bias"]
    _linear(out, "decoder.final_norm", src, "ln_f")
    head = src["lm_head.weight"]
    if geometry.tie_head:
        # A tied zoo model has one matrix; refuse a checkpoint whose head differs from its embedding.
        _require(head is src["wte.weight"] or torch.equal(head, src["wte.weight"]),
                 "tie_head=True but lm_head.weight differs from transformer.wte.weight")
        head = src["wte.weight"]
    out["lm_head.weight"] = head
    return {k: v.contiguous() for k, v in out.items()}


def zoo_to_gpt2(state: State, geometry: Geometry) -> dict[str, torch.Tensor]:
    """DecoderOnly state dict -> GPT2LMHeadModel state dict (the inverse of ``gpt2_to_zoo``)."""
    _gpt2_compatible(geometry)
    zoo_keys = {"decoder.embedding.embedding.weight", "decoder.pos.embedding.weight", "decoder.final_norm.weight",
                "decoder.final_norm.bias", "lm_head.weight"}
    for i in range(geometry.layers):
        z = f"decoder.layers.{i}."
        zoo_keys |= {z + n + s for n in ("attn_block.norm", "ffn_block.norm", "self_attn.q_proj", "self_attn.k_proj",
                                         "self_attn.v_proj", "self_attn.out_proj", "ffn.up", "ffn.down")
                     for s in (".weight", ".bias")}
    _check_keys(state, zoo_keys, "zoo DecoderOnly state dict")
    out: dict[str, torch.Tensor] = {"transformer.wte.weight": state["decoder.embedding.embedding.weight"],
                                    "transformer.wpe.weight": state["decoder.pos.embedding.weight"]}
    for i in range(geometry.layers):
        h, z = f"transformer.h.{i}.", f"decoder.layers.{i}."
        _linear(out, h + "ln_1", state, z + "attn_block.norm")
        _linear(out, h + "ln_2", state, z + "ffn_block.norm")
        qkv = torch.stack([state[f"{z}self_attn.{n}.weight"] for n in ("q_proj", "k_proj", "v_proj")])
        out[h + "attn.c_attn.weight"] = rearrange(qkv, "three o d -> d (three o)")
        out[h + "attn.c_attn.bias"] = torch.cat([state[f"{z}self_attn.{n}.bias"]
                                                 for n in ("q_proj", "k_proj", "v_proj")])
        for zoo_name, hf_name in (("self_attn.out_proj", "attn.c_proj"), ("ffn.up", "mlp.c_fc"),
                                  ("ffn.down", "mlp.c_proj")):
            out[f"{h}{hf_name}.weight"] = state[f"{z}{zoo_name}.weight"].t()
            out[f"{h}{hf_name}.bias"] = state[f"{z}{zoo_name}.bias"]
    _linear(out, "transformer.ln_f", state, "decoder.final_norm")
    out["lm_head.weight"] = out["transformer.wte.weight"] if geometry.tie_head else state["lm_head.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def _dtype_of(model: nn.Module) -> torch.dtype:
    return next(model.parameters()).dtype


def zoo_gpt2_from_hf(hf_model: nn.Module, *, device=None, dtype=None, kernel: str | Callable = "math") -> DecoderOnly:
    """A DecoderOnly with the geometry and weights of a Hugging Face GPT2LMHeadModel (or GPT2Model)."""
    geometry = gpt2_geometry(hf_model.config)
    model = geometry.build(device=device, dtype=dtype or _dtype_of(hf_model), kernel=kernel)
    load_state_dict_checked(model, gpt2_to_zoo(hf_model.state_dict(), geometry), source="converted GPT-2 weights")
    return model.train(hf_model.training)


def hf_gpt2_config(geometry: Geometry, *, attn_implementation: str = "eager"):
    """The GPT2Config of a GPT-2-shaped geometry."""
    from transformers import GPT2Config

    g = geometry
    _gpt2_compatible(g)
    # gelu_tanh is written "gelu_new" in GPT-2's config: the same function (tanh approximation) in
    # HF's own formula, which differs from torch's only in rounding.
    activation = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu"}[g.activation]
    return GPT2Config(vocab_size=g.vocab_size, n_positions=g.max_len, n_embd=g.d_model, n_layer=g.layers,
                      n_head=g.heads, n_inner=g.d_ff, activation_function=activation, layer_norm_epsilon=g.norm_eps,
                      resid_pdrop=g.dropout, embd_pdrop=g.dropout, attn_pdrop=g.attention_dropout,
                      tie_word_embeddings=g.tie_head, bos_token_id=g.vocab_size - 1, eos_token_id=g.vocab_size - 1,
                      attn_implementation=attn_implementation)


def hf_gpt2_from_zoo(model: DecoderOnly, *, attn_implementation: str = "eager"):
    """A Hugging Face GPT2LMHeadModel with the geometry and weights of a GPT-2-shaped DecoderOnly."""
    from transformers import GPT2LMHeadModel

    g = zoo_geometry(model)
    weight = model.lm_head.weight
    hf = GPT2LMHeadModel(hf_gpt2_config(g, attn_implementation=attn_implementation)).to(weight.device, weight.dtype)
    load_state_dict_checked(hf, zoo_to_gpt2(model.state_dict(), g), source="converted zoo weights")
    return hf.train(model.training)


# ----------------------------------------------------------------------------------------------- BERT

_BERT_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}


def bert_geometry(config) -> Geometry:
    """BertConfig -> the EncoderOnly geometry (post-norm, embedding LayerNorm, token types, pooler)."""
    _require(isinstance(config.hidden_act, str) and config.hidden_act in _BERT_ACTIVATIONS,
             f"BERT hidden_act={config.hidden_act!r}: supported {sorted(_BERT_ACTIVATIONS)}")
    _require(getattr(config, "position_embedding_type", "absolute") == "absolute",
             "only absolute (learned) BERT position embeddings have a zoo counterpart")
    _require(not config.is_decoder and not getattr(config, "add_cross_attention", False),
             "BERT as a decoder has no zoo counterpart")
    return Geometry(family="encoder_only", vocab_size=config.vocab_size, d_model=config.hidden_size,
                    heads=config.num_attention_heads, layers=config.num_hidden_layers, d_ff=config.intermediate_size,
                    max_len=config.max_position_embeddings, activation=_BERT_ACTIVATIONS[config.hidden_act],
                    norm_eps=config.layer_norm_eps, pos="learned", norm_placement="post", final_norm=False,
                    embed_norm=True, type_vocab_size=config.type_vocab_size, pooler=True,
                    dropout=float(config.hidden_dropout_prob),
                    attention_dropout=float(config.attention_probs_dropout_prob))


def _bert_names(g: Geometry) -> dict[str, str]:
    """HF BertModel key -> zoo EncoderOnly key: the two differ only in names."""
    _require(g.family == "encoder_only" and g.norm == "layernorm" and g.pos == "learned" and g.norm_placement == "post"
             and not g.final_norm and g.embed_norm and not g.embed_scale and g.bias and g.kv_heads is None
             and g.type_vocab_size > 0 and g.pooler and not g.head_classes,
             f"not a BERT geometry (need encoder_only, post-norm LayerNorm with bias, learned positions, "
             f"embed_norm, token types, pooler, no head): {g}")
    names = {"embeddings.word_embeddings": "encoder.embedding.embedding",
             "embeddings.position_embeddings": "encoder.pos.embedding",
             "embeddings.token_type_embeddings": "token_types", "embeddings.LayerNorm": "encoder.embed_norm",
             "pooler.dense": "pooler"}
    for i in range(g.layers):
        b, z = f"encoder.layer.{i}.", f"encoder.layers.{i}."
        names.update({b + "attention.self.query": z + "self_attn.q_proj",
                      b + "attention.self.key": z + "self_attn.k_proj",
                      b + "attention.self.value": z + "self_attn.v_proj",
                      b + "attention.output.dense": z + "self_attn.out_proj",
                      b + "attention.output.LayerNorm": z + "attn_block.norm", b + "intermediate.dense": z + "ffn.up",
                      b + "output.dense": z + "ffn.down", b + "output.LayerNorm": z + "ffn_block.norm"})
    out = {}
    for hf, zoo in names.items():
        suffixes = (".weight",) if "embeddings" in hf and "LayerNorm" not in hf else (".weight", ".bias")
        out.update({hf + s: zoo + s for s in suffixes})
    return out


def bert_to_zoo(state: State, geometry: Geometry) -> dict[str, torch.Tensor]:
    """BertModel state dict (optionally under a ``bert.`` prefix) -> EncoderOnly state dict."""
    names = _bert_names(geometry)
    src = _drop_buffers(_strip_prefix(state, "bert."), ("embeddings.position_ids", "embeddings.token_type_ids"))
    _check_keys(src, names, "BERT state dict")
    return {zoo: src[hf] for hf, zoo in names.items()}


def zoo_to_bert(state: State, geometry: Geometry) -> dict[str, torch.Tensor]:
    """EncoderOnly state dict -> BertModel state dict (the inverse renaming)."""
    names = _bert_names(geometry)
    _check_keys(state, names.values(), "zoo EncoderOnly state dict")
    return {hf: state[zoo] for hf, zoo in names.items()}


def hf_bert_config(geometry: Geometry, *, attn_implementation: str = "eager"):
    """The BertConfig of a BERT-shaped geometry."""
    from transformers import BertConfig

    g = geometry
    _bert_names(g)  # checks the geometry
    activation = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "relu": "relu"}
    _require(g.activation in activation, f"BERT has no {g.activation!r} activation")
    return BertConfig(vocab_size=g.vocab_size, hidden_size=g.d_model, num_hidden_layers=g.layers,
                      num_attention_heads=g.heads, intermediate_size=g.d_ff, hidden_act=activation[g.activation],
                      hidden_dropout_prob=g.dropout, attention_probs_dropout_prob=g.attention_dropout,
                      max_position_embeddings=g.max_len, type_vocab_size=g.type_vocab_size, layer_norm_eps=g.norm_eps,
                      attn_implementation=attn_implementation)


def hf_bert_from_zoo(model: EncoderOnly, *, attn_implementation: str = "eager"):
    """A Hugging Face BertModel with the geometry and weights of a BERT-shaped EncoderOnly."""
    from transformers import BertModel

    g = zoo_geometry(model)
    weight = model.encoder.embedding.weight
    hf = BertModel(hf_bert_config(g, attn_implementation=attn_implementation)).to(weight.device, weight.dtype)
    load_state_dict_checked(hf, zoo_to_bert(model.state_dict(), g), source="converted zoo weights")
    return hf.train(model.training)


def zoo_bert_from_hf(hf_model: nn.Module, *, device=None, dtype=None, kernel: str | Callable = "math") -> EncoderOnly:
    """An EncoderOnly with the geometry and weights of a Hugging Face BertModel; pass token_types to forward."""
    geometry = bert_geometry(hf_model.config)
    model = geometry.build(device=device, dtype=dtype or _dtype_of(hf_model), kernel=kernel)
    load_state_dict_checked(model, bert_to_zoo(hf_model.state_dict(), geometry), source="converted BERT weights")
    return model.train(hf_model.training)


# ------------------------------------------------------------------------------- torch.nn.Transformer

def _textbook_positions(length: int, d_model: int) -> torch.Tensor:
    # The PyTorch tutorial's PositionalEncoding, written independently of zoo.positional so that the
    # reference checks the zoo's table too: exp(-ln(10000) 2i/d) instead of 10000^(-2i/d).
    position = torch.arange(length, dtype=torch.float64)[:, None]
    div_term = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float64) * (-math.log(10000.0) / d_model))
    table = torch.zeros(length, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(position * div_term)
    table[:, 1::2] = torch.cos(position * div_term)[:, : d_model // 2]
    return table


class TorchTransformerReference(nn.Module):
    """torch.nn.Transformer (batch_first) with the front-end and head of Vaswani et al. (section 3.4):
    one embedding matrix for source and target, scaled by sqrt(d), sinusoidal positions added, and the
    same matrix as the pre-softmax projection. nn.Transformer has no embeddings; this wrapper supplies
    the paper's, so that whole-model logits can be compared. Masks follow the zoo: True = real token.
    """

    def __init__(self, vocab_size: int, d_model: int, heads: int, layers: int, d_ff: int, max_len: int,
                 decoder_layers: int | None = None, dropout: float = 0.0, activation: str = "relu",
                 layer_norm_eps: float = 1e-5, norm_first: bool = False, bias: bool = True, *, device=None, dtype=None):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.embedding = nn.Embedding(vocab_size, d_model, **kw)
        with warnings.catch_warnings():  # "nested tensors unavailable" notices: they are switched off below
            warnings.filterwarnings("ignore", message="enable_nested_tensor is True")
            self.transformer = nn.Transformer(d_model, heads, layers,
                                              layers if decoder_layers is None else decoder_layers, d_ff, dropout,
                                              activation, layer_norm_eps=layer_norm_eps, batch_first=True,
                                              norm_first=norm_first, bias=bias, **kw)
        # Keep PyTorch's per-layer fast path but not the nested-tensor conversion, whose padded
        # outputs would not be plain tensors for forward hooks.
        self.transformer.encoder.enable_nested_tensor = self.transformer.encoder.use_nested_tensor = False
        self.vocab_size, self.max_len, self.d_model = vocab_size, max_len, d_model

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.shape[1] > self.max_len:
            raise ValueError(f"sequence of length {tokens.shape[1]} exceeds max_len={self.max_len}")
        x = self.embedding(tokens) * math.sqrt(self.d_model)
        # Computed per call in float64, not stored: a buffer would be rounded by module.to(float32)
        # and stay rounded after a later .to(float64).
        return x + _textbook_positions(tokens.shape[1], self.d_model).to(x)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor, src_mask: torch.Tensor | None = None,
                tgt_mask: torch.Tensor | None = None) -> torch.Tensor:
        l = tgt.shape[1]
        causal = torch.ones(l, l, dtype=torch.bool, device=tgt.device).triu(1)  # True = may NOT attend
        src_pad = None if src_mask is None else ~src_mask.to(torch.bool)
        tgt_pad = None if tgt_mask is None else ~tgt_mask.to(torch.bool)
        out = self.transformer(self.embed(src), self.embed(tgt), tgt_mask=causal, src_key_padding_mask=src_pad,
                               tgt_key_padding_mask=tgt_pad, memory_key_padding_mask=src_pad, tgt_is_causal=True)
        return nn.functional.linear(out, self.embedding.weight)


def _layer_activation(layer: nn.Module) -> str:
    kinds = {1: "relu", 2: "gelu"}  # how nn.Transformer*Layer records F.relu / F.gelu
    _require(getattr(layer, "activation_relu_or_gelu", 0) in kinds,
             f"nn.Transformer activation {layer.activation!r}: only relu and (exact) gelu have zoo counterparts")
    return kinds[layer.activation_relu_or_gelu]


def torch_transformer_geometry(transformer: nn.Transformer, vocab_size: int, max_len: int) -> Geometry:
    """Geometry of an EncoderDecoder computing nn.Transformer's stacks under the paper's front-end and head."""
    enc, dec = transformer.encoder, transformer.decoder
    _require(isinstance(enc, nn.TransformerEncoder) and isinstance(dec, nn.TransformerDecoder),
             "custom encoder/decoder modules are not supported")
    first = enc.layers[0]
    attn = first.self_attn
    _require(attn._qkv_same_embed_dim and attn.bias_k is None and not attn.add_zero_attn,
             "attention with kdim/vdim, bias_k/bias_v or add_zero_attn has no zoo counterpart")
    _require((enc.norm is None) == (dec.norm is None),
             "the encoder and decoder must both have, or both lack, a final norm")
    return Geometry(family="encoder_decoder", vocab_size=vocab_size, d_model=attn.embed_dim, heads=attn.num_heads,
                    layers=len(enc.layers), decoder_layers=len(dec.layers), d_ff=first.linear1.out_features,
                    max_len=max_len, activation=_layer_activation(first), norm_eps=first.norm1.eps, pos="sinusoidal",
                    norm_placement="pre" if first.norm_first else "post", final_norm=enc.norm is not None,
                    embed_scale=True, bias=first.linear1.bias is not None, dropout=float(first.dropout.p),
                    attention_dropout=float(attn.dropout))


def mha_to_zoo(state: State, prefix: str = "", out_prefix: str = "") -> dict[str, torch.Tensor]:
    """nn.MultiheadAttention state dict -> MultiHeadAttention state dict (in_proj split into q, k, v)."""
    bias = prefix + "in_proj_bias" in state
    expected = [f"{prefix}{k}" for k in ("in_proj_weight", "out_proj.weight")
                + (("in_proj_bias", "out_proj.bias") if bias else ())]
    _check_keys({k: v for k, v in state.items() if k.startswith(prefix)}, expected, "nn.MultiheadAttention state dict")
    out = {}
    for name, w in zip(("q_proj", "k_proj", "v_proj"), _split_rows(state[prefix + "in_proj_weight"])):
        out[f"{out_prefix}{name}.weight"] = w
    if bias:
        for name, b in zip(("q_proj", "k_proj", "v_proj"), _split_rows(state[prefix + "in_proj_bias"])):
            out[f"{out_prefix}{name}.bias"] = b
    _linear(out, out_prefix + "out_proj", state, prefix + "out_proj", bias=bias)
    return out


def zoo_attention_from_mha(mha: nn.MultiheadAttention, *, kernel: str | Callable = "math") -> MultiHeadAttention:
    """A MultiHeadAttention computing the same as ``mha`` (key_padding_mask inverted: True = real key)."""
    _require(mha._qkv_same_embed_dim and mha.bias_k is None and not mha.add_zero_attn,
             "attention with kdim/vdim, bias_k/bias_v or add_zero_attn has no zoo counterpart")
    w = mha.in_proj_weight
    zoo = MultiHeadAttention(mha.embed_dim, mha.num_heads, bias=mha.in_proj_bias is not None, dropout=mha.dropout,
                             kernel=kernel, device=w.device, dtype=w.dtype)
    keys = [k for k in mha.state_dict() if k not in ("in_proj_weight", "in_proj_bias")]
    _require(all(k.startswith("out_proj.") for k in keys), f"unexpected nn.MultiheadAttention parameters: {keys}")
    load_state_dict_checked(zoo, mha_to_zoo(mha.state_dict()), source="converted nn.MultiheadAttention weights")
    return zoo.train(mha.training)


def torch_transformer_to_zoo(state: State, geometry: Geometry, embedding: torch.Tensor) -> dict[str, torch.Tensor]:
    """nn.Transformer state dict + the (shared) embedding matrix -> EncoderDecoder state dict."""
    _require(geometry.family == "encoder_decoder" and geometry.share_embeddings and geometry.tie_head,
             "the nn.Transformer converter fills one shared, tied embedding")
    suffixes = (".weight", ".bias") if geometry.bias else (".weight",)
    attention = [f"{k}{s}" for k, s in (("in_proj_", "weight"), ("out_proj.", "weight"))] + \
        ([f"{k}{s}" for k, s in (("in_proj_", "bias"), ("out_proj.", "bias"))] if geometry.bias else [])
    names: dict[str, str] = {}  # nn.Transformer key -> zoo key, for the parameters copied as they are
    expected: list[str] = []
    decoder_layers = geometry.layers if geometry.decoder_layers is None else geometry.decoder_layers
    for side, count in (("encoder", geometry.layers), ("decoder", decoder_layers)):
        blocks = ["attn_block", "cross_block", "ffn_block"] if side == "decoder" else ["attn_block", "ffn_block"]
        for i in range(count):
            t = f"{side}.layers.{i}."
            parts = {f"norm{j + 1}": f"{block}.norm" for j, block in enumerate(blocks)}
            parts.update(linear1="ffn.up", linear2="ffn.down")
            names.update({t + ref + s: t + zoo + s for ref, zoo in parts.items() for s in suffixes})
            for ref in ("self_attn", "multihead_attn") if side == "decoder" else ("self_attn",):
                expected += [f"{t}{ref}.{k}" for k in attention]
        if geometry.final_norm:
            names.update({f"{side}.norm{s}": f"{side}.final_norm{s}" for s in suffixes})
    _check_keys(state, expected + list(names), "nn.Transformer state dict")

    out = {"encoder.embedding.embedding.weight": embedding, "decoder.embedding.embedding.weight": embedding,
           "lm_head.weight": embedding}
    out.update({zoo: state[ref] for ref, zoo in names.items()})
    for side, count in (("encoder", geometry.layers), ("decoder", decoder_layers)):
        for i in range(count):
            t = f"{side}.layers.{i}."
            out.update(mha_to_zoo(state, t + "self_attn.", t + "self_attn."))
            if side == "decoder":
                out.update(mha_to_zoo(state, t + "multihead_attn.", t + "cross_attn."))
    return {k: v.contiguous() for k, v in out.items()}


def zoo_from_torch_transformer(reference: TorchTransformerReference, *, device=None, dtype=None,
                               kernel: str | Callable = "math") -> EncoderDecoder:
    """An EncoderDecoder with the geometry and weights of a ``TorchTransformerReference``."""
    geometry = torch_transformer_geometry(reference.transformer, reference.vocab_size, reference.max_len)
    model = geometry.build(device=device, dtype=dtype or _dtype_of(reference), kernel=kernel)
    load_state_dict_checked(model, torch_transformer_to_zoo(reference.transformer.state_dict(), geometry,
                                                            reference.embedding.weight.detach()),
                            source="converted nn.Transformer weights")
    return model.train(reference.training)


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


def _is_safetensors(path: Path) -> bool:
    # Layout: an 8-byte little-endian header length, then a JSON header starting with '{'.
    with open(path, "rb") as f:
        head = f.read(9)
    if len(head) < 9:
        return False
    size = int.from_bytes(head[:8], "little")
    return head[8:9] == b"{" and 0 < size <= path.stat().st_size - 8


def read_checkpoint(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The state dict in a safetensors file or a torch.save file, on the CPU.

    torch.save files are read with ``weights_only=True``: tensors and plain containers only, never
    arbitrary pickled objects. A file holding {'state_dict': ...} or {'model': ...} is unwrapped.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
    if _is_safetensors(path):
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            state = {k: f.get_tensor(k) for k in f.keys()}
            aliases = json.loads((f.metadata() or {}).get(_ALIASES, "{}"))
        for alias, key in aliases.items():
            if key not in state:
                raise ValueError(f"checkpoint {str(path)!r}: alias {alias!r} points to missing key {key!r}")
            state[alias] = state[key]
        return state
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # anything torch.load rejects: not a checkpoint we may open
        raise ValueError(f"checkpoint {str(path)!r} is neither safetensors nor a weights-only torch.save file: "
                         f"{type(exc).__name__}: {exc}") from exc
    for wrapper in ("state_dict", "model"):
        if isinstance(obj, Mapping) and isinstance(obj.get(wrapper), Mapping):
            obj = obj[wrapper]
            break
    if not isinstance(obj, Mapping):
        raise ValueError(f"checkpoint {str(path)!r} holds a {type(obj).__name__}, not a state dict")
    bad = [str(k) for k, v in obj.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    if bad:
        raise ValueError(f"checkpoint {str(path)!r}: entries that are not named tensors: {bad}")
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
