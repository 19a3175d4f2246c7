"""``task=verify``: run the spec suite (pytest properties/) on the model a config assembles, and report.

The suite runs in a child pytest process through pytest's public entry point — the same code as ``pytest
properties/`` — with ``--zoo-config`` naming the config this run composed (saved once, resolved, so the child
never composes it again), ``--kernel`` set to the attention kernel of the config, and
``--report-json``/``--junitxml`` pointed at a private temporary directory. The zoo never imports the suite:
it names it to pytest as the plugin ``properties.plugin``. Only when the run has finished are report.json, report.md and junit.xml moved into the output
directory, each by an atomic rename: an interrupted run leaves the previous reports or none, never half.
"""
from __future__ import annotations

import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from pathlib import Path

import torch
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from zoo.io.atomic import write_text
from zoo.tasks.plots import PLOTS_HINT, plots_available, write_figures

__all__ = ["run_suite", "summarize", "write_reports", "verify", "SweepSummary", "suite_dir"]

STATUS_ORDER = ("failed", "error", "passed", "skipped")


def suite_dir() -> Path:
    """Where the suite's package lies, found without importing it (the zoo does not depend on the suite)."""
    spec = importlib.util.find_spec("properties")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the spec suite (package 'properties') is not installed beside the zoo")
    return Path(next(iter(spec.submodule_search_locations)))


def run_suite(config_path: Path, kernel: str | None, *, device: str, profile: str, workdir: Path,
              echo=True) -> tuple[int, Path, Path, float]:
    """Run pytest on the suite in a child process; returns (exit status, report json, junit xml, seconds)."""
    report, junit = workdir / "report.json", workdir / "junit.xml"
    suite = suite_dir()
    command = [sys.executable, "-m", "pytest", "-p", "properties.plugin", str(suite), "-p", "no:cacheprovider",
               "--rootdir", str(suite.parent), "-q", "--no-header", "-rN", "--color=no",
               f"--hypothesis-profile={profile}", "--device", device, "--zoo-config", str(config_path),
               "--report-json", str(report), "--junitxml", str(junit)]
    if kernel is not None:
        command += ["--kernel", kernel]
    start = time.perf_counter()
    result = subprocess.run(command, cwd=workdir, stdout=None if echo else subprocess.DEVNULL,
                            stderr=subprocess.STDOUT if not echo else None, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return result.returncode, report, junit, time.perf_counter() - start


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


def group_of(clause_id: str) -> str:
    """The clause group: the ID's first word (ATTN, MASK, MODEL, MHA, ...)."""
    return clause_id.split("-")[0]


def _detail(row: dict) -> str:
    """What a person reads first: the observed-vs-expected line, then the minimal counterexample."""
    message = " ".join(row["message"].split("Failing test case:")[0].split("Falsifying example:")[0].split())
    if row["counterexample"]:
        return f"{message[:240]}{'...' if len(message) > 240 else ''} | {row['counterexample']}"
    return message


def _table(rows) -> str:
    lines = [f"{'clause':<26} {'status':<8} {'time':>7}  counterexample / reason"]
    for row in rows.values():
        detail = _detail(row)
        lines.append(f"{row['clause']:<26} {row['status']:<8} {row['time_s']:>6.2f}s  "
                     f"{detail[:400] if row['status'] != 'passed' else ''}")
    return "\n".join(lines)


def _markdown(cfg_yaml: str, rows, totals: dict, figures: dict[str, str], overrides: list[str]) -> str:
    out = ["# Verification report", "",
           f"`python -m zoo {' '.join(overrides)}` — "
           f"{totals['passed']} passed, {totals['failed']} failed, {totals['skipped']} skipped "
           f"in {totals['seconds']:.1f} s (torch {torch.__version__}).", "",
           "| clause | status | time (s) | counterexample / reason |", "| --- | --- | ---: | --- |"]
    for row in rows.values():
        detail = _detail(row).replace("|", "\\|")
        out.append(f"| {row['clause']} | {row['status']} | {row['time_s']:.2f} | "
                   f"{detail if row['status'] != 'passed' else ''} |")
    out += ["", "## Pictures", ""]
    if figures:
        out += [f"![{title}]({name})" for title, name in figures.items()]
    else:
        out.append(f"No pictures: {PLOTS_HINT}.")
    out += ["", "## Configuration", "", "```yaml", cfg_yaml.rstrip(), "```", ""]
    return "\n".join(out)


def write_reports(out_dir: Path, *, cfg: DictConfig, overrides: list[str], records: list[dict], junit: Path,
                  seconds: float, status: int, figures: dict[str, str]) -> dict:
    rows = summarize(records)
    totals = {s: sum(1 for r in rows.values() if r["status"] == s) for s in STATUS_ORDER}
    totals["seconds"] = round(seconds, 2)
    cfg_yaml = OmegaConf.to_yaml(cfg, resolve=False)
    report = {
        "overrides": overrides, "config": OmegaConf.to_container(cfg, resolve=False),
        "status": "passed" if status == 0 else "failed", "exit_status": status, "totals": totals,
        "clauses": list(rows.values()), "tests": records, "figures": figures,
        "versions": {"torch": torch.__version__, "python": platform.python_version(),
                     "suite": _suite_version()},
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    write_text(out_dir / "report.json", json.dumps(report, indent=1, default=str))
    write_text(out_dir / "report.md", _markdown(cfg_yaml, rows, totals, figures, overrides))
    if junit.exists():
        write_text(out_dir / "junit.xml", junit.read_text(encoding="utf-8"))
    return report


def _suite_version() -> str:
    try:
        from importlib.metadata import version
        return version("transformer-zoo")
    except Exception:  # running from a source tree that was never installed
        return "unknown"


def configured_kernel(cfg: DictConfig) -> str | None:
    """The attention kernel of a config whose attention is the zoo's multi-head attention (or a subclass)."""
    from hydra.utils import get_class
    from zoo.nn.attention import MultiHeadAttention
    try:
        is_zoo_attention = issubclass(get_class(cfg.attention._target_), MultiHeadAttention)
    except Exception:  # a replacement that is not a class: it has no kernel option of ours
        return None
    kernel = cfg.attention.get("kernel") if is_zoo_attention else None
    return kernel if isinstance(kernel, str) else None


def verify(cfg: DictConfig, overrides: list[str], choices: dict[str, str], out_dir: Path, *, profile: str,
           model=None) -> int:
    """Run the suite on the configured model, print the clause table, write the reports; the exit status."""
    kernel = configured_kernel(cfg)
    print(f"verifying: pytest properties/ --zoo-config config.yaml{f' --kernel {kernel}' if kernel else ''} "
          f"--hypothesis-profile={profile}  (python -m zoo {' '.join(overrides)})", flush=True)
    with tempfile.TemporaryDirectory(prefix="zoo-verify-") as scratch:
        config_path = Path(scratch) / "config.yaml"  # the config composed once, for the child to load,
        OmegaConf.save(cfg, config_path, resolve=True)  # with Hydra's record of the options chosen beside it
        OmegaConf.save({"hydra": {"runtime": {"choices": choices}}}, Path(scratch) / "hydra.yaml")
        status, report_path, junit, seconds = run_suite(config_path, kernel, device=cfg.device, profile=profile,
                                                        workdir=Path(scratch))
        if status not in (0, 1) or not report_path.exists():  # usage error, interrupt or crash: no report
            print(f"zoo: verify: the suite did not run to the end (pytest exit status {status}); "
                  "no report written", file=sys.stderr)
            return status or 1
        records = json.loads(report_path.read_text(encoding="utf-8"))
        figures: dict[str, str] = {}
        if plots_available() and model is not None:
            figures = {title: path.name for title, path in write_figures(model, cfg.d_model, out_dir).items()}
        report = write_reports(out_dir, cfg=cfg, overrides=overrides, records=records, junit=junit,
                               seconds=seconds, status=status, figures=figures)
    rows = summarize(records)
    print()
    print(_table(rows))
    totals = report["totals"]
    print(f"\n{totals['passed']} clauses passed, {totals['failed'] + totals['error']} failed, "
          f"{totals['skipped']} skipped in {seconds:.1f} s; reports in {out_dir}")
    if not figures:
        print(f"(no pictures: {PLOTS_HINT})")
    return 0 if status == 0 else 1


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
            report = json.loads(path.read_text(encoding="utf-8"))
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
        common = set.intersection(*(set(overrides) for overrides, _, _ in jobs))  # show what the sweep varies
        jobs = [(" ".join(o for o in overrides if o not in common) or "(defaults)", verdict, cells)
                for overrides, verdict, cells in jobs]
        mark = {"passed": "pass", "failed": "FAIL", "error": "ERROR", "skipped": "-"}
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
