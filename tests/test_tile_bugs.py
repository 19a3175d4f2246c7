"""The tile-boundary bugs (properties/catalog/tile_bugs.py) are exact wherever a problem fits one 64 x 64 tile with
E <= 64 — bitwise equal to the correct tiled kernel, forward and backward — and wrong past it; the correct tiled
kernel agrees with PyTorch's SDPA. The catalog test (tests/test_catalog.py) shows that the suite catches each on
its pinned problems."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from properties.catalog import CATALOG, tile_bugs
from properties.catalog.tiled import tiled_attention

# (L, S, E, Ev, mask, is_causal, kv heads of 2 query heads, dtype): one tile each, masks, causal, GQA, L != S.
ONE_TILE = [(64, 64, 64, 64, None, True, 2, torch.float32), (1, 64, 64, 16, "float", False, 1, torch.float32),
            (64, 5, 3, 7, "bool", False, 2, torch.bfloat16), (17, 64, 64, 64, None, False, 1, torch.float64),
            (33, 40, 48, 8, "float", False, 2, torch.float16)]
# Past one tile: the problems the suite pins (L = S = 65 causal; 65 x 130 with E = 128 and a float mask).
PAST_ONE_TILE = [(65, 65, 64, 64, None, True, 2, torch.float32), (65, 130, 128, 64, "float", False, 1, torch.float32)]


def _run(kernel, l, s, e, ev, mask, causal, kv_heads, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, heads, n, d, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
               for heads, n, d in ((2, l, e), (kv_heads, s, e), (kv_heads, s, ev)))
    attn_mask = None
    if mask == "bool":
        attn_mask = torch.rand(l, s, generator=g) < 0.7
    elif mask == "float":
        attn_mask = torch.randn(2, 1, l, s, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    out = kernel(q, k, v, attn_mask, is_causal=causal, enable_gqa=kv_heads != 2)
    leaves = [q, k, v] + ([attn_mask] if mask == "float" else [])
    grads = torch.autograd.grad(out, leaves, torch.randn(out.shape, generator=g, dtype=torch.float64).to(dtype))
    return out.detach(), grads


# The catalog's entries declared in tile_bugs.py.
NAMES = sorted(e.spec.partition(":")[2] for e in CATALOG if e.spec.partition(":")[0] == tile_bugs.__name__)


@pytest.mark.parametrize("name", NAMES)
def test_tile_bug_is_exact_on_one_tile_and_wrong_past_it(name):
    bug = getattr(tile_bugs, name)
    for problem in ONE_TILE:
        out, grads = _run(bug, *problem)
        expected_out, expected_grads = _run(tiled_attention, *problem)
        assert torch.equal(out, expected_out), (name, problem)
        assert all(torch.equal(a, b) for a, b in zip(grads, expected_grads)), (name, problem)
    differs = False
    for problem in PAST_ONE_TILE:
        out, grads = _run(bug, *problem)
        expected_out, expected_grads = _run(tiled_attention, *problem)
        differs |= not torch.allclose(out, expected_out) or not all(
            torch.allclose(a, b) for a, b in zip(grads, expected_grads))
    assert differs, f"{name} computes the same as the correct kernel past one tile"


@pytest.mark.parametrize("problem", ONE_TILE[:2] + PAST_ONE_TILE)
def test_the_tiled_kernel_agrees_with_sdpa(problem):
    problem = (*problem[:-1], torch.float64)
    out, grads = _run(tiled_attention, *problem)
    expected_out, expected_grads = _run(F.scaled_dot_product_attention, *problem)
    torch.testing.assert_close(out, expected_out, rtol=1e-12, atol=1e-12)
    for a, b in zip(grads, expected_grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
