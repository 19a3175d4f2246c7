"""Every repository path that README.md, docs/ and properties/SPEC.md name exists: a file moved or renamed takes its
mentions with it. Links are tests/test_links.py's; this reads every path-shaped word, in prose and in code alike
(`properties/kernel/guard.py`, `properties/kernel/test_*.py`, `examples/my_kernel.py:attention`)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# docs/CHANGELOG.md is left out: it records what changed when, in the paths of its day (a file later moved keeps its
# old name there); every other page states what is.
DOCUMENTS = sorted({ROOT / "README.md", ROOT / "properties" / "SPEC.md", *(ROOT / "docs").rglob("*.md"),
                    *[p for p in [ROOT / "properties" / "README.md"] if p.exists()]} - {ROOT / "docs" / "CHANGELOG.md"})
TOP_FOLDERS = ("zoo", "properties", "tests", "docs", "examples", "bench", "conf", ".ci")
_PATH = re.compile(rf"(?<![\w./-])((?:{'|'.join(re.escape(f) for f in TOP_FOLDERS)})/[\w./*<>-]*[\w/*>])")
# A placeholder segment (conf/task/NAME.yaml, DIR/<clause>-<n>.py) names a kind of file, not one file.
_PLACEHOLDER = re.compile(r"(^|/)[A-Z][A-Z_]*(\.|/|$)|<")
# Files that commands write and the repository does not hold: the path a document names, the command that writes it.
OUTPUTS = {"bench/results_gpu.json": "python -m bench.gpu_check (on a machine with CUDA)"}


def named_paths(path: Path) -> list[tuple[int, str]]:
    found = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        for match in _PATH.finditer(line):
            name = match.group(1).rstrip(".")
            if not _PLACEHOLDER.search(name):
                found.append((number, name))
    return found


def _exists(name: str) -> bool:
    if "*" in name:
        return any(ROOT.glob(name))
    return (ROOT / name).exists() or name in OUTPUTS


@pytest.mark.parametrize("document", DOCUMENTS, ids=[str(d.relative_to(ROOT)) for d in DOCUMENTS])
def test_every_named_path_exists(document):
    missing = [f"line {number}: {name}" for number, name in named_paths(document) if not _exists(name)]
    assert not missing, f"{document.relative_to(ROOT)} names paths the repository does not hold: {missing}"


def test_the_path_reader_sees_paths_in_prose_code_and_globs(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("See `properties/kernel/guard.py:GuardedKernel`, properties/kernel/test_*.py and zoo/nn/.\n"
                    "Not conf/task/NAME.yaml, nor DIR/<clause>-<n>.py, nor xzoo/nn.\n", encoding="utf-8")
    assert [name for _, name in named_paths(page)] == ["properties/kernel/guard.py", "properties/kernel/test_*.py",
                                                       "zoo/nn/"]
    assert _exists("properties/kernel/test_*.py") and not _exists("properties/core/repeats.py")


# What a page states is what is: the history of a change (the issue that asked for it, how it was before) is the
# CHANGELOG's. Issue numbers of other projects (pytorch/pytorch#123, transformers #25306) are sources, not history.
HISTORY = re.compile(r"(?<![\w/#-])[Ii]ssue \d+|\(issue \d+|before this change|\bused to (?:see|be|skip|pass|fail)\b"
                     r"|load ≈|\bat load \d")


def history_lines(path: Path) -> list[str]:
    return [f"line {number}: {line.strip()[:100]}" for number, line in
            enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if HISTORY.search(line)]


@pytest.mark.parametrize("document", DOCUMENTS, ids=[str(d.relative_to(ROOT)) for d in DOCUMENTS])
def test_every_page_but_the_changelog_states_what_is(document):
    told = history_lines(document)
    assert not told, f"{document.relative_to(ROOT)} tells history (the CHANGELOG's): {told}"


def test_the_history_reader_tells_a_source_from_history(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("pytorch/pytorch#141429; transformers issue #25306\nthe fix of issue 33\n(main before this change)\n"
                    "measured at load ≈ 8\n", encoding="utf-8")
    assert [line.split(":")[0] for line in history_lines(page)] == ["line 2", "line 3", "line 4"]
