"""A FlashAttention-2-style fused attention kernel in Triton, forward and backward: the suite's worked example
of a kernel with limits.

    pytest properties/ --kernel examples/triton_attention.py:attention --device cuda     # compiled, on a GPU
    TRITON_INTERPRET=1 pytest properties/ --kernel examples/triton_attention.py:attention --device cpu \
        --dtype float16 --dtype bfloat16 --kernel-head-size 16,32,64,128 --kernel-no-mask --kernel-equal-head-sizes \
        --hypothesis-profile pinned                       # on the CPU, interpreted: its limits declared, pinned problems

The algorithm (Dao, "FlashAttention-2", 2023, Algorithms 1 and 2), per (batch, head) slice:

- forward: one program per tile of BLOCK_M queries walks the keys in tiles of BLOCK_N.  It keeps the running
  row maximum m, the running row sum l of exp(s - m) and the unnormalised output acc; when a later tile
  raises the maximum, l and acc are rescaled by exp(m_old - m_new) (the online softmax).  At the end it
  writes acc / l and the row's log-sum-exp, m + log l, for the backward pass.  Scores are kept in base 2
  (scale · log2 e folded into one factor, exp2 instead of exp).
- backward: delta = rowsum(dO ∘ O) first; then one program per key tile recomputes each weight from the
  saved log-sum-exp, P = exp2(s - lse), and accumulates dV += Pᵀ dO and dK += dSᵀ Q with dS = P ∘ (dP - delta),
  dP = dO Vᵀ; and one program per query tile accumulates dQ += dS K the same way.  No weight matrix is
  ever stored.

Its limits, declared by declining (NotImplementedError, worded "not supported" / "only supports"): float16 and
bfloat16 only; head sizes 16, 32, 64 or 128, the value's equal to the query's; no attn_mask (is_causal is
supported, top-left aligned as SDPA's); no dropout.  Within them it takes any L and S (partial last tiles on
both axes, L != S), scale, grouped-query attention, any leading dims and strides.  CUDA tensors run compiled;
CPU tensors only under Triton's interpreter (TRITON_INTERPRET=1), which runs the same kernels with NumPy.
"""
from __future__ import annotations

import math

import torch

try:
    import triton
    import triton.language as tl
except ModuleNotFoundError as exc:   # the one-line error --kernel prints then says what to install
    raise ModuleNotFoundError(f"{exc}: examples/triton_attention.py needs Triton (pip install -e '.[triton]')",
                              name=exc.name) from exc

__all__ = ["attention", "HEAD_SIZES", "DTYPES", "BLOCK_M", "BLOCK_N"]

HEAD_SIZES = (16, 32, 64, 128)
DTYPES = (torch.float16, torch.bfloat16)
BLOCK_M, BLOCK_N = 64, 64      # query and key tile sizes (the same in the interpreter and on a GPU)
LOG2E = 1.4426950408889634


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr):
    """a @ b accumulated in float32.  Triton's interpreter keeps bfloat16 as its uint16 bit pattern and its tl.dot
    multiplies those (triton-lang/triton#11584, "not supported yet"): there, with UPCAST, the operands go to float32
    first, which is exact for 16-bit floats, so the products and the float32 sum are those of the GPU's dot."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _to(x, dtype: tl.constexpr, UPCAST: tl.constexpr):
    """x (float32) cast to ``dtype``, rounded to nearest even as a GPU rounds.  Triton's interpreter casts float32 to
    bfloat16 by dropping the low 16 bits (its cast passes no rounding mode): one ulp of error where a GPU makes half
    an ulp, always toward zero, which the suite's bounds catch (a row of weights summing to 1 - 2.1 ulp).  There, with
    UPCAST, x is first rounded to bfloat16's precision in float32 (the bias 0x7FFF plus the kept field's last bit,
    carrying into the exponent where it must), which the truncating cast then keeps exactly."""
    if UPCAST:
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def _rows_of(X, n, h, rows, length, s_n, s_h, s_l, s_e, HEAD: tl.constexpr):
    """Pointers to the (rows, HEAD) tile of head h of sequence n of an (N, H, length, HEAD) tensor of strides s_*, and
    the mask of the rows inside it."""
    feat = tl.arange(0, HEAD)
    return X + n * s_n + h * s_h + rows[:, None] * s_l + feat[None, :] * s_e, rows[:, None] < length


@triton.jit
def _load_rows(X, n, h, rows, length, s_n, s_h, s_l, s_e, HEAD: tl.constexpr):
    """The (rows, HEAD) tile of head h of sequence n (``_rows_of``); rows past ``length`` read 0."""
    pointers, inside = _rows_of(X, n, h, rows, length, s_n, s_h, s_l, s_e, HEAD)
    return tl.load(pointers, mask=inside, other=0.0)


@triton.jit
def _store_rows(X, value, n, h, rows, length, s_n, s_h, s_l, s_e, HEAD: tl.constexpr):
    """Writes ``value`` into the (rows, HEAD) tile of head h of sequence n (``_rows_of``), rows past ``length`` left."""
    pointers, inside = _rows_of(X, n, h, rows, length, s_n, s_h, s_l, s_e, HEAD)
    tl.store(pointers, value, mask=inside)


@triton.jit
def _forward(Q, K, V, O, LSE, qk_scale,
             sq_n, sq_h, sq_l, sq_e, sk_n, sk_h, sk_s, sk_e, sv_n, sv_h, sv_s, sv_e, so_n, so_h, so_l, so_e,
             H, GROUP, L, S,
             CAUSAL: tl.constexpr, HEAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             UPCAST: tl.constexpr):
    tile, nh = tl.program_id(0), tl.program_id(1).to(tl.int64)   # offsets may pass 2**31
    n, h = nh // H, nh % H
    kv = h // GROUP                                   # grouped-query attention: the query head's key/value head
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    feat = tl.arange(0, HEAD)
    q = _load_rows(Q, n, h, rows, L, sq_n, sq_h, sq_l, sq_e, HEAD)
    K += n * sk_n + kv * sk_h
    V += n * sv_n + kv * sv_h

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)   # running maximum of the scores, base 2
    l = tl.zeros([BLOCK_M], tl.float32)                 # running sum of exp2(s - m)
    acc = tl.zeros([BLOCK_M, HEAD], tl.float32)         # running sum of exp2(s - m) v
    end = S
    if CAUSAL:                                          # keys after the tile's last query are never admissible
        end = tl.minimum(S, (tile + 1) * BLOCK_M)
    for start in range(0, end, BLOCK_N):
        keys = start + cols
        k_t = tl.load(K + keys[None, :] * sk_s + feat[:, None] * sk_e, mask=keys[None, :] < S, other=0.0)
        s = _dot(q, k_t, UPCAST) * qk_scale
        admissible = keys[None, :] < S
        if CAUSAL:
            admissible = admissible & (keys[None, :] <= rows[:, None])
        s = tl.where(admissible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # a row with nothing admissible yet
        alpha = tl.exp2(m - m_safe)                              # rescales what earlier tiles summed
        p = tl.exp2(s - m_safe[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(V + keys[:, None] * sv_s + feat[None, :] * sv_e, mask=keys[:, None] < S, other=0.0)
        acc = acc * alpha[:, None] + _dot(_to(p, v.dtype, UPCAST), v, UPCAST)
        m = m_new
    out = acc / l[:, None]
    _store_rows(O, _to(out, O.dtype.element_ty, UPCAST), n, h, rows, L, so_n, so_h, so_l, so_e, HEAD)
    tl.store(LSE + nh * L + rows, m + tl.log2(l), mask=rows < L)


@triton.jit
def _delta(O, DO, DELTA, so_n, so_h, so_l, so_e, sd_n, sd_h, sd_l, sd_e, H, L,
           HEAD: tl.constexpr, BLOCK_M: tl.constexpr):
    """delta = rowsum(dO ∘ O): the row term of dS = P ∘ (dP - delta)."""
    tile, nh = tl.program_id(0), tl.program_id(1).to(tl.int64)   # offsets may pass 2**31
    n, h = nh // H, nh % H
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    o = _load_rows(O, n, h, rows, L, so_n, so_h, so_l, so_e, HEAD)
    do = _load_rows(DO, n, h, rows, L, sd_n, sd_h, sd_l, sd_e, HEAD)
    tl.store(DELTA + nh * L + rows, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=rows < L)


@triton.jit
def _backward_key_tile(Q, K, V, DO, LSE, DELTA, DK, DV, qk_scale, scale,
                       sq_n, sq_h, sq_l, sq_e, sk_n, sk_h, sk_s, sk_e, sv_n, sv_h, sv_s, sv_e,
                       sd_n, sd_h, sd_l, sd_e, sdk_n, sdk_h, sdk_s, sdk_e, sdv_n, sdv_h, sdv_s, sdv_e,
                       H, GROUP, L, S,
                       CAUSAL: tl.constexpr, HEAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       UPCAST: tl.constexpr):
    """dK and dV of one tile of keys of one key/value head, summed over the query heads of its group."""
    tile, nkv = tl.program_id(0), tl.program_id(1).to(tl.int64)
    KV = H // GROUP
    n, kv = nkv // KV, nkv % KV
    keys = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    feat = tl.arange(0, HEAD)
    k = _load_rows(K, n, kv, keys, S, sk_n, sk_h, sk_s, sk_e, HEAD)
    v = _load_rows(V, n, kv, keys, S, sv_n, sv_h, sv_s, sv_e, HEAD)
    dk = tl.zeros([BLOCK_N, HEAD], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD], tl.float32)
    first = 0
    if CAUSAL:                              # query tiles wholly before the first key see none of these keys
        first = (tile * BLOCK_N) // BLOCK_M * BLOCK_M
    for g in range(0, GROUP):
        h = kv * GROUP + g
        for start in range(first, L, BLOCK_M):
            rows = start + tl.arange(0, BLOCK_M)
            q_t = tl.load(Q + n * sq_n + h * sq_h + rows[None, :] * sq_l + feat[:, None] * sq_e,
                          mask=rows[None, :] < L, other=0.0)
            lse = tl.load(LSE + (n * H + h) * L + rows, mask=rows < L, other=0.0)
            s_t = _dot(k, q_t, UPCAST) * qk_scale      # scores transposed: (keys, queries)
            admissible = (keys[:, None] < S) & (rows[None, :] < L)
            if CAUSAL:
                admissible = admissible & (keys[:, None] <= rows[None, :])
            p_t = tl.where(admissible, tl.exp2(s_t - lse[None, :]), 0.0)
            do = _load_rows(DO, n, h, rows, L, sd_n, sd_h, sd_l, sd_e, HEAD)
            dv += _dot(_to(p_t, do.dtype, UPCAST), do, UPCAST)
            delta = tl.load(DELTA + (n * H + h) * L + rows, mask=rows < L, other=0.0)
            dp_t = _dot(v, tl.trans(do), UPCAST)
            ds_t = p_t * (dp_t - delta[None, :])
            dk += _dot(_to(ds_t, k.dtype, UPCAST), tl.trans(q_t), UPCAST)
    _store_rows(DK, _to(dk * scale, DK.dtype.element_ty, UPCAST), n, kv, keys, S, sdk_n, sdk_h, sdk_s, sdk_e, HEAD)
    _store_rows(DV, _to(dv, DV.dtype.element_ty, UPCAST), n, kv, keys, S, sdv_n, sdv_h, sdv_s, sdv_e, HEAD)


@triton.jit
def _backward_query_tile(Q, K, V, DO, LSE, DELTA, DQ, qk_scale, scale,
                         sq_n, sq_h, sq_l, sq_e, sk_n, sk_h, sk_s, sk_e, sv_n, sv_h, sv_s, sv_e,
                         sd_n, sd_h, sd_l, sd_e, sdq_n, sdq_h, sdq_l, sdq_e,
                         H, GROUP, L, S,
                         CAUSAL: tl.constexpr, HEAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         UPCAST: tl.constexpr):
    """dQ of one tile of queries of one head."""
    tile, nh = tl.program_id(0), tl.program_id(1).to(tl.int64)   # offsets may pass 2**31
    n, h = nh // H, nh % H
    kv = h // GROUP
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    feat = tl.arange(0, HEAD)
    q = _load_rows(Q, n, h, rows, L, sq_n, sq_h, sq_l, sq_e, HEAD)
    do = _load_rows(DO, n, h, rows, L, sd_n, sd_h, sd_l, sd_e, HEAD)
    lse = tl.load(LSE + nh * L + rows, mask=rows < L, other=0.0)
    delta = tl.load(DELTA + nh * L + rows, mask=rows < L, other=0.0)
    K += n * sk_n + kv * sk_h
    V += n * sv_n + kv * sv_h
    dq = tl.zeros([BLOCK_M, HEAD], tl.float32)
    end = S
    if CAUSAL:
        end = tl.minimum(S, (tile + 1) * BLOCK_M)
    for start in range(0, end, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        k_t = tl.load(K + keys[None, :] * sk_s + feat[:, None] * sk_e, mask=keys[None, :] < S, other=0.0)
        v_t = tl.load(V + keys[None, :] * sv_s + feat[:, None] * sv_e, mask=keys[None, :] < S, other=0.0)
        s = _dot(q, k_t, UPCAST) * qk_scale
        admissible = (keys[None, :] < S) & (rows[:, None] < L)
        if CAUSAL:
            admissible = admissible & (keys[None, :] <= rows[:, None])
        p = tl.where(admissible, tl.exp2(s - lse[:, None]), 0.0)
        ds = p * (_dot(do, v_t, UPCAST) - delta[:, None])
        dq += _dot(_to(ds, q.dtype, UPCAST), tl.trans(k_t), UPCAST)
    _store_rows(DQ, _to(dq * scale, DQ.dtype.element_ty, UPCAST), n, h, rows, L, sdq_n, sdq_h, sdq_l, sdq_e, HEAD)


_INTERPRETED = type(_forward).__name__ == "InterpretedFunction"   # TRITON_INTERPRET=1 when this module loaded


def _sizes(causal: bool, q: torch.Tensor) -> dict:
    """The compile-time parameters of the attention kernels."""
    e = q.shape[-1]
    return dict(CAUSAL=causal, HEAD=e, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, num_warps=8 if e >= 128 else 4,
                UPCAST=_INTERPRETED and q.dtype == torch.bfloat16)


class _FlashAttention(torch.autograd.Function):
    """On (N, H, L, E) queries and (N, H / GROUP, S, E) keys and values."""

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, scale: float):
        n, h, l, e = q.shape
        kv_heads, s = k.shape[1], k.shape[2]
        out = torch.empty((n, h, l, e), dtype=q.dtype, device=q.device)
        lse = torch.empty((n, h, l), dtype=torch.float32, device=q.device)
        _forward[(triton.cdiv(l, BLOCK_M), n * h)](
            q, k, v, out, lse, scale * LOG2E, *q.stride(), *k.stride(), *v.stride(), *out.stride(),
            h, h // kv_heads, l, s, **_sizes(causal, q))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale = causal, scale
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_out):
        q, k, v, out, lse = ctx.saved_tensors
        n, h, l, e = q.shape
        kv_heads, s = k.shape[1], k.shape[2]
        group = h // kv_heads
        delta = torch.empty_like(lse)
        _delta[(triton.cdiv(l, BLOCK_M), n * h)](out, d_out, delta, *out.stride(), *d_out.stride(), h, l,
                                                 HEAD=e, BLOCK_M=BLOCK_M)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        common = (ctx.scale * LOG2E, ctx.scale, *q.stride(), *k.stride(), *v.stride(), *d_out.stride())
        sizes = _sizes(ctx.causal, q)
        _backward_key_tile[(triton.cdiv(s, BLOCK_N), n * kv_heads)](
            q, k, v, d_out, lse, delta, dk, dv, *common, *dk.stride(), *dv.stride(), h, group, l, s, **sizes)
        _backward_query_tile[(triton.cdiv(l, BLOCK_M), n * h)](
            q, k, v, d_out, lse, delta, dq, *common, *dq.stride(), h, group, l, s, **sizes)
        return dq, dk, dv, None, None


def _decline_unsupported(query, key, value, attn_mask, dropout_p) -> None:
    """NotImplementedError for a problem outside the kernel's limits (a decline, not a wrong answer)."""
    if attn_mask is not None:
        raise NotImplementedError("triton_attention: attn_mask is not supported (only is_causal)")
    if dropout_p:
        raise NotImplementedError("triton_attention: dropout is not supported")
    if query.dtype not in DTYPES or key.dtype != query.dtype or value.dtype != query.dtype:
        raise NotImplementedError(f"triton_attention only supports float16 and bfloat16, got {query.dtype}, "
                                  f"{key.dtype}, {value.dtype}")
    e, ev = query.shape[-1], value.shape[-1]
    if e not in HEAD_SIZES or ev != e:
        raise NotImplementedError(f"triton_attention only supports head sizes {', '.join(map(str, HEAD_SIZES))} "
                                  f"with the value's equal to the query's, got E = {e}, Ev = {ev}")
    if query.device.type == "cpu" and not _INTERPRETED:
        raise NotImplementedError("triton_attention: CPU tensors are not supported outside Triton's interpreter "
                                  "(set TRITON_INTERPRET=1 before Triton is imported)")
    if query.device.type not in ("cpu", "cuda"):
        raise NotImplementedError(f"triton_attention: device {query.device.type} is not supported")


def _as_4d(t: torch.Tensor, batch: int) -> torch.Tensor:
    """(*batch dims, H, n, E) -> (batch, H, n, E); a 2-D (n, E) tensor is one head."""
    if t.dim() == 2:
        return t[None, None]
    return t.reshape(batch, t.shape[-3], t.shape[-2], t.shape[-1])


def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """``torch.nn.functional.scaled_dot_product_attention``'s contract, within the limits in the module docstring."""
    if query.dim() < 2 or key.dim() != query.dim() or value.dim() != query.dim():
        raise ValueError(f"query, key and value need the same number (>= 2) of dims, got {query.dim()}, "
                         f"{key.dim()}, {value.dim()}")
    if key.shape[-1] != query.shape[-1] or key.shape[:-1] != value.shape[:-1]:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} do not fit query {tuple(query.shape)}")
    if query.shape[:-3] != key.shape[:-3]:
        raise ValueError(f"query {tuple(query.shape)} and key {tuple(key.shape)} differ in their batch dims")
    if key.device != query.device or value.device != query.device:
        raise ValueError(f"query, key and value are on {query.device}, {key.device}, {value.device}")
    heads, kv_heads = (query.shape[-3], key.shape[-3]) if query.dim() >= 3 else (1, 1)
    if kv_heads != heads and not (enable_gqa and heads % kv_heads == 0):
        raise ValueError(f"{heads} query heads and {kv_heads} key/value heads need enable_gqa=True and a "
                         f"whole number of query heads per key/value head")
    _decline_unsupported(query, key, value, attn_mask, dropout_p)
    if query.shape[-2] == 0 or key.shape[-2] == 0:
        raise NotImplementedError("triton_attention: empty sequences are not supported")
    batch = math.prod(query.shape[:-3])
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    out = _FlashAttention.apply(_as_4d(query, batch), _as_4d(key, batch), _as_4d(value, batch),
                                bool(is_causal), scale)
    return out.reshape(query.shape)
