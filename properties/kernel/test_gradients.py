"""Gradient clauses (SPEC.md, "Gradients"): the backward pass of a kernel whose output requires grad.

Axes: b batch, h query heads (h = k · group), k key/value heads, l queries, s keys, e and ev features. The
oracle and its bound are kernel/gradients.py. A kernel whose output does not require grad, or whose backward
raises NotImplementedError, has these clauses skipped with that reason.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import assume, example, strategies as st

from properties import clause
from properties.core import evidence
from properties.core.assertions import assert_all, assert_within
from properties.kernel.gradients import gradient_oracle, group_sum
from properties.kernel.limits import nearest_size
from properties.core.oracle import causal_allowed, default_scale, to_float64
from properties.core.strategies import derived_generator, on, random_bool_mask, require_dtype, seeded_rng
from properties.kernel.problem_space import MEAN, Extra, Problem, Space
from properties.kernel.schedule import scheduled
from properties.kernel.tiles import kernel_limits
from properties.core.tolerance import softmax_bounds
from properties.kernel.guard import backward_gradients

MASKS = ("none", "bool", "float", "float-grad")


@dataclass(frozen=True)
class GradCase:
    b: int
    kv_heads: int
    group: int
    l: int
    s: int
    e: int
    ev: int
    dtype: torch.dtype
    mask: str            # none | bool | float | float-grad (a float mask that requires grad)
    causal: bool
    scale: float | None
    strided: bool        # q, k, v and dO as .transpose(1, 2) views of (b, l, h, e) tensors
    seed: int
    shift: float = 0.0   # the mean of the values and of dO (spread 1/4): ``shifted`` values (0: gaussian)

    @property
    def heads(self) -> int:
        return self.kv_heads * self.group

    def __repr__(self) -> str:
        return (f"GradCase(b={self.b}, h={self.heads}, kv_heads={self.kv_heads}, l={self.l}, s={self.s}, "
                f"e={self.e}, ev={self.ev}, dtype={self.dtype}, mask={self.mask!r}, causal={self.causal}, "
                f"scale={self.scale}, strided={self.strided}, seed={self.seed}"
                f"{f', shift={self.shift}' if self.shift else ''})")

    def _tensor(self, g, heads, length, features, device, shift: float = 0.0):
        shape = (self.b, length, heads, features) if self.strided else (self.b, heads, length, features)
        t = torch.randn(*shape, generator=g, dtype=torch.float64)
        if shift:
            t = shift + 0.25 * t
        t = on(t, self.dtype, device)
        return t.transpose(1, 2) if self.strided else t   # the storage of a (b, l, h, e) projection

    def tensors(self, device):
        """q, k, v, dO and the mask (or None), in the dtype on ``device``."""
        require_dtype(str(device), self.dtype)
        g = derived_generator(self.seed)
        q = self._tensor(g, self.heads, self.l, self.e, device)
        k = self._tensor(g, self.kv_heads, self.s, self.e, device)
        v = self._tensor(g, self.kv_heads, self.s, self.ev, device, self.shift)
        do = self._tensor(g, self.heads, self.l, self.ev, device, self.shift)
        mask = None
        if self.mask == "bool":
            mask = random_bool_mask(g, (self.l, self.s), 0.6, keep_one=False).to(device)
        elif self.mask.startswith("float"):
            mask = on(2 * torch.randn(self.b, 1, self.l, self.s, generator=g, dtype=torch.float64), self.dtype, device)
        return q, k, v, do, mask

    def contract(self, mask) -> dict:
        kw = {}
        if mask is not None:
            kw["attn_mask"] = mask
        if self.causal:
            kw["is_causal"] = True
        if self.scale is not None:
            kw["scale"] = self.scale
        if self.group > 1:
            kw["enable_gqa"] = True
        return kw

    @staticmethod
    def of(problem: Problem) -> "GradCase":
        """The backward problem of a problem of a GRAD space: (B, H) its leading dims, the mask kind its attend class
        (a float mask that requires grad where its ``mask_grad`` says), the layout's strides, the values' mean."""
        group = problem.group
        b, heads = problem.lead
        mask = {"none": "none", "causal": "none", "bool": "bool"}.get(problem.attend, "float")
        if mask == "float" and dict(problem.extras).get("mask_grad"):
            mask = "float-grad"
        limits = kernel_limits()
        scale = dict(problem.extras).get("scale") if limits.explicit_scale else None
        return GradCase(b=b, kv_heads=heads // group, group=group, l=problem.l, s=problem.s, e=problem.e,
                        ev=problem.ev, dtype=problem.dtype, mask=mask, causal=problem.attend == "causal", scale=scale,
                        strided=problem.layout == "transposed", seed=problem.seed,
                        shift=problem.shift_of_mean() if problem.values == "shifted" else 0.0)


# The backward problems: 4-D (B, H, L, E) inputs, contiguous or the (B, L, H, E) storage of projections, values and
# upstream gradients of zero mean or of mean >> spread (rowsum(dO o O) then far from 0), an explicit scale or none.
SCALE = Extra((None, 0.5, 0.05, 2.0, 1.0), st.one_of(st.none(), st.floats(0.05, 2.0)))
GRAD = dict(L=True, S=True, order=True, E=True, Ev=True, dtype=True, group=("1", "2"), calls=4,
            layout=("contiguous", "transposed"), values=("gaussian", "shifted"), fixed={"rank": "2"},
            extras={"scale": SCALE, "mean_exponent": MEAN, "mask_grad": Extra((True, False), st.booleans())})


def backward(kernel, q, k, v, do, mask=None, **contract) -> tuple[torch.Tensor, dict]:
    """The kernel's output and the gradients of sum(out ∘ dO) w.r.t. q, k, v (and a float mask that
    requires grad); a skip if the kernel does not support autograd."""
    __tracebackhide__ = True
    leaves = {"query": q.detach().requires_grad_(), "key": k.detach().requires_grad_(),
              "value": v.detach().requires_grad_()}
    if mask is not None:
        if mask.dtype != torch.bool and mask.requires_grad:
            leaves["attn_mask"] = mask.detach().requires_grad_()
            mask = leaves["attn_mask"]
        contract["attn_mask"] = mask
    out = kernel(leaves["query"], leaves["key"], leaves["value"], **contract)
    grads = backward_gradients(kernel, out, do, leaves)
    return out, grads


def _check_layout(grads: dict, leaves: dict) -> None:
    for name, grad in grads.items():
        assert tuple(grad.shape) == tuple(leaves[name].shape), \
            f"d{name} has shape {tuple(grad.shape)}, the input {tuple(leaves[name].shape)}"


def _bounds(case: GradCase, q, k, v, mask, causal_alignment):
    return softmax_bounds(q, k, v, attn_mask=mask, is_causal=case.causal, enable_gqa=case.group > 1,
                          scale=case.scale, causal_alignment=causal_alignment)


def _record_zeros(kernel, q, k, v, do, contract: dict, grads: dict, zeros: dict, *, causal_alignment: str) -> None:
    """--repro-dir: the gradient reproducer with bound 0 where the clause wants exact zeros (``zeros``: name -> the
    positions along its sequence axis) and ∞ elsewhere (there only finiteness is checked)."""
    if not evidence.active():
        return
    bound = {name: torch.full_like(to_float64(grad), torch.inf) for name, grad in grads.items()}
    for name, positions in zeros.items():
        bound[name][..., positions, :] = 0
    evidence.record("gradient", subject=kernel.name, device=str(q.device), upstream=do, alignment=causal_alignment,
                    inputs=dict(query=q, key=k, value=v, **contract), bound=bound)


# ------------------------------------------------------------------------------------------ ATTN-GRAD
@clause("ATTN-GRAD")
@scheduled(Space.of("ATTN-GRAD", **GRAD, attend=("none", "causal", "bool", "float")))
def test_gradients_agree_with_float64_oracle(kernel, device, causal_alignment, fully_masked, case):
    case = GradCase.of(case)
    q, k, v, do, mask = case.tensors(device)
    if mask is not None and case.mask == "float-grad":
        mask.requires_grad_()
    bounds = _bounds(case, q, k, v, mask, causal_alignment)
    if fully_masked != "zeros":
        assume(not bool(bounds.reference.no_key_rows.any()))
    _, grads = backward(kernel, q, k, v, do, mask, **{k_: v_ for k_, v_ in case.contract(None).items()})
    _check_layout(grads, {"query": q, "key": k, "value": v, **({"attn_mask": mask} if "attn_mask" in grads else {})})
    scale = default_scale(case.e) if case.scale is None else case.scale
    oracle = gradient_oracle(bounds, q, k, v, do, scale=scale, attn_mask=mask if "attn_mask" in grads else None)
    evidence.record("gradient", subject=kernel.name, device=str(q.device), upstream=do, alignment=causal_alignment,
                    inputs=dict(query=q, key=k, value=v, **({"attn_mask": mask} if mask is not None else {}),
                                **case.contract(None)), bound={name: oracle.bound[name] for name in grads})
    for name, grad in grads.items():
        assert_within(to_float64(grad), oracle.value[name], oracle.bound[name], what=f"d{name}",
                      reference="float64 chain rule")


# ----------------------------------------------------------------------------------- ATTN-GRAD-MASKED
@clause("ATTN-GRAD-MASKED")
@scheduled(Space.of("ATTN-GRAD-MASKED", **GRAD, attend=("bool",)))
def test_masked_keys_and_empty_queries_get_zero_gradient(kernel, device, fully_masked, case):
    if fully_masked != "zeros":
        pytest.skip(f"--fully-masked {fully_masked}: dQ of a query with no admissible key is not required to be 0")
    case = GradCase.of(case)
    q, k, v, do, _ = case.tensors(device)
    g = derived_generator(case.seed, 7)
    mask = random_bool_mask(g, (case.l, case.s), 0.6, keep_one=True)
    mask[:, int(torch.randint(case.s, (1,), generator=g))] = False      # a key no query may attend
    mask[int(torch.randint(case.l, (1,), generator=g))] = False         # a query with no admissible key
    _, grads = backward(kernel, q, k, v, do, mask.to(device), **case.contract(None))
    unseen = ~mask.any(0)        # (s,) keys that no query attends
    empty = ~mask.any(1)         # (l,) queries with no key
    _record_zeros(kernel, q, k, v, do, dict(attn_mask=mask.to(device), **case.contract(None)), grads,
                  {"key": unseen, "value": unseen, "query": empty}, causal_alignment="top-left")
    for name, grad in grads.items():
        assert_all(torch.isfinite(to_float64(grad)), to_float64(grad), what=f"d{name} is finite")
    for name in ("key", "value"):
        grad = to_float64(grads[name])[..., unseen, :]
        assert_all(grad == 0, grad, what=f"d{name} is exactly 0 for keys no query may attend "
                                          f"(keys {unseen.nonzero().flatten().tolist()})")
    grad = to_float64(grads["query"])[..., empty, :]
    assert_all(grad == 0, grad, what=f"dquery is exactly 0 for queries with no admissible key "
                                     f"(queries {empty.nonzero().flatten().tolist()})")


# ----------------------------------------------------------------------------------- ATTN-GRAD-CAUSAL
@clause("ATTN-GRAD-CAUSAL")
@scheduled(Space.of("ATTN-GRAD-CAUSAL", **{**GRAD, "extras": {**GRAD["extras"], "query": Extra(
    (64, 0, 1, 63, 65, 128, 3), st.one_of(st.integers(0, 5), st.sampled_from((63, 64, 65, 128))))}},
    attend=("causal",)))
def test_upstream_gradient_reaches_only_allowed_keys(kernel, device, causal_alignment, case):
    """dO nonzero at one query (the first of the second 64-row tile where there is one; the last row where the
    drawn one is past L)."""
    row = min(case.query, case.l - 1)
    case = GradCase.of(case)
    q, k, v, do, _ = case.tensors(device)
    only_row = torch.zeros_like(do)
    only_row[..., row, :] = do[..., row, :]
    _, grads = backward(kernel, q, k, v, only_row, **case.contract(None))
    later = ~causal_allowed(case.l, case.s, causal_alignment)[row]          # keys query `row` may not see
    _record_zeros(kernel, q, k, v, only_row, case.contract(None), {n: g for n, g in grads.items() if n != "query"},
                  {"key": later, "value": later}, causal_alignment=causal_alignment)
    for name in ("key", "value"):
        grad = to_float64(grads[name])[..., later, :]
        assert_all(grad == 0, grad, what=f"d{name} of keys {later.nonzero().flatten().tolist()} after "
                                          f"query {row} ({causal_alignment}) from dO at row {row} only")


# ---------------------------------------------------------------------------------- ATTN-GRAD-DROPOUT
@clause("ATTN-GRAD-DROPOUT")
@scheduled(Space.of("ATTN-GRAD-DROPOUT", **{
    **GRAD, "group": ("1",), "Ev": None, "fixed": {"rank": "2", "dropout": True},
    "extras": {**GRAD["extras"], "p": Extra((0.5, 0.1, 0.7, 2 / 16, 11 / 16),   # (cuDNN's 1/16 steps)
                                            st.one_of(st.floats(0.1, 0.7), st.sampled_from([i / 16 for i in range(2, 12)])))}},
    attend=("none",), weights=True))
def test_backward_uses_the_mask_the_forward_realised(kernel, device, case):
    """V = I: the output is the realised weight matrix W̃ (dropped and rescaled), so the mask is known. Ev = S must
    be a head size the kernel accepts: S moves to the nearest one (and E, L with it where the kernel needs Ev = E or
    L = S), so that one call realises the whole mask."""
    p = case.p
    case = GradCase.of(case)
    limits = kernel_limits()
    s = nearest_size(limits.head_sizes, case.s) if limits.head_sizes is not None else case.s
    case = GradCase(**{**case.__dict__, "s": s, "ev": s, "e": s if limits.equal_head_sizes else case.e,
                       "l": s if limits.equal_lengths else case.l})
    q, k, _, do, _ = case.tensors(device)
    # Scores within [-1, 1]: every weight at least e^-2/S, far above the dtype's underflow (float16's smallest normal
    # is 6e-5), so that a zero output means a dropped weight whatever the head size, scale and length.
    scale = default_scale(case.e) if case.scale is None else case.scale
    largest = float((abs(scale) * to_float64(q).abs() @ to_float64(k).abs().transpose(-1, -2)).max())
    if largest > 1:
        q = q / 2.0 ** math.ceil(math.log2(largest))   # a power of two: exact in every dtype
    v = torch.eye(case.s, dtype=case.dtype, device=device).expand(case.b, case.kv_heads, case.s, case.s)
    bounds = _bounds(case, q, k, v, None, "top-left")
    assume(bool((bounds.lower > 0).all()))   # every weight nonzero before dropout: a zero output means dropped
    with seeded_rng(device, case.seed):   # a kernel that declines dropout has this clause skipped (the guard)
        out, grads = backward(kernel, q, k, v.contiguous(), do, dropout_p=p, **case.contract(None))
    keep = to_float64(out) != 0
    oracle = gradient_oracle(bounds, q, k, v, do, scale=scale, keep=keep, p=p)
    if evidence.active():   # the script's own draw may differ (another kernel): the bound of a mask that keeps all
        evidence.record("dropout-gradient", subject=kernel.name, device=str(device), query=q, key=k, upstream=do, p=p,
                        seed=case.seed, contract=case.contract(None), bound=gradient_oracle(
                         bounds, q, k, v, do, scale=scale, keep=torch.ones_like(keep), p=p).bound)
    for name, grad in grads.items():
        assert_within(to_float64(grad), oracle.value[name], oracle.bound[name], what=f"d{name} with dropout",
                      reference=f"the chain rule with the forward's realised mask (p={p:.3g})")


# ------------------------------------------------------------------------------------- ATTN-GRAD-GQA
@clause("ATTN-GRAD-GQA")
@example(case=Problem(lead=(1, 2), l=1, s=2, e=8, ev=16, dtype=torch.bfloat16, seed=2, attend="bool", group=2,
                      extras=(("scale", None),)))   # the query admits no key (cuDNN's rows: the derivation below)
@scheduled(Space.of("ATTN-GRAD-GQA", **{**GRAD, "group": ("2", "4"), "calls": 8},   # two backward passes
                    attend=("none", "causal", "bool", "float")))
def test_shared_kv_head_gradient_is_the_sum_over_its_group(kernel, device, causal_alignment, fully_masked, case):
    case = GradCase.of(case)
    q, k, v, do, mask = case.tensors(device)
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.detach()
    bounds = _bounds(case, q, k, v, mask, causal_alignment)
    no_key = bounds.reference.no_key_rows
    if fully_masked == "nan":
        assume(not bool(no_key.any()))
    # dO = 0 on queries without an admissible key: their gradient is MASK-FULLY-MASKED's and ATTN-GRAD-MASKED's
    # business (zeros, or the convention declared), and with dO = 0 they contribute nothing here whatever they output
    do = do.masked_fill(no_key[..., None].to(do.device), 0)
    contract = {k_: v_ for k_, v_ in case.contract(None).items()}
    _, shared = backward(kernel, q, k, v, do, mask, **contract)
    contract.pop("enable_gqa")
    wide_k, wide_v = (t.repeat_interleave(case.group, dim=1) for t in (k, v))
    _, per_head = backward(kernel, q, wide_k, wide_v, do, mask, **contract)
    check_group_sums(case, q, k, v, do, mask, shared, per_head, causal_alignment, subject=kernel.name,
                     contract=case.contract(None))


def check_group_sums(case: GradCase, q, k, v, do, mask, shared: dict, per_head: dict, causal_alignment: str, *,
                     subject: str = "", contract: dict | None = None) -> None:
    """ATTN-GRAD-GQA: dK and dV of the shared key/value heads (``shared``) equal those of the heads repeated
    (``per_head``) summed over each group, within the bound of each computation (SPEC.md, ATTN-GRAD-GQA)."""
    __tracebackhide__ = True
    scale = default_scale(case.e) if case.scale is None else case.scale
    bounds = _bounds(case, q, k, v, mask, causal_alignment)
    wide_k, wide_v = (t.repeat_interleave(case.group, dim=1) for t in (k, v))
    oracle = gradient_oracle(bounds, q, k, v, do, scale=scale)
    wide = gradient_oracle(_bounds(GradCase(**{**case.__dict__, "group": 1, "kv_heads": case.heads}),
                                   q, wide_k, wide_v, mask, causal_alignment), q, wide_k, wide_v, do, scale=scale)
    limits = {name: oracle.bound[name] + group_sum(wide.bound[name], case.kv_heads) for name in ("key", "value")}
    if contract is not None:   # --repro-dir: the two calls (shared heads, heads repeated) and this bound
        evidence.record("group-sum", subject=subject, device=str(q.device), upstream=do, bound=limits, inputs=dict(
            query=q, key=k, value=v, **({"attn_mask": mask} if mask is not None else {}), **contract))
    for name, bound in limits.items():
        summed = group_sum(to_float64(per_head[name]), case.kv_heads)
        assert_within(to_float64(shared[name]), summed, bound, what=f"d{name} of the shared heads",
                      reference=f"d{name} of the heads repeated, summed over each group of {case.group}")
