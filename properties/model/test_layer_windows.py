"""MODEL-WINDOW layer by layer (SPEC.md, "Models"): each windowed layer's attention alone, through hooks on
``Subject.attention_modules``, whatever the other layers do.

The whole-model half of MODEL-WINDOW (properties/model/test_scale.py) sees a window only when every layer has one: a
global layer after a local one reaches every position, and the local layer's window disappears from the outputs
(Gemma 2 and 3 alternate them, Qwen2's ``max_window_layers`` and ``layer_types`` mix them). Here a zero tensor δ that
requires a gradient is added to the input of one attention module, and the gradient of that module's own output at
position p with respect to δ at position j is read: exactly 0 for every key outside the window (its softmax weight is
exactly 0), not exactly 0 for the farthest key inside it. No other layer lies on that path, so the other layers'
kinds do not matter.
"""
from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
from hypothesis import strategies as st

from properties import clause
from properties.core.hooks import first_output, hooks_in_place
from properties.model.checks import (Batch, assert_window_gradient, module_input, pinned_model_property,
                                     real_tokens, requires, subject_args)
from properties.model.scale import SLACK
from properties.model.twin import observe

def _lowest(low, high):
    """the lowest"""
    return low


# The shortest sequence with a key W back in the widest window, the first position perturbed, two samples.
PINS = ({"length": _lowest, "perturbed position": 0, "seed": 0, "batch size": 2},)


@contextmanager
def probed(module: torch.nn.Module):
    """Adds a zero δ (requires_grad) to the module's input hidden states; yields {"delta": δ, "out": output}."""
    seen: dict = {}

    def before(_, args, kwargs):
        hidden, put = module_input(args, kwargs)
        seen["delta"] = torch.zeros_like(hidden, requires_grad=True)
        return put(hidden + seen["delta"])

    def after(_, args, kwargs, output):
        seen["out"] = first_output(output)
    handles = [module.register_forward_pre_hook(before, with_kwargs=True),
               module.register_forward_hook(after, with_kwargs=True)]
    with hooks_in_place(handles):
        yield seen


def _windowed(s) -> list[tuple[int, int]]:
    return [(layer, w) for layer, w in enumerate(s.window or ()) if w is not None]


@clause("MODEL-WINDOW")
@pinned_model_property(PINS[0])
def test_window_in_each_layer(mut, data):
    s = mut.precise
    requires(s, "window", "the model declares no sliding window")
    requires(s, "attention_modules", "the windows are checked through the outputs only")
    layers = [(layer, w) for layer, w in _windowed(s) if w + 1 <= s.max_len]
    if not layers:
        pytest.skip(f"max_len={s.max_len}: no window W leaves a key W positions back (windows {tuple(s.window)})")
    widest = max(w for _, w in layers)
    low = min(widest + 1, s.max_len)
    length = data.draw(st.integers(low, min(s.max_len, low + SLACK)), label="length")
    j = data.draw(st.integers(0, max(0, length - min(w for _, w in layers) - 1)), label="perturbed position")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    size = data.draw(st.integers(1, 2), label="batch size")
    tokens = real_tokens(torch.Generator().manual_seed(seed), (size, length), s, mut.device)
    ones = torch.ones_like(tokens, dtype=torch.bool)
    src = None
    if s.kind == "encoder_decoder":
        source = Batch(size, 5, (5,) * size, seed + 2**17)
        src = (source.tokens(s, mut.device), source.mask(mut.device))
    for layer, w in layers:
        k = min(j, length - w - 1)                                              # a key W back exists
        with torch.enable_grad(), probed(s.attention_modules[layer]) as seen:
            s.forward(*subject_args(src, tokens, ones))
        assert "out" in seen, (f"Subject.attention_modules[{layer}] was not called by forward: expected the "
                               f"self-attention module of layer {layer}")
        distance = torch.arange(seen["out"].shape[1], device=mut.device) - k
        if s.kind == "encoder_only":
            distance = distance.abs()
        weights = torch.randn(seen["out"].shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        what = f"layer {layer} (window {w}: a query attends its {w} most recent keys, itself included)"
        for positions, attended in ((distance >= w, False), (distance == w - 1, True)):
            (grad,) = torch.autograd.grad((seen["out"] * weights.to(seen["out"]))[:, positions].sum(),
                                          seen["delta"], retain_graph=not attended)
            observe(s, grad, f"gradient through layer {layer}'s attention")
            far = positions.nonzero().flatten().tolist()
            assert_window_gradient(
                grad[:, k], attended, k,
                lambda dead: (f"{what}: its outputs at position {k + w - 1} have a gradient of exactly 0 with respect "
                              f"to its input at position {k} ({w - 1} back) in sample(s) {dead}: the layer does not "
                              f"attend the key W - 1 positions back"),
                lambda largest: (f"{what}: its outputs at positions {far[:4]}{'…' if len(far) > 4 else ''} (W or "
                                 f"more after {k}) have a non-zero gradient with respect to its input at position {k} "
                                 f"(largest {largest:.1e}): the layer attends a key W or more positions back"))
