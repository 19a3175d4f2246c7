"""The zoo's ``task.packing`` (issue 16): a packed training batch has the loss and gradients of the unpacked one,
a packed sequence does not see its neighbours, and packed self-attention equals flash-attn's varlen semantics
(zoo/nn/flash_varlen.py: flash_attn_varlen_packed). Comparisons run in float64 with the suite's own tolerance
(properties/model/checks.py: assert_same_output, 2^21 u max|y|).
"""
from __future__ import annotations

import pytest
import torch
from einops import rearrange

from properties.core.tolerance import gamma, unit_roundoff
from properties.model.checks import assert_same_output, comparison_tolerance
from zoo.config.builder import model_from_config
from zoo.config.composition import compose_config
from zoo.config.errors import ConfigError
from zoo.nn.attention import MultiHeadAttention
from zoo.nn.cache import KVCache
from zoo.nn.packing import Packing
from zoo.nn.flash_varlen import flash_attn_varlen_packed
from zoo.tasks.data import IGNORE, pack
from zoo.tasks.train import batch_metrics, fit_config_to_data, forward_batch, train

from feature_models import F64, head_projections, small_model
from training import train_config

pytestmark = pytest.mark.usefixtures("one_thread")


def _trained_setup(*overrides: str):
    cfg, data = fit_config_to_data(compose_config(["model=decoder_only", "task=train", "data=reverse", "d_model=16",
                                                   "heads=4", "layers=2", "d_ff=32", "dropout=0", "dtype=float64",
                                                   "data.vocab=6", "data.min_len=2", "data.max_len=6", *overrides]))
    torch.manual_seed(0)
    return model_from_config(cfg), data


@pytest.mark.parametrize("overrides", [
    ("pos=sinusoidal",),                        # absolute codes: positions must restart with every sequence
    ("pos=learned", "norm_placement=pre"),
    ("pos=rotary", "attention.window=3", "kv_heads=2"),
    ("pos=alibi", "attention.softcap=1.0"),
])
def test_packed_batch_has_the_loss_of_the_unpacked_one(overrides):
    model, data = _trained_setup(*overrides)
    batch = data.batch("decoder_only", 12, "train", 0)
    packed = pack(batch, model.max_len)
    assert packed["tokens"].shape[0] < 12 and (packed["segments"] > 0).any()   # it did pack
    assert int((packed["targets"] != IGNORE).sum()) == int((batch["targets"] != IGNORE).sum())
    model.eval()
    with torch.no_grad():
        alone, together = forward_batch(model, batch), forward_batch(model, packed)
    # Same target tokens in the same order (next fit keeps the order): their logits agree to rounding. The mean
    # cross-entropy moves by at most 2 max|d logit| (its gradient in a token's logits has 1-norm <= 2), plus the
    # rounding of each loss, which batch_metrics evaluates in float32: gamma_(n + V + 4) of (loss + max|logit|)
    # for a log-sum-exp over V logits and a mean over n tokens.
    expected = alone[batch["targets"] != IGNORE]
    assert_same_output(together[packed["targets"] != IGNORE], expected, f"packed vs unpacked logits, {overrides}")
    loss_alone = batch_metrics(alone, batch["targets"])["loss"]
    loss_packed = batch_metrics(together, packed["targets"])["loss"]
    n, vocab = expected.shape
    evaluation = gamma(n + vocab + 4, unit_roundoff(torch.float32)) * (float(loss_alone) + float(expected.abs().max()))
    assert abs(float(loss_packed - loss_alone)) <= 2 * comparison_tolerance(expected) + 2 * evaluation


def test_packed_gradients_equal_unpacked():
    model, data = _trained_setup("pos=rotary")
    batch = data.batch("decoder_only", 10, "train", 3)
    grads = []
    for b in (batch, pack(batch, model.max_len)):
        model.zero_grad()
        batch_metrics(forward_batch(model, b), b["targets"])["loss"].backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
    for name, g in grads[0].items():
        assert_same_output(grads[1][name], g, f"gradient of {name}, packed vs unpacked")


def test_packed_sequence_does_not_see_its_neighbours():
    model, data = _trained_setup("pos=learned")
    packed = pack(data.batch("decoder_only", 8, "train", 1), model.max_len)
    row, segments = 0, packed["segments"][0]
    first, second = segments == 0, segments == 1
    changed = packed["tokens"].clone()
    changed[row, first] = torch.where(changed[row, first] == 5, 6, 5)   # another symbol at every token of seq 0
    with torch.no_grad():
        before = model(packed["tokens"], segments=packed["segments"])
        after = model(changed, segments=packed["segments"])
    assert_same_output(after[row, second], before[row, second], "sequence 1 after changing sequence 0 of its row")
    assert not torch.allclose(after[row, first], before[row, first])


def test_packing_is_flash_varlen():
    # Self-attention over packed rows equals flash_attn_varlen_func over the same sequences (cu_seqlens).
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 4, kv_heads=2, kernel="math", window=3, dtype=F64)
    segments = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 2, -1], [0, 0, 0, 0, 0, 0, 1, 1, -1, -1]])
    x = torch.randn(2, 10, 16, dtype=F64)
    out = mha(x, is_causal=True, packing=Packing.from_segments(segments))
    real = segments >= 0
    lengths = [int((segments[b] == k).sum()) for b in range(2) for k in range(int(segments[b].max()) + 1)]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v = (rearrange(t, "b h l e -> b l h e")[real] for t in head_projections(mha, x))
    flash = flash_attn_varlen_packed(q, k, v, cu, cu, max(lengths), max(lengths), causal=True, window_size=(2, 0))
    expected = mha.out_proj(rearrange(flash, "t h e -> t (h e)"))
    assert_same_output(out[real], expected, "packed self-attention vs flash varlen")
    assert Packing.from_segments(segments).positions[0].tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0, 0]


def test_bad_packing_is_refused_in_one_line():
    with pytest.raises(ValueError, match="non-decreasing sequence indices"):
        Packing.from_segments(torch.tensor([[0, 1, 0, -1]]))
    with pytest.raises(ValueError, match="non-decreasing sequence indices"):
        Packing.from_segments(torch.tensor([[0, -1, 1, 1]]))
    model = small_model("model=decoder_only")
    with pytest.raises(ValueError, match="not cached decoding"):
        model(torch.ones(1, 3, dtype=torch.long), cache=KVCache(), segments=torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ConfigError, match=r"^task.packing=True: packs decoder_only sequences"):
        compose_config(["model=encoder_decoder", "task=train", "data=sort", "task.packing=true"])


def test_training_with_packing_runs(tmp_path):
    result = train(train_config(tmp_path, "task.steps=2", "task.packing=true", "task.eval_every=2"), quiet=True)
    assert 0.0 <= result["exact"] <= 1.0 and result["loss"] == result["loss"]

