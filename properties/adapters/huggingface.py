"""A Hugging Face transformers model as a suite Subject, in one call::

    from transformers import LlamaConfig, LlamaForCausalLM
    from properties.adapters import hf_subject

    def llama():
        return hf_subject(LlamaForCausalLM(LlamaConfig(...)).eval())

    pytest properties/ -m model --model my_file.py:llama

Everything is read from the model and its config; each keyword overrides one guess. Masks: the suite's
True = real token is HF's attention_mask 1. Decoders get position ids counted over the real tokens
(cumsum of the mask - 1), so that left padding moves no real position, whatever the position scheme.
"""
from __future__ import annotations

import inspect

from properties.core.subject import Subject, SubjectError

__all__ = ["hf_subject", "require_transformers"]

EXTRA = "pip install 'transformer-zoo[hf]'"


def require_transformers():
    """The transformers module, or a one-line ImportError naming the extra that installs it."""
    try:
        import transformers
    except ImportError:
        raise ImportError(f"Hugging Face transformers is not installed: {EXTRA}") from None
    return transformers


def _long(mask):
    return None if mask is None else mask.long()


def _positions(mask, new: int):
    """Position ids of the last `new` columns counted over real tokens (padded columns get 0)."""
    return None if mask is None else (mask.long().cumsum(-1) - 1).clamp(min=0)[:, -new:]


def _kind(model) -> str:
    if getattr(model.config, "is_encoder_decoder", False):
        return "encoder_decoder"
    if model.can_generate() or getattr(model.config, "is_decoder", False):
        return "decoder_only"
    return "encoder_only"


def _rotary(model) -> bool:
    return any("Rotary" in type(m).__name__ for m in model.modules())


def _relative(config) -> bool:
    """Positions that enter only as query-key offsets: T5's buckets, BERT's relative_key(_query)."""
    return getattr(config, "relative_attention_num_buckets", None) is not None or \
        str(getattr(config, "position_embedding_type", "absolute")).startswith("relative")


def _max_len(config):
    for name in ("max_position_embeddings", "n_positions", "max_length_positions"):
        if isinstance(getattr(config, name, None), int):
            return getattr(config, name)
    # T5: no table; beyond max_distance all offsets share a bucket, so longer inputs add nothing new.
    return getattr(config, "relative_attention_max_distance", None)


def hf_subject(model, *, kind: str | None = None, pad_id: int | None = None, left_padding: bool | None = None,
               max_len: int | None = None, decode: bool = True, positional: bool = True,
               extrapolates: bool | None = None) -> Subject:
    """The Subject of a transformers model (already built; put in eval mode here).

    kind: "decoder_only" (a model that generates), "encoder_decoder" (config.is_encoder_decoder) or
    "encoder_only" (the rest: last_hidden_state, or logits of a head). pad_id: config.pad_token_id, else 0.
    max_len: max_position_embeddings / n_positions, T5's relative_attention_max_distance.
    left_padding: decoders True (position ids from the mask, or positions that are relative), encoders and
    encoder-decoders only when their positions are relative (T5) or counted over the non-pad tokens (RoBERTa;
    BERT's, BART's and Marian's are counted from column 0).
    extrapolates: True for rotary and relative positions (no table to run past). decode=False: no
    decode_step (MODEL-KV-CACHE is then skipped).
    """
    transformers = require_transformers()
    if not isinstance(model, transformers.PreTrainedModel):
        raise SubjectError(f"hf_subject: expected a transformers.PreTrainedModel, got {type(model).__qualname__}")
    model.eval()
    config = model.config
    kind = kind or _kind(model)
    relative = _rotary(model) or _relative(config)
    # RoBERTa's embeddings count positions over the non-pad tokens, from padding_idx + 1 on.
    counted = getattr(getattr(getattr(model, "base_model", model), "embeddings", None), "padding_idx", None)
    if left_padding is None and counted is not None:
        left_padding = True
    table = _max_len(config)
    max_len = max_len or (table - counted - 1 if counted is not None and table else table)
    if max_len is None:
        raise SubjectError(f"hf_subject: {type(config).__name__} names no maximum length; pass max_len=")
    pad = config.pad_token_id if pad_id is None else pad_id
    common = dict(vocab_size=config.vocab_size, max_len=max_len, positional=positional,
                  pad_id=0 if pad is None else pad, module=model,
                  # None for a model without positions: the suite then accepts either outcome past max_len.
                  extrapolates=(relative or (False if positional else None)) if extrapolates is None else extrapolates)
    takes_positions = "position_ids" in inspect.signature(model.forward).parameters

    if kind == "encoder_only":
        def forward(tokens, mask):
            out = model(input_ids=tokens, attention_mask=_long(mask))
            return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state
        # A base model (no head) gives last_hidden_state; its pooler (BERT's, RoBERTa's) makes pooler_output only.
        pooled = model is getattr(model, "base_model", model) and getattr(model, "pooler", None) is not None
        return Subject("encoder_only", forward, **common, embedding=model.get_input_embeddings(),
                       left_padding=relative if left_padding is None else left_padding,
                       unused_parameters=tuple(n for n, _ in model.named_parameters()
                                               if pooled and n.startswith("pooler.")))

    if kind == "decoder_only":
        def positions(mask, new):
            return {"position_ids": _positions(mask, new)} if takes_positions else {}

        def forward(tokens, mask):
            return model(input_ids=tokens, attention_mask=_long(mask), **positions(mask, tokens.shape[1])).logits

        def decode_step(tokens, mask, state):
            out = model(input_ids=tokens, attention_mask=_long(mask), past_key_values=state, use_cache=True,
                        **positions(mask, tokens.shape[1]))
            return out.logits, out.past_key_values
        return Subject("decoder_only", forward, **common, embedding=model.get_input_embeddings(),
                       decode_step=decode_step if decode else None,
                       left_padding=(takes_positions or relative) if left_padding is None else left_padding)

    if kind != "encoder_decoder":
        raise SubjectError(f"hf_subject: kind={kind!r}: expected 'decoder_only', 'encoder_only' or 'encoder_decoder'")

    def forward(src, tgt, src_mask, tgt_mask):
        return model(input_ids=src, attention_mask=_long(src_mask), decoder_input_ids=tgt,
                     decoder_attention_mask=_long(tgt_mask)).logits

    def decode_step(src, tgt, src_mask, tgt_mask, state):
        # state: the encoder's output, computed on the first call, and the decoder's cache.
        encoded, cache = state or (model.get_encoder()(input_ids=src, attention_mask=_long(src_mask)), None)
        out = model(encoder_outputs=encoded, attention_mask=_long(src_mask), decoder_input_ids=tgt,
                    decoder_attention_mask=_long(tgt_mask), past_key_values=cache, use_cache=True)
        return out.logits, (encoded, out.past_key_values)
    embedding = getattr(model.get_decoder(), "embed_tokens", None)  # BART's, T5's: not the shared module
    return Subject("encoder_decoder", forward, **common,
                   embedding=model.get_input_embeddings() if embedding is None else embedding,
                   decode_step=decode_step if decode else None,
                   left_padding=relative if left_padding is None else left_padding)
