"""Every link in the project's Markdown resolves inside the repository: a clone has everything its documents
point to (the sources of the spec are in docs/sources/), and no document points outside the repository."""
from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = sorted({ROOT / "README.md", ROOT / "properties" / "SPEC.md", *(ROOT / "docs").rglob("*.md"),
                    *[p for p in [ROOT / "properties" / "README.md"] if p.exists()]})

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_CODE_SPAN = re.compile(r"(`+)(?!`)(?:(?!\n[ \t]*\n).)+?(?<!`)\1(?!`)", re.DOTALL)
_INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
_REFERENCE_DEFINITION = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.MULTILINE)
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_HTML_ANCHOR = re.compile(r"<a\s+(?:[^>]*\s)?(?:id|name)=[\"']([^\"']+)[\"']", re.IGNORECASE)
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def _prose(text: str, code_spans: bool = True) -> str:
    """The text outside fenced code blocks and (unless told otherwise) code spans: a link in code is not a link."""
    lines, fence = [], None
    for line in text.splitlines():
        match = _FENCE.match(line)
        if fence is None and match:
            fence = match.group(1)[0] * len(match.group(1))
            lines.append("")
        elif fence is not None:
            if line.strip().startswith(fence) and not line.strip().strip(fence[0]):
                fence = None
            lines.append("")
        else:
            lines.append(line)
    text = "\n".join(lines)
    return _CODE_SPAN.sub("code", text) if code_spans else text


def links(path: Path) -> list[str]:
    prose = _prose(path.read_text(encoding="utf-8"))
    return [m.group(1) for m in _INLINE_LINK.finditer(prose)] + _REFERENCE_DEFINITION.findall(prose)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: inline markup dropped, lower case, punctuation other than '-' and '_'
    removed, each space a '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"(`+)(.+?)\1", r"\2", text).replace("*", "").lower()
    return "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LMN").replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found, seen = set(), {}
    text = path.read_text(encoding="utf-8")
    for line in _prose(text, code_spans=False).splitlines():
        match = _HEADING.match(line)
        if match:
            slug = _slug(match.group(2))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            found.add(slug if count == 0 else f"{slug}-{count}")
    return found | set(_HTML_ANCHOR.findall(text))


def problems(document: Path) -> list[str]:
    out = []
    for target in links(document):
        if not target:
            out.append("an empty link target")
            continue
        if _SCHEME.match(target) or target.startswith(("/", "\\", "//")):
            out.append(f"{target}: points outside the repository (use a relative link to a file in it, e.g. docs/sources/)")
            continue
        location, _, anchor = target.partition("#")
        resolved = (document.parent / location).resolve() if location else document
        if ROOT not in resolved.parents and resolved != ROOT:
            out.append(f"{target}: points outside the repository")
        elif not resolved.exists():
            out.append(f"{target}: no such file in the repository")
        elif anchor:
            if resolved.suffix != ".md":
                out.append(f"{target}: an anchor into a file that is not Markdown")
            elif anchor not in anchors(resolved):
                out.append(f"{target}: no heading with anchor #{anchor} in {resolved.relative_to(ROOT)}")
    return out


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve_inside_the_repository(document):
    assert not problems(document), f"{document.relative_to(ROOT)}:\n  " + "\n  ".join(problems(document))


def test_every_source_note_is_indexed():
    index = ROOT / "docs" / "sources" / "README.md"
    linked = {(index.parent / target.partition("#")[0]).resolve() for target in links(index)}
    notes = {p.resolve() for p in index.parent.glob("*.md") if p != index}
    assert notes and notes <= linked, f"not in {index.relative_to(ROOT)}: {sorted(p.name for p in notes - linked)}"


def test_the_checker_sees_what_it_should(tmp_path, monkeypatch):
    """The checker itself: it finds inline, image and reference links, ignores code, and judges anchors."""
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# Title — with `code` and a dash\n\n## Same\n\n## Same\n")
    document = tmp_path / "README.md"
    document.write_text(
        "[ok](docs/a.md) ![img](docs/a.md) [anchor](docs/a.md#title--with-code-and-a-dash) [dup](docs/a.md#same-1)\n"
        "[here](#top) `[in code](nowhere.md)`\n\n```\n[in a fence](nowhere.md)\n```\n\n# Top\n\n"
        "[missing](docs/b.md) [bad anchor](docs/a.md#nope) [web](https://example.com) [up](../outside.md)\n"
        "[ref]: ../../shared/seeds/000.txt\n")
    found = problems(document)
    assert [p.split(":")[0] for p in found] == ["docs/b.md", "docs/a.md#nope", "https", "../outside.md",
                                                "../../shared/seeds/000.txt"], found


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_document_names_a_folder_outside_the_clone(document):
    """In prose or code: the spec's earlier notes are cited by file name, with our note on each in
    docs/sources/seed-notes.md; the folder they were collected in is not part of a clone."""
    text = document.read_text(encoding="utf-8")
    found = sorted(set(re.findall(r"(?:\.\./)*shared/\S*|seeds/\S+", text)))
    assert not found, f"{document.relative_to(ROOT)} names paths outside the repository: {found}"


def test_every_seed_the_spec_cites_has_a_note():
    spec = (ROOT / "properties" / "SPEC.md").read_text(encoding="utf-8")
    notes = (ROOT / "docs" / "sources" / "seed-notes.md").read_text(encoding="utf-8")
    cited = set(re.findall(r"seed `?(\d{3})", spec))
    assert cited, "SPEC.md cites no seed note (the pattern changed?)"
    missing = sorted(n for n in cited if f"## Seed {n}" not in notes)
    assert not missing, f"SPEC.md cites seeds without a section in docs/sources/seed-notes.md: {missing}"
