"""Gradient clauses (SPEC.md, "Gradients"): the backward pass of a kernel whose output requires grad.

Axes: b batch, h query heads (h = k · group), k key/value heads, l queries, s keys, e and ev features. The
oracle and its bound are kernel/gradients.py. A kernel whose output does not require grad, or whose backward
raises NotImplementedError, has these clauses skipped with that reason.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import assume, example, given, strategies as st

from properties import clause
from properties.core import evidence
from properties.core.assertions import assert_all, assert_within
from properties.kernel.gradients import gradient_oracle, group_sum
from properties.kernel.limits import nearest_size
from properties.core.oracle import causal_allowed, default_scale, to_float64
from properties.core.strategies import derived_generator, on, random_bool_mask, require_dtype, seeded_rng, seeds
from properties.kernel.cases import dtypes
from properties.kernel.tiles import TILE_SHARE, drawn_head_size, kernel_limits, tile_shape
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

    @property
    def heads(self) -> int:
        return self.kv_heads * self.group

    def __repr__(self) -> str:
        return (f"GradCase(b={self.b}, h={self.heads}, kv_heads={self.kv_heads}, l={self.l}, s={self.s}, "
                f"e={self.e}, ev={self.ev}, dtype={self.dtype}, mask={self.mask!r}, causal={self.causal}, "
                f"scale={self.scale}, strided={self.strided}, seed={self.seed})")

    def _tensor(self, g, heads, length, features, device):
        if self.strided:  # the storage of a (b, l, h, e) projection, viewed as (b, h, l, e)
            t = torch.randn(self.b, length, heads, features, generator=g, dtype=torch.float64)
            return on(t, self.dtype, device).transpose(1, 2)
        return on(torch.randn(self.b, heads, length, features, generator=g, dtype=torch.float64), self.dtype, device)

    def tensors(self, device):
        """q, k, v, dO and the mask (or None), in the dtype on ``device``."""
        require_dtype(str(device), self.dtype)
        g = derived_generator(self.seed)
        q = self._tensor(g, self.heads, self.l, self.e, device)
        k = self._tensor(g, self.kv_heads, self.s, self.e, device)
        v = self._tensor(g, self.kv_heads, self.s, self.ev, device)
        do = self._tensor(g, self.heads, self.l, self.ev, device)
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


@st.composite
def grad_cases(draw, *, mask=None, causal=None, group=None, strided=None, weights=False) -> GradCase:
    """Backward problems: today's small ones, and one in TILE_SHARE at kernel scale (core/strategies.py); inside the
    limits of the kernel under test (a clause that needs a feature it declines asks for it anyway)."""
    limits = kernel_limits()
    masks = [m for m in MASKS if m == "none" or m.split("-")[0] in limits.masks]
    the_mask = draw(st.sampled_from(masks)) if mask is None else mask
    drawn_causal = limits.causal_only or (draw(st.booleans()) and limits.causal)
    is_causal = (drawn_causal if causal is None else causal) and the_mask == "none"
    the_group = (draw(st.integers(1, 2)) if limits.gqa else 1) if group is None else group
    big = draw(st.integers(0, TILE_SHARE - 1)) == TILE_SHARE - 1
    kv_heads, b = (1, 1) if big else (draw(st.integers(1, 2)), draw(st.integers(1, 2)))
    if big:
        l, s, e, ev = draw(tile_shape(kv_heads * the_group, weights=weights))
    else:
        l, s, e = draw(st.integers(1, 6)), draw(st.integers(1, 6)), draw(drawn_head_size(limits, 1, 8))
        ev = e if limits.equal_head_sizes else draw(drawn_head_size(limits, 1, 6))
        if limits.equal_lengths:
            l = s = max(l, s)
        l, s = limits.length(l), limits.length(s)
    scale = draw(st.one_of(st.none(), st.floats(0.05, 2.0))) if limits.explicit_scale else None
    return GradCase(b=b, kv_heads=kv_heads, group=the_group, l=l, s=s, e=e, ev=ev, dtype=draw(dtypes()),
                    mask=the_mask, causal=is_causal, scale=scale, seed=draw(seeds),
                    strided=(draw(st.booleans()) if strided is None else strided) and limits.strided)


# The kernel-scale problems pinned in every gradient clause (core/strategies.py, tile_pins): L = S = 65 causal,
# L = 65, S = 130 with E = 128 and a float mask that requires grad, S = 1024 in bfloat16, L = S = 129 causal, E = 96.
TILE_GRAD_PINS = (GradCase(1, 1, 1, 65, 65, 64, 64, torch.float32, "none", True, None, False, 0),
                  GradCase(1, 1, 1, 65, 130, 128, 64, torch.float32, "float-grad", False, None, False, 0),
                  GradCase(1, 1, 1, 3, 1024, 64, 64, torch.bfloat16, "none", False, None, False, 0),
                  GradCase(1, 1, 1, 129, 129, 96, 96, torch.float32, "none", True, None, False, 0))


def with_tile_pins(**other_args):
    """Decorator: the TILE_GRAD_PINS as explicit examples (``other_args``: the test's other drawn arguments)."""
    def decorate(test):
        for case in reversed(TILE_GRAD_PINS):
            test = example(case=case, **other_args)(test)
        return test
    return decorate


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
@example(case=GradCase(2, 2, 2, 3, 5, 4, 3, torch.float32, "float-grad", False, None, True, 0))  # GQA, strided
@example(case=GradCase(1, 1, 1, 5, 3, 3, 2, torch.float32, "none", True, 0.5, False, 1))  # causal, l != s
@example(case=GradCase(1, 1, 1, 2, 4, 3, 3, torch.bfloat16, "bool", False, None, True, 2))
@with_tile_pins()
@given(case=grad_cases())
def test_gradients_agree_with_float64_oracle(kernel, device, causal_alignment, fully_masked, case):
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
@example(case=GradCase(1, 1, 1, 3, 4, 3, 2, torch.float32, "bool", False, None, False, 0))
@example(case=GradCase(1, 1, 1, 65, 130, 128, 64, torch.float32, "bool", False, None, False, 0))
@given(case=grad_cases(mask="bool"))
def test_masked_keys_and_empty_queries_get_zero_gradient(kernel, device, fully_masked, case):
    if fully_masked != "zeros":
        pytest.skip(f"--fully-masked {fully_masked}: dQ of a query with no admissible key is not required to be 0")
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
@example(case=GradCase(1, 1, 1, 4, 4, 3, 2, torch.float32, "none", True, None, False, 0), row=1)
@example(case=GradCase(1, 1, 1, 3, 5, 3, 2, torch.float32, "none", True, None, True, 0), row=0)
@example(case=TILE_GRAD_PINS[0], row=64)   # the first row of the second 64-query tile
@given(case=grad_cases(mask="none", causal=True), row=st.one_of(st.integers(0, 5), st.sampled_from((63, 64, 65, 128))))
def test_upstream_gradient_reaches_only_allowed_keys(kernel, device, causal_alignment, case, row):
    assume(row < case.l)
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
@example(case=GradCase(1, 1, 1, 3, 4, 3, 4, torch.float32, "none", False, None, False, 0), p=0.5)
@given(case=grad_cases(mask="none", causal=False, group=1, weights=True),
       p=st.one_of(st.floats(0.1, 0.7), st.sampled_from([i / 16 for i in range(2, 12)])))   # (cuDNN's 1/16 steps)
def test_backward_uses_the_mask_the_forward_realised(kernel, device, case, p):
    """V = I: the output is the realised weight matrix W̃ (dropped and rescaled), so the mask is known. Ev = S must
    be a head size the kernel accepts: S moves to the nearest one (and E, L with it where the kernel needs Ev = E or
    L = S), so that one call realises the whole mask."""
    limits = kernel_limits()
    s = nearest_size(limits.head_sizes, case.s) if limits.head_sizes is not None else case.s
    case = GradCase(**{**case.__dict__, "s": s, "ev": s, "e": s if limits.equal_head_sizes else case.e,
                       "l": s if limits.equal_lengths else case.l})
    q, k, _, do, _ = case.tensors(device)
    v = torch.eye(case.s, dtype=case.dtype, device=device).expand(case.b, case.kv_heads, case.s, case.s)
    bounds = _bounds(case, q, k, v, None, "top-left")
    assume(bool((bounds.lower > 0).all()))   # every weight nonzero before dropout: a zero output means dropped
    with seeded_rng(device, case.seed):   # a kernel that declines dropout has this clause skipped (the guard)
        out, grads = backward(kernel, q, k, v.contiguous(), do, dropout_p=p, **case.contract(None))
    keep = to_float64(out) != 0
    scale = default_scale(case.e) if case.scale is None else case.scale
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
@example(case=GradCase(1, 2, 2, 3, 4, 4, 3, torch.float32, "none", False, None, True, 0))
@example(case=GradCase(1, 2, 2, 65, 130, 128, 64, torch.float32, "float", False, None, False, 0))
@example(case=GradCase(1, 1, 2, 1, 2, 8, 16, torch.bfloat16, "bool", False, None, False, 2))   # the query admits no key
@given(case=grad_cases(group=2))
def test_shared_kv_head_gradient_is_the_sum_over_its_group(kernel, device, causal_alignment, fully_masked, case):
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
