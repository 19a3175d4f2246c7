"""The online-softmax state bugs (properties/catalog/state_bugs.py) hide where the suite's earlier draws looked: each
is bitwise equal to the correct tiled kernel on gaussian problems across several key tiles (the sentinel and the
masked-tile bug in every dtype with random masks, the state-rounding bug in float32), and differs only on the
problems the new draws make: very negative rows, whole masked 64-key tiles, long rows in bfloat16. The catalog test
(tests/test_catalog.py) shows that the suite catches each on its pinned problems; the dropout bug
(dropout_mask_shared_across_heads) passes DROPOUT-RATE and DROPOUT-EXPECTATION there, caught by DROPOUT-INDEPENDENT
only."""
from __future__ import annotations

import torch

from properties.catalog import state_bugs
from properties.catalog.tiled import tiled_attention
from properties.kernel.magnitudes import Scores, covered_tiles
from properties.kernel.cases import Case


def _problem(l, s, dtype, scores=Scores(), cover=None, seed=0):
    case = Case(lead=(2, 2), l=l, s=s, e=64, ev=16, dtype=dtype, seed=seed)
    q, k, v = case.qkv64()
    q, k = scores.apply(q, k, 1 / 8, dtype, case.generator(3))
    mask = (torch.rand(2, 2, l, s, generator=case.generator(1)) < 0.7) & ~covered_tiles((2, 2, l, s), cover,
                                                                                       case.generator(4))
    mask[..., -1] |= ~mask.any(-1)
    return [t.to(dtype) for t in (q, k, v)] + [mask]


def _same(bug, problem) -> bool:
    return torch.equal(bug(*problem), tiled_attention(*problem))


def test_each_bug_is_exact_on_gaussian_problems_across_tiles():
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        problem = _problem(5, 200, dtype)
        assert _same(state_bugs.running_max_sentinel, problem), dtype
        assert _same(state_bugs.masked_tile_resets_max, problem), dtype
    assert _same(state_bugs.state_rounded_per_tile, _problem(3, 1024, torch.float32))


def test_each_bug_differs_where_the_new_draws_look():
    negative = _problem(5, 65, torch.float32, Scores("negative", 1.0))
    assert not torch.allclose(state_bugs.running_max_sentinel(*negative), tiled_attention(*negative))
    covered = _problem(9, 130, torch.float32, cover=64)
    assert not torch.allclose(state_bugs.masked_tile_resets_max(*covered), tiled_attention(*covered))
    long_row = _problem(3, 1024, torch.bfloat16)
    assert not torch.equal(state_bugs.state_rounded_per_tile(*long_row), tiled_attention(*long_row))
