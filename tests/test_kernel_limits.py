"""Kernels with limits (properties/kernel/limits.py, coverage.py): what counts as a decline, learning a kernel's limits,
fitting pinned problems into them, reading weights through V = I in slices, the declared-limits options, and the
suite run on kernels that decline — a fused kernel's limits, a pre-2.5 signature without enable_gqa,
flex_attention, whose CPU forward declines inputs that require grad, and PyTorch's CUDA backends on the CPU.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from properties.catalog.sessions import run_pytest
from properties.core.declines import decline_reason
from properties.kernel.limits import Limits, LimitsError, declared_limits
from properties.kernel.cases import Case
from properties.kernel.guard import GuardedKernel, KernelContractError, KernelDeclined
from properties.kernel.test_gradients import GradCase

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve()


# ----------------------------------------------------------------------------------- kernels used below
def fused_like(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """A correct kernel with a fused kernel's limits (worded as flash-attn words them)."""
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise RuntimeError(f"FlashAttention only supports fp16 and bf16 data type, not {q.dtype}")
    if attn_mask is not None:
        raise NotImplementedError("attn_mask is not supported")
    if q.shape[-1] not in (16, 32, 64, 128):
        raise ValueError(f"head size {q.shape[-1]} is not supported (16, 32, 64, 128)")
    if q.shape[-2] != k.shape[-2]:
        raise NotImplementedError("L != S")
    if dropout_p:
        raise NotImplementedError("no dropout")
    return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)


def before_gqa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
    """PyTorch's SDPA signature before 2.5: no enable_gqa."""
    return F.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale=scale)


def value_head_equal(q, k, v, **kwargs):
    if v.shape[-1] != q.shape[-1]:
        raise NotImplementedError("only supports Ev == E")
    return F.scaled_dot_product_attention(q, k, v, **kwargs)


# ------------------------------------------------------------------------------------------- in process
@pytest.mark.parametrize("exc, declined", [
    (NotImplementedError("anything"), True),
    (RuntimeError("No available kernel. Aborting execution."), True),
    (RuntimeError("FlashAttention only supports Ampere GPUs or newer."), True),
    (ValueError("head dimension 80 is not supported"), True),
    (TypeError("Paged KV cache does not support cache_batch_idx"), True),
    (TypeError("attn() got an unexpected keyword argument 'enable_gqa'"), True),
    (TypeError("attn() got an unexpected keyword argument 'attn_mask'"), False),   # a required keyword
    (TypeError("unsupported operand type(s) for +: 'NoneType' and 'Tensor'"), False),   # a bug, worded by Python
    (IndexError("index 64 is out of bounds for dimension 0 with size 64"), False),
    (RuntimeError("CUDA error: an illegal memory access was encountered"), False),
    (ValueError("shape '[1, 2, 65, 64]' is invalid for input of size 8192"), False),
])
def test_what_counts_as_a_decline(exc, declined):
    assert (decline_reason(exc) is not None) is declined


def test_a_decline_is_a_rejected_example_and_teaches_the_limits():
    kernel = GuardedKernel("fused_like", fused_like)
    q = torch.randn(1, 2, 5, 3)
    with pytest.raises(KernelDeclined):   # float32, head size 3, L != S (inside a Hypothesis example: rejected)
        kernel(q, torch.randn(1, 2, 7, 3), torch.randn(1, 2, 7, 3))
    limits = kernel.limits("cpu")
    assert limits.learned and set(limits.dtypes) == {torch.float16, torch.bfloat16}
    assert limits.head_sizes == (16, 32, 64, 128) and limits.equal_lengths and limits.masks == ()
    assert limits.causal and limits.gqa and "L = S" in limits.reasons
    with pytest.raises(KernelContractError, match="IndexError"):   # not worded as a decline: a failure
        GuardedKernel("bad", lambda q, k, v: q[99])(q, q, q)


def test_pinned_problems_are_fitted_into_the_limits():
    limits = Limits(dtypes=(torch.float16,), head_sizes=(16, 64, 128), equal_lengths=True, equal_head_sizes=True,
                    ranks=(2,), strided=False, explicit_scale=False)
    case = limits.fit(Case(lead=(3,), l=65, s=130, e=80, ev=5, dtype=torch.float32, seed=0))
    assert case == Case(lead=(1, 3), l=130, s=130, e=128, ev=128, dtype=torch.float16, seed=0)   # long rows stay
    grad = limits.fit(GradCase(1, 1, 2, 4, 6, 3, 3, torch.float32, "bool", True, 0.5, True, 0))
    assert (grad.dtype, grad.l, grad.s, grad.e, grad.ev, grad.scale, grad.strided) == (
        torch.float16, 6, 6, 16, 16, None, False)
    assert (grad.mask, grad.causal, grad.group) == ("bool", True, 2)   # the clause's own features stay
    # a test that adds a head axis (GQA-HEADS) or a stack of draws (dropout) keeps its rank among the accepted ones
    four_d = Limits(ranks=(2,))
    assert four_d.fit(Case(lead=(1,), l=1, s=1, e=1, ev=1, dtype=torch.float32, seed=0, axes=1)).lead == (1,)
    assert four_d.fit(Case(lead=(), l=1, s=1, e=1, ev=1, dtype=torch.float32, seed=0, axes=1)).lead == (1,)
    assert Limits(ranks=(1,)).fit(Case(lead=(1,), l=1, s=1, e=1, ev=1, dtype=torch.float32, seed=0, axes=1)).lead == ()


def test_declared_limits_are_enforced_before_the_kernel_is_called():
    calls = []
    kernel = GuardedKernel("counting", lambda q, k, v, **kw: calls.append(kw) or F.scaled_dot_product_attention(
        q, k, v, **kw), Limits(masks=(), equal_lengths=True))
    q, k = torch.randn(1, 4, 8), torch.randn(1, 5, 8)
    with pytest.raises(KernelDeclined, match="outside the declared limits: a bool attn_mask"):
        kernel(q, q, q, attn_mask=torch.ones(4, 4, dtype=torch.bool))
    with pytest.raises(KernelDeclined, match="outside the declared limits: L != S"):
        kernel(q, k, k)
    assert not calls and kernel(q, q, q).shape == (1, 4, 8) and len(calls) == 1


def test_weights_are_read_in_slices_of_e_columns_for_a_kernel_that_needs_ev_equal_e():
    kernel = GuardedKernel("value_head_equal", value_head_equal, Limits(equal_head_sizes=True))
    q, k = torch.randn(2, 4, 3, dtype=torch.float64), torch.randn(2, 7, 3, dtype=torch.float64)   # S = 7, E = 3
    expected = torch.softmax(q @ k.transpose(-1, -2) / 3 ** 0.5, dim=-1)
    torch.testing.assert_close(kernel.weights(q, k), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("options, api, message", [
    ({"--kernel-head-size": ["abc"]}, "sdpa", "--kernel-head-size 'abc': expected head sizes between 1 and 1024"),
    ({"--kernel-head-size": ["64,0"]}, "sdpa", "--kernel-head-size '64,0': expected head sizes between 1 and 1024"),
    ({"--kernel-no-mask": True}, "flash", "--kernel-no-mask declares limits of an SDPA kernel"),
])
def test_bad_declared_limits_are_one_line_errors(options, api, message):
    with pytest.raises(LimitsError) as error:
        declared_limits(options, None, api)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_declared_limits():
    limits = declared_limits({"--kernel-head-size": ["64", "16,32"], "--kernel-no-mask": True,
                              "--kernel-equal-lengths": True}, [torch.float16])
    assert limits == Limits(dtypes=(torch.float16,), head_sizes=(16, 32, 64), masks=(), equal_lengths=True)


# ------------------------------------------------------------------------------------- the suite as run
def _pytest(*args, report: Path | None = None):
    """``python -m pytest ARGS`` as a new session, forked from the catalog's session server (one intra-op thread):
    the same session as a new interpreter's, without importing torch again for each (properties/catalog/sessions.py)."""
    cmd = [*args, "-q", "-p", "no:cacheprovider", "-W", "ignore"]
    cmd += ["--report-json", str(report)] if report else []
    proc = run_pytest(cmd, cwd=ROOT, timeout=900)
    rows = json.loads(report.read_text()) if report is not None and report.exists() else []
    return proc, {(r["clause"], r["nodeid"].split("[")[1].rsplit("-cpu", 1)[0]): r for r in rows}


@pytest.mark.parametrize("args, expected", [
    (["--kernel-head-size", "0"], "ERROR: --kernel-head-size '0': expected head sizes between 1 and 1024"),
    (["--finfo-min-rows", "zeros"], "argument --finfo-min-rows: invalid choice: 'zeros'"),
    (["--dtype", "float32", "--kernel", f"{HERE}:fused_like"],
     "declines every problem inside its declared limits (dtypes float32)"),
])
def test_usage_errors_are_one_line(args, expected):
    proc, _ = _pytest(str(ROOT / "properties" / "kernel" / "test_gqa.py"), *args)
    lines = [line for line in proc.stderr.splitlines() if line.strip() and not line.startswith(
        ("ERROR: usage:", "  inifile:", "  rootdir:"))]   # pytest's own lines around an argparse error
    assert proc.returncode == 4 and len(lines) == 1 and expected in lines[0], proc.stderr[-2000:]
    if "fused_like" in expected or "fused_like" in " ".join(args):
        assert "it accepts float16" in lines[0] or "it accepts bfloat16" in lines[0], lines[0]


def test_kernels_that_decline_pass_with_coverage_or_are_skipped_with_the_reason(tmp_path):
    suite = ROOT / "properties" / "kernel"
    flex = f"{ROOT / 'examples' / 'flex_attention_adapter.py'}:scaled_dot_product_attention"
    flex_forward = [f"--deselect=properties/kernel/{name}[{flex}-cpu]" for name in (
        "test_kernel.py::test_output_agrees_with_float64_oracle", "test_masks.py::test_bool_mask_true_means_attend")]
    backends = [f"examples/torch_cuda_backends.py:{name}" for name in ("flash", "efficient", "cudnn", "math")]
    proc, rows = _pytest(str(suite / "test_kernel.py"), str(suite / "test_masks.py"), str(suite / "test_gradients.py"),
                         "--kernel", f"{HERE}:fused_like", "--kernel", f"{HERE}:before_gqa", "--kernel", flex,
                         *(word for spec in backends for word in ("--kernel", spec)), "--device", "cpu",
                         "-k", "float64_oracle or true_means_attend or shared_kv_head", *flex_forward,
                         report=tmp_path / "r.json")
    assert proc.returncode == 0, proc.stdout[-3000:]
    for name in ("flash", "efficient", "cudnn"):   # the CUDA backends decline the CPU: skipped, with the reason
        row = rows[("ATTN-ORACLE", f"examples/torch_cuda_backends.py:{name}")]
        assert row["status"] == "skipped" and "is a CUDA backend" in row["message"], row
    assert rows[("ATTN-GRAD", "examples/torch_cuda_backends.py:math")]["status"] == "passed"
    fused = f"{HERE}:fused_like"
    oracle = rows[("ATTN-ORACLE", fused)]
    assert oracle["status"] == "passed" and oracle["coverage"]["run"] >= 10, oracle
    assert set(oracle["coverage"]["dtypes"]) <= {"float16", "bfloat16"} and oracle["coverage"]["max_e"] >= 64
    grad = rows[("ATTN-GRAD", fused)]
    assert grad["status"] == "passed" and grad["coverage"]["run"] >= 10, grad
    mask = rows[("MASK-BOOL", fused)]      # every problem declined: skipped with the kernel's reason, never passed
    assert mask["status"] == "skipped" and "attn_mask is not supported" in mask["message"], mask
    old = f"{HERE}:before_gqa"             # no enable_gqa: its GQA pairs are declined, the clause that needs them skipped
    assert rows[("ATTN-GRAD", old)]["status"] == "passed", rows[("ATTN-GRAD", old)]
    declined = rows[("ATTN-GRAD", old)]["coverage"]["pairs"]["declined_pairs"]
    assert declined and all("enable_gqa" in d["reason"] and "group=2" in d["pair"] for d in declined), declined
    gqa = rows[("ATTN-GRAD-GQA", old)]
    assert gqa["status"] == "skipped" and "enable_gqa" in gqa["message"], gqa
    flex_grad = rows[("ATTN-GRAD", flex)]  # flex_attention on the CPU: no backward, the gradient clauses skipped
    assert flex_grad["status"] == "skipped" and "does not support backward on CPU" in flex_grad["message"], flex_grad
    assert ("ATTN-ORACLE", flex) not in rows                        # (eager flex_attention is slow on the CPU)
    assert "kernel clause coverage" in proc.stdout and "MASK-BOOL [skipped]" in proc.stdout, proc.stdout[-3000:]


def test_a_grouped_heads_decline_is_not_taken_for_a_gradient_decline():
    from properties.catalog.declining import causal_only, grouped_heads_declined
    kernel = GuardedKernel("grouped_heads_declined", grouped_heads_declined)
    q, kv = torch.randn(1, 4, 3, 8, requires_grad=True), torch.randn(1, 2, 5, 8, requires_grad=True)
    with pytest.raises(KernelDeclined, match="grouped-query attention is not supported"):   # rejected, not skipped
        kernel(q, kv, kv, enable_gqa=True)
    assert not kernel.limits("cpu").gqa
    limits = GuardedKernel("causal_only", causal_only).learn("cpu")       # usable: it accepts causal problems
    assert not limits.unusable and limits.causal_only and limits.masks == () and "causal only" in limits.describe()
