"""ATTN-HISTORY (SPEC.md, "Integrity, history and layouts"): a problem's output does not depend on the calls before
it. A kernel is a function, so there is no fresh instance to compare with: every call of the sequence P, P,
h₁, …, h_n, P is held to the oracle (what the problem gives when nothing came before), and the last P to the first,
bitwise where the kernel repeats P bitwise."""
from __future__ import annotations

from dataclasses import replace

import torch
from hypothesis import example, strategies as st

from properties import clause
from properties.core.strategies import require_dtype
from properties.core.dtypes import selected_dtypes
from properties.kernel.problem_space import MASK_EXTRAS, SHAPES, Extra, Problem, Space
from properties.kernel.schedule import scheduled
from properties.kernel.tiles import kernel_limits
from properties.core.tolerance import deciding_output_bound
from properties.kernel.guard import check_against_oracle
from properties.kernel.integrity import assert_same_result, bitwise_equal

F32 = selected_dtypes()[0]
ATTENDS = ("none", "causal", "bool", "float")


def _changed(p: Problem, what: str, n: int) -> Problem:
    """P with one thing changed (``what``: s, l, lead, attend, dtype, group; the kernel's limits kept), a new seed."""
    limits = kernel_limits()
    if what in ("s", "l"):
        n = limits.length(n)
        p = replace(p, s=n, l=n) if limits.equal_lengths else replace(p, **{what: n})
    elif what == "lead":   # other sizes (the head axis a multiple of the group)
        lead = tuple(x % 3 + 1 for x in p.lead)
        if lead and p.group > 1:
            lead = (*lead[:-1], ((p.lead[-1] // p.group) % 3 + 1) * p.group)
        p = replace(p, lead=lead)
    elif what == "attend":
        allowed = [a for a in ATTENDS if a == "none" or (a == "causal" and limits.causal) or a in limits.masks]
        p = replace(p, attend=allowed[(allowed.index(p.attend) + 1) % len(allowed)] if p.attend in allowed else "none")
    elif what == "dtype":
        dtypes = limits.dtypes_among(selected_dtypes())
        p = replace(p, dtype=dtypes[(dtypes.index(p.dtype) + 1) % len(dtypes)] if p.dtype in dtypes else dtypes[0])
    elif what == "group" and p.lead:
        p = replace(p, group=1) if p.group > 1 else replace(p, group=2, lead=(*p.lead[:-1], 2 * p.lead[-1]))
    return replace(p, seed=p.seed + 1, classes=(), row=None)


def _call(kernel, device, p: Problem, causal_alignment, fully_masked, what: str, tensors=None):
    """The problem's output, checked against the oracle; (output, its oracle bounds, its values)."""
    q, k, v = tensors if tensors is not None else p.qkv(device)
    out, bounds = check_against_oracle(kernel, q, k, v, causal_alignment=causal_alignment, fully_masked=fully_masked,
                                       what=what, **p.contract(device))
    return out, (bounds, v.clone())


_P = Problem(lead=(1, 2), l=3, s=4, e=5, ev=3, dtype=F32, seed=0, attend="causal", history="s",
             extras=(("n", 8),))


@clause("ATTN-HISTORY")
# The same L, more keys: a mask cached under L alone serves the second S with the first's.
@example(case=_P)
@scheduled(Space.of("ATTN-HISTORY", **SHAPES, shrink=False, group=True, attend=ATTENDS, history=True,
                    requires=(lambda row: not (row.get("history") == "group" and row.get("rank") == "0"),),
                    extras={**MASK_EXTRAS, "n": Extra((8, 1, 16, 3, 12), st.integers(1, 16))}))
def test_output_does_not_depend_on_earlier_calls(kernel, device, causal_alignment, fully_masked, case):
    """P, P, h, P: h is P with one thing changed (its history class), or P's own tensors written in place with new
    contents (``in-place``: a KV cache updated between calls), then P's contents written back."""
    p = case
    require_dtype(device, p.dtype)
    tensors = p.qkv(device) if p.history == "in-place" else None
    first, bound = _call(kernel, device, p, causal_alignment, fully_masked, "out of P, called first", tensors)
    again, _ = _call(kernel, device, p, causal_alignment, fully_masked, "out of P, called again", tensors)
    if p.history == "in-place":
        saved = [t.clone() for t in tensors]
        with torch.no_grad():
            for t, new in zip(tensors, p.qkv(device, stream=4)):
                t.copy_(new)
        new_problem = replace(p, seed=p.seed + 1)   # (for the message: P's shapes, new contents)
        _call(kernel, device, p, causal_alignment, fully_masked, "out of P's tensors written in place with new "
              "contents (the same storage)", tensors)
        with torch.no_grad():
            for t, old in zip(tensors, saved):
                t.copy_(old)
        history = [f"P's tensors written in place ({new_problem!r}), then P's contents written back"]
    else:
        h = _changed(p, p.history, p.n)
        require_dtype(device, h.dtype)
        _call(kernel, device, h, causal_alignment, fully_masked, f"out of the history call ({h!r})")
        history = [repr(h)]
    last, _ = _call(kernel, device, p, causal_alignment, fully_masked, "out of P after the history", tensors)
    repeats = bitwise_equal(again, first)
    within = None if repeats else deciding_output_bound(last, first, *bound, factor=2)
    assert_same_result(last, first, repeats, within, what="out of P after the history",
                       reference="out of P called first", note=f"; history {history}")
