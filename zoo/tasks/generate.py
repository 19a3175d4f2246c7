"""``task=generate``: decode with a trained model, greedily or by sampling, with the KV cache.

With ``use_cache=True`` the prompt is run once and then each new token alone, its keys and values kept in a
cache; with ``use_cache=False`` the whole prefix is run again at every step. Both compute the same function, so
they give the same tokens (tests/test_generate.py checks it). The cache is a ``StaticKVCache`` (zoo/nn/static_cache.py:
allocated once for the prompt and every new token, written in place, each step's positions and masks precomputed),
or, for a model with a plug-in attention or position module, the growing ``KVCache`` those were written against.
With ``block_size=N`` it is paged (``PagedKVCache``: blocks of N positions through a block table, as vLLM's
PagedAttention and flash_attn_with_kvcache's ``block_table``), which gives exactly the tokens of the contiguous
cache (tests/test_zoo_features.py).

``compile_mode`` (``task.compile``) compiles the decoding step (one new token per sequence, the static cache)
with ``torch.compile(fullgraph=True)``: ``reduce-overhead`` captures it in a CUDA graph, so a step is one graph
launch instead of a few hundred kernel launches; ``default`` and ``max-autotune`` are inductor's other modes;
``aot_eager`` traces the step without generating code (no speed-up: a check that it traces, which the CPU tests
use). The prompt runs eagerly. The compiled step gives the eager step's tokens (tests/test_static_cache.py).
"""
from __future__ import annotations

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from zoo.runtime.call_limit import bounded
from zoo.nn.cache import KVCache, PagedKVCache
from zoo.nn.static_cache import StaticKVCache, refusal
from zoo.config.builder import model_from_config
from zoo.config.sizing import check_fits
from zoo.config.task_schemas import COMPILE_MODES
from zoo.io.checkpoint import load_weights
from zoo.io.checkpoint_read import CheckpointError, check_config, read_state, resolve_checkpoint
from zoo.tasks.data import BOS, EOS, N_SPECIAL, PAD, SEP, task_from_config, symbols_to_text
from zoo.config.errors import ConfigError
from zoo.config.schema import ZooSchema, plugin_in, torch_dtype, validate

__all__ = ["generate", "pick_next", "generate_task", "saved_config", "decode_step", "compiled_step"]


def saved_config(state: dict, checkpoint, *, allow_plugins: bool = False, device: str | None = None) -> DictConfig:
    """The config a checkpoint was trained with, checked (what it may name, then every value) before use;
    ``device`` (the command line's) replaces the one it was trained on."""
    where = f"{checkpoint}/state.json"
    plain = check_config(state["config"], where, allow_plugins=allow_plugins)
    if device is not None:
        plain["device"] = device
    try:
        saved = OmegaConf.merge(OmegaConf.structured(ZooSchema), plain)
        validate(saved)
    except ConfigError as exc:
        raise CheckpointError(f"{where}: its config is not valid: {exc}") from None
    except Exception as exc:  # a key missing or of the wrong type
        key = getattr(exc, "full_key", None)
        raise CheckpointError(f"{where}: not a zoo config ({f'{key}: ' if key else ''}"
                              f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None
    return saved


def pick_next(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
              generator: torch.Generator | None = None) -> torch.Tensor:
    """Next token ids (b,) from last-position logits (b, vocab): argmax at temperature 0, else a sample."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    # Shifted so that the largest logit is 0 before the division: no temperature, however small, overflows to inf
    # (inf - inf is NaN); a temperature far below the logits' gaps samples the argmax, as the limit T -> 0 does.
    logits = logits.double()   # a float32 division would round a temperature below 1e-45 to 0 (0 / 0: NaN)
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(1)


def decode_step(model: nn.Module, tokens: torch.Tensor, cache: KVCache, memory: torch.Tensor | None,
                src_mask: torch.Tensor | None) -> torch.Tensor:
    """Last-position logits (b, vocab) of one cached call; the ids are the model's own picks, so not checked."""
    if memory is not None:
        return model.decode(tokens, memory, src_mask, cache=cache, check=False)[:, -1]
    return model(tokens, cache=cache, check=False)[:, -1]


def compiled_step(mode: str):
    """decode_step compiled whole with torch.compile in ``mode`` (one of COMPILE_MODES), shapes static."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile_mode={mode!r}: expected one of {', '.join(COMPILE_MODES)}")
    how = {"backend": mode} if mode == "aot_eager" else {"mode": mode}
    return torch.compile(decode_step, fullgraph=True, dynamic=False, **how)


@torch.no_grad()
def generate(model: nn.Module, prompt: torch.Tensor, max_new: int, *, src: torch.Tensor | None = None,
             src_mask: torch.Tensor | None = None, temperature: float = 0.0, top_k: int | None = None,
             use_cache: bool = True, generator: torch.Generator | None = None, eos_id: int | None = EOS,
             pad_id: int = PAD, block_size: int | None = None, static: bool = True,
             compile_mode: str | None = None, cache: StaticKVCache | None = None) -> torch.Tensor:
    """Up to max_new tokens (b, n) after prompt (b, l); a row is padded with pad_id after its eos_id.

    Decoder-only: prompt is the start of the sequence. Encoder-decoder: src (b, s) is encoded once and
    prompt starts the target (usually a BOS column). Prompts in one batch must have the same length.
    block_size: decode through a paged KV cache of blocks of this many positions (None: one contiguous cache).
    static: preallocate the cache (StaticKVCache) when the model's parts allow it; False: the growing KVCache.
    compile_mode: compile the decoding step (module docstring; COMPILE_MODES); it needs the static cache.
    cache: a StaticKVCache of this batch and capacity (prompt + max_new - 1) to use again, emptied first: a CUDA
    graph recorded on its buffers replays on them, where a new cache would have it recorded again.
    """
    if model.kind not in ("decoder_only", "encoder_decoder"):
        raise ValueError(f"generate needs a decoder_only or encoder_decoder model, got {model.kind}")
    if model.kind == "encoder_decoder" and src is None:
        raise ValueError("an encoder_decoder model needs src to generate from")
    # The last new token is returned, never fed back, so it needs no position of its own.
    if block_size is not None and not use_cache:
        raise ValueError("block_size pages the KV cache: it needs use_cache=True")
    if prompt.shape[1] + max_new - 1 > model.max_len:
        raise ValueError(f"prompt of {prompt.shape[1]} tokens + {max_new} new ones exceeds the model's "
                         f"max_len={model.max_len}")
    if max_new < 1:
        return prompt.new_empty(prompt.shape[0], 0)
    static = static and use_cache and block_size is None and refusal(model) is None
    if compile_mode is not None and not static:
        why = ("it decodes without a cache" if not use_cache else "the cache is paged" if block_size is not None
               else refusal(model) or "static=False")
        raise ValueError(f"compile_mode={compile_mode}: compiling needs the static KV cache, and {why}")
    step = decode_step if compile_mode is None else compiled_step(compile_mode)
    was_training = model.training
    model.eval()  # dropout would make every step, cached or not, a different function
    try:
        memory = model.encode(src, src_mask) if model.kind == "encoder_decoder" else None
        capacity = prompt.shape[1] + max_new - 1
        if cache is not None:
            if not static or (cache.batch, cache.capacity) != (prompt.shape[0], capacity):
                raise ValueError(f"cache: a StaticKVCache for batch {prompt.shape[0]} and capacity {capacity} "
                                 f"(prompt + max_new - 1) is needed, with the static cache enabled")
            cache.reset()
        elif static:
            cache = StaticKVCache.for_model(model, prompt.shape[0], capacity)
        elif use_cache:  # a paged cache reserves blocks for every position this call can reach, once
            cache = KVCache() if block_size is None else PagedKVCache(block_size=block_size, capacity=capacity)
        if compile_mode is not None and prompt.device.type == "cuda":
            cache.mark_static()
        sequence = prompt
        finished = torch.zeros(prompt.shape[0], dtype=torch.bool, device=prompt.device)
        new = []
        logits = (model.decode(prompt, memory, src_mask, cache=cache)[:, -1] if memory is not None else
                  model(prompt, cache=cache)[:, -1])  # the prompt, eagerly; its ids are checked
        for index in range(max_new):
            token = pick_next(logits, temperature, top_k, generator)
            token = token.masked_fill(finished, pad_id)
            new.append(token)
            if eos_id is not None:
                finished |= token == eos_id
                if bool(finished.all()):
                    break
            if index == max_new - 1:
                break
            if cache is None:
                sequence = torch.cat([sequence, token[:, None]], dim=1)
                logits = decode_step(model, sequence, None, memory, src_mask)
                continue
            if static:
                cache.prepare(1)  # outside a compiled step: it reads the Python length
            logits = step(model, token[:, None], cache, memory, src_mask)
        return torch.stack(new, dim=1) if new else prompt.new_empty(prompt.shape[0], 0)
    finally:
        model.train(was_training)


def _parse_prompt(text: str, vocab: int, max_len: int) -> torch.Tensor:
    try:
        symbols = [int(word) for word in text.split()]
    except ValueError:
        raise ConfigError(f"task.prompt={text}: expected symbols 0..{vocab - 1} separated by spaces") from None
    if not symbols or not all(0 <= s < vocab for s in symbols):
        raise ConfigError(f"task.prompt={text}: expected 1 to {max_len} symbols in 0..{vocab - 1}")
    if len(symbols) > max_len:
        raise ConfigError(f"task.prompt={text}: {len(symbols)} symbols, the model was trained on at most {max_len}")
    return torch.tensor([symbols]) + N_SPECIAL


def generate_task(cfg: DictConfig) -> None:
    """Decode held-out prompts (or task.prompt) with the model and data saved in task.checkpoint."""
    opts = cfg.task
    if not opts.checkpoint:
        raise ConfigError("task.checkpoint: required (a task=train out_dir or one of its step-NNNNNNN directories)")
    checkpoint = resolve_checkpoint(opts.checkpoint)
    state = read_state(checkpoint)
    # The checkpoint fixes model and data; the command line says where to run and how to decode. Its config is
    # checked before anything in it is imported: only the zoo's own classes and kernels, unless allow_plugins.
    saved = saved_config(state, checkpoint, allow_plugins=bool(cfg.get("allow_plugins", False)), device=cfg.device)
    check_fits(saved, device=cfg.device)
    plugin = plugin_in(saved)   # with allow_plugins: each call through it is bounded by call_timeout
    with bounded(plugin, "building the model"):
        model = model_from_config(saved, device=cfg.device, dtype=torch_dtype(saved.dtype))
    load_weights(model, checkpoint, state)
    model.eval()
    data = task_from_config(saved.data)
    if model.kind == "encoder_only":
        raise ConfigError(f"task=generate: {checkpoint} holds an encoder_only model, which labels tokens "
                          f"rather than generating them (use decoder_only or encoder_decoder)")
    if opts.prompt:
        x = _parse_prompt(opts.prompt, data.vocab, data.max_len)
        lengths = torch.tensor([x.shape[1]])
        x = torch.nn.functional.pad(x, (0, data.max_len - x.shape[1]), value=PAD)
    else:
        x, lengths = data.sample(opts.samples, "heldout", 0)
    expected = data.answer(x, lengths)
    why_not_static = refusal(model)
    if opts.compile and why_not_static:
        raise ConfigError(f"task.compile={opts.compile}: compiling needs the static KV cache, which this model "
                          f"cannot use: {why_not_static}")
    max_new = opts.max_new or data.max_len + 1
    generator = torch.Generator(device=cfg.device).manual_seed(opts.seed)
    outputs: list[torch.Tensor | None] = [None] * len(x)
    try:
        if model.kind == "encoder_decoder":
            src_mask = torch.arange(x.shape[1]) < lengths[:, None]
            prompt = torch.full((len(x), 1), BOS)
            with bounded(plugin, "decoding (task=generate)"):
                out = generate(model, prompt.to(cfg.device), max_new, src=x.to(cfg.device),
                               src_mask=src_mask.to(cfg.device), temperature=opts.temperature, top_k=opts.top_k,
                               use_cache=opts.cache, generator=generator, block_size=opts.block_size,
                               compile_mode=opts.compile)
            outputs = list(out.cpu())
        else:
            # Prompts of one length share a batch: BOS x SEP, with no padding for positions to shift.
            for n in lengths.unique().tolist():
                rows = (lengths == n).nonzero().squeeze(1)
                prompt = torch.cat([torch.full((len(rows), 1), BOS), x[rows, :n],
                                    torch.full((len(rows), 1), SEP)], dim=1)
                with bounded(plugin, "decoding (task=generate)"):
                    out = generate(model, prompt.to(cfg.device), max_new, temperature=opts.temperature,
                                   top_k=opts.top_k, use_cache=opts.cache, generator=generator,
                                   block_size=opts.block_size, compile_mode=opts.compile)
                for row, tokens in zip(rows.tolist(), out.cpu()):
                    outputs[row] = tokens
    except ValueError as exc:  # a prompt/max_new the model's positions cannot hold
        raise ConfigError(f"task.max_new={opts.max_new}: {exc}") from exc

    mode = "greedy" if opts.temperature == 0 else f"temperature {opts.temperature}, top_k {opts.top_k}"
    kind = ("without a KV cache" if not opts.cache else f"with a paged (blocks of {opts.block_size}) KV cache"
            if opts.block_size else f"with a growing KV cache ({why_not_static})" if why_not_static else
            "with a static KV cache" + (f", the step compiled ({opts.compile})" if opts.compile else ""))
    print(f"{model.kind} from {checkpoint} (step {state['step']}), data={data.name}, {mode}, {kind}")
    if opts.prompt and int(lengths[0]) < data.min_len:
        print(f"  (the prompt is shorter than any the model was trained on: {data.min_len}-{data.max_len} symbols)")
    right = 0
    for i, tokens in enumerate(outputs):
        want = expected[i][: int(lengths[i])].tolist() + [EOS]
        got = tokens.tolist()
        ok = got[: len(want)] == want
        right += ok
        print(f"  {symbols_to_text(x[i])}  ->  {symbols_to_text(got)}" + ("" if ok else
              f"   (expected {symbols_to_text(want)})"))
    print(f"exact match {right}/{len(outputs)}")
