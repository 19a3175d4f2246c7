"""Varlen clauses (SPEC.md, "The FlashAttention API"): ``flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k,
max_seqlen_q, max_seqlen_k, ...)`` with sequences packed end to end. Run with ``--kernel-api flash-varlen`` or
``flash`` (fixture ``varlen_kernel``): every sequence must be the ``flash`` problem of its own slice."""
from __future__ import annotations

import torch
from hypothesis import assume, example, given

from properties import clause
from properties.core import evidence
from properties.core.assertions import assert_all, assert_within
from properties.kernel.flash import FlashCase, flash_gradients, to_heads_first
from properties.kernel.flash_cases import VarlenCase, varlen_cases
from properties.kernel.flash_guard import skip_unsupported
from properties.core.oracle import to_float64
from properties.core.strategies import derived_generator
from properties.core.dtypes import selected_dtypes
from properties.kernel.guard import backward_gradients

F32 = selected_dtypes()[0]


def _base(n, lq, lk, **kw) -> FlashCase:
    return FlashCase(n, lq, lk, kw.pop("kv_heads", 1), kw.pop("group", 2), kw.pop("d", 4), F32, **kw)


def _call(kernel, case: VarlenCase, q, k, v, slopes, args):
    with skip_unsupported(kernel, f"{case!r}"):
        return kernel(q, k, v, *args, **case.flash.kwargs(slopes))


def _record(kernel, device, case: VarlenCase, q, k, v, slopes, args, what: str = "out") -> None:
    """--repro-dir: the call and every sequence's bound (0 for a sequence without keys: its rows must be 0)."""
    if evidence.active():
        bound = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float64)
        for index, (q0, q1) in enumerate(zip(case.cu_q, case.cu_q[1:])):
            if q1 > q0:
                bound[q0:q1] = case.sequence_bounds(q, k, v, slopes, index).output_bound()[0]
        evidence.record("flash-varlen", subject=kernel.name, device=str(device), query=q, key=k, value=v, args=args,
                        kwargs=case.flash.kwargs(slopes), bound=bound, what=what)


def _check_sequences(out, case: VarlenCase, q, k, v, slopes, *, what: str, factor: float = 1.0, only=None):
    __tracebackhide__ = True
    out = to_float64(out)
    for index, (q0, q1) in enumerate(zip(case.cu_q, case.cu_q[1:])):
        if (only is not None and index != only) or q1 == q0:
            continue
        bounds = case.sequence_bounds(q, k, v, slopes, index)
        assert_within(out[q0:q1], bounds.output[0], factor * bounds.output_bound()[0],
                      what=f"{what} rows {q0}..{q1 - 1} (sequence {index})",
                      reference=f"flash oracle of sequence {index} alone",
                      note=f"; index (i, h, d) within the sequence; {case!r}")


@clause("VARLEN-EQUALS-PADDED")
@example(case=VarlenCase((2, 3), (3, 2), _base(2, 3, 3, causal=True)))            # per-sequence offsets +1, -1
@example(case=VarlenCase((3, 0, 2), (2, 4, 0), _base(3, 3, 4, alibi="batch")))    # empty sequences
@example(case=VarlenCase((1, 2), (3, 2), _base(2, 2, 3, alibi="batch")))          # alibi row b of sequence b > 0
@example(case=VarlenCase((2, 2), (4, 4), _base(2, 2, 4, window=(1, 0), softcap=2.5)))
@given(case=varlen_cases())
def test_each_packed_sequence_is_its_own_flash_problem(varlen_kernel, device, case):
    case = case.without(varlen_kernel.unsupported(device))
    q, k, v, slopes, args = case.tensors(device)
    out = _call(varlen_kernel, case, q, k, v, slopes, args)
    _record(varlen_kernel, device, case, q, k, v, slopes, args)
    _check_sequences(out, case, q, k, v, slopes, what="out")


@clause("VARLEN-INDEPENDENT")
@example(case=VarlenCase((2, 3, 2), (2, 3, 2), _base(3, 3, 3, causal=True)))
@example(case=VarlenCase((3, 3), (3, 3), _base(2, 3, 3)))
@given(case=varlen_cases())
def test_a_sequence_ignores_its_neighbours(varlen_kernel, device, case):
    case = case.without(varlen_kernel.unsupported(device))
    assume(len(case.lens_q) > 1)
    q, k, v, slopes, args = case.tensors(device)
    g = torch.Generator().manual_seed(case.flash.seed)
    candidates = [i for i, n in enumerate(case.lens_q) if n > 0]
    index = candidates[int(torch.randint(len(candidates), (1,), generator=g))]
    q2, k2, v2, _, _ = case.tensors(device, stream=4)
    (q0, q1), (k0, k1) = case.cu_q[index:index + 2], case.cu_k[index:index + 2]
    q2[q0:q1], k2[k0:k1], v2[k0:k1] = q[q0:q1], k[k0:k1], v[k0:k1]
    first = to_float64(_call(varlen_kernel, case, q, k, v, slopes, args))
    second = to_float64(_call(varlen_kernel, case, q2, k2, v2, slopes, args))
    bounds = case.sequence_bounds(q, k, v, slopes, index)
    # the script checks the first call's sequences against the oracle: a neighbour that leaks in shows there
    _record(varlen_kernel, device, case, q, k, v, slopes, args, what="out (the first call)")
    assert_all(torch.isfinite(second), second, what="out is finite")
    assert_within(second[q0:q1], first[q0:q1], 2 * bounds.output_bound()[0],
                  what=f"sequence {index}'s rows with fresh neighbours", reference="the same rows before",
                  note=f"; {case!r}")
    _check_sequences(first, case, q, k, v, slopes, what="out", only=index)


@clause("VARLEN-GRAD")
@example(case=VarlenCase((2, 3), (3, 2), _base(2, 3, 3, causal=True)))              # per-sequence offsets +1, -1
@example(case=VarlenCase((1, 0, 2), (3, 2, 0), _base(3, 2, 3, alibi="batch", softcap=2.5)))   # empty sides, row b
@given(case=varlen_cases(max_d=6))
def test_packed_gradients_are_each_sequences_own(varlen_kernel, device, case):
    case = case.without(varlen_kernel.unsupported(device))
    # With no sequence holding both queries and keys there are no scores: nothing to differentiate.
    assume(any(lq and lk for lq, lk in zip(case.lens_q, case.lens_k)))
    q, k, v, slopes, args = case.tensors(device)
    g = derived_generator(case.flash.seed, 9)
    do = case.place(torch.randn(*q.shape[:2], v.shape[-1], generator=g, dtype=torch.float64), device)
    leaves = {name: t.detach().requires_grad_() for name, t in (("query", q), ("key", k), ("value", v))}
    out = _call(varlen_kernel, case, leaves["query"], leaves["key"], leaves["value"], slopes, args)
    grads = {name: to_float64(t) for name, t in backward_gradients(varlen_kernel, out, do, leaves).items()}
    bound = {name: torch.zeros_like(to_heads_first(grads[name][None]))[0] for name in grads}   # (H, total, D)
    sequences = []   # (where, slices, the sequence's own oracle, or None where it has no scores)
    for index, ((q0, q1), (k0, k1)) in enumerate(zip(zip(case.cu_q, case.cu_q[1:]), zip(case.cu_k, case.cu_k[1:]))):
        slices = {"query": slice(q0, q1), "key": slice(k0, k1), "value": slice(k0, k1)}
        oracle = None
        if q1 > q0 and k1 > k0:
            sequence = [t[None, part] for t, part in ((q, slices["query"]), (k, slices["key"]), (v, slices["value"]),
                                                      (do, slices["query"]))]
            oracle = flash_gradients(case.flash, case.sequence_bounds(q, k, v, slopes, index), *sequence)
            for name, part in slices.items():
                bound[name][:, part] = oracle.bound[name][0]
        sequences.append((f"sequence {index} (queries {q0}..{q1 - 1}, keys {k0}..{k1 - 1}); {case!r}", slices, oracle))
    evidence.record("flash-gradient", subject=varlen_kernel.name, device=str(device), query=q, key=k, value=v, args=args,
                    kwargs=case.flash.kwargs(slopes), upstream=do, bound=bound)   # 0: where the clause wants exact 0
    for where, slices, oracle in sequences:
        if oracle is None:   # no scores: no gradient reaches this sequence's keys, nor its queries
            for name, part in slices.items():
                assert_all(grads[name][part] == 0, grads[name][part], what=f"d{name} of {where} is exactly 0")
            continue
        for name, part in slices.items():
            assert_within(to_heads_first(grads[name][None, part]), oracle.value[name], oracle.bound[name],
                          what=f"d{name} of {where}", reference="float64 chain rule of the sequence alone",
                          note="; index (1, h, position, d)")
