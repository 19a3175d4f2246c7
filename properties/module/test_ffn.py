"""The position-wise feed-forward network as a module (SPEC.md, "Modules": FFN-*).

The formula clause reads ``up``, ``down`` (and ``gate`` for swiglu); the variant is the config node's
``activation``.  Without them it is skipped with the reason; FFN-POSITIONWISE then runs in float64 with the
Models section's comparison tolerance.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import example, given, strategies as st

from properties import clause
from properties.core import evidence
from properties.core.assertions import assert_within
from properties.model.checks import comparison_tolerance
from properties.module.gradients import check_gradients, feed_forward
from properties.module.oracle import ffn_layers, ffn_oracle
from properties.module.parts import OneLine, call_module, inputs, module_settings, part_params
from properties.core.strategies import pinned_property, seeds
from properties.core.dtypes import selected_dtypes
from properties.kernel.cases import dtypes

FIRST = selected_dtypes()[0]


def pytest_generate_tests(metafunc):
    if "ffn" in metafunc.fixturenames:
        metafunc.parametrize("ffn", part_params(metafunc.config, "ffn"))


@dataclass(frozen=True)
class Ffn(OneLine):
    batch: int
    l: int
    d_model: int
    d_ff: int
    dtype: torch.dtype
    seed: int


problems = st.builds(Ffn, batch=st.integers(1, 3), l=st.integers(1, 6), d_model=st.integers(1, 12),
                     d_ff=st.integers(1, 24), dtype=dtypes(), seed=seeds)


# Pinned shape (drawn every run): B == L, odd d_model, and d_ff wide enough (16 hidden units of N(0, 4)
# inputs) that some pre-activations fall where a wrong activation departs from the formula (a forgotten one
# for t < 0, GELU's tanh form for exact GELU near |t| ≈ 2).
PINNED = Ffn(3, 3, 5, 16, FIRST, 0)
# The settings, the pinned shape, then drawn shapes: the stack of the clauses run on PINNED.
ffn_property = pinned_property(module_settings, {"p": problems}, {"p": PINNED})


def build(ffn, p: Ffn, device, dtype=None):
    return ffn.build(device, dtype or p.dtype, p.seed, d_model=p.d_model, d_ff=p.d_ff)


def forward(module, x):
    return call_module(module, x, expect=tuple(x.shape), like=x, what="ffn")


def oracle(ffn, module, x, dtype):
    """(the fp64 oracle, or None and the reason)."""
    name = ffn.get("activation")
    if name is None:
        return None, "the ffn node has no activation key: the formula's variant is unknown"
    layers, reason = ffn_layers(module, name)
    if layers is None:
        return None, reason
    return ffn_oracle(layers, name, x, dtype), ""


# ------------------------------------------------------------------------------------ FFN-POSITIONWISE
@clause("FFN-POSITIONWISE")
@ffn_property
def test_each_position_alone(ffn, device, p):
    module = build(ffn, p, device)
    x = inputs(p.seed, 1, (p.batch, p.l, p.d_model), p.dtype, device)
    ref, _ = oracle(ffn, module, x, p.dtype)
    if ref is None:   # black box: float64 and the comparison tolerance
        module = build(ffn, p, device, torch.float64)
        x = x.to(torch.float64)
    together = forward(module, x)
    alone = forward(module, x.reshape(p.batch * p.l, 1, p.d_model)).reshape(x.shape)
    bound = 2 * ref.error if ref is not None else torch.tensor(comparison_tolerance(together))
    assert_within(together, alone, bound, what="FFN(x)[b, i] in the sequence",
                  reference="FFN(x[b, i]) alone at position 0")


# ----------------------------------------------------------------------------------------- FFN-FORMULA
@clause("FFN-FORMULA")
@ffn_property
def test_formula_with_own_weights(ffn, device, p):
    module = build(ffn, p, device)
    x = inputs(p.seed, 1, (p.batch, p.l, p.d_model), p.dtype, device, scale=2.0)
    ref, reason = oracle(ffn, module, x, p.dtype)
    if ref is None:
        pytest.skip(reason)
    out = forward(module, x)
    words = dict(what=f"FFN(x) ({ffn.get('activation')})", reference="formula with the module's weights (fp64)")
    evidence.record_module_oracle(out, ref.value, ref.error, oracle="properties/module/oracle.py", **words)
    assert_within(out, ref.value, ref.error, **words)


# -------------------------------------------------------------------------------------------- FFN-GRAD
@clause("FFN-GRAD")
@module_settings
@example(p=Ffn(2, 3, 4, 8, FIRST, 0))
@given(p=problems)
def test_gradients_follow_the_formula(ffn, device, p):
    module = build(ffn, p, device)
    name = ffn.get("activation")
    layers, reason = (None, "the ffn node has no activation key") if name is None else ffn_layers(module, name)
    if layers is None:
        pytest.skip(reason)
    x = inputs(p.seed, 1, (p.batch, p.l, p.d_model), p.dtype, device)
    upstream = inputs(p.seed, 2, (p.batch, p.l, p.d_model), p.dtype, device)
    params = {n: t for n, t in module.named_parameters() if n.split(".")[0] in layers}
    failures = check_gradients(module, lambda m, x: m(x), lambda i, w: feed_forward(i["x"], w, name), {"x": x},
                               params, upstream, p.dtype, p.seed)
    assert not failures, f"gradients of sum(FFN(x) ∘ G) ({name}) depart from the formula's:\n  " + "\n  ".join(failures)
