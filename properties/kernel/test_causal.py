"""Causal masking (paper 3.2.3): no information from later positions, exact zeros, and the alignment of
the diagonal when L != S (--causal-alignment)."""
from __future__ import annotations

import math

import torch
from hypothesis import assume, example, strategies as st

from properties import clause
from properties.core.assertions import assert_all
from properties.kernel.repeats import assert_unchanged
from properties.core.tolerance import output_bound, softmax_bounds
from properties.core.strategies import require_dtype
from properties.kernel.guard import NON_FINITE_CONVENTIONS, check_against_oracle
from properties.core.oracle import causal_allowed, to_float64
from properties.core.strategies import huge_values, on, rescale_keys
from properties.core.dtypes import selected_dtypes
from properties.kernel.problem_space import MAGNITUDE, SHAPES, Extra, Problem, Space
from properties.kernel.schedule import scheduled

# is_causal in every problem; scores typical, peaked or all very negative (SPEC.md, "Extreme scores under masks").
CAUSAL = dict(fixed={"attend": "causal"}, values=("gaussian", "peaked", "negative"), extras={"magnitude": MAGNITUDE})


def _offset(l: int, s: int, alignment: str) -> int:
    return 0 if alignment == "top-left" else s - l


def _no_key_rows(case, alignment):
    return ~causal_allowed(case.l, case.s, alignment).any(dim=-1)


# L = S = 65 with every score near -2^16 (float32's realistic range): rows whose admissible scores all lie below a
# finite running-max sentinel (a past bug: properties/catalog/state_bugs.py, running_max_sentinel).
NEGATIVE_ROWS = Problem(lead=(1, 1), l=65, s=65, e=64, ev=64, dtype=selected_dtypes()[0], seed=0, attend="causal",
                        values="negative", extras=(("magnitude", 1.0),))


@clause("CAUSAL-NO-FUTURE")
@scheduled(Space.of("CAUSAL-NO-FUTURE", **{**SHAPES, "S": ("short", "tile", "past256", "long")},
                    **{**CAUSAL, "extras": {**CAUSAL["extras"], "adversarial": Extra((True, False), st.booleans())}}))
def test_outputs_ignore_later_keys_and_values(kernel, device, case, causal_alignment, fully_masked):
    require_dtype(device, case.dtype)
    offset = _offset(case.l, case.s, causal_alignment)
    first_cut = max(1, offset + 1)  # keys from `cut` on are replaced; row 0 must not see any of them
    assume(first_cut <= case.s - 1)
    cut = int(torch.randint(first_cut, case.s, (1,), generator=case.generator(1)))
    q64, k64, v64 = case.qkv64()
    k_new, v_new = (t.clone() for t in (k64, v64))
    _, fresh_k, fresh_v = case.qkv64(stream=2)
    k_new[..., cut:, :], v_new[..., cut:, :] = fresh_k[..., cut:, :], fresh_v[..., cut:, :]
    if case.adversarial:  # huge but finite: scaled partial sums up to finfo.max/(4 sqrt E), values finfo.max/4
        big = torch.finfo(case.dtype).max / 4
        k_new[..., cut:, :] = rescale_keys(q64, k_new[..., cut:, :], 1 / math.sqrt(case.e), big / math.sqrt(case.e),
                                           big)
        v_new[..., cut:, :] = huge_values(v_new[..., cut:, :], case.dtype)
    q, k, v, k2, v2 = (on(t, case.dtype, device) for t in (q64, k64, v64, k_new, v_new))
    no_key = _no_key_rows(case, causal_alignment).expand(*case.lead, case.l) \
        if fully_masked in NON_FINITE_CONVENTIONS else None
    before = to_float64(kernel(q, k, v, is_causal=True, nan_rows=no_key))
    after = to_float64(kernel(q, k2, v2, is_causal=True, nan_rows=no_key))
    blind = torch.arange(case.l) + offset < cut  # rows whose admissible keys all precede the cut
    if fully_masked in ("mean", "any"):   # a row without keys may read every value (mean) or anything
        blind = blind & ~_no_key_rows(case, causal_alignment)
    assert_unchanged(after, before, lambda: to_float64(kernel(q, k, v, is_causal=True, nan_rows=no_key)),
                     lambda t: t[..., blind, :],
                     lambda: 2 * output_bound(softmax_bounds(q, k, v, is_causal=True,
                                                             causal_alignment=causal_alignment), v)[..., blind, :],
                     what=f"out after changing keys/values at positions >= {cut}", reference="out before",
                     note=f"; rows {torch.nonzero(blind).flatten().tolist()} admit only keys < {cut}",
                     subject=kernel.name, calls=(dict(query=q, key=k, value=v, is_causal=True),
                                                 dict(query=q, key=k2, value=v2, is_causal=True)))


@clause("CAUSAL-ZERO-ABOVE")
@scheduled(Space.of("CAUSAL-ZERO-ABOVE", **{n: c for n, c in SHAPES.items() if n != "Ev"}, weights=True, long_rows=True,
                    **CAUSAL))
def test_weights_above_the_diagonal_are_exactly_zero(kernel, device, case, causal_alignment, fully_masked):
    q, k, _ = case.qkv(device)
    allowed = causal_allowed(case.l, case.s, causal_alignment)
    no_key = ~allowed.any(dim=-1)
    w = to_float64(kernel.weights(q, k, is_causal=True,
                                  nan_rows=no_key.expand(*case.lead, case.l)
                                  if fully_masked in NON_FINITE_CONVENTIONS else None))
    above = ~allowed & ~no_key[:, None] if fully_masked != "zeros" else ~allowed
    assert_all(~above | (w == 0), w, what=f"weight is exactly 0 for keys j > i + offset "
                                          f"({causal_alignment} alignment)")


@clause("CAUSAL-ALIGNMENT")
@example(case=NEGATIVE_ROWS)
@scheduled(Space.of("CAUSAL-ALIGNMENT", **SHAPES, group=True, long_rows=True, **CAUSAL))
def test_causal_diagonal_alignment(kernel, device, case, causal_alignment, fully_masked):
    require_dtype(device, case.dtype)
    q, k, v = case.qkv(device)
    check_against_oracle(kernel, q, k, v, causal_alignment=causal_alignment, fully_masked=fully_masked,
                         **case.contract(device))
