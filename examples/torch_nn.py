"""torch.nn.TransformerEncoder and torch.nn.Transformer with embeddings, as suite subjects.

    pytest properties/ -m model --model examples/torch_nn.py:encoder
    pytest properties/ -m model --model examples/torch_nn.py:transformer

torch.nn's key padding masks say True = IGNORE this key, the opposite of the suite's True = real
token: the models below pass ``~mask``.
"""
from __future__ import annotations

import torch
from torch import nn

from properties import Subject

VOCAB, MAX_LEN, D = 64, 16, 32


def _ignore(mask):
    return None if mask is None else ~mask


class Encoder(nn.Module):
    """BERT-like: token + learned position embeddings, then nn.TransformerEncoder (post-norm)."""

    def __init__(self):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(VOCAB, D), nn.Embedding(MAX_LEN, D)
        layer = nn.TransformerEncoderLayer(D, nhead=2, dim_feedforward=64, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2)

    def forward(self, tokens, mask=None):
        x = self.tokens(tokens) + self.positions(torch.arange(tokens.shape[1], device=tokens.device))
        return self.encoder(x, src_key_padding_mask=_ignore(mask))


class Seq2Seq(nn.Module):
    """Vaswani-like: one embedding for source, target and output, learned positions, nn.Transformer."""

    def __init__(self):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(VOCAB, D), nn.Embedding(MAX_LEN, D)
        self.transformer = nn.Transformer(D, nhead=2, num_encoder_layers=2, num_decoder_layers=2,
                                          dim_feedforward=64, dropout=0.1, batch_first=True)

    def embed(self, tokens):
        return self.tokens(tokens) * D ** 0.5 + self.positions(torch.arange(tokens.shape[1], device=tokens.device))

    def forward(self, src, tgt, src_mask=None, tgt_mask=None):
        l = tgt.shape[1]
        future = torch.ones(l, l, dtype=torch.bool, device=tgt.device).triu(1)  # True = may NOT attend
        out = self.transformer(self.embed(src), self.embed(tgt), tgt_mask=future, tgt_is_causal=True,
                               src_key_padding_mask=_ignore(src_mask), tgt_key_padding_mask=_ignore(tgt_mask),
                               memory_key_padding_mask=_ignore(src_mask))
        return out @ self.tokens.weight.T  # output projection tied to the embedding


def encoder() -> Subject:
    model = Encoder().eval()
    return Subject("encoder_only", model, VOCAB, MAX_LEN, module=model, embedding=model.tokens)


def transformer() -> Subject:
    model = Seq2Seq().eval()
    return Subject("encoder_decoder", model, VOCAB, MAX_LEN, module=model, embedding=model.tokens)
