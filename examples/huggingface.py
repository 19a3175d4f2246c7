"""Hugging Face models as suite subjects, built offline from small random configs (no download).

    pytest properties/ -m model --model examples/huggingface.py:gpt2
    pytest properties/ -m model --model examples/huggingface.py:bert
    pytest properties/ -m model --model examples/huggingface.py:bart

HF masks are attention_mask with 1 = real token, as the suite's (True = real): only the dtype changes.
"""
from __future__ import annotations

from transformers import (BartConfig, BartForConditionalGeneration, BertConfig, BertModel, GPT2Config,
                          GPT2LMHeadModel)

from properties import Subject

VOCAB, MAX_LEN, PAD = 64, 16, 0
SPECIAL = dict(pad_token_id=PAD, bos_token_id=1, eos_token_id=2)


def _long(mask):
    return None if mask is None else mask.long()


def gpt2() -> Subject:
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=MAX_LEN, n_embd=32, n_layer=2, n_head=2,
                                       **SPECIAL)).eval()

    def positions(mask, new):
        # Positions counted over real tokens, so that left padding moves nothing (GPT-2 itself
        # counts from the first column).
        return None if mask is None else (mask.long().cumsum(-1) - 1).clamp(min=0)[:, -new:]

    def forward(tokens, mask):
        return model(input_ids=tokens, attention_mask=_long(mask), position_ids=positions(mask, tokens.shape[1])).logits

    def decode_step(tokens, mask, state):
        out = model(input_ids=tokens, attention_mask=_long(mask), position_ids=positions(mask, tokens.shape[1]),
                    past_key_values=state, use_cache=True)
        return out.logits, out.past_key_values

    return Subject("decoder_only", forward, VOCAB, MAX_LEN, pad_id=PAD, module=model,
                   embedding=model.transformer.wte, decode_step=decode_step, left_padding=True)


def bert() -> Subject:
    model = BertModel(BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                 intermediate_size=64, max_position_embeddings=MAX_LEN, type_vocab_size=1,
                                 pad_token_id=PAD), add_pooling_layer=False).eval()  # the pooler is not in forward

    def forward(tokens, mask):
        return model(input_ids=tokens, attention_mask=_long(mask)).last_hidden_state

    return Subject("encoder_only", forward, VOCAB, MAX_LEN, pad_id=PAD, module=model,
                   embedding=model.embeddings.word_embeddings)


def bart() -> Subject:
    model = BartForConditionalGeneration(BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=MAX_LEN,
        decoder_start_token_id=2, forced_eos_token_id=None, **SPECIAL)).eval()

    def forward(src, tgt, src_mask, tgt_mask):
        return model(input_ids=src, attention_mask=_long(src_mask), decoder_input_ids=tgt,
                     decoder_attention_mask=_long(tgt_mask)).logits

    def decode_step(src, tgt, src_mask, tgt_mask, state):
        encoded, cache = state or (model.model.encoder(input_ids=src, attention_mask=_long(src_mask)), None)
        out = model(encoder_outputs=encoded, attention_mask=_long(src_mask), decoder_input_ids=tgt,
                    decoder_attention_mask=_long(tgt_mask), past_key_values=cache, use_cache=True)
        return out.logits, (encoded, out.past_key_values)

    return Subject("encoder_decoder", forward, VOCAB, MAX_LEN, pad_id=PAD, module=model,
                   embedding=model.model.decoder.embed_tokens, decode_step=decode_step)
