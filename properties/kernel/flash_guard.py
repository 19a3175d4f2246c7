"""Calling a kernel with FlashAttention's API: the guard, unsupported features, and the weights of a black box.

A ``FlashKernel`` is the user's function with one of the three APIs (``flash``, ``flash-varlen``,
``flash-kvcache``; properties/plugin/__init__.py's ``--kernel-api``). Every call goes through it: an exception, an output
of the wrong shape, dtype or device, or NaN/Inf becomes an ``AssertionError`` (a failure of the clause the property
is bound to), except that a kernel may decline a feature, by the one rule of the SDPA kernels
(properties/kernel/limits.py, ``decline_reason``): ``NotImplementedError``, a ``TypeError`` for an optional feature's
keyword (an older signature without ``cache_leftpad``, say), or a ``TypeError``, ``ValueError`` or ``RuntimeError``
whose message says the combination is not supported (flash-attn's own wording, e.g. "Paged KVcache does not
support cache_batch_idx", "Softcapping does not support dropout"), is ``Unsupported``. The clauses of that feature
are then skipped with the kernel's message, and drawn problems of the other clauses leave the feature out
(``FlashKernel.unsupported``, probed once per device on a tiny problem); the decline is recorded in the clause's
coverage (properties/kernel/coverage.py), so the report lists what was not covered.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch

from properties.kernel import coverage
from properties.core.declines import decline_reason
from properties.core import evidence
from properties.core.watchdog import cause, describe_args, raised, user_call
from properties.kernel.guard import KernelContractError, NamedKernel, check_output, describe_call

__all__ = ["Unsupported", "FlashKernel", "skip_unsupported", "flash_weights", "FEATURES"]

# The optional features of each API (probed once per device); the rest of the API is required.
FEATURES = {
    "flash": ("window", "softcap", "alibi_heads", "alibi_batch", "gqa", "dropout"),
    "flash-varlen": ("window", "softcap", "alibi_heads", "alibi_batch", "gqa", "dropout"),
    "flash-kvcache": ("window", "softcap", "alibi_heads", "alibi_batch", "gqa", "append", "paged", "batch_idx",
                      "leftpad"),
}


class Unsupported(Exception):
    """The kernel declined a feature (NotImplementedError, or flash-attn's 'does not support' RuntimeError)."""


# Keywords of optional features: a kernel whose signature lacks one (TypeError "unexpected keyword argument")
# declines that feature, as GQA-HEADS treats enable_gqa.
OPTIONAL_KEYWORDS = ("dropout_p", "window_size", "softcap", "alibi_slopes", "k", "v", "cache_batch_idx",
                     "cache_leftpad", "block_table")


def _is_unsupported(exc: BaseException) -> bool:
    """The SDPA kernels' decline rule (properties/kernel/limits.py) with this API's optional keywords."""
    return decline_reason(exc, OPTIONAL_KEYWORDS) is not None


@dataclass(frozen=True, repr=False)
class FlashKernel(NamedKernel):
    """A kernel with FlashAttention's API ``api``, checked on every call; ``repr`` is its name."""

    name: str
    fn: Callable
    api: str
    _unsupported: dict = field(default_factory=dict, compare=False)   # device -> {feature: reason}

    def raw(self, *args, **kwargs):
        """Call the kernel unguarded except for the translation of unsupported features."""
        try:
            with user_call(self.plugin, lambda: describe_args(f"kernel {self.name}", args, kwargs)):
                return self.fn(*args, **kwargs)
        except Exception as exc:
            if _is_unsupported(exc):
                raise Unsupported(f"{type(exc).__name__}: {exc}") from exc
            raise

    def __call__(self, q, key, value, *args, nan_rows: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """The kernel's output (the first element of a tuple), checked: shape (*q.shape[:-1], value's last dim),
        q's dtype and device, finite (except at ``nan_rows``)."""
        __tracebackhide__ = True
        call = describe_call(q, key, value, kwargs)
        try:
            try:
                with user_call(self.plugin, call):
                    out = self.fn(q, key, value, *args, **kwargs)
            except Exception as exc:  # any failure of user code is a finding, unless it declines a feature
                if _is_unsupported(exc):
                    raise Unsupported(f"{type(exc).__name__}: {exc}") from exc
                raise KernelContractError(f"kernel {self.name} raised {raised(exc)}\n  in {call}") from cause(exc)
            if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
                out = out[0]
            out = check_output(self.name, out, q, value, call, nan_rows)
        except AssertionError:   # --repro-dir: the reproducer makes this call and checks the same contract
            evidence.record_call(self.name, (q, key, value, *args), kwargs, shape=(*q.shape[:-1], value.shape[-1]),
                                 nan_rows=nan_rows, first_of_tuple=True)
            raise
        coverage.ran(q.shape[-3], key.shape[-3], q.shape[-1], q.dtype)   # (B, L, H, D); varlen: L = total tokens
        if self.api == "flash" and not args:   # --repro-dir: the fallback of a clause that records no comparison
            evidence.observe_flash_call(self.name, q, key, value, kwargs)
        return out

    # ------------------------------------------------------------------------------ optional features
    def unsupported(self, device) -> dict[str, str]:
        """{feature: the kernel's message} for the optional features it declines on ``device`` (probed once)."""
        device = str(device)
        if device not in self._unsupported:
            found = {}
            for feature in FEATURES[self.api]:
                args, kwargs = _probe(self.api, feature, device)
                try:
                    with user_call(self.plugin, f"the probe of {feature} (kernel {self.name}, {self.api} API)"):
                        self.fn(*args, **kwargs)
                except Exception as exc:  # only a declined feature counts; other errors are the clauses' business
                    if _is_unsupported(exc):
                        found[feature] = f"{type(exc).__name__}: {exc}"
            self._unsupported[device] = found
        return self._unsupported[device]

    def require(self, device, *features: str) -> None:
        """Skip the calling test (with the kernel's message) if the kernel declines one of ``features``."""
        declined = self.unsupported(device)
        for feature in features:
            if feature in declined:
                coverage.declined(declined[feature])
                pytest.skip(f"kernel {self.name} does not support {feature}: {declined[feature]} (not covered)")


@contextlib.contextmanager
def skip_unsupported(kernel: FlashKernel, what: str):
    """A call the kernel declines skips the test with its message (a combination the probes did not try)."""
    try:
        yield
    except Unsupported as exc:
        coverage.declined(str(exc))
        pytest.skip(f"kernel {kernel.name} does not support {what}: {exc} (not covered)")


def flash_weights(kernel: FlashKernel, q, k, *args, value_arg=None, **kwargs) -> torch.Tensor:
    """The weights (B, H, Lq, Lk) of a ``flash``-API kernel, float64: outputs for values that are columns of
    the identity, D at a time (attention is linear in V; D stays the head size, as flash-attn requires)."""
    __tracebackhide__ = True
    b, lk, kv_heads, d = k.shape
    columns = []
    for c0 in range(0, lk, d):
        eye = torch.zeros(lk, d, dtype=torch.float64)
        width = min(d, lk - c0)
        eye[c0:c0 + width, :width] = torch.eye(width, dtype=torch.float64)
        v = eye[None, :, None, :].expand(b, lk, kv_heads, d).to(q.dtype).to(q.device).contiguous()
        out = kernel(q, k, v, *args, **kwargs).detach().to("cpu", torch.float64)  # (B, Lq, H, D)
        columns.append(out[..., :width])
    return torch.cat(columns, dim=-1).permute(0, 2, 1, 3)        # (B, H, Lq, Lk)


# ------------------------------------------------------------------------------------------- probes
def _probe(api: str, feature: str, device: str):
    """A tiny call of ``api`` that uses ``feature`` and nothing else optional: (args, kwargs)."""
    kv = 1 if feature == "gqa" else 2
    kw: dict = {}
    if feature == "window":
        kw["window_size"] = (1, 0)
    elif feature == "softcap":
        kw["softcap"] = 1.0
    elif feature == "alibi_heads":
        kw["alibi_slopes"] = torch.full((2,), 0.5, device=device)
    elif feature == "alibi_batch":
        kw["alibi_slopes"] = torch.full((1, 2), 0.5, device=device)
    elif feature == "dropout":
        kw["dropout_p"] = 0.5
    z = lambda *shape: torch.zeros(*shape, device=device)  # noqa: E731
    if api == "flash":
        return (z(1, 2, 2, 4), z(1, 3, kv, 4), z(1, 3, kv, 4)), kw
    if api == "flash-varlen":
        cu = torch.tensor([0, 2], dtype=torch.int32, device=device)
        cu_k = torch.tensor([0, 3], dtype=torch.int32, device=device)
        return (z(2, 2, 4), z(3, kv, 4), z(3, kv, 4), cu, cu_k, 2, 3), kw
    cache = (z(1, 6, kv, 4), z(1, 6, kv, 4))
    kw["cache_seqlens"] = torch.tensor([3], dtype=torch.int32, device=device)
    if feature == "append":
        kw["k"], kw["v"] = z(1, 1, kv, 4), z(1, 1, kv, 4)
    elif feature == "paged":
        cache = (z(3, 2, kv, 4), z(3, 2, kv, 4))
        kw["block_table"] = torch.tensor([[2, 0, 1]], dtype=torch.int32, device=device)
    elif feature == "batch_idx":
        cache = (z(2, 6, kv, 4), z(2, 6, kv, 4))
        kw["cache_batch_idx"] = torch.tensor([1], dtype=torch.int32, device=device)
    elif feature == "leftpad":
        kw["cache_leftpad"] = torch.tensor([1], dtype=torch.int32, device=device)
    return (z(1, 1, 2, 4), *cache), kw


# ----------------------------------------------------------------------------- plugin parametrization
FIXTURES = {"flash": "flash_kernel", "flash-varlen": "varlen_kernel", "flash-kvcache": "kvcache_kernel"}


def kernel_params(specs, api: str) -> dict[str, list]:
    """The parametrization of the kernel fixtures for ``--kernel-api api`` and ``--kernel specs``:
    {fixture: [pytest.param, ...]}. ``kernel`` (the SDPA clauses) is absent under ``sdpa`` (the plugin's own
    list applies). Fixtures of an API not selected get one skipped entry whose reason says how to select it.
    Without --kernel, ``flash`` selects the zoo's kernels of all three flash APIs, ``flash-varlen`` and
    ``flash-kvcache`` those of their own API. Raises zoo.runtime.plugins.PluginError for a bad spec."""
    from zoo.nn.flash import FLASH_KERNELS, resolve_flash_kernel

    params: dict[str, list] = {}
    if api != "sdpa":
        params["kernel"] = [pytest.param(None, id="sdpa", marks=pytest.mark.skip(
            reason=f"--kernel-api {api}: the SDPA-signature clauses apply to --kernel-api sdpa (the default)"))]
    for family, fixture in FIXTURES.items():
        if api == family and specs:
            chosen = [(spec, resolve_flash_kernel(spec, family)) for spec in specs]
        elif not specs and (api == family or (api == "flash" and family != "flash")):
            chosen = list(FLASH_KERNELS[family].items())
        else:
            hint = f"--kernel-api {family}" + ("" if api == "sdpa" else " (this run: --kernel-api " + api + ")")
            params[fixture] = [pytest.param(None, id=family, marks=pytest.mark.skip(
                reason=f"the {family} clauses run with {hint}"))]
            continue
        params[fixture] = [pytest.param(FlashKernel(name, fn, family), id=name) for name, fn in chosen]
    return params
