"""README is a front page (issue 31): at most 200 lines, its three recipes within the first 60, and each recipe
runs as written, from a directory of the user's own (the `examples/` of the clone beside it).

The recipes are the code blocks after `<!-- recipe: NAME -->` markers: `kernel` (a bash block), `my_model.py` (the
file the `model` block runs) and `zoo`. Their pytest lines run as written; the zoo recipe's `task=summary` line runs
as written and its `task=verify` lines pass every check `python -m zoo` makes before it starts (the task itself is
tests/test_verify.py's subject), so that the recipes cost the test command little.
"""
from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from properties.catalog.sessions import run_pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_LINES, FIRST_SCREEN = 200, 60
RECIPE = re.compile(r"^<!-- recipe: (\S+) -->\n```\w*\n(.*?)^```$", re.M | re.S)


def recipes(text: str) -> dict[str, tuple[int, str]]:
    """NAME -> (the line number of the block's closing fence, the block's text) for every recipe marker."""
    found = {}
    for match in RECIPE.finditer(text):
        found[match.group(1)] = (text[:match.end()].count("\n") + 1, match.group(2))
    return found


def commands(block: str) -> list[str]:
    """The shell lines of a bash recipe, comments dropped."""
    lines = [shlex.split(line, comments=True) for line in block.splitlines()]
    return [shlex.join(words) for words in lines if words]


def test_readme_is_a_front_page_with_three_recipes_on_its_first_screen():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= MAX_LINES, f"README.md has {len(text.splitlines())} lines (at most {MAX_LINES})"
    found = recipes(text)
    assert set(found) == {"kernel", "my_model.py", "model", "zoo"}, sorted(found)
    late = {name: end for name, (end, _) in found.items() if end > FIRST_SCREEN}
    assert not late, f"recipes ending past line {FIRST_SCREEN}: {late}"
    assert len(found["my_model.py"][1].splitlines()) == 4, "the Hugging Face factory is four lines"
    assert all(len(found[name][1].splitlines()) <= 3 for name in ("kernel", "model", "zoo"))


def test_the_check_finds_recipes_and_their_lines():
    text = "# t\n\n<!-- recipe: zoo -->\n```bash\n# a comment\npython -m zoo a=1  # why\n```\n"
    assert recipes(text) == {"zoo": (7, "# a comment\npython -m zoo a=1  # why\n")}
    assert commands(recipes(text)["zoo"][1]) == ["python -m zoo a=1"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A user's directory: the clone's examples/ beside the files the recipes write."""
    work = tmp_path_factory.mktemp("user")
    (work / "examples").symlink_to(ROOT / "examples")
    for name, (_, block) in recipes(README.read_text(encoding="utf-8")).items():
        if name.endswith(".py"):
            (work / name).write_text(block)
    return work


def run_line(line: str, work: Path, *extra: str):
    """One recipe line as a shell runs it in `work`; pytest lines run in a forked session (torch imported once)."""
    words = shlex.split(line)
    if words[0] == "pytest":
        return run_pytest([*words[1:], "-p", "no:cacheprovider", *extra], cwd=work, timeout=600)
    done = subprocess.run(["bash", "-c", line], cwd=work, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, f"{line}\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
    return done


def clause_outcomes(report: Path) -> dict[str, set[str]]:
    outcome: dict[str, set[str]] = {}
    for row in json.loads(report.read_text()):
        outcome.setdefault(row["status"], set()).add(row["clause"])
    return outcome


def test_kernel_recipe_passes_every_kernel_clause(workdir):
    lines = commands(recipes(README.read_text(encoding="utf-8"))["kernel"][1])
    assert lines[-1].startswith("pytest --pyargs properties --kernel my.py:attention"), lines
    for line in lines[:-1]:
        run_line(line, workdir)
    report = workdir / "kernel.json"
    result = run_line(lines[-1], workdir, "-q", "--report-json", str(report))
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    outcome = clause_outcomes(report)
    assert {"ATTN-ORACLE", "SCALE-DEFAULT", "CAUSAL-NO-FUTURE", "MASK-FULLY-MASKED", "GQA-HEADS",
            "ATTN-GRAD"} <= outcome["passed"]
    assert not any(clause.startswith(("MODEL-", "MHA-")) for clause in outcome["passed"])  # kernel level only


def test_hugging_face_recipe_passes_the_model_clauses(workdir):
    pytest.importorskip("transformers")
    (line,) = commands(recipes(README.read_text(encoding="utf-8"))["model"][1])
    report = workdir / "model.json"
    result = run_line(line, workdir, "-q", "--hypothesis-profile", "quick", "--report-json", str(report))
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    outcome = clause_outcomes(report)
    assert {"MODEL-CAUSAL", "MODEL-PADDING", "MODEL-KV-CACHE", "MODEL-SHIFT"} <= outcome["passed"], outcome
    assert not any(clause.startswith(("ATTN-", "MHA-")) for clause in outcome["passed"])  # model level only


def test_zoo_recipe_runs_its_card_and_its_verify_commands_pass_every_check(workdir, monkeypatch):
    from cli_harness import zoo_in_process

    from zoo.cli.plan import plan

    lines = commands(recipes(README.read_text(encoding="utf-8"))["zoo"][1])
    assert lines and all(line.startswith("python -m zoo ") for line in lines), lines
    run_line("cp examples/my_kernel.py my.py", workdir)  # what the kernel recipe did first
    monkeypatch.chdir(workdir)
    for line in lines:
        arguments = shlex.split(line)[3:]
        if "task=summary" in arguments:
            outcome = zoo_in_process(arguments, workdir, real_tasks=True)
            assert outcome.status == 0 and "total" in outcome.out, outcome.err[-2000:]
        else:
            assert plan(arguments).mode == "run", line
