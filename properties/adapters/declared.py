"""``Subject.declared`` of a transformers model: what its config declares about each attention layer, norm,
feed-forward network and mixture-of-experts block, and the modules that must compute it (properties/core/declared.py;
the clauses: properties/model/test_declared.py).

The config names the numbers (heads, head_dim, eps, rope_parameters, query_pre_attn_scalar, attention_multiplier,
attn_logit_softcapping, sliding_window and layer_types, hidden_act, norm_topk_prob, n_group, ...). What a config does
not name but an architecture fixes is stated once, in the tables below, each with its source: Gemma's (1 + w) norms,
the interleaved rotary pairs of Cohere and GLM, the global layers without rotary of Cohere 2 and EXAONE 4, the
routing rule of each mixture-of-experts family. A part whose weights the adapter cannot read, or whose module holds
parameters the oracle does not use, is listed in ``not_checked`` with the reason, never checked against a guess.
"""
from __future__ import annotations

import inspect
import re

import torch
from torch import nn

from properties.adapters.moe import moe_blocks, routing_rule
from properties.adapters.probe import absolute_position_tables
from properties.core.declared import Attention, Declared, Ends, Experts, FeedForward, Norm
from properties.core.rotary import SCALINGS, Rotary

__all__ = ["read_declared", "UNIT_OFFSET_NORMS", "INTERLEAVED_ROTARY", "GLOBAL_LAYERS_WITHOUT_ROTARY", "ACTIVATION_NAMES"]

# Gemma's RMSNorm scales by (1 + w), its weight stored as w (Gemma's reference implementation, gemma_pytorch
# ``RMSNorm(add_unit_offset=True)``; transformers' GemmaRMSNorm ``output * (1.0 + self.weight)``).
UNIT_OFFSET_NORMS = ("gemma", "gemma2", "gemma3", "gemma3_text", "recurrent_gemma")
# Rotary pairs (2i, 2i + 1) instead of (i, i + d/2): GPT-J's layout, kept by Cohere (Command R), GLM-4 and Ernie 4.5
# (transformers' rotate_half over x[..., 0::2], x[..., 1::2] in these models).
INTERLEAVED_ROTARY = ("cohere", "cohere2", "glm", "glm4", "ernie4_5", "ernie4_5_moe")
# Interleaved attention whose global layers take no positions (NoPE) while the sliding ones rotate: Cohere's Command
# R7B (Cohere 2) and EXAONE 4 (their model cards: "sliding window attention with RoPE, global attention without
# positional embeddings"; transformers applies rotary only where the layer has a sliding window).
GLOBAL_LAYERS_WITHOUT_ROTARY = ("cohere2", "exaone4")
# transformers' ACT2FN names -> the oracle's activations (activations.py: gelu_new, gelu_fast and gelu_pytorch_tanh
# are GELU's tanh form; silu and swish are x·sigmoid(x)).
ACTIVATION_NAMES = {"relu": "relu", "gelu": "gelu", "gelu_python": "gelu", "gelu_new": "gelu_tanh",
                    "gelu_fast": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "silu": "silu", "swish": "silu"}
# Config fields that scale, cap or temper something (their names say so) and that the reading below does not use:
# named when set to anything but a neutral value; one that speaks of attention (Llama 4's attn_scale, Falcon-H1's
# attention_in_multiplier, ...) keeps the attention layers from being checked against a scale it would change.
READ_FIELDS = ("query_pre_attn_scalar", "attention_multiplier", "attn_logit_softcapping", "routed_scaling_factor",
               "scale_attn_weights")
ENDS_FIELDS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "embedding_multiplier")
# Gemma scales its token embeddings by √hidden_size (Gemma report §2, "we multiply the embeddings by √d_model";
# transformers' GemmaTextScaledWordEmbedding).
SCALED_EMBEDDINGS = ("gemma", "gemma2", "gemma3", "gemma3_text")
SCALING_FIELD = re.compile(r"scal|multiplier|temperature|softcap|soft_cap|logit_cap")
ATTENTION_FIELD = re.compile(r"attn|attention|query|qk|key_")
NEUTRAL = (None, False, 0, 1)
RMS_EPS = ("rms_norm_eps",)
LAYER_EPS = ("layer_norm_eps", "layer_norm_epsilon", "norm_epsilon", "norm_eps")
ATTENTION_PARTS = {"q_proj", "k_proj", "v_proj", "o_proj", "out_proj", "dense", "qkv_proj", "q_norm", "k_norm",
                   "q_layernorm", "k_layernorm"}


def _int(config, *names):
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _linear(module, name):
    part = getattr(module, name, None)
    return part if isinstance(part, nn.Linear) else None


def _pair(layer: nn.Linear, rows: slice | None = None):
    weight = layer.weight if rows is None else layer.weight[rows]
    bias = layer.bias if layer.bias is None or rows is None else layer.bias[rows]
    return weight, bias


def _parameterised_children(module: nn.Module, known: set[str]) -> list[str]:
    """Names of the module's own parameters and of its children holding parameters, other than ``known``."""
    own = [name for name, _ in module.named_parameters(recurse=False)]
    children = [name for name, child in module.named_children()
                if name not in known and any(True for _ in child.parameters())]
    return own + children


# ------------------------------------------------------------------------------------------------------- norms
def _single_input(module: nn.Module) -> bool:
    try:
        params = [p for p in inspect.signature(module.forward).parameters.values()
                  if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return False
    return len(params) == 1


def _norm_kind(module: nn.Module, model_type: str) -> str | None:
    """"rms", "layer" or None (not a norm this adapter knows): torch's own classes, else the class name (T5's
    T5LayerNorm, and its kin, is an RMSNorm: T5 paper §2.1, "only rescaled and no additive bias")."""
    for torch_norm, kind in ((nn.LayerNorm, "layer"), (getattr(nn, "RMSNorm", ()), "rms")):
        if isinstance(module, torch_norm):   # a subclass with a forward of its own (SqueezeBERT's, channels first)
            return kind if type(module).forward is torch_norm.forward else None
    name = type(module).__name__
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() not in (1, 2) or not _single_input(module):
        return None
    if "RMSNorm" in name or name.endswith("RMSNorm") or (name == "T5LayerNorm") or \
            (model_type in ("t5", "mt5", "umt5", "longt5") and name.endswith("LayerNorm")):
        return "rms"
    if name.endswith("LayerNorm"):
        return "layer"
    return None


def _eps(config, kind: str, model_type: str):
    names = RMS_EPS if kind == "rms" else LAYER_EPS
    if kind == "rms" and model_type in ("t5", "mt5", "umt5", "longt5"):
        names = ("layer_norm_epsilon",)
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value), name
    return None, None


def _norms(model: nn.Module, config, model_type: str, not_checked: list) -> dict[int, Norm]:
    """Every norm module, by id, with its declared formula."""
    found, missing = {}, set()
    for name, module in model.named_modules():
        kind = _norm_kind(module, model_type)
        if kind is None:
            if isinstance(module, nn.LayerNorm):
                missing.add(f"{type(module).__name__} (a LayerNorm with a forward of its own)")
            continue
        eps, _ = _eps(config, kind, model_type)
        if eps is None:
            missing.add(f"{type(module).__name__} (the config names no {' or '.join(RMS_EPS if kind == 'rms' else LAYER_EPS)})")
            continue
        found[id(module)] = Norm(name, module, kind, eps, unit_offset=model_type in UNIT_OFFSET_NORMS)
    not_checked += [f"the norm {m}" for m in sorted(missing)]
    return found


# ---------------------------------------------------------------------------------------------------- rotary
def _rope_parameters(config, layer_type: str | None) -> dict | None:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(params, dict):
        theta = getattr(config, "rope_theta", None)
        return {"rope_type": "default", "rope_theta": theta} if theta else None
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        return params[layer_type]
    if any(isinstance(v, dict) for v in params.values()):   # nested by layer type, this one absent
        return None
    return params


def _rotary(config, model_type: str, layer: int, head_dim: int, window,
            has_rotary: bool) -> tuple[Rotary | None, str | None]:
    """(the layer's rotary embedding or None, why it cannot be read)."""
    types = getattr(config, "layer_types", None)
    layer_type = types[layer] if isinstance(types, (list, tuple)) and layer < len(types) else None
    flags = getattr(config, "no_rope_layers", None)    # SmolLM3, Llama 4: 1 = the layer uses rotary
    if isinstance(flags, (list, tuple)) and layer < len(flags) and not flags[layer]:
        return None, None
    if model_type in GLOBAL_LAYERS_WITHOUT_ROTARY and getattr(config, "sliding_window", None) and window is None:
        return None, None
    params = _rope_parameters(config, layer_type)
    if params is None and not has_rotary:   # no rotary table anywhere and none declared: positions from order only
        return None, None
    if params is None:
        return None, f"rotary parameters of layer {layer} (no rope_parameters{f' for {layer_type}' if layer_type else ''})"
    kind = str(params.get("rope_type") or params.get("type") or "default")
    if kind not in SCALINGS:
        return None, f"rotary scaling {kind!r}"
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None)) or 1.0
    dim = int(head_dim * partial)
    dim -= dim % 2
    factors = {n: tuple(float(f) for f in params[n]) for n in ("short_factor", "long_factor") if params.get(n)}
    optional = {n: float(params[n]) for n in ("factor", "attention_factor", "mscale", "mscale_all_dim")
                if params.get(n) is not None}
    tuning = {n: float(params[n]) for n in ("beta_fast", "beta_slow", "low_freq_factor", "high_freq_factor")
              if params.get(n)}
    original = params.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings",
                                                                          None)
    base = params.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0
    try:
        return Rotary(dim=dim, base=float(base), kind=kind, interleaved=model_type in INTERLEAVED_ROTARY,
                      original_length=original, max_length=_int(config, "max_position_embeddings"),
                      truncate=bool(params.get("truncate", True)), **optional, **tuning, **factors), None
    except (TypeError, ValueError) as exc:
        return None, f"rotary parameters of layer {layer} ({exc})"


# ------------------------------------------------------------------------------------------------- attention
def _scale(config, head_dim: int) -> tuple[float, str]:
    scalar = getattr(config, "query_pre_attn_scalar", None)
    if isinstance(scalar, (int, float)) and scalar:
        return float(scalar) ** -0.5, f"query_pre_attn_scalar^-1/2 ({scalar})"
    multiplier = getattr(config, "attention_multiplier", None)
    if isinstance(multiplier, (int, float)) and multiplier:
        return float(multiplier), "attention_multiplier"
    if getattr(config, "scale_attn_weights", True) is False:   # GPT-2's and GPT-BigCode's switch for 1/√d
        return 1.0, "scale_attn_weights=False"
    return head_dim ** -0.5, f"head_dim^-1/2 ({head_dim})"


def _projections(module: nn.Module, heads: int, kv_heads: int, head_dim: int):
    """weights() of the module's projections, or (None, why)."""
    out = _linear(module, "o_proj") or _linear(module, "out_proj") or _linear(module, "dense")
    q, k, v = (_linear(module, n) for n in ("q_proj", "k_proj", "v_proj"))
    fused = _linear(module, "qkv_proj")
    if out is None or not ((q and k and v) or fused):
        return None, (f"{type(module).__name__}: no q_proj, k_proj, v_proj (or qkv_proj) and o_proj as nn.Linear")
    widths = (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)
    if fused is not None:
        if fused.weight.shape[0] != sum(widths):
            return None, f"{type(module).__name__}: qkv_proj has {fused.weight.shape[0]} rows, not {sum(widths)}"
        cuts = (slice(0, widths[0]), slice(widths[0], widths[0] + widths[1]), slice(widths[0] + widths[1], None))
        return (lambda: {"q": _pair(fused, cuts[0]), "k": _pair(fused, cuts[1]), "v": _pair(fused, cuts[2]),
                         "o": _pair(out)}), None
    if (q.weight.shape[0], k.weight.shape[0], v.weight.shape[0]) != widths:
        return None, (f"{type(module).__name__}: projections of {q.weight.shape[0]}, {k.weight.shape[0]}, "
                      f"{v.weight.shape[0]} rows for {heads} heads and {kv_heads} key/value heads of {head_dim}")
    return (lambda: {"q": _pair(q), "k": _pair(k), "v": _pair(v), "o": _pair(out)}), None


ATTENTION_NAMES = ("self_attn", "attn", "attention", "self_attention")


def _layer_attention(model: nn.Module, layers: int | None) -> list[tuple[int, nn.Module]]:
    """(layer, self-attention module) for the layers of the first ModuleList of ``layers`` blocks that have one
    (every layer of most decoders; the attention layers of a hybrid stack such as Jamba's)."""
    for stack in model.modules():
        if isinstance(stack, nn.ModuleList) and layers and len(stack) == layers:
            found = [(i, next((getattr(block, n) for n in ATTENTION_NAMES
                               if isinstance(getattr(block, n, None), nn.Module)), None)) for i, block in enumerate(stack)]
            found = [(i, m) for i, m in found if m is not None]
            if found:
                return found
    return []


def _attention(model, config, model_type, windows, norms, not_checked) -> tuple[Attention, ...]:
    heads = _int(config, "num_attention_heads", "n_head", "num_heads")
    hidden = _int(config, "hidden_size", "d_model", "n_embd")
    modules = _layer_attention(model, _int(config, "num_hidden_layers", "num_layers", "n_layer"))
    if not heads or not hidden or not modules:
        not_checked.append("the attention layers (no per-layer attention modules or head count found)")
        return ()
    kv_heads = _int(config, "num_key_value_heads", "num_kv_heads") or heads
    head_dim = _int(config, "head_dim") or hidden // heads
    scale, scale_from = _scale(config, head_dim)
    softcap = getattr(config, "attn_logit_softcapping", None)
    has_rotary = any(isinstance(getattr(m, "inv_freq", None), torch.Tensor) or
                     any(n.endswith("inv_freq") for n, _ in m.named_buffers(recurse=False)) for m in model.modules())
    layers = []
    for layer, module in modules:
        where = f"layer {layer}'s attention"
        weights, why = _projections(module, heads, kv_heads, head_dim)
        extra = _parameterised_children(module, ATTENTION_PARTS)
        if weights is None or extra:
            not_checked.append(f"{where} ({why or 'parameters the oracle does not read: ' + ', '.join(extra)})")
            continue
        window = windows[layer] if windows and layer < len(windows) else None
        rotary, why = _rotary(config, model_type, layer, head_dim, window, has_rotary)
        if why:
            not_checked.append(f"{where} ({why})")
            continue
        q_norm = next((getattr(module, n) for n in ("q_norm", "q_layernorm") if getattr(module, n, None) is not None),
                      None)
        k_norm = next((getattr(module, n) for n in ("k_norm", "k_layernorm") if getattr(module, n, None) is not None),
                      None)
        if (q_norm is not None and id(q_norm) not in norms) or (k_norm is not None and id(k_norm) not in norms):
            not_checked.append(f"{where} (its q/k norm's formula is not declared)")
            continue
        name = next(n for n, m in model.named_modules() if m is module)
        layers.append(Attention(name, module, heads, kv_heads, head_dim, scale, weights, window=window,
                                softcap=float(softcap) if softcap else None, rotary=rotary,
                                q_norm=norms.get(id(q_norm)), k_norm=norms.get(id(k_norm)),
                                why={"scale": scale_from}))
    return tuple(layers)


# ---------------------------------------------------------------------------------------------- feed-forward
def _activation(config) -> tuple[str | None, str]:
    for field in ("hidden_activation", "hidden_act", "activation_function"):
        name = getattr(config, field, None)
        if isinstance(name, str):
            return ACTIVATION_NAMES.get(name), name
    return None, "none"


FFN_LAYOUTS = (   # (names, gated): the projections of a feed-forward module, each an nn.Linear
    (("gate_proj", "up_proj", "down_proj"), True), (("gate_up_proj", "down_proj"), True),
    (("fc1", "fc2"), False), (("c_fc", "c_proj"), False), (("up_proj", "down_proj"), False))


def _ffn_weights(module: nn.Module, names: tuple[str, ...]):
    parts = [getattr(module, n) for n in names]
    if names[0] == "gate_up_proj":
        fused, down = parts
        inner = fused.weight.shape[0] // 2
        return lambda: {"gate": _pair(fused, slice(0, inner)), "up": _pair(fused, slice(inner, None)),
                        "down": _pair(down)}
    if len(parts) == 3:
        return lambda: {"gate": _pair(parts[0]), "up": _pair(parts[1]), "down": _pair(parts[2])}
    return lambda: {"up": _pair(parts[0]), "down": _pair(parts[1])}


def feed_forward_of(name: str, module: nn.Module, activation: str) -> FeedForward | None:
    """The FeedForward of a module holding exactly one of FFN_LAYOUTS' sets of projections, else None."""
    for names, gated in FFN_LAYOUTS:
        if all(_linear(module, n) is not None for n in names):
            if _parameterised_children(module, set(names)):
                return None
            return FeedForward(name, module, activation, gated, _ffn_weights(module, names))
    return None


def _feed_forward(model, config, not_checked, skip: set[int]) -> tuple[FeedForward, ...]:
    activation, named = _activation(config)
    found = []
    for name, module in model.named_modules():
        if id(module) in skip or not any(all(_linear(module, n) is not None for n in names)
                                         for names, _ in FFN_LAYOUTS):
            continue
        if activation is None:
            not_checked.append(f"the feed-forward networks (activation {named!r} has no oracle)")
            return ()
        ffn = feed_forward_of(name, module, activation)
        if ffn is not None:
            found.append(ffn)
    return tuple(found)


# ------------------------------------------------------------------------------------------ mixture of experts
def _experts(model, config, not_checked) -> tuple[tuple[Experts, ...], set[int]]:
    activation, named = _activation(config)
    found, inside = [], set()
    for name, block, router, experts in moe_blocks(model):
        rule, why = routing_rule(router, config)
        for module in block.modules():
            inside.add(id(module))
        params = {n for n, _ in experts.named_parameters()}
        shared = next(((n, getattr(block, n)) for n in ("shared_expert", "shared_experts")
                       if isinstance(getattr(block, n, None), nn.Module)), None)
        gate = _linear(block, "shared_expert_gate")
        known = {n for n, m in block.named_children() if m is router or m is experts} | \
            ({shared[0]} if shared else set()) | ({"shared_expert_gate"} if gate is not None else set())
        extra = _parameterised_children(block, known)
        router_params = {n for n, _ in router.named_parameters(recurse=False)}
        problem = (why if rule is None else
                   f"activation {named!r} has no oracle" if activation is None else
                   f"experts hold {sorted(params)}, not gate_up_proj and down_proj" if params != {"gate_up_proj",
                                                                                              "down_proj"} else
                   f"parameters the oracle does not read: {', '.join(extra)}" if extra else
                   f"router parameters {sorted(router_params)}" if not router_params <= {"weight", "bias"} else "")
        shared_ffn = None if shared is None else feed_forward_of(f"{name}.{shared[0]}", shared[1], activation or "silu")
        if not problem and shared is not None and shared_ffn is None:
            problem = f"its {shared[0]} is not a feed-forward network the adapter reads"
        if problem:
            not_checked.append(f"MoE block {name} ({problem})")
            continue
        found.append(Experts(name, block, rule, activation,
                             router=lambda r=router: (r.weight, getattr(r, "bias", None)),
                             experts=lambda e=experts: (e.gate_up_proj, e.down_proj), shared=shared_ffn,
                             shared_gate=None if gate is None else (lambda g=gate: _pair(g))))
    return tuple(found), inside


def _ends(model, config, model_type: str) -> Ends | None:
    """The embedding's scale and the head's logit transform of a decoder without absolute positions (its first layer
    receives the token embeddings alone), when the modules are found."""
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    layers = _int(config, "num_hidden_layers", "num_layers", "n_layer")
    stack = next((m for m in model.modules() if isinstance(m, nn.ModuleList) and layers and len(m) == layers), None)
    if absolute_position_tables(model) or not isinstance(head, nn.Linear) or stack is None or \
            not isinstance(getattr(embedding, "weight", None), torch.Tensor):
        return None
    hidden = _int(config, "hidden_size", "d_model", "n_embd")
    built = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    # Gemma's normalizer is √hidden_size in the model's dtype (its reference implementation; transformers #29402:
    # 55.4256 becomes 55.5 in bfloat16), so a bfloat16 model and its float64 twin scale by the rounded value.
    scale, scale_from = ((float(torch.tensor(hidden ** 0.5, dtype=built)), f"Gemma's √hidden_size in {built}")
                         if model_type in SCALED_EMBEDDINGS else
                         (float(getattr(config, "embedding_multiplier", 1.0) or 1.0), "embedding_multiplier"))
    logits = getattr(config, "logit_scale", None) or 1.0
    divisor = getattr(config, "logits_scaling", None) or 1.0
    cap = getattr(config, "final_logit_softcapping", None)
    return Ends(embedding, stack[0], head, embedding_scale=float(scale), logit_scale=float(logits) / float(divisor),
                logit_softcap=float(cap) if cap else None,
                why={"embedding": scale_from, "logits": "logit_scale / logits_scaling", "cap": "final_logit_softcapping"})


def _unread_fields(config, read=()) -> tuple[list[str], list[str]]:
    """(fields of the config that scale something and are not read, those of them that speak of attention)."""
    fields = config.to_dict() if hasattr(config, "to_dict") else vars(config)
    unread = [f"{k}={v}" for k, v in fields.items()
              if SCALING_FIELD.search(k) and "init" not in k and k not in READ_FIELDS + tuple(read)
              and not isinstance(v, (dict, str))
              and not any(v is n or (not isinstance(v, bool) and isinstance(v, (int, float)) and v == n and n is not None
                                     and not isinstance(n, bool)) for n in NEUTRAL)]
    return unread, [f for f in unread if ATTENTION_FIELD.search(f.split("=")[0])]


def read_declared(model: nn.Module, kind: str, windows, relative: bool = False) -> Declared:
    """The Declared of a transformers model (already built; its config at ``model.config``); ``windows``: each
    layer's sliding window as hf_subject read it (None: none); ``relative``: its positions enter as offsets or not at
    all (no absolute code is added to the embeddings)."""
    config = model.config
    model_type = str(getattr(config, "model_type", ""))
    not_checked: list[str] = []
    norms = _norms(model, config, model_type, not_checked)
    unread, about_attention = _unread_fields(config, ENDS_FIELDS)
    attention = ()
    if about_attention:
        not_checked.append(f"the attention layers (the config sets {', '.join(about_attention)}, which the reading "
                           f"does not use)")
    elif kind == "decoder_only":
        attention = _attention(model, config, model_type, windows, norms, not_checked)
    else:
        not_checked.append(f"the attention layers (an {kind.replace('_', '-')} model: causal self-attention only)")
    # The ends of a decoder whose layers the reading follows (its attention read) and whose embeddings carry no
    # absolute position code: its first layer receives the scaled token embeddings alone.
    ends = _ends(model, config, model_type) if attention and relative else None
    if ends is None:
        unread = [f for f in _unread_fields(config)[0] if f not in about_attention]
    experts, inside = _experts(model, config, not_checked)
    ffn = _feed_forward(model, config, not_checked, skip=inside - {id(e.shared.module) for e in experts if e.shared})
    not_checked += [f for f in unread if f not in about_attention]
    if ends is None and kind == "decoder_only":
        not_checked.append("the embedding's scale and the logits' transform (read for a decoder whose attention "
                           "layers are read, without absolute positions, with a linear head)")
    return Declared(attention=attention, norms=tuple(norms.values()), feed_forward=ffn, experts=experts, ends=ends,
                    not_checked=tuple(dict.fromkeys(not_checked)))
