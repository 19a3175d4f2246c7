"""The ranks a context-parallel kernel runs on, started once per pytest run and fed one call at a time.

``SpawnedWorld``: W rank processes (properties/distributed/worker.py: ``serve``) forked from a forkserver that imported
torch once, joined in a gloo group (NCCL for the kernels' groups on W GPUs) through a TCPStore this process holds
on 127.0.0.1 (a port the system picks, or --master-port). The pytest process is not a rank: it hands each rank its
shard over a pipe and waits for the answers with a deadline, so no collective can hang it. A call that fails on
some rank (it raised, gave the wrong shape, never answered, died) ends with the ranks killed: the others may be
stuck in a collective with it. The world is started again, a new generation of ranks in the same store under a new
prefix, for the next call (a fork and a rendezvous: tenths of a second).

``TorchrunWorld``: the run is already one of W processes started by torchrun (RANK and WORLD_SIZE set). This process
is rank 0 and draws; the others serve it (``serve_torchrun``). Ranks cannot be restarted here: after a failed call
every rank makes the kernels' groups again; a rank that stops answering leaves every later call failing at once.

Deadlines: each phase of a call (forward, backward) may take --call-timeout on a rank, where the rank's own watchdog
interrupts it (SIGALRM), and the kernels' groups time their collectives out a little before it (0.9 of the limit: a
rank left waiting for a hung one reports the collective's timeout, ``stalled``, before the hung rank's watchdog fires,
so that the answers tell them apart); the driver waits the limit plus a grace (2 s + a quarter of the limit) before
it takes a rank for hung. A rank that answers ``stalled`` or ``peer-lost`` does not end the wait: it waited for
another, which answers for itself (or is found hung or dead). Once one rank has failed otherwise it
waits only ``AFTER_FAILURE`` for the others: a rank that raised or died leaves them waiting in a collective that never
completes, and what they would say changes nothing; a rank that declined gives them longer (``AFTER_DECLINE``), since
a decline is a failure only where another rank does not decline the same problem. That grace is seconds: ranks run
the same code to the same decline, but on a machine with more busy processes than cores one of them can be
descheduled for a second or more (tests/test_distributed_faults.py makes rank 1 decline 3 s late); a kernel that
declines on some ranks only pays it once per call.
"""
from __future__ import annotations

import datetime
import os
import pickle
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from properties.distributed.worker import (STARTUP_TIMEOUT, Config, Rank, Status, kernel_groups, serve,
                                           torchrun_step)

__all__ = ["WorldError", "Outcome", "SpawnedWorld", "TorchrunWorld", "under_torchrun", "AFTER_FAILURE", "AFTER_DECLINE"]

AFTER_FAILURE = 0.2   # seconds the others get to answer once a rank has raised or died (module docstring)
AFTER_DECLINE = 5.0   # ... once a rank has declined: longer than ranks running the same code drift apart
_PRELOAD = ["torch", "torch.distributed", "properties.distributed.worker"]


class WorldError(Exception):
    """The ranks could not be started (one line: the rank and what went wrong)."""


@dataclass
class Outcome:
    """What the ranks of one call answered: forward statuses by rank, backward statuses (None: not run), and the
    ranks that never answered or died, with how."""
    forward: dict = field(default_factory=dict)
    backward: dict | None = None
    lost: dict = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        statuses = list(self.forward.values()) + list((self.backward or {}).values())
        return bool(self.lost) or any(not s.ok for s in statuses)


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _deadline(limit: float) -> float | None:
    return None if limit <= 0 else time.monotonic() + limit + 2.0 + limit / 4


class SpawnedWorld:
    """W rank processes of this pytest run (module docstring)."""

    def __init__(self, size: int, *, device: str, limit: float, specs, layout: str, port: int | None = None):
        self.size, self.device, self.limit, self.specs, self.layout = size, device, limit, tuple(specs), layout
        self.port, self.store, self.generation = port, None, 0
        self.processes, self.conns, self.pids = [], [], []
        self.load_errors: dict = {}
        self.starts = 0

    @property
    def alive(self) -> bool:
        return bool(self.processes)

    def _store(self):
        if self.store is None:
            try:
                self.store = dist.TCPStore("127.0.0.1", self.port or 0, None, True,
                                           datetime.timedelta(seconds=STARTUP_TIMEOUT), wait_for_workers=False)
            except (RuntimeError, OSError) as exc:
                detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                where = f"--master-port {self.port}" if self.port else "a free port on 127.0.0.1"
                raise WorldError(f"{where}: the ranks' rendezvous cannot listen there ({detail}); "
                                 f"{'choose another port or leave --master-port out' if self.port else ''}") from None
        return self.store

    def start(self) -> None:
        """Start the W ranks and wait until each has joined and loaded the kernels (WorldError otherwise)."""
        import multiprocessing
        from multiprocessing.connection import wait
        store = self._store()
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        self.generation += 1
        self.starts += 1
        backend = "nccl" if self.device != "cpu" else "gloo"
        pending = {}
        for rank in range(self.size):
            config = Config(rank=rank, size=self.size, host="127.0.0.1", port=store.port, prefix=f"g{self.generation}",
                            backend=backend, device=self.device, limit=self.limit, specs=self.specs,
                            layout=self.layout)
            mine, theirs = ctx.Pipe()
            process = ctx.Process(target=serve, args=(config, theirs), daemon=True, name=f"rank {rank}")
            process.start()
            theirs.close()
            self.processes.append(process)
            self.conns.append(mine)
            pending[mine] = rank
        end = time.monotonic() + STARTUP_TIMEOUT
        errors = {}
        while pending:
            ready = wait(list(pending), timeout=max(0.0, end - time.monotonic()))
            if not ready:
                self.kill()
                raise WorldError(f"ranks {sorted(pending.values())} did not join the group within "
                                 f"{STARTUP_TIMEOUT:g} s")
            for conn in ready:
                rank = pending.pop(conn)
                try:
                    kind, _, pid, detail = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    how = self._how_it_ended(rank)
                    self.kill()
                    raise WorldError(f"rank {rank} ended ({how}) while it joined the group or imported "
                                     f"--kernel {' '.join(self.specs)}") from None
                if kind == "failed":
                    self.kill()
                    raise WorldError(f"rank {rank} could not join the group: {detail}")
                errors.update({spec: error for spec, error in detail.items() if spec not in errors})
        self.pids = [p.pid for p in self.processes]
        self.load_errors = errors

    def _how_it_ended(self, rank: int) -> str:
        process = self.processes[rank]
        process.join(1.0)
        code = process.exitcode
        if code is None:
            return "still running"
        return f"signal {-code}" if code < 0 else f"exit status {code}"

    def kill(self) -> None:
        """End every rank now (they may be stuck in a collective); the next call starts a new generation."""
        for process in self.processes:
            if process.is_alive():
                process.kill()
        for process in self.processes:
            process.join(5.0)
        for conn in self.conns:
            conn.close()
        self.processes, self.conns, self.pids = [], [], []

    def stop(self) -> None:
        for conn in self.conns:
            try:
                conn.send_bytes(pickle.dumps(("stop",)))
            except OSError:
                pass
        for process in self.processes:
            process.join(2.0)
        self.kill()

    def _send(self, ranks, message) -> dict:
        """Send ``message`` (one per rank, or the same to all); {rank: how it ended} for ranks gone."""
        gone = {}
        for rank in ranks:
            payload = message[rank] if isinstance(message, dict) else message
            try:
                self.conns[rank].send_bytes(pickle.dumps(payload))
            except OSError:
                gone[rank] = f"ended ({self._how_it_ended(rank)})"
        return gone

    def _collect(self, ranks, lost: dict) -> dict:
        from multiprocessing.connection import wait
        answers = {}
        pending = {self.conns[r]: r for r in ranks if r not in lost}
        deadline, failed_at, grace = _deadline(self.limit), None, AFTER_DECLINE
        while pending:
            ends = [t for t in (deadline, failed_at and failed_at + grace) if t]
            timeout = None if not ends else max(0.0, min(ends) - time.monotonic())
            ready = wait(list(pending), timeout=timeout)
            if not ready:
                break
            for conn in ready:
                rank = pending.pop(conn)
                try:
                    status = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    lost[rank] = f"ended ({self._how_it_ended(rank)})"
                    failed_at, grace = failed_at or time.monotonic(), AFTER_FAILURE
                    continue
                answers[rank] = status
                if not status.ok and status.kind not in ("stalled", "peer-lost"):
                    # (a rank that waited in vain for another says nothing of the others: wait on for them)
                    failed_at = failed_at or time.monotonic()
                    grace = AFTER_DECLINE if status.kind == "declined" and grace == AFTER_DECLINE else AFTER_FAILURE
        for rank in pending.values():
            lost[rank] = ("did not answer within %g s (--call-timeout)" % self.limit if failed_at is None
                          else "was still in the call when another rank failed")
        return answers

    def call(self, spec: str, world: int, shards, kwargs: dict, grad: bool, text: str, grads_out, shapes) -> Outcome:
        """One call of kernel ``spec`` on the first ``world`` ranks: shards[r] = (q, k, v) of rank r; with ``grad``,
        then the backward pass with grads_out[r] when every forward output has shapes[r]."""
        if not self.alive:
            self.start()
        ranks = list(range(world))
        outcome = Outcome()
        outcome.lost = self._send(ranks, {r: ("forward", spec, world, shards[r], kwargs, grad, text) for r in ranks})
        outcome.forward = self._collect(ranks, outcome.lost)
        proceed = grad and not outcome.failed and all(
            isinstance(s.out, torch.Tensor) and tuple(s.out.shape) == tuple(shapes[r])
            for r, s in outcome.forward.items())
        if proceed:
            outcome.lost.update(self._send(ranks, {r: ("backward", spec, grads_out[r]) for r in ranks}))
            outcome.backward = self._collect(ranks, outcome.lost)
        if outcome.failed and not _all_declined(outcome, ranks):
            self.kill()
        elif not proceed and grad:
            self._send(ranks, ("drop",))
        return outcome


def _all_declined(outcome: Outcome, ranks) -> bool:
    """Every rank declined the problem in the forward (no collective left half done)."""
    return not outcome.lost and all(r in outcome.forward and outcome.forward[r].kind == "declined" for r in ranks)


class TorchrunWorld:
    """This process as rank 0 of torchrun's group (module docstring)."""

    def __init__(self, size: int, *, device: str, limit: float, specs, layout: str):
        self.size, self.limit, self.specs = size, limit, tuple(specs)
        backend = "nccl" if device != "cpu" else "gloo"
        config = Config(rank=0, size=size, host="", port=0, prefix="", backend=backend, device=device, limit=limit,
                        specs=self.specs, layout=layout)
        self.rank = Rank(config, kernel_groups(size, backend, limit))
        everyone = [None] * size
        dist.all_gather_object(everyone, self.rank.load_errors)
        self.load_errors = {}
        for errors in everyone:
            self.load_errors.update({k: v for k, v in errors.items() if k not in self.load_errors})
        self.broken = ""
        self.starts = 1

    def call(self, spec, world, shards, kwargs, grad, text, grads_out, shapes) -> Outcome:
        if self.broken:
            return Outcome(lost={r: self.broken for r in range(1, world)})
        request = ("call", spec, world, shards, kwargs, grad, text, grads_out, shapes)
        try:
            dist.broadcast_object_list([request], src=0)
            forward, backward = torchrun_step(self.rank, request, None)
        except RuntimeError as exc:   # the default group timed out: a rank stopped answering
            self.broken = f"stopped answering ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"
            return Outcome(lost={r: self.broken for r in range(1, world)})
        outcome = Outcome(forward={s.rank: s for s in forward},
                          backward=None if backward is None else {s.rank: s for s in backward})
        if outcome.failed:
            dist.broadcast_object_list([("regroup",)], src=0)
            self.rank.groups = kernel_groups(self.size, self.rank.config.backend, self.limit)
        return outcome

    def stop(self) -> None:
        if not self.broken:
            dist.broadcast_object_list([("stop",)], src=0)

    def kill(self) -> None:
        self.stop()


def start_torchrun_rank(*, device: str, limit: float, specs, layout: str):
    """Join torchrun's group (env://); on rank 0 return a TorchrunWorld, elsewhere serve rank 0 until it stops and
    return None."""
    from properties.distributed.worker import serve_torchrun
    size, me = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    if device != "cpu":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", me)) % torch.cuda.device_count())
    timeout = datetime.timedelta(seconds=max(STARTUP_TIMEOUT, 4 * limit) if limit > 0 else 3600)
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="env://", rank=me, world_size=size, timeout=timeout)
    if me == 0:
        return TorchrunWorld(size, device=device, limit=limit, specs=specs, layout=layout)
    backend = "nccl" if device != "cpu" else "gloo"
    config = Config(rank=me, size=size, host="", port=0, prefix="", backend=backend, device=device, limit=limit,
                    specs=tuple(specs), layout=layout)
    rank = Rank(config, kernel_groups(size, backend, limit))
    dist.all_gather_object([None] * size, rank.load_errors)
    serve_torchrun(rank, None)
    return None
