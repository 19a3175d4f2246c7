"""Rotary position embeddings as a config declares them: the frequencies θ_i of every scaling type and the factor
that scales cos and sin, in float64, written once here from their sources (SPEC.md, MODEL-LAYER-ATTENTION):

- default: θ_i = base^(−2i/d), i < d/2 (Su et al., RoFormer §3.2.2);
- linear: θ_i / factor (Chen et al. 2023, "Extending context window ... via positional interpolation");
- dynamic: for a call over L > L_max positions the base grows to base·(factor·L/L_max − (factor − 1))^(d/(d − 2))
  (dynamic NTK-aware scaling; transformers' documented ``rope_parameters`` semantics, ``_compute_dynamic_ntk``);
- yarn: θ_i blended between θ_i/factor (interpolation) and θ_i (extrapolation) by a linear ramp over the dimension
  index between the correction dimensions of beta_fast and beta_slow rotations in the trained length (floored and
  ceiled when ``truncate``), cos and sin scaled by the attention factor 0.1·ln(factor) + 1, or
  mscale-adjusted (Peng et al. 2023, "YaRN", §3.2–3.4 and its reference code; DeepSeek-V3's mscale, mscale_all_dim);
- longrope: θ_i = 1/(λ_i·base^(2i/d)) with λ the short factors up to the trained length and the long ones past it, cos
  and sin scaled by √(1 + ln(s)/ln(L_trained)), s = L_max/L_trained (Ding et al. 2024, "LongRoPE"; Phi-3);
- llama3: wavelengths 2π/θ_i shorter than L_trained/high_freq_factor kept, longer than L_trained/low_freq_factor
  divided by factor, and smoothly interpolated between (Meta's Llama 3.1 ``apply_scaling``).

Pairs of features rotate as "halves" ((i, i + d/2), Llama's rotate_half) or "interleaved" ((2i, 2i + 1), GPT-J,
Cohere, GLM); a partial rotary factor rotates the first d of the head's features and passes the rest.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["Rotary", "SCALINGS", "effective_base", "frequencies", "attention_factor", "rotation", "pairs", "rotate", "describe"]

SCALINGS = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
_F64 = torch.float64


@dataclass(frozen=True)
class Rotary:
    """One layer's rotary embedding. ``dim``: the features rotated per head (even); ``kind``: one of SCALINGS;
    ``original_length``: the trained length the scaling refers to (yarn, longrope, llama3; for dynamic the
    ``max_length`` past which the base grows); ``max_length``: max_position_embeddings."""
    dim: int
    base: float = 10000.0
    kind: str = "default"
    interleaved: bool = False
    factor: float | None = None
    original_length: int | None = None
    max_length: int | None = None
    attention_factor: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0

    def __post_init__(self):
        if self.kind not in SCALINGS:
            raise ValueError(f"rotary scaling {self.kind!r}: expected one of {SCALINGS}")
        if self.dim < 2 or self.dim % 2:
            raise ValueError(f"rotary dim {self.dim}: expected an even number >= 2")

    @property
    def threshold(self) -> int | None:
        """The length past which the frequencies change with the input's length (dynamic: L_max; longrope: the
        trained length), None when they do not."""
        if self.kind == "dynamic":
            return self.max_length
        if self.kind == "longrope":
            return self.original_length
        return None


def _scale(r: Rotary) -> float:
    """s: the declared factor, or the ratio of max_position_embeddings to the trained length."""
    if r.factor is not None:
        return float(r.factor)
    if r.max_length and r.original_length:
        return r.max_length / r.original_length
    return 1.0


def _plain(base: float, dim: int) -> torch.Tensor:
    return base ** (-torch.arange(0, dim, 2, dtype=_F64) / dim)


def _yarn(r: Rotary) -> torch.Tensor:
    s, d, base, trained = _scale(r), r.dim, r.base, r.original_length or r.max_length

    def correction(rotations: float) -> float:   # the dimension whose wavelength fits ``rotations`` times in L
        return d * math.log(trained / (rotations * 2 * math.pi)) / (2 * math.log(base))
    low, high = correction(r.beta_fast), correction(r.beta_slow)
    if r.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(d // 2, dtype=_F64) - low) / (high - low)).clamp(0, 1)
    extrapolated = 1 - ramp          # 1: keep θ_i (high frequencies), 0: θ_i / s (low frequencies)
    theta = _plain(base, d)
    return theta / s * (1 - extrapolated) + theta * extrapolated


def _llama3(r: Rotary) -> torch.Tensor:
    theta, f, trained = _plain(r.base, r.dim), float(r.factor or 1.0), r.original_length or r.max_length
    wavelength = 2 * math.pi / theta
    low_wavelength, high_wavelength = trained / r.low_freq_factor, trained / r.high_freq_factor
    smooth = (trained / wavelength - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor)
    blended = (1 - smooth) * theta / f + smooth * theta
    return torch.where(wavelength < high_wavelength, theta,
                       torch.where(wavelength > low_wavelength, theta / f, blended))


def effective_base(r: Rotary, length: int) -> float:
    """The base the frequencies are powers of, for a call over ``length`` positions: the declared one but for
    dynamic NTK scaling past max_length, where it grows to base·(factor·L/L_max − (factor − 1))^(d/(d − 2))."""
    if r.kind != "dynamic" or r.max_length is None or length <= r.max_length:
        return r.base
    f = float(r.factor or 1.0)
    return r.base * (f * length / r.max_length - (f - 1)) ** (r.dim / (r.dim - 2))


def frequencies(r: Rotary, length: int) -> torch.Tensor:
    """θ (dim/2,) float64 for a call over ``length`` positions (dynamic and longrope choose by length)."""
    if r.kind in ("default", "dynamic"):
        return _plain(effective_base(r, length), r.dim)
    if r.kind == "linear":
        return _plain(r.base, r.dim) / float(r.factor or 1.0)
    if r.kind == "yarn":
        return _yarn(r)
    if r.kind == "longrope":
        long = r.original_length is not None and length > r.original_length
        factors = torch.tensor(r.long_factor if long else r.short_factor, dtype=_F64)
        return _plain(r.base, r.dim) / factors
    return _llama3(r)


def attention_factor(r: Rotary) -> float:
    """The factor cos and sin are multiplied by (1 but for yarn and longrope)."""
    if r.attention_factor is not None:
        return float(r.attention_factor)
    s = _scale(r)
    if r.kind == "yarn":
        def m(scale, mscale=1.0):
            return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0
        return m(s, r.mscale) / m(s, r.mscale_all_dim) if r.mscale and r.mscale_all_dim else m(s)
    if r.kind == "longrope":
        trained = r.original_length or r.max_length
        return 1.0 if s <= 1 else math.sqrt(1 + math.log(s) / math.log(trained))
    return 1.0


def rotation(r: Rotary, positions: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(angles, cos, sin), each (P, dim/2) float64, at ``positions`` of a call over ``length`` positions; cos and
    sin carry the attention factor."""
    angles = positions.to(_F64)[:, None] * frequencies(r, length)[None, :]
    a = attention_factor(r)
    return angles, a * torch.cos(angles), a * torch.sin(angles)


def pairs(r: Rotary, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The feature indices (first, second) of each rotated pair, (dim/2,) each."""
    half = r.dim // 2
    if r.interleaved:
        return torch.arange(0, r.dim, 2), torch.arange(1, r.dim, 2)
    return torch.arange(half), torch.arange(half, r.dim)


def rotate(r: Rotary, x: torch.Tensor, positions: torch.Tensor, length: int) -> torch.Tensor:
    """x (..., P, H, head_dim) float64 rotated at ``positions`` (P,): each pair (a, b) -> (a cos − b sin,
    a sin + b cos), the features past ``dim`` unchanged."""
    _, cos, sin = rotation(r, positions, length)
    first, second = pairs(r, x.shape[-1])
    cos, sin = cos[:, None, :], sin[:, None, :]           # (P, 1, dim/2): broadcast over heads
    a, b = x[..., first], x[..., second]
    out = x.clone()
    out[..., first] = a * cos - b * sin
    out[..., second] = a * sin + b * cos
    return out


def describe(r: Rotary | None) -> str:
    if r is None:
        return "no rotary"
    words = [f"{r.kind} base {r.base:g}", f"{r.dim} features ({'interleaved' if r.interleaved else 'halves'})"]
    if r.kind != "default":
        words.append(f"factor {_scale(r):g}")
    a = attention_factor(r)
    if a != 1.0:
        words.append(f"attention factor {a:.4g}")
    return ", ".join(words)
