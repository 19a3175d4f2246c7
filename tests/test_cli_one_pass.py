"""`python -m zoo` composes each job once and validates it once, before any work, and builds the model once where its
task needs one (docs/ARCHITECTURE.md, "python -m zoo ..."); a refused command builds nothing.

Counted in this process (tests/cli_harness.py, the tasks real) by the code objects that run, so that no caller is
missed, whatever name it imported them under: Hydra's ``ConfigLoaderImpl.load_configuration`` (every composition,
whoever asks for it: the checks, Hydra's run, a sweep's batch check and its launcher), ``zoo.config.schema.validate``,
and the constructors of the model families and of ``MultiHeadAttention`` (the checks build one attention part on the
meta device to hear what its constructor refuses; a model builds one per layer)."""
from __future__ import annotations

import collections
import contextlib
import sys
import threading

import pytest

from cli_harness import assert_one_line_refusal, zoo_in_process

LAYERS = 2   # conf/preset/tiny.yaml, the default preset


@contextlib.contextmanager
def counting():
    """A Counter of compositions, validations, models and attention layers, filled while the block runs."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    from zoo.config.schema import validate
    from zoo.nn.attention import MultiHeadAttention
    from zoo.nn.models import DecoderOnly, EncoderDecoder, EncoderOnly

    watched = {ConfigLoaderImpl.load_configuration.__code__: "compositions", validate.__code__: "validations",
               MultiHeadAttention.__init__.__code__: "attention layers",
               **{family.__init__.__code__: "models" for family in (DecoderOnly, EncoderOnly, EncoderDecoder)}}
    counts: collections.Counter = collections.Counter()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code in watched:
            counts[watched[frame.f_code]] += 1

    previous = sys.getprofile()
    sys.setprofile(profile)
    threading.setprofile(profile)
    try:
        yield counts
    finally:
        sys.setprofile(previous)
        threading.setprofile(None)


@pytest.mark.parametrize("argv,printed", [
    (["model=decoder_only", "heads=8", "task=summary"], "DecoderOnly"),   # the card, built on the meta device
    (["model=decoder_only", "heads=8", "task.verify=false"], "forward"),  # task=run: card and a forward pass
])
def test_a_run_composes_validates_and_builds_once(tmp_path, argv, printed):
    with counting() as counts:
        outcome = zoo_in_process(argv, tmp_path, real_tasks=True)
    assert outcome.status == 0 and printed in outcome.out, outcome.err[-3000:]
    assert dict(counts) == {"compositions": 1, "validations": 1, "models": 1, "attention layers": 1 + LAYERS}, counts


def test_each_job_of_a_sweep_is_composed_validated_and_built_once(tmp_path):
    with counting() as counts:
        outcome = zoo_in_process(["-m", "heads=1,2", "task=summary"], tmp_path, real_tasks=True)
    assert outcome.status == 0 and outcome.out.count("DecoderOnly") >= 2, outcome.err[-3000:]
    assert sorted(p.name for p in (tmp_path / "multirun").glob("*/*/*") if p.is_dir()) == ["0", "1"]
    # the sweep's own config (its directory, its launcher), then each job's
    assert dict(counts) == {"compositions": 1 + 2, "validations": 2, "models": 2,
                            "attention layers": 2 * (1 + LAYERS)}, counts


@pytest.mark.parametrize("argv,words", [(["heads=3", "task=summary"], ["heads=3", "must divide"]),
                                        (["d_model=1073741824"], ["model too large"])])
def test_a_refused_command_is_composed_once_and_builds_no_model(tmp_path, argv, words):
    with counting() as counts:
        outcome = zoo_in_process(argv, tmp_path, real_tasks=True)
    assert_one_line_refusal(outcome, *words)
    assert counts["compositions"] == 1 and counts["validations"] == 1 and counts["models"] == 0, counts
