"""Pictures for the verification report: attention weights, the sinusoidal table, score variance vs d_k.

Plotting is optional (``pip install .[plots]``); ``plots_available()`` says whether matplotlib imports.
Each figure is written atomically (a temporary file renamed into place).
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from torch import nn

from zoo.io.atomic import replacing
from zoo.nn.attention import MultiHeadAttention
from zoo.nn.kernel import torch_attention
from zoo.nn.positional import sinusoidal_table

__all__ = ["plots_available", "attention_maps", "score_variance", "write_figures"]

PLOTS_HINT = "pictures need matplotlib: pip install 'transformer-zoo[plots]' (or pip install matplotlib)"


def plots_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


@contextlib.contextmanager
def _recording_weights(model: nn.Module):
    """Make every zoo attention layer also record its weights, read off its own kernel with V = identity
    (attention is linear in V, so the output is then the weight matrix)."""
    records: dict[str, torch.Tensor] = {}
    patched = []
    for name, module in model.named_modules():
        if not isinstance(module, MultiHeadAttention):
            continue
        kernel = module.kernel

        def recording(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
                      _kernel=kernel, _name=name):
            s = k.shape[-2]
            identity = torch.eye(s, dtype=v.dtype, device=v.device).expand(*v.shape[:-2], s, s)
            records[_name] = _kernel(q, k, identity, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                                     enable_gqa=enable_gqa).detach()
            return _kernel(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                           enable_gqa=enable_gqa)

        module.kernel = recording
        patched.append((module, kernel))
    try:
        yield records
    finally:
        for module, kernel in patched:
            module.kernel = kernel


def attention_maps(model: nn.Module, *, length: int = 12, padded: int = 3, seed: int = 0) -> dict[str, torch.Tensor]:
    """Weights (l, s) of head 0 in the first layer of each attention type, for one sample whose last
    ``padded`` positions are padding: the causal triangle and the masked padding columns show."""
    generator = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    length = min(length, model.max_len)
    tokens = torch.randint(1, model.vocab_size, (1, length), generator=generator).to(device)
    mask = torch.ones(1, length, dtype=torch.bool, device=device)
    mask[:, length - padded:] = False
    model.eval()
    with torch.no_grad(), _recording_weights(model) as records:
        if model.kind == "encoder_decoder":
            model(tokens, tokens, mask, mask)
        else:
            model(tokens, mask)
    wanted = {"encoder.layers.0.self_attn": "encoder self-attention",
              "decoder.layers.0.self_attn": "decoder self-attention (causal)",
              "decoder.layers.0.cross_attn": "decoder cross-attention"}
    return {title: records[name][0, 0].float().cpu() for name, title in wanted.items() if name in records}


def score_variance(kernel, d_ks=(4, 8, 16, 32, 64, 128, 256, 512), queries: int = 64, keys: int = 256,
                   seed: int = 0):
    """Var(q·k) before scaling, and the variance of the scores the kernel itself applied, for q, k with
    i.i.d. N(0, 1) entries. The applied scores are read off the kernel's weights (V = identity): within a
    row, log w_j = score_j - logsumexp, so the centred log-weights are the centred scores."""
    generator = torch.Generator().manual_seed(seed)
    before, after = [], []
    for d in d_ks:
        q = torch.randn(1, queries, d, generator=generator, dtype=torch.float64)
        k = torch.randn(1, keys, d, generator=generator, dtype=torch.float64)
        before.append((q @ k.transpose(-1, -2)).var().item())
        weights = kernel(q.float(), k.float(), torch.eye(keys).expand(1, keys, keys)).double()
        log_weights = weights.clamp_min(1e-300).log()
        centred = log_weights - log_weights.mean(-1, keepdim=True)
        after.append(centred.square().sum(-1).div(keys - 1).mean().item())
    return list(d_ks), before, after


def _save(figure, path: Path) -> None:
    with replacing(path) as temporary:
        figure.savefig(temporary, format="png", dpi=110, bbox_inches="tight")


def write_figures(model: nn.Module, d_model: int, out_dir: Path, *,
                  notes: dict[str, str] | None = None) -> dict[str, Path]:
    """attention.png, positional.png, score_variance.png in out_dir; returns {title: path}.

    With `notes` (a dict), a picture that cannot be drawn (a plugged kernel that raises on a mask, say) is
    recorded there as {title: reason} and the others are still drawn; without, the error propagates."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: dict[str, Path] = {}
    for title, name, draw in (("Attention weights of each layer type", "attention.png", _attention_figure),
                              ("Sinusoidal positional encoding", "positional.png", _positional_figure),
                              ("Score variance against d_k", "score_variance.png", _variance_figure)):
        figure = None
        try:
            figure = draw(plt, model, d_model)
            if figure is None:
                continue
            _save(figure, out_dir / name)
            written[title] = out_dir / name
        except Exception as exc:
            if notes is None:
                raise
            message = str(exc).splitlines()[0] if str(exc) else ""
            notes[title] = f"{type(exc).__name__}: {message}"[:300]
        finally:
            if figure is not None:
                plt.close(figure)
    return written


def _attention_figure(plt, model: nn.Module, d_model: int):
    maps = attention_maps(model)
    if not maps:
        return None
    figure, axes = plt.subplots(1, len(maps), figsize=(5 * len(maps), 4.4), squeeze=False, layout="constrained")
    for axis, (title, weights) in zip(axes[0], maps.items()):
        image = axis.imshow(weights.numpy(), cmap="viridis", vmin=0, vmax=float(weights.max()))
        axis.set_title(title, fontsize=10)
        axis.set_xlabel("key position (last 3 are padding)")
        axis.set_ylabel("query position")
        figure.colorbar(image, ax=axis, fraction=0.046)
    figure.suptitle("Attention weights, layer 0, head 0")
    return figure


def _positional_figure(plt, model: nn.Module, d_model: int):
    table = sinusoidal_table(min(model.max_len, 128), d_model)
    figure, axis = plt.subplots(figsize=(7, 4))
    image = axis.imshow(table.numpy(), aspect="auto", cmap="RdBu", vmin=-1, vmax=1)
    axis.set_xlabel("feature i")
    axis.set_ylabel("position")
    axis.set_title(f"Sinusoidal positional encoding (d_model = {d_model})")
    figure.colorbar(image, ax=axis)
    return figure


def _variance_figure(plt, model: nn.Module, d_model: int):
    attention = next((m for m in model.modules() if isinstance(m, MultiHeadAttention)), None)
    d_ks, before, after = score_variance(attention.kernel if attention is not None else torch_attention)
    figure, axis = plt.subplots(figsize=(6, 4))
    axis.loglog(d_ks, d_ks, "k--", label="Var = d_k")
    axis.loglog(d_ks, [1.0] * len(d_ks), "k:", label="Var = 1")
    axis.loglog(d_ks, before, "o", label="q·k (measured)")
    axis.loglog(d_ks, after, "s", label="scores the kernel applied (from its weights)")
    axis.set_xlabel("d_k")
    axis.set_ylabel("variance of the score")
    axis.set_title("Score variance before and after scaling (q, k ~ N(0, 1))")
    axis.legend()
    return figure
