"""Differential checks of the converters (zoo.interop) against Hugging Face and torch.nn, and checkpoints.

Every reference gets random values in all its parameters (zoo.tasks.compare.randomize_), drawn once in
float64, so the float32 run uses the same numbers rounded. Outputs are compared in eval mode at the
real positions only; the bound is zoo.tasks.compare.error_bound (rounding model: eps/2 * magnitude *
depth * sqrt(width)), and float64 must in addition agree to 1e-12.
"""
from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from zoo import interop  # noqa: E402
from zoo.config.builder import build_model  # noqa: E402
from zoo.tasks.compare import compare, error_bound, randomize_, run_compare  # noqa: E402
from zoo.interop import ConversionError  # noqa: E402
from zoo.io import weights  # noqa: E402
from zoo.io.weights import StateDictMismatch  # noqa: E402

LAYERS, D, HEADS, D_FF, VOCAB, MAX_LEN = 2, 32, 4, 128, 97, 24
B, L = 3, 12
DTYPES = [torch.float32, torch.float64]
PADDINGS = ["none", "right", "left"]


def _tokens(generator, length=L):
    return torch.randint(0, VOCAB, (B, length), generator=generator)


def _mask(padding: str, length=L) -> torch.Tensor | None:
    """(B, length) True = real token. Row 1 loses its last third (right) or its first third (left)."""
    if padding == "none":
        return None
    mask = torch.ones(B, length, dtype=torch.bool)
    if padding == "right":
        mask[1, 2 * length // 3:] = False
    else:
        mask[1, : length // 3] = False
    mask[2, -1] = False  # a second, shorter padding run
    return mask


def _check(reference: torch.Tensor, zoo: torch.Tensor, mask, dtype, depth: int) -> float:
    """Assert the rounding bound at the real positions; return the measured max abs difference."""
    assert reference.shape == zoo.shape
    if mask is not None:
        reference, zoo = reference[mask], zoo[mask]
    assert torch.isfinite(zoo).all() and torch.isfinite(reference).all()
    diff = (reference - zoo).abs().max().item()
    bound = error_bound(dtype, reference.abs().max().item(), depth, max(D_FF, L))
    assert diff <= bound, f"max abs diff {diff:.3e} > bound {bound:.3e} ({dtype})"
    if dtype == torch.float64:
        assert diff <= 1e-12
    return diff


def _randomized(module: nn.Module, dtype) -> nn.Module:
    return randomize_(module.to(torch.float64), seed=1).to(dtype).eval()


# --------------------------------------------------------------------------------------------- GPT-2

def _gpt2_config(**changes):
    kw = dict(n_layer=LAYERS, n_embd=D, n_head=HEADS, n_positions=MAX_LEN, vocab_size=VOCAB, resid_pdrop=0.0,
              embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1,
              attn_implementation="eager")
    return transformers.GPT2Config(**(kw | changes))


@pytest.mark.parametrize("padding", PADDINGS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpt2_logits_match_hugging_face(dtype, padding):
    hf = _randomized(transformers.GPT2LMHeadModel(_gpt2_config()), dtype)
    zoo = interop.zoo_gpt2_from_hf(hf).eval()
    assert zoo.lm_head.weight is zoo.decoder.embedding.weight
    tokens, mask = _tokens(torch.Generator().manual_seed(0)), _mask(padding)
    with torch.no_grad():
        expected = hf(input_ids=tokens, attention_mask=None if mask is None else mask.long()).logits
        got = zoo(tokens, mask=mask)
    _check(expected, got, mask, dtype, depth=3 + 2 * LAYERS)


def test_gpt2_matches_the_sdpa_implementation_too():
    hf = _randomized(transformers.GPT2LMHeadModel(_gpt2_config(attn_implementation="sdpa")), torch.float64)
    zoo = interop.zoo_gpt2_from_hf(hf, kernel="torch").eval()
    tokens, mask = _tokens(torch.Generator().manual_seed(1)), _mask("right")
    with torch.no_grad():
        _check(hf(input_ids=tokens, attention_mask=mask.long()).logits, zoo(tokens, mask=mask), mask,
               torch.float64, depth=3 + 2 * LAYERS)


def _bitwise_equal(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        x, y = a[key], b[key]
        assert (x.dtype, x.shape) == (y.dtype, y.shape), key
        assert x.contiguous().view(torch.uint8).equal(y.contiguous().view(torch.uint8)), key


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpt2_round_trip_is_bitwise(dtype):
    geometry = interop.gpt2_geometry(_gpt2_config())
    zoo = randomize_(geometry.build(dtype=dtype), seed=2)
    hf = interop.hf_gpt2_from_zoo(zoo)
    assert hf.lm_head.weight is hf.transformer.wte.weight
    back = interop.zoo_gpt2_from_hf(hf)
    _bitwise_equal(zoo.state_dict(), back.state_dict())
    # and the other way: HF -> zoo -> HF state dicts
    hf_state = _randomized(transformers.GPT2LMHeadModel(_gpt2_config()), dtype).state_dict()
    _bitwise_equal(hf_state, interop.zoo_to_gpt2(interop.gpt2_to_zoo(hf_state, geometry), geometry))


def test_gpt2_model_without_head_and_untied_head():
    config = _gpt2_config()
    body = _randomized(transformers.GPT2Model(config), torch.float64)
    zoo_state = interop.gpt2_to_zoo(body.state_dict(), interop.gpt2_geometry(config))
    assert zoo_state["lm_head.weight"] is zoo_state["decoder.embedding.embedding.weight"]

    untied = _randomized(transformers.GPT2LMHeadModel(_gpt2_config(tie_word_embeddings=False)), torch.float64)
    assert untied.lm_head.weight is not untied.transformer.wte.weight
    zoo = interop.zoo_gpt2_from_hf(untied).eval()
    assert zoo.lm_head.weight is not zoo.decoder.embedding.weight
    tokens = _tokens(torch.Generator().manual_seed(3))
    with torch.no_grad():
        _check(untied(input_ids=tokens).logits, zoo(tokens), None, torch.float64, depth=3 + 2 * LAYERS)
    # A tied geometry refuses a state dict whose head differs from its embedding.
    with pytest.raises(ConversionError, match="lm_head.weight differs"):
        interop.gpt2_to_zoo(untied.state_dict(), interop.gpt2_geometry(config))


@pytest.mark.parametrize("change", [dict(scale_attn_by_inverse_layer_idx=True), dict(activation_function="silu"),
                                    dict(scale_attn_weights=False)], ids=str)
def test_gpt2_configs_the_zoo_cannot_express_are_refused(change):
    with pytest.raises(ConversionError):
        interop.gpt2_geometry(_gpt2_config(**change))


def test_gpt2_state_dict_with_wrong_keys_is_reported():
    config = _gpt2_config()
    state = transformers.GPT2LMHeadModel(config).state_dict()
    state.pop("transformer.h.1.ln_2.bias")
    state["transformer.h.1.extra"] = torch.zeros(1)
    with pytest.raises(StateDictMismatch, match=r"h\.1\.ln_2\.bias[\s\S]*h\.1\.extra"):
        interop.gpt2_to_zoo(state, interop.gpt2_geometry(config))


# ---------------------------------------------------------------------------------------------- BERT

def _bert_config(**changes):
    kw = dict(num_hidden_layers=LAYERS, hidden_size=D, num_attention_heads=HEADS, intermediate_size=D_FF,
              vocab_size=VOCAB, max_position_embeddings=MAX_LEN, hidden_dropout_prob=0.0,
              attention_probs_dropout_prob=0.0, attn_implementation="eager")
    return transformers.BertConfig(**(kw | changes))


@pytest.mark.parametrize("padding", ["none", "right"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bert_hidden_states_and_pooler_match_hugging_face(dtype, padding):
    hf = _randomized(transformers.BertModel(_bert_config()), dtype)
    zoo = interop.zoo_bert_from_hf(hf).eval()
    generator = torch.Generator().manual_seed(4)
    tokens, mask = _tokens(generator), _mask(padding)
    types = torch.randint(0, 2, (B, L), generator=generator)
    with torch.no_grad():
        out = hf(input_ids=tokens, attention_mask=None if mask is None else mask.long(), token_type_ids=types)
        hidden = zoo(tokens, mask=mask, token_types=types)
        _check(out.last_hidden_state, hidden, mask, dtype, depth=1 + 2 * LAYERS)
        _check(out.pooler_output, zoo.pool(hidden), None, dtype, depth=2 + 2 * LAYERS)
        # Without token types both sides use type 0.
        _check(hf(input_ids=tokens).last_hidden_state, zoo(tokens), None, dtype, depth=1 + 2 * LAYERS)


def test_bert_round_trip_and_prefixed_state_dicts():
    config = _bert_config()
    geometry = interop.bert_geometry(config)
    hf = _randomized(transformers.BertModel(config), torch.float32)
    state = hf.state_dict()
    _bitwise_equal(state, interop.zoo_to_bert(interop.bert_to_zoo(state, geometry), geometry))
    prefixed = {f"bert.{k}": v for k, v in state.items()}
    _bitwise_equal(interop.bert_to_zoo(state, geometry), interop.bert_to_zoo(prefixed, geometry))
    zoo = interop.zoo_bert_from_hf(hf)
    _bitwise_equal(state, interop.hf_bert_from_zoo(zoo).state_dict())


def test_bert_configs_the_zoo_cannot_express_are_refused():
    with pytest.raises(ConversionError):
        interop.bert_geometry(_bert_config(is_decoder=True))
    with pytest.raises(ConversionError):
        interop.bert_geometry(_bert_config(hidden_act="silu"))


# -------------------------------------------------------------------------------- torch.nn.Transformer

def _reference(dtype, **kw):
    return _randomized(interop.TorchTransformerReference(VOCAB, D, HEADS, LAYERS, D_FF, MAX_LEN, **kw), dtype)


# Only right padding: nn.MultiheadAttention returns NaN for a query with no admissible key (the
# first target position of a left-padded row), and the NaN reaches real positions through the
# next layer's 0 * NaN; the zoo's kernel returns zeros there by contract.
@pytest.mark.parametrize("padding", ["none", "right"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_torch_transformer_logits_match(dtype, padding):
    reference = _reference(dtype)
    zoo = interop.zoo_from_torch_transformer(reference).eval()
    assert zoo.lm_head.weight is zoo.encoder.embedding.weight is zoo.decoder.embedding.weight
    generator = torch.Generator().manual_seed(5)
    src, tgt = _tokens(generator), _tokens(generator, L - 3)
    src_mask, tgt_mask = _mask(padding), _mask(padding, L - 3)
    with torch.no_grad():
        expected, got = reference(src, tgt, src_mask, tgt_mask), zoo(src, tgt, src_mask, tgt_mask)
    _check(expected, got, tgt_mask, dtype, depth=6 + 5 * LAYERS)


def test_torch_transformer_pre_norm_and_gelu():
    reference = _reference(torch.float64, norm_first=True, activation="gelu", decoder_layers=3)
    zoo = interop.zoo_from_torch_transformer(reference).eval()
    geometry = interop.zoo_geometry(zoo)
    assert (geometry.norm_placement, geometry.activation, geometry.decoder_layers) == ("pre", "gelu", 3)
    generator = torch.Generator().manual_seed(6)
    src, tgt, mask = _tokens(generator), _tokens(generator), _mask("right")
    with torch.no_grad():
        _check(reference(src, tgt, mask, mask), zoo(src, tgt, mask, mask), mask, torch.float64, depth=20)


@pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")
def test_torch_transformer_refusals():
    custom = nn.Transformer(D, HEADS, 1, 1, D_FF, 0.0, activation=torch.tanh, batch_first=True)
    with pytest.raises(ConversionError, match="activation"):
        interop.torch_transformer_geometry(custom, VOCAB, MAX_LEN)
    reference = _reference(torch.float32)
    geometry = interop.torch_transformer_geometry(reference.transformer, VOCAB, MAX_LEN)
    state = reference.transformer.state_dict()
    state["decoder.norm.extra"] = torch.zeros(1)
    with pytest.raises(StateDictMismatch, match="unexpected keys.*decoder.norm.extra"):
        interop.torch_transformer_to_zoo(state, geometry, reference.embedding.weight)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_multihead_attention_matches(dtype):
    mha = _randomized(nn.MultiheadAttention(D, HEADS, batch_first=True), dtype)
    zoo = interop.zoo_attention_from_mha(mha).eval()
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(B, L, D, generator=generator, dtype=torch.float64).to(dtype)
    memory = torch.randn(B, L + 5, D, generator=generator, dtype=torch.float64).to(dtype)
    mask = _mask("right")
    memory_mask = _mask("right", L + 5)
    causal = torch.ones(L, L, dtype=torch.bool).triu(1)  # nn.MultiheadAttention: True = masked
    with torch.no_grad():
        cases = [
            (mha(x, x, x, need_weights=False)[0], zoo(x)),
            (mha(x, x, x, key_padding_mask=~mask, need_weights=False)[0], zoo(x, key_padding_mask=mask)),
            (mha(x, memory, memory, key_padding_mask=~memory_mask, need_weights=False)[0],
             zoo(x, memory, key_padding_mask=memory_mask)),
            (mha(x, x, x, attn_mask=causal, need_weights=False)[0], zoo(x, is_causal=True)),
        ]
    for expected, got in cases:
        _check(expected, got, None, dtype, depth=2)


def test_multihead_attention_refusals():
    with pytest.raises(ConversionError):
        interop.zoo_attention_from_mha(nn.MultiheadAttention(D, HEADS, kdim=16, vdim=16))
    with pytest.raises(ConversionError):
        interop.zoo_attention_from_mha(nn.MultiheadAttention(D, HEADS, add_bias_kv=True))


# -------------------------------------------------------------------------------------------- geometry

@pytest.mark.parametrize("family", ["gpt2", "bert", "torch"])
def test_geometry_overrides_build_the_same_model(family):
    if family == "gpt2":
        geometry = interop.gpt2_geometry(_gpt2_config())
    elif family == "bert":
        geometry = interop.bert_geometry(_bert_config())
    else:
        geometry = interop.torch_transformer_geometry(_reference(torch.float32).transformer, VOCAB, MAX_LEN)
    built = build_model(geometry.overrides())
    assert interop.zoo_geometry(built) == geometry == interop.zoo_geometry(geometry.build())
    assert {k: v.shape for k, v in built.state_dict().items()} == \
        {k: v.shape for k, v in geometry.build().state_dict().items()}


# ----------------------------------------------------------------------------------------- checkpoints

def _tiny(family: str, dtype=torch.float32) -> nn.Module:
    return build_model([f"model={family}", "d_model=16", "heads=2", "layers=1", "d_ff=32", "vocab_size=23",
                        "max_len=8"], dtype=dtype)


@pytest.mark.parametrize("family", ["decoder_only", "encoder_decoder", "encoder_only"])
def test_safetensors_round_trip_keeps_tied_weights(tmp_path, family):
    model = randomize_(_tiny(family), seed=8)
    path = weights.save_checkpoint(model, tmp_path / "model.safetensors")
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors"]  # no temp file left behind
    stored = safetensors_torch.load_file(path)  # plain safetensors: each tie stored once
    assert len(stored) == len({id(p) for p in model.state_dict(keep_vars=True).values()})
    fresh = _tiny(family)
    weights.load_checkpoint(fresh, path)
    _bitwise_equal(model.state_dict(), fresh.state_dict())
    if family != "encoder_only":
        assert fresh.lm_head.weight is fresh.decoder.embedding.weight


def test_checkpoints_written_by_other_tools_load(tmp_path):
    model = randomize_(_tiny("encoder_decoder"), seed=9)
    safetensors_torch.save_model(model, tmp_path / "save_model.safetensors")  # drops tied duplicates
    torch.save(model.state_dict(), tmp_path / "plain.pt")
    torch.save({"state_dict": model.state_dict(), "step": 3}, tmp_path / "wrapped.pt")
    for name in ("save_model.safetensors", "plain.pt", "wrapped.pt"):
        fresh = _tiny("encoder_decoder")
        weights.load_checkpoint(fresh, tmp_path / name)
        _bitwise_equal(model.state_dict(), fresh.state_dict())


def test_mismatched_checkpoint_lists_every_problem(tmp_path):
    state = randomize_(_tiny("decoder_only"), seed=10).state_dict()
    state.pop("decoder.layers.0.ffn_block.norm.bias")
    state["decoder.layers.0.ffn.up.weight"] = torch.zeros(64, 16)
    state["unused.weight"] = torch.zeros(2)
    path = weights.save_checkpoint(state, tmp_path / "bad.safetensors")
    model = _tiny("decoder_only")
    with pytest.raises(StateDictMismatch) as info:
        weights.load_checkpoint(model, path)
    message = str(info.value)
    assert "missing keys (1): decoder.layers.0.ffn_block.norm.bias" in message
    assert "unexpected keys (1): unused.weight" in message
    assert "decoder.layers.0.ffn.up.weight: checkpoint [64, 16] vs model [32, 16]" in message
    assert info.value.mismatched == [("decoder.layers.0.ffn.up.weight", (64, 16), (32, 16))]


def test_conflicting_tied_values_are_refused(tmp_path):
    state = {k: v.clone() for k, v in _tiny("decoder_only").state_dict().items()}
    state["lm_head.weight"] += 1.0  # untied values for a tied model
    with pytest.raises(StateDictMismatch, match="tied weights with different values"):
        weights.load_state_dict_checked(_tiny("decoder_only"), state)


class _NotAWeight:
    pass


def test_arbitrary_pickles_are_never_loaded(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"weight": torch.zeros(2), "payload": _NotAWeight()}, path)
    with pytest.raises(ValueError, match="weights-only"):
        weights.read_checkpoint(path)
    (tmp_path / "junk.bin").write_bytes(b"not a checkpoint at all")
    with pytest.raises(ValueError, match="neither safetensors"):
        weights.read_checkpoint(tmp_path / "junk.bin")
    with pytest.raises(FileNotFoundError):
        weights.read_checkpoint(tmp_path / "absent.safetensors")


def test_failed_save_leaves_the_old_file(tmp_path, monkeypatch):
    model = _tiny("decoder_only")
    path = weights.save_checkpoint(model, tmp_path / "model.safetensors")
    before = path.read_bytes()

    def broken(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(safetensors_torch, "save_file", broken)
    with pytest.raises(OSError, match="disk full"):
        weights.save_checkpoint(randomize_(copy.deepcopy(model), seed=11), path)
    assert path.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["model.safetensors"]


# ------------------------------------------------------------------------------------------- compare

@pytest.mark.parametrize("preset", ["gpt2_small", "bert_base", "vaswani_base"])
def test_compare_table(preset):
    lines = []
    result = run_compare(preset, None, layers=2, d_model=32, heads=4, vocab_size=VOCAB, max_len=MAX_LEN,
                         print_fn=lines.append)
    assert result["ok"], lines[0]
    assert result["max_abs_diff"]["float64"] <= 1e-12
    assert result["max_abs_diff"]["float32"] <= 1e-4
    names = [row["output"] for row in result["rows"]]
    assert any("layer 1" in name for name in names) and len(lines) == 1 and "within bound" in lines[0]


def test_compare_rejects_bad_arguments():
    with pytest.raises(ValueError, match="expected 'torch'"):
        compare("hf", "vaswani_base")
    with pytest.raises(ValueError, match="compare knows"):
        compare("hf", "tiny")
    with pytest.raises(ValueError, match="dtypes"):
        run_compare("gpt2_small", "hf", dtypes=("float16",), print_fn=None)
