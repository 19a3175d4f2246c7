"""examples/triton_attention.py, the FlashAttention-2-style Triton kernel: checked against the suite's float64
oracle and its derived bounds (properties/core/tolerance.py, properties/kernel/gradients.py) on problems that cross
its 64 x 64 tiles, forward and backward, and on its declines.

Its kernels run compiled on CUDA, or on the CPU under Triton's interpreter (TRITON_INTERPRET=1: the same kernels
executed with NumPy). The interpreter is chosen when ``triton`` is first imported, for the whole process, so a
run without it (CI's) checks the kernel here in a new pytest session that has it (forked from the server of
properties/catalog/sessions.py, which never imports Triton); with it, or on a CUDA machine, the tests below run in
this process. Skipped where Triton is not installed (pip install -e ".[triton]").
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton", reason="Triton is not installed: pip install -e '.[triton]'")

from properties.catalog.sessions import run_pytest  # noqa: E402
from properties.core.assertions import assert_within  # noqa: E402
from properties.kernel.gradients import gradient_oracle  # noqa: E402
from properties.core.oracle import default_scale, to_float64  # noqa: E402
from properties.kernel.guard import GuardedKernel, check_against_oracle  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "triton_attention.py"
INTERPRETED = bool(triton.knobs.runtime.interpret)
DEVICE = "cpu" if INTERPRETED else "cuda" if torch.cuda.is_available() else None
INTERPRETER = {"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}   # a session's environment: the CPU, interpreted
runs_kernels = pytest.mark.skipif(DEVICE is None, reason="Triton kernels run on CUDA or under TRITON_INTERPRET=1; "
                                  "test_the_kernel_under_the_interpreter runs these in a process with it")


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def triton_attention():
    """The example module (its kernels compiled, or interpreted under TRITON_INTERPRET=1)."""
    return _load("triton_attention_example")


def _tensors(lead, kv_heads, l, s, e, dtype, strided, seed, device):
    """q, k, v, dO: standard normal, rounded to ``dtype``; ``strided``: (b, l, h, e) storage seen as (b, h, l, e)."""
    g = torch.Generator().manual_seed(seed)

    def draw(heads, n):
        if strided:
            return torch.randn(lead[0], n, heads, e, generator=g, dtype=torch.float64).to(dtype).transpose(1, 2)
        return torch.randn(*lead[:-1], heads, n, e, generator=g, dtype=torch.float64).to(dtype)
    return tuple(t.to(device) for t in (draw(lead[-1], l), draw(kv_heads, s), draw(kv_heads, s), draw(lead[-1], l)))


# (lead, kv heads, L, S, E, dtype, causal, scale, strided): every problem crosses a 64-wide tile on at least one
# axis, with a partial last tile (63, 65, 100, 127, 129, 257, 1025), L != S both ways, and E up to 128.
TILED = [
    ((1, 2), 2, 65, 65, 16, torch.float16, True, None, False),      # the pinned causal case
    ((2, 2), 2, 127, 129, 32, torch.float16, False, 0.3, True),     # partial tiles on both axes, strided
    ((1, 4), 2, 129, 63, 64, torch.float16, True, None, False),     # L > S causal, grouped-query heads
    ((1, 1), 1, 2, 257, 64, torch.float16, False, None, False),     # five key tiles, the last of one key
    ((1, 1), 1, 3, 100, 128, torch.bfloat16, True, 2.0, False),     # two key tiles, causal, E = 128
    ((1, 1), 1, 2, 1025, 32, torch.bfloat16, False, None, False),   # a long row: 17 key tiles, the last of one key
    ((1, 2), 1, 65, 64, 16, torch.bfloat16, False, None, True),     # one full key tile, two query tiles, GQA
]


def _id(case):
    lead, kv, l, s, e, dtype, causal, scale, strided = case
    return f"L{l}-S{s}-E{e}-{str(dtype)[6:]}{'-causal' if causal else ''}{'-gqa' if kv != lead[-1] else ''}"


@runs_kernels
@pytest.mark.parametrize("case", TILED, ids=[_id(c) for c in TILED])
def test_forward_and_backward_within_the_suites_bounds(triton_attention, case):
    _check(triton_attention, case, DEVICE)


def _run(module, case, device):
    """``module.attention`` on ``case``, through the suite's guard and ATTN-ORACLE's check, then backward: the inputs,
    dO, the output, the gradients (query, key, value) and the forward's bounds."""
    lead, kv_heads, l, s, e, dtype, causal, scale, strided = case
    q, k, v, do = _tensors(lead, kv_heads, l, s, e, dtype, strided, seed=l * s + e, device=device)
    contract = {"is_causal": causal, "scale": scale, "enable_gqa": kv_heads != lead[-1]}
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out, bounds = check_against_oracle(GuardedKernel("triton_attention", module.attention), *leaves, **contract)
    out.backward(do)
    return (q, k, v, do), out, [leaf.grad for leaf in leaves], bounds


def _check(module, case, device):
    """The suite's forward and backward checks (ATTN-ORACLE's and ATTN-GRAD's bounds) of ``module.attention``."""
    (q, k, v, do), _, grads, bounds = _run(module, case, device)
    scale = case[7]
    oracle = gradient_oracle(bounds, q, k, v, do, scale=default_scale(q.shape[-1]) if scale is None else scale)
    for name, leaf, grad in zip(("query", "key", "value"), (q, k, v), grads):
        assert grad.shape == leaf.shape and grad.dtype == leaf.dtype
        assert bool(torch.isfinite(oracle.bound[name]).all()), f"the bound on d{name} is not finite: it checks nothing"
        assert_within(to_float64(grad), oracle.value[name], oracle.bound[name], what=f"d{name}",
                      reference="float64 chain rule")


# Bugs of tiled kernels, each injected into the example's source: (name, the line as written, the line with the bug,
# a problem inside one 64 x 64 tile where the bug changes nothing, one across tiles where it does).
ONE_TILE = ((1, 2), 2, 64, 64, 16, torch.float16, True, None, False)
TILE_BUGS = [
    ("accumulator-not-rescaled", "acc = acc * alpha[:, None] + _dot(", "acc = acc + _dot(",
     ((1, 1), 1, 8, 129, 16, torch.float16, False, 1.0, False)),   # wide scores: the maximum moves by a lot
    ("causal-index-inside-the-tile", "admissible = admissible & (keys[None, :] <= rows[:, None])\n        s = tl.where",
     "admissible = admissible & (keys[None, :] - start <= rows[:, None] - tile * BLOCK_M)\n        s = tl.where",
     ((1, 1), 1, 65, 65, 16, torch.float16, True, None, False)),
    ("dv-of-the-last-query-tile-only", "dv += _dot(_to(p_t, do.dtype, UPCAST), do, UPCAST)",
     "dv = _dot(_to(p_t, do.dtype, UPCAST), do, UPCAST)", ((1, 1), 1, 65, 9, 16, torch.float16, False, None, False)),
]


@runs_kernels
@pytest.mark.parametrize("name,line,bug,across", TILE_BUGS, ids=[b[0] for b in TILE_BUGS])
def test_a_tile_bug_is_exact_inside_one_tile_and_caught_across_tiles(triton_attention, tmp_path, name, line, bug,
                                                                     across):
    """The bug leaves a one-tile problem bit for bit as the example computes it (so small draws cannot see it), and
    the suite's bounds catch it once the problem crosses a tile."""
    source = EXAMPLE.read_text()
    assert source.count(line) == 1, f"the line {line!r} is no longer in the example: update TILE_BUGS"
    mutant = tmp_path / f"{name.replace('-', '_')}.py"
    mutant.write_text(source.replace(line, bug))
    spec = importlib.util.spec_from_file_location(mutant.stem, mutant)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    _, out, grads, _ = _run(module, ONE_TILE, DEVICE)
    _, out_correct, grads_correct, _ = _run(triton_attention, ONE_TILE, DEVICE)
    assert all(torch.equal(a, b) for a, b in zip([out, *grads], [out_correct, *grads_correct]))
    with pytest.raises(AssertionError, match="outside the bound"):
        _check(module, across, DEVICE)


KERNEL_DTYPES = [torch.float16, torch.bfloat16]


@runs_kernels
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
def test_outputs_round_to_nearest_as_on_a_gpu(triton_attention, dtype):
    """Equal scores over S keys: every weight is 1/S, computed exactly up to the float32 division, so the output read
    through V = I is 1/S rounded once to the dtype, to nearest (the Triton interpreter's own bfloat16 cast truncates:
    1/3 became 0.33203125, not 0.333984375)."""
    for s in (3, 5, 7, 11, 100):
        q, k = torch.zeros(1, 1, 2, 16, dtype=dtype, device=DEVICE), torch.randn(1, 1, s, 16).to(DEVICE, dtype)
        v = torch.eye(s, 16, dtype=dtype, device=DEVICE)[None, None]
        out = triton_attention.attention(q, k, v)[..., :s]
        expected = torch.tensor(1 / s, dtype=torch.float32).to(dtype)
        assert bool((out.cpu() == expected).all()), f"S = {s}: {out[0, 0, 0].tolist()} != {expected.item()}"


DECLINED = [
    (dict(dtype=torch.float32), "only supports float16 and bfloat16"),
    (dict(e=80), "only supports head sizes"),
    (dict(ev=32), "only supports head sizes"),
    (dict(attn_mask=torch.ones(5, 7, dtype=torch.bool)), "attn_mask is not supported"),
    (dict(dropout_p=0.1), "dropout is not supported"),
]


@runs_kernels
@pytest.mark.parametrize("change,words", DECLINED, ids=[w.split()[-1] + "-" + next(iter(c)) for c, w in DECLINED])
def test_declines_what_it_lacks_in_the_words_of_fused_kernels(triton_attention, change, words):
    """A problem outside its limits is a NotImplementedError worded as unsupported, never a wrong answer."""
    dtype, e, ev = change.pop("dtype", torch.float16), change.pop("e", 16), change.pop("ev", None)
    q, k, v = (torch.randn(1, 1, n, m).to(DEVICE, dtype) for n, m in ((5, e), (7, e), (7, ev or e)))
    with pytest.raises(NotImplementedError, match=words):
        triton_attention.attention(q, k, v, **change)


@pytest.mark.skipif(INTERPRETED, reason="under TRITON_INTERPRET=1 the kernels take CPU tensors")
def test_cpu_tensors_without_the_interpreter_are_declined_with_the_remedy():
    """Without the interpreter the kernels are compiled ones, which cannot read CPU memory."""
    q = torch.randn(1, 1, 4, 16).half()
    with pytest.raises(NotImplementedError, match="TRITON_INTERPRET=1"):
        _load("triton_attention_compiled").attention(q, q, q)


@pytest.mark.skipif(INTERPRETED, reason="under TRITON_INTERPRET=1 Triton compiles nothing")
def test_the_kernels_compile_for_an_h100_without_one(tmp_path, monkeypatch):
    """What this machine cannot run it can still compile: the four kernels in their largest configuration (E = 128,
    bfloat16, causal, 8 warps, 64 x 64 tiles) through Triton's NVIDIA backend for sm_90 (PTX, then the wheel's own
    ptxas), so an edit that the interpreter accepts and the compiler does not fails here, without a GPU."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))      # a real compile, and nothing left in ~/.triton
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")         # Triton 3.9 warns when unset; 1 is its default
    module = _load("triton_attention_compiled")
    pointers = {"Q", "K", "V", "O", "DO", "DQ", "DK", "DV", "LSE", "DELTA"}
    sizes = dict(CAUSAL=True, HEAD=128, BLOCK_M=64, BLOCK_N=64, UPCAST=False)
    for kernel in (module._forward, module._delta, module._backward_key_tile, module._backward_query_tile):
        names = kernel.arg_names
        constants = {name: value for name, value in sizes.items() if name in names}
        signature = {name: "constexpr" if name in constants else
                     ("*fp32" if name in ("LSE", "DELTA") else "*bf16") if name in pointers else
                     "fp32" if name in ("qk_scale", "scale") else "i32" for name in names}
        source = ASTSource(kernel, signature, constexprs={(names.index(n),): v for n, v in constants.items()})
        try:
            compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
        except (ImportError, KeyError) as exc:   # a Triton build without the NVIDIA backend
            pytest.skip(f"this Triton cannot compile for CUDA: {type(exc).__name__}: {exc}")
        assert compiled.asm["cubin"], kernel.__name__
        assert compiled.metadata.shared <= 100 * 1024, (kernel.__name__, compiled.metadata.shared)  # fits sm_86 too


# The suite's run under the interpreter, as docs/kernels.md shows it. Each interpreted launch costs milliseconds per
# program, so the run is bounded by declaring the kernel's limits (draws start inside them, and the start-up probes of
# its limits only confirm them: one small program each; no draw spent on a decline) and by the `quick` profile: every
# clause on a covering row for each class it poses (tile lengths, L = S = 1024, head size 128 among them) and one
# draw. The kernel declines dropout; the suite confirms such a decline on the first batch and head of the clause's
# stack, one interpreted program, and skips the dropout clauses.
SUITE_UNDER_THE_INTERPRETER = [
    "--dtype", "float16", "--dtype", "bfloat16", "--kernel-head-size", "16,32,64,128", "--kernel-no-mask",
    "--kernel-equal-head-sizes", "--hypothesis-profile", "quick",
    # The interpreter runs a tile-scale call (S = 1025) program by program: under the test command's full load one
    # call can take minutes, which the default limit per call (60 s) would report as a hang.
    "--call-timeout", "300",
]
# Clauses the kernel must pass (not only skip): forward, backward, causal, GQA, scale, and the weights read through
# V = I in slices of E columns.
MUST_PASS = {"ATTN-ORACLE", "ATTN-SHAPE", "ATTN-ROWSUM", "ATTN-LARGE-SCORES", "ATTN-GRAD", "ATTN-GRAD-CAUSAL",
             "ATTN-GRAD-GQA", "CAUSAL-NO-FUTURE", "CAUSAL-ZERO-ABOVE", "GQA-HEADS", "SCALE-DEFAULT", "SCALE-EXPLICIT"}
MASK_CLAUSES = {"MASK-BOOL", "MASK-FLOAT-ADDITIVE", "MASK-FULLY-MASKED", "ATTN-GRAD-MASKED"}


def _suite(tmp_path, env: dict, *options: str) -> tuple[str, list[dict]]:
    """``pytest properties/ --kernel examples/triton_attention.py:attention OPTIONS`` as a new session (a process that
    has not imported Triton yet): its output and the kernel-level rows of its --report-json."""
    report = tmp_path / "report.json"
    result = run_pytest(["properties/", "-q", "-p", "no:cacheprovider", "--kernel",
                         "examples/triton_attention.py:attention", "--report-json", str(report), *options],
                        cwd=ROOT, env=env, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    return result.stdout, [row for row in json.loads(report.read_text()) if row["level"] == "kernel"]


def _check_verified(output: str, rows: list[dict]) -> None:
    """The claimed clauses passed, each having run problems, tile-crossing ones among them; the mask clauses were
    skipped, for the kernel's own reason (limits learned) or the declared one (--kernel-no-mask: the suite does not
    call the kernel there); the coverage report was printed."""
    assert "kernel clause coverage" in output, output[-3000:]
    passed = {row["clause"]: row for row in rows if row["status"] == "passed"}
    assert MUST_PASS <= set(passed), f"clauses that did not pass: {sorted(MUST_PASS - set(passed))}"
    for clause, row in passed.items():
        assert row["coverage"]["run"] > 0, f"{clause} passed without running a problem: {row['coverage']}"
    largest = {key: max(row["coverage"][key] for row in passed.values()) for key in ("max_l", "max_s", "max_e")}
    assert largest["max_l"] > 64 and largest["max_s"] >= 1024 and largest["max_e"] == 128, largest
    skipped = {row["clause"]: row["message"] for row in rows if row["status"] == "skipped"}
    for clause in MASK_CLAUSES:
        reason = skipped.get(clause, "")
        assert "attn_mask is not supported" in reason or "outside the declared limits: a bool attn_mask" in reason or \
            "outside the declared limits: a float attn_mask" in reason, (clause, reason)


@pytest.mark.skipif(INTERPRETED, reason="this process is the one under the interpreter")
def test_the_suite_verifies_the_kernel_under_the_interpreter(tmp_path):
    """The suite on the kernel under TRITON_INTERPRET=1 on the CPU, its limits declared, every class once; the clauses
    it must pass and the mask clauses it must skip (the cheapest subset: the interpreter costs milliseconds per
    program, and docs/kernels.md times the whole run)."""
    chosen = [word for clause in sorted(MUST_PASS | MASK_CLAUSES) for word in ("--catalog-clause", clause)]
    _check_verified(*_suite(tmp_path, INTERPRETER, "--device", "cpu", *SUITE_UNDER_THE_INTERPRETER,
                            "-p", "properties.catalog.select", *chosen))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available")
def test_the_suite_verifies_the_kernel_on_cuda(tmp_path):
    """The command of issue 24 on a GPU, compiled, with no other option: limits learned, the default profile."""
    _check_verified(*_suite(tmp_path, {"TRITON_INTERPRET": "0"}, "-x", "--device", "cuda"))


@pytest.mark.skipif(INTERPRETED, reason="this process is the one under the interpreter")
def test_the_kernel_under_the_interpreter():
    """This file's kernel tests in a new session with TRITON_INTERPRET=1 (on the CPU, whatever this machine has)."""
    result = run_pytest([str(Path(__file__)), "-q", "-p", "no:cacheprovider", "-p", "no:xdist"], cwd=ROOT,
                        env=INTERPRETER, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    expected = len(TILED) + len(TILE_BUGS) + len(KERNEL_DTYPES) + len(DECLINED)
    assert f"{expected} passed" in result.stdout, result.stdout[-2000:]
