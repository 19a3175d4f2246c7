"""Differential comparison of a zoo preset against an independent reference implementation.

    run_compare("gpt2_small", "hf")       Hugging Face GPT2LMHeadModel   vs DecoderOnly
    run_compare("bert_base", "hf")        Hugging Face BertModel         vs EncoderOnly
    run_compare("vaswani_base", "torch")  torch.nn.Transformer + front-end vs EncoderDecoder

The zoo model is built from the preset (conf/) at a reduced size; the reference is built with the
same geometry, given random weights (every parameter, biases and norm gains included, so that a
mis-mapped bias cannot hide behind a zero init), and its weights are converted into the zoo model.
Both run in eval mode on one random batch; forward hooks record every layer's output, and the table
gives the largest absolute difference per output at the real (unpadded) positions.

Tolerance model: each output is a chain of dot products whose rounding errors are roughly
independent, so one of length n errs by about u * sqrt(n) * |value| (u = eps/2, the unit
roundoff; Higham's probabilistic bound), and errors add along the ``depth`` sub-layers before it:

    bound = u * magnitude * depth * sqrt(width),   width = the longest inner dimension.

The same formula serves float32 and float64, so a float64 difference near 1e-15 confirms that the
float32 one is rounding and not a mapping error.
"""
from __future__ import annotations

import copy
import math
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Callable, Iterator

import torch
from torch import nn

from zoo import interop
from zoo.interop import Geometry, ConversionError
from zoo.io.weights import load_state_dict_checked

__all__ = ["REFERENCES", "error_bound", "randomize_", "run_compare", "compare", "format_table", "check_compare"]

REFERENCES = {"gpt2_small": "hf", "bert_base": "hf", "vaswani_base": "torch"}
DTYPES = {"float32": torch.float32, "float64": torch.float64}


def check_compare(preset: str | None, reference: str | None, task) -> None:
    """What `task=compare` needs, refused in one line (ConfigError) before anything is built: a preset with a
    reference implementation, that reference, and memory for both models at task.*'s sizes in float32 and float64
    (the zoo model and the reference in each: 24 bytes per parameter)."""
    from zoo.config.errors import ConfigError
    from zoo.config.sizing import ModelTooLarge
    from zoo.config.device_memory import available_memory

    if preset not in REFERENCES:
        raise ConfigError(f"preset={preset}: task=compare needs a preset with a reference implementation "
                          f"(allowed: {', '.join(REFERENCES)})")
    if reference is not None and reference != REFERENCES[preset]:
        raise ConfigError(f"reference={reference}: preset={preset} is compared with reference={REFERENCES[preset]}")
    d, layers, vocab = task.d_model, task.layers, task.vocab_size
    if vocab < 2:   # the inputs are ids 1 .. vocab_size - 1 (0 pads)
        raise ConfigError(f"task.vocab_size={vocab}: task=compare needs at least 2 token ids (0 pads, the inputs "
                          f"draw from 1 .. vocab_size - 1)")
    decoders = 2 if preset == "vaswani_base" else 1
    parameters = decoders * layers * (4 * d * d + 8 * d * d) + vocab * d + task.max_len * d
    free = available_memory("cpu")
    if free is not None and 24 * parameters > free[0]:
        raise ModelTooLarge(f"task.d_model={d}: the compared models need about {24 * parameters / 2**30:,.1f} GiB "
                          f"(both in float32 and float64), and {free[0] / 2**30:,.1f} GiB is available ({free[1]})")


def error_bound(dtype: torch.dtype, magnitude: float, depth: int, width: int) -> float:
    """Rounding-error bound of the module docstring for outputs of size ``magnitude``."""
    return torch.finfo(dtype).eps / 2 * magnitude * depth * math.sqrt(width)


def randomize_(module: nn.Module, seed: int = 0) -> nn.Module:
    """Give every parameter a distinct random value: matrices N(0, 1/fan_in) (unit-scale activations,
    attention far from uniform), vectors named *weight (norm gains) 1 + N(0, 0.1^2), other vectors
    (biases) N(0, 0.1^2). Drawn in float64 on the CPU, so every dtype gets the same numbers rounded."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():  # tied parameters are listed once
            noise = torch.randn(p.shape, generator=generator, dtype=torch.float64)
            if p.dim() > 1:
                value = noise / math.sqrt(p.shape[-1])
            elif name.endswith("weight"):
                value = 1.0 + 0.1 * noise
            else:
                value = 0.1 * noise
            p.copy_(value.to(p.device, p.dtype))
    return module


@dataclass
class _Row:
    name: str
    reference: Callable[[], torch.Tensor]  # read after the forward passes
    zoo: Callable[[], torch.Tensor]
    mask: torch.Tensor | None  # (b, l) True at real positions; None: no position axis
    depth: int


@contextmanager
def _recording(modules: dict[str, nn.Module]) -> Iterator[dict[str, torch.Tensor]]:
    """Forward hooks that keep each module's output (the first element when it returns a tuple)."""
    outputs: dict[str, torch.Tensor] = {}

    def hook(name):
        def keep(module, args, output):
            outputs[name] = output[0] if isinstance(output, (tuple, list)) else output
        return keep

    handles = [m.register_forward_hook(hook(name)) for name, m in modules.items()]
    try:
        yield outputs
    finally:
        for handle in handles:
            handle.remove()


def _batch(geometry: Geometry, batch: int, seq_len: int, padding: bool, generator: torch.Generator):
    tokens = torch.randint(1, geometry.vocab_size, (batch, seq_len), generator=generator)
    mask = torch.ones(batch, seq_len, dtype=torch.bool)
    if padding and batch > 1:  # right padding on the last row: a quarter of it (at least one token)
        mask[-1, seq_len - max(1, seq_len // 4):] = False
    return tokens, mask


# Each case: (geometry of the zoo model, float64 reference) -> reference builder, converter, runner.

def _gpt2_reference(g: Geometry) -> nn.Module:
    from transformers import GPT2LMHeadModel
    return GPT2LMHeadModel(interop.hf_gpt2_config(g))


def _bert_reference(g: Geometry) -> nn.Module:
    from transformers import BertModel
    return BertModel(interop.hf_bert_config(g))


def _torch_reference(g: Geometry) -> nn.Module:
    if not (g.family == "encoder_decoder" and g.norm == "layernorm" and g.pos == "sinusoidal" and g.embed_scale
            and g.share_embeddings and g.tie_head and g.kv_heads is None and not g.embed_norm
            and g.activation in ("relu", "gelu") and g.bias):
        raise ConversionError(f"nn.Transformer cannot express this geometry: {g}")
    return interop.TorchTransformerReference(g.vocab_size, g.d_model, g.heads, g.layers, g.d_ff, g.max_len,
                                             g.decoder_layers, activation=g.activation, layer_norm_eps=g.norm_eps,
                                             norm_first=g.norm_placement == "pre")


def _reference_geometry(preset: str, reference: nn.Module) -> Geometry:
    if preset == "gpt2_small":
        return interop.gpt2_geometry(reference.config)
    if preset == "bert_base":
        return interop.bert_geometry(reference.config)
    return interop.torch_transformer_geometry(reference.transformer, reference.vocab_size, reference.max_len)


def _convert(preset: str, reference: nn.Module, g: Geometry) -> dict[str, torch.Tensor]:
    if preset == "gpt2_small":
        return interop.gpt2_to_zoo(reference.state_dict(), g)
    if preset == "bert_base":
        return interop.bert_to_zoo(reference.state_dict(), g)
    return interop.torch_transformer_to_zoo(reference.transformer.state_dict(), g,
                                            reference.embedding.weight.detach())


def _run(preset: str, ref: nn.Module, zoo: nn.Module, g: Geometry, tokens, mask, types, target, target_mask):
    """Run both models under hooks; return the rows (name, reference, zoo, mask, depth) in order."""
    if preset == "gpt2_small":
        pairs = {"embeddings": (ref.transformer.drop, zoo.decoder.dropout, 1)}
        pairs.update({f"layer {i}": (ref.transformer.h[i], zoo.decoder.layers[i], 1 + 2 * (i + 1))
                      for i in range(g.layers)})
        pairs["final norm"] = (ref.transformer.ln_f, zoo.decoder.final_norm, 2 + 2 * g.layers)
        with _recording({k: v[0] for k, v in pairs.items()}) as r, _recording({k: v[1] for k, v in pairs.items()}) as z:
            r["logits"] = ref(input_ids=tokens, attention_mask=mask.long()).logits
            z["logits"] = zoo(tokens, mask=mask)
        depths = {k: v[2] for k, v in pairs.items()} | {"logits": 3 + 2 * g.layers}
        return [(k, r[k], z[k], mask, d) for k, d in depths.items()]
    if preset == "bert_base":
        pairs = {"embeddings": (ref.embeddings, zoo.encoder.dropout, 1)}
        pairs.update({f"layer {i}": (ref.encoder.layer[i], zoo.encoder.layers[i], 1 + 2 * (i + 1))
                      for i in range(g.layers)})
        with _recording({k: v[0] for k, v in pairs.items()}) as r, _recording({k: v[1] for k, v in pairs.items()}) as z:
            out = ref(input_ids=tokens, attention_mask=mask.long(), token_type_ids=types)
            hidden = zoo(tokens, mask=mask, token_types=types)
        rows = [(k, r[k], z[k], mask, v[2]) for k, v in pairs.items()]
        rows.append(("hidden states", out.last_hidden_state, hidden, mask, 1 + 2 * g.layers))
        return rows + [("pooler", out.pooler_output, zoo.pool(hidden), None, 2 + 2 * g.layers)]
    t = ref.transformer
    decoder_layers = g.layers if g.decoder_layers is None else g.decoder_layers
    enc_depth = 1 + 2 * g.layers + 1
    pairs = {f"encoder layer {i}": (t.encoder.layers[i], zoo.encoder.layers[i], mask, 1 + 2 * (i + 1))
             for i in range(g.layers)}
    pairs["encoder norm"] = (t.encoder.norm, zoo.encoder.final_norm, mask, enc_depth)
    pairs.update({f"decoder layer {i}": (t.decoder.layers[i], zoo.decoder.layers[i], target_mask,
                                         enc_depth + 1 + 3 * (i + 1)) for i in range(decoder_layers)})
    pairs["decoder norm"] = (t.decoder.norm, zoo.decoder.final_norm, target_mask, enc_depth + 2 + 3 * decoder_layers)
    with _recording({k: v[0] for k, v in pairs.items()}) as r, _recording({k: v[1] for k, v in pairs.items()}) as z:
        r["logits"] = ref(tokens, target, mask, target_mask)
        z["logits"] = zoo(tokens, target, mask, target_mask)
    rows = [("source embeddings", ref.embed(tokens), zoo.encoder.embed(tokens), mask, 1),
            ("target embeddings", ref.embed(target), zoo.decoder.embed(target), target_mask, 1)]
    rows += [(k, r[k], z[k], v[2], v[3]) for k, v in pairs.items()]
    return rows + [("logits", r["logits"], z["logits"], target_mask, enc_depth + 3 + 3 * decoder_layers)]


def _zoo_model(preset: str, sizes: dict, dtype: torch.dtype) -> nn.Module:
    from zoo.config.builder import build_model
    overrides = [f"preset={preset}"] + [f"{k}={v}" for k, v in sizes.items()] + ["dropout=0.0", "device=cpu"]
    return build_model(overrides, dtype=dtype).eval()


def _without_dropout(g: Geometry) -> Geometry:
    return replace(g, dropout=0.0, attention_dropout=0.0)


def run_compare(preset: str, reference: str | None = None, *, seed: int = 0, layers: int = 2, d_model: int = 64,
                heads: int = 4, vocab_size: int = 512, d_ff: int | None = None, max_len: int = 64, batch: int = 3,
                seq_len: int = 16, padding: bool = True, dtypes=("float32", "float64"),
                print_fn: Callable[[str], object] | None = print) -> dict:
    """Compare preset ``preset`` of the zoo, at a reduced size, with ``reference`` ('hf' or 'torch').

    Returns {"preset", "reference", "geometry", "rows": [{"output", "depth", per dtype: "<dtype>",
    "<dtype>_bound", "<dtype>_magnitude"}], "max_abs_diff": {dtype: x}, "ok": bool}; prints the table
    with ``print_fn`` (None: silent).
    """
    if preset not in REFERENCES:
        raise ValueError(f"preset={preset!r}: compare knows {sorted(REFERENCES)}")
    reference = REFERENCES[preset] if reference is None else reference
    if reference != REFERENCES[preset]:
        raise ValueError(f"reference={reference!r} for preset={preset!r}: expected {REFERENCES[preset]!r} "
                         f"({', '.join(f'{p}: {r}' for p, r in REFERENCES.items())})")
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown or not dtypes:
        raise ValueError(f"dtypes={list(dtypes)}: expected a non-empty subset of {sorted(DTYPES)}")
    if seq_len < 2 or seq_len > max_len:
        raise ValueError(f"seq_len={seq_len} must lie in [2, max_len={max_len}]")
    sizes = dict(layers=layers, d_model=d_model, heads=heads, d_ff=4 * d_model if d_ff is None else d_ff,
                 vocab_size=vocab_size, max_len=max_len)

    geometry = _without_dropout(interop.zoo_geometry(_zoo_model(preset, sizes, torch.float64)))
    builder = {"gpt2_small": _gpt2_reference, "bert_base": _bert_reference, "vaswani_base": _torch_reference}[preset]
    torch.manual_seed(seed)  # HF constructors draw their own init; randomize_ then overwrites all of it
    reference64 = randomize_(builder(geometry).to(torch.float64).eval(), seed)
    # The reference's own config must describe the zoo preset exactly: else the preset is not that model.
    seen = _without_dropout(_reference_geometry(preset, reference64))
    if seen != geometry:
        raise ConversionError(f"preset {preset} differs from its reference:\n  zoo       {geometry}\n"
                              f"  reference {seen}")

    generator = torch.Generator().manual_seed(seed)
    tokens, mask = _batch(geometry, batch, seq_len, padding, generator)
    target, target_mask = _batch(geometry, batch, max(2, seq_len - 3), padding, generator)
    types = torch.randint(0, max(1, geometry.type_vocab_size), (batch, seq_len), generator=generator)
    width = max(geometry.d_ff, geometry.d_model, seq_len)

    rows: dict[str, dict] = {}
    for name in dtypes:
        dtype = DTYPES[name]
        ref = copy.deepcopy(reference64).to(dtype)
        zoo = _zoo_model(preset, sizes, dtype)
        load_state_dict_checked(zoo, _convert(preset, ref, geometry), source=f"converted {reference} weights")
        with torch.no_grad():
            outputs = _run(preset, ref, zoo, geometry, tokens, mask, types, target, target_mask)
        for output, a, b, where, depth in outputs:
            if a.shape != b.shape:
                raise RuntimeError(f"{output}: reference shape {tuple(a.shape)} vs zoo {tuple(b.shape)}")
            a, b = (a, b) if where is None else (a[where], b[where])  # only real positions
            magnitude = a.abs().max().item()
            row = rows.setdefault(output, {"output": output, "depth": depth})
            row[name] = (a - b).abs().max().item()
            row[f"{name}_magnitude"] = magnitude
            row[f"{name}_bound"] = error_bound(dtype, magnitude, depth, width)
    table = list(rows.values())
    result = {"preset": preset, "reference": reference, "geometry": geometry, "rows": table,
              "max_abs_diff": {d: max(r[d] for r in table) for d in dtypes},
              "ok": all(r[d] <= r[f"{d}_bound"] for r in table for d in dtypes)}
    if print_fn is not None:
        print_fn(format_table(result))
    return result


def compare(reference: str, preset: str, **kwargs) -> dict:
    """``run_compare`` with the arguments in CLI order and no printing unless print_fn is given."""
    kwargs.setdefault("print_fn", None)
    return run_compare(preset, reference, **kwargs)


def format_table(result: dict) -> str:
    g = result["geometry"]
    dtypes = list(result["max_abs_diff"])
    head = (f"{result['preset']} vs {result['reference']}: {g.family}, layers={g.layers}, d_model={g.d_model}, "
            f"heads={g.heads}, d_ff={g.d_ff}, vocab={g.vocab_size}; max |diff| at real positions, "
            f"bound = eps/2 * max|ref| * depth * sqrt(width)")
    columns = ["output", "max|ref|"] + [c for d in dtypes for c in (d, "bound")]
    lines = [[r["output"], f"{r[dtypes[-1] + '_magnitude']:.3g}"]
             + [c for d in dtypes for c in (f"{r[d]:.2e}", f"{r[d + '_bound']:.1e}")] for r in result["rows"]]
    widths = [max(len(str(x)) for x in col) for col in zip(columns, *lines)]
    fmt = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    body = [fmt(columns), fmt(["-" * w for w in widths])] + [fmt(line) for line in lines]
    verdict = "all within bound" if result["ok"] else "SOME DIFFERENCES EXCEED THE BOUND"
    return "\n".join([head, *body, verdict])
