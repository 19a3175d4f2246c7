"""Multi-head attention as a module (SPEC.md, "Modules": MHA-*), on the attention parts of properties/module/parts.py.

The oracle (properties/module/oracle.py) reads ``q_proj, k_proj, v_proj, out_proj``; a replacement module
without them skips the oracle clauses with that reason, and its black-box clauses (permutation, cross
attention, length) run in float64 with the Models section's comparison tolerance instead.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import example, given, strategies as st

from properties import clause
from properties.core.assertions import assert_within
from properties.core.strategies import require_dtype
from properties.model.checks import comparison_tolerance
from properties.module.gradients import check_gradients, multihead
from properties.module.attention_oracle import (PROJECTION_NAMES, module_options, multihead_oracle, projections,
                                                single_head_oracle)
from properties.core import evidence
from properties.module.parts import OneLine, call_module, inputs, module_settings, part_params
from properties.core.dtypes import dtype_supported, selected_dtypes
from properties.core.strategies import PinnedData, derived_generator, seeds
from properties.kernel.cases import dtypes

FIRST = selected_dtypes()[0]   # pinned examples use the first selected dtype (float32 unless --dtype says)


def pytest_generate_tests(metafunc):
    if "attention" in metafunc.fixturenames:
        metafunc.parametrize("attention", part_params(metafunc.config, "attention"))


@dataclass(frozen=True)
class Mha(OneLine):
    """One drawn problem: batch, query length l, memory length s (cross only), heads h, key/value heads k,
    head size e (d_model = h·e), cross attention or self, right padding of the keys, causal, dtype, seed."""
    batch: int
    l: int
    s: int
    heads: int
    kv_heads: int
    e: int
    cross: bool
    padded: bool
    causal: bool
    dtype: torch.dtype
    seed: int

    @property
    def d_model(self) -> int:
        return self.heads * self.e

    @property
    def keys(self) -> int:
        return self.s if self.cross else self.l

    def __repr__(self) -> str:
        kind = f"cross(s={self.s})" if self.cross else "self"
        return (f"Mha(batch={self.batch}, l={self.l}, {kind}, heads={self.heads}, kv_heads={self.kv_heads}, "
                f"e={self.e}, padded={self.padded}, causal={self.causal}, dtype={self.dtype}, seed={self.seed})")


# Pinned shapes (drawn every run, SPEC.md's rule that a known bug class is never a coin flip), in the order of
# Mha's fields: batch, l, s, heads, kv_heads, e, cross, padded, causal, dtype, seed.
# B == L with 2 heads of an odd size 3: a head split or merge over the wrong axis (batch for length, (e h) for
# (h e)) raises no shape error and shows in the values; right-padded keys and causal masking together.
SELF_B_EQ_L = Mha(3, 3, 0, 2, 2, 3, False, True, True, FIRST, 0)
# Cross attention with L != S and a padded memory of mixed real lengths, 2 heads of size 2.
CROSS_L_NE_S = Mha(2, 3, 5, 2, 2, 2, True, True, False, FIRST, 1)


@st.composite
def problems(draw, *, heads=None, gqa=False, cross=None, padded=None, causal=None, min_l=1, max_l=6):
    if gqa:
        h = draw(st.integers(2, 6))
        k = draw(st.sampled_from([d for d in range(1, h) if h % d == 0]))
    else:
        h = draw(st.integers(1, 4)) if heads is None else heads
        k = h
    is_cross = draw(st.booleans()) if cross is None else cross
    is_causal = False if is_cross else (draw(st.booleans()) if causal is None else causal)
    return Mha(batch=draw(st.integers(1, 3)), l=draw(st.integers(min_l, max_l)),
               s=draw(st.integers(1, 6)) if is_cross else 0, heads=h, kv_heads=k, e=draw(st.integers(1, 4)),
               cross=is_cross, padded=draw(st.booleans()) if padded is None else padded, causal=is_causal,
               dtype=draw(dtypes()), seed=draw(seeds))


def build(attention, p: Mha, device, dtype=None):
    sizes = dict(d_model=p.d_model, heads=p.heads)
    if attention.has("kv_heads"):
        sizes["kv_heads"] = p.kv_heads
    return attention.build(device, dtype or p.dtype, p.seed, **sizes)


def tensors(p: Mha, device, dtype=None):
    """x (b, l, d), memory (b, s, d) or None, key padding mask (b, keys) with real prefixes or None."""
    dtype = dtype or p.dtype
    x = inputs(p.seed, 1, (p.batch, p.l, p.d_model), dtype, device)
    memory = inputs(p.seed, 2, (p.batch, p.s, p.d_model), dtype, device) if p.cross else None
    mask = None
    if p.padded:
        g = derived_generator(p.seed, 3)
        real = torch.randint(1, p.keys + 1, (p.batch,), generator=g)  # >= 1 real key: no empty row
        mask = (torch.arange(p.keys)[None, :] < real[:, None]).to(device)
    return x, memory, mask


def forward(module, p: Mha, x, memory, mask):
    kwargs = {}
    if mask is not None:
        kwargs["key_padding_mask"] = mask
    if p.causal:
        kwargs["is_causal"] = True
    args = (x,) if memory is None else (x, memory)
    return call_module(module, *args, expect=(x.shape[0], x.shape[1], p.d_model), like=x, what="attention", **kwargs)


def oracle(module, p: Mha, x, memory, mask):
    proj, reason = projections(module)
    if proj is None:
        pytest.skip(reason)
    return multihead_oracle(proj, x, memory, p.heads, p.kv_heads, key_padding_mask=mask, is_causal=p.causal,
                            dtype=p.dtype, **module_options(module))


def comparison(module, p: Mha, attention, device):
    """For the black-box clauses: (module, dtype, bound(x, memory, mask) -> tensor).  With readable
    projections, the oracle's bound in the drawn dtype; otherwise float64 and the comparison tolerance."""
    proj, _ = projections(module)
    if proj is not None:
        def bound(out, x, memory, mask):
            return multihead_oracle(proj, x, memory, p.heads, p.kv_heads, key_padding_mask=mask,
                                    is_causal=p.causal, dtype=p.dtype, **module_options(module)).error
        return module, p.dtype, bound
    module = build(attention, p, device, torch.float64)
    return module, torch.float64, lambda out, x, *_: torch.full((*x.shape[:2], p.d_model), comparison_tolerance(out),
                                                                 dtype=torch.float64)


# ------------------------------------------------------------------------------------------- MHA-SHAPE
@clause("MHA-SHAPE")
@module_settings
@example(p=SELF_B_EQ_L)
@example(p=CROSS_L_NE_S)
@given(p=problems())
def test_shape(attention, device, p):
    module = build(attention, p, device)
    x, memory, mask = tensors(p, device)
    forward(module, p, x, memory, mask)   # checks (B, L, D), dtype and device
    proj, _ = projections(module)
    if proj is not None:
        d, width, kv_width = p.d_model, p.d_model, p.kv_heads * p.e
        expected = {"q_proj": (width, d), "k_proj": (kv_width, d), "v_proj": (kv_width, d), "out_proj": (d, width)}
        actual = {"q_proj": proj.wq.shape, "k_proj": proj.wk.shape, "v_proj": proj.wv.shape, "out_proj": proj.wo.shape}
        wrong = {k: tuple(v) for k, v in actual.items() if tuple(v) != expected[k]}
        assert not wrong, (f"projection weights (out, in) {wrong}; expected {expected} for d_model={d}, "
                           f"heads={p.heads}, kv_heads={p.kv_heads}: head size d_model/heads = {p.e}")


# ------------------------------------------------------------------------------------------ MHA-ORACLE
@clause("MHA-ORACLE")
@module_settings
@example(p=Mha(1, 2, 0, 2, 2, 1, False, False, False, FIRST, 0))   # smallest shape where heads mix
@example(p=SELF_B_EQ_L)       # e > 1: a merge as (e h) instead of (h e) shows only with head size >= 2
@example(p=CROSS_L_NE_S)
@given(p=problems())
def test_concat_heads_times_w_o(attention, device, p):
    module = build(attention, p, device)
    x, memory, mask = tensors(p, device)
    out = forward(module, p, x, memory, mask)
    ref = oracle(module, p, x, memory, mask)
    words = dict(what="MultiHead(x)", reference="concat(heads) W_O + b_O (fp64)")
    evidence.record_module_oracle(out, ref.value, ref.error, oracle="properties/module/attention_oracle.py", **words)
    assert_within(out, ref.value, ref.error, **words)


# ------------------------------------------------------------------------------------- MHA-SINGLE-HEAD
@clause("MHA-SINGLE-HEAD")
@module_settings
@example(p=Mha(3, 3, 0, 1, 1, 3, False, True, True, FIRST, 0))   # B == L, padded and causal
@example(p=Mha(2, 3, 5, 1, 1, 2, True, True, False, FIRST, 1))   # cross, L != S, padded memory
@given(p=problems(heads=1))
def test_one_head_is_attention_on_the_projections(attention, device, p):
    module = build(attention, p, device)
    x, memory, mask = tensors(p, device)
    out = forward(module, p, x, memory, mask)
    proj, reason = projections(module)
    if proj is None:
        pytest.skip(reason)
    ref = single_head_oracle(proj, x, memory, key_padding_mask=mask, is_causal=p.causal, dtype=p.dtype,
                             **module_options(module))
    words = dict(what="MultiHead(x) with h=1", reference="Attention(xW_Q, mW_K, mW_V) W_O (fp64)")
    evidence.record_module_oracle(out, ref.value, ref.error, oracle="properties/module/attention_oracle.py", **words)
    assert_within(out, ref.value, ref.error, **words)


# --------------------------------------------------------------------------------------------- MHA-GQA
@clause("MHA-GQA")
@module_settings
@example(p=Mha(1, 2, 0, 4, 2, 1, False, False, False, FIRST, 0))   # h=4, k=2: both head orders differ
@example(p=Mha(2, 3, 5, 6, 2, 2, True, True, False, FIRST, 1))    # groups of 3, cross, L != S, padded memory
@given(p=problems(gqa=True))
def test_query_head_reads_its_group(attention, device, p):
    if not attention.has("kv_heads"):
        pytest.skip("the attention node has no kv_heads key: grouped-query heads are not configurable")
    module = build(attention, p, device)
    x, memory, mask = tensors(p, device)
    out = forward(module, p, x, memory, mask)
    ref = oracle(module, p, x, memory, mask)
    words = dict(what=f"MultiHead(x) with h={p.heads}, kv_heads={p.kv_heads}",
                 reference="oracle with query head i -> kv head i // (h/k)")
    evidence.record_module_oracle(out, ref.value, ref.error, oracle="properties/module/attention_oracle.py", **words)
    assert_within(out, ref.value, ref.error, **words)


def _permuted(attention, device, p: Mha, data, n: int, label: str):
    """A drawn permutation of n positions (as drawn, and as an index tensor), the module set up for comparing
    two of its evaluations with their bound, and its inputs (x, memory, mask) in the comparison dtype."""
    require_dtype(device, p.dtype)
    order = data.draw(st.permutations(range(n)), label=label)
    module, dtype, bound = comparison(build(attention, p, device), p, attention, device)
    return order, torch.tensor(order, device=device), module, bound, tensors(p, device, dtype)


# ------------------------------------------------------------------------------------- MHA-PERMUTATION
@clause("MHA-PERMUTATION")
@module_settings
@example(p=Mha(3, 3, 0, 2, 2, 3, False, False, False, FIRST, 0), data=PinnedData({"permutation": (2, 0, 1)}))
@given(p=problems(cross=False, padded=False, causal=False, min_l=2), data=st.data())
def test_self_attention_is_permutation_equivariant(attention, device, p, data):
    order, perm, module, bound, (x, _, _) = _permuted(attention, device, p, data, p.l, "permutation")
    if getattr(module, "window", None) is not None:
        pytest.skip(f"window={module.window}: a sliding window is a positional structure, so self-attention "
                    "is permutation equivariant only without it (MHA-ORACLE checks the window)")
    out = forward(module, p, x, None, None)
    permuted = forward(module, p, x[:, perm], None, None)
    tolerance = bound(out, x[:, perm], None, None) + bound(out, x, None, None)[:, perm.cpu()]
    assert_within(permuted, out[:, perm], tolerance, what="MultiHead(Px)", reference="P MultiHead(x)",
                  note=f" (permutation {order})")


# ------------------------------------------------------------------------------------------- MHA-CROSS
@clause("MHA-CROSS")
@module_settings
@example(p=CROSS_L_NE_S, data=PinnedData({"memory permutation": (4, 2, 0, 3, 1)}))
@given(p=problems(cross=True), data=st.data())
def test_cross_attention_follows_queries_and_ignores_memory_order(attention, device, p, data):
    order, perm, module, bound, (x, memory, mask) = _permuted(attention, device, p, data, p.s, "memory permutation")
    out = forward(module, p, x, memory, mask)             # shape (B, L, D): L of the queries, not S
    shuffled_mask = None if mask is None else mask[:, perm]
    shuffled = forward(module, p, x, memory[:, perm], shuffled_mask)
    tolerance = bound(out, x, memory, mask) + bound(out, x, memory[:, perm], shuffled_mask)
    assert_within(shuffled, out, tolerance, what="MultiHead(x, Pm)", reference="MultiHead(x, m)",
                  note=f" (memory permutation {order}, key padding mask permuted alike)")


# ------------------------------------------------------------------------------------- MHA-LENGTH-FREE
def _parameter_shapes(module):
    return [(name, tuple(t.shape)) for name, t in module.named_parameters()]


@clause("MHA-LENGTH-FREE")
@module_settings
@example(p=Mha(2, 5, 0, 2, 2, 3, False, False, True, FIRST, 0), data=PinnedData({"prefix length": 3}))
@given(p=problems(cross=False, padded=False, causal=True, max_l=12), data=st.data())
def test_parameters_do_not_depend_on_length(attention, device, p, data):
    require_dtype(device, p.dtype)
    prefix = data.draw(st.integers(1, p.l), label="prefix length")
    fresh = _parameter_shapes(build(attention, p, device))
    module, dtype, bound = comparison(build(attention, p, device), p, attention, device)
    before = _parameter_shapes(module)
    x, _, _ = tensors(p, device, dtype)
    whole = forward(module, p, x, None, None)
    part = forward(module, p, x[:, :prefix], None, None)
    after = _parameter_shapes(module)
    assert before == after, f"parameters changed by calls at lengths {p.l} and {prefix}: {before} -> {after}"
    assert before == fresh, f"two modules built alike have different parameters: {before} vs {fresh}"
    tolerance = bound(whole, x, None, None)[:, :prefix] + bound(part, x[:, :prefix], None, None)
    assert_within(part, whole[:, :prefix], tolerance, what=f"causal MultiHead(x[:, :{prefix}])",
                  reference=f"MultiHead(x)[:, :{prefix}] at length {p.l}")


# -------------------------------------------------------------------------------------- MHA-HEAD-COUNT
@clause("MHA-HEAD-COUNT")
@module_settings
@example(heads=0, e=2, pick=0, kv_case=False)   # no head at all
@example(heads=4, e=2, pick=1, kv_case=False)   # d_model = 10 for 4 heads
@example(heads=4, e=2, pick=2, kv_case=True)    # kv_heads = 3 for 4 heads
@given(heads=st.sampled_from([0, 2, 3, 4, 5, 6, 7, 8]), e=st.integers(1, 4), pick=st.integers(0, 7),
       kv_case=st.booleans())
def test_bad_head_count_is_a_clear_error(attention, device, heads, e, pick, kv_case):
    """heads = 0 or heads >= 2 with d_model = heads·e + r, 0 < r < heads; or a valid heads with kv_heads
    (picked by index) among 0 and the non-divisors of heads up to heads + 1."""
    if kv_case and attention.has("kv_heads"):  # without the key, the example checks the heads case
        heads = max(heads, 2)
        bad = [k for k in range(heads + 2) if k == 0 or heads % k]
        sizes = dict(d_model=heads * e, heads=heads, kv_heads=bad[pick % len(bad)])
        names = ("kv_heads", "heads")
    else:
        d_model = heads * e + 1 + pick % (heads - 1) if heads else e
        sizes, names = dict(d_model=d_model, heads=heads), ("heads", "d_model")
        if attention.has("kv_heads"):
            sizes["kv_heads"] = None
    dtype = next((d for d in selected_dtypes() if dtype_supported(str(device), d)), None)
    if dtype is None:
        pytest.skip(f"no selected dtype computes on {device}")
    try:
        attention.build(device, dtype, 0, **sizes)
    except ValueError as exc:
        message = str(exc)
        missing = [n for n in names if n not in message]
        assert not missing, f"ValueError for {sizes} does not name {missing}: {message!r}"
        return
    except Exception as exc:
        raise AssertionError(f"building with {sizes} raised {type(exc).__name__}: {exc}; expected a ValueError "
                             f"naming {' and '.join(names)}") from exc
    raise AssertionError(f"built an attention module with {sizes}; expected a ValueError naming "
                         f"{' and '.join(names)} ({names[0]} must be a positive divisor of {names[1]})")


# -------------------------------------------------------------------------------------------- MHA-GRAD
def _grad_call(p: Mha):
    def call(module, x, memory=None, key_padding_mask=None):
        kwargs = {"key_padding_mask": key_padding_mask} if key_padding_mask is not None else {}
        if p.causal:
            kwargs["is_causal"] = True
        return module(*((x,) if memory is None else (x, memory)), **kwargs)
    return call


@clause("MHA-GRAD")
@module_settings
@example(p=Mha(2, 3, 0, 4, 2, 2, False, True, True, FIRST, 0))   # GQA, causal, right padding: all three in dK, dV
@example(p=Mha(1, 2, 3, 2, 2, 2, True, True, False, FIRST, 1))   # cross attention, Lq != Lk, padded memory
@given(p=st.one_of(problems(), problems(gqa=True)))
def test_gradients_follow_the_formula(attention, device, p):
    if p.kv_heads != p.heads and not attention.has("kv_heads"):
        pytest.skip("the attention node has no kv_heads key: grouped-query heads are not configurable")
    module = build(attention, p, device)
    proj, reason = projections(module)
    if proj is None:
        pytest.skip(reason)
    x, memory, mask = tensors(p, device)
    upstream = inputs(p.seed, 4, (p.batch, p.l, p.d_model), p.dtype, device)
    params = {n: t for n, t in module.named_parameters() if n.split(".")[0] in PROJECTION_NAMES}
    given_inputs = {"x": x} | ({"memory": memory} if memory is not None else {}) | (
        {"key_padding_mask": mask} if mask is not None else {})

    def formula(i, w):
        return multihead(i["x"], i.get("memory"), w, p.heads, p.kv_heads, i.get("key_padding_mask"), p.causal,
                         **module_options(module))
    failures = check_gradients(module, _grad_call(p), formula, given_inputs, params, upstream, p.dtype, p.seed)
    assert not failures, "gradients of sum(MultiHead(x) ∘ G) depart from the formula's:\n  " + "\n  ".join(failures)
