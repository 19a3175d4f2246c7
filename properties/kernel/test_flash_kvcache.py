"""KV-cache clauses (SPEC.md, "The FlashAttention API"): ``flash_attn_with_kvcache(q, k_cache, v_cache, k, v, ...)``.
Run with ``--kernel-api flash-kvcache`` or ``flash`` (fixture ``kvcache_kernel``). Each entry's output must be
``flash`` over the keys it may see (cache positions [cache_leftpad, cache_seqlens) then the new keys), the cache
must be updated in place at exactly the right slots, and stale slots (keys 4·N(0, 1), values 1000·N(0, 1)) must
never be attended."""
from __future__ import annotations

from dataclasses import replace

from hypothesis import example, given

from properties import clause
from properties.core import evidence
from properties.core.assertions import assert_identical, assert_within
from properties.kernel.flash import FlashCase
from properties.kernel.flash_cases import CacheCase, cache_cases
from properties.kernel.flash_guard import skip_unsupported
from properties.core.oracle import to_float64
from properties.core.dtypes import selected_dtypes

F32 = selected_dtypes()[0]


def _flash(b, lq, **kw) -> FlashCase:
    return FlashCase(b, lq, 1, kw.pop("kv_heads", 1), kw.pop("group", 2), kw.pop("d", 4), F32, **kw)


def _run(kernel, device, case: CacheCase):
    """(problem, out, k_cache after, v_cache after) for the case without the features the kernel declines."""
    case = case.without(kernel.unsupported(device))
    problem = case.problem(device)
    with skip_unsupported(kernel, f"{case!r}"):
        out, k_after, v_after = problem.call(kernel)
    if evidence.active():   # the keys each entry may see and the caches as the call must leave them, for the script
        entries = [problem.keys_of(index) for index in range(case.flash.b)]
        new = {} if problem.k_new is None else {"k": problem.k_new, "v": problem.v_new}
        evidence.record("flash-kvcache", subject=kernel.name, device=str(device), query=problem.q, key=problem.k_cache,
                        value=problem.v_cache, kwargs={**new, **problem.kwargs}, keys=[k for k, _ in entries],
                        values=[v for _, v in entries], caches=[problem.expected_cache("k"), problem.expected_cache("v")],
                        bound=[problem.entry_bounds(index).output_bound()[0] for index in range(case.flash.b)])
    return problem, out, k_after, v_after


def _check_entries(problem, out, *, what: str = "out") -> None:
    __tracebackhide__ = True
    out = to_float64(out)
    for index in range(problem.case.flash.b):
        bounds = problem.entry_bounds(index)
        assert_within(out[index], bounds.output[0], bounds.output_bound()[0], what=f"{what} of entry {index}",
                      reference=f"flash oracle over the {problem.keys_of(index)[0].shape[1]} keys entry {index} "
                                "may see", note=f"; index (i, h, d); {problem.case!r}")


def _check_cache(problem, k_after, v_after) -> None:
    __tracebackhide__ = True
    for name, after in (("k", k_after), ("v", v_after)):
        assert_identical(to_float64(after), problem.expected_cache(name), what=f"{name}_cache after the call",
                         reference=f"{name}_cache with {name}_new written at cache_seqlens[b] … and nothing else "
                                   f"changed (index: cache row or block, slot, head, feature); {problem.case!r}")


@clause("KVCACHE-EQUALS-FULL")
@example(case=CacheCase(_flash(2, 1, causal=True), 6, (3, 5), lnew=1))                  # one decode step
@example(case=CacheCase(_flash(2, 2, causal=True, window=(1, 0)), 6, (2, 4), lnew=2))   # stale slots just after
@example(case=CacheCase(_flash(1, 2, alibi="batch"), 5, (5,), seqlens_as="none"))       # the whole cache
@example(case=CacheCase(_flash(2, 3, causal=True), 5, (1, 1), seqlens_as="int"))       # Lq > seen keys
@given(case=cache_cases(paged=False, batch_idx=False, leftpad=False))
def test_decoding_over_the_cache_equals_flash_over_its_keys(kvcache_kernel, device, case):
    problem, out, _, _ = _run(kvcache_kernel, device, case)
    _check_entries(problem, out)


@clause("KVCACHE-APPEND")
@example(case=CacheCase(_flash(2, 1), 6, (3, 0), lnew=2))
@example(case=CacheCase(_flash(2, 1), 4, (1, 3), lnew=1, block_size=2))
@given(case=cache_cases(append=True))
def test_the_call_appends_at_cache_seqlens_and_changes_nothing_else(kvcache_kernel, device, case):
    kvcache_kernel.require(device, "append")
    problem, _, k_after, v_after = _run(kvcache_kernel, device, case)
    _check_cache(problem, k_after, v_after)


@clause("KVCACHE-PAGED-EQUALS-CONTIGUOUS")
@example(case=CacheCase(_flash(2, 2, causal=True), 6, (2, 5), lnew=1, block_size=2))
@example(case=CacheCase(_flash(1, 1), 3, (3,), block_size=1))
@given(case=cache_cases(paged=True))
def test_a_paged_cache_behaves_as_the_contiguous_cache_it_stores(kvcache_kernel, device, case):
    kvcache_kernel.require(device, "paged")
    problem, out, k_after, v_after = _run(kvcache_kernel, device, case)
    _check_entries(problem, out, what="out (paged)")
    _check_cache(problem, k_after, v_after)
    flat = replace(problem.case, block_size=0)
    contiguous, out_flat, k_flat, _ = _run(kvcache_kernel, device, flat)
    for index in range(flat.flash.b):
        bound = 2 * problem.entry_bounds(index).output_bound()[0]
        assert_within(to_float64(out[index]), to_float64(out_flat[index]), bound, what=f"paged out of entry {index}",
                      reference="the same call on the contiguous cache", note=f"; {problem.case!r}")
    assert_identical(problem.read_rows(k_after), contiguous.read_rows(k_flat), what="paged k_cache read through "
                     "block_table after the call", reference="contiguous k_cache after the call")


@clause("KVCACHE-BATCH-IDX")
@example(case=CacheCase(_flash(2, 1, causal=True), 5, (2, 4), lnew=1, batch_idx=True, extra_rows=1))
@given(case=cache_cases(paged=False, batch_idx=True))
def test_cache_batch_idx_picks_each_entrys_row(kvcache_kernel, device, case):
    kvcache_kernel.require(device, "batch_idx")
    problem, out, k_after, v_after = _run(kvcache_kernel, device, case)
    _check_entries(problem, out)
    _check_cache(problem, k_after, v_after)


@clause("KVCACHE-LEFTPAD")
@example(case=CacheCase(_flash(2, 2, causal=True, alibi="heads"), 6, (4, 5), lnew=1, leftpad=(2, 1)))
@example(case=CacheCase(_flash(1, 1, window=(1, -1)), 5, (4,), leftpad=(1,)))
@given(case=cache_cases(leftpad=True, seqlens_as="tensor"))
def test_cache_leftpad_starts_each_entrys_range(kvcache_kernel, device, case):
    kvcache_kernel.require(device, "leftpad")
    problem, out, _, _ = _run(kvcache_kernel, device, case)
    _check_entries(problem, out)
