"""Module gradients (SPEC.md, "Gradients": MHA-GRAD, FFN-GRAD, NORM-GRAD): the paper's formulas differentiated
in float64, and a bound from Monte Carlo arithmetic.

Each formula below is the module's function written from the paper with plain torch and einops operations,
reading only the parameters that the forward oracles read (properties/module/oracle.py).  Run on float64
copies of the input and parameters, autograd gives the gradient of L = sum(y ∘ G) for a random upstream
gradient G (exact up to float64 rounding).

The bound comes from the standard model of rounding applied to that same computation, forward and backward:
every elementary operation returns its exact result times (1 + δ), |δ| <= u(dtype) (for sums and products
of matrices of n terms: plus n·δ times the same operation on the absolute values of its arguments, the
worst-case rounding of a sum being γ(n) of its absolute terms).  Monte Carlo arithmetic (Parker 1997) draws those δ at random: K runs
of the float64 formula with every operation so perturbed (a TorchDispatchMode, so the backward operations
are perturbed too) spread around the exact gradient by what rounding in the tested dtype does to it,
cancellation included (a LayerNorm's dx is a difference of nearly equal terms).  Per gradient tensor, in
the max norm:

    max |module's gradient − exact| <= C · max_k max |MCA run k − exact| + tiny

with K = 4 runs and C = 4: a correct module rounds the same operations (or fewer) in its own order; 4
leaves room for an order unluckier than the sampled ones.  Where the spread exceeds 1/8 of the gradient's
largest entry, rounding in the tested dtype decides the result (a bfloat16 LayerNorm of two nearly equal
features): the first-order model no longer holds, and only finiteness is required of that tensor.  A bug in a backward pass (a lost term, a wrong
scale, a detached parameter, a gradient that skips a mask) moves a gradient by far more than rounding.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange, repeat
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from properties.core.watchdog import raised, user_call
from properties.core.assertions import fmt
from properties.kernel.flash import flash_allowed
from properties.core.tolerance import unit_roundoff

__all__ = ["RUNS", "C", "MonteCarloArithmetic", "multihead", "feed_forward", "layer_norm", "rms_norm",
           "GradientCheck", "check_gradients", "module_gradients"]

_F64 = torch.float64


# ---------------------------------------------------------------------------------------------- formulas
def multihead(x, memory, params: dict, heads: int, kv_heads: int, key_padding_mask=None, is_causal=False,
              window: int | None = None, softcap: float | None = None):
    """concat_i softmax(Q_i K_g(i)ᵀ/√e + M) V_g(i) W_Oᵀ + b_O; params: q_proj.weight, q_proj.bias, ... (bias may
    be absent); query head i reads key/value head g(i) = i // (h/k).  ``window`` W (self-attention): |i - j| < W;
    ``softcap`` X: scores X·tanh(score / X) before the mask."""
    source = x if memory is None else memory
    proj = {name: F.linear(t, params[f"{name}.weight"], params.get(f"{name}.bias"))
            for name, t in (("q_proj", x), ("k_proj", source), ("v_proj", source))}
    q = rearrange(proj["q_proj"], "b l (h e) -> b h l e", h=heads)
    k = repeat(proj["k_proj"], "b s (k e) -> b (k g) s e", k=kv_heads, g=heads // kv_heads)
    v = repeat(proj["v_proj"], "b s (k e) -> b (k g) s e", k=kv_heads, g=heads // kv_heads)
    scores = torch.einsum("bhle,bhse->bhls", q, k) / math.sqrt(q.shape[-1])
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    l, s = scores.shape[-2:]
    visible = torch.ones(l, s, dtype=torch.bool, device=x.device)
    if is_causal:
        visible = visible.tril()
    if window is not None and memory is None:   # flash-attn's window_size (W - 1, W - 1)
        visible = visible & flash_allowed(l, s, window_size=(window - 1, window - 1), offset=0).to(x.device)
    visible = visible.expand(x.shape[0], 1, l, s)
    if key_padding_mask is not None:
        visible = visible & key_padding_mask.to(torch.bool)[:, None, None, :]
    weights = torch.softmax(scores.masked_fill(~visible, -math.inf), dim=-1)
    out = rearrange(torch.einsum("bhls,bhse->bhle", weights, v), "b h l e -> b l (h e)")
    return F.linear(out, params["out_proj.weight"], params.get("out_proj.bias"))


_ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}


def feed_forward(x, params: dict, activation: str):
    """relu/gelu/gelu_tanh: f(x W1ᵀ + b1) W2ᵀ + b2; swiglu: (SiLU(x W_gateᵀ + b_gate) ∘ (x W1ᵀ + b1)) W2ᵀ + b2."""
    up = F.linear(x, params["up.weight"], params.get("up.bias"))
    if activation == "swiglu":
        hidden = F.silu(F.linear(x, params["gate.weight"], params.get("gate.bias"))) * up
    else:
        hidden = _ACTIVATIONS[activation](up)
    return F.linear(hidden, params["down.weight"], params.get("down.bias"))


def layer_norm(x, params: dict, eps: float):
    """(x − mean) / sqrt(var + eps) · g + b over the features, var the biased variance, formed in one pass as
    mean(x²) − mean(x)² (as fused kernels do: its rounding bounds the two-pass form's too)."""
    mean = x.mean(-1, keepdim=True)
    var = (x * x).mean(-1, keepdim=True) - mean * mean
    y = (x - mean) / torch.sqrt(var + eps) * params["weight"]
    return y + params["bias"] if "bias" in params else y


def rms_norm(x, params: dict, eps: float):
    """x / sqrt(mean(x²) + eps) · g."""
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * params["weight"]


# ---------------------------------------------------------------------------------- Monte Carlo arithmetic
_ABSOLUTE = {"mm", "bmm", "addmm", "baddbmm", "addbmm", "dot", "mv", "sum", "mean"}   # rounding ∝ f(|args|)
_EXACT = {"detach", "clone", "copy_", "_to_copy", "empty_like", "zeros_like", "ones_like", "lift_fresh", "neg",
          "abs", "expand", "masked_fill", "where", "fill", "zero_", "new_zeros", "new_empty", "scalar_tensor",
          "full_like", "ones", "zeros", "full", "empty", "repeat", "cat", "index", "index_select", "threshold_backward"}


def _gelu_terms(x):
    """GELU'(x) = Φ(x) + x φ(x) with Φ(x) = (1 + erf(x/√2))/2: 1 + |x| φ(x) (the terms cancel near x = −0.75,
    and 1 + erf cancels for negative x, so its rounding is relative to 1)."""
    return 1 + x.abs() * torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def _silu_terms(x):
    """SiLU'(x) = σ(x)(1 + x(1 − σ(x))): σ(x)(1 + |x|(1 − σ(x)))."""
    sigma = torch.sigmoid(x)
    return sigma * (1 + x.abs() * (1 - sigma))


# roundings of one evaluation of a function of a few ulps (transcendental evaluation, 1 to 2 ulps each, and
# the arithmetic around it; gelu and silu as in the forward oracle's activation model)
_ROUNDINGS = {"exp": 2, "erf": 2, "tanh": 2, "sigmoid": 3, "pow": 2, "rsqrt": 2, "gelu": 6, "silu": 5,
              "gelu_backward": 10, "silu_backward": 8}
# fused activation derivatives: rounding relative to the terms of f'(x), not to f'(x) itself
_ACTIVATION_TERMS = {"gelu_backward": _gelu_terms, "silu_backward": _silu_terms}


def _terms(name: str, args, out) -> int:
    """How many terms a sum or matrix product adds per result entry (its rounding grows with that count)."""
    if name in ("sum", "mean", "dot"):
        return max(1, args[0].numel() // max(1, out.numel()))
    inner = [a for a in args if torch.is_tensor(a) and a.dim() >= 1]
    return (inner[-2].shape[-1] if len(inner) >= 2 else 1) + (1 if name.startswith(("add", "badd")) else 0)


class MonteCarloArithmetic(TorchDispatchMode):
    """Every float64 operation's result x becomes x + δ·u·m with δ uniform in [−1, 1] per entry: m = |x| for
    elementwise operations, m = n times the operation on the arguments' absolute values for sums and
    matrix products of n terms (their rounding is γ(n) of the absolute terms).  Views, copies, selections and exact
    operations are left alone.  Fused activation derivatives (GELU', SiLU') are relative to their terms'
    absolute sum."""

    def __init__(self, u: float, generator: torch.Generator):
        super().__init__()
        self.u, self.generator = u, generator

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.__name__.split(".")[0]
        if func.is_view or func._schema.is_mutable or name in _EXACT or not torch.is_tensor(out):
            return out
        if out.dtype != _F64 or not out.numel():
            return out
        if name in _ABSOLUTE:
            absolute = tree_map(lambda a: a.abs() if torch.is_tensor(a) and a.is_floating_point() else a, args)
            magnitude = func(*absolute, **kwargs) * _terms(name, args, out)
        elif name in _ACTIVATION_TERMS:
            grad, x = args[0], args[1]
            magnitude = grad.abs() * _ACTIVATION_TERMS[name](x) * _ROUNDINGS[name]
        elif name == "_softmax":          # w = exp(s − max)/Σ exp: relative γ(2S + 6) (the kernel's model)
            magnitude = out.abs() * (2 * out.shape[args[1]] + 6)
        elif name == "_softmax_backward_data":   # w ∘ (g − Σ g ∘ w): relative to the terms, S + 2 roundings
            grad, w, dim = args[0], args[1], args[2]
            magnitude = w.abs() * (grad.abs() + (grad.abs() * w.abs()).sum(dim, keepdim=True)) * (w.shape[dim] + 2)
        elif name in ("gelu", "silu"):   # x Φ(x), x σ(x): rounding relative to |x| (1 + erf cancels)
            magnitude = args[0].abs() * _ROUNDINGS[name]
        else:
            magnitude = out.abs() * _ROUNDINGS.get(name, 1)
        noise = 2 * torch.rand(out.shape, generator=self.generator, dtype=_F64) - 1
        return out + self.u * noise * magnitude


# ------------------------------------------------------------------------------------------- comparison
RUNS, C = 4, 4.0
ILL_CONDITIONED = 1 / 8   # spread / max|exact| beyond which rounding decides the result


@dataclass(frozen=True)
class GradientCheck:
    """One tensor's gradient: the module's, the exact one and the spread of the MCA runs (float64, CPU)."""
    name: str
    module: torch.Tensor
    exact: torch.Tensor
    spread: float

    @property
    def error(self) -> float:
        return float(torch.nan_to_num((self.module - self.exact).abs(), nan=math.inf).max()) if self.exact.numel() else 0.0

    def bound(self, dtype: torch.dtype) -> float:
        return C * self.spread + torch.finfo(dtype).tiny

    def message(self, dtype: torch.dtype) -> str:
        diff = torch.nan_to_num((self.module - self.exact).abs(), nan=math.inf)
        index = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape)) if diff.dim() else ()
        return (f"d{self.name}: max |module - exact| = {fmt(self.error)} > bound {fmt(self.bound(dtype))} "
                f"(= {C:g} × the rounding spread {fmt(self.spread)} of {RUNS} Monte Carlo runs) at index {index}: "
                f"module = {fmt(float(self.module[index]))}, exact = {fmt(float(self.exact[index]))}")


def module_gradients(module, inputs: dict, upstream: torch.Tensor, call) -> tuple[dict, str]:
    """Gradients of sum(call(module, **inputs) ∘ upstream) w.r.t. the floating inputs and every parameter, by
    name ("x", "q_proj.weight", ...), float64 on the CPU; or ({}, why autograd is not available)."""
    leaves = {name: t.detach().clone().requires_grad_(True) if torch.is_tensor(t) and t.is_floating_point() else t
              for name, t in inputs.items()}
    params = dict(module.named_parameters())
    for p in params.values():
        p.grad = None
    try:
        out = call(module, **leaves)
    except Exception as exc:  # a user's module may fail in any way: a finding, not a crash
        raise AssertionError(f"the forward pass raised {raised(exc)}") from exc
    if not out.requires_grad:
        return {}, f"{type(module).__qualname__}'s output does not require grad: the module does not support autograd"
    try:
        with user_call(getattr(module, "_watchdog_plugin", f"module {type(module).__qualname__}"),
                       f"the backward pass of {type(module).__qualname__}"):
            out.backward(upstream.to(out.dtype))
    except NotImplementedError as exc:
        return {}, f"{type(module).__qualname__}'s backward raised NotImplementedError: {exc}"
    grads = {}
    for name, t in list(leaves.items()) + list(params.items()):
        if torch.is_tensor(t) and t.is_floating_point():
            g = t.grad
            grads[name] = torch.zeros_like(t, dtype=_F64, device="cpu") if g is None else g.detach().to("cpu", _F64)
    for p in params.values():
        p.grad = None
    return grads, ""


def _formula_gradients(formula, inputs: dict, params: dict, upstream: torch.Tensor, mode=None) -> dict:
    """Autograd of sum(formula(inputs, params) ∘ upstream) in float64 on the CPU, under ``mode`` if given."""
    def leaf(t):
        if not torch.is_tensor(t):
            return t
        t = t.detach().cpu()
        return t.to(_F64).requires_grad_(True) if t.is_floating_point() else t
    x = {n: leaf(t) for n, t in inputs.items()}
    p = {n: leaf(t) for n, t in params.items()}
    with mode if mode is not None else contextlib.nullcontext():
        formula(x, p).backward(upstream.detach().to("cpu", _F64))
    return {n: t.grad.detach() if t.grad is not None else torch.zeros_like(t)
            for n, t in list(x.items()) + list(p.items()) if torch.is_tensor(t) and t.requires_grad}


def check_gradients(module, call, formula, inputs: dict, params: dict, upstream: torch.Tensor,
                    dtype: torch.dtype, seed: int = 0) -> list[str]:
    """Compare the module's gradients with the formula's; returns the failure lines (empty: pass).

    ``call(module, **inputs)`` runs the module; ``formula(inputs, params)`` the paper's function; ``params``
    maps the module's parameter names that the formula reads to the module's tensors.  Gradients of other
    parameters are not bounded here (a replacement module may have more) but must be finite."""
    grads, reason = module_gradients(module, inputs, upstream, call)
    if not grads:
        import pytest
        pytest.skip(reason)
    exact = _formula_gradients(formula, inputs, params, upstream)
    # u(dtype) + u(float64): the module's rounding and the float64 evaluation's own
    u = unit_roundoff(dtype) + unit_roundoff(_F64)
    generator = torch.Generator().manual_seed(seed)
    runs = [_formula_gradients(formula, inputs, params, upstream, MonteCarloArithmetic(u, generator))
            for _ in range(RUNS)]
    failures = []
    for name, value in exact.items():
        got = grads.get(name)
        if got is None:
            failures.append(f"d{name}: the module has no tensor of that name")
            continue
        if got.shape != value.shape:
            failures.append(f"d{name}: shape {tuple(got.shape)}, expected {tuple(value.shape)}")
            continue
        spread = max(float(torch.nan_to_num((run[name] - value).abs(), nan=math.inf).max()) for run in runs) \
            if value.numel() else 0.0
        if spread > ILL_CONDITIONED * float(value.abs().max()):
            # rounding in this dtype moves the gradient by a large part of itself: the first-order model does
            # not hold and no bound is meaningful; only finiteness is required
            if not bool(torch.isfinite(got).all()):
                failures.append(f"d{name}: not finite")
            continue
        check = GradientCheck(name, got, value, spread)
        if not check.error <= check.bound(dtype):
            failures.append(check.message(dtype))
    for name, got in grads.items():
        if name not in exact and not bool(torch.isfinite(got).all()):
            failures.append(f"d{name}: not finite")
    return failures
