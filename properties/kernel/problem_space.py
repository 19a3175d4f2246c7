"""The problem space of an attention kernel: the classes a kernel specialises on, each with the few values that
matter (SPEC.md, "Problems at kernel scale, kernels with limits, coverage").

A fused kernel picks code paths by the problem's classes — how long the rows are against its tiles, the head size
against its register blocks, the dtype, whether it is causal or masked, grouped heads, the strides — and its bugs
live where two such choices meet. The factors, and their classes:

========  ============================================================================================================
factor    classes (values inside a class)
========  ============================================================================================================
L, S      ``one`` (1), ``short`` (2 … 47: below a tile), ``tile`` (63, 64, 65, 127, 128, 129: a tile ± 1), ``past256``
          (258 … 513: positions past 256, bfloat16's last exact integer), ``long`` (1023, 1024, 1025)
order     L ``<`` S, L ``=`` S, L ``>`` S; covered against the *scale*, the class of the longer of L and S, so that all
          three orders appear at every scale (L > S at tile scale: L in ``tile``, S shorter)
E, Ev     ``odd`` (1, 3, 5, 7, 9, 15, 33), ``8k`` (8 … 192, multiples of 8), ``64``, ``128``, ``256``
dtype     the run's dtypes (``--dtype``)
rank      0, 1 or 2 leading (batch, head) dims
group     query heads per key/value head: 1, 2, 4 (enable_gqa)
attend    ``none``, ``causal``, ``bool``, ``float``, ``bool-empty`` / ``float-empty`` (rows that admit no key),
          ``bool-tiles`` (whole aligned 64- or 128-key tiles masked in random rows)
values    ``gaussian`` (zero mean), ``positive`` (values on [0, 1)), ``shifted`` (values and upstream gradient of mean
          ≫ spread), ``peaked`` (one key far above the rest), ``negative`` (every score of a row very negative)
layout    ``contiguous``, ``transposed`` ((B, L, H, E) storage), ``expanded`` (stride 0), ``sliced`` (a view of a
          larger buffer)
history   what changes between two calls of ATTN-HISTORY: ``s``, ``l``, ``lead``, ``attend``, ``dtype``, ``group``,
          ``in-place`` (the same storage with new contents)
========  ============================================================================================================

Each clause declares the factors it poses and, for each, the classes it can pose (a ``Space``); the schedule
(properties/kernel/schedule.py) covers every pair of them at the default profile, every triple under ``thorough``.
A ``Problem`` is one point of a space: a ``Case`` (shapes, dtype, seed) that also carries its classes, so that a
counterexample names them.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from hypothesis import strategies as st

from properties.core.strategies import derived_generator, on, random_bool_mask, require_dtype
from properties.kernel.cases import Case
from properties.kernel.limits import Limits, nearest_size
from properties.kernel.magnitudes import Scores, covered_tiles

__all__ = ["SHAPES", "SPREAD", "MAGNITUDE", "MEAN", "DENSITY", "COVER", "VALUE_EXTRAS", "MASK_EXTRAS", "LENGTHS", "HEAD_SIZES", "RANKS", "GROUPS", "ATTENDS", "VALUES", "LAYOUTS", "HISTORIES", "FACTORS",
           "Extra", "Space", "Problem", "Context", "BUDGET", "LONG_BUDGET", "cost", "scale_of", "square_of",
           "SQUARE_CLASSES"]

# ------------------------------------------------------------------------------------------------ the classes
LENGTHS: dict[str, tuple[int, ...]] = {
    "one": (1,),
    "short": (2, 3, 4, 5, 7, 8, 13, 16, 17, 31, 33, 47),
    "tile": (63, 64, 65, 127, 128, 129),
    "past256": (258, 300, 383, 449, 511, 513),   # every one holds a position past 256 (257 rounds to 256 in bf16)
    "long": (1023, 1024, 1025),
}
HEAD_SIZES: dict[str, tuple[int, ...]] = {
    "odd": (1, 3, 5, 7, 9, 15, 33),
    "8k": (8, 16, 24, 32, 48, 80, 96, 192),
    "64": (64,),
    "128": (128,),
    "256": (256,),
}
RANKS = ("2", "1", "0")
RANK_SIZES = {"0": ((),), "1": ((1,), (2,), (3,)), "2": ((1, 1), (2, 3), (3, 2), (1, 2), (2, 1))}
GROUPS = ("1", "2", "4")
ATTENDS = ("none", "causal", "bool", "float", "bool-empty", "float-empty", "bool-tiles")
VALUES = ("gaussian", "positive", "shifted", "peaked", "negative")
LAYOUTS = ("contiguous", "transposed", "expanded", "sliced")
HISTORIES = ("in-place", "s", "l", "lead", "attend", "dtype", "group")
DTYPE_NAMES = {torch.float32: "float32", torch.float64: "float64", torch.bfloat16: "bfloat16",
               torch.float16: "float16"}
DTYPES_BY_NAME = {name: dtype for dtype, name in DTYPE_NAMES.items()}
DTYPE_ORDER = ("float32", "float64", "bfloat16", "float16")   # cheapest first on a CPU
FACTORS: dict[str, tuple[str, ...]] = {
    "L": tuple(LENGTHS), "S": tuple(LENGTHS), "order": ("=", "<", ">"), "E": ("odd", "8k", "64", "128", "256"),
    "Ev": ("odd", "8k", "64", "128", "256"), "dtype": DTYPE_ORDER, "rank": RANKS, "group": GROUPS,
    "attend": ATTENDS, "values": VALUES, "layout": LAYOUTS, "history": HISTORIES,
}
_LENGTH_RANK = {c: i for i, c in enumerate(LENGTHS)}

# Multiply-adds a problem may cost at the default profile on a CPU: heads·L·S·(E + Ev + 32) (+ heads·L·S·S where the
# weights are read through V = I); 4x under ``thorough``, 4x on CUDA. The clauses where long rows catch what shorter
# ones cannot (the oracle, causality, masks, gradients: ``Space(long_rows=True)``) have LONG_BUDGET, which holds
# L = S = 1024; the others hold one long sequence beside a short one, or two past 256.
BUDGET = 2 ** 22
LONG_BUDGET = 2 ** 26


def cost(l: int, s: int, e: int, ev: int, heads: int = 1, weights: bool = False) -> int:
    """What a problem costs the kernel and the float64 oracle: the products and the O(L·S) bound."""
    return heads * l * s * (e + ev + 32 + (s if weights else 0))


def scale_of(row: dict) -> str | None:
    """The class of the longer of L and S (a derived attribute of a row)."""
    if "L" not in row or "S" not in row:
        return None
    return max(row["L"], row["S"], key=_LENGTH_RANK.__getitem__)


def square_of(row: dict) -> str | None:
    """The class of L = S (self-attention: one sequence), "-" for L != S (a derived attribute of a row)."""
    if "L" not in row or "S" not in row or "order" not in row:
        return None
    return row["L"] if row["order"] == "=" else "-"


# Self-attention (L = S, one sequence) at every scale but the longest, against every other class: positions past 256
# exist in both the queries and the keys only there (a causal mask built from positions rounded in bfloat16).
SQUARE_CLASSES = ("one", "short", "tile", "past256")


# ------------------------------------------------------------------------------------------------ a clause's space
@dataclass(frozen=True)
class Extra:
    """A parameter drawn inside every row (not a covering factor): ``values`` for the covering rows (the first is the
    simplest, the one a failing row shrinks to), ``strategy`` for the rows Hypothesis draws."""
    values: tuple
    strategy: Any

    def __hash__(self):
        return hash(self.values)


@dataclass(frozen=True)
class Space:
    """The factors a clause poses, with the classes it can pose of each, and its drawn extras.

    ``weights``: the clause reads the weights through V = I (its cost grows as L·S·S). ``axes``: leading dims the
    clause adds itself (a head axis, a stack of copies). ``requires``: predicates on a (partial) row, for what the
    clause cannot pose (each returns True while it lacks the factors it reads)."""

    name: str
    factors: tuple[tuple[str, tuple[str, ...]], ...]
    extras: tuple[tuple[str, Extra], ...] = ()
    weights: bool = False
    axes: int = 0
    requires: tuple[Callable[[dict], bool], ...] = ()
    fixed: tuple[tuple[str, Any], ...] = ()   # features every problem of the clause has (is_causal, ...)
    long_rows: bool = False                   # LONG_BUDGET instead of BUDGET
    lengths: tuple[tuple[str, tuple[int, ...]], ...] = ()   # a class's values where the clause needs fewer
    calls: int = 1                            # what one problem costs, in forward calls (a backward: 4)
    shrink: bool = True                       # a failing covering row is shrunk (not where calls before matter)

    @staticmethod
    def of(name: str, *, extras: dict | None = None, weights: bool = False, axes: int = 0,
           requires: tuple = (), fixed: dict | None = None, long_rows: bool = False, lengths: dict | None = None,
           calls: int = 1, shrink: bool = True, **factors) -> "Space":
        """``factors``: factor -> the classes posed (``True``: all of them), in FACTORS' order."""
        chosen = []
        for factor, classes in FACTORS.items():
            given = factors.pop(factor, None)
            if given is None:
                continue
            if given is True:
                given = classes
            unknown = [c for c in given if c not in classes]
            if unknown:
                raise ValueError(f"{name}: {factor} has no class {unknown}")
            chosen.append((factor, tuple(c for c in classes if c in given)))
        if factors:
            raise ValueError(f"{name}: no factor {sorted(factors)}")
        return Space(name, tuple(chosen), tuple((extras or {}).items()), weights, axes, tuple(requires),
                     tuple((fixed or {}).items()), long_rows, tuple((lengths or {}).items()), calls, shrink)

    @functools.cached_property
    def _factor_classes(self) -> dict:
        return dict(self.factors)

    def classes(self, factor: str) -> tuple[str, ...]:
        return self._factor_classes.get(factor, ())

    def has(self, factor: str) -> bool:
        return factor in self._factor_classes

    def extra(self, name: str) -> Extra:
        return dict(self.extras)[name]


# The factors of a problem's shapes and dtype, posed by almost every clause.
SHAPES = dict(L=True, S=True, order=True, E=True, Ev=True, dtype=True, rank=True)
# Drawn inside every row of the clauses that use them (the first value is what a failing row shrinks to).
SPREAD = Extra((0, -8, -4, 2, 4), st.integers(-8, 4))                  # queries scaled by 2^spread
MAGNITUDE = Extra((0.5, 0.0, 1.0, 0.25, 0.75), st.floats(0.0, 1.0))    # a score profile's share of the dtype's range
MEAN = Extra((0, 2, 4, 1, 3), st.integers(0, 4))                       # shifted values: mean 2^k, spread 1/4
DENSITY = Extra((0.5, 0.2, 0.8, 0.05, 0.95), st.floats(0.0, 1.0))      # a mask's share of admissible keys
COVER = Extra((64, 128), st.sampled_from((64, 128)))                   # the tile of masked tiles
VALUE_EXTRAS = {"spread": SPREAD, "magnitude": MAGNITUDE, "mean_exponent": MEAN}
MASK_EXTRAS = {"density": DENSITY, "cover": COVER}


# ------------------------------------------------------------------------------------------------- a problem
@dataclass(frozen=True)
class Problem(Case):
    """A point of a clause's space: the shapes, dtype and seed of a ``Case``, and the classes and extras that made
    it. ``lead`` is the query's; with ``group`` > 1 the head axis (the last leading dim) of key and value is
    ``lead[-1] // group``."""

    classes: tuple = ()            # ((factor, class), ...)
    attend: str = "none"
    values: str = "gaussian"
    group: int = 1
    layout: str = "contiguous"
    history: str = ""
    extras: tuple = ()             # ((name, value), ...)
    row: int | None = field(default=None, compare=False)   # its covering row, None for a drawn one

    def __repr__(self) -> str:
        parts = []
        classes = dict(self.classes)
        shown = {"L": self.l, "S": self.s, "E": self.e, "Ev": self.ev}
        for factor, cls in self.classes:
            if factor in shown:
                value = shown[factor]
                parts.append(f"{factor}={cls}:{value}" if cls != str(value) else f"{factor}={value}")
            elif factor == "rank":
                parts.append(f"lead={self.lead}")
            elif factor == "dtype":
                parts.append(f"dtype={cls}")
            else:
                parts.append(f"{factor}={cls}")
        for name, value in (("L", self.l), ("S", self.s), ("E", self.e), ("Ev", self.ev)):
            if name not in classes:
                parts.append(f"{name}={value}")
        if "rank" not in classes:
            parts.append(f"lead={self.lead}")
        if "dtype" not in classes:
            parts.append(f"dtype={DTYPE_NAMES.get(self.dtype, self.dtype)}")
        parts += [f"{name}={value!r}" for name, value in self.extras if self.uses(name)]
        parts.append(f"seed={self.seed}")
        where = f"row {self.row}: " if self.row is not None else ""
        return f"Problem({where}{', '.join(parts)})"

    def _repr_pretty_(self, printer, cycle) -> None:
        printer.text(repr(self))

    def __getattr__(self, name: str):
        # the extras, by name (dataclass fields are found before this is called)
        if name.startswith("__"):
            raise AttributeError(name)
        for key, value in object.__getattribute__(self, "extras"):
            if key == name:
                return value
        raise AttributeError(f"{type(self).__name__} has no attribute or extra {name!r}")

    def uses(self, extra: str) -> bool:
        """Whether an extra matters to this problem (the spread of gaussian scores, the magnitude of a score
        profile, the mean of shifted values, the density of a mask, the tile of masked tiles; a clause's own)."""
        relevant = {"spread": self.values in ("gaussian", "positive"), "magnitude": self.values in ("peaked", "negative"),
                    "mean_exponent": self.values == "shifted", "density": self.attend not in ("none", "causal"),
                    "cover": self.attend == "bool-tiles"}
        return relevant.get(extra, True)

    def cls(self, factor: str) -> str | None:
        return dict(self.classes).get(factor)

    @property
    def kv_lead(self) -> tuple[int, ...]:
        if self.group > 1 and self.lead:
            return (*self.lead[:-1], self.lead[-1] // self.group)
        return self.lead

    @property
    def case(self) -> Case:
        """The plain ``Case`` of this problem (shapes, dtype, seed)."""
        return Case(self.lead, self.l, self.s, self.e, self.ev, self.dtype, self.seed, self.axes)

    # ------------------------------------------------------------------------------------------- tensors
    def qkv64(self, stream: int = 0):
        """Query, key and value in float64 (CPU), before rounding, with the values class applied: ``gaussian``
        (queries scaled by 2^spread when the space draws a spread), ``positive`` values on [0, 1), ``shifted``
        values of mean ≫ spread, ``peaked`` and ``negative`` score profiles (properties/kernel/magnitudes.py)."""
        g = self.generator(stream)
        q = _gaussian(g, *self.lead, self.l, self.e)
        k = _gaussian(g, *self.kv_lead, self.s, self.e)
        v = _gaussian(g, *self.kv_lead, self.s, self.ev)
        spread = dict(self.extras).get("spread", 0)
        if spread and self.values in ("gaussian", "positive"):
            q = q * 2.0 ** spread
        if self.values == "positive":
            v = torch.rand(v.shape, generator=self.generator(stream + 101), dtype=torch.float64)
        elif self.values == "shifted":
            v = self.shift_of_mean() + 0.25 * v
        elif self.values in ("peaked", "negative"):
            scores = Scores(self.values, float(dict(self.extras).get("magnitude", 0.5)))
            if self.group > 1:   # the profile is made per query head: each key/value head keeps its group's first
                wide = k.repeat_interleave(self.group, dim=-3)
                q, wide = scores.apply(q, wide, 1 / math.sqrt(self.e), self.dtype, self.generator(stream + 3))
                k = wide[..., ::self.group, :, :]
            else:
                q, k = scores.apply(q, k, 1 / math.sqrt(self.e), self.dtype, self.generator(stream + 3))
        return q, k, v

    def shift_of_mean(self) -> float:
        """The mean of ``shifted`` values and upstream gradients (the spread is 1/4)."""
        return float(2 ** dict(self.extras).get("mean_exponent", 0))

    def qkv(self, device, stream: int = 0):
        require_dtype(str(device), self.dtype)
        return tuple(on(t, self.dtype, device) for t in self.qkv64(stream))

    def upstream64(self, stream: int = 5) -> torch.Tensor:
        """The upstream gradient dO (lead, L, Ev) in float64: gaussian, or shifted as the values are."""
        do = _gaussian(self.generator(stream), *self.lead, self.l, self.ev)
        return self.shift_of_mean() + 0.25 * do if self.values == "shifted" else do

    def mask64(self, shape=None, stream: int = 1) -> torch.Tensor | None:
        """The attend class's mask over ``shape`` (default: the query's lead, L, S), as a bool mask (True = may
        attend; the float kinds are made from it by ``contract``), or None (none, causal)."""
        if self.attend in ("none", "causal"):
            return None
        shape = tuple(shape) if shape is not None else (*self.lead, self.l, self.s)
        g = self.generator(stream)
        density = float(dict(self.extras).get("density", 0.5))
        mask = random_bool_mask(g, shape, density)          # every query keeps a key ...
        if self.attend == "bool-tiles":
            tile = int(dict(self.extras).get("cover", 64))
            covered = covered_tiles(shape, tile, derived_generator(self.seed, stream + 3))
            if shape[-1] >= tile:   # the first tile masked for query 0 and kept for query 1: a tile some rows skip
                covered[..., 0, :tile] = True
                if shape[-2] > 1:
                    covered[..., 1, :tile] = False
            mask = mask & ~covered
            mask[..., -1] |= ~mask.any(-1)
        if self.attend.endswith("-empty"):                  # ... except some that keep none
            empty = torch.rand(shape[:-1], generator=g, dtype=torch.float64) < 0.5
            empty[..., 0] = True
            mask = mask & ~empty[..., None]
        return mask

    def contract(self, device, shape=None) -> dict:
        """The keyword arguments of this problem: its attn_mask or is_causal, and enable_gqa where heads are
        grouped. A float mask is −∞ where the bool mask is False plus N(0, 1) noise elsewhere (``float``) or exact
        zeros there (``float-empty``: a row of −∞ and nothing else)."""
        kw: dict = {}
        if self.attend == "causal":
            kw["is_causal"] = True
        mask = self.mask64(shape)
        if mask is not None:
            if self.attend.startswith("float"):
                noise = 0.0 if self.attend == "float-empty" else torch.randn(
                    mask.shape, generator=self.generator(2), dtype=torch.float64)
                kw["attn_mask"] = on(torch.where(mask, 0.0, float("-inf")) + noise, self.dtype, device)
            else:
                kw["attn_mask"] = mask.to(device)
        if self.group > 1:
            kw["enable_gqa"] = True
        return kw


def _gaussian(generator: torch.Generator, *shape: int) -> torch.Tensor:
    """Standard normal draws in float64, drawn in float32 (a third of the time of float64 draws, which matters for
    the long rows; the values are exact in float64 whatever the tested dtype rounds them to)."""
    return torch.randn(*shape, generator=generator, dtype=torch.float32).to(torch.float64)


# ------------------------------------------------------------------------------------------------- constraints
@dataclass(frozen=True)
class Context:
    """What a space is scheduled against: the kernel's limits on its device, the run's dtypes, the budget and the
    strength (2: pairs; 3: triples; 1: every class once)."""

    limits: Limits
    dtypes: tuple[str, ...]
    budget: int
    strength: int

    def key(self) -> tuple:
        return (repr(self.limits), self.dtypes, self.budget, self.strength)


def _reason(limits: Limits, key: str, declared: str) -> str:
    """The kernel's own words for a limit it showed at start-up, else the declared limit."""
    return limits.reasons.get(key) or f"outside the declared limits: {declared}"


def lengths_of(cls: str, limits: Limits, space: "Space | None" = None) -> tuple[int, ...]:
    values = dict(space.lengths).get(cls, LENGTHS[cls]) if space is not None else LENGTHS[cls]
    return _lengths(tuple(values), limits.length_multiple)


@functools.lru_cache(maxsize=None)
def _lengths(values: tuple, multiple: int) -> tuple[int, ...]:
    return tuple(sorted({n if multiple <= 1 else -(-n // multiple) * multiple for n in values}))


def heads_of(cls: str, limits: Limits) -> tuple[int, ...]:
    return _heads(cls, limits.head_sizes)


@functools.lru_cache(maxsize=None)
def _heads(cls: str, accepted: tuple | None) -> tuple[int, ...]:
    sizes = HEAD_SIZES[cls]
    if accepted is not None:
        sizes = tuple(n for n in sizes if n in accepted)
    return sizes


def structure_ok(space: Space, row: dict) -> bool:
    """What no problem of the clause can be, whatever the kernel: an order the lengths' classes contradict, grouped
    heads without a head axis, whole masked 64-key tiles in fewer than 64 keys, the clause's own requirements."""
    L, S, order = row.get("L"), row.get("S"), row.get("order")
    if L is not None and S is not None and order is not None:
        a, b = _LENGTH_RANK[L], _LENGTH_RANK[S]
        if a != b and order != ("<" if a < b else ">"):
            return False
        if a == b and L == "one" and order != "=":
            return False
    if row.get("group", "1") != "1" and row.get("rank") == "0" and space.axes == 0:
        return False
    if row.get("attend") == "bool-tiles" and S is not None and _LENGTH_RANK[S] < _LENGTH_RANK["tile"]:
        return False
    return all(requirement(row) for requirement in space.requires)


def limits_reason(space: Space, ctx: Context, row: dict) -> str | None:
    """Why the kernel declines every problem of a (partial) row, from its limits (learned or declared); None if it
    may accept one."""
    limits = ctx.limits
    dtype = row.get("dtype")
    if dtype is not None and limits.dtypes is not None and DTYPES_BY_NAME[dtype] not in limits.dtypes:
        return _reason(limits, "dtype", f"dtypes {', '.join(DTYPE_NAMES[d] for d in limits.dtypes)}")
    for factor in ("E", "Ev"):
        cls = row.get(factor)
        if cls is not None and not heads_of(cls, limits):
            return _reason(limits, "head size", f"head sizes {', '.join(map(str, limits.head_sizes or ()))}")
    if limits.equal_head_sizes and row.get("E") is not None and row.get("Ev") is not None and row["E"] != row["Ev"]:
        return _reason(limits, "Ev = E", "Ev = E")
    if limits.equal_lengths and (row.get("order") not in (None, "=")):
        return _reason(limits, "L = S", "L = S")
    if limits.length_multiple > 1 and "one" in (row.get("L"), row.get("S")):
        return _reason(limits, "length multiple", f"L, S multiples of {limits.length_multiple}")
    rank = row.get("rank")
    if rank is not None and limits.ranks is not None and int(rank) + space.axes not in limits.ranks:
        return _reason(limits, "leading dims", f"leading dims {limits.ranks}")
    attend = row.get("attend") if space.has("attend") else dict(space.fixed).get("attend", "none")
    if attend is not None:
        if attend == "causal" and not limits.causal:
            return _reason(limits, "is_causal", "no is_causal")
        kind = attend.split("-")[0]
        if kind in ("bool", "float") and kind not in limits.masks:
            return _reason(limits, f"{kind} mask", f"a {kind} attn_mask")
        if limits.causal_only and attend != "causal":
            return _reason(limits, "is_causal only", "is_causal only")
    if (row.get("group", "1") != "1" or row.get("history") == "group") and not limits.gqa:
        return _reason(limits, "enable_gqa", "no enable_gqa")
    if row.get("layout", "contiguous") != "contiguous" and not limits.strided:
        return _reason(limits, "strided", "contiguous inputs only")
    if dict(space.fixed).get("dropout") and not limits.dropout:
        return _reason(limits, "dropout", "no dropout")
    return None


def _minimum(space: Space, ctx: Context, row: dict) -> dict:
    """The smallest realization of a (partial) row: every length, head size and lead at its class's least value
    (unassigned factors at the least over their classes)."""
    limits = ctx.limits

    def least_length(factor):
        cls = row.get(factor)
        pool = [cls] if cls else list(space.classes(factor)) or ["short"]
        return min(lengths_of(c, limits, space)[0] for c in pool)

    def least_head(factor):
        cls = row.get(factor)
        pool = [cls] if cls else list(space.classes(factor))
        sizes = [heads_of(c, limits) for c in pool]
        sizes = [s[0] for s in sizes if s]
        return min(sizes) if sizes else 1
    l = least_length("L") if space.has("L") else 1
    s = least_length("S") if space.has("S") else 1
    if row.get("L") == row.get("S") and row.get("order") in ("<", ">") and row.get("L") is not None:
        values = lengths_of(row["L"], limits, space)
        second = values[len(values) // 2] if len(values) > 1 else values[0]
        l, s = (l, second) if row["order"] == "<" else (second, s)
    e = least_head("E") if space.has("E") else 1
    ev = least_head("Ev") if space.has("Ev") else (e if not space.weights else 0)
    heads = int(row.get("group", "1"))
    return {"l": l, "s": s, "e": e, "ev": ev, "heads": heads}


def row_cost(space: Space, ctx: Context, row: dict) -> int:
    m = _minimum(space, ctx, row)
    return space.calls * cost(m["l"], m["s"], m["e"], m["ev"], m["heads"], space.weights)


def budget_ok(space: Space, ctx: Context, row: dict) -> bool:
    return row_cost(space, ctx, row) <= ctx.budget


# ------------------------------------------------------------------------------------------------- realization
class Chooser:
    """How a row's values are picked inside its classes: ``pick(name, candidates)`` returns one of the candidates
    (non-empty, ascending: the first is the smallest)."""

    def pick(self, name: str, candidates: tuple):
        raise NotImplementedError


def realize(space: Space, ctx: Context, row: dict, chooser: Chooser, row_index: int | None = None) -> Problem:
    """The problem of a row: values picked inside its classes by ``chooser``, within the budget (a pick that would
    exceed it falls back to the smallest values)."""
    limits = ctx.limits
    fixed = dict(space.fixed)

    def fits(l, s, e, ev, heads):
        return space.calls * cost(l, s, e, ev, heads, space.weights) <= ctx.budget

    least = _minimum(space, ctx, row)
    # lengths: the order inside one class picks the shorter from the lower half and the longer from the upper half
    if space.has("L") and space.has("S"):
        cl, cs, order = row["L"], row["S"], row.get("order", "=")
        lv, sv = lengths_of(cl, limits, space), lengths_of(cs, limits, space)
        if row.get("attend") == "bool-tiles":
            sv = tuple(n for n in sv if n >= 64) or sv
        if cl == cs and order == "=":
            l = s = chooser.pick("L=S", tuple(n for n in lv if fits(n, n, least["e"], least["ev"], least["heads"]))
                                 or lv[:1])
        elif cl == cs:
            half = max(1, len(lv) // 2)
            low, high = lv[:half], lv[half:] or lv[-1:]
            shorter = chooser.pick("shorter", low)
            longer = chooser.pick("longer", tuple(n for n in high if n > shorter) or high)
            l, s = (shorter, longer) if order == "<" else (longer, shorter)
        else:
            l = chooser.pick("L", lv)
            s = chooser.pick("S", tuple(n for n in sv if fits(l, n, least["e"], least["ev"], least["heads"])) or sv[:1])
            if not fits(l, s, least["e"], least["ev"], least["heads"]):
                l = lv[0]
    else:
        l = chooser.pick("L", lengths_of(row["L"], limits, space)) if "L" in row else fixed.get("l", 1)
        s = chooser.pick("S", lengths_of(row["S"], limits, space)) if "S" in row else fixed.get("s", l)
    if limits.equal_lengths:
        l = s = max(l, s)
    # head sizes, within the budget left
    def heads_pick(factor, other):
        sizes = heads_of(row[factor], limits)
        from properties.kernel.tiles import run_choice
        if len(sizes) > 2:
            sizes = tuple(run_choice(sizes, "small"))
        ok = tuple(n for n in sizes if fits(l, s, n, other, least["heads"])) or sizes[:1]
        return chooser.pick(factor, ok)
    e = heads_pick("E", least["ev"]) if "E" in row else fixed.get("e", 8)
    if space.weights:
        # (read through V = I: the value tensor is the clause's own, as narrow as the kernel takes)
        ev = e if limits.equal_head_sizes or limits.head_sizes is not None else fixed.get("ev", 1)
    elif "Ev" in row:
        ev = e if limits.equal_head_sizes else heads_pick("Ev", e)
    else:
        ev = e if limits.equal_head_sizes or "ev" not in fixed else fixed["ev"]
    if limits.head_sizes is not None:
        e = e if e in limits.head_sizes else nearest_size(limits.head_sizes, e)
        if not space.weights:
            ev = e if limits.equal_head_sizes else (ev if ev in limits.head_sizes else nearest_size(limits.head_sizes, ev))
    # leading dims: sizes inside the budget; grouped heads on the last one
    group = int(row.get("group", "1"))
    rank = row.get("rank", fixed.get("rank", "2"))
    options = []
    for lead in RANK_SIZES[rank]:
        lead = tuple(lead)
        if group > 1 and not space.axes:   # (a clause that adds the head axis itself builds the groups there)
            lead = (*lead[:-1], lead[-1] * group) if lead else lead
        size = math.prod(lead) if lead else 1
        if fits(l, s, e, ev, size):
            options.append(lead)
    if options and space.calls * cost(l, s, e, ev, math.prod(options[0]) if options[0] else 1,
                                      space.weights) > ctx.budget // 16:
        options = options[:1]   # a large problem keeps one slice per group (its pairs need no more)
    lead = chooser.pick("lead", tuple(options)) if options else tuple(
        (*((1,) * (len(RANK_SIZES[rank][0]) - 1)), group) if RANK_SIZES[rank][0] else ())
    extras = tuple((name, chooser.pick(name, extra.values)) for name, extra in space.extras)
    seed = chooser.pick("seed", ())
    dtype = DTYPES_BY_NAME[row["dtype"]] if "dtype" in row else DTYPES_BY_NAME[fixed.get("dtype", ctx.dtypes[0])]
    return Problem(lead=lead, l=l, s=s, e=e, ev=ev, dtype=dtype, seed=seed, axes=space.axes,
                   classes=tuple((f, row[f]) for f, _ in space.factors if f in row),
                   attend=row.get("attend", fixed.get("attend", "none")), values=row.get("values", "gaussian"),
                   group=group, layout=row.get("layout", "contiguous"), history=row.get("history", ""),
                   extras=extras, row=row_index)


class Rotation(Chooser):
    """The covering rows' picks: the k-th row holding a class takes the class's (offset + k)-th value, so that the
    rows of a class spread over its values; the offset and the seeds come from the run's seed."""

    def __init__(self, run_seed: int, clause: str, occurrences: dict, row_index: int):
        import zlib
        self.offset = zlib.crc32(f"{run_seed} {clause}".encode())
        self.occurrences, self.row_index, self.clause, self.run_seed = occurrences, row_index, clause, run_seed

    def pick(self, name, candidates):
        if name == "seed":
            import zlib
            return zlib.crc32(f"{self.run_seed} {self.clause} row {self.row_index}".encode())
        k = self.occurrences.get(name, 0)
        return candidates[(self.offset + k) % len(candidates)]


class Drawing(Chooser):
    """Hypothesis' picks (the generate phase): each from ``st.sampled_from`` (or the extra's own strategy), so that
    a failure shrinks to the smallest value of each class."""

    def __init__(self, draw, space: Space):
        self.draw, self.space = draw, space

    def pick(self, name, candidates):
        if name == "seed":
            from properties.core.strategies import seeds
            return self.draw(seeds)
        extras = dict(self.space.extras)
        if name in extras:
            return self.draw(extras[name].strategy)
        return self.draw(st.sampled_from(candidates))


class Smallest(Chooser):
    """A failing covering row's shrink (properties/kernel/schedule.py): the smallest value of every name in
    ``smallest``, the original's elsewhere."""

    def __init__(self, original: dict, smallest: set):
        self.original, self.smallest = original, smallest

    def pick(self, name, candidates):
        if name in self.smallest:
            return 0 if name == "seed" else candidates[0]
        value = self.original.get(name)
        if name == "seed" or name not in self.original:
            return value if value is not None else candidates[0]
        return value if value in candidates else candidates[0]


def picks_of(problem: Problem) -> dict:
    """The names a chooser picked for ``problem`` and their values (for ``Smallest``)."""
    picks = {"L": problem.l, "S": problem.s, "L=S": problem.l, "E": problem.e, "Ev": problem.ev,
             "lead": problem.lead, "seed": problem.seed, "shorter": min(problem.l, problem.s),
             "longer": max(problem.l, problem.s)}
    picks.update(dict(problem.extras))
    return picks
