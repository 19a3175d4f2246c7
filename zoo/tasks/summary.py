"""The model card: key configuration, parameters per part (tied weights counted once), a timed forward pass."""
from __future__ import annotations

import time

import torch
from omegaconf import DictConfig
from torch import nn

__all__ = ["parameters_by_part", "model_card", "timed_forward", "random_inputs"]

# The first attribute name on a parameter's path that says which part it belongs to.
_PART_OF = {
    "self_attn": "attention", "cross_attn": "attention",
    "ffn": "ffn",
    "norm": "norms", "final_norm": "norms", "embed_norm": "norms",
    "embedding": "embeddings", "pos": "embeddings", "token_types": "embeddings",
    "lm_head": "head", "pooler": "head", "head": "head",
}
PART_ORDER = ("embeddings", "attention", "ffn", "norms", "head", "other")


def parameters_by_part(model: nn.Module) -> dict[str, int]:
    """Parameter counts per part; named_parameters() yields a shared (tied) tensor once, under its first name."""
    counts = dict.fromkeys(PART_ORDER, 0)
    for name, parameter in model.named_parameters():
        part = next((_PART_OF[p] for p in name.split(".") if p in _PART_OF), "other")
        counts[part] += parameter.numel()
    return counts


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if n < 1024 or unit == "EiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return ""


def _short(target: str) -> str:
    return target.rsplit(".", 1)[-1]


def model_card(cfg: DictConfig, model: nn.Module) -> str:
    """The card; the precision line names the device the model was built on (meta: nothing allocated)."""
    built_on = next((t.device for t in (*model.parameters(), *model.buffers())), None)
    where = str(built_on) if built_on is not None else str(cfg.device)
    if where == "meta":
        where = "meta (shapes only, nothing allocated)"
    kv = cfg.kv_heads if cfg.kv_heads is not None else cfg.heads
    attention = f"{_short(cfg.attention._target_)}(kernel={cfg.attention.get('kernel', '?')})"
    ffn = f"{_short(cfg.ffn._target_)}({cfg.ffn.get('activation', '')})"
    lines = [
        f"model      {_short(cfg.model._target_)}  ({cfg.model._target_})",
        f"sizes      d_model={cfg.d_model} heads={cfg.heads} kv_heads={kv} layers={cfg.layers} "
        f"d_ff={cfg.d_ff} vocab_size={cfg.vocab_size} max_len={cfg.max_len} dropout={cfg.dropout}",
        f"parts      attention={attention} ffn={ffn} norm={_short(cfg.norm._target_)} "
        f"({cfg.norm_placement}-norm) pos={_short(cfg.pos._target_)}",
        f"precision  {cfg.dtype} on {where}",
        "",
        f"{'part':<12}{'parameters':>14}",
    ]
    counts = parameters_by_part(model)
    for part in PART_ORDER:
        if counts[part] or part != "other":
            lines.append(f"{part:<12}{counts[part]:>14,}")
    total = sum(counts.values())
    lines.append(f"{'total':<12}{total:>14,}")
    lines.append(f"{'w/o embed.':<12}{total - counts['embeddings']:>14,}")
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    lines.append(f"{'memory':<12}{_bytes(weights + buffers):>14} weights and buffers in {cfg.dtype} "
                 f"(training: about {_bytes(4 * weights + buffers)} with gradients and AdamW moments)")
    tied = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)
            and any(module.weight is e.weight for e in model.modules() if isinstance(e, nn.Embedding))]
    if tied:
        lines.append(f"(tied to the token embedding and counted once: {', '.join(tied)})")
    return "\n".join(lines)


def random_inputs(model: nn.Module, batch: int, seq_len: int, *, generator: torch.Generator,
                  device=None) -> tuple[torch.Tensor, ...]:
    """Token batches the model's forward takes: (tokens,) or (src, tgt)."""
    def tokens() -> torch.Tensor:
        return torch.randint(0, model.vocab_size, (batch, seq_len), generator=generator).to(device)
    return (tokens(), tokens()) if model.kind == "encoder_decoder" else (tokens(),)


def timed_forward(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, float]:
    """One eval-mode forward pass without gradients, and its wall time in seconds."""
    model.eval()
    with torch.no_grad():
        start = time.perf_counter()
        out = model(*inputs)
        if out.device.type == "cuda":
            torch.cuda.synchronize(out.device)
        return out, time.perf_counter() - start
