"""Encoder and decoder layers (SPEC.md, "Modules": LAYER-*), checked against their own sub-modules.

The layers are those of a tiny model built in float64 from the config (properties/module/parts.py): by default
one encoder-decoder per default composition (post- and pre-norm), with ``--zoo`` the model the overrides
build.  Two float64 evaluations are compared with the Models section's comparison tolerance.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import example, given, strategies as st

from properties import clause
from properties.core.assertions import assert_identical
from properties.core.hooks import hooks_in_place
from properties.core.strategies import PinnedData, pinned_property
from properties.model.checks import assert_same_output, comparison_tolerance
from properties.module.parts import OneLine, inputs, layer_params, layer_subject, module_settings

ENCODER_PARTS = ("self_attn", "ffn", "attn_block.norm", "ffn_block.norm")


def pytest_generate_tests(metafunc):
    if "layer_key" in metafunc.fixturenames:
        name = metafunc.function.__name__
        placement = "post" if "post_norm" in name else "pre" if "pre_norm" in name else None
        metafunc.parametrize("layer_key", layer_params(metafunc.config, placement))


@dataclass(frozen=True)
class Draw(OneLine):
    batch: int
    l: int
    s: int
    seed: int


draws = st.builds(Draw, batch=st.integers(1, 3), l=st.integers(1, 8), s=st.integers(1, 8),
                  seed=st.integers(0, 2**32 - 1))


# Pinned shape (drawn every run): B == L == 3 (an axis mixed up with another raises no shape error) and a
# memory of 5 positions, so that the decoder's length differs from the encoder's.
PINNED = Draw(batch=3, l=3, s=5, seed=0)
# The settings, the pinned shape, then drawn shapes: the stack of every layer clause with one drawn argument.
layer_property = pinned_property(module_settings, {"p": draws}, {"p": PINNED})


def _get(obj, dotted: str):
    for name in dotted.split("."):
        obj = getattr(obj, name, None)
    return obj


def subject_for(layer_key, device, p: Draw):
    subject = layer_subject(layer_key, device)
    if subject.reason:
        pytest.skip(subject.reason)
    subject.reseed(p.seed)
    return subject


def layers_of(subject):
    """[(kind, index, layer)] for every layer, skipping (with the reason) a layer without the named parts."""
    found = [("encoder", i, layer) for i, layer in enumerate(subject.encoder_layers)]
    found += [("decoder", i, layer) for i, layer in enumerate(subject.decoder_layers)]
    for kind, i, layer in found:
        needed = ENCODER_PARTS + (("cross_block.norm",) if getattr(layer, "cross_attn", None) is not None else ())
        missing = [name for name in needed if _get(layer, name) is None]
        if missing:
            pytest.skip(f"{kind} layer {i} ({type(layer).__qualname__}) has no {', '.join(missing)}: the layer "
                        f"clauses compose {', '.join(ENCODER_PARTS)} (decoder: cross_attn, cross_block.norm)")
    return found


def tensors(subject, p: Draw, device):
    d = subject.d_model
    return (inputs(p.seed, 1, (p.batch, p.l, d), torch.float64, device),
            inputs(p.seed, 2, (p.batch, p.s, d), torch.float64, device))


def run_layer(kind, layer, x, memory):
    with torch.no_grad():
        return layer(x) if kind == "encoder" else layer(x, memory)


def sublayers(kind, layer, memory):
    """[(norm, sublayer)] in the order the layer applies them."""
    steps = [(layer.attn_block.norm, (lambda h: layer.self_attn(h)) if kind == "encoder"
              else (lambda h: layer.self_attn(h, is_causal=True)))]
    if kind == "decoder" and getattr(layer, "cross_attn", None) is not None:
        steps.append((layer.cross_block.norm, lambda h: layer.cross_attn(h, memory)))
    steps.append((layer.ffn_block.norm, layer.ffn))
    return steps


def equation(kind, layer, x, memory, placement):
    """post: x <- Norm(x + Sublayer(x)); pre: x <- x + Sublayer(Norm(x)); for each sub-layer in turn."""
    with torch.no_grad():
        for norm, sublayer in sublayers(kind, layer, memory):
            x = norm(x + sublayer(x)) if placement == "post" else x + sublayer(norm(x))
    return x


def _check_equation(layer_key, device, p, placement):
    subject = subject_for(layer_key, device, p)
    if subject.placement != placement:
        pytest.skip(f"the layers are {subject.placement}-norm (norm_placement={subject.placement})")
    x, memory = tensors(subject, p, device)
    for kind, i, layer in layers_of(subject):
        assert_same_output(run_layer(kind, layer, x, memory), equation(kind, layer, x, memory, placement),
                           f"{kind} layer {i} output vs the {placement}-norm equation on its own sub-modules")


# ------------------------------------------------------------------------------------- LAYER-POST-NORM
@clause("LAYER-POST-NORM")
@layer_property
def test_post_norm_equation(layer_key, device, p):
    _check_equation(layer_key, device, p, "post")


# -------------------------------------------------------------------------------------- LAYER-PRE-NORM
@clause("LAYER-PRE-NORM")
@layer_property
def test_pre_norm_equation(layer_key, device, p):
    _check_equation(layer_key, device, p, "pre")


# ------------------------------------------------------------------------------------- LAYER-RESIDUAL
@clause("LAYER-RESIDUAL")
@layer_property
def test_residual_carries_the_input(layer_key, device, p):
    subject = subject_for(layer_key, device, p)
    x, memory = tensors(subject, p, device)
    for kind, i, layer in layers_of(subject):
        silenced = [m for m in (layer.self_attn, getattr(layer, "cross_attn", None), layer.ffn) if m is not None]
        with hooks_in_place([m.register_forward_hook(lambda module, args, out: torch.zeros_like(out))
                             for m in silenced]):
            out = run_layer(kind, layer, x, memory)
            if subject.placement == "pre":
                assert_identical(out, x, what=f"{kind} layer {i} with every sub-layer output 0",
                                 reference="its input x (x + 0)")
            else:
                expected = x
                with torch.no_grad():
                    for norm, _ in sublayers(kind, layer, memory):
                        expected = norm(expected)
                assert_same_output(out, expected, f"{kind} layer {i} with every sub-layer output 0 vs its "
                                                  f"norms applied in turn to x")


# ---------------------------------------------------------------------------- LAYER-STACK-PERMUTATION
@clause("LAYER-STACK-PERMUTATION")
@module_settings
@example(p=PINNED, data=PinnedData({"permutation": (2, 0, 1)}))
@given(p=draws.filter(lambda d: d.l >= 3), data=st.data())
def test_stack_permutation(layer_key, device, p, data):
    subject = subject_for(layer_key, device, p)
    if not subject.encoder_layers:
        pytest.skip("the model has no encoder layers (a decoder stack is causal, hence never equivariant)")
    # Neither the identity nor the reversal: positions symmetric in |i - j| (ALiBi in an encoder) are
    # exactly equivariant under the reversal, the only other permutation that keeps every distance.
    order = data.draw(st.permutations(range(p.l)).filter(lambda o: list(o) not in (sorted(o), sorted(o)[::-1])),
                      label="permutation")
    perm = torch.tensor(order, device=device)
    x, _ = tensors(subject, p, device)
    pos = subject.pos

    def stack(h):
        with torch.no_grad():
            if pos is not None:
                h = pos(h, 0)
            for layer in subject.encoder_layers:
                h = layer(h, positions=pos)
        return h

    out, permuted = stack(x), stack(x[:, perm])
    if not getattr(pos, "injects_order", True):
        assert_same_output(permuted, out[:, perm], f"stack(Px) vs P stack(x), permutation {order}, no positions")
        return
    tolerance = 2 * comparison_tolerance(out)
    difference = float((permuted - out[:, perm]).abs().max())
    assert difference > tolerance, (
        f"with positions ({type(pos).__qualname__}) stack(Px) = P stack(x) within {tolerance:.1e} (max difference "
        f"{difference:.1e}) for permutation {order}: the positional encoding does not reach the layers")
