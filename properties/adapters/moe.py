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

import torch
from torch import nn

from properties.core.subject import Route, SubjectError

__all__ = ["moe_layers", "routing", "eager_experts_in_float64"]


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


def moe_layers(model: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    """(router, experts) of every MoE block, in module order."""
    layers = []
    for block in model.modules():
        for child in block.children():
            if _is_experts(child):
                router = _router(block, child)
                if router is not None:
                    layers.append((router, child))
    return layers


def _top_k_rule(router: nn.Module, config) -> bool:
    """Whether the router picks the k largest logits: a softmax top-k router has one weight (and maybe a bias);
    a score-correction bias (DeepSeek-V3, GLM-4-MoE), grouped routing or sigmoid scores pick by another rule."""
    extra = [name for name, _ in router.named_parameters(recurse=False)] + [n for n, _ in router.named_buffers()]
    grouped = (getattr(config, "n_group", None) or 1) > 1 or (getattr(config, "topk_group", None) or 1) > 1
    scoring = str(getattr(config, "scoring_func", "softmax") or "softmax")
    return set(extra) <= {"weight", "bias"} and not grouped and scoring == "softmax"


def _normalized(router: nn.Module, config) -> bool | None:
    """Whether the combine weights are renormalised over the chosen experts, as the router or config says."""
    for source in (router, config):
        value = getattr(source, "norm_topk_prob", None)
        if isinstance(value, bool):
            return value
    return None


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

    @contextmanager
    def record():
        routes: list[Route] = []
        pending: dict[int, torch.Tensor] = {}
        handles = []
        for index, (router, experts) in enumerate(layers):
            rule = _top_k_rule(router, config) if top_k is None else top_k
            norm = _normalized(router, config) if normalized is None else normalized

            def logits(_, args, output, index=index):
                pending[index] = output[0] if isinstance(output, (tuple, list)) else output

            def combined(_, args, kwargs, index=index, rule=rule, norm=norm):
                values = list(args) + list(kwargs.values())
                if len(values) < 3 or index not in pending:
                    raise AssertionError(f"MoE layer {index}: the experts module was called without (hidden_states, "
                                         f"indices, weights) after its router")
                tokens = values[0].numel() // values[0].shape[-1]
                routes.append(Route(*(v.reshape(tokens, -1) for v in (pending.pop(index), values[1], values[2])),
                                    top_k=rule, normalized=norm))
            handles += [router.register_forward_hook(logits),
                        experts.register_forward_pre_hook(combined, with_kwargs=True)]
        try:
            yield routes
        finally:
            for handle in handles:
                handle.remove()
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
