"""The presets have the published geometry: parameter counts equal the reference implementations'."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from zoo.config.builder import build_model
from zoo.tasks.summary import parameters_by_part


def count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())  # a tied tensor is yielded once


def zoo_count(preset: str) -> dict[str, int]:
    parts = parameters_by_part(build_model([f"preset={preset}"], device="meta"))
    return {"total": sum(parts.values()), **parts}


def test_vaswani_base_equals_torch_transformer():
    with torch.device("meta"):
        reference = nn.Transformer(512, 8, 6, 6, 2048)
    counts = zoo_count("vaswani_base")
    assert counts["total"] - counts["embeddings"] == count(reference) == 44_140_544
    assert counts["total"] == 44_140_544 + 37_000 * 512 == 63_084_544


def test_gpt2_small_equals_hugging_face():
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        reference = transformers.GPT2LMHeadModel(transformers.GPT2Config())
    assert zoo_count("gpt2_small")["total"] == count(reference) == 124_439_808


def test_bert_base_equals_hugging_face():
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        reference = transformers.BertModel(transformers.BertConfig())
    assert zoo_count("bert_base")["total"] == count(reference) == 109_482_240
