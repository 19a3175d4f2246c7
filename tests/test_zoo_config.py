"""``pytest properties/ --zoo-config PATH``: a resolved zoo config saved as YAML (what ``python -m zoo task=verify``
writes) selects the levels ``--zoo`` selects and builds the same model; its part nodes feed the module clauses."""
from __future__ import annotations

import json
from pathlib import Path

from omegaconf import OmegaConf

from properties.catalog.sessions import Session, run_pytest
from zoo.config.composition import compose_config

ROOT = Path(__file__).resolve().parents[1]


def _suite(tmp_path: Path, *args: str) -> Session:
    """``python -m pytest properties/ ARGS`` from the repository (a session forked from a server that imported torch
    once, with one intra-op thread: tiny models, and runs may share the machine)."""
    return run_pytest(["properties/", "-q", "-p", "no:randomly", *args], cwd=ROOT, timeout=600)


def _saved(tmp_path: Path, *overrides: str) -> Path:
    path = tmp_path / "config.yaml"
    OmegaConf.save(compose_config(list(overrides)), path, resolve=True)
    return path


def test_saved_config_runs_the_module_and_model_levels(tmp_path):
    config = _saved(tmp_path, "model=encoder_decoder", "pos=rotary")
    report = tmp_path / "report.json"
    proc = _suite(tmp_path, "-m", "module or model", "--zoo-config", str(config), "--report-json", str(report))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    rows = json.loads(report.read_text())
    assert not [row for row in rows if row["status"] in ("failed", "error")]
    passed = {(row["level"], row["clause"]) for row in rows if row["status"] == "passed"}
    assert {level for level, _ in passed} == {"module", "model"}
    # the model built is the encoder-decoder: its causal and cache clauses ran; its parts met the module clauses
    assert {("model", "MODEL-CAUSAL"), ("model", "MODEL-KV-CACHE"), ("module", "MHA-ORACLE")} <= passed
    assert any(clause.startswith("LAYER-") for level, clause in passed)


def test_zoo_and_zoo_config_are_exclusive(tmp_path):
    config = _saved(tmp_path)
    proc = _suite(tmp_path, "--zoo", "model=decoder_only", "--zoo-config", str(config))
    assert proc.returncode == 4, proc.stdout[-2000:] + proc.stderr[-2000:]  # usage error
    errors = [line for line in proc.stderr.splitlines() if line.startswith("ERROR")]
    assert errors == ["ERROR: --zoo and --zoo-config both name a zoo model: give one"], proc.stderr


def test_unusable_zoo_config_is_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("d_model: [unclosed\n")
    proc = _suite(tmp_path, "--zoo-config", str(bad))
    assert proc.returncode == 4
    errors = [line for line in proc.stderr.splitlines() if line.startswith("ERROR")]
    assert len(errors) == 1 and errors[0].startswith(f"ERROR: --zoo-config {str(bad)!r}: not a YAML config"), \
        proc.stderr
