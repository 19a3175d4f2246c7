"""Mixture-of-experts routing as a config declares it, in float64 (SPEC.md, MODEL-ROUTING and MODEL-LAYER-MOE): which
experts a token goes to and the weights their outputs are combined with, from the router's logits.

    scores  p = softmax(ℓ) or sigmoid(ℓ)                  (Shazeer et al. 2017; DeepSeek-V3 §2.1.2: sigmoid affinities)
    choice  c = p + b                                     (a correction bias b used for the choice only: DeepSeek-V3's
                                                           auxiliary-loss-free balancing, GLM-4-MoE, Ernie 4.5)
    groups  keep the G' groups of E/G experts with the largest sums of their two best c; others out (DeepSeek-V3's
            group-limited routing, transformers' n_group / topk_group)
    chosen  the k experts of largest c among those kept
    weights w = p_chosen, divided by max(Σ p_chosen, norm_min) when normalised (norm_topk_prob; Mixtral and GraniteMoE
            always: a softmax over the top-k logits is the renormalised probabilities), times routed_scaling_factor.

``normalized=None`` is a rule that does not say whether the weights are renormalised: only their ratios are known.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["RoutingRule", "Routed", "route", "describe_rule"]


@dataclass(frozen=True)
class RoutingRule:
    k: int
    scoring: str = "softmax"            # softmax | sigmoid
    normalized: bool | None = None
    bias: torch.Tensor | None = None    # (E,) added to the scores for the choice only
    groups: int = 1
    groups_kept: int = 1
    scale: float = 1.0
    norm_min: float = 0.0

    def __post_init__(self):
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"routing scoring {self.scoring!r}: expected 'softmax' or 'sigmoid'")


@dataclass(frozen=True)
class Routed:
    """The rule applied to N tokens: ``scores`` p (N, E), ``choice`` c (N, E, -inf outside the kept groups), ``chosen``
    (N, k) sorted, ``weights`` (N, k) in the order of ``chosen``, ``margin`` (N,): how far each token is from a tie
    that would change its experts (the gap between its k-th and (k+1)-th choice, and between its last kept and first
    dropped group)."""
    scores: torch.Tensor
    choice: torch.Tensor
    chosen: torch.Tensor
    weights: torch.Tensor
    margin: torch.Tensor


def route(logits: torch.Tensor, rule: RoutingRule) -> Routed:
    """``rule`` applied to router logits (N, E), in float64."""
    logits = logits.to(torch.float64)
    n, count = logits.shape
    scores = logits.softmax(-1) if rule.scoring == "softmax" else logits.sigmoid()
    choice = scores + (0.0 if rule.bias is None else rule.bias.detach().to(scores).reshape(-1))
    margin = torch.full((n,), float("inf"), dtype=torch.float64)
    if rule.groups > 1:
        grouped = choice.reshape(n, rule.groups, count // rule.groups)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)          # (N, G)
        ranked = group_scores.sort(-1, descending=True).values
        if rule.groups_kept < rule.groups:
            margin = ranked[:, rule.groups_kept - 1] - ranked[:, rule.groups_kept]
        kept = group_scores.topk(rule.groups_kept, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, kept, True)
        choice = choice.masked_fill(~keep.repeat_interleave(count // rule.groups, dim=1), float("-inf"))
    top = choice.topk(min(rule.k + 1, count), dim=-1)
    if top.values.shape[1] > rule.k:
        gap = top.values[:, rule.k - 1] - top.values[:, rule.k]
        margin = torch.minimum(margin, torch.where(torch.isfinite(gap), gap, torch.full_like(gap, float("inf"))))
    chosen = top.indices[:, : rule.k].sort(-1).values
    weights = scores.gather(1, chosen)
    if rule.normalized:
        weights = weights / weights.sum(-1, keepdim=True).clamp(min=rule.norm_min)
    return Routed(scores, choice, chosen, weights * rule.scale, margin)


def describe_rule(rule: RoutingRule | None) -> str:
    if rule is None:
        return "an undeclared rule"
    words = [f"top {rule.k} of {rule.scoring}"]
    if rule.bias is not None:
        words.append("+ a correction bias for the choice")
    if rule.groups > 1:
        words.append(f"in the best {rule.groups_kept} of {rule.groups} groups")
    words.append({True: "renormalised", False: "not renormalised", None: "renormalisation not declared"}[rule.normalized]
                 + (f" (sum clamped at {rule.norm_min:g})" if rule.normalized and rule.norm_min else ""))
    if rule.scale != 1.0:
        words.append(f"times {rule.scale:g}")
    return ", ".join(words)
