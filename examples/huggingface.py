"""Hugging Face models as suite subjects, built offline from small random configs (no download).

    pytest properties/ -m model --model examples/huggingface.py:gpt2
    pytest properties/ -m model --model examples/huggingface.py:bert
    pytest properties/ -m model --model examples/huggingface.py:bart

properties.adapters.hf_subject reads everything else from the model: kind, vocabulary, length, pad id, the
token embedding, cached decoding with past_key_values, and (for decoders) position ids counted over the real
tokens, so that left padding moves nothing. examples/conformance.py has a dozen more architectures.
"""
from __future__ import annotations

from transformers import (BartConfig, BartForConditionalGeneration, BertConfig, BertModel, GPT2Config,
                          GPT2LMHeadModel)

from properties import Subject
from properties.adapters import hf_subject

VOCAB, MAX_LEN, PAD = 64, 16, 0
SPECIAL = dict(pad_token_id=PAD, bos_token_id=1, eos_token_id=2)


def gpt2() -> Subject:
    return hf_subject(GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=MAX_LEN, n_embd=32, n_layer=2, n_head=2,
                                                 **SPECIAL)))


def bert() -> Subject:
    return hf_subject(BertModel(BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                           intermediate_size=64, max_position_embeddings=MAX_LEN, type_vocab_size=1,
                                           pad_token_id=PAD)))  # its pooler: Subject.unused_parameters


def bart() -> Subject:
    return hf_subject(BartForConditionalGeneration(BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=MAX_LEN,
        decoder_start_token_id=2, forced_eos_token_id=None, **SPECIAL)))
