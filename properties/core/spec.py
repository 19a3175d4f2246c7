"""The spec's clauses, parsed from SPEC.md.

A clause is a section of the exact form::

    ### ATTN-ROWSUM — Attention weights sum to 1 over keys
    **Statement.** <math>
    **Source.** <paper section / seed file / SDPA docs>

and may carry further ``**Name.**`` paragraphs (derivations, deviations).  IDs are stable: property tests
bind to them with ``@properties.clause(ID)`` and reports (JSON, CLI, mutation testing) key on them.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Clause", "SpecError", "SPEC_PATH", "load_clauses"]

SPEC_PATH = Path(__file__).resolve().parent.parent / "SPEC.md"

_HEADING = re.compile(r"^### (?P<id>[A-Z][A-Z0-9]*(?:-[A-Z0-9]+)+) — (?P<title>\S.*)$")
_FIELD = re.compile(r"^\*\*(?P<name>[A-Z][A-Za-z -]*)\.\*\*\s*(?P<text>.*)$")


class SpecError(ValueError):
    """SPEC.md is malformed (missing field, duplicate ID); the message names the line."""


@dataclass(frozen=True)
class Clause:
    id: str
    title: str
    statement: str
    source: str
    extra: dict[str, str] = field(default_factory=dict, compare=False)

    def describe(self) -> str:
        """The text a failure report shows: heading, statement, source."""
        return f"{self.id} — {self.title}\nStatement: {self.statement}\nSource: {self.source}"


def _finish(path, line_no, clause_id, title, fields, clauses):
    missing = [name for name in ("Statement", "Source") if not fields.get(name)]
    if missing:
        raise SpecError(f"{path}:{line_no}: clause {clause_id} lacks {' and '.join(missing)}")
    if clause_id in clauses:
        raise SpecError(f"{path}:{line_no}: clause {clause_id} is defined twice")
    extra = {k: v for k, v in fields.items() if k not in ("Statement", "Source")}
    clauses[clause_id] = Clause(clause_id, title, fields["Statement"], fields["Source"], extra)


@functools.lru_cache(maxsize=None)
def load_clauses(path: Path | str = SPEC_PATH) -> dict[str, Clause]:
    """All clauses of SPEC.md by ID, in document order."""
    clauses: dict[str, Clause] = {}
    current = None  # (line_no, id, title, fields, name of the field being read)
    for line_no, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        heading = _HEADING.match(line)
        if heading or line.startswith("#"):
            if current:
                _finish(path, current[0], current[1], current[2], current[3], clauses)
            current = [line_no, heading["id"], heading["title"].strip(), {}, None] if heading else None
            continue
        if current is None:
            continue
        fields = current[3]
        marker = _FIELD.match(line)
        if marker:
            current[4] = marker["name"]
            fields[current[4]] = marker["text"].strip()
        elif current[4] is not None and line.strip():
            fields[current[4]] = (fields[current[4]] + "\n" + line.rstrip()).strip()
    if current:
        _finish(path, current[0], current[1], current[2], current[3], clauses)
    return clauses
