"""Context-parallel kernels that break the run rather than the arithmetic, for tests/test_distributed_faults.py: each
is the zoo's ring attention (zoo/nn/context_parallel.py) with one fault, plugged in as a user plugs in theirs
(``--world-size 2 --kernel tests/distributed_kernels.py:NAME``). Only rank 1 misbehaves where a fault is a rank's, so
that the suite has to name the right one."""
from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist

from zoo.nn.context_parallel import ring_attention


def _rank(group) -> int:
    return dist.get_rank(group)


def _fault_on_rank_1(fault):
    """The kernel named and described by ``fault``: the zoo's ring, where rank 1 first calls ``fault()`` (none of
    them returns)."""
    def kernel(q, k, v, *, group=None, **kwargs):
        if _rank(group) == 1:
            fault()
        return ring_attention(q, k, v, group=group, **kwargs)
    kernel.__name__, kernel.__qualname__, kernel.__doc__ = fault.__name__, fault.__qualname__, fault.__doc__
    return kernel


@_fault_on_rank_1
def raises_on_rank_1():
    """Rank 1 raises before the first collective; rank 0 waits in it."""
    raise RuntimeError("rank 1 lost its key cache")


def wrong_shape_on_rank_1(q, k, v, *, group=None, **kwargs):
    """Rank 1 returns its output without its last row."""
    out = ring_attention(q, k, v, group=group, **kwargs)
    return out[..., :-1, :] if _rank(group) == 1 else out


@_fault_on_rank_1
def hangs_on_rank_1():
    """Rank 1 never joins the ring's collectives (it sleeps); rank 0 waits for it."""
    time.sleep(3600)


@_fault_on_rank_1
def hangs_on_rank_1_ignoring_alarms():
    """Rank 1 blocks SIGALRM and sleeps: only the driver's deadline and a kill stop it."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    time.sleep(3600)


def skips_the_ring_on_rank_1(q, k, v, *, group=None, **kwargs):
    """Rank 1 answers at once, from its own keys only, without joining the collectives rank 0 waits in."""
    if _rank(group) == 1:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, **kwargs)
    return ring_attention(q, k, v, group=group, **kwargs)


@_fault_on_rank_1
def exits_on_rank_1():
    """Rank 1 ends its process (os._exit: no exception, no atexit)."""
    os._exit(3)


@_fault_on_rank_1
def killed_on_rank_1():
    """Rank 1 dies of a signal (as a segfault or the OOM killer ends it)."""
    os.kill(os.getpid(), signal.SIGKILL)


def calls_init_process_group(q, k, v, *, group=None, **kwargs):
    """Makes a default group of its own, as a training script's setup code does."""
    if not dist.is_initialized() or group is not None:
        dist.init_process_group("gloo")
    return ring_attention(q, k, v, group=group, **kwargs)


def declines_every_problem(q, k, v, *, group=None, **kwargs):
    """Written for another layout: declines every problem, in its own words, on every rank."""
    raise NotImplementedError("this kernel does not support the zigzag layout (contiguous shards only)")


def hangs_on_batches_on_rank_1(q, k, v, *, group=None, **kwargs):
    """Rank 1 hangs on a batch of more than one sequence: the start-up probe (one sequence) passes, a clause meets it."""
    if _rank(group) == 1 and q.shape[0] > 1:
        time.sleep(3600)
    return ring_attention(q, k, v, group=group, **kwargs)


def raises_in_the_backward_on_rank_1(q, k, v, *, group=None, **kwargs):
    """Rank 1's backward pass raises; its forward is right."""
    out = ring_attention(q, k, v, group=group, **kwargs)
    if _rank(group) == 1 and out.requires_grad:
        return _RaiseInBackward.apply(out)
    return out


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("rank 1's backward lost the saved key block")


_LATE = {"declined": False}


def declines_late_on_rank_1(q, k, v, *, group=None, **kwargs):
    """The zoo's ring, correct, whose rank 1 reaches its first decline (unequal shards) 3 s after rank 0: the skew of
    a rank descheduled on a loaded machine. Not a fault: both ranks decline the same problem."""
    try:
        return ring_attention(q, k, v, group=group, **kwargs)
    except Exception:
        if _rank(group) == 1 and not _LATE["declined"]:
            _LATE["declined"] = True
            time.sleep(3)
        raise
