"""Declines honoured at every level, run as a user runs the suite (a kernel file of their own, ``pytest --pyargs
properties``): a kernel that declines float32 inside the zoo's attention leaves the module clauses judged on the
dtypes it takes, never failed on its documented decline; one that declines everything has the module and model
clauses skipped with its words; a reference kernel's
declines are named as the reference's, not the kernel's under test.
"""
from __future__ import annotations

import json
import textwrap

import pytest

from properties.catalog.sessions import run_pytest

KERNELS = textwrap.dedent('''
    import torch
    import torch.nn.functional as F

    def _sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                              is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)

    def float32_declined(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                         enable_gqa=False):
        if query.dtype == torch.float32:
            raise NotImplementedError("float32_declined: float32 is not supported")
        return _sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)

    def everything_declined(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                            enable_gqa=False):
        raise NotImplementedError("everything_declined: nothing is supported")

    def half_declined(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                      enable_gqa=False):
        if query.dtype in (torch.float16, torch.bfloat16):
            raise NotImplementedError("half_declined: half precision is not supported")
        return _sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
''')


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    path = tmp_path_factory.mktemp("declines") / "declining_kernels.py"
    path.write_text(KERNELS)
    return path


def _pytest(cwd, *words):
    """``python -m pytest --pyargs properties WORDS`` in ``cwd`` (a session forked from a server that imported torch
    once, properties/catalog/sessions.py)."""
    return run_pytest(["--pyargs", "properties", "-q", "-rs", "-p", "no:cacheprovider", "--hypothesis-profile",
                       "quick", *words], cwd=cwd, timeout=600)


def test_module_clauses_run_on_what_the_kernel_inside_accepts(kernels):
    run = _pytest(kernels.parent, "--zoo", f"attention.kernel={kernels}:float32_declined", "-m", "module",
                  "-k", "multihead")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "float32 is not supported" not in run.stdout, run.stdout[-3000:]   # not a failure, not a skip


def test_module_clauses_the_kernel_declines_entirely_are_skipped_with_its_words(kernels):
    run = _pytest(kernels.parent, "--zoo", f"attention.kernel={kernels}:everything_declined", "-m", "module",
                  "-k", "multihead and not HEAD_COUNT")
    assert " failed" not in run.stdout.splitlines()[-1], run.stdout[-3000:]
    skips = [line for line in run.stdout.splitlines() if "declined every example of this clause" in line]
    assert skips and all("everything_declined: nothing is supported" in line for line in skips), run.stdout[-3000:]


def test_model_clauses_the_kernel_declines_are_skipped_with_its_words(kernels):
    run = _pytest(kernels.parent, "--zoo", f"attention.kernel={kernels}:everything_declined", "-m", "model")
    assert " failed" not in run.stdout.splitlines()[-1], run.stdout[-3000:]
    skips = [line for line in run.stdout.splitlines() if "the model under test" in line]
    assert skips and all("everything_declined: nothing is supported" in line for line in skips), run.stdout[-3000:]


def test_a_reference_kernels_declines_are_named_as_the_references(kernels, tmp_path):
    report = tmp_path / "report.json"
    run = _pytest(kernels.parent, "--kernel", "torch.nn.functional:scaled_dot_product_attention",
                  "--reference-kernel", f"{kernels}:half_declined", "-k", "reference_kernel",
                  "--report-json", str(report))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    reasons = [reason for test in json.loads(report.read_text()) if test.get("coverage")
               for reason in test["coverage"]["reasons"]]
    assert reasons, "the reference kernel declined nothing: the test shows nothing"
    assert all(r.startswith(f"reference {kernels}:half_declined declined: NotImplementedError") for r in reasons), \
        reasons
