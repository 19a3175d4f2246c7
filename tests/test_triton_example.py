"""examples/triton_attention.py, the FlashAttention-2-style Triton kernel, run on the CPU under Triton's
interpreter (TRITON_INTERPRET=1): the same kernels a GPU compiles, executed with NumPy.

Checked here against the suite's float64 oracle and its derived bounds (properties/core/tolerance.py,
properties/core/gradients.py) on problems that cross its 64 x 64 tiles, forward and backward, and on its
declines.  Skipped where Triton is not installed (pip install -e ".[triton]").
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed: pip install -e '.[triton]'")

from properties.core.assertions import assert_within  # noqa: E402
from properties.core.gradients import gradient_oracle  # noqa: E402
from properties.core.oracle import default_scale, to_float64  # noqa: E402
from properties.kernel.guard import GuardedKernel, check_against_oracle  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "triton_attention.py"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def triton_attention():
    """The example module, and the device its kernels run on here."""
    return _load("triton_attention_example")


def _tensors(lead, kv_heads, l, s, e, dtype, strided, seed):
    """q, k, v, dO: standard normal, rounded to ``dtype``; ``strided`` gives (b, l, h, e) storage seen as (b, h, l, e)."""
    g = torch.Generator().manual_seed(seed)

    def draw(heads, n):
        if strided:
            return torch.randn(lead[0], n, heads, e, generator=g, dtype=torch.float64).to(dtype).transpose(1, 2)
        return torch.randn(*lead[:-1], heads, n, e, generator=g, dtype=torch.float64).to(dtype)
    return draw(lead[-1], l), draw(kv_heads, s), draw(kv_heads, s), draw(lead[-1], l)


# (lead, kv heads, L, S, E, dtype, causal, scale, strided): every problem crosses a 64-wide tile on at least one
# axis, with a partial last tile (63, 65, 100, 127, 129, 257), L != S both ways, and E up to 128.  bfloat16 only
# where S <= 100: beyond S ~ 124 the suite's worst-case softmax bound for bfloat16, gamma(2S + 6), is infinite
# (see the finiteness check below), and a bound that is infinite checks nothing.
TILED = [
    ((1, 2), 2, 65, 65, 16, torch.float16, True, None, False),      # the pinned causal case
    ((2, 2), 2, 127, 129, 32, torch.float16, False, 0.3, True),     # partial tiles on both axes, strided
    ((1, 4), 2, 129, 63, 64, torch.float16, True, None, False),     # L > S causal, grouped-query heads
    ((1, 1), 1, 2, 257, 64, torch.float16, False, None, False),     # five key tiles, the last of one key
    ((1, 1), 1, 3, 100, 128, torch.bfloat16, True, 2.0, False),     # two key tiles, causal, E = 128
    ((1, 2), 1, 65, 64, 16, torch.bfloat16, False, None, True),     # one full key tile, two query tiles, GQA
]


def _id(case):
    lead, kv, l, s, e, dtype, causal, scale, strided = case
    return f"L{l}-S{s}-E{e}-{str(dtype)[6:]}{'-causal' if causal else ''}{'-gqa' if kv != lead[-1] else ''}"


@pytest.mark.parametrize("case", TILED, ids=[_id(c) for c in TILED])
def test_forward_and_backward_within_the_suites_bounds(triton_attention, case):
    lead, kv_heads, l, s, e, dtype, causal, scale, strided = case
    q, k, v, do = _tensors(lead, kv_heads, l, s, e, dtype, strided, seed=l * s + e)
    contract = {"is_causal": causal, "scale": scale, "enable_gqa": kv_heads != lead[-1]}
    kernel = GuardedKernel("triton_attention", triton_attention.attention)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out, bounds = check_against_oracle(kernel, *leaves, **contract)           # ATTN-ORACLE's bound
    out.backward(do)
    oracle = gradient_oracle(bounds, q, k, v, do, scale=default_scale(e) if scale is None else scale)
    for name, leaf in zip(("query", "key", "value"), leaves):
        assert leaf.grad.shape == leaf.shape and leaf.grad.dtype == dtype
        assert bool(torch.isfinite(oracle.bound[name]).all()), f"the bound on d{name} is not finite: it checks nothing"
        assert_within(to_float64(leaf.grad), oracle.value[name], oracle.bound[name], what=f"d{name}",
                      reference="float64 chain rule")


DECLINED = [
    (dict(dtype=torch.float32), "only supports float16 and bfloat16"),
    (dict(e=80), "only supports head sizes"),
    (dict(ev=32), "only supports head sizes"),
    (dict(attn_mask=torch.ones(5, 7, dtype=torch.bool)), "attn_mask is not supported"),
    (dict(dropout_p=0.1), "dropout is not supported"),
]


@pytest.mark.parametrize("change,words", DECLINED, ids=[w.split()[-1] + "-" + next(iter(c)) for c, w in DECLINED])
def test_declines_what_it_lacks_in_the_words_of_fused_kernels(triton_attention, change, words):
    """A problem outside its limits is a NotImplementedError worded as unsupported, never a wrong answer."""
    dtype, e, ev = change.pop("dtype", torch.float16), change.pop("e", 16), change.pop("ev", None)
    q, k, v = torch.randn(1, 1, 5, e).to(dtype), torch.randn(1, 1, 7, e).to(dtype), torch.randn(1, 1, 7, ev or e).to(dtype)
    with pytest.raises(NotImplementedError, match=words):
        triton_attention.attention(q, k, v, **change)


def test_cpu_tensors_without_the_interpreter_are_declined_with_the_remedy():
    """Imported without TRITON_INTERPRET, the kernels are compiled ones, which cannot read CPU memory."""
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("TRITON_INTERPRET", raising=False)
        spec = importlib.util.spec_from_file_location("triton_attention_compiled", EXAMPLE)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    q = torch.randn(1, 1, 4, 16).half()
    with pytest.raises(NotImplementedError, match="TRITON_INTERPRET=1"):
        module.attention(q, q, q)
