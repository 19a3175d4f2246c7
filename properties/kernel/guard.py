"""Calling the kernel under test: the guard, weight extraction, and the standard oracle check.

Every property calls the user's kernel through :class:`GuardedKernel`, which turns anything that breaks
the calling contract (an exception, an output of the wrong shape, dtype or device, NaN or Inf where none
is allowed) into an ``AssertionError``.  A kernel declared with ``--returns-lse`` returns (output, lse): every clause
reads the output, the LSE clauses (properties/kernel/test_lse.py) the LSE too (``GuardedKernel.with_lse``,
``check_lse``, ``check_lse_against_oracle``).  Pytest then reports it as a failure of the clause the property is
bound to, Hypothesis shrinks it like any other failure, and the rest of the suite keeps running.  A kernel may
decline a problem instead (properties/kernel/limits.py): the example is then rejected and recorded
(properties/kernel/coverage.py), and the draws that follow stay inside what the kernel accepts.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from properties.kernel import coverage
from properties.core import evidence
from properties.core.assertions import assert_all, assert_within, fmt
from properties.core.declines import decline_reason
from properties.kernel.limits import Limits, LimitsError, learn_limits, nearest_size
from properties.core.oracle import expand_kv_heads, to_float64
from properties.kernel.statistics import FALSE_ALARM, hoeffding_halfwidth
from properties.core.strategies import identity_values
from properties.core.tolerance import (SoftmaxBounds, deciding_output_bound, evaluation_error, gamma, lse_bound,
                                       output_bound, rounding_error, softmax_bounds, unit_roundoff)
from properties.core.watchdog import cause, raised, user_call

__all__ = ["KernelContractError", "KernelDeclined", "NamedKernel", "GuardedKernel", "identity_width",
           "fully_masked_mean", "describe_call", "check_output", "check_against_oracle", "check_dropout_rate",
           "LSE_DTYPES", "check_lse", "natural_lse", "check_lse_against_oracle", "lse_pair_problem"]


class KernelContractError(AssertionError):
    """The kernel raised, or returned something the contract rules out."""


class KernelDeclined(Exception):
    """The kernel declined a problem outside a Hypothesis example (inside one, the example is rejected)."""


def _describe(t) -> str:
    if isinstance(t, torch.Tensor):
        return f"{t.dtype}{tuple(t.shape)}@{t.device}".replace("torch.", "")
    return repr(t)


def describe_call(query, key, value, kwargs) -> str:
    args = ", ".join([_describe(query), _describe(key), _describe(value)]
                     + [f"{k}={_describe(v)}" for k, v in kwargs.items()])
    return f"kernel({args})"


def check_output(name: str, out, query, value, call: str, nan_rows: torch.Tensor | None = None) -> torch.Tensor:
    """The output contract of every kernel API: a tensor of shape (*query.shape[:-1], value's last dim), the
    query's dtype and device, finite except at ``nan_rows`` (bool, query shape without its last dim)."""
    __tracebackhide__ = True
    if not isinstance(out, torch.Tensor):
        raise KernelContractError(f"kernel {name} returned {type(out).__name__}, not a tensor, in {call}")
    expected = (*query.shape[:-1], value.shape[-1])
    if tuple(out.shape) != expected:
        raise KernelContractError(f"output shape {tuple(out.shape)} != expected {expected} "
                                  f"(query's leading dims, value's last dim) in {call}")
    if out.dtype != query.dtype:
        raise KernelContractError(f"output dtype {out.dtype} != query dtype {query.dtype} in {call}")
    if out.device != query.device:
        raise KernelContractError(f"output device {out.device} != query device {query.device} in {call}")
    finite = torch.isfinite(out)
    if nan_rows is not None:
        finite = finite | nan_rows.to(out.device)[..., None]
    assert_all(finite.cpu(), out.cpu(), what=f"output is finite (kernel {name})", note=f" in {call}")
    return out


# The dtypes an LSE may have: float32 (FlashAttention, PyTorch's fused backends, FlashInfer and vLLM keep it there) or
# float64. An LSE λ stored in 16 bits is off by up to |λ|·2^-8 (bfloat16), and every weight a merge rescales with it
# by as much, relative: 10 % at λ = 50 (SPEC.md, "Attention split across ranks").
LSE_DTYPES = (torch.float32, torch.float64)


def check_lse(name: str, lse, lead: tuple, device, call: str, what: str = "lse") -> torch.Tensor:
    """The contract of an LSE: a tensor of shape ``lead`` (the query's shape without its last dim), float32 or
    float64, on ``device``. Its values are the oracle's business (``check_lse_against_oracle``)."""
    __tracebackhide__ = True
    if not isinstance(lse, torch.Tensor):
        raise KernelContractError(f"kernel {name} returned {type(lse).__name__} as its {what}, not a tensor, in {call}")
    if tuple(lse.shape) != tuple(lead):
        raise KernelContractError(f"{what} shape {tuple(lse.shape)} != expected {tuple(lead)} (the query's shape "
                                  f"without its last dim: one log-sum-exp per query) in {call}")
    if lse.dtype not in LSE_DTYPES:
        raise KernelContractError(f"{what} dtype {lse.dtype} is not float32 or float64 (an LSE stored in 16 bits moves "
                                  f"every weight a merge rescales with it by up to |lse|·2^-8) in {call}")
    if lse.device != torch.device(device):
        raise KernelContractError(f"{what} device {lse.device} != {device} in {call}")
    return lse


def natural_lse(lse: torch.Tensor, base: str) -> torch.Tensor:
    """An LSE in base ``base`` ("e" or "2", --lse-base) as a natural one, float64 on the CPU (one more float64
    rounding for base 2, which ``check_lse_against_oracle`` counts)."""
    lse64 = to_float64(lse)
    return lse64 * math.log(2.0) if base == "2" else lse64


def check_lse_against_oracle(lse: torch.Tensor, bounds: SoftmaxBounds, *, base: str = "e", fully_masked: str = "zeros",
                             what: str = "lse") -> None:
    """LSE-ORACLE's comparison: a query with an admissible key has a finite LSE within ``lse_bound`` of the float64
    log-sum-exp of its admissible scores (converted from ``base``); one without has −inf exactly (under
    --fully-masked zeros; under nan, mean or any, as its output, its LSE is not checked)."""
    __tracebackhide__ = True
    actual = natural_lse(lse, base)
    no_key = torch.broadcast_to(bounds.reference.no_key_rows.cpu(), actual.shape)
    if fully_masked == "zeros" and bool(no_key.any()):
        assert_all(actual[no_key] == -math.inf, actual[no_key],
                   what=f"{what} of a query with no admissible key is -inf (log of an empty sum)",
                   note=" (the weight a merge gives such a state must be exactly 0; vllm PR #49294: a finite LSE "
                        "for an empty chunk made its undefined output count as attention)")
    exact = torch.logsumexp(bounds.reference.scores, dim=-1)
    exact = torch.where(no_key, torch.zeros_like(exact), exact)
    actual = torch.where(no_key, torch.zeros_like(actual), actual)
    bound = lse_bound(bounds, lse.dtype) + 2 * unit_roundoff(torch.float64) * exact.abs()   # (base 2: × log 2)
    where = " (converted from base 2: × log 2)" if base == "2" else ""
    assert_within(actual, exact, bound, what=what, reference="float64 log-sum-exp of the admissible scores",
                  note=where)


def _pair(name: str, out, call: str):
    """(output, lse) of a kernel declared with --returns-lse; anything else breaks its declared contract."""
    if isinstance(out, (tuple, list)) and len(out) == 2 and all(isinstance(t, torch.Tensor) for t in out):
        return out[0], out[1]
    got = (f"a {type(out).__name__} of {len(out)}" if isinstance(out, (tuple, list)) else type(out).__name__)
    raise KernelContractError(f"kernel {name} returned {got}, not the pair (output, lse) that --returns-lse declares, "
                              f"in {call}")


class NamedKernel:
    """A kernel under guard, shown by its name: ``repr`` (and Hypothesis' printer) read ``kernel=math`` in a falsifying
    example, and the watchdog names it ``kernel NAME``. Its subclasses are dataclasses with ``repr=False`` and a
    ``name`` field."""

    def __repr__(self) -> str:
        return self.name

    def _repr_pretty_(self, printer, cycle) -> None:  # Hypothesis' printer prefers this to __repr__
        printer.text(self.name)

    @property
    def plugin(self) -> str:
        """How the watchdog names it (properties/core/watchdog.py)."""
        return f"kernel {self.name}"


@dataclass(frozen=True, repr=False)
class GuardedKernel(NamedKernel):
    """A kernel with the SDPA contract, checked on every call.  ``repr`` is its name, so Hypothesis'
    falsifying example reads ``kernel=math``.  ``declared``: the limits the run declares
    (properties/kernel/limits.py); what the kernel accepts on each device is learned at start-up (``learn``).
    ``returns_lse`` (--returns-lse): the kernel returns (output, lse); calls give the output, ``with_lse`` both."""

    name: str
    fn: Callable
    declared: Limits = field(default_factory=Limits, compare=False)
    _limits: dict = field(default_factory=dict, compare=False)   # device -> Limits
    returns_lse: bool = False

    # ------------------------------------------------------------------------------------------ limits
    def limits(self, device) -> Limits:
        """What the kernel accepts on ``device``: the declared limits until a decline teaches more."""
        return self._limits.get(str(device), self.declared)

    def learn(self, device) -> Limits:
        """Probe the kernel's limits on ``device`` (once); raises LimitsError if they contradict the declared ones."""
        device = str(device)
        if device not in self._limits:
            from properties.core.dtypes import selected_dtypes
            self._limits[device] = learn_limits(self._probe_fn, device, self.declared, selected_dtypes())
        return self._limits[device]

    # ------------------------------------------------------------------------------------------- calls
    def __call__(self, query, key, value, *, nan_rows: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """``kwargs`` go to the kernel unchanged (only those given, so minimal signatures work);
        ``nan_rows`` (bool, query shape without E) marks queries allowed to come out NaN.  A declined problem is
        rejected (or, for dropout or inputs that require grad, the clause skipped): ``_declined``."""
        __tracebackhide__ = True
        return self._call(query, key, value, nan_rows, kwargs)[0]

    def with_lse(self, query, key, value, *, nan_rows: torch.Tensor | None = None, **kwargs):
        """(output, lse) of a kernel declared with --returns-lse, both checked (``check_output``, ``check_lse``)."""
        __tracebackhide__ = True
        out, lse = self._call(query, key, value, nan_rows, kwargs)
        if lse is None:
            raise ValueError(f"kernel {self.name} is not declared to return its LSE (--returns-lse)")
        return out, check_lse(self.name, lse, query.shape[:-1], query.device, describe_call(query, key, value, kwargs))

    def _call(self, query, key, value, nan_rows, kwargs):
        __tracebackhide__ = True
        call = describe_call(query, key, value, kwargs)
        outside = self.declared.violation(query, key, value, kwargs) if self.declared else ""
        if outside:
            self._reject(f"outside the declared limits: {outside}", query, key, value, kwargs)
        lse = None
        try:
            try:
                with user_call(self.plugin, call):
                    out = self.fn(query, key, value, **kwargs)
            except Exception as exc:  # any failure of user code is a finding, not a crash of the suite ...
                reason = decline_reason(exc)
                if reason is None:
                    raise KernelContractError(f"kernel {self.name} raised {raised(exc)}\n  in {call}") from cause(exc)
                self._declined(reason, query, key, value, kwargs)   # ... unless it declines the problem
            if self.returns_lse:
                out, lse = _pair(self.name, out, call)
            elif isinstance(out, (tuple, list)):
                raise KernelContractError(f"kernel {self.name} returned a {type(out).__name__} of {len(out)}, not a "
                                          f"tensor, in {call} (a kernel that returns (output, lse) is declared with "
                                          f"--returns-lse)")
            out = check_output(self.name, out, query, value, call, nan_rows)
        except AssertionError:   # --repro-dir: the reproducer makes this call and checks the same contract
            evidence.record_call(self.name, (query, key, value), kwargs, shape=(*query.shape[:-1], value.shape[-1]),
                                 nan_rows=nan_rows, first_of_tuple=self.returns_lse)
            raise
        evidence.observe_kernel_call(self.name, query, key, value, kwargs)
        coverage.ran(query.shape[-2], key.shape[-2], query.shape[-1], query.dtype, value.shape[-1],
                     bool(kwargs.get("is_causal")))
        return out, lse

    def _watched_fn(self, query, key, value, **kwargs):
        """The kernel, called under the watchdog."""
        with user_call(self.plugin, lambda: describe_call(query, key, value, kwargs)):
            return self.fn(query, key, value, **kwargs)

    def _probe_fn(self, query, key, value, **kwargs):
        """The kernel as the probes of its limits call it: under the watchdog, the call named as a probe (outside
        any clause, at start-up or at a first decline)."""
        with user_call(self.plugin, lambda: f"{describe_call(query, key, value, kwargs)}, a probe of its limits"):
            return self.fn(query, key, value, **kwargs)

    def _accepts(self, query, key, value, kwargs) -> bool:
        """Whether the kernel accepts the problem, asked of a slice of it: a stack of thousands of copies (the dropout
        clauses) would cost a slow kernel minutes for a skip. The slice keeps every feature a kernel may decline: the
        rank, the lengths, the head sizes, the mask, the layout, and the head axis whole where key and value have
        fewer heads than the query (grouped heads); it drops only batch entries."""
        grouped = query.dim() >= 3 and key.dim() >= 3 and query.shape[-3] != key.shape[-3]

        def first(t):
            if not isinstance(t, torch.Tensor):
                return t
            batch_dims = t.dim() - 2 - (1 if grouped and t.dim() >= 3 else 0)
            return t[tuple(slice(0, 1) for _ in range(max(batch_dims, 0)))]
        try:
            self._watched_fn(first(query), first(key), first(value), **{k: first(v) for k, v in kwargs.items()})
        except Exception as exc:  # only a decline counts
            return decline_reason(exc) is None
        return True

    def _declined(self, reason: str, query, key, value, kwargs):
        """A decline of dropout by a kernel without dropout, or of inputs that require grad, skips the clause (those
        features are optional); any other is a problem outside the kernel's limits: record, reject. (The limits are
        learned at start-up; a kernel built outside the plugin learns them here, at its first decline.)"""
        import pytest
        try:
            limits = self.learn(query.device)
        except LimitsError:   # the plainest problem was accepted at start-up: keep the declared limits
            limits = self._limits[str(query.device)] = self.declared
        p = kwargs.get("dropout_p", 0.0)
        # a kernel with dropout that declines this rate or problem (cuDNN: rates in steps of 1/16, L > 1) has the
        # example rejected; one without dropout (its probes say so) has the dropout clauses skipped
        if p and not limits.dropout and self._accepts(query, key, value, {**kwargs, "dropout_p": 0.0}):
            pytest.skip(f"kernel {self.name} declines dropout_p > 0 ({reason}): the dropout clauses do not apply")
        tensors = (query, key, value, kwargs.get("attn_mask"))
        if any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors):
            detached = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
            if self._accepts(query.detach(), key.detach(), value.detach(), detached):
                pytest.skip(f"kernel {self.name} declines a forward whose inputs require grad ({reason}): "
                            f"the gradient clauses do not apply")
        self._reject(reason, query, key, value, kwargs)

    def _reject(self, reason: str, query, key, value, kwargs):
        """Record the decline and reject the example (outside one: raise KernelDeclined)."""
        from hypothesis import reject
        from hypothesis.control import currently_in_test_context
        coverage.declined(reason, by=self.name)
        if not currently_in_test_context():
            raise KernelDeclined(f"kernel {self.name} declined {describe_call(query, key, value, kwargs)}: {reason}")
        reject()

    def weights(self, query, key, **kwargs) -> torch.Tensor:
        """The kernel's attention weights: its output for V = I_S (attention is linear in V); for a kernel that
        accepts only Ev = E, or only some head sizes, V = I read ``width`` columns at a time (an accepted value
        head size; the last slice padded with zero columns)."""
        __tracebackhide__ = True
        lead, s, e = tuple(key.shape[:-2]), key.shape[-2], query.shape[-1]
        width = identity_width(self.limits(key.device), s, e)
        if width == s:
            return self(query, key, identity_values(lead, s, key.dtype, key.device), **kwargs)
        columns = []
        for c0 in range(0, s, width):
            n = min(width, s - c0)
            eye = torch.zeros(s, width, dtype=torch.float64)
            eye[c0:c0 + n, :n] = torch.eye(n, dtype=torch.float64)
            value = eye.to(key.dtype).to(key.device).expand(*lead, s, width).contiguous()
            columns.append(self(query, key, value, **kwargs)[..., :n])
        return torch.cat(columns, dim=-1)

    def rejects_keyword(self, keyword: str, query, key, value, **kwargs) -> bool:
        """True if the kernel raises TypeError naming ``keyword`` (an optional feature it lacks)."""
        try:
            with user_call(self.plugin, lambda: describe_call(query, key, value, kwargs)):
                self.fn(query, key, value, **kwargs)
        except TypeError as exc:
            return keyword in str(exc)
        except Exception:
            return False
        return False


def identity_width(limits: Limits, s: int, e: int) -> int:
    """The value head size through which a kernel with ``limits`` reads the weights of S keys: S itself (V = I_S)
    where it accepts Ev = S, else E (a kernel that takes only Ev = E) or the accepted head size nearest S."""
    if limits.equal_head_sizes:
        return e
    if limits.head_sizes is not None and s not in limits.head_sizes:
        return nearest_size(limits.head_sizes, s)
    return s


def check_against_oracle(kernel: GuardedKernel, query, key, value, *, fully_masked: str = "zeros",
                         causal_alignment: str = "top-left", what: str = "out",
                         **contract) -> tuple[torch.Tensor, SoftmaxBounds]:
    """Call the kernel with ``contract`` (its keyword arguments) and check ATTN-ORACLE's bound (``value`` None: the
    kernel's weights, read through V = I).  Queries without an admissible key must give zeros (exactly: their bound
    is 0) or, with ``fully_masked='nan'``, NaN.  Returns (output, bounds)."""
    __tracebackhide__ = True
    bounds = softmax_bounds(query, key, value, causal_alignment=causal_alignment, **contract)
    no_key = bounds.reference.no_key_rows
    mask = contract.get("attn_mask")
    float_mask = mask is not None and mask.dtype != torch.bool
    may_be_nan = fully_masked in NON_FINITE_CONVENTIONS or (fully_masked == "mean" and float_mask)
    nan_rows = no_key if may_be_nan else None
    out = (kernel(query, key, value, nan_rows=nan_rows, **contract) if value is not None
           else kernel.weights(query, key, nan_rows=nan_rows, **contract))
    actual = to_float64(out)
    if evidence.active():   # (the full bound only for the reproducer: the check below needs it only when it decides)
        evidence.record("oracle", subject=kernel.name, device=str(query.device), what=what,
                     bound=output_bound(bounds, value), inputs=dict(query=query, key=key, value=value, **contract),
                     alignment=causal_alignment, fully_masked=fully_masked)
    if fully_masked == "zeros" and bool(no_key.any()):
        check_no_key_rows_are_zero(actual, no_key, mask)
    if fully_masked != "zeros" and bool(no_key.any()):
        if fully_masked == "nan":
            assert_all(torch.isnan(actual[no_key]), actual[no_key],
                       what="queries with no admissible key output NaN (--fully-masked nan)")
        elif fully_masked == "mean":
            # a user's own all −inf float row cannot become finite scores: NaN there, else the mean
            nan_rows = torch.isnan(actual).any(-1) if float_mask else torch.zeros_like(actual[..., 0], dtype=torch.bool)
            check_fully_masked_mean(actual, value, no_key & ~nan_rows, query.dtype)
        actual = torch.where(no_key[..., None], bounds.reference.output, actual)
    # 0 at a query without an admissible key: its 0 is exact
    bound = deciding_output_bound(actual, bounds.reference.output, bounds, value)
    assert_within(actual, bounds.reference.output, bound, what=what)
    return out, bounds


def no_key_symptom(mask) -> str:
    """The start of the message for a query without admissible key whose output breaks the zeros convention."""
    kind = "causal mask" if mask is None else f"{'bool' if mask.dtype == torch.bool else 'float'} mask"
    return f"a query whose {kind} admits no key does not come out as 0"


def check_no_key_rows_are_zero(actual: torch.Tensor, no_key: torch.Tensor, mask) -> None:
    """MASK-FULLY-MASKED, zeros: the rows of queries without an admissible key are exactly 0; the message names the
    symptom (PyTorch's cuDNN backend with a bool mask, docs/kernels.md) and the conventions a user may declare."""
    __tracebackhide__ = True
    rows = torch.broadcast_to(no_key.cpu(), actual.shape[:-1])
    values = actual.cpu()[rows]
    assert_all(values == 0, values, what=no_key_symptom(mask),
               note=" (MASK-FULLY-MASKED: zeros, PyTorch's math backend; a kernel that documents another value "
                    "declares it with --fully-masked nan, mean or any; examples/repro_cudnn_bool_mask_rows.py)")


def check_dropout_rate(w: torch.Tensor, positive: torch.Tensor, p: float, note: str = "") -> None:
    """DROPOUT-RATE: ``w`` holds a kernel's weights over independent dropout draws (the draws on the first axis),
    ``positive`` marks the weights that are nonzero without dropout; the fraction of those that are 0 is p within
    Hoeffding's bound at false-alarm probability FALSE_ALARM."""
    __tracebackhide__ = True
    n = w.shape[0] * int(positive.sum())
    dropped = float((w[:, positive] == 0).sum()) / n
    halfwidth = hoeffding_halfwidth(n, 1.0, FALSE_ALARM)
    assert abs(dropped - p) <= halfwidth, (
        f"fraction of dropped weights = {fmt(dropped)}, dropout_p = {fmt(p)}: |difference| > {fmt(halfwidth)} "
        f"(Hoeffding, n = {n} weights, false-alarm probability <= {FALSE_ALARM:g}){note}")


# The --fully-masked conventions (properties/core/options.py) under which such a query may come out NaN.
NON_FINITE_CONVENTIONS = ("nan", "any")


def fully_masked_mean(actual: torch.Tensor, value: torch.Tensor | None, dtype: torch.dtype):
    """(the mean of the values over all S keys, its bound) broadcast to ``actual``: weights 1/S each within the
    softmax's evaluation error, the weighted sum within the rounding of S products, plus underflow (``value`` None:
    V = I)."""
    v = to_float64(value) if value is not None else torch.eye(actual.shape[-1], dtype=torch.float64)
    if v.dim() >= 3 and actual.dim() >= 3 and v.shape[-3] != actual.shape[-3]:
        v = expand_kv_heads(v, actual.shape[-3])
    s, dtype = v.shape[-2], value.dtype if value is not None else dtype
    mean = torch.broadcast_to(v.mean(-2, keepdim=True), actual.shape)
    rounding = evaluation_error(s, dtype) + rounding_error(s, 2, dtype) + gamma(s + 2, unit_roundoff(torch.float64))
    bound = torch.broadcast_to(rounding * v.abs().mean(-2, keepdim=True) + s * torch.finfo(dtype).tiny, actual.shape)
    return mean, bound


def check_fully_masked_mean(actual: torch.Tensor, value: torch.Tensor | None, no_key: torch.Tensor,
                            dtype: torch.dtype | None = None) -> None:
    """Rows without an admissible key equal the mean of the values over all S keys (``fully_masked_mean``)."""
    __tracebackhide__ = True
    mean, bound = fully_masked_mean(actual, value, dtype)
    rows = torch.broadcast_to(no_key.cpu(), actual.shape[:-1])
    assert_within(actual[rows], mean[rows], bound[rows], what="output of a query with no admissible key",
                  reference="mean of the values (--fully-masked mean)")


def backward_gradients(kernel, out, upstream, leaves: dict) -> dict:
    """Backpropagate ``upstream`` through a kernel's output; the gradients of ``leaves`` (name -> leaf), each of
    its leaf's shape. Skips when the kernel has no autograd (output without grad, a backward that declines)."""
    import pytest
    if not out.requires_grad:
        pytest.skip(f"kernel {kernel.name}: its output does not require grad when its inputs do")
    try:
        with user_call(kernel.plugin, lambda: f"the backward pass of kernel {kernel.name}"):
            out.backward(upstream)
    except Exception as exc:  # any failure of user code is a finding, unless it declines (kernel/limits.py)
        reason = decline_reason(exc)
        if reason is not None:
            pytest.skip(f"kernel {kernel.name}: its backward declines ({reason}): the gradient clauses do not apply")
        raise KernelContractError(f"kernel {kernel.name}: backward raised {raised(exc)}") from cause(exc)
    grads = {}
    for name, leaf in leaves.items():
        if leaf.grad is None:
            raise KernelContractError(f"kernel {kernel.name}: no gradient reached {name}, which requires grad")
        assert tuple(leaf.grad.shape) == tuple(leaf.shape), f"d{name} has shape {tuple(leaf.grad.shape)}"
        grads[name] = leaf.grad
    return grads


def lse_pair_problem(kernel: GuardedKernel, device) -> str:
    """Why ``kernel``, declared with --returns-lse, cannot be held to it ('' when it can): called on the plainest
    problem inside its limits on ``device``, it must return (output, lse) with lse of the query's shape without its
    last dim. A raise or a decline is left to the clauses, which report it in their own words."""
    from properties.kernel.cases import Case
    from properties.core.dtypes import selected_dtypes
    limits = kernel.limits(device)
    plain = limits.fit(Case(lead=(1, 2), l=3, s=3, e=8, ev=8, dtype=limits.dtypes_among(selected_dtypes())[0],
                            seed=0))
    query, key, value = plain.qkv(device)
    kwargs = {"is_causal": True} if limits.causal_only else {}
    try:
        out = kernel._probe_fn(query, key, value, **kwargs)
    except Exception:   # the clauses report it, or learn the decline
        return ""
    try:
        _, lse = _pair(kernel.name, out, describe_call(query, key, value, kwargs))
        check_lse(kernel.name, lse, query.shape[:-1], query.device, describe_call(query, key, value, kwargs))
    except KernelContractError as exc:
        return str(exc)
    return ""
