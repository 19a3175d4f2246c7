"""Broken kernels with FlashAttention's API (flash-attn 2.x keywords): one realistic bug each, every one correct on
the plain case (no window, softcap or ALiBi; one packed sequence; a cache read whole with nothing appended), so
that only the feature clauses can catch it (SPEC.md, "The FlashAttention API").

    pytest properties/ --kernel-api flash --kernel properties.catalog.flash_bugs:window_left_off_by_one
    pytest properties/ --kernel-api flash-varlen --kernel properties.catalog.flash_bugs:varlen_causal_global_offset
    pytest properties/ --kernel-api flash-kvcache --kernel properties.catalog.flash_bugs:kvcache_seqlens_off_by_one

The correct base is written here from the docstrings (not imported from ``zoo/``), so that the catalog does not
change when the zoo does: ``FlashBase`` (``flash_attn_func``), ``varlen_base`` and ``KVCacheBase``; each bug
overrides one step. ``BUGS`` maps every name to its API and mechanism (properties/catalog/__init__.py registers
them).
"""
from __future__ import annotations

import math

import torch

__all__ = ["BUGS", "FlashBase", "KVCacheBase", "flash_base", "varlen_base", "kvcache_base"]


def _ct(dtype):
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class FlashBase:
    """A correct ``flash_attn_func`` in plain torch, in overridable steps."""

    def band(self, lq, lk, causal, window, device):
        """(lq, lk) bool: key j admissible for query i."""
        i = torch.arange(lq, device=device)[:, None] + (lk - lq)
        j = torch.arange(lk, device=device)[None, :]
        left, right = window
        ok = torch.ones(lq, lk, dtype=torch.bool, device=device)
        if causal:
            ok = ok & (j <= i)
        if right >= 0:
            ok = ok & (j <= i + right)
        if left >= 0:
            ok = ok & (j >= i - left)
        return ok

    def distance(self, lq, lk, device):
        return ((torch.arange(lq, device=device)[:, None] + (lk - lq)) - torch.arange(lk, device=device)[None, :]).abs()

    def bias(self, slopes, b, h, lq, lk, ct, device):
        slopes = slopes.to(device=device, dtype=ct).expand(b, h)
        return -slopes[:, :, None, None] * self.distance(lq, lk, device).to(ct)

    def expand(self, t, h):
        return t.repeat_interleave(h // t.shape[2], dim=2)

    def scores(self, q, k, scale, softcap, ct):
        s = torch.einsum("blhe,bshe->bhls", q.to(ct) * scale, k.to(ct))
        return softcap * torch.tanh(s / softcap) if softcap > 0 else s

    def masked(self, scores, allowed, softcap):
        return scores.masked_fill(~allowed, -math.inf)

    def softmax(self, scores):
        top = scores.amax(-1, keepdim=True)
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        e = torch.exp(scores - top)
        total = e.sum(-1, keepdim=True)
        return e / torch.where(total > 0, total, torch.ones_like(total))

    def __call__(self, q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                 alibi_slopes=None, deterministic=False, return_attn_probs=False):
        b, lq, h, e = q.shape
        lk = k.shape[1]
        ct = _ct(q.dtype)
        if lq == 0 or lk == 0:
            return q.new_zeros(b, lq, h, v.shape[-1])
        scale = 1.0 / math.sqrt(e) if softmax_scale is None else softmax_scale
        s = self.scores(q, self.expand(k, h), scale, softcap, ct)
        if alibi_slopes is not None:
            s = s + self.bias(alibi_slopes, b, h, lq, lk, ct, q.device)
        s = self.masked(s, self.band(lq, lk, causal, tuple(window_size), q.device), softcap)
        w = self.softmax(s)
        if dropout_p > 0:
            w = torch.nn.functional.dropout(w, dropout_p)
        return torch.einsum("bhls,bshv->blhv", w, self.expand(v, h).to(ct)).to(q.dtype)


flash_base = FlashBase()


# ------------------------------------------------------------------------------------------- flash bugs
class _WindowLeftOffByOne(FlashBase):
    def band(self, lq, lk, causal, window, device):
        left, right = window
        ok = super().band(lq, lk, causal, (-1, right), device)
        if left >= 0:   # j > i + o - left: the left edge exclusive
            i = torch.arange(lq, device=device)[:, None] + (lk - lq)
            ok = ok & (torch.arange(lk, device=device)[None, :] > i - left)
        return ok


class _WindowRightOffByOne(FlashBase):
    def band(self, lq, lk, causal, window, device):
        left, right = window
        return super().band(lq, lk, causal, (left, right + 1 if right >= 0 else right), device)


class _WindowSidesSwapped(FlashBase):
    def band(self, lq, lk, causal, window, device):
        return super().band(lq, lk, causal, (window[1], window[0]), device)


class _WindowTopLeft(FlashBase):
    def band(self, lq, lk, causal, window, device):
        ok = super().band(lq, lk, causal, (-1, -1), device)
        i = torch.arange(lq, device=device)[:, None]
        j = torch.arange(lk, device=device)[None, :]
        left, right = window
        if right >= 0:
            ok = ok & (j <= i + right)
        if left >= 0:
            ok = ok & (j >= i - left)
        return ok


class _CausalTopLeft(FlashBase):
    def band(self, lq, lk, causal, window, device):
        ok = super().band(lq, lk, False, window, device)
        if causal:
            ok = ok & torch.ones(lq, lk, dtype=torch.bool, device=device).tril()
        return ok


class _SoftcapAfterMask(FlashBase):
    def scores(self, q, k, scale, softcap, ct):
        return super().scores(q, k, scale, 0.0, ct)

    def masked(self, scores, allowed, softcap):
        scores = scores.masked_fill(~allowed, -math.inf)
        return softcap * torch.tanh(scores / softcap) if softcap > 0 else scores


class _SoftcapBeforeScale(FlashBase):
    def scores(self, q, k, scale, softcap, ct):
        s = torch.einsum("blhe,bshe->bhls", q.to(ct), k.to(ct))
        return (softcap * torch.tanh(s / softcap) if softcap > 0 else s) * scale


class _SoftcapAfterAlibi(FlashBase):
    def __call__(self, q, k, v, *args, softcap=0.0, alibi_slopes=None, **kwargs):
        self._cap, self._alibi = softcap, alibi_slopes is not None
        return super().__call__(q, k, v, *args, softcap=0.0 if self._alibi else softcap, alibi_slopes=alibi_slopes,
                                **kwargs)

    def masked(self, scores, allowed, softcap):
        if self._alibi and self._cap > 0:       # the cap applied to score + bias
            scores = self._cap * torch.tanh(scores / self._cap)
        return super().masked(scores, allowed, softcap)


class _AlibiSignFlipped(FlashBase):
    def bias(self, slopes, b, h, lq, lk, ct, device):
        return -super().bias(slopes, b, h, lq, lk, ct, device)


class _AlibiDistanceTopLeft(FlashBase):
    def distance(self, lq, lk, device):
        return (torch.arange(lq, device=device)[:, None] - torch.arange(lk, device=device)[None, :]).abs()


class _AlibiWithoutAbs(FlashBase):
    def distance(self, lq, lk, device):
        return (torch.arange(lq, device=device)[:, None] + (lk - lq)) - torch.arange(lk, device=device)[None, :]


class _AlibiBatchRowIgnored(FlashBase):
    def bias(self, slopes, b, h, lq, lk, ct, device):
        return super().bias(slopes if slopes.dim() == 1 else slopes[0], b, h, lq, lk, ct, device)


class _GqaHeadsTiled(FlashBase):
    def expand(self, t, h):
        return t.repeat(1, 1, h // t.shape[2], 1)


class _FullyMaskedRowsNan(FlashBase):
    def softmax(self, scores):
        return torch.softmax(scores, dim=-1)


class _BackwardWithoutWindow(torch.autograd.Function):
    """Forward: the correct kernel. Backward: weights recomputed with the causal mask only (the window and ALiBi
    forgotten), the chain rule of SPEC.md "Gradients" otherwise exact."""

    @staticmethod
    def forward(ctx, q, k, v, scale, causal, window, alibi_slopes):
        ctx.save_for_backward(q, k, v)
        ctx.options = (scale, causal, alibi_slopes)
        return flash_base(q, k, v, softmax_scale=scale, causal=causal, window_size=window, alibi_slopes=alibi_slopes)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v = ctx.saved_tensors
        scale, causal, _ = ctx.options
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            out = flash_base(*leaves, softmax_scale=scale, causal=causal)
            grads = torch.autograd.grad(out, leaves, grad_out)
        return (*grads, None, None, None, None)


def backward_without_window(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                            softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    if dropout_p > 0 or softcap > 0:
        return flash_base(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    return _BackwardWithoutWindow.apply(q, k, v, scale, causal, tuple(window_size), alibi_slopes)


class _SoftcapBackwardAsUncapped(FlashBase):
    """Forward exact; the backward passes the scores' gradient through the cap unchanged (slope 1 instead of
    1 − tanh²), as a hand-written backward that forgets the cap's derivative does."""

    def scores(self, q, k, scale, softcap, ct):
        raw = super().scores(q, k, scale, 0.0, ct)
        if softcap <= 0:
            return raw
        return raw + (softcap * torch.tanh(raw / softcap) - raw).detach()


softcap_backward_as_uncapped = _SoftcapBackwardAsUncapped()
window_left_off_by_one = _WindowLeftOffByOne()
window_right_off_by_one = _WindowRightOffByOne()
window_sides_swapped = _WindowSidesSwapped()
window_top_left = _WindowTopLeft()
causal_top_left = _CausalTopLeft()
softcap_after_mask = _SoftcapAfterMask()
softcap_before_scale = _SoftcapBeforeScale()
softcap_after_alibi = _SoftcapAfterAlibi()
alibi_sign_flipped = _AlibiSignFlipped()
alibi_distance_top_left = _AlibiDistanceTopLeft()
alibi_without_abs = _AlibiWithoutAbs()
alibi_batch_row_ignored = _AlibiBatchRowIgnored()
gqa_heads_tiled_flash = _GqaHeadsTiled()
fully_masked_rows_nan_flash = _FullyMaskedRowsNan()


# -------------------------------------------------------------------------------------------------- varlen
def _bounds(cu):
    b = [int(x) for x in cu.tolist()]
    return list(zip(b, b[1:]))


def varlen_base(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
                causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                return_attn_probs=False, *, _key_slice=None, _row=None):
    """A correct ``flash_attn_varlen_func``: ``flash_base`` on every sequence's slices."""
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
    for index, ((q0, q1), (k0, k1)) in enumerate(zip(_bounds(cu_seqlens_q), _bounds(cu_seqlens_k))):
        if _key_slice is not None:
            k0, k1 = _key_slice(k0, k1)
        slopes = alibi_slopes
        if slopes is not None and slopes.dim() == 2:
            slopes = slopes[index if _row is None else _row(index)]
        out[q0:q1] = flash_base(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], dropout_p, softmax_scale, causal,
                                window_size, softcap, slopes)[0]
    return out


def varlen_reads_one_key_past_the_end(q, k, v, cu_seqlens_q, cu_seqlens_k, *args, **kwargs):
    return varlen_base(q, k, v, cu_seqlens_q, cu_seqlens_k, *args, **kwargs, _key_slice=lambda a, b: (a, b + 1))



class _VarlenBackwardAcrossSequences(torch.autograd.Function):
    """Forward: the correct varlen kernel. Backward: the gradient of one attention over the whole packed batch, as
    a backward that forgets cu_seqlens does: each sequence's gradients leak into its neighbours'."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, options):
        ctx.save_for_backward(q, k, v)
        ctx.scale = options.get("softmax_scale")
        return varlen_base(q, k, v, cu_q, cu_k, 0, 0, **options)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v = ctx.saved_tensors
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            out = flash_base(*(t[None] for t in leaves), softmax_scale=ctx.scale)[0]
            grads = torch.autograd.grad(out, leaves, grad_out, allow_unused=True)
        return (*grads, None, None, None)


def varlen_backward_across_sequences(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **options):
    return _VarlenBackwardAcrossSequences.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, options)

def varlen_alibi_row0(q, k, v, cu_seqlens_q, cu_seqlens_k, *args, **kwargs):
    return varlen_base(q, k, v, cu_seqlens_q, cu_seqlens_k, *args, **kwargs, _row=lambda index: 0)


def _packed(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window_size, softcap, alibi_slopes, allowed_fn):
    """One masked problem over the packed axes; ``allowed_fn(qi, ki, q_id, k_id, q_pos, k_pos, offset)``."""
    total_q, h, e = q.shape
    total_k = k.shape[0]
    if total_q == 0 or total_k == 0:
        return q.new_zeros(total_q, h, v.shape[-1])
    ct = _ct(q.dtype)

    def ids(cu, total):
        seq = torch.full((total,), -1, dtype=torch.long)
        pos = torch.zeros(total, dtype=torch.long)
        for index, (a, b) in enumerate(_bounds(cu)):
            seq[a:b], pos[a:b] = index, torch.arange(b - a)
        return seq.to(q.device), pos.to(q.device)

    q_id, q_pos = ids(cu_seqlens_q, total_q)
    k_id, k_pos = ids(cu_seqlens_k, total_k)
    lens_q = torch.tensor([b - a for a, b in _bounds(cu_seqlens_q)] + [0], device=q.device)
    lens_k = torch.tensor([b - a for a, b in _bounds(cu_seqlens_k)] + [0], device=q.device)
    offset = (lens_k[q_id] - lens_q[q_id])[:, None]
    allowed = allowed_fn(torch.arange(total_q, device=q.device)[:, None], torch.arange(total_k, device=q.device)[None, :],
                         q_id[:, None], k_id[None, :], q_pos[:, None], k_pos[None, :], offset)
    diag = q_pos[:, None] + offset
    scale = 1.0 / math.sqrt(e) if softmax_scale is None else softmax_scale
    s = flash_base.scores(q[None], flash_base.expand(k[None], h), scale, softcap, ct)[0]
    if alibi_slopes is not None:
        sl = alibi_slopes.to(device=q.device, dtype=ct)
        sl = sl.expand(len(lens_q) - 1, h)[q_id.clamp_min(0)]
        s = s - sl.T[:, :, None] * (diag - k_pos[None, :]).abs().to(ct)
    s = s.masked_fill(~allowed, -math.inf)
    w = flash_base.softmax(s)
    return torch.einsum("hls,shv->lhv", w, flash_base.expand(v[None], h)[0].to(ct)).to(q.dtype)


def _band(rows, cols, causal, window_size):
    left, right = window_size
    ok = torch.ones(torch.broadcast_shapes(rows.shape, cols.shape), dtype=torch.bool, device=rows.device)
    if causal:
        ok = ok & (cols <= rows)
    if right >= 0:
        ok = ok & (cols <= rows + right)
    if left >= 0:
        ok = ok & (cols >= rows - left)
    return ok


def varlen_causal_global_offset(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                deterministic=False, return_attn_probs=False):
    """Block-diagonal, but the causal/window diagonal is that of the whole packed matrix (offset total_k −
    total_q over packed indices), not each sequence's own."""
    global_offset = k.shape[0] - q.shape[0]

    def allowed(qi, ki, q_id, k_id, q_pos, k_pos, offset):
        return (q_id == k_id) & (q_id >= 0) & _band(qi + global_offset, ki, causal, tuple(window_size))
    return _packed(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window_size, softcap, alibi_slopes,
                   allowed)


def varlen_cross_sequence_leak(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                               softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                               deterministic=False, return_attn_probs=False):
    """Keys are bounded by the end of the query's sequence only: every earlier sequence's keys leak in (positions
    before the sequence's start count as admissible)."""
    def allowed(qi, ki, q_id, k_id, q_pos, k_pos, offset):
        own = (k_id <= q_id) & (k_id >= 0) & (q_id >= 0)
        rel = torch.where(k_id == q_id, k_pos, torch.full_like(k_pos * q_pos, -1))
        rows = q_pos + offset
        band = _band(rows, rel, causal, (-1, window_size[1]))
        if window_size[0] >= 0:
            band = band & ((rel >= rows - window_size[0]) | (k_id < q_id))
        return own & band
    return _packed(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window_size, softcap, alibi_slopes,
                   allowed)


# ------------------------------------------------------------------------------------------------- kvcache
class KVCacheBase:
    """A correct ``flash_attn_with_kvcache``: append in place, gather each entry's range, ``flash_base`` on it."""

    flash = flash_base

    def write_positions(self, seqlen, lnew):
        return range(seqlen, seqlen + lnew)

    def attended(self, leftpad, seqlen, lnew, capacity):
        return leftpad, seqlen + lnew

    def locate(self, index, row, p, block_table, block_size, max_blocks):
        if block_table is None:
            return row, p
        return int(block_table[index, p // block_size]), p % block_size

    def read_row(self, index, rows):
        return rows[index]

    def __call__(self, q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                 cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None, causal=False,
                 window_size=(-1, -1), softcap=0.0, rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                 return_softmax_lse=False):
        if rotary_cos is not None or return_softmax_lse:
            raise NotImplementedError("rotary and return_softmax_lse are not implemented")
        b = q.shape[0]
        block_size = k_cache.shape[1]
        max_blocks = 1 if block_table is None else block_table.shape[1]
        capacity = block_size * max_blocks
        if cache_seqlens is None:
            seqlens = [capacity] * b
        elif isinstance(cache_seqlens, int):
            seqlens = [cache_seqlens] * b
        else:
            seqlens = [int(x) for x in cache_seqlens.tolist()]
        pads = [0] * b if cache_leftpad is None else [int(x) for x in cache_leftpad.tolist()]
        rows = list(range(b)) if cache_batch_idx is None else [int(x) for x in cache_batch_idx.tolist()]
        lnew = 0 if k is None else k.shape[1]
        with torch.no_grad():
            for index in range(b):
                for t, p in enumerate(self.write_positions(seqlens[index], lnew)):
                    where = self.locate(index, rows[index], p, block_table, block_size, max_blocks)
                    k_cache[where], v_cache[where] = k[index, t], v[index, t]
        outs = []
        for index in range(b):
            start, end = self.attended(pads[index], seqlens[index], lnew, capacity)
            row = self.read_row(index, rows)
            where = [self.locate(index, row, p, block_table, block_size, max_blocks) for p in range(start, end)]
            ks = torch.stack([k_cache[w] for w in where]) if where else k_cache.new_zeros(0, *k_cache.shape[2:])
            vs = torch.stack([v_cache[w] for w in where]) if where else v_cache.new_zeros(0, *v_cache.shape[2:])
            slopes = alibi_slopes
            if slopes is not None and slopes.dim() == 2:
                slopes = slopes[index]
            outs.append(self.flash(q[index:index + 1], ks[None], vs[None], softmax_scale=softmax_scale, causal=causal,
                                   window_size=window_size, softcap=softcap, alibi_slopes=slopes))
        return torch.cat(outs)


kvcache_base = KVCacheBase()


class _SeqlensOffByOne(KVCacheBase):
    def attended(self, leftpad, seqlen, lnew, capacity):
        return leftpad, min(seqlen + lnew + 1, capacity)


class _StaleSlotsAttended(KVCacheBase):
    def attended(self, leftpad, seqlen, lnew, capacity):
        return leftpad, capacity


class _AppendOffByOne(KVCacheBase):
    def write_positions(self, seqlen, lnew):     # cache_seqlens read as the index of the last filled slot
        return range(max(seqlen - 1, 0), max(seqlen - 1, 0) + lnew)

    def attended(self, leftpad, seqlen, lnew, capacity):
        return leftpad, max(seqlen - 1, 0) + lnew if lnew else seqlen


class _PagedBlockTableIgnored(KVCacheBase):
    def locate(self, index, row, p, block_table, block_size, max_blocks):
        if block_table is None:
            return row, p
        return index * max_blocks + p // block_size, p % block_size


class _BatchIdxIgnoredOnRead(KVCacheBase):
    def read_row(self, index, rows):
        return index


class _LeftpadIgnored(KVCacheBase):
    def attended(self, leftpad, seqlen, lnew, capacity):
        return 0, seqlen + lnew


class _DecodeCausalTopLeft(KVCacheBase):
    flash = causal_top_left


kvcache_seqlens_off_by_one = _SeqlensOffByOne()
kvcache_stale_slots_attended = _StaleSlotsAttended()
kvcache_append_off_by_one = _AppendOffByOne()
kvcache_paged_block_table_ignored = _PagedBlockTableIgnored()
kvcache_batch_idx_ignored_on_read = _BatchIdxIgnoredOnRead()
kvcache_leftpad_ignored = _LeftpadIgnored()
kvcache_causal_top_left = _DecodeCausalTopLeft()


# name -> (API, mechanism, expected clauses)
BUGS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "window_left_off_by_one": ("flash", "left window edge exclusive: j >= i + o - left + 1",
                               ("WINDOW-BOUNDS", "FLASH-ORACLE")),
    "window_right_off_by_one": ("flash", "right window edge one too far: j <= i + o + right + 1 (transformers #39408)",
                                ("WINDOW-BOUNDS", "FLASH-ORACLE")),
    "window_sides_swapped": ("flash", "window_size read as (right, left)", ("WINDOW-BOUNDS", "FLASH-ORACLE")),
    "window_top_left": ("flash", "window band aligned top-left (i - left <= j <= i + right), not at i + Lk - Lq",
                        ("WINDOW-BOUNDS", "FLASH-ORACLE")),
    "causal_top_left": ("flash", "causal mask tril(ones(Lq, Lk)) (PyTorch's top-left), not bottom-right",
                        ("CAUSAL-BOTTOM-RIGHT", "FLASH-ORACLE", "FLASH-FULLY-MASKED")),
    "softcap_after_mask": ("flash", "the cap applied after masking: c*tanh(-inf) = -c gives masked keys weight",
                           ("SOFTCAP-RANGE", "SOFTCAP-FORMULA", "FLASH-ORACLE")),
    "softcap_before_scale": ("flash", "c*tanh(q.k / c) * scale: the cap taken on the unscaled product",
                             ("SOFTCAP-FORMULA", "FLASH-ORACLE", "FLASH-SCALE")),
    "softcap_after_alibi": ("flash", "the cap applied to score + ALiBi bias instead of before the bias",
                            ("SOFTCAP-FORMULA", "ALIBI-BIAS", "FLASH-ORACLE")),
    "alibi_sign_flipped": ("flash", "+slope*|i + o - j|: far keys favoured", ("ALIBI-BIAS", "FLASH-ORACLE")),
    "alibi_distance_top_left": ("flash", "ALiBi distance |i - j| without the bottom-right offset Lk - Lq",
                                ("ALIBI-BIAS", "FLASH-ORACLE")),
    "alibi_without_abs": ("flash", "ALiBi bias -slope*(i + o - j) without the absolute value: later keys rewarded",
                          ("ALIBI-BIAS", "FLASH-ORACLE")),
    "alibi_batch_row_ignored": ("flash", "(B, H) slopes: row 0 used for every batch entry",
                                ("ALIBI-BIAS", "FLASH-ORACLE", "FLASH-SLICE-INDEPENDENT")),
    "gqa_heads_tiled_flash": ("flash", "kv heads expanded with repeat (head h reads h mod Hkv), not h // (H/Hkv)",
                              ("FLASH-GQA", "FLASH-ORACLE")),
    "fully_masked_rows_nan_flash": ("flash", "plain softmax over a row with no admissible key: NaN instead of 0",
                                    ("FLASH-FULLY-MASKED", "CAUSAL-BOTTOM-RIGHT", "FLASH-ORACLE")),
    "softcap_backward_as_uncapped": ("flash", "exact forward; the backward omits the cap's slope 1 - tanh^2",
                                     ("FLASH-GRAD",)),
    "backward_without_window": ("flash", "exact forward; the backward recomputes the weights without window and ALiBi",
                                ("FLASH-GRAD", "FLASH-GRAD-MASKED")),
    "varlen_reads_one_key_past_the_end": ("flash-varlen", "sequence b's keys sliced k[cu_k[b] : cu_k[b+1] + 1]: "
                                          "the next sequence's first key leaks in",
                                          ("VARLEN-EQUALS-PADDED", "VARLEN-INDEPENDENT")),
    "varlen_cross_sequence_leak": ("flash-varlen", "keys bounded by the end of the query's sequence only: earlier "
                                   "sequences leak in", ("VARLEN-INDEPENDENT", "VARLEN-EQUALS-PADDED")),
    "varlen_causal_global_offset": ("flash-varlen", "causal/window diagonal of the packed matrix (total_k - total_q), "
                                    "not each sequence's Lk_b - Lq_b", ("VARLEN-EQUALS-PADDED",)),
    "varlen_backward_across_sequences": ("flash-varlen", "exact forward; the backward differentiates one attention "
                                         "over the whole packed batch", ("VARLEN-GRAD",)),
    "varlen_alibi_row0": ("flash-varlen", "(B, H) slopes: row 0 used for every sequence", ("VARLEN-EQUALS-PADDED",)),
    "kvcache_seqlens_off_by_one": ("flash-kvcache", "attends cache_seqlens + Lnew + 1 positions: one stale slot",
                                   ("KVCACHE-EQUALS-FULL", "KVCACHE-PAGED-EQUALS-CONTIGUOUS", "KVCACHE-BATCH-IDX",
                                    "KVCACHE-LEFTPAD")),
    "kvcache_stale_slots_attended": ("flash-kvcache", "cache_seqlens ignored when attending: the whole cache is read",
                                     ("KVCACHE-EQUALS-FULL", "KVCACHE-PAGED-EQUALS-CONTIGUOUS", "KVCACHE-BATCH-IDX",
                                      "KVCACHE-LEFTPAD")),
    "kvcache_append_off_by_one": ("flash-kvcache", "new keys written from cache_seqlens - 1: the last cached key is "
                                  "overwritten", ("KVCACHE-APPEND", "KVCACHE-EQUALS-FULL")),
    "kvcache_paged_block_table_ignored": ("flash-kvcache", "paged position p read from block b*max_blocks + p//size "
                                          "(the table assumed to be the identity)",
                                          ("KVCACHE-PAGED-EQUALS-CONTIGUOUS", "KVCACHE-APPEND")),
    "kvcache_batch_idx_ignored_on_read": ("flash-kvcache", "appends to row cache_batch_idx[b] but attends row b",
                                          ("KVCACHE-BATCH-IDX",)),
    "kvcache_leftpad_ignored": ("flash-kvcache", "cache_leftpad ignored: the pad slots are attended",
                                ("KVCACHE-LEFTPAD",)),
    "kvcache_causal_top_left": ("flash-kvcache", "decode causal mask aligned to the cache start (j <= i), not its end",
                                ("KVCACHE-EQUALS-FULL", "KVCACHE-PAGED-EQUALS-CONTIGUOUS", "KVCACHE-BATCH-IDX",
                                 "KVCACHE-LEFTPAD")),
}
