"""The reports of ``task=verify`` (zoo/tasks/verify.py runs the suite): the clause table, report.json, report.md
and junit.xml written atomically under the first free suffix, the pictures, and a sweep's summary matrix.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import platform
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Iterator

import torch
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from zoo.io.bounded import read_json
from zoo.io.atomic import write_text
from zoo.tasks.plots import PLOTS_HINT, plots_available, write_figures

__all__ = ["summarize", "write_reports", "SweepSummary", "STATUS_ORDER", "REPORT_FILES", "group_of", "free_suffix",
           "clause_table", "suffixed_name", "reports_lock", "draw_pictures"]

STATUS_ORDER = ("failed", "error", "passed", "skipped")


def summarize(records: list[dict]) -> "OrderedDict[str, dict]":
    """One row per clause: its worst status over every test run for it, total time, first failure message."""
    rows: OrderedDict[str, dict] = OrderedDict()
    for record in records:
        row = rows.setdefault(record["clause"], {"clause": record["clause"], "title": record["title"],
                                                 "status": "skipped", "time_s": 0.0, "tests": 0,
                                                 "counterexample": "", "message": ""})
        row["time_s"] += record["duration_s"]
        row["tests"] += 1
        if STATUS_ORDER.index(record["status"]) < STATUS_ORDER.index(row["status"]):
            row["status"] = record["status"]
            if record["status"] in ("failed", "error"):
                row["message"] = record["message"]
                row["counterexample"] = record.get("counterexample", "")
        if record["status"] == "skipped" and row["status"] == "skipped" and not row["message"]:
            row["message"] = record["message"]
    return rows


def model_dtypes(records: list[dict]) -> list[str]:
    """The dtypes the model clauses called the model in, over every test (its outputs' dtypes)."""
    return sorted({d for record in records for d in record.get("model_dtypes") or ()})


def group_of(clause_id: str) -> str:
    """The clause group: the ID's first word (ATTN, MASK, MODEL, MHA, ...)."""
    return clause_id.split("-")[0]


def _detail(row: dict) -> str:
    """What a person reads first: the observed-vs-expected line, then the minimal counterexample."""
    message = " ".join(row["message"].split("Failing test case:")[0].split("Falsifying example:")[0].split())
    if row["counterexample"]:
        return f"{message[:240]}{'...' if len(message) > 240 else ''} | {row['counterexample']}"
    return message


def clause_table(rows) -> str:
    """The clauses of ``summarize``'s rows as the text table a run prints: status, time, and what failed."""
    lines = [f"{'clause':<26} {'status':<8} {'time':>7}  counterexample / reason"]
    for row in rows.values():
        detail = _detail(row)
        lines.append(f"{row['clause']:<26} {row['status']:<8} {row['time_s']:>6.2f}s  "
                     f"{detail[:400] if row['status'] != 'passed' else ''}")
    return "\n".join(lines)


def _markdown(cfg_yaml: str, rows, totals: dict, figures: dict[str, str], overrides: list[str], *,
              notes: dict[str, str] | None = None, problem: str = "", output_tail: str = "",
              called: list[str] = ()) -> str:
    out = ["# Verification report", "",
           f"`python -m zoo {' '.join(overrides)}` — "
           f"{totals['passed']} passed, {totals['failed']} failed, {totals['skipped']} skipped "
           f"in {totals['seconds']:.1f} s (torch {torch.__version__}).", ""]
    if called:
        out += [f"The model clauses ran the model in {', '.join(called)} (its own dtype, and float64 where a clause "
                f"compares with its float64 twin).", ""]
    if problem:
        out += [f"**The run broke: {problem}.** The table holds what was recorded before it did.", ""]
        if output_tail:
            out += ["The last lines pytest printed:", "", "```text", output_tail.rstrip(), "```", ""]
    out += ["| clause | status | time (s) | counterexample / reason |", "| --- | --- | ---: | --- |"]
    for row in rows.values():
        detail = _detail(row).replace("|", "\\|")
        out.append(f"| {row['clause']} | {row['status']} | {row['time_s']:.2f} | "
                   f"{detail if row['status'] != 'passed' else ''} |")
    out += ["", "## Pictures", ""]
    if figures:
        out += [f"![{title}]({name})" for title, name in figures.items()]
    if figures and notes:
        out.append("")
    for title, note in (notes or {}).items():
        out.append(f"- {title}: not drawn: {note}")
    if not figures and not notes:
        out.append(f"No pictures: {PLOTS_HINT}.")
    out += ["", "## Configuration", "", "```yaml", cfg_yaml.rstrip(), "```", ""]
    return "\n".join(out)


def suffixed_name(name: str, suffix: str) -> str:
    """``report.md`` with suffix ``-2``: ``report-2.md`` (the suffix before the extension)."""
    stem, dot, ext = name.rpartition(".")
    return f"{stem}{suffix}.{ext}" if dot else f"{name}{suffix}"


REPORT_FILES = ("report.json", "report.md", "junit.xml")


def write_reports(out_dir: Path, *, cfg: DictConfig, overrides: list[str], records: list[dict], junit: Path,
                  seconds: float, status: int, figures: dict[str, str], suffix: str = "",
                  notes: dict[str, str] | None = None, problem: str = "", output_tail: str = "") -> dict:
    """report.json, report.md and junit.xml (with `suffix` before the extension), each written atomically.
    `status` is the exit status of the run: 0 passed, 1 clauses failed, 2 the run broke (`problem` says how)."""
    rows = summarize(records)
    totals = {s: sum(1 for r in rows.values() if r["status"] == s) for s in STATUS_ORDER}
    called = model_dtypes(records)
    totals["seconds"] = round(seconds, 2)
    cfg_yaml = OmegaConf.to_yaml(cfg, resolve=False)
    report = {
        "overrides": overrides, "config": OmegaConf.to_container(cfg, resolve=False),
        "status": "passed" if status == 0 else "failed" if status == 1 else "broken", "exit_status": status,
        "problem": problem, "totals": totals, "model_dtypes": called,
        "clauses": list(rows.values()), "tests": records, "figures": figures, "figure_notes": notes or {},
        "versions": {"torch": torch.__version__, "python": platform.python_version(),
                     "suite": _suite_version()},
    }
    if problem:
        report["output_tail"] = output_tail
    out_dir.mkdir(parents=True, exist_ok=True)
    if junit.exists():
        write_text(out_dir / suffixed_name("junit.xml", suffix), junit.read_text(encoding="utf-8"))
    write_text(out_dir / suffixed_name("report.md", suffix),
               _markdown(cfg_yaml, rows, totals, figures, overrides, notes=notes, problem=problem,
                         output_tail=output_tail, called=called))
    write_text(out_dir / suffixed_name("report.json", suffix), json.dumps(report, indent=1, default=str))
    return report


@contextlib.contextmanager
def reports_lock(out_dir: Path) -> Iterator[None]:
    """An exclusive lock on out_dir's reports (flock on a hidden file; released by the kernel if we die)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # no flock (Windows): the suffix check alone
        yield
        return
    with open(out_dir / ".zoo-reports.lock", "a") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def free_suffix(out_dir: Path, names) -> str:
    """'' if none of `names` exists in out_dir, else the first '-N' (N = 2, 3, ...) free for all of them."""
    for n in itertools.count(1):
        suffix = "" if n == 1 else f"-{n}"
        if not any((out_dir / suffixed_name(name, suffix)).exists() for name in names):
            return suffix
    raise AssertionError("unreachable")


def _suite_version() -> str:
    try:
        from importlib.metadata import version
        return version("transformer-zoo")
    except Exception:  # running from a source tree that was never installed
        return "unknown"


def draw_pictures(model, d_model: int, where: Path) -> tuple[dict[str, Path], dict[str, str]]:
    """The pictures, drawn into `where`; one that cannot be drawn is a note, never a lost report."""
    notes: dict[str, str] = {}
    if model is None or not plots_available():
        return {}, notes
    try:
        return write_figures(model, d_model, where, notes=notes), notes
    except Exception as exc:  # matplotlib itself failing: note it, keep the report
        notes["pictures"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        return {}, notes


MAX_REPORT_BYTES = 64 << 20  # a report.json holds one record per clause: a few hundred KiB


class SweepSummary(Callback):
    """Hydra callback: after a multirun, one matrix of configs × clause groups in the sweep directory."""

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        reports = sorted(sweep_dir.glob("*/report.json"), key=lambda p: int(p.parent.name)
                         if p.parent.name.isdigit() else 0)
        if not reports:
            return
        jobs, groups = [], OrderedDict()
        for path in reports:
            try:
                report = read_json(path, max_bytes=MAX_REPORT_BYTES, what="report.json")
            except (OSError, ValueError) as exc:  # one unreadable report must not cost the summary of the others
                print(f"zoo: sweep summary: {path} skipped: {type(exc).__name__}: {exc}", file=sys.stderr)
                continue
            cells: dict[str, str] = {}
            for row in report["clauses"]:
                group = group_of(row["clause"])
                groups[group] = None
                before = cells.get(group, "skipped")
                if STATUS_ORDER.index(row["status"]) < STATUS_ORDER.index(before):
                    cells[group] = row["status"]
                else:
                    cells.setdefault(group, before)
            jobs.append((report["overrides"], report["status"], cells))
        if not jobs:
            return
        common = set.intersection(*(set(overrides) for overrides, _, _ in jobs))  # show what the sweep varies
        jobs = [(" ".join(o for o in overrides if o not in common) or "(defaults)", verdict, cells)
                for overrides, verdict, cells in jobs]
        mark = {"passed": "pass", "failed": "FAIL", "error": "ERROR", "skipped": "-", "broken": "BROKEN"}
        header = ["config", "verdict", *groups]
        lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
        for name, verdict, cells in jobs:
            lines.append("| " + " | ".join([f"`{name}`", verdict] + [mark[cells.get(g, "skipped")] for g in groups])
                         + " |")
        failed = sum(1 for _, verdict, _ in jobs if verdict != "passed")
        text = (f"# Sweep summary\n\n{len(jobs)} configurations ({' '.join(sorted(common))} in all), "
                f"{failed} with a failing clause.\n\n"
                + "\n".join(lines) + "\n")
        write_text(sweep_dir / "summary.md", text)
        write_text(sweep_dir / "summary.json", json.dumps(
            [{"config": name, "verdict": verdict, "groups": cells} for name, verdict, cells in jobs], indent=1))
        print(f"\n{text}\nsummary written to {sweep_dir / 'summary.md'}")
