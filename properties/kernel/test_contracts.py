"""The declared contracts of a kernel (--deterministic, --batch-invariant; skipped unless the run declares them,
properties/plugin/contracts.py): bitwise-equal repeats, forward and backward, and a sequence's rows independent of
its batch."""
from __future__ import annotations

import torch
from hypothesis import strategies as st

from properties import clause
from properties.core import evidence
from properties.core.assertions import assert_identical
from properties.core.strategies import gaussian, on, random_bool_mask
from properties.kernel.problem_space import SHAPES, Extra, Space
from properties.kernel.schedule import scheduled

ATTENDS = ("none", "causal", "bool", "float")   # dropout is left out: its draws differ by design


def _contract(case, device, lead=None) -> dict:
    """The keyword arguments of the case's attend class (a mask of shape ``lead`` + (L, S))."""
    lead = case.lead if lead is None else lead
    if case.attend == "causal":
        return {"is_causal": True}
    if case.attend in ("bool", "float"):
        mask = random_bool_mask(case.generator(1), (*lead, case.l, case.s), 0.5)
        if case.attend == "float":
            mask = torch.zeros(mask.shape, dtype=case.dtype).masked_fill(~mask, float("-inf"))
        return {"attn_mask": mask.to(device)}
    return {}


def _forward_backward(kernel, q, k, v, upstream, contract):
    """(out, {dq, dk, dv} or {} when the kernel's output carries no gradient)."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = kernel(*leaves, **contract)
    if not out.requires_grad:
        return out.detach(), {}
    from properties.kernel.guard import backward_gradients
    grads = backward_gradients(kernel, out, upstream, dict(zip(("q", "k", "v"), leaves)))
    return out.detach(), {name: g.detach().clone() for name, g in grads.items()}


@clause("KERNEL-DETERMINISTIC")
@scheduled(Space.of("KERNEL-DETERMINISTIC", **SHAPES, shrink=False, attend=ATTENDS))
def test_repeated_calls_are_bitwise_equal(kernel, device, case):
    """The same call twice, a call on another problem between them (other shapes, values and flags: a kernel that
    keeps state between calls, or caches a plan by shape, shows it there)."""
    flavor = case.attend
    q, k, v = case.qkv(device)
    contract = _contract(case, device)
    upstream = on(gaussian(case.generator(3), *case.lead, case.l, case.ev), case.dtype, device)
    first, first_grads = _forward_backward(kernel, q, k, v, upstream, contract)
    oq, ok, ov = (on(t, case.dtype, device) for t in (gaussian(case.generator(4), *case.lead, case.l + 1, case.e),
                                                      gaussian(case.generator(4), *case.lead, case.s + 2, case.e),
                                                      gaussian(case.generator(4), *case.lead, case.s + 2, case.ev)))
    kernel(oq, ok, ov, is_causal=flavor != "causal")
    second, second_grads = _forward_backward(kernel, q, k, v, upstream, contract)
    every = torch.arange(first.numel())
    evidence.record("two-calls", subject=kernel.name, device=str(device), what=f"out of the second call ({flavor})",
                    reference="the first call", first=dict(query=q, key=k, value=v, **contract),
                    second=dict(query=q, key=k, value=v, **contract), index_first=every, index_second=every,
                    bitwise=True, upstream=upstream if first_grads else None,
                    between=[dict(query=oq, key=ok, value=ov, is_causal=flavor != "causal")])
    assert_identical(second, first, what=f"out of the second call ({flavor})", reference="out of the first call",
                     note="; a call on another problem ran between them")
    for name in first_grads:
        assert_identical(second_grads[name], first_grads[name], what=f"d{name} of the second backward ({flavor})",
                         reference="d" + name + " of the first")


BATCH_SIZES = (2, 3, 8)


@clause("KERNEL-BATCH-INVARIANT")
@scheduled(Space.of("KERNEL-BATCH-INVARIANT", **{**SHAPES, "rank": ("2",)}, shrink=False, attend=ATTENDS,
                    extras={"batch": Extra((8, 2, 3), st.sampled_from(BATCH_SIZES)),
                            "position": Extra((5, 0, 1, 7), st.integers(0, 7))}))
def test_sequence_rows_do_not_depend_on_the_batch(kernel, device, case):
    """Sequence 0 of the case, alone (batch 1), then at ``position`` in a batch of ``batch`` with other sequences."""
    flavor, batch = case.attend, case.batch
    position = case.position % batch
    heads = case.lead[1]
    q, k, v = (t[:1] for t in case.qkv(device))
    contract = _contract(case, device, lead=(batch, heads))
    g = case.generator(5)
    others = [on(gaussian(g, batch, heads, n, width), case.dtype, device)
              for n, width in ((case.l, case.e), (case.s, case.e), (case.s, case.ev))]
    batched = [torch.cat([o[:position], t, o[position + 1:]]) for o, t in zip(others, (q, k, v))]
    mine = {name: m[position:position + 1] for name, m in contract.items() if name == "attn_mask"}
    alone = kernel(q, k, v, **{**contract, **mine})
    out = kernel(*batched, **contract)
    in_batch = out[position:position + 1]
    evidence.record("two-calls", subject=kernel.name, device=str(device), what=f"rows of the sequence at position "
                    f"{position} of a batch of {batch} ({flavor})", reference="its rows computed alone",
                    first=dict(query=q, key=k, value=v, **{**contract, **mine}),
                    second=dict(zip(("query", "key", "value"), batched), **contract), bitwise=True,
                    index_first=torch.arange(alone.numel()),
                    index_second=evidence.flat_index(out.shape, lambda t: t[position:position + 1]))
    assert_identical(in_batch, alone, what=f"rows of the sequence at position {position} of a batch of {batch} "
                     f"({flavor})", reference="its rows computed alone (batch of 1)")
