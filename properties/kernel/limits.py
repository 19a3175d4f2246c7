"""Kernels with limits: how a kernel declines a problem, what it accepts, and how the draws stay inside it.

Fused kernels implement part of the SDPA contract (float16/bfloat16 only, a few head sizes, no mask, L = S, ...).
Such a kernel **declines** a problem by raising ``NotImplementedError``, or a ``TypeError``, ``ValueError`` or
``RuntimeError`` whose message says the problem is unsupported in the words flash-attn, Triton wrappers and PyTorch
use ("not supported", "does not support", "only supports", "unsupported", "No available kernel", ...), or a
``TypeError`` for an optional keyword its signature lacks (``enable_gqa``, ``scale``, ``dropout_p``, as before
PyTorch 2.5 / 2.1). Any other exception (an IndexError, a CUDA error, a wrong shape) is a failure, as before.

A declined problem is discarded (a Hypothesis reject) and recorded (properties/kernel/coverage.py). The suite
**learns** the kernel's limits on each device at start-up, before any test draws (so that no strategy changes what it
draws in the middle of a test), by probing one attribute at a time from the plainest problem it accepts (a
non-causal one, else a causal one), and every draw (``cases``, ``grad_cases``) stays inside them. Limits may also
be **declared** up front (``--dtype``, ``--kernel-head-size``, ``--kernel-no-mask``, ``--kernel-equal-lengths``,
``--kernel-equal-head-sizes``): the draws then start inside them, and a kernel that declines the plainest problem
inside its declared limits while it accepts another is a one-line usage error. A kernel that declines every
problem on a device (a CUDA-only kernel on the CPU) has its clauses skipped there, with its message.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from properties.core.declines import decline_reason
from properties.core.options import LIMIT_OPTIONS

__all__ = ["Limits", "LimitsError", "Probe", "learn_limits",
           "set_active", "active", "active_device", "HEAD_SIZES_DRAWN", "declared_limits"]

# Head sizes the kernel strategies draw (core/strategies.py): the small ones and those of real models.
HEAD_SIZES_DRAWN = (*range(1, 17), 32, 64, 80, 96, 128, 192, 256)


@dataclass
class Limits:
    """What a kernel accepts on one device (the defaults: the whole contract). ``reasons`` keeps the kernel's own
    message for each limit it showed, ``unusable`` the message when it accepts no problem at all there."""

    dtypes: tuple[torch.dtype, ...] | None = None     # None: every selected dtype
    head_sizes: tuple[int, ...] | None = None         # None: any
    masks: tuple[str, ...] = ("bool", "float")        # attn_mask kinds accepted
    equal_lengths: bool = False                       # L = S only
    equal_head_sizes: bool = False                    # Ev = E only
    ranks: tuple[int, ...] | None = None              # numbers of leading (batch, head) dims accepted; None: 0, 1, 2
    length_multiple: int = 1                          # L and S multiples of this
    causal: bool = True
    causal_only: bool = False                         # is_causal=True only (no plainer problem is accepted)
    gqa: bool = True
    dropout: bool = True                              # dropout_p > 0 (at the plain rate 0.5) on the plainest problem
    explicit_scale: bool = True
    strided: bool = True                              # non-contiguous (transposed) inputs
    learned: bool = False
    unusable: str = ""
    reasons: dict = field(default_factory=dict)

    def __bool__(self) -> bool:
        """Whether anything is limited."""
        return self != Limits(learned=self.learned, reasons=self.reasons)

    def describe(self) -> str:
        parts = []
        if self.dtypes is not None:
            parts.append("dtypes " + ", ".join(str(d).removeprefix("torch.") for d in self.dtypes))
        if self.head_sizes is not None:
            parts.append("head sizes " + ", ".join(map(str, self.head_sizes)))
        if self.equal_head_sizes:
            parts.append("Ev = E")
        if set(self.masks) != {"bool", "float"}:
            parts.append("masks: " + (", ".join(self.masks) or "none"))
        if self.equal_lengths:
            parts.append("L = S")
        if self.length_multiple > 1:
            parts.append(f"L, S multiples of {self.length_multiple}")
        if self.ranks is not None:
            parts.append("leading dims " + ", ".join(map(str, self.ranks)))
        if self.causal_only:
            parts.append("is_causal only")
        for flag, text in (("causal", "no is_causal"), ("gqa", "no enable_gqa"), ("dropout", "no dropout"), ("explicit_scale", "no scale="),
                           ("strided", "contiguous inputs only")):
            if not getattr(self, flag):
                parts.append(text)
        return "; ".join(parts) or "none"

    # ------------------------------------------------------------------------------ steering the draws
    def dtypes_among(self, selected) -> tuple:
        chosen = tuple(d for d in selected if self.dtypes is None or d in self.dtypes)
        return chosen or tuple(selected)   # nothing fits: draw anyway, the kernel declines, the clause is skipped

    def length(self, n: int) -> int:
        m = self.length_multiple
        return n if m <= 1 else -(-n // m) * m

    def fit(self, problem):
        """A pinned problem (a dataclass with some of dtype, lead, l, s, e, ev, strided, scale) moved inside these
        limits: an accepted dtype, the nearest accepted head size, L = S (the longer: a long-row pin stays long),
        lengths rounded up to the multiple, the leading dims padded or dropped, contiguous, the default scale. A
        problem whose ``axes`` says how many leading dims its test adds (a head axis of grouped heads, a stack of
        dropout draws) keeps ``len(lead) + axes`` among the accepted ranks. The clause's own features (masks,
        is_causal, grouped heads) are left alone: a kernel that declines them declines the problem."""
        if not dataclasses.is_dataclass(problem) or not hasattr(problem, "dtype") or not hasattr(problem, "e"):
            return problem
        from properties.core.dtypes import selected_dtypes
        changes: dict = {}
        if self.dtypes is not None and problem.dtype not in self.dtypes:
            changes["dtype"] = self.dtypes_among(selected_dtypes())[0]
        e = problem.e
        if self.head_sizes is not None and e not in self.head_sizes:
            e = changes["e"] = nearest_size(self.head_sizes, e)
        if self.equal_head_sizes and problem.ev != e:
            changes["ev"] = e
        elif self.head_sizes is not None and problem.ev not in self.head_sizes:
            changes["ev"] = nearest_size(self.head_sizes, problem.ev)
        l, s = problem.l, problem.s
        if self.equal_lengths and l != s:
            l = s = max(l, s)
        l, s = self.length(l), self.length(s)
        if (l, s) != (problem.l, problem.s):
            changes["l"], changes["s"] = l, s
        lead = problem.lead if "lead" in {f.name for f in dataclasses.fields(problem)} else None
        axes = getattr(problem, "axes", 0)
        if lead is not None and self.ranks is not None and len(lead) + axes not in self.ranks:
            fitting = [r - axes for r in self.ranks if r >= axes] or [0]
            rank = min(fitting, key=lambda r: abs(r - len(lead)))
            changes["lead"] = tuple(lead[len(lead) - rank:]) if rank < len(lead) else (1,) * (rank - len(lead)) + lead
        fields = {f.name for f in dataclasses.fields(problem)}
        if "strided" in fields and problem.strided and not self.strided:
            changes["strided"] = False
        if "scale" in fields and problem.scale is not None and not self.explicit_scale:
            changes["scale"] = None
        return dataclasses.replace(problem, **changes) if changes else problem

    def ranks_with(self, axes: int, low: int = 0, high: int = 2) -> list[int]:
        """The numbers of leading dims in [low, high] a draw may give a problem whose test adds ``axes`` more."""
        return [r for r in range(low, high + 1) if self.ranks is None or r + axes in self.ranks]

    def violation(self, query, key, value, kwargs) -> str:
        """Why a call lies outside these limits ('' if it does not): the declared ones are enforced before the
        kernel is called, so that a clause the user ruled out is skipped whatever the kernel would do."""
        mask = kwargs.get("attn_mask")
        kind = None if mask is None else ("bool" if mask.dtype == torch.bool else "float")
        checks = [(self.dtypes is not None and query.dtype not in self.dtypes, f"dtype {query.dtype}"),
                  (self.head_sizes is not None and query.shape[-1] not in self.head_sizes,
                   f"head size {query.shape[-1]}"),
                  (self.equal_head_sizes and value.shape[-1] != query.shape[-1], "Ev != E"),
                  (self.equal_lengths and query.shape[-2] != key.shape[-2], "L != S"),
                  (kind is not None and kind not in self.masks, f"a {kind} attn_mask")]
        return ", ".join(text for broken, text in checks if broken)

    def fits(self, *, dtype=None, e=None, ev=None, l=None, s=None, rank=None) -> bool:
        return ((dtype is None or self.dtypes is None or dtype in self.dtypes)
                and (e is None or self.head_sizes is None or e in self.head_sizes)
                and (ev is None or e is None or not self.equal_head_sizes or ev == e)
                and (l is None or s is None or not self.equal_lengths or l == s)
                and (rank is None or self.ranks is None or rank in self.ranks))


def nearest_size(sizes, n: int) -> int:
    """The accepted head size nearest ``n`` from above (the largest if none is)."""
    return min(sizes, key=lambda m: (m < n, abs(m - n)))


# ---------------------------------------------------------------------------------- the active limits
_active: list = [None, "cpu"]


def set_active(limits, device: str = "cpu") -> None:
    """The limits of the kernel and device of the test now running (set by the plugin around each test): a
    ``Limits``, a function returning the current ones (learned at start-up), or None."""
    _active[:] = [limits, str(device)]


def active() -> Limits | None:
    limits = _active[0]
    return limits() if callable(limits) else limits


def active_device() -> str:
    return _active[1]


# -------------------------------------------------------------------------------------------- probes
@dataclass(frozen=True)
class Probe:
    """One small problem posed to a kernel to learn its limits."""
    dtype: torch.dtype
    l: int = 16
    s: int = 16
    e: int = 16
    ev: int | None = None
    rank: int = 2
    mask: str = "none"          # none | bool | float
    causal: bool = False
    gqa: bool = False
    scale: float | None = None
    strided: bool = False
    dropout: float = 0.0

    def call(self, fn, device) -> str | None:
        """The kernel's decline reason for this problem, or None (it ran, or failed otherwise: the clauses'
        business)."""
        g = torch.Generator().manual_seed(0)
        lead = (1, 2)[2 - self.rank:] if self.rank else ()
        kv_lead = (*lead[:-1], 1) if self.gqa and lead else lead

        def tensor(shape_lead, n, d):
            t = torch.randn(*shape_lead, n, d, generator=g, dtype=torch.float64)
            if self.strided and len(shape_lead) == 2:   # a (b, n, h, d) projection viewed as (b, h, n, d)
                t = t.transpose(-2, -3).contiguous().transpose(-2, -3)
            return t.to(self.dtype).to(device)
        q, k = tensor(lead, self.l, self.e), tensor(kv_lead, self.s, self.e)
        v = tensor(kv_lead, self.s, self.ev or self.e)
        kwargs: dict = {}
        if self.mask == "bool":
            kwargs["attn_mask"] = torch.ones(self.l, self.s, dtype=torch.bool, device=device).tril(self.s - self.l)
        elif self.mask == "float":
            kwargs["attn_mask"] = torch.zeros(self.l, self.s, dtype=self.dtype, device=device)
        if self.causal:
            kwargs["is_causal"] = True
        if self.gqa:
            kwargs["enable_gqa"] = True
        if self.scale is not None:
            kwargs["scale"] = self.scale
        if self.dropout:
            kwargs["dropout_p"] = self.dropout
        try:
            fn(q, k, v, **kwargs)
        except Exception as exc:  # only a decline counts here
            return decline_reason(exc)
        return None


def _supported(device, dtype) -> bool:
    from properties.core.dtypes import dtype_supported
    return dtype_supported(str(device), dtype)


def _base(fn, device, declared: Limits, selected) -> tuple[Probe | None, str, bool]:
    """(the plainest accepted problem, the plainest problem's decline reason ('' if accepted), whether the accepted
    one lies inside the declared limits). The plainest problem: the first selected dtype the declared limits allow,
    the smallest declared head size (16 if none), L = S = 16, two leading dims, no mask."""
    dtypes = [d for d in declared.dtypes_among(selected) if _supported(device, d)]
    others = [d for d in (torch.float32, torch.float64, torch.bfloat16, torch.float16)
              if d not in dtypes and _supported(device, d)]
    sizes = sorted(declared.head_sizes, key=lambda n: (n < 16, n)) if declared.head_sizes else [16, 64, 128, 32, 8]
    extra_sizes = [n for n in (16, 64, 128, 32, 8) if n not in sizes]
    first_reason = ""
    for causal in (False, True):   # a kernel that runs only causal problems (no plainer one) is usable all the same
        for inside, dtype_list, size_list in ((True, dtypes, sizes), (False, dtypes + others, sizes + extra_sizes)):
            for dtype in dtype_list:
                for e in size_list:
                    for n in (16, 64, 128):
                        for rank in (2, 1, 0) if declared.ranks is None else declared.ranks:
                            probe = Probe(dtype, l=n, s=n, e=e, rank=rank, causal=causal)
                            reason = probe.call(fn, device)
                            if reason is None:
                                return probe, first_reason, inside
                            first_reason = first_reason or reason
    return None, first_reason, False


def learn_limits(fn, device, declared: Limits, selected) -> Limits:
    """The kernel's limits on ``device``: the declared ones, narrowed by what probes from its plainest accepted
    problem show. Raises ``LimitsError`` when it declines the plainest problem inside declared limits and accepts
    another; returns ``Limits(unusable=reason)`` when it accepts nothing."""
    base, plainest, inside = _base(fn, device, declared, selected)
    if base is None:
        return dataclasses.replace(declared, learned=True, unusable=plainest or "it declines every probe")
    if plainest and bool(declared) and not inside:   # (lengths and leading dims cannot be declared: tried inside)
        raise LimitsError(f"declines every problem inside its declared limits ({declared.describe()}), the "
                          f"plainest with {plainest}; it accepts {str(base.dtype).removeprefix('torch.')} with head "
                          f"size {base.e}, L = S = {base.l}")
    reasons: dict[str, str] = {}

    def declines(attribute: str, **changes) -> bool:
        reason = dataclasses.replace(base, **changes).call(fn, device)
        if reason is not None:
            reasons.setdefault(attribute, reason)
        return reason is not None

    limits = dataclasses.replace(declared, learned=True, reasons=reasons)
    dtypes = [d for d in selected if _supported(device, d)]
    accepted = tuple(d for d in dtypes if d == base.dtype or not declines("dtype", dtype=d))
    if len(accepted) < len(dtypes):
        limits.dtypes = tuple(d for d in accepted if declared.dtypes is None or d in declared.dtypes)
    candidates = declared.head_sizes or HEAD_SIZES_DRAWN
    sizes = tuple(n for n in candidates if n == base.e or not declines("head size", e=n, ev=n))
    if len(sizes) < len(candidates) or declared.head_sizes:
        limits.head_sizes = sizes
    other_size = next((n for n in sizes if n != base.e), base.e // 2 or base.e + 1)
    limits.equal_head_sizes = declared.equal_head_sizes or declines("Ev = E", ev=other_size)
    limits.equal_lengths = declared.equal_lengths or declines("L = S", s=2 * base.l) or declines("L = S", l=2 * base.l)
    if declines("length multiple", l=base.l + 1, s=base.l + 1):
        limits.length_multiple = base.l
    ranks = tuple(r for r in (0, 1, 2) if r == base.rank or not declines("leading dims", rank=r))
    if len(ranks) < 3:
        limits.ranks = ranks if declared.ranks is None else tuple(r for r in ranks if r in declared.ranks)
    # (a mask with is_causal is a usage error in SDPA: the masks are probed without it)
    limits.masks = tuple(kind for kind in declared.masks if not declines(f"{kind} mask", mask=kind, causal=False))
    limits.causal = declared.causal and not declines("is_causal", causal=True)
    if base.causal:
        limits.causal_only = True
        reasons.setdefault("is_causal only", plainest)
    limits.gqa = declared.gqa and not (base.rank and declines("enable_gqa", gqa=True))
    limits.explicit_scale = declared.explicit_scale and not declines("scale", scale=0.5)
    limits.dropout = not declines("dropout", dropout=0.5)
    limits.strided = declared.strided and not (base.rank == 2 and declines("strided", strided=True))
    return limits


class LimitsError(ValueError):
    """A kernel's declared limits contradict what it accepts."""


# ------------------------------------------------------------------------------------ declared limits
def _head_sizes(values) -> tuple[int, ...] | None:
    if not values:
        return None
    sizes = []
    for value in values:
        for word in str(value).split(","):
            word = word.strip()
            if not word.isdigit() or not 1 <= int(word) <= 1024:
                raise LimitsError(f"--kernel-head-size {value!r}: expected head sizes between 1 and 1024 "
                                  f"(e.g. --kernel-head-size 64 or --kernel-head-size 16,32,64,128)")
            sizes.append(int(word))
    return tuple(sorted(set(sizes)))


def declared_limits(options: dict, dtypes=None, kernel_api: str = "sdpa") -> Limits:
    """The limits declared by ``options`` ({option: value} of LIMIT_OPTIONS) and ``--dtype`` (``dtypes``, None when
    not given). Raises ``LimitsError`` (one line) for a bad value or an option that does not apply."""
    given = [name for name in LIMIT_OPTIONS if options.get(name)]
    if given and kernel_api != "sdpa":
        raise LimitsError(f"{given[0]} declares limits of an SDPA kernel (--kernel-api sdpa); --kernel-api "
                          f"{kernel_api} kernels decline features instead (properties/kernel/flash_guard.py)")
    return Limits(dtypes=tuple(dtypes) if dtypes else None,
                  head_sizes=_head_sizes(options.get("--kernel-head-size")),
                  masks=() if options.get("--kernel-no-mask") else ("bool", "float"),
                  equal_lengths=bool(options.get("--kernel-equal-lengths")),
                  equal_head_sizes=bool(options.get("--kernel-equal-head-sizes")))
