"""The size check counts from the config alone (zoo/config/sizing.py): its counts equal the built model's for every
family, part option and flag, the presets' published counts, in O(1) of the layer count."""
from __future__ import annotations

import copy
import functools
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import open_dict
from torch import nn

from zoo.config.builder import model_from_config
from zoo.config.composition import compose_config
from zoo.config.errors import ConfigError
from zoo.config.options import FAMILIES, options
from zoo.config.sizing import ModelTooLarge, check_fits, model_size
from zoo.tasks.summary import parameters_by_part

SMALL = ["task=summary", "d_model=8", "heads=2", "d_ff=6", "layers=2", "vocab_size=11", "max_len=7"]


@functools.lru_cache(maxsize=None)
def _composed(*overrides: str):
    return compose_config([*SMALL, *overrides])


def _with_parts(family: str, **choices: str):
    """The family's config with the part nodes of other options swapped in (one composition per option)."""
    cfg = copy.deepcopy(_composed(f"model={family}"))
    with open_dict(cfg):
        for group, option in choices.items():
            cfg[group] = copy.deepcopy(_composed(f"{group}={option}")[group])
    return cfg


def built_counts(cfg) -> dict:
    model = model_from_config(cfg, device="meta")
    return {"parameters": sum(p.numel() for p in model.parameters()),
            "by_part": parameters_by_part(model), "buffers": sum(b.numel() for b in model.buffers()),
            "modules": len(list(model.modules())), "tensors": len([*model.parameters(), *model.buffers()])}


def counted(cfg) -> dict:
    size = model_size(cfg)
    return {"parameters": size.parameters, "by_part": size.by_part, "buffers": size.buffers,
            "modules": size.modules, "tensors": size.tensors}


@pytest.mark.parametrize("family", FAMILIES)
def test_every_part_option_is_counted_exactly(family):
    """Each option of each part group once (the others at their defaults); the drawn test below mixes them."""
    for group in ("pos", "ffn", "norm"):
        for option in options(group):
            cfg = _with_parts(family, **{group: option})
            assert counted(cfg) == built_counts(cfg), (family, group, option)


@settings(max_examples=25, deadline=None, database=None)
@given(family=st.sampled_from(FAMILIES), pos=st.sampled_from(options("pos")), ffn=st.sampled_from(options("ffn")),
       norm=st.sampled_from(options("norm")), heads=st.sampled_from([1, 2, 4]), kv_heads=st.sampled_from([None, 1, 2]),
       layers=st.integers(1, 3), decoder_layers=st.sampled_from([None, 1, 3]), d_ff=st.integers(1, 9),
       vocab=st.integers(1, 20), max_len=st.integers(1, 9), placement=st.sampled_from(["pre", "post"]),
       flags=st.lists(st.booleans(), min_size=8, max_size=8), final_norm=st.sampled_from([None, True, False]),
       extra=st.integers(0, 3))
def test_any_config_is_counted_exactly(family, pos, ffn, norm, heads, kv_heads, layers, decoder_layers, d_ff, vocab,
                                       max_len, placement, flags, final_norm, extra):
    cfg = _with_parts(family, pos=pos, ffn=ffn, norm=norm)
    kv_heads = kv_heads if kv_heads is None or heads % kv_heads == 0 else None
    with open_dict(cfg):
        cfg.heads, cfg.kv_heads, cfg.layers, cfg.d_ff, cfg.vocab_size, cfg.max_len = \
            heads, kv_heads, layers, d_ff, vocab, max_len
        cfg.norm_placement = placement
        cfg.model.final_norm, cfg.model.embed_norm = final_norm, flags[0]
        cfg.attention.bias = flags[1]
        if "bias" in cfg.norm:
            cfg.norm.bias = flags[2]
        if family == "encoder_decoder":
            cfg.model.decoder_layers, cfg.model.share_embeddings, cfg.model.tie_head = decoder_layers, flags[3], flags[4]
        elif family == "decoder_only":
            cfg.model.tie_head = flags[3]
        else:
            cfg.model.type_vocab_size, cfg.model.pooler, cfg.model.head_classes = extra, flags[3], extra
    assert counted(cfg) == built_counts(cfg)


@pytest.mark.parametrize("preset,total,embeddings", [("gpt2_small", 124_439_808, 39_383_808),
                                                     ("bert_base", 109_482_240, 23_835_648),
                                                     ("vaswani_base", 63_084_544, 37_000 * 512)])
def test_the_presets_published_counts(preset, total, embeddings):
    """tests/test_parameter_counts.py checks the built presets against the reference implementations."""
    size = model_size(compose_config([f"preset={preset}", "task=summary"]))
    assert size.parameters == total and size.by_part["embeddings"] == embeddings


def test_counting_costs_the_same_for_any_number_of_layers():
    shallow, deep = (_composed(f"layers={n}") for n in (1, 4096))
    started = time.process_time()
    one, many = model_size(shallow), model_size(deep)
    assert time.process_time() - started < 1.0  # 4,096 layers built even on the meta device: a minute or more
    two = model_size(_composed("layers=2"))
    assert many.parameters - one.parameters == 4095 * (two.parameters - one.parameters)


class FailsOnMeta(nn.Module):
    """A plug-in attention whose constructor computes on the CPU, which the meta device cannot."""

    def __init__(self, d_model: int, heads: int, kv_heads=None, bias: bool = True, dropout: float = 0.0,
                 kernel="math", window=None, softcap=None, *, device=None, dtype=None):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(d_model, device=device, dtype=dtype))
        if torch.device(device or "cpu").type == "meta":
            raise RuntimeError("needs real values")


def test_a_plug_in_part_is_counted_from_one_instance_or_estimated_aloud():
    exact = compose_config([*SMALL, "attention._target_=properties.catalog.modules.SplitHeadsWithoutTranspose"])
    assert counted(exact) == built_counts(exact) and not model_size(exact).estimated
    odd = compose_config([*SMALL, f"attention._target_={__name__}.FailsOnMeta"])
    size = model_size(odd)
    assert size.estimated and "counted as the zoo's MultiHeadAttention" in size.estimated[0]
    assert size.parameters == model_size(_composed()).parameters  # the zoo's attention in its place


def test_check_fits_refuses_in_one_line_and_says_what_it_counted():
    with pytest.raises(ModelTooLarge) as refused:
        check_fits(_composed("d_model=1073741824"), batch=2, length=32)
    line = str(refused.value)
    assert "\n" not in line and "parameters in float32" in line and "activations of a batch of 2 x 32" in line
    check_fits(_composed(), batch=2, length=32)  # a tiny model fits
    check_fits(_composed("d_model=1073741824"), device="meta")  # nothing is allocated on the meta device
    assert issubclass(ModelTooLarge, ConfigError)


def test_only_a_part_of_ones_own_is_built_on_the_meta_device_to_be_sized():
    """builds_a_part: the zoo's parts are counted from their settings (the suite then skips warming torch's meta
    kernels); a replacement part, a subclass of the zoo's included, is built on the meta device."""
    from zoo.config.composition import compose_config
    from zoo.config.sizing import builds_a_part
    for pos in ("sinusoidal", "learned", "rotary", "alibi", "none"):
        assert not builds_a_part(compose_config(["model=decoder_only", f"pos={pos}", "task=summary"])), pos
    own = compose_config(["model=decoder_only", "task=summary",
                          "attention._target_=properties.catalog.models.NoCausalMask"])
    assert builds_a_part(own)


def test_a_meta_build_makes_no_values_and_keeps_every_shape():
    """On the meta device the embedding tables and the sinusoidal table are made empty, not computed: the same
    parameters and buffers, by name, shape and dtype, as the real build."""
    from zoo import build_model
    overrides = ["model=encoder_only", "pos=learned", "model.type_vocab_size=2"]
    real, meta = build_model(overrides), build_model(overrides, device="meta")
    shapes = lambda m: [(n, t.shape, t.dtype) for n, t in [*m.named_parameters(), *m.named_buffers()]]  # noqa: E731
    assert shapes(real) == shapes(meta) and all(t.device.type == "meta" for _, t in meta.named_parameters())
    table = build_model(["model=decoder_only", "pos=sinusoidal"], device="meta").decoder.pos.table
    assert table.device.type == "meta" and table.dtype == torch.float32
