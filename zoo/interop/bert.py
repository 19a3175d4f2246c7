"""Hugging Face BertModel <-> zoo EncoderOnly (bert_to_zoo / zoo_to_bert, a pure renaming)."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from zoo.interop.geometry import (Geometry, State, check_keys, drop_buffers, dtype_of, require, strip_prefix,
                                  zoo_geometry)
from zoo.io.weights import load_state_dict_checked
from zoo.nn.models import EncoderOnly


# ----------------------------------------------------------------------------------------------- BERT

_BERT_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}


def bert_geometry(config) -> Geometry:
    """BertConfig -> the EncoderOnly geometry (post-norm, embedding LayerNorm, token types, pooler)."""
    require(isinstance(config.hidden_act, str) and config.hidden_act in _BERT_ACTIVATIONS,
             f"BERT hidden_act={config.hidden_act!r}: supported {sorted(_BERT_ACTIVATIONS)}")
    require(getattr(config, "position_embedding_type", "absolute") == "absolute",
             "only absolute (learned) BERT position embeddings have a zoo counterpart")
    require(not config.is_decoder and not getattr(config, "add_cross_attention", False),
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
    require(g.family == "encoder_only" and g.norm == "layernorm" and g.pos == "learned" and g.norm_placement == "post"
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
    src = drop_buffers(strip_prefix(state, "bert."), ("embeddings.position_ids", "embeddings.token_type_ids"))
    check_keys(src, names, "BERT state dict")
    return {zoo: src[hf] for hf, zoo in names.items()}


def zoo_to_bert(state: State, geometry: Geometry) -> dict[str, torch.Tensor]:
    """EncoderOnly state dict -> BertModel state dict (the inverse renaming)."""
    names = _bert_names(geometry)
    check_keys(state, names.values(), "zoo EncoderOnly state dict")
    return {hf: state[zoo] for hf, zoo in names.items()}


def hf_bert_config(geometry: Geometry, *, attn_implementation: str = "eager"):
    """The BertConfig of a BERT-shaped geometry."""
    from transformers import BertConfig

    g = geometry
    _bert_names(g)  # checks the geometry
    activation = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "relu": "relu"}
    require(g.activation in activation, f"BERT has no {g.activation!r} activation")
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
    model = geometry.build(device=device, dtype=dtype or dtype_of(hf_model), kernel=kernel)
    load_state_dict_checked(model, bert_to_zoo(hf_model.state_dict(), geometry), source="converted BERT weights")
    return model.train(hf_model.training)

