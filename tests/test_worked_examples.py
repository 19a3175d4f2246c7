"""The worked example of `--zoo` (docs/verify.md) passes, run as a user types it; README's kernel recipe, which runs
examples/my_kernel.py, is tests/test_readme_recipes.py's."""
from __future__ import annotations

import json
from pathlib import Path

from properties.catalog.sessions import run_pytest

ROOT = Path(__file__).resolve().parents[1]


def suite(tmp_path, *arguments: str) -> dict[str, set[str]]:
    report = tmp_path / "report.json"
    result = run_pytest(["properties/", "-q", "-p", "no:cacheprovider", "--report-json", str(report), *arguments],
                        cwd=ROOT, timeout=600, env={"PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    outcome: dict[str, set[str]] = {}
    for row in json.loads(report.read_text()):
        outcome.setdefault(row["status"], set()).add(row["clause"])
    return outcome


def test_my_attention_module_passes_the_module_and_model_clauses(tmp_path):
    # (-m: its module and model clauses; the kernel clauses of the zoo's kernels inside it are the spec suite's own
    # run, which the test command makes anyway)
    outcome = suite(tmp_path, "--zoo", "attention._target_=examples.my_attention.MyAttention", "-m", "module or model")
    assert {"MHA-ORACLE", "MHA-GQA", "MHA-HEAD-COUNT", "MODEL-CAUSAL", "MODEL-KV-CACHE"} <= outcome["passed"]
