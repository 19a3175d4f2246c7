"""Greedy decoding with a KVCache against recomputing the whole prefix at every step."""
from __future__ import annotations

import gc

import torch

from bench.common import interleaved
from bench.models import overrides
from zoo.config.builder import build_model
from zoo.nn.attention import KVCache


def generate_cached(model, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    cache = KVCache()
    token = model(prompt, cache=cache)[:, -1].argmax(-1, keepdim=True)
    out = [token]
    for _ in range(new_tokens - 1):
        token = model(token, cache=cache)[:, -1].argmax(-1, keepdim=True)
        out.append(token)
    return torch.cat(out, dim=1)


def generate_recompute(model, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    sequence = prompt
    for _ in range(new_tokens):
        token = model(sequence)[:, -1].argmax(-1, keepdim=True)
        sequence = torch.cat([sequence, token], dim=1)
    return sequence[:, prompt.shape[1]:]


def bench_decode(args, device) -> list[dict]:
    cells = []
    for dtype in args.dtypes:
        torch.manual_seed(0)
        model = build_model(overrides("decoder_only", args, "attention=torch"), device=device, dtype=dtype).eval()
        if model.max_len < args.prompt + args.new_tokens:
            raise ValueError(f"max_len={model.max_len} < prompt {args.prompt} + {args.new_tokens} new tokens")
        prompt = torch.randint(1, model.vocab_size, (args.decode_batch, args.prompt), device=device)
        results = {}

        def fn(name, generate, n, model=model, prompt=prompt, results=results):
            def run():
                with torch.inference_mode():
                    results[name] = generate(model, prompt, n)
            return run
        for warm in (fn("cached", generate_cached, 8), fn("recompute", generate_recompute, 8)):
            warm()
        fns = {"cached": fn("cached", generate_cached, args.new_tokens),
               "recompute": fn("recompute", generate_recompute, args.new_tokens)}
        out = interleaved(fns, device, warmup=0, min_repeats=args.timing["min_repeats"], max_repeats=5,
                          budget_s=args.timing["budget_s"], clock=args.clock)
        s = out["seconds"]
        cell = {"model": "decoder_only (gpt2_small geometry)", "layers": args.layers, "backend": "torch",
                "dtype": str(dtype).removeprefix("torch."), "batch": args.decode_batch, "prompt": args.prompt,
                "new_tokens": args.new_tokens, "repeats": out["repeats"], "seconds": s,
                "tokens_per_s": {k: args.decode_batch * args.new_tokens / v for k, v in s.items()},
                "speedup": s["recompute"] / s["cached"],
                "same_tokens": bool(torch.equal(results["cached"], results["recompute"])),
                "samples": out["samples"]}
        cells.append(cell)
        print(f"decode {cell['dtype']:<8} {args.new_tokens} tokens: cached {s['cached']:.2f} s, "
              f"recompute {s['recompute']:.2f} s, speedup x{cell['speedup']:.1f}, "
              f"same tokens: {cell['same_tokens']}", flush=True)
        del model, fn, fns, warm  # the closures hold the model too
        gc.collect()
    return cells
