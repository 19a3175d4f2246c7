"""Calling a context-parallel kernel: sharding the problem, the ranks' answers checked, the whole reassembled.

A ``ContextParallelKernel`` is one ``--kernel`` of a ``--world-size`` run. Called with the whole problem (q, k, v in
SDPA's layout (b, h, L, e), the contract's keywords and, for the backward, the whole upstream gradient), it cuts each
tensor into the ranks' shards of the declared layout (properties/distributed/layouts.py), has the ranks call the
kernel (properties/distributed/world.py) and reassembles the output and dQ, dK, dV of the whole sequence.

Every answer is checked, rank by rank, against the contract: an output tensor of the shard's shape (b, h, L_r, ev), the
query's dtype and device, finite; gradients of the shards' shapes. What breaks it becomes one line naming the rank,
the call and the clause: ``KernelContractError`` (an AssertionError: the clause fails, Hypothesis shrinks it), or,
for a rank that hung, died, or left the others waiting in a collective it never joined, ``RanksLost`` (a
BaseException, like the watchdog's CallTimeout: the test ends at once, unshrunk, and the kernel is not called again in
this run: a hang costs the limit once). The rank at fault is named first, then the ranks that waited for it. A decline
(the rule of properties/kernel/limits.py, on every rank alike) rejects the example and is counted in the coverage; a
decline on some ranks only fails.

What the kernel accepts is probed once at start-up on small problems (``probe``): the plainest problem (float32 first,
then each dtype selected), then causal, grouped heads, an explicit scale, the other dtypes, and the backward; a
decline there skips the clauses that need the feature, with the kernel's words. A kernel that declines the plainest
problem in every dtype selected verifies nothing: ``probe`` raises KernelDeclined (the plug-in refuses the run in one
line, naming --shard). A rank lost in the probe leaves the kernel ``hung``, and every clause fails with what happened.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from properties.core import watchdog
from properties.distributed.layouts import rows_of, shard, unshard
from properties.distributed.worker import Status
from properties.kernel import coverage
from properties.kernel.guard import KernelContractError, KernelDeclined, NamedKernel, describe_call

__all__ = ["RanksLost", "GroupContract", "CallResult", "ContextParallelKernel", "FEATURES"]

# What a context-parallel kernel may decline besides the plainest problem (float32, non-causal, h = k heads).
FEATURES = ("causal", "gqa", "scale", "float32", "float64", "bfloat16", "float16", "backward")


class RanksLost(BaseException):
    """A rank never answered or died: the ranks were killed (the clause fails at once, unshrunk)."""


class GroupContract(KernelContractError):
    """The kernel tried to create or destroy the process group."""


@dataclass
class CallResult:
    out: torch.Tensor                    # the whole output (b, h, L, ev), the kernel's dtype
    grads: dict                          # query/key/value -> the whole gradient (empty without a backward)
    changed: dict                        # rank -> inputs it wrote into
    world: int


def _answers(answered: dict, lost: dict, world: int) -> list[Status]:
    """Every rank's status for one phase, in rank order: a rank that gave none was still in the call (it waited in a
    collective for a rank that had failed) and was stopped with the others."""
    return [answered[r] if r in answered else Status(r, ok=False, kind="stopped", error=lost.get(r, "gave no answer"))
            for r in range(world)]


# What a rank says that waited for another (properties/distributed/worker.py, and the driver's "stopped").
_WAITED = ("stalled", "peer-lost", "stopped")


def _where() -> str:
    clauses, nodeid = watchdog.current_test()
    return f" [clause {clauses}]" if clauses else ""


@dataclass(eq=False, repr=False)
class ContextParallelKernel(NamedKernel):
    """The kernel ``name`` (as --kernel names it) on the ranks of ``world`` (SpawnedWorld or TorchrunWorld)."""

    name: str
    layout: str
    world: object
    size: int
    declined: dict = field(default_factory=dict)   # feature -> the kernel's words
    hung: str = ""
    probing: bool = False

    def describe(self, q, k, v, kwargs, world: int) -> str:
        return describe_call(q, k, v, {**kwargs, "group": f"<{world} ranks, {self.layout} shards>"})

    def __call__(self, q, k, v, *, grad_out=None, world: int | None = None, on_decline: str = "reject",
                 **kwargs) -> CallResult | None:
        """The whole problem on ``world`` ranks (default: all); ``grad_out``: run the backward too. A problem the
        kernel declines is rejected (outside Hypothesis: KernelDeclined), or with ``on_decline="return"`` gives
        None (counted in the coverage either way)."""
        __tracebackhide__ = True
        world = world or self.size
        text = self.describe(q, k, v, kwargs, world)
        if self.hung:
            raise RanksLost(f"kernel {self.name} is not called again{_where()}: {self.hung}")
        length, ev = q.shape[-2], v.shape[-1]
        rows = rows_of(length, world, self.layout)
        shards = {r: (shard(q, rows[r]), shard(k, rows[r]), shard(v, rows[r])) for r in range(world)}
        shapes = {r: (*q.shape[:-2], len(rows[r]), ev) for r in range(world)}
        grads_out = None if grad_out is None else {r: shard(grad_out, rows[r]) for r in range(world)}
        outcome = self.world.call(self.name, world, shards, kwargs, grad_out is not None, text, grads_out, shapes)
        self._check_lost(outcome, text)
        statuses = _answers(outcome.forward, outcome.lost, world)
        if all(not s.ok and s.kind == "declined" for s in statuses):
            if on_decline == "return":
                coverage.declined(statuses[0].error)
                return None
            self._reject(statuses[0].error, text)
        self._check_failures(statuses, text, phase="")
        outs = [self._check_output(s, shapes[s.rank], q, text) for s in statuses]
        coverage.ran(length, k.shape[-2], q.shape[-1], q.dtype, ev, bool(kwargs.get("is_causal")))
        changed = {s.rank: s.changed for s in statuses if s.changed}
        grads = {}
        if grad_out is not None:
            backward = _answers(outcome.backward, outcome.lost, world)
            self._check_failures(backward, text, phase="the backward pass of ")
            for s in backward:
                if s.changed:
                    changed[s.rank] = tuple(sorted(set(changed.get(s.rank, ())) | set(s.changed)))
            for name, whole in (("query", q), ("key", k), ("value", v)):
                pieces = []
                for s in backward:
                    g = s.grads.get(name)
                    if g is None:
                        raise KernelContractError(f"kernel {self.name}: no gradient reached the {name} shard of rank "
                                                  f"{s.rank} in the backward pass of {text}{_where()}")
                    want = tuple(shards[s.rank][("query", "key", "value").index(name)].shape)
                    if tuple(g.shape) != want:
                        raise KernelContractError(f"kernel {self.name}: rank {s.rank}'s d{name} has shape "
                                                  f"{tuple(g.shape)}, its shard {want}, in {text}{_where()}")
                    pieces.append(g)
                grads[name] = unshard(pieces, rows, length)
        return CallResult(unshard(outs, rows, length), grads, changed, world)

    # ---------------------------------------------------------------------------------------------- checks
    def _check_lost(self, outcome, text: str) -> None:
        """A rank that hung (past --call-timeout, or no answer at all), died, or left the others waiting in a
        collective it never joined: RanksLost, naming it first, then the ranks that waited for it."""
        __tracebackhide__ = True
        phase = "the backward pass of " if outcome.backward is not None else ""
        answers = outcome.backward if outcome.backward is not None else outcome.forward
        culprits = {r: how for r, how in outcome.lost.items() if "did not answer" in how or "ended" in how}
        culprits.update({r: f"did not return within {watchdog.limit():g} s (--call-timeout)"
                         for r, s in answers.items() if s.kind == "timeout" and r not in culprits})
        stalled = {r: s for r, s in answers.items() if s.kind == "stalled"}
        failed_alone = any(s.kind in ("raised", "group", "declined", "no-grad") for s in answers.values())
        if not culprits and (not stalled or failed_alone):
            return
        waiting = ", ".join(map(str, sorted(stalled)))
        if not culprits:   # the ranks that answered did so without joining the collective the others waited in
            quiet = sorted(r for r, s in answers.items() if s.ok)
            culprits = {r: f"returned without joining the collective rank{'s' if len(stalled) > 1 else ''} "
                           f"{waiting} waited in" for r in quiet}
        parts = [f"rank {r} {how}" for r, how in sorted(culprits.items())]
        if not culprits:   # every rank waited for another: a deadlock
            parts = [f"ranks {waiting} each waited in a collective for another (a deadlock)"]
        for r, s in sorted(answers.items()):
            if r in culprits or s.ok:
                continue
            parts.append(f"rank {r} timed out in a collective ({s.error})" if s.kind == "stalled" else
                         f"rank {r} lost its peer in a collective ({s.error})" if s.kind == "peer-lost" else
                         f"rank {r}: {s.error}")
        parts += [f"rank {r} {how}" for r, how in sorted(outcome.lost.items()) if r not in culprits]
        where = " (the start-up probe)" if self.probing else ""
        self.hung = f"{'; '.join(parts)} in {phase}{text}{where}"
        raise RanksLost(f"kernel {self.name}: {'; '.join(parts)} in {phase}{text}{_where()}; its ranks were "
                        f"killed and it is not called again in this run")

    def _check_failures(self, statuses, text: str, phase: str) -> None:
        __tracebackhide__ = True
        failed = [s for s in statuses if not s.ok]
        if not failed:
            return
        group = [s for s in failed if s.kind == "group"]
        if group:
            raise GroupContract(f"kernel {self.name}: {group[0].error} ({phase}{text})")
        if phase and any(s.kind == "no-grad" for s in failed):
            import pytest
            pytest.skip(f"kernel {self.name}: its output does not require grad when its inputs do: the gradient "
                        f"clauses do not apply")
        if all(s.kind == "declined" for s in failed) and len(failed) == len(statuses):
            reason = failed[0].error
            if phase:
                import pytest
                pytest.skip(f"kernel {self.name}: its backward declines ({reason}): the gradient clauses do not apply")
            self._reject(reason, text)
        first = next((s for s in failed if s.kind not in ("declined", *_WAITED)), None)
        if first is None:   # some ranks declined, the others went on (and may have waited for them in a collective)
            first = next(s for s in failed if s.kind == "declined")
            others = [s.rank for s in statuses if s.kind != "declined"]
            what = (f"declined ({first.error}) where rank{'s' if len(others) > 1 else ''} "
                    f"{', '.join(map(str, others))} did not: a decline must come on every rank alike, before any "
                    f"collective")
        else:
            what = f"raised {first.error}"
        more = "; ".join(f"rank {s.rank} {s.error}" if s.kind == "stopped" else
                         f"rank {s.rank} lost its peer in a collective ({s.error})" if s.kind == "peer-lost" else
                         f"rank {s.rank} timed out in a collective ({s.error})" if s.kind == "stalled" else
                         f"rank {s.rank}: {s.error}" for s in failed if s is not first)
        raise KernelContractError(f"kernel {self.name}: rank {first.rank} of {len(statuses)} {what} in "
                                  f"{phase}{text}{_where()}{'; ' + more if more else ''}")

    def _reject(self, reason: str, text: str) -> None:
        from hypothesis import reject
        from hypothesis.control import currently_in_test_context
        coverage.declined(reason)
        if not currently_in_test_context():
            raise KernelDeclined(f"kernel {self.name} declined {text}: {reason}")
        reject()

    def _check_output(self, status, shape, q, text: str) -> torch.Tensor:
        __tracebackhide__ = True
        out, rank = status.out, status.rank
        if not isinstance(out, torch.Tensor):
            raise KernelContractError(f"kernel {self.name}: rank {rank} returned {out}, not a tensor, in {text}"
                                      f"{_where()}")
        if tuple(out.shape) != tuple(shape):
            raise KernelContractError(f"kernel {self.name}: rank {rank}'s output shape {tuple(out.shape)} != its shard's "
                                      f"{tuple(shape)} (the query shard's leading dims, the value's last) in {text}"
                                      f"{_where()}")
        if out.dtype != q.dtype:
            raise KernelContractError(f"kernel {self.name}: rank {rank}'s output dtype {out.dtype} != the query's "
                                      f"{q.dtype} in {text}{_where()}")
        bad = ~torch.isfinite(out)
        if bool(bad.any()):
            raise KernelContractError(f"kernel {self.name}: rank {rank}'s output is not finite at "
                                      f"{int(bad.sum())} of {out.numel()} entries in {text}{_where()}")
        return out

    # ---------------------------------------------------------------------------------------------- probes
    def probe(self, dtypes) -> None:
        """Learn what the kernel declines (module docstring). Raises GroupContract as a call does, and KernelDeclined
        when it declines the plainest problem in every dtype selected: nothing could be verified (the --shard or
        --dtype given is not what it is written for). A rank that hangs or dies here leaves the kernel ``hung``:
        each clause then fails at once with what happened."""
        self.probing = True
        try:
            self._probe(dtypes)
        except RanksLost:
            pass
        finally:
            self.probing = False

    def _probe(self, dtypes) -> None:
        heads = max(2, self.size)   # what a kernel that shards heads (Ulysses) can split

        def problem(dtype, kv_heads=heads):
            g = torch.Generator().manual_seed(0)
            length = 4 * self.size
            q = torch.randn(1, heads, length, 4, generator=g).to(dtype)
            k, v = (torch.randn(1, kv_heads, length, 4, generator=g).to(dtype) for _ in range(2))
            return q, k, v
        order = sorted(dtypes, key=lambda d: d != torch.float32) or [torch.float32]   # float32 first
        names = {d: str(d).removeprefix("torch.") for d in order}
        base, reasons = None, {}
        for dtype in order:   # the plainest problem
            try:
                self(*problem(dtype))
            except KernelDeclined as exc:
                reason = str(exc).split(": ", 1)[-1]
                self.declined[names[dtype]] = reason
                reasons.setdefault(reason, []).append(names[dtype])
                continue
            except (KernelContractError, AssertionError) as exc:
                if isinstance(exc, GroupContract):
                    raise
                return   # the clauses will say what is wrong
            base = dtype
            break
        if base is None:
            said = "; ".join(f"in {', '.join(where)}: {reason}" for reason, where in reasons.items())
            raise KernelDeclined(f"it declines the plainest problem on {self.size} ranks, {self.layout} shards ({said})")
        tries = {"causal": (problem(base), {"is_causal": True}), "gqa": (problem(base, kv_heads=1),
                                                                          {"enable_gqa": True}),
                 "scale": (problem(base), {"scale": 0.5})}
        for dtype in order[order.index(base) + 1:]:
            tries[names[dtype]] = (problem(dtype), {})
        for feature, (tensors, kwargs) in tries.items():
            try:
                self(*tensors, **kwargs)
            except KernelDeclined as exc:
                self.declined[feature] = str(exc).split(": ", 1)[-1]
            except GroupContract:
                raise
            except AssertionError:
                pass
        q, k, v = problem(base)
        try:
            self(q, k, v, grad_out=torch.ones_like(q))
        except KernelDeclined as exc:
            self.declined["backward"] = str(exc).split(": ", 1)[-1]
        except GroupContract:
            raise
        except BaseException as exc:  # noqa: BLE001  skips and failures: the gradient clauses will say
            if isinstance(exc, (KeyboardInterrupt, RanksLost)):
                raise
            if type(exc).__name__ == "Skipped":
                self.declined["backward"] = str(exc)

    def require(self, *features: str) -> None:
        """Skip the calling test if the kernel declines one of ``features`` (its words)."""
        import pytest
        for feature in features:
            if feature in self.declined:
                coverage.declined(self.declined[feature])
                pytest.skip(f"kernel {self.name} declines {feature} ({self.declined[feature]}): not covered")
