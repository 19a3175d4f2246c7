"""W processes started with ``spawn`` that each run ``target(rank, *args, results)`` and put one ``(rank, value)``
into ``results``: the ranks of the tests that check context-parallel kernels on gloo without the suite's machinery
(tests/test_context_parallel.py, tests/test_distributed_bugs.py). Every rank is joined within ``timeout`` seconds or
the test fails naming the ranks that hung; every rank is killed on the way out, so that none outlives its test."""
from __future__ import annotations

import torch.multiprocessing as mp


def run_ranks(target, world: int, args: tuple, timeout: float) -> dict:
    """rank -> the value that rank put, for ``world`` spawned ranks of ``target``."""
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    ranks = [ctx.Process(target=target, args=(r, *args, results), daemon=True) for r in range(world)]
    for p in ranks:
        p.start()
    try:
        for p in ranks:
            p.join(timeout)
        hung = [r for r, p in enumerate(ranks) if p.is_alive()]
        assert not hung, f"ranks {hung} did not finish within {timeout} s"
        assert all(p.exitcode == 0 for p in ranks), [p.exitcode for p in ranks]
        return dict(results.get() for _ in range(world))
    finally:
        for p in ranks:
            p.kill()
            p.join()
