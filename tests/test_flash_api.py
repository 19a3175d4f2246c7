"""The FlashAttention-API contracts (--kernel-api, SPEC.md "The FlashAttention API"): the zoo's kernels agree with each
other, every catalog bug is correct on the plain case, the plugin selects, skips and reports as documented, and the
flex_attention / flash-attn adapters in examples/ pass (where their backend runs)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from properties.catalog import CATALOG, flash_bugs, flash_kvcache_bugs, flash_varlen_bugs
from properties.catalog.sessions import run_pytest
from zoo.nn import flash_dense, flash_kvcache, flash_varlen

ROOT = Path(__file__).resolve().parents[1]
SUITE = ROOT / "properties"


def _run(*args, report: Path | None = None, timeout: float = 900):
    cmd = [*args, "-q", "-p", "no:cacheprovider", "-W", "ignore"]
    if report is not None:
        cmd += ["--report-json", str(report)]
    proc = run_pytest(cmd, cwd=ROOT, timeout=timeout)
    rows = json.loads(report.read_text()) if report is not None and report.exists() else []
    return proc, rows


def _problem(seed=0, b=2, lq=3, lk=5, h=4, hkv=2, d=3):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, lq, h, d, generator=g, dtype=torch.float64),
            torch.randn(b, lk, hkv, d, generator=g, dtype=torch.float64),
            torch.randn(b, lk, hkv, d, generator=g, dtype=torch.float64))


# ----------------------------------------------------------------------------------------- the zoo's kernels
@pytest.mark.parametrize("lq,lk", [(3, 5), (5, 3), (4, 4), (1, 6)])
def test_zoo_flash_kernels_agree(lq, lk):
    q, k, v = _problem(lq=lq, lk=lk)
    slopes = torch.rand(2, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64).float()
    for kw in ({}, {"causal": True}, {"window_size": (1, 2)}, {"causal": True, "window_size": (2, -1), "softcap": 1.5,
                                                                "alibi_slopes": slopes}):
        reference = flash_dense.flash_attn_reference(q, k, v, **kw)
        torch.testing.assert_close(flash_dense.flash_attn_tiled(q, k, v, **kw), reference, rtol=1e-12, atol=1e-12)
        cu = lambda n: torch.arange(0, 2 * n + 1, n, dtype=torch.int32)  # noqa: E731
        for varlen in (flash_varlen.flash_attn_varlen_loop, flash_varlen.flash_attn_varlen_packed):
            out = varlen(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu(lq), cu(lk), lq, lk, **kw)
            torch.testing.assert_close(out, reference.flatten(0, 1), rtol=1e-12, atol=1e-12)
        for cache in (flash_kvcache.flash_attn_kvcache_gather, flash_kvcache.flash_attn_kvcache_paged):
            kv = {key: value for key, value in kw.items()}
            out = cache(q, k.clone(), v.clone(), **kv)           # cache_seqlens=None: the whole cache
            torch.testing.assert_close(out, reference, rtol=1e-12, atol=1e-12)


def test_kvcache_appends_in_place():
    q, k, v = _problem(lq=1, lk=4)
    k_cache, v_cache = torch.zeros(2, 6, 2, 3, dtype=torch.float64), torch.zeros(2, 6, 2, 3, dtype=torch.float64)
    k_cache[:, :3], v_cache[:, :3] = k[:, :3], v[:, :3]
    seqlens = torch.tensor([3, 3], dtype=torch.int32)
    out = flash_kvcache.flash_attn_kvcache_paged(q, k_cache, v_cache, k[:, 3:], v[:, 3:], cache_seqlens=seqlens,
                                                 causal=True)
    assert torch.equal(k_cache[:, :4], k) and torch.equal(k_cache[:, 4:], torch.zeros_like(k_cache[:, 4:]))
    torch.testing.assert_close(out, flash_dense.flash_attn_reference(q, k, v, causal=True), rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------------- the catalog's bugs
def _plain_call(api, fn):
    q, k, v = _problem(h=2, hkv=2)      # plain: no grouped heads, no window, softcap, ALiBi, one sequence, whole cache
    if api == "flash":
        return fn(q, k, v), flash_dense.flash_attn_reference(q, k, v)
    if api == "flash-varlen":
        cu_q, cu_k = torch.tensor([0, 3], dtype=torch.int32), torch.tensor([0, 5], dtype=torch.int32)
        return fn(q[0], k[0], v[0], cu_q, cu_k, 3, 5), flash_dense.flash_attn_reference(q[:1], k[:1], v[:1])[0]
    return fn(q, k.clone(), v.clone()), flash_dense.flash_attn_reference(q, k, v)


# The catalog's bugs of the three flash modules: name -> (API, the kernel).
_FLASH_MODULES = {m.__name__: m for m in (flash_bugs, flash_varlen_bugs, flash_kvcache_bugs)}
FLASH_BUGS = {name: (e.api, getattr(_FLASH_MODULES[module], name))
              for e in CATALOG for module, _, name in [e.spec.partition(":")] if module in _FLASH_MODULES}


@pytest.mark.parametrize("name", sorted(FLASH_BUGS))
def test_every_flash_bug_is_correct_on_the_plain_case(name):
    api, kernel = FLASH_BUGS[name]
    out, reference = _plain_call(api, kernel)
    torch.testing.assert_close(out, reference, rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------------------------- the plugin
def test_default_run_skips_the_flash_clauses_with_a_reason(tmp_path):
    proc, rows = _run(str(SUITE / "kernel" / "test_flash_varlen.py"), "--device", "cpu", report=tmp_path / "r.json")
    assert proc.returncode == 0, proc.stdout[-2000:]
    assert rows and all(r["status"] == "skipped" and "--kernel-api flash-varlen" in r["message"] for r in rows), rows


def test_kernel_api_flash_checks_the_zoo_kernels_and_skips_sdpa_clauses(tmp_path):
    proc, rows = _run(str(SUITE / "kernel" / "test_flash_kvcache.py"), str(SUITE / "kernel" / "test_gqa.py"),
                      "--kernel-api", "flash", "--device", "cpu", report=tmp_path / "r.json")
    assert proc.returncode == 0, proc.stdout[-2000:]
    kv = [r for r in rows if r["clause"].startswith("KVCACHE")]
    assert {r["status"] for r in kv} == {"passed"} and {"kvcache_gather", "kvcache_paged"} <= {
        r["nodeid"].split("[")[1].split("-")[0] for r in kv}, kv
    sdpa = [r for r in rows if r["clause"] == "GQA-HEADS"]
    assert sdpa and all(r["status"] == "skipped" and "--kernel-api flash" in r["message"] for r in sdpa), sdpa


def no_softcap(q, k, v, softcap=0.0, **kwargs):
    """A flash kernel that declines softcap (used by the test below through --kernel tests/test_flash_api.py:...)."""
    if softcap > 0:
        raise NotImplementedError("no softcap here")
    return flash_dense.flash_attn_reference(q, k, v, **kwargs)


def test_a_declined_feature_is_skipped_and_reported(tmp_path):
    proc, rows = _run(str(SUITE / "kernel" / "test_flash.py"), "--kernel-api", "flash", "--device", "cpu",
                      "--kernel", f"{Path(__file__).resolve()}:no_softcap", "-k", "softcap or oracle",
                      report=tmp_path / "r.json")
    assert proc.returncode == 0, proc.stdout[-2000:]
    status = {r["clause"]: r for r in rows}
    assert status["FLASH-ORACLE"]["status"] == "passed"
    for clause in ("SOFTCAP-FORMULA", "SOFTCAP-RANGE"):
        assert status[clause]["status"] == "skipped" and "does not support softcap" in status[clause]["message"] \
            and "no softcap here" in status[clause]["message"], status[clause]


def test_a_bad_flash_kernel_is_a_one_line_usage_error():
    proc, _ = _run(str(SUITE / "kernel" / "test_flash.py"), "--kernel-api", "flash-kvcache", "--kernel", "nope")
    assert proc.returncode == 4
    lines = [line for line in proc.stderr.splitlines() if "nope" in line]
    assert len(lines) == 1 and "--kernel-api flash-kvcache" in lines[0] and "kvcache_paged" in lines[0], proc.stderr


# ---------------------------------------------------------------------------------------------- the adapters
def _flex_works() -> str | None:
    try:
        from zoo.runtime.plugins import load_object
        flash_attn_func = load_object(f"{ROOT / 'examples' / 'flex_attention_adapter.py'}:flash_attn_func")
        q, k, v = _problem()
        flash_attn_func(q.float(), k.float(), v.float(), causal=True)
    except Exception as exc:  # torch without flex_attention, or no CPU support for it
        return f"flex_attention does not run here: {type(exc).__name__}: {exc}"
    return None


def test_flex_attention_adapter_passes_the_flash_clauses(tmp_path):
    reason = _flex_works()
    if reason:
        pytest.skip(reason)
    proc, rows = _run(str(SUITE / "kernel" / "test_flash.py"), "--kernel-api", "flash", "--device", "cpu",
                      "--kernel", "examples/flex_attention_adapter.py:flash_attn_func", "--hypothesis-profile", "quick",
                      "-k", "oracle or window or softcap or alibi or causal or gqa", report=tmp_path / "r.json")
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert sum(r["status"] == "passed" for r in rows) >= 6, rows


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None or not torch.cuda.is_available(),
                    reason="flash-attn and CUDA are needed (pip install flash-attn on a CUDA machine)")
def test_flash_attn_adapter_passes_the_flash_clauses(tmp_path):  # pragma: no cover - CUDA only
    proc, _ = _run(str(SUITE / "kernel" / "test_flash.py"), "--kernel-api", "flash", "--device", "cuda",
                   "--dtype", "float16", "--dtype", "bfloat16", "--window-right-below-lk",
                   "--kernel", "examples/flash_attn_adapter.py:flash_attn_func", "--hypothesis-profile", "quick")
    assert proc.returncode == 0, proc.stdout[-3000:]


def test_window_right_below_lk_restricts_the_drawn_windows():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from properties.kernel.flash import set_window_right_below_lk, windows

    @settings(max_examples=200, database=None)
    @given(data=st.data(), lk=st.integers(1, 9))
    def draws(data, lk):
        left, right = data.draw(windows(lk, bounded=True))
        assert 0 <= right < lk and left >= -1

    set_window_right_below_lk(True)
    try:
        draws()
    finally:
        set_window_right_below_lk(False)


def test_flash_example_based_baseline_passes_the_reference_and_catches_a_bug():
    from properties.catalog import flash_example_based

    correct = flash_example_based.run(flash_varlen.flash_attn_varlen_packed, "flash-varlen")
    assert correct.cases == len(flash_example_based.GRID) and not correct.failures, correct.failures[:3]
    broken = flash_example_based.run(flash_kvcache_bugs.kvcache_leftpad_ignored, "flash-kvcache", stop_first=True)
    assert broken.caught and "leftpad" in broken.failures[0], broken.failures[:1]
