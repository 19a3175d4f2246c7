"""The FlashAttention API (flash-attn 2.x): its float64 oracle, its rounding bound, and the drawn problems.

Semantics (SPEC.md, "The FlashAttention API"; flash_attn_interface.py docstrings), written here from the
docstrings and independent of ``zoo/``: q (B, Lq, H, D), k and v (B, Lk, Hkv, D), query head h reads key/value
head h // (H / Hkv); with o = Lk − Lq, query i may attend key j iff j ≤ i + o under ``causal`` and
i + o − left ≤ j ≤ i + o + right under ``window_size=(left, right)`` (−1: unbounded); the score is
σ q·k, capped to c·tanh(σ q·k / c) when softcap c > 0, plus −slope·|i + o − j| with ``alibi_slopes`` (H,) or
(B, H); a query with no admissible key outputs 0.

Oracle and bound reuse ``core/oracle.py`` and ``core/tolerance.py``: the softcap and ALiBi terms enter
``softmax_bounds`` as an additive float mask m = (capped score + bias) − σ q·k (−∞ where not admissible), so the
oracle's scores are exactly the flash scores and the SDPA rounding model applies unchanged. Capping and the
bias cost a kernel a few more roundings than the model's E + 5 (the division by c, ``tanh`` within 4u, the
multiplication by c, the ALiBi product and its addition: at most 16u·(σ Σ|q k| + |m|) together, since
c·tanh(x/c) is 1-Lipschitz and |c·tanh(x/c)| ≤ |x|); they are counted by lengthening the dot product by
``FEATURE_ROUNDINGS`` zero features, which changes no score and raises γ(E + 5) to γ(E + 21). The slopes are
float32 (the API's dtype) and a kernel may form the bias in float32 whatever the inputs' dtype (flash-attn does; so
does plain ``slopes * distance`` with an integer distance): with ALiBi, a float64 kernel is held to float32's u.
Without softcap and ALiBi the bound is exactly the SDPA one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from einops import einsum
from hypothesis import strategies as st

from properties.kernel.gradients import Gradients, gradient_oracle, softcap_slope
from properties.kernel.magnitudes import TYPICAL, Scores, score_shapes
from properties.core.oracle import expand_kv_heads, to_float64
from properties.core.strategies import derived_generator, on, require_dtype, seeds
from properties.kernel.cases import dtypes
from properties.core.tolerance import SoftmaxBounds, output_bound, softmax_bounds

__all__ = ["FEATURE_ROUNDINGS", "FlashBounds", "FlashCase", "flash_allowed", "alibi_bias", "flash_bounds",
           "flash_cases", "draw_slopes", "windows", "window_keys", "set_window_right_below_lk", "to_heads_first",
           "flash_gradients"]

FEATURE_ROUNDINGS = 16
_F64 = torch.float64

# --window-right-below-lk (properties/plugin/__init__.py): drawn windows keep 0 <= right < Lk, where flash-attn 2's CUDA
# kernel follows its docstring (it rewrites right = -1 or right >= Lk to Lk, which differs when Lq > Lk + 1).
_window_right_below_lk = [False]


def set_window_right_below_lk(flag: bool) -> None:
    _window_right_below_lk[0] = bool(flag)


def flash_allowed(lq: int, lk: int, *, causal: bool = False, window_size=(-1, -1), offset: int | None = None):
    """(lq, lk) bool: key j admissible for query i (bottom-right: offset o = lk − lq unless given)."""
    o = lk - lq if offset is None else offset
    i = torch.arange(lq)[:, None] + o
    j = torch.arange(lk)[None, :]
    left, right = window_size
    allowed = torch.ones(lq, lk, dtype=torch.bool)
    if causal:
        allowed &= j <= i
    if right >= 0:
        allowed &= j <= i + right
    if left >= 0:
        allowed &= j >= i - left
    return allowed


def alibi_bias(slopes, batch: int, heads: int, lq: int, lk: int) -> torch.Tensor:
    """(batch, heads, lq, lk) float64: −slope·|i + lk − lq − j| (slopes (heads,) or (batch, heads))."""
    s = to_float64(slopes).expand(batch, heads)
    distance = (torch.arange(lq)[:, None] + (lk - lq) - torch.arange(lk)[None, :]).abs().to(_F64)
    return -s[:, :, None, None] * distance


def to_heads_first(t: torch.Tensor) -> torch.Tensor:
    """(B, L, H, D) -> (B, H, L, D) in float64 on the CPU."""
    return to_float64(t).transpose(1, 2)


@dataclass(frozen=True)
class FlashBounds:
    """The oracle of one ``flash_attn_func`` call and the bound on a correct kernel's error."""

    softmax: SoftmaxBounds | None   # None for an empty problem (Lq = 0 or Lk = 0)
    output: torch.Tensor            # (B, Lq, H, Dv) float64
    no_key: torch.Tensor            # (B, Lq, H) bool: queries with no admissible key
    value: torch.Tensor             # (B, Hkv, Lk, Dv) float64

    @property
    def weights(self) -> torch.Tensor:
        """(B, H, Lq, Lk) oracle weights."""
        return self.softmax.weights

    @property
    def admissible(self) -> torch.Tensor:
        return self.softmax.admissible

    def output_bound(self, *, extra_roundings: int = 0, weight_factor: float = 1.0) -> torch.Tensor:
        """(B, Lq, H, Dv) elementwise bound on |kernel output − oracle output| (0 for queries with no key)."""
        if self.softmax is None:
            return torch.zeros_like(self.output)
        return output_bound(self.softmax, self.value, extra_roundings=extra_roundings,
                            weight_factor=weight_factor).transpose(1, 2)


def flash_bounds(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                 alibi_slopes=None, dtype=None) -> FlashBounds:
    """The oracle of ``flash_attn_func(q, k, v, ...)`` (float64, CPU) with its rounding bound; ``dtype`` is the
    precision the kernel is held to (default: q's)."""
    dtype = dtype or q.dtype
    qh, kh, vh = to_heads_first(q), to_heads_first(k), to_heads_first(v)
    b, h, lq, d = qh.shape
    lk, dv = kh.shape[2], vh.shape[-1]
    if lq == 0 or lk == 0:
        return FlashBounds(None, torch.zeros(b, lq, h, dv, dtype=_F64), torch.ones(b, lq, h, dtype=torch.bool), vh)
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    features = softcap > 0 or alibi_slopes is not None
    if features:  # FEATURE_ROUNDINGS more roundings per score: zero features (module docstring)
        qh = torch.cat([qh, qh.new_zeros(b, h, lq, FEATURE_ROUNDINGS)], dim=-1)
        kh = torch.cat([kh, kh.new_zeros(*kh.shape[:3], FEATURE_ROUNDINGS)], dim=-1)
    raw = (qh * scale) @ expand_kv_heads(kh, h).transpose(-1, -2)   # as core/oracle.py's reference_scores
    target = softcap * torch.tanh(raw / softcap) if softcap > 0 else raw
    if alibi_slopes is not None:
        target = target + alibi_bias(alibi_slopes, b, h, lq, lk)
    allowed = flash_allowed(lq, lk, causal=causal, window_size=tuple(window_size))
    mask = torch.where(allowed, target - raw, torch.full_like(raw, -math.inf))
    if alibi_slopes is not None and torch.finfo(dtype).eps < torch.finfo(torch.float32).eps:
        dtype = torch.float32   # the bias may be formed in its slopes' float32 (module docstring)
    bounds = softmax_bounds(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True, dtype=dtype)
    output = bounds.reference.output.transpose(1, 2)
    return FlashBounds(bounds, output, bounds.reference.no_key_rows.transpose(1, 2), vh)


def flash_gradients(case: "FlashCase", bounds: FlashBounds, q, k, v, grad_out) -> Gradients:
    """The float64 chain rule of sum(out ∘ grad_out) for one ``flash_attn_func`` problem, (B, L, H, D) tensors, with
    its bound: kernel/gradients.py's oracle on the flash scores, a soft cap through its slope 1 − tanh²."""
    scale = case.scale if case.scale is not None else case.d ** -0.5
    qh, kh = to_heads_first(q), to_heads_first(k)
    slope = None if not case.softcap else softcap_slope(qh, kh, scale=scale, softcap=case.softcap, dtype=case.dtype)
    return gradient_oracle(bounds.softmax, qh, kh, to_heads_first(v), to_heads_first(grad_out), scale=scale,
                           score_slope=slope)


# --------------------------------------------------------------------------------------- drawn problems
@dataclass(frozen=True)
class FlashCase:
    """One ``flash_attn_func`` problem: shapes, dtype, the keywords, the score spread (q times 2**spread),
    the layout (``strided``: q, k, v as .transpose(1, 2) views of (B, H, L, D) tensors) and the seed."""

    b: int
    lq: int
    lk: int
    kv_heads: int
    group: int
    d: int
    dtype: torch.dtype
    causal: bool = False
    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    alibi: str = "none"              # none | heads (H,) | batch (B, H)
    scale: float | None = None
    spread: int = 0
    strided: bool = False
    seed: int = 0
    scores: Scores = TYPICAL         # peaked or very negative rows (properties/kernel/magnitudes.py)

    @property
    def heads(self) -> int:
        return self.kv_heads * self.group

    def __repr__(self) -> str:
        parts = [f"b={self.b}", f"lq={self.lq}", f"lk={self.lk}", f"kv_heads={self.kv_heads}", f"group={self.group}",
                 f"d={self.d}", f"dtype={self.dtype}"]
        defaults = {"causal": False, "window": (-1, -1), "softcap": 0.0, "alibi": "none", "scale": None,
                    "spread": 0, "strided": False, "scores": TYPICAL}
        parts += [f"{name}={getattr(self, name)!r}" for name, default in defaults.items()
                  if getattr(self, name) != default]
        return f"FlashCase({', '.join(parts)}, seed={self.seed})"

    @property
    def features(self) -> set[str]:
        used = set()
        if self.window != (-1, -1):
            used.add("window")
        if self.softcap > 0:
            used.add("softcap")
        if self.alibi != "none":
            used.add(f"alibi_{self.alibi}")
        if self.group > 1:
            used.add("gqa")
        return used

    def without(self, features) -> "FlashCase":
        """The case with the given features switched off (a kernel that does not support them)."""
        case = self
        if "window" in features:
            case = replace(case, window=(-1, -1))
        if "softcap" in features:
            case = replace(case, softcap=0.0)
        if f"alibi_{case.alibi}" in features:
            case = replace(case, alibi="none")
        if "gqa" in features:
            case = replace(case, kv_heads=case.heads, group=1)
        return case

    def slopes64(self, generator: torch.Generator | None = None) -> torch.Tensor | None:
        if self.alibi == "none":
            return None
        g = generator or derived_generator(self.seed, 5)
        return draw_slopes(g, (self.heads,) if self.alibi == "heads" else (self.b, self.heads))

    def tensors64(self, stream: int = 0):
        """q (B, Lq, H, D) scaled by 2**spread, k, v (B, Lk, Hkv, D), float64 on the CPU."""
        g = derived_generator(self.seed, stream)
        q = torch.randn(self.b, self.lq, self.heads, self.d, generator=g, dtype=_F64) * 2.0**self.spread
        k = torch.randn(self.b, self.lk, self.kv_heads, self.d, generator=g, dtype=_F64)
        v = torch.randn(self.b, self.lk, self.kv_heads, self.d, generator=g, dtype=_F64)
        if self.scores != TYPICAL:
            q, k = self.scores.directions(q, k, derived_generator(self.seed, 3))
            # one factor for q and k: the largest scaled partial sum over every query head and its key head
            sigma = self.scale if self.scale is not None else 1 / math.sqrt(self.d)
            k_heads = k.repeat_interleave(self.group, dim=2)
            current = abs(sigma) * einsum(q.abs(), k_heads.abs(), "b i h d, b j h d -> b h i j").max().item()
            factor = math.sqrt(self.scores.target(self.dtype)) / math.sqrt(current)
            q, k = q * factor, k * factor
        return q, k, v

    def place(self, t: torch.Tensor, device) -> torch.Tensor:
        """Round to the dtype and move; a strided case gets the (B, H, L, D) storage seen as (B, L, H, D)."""
        if self.strided:
            return on(t.transpose(1, 2).contiguous(), self.dtype, device).transpose(1, 2)
        return on(t, self.dtype, device)

    def tensors(self, device, stream: int = 0):
        """q, k, v in the dtype on ``device`` and the slopes (float32, or None)."""
        require_dtype(str(device), self.dtype)
        q, k, v = (self.place(t, device) for t in self.tensors64(stream))
        slopes = self.slopes64()
        return q, k, v, None if slopes is None else slopes.to(torch.float32).to(device)

    def kwargs(self, slopes=None) -> dict:
        """The flash keywords of this case (only those that differ from the defaults)."""
        kw = {}
        if self.scale is not None:
            kw["softmax_scale"] = self.scale
        if self.causal:
            kw["causal"] = True
        if self.window != (-1, -1):
            kw["window_size"] = self.window
        if self.softcap > 0:
            kw["softcap"] = self.softcap
        if slopes is not None:
            kw["alibi_slopes"] = slopes
        return kw

    def oracle_kwargs(self, slopes=None) -> dict:
        return dict(softmax_scale=self.scale, causal=self.causal, window_size=self.window, softcap=self.softcap,
                    alibi_slopes=slopes)


def draw_slopes(generator: torch.Generator, shape) -> torch.Tensor:
    """ALiBi slopes: uniform in [1/16, 2], exact in float32 (returned in float64)."""
    return (1 / 16 + (2 - 1 / 16) * torch.rand(*shape, generator=generator, dtype=_F64)).to(torch.float32).to(_F64)


def window_keys(lengths) -> int:
    """The Lk windows are drawn against for several sequences of key lengths ``lengths``: the longest, or under
    --window-right-below-lk the shortest non-empty one (right < Lk then holds for every sequence)."""
    positive = [n for n in lengths if n > 0] or [1]
    return min(positive) if _window_right_below_lk[0] else max(positive)


@st.composite
def windows(draw, lk: int, *, bounded: bool | None = None) -> tuple[int, int]:
    """window_size for Lk keys: each side −1 or 0 … Lk + 1 (``bounded``: at least one side bounded; False: (−1, −1)).
    Under --window-right-below-lk a bounded window has 0 <= right < Lk."""
    if bounded is False:
        return (-1, -1)
    side = st.integers(-1, lk + 1)
    while True:
        left = draw(side)
        if _window_right_below_lk[0]:
            right = draw(st.integers(0, max(lk - 1, 0)))
        else:
            right = draw(side)
        if (left, right) != (-1, -1) or bounded is None:
            return (left, right)


@st.composite
def flash_cases(draw, *, max_b: int = 2, min_lq: int = 1, max_lq: int = 7, min_lk: int = 1, max_lk: int = 9,
                max_d: int = 8, causal=None, window=None, softcap=None, alibi=None, group=None, scale="draw",
                spread=None, strided=None, dtype=None, scores=False) -> FlashCase:
    """Drawn ``flash_attn_func`` problems. Each feature argument fixes it (``window``/``softcap``: True = on,
    False = off; ``alibi``: 'none', 'heads', 'batch'; ``scale``: a value or None for the default); None (for
    ``scale``: 'draw') draws it. ``scores``: also draw peaked and very negative rows (properties/kernel/magnitudes.py)."""
    lq, lk = draw(st.integers(min_lq, max_lq)), draw(st.integers(min_lk, max_lk))
    kv_heads = draw(st.integers(1, 2))
    the_group = draw(st.integers(1, 3)) if group is None else group
    is_causal = draw(st.booleans()) if causal is None else causal
    bounded = draw(st.booleans()) if window is None else window
    the_window = draw(windows(lk, bounded=bounded)) if bounded else (-1, -1)
    cap = softcap if softcap is not None else draw(st.booleans())
    cap_value = draw(st.sampled_from([0.5, 1.0, 2.5, 5.0, 30.0])) if cap else 0.0
    return FlashCase(
        b=draw(st.integers(1, max_b)), lq=lq, lk=lk, kv_heads=kv_heads, group=the_group, d=draw(st.integers(1, max_d)),
        dtype=draw(dtype if dtype is not None else dtypes()), causal=is_causal, window=the_window, softcap=cap_value,
        alibi=draw(st.sampled_from(["none", "heads", "batch"])) if alibi is None else alibi,
        scale=draw(st.one_of(st.none(), st.floats(0.05, 2.0))) if scale == "draw" else scale,
        spread=draw(st.integers(-2, 3)) if spread is None else spread,
        strided=draw(st.booleans()) if strided is None else strided, seed=draw(seeds),
        scores=draw(score_shapes()) if scores else TYPICAL)
