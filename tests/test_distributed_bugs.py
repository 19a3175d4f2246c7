"""Each bug of the distributed catalog (properties/catalog/distributed_bugs.py) is wrong on a problem its contract
accepts, and its correct twin is right on the same problem: both run on W = 2 gloo ranks spawned here (no suite
machinery: the shards are cut and the answers compared in this file) and are compared with attention over the whole
sequence written from the definition in float64, forward and backward.

A bug whose forward is right (the backward bugs) is shown right there too: the gradients alone depart. The 16-bit
merge is the one bug that needs half precision: its error is compared with the correct ring's in the same dtype.
tests/test_catalog.py checks that the suite's clauses catch each of them.
"""
from __future__ import annotations

import datetime
import math

import pytest
import torch

from spawned_ranks import run_ranks

WORLD = 2
TIMEOUT = 120   # seconds for the whole run (spawn, import torch, every case on both ranks)
BUGS = "properties.catalog.distributed_bugs"

def _case(kernel, *, causal, twin="ring", layout="contiguous", heads=2, kv_heads=2, length=8, dtype=torch.float64,
          spread=1.0):
    """(kernel, twin, layout, problem), problem = (heads, kv_heads, length, causal, dtype, spread): the twins are the
    zoo's kernels (by name) or the catalog's balanced zigzag ring."""
    return kernel, twin, layout, (heads, kv_heads, length, causal, dtype, spread)


HALF = dict(length=4, spread=16.0)   # the 16-bit merge: scores in the tens
CASES = {
    "stale_kv_backward": _case("stale_kv_backward", causal=False),
    "zigzag_chunks_swapped_in_backward": _case("zigzag_chunks_swapped_in_backward", causal=True, layout="zigzag"),
    "kv_transposed_twice_in_backward": _case("kv_transposed_twice_in_backward", causal=False, length=4),
    "local_lse_in_backward": _case("local_lse_in_backward", causal=True),
    "ring_receives_into_callers_shards": _case("ring_receives_into_callers_shards", causal=False),
    "causal_mask_from_local_positions": _case("causal_mask_from_local_positions", causal=True),
    "rank_offset_off_by_one": _case("rank_offset_off_by_one", causal=True),
    **{f"partial_states_in_16_bits, {dtype}": _case("partial_states_in_16_bits", causal=True,
                                                     dtype=getattr(torch, dtype), **HALF)
       for dtype in ("bfloat16", "float16", "float32")},
    "empty_block_finite_lse": _case("empty_block_finite_lse", causal=True),
    "scale_twice_on_remote_blocks": _case("scale_twice_on_remote_blocks", causal=False),
    **{name: _case("balanced_schedule_when_not_causal", causal=causal, twin="balanced_zigzag", layout="zigzag")
       for name, causal in (("balanced_schedule_when_not_causal", False),
                            ("balanced_schedule_when_not_causal, causal", True))},
    "ulysses_heads_and_rows_swapped": _case("ulysses_heads_and_rows_swapped", causal=False, twin="ulysses"),
    "ulysses_kv_heads_tiled": _case("ulysses_kv_heads_tiled", causal=True, twin="ulysses", heads=6, kv_heads=3),
    "ulysses_kv_heads_tiled, one key/value head": _case("ulysses_kv_heads_tiled", causal=True, twin="ulysses",
                                                        heads=4, kv_heads=1),
    "allgather_without_dkv_reduction": _case("allgather_without_dkv_reduction", causal=True, twin="allgather_kv"),
}


def _rows(rank: int, length: int, layout: str) -> torch.Tensor:
    """The rows rank ``rank`` holds: written here from the layouts' definitions."""
    if layout == "contiguous":
        step = length // WORLD
        return torch.arange(rank * step, (rank + 1) * step)
    chunk = length // (2 * WORLD)
    return torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk),
                      torch.arange((2 * WORLD - 1 - rank) * chunk, (2 * WORLD - rank) * chunk)])


def _attention(q, k, v, causal: bool):
    """softmax(q kᵀ / √E) v over the whole sequence, key/value heads grouped (query head i reads i // (H / H_kv))."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), -math.inf)
    return torch.softmax(s, -1) @ v


def _problem(heads, kv_heads, length, spread, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = ((1, heads, length, 16), (1, kv_heads, length, 16), (1, kv_heads, length, 8), (1, heads, length, 8))
    q, k, v, do = (torch.randn(*shape, generator=g, dtype=torch.float64) for shape in shapes)
    return q * spread, k, v, do


def _run(kernel, layout, problem, rank):
    """This rank's errors against float64 (the largest over its rows of out, dq, dk, dv) and whether it wrote into
    its shards."""
    from zoo.nn.context_parallel import resolve_context_parallel
    heads, kv_heads, length, causal, dtype, spread = problem
    q, k, v, do = _problem(heads, kv_heads, length, spread)
    q, k, v, do = (t.to(dtype).to(torch.float64) for t in (q, k, v, do))   # the problem exact in the tested dtype
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    want = _attention(*whole, causal)
    want.backward(do)
    rows = _rows(rank, length, layout)
    shards = [t[:, :, rows].to(dtype).requires_grad_() for t in (q, k, v)]
    copies = [t.detach().clone() for t in shards]
    fn = resolve_context_parallel(kernel, layout)
    out = fn(*shards, is_causal=causal, enable_gqa=kv_heads != heads, group=None)
    changed = any(not torch.equal(s.detach(), c) for s, c in zip(shards, copies))
    out.backward(do[:, :, rows].to(dtype))
    errors = {"out": float((out.double() - want[:, :, rows]).abs().max())}
    for name, mine, ref in zip(("dq", "dk", "dv"), shards, whole):
        errors[name] = float((mine.grad.double() - ref.grad[:, :, rows]).abs().max())
    return errors, changed


def _rank(rank: int, store: str, results) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=TIMEOUT / 2))
    got = {}
    for name, (bug, twin, layout, problem) in CASES.items():
        twin_spec = twin if twin in ("ring", "ulysses", "allgather_kv") else f"{BUGS}:{twin}"
        got[name] = {"bug": _run(f"{BUGS}:{bug}", layout, problem, rank),
                     "twin": _run(twin_spec, layout, problem, rank)}
    results.put((rank, got))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def errors(tmp_path_factory):
    """name -> {"bug" | "twin": ({quantity: the largest error over both ranks}, whether a rank wrote its shards)}."""
    store = tmp_path_factory.mktemp("distributed-bugs") / "store"
    got = run_ranks(_rank, WORLD, (str(store),), TIMEOUT)
    merged = {}
    for name in CASES:
        merged[name] = {}
        for who in ("bug", "twin"):
            per_rank = [got[r][name][who] for r in range(WORLD)]
            worst = {q: max(e[q] for e, _ in per_rank) for q in per_rank[0][0]}
            merged[name][who] = (worst, any(changed for _, changed in per_rank))
    return merged


EXACT = 1e-12      # float64 twins: the rounding of a few hundred float64 operations
WRONG = 1e-2       # a bug's departure on these problems of order one


# name -> (what the bug gets wrong on its problem, what it still gets right there)
BACKWARD = ("dq", "dk", "dv")
DEPARTS = {
    "stale_kv_backward": (BACKWARD, ("out",)),
    "zigzag_chunks_swapped_in_backward": (BACKWARD, ("out",)),
    "kv_transposed_twice_in_backward": (BACKWARD, ("out",)),
    "local_lse_in_backward": (BACKWARD, ("out",)),
    "ring_receives_into_callers_shards": (("dk", "dv"), ("out", "dq")),   # not causal: dQ sums both blocks anyway
    "causal_mask_from_local_positions": (("out",), ()),
    "rank_offset_off_by_one": (("out",), ()),
    "empty_block_finite_lse": (("out",), ()),
    "scale_twice_on_remote_blocks": (("out",), ()),
    "balanced_schedule_when_not_causal": (("out",), ()),
    "ulysses_heads_and_rows_swapped": (("out",), ()),
    "ulysses_kv_heads_tiled": (("out",), ()),
    "allgather_without_dkv_reduction": (("dk", "dv"), ("out", "dq")),
}


@pytest.mark.parametrize("name", sorted(DEPARTS))
def test_each_bug_departs_from_float64_where_its_twin_is_exact(errors, name):
    (bug, _), (twin, twin_changed) = errors[name]["bug"], errors[name]["twin"]
    assert max(twin.values()) < EXACT and not twin_changed, (name, twin)
    wrong, right = DEPARTS[name]
    assert all(bug[q] > WRONG for q in wrong), (name, bug)
    assert all(bug[q] < EXACT for q in right), (name, bug)


def test_the_ring_that_receives_into_its_inputs_writes_the_callers_shards(errors):
    assert errors["ring_receives_into_callers_shards"]["bug"][1]
    assert errors["ring_receives_into_callers_shards"]["bug"][0]["out"] < EXACT   # a healthy forward


@pytest.mark.parametrize("name", ["balanced_schedule_when_not_causal, causal",
                                  "ulysses_kv_heads_tiled, one key/value head", "partial_states_in_16_bits, float32"])
def test_each_bug_is_exact_where_its_class_is_absent(errors, name):
    """The half-block schedule is right under is_causal; one key/value head tiles as it groups; float32 states are
    what the ring keeps anyway."""
    (bug, _), (twin, _) = errors[name]["bug"], errors[name]["twin"]
    limit = EXACT if "float32" not in name else 0.0
    assert all(bug[q] <= max(limit, twin[q]) for q in bug), (name, bug, twin)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_partial_states_in_16_bits_depart_further_than_the_correct_ring_in_the_same_dtype(errors, dtype):
    """Scores in the tens: a 16-bit LSE moves the backward's weights exp(s − λ) by its rounding, several times the
    error the correct ring (states in float32, one rounding of the output) makes in the same dtype."""
    (bug, _), (twin, _) = errors[f"partial_states_in_16_bits, {dtype}"]["bug"], \
        errors[f"partial_states_in_16_bits, {dtype}"]["twin"]
    assert max(bug[q] / twin[q] for q in ("dq", "dk", "dv")) > 4, (bug, twin)
