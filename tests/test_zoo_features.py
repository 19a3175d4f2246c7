"""The zoo's FlashAttention features as model options (issue 16): ``attention.window``, ``attention.softcap``,
``pos=alibi`` and the paged KV cache of ``task=generate`` (``task.packing``: tests/test_zoo_packing.py).

Each option is checked for what it changes (against zoo/nn/flash.py, the plain-torch reference of flash-attn's
API, where one exists), for cached decoding equal to the full forward pass, and for the model clauses of the
suite on a model built with it. Comparisons of two evaluations run in float64 with the suite's own tolerance
(properties/model/checks.py: assert_same_output, 2^21 u max|y|).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from einops import rearrange

from properties.catalog.sessions import run_pytest
from properties.core.tolerance import evaluation_error
from properties.model.checks import assert_same_output
from zoo.config.builder import build_model
from zoo.config.composition import compose_config
from zoo.config.errors import ConfigError
from zoo.nn.attention import MultiHeadAttention
from zoo.nn.cache import KVCache, PagedKVCache
from zoo.nn.flash_dense import flash_attn_reference
from zoo.nn.kernel import math_attention
from zoo.tasks.generate import generate, generate_task

from feature_models import F64, SMALL, head_projections, small_model

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("one_thread")


def _flash_layout(t: torch.Tensor) -> torch.Tensor:
    return rearrange(t, "b h l e -> b l h e")


def _flash_mha(mha: MultiHeadAttention, x: torch.Tensor, **flash) -> torch.Tensor:
    """The layer's output with the attention computed by the flash-attn reference kernel."""
    q, k, v = (_flash_layout(t) for t in head_projections(mha, x))
    out = flash_attn_reference(q, k, v, **flash)
    return mha.out_proj(rearrange(out, "b l h e -> b l (h e)"))


def _decode_one_by_one(model, tokens: torch.Tensor, mask: torch.Tensor | None = None, prefill: int = 1):
    """Logits of every position from a prefill of ``prefill`` tokens, then one token per call, with a KVCache."""
    cache, outs = KVCache(), []
    cuts = [0, prefill, *range(prefill + 1, tokens.shape[1] + 1)]
    for a, b in zip(cuts, cuts[1:]):
        outs.append(model(tokens[:, a:b], None if mask is None else mask[:, :b], cache=cache))
    return torch.cat(outs, dim=1)


def _tokens(model, batch: int, length: int, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, model.vocab_size, (batch, length), generator=generator)


# --------------------------------------------------------------------------------- attention.window=W
@pytest.mark.parametrize("window", [1, 3, 5])
def test_window_is_mistral_sliding_window(window):
    # Mistral's sliding_window W: query i attends i - W < j <= i, i.e. W keys (fewer only at the start).
    mha = MultiHeadAttention(16, 4, kernel="math", window=window, dtype=F64)
    allowed = mha.mask(9, 9, 0, None, True, None, "cpu", window=window)
    i = torch.arange(9)[:, None]
    j = torch.arange(9)[None, :]
    assert torch.equal(allowed, (j <= i) & (j > i - window))
    assert allowed.sum(-1).tolist() == [min(row + 1, window) for row in range(9)]


@pytest.mark.parametrize("causal", [True, False])
def test_window_equals_flash_window_size(causal):
    torch.manual_seed(0)
    window = 3
    mha = MultiHeadAttention(16, 4, kv_heads=2, kernel="math", window=window, dtype=F64)
    x = torch.randn(2, 11, 16, dtype=F64)
    expected = _flash_mha(mha, x, causal=causal, window_size=(window - 1, 0 if causal else window - 1))
    assert_same_output(mha(x, is_causal=causal), expected, f"window={window}, causal={causal} vs flash window_size")


def test_window_output_independent_of_keys_outside_it():
    torch.manual_seed(0)
    window, i = 3, 7
    mha = MultiHeadAttention(16, 4, kernel="math", window=window, dtype=F64)
    x = torch.randn(1, 10, 16, dtype=F64)
    out = mha(x, is_causal=True)
    outside, inside = x.clone(), x.clone()
    outside[:, : i - window + 1] += 1.0                 # keys j <= i - W: outside the window of query i
    inside[:, i - window + 1] += 1.0                    # the oldest key inside it
    # Masked keys get weight exactly 0, so the row of query i is bitwise the same.
    assert torch.equal(mha(outside, is_causal=True)[:, i], out[:, i])
    assert not torch.allclose(mha(inside, is_causal=True)[:, i], out[:, i])


def test_window_is_not_applied_to_cross_attention():
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 4, kernel="math", window=1, dtype=F64)
    x, memory = torch.randn(1, 4, 16, dtype=F64), torch.randn(1, 6, 16, dtype=F64)
    expected = _flash_mha_cross(mha, x, memory)
    assert_same_output(mha(x, memory), expected, "cross-attention with window=1 vs unwindowed")


def _flash_mha_cross(mha, x, memory):
    q = _flash_layout(mha.split_heads(mha.q_proj(x), mha.heads))
    k = _flash_layout(mha.split_heads(mha.k_proj(memory), mha.kv_heads))
    v = _flash_layout(mha.split_heads(mha.v_proj(memory), mha.kv_heads))
    return mha.out_proj(rearrange(flash_attn_reference(q, k, v), "b l h e -> b l (h e)"))


# ------------------------------------------------------------------------------- attention.softcap=X
def test_softcap_equals_flash_softcap():
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 4, kernel="math", softcap=0.5, window=4, dtype=F64)
    x = 5 * torch.randn(2, 9, 16, dtype=F64)
    expected = _flash_mha(mha, x, causal=True, window_size=(3, 0), softcap=0.5)
    assert_same_output(mha(x, is_causal=True), expected, "softcap=0.5 vs flash softcap")


def test_softcap_bounds_the_scores():
    # With values = one-hot rows the output is the weight matrix; capped scores lie in (-X, X), so two
    # weights of one row differ by a factor below exp(2X) however large q·k is.
    cap = 1.5
    generator = torch.Generator().manual_seed(0)
    q = 100 * torch.randn(1, 2, 6, 8, generator=generator, dtype=F64)
    k = 100 * torch.randn(1, 2, 6, 8, generator=generator, dtype=F64)
    v = torch.eye(6, dtype=F64).expand(1, 2, 6, 6)
    # tanh saturates at exactly ±1 for these scores: the ratio reaches the bound, up to the rounding of two
    # softmax weights (the suite's softmax evaluation error, properties/core/tolerance.py).
    bound = torch.exp(torch.tensor(2 * cap, dtype=F64)) * (1 + 2 * evaluation_error(6, F64))
    weights = math_attention(q, k, v, softcap=cap)
    assert (weights.amax(-1) / weights.amin(-1)).max() <= bound
    uncapped = math_attention(q, k, v)
    assert (uncapped.amax(-1) / uncapped.amin(-1)).max() > bound   # the test would notice no capping


# ------------------------------------------------------------------------------------ cached decoding
@pytest.mark.parametrize("overrides", [
    ("attention.window=3",),
    ("attention.window=2", "attention.softcap=0.7", "pos=rotary", "kv_heads=2"),
    ("pos=alibi", "heads=2"),
    ("pos=alibi", "attention.window=4", "attention.softcap=1.0", "kv_heads=1"),
])
def test_cached_decoding_equals_full_forward(overrides):
    model = small_model("model=decoder_only", *overrides)
    tokens = _tokens(model, 2, 12)
    with torch.no_grad():
        full = model(tokens)
        assert_same_output(_decode_one_by_one(model, tokens, prefill=4), full, f"cached decoding, {overrides}")


@pytest.mark.parametrize("pos", ["rotary", "alibi"])
def test_cached_decoding_with_left_padding_and_window(pos):
    # Left padding shifts absolute positions; the window and ALiBi's distances count them too, so both stay
    # relative to the token.
    model = small_model("model=decoder_only", "attention.window=3", f"pos={pos}")
    tokens = _tokens(model, 2, 10)
    mask = torch.ones_like(tokens, dtype=torch.bool)
    mask[0, :3] = False
    tokens = tokens.masked_fill(~mask, model.pad_id)
    with torch.no_grad():
        full = model(tokens, mask)
        cached = _decode_one_by_one(model, tokens, mask, prefill=5)
        alone = model(tokens[:1, 3:])
    assert_same_output(cached[mask], full[mask], "cached decoding with left padding")
    assert_same_output(full[0, 3:], alone[0], "left-padded row vs the same row unpadded")


# ------------------------------------------------------------------------------------------------ pos=alibi
def test_alibi_slopes_as_in_the_paper():
    # Press et al. 2022, section 3: 8 heads -> 1/2, 1/4, ..., 1/256; a non-power of two H (reference code, BLOOM):
    # the 8 slopes of 8 heads, then slopes 1, 3, 5, 7 of 16 heads (2^-0.5, 2^-1.5, ...).
    eight = build_model([*SMALL, "pos=alibi", "heads=8"]).decoder.pos.slopes
    assert eight.tolist() == [2.0 ** -h for h in range(1, 9)]
    twelve = build_model([*SMALL, "pos=alibi", "heads=12", "d_model=24"], dtype=F64).decoder.pos.slopes
    expected = [2.0 ** -h for h in range(1, 9)] + [2.0 ** -(h / 2) for h in (1, 3, 5, 7)]
    assert torch.allclose(twelve, torch.tensor(expected, dtype=F64), rtol=4 * torch.finfo(F64).eps, atol=0)


def test_alibi_adds_no_position_codes():
    model = small_model("model=decoder_only", "pos=alibi")
    tokens = _tokens(model, 2, 6)
    assert not list(model.decoder.pos.parameters()) and not model.decoder.pos.state_dict()
    assert torch.equal(model.decoder.embed(tokens, offset=3), model.decoder.embedding(tokens))


def test_alibi_bias_per_head_by_absolute_distance():
    model = small_model("model=decoder_only", "pos=alibi")
    pos, heads = model.decoder.pos, 4
    bias = pos.score_bias(3, 7, 4, heads)                  # queries at 4, 5, 6 against keys 0..6 (a cache of 4)
    i = torch.arange(4, 7)[:, None]
    j = torch.arange(7)[None, :]
    for h in range(heads):
        assert torch.equal(bias[h], -pos.slopes[h] * (i - j).abs().to(F64))
    assert len({float(bias[h, 0, 0]) for h in range(heads)}) == heads   # each head its own slope


@pytest.mark.parametrize("causal", [True, False])
def test_alibi_attention_equals_flash_alibi_slopes(causal):
    model = small_model("model=decoder_only", "pos=alibi", "kv_heads=2")
    mha, pos = model.decoder.layers[0].self_attn, model.decoder.pos
    x = torch.randn(2, 9, 16, generator=torch.Generator().manual_seed(0), dtype=F64)
    expected = _flash_mha(mha, x, causal=causal, alibi_slopes=pos.slopes)
    assert_same_output(mha(x, is_causal=causal, positions=pos), expected, "ALiBi vs flash alibi_slopes")


# ------------------------------------------------------------------------------ task=generate task.block_size
@pytest.mark.parametrize("family", ["decoder_only", "encoder_decoder"])
def test_paged_cache_decoding_gives_the_tokens_of_the_contiguous_cache(family):
    model = small_model(f"model={family}", "pos=alibi", "attention.window=4", "kv_heads=2", dtype=torch.float32)
    prompt = _tokens(model, 3, 2)
    kw = {}
    if family == "encoder_decoder":
        kw = dict(src=_tokens(model, 3, 7, seed=2), src_mask=torch.ones(3, 7, dtype=torch.bool))
    max_new = 10                                    # 11 positions: blocks of 3 fill 3 blocks and start a 4th
    for block_size in (1, 3, 16):                   # one position per block, several blocks, one block
        for sampling in (dict(), dict(temperature=1.3, top_k=5)):
            runs = [generate(model, prompt, max_new, eos_id=None, block_size=b,
                             generator=torch.Generator().manual_seed(5), **sampling, **kw) for b in (None, block_size)]
            assert runs[0].shape == (3, max_new) and torch.equal(*runs), (block_size, sampling)


def test_paged_cache_holds_each_position_through_its_block_table():
    model = small_model("model=decoder_only", "kv_heads=1")
    tokens = _tokens(model, 3, 11)
    contiguous, paged = KVCache(), PagedKVCache(block_size=4)
    with torch.no_grad():
        for cache in (contiguous, paged):
            model(tokens[:, :5], cache=cache)
            for i in range(5, 11):
                model(tokens[:, i:i + 1], cache=cache)
    # Blocks handed out in turn as the three sequences grow: a sequence's blocks are not adjacent in the pool.
    assert paged.block_table.tolist() == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]
    for layer, (k_pool, v_pool) in paged.pools.items():
        for b in range(3):
            for position in range(11):
                block, slot = paged.block_table[b, position // 4], position % 4
                assert torch.equal(k_pool[block, slot], contiguous.keys[layer][b, :, position])
                assert torch.equal(v_pool[block, slot], contiguous.values[layer][b, :, position])
    with pytest.raises(ValueError, match="block_size=0"):
        PagedKVCache(block_size=0)


def test_generate_task_with_a_paged_cache(finished_run, capsys):
    outputs = []
    for extra in ((), ("task.block_size=2",)):
        generate_task(compose_config(["task=generate", f"task.checkpoint='{finished_run}'", "task.samples=6",
                                      "task.temperature=0.8", *extra]))
        lines = capsys.readouterr().out.splitlines()
        outputs.append(lines)
    assert "with a paged (blocks of 2) KV cache" in outputs[1][0]
    assert outputs[0][1:] == outputs[1][1:] and len([line for line in outputs[1] if "->" in line]) == 6


# ------------------------------------------------------------------------------------------ the schema
@pytest.mark.parametrize("override, message", [
    ("attention.window=0", "attention.window=0: must be a positive integer"),
    ("attention.window=2.5", "attention.window=2.5: expected int | None"),
    ("attention.softcap=0", "attention.softcap=0: must be positive (null: no capping)"),
    ("attention.softcap=-1.0", "attention.softcap=-1.0: must be positive"),
    ("attention.softcap=inf", "attention.softcap=inf: must be a finite number"),
    ("task=generate task.block_size=0", "task.block_size=0: must be a positive integer or null"),
    ("task=generate task.block_size=4 task.cache=false", "task.block_size=4: pages the KV cache"),
    ("task=train task.packing=maybe", "task.packing=maybe: Value 'maybe' is not a valid bool"),
])
def test_bad_values_are_one_line_errors(override, message):
    with pytest.raises(ConfigError) as info:
        compose_config(override.split())
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


@pytest.mark.parametrize("kernel", ["torch", "memory_efficient"])
def test_softcap_needs_a_kernel_that_takes_it(kernel):
    with pytest.raises(ConfigError, match=rf"^attention.softcap=2.0: attention.kernel={kernel} has SDPA's signature"):
        compose_config([f"attention={kernel}", "attention.softcap=2.0"])
    with pytest.raises(ValueError, match="has no softcap parameter"):
        MultiHeadAttention(16, 4, kernel=kernel, softcap=2.0)
    compose_config([f"attention={kernel}", "attention.window=4"])   # a window is a bool mask: every kernel


def test_window_with_sdpa_kernels_equals_math():
    torch.manual_seed(0)
    x = torch.randn(2, 9, 16, dtype=F64)
    outs = []
    for kernel in ("math", "torch", "memory_efficient"):
        torch.manual_seed(1)
        outs.append(MultiHeadAttention(16, 4, kernel=kernel, window=3, dtype=F64)(x, is_causal=True))
    for out in outs[1:]:
        assert_same_output(out, outs[0], "window=3 on an SDPA kernel vs math")


# ------------------------------------------------------------------------------- the suite's model clauses
def test_model_clauses_pass_with_the_features(tmp_path):
    # One model with every attention feature; the ci profile (derandomized) keeps the run reproducible.
    report = tmp_path / "report.json"
    features = "model=decoder_only attention.window=3 attention.softcap=2.0 pos=alibi kv_heads=1"
    # a pytest session forked from a server that imported torch once (OMP_NUM_THREADS=1 there): the clauses'
    # verdicts are the point, not the interpreter's start-up
    proc = run_pytest(["properties/model", "-q", "-p", "no:randomly", "--zoo", features, "--hypothesis-profile=ci",
                       "--report-json", str(report)], cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    rows = json.loads(report.read_text())
    passed = {row["clause"] for row in rows if row["status"] == "passed"}
    assert {"MODEL-CAUSAL", "MODEL-KV-CACHE", "MODEL-PADDING", "MODEL-BATCHED-DECODING"} <= passed, passed


def test_a_replacement_attention_without_the_options_still_builds():
    # window and softcap are passed only when set: an attention class written before they existed (the
    # docs/verify.md's examples/my_attention.py) keeps working, and asking it for a window is a clear error.
    target = "attention._target_=examples.my_attention.MyAttention"
    model = build_model([target, "d_model=32", "heads=2", "layers=1"])
    assert type(model.decoder.layers[0].self_attn).__name__ == "MyAttention"
    with pytest.raises(ConfigError, match=r"^attention.window=2: not a parameter of examples.my_attention.MyAttention"):
        build_model([target, "d_model=32", "heads=2", "layers=1", "attention.window=2"])
