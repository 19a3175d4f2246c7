"""The bodies of the kernel clauses' reproducers whose comparison the SDPA oracle, two calls or the statistical
bodies of properties/repro/kernel.py cannot express (SPEC.md, "Reproducers"): ``shifted`` (ATTN-SHIFT-INVARIANT:
the call with a row-constant mask against the oracle without it), ``rowsum`` (weights read through V = I summing to
1: MASK-LOW-PRECISION, ATTN-LARGE-SCORES), ``group-sum`` (ATTN-GRAD-GQA: dK, dV of the shared heads against the
group sums of the repeated heads), ``dropout-independent`` (DROPOUT-INDEPENDENT's two Hoeffding tests over the same
copies), ``integrity`` (ATTN-INPUTS-UNCHANGED, ATTN-OUTPUT-FRESH: the inputs bitwise unchanged by the forward and
backward, outputs sharing no storage, a second call on the same tensors written in place), and for a kernel with
FlashAttention's API ``flash-oracle`` (its output, or its weights through identity columns, against
flash_attn_func's semantics in float64), ``flash-varlen`` (each packed sequence against that oracle of its own
slices), ``flash-kvcache`` (each batch entry against it over the keys the entry may see, and the caches after the
call) and ``flash-gradient`` (dQ, dK, dV through that oracle's autograd; packed sequences too). Each body follows the
header of properties/repro/kernel.py (``subject``, ``DATA``, ``on_device``, ``oracle``, ``verdict``, ``worst``,
``stacked_copies``, ``hoeffding_halfwidth``, ``FALSE_ALARM``) and is a ``str.format`` template: doubled braces are
the script's own."""
from __future__ import annotations

import textwrap

__all__ = ["BODIES"]

_FLASH_ORACLE = '''
def flash_call(q, k, v, kwargs):
    out = subject(q, k, v, **kwargs)
    return out[0] if isinstance(out, (tuple, list)) else out   # flash_attn_func: (out, softmax_lse, ...)


def flash_oracle(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None):
    """flash_attn_func in float64: q (B, Lq, H, D), k, v (B, Lk, Hkv, D); query head h reads key head h // (H/Hkv);
    with o = Lk - Lq, query i attends key j iff j <= i + o (causal) and i + o - left <= j <= i + o + right (window,
    -1: unbounded); score c*tanh(s/c) (softcap), then minus slope*|i + o - j| (ALiBi); no admissible key: 0.
    Returns (out (B, Lq, H, Dv), weights (B, H, Lq, Lk))."""
    q, k, v = (t.double().cpu().transpose(1, 2) for t in (q, k, v))   # heads first; no detach (gradients)
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    i, j = torch.arange(q.shape[2])[:, None] + k.shape[2] - q.shape[2], torch.arange(k.shape[2])[None, :]
    scores = q @ k.transpose(-1, -2) * (1 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale)
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    if alibi_slopes is not None:
        slopes = alibi_slopes.double().cpu().expand(q.shape[0], q.shape[1])
        scores = scores - slopes[..., None, None] * (i - j).abs()
    left, right = window_size
    allowed = ((j <= i) | (not causal)) & ((j <= i + right) | (right < 0)) & ((j >= i - left) | (left < 0))
    scores = scores.masked_fill(~allowed, -math.inf)
    top = scores.amax(-1, keepdim=True)
    weights = (scores - torch.where(torch.isinf(top), torch.zeros_like(top), top)).exp()
    weights = weights / weights.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny)
    return (weights @ v).transpose(1, 2), weights


q, k, v = (on_device(DATA[name]) for name in ("query", "key", "value"))
kwargs = {{name: tuple(x) if isinstance(x, list) else on_device(x) for name, x in DATA["kwargs"].items()}}
'''

_VARLEN_ORACLE = '''
args = [on_device(x) for x in DATA["args"]]   # cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k
flash_call = lambda q, k, v, kwargs: first(subject(q, k, v, *args, **kwargs))   # noqa: E731 (flash_attn_varlen_func)
first = lambda out: out[0] if isinstance(out, (tuple, list)) else out   # noqa: E731


def varlen_oracle(q, k, v):
    """The packed rows of every sequence: flash_oracle of its own slices (ALiBi (B, H): row b); no keys: 0."""
    cu_q, cu_k = DATA["args"][0].tolist(), DATA["args"][1].tolist()
    rows = []
    for b in range(len(cu_q) - 1):
        (q0, q1), (k0, k1) = cu_q[b:b + 2], cu_k[b:b + 2]
        alone = {{**kwargs}}
        if alone.get("alibi_slopes") is not None and alone["alibi_slopes"].dim() == 2:
            alone["alibi_slopes"] = alone["alibi_slopes"][b]
        rows.append(flash_oracle(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], **alone)[0][0] if k1 > k0 else
                    torch.zeros(q1 - q0, q.shape[1], v.shape[-1], dtype=torch.float64))
    return torch.cat(rows)
'''

BODIES = {
    "shifted": '''
inputs = {{name: on_device(x) for name, x in DATA["inputs"].items()}}
query, key, value, shift = (inputs.pop(name) for name in ("query", "key", "value", "attn_mask"))
out = subject(query, key, value, attn_mask=shift, **inputs).double().cpu()
expected, _ = oracle(query, key, value, **inputs)   # softmax is unchanged by a constant added to a row of scores
excess = torch.nan_to_num((out - expected).abs() - DATA["bound"], nan=math.inf)
verdict((excess > 0).any(), f"{{WHAT}} departs from {{REFERENCE}} by more than the bound of the masked call at "
        f"{{int((excess > 0).sum())}} of {{excess.numel()}} entries; worst " +
        worst(excess, (WHAT, out), ("oracle", expected), ("bound", DATA["bound"].expand_as(out))))
''',
    "rowsum": '''
inputs = {{name: on_device(x) for name, x in DATA["inputs"].items()}}
query, key = inputs.pop("query"), inputs.pop("key")
eye = torch.eye(key.shape[-2], dtype=key.dtype, device=key.device).expand(*key.shape[:-1], key.shape[-2])
sums = subject(query, key, eye.contiguous(), **inputs).double().cpu().sum(-1)   # V = I: the output is the weights
excess = torch.nan_to_num((sums - 1).abs() - DATA["bound"], nan=math.inf)
verdict((excess > 0).any(), f"sum over keys of the weights departs from 1 by more than {{float(DATA['bound']):.3g}} "
        f"({{REFERENCE}}) at {{int((excess > 0).sum())}} of {{excess.numel()}} queries; worst " +
        worst(excess, ("sum", sums)))
''',
    "group-sum": '''
inputs = {{name: on_device(x) for name, x in DATA["inputs"].items()}}
query, key, value = (inputs.pop(name) for name in ("query", "key", "value"))


def key_value_gradients(key, value, **contract):
    leaves = [t.detach().requires_grad_() for t in (query, key, value)]
    out = subject(*leaves, **contract)
    return [g.double().cpu() for g in torch.autograd.grad(out, leaves, on_device(DATA["upstream"]))[1:]]


shared = key_value_gradients(key, value, **inputs)   # enable_gqa: H query heads share Hkv key/value heads
inputs.pop("enable_gqa", None)
group = query.shape[-3] // key.shape[-3]
per_head = key_value_gradients(*(t.repeat_interleave(group, dim=-3) for t in (key, value)), **inputs)
for name, grad, wide in zip(("key", "value"), shared, per_head):
    summed = wide.unflatten(-3, (grad.shape[-3], group)).sum(-3)   # each key/value head's group of query heads
    excess = torch.nan_to_num((grad - summed).abs() - DATA["bound"][name], nan=math.inf)
    if (excess > 0).any():
        verdict(True, f"d{{name}} of the shared heads departs from d{{name}} of the heads repeated, summed over each "
                f"group of {{group}}, at {{int((excess > 0).sum())}} of {{excess.numel()}} entries; worst " +
                worst(excess, (f"d{{name}}", grad), ("group sum", summed), ("bound", DATA["bound"][name])))
verdict(False, "")
''',
    "dropout-independent": '''
# Statistical: over the same copies, disjoint pairs of heads (0, 1), (2, 3), ... and of batch entries agree (both kept or
# both dropped) on a fraction p^2 + (1 - p)^2 of the weights positive without dropout, if the drops are independent;
# each of the two Hoeffding tests is at level {false_alarm:g} / 2, so a correct kernel fails with probability at
# most {false_alarm:g}.
n, p, seed, positive = DATA["copies"], DATA["p"], DATA["seed"], DATA["positive"]   # positive: (B, H, L, S)
query, key = on_device(DATA["query"]), on_device(DATA["key"])
eye = torch.eye(key.shape[-2], dtype=key.dtype, device=key.device).expand(*key.shape[:-1], key.shape[-2])
with torch.random.fork_rng(devices=[]):
    torch.manual_seed(seed)
    w = subject(*stacked_copies(n, query, key, eye.contiguous()), dropout_p=p).double().cpu()
kept = w.reshape(n, *positive.shape) != 0   # (copies, B, H, L, S)
agree = p ** 2 + (1 - p) ** 2
for axis, dim in (("heads", 2), ("batch entries", 1)):
    evens, odds = torch.arange(0, kept.shape[dim] - 1, 2), torch.arange(1, kept.shape[dim], 2)
    first, second = kept.index_select(dim, evens), kept.index_select(dim, odds)
    both = (positive.index_select(dim - 1, evens) & positive.index_select(dim - 1, odds)).expand_as(first)
    observed = float((first == second)[both].float().mean())
    halfwidth = hoeffding_halfwidth(int(both.sum()), 1.0, FALSE_ALARM / 2)
    if abs(observed - agree) > halfwidth:
        verdict(True, f"dropout p = {{p:.6g}}: {{axis}} agree on a fraction {{observed:.6g}} of {{int(both.sum())}} pairs "
                f"of weights, independent drops agree on p^2 + (1-p)^2 = {{agree:.6g}}: |difference| > {{halfwidth:.6g}} "
                f"(Hoeffding, false-alarm probability <= {false_alarm:g} / 2)")
verdict(False, "")
''',
    "integrity": '''
inputs = {{name: on_device(x) for name, x in DATA["inputs"].items()}}
query, key, value = (inputs.pop(name) for name in ("query", "key", "value"))
upstream = on_device(DATA.get("upstream"))
tensors = {{"query": query, "key": key, "value": value, "the upstream gradient": upstream,
           **{{name: t for name, t in inputs.items() if torch.is_tensor(t)}}}}
tensors = {{name: t for name, t in tensors.items() if t is not None}}
kept = {{name: t.detach().clone() for name, t in tensors.items()}}
same = lambda a, b: bool(((a == b) | (a.isnan() & b.isnan())).all())   # noqa: E731 (bitwise, NaN where NaN)
shares = lambda a, b: a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()   # noqa: E731


def check_unchanged(when):
    for name, t in tensors.items():
        if not same(t.detach(), kept[name]):
            verdict(True, f"{{name}} changed {{when}} at {{int((t.detach() != kept[name]).sum())}} of {{t.numel()}} entries")


def check_own(out, what, others):
    for name, t in others.items():
        if shares(out, t):
            verdict(True, f"{{what}} shares its storage with {{name}}")


if upstream is not None:   # inputs that require grad, then the backward
    for t in (query, key, value):
        t.requires_grad_()
first = subject(query, key, value, **inputs)
check_unchanged("by the kernel's forward")
check_own(first, "the output", tensors)
if upstream is not None:
    for name, grad in zip(("query", "key", "value"), torch.autograd.grad(first, (query, key, value), upstream)):
        check_unchanged("by the kernel's backward")
        check_own(grad, f"d{{name}}", {{**tensors, "the output": first}})
if "second" in DATA:   # the same tensors written in place with new values (a static KV cache is), called again
    before = first.detach().clone()
    with torch.no_grad():
        for t, new in zip((query, key, value), DATA["second"]):
            t.copy_(on_device(new))
    second = subject(query, key, value, **inputs)
    check_own(second, "the second call's output", {{"the first call's output": first}})
    if not same(first.detach(), before):
        verdict(True, "the first call's output changed during the second call (the kernel reuses an output buffer)")
    expected, no_key = oracle(query, key, value, alignment=DATA["alignment"], **inputs)
    actual = second.detach().double().cpu()
    if DATA["fully_masked"] != "zeros":   # --fully-masked: rows without an admissible key are not compared here
        actual = torch.where(no_key[..., None], expected, actual)
    excess = torch.nan_to_num((actual - expected).abs() - DATA["bound"], nan=math.inf)
    if (excess > 0).any():
        verdict(True, f"out of a second call, on the inputs written in place with new values, departs from the "
                f"float64 oracle by more than the bound; worst " + worst(excess, ("out", actual), ("oracle", expected)))
    kept_second = second.detach().clone()
    with torch.no_grad():
        first.detach().fill_(float("nan"))
    if not same(second.detach(), kept_second):
        verdict(True, "the second call's output changed when NaN was written into the first's")
verdict(False, "")
''',
    "flash-oracle": _FLASH_ORACLE + '''
if v is None:   # the clause read the weights: outputs for values that are columns of the identity, D at a time
    b, lk, kv_heads, d = k.shape
    columns = []
    for c0 in range(0, lk, d):
        width = min(d, lk - c0)
        eye = torch.zeros(lk, d, dtype=q.dtype, device=q.device)
        eye[c0:c0 + width, :width] = torch.eye(width, dtype=q.dtype, device=q.device)
        columns.append(flash_call(q, k, eye[None, :, None, :].expand(b, lk, kv_heads, d).contiguous(), kwargs)
                       .double().cpu()[..., :width])
    actual, expected = torch.cat(columns, dim=-1).permute(0, 2, 1, 3), flash_oracle(q, k, k, **kwargs)[1]
else:
    actual, expected = flash_call(q, k, v, kwargs).double().cpu(), flash_oracle(q, k, v, **kwargs)[0]
excess = torch.nan_to_num((actual - expected).abs() - DATA["bound"], nan=math.inf)
verdict((excess > 0).any(), f"{{WHAT}} departs from the float64 flash oracle by more than the bound at "
        f"{{int((excess > 0).sum())}} of {{excess.numel()}} entries; worst " +
        worst(excess, (WHAT, actual), ("oracle", expected), ("bound", DATA["bound"].expand_as(actual))))
''',
    "flash-varlen": _FLASH_ORACLE + _VARLEN_ORACLE + '''
actual, expected = flash_call(q, k, v, kwargs).double().cpu(), varlen_oracle(q, k, v)
excess = torch.nan_to_num((actual - expected).abs() - DATA["bound"], nan=math.inf)
verdict((excess > 0).any(), f"{{WHAT}} departs from the flash oracle of each sequence alone by more than the bound "
        f"at {{int((excess > 0).sum())}} of {{excess.numel()}} entries; worst (packed row, h, d) " +
        worst(excess, (WHAT, actual), ("oracle", expected), ("bound", DATA["bound"].expand_as(actual))))
''',
    "flash-kvcache": _FLASH_ORACLE + '''
caches = [k.clone(), v.clone()]   # flash_attn_with_kvcache writes the new keys and values into them
out = flash_call(q, caches[0], caches[1], kwargs).double().cpu()
alibi = kwargs.get("alibi_slopes")
options = {{name: x for name, x in kwargs.items() if name in ("softmax_scale", "causal", "window_size", "softcap")}}
# DATA["keys"][b], DATA["values"][b]: the keys entry b may see, as the run read them from the cache arguments: its
# cache row (through cache_batch_idx or the block_table) from cache_leftpad[b] to cache_seqlens[b], then the new k, v
for b, (keys, values, bound) in enumerate(zip(DATA["keys"], DATA["values"], DATA["bound"])):
    row = {{**options, **({{"alibi_slopes": alibi[b] if alibi.dim() == 2 else alibi}} if alibi is not None else {{}})}}
    expected = (flash_oracle(q[b:b + 1], keys, values, **row)[0][0] if keys.shape[1] else
                torch.zeros_like(out[b]))
    excess = torch.nan_to_num((out[b] - expected).abs() - bound, nan=math.inf)
    if (excess > 0).any():
        verdict(True, f"out of entry {{b}} departs from the flash oracle over the {{keys.shape[1]}} keys it may see at "
                f"{{int((excess > 0).sum())}} of {{excess.numel()}} entries; worst (i, h, d) " +
                worst(excess, ("out", out[b]), ("oracle", expected), ("bound", bound.expand_as(expected))))
for name, after, expected in zip(("k_cache", "v_cache"), caches, DATA["caches"]):
    differs = after.double().cpu() != expected
    if differs.any():
        verdict(True, f"{{name}} after the call differs from the cache with the new keys written at cache_seqlens[b] "
                f"and nothing else changed at {{int(differs.sum())}} entries; first at {{differs.nonzero()[0].tolist()}}")
verdict(False, "")
''',
    "flash-gradient": _FLASH_ORACLE + '''
if "args" in DATA:   # flash_attn_varlen_func: the sequences packed end to end, (total, H, D)
''' + textwrap.indent(_VARLEN_ORACLE, "    ") + '''
    oracle_out = varlen_oracle
else:
    oracle_out = lambda q, k, v: flash_oracle(q, k, v, **kwargs)[0]   # noqa: E731
leaves = [t.detach().requires_grad_() for t in (q, k, v)]
grads = torch.autograd.grad(flash_call(*leaves, kwargs), leaves, on_device(DATA["upstream"]))
leaves64 = [t.detach().double().cpu().requires_grad_() for t in (q, k, v)]
grads64 = torch.autograd.grad(oracle_out(*leaves64), leaves64, DATA["upstream"].double().cpu())
for name, grad, grad64 in zip(("query", "key", "value"), grads, grads64):   # compared heads first, (B, H, L, D)
    grad, grad64, bound = grad.double().cpu().transpose(-3, -2), grad64.transpose(-3, -2), DATA["bound"][name]
    excess = torch.nan_to_num((grad - grad64).abs() - bound, nan=math.inf)
    if (excess > 0).any():
        verdict(True, f"d{{name}} departs from the float64 chain rule by more than the bound at "
                f"{{int((excess > 0).sum())}} of {{excess.numel()}} entries; worst (b, h, position, d) " +
                worst(excess, (f"d{{name}}", grad), ("oracle", grad64), ("bound", bound.expand_as(grad64))))
verdict(False, "")
''',
}
