"""Drawn problems of the distributed level, and the comparisons every distributed clause makes.

A ``CPCase`` is one attention problem over the whole sequence (q (b, h, L, e), k and v (b, k, L, ·), the upstream
gradient), drawn by Hypothesis and generated in float64 from a seed, then rounded to the tested dtype. Lengths are
multiples of the layout's unit (W contiguous, 2W zigzag) unless a clause asks for the others (CP-SHARD-EDGES); heads
are W, 2W or 3W (what Ulysses can split; 3W with 3 key/value heads, which W = 2 or 4 does not divide) first, then
any; ``spread`` multiplies the queries, so that the scores reach the tens where a partial state's LSE held in 16 bits
loses its weights' precision. The pinned problems (``HALF_PIN`` ...) are the rows of these classes every run poses
first.

The comparisons: the gathered output and gradients against the float64 oracle of the whole problem
(properties/core/oracle.py, properties/kernel/gradients.py) within the single-device rounding model plus the merge's
(properties/core/tolerance.py, steps 1-7): one rescale per merged state, a state per chunk of the layout (W contiguous,
2W zigzag). A failure names the rank that holds the worst row.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from hypothesis import strategies as st

from properties.core.assertions import assert_within
from properties.core.oracle import to_float64
from properties.core.strategies import derived_generator, seeds
from properties.core.dtypes import selected_dtypes
from properties.core.tolerance import output_bound, softmax_bounds
from properties.distributed.layouts import rows_of
from properties.kernel.gradients import gradient_oracle

__all__ = ["CPCase", "Pin", "as_case", "cp_cases", "case_for", "merged_states", "Expected", "expected", "check_output",
           "check_gradients", "rank_of_worst", "HALF_PIN", "FLOAT16_PIN", "GROUPED_PIN", "UNEVEN_GROUPS_PIN",
           "FLOAT_PIN"]


@dataclass(frozen=True)
class CPCase:
    b: int
    heads: int
    kv_heads: int
    length: int
    e: int
    ev: int
    dtype: torch.dtype
    causal: bool
    scale: float | None
    spread: float
    seed: int

    def __repr__(self) -> str:
        return (f"CPCase(b={self.b}, heads={self.heads}, kv_heads={self.kv_heads}, length={self.length}, e={self.e}, "
                f"ev={self.ev}, dtype={self.dtype}, causal={self.causal}, scale={self.scale}, spread={self.spread}, "
                f"seed={self.seed})")

    def tensors(self, stream: int = 0):
        """q, k, v and the upstream gradient in the case's dtype (CPU)."""
        g = derived_generator(self.seed, stream)
        shapes = ((self.b, self.heads, self.length, self.e), (self.b, self.kv_heads, self.length, self.e),
                  (self.b, self.kv_heads, self.length, self.ev), (self.b, self.heads, self.length, self.ev))
        q, k, v, do = (torch.randn(*shape, generator=g, dtype=torch.float64) for shape in shapes)
        return tuple(t.to(self.dtype) for t in (q * self.spread, k, v, do))

    def kwargs(self) -> dict:
        kw = {"is_causal": self.causal}
        if self.scale is not None:
            kw["scale"] = self.scale
        if self.kv_heads != self.heads:
            kw["enable_gqa"] = True
        return kw


@dataclass(frozen=True)
class Pin:
    """A problem pinned with @example, its sizes in units of the kernel's world: heads = heads_per_rank·W, length =
    multiple·(W or 2W); resolved by ``as_case`` (the world is known only when the test runs)."""
    heads_per_rank: int
    kv_heads: int          # 0: as many as the query heads
    multiple: int
    e: int
    ev: int
    dtype: torch.dtype
    causal: bool
    spread: float
    scale: float | None = None


def as_case(case, kernel) -> CPCase:
    """A drawn CPCase as it is; a Pin resolved for ``kernel`` (rejected where the kernel declines its dtype)."""
    if isinstance(case, CPCase):
        return case
    from hypothesis import reject
    if case.dtype not in _dtypes(kernel):
        reject()
    unit = kernel.size if kernel.layout == "contiguous" else 2 * kernel.size
    heads = case.heads_per_rank * kernel.size
    return CPCase(b=1, heads=heads, kv_heads=case.kv_heads or heads, length=case.multiple * unit, e=case.e, ev=case.ev,
                  dtype=case.dtype, causal=case.causal, scale=case.scale, spread=case.spread, seed=0)


def case_for(example, kernel, **features) -> CPCase:
    """A clause's problem: a Pin (from @example) resolved for ``kernel``, else drawn from ``example`` (st.data()) with
    the features the clause needs forced (``cp_cases``'s keywords)."""
    if isinstance(example, Pin):
        return as_case(example, kernel)
    return example.draw(cp_cases(kernel, **features), label="case")


# Pinned in the clauses (the rows every run poses first, whatever Hypothesis draws):
# - scores in the tens in half precision, causal: the merge's precision (a partial state held in 16 bits), in each
#   16-bit dtype (HALF_PIN in bfloat16, FLOAT16_PIN);
# - grouped heads, causal, in float32, with one key/value head (GROUPED_PIN: H_kv < W, what a kernel that shards heads
#   must repeat) and with several that W does not divide (UNEVEN_GROUPS_PIN: H_kv = 3; how they are repeated shows);
#   scores of order one, so that every key of a row weighs (a key admitted or dropped, an empty block weighed);
# - a plain float32 problem of one unit, not causal (FLOAT_PIN): every block seen whole.
HALF_PIN = Pin(heads_per_rank=1, kv_heads=0, multiple=2, e=16, ev=8, dtype=torch.bfloat16, causal=True, spread=16.0)
FLOAT16_PIN = replace(HALF_PIN, dtype=torch.float16)
GROUPED_PIN = Pin(heads_per_rank=2, kv_heads=1, multiple=2, e=8, ev=4, dtype=torch.float32, causal=True, spread=1.0)
UNEVEN_GROUPS_PIN = replace(GROUPED_PIN, heads_per_rank=3, kv_heads=3)
FLOAT_PIN = Pin(heads_per_rank=1, kv_heads=0, multiple=1, e=4, ev=4, dtype=torch.float32, causal=False, spread=1.0)


def _dtypes(kernel) -> list[torch.dtype]:
    allowed = [d for d in selected_dtypes() if str(d).removeprefix("torch.") not in kernel.declined]
    return allowed or [torch.float32]


@st.composite
def cp_cases(draw, kernel, *, causal=None, gqa=None, scale=None, divisible=True, max_multiple=3,
             dtype=None) -> CPCase:
    """Problems for ``kernel`` (a ContextParallelKernel): inside what it accepts, the feature a clause needs forced."""
    world = kernel.size
    unit = world if kernel.layout == "contiguous" else 2 * world
    if divisible:
        length = unit * draw(st.sampled_from((*range(1, max_multiple + 1), 16)))
    else:
        length = draw(st.integers(1, unit * max_multiple).filter(lambda n: n % unit))
    # W, 2W and 3W heads split among the ranks (3W with 3 key/value heads: grouped heads W does not divide); 1-3 do not
    per_rank = sorted({world, 2 * world, 3 * world})
    heads = draw(st.sampled_from(per_rank + [h for h in (1, 2, 3) if h not in per_rank]))
    can_group = "gqa" not in kernel.declined
    grouped = (draw(st.booleans()) and can_group) if gqa is None else gqa
    divisors = [d for d in range(1, heads) if heads % d == 0]
    kv_heads = draw(st.sampled_from(divisors)) if grouped and divisors else heads
    is_causal = (draw(st.booleans()) and "causal" not in kernel.declined) if causal is None else causal
    if scale is None:
        the_scale = draw(st.one_of(st.none(), st.floats(0.05, 2.0))) if "scale" not in kernel.declined else None
    else:
        the_scale = scale
    return CPCase(b=draw(st.integers(1, 2)), heads=heads, kv_heads=kv_heads, length=length,
                  e=draw(st.sampled_from((4, 1, 2, 3, 5, 8, 16))), ev=draw(st.sampled_from((4, 1, 3, 8))),
                  dtype=dtype or draw(st.sampled_from(_dtypes(kernel))), causal=is_causal, scale=the_scale,
                  spread=draw(st.sampled_from((1.0, 4.0, 16.0))), seed=draw(seeds))


def merged_states(world: int, layout: str) -> int:
    """The partial states a query's output may be merged from: one per chunk of the layout."""
    return world if layout == "contiguous" else 2 * world


@dataclass
class Expected:
    """The oracle of a whole problem: bounds (tolerance.SoftmaxBounds), the output and its bound, the gradients."""
    bounds: object
    out: torch.Tensor
    out_bound: torch.Tensor
    grads: object = None   # kernel.gradients.Gradients


def expected(case: CPCase, q, k, v, do=None, *, world: int, layout: str) -> Expected:
    kw = case.kwargs()
    scale = kw.get("scale", 1.0 / case.e ** 0.5)

    def bounds_of(states: int):
        return softmax_bounds(q, k, v, is_causal=case.causal, scale=scale, enable_gqa=kw.get("enable_gqa", False),
                              merged_states=states)
    states = merged_states(world, layout)
    bounds = bounds_of(states)
    # The backward recomputes the weights from the LSE the forward kept, rounded to the accumulation type: exp(s - lse)
    # errs by |lse| u_a, not by |s - max| u_a. With two states or more step 7 covers it (their LSEs are rounded the
    # same way); a single state (one rank, contiguous shards) is held to it as to a merge of two.
    backward = bounds if states > 1 else bounds_of(2)
    grads = None if do is None else gradient_oracle(backward, q, k, v, do, scale=scale)
    return Expected(bounds, bounds.reference.output, output_bound(bounds, v), grads)


def rank_of_worst(actual, exact, bound, world: int, layout: str) -> str:
    """' (row l, the worst, is held by rank r of W; rows outside the bound on ranks …; layout shards)' for a failure
    message ('' when every entry is within)."""
    a, e, b = to_float64(actual), to_float64(exact), to_float64(bound)
    a, e = torch.broadcast_tensors(a, e)
    b = torch.broadcast_to(b, a.shape)
    error = torch.nan_to_num((a - e).abs(), nan=torch.inf)
    excess = torch.where(error > b, error / b.clamp_min(1e-300), torch.full_like(error, -1.0))
    if not bool((excess > 0).any()):
        return ""
    index = torch.unravel_index(excess.argmax(), excess.shape)
    row = int(index[-2])
    rows = rows_of(a.shape[-2], world, layout)
    owner = next(r for r, held in enumerate(rows) if row in held.tolist())
    bad_rows = (excess > 0).flatten(end_dim=-3).any(dim=0).any(dim=-1) if a.dim() > 2 else (excess > 0).any(dim=-1)
    ranks = [r for r, held in enumerate(rows) if len(held) and bool(bad_rows[held].any())]
    where = "every rank's" if len(ranks) == world else f"rank{'s' if len(ranks) > 1 else ''} " \
                                                          f"{', '.join(map(str, ranks))}'s"
    return f" (row {row}, the worst, is held by rank {owner} of {world}; {where} rows are outside the bound; " \
           f"{layout} shards)"


def check_output(out, exp: Expected, *, world: int, layout: str, what: str = "out") -> None:
    __tracebackhide__ = True
    note = rank_of_worst(out, exp.out, exp.out_bound, world, layout)
    assert_within(out, exp.out, exp.out_bound, what=what, note=note)


def check_gradients(grads: dict, exp: Expected, *, world: int, layout: str, where: str = "") -> None:
    """dQ, dK, dV each within its bound; a failure names every gradient outside (and those within), each with the
    ranks that hold its rows outside."""
    __tracebackhide__ = True
    failures, within = [], []
    for name in ("query", "key", "value"):
        exact, bound = exp.grads.value[name], exp.grads.bound[name]
        note = rank_of_worst(grads[name], exact, bound, world, layout)
        try:
            assert_within(grads[name], exact, bound, what=f"d{name}{where}", note=note)
        except AssertionError as exc:
            failures.append(str(exc))
        else:
            within.append(f"d{name}{where}")
    if failures:
        raise AssertionError("; ".join(failures) + (f" ({' and '.join(within)} within {'its' if len(within) == 1 else 'their'} "
                                                    f"bound)" if within else ""))


def with_dtype(case: CPCase, dtype: torch.dtype) -> CPCase:
    return replace(case, dtype=dtype)
