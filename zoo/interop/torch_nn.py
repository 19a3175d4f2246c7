"""torch.nn.Transformer -> zoo EncoderDecoder, nn.MultiheadAttention -> zoo MultiHeadAttention."""
from __future__ import annotations

import math
import warnings
from typing import Callable

import torch
from torch import nn

from zoo.nn.attention import MultiHeadAttention
from zoo.nn.models import EncoderDecoder
from zoo.interop.geometry import Geometry, State, check_keys, copy_linear, dtype_of, require, split_qkv_rows
from zoo.io.weights import load_state_dict_checked


# ------------------------------------------------------------------------------- torch.nn.Transformer

def _textbook_positions(length: int, d_model: int) -> torch.Tensor:
    # The PyTorch tutorial's PositionalEncoding, written independently of zoo.nn.positional so that the
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
    require(getattr(layer, "activation_relu_or_gelu", 0) in kinds,
             f"nn.Transformer activation {layer.activation!r}: only relu and (exact) gelu have zoo counterparts")
    return kinds[layer.activation_relu_or_gelu]


def torch_transformer_geometry(transformer: nn.Transformer, vocab_size: int, max_len: int) -> Geometry:
    """Geometry of an EncoderDecoder computing nn.Transformer's stacks under the paper's front-end and head."""
    enc, dec = transformer.encoder, transformer.decoder
    require(isinstance(enc, nn.TransformerEncoder) and isinstance(dec, nn.TransformerDecoder),
             "custom encoder/decoder modules are not supported")
    first = enc.layers[0]
    attn = first.self_attn
    require(attn._qkv_same_embed_dim and attn.bias_k is None and not attn.add_zero_attn,
             "attention with kdim/vdim, bias_k/bias_v or add_zero_attn has no zoo counterpart")
    require((enc.norm is None) == (dec.norm is None),
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
    check_keys({k: v for k, v in state.items() if k.startswith(prefix)}, expected, "nn.MultiheadAttention state dict")
    out = {}
    for name, w in zip(("q_proj", "k_proj", "v_proj"), split_qkv_rows(state[prefix + "in_proj_weight"])):
        out[f"{out_prefix}{name}.weight"] = w
    if bias:
        for name, b in zip(("q_proj", "k_proj", "v_proj"), split_qkv_rows(state[prefix + "in_proj_bias"])):
            out[f"{out_prefix}{name}.bias"] = b
    copy_linear(out, out_prefix + "out_proj", state, prefix + "out_proj", bias=bias)
    return out


def zoo_attention_from_mha(mha: nn.MultiheadAttention, *, kernel: str | Callable = "math") -> MultiHeadAttention:
    """A MultiHeadAttention computing the same as ``mha`` (key_padding_mask inverted: True = real key)."""
    require(mha._qkv_same_embed_dim and mha.bias_k is None and not mha.add_zero_attn,
             "attention with kdim/vdim, bias_k/bias_v or add_zero_attn has no zoo counterpart")
    w = mha.in_proj_weight
    zoo = MultiHeadAttention(mha.embed_dim, mha.num_heads, bias=mha.in_proj_bias is not None, dropout=mha.dropout,
                             kernel=kernel, device=w.device, dtype=w.dtype)
    keys = [k for k in mha.state_dict() if k not in ("in_proj_weight", "in_proj_bias")]
    require(all(k.startswith("out_proj.") for k in keys), f"unexpected nn.MultiheadAttention parameters: {keys}")
    load_state_dict_checked(zoo, mha_to_zoo(mha.state_dict()), source="converted nn.MultiheadAttention weights")
    return zoo.train(mha.training)


def torch_transformer_to_zoo(state: State, geometry: Geometry, embedding: torch.Tensor) -> dict[str, torch.Tensor]:
    """nn.Transformer state dict + the (shared) embedding matrix -> EncoderDecoder state dict."""
    require(geometry.family == "encoder_decoder" and geometry.share_embeddings and geometry.tie_head,
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
    check_keys(state, expected + list(names), "nn.Transformer state dict")

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
    model = geometry.build(device=device, dtype=dtype or dtype_of(reference), kernel=kernel)
    load_state_dict_checked(model, torch_transformer_to_zoo(reference.transformer.state_dict(), geometry,
                                                            reference.embedding.weight.detach()),
                            source="converted nn.Transformer weights")
    return model.train(reference.training)

