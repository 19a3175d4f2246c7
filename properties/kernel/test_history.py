"""ATTN-HISTORY (SPEC.md, "Integrity, history and layouts"): a problem's output does not depend on the calls before
it. A kernel is a function, so there is no fresh instance to compare with: every call of the sequence P, P,
h₁, …, h_n, P is held to the oracle (what the problem gives when nothing came before), and the last P to the first,
bitwise where the kernel repeats P bitwise."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from hypothesis import example, given, strategies as st

from properties import clause
from properties.core.strategies import require_dtype, selected_dtypes
from properties.kernel.cases import Case, cases, dtypes
from properties.kernel.tiles import kernel_limits
from properties.core.tolerance import output_bound
from properties.kernel.guard import check_against_oracle
from properties.kernel.integrity import FEW, assert_same_result, attends, bitwise_equal, contract

F32 = selected_dtypes()[0]


@dataclass(frozen=True)
class Problem:
    """A case and how its queries are restricted (none | causal | bool | float)."""
    case: Case
    attend: str

    def __repr__(self) -> str:
        c = self.case
        return (f"Problem(lead={c.lead}, l={c.l}, s={c.s}, e={c.e}, ev={c.ev}, {str(c.dtype).removeprefix('torch.')}, "
                f"{self.attend}, seed={c.seed})")


# One change to P per history call: what real callers vary between calls of one kernel.
CHANGES = ("s", "l", "lead", "attend", "dtype")


@st.composite
def _changed(draw, p: Problem) -> Problem:
    """P with one thing changed (the kernel's limits kept: equal lengths, length multiples, masks)."""
    limits, what = kernel_limits(), draw(st.sampled_from(CHANGES))
    case = p.case
    if what in ("s", "l"):
        n = limits.length(draw(st.integers(1, 16)))
        case = replace(case, s=n, l=n) if limits.equal_lengths else replace(case, **{what: n})
    elif what == "lead":
        case = replace(case, lead=tuple(draw(st.integers(1, 3)) for _ in case.lead))
    elif what == "dtype":
        case = replace(case, dtype=draw(dtypes()))
    attend = draw(attends()) if what == "attend" else p.attend
    return Problem(replace(case, seed=draw(st.integers(0, 2**16))), attend)


@st.composite
def histories(draw):
    """(P, the history h₁ … h_n), n from 1 to 3."""
    p = Problem(draw(cases(tiles=False)), draw(attends()))
    return p, tuple(draw(st.lists(_changed(p), min_size=1, max_size=3)))


def _call(kernel, device, p: Problem, causal_alignment, fully_masked, what: str):
    """The problem's output, checked against the oracle; (output, its oracle bound)."""
    q, k, v = p.case.qkv(device)
    out, bounds = check_against_oracle(kernel, q, k, v, causal_alignment=causal_alignment, fully_masked=fully_masked,
                                       what=what, **contract(p.case, p.attend, device))
    return out, output_bound(bounds, v)


_P = Problem(Case(lead=(1, 2), l=3, s=4, e=5, ev=3, dtype=F32, seed=0), "causal")


@clause("ATTN-HISTORY")
# The same L, more keys: a mask cached under L alone serves the second S with the first's.
@example(history=(_P, (replace(_P, case=replace(_P.case, s=8)),)))
# Causal, then a bool mask, then the other dtype and other leading dims: whatever the kernel keeps per call.
@example(history=(replace(_P, attend="bool"), (_P, Problem(replace(_P.case, dtype=torch.bfloat16), "float"),
                                               Problem(replace(_P.case, lead=(2, 3)), "none"))))
@FEW
@given(history=histories())
def test_output_does_not_depend_on_earlier_calls(kernel, device, causal_alignment, fully_masked, history):
    p, earlier = history
    for problem in (p, *earlier):
        require_dtype(device, problem.case.dtype)
    first, bound = _call(kernel, device, p, causal_alignment, fully_masked, "out of P, called first")
    again, _ = _call(kernel, device, p, causal_alignment, fully_masked, "out of P, called again")
    for i, h in enumerate(earlier, 1):
        _call(kernel, device, h, causal_alignment, fully_masked, f"out of history call {i} ({h!r})")
    last, _ = _call(kernel, device, p, causal_alignment, fully_masked, "out of P after the history")
    assert_same_result(last, first, bitwise_equal(again, first), 2 * bound, what="out of P after the history",
                       reference="out of P called first", note=f"; history {list(earlier)}")
