"""Kernels that decline part of the contract, as fused kernels do, verified without a false alarm and without a wrong
skip (properties/catalog/declining.py: PyTorch's flash, memory-efficient and cuDNN backends' limits, and kernels that
decline only grouped heads, only masks, all but 4-D inputs, all but causal problems, all but L = S).

The profiles run the kernel-level suite as a user does (``pytest properties/ --kernel A --kernel B ...``, one session
forked from the catalog's session server, each kernel's rows of the report its own: properties/catalog/run.py,
``run_together``) at the suite's ``quick`` Hypothesis profile (see ``PROFILE`` below). None may fail a clause; a clause may be skipped
only when the profile runs none of its problems (``CANNOT_RUN``), with the profile's own words, never blaming a
feature it does not decline (a GQA decline taken for a gradient decline, say); every other kernel clause must pass
with at least one problem run. Also here, in process: cuDNN's rows without admissible key, and the zoo's ``torch``
kernel keeping its promise over a stand-in of them.
"""
from __future__ import annotations

import pytest
import torch

from properties.catalog import Entry
from properties.catalog.declining import PROFILES, TAGS, cannot_run, cudnn_bool_mask_rows, zoo_torch_on_cudnn_rows
from properties.catalog.run import Run, run_together
from properties.kernel.guard import GuardedKernel, check_against_oracle
from shared_runs import SharedRuns, common_directory

NAMES = list(PROFILES)
# Skips that concern no kernel (a reference kernel not given, no CUDA device, the FlashAttention-API tests, a
# contract the run did not declare: --deterministic, --batch-invariant).
NOT_ABOUT_THE_KERNEL = ("no --reference-kernel given", "CUDA not available", "--kernel-api", "a declared contract: run with")


# The claim is about which clauses a declining kernel runs and how the others are skipped, not about how many draws
# each clause makes: ``quick`` runs every pinned problem (fitted into the kernel's limits) and 3 draws per clause
# instead of the default's 12, so each clause the profile can run still runs problems (asserted: ``run >= 1``), and a
# clause it cannot run is still declined on every problem and skipped with the profile's words. The seed is fixed, so
# the run is the same every time.
PROFILE = ("--hypothesis-profile", "quick")


def _entry(name: str) -> Entry:
    return Entry(name, "kernel", PROFILES[name].__doc__ or name, (), "--kernel", f"properties.catalog.declining:{name}")


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory) -> dict[str, Run]:
    """name -> its Run: the selected profiles in one session (its start-up paid once), each kernel on every clause as
    if alone, run once per test run (under pytest-xdist, by the first worker that needs it; every worker has
    collected the same selection)."""
    selected = [name for name in NAMES if any(
        item.module.__name__ == __name__ and getattr(item, "callspec", None) is not None and
        item.callspec.params.get("name") == name for item in request.session.items)]

    def run_selected(_: str) -> list[Run]:
        return run_together([_entry(name) for name in selected], seed=0, extra=PROFILE)

    if not hasattr(request.config, "workerinput"):
        return {run.entry.name: run for run in run_selected("")}
    shared = SharedRuns(common_directory(tmp_path_factory), run_selected, prefix="declining")
    return {run.entry.name: run for run in shared.runs("all" if selected == NAMES else "-".join(selected))}


@pytest.mark.parametrize("name", NAMES)
def test_a_declining_kernel_passes_every_clause_it_can_run_and_skips_the_others_for_its_own_reason(runs, name):
    run = runs[name]
    explain = f"{' '.join(run.command[2:])}\nexit status {run.returncode}\n{run.output[-3000:]}"
    kernel_tests = [t for t in run.tests if "/test_flash" not in t["nodeid"]]
    failed = [f"{t['nodeid']}: {t['message'][:300]}" for t in kernel_tests if t["status"] in ("failed", "error")]
    assert run.returncode == 0 and not failed, f"{name}: {failed}\n{explain}"
    coverage = {row["nodeid"]: row.get("coverage") for row in run.rows}
    for test in kernel_tests:
        message = test["message"] or ""
        if test["status"] == "skipped" and any(words in message for words in NOT_ABOUT_THE_KERNEL):
            continue
        unrunnable = [c for c in test["clauses"] if cannot_run(name, c)]
        if unrunnable:
            assert test["status"] == "skipped" and TAGS[name] in message, (name, test["nodeid"], message)
            assert "require grad" not in message and "dropout clauses" not in message, (name, message)
        else:
            ran = (coverage.get(test["nodeid"]) or {}).get("run", 0)
            assert test["status"] == "passed" and ran >= 1, (name, test["nodeid"], test["status"], message[:300], ran)


# ------------------------------------------------------------------- cuDNN's rows without an admissible key
def _no_key_problem(dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 16, generator=g, dtype=torch.float64).to(dtype) for _ in range(3))
    mask = torch.rand(8, 8, generator=g) < 0.5
    mask[0] = False            # query 0 admits no key
    mask[1:, 3] = False        # key 3: no query may attend it
    mask[1:, 0] = True
    return q, k, v, mask


def test_the_cudnn_stand_in_fails_with_the_symptom_named():
    q, k, v, mask = _no_key_problem()
    with pytest.raises(AssertionError, match="a query whose bool mask admits no key does not come out as 0"):
        check_against_oracle(GuardedKernel("cudnn_bool_mask_rows", cudnn_bool_mask_rows), q, k, v, attn_mask=mask)


def test_the_zoo_torch_kernel_keeps_its_promise_over_cudnn_rows():
    q, k, v, mask = _no_key_problem()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = zoo_torch_on_cudnn_rows(*leaves, attn_mask=mask)
    assert bool((out[..., 0, :] == 0).all())
    check_against_oracle(GuardedKernel("zoo_torch_on_cudnn_rows", zoo_torch_on_cudnn_rows), q, k, v, attn_mask=mask)
    out.backward(torch.ones_like(out))
    assert bool((leaves[1].grad[..., 3, :] == 0).all()) and bool((leaves[2].grad[..., 3, :] == 0).all())
    raw = [t.clone().requires_grad_() for t in (q, k, v)]
    cudnn_bool_mask_rows(*raw, attn_mask=mask).backward(torch.ones_like(out))
    assert bool((raw[2].grad[..., 3, :] != 0).any()), "the stand-in shows cuDNN's symptom: dV of a key no query sees"


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the repro runs the backend itself")
def test_the_cudnn_repro_says_it_needs_cuda_and_exits_0(capsys):
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "examples" / "repro_cudnn_bool_mask_rows.py"
    spec = importlib.util.spec_from_file_location("repro_cudnn_bool_mask_rows", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main() == 0 and "needs CUDA" in capsys.readouterr().out
