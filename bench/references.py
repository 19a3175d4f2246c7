"""The reference implementations the zoo is timed against, built with the zoo model's geometry.

    encoder_decoder  TorchTransformerLM: torch.nn.Transformer (batch_first=True) with the zoo's
                     front end (shared token embedding x sqrt(d), sinusoidal positions) and a head
                     tied to the embedding
    decoder_only     transformers.GPT2LMHeadModel, attn_implementation="sdpa"
    encoder_only     transformers.BertModel (with pooler), attn_implementation="sdpa"

Every reference has dropout 0 and the same parameter count as the zoo model (checked on build).
Random weights: speed does not depend on trained values.
"""
from __future__ import annotations

import math

import torch
from omegaconf import DictConfig
from torch import nn

from zoo.nn.positional import sinusoidal_table

__all__ = ["REFERENCE_NAMES", "TorchTransformerLM", "build_reference"]

REFERENCE_NAMES = {
    "encoder_decoder": "torch.nn.Transformer (batch_first, + embedding/positions/tied head)",
    "decoder_only": "transformers.GPT2LMHeadModel (attn_implementation=sdpa)",
    "encoder_only": "transformers.BertModel (attn_implementation=sdpa)",
}


class TorchTransformerLM(nn.Module):
    """nn.Transformer between a scaled, shared token embedding with sinusoidal positions and a tied head."""

    def __init__(self, vocab_size: int, d_model: int, heads: int, layers: int, decoder_layers: int, d_ff: int,
                 max_len: int, eps: float = 1e-5, *, device=None, dtype=None):
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.embedding = nn.Embedding(vocab_size, d_model, **kw)
        self.register_buffer("positions", sinusoidal_table(max_len, d_model, device=device, dtype=dtype),
                             persistent=False)
        self.transformer = nn.Transformer(d_model, heads, layers, decoder_layers, d_ff, dropout=0.0,
                                          activation="relu", layer_norm_eps=eps, batch_first=True,
                                          norm_first=False, **kw)
        self.head = nn.Linear(d_model, vocab_size, bias=False, **kw)
        self.head.weight = self.embedding.weight
        self.scale = math.sqrt(d_model)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embedding(tokens) * self.scale + self.positions[: tokens.shape[1]]

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        length = tgt.shape[1]
        causal = nn.Transformer.generate_square_subsequent_mask(length, device=tgt.device,
                                                                dtype=self.embedding.weight.dtype)
        out = self.transformer(self.embed(src), self.embed(tgt), tgt_mask=causal, tgt_is_causal=True)
        return self.head(out)


def build_reference(family: str, cfg: DictConfig, *, device, dtype) -> nn.Module:
    """The reference for ``family`` with the geometry of the composed zoo config ``cfg``."""
    if family == "encoder_decoder":
        decoder_layers = cfg.model.decoder_layers if cfg.model.decoder_layers is not None else cfg.layers
        return TorchTransformerLM(cfg.vocab_size, cfg.d_model, cfg.heads, cfg.layers, decoder_layers, cfg.d_ff,
                                  cfg.max_len, cfg.norm.eps, device=device, dtype=dtype)
    import transformers

    if family == "decoder_only":
        config = transformers.GPT2Config(
            vocab_size=cfg.vocab_size, n_positions=cfg.max_len, n_embd=cfg.d_model, n_layer=cfg.layers,
            n_head=cfg.heads, n_inner=cfg.d_ff, activation_function="gelu_new", layer_norm_epsilon=cfg.norm.eps,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True,
            bos_token_id=cfg.vocab_size - 1, eos_token_id=cfg.vocab_size - 1,  # GPT-2's 50256 = vocab - 1
            attn_implementation="sdpa")
        model = transformers.GPT2LMHeadModel(config)
    elif family == "encoder_only":
        config = transformers.BertConfig(
            vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, num_hidden_layers=cfg.layers,
            num_attention_heads=cfg.heads, intermediate_size=cfg.d_ff, max_position_embeddings=cfg.max_len,
            type_vocab_size=cfg.model.type_vocab_size, layer_norm_eps=cfg.norm.eps, hidden_act="gelu",
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attn_implementation="sdpa")
        model = transformers.BertModel(config, add_pooling_layer=True)
    else:
        raise ValueError(f"unknown family {family!r}")
    if model.config._attn_implementation != "sdpa":
        raise RuntimeError(f"{type(model).__name__} runs {model.config._attn_implementation!r}, not sdpa")
    return model.to(device=device, dtype=dtype)
