"""One rank of the distributed level: it joins the process group, loads the kernels under test, and runs what rank 0's
pytest session asks of it, one call at a time, in two phases (properties/distributed/world.py drives them):

* ``forward``: the kernel called on this rank's shard with ``group=`` (a group of the first W' ranks: the whole world,
  or a smaller one for CP-WORLD-SIZE), under the watchdog's per-call limit (SIGALRM, as every call of code under
  test); the output goes back as it came, checked on the driver's side;
* ``backward`` (only when every rank's forward gave an output of the right shape: a rank that goes on alone would
  wait in a collective for one that will never come) or ``drop``.

Each phase's answer also says whether the call wrote into its inputs (the shards and the upstream gradient, compared
with copies taken before). A kernel that calls ``init_process_group`` or ``destroy_process_group`` itself (at import
or in a call) raises ``GroupContractError`` here: the suite owns the group and hands it over as ``group=``.

Spawned ranks (``serve``) are forked from a forkserver that has imported torch once, talk to the driver over a pipe
(pickled bytes: the shards are small), and die with it (PR_SET_PDEATHSIG, and EOF on the pipe). Under torchrun the
ranks other than 0 run ``serve_torchrun``: the problem comes by broadcast from rank 0 on the default group, the
answers go back by gather on it; the kernels get groups of their own (``kernel_groups``), made again after a call
that failed, so that a collective left half done cannot poison the next call.
"""
from __future__ import annotations

import datetime
import os
import pickle
import signal
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from properties.core import watchdog
from properties.core.watchdog import CallTimeout, raised, user_call

__all__ = ["Config", "GroupContractError", "Status", "subgroup_sizes", "kernel_groups", "Rank", "serve",
           "serve_torchrun", "STARTUP_TIMEOUT"]

STARTUP_TIMEOUT = 120.0   # seconds for a rank to join the group and load the kernels


class GroupContractError(RuntimeError):
    """The code under test tried to create or destroy the process group the suite owns."""


@dataclass(frozen=True)
class Config:
    """What a rank needs to start: the rendezvous, the device and backend, the limit, the kernels to load."""
    rank: int
    size: int
    host: str
    port: int
    prefix: str
    backend: str            # of the kernels' groups: gloo, or nccl on GPUs
    device: str             # cpu, or cuda (each rank its own device)
    limit: float            # --call-timeout (0: none)
    specs: tuple[str, ...]  # the kernels, as --kernel names them
    layout: str


@dataclass
class Status:
    """One rank's answer for one phase."""
    rank: int
    ok: bool = True
    out: object = None              # forward: the output (a CPU tensor), or a description of what came back
    grads: dict = field(default_factory=dict)   # backward: query/key/value -> CPU tensor
    error: str = ""                 # 'Type: message' of what the kernel raised
    kind: str = ""                  # raised | declined | timeout | group | no-grad | stalled | peer-lost; stopped
    #                                 (set by the driver: no answer, the rank killed while it waited for another)
    changed: tuple[str, ...] = ()   # inputs the call wrote into


def subgroup_sizes(size: int) -> tuple[int, ...]:
    """The world sizes a run of ``size`` ranks checks besides its own (CP-WORLD-SIZE): 1, 2, 4, ... below it."""
    sizes, w = [], 1
    while w < size:
        sizes.append(w)
        w *= 2
    return tuple(sizes)


def kernel_groups(size: int, backend: str, limit: float) -> dict[int, object]:
    """The groups kernels get, by world size: the first w ranks for every w of ``subgroup_sizes`` and the whole
    world. Every rank calls this, in the same order (new_group is a collective of the default group)."""
    # A little under the limit: a rank left waiting for a hung one reports gloo's timeout before its own watchdog
    # fires, so that the answers tell the rank that hung from the ranks that waited for it.
    timeout = datetime.timedelta(seconds=0.9 * limit if limit > 0 else 3600)
    groups = {}
    for w in (*subgroup_sizes(size), size):
        groups[w] = dist.new_group(list(range(w)), timeout=timeout, backend=backend)
    return groups


def _forbid_group_management(rank: int) -> None:
    def refuse(*args, **kwargs):
        raise GroupContractError(f"the code under test called torch.distributed.init_process_group or "
                                 f"destroy_process_group on rank {rank}: the suite starts the process group and "
                                 f"passes the kernel its group as group=; use it (and no default group of its own)")
    import torch.distributed.distributed_c10d as c10d
    for module in (dist, c10d):
        module.init_process_group = refuse
        module.destroy_process_group = refuse


def _load(spec: str, layout: str):
    from zoo.nn.context_parallel import resolve_context_parallel
    return resolve_context_parallel(spec, layout)


# How gloo (and NCCL, in a DistError) words a collective that another rank left this one waiting in.
_TIMED_OUT = ("timed out", "timeout")
_PEER_GONE = ("closed by peer", "reset by peer", "read error", "write error", "broken pipe")


def _collective_failure(exc: BaseException) -> tuple[str, str] | None:
    """(kind, words) when ``exc`` is a collective of the group failing for want of another rank: ``stalled`` (it timed
    out waiting for a rank that never joined) or ``peer-lost`` (a rank went away in the middle of it), and the words:
    the error's first sentence without gloo's source path; None for any other error."""
    text = str(exc)
    if not (isinstance(exc, dist.DistError) or (isinstance(exc, RuntimeError) and "gloo/" in text)):
        return None
    lowered = text.lower()
    kind = ("stalled" if any(w in lowered for w in _TIMED_OUT) else
            "peer-lost" if any(w in lowered for w in _PEER_GONE) else None)
    if kind is None:
        return None
    words = text.strip().splitlines()[0] if text.strip() else ""
    if words.startswith("["):   # gloo's '[/path/to/pair.cc:553] ' prefix
        words = words.split("] ", 1)[-1]
    return kind, f"{type(exc).__name__}: {words.split('. ', 1)[0]}"


def _error_status(rank: int, exc: BaseException) -> Status:
    from properties.core.declines import decline_reason
    if isinstance(exc, CallTimeout):
        return Status(rank, ok=False, error=str(exc), kind="timeout")
    cause = exc.__cause__ if isinstance(exc, watchdog.UserExit) and exc.__cause__ is not None else exc
    if isinstance(cause, GroupContractError):
        return Status(rank, ok=False, error=str(cause), kind="group")
    waited = _collective_failure(cause)
    if waited is not None:
        return Status(rank, ok=False, error=waited[1], kind=waited[0])
    reason = decline_reason(cause) if isinstance(cause, Exception) else None
    if reason is not None:
        return Status(rank, ok=False, error=reason, kind="declined")
    return Status(rank, ok=False, error=raised(exc), kind="raised")


class Rank:
    """The kernels and groups of one rank, and the call in progress."""

    def __init__(self, config: Config, groups: dict):
        self.config, self.groups = config, groups
        self.kernels, self.load_errors = {}, {}
        self.pending = None   # (output, leaves, inputs, copies, text) between forward and backward
        watchdog.set_limit(config.limit, alarm=True)
        _forbid_group_management(config.rank)
        for spec in config.specs:
            try:
                with user_call(f"kernel {spec}", f"importing it on rank {config.rank}"):
                    self.kernels[spec] = _load(spec, config.layout)
                declared = getattr(self.kernels[spec], "layouts", None)
                if declared is not None and config.layout not in tuple(declared):
                    self.load_errors[spec] = ("layout", f"it is written for {' or '.join(map(str, declared))} shards "
                                                        f"(its `layouts`), not --shard {config.layout}")
            except BaseException as exc:  # noqa: BLE001  every failure of user code is reported, none ends the rank
                from zoo.runtime.plugins import PluginError
                if isinstance(watchdog.cause(exc), PluginError):   # it says which path and why, in one line
                    self.load_errors[spec] = ("plugin", str(watchdog.cause(exc)))
                    continue
                status = _error_status(config.rank, exc)
                self.load_errors[spec] = (status.kind, status.error)

    def device(self) -> torch.device:
        if self.config.device == "cpu":
            return torch.device("cpu")
        return torch.device("cuda", torch.cuda.current_device())

    def forward(self, spec: str, world: int, shards, kwargs: dict, grad: bool, text: str) -> Status:
        rank = self.config.rank
        self.pending = None
        device = self.device()
        inputs = [t.to(device) for t in shards]
        leaves = [t.detach().requires_grad_(grad) for t in inputs]
        copies = [t.detach().clone() for t in inputs]
        try:
            with user_call(f"kernel {spec}", f"{text} on rank {rank}"):
                out = self.kernels[spec](*leaves, group=self.groups[world], **kwargs)
        except BaseException as exc:  # noqa: BLE001
            if isinstance(exc, KeyboardInterrupt):
                raise
            status = _error_status(rank, exc)
            status.changed = _changed(leaves, copies)
            return status
        status = Status(rank, changed=_changed(leaves, copies))
        if isinstance(out, torch.Tensor):
            status.out = out.detach().to("cpu")
            if grad:
                self.pending = (out, leaves, copies, text)
        else:
            status.out = f"{type(out).__name__}"
        return status

    def backward(self, spec: str, grad_out: torch.Tensor) -> Status:
        rank = self.config.rank
        out, leaves, copies, text = self.pending
        self.pending = None
        if not out.requires_grad:
            return Status(rank, ok=False, kind="no-grad", error="its output does not require grad")
        upstream = grad_out.to(out.device)
        upstream_copy = upstream.clone()
        try:
            with user_call(f"kernel {spec}", f"the backward pass of {text} on rank {rank}"):
                out.backward(upstream)
        except BaseException as exc:  # noqa: BLE001
            if isinstance(exc, KeyboardInterrupt):
                raise
            return _error_status(rank, exc)
        grads = {name: (None if leaf.grad is None else leaf.grad.detach().to("cpu"))
                 for name, leaf in zip(("query", "key", "value"), leaves)}
        changed = _changed(leaves, copies) + (("grad_out",) if not torch.equal(upstream, upstream_copy) else ())
        return Status(rank, grads=grads, changed=changed)

    def drop(self) -> None:
        self.pending = None


def _changed(leaves, copies) -> tuple[str, ...]:
    names = ("query", "key", "value")
    return tuple(n for n, leaf, copy in zip(names, leaves, copies)
                 if leaf.shape != copy.shape or not torch.equal(leaf.detach(), copy))


def _join(config: Config) -> None:
    """Join the group (the driver's TCPStore, this generation's prefix) and set the device."""
    if config.device != "cpu":
        torch.cuda.set_device(config.rank % torch.cuda.device_count())
    timeout = datetime.timedelta(seconds=STARTUP_TIMEOUT)
    store = dist.TCPStore(config.host, config.port, config.size, is_master=False, timeout=timeout)
    control = datetime.timedelta(seconds=max(STARTUP_TIMEOUT, 4 * config.limit))
    dist.init_process_group("gloo", store=dist.PrefixStore(config.prefix, store), rank=config.rank,
                            world_size=config.size, timeout=control)


def _end_with_parent() -> None:
    try:   # PR_SET_PDEATHSIG: a rank never outlives the forkserver, which ends with the driver
        import ctypes
        ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))
    except Exception:  # noqa: BLE001  (not Linux: the pipe's EOF still ends the loop)
        pass


def serve(config: Config, conn) -> None:
    """A spawned rank's life: join, load, answer 'ready', then serve the driver's requests until 'stop' or EOF."""
    _end_with_parent()
    torch.set_num_threads(1)
    try:
        _join(config)
        groups = kernel_groups(config.size, config.backend, config.limit)
        rank = Rank(config, groups)
    except BaseException as exc:  # noqa: BLE001  the driver reports it in one line
        conn.send_bytes(pickle.dumps(("failed", config.rank, os.getpid(), raised(exc))))
        return
    conn.send_bytes(pickle.dumps(("ready", config.rank, os.getpid(), rank.load_errors)))
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            break
        kind = message[0]
        if kind == "stop":
            break
        if kind == "forward":
            answer = rank.forward(*message[1:])
        elif kind == "backward":
            answer = rank.backward(*message[1:])
        else:
            rank.drop()
            continue
        conn.send_bytes(pickle.dumps(answer))
    os._exit(0)   # no atexit work: the group may be half broken, the driver may be gone


def serve_torchrun(rank: Rank, control) -> None:
    """A torchrun rank other than 0: run rank 0's calls (torchrun_call on rank 0 is the other half) until 'stop'."""
    while True:
        message = [None]
        dist.broadcast_object_list(message, src=0, group=control)
        request = message[0]
        if request[0] == "stop":
            return
        if request[0] == "regroup":
            rank.groups = kernel_groups(rank.config.size, rank.config.backend, rank.config.limit)
            continue
        torchrun_step(rank, request, control)


def torchrun_step(rank: Rank, request, control):
    """One call on every rank under torchrun: each runs its forward, all learn every forward status, then all run the
    backward or drop it. Rank 0 gets (forward statuses, backward statuses or None); the others None."""
    _, spec, world, shards, kwargs, grad, text, grads_out, shapes = request
    me = rank.config.rank
    status = rank.forward(spec, world, shards[me], kwargs, grad, text) if me < world else None
    forward = [None] * rank.config.size
    dist.all_gather_object(forward, status, group=control)
    statuses = [s for s in forward if s is not None]
    proceed = grad and all(s.ok and isinstance(s.out, torch.Tensor) and tuple(s.out.shape) == tuple(shapes[s.rank])
                           for s in statuses)
    backward = None
    if me < world:
        if proceed:
            backward = rank.backward(spec, grads_out[me])
        else:
            rank.drop()
    gathered = [None] * rank.config.size if me == 0 else None
    dist.gather_object(backward, gathered, dst=0, group=control)
    if me != 0:
        return None
    return statuses, ([s for s in gathered if s is not None] if proceed else None)
