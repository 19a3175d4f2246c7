"""The static KV cache (zoo/nn/static_cache.py), the compiled decoding step (zoo/tasks/generate.py) and the
device-independent initial weights of task=train (zoo/tasks/train.py: seeded_model)."""
from __future__ import annotations

import pytest
import torch
import torch._dynamo.utils
from torch import nn

import zoo.tasks.train as train_module
from zoo.config.builder import build_model
from zoo.nn.attention import MultiHeadAttention
from zoo.nn.cache import KVCache
from zoo.nn.static_cache import StaticKVCache, refusal
from zoo.tasks.generate import generate
from zoo.tasks.train import fit_config_to_data, seeded_model

from training import train_config

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = ["d_model=16", "heads=4", "layers=2", "d_ff=32", "vocab_size=32", "max_len=24"]


def tiny(family: str, *extra: str, dtype: str = "float64") -> nn.Module:
    torch.manual_seed(0)
    return build_model([f"model={family}", *TINY, f"dtype={dtype}", *extra]).eval()


def batch(family: str, rows: int, length: int, real: tuple[int, ...] | None = None):
    """Tokens (rows, length), their mask left-padded to the real lengths, and a source for an encoder-decoder."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(1, 32, (rows, length), generator=g)
    mask = None
    if real is not None:
        mask = torch.arange(length)[None, :] >= length - torch.tensor(real)[:, None]
        tokens = tokens.masked_fill(~mask, 0)
    src = torch.randint(1, 32, (rows, 7), generator=g) if family == "encoder_decoder" else None
    return tokens, mask, src


# Each part of the cache path once: grouped-query heads and a sliding window with rotary positions, ALiBi's bias
# over the slots with soft-capping, absolute positions, cross-attention's kept keys, SDPA's kernel in bfloat16.
CASES = {
    "rotary-gqa-window": ("decoder_only", ("pos=rotary", "kv_heads=2", "attention.window=3")),
    "alibi-softcap": ("decoder_only", ("pos=alibi", "attention.softcap=5.0")),
    "learned": ("decoder_only", ("pos=learned",)),
    "encoder-decoder": ("encoder_decoder", ("pos=sinusoidal",)),
    "torch-kernel-bfloat16": ("decoder_only", ("pos=rotary", "attention=torch")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_static_cache_computes_the_growing_caches_logits_in_preallocated_slots(case):
    """A prefill, chunks and one-token steps of a left-padded batch of mixed lengths: the logits of KVCache, bit
    for bit (an eager call attends to the written slots, views of the preallocated buffers: the same sums)."""
    family, extra = CASES[case]
    model = tiny(family, *extra, dtype="bfloat16" if "bfloat16" in case else "float64")
    # SDPA's math path gives a row with no admissible key NaN where the zoo's kernel gives 0: no padding there.
    real = None if case.startswith("torch-kernel") else (12, 7, 4)
    tokens, mask, src = batch(family, 3, 12, real)
    memory = model.encode(src) if src is not None else None
    static, growing = StaticKVCache.for_model(model, 3, 12), KVCache()
    buffers = [t.data_ptr() for t in (*static.keys.values(), *static.values.values())]
    with torch.no_grad():
        for start, end in zip([0, 5, 8, 9, 10, 11], [5, 8, 9, 10, 11, 12]):
            chunk, seen = tokens[:, start:end], None if mask is None else mask[:, :end]
            if memory is not None:
                a, b = (model.decode(chunk, memory, None, seen, cache=c) for c in (static, growing))
            else:
                a, b = (model(chunk, seen, cache=c) for c in (static, growing))
            assert torch.equal(a, b), f"positions {start}..{end - 1}: {(a - b).abs().max():.1e}"
    assert static.length == growing.length == 12
    assert [t.data_ptr() for t in (*static.keys.values(), *static.values.values())] == buffers  # written in place
    assert all(t.shape == (3, model.decoder.layers[0].self_attn.kv_heads, 12, 4) for t in static.keys.values())
    if memory is not None:
        assert len(static.cross_kv) == len(model.decoder.layers)  # projected once, at the first call


def test_a_static_cache_serves_another_generation_in_the_same_buffers():
    """generate(cache=...) empties and reuses a cache (the addresses a CUDA graph was recorded on), cross-attention
    keys included: the tokens of a fresh cache."""
    model = tiny("encoder_decoder", dtype="float32")
    prompt, _, src = batch("encoder_decoder", 2, 1)
    cache = StaticKVCache.for_model(model, 2, 6)
    first = generate(model, prompt, 6, src=src, eos_id=None, cache=cache)
    buffers = [t.data_ptr() for t in (*cache.keys.values(), *(t for kv in cache.cross_kv.values() for t in kv))]
    other = src.flip(0)
    again = generate(model, prompt, 6, src=other, eos_id=None, cache=cache)
    assert torch.equal(first, generate(model, prompt, 6, src=src, eos_id=None))
    assert torch.equal(again, generate(model, prompt, 6, src=other, eos_id=None))
    assert [t.data_ptr() for t in (*cache.keys.values(), *(t for kv in cache.cross_kv.values() for t in kv))] == buffers
    with pytest.raises(ValueError, match="a StaticKVCache for batch 2 and capacity 7"):
        generate(model, prompt, 7, src=src, cache=cache)


def test_static_cache_refuses_what_it_cannot_hold_in_one_line():
    model = tiny("decoder_only")
    cache = StaticKVCache.for_model(model, 1, 4)
    with torch.no_grad():
        model(torch.ones(1, 3, dtype=torch.long), cache=cache)
        with pytest.raises(ValueError, match=r"positions 3\.\.4 beyond its capacity of 4"):
            model(torch.ones(1, 2, dtype=torch.long), cache=cache)
        with pytest.raises(ValueError, match="the mask covers 2 positions; this call reaches 3"):
            model(torch.ones(1, 3, dtype=torch.long), torch.ones(1, 2, dtype=torch.bool),
                  cache=StaticKVCache.for_model(model, 1, 4))
    with pytest.raises(ValueError, match="capacity=25 positions: expected 1 to the model's max_len=24"):
        StaticKVCache.for_model(model, 1, 25)
    with pytest.raises(ValueError, match="encoder_only model does not decode"):
        StaticKVCache.for_model(tiny("encoder_only"), 1, 4)


class PluginAttention(MultiHeadAttention):
    """A user's attention written against the KVCache contract (cache.length, extend returning every position)."""

    def forward(self, x, memory=None, **kwargs):
        return super().forward(x, memory, **kwargs)


def test_a_plugin_attention_decodes_with_the_growing_cache_and_cannot_be_compiled():
    model = tiny("decoder_only", "attention._target_=test_static_cache.PluginAttention")
    assert "PluginAttention is not the zoo's MultiHeadAttention" in refusal(model)
    prompt = batch("decoder_only", 2, 3)[0]
    assert torch.equal(generate(model, prompt, 6, eos_id=None), generate(model, prompt, 6, eos_id=None,
                                                                          use_cache=False))
    with pytest.raises(ValueError, match="compiling needs the static KV cache, and attention PluginAttention"):
        generate(model, prompt, 6, compile_mode="aot_eager")


@pytest.mark.parametrize("family", ["decoder_only", "encoder_decoder"])
def test_the_compiled_decoding_step_gives_the_eager_steps_tokens_greedy_and_sampled(family):
    """torch.compile(fullgraph=True) of the step, with aot_eager (the graph, no code generation: seconds on a
    CPU), float32: the tokens of the eager static cache, greedy and sampled, from one graph compiled once."""
    model = tiny(family, "pos=rotary", "layers=1", dtype="float32")
    prompt, _, src = batch(family, 2, 3)
    kw = {} if src is None else {"src": src, "src_mask": torch.ones_like(src, dtype=torch.bool)}
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    for sampling in ({}, {"temperature": 1.0, "top_k": 8}):
        runs = [generate(model, prompt, 12, eos_id=None, compile_mode=mode,
                         generator=torch.Generator().manual_seed(5), **sampling, **kw) for mode in (None, "aot_eager")]
        assert runs[0].shape == (2, 12) and torch.equal(*runs), sampling
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1  # no recompilation from step to step
    with pytest.raises(ValueError, match="compile_mode='fast': expected one of reduce-overhead"):
        generate(model, prompt, 4, compile_mode="fast", **kw)
    with pytest.raises(ValueError, match="compiling needs the static KV cache, and the cache is paged"):
        generate(model, prompt, 4, compile_mode="aot_eager", block_size=4, **kw)


def test_initial_weights_are_drawn_on_the_cpu_whatever_the_device(tmp_path, monkeypatch):
    """The recipes' initial weights come from the CPU generator, then move: the same on every device (a CUDA
    generator seeded alike draws other numbers). Here the device is meta, which has no generator of its own."""
    cfg, data = fit_config_to_data(train_config(tmp_path, "seed=3"))
    built_on, build = [], train_module.model_from_config
    monkeypatch.setattr(train_module, "model_from_config",
                        lambda cfg, device=None, **kw: built_on.append(device) or build(cfg, device=device, **kw))
    on_cpu = seeded_model(cfg).state_dict()
    assert all(torch.equal(a, b) for a, b in zip(on_cpu.values(), seeded_model(cfg).state_dict().values()))
    cfg.device = "meta"
    moved = seeded_model(cfg)
    assert built_on == ["cpu"] * 3 and {p.device.type for p in moved.parameters()} == {"meta"}
    # The data streams are CPU draws already: a batch is a function of (seed, stream, index).
    first, again = data.batch("decoder_only", 4, "train", 7), data.batch("decoder_only", 4, "train", 7)
    assert all(t.device.type == "cpu" and torch.equal(t, again[k]) for k, t in first.items())
