"""Drawn problems of the varlen and KV-cache APIs, and their oracles (per sequence / per batch entry).

Both reuse ``FlashCase`` (kernel/flash.py) for the keywords, the head layout, the dtype and the seed; the oracle of
each sequence or entry is ``flash_bounds`` on its own keys, so the varlen and cache clauses are exactly "the
``flash`` semantics on each part" (SPEC.md, "The FlashAttention API").
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from hypothesis import strategies as st

from properties.kernel.flash import FlashBounds, FlashCase, flash_bounds, flash_cases, window_keys, windows
from properties.core.strategies import derived_generator, on, require_dtype

__all__ = ["VarlenCase", "varlen_cases", "CacheCase", "cache_cases", "CacheProblem", "STALE_KEY", "STALE_VALUE"]

_F64 = torch.float64
STALE_KEY, STALE_VALUE = 4.0, 1000.0   # stale cache slots: keys 4·N(0, 1), values 1000·N(0, 1) (finite in fp16)


def _cu(lengths) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


# --------------------------------------------------------------------------------------------------- varlen
@dataclass(frozen=True)
class VarlenCase:
    """A packed batch: sequence b has lens_q[b] queries and lens_k[b] keys; ``flash`` holds the keywords
    (its b is the number of sequences; its lq, lk the largest lengths)."""

    lens_q: tuple[int, ...]
    lens_k: tuple[int, ...]
    flash: FlashCase

    def __repr__(self) -> str:
        return f"VarlenCase(lens_q={self.lens_q}, lens_k={self.lens_k}, {self.flash!r})"

    @property
    def cu_q(self) -> list[int]:
        return _cu(self.lens_q)

    @property
    def cu_k(self) -> list[int]:
        return _cu(self.lens_k)

    def without(self, features) -> "VarlenCase":
        return replace(self, flash=self.flash.without(features))

    def tensors64(self, stream: int = 0):
        f = self.flash
        g = derived_generator(f.seed, stream)
        q = torch.randn(sum(self.lens_q), f.heads, f.d, generator=g, dtype=_F64) * 2.0**f.spread
        k = torch.randn(sum(self.lens_k), f.kv_heads, f.d, generator=g, dtype=_F64)
        v = torch.randn(sum(self.lens_k), f.kv_heads, f.d, generator=g, dtype=_F64)
        return q, k, v

    def place(self, t: torch.Tensor, device) -> torch.Tensor:
        if self.flash.strided:   # (H, total, D) storage seen as (total, H, D): last dim still contiguous
            return on(t.transpose(0, 1).contiguous(), self.flash.dtype, device).transpose(0, 1)
        return on(t, self.flash.dtype, device)

    def tensors(self, device, stream: int = 0):
        """q, k, v, the slopes and the varlen positional arguments (cu_seqlens_q, cu_seqlens_k, max_q, max_k)."""
        require_dtype(str(device), self.flash.dtype)
        q, k, v = (self.place(t, device) for t in self.tensors64(stream))
        slopes = self.flash.slopes64()
        slopes = None if slopes is None else slopes.to(torch.float32).to(device)
        args = (torch.tensor(self.cu_q, dtype=torch.int32, device=device),
                torch.tensor(self.cu_k, dtype=torch.int32, device=device), max(self.lens_q), max(self.lens_k))
        return q, k, v, slopes, args

    def sequence_bounds(self, q, k, v, slopes, index: int) -> FlashBounds:
        """The oracle of sequence ``index`` alone (``flash`` on its slices, ALiBi row ``index``)."""
        (q0, q1), (k0, k1) = self.cu_q[index:index + 2], self.cu_k[index:index + 2]
        row = slopes if slopes is None or slopes.dim() == 1 else slopes[index]
        return flash_bounds(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], **self.flash.oracle_kwargs(row))


@st.composite
def varlen_cases(draw, *, max_seqs: int = 4, max_len: int = 6, **flash_options) -> VarlenCase:
    n = draw(st.integers(1, max_seqs))
    lens_q = tuple(draw(st.integers(0, max_len)) for _ in range(n))
    lens_k = tuple(draw(st.integers(0, max_len)) for _ in range(n))
    if sum(lens_q) == 0:
        lens_q = (1,) + lens_q[1:]
    lk = window_keys(lens_k)
    base = draw(flash_cases(max_b=1, min_lk=lk, max_lk=lk, **flash_options))
    return VarlenCase(lens_q, lens_k, replace(base, b=n, lq=max(lens_q), lk=max(lens_k)))


# -------------------------------------------------------------------------------------------------- kvcache
@dataclass(frozen=True)
class CacheCase:
    """A decoding call: entries 0 … B−1 with ``flash.lq`` queries each, a cache of ``l_cache`` positions per row,
    per-entry ``seqlens`` (``seqlens_as``: tensor, int or none = the whole cache) and ``leftpad``, ``lnew`` appended
    keys, a paged layout (``block_size`` > 0) or cache rows picked by ``batch_idx`` (``extra_rows`` unused rows)."""

    flash: FlashCase
    l_cache: int
    seqlens: tuple[int, ...]
    lnew: int = 0
    seqlens_as: str = "tensor"
    leftpad: tuple[int, ...] | None = None
    block_size: int = 0
    batch_idx: bool = False
    extra_rows: int = 0

    def __repr__(self) -> str:
        parts = [f"l_cache={self.l_cache}", f"seqlens={self.seqlens}"]
        for name, default in (("lnew", 0), ("seqlens_as", "tensor"), ("leftpad", None), ("block_size", 0),
                              ("batch_idx", False), ("extra_rows", 0)):
            if getattr(self, name) != default:
                parts.append(f"{name}={getattr(self, name)!r}")
        return f"CacheCase({', '.join(parts)}, {self.flash!r})"

    @property
    def features(self) -> set[str]:
        used = set(self.flash.features)
        if self.lnew:
            used.add("append")
        if self.block_size:
            used.add("paged")
        if self.batch_idx:
            used.add("batch_idx")
        if self.leftpad is not None:
            used.add("leftpad")
        return used

    def without(self, features) -> "CacheCase":
        case = replace(self, flash=self.flash.without(features))
        if "append" in features:
            case = replace(case, lnew=0)
        if "paged" in features:
            case = replace(case, block_size=0)
        if "batch_idx" in features:
            case = replace(case, batch_idx=False, extra_rows=0)
        if "leftpad" in features:
            case = replace(case, leftpad=None)
        return case

    def contiguous(self) -> "CacheCase":
        return replace(self, block_size=0)

    def problem(self, device) -> "CacheProblem":
        return CacheProblem.build(self, device)


@dataclass
class CacheProblem:
    """The tensors of a ``CacheCase`` and the expectations: ``call()`` runs the kernel on fresh cache copies."""

    case: CacheCase
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k_new: torch.Tensor | None
    v_new: torch.Tensor | None
    slopes: torch.Tensor | None
    kwargs: dict                      # every keyword of the call except k and v
    rows: list[int]                   # cache row (or -1 for paged) of each entry
    table: torch.Tensor | None        # (B, max_blocks) block table
    logical_k: torch.Tensor           # (B, l_cache, Hkv, D) float64: each entry's cache row before the call
    logical_v: torch.Tensor

    @classmethod
    def build(cls, case: CacheCase, device) -> "CacheProblem":
        f = case.flash
        require_dtype(str(device), f.dtype)
        g = derived_generator(f.seed, 11)
        b, hkv, d = f.b, f.kv_heads, f.d
        q = torch.randn(b, f.lq, f.heads, d, generator=g, dtype=_F64) * 2.0**f.spread
        real_k = torch.randn(b, case.l_cache, hkv, d, generator=g, dtype=_F64)
        real_v = torch.randn(b, case.l_cache, hkv, d, generator=g, dtype=_F64)
        stale_k = STALE_KEY * torch.randn(b, case.l_cache, hkv, d, generator=g, dtype=_F64)
        stale_v = STALE_VALUE * torch.randn(b, case.l_cache, hkv, d, generator=g, dtype=_F64)
        position = torch.arange(case.l_cache)
        leftpad = case.leftpad or (0,) * b
        real = torch.stack([(position >= leftpad[i]) & (position < case.seqlens[i]) for i in range(b)])
        logical_k = torch.where(real[..., None, None], real_k, stale_k)
        logical_v = torch.where(real[..., None, None], real_v, stale_v)
        k_new = v_new = None
        if case.lnew:
            k_new = torch.randn(b, case.lnew, hkv, d, generator=g, dtype=_F64)
            v_new = torch.randn(b, case.lnew, hkv, d, generator=g, dtype=_F64)
        rows, table = list(range(b)), None
        if case.block_size:
            blocks_per_row = case.l_cache // case.block_size
            pool = b * blocks_per_row + 2                      # two blocks no entry uses
            table = torch.randperm(pool, generator=g)[:b * blocks_per_row].reshape(b, blocks_per_row)
            k_cache = STALE_KEY * torch.randn(pool, case.block_size, hkv, d, generator=g, dtype=_F64)
            v_cache = STALE_VALUE * torch.randn(pool, case.block_size, hkv, d, generator=g, dtype=_F64)
            k_cache[table.reshape(-1)] = logical_k.reshape(-1, case.block_size, hkv, d)
            v_cache[table.reshape(-1)] = logical_v.reshape(-1, case.block_size, hkv, d)
            rows = [-1] * b
        else:
            n_rows = b + case.extra_rows
            if case.batch_idx:
                rows = torch.randperm(n_rows, generator=g)[:b].tolist()
            k_cache = STALE_KEY * torch.randn(n_rows, case.l_cache, hkv, d, generator=g, dtype=_F64)
            v_cache = STALE_VALUE * torch.randn(n_rows, case.l_cache, hkv, d, generator=g, dtype=_F64)
            k_cache[rows] = logical_k
            v_cache[rows] = logical_v
        slopes = f.slopes64()
        slopes = None if slopes is None else slopes.to(torch.float32).to(device)
        put = lambda t: None if t is None else on(t, f.dtype, device)  # noqa: E731
        kwargs = f.kwargs(slopes)
        if case.seqlens_as == "tensor":
            kwargs["cache_seqlens"] = torch.tensor(case.seqlens, dtype=torch.int32, device=device)
        elif case.seqlens_as == "int":
            kwargs["cache_seqlens"] = case.seqlens[0]
        if case.leftpad is not None:
            kwargs["cache_leftpad"] = torch.tensor(case.leftpad, dtype=torch.int32, device=device)
        if case.batch_idx:
            kwargs["cache_batch_idx"] = torch.tensor(rows, dtype=torch.int32, device=device)
        if table is not None:
            kwargs["block_table"] = table.to(torch.int32).to(device)
        # Every tensor is rounded to the dtype once; the logical rows are read back from the rounded cache.
        q, k_cache, v_cache, k_new, v_new = (put(t) for t in (q, k_cache, v_cache, k_new, v_new))
        q = f.place(q.to(_F64), device) if f.strided else q
        problem = cls(case, q, k_cache, v_cache, k_new, v_new, slopes, kwargs, rows, table, logical_k, logical_v)
        problem.logical_k, problem.logical_v = problem.read_rows(k_cache), problem.read_rows(v_cache)
        return problem

    def read_rows(self, cache: torch.Tensor) -> torch.Tensor:
        """(B, l_cache, Hkv, D) float64: each entry's logical row of ``cache`` (through the table if paged)."""
        c = cache.detach().to("cpu", _F64)
        if self.table is not None:
            return c[self.table].reshape(self.table.shape[0], -1, *c.shape[2:])
        return c[self.rows]

    def expected_cache(self, name: str) -> torch.Tensor:
        """The whole cache ``name`` ('k' or 'v') as the call must leave it (float64, CPU)."""
        cache = (self.k_cache if name == "k" else self.v_cache).detach().to("cpu", _F64).clone()
        new = self.k_new if name == "k" else self.v_new
        if new is None:
            return cache
        new = new.detach().to("cpu", _F64)
        bs = self.case.block_size
        for i in range(self.case.flash.b):
            for t in range(self.case.lnew):
                p = self.case.seqlens[i] + t
                if self.table is not None:
                    cache[int(self.table[i, p // bs]), p % bs] = new[i, t]
                else:
                    cache[self.rows[i], p] = new[i, t]
        return cache

    def keys_of(self, index: int):
        """(k, v) (1, n, Hkv, D) float64 that entry ``index`` attends: its row [leftpad, seqlen) then the new keys."""
        start = 0 if self.case.leftpad is None else self.case.leftpad[index]
        end = self.case.seqlens[index]
        k, v = self.logical_k[index, start:end], self.logical_v[index, start:end]
        if self.k_new is not None:
            k = torch.cat([k, self.k_new[index].detach().to("cpu", _F64)])
            v = torch.cat([v, self.v_new[index].detach().to("cpu", _F64)])
        return k[None], v[None]

    def entry_bounds(self, index: int) -> FlashBounds:
        k, v = self.keys_of(index)
        slopes = self.slopes
        row = slopes if slopes is None or slopes.dim() == 1 else slopes[index]
        return flash_bounds(self.q[index:index + 1], k.to(self.case.flash.dtype), v.to(self.case.flash.dtype),
                            **self.case.flash.oracle_kwargs(row))

    def call(self, kernel):
        """The kernel on fresh copies of the caches: (out, k_cache after, v_cache after)."""
        k_cache, v_cache = self.k_cache.clone(), self.v_cache.clone()
        extra = {} if self.k_new is None else {"k": self.k_new, "v": self.v_new}
        out = kernel(self.q, k_cache, v_cache, **extra, **self.kwargs)
        return out, k_cache, v_cache


@st.composite
def cache_cases(draw, *, paged=None, batch_idx=None, leftpad=None, append=None, seqlens_as=None,
                **flash_options) -> CacheCase:
    """KV-cache problems; ``paged``, ``batch_idx``, ``leftpad``, ``append`` (bools) and ``seqlens_as`` fix a
    choice, None draws it (paged and batch_idx never together: flash-attn declines that combination)."""
    b = draw(st.integers(1, 3))
    lnew = draw(st.integers(1, 3)) if (append if append is not None else draw(st.booleans())) else 0
    is_paged = draw(st.booleans()) if paged is None else paged
    block_size = draw(st.integers(1, 4)) if is_paged else 0
    use_idx = (draw(st.booleans()) if batch_idx is None else batch_idx) and not is_paged
    how = draw(st.sampled_from(["tensor", "tensor", "int", "none"])) if seqlens_as is None else seqlens_as
    if how == "none":
        lnew = 0
    min_cache = 1 + lnew
    if block_size:
        l_cache = block_size * draw(st.integers(-(-min_cache // block_size), max(-(-8 // block_size), 1)))
    else:
        l_cache = draw(st.integers(min_cache, 8))
    if how == "none":
        seqlens = (l_cache,) * b
    elif how == "int":
        seqlens = (draw(st.integers(0, l_cache - lnew)),) * b
    else:
        seqlens = tuple(draw(st.integers(0, l_cache - lnew)) for _ in range(b))
    pads = None
    if how != "none" and (leftpad if leftpad is not None else draw(st.booleans())):
        pads = tuple(draw(st.integers(0, s)) for s in seqlens)
    lengths = [s + lnew - (pads[i] if pads else 0) for i, s in enumerate(seqlens)]
    base = draw(flash_cases(max_b=1, max_lq=4, max_lk=max(max(lengths), 1), window=False, **flash_options))
    the_window = draw(windows(window_keys(lengths))) if draw(st.booleans()) else (-1, -1)
    flash = replace(base, b=b, lk=max(lengths), window=the_window, strided=base.strided)
    return CacheCase(flash, l_cache, seqlens, lnew, how, pads, block_size, use_idx,
                     draw(st.integers(1, 2)) if use_idx else 0)
