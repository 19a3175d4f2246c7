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
import warnings

import torch

from properties.adapters.declared import read_declared
from properties.adapters.moe import eager_experts_in_float64, routing as moe_routing
from properties.adapters.probe import absolute_position_tables, reached_parameters
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


def _rotary(model) -> tuple[bool, bool]:
    """(rotary positions?, backed by a fixed table?): GPT-J's and CodeGen's rotary modules index a sin/cos table of
    max_position_embeddings rows (``embed_positions``), so they cannot run past it."""
    rotary = [m for m in model.modules() if "Rotary" in type(m).__name__]
    return bool(rotary), any(isinstance(getattr(m, "embed_positions", None), torch.Tensor) for m in rotary)


def _regrows(model) -> bool:
    """A position table that grows to whatever length forward reaches (fairseq's sinusoidal tables, kept by XGLM,
    M2M100, FSMT: ``make_weights`` called again past the table's end): positions without a length limit."""
    return any(callable(getattr(m, "make_weights", None)) and torch.is_tensor(getattr(m, "weights", None))
               for m in model.modules())


def _alibi(model, config) -> bool:
    """ALiBi: Bloom (no position table at all), MPT (attn_config.alibi), Falcon (config.alibi)."""
    attn = getattr(config, "attn_config", None)
    return (getattr(config, "model_type", "") == "bloom" or bool(getattr(config, "alibi", False))
            or bool(getattr(attn, "alibi", False) if attn is not None and not isinstance(attn, dict)
                    else (attn or {}).get("alibi", False)))


# Positions carried by order alone (NoPE): state-space layers and causal attention without position codes; shifting every
# position changes nothing and any length is taken (the Jamba paper, §3: "we found that no explicit positional
# information is needed"; Mamba keeps none).
ORDER_ONLY = ("jamba", "mamba", "mamba2", "falcon_mamba")


def _relative(config) -> bool:
    """Positions that enter only as query-key offsets: T5's buckets, BERT's relative_key(_query), DeBERTa-v2's
    relative_attention when no absolute position is added to the input (position_biased_input False)."""
    return getattr(config, "relative_attention_num_buckets", None) is not None or \
        str(getattr(config, "position_embedding_type", "absolute")).startswith("relative") or \
        (bool(getattr(config, "relative_attention", False)) and not getattr(config, "position_biased_input", True))


# The names transformers' configs give their longest input: most models, GPT-2 / GPT-J, MPT, old GPT-2 checkpoints,
# ChatGLM and Falcon-style configs, XLNet-style and Marian-style.
LENGTH_NAMES = ("max_position_embeddings", "n_positions", "max_seq_len", "n_ctx", "seq_length", "max_sequence_length",
                "max_length_positions")


def _max_len(config):
    for name in LENGTH_NAMES:   # XLNet-style -1 ("no limit") is no length
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    # T5: no table; beyond max_distance all offsets share a bucket, so longer inputs add nothing new.
    return getattr(config, "relative_attention_max_distance", None)


def _windows(config) -> tuple[int | None, ...] | None:
    """Subject.window from the config: Mistral's / Qwen2's / Gemma 2's sliding_window (on the layers layer_types
    marks "sliding_attention", or on every layer), GPT-Neo's window_size on its "local" layers. In transformers a
    window W admits the W most recent keys, the query's own included (masking_utils.sliding_window_overlay)."""
    layers = next((getattr(config, n) for n in ("num_hidden_layers", "num_layers", "n_layer")
                   if isinstance(getattr(config, n, None), int)), None)
    kinds = getattr(config, "attention_layers", None)         # GPT-Neo: "global" / "local" per layer
    if kinds and isinstance(getattr(config, "window_size", None), int):
        return tuple(config.window_size if k == "local" else None for k in kinds)
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or isinstance(window, bool) or not getattr(config, "use_sliding_window", True):
        return None
    types = getattr(config, "layer_types", None)
    if types:
        windows = tuple(window if t == "sliding_attention" else None for t in types)
        return windows if any(w is not None for w in windows) else None
    return (window,) * layers if layers else None


ATTENTION_NAMES = ("self_attn", "attn", "attention", "self_attention")


def _attention_modules(model, layers: int | None) -> tuple | None:
    """Each layer's self-attention module: the children named like one in the first ModuleList of ``layers``
    blocks (Llama's ``layers[i].self_attn``, GPT-2's and GPT-Neo's ``h[i].attn``, Falcon's ``self_attention``)."""
    if not layers:
        return None
    for stack in model.modules():
        if isinstance(stack, torch.nn.ModuleList) and len(stack) == layers:
            found = [next((getattr(block, n) for n in ATTENTION_NAMES
                           if isinstance(getattr(block, n, None), torch.nn.Module)), None) for block in stack]
            if all(m is not None for m in found):
                return tuple(found)
    return None


def _half_width(module) -> int | None:
    """Longformer's local window, an inclusive half-width: its self-attention (``attention.self``) attends
    ``one_sided_attn_window_size`` keys on either side of the query (config.attention_window // 2)."""
    return next((m.one_sided_attn_window_size for m in module.modules()
                 if isinstance(getattr(m, "one_sided_attn_window_size", None), int)), None)


def _module_windows(modules, encoder: bool) -> tuple[int | None, ...] | None:
    """The windows the attention modules declare themselves (transformers 5 sets ``sliding_window`` on each layer's
    attention: the config's window on sliding layers, None on the others), when every module declares one; for an
    encoder, Longformer's half-width h, which is the window h + 1 (h keys on either side and the query itself)."""
    if encoder and modules and all(_half_width(m) is not None for m in modules):
        return tuple(_half_width(m) + 1 for m in modules)
    if not modules or not all(hasattr(m, "sliding_window") for m in modules):
        return None
    # EXAONE 4 keeps the config's window on every layer's module and marks the windowed ones ``is_sliding``: its
    # global layers are called with sliding_window=None (modeling_exaone4.py), as its config's layer_types say.
    windows = tuple(m.sliding_window if isinstance(m.sliding_window, int) and m.sliding_window > 0
                    and getattr(m, "is_sliding", True) else None for m in modules)
    return windows if any(w is not None for w in windows) else None


SPECIAL_ID_NAMES = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id",
                    "cls_token_id")


def _special_ids(config) -> tuple[int, ...]:
    """The config's special token ids inside the vocabulary (eos may be a list), each once."""
    found = []
    for name in SPECIAL_ID_NAMES:
        value = getattr(config, name, None)
        for i in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < config.vocab_size:
                found.append(i)
    return tuple(dict.fromkeys(found))


def _declared(model, kind: str, window, relative: bool):
    """Subject.declared; a config the reading cannot follow is named, never guessed."""
    from properties.core.declared import Declared
    try:
        return read_declared(model, kind, window, relative)
    except Exception as exc:   # noqa: BLE001  an architecture the tables do not know may fail in any way
        first = str(exc).splitlines()[0] if str(exc) else ""
        return Declared(not_checked=(f"every declared setting (reading the config raised {type(exc).__name__}: "
                                     f"{first})",))


def _probe_output(model, kind: str, tokens, mask):
    """The output of forward as the Subject's forward gives it, for the probe: logits, else the hidden states."""
    inputs = dict(input_ids=tokens, attention_mask=_long(mask))
    if kind == "encoder_decoder":
        inputs.update(decoder_input_ids=tokens, decoder_attention_mask=_long(mask))
    out = model(**inputs)
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


def _unused(model, reached: set[str], declared) -> tuple[str, ...]:
    """Subject.unused_parameters: the declared ones, and the trainable parameters forward did not reach when they
    are a pooler's (pooler_output is not what forward returns); any other unreached one stops with one line."""
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    unreached = [name for name in trainable if name not in reached]
    if declared == "unreached":
        return tuple(unreached)
    if isinstance(declared, str):
        raise SubjectError(f"hf_subject: unused_parameters={declared!r}: expected a tuple of parameter names or "
                           f"'unreached'")
    pooler = tuple(n for n in unreached if "pooler" in n.split(".")[:-1] and n not in declared)
    undeclared = [n for n in unreached if n not in declared and n not in pooler]
    if undeclared:
        raise SubjectError(f"hf_subject: forward does not reach {len(undeclared)} of {len(trainable)} parameters "
                           f"({', '.join(undeclared[:3])}{', ...' if len(undeclared) > 3 else ''}); if it does not "
                           f"use them by design, pass unused_parameters='unreached' (or their names)")
    return tuple(declared) + pooler


def hf_subject(model, *, kind: str | None = None, pad_id: int | None = None, left_padding: bool | None = None,
               max_len: int | None = None, decode: bool = True, positional: bool = True,
               extrapolates: bool | None = None, relative_positions: bool | None = None,
               window: tuple[int | None, ...] | None = None, edges: tuple[int, ...] = (),
               unused_parameters: tuple[str, ...] | str = (), attention_modules: tuple | None = None,
               routing_top_k: bool | None = None, routing_normalized: bool | None = None) -> Subject:
    """The Subject of a transformers model (already built; put in eval mode here).

    kind: "decoder_only" (a model that generates), "encoder_decoder" (config.is_encoder_decoder) or
    "encoder_only" (the rest: last_hidden_state, or logits of a head). pad_id: config.pad_token_id, else 0.
    max_len: max_position_embeddings / n_positions, T5's relative_attention_max_distance.
    left_padding: decoders True (position ids from the mask, or positions that are relative), encoders and
    encoder-decoders only when their positions are relative (T5) or counted over the non-pad tokens (RoBERTa;
    BERT's, BART's and Marian's are counted from column 0).
    extrapolates: True for rotary, ALiBi and relative positions (no table to run past), False for a rotary module
    backed by a fixed table (GPT-J, CodeGen) and for absolute positions. relative_positions: rotary (with dynamic NTK
    or LongRoPE scaling, below the length past which the frequencies change), ALiBi and relative positions (MODEL-SHIFT
    then requires shifted inputs to give the same outputs). window: per layer,
    from sliding_window / layer_types / GPT-Neo's window_size (MODEL-WINDOW). edges: more lengths for the long
    draws (a cache block). decode=False: no decode_step (MODEL-KV-CACHE is then skipped). Models whose forward
    takes position_ids get ``shifted`` (MODEL-SHIFT): the same position ids plus the offset.
    unused_parameters: names of parameters forward does not use by design (MODEL-GRADIENT leaves them out), or
    "unreached": every parameter that a probe forward pass does not reach. The probe (properties/adapters/probe.py)
    declares an unreached pooler by itself (forward returns the hidden states or a head's logits, not
    pooler_output) and stops with one line naming the others; a learned absolute position table that it reaches
    makes the positions absolute, whatever relative bias the config names besides (MPNet).
    attention_modules: each layer's self-attention module (found as ``layers[i].self_attn`` and the like), which
    lets MODEL-WINDOW check each windowed layer alone; the windows the modules declare (``sliding_window``) take
    precedence over the config's. routing_top_k, routing_normalized: the rule of the mixture-of-experts routers
    (MODEL-ROUTING), read from the router (one weight: top-k of its logits) and the config's ``norm_topk_prob``.
    A float64 copy of an MoE model runs its experts eagerly (grouped_mm refuses float64 on the CPU).
    """
    transformers = require_transformers()
    if not isinstance(model, transformers.PreTrainedModel):
        raise SubjectError(f"hf_subject: expected a transformers.PreTrainedModel, got {type(model).__qualname__}")
    model.eval()
    config = model.config
    kind = kind or _kind(model)
    rotary, tabulated = _rotary(model)
    alibi = _alibi(model, config)
    # Rotary positions enter as offsets; dynamic NTK and LongRoPE rescale the frequencies past a length
    # (Subject.declared's length_thresholds), below which MODEL-SHIFT keeps its shifted positions.
    order_only = getattr(config, "model_type", "") in ORDER_ONLY
    relative = rotary or alibi or _relative(config) or order_only
    # MPT builds its ALiBi bias for max_seq_len positions in every forward pass: a table it cannot run past.
    tabulated = tabulated or (alibi and getattr(config, "model_type", "") == "mpt")
    # RoBERTa's embeddings count positions over the non-pad tokens, from padding_idx + 1 on.
    counted = getattr(getattr(getattr(model, "base_model", model), "embeddings", None), "padding_idx", None)
    if left_padding is None and counted is not None:
        left_padding = True
    table = _max_len(config)
    max_len = max_len or (table - counted - 1 if counted is not None and table else table)
    if max_len is None:
        raise SubjectError(f"hf_subject: {type(config).__name__} names no maximum length (none of "
                           f"{', '.join(LENGTH_NAMES)}); pass max_len=")
    pad = getattr(config, "pad_token_id", None) if pad_id is None else pad_id
    try:
        reached = reached_parameters(model, lambda tokens, mask: _probe_output(model, kind, tokens, mask),
                                     min(8, max_len))
    except Exception as exc:   # a forward the probe's plain call does not fit: every parameter counts as read
        warnings.warn(f"hf_subject: the parameter-reach probe could not call {type(model).__name__} "
                      f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); every parameter "
                      f"counts as read (pass unused_parameters= if MODEL-GRADIENT names one the forward never uses)",
                      stacklevel=2)
        reached = {name for name, p in model.named_parameters() if p.requires_grad}
    if any(name in reached for name in absolute_position_tables(model)):
        # Positions of two kinds (MPNet: an absolute table added to the input and relative buckets): the absolute
        # table decides; shifted inputs differ and the table ends at max_len (unless it regrows).
        relative, tabulated = False, not _regrows(model)
    unused_parameters = _unused(model, reached, unused_parameters)
    if extrapolates is None:   # None for a model without positions: the suite then accepts either outcome
        # Rotary tables computed per call (dynamic NTK and LongRoPE included) take any length.
        extrapolates = ((relative or rotary) and not tabulated) or _regrows(model) or order_only or \
            (False if positional else None)
    layers = next((getattr(config, n) for n in ("num_hidden_layers", "num_layers", "n_layer")
                   if isinstance(getattr(config, n, None), int)), None)
    found = _attention_modules(model, layers) if attention_modules is None else tuple(attention_modules)
    declared = _module_windows(found, kind == "encoder_only")
    if window is None and declared is None and kind == "encoder_only" and _windows(config) is not None:
        # transformers' sliding_window counts the W most recent keys of a causal stack; a bidirectional stack's
        # config may give a half-width instead (ModernBERT's is local_attention // 2; its modules say h + 1).
        raise SubjectError(f"hf_subject: {type(config).__name__} gives a sliding window for a bidirectional stack "
                           f"and its attention modules declare none, so whether it counts keys on either side "
                           f"is unknown; pass window= (per layer: W - 1 keys on either side, or None)")
    window = window if window is not None else declared or _windows(config)
    common = dict(vocab_size=config.vocab_size, max_len=max_len, positional=positional,
                  pad_id=0 if pad is None else pad, special_ids=_special_ids(config), module=model,
                  extrapolates=extrapolates,
                  relative_positions=relative if relative_positions is None else relative_positions,
                  window=window, edges=tuple(edges),
                  attention_modules=found if window is not None and found and len(found) == len(window) else None,
                  routing=moe_routing(model, top_k=routing_top_k, normalized=routing_normalized),
                  declared=_declared(model, kind, window, relative))

    def run(**inputs):
        eager_experts_in_float64(model)   # the suite's float64 twin: cast after this subject was made
        return model(**inputs)

    takes_positions = "position_ids" in inspect.signature(model.forward).parameters

    def shifted_positions(tokens, mask, offset):
        """position_ids of forward (counted over the real tokens for a decoder, columns for an encoder) + offset."""
        if kind == "decoder_only" and mask is not None:
            return _positions(mask, tokens.shape[1]) + offset
        return torch.arange(offset, offset + tokens.shape[1], device=tokens.device).expand(tokens.shape[0], -1)

    if kind == "encoder_only":
        def forward(tokens, mask, position_ids=None):
            extra = {} if position_ids is None else {"position_ids": position_ids}
            out = run(input_ids=tokens, attention_mask=_long(mask), **extra)
            return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state

        def shifted(tokens, mask, offset):
            return forward(tokens, mask, shifted_positions(tokens, mask, offset))
        return Subject("encoder_only", lambda tokens, mask: forward(tokens, mask), **common,
                       embedding=model.get_input_embeddings(), shifted=shifted if takes_positions else None,
                       left_padding=relative if left_padding is None else left_padding,
                       unused_parameters=unused_parameters)

    if kind == "decoder_only":
        def positions(mask, new):
            return {"position_ids": _positions(mask, new)} if takes_positions else {}

        def forward(tokens, mask):
            return run(input_ids=tokens, attention_mask=_long(mask), **positions(mask, tokens.shape[1])).logits

        def shifted(tokens, mask, offset):
            return run(input_ids=tokens, attention_mask=_long(mask),
                         position_ids=shifted_positions(tokens, mask, offset)).logits

        def decode_step(tokens, mask, state):
            out = run(input_ids=tokens, attention_mask=_long(mask), past_key_values=state, use_cache=True,
                        **positions(mask, tokens.shape[1]))
            return out.logits, out.past_key_values
        return Subject("decoder_only", forward, **common, embedding=model.get_input_embeddings(),
                       unused_parameters=unused_parameters,
                       decode_step=decode_step if decode else None, shifted=shifted if takes_positions else None,
                       left_padding=(takes_positions or relative) if left_padding is None else left_padding)

    if kind != "encoder_decoder":
        raise SubjectError(f"hf_subject: kind={kind!r}: expected 'decoder_only', 'encoder_only' or 'encoder_decoder'")

    def forward(src, tgt, src_mask, tgt_mask):
        return run(input_ids=src, attention_mask=_long(src_mask), decoder_input_ids=tgt,
                     decoder_attention_mask=_long(tgt_mask)).logits

    def decode_step(src, tgt, src_mask, tgt_mask, state):
        # state: the encoder's output, computed on the first call, and the decoder's cache.
        encoded, cache = state or (model.get_encoder()(input_ids=src, attention_mask=_long(src_mask)), None)
        out = run(encoder_outputs=encoded, attention_mask=_long(src_mask), decoder_input_ids=tgt,
                    decoder_attention_mask=_long(tgt_mask), past_key_values=cache, use_cache=True)
        return out.logits, (encoded, out.past_key_values)
    embedding = getattr(model.get_decoder(), "embed_tokens", None)  # BART's, T5's: not the shared module
    return Subject("encoder_decoder", forward, **common,
                   embedding=model.get_input_embeddings() if embedding is None else embedding,
                   decode_step=decode_step if decode else None, unused_parameters=unused_parameters,
                   left_padding=relative if left_padding is None else left_padding)
