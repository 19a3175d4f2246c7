"""Clauses on merge kernels (``--kernel-api merge``; SPEC.md, "Partial states and their merge"): the keys of a drawn
attention problem are cut into parts, each part's state (o, λ) is computed in float64 from the whole problem's oracle
and rounded as a kernel upstream would hand it over (o to the tested dtype, λ to float32), and the kernel merges them,
two at a time (a left fold of ``merge_state``) and, where offered, all at once (``merge_states``). The merged state
must be the whole problem's, within the bound of "Tolerance" there. States are laid out as FlashInfer's: a problem's
(B, H, L, D) as N = B·L rows, ``(b l) h d``."""
from __future__ import annotations

import math

import torch
from einops import rearrange
from hypothesis import example, strategies as st

from properties import clause
from properties.core.assertions import assert_within
from properties.core.oracle import causal_allowed, expand_kv_heads, softmax_rows, to_float64
from properties.core.strategies import derived_generator, on, require_dtype
from properties.core.tolerance import deciding_output_bound, softmax_bounds
from properties.kernel.guard import check_lse_against_oracle
from properties.kernel.problem_space import DENSITY, MAGNITUDE, SPREAD, Extra, Problem, Space
from properties.kernel.schedule import scheduled

# The cut points, as fractions of S (rounded to keys): 2 to 8 parts, empty ones where two cuts meet or a cut is at an
# end. The first is what a failing row shrinks to.
CUTS = Extra(((0.5,), (0.25, 0.75), (0.0, 0.5), (0.3, 0.3, 0.6), (0.125, 0.25, 0.5, 0.75, 0.875, 1.0, 1.0)),
             st.lists(st.floats(0.0, 1.0), min_size=1, max_size=7).map(tuple))
MERGE_FACTORS = dict(L=True, S=True, order=True, E=True, Ev=True, dtype=True, group=("1", "2"),
                     values=("gaussian", "peaked", "negative"), fixed={"rank": "2"})
MERGE_EXTRAS = {"cuts": CUTS, "spread": SPREAD, "magnitude": MAGNITUDE, "density": DENSITY}


def _parts(case) -> list[tuple[int, int]]:
    """The parts' key ranges [a, b), in order."""
    cuts = sorted(min(case.s, max(0, round(f * case.s))) for f in case.cuts)
    edges = [0, *cuts, case.s]
    return list(zip(edges[:-1], edges[1:]))


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _states(bounds, value, parts, dtype, device, base: str):
    """Every part's state from the whole problem's float64 oracle, rounded and laid out for the kernel: a list of
    (v (N, H, D) in ``dtype``, s (N, H) float32 or float64, in base ``base``)."""
    scores = bounds.reference.scores
    v64 = expand_kv_heads(to_float64(value), scores.shape[-3])
    states = []
    for a, b in parts:
        block = scores[..., a:b]
        if b > a:
            lse = torch.logsumexp(block, dim=-1)
            out = softmax_rows(block) @ v64[..., a:b, :]   # (max-subtracted: weights within a few u64 at any size)
        else:
            lse = torch.full(scores.shape[:-1], -math.inf, dtype=torch.float64)
            out = torch.zeros(*scores.shape[:-1], v64.shape[-1], dtype=torch.float64)
        s = lse / math.log(2.0) if base == "2" else lse
        states.append((on(rearrange(out, "b h l d -> (b l) h d"), dtype, device),
                       rearrange(s, "b h l -> (b l) h").to(_lse_dtype(dtype)).to(device)))
    return states


def _merged(kernel, states, nan_rows):
    """((v, s) of the left fold of merge_state, (v, s) of merge_states or None): the kernel's merges of ``states``."""
    v, s = states[0]
    for v_i, s_i in states[1:]:
        v, s = kernel.merge_state(v, s, v_i, s_i, nan_rows=nan_rows)
    many = None
    if kernel.many is not None:
        many = kernel.merge_states(torch.stack([v for v, _ in states], 1), torch.stack([s for _, s in states], 1),
                                   nan_rows=nan_rows)
    return (v, s), many


def _check_merged(merged, form: str, bounds, value, n: int, fully_masked: str, base: str, b: int) -> None:
    """The merged state of ``form`` against the whole problem: v within ATTN-ORACLE's bound widened by the merges
    (a fold: n − 1 rescales of two states and n − 1 outputs stored in the dtype), s within ``lse_bound``; a query
    without an admissible key (0, −∞) exactly under --fully-masked zeros."""
    __tracebackhide__ = True
    v, s = merged
    actual = rearrange(to_float64(v), "(b l) h d -> b h l d", b=b)
    lse = rearrange(s.detach().cpu(), "(b l) h -> b h l", b=b)
    expected = bounds.reference.output
    no_key = bounds.reference.no_key_rows
    if fully_masked != "zeros":   # such a query's v follows the declared convention, not the oracle
        actual = torch.where(no_key[..., None], expected, actual)
    stored = n - 1 if form == "merge_state" else 1
    bound = deciding_output_bound(actual, expected, bounds, value, stored_outputs=stored)
    assert_within(actual, expected, bound, what=f"v merged by {form} ({n} states)",
                  reference="float64 oracle of the whole problem")
    check_lse_against_oracle(lse, bounds, base=base, fully_masked=fully_masked, what=f"s merged by {form}")


def _check_both(kernel, q, k, v, contract, states, fully_masked, base, case):
    __tracebackhide__ = True
    n = len(states)
    merged_bounds = {fold: softmax_bounds(q, k, v, dtype=case.dtype, merged_states=n, folded=fold, **contract)
                     for fold in (True, False)}
    no_key = merged_bounds[True].reference.no_key_rows
    nan_rows = None if fully_masked == "zeros" else rearrange(no_key, "b h l -> (b l) h")
    folded, many = _merged(kernel, states, nan_rows)
    b = case.lead[0]
    _check_merged(folded, "merge_state", merged_bounds[True], v, n, fully_masked, base, b)
    if many is not None:
        _check_merged(many, "merge_states", merged_bounds[False], v, n, fully_masked, base, b)


def _with_blank_part(case, contract: dict, parts, device) -> dict:
    """The problem's keyword arguments with the keys of part 1 masked for every query (``blank``)."""
    if not case.blank:
        return contract
    a, b = parts[1]
    hidden = torch.zeros(case.s, dtype=torch.bool)
    hidden[a:b] = True
    contract = dict(contract)
    mask = contract.pop("attn_mask", None)
    if contract.pop("is_causal", False):
        mask = causal_allowed(case.l, case.s).to(device)
    if mask is None:
        mask = torch.ones(case.l, case.s, dtype=torch.bool, device=device)
    contract["attn_mask"] = (mask & ~hidden.to(device) if mask.dtype == torch.bool
                             else mask.masked_fill(hidden.to(device), float("-inf")))
    return contract


@clause("MERGE-ORACLE")
@scheduled(Space.of("MERGE-ORACLE", **MERGE_FACTORS,
                    attend=("none", "causal", "bool", "float", "bool-empty", "float-empty"),
                    extras={**MERGE_EXTRAS, "blank": Extra((False, True), st.booleans())}))
def test_merged_states_agree_with_float64_oracle(merge_kernel, device, fully_masked, lse_base, case):
    """Every pair of classes: lengths and order, head sizes, dtypes, grouped heads, masks, rows without a key, score
    profiles up to the dtype's range; 2 to 8 parts, empty ones, and a part masked for every query (``blank``)."""
    require_dtype(device, case.dtype)
    q, k, v = case.qkv(device)
    parts = _parts(case)
    contract = _with_blank_part(case, case.contract(device), parts, device)
    bounds = softmax_bounds(q, k, v, dtype=case.dtype, **contract)
    states = _states(bounds, v, parts, case.dtype, device, lse_base)
    _check_both(merge_kernel, q, k, v, contract, states, fully_masked, lse_base, case)


def _emptied(case, parts) -> torch.Tensor:
    """(n, B, H, L) bool: the states made empty — a drawn share, and always every state of query 0, only the first
    of query 1, only the last of query 2."""
    n, heads = len(parts), case.lead[1]
    g = derived_generator(case.seed, 11)
    empty = torch.rand(n, case.lead[0], heads, case.l, generator=g, dtype=torch.float64) < case.share
    empty[..., 0] = True
    if case.l > 1:
        empty[..., 1] = False
        empty[0, ..., 1] = True
    if case.l > 2:
        empty[..., 2] = False
        empty[-1, ..., 2] = True
    return empty


# Two states per query, the first, the second or both empty, with typical scores (a merge that forms
# exp(−∞ − (−∞)) fails here whatever Hypothesis draws).
TWO_STATES = Problem(lead=(1, 1), l=4, s=4, e=8, ev=8, dtype=torch.float32, seed=0,
                     extras=(("cuts", (0.5,)), ("spread", 0), ("magnitude", 0.5), ("density", 0.5), ("share", 0.5)))


@clause("MERGE-EMPTY")
@example(case=TWO_STATES)
@scheduled(Space.of("MERGE-EMPTY", **MERGE_FACTORS, attend=("none", "causal", "bool"),
                    extras={**MERGE_EXTRAS, "share": Extra((0.5, 0.25, 0.75, 0.0, 1.0), st.floats(0.0, 1.0))}))
def test_empty_states_weigh_nothing(merge_kernel, device, fully_masked, lse_base, case):
    """A drawn share of (query, part) states is empty (λ = −∞) with undefined output (±finfo.max/4): the merge is the
    state of the query's other parts, and (0, −∞) where every part is empty."""
    require_dtype(device, case.dtype)
    q, k, v = case.qkv(device)
    parts = _parts(case)
    contract = case.contract(device)
    admissible = softmax_bounds(q, k, v, dtype=case.dtype, **contract).admissible
    keep = admissible.clone()
    for empty, (a, b) in zip(_emptied(case, parts), parts):
        keep[..., a:b] &= ~empty[..., None]
    masked = {name: value for name, value in contract.items() if name not in ("attn_mask", "is_causal")}
    masked["attn_mask"] = keep.to(device)
    bounds = softmax_bounds(q, k, v, dtype=case.dtype, **masked)
    states = _states(bounds, v, parts, case.dtype, device, lse_base)
    huge = torch.finfo(case.dtype).max / 4
    signs = torch.randint(2, states[0][0].shape, generator=derived_generator(case.seed, 12)).double() * 2 - 1
    undefined = on(huge * signs, case.dtype, device)
    states = [(torch.where(torch.isinf(s)[..., None], undefined, v_i), s) for v_i, s in states]
    _check_both(merge_kernel, q, k, v, masked, states, fully_masked, lse_base, case)
