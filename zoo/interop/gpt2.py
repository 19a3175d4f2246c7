"""Hugging Face GPT2LMHeadModel <-> zoo DecoderOnly (gpt2_to_zoo / zoo_to_gpt2)."""
from __future__ import annotations

from typing import Callable

import torch
from einops import rearrange
from torch import nn

from zoo.interop.geometry import (Geometry, State, check_keys, copy_linear, drop_buffers, dtype_of, require,
                                  split_qkv_rows, strip_prefix, zoo_geometry)
from zoo.io.weights import load_state_dict_checked
from zoo.nn.models import DecoderOnly


# ---------------------------------------------------------------------------------------------- GPT-2

_GPT2_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu"}


def gpt2_geometry(config) -> Geometry:
    """GPT2Config -> the DecoderOnly geometry that computes the same function."""
    require(config.activation_function in _GPT2_ACTIVATIONS,
             f"GPT-2 activation_function={config.activation_function!r}: supported {sorted(_GPT2_ACTIVATIONS)}")
    require(config.scale_attn_weights and not config.scale_attn_by_inverse_layer_idx,
             "GPT-2 attention must be scaled by 1/sqrt(head_dim) only (scale_attn_weights=True, "
             "scale_attn_by_inverse_layer_idx=False)")
    require(not getattr(config, "add_cross_attention", False), "GPT-2 with cross-attention has no zoo counterpart")
    return Geometry(family="decoder_only", vocab_size=config.vocab_size, d_model=config.n_embd, heads=config.n_head,
                    layers=config.n_layer, d_ff=config.n_inner or 4 * config.n_embd, max_len=config.n_positions,
                    activation=_GPT2_ACTIVATIONS[config.activation_function], norm_eps=config.layer_norm_epsilon,
                    pos="learned", norm_placement="pre", final_norm=True,
                    tie_head=bool(getattr(config, "tie_word_embeddings", True)),
                    dropout=float(config.resid_pdrop), attention_dropout=float(config.attn_pdrop))


def _gpt2_compatible(g: Geometry) -> None:
    require(g.family == "decoder_only" and g.norm == "layernorm" and g.pos == "learned" and g.norm_placement == "pre"
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


# Every GPT-2 module with a zoo counterpart, in state-dict order: (zoo name, GPT-2 name, kind). kind "weight": the
# weight alone; "norm": weight and bias as they are; "conv1d": HF's Conv1D computes x @ W + b, so W is the transpose
# of nn.Linear's weight; "qkv": c_attn fuses q|k|v along its output axis (the zoo name is the q/k/v prefix).
_GPT2_CONV1D = (("self_attn.out_proj", "attn.c_proj"), ("ffn.up", "mlp.c_fc"), ("ffn.down", "mlp.c_proj"))
_QKV = ("q_proj", "k_proj", "v_proj")


def _gpt2_modules(g: Geometry, transformer: str) -> list[tuple[str, str, str]]:
    """The modules both conversions map, GPT-2's names prefixed with ``transformer`` ("" or "transformer.")."""
    modules = [("decoder.embedding.embedding", f"{transformer}wte", "weight"),
               ("decoder.pos.embedding", f"{transformer}wpe", "weight")]
    for i in range(g.layers):
        z, h = f"decoder.layers.{i}.", f"{transformer}h.{i}."
        modules += [(z + "attn_block.norm", h + "ln_1", "norm"), (z + "ffn_block.norm", h + "ln_2", "norm"),
                    (z + "self_attn.", h + "attn.c_attn", "qkv")]
        modules += [(z + zoo_name, h + hf_name, "conv1d") for zoo_name, hf_name in _GPT2_CONV1D]
    return modules + [("decoder.final_norm", f"{transformer}ln_f", "norm")]


def gpt2_to_zoo(state: State, geometry: Geometry) -> dict[str, torch.Tensor]:
    """GPT2LMHeadModel (or GPT2Model) state dict -> DecoderOnly state dict.

    HF's Conv1D computes x @ W + b, so W is the transpose of nn.Linear's weight; c_attn fuses
    q|k|v along its output axis.
    """
    _gpt2_compatible(geometry)
    src = drop_buffers(strip_prefix(state, "transformer.", keep=["lm_head.weight"]),
                        (".attn.bias", ".attn.masked_bias"))
    if "lm_head.weight" not in src:  # GPT2Model: no head; GPT-2's head is the token embedding
        require(geometry.tie_head, "a GPT2Model state dict has no lm_head.weight, so the head must be tied")
        src["lm_head.weight"] = src.get("wte.weight")
    check_keys(src, _gpt2_keys(geometry), "GPT-2 state dict")
    out: dict[str, torch.Tensor] = {}
    for z, h, kind in _gpt2_modules(geometry, ""):
        if kind == "qkv":
            q, k, v = rearrange(src[h + ".weight"], "d (three o) -> three o d", three=3)
            qb, kb, vb = split_qkv_rows(src[h + ".bias"])
            for name, w, b in zip(_QKV, (q, k, v), (qb, kb, vb)):
                out[f"{z}{name}.weight"], out[f"{z}{name}.bias"] = w, b
        elif kind == "conv1d":
            out[f"{z}.weight"] = src[f"{h}.weight"].t()
            out[f"{z}.bias"] = src[f"{h}.bias"]
        else:
            copy_linear(out, z, src, h, bias=kind == "norm")
    head = src["lm_head.weight"]
    if geometry.tie_head:
        # A tied zoo model has one matrix; refuse a checkpoint whose head differs from its embedding.
        require(head is src["wte.weight"] or torch.equal(head, src["wte.weight"]),
                 "tie_head=True but lm_head.weight differs from transformer.wte.weight")
        head = src["wte.weight"]
    out["lm_head.weight"] = head
    return {k: v.contiguous() for k, v in out.items()}


def zoo_to_gpt2(state: State, geometry: Geometry) -> dict[str, torch.Tensor]:
    """DecoderOnly state dict -> GPT2LMHeadModel state dict (the inverse of ``gpt2_to_zoo``)."""
    _gpt2_compatible(geometry)
    modules = _gpt2_modules(geometry, "transformer.")
    zoo_keys = {"lm_head.weight"} | {f"{z}{name}{suffix}" for z, _, kind in modules
                                     for name in (_QKV if kind == "qkv" else ("",))
                                     for suffix in ((".weight",) if kind == "weight" else (".weight", ".bias"))}
    check_keys(state, zoo_keys, "zoo DecoderOnly state dict")
    out: dict[str, torch.Tensor] = {}
    for z, h, kind in modules:
        if kind == "qkv":
            qkv = torch.stack([state[f"{z}{n}.weight"] for n in _QKV])
            out[h + ".weight"] = rearrange(qkv, "three o d -> d (three o)")
            out[h + ".bias"] = torch.cat([state[f"{z}{n}.bias"] for n in _QKV])
        elif kind == "conv1d":
            out[f"{h}.weight"] = state[f"{z}.weight"].t()
            out[f"{h}.bias"] = state[f"{z}.bias"]
        else:
            copy_linear(out, h, state, z, bias=kind == "norm")
    out["lm_head.weight"] = out["transformer.wte.weight"] if geometry.tie_head else state["lm_head.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def zoo_gpt2_from_hf(hf_model: nn.Module, *, device=None, dtype=None, kernel: str | Callable = "math") -> DecoderOnly:
    """A DecoderOnly with the geometry and weights of a Hugging Face GPT2LMHeadModel (or GPT2Model)."""
    geometry = gpt2_geometry(hf_model.config)
    model = geometry.build(device=device, dtype=dtype or dtype_of(hf_model), kernel=kernel)
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

