"""Forward and forward+backward tokens/s of the three families against their references."""
from __future__ import annotations

import gc

import torch

from bench.common import BACKENDS, FAMILIES, TOY, cell_timing, forward_flops, interleaved, out_of_time
from bench.references import REFERENCE_NAMES, build_reference
from zoo.config.builder import build_model
from zoo.config.composition import compose_config


def overrides(family: str, args, *extra: str) -> list[str]:
    return [f"preset={FAMILIES[family]}", f"layers={args.layers}", "dropout=0", *(TOY if args.toy else []), *extra]


def count_parameters(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())  # a tied tensor is yielded once


def model_inputs(family: str, vocab_size: int, batch: int, length: int, device) -> tuple:
    tokens = lambda: torch.randint(1, vocab_size, (batch, length), device=device)
    return (tokens(), tokens()) if family == "encoder_decoder" else (tokens(),)


def zoo_call(family: str, model):
    if family == "encoder_only":  # hidden states and BERT's pooler, as BertModel returns both
        def call(tokens):
            h = model(tokens)
            return [h, model.pool(h)]
        return call
    return lambda *inputs: [model(*inputs)]


def reference_call(family: str, model):
    if family == "decoder_only":
        return lambda tokens: [model(input_ids=tokens).logits]
    if family == "encoder_only":
        def call(tokens):
            o = model(input_ids=tokens)
            return [o.last_hidden_state, o.pooler_output]
        return call
    return lambda src, tgt: [model(src, tgt)]


def forward_fn(model, call, inputs):
    def run():
        with torch.inference_mode():
            call(*inputs)
    return run


def training_fn(model, call, inputs):
    def run():
        sum(out.sum() for out in call(*inputs)).backward()
        model.zero_grad(set_to_none=True)
    return run


def bench_models(args, device, matmul: dict) -> list[dict]:
    cells = []
    timing = cell_timing(args, "models", len(args.families) * len(args.dtypes) * len(args.lengths) * 2)
    for family in args.families:
        cfg = compose_config(overrides(family, args))
        for dtype in args.dtypes:
            if out_of_time(args):
                print(f"models: --time-limit reached, {family} {dtype} and the cells after it not measured",
                      flush=True)
                return cells
            dtype_name = str(dtype).removeprefix("torch.")
            torch.manual_seed(0)
            models = {f"zoo_{b}": build_model(overrides(family, args, f"attention={b}"), device=device, dtype=dtype)
                      for b in BACKENDS}
            models["reference"] = build_reference(family, cfg, device=device, dtype=dtype)
            counts = {name: count_parameters(m) for name, m in models.items()}
            if len(set(counts.values())) != 1:
                raise RuntimeError(f"{family}: parameter counts differ, geometry is not identical: {counts}")
            calls = {name: (reference_call if name == "reference" else zoo_call)(family, m)
                     for name, m in models.items()}
            for length in args.lengths:
                inputs = model_inputs(family, cfg.vocab_size, args.batch, length, device)
                tokens = sum(t.numel() for t in inputs)
                flops = forward_flops(family, batch=args.batch, seq_len=length, d_model=cfg.d_model,
                                      d_ff=cfg.d_ff, vocab_size=cfg.vocab_size, layers=cfg.layers,
                                      pooler=family == "encoder_only")
                for mode, make, train in (("forward", forward_fn, False), ("forward+backward", training_fn, True)):
                    for m in models.values():
                        m.train(train)
                    fns = {name: make(models[name], calls[name], inputs)
                           for name in ("reference", "zoo_torch", "zoo_math")}
                    out = interleaved(fns, device, **timing)
                    seconds = out["seconds"]
                    cell = {"family": family, "reference": REFERENCE_NAMES[family], "seq_len": length,
                            "batch": args.batch, "dtype": dtype_name, "mode": mode, "tokens_per_call": tokens,
                            "parameters": counts["reference"], "repeats": out["repeats"],
                            "calls_per_sample": out["calls_per_sample"], "seconds": seconds,
                            "tokens_per_s": {k: tokens / s for k, s in seconds.items()},
                            "ratio": {k: seconds["reference"] / seconds[k] for k in ("zoo_torch", "zoo_math")},
                            "samples": out["samples"]}
                    if mode == "forward":
                        cell["flops_per_call"] = flops
                        cell["flops_per_s"] = {k: flops / s for k, s in seconds.items()}
                        peak = matmul[dtype_name]["flops_per_s"]
                        cell["matmul_utilization"] = {k: flops / s / peak for k, s in seconds.items()}
                    cells.append(cell)
                    print(format_model_row(cell), flush=True)
            del models, calls, fns
            gc.collect()
    return cells


def format_model_row(c: dict) -> str:
    t = c["tokens_per_s"]
    util = c.get("matmul_utilization")
    extra = f"  util torch {util['zoo_torch']:.0%} ref {util['reference']:.0%}" if util else ""
    return (f"{c['family']:<16}{c['seq_len']:>5} {c['dtype']:<9}{c['mode']:<17}{t['reference']:>10,.0f}"
            f"{t['zoo_torch']:>10,.0f} x{c['ratio']['zoo_torch']:<6.2f}{t['zoo_math']:>10,.0f} "
            f"x{c['ratio']['zoo_math']:<6.2f}{c['repeats']:>3}{extra}")


MODEL_HEADER = (f"{'family':<16}{'L':>5} {'dtype':<9}{'mode':<17}{'ref tok/s':>10}{'torch':>10} {'ratio':<7}"
                f"{'math':>10} {'ratio':<7}{'n':>3}  forward FLOP/s / matmul FLOP/s")
