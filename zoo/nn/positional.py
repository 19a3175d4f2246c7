"""Positional information: how (and whether) a model knows the order of its tokens.

One protocol for every scheme, absolute or relative. The model adds absolute codes to the embeddings, and
hands the same module to each self-attention layer, which asks it about queries, keys and scores:

    forward(x, offset)                 adds absolute position codes to embeddings x (b, l, d)
    rotate(t, offset)                  turns per-head queries/keys t (b, h, l, e) by their positions (RoPE)
    score_bias(l, s, offset, heads)    an additive bias (h, l, s) on the scores of queries at positions
                                       offset..offset+l-1 against keys at 0..s-1, or None (ALiBi-style)

Each default is the identity (or None), so a scheme overrides only what it does, and a new scheme is one
class here, one file under conf/pos/ and its spec clause. ``offset`` is the absolute position of the first
token (non-zero while decoding with a cache), or, for packed rows (several sequences in one row, varlen
semantics: zoo.nn.packing.Packing), a (b, l) tensor holding the position of every token within its own
sequence; then the keys of score_bias are those same tokens (s = l, no cache). A static KV cache
(zoo.nn.static_cache) gives an (l,) tensor: the positions of the l tokens, keys at 0..s-1 (its slots); it checked
them against max_len when it was made, so they are not checked again (a check would read the tensor: a device
synchronisation per layer, and a break in a compiled graph). ``injects_order`` is False only for
``NoPositions``: then the model is permutation equivariant.
"""
from __future__ import annotations

import torch
from einops import rearrange, repeat
from torch import nn

from zoo.nn.embedding import embedding_table

__all__ = ["Positions", "sinusoidal_table", "alibi_slopes", "SinusoidalPositions", "LearnedPositions",
           "RotaryPositions", "AlibiPositions", "NoPositions"]


def sinusoidal_table(length: int, d_model: int, *, device=None, dtype=None) -> torch.Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d)) (section 3.5)."""
    position = torch.arange(length, dtype=torch.float64, device=device)
    two_i = torch.arange(0, d_model, 2, dtype=torch.float64, device=device)
    angle = position[:, None] / torch.pow(10000.0, two_i / d_model)[None, :]
    table = torch.empty(length, d_model, dtype=torch.float64, device=device)
    table[:, 0::2] = torch.sin(angle)
    table[:, 1::2] = torch.cos(angle[:, : d_model // 2])
    return table.to(dtype or torch.get_default_dtype())


def position_ids(offset: int | torch.Tensor, l: int, device) -> torch.Tensor:
    """The positions of l tokens: offset, ..., offset + l - 1 as an (l,) tensor, or the (b, l) tensor given."""
    if torch.is_tensor(offset):
        return offset.to(device)
    return torch.arange(offset, offset + l, device=device)


class Positions(nn.Module):
    """The base of every position scheme, and the extension point for a new one: subclass it, override what the
    scheme does (``forward``, ``rotate``, ``score_bias``, described in the module docstring; each default leaves its
    input alone) and name the class in a file under conf/pos/. ``max_len`` is the longest sequence it covers
    (``_check_length`` refuses a position past it); ``injects_order`` says whether it tells the model the order of
    the tokens at all (False only for ``NoPositions``)."""
    injects_order = True

    def __init__(self, max_len: int):
        super().__init__()
        self.max_len = max_len

    def _check_length(self, end: int | torch.Tensor) -> None:
        """end: one past the last position, or the positions themselves (a tensor: packed rows)."""
        if torch.is_tensor(end):
            if end.dim() == 1:  # a static cache's slots, checked when it was made (module docstring)
                return
            end = int(end.max()) + 1 if end.numel() else 0
        if end > self.max_len:
            raise ValueError(f"sequence reaches position {end}, beyond max_len={self.max_len}")

    def forward(self, x: torch.Tensor, offset: int = 0) -> torch.Tensor:
        return x

    def rotate(self, t: torch.Tensor, offset: int = 0) -> torch.Tensor:
        return t

    def score_bias(self, l: int, s: int, offset: int, heads: int) -> torch.Tensor | None:
        return None


class NoPositions(Positions):
    injects_order = False

    def __init__(self, d_model: int = 0, max_len: int = 2**31 - 1, *, device=None, dtype=None):
        super().__init__(max_len)


class SinusoidalPositions(Positions):
    def __init__(self, d_model: int, max_len: int, *, device=None, dtype=None):
        super().__init__(max_len)
        # A fixed function of the position, not a parameter: kept out of the state dict.
        if torch.device(device or "cpu").type == "meta":   # shapes only (a model card, a config's check): no values,
            # and no meta arithmetic, whose first use in a process imports torch's Python meta kernels (over 1 s)
            table = torch.empty(max_len, d_model, device="meta", dtype=dtype or torch.get_default_dtype())
        else:
            table = sinusoidal_table(max_len, d_model, device=device, dtype=dtype)
        self.register_buffer("table", table, persistent=False)

    def _apply(self, fn, recurse=True):
        # module.to(dtype) would cast the stored table, so a float32 model moved to float64 kept a
        # table rounded to float32 (errors ~3e-8). Recompute it from float64 in the new dtype.
        super()._apply(fn, recurse)
        if self.table.device.type != "meta":
            self.table = sinusoidal_table(*self.table.shape, device=self.table.device, dtype=self.table.dtype)
        return self

    def forward(self, x: torch.Tensor, offset: int | torch.Tensor = 0) -> torch.Tensor:
        if not torch.is_tensor(offset):  # a slice of the table: no index tensor to build, no gather
            self._check_length(offset + x.shape[1])
            return x + self.table[offset:offset + x.shape[1]].to(x.dtype)
        self._check_length(offset)
        return x + self.table[offset.to(x.device)].to(x.dtype)


class LearnedPositions(Positions):
    def __init__(self, d_model: int, max_len: int, *, device=None, dtype=None):
        super().__init__(max_len)
        self.embedding = embedding_table(max_len, d_model, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, offset: int | torch.Tensor = 0) -> torch.Tensor:
        position = position_ids(offset, x.shape[1], x.device)
        self._check_length(position if torch.is_tensor(offset) else offset + x.shape[1])
        return x + self.embedding.weight[position]


class RotaryPositions(Positions):
    """RoPE (Su et al. 2021), "rotate-half" layout as in GPT-NeoX and LLaMA: feature pairs (j, j + e/2)
    of every query and key turn by angle pos * base^(-2j/e), so q·k depends only on the offset."""

    def __init__(self, d_model: int, max_len: int, heads: int, base: float = 10000.0, *, device=None, dtype=None):
        super().__init__(max_len)
        head_dim = d_model // heads
        if head_dim % 2:
            raise ValueError(f"rotary positions need an even head size, got d_model/heads = {head_dim}")
        self.head_dim, self.base = head_dim, base

    def rotate(self, t: torch.Tensor, offset: int | torch.Tensor = 0) -> torch.Tensor:
        l, e = t.shape[-2], t.shape[-1]
        position = position_ids(offset, l, t.device)
        self._check_length(position if torch.is_tensor(offset) else offset + l)
        compute = torch.promote_types(t.dtype, torch.float32)  # half-precision angles lose whole radians
        inverse_frequency = self.base ** (-torch.arange(0, e, 2, device=t.device, dtype=compute) / e)
        angle = repeat(position.to(compute)[..., None] * inverse_frequency, "... l j -> ... l (two j)", two=2)
        if position.dim() == 2:  # packed rows: one position per (sample, token), the same for every head
            angle = rearrange(angle, "b l e -> b 1 l e")
        wide = t.to(compute)
        first, second = rearrange(wide, "... (two j) -> two ... j", two=2)
        rotated_half = torch.cat([-second, first], dim=-1)
        return (wide * angle.cos() + rotated_half * angle.sin()).to(t.dtype)


def alibi_slopes(heads: int, *, device=None, dtype=None) -> torch.Tensor:
    """ALiBi's head slopes (Press et al. 2022, section 3): for H a power of two the geometric sequence
    m_h = 2^(-8h/H), h = 1..H; otherwise, as the paper's reference code and BLOOM do, the H' = 2^floor(log2 H)
    slopes of H' heads followed by every other slope of 2H' heads (the odd ones, 2^(-4(2k-1)/H')), first
    H - H' of them."""
    if heads < 1:
        raise ValueError(f"heads={heads}: ALiBi needs at least one head")

    def geometric(n: int) -> list[float]:
        return [2.0 ** (-8.0 * h / n) for h in range(1, n + 1)]

    closest = 2 ** (heads.bit_length() - 1)
    slopes = geometric(closest) + geometric(2 * closest)[0::2][: heads - closest]
    return torch.tensor(slopes, dtype=torch.float64, device=device).to(dtype or torch.get_default_dtype())


class AlibiPositions(Positions):
    """ALiBi (Press et al. 2022): no position codes; each self-attention score gets the bias -m_h·|i - j|, head h's
    slope m_h (``alibi_slopes``) times the distance between the absolute positions of query i and key j.

    The paper's decoder bias is -m_h·(i - j) for the keys j <= i it can see; the absolute distance is the same
    there and is what flash-attn's ``alibi_slopes`` add (zoo/nn/flash.py), and it makes an encoder's bias
    symmetric. Positions count the cache offset (a cached query at offset + i) and padding alike: the bias
    depends only on i - j, so prepended padding leaves it unchanged, as with rotary positions."""

    def __init__(self, d_model: int, max_len: int, heads: int, *, device=None, dtype=None):
        super().__init__(max_len)
        # A fixed function of the head count, not a parameter: kept out of the state dict.
        if torch.device(device or "cpu").type == "meta":  # shapes only: no values to compute (heads may be huge)
            slopes = torch.empty(heads, device="meta", dtype=dtype or torch.get_default_dtype())
        else:
            slopes = alibi_slopes(heads, device=device, dtype=dtype)
        self.register_buffer("slopes", slopes, persistent=False)

    def _apply(self, fn, recurse=True):
        # As for the sinusoidal table: recompute in the new dtype from float64 rather than round the old values.
        super()._apply(fn, recurse)
        if self.slopes.device.type != "meta":
            self.slopes = alibi_slopes(self.slopes.numel(), device=self.slopes.device, dtype=self.slopes.dtype)
        return self

    def score_bias(self, l: int, s: int, offset: int | torch.Tensor, heads: int) -> torch.Tensor:
        """(h, l, s), or (b, h, l, s) for packed rows (offset a (b, l) tensor of positions, keys the same tokens);
        offset an (l,) tensor: the queries' positions in a static cache, keys its slots 0..s-1."""
        if heads != self.slopes.numel():
            raise ValueError(f"ALiBi was built for {self.slopes.numel()} heads, asked for {heads}")
        query = position_ids(offset, l, self.slopes.device)
        packed = torch.is_tensor(offset) and offset.dim() == 2
        key = query if packed else torch.arange(s, device=self.slopes.device)
        self._check_length(query if torch.is_tensor(offset) else max(offset + l, s))
        distance = (query[..., :, None] - key[..., None, :]).abs().to(self.slopes.dtype)
        if distance.dim() == 3:
            distance = rearrange(distance, "b l s -> b 1 l s")
        return -rearrange(self.slopes, "h -> h 1 1") * distance
