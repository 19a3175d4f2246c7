"""Mixture-of-experts layers of a transformers model, read from its modules: the routing they do (Subject.routing,
MODEL-ROUTING) and an expert implementation that runs in float64 (the suite's twin).

transformers 5 builds every MoE layer the same way: a block with a router and an experts module, the router giving
(logits, combine weights, expert indices) or the logits alone, the experts module taking
``(hidden_states, top_k_index, top_k_weights)`` (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3, GLM-4-MoE, MiniMax, ...).
The routing is read where the block hands it over: the router's first output (the logits) and the experts module's
arguments (what the outputs are combined with), so a bug anywhere between the two shows.
"""
from __future__ import annotations

import inspect
from contextlib import contextmanager
from dataclasses import replace

import torch
from torch import nn

from properties.core.hooks import first_output, hooks_in_place
from properties.core.routing import RoutingRule
from properties.core.subject import Route, SubjectError

__all__ = ["moe_blocks", "moe_layers", "routing_rule", "routing", "eager_experts_in_float64"]


def _is_experts(module: nn.Module) -> bool:
    """An experts module: forward(hidden_states, indices, weights), its weights 3-D (experts, out, in)."""
    if not any(p.dim() == 3 for p in module.parameters(recurse=False)):
        return False
    try:
        params = list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return False
    return len(params) >= 3 and params[0] == "hidden_states"


def _router(block: nn.Module, experts: nn.Module) -> nn.Module | None:
    """The block's child with a 2-D weight of one row per expert: its router."""
    count = next(p.shape[0] for p in experts.parameters(recurse=False) if p.dim() == 3)
    for child in block.children():
        weight = getattr(child, "weight", None)
        if child is not experts and torch.is_tensor(weight) and weight.dim() == 2 and weight.shape[0] == count:
            return child
    return None


def moe_blocks(model: nn.Module) -> list[tuple[str, nn.Module, nn.Module, nn.Module]]:
    """(name, block, router, experts) of every MoE block, in module order."""
    blocks = []
    for name, block in model.named_modules():
        for child in block.children():
            if _is_experts(child):
                router = _router(block, child)
                if router is not None:
                    blocks.append((name, block, router, child))
    return blocks


def moe_layers(model: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    """(router, experts) of every MoE block, in module order."""
    return [(router, experts) for _, _, router, experts in moe_blocks(model)]


# The routing rule of each family, as its paper and transformers' implementation state it (properties/core/routing.py):
# Mixtral (Jiang et al. 2024, eq. 1: softmax over the top-k logits) and GraniteMoE (softmax of its top-k logits)
# always renormalise over the chosen experts, whatever the config (Mixtral's has no norm_topk_prob); Qwen-MoE and
# OLMoE renormalise as norm_topk_prob says; Jamba keeps the chosen probabilities as they are (transformers'
# JambaTopKRouter: "the selected weights left unnormalized"); Ernie 4.5 chooses by softmax plus its
# e_score_correction_bias and divides by the chosen sum clamped at moe_norm_min; DeepSeek-V3 and GLM-4-MoE score by
# sigmoid, choose by score plus bias within the best topk_group of n_group groups, renormalise as norm_topk_prob says
# and scale by routed_scaling_factor (DeepSeek-V3 technical report, §2.1.2).
ALWAYS_RENORMALISED = ("mixtral", "granitemoe", "granitemoeshared", "granitemoehybrid")
RENORMALISED_AS_CONFIGURED = ("qwen2_moe", "qwen3_moe", "olmoe", "qwen3_vl_moe")
NOT_RENORMALISED = ("jamba",)
BIASED_SOFTMAX = ("ernie4_5_moe",)
GROUPED_SIGMOID = ("deepseek_v3", "glm4_moe", "glm4v_moe")
BIAS_NAME = "e_score_correction_bias"


def _k(router: nn.Module, config) -> int | None:
    for source, name in ((config, "num_experts_per_tok"), (router, "top_k"), (config, "moe_topk")):
        value = getattr(source, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def routing_rule(router: nn.Module, config) -> tuple[RoutingRule | None, str]:
    """The router's declared rule, read from its whole module tree (a correction bias may sit on a child: Ernie 4.5's
    ``moe_statics``) and the config; (None, why) when the rule is not declared to the suite."""
    model_type = str(getattr(config, "model_type", ""))
    tensors = dict(router.named_parameters()) | dict(router.named_buffers())
    bias = next((t for n, t in tensors.items() if n.rsplit(".", 1)[-1] == BIAS_NAME), None)
    extra = sorted(n for n in tensors if n not in ("weight", "bias") and n.rsplit(".", 1)[-1] != BIAS_NAME)
    k = _k(router, config)
    unknown = f"the routing rule of {type(router).__name__} ({model_type or 'no model_type'})"
    if k is None or extra:
        return None, unknown + (f": it holds {', '.join(extra)}" if extra else ": no top-k in the config")
    norm = getattr(config, "norm_topk_prob", None)
    if model_type in ALWAYS_RENORMALISED and bias is None:
        return RoutingRule(k, "softmax", True), ""
    if model_type in RENORMALISED_AS_CONFIGURED and bias is None:
        return RoutingRule(k, "softmax", bool(norm)), ""
    if model_type in NOT_RENORMALISED and bias is None:
        return RoutingRule(k, "softmax", False), ""
    if model_type in BIASED_SOFTMAX and bias is not None:
        return RoutingRule(k, "softmax", True, bias=bias.detach(), norm_min=float(getattr(config, "moe_norm_min", 0.0)
                                                                                   or 0.0)), ""
    if model_type in GROUPED_SIGMOID and bias is not None:
        groups, kept = int(getattr(config, "n_group", 1) or 1), int(getattr(config, "topk_group", 1) or 1)
        return RoutingRule(k, "sigmoid", bool(norm), bias=bias.detach(), groups=groups, groups_kept=kept,
                           scale=float(getattr(config, "routed_scaling_factor", 1.0) or 1.0)), ""
    grouped = (getattr(config, "n_group", None) or 1) > 1 or (getattr(config, "topk_group", None) or 1) > 1
    scoring = str(getattr(config, "scoring_func", "softmax") or "softmax")
    if bias is None and not grouped and scoring == "softmax":   # a plain softmax top-k router of another family
        return RoutingRule(k, "softmax", norm if isinstance(norm, bool) else None), ""
    return None, unknown + (": a correction bias" if bias is not None else "") + (": grouped" if grouped else "") + \
        (f": {scoring} scores" if scoring != "softmax" else "")


def routing(model: nn.Module, *, top_k: bool | None = None, normalized: bool | None = None):
    """Subject.routing of ``model`` (None without MoE layers): a context manager recording one Route per call.
    top_k / normalized: the rule, when the reading of the router and config (above) is to be overridden."""
    layers = moe_layers(model)
    if not layers:
        if top_k is not None or normalized is not None:
            raise SubjectError("hf_subject: routing_top_k= / routing_normalized= given, but the model has no "
                               "mixture-of-experts layer (a block with a router and an experts module)")
        return None
    config = getattr(model, "config", None)
    rules = []
    for router, _ in layers:
        rule, _ = routing_rule(router, config)
        if top_k is False:
            rule = None
        elif rule is None and top_k:
            rule = RoutingRule(_k(router, config) or 1, "softmax", normalized)
        elif rule is not None and normalized is not None:
            rule = replace(rule, normalized=normalized)
        rules.append(rule)

    @contextmanager
    def record():
        routes: list[Route] = []
        pending: dict[int, torch.Tensor] = {}
        handles = []
        for index, ((router, experts), rule) in enumerate(zip(layers, rules)):
            def logits(_, args, output, index=index):
                pending[index] = first_output(output)

            def combined(_, args, kwargs, index=index, rule=rule):
                values = list(args) + list(kwargs.values())
                if len(values) < 3 or index not in pending:
                    raise AssertionError(f"MoE layer {index}: the experts module was called without (hidden_states, "
                                         f"indices, weights) after its router")
                tokens = values[0].numel() // values[0].shape[-1]
                routes.append(Route(*(v.reshape(tokens, -1) for v in (pending.pop(index), values[1], values[2])),
                                    top_k=rule is not None, normalized=None if rule is None else rule.normalized,
                                    rule=rule))
            handles += [router.register_forward_hook(logits),
                        experts.register_forward_pre_hook(combined, with_kwargs=True)]
        with hooks_in_place(handles):
            yield routes
    return record


def eager_experts_in_float64(model: nn.Module) -> None:
    """Switches a float64 model's experts to transformers' eager implementation: grouped_mm, the default, refuses
    float64 on the CPU ("Expected mat_a to be Float32, BFloat16 or Float16"), and the eager loop is exact there."""
    implementation = getattr(getattr(model, "config", None), "_experts_implementation", None)
    if implementation in (None, "eager") or not hasattr(model, "set_experts_implementation"):
        return
    first = next((p for p in model.parameters() if p.is_floating_point()), None)
    if first is not None and first.dtype == torch.float64:
        model.set_experts_implementation("eager")
