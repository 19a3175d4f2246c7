"""Partial states, single process (SPEC.md, "Partial states and their merge"): kernels that return their LSE
(--returns-lse: LSE-ORACLE, LSE-GRAD) and merge kernels (--kernel-api merge: MERGE-ORACLE, MERGE-EMPTY). The zoo's
own pass (the catalog's correct and broken ones are tests/test_catalog.py's), bad input is one line, and a run without
the options skips these clauses with the reason."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from properties.catalog import CATALOG, merge_bugs
from properties.catalog.sessions import run_pytest
from properties.core.tolerance import fold_error, merge_error
from zoo.nn.partial import attention_with_lse, merge_state, merge_states

ROOT = Path(__file__).resolve().parents[1]
KERNEL = ROOT / "properties" / "kernel"
LSE, MERGE = str(KERNEL / "test_lse.py"), str(KERNEL / "test_merge.py")
MERGE_BUGS = [e for e in CATALOG if e.spec.startswith("properties.catalog.merge_bugs:")]


def _suite(tmp_path, *args, timeout: float = 600):
    report = tmp_path / "report.json"
    proc = run_pytest([*args, "-q", "-p", "no:cacheprovider", "-W", "ignore", "--report-json", str(report)],
                      cwd=tmp_path, timeout=timeout)
    rows = json.loads(report.read_text()) if report.exists() else []
    return proc, rows


def _kernel_of(row) -> str:
    return row["nodeid"].split("[", 1)[1].rsplit("-", 1)[0]


# ------------------------------------------------------------------------------------------- the zoo's arithmetic
def test_attention_with_lse_is_sdpa_and_its_lse_the_log_sum_exp():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 5, 8, generator=g, dtype=torch.float64), torch.randn(2, 2, 7, 8, generator=g,
               dtype=torch.float64), torch.randn(2, 2, 7, 3, generator=g, dtype=torch.float64))
    mask = torch.rand(5, 7, generator=g) < 0.6
    mask[1] = False
    out, lse = attention_with_lse(q, k, v, attn_mask=mask, enable_gqa=True)
    reference = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    keep = mask.any(-1)
    torch.testing.assert_close(out[..., keep, :], reference[..., keep, :])
    assert torch.equal(out[..., 1, :], torch.zeros_like(out[..., 1, :])) and bool((lse[..., 1] == -math.inf).all())
    scores = (q / math.sqrt(8)) @ k.repeat_interleave(2, dim=1).transpose(-1, -2)
    expected = torch.logsumexp(scores.masked_fill(~mask, -math.inf), -1)
    torch.testing.assert_close(lse[..., keep], expected[..., keep])


def test_merge_of_two_blocks_is_the_whole_and_empty_states_weigh_nothing():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 3, 4, generator=g), torch.randn(1, 2, 6, 4, generator=g),
               torch.randn(1, 2, 6, 5, generator=g))
    whole, whole_lse = attention_with_lse(q, k, v)
    a, b = attention_with_lse(q, k[..., :2, :], v[..., :2, :]), attention_with_lse(q, k[..., 2:, :], v[..., 2:, :])
    flat = lambda o, s: (o[0].transpose(0, 1), s[0].transpose(0, 1))   # noqa: E731  (b h l d -> (b l) h d)
    merged, merged_lse = merge_state(*flat(*a), *flat(*b))
    torch.testing.assert_close(merged, flat(whole, whole_lse)[0])
    torch.testing.assert_close(merged_lse, flat(whole, whole_lse)[1])
    empty = (torch.full_like(merged, 1e30), torch.full_like(merged_lse, -math.inf))
    both = merge_states(torch.stack([empty[0], merged, empty[0]], 1), torch.stack([empty[1], merged_lse, empty[1]], 1))
    torch.testing.assert_close(both[0], merged)
    nothing = merge_state(*empty, *empty)
    assert torch.equal(nothing[0], torch.zeros_like(merged)) and bool((nothing[1] == -math.inf).all())


def test_a_fold_is_bounded_by_its_merges():
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        assert fold_error(1, dtype, 100.0) == 0.0 == merge_error(1, dtype, 100.0)
        two = fold_error(2, dtype, 100.0)
        assert two >= merge_error(2, dtype, 100.0)
        assert fold_error(8, dtype, 100.0) >= 7 * two   # compounded over the 7 merges of 8 states


# ------------------------------------------------------------------------------- the zoo's own kernels pass
# The catalog's correct merge and LSE kernels (merge_base, its base-2 twin, lse_attention) pass their whole level, and
# each broken one of properties/catalog/merge_bugs.py fails its named clause on the covering rows alone, in
# tests/test_catalog.py's sessions; here the zoo's own references, on these clauses.
def test_the_zoos_merge_passes(tmp_path):
    proc, rows = _suite(tmp_path, MERGE, "--device", "cpu", "--kernel-api", "merge", "--kernel",
                        "zoo.nn.partial:merge_state")
    assert proc.returncode == 0, proc.output[-3000:]
    assert {(r["clause"], r["status"]) for r in rows} == {("MERGE-ORACLE", "passed"), ("MERGE-EMPTY", "passed")}
    assert {_kernel_of(r) for r in rows} == {"zoo.nn.partial:merge_state"}


def test_the_zoos_attention_with_lse_passes(tmp_path):
    proc, rows = _suite(tmp_path, LSE, "--device", "cpu", "--returns-lse", "--kernel",
                        "zoo.nn.partial:attention_with_lse")
    assert proc.returncode == 0, proc.output[-3000:]
    assert len(rows) == 2 and {r["status"] for r in rows} == {"passed"}, rows


def test_the_merge_bugs_are_correct_where_their_bug_does_not_apply():
    """Two non-empty float64 states with LSEs near 0: only the LSE's base and the 16-bit rounding can show."""
    g = torch.Generator().manual_seed(2)
    v_a, v_b = torch.randn(3, 2, 4, generator=g, dtype=torch.float64), torch.randn(3, 2, 4, generator=g,
                                                                                 dtype=torch.float64)
    s_a, s_b = torch.randn(3, 2, generator=g, dtype=torch.float64), torch.randn(3, 2, generator=g, dtype=torch.float64)
    expected = merge_state(v_a, s_a, v_b, s_b)
    for name in ("merge_base", "merge_nan_when_both_empty", "merge_empty_as_finite", "merge_without_max_subtraction"):
        got = getattr(merge_bugs, name)(v_a, s_a, v_b, s_b)
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12, msg=name)


# ----------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("args,expected", [
    (["--returns-lse", "--kernel", "math"],
     "--kernel math --returns-lse: kernel math returned Tensor, not the pair (output, lse) that --returns-lse declares"),
    (["--returns-lse", "--kernel-api", "merge"], "--returns-lse declares that an SDPA-signature kernel returns"),
    (["--lse-base", "2"], "--lse-base: the base of the LSE a kernel returns (--returns-lse) or a merge kernel takes"),
    (["--kernel-api", "merge", "--kernel", "zoo.nn.partial:expand_heads"],
     "does not take merge_state's arguments (v_a, s_a, v_b, s_b)"),
    (["--kernel-api", "merge", "--kernel", "no_such_module:merge_state"], "cannot import 'no_such_module'"),
], ids=["bare-tensor", "returns-lse-with-merge", "lse-base-alone", "merge-signature", "merge-import"])
def test_bad_input_is_one_line(tmp_path, args, expected):
    proc, _ = _suite(tmp_path, LSE, "--device", "cpu", "--collect-only", *args)
    lines = [line for line in proc.stderr.splitlines() if "ERROR" in line]
    assert proc.returncode == 4 and len(lines) == 1 and expected in lines[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.output


def test_a_pair_without_returns_lse_is_named(tmp_path):
    proc, rows = _suite(tmp_path, str(KERNEL / "test_kernel.py"), "--device", "cpu", "-k", "shape",
                        "--kernel", "zoo.nn.partial:attention_with_lse", "--hypothesis-profile", "pinned")
    assert proc.returncode == 1 and rows, proc.output[-2000:]
    assert "a kernel that returns (output, lse) is declared with --returns-lse" in rows[0]["message"], rows[0]


def test_without_the_options_the_clauses_skip_with_the_reason(tmp_path):
    proc, rows = _suite(tmp_path, LSE, MERGE, "--device", "cpu", "--kernel", "math")
    reasons = {r["clause"]: r["message"] for r in rows}
    assert set(reasons) == {"LSE-ORACLE", "LSE-GRAD", "MERGE-ORACLE", "MERGE-EMPTY"}, proc.output[-2000:]
    assert {r["status"] for r in rows} == {"skipped"}
    assert "--returns-lse" in reasons["LSE-ORACLE"] and "--kernel-api merge" in reasons["MERGE-ORACLE"], reasons


def test_a_merge_that_breaks_the_contract_is_named():
    from properties.kernel.merge_guard import MergeKernel
    v, s = torch.zeros(3, 2, 4), torch.zeros(3, 2)
    cases = {"a bare tensor": (lambda v_a, s_a, v_b, s_b: v_a, "returned Tensor, not the pair (v, s)"),
             "a 16-bit LSE": (lambda v_a, s_a, v_b, s_b: (v_a, s_a.half()), "merged s dtype torch.float16 is not"),
             "a wrong shape": (lambda v_a, s_a, v_b, s_b: (v_a[:1], s_a), "output shape (1, 2, 4) != expected"),
             "NaN": (lambda v_a, s_a, v_b, s_b: (v_a * math.nan, s_a), "is finite")}
    for name, (fn, said) in cases.items():
        with pytest.raises(AssertionError, match=None) as raised:
            MergeKernel(name, fn).merge_state(v, s, v, s)
        assert said in str(raised.value), (name, str(raised.value))


def test_the_catalog_plugs_merge_and_lse_entries_in_as_a_user_does():
    entries = {e.name: e for e in MERGE_BUGS}
    merge = entries["merge_in_base_two"]
    assert (merge.option, merge.argument, merge.api) == (
        "--kernel-api=merge", "--kernel=properties.catalog.merge_bugs:merge_in_base_two", "merge")
    lse = entries["lse_in_base_two"]
    assert lse.plug_in == ["--kernel", "properties.catalog.merge_bugs:lse_in_base_two", "--returns-lse"]
