"""MODEL-ROUTING (SPEC.md, "Models"): a mixture-of-experts model routes each token by its own router logits.

What the routing layers record (``Subject.routing``: per call, the router's logits and the experts and combine
weights the experts module receives) is checked against the router's declared rule (properties/core/routing.py: the
scores, a correction bias for the choice, groups, renormalisation, a scaling factor; a plain softmax top-k rule when
only ``top_k`` and ``normalized`` are given), and a token's experts are the same alone as in a padded batch. Wrong routing hides well: outputs
stay self-consistent (a batch is still the sum of its samples when the weights are renormalised against the config),
so only the routing itself says that it is wrong.
"""
from __future__ import annotations

import dataclasses

import torch

from properties import clause
from properties.core.routing import RoutingRule, describe_rule, route as route_tokens
from properties.core.subject import Route
from properties.core.tolerance import unit_roundoff
from properties.model.checks import draw_pair, forward, only, pinned_model_property, requires
from properties.model.precision import OUTPUT_ROUNDINGS, OWN_ROUNDINGS, accumulation_roundoff, precision_of
from properties.model.test_models import MIXED
from properties.model.twin import NOT_CHECKED, add_note


def _tolerance(s) -> float:
    """Rounding of the router's computation in the precision the subject computes in (routers take their softmax in
    float32 even in a float64 model): OWN_ROUNDINGS·u_acc + OUTPUT_ROUNDINGS·u_eff, relative to values of order 1."""
    precision = precision_of(s)
    dtype = precision.compute_dtype if precision is not None else torch.float64
    return OWN_ROUNDINGS * accumulation_roundoff(dtype) + OUTPUT_ROUNDINGS * unit_roundoff(dtype)


def _routed(s, src, tgt) -> list[Route]:
    with torch.no_grad(), s.routing() as routes:
        forward(s, src, tgt)
    assert routes, "Subject.routing recorded no routed layer during a forward pass"
    return [Route(r.logits.double(), r.experts.long(), r.weights.double(), r.top_k, r.normalized, r.rule)
            for r in routes]


def _rule(route: Route) -> RoutingRule | None:
    """The route's declared rule; a plain softmax top-k one from ``top_k`` and ``normalized``; None when unknown."""
    if route.rule is not None:
        return route.rule
    return RoutingRule(route.experts.shape[1], "softmax", route.normalized) if route.top_k else None


def _check_rule(route: Route, layer: int, rows: torch.Tensor, tol: float) -> None:
    logits, experts, weights = route.logits[rows], route.experts[rows], route.weights[rows]
    n, count = logits.shape
    k = experts.shape[1]
    assert weights.shape == experts.shape and 1 <= k <= count, (
        f"MoE layer {layer}: experts {tuple(experts.shape)} and weights {tuple(weights.shape)} for logits "
        f"{tuple(logits.shape)}; expected (tokens, k) each with 1 <= k <= {count} experts")
    rule = _rule(route)
    if rule is None:
        return
    if rule.k != k:
        rule = dataclasses.replace(rule, k=k)
    routed = route_tokens(logits, rule)
    scale = max(1.0, float(routed.choice[torch.isfinite(routed.choice)].abs().max()))
    decided = routed.margin > tol * scale          # a closer pair is a tie that rounding may break either way
    order = experts.sort(1)
    sent, weights = order.values, weights.gather(1, order.indices)
    wrong = ((sent != routed.chosen).any(1) & decided).nonzero().flatten().tolist()
    if wrong:
        t = wrong[0]
        raise AssertionError(
            f"MoE layer {layer}: token(s) {wrong[:5]} are sent to experts {sent[t].tolist()} although the declared "
            f"rule ({describe_rule(rule)}) chooses {routed.chosen[t].tolist()} (choice scores "
            f"{[round(v, 4) for v in routed.choice[t].tolist()]}; logits {[round(v, 4) for v in logits[t].tolist()]})")
    expected = routed.weights
    if rule.normalized is None:   # the rule does not say whether they are renormalised: their ratios only
        expected, actual = expected / expected.sum(1, keepdim=True), weights / weights.sum(1, keepdim=True)
        what = "proportional to the chosen experts' scores"
    else:
        actual, what = weights, f"the weights of the declared rule ({describe_rule(rule)})"
    error = ((actual - expected).abs().amax(1)).masked_fill(~decided, 0)
    worst = int(error.argmax())
    assert float(error[worst]) <= tol * max(1.0, abs(rule.scale)), (
        f"MoE layer {layer}: token {worst}'s combine weights {[round(v, 5) for v in weights[worst].tolist()]} "
        f"(sum {float(weights[worst].sum()):.5f}) differ by {float(error[worst]):.2e} (tolerance {tol:.1e}) from "
        f"{[round(v, 5) for v in expected[worst].tolist()]}: expected {what}")


def _experts_by_token(route: Route, rows: torch.Tensor, tol: float):
    """The sorted experts of each row, and whether the row is decided: its k-th and (k+1)-th choice scores (under the
    declared rule; the logits when the rule is unknown) apart by more than rounding (a near tie may flip with any
    change of summation order)."""
    logits, experts = route.logits[rows], route.experts[rows]
    k = experts.shape[1]
    rule = _rule(route)
    if rule is None:   # an unknown rule: the gap between the k-th and (k+1)-th logits stands for its margin
        top = logits.topk(min(k + 1, logits.shape[1]), dim=1).values
        decided = (top[:, k - 1] - top[:, k] > tol * max(1.0, float(logits.abs().max()))) if top.shape[1] > k else \
            torch.ones(len(rows), dtype=torch.bool)
        return experts.sort(1).values, decided
    routed = route_tokens(logits, dataclasses.replace(rule, k=k))
    scale = max(1.0, float(routed.choice[torch.isfinite(routed.choice)].abs().max()))
    return experts.sort(1).values, routed.margin > tol * scale


@clause("MODEL-ROUTING")
@pinned_model_property({"batch": MIXED})
def test_routing(mut, data):
    s = only(mut.precise, "decoder_only", "encoder_only")
    requires(s, "routing", "the model declares no mixture-of-experts routing")
    _, (tokens, mask, b) = draw_pair(data, s, mut.device)
    tol = _tolerance(s)
    batched = _routed(s, None, (tokens, mask))
    unknown = [layer for layer, route in enumerate(batched) if _rule(route) is None]
    if unknown:
        add_note(NOT_CHECKED + f"the routing rule of MoE layer(s) {unknown} (not declared to the suite: batch and "
                               f"padding invariance only)")
    real = mask.flatten().nonzero().flatten().cpu()
    for layer, route in enumerate(batched):
        assert route.logits.shape[0] == tokens.numel(), (
            f"MoE layer {layer}: {route.logits.shape[0]} routed rows for a batch of {tokens.numel()} tokens")
        _check_rule(route, layer, real, tol)
    for sample, length in enumerate(b.real):
        alone = _routed(s, None, (tokens[sample:sample + 1, :length], mask[sample:sample + 1, :length]))
        assert len(alone) == len(batched), (f"sample {sample} alone passes {len(alone)} routed layers; in the batch "
                                            f"{len(batched)}")
        rows = torch.arange(sample * b.length, sample * b.length + length)
        for layer, (together, single) in enumerate(zip(batched, alone)):
            in_batch, decided = _experts_by_token(together, rows, tol)
            by_itself, _ = _experts_by_token(single, torch.arange(length), tol)
            moved = ((in_batch != by_itself).any(1) & decided).nonzero().flatten().tolist()
            assert not moved, (
                f"MoE layer {layer}: sample {sample}'s token(s) at position(s) {moved[:5]} go to experts "
                f"{in_batch[moved[0]].tolist()} in the padded batch of {b.size} and to {by_itself[moved[0]].tolist()} "
                f"alone: a token's routing depends on the other tokens of the batch or on the padding")
