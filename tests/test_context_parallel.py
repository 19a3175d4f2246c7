"""The zoo's partial states, merges and context-parallel kernels (zoo/nn/partial.py, collectives.py,
context_parallel.py) against attention written from the definition in float64.

The merges run here in one process. The kernels run on W = 2 gloo ranks spawned on 127.0.0.1 with every collective
under a time limit (gloo's timeout, and the ranks killed past it); the spec suite's distributed level holds them to
the float64 oracle on drawn problems (tests/test_distributed.py), this is the plain check of their arithmetic.
"""
from __future__ import annotations

import datetime
import math
import socket

import pytest
import torch

from spawned_ranks import run_ranks
from zoo.nn.partial import block_attention, merge, merge_state, merge_states

TIMEOUT = 120   # seconds for the whole W = 2 run (spawn, import torch, every kernel forward and backward)


def _reference(q, k, v, *, causal=False, scale=None, q_positions=None, k_positions=None):
    """softmax(σ q kᵀ) v and the row log-sum-exp, float64, keys after the query's position masked when asked."""
    h = q.shape[1]
    k, v = k.repeat_interleave(h // k.shape[1], 1), v.repeat_interleave(h // v.shape[1], 1)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = (q * scale) @ k.transpose(-1, -2)
    if causal:
        qp = torch.arange(q.shape[2]) if q_positions is None else q_positions
        kp = torch.arange(k.shape[2]) if k_positions is None else k_positions
        s = s.masked_fill(kp[None, :] > qp[:, None], -math.inf)
    lse = torch.logsumexp(s, -1)
    w = torch.where(torch.isfinite(lse)[..., None], torch.exp(s - lse.nan_to_num(neginf=0)[..., None]), 0.0)
    return w @ v, lse


def _problem(b=2, h=4, hk=2, l=6, s=7, e=5, ev=3, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)
                 for shape in ((b, h, l, e), (b, hk, s, e), (b, hk, s, ev)))


def test_block_attention_is_the_partial_state_and_empty_rows_are_zero_and_minus_infinity():
    q, k, v = _problem()
    qp, kp = torch.tensor([0, 1, 2, 3, 4, 5]), torch.tensor([2, 3, 4, 5, 6, 7, 8])   # rows 0, 1: no key
    out, lse = block_attention(q, k, v, scale=0.7, q_positions=qp, k_positions=kp)
    want, want_lse = _reference(q, k, v, causal=True, scale=0.7, q_positions=qp, k_positions=kp)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-12)
    assert torch.equal(out[:, :, :2], torch.zeros_like(out[:, :, :2]))
    assert bool((lse[:, :, :2] == -math.inf).all())
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = block_attention(*leaves, scale=0.7, q_positions=qp, k_positions=kp)
    (out.sum() + lse.nan_to_num(neginf=0).sum()).backward()
    assert all(bool(t.grad.isfinite().all()) for t in leaves), "an empty row's gradient is not finite"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_merges_of_a_key_split_equal_the_whole(dtype):
    q, k, v = _problem(s=9, dtype=dtype)
    cuts = [(0, 0), (0, 4), (4, 9)]   # an empty part, then two halves
    states = [block_attention(q, k[:, :, a:b], v[:, :, a:b], scale=0.5) for a, b in cuts]
    whole, whole_lse = _reference(*(t.double() for t in (q, k, v)), scale=0.5)
    out, lse = states[0]
    for block_out, block_lse in states[1:]:
        out, lse = merge(out, lse, block_out, block_lse)
    tolerance = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(out.double(), whole, rtol=0, atol=tolerance)
    torch.testing.assert_close(lse.double(), whole_lse, rtol=0, atol=tolerance)
    # FlashInfer's layouts: (seq, heads, dim) and (seq, states, heads, dim)
    flat = [(o[0].permute(1, 0, 2).to(dtype), s_[0].permute(1, 0).to(torch.float64 if dtype == torch.float64 else torch.float32)) for o, s_ in states]
    pair_v, pair_s = merge_state(*flat[1], *flat[2])
    many_v, many_s = merge_states(torch.stack([f[0] for f in flat], 1), torch.stack([f[1] for f in flat], 1))
    for v_, s_ in ((pair_v, pair_s), (many_v, many_s)):
        assert v_.dtype == dtype and s_.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        torch.testing.assert_close(v_.double(), whole[0].permute(1, 0, 2), rtol=0,
                                   atol=tolerance if dtype != torch.bfloat16 else 2e-2)
        torch.testing.assert_close(s_.double(), whole_lse[0].permute(1, 0), rtol=0, atol=max(tolerance, 1e-5))


def test_merging_only_empty_states_gives_zero_and_minus_infinity():
    out = torch.randn(3, 2, 4)   # whatever an empty state's output holds, it has no weight
    lse = torch.full((3, 2), -math.inf)
    v, s = merge_state(out, lse, out + 1, lse)
    assert torch.equal(v, torch.zeros_like(v)) and bool((s == -math.inf).all())
    v, s = merge_states(torch.stack([out, out], 1), torch.stack([lse, lse], 1))
    assert torch.equal(v, torch.zeros_like(v)) and bool((s == -math.inf).all())


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank(rank: int, world: int, port: int, results) -> None:
    import torch.distributed as dist
    from zoo.nn.context_parallel import CONTEXT_PARALLEL, shard_positions
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=TIMEOUT / 2))
    worst = {}
    for layout, kernels in CONTEXT_PARALLEL.items():
        for name, kernel in kernels.items():
            for causal, hk in ((False, 4), (True, 2), (True, 1)):
                q, k, v = _problem(h=4, hk=hk, l=4 * world, s=4 * world)
                do = _problem(h=4, hk=4, l=4 * world, e=3, seed=1)[0]
                leaves = [t.clone().requires_grad_() for t in (q, k, v)]
                want, _ = _reference(*leaves, causal=causal, scale=0.3)
                want.backward(do)
                rows = shard_positions(rank, world, 4, layout)
                shards = [t[:, :, rows].clone().requires_grad_() for t in (q, k, v)]
                out = kernel(*shards, is_causal=causal, scale=0.3, enable_gqa=hk != 4, group=None)
                out.backward(do[:, :, rows])
                errors = [(out - want[:, :, rows]).abs().max()] + [
                    (mine.grad - whole.grad[:, :, rows]).abs().max() for mine, whole in zip(shards, leaves)]
                worst[f"{layout} {name} causal={causal} kv_heads={hk}"] = float(max(errors))
    results.put((rank, worst))
    dist.destroy_process_group()


def test_context_parallel_kernels_agree_with_attention_on_the_whole_sequence():
    got = run_ranks(_rank, 2, (2, _free_port()), TIMEOUT)
    bad = {f"rank {r}: {case}": e for r, worst in got.items() for case, e in worst.items() if not e < 1e-12}
    assert not bad, bad
    assert len(got[0]) == 18
