"""Sinusoidal and rotary positions as modules (SPEC.md, "Modules": POS-*).

A pos part offers ``forward(x, offset)`` (adds absolute codes) and ``rotate(t, offset)`` (rotates per-head
queries and keys).  The sinusoidal clauses run on ``pos=sinusoidal`` parts and read the codes through
``forward`` (codes = forward(0, offset)); the rotary clause runs on ``pos=rotary`` parts through ``rotate``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from hypothesis import example, given, strategies as st

from properties import clause
from properties.core import evidence
from properties.core.assertions import assert_all, assert_within
from properties.core.strategies import require_dtype
from properties.module.oracle import rotary_pair_error, sinusoid_error, sinusoid_table
from properties.module.parts import OneLine, call_module, inputs, module_settings, part_params
from properties.core.oracle import to_float64
from properties.core.strategies import PinnedData, pinned_property, seeds
from properties.core.dtypes import selected_dtypes
from properties.kernel.cases import dtypes
from properties.core.tolerance import gamma, unit_roundoff

U64 = unit_roundoff(torch.float64)
FIRST = selected_dtypes()[0]   # pinned examples use the first selected dtype (float32 unless --dtype says)


def _only(choice):
    def applies(part):
        return None if part.choice == choice else f"pos={part.choice}: the clause is about pos={choice}"
    return applies


def _only_not(choice):
    def applies(part):
        return f"pos={choice} has nothing to differentiate" if part.choice == choice else None
    return applies


def pytest_generate_tests(metafunc):
    if "pos_any" in metafunc.fixturenames:
        metafunc.parametrize("pos_any", part_params(metafunc.config, "pos", _only_not("none")))
    if "alibi" in metafunc.fixturenames:
        metafunc.parametrize("alibi", part_params(metafunc.config, "pos", _only("alibi")))
    if "pos" in metafunc.fixturenames:
        choice = "rotary" if "rotary" in metafunc.function.__name__ else "sinusoidal"
        metafunc.parametrize("pos", part_params(metafunc.config, "pos", _only(choice)))


@dataclass(frozen=True)
class Table(OneLine):
    """Codes for d features (even) and positions [offset, offset + l) of a module with max_len."""
    d: int
    max_len: int
    offset: int
    l: int
    batch: int
    dtype: torch.dtype
    seed: int


@st.composite
def tables(draw, min_len=1):
    d = 2 * draw(st.integers(1, 16))
    max_len = draw(st.integers(min_len, 48))
    offset = draw(st.integers(0, max_len - 1))
    l = draw(st.integers(1, max_len - offset))
    return Table(d, max_len, offset, l, draw(st.integers(1, 2)), draw(dtypes()), draw(seeds))


# Pinned table (drawn every run), in the order of Table's fields: d, max_len, offset, l, batch, dtype, seed.
# d = 6 (three frequencies, so an exponent off by a factor shows at i = 1, 2; with d = 2 only i = 0 exists), an
# offset > 0 (positions counted from the offset) and a batch of 2.
PINNED = Table(6, 12, 3, 5, 2, FIRST, 0)
# The settings, the pinned table, then drawn tables: the stack of the clauses run on PINNED and tables().
table_property = pinned_property(module_settings, {"p": tables()}, {"p": PINNED})


def build(pos, p: Table, device):
    return pos.build(device, p.dtype, p.seed, d_model=p.d, max_len=p.max_len)


def codes(module, p: Table, device, offset: int, length: int) -> torch.Tensor:
    """The codes the module adds at positions [offset, offset + length): forward(0, offset) (0 + c = c)."""
    zeros = torch.zeros(1, length, p.d, dtype=p.dtype, device=device)
    return to_float64(call_module(module, zeros, offset, expect=tuple(zeros.shape), like=zeros, what="pos"))[0]


# ---------------------------------------------------------------------------------- POS-SINUSOID-FORMULA
@clause("POS-SINUSOID-FORMULA")
@table_property
def test_sinusoid_formula(pos, device, p):
    module = build(pos, p, device)
    x = inputs(p.seed, 1, (p.batch, p.l, p.d), p.dtype, device)
    out = call_module(module, x, p.offset, expect=tuple(x.shape), like=x, what="pos")
    positions = torch.arange(p.offset, p.offset + p.l)
    table = sinusoid_table(positions.tolist(), p.d)
    e_table = sinusoid_error(positions, p.d, p.dtype)
    xd = to_float64(x)
    bound = e_table + gamma(1, unit_roundoff(p.dtype) + U64) * (xd.abs() + table.abs() + e_table)
    words = dict(what=f"forward(x, offset={p.offset})",
                 reference="x + PE(pos) with PE(pos, 2i) = sin(pos/10000^(2i/d)), PE(pos, 2i+1) = cos(..)")
    evidence.record_module_oracle(out, xd + table, bound, oracle="the sinusoid table in float64 (SPEC.md, POS-*)", **words)
    assert_within(out, xd + table, bound, **words)


# ------------------------------------------------------------------------------------ POS-SINUSOID-RANGE
@clause("POS-SINUSOID-RANGE")
@table_property
def test_sinusoid_range_and_distinct_rows(pos, device, p):
    module = build(pos, p, device)
    table = codes(module, p, device, 0, p.max_len)
    assert_all(table.abs() <= 1, table, what="every code lies in [-1, 1]")
    exact = sinusoid_table(range(p.max_len), p.d)
    error = sinusoid_error(torch.arange(p.max_len), p.d, p.dtype).amax(-1)
    gap = (exact[:, None, :] - exact[None, :, :]).abs().amax(-1)          # exact row distances
    certified = gap > error[:, None] + error[None, :]                        # rows that must differ
    same = (table[:, None, :] == table[None, :, :]).all(-1)
    clash = certified & same
    if clash.any():
        i, j = (int(t) for t in clash.nonzero()[0])
        raise AssertionError(f"rows {i} and {j} of the code table are equal, although the exact rows differ by "
                             f"{float(gap[i, j]):.3g} > their error bounds {float(error[i] + error[j]):.3g}")


# ------------------------------------------------------------------------------- POS-SINUSOID-WAVELENGTHS
def _angle(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Angle of the pair (a, b) = (sin φ, cos φ), i.e. φ."""
    return torch.atan2(a, b)


def _pair_error(error: torch.Tensor) -> torch.Tensor:
    """Euclidean bound of a feature pair's error from the two entries' bounds (..., d) -> (..., d/2)."""
    return torch.sqrt(error[..., 0::2] ** 2 + error[..., 1::2] ** 2)


def _angle_error(eps: torch.Tensor) -> torch.Tensor:
    """A unit 2-vector moved by at most eps (< 1) turns by at most asin(eps); π for eps >= 1."""
    return torch.where(eps < 1, torch.asin(eps.clamp(max=1.0)), torch.full_like(eps, math.pi))


@clause("POS-SINUSOID-WAVELENGTHS")
@module_settings
@example(p=PINNED)
@given(p=tables(min_len=2))
def test_wavelengths_geometric(pos, device, p):
    module = build(pos, p, device)
    row = codes(module, p, device, 1, 1)[0]                                  # PE(1) = (sin ω_i, cos ω_i)
    omega = _angle(row[0::2], row[1::2])                                     # recovered ω_i = 2π/λ_i
    i = torch.arange(p.d // 2, dtype=torch.float64)
    expected = 10000.0 ** (-2 * i / p.d)                                     # λ_i = 2π·10000^(2i/d)
    eps = _pair_error(sinusoid_error(torch.tensor([1]), p.d, p.dtype))[0]
    bound = _angle_error(eps) + 4 * U64 * (1 + expected)
    ratio = f"{10000.0 ** (2 / p.d):.4g}"
    wavelengths = ", ".join(f"{2 * math.pi / float(w):.4g}" if float(w) > 0 else "inf" for w in omega[:4])
    assert_within(omega, expected, bound, what="ω_i = 2π/λ_i recovered from PE(1)",
                  reference=f"10000^(-2i/d): λ from 2π, ratio {ratio}",
                  note=f" (recovered wavelengths {wavelengths}{', ...' if len(omega) > 4 else ''})")


# -------------------------------------------------------------------------------- POS-SINUSOID-RELATIVE
@clause("POS-SINUSOID-RELATIVE")
@module_settings
@example(p=PINNED, data=PinnedData({"shift k": 5}))
@given(p=tables(min_len=2), data=st.data())
def test_shift_is_a_rotation(pos, device, p, data):
    require_dtype(device, p.dtype)
    k = data.draw(st.integers(1, p.max_len - 1), label="shift k")
    module = build(pos, p, device)
    table = codes(module, p, device, 0, p.max_len)
    error = _pair_error(sinusoid_error(torch.arange(p.max_len), p.d, p.dtype))   # (max_len, d/2)
    a, b = table[:, 0::2], table[:, 1::2]
    theta = _angle(a[k], b[k]) - _angle(a[0], b[0])                         # R_k from PE(0) -> PE(k)
    d_theta = _angle_error(error[0]) + _angle_error(error[k]) + 8 * U64 * (1 + theta.abs())
    n = p.max_len - k
    c, s = torch.cos(theta), torch.sin(theta)
    rotated_a = a[:n] * c + b[:n] * s                                        # R_k PE(pos), pair by pair
    rotated_b = b[:n] * c - a[:n] * s
    miss = torch.sqrt((a[k:] - rotated_a) ** 2 + (b[k:] - rotated_b) ** 2)
    bound = error[k:] + error[:n] + d_theta * (1 + error[:n]) + 8 * U64
    assert_within(miss, torch.zeros_like(miss), bound, what=f"|PE(pos + {k}) - R_{k} PE(pos)| per pair",
                  reference="0 (the rotation taking PE(0) to PE(k))", note=" (index: position, pair)")


# ---------------------------------------------------------------------------------- POS-ROTARY-RELATIVE
@dataclass(frozen=True)
class Rotary(OneLine):
    batch: int
    heads: int
    e: int
    l: int
    offsets: tuple[int, int]
    dtype: torch.dtype
    seed: int


@st.composite
def rotary_problems(draw):
    l = draw(st.integers(1, 8))
    return Rotary(draw(st.integers(1, 2)), draw(st.integers(1, 3)), 2 * draw(st.integers(1, 4)), l,
                  (draw(st.integers(0, 24)), draw(st.integers(0, 24))), draw(dtypes()), draw(seeds))


@clause("POS-ROTARY-RELATIVE")
@module_settings
@example(p=Rotary(2, 2, 6, 5, (0, 7), FIRST, 0))   # 2 heads of 3 pairs, two different offsets
@given(p=rotary_problems())
def test_rotary_scores_depend_on_offset_only(pos, device, p):
    require_dtype(device, p.dtype)
    max_len = max(p.offsets) + p.l
    module = pos.build(device, p.dtype, p.seed, d_model=p.heads * p.e, max_len=max_len, heads=p.heads)
    log_base = math.log(float(pos.get("base", getattr(module, "base", 10000.0))))
    q = inputs(p.seed, 1, (p.batch, p.heads, 1, p.e), p.dtype, device).expand(-1, -1, p.l, -1).contiguous()
    k = inputs(p.seed, 2, (p.batch, p.heads, 1, p.e), p.dtype, device).expand(-1, -1, p.l, -1).contiguous()
    q_norm, k_norm = to_float64(q[:, :, :1]).norm(dim=-1), to_float64(k[:, :, :1]).norm(dim=-1)   # (b, h, 1)
    scores, errors = [], []
    for offset in p.offsets:
        rq = to_float64(call_module(module.rotate, q, offset, expect=tuple(q.shape), like=q, what="rotate"))
        rk = to_float64(call_module(module.rotate, k, offset, expect=tuple(k.shape), like=k, what="rotate"))
        positions = torch.arange(offset, offset + p.l, dtype=torch.float64)
        # per unit norm, a rotated vector's error is rotary_pair_error(pos, 1) whatever the pairing layout
        c = rotary_pair_error(positions, torch.ones(()), log_base, p.dtype)                       # (l,)
        norm_error = q_norm[..., None] * c                                                          # (b, h, 1, l)
        assert_within(rq.norm(dim=-1), q_norm.expand(-1, -1, p.l), norm_error[:, :, 0] + gamma(p.e + 2, U64) * q_norm,
                      what=f"|rotate(q, {offset})| per position", reference="|q| (a rotation)")
        scores.append(rq @ rk.transpose(-1, -2))                                                    # (b, h, l, l)
        errors.append((q_norm * k_norm)[..., None] * (c[:, None] + c[None, :] + c[:, None] * c[None, :])
                      + gamma(p.e, U64) * (q_norm * k_norm)[..., None])
    # reference score for each offset m - n: row 0 / column 0 of the first offset's score matrix
    m = torch.arange(p.l)
    delta = m[:, None] - m[None, :]
    row, col = delta.clamp(min=0), (-delta).clamp(min=0)
    reference = scores[0][..., row, col]
    reference_error = errors[0][..., row, col]
    for offset, score, error in zip(p.offsets, scores, errors):
        assert_within(score, reference, error + reference_error,
                      what=f"q_m·k_n after rotate(., {offset}) (index b, h, m, n)",
                      reference=f"q_(m-n)·k_0 after rotate(., {p.offsets[0]})")


# -------------------------------------------------------------------------------------- POS-ALIBI-BIAS
def paper_slopes(heads: int) -> list[float]:
    """get_slopes of ALiBi's reference code (Press et al.), as written there: a geometric sequence starting at and
    multiplying by 2^(-8/n) for n a power of two; otherwise the closest power's slopes, then every other slope
    of twice as many heads."""
    def power_of_2(n):
        start = 2 ** (-2 ** -(math.log2(n) - 3))
        return [start * start ** i for i in range(n)]
    if math.log2(heads).is_integer():
        return power_of_2(heads)
    closest = 2 ** math.floor(math.log2(heads))
    return power_of_2(closest) + paper_slopes(2 * closest)[0::2][:heads - closest]


@dataclass(frozen=True)
class Alibi(OneLine):
    """Bias of h heads for l queries at positions [offset, offset + l) against the keys [0, offset + l)."""
    heads: int
    l: int
    offset: int
    dtype: torch.dtype


@clause("POS-ALIBI-BIAS")
@module_settings
@example(p=Alibi(6, 3, 4, FIRST))   # 6 heads: not a power of two, the reference code's interleaved slopes
@given(p=st.builds(Alibi, st.integers(1, 12), st.integers(1, 8), st.integers(0, 24), dtypes()))
def test_alibi_bias_is_slope_times_distance(alibi, device, p):
    require_dtype(device, p.dtype)
    s = p.offset + p.l
    module = alibi.build(device, p.dtype, 0, d_model=2 * p.heads, max_len=s, heads=p.heads)
    x = inputs(0, 1, (1, p.l, 2 * p.heads), p.dtype, device)
    t = inputs(0, 2, (1, p.heads, p.l, 2), p.dtype, device)
    bias = call_module(module.score_bias, p.l, s, p.offset, p.heads, expect=(p.heads, p.l, s), like=x,
                       what="score_bias")
    distance = (torch.arange(p.offset, s, dtype=torch.float64)[:, None] - torch.arange(s)[None, :]).abs()
    exact = -torch.tensor(paper_slopes(p.heads), dtype=torch.float64)[:, None, None] * distance
    # The module's slope: an exponent 8h/H' and a power in the dtype's arithmetic (at most 8 ln 2 u + u, say 7u),
    # rounded to the dtype (u), then one product (u; the distance is an integer the dtype holds): γ(9). The
    # float64 reference: start^(i + 1) with start 2^(-8/n) to 1 ulp, a power and a product, i < 16: γ(18).
    bound = (gamma(9, unit_roundoff(p.dtype)) + gamma(18, U64)) * exact.abs()
    assert_within(bias, exact, bound, what="score_bias (index h, i, j)",
                  reference="-m_h |offset + i - j|, m_h of the reference code's get_slopes")
    assert torch.equal(call_module(module, x, p.offset, expect=tuple(x.shape), like=x, what="pos"), x), (
        "ALiBi adds no position codes to the embeddings: forward(x, offset) must return x")
    assert torch.equal(call_module(module.rotate, t, p.offset, expect=tuple(t.shape), like=t, what="rotate"), t), (
        "ALiBi rotates nothing: rotate(t, offset) must return t")


# -------------------------------------------------------------------------------------------- POS-GRAD
@clause("POS-GRAD")
@table_property
def test_additive_positions_pass_gradients_through(pos_any, device, p):
    if pos_any.choice == "rotary" or pos_any.has("heads"):   # a loaded config names no choice: rotary takes heads
        _rotary_gradient(pos_any, device, p)
        return
    module = build(pos_any, p, device)
    x = inputs(p.seed, 1, (p.batch, p.l, p.d), p.dtype, device).requires_grad_(True)
    dy = inputs(p.seed, 2, (p.batch, p.l, p.d), p.dtype, device)
    for param in module.parameters():
        param.grad = None
    out = module(x, p.offset)
    if not out.requires_grad:
        import pytest
        pytest.skip(f"{type(module).__qualname__}'s output does not require grad")
    out.backward(dy)
    assert_within(x.grad, dy, 0.0, what="dx", reference="dy (x + codes passes the gradient unchanged)")
    params = dict(module.named_parameters())
    if pos_any.choice == "sinusoidal":
        assert not params, f"sinusoidal codes are fixed (paper 3.5), but the module has parameters {list(params)}"
    for name, param in params.items():
        if param.dim() != 2 or param.shape[-1] != p.d:
            continue
        expected = torch.zeros(param.shape, dtype=torch.float64)
        expected[p.offset: p.offset + p.l] = to_float64(dy).sum(0)
        bound = gamma(p.batch, unit_roundoff(p.dtype)) * torch.zeros_like(expected).index_add_(
            0, torch.arange(p.offset, p.offset + p.l), to_float64(dy).abs().sum(0))
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        assert_within(grad, expected, bound, what=f"d{name}",
                      reference=f"Σ_b dy at rows [{p.offset}, {p.offset + p.l}), 0 elsewhere")


def _rotary_gradient(pos, device, p: Table):
    """rotate is linear and orthogonal per position: dt = R̂ᵀ dy, R̂ read from the module (rotate of the basis)."""
    heads = 1
    require_dtype(device, p.dtype)
    module = pos.build(device, p.dtype, p.seed, d_model=p.d, max_len=p.max_len, heads=heads)
    log_base = math.log(float(pos.get("base", getattr(module, "base", 10000.0))))
    t = inputs(p.seed, 1, (p.batch, heads, p.l, p.d), p.dtype, device).requires_grad_(True)
    dy = inputs(p.seed, 2, (p.batch, heads, p.l, p.d), p.dtype, device)
    out = module.rotate(t, p.offset)
    if not out.requires_grad:
        import pytest
        pytest.skip(f"{type(module).__qualname__}.rotate's output does not require grad")
    out.backward(dy)
    basis = torch.eye(p.d, dtype=p.dtype, device=device).expand(p.l, p.d, p.d).transpose(0, 1)   # (d, l, d): e_j at every position
    with torch.no_grad():
        columns = to_float64(module.rotate(basis.contiguous(), p.offset))                        # (d, l, d): R̂ e_j
    rotation = columns.permute(1, 2, 0)                                                            # (l, d_out, d_in)
    expected = torch.einsum("lij,bhli->bhlj", rotation, to_float64(dy))                            # R̂ᵀ dy
    positions = torch.arange(p.offset, p.offset + p.l, dtype=torch.float64)
    c = rotary_pair_error(positions, torch.ones(()), log_base, p.dtype)                            # per unit norm
    dy_norm = to_float64(dy).norm(dim=-1)
    bound = (1 + math.sqrt(p.d)) * c[None, None, :] * dy_norm + gamma(p.d, U64) * dy_norm         # (b, h, l)
    miss = (to_float64(t.grad) - expected).norm(dim=-1)
    assert_within(miss, torch.zeros_like(miss), bound, what="|dt − R̂ᵀ dy| per position",
                  reference="0 (the adjoint of a rotation is its inverse)")
