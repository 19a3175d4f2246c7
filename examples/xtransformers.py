"""lucidrains' x-transformers (``pip install x-transformers``) as suite subjects.

    pytest properties/ -m model --model examples/xtransformers.py:decoder
    pytest properties/ -m model --model examples/xtransformers.py:decoder_rotary
    pytest properties/ -m model --model examples/xtransformers.py:encoder

x-transformers' ``mask`` says True = real token, as the suite's does, so it is passed as it is. Its cache
decodes one token at a time, so no ``decode_step`` is given (MODEL-KV-CACHE is skipped with that reason).
"""
from __future__ import annotations

import torch
from x_transformers import Decoder, Encoder, TransformerWrapper

from properties import Subject

VOCAB, MAX_LEN = 64, 16


def _subject(kind: str, net: TransformerWrapper, **claims) -> Subject:
    net.eval()

    def forward(tokens, mask):
        return net(tokens, mask=mask)
    return Subject(kind, forward, vocab_size=VOCAB, max_len=MAX_LEN, module=net, **claims)


def decoder() -> Subject:
    """GPT-like: learned absolute positions (refuses inputs past max_seq_len with an AssertionError)."""
    torch.manual_seed(0)
    return _subject("decoder_only", TransformerWrapper(num_tokens=VOCAB, max_seq_len=MAX_LEN,
                                                       attn_layers=Decoder(dim=32, depth=2, heads=2)))


def decoder_rotary() -> Subject:
    """Rotary positions only: relative, so left padding leaves real positions alone and any length is valid."""
    torch.manual_seed(0)
    layers = Decoder(dim=32, depth=2, heads=2, rotary_pos_emb=True)
    return _subject("decoder_only", TransformerWrapper(num_tokens=VOCAB, max_seq_len=MAX_LEN, use_abs_pos_emb=False,
                                                       attn_layers=layers), left_padding=True, extrapolates=True)


def encoder() -> Subject:
    """BERT-like: bidirectional, learned absolute positions; outputs token logits."""
    torch.manual_seed(0)
    return _subject("encoder_only", TransformerWrapper(num_tokens=VOCAB, max_seq_len=MAX_LEN,
                                                       attn_layers=Encoder(dim=32, depth=2, heads=2)))
