"""The side-by-side baseline for the FlashAttention-API bugs: flash-attn's own example-based tests
(``tests/test_flash_attn.py``: ``test_flash_attn_output``, ``test_flash_attn_varlen_output``,
``test_flash_attn_kvcache``), reduced to sizes a CPU runs in seconds and run on any kernel with that API.

As flash-attn tests: a fixed grid of standard-normal inputs from ``torch.random.manual_seed(0)`` — (seqlen_q,
seqlen_k) × d × causal × local (a window ``torch.randint(0, seqlen_k, (2,))``) × softcap {0, 50} × ALiBi (slopes
``torch.rand(batch, nheads) * 0.3``) × {MHA, GQA} × {float16, bfloat16}; the reference ``attention_ref`` computed
upcast (float64 here) and naively in the input dtype; the tolerance 2·|out_pt − out_ref| + fwd_atol
(``properties/catalog/example_based.py``), for dq, dk, dv too when the output requires grad. Varlen: random
sequence lengths (``generate_random_padding_mask``'s "random" mode) compared sequence by sequence with the padded
reference; kvcache: random ``cache_seqlens``, new keys appended, plain or paged (a random block table) or with
``cache_batch_idx`` or ``cache_leftpad``, output and the updated cache compared (the cache exactly, as flash-attn does).

    python -m properties.catalog.flash_example_based --kernel properties.catalog.flash_bugs:window_left_off_by_one
"""
from __future__ import annotations

import itertools
import math
import sys
import time
from dataclasses import dataclass, field

import torch

from zoo.runtime.plugins import load_object

__all__ = ["Result", "attention_ref", "run", "main"]

SEQLENS = ((1, 1), (3, 7), (7, 3), (16, 16), (19, 33))
DS = (8, 17)
DTYPES = (torch.float16, torch.bfloat16)
BATCH, HEADS, KV_HEADS = 2, 4, {"mha": 4, "gqa": 2}


@dataclass
class Result:
    cases: int = 0
    failures: list[str] = field(default_factory=list)
    first_failure_s: float | None = None

    @property
    def caught(self) -> bool:
        return bool(self.failures)


def attention_ref(q, k, v, causal=False, window=(-1, -1), softcap=0.0, alibi=None, upcast=True, reorder_ops=False):
    """flash-attn's ``attention_ref`` in the (B, L, H, D) layout: bottom-right causal/local mask, softcap on the
    scaled scores, ALiBi after it, rows with no key set to 0."""
    dtype_og = q.dtype
    if upcast:
        q, k, v = q.double(), k.double(), v.double()
    lq, lk, d = q.shape[1], k.shape[1], q.shape[-1]
    g = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
    if not reorder_ops:
        scores = torch.einsum("bthd,bshd->bhts", q / math.sqrt(d), k)
    else:
        scores = torch.einsum("bthd,bshd->bhts", q, k / math.sqrt(d))
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    row = torch.arange(lq, device=q.device)[:, None] + lk - lq
    col = torch.arange(lk, device=q.device)[None, :]
    if alibi is not None:
        scores = scores - alibi.to(scores.dtype)[:, :, None, None] * (row - col).abs().to(scores.dtype)
    left, right = (window[0], 0) if causal and window != (-1, -1) else window
    masked = torch.zeros(lq, lk, dtype=torch.bool, device=q.device)
    if causal:
        masked |= col > row
    if right >= 0:
        masked |= col > row + right
    if left >= 0:
        masked |= col < row - left
    scores = scores.masked_fill(masked, float("-inf"))
    attention = torch.softmax(scores, dim=-1).masked_fill(masked.all(-1, keepdim=True), 0.0)
    return torch.einsum("bhts,bshd->bthd", attention, v).to(dtype_og)


def _close(name, out, ref, pt) -> str | None:
    atol = 2 * (ref + 0.3 - 0.3 - ref).abs().max().item()
    err, limit = (out.double() - ref.double()).abs().max().item(), 2 * (pt.double() - ref.double()).abs().max().item()
    return None if err <= limit + atol else f"max |{name} - {name}_ref| = {err:.3g} > {limit + atol:.3g}"


def _flash_case(fn, lq, lk, d, causal, local, softcap, alibi, dtype, mha, device):
    torch.random.manual_seed(0)
    q = torch.randn(BATCH, lq, HEADS, d, device=device, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(BATCH, lk, KV_HEADS[mha], d, device=device, dtype=dtype, requires_grad=True) for _ in "kv")
    window = tuple(torch.randint(0, lk, (2,)).tolist()) if local else (-1, -1)
    slopes = torch.rand(BATCH, HEADS, device=device) * 0.3 if alibi else None
    kw = {"causal": causal, "window_size": window, "softcap": softcap, "alibi_slopes": slopes}
    out = fn(q, k, v, **kw)
    out = out[0] if isinstance(out, tuple) else out
    ref = attention_ref(q, k, v, causal, window, softcap, slopes)
    pt = attention_ref(q, k, v, causal, window, softcap, slopes, upcast=False, reorder_ops=True)
    problem = _close("out", out, ref, pt)
    if problem or not out.requires_grad:
        return problem
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    refs, pts = torch.autograd.grad(ref, (q, k, v), g), torch.autograd.grad(pt, (q, k, v), g)
    for name, a, b, c in zip(("dq", "dk", "dv"), grads, refs, pts):
        problem = _close(name, a, b, c)
        if problem:
            return problem
    return None


def _varlen_case(fn, lq, lk, d, causal, local, softcap, alibi, dtype, mha, device):
    torch.random.manual_seed(0)
    lens_q = torch.randint(max(1, lq - 20), lq + 1, (BATCH,)).tolist()
    lens_k = torch.randint(max(1, lk - 20), lk + 1, (BATCH,)).tolist()
    q = torch.randn(sum(lens_q), HEADS, d, device=device, dtype=dtype)
    k, v = (torch.randn(sum(lens_k), KV_HEADS[mha], d, device=device, dtype=dtype) for _ in "kv")
    window = tuple(torch.randint(0, lk, (2,)).tolist()) if local else (-1, -1)
    slopes = torch.rand(BATCH, HEADS, device=device) * 0.3 if alibi else None
    cu = lambda lens: torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=device)  # noqa: E731
    out = fn(q, k, v, cu(lens_q), cu(lens_k), max(lens_q), max(lens_k), causal=causal, window_size=window,
             softcap=softcap, alibi_slopes=slopes)
    out = out[0] if isinstance(out, tuple) else out
    oq = ok = 0
    for b, (n, m) in enumerate(zip(lens_q, lens_k)):
        args = (q[None, oq:oq + n], k[None, ok:ok + m], v[None, ok:ok + m], causal, window, softcap,
                None if slopes is None else slopes[b:b + 1])
        problem = _close("out", out[None, oq:oq + n], attention_ref(*args),
                         attention_ref(*args, upcast=False, reorder_ops=True))
        if problem:
            return f"sequence {b}: {problem}"
        oq, ok = oq + n, ok + m
    return None


def _kvcache_case(fn, lq, lk, d, causal, local, softcap, alibi, dtype, mha, device, layout):
    torch.random.manual_seed(0)
    lnew = min(lq, lk)
    hkv = KV_HEADS[mha]
    q = torch.randn(BATCH, lq, HEADS, d, device=device, dtype=dtype)
    k_new, v_new = (torch.randn(BATCH, lnew, hkv, d, device=device, dtype=dtype) for _ in "kv")
    l_cache = lk + lnew
    k_logical, v_logical = (torch.randn(BATCH, l_cache, hkv, d, device=device, dtype=dtype) for _ in "kv")
    seqlens = torch.randint(0, lk + 1, (BATCH,), dtype=torch.int32, device=device)
    window = tuple(torch.randint(0, lk + lnew, (2,)).tolist()) if local else (-1, -1)
    slopes = torch.rand(BATCH, HEADS, device=device) * 0.3 if alibi else None
    kw = {"cache_seqlens": seqlens, "causal": causal, "window_size": window, "softcap": softcap,
          "alibi_slopes": slopes}
    if layout == "paged":
        bs = 2 if l_cache % 2 == 0 else 1
        n_blocks = BATCH * l_cache // bs
        table = torch.randperm(n_blocks, dtype=torch.int32, device=device).reshape(BATCH, -1)
        k_cache, v_cache = (torch.empty(n_blocks, bs, hkv, d, device=device, dtype=dtype) for _ in "kv")
        k_cache[table.long().flatten()] = k_logical.reshape(-1, bs, hkv, d)
        v_cache[table.long().flatten()] = v_logical.reshape(-1, bs, hkv, d)
        kw["block_table"] = table
        read = lambda c: c[table.long()].reshape(BATCH, l_cache, hkv, d)  # noqa: E731
    elif layout == "leftpad":
        k_cache, v_cache = k_logical.clone(), v_logical.clone()
        pads = torch.cat([torch.randint(0, int(s) + 1, (1,)) for s in seqlens]).to(torch.int32).to(device)
        kw["cache_leftpad"] = pads
        read = lambda c: c  # noqa: E731
    elif layout == "batch_idx":
        idx = torch.randperm(BATCH + 1, dtype=torch.int32, device=device)[:BATCH]
        k_cache, v_cache = (torch.randn(BATCH + 1, l_cache, hkv, d, device=device, dtype=dtype) for _ in "kv")
        k_cache[idx.long()], v_cache[idx.long()] = k_logical, v_logical
        kw["cache_batch_idx"] = idx
        read = lambda c: c[idx.long()]  # noqa: E731
    else:
        k_cache, v_cache = k_logical.clone(), v_logical.clone()
        read = lambda c: c  # noqa: E731
    out = fn(q, k_cache, v_cache, k_new, v_new, **kw)
    out = out[0] if isinstance(out, tuple) else out
    k_ref, v_ref = k_logical.clone(), v_logical.clone()
    for b in range(BATCH):
        s, p = int(seqlens[b]), int(kw["cache_leftpad"][b]) if "cache_leftpad" in kw else 0
        k_ref[b, s:s + lnew], v_ref[b, s:s + lnew] = k_new[b], v_new[b]
        args = (q[b:b + 1], k_ref[b:b + 1, p:s + lnew], v_ref[b:b + 1, p:s + lnew], causal, window, softcap,
                None if slopes is None else slopes[b:b + 1])
        problem = _close("out", out[b:b + 1], attention_ref(*args), attention_ref(*args, upcast=False, reorder_ops=True))
        if problem:
            return f"entry {b}: {problem}"
    for name, cache, ref in (("k_cache", k_cache, k_ref), ("v_cache", v_cache, v_ref)):
        if not torch.equal(read(cache), ref):
            return f"{name} after the call differs from the reference update"
    return None


GRID = list(itertools.product(SEQLENS, DS, (False, True), (False, True), (0.0, 50.0), (False, True), DTYPES,
                              KV_HEADS))


def run(spec, api: str = "flash", name: str | None = None, *, device: str = "cpu", stop_first: bool = False) -> Result:
    """The grid for ``api`` on the kernel ``spec`` (an import path or a callable)."""
    fn = load_object(spec) if isinstance(spec, str) else spec
    result, start = Result(), time.perf_counter()
    layouts = ("plain", "paged", "batch_idx", "leftpad") if api == "flash-kvcache" else (None,)
    for ((lq, lk), d, causal, local, softcap, alibi, dtype, mha), layout in itertools.product(GRID, layouts):
        if api == "flash-kvcache" and softcap > 0:
            continue       # flash-attn's kvcache test does not vary softcap
        result.cases += 1
        args = (fn, lq, lk, d, causal, local, softcap, alibi, dtype, mha, device)
        try:
            if api == "flash":
                problem = _flash_case(*args)
            elif api == "flash-varlen":
                problem = _varlen_case(*args)
            else:
                problem = _kvcache_case(*args, layout)
        except NotImplementedError:
            result.cases -= 1
            continue
        except Exception as exc:  # a crash is a failure of the test too
            problem = f"raised {type(exc).__name__}: {exc}"
        if problem:
            if result.first_failure_s is None:
                result.first_failure_s = time.perf_counter() - start
            result.failures.append(f"(seqlen_q={lq}, seqlen_k={lk}, d={d}, causal={causal}, local={local}, "
                                   f"softcap={softcap}, alibi={alibi}, {str(dtype).removeprefix('torch.')}, {mha}"
                                   f"{'' if layout in (None, 'plain') else ', ' + layout}): {problem}")
            if stop_first:
                break
    return result


def main(argv=None) -> int:
    from zoo.cli.arguments import Parser, device_problem
    parser = Parser(prog="python -m properties.catalog.flash_example_based", description=__doc__.splitlines()[0])
    parser.add_argument("--kernel", required=True)
    parser.add_argument("--kernel-api", default="flash", choices=("flash", "flash-varlen", "flash-kvcache"))
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    problem = device_problem(args.device)   # else every case fails, blamed on the kernel
    if problem:
        parser.error(f"--device {args.device}: {problem}")
    from zoo.runtime.plugins import PluginError
    from zoo.nn.flash import resolve_flash_kernel
    try:
        kernel = resolve_flash_kernel(args.kernel, args.kernel_api)
    except PluginError as exc:
        parser.error(f"--kernel (--kernel-api {args.kernel_api}): {exc}")
    result = run(kernel, args.kernel_api, args.kernel, device=args.device)
    print(f"{result.cases} cases, {len(result.failures)} failed" + "".join(f"\n  {f}" for f in result.failures[:5]))
    return 1 if result.failures else 0


if __name__ == "__main__":
    sys.exit(main())
