"""The example factories pass the model clauses, run the way a user runs them:
``pytest properties/ --model <factory>`` in a new pytest session (and ``--zoo`` for a zoo model from overrides)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from properties.catalog.sessions import run_pytest

ROOT = Path(__file__).resolve().parents[1]
ALL = {"MODEL-SHAPE", "MODEL-CAUSAL", "MODEL-DEPENDENCE", "MODEL-PERMUTATION", "MODEL-BATCH", "MODEL-PADDING",
       "MODEL-DETERMINISM", "MODEL-DISTRIBUTION", "MODEL-FACTORISATION", "MODEL-KV-CACHE", "MODEL-LENGTH",
       "MODEL-GRADIENT"}
DECODER_ONLY = ALL - {"MODEL-DEPENDENCE", "MODEL-PERMUTATION"}
ENCODER_DECODER = ALL - {"MODEL-PERMUTATION"}
ENCODER_ONLY = ALL - {"MODEL-CAUSAL", "MODEL-DEPENDENCE", "MODEL-DISTRIBUTION", "MODEL-FACTORISATION",
                      "MODEL-KV-CACHE"}

CASES = [
    # (option, value, clauses that must have passed at least one test)
    ("--model", "examples.huggingface:gpt2", DECODER_ONLY),            # the pkg.module:factory form
    ("--model", "examples/huggingface.py:bert", ENCODER_ONLY),          # the path/to/file.py:factory form
    ("--model", "examples/huggingface.py:bart", ENCODER_DECODER),
    ("--model", "examples/torch_nn.py:encoder", ENCODER_ONLY),
    ("--model", "examples/torch_nn.py:transformer", ENCODER_DECODER - {"MODEL-KV-CACHE"}),  # no cache
    ("--model", "examples/xtransformers.py:decoder", DECODER_ONLY - {"MODEL-KV-CACHE"}),  # one-token cache only
    ("--model", "examples/xtransformers.py:decoder_rotary", DECODER_ONLY - {"MODEL-KV-CACHE"}),
    ("--model", "examples/xtransformers.py:encoder", ENCODER_ONLY),
    ("--zoo", "model=encoder_decoder pos=rotary d_model=32 heads=2 layers=1 d_ff=64 vocab_size=64 max_len=16",
     ENCODER_DECODER),
]


@pytest.mark.parametrize("option,value,expected", CASES, ids=[c[1].split()[0].split(":")[-1] for c in CASES])
def test_example_passes_the_model_clauses(tmp_path, option, value, expected):
    pytest.importorskip("x_transformers" if "xtransformers" in value else "transformers")
    report = tmp_path / "report.json"
    proc = run_pytest(["properties/model", "-m", "model", "-q", "--report-json", str(report), option, value], cwd=ROOT,
                      timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    rows = json.loads(report.read_text())
    passed = {row["clause"] for row in rows if row["status"] == "passed"}
    assert expected <= passed, f"clauses that did not run: {sorted(expected - passed)}"
    assert not [row for row in rows if row["status"] in ("failed", "error")]
