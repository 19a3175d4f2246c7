"""The comparison baseline: an example-based kernel test in the style of FlashAttention's
``tests/test_flash_attn.py`` (``test_flash_attn_output``), adapted to the SDPA contract.

A fixed grid — (batch, heads, seqlen_q, seqlen_k, d) × causal × dtype × {MHA, GQA} — of standard-normal
inputs from ``torch.random.manual_seed(0)``, each output compared with a reference at FlashAttention's
tolerance (FlashAttention 3's ``hopper/test_flash_attn.py``)::

    out_ref = attention_ref(q, k, v, causal)    # computed upcast (float64 here, FA: float32), in the input dtype
    out_pt  = attention_ref(q, k, v, causal, upcast=False, reorder_ops=True)   # naive, in the input dtype
    fwd_atol = 2 * (out_ref + 0.3 - 0.3 - out_ref).abs().max()
    assert (out - out_ref).abs().max() <= 2 * (out_pt - out_ref).abs().max() + fwd_atol
    # and, as FA's test does, for dq, dk, dv of one random upstream gradient (atol built the same way)

A kernel whose output does not require grad gets the forward half only. The gradient half raises false alarms
on correct kernels: where the naive computation's gradient is exact (seqlen_k = 1 gives dq = 0 exactly, so
atol = 0), any rounding in the kernel's dq fails it (torch's SDPA on CPU), and a tiled kernel's dk can exceed
twice the naive error (the catalog's correct flash_attention); ``run(..., gradients=False)`` is the forward
half alone.

As in FlashAttention's test: no masks beyond causal, no explicit scale, no dropout (FA checks dropout through
the returned dropout mask, which an SDPA-signature kernel does not return), no adversarial magnitudes, and the
output compared by value (its dtype is not checked). The causal diagonal is top-left (PyTorch's contract;
FlashAttention ≥ 2.1 tests bottom-right). It applies to kernels only: the module and model levels have no
established example-based counterpart with a numeric reference.

    python -m properties.catalog.example_based --kernel properties.catalog.kernels:scale_missing
"""
from __future__ import annotations

import itertools
import math
import sys
import time
from dataclasses import dataclass, field

import torch

__all__ = ["GRID", "Case", "Result", "attention_ref", "check_case", "run", "main"]

BATCH, HEADS = 2, 4
DS = (8, 17, 32)
SEQLENS = ((1, 1), (3, 7), (7, 3), (16, 16), (19, 33), (33, 19), (64, 64))
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MHA_TYPES = {"mha": HEADS, "gqa": 2}


@dataclass(frozen=True)
class Case:
    seqlen_q: int
    seqlen_k: int
    d: int
    causal: bool
    dtype: torch.dtype
    mha_type: str

    def __str__(self) -> str:
        return (f"(batch={BATCH}, heads={HEADS}, kv_heads={MHA_TYPES[self.mha_type]}, seqlen_q={self.seqlen_q}, "
                f"seqlen_k={self.seqlen_k}, d={self.d}, causal={self.causal}, {str(self.dtype).removeprefix('torch.')})")


GRID = [Case(lq, lk, d, causal, dtype, mha) for (lq, lk), d, causal, dtype, mha
        in itertools.product(SEQLENS, DS, (False, True), DTYPES, MHA_TYPES)]


def attention_ref(q, k, v, causal=False, upcast=True, reorder_ops=False):
    """FlashAttention's ``attention_ref``: (B, H, L, d) layout, kv heads repeated, top-left causal mask."""
    dtype_og = q.dtype
    if upcast:
        q, k, v = q.double(), k.double(), v.double()
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    d = q.shape[-1]
    if not reorder_ops:
        scores = (q / math.sqrt(d)) @ k.transpose(-1, -2)
    else:
        scores = q @ (k / math.sqrt(d)).transpose(-1, -2)
    if causal:
        allowed = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~allowed, float("-inf"))
    attention = torch.softmax(scores, dim=-1)
    return (attention @ v).to(dtype_og)


def check_case(kernel, case: Case, gradients: bool = True) -> str | None:
    """None if the kernel passes the case, else the failure (as pytest would show it); ``gradients``: FA's
    gradient half too."""
    torch.random.manual_seed(0)
    kv_heads = MHA_TYPES[case.mha_type]
    q = torch.randn(BATCH, HEADS, case.seqlen_q, case.d, dtype=case.dtype)
    k = torch.randn(BATCH, kv_heads, case.seqlen_k, case.d, dtype=case.dtype)
    v = torch.randn(BATCH, kv_heads, case.seqlen_k, case.d, dtype=case.dtype)
    kwargs = {"is_causal": True} if case.causal else {}
    if kv_heads != HEADS:
        kwargs["enable_gqa"] = True
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    try:
        out = kernel(q, k, v, **kwargs)
    except Exception as exc:  # an exception fails the test, as in pytest
        return f"{case}: raised {type(exc).__name__}: {exc}"
    if not isinstance(out, torch.Tensor):   # FA's test would fail on it too: out.shape of a tuple raises
        return f"{case}: returned {type(out).__name__}, not a tensor (the SDPA signature returns the output alone)"
    out_ref = attention_ref(q, k, v, case.causal)   # computed in float64, rounded to the input dtype (as FA)
    out_pt = attention_ref(q, k, v, case.causal, upcast=False, reorder_ops=True)
    fwd_atol = 2 * (out_ref + 0.3 - 0.3 - out_ref).abs().max().item()
    if tuple(out.shape) != tuple(out_ref.shape):
        return f"{case}: output shape {tuple(out.shape)} != {tuple(out_ref.shape)}"
    error = (out.double() - out_ref.double()).abs().max().item()
    allowed = 2 * (out_pt.double() - out_ref.double()).abs().max().item() + fwd_atol
    if not error <= allowed:  # NaN fails
        return f"{case}: max |out - out_ref| = {error:.3g} > 2 * max |out_pt - out_ref| + fwd_atol = {allowed:.3g}"
    if not gradients or not out.requires_grad:
        return None   # no autograd: FA's test would not reach its gradient half
    # FA's gradient half: one random upstream gradient, each of dq, dk, dv within 2x the naive error (+ atol)
    g = torch.randn_like(out)
    try:
        grads = torch.autograd.grad(out, (q, k, v), g)
    except Exception as exc:
        return f"{case}: backward raised {type(exc).__name__}: {exc}"
    grads_ref = torch.autograd.grad(out_ref, (q, k, v), g)
    grads_pt = torch.autograd.grad(out_pt, (q, k, v), g)
    for name, d, d_ref, d_pt in zip(("dq", "dk", "dv"), grads, grads_ref, grads_pt):
        atol = 2 * (d_ref + 0.3 - 0.3 - d_ref).abs().max().item()
        error = (d.double() - d_ref.double()).abs().max().item()
        allowed = 2 * (d_pt.double() - d_ref.double()).abs().max().item() + atol
        if not error <= allowed:
            return f"{case}: max |{name} - {name}_ref| = {error:.3g} > 2 * max |{name}_pt - {name}_ref| + atol = {allowed:.3g}"
    return None


@dataclass
class Result:
    kernel: str
    cases: int = 0
    failures: list[str] = field(default_factory=list)
    time_s: float = 0.0
    first_failure_s: float | None = None

    @property
    def caught(self) -> bool:
        return bool(self.failures)


def run(kernel, name: str = "", *, stop_first: bool = False, gradients: bool = True) -> Result:
    """Every case of the grid on ``kernel`` (a callable or a spec for ``zoo.nn.kernel.resolve_kernel``)."""
    if isinstance(kernel, str):
        from zoo.nn.kernel import resolve_kernel
        name, kernel = name or kernel, resolve_kernel(kernel)
    result = Result(name)
    start = time.perf_counter()
    for case in GRID:
        result.cases += 1
        failure = check_case(kernel, case, gradients)
        if failure is not None:
            result.failures.append(failure)
            if result.first_failure_s is None:
                result.first_failure_s = time.perf_counter() - start
            if stop_first:
                break
    result.time_s = time.perf_counter() - start
    return result


def main(argv=None) -> int:
    from zoo.cli.arguments import Parser
    parser = Parser(prog="python -m properties.catalog.example_based", description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernel", action="append", required=True, help="kernel spec (repeatable)")
    parser.add_argument("-x", "--stop-first", action="store_true", help="stop a kernel at its first failing case")
    args = parser.parse_args(argv)
    from zoo.runtime.plugins import PluginError
    from zoo.nn.kernel import resolve_kernel
    kernels = {}
    for spec in args.kernel:   # every kernel resolved before the first is run
        try:
            kernels[spec] = resolve_kernel(spec)
        except PluginError as exc:
            parser.error(f"--kernel: {exc}")
    torch.set_num_threads(1)
    status = 0
    for spec in args.kernel:
        result = run(kernels[spec], spec, stop_first=args.stop_first)
        print(f"{spec}: {result.cases - len(result.failures)}/{result.cases} cases passed in {result.time_s:.1f} s")
        for failure in result.failures[:5]:
            print(f"  FAILED {failure}")
        status |= result.caught
    return status


if __name__ == "__main__":
    sys.exit(main())
