"""Every config in the tree composes, validates and builds; every family trains a step in fp32 and bf16."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import zoo.conf
from zoo.config.builder import build_model, model_from_config
from zoo.config.composition import compose_config
from zoo.config.options import FAMILIES
from zoo.tasks.summary import random_inputs
from zoo.tasks.train import fit_config_to_data

CONF = Path(zoo.conf.__path__[0])
GROUPS = {group.name: sorted(p.stem for p in group.glob("*.yaml")) for group in CONF.iterdir() if group.is_dir()
          and not group.name.startswith("__")}


def test_tree_has_the_groups_the_issue_names():
    assert {"model", "attention", "ffn", "norm", "pos", "preset", "task"} <= set(GROUPS)
    assert set(GROUPS["model"]) == set(FAMILIES)
    assert {"vaswani_base", "gpt2_small", "bert_base", "tiny"} <= set(GROUPS["preset"])


@pytest.mark.parametrize("group,option", [(g, o) for g, options in GROUPS.items() for o in options])
def test_every_option_composes_and_builds(group, option):
    # Full-size presets are built on the meta device: the geometry is checked, no memory spent.
    device = "meta" if group == "preset" and option != "tiny" else "cpu"
    if group == "experiment":  # a whole training run, its task included: built as task=train builds it
        model = model_from_config(fit_config_to_data(compose_config([f"experiment={option}"]))[0])
    else:
        model = build_model([f"{group}={option}"], device=device)
    assert sum(p.numel() for p in model.parameters()) > 0


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("pos", GROUPS["pos"])
def test_every_family_with_every_position_scheme_builds(family, pos):
    model = build_model([f"model={family}", f"pos={pos}"])
    assert model.kind == family


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("family", FAMILIES)
def test_forward_and_backward(family, dtype):
    model = build_model([f"model={family}", "d_model=32", "heads=2", "layers=1", "d_ff=64", "vocab_size=50"],
                        dtype=dtype)
    inputs = random_inputs(model, 2, 7, generator=torch.Generator().manual_seed(0))
    out = model(*inputs)
    expected_last = model.d_model if family == "encoder_only" else model.vocab_size
    assert out.shape == (2, 7, expected_last) and out.dtype == dtype
    out.float().square().mean().backward()
    missing = [name for name, p in model.named_parameters() if p.grad is None]
    assert not missing, f"parameters without gradient: {missing}"
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_command_line_values_win_over_the_preset():
    cfg = compose_config(["preset=gpt2_small", "heads=8", "ffn=relu", "layers=2"])
    assert (cfg.heads, cfg.layers, cfg.ffn.activation, cfg.d_model) == (8, 2, "relu", 768)
